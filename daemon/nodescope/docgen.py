"""The README's generated sections (CLI, configuration and metrics references, the finding
tables), the sample configuration file, and the code blocks made from the finding-kind specs.

``python -m nodescope.docgen --write README.md`` refreshes the sections in place between
``<!-- BEGIN name -->`` / ``<!-- END name -->`` markers, ``--check README.md`` only says whether
they are stale, and ``--sample systemd/nodescope.toml`` writes the sample configuration; the test
suite fails when either is stale, so they always describe the code.

``--write-code`` refreshes the blocks between ``# BEGIN generated name`` / ``# END generated
name`` lines in the package's own modules (:data:`CODE_SECTIONS`: tables of finding kinds
that modules outside the detectors need without importing them), ``--check-code`` only says
whether they are stale.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from nodescope import assembly
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


def findings_signals() -> str:
    from nodescope.detectors.kinds import signal_table
    from nodescope.detectors.registry import KINDS

    return signal_table(KINDS.values())


def findings_kinds() -> str:
    from nodescope.detectors.kinds import kind_table
    from nodescope.detectors.registry import KINDS

    return kind_table(KINDS.values())


SECTIONS = {
    "cli": cli_reference,
    "config": assembly.reference_markdown,
    "metrics": metrics_reference,
    "finding-signals": findings_signals,
    "finding-kinds": findings_kinds,
}


def _policy_rules() -> str:
    from nodescope.detectors.kinds import policy_block
    from nodescope.detectors.registry import KINDS

    return policy_block(KINDS.values())


def _contention_kinds() -> str:
    from nodescope.detectors.kinds import contention_block
    from nodescope.detectors.registry import KINDS

    return contention_block(KINDS.values())


#: Module (relative to the package) -> block name -> what makes its body.
CODE_SECTIONS: Mapping[str, Mapping[str, Callable[[], str]]] = {
    "remediation/policy.py": {"kind-actions": _policy_rules},
    "hooks/tracker.py": {"contention-kinds": _contention_kinds},
}

PACKAGE = Path(__file__).resolve().parent


def refresh_code(text: str, sections: Mapping[str, Callable[[], str]]) -> str:
    """``text`` with each named block's body made anew (the marker lines kept)."""
    for name, make in sections.items():
        quoted = re.escape(name)
        pattern = re.compile(
            rf"(^# BEGIN generated {quoted}\b[^\n]*\n).*?(^# END generated {quoted}$)",
            flags=re.DOTALL | re.MULTILINE,
        )
        if not pattern.search(text):
            raise ValueError(f"no generated {name} block")
        body = make()

        def replace(match: re.Match[str], body: str = body) -> str:
            return match.group(1) + body + match.group(2)

        text = pattern.sub(replace, text)
    return text


def stale_code(root: Path = PACKAGE) -> list[str]:
    """The modules under ``root`` whose generated blocks differ from the specs."""
    stale = []
    for module, sections in CODE_SECTIONS.items():
        text = (root / module).read_text()
        if refresh_code(text, sections) != text:
            stale.append(module)
    return stale


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
    parser.add_argument(
        "--write-code", action="store_true", help="refresh the package's generated code blocks"
    )
    parser.add_argument(
        "--check-code",
        action="store_true",
        help="exit status 1 when the package's generated code blocks are stale",
    )
    args = parser.parse_args(argv)
    if args.write_code:
        for module, sections in CODE_SECTIONS.items():
            path = PACKAGE / module
            path.write_text(refresh_code(path.read_text(), sections))
    if args.check_code:
        stale = stale_code()
        if stale:
            print(f"generated code blocks are stale: {', '.join(stale)}", file=sys.stderr)
            return 1
    if args.sample:
        Path(args.sample).write_text(assembly.sample_toml())
    if args.check:
        text = Path(args.check).read_text()
        if refresh(text) != text:
            print(f"{args.check}: generated sections are stale", file=sys.stderr)
            return 1
    if args.write:
        path = Path(args.write)
        path.write_text(refresh(path.read_text()))
    if not (args.sample or args.check or args.write or args.write_code or args.check_code):
        for name, make in SECTIONS.items():
            print(f"<!-- {name} -->\n{make()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
