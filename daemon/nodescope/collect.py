"""The collection cycle: run the sources that are due, isolate their failures, build the
snapshot.

A source that raises is marked down for that run (its sample carries the error, its previous
good data is not reused) and the other sources go on. State changes — up to down, down to up —
are logged once, not every cycle.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from nodescope.config import Config
from nodescope.model.snapshot import Snapshot, SourceSample, SourceStatus
from nodescope.roots import Roots
from nodescope.sources.base import Source
from nodescope.sources.registry import SOURCES

log = logging.getLogger("nodescope.collect")


@dataclass
class UnavailableSource:
    """Stands in for a source that could not even be built (a missing library, say): it is
    reported down with that reason on every run instead of stopping the daemon."""

    name: str
    reason: str

    def collect(self, roots: Roots) -> None:
        raise RuntimeError(self.reason)

    def close(self) -> None:
        return None


def _make(name: str) -> Source:
    try:
        return SOURCES[name].make()
    except Exception as exc:
        log.warning("source=%s state=unavailable error=%r", name, f"{type(exc).__name__}: {exc}")
        return UnavailableSource(name, f"cannot start: {type(exc).__name__}: {exc}")


@dataclass
class ScheduledSource:
    source: Source
    interval: float
    next_due: float = 0.0
    errors_total: int = 0
    runs_total: int = 0
    up: bool | None = None


@dataclass
class Collector:
    """Runs sources on their own intervals against a set of roots.

    ``clock`` is injected so tests and the simulated node can drive time.
    """

    roots: Roots
    scheduled: list[ScheduledSource]
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time
    cycle: int = 0
    _current: dict[str, SourceSample] = field(default_factory=dict)
    _previous: dict[str, SourceSample] = field(default_factory=dict)
    last: Snapshot | None = None

    @classmethod
    def from_config(cls, config: Config, sources: Iterable[Source] | None = None) -> Collector:
        """Sources from the registry (or the given ones), with the intervals of ``config``."""
        scheduled: list[ScheduledSource] = []
        if sources is None:
            for name, wanted in config.sources.items():
                if wanted.enabled:
                    scheduled.append(ScheduledSource(_make(name), wanted.interval_seconds))
        else:
            for source in sources:
                settings = config.sources.get(source.name)
                interval = settings.interval_seconds if settings else config.tick_seconds
                scheduled.append(ScheduledSource(source, interval))
        return cls(roots=config.roots, scheduled=scheduled)

    def _run_one(self, item: ScheduledSource, now: float) -> SourceSample:
        start = self.clock()
        item.runs_total += 1
        try:
            data = item.source.collect(self.roots)
        except Exception as exc:  # isolation: any failure of one source is that source's alone
            item.errors_total += 1
            error = f"{type(exc).__name__}: {exc}"
            if item.up is not False:
                log.warning("source=%s state=down error=%r", item.source.name, error)
            item.up = False
            return SourceSample(item.source.name, now, self.clock() - start, None, error)
        if item.up is False:
            log.info("source=%s state=up", item.source.name)
        item.up = True
        return SourceSample(item.source.name, now, self.clock() - start, data, None)

    def run_cycle(self, force: bool = False) -> Snapshot:
        """Run every due source (every source with ``force``) and return the new snapshot."""
        cycle_start = self.clock()
        for item in self.scheduled:
            # A tenth of the interval of slack: the loop's wake-up jitter must not push a
            # source that is due on this tick to the next one.
            if not force and cycle_start < item.next_due - 0.1 * item.interval:
                continue
            now = self.clock()
            sample = self._run_one(item, now)
            name = item.source.name
            if name in self._current:
                self._previous[name] = self._current[name]
            self._current[name] = sample
            # Schedule from the planned time so the cadence does not drift with read cost;
            # after an overrun (or on the first run) start again from now.
            planned = item.next_due + item.interval
            if not item.next_due or planned <= now:
                planned = cycle_start + item.interval
            item.next_due = planned
        self.cycle += 1
        snapshot = Snapshot(
            cycle=self.cycle,
            monotonic=self.clock(),
            wall_time=self.wall_clock(),
            current=self._current,
            previous=self._previous,
            cycle_duration=self.clock() - cycle_start,
            status={
                item.source.name: SourceStatus(
                    item.source.name,
                    bool(item.up),
                    item.runs_total,
                    item.errors_total,
                    item.interval,
                )
                for item in self.scheduled
            },
        )
        self.last = snapshot
        return snapshot

    def close(self) -> None:
        for item in self.scheduled:
            try:
                item.source.close()
            except Exception as exc:
                log.debug("source=%s close_error=%r", item.source.name, exc)
