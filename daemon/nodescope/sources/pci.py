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
(realpaths, ids, class, capabilities, NUMA placement, which files exist) and on each run
reads only what changes — runtime status, current link speed/width, the AER files and the OS
names — unless the set of entries in ``bus/pci/devices`` changed, udev reported a device
event, or ``slow_every`` runs passed. A function whose files read the same bytes as last run
keeps its record, and a run where no function changed returns the previous topology object.
A runtime-suspended function's link files are not read, because reading them resumes the
device.

A function hot-unplugged in the middle of a walk, or one whose ``vendor``, ``device`` or
``class`` cannot be read (refused: a FIFO or device where the attribute should be) or parsed,
is left out with every function below it, so the tree stays whole; an optional attribute
that is refused or malformed (``numa_node``, a link speed, an AER file) is absent. Both are
counted in ``Topology.skipped``; only an unreadable ``bus/pci/devices`` takes the source down.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from nodescope.errors import ParseError
from nodescope.fileio import SYSFS_ATTRIBUTE, FileTooLarge, NotARegularFile, read_bytes
from nodescope.model.skips import SkipTally
from nodescope.model.topology import (
    PEER_MODULES,
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
from nodescope.sources.base import TopologyGeneration
from nodescope.sources.spec import SourceSpec

SOURCE_NAME = "pci"

T = TypeVar("T")

# Reasons a record was skipped (nodescope_source_records_skipped_total{reason}).
#: a ``bus/pci/devices`` entry whose realpath is not below a ``pciDDDD:BB`` host bridge
SKIP_FUNCTION_PATH_UNPARSABLE = "function_path_unparsable"
#: a function whose ``vendor``, ``device`` or ``class`` is gone, refused or malformed
SKIP_FUNCTION_UNREADABLE = "function_unreadable"
#: a function below one that was skipped: its chain would name a function not in the tree
SKIP_FUNCTION_BELOW_SKIPPED = "function_below_skipped"
#: an optional attribute (``numa_node``, ``*_link_*``, ``aer_dev_*``...) that does not parse
SKIP_ATTRIBUTE_UNPARSABLE = "attribute_unparsable"
#: an attribute that is not a regular file or is over its size cap, refused unread
SKIP_FILE_REFUSED = "file_refused"

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


#: PCIe extended capabilities start after the 256 bytes of conventional configuration space.
EXTENDED_CAPABILITIES = 0x100
#: Access Control Services' extended capability ID (PCIe Base Specification §7.7.8).
ACS_CAPABILITY_ID = 0x000D
#: ACS Control register, bit 2: P2P Request Redirect.
ACS_P2P_REQUEST_REDIRECT = 1 << 2


def parse_acs_redirect(data: bytes, source: str = "config") -> bool | None:
    """Whether a port's ACS sends peer-to-peer requests up to the root complex, from the
    bytes of its sysfs ``config`` file: the extended capability list is followed from offset
    0x100 (each header: capability ID in bits 0-15, next offset in bits 20-31) to the ACS
    capability, whose control register is the 16 bits at its offset + 6.

    ``None`` when the file holds only conventional space (the 64 bytes an unprivileged reader
    gets, or 256 for a PCI device) or the port has no ACS capability. A list that loops or
    points outside the file raises :class:`ParseError`."""
    if len(data) < EXTENDED_CAPABILITIES + 4:
        return None
    offset = EXTENDED_CAPABILITIES
    seen: set[int] = set()
    while offset:
        if offset in seen or offset < EXTENDED_CAPABILITIES or offset % 4 or offset + 8 > len(data):
            raise ParseError(source, f"extended capability list broken at offset {offset:#x}")
        seen.add(offset)
        header = int.from_bytes(data[offset : offset + 4], "little")
        if header in (0, 0xFFFFFFFF):
            return None  # no extended capabilities (all zeros, or all ones: not readable)
        if header & 0xFFFF == ACS_CAPABILITY_ID:
            control = int.from_bytes(data[offset + 6 : offset + 8], "little")
            return bool(control & ACS_P2P_REQUEST_REDIRECT)
        offset = (header >> 20) & 0xFFF
    return None


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

#: ``pci`` runs between two walks of the whole tree when ``bus/pci/devices`` lists the same
#: functions (at the 30 s default interval, every 5 minutes): ids, class, capabilities and
#: NUMA placement change only on hotplug, which a changed listing or a udev event already
#: catches; the periodic walk catches the rest (a function replaced at the same address
#: while no udev monitor runs).
SLOW_EVERY = 10


@dataclass(frozen=True, slots=True)
class _Static:
    """What a walk learns about one function and what does not change until hotplug.

    ``device`` has the capabilities (``max_link_*``) but no current link state, AER counters
    or OS names; the paths are the files read on every run.
    """

    device: PciDevice
    directory: str
    #: ``power/runtime_status``, ``current_link_speed``, ``current_link_width``; None when the
    #: function has no link worth reading.
    link_files: tuple[str, str, str] | None
    #: (severity, path) of the ``aer_dev_*`` files present.
    aer_files: tuple[tuple[str, str], ...]
    #: ``<function>/net`` for network functions, whose interfaces are listed every run.
    net_dir: str | None


@dataclass(frozen=True, slots=True)
class _Structure:
    roots: Roots
    entries: tuple[str, ...]
    functions: tuple[_Static, ...]
    host_bridges: tuple[PciRoot, ...]
    numa_nodes: tuple[NumaNode, ...]
    peer_modules: frozenset[str]


#: What one run reads of a function, as read: runtime status, current link speed and width
#: (None when absent or not read), the AER files' bytes, network interfaces, IB devices and
#: NVMe controllers. Equal tuples mean an equal :class:`PciDevice`.
_Raw = tuple[
    bytes | None,
    bytes | None,
    bytes | None,
    tuple[bytes | None, ...],
    tuple[str, ...],
    tuple[str, ...],
    tuple[str, ...],
]


@dataclass(slots=True)
class _Entry:
    """The last run's reading of one function and the record built from it."""

    static: _Static
    raw: _Raw | None = None
    device: PciDevice | None = None
    #: The last ``runtime_status`` bytes and whether they said ``suspended``.
    status: bytes | None = None
    suspended: bool = False


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


def _read_attribute(path: str, tally: SkipTally) -> bytes | None:
    """A sysfs attribute's bytes; ``None`` when absent or unreadable, and when refused (a FIFO
    or device planted where the attribute should be), which ``tally`` counts."""
    try:
        return read_bytes(path, SYSFS_ATTRIBUTE)
    except (NotARegularFile, FileTooLarge):
        tally.skip(SKIP_FILE_REFUSED, path)
        return None
    except OSError:
        return None


def _parsed(
    text: str | None, path: str, parse: Callable[[str, str], T], tally: SkipTally
) -> T | None:
    """``parse(text)``; ``None`` for no text, and (counted) for text that does not parse."""
    if text is None:
        return None
    try:
        return parse(text, path)
    except ParseError as exc:
        tally.skip(SKIP_ATTRIBUTE_UNPARSABLE, str(exc))
        return None


def _parsed_bytes(
    data: bytes, path: str, parse: Callable[[bytes, str], T], tally: SkipTally
) -> T | None:
    """``parse(data)``; ``None`` (counted) for bytes that do not parse."""
    try:
        return parse(data, path)
    except ParseError as exc:
        tally.skip(SKIP_ATTRIBUTE_UNPARSABLE, str(exc))
        return None


def _physical_function(directory: str) -> str | None:
    """The BDF ``physfn`` points to (an SR-IOV virtual function's physical function), when it
    is a link to a function's directory; ``None`` otherwise."""
    try:
        target = os.readlink(f"{directory}/physfn")
    except OSError:
        return None
    name = os.path.basename(target.rstrip("/"))
    return name if BDF_RE.match(name) else None


def _peer_modules(roots: Roots) -> frozenset[str]:
    """The modules of :data:`PEER_MODULES` loaded: a loaded module has ``/sys/module/NAME``."""
    return frozenset(m for m in PEER_MODULES if os.path.isdir(roots.sysfs / "module" / m))


def _read_text(path: str, tally: SkipTally) -> str | None:
    data = _read_attribute(path, tally)
    return None if data is None else _text(data)


def _read_numa_nodes(roots: Roots, tally: SkipTally) -> tuple[NumaNode, ...]:
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
        path = str(base / name / "cpulist")
        cpus = _parsed(_read_text(path, tally), path, parse_cpulist, tally)
        nodes.append(NumaNode(int(match.group(1)), cpus or ()))
    return tuple(sorted(nodes, key=lambda n: n.node))


def _required(directory: str, name: str) -> tuple[str, str]:
    """``(text, path)`` of an attribute every function has; ``OSError`` when it is gone
    (the function was unplugged) or refused."""
    path = f"{directory}/{name}"
    return _text(read_bytes(path, SYSFS_ATTRIBUTE)), path


def _identity(directory: str) -> tuple[int, int, int]:
    """``vendor``, ``device`` and ``class``; ``OSError`` or :class:`ParseError` otherwise."""
    return (
        parse_hex_id(*_required(directory, "vendor")),
        parse_hex_id(*_required(directory, "device")),
        parse_class(*_required(directory, "class")),
    )


def _function_dir(devices_dir: str, devices_real: str, sysfs_real: str, entry: str) -> str:
    """The realpath of ``bus/pci/devices/<entry>``.

    The kernel's link is relative (``../../../devices/pci0000:00/0000:00:01.0/0000:18:00.0``)
    and every directory it names below ``devices/`` is a directory, not a link, so joining
    its text to the resolved ``bus/pci/devices`` is the realpath without an ``lstat`` per
    component (the walk does this for every function). Anything else is resolved.
    """
    link = f"{devices_dir}/{entry}"
    try:
        text = os.readlink(link)
    except OSError:
        return os.path.realpath(link)
    real = os.path.normpath(os.path.join(devices_real, text))
    if os.path.isabs(text) or not real.startswith(f"{sysfs_real}/devices/"):
        return os.path.realpath(link)
    return real


_NIC_CLASSES = (DeviceClass.ETHERNET, DeviceClass.INFINIBAND)


def _walk(roots: Roots, entries: tuple[str, ...], tally: SkipTally) -> _Structure:
    devices_dir = str(_devices_dir(roots))
    devices_real = os.path.realpath(devices_dir)
    sysfs_real = os.path.realpath(roots.sysfs)
    placed: list[tuple[str, tuple[str, ...], str, tuple[int, int, int]]] = []
    left_out: set[str] = set()
    for entry in entries:
        real = _function_dir(devices_dir, devices_real, sysfs_real, entry)
        relative = os.path.relpath(real, sysfs_real)
        try:
            root, chain = parse_device_path(relative, f"{devices_dir}/{entry}")
        except ParseError as exc:
            tally.skip(SKIP_FUNCTION_PATH_UNPARSABLE, str(exc))
            left_out.add(entry)
            continue
        try:
            identity = _identity(real)
        except (OSError, ParseError) as exc:
            tally.skip(SKIP_FUNCTION_UNREADABLE, str(exc))
            left_out.add(chain[-1])
            continue
        placed.append((root, chain, real, identity))
    # A function below one left out goes too: its chain would name a bridge not in the tree.
    found: list[tuple[str, tuple[str, ...], str, tuple[int, int, int]]] = []
    for item in placed:
        chain = item[1]
        if left_out.isdisjoint(chain[:-1]):
            found.append(item)
        else:
            tally.skip(SKIP_FUNCTION_BELOW_SKIPPED, item[2])

    children: dict[str, list[str]] = {}
    root_children: dict[str, list[str]] = {}
    for root, chain, _, _ in found:
        if len(chain) == 1:
            root_children.setdefault(root, []).append(chain[0])
        else:
            children.setdefault(chain[-2], []).append(chain[-1])

    functions: list[_Static] = []
    # Functions of one NUMA node share their CPU list: parse each text once per walk.
    cpulists: dict[str, tuple[int, ...]] = {}
    for root, chain, directory, (vendor, device_id, class_code) in found:
        bdf = chain[-1]

        numa_path = f"{directory}/numa_node"
        numa = _parsed(_read_text(numa_path, tally), numa_path, parse_numa_node, tally)
        cpus_path = f"{directory}/local_cpulist"
        cpus_text = _read_text(cpus_path, tally)
        cpus = None
        if cpus_text is not None:
            cpus = cpulists.get(cpus_text)
            if cpus is None:
                cpus = _parsed(cpus_text, cpus_path, parse_cpulist, tally)
                if cpus is not None:
                    cpulists[cpus_text] = cpus

        max_speed_path = f"{directory}/max_link_speed"
        max_speed_text = _read_text(max_speed_path, tally)
        max_width_path = f"{directory}/max_link_width"
        max_width_text = _read_text(max_width_path, tally)
        has_current = os.path.exists(f"{directory}/current_link_speed")
        link: LinkState | None = None
        if max_speed_text is not None or max_width_text is not None or has_current:
            link = LinkState(
                current_speed_gts=None,
                current_width=None,
                max_speed_gts=_parsed(max_speed_text, max_speed_path, parse_link_speed, tally),
                max_width=_parsed(max_width_text, max_width_path, parse_link_width, tally),
            )
        base = directory
        aer = tuple(
            (s, f"{base}/aer_dev_{s}")
            for s in AER_SEVERITIES
            if os.path.exists(f"{base}/aer_dev_{s}")
        )
        bridge = is_pci_bridge(class_code)
        role = _role(chain, bridge)
        acs_redirect = None
        if role in (PortRole.ROOT_PORT, PortRole.DOWNSTREAM_PORT):
            config_path = f"{directory}/config"
            config = _read_attribute(config_path, tally)
            if config is not None:
                acs_redirect = _parsed_bytes(config, config_path, parse_acs_redirect, tally)
        record = PciDevice(
            bdf=bdf,
            root=root,
            chain=chain,
            vendor_id=vendor,
            device_id=device_id,
            class_code=class_code,
            device_class=classify(class_code, vendor),
            role=role,
            numa_node=numa,
            local_cpus=cpus,
            link=link,
            children=tuple(sorted(children.get(bdf, ()))),
            acs_redirect=acs_redirect,
            physical_function=_physical_function(directory),
        )
        # RC-integrated functions have the link files but no link (``Unknown``/0 for their
        # capabilities): never worth a read per run.
        linkless = link is not None and link.max_speed_gts is None and not link.max_width
        link_files = None
        if link is not None and has_current and not linkless:
            link_files = (
                f"{base}/power/runtime_status",
                f"{base}/current_link_speed",
                f"{base}/current_link_width",
            )
        net_dir = f"{base}/net" if record.device_class in _NIC_CLASSES else None
        functions.append(_Static(record, base, link_files, aer, net_dir))

    host_bridges = []
    for name in sorted({root for root, _, _, _ in found}):
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
        numa_nodes=_read_numa_nodes(roots, tally),
        peer_modules=_peer_modules(roots),
    )


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _link_target(base: str, name: str) -> str:
    """The basename of what ``<base>/<name>/device`` resolves to, from the two links' texts.

    The kernel's ``device`` link names the function (``../../../0000:18:00.0``); a relative
    link up the tree (``../..``, as from ``<function>/nvme/nvme0``) is joined to the class
    link's text. Path arithmetic is exact here because the directories below ``devices/``
    are directories, not links; anything else is resolved the slow way.
    """
    device = f"{base}/{name}/device"
    try:
        text = os.readlink(device)
        target = os.path.basename(text)
        if BDF_RE.match(target):
            return target
        joined = os.path.join(os.readlink(f"{base}/{name}"), text)
        target = os.path.basename(os.path.normpath(joined))
        if BDF_RE.match(target):
            return target
    except OSError:
        pass
    return os.path.basename(os.path.realpath(device))


def _link_targets(base: Path) -> dict[str, tuple[str, ...]]:
    """``class/<x>/<name>/device`` links, as BDF -> names (non-PCI targets are skipped)."""
    result: dict[str, tuple[str, ...]] = {}
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return result
    directory = str(base)
    for name in names:
        target = _link_target(directory, name)
        if BDF_RE.match(target):
            result[target] = (*result.get(target, ()), name)
    return result


def _listing(directory: str | None) -> tuple[str, ...]:
    if directory is None:
        return ()
    try:
        return tuple(sorted(os.listdir(directory)))
    except OSError:
        return ()


def _read_function(
    entry: _Entry,
    ib: dict[str, tuple[str, ...]],
    nvme: dict[str, tuple[str, ...]],
    tally: SkipTally,
) -> _Raw:
    """What changes of one function, as read now (the attribute files' bytes, undecoded: most
    runs only compare them with the last run's). A runtime-suspended function's link files
    are not read: reading them would resume it; nor are they with a status that does not
    parse, for the same reason."""
    static = entry.static
    status = speed = width = None
    if static.link_files is not None:
        status_path, speed_path, width_path = static.link_files
        status = _read_attribute(status_path, tally)
        if status != entry.status:
            state = _parsed(
                None if status is None else _text(status),
                status_path,
                parse_runtime_status,
                tally,
            )
            entry.suspended = status is not None and state in (None, "suspended")
            entry.status = status
        if not entry.suspended:
            speed = _read_attribute(speed_path, tally)
            width = _read_attribute(width_path, tally)
    bdf = static.device.bdf
    return (
        status,
        speed,
        width,
        tuple(_read_attribute(path, tally) for _, path in static.aer_files),
        _listing(static.net_dir),
        ib.get(bdf, ()),
        nvme.get(bdf, ()),
    )


def _parse_aer_of(severity: str) -> Callable[[str, str], AerRecord]:
    return lambda text, source: parse_aer(text, severity, source)


def _build(static: _Static, raw: _Raw, tally: SkipTally) -> PciDevice:
    """The function's record from the static part and one run's reading (pure but for the
    paths in the skipped records' examples)."""
    _status, speed, width, aer_texts, nets, ib, nvme = raw
    dev = static.device
    link = dev.link
    if link is not None and static.link_files is not None:
        _, speed_path, width_path = static.link_files
        link = LinkState(
            current_speed_gts=_parsed(
                None if speed is None else _text(speed), speed_path, parse_link_speed, tally
            ),
            current_width=_parsed(
                None if width is None else _text(width), width_path, parse_link_width, tally
            ),
            max_speed_gts=link.max_speed_gts,
            max_width=link.max_width,
        )
    aer: list[AerRecord] = []
    for (severity, path), text in zip(static.aer_files, aer_texts, strict=True):
        record = _parsed(
            None if text is None else _text(text), path, _parse_aer_of(severity), tally
        )
        if record is not None:
            aer.append(record)
    return replace(
        dev, link=link, aer=tuple(aer), net_interfaces=nets, ib_devices=ib, nvme_controllers=nvme
    )


def _adopt(structure: _Structure, entries: dict[str, _Entry]) -> dict[str, _Entry]:
    """Entries for a freshly walked structure, keeping the last reading of every function
    whose static part did not change (so an unchanged tree gives the same records)."""
    adopted: dict[str, _Entry] = {}
    for static in structure.functions:
        old = entries.get(static.device.bdf)
        if old is not None and old.static == static:
            adopted[static.device.bdf] = old
        else:
            adopted[static.device.bdf] = _Entry(static)
    return adopted


def _refresh(
    structure: _Structure,
    entries: dict[str, _Entry],
    previous: Topology | None,
    tally: SkipTally,
) -> Topology:
    """The topology with the link state, AER counters and OS names read now; ``previous``
    itself when nothing differs from the run that built it and neither run skipped anything
    (the collector counts a record's ``skipped`` once per run that returns it)."""
    roots = structure.roots
    ib = _link_targets(roots.sysfs / "class" / "infiniband")
    nvme = _link_targets(roots.sysfs / "class" / "nvme")
    devices: list[PciDevice] = []
    changed = False
    for static in structure.functions:
        entry = entries[static.device.bdf]
        raw = _read_function(entry, ib, nvme, tally)
        device = entry.device
        if device is None or raw != entry.raw:
            device = _build(static, raw, tally)
            entry.raw, entry.device = raw, device
            changed = True
        devices.append(device)
    skipped = tally.freeze()
    if (
        previous is not None
        and not changed
        and not skipped
        and not previous.skipped
        and previous.roots == structure.host_bridges
        and previous.numa_nodes == structure.numa_nodes
        and previous.peer_modules == structure.peer_modules
        and len(previous.devices) == len(devices)
        and all(a is b for a, b in zip(previous.devices, devices, strict=True))
    ):
        return previous
    return Topology(
        devices=tuple(devices),
        roots=structure.host_bridges,
        numa_nodes=structure.numa_nodes,
        peer_modules=structure.peer_modules,
        skipped=skipped,
    )


def read_topology(roots: Roots) -> Topology:
    """Walk and read the whole PCI tree once (no cache: for the CLI and tests)."""
    tally = SkipTally()
    structure = _walk(roots, _list_entries(roots), tally)
    return _refresh(structure, _adopt(structure, {}), None, tally)


class PciSource:
    """The ``pci`` source: walks the tree on the first run, after hotplug and every
    :attr:`slow_every` runs, otherwise re-reads only the link state, AER counters and OS
    names. Hotplug is a change in the listing of ``bus/pci/devices`` or a move of
    ``topology``, which the ``udev`` source's monitor advances on a device event (a function
    replaced at the same address, a driver bound or unbound); without one given, nothing
    else moves it.

    A run that finds nothing changed returns the previous :class:`Topology` object, so
    what is derived from it can be kept by identity."""

    name = SOURCE_NAME

    def __init__(self, topology: TopologyGeneration | None = None) -> None:
        self.topology = TopologyGeneration() if topology is None else topology
        self._structure: _Structure | None = None
        self._entries: dict[str, _Entry] = {}
        self._topology: Topology | None = None
        self._generation = -1
        self._runs_since_walk = 0
        #: Runs between walks of an unchanged tree (1: every run).
        self.slow_every = SLOW_EVERY
        self.walks = 0

    def collect(self, roots: Roots) -> Topology:
        entries = _list_entries(roots)
        generation = self.topology.value
        cached = self._structure
        tally = SkipTally()
        self._runs_since_walk += 1
        if (
            cached is None
            or cached.roots != roots
            or cached.entries != entries
            or generation != self._generation
            or self._runs_since_walk >= self.slow_every
        ):
            if cached is not None and cached.roots != roots:
                self.close()
            cached = _walk(roots, entries, tally)
            self._entries = _adopt(cached, self._entries)
            self._structure = cached
            self._generation = generation
            self._runs_since_walk = 0
            self.walks += 1
        self._topology = _refresh(cached, self._entries, self._topology, tally)
        return self._topology

    def close(self) -> None:
        self._structure = None
        self._entries = {}
        self._topology = None


def make_source(topology: TopologyGeneration | None = None) -> PciSource:
    """The source; ``topology``: the generation the ``udev`` source advances."""
    return PciSource(topology)


SPEC = SourceSpec(
    name="pci",
    default_interval=30.0,
    help="PCIe tree, link speed/width, NUMA placement and AER counters from /sys/bus/pci",
    build=lambda inputs: make_source(topology=inputs.topology),
    rates=None,
    metric_area="nodescope_exporters.pci_metrics",
    sim_parts=frozenset({"pci_links"}),
    # A function hot-removed is judged while what used it is still in the reads.
    due_on_topology_change=True,
)


__all__ = [
    "SLOW_EVERY",
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
