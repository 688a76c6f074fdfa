"""The analysis step's caches: a memoized detector or intermediate gives the same result
object while its inputs are the same objects, and computes again, with the new answer, as
soon as one of them is a new object or a compared value changes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import pytest

from nodescope import jobs as registry_module
from nodescope.alerts import AlertRules, keep_floor
from nodescope.config import Config, from_mapping
from nodescope.detectors import errors, hangs, placement
from nodescope.detectors import jobs as jobs_detector
from nodescope.detectors.registry import ALERT_RULES
from nodescope.memo import Memo
from nodescope.model import attribution
from nodescope.model.attribution import EndpointFlow, attribute
from nodescope.model.finding import Finding
from nodescope.model.jobs import JobProcess
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.model.topology import AerCounter, AerRecord, DeviceClass, LinkState
from nodescope.sources.infiniband import IbDevice, InfinibandData
from nodescope.sources.jobs import JobCgroup, JobsData, JobTask
from nodescope.sources.nvml import GpuProcess, NvmlData
from nodescope.sources.procs import ProcsData, TcpCounters
from tests.unit.fabric_helpers import GPU_A, GPU_B, GPU_C, HCA, HCA_C, RP_SHARED, topology
from tests.unit.test_detectors import _gpu

# --- the cache itself ---------------------------------------------------------------------


def test_memo_keeps_the_result_of_the_same_objects() -> None:
    memo: Memo[list[int]] = Memo()
    calls: list[int] = []
    a, b = [1], [2]

    def compute(x: list[int]) -> list[int]:
        calls.append(1)
        return [*x, 0]

    first = memo.get((a,), 0.5, lambda: compute(a))
    assert memo.get((a,), 0.5, lambda: compute(a)) is first
    assert len(calls) == 1
    # An equal but other object is another input: identity, not equality, for records.
    again = memo.get(([1],), 0.5, lambda: compute([1]))
    assert again is not first and again == first and len(calls) == 2
    # A new object, or a changed value compared by equality, computes again.
    assert memo.get((b,), 0.5, lambda: compute(b)) == [2, 0]
    assert memo.get((b,), 0.6, lambda: compute(b)) == [2, 0]
    assert len(calls) == 4
    assert (memo.hits, memo.misses) == (1, 4)
    memo.clear()
    memo.get((b,), 0.6, lambda: compute(b))
    assert len(calls) == 5


def test_memo_tells_none_from_a_record_and_counts_the_inputs() -> None:
    memo: Memo[str] = Memo()
    assert memo.get((None,), None, lambda: "none") == "none"
    assert memo.get((None,), None, lambda: "again") == "none"
    assert memo.get((None, None), None, lambda: "two") == "two"
    assert memo.get((object(),), None, lambda: "record") == "record"


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


def test_placement_views_follow_the_processes_not_the_nvml_record() -> None:
    jobs = _jobs(_task(100, "81770", "=mlx5_1"), _task(101, "81770", "=mlx5_1"))
    ib = SourceSample("infiniband", 99.0, 0.0, _ib(HCAS))
    first = registry_module.placement_views(
        _snap({"jobs": jobs, "nvml": _nvml({0: (100,), 1: (101,)}), "infiniband": ib})
    )
    assert [v.gpus for v in first] == [(0, 1)]
    # A new NVML record (read every second) with the same compute processes: the same views.
    again = registry_module.placement_views(
        _snap({"jobs": jobs, "nvml": _nvml({0: (100,), 1: (101,)}), "infiniband": ib})
    )
    assert again is first
    # A process moved to GPU 2: new views with the new answer.
    moved = registry_module.placement_views(
        _snap({"jobs": jobs, "nvml": _nvml({0: (100,), 2: (101,)}), "infiniband": ib})
    )
    assert [v.gpus for v in moved] == [(0, 2)]
    # Another jobs record (the source read again) with other HCAs: computed again.
    other = _jobs(_task(100, "81770"), _task(101, "81770"))
    views = registry_module.placement_views(
        _snap({"jobs": other, "nvml": _nvml({0: (100,), 2: (101,)}), "infiniband": ib})
    )
    assert [v.hcas for v in views] == [("mlx5_0", "mlx5_1")]


def test_the_placement_detector_reruns_only_for_new_inputs() -> None:
    jobs = SourceSample("jobs", 90.0, 0.0, _jobs(_task(100, "81770", "=mlx5_1")))
    topo = SourceSample("pci", 80.0, 0.0, topology())
    config = Config()

    def detect(
        nvml: NvmlData, pci: SourceSample = topo, hcas: dict[str, str] = HCAS
    ) -> list[Finding]:
        snap = _snap({"jobs": jobs, "nvml": nvml, "infiniband": _ib(hcas), "pci": pci})
        return placement.detect(None, snap, config)

    first = detect(_nvml({0: (100,)}))
    assert [f.key for f in first] == ["job_hca_placement{job=81770}"]
    assert detect(_nvml({0: (100,)})) is first
    # The job's process now on GPU C, beside mlx5_1: no finding.
    assert detect(_nvml({2: (100,)})) == []
    # A new topology object (the pci source read again): evaluated again, the same answer.
    again = detect(_nvml({0: (100,)}), SourceSample("pci", 110.0, 0.0, topology()))
    assert again == first and again is not first
    # mlx5_1 is now the function beside GPU A: no finding.
    assert detect(_nvml({0: (100,)}), hcas={"mlx5_0": HCA, "mlx5_1": HCA}) == []


# --- the jobs detector ----------------------------------------------------------------------


def test_the_jobs_detector_keeps_its_findings_until_the_registry_changes() -> None:
    sample = SourceSample("jobs", 90.0, 0.0, _jobs(_task(100, "81770", gpus="0")))
    # GPU 0 belongs to the job (its process 100); pid 555 on it is outside the job.
    nvml = {0: (100, 555)}
    config = Config()
    first = jobs_detector.detect(None, _snap({"jobs": sample, "nvml": _nvml(nvml)}), config)
    assert [f.kind for f in first] == [jobs_detector.ESCAPE]
    assert jobs_detector.detect(None, _snap({"jobs": sample, "nvml": _nvml(nvml)}), config) is (
        first
    )
    # The escaped process ended: new registry, no finding.
    gone = jobs_detector.detect(None, _snap({"jobs": sample, "nvml": _nvml({0: (100,)})}), config)
    assert gone == []
    # A new jobs record in which 555 is the job's own: computed again.
    joined = _jobs(_task(100, "81770", gpus="0"), _task(555, "81770"))
    assert jobs_detector.detect(None, _snap({"jobs": joined, "nvml": _nvml(nvml)}), config) == []
    # The same record under a pressure threshold changed by a reload: evaluated again.
    lower = from_mapping({"detectors": {"jobs": {"memory_pressure_percent": 5.0}}})
    again = jobs_detector.detect(None, _snap({"jobs": sample, "nvml": _nvml(nvml)}), lower)
    assert again == first and again is not first


def test_the_registry_of_the_jobs_metrics_is_shared_until_the_record_changes() -> None:
    data = _jobs(_task(100, "81770"))
    snap = _snap({"jobs": data, "nvml": _nvml({0: (100,)})})
    first = registry_module.jobs_of(snap)
    assert registry_module.jobs_of(_snap({"jobs": data, "nvml": _nvml({0: (100,)})})) is first
    other = registry_module.jobs_of(_snap({"jobs": _jobs(_task(100, "81771"), job="81771")}))
    assert [j.job_id for j in other] == ["81771"]


# --- AER ----------------------------------------------------------------------------------


def _aer_topology(fatal: int) -> object:
    return topology(aer={GPU_A: (AerRecord("fatal", (AerCounter("x", fatal),), fatal),)})


def test_aer_findings_are_kept_while_the_pci_pair_is_the_same() -> None:
    before = SourceSample("pci", 70.0, 0.0, _aer_topology(0))
    after = SourceSample("pci", 100.0, 0.0, _aer_topology(1))
    config = Config()

    def aer(cur: SourceSample, prev: SourceSample) -> list[Finding]:
        snap = Snapshot(1, 101.0, 101.0, current={"pci": cur}, previous={"pci": prev})
        return [f for f in errors.detect(None, snap, config) if f.kind == errors.AER]

    first = aer(after, before)
    assert [f.evidence["errors"] for f in first] == [1.0]
    second = aer(after, before)
    assert second == first and all(a is b for a, b in zip(second, first, strict=True))
    # The pci source read again: two more fatal errors.
    later = SourceSample("pci", 130.0, 0.0, _aer_topology(3))
    assert [f.evidence["errors"] for f in aer(later, after)] == [2.0]
    assert aer(SourceSample("pci", 160.0, 0.0, _aer_topology(3)), later) == []


def test_nvlink_error_counters_that_did_not_move_are_no_finding() -> None:
    from tests.unit.test_detectors import _link

    def nvml(**counts: int) -> NvmlData:
        return NvmlData(
            1, (_gpu(0, GPU_A, nvlinks=(_link(0, **counts), _link(1))),), (), (), None, ()
        )

    assert errors.nvml_findings(nvml(crc_flit=5), nvml(crc_flit=5), 1.0, 1.0, 1.0) == []
    (moved,) = errors.nvml_findings(nvml(crc_flit=5), nvml(crc_flit=9), 1.0, 1.0, 1.0)
    assert moved.evidence["crc_flit_errors"] == 4.0


# --- hangs ----------------------------------------------------------------------------------


def test_the_job_process_maps_follow_the_procs_record() -> None:
    one = ProcsData((JobProcess(100, "81770", "/job_81770"),), TcpCounters(0, 0, 0))
    job_of, pids_of = hangs._job_processes(one)
    assert hangs._job_processes(one)[0] is job_of
    assert job_of == {100: "81770"} and pids_of == {"81770": {100}}
    two = ProcsData(
        (JobProcess(100, "81770", "/job_81770"), JobProcess(101, "81771", "/job_81771")),
        TcpCounters(0, 0, 0),
    )
    assert hangs._job_processes(two)[1] == {"81770": {100}, "81771": {101}}


# --- attribution ----------------------------------------------------------------------------


def test_the_link_index_is_built_again_for_a_new_topology() -> None:
    flows = [EndpointFlow(GPU_A, "gpu0", DeviceClass.GPU, 10e9, 0.0, "test")]
    first = attribute(topology(), flows)
    index = attribution._last_index
    assert attribute(index.topology, flows).link(RP_SHARED) == first.link(RP_SHARED)  # type: ignore[union-attr]
    assert attribution._last_index is index
    # The root port trained down to Gen4 x8: the links' capacity follows the new topology.
    slower = topology(links={RP_SHARED: LinkState(16.0, 8, 32.0, 16)})
    rp = attribute(slower, flows).link(RP_SHARED)
    assert attribution._last_index is not index
    assert rp is not None and rp.width == 8 and rp.speed_gts == 16.0
    old = first.link(RP_SHARED)
    assert old is not None and rp.capacity_bytes_per_second < old.capacity_bytes_per_second  # type: ignore[operator]
    # Each function's own link too.
    own = attribute(topology(links={GPU_A: LinkState(16.0, 4, 32.0, 16)}), flows).endpoint(GPU_A)
    assert own is not None and own.link is not None and own.link.current_width == 4


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
