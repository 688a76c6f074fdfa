"""GPU metric families from snapshots built with the NVML source over the fake NVML."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.roots import Roots
from nodescope.sim.fake_nvml import FakeNvml, FakeProcess, hgx_h100
from nodescope.sources import nvml as nv
from nodescope_exporters import gpu_metrics
from nodescope_exporters.catalog import CATALOG
from nodescope_exporters.prometheus import render

NO_FILES = Roots.under("/nonexistent-nodescope-root")


def snapshot_of(data: object) -> Snapshot:
    return Snapshot(
        cycle=1,
        monotonic=1.0,
        wall_time=0.0,
        current={"nvml": SourceSample("nvml", 1.0, 0.0, data)},
    )


def samples(snapshot: Snapshot) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = render(snapshot, [gpu_metrics.families]).decode()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            key = (sample.name, tuple(sorted(sample.labels.items())))
            assert key not in out, f"duplicate series {key}"
            out[key] = sample.value
    return out


def value(
    s: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return s[(name, tuple(sorted(labels.items())))]


@pytest.fixture
def node() -> FakeNvml:
    gpus = hgx_h100()
    gpus[0].pcie_tx_bytes, gpus[0].pcie_rx_bytes = 5_000_000, 7_000_000
    gpus[0].replay_counter = 3
    gpus[0].decoder_util, gpus[0].jpeg_util, gpus[0].gpu_util = 25, 50, 100
    gpus[0].processes = [FakeProcess(10, 1 << 30), FakeProcess(11, 1 << 29)]
    gpus[0].links[5].data_tx_kib, gpus[0].links[5].raw_rx_kib = 3, 4
    gpus[0].links[5].errors[0] = 2  # replay
    gpus[0].links[6].active = False
    gpus[2].unsupported |= {197, 198, "nvmlDeviceGetJpgUtilization"}
    gpus[2].pcie_throughput_tx_kbps = 100
    return FakeNvml(gpus)


def collect_with_xids(node: FakeNvml) -> nv.NvmlData:
    source = nv.NvmlSource(node, event_wait_ms=50)
    try:
        source.collect(NO_FILES)
        deadline = time.monotonic() + 2
        while node.registered_event_sets() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        node.inject_xid(4, 79)
        node.inject_xid(4, 79)
        node.inject_xid(1, 4242)  # a code without a catalogued meaning
        while time.monotonic() < deadline:
            data = source.collect(NO_FILES)
            if sum(x.count for x in data.xids) == 3:
                break
            time.sleep(0.01)
        node.gpus[7].lost = True
        return source.collect(NO_FILES)
    finally:
        source.close()


def test_gpu_families_from_a_fake_hgx_node(node: FakeNvml) -> None:
    s = samples(snapshot_of(collect_with_xids(node)))
    info = {labels for name, labels in s if name == "nodescope_gpu_info"}
    assert len(info) == 7  # GPU 7 was lost: its series end
    assert (
        ("gpu", "0"),
        ("name", "NVIDIA H100 80GB HBM3"),
        ("pci_address", "0000:19:00.0"),
        ("uuid", node.gpus[0].uuid),
    ) in info
    assert (
        value(
            s,
            "nodescope_gpu_lost_info",
            gpu="7",
            uuid=node.gpus[7].uuid,
            pci_address="0000:db:00.0",
        )
        == 1
    )
    assert not any(
        dict(labels).get("gpu") == "7" for name, labels in s if name != "nodescope_gpu_lost_info"
    )
    assert value(s, "nodescope_gpu_pcie_tx_bytes_total", gpu="0") == 5_000_000
    assert value(s, "nodescope_gpu_pcie_rx_bytes_total", gpu="0") == 7_000_000
    assert value(s, "nodescope_gpu_pcie_replays_total", gpu="0") == 3
    assert value(s, "nodescope_gpu_pcie_link_generation", gpu="0") == 5
    assert value(s, "nodescope_gpu_pcie_link_max_width_lanes", gpu="0") == 16
    # GPU 2 has only the 20 ms snapshot: no counter series, a labelled gauge instead.
    assert ("nodescope_gpu_pcie_tx_bytes_total", (("gpu", "2"),)) not in s
    assert value(s, "nodescope_gpu_pcie_snapshot_bytes_per_second", gpu="2", direction="tx") == (
        100 * 1024
    )
    assert value(s, "nodescope_gpu_utilization_ratio", gpu="0", engine="decoder") == 0.25
    assert value(s, "nodescope_gpu_utilization_ratio", gpu="0", engine="jpeg") == 0.5
    assert value(s, "nodescope_gpu_utilization_ratio", gpu="0", engine="gpu") == 1.0
    assert ("nodescope_gpu_utilization_ratio", (("engine", "jpeg"), ("gpu", "2"))) not in s
    assert value(s, "nodescope_gpu_compute_processes", gpu="0") == 2
    assert value(s, "nodescope_gpu_process_memory_used_bytes", gpu="0") == (1 << 30) + (1 << 29)
    assert value(s, "nodescope_gpu_nvlink_data_tx_bytes_total", gpu="0", link="5") == 3 * 1024
    # Bytes with protocol overhead are summed per GPU; the payload bytes stay per link.
    assert value(s, "nodescope_gpu_nvlink_raw_rx_bytes_total", gpu="0") == 4 * 1024
    assert not any(
        name.startswith("nodescope_gpu_nvlink_raw_") and "link" in dict(labels)
        for name, labels in s
    )
    assert value(s, "nodescope_gpu_nvlink_errors_total", gpu="0", link="5", counter="replay") == 2
    assert value(s, "nodescope_gpu_nvlink_up", gpu="0", link="6") == 0
    assert (
        value(
            s,
            "nodescope_gpu_nvlink_info",
            gpu="0",
            link="0",
            remote_type="switch",
            remote_pci_address="0000:83:00.0",
        )
        == 1
    )
    links = [labels for name, labels in s if name == "nodescope_gpu_nvlink_data_rx_bytes_total"]
    assert len(links) == 7 * 18
    assert value(s, "nodescope_gpu_xid_errors_total", gpu="4", xid="79") == 2
    assert value(s, "nodescope_gpu_xid_errors_total", gpu="1", xid="4242") == 1
    assert value(s, "nodescope_xid_info", xid="79", meaning="GPU has fallen off the bus") == 1
    assert not any(name == "nodescope_xid_info" and ("xid", "4242") in labels for name, labels in s)
    assert value(s, "nodescope_gpu_xid_source_info", source="nvml-events") == 1
    assert value(s, "nodescope_nvlink_data_source_info", source="nvml") == 1


def test_xid_counter_is_a_counter_and_names_follow_the_catalog() -> None:
    assert CATALOG["nodescope_gpu_xid_errors_total"].kind == "counter"
    assert CATALOG["nodescope_xid_info"].kind == "info"
    gpu_names = [name for name, spec in CATALOG.items() if spec.area == gpu_metrics.AREA]
    assert "nodescope_nvlink_data_source_info" in gpu_names and len(gpu_names) >= 20


def test_no_nvml_data_means_no_gpu_series() -> None:
    empty = Snapshot(cycle=1, monotonic=1.0, wall_time=0.0)
    assert list(gpu_metrics.families(empty)) == []
    failed = Snapshot(
        cycle=1,
        monotonic=1.0,
        wall_time=0.0,
        current={"nvml": SourceSample("nvml", 1.0, 0.0, None, "NvmlUnavailable: no driver")},
    )
    assert samples(failed) == {}


def test_gpu_without_nvlink_has_no_nvlink_source_series() -> None:
    gpus = hgx_h100(1, links=0)
    data = nv.NvmlSource(FakeNvml(gpus), watch_xids=False).collect(NO_FILES)
    s = samples(snapshot_of(data))
    assert not any(name == "nodescope_nvlink_data_source_info" for name, _ in s)
    assert value(s, "nodescope_gpu_compute_processes", gpu="0") == 0


def test_summed_nvlink_counters_wrap_as_one_part_would() -> None:
    width = 42  # a 32-bit KiB field, in bytes
    wrap = 1 << width

    def cv(value: int, bits: int | None = width) -> nv.CounterValue:
        return nv.CounterValue(value, None, bits)

    def summed(counters: list[nv.CounterValue | None]) -> int | None:
        return gpu_metrics._summed(nv.CounterColumn.of(counters))

    before = summed([cv(wrap - 10), cv(5), None])
    after = summed([cv(6), cv(5)])  # the first part wrapped after 16 bytes
    assert before == wrap - 5 and after == 11
    # rate() over a counter of that width sees 16 bytes, not a reset of the whole sum.
    assert before is not None and after is not None and (after - before) % wrap == 16
    assert summed([cv(wrap - 1, 74), cv(5, 42)]) == wrap + 4  # widths differ
    assert summed([cv(3, None), cv(4, None)]) == 7
    assert summed([None, None]) is None
