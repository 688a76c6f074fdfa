"""The detectors the daemon runs, in order.

A detector is a pure function ``(previous_snapshot, snapshot, config) -> Iterable[Finding]``:
no IO, no clock, no memory that changes an answer (the alert engine is the only place that
remembers). A detector may keep the result of its last inputs (:class:`nodescope.memo.Memo`,
keyed on the identity of the samples it reads) and return that same object while they are
the same; callers do not modify what a detector returns.
``previous_snapshot`` is the snapshot of the cycle before (``None`` on the first cycle); the
topology is the ``pci`` source's data in the snapshot. The analysis step
(``nodescope.analysis``) runs each one isolated: one that raises loses its findings for that
cycle, is logged once and counted, and the others go on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

from nodescope.alerts import BUILTIN_RULES, AlertRule
from nodescope.config import Config
from nodescope.detectors import (
    contention,
    errors,
    hangs,
    hotplug,
    jobs,
    links,
    nvlink,
    placement,
)
from nodescope.model.finding import Finding
from nodescope.model.snapshot import Snapshot

Detect = Callable[[Snapshot | None, Snapshot, Config], Iterable[Finding]]


class DetectorInfo(NamedTuple):
    """``name`` labels the detector's error counter and log lines."""

    name: str
    detect: Detect


DETECTORS: tuple[DetectorInfo, ...] = (
    DetectorInfo("contention", contention.detect),
    DetectorInfo("saturation", links.detect_saturation),
    DetectorInfo("downtraining", links.detect_downtraining),
    DetectorInfo("errors", errors.detect),
    DetectorInfo("placement", placement.detect),
    DetectorInfo("jobs", jobs.detect),
    DetectorInfo("nvlink", nvlink.detect),
    DetectorInfo("hangs", hangs.detect),
    DetectorInfo("hotplug", hotplug.detect),
)

# Alert rules of the kinds above that differ from the [alerts] defaults: an error counter that
# moved is a finding for one interval, so it fires at once and stays visible a while.
BUILTIN_RULES.update(
    {
        contention.KIND: AlertRule(for_seconds=30.0, resolve_after_seconds=60.0, clear_below=0.5),
        links.SATURATION: AlertRule(for_seconds=30.0, resolve_after_seconds=60.0, clear_below=0.9),
        errors.AER: AlertRule(for_seconds=0.0, resolve_after_seconds=600.0),
        errors.REPLAYS: AlertRule(for_seconds=0.0, resolve_after_seconds=300.0),
        errors.NVLINK: AlertRule(for_seconds=0.0, resolve_after_seconds=300.0),
        errors.IB_ERRORS: AlertRule(for_seconds=0.0, resolve_after_seconds=600.0),
        jobs.OOM_KILL: AlertRule(for_seconds=0.0, resolve_after_seconds=600.0),
        # NVLink stalls, bursts and saturation take the [alerts] defaults (held for a while);
        # counter registers that read all-ones stay gone, so that fires at once.
        nvlink.GONE: AlertRule(for_seconds=0.0, resolve_after_seconds=300.0),
        # Idle GPUs are a stall only once they stay idle: T is the rule's "for"; the cause
        # unknown waits longer, as a job between phases is idle for a while too.
        hangs.STORAGE: AlertRule(for_seconds=30.0, resolve_after_seconds=60.0),
        hangs.LOADER: AlertRule(for_seconds=60.0, resolve_after_seconds=120.0),
        hangs.UNKNOWN: AlertRule(for_seconds=120.0, resolve_after_seconds=60.0),
        hotplug.FELL_OFF_BUS: AlertRule(for_seconds=0.0, resolve_after_seconds=600.0),
        hotplug.FLAPPING: AlertRule(for_seconds=0.0, resolve_after_seconds=300.0),
    }
)
