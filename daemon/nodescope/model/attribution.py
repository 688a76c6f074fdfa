"""Attribution: which endpoints put how many bytes through which shared PCIe link.

Input: the topology (:mod:`nodescope.model.topology`, built from ``/sys/bus/pci/devices``,
``docs/datasources.md`` §2) and one :class:`EndpointFlow` per PCI function that moved data,
as the sources measured it (NVML, diskstats, InfiniBand/netdev; gathered from a snapshot by
:mod:`nodescope.detectors.traffic`). Pure: no IO, no clock, nothing of nodescope's above the
model.

**Directions** are named as the PCIe specification names flow through the tree:

``downstream``
    from the root complex towards the endpoint: host memory to the device. A GPU's
    host-to-device copies (NVML field 198 ``PCIE_COUNT_RX_BYTES``, "to this GPU"), a disk
    *write* (the controller reads the data out of host memory and the completions flow
    down), a NIC's *transmit* (the NIC reads the packet out of host memory).
``upstream``
    from the endpoint towards the root complex: the device writes into host memory. A GPU's
    device-to-host copies (field 197 ``PCIE_COUNT_TX_BYTES``), a disk *read* (a DMA write
    into host memory), a NIC's *receive*.

**Links** are physical links, named by the port at their upper end: a root port
(``kind="root_port"``) or a switch downstream port (``kind="switch_port"``) names the one link
below it, so the link between a root port and a switch's upstream port is the root port's.
Every endpoint function whose sysfs chain passes through the port sends its bytes through
that link. A host bridge (``pciDDDD:BB``) with more than one root port above such functions
is attributed too (``kind="host_bridge"``): its capacity is the sum of its root ports'
links, the most the stack can carry. A link is *shared* when at least two endpoint
functions of the classes that move data (GPU, NVMe, Ethernet, InfiniBand) sit below it —
whether or not they moved data in this interval, so the set of shared links is a property
of the hardware.

**Capacity** is per direction, after line encoding (:func:`~nodescope.model.topology.
link_capacity_bytes_per_s`), taken at the narrower end: the lesser current speed and the
lesser current width that the two ends report. Utilisation is demand over that capacity.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from nodescope.model.topology import (
    GPUDIRECT_RDMA_MODULES,
    GPUDIRECT_STORAGE_MODULES,
    DeviceClass,
    PciDevice,
    PortRole,
    Topology,
    UpstreamLink,
    upstream_links,
)


class Direction(enum.StrEnum):
    """Which way bytes cross a link; see the module docstring."""

    DOWNSTREAM = "downstream"
    UPSTREAM = "upstream"


DIRECTIONS: tuple[Direction, ...] = (Direction.DOWNSTREAM, Direction.UPSTREAM)


class LinkKind(enum.StrEnum):
    ROOT_PORT = "root_port"
    SWITCH_PORT = "switch_port"
    HOST_BRIDGE = "host_bridge"


#: Classes whose traffic the sources measure; the ones that make a link shared.
TRAFFIC_CLASSES = frozenset(
    {DeviceClass.GPU, DeviceClass.NVME, DeviceClass.ETHERNET, DeviceClass.INFINIBAND}
)


@dataclass(frozen=True, slots=True)
class EndpointFlow:
    """What one PCI function moved, in bytes per second over one interval.

    ``name`` is how people know it (``gpu0``, ``nvme3n1``, ``mlx5_0``); ``measured_by`` the
    source the numbers came from (``nvml``, ``disks``, ``infiniband``, ``netdev``).
    """

    bdf: str
    name: str
    device_class: DeviceClass
    downstream_bytes_per_second: float
    upstream_bytes_per_second: float
    measured_by: str

    def bytes_per_second(self, direction: Direction) -> float:
        if direction is Direction.DOWNSTREAM:
            return self.downstream_bytes_per_second
        return self.upstream_bytes_per_second

    @property
    def total_bytes_per_second(self) -> float:
        return self.downstream_bytes_per_second + self.upstream_bytes_per_second


@dataclass(frozen=True, slots=True)
class Contribution:
    """One endpoint's traffic through one link in one direction and its share of the demand
    (0 when the direction carried nothing)."""

    endpoint: str
    bdf: str
    device_class: DeviceClass
    direction: Direction
    bytes_per_second: float
    share: float


class PeerKind(enum.StrEnum):
    GPUDIRECT_RDMA = "gpudirect_rdma"
    GPUDIRECT_STORAGE = "gpudirect_storage"


@dataclass(frozen=True, slots=True)
class PeerFlow:
    """Bytes a GPU and a NIC or NVMe drive below one PCIe switch are taken to have moved
    between each other directly, turning inside the switch at ``turn`` (the deepest function
    both sit below): they cross the links below ``turn`` only. ``basis`` says what the
    placement rests on."""

    kind: PeerKind
    gpu: str
    gpu_name: str
    peer: str
    peer_name: str
    turn: str
    to_gpu_bytes_per_second: float
    from_gpu_bytes_per_second: float
    basis: str

    @property
    def total_bytes_per_second(self) -> float:
        return self.to_gpu_bytes_per_second + self.from_gpu_bytes_per_second


@dataclass(frozen=True, slots=True)
class DirectionLoad:
    direction: Direction
    demand_bytes_per_second: float
    #: demand over the link's capacity; ``None`` when the capacity is unknown
    utilisation: float | None
    #: largest first
    contributions: tuple[Contribution, ...]


@dataclass(frozen=True, slots=True)
class LinkLoad:
    """The load on one link. ``endpoints`` are the BDFs of every traffic-class function below
    it (idle or not); ``flows`` the flows that crossed it in this interval."""

    name: str
    kind: LinkKind
    host_bridge: str
    numa_node: int | None
    #: functions between the host bridge and the link's upper end, the port included (0 for
    #: a host bridge): deeper links are nearer the endpoints
    depth: int
    #: the narrower end's current speed and width (``None`` for a host bridge)
    speed_gts: float | None
    width: int | None
    capacity_bytes_per_second: float | None
    max_capacity_bytes_per_second: float | None
    endpoints: tuple[str, ...]
    flows: tuple[EndpointFlow, ...]
    downstream: DirectionLoad
    upstream: DirectionLoad
    #: flows between two functions below this link that turn below it, so are not in its
    #: demand (``flows`` hold what is left of each function's traffic)
    peer_to_peer: tuple[PeerFlow, ...] = ()

    @property
    def shared(self) -> bool:
        return len(self.endpoints) >= 2

    def load(self, direction: Direction) -> DirectionLoad:
        return self.downstream if direction is Direction.DOWNSTREAM else self.upstream

    @property
    def busier(self) -> DirectionLoad:
        """The direction of higher demand (downstream on a tie)."""
        if self.upstream.demand_bytes_per_second > self.downstream.demand_bytes_per_second:
            return self.upstream
        return self.downstream

    @property
    def total_bytes_per_second(self) -> float:
        return self.downstream.demand_bytes_per_second + self.upstream.demand_bytes_per_second


@dataclass(frozen=True, slots=True)
class EndpointLoad:
    """An endpoint's own traffic against its own link (the nearest link above it)."""

    flow: EndpointFlow
    link: UpstreamLink | None

    @property
    def capacity_bytes_per_second(self) -> float | None:
        return None if self.link is None else self.link.capacity_bytes_per_s

    def utilisation(self, direction: Direction) -> float | None:
        capacity = self.capacity_bytes_per_second
        if not capacity:
            return None
        return self.flow.bytes_per_second(direction) / capacity

    @property
    def bidirectional_utilisation(self) -> float | None:
        """Both directions together over twice the per-direction capacity."""
        capacity = self.capacity_bytes_per_second
        if not capacity:
            return None
        return self.flow.total_bytes_per_second / (2 * capacity)


@dataclass(frozen=True, slots=True)
class Attribution:
    """Every port link (shared or not) and host bridge in use, and every endpoint's own load."""

    links: tuple[LinkLoad, ...]
    endpoints: tuple[EndpointLoad, ...]
    #: the traffic placed peer to peer below a switch (see :func:`attribute`)
    peer_flows: tuple[PeerFlow, ...] = ()

    @property
    def shared_links(self) -> tuple[LinkLoad, ...]:
        return tuple(link for link in self.links if link.shared)

    def link(self, name: str) -> LinkLoad | None:
        for link in self.links:
            if link.name == name:
                return link
        return None

    def endpoint(self, bdf: str) -> EndpointLoad | None:
        for load in self.endpoints:
            if load.flow.bdf == bdf:
                return load
        return None

    def links_of(self, bdf: str) -> tuple[LinkLoad, ...]:
        """The links ``bdf``'s traffic crosses, nearest first, host bridge last."""
        crossed = [link for link in self.links if bdf in link.endpoints]
        return tuple(sorted(crossed, key=lambda link: -link.depth))


# --- computation ----------------------------------------------------------------------------


def _direction_load(
    direction: Direction, flows: Iterable[EndpointFlow], capacity: float | None
) -> DirectionLoad:
    # Runs for every link and direction each cycle: the attribute reads are spelt out
    # rather than going through EndpointFlow.bytes_per_second.
    if direction is Direction.DOWNSTREAM:
        amounts = [(f.downstream_bytes_per_second, f) for f in flows]
    else:
        amounts = [(f.upstream_bytes_per_second, f) for f in flows]
    moving = [(amount, f) for amount, f in amounts if amount > 0]
    demand = sum(amount for amount, _f in moving)
    moving.sort(key=lambda af: (-af[0], af[1].name))
    contributions = tuple(
        Contribution(
            endpoint=f.name,
            bdf=f.bdf,
            device_class=f.device_class,
            direction=direction,
            bytes_per_second=amount,
            share=amount / demand if demand > 0 else 0.0,
        )
        for amount, f in moving
    )
    utilisation = demand / capacity if capacity else None
    return DirectionLoad(direction, demand, utilisation, contributions)


def _less_by(flow: EndpointFlow, down: float, up: float) -> EndpointFlow:
    """``flow`` without ``down`` and ``up`` bytes per second (what turned elsewhere)."""
    return replace(
        flow,
        downstream_bytes_per_second=max(0.0, flow.downstream_bytes_per_second - down),
        upstream_bytes_per_second=max(0.0, flow.upstream_bytes_per_second - up),
    )


def _link_load(
    spec: _LinkSpec,
    flows_by_bdf: Mapping[str, EndpointFlow],
    peer: Mapping[str, list[tuple[int, float, float, PeerFlow]]],
) -> LinkLoad:
    flows = tuple(flows_by_bdf[b] for b in spec.endpoints if b in flows_by_bdf)
    turned: dict[PeerFlow, None] = {}
    if peer:
        # What a function moved peer to peer with a partner turns at a switch port at least
        # as deep as this link's upper end: it does not cross this link.
        kept = []
        for flow in flows:
            portions = [p for p in peer.get(flow.bdf, ()) if p[0] >= spec.depth]
            if portions:
                down = sum(p[1] for p in portions)
                up = sum(p[2] for p in portions)
                flow = _less_by(flow, down, up)
                turned.update(dict.fromkeys(p[3] for p in portions))
            kept.append(flow)
        flows = tuple(kept)
    below = spec.below
    capacity = spec.capacity
    return LinkLoad(
        name=spec.name,
        kind=spec.kind,
        host_bridge=spec.host_bridge,
        numa_node=spec.numa_node,
        depth=spec.depth,
        speed_gts=None if below is None else below.current_speed_gts,
        width=None if below is None else below.current_width,
        capacity_bytes_per_second=capacity,
        max_capacity_bytes_per_second=spec.max_capacity,
        endpoints=spec.endpoints,
        flows=flows,
        downstream=_direction_load(Direction.DOWNSTREAM, flows, capacity),
        upstream=_direction_load(Direction.UPSTREAM, flows, capacity),
        peer_to_peer=tuple(turned),
    )


def _port_link(topology: Topology, port: PciDevice) -> UpstreamLink | None:
    """The link below ``port``, seen from the first function beneath it (both ends' figures
    merged at the narrower end by :func:`upstream_links`)."""
    children = port.children or tuple(d.bdf for d in topology.devices if d.parent == port.bdf)
    for child_bdf in children:
        child = topology.get(child_bdf)
        if child is None:
            continue
        for link in upstream_links(topology, child.bdf):
            if link.upstream == port.bdf:
                return link
    return None


@dataclass(frozen=True, slots=True)
class _LinkSpec:
    """What the topology alone says of one link: everything of a :class:`LinkLoad` but the
    traffic. ``endpoints`` sorted."""

    name: str
    kind: LinkKind
    host_bridge: str
    numa_node: int | None
    depth: int
    below: UpstreamLink | None
    capacity: float | None
    max_capacity: float | None
    endpoints: tuple[str, ...]


class LinkIndex:
    """The links of one topology and each function's own link, worked out once per topology
    object: the topology changes only when the hardware does, the traffic every second."""

    __slots__ = ("_own", "links", "peer_pairs", "topology")

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.links = _link_specs(topology)
        self.peer_pairs = _peer_pairs(topology)
        self._own: dict[str, UpstreamLink | None] = {}

    def own_link(self, bdf: str) -> UpstreamLink | None:
        """The nearest link above ``bdf`` (``None``: an RC-integrated endpoint)."""
        try:
            return self._own[bdf]
        except KeyError:
            links = upstream_links(self.topology, bdf)
            link = self._own[bdf] = links[0] if links else None
            return link


def _link_specs(topology: Topology) -> tuple[_LinkSpec, ...]:
    """Every port link with a traffic-class function below it, by port BDF, then the host
    bridges with more than one such root port, by name."""
    members: dict[str, list[str]] = {}
    for dev in topology.devices:
        if dev.device_class not in TRAFFIC_CLASSES or dev.role is PortRole.RC_INTEGRATED_ENDPOINT:
            continue
        for bdf in dev.chain[:-1]:
            port = topology.get(bdf)
            if port is not None and port.role in (PortRole.ROOT_PORT, PortRole.DOWNSTREAM_PORT):
                members.setdefault(bdf, []).append(dev.bdf)

    specs: list[_LinkSpec] = []
    root_ports_by_bridge: dict[str, list[tuple[PciDevice, UpstreamLink | None]]] = {}
    for port_bdf in sorted(members):
        port = topology.device(port_bdf)
        below = _port_link(topology, port)
        kind = LinkKind.ROOT_PORT if port.role is PortRole.ROOT_PORT else LinkKind.SWITCH_PORT
        specs.append(
            _LinkSpec(
                port.bdf,
                kind,
                port.root,
                port.numa_node,
                len(port.chain),
                below,
                None if below is None else below.capacity_bytes_per_s,
                None if below is None else below.max_capacity_bytes_per_s,
                tuple(sorted(set(members[port_bdf]))),
            )
        )
        if kind is LinkKind.ROOT_PORT:
            root_ports_by_bridge.setdefault(port.root, []).append((port, below))

    for bridge in sorted(root_ports_by_bridge):
        ports = root_ports_by_bridge[bridge]
        if len(ports) < 2:
            continue  # the root port's link already says everything
        capacities = [b.capacity_bytes_per_s if b else None for _p, b in ports]
        maxima = [b.max_capacity_bytes_per_s if b else None for _p, b in ports]
        specs.append(
            _LinkSpec(
                bridge,
                LinkKind.HOST_BRIDGE,
                bridge,
                ports[0][0].numa_node,
                0,
                None,
                None if None in capacities else sum(c or 0.0 for c in capacities),
                None if None in maxima else sum(m or 0.0 for m in maxima),
                tuple(sorted({e for p, _b in ports for e in members[p.bdf]})),
            )
        )
    return tuple(specs)


@dataclass(frozen=True, slots=True)
class _PeerPair:
    """A GPU and a function below the same PCIe switch that can move data between each other
    without the root complex; ``depth``: the length of the chain down to ``turn``."""

    kind: PeerKind
    gpu: str
    peer: str
    turn: str
    depth: int
    basis: str
    inferred: bool


_SWITCH_PORTS = (PortRole.UPSTREAM_PORT, PortRole.DOWNSTREAM_PORT)
_RDMA_CLASSES = (DeviceClass.INFINIBAND, DeviceClass.ETHERNET)


def _switch_between(topology: Topology, a: PciDevice, b: PciDevice) -> tuple[int, PciDevice] | None:
    """Where the paths of ``a`` and ``b`` meet when that is a PCIe switch port: the length of
    their common chain and that port; ``None`` when they meet at the root or not at all."""
    depth = 0
    for x, y in zip(a.chain, b.chain, strict=False):
        if x != y:
            break
        depth += 1
    if depth == 0:
        return None
    turn = topology.get(a.chain[depth - 1])
    if turn is None or turn.role not in _SWITCH_PORTS:
        return None
    return depth, turn


def _peer_pairs(topology: Topology) -> tuple[_PeerPair, ...]:
    """Every GPU and NIC (GPUDirect RDMA) or NVMe drive (GPUDirect Storage, with ``nvidia_fs``
    loaded) whose paths meet inside a PCIe switch, where no port on the way down to either
    redirects peer-to-peer requests to the root complex (ACS); the nearest pairs first.

    A GPU-NIC pair is *inferred* when neither ``nvidia_peermem`` nor ``nv_peer_mem`` is
    loaded: GPUDirect RDMA through DMA-BUF (recent kernels and CUDA) needs no module, and the
    counters cannot tell it from traffic to host memory, so such a pair is used only where
    the traffic would otherwise be more than a link above it can carry (see
    :func:`attribute`)."""
    modules = topology.peer_modules
    rdma_module = next((m for m in GPUDIRECT_RDMA_MODULES if m in modules), None)
    storage_module = next((m for m in GPUDIRECT_STORAGE_MODULES if m in modules), None)
    endpoints = [d for d in topology.devices if d.role is not PortRole.RC_INTEGRATED_ENDPOINT]
    gpus = [d for d in endpoints if d.device_class is DeviceClass.GPU]
    peers = [
        d
        for d in endpoints
        if d.device_class in _RDMA_CLASSES
        or (storage_module is not None and d.device_class is DeviceClass.NVME)
    ]
    pairs: list[_PeerPair] = []
    for gpu in gpus:
        for peer in peers:
            meeting = _switch_between(topology, gpu, peer)
            if meeting is None:
                continue
            depth, turn = meeting
            below = [topology.get(b) for b in (*gpu.chain[depth:], *peer.chain[depth:])]
            acs = [d.acs_redirect for d in below if d is not None and d.role in _SWITCH_PORTS]
            if any(acs):
                continue  # requests go up to the root complex and back down
            read = all(a is False for a in acs) and bool(acs)
            acs_text = "ACS does not redirect" if read else "ACS not read"
            inferred = False
            if peer.device_class is DeviceClass.NVME:
                kind = PeerKind.GPUDIRECT_STORAGE
                module = f"{storage_module} loaded"
            else:
                kind = PeerKind.GPUDIRECT_RDMA
                inferred = rdma_module is None
                module = (
                    "no GPUDirect module loaded, inferred from a demand above what the link carries"
                    if inferred
                    else f"{rdma_module} loaded"
                )
            basis = f"{module}, {acs_text}"
            pairs.append(_PeerPair(kind, gpu.bdf, peer.bdf, turn.bdf, depth, basis, inferred))
    pairs.sort(key=lambda p: (-p.depth, p.gpu, p.peer))
    return tuple(pairs)


@dataclass(frozen=True, slots=True)
class AcsRedirect:
    """Two functions whose paths meet inside a PCIe switch (at ``turn``), where switch ports
    on the way down (``ports``) redirect peer-to-peer requests to the root complex (ACS "P2P
    Request Redirect"): what they move between each other goes up through the root port
    above and back down instead of turning in the switch."""

    first: str
    second: str
    turn: str
    ports: tuple[str, ...]


#: Classes whose traffic between each other may turn inside a switch: GPUs among themselves
#: (CUDA peer access), with a NIC (GPUDirect RDMA) or an NVMe drive (GPUDirect Storage).
_PEER_CLASSES = (DeviceClass.GPU, DeviceClass.NVME, *_RDMA_CLASSES)


def acs_redirects(topology: Topology, bdfs: Iterable[str]) -> tuple[AcsRedirect, ...]:
    """The pairs of ``bdfs``, at least one a GPU, that sit below one PCIe switch and whose
    peer-to-peer requests ACS redirects to the root complex (see :class:`AcsRedirect`). For
    a finding's message: a link carries their traffic because of that setting."""
    devices = [d for d in (topology.get(b) for b in sorted(set(bdfs))) if d is not None]
    devices = [d for d in devices if d.device_class in _PEER_CLASSES]
    found: list[AcsRedirect] = []
    for i, first in enumerate(devices):
        for second in devices[i + 1 :]:
            if DeviceClass.GPU not in (first.device_class, second.device_class):
                continue
            meeting = _switch_between(topology, first, second)
            if meeting is None:
                continue
            depth, turn = meeting
            ports = tuple(
                bdf
                for bdf in (*first.chain[depth:], *second.chain[depth:])
                if (port := topology.get(bdf)) is not None
                and port.role in _SWITCH_PORTS
                and port.acs_redirect
            )
            if ports:
                found.append(AcsRedirect(first.bdf, second.bdf, turn.bdf, tuple(sorted(ports))))
    return tuple(found)


def _peer_flows(
    pairs: tuple[_PeerPair, ...], flows_by_bdf: Mapping[str, EndpointFlow]
) -> tuple[PeerFlow, ...]:
    """The traffic of each pair taken as peer to peer: what the GPU sent up against what the
    partner took down (a NIC's transmit, a drive's write), and what the partner sent up (a
    receive, a read) against what the GPU took down, each the lesser of the two and each
    function's bytes given out once, nearest pairs first. The counters cannot tell a NIC's
    transmit out of GPU memory from one out of host memory: taking the match as peer to peer
    never puts on a link more than crosses it."""
    left_down = {b: f.downstream_bytes_per_second for b, f in flows_by_bdf.items()}
    left_up = {b: f.upstream_bytes_per_second for b, f in flows_by_bdf.items()}
    placed: list[PeerFlow] = []
    for pair in pairs:
        gpu = flows_by_bdf.get(pair.gpu)
        peer = flows_by_bdf.get(pair.peer)
        if gpu is None or peer is None:
            continue
        from_gpu = min(left_up[pair.gpu], left_down[pair.peer])
        to_gpu = min(left_down[pair.gpu], left_up[pair.peer])
        if from_gpu <= 0 and to_gpu <= 0:
            continue
        left_up[pair.gpu] -= from_gpu
        left_down[pair.peer] -= from_gpu
        left_down[pair.gpu] -= to_gpu
        left_up[pair.peer] -= to_gpu
        placed.append(
            PeerFlow(
                pair.kind, gpu.bdf, gpu.name, peer.bdf, peer.name, pair.turn,
                max(0.0, to_gpu), max(0.0, from_gpu), pair.basis,
            )
        )  # fmt: skip
    return tuple(placed)


def attribute(
    topology: Topology,
    flows: Iterable[EndpointFlow],
    index: LinkIndex | None = None,
    host_staged: frozenset[str] = frozenset(),
) -> Attribution:
    """Attribute ``flows`` to every link of ``topology`` they cross.

    Flows of functions the topology does not know (a device that left the bus) are dropped.
    ``index``: the links of ``topology`` worked out before (the topology changes only when the
    hardware does, the traffic every second); made here when not given or of another topology.

    Traffic a GPU and a NIC or NVMe drive below one switch can move between each other is
    placed peer to peer (:func:`_peer_pairs`, :func:`_peer_flows`): with the GPUDirect
    module loaded, and without it only below a port link that would otherwise carry more than
    it can. ``host_staged``: BDFs of GPUs whose jobs turned GPUDirect RDMA off
    (``NCCL_NET_GDR_LEVEL=LOC``): their traffic with NICs goes through host memory.
    """
    flows_by_bdf: dict[str, EndpointFlow] = {}
    for flow in flows:
        if topology.get(flow.bdf) is not None:
            flows_by_bdf[flow.bdf] = flow
    if index is None or index.topology is not topology:
        index = LinkIndex(topology)
    pairs = index.peer_pairs
    if host_staged:
        pairs = tuple(
            p for p in pairs if p.gpu not in host_staged or p.kind is not PeerKind.GPUDIRECT_RDMA
        )
    known = tuple(p for p in pairs if not p.inferred)
    peer_flows = _peer_flows(known, flows_by_bdf) if known else ()
    links = _links(index, flows_by_bdf, peer_flows)
    inferred = [p for p in pairs if p.inferred]
    if inferred:
        # A port link that would carry more than it can: what a GPU and a NIC below it could
        # have moved between each other turned below it.
        over = [link for link in links if link.kind is not LinkKind.HOST_BRIDGE and _over(link)]
        usable = tuple(
            p
            for p in inferred
            if any(
                p.gpu in link.endpoints and p.peer in link.endpoints and p.depth >= link.depth
                for link in over
            )
        )
        if usable:
            peer_flows = peer_flows + _peer_flows(usable, _less(flows_by_bdf, peer_flows))
            links = _links(index, flows_by_bdf, peer_flows)
    endpoints = tuple(
        EndpointLoad(flows_by_bdf[bdf], index.own_link(bdf)) for bdf in sorted(flows_by_bdf)
    )
    return Attribution(links, endpoints, peer_flows)


#: Demand over capacity that the timing of the counters' reads cannot explain: they are read
#: within milliseconds of each other over intervals of a second or more.
IMPOSSIBLE_UTILISATION = 1.1


def _over(link: LinkLoad) -> bool:
    return any(
        d.utilisation is not None and d.utilisation > IMPOSSIBLE_UTILISATION
        for d in (link.downstream, link.upstream)
    )


def _less(
    flows_by_bdf: Mapping[str, EndpointFlow], placed: tuple[PeerFlow, ...]
) -> dict[str, EndpointFlow]:
    """``flows_by_bdf`` less what ``placed`` already gave out."""
    left = dict(flows_by_bdf)
    for moved in placed:
        for bdf, down, up in (
            (moved.gpu, moved.to_gpu_bytes_per_second, moved.from_gpu_bytes_per_second),
            (moved.peer, moved.from_gpu_bytes_per_second, moved.to_gpu_bytes_per_second),
        ):
            flow = left[bdf]
            left[bdf] = _less_by(flow, down, up)
    return left


def _links(
    index: LinkIndex, flows_by_bdf: Mapping[str, EndpointFlow], peer_flows: tuple[PeerFlow, ...]
) -> tuple[LinkLoad, ...]:
    # function -> (depth of the turn, its downstream and upstream bytes in it, the flow)
    portions: dict[str, list[tuple[int, float, float, PeerFlow]]] = {}
    depth_of = {(p.gpu, p.peer): p.depth for p in index.peer_pairs}
    for moved in peer_flows:
        depth = depth_of[(moved.gpu, moved.peer)]
        to_gpu, from_gpu = moved.to_gpu_bytes_per_second, moved.from_gpu_bytes_per_second
        portions.setdefault(moved.gpu, []).append((depth, to_gpu, from_gpu, moved))
        portions.setdefault(moved.peer, []).append((depth, from_gpu, to_gpu, moved))
    return tuple(_link_load(spec, flows_by_bdf, portions) for spec in index.links)
