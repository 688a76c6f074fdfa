"""The simulated node in continuous time: a counter read at any moment holds the value of
that moment, so the rate between any two reads is the scenario's, however the reads fall
against the scenario's ticks (:meth:`SimulatedNode.refresh`, :mod:`nodescope.sim.live`,
``run_node``'s real-time loop)."""

from __future__ import annotations

import itertools
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodescope.collect import Collector, ScheduledSource
from nodescope.kmod_abi import parse_snapshot
from nodescope.sim.live import ReadTimeSource, WallClockNode
from nodescope.sim.node import EPOCH, SimulatedNode, make_temp_root
from nodescope.sim.run_node import run_in_real_time
from nodescope.sim.scenario import load_scenario
from nodescope.sources.diskstats import IostatReport, parse_diskstats

CONTENTION = load_scenario("root-port-contention")
#: The scenario's rates while its loader runs (t = 10 to 50).
DISK_READ_BPS = 6.5e9
GPU0_H2D_BPS = 41e9
IB_RX_BPS = 2e9
#: CPU of job 81740: the rank at 100 % and twelve loaders at 95 %, in CPU seconds per second.
JOB_CPUS = 1.0 + 12 * 0.95


@pytest.fixture
def node_root() -> Iterator[Path]:
    root = make_temp_root("nodescope-sim-live-")
    shutil.rmtree(root)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _counters(node: SimulatedNode) -> dict[str, float]:
    """The raw counters, each read right after a refresh for the source that reads it."""
    disks = {d.name: d for d in parse_diskstats((node.roots.procfs / "diskstats").read_text())}
    ib = node.roots.sysfs / "class/infiniband/mlx5_0/ports/1/counters/port_rcv_data"
    job = node.roots.cgroupfs / "system.slice/slurmstepd.scope/job_81740/cpu.stat"
    usage = dict(line.split() for line in job.read_text().splitlines())
    rank = (node.roots.procfs / str(node.pid_of("vid-rank")) / "stat").read_text()
    fields = rank.rsplit(")", 1)[1].split()
    return {
        "disk_sectors_read": disks["nvme0n1"].sectors_read,
        "gpu0_pcie_rx_bytes": node.nvml.gpus[0].pcie_rx_bytes,
        "ib_rcv_words": int(ib.read_text()),
        "job_usage_usec": int(usage["usage_usec"]),
        "rank_cpu_ticks": int(fields[11]) + int(fields[12]),
    }


#: counter -> (units per second, the reader whose refresh writes it, rounding of one read)
EXPECTED = {
    "disk_sectors_read": (DISK_READ_BPS / 512, "disks", 1),
    "gpu0_pcie_rx_bytes": (GPU0_H2D_BPS, "nvml", 1),
    "ib_rcv_words": (IB_RX_BPS / 4, "infiniband", 1),
    "job_usage_usec": (JOB_CPUS * 1e6, "cgroups", 1),
    # utime and stime are each whole clock ticks
    "rank_cpu_ticks": (100.0, "threads", 2),
}


@pytest.mark.slow  # a live simulated node per example
@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    first=st.floats(10.0, 20.0),
    gaps=st.lists(st.floats(0.013, 3.7), min_size=2, max_size=12),
)
def test_the_rate_between_any_two_reads_is_the_scenarios(
    node_root: Path, first: float, gaps: list[float]
) -> None:
    """Reads at arbitrary moments, off the 1 s ticks: the increase between any two equals
    rate × time, within the counter's own rounding (a step function per tick would be off
    by up to a whole tick's traffic)."""
    shutil.rmtree(node_root, ignore_errors=True)
    node = SimulatedNode(CONTENTION, node_root)
    node.materialise()
    node.advance_to(0.0)
    times = [first]
    for gap in gaps:
        if times[-1] + gap > 50.0:
            break
        times.append(times[-1] + gap)
    readings: list[tuple[float, dict[str, float]]] = []
    for t in times:
        values: dict[str, float] = {}
        for name, (_rate, reader, _rounding) in EXPECTED.items():
            node.refresh(t, reader)
            values[name] = _counters(node)[name]
        readings.append((t, values))
    for i, (t0, v0) in enumerate(readings):
        for t1, v1 in readings[i + 1 :]:
            for name, (rate, _reader, rounding) in EXPECTED.items():
                moved = v1[name] - v0[name]
                assert abs(moved - rate * (t1 - t0)) <= rounding + 1e-9 * rate, (
                    name,
                    t0,
                    t1,
                    moved,
                    rate * (t1 - t0),
                )


def test_a_refresh_writes_only_what_its_reader_reads(node_root: Path) -> None:
    node = SimulatedNode(CONTENTION, node_root)
    node.materialise()
    node.advance_to(10.0)
    ib = node.roots.sysfs / "class/infiniband/mlx5_0/ports/1/counters/port_rcv_data"
    diskstats = node.roots.procfs / "diskstats"
    ib_before, disks_before = ib.read_text(), diskstats.read_text()
    node.refresh(12.5, "disks")
    assert ib.read_text() == ib_before
    assert diskstats.read_text() != disks_before
    # The InfiniBand counters catch up at their own reader's refresh, with nothing lost.
    node.refresh(13.0, "infiniband")
    assert int(ib.read_text()) - int(ib_before) == pytest.approx(IB_RX_BPS / 4 * 3.0, abs=1)


def test_the_module_window_is_taken_only_by_its_reader(node_root: Path) -> None:
    """/dev/nvlink_stats keeps one window per open file: samples since that reader's previous
    read, however often the node is refreshed for the other sources."""
    node = SimulatedNode(load_scenario("nvlink-stall-bursts"), node_root)
    node.materialise()
    node.advance_to(1.0)
    before = node.nvlink_snapshot_path.read_bytes()
    for t in (1.3, 1.7, 2.2, 2.9):
        node.refresh(t, "disks")
        node.refresh(t)
    assert node.nvlink_snapshot_path.read_bytes() == before
    node.refresh(3.25, "nvlink_kmod")
    snapshot = parse_snapshot(node.nvlink_snapshot_path.read_bytes())
    assert snapshot.header.window_ns == 2_250_000_000
    assert snapshot.header.timestamp_ns - parse_snapshot(before).header.timestamp_ns == (
        2_250_000_000
    )


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_demo_sources_read_the_true_rate_whatever_the_cycle_jitter(node_root: Path) -> None:
    """The demo's path: a wall-clock node whose sources refresh before they read, collected
    at jittered moments (a loaded machine); every disk rate is the scenario's."""
    node = SimulatedNode(CONTENTION, node_root)
    node.materialise()
    node.advance_to(0.0)
    clock = FakeClock()
    live = WallClockNode(node, clock=clock)
    sources = live.sources()
    try:
        assert all(isinstance(s, ReadTimeSource) for s in sources)
        disks = [s for s in sources if s.name == "disks"]
        collector = Collector(
            roots=node.roots,
            scheduled=[ScheduledSource(s, 1.0) for s in disks],
            clock=clock,
            wall_clock=lambda: EPOCH + clock.now,
        )
        # A cycle a second, each late by a different fraction of the tick, across the ticks.
        lateness = [0.0, 0.97, 0.02, 0.51, 0.99, 0.0, 0.33, 0.95, 0.05, 0.6]
        rates = []
        for n, late in enumerate(lateness):
            clock.now = 1000.0 + 15.0 + n + late
            snapshot = collector.run_cycle(force=True)
            report = snapshot.derived.disk_rates
            if isinstance(report, IostatReport):
                (device,) = [d for d in report.devices if d.device == "nvme0n1"]
                rates.append(device.rmb_s * 2**20)
        assert len(rates) == len(lateness) - 1
        for rate, (late, later) in zip(rates, itertools.pairwise(lateness), strict=True):
            # iostat's interval is /proc/uptime's, in hundredths of a second; a sector is the
            # counter's own unit. Steps of a tick would be off by whole seconds of traffic.
            seconds = 1.0 + later - late
            assert abs(rate - DISK_READ_BPS) <= (DISK_READ_BPS * 0.01 + 2 * 512) / seconds
        assert live.t == pytest.approx(15.0 + 9 + 0.6)
    finally:
        for source in sources:
            source.close()


def test_the_wall_clock_node_never_goes_back() -> None:
    moved: list[tuple[float, str | None]] = []

    class Recorder:
        def refresh(self, t: float, reader: str | None = None) -> None:
            moved.append((t, reader))

        def sources(self, inputs: object = None) -> list[object]:
            return []

    clock = FakeClock(50.0)
    live = WallClockNode(Recorder(), clock=clock)
    clock.now = 52.5
    assert live.refresh("disks") == 2.5
    clock.now = 51.0  # a refresh that took its present before another one finished
    assert live.refresh() == 2.5
    assert moved == [(2.5, "disks"), (2.5, None)]


class FakeProcess:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []

    def advance(self, t: float) -> None:
        self.calls.append(("tick", t))

    def refresh(self, t: float) -> None:
        self.calls.append(("refresh", t))


class SteppingEvent(threading.Event):
    """An event whose wait moves a fake clock instead of sleeping; set after ``limit``."""

    def __init__(self, clock: FakeClock, limit: float, stall_at: float | None = None) -> None:
        super().__init__()
        self.clock, self.limit, self.stall_at = clock, limit, stall_at

    def wait(self, timeout: float | None = None) -> bool:
        self.clock.now += timeout or 0.0
        if self.stall_at is not None and self.clock.now >= self.stall_at:
            self.clock.now += 7.3  # the process was stopped for a while
            self.stall_at = None
        return self.clock.now >= self.limit


def test_run_node_refreshes_between_ticks_and_does_a_ticks_work_once_per_tick() -> None:
    clock = FakeClock(0.0)
    process = FakeProcess()
    run_in_real_time(process, 1.0, 0.1, SteppingEvent(clock, 3.05), clock)  # type: ignore[arg-type]
    ticks = [t for kind, t in process.calls if kind == "tick"]
    refreshes = [t for kind, t in process.calls if kind == "refresh"]
    assert ticks == pytest.approx([1.0, 2.0, 3.0])
    assert len(refreshes) == 27  # 0.1 … 2.9 but the ticks
    times = [t for _kind, t in process.calls]
    assert times == sorted(times)
    assert max(b - a for a, b in itertools.pairwise(times)) == pytest.approx(0.1)


def test_run_node_after_a_stall_goes_on_from_the_present() -> None:
    clock = FakeClock(0.0)
    process = FakeProcess()
    event = SteppingEvent(clock, 12.0, stall_at=2.0)
    run_in_real_time(process, 1.0, 0.1, event, clock)  # type: ignore[arg-type]
    times = [t for _kind, t in process.calls]
    # One tick's work at the present after the stall, no burst of missed refreshes.
    late = [t for t in times if 1.95 <= t < 9.35]
    assert late == [pytest.approx(9.3)]
    assert [kind for kind, t in process.calls if t == pytest.approx(9.3)] == ["tick"]
    assert max(b - a for a, b in itertools.pairwise(times[-20:])) <= 0.1 + 1e-9
