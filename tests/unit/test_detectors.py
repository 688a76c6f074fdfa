"""The pure detectors: where each raises and where it stays silent, the evidence numbers, and
messages that name devices, links and jobs."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.assembly import default_config, from_mapping
from nodescope.detectors import contention, errors, links, nvlink, placement
from nodescope.detectors.registry import ALERT_RULES, DETECTORS, saturation_inputs
from nodescope.errors import ConfigError
from nodescope.model.attribution import EndpointFlow, attribute
from nodescope.model.finding import THRESHOLD, VALUE, Finding, Severity
from nodescope.model.jobs import GpuUse, JobProcess, JobView, job_views, parse_nccl_ib_hca
from nodescope.model.topology import (
    AerCounter,
    AerRecord,
    DeviceClass,
    LinkState,
    link_capacity_bytes_per_s,
)
from nodescope.sources.infiniband import CounterRate, InfinibandRates, PortRates
from nodescope.sources.jobs import JobCgroup, JobsData, JobTask
from nodescope.sources.nvml import GpuProcess, GpuSample, NvLinkSample, NvmlData
from nodescope.sources.procs import ProcsData, TcpCounters
from tests.unit.fabric_helpers import (
    GPU_A,
    GPU_B,
    GPU_C,
    HCA,
    HCA_C,
    NVME,
    RP_SHARED,
    snapshot,
    topology,
)
from tests.unit.gpu_helpers import gpu_sample

GEN5 = link_capacity_bytes_per_s(5, 16)
GEN4 = link_capacity_bytes_per_s(4, 16)


def flow(bdf: str, name: str, cls: DeviceClass, down: float, up: float) -> EndpointFlow:
    return EndpointFlow(bdf, name, cls, down, up, "test")


# --- contention -------------------------------------------------------------------------------


def _contended(gpu_down: float, nvme_up: float, hca: float = 0.0) -> list[Any]:
    flows = [
        flow(GPU_A, "gpu0", DeviceClass.GPU, gpu_down, 0.0),
        flow(NVME, "nvme0n1", DeviceClass.NVME, 0.0, nvme_up),
        flow(HCA, "mlx5_0", DeviceClass.INFINIBAND, hca, hca),
    ]
    a = attribute(topology(), flows)
    return contention.evaluate(
        a.shared_links, 0.6, 0.1, jobs_by_bdf={GPU_A: ["81740"]}, extra_evidence={}
    )


def test_contention_raises_at_the_threshold_with_two_classes() -> None:
    found = _contended(0.6 * GEN5, 6.5e9)
    assert [f.key for f in found] == [f"pcie_contention{{link={RP_SHARED}}}"]
    f = found[0]
    assert f.severity is Severity.WARNING
    assert f.evidence[VALUE] == pytest.approx(0.6)
    assert f.evidence[THRESHOLD] == 0.6
    assert f.evidence["downstream_bytes_per_second"] == pytest.approx(0.6 * GEN5)
    assert f.evidence["upstream_bytes_per_second"] == pytest.approx(6.5e9)
    assert f.evidence["nvme0n1_share_ratio"] == pytest.approx(6.5e9 / (0.6 * GEN5 + 6.5e9))
    assert f.evidence["endpoints"] == 2.0
    # The message names the link, its capacity, the devices, what they do, and the job.
    for part in (RP_SHARED, "root port", "Gen5 x16", "63.0 GB/s", "gpu0 H2D", "job 81740",
                 "nvme0n1 reads 6.5 GB/s", "60% downstream"):  # fmt: skip
        assert part in f.message, (part, f.message)


def test_contention_message_adds_up_per_direction() -> None:
    # Downstream: the GPU's H2D and the NIC's transmit; upstream: the NVMe's reads and the
    # NIC's receive. Each direction lists every contributor and only its own traffic.
    (f,) = _contended(0.55 * GEN5, 6.5e9, hca=6e9)
    down, up = f.message.split(": ", 1)[1].split("; ")
    assert "gpu0 H2D" in down and "mlx5_0 transmit 6.0 GB/s" in down
    assert f"= {(0.55 * GEN5 + 6e9) / GEN5:.0%} downstream" in down
    assert "receive" not in down and "reads" not in down
    assert "nvme0n1 reads 6.5 GB/s" in up and "mlx5_0 receive 6.0 GB/s" in up
    assert f"= {(6.5e9 + 6e9) / GEN5:.0%} upstream" in up
    assert "H2D" not in up and "transmit" not in up


def test_contention_stays_silent_just_below_the_threshold() -> None:
    assert _contended(0.6 * GEN5 * 0.999, 6.5e9) == []


def test_contention_needs_a_second_class_with_a_real_share() -> None:
    # nvme at 5 % of the link's traffic: not a real share.
    gpu = 0.7 * GEN5
    assert _contended(gpu, 0.05 / 0.95 * gpu) == []
    # the same GPU load with a NIC of 10 % makes it contention again
    found = _contended(gpu, 0.0, hca=0.0556 * gpu)
    assert [f.key for f in found] == [f"pcie_contention{{link={RP_SHARED}}}"]
    assert "mlx5_0 transmit" in found[0].message


def test_contention_ignores_one_class_only() -> None:
    # Two GPUs below one host bridge fill it, but no other class takes part.
    a = attribute(
        topology(),
        [
            flow(GPU_A, "gpu0", DeviceClass.GPU, 0.9 * GEN5, 0.0),
            flow(GPU_B, "gpu1", DeviceClass.GPU, 0.9 * GEN5, 0.0),
        ],
    )
    assert contention.evaluate(a.shared_links, 0.6, 0.1) == []


def test_contention_keep_band_reports_below_the_threshold() -> None:
    flows = [
        flow(GPU_A, "gpu0", DeviceClass.GPU, 0.55 * GEN5, 0.0),
        flow(NVME, "nvme0n1", DeviceClass.NVME, 0.0, 6e9),
    ]
    a = attribute(topology(), flows)
    assert contention.evaluate(a.shared_links, 0.6, 0.1) == []
    kept = contention.evaluate(a.shared_links, 0.6, 0.1, floor=0.5)
    assert len(kept) == 1
    assert kept[0].evidence[VALUE] < kept[0].evidence[THRESHOLD]


@settings(max_examples=200, deadline=None)
@given(
    st.floats(0.0, 1.2 * 63e9, allow_nan=False),
    st.floats(0.0, 8e9, allow_nan=False),
    st.floats(0.0, 40e9, allow_nan=False),
)
def test_contention_raises_exactly_when_the_rule_holds(gpu: float, nvme: float, hca: float) -> None:
    flows = [
        flow(GPU_A, "gpu0", DeviceClass.GPU, gpu, 0.0),
        flow(NVME, "nvme0n1", DeviceClass.NVME, 0.0, nvme),
        flow(HCA, "mlx5_0", DeviceClass.INFINIBAND, hca, hca),
    ]
    a = attribute(topology(), flows)
    found = contention.evaluate(a.shared_links, 0.6, 0.1)
    rp = a.link(RP_SHARED)
    assert rp is not None
    total = rp.total_bytes_per_second
    util = max(rp.downstream.utilisation or 0.0, rp.upstream.utilisation or 0.0)
    classes = {
        f.device_class for f in rp.flows if total and f.total_bytes_per_second / total >= 0.1
    }
    # More than the link can carry is no contention: the traffic took another path.
    expected = 0.6 <= util <= contention.IMPOSSIBLE_UTILISATION and len(classes) >= 2
    assert any(f.subjects["link"] == RP_SHARED for f in found) == expected
    for f in found:
        assert 0.6 <= f.evidence[VALUE] <= contention.IMPOSSIBLE_UTILISATION


# --- saturation -------------------------------------------------------------------------------


def _gpu(
    index: int,
    bdf: str,
    name: str = "NVIDIA A100-SXM4-80GB",
    *,
    gen: tuple[int, int] = (4, 4),
    width: tuple[int, int] = (16, 16),
    replays: int | None = 0,
    pids: tuple[int, ...] = (),
    nvlinks: tuple[NvLinkSample, ...] = (),
) -> GpuSample:
    return gpu_sample(
        index,
        bdf,
        name=name,
        pcie_gen_current=gen[0],
        pcie_width_current=width[0],
        pcie_gen_max=gen[1],
        pcie_width_max=width[1],
        pcie_replays=replays,
        gpu_util_percent=90,
        memory_util_percent=50,
        decoder_util_percent=0,
        encoder_util_percent=0,
        jpeg_util_percent=0,
        processes=tuple(GpuProcess(p, None) for p in pids),
        nvlinks=nvlinks,
    )


def _saturation(down: float, up: float, name: str = "NVIDIA A100-SXM4-80GB") -> list[Any]:
    topo = topology(links={GPU_A: LinkState(16.0, 16, 16.0, 16)})  # Gen4 x16
    a = attribute(topo, [flow(GPU_A, "gpu0", DeviceClass.GPU, down, up)])
    return links.saturation(
        a.endpoints,
        {GPU_A: _gpu(0, GPU_A, name)},
        bidirectional_ratio=0.6,
        one_way_ratio=0.85,
        models={"A100": 0.57, "A100-SXM4-40GB": 0.5},
        jobs_by_bdf={GPU_A: ["81744"]},
    )


def test_saturation_at_the_measured_a100_point() -> None:
    found = _saturation(20e9, 18e9)  # 38 of 63 GB/s both ways
    assert [f.key for f in found] == [f"pcie_saturation{{device={GPU_A},gpu=0}}"]
    f = found[0]
    assert f.evidence["bidirectional_utilisation_ratio"] == pytest.approx(38e9 / (2 * GEN4))
    assert f.evidence["bidirectional_threshold_ratio"] == 0.57
    assert f.evidence[VALUE] == pytest.approx(38e9 / (2 * GEN4) / 0.57)
    assert f.evidence[THRESHOLD] == 1.0
    for part in ("GPU 0", GPU_A, "A100", "Gen4 x16", "38.0 GB/s", "for A100", "job 81744"):
        assert part in f.message, (part, f.message)


def test_saturation_boundaries_per_model() -> None:
    at = 0.57 * 2 * GEN4
    assert _saturation(at / 2, at / 2)
    assert not _saturation(at / 2 * 0.999, at / 2 * 0.999)
    # An unknown model takes the default ratio (0.6 here): the A100 point is not enough.
    assert not _saturation(at / 2, at / 2, name="NVIDIA H100 80GB HBM3")
    # The longest matching key wins.
    found = _saturation(0.26 * 2 * GEN4, 0.26 * 2 * GEN4, name="NVIDIA A100-SXM4-40GB")
    assert found and found[0].evidence["bidirectional_threshold_ratio"] == 0.5


def test_saturation_one_way() -> None:
    found = _saturation(0.85 * GEN4, 0.0)
    assert found and found[0].evidence["one_way_utilisation_ratio"] == pytest.approx(0.85)
    assert not _saturation(0.84 * GEN4, 0.0)


def test_model_ratio() -> None:
    assert links.model_ratio("NVIDIA A100-SXM4-80GB", {"a100": 0.5}, 0.6) == (0.5, "a100")
    assert links.model_ratio("NVIDIA H100", {"A100": 0.5}, 0.6) == (0.6, None)


# --- downtraining -----------------------------------------------------------------------------


def _downtraining(gpu_link: LinkState, traffic: float, nvml: tuple[int, int] = (5, 5)) -> list[Any]:
    topo = topology(links={GPU_A: gpu_link, "0000:12:00.0": gpu_link})
    a = attribute(topo, [flow(GPU_A, "gpu0", DeviceClass.GPU, traffic, 0.0)])
    gpus = {GPU_A: _gpu(3, GPU_A, "NVIDIA H100 80GB HBM3", gen=nvml)}
    return links.downtraining(a, gpus, 1e9, jobs_by_bdf={GPU_A: ["81742"]})


def test_downtraining_under_load() -> None:
    found = _downtraining(LinkState(2.5, 16, 32.0, 16), 3.6e9)
    assert [f.key for f in found] == [f"pcie_link_downtrained{{device={GPU_A},gpu=3}}"]
    f = found[0]
    assert f.evidence["current_generation"] == 1.0 and f.evidence["max_generation"] == 5.0
    assert f.evidence["current_speed_gts"] == 2.5
    assert f.evidence["capacity_bytes_per_second"] == pytest.approx(4e9)
    for part in ("GPU 3", GPU_A, "below 0000:12:00.0", "Gen1 x16 of Gen5 x16", "job 81742"):
        assert part in f.message, (part, f.message)


def test_downtraining_width() -> None:
    found = _downtraining(LinkState(32.0, 8, 32.0, 16), 14e9)
    assert found and found[0].evidence["current_width_lanes"] == 8.0
    assert "Gen5 x8 of Gen5 x16" in found[0].message


def test_idle_downtraining_is_no_finding() -> None:
    assert _downtraining(LinkState(2.5, 16, 32.0, 16), 0.99e9) == []
    assert _downtraining(LinkState(32.0, 16, 32.0, 16), 50e9) == []


def test_downtraining_seen_by_nvml_only() -> None:
    found = _downtraining(LinkState(32.0, 16, 32.0, 16), 5e9, nvml=(3, 5))
    assert found and found[0].evidence["current_generation"] == 3.0


# --- error counters ---------------------------------------------------------------------------


def _aer(severity: str, total: int, **counters: int) -> AerRecord:
    return AerRecord(severity, tuple(AerCounter(n, v) for n, v in counters.items()), total)


def _link(n: int, **counts: int) -> NvLinkSample:
    return NvLinkSample(n, True, "switch", "0000:83:00.0", None, None, None, None,
                        tuple(counts.items()))  # fmt: skip


def _nvml(replays: int, nvlinks: tuple[NvLinkSample, ...] = ()) -> NvmlData:
    gpu = _gpu(2, GPU_A, "NVIDIA H100", gen=(5, 5), replays=replays, nvlinks=nvlinks)
    return NvmlData(1, (gpu,), (), (), None, ())


def _ib(symbol: float, downed: float, wait: float) -> InfinibandRates:
    port = PortRates(
        "mlx5_0", 1, 1e9, 1e9, None, None, wait, None, None, None,
        (CounterRate("symbol_error", symbol), CounterRate("link_downed", downed)), (),
    )  # fmt: skip
    return InfinibandRates(10.0, (port,))


def test_ib_xmit_wait_is_congestion_apart_from_errors() -> None:
    # Error counters in the rates are the windows' to judge: only the transmit waits here.
    assert errors.xmit_wait_findings(_ib(0.0, 0.0, 0.0), 1e6) == []
    (found,) = errors.xmit_wait_findings(_ib(0.1, 0.1, 2e6), 1e6)
    assert found.key == "ib_xmit_wait{hca=mlx5_0,port=1}"
    assert found.evidence["xmit_wait_per_second"] == 2e6
    assert errors.xmit_wait_findings(_ib(0.01, 0.0, 0.99e6), 1e6) == []


def test_error_kinds_fire_at_once() -> None:
    for kind in (errors.AER, errors.REPLAYS, errors.NVLINK, errors.IB_ERRORS, errors.ECC_CORRECTED):
        assert ALERT_RULES[kind].for_seconds == 0.0


# --- placement and the job view ---------------------------------------------------------------


HCAS = {"mlx5_0": HCA, "mlx5_1": HCA_C}


def _views(hca: str | None) -> tuple[JobView, ...]:
    procs = [JobProcess(100, "81770", "/job_81770/step_0/user/task_0", hca),
             JobProcess(101, "81770", "/job_81770/step_0/user/task_1", hca)]  # fmt: skip
    gpus = [GpuUse(0, GPU_A, (100,)), GpuUse(1, GPU_B, (101,)), GpuUse(2, GPU_C, ())]
    return job_views(procs, gpus, HCAS)


def test_job_view_from_processes_and_nccl_ib_hca() -> None:
    (view,) = _views("=mlx5_1")
    assert view.gpus == (0, 1) and view.gpu_bdfs == (GPU_A, GPU_B)
    assert view.hcas == ("mlx5_1",) and view.hca_source == "NCCL_IB_HCA"
    (view,) = _views(None)
    assert view.hcas == ("mlx5_0", "mlx5_1") and view.hca_source == "all"


def test_placement_across_numa_is_a_warning() -> None:
    found = placement.evaluate(_views("mlx5_1"), topology(), HCAS)
    assert [f.key for f in found] == ["job_hca_placement{job=81770}"]
    f = found[0]
    assert f.severity is Severity.WARNING
    assert f.evidence["gpus_across_numa"] == 2.0
    for part in ("job 81770", "GPUs 0,1", "NUMA 0", "mlx5_1 (NUMA 1)", "mlx5_0 (GPU 0)"):
        assert part in f.message, (part, f.message)


def test_placement_with_the_near_hca_is_fine() -> None:
    assert placement.evaluate(_views(None), topology(), HCAS) == []
    assert placement.evaluate(_views("mlx5_0"), topology(), HCAS) == []


def test_placement_another_root_complex_is_info() -> None:
    # Both host bridges on NUMA node 0: GPU C (pci0000:80) told to use mlx5_0 (pci0000:10)
    # while mlx5_1 shares its root complex.
    topo = topology()
    topo = dataclasses.replace(
        topo,
        devices=tuple(dataclasses.replace(d, numa_node=0) for d in topo.devices),
    )
    procs = [JobProcess(100, "7", "/job_7", "=mlx5_0")]
    (view,) = job_views(procs, [GpuUse(2, GPU_C, (100,))], HCAS)
    found = placement.evaluate([view], topo, HCAS)
    assert [f.key for f in found] == ["job_hca_placement{job=7}"]
    assert found[0].severity is Severity.INFO
    assert found[0].evidence["gpus_across_root_complex"] == 1.0
    assert "another root complex" in found[0].message
    # On the two-socket tree the same choice crosses sockets: a warning.
    (far,) = placement.evaluate([view], topology(), HCAS)
    assert far.severity is Severity.WARNING


@pytest.mark.parametrize(
    ("value", "devices", "chosen"),
    [
        ("mlx5", ["mlx5_0", "mlx5_10", "ib0"], ("mlx5_0", "mlx5_10")),
        ("=mlx5_1", ["mlx5_1", "mlx5_10"], ("mlx5_1",)),
        ("mlx5_1:1,mlx5_4:1", ["mlx5_1", "mlx5_4", "mlx5_5"], ("mlx5_1", "mlx5_4")),
        ("^=mlx5_1", ["mlx5_1", "mlx5_10"], ("mlx5_10",)),
        ("^mlx5_1", ["mlx5_1", "mlx5_10", "mlx5_2"], ("mlx5_2",)),
    ],
)
def test_nccl_ib_hca(value: str, devices: list[str], chosen: tuple[str, ...]) -> None:
    f = parse_nccl_ib_hca(value)
    assert f is not None and f.select(devices) == chosen


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_nccl_ib_hca_never_raises(value: str) -> None:
    f = parse_nccl_ib_hca(value)
    if f is not None:
        f.select(["mlx5_0", "mlx5_1"])


# --- wiring: the registry, the config, the snapshot path --------------------------------------


def test_registry_runs_these_detectors() -> None:
    names = {d.name for d in DETECTORS}
    assert {"contention", "saturation", "downtraining", "errors", "placement"} <= names


def test_detectors_config_section() -> None:
    config = from_mapping(
        {
            "detectors": {
                "contention": {"utilisation_ratio": 0.7, "min_share": 0.2},
                "saturation": {"models": {"H100": 0.5}},
                "errors": {"enabled": False},
            }
        }
    )
    d = config.detectors
    assert d.contention.utilisation_ratio == 0.7
    assert d.contention.min_share == 0.2
    assert dict(d.saturation_models) == {"A100": 0.57, "H100": 0.5}
    assert not d.errors.enabled and d.placement.enabled
    assert default_config().detectors.saturation.bidirectional_ratio == 0.57
    for bad in (
        {"detectors": {"nope": {}}},
        {"detectors": {"contention": {"nope": 1}}},
        {"detectors": {"contention": {"utilisation_ratio": 1.5}}},
        {"detectors": {"saturation": {"models": {"A100": 0}}}},
    ):
        with pytest.raises(ConfigError):
            from_mapping(bad)


def test_detect_on_a_snapshot_with_tcp_evidence_and_jobs() -> None:
    """The registry form: data from the snapshot, jobs from the job registry, TCP from
    /proc/net/snmp."""
    from nodescope.sources.nvml import CounterValue

    def nvml(tx: int, rx: int) -> NvmlData:
        gpu = dataclasses.replace(
            _gpu(0, GPU_A, "NVIDIA A100-SXM4-80GB", pids=(4242,)),
            pcie_tx=CounterValue(tx, None, 64),
            pcie_rx=CounterValue(rx, None, 64),
        )
        return NvmlData(1, (gpu,), (), (), None, ())

    topo = topology(links={GPU_A: LinkState(16.0, 16, 16.0, 16)})
    procs_before = ProcsData((), TcpCounters(0, 1000, 10))
    procs_after = ProcsData((), TcpCounters(0, 21000, 12))
    task = JobTask(4242, "python3", "/job_81744/step_0", "0", (), 1, (), None)
    job = JobCgroup("job_81744", "81744", "v2", "/job_81744", None, None, (), (task,), None, None)
    jobs = JobsData("v2", (job,), (), ())
    snap = snapshot(
        {
            "pci": topo,
            "nvml": nvml(18_000_000_000, 20_000_000_000),
            "procs": procs_after,
            "jobs": jobs,
        },
        {"pci": topo, "nvml": nvml(0, 0), "procs": procs_before, "jobs": jobs},
    )
    found = links.detect_saturation(None, snap, saturation_inputs(default_config()))
    assert len(found) == 1
    f = found[0]
    assert f.evidence["tcp_retransmitted_segments_per_second"] == pytest.approx(2.0)
    assert f.evidence["tcp_retransmit_ratio"] == pytest.approx(2.0 / 20000)
    assert "job 81744" in f.message and "TCP retransmits 2.0/s" in f.message
    disabled = from_mapping({"detectors": {"saturation": {"enabled": False}}})
    assert links.detect_saturation(None, snap, saturation_inputs(disabled)) == []


# --- NVSwitch stalls ---------------------------------------------------------------------------


def _switch_links(gpu: int) -> tuple[NvLinkSample, ...]:
    """Links 0-1 to switch A, 2-3 to switch B."""
    switch = ("0000:83:00.0", "0000:83:00.0", "0000:84:00.0", "0000:84:00.0")
    return tuple(
        NvLinkSample(n, True, "switch", switch[n], None, None, None, None, ()) for n in range(4)
    )


def _stall(device: int, link: int) -> Finding:
    return Finding(
        nvlink.STALL_BURST,
        Severity.WARNING,
        {"device": str(device), "link": str(link)},
        {"stall_cycles_per_microsecond": 400.0, "window_max_stall_cycles_per_microsecond": 2200.0},
        "burst",
    )


def test_most_links_into_one_switch_stalling_fold_into_one_finding() -> None:
    gpus = tuple(_gpu(i, f"0000:1{i}:00.0", nvlinks=_switch_links(i)) for i in range(3))
    nvml = NvmlData(3, gpus, (), (), None, ())
    other = Finding(nvlink.SATURATION, Severity.WARNING, {"device": "0", "link": "2"}, {}, "busy")
    # 5 of switch A's 6 links stall, across three GPUs; one of switch B's 6 does.
    stalls = [_stall(d, n) for d in range(3) for n in (0, 1) if (d, n) != (2, 1)] + [_stall(1, 3)]
    found = nvlink.fold_switch_stalls([*stalls, other], nvml, {0: ["81"], 2: ["82"]})
    switch = [f for f in found if f.kind == nvlink.SWITCH_STALL]
    assert [f.subjects for f in switch] == [{"nvswitch": "0000:83:00.0"}]
    assert switch[0].evidence["links_stalled"] == 5 and switch[0].evidence["links_into_switch"] == 6
    assert "GPUs 0, 1, 2" in switch[0].message and "jobs 81, 82" in switch[0].message
    # Switch A's link findings are folded; switch B's one link and the saturation stay.
    assert sorted(f.key for f in found if f.kind != nvlink.SWITCH_STALL) == sorted(
        [_stall(1, 3).key, other.key]
    )


def test_one_gpus_links_to_a_switch_are_no_switch_stall() -> None:
    gpus = tuple(_gpu(i, f"0000:1{i}:00.0", nvlinks=_switch_links(i)) for i in range(3))
    nvml = NvmlData(3, gpus, (), (), None, ())
    stalls = [_stall(0, 0), _stall(0, 1)]  # GPU 0's own links: 2 of 6 into switch A
    assert nvlink.fold_switch_stalls(stalls, nvml, {}) == stalls
    assert nvlink.fold_switch_stalls(stalls, None, {}) == stalls


def test_gpudirect_rdma_at_line_rate_is_no_root_port_contention() -> None:
    """Every HCA at 92 % of NDR each way through GPUDirect RDMA, flat xmit_wait: with
    nvidia_peermem loaded the bytes turn in the switch; without it the root port would show
    148 % downstream, which no link carries, and is no finding either."""
    ndr = 0.92 * 50e9
    flows = [
        flow(GPU_A, "gpu0", DeviceClass.GPU, ndr + 1e9, ndr),
        flow(HCA, "mlx5_0", DeviceClass.INFINIBAND, ndr, ndr),
        flow(NVME, "nvme0n1", DeviceClass.NVME, 0.0, 1e9),
    ]
    base = topology()
    loaded = dataclasses.replace(base, peer_modules=frozenset({"nvidia_peermem"}))
    for topo in (base, loaded):
        assert contention.evaluate(attribute(topo, flows).shared_links, 0.6, 0.1) == []
    # The same traffic to host memory at a rate the root port can carry is contention, and a
    # contention beside peer-to-peer traffic names what turned below the link.
    busy = [
        flow(GPU_A, "gpu0", DeviceClass.GPU, 30e9, 20e9),
        flow(HCA, "mlx5_0", DeviceClass.INFINIBAND, 10e9, 20e9),
        flow(NVME, "nvme0n1", DeviceClass.NVME, 0.0, 6e9),
    ]
    (plain,) = contention.evaluate(attribute(base, busy).shared_links, 0.6, 0.1)
    assert "peer to peer" not in plain.message
    # With nvidia_peermem, 10 GB/s from the GPU and 20 GB/s to it turn in the switch: the root
    # port keeps 10 GB/s down and 16 GB/s up (the GPU's 10 to host memory, the drive's 6).
    (found,) = contention.evaluate(attribute(loaded, busy).shared_links, 0.2, 0.1)
    assert found.subjects == {"link": RP_SHARED}
    assert "peer to peer below it, not counted: gpu0↔mlx5_0 20.0 GB/s to the GPU" in found.message
    assert "(GPUDirect RDMA: nvidia_peermem loaded, ACS not read)" in found.message
    assert found.evidence["peer_to_peer_bytes_per_second"] == pytest.approx(30e9)
