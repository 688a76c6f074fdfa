"""The collector: intervals, per-source isolation, previous/current samples."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nodescope.collect import Collector, ScheduledSource
from nodescope.errors import ConfigError
from nodescope.model.source_key import SourceKey
from nodescope.roots import Roots
from nodescope.sources.base import TopologyGeneration
from nodescope.sources.registry import SOURCES, SourceInputs


@dataclass
class Counting:
    name: str
    fail: bool = False
    calls: int = 0
    closed: bool = False

    def collect(self, roots: Roots) -> int:
        self.calls += 1
        if self.fail:
            raise OSError(f"{self.name} input vanished")
        return self.calls

    def close(self) -> None:
        self.closed = True


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def collector(*items: tuple[Counting, float], clock: FakeClock) -> Collector:
    return Collector(
        roots=Roots(),
        scheduled=[ScheduledSource(src, interval) for src, interval in items],
        clock=clock,
        wall_clock=lambda: 1.7e9,
    )


def test_sources_run_on_their_own_intervals() -> None:
    clock = FakeClock()
    fast, slow = Counting("fast"), Counting("slow")
    c = collector((fast, 1.0), (slow, 5.0), clock=clock)
    for _ in range(10):
        c.run_cycle()
        clock.now += 1.0
    assert fast.calls == 10
    assert slow.calls == 2


def test_previous_and_current_samples_give_measured_time() -> None:
    clock = FakeClock()
    src = Counting("a")
    c = collector((src, 1.0), clock=clock)
    c.run_cycle()
    clock.now += 2.5
    snap = c.run_cycle()
    pair = snap.pair(SourceKey("a", int))
    assert pair == (1, 2, 2.5)


def test_a_failing_source_does_not_stop_the_others(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    good, bad = Counting("good"), Counting("bad", fail=True)
    c = collector((bad, 1.0), (good, 1.0), clock=clock)
    with caplog.at_level(logging.INFO, logger="nodescope.collect"):
        for _ in range(3):
            snap = c.run_cycle()
            clock.now += 1.0
    assert snap.current["good"].data == 3
    assert snap.current["bad"].data is None
    assert "input vanished" in (snap.current["bad"].error or "")
    assert snap.status["bad"].up is False
    assert snap.status["bad"].errors_total == 3
    assert snap.status["good"].up is True
    # One log line per state change, not per cycle.
    downs = [r for r in caplog.records if "state=down" in r.getMessage()]
    assert len(downs) == 1
    bad.fail = False
    with caplog.at_level(logging.INFO, logger="nodescope.collect"):
        snap = c.run_cycle()
    assert snap.status["bad"].up is True
    assert any("source=bad state=up" in r.getMessage() for r in caplog.records)


def test_snapshot_is_immutable() -> None:
    clock = FakeClock()
    c = collector((Counting("a"), 1.0), clock=clock)
    snap = c.run_cycle()
    with pytest.raises(TypeError):
        snap.current["a"] = snap.current["a"]  # type: ignore[index]
    with pytest.raises(AttributeError):
        snap.cycle = 5  # type: ignore[misc]


def test_a_source_that_cannot_be_built_is_reported_down() -> None:
    from nodescope.collect import UnavailableSource

    clock = FakeClock()
    c = Collector(
        roots=Roots(),
        scheduled=[ScheduledSource(UnavailableSource("nvml", "libnvidia-ml.so.1 not found"), 1)],
        clock=clock,
    )
    snap = c.run_cycle()
    assert snap.status["nvml"].up is False
    assert "libnvidia-ml" in (snap.current["nvml"].error or "")


def test_close_closes_every_source() -> None:
    clock = FakeClock()
    a, b = Counting("a"), Counting("b")
    c = collector((a, 1.0), (b, 1.0), clock=clock)
    c.close()
    assert a.closed and b.closed


def test_jitter_of_the_loop_does_not_skip_a_due_source() -> None:
    clock = FakeClock()
    src = Counting("a")
    c = collector((src, 1.0), clock=clock)
    for i in range(20):
        # Ticks arrive up to 30 ms early or late.
        clock.now = 100.0 + i + (0.03 if i % 2 else -0.03)
        c.run_cycle()
    assert src.calls == 20


def test_source_deadlines_come_from_the_config(tmp_path: Path) -> None:
    from nodescope.assembly import load

    path = tmp_path / "nodescope.toml"
    path.write_text("[sources.disks]\ntimeout_seconds = 2.5\n")
    config = load(path)
    collector = Collector.from_config(config, [Counting("disks"), Counting("locks")])
    timeouts = {item.source.name: item.timeout for item in collector.scheduled}
    assert timeouts == {"disks": 2.5, "locks": 5.0}
    path.write_text("[sources.disks]\ntimeout_seconds = inf\n")
    with pytest.raises(ConfigError, match="timeout_seconds"):
        load(path)


@dataclass(frozen=True)
class RecordingInputs(SourceInputs):
    begun: list[set[str]] = field(default_factory=list)

    def begin_cycle(self, due: Iterable[str]) -> None:
        self.begun.append(set(due))
        super().begin_cycle(due)


def test_each_cycle_begins_on_the_inputs_its_sources_share_before_they_run() -> None:
    clock = FakeClock()
    inputs = RecordingInputs()
    fast, slow = Counting("fast"), Counting("slow")
    c = Collector(
        roots=Roots(),
        scheduled=[ScheduledSource(fast, 1.0), ScheduledSource(slow, 2.0)],
        clock=clock,
        inputs=inputs,
    )
    for _ in range(3):
        c.run_cycle()
        clock.now += 1.0
    assert inputs.begun == [{"fast", "slow"}, {"fast"}, {"fast", "slow"}]


def test_the_sources_it_builds_share_one_set_of_inputs(tmp_path: Path) -> None:
    from nodescope.assembly import load

    path = tmp_path / "nodescope.toml"
    wanted = {"pci", "udev", "cgroups", "jobs", "procs", "threads"}
    path.write_text(
        "".join(f"[sources.{name}]\nenabled = false\n" for name in SOURCES if name not in wanted)
    )
    c = Collector.from_config(load(path))
    try:
        assert c.inputs is not None
        built = {item.source.name: item.source for item in c.scheduled}
        assert set(built) == wanted
        for name in wanted - {"pci", "udev"}:
            assert getattr(built[name], "walk", None) is c.inputs.cgroup_walk, name
        for name in ("pci", "udev"):
            assert getattr(built[name], "topology", None) is c.inputs.topology, name
        # The pci source is the one due when the topology moves; the udev source moves it.
        watching = {item.source.name: item.watches for item in c.scheduled}
        assert watching == {name: None for name in wanted} | {"pci": c.inputs.topology}
    finally:
        c.close()


@dataclass
class Advancing:
    """A source whose run moves the topology generation, as the ``udev`` source's does when
    it hands over a PCI device event."""

    topology: TopologyGeneration
    name: str = "udev"
    moves: set[int] = field(default_factory=set)
    calls: int = 0

    def collect(self, roots: Roots) -> int:
        self.calls += 1
        if self.calls in self.moves:
            self.topology.advance()
        return self.calls

    def close(self) -> None:
        return None


def test_a_source_watching_the_topology_runs_exactly_when_it_moved() -> None:
    clock = FakeClock()
    topology = TopologyGeneration()
    pci = Counting("pci")
    # The udev source runs after the pci source in a cycle, as in the daemon's order; its
    # 3rd run (t=102) hands over a removal.
    udev = Advancing(topology, moves={3})
    c = Collector(
        roots=Roots(),
        scheduled=[
            ScheduledSource(pci, 30.0, watches=topology),
            ScheduledSource(udev, 1.0),
        ],
        clock=clock,
        wall_clock=lambda: 1.7e9,
    )
    runs: dict[float, int] = {}
    for _ in range(40):
        if clock.now == 105.0:
            topology.advance()  # a monitor thread's event between two cycles
        snapshot = c.run_cycle()
        runs[clock.now] = pci.calls
        if clock.now == 102.0:
            # Read in the cycle that reported the move, after the source that moved it.
            sample = snapshot.current["pci"]
            assert sample.data == 2 and sample.monotonic == 102.0
        clock.now += 1.0
    ran_at = [t for t in runs if runs[t] != runs.get(t - 1.0, 0)]
    # First run, the udev source's move (same cycle), the monitor's move (next cycle), then
    # the interval's own runs, which the extra runs did not shift (slack of a tenth).
    assert ran_at == [100.0, 102.0, 105.0, 127.0]
    assert udev.calls == 40
    assert c.scheduled[0].next_due == 160.0  # planned: 130 + 30


def test_an_unwatched_source_ignores_the_topology() -> None:
    clock = FakeClock()
    topology = TopologyGeneration()
    pci = Counting("pci")
    udev = Advancing(topology, moves={2, 3, 4})
    c = Collector(
        roots=Roots(),
        scheduled=[ScheduledSource(pci, 30.0), ScheduledSource(udev, 1.0)],
        clock=clock,
        wall_clock=lambda: 1.7e9,
    )
    for _ in range(10):
        c.run_cycle()
        clock.now += 1.0
    assert topology.value == 3 and pci.calls == 1
