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

Each entry also lists the specs of the kinds its detector emits
(:class:`~nodescope.detectors.kinds.FindingKind`, declared in the detector's module):
:data:`KINDS` gathers them into one read-only catalogue and :data:`ALERT_RULES` their alert
rules where they differ from the ``[alerts]`` defaults, which the composition root hands to the
alert engine. Both are built once, at import.
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
from nodescope.detectors.kinds import FindingKind, catalogue
from nodescope.model.finding import Finding
from nodescope.model.snapshot import Snapshot
from nodescope.model.xid_catalog import load_catalog

Detect = Callable[[Snapshot | None, Snapshot, Config], Iterable[Finding]]


class DetectorInfo(NamedTuple):
    """``name`` labels the detector's error counter and log lines. ``kinds``: the spec of
    every kind the detector emits."""

    name: str
    detect: Detect
    kinds: tuple[FindingKind, ...] = ()


# The packaged Xid catalog, read once here and held by the detector: immutable data.
_XID_CATALOG = load_catalog()

DETECTORS: tuple[DetectorInfo, ...] = (
    DetectorInfo("contention", contention.detect, (contention.SPEC,)),
    DetectorInfo("saturation", links.detect_saturation, (links.SPECS[0],)),
    DetectorInfo("downtraining", links.detect_downtraining, (links.SPECS[1],)),
    DetectorInfo("errors", errors.detect, errors.SPECS),
    DetectorInfo("placement", placement.detect, (placement.SPEC,)),
    DetectorInfo("jobs", jobs.detect, jobs.SPECS),
    DetectorInfo("nvlink", nvlink.detect, nvlink.SPECS),
    DetectorInfo("hangs", hangs.detect, hangs.SPECS),
    DetectorInfo("hotplug", hotplug.detect, hotplug.SPECS),
    DetectorInfo("xids", xids.XidDetector(_XID_CATALOG), xids.specs(_XID_CATALOG)),
    DetectorInfo("sxids", sxids.detect, sxids.SPECS),
    DetectorInfo("gpu_health", gpu_health.detect, gpu_health.SPECS),
    DetectorInfo("collectives", collectives.detect, collectives.SPECS),
)


def kinds_of(detectors: Iterable[DetectorInfo]) -> Mapping[str, FindingKind]:
    """Every kind the detectors emit, by name, in their order; a kind belongs to one
    detector (two specs of one name would make one silently win)."""
    return catalogue(kind for info in detectors for kind in info.kinds)


def alert_rules_of(detectors: Iterable[DetectorInfo]) -> Mapping[str, AlertRule]:
    """The detectors' built-in alert rules in one read-only table."""
    return MappingProxyType(
        {name: kind.alert for name, kind in kinds_of(detectors).items() if kind.alert is not None}
    )


#: The spec of every kind the daemon's detectors emit.
KINDS: Mapping[str, FindingKind] = kinds_of(DETECTORS)

#: The built-in alert rule of every kind that differs from the ``[alerts]`` defaults.
ALERT_RULES: Mapping[str, AlertRule] = alert_rules_of(DETECTORS)
