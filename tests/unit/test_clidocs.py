"""Manual pages and shell completion: generated from the parser, committed current, read by the
real tools (groff for the pages, bash and zsh for the completion)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from nodescope import clidocs
from tests.conftest import REPO

GENERATED = REPO / "packaging" / "common"


def test_the_committed_files_are_what_the_parser_makes() -> None:
    assert clidocs.main(["--check", str(GENERATED)]) == 0, (
        "stale: run .venv/bin/python -m nodescope.clidocs --write packaging/common"
    )


def test_every_command_line_has_a_page() -> None:
    names = {c.name for c in clidocs.commands()}
    pages = {p.stem for p in (GENERATED / "man").glob("*.1")}
    assert pages == names
    assert {"nodescope", "nodescope-check", "nodescope-slurm-prolog"} <= pages


@pytest.mark.parametrize("page", sorted((GENERATED / "man").glob("*.1")), ids=lambda p: p.stem)
def test_groff_reads_each_page_without_a_warning(page: object) -> None:
    groff = shutil.which("groff")
    if groff is None:
        pytest.fail("groff is not installed (Debian's groff-base, which man-db needs)")
    result = subprocess.run(
        [groff, "-man", "-ww", "-z", str(page)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0 and not result.stderr, result.stderr


def test_a_page_says_what_the_parser_says() -> None:
    text = (GENERATED / "man" / "nodescope-check.1").read_text()
    assert text.startswith('.TH "NODESCOPE-CHECK" "1"')
    assert "\\fB\\-\\-seconds\\fR \\fISECONDS\\fR" in text
    assert "how long to watch the node, 1 to 300 (default 3)" in text


def _complete(line: str) -> list[str]:
    script = (
        f"source {GENERATED / 'completion' / 'nodescope.bash'}\n"
        'read -ra COMP_WORDS <<< "$1"\n'
        '[[ "$1" == *" " ]] && COMP_WORDS+=("")\n'
        "COMP_CWORD=$((${#COMP_WORDS[@]} - 1))\n"
        "_nodescope\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    result = subprocess.run(
        ["bash", "-c", script, "_", line], capture_output=True, text=True, check=True
    )
    return [w for w in result.stdout.splitlines() if w]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("nodescope ch", ["check"]),
        ("nodescope check --sec", ["--seconds"]),
        ("nodescope run --log-format ", ["logfmt", "json"]),
        ("nodescope slurm pro", ["prolog"]),
        ("nodescope slurm prolog --con", ["--config"]),
        ("nodescope check --seconds ", []),
        ("nodescope -", ["-h", "--help", "-V", "--version"]),
    ],
)
def test_bash_completes_commands_options_and_choices(line: str, expected: list[str]) -> None:
    assert _complete(line) == expected


def test_bash_completes_directories_after_a_root_option(tmp_path: object) -> None:
    found = _complete(f"nodescope check --sysfs {REPO / 'dae'}")
    assert found == [str(REPO / "daemon")]


def test_zsh_reads_the_completion_function() -> None:
    zsh = shutil.which("zsh")
    if zsh is None:
        pytest.fail("zsh is not installed (scripts/lib.sh installs it for this test)")
    path = GENERATED / "completion" / "_nodescope"
    assert path.read_text().startswith("#compdef nodescope\n")
    result = subprocess.run([zsh, "-n", str(path)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    # Defining the functions (without running the completion) runs every spec through zsh.
    check = subprocess.run(
        [zsh, "-c", f"source <(sed '$d' {path}); whence -w _nodescope_check _nodescope_slurm"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stderr
    assert "_nodescope_check: function" in check.stdout
