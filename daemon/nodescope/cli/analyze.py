"""``nodescope analyze TRACE…``: the collectives of a training job from its ranks' PyTorch
traces — profiler (Kineto) files or flight recorder dumps, one per rank, gzip or not.

Prints per collective kind and per rank the bytes sent and received, the time spent in the
collective and waiting for the last rank, AllToAll skew δ, and the straggler, and which
ranks of the job's world size (as the traces name it) have no trace; ``--json``
prints the analysis as a document, ``--svg FILE`` draws the ranks' bytes and waits.
Exit status 0 when at least one file was read, 1 when none could be.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from nodescope.progress import Progress

#: ``Limits().max_file_bytes`` in MiB. Written out so that registering the subcommand —
#: which every ``nodescope`` process does, the daemon's included — imports none of the
#: analysis (gzip, pickle) until ``analyze`` runs; a test holds the two equal.
DEFAULT_MAX_FILE_MIB = 256


def register(subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "analyze",
        help="AllToAll skew and straggler ranks from PyTorch traces (one file per rank)",
        description=(
            "Analyse the collectives in PyTorch profiler traces or flight recorder dumps,"
            " one file per rank: bytes, durations and waits per kind and rank, AllToAll"
            " skew (std/mean of the bytes each rank sends) and the rank the others waited for."
        ),
    )
    parser.add_argument(
        "traces",
        metavar="TRACE",
        nargs="+",
        help="a rank's trace: *.json or *.json.gz from torch.profiler, or a flight recorder"
        " dump (JSON or pickle, its file name ending in the rank); a directory stands for"
        " the files in it",
    )
    parser.add_argument("--json", action="store_true", help="print the analysis as JSON")
    parser.add_argument("--svg", metavar="FILE", help="also draw bytes and waits into FILE (SVG)")
    parser.add_argument(
        "--max-file-mib",
        type=int,
        default=DEFAULT_MAX_FILE_MIB,
        metavar="MIB",
        help="refuse a file larger than this once decompressed (default %(default)s)",
    )
    parser.set_defaults(func=run)


def _expand(names: list[str]) -> list[str]:
    paths: list[str] = []
    for name in names:
        path = Path(name)
        if path.is_dir():
            paths.extend(str(p) for p in sorted(path.iterdir()) if p.is_file())
        else:
            paths.append(name)
    return paths


def run(args: argparse.Namespace) -> int:
    from nodescope.collectives import Limits
    from nodescope.collectives.analysis import analyze, read_file
    from nodescope.collectives.render import render_svg, render_text, to_document
    from nodescope.text import sanitize_lines
    from nodescope_exporters.reports import atomic_write_bytes

    if args.max_file_mib <= 0:
        print("nodescope: --max-file-mib must be positive", file=sys.stderr)
        return 2
    limits = Limits(max_file_bytes=args.max_file_mib << 20)
    named = _expand(args.traces)
    opened = named[: limits.max_files]
    # A job's traces run to gigabytes: reading them takes seconds to minutes, so a terminal
    # sees which file is being read.
    progress = Progress(len(opened), sys.stderr)
    parsed = []
    for path in opened:
        progress.show(f"reading {Path(path).name}")
        parsed.append(read_file(path, limits))
        progress.step(f"read {Path(path).name}")
    progress.close()
    analysis = analyze(parsed, limits, files_dropped=len(named) - len(opened))
    if args.json:
        print(json.dumps(to_document(analysis), indent=2))
    else:
        sys.stdout.write(sanitize_lines(render_text(analysis)))  # names come from the job
    if args.svg:
        try:
            atomic_write_bytes(Path(args.svg), render_svg(analysis).encode(), 0o644)
        except OSError as exc:
            print(f"nodescope: cannot write {args.svg}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        if not args.json:
            print(f"bytes and waits drawn in {args.svg}")
    for report in analysis.files:
        if report.error:
            print(f"nodescope: {report.path}: {report.error}", file=sys.stderr)
    return 0 if any(r.error is None for r in analysis.files) else 1
