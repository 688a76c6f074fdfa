"""One immutable record of a collection cycle.

Sources run on their own intervals, so a snapshot holds, per source, the latest sample and
the sample before it: rates are always computed from a source's own two readings and its own
measured time, never from the cycle clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeVar

from nodescope.model.alert import Alert, AlertCounters
from nodescope.model.derived import Derived, sample_pair
from nodescope.model.finding import Finding
from nodescope.model.process import ProcessFigures
from nodescope.model.source_key import SourceKey

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SourceSample:
    """The outcome of one run of one source.

    ``monotonic`` is CLOCK_MONOTONIC seconds at the read; ``data`` is the source's record, or
    ``None`` when the run failed (then ``error`` says why). It is read back typed through the
    source's key (:meth:`Snapshot.latest`), which checks its type.
    """

    source: str
    monotonic: float
    duration: float
    data: object = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class SourceStatus:
    """Health of one source over the daemon's life, for self-metrics.

    ``skipped_total`` counts, per reason, the records its parsers skipped as malformed;
    ``timeouts_total`` the runs that overran their deadline.
    """

    source: str
    up: bool
    runs_total: int
    errors_total: int
    interval: float
    skipped_total: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    timeouts_total: int = 0


def _frozen(m: Mapping[str, T]) -> Mapping[str, T]:
    return MappingProxyType(dict(m))


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the node looked like at the end of cycle ``cycle``.

    ``current[name]`` is the latest sample of source ``name``; ``previous[name]`` the one
    before it (absent until the source has run twice). ``findings``, ``alerts`` (pending and
    firing) and ``alert_counters`` are filled by the analysis step after the detectors ran.
    """

    cycle: int
    monotonic: float
    wall_time: float
    current: Mapping[str, SourceSample] = field(default_factory=dict)
    previous: Mapping[str, SourceSample] = field(default_factory=dict)
    cycle_duration: float = 0.0
    status: Mapping[str, SourceStatus] = field(default_factory=dict)
    findings: tuple[Finding, ...] = ()
    alerts: tuple[Alert, ...] = ()
    alert_counters: AlertCounters | None = None
    cycle_errors: Mapping[str, int] = field(default_factory=dict)
    #: The daemon's config reloads by result (``success``, ``failure``); empty outside it.
    config_reloads: Mapping[str, int] = field(default_factory=dict)
    #: The daemon's own processes (itself, its serving process), measured by the daemon after
    #: the cycle; empty outside it, so fixture and replay renderings hold no such figures.
    processes: tuple[ProcessFigures, ...] = ()
    #: The figures this snapshot's samples imply (:mod:`nodescope.model.derived`); made here
    #: when not given, so every snapshot has them. Read it as :attr:`derived`.
    figures: Derived | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "current", _frozen(self.current))
        object.__setattr__(self, "previous", _frozen(self.previous))
        # A copy with other samples (``dataclasses.replace``) must not keep the figures of the
        # samples it replaced.
        if self.figures is None or not self.figures.made_from(self.current, self.previous):
            object.__setattr__(self, "figures", Derived(self.current, self.previous))
        object.__setattr__(self, "status", _frozen(self.status))
        object.__setattr__(self, "cycle_errors", _frozen(self.cycle_errors))
        object.__setattr__(self, "config_reloads", _frozen(self.config_reloads))

    @property
    def derived(self) -> Derived:
        """Rates, the PCIe attribution and the job registry of this snapshot, each computed
        once however many readers ask."""
        assert self.figures is not None  # made in __post_init__
        return self.figures

    def latest(self, key: SourceKey[T]) -> T | None:
        """The latest good record of the source ``key`` names."""
        sample = self.current.get(key.name)
        return None if sample is None else key.of(sample.data)

    def pair(self, key: SourceKey[T]) -> tuple[T, T, float] | None:
        """(previous, current, seconds between them) of the source ``key`` names, for rates,
        when both reads succeeded."""
        pair = sample_pair(self.current, self.previous, key)
        return None if pair is None else (pair.before, pair.now, pair.seconds)
