"""The NVLink graph of a node: GPUs and NVSwitches joined by NVLinks.

Built from what NVML says per GPU link (``docs/datasources.md`` §1.3): whether the link is
active (``nvmlDeviceGetNvLinkState``), what is at its far end
(``nvmlDeviceGetNvLinkRemoteDeviceType``: ``gpu``, ``switch``, ``ibmnpu``, ``unknown``) and
that device's PCI address (``nvmlDeviceGetNvLinkRemotePciInfo``, in the sysfs form). NVML
shows links only from the GPU side: switch-to-switch trunks and switch port numbers are not
in it (§8), so an NVSwitch is a node known by its PCI address alone.

The questions asked of it are those of ``nvidia-smi topo -m`` (§9): ``NV#``, the number of
bonded NVLinks between two GPUs, and which switches each GPU reaches; and, by PCI address,
where each node sits in the PCIe tree (:mod:`nodescope.model.topology`). Records are immutable;
this module imports nothing of nodescope outside ``model``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

from nodescope.model.topology import DeviceClass, PciDevice, Topology

#: Remote device types as the NVML source names them (nvml.h ``nvmlIntNvLinkDeviceType_t``).
REMOTE_GPU = "gpu"
REMOTE_SWITCH = "switch"

VIA_DIRECT = "direct"
VIA_NVSWITCH = "nvswitch"


class LinkColumns(Protocol):
    """A GPU's NVLinks as it reports them, held as columns (``model.nvml.NvLinks`` is one):
    the ``i``-th item of each is link ``i``'s."""

    @property
    def link(self) -> Sequence[int]: ...
    @property
    def active(self) -> Sequence[bool | None]: ...
    @property
    def remote_type(self) -> Sequence[str | None]: ...
    @property
    def remote_pci_address(self) -> Sequence[str | None]: ...


class GpuLike(Protocol):
    """A GPU and its NVLinks (``sources.nvml.GpuSample`` is one)."""

    @property
    def index(self) -> int: ...
    @property
    def pci_address(self) -> str: ...
    @property
    def nvlinks(self) -> LinkColumns: ...


@dataclass(frozen=True, slots=True)
class GpuNode:
    """A GPU: NVML index and sysfs PCI address (``0000:19:00.0``)."""

    index: int
    pci_address: str


@dataclass(frozen=True, slots=True)
class SwitchNode:
    """An NVSwitch, known from the GPU side only by its PCI address."""

    pci_address: str


@dataclass(frozen=True, slots=True)
class NvLinkEdge:
    """Link ``link`` of GPU ``gpu`` (an NVML index) and what NVML says is at its far end.

    ``remote_type``/``remote_pci_address`` are ``None`` where NVML did not say (the link was
    never up, or the call is not supported); ``active`` is ``None`` where the state call
    failed. Only links with ``active is True`` count anywhere.
    """

    gpu: int
    link: int
    remote_type: str | None
    remote_pci_address: str | None
    active: bool | None


@dataclass(frozen=True, slots=True)
class BondedPair:
    """``NV#`` of two GPUs (``gpu_a < gpu_b``): ``links`` bonded NVLinks, ``via`` ``direct``
    (GPU-to-GPU links) or ``nvswitch``."""

    gpu_a: int
    gpu_b: int
    links: int
    via: str


@dataclass(frozen=True, slots=True)
class SwitchReach:
    """The active links of one GPU that end on one NVSwitch."""

    switch: str
    links: int


def _address(text: str) -> str:
    # sysfs prints addresses in lower case; NVML's busId is upper case.
    return text.strip().lower()


@dataclass(frozen=True)
class NvLinkGraph:
    """GPUs (by index), the NVSwitches their links reach, and every link, sorted."""

    gpus: tuple[GpuNode, ...]
    switches: tuple[SwitchNode, ...]
    links: tuple[NvLinkEdge, ...]

    @classmethod
    def from_gpus(cls, gpus: Iterable[GpuLike]) -> NvLinkGraph:
        """The graph of the GPUs NVML lists now. A GPU NVML lost is not among them, so it
        drops out: its peers' links to it stay as edges but bond with nothing."""
        nodes: dict[int, GpuNode] = {}
        edges: list[NvLinkEdge] = []
        switches: set[str] = set()
        for gpu in gpus:
            nodes[gpu.index] = GpuNode(gpu.index, _address(gpu.pci_address))
            links = gpu.nvlinks
            for number, remote_type, remote, active in zip(
                links.link, links.remote_type, links.remote_pci_address, links.active, strict=True
            ):
                remote = None if remote is None else _address(remote)
                edges.append(NvLinkEdge(gpu.index, number, remote_type, remote, active))
                if remote_type == REMOTE_SWITCH and remote is not None:
                    switches.add(remote)
        return cls(
            gpus=tuple(nodes[i] for i in sorted(nodes)),
            switches=tuple(SwitchNode(s) for s in sorted(switches)),
            links=tuple(sorted(edges, key=lambda e: (e.gpu, e.link))),
        )

    # ---- lookups ------------------------------------------------------------------------

    @cached_property
    def _by_index(self) -> Mapping[int, GpuNode]:
        return {g.index: g for g in self.gpus}

    @cached_property
    def _by_address(self) -> Mapping[str, GpuNode]:
        return {g.pci_address: g for g in self.gpus}

    @cached_property
    def _active(self) -> Mapping[int, tuple[NvLinkEdge, ...]]:
        by_gpu: dict[int, list[NvLinkEdge]] = {g.index: [] for g in self.gpus}
        for edge in self.links:
            if edge.active is True and edge.gpu in by_gpu:
                by_gpu[edge.gpu].append(edge)
        return {gpu: tuple(edges) for gpu, edges in by_gpu.items()}

    def gpu(self, index: int) -> GpuNode:
        """The GPU of NVML index ``index``; ``KeyError`` when the graph has none."""
        return self._by_index[index]

    def gpu_at(self, pci_address: str) -> GpuNode | None:
        return self._by_address.get(_address(pci_address))

    def active_links(self, gpu: int) -> tuple[NvLinkEdge, ...]:
        """The active links of GPU ``gpu`` (none for a GPU not in the graph)."""
        return self._active.get(gpu, ())

    # ---- NV# ----------------------------------------------------------------------------

    def _direct(self, a: GpuNode, b: GpuNode) -> int:
        # A driver without nvmlDeviceGetNvLinkRemoteDeviceType leaves the type unknown; the
        # peer's address alone then says the far end is that GPU.
        return sum(
            1
            for e in self.active_links(a.index)
            if e.remote_pci_address == b.pci_address and e.remote_type in (REMOTE_GPU, None)
        )

    def switch_links(self, gpu: int) -> int:
        """Active links of ``gpu`` that end on an NVSwitch."""
        return sum(1 for e in self.active_links(gpu) if e.remote_type == REMOTE_SWITCH)

    def bonded(self, a: int, b: int) -> BondedPair | None:
        """``NV#`` of GPUs ``a`` and ``b`` (§9), ``None`` when no NVLink joins them.

        Direct links are counted by peer address from both ends and the smaller count
        taken: a link that one end reports down carries nothing. Through NVSwitches every
        pair on the fabric shows the GPUs' active switch-link count, the smaller of the
        two where they differ (HGX H100: NV18). Sharing a switch is not required: NVML does
        not show switch-to-switch trunks, and on two-baseboard systems (HGX-2) GPUs that
        reach disjoint switches are still one fabric. Direct links, where a GPU has them,
        decide alone.
        """
        if a == b or a not in self._by_index or b not in self._by_index:
            return None
        ga, gb = self._by_index[a], self._by_index[b]
        lo, hi = min(a, b), max(a, b)
        direct = min(self._direct(ga, gb), self._direct(gb, ga))
        if direct:
            return BondedPair(lo, hi, direct, VIA_DIRECT)
        switched = min(self.switch_links(a), self.switch_links(b))
        if switched:
            return BondedPair(lo, hi, switched, VIA_NVSWITCH)
        return None

    def bonded_pairs(self) -> tuple[BondedPair, ...]:
        """Every GPU pair joined by NVLink, ordered by ``(gpu_a, gpu_b)``."""
        pairs: list[BondedPair] = []
        indices = [g.index for g in self.gpus]
        for i, a in enumerate(indices):
            for b in indices[i + 1 :]:
                pair = self.bonded(a, b)
                if pair is not None:
                    pairs.append(pair)
        return tuple(pairs)

    def switches_of(self, gpu: int) -> tuple[SwitchReach, ...]:
        """The NVSwitches GPU ``gpu`` reaches over active links, with the link count to
        each, by switch address."""
        counts: dict[str, int] = {}
        for e in self.active_links(gpu):
            if e.remote_type == REMOTE_SWITCH and e.remote_pci_address is not None:
                counts[e.remote_pci_address] = counts.get(e.remote_pci_address, 0) + 1
        return tuple(SwitchReach(s, n) for s, n in sorted(counts.items()))

    def counts_by_address(self) -> dict[frozenset[str], int]:
        """``NV#`` keyed by the pair's PCI addresses: the form
        :func:`nodescope.model.topology.affinity` takes."""
        return {
            frozenset((self.gpu(p.gpu_a).pci_address, self.gpu(p.gpu_b).pci_address)): p.links
            for p in self.bonded_pairs()
        }


# --- the graph on the PCIe tree ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlacedNode:
    """A node of the NVLink graph and the PCI function at its address (``None``: the PCIe
    tree has no function there). ``gpu`` is the NVML index, ``None`` for an NVSwitch."""

    pci_address: str
    kind: DeviceClass
    gpu: int | None
    device: PciDevice | None


@dataclass(frozen=True)
class PlacedGraph:
    """An NVLink graph joined to a PCIe topology by PCI address.

    ``unmatched`` lists the graph's nodes the PCIe tree lacks (or shows as another kind of
    device); ``gpus_without_nvlink_graph`` the GPUs the PCIe tree shows that the graph does
    not (NVML lost them, or was never told of them).
    """

    graph: NvLinkGraph
    nodes: tuple[PlacedNode, ...]
    unmatched: tuple[str, ...]
    gpus_without_nvlink_graph: tuple[str, ...]

    def device_of_gpu(self, index: int) -> PciDevice | None:
        for node in self.nodes:
            if node.gpu == index:
                return node.device
        return None

    def counts_by_bdf(self) -> dict[frozenset[str], int]:
        """``NV#`` for pairs of GPUs present in both views, keyed by BDF, for
        :func:`nodescope.model.topology.affinity`."""
        placed = {n.pci_address for n in self.nodes if n.device is not None}
        return {
            pair: count for pair, count in self.graph.counts_by_address().items() if pair <= placed
        }


def attach(graph: NvLinkGraph, topology: Topology) -> PlacedGraph:
    """Place every GPU and NVSwitch of ``graph`` on ``topology`` by PCI address.

    A node whose address the tree has as another device class is unmatched: the two views
    disagree, and no ``NV#`` is drawn on a device that is not a GPU.
    """
    nodes: list[PlacedNode] = []
    unmatched: list[str] = []
    wanted: list[tuple[str, DeviceClass, int | None]]
    wanted = [(g.pci_address, DeviceClass.GPU, g.index) for g in graph.gpus]
    wanted += [(s.pci_address, DeviceClass.NVSWITCH, None) for s in graph.switches]
    for address, kind, index in wanted:
        device = topology.get(address)
        if device is not None and device.device_class is not kind:
            device = None
        if device is None:
            unmatched.append(address)
        nodes.append(PlacedNode(address, kind, index, device))
    known = {g.pci_address for g in graph.gpus}
    missing = tuple(d.bdf for d in topology.of_class(DeviceClass.GPU) if d.bdf not in known)
    return PlacedGraph(graph, tuple(nodes), tuple(unmatched), missing)
