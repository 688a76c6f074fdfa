"""One cycle for the daemon and the replay (nodescope.cycle): what it hands the parts that
act outside the process, how the daemon survives a stage and a replay does not, and that
both run it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from nodescope.analysis import Analyzer
from nodescope.assembly import default_config
from nodescope.collect import Collector, ScheduledSource
from nodescope.cycle import Cycle, OutsideParts
from nodescope.model.process import ProcessFigures
from nodescope.model.snapshot import Snapshot
from nodescope.roots import Roots
from nodescope.service import Service
from nodescope.sim.driver import replay, replay_outside_parts
from nodescope.sim.node import make_temp_root
from nodescope.sim.scenario import load_scenario
from nodescope.timing import Timing


class Counting:
    name = "counting"

    def __init__(self) -> None:
        self.calls = 0

    def collect(self, roots: Roots) -> int:
        self.calls += 1
        return self.calls

    def close(self) -> None:
        return None


class Seen:
    """An outside part that keeps what it was handed, or raises."""

    def __init__(self, fail: bool = False) -> None:
        self.snapshots: list[Snapshot] = []
        self.fail = fail

    def observe(self, snapshot: Snapshot) -> None:
        self.snapshots.append(snapshot)
        if self.fail:
            raise KeyError("job 42")


class Meter:
    def __init__(self) -> None:
        self.pids: list[int | None] = []

    def measure(self, serving_pid: int | None = None) -> tuple[ProcessFigures, ...]:
        self.pids.append(serving_pid)
        return ()


def _cycle(outside: OutsideParts, offered: list[Snapshot], strict: bool = False) -> Cycle:
    collector = Collector(roots=Roots(), scheduled=[ScheduledSource(Counting(), 0.0)])
    return Cycle(
        collector,
        Analyzer.from_config(default_config(), []),
        offered.append,
        None,
        outside,
        strict=strict,
    )


def test_the_outside_parts_see_the_analysed_snapshot_and_the_exporters_get_it() -> None:
    jobs, drain, meter, offered = Seen(), Seen(), Meter(), []
    cycle = _cycle(OutsideParts(jobs, drain, meter, serving_pid=lambda: 4242), offered)
    assert cycle.run() and cycle.run()
    assert [s.cycle for s in jobs.snapshots] == [1, 2]
    # The same analysed snapshot (alert counters filled in) reaches every part.
    assert all(s.alert_counters is not None for s in jobs.snapshots)
    assert [s.cycle for s in drain.snapshots] == [1, 2]
    assert meter.pids == [4242, 4242]
    assert [s.cycle for s in offered] == [1, 2]
    assert offered[1].current["counting"].data == 2


def test_the_daemon_survives_a_stage_and_a_replay_does_not() -> None:
    offered: list[Snapshot] = []
    cycle = _cycle(OutsideParts(jobs=Seen(fail=True)), offered)
    before = cycle.last_completed
    # The stage failed, the cycle completed: the job tracker's trouble is counted, exported.
    assert cycle.run()
    assert cycle.errors == {"jobs": 1}
    assert offered[-1].cycle_errors == {"jobs": 1}
    assert cycle.last_completed >= before
    strict = _cycle(OutsideParts(jobs=Seen(fail=True)), [], strict=True)
    with pytest.raises(KeyError, match="job 42"):
        strict.run()
    assert strict.errors == {}


def test_a_replay_runs_without_the_outside_parts() -> None:
    parts = replay_outside_parts()
    assert (parts.jobs, parts.job_drain, parts.process_meter) == (None, None, None)
    assert parts.serving_pid() is None


def test_the_daemon_and_the_replay_run_the_same_cycle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[tuple[bool, bool]] = []
    original = Cycle.run

    def spy(self: Cycle) -> bool:
        runs.append((self.strict, self.outside.process_meter is not None))
        return original(self)

    monkeypatch.setattr(Cycle, "run", spy)
    scenario: dict[str, Any] = {
        "format": "nodescope-scenario/1",
        "name": "quiet",
        "duration_seconds": 2,
        "hardware": {"base": "dgx-h100", "os": {"background_processes": 1}},
        "timeline": [],
    }
    path = tmp_path / "quiet.json"
    path.write_text(json.dumps(scenario))
    base = make_temp_root("nodescope-test-")
    try:
        result = replay(load_scenario(str(path)), base / "node")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert result.cycles == 3
    assert runs == [(True, False)] * 3
    service = Service(lambda: default_config(roots=Roots.under(tmp_path / "host")))
    try:
        assert service.run_cycle()
    finally:
        service.shutdown()
    assert runs[3:] == [(False, True)]


def test_the_watchdog_judges_a_cycle_by_the_tick_it_ran_on(tmp_path: Path) -> None:
    """A reload that shortens the tick from 30 s to 1 s, 20 s after the last cycle: that
    cycle is on time by its own tick's bound (60 s), and the next by the new one (11 s)."""
    ticks = [30.0]
    service = Service(
        lambda: default_config(roots=Roots.under(tmp_path / "host"), tick_seconds=ticks[-1]),
        make_collector=lambda config: Collector(roots=Roots(), scheduled=[]),
    )
    try:
        assert service.run_cycle()
        service.cycle.last_completed -= 20.0
        ticks.append(1.0)
        assert service.reload()
        assert service.timing == Timing.of_tick(1.0)
        assert service.cycles_on_time()
        assert service.run_cycle()
        service.cycle.last_completed -= 12.0
        assert not service.cycles_on_time()
    finally:
        service.shutdown()


def test_the_timing_of_a_tick() -> None:
    assert Timing.of_tick(1.0) == Timing(1.0, stale_after=11.0, render_window=1.5)
    # A tick longer than the grace: a whole tick of grace.
    assert Timing.of_tick(30.0).stale_after == 60.0
    assert Timing.of(default_config()).tick_seconds == default_config().tick_seconds
    assert Timing.of_tick(30.0).sleep_seconds(None) == 30.0
    assert Timing.of_tick(30.0).sleep_seconds(20.0) == 10.0
