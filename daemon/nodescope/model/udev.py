"""Device hot-plug as the node reported it: the ``udev`` source's records.

Built by ``sources/udev.py`` from the kernel's uevents (``lib/kobject_uevent.c``) or udevd's
re-broadcast of them, and from listings of ``<sysfs>/bus/pci/devices``: events counted per
subsystem and action, GPUs removed and GPUs missing since the source started.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nodescope.model.skips import NOTHING_SKIPPED, Skipped
from nodescope.model.source_key import SourceKey

#: The device actions the kernel reports (``lib/kobject_uevent.c`` ``kobject_actions``).
ACTIONS = ("add", "remove", "change", "move", "bind", "unbind", "online", "offline")


def is_gpu_class(pci_class: int | None) -> bool:
    """Display controllers (base class 0x03: VGA 0x0300, 3D 0x0302) are GPUs."""
    return pci_class is not None and (pci_class >> 16) == 0x03


@dataclass(frozen=True, slots=True)
class UdevEvent:
    """One device event. ``pci_slot``/``pci_class`` for PCI functions, ``interface`` for
    network devices; ``seqnum`` is the kernel's event number; ``pci_id``: the function's
    (vendor, device) from ``PCI_ID``, which a removal event still carries after its sysfs
    directory is gone."""

    action: str
    subsystem: str
    devpath: str
    pci_slot: str | None = None
    pci_class: int | None = None
    interface: str | None = None
    seqnum: int | None = None
    pci_id: tuple[int, int] | None = None

    @property
    def under_pci(self) -> bool:
        """A device of a PCI function (not ``/devices/virtual``): it changes the topology."""
        return self.subsystem == "pci" or self.devpath.startswith("/devices/pci")

    @property
    def is_gpu(self) -> bool:
        return self.subsystem == "pci" and is_gpu_class(self.pci_class)

    @property
    def is_pci_removal(self) -> bool:
        """A PCI function of any class left the bus (``remove`` on the ``pci`` subsystem).
        A driver unbound from a function (``unbind``) and the removal of what a driver
        made of it (a block device, a network interface) leave the function on the bus."""
        return self.subsystem == "pci" and self.action == "remove" and self.pci_slot is not None


@dataclass(frozen=True, slots=True)
class GpuRemovals:
    bdf: str
    count: int


@dataclass(frozen=True, slots=True)
class UdevData:
    """``monitor``: ``"kernel"``/``"udev"`` or ``None`` when no monitor runs (listing only).
    ``events``: (subsystem, action, count) since start; ``gpu_removals``: GPUs removed since
    start, by BDF; ``gpus_missing``: GPUs seen before and absent now; ``recent``: events of
    this run; ``dropped``: events lost to a full queue."""

    monitor: str | None
    events: tuple[tuple[str, str, int], ...]
    gpu_removals: tuple[GpuRemovals, ...]
    gpus_missing: tuple[str, ...]
    recent: tuple[UdevEvent, ...]
    dropped: int
    topology_generation: int
    #: events and ``class`` attributes of this run left out as malformed or refused
    skipped: Skipped = field(default=NOTHING_SKIPPED, compare=False)


#: The ``udev`` source's records.
UDEV = SourceKey("udev", UdevData)
