"""One line of a pressure stall information file, in the kernel's exact format
(``kernel/sched/psi.c``, ``psi_show``), as the node's ``/proc/pressure/<resource>`` and every
cgroup's ``<resource>.pressure`` print it::

    some avg10=0.00 avg60=0.00 avg300=0.00 total=0

``avg*`` are the percent of wall time stalled over 10, 60 and 300 s, printed ``%lu.%02lu``
(0.00 to 100.00); ``total`` the cumulative stall time in microseconds, a u64. A file holds a
``some`` and a ``full`` line, each at most once (``irq.pressure`` ``full`` only, a cgroup's
``cpu.pressure`` on an old kernel ``some`` only). The two sources read lines alike and differ
only in what a bad line costs: the node source skips and counts the line, the cgroup source
leaves that cgroup's figure out.
"""

from __future__ import annotations

import re

from nodescope.model.cgroup import PressureLine

_LINE = re.compile(
    r"(some|full) avg10=([0-9]{1,3}\.[0-9]{2}) avg60=([0-9]{1,3}\.[0-9]{2})"
    r" avg300=([0-9]{1,3}\.[0-9]{2}) total=([0-9]{1,20})"
)
_U64_MAX = 2**64 - 1


def parse_psi_line(line: str) -> tuple[str, PressureLine] | None:
    """The kind (``some``/``full``) and figures of one line; ``None`` when the line is not in
    the kernel's format."""
    match = _LINE.fullmatch(line)
    if match is None:
        return None
    total = int(match[5])
    if total > _U64_MAX:
        return None
    return match[1], PressureLine(float(match[2]), float(match[3]), float(match[4]), total)
