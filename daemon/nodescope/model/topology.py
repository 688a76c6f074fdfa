"""The PCIe topology of a node: host bridges, root ports, switch ports, endpoints.

Built by ``sources/pci.py`` from ``/sys/bus/pci/devices`` (see ``docs/datasources.md`` §2):
each function's sysfs realpath ``/sys/devices/pciDDDD:BB/<root port>/.../<function>`` gives
its root bus and its chain of parent bridges. This module holds the typed, immutable records
and the pure functions the rest of nodescope asks questions with: link capacities, the path
of a device to its root port, and the ``nvidia-smi topo -m`` relation between two devices
(§9). Of nodescope it imports only the record of skipped input (:mod:`nodescope.model.skips`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from nodescope.model.skips import NOTHING_SKIPPED, Skipped
from nodescope.model.source_key import SourceKey

#: PCI vendor ids this module names (pci.ids).
VENDOR_NVIDIA = 0x10DE
VENDOR_AMD_ATI = 0x1002
VENDOR_MELLANOX = 0x15B3

#: Vendors whose display controllers are compute GPUs rather than BMC/console graphics.
GPU_VENDORS = frozenset({VENDOR_NVIDIA, VENDOR_AMD_ATI})


class DeviceClass(enum.StrEnum):
    """What a PCI function is, for nodescope's purposes (§2.4)."""

    GPU = "gpu"
    NVME = "nvme"
    ETHERNET = "ethernet"
    INFINIBAND = "infiniband"
    NVSWITCH = "nvswitch"
    BRIDGE = "bridge"
    OTHER = "other"


class PortRole(enum.StrEnum):
    """Where a function sits in the tree.

    Without root, the PCIe capability (which names the port type) lies past the 64 bytes of
    config space sysfs shows, so the role is derived from the position in the realpath
    chain (§2.3): the first function below the host bridge is a root port if it is a bridge,
    otherwise an RC-integrated endpoint; further bridges alternate switch upstream and
    downstream ports.
    """

    ROOT_PORT = "root_port"
    UPSTREAM_PORT = "upstream_port"
    DOWNSTREAM_PORT = "downstream_port"
    ENDPOINT = "endpoint"
    RC_INTEGRATED_ENDPOINT = "rc_integrated_endpoint"


class Relation(enum.StrEnum):
    """The PCIe part of the ``nvidia-smi topo -m`` legend, nearest first (§9)."""

    X = "X"
    PIX = "PIX"
    PXB = "PXB"
    PHB = "PHB"
    NODE = "NODE"
    SYS = "SYS"


RELATION_LEGEND: tuple[tuple[str, str], ...] = (
    ("X", "Self"),
    ("SYS", "Connection traversing PCIe as well as the SMP interconnect between NUMA nodes"),
    (
        "NODE",
        "Connection traversing PCIe as well as the interconnect between PCIe host bridges"
        " within a NUMA node",
    ),
    ("PHB", "Connection traversing PCIe as well as a PCIe host bridge (typically the CPU)"),
    (
        "PXB",
        "Connection traversing multiple PCIe bridges (without traversing the PCIe host bridge)",
    ),
    ("PIX", "Connection traversing at most a single PCIe bridge"),
    ("NV#", "Connection traversing a bonded set of # NVLinks"),
)


def classify(class_code: int, vendor_id: int) -> DeviceClass:
    """The device class from the 24-bit class code and the vendor id (§2.4)."""
    base = (class_code >> 16) & 0xFF
    sub = (class_code >> 8) & 0xFF
    if base == 0x03 and vendor_id in GPU_VENDORS:
        return DeviceClass.GPU
    if class_code == 0x010802:
        return DeviceClass.NVME
    if base == 0x02 and sub == 0x00:
        return DeviceClass.ETHERNET
    if base == 0x02 and sub == 0x07:
        return DeviceClass.INFINIBAND
    if base == 0x06 and sub == 0x80 and vendor_id == VENDOR_NVIDIA:
        return DeviceClass.NVSWITCH
    if base == 0x06:
        return DeviceClass.BRIDGE
    return DeviceClass.OTHER


def is_pci_bridge(class_code: int) -> bool:
    """PCI-to-PCI bridge (0x0604xx): root ports and switch ports."""
    return (class_code >> 8) == 0x0604


# --- link capacity --------------------------------------------------------------------------

#: generation -> (GT/s, payload bits per transferred bit). Gen1-2 use 8b/10b, Gen3-5
#: 128b/130b; Gen6 sends 256-byte FLITs of which 236 bytes carry TLPs (the rest are DLP,
#: CRC and FEC), table §2.5.
_GENERATIONS: dict[int, tuple[float, float]] = {
    1: (2.5, 8 / 10),
    2: (5.0, 8 / 10),
    3: (8.0, 128 / 130),
    4: (16.0, 128 / 130),
    5: (32.0, 128 / 130),
    6: (64.0, 236 / 256),
}


def generation_of(gts: float) -> int | None:
    """PCIe generation of a signalling rate in GT/s (2.5 -> 1 ... 64 -> 6), None if unknown."""
    for gen, (rate, _eff) in _GENERATIONS.items():
        if abs(rate - gts) < 1e-6:
            return gen
    return None


def gts_of_generation(generation: int) -> float:
    return _GENERATIONS[generation][0]


def link_capacity_bytes_per_s(gen_or_gts: int | float, width: int) -> float:
    """Usable bytes per second in one direction of a link, after line encoding.

    An ``int`` is a generation (5 = Gen5), a ``float`` a rate in GT/s (5.0 = Gen2). Rates that
    match no generation are taken as 128b/130b. TLP/DLLP overhead is not subtracted.
    """
    if width < 0:
        raise ValueError(f"negative link width {width}")
    if isinstance(gen_or_gts, int) and not isinstance(gen_or_gts, bool):
        if gen_or_gts not in _GENERATIONS:
            raise ValueError(f"no PCIe generation {gen_or_gts}")
        gts, efficiency = _GENERATIONS[gen_or_gts]
    else:
        gts = float(gen_or_gts)
        gen = generation_of(gts)
        efficiency = _GENERATIONS[gen][1] if gen is not None else 128 / 130
    return gts * 1e9 * efficiency / 8 * width


# --- records ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LinkState:
    """``current_link_*`` (Link Status) and ``max_link_*`` (Link Capabilities) of a function.

    ``None`` where the file is absent, reads ``Unknown``, or the device was runtime-suspended
    (reading the link files would have woken it).
    """

    current_speed_gts: float | None
    current_width: int | None
    max_speed_gts: float | None
    max_width: int | None

    @property
    def current_generation(self) -> int | None:
        return None if self.current_speed_gts is None else generation_of(self.current_speed_gts)

    @property
    def max_generation(self) -> int | None:
        return None if self.max_speed_gts is None else generation_of(self.max_speed_gts)

    @property
    def current_capacity_bytes_per_s(self) -> float | None:
        if self.current_speed_gts is None or self.current_width is None:
            return None
        return link_capacity_bytes_per_s(self.current_speed_gts, self.current_width)

    @property
    def max_capacity_bytes_per_s(self) -> float | None:
        if self.max_speed_gts is None or self.max_width is None:
            return None
        return link_capacity_bytes_per_s(self.max_speed_gts, self.max_width)

    @property
    def downtrained(self) -> bool:
        """Running slower or narrower than the device can: often idle power saving on GPUs."""
        if None in (self.current_speed_gts, self.max_speed_gts):
            speed_down = False
        else:
            speed_down = self.current_speed_gts < self.max_speed_gts  # type: ignore[operator]
        if None in (self.current_width, self.max_width):
            width_down = False
        else:
            width_down = self.current_width < self.max_width  # type: ignore[operator]
        return speed_down or width_down


@dataclass(frozen=True, slots=True)
class AerCounter:
    name: str
    value: int


@dataclass(frozen=True, slots=True)
class AerRecord:
    """One ``aer_dev_{correctable,fatal,nonfatal}`` file (§2.2).

    ``severity`` is ``correctable``, ``fatal`` or ``nonfatal``; ``total`` is the
    ``TOTAL_ERR_*`` line, which can differ from the sum of the named counters.
    """

    severity: str
    counters: tuple[AerCounter, ...]
    total: int | None


#: GPUDirect RDMA: NICs read and write GPU memory directly (``nvidia_peermem``, before it
#: Mellanox's ``nv_peer_mem``; CUDA 11.7 and later on kernels with DMA-BUF need neither).
GPUDIRECT_RDMA_MODULES = ("nvidia_peermem", "nv_peer_mem")
#: GPUDirect Storage: NVMe drives read into and write from GPU memory (``nvidia_fs``).
GPUDIRECT_STORAGE_MODULES = ("nvidia_fs",)
PEER_MODULES = GPUDIRECT_RDMA_MODULES + GPUDIRECT_STORAGE_MODULES


@dataclass(frozen=True, slots=True)
class PciDevice:
    """One PCI function.

    ``root`` is the host bridge (``pci0000:15``); ``chain`` the BDFs from the first function
    below it down to this one (inclusive), so ``chain[0]`` is the root port (or this device,
    for an RC-integrated endpoint) and ``chain[-2]`` the parent bridge.
    """

    bdf: str
    root: str
    chain: tuple[str, ...]
    vendor_id: int
    device_id: int
    class_code: int
    device_class: DeviceClass
    role: PortRole
    numa_node: int | None
    local_cpus: tuple[int, ...] | None
    link: LinkState | None
    aer: tuple[AerRecord, ...] = ()
    children: tuple[str, ...] = ()
    net_interfaces: tuple[str, ...] = ()
    ib_devices: tuple[str, ...] = ()
    nvme_controllers: tuple[str, ...] = ()
    #: A port's Access Control Services "P2P Request Redirect" (ACS control bit 2, PCIe Base
    #: Specification §7.7.8): ``True`` sends peer-to-peer requests up to the root complex
    #: instead of across the switch; ``None`` when the port has no ACS capability or its
    #: configuration space could not be read (functions other than ports: always ``None``).
    acs_redirect: bool | None = None
    #: for an SR-IOV virtual function, the BDF of its physical function (sysfs ``physfn``):
    #: the PF's driver creates and removes its VFs (``sriov_numvfs``)
    physical_function: str | None = None

    @property
    def parent(self) -> str | None:
        return self.chain[-2] if len(self.chain) > 1 else None

    @property
    def root_port(self) -> str | None:
        """The root port above (or at) this function; None for RC-integrated endpoints."""
        first = self.chain[0]
        if first == self.bdf and self.role is PortRole.RC_INTEGRATED_ENDPOINT:
            return None
        return first

    @property
    def os_names(self) -> tuple[str, ...]:
        """Names the OS gives this function: IB device, NVMe controller, network interfaces."""
        return self.ib_devices + self.nvme_controllers + self.net_interfaces


@dataclass(frozen=True, slots=True)
class PciRoot:
    """A host bridge / root bus, ``pciDDDD:BB`` in sysfs (not a PCI function itself)."""

    name: str
    domain: int
    bus: int
    children: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class NumaNode:
    node: int
    cpus: tuple[int, ...]


@dataclass(frozen=True)
class Topology:
    """All PCI functions of the node, sorted by BDF, plus the host bridges and NUMA nodes."""

    devices: tuple[PciDevice, ...]
    roots: tuple[PciRoot, ...]
    numa_nodes: tuple[NumaNode, ...] = ()
    #: which of the kernel modules that let devices move data peer to peer with a GPU are
    #: loaded (:data:`PEER_MODULES`), from ``/sys/module``
    peer_modules: frozenset[str] = frozenset()
    #: functions and attributes the read that made this record left out as unreadable or
    #: malformed (a function is left out with every function below it)
    skipped: Skipped = field(default=NOTHING_SKIPPED, compare=False)

    @cached_property
    def _by_bdf(self) -> Mapping[str, PciDevice]:
        return {d.bdf: d for d in self.devices}

    def device(self, bdf: str) -> PciDevice:
        """The function at ``bdf``; ``KeyError`` when there is none."""
        return self._by_bdf[bdf]

    def get(self, bdf: str) -> PciDevice | None:
        return self._by_bdf.get(bdf)

    def of_class(self, *classes: DeviceClass) -> tuple[PciDevice, ...]:
        wanted = set(classes)
        return tuple(d for d in self.devices if d.device_class in wanted)

    def below(self, bdf: str) -> tuple[PciDevice, ...]:
        """Every function in the subtree under ``bdf`` (not including it)."""
        return tuple(d for d in self.devices if bdf in d.chain[:-1])


# --- paths and links ------------------------------------------------------------------------


def path_to_root(topology: Topology, bdf: str) -> tuple[PciDevice, ...]:
    """The device, its parent bridge, ... up to the root port, nearest first."""
    dev = topology.device(bdf)
    return tuple(topology.device(b) for b in reversed(dev.chain))


@dataclass(frozen=True, slots=True)
class UpstreamLink:
    """A physical link between ``downstream`` (endpoint or switch upstream port) and
    ``upstream`` (root port or switch downstream port).

    Both ends report the link; the figures are the narrower end's, so a mismatch (one end
    reporting less) counts against the link.
    """

    downstream: str
    upstream: str
    current_speed_gts: float | None
    current_width: int | None
    max_speed_gts: float | None
    max_width: int | None
    capacity_bytes_per_s: float | None
    max_capacity_bytes_per_s: float | None


def _narrower(a: float | int | None, b: float | int | None) -> float | int | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def _capacity(speed: float | None, width: int | None) -> float | None:
    if speed is None or width is None:
        return None
    return link_capacity_bytes_per_s(float(speed), width)


def upstream_links(topology: Topology, bdf: str) -> tuple[UpstreamLink, ...]:
    """The physical links from ``bdf`` up to its root port, nearest first.

    A switch's upstream-to-downstream-port hop is internal to the switch and is no link; a
    root port's upstream side is the root complex.
    """
    links: list[UpstreamLink] = []
    for dev in path_to_root(topology, bdf):
        parent_bdf = dev.parent
        if parent_bdf is None or dev.role is PortRole.DOWNSTREAM_PORT:
            continue
        parent = topology.device(parent_bdf)
        lo = dev.link or LinkState(None, None, None, None)
        hi = parent.link or LinkState(None, None, None, None)
        cur_speed = _narrower(lo.current_speed_gts, hi.current_speed_gts)
        cur_width = _narrower(lo.current_width, hi.current_width)
        max_speed = _narrower(lo.max_speed_gts, hi.max_speed_gts)
        max_width = _narrower(lo.max_width, hi.max_width)
        links.append(
            UpstreamLink(
                downstream=dev.bdf,
                upstream=parent.bdf,
                current_speed_gts=None if cur_speed is None else float(cur_speed),
                current_width=None if cur_width is None else int(cur_width),
                max_speed_gts=None if max_speed is None else float(max_speed),
                max_width=None if max_width is None else int(max_width),
                capacity_bytes_per_s=_capacity(
                    None if cur_speed is None else float(cur_speed),
                    None if cur_width is None else int(cur_width),
                ),
                max_capacity_bytes_per_s=_capacity(
                    None if max_speed is None else float(max_speed),
                    None if max_width is None else int(max_width),
                ),
            )
        )
    return tuple(links)


def bottleneck(links: Iterable[UpstreamLink]) -> UpstreamLink | None:
    """The link of least current capacity on a path (None when no capacity is known)."""
    known = [link for link in links if link.capacity_bytes_per_s is not None]
    if not known:
        return None
    return min(known, key=lambda link: link.capacity_bytes_per_s or 0.0)


# --- nvidia-smi topo -m relations -----------------------------------------------------------


def switch_of(topology: Topology, bdf: str) -> str | None:
    """The switch a bridge belongs to, named by its upstream port; a root port is its own.

    ``None`` for functions that are not ports.
    """
    dev = topology.device(bdf)
    if dev.role is PortRole.UPSTREAM_PORT or dev.role is PortRole.ROOT_PORT:
        return dev.bdf
    if dev.role is PortRole.DOWNSTREAM_PORT:
        return dev.parent
    return None


def relation(topology: Topology, a: str, b: str) -> Relation:
    """How ``a`` reaches ``b`` over PCIe, in the ``nvidia-smi topo -m`` legend (§9).

    Different host bridges: NODE within one NUMA node, else SYS. One host bridge but different
    root ports: PHB. Below one root port: the switches the path crosses (a switch counted
    once for its upstream and downstream ports) decide PIX (one) or PXB (more).
    """
    if a == b:
        return Relation.X
    da, db = topology.device(a), topology.device(b)
    if da.root != db.root:
        return Relation.NODE if da.numa_node == db.numa_node else Relation.SYS
    if da.chain[0] != db.chain[0]:
        return Relation.PHB
    common = 0
    for x, y in zip(da.chain, db.chain, strict=False):
        if x != y:
            break
        common += 1
    # Bridges on the path: those below the common ancestor on both sides, and the ancestor.
    crossed = set(da.chain[common:-1]) | set(db.chain[common:-1]) | {da.chain[common - 1]}
    crossed.discard(a)
    crossed.discard(b)
    switches = {switch_of(topology, bridge) for bridge in crossed}
    switches.discard(None)
    return Relation.PIX if len(switches) <= 1 else Relation.PXB


def affinity(
    topology: Topology,
    a: str,
    b: str,
    nvlinks: Mapping[frozenset[str], int] | None = None,
) -> str:
    """The ``nvidia-smi topo -m`` cell for ``a`` and ``b``: ``NV#`` when ``nvlinks`` gives the
    pair a positive count of NVLinks, otherwise the PCIe relation."""
    if a != b and nvlinks:
        count = nvlinks.get(frozenset((a, b)), 0)
        if count > 0:
            return f"NV{count}"
    return relation(topology, a, b).value


def format_cpulist(cpus: Iterable[int]) -> str:
    """``0-55,112-167`` from CPU numbers (the kernel's cpulist form)."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


#: The ``pci`` source's records: the node's PCIe tree.
PCI = SourceKey("pci", Topology)
