"""The topology model: classes, link capacities, paths to the root, topo -m relations."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope import jsonout
from nodescope.model.topology import (
    DeviceClass,
    LinkState,
    PciDevice,
    PciRoot,
    PortRole,
    Relation,
    Topology,
    affinity,
    bottleneck,
    classify,
    format_cpulist,
    generation_of,
    link_capacity_bytes_per_s,
    path_to_root,
    relation,
    switch_of,
    upstream_links,
)
from nodescope.roots import Roots
from nodescope.sim.sysfs_tree import cached_hgx_h100_tree
from nodescope.sources.pci import read_topology

# --- capacities -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("generation", "x16_gb"),
    [(1, 4.0), (2, 8.0), (3, 15.754), (4, 31.508), (5, 63.015), (6, 118.0)],
)
def test_x16_capacity_per_generation(generation: int, x16_gb: float) -> None:
    assert link_capacity_bytes_per_s(generation, 16) / 1e9 == pytest.approx(x16_gb, abs=0.01)


def test_int_is_a_generation_and_float_a_rate() -> None:
    assert link_capacity_bytes_per_s(5, 16) == pytest.approx(63.015e9, rel=1e-4)
    assert link_capacity_bytes_per_s(5.0, 16) == pytest.approx(8.0e9)
    assert link_capacity_bytes_per_s(32.0, 16) == link_capacity_bytes_per_s(5, 16)
    assert link_capacity_bytes_per_s(8.0, 1) == pytest.approx(8e9 * 128 / 130 / 8)
    assert link_capacity_bytes_per_s(16.0, 0) == 0.0


def test_capacity_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        link_capacity_bytes_per_s(7, 16)
    with pytest.raises(ValueError):
        link_capacity_bytes_per_s(4, -1)


def test_generation_of_rates() -> None:
    assert [generation_of(r) for r in (2.5, 5.0, 8.0, 16.0, 32.0, 64.0)] == [1, 2, 3, 4, 5, 6]
    assert generation_of(20.0) is None


def test_link_state_capacities_and_downtraining() -> None:
    idle_gpu = LinkState(2.5, 16, 32.0, 16)
    assert idle_gpu.downtrained
    assert idle_gpu.current_generation == 1 and idle_gpu.max_generation == 5
    assert idle_gpu.current_capacity_bytes_per_s == pytest.approx(4e9)
    assert LinkState(32.0, 16, 32.0, 16).downtrained is False
    assert LinkState(32.0, 8, 32.0, 16).downtrained is True
    assert LinkState(None, None, 32.0, 16).current_capacity_bytes_per_s is None


# --- classes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("class_code", "vendor", "expected"),
    [
        (0x030200, 0x10DE, DeviceClass.GPU),  # H100: 3D controller
        (0x030000, 0x10DE, DeviceClass.GPU),  # VGA-class NVIDIA board
        (0x030000, 0x102B, DeviceClass.OTHER),  # Matrox BMC graphics is no GPU
        (0x038000, 0x1002, DeviceClass.GPU),  # AMD Instinct: display controller
        (0x010802, 0x8086, DeviceClass.NVME),
        (0x010601, 0x8086, DeviceClass.OTHER),  # AHCI
        (0x020000, 0x15B3, DeviceClass.ETHERNET),
        (0x020700, 0x15B3, DeviceClass.INFINIBAND),
        (0x068000, 0x10DE, DeviceClass.NVSWITCH),
        (0x068000, 0x8086, DeviceClass.BRIDGE),
        (0x060400, 0x1000, DeviceClass.BRIDGE),
        (0x060000, 0x8086, DeviceClass.BRIDGE),
        (0x088000, 0x8086, DeviceClass.OTHER),
    ],
)
def test_classify(class_code: int, vendor: int, expected: DeviceClass) -> None:
    assert classify(class_code, vendor) is expected


def test_format_cpulist() -> None:
    assert format_cpulist([3, 0, 1, 2, 8, 10, 11]) == "0-3,8,10-11"
    assert format_cpulist([]) == ""


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(min_value=0, max_value=512)))
def test_format_cpulist_round_trips(cpus: set[int]) -> None:
    from nodescope.sources.pci import parse_cpulist

    assert set(parse_cpulist(format_cpulist(cpus))) == cpus


# --- a hand-built tree ------------------------------------------------------------------------
#
# pci0000:00 (NUMA 0)
#   00:01.0 RP -> 01:00.0 USP -> 02:00.0 DSP -> 03:00.0 GPU
#                             -> 02:01.0 DSP -> 04:00.0 USP -> 05:00.0 DSP -> 06:00.0 NIC
#                             -> 02:02.0 DSP -> 07:00.0, 07:00.1 (one dual-port NIC)
#   00:02.0 RP -> 08:00.0 NVMe
# pci0000:40 (NUMA 0)  40:01.0 RP -> 41:00.0 GPU
# pci0000:80 (NUMA 1)  80:01.0 RP -> 81:00.0 GPU

G5 = LinkState(32.0, 16, 32.0, 16)


def _dev(
    chain: tuple[str, ...],
    root: str,
    cls: DeviceClass,
    role: PortRole,
    numa: int | None,
    link: LinkState | None = G5,
) -> PciDevice:
    class_code = {
        DeviceClass.GPU: 0x030200,
        DeviceClass.ETHERNET: 0x020000,
        DeviceClass.NVME: 0x010802,
        DeviceClass.BRIDGE: 0x060400,
    }[cls]
    return PciDevice(
        bdf=chain[-1],
        root=root,
        chain=chain,
        vendor_id=0x10DE,
        device_id=0x2330,
        class_code=class_code,
        device_class=cls,
        role=role,
        numa_node=numa,
        local_cpus=(0, 1),
        link=link,
    )


B, RP, USP, DSP, EP = (
    DeviceClass.BRIDGE,
    PortRole.ROOT_PORT,
    PortRole.UPSTREAM_PORT,
    PortRole.DOWNSTREAM_PORT,
    PortRole.ENDPOINT,
)


def _hand_topology() -> Topology:
    r0 = ("0000:00:01.0",)
    usp = (*r0, "0000:01:00.0")
    devices = [
        _dev(r0, "pci0000:00", B, RP, 0, LinkState(16.0, 16, 32.0, 16)),
        _dev(usp, "pci0000:00", B, USP, 0),
        _dev((*usp, "0000:02:00.0"), "pci0000:00", B, DSP, 0),
        _dev((*usp, "0000:02:00.0", "0000:03:00.0"), "pci0000:00", DeviceClass.GPU, EP, 0,
             LinkState(32.0, 8, 32.0, 16)),
        _dev((*usp, "0000:02:01.0"), "pci0000:00", B, DSP, 0),
        _dev((*usp, "0000:02:01.0", "0000:04:00.0"), "pci0000:00", B, USP, 0),
        _dev((*usp, "0000:02:01.0", "0000:04:00.0", "0000:05:00.0"), "pci0000:00", B, DSP, 0),
        _dev((*usp, "0000:02:01.0", "0000:04:00.0", "0000:05:00.0", "0000:06:00.0"),
             "pci0000:00", DeviceClass.ETHERNET, EP, 0),
        _dev((*usp, "0000:02:02.0"), "pci0000:00", B, DSP, 0),
        _dev((*usp, "0000:02:02.0", "0000:07:00.0"), "pci0000:00", DeviceClass.ETHERNET, EP, 0),
        _dev((*usp, "0000:02:02.0", "0000:07:00.1"), "pci0000:00", DeviceClass.ETHERNET, EP, 0),
        _dev(("0000:00:02.0",), "pci0000:00", B, RP, 0),
        _dev(("0000:00:02.0", "0000:08:00.0"), "pci0000:00", DeviceClass.NVME, EP, 0,
             LinkState(16.0, 4, 16.0, 4)),
        _dev(("0000:40:01.0",), "pci0000:40", B, RP, 0),
        _dev(("0000:40:01.0", "0000:41:00.0"), "pci0000:40", DeviceClass.GPU, EP, 0),
        _dev(("0000:80:01.0",), "pci0000:80", B, RP, 1),
        _dev(("0000:80:01.0", "0000:81:00.0"), "pci0000:80", DeviceClass.GPU, EP, 1),
    ]  # fmt: skip
    roots = (
        PciRoot("pci0000:00", 0, 0x00, ("0000:00:01.0", "0000:00:02.0")),
        PciRoot("pci0000:40", 0, 0x40, ("0000:40:01.0",)),
        PciRoot("pci0000:80", 0, 0x80, ("0000:80:01.0",)),
    )
    return Topology(tuple(sorted(devices, key=lambda d: d.bdf)), roots)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("0000:03:00.0", "0000:03:00.0", Relation.X),
        ("0000:03:00.0", "0000:07:00.0", Relation.PIX),  # one switch between them
        ("0000:07:00.0", "0000:07:00.1", Relation.PIX),  # two functions of one NIC
        ("0000:03:00.0", "0000:06:00.0", Relation.PXB),  # through the cascaded switch
        ("0000:06:00.0", "0000:07:00.1", Relation.PXB),
        ("0000:03:00.0", "0000:08:00.0", Relation.PHB),  # other root port, same host bridge
        ("0000:03:00.0", "0000:41:00.0", Relation.NODE),  # other host bridge, same NUMA node
        ("0000:03:00.0", "0000:81:00.0", Relation.SYS),  # other socket
        ("0000:41:00.0", "0000:81:00.0", Relation.SYS),
    ],
)
def test_relations(a: str, b: str, expected: Relation) -> None:
    topo = _hand_topology()
    assert relation(topo, a, b) is expected
    assert relation(topo, b, a) is expected


def test_affinity_uses_nvlink_counts_when_given() -> None:
    topo = _hand_topology()
    nvlinks = {frozenset(("0000:03:00.0", "0000:41:00.0")): 18}
    assert affinity(topo, "0000:03:00.0", "0000:41:00.0", nvlinks) == "NV18"
    assert affinity(topo, "0000:41:00.0", "0000:03:00.0", nvlinks) == "NV18"
    assert affinity(topo, "0000:03:00.0", "0000:81:00.0", nvlinks) == "SYS"
    assert affinity(topo, "0000:03:00.0", "0000:03:00.0", nvlinks) == "X"
    assert affinity(topo, "0000:03:00.0", "0000:41:00.0") == "NODE"


def test_switch_of_names_the_upstream_port() -> None:
    topo = _hand_topology()
    assert switch_of(topo, "0000:02:01.0") == "0000:01:00.0"
    assert switch_of(topo, "0000:05:00.0") == "0000:04:00.0"
    assert switch_of(topo, "0000:00:01.0") == "0000:00:01.0"
    assert switch_of(topo, "0000:03:00.0") is None


def test_path_and_upstream_links_take_the_narrower_end() -> None:
    topo = _hand_topology()
    path = [d.bdf for d in path_to_root(topo, "0000:03:00.0")]
    assert path == ["0000:03:00.0", "0000:02:00.0", "0000:01:00.0", "0000:00:01.0"]
    links = upstream_links(topo, "0000:03:00.0")
    # GPU-DSP and USP-RP; the switch-internal USP-DSP hop is no link.
    assert [(x.downstream, x.upstream) for x in links] == [
        ("0000:03:00.0", "0000:02:00.0"),
        ("0000:01:00.0", "0000:00:01.0"),
    ]
    gpu_link, rp_link = links
    assert gpu_link.current_width == 8 and gpu_link.max_width == 16
    assert gpu_link.capacity_bytes_per_s == pytest.approx(link_capacity_bytes_per_s(5, 8))
    assert rp_link.current_speed_gts == 16.0 and rp_link.max_speed_gts == 32.0
    assert rp_link.capacity_bytes_per_s == pytest.approx(link_capacity_bytes_per_s(4, 16))
    worst = bottleneck(links)
    assert worst is not None and worst.downstream == "0000:03:00.0"
    assert upstream_links(topo, "0000:00:01.0") == ()
    assert bottleneck(()) is None


def test_lookup_and_subtree() -> None:
    topo = _hand_topology()
    assert topo.device("0000:08:00.0").device_class is DeviceClass.NVME
    assert topo.get("0000:ff:00.0") is None
    with pytest.raises(KeyError):
        topo.device("0000:ff:00.0")
    below = {d.bdf for d in topo.below("0000:02:01.0")}
    assert below == {"0000:04:00.0", "0000:05:00.0", "0000:06:00.0"}
    assert topo.device("0000:03:00.0").parent == "0000:02:00.0"
    assert topo.device("0000:03:00.0").root_port == "0000:00:01.0"


def test_record_serialises_to_json() -> None:
    # The project's JSON writer: dataclasses.asdict cannot copy the read-only mappings of
    # the record's ``skipped`` field.
    text = json.dumps(jsonout.plain(_hand_topology()))
    assert '"device_class": "gpu"' in text and '"role": "downstream_port"' in text


# --- the HGX H100 from its capture ------------------------------------------------------------


@pytest.fixture(scope="module")
def hgx(tmp_path_factory: pytest.TempPathFactory) -> Topology:
    root = cached_hgx_h100_tree(tmp_path_factory.getbasetemp() / "hgx-h100")
    return read_topology(Roots.under(root))


GPUS = ["19", "3b", "4c", "5d", "9b", "bb", "cb", "db"]


def test_hgx_has_eight_h100_each_behind_its_own_switch_and_root_port(hgx: Topology) -> None:
    gpus = hgx.of_class(DeviceClass.GPU)
    assert [g.bdf[5:7] for g in gpus] == GPUS
    assert {(g.vendor_id, g.device_id) for g in gpus} == {(0x10DE, 0x2330)}
    assert len({g.root_port for g in gpus}) == 8
    assert len({g.root for g in gpus}) == 8  # Sapphire Rapids: a host bridge per root port
    gpu0 = hgx.device("0000:19:00.0")
    assert gpu0.chain == ("0000:15:01.0", "0000:16:00.0", "0000:17:01.0", "0000:19:00.0")
    assert [hgx.device(b).role for b in gpu0.chain] == [RP, USP, DSP, EP]
    assert switch_of(hgx, "0000:17:01.0") == "0000:16:00.0"


def test_hgx_switch_sharing(hgx: Topology) -> None:
    # Below root port 15:01.0 / switch 16:00.0: NVMe 18, GPU 19, ConnectX-7 1a and a
    # dual-port ConnectX-6 Dx 1b; the same pattern with one NIC on the other root ports.
    under = {d.bdf for d in hgx.below("0000:16:00.0") if d.role is EP}
    assert under == {
        "0000:18:00.0", "0000:19:00.0", "0000:1a:00.0", "0000:1b:00.0", "0000:1b:00.1",
        "0000:1c:00.0",
    }  # fmt: skip
    assert relation(hgx, "0000:19:00.0", "0000:1a:00.0") is Relation.PIX
    assert relation(hgx, "0000:19:00.0", "0000:18:00.0") is Relation.PIX
    assert relation(hgx, "0000:19:00.0", "0000:3b:00.0") is Relation.NODE
    assert relation(hgx, "0000:19:00.0", "0000:9b:00.0") is Relation.SYS
    nvme = hgx.device("0000:18:00.0")
    assert nvme.nvme_controllers == ("nvme0",)
    nic = hgx.device("0000:1a:00.0")
    assert nic.ib_devices == ("mlx5_0",) and nic.net_interfaces == ("enp26s0np0",)


def test_hgx_two_numa_nodes(hgx: Topology) -> None:
    assert [n.node for n in hgx.numa_nodes] == [0, 1]
    assert [len(n.cpus) for n in hgx.numa_nodes] == [112, 112]
    numa = {g.bdf[5:7]: g.numa_node for g in hgx.of_class(DeviceClass.GPU)}
    assert numa == {"19": 0, "3b": 0, "4c": 0, "5d": 0, "9b": 1, "bb": 1, "cb": 1, "db": 1}
    assert hgx.device("0000:9b:00.0").local_cpus == hgx.numa_nodes[1].cpus
    nvswitches = hgx.of_class(DeviceClass.NVSWITCH)
    assert [s.bdf[5:7] for s in nvswitches] == ["83", "84", "85", "86"]
    assert {s.numa_node for s in nvswitches} == {1}


def test_hgx_gen5_x16_capacity(hgx: Topology) -> None:
    for gpu in hgx.of_class(DeviceClass.GPU):
        links = upstream_links(hgx, gpu.bdf)
        assert len(links) == 2
        for link in links:
            assert (link.current_speed_gts, link.current_width) == (32.0, 16)
            assert link.capacity_bytes_per_s is not None
            assert link.capacity_bytes_per_s / 1e9 == pytest.approx(63.0, abs=0.05)
    # The Gen4 x4 NVMe drive behind a Gen5-capable downstream port: the port reports itself
    # downgraded, yet the link runs at the narrower end's best.
    dsp = hgx.device("0000:17:00.0")
    assert dsp.link is not None and dsp.link.downtrained
    (nvme_link, _) = upstream_links(hgx, "0000:18:00.0")
    assert (nvme_link.current_speed_gts, nvme_link.current_width) == (16.0, 4)
    assert (nvme_link.max_speed_gts, nvme_link.max_width) == (16.0, 4)
    assert nvme_link.capacity_bytes_per_s is not None
    assert math.isclose(nvme_link.capacity_bytes_per_s, 16e9 * 128 / 130 / 8 * 4)
