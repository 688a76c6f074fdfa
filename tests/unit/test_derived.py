"""The figures a snapshot implies (rates, the PCIe attribution, the job registry and its
placement view) and the detectors that read them: each answer follows its inputs, whether the
snapshot was made alone or by the derived stage that carries the last cycle's figures over."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

import pytest

from nodescope.alerts import AlertRules, keep_floor
from nodescope.assembly import default_config, from_mapping
from nodescope.config import Config
from nodescope.derive import DerivedStage
from nodescope.detectors import errors, hangs, placement
from nodescope.detectors import jobs as jobs_detector
from nodescope.detectors.registry import ALERT_RULES
from nodescope.model import derived as derived_module
from nodescope.model.attribution import EndpointFlow, LinkIndex, attribute
from nodescope.model.finding import Finding, Severity
from nodescope.model.jobs import JobProcess
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.model.topology import PCI, AerCounter, AerRecord, DeviceClass, LinkState
from nodescope.sources.infiniband import IbDevice, InfinibandData
from nodescope.sources.jobs import JobCgroup, JobsData, JobTask
from nodescope.sources.nvml import GpuProcess, NvmlData
from nodescope.sources.procs import ProcsData, TcpCounters
from tests.unit.fabric_helpers import GPU_A, GPU_B, GPU_C, HCA, HCA_C, RP_SHARED, topology
from tests.unit.test_detectors import _gpu

# --- inputs ---------------------------------------------------------------------------------


def _task(pid: int, job: str, hca: str | None = None, gpus: str | None = None) -> JobTask:
    env: tuple[tuple[str, str], ...] = (("NCCL_IB_HCA", hca),) if hca else ()
    env += (("SLURM_JOB_GPUS", gpus),) if gpus else ()
    return JobTask(pid, "python3", f"/job_{job}/step_0", "0", env, 1, (), None)


def _jobs(*tasks: JobTask, job: str = "81770") -> JobsData:
    cgroup = JobCgroup(f"job_{job}", job, "v2", f"/job_{job}", None, None, (), tasks, None, None)
    return JobsData("v2", (cgroup,), (), ())


def _nvml(pids: Mapping[int, tuple[int, ...]]) -> NvmlData:
    """GPUs 0 (GPU_A), 1 (GPU_B) and 2 (GPU_C) with the given compute processes."""
    bdfs = {0: GPU_A, 1: GPU_B, 2: GPU_C}
    gpus = tuple(
        dataclasses.replace(
            _gpu(i, bdfs[i]), processes=tuple(GpuProcess(p, None) for p in pids.get(i, ()))
        )
        for i in sorted(bdfs)
    )
    return NvmlData(len(gpus), gpus, (), (), None, ())


def _ib(functions: dict[str, str]) -> InfinibandData:
    return InfinibandData(
        tuple(IbDevice(n, None, None, None, None, bdf, (), (), ()) for n, bdf in functions.items())
    )


def _snap(
    current: dict[str, object], previous: dict[str, object] | None = None, t: float = 100.0
) -> Snapshot:
    """Samples made here are new objects: pass a SourceSample to hand one on unchanged."""

    def sample(name: str, data: object, at: float) -> SourceSample:
        return data if isinstance(data, SourceSample) else SourceSample(name, at, 0.0, data)

    cur = {n: sample(n, d, t) for n, d in current.items()}
    prev = {n: sample(n, d, t - 15.0) for n, d in (previous or {}).items()}
    return Snapshot(cycle=1, monotonic=t, wall_time=t, current=cur, previous=prev)


HCAS = {"mlx5_0": HCA, "mlx5_1": HCA_C}


# --- job views and the placement detector -----------------------------------------------------


def test_placement_views_follow_the_processes() -> None:
    jobs = _jobs(_task(100, "81770", "=mlx5_1"), _task(101, "81770", "=mlx5_1"))
    ib = SourceSample("infiniband", 99.0, 0.0, _ib(HCAS))
    stage = DerivedStage()

    def views(nvml: NvmlData, data: JobsData = jobs) -> tuple[object, ...]:
        snap = _snap({"jobs": data, "nvml": nvml, "infiniband": ib})
        alone = snap.derived.job_views
        staged = stage.derive(snap).derived.job_views
        assert staged == alone
        return staged

    assert [v.gpus for v in views(_nvml({0: (100,), 1: (101,)}))] == [(0, 1)]  # type: ignore[attr-defined]
    # A new NVML record (read every second) with the same compute processes: the same views.
    assert [v.gpus for v in views(_nvml({0: (100,), 1: (101,)}))] == [(0, 1)]  # type: ignore[attr-defined]
    # A process moved to GPU 2: the new answer.
    assert [v.gpus for v in views(_nvml({0: (100,), 2: (101,)}))] == [(0, 2)]  # type: ignore[attr-defined]
    # Another jobs record (the source read again) with other HCAs.
    other = _jobs(_task(100, "81770"), _task(101, "81770"))
    assert [v.hcas for v in views(_nvml({0: (100,), 2: (101,)}), other)] == [  # type: ignore[attr-defined]
        ("mlx5_0", "mlx5_1")
    ]


def test_the_placement_detector_follows_its_inputs() -> None:
    jobs = SourceSample("jobs", 90.0, 0.0, _jobs(_task(100, "81770", "=mlx5_1")))
    topo = SourceSample("pci", 80.0, 0.0, topology())
    config = default_config()
    stage = DerivedStage()

    def detect(
        nvml: NvmlData, pci: SourceSample = topo, hcas: dict[str, str] = HCAS
    ) -> list[Finding]:
        snap = stage.derive(
            _snap({"jobs": jobs, "nvml": nvml, "infiniband": _ib(hcas), "pci": pci})
        )
        return list(placement.detect(None, snap, config.detectors.placement))

    first = detect(_nvml({0: (100,)}))
    assert [f.key for f in first] == ["job_hca_placement{job=81770}"]
    assert detect(_nvml({0: (100,)})) == first
    # The job's process now on GPU C, beside mlx5_1: no finding.
    assert detect(_nvml({2: (100,)})) == []
    # A new topology object (the pci source read again): the same answer.
    assert detect(_nvml({0: (100,)}), SourceSample("pci", 110.0, 0.0, topology())) == first
    # mlx5_1 is now the function beside GPU A: no finding.
    assert detect(_nvml({0: (100,)}), hcas={"mlx5_0": HCA, "mlx5_1": HCA}) == []


# --- the jobs detector ----------------------------------------------------------------------


def test_the_jobs_detector_follows_the_registry_and_the_config() -> None:
    sample = SourceSample("jobs", 90.0, 0.0, _jobs(_task(100, "81770", gpus="0")))
    # GPU 0 belongs to the job (its process 100); pid 555 on it is outside the job.
    nvml = {0: (100, 555)}
    config = default_config()
    stage = DerivedStage()

    def detect(
        jobs: object, gpus: Mapping[int, tuple[int, ...]], cfg: Config = config
    ) -> list[Finding]:
        return list(
            jobs_detector.detect(
                None,
                stage.derive(_snap({"jobs": jobs, "nvml": _nvml(gpus)})),
                cfg.detectors.jobs,
            )
        )

    first = detect(sample, nvml)
    assert [f.kind for f in first] == [jobs_detector.ESCAPE]
    assert detect(sample, nvml) == first
    # The escaped process ended: no finding.
    assert detect(sample, {0: (100,)}) == []
    # A new jobs record in which 555 is the job's own.
    assert detect(_jobs(_task(100, "81770", gpus="0"), _task(555, "81770")), nvml) == []
    # The same record under a pressure threshold changed by a reload: the same escape.
    lower = from_mapping({"detectors": {"jobs": {"memory_pressure_percent": 5.0}}})
    assert detect(sample, nvml, lower) == first


def test_the_registry_follows_the_jobs_record() -> None:
    data = _jobs(_task(100, "81770"))
    stage = DerivedStage()
    first = stage.derive(_snap({"jobs": data, "nvml": _nvml({0: (100,)})})).derived.jobs
    assert [j.job_id for j in first] == ["81770"]
    again = stage.derive(_snap({"jobs": data, "nvml": _nvml({0: (100,)})})).derived.jobs
    assert again == first
    other = stage.derive(_snap({"jobs": _jobs(_task(100, "81771"), job="81771")})).derived.jobs
    assert [j.job_id for j in other] == ["81771"]


def test_the_jobs_before_are_the_registry_of_the_previous_record() -> None:
    old = _jobs(_task(100, "81770"))
    new = _jobs(_task(100, "81771"), job="81771")
    snap = _snap({"jobs": new, "nvml": _nvml({})}, {"jobs": old})
    before = snap.derived.jobs_before
    assert before is not None and [j.job_id for j in before] == ["81770"]
    assert [j.job_id for j in snap.derived.jobs] == ["81771"]
    assert _snap({"jobs": new}).derived.jobs_before is None


# --- AER ----------------------------------------------------------------------------------


def _aer_topology(fatal: int) -> object:
    return topology(aer={GPU_A: (AerRecord("fatal", (AerCounter("x", fatal),), fatal),)})


def test_aer_windows_follow_the_pci_reads_through_the_stage() -> None:
    config = default_config()
    stage = DerivedStage()

    def aer(t: float, cur: SourceSample, prev: SourceSample) -> list[float]:
        snap = stage.derive(Snapshot(1, t, t, current={"pci": cur}, previous={"pci": prev}))
        found = errors.detect(None, snap, config.detectors.errors)
        return [f.evidence["fatal_errors_1h"] for f in found if f.kind == errors.AER]

    before = SourceSample("pci", 70.0, 0.0, _aer_topology(0))
    after = SourceSample("pci", 100.0, 0.0, _aer_topology(1))
    # One fatal error is critical at once, and stays counted while the same read is latest.
    assert aer(101.0, after, before) == [1.0]
    assert aer(102.0, after, before) == [1.0]
    # The pci source read again: two more, counted once, added to the hour's.
    later = SourceSample("pci", 130.0, 0.0, _aer_topology(3))
    assert aer(131.0, later, after) == [3.0]
    assert aer(161.0, SourceSample("pci", 160.0, 0.0, _aer_topology(3)), later) == [3.0]
    # A snapshot made without the stage counts its own pair: the increase between the reads.
    snap = Snapshot(1, 131.0, 131.0, current={"pci": later}, previous={"pci": after})
    assert [
        f.evidence["fatal_errors_1h"] for f in errors.detect(None, snap, config.detectors.errors)
    ] == [2.0]


def test_nvlink_error_counters_that_did_not_move_count_nothing() -> None:
    from nodescope.model.error_windows import NVLINK, CounterKey
    from tests.unit.test_detectors import _link

    def nvml(t: float, **counts: int) -> SourceSample:
        data = NvmlData(
            1, (_gpu(0, GPU_A, nvlinks=(_link(0, **counts), _link(1))),), (), (), None, ()
        )
        return SourceSample("nvml", t, t, data)

    uuid = nvml(0.0).data.gpus[0].uuid  # type: ignore[union-attr]
    key = CounterKey(NVLINK, (uuid, "0"), "crc_flit")
    still = Snapshot(1, 2.0, 2.0, current={"nvml": nvml(2, crc_flit=5)},
                     previous={"nvml": nvml(1, crc_flit=5)})  # fmt: skip
    assert still.derived.error_windows.windows == {}
    moved = Snapshot(1, 2.0, 2.0, current={"nvml": nvml(2, crc_flit=9)},
                     previous={"nvml": nvml(1, crc_flit=5)})  # fmt: skip
    assert moved.derived.error_windows.count(key, 60.0, 2.0) == 4
    # Four CRC errors are far from DCGM's 100 a second: no finding.
    assert errors.detect(None, moved, default_config().detectors.errors) == []


# --- hangs ----------------------------------------------------------------------------------


def test_the_job_process_maps_follow_the_procs_record() -> None:
    one = ProcsData((JobProcess(100, "81770", "/job_81770"),), TcpCounters(0, 0, 0))
    job_of, pids_of = hangs._job_process_maps(one)
    assert job_of == {100: "81770"} and pids_of == {"81770": {100}}
    two = ProcsData(
        (JobProcess(100, "81770", "/job_81770"), JobProcess(101, "81771", "/job_81771")),
        TcpCounters(0, 0, 0),
    )
    assert hangs._job_process_maps(two)[1] == {"81770": {100}, "81771": {101}}


# --- attribution ----------------------------------------------------------------------------


def test_an_index_of_another_topology_is_not_used() -> None:
    flows = [EndpointFlow(GPU_A, "gpu0", DeviceClass.GPU, 10e9, 0.0, "test")]
    first = attribute(topology(), flows)
    # The root port trained down to Gen4 x8: the links' capacity follows the new topology,
    # even when handed the index of the old one.
    slower = topology(links={RP_SHARED: LinkState(16.0, 8, 32.0, 16)})
    rp = attribute(slower, flows, LinkIndex(topology())).link(RP_SHARED)
    assert rp is not None and rp.width == 8 and rp.speed_gts == 16.0
    old = first.link(RP_SHARED)
    assert old is not None and rp.capacity_bytes_per_second < old.capacity_bytes_per_second  # type: ignore[operator]
    # Each function's own link too.
    own = attribute(topology(links={GPU_A: LinkState(16.0, 4, 32.0, 16)}), flows).endpoint(GPU_A)
    assert own is not None and own.link is not None and own.link.current_width == 4


def test_the_staged_attribution_follows_a_new_topology() -> None:
    stage = DerivedStage()
    nvml = _nvml({})
    pci = SourceSample("pci", 1.0, 0.0, topology())
    first = stage.derive(_snap({"pci": pci, "nvml": nvml})).derived.attribution
    slower = SourceSample(
        "pci", 2.0, 0.0, topology(links={RP_SHARED: LinkState(16.0, 8, 32.0, 16)})
    )
    later = stage.derive(_snap({"pci": slower, "nvml": nvml})).derived.attribution
    assert first is not None and later is not None
    a, b = first.link(RP_SHARED), later.link(RP_SHARED)
    assert a is not None and b is not None and b.width == 8 and a.width != 8


# --- the stage ------------------------------------------------------------------------------


def _pair(prev: int, cur: int, t: float) -> dict[str, dict[str, SourceSample]]:
    return {
        "current": {
            "procs": SourceSample("procs", t, 0.0, ProcsData((), TcpCounters(cur, cur, 0)))
        },
        "previous": {
            "procs": SourceSample("procs", t - 1, 0.0, ProcsData((), TcpCounters(prev, prev, 0)))
        },
    }


def test_the_stage_gives_the_answer_a_snapshot_alone_gives() -> None:
    stage = DerivedStage()
    samples = _pair(100, 200, 10.0)
    alone = Snapshot(1, 10.0, 0.0, **samples)  # type: ignore[arg-type]
    staged = stage.derive(Snapshot(1, 10.0, 0.0, **samples))  # type: ignore[arg-type]
    assert staged.derived.procs_rates == alone.derived.procs_rates
    assert staged.derived.procs_rates is not None
    # The next pair: the rates of the new samples, not the carried ones.
    nxt = stage.derive(Snapshot(2, 11.0, 0.0, **_pair(200, 500, 11.0)))  # type: ignore[arg-type]
    rates = nxt.derived.procs_rates
    assert rates is not None and rates.tcp is not None
    assert rates.tcp.out_segs_per_second == 300.0


def test_a_copy_with_other_samples_does_not_keep_the_old_figures() -> None:
    snap = Snapshot(1, 10.0, 0.0, **_pair(100, 200, 10.0))  # type: ignore[arg-type]
    before = snap.derived.procs_rates
    moved = dataclasses.replace(snap, **_pair(100, 400, 10.0))
    after = moved.derived.procs_rates
    assert (
        before is not None
        and after is not None
        and before.tcp is not None
        and after.tcp is not None
    )
    assert (before.tcp.out_segs_per_second, after.tcp.out_segs_per_second) == (100.0, 300.0)
    # A copy with the same samples (the analysed snapshot) keeps them.
    assert dataclasses.replace(snap, findings=()).derived.procs_rates is before


def test_a_pair_no_rates_can_be_made_of_costs_only_that_source(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Not a ProcsData: the typed key refuses it, and the other figures are still made.
    snap = Snapshot(
        1,
        10.0,
        0.0,
        current={
            "procs": SourceSample("procs", 10.0, 0.0, "odd"),
            "nvml": SourceSample("nvml", 10.0, 0.0, _nvml({0: (1,)})),
        },
        previous={"procs": SourceSample("procs", 9.0, 0.0, "odd")},
    )
    assert snap.derived.procs_rates is None
    assert [g.index for g in snap.derived.gpu_uses] == [0, 1, 2]

    # Samples of the right type that the rate function cannot make rates of (it raises):
    # logged, None, and only that source's figure is lost.
    def unreadable(previous: ProcsData, current: ProcsData, seconds: float) -> None:
        raise ValueError("counters went backwards by a page")

    monkeypatch.setattr(derived_module, "procs_rates", unreadable)
    odd = ProcsData((), TcpCounters(7, 1, 0))
    snap = Snapshot(
        1,
        10.0,
        0.0,
        current={
            "procs": SourceSample("procs", 10.0, 0.0, ProcsData((), TcpCounters(5, 1, 0))),
            "nvml": SourceSample("nvml", 10.0, 0.0, _nvml({0: (1,)})),
        },
        previous={"procs": SourceSample("procs", 9.0, 0.0, odd)},
    )
    with caplog.at_level(logging.WARNING, logger="nodescope.derive"):
        assert snap.derived.procs_rates is None
    assert "source=procs derive_error=" in caplog.text
    assert [g.index for g in snap.derived.gpu_uses] == [0, 1, 2]


# --- alert rules ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rules",
    [
        {},
        {"pcie_contention": {"clear_below": 0.4}},
        {"pcie_contention": {"for_seconds": 5}, "made_up_kind": {"clear_below": 0.2}},
        {"nvlink_errors": {"clear_below": 0.3}, "pcie_saturation": {"enabled": False}},
    ],
)
def test_keep_floor_is_the_full_rule_tables_clear_below(rules: dict[str, object]) -> None:
    config = from_mapping({"alerts": {"rules": rules}})
    table = AlertRules.from_settings(config.alerts, ALERT_RULES)
    for kind in [*ALERT_RULES, *rules, "never_configured"]:
        assert (
            keep_floor(config, kind, ALERT_RULES.get(kind)) == table.for_kind(kind).clear_below
        ), kind


def test_a_reused_result_follows_its_inputs_across_the_stage() -> None:
    stage = DerivedStage()
    pci = SourceSample("pci", 1.0, 0.0, topology())
    made: list[object] = []

    def result(snap: Snapshot, threshold: float) -> list[object]:
        inputs = (snap.latest(PCI),)
        return snap.derived.reuse("test", inputs, threshold, lambda: made.append(1) or [threshold])

    first = stage.derive(_snap({"pci": pci}))
    assert result(first, 1.0) == [1.0] and len(made) == 1
    # The next cycle, the same pci sample and threshold: the result of the last cycle.
    assert result(stage.derive(_snap({"pci": pci})), 1.0) == [1.0] and len(made) == 1
    # A changed threshold, then a new pci sample: made again, with the new answer.
    assert result(stage.derive(_snap({"pci": pci})), 2.0) == [2.0] and len(made) == 2
    newer = SourceSample("pci", 2.0, 0.0, topology())
    assert result(stage.derive(_snap({"pci": newer})), 2.0) == [2.0] and len(made) == 3
    # A snapshot made without the stage computes for itself.
    assert result(_snap({"pci": newer}), 2.0) == [2.0] and len(made) == 4


def test_a_rank_of_another_job_in_the_cgroup_gives_it_none_of_that_jobs_gpus() -> None:
    # Job 81771's rank (pid 300, SLURM_JOB_ID=81771, GPUs 0,1) runs in job 81770's cgroup.
    foreign = dataclasses.replace(
        _task(300, "81770"),
        environ=(("SLURM_JOB_ID", "81771"), ("SLURM_JOB_GPUS", "0,1")),
    )
    own = dataclasses.replace(
        _task(100, "81770"), environ=(("SLURM_JOB_ID", "81770"), ("SLURM_JOB_GPUS", "2"))
    )
    jobs = _snap({"jobs": _jobs(own, foreign), "nvml": _nvml({0: (300,), 2: (100,)})})
    (job,) = jobs.derived.jobs
    assert (job.gpus, job.gpu_source) == ((2,), "environ")
    assert job.escaped_processes == ()


# --- how long a condition has held --------------------------------------------------------


def test_a_condition_holds_since_its_first_cycle_until_one_without_it() -> None:
    stage = DerivedStage()
    previous: Snapshot | None = None

    def cycle(t: float, keys: set[str], ask: bool = True) -> Mapping[object, float]:
        nonlocal previous
        snap = stage.derive(_snap({}, t=t))
        before = None if previous is None else previous.monotonic
        since = snap.derived.held_since("stalls", keys, t, before) if ask else {}
        # Asked again in the same snapshot (another reader): the same answer.
        if ask:
            assert snap.derived.held_since("stalls", keys, t, before) == since
        previous = snap
        return since

    assert cycle(1.0, {"a"}) == {"a": 1.0}
    assert cycle(2.0, {"a", "b"}) == {"a": 1.0, "b": 2.0}
    assert cycle(3.0, {"a", "b"}) == {"a": 1.0, "b": 2.0}
    # b stops for one cycle: it starts again; a goes on.
    assert cycle(4.0, {"a"}) == {"a": 1.0}
    assert cycle(5.0, {"a", "b"}) == {"a": 1.0, "b": 5.0}
    # A cycle whose detector did not ask (nothing could hold): everything starts again.
    cycle(6.0, set(), ask=False)
    assert cycle(7.0, {"a", "b"}) == {"a": 7.0, "b": 7.0}
    # Another name is another set of conditions.
    snap = stage.derive(_snap({}, t=8.0))
    assert snap.derived.held_since("other", {"a"}, 8.0, 7.0) == {"a": 8.0}


def test_a_stall_shorter_than_the_minimum_is_no_finding() -> None:
    stall = Finding(hangs.UNKNOWN, Severity.WARNING, {"job": "81743"}, {}, "stalled")
    stage = DerivedStage()
    previous: Snapshot | None = None
    found: dict[float, list[Finding]] = {}
    # Stalled from t=10 to t=24 (15 cycles: a pause at an epoch boundary), then from t=40 on.
    for t in range(0, 70):
        snap = stage.derive(_snap({}, t=float(t)))
        now = [stall] if 10 <= t < 25 or t >= 40 else []
        found[float(t)] = hangs.held_long_enough(now, previous, snap, 20.0)
        previous = snap
    assert [t for t, f in found.items() if f] == [float(t) for t in range(60, 70)]
    assert found[60.0][0].evidence["held_seconds"] == 20.0


def test_gpus_of_jobs_that_set_nccl_net_gdr_level_loc_are_host_staged() -> None:
    def task(pid: int, job: str, level: str | None) -> JobTask:
        env = (("NCCL_NET_GDR_LEVEL", level),) if level is not None else ()
        return JobTask(pid, "python3", f"/job_{job}/step_0", "0", env, 1, (), None)

    def cgroup(job: str, *tasks: JobTask) -> JobCgroup:
        return JobCgroup(f"job_{job}", job, "v2", f"/job_{job}", None, None, (), tasks, None, None)

    data = JobsData(
        "v2",
        (
            cgroup("81770", task(100, "81770", "LOC")),
            cgroup("81771", task(101, "81771", "PXB"), task(102, "81771", None)),
            cgroup("81772", task(103, "81772", " 0 ")),
        ),
        (),
        (),
    )
    nvml = _nvml({0: (100,), 1: (101,), 2: (103,)})
    snap = _snap({"jobs": data, "nvml": nvml})
    assert snap.derived.host_staged_gpus == frozenset({GPU_A, GPU_C})
    assert _snap({"nvml": nvml}).derived.host_staged_gpus == frozenset()


def test_readers_of_one_snapshot_asking_other_conditions_get_consistent_times() -> None:
    stage = DerivedStage()
    first = stage.derive(_snap({}, t=1.0))
    assert first.derived.held_since("stalls", {"a"}, 1.0, None) == {"a": 1.0}
    second = stage.derive(_snap({}, t=2.0))
    # One reader asks for a, another (another configuration) for a and b.
    assert second.derived.held_since("stalls", {"a"}, 2.0, 1.0) == {"a": 1.0}
    assert second.derived.held_since("stalls", {"a", "b"}, 2.0, 1.0) == {"a": 1.0, "b": 2.0}
    assert second.derived.held_since("stalls", {"b"}, 2.0, 1.0) == {"b": 2.0}
    # The next snapshot carries every condition asked of this one.
    third = stage.derive(_snap({}, t=3.0))
    assert third.derived.held_since("stalls", {"a", "b"}, 3.0, 2.0) == {"a": 1.0, "b": 2.0}


# --- departed ranks ---------------------------------------------------------------------------


def test_a_job_process_that_leaves_its_gpu_is_remembered_as_departed() -> None:
    jobs = SourceSample("jobs", 90.0, 0.0, _jobs(_task(100, "81770"), _task(101, "81770")))
    ib = SourceSample("infiniband", 90.0, 0.0, _ib(HCAS))
    stage = DerivedStage()
    before: float | None = None

    def departed(t: float, pids: Mapping[int, tuple[int, ...]], keep: float = 60.0) -> object:
        nonlocal before
        snap = stage.derive(_snap({"jobs": jobs, "nvml": _nvml(pids), "infiniband": ib}, t=t))
        found = snap.derived.departed_ranks(t, before, keep)
        before = t
        return found

    both = {0: (100,), 1: (101,)}
    assert departed(1.0, both) == ()
    assert departed(2.0, both) == ()
    # pid 101 (rank on GPU 1) is gone from NVML's compute processes at t=3.
    gone = departed(3.0, {0: (100,)})
    assert [(d.job_id, d.pid, d.comm, d.gpus, d.gone_at) for d in gone] == [  # type: ignore[attr-defined]
        ("81770", 101, "python3", (1,), 3.0)
    ]
    # Remembered, with the time it was first missed, while it stays gone.
    assert [d.gone_at for d in departed(30.0, {0: (100,)})] == [3.0]  # type: ignore[attr-defined]
    # Forgotten after keep_seconds.
    assert departed(64.0, {0: (100,)}) == ()


def test_departed_ranks_start_again_when_a_snapshot_did_not_ask() -> None:
    jobs = SourceSample("jobs", 90.0, 0.0, _jobs(_task(100, "81770"), _task(101, "81770")))
    stage = DerivedStage()
    snap = stage.derive(_snap({"jobs": jobs, "nvml": _nvml({0: (100,), 1: (101,)})}, t=1.0))
    assert snap.derived.departed_ranks(1.0, None, 60.0) == ()
    # A snapshot at t=2 that nobody asked: the one at t=3 has no memory to compare with.
    stage.derive(_snap({"jobs": jobs, "nvml": _nvml({0: (100,), 1: (101,)})}, t=2.0))
    snap = stage.derive(_snap({"jobs": jobs, "nvml": _nvml({0: (100,)})}, t=3.0))
    assert snap.derived.departed_ranks(3.0, 2.0, 60.0) == ()


def test_departed_ranks_are_bounded() -> None:
    tasks = tuple(_task(1000 + i, "81770") for i in range(100))
    jobs = SourceSample("jobs", 90.0, 0.0, _jobs(*tasks))
    stage = DerivedStage()
    every = {0: tuple(range(1000, 1100))}
    snap = stage.derive(_snap({"jobs": jobs, "nvml": _nvml(every)}, t=1.0))
    snap.derived.departed_ranks(1.0, None, 600.0)
    snap = stage.derive(_snap({"jobs": jobs, "nvml": _nvml({})}, t=2.0))
    gone = snap.derived.departed_ranks(2.0, 1.0, 600.0)
    assert len(gone) == derived_module.MAX_DEPARTED
