"""The simulated node's PCIe tree under ``sys/`` (:mod:`nodescope.sim.sysfs_tree`, from the
scenario's lspci capture): the functions, their ``current_link_{speed,width}`` as the timeline
changes them, their AER counters (drivers/pci/pcie/aer.c), the loaded kernel modules
(kernel/module/sysfs.c), and the device events of a function removed or rebound."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from nodescope.sim.lspci import ExpressType, LspciDevice, bridge_chains
from nodescope.sim.node_base import NodePart
from nodescope.sim.sysfs_tree import (
    AER_CORRECTABLE_NAMES,
    AER_TOTALS,
    AER_UNCORRECTABLE_NAMES,
    aer_text,
    cpus_of_sockets,
    materialise,
    speed_string,
)
from nodescope.sources.udev import event_from_properties

if TYPE_CHECKING:
    from nodescope.sim.node import SimulatedNode

#: PCIe generation by link speed in GT/s.
GENERATIONS = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
#: Express functions without a link of their own (sysfs shows ``Unknown``/0 for them).
NO_LINK = (ExpressType.RC_INTEGRATED_ENDPOINT, ExpressType.RC_EVENT_COLLECTOR)


class PciPart(NodePart):
    """The PCIe functions, their links and AER counters, and the device events of the node."""

    def __init__(self, node: SimulatedNode) -> None:
        super().__init__(node)
        #: the kernel's event number of the last device event
        self._seqnum = 4000

    def write_pci(self) -> None:
        node = self.node
        tree = materialise(
            node.dump,
            node.root,
            cpus_of_sockets(
                node.hardware.cpu.sockets,
                node.hardware.cpu.cores_per_socket,
                node.hardware.cpu.threads_per_core,
            ),
        )
        node.dirs = dict(tree.function_dirs)
        sysfs = node.roots.sysfs
        # The tree wrote each function's Link Status: remember it, so a tick rewrites only
        # the links the timeline changes.
        for dev in node.dump.devices:
            if dev.express_type is not None and dev.express_type not in NO_LINK:
                directory = node.dirs[dev.bdf]
                node.files.assume(
                    directory / "current_link_speed", f"{speed_string(dev.link_sta_speed_gts)}\n"
                )
                node.files.assume(directory / "current_link_width", f"{dev.link_sta_width or 0}\n")
        # OS names are the scenario's: replace the tree's guesses (address order).
        for bdf, name in tree.nvme.items():
            (sysfs / "class" / "nvme" / name).unlink()
            shutil.rmtree(node.dirs[bdf] / "nvme")
        for bdf, name in tree.infiniband.items():
            (sysfs / "class" / "infiniband" / name).unlink()
            shutil.rmtree(node.dirs[bdf] / "infiniband")

    def write_modules(self) -> None:
        """A directory per loaded module, as the kernel makes one when it loads a module; its
        ``refcnt``, the users holding it, is 0 as nothing here uses the modules."""
        node = self.node
        for name in node.hardware.os.kernel_modules:
            node.files.write(node.roots.sysfs / "module" / name / "refcnt", "0\n")

    def write_pci_links(self, links: Mapping[str, tuple[float | None, int | None]]) -> None:
        node = self.node
        for bdf, (speed, width) in links.items():
            if bdf in node.removed or bdf not in node.dirs:
                continue
            directory = node.dirs[bdf]
            node.files.write(directory / "current_link_speed", f"{speed_string(speed)}\n")
            node.files.write(directory / "current_link_width", f"{width or 0}\n")

    def uevent(
        self, action: str, subsystem: str, directory: Path, function: LspciDevice | None = None
    ) -> None:
        """A device event as the kernel sends it (``lib/kobject_uevent.c``; a PCI function's
        properties from ``drivers/pci/pci-driver.c`` ``pci_uevent``), to every udev source."""
        node = self.node
        self._seqnum += 1
        properties = {
            "ACTION": action,
            "DEVPATH": "/" + directory.relative_to(node.roots.sysfs).as_posix(),
            "SUBSYSTEM": subsystem,
            "SEQNUM": str(self._seqnum),
        }
        if function is not None:
            if function.class_code is not None:
                properties["PCI_CLASS"] = f"{function.class_code:X}"
            if function.vendor_id is not None and function.device_id is not None:
                properties["PCI_ID"] = f"{function.vendor_id:04X}:{function.device_id:04X}"
            properties["PCI_SLOT_NAME"] = function.bdf
        event = event_from_properties(properties, "simulated uevent")
        for sink in node._uevent_sinks:
            sink(event)

    def remove_function(self, bdf: str) -> None:
        """Hot-unplug: the function, its children and the class links into them vanish, and
        the kernel's events say so, deepest first: the block devices and interfaces drivers
        made of them, then each function's driver unbound and the function removed."""
        node = self.node
        if bdf in node.removed or bdf not in node.dirs:
            return
        chains = bridge_chains(node.dump)
        gone = {b for b, chain in chains.items() if bdf in chain}
        sysfs = node.roots.sysfs
        for drive in node.hardware.nvme:
            if drive.pci in gone:
                ctrl = node.dirs[drive.pci] / "nvme" / drive.controller
                self.uevent("remove", "block", ctrl / drive.disk)
        for b in sorted(gone, key=lambda b: (-len(chains[b]), b)):
            directory = node.dirs[b]
            for net in (directory / "net").glob("*") if (directory / "net").is_dir() else ():
                self.uevent("remove", "net", directory / "net" / net.name)
            function = node.functions[b]
            if function.driver:
                self.uevent("unbind", "pci", directory, function)
            self.uevent("remove", "pci", directory, function)
        node.removed |= gone
        for drive in node.hardware.nvme:
            if drive.pci in gone:
                for link in (
                    sysfs / "block" / drive.disk,
                    sysfs / "class" / "block" / drive.disk,
                    sysfs / "class" / "nvme" / drive.controller,
                ):
                    node.files.remove_tree(link)
        for nic in node.hardware.nics:
            if nic.pci[0] in gone:
                node.files.remove_tree(sysfs / "class" / "infiniband" / nic.name)
        for b in gone:
            directory = node.dirs[b]
            for net in (directory / "net").glob("*") if (directory / "net").is_dir() else ():
                node.files.remove_tree(sysfs / "class" / "net" / net.name)
            node.files.remove_tree(sysfs / "bus" / "pci" / "devices" / b)
        node.files.remove_tree(node.dirs[bdf])
        for gpu in node.hardware.gpus:
            if gpu.pci in gone:
                node.nvml.gpus[gpu.index].lost = True

    def rebind_driver(self, bdf: str) -> None:
        """The function's driver unbound and bound again (``echo BDF > .../unbind``, then
        ``bind``) between two reads: the events of both, the function never leaving the bus.
        What the driver made (a namespace's block device) goes and comes back with it, so the
        tree the next read sees is the one before."""
        node = self.node
        if bdf in node.removed or bdf not in node.dirs:
            return
        function = node.functions[bdf]
        directory = node.dirs[bdf]
        disks = [
            directory / "nvme" / d.controller / d.disk for d in node.hardware.nvme if d.pci == bdf
        ]
        for disk in disks:
            self.uevent("remove", "block", disk)
        self.uevent("unbind", "pci", directory, function)
        self.uevent("bind", "pci", directory, function)
        for disk in disks:
            self.uevent("add", "block", disk)

    def write_aer(self) -> None:
        """The AER counters of the functions the timeline gives errors, totals kept equal to
        the sum of the named counters as the kernel keeps them."""
        node = self.node
        for bdf in sorted(node.aer_functions):
            if bdf in node.removed:
                continue
            for severity in AER_TOTALS:
                names = (
                    AER_CORRECTABLE_NAMES if severity == "correctable" else AER_UNCORRECTABLE_NAMES
                )
                counts = {n: int(node.acc.get(("aer", bdf, severity, n), 0.0)) for n in names}
                node.files.write(node.dirs[bdf] / f"aer_dev_{severity}", aer_text(severity, counts))
