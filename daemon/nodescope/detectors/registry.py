"""The detectors the daemon runs, in order.

A detector is a pure function ``(previous_snapshot, snapshot, config) -> Iterable[Finding]``:
no IO, no clock, no memory between calls (the alert engine is the only place that remembers).
``previous_snapshot`` is the snapshot of the cycle before (``None`` on the first cycle); the
topology is the ``pci`` source's data in the snapshot. The analysis step
(``nodescope.analysis``) runs each one isolated: one that raises loses its findings for that
cycle, is logged once and counted, and the others go on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

from nodescope.config import Config
from nodescope.model.finding import Finding
from nodescope.model.snapshot import Snapshot

Detect = Callable[[Snapshot | None, Snapshot, Config], Iterable[Finding]]


class DetectorInfo(NamedTuple):
    """``name`` labels the detector's error counter and log lines."""

    name: str
    detect: Detect


DETECTORS: tuple[DetectorInfo, ...] = ()
