"""Drive the daemon against a simulated node: ``replay`` in simulated time, ``demo`` in real
time.

Both run the daemon's own parts — the sources of :meth:`SimulatedNode.sources` reading the
files the node writes under a temporary root, the :class:`~nodescope.collect.Collector`, the
analysis step (detectors and alert engine, :mod:`nodescope.analysis`), the Prometheus
exposition — so what passes here is what a scrape of a real node would show.

``replay`` runs as fast as it can, on the daemon's own cadences: its collector is built by
:meth:`~nodescope.collect.Collector.from_config` from the daemon's default configuration, as
the daemon's composition root (:class:`~nodescope.service.Service`) builds it, so every
source runs at its configured interval, and each source reads its slow files (NVLink and PCIe
error counters, InfiniBand error counters, GPU health, the cgroup tree's static files) every
so many runs exactly as the daemon's sources do: the simulated node builds them with the
registry's own makers and defaults (:meth:`SimulatedNode.sources`). A counter a scenario
raises is therefore seen when the daemon would see it, not earlier (:func:`replay_schedule`).
One cycle runs every ``tick_seconds`` of the daemon's configuration (1 s) with a clock that
reads the simulated second (rates, sample times and alert durations are in simulated seconds)
and is analysed like the daemon's. Each source moves the node to the cycle's second just before
it reads and has only what it reads written (:class:`~nodescope.sim.live.ReadTimeSource`, as
in the demo). At each tick of the scenario /metrics is rendered — a scrape — and the
scenario's expectations are evaluated on it (:mod:`nodescope.sim.expect`); findings are
looked at after every cycle. Runs happen in the caller's thread (no deadline: in simulated
time nothing blocks). Xid events reach the NVML source on its own thread, as on a real node,
so one can be counted a cycle late.

``demo`` runs the daemon's :class:`~nodescope.service.Service` with its configured source
intervals and real clocks on a node in wall time (:class:`~nodescope.sim.live.WallClockNode`):
simulated time is the wall time since the start, each source moves the node to the present
just before it reads, so every counter holds the value of the moment it is read, whatever
the jitter of the daemon's cycle; a simulator thread refreshes every file once per tick for
other readers of the tree (past the scenario's end the node goes on at the rates its
open-ended activities leave), and a view is refreshed once per second.

The notable-event timeline (:class:`Timeline`) is shared by both: sources going down and
up, GPUs lost, Xid errors, findings appearing and clearing.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Protocol, TextIO

from nodescope.analysis import Analyzer
from nodescope.assembly import default_config
from nodescope.assembly import from_mapping as config_from_mapping
from nodescope.collect import Collector, ScheduledSource
from nodescope.config import (
    Config,
    link_events_options,
    netdev_options,
    spool_settings,
)
from nodescope.cycle import Cycle, LatestSnapshot, OutsideParts
from nodescope.detectors.registry import DetectorInfo
from nodescope.model.disks import DISKS
from nodescope.model.infiniband import INFINIBAND
from nodescope.model.nvlink_kmod import NVLINK_KMOD, LinkRates
from nodescope.model.nvml import NVML, XID_MEANINGS
from nodescope.model.snapshot import Snapshot
from nodescope.model.topology import PCI
from nodescope.roots import Roots
from nodescope.service import Service
from nodescope.sim.expect import (
    Evaluator,
    Expectations,
    FindingResult,
    MetricResult,
    check_catalog,
    number,
)
from nodescope.sim.live import ReadTimeSource, WallClockNode
from nodescope.sim.sandbox import prepare as prepare_sandbox
from nodescope.sim.sandbox import sandbox_config
from nodescope.sources.base import Source
from nodescope.sources.registry import SourceInputs
from nodescope_exporters.catalog import CATALOG
from nodescope_exporters.prometheus import FamilyBuilder, MetricsCache, SnapshotCollector

log = logging.getLogger("nodescope.sim")


class ScenarioLike(Protocol):
    """What the driver needs of a :class:`nodescope.sim.scenario.Scenario`."""

    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str: ...

    @property
    def tick_seconds(self) -> float: ...

    @property
    def duration_seconds(self) -> float: ...

    @property
    def expect(self) -> Expectations: ...

    @property
    def source_path(self) -> str | os.PathLike[str] | None: ...


class NodeLike(Protocol):
    """What the driver needs of a :class:`nodescope.sim.node.SimulatedNode`."""

    @property
    def roots(self) -> Roots: ...

    def materialise(self) -> None: ...

    def advance_to(self, t: float) -> None: ...

    def refresh(self, t: float, reader: str | None = None) -> None: ...

    def sources(self, inputs: SourceInputs | None = None) -> list[Source]: ...


NodeFactory = Callable[[Any, Path], NodeLike]


def default_node_factory(scenario: Any, root: Path) -> NodeLike:
    from nodescope.sim.node import SimulatedNode

    node: NodeLike = SimulatedNode(scenario, root)
    return node


def temp_dir() -> str | None:
    """Where to put simulated nodes: a tmpfs when there is one (tens of thousands of small
    files are written), else the system default."""
    from nodescope.sim.node import preferred_temp_dir

    return preferred_temp_dir()


def tick_times(tick_seconds: float, duration_seconds: float) -> list[float]:
    """``0, tick, 2·tick … duration`` computed by multiplication, so a 0.1 s tick does not
    drift by float accumulation over a long scenario."""
    count = int(duration_seconds / tick_seconds + 1e-9)
    return [round(i * tick_seconds, 9) for i in range(count + 1)]


@dataclass(frozen=True, slots=True)
class ReplayStep:
    """One second of a replay: the node moves to ``t``; ``collect``: the daemon runs a cycle
    (its tick); ``scrape``: /metrics is rendered and the expectations are evaluated (the
    scenario's tick)."""

    t: float
    collect: bool
    scrape: bool


def replay_steps(
    scenario_tick: float, daemon_tick: float, duration_seconds: float
) -> list[ReplayStep]:
    """The seconds a replay visits: the daemon's cycles every ``daemon_tick`` and the
    scenario's scrapes every ``scenario_tick``, merged in time order."""
    cycles = set(tick_times(daemon_tick, duration_seconds))
    scrapes = set(tick_times(scenario_tick, duration_seconds))
    return [ReplayStep(t, t in cycles, t in scrapes) for t in sorted(cycles | scrapes)]


def replay_config(node: NodeLike) -> Config:
    """The daemon's default configuration over the node's trees, and the node's traces spool
    (``[sources.traces] spool_dir``) where it has one."""
    spool = getattr(node, "spool_dir", None)
    if spool is None:
        return default_config(roots=node.roots)
    configured = config_from_mapping({"sources": {"traces": {"spool_dir": str(spool)}}})
    return dataclasses.replace(configured, roots=node.roots)


def replay_schedule(
    config: Config, sources: Sequence[Source], inputs: SourceInputs
) -> list[ScheduledSource]:
    """The replay's schedule of the node's ``sources``: the daemon's, built by the function
    the daemon builds it with (:meth:`Collector.from_config`: each source's configured
    interval), run in the caller's thread without a deadline (a deadline bounds real
    waiting; a replay's clock is simulated and its node never blocks)."""
    scheduled = Collector.from_config(config, sources, inputs).scheduled
    for item in scheduled:
        item.timeout = None
    return scheduled


def replay_outside_parts() -> OutsideParts:
    """The parts of a cycle that act outside the process, as a replay runs them: none. A
    simulated node has no Slurm to call the hooks (no prolog registers a job over the
    socket); a drain would run ``scontrol`` on whatever machine runs the replay; the process
    meter would measure the replay's own process, which is no daemon. Each would make a
    replay's result depend on where it runs, and none feeds anything a scenario checks. The
    demo runs them all, on its sandboxed configuration (:mod:`nodescope.sim.sandbox`)."""
    return OutsideParts(jobs=None, job_drain=None, process_meter=None)


def format_t(t: float) -> str:
    """``t=  12s`` (``t=12.5s`` for fractional ticks): the timeline's time column."""
    return f"t={int(t):>4d}s" if float(t).is_integer() else f"t={t:>6.1f}s"


# --------------------------------------------------------------------------------------------
# The timeline of notable events


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    """``kind`` is ``source_down``, ``source_up``, ``gpu_lost``, ``xid``, ``finding`` (a
    detector's finding appeared; ``subject`` is its key) or ``finding_cleared``."""

    t: float
    kind: str
    subject: str
    detail: str

    def text(self) -> str:
        if self.kind == "source_down":
            what = f"source {self.subject} DOWN: {self.detail}"
        elif self.kind == "source_up":
            what = f"source {self.subject} up again"
        elif self.kind == "finding":
            what = f"finding {self.subject}: {self.detail}"
        elif self.kind == "finding_cleared":
            what = f"finding {self.subject} cleared"
        else:
            what = f"{self.subject}: {self.detail}"
        return f"{format_t(self.t)}  {what}"


class Timeline:
    """Turns consecutive snapshots into events: what changed, once, when it changed."""

    def __init__(self) -> None:
        self.events: list[TimelineEvent] = []
        self._up: dict[str, bool] = {}
        self._lost: set[str] = set()
        self._xids: dict[tuple[int | None, str, int], int] = {}
        self._findings: set[str] = set()

    def update(self, t: float, snapshot: Snapshot) -> list[TimelineEvent]:
        new: list[TimelineEvent] = []
        for name, status in snapshot.status.items():
            was = self._up.get(name)
            if status.up == was:
                continue
            self._up[name] = status.up
            if not status.up:
                sample = snapshot.current.get(name)
                error = sample.error if sample is not None and sample.error else "no data"
                new.append(TimelineEvent(t, "source_down", name, error))
            elif was is not None:
                new.append(TimelineEvent(t, "source_up", name, ""))
        nvml = snapshot.latest(NVML)
        if nvml is not None:
            for lost in nvml.lost:
                if lost.uuid not in self._lost:
                    self._lost.add(lost.uuid)
                    new.append(
                        TimelineEvent(
                            t,
                            "gpu_lost",
                            f"gpu {lost.gpu} ({lost.pci_address})",
                            f"lost by NVML ({lost.uuid})",
                        )
                    )
            for xid in nvml.xids:
                xid_key = (xid.gpu, xid.pci_address, xid.xid)
                before = self._xids.get(xid_key, 0)
                if xid.count > before:
                    self._xids[xid_key] = xid.count
                    meaning = XID_MEANINGS.get(xid.xid)
                    gpu = "gpu ?" if xid.gpu is None else f"gpu {xid.gpu}"
                    new.append(
                        TimelineEvent(
                            t,
                            "xid",
                            f"{gpu} ({xid.pci_address})",
                            f"Xid {xid.xid}"
                            + (f" ({meaning})" if meaning else "")
                            + f" x{xid.count - before}",
                        )
                    )
        keys: set[str] = set()
        for finding in sorted(snapshot.findings, key=lambda f: f.key):
            keys.add(finding.key)
            if finding.key not in self._findings:
                detail = f"({finding.severity.label}) {finding.message}".rstrip()
                new.append(TimelineEvent(t, "finding", finding.key, detail))
        for key in sorted(self._findings - keys):
            new.append(TimelineEvent(t, "finding_cleared", key, ""))
        self._findings = keys
        self.events.extend(new)
        return new


# --------------------------------------------------------------------------------------------
# Replay


@dataclass(frozen=True, slots=True)
class ReplayResult:
    scenario: str
    description: str
    source_path: str | None
    tick_seconds: float
    duration_seconds: float
    cycles: int
    daemon_tick_seconds: float
    elapsed_seconds: float
    sources: tuple[str, ...]
    timeline: tuple[TimelineEvent, ...]
    metrics: tuple[MetricResult, ...]
    findings: tuple[FindingResult, ...]

    @property
    def passed(self) -> bool:
        return all(m.passed for m in self.metrics) and all(f.passed for f in self.findings)

    @property
    def failures(self) -> tuple[MetricResult, ...]:
        return tuple(m for m in self.metrics if not m.passed)


class SimClock:
    """The collector's monotonic clock in a replay: the simulated second being collected."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _wait_for_xid_watcher(node: NodeLike, timeout: float = 2.0) -> None:
    # The NVML source takes Xid events on its own thread, registered after the first
    # collection: an Xid the node injects before that would be lost, which no real daemon
    # that has been up for a second would suffer. Wait (bounded) for the registration.
    nvml = getattr(node, "nvml", None)
    if nvml is None or not getattr(nvml, "gpus", None):
        return
    registered = getattr(nvml, "registered_event_sets", None)
    if not callable(registered):
        return
    deadline = time.monotonic() + timeout
    while not registered() and time.monotonic() < deadline:
        time.sleep(0.005)


#: Longest a replay waits for one cycle's background work (a trace parser's answer).
BACKGROUND_WORK_SECONDS = 120.0


def _wait_for_background_work(sources: Sequence[Source | ReadTimeSource]) -> None:
    for wrapped in sources:
        source = wrapped.source if isinstance(wrapped, ReadTimeSource) else wrapped
        worker = getattr(source, "worker", None)
        wait_idle = getattr(worker, "wait_idle", None)
        if callable(wait_idle):
            wait_idle(BACKGROUND_WORK_SECONDS)


def replay(
    scenario: ScenarioLike,
    root: Path,
    *,
    node_factory: NodeFactory | None = None,
    builders: list[FamilyBuilder] | None = None,
    detectors: Sequence[DetectorInfo] | None = None,
    on_cycle: Callable[[float, Snapshot, bytes], None] | None = None,
) -> ReplayResult:
    """Run ``scenario`` in simulated time on a node materialised under ``root`` (an empty
    directory the caller owns) and evaluate its expectations.

    Raises :class:`~nodescope.errors.ParseError` before running anything when an expectation
    names a metric or label nodescope does not export. Each cycle is the daemon's own
    (:class:`~nodescope.cycle.Cycle`, as :class:`~nodescope.service.Service` runs it), without
    the parts that act outside the process (:func:`replay_outside_parts`); ``detectors``
    replaces the registry's. ``builders`` narrows the exposition (tests);
    ``on_cycle`` sees the analysed snapshot and rendered body of every scrape (every tick of
    the scenario).
    """
    source_path = None if scenario.source_path is None else str(scenario.source_path)
    cache = MetricsCache(SnapshotCollector(builders))
    # The catalogue is filled by importing the area modules, which the cache just did.
    check_catalog(scenario.expect, CATALOG, source_path or scenario.name)

    started = time.monotonic()
    node = (node_factory or default_node_factory)(scenario, root)
    node.materialise()
    clock = SimClock()
    wall_base = time.time()
    # The daemon's configuration as it starts without a file: its tick and source intervals;
    # with the node's spool as [sources.traces] spool_dir when the scenario drops traces.
    config = replay_config(node)
    inputs = SourceInputs(
        spool=spool_settings(config),
        netdev=netdev_options(config),
        link_events=link_events_options(config),
    )
    # Each source moves the node to the cycle's second and has what it reads written just
    # before it reads, as in the demo: a cycle writes what its due sources read, not every
    # file of the node (counters are integrated over time, so no value changes).
    sources = [
        ReadTimeSource(source, lambda name: node.refresh(clock.now, name))
        for source in node.sources(inputs=inputs)
    ]
    collector = Collector(
        roots=node.roots,
        scheduled=replay_schedule(config, sources, inputs),
        clock=clock,
        wall_clock=lambda: wall_base + clock.now,
        inputs=inputs,
    )
    # Rendered when the scenario scrapes, at its own tick.
    kept = LatestSnapshot()
    # The daemon's cycle (nodescope.cycle), strict: an exception in any stage is a bug the
    # replay reports rather than a stage the daemon would survive.
    cycle = Cycle(
        collector,
        Analyzer.from_config(config, detectors),
        kept.offer,
        outside=replay_outside_parts(),
        strict=True,
        clock=clock,
    )
    evaluator = Evaluator(scenario.expect)
    timeline = Timeline()
    steps = replay_steps(scenario.tick_seconds, config.tick_seconds, scenario.duration_seconds)
    snapshot: Snapshot | None = None
    cycles = 0
    try:
        for step in steps:
            t = step.t
            clock.now = t
            if step.collect:
                cycle.run()
                snapshot = kept.snapshot
                assert snapshot is not None  # strict: a cycle that failed raised
                # Work a source hands to a process of its own (the traces parser) takes
                # seconds of real time, a cycle or two of a daemon's: a replay waits for it
                # each cycle, so what it finds shows in the next one whatever the machine's
                # load, as on a node.
                _wait_for_background_work(sources)
                if cycles == 0:
                    _wait_for_xid_watcher(node)
                cycles += 1
                timeline.update(t, snapshot)
                evaluator.observe_findings(t, snapshot.findings)
            if step.scrape and snapshot is not None:
                body = cache.update(snapshot)
                evaluator.observe(t, body.decode("utf-8"))
                if on_cycle is not None:
                    on_cycle(t, snapshot, body)
    finally:
        cycle.collector.close()
        cycle.analyzer.close()
    return ReplayResult(
        scenario=scenario.name,
        description=scenario.description,
        source_path=source_path,
        tick_seconds=scenario.tick_seconds,
        duration_seconds=scenario.duration_seconds,
        cycles=cycles,
        daemon_tick_seconds=config.tick_seconds,
        elapsed_seconds=time.monotonic() - started,
        sources=tuple(s.name for s in sources),
        timeline=tuple(timeline.events),
        metrics=evaluator.metric_results(),
        findings=evaluator.finding_results(checkable=bool(cycle.analyzer.detectors)),
    )


def _labels_object(labels: Sequence[tuple[str, str]]) -> dict[str, str]:
    return dict(labels)


def metric_result_document(result: MetricResult) -> dict[str, Any]:
    e = result.expectation
    v = result.first_violation
    return {
        "pointer": e.pointer,
        "expectation": e.describe(),
        "name": e.name,
        "labels": _labels_object(e.labels),
        "aggregate": e.aggregate,
        "min": e.min,
        "max": e.max,
        "from": e.start,
        "to": e.end,
        "description": e.description,
        "status": result.status,
        "reason": result.reason,
        "observed_min": result.observed_min,
        "observed_max": result.observed_max,
        "cycles_in_window": result.cycles_in_window,
        "cycles_evaluated": result.cycles_evaluated,
        "violations": result.violations,
        "first_violation": None
        if v is None
        else {"t": v.t, "labels": _labels_object(v.labels), "value": v.value},
        "series": [_labels_object(s) for s in result.series],
    }


def finding_result_document(result: FindingResult) -> dict[str, Any]:
    e = result.expectation
    doc: dict[str, Any] = {
        "expectation": result.describe(),
        "status": result.status,
        "reason": result.reason,
        "first_seen": result.first_seen,
        "finding": result.finding,
    }
    if e is None:
        doc["kind"] = "no_other_findings"
    else:
        doc.update(
            pointer=e.pointer,
            kind=e.kind,
            subjects=list(e.subjects),
            **{"from": e.start, "to": e.end},
            description=e.description,
        )
    return doc


def _count(findings: Sequence[FindingResult], status: str) -> int:
    return sum(1 for f in findings if f.status == status)


def replay_document(result: ReplayResult) -> dict[str, Any]:
    """``nodescope replay --json``: the timeline, every expectation, the summary."""
    failed = len(result.failures)
    return {
        "scenario": result.scenario,
        "description": result.description,
        "source": result.source_path,
        "tick_seconds": result.tick_seconds,
        "duration_seconds": result.duration_seconds,
        "cycles": result.cycles,
        "daemon_tick_seconds": result.daemon_tick_seconds,
        "elapsed_seconds": round(result.elapsed_seconds, 3),
        "sources": list(result.sources),
        "timeline": [
            {"t": e.t, "kind": e.kind, "subject": e.subject, "detail": e.detail, "text": e.text()}
            for e in result.timeline
        ],
        "expectations": {
            "metrics": [metric_result_document(m) for m in result.metrics],
            "findings": [finding_result_document(f) for f in result.findings],
        },
        "summary": {
            "passed": result.passed,
            "metrics_passed": len(result.metrics) - failed,
            "metrics_failed": failed,
            "findings_passed": _count(result.findings, "pass"),
            "findings_failed": _count(result.findings, "fail"),
            "findings_unchecked": _count(result.findings, "unchecked"),
        },
    }


def replay_text(result: ReplayResult) -> str:
    """The human report: header, timeline, one line per expectation, summary."""
    lines = [
        f"scenario {result.scenario}: {result.description}",
        f"  {result.cycles} cycles of the daemon (every {number(result.daemon_tick_seconds)} s)"
        f" over {number(result.duration_seconds)} s simulated, scraped every"
        f" {number(result.tick_seconds)} s, in {result.elapsed_seconds:.1f} s; "
        f"sources: {', '.join(result.sources)}",
        "",
        "timeline:",
    ]
    lines += [f"  {e.text()}" for e in result.timeline] or ["  (nothing notable)"]
    lines += ["", "expectations:"]
    for m in result.metrics:
        observed = (
            f"observed {number(m.observed_min)}..{number(m.observed_max)}"
            if m.observed_min is not None
            else "observed nothing"
        )
        mark = "ok  " if m.passed else "FAIL"
        lines.append(f"  {mark} {m.expectation.describe()}")
        lines.append(f"       {observed}; {m.reason}  [{m.expectation.pointer}]")
    for f in result.findings:
        mark = {"pass": "ok  ", "fail": "FAIL"}.get(f.status, "skip")
        where = f"  [{f.expectation.pointer}]" if f.expectation is not None else ""
        lines.append(f"  {mark} {f.describe()}: {f.reason}{where}")
    if not result.metrics and not result.findings:
        lines.append("  (none)")
    failed = len(result.failures)
    verdict = "PASS" if result.passed else "FAIL"
    findings = [
        f"{n} {label}"
        for n, label in (
            (_count(result.findings, "pass"), "held"),
            (_count(result.findings, "fail"), "failed"),
            (_count(result.findings, "unchecked"), "not checkable yet"),
        )
        if n
    ]
    lines += [
        "",
        f"{verdict}: {len(result.metrics) - failed} of {len(result.metrics)} metric "
        f"expectation(s) held"
        + (f", {failed} failed" if failed else "")
        + (f"; finding expectations: {', '.join(findings)}" if findings else ""),
    ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Demo


class Simulator(threading.Thread):
    """Refreshes every file of the node once per tick of wall time until stopped, for readers
    other than the daemon's sources (which refresh what they read themselves) and for the
    timeline's events. ``t`` is the simulated second last reached; an error stops the thread
    and is kept in ``error``."""

    def __init__(
        self, node: WallClockNode, tick_seconds: float, on_error: Callable[[], None]
    ) -> None:
        super().__init__(name="nodescope-sim", daemon=True)
        self.node = node
        self.tick_seconds = tick_seconds
        self.on_error = on_error
        self.stop_event = threading.Event()
        self.error: BaseException | None = None

    @property
    def t(self) -> float:
        return self.node.t

    def run(self) -> None:
        try:
            # Time is the wall clock's: after a stall (a suspended terminal) the next refresh
            # is simply at the present, with no burst of missed ticks to replay.
            while not self.stop_event.wait(self.tick_seconds):
                self.node.refresh()
        except BaseException as exc:  # reported by the demo, which then stops
            self.error = exc
            self.on_error()

    def stop(self) -> None:
        self.stop_event.set()


def _gbps(value: float | None) -> str:
    return "     -" if value is None else f"{value / 1e9:6.2f}"


def _mbps(value: float | None) -> str:
    return "      -" if value is None else f"{value:7.1f}"


def _most(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def nvlink_kmod_view(snapshot: Snapshot, max_rows: int = 12) -> list[str]:
    """Rows of the view for the nvlink_counter module, one per device (a GPU on the simulated
    node), when it serves: NVLink TX/RX summed over the device's links, and over its links the
    highest average utilisation and stall rate, the highest per-sample peaks of the last
    window, and the largest share of samples over the module's stall threshold: the bursts
    an average hides."""
    data = snapshot.latest(NVLINK_KMOD)
    rates = snapshot.derived.nvlink_rates
    if data is None or data.snapshot is None or not data.serving:
        return []
    if rates is None:
        return []
    head = data.snapshot.header
    devices: dict[int, list[LinkRates]] = {}
    for lr in rates.links:
        devices.setdefault(lr.device, []).append(lr)
    lines = [
        f"NVLink from the nvlink_counter module ({head.period_ns / 1000:g} µs samples, "
        f"{head.source_name}): worst link of each device",
        "dev links   tx GB/s   rx GB/s  util  peak util  stall/µs  peak stall/µs  "
        f"samples >{head.stall_threshold}/µs",
    ]
    for device in sorted(devices)[:max_rows]:
        links = devices[device]
        gone = sum(1 for x in links if x.device_gone)
        tx = sum(x.tx_bytes_per_second or 0.0 for x in links if not x.device_gone)
        rx = sum(x.rx_bytes_per_second or 0.0 for x in links if not x.device_gone)
        live = [x for x in links if not x.device_gone and x.window_samples]
        util = _most([x.utilisation for x in live])
        stall = _most([x.stall_cycles_per_microsecond for x in live])
        over = _most([x.window_stall_over_threshold_ratio for x in live])
        peak_util = _most([x.window_max_utilisation for x in live])
        peak_stall = _most([float(x.window_max_stall_cycles_per_microsecond) for x in live])
        if not live:
            lines.append(
                f"{device:>3} {len(links):>5}  " + ("GONE" if gone else "no samples this window")
            )
            continue
        lines.append(
            f"{device:>3} {len(links):>5}    {_gbps(tx)}    {_gbps(rx)}"
            f"  {_pct(util)}     {_pct(peak_util)}  {_num(stall, 8)}  {_num(peak_stall, 13)}"
            f"  {_pct(over):>12}" + (f"  ({gone} gone)" if gone else "")
        )
    lines.append("")
    return lines


def _pct(value: float | None) -> str:
    return "   -" if value is None else f"{value:4.0%}"


def _num(value: float | None, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}.0f}"


def demo_view(
    scenario: ScenarioLike,
    t: float,
    snapshot: Snapshot | None,
    events: Sequence[TimelineEvent],
    metrics_url: str,
    max_rows: int = 12,
    detectors: bool = True,
) -> str:
    """The text of one refresh: GPUs (PCIe and NVLink rates, link, root port), disks, IB
    ports, source health, findings, recent events. ``detectors``: whether any detector runs
    (else "no findings" means nothing)."""
    ended = " (timeline over; node holds its last rates)" if t > scenario.duration_seconds else ""
    lines = [
        f"nodescope demo: {scenario.name}  simulated t={number(t)}s of "
        f"{number(scenario.duration_seconds)}s{ended}",
        f"  {scenario.description}",
        f"  {metrics_url}   Ctrl-C stops",
        "",
    ]
    if snapshot is None:
        return "\n".join([*lines, "waiting for the first collection cycle…"]) + "\n"

    topology = snapshot.latest(PCI)

    def root_port(bdf: str | None) -> str:
        # The unit of PCIe contention: devices that share it share its bandwidth.
        device = topology.get(bdf) if topology is not None and bdf else None
        return (device.root_port or "-") if device is not None else "?"

    nvml = snapshot.latest(NVML)
    nvml_rates = snapshot.derived.gpu_rates
    if nvml is not None:
        rates = {g.index: g for g in nvml_rates.gpus} if nvml_rates is not None else {}
        lines.append(
            "GPU  PCI address   root port     link      PCIe GB/s H2D   D2H"
            "   NVLink GB/s tx    rx  util"
        )
        for gpu in nvml.gpus[:max_rows]:
            r = rates.get(gpu.index)
            link = f"Gen{gpu.pcie_gen_current or '?'} x{gpu.pcie_width_current or '?'}"
            if (gpu.pcie_gen_current, gpu.pcie_width_current) != (
                gpu.pcie_gen_max,
                gpu.pcie_width_max,
            ):
                link += "*"
            nv_tx = nv_rx = None
            if r is not None and r.nvlinks:
                nv_tx = sum(x.data_tx_bytes_per_second or 0.0 for x in r.nvlinks)
                nv_rx = sum(x.data_rx_bytes_per_second or 0.0 for x in r.nvlinks)
            util = "-" if gpu.gpu_util_percent is None else f"{gpu.gpu_util_percent}%"
            lines.append(
                f"{gpu.index:>3}  {gpu.pci_address:<13} {root_port(gpu.pci_address):<13} "
                f"{link:<9}"
                f"      {_gbps(r.pcie_rx_bytes_per_second if r else None)}"
                f" {_gbps(r.pcie_tx_bytes_per_second if r else None)}"
                f"          {_gbps(nv_tx)} {_gbps(nv_rx)} {util:>5}"
            )
        for lost in nvml.lost:
            lines.append(f"{lost.gpu:>3}  {lost.pci_address:<13} LOST")
        lines.append("  (* link below its maximum; H2D = bytes the GPU received)")
        lines.append("")

    lines += nvlink_kmod_view(snapshot, max_rows)
    iostat = snapshot.derived.disk_rates
    disks = snapshot.latest(DISKS)
    if iostat is not None and iostat.devices:
        controller: dict[str, str | None] = {}
        for ns in disks.nvme if disks is not None else ():
            addresses = [p.pci_address for p in ns.paths if p.pci_address]
            controller[ns.disk] = addresses[0] if addresses else None
        lines.append("disk           root port      read MB/s  write MB/s   util")
        busiest = sorted(iostat.devices, key=lambda d: -(d.rmb_s + d.wmb_s))[:max_rows]
        for dev in sorted(busiest, key=lambda d: d.device):
            above = root_port(controller.get(dev.device))
            lines.append(
                f"{dev.device:<14} {above:<13} {_mbps(dev.rmb_s)}     {_mbps(dev.wmb_s)} "
                f"{dev.util_pct:5.0f}%"
            )
        lines.append("")

    ib = snapshot.latest(INFINIBAND)
    ib_rates = snapshot.derived.ib_rates
    if ib is not None and ib.devices:
        lines.append("IB port        state     rate Gb/s   tx GB/s   rx GB/s")
        for port in list(ib.ports())[:max_rows]:
            pr = ib_rates.port(port.device, port.port) if ib_rates is not None else None
            state = port.state.name if port.state is not None else "?"
            rate = f"{port.rate.gbps:g}" if port.rate is not None else "?"
            lines.append(
                f"{port.device + '/' + str(port.port):<14} {state:<9} {rate:>9}"
                f"    {_gbps(pr.xmit_bytes_per_second if pr else None)}"
                f"    {_gbps(pr.rcv_bytes_per_second if pr else None)}"
            )
        lines.append("")

    health = []
    for name in sorted(snapshot.status):
        status = snapshot.status[name]
        health.append(f"{name} {'up' if status.up else 'DOWN'}")
    lines.append("sources: " + ", ".join(health))
    if snapshot.findings:
        lines.append("findings:")
        ordered = sorted(snapshot.findings, key=lambda f: (-f.severity, f.key))
        for finding in ordered[:max_rows]:
            lines.append(f"  {finding.severity.label.upper():<8} {finding.message or finding.key}")
    else:
        lines.append("findings: none" + ("" if detectors else " (no detectors registered)"))
    if events:
        lines.append("")
        lines.append("recent events:")
        lines += [f"  {e.text()}" for e in events[-5:]]
    return "\n".join(lines) + "\n"


CLEAR = "\x1b[H\x1b[2J"


class ViewCache(MetricsCache):
    """The exposition cache, keeping the analysed snapshot it was last offered for the view."""

    last: Snapshot | None = None

    def offer(self, snapshot: Snapshot) -> int:
        generation = super().offer(snapshot)
        self.last = snapshot
        return generation


def _live_collector(config: Config, live: WallClockNode) -> Collector:
    """The collector of the live node's sources, built to share one set of inputs (the
    traces spool among them, as the daemon's collector builds them)."""
    inputs = SourceInputs(
        spool=spool_settings(config),
        netdev=netdev_options(config),
        link_events=link_events_options(config),
    )
    return Collector.from_config(config, live.sources(inputs), inputs)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def demo(
    scenario: ScenarioLike,
    listen: str,
    *,
    duration: float | None = None,
    tty: bool = True,
    out: TextIO | None = None,
    node_factory: NodeFactory | None = None,
    install_signal_handlers: bool = True,
    settings: Config | None = None,
) -> int:
    """Serve /metrics for a simulated node in real time until Ctrl-C/SIGTERM or ``duration``
    seconds. The node lives in a temporary directory that is removed on the way out.
    ``settings`` supplies the alert and detector settings (the node, the listen address and
    the one-second tick are the demo's own). Returns the exit status."""
    stream = out or sys.stdout
    if install_signal_handlers:
        # Until the service's own handlers are in place (building a DGX-class node takes a
        # moment), SIGTERM unwinds like Ctrl-C so the directory is still removed.
        signal.signal(signal.SIGTERM, _interrupt)
    root = Path(tempfile.mkdtemp(prefix="nodescope-demo-", dir=temp_dir()))
    try:
        return _demo(
            scenario,
            listen,
            root,
            duration,
            tty,
            stream,
            node_factory,
            install_signal_handlers,
            settings or default_config(),
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
        print(f"removed {root}", file=stream, flush=True)


def _demo(
    scenario: ScenarioLike,
    listen: str,
    root: Path,
    duration: float | None,
    tty: bool,
    stream: TextIO,
    node_factory: NodeFactory | None,
    install_signal_handlers: bool,
    settings: Config,
) -> int:
    node = (node_factory or default_node_factory)(scenario, root)
    node.materialise()
    node.advance_to(0.0)
    live = WallClockNode(node)
    # Every path the daemon writes is under the demo's directory (nodescope.sim.sandbox).
    config = sandbox_config(root, node.roots, listen, settings)
    if getattr(node, "spool_dir", None) is not None and spool_settings(settings) is None:
        # The scenario drops traces: the daemon reads the node's spool (under the demo's
        # directory too), as in a replay.
        traces = replay_config(node).sources["traces"]
        config = dataclasses.replace(config, sources={**config.sources, "traces": traces})
    hook_config = prepare_sandbox(root, config)
    service = Service(
        lambda: config,
        make_collector=lambda cfg: _live_collector(cfg, live),
    )
    # The view shows the analysed snapshot (with findings), which the cache is handed.
    view_cache = ViewCache()
    service.cache = view_cache
    try:
        service.start_server()
    except OSError as exc:
        print(f"nodescope demo: cannot listen on {listen}: {exc}", file=sys.stderr)
        service.shutdown()
        return 1
    assert service.server is not None
    url = f"http://{service.server.bound}/metrics"
    print(
        f"nodescope demo: scenario {scenario.name}, node under {root}, serving {url}",
        file=stream,
        flush=True,
    )
    print(
        f"nodescope demo: Slurm hooks: nodescope slurm prolog|epilog --config {hook_config}"
        f" (job reports in {config.slurm.reports_dir})",
        file=stream,
        flush=True,
    )
    if install_signal_handlers:
        service.install_signal_handlers()

    simulator = Simulator(live, scenario.tick_seconds, service.request_stop)
    timeline = Timeline()
    view_stop = threading.Event()
    started = time.monotonic()

    def show() -> None:
        failed = False
        while not view_stop.wait(1.0):
            if duration is not None and time.monotonic() - started >= duration:
                service.request_stop()
            try:
                snapshot = view_cache.last
                if snapshot is not None and snapshot.cycle:
                    timeline.update(simulator.t, snapshot)
                text = demo_view(
                    scenario,
                    simulator.t,
                    snapshot,
                    timeline.events,
                    url,
                    detectors=bool(service.analyzer.detectors),
                )
            except Exception as exc:  # the view must never take the demo (or --duration) down
                if not failed:
                    log.exception("event=view_failed")
                    failed = True
                text = f"view failed: {type(exc).__name__}: {exc}\n"
            if tty:
                stream.write(CLEAR + text)
            else:
                stream.write(f"--- {format_t(time.monotonic() - started)} wall\n{text}\n")
            stream.flush()

    viewer = threading.Thread(target=show, name="nodescope-view", daemon=True)
    simulator.start()
    viewer.start()
    try:
        status = service.run()
    finally:
        simulator.stop()
        view_stop.set()
        simulator.join(5.0)
        viewer.join(5.0)
    if simulator.error is not None:
        print(f"nodescope demo: the simulated node failed: {simulator.error!r}", file=sys.stderr)
        return 1
    return status
