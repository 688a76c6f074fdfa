"""The README's references are generated from the code and must not go stale; the shipped
sample configuration must be valid."""

from __future__ import annotations

import re
from pathlib import Path

from nodescope import assembly, config, docgen
from tests.conftest import REPO


def test_readme_generated_sections_are_current() -> None:
    text = (REPO / "README.md").read_text()
    assert docgen.refresh(text) == text, (
        "README.md is stale: run .venv/bin/python -m nodescope.docgen --write README.md"
    )


def test_readme_opens_with_the_two_setup_commands() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    fence = lines.index("```sh")
    commands = lines[fence + 1 : lines.index("```", fence + 1)]
    assert [c.split("#")[0].split() for c in commands] == [
        ["bash", "scripts/run.sh"],
        ["bash", "scripts/test.sh"],
    ]
    assert "scripts/test.sh" in (REPO / ".ci" / "run").read_text()
    # Root is needed; started as a user, each script runs itself again under sudo.
    for script in ("run.sh", "test.sh"):
        text = (REPO / "scripts" / script).read_text()
        assert 'if [ "$(id -u)" -ne 0 ]; then exec sudo bash "$0" "$@"; fi' in text


def test_every_metric_is_in_the_readme() -> None:
    from nodescope_exporters.catalog import CATALOG
    from nodescope_exporters.prometheus import load_areas

    load_areas()
    text = (REPO / "README.md").read_text()
    missing = [name for name in CATALOG if f"`{name}`" not in text]
    assert not missing


def test_shipped_sample_config_is_valid() -> None:
    cfg = assembly.load(REPO / "systemd" / "nodescope.toml")
    assert cfg.listen == config.DEFAULT_LISTEN


def test_commented_examples_of_the_sample_config_are_valid(tmp_path: Path) -> None:
    """The commented sections of systemd/nodescope.toml, uncommented, still validate."""
    text = (REPO / "systemd" / "nodescope.toml").read_text()
    lines = [
        line[2:] if re.match(r"^# (\[|[a-z_]+ = )", line) else line for line in text.splitlines()
    ]
    uncommented = tmp_path / "nodescope.toml"
    uncommented.write_text("\n".join(lines) + "\n")
    cfg = assembly.load(uncommented)
    assert cfg.listen == config.DEFAULT_LISTEN


def test_every_datasources_citation_in_the_code_names_a_section() -> None:
    """Code cites docs/datasources.md by section number ("§2.4", "§1, §4"); each must exist."""
    headings = {
        match.group(1)
        for match in re.finditer(
            r"^#{2,3} (\d+(?:\.\d+)?)\.? ", (REPO / "docs" / "datasources.md").read_text(), re.M
        )
    }
    cited: dict[str, set[str]] = {}
    for root in ("daemon", "exporters"):
        for path in (REPO / root).rglob("*.py"):
            text = path.read_text()
            for match in re.finditer(r"datasources\.md`{0,2}((?:[ ,;and]*§\d+(?:\.\d+)?)+)", text):
                for number in re.findall(r"§(\d+(?:\.\d+)?)", match.group(1)):
                    cited.setdefault(number, set()).add(str(path.relative_to(REPO)))
    assert cited, "no citation found: the pattern no longer matches how the code cites"
    missing = {number: sorted(paths) for number, paths in cited.items() if number not in headings}
    assert not missing


def test_the_readme_says_which_commands_take_the_filesystem_roots() -> None:
    from nodescope.cli.main import build_parser

    parser = build_parser()
    commands = next(
        a
        for a in parser._actions
        if a.dest == "command"  # the subparsers action
    ).choices
    assert commands is not None
    takes_roots = set()
    for name, sub in commands.items():
        options = {o for a in sub._actions for o in a.option_strings}
        nested = [a for a in sub._actions if a.dest == "action"]
        if nested and nested[0].choices:
            options |= {
                o for s in nested[0].choices.values() for a in s._actions for o in a.option_strings
            }
        if "--sysfs" in options:
            takes_roots.add(name)
    text = (REPO / "README.md").read_text()
    said = re.search(r"The commands that read this node — (.+?) — accept", text, re.S)
    assert said, "the README's sentence about --sysfs is gone"
    named = set(re.findall(r"`([a-z]+)`", said.group(1)))
    assert named == takes_roots
    refused = re.search(r"to\s+read another tree instead .*?; (.+?) read no node", text, re.S)
    assert refused
    assert set(re.findall(r"`([a-z]+)`", refused.group(1))) == set(commands) - takes_roots
