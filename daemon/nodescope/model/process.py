"""What nodescope's own processes cost the node, as one cycle measured it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: The daemon collects, analyses and renders; the serving process answers scrapes.
ProcessRole = Literal["daemon", "serving"]

#: Seconds between two readings of a process's PSS: reading ``smaps_rollup`` walks the whole
#: memory map under its lock, several times the cost of all the other figures together.
PSS_EVERY_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class ProcessFigures:
    """One process's figures, those Prometheus's process collector reports and its PSS.

    A figure the daemon could not read this time is ``None`` (the serving process's
    descriptors and memory map need privileges a unit may withhold), and so is ``max_fds``
    when the descriptor limit is unlimited. ``pss_bytes`` is read on a slower cadence than
    the rest: it is the value of its own last reading, not necessarily of this cycle.
    """

    role: ProcessRole
    pid: int
    #: User and system CPU time (utime + stime of /proc/<pid>/stat), children excluded.
    cpu_seconds: float
    resident_bytes: int
    virtual_bytes: int
    threads: int
    #: Unix time the process started.
    start_time_seconds: float
    open_fds: int | None
    #: The soft RLIMIT_NOFILE.
    max_fds: int | None
    #: Proportional set size: resident pages, each shared one divided among its sharers.
    pss_bytes: int | None
