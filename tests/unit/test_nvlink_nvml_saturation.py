"""NVLink saturation from NVML's per-link data counters: the nvlink detector's bands on the
links the nvlink_counter module does not serve, and never twice for one link."""

from __future__ import annotations

from nodescope.assembly import default_config, from_mapping
from nodescope.detectors import nvlink as det
from nodescope.model.finding import Finding, Severity
from nodescope.model.nvlink_kmod import (
    NvlcHeader,
    NvlcRecord,
    NvlcRecords,
    NvlcSnapshot,
    NvlinkKmodData,
)
from nodescope.model.nvml import CounterValue, GpuSample, NvLinkSample, NvmlData
from nodescope.model.snapshot import Snapshot, SourceSample
from tests.unit.gpu_helpers import H100, gen5_sample

GB = 1e9
#: One NVLink 4 link: 25 GB/s per direction.
LINK = 25 * GB

#: The shipped ``[detectors.nvlink]`` table.
NVLINK = default_config().detectors.nvlink


def link(n: int, tx: int, rx: int, t_us: int) -> NvLinkSample:
    return NvLinkSample(
        link=n,
        active=True,
        remote_type="switch",
        remote_pci_address="0000:05:00.0",
        data_tx=CounterValue(tx, t_us, 64),
        data_rx=CounterValue(rx, t_us, 64),
        raw_tx=None,
        raw_rx=None,
        errors=(),
    )


def gpu(index: int, links: tuple[NvLinkSample, ...], name: str = H100) -> GpuSample:
    return gen5_sample(
        index,
        f"0000:{0x18 + index:02x}:00.0",
        name=name,
        gpu_util_percent=100,
        memory_util_percent=50,
        nvlinks=links,
    )


def nvml(*gpus: GpuSample, source: str = "nvml") -> NvmlData:
    return NvmlData(len(gpus), gpus, (), (), None, (), nvlink_data_source=source)


def reads(
    loads: dict[tuple[int, int], tuple[float, float]], name: str = H100, source: str = "nvml"
) -> tuple[NvmlData, NvmlData]:
    """Two NVML reads 1 s apart in which each (GPU, link) of ``loads`` moved (TX, RX) bytes/s."""
    indices = sorted({g for g, _ in loads})
    before, after = [], []
    for g in indices:
        links = sorted(n for i, n in loads if i == g)
        before.append(gpu(g, tuple(link(n, 0, 0, 10_000_000) for n in links), name))
        moved = tuple(
            link(n, int(loads[(g, n)][0]), int(loads[(g, n)][1]), 11_000_000) for n in links
        )
        after.append(gpu(g, moved, name))
    return nvml(*before, source=source), nvml(*after, source=source)


def kmod(t: float, served: dict[tuple[int, int], float]) -> NvlinkKmodData:
    """The module's read at ``t`` s: each served (GPU, link) has sent ``rate`` bytes/s since 0."""
    records = tuple(
        NvlcRecord(device=g, link=n, capacity_bps=int(LINK), counters=(int(rate * t), 0, 0, 0, 0))
        for (g, n), rate in sorted(served.items())
    )
    header = NvlcHeader(record_count=len(records), sequence=int(t), timestamp_ns=int(t * 1e9))
    return NvlinkKmodData(
        "/dev/nvlink_stats", "device", NvlcSnapshot(header, NvlcRecords.of(records))
    )


def snapshot(
    pair: tuple[NvmlData, NvmlData], module: tuple[NvlinkKmodData, NvlinkKmodData] | None = None
) -> Snapshot:
    previous = {"nvml": SourceSample("nvml", 10.0, 0.01, pair[0])}
    current = {"nvml": SourceSample("nvml", 11.0, 0.01, pair[1])}
    if module is not None:
        previous["nvlink_kmod"] = SourceSample("nvlink_kmod", 10.0, 0.0, module[0])
        current["nvlink_kmod"] = SourceSample("nvlink_kmod", 11.0, 0.0, module[1])
    return Snapshot(2, 11.0, 1.7e9, current, previous)


def saturation(found: list[Finding]) -> dict[tuple[str, str], Finding]:
    out = {}
    for f in found:
        assert f.kind == det.SATURATION
        where = (f.subjects["device"], f.subjects["link"])
        assert where not in out, f"two findings for {where}"
        out[where] = f
    return out


def test_nvml_counters_give_the_bands() -> None:
    loads = {
        (0, 0): (0.95 * LINK, 0.1 * LINK),  # critical: above 90 %
        (0, 1): (0.1 * LINK, 0.75 * LINK),  # warning: the larger direction counts
        (0, 2): (0.5 * LINK, 0.5 * LINK),  # normal
        (1, 0): (0.9 * LINK, 0.0),  # 90 % is still a warning
    }
    found = saturation(det.detect(None, snapshot(reads(loads)), NVLINK))
    assert set(found) == {("0", "0"), ("0", "1"), ("1", "0")}
    assert found[("0", "0")].severity is Severity.CRITICAL
    assert found[("0", "1")].severity is Severity.WARNING
    assert found[("1", "0")].severity is Severity.WARNING
    critical = found[("0", "0")]
    assert critical.evidence["utilisation_ratio"] == 0.95
    assert critical.evidence["tx_bytes_per_second"] == 0.95 * LINK
    assert critical.evidence["capacity_bytes_per_second"] == LINK
    assert critical.evidence["nvml_data_counters"] == 1.0
    assert all(isinstance(v, float) for v in critical.evidence.values())
    assert "device 0 link 0 at 95% of its 25 GB/s per direction" in critical.message
    assert "(NVML data counters)" in critical.message


def test_the_bands_are_the_nvlink_tables() -> None:
    pair = reads({(0, 0): (0.6 * LINK, 0.0)})
    assert det.detect(None, snapshot(pair), NVLINK) == []
    config = from_mapping({"detectors": {"nvlink": {"utilisation_warning_ratio": 0.5}}})
    [finding] = det.detect(None, snapshot(pair), config.detectors.nvlink)
    assert finding.severity is Severity.WARNING
    off = from_mapping({"detectors": {"nvlink": {"enabled": False}}})
    assert det.detect(None, snapshot(reads({(0, 0): (LINK, LINK)})), off.detectors.nvlink) == []


def test_a_blackwell_link_has_twice_the_capacity() -> None:
    pair = reads({(0, 0): (0.95 * LINK, 0.0)}, name="NVIDIA B200")
    # 23.75 GB/s of a 50 GB/s link: under half.
    assert det.detect(None, snapshot(pair), NVLINK) == []
    pair = reads({(0, 0): (1.9 * LINK, 0.0)}, name="NVIDIA B200")
    [finding] = det.detect(None, snapshot(pair), NVLINK)
    assert finding.evidence["capacity_bytes_per_second"] == 2 * LINK


def test_an_unknown_model_has_no_utilisation() -> None:
    pair = reads({(0, 0): (LINK, LINK)}, name="NVIDIA Future GPU")
    assert det.detect(None, snapshot(pair), NVLINK) == []


def test_capacities_by_model() -> None:
    assert det.nvlink_capacity("NVIDIA H100 80GB HBM3") == 25 * GB
    assert det.nvlink_capacity("NVIDIA H200") == 25 * GB
    assert det.nvlink_capacity("NVIDIA A100-SXM4-80GB") == 25 * GB
    assert det.nvlink_capacity("Tesla V100-SXM2-32GB") == 25 * GB
    assert det.nvlink_capacity("Tesla P100-SXM2-16GB") == 20 * GB
    assert det.nvlink_capacity("NVIDIA GB200") == 50 * GB
    assert det.nvlink_capacity("NVIDIA B200") == 50 * GB
    assert det.nvlink_capacity("NVIDIA L40S") is None


def test_links_the_module_serves_are_the_modules_alone() -> None:
    # Both sources see link 0 of GPU 0 saturated; only the module serves it.
    loads = {(0, 0): (0.95 * LINK, 0.0), (0, 1): (0.95 * LINK, 0.0)}
    module = (kmod(10.0, {(0, 0): 0.95 * LINK}), kmod(11.0, {(0, 0): 0.95 * LINK}))
    found = saturation(det.detect(None, snapshot(reads(loads), module), NVLINK))
    assert set(found) == {("0", "0"), ("0", "1")}
    assert "nvml_data_counters" not in found[("0", "0")].evidence
    assert "window_max_utilisation_ratio" in found[("0", "0")].evidence
    assert found[("0", "1")].evidence["nvml_data_counters"] == 1.0


def test_a_served_link_stays_the_modules_before_its_second_read() -> None:
    # The module's first read gives no rate yet: NVML does not stand in for that cycle.
    pair = reads({(0, 0): (0.95 * LINK, 0.0)})
    served = kmod(11.0, {(0, 0): 0.0})
    snap = snapshot(pair)
    snap = Snapshot(
        2,
        11.0,
        1.7e9,
        {**snap.current, "nvlink_kmod": SourceSample("nvlink_kmod", 11.0, 0, served)},
    )
    assert det.detect(None, snap, NVLINK) == []
    assert det.module_links(snap) == frozenset({(0, 0)})


def test_an_absent_module_serves_nothing() -> None:
    absent = NvlinkKmodData("/dev/nvlink_stats", "absent", None)
    pair = reads({(0, 0): (0.95 * LINK, 0.0)})
    found = det.detect(None, snapshot(pair, (absent, absent)), NVLINK)
    assert [f.evidence["nvml_data_counters"] for f in found] == [1.0]


def test_figures_nvml_did_not_serve_are_not_its_own() -> None:
    pair = reads({(0, 0): (0.95 * LINK, 0.0)}, source="kmod")
    assert det.detect(None, snapshot(pair), NVLINK) == []


def test_one_nvml_read_gives_no_rate() -> None:
    _, after = reads({(0, 0): (0.95 * LINK, 0.0)})
    snap = Snapshot(1, 11.0, 1.7e9, {"nvml": SourceSample("nvml", 11.0, 0.01, after)})
    assert det.detect(None, snap, NVLINK) == []
