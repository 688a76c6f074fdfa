"""The NVLink graph: NV# per GPU pair (docs/datasources.md §9), switches reached, placement on
the PCIe tree; built from the NVML source reading the fake NVML."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pynvml
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nodescope.model.nvlink_graph import (
    BondedPair,
    NvLinkEdge,
    NvLinkGraph,
    SwitchReach,
    attach,
)
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.model.topology import DeviceClass, affinity
from nodescope.roots import Roots
from nodescope.sim.fake_nvml import (
    HGX_H100_GPU_BUSES,
    HGX_H100_NVSWITCH_BUSES,
    FakeGpu,
    FakeLink,
    FakeNvml,
    hgx_h100,
)
from nodescope.sim.sysfs_tree import cached_hgx_h100_tree
from nodescope.sources import nvml as nv
from nodescope.sources.pci import read_topology
from nodescope_exporters import gpu_metrics
from nodescope_exporters.prometheus import render

NO_FILES = Roots.under("/nonexistent-nodescope-root")
GPU = pynvml.NVML_NVLINK_DEVICE_TYPE_GPU

#: nvidia-smi topo -m of a DGX-1 with V100s (hybrid cube-mesh, 6 links per GPU): NV# per pair.
DGX1_MESH = (
    (0, 1, 1), (0, 2, 1), (0, 3, 2), (0, 4, 2),
    (1, 2, 2), (1, 3, 1), (1, 5, 2),
    (2, 3, 2), (2, 6, 1),
    (3, 7, 1),
    (4, 5, 1), (4, 6, 1), (4, 7, 2),
    (5, 6, 2), (5, 7, 1),
    (6, 7, 2),
)  # fmt: skip


def _graph(gpus: list[FakeGpu]) -> NvLinkGraph:
    source = nv.NvmlSource(FakeNvml(gpus), watch_xids=False)
    try:
        data = source.collect(NO_FILES)
    finally:
        source.close()
    return NvLinkGraph.from_gpus(data.gpus)


def _bus_id(bus: int) -> str:
    return f"00000000:{bus:02X}:00.0"


def dgx1() -> list[FakeGpu]:
    buses = (0x06, 0x07, 0x0A, 0x0B, 0x85, 0x86, 0x89, 0x8A)
    links: dict[int, list[FakeLink]] = {i: [] for i in range(8)}
    for a, b, n in DGX1_MESH:
        links[a] += [FakeLink(_bus_id(buses[b]), GPU) for _ in range(n)]
        links[b] += [FakeLink(_bus_id(buses[a]), GPU) for _ in range(n)]
    return [
        FakeGpu(f"GPU-{i}", "Tesla V100-SXM2-32GB", _bus_id(buses[i]), links=links[i])
        for i in range(8)
    ]


def test_hgx_h100_is_nv18_for_every_pair_through_four_switches() -> None:
    graph = _graph(hgx_h100())
    assert [g.pci_address for g in graph.gpus] == [f"0000:{b:02x}:00.0" for b in HGX_H100_GPU_BUSES]
    assert [s.pci_address for s in graph.switches] == [
        f"0000:{b:02x}:00.0" for b in HGX_H100_NVSWITCH_BUSES
    ]
    pairs = graph.bonded_pairs()
    assert len(pairs) == 28
    assert {(p.links, p.via) for p in pairs} == {(18, "nvswitch")}
    assert graph.bonded(7, 0) == BondedPair(0, 7, 18, "nvswitch")
    assert graph.bonded(3, 3) is None
    assert graph.switches_of(5) == (
        SwitchReach("0000:83:00.0", 5),
        SwitchReach("0000:84:00.0", 4),
        SwitchReach("0000:85:00.0", 4),
        SwitchReach("0000:86:00.0", 5),
    )
    counts = graph.counts_by_address()
    assert counts[frozenset(("0000:19:00.0", "0000:db:00.0"))] == 18
    assert len(counts) == 28


def test_direct_links_are_counted_per_peer_in_a_hybrid_cube_mesh() -> None:
    graph = _graph(dgx1())
    assert graph.switches == ()
    expected = {(a, b): BondedPair(a, b, n, "direct") for a, b, n in DGX1_MESH}
    assert {(p.gpu_a, p.gpu_b): p for p in graph.bonded_pairs()} == expected
    assert graph.bonded(0, 5) is None  # no NVLink: the matrix falls back to PCIe (SYS)
    assert graph.bonded(3, 0) == BondedPair(0, 3, 2, "direct")
    for gpu in range(8):
        assert sum(p.links for p in graph.bonded_pairs() if gpu in (p.gpu_a, p.gpu_b)) == 6
        assert graph.switches_of(gpu) == ()


def test_inactive_links_are_not_counted() -> None:
    gpus = hgx_h100()
    gpus[1].links[0].active = False
    gpus[1].links[7].active = False
    graph = _graph(gpus)
    assert graph.bonded(0, 1) == BondedPair(0, 1, 16, "nvswitch")
    assert graph.bonded(1, 6) == BondedPair(1, 6, 16, "nvswitch")
    assert graph.bonded(0, 6) == BondedPair(0, 6, 18, "nvswitch")
    # Links 0 (switch 0x83) and 7 (switch 0x84) of GPU 1 are down: one fewer to each.
    assert graph.switches_of(1) == (
        SwitchReach("0000:83:00.0", 4),
        SwitchReach("0000:84:00.0", 3),
        SwitchReach("0000:85:00.0", 4),
        SwitchReach("0000:86:00.0", 5),
    )
    mesh = dgx1()
    mesh[0].links[2].active = False  # one of GPU0's two links to GPU3
    graph = _graph(mesh)
    assert graph.bonded(0, 3) == BondedPair(0, 3, 1, "direct")
    assert graph.bonded(0, 4) == BondedPair(0, 4, 2, "direct")


def test_a_gpu_without_active_links_bonds_with_nothing() -> None:
    gpus = hgx_h100()
    for link in gpus[2].links:
        link.active = False
    graph = _graph(gpus)
    assert [g.index for g in graph.gpus] == list(range(8))
    assert graph.active_links(2) == ()
    assert all(2 not in (p.gpu_a, p.gpu_b) for p in graph.bonded_pairs())
    assert len(graph.bonded_pairs()) == 21


def test_a_lost_gpu_drops_out() -> None:
    gpus = dgx1()
    gpus[3].lost = True
    source = nv.NvmlSource(FakeNvml(gpus), watch_xids=False)
    data = source.collect(NO_FILES)
    source.close()
    assert [lost.gpu for lost in data.lost] == [3]
    graph = NvLinkGraph.from_gpus(data.gpus)
    assert [g.index for g in graph.gpus] == [0, 1, 2, 4, 5, 6, 7]
    # Its peers' links to it are still edges, but bond with nothing.
    assert any(e.remote_pci_address == "0000:0b:00.0" for e in graph.active_links(0))
    assert graph.bonded(0, 3) is None
    pairs = {(p.gpu_a, p.gpu_b) for p in graph.bonded_pairs()}
    assert pairs == {(a, b) for a, b, _ in DGX1_MESH if 3 not in (a, b)}


def test_a_gpu_lost_after_the_first_read_drops_out_of_the_next_graph() -> None:
    node = FakeNvml(hgx_h100())
    source = nv.NvmlSource(node, watch_xids=False)
    first = NvLinkGraph.from_gpus(source.collect(NO_FILES).gpus)
    node.gpus[6].lost = True
    second = NvLinkGraph.from_gpus(source.collect(NO_FILES).gpus)
    source.close()
    assert len(first.bonded_pairs()) == 28
    assert [g.index for g in second.gpus] == [0, 1, 2, 3, 4, 5, 7]
    assert len(second.bonded_pairs()) == 21
    assert second.bonded(0, 6) is None


def test_direct_links_count_the_end_that_sees_fewer() -> None:
    a, b = "00000000:07:00.0", "00000000:0F:00.0"
    gpus = [
        FakeGpu("GPU-a", "A100", a, links=[FakeLink(b, GPU) for _ in range(4)]),
        FakeGpu("GPU-b", "A100", b, links=[FakeLink(a, GPU) for _ in range(4)]),
    ]
    gpus[1].links[3].active = False
    assert _graph(gpus).bonded(0, 1) == BondedPair(0, 1, 3, "direct")


def test_unknown_remote_type_with_a_gpu_address_is_a_direct_link() -> None:
    # A driver without nvmlDeviceGetNvLinkRemoteDeviceType: NVML says NOT_SUPPORTED.
    gpus = dgx1()
    for gpu in gpus:
        gpu.unsupported.add("nvmlDeviceGetNvLinkRemoteDeviceType")
    graph = _graph(gpus)
    assert all(e.remote_type is None for e in graph.links)
    assert len(graph.bonded_pairs()) == len(DGX1_MESH)


def test_agrees_with_the_nvml_sources_nvlink_pairs() -> None:
    for gpus in (hgx_h100(), dgx1()):
        data = nv.NvmlSource(FakeNvml(gpus), watch_xids=False).collect(NO_FILES)
        graph = NvLinkGraph.from_gpus(data.gpus)
        assert [dataclasses.astuple(p) for p in graph.bonded_pairs()] == [
            dataclasses.astuple(p) for p in nv.nvlink_pairs(data.gpus)
        ]


def test_records_are_immutable_and_serialisable() -> None:
    graph = _graph(hgx_h100(gpus=2, links=2))
    assert json.loads(json.dumps(dataclasses.asdict(graph))) == {
        "gpus": [
            {"index": 0, "pci_address": "0000:19:00.0"},
            {"index": 1, "pci_address": "0000:3b:00.0"},
        ],
        "switches": [{"pci_address": "0000:83:00.0"}],
        "links": [
            {"gpu": g, "link": n, "remote_type": "switch",
             "remote_pci_address": "0000:83:00.0", "active": True}
            for g in (0, 1) for n in (0, 1)
        ],
    }  # fmt: skip
    with pytest.raises(dataclasses.FrozenInstanceError):
        graph.links[0].active = False  # type: ignore[misc]
    assert isinstance(graph.links[0], NvLinkEdge)


def test_upper_case_addresses_are_matched_to_sysfs_form() -> None:
    graph = NvLinkGraph.from_gpus([])
    assert graph.gpus == () and graph.bonded_pairs() == ()
    edge_a = NvLinkEdge(0, 0, "gpu", "0000:0F:00.0", True)
    edge_b = NvLinkEdge(1, 0, "gpu", "0000:07:00.0", True)

    @dataclasses.dataclass(frozen=True)
    class Links:
        link: tuple[int, ...]
        active: tuple[bool | None, ...]
        remote_type: tuple[str | None, ...]
        remote_pci_address: tuple[str | None, ...]

    @dataclasses.dataclass(frozen=True)
    class Gpu:
        index: int
        pci_address: str
        nvlinks: Links

    graph = NvLinkGraph.from_gpus(
        [
            Gpu(0, "0000:07:00.0", Links((0,), (True,), ("gpu",), (edge_a.remote_pci_address,))),
            Gpu(1, "0000:0F:00.0", Links((0,), (True,), ("gpu",), (edge_b.remote_pci_address,))),
        ]
    )
    assert graph.gpu_at("0000:0f:00.0") == graph.gpu(1)
    assert graph.bonded(0, 1) == BondedPair(0, 1, 1, "direct")


# --- on the PCIe tree -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def hgx_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cached_hgx_h100_tree(tmp_path_factory.getbasetemp() / "hgx-h100")


def test_attach_places_gpus_and_switches_on_the_pcie_tree(hgx_root: Path) -> None:
    topology = read_topology(Roots.under(hgx_root))
    placed = attach(_graph(hgx_h100()), topology)
    assert placed.unmatched == () and placed.gpus_without_nvlink_graph == ()
    kinds = [(n.kind, n.device is not None) for n in placed.nodes]
    assert kinds == [(DeviceClass.GPU, True)] * 8 + [(DeviceClass.NVSWITCH, True)] * 4
    gpu0 = placed.device_of_gpu(0)
    assert gpu0 is not None and gpu0.root_port == "0000:15:01.0"
    switch = next(n for n in placed.nodes if n.pci_address == "0000:84:00.0")
    assert switch.device is not None and switch.device.numa_node == 1
    counts = placed.counts_by_bdf()
    assert len(counts) == 28
    assert affinity(topology, "0000:19:00.0", "0000:db:00.0", counts) == "NV18"
    assert affinity(topology, "0000:19:00.0", "0000:18:00.0", counts) == "PIX"  # its NVMe


def test_attach_reports_what_the_two_views_disagree_on(hgx_root: Path) -> None:
    topology = read_topology(Roots.under(hgx_root))
    gpus = hgx_h100()
    gpus[0].pci_bus_id = "00000000:18:00.0"  # the NVMe drive's address, not a GPU
    gpus[5].lost = True
    placed = attach(_graph(gpus), topology)
    assert placed.unmatched == ("0000:18:00.0",)
    assert placed.gpus_without_nvlink_graph == ("0000:19:00.0", "0000:bb:00.0")
    assert placed.device_of_gpu(0) is None
    counts = placed.counts_by_bdf()
    # No NV# on a device that is not a GPU, none for the lost GPU: 6 GPUs, 15 pairs.
    assert len(counts) == 15
    assert all("0000:18:00.0" not in pair and "0000:bb:00.0" not in pair for pair in counts)


# --- exported ---------------------------------------------------------------------------------


def _bonded_series(gpus: list[FakeGpu]) -> dict[tuple[str, str], float]:
    source = nv.NvmlSource(FakeNvml(gpus), watch_xids=False)
    data = source.collect(NO_FILES)
    source.close()
    snapshot = Snapshot(
        cycle=1, monotonic=1.0, wall_time=0.0, current={"nvml": SourceSample("nvml", 1, 0, data)}
    )
    text = render(snapshot, [gpu_metrics.families]).decode()
    return {
        (s.labels["gpu"], s.labels["peer_gpu"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "nodescope_gpu_nvlink_bonded_links"
    }


def test_bonded_links_metric() -> None:
    gpus = hgx_h100()
    gpus[2].links[0].active = False
    series = _bonded_series(gpus)
    assert len(series) == 56
    assert series[("0", "7")] == 18 and series[("7", "0")] == 18
    assert series[("2", "5")] == 17 and series[("5", "2")] == 17
    mesh = dgx1()
    mesh[6].lost = True
    series = _bonded_series(mesh)
    assert len(series) == 7 * 6
    assert series[("0", "3")] == 2 and series[("3", "0")] == 2
    assert series[("0", "5")] == 0  # no NVLink between them: PCIe only
    assert all("6" not in key for key in series)


def test_no_bonded_links_series_without_nvlinks() -> None:
    plain = [FakeGpu(f"GPU-{i}", "L40S", _bus_id(0x10 + i)) for i in range(4)]
    assert _bonded_series(plain) == {}
