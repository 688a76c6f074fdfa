"""``nodescope report JOB``: a job's report, as the epilog wrote it, for people.

Reads ``<[slurm] reports_dir>/<JOB>.json`` (``nodescope-job-report/1``) and prints the
counter deltas, memory, findings, contention episodes and a timeline drawn in block
characters; ``--svg FILE`` also draws the timeline as an SVG file, ``--json`` prints the
document itself.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from nodescope import assembly
from nodescope.errors import ConfigError
from nodescope.text import sanitize, sanitize_lines
from nodescope_exporters.reports import atomic_write_bytes, read_report, render_svg, render_text

DEFAULT_CONFIG = "/etc/nodescope/nodescope.toml"


def register(subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "report",
        help="show a job's report (counter deltas, findings, timeline)",
        description="Show the report the Slurm epilog wrote for a job.",
    )
    parser.add_argument("job", metavar="JOB", help="Slurm job id")
    parser.add_argument(
        "--config",
        metavar="FILE",
        help=f"TOML configuration file (default: {DEFAULT_CONFIG} when it exists)",
    )
    parser.add_argument("--dir", metavar="DIR", help="read reports from DIR ([slurm] reports_dir)")
    parser.add_argument("--svg", metavar="FILE", help="also draw the timeline into FILE (SVG)")
    parser.add_argument("--json", action="store_true", help="print the report document")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        path = args.config or (DEFAULT_CONFIG if Path(DEFAULT_CONFIG).is_file() else None)
        config = assembly.load(path) if path else assembly.default_config()
    except ConfigError as exc:
        print(f"nodescope: {exc}", file=sys.stderr)
        return 2
    directory = Path(args.dir or config.slurm.reports_dir)
    try:
        document = read_report(directory, args.job)
    except FileNotFoundError:
        print(f"nodescope: no report for job {args.job} in {directory}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:
        print(sanitize(f"nodescope: {exc}"), file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(document, indent=2, sort_keys=True))
    else:
        width = max(20, min(100, shutil.get_terminal_size((100, 24)).columns - 40))
        # A report names the job's processes, and a process names itself: every line goes
        # through the sanitiser before it reaches the terminal.
        sys.stdout.write(sanitize_lines(render_text(document, width=width)))
    if args.svg:
        try:
            atomic_write_bytes(Path(args.svg), render_svg(document).encode(), 0o644)
        except OSError as exc:
            print(f"nodescope: cannot write {args.svg}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        if not args.json:
            print(f"timeline drawn in {args.svg}")
    return 0
