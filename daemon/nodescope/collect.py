"""The collection cycle: run the sources that are due, isolate their failures, build the
snapshot.

A source that raises is marked down for that run (its sample carries the error, its previous
good data is not reused) and the other sources go on. A source that overruns its deadline is
marked down with reason ``timeout`` and the cycle goes on without it. State changes — up to
down, down to up — are logged once, not every cycle; records a source skipped as malformed
are counted per reason and logged at most once per reason every ten minutes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from nodescope.config import (
    DEFAULT_SOURCE_TIMEOUT,
    Config,
    link_events_options,
    netdev_options,
    spool_settings,
)
from nodescope.model.skips import Skipped
from nodescope.model.snapshot import Snapshot, SourceSample, SourceStatus
from nodescope.roots import Roots
from nodescope.sources.base import Source, TopologyGeneration
from nodescope.sources.registry import SOURCES, SourceInputs
from nodescope.timing import Timing

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


def _make(name: str, inputs: SourceInputs) -> Source:
    try:
        return SOURCES[name].make(inputs)
    except Exception as exc:
        log.warning("source=%s state=unavailable error=%r", name, f"{type(exc).__name__}: {exc}")
        return UnavailableSource(name, f"cannot start: {type(exc).__name__}: {exc}")


def _timeout_of(config: Config, name: str) -> float:
    """Seconds one run of the source may take (``[sources.<name>] timeout_seconds``)."""
    settings = config.sources.get(name)
    return settings.timeout_seconds if settings is not None else DEFAULT_SOURCE_TIMEOUT


def _watched(name: str, inputs: SourceInputs | None) -> TopologyGeneration | None:
    """The topology generation the source named ``name`` runs on when it moves: the shared
    one of ``inputs`` if the registry declares the source due on a topology change."""
    info = SOURCES.get(name)
    if inputs is None or info is None or not info.due_on_topology_change:
        return None
    return inputs.topology


@dataclass
class ScheduledSource:
    """A source, its interval and deadline, and its health over the daemon's life.

    ``timeout`` is how long one run may take; ``None`` runs it in the caller's thread with no
    deadline (tests and replays, whose clock is simulated). ``stuck_since`` is set while a run
    that overran its deadline has not returned: the source is not called again until it does,
    so a call blocked in the kernel (a hung NFS server, a GPU in a bad state) holds one thread,
    never one per cycle.

    ``watches`` is the topology generation the source declared it follows
    (:attr:`~nodescope.sources.spec.SourceSpec.due_on_topology_change`): the source is
    also due in any cycle in which it moved since the generation ``watched_seen`` it last ran
    at, so a device hot-removed is read when the ``udev`` source reports it, not at the end
    of the source's interval. Such a run keeps ``next_due``: the cadence goes on as planned.
    """

    source: Source
    interval: float
    timeout: float | None = None
    next_due: float = 0.0
    watches: TopologyGeneration | None = None
    watched_seen: int = 0
    errors_total: int = 0
    runs_total: int = 0
    timeouts_total: int = 0
    up: bool | None = None
    stuck_since: float | None = None
    skipped_total: dict[str, int] = field(default_factory=dict)
    skip_logged: dict[str, float] = field(default_factory=dict)


#: Seconds between two log lines about the same source skipping records for the same reason.
SKIP_LOG_INTERVAL = 600.0


@dataclass
class _Outcome:
    item: ScheduledSource
    started: float
    duration: float
    data: Any = None
    error: str | None = None


class _Runner:
    """A thread that runs one cycle's sources one after another.

    The collector waits for it with the deadline of the source it is running. When a source
    overruns, the collector marks it down, abandons this runner — the thread ends when the
    blocked call returns, and drops its result — and hands the rest of the cycle to a new one.
    """

    def __init__(self, roots: Roots, clock: Callable[[], float]) -> None:
        self.roots = roots
        self.clock = clock
        self.lock = threading.Condition()
        self.work: list[ScheduledSource] = []
        self.position = 0
        self.deadline_started = 0.0
        self.outcomes: list[_Outcome] = []
        self.busy = False
        self.abandoned = False
        self._thread = threading.Thread(target=self._loop, name="nodescope-sources", daemon=True)
        self._thread.start()

    def submit(self, work: list[ScheduledSource], roots: Roots) -> None:
        """Start ``work`` (the caller holds ``lock``)."""
        self.roots = roots
        self.work = work
        self.position = 0
        self.outcomes = []
        self.deadline_started = time.monotonic()
        self.busy = True
        self.lock.notify_all()

    def given_up(self) -> bool:
        """Whether the collector abandoned this runner (another thread sets it)."""
        return self.abandoned

    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self.busy:
                    self.lock.wait()
                if self.abandoned:
                    return
                item = self.work[self.position]
                roots = self.roots
            started = self.clock()
            data, error = _call(item, roots)
            duration = self.clock() - started
            with self.lock:
                if self.given_up():
                    # The collector gave up on this call: the source may run again.
                    item.stuck_since = None
                    return
                self.outcomes.append(_Outcome(item, started, duration, data, error))
                self.position += 1
                self.deadline_started = time.monotonic()
                if self.position >= len(self.work):
                    self.busy = False
                    self.lock.notify_all()


def _call(item: ScheduledSource, roots: Roots) -> tuple[Any, str | None]:
    try:
        return item.source.collect(roots), None
    except Exception as exc:  # isolation: any failure of one source is that source's alone
        return None, f"{type(exc).__name__}: {exc}"


def _input_moved(item: ScheduledSource) -> bool:
    """Whether the generation ``item`` watches moved since it last ran."""
    watches = item.watches
    return watches is not None and watches.value != item.watched_seen


def _watch(due: list[ScheduledSource]) -> list[ScheduledSource]:
    """``due``, each watching source noted as having run at the generation it starts from
    (a move during its run is caught by the next look)."""
    for item in due:
        if item.watches is not None:
            item.watched_seen = item.watches.value
    return due


@dataclass
class Collector:
    """Runs sources on their own intervals against a set of roots.

    ``clock`` is injected so tests and the simulated node can drive time. Deadlines are kept
    on the real monotonic clock: they bound real waiting. ``inputs`` is what the sources were
    built to share (the cgroup walk of a cycle): each cycle begins on it before any source
    runs, so what one source reads for the others is read once per cycle, whichever runs
    first.
    """

    roots: Roots
    scheduled: list[ScheduledSource]
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time
    cycle: int = 0
    inputs: SourceInputs | None = None
    _current: dict[str, SourceSample] = field(default_factory=dict)
    _previous: dict[str, SourceSample] = field(default_factory=dict)
    _runner: _Runner | None = None
    last: Snapshot | None = None

    @classmethod
    def from_config(
        cls,
        config: Config,
        sources: Iterable[Source] | None = None,
        inputs: SourceInputs | None = None,
    ) -> Collector:
        """Sources from the registry, built to share one :class:`SourceInputs`, or the given
        ones with the ``inputs`` they were built with, at the intervals and deadlines of
        ``config``."""
        scheduled: list[ScheduledSource] = []
        timing = Timing.of(config)
        if sources is None:
            if inputs is None:
                inputs = SourceInputs(
                    spool=spool_settings(config),
                    netdev=netdev_options(config),
                    link_events=link_events_options(config),
                    max_registrations=config.slurm.max_registrations,
                )
            for name, wanted in config.sources.items():
                if wanted.enabled:
                    scheduled.append(
                        ScheduledSource(
                            _make(name, inputs),
                            timing.source_interval(wanted),
                            _timeout_of(config, name),
                            watches=_watched(name, inputs),
                        )
                    )
        else:
            for source in sources:
                scheduled.append(
                    ScheduledSource(
                        source,
                        timing.source_interval(config.sources.get(source.name)),
                        _timeout_of(config, source.name),
                        watches=_watched(source.name, inputs),
                    )
                )
        return cls(roots=config.roots, scheduled=scheduled, inputs=inputs)

    def _record(self, outcome: _Outcome, now: float) -> SourceSample:
        item = outcome.item
        name = item.source.name
        item.runs_total += 1
        if outcome.error is not None:
            item.errors_total += 1
            if item.up is not False:
                log.warning("source=%s state=down error=%r", name, outcome.error)
            item.up = False
            return SourceSample(name, now, outcome.duration, None, outcome.error)
        if item.up is False:
            log.info("source=%s state=up", name)
        item.up = True
        skipped = getattr(outcome.data, "skipped", None)
        if isinstance(skipped, Skipped) and skipped:
            self._count_skips(item, skipped)
        return SourceSample(name, now, outcome.duration, outcome.data, None)

    def _count_skips(self, item: ScheduledSource, skipped: Skipped) -> None:
        totals = item.skipped_total
        now = time.monotonic()
        for reason, count in skipped.counts.items():
            totals[reason] = totals.get(reason, 0) + count
            last = item.skip_logged.get(reason)
            if last is None or now - last >= SKIP_LOG_INTERVAL:
                item.skip_logged[reason] = now
                log.warning(
                    "source=%s event=records_skipped reason=%s count=%d total=%d example=%s",
                    item.source.name,
                    reason,
                    count,
                    totals[reason],
                    skipped.examples.get(reason, ""),
                )

    def _timed_out(self, item: ScheduledSource, now: float) -> SourceSample:
        """The sample of a source whose run has overrun its deadline and not returned."""
        item.runs_total += 1
        item.errors_total += 1
        item.timeouts_total += 1
        running = time.monotonic() - (item.stuck_since or time.monotonic())
        error = f"timeout: still running after {running:.1f} s (deadline {item.timeout} s)"
        if item.up is not False:
            log.warning("source=%s state=down error=%r", item.source.name, error)
        item.up = False
        return SourceSample(item.source.name, now, running, None, error)

    def _run_due(self, due: list[ScheduledSource]) -> list[SourceSample]:
        """Run ``due`` in order, each within its deadline; a sample per source."""
        samples: list[SourceSample] = []
        inline = [item for item in due if item.timeout is None]
        for item in inline:
            started = self.clock()
            data, error = _call(item, self.roots)
            samples.append(
                self._record(_Outcome(item, started, self.clock() - started, data, error), started)
            )
        pending = [item for item in due if item.timeout is not None]
        while pending:
            # A source whose earlier run is still blocked is not called again.
            runnable = []
            for item in pending:
                if item.stuck_since is not None:
                    samples.append(self._timed_out(item, self.clock()))
                else:
                    runnable.append(item)
            if not runnable:
                break
            runner = self._runner
            if runner is None:
                runner = self._runner = _Runner(self.roots, self.clock)
            overran: ScheduledSource | None = None
            with runner.lock:
                runner.submit(runnable, self.roots)
                while runner.busy:
                    item = runner.work[runner.position]
                    assert item.timeout is not None
                    remaining = runner.deadline_started + item.timeout - time.monotonic()
                    if remaining > 0:
                        runner.lock.wait(remaining)
                        continue
                    overran = item
                    item.stuck_since = runner.deadline_started
                    runner.abandoned = True
                    break
                outcomes = runner.outcomes
                position = runner.position
            for outcome in outcomes:
                samples.append(self._record(outcome, outcome.started))
            if overran is None:
                break
            self._runner = None
            samples.append(self._timed_out(overran, self.clock()))
            pending = runnable[position + 1 :]
        return samples

    def run_cycle(self, force: bool = False) -> Snapshot:
        """Run every due source (every source with ``force``) and return the new snapshot.

        A source that watches the topology generation is due too when the generation moved
        since it last ran; one that was not due at the start is looked at again once the
        others ran, so a PCI event the ``udev`` source hands over in this cycle has the tree
        read in this cycle. The cost is one integer comparison per watching source (the
        ``pci`` source only), twice a cycle."""
        cycle_start = self.clock()
        due: list[ScheduledSource] = []
        # Run only because an input moved: their cadence goes on as planned.
        unscheduled: set[str] = set()
        for item in self.scheduled:
            # A tenth of the interval of slack: the loop's wake-up jitter must not push a
            # source that is due on this tick to the next one.
            if force or cycle_start >= item.next_due - 0.1 * item.interval:
                due.append(item)
            elif item.watches is not None and _input_moved(item):
                due.append(item)
                unscheduled.add(item.source.name)
        by_name = {item.source.name: item for item in due}
        if self.inputs is not None:
            self.inputs.begin_cycle(by_name)
        self._keep(_watch(due), by_name, unscheduled, cycle_start)
        # Sources that watch an input moved by a source of this cycle (or by a monitor thread
        # meanwhile). They share the cycle's cgroup walk as begun: none of them reads it.
        late = [
            item
            for item in self.scheduled
            if item.watches is not None and item.source.name not in by_name and _input_moved(item)
        ]
        if late:
            late_names = {item.source.name: item for item in late}
            self._keep(_watch(late), late_names, set(late_names), cycle_start)
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
                    MappingProxyType(dict(item.skipped_total)),
                    item.timeouts_total,
                )
                for item in self.scheduled
            },
        )
        self.last = snapshot
        return snapshot

    def _keep(
        self,
        due: list[ScheduledSource],
        by_name: dict[str, ScheduledSource],
        unscheduled: set[str],
        cycle_start: float,
    ) -> None:
        """Run ``due`` and keep their samples; all but the ``unscheduled`` ones (run because
        an input moved) are scheduled again."""
        for sample in self._run_due(due):
            name = sample.source
            item = by_name[name]
            if name in self._current:
                self._previous[name] = self._current[name]
            self._current[name] = sample
            if name in unscheduled:
                continue
            # Schedule from the planned time so the cadence does not drift with read cost;
            # after an overrun (or on the first run) start again from now.
            now = sample.monotonic
            planned = item.next_due + item.interval
            if not item.next_due or planned <= now:
                planned = cycle_start + item.interval
            item.next_due = planned

    def close(self) -> None:
        if self._runner is not None:
            with self._runner.lock:
                self._runner.abandoned = True
                self._runner.busy = True
                self._runner.lock.notify_all()
            self._runner = None
        for item in self.scheduled:
            if item.stuck_since is not None:
                continue  # still inside a call: closing under it is not safe
            try:
                item.source.close()
            except Exception as exc:
                log.debug("source=%s close_error=%r", item.source.name, exc)
