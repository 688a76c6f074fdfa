"""The simulated node's disks and mounts: ``class/nvme`` and ``block/nvme*`` in sysfs
(drivers/nvme/host/core.c), ``proc/diskstats`` (block/genhd.c, 20 fields), ``mounts``,
``mountinfo`` and the daemon's ``mountstats`` (fs/nfs/super.c, net/sunrpc/stats.c), and the
block I/O the timeline's activities do."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nodescope.sim.node_base import PAGE, SECTOR, NodePart
from nodescope.sim.scenario import (
    NFS4_OPS,
    Activity,
    Mount,
)

if TYPE_CHECKING:
    pass

#: Request size assumed when a disk activity gives bytes but no IOPS.
DEFAULT_REQUEST_BYTES = 131072
#: Latencies of traffic a ``disk`` activity does not state (``job_io``, ``gpu_peer``): the
#: ``disk`` activity's defaults.
_DEFAULT_READ_MS = 0.1
_DEFAULT_WRITE_MS = 0.05

_NFS_OP_FIELDS = (
    "ops", "ntrans", "timeouts", "bytes_sent", "bytes_recv", "queue_ms", "rtt_ms",
    "execute_ms", "errors",
)  # fmt: skip


class DisksPart(NodePart):
    """The NVMe drives, the block devices and the mounts of the node."""

    def write_block(self) -> None:
        node = self.node
        sysfs = node.roots.sysfs
        files = node.files
        for drive in node.hardware.nvme:
            function = node.dirs[drive.pci]
            ctrl = function / "nvme" / drive.controller
            disk = ctrl / drive.disk
            files.mkdir(disk)
            files.symlink(ctrl / "device", function)
            files.symlink(sysfs / "class" / "nvme" / drive.controller, ctrl)
            files.write(ctrl / "address", drive.pci)
            files.write(ctrl / "transport", "pcie\n")
            files.write(ctrl / "model", f"{drive.model}\n")
            files.write(ctrl / "state", "live\n")
            files.symlink(disk / "device", ctrl)
            files.write(disk / "dev", f"{drive.major}:{drive.minor}\n")
            files.write(disk / "size", f"{drive.size_bytes // SECTOR}\n")
            files.symlink(sysfs / "block" / drive.disk, disk)
            files.symlink(sysfs / "class" / "block" / drive.disk, disk)
            uptime = node.hardware.os.uptime_seconds
            # Since boot: a modest history, so the first rates are the timeline's, not boot's.
            for name, per_s in (
                ("reads_completed", 400.0),
                ("sectors_read", 400.0 * 256),
                ("read_ms", 400.0 * 0.1),
                ("writes_completed", 50.0),
                ("sectors_written", 50.0 * 64),
                ("write_ms", 50.0 * 0.05),
                ("io_ms", 45.0),
                ("weighted_io_ms", 42.5),
                ("flushes_completed", 1.0),
                ("flush_ms", 0.1),
            ):
                node.acc[("disk", drive.disk, name)] = per_s * uptime

    def diskstats(self) -> str:
        node = self.node
        lines = [f"   7       {n} loop{n} 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n" for n in range(8)]
        fields = (
            "reads_completed", "reads_merged", "sectors_read", "read_ms", "writes_completed",
            "writes_merged", "sectors_written", "write_ms", "in_flight", "io_ms",
            "weighted_io_ms", "discards_completed", "discards_merged", "sectors_discarded",
            "discard_ms", "flushes_completed", "flush_ms",
        )  # fmt: skip
        for drive in node.hardware.nvme:
            if drive.pci in node.removed:
                continue
            values = []
            for name in fields:
                value = int(node.acc.get(("disk", drive.disk, name), 0.0))
                if name.endswith("_ms"):
                    value %= 1 << 32  # unsigned int in diskstats_show()
                values.append(str(value))
            lines.append(f" {drive.major:3d} {drive.minor:7d} {drive.disk} {' '.join(values)}\n")
        return "".join(lines)

    def mounts(self) -> str:
        node = self.node
        lines = [
            "sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0\n",
            "proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0\n",
            "/dev/md0 / ext4 rw,relatime 0 0\n",
            "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate 0 0\n",
        ]
        for mount in node.hardware.mounts:
            lines.append(
                f"{mount.device} {mount.mountpoint} {mount.fstype} {self.nfs_opts(mount)} 0 0\n"
            )
        return "".join(lines)

    def mountinfo(self) -> str:
        """``/proc/self/mountinfo`` (Documentation/filesystems/proc.rst §3.5): the mounts
        with their superblock's device numbers, which /proc/locks names a file by."""
        node = self.node
        lines = [
            "22 1 0:21 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw\n",
            "23 1 0:22 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw\n",
            "24 1 9:0 / / rw,relatime shared:1 - ext4 /dev/md0 rw\n",
            "25 22 0:25 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2"
            " cgroup2 rw,nsdelegate\n",
        ]
        for number, mount in enumerate(node.hardware.mounts, start=40):
            lines.append(
                f"{number} 24 {mount.major}:{mount.minor} / {mount.mountpoint} rw,relatime"
                f" shared:{number} - {mount.fstype} {mount.device} {self.nfs_opts(mount)}\n"
            )
        return "".join(lines)

    @staticmethod
    def nfs_opts(mount: Mount) -> str:
        return (
            f"rw,relatime,vers={mount.version},rsize=1048576,wsize=1048576,namlen=255,hard,"
            f"proto=tcp,timeo=600,retrans=2,sec=sys,clientaddr=10.20.1.17,local_lock=none,"
            f"addr={mount.server_addr}"
        )

    def mountstats(self) -> str:
        node = self.node
        out = [
            "device sysfs mounted on /sys with fstype sysfs\n",
            "device proc mounted on /proc with fstype proc\n",
            "device /dev/md0 mounted on / with fstype ext4\n",
            "device cgroup2 mounted on /sys/fs/cgroup with fstype cgroup2\n",
        ]
        age = int(node.hardware.os.uptime_seconds + node.t)
        for mount in node.hardware.mounts:
            heading = (
                f"device {mount.device} mounted on {mount.mountpoint} with fstype {mount.fstype}"
            )
            if not mount.is_nfs:
                out.append(f"{heading}\n")
                continue
            ops = {
                op: [
                    int(node.acc.get(("nfs", mount.mountpoint, op, k), 0.0)) for k in _NFS_OP_FIELDS
                ]
                for op in NFS4_OPS
            }
            sends = sum(v[1] for v in ops.values())
            read_bytes = int(node.acc.get(("nfs", mount.mountpoint, "READ", "bytes_recv"), 0.0))
            write_bytes = int(node.acc.get(("nfs", mount.mountpoint, "WRITE", "bytes_sent"), 0.0))
            # include/linux/nfs_iostat.h: 27 event counters, NFSIOS_INODEREVALIDATE first,
            # NFSIOS_VFSLOCK the 17th.
            events = [0] * 27
            events[0] = ops["GETATTR"][0]
            events[16] = ops["LOCK"][0]
            pages = f"{read_bytes // PAGE} {write_bytes // PAGE}"
            out.append(
                f"{heading} statvers=1.1\n"
                f"\topts:\t{self.nfs_opts(mount)}\n"
                f"\tage:\t{age}\n"
                "\timpl_id:\tname='',domain='',date='0,0'\n"
                "\tcaps:\tcaps=0x3ffbffff,wtmult=512,dtsize=1048576,bsize=0,namlen=255\n"
                "\tnfsv4:\tbm0=0xfdffbfff,bm1=0x40fdbe3e,bm2=0x60803,acl=0x3,sessions,"
                "pnfs=not configured,lease_time=90,lease_expired=0\n"
                "\tsec:\tflavor=1,pseudoflavor=1\n"
                f"\tevents:\t{' '.join(str(e) for e in events)}\n"
                f"\tbytes:\t{read_bytes} {write_bytes} 0 0 {read_bytes} {write_bytes} {pages}\n"
                "\tRPC iostats version: 1.1  p/v: 100003/4 (nfs)\n"
                f"\txprt:\ttcp 718 1 1 0 0 {sends} {sends} 0 {sends} 0 64 0 0\n"
                "\tper-op statistics\n"
            )
            for op in NFS4_OPS:
                values = ops[op]
                out.append(f"\t{op:>12s}: {' '.join(str(v) for v in values)}\n")
            out.append("\n")
        return "".join(out)

    def integrate_disk(self, activity: Activity, seconds: float) -> None:
        get = activity.get
        self.integrate_drive(
            get("disk"),
            seconds,
            get("read_bytes_per_second"),
            get("write_bytes_per_second"),
            get("read_iops"),
            get("write_iops"),
            get("read_latency_ms"),
            get("write_latency_ms"),
        )

    def integrate_drive(
        self,
        disk: str,
        seconds: float,
        read_bytes: float,
        write_bytes: float,
        r_iops: float | None = None,
        w_iops: float | None = None,
        r_lat: float = _DEFAULT_READ_MS,
        w_lat: float = _DEFAULT_WRITE_MS,
    ) -> None:
        """``/proc/diskstats`` of ``disk`` for ``seconds`` of this traffic."""
        node = self.node
        r_iops = read_bytes / DEFAULT_REQUEST_BYTES if r_iops is None else r_iops
        w_iops = write_bytes / DEFAULT_REQUEST_BYTES if w_iops is None else w_iops
        queue = (r_iops * r_lat + w_iops * w_lat) / 1000.0  # requests in flight on average
        key = ("disk", disk)
        node.add((*key, "reads_completed"), r_iops * seconds)
        node.add((*key, "sectors_read"), read_bytes * seconds / SECTOR)
        node.add((*key, "read_ms"), r_iops * seconds * r_lat)
        node.add((*key, "writes_completed"), w_iops * seconds)
        node.add((*key, "sectors_written"), write_bytes * seconds / SECTOR)
        node.add((*key, "write_ms"), w_iops * seconds * w_lat)
        node.add((*key, "io_ms"), min(1.0, queue) * seconds * 1000)
        node.add((*key, "weighted_io_ms"), queue * seconds * 1000)
