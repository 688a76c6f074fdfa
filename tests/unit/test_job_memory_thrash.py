"""``job_memory_limit_thrash``: the rate of ``memory.events`` ``max`` of a job's cgroups, named
at the level whose limit is hit."""

from __future__ import annotations

from nodescope.config import Config, from_mapping
from nodescope.detectors import jobs as job_detectors
from nodescope.model.cgroup import Cgroup, CpuStat, KeyValues, Limit, MemoryEvents
from nodescope.model.finding import Finding
from nodescope.model.job_records import JobCgroup, JobsData, JobStep
from nodescope.model.jobs import Job, build_registry
from nodescope.model.snapshot import Snapshot, SourceSample

GIB = 1 << 30
JOB = "/system.slice/slurmstepd.scope/job_42"
STEP = f"{JOB}/step_0"


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


def _thrash(
    before: JobsData, after: JobsData, seconds: float = 10.0, per_second: float = 50.0
) -> list[Finding]:
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


def test_reclaim_of_pages_nobody_asks_for_again_is_no_thrash() -> None:
    # Streaming reads fill the limit with page cache: memory.max is hit as often, but reclaim
    # takes pages that are never refaulted.
    before = _data(_cg(JOB, 0, 0, limit=4 * GIB, refaults=500))
    cheap = _data(_cg(JOB, 5000, 5000, limit=4 * GIB, refaults=500))
    assert _thrash(before, cheap) == []
    costly = _data(_cg(JOB, 5000, 5000, limit=4 * GIB, refaults=40500))
    (found,) = _thrash(before, costly)
    assert found.evidence["refaults_per_second"] == 4000.0 and "refaulted" in found.message


def _snapshot(before: JobsData, after: JobsData, seconds: float) -> Snapshot:
    wall = 1000.0
    current = {"jobs": SourceSample("jobs", wall, 0.0, after)}
    previous = {"jobs": SourceSample("jobs", wall - seconds, 0.0, before)}
    return Snapshot(cycle=1, monotonic=wall, wall_time=wall, current=current, previous=previous)


def test_detect_divides_by_the_time_between_reads_and_reads_the_threshold() -> None:
    before = _data(_cg(JOB, 0, 0, limit=4 * GIB))
    after = _data(_cg(JOB, 1500, 1500, limit=4 * GIB))
    kinds = [f.kind for f in job_detectors.detect(None, _snapshot(before, after, 15.0), Config())]
    assert kinds == [job_detectors.THRASH]  # 100/s
    assert job_detectors.detect(None, _snapshot(before, after, 60.0), Config()) == []  # 25/s
    high = from_mapping({"detectors": {"jobs": {"memory_limit_thrash_events_per_second": 200}}})
    assert job_detectors.detect(None, _snapshot(before, after, 15.0), high) == []
