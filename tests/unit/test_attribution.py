"""Attribution of endpoint traffic to shared PCIe links: directions, shares, capacity at the
narrower end; on hand-made trees and on the simulated HGX H100 through the real sources."""

from __future__ import annotations

import dataclasses
import math
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.collect import Collector, ScheduledSource
from nodescope.model.attribution import (
    Direction,
    EndpointFlow,
    LinkKind,
    attribute,
)
from nodescope.model.snapshot import Snapshot
from nodescope.model.topology import (
    PCI,
    DeviceClass,
    LinkState,
    Topology,
    link_capacity_bytes_per_s,
)
from nodescope.model.traffic import endpoint_flows
from nodescope_exporters.fabric_metrics import TOP_CONTRIBUTORS, families
from tests.unit.fabric_helpers import (
    GPU_A,
    GPU_B,
    GPU_C,
    HCA,
    HCA_C,
    NVME,
    RP_ALONE,
    RP_REMOTE,
    RP_SHARED,
    topology,
)

GEN5_X16 = link_capacity_bytes_per_s(5, 16)


def flow(bdf: str, name: str, cls: DeviceClass, down: float, up: float) -> EndpointFlow:
    return EndpointFlow(bdf, name, cls, down, up, "test")


def test_demand_is_the_sum_below_the_link_per_direction() -> None:
    flows = [
        flow(GPU_A, "gpu0", DeviceClass.GPU, 30e9, 2e9),  # H2D 30, D2H 2
        flow(NVME, "nvme0n1", DeviceClass.NVME, 0.5e9, 6e9),  # writes 0.5, reads 6
        flow(HCA, "mlx5_0", DeviceClass.INFINIBAND, 4e9, 1e9),  # transmit 4, receive 1
        flow(GPU_B, "gpu1", DeviceClass.GPU, 7e9, 7e9),  # another root port
    ]
    a = attribute(topology(), flows)
    rp = a.link(RP_SHARED)
    assert rp is not None and rp.kind is LinkKind.ROOT_PORT and rp.shared
    assert rp.endpoints == (GPU_A, NVME, HCA)
    assert rp.downstream.demand_bytes_per_second == pytest.approx(34.5e9)
    assert rp.upstream.demand_bytes_per_second == pytest.approx(9e9)
    assert rp.downstream.utilisation == pytest.approx(34.5e9 / GEN5_X16)
    assert rp.upstream.utilisation == pytest.approx(9e9 / GEN5_X16)
    # Largest first, shares of the direction's demand.
    down = [(c.endpoint, round(c.share, 4)) for c in rp.downstream.contributions]
    assert down == [("gpu0", round(30 / 34.5, 4)), ("mlx5_0", round(4 / 34.5, 4)),
                    ("nvme0n1", round(0.5 / 34.5, 4))]  # fmt: skip
    up = {c.endpoint: c for c in rp.upstream.contributions}
    assert up["nvme0n1"].direction is Direction.UPSTREAM
    assert up["nvme0n1"].share == pytest.approx(6 / 9)
    assert rp.busier is rp.downstream
    assert rp.total_bytes_per_second == pytest.approx(43.5e9)


def test_own_links_are_not_shared_and_the_lonely_root_port_neither() -> None:
    a = attribute(topology(), [flow(GPU_A, "gpu0", DeviceClass.GPU, 1e9, 0.0)])
    assert {link.name for link in a.shared_links} == {RP_SHARED, RP_REMOTE, "pci0000:10"}
    gpu_port = a.link("0000:12:00.0")
    assert gpu_port is not None and gpu_port.kind is LinkKind.SWITCH_PORT
    assert not gpu_port.shared
    alone = a.link(RP_ALONE)
    assert alone is not None and not alone.shared
    assert [link.name for link in a.links_of(GPU_A)] == ["0000:12:00.0", RP_SHARED, "pci0000:10"]


def test_a_host_bridge_with_two_root_ports_sums_their_capacity() -> None:
    a = attribute(
        topology(),
        [
            flow(GPU_A, "gpu0", DeviceClass.GPU, 10e9, 0.0),
            flow(GPU_B, "gpu1", DeviceClass.GPU, 20e9, 0.0),
            flow(GPU_C, "gpu2", DeviceClass.GPU, 5e9, 0.0),
        ],
    )
    bridge = a.link("pci0000:10")
    assert bridge is not None and bridge.kind is LinkKind.HOST_BRIDGE and bridge.shared
    assert bridge.capacity_bytes_per_second == pytest.approx(2 * GEN5_X16)
    assert bridge.downstream.demand_bytes_per_second == pytest.approx(30e9)
    assert bridge.speed_gts is None
    # One root port under pci0000:80: its root port already says everything.
    assert a.link("pci0000:80") is None


@pytest.mark.parametrize(
    ("port", "below", "expected"),
    [
        # the root port trained at Gen4 x16, the switch below it still says Gen5 x16
        (LinkState(16.0, 16, 32.0, 16), LinkState(32.0, 16, 32.0, 16), (4, 16)),
        # the switch's upstream port reports x8: the narrower end is x8
        (LinkState(32.0, 16, 32.0, 16), LinkState(32.0, 8, 32.0, 16), (5, 8)),
        # Gen2 at one end (8b/10b) and x4 at the other
        (LinkState(5.0, 16, 32.0, 16), LinkState(32.0, 4, 32.0, 16), (2, 4)),
    ],
)
def test_capacity_is_taken_at_the_narrower_end(
    port: LinkState, below: LinkState, expected: tuple[int, int]
) -> None:
    topo = topology(links={RP_SHARED: port, "0000:11:00.0": below})
    a = attribute(topo, [flow(GPU_A, "gpu0", DeviceClass.GPU, 1e9, 1e9)])
    rp = a.link(RP_SHARED)
    assert rp is not None
    gen, width = expected
    assert rp.capacity_bytes_per_second == pytest.approx(link_capacity_bytes_per_s(gen, width))
    assert rp.max_capacity_bytes_per_second == pytest.approx(GEN5_X16)
    assert rp.width == width
    assert rp.downstream.utilisation == pytest.approx(1e9 / link_capacity_bytes_per_s(gen, width))


def test_endpoint_load_against_its_own_link() -> None:
    topo = topology(links={GPU_A: LinkState(16.0, 16, 32.0, 16)})
    a = attribute(topo, [flow(GPU_A, "gpu0", DeviceClass.GPU, 20e9, 18e9)])
    load = a.endpoint(GPU_A)
    assert load is not None and load.link is not None
    gen4 = link_capacity_bytes_per_s(4, 16)
    assert load.capacity_bytes_per_second == pytest.approx(gen4)
    assert load.utilisation(Direction.DOWNSTREAM) == pytest.approx(20e9 / gen4)
    assert load.bidirectional_utilisation == pytest.approx(38e9 / (2 * gen4))


def test_unknown_functions_are_dropped_and_idle_links_have_no_contributions() -> None:
    a = attribute(topology(), [flow("0000:ee:00.0", "gone", DeviceClass.GPU, 1e9, 1e9)])
    assert a.endpoints == ()
    rp = a.link(RP_SHARED)
    assert rp is not None and rp.flows == () and rp.downstream.contributions == ()
    assert rp.downstream.demand_bytes_per_second == 0.0
    assert rp.downstream.utilisation == 0.0


rates = st.floats(min_value=0.0, max_value=1e11, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(rates, rates), min_size=6, max_size=6))
def test_conservation_and_shares(values: list[tuple[float, float]]) -> None:
    bdfs = [
        (GPU_A, DeviceClass.GPU),
        (NVME, DeviceClass.NVME),
        (HCA, DeviceClass.INFINIBAND),
        (GPU_B, DeviceClass.GPU),
        (GPU_C, DeviceClass.GPU),
        (HCA_C, DeviceClass.INFINIBAND),
    ]
    flows = [
        flow(b, f"e{i}", c, down, up)
        for i, ((b, c), (down, up)) in enumerate(zip(bdfs, values, strict=True))
    ]
    a = attribute(topology(), flows)
    by_bdf = {f.bdf: f for f in flows}
    for link in a.links:
        for direction in Direction:
            load = link.load(direction)
            expected = sum(by_bdf[b].bytes_per_second(direction) for b in link.endpoints)
            # Traffic a GPU and an HCA below the link moved between each other (inferred where
            # the link could not carry it all) turned below it: out of both directions.
            expected -= sum(p.total_bytes_per_second for p in link.peer_to_peer)
            assert load.demand_bytes_per_second == pytest.approx(expected, abs=1e-3)
            if load.demand_bytes_per_second > 0:
                assert math.fsum(c.share for c in load.contributions) == pytest.approx(1.0)
                assert all(c.direction is direction for c in load.contributions)
            if link.capacity_bytes_per_second:
                assert load.utilisation == pytest.approx(
                    load.demand_bytes_per_second / link.capacity_bytes_per_second
                )
            amounts = [c.bytes_per_second for c in load.contributions]
            assert amounts == sorted(amounts, reverse=True)


# --- the simulated HGX H100 through the real sources -----------------------------------------


def _run(name: str, until: int) -> Iterator[Snapshot]:
    from nodescope.sim.driver import SimClock, temp_dir
    from nodescope.sim.node import SimulatedNode
    from nodescope.sim.scenario import load_scenario

    with tempfile.TemporaryDirectory(prefix="nodescope-test-", dir=temp_dir()) as d:
        node = SimulatedNode(load_scenario(name), Path(d) / "root")
        node.materialise()
        clock = SimClock()
        collector = Collector(
            roots=node.roots,
            scheduled=[ScheduledSource(s, 1.0) for s in node.sources()],
            clock=clock,
        )
        try:
            for t in range(until + 1):
                node.advance_to(float(t))
                clock.now = float(t)
                yield collector.run_cycle(force=True)
        finally:
            collector.close()


@pytest.fixture(scope="module")
def contention_snapshot() -> Snapshot:
    """root-port-contention at t=20: GPU 0 copies 41 GB/s host-to-device, nvme0n1 reads
    6.5 GB/s, mlx5_0 moves 2 GB/s each way, all below root port 0000:15:01.0."""
    *_, last = _run("root-port-contention", 20)
    return last


def test_simulated_directions_through_the_real_sources(contention_snapshot: Snapshot) -> None:
    flows = {
        f.name: f
        for f in endpoint_flows(
            contention_snapshot.derived.traffic, contention_snapshot.latest(PCI)
        )
    }
    gpu, nvme, hca = flows["gpu0"], flows["nvme0n1"], flows["mlx5_0"]
    # NVML RX ("to this GPU") is downstream, TX upstream.
    assert gpu.downstream_bytes_per_second == pytest.approx(41e9, rel=1e-3)
    assert gpu.upstream_bytes_per_second == pytest.approx(0.25e9, rel=1e-3)
    assert gpu.measured_by == "nvml" and gpu.bdf == "0000:19:00.0"
    # A disk read is a DMA write into host memory: upstream.
    assert nvme.upstream_bytes_per_second == pytest.approx(6.5e9, rel=1e-3)
    assert nvme.downstream_bytes_per_second == 0.0
    assert nvme.bdf == "0000:18:00.0" and nvme.device_class is DeviceClass.NVME
    # A NIC's transmit reads host memory: downstream.
    assert hca.downstream_bytes_per_second == pytest.approx(2e9, rel=1e-3)
    assert hca.device_class is DeviceClass.INFINIBAND


def test_simulated_root_port_load(contention_snapshot: Snapshot) -> None:
    a = contention_snapshot.derived.attribution
    assert a is not None
    rp = a.link("0000:15:01.0")
    assert rp is not None and rp.shared and rp.numa_node == 0
    assert rp.capacity_bytes_per_second == pytest.approx(GEN5_X16)
    down = {c.endpoint: c.bytes_per_second for c in rp.downstream.contributions}
    up = {c.endpoint: c.bytes_per_second for c in rp.upstream.contributions}
    assert down["gpu0"] == pytest.approx(41e9, rel=1e-3)
    assert "nvme0n1" not in down
    assert up["nvme0n1"] == pytest.approx(6.5e9, rel=1e-3)
    assert rp.downstream.utilisation == pytest.approx(sum(down.values()) / GEN5_X16, rel=1e-9)
    # GPU 1's root port is not affected.
    other = a.link("0000:37:01.0")
    assert other is not None and (other.downstream.utilisation or 0.0) < 0.2


def test_exported_series_only_for_shared_links_and_bounded(contention_snapshot: Snapshot) -> None:
    a = contention_snapshot.derived.attribution
    assert a is not None
    shared = {link.name for link in a.shared_links}
    got = {f.name: f for f in families(contention_snapshot)}
    util = got["nodescope_pcie_link_utilization_ratio"].samples
    assert {s.labels["link"] for s in util} <= shared
    assert {s.labels["direction"] for s in util} == {"downstream", "upstream"}
    rp = [s.value for s in util if s.labels == {"link": "0000:15:01.0", "direction": "downstream"}]
    assert rp and 0.68 < rp[0] < 0.70
    endpoint = got["nodescope_pcie_link_endpoint_bytes_per_second"].samples
    per_key: dict[tuple[str, str], int] = {}
    for s in endpoint:
        key = (s.labels["link"], s.labels["direction"])
        per_key[key] = per_key.get(key, 0) + 1
    assert max(per_key.values()) <= TOP_CONTRIBUTORS
    nvme = [
        s
        for s in endpoint
        if s.labels["endpoint"] == "nvme0n1" and s.labels["link"] == "0000:15:01.0"
    ]
    assert [(s.labels["direction"], s.labels["class"]) for s in nvme] == [("upstream", "nvme")]
    capacity = got["nodescope_pcie_shared_link_capacity_bytes_per_second"].samples
    assert {s.labels["link"] for s in capacity} == shared


# --- peer to peer below a switch ------------------------------------------------------------


def _with(
    modules: frozenset[str] = frozenset(), redirect: dict[str, bool | None] | None = None
) -> Topology:
    """The hand-made tree with ``modules`` loaded and the ACS redirect bit of some ports."""
    base = topology()
    acs = redirect or {}
    devices = tuple(
        dataclasses.replace(d, acs_redirect=acs[d.bdf]) if d.bdf in acs else d for d in base.devices
    )
    return dataclasses.replace(base, devices=devices, peer_modules=modules)


# GPUDirect RDMA at line rate: the HCA transmits what the GPU sends up and receives what it
# takes down, 46 GB/s each way, beside 3 GB/s of host-to-device copies and an NVMe read.
GDR_FLOWS = [
    flow(GPU_A, "gpu0", DeviceClass.GPU, 49e9, 46e9),
    flow(HCA, "mlx5_0", DeviceClass.INFINIBAND, 46e9, 46e9),
    flow(NVME, "nvme0n1", DeviceClass.NVME, 0.0, 2e9),
]
SWITCH_UP, GPU_PORT, HCA_PORT = "0000:11:00.0", "0000:12:00.0", "0000:12:02.0"


def test_gpudirect_rdma_turns_in_the_switch_and_never_reaches_the_root_port() -> None:
    a = attribute(_with(frozenset({"nvidia_peermem"})), GDR_FLOWS)
    (moved,) = a.peer_flows
    assert (moved.gpu, moved.peer, moved.turn) == (GPU_A, HCA, SWITCH_UP)
    assert moved.to_gpu_bytes_per_second == pytest.approx(46e9)
    assert moved.from_gpu_bytes_per_second == pytest.approx(46e9)
    assert moved.basis == "nvidia_peermem loaded, ACS not read"
    rp = a.link(RP_SHARED)
    assert rp is not None and rp.peer_to_peer == (moved,)
    # What is left at the root port: the GPU's 3 GB/s from host memory, the drive's read.
    assert rp.downstream.demand_bytes_per_second == pytest.approx(3e9)
    assert rp.upstream.demand_bytes_per_second == pytest.approx(2e9)
    bridge = a.link("pci0000:10")
    assert bridge is not None and bridge.downstream.demand_bytes_per_second == pytest.approx(3e9)
    # Below the switch each function's own link carries all it moved.
    gpu_link, hca_link = a.link(GPU_PORT), a.link(HCA_PORT)
    assert gpu_link is not None and gpu_link.downstream.demand_bytes_per_second == 49e9
    assert hca_link is not None and hca_link.upstream.demand_bytes_per_second == 46e9
    assert gpu_link.peer_to_peer == ()
    endpoint = a.endpoint(GPU_A)
    assert endpoint is not None and endpoint.flow.downstream_bytes_per_second == 49e9


def test_without_the_module_the_bytes_go_up_unless_the_root_port_could_not_carry_them() -> None:
    # 20 GB/s each way: the root port can carry it, so without nvidia_peermem it is taken to
    # go to host memory (as traffic through DMA-BUF cannot be told from it).
    light = [flow(GPU_A, "gpu0", DeviceClass.GPU, 20e9, 20e9),
             flow(HCA, "mlx5_0", DeviceClass.INFINIBAND, 20e9, 20e9)]  # fmt: skip
    for topo in (_with(), _with(frozenset({"nvidia_fs"}))):
        a = attribute(topo, light)
        assert a.peer_flows == ()
        rp = a.link(RP_SHARED)
        assert rp is not None and rp.downstream.demand_bytes_per_second == pytest.approx(40e9)
    # At line rate the root port would carry 95 GB/s of a 63 GB/s link: what the GPU and the
    # HCA could have moved between each other is taken to have turned in the switch.
    a = attribute(_with(), GDR_FLOWS)
    (moved,) = a.peer_flows
    assert moved.basis.startswith("no GPUDirect module loaded, inferred")
    rp = a.link(RP_SHARED)
    assert rp is not None and rp.downstream.demand_bytes_per_second == pytest.approx(3e9)


def test_acs_redirect_keeps_peer_traffic_on_the_root_port() -> None:
    for modules in (frozenset(), frozenset({"nvidia_peermem"})):
        a = attribute(_with(modules, {HCA_PORT: True}), GDR_FLOWS)
        assert a.peer_flows == ()
        rp = a.link(RP_SHARED)
        assert rp is not None and rp.downstream.demand_bytes_per_second == pytest.approx(95e9)


def test_acs_redirects_name_the_pairs_and_the_redirecting_ports() -> None:
    from nodescope.model.attribution import AcsRedirect, acs_redirects

    on = _with(frozenset({"nvidia_peermem"}), {HCA_PORT: True})
    assert acs_redirects(on, [GPU_A, HCA, NVME]) == (
        AcsRedirect(GPU_A, HCA, SWITCH_UP, (HCA_PORT,)),
    )
    # Read and clear, or not read: nothing redirects.
    off = _with(frozenset({"nvidia_peermem"}), {GPU_PORT: False, HCA_PORT: False})
    assert acs_redirects(off, [GPU_A, HCA, NVME]) == ()
    assert acs_redirects(topology(), [GPU_A, HCA]) == ()
    # Pairs without a GPU, or not below one switch, are none of its business.
    assert acs_redirects(_with(redirect={HCA_PORT: True}), [NVME, HCA]) == ()
    assert acs_redirects(_with(redirect={HCA_PORT: True}), [GPU_B, HCA]) == ()


def test_contention_caused_by_acs_redirect_says_so() -> None:
    from nodescope.detectors import contention

    redirected = _with(frozenset({"nvidia_peermem"}), {HCA_PORT: True})
    # 30 GB/s each way between the GPU and the HCA: redirected, 95 % of the root port.
    flows = [
        flow(GPU_A, "gpu0", DeviceClass.GPU, 30e9, 30e9),
        flow(HCA, "mlx5_0", DeviceClass.INFINIBAND, 30e9, 30e9),
    ]
    links = attribute(redirected, flows).shared_links
    [finding] = [
        f for f in contention.evaluate(links, 0.6, 0.1, topology=redirected)
        if f.subjects["link"] == RP_SHARED
    ]  # fmt: skip
    assert finding.evidence["acs_redirect"] == 1.0
    assert f"ACS P2P Request Redirect is on at switch port {HCA_PORT}" in finding.message
    assert f"gpu0↔mlx5_0 below switch port {SWITCH_UP}" in finding.message
    # The same load without the topology (or without redirect) does not claim it.
    [plain] = [
        f for f in contention.evaluate(links, 0.6, 0.1) if f.subjects["link"] == RP_SHARED
    ]  # fmt: skip
    assert "ACS" not in plain.message and "acs_redirect" not in plain.evidence


def test_acs_read_and_clear_is_said_in_the_basis() -> None:
    ports = {GPU_PORT: False, HCA_PORT: False}
    a = attribute(_with(frozenset({"nv_peer_mem"}), ports), GDR_FLOWS)
    assert [p.basis for p in a.peer_flows] == ["nv_peer_mem loaded, ACS does not redirect"]


def test_gpudirect_storage_needs_nvidia_fs() -> None:
    flows = [
        flow(GPU_A, "gpu0", DeviceClass.GPU, 6e9, 0.0),
        flow(NVME, "nvme0n1", DeviceClass.NVME, 0.0, 6e9),  # reads straight into the GPU
    ]
    assert attribute(_with(frozenset({"nvidia_peermem"})), flows).peer_flows == ()
    a = attribute(_with(frozenset({"nvidia_fs"})), flows)
    assert [(p.kind.value, p.peer, p.to_gpu_bytes_per_second) for p in a.peer_flows] == [
        ("gpudirect_storage", NVME, 6e9)
    ]
    rp = a.link(RP_SHARED)
    assert rp is not None and rp.total_bytes_per_second == pytest.approx(0.0)


def test_a_gpu_and_a_nic_on_different_root_ports_stay_on_both() -> None:
    # GPU_B sits alone on its root port: its path and the HCA's meet at the host bridge only.
    flows = [
        flow(GPU_B, "gpu1", DeviceClass.GPU, 10e9, 10e9),
        flow(HCA, "mlx5_0", DeviceClass.INFINIBAND, 10e9, 10e9),
    ]
    a = attribute(_with(frozenset({"nvidia_peermem"})), flows)
    assert a.peer_flows == ()
    rp = a.link(RP_SHARED)
    assert rp is not None and rp.downstream.demand_bytes_per_second == 10e9


@settings(max_examples=300, deadline=None)
@given(
    amounts=st.lists(st.floats(0, 80e9, allow_nan=False), min_size=6, max_size=6),
    modules=st.sets(st.sampled_from(["nvidia_peermem", "nvidia_fs", "nv_peer_mem"])),
)
def test_placement_never_adds_bytes_and_each_byte_is_given_out_once(
    amounts: list[float], modules: set[str]
) -> None:
    gd, gu, hd, hu, nd, nu = amounts
    flows = [
        flow(GPU_A, "gpu0", DeviceClass.GPU, gd, gu),
        flow(HCA, "mlx5_0", DeviceClass.INFINIBAND, hd, hu),
        flow(NVME, "nvme0n1", DeviceClass.NVME, nd, nu),
    ]
    a = attribute(_with(frozenset(modules)), flows)
    to_gpu = sum(p.to_gpu_bytes_per_second for p in a.peer_flows)
    from_gpu = sum(p.from_gpu_bytes_per_second for p in a.peer_flows)
    assert to_gpu <= gd + 1 and from_gpu <= gu + 1
    rp = a.link(RP_SHARED)
    assert rp is not None
    # The root port carries what was moved less what turned below it, never less than zero.
    assert rp.downstream.demand_bytes_per_second == pytest.approx(
        gd + hd + nd - to_gpu - from_gpu, abs=1
    )
    assert rp.upstream.demand_bytes_per_second == pytest.approx(
        gu + hu + nu - to_gpu - from_gpu, abs=1
    )
    assert min(rp.downstream.demand_bytes_per_second, rp.upstream.demand_bytes_per_second) >= 0


def test_a_gpu_whose_job_turned_gdr_off_moves_its_nic_traffic_through_host_memory() -> None:
    loaded = _with(frozenset({"nvidia_peermem", "nvidia_fs"}))
    a = attribute(loaded, GDR_FLOWS, host_staged=frozenset({GPU_A}))
    # No GPUDirect RDMA for GPU A; its storage traffic (nvidia_fs) may still turn.
    assert [p.kind.value for p in a.peer_flows] == ["gpudirect_storage"]
    rp = a.link(RP_SHARED)
    assert rp is not None and rp.upstream.demand_bytes_per_second == pytest.approx(92e9)
    # Nor is any inferred: the job said so.
    assert attribute(_with(), GDR_FLOWS, host_staged=frozenset({GPU_A})).peer_flows == ()
