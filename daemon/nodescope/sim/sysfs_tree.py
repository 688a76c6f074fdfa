"""Materialise the sysfs PCI tree of a real machine from its ``lspci -vvv`` capture.

Writes, under ``dest_root/sys`` (so ``Roots.under(dest_root)`` reads it), what the kernel
shows for each function (``drivers/pci/pci-sysfs.c``, ``drivers/pci/pcie/aer.c``):

* ``devices/pciDDDD:BB/<root port>/<upstream port>/<downstream port>/<function>/`` with
  ``vendor device class revision numa_node local_cpulist irq resource config`` (``irq`` and
  ``resource`` only because ``lspci -vvv`` insists on them), and for PCIe functions
  ``{current,max}_link_{speed,width}`` and ``power/runtime_status``;
  ``aer_dev_{correctable,fatal,nonfatal}`` where the capture shows
  Advanced Error Reporting; ``driver`` links into ``bus/pci/drivers``;
* ``bus/pci/devices/<BDF>`` relative links to those directories;
* ``class/nvme/nvmeN`` and ``<function>/nvme/nvmeN/device``;
  ``class/infiniband/mlx5_N`` and ``<function>/infiniband/mlx5_N/device``;
  ``<function>/net/<ifname>`` and ``class/net/<ifname>`` for network functions;
* ``devices/system/node/nodeN/cpulist`` and ``devices/system/node/online``.

``config`` holds config space as the kernel shows it to root: ids, class, header type, the
bridges' bus numbers and a PCIe capability with the port type and Link Capabilities/Status,
so ``lspci -A linux-sysfs -O sysfs.path=<root>/sys/bus/pci`` can read the tree back. A
function with Access Control Services gets the 4096 bytes of a PCIe function's config space,
with ACS as the one extended capability at 0x100; the others keep the first 256 bytes.

What the capture does not show is inferred, and said so here:

* ids printed as names are mapped by :mod:`nodescope.sim.lspci`'s tables;
* CPU numbers: the capture has NUMA nodes but no CPUs; the layout is a parameter
  (:func:`build_hgx_h100_tree` assumes two 56-core sockets with SMT, Linux numbering);
* OS names: NVMe controllers ``nvme0..`` and Mellanox functions ``mlx5_0..`` in BDF order,
  interface names in systemd's predictable scheme (``enp<bus>s<slot>[f<fn>][np0]``);
* ACS sits at 0x100, the one extended capability, wherever the capture shows it (``[148
  v1]``); its Egress Control Vector Size is 0;
* AER counters are zero (lspci shows status bits, not counts); runtime status ``active``;
  Express functions without a link (RC-integrated endpoints) read ``Unknown``/``0`` as the
  kernel reports them.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from nodescope.errors import ParseError
from nodescope.model.topology import format_cpulist
from nodescope.sim.lspci import (
    EXPRESS_TYPE_CODES,
    ExpressType,
    LspciDevice,
    LspciDump,
    bridge_chains,
    parse_lspci_vvv,
)

#: The ``lspci -vvv`` capture of an 8x H100 SXM server (see the README beside it).
HGX_H100_CAPTURE = (
    Path(__file__).resolve().parents[3]
    / "tests"
    / "fixtures"
    / "captures"
    / "hgx-h100"
    / "lspci-vvv.hgx-h100"
)

#: 6.12 names of the AER counters (``drivers/pci/pcie/aer.c``); unnamed bits are only
#: printed when non-zero.
AER_CORRECTABLE_NAMES = (
    "RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout", "NonFatalErr", "CorrIntErr", "HeaderOF",
)  # fmt: skip
AER_UNCORRECTABLE_NAMES = (
    "Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "CmpltAbrt", "UnxCmplt", "RxOF",
    "MalfTLP", "ECRC", "UnsupReq", "ACSViol", "UncorrIntErr", "BlockedTLP",
)  # fmt: skip

#: ``aer_dev_<severity>`` files and the name of their last line, the sum of the others.
AER_TOTALS = {
    "correctable": "TOTAL_ERR_COR",
    "fatal": "TOTAL_ERR_FATAL",
    "nonfatal": "TOTAL_ERR_NONFATAL",
}


def aer_text(severity: str, counts: Mapping[str, int]) -> str:
    """An ``aer_dev_<severity>`` file (``drivers/pci/pcie/aer.c``): every named error of the
    severity with its count, then the total, which the kernel keeps as the sum."""
    names = AER_CORRECTABLE_NAMES if severity == "correctable" else AER_UNCORRECTABLE_NAMES
    lines = "".join(f"{n} {counts.get(n, 0)}\n" for n in names)
    return f"{lines}{AER_TOTALS[severity]} {sum(counts.get(n, 0) for n in names)}"


_SPEED_CODES = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
_NO_LINK_TYPES = (ExpressType.RC_INTEGRATED_ENDPOINT, ExpressType.RC_EVENT_COLLECTOR)
_MELLANOX = 0x15B3
#: ``resource``: start, end, flags of 6 BARs and the ROM; all unassigned.
_NO_RESOURCES = "0x0000000000000000 0x0000000000000000 0x0000000000000000\n" * 7


@dataclass(frozen=True, slots=True)
class MaterialisedTree:
    """Where things went: the root to hand to ``Roots.under`` and the OS names given."""

    root: Path
    function_dirs: Mapping[str, Path]
    nvme: Mapping[str, str]
    infiniband: Mapping[str, str]
    net: Mapping[str, str]


def speed_string(gts: float | None) -> str:
    """The kernel's ``pci_speed_string`` form: ``32.0 GT/s PCIe`` or ``Unknown``."""
    if gts is None:
        return "Unknown"
    return f"{gts:.1f} GT/s PCIe"


def cpus_of_sockets(sockets: int, cores: int, threads: int) -> dict[int, tuple[int, ...]]:
    """Linux's usual numbering, one NUMA node per socket: first threads of every core of every
    socket, then the SMT siblings (node0 = ``0-55,112-167`` for 2x56 cores with SMT)."""
    nodes: dict[int, list[int]] = {s: [] for s in range(sockets)}
    for thread in range(threads):
        for socket in range(sockets):
            first = thread * sockets * cores + socket * cores
            nodes[socket].extend(range(first, first + cores))
    return {node: tuple(cpus) for node, cpus in nodes.items()}


#: Conventional config space; PCIe functions have 4096 bytes, extended capabilities from 0x100.
CONVENTIONAL_CONFIG_SIZE = 256
EXTENDED_CONFIG_SIZE = 4096
EXTENDED_CAPABILITIES = 0x100
#: Access Control Services' extended capability ID and the version the capture's ports show.
ACS_CAPABILITY_ID = 0x000D
ACS_CAPABILITY_VERSION = 1


def _config_space(dev: LspciDevice, multifunction: bool) -> bytes:
    """Config space with what ``lspci`` needs to rebuild the tree: 256 bytes, or 4096 with the
    ACS extended capability for a function that has one."""
    extended = dev.acs_control is not None
    config = bytearray(EXTENDED_CONFIG_SIZE if extended else CONVENTIONAL_CONFIG_SIZE)
    class_code = dev.class_code if dev.class_code is not None else 0xFF0000
    struct.pack_into("<HH", config, 0x00, dev.vendor_id or 0xFFFF, dev.device_id or 0xFFFF)
    struct.pack_into("<H", config, 0x04, 0x0006)  # memory space + bus master enabled
    config[0x08] = dev.revision or 0
    config[0x09] = class_code & 0xFF
    config[0x0A] = (class_code >> 8) & 0xFF
    config[0x0B] = (class_code >> 16) & 0xFF
    header_type = 1 if dev.is_bridge else 0
    config[0x0E] = header_type | (0x80 if multifunction else 0)
    if dev.bus is not None:
        config[0x18] = dev.bus.primary
        config[0x19] = dev.bus.secondary
        config[0x1A] = dev.bus.subordinate
    if dev.express_type is not None and dev.express_type in EXPRESS_TYPE_CODES:
        struct.pack_into("<H", config, 0x06, 0x0010)  # status: capability list present
        config[0x34] = 0x40
        config[0x40] = 0x10  # PCI Express capability, last in the list
        config[0x41] = 0x00
        struct.pack_into("<H", config, 0x42, 0x2 | (EXPRESS_TYPE_CODES[dev.express_type] << 4))
        if dev.express_type not in _NO_LINK_TYPES:
            cap_speed = _SPEED_CODES.get(dev.link_cap_speed_gts or 0.0, 0)
            sta_speed = _SPEED_CODES.get(dev.link_sta_speed_gts or 0.0, 0)
            struct.pack_into("<I", config, 0x4C, cap_speed | ((dev.link_cap_width or 0) << 4))
            struct.pack_into("<H", config, 0x52, sta_speed | ((dev.link_sta_width or 0) << 4))
            # Link Capabilities 2: supported speeds vector, up to the maximum.
            struct.pack_into("<I", config, 0x6C, ((1 << cap_speed) - 1) << 1 if cap_speed else 0)
    if dev.acs_control is not None:
        # Header: ID in bits 0-15, version 16-19, next capability's offset 20-31 (0: last).
        header = ACS_CAPABILITY_ID | (ACS_CAPABILITY_VERSION << 16)
        # A control bit can only be set where the capability has it: with the capability
        # unknown, the control bits stand for it.
        capability = dev.acs_capability if dev.acs_capability is not None else dev.acs_control
        struct.pack_into("<IHH", config, EXTENDED_CAPABILITIES, header, capability, dev.acs_control)
    return bytes(config)


def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, (text if text.endswith("\n") else text + "\n").encode())
    finally:
        os.close(fd)


def _symlink(link: Path, target: Path) -> None:
    """A relative symlink at ``link`` pointing to ``target``, as sysfs has them."""
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent))


def _ifname(dev: LspciDevice, multifunction: bool) -> str:
    bus = int(dev.bdf[-7:-5], 16)
    slot = int(dev.bdf[-4:-2], 16)
    fn = int(dev.bdf[-1])
    prefix = "ib" if dev.class_code is not None and dev.class_code >> 8 == 0x0207 else "en"
    name = f"{prefix}p{bus}s{slot}"
    if multifunction:
        name += f"f{fn}"
    if dev.vendor_id == _MELLANOX:
        name += "np0"
    return name


def materialise(
    dump: LspciDump,
    dest_root: str | os.PathLike[str],
    node_cpus: Mapping[int, Sequence[int]],
) -> MaterialisedTree:
    """Write the sysfs tree of ``dump`` under ``dest_root/sys``."""
    root = Path(dest_root)
    sys_dir = root / "sys"
    devices_dir = sys_dir / "devices"
    chains = bridge_chains(dump)
    by_bdf = {dev.bdf: dev for dev in dump.devices}
    slots: dict[str, int] = {}
    for dev in dump.devices:
        slots[dev.bdf[:-2]] = slots.get(dev.bdf[:-2], 0) + 1

    function_dirs: dict[str, Path] = {}
    for dev in dump.devices:
        chain = chains[dev.bdf]
        top = by_bdf[chain[0]]
        host_bridge = f"pci{top.domain:04x}:{top.bus_number:02x}"
        function_dirs[dev.bdf] = devices_dir.joinpath(host_bridge, *chain)

    nvme: dict[str, str] = {}
    infiniband: dict[str, str] = {}
    net: dict[str, str] = {}
    for dev in dump.devices:
        directory = function_dirs[dev.bdf]
        directory.mkdir(parents=True, exist_ok=True)
        multifunction = slots[dev.bdf[:-2]] > 1
        class_code = dev.class_code if dev.class_code is not None else 0xFF0000
        _write(directory / "vendor", f"0x{dev.vendor_id or 0xFFFF:04x}")
        _write(directory / "device", f"0x{dev.device_id or 0xFFFF:04x}")
        _write(directory / "class", f"0x{class_code:06x}")
        _write(directory / "revision", f"0x{dev.revision or 0:02x}")
        _write(directory / "irq", "0")
        _write(directory / "resource", _NO_RESOURCES)
        node = dev.numa_node
        _write(directory / "numa_node", str(-1 if node is None else node))
        cpus = (
            node_cpus.get(node, ())
            if node is not None
            else [c for v in node_cpus.values() for c in v]
        )
        _write(directory / "local_cpulist", format_cpulist(cpus))
        (directory / "config").write_bytes(_config_space(dev, multifunction))
        if dev.express_type is not None:
            no_link = dev.express_type in _NO_LINK_TYPES
            _write(
                directory / "max_link_speed",
                speed_string(None if no_link else dev.link_cap_speed_gts),
            )
            _write(directory / "max_link_width", str(0 if no_link else dev.link_cap_width or 0))
            _write(
                directory / "current_link_speed",
                speed_string(None if no_link else dev.link_sta_speed_gts),
            )
            _write(directory / "current_link_width", str(0 if no_link else dev.link_sta_width or 0))
            (directory / "power").mkdir(exist_ok=True)
            _write(directory / "power" / "runtime_status", "active")
        if dev.has_aer:
            for severity in AER_TOTALS:
                _write(directory / f"aer_dev_{severity}", aer_text(severity, {}))
        if dev.driver is not None:
            driver_dir = sys_dir / "bus" / "pci" / "drivers" / dev.driver
            driver_dir.mkdir(parents=True, exist_ok=True)
            _symlink(directory / "driver", driver_dir)
        _symlink(sys_dir / "bus" / "pci" / "devices" / dev.bdf, directory)

        class_code_24 = dev.class_code or 0
        if class_code_24 == 0x010802:
            name = f"nvme{len(nvme)}"
            nvme[dev.bdf] = name
            ctrl = directory / "nvme" / name
            ctrl.mkdir(parents=True)
            _symlink(ctrl / "device", directory)
            _symlink(sys_dir / "class" / "nvme" / name, ctrl)
        if class_code_24 >> 16 == 0x02:
            if dev.vendor_id == _MELLANOX:
                name = f"mlx5_{len(infiniband)}"
                infiniband[dev.bdf] = name
                hca = directory / "infiniband" / name
                hca.mkdir(parents=True)
                _symlink(hca / "device", directory)
                _symlink(sys_dir / "class" / "infiniband" / name, hca)
            ifname = _ifname(dev, multifunction)
            net[dev.bdf] = ifname
            iface = directory / "net" / ifname
            iface.mkdir(parents=True)
            _symlink(iface / "device", directory)
            _symlink(sys_dir / "class" / "net" / ifname, iface)

    node_dir = devices_dir / "system" / "node"
    nodes = sorted(set(node_cpus) | {d.numa_node for d in dump.devices if d.numa_node is not None})
    for node in nodes:
        (node_dir / f"node{node}").mkdir(parents=True, exist_ok=True)
        _write(node_dir / f"node{node}" / "cpulist", format_cpulist(node_cpus.get(node, ())))
    if nodes:
        _write(node_dir / "online", format_cpulist(nodes))
        _write(node_dir / "possible", format_cpulist(nodes))
    return MaterialisedTree(root, function_dirs, nvme, infiniband, net)


def load_capture(path: str | os.PathLike[str]) -> LspciDump:
    try:
        text = Path(path).read_text()
    except UnicodeDecodeError as exc:
        raise ParseError(str(path), f"not text: {exc}") from exc
    return parse_lspci_vvv(text, str(path))


def build_hgx_h100_tree(
    dest_root: str | os.PathLike[str], capture: str | os.PathLike[str] | None = None
) -> MaterialisedTree:
    """The PCI sysfs tree of the captured 8x H100 SXM server (two Sapphire Rapids sockets,
    assumed 56 cores each with SMT) under ``dest_root``."""
    dump = load_capture(capture if capture is not None else HGX_H100_CAPTURE)
    return materialise(dump, dest_root, cpus_of_sockets(sockets=2, cores=56, threads=2))


def cached_hgx_h100_tree(directory: str | os.PathLike[str]) -> Path:
    """The HGX H100 tree under ``directory``, built on the first call and reused after (a
    ``.complete`` marker says a build finished), so a test session pays for it once."""
    root = Path(directory)
    marker = root / ".complete"
    if not marker.exists():
        if root.exists():
            shutil.rmtree(root)
        build_hgx_h100_tree(root)
        marker.touch()
    return root
