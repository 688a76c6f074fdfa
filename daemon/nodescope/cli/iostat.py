"""`nodescope iostat [INTERVAL [COUNT]]`: the columns of sysstat's ``iostat -dxm``, live.

Reads /proc/diskstats, /sys/block and /proc/uptime through the disks source (so ``--procfs`` and
``--sysfs`` point it at a fixture tree). As sysstat 12.6 does, the first report averages the
counters since boot over /proc/uptime, later reports cover one interval each; devices that never
completed a request are not shown; COUNT counts printed reports; ``-y`` omits the since-boot
report and ``-z`` the devices without requests in the interval.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, TextIO

from nodescope.cli.common import roots_from_args
from nodescope.errors import ParseError
from nodescope.roots import Roots
from nodescope.sources.diskstats import (
    IOSTAT_COLUMNS,
    SKIP_LINE_UNPARSABLE,
    DisksData,
    DiskStat,
    IostatFigures,
    IostatReport,
    iostat_figures,
    make_source,
    since_boot,
)

#: Printed width of each column (sysstat's ``cprintf_f``/``cprintf_pc`` widths), header order.
WIDTHS: dict[str, int] = {
    "r/s": 7,
    "rMB/s": 9,
    "rrqm/s": 8,
    "%rrqm": 6,
    "r_await": 7,
    "rareq-sz": 8,
    "w/s": 7,
    "wMB/s": 9,
    "wrqm/s": 8,
    "%wrqm": 6,
    "w_await": 7,
    "wareq-sz": 8,
    "d/s": 7,
    "dMB/s": 9,
    "drqm/s": 8,
    "%drqm": 6,
    "d_await": 7,
    "dareq-sz": 8,
    "f/s": 7,
    "f_await": 7,
    "aqu-sz": 7,
    "%util": 6,
}

#: sysstat pads the device name to 13 characters.
NAME_WIDTH = 13


def header_line() -> str:
    return f"{'Device':<{NAME_WIDTH}}" + "".join(
        f"{title:>{WIDTHS[title] + 1}}" for title, _, _ in IOSTAT_COLUMNS
    )


def device_line(fig: IostatFigures) -> str:
    cells = []
    for title, attr, _ in IOSTAT_COLUMNS:
        value = getattr(fig, attr)
        # Columns the kernel does not report print as 0.00, as iostat prints them.
        cells.append(f" {0.0 if value is None else value:{WIDTHS[title]}.2f}")
    return f"{fig.device:<{NAME_WIDTH}}" + "".join(cells)


def banner() -> str:
    """sysstat's first line: kernel, host name, date, architecture, CPUs."""
    u = os.uname()
    today = datetime.now().strftime("%x")
    return (
        f"{u.sysname} {u.release} ({u.nodename}) \t{today} \t_{u.machine}_\t({os.cpu_count()} CPU)"
    )


def format_report(
    report: IostatReport,
    cur: DisksData,
    prev: DisksData | None,
    omit_idle: bool = False,
) -> str:
    """One report: the header and a line per device, then the blank lines iostat prints."""
    current = {d.name: d for d in cur.disks}
    previous = {d.name: d for d in prev.disks} if prev is not None else {}
    lines = [header_line()]
    for fig in sorted(report.devices, key=lambda f: f.device):
        stat = current[fig.device]
        if stat.idle_since_boot:
            continue
        if omit_idle and _no_requests(previous.get(fig.device), stat):
            continue
        lines.append(device_line(fig))
    return "\n".join(lines) + "\n\n\n"


def _requests(s: DiskStat) -> tuple[int, int, int, int]:
    return (
        s.reads_completed,
        s.writes_completed,
        s.discards_completed or 0,
        s.flushes_completed or 0,
    )


def _no_requests(prev: DiskStat | None, cur: DiskStat) -> bool:
    before = _requests(prev) if prev is not None else (0, 0, 0, 0)
    return before == _requests(cur)


def run_iostat(
    roots: Roots,
    interval: float | None,
    count: int | None,
    *,
    omit_first: bool = False,
    omit_idle: bool = False,
    out: TextIO | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    show_banner: bool = True,
) -> int:
    """Print reports until ``count`` were printed (forever when ``interval`` is set and ``count``
    is ``None``; one report when ``interval`` is ``None``)."""
    if out is None:
        out = sys.stdout
    source = make_source()
    remaining = count if interval is not None else 1
    skip = omit_first and interval is not None
    if show_banner:
        out.write(banner() + "\n\n")
    prev: DisksData | None = None
    prev_t = 0.0
    # Each reason for skipped lines is said once, not in every report.
    warned: set[str] = set()
    start = clock()
    tick = 0
    try:
        while True:
            try:
                cur = source.collect(roots)
            except (OSError, ParseError) as exc:
                print(f"nodescope iostat: {exc}", file=sys.stderr)
                return 1
            for reason, skipped in sorted(cur.skipped.counts.items()):
                if reason in warned:
                    continue
                warned.add(reason)
                example = cur.skipped.examples.get(reason, "")
                print(
                    f"nodescope iostat: skipped {skipped} record(s): {reason} ({example})",
                    file=sys.stderr,
                )
            if not cur.disks and cur.skipped.counts.get(SKIP_LINE_UNPARSABLE):
                # Nothing left to report: the input as a whole is unusable.
                print(
                    f"nodescope iostat: no readable line in {roots.procfs / 'diskstats'}",
                    file=sys.stderr,
                )
                return 1
            now = clock()
            if prev is None:
                if cur.uptime_seconds is None:
                    print(
                        f"nodescope iostat: cannot read {roots.procfs / 'uptime'}", file=sys.stderr
                    )
                    return 2
                # sysstat's interval has a floor of one hundredth of a second.
                report = iostat_figures(since_boot(cur), cur, max(cur.uptime_seconds, 0.01))
            else:
                report = iostat_figures(prev, cur, max(now - prev_t, 1e-9))
            if not skip:
                out.write(format_report(report, cur, prev, omit_idle))
                out.flush()
                if remaining is not None:
                    remaining -= 1
            skip = False
            if remaining == 0 or interval is None:
                return 0
            prev, prev_t = cur, now
            tick += 1
            # Ticks are anchored to the start so the reports do not drift.
            sleep(max(0.0, start + tick * interval - clock()))
    finally:
        source.close()


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"interval must be positive, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"count must be at least 1, got {text}")
    return value


def _main(args: argparse.Namespace) -> int:
    return run_iostat(
        roots_from_args(args),
        args.interval,
        args.count,
        omit_first=args.omit_first,
        omit_idle=args.omit_idle,
    )


def register(subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "iostat",
        parents=parents,
        help="extended disk statistics, the columns of iostat -dxm",
        description=(
            "Extended statistics per whole disk in the columns of sysstat's `iostat -dxm`: "
            "first since boot, then every INTERVAL seconds, COUNT reports in all."
        ),
    )
    parser.add_argument("interval", nargs="?", type=_positive_float, metavar="INTERVAL")
    parser.add_argument("count", nargs="?", type=_positive_int, metavar="COUNT")
    parser.add_argument(
        "-y",
        dest="omit_first",
        action="store_true",
        help="omit the first report (averages since boot) when an INTERVAL is given",
    )
    parser.add_argument(
        "-z",
        dest="omit_idle",
        action="store_true",
        help="omit devices that completed no request in the interval",
    )
    parser.set_defaults(func=_main)
