"""Parser of ``lspci -vvv`` text, the hardware description of simulated nodes.

The format is pciutils' (``lspci.c`` ``show_device``/``show_verbose``, ``ls-caps.c``
``cap_express``/``cap_express_link``): a header line per function,

    ``[DDDD:]BB:DD.F <class name>[ [cccc]]: <vendor> <device>[ [vvvv:dddd]]``
    ``(rev RR) (prog-if PP [name])`` (one line)

then tab-indented attribute lines, and a blank line between functions. Read here: the class,
vendor and device names (ids when the capture shows them, with ``-nn`` or as
``Device 2330``), ``NUMA node:``, ``Bus: primary=.., secondary=.., subordinate=..`` of
bridges, the Express capability's port type and its ``LnkCap``/``LnkSta`` speed and width,
whether Advanced Error Reporting is present, the Access Control Services capability and
control registers (``ACSCap``/``ACSCtl``, ``ls-ecaps.c`` ``cap_acs``), and the driver in use.

Plain ``lspci -vvv`` prints names, not numbers. Class codes are mapped back from pci.ids
class names (:data:`CLASS_NAMES`), vendor and device ids from :data:`VENDOR_NAMES` and
:data:`DEVICE_NAMES`, small tables of the hardware in the captures we ship; a function whose
ids came from these tables has ``ids_inferred`` set.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass

from nodescope.errors import ParseError


class ExpressType(enum.StrEnum):
    """The PCIe capability's device/port type as lspci names it (``ls-caps.c``)."""

    ENDPOINT = "Endpoint"
    LEGACY_ENDPOINT = "Legacy Endpoint"
    ROOT_PORT = "Root Port"
    UPSTREAM_PORT = "Upstream Port"
    DOWNSTREAM_PORT = "Downstream Port"
    PCIE_TO_PCI_BRIDGE = "PCI-Express to PCI/PCI-X Bridge"
    PCI_TO_PCIE_BRIDGE = "PCI/PCI-X to PCI-Express Bridge"
    RC_INTEGRATED_ENDPOINT = "Root Complex Integrated Endpoint"
    RC_EVENT_COLLECTOR = "Root Complex Event Collector"
    UNKNOWN = "Unknown type"


#: Device/port type field (PCIe capability bits 7:4, ``include/uapi/linux/pci_regs.h``).
EXPRESS_TYPE_CODES: Mapping[ExpressType, int] = {
    ExpressType.ENDPOINT: 0x0,
    ExpressType.LEGACY_ENDPOINT: 0x1,
    ExpressType.ROOT_PORT: 0x4,
    ExpressType.UPSTREAM_PORT: 0x5,
    ExpressType.DOWNSTREAM_PORT: 0x6,
    ExpressType.PCIE_TO_PCI_BRIDGE: 0x7,
    ExpressType.PCI_TO_PCIE_BRIDGE: 0x8,
    ExpressType.RC_INTEGRATED_ENDPOINT: 0x9,
    ExpressType.RC_EVENT_COLLECTOR: 0xA,
}

#: pci.ids subclass names -> (base class, subclass). Where a subclass shares its base class's
#: name (``Bridge``, ``Network controller``), lspci printed the 0x80 "other" subclass: a
#: function whose subclass pci.ids does not know is printed as ``<base name> [bbss]``.
CLASS_NAMES: Mapping[str, int] = {
    "Non-VGA unclassified device": 0x0000,
    "SCSI storage controller": 0x0100,
    "IDE interface": 0x0101,
    "RAID bus controller": 0x0104,
    "ATA controller": 0x0105,
    "SATA controller": 0x0106,
    "Serial Attached SCSI controller": 0x0107,
    "Non-Volatile memory controller": 0x0108,
    "Mass storage controller": 0x0180,
    "Ethernet controller": 0x0200,
    "Infiniband controller": 0x0207,
    "Fabric controller": 0x0208,
    "Network controller": 0x0280,
    "VGA compatible controller": 0x0300,
    "3D controller": 0x0302,
    "Display controller": 0x0380,
    "Audio device": 0x0403,
    "Multimedia controller": 0x0480,
    "RAM memory": 0x0500,
    "Memory controller": 0x0580,
    "Host bridge": 0x0600,
    "ISA bridge": 0x0601,
    "PCI bridge": 0x0604,
    "CardBus bridge": 0x0607,
    "Bridge": 0x0680,
    "Serial controller": 0x0700,
    "Communication controller": 0x0780,
    "PIC": 0x0800,
    "IOMMU": 0x0806,
    "System peripheral": 0x0880,
    "USB controller": 0x0C03,
    "Fibre Channel": 0x0C04,
    "SMBus": 0x0C05,
    "IPMI Interface": 0x0C07,
    "Serial bus controller": 0x0C80,
    "Encryption controller": 0x1080,
    "Performance counters": 0x1101,
    "Signal processing controller": 0x1180,
    "Processing accelerators": 0x1200,
    "Unassigned class": 0xFF00,
}

#: pci.ids vendor names -> vendor id.
VENDOR_NAMES: Mapping[str, int] = {
    "NVIDIA Corporation": 0x10DE,
    "Mellanox Technologies": 0x15B3,
    "Intel Corporation": 0x8086,
    "Broadcom / LSI": 0x1000,
    "Broadcom Inc. and subsidiaries": 0x14E4,
    "Micron Technology Inc": 0x1344,
    "Samsung Electronics Co Ltd": 0x144D,
    "PMC-Sierra Inc.": 0x11F8,
    "PLDA": 0x1556,
    "Matrox Electronics Systems Ltd.": 0x102B,
    "ASPEED Technology, Inc.": 0x1A03,
    "Advanced Micro Devices, Inc. [AMD]": 0x1022,
    "Advanced Micro Devices, Inc. [AMD/ATI]": 0x1002,
    "Red Hat, Inc.": 0x1AF4,
}

#: (vendor id, pci.ids device name) -> device id, for devices lspci names rather than numbers.
DEVICE_NAMES: Mapping[tuple[int, str], int] = {
    (0x10DE, "GH100 [H100 SXM5 80GB]"): 0x2330,
    (0x15B3, "MT2910 Family [ConnectX-7]"): 0x1021,
    (0x15B3, "MT2892 Family [ConnectX-6 Dx]"): 0x101D,
    (0x1000, "PEX890xx PCIe Gen 5 Switch"): 0xC030,
    (0x1000, "PCIe Switch management endpoint"): 0x00B2,
    (0x8086, "NVMe DC SSD [3DNAND, Sentinel Rock Controller]"): 0x0B60,
    (0x1344, "7450 PRO NVMe SSD"): 0x51C3,
    (0x14E4, "NetXtreme BCM5720 Gigabit Ethernet PCIe"): 0x165F,
    (0x102B, "Integrated Matrox G200eW3 Graphics Controller"): 0x0536,
    (0x1556, "PCI Express Bridge"): 0xBE00,
}


#: ACS capability and control register bits by the names lspci gives them (``ls-ecaps.c``
#: ``cap_acs``; PCIe Base Specification §7.7.8.2-3): the low 7 bits of both registers.
ACS_FLAG_BITS: Mapping[str, int] = {
    "SrcValid": 1 << 0,
    "TransBlk": 1 << 1,
    "ReqRedir": 1 << 2,
    "CmpltRedir": 1 << 3,
    "UpstreamFwd": 1 << 4,
    "EgressCtrl": 1 << 5,
    "DirectTrans": 1 << 6,
}


@dataclass(frozen=True, slots=True)
class BusNumbers:
    """A bridge's ``Bus: primary=.., secondary=.., subordinate=..``."""

    primary: int
    secondary: int
    subordinate: int


@dataclass(frozen=True, slots=True)
class LspciDevice:
    """One function of an ``lspci -vvv`` listing. ``line`` is its header's line number."""

    bdf: str
    line: int
    class_name: str
    class_code: int | None
    vendor_name: str | None
    vendor_id: int | None
    device_name: str
    device_id: int | None
    ids_inferred: bool
    revision: int | None
    numa_node: int | None
    express_type: ExpressType | None
    link_cap_speed_gts: float | None
    link_cap_width: int | None
    link_sta_speed_gts: float | None
    link_sta_width: int | None
    bus: BusNumbers | None
    has_aer: bool
    driver: str | None
    #: the ACS capability and control registers (:data:`ACS_FLAG_BITS`); ``None`` without an
    #: ACS capability, or where the capture shows one without its registers (``-v``, or
    #: lspci not run as root)
    acs_capability: int | None = None
    acs_control: int | None = None

    @property
    def domain(self) -> int:
        return int(self.bdf[:-8], 16)

    @property
    def bus_number(self) -> int:
        return int(self.bdf[-7:-5], 16)

    @property
    def is_bridge(self) -> bool:
        return self.class_code is not None and (self.class_code >> 8) == 0x0604


@dataclass(frozen=True, slots=True)
class LspciDump:
    source: str
    devices: tuple[LspciDevice, ...]

    def device(self, bdf: str) -> LspciDevice:
        for dev in self.devices:
            if dev.bdf == bdf:
                return dev
        raise KeyError(bdf)


_HEADER_RE = re.compile(
    r"^(?:(?P<domain>[0-9a-f]{4,8}):)?(?P<bus>[0-9a-f]{2}):(?P<dev>[01][0-9a-f])\.(?P<fn>[0-7])"
    r" (?P<rest>.+)$"
)
_CLASS_RE = re.compile(r"^(?P<name>[^:\[]+?)(?: \[(?P<code>[0-9a-f]{4})\])?: (?P<desc>.*)$")
_PROGIF_RE = re.compile(r" \(prog-if (?P<progif>[0-9a-f]{2})(?: \[[^\]]*\])?\)$")
_REV_RE = re.compile(r" \(rev (?P<rev>[0-9a-f]{2})\)$")
_IDS_RE = re.compile(r" \[(?P<vendor>[0-9a-f]{4}):(?P<device>[0-9a-f]{4})\]$")
_UNKNOWN_VENDOR_RE = re.compile(r"^Device (?P<vendor>[0-9a-f]{4}):(?P<device>[0-9a-f]{4})$")
_DEVICE_NUMBER_RE = re.compile(r"^Device (?P<device>[0-9a-f]{4})$")
_UNLISTED_VENDOR_RE = re.compile(r"^(?P<vendor>.+) Device (?P<device>[0-9a-f]{4})$")
_NUMA_RE = re.compile(r"^NUMA node: (?P<node>-?[0-9]{1,5})$")
_BUS_RE = re.compile(
    r"^Bus: primary=(?P<p>[0-9a-f]{2}), secondary=(?P<s>[0-9a-f]{2}), "
    r"subordinate=(?P<o>[0-9a-f]{2})(?:, sec-latency=[0-9]+)?$"
)
_EXPRESS_RE = re.compile(r"^Capabilities: \[[0-9a-f]+\] Express (?:\(v[0-9]+\) )?(?P<type>.*)$")
_LNK_SPEED_RE = re.compile(r"Speed (?P<speed>[0-9]+(?:\.[0-9]+)?GT/s|unknown)")
_LNK_WIDTH_RE = re.compile(r"Width x(?P<width>[0-9]{1,2})\b")
_ACS_FLAG_RE = re.compile(r"^(?P<name>[A-Za-z0-9]+)(?P<state>[+-])$")


def _speed(text: str) -> float | None:
    return None if text == "unknown" else float(text.removesuffix("GT/s"))


def _acs_register(text: str, source: str, number: int) -> int:
    """The bits of an ``ACSCap:``/``ACSCtl:`` line's ``Name+``/``Name-`` flags. Names this
    table does not know (a later lspci's) are passed over; every known one must be there."""
    value = 0
    seen: set[str] = set()
    for token in text.split(":", 1)[1].split():
        flag = _ACS_FLAG_RE.match(token)
        if flag is None:
            raise ParseError(source, f"not an ACS flag: {token!r}", number)
        bit = ACS_FLAG_BITS.get(flag.group("name"))
        if bit is None:
            continue
        seen.add(flag.group("name"))
        if flag.group("state") == "+":
            value |= bit
    missing = [name for name in ACS_FLAG_BITS if name not in seen]
    if missing:
        raise ParseError(source, f"ACS flags {', '.join(missing)} missing in {text!r}", number)
    return value


def _express_type(text: str) -> ExpressType:
    name = text.split(", MSI", 1)[0].split(", IntMsgNum", 1)[0]
    name = re.sub(r" \(Slot[+-]\)$", "", name).strip()
    try:
        return ExpressType(name)
    except ValueError:
        return ExpressType.UNKNOWN


def _split_description(desc: str) -> tuple[str | None, int | None, str, int | None, bool]:
    """(vendor name, vendor id, device name, device id, ids inferred) of a header's text."""
    explicit = _IDS_RE.search(desc)
    if explicit is not None:
        desc = desc[: explicit.start()]
    vendor_name: str | None = None
    device_name = desc
    for name in sorted(VENDOR_NAMES, key=len, reverse=True):
        if desc.startswith(name + " "):
            vendor_name, device_name = name, desc[len(name) + 1 :]
            break
    if explicit is not None:
        return (
            vendor_name,
            int(explicit.group("vendor"), 16),
            device_name,
            int(explicit.group("device"), 16),
            False,
        )
    unknown = _UNKNOWN_VENDOR_RE.match(desc)
    if unknown is not None:
        return None, int(unknown.group("vendor"), 16), desc, int(unknown.group("device"), 16), False
    if vendor_name is None:
        unlisted = _UNLISTED_VENDOR_RE.match(desc)
        if unlisted is not None:
            return unlisted.group("vendor"), None, desc, int(unlisted.group("device"), 16), False
    vendor_id = VENDOR_NAMES.get(vendor_name) if vendor_name is not None else None
    inferred = vendor_id is not None
    device_id: int | None = None
    number = _DEVICE_NUMBER_RE.match(device_name)
    if number is not None:
        device_id = int(number.group("device"), 16)
    elif vendor_id is not None:
        device_id = DEVICE_NAMES.get((vendor_id, device_name))
    return vendor_name, vendor_id, device_name, device_id, inferred


@dataclass
class _Building:
    bdf: str
    line: int
    class_name: str
    class_code: int | None
    vendor_name: str | None
    vendor_id: int | None
    device_name: str
    device_id: int | None
    ids_inferred: bool
    revision: int | None
    numa_node: int | None = None
    express_type: ExpressType | None = None
    link_cap_speed_gts: float | None = None
    link_cap_width: int | None = None
    link_sta_speed_gts: float | None = None
    link_sta_width: int | None = None
    bus: BusNumbers | None = None
    has_aer: bool = False
    driver: str | None = None
    acs_capability: int | None = None
    acs_control: int | None = None

    def freeze(self) -> LspciDevice:
        return LspciDevice(
            bdf=self.bdf,
            line=self.line,
            class_name=self.class_name,
            class_code=self.class_code,
            vendor_name=self.vendor_name,
            vendor_id=self.vendor_id,
            device_name=self.device_name,
            device_id=self.device_id,
            ids_inferred=self.ids_inferred,
            revision=self.revision,
            numa_node=self.numa_node,
            express_type=self.express_type,
            link_cap_speed_gts=self.link_cap_speed_gts,
            link_cap_width=self.link_cap_width,
            link_sta_speed_gts=self.link_sta_speed_gts,
            link_sta_width=self.link_sta_width,
            bus=self.bus,
            has_aer=self.has_aer,
            driver=self.driver,
            acs_capability=self.acs_capability,
            acs_control=self.acs_control,
        )


def _header(line: str, number: int, source: str) -> _Building:
    match = _HEADER_RE.match(line)
    if match is None:
        raise ParseError(source, f"not a device header: {line[:80]!r}", number)
    domain = match.group("domain") or "0000"
    bdf = f"{int(domain, 16):04x}:{match.group('bus')}:{match.group('dev')}.{match.group('fn')}"
    klass = _CLASS_RE.match(match.group("rest"))
    if klass is None:
        raise ParseError(source, f"no '<class>: <device>' in {line[:80]!r}", number)
    desc = klass.group("desc")
    prog_if = 0
    progif_match = _PROGIF_RE.search(desc)
    if progif_match is not None:
        prog_if = int(progif_match.group("progif"), 16)
        desc = desc[: progif_match.start()]
    revision: int | None = None
    rev_match = _REV_RE.search(desc)
    if rev_match is not None:
        revision = int(rev_match.group("rev"), 16)
        desc = desc[: rev_match.start()]
    class_name = klass.group("name").strip()
    if klass.group("code") is not None:
        base_sub: int | None = int(klass.group("code"), 16)
    else:
        base_sub = CLASS_NAMES.get(class_name)
    class_code = None if base_sub is None else (base_sub << 8) | prog_if
    vendor_name, vendor_id, device_name, device_id, inferred = _split_description(desc)
    return _Building(
        bdf=bdf,
        line=number,
        class_name=class_name,
        class_code=class_code,
        vendor_name=vendor_name,
        vendor_id=vendor_id,
        device_name=device_name,
        device_id=device_id,
        ids_inferred=inferred,
        revision=revision,
    )


def _attribute(dev: _Building, text: str, number: int, source: str) -> None:
    if text.startswith("NUMA node:"):
        match = _NUMA_RE.match(text)
        if match is None:
            raise ParseError(source, f"bad NUMA node line {text!r}", number)
        node = int(match.group("node"))
        dev.numa_node = None if node < 0 else node
    elif text.startswith("Bus: primary="):
        match = _BUS_RE.match(text)
        if match is None:
            raise ParseError(source, f"bad bus numbers line {text!r}", number)
        dev.bus = BusNumbers(
            int(match.group("p"), 16), int(match.group("s"), 16), int(match.group("o"), 16)
        )
    elif text.startswith("Capabilities: ["):
        express = _EXPRESS_RE.match(text)
        if express is not None:
            dev.express_type = _express_type(express.group("type"))
        elif text.endswith("] Advanced Error Reporting"):
            dev.has_aer = True
    elif text.startswith(("LnkCap:", "LnkSta:")):
        speed = _LNK_SPEED_RE.search(text)
        width = _LNK_WIDTH_RE.search(text)
        if speed is None or width is None:
            raise ParseError(source, f"no speed and width in {text!r}", number)
        if text.startswith("LnkCap:"):
            dev.link_cap_speed_gts = _speed(speed.group("speed"))
            dev.link_cap_width = int(width.group("width"))
        else:
            dev.link_sta_speed_gts = _speed(speed.group("speed"))
            dev.link_sta_width = int(width.group("width"))
    elif text.startswith("ACSCap:"):
        dev.acs_capability = _acs_register(text, source, number)
    elif text.startswith("ACSCtl:"):
        dev.acs_control = _acs_register(text, source, number)
    elif text.startswith("Kernel driver in use: "):
        dev.driver = text.removeprefix("Kernel driver in use: ").strip() or None


def parse_lspci_vvv(text: str, source: str = "lspci -vvv") -> LspciDump:
    """Every function of an ``lspci -vvv`` (or ``-vvv -nn``, ``-D``) listing."""
    devices: list[LspciDevice] = []
    seen: set[str] = set()
    current: _Building | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.rstrip()
        if not line:
            continue
        if not line[0].isspace():
            if current is not None:
                devices.append(current.freeze())
            current = _header(line, number, source)
            if current.bdf in seen:
                raise ParseError(source, f"{current.bdf} listed twice", number)
            seen.add(current.bdf)
            continue
        if current is None:
            raise ParseError(source, "attribute line before any device header", number)
        _attribute(current, line.strip(), number, source)
    if current is not None:
        devices.append(current.freeze())
    return LspciDump(source, tuple(devices))


def parent_bridges(dump: LspciDump) -> dict[str, str | None]:
    """BDF -> the bridge whose secondary bus the function sits on (``None``: a root bus).

    Raises :class:`ParseError` when two bridges claim one secondary bus.
    """
    by_secondary: dict[tuple[int, int], LspciDevice] = {}
    for dev in dump.devices:
        if dev.bus is None:
            continue
        key = (dev.domain, dev.bus.secondary)
        other = by_secondary.get(key)
        if other is not None:
            raise ParseError(
                dump.source,
                f"{dev.bdf} and {other.bdf} both claim secondary bus {dev.bus.secondary:02x}",
                dev.line,
            )
        by_secondary[key] = dev
    parents: dict[str, str | None] = {}
    for dev in dump.devices:
        bridge = by_secondary.get((dev.domain, dev.bus_number))
        parents[dev.bdf] = None if bridge is None else bridge.bdf
    return parents


def bridge_chains(dump: LspciDump) -> dict[str, tuple[str, ...]]:
    """BDF -> the chain from the function on the root bus down to it (inclusive).

    Raises :class:`ParseError` when bus numbers form a cycle.
    """
    parents = parent_bridges(dump)
    lines = {dev.bdf: dev.line for dev in dump.devices}
    chains: dict[str, tuple[str, ...]] = {}
    for dev in dump.devices:
        chain = [dev.bdf]
        seen = {dev.bdf}
        parent = parents[dev.bdf]
        while parent is not None:
            if parent in seen:
                raise ParseError(dump.source, f"bus numbers above {dev.bdf} loop", lines[dev.bdf])
            seen.add(parent)
            chain.append(parent)
            parent = parents[parent]
        chains[dev.bdf] = tuple(reversed(chain))
    return chains
