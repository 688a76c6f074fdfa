"""The README's generated sections (CLI, configuration and metrics references) and the sample
configuration file.

``python -m nodescope.docgen --write README.md`` refreshes the sections in place between
``<!-- BEGIN name -->`` / ``<!-- END name -->`` markers, ``--check README.md`` only says whether
they are stale, and ``--sample systemd/nodescope.toml`` writes the sample configuration; the test
suite fails when either is stale, so they always describe the code.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from nodescope import config
from nodescope.cli.main import build_parser


def cli_reference() -> str:
    parser = build_parser()
    out = ["```", re.sub(r"\s+", " ", parser.format_usage().strip()), "```", ""]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice, sub in action.choices.items():
                help_text = next((a.help for a in action._choices_actions if a.dest == choice), "")
                out.append(f"### `nodescope {choice}`")
                out.append("")
                out.append(help_text or "")
                out.append("")
                usage = sub.format_usage().strip().removeprefix("usage: ")
                out.append("```")
                out.append(re.sub(r"\s+", " ", usage))
                out.append("```")
                out.append("")
    return "\n".join(out)


def metrics_reference() -> str:
    from nodescope_exporters.catalog import CATALOG
    from nodescope_exporters.prometheus import load_areas

    load_areas()
    lines = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for spec in sorted(CATALOG.values(), key=lambda s: (s.area, s.name)):
        labels = ", ".join(f"`{label}`" for label in spec.labels) or "—"
        lines.append(f"| `{spec.name}` | {spec.kind} | {labels} | {spec.help} |")
    return "\n".join(lines) + "\n"


SECTIONS = {
    "cli": cli_reference,
    "config": config.reference_markdown,
    "metrics": metrics_reference,
}


def refresh(text: str) -> str:
    for name, make in SECTIONS.items():
        pattern = re.compile(rf"(<!-- BEGIN {name} -->\n).*?(<!-- END {name} -->)", flags=re.DOTALL)
        if not pattern.search(text):
            raise ValueError(f"README has no {name} markers")
        body = make()

        def replace(match: re.Match[str], body: str = body) -> str:
            return match.group(1) + body + match.group(2)

        text = pattern.sub(replace, text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", metavar="README", help="refresh the file in place")
    parser.add_argument(
        "--check", metavar="README", help="exit status 1 when the file's sections are stale"
    )
    parser.add_argument(
        "--sample", metavar="FILE", help="write the sample configuration file (from the code)"
    )
    args = parser.parse_args(argv)
    if args.sample:
        Path(args.sample).write_text(config.sample_toml())
    if args.check:
        text = Path(args.check).read_text()
        if refresh(text) != text:
            print(f"{args.check}: generated sections are stale", file=sys.stderr)
            return 1
    if args.write:
        path = Path(args.write)
        path.write_text(refresh(path.read_text()))
    if not (args.sample or args.check or args.write):
        for name, make in SECTIONS.items():
            print(f"<!-- {name} -->\n{make()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
