"""The detectors the daemon runs, in order.

A detector is a pure function ``(previous_snapshot, snapshot, config) -> Iterable[Finding]``:
no IO, no clock, no memory that changes an answer (the alert engine is the only place that
remembers). What a detector reuses across cycles while its inputs are the same objects goes
through the snapshot's derived figures (``snapshot.derived.reuse``), which the analysis step's
derived stage owns; callers do not modify what a detector returns.
``previous_snapshot`` is the snapshot of the cycle before (``None`` on the first cycle); the
topology is the ``pci`` source's record in the snapshot (``snapshot.latest(PCI)``). The
analysis step (``nodescope.analysis``) runs each one isolated: one that raises loses its
findings for that cycle, is logged once and counted, and the others go on.

Each entry also declares, as data, the alert rules of the kinds its detector emits where they
differ from the ``[alerts]`` defaults; :data:`ALERT_RULES` gathers them into one read-only
table, which the composition root hands to the alert engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import NamedTuple

from nodescope.alerts import AlertRule
from nodescope.config import Config
from nodescope.detectors import (
    collectives,
    contention,
    errors,
    gpu_health,
    hangs,
    hotplug,
    jobs,
    links,
    nvlink,
    placement,
    sxids,
    xids,
)
from nodescope.model.finding import Finding
from nodescope.model.snapshot import Snapshot
from nodescope.model.xid_catalog import load_catalog

Detect = Callable[[Snapshot | None, Snapshot, Config], Iterable[Finding]]

_NO_RULES: Mapping[str, AlertRule] = MappingProxyType({})


class DetectorInfo(NamedTuple):
    """``name`` labels the detector's error counter and log lines. ``alert_rules``: the
    built-in rule of each kind the detector emits whose alerts differ from the ``[alerts]``
    defaults."""

    name: str
    detect: Detect
    alert_rules: Mapping[str, AlertRule] = _NO_RULES


# An error counter that moved is a finding for one interval, so its kind fires at once and
# stays visible a while. Contention and saturation declare their rules in their own modules:
# those detectors read the rule's clear_below to report findings in the keep band.
DETECTORS: tuple[DetectorInfo, ...] = (
    DetectorInfo(
        "contention", contention.detect, MappingProxyType({contention.KIND: contention.RULE})
    ),
    DetectorInfo(
        "saturation",
        links.detect_saturation,
        MappingProxyType({links.SATURATION: links.SATURATION_RULE}),
    ),
    DetectorInfo("downtraining", links.detect_downtraining),
    DetectorInfo(
        "errors",
        errors.detect,
        MappingProxyType(
            {
                errors.AER: AlertRule(for_seconds=0.0, resolve_after_seconds=600.0),
                errors.REPLAYS: AlertRule(for_seconds=0.0, resolve_after_seconds=300.0),
                errors.NVLINK: AlertRule(for_seconds=0.0, resolve_after_seconds=300.0),
                errors.IB_ERRORS: AlertRule(for_seconds=0.0, resolve_after_seconds=600.0),
                errors.ECC_CORRECTED: AlertRule(for_seconds=0.0, resolve_after_seconds=600.0),
            }
        ),
    ),
    DetectorInfo("placement", placement.detect),
    DetectorInfo(
        "jobs",
        jobs.detect,
        MappingProxyType({jobs.OOM_KILL: AlertRule(for_seconds=0.0, resolve_after_seconds=600.0)}),
    ),
    # NVLink stalls, bursts and saturation take the [alerts] defaults (held for a while);
    # counter registers that read all-ones stay gone, so that fires at once.
    DetectorInfo(
        "nvlink",
        nvlink.detect,
        MappingProxyType({nvlink.GONE: AlertRule(for_seconds=0.0, resolve_after_seconds=300.0)}),
    ),
    # Idle GPUs are a stall only once they stay idle: T is the rule's "for"; the cause
    # unknown waits longer, as a job between phases is idle for a while too.
    DetectorInfo(
        "hangs",
        hangs.detect,
        MappingProxyType(
            {
                hangs.STORAGE: AlertRule(for_seconds=30.0, resolve_after_seconds=60.0),
                # Kernels spinning with nothing moving: held as long as a storage stall, so
                # a collective that waits out a slow rank for a few seconds is no alert.
                hangs.COLLECTIVE: AlertRule(for_seconds=30.0, resolve_after_seconds=60.0),
                hangs.LOADER: AlertRule(for_seconds=60.0, resolve_after_seconds=120.0),
                hangs.UNKNOWN: AlertRule(for_seconds=120.0, resolve_after_seconds=60.0),
            }
        ),
    ),
    DetectorInfo(
        "hotplug",
        hotplug.detect,
        MappingProxyType(
            {
                hotplug.FELL_OFF_BUS: AlertRule(for_seconds=0.0, resolve_after_seconds=600.0),
                # Found in the one cycle whose two reads differ: held long enough to be seen.
                hotplug.REMOVED: AlertRule(for_seconds=0.0, resolve_after_seconds=1800.0),
                hotplug.FLAPPING: AlertRule(for_seconds=0.0, resolve_after_seconds=300.0),
            }
        ),
    ),
    # The packaged Xid catalog, read once here and held by the detector: immutable data.
    DetectorInfo("xids", xids.XidDetector(load_catalog()), xids.RULES),
    DetectorInfo("sxids", sxids.detect, sxids.RULES),
    DetectorInfo("gpu_health", gpu_health.detect, gpu_health.RULES),
    # Trace figures are already a summary over the profiler's window: they fire at once and
    # hold until the job's next files (or its end) change them.
    DetectorInfo(
        "collectives",
        collectives.detect,
        MappingProxyType(
            {
                collectives.SKEW: AlertRule(for_seconds=0.0, resolve_after_seconds=60.0),
                collectives.STRAGGLER: AlertRule(for_seconds=0.0, resolve_after_seconds=60.0),
            }
        ),
    ),
)


def alert_rules_of(detectors: Iterable[DetectorInfo]) -> Mapping[str, AlertRule]:
    """The detectors' built-in alert rules in one read-only table."""
    table: dict[str, AlertRule] = {}
    for info in detectors:
        for kind, rule in info.alert_rules.items():
            # A kind belongs to one detector; two rules for it would make one silently win.
            if kind in table:
                raise ValueError(f"alert rule for {kind!r} declared twice (by {info.name!r})")
            table[kind] = rule
    return MappingProxyType(table)


#: The built-in alert rule of every kind that differs from the ``[alerts]`` defaults.
ALERT_RULES: Mapping[str, AlertRule] = alert_rules_of(DETECTORS)
