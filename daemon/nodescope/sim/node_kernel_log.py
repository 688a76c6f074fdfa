"""The simulated node's kernel log (``dev/kmsg``): records as ``/dev/kmsg`` hands them out,
``PRIO,SEQ,USEC,FLAGS;MESSAGE`` (Documentation/ABI/testing/dev-kmsg), only ever appended to:
the ``nvidia-nvswitch`` driver's SXid lines, the NVIDIA driver's Xid lines, a segfault's
report, or the same text written from user space (a record with a facility)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nodescope.model.xid_catalog import load_catalog
from nodescope.sim.node_base import NodePart
from nodescope.sim.scenario import (
    FORGED_SEGFAULT,
    Activity,
)

if TYPE_CHECKING:
    from nodescope.sim.node import SimulatedNode
    from nodescope.sim.node_processes import Proc


class KernelLogPart(NodePart):
    """The kernel log of the node, and the sequence number of its next record."""

    def __init__(self, node: SimulatedNode) -> None:
        super().__init__(node)
        self._kmsg_sequence = 0

    def log_sxid(self, activity: Activity) -> None:
        """Append an ``sxid`` activity's records to the kernel log: per SXid, the line of
        ``NVSWITCH_PRINT_SXID`` and the two lines of the driver's error-log entry
        (``_nvswitch_dump_error_entry``), as docs/sxid.md shows them."""
        node = self.node
        index = activity.get("nvswitch")
        bdf = node.hardware.nvswitches[index]
        forged = activity.get("forged")
        if bdf in node.removed and not forged:
            return  # a switch off the bus raises no error
        fatal, link, code = activity.get("fatal"), activity.get("link"), activity.get("sxid")
        prefix = f"nvidia-nvswitch{index}: SXid (PCI:{bdf}): {code:05d}, "
        where = "" if link is None else f"Link {link:02d} "
        lines = (
            f"{'Fatal' if fatal else 'Non-fatal'}, {where}{activity.get('message')}",
            # The entry's severity (1 fatal, 0 non-fatal) and the port as its engine instance.
            f"Severity {1 if fatal else 0} Engine instance {link or 0:02d} Sub-engine instance 00",
            # The entry's raw words: nothing reads them.
            "Data {" + ", ".join(["0x00000000"] * 8) + "}",
        )
        forged_as = activity.get("forged_as") if forged else None
        # A crashing binary carries one line in its name: the SXid line alone.
        written = lines[:1] if forged_as == FORGED_SEGFAULT else lines
        for _ in range(activity.get("count")):
            self.append_kmsg([prefix + line for line in written], activity.start, forged_as)

    def log_segfault(self, proc: Proc, start: float) -> None:
        """The kernel's report of a process killed by a fault it did not handle
        (``show_signal_msg``, ``arch/x86/mm/fault.c``): facility 0, ``KERN_INFO``, the task's
        name (its first 15 characters) and pid first."""
        node = self.node
        usec = round((node.hardware.os.uptime_seconds + start) * 1_000_000)
        text = (
            f"{proc.comm[:15]}[{proc.pid}]: segfault at 0 ip 00007f3a1c2b4d10 sp"
            f" 00007ffd5e1f2a40 error 4 in libc.so.6[7f3a1c200000+195000]"
            " likely on CPU 3 (core 3, socket 0)"
        )
        record = f"{0 * 8 + 6},{self._kmsg_sequence},{usec},-;{text}\n"
        self._kmsg_sequence += 1
        node.files.append(node.kmsg_path, record.encode())

    @staticmethod
    def xid_line(pci: str, xid: int) -> str:
        """The GPU driver's Xid line (``kernel_rc.c``): the address without its function,
        then the code, the process (none for a fault of the GPU's own) and the meaning."""
        meaning = load_catalog().lookup(xid).name
        address = pci.rsplit(".", 1)[0]
        return f"NVRM: Xid (PCI:{address}): {xid}, pid='<unknown>', name=<unknown>, {meaning}"

    def append_kmsg(self, lines: list[str], start: float, forged_as: str | None = None) -> None:
        """Append ``lines`` to the kernel log as records at ``start``: the driver's (facility
        0, ``KERN_ERR``), or with ``forged_as`` the same text as a user makes the kernel log
        it (:data:`FORGED_DEVKMSG`, :data:`FORGED_SEGFAULT`)."""
        node = self.node
        usec = round((node.hardware.os.uptime_seconds + start) * 1_000_000)
        records = []
        for line in lines:
            if forged_as is None:
                # The drivers print at KERN_ERR (3) in the kernel's facility 0.
                prio, text = 0 * 8 + 3, line
            elif forged_as == FORGED_SEGFAULT:
                # The kernel's report of a crashing binary named after the line
                # (show_signal_msg, arch/x86/mm/fault.c): KERN_INFO, its comm (the name's
                # first 15 characters) first, the whole file name after "in".
                prio = 0 * 8 + 6
                text = (
                    f"{line[:15]}[{4242 + self._kmsg_sequence}]: segfault at 0 ip "
                    f"000055d0c0de1139 sp 00007ffd5e1f2a40 error 4 in {line}"
                    "[55d0c0de1000+1000] likely on CPU 3 (core 3, socket 0)"
                )
            else:
                # A write to /dev/kmsg from user space gets facility 1 (LOG_USER) and the
                # default level 4 (devkmsg_write, kernel/printk/printk.c).
                prio, text = 1 * 8 + 4, line
            records.append(f"{prio},{self._kmsg_sequence},{usec},-;{text}\n")
            self._kmsg_sequence += 1
        node.files.append(node.kmsg_path, "".join(records).encode())
