"""``job_memory_limit_thrash``: the rate of ``memory.events`` ``max`` of a job's cgroups, named
at the level whose limit is hit, a finding only when the reclaim costs the tasks time (memory
PSI stall over the interval, OOM kills; pages refaulted where there is no PSI)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.assembly import default_config, from_mapping
from nodescope.detectors import jobs as job_detectors
from nodescope.model.cgroup import (
    Cgroup,
    CpuStat,
    KeyValues,
    Limit,
    MemoryEvents,
    Pressure,
    PressureLine,
)
from nodescope.model.finding import Finding
from nodescope.model.job_records import JobCgroup, JobsData, JobStep
from nodescope.model.jobs import Job, build_registry
from nodescope.model.pressure import NodePressure
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.sources.cgroup import parse_pressure

GIB = 1 << 30
JOB = "/system.slice/slurmstepd.scope/job_42"
STEP = f"{JOB}/step_0"

#: The shipped ``[detectors.jobs]`` table.
JOBS = default_config().detectors.jobs


def _cg(
    path: str,
    events: int | None,
    local: int | None,
    *,
    limit: int | None = None,
    current: int = 4 * GIB - (1 << 20),
    usage: int = 1_000_000,
    refaults: int | None = None,
) -> Cgroup:
    stat = (
        None
        if refaults is None
        else KeyValues((("anon", current), ("workingset_refault_file", refaults)))
    )
    return Cgroup(
        path=path,
        depth=path.count("/"),
        type="domain",
        controllers=None,
        nr_children=0,
        memory_current=current,
        memory_max=Limit(limit),
        memory_events=None if events is None else MemoryEvents(max=events),
        memory_events_local=None if local is None else MemoryEvents(max=local),
        memory_stat=stat,
        cpu_stat=CpuStat(usage_usec=usage),
    )


def _data(job: Cgroup, step: Cgroup | None = None, layout: str = "v2") -> JobsData:
    steps = () if step is None else (JobStep("0", step.path, step),)
    record = JobCgroup("job_42", "42", layout, JOB, None, job, steps, (), 4 * GIB, None)  # type: ignore[arg-type]
    return JobsData("v2", (record,), (), ())


def _registry(data: JobsData) -> tuple[Job, ...]:
    return build_registry(data, [])


def _psi(data: JobsData, some_usec: int, full_usec: int = 0) -> JobsData:
    """``data`` with every cgroup's ``memory.pressure`` totals set (averages 0: the detector
    takes the totals' growth)."""
    pressure = Pressure(PressureLine(0, 0, 0, some_usec), PressureLine(0, 0, 0, full_usec))

    def with_psi(cg: Cgroup | None) -> Cgroup | None:
        return None if cg is None else replace(cg, memory_pressure=pressure)

    jobs = tuple(
        replace(
            j,
            stats=with_psi(j.stats),
            steps=tuple(replace(s, stats=with_psi(s.stats)) for s in j.steps),
        )
        for j in data.jobs
    )
    return replace(data, jobs=jobs)


def _thrash(
    before: JobsData,
    after: JobsData,
    seconds: float = 10.0,
    per_second: float = 50.0,
    stalled: float | None = 40.0,
) -> list[Finding]:
    """Thrash findings between two reads; ``stalled``: the share of the interval (%) the
    tasks stalled on memory, by PSI (``None``: no ``memory.pressure`` as given)."""
    if stalled is not None:
        before = _psi(before, 7_000_000)
        after = _psi(after, 7_000_000 + round(stalled / 100 * seconds * 1e6))
    found = job_detectors.evaluate(_registry(before), _registry(after), 10.0, seconds, per_second)
    return [f for f in found if f.kind == job_detectors.THRASH]


def test_a_step_at_its_limit_is_named_with_its_limit_and_usage() -> None:
    # step_0 has the limit; the job cgroup's memory.events counts the step's events too.
    before = _data(_cg(JOB, 100, 0), _cg(STEP, 100, 100, limit=4 * GIB))
    after = _data(_cg(JOB, 2100, 0), _cg(STEP, 2100, 2100, limit=4 * GIB))
    (found,) = _thrash(before, after)
    assert found.subjects == {"job": "42", "step": "0"}
    assert found.evidence["value"] == 200.0
    assert found.evidence["memory_max_bytes"] == 4 * GIB
    assert found.evidence["memory_current_bytes"] == 4 * GIB - (1 << 20)
    assert "step 0" in found.message and STEP in found.message
    assert "memory.max 4.0 GiB" in found.message and "memory.current 4.0 GiB" in found.message


def test_the_job_level_when_its_own_limit_is_hit() -> None:
    before = _data(_cg(JOB, 0, 0, limit=4 * GIB), _cg(STEP, 0, 0))
    after = _data(_cg(JOB, 3000, 3000, limit=4 * GIB), _cg(STEP, 0, 0))
    (found,) = _thrash(before, after)
    assert found.subjects == {"job": "42", "step": "job"}
    assert found.evidence["value"] == 300.0 and "the job cgroup" in found.message


def test_without_local_counts_the_job_keeps_only_what_its_steps_did_not_hit() -> None:
    # Kernels before 5.2: memory.events only. 2000 of the job's 2600 are step_0's.
    before = _data(_cg(JOB, 0, None, limit=4 * GIB), _cg(STEP, 0, None, limit=3 * GIB))
    after = _data(_cg(JOB, 2600, None, limit=4 * GIB), _cg(STEP, 2000, None, limit=3 * GIB))
    found = {f.subjects["step"]: f.evidence["value"] for f in _thrash(before, after)}
    assert found == {"0": 200.0, "job": 60.0}
    # All of them the step's: the job level is silent.
    after = _data(_cg(JOB, 2000, None, limit=4 * GIB), _cg(STEP, 2000, None, limit=3 * GIB))
    assert [f.subjects["step"] for f in _thrash(before, after)] == ["0"]


def test_v1_failcnt_is_the_cgroups_own() -> None:
    before = _data(_cg(JOB, 0, None, limit=4 * GIB), _cg(STEP, 0, None), layout="v1")
    after = _data(_cg(JOB, 1000, None, limit=4 * GIB), _cg(STEP, 0, None), layout="v1")
    (found,) = _thrash(before, after)
    assert found.subjects["step"] == "job" and found.evidence["value"] == 100.0


def test_the_threshold_and_a_few_hits() -> None:
    before = _data(_cg(JOB, 0, 0, limit=4 * GIB))
    assert [
        f.evidence["value"] for f in _thrash(before, _data(_cg(JOB, 500, 500, limit=4 * GIB)))
    ] == [50.0]
    assert _thrash(before, _data(_cg(JOB, 499, 499, limit=4 * GIB))) == []
    # No rate without an interval: a first read, or a caller without a threshold.
    reg = _registry(before)
    assert not [f for f in job_detectors.evaluate(reg, reg, 10.0) if f.kind == job_detectors.THRASH]


def test_counter_resets_and_recreated_cgroups_give_no_rate() -> None:
    before = _data(_cg(JOB, 9000, 9000, limit=4 * GIB))
    # The counter went down: the cgroup was made again.
    assert _thrash(before, _data(_cg(JOB, 10, 10, limit=4 * GIB))) == []
    # Made again and already past the old count: its CPU time started again from 0.
    again = _data(_cg(JOB, 12000, 12000, limit=4 * GIB, usage=5))
    assert _thrash(before, again) == []
    # The same for a step.
    before = _data(_cg(JOB, 0, 0), _cg(STEP, 9000, 9000, limit=GIB))
    after = _data(_cg(JOB, 0, 0), _cg(STEP, 12000, 12000, limit=GIB, usage=5))
    assert _thrash(before, after) == []


def test_without_psi_reclaim_of_pages_nobody_asks_for_again_is_no_thrash() -> None:
    # No memory.pressure (cgroup v1): streaming reads fill the limit with page cache,
    # memory.max is hit as often, but reclaim takes pages that are never refaulted.
    before = _data(_cg(JOB, 0, 0, limit=4 * GIB, refaults=500))
    cheap = _data(_cg(JOB, 5000, 5000, limit=4 * GIB, refaults=500))
    assert _thrash(before, cheap, stalled=None) == []
    costly = _data(_cg(JOB, 5000, 5000, limit=4 * GIB, refaults=40500))
    (found,) = _thrash(before, costly, stalled=None)
    assert found.evidence["refaults_per_second"] == 4000.0 and "refaulted" in found.message
    assert "memory_some_stall_percent" not in found.evidence


def test_without_psi_or_refaults_nothing_shows_a_cost() -> None:
    before = _data(_cg(JOB, 0, 0, limit=4 * GIB))
    after = _data(_cg(JOB, 5000, 5000, limit=4 * GIB))
    assert _thrash(before, after, stalled=None) == []


def test_page_cache_at_the_limit_without_stall_time_is_healthy() -> None:
    # A job reading its data set through page cache: 500 limit hits a second, refaults too
    # (pages read again after reclaim), but its tasks stalled on memory 0.3 % of the time.
    before = _data(_cg(JOB, 0, 0, limit=4 * GIB, refaults=0))
    after = _data(_cg(JOB, 5000, 5000, limit=4 * GIB, refaults=3000))
    assert _thrash(before, after, stalled=0.3) == []
    assert _thrash(before, after, stalled=9.9) == []


def test_reclaim_that_stalls_the_tasks_is_thrash_naming_the_stall() -> None:
    before = _data(_cg(JOB, 0, 0, limit=4 * GIB))
    after = _data(_cg(JOB, 5000, 5000, limit=4 * GIB))
    before, after = _psi(before, 1_000_000, 400_000), _psi(after, 4_500_000, 2_400_000)
    found = job_detectors.evaluate(_registry(before), _registry(after), 10.0, 10.0, 50.0)
    (thrash,) = [f for f in found if f.kind == job_detectors.THRASH]
    assert thrash.evidence["memory_some_stall_percent"] == pytest.approx(35.0)
    assert thrash.evidence["memory_full_stall_percent"] == pytest.approx(20.0)
    assert "its tasks stalled on memory 35.0 % of those 10 s (memory.pressure some" in (
        thrash.message
    )
    assert "all of them at once 20.0 %, full" in thrash.message


def test_the_stall_threshold_is_configured() -> None:
    before = _data(_cg(JOB, 0, 0, limit=4 * GIB))
    after = _data(_cg(JOB, 5000, 5000, limit=4 * GIB))
    assert len(_thrash(before, after, stalled=10.0)) == 1
    b, a = _psi(before, 0), _psi(after, 2_000_000)  # 20 % of 10 s
    found = job_detectors.evaluate(_registry(b), _registry(a), 10.0, 10.0, 50.0, 25.0)
    assert [f for f in found if f.kind == job_detectors.THRASH] == []
    found = job_detectors.evaluate(_registry(b), _registry(a), 10.0, 10.0, 50.0, 20.0)
    assert [f.kind for f in found] == [job_detectors.THRASH]


def test_oom_kills_at_the_limit_are_a_cost_without_stall_time() -> None:
    def cg(events: int, kills: int) -> Cgroup:
        return replace(
            _cg(JOB, events, events, limit=4 * GIB),
            memory_events=MemoryEvents(max=events, oom_kill=kills),
        )

    before, after = _data(cg(0, 0)), _data(cg(5000, 2))
    found = _thrash(before, after, stalled=0.0)
    (thrash,) = found
    assert thrash.evidence["oom_kills"] == 2.0 and "the OOM killer killed 2" in thrash.message


def test_a_pressure_total_that_went_back_is_no_stall() -> None:
    before = _psi(_data(_cg(JOB, 0, 0, limit=4 * GIB)), 9_000_000)
    after = _psi(_data(_cg(JOB, 5000, 5000, limit=4 * GIB)), 1_000)
    found = job_detectors.evaluate(_registry(before), _registry(after), 10.0, 10.0, 50.0)
    assert [f for f in found if f.kind == job_detectors.THRASH] == []


def _snapshot(before: JobsData, after: JobsData, seconds: float) -> Snapshot:
    wall = 1000.0
    current = {"jobs": SourceSample("jobs", wall, 0.0, after)}
    previous = {"jobs": SourceSample("jobs", wall - seconds, 0.0, before)}
    return Snapshot(cycle=1, monotonic=wall, wall_time=wall, current=current, previous=previous)


def test_detect_divides_by_the_time_between_reads_and_reads_the_threshold() -> None:
    before = _psi(_data(_cg(JOB, 0, 0, limit=4 * GIB)), 0)
    after = _psi(_data(_cg(JOB, 1500, 1500, limit=4 * GIB)), 30_000_000)
    kinds = [f.kind for f in job_detectors.detect(None, _snapshot(before, after, 15.0), JOBS)]
    assert kinds == [job_detectors.THRASH]  # 100/s
    assert job_detectors.detect(None, _snapshot(before, after, 60.0), JOBS) == []  # 25/s
    high = from_mapping({"detectors": {"jobs": {"memory_limit_thrash_events_per_second": 200}}})
    assert job_detectors.detect(None, _snapshot(before, after, 15.0), high.detectors.jobs) == []


def test_the_nodes_memory_full_stall_is_evidence_of_the_thrash() -> None:
    before = _psi(_data(_cg(JOB, 0, 0, limit=4 * GIB)), 0)
    after = _psi(_data(_cg(JOB, 1500, 1500, limit=4 * GIB)), 30_000_000)
    snapshot = _snapshot(before, after, 15.0)
    # Read 5 s apart by the pressure source: 2 s of every task on the node stalled on memory.
    line = PressureLine(0.0, 0.0, 0.0, 0)
    node = {
        t: NodePressure(cpu=None, memory=Pressure(line, PressureLine(0.0, 0.0, 0.0, usec)), io=None)
        for t, usec in ((995.0, 1_000_000), (1000.0, 3_000_000))
    }
    snapshot = replace(
        snapshot,
        current={
            **snapshot.current,
            "pressure": SourceSample("pressure", 1000.0, 0.0, node[1000.0]),
        },
        previous={
            **snapshot.previous,
            "pressure": SourceSample("pressure", 995.0, 0.0, node[995.0]),
        },
    )
    (finding,) = job_detectors.detect(None, snapshot, default_config().detectors.jobs)
    assert finding.kind == job_detectors.THRASH
    assert finding.evidence["node_memory_full_stall_ratio"] == 0.4
    # Without the pressure source the finding is the same, less that line.
    (alone,) = job_detectors.detect(
        None, _snapshot(before, after, 15.0), default_config().detectors.jobs
    )
    assert {**alone.evidence, "node_memory_full_stall_ratio": 0.4} == dict(finding.evidence)


#: PSI totals are u64 microseconds.
_TOTAL = st.integers(0, 2**64 - 1)


@settings(max_examples=300, deadline=None)
@given(
    some=st.tuples(_TOTAL, _TOTAL),
    full=st.tuples(_TOTAL, _TOTAL),
    seconds=st.floats(0.001, 3600.0),
)
def test_fuzz_the_stall_share_of_two_psi_reads(
    some: tuple[int, int], full: tuple[int, int], seconds: float
) -> None:
    # Two memory.pressure files as the kernel writes them, through the source's parser: the
    # share is None where a total went back (a cgroup made again), else within 0-100 %.
    def read(i: int) -> Cgroup:
        text = (
            f"some avg10=0.00 avg60=0.00 avg300=0.00 total={some[i]}\n"
            f"full avg10=0.00 avg60=0.00 avg300=0.00 total={full[i]}\n"
        )
        cg = _cg(JOB, 0, 0, limit=GIB)
        return replace(cg, memory_pressure=parse_pressure(text, "memory.pressure"))

    cost = job_detectors._cost(read(0), read(1), seconds)
    for (old, new), share in ((some, cost.some_percent), (full, cost.full_percent)):
        if new < old:
            assert share is None
        else:
            assert share is not None and 0.0 <= share <= 100.0
