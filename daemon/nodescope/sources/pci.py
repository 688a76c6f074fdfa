"""PCIe topology, link state and AER counters from sysfs.

Reads, under the sysfs root:

* ``bus/pci/devices/<BDF>`` — one symlink per function; its realpath
  ``devices/pciDDDD:BB/<root port>/.../<BDF>`` is the chain of bridges above it
  (``drivers/pci/probe.c``, host bridge name ``"pci%04x:%02x"``);
* per function (``drivers/pci/pci-sysfs.c``): ``vendor``, ``device`` (``0x%04x``), ``class``
  (``0x%06x``), ``numa_node`` (``%d``, -1 unknown), ``local_cpulist``,
  ``{current,max}_link_speed`` (``"32.0 GT/s PCIe"``, ``"8 GT/s"`` before Linux 5.7,
  ``"Unknown"``), ``{current,max}_link_width`` (``%u``), ``power/runtime_status``;
* ``aer_dev_{correctable,fatal,nonfatal}`` (``drivers/pci/pcie/aer.c``,
  ``Documentation/ABI/testing/sysfs-bus-pci-devices-aer_stats``);
* the OS names of functions: ``class/infiniband/*/device``, ``class/nvme/*/device`` (links to
  the PCI function) and ``<function>/net/*``;
* ``devices/system/node/node*/cpulist``.

Formats, pitfalls and the walk are in ``docs/datasources.md`` §2, §4 and §7.

Cost: the tree changes only on hotplug, so :class:`PciSource` keeps the walked structure
(realpaths, ids, class, NUMA placement, which files exist) and on each run reads only what
changes — current link speed/width and the AER files — unless the set of entries in
``bus/pci/devices`` changed. A runtime-suspended function's link files are not read, because
reading them resumes the device.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from nodescope.errors import ParseError
from nodescope.model.topology import (
    AerCounter,
    AerRecord,
    DeviceClass,
    LinkState,
    NumaNode,
    PciDevice,
    PciRoot,
    PortRole,
    Topology,
    classify,
    is_pci_bridge,
)
from nodescope.roots import Roots
from nodescope.sources.base import read_optional, read_text
from nodescope.sources.udev import topology_generation

SOURCE_NAME = "pci"

BDF_RE = re.compile(r"^([0-9a-f]{4,8}):([0-9a-f]{2}):([0-1][0-9a-f])\.([0-7])$")
ROOT_RE = re.compile(r"^pci([0-9a-f]{4,8}):([0-9a-f]{2})$")
_SPEED_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?) GT/s(?: PCIe)?$")
_NUMBER_RE = re.compile(r"^[0-9]+$")

AER_SEVERITIES = ("correctable", "fatal", "nonfatal")
_AER_TOTALS = {
    "correctable": "TOTAL_ERR_COR",
    "fatal": "TOTAL_ERR_FATAL",
    "nonfatal": "TOTAL_ERR_NONFATAL",
}

#: More CPUs than any kernel supports (NR_CPUS tops out at 8192): a cpulist beyond this is
#: garbage, not a machine.
MAX_CPUS = 1 << 16


# --- parsers ----------------------------------------------------------------------------------


def _one_line(text: str, source: str) -> str:
    value = text.strip()
    if "\n" in value:
        raise ParseError(source, "expected a single line", 2)
    return value


def parse_link_speed(text: str, source: str = "link_speed") -> float | None:
    """``current_link_speed``/``max_link_speed``: GT/s, or ``None`` for ``Unknown``."""
    value = _one_line(text, source)
    if value == "Unknown":
        return None
    match = _SPEED_RE.match(value)
    if match is None:
        raise ParseError(source, f"not a link speed: {value!r}", 1)
    return float(match.group(1))


def parse_link_width(text: str, source: str = "link_width") -> int:
    """``current_link_width``/``max_link_width``: lanes (0 when the link is down)."""
    value = _one_line(text, source)
    if not _NUMBER_RE.match(value) or len(value) > 3:
        raise ParseError(source, f"not a link width: {value!r}", 1)
    return int(value)


def _parse_hex(text: str, source: str, bits: int) -> int:
    value = _one_line(text, source)
    if not value.startswith("0x") or not re.fullmatch(r"[0-9a-fA-F]{1,8}", value[2:]):
        raise ParseError(source, f"not a hex number: {value!r}", 1)
    number = int(value, 16)
    if number >= 1 << bits:
        raise ParseError(source, f"{value} does not fit {bits} bits", 1)
    return number


def parse_hex_id(text: str, source: str = "id") -> int:
    """``vendor``, ``device``, ``subsystem_*``: ``0x%04x``."""
    return _parse_hex(text, source, 16)


def parse_class(text: str, source: str = "class") -> int:
    """``class``: ``0x%06x``, base class, subclass, programming interface."""
    return _parse_hex(text, source, 24)


def parse_numa_node(text: str, source: str = "numa_node") -> int | None:
    """``numa_node``: the node, ``None`` for -1 (no affinity known, e.g. in most VMs)."""
    value = _one_line(text, source)
    if not re.fullmatch(r"-?[0-9]{1,5}", value):
        raise ParseError(source, f"not a NUMA node: {value!r}", 1)
    node = int(value)
    if node < -1:
        raise ParseError(source, f"negative NUMA node {node}", 1)
    return None if node == -1 else node


def parse_cpulist(text: str, source: str = "cpulist") -> tuple[int, ...]:
    """A kernel CPU list (``0-55,112-167``; empty for none) as sorted CPU numbers."""
    value = _one_line(text, source)
    if not value:
        return ()
    cpus: set[int] = set()
    for part in value.split(","):
        match = re.fullmatch(r"([0-9]{1,6})(?:-([0-9]{1,6}))?", part)
        if match is None:
            raise ParseError(source, f"not a CPU range: {part!r}", 1)
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first or last >= MAX_CPUS:
            raise ParseError(source, f"bad CPU range {part!r}", 1)
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def parse_aer(text: str, severity: str, source: str = "aer_dev") -> AerRecord:
    """One ``aer_dev_<severity>`` file: ``<name> <count>`` lines and a ``TOTAL_ERR_*`` line.

    Names are split off the count with ``rsplit``: the ABI document's sample uses multi-word
    names (``Receiver Error 2``), 6.12 single words (``RxErr 2``).
    """
    if severity not in _AER_TOTALS:
        raise ParseError(source, f"unknown AER severity {severity!r}")
    counters: list[AerCounter] = []
    total: int | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped:
            continue
        parts = stripped.rsplit(None, 1)
        if len(parts) != 2 or not _NUMBER_RE.match(parts[1]):
            raise ParseError(source, f"expected '<name> <count>', got {stripped!r}", number)
        name, count_text = parts
        count = int(count_text)
        if count >= 1 << 64:
            raise ParseError(source, f"count {count} exceeds 64 bits", number)
        if name.startswith("TOTAL_ERR_"):
            if name != _AER_TOTALS[severity]:
                raise ParseError(source, f"{name} in a {severity} file", number)
            total = count
        else:
            counters.append(AerCounter(name, count))
    return AerRecord(severity, tuple(counters), total)


def parse_device_path(path: str, source: str = "realpath") -> tuple[str, tuple[str, ...]]:
    """The host bridge and bridge chain of a function from its sysfs realpath.

    ``/sys/devices/pci0000:17/0000:17:01.0/0000:18:00.0`` -> ``("pci0000:17",
    ("0000:17:01.0", "0000:18:00.0"))``. The last host bridge on the path counts, so
    functions behind a VMD controller (which opens its own ``pci10000:e0`` domain below a
    BDF) belong to that domain.
    """
    parts = [p for p in path.split("/") if p]
    root_index = None
    for index, part in enumerate(parts):
        if ROOT_RE.match(part):
            root_index = index
    if root_index is None:
        raise ParseError(source, f"no pciDDDD:BB host bridge in {path!r}")
    chain = tuple(p for p in parts[root_index + 1 :] if BDF_RE.match(p))
    if not chain or chain[-1] != parts[-1]:
        raise ParseError(source, f"{path!r} does not end in a PCI function")
    return parts[root_index], chain


def parse_runtime_status(text: str, source: str = "runtime_status") -> str:
    """``power/runtime_status``: ``active``, ``suspended``, ``suspending``, ``resuming``,
    ``error`` or ``unsupported`` (``drivers/base/power/sysfs.c``)."""
    value = _one_line(text, source)
    if value not in {"active", "suspended", "suspending", "resuming", "error", "unsupported"}:
        raise ParseError(source, f"unknown runtime status {value!r}", 1)
    return value


# --- reader -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Static:
    """What a walk learns about one function and what does not change until hotplug."""

    device: PciDevice
    directory: Path
    has_current_link: bool
    aer_severities: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _Structure:
    roots: Roots
    entries: tuple[str, ...]
    functions: tuple[_Static, ...]
    host_bridges: tuple[PciRoot, ...]
    numa_nodes: tuple[NumaNode, ...]


def _devices_dir(roots: Roots) -> Path:
    return roots.sysfs / "bus" / "pci" / "devices"


def _list_entries(roots: Roots) -> tuple[str, ...]:
    return tuple(sorted(e for e in os.listdir(_devices_dir(roots)) if BDF_RE.match(e)))


def _role(chain: tuple[str, ...], bridge: bool) -> PortRole:
    position = len(chain) - 1
    if not bridge:
        return PortRole.RC_INTEGRATED_ENDPOINT if position == 0 else PortRole.ENDPOINT
    if position == 0:
        return PortRole.ROOT_PORT
    # Below a root port, bridges alternate: switch upstream port, downstream port, ...
    return PortRole.UPSTREAM_PORT if position % 2 == 1 else PortRole.DOWNSTREAM_PORT


def _read_numa_nodes(roots: Roots) -> tuple[NumaNode, ...]:
    base = roots.sysfs / "devices" / "system" / "node"
    try:
        names = os.listdir(base)
    except OSError:
        return ()
    nodes: list[NumaNode] = []
    for name in names:
        match = re.fullmatch(r"node([0-9]+)", name)
        if match is None:
            continue
        path = base / name / "cpulist"
        text = read_optional(path)
        cpus = parse_cpulist(text, str(path)) if text is not None else ()
        nodes.append(NumaNode(int(match.group(1)), cpus))
    return tuple(sorted(nodes, key=lambda n: n.node))


def _required(directory: Path, name: str) -> tuple[str, str]:
    path = directory / name
    return read_text(path), str(path)


def _walk(roots: Roots, entries: tuple[str, ...]) -> _Structure:
    devices_dir = _devices_dir(roots)
    sysfs_real = os.path.realpath(roots.sysfs)
    found: list[tuple[str, tuple[str, ...], Path]] = []
    for entry in entries:
        real = os.path.realpath(devices_dir / entry)
        relative = os.path.relpath(real, sysfs_real)
        root, chain = parse_device_path(relative, str(devices_dir / entry))
        found.append((root, chain, Path(real)))

    children: dict[str, list[str]] = {}
    root_children: dict[str, list[str]] = {}
    for root, chain, _ in found:
        if len(chain) == 1:
            root_children.setdefault(root, []).append(chain[0])
        else:
            children.setdefault(chain[-2], []).append(chain[-1])

    functions: list[_Static] = []
    for root, chain, directory in found:
        bdf = chain[-1]

        vendor = parse_hex_id(*_required(directory, "vendor"))
        device_id = parse_hex_id(*_required(directory, "device"))
        class_code = parse_class(*_required(directory, "class"))
        numa_path = directory / "numa_node"
        numa_text = read_optional(numa_path)
        numa = parse_numa_node(numa_text, str(numa_path)) if numa_text is not None else None
        cpus_path = directory / "local_cpulist"
        cpus_text = read_optional(cpus_path)
        cpus = parse_cpulist(cpus_text, str(cpus_path)) if cpus_text is not None else None

        max_speed_path = directory / "max_link_speed"
        max_speed_text = read_optional(max_speed_path)
        max_width_path = directory / "max_link_width"
        max_width_text = read_optional(max_width_path)
        has_current = (directory / "current_link_speed").exists()
        link: LinkState | None = None
        if max_speed_text is not None or max_width_text is not None or has_current:
            link = LinkState(
                current_speed_gts=None,
                current_width=None,
                max_speed_gts=(
                    parse_link_speed(max_speed_text, str(max_speed_path))
                    if max_speed_text is not None
                    else None
                ),
                max_width=(
                    parse_link_width(max_width_text, str(max_width_path))
                    if max_width_text is not None
                    else None
                ),
            )
        aer = tuple(s for s in AER_SEVERITIES if (directory / f"aer_dev_{s}").exists())
        bridge = is_pci_bridge(class_code)
        record = PciDevice(
            bdf=bdf,
            root=root,
            chain=chain,
            vendor_id=vendor,
            device_id=device_id,
            class_code=class_code,
            device_class=classify(class_code, vendor),
            role=_role(chain, bridge),
            numa_node=numa,
            local_cpus=cpus,
            link=link,
            children=tuple(sorted(children.get(bdf, ()))),
        )
        # RC-integrated functions have the link files but no link (``Unknown``/0 for their
        # capabilities): never worth a read per run.
        linkless = link is not None and link.max_speed_gts is None and not link.max_width
        functions.append(_Static(record, directory, has_current and not linkless, aer))

    host_bridges = []
    for name in sorted({root for root, _, _ in found}):
        match = ROOT_RE.match(name)
        assert match is not None  # parse_device_path only returns matching names
        host_bridges.append(
            PciRoot(
                name=name,
                domain=int(match.group(1), 16),
                bus=int(match.group(2), 16),
                children=tuple(sorted(root_children.get(name, ()))),
            )
        )
    return _Structure(
        roots=roots,
        entries=entries,
        functions=tuple(functions),
        host_bridges=tuple(host_bridges),
        numa_nodes=_read_numa_nodes(roots),
    )


def _link_targets(base: Path) -> dict[str, list[str]]:
    """``class/<x>/<name>/device`` links, as BDF -> names (non-PCI targets are skipped)."""
    result: dict[str, list[str]] = {}
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return result
    for name in names:
        target = os.path.basename(os.path.realpath(base / name / "device"))
        if BDF_RE.match(target):
            result.setdefault(target, []).append(name)
    return result


def _net_interfaces(directory: Path) -> tuple[str, ...]:
    try:
        return tuple(sorted(os.listdir(directory / "net")))
    except OSError:
        return ()


_NIC_CLASSES = (DeviceClass.ETHERNET, DeviceClass.INFINIBAND)


def _refresh(structure: _Structure) -> Topology:
    """The topology with the link state, AER counters and OS names read now."""
    roots = structure.roots
    ib = _link_targets(roots.sysfs / "class" / "infiniband")
    nvme = _link_targets(roots.sysfs / "class" / "nvme")
    devices: list[PciDevice] = []
    for static in structure.functions:
        dev = static.device
        directory = static.directory
        link = dev.link
        if link is not None and static.has_current_link:
            status_path = directory / "power" / "runtime_status"
            status_text = read_optional(status_path)
            suspended = (
                status_text is not None
                and parse_runtime_status(status_text, str(status_path)) == "suspended"
            )
            if not suspended:
                speed_path = directory / "current_link_speed"
                width_path = directory / "current_link_width"
                speed_text = read_optional(speed_path)
                width_text = read_optional(width_path)
                link = replace(
                    link,
                    current_speed_gts=(
                        parse_link_speed(speed_text, str(speed_path))
                        if speed_text is not None
                        else None
                    ),
                    current_width=(
                        parse_link_width(width_text, str(width_path))
                        if width_text is not None
                        else None
                    ),
                )
        aer: list[AerRecord] = []
        for severity in static.aer_severities:
            path = directory / f"aer_dev_{severity}"
            text = read_optional(path)
            if text is not None:
                aer.append(parse_aer(text, severity, str(path)))
        nets = _net_interfaces(directory) if dev.device_class in _NIC_CLASSES else ()
        devices.append(
            replace(
                dev,
                link=link,
                aer=tuple(aer),
                net_interfaces=nets,
                ib_devices=tuple(ib.get(dev.bdf, ())),
                nvme_controllers=tuple(nvme.get(dev.bdf, ())),
            )
        )
    return Topology(
        devices=tuple(devices),
        roots=structure.host_bridges,
        numa_nodes=structure.numa_nodes,
    )


def read_topology(roots: Roots) -> Topology:
    """Walk and read the whole PCI tree once (no cache: for the CLI and tests)."""
    return _refresh(_walk(roots, _list_entries(roots)))


class PciSource:
    """The ``pci`` source: walks the tree on the first run and after hotplug, otherwise
    re-reads only the link state, AER counters and OS names. Hotplug is a change in the
    listing of ``bus/pci/devices`` or a device event of the udev monitor
    (:func:`nodescope.sources.udev.mark_topology_stale`: a function replaced at the same
    address, a driver bound or unbound)."""

    name = SOURCE_NAME

    def __init__(self) -> None:
        self._structure: _Structure | None = None
        self._generation = -1
        self.walks = 0

    def collect(self, roots: Roots) -> Topology:
        entries = _list_entries(roots)
        generation = topology_generation()
        cached = self._structure
        if (
            cached is None
            or cached.roots != roots
            or cached.entries != entries
            or generation != self._generation
        ):
            cached = _walk(roots, entries)
            self._structure = cached
            self._generation = generation
            self.walks += 1
        return _refresh(cached)

    def close(self) -> None:
        self._structure = None


def make_source() -> PciSource:
    return PciSource()


__all__ = [
    "PciSource",
    "make_source",
    "parse_aer",
    "parse_class",
    "parse_cpulist",
    "parse_device_path",
    "parse_hex_id",
    "parse_link_speed",
    "parse_link_width",
    "parse_numa_node",
    "parse_runtime_status",
    "read_topology",
]
