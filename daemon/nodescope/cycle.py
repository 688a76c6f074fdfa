"""One cycle of the daemon, the same code whether the daemon or a replay runs it.

A cycle collects the sources that are due (:class:`~nodescope.collect.Collector`), analyses
the snapshot (derived figures, detectors, alert engine: :class:`~nodescope.analysis.Analyzer`),
hands it to the parts that act on the world outside the process (:class:`OutsideParts`: the
Slurm hooks' job tracker, the job drain that runs the remediation policy, the meter of the
daemon's own processes), adds the cycle's own figures, offers it to the exporters and
publishes it.

What a cycle touches outside the process is injected, never reached for: the daemon
(:class:`~nodescope.service.Service`) hands in its hooks, job drain and process meter and
its exporters; a replay (:func:`nodescope.sim.driver.replay`) says in one place which of them
it runs with. The daemon survives an exception in any stage (counted per stage in
``nodescope_cycle_errors_total``, logged once per stage with its trace); a replay is
``strict``: an exception there is a bug a test must see, so it propagates.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from nodescope.analysis import Analyzer
from nodescope.collect import Collector
from nodescope.model.process import ProcessFigures
from nodescope.model.snapshot import Snapshot

log = logging.getLogger("nodescope.service")


class SnapshotObserver(Protocol):
    """A part that sees every analysed snapshot (the job tracker, the job drain)."""

    def observe(self, snapshot: Snapshot) -> object: ...


class ProcessMeasure(Protocol):
    """Measures the daemon's own processes (:class:`~nodescope.selfstats.ProcessMeter`)."""

    def measure(self, serving_pid: int | None = None) -> tuple[ProcessFigures, ...]: ...


def _no_serving_process() -> int | None:
    return None


@dataclass(slots=True)
class OutsideParts:
    """The parts of a cycle that act on the world outside the process. Each one absent
    (``None``) is not run: a cycle without them analyses and exports the same snapshot.

    ``jobs``: the Slurm hooks' job tracker (job registrations, reports); ``job_drain``: drains
    the node through ``scontrol`` when the remediation policy says so (it starts a worker at
    most: nothing outside runs in the cycle itself); ``process_meter``: the daemon's and the
    serving process's memory and CPU, whose pid ``serving_pid`` tells."""

    jobs: SnapshotObserver | None = None
    job_drain: SnapshotObserver | None = None
    process_meter: ProcessMeasure | None = None
    serving_pid: Callable[[], int | None] = _no_serving_process


class LatestSnapshot:
    """An export that keeps the newest snapshot: a replay renders it when the scenario
    scrapes, a one-shot command reads it."""

    def __init__(self) -> None:
        self.snapshot: Snapshot | None = None

    def offer(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot


class Cycle:
    """Runs one cycle per :meth:`run`. ``collector`` and ``analyzer`` may be replaced between
    cycles (a reload builds a new collector). ``offer`` hands the finished snapshot to the
    exporters (rendered there now or when a request asks; a replay keeps it to scrape it at
    the scenario's tick); ``publish`` makes the newest
    documents reachable (the serving process), ``None`` when nothing serves them."""

    def __init__(
        self,
        collector: Collector,
        analyzer: Analyzer,
        offer: Callable[[Snapshot], None],
        publish: Callable[[], None] | None = None,
        outside: OutsideParts | None = None,
        *,
        strict: bool = False,
        every_source: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.collector = collector
        self.analyzer = analyzer
        self.offer = offer
        self.publish = publish
        self.outside = outside if outside is not None else OutsideParts()
        self.strict = strict
        #: Run every source each cycle, due or not (``nodescope check``: a short look).
        self.every_source = every_source
        self.clock = clock
        #: Exceptions each stage raised over the daemon's life (``cycle_errors_total``).
        self.errors: dict[str, int] = {}
        #: Configuration reloads by outcome, exported with each snapshot; the daemon keeps
        #: them, a replay has none.
        self.config_reloads: dict[str, int] = {}
        #: When the last cycle completed (collected, analysed and published); monotonic.
        self.last_completed = clock()

    def survived(self, stage: str, exc: Exception) -> None:
        """Count and log an exception a stage of the cycle raised; the daemon goes on."""
        if self.strict:
            raise exc
        self.errors[stage] = self.errors.get(stage, 0) + 1
        log.error(
            "event=cycle_error stage=%s total=%d error=%r",
            stage,
            self.errors[stage],
            f"{type(exc).__name__}: {exc}",
            exc_info=self.errors[stage] == 1,
        )

    def run(self) -> bool:
        """One cycle; whether it completed: collected, analysed, offered and published
        (:attr:`last_completed` moves then). Every stage is guarded (unless ``strict``): an
        exception in one (a bug, an input nothing foresaw) is logged and counted, the stages
        that can still run do, and the next cycle comes as planned."""
        try:
            if self.every_source:
                snapshot = self.collector.run_cycle(force=True)
            else:
                snapshot = self.collector.run_cycle()
        except Exception as exc:
            self.survived("collect", exc)
            return False
        completed = True
        try:
            snapshot = self.analyzer.analyze(snapshot)
        except Exception as exc:
            self.survived("analyze", exc)
            completed = False
        outside = self.outside
        if outside.jobs is not None:
            try:
                outside.jobs.observe(snapshot)
            except Exception as exc:
                self.survived("jobs", exc)
        if outside.job_drain is not None:
            try:
                # Starts a worker at most: scontrol never runs in the cycle itself.
                outside.job_drain.observe(snapshot)
            except Exception as exc:
                self.survived("remediation", exc)
        processes: tuple[ProcessFigures, ...] = ()
        if outside.process_meter is not None:
            try:
                processes = outside.process_meter.measure(outside.serving_pid())
            except Exception as exc:
                self.survived("processes", exc)
        if self.errors or self.config_reloads or processes:
            snapshot = replace(
                snapshot,
                cycle_errors=self.errors,
                config_reloads=self.config_reloads,
                processes=processes,
            )
        try:
            self.offer(snapshot)
        except Exception as exc:
            self.survived("export", exc)
            return False
        if self.publish is not None:
            try:
                self.publish()
            except Exception as exc:
                self.survived("publish", exc)
                return False
        if completed:
            self.last_completed = self.clock()
        return completed
