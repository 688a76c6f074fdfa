"""The ``pressure`` source: the node's pressure stall information, ``/proc/pressure``.

Each of ``cpu``, ``memory`` and ``io`` holds up to two lines in the kernel's exact format
(``kernel/sched/psi.c``, ``psi_show``)::

    some avg10=0.00 avg60=0.00 avg300=0.00 total=0
    full avg10=0.00 avg60=0.00 avg300=0.00 total=0

``avg*`` are the percent of wall time stalled over 10, 60 and 300 s (two decimals); ``total``
the cumulative stall time in microseconds. A line not in that format, or a second line of one
kind, is skipped and counted; the file's other line is kept. A file that is not there (PSI
off) leaves its resource absent; the source stays up.
"""

from __future__ import annotations

import re

from nodescope.fileio import KERNEL_FILE, read_optional
from nodescope.model.cgroup import Pressure, PressureLine
from nodescope.model.pressure import PRESSURE, RESOURCES, NodePressure
from nodescope.model.skips import SkipTally
from nodescope.roots import Roots
from nodescope.sources.spec import SourceSpec

NAME = PRESSURE.name

#: A line not in the kernel's format.
SKIP_LINE_MALFORMED = "pressure_line_malformed"
#: A second ``some`` or ``full`` line in one file (the first is kept).
SKIP_LINE_REPEATED = "pressure_line_repeated"

_LINE = re.compile(
    r"(some|full) avg10=([0-9]{1,3}\.[0-9]{2}) avg60=([0-9]{1,3}\.[0-9]{2})"
    r" avg300=([0-9]{1,3}\.[0-9]{2}) total=([0-9]{1,20})"
)
#: ``total`` is a u64 of microseconds.
_U64_MAX = 2**64 - 1


def parse_pressure_file(text: str, source: str, tally: SkipTally) -> Pressure:
    """One ``/proc/pressure/<resource>`` file; bad lines are counted in ``tally``."""
    lines: dict[str, PressureLine] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line:
            continue
        match = _LINE.fullmatch(line)
        total = int(match[5]) if match else _U64_MAX + 1
        if match is None or total > _U64_MAX:
            tally.skip(SKIP_LINE_MALFORMED, f"{source}:{number}: {line!r}")
            continue
        kind = match[1]
        if kind in lines:
            tally.skip(SKIP_LINE_REPEATED, f"{source}:{number}: {line!r}")
            continue
        lines[kind] = PressureLine(float(match[2]), float(match[3]), float(match[4]), total)
    return Pressure(some=lines.get("some"), full=lines.get("full"))


def parse_node_pressure(texts: dict[str, str | None], directory: str) -> NodePressure:
    """The files' texts by resource (``None``: the file is absent) as one record."""
    tally = SkipTally()
    read = {
        resource: None
        if text is None
        else parse_pressure_file(text, f"{directory}/{resource}", tally)
        for resource, text in texts.items()
    }
    return NodePressure(
        cpu=read.get("cpu"), memory=read.get("memory"), io=read.get("io"), skipped=tally.freeze()
    )


def read_node_pressure(roots: Roots) -> NodePressure:
    directory = roots.procfs / "pressure"
    texts = {resource: read_optional(directory / resource, KERNEL_FILE) for resource in RESOURCES}
    return parse_node_pressure(texts, str(directory))


class PressureSource:
    name = NAME

    def collect(self, roots: Roots) -> NodePressure:
        return read_node_pressure(roots)

    def close(self) -> None:
        return None


def make_source() -> PressureSource:
    return PressureSource()


SPEC = SourceSpec(
    name=NAME,
    default_interval=5.0,
    help="node pressure stall information (PSI): time stalled on CPU, memory and IO, from"
    " /proc/pressure",
    build=lambda inputs: make_source(),
    rates=None,
    metric_area="nodescope_exporters.pressure_metrics",
    # The simulated node writes no /proc/pressure: the source would only report it absent.
    sim_parts=None,
)

__all__ = [
    "NAME",
    "SKIP_LINE_MALFORMED",
    "SKIP_LINE_REPEATED",
    "SPEC",
    "PressureSource",
    "make_source",
    "parse_node_pressure",
    "parse_pressure_file",
    "read_node_pressure",
]
