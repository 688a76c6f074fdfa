"""The ``pressure`` source: the node's pressure stall information, ``/proc/pressure``.

Each of ``cpu``, ``memory`` and ``io`` holds up to two lines in the kernel's exact format
(:mod:`nodescope.sources.psi_format`)::

    some avg10=0.00 avg60=0.00 avg300=0.00 total=0
    full avg10=0.00 avg60=0.00 avg300=0.00 total=0

``avg*`` are the percent of wall time stalled over 10, 60 and 300 s (two decimals); ``total``
the cumulative stall time in microseconds. A line not in that format, or a second line of one
kind, is skipped and counted; the file's other line is kept. A file that is not there (PSI
off) leaves its resource absent; the source stays up.
"""

from __future__ import annotations

from nodescope.fileio import KERNEL_FILE, read_optional
from nodescope.model.cgroup import Pressure, PressureLine
from nodescope.model.pressure import PRESSURE, RESOURCES, NodePressure
from nodescope.model.skips import SkipTally
from nodescope.roots import Roots
from nodescope.sources.psi_format import parse_psi_line
from nodescope.sources.spec import SourceSpec

NAME = PRESSURE.name

#: A line not in the kernel's format.
SKIP_LINE_MALFORMED = "pressure_line_malformed"
#: A second ``some`` or ``full`` line in one file (the first is kept).
SKIP_LINE_REPEATED = "pressure_line_repeated"


def parse_pressure_file(text: str, source: str, tally: SkipTally) -> Pressure:
    """One ``/proc/pressure/<resource>`` file; bad lines are counted in ``tally``."""
    lines: dict[str, PressureLine] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line:
            continue
        parsed = parse_psi_line(line)
        if parsed is None:
            tally.skip(SKIP_LINE_MALFORMED, f"{source}:{number}: {line!r}")
            continue
        kind, figures = parsed
        if kind in lines:
            tally.skip(SKIP_LINE_REPEATED, f"{source}:{number}: {line!r}")
            continue
        lines[kind] = figures
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
