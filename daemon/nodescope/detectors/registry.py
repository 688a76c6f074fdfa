"""The detectors the daemon runs, in order.

A detector is a pure function ``(previous_snapshot, snapshot, settings) -> Iterable[Finding]``:
no IO, no clock, no memory that changes an answer (the alert engine is the only place that
remembers). ``settings`` are its own, typed: its ``[detectors.<name>]`` table, or a small
record of that and what else of the configuration it reads; :class:`Configured` picks them
out of the whole ``Config`` at each call, here and nowhere else.

What a detector reuses across cycles while its inputs are the same objects goes
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
from typing import Generic, NamedTuple, TypeVar

from nodescope.alerts import AlertRule, keep_floor
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
from nodescope.model.nvml import NVML
from nodescope.model.snapshot import Snapshot
from nodescope.model.xid_catalog import load_catalog

Detect = Callable[[Snapshot | None, Snapshot, Config], Iterable[Finding]]

S = TypeVar("S")


class Configured(Generic[S]):
    """A detector of typed settings in the registry's form: ``settings`` picks them out of
    the configuration at each call (a few attribute reads; a reload takes effect at once)."""

    __slots__ = ("detect", "settings")

    def __init__(
        self,
        detect: Callable[[Snapshot | None, Snapshot, S], Iterable[Finding]],
        settings: Callable[[Config], S],
    ) -> None:
        self.detect = detect
        self.settings = settings

    def __call__(
        self, previous: Snapshot | None, snapshot: Snapshot, config: Config
    ) -> Iterable[Finding]:
        return self.detect(previous, snapshot, self.settings(config))


class DetectorInfo(NamedTuple):
    """``name`` labels the detector's error counter and log lines. ``kinds``: the spec of
    every kind the detector emits."""

    name: str
    detect: Detect
    kinds: tuple[FindingKind, ...] = ()


# What each detector reads of the configuration besides its own table: the keep band of its
# alert rule, the source interval its held times count in.


def contention_inputs(config: Config) -> contention.ContentionInputs:
    return contention.ContentionInputs(
        config.detectors.contention, keep_floor(config, contention.KIND, contention.RULE)
    )


def saturation_inputs(config: Config) -> links.SaturationInputs:
    return links.SaturationInputs(
        config.detectors.saturation,
        config.detectors.saturation_models,
        keep_floor(config, links.SATURATION, links.SATURATION_RULE),
    )


def gpu_health_inputs(config: Config) -> gpu_health.GpuHealthInputs:
    source = config.sources.get(NVML.name)
    return gpu_health.GpuHealthInputs(
        config.detectors.gpu_health, 1.0 if source is None else source.interval_seconds
    )


def _no_settings(config: Config) -> None:
    return None


# The packaged Xid catalog, read once here and held by the detector: immutable data.
_XID_CATALOG = load_catalog()

DETECTORS: tuple[DetectorInfo, ...] = (
    DetectorInfo(
        "contention", Configured(contention.detect, contention_inputs), (contention.SPEC,)
    ),
    DetectorInfo(
        "saturation",
        Configured(links.detect_saturation, saturation_inputs),
        (links.SATURATION_SPEC,),
    ),
    DetectorInfo(
        "downtraining",
        Configured(links.detect_downtraining, lambda c: c.detectors.downtraining),
        (links.DOWNTRAINED_SPEC,),
    ),
    DetectorInfo("errors", Configured(errors.detect, lambda c: c.detectors.errors), errors.SPECS),
    DetectorInfo(
        "placement",
        Configured(placement.detect, lambda c: c.detectors.placement),
        (placement.SPEC,),
    ),
    DetectorInfo("jobs", Configured(jobs.detect, lambda c: c.detectors.jobs), jobs.SPECS),
    DetectorInfo("nvlink", Configured(nvlink.detect, lambda c: c.detectors.nvlink), nvlink.SPECS),
    DetectorInfo("hangs", Configured(hangs.detect, lambda c: c.detectors.hangs), hangs.SPECS),
    DetectorInfo(
        "hotplug", Configured(hotplug.detect, lambda c: c.detectors.hotplug), hotplug.SPECS
    ),
    DetectorInfo(
        "xids",
        Configured(xids.XidDetector(_XID_CATALOG), lambda c: c.detectors.xids),
        xids.specs(_XID_CATALOG),
    ),
    DetectorInfo("sxids", Configured(sxids.detect, _no_settings), sxids.SPECS),
    DetectorInfo("gpu_health", Configured(gpu_health.detect, gpu_health_inputs), gpu_health.SPECS),
    DetectorInfo(
        "collectives",
        Configured(collectives.detect, lambda c: c.detectors.collectives),
        collectives.SPECS,
    ),
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
