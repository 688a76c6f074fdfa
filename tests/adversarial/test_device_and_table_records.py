"""One bad record never takes its source down: InfiniBand ports, disk lines, lock lines,
mount blocks, PCI and udev attributes.

Each test drives the source as the daemon does — through the collector, over real captures,
real kernel files and real processes where the machine allows — and checks that the source
stays up, that the good records are all there, and that the bad one is counted in
``nodescope_source_records_skipped_total{source,reason}``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from nodescope.roots import Roots
from nodescope.sim.lspci import parse_lspci_vvv
from nodescope.sim.sysfs_tree import materialise
from nodescope.sources import diskstats, locks, mountstats, pci
from nodescope.sources import infiniband as ib
from tests.adversarial.common import one_cycle, skipped_metric

CAPTURES = Path(__file__).resolve().parents[1] / "fixtures" / "captures"
PROCFS_IB = CAPTURES / "procfs-sysfs-infiniband"


def _ports(data: ib.InfinibandData) -> Iterable[tuple[str, int]]:
    return [(p.device, p.port) for p in data.ports()]


# --------------------------------------------------------------------------------------------
# InfiniBand


def test_infiniband_reads_the_procfs_capture_whole() -> None:
    """mlx4_0 port 2 of this capture has ``link_layer`` = ``InfiniBand\\n\\n``: it took every
    device down."""
    snapshot = one_cycle(Roots.under(PROCFS_IB), ib.InfinibandSource())
    assert snapshot.status["infiniband"].up, snapshot.current["infiniband"].error
    data = snapshot.current["infiniband"].data
    assert isinstance(data, ib.InfinibandData)
    assert _ports(data) == [("hfi1_0", 1), ("mlx4_0", 1), ("mlx4_0", 2), ("mlx5_0", 1)]
    assert {p.link_layer for p in data.ports()} == {"InfiniBand"}
    assert not data.skipped
    assert skipped_metric(snapshot) == {}


@pytest.mark.alone  # a cycle within 4 s
def test_infiniband_bad_port_attributes_are_skipped_and_counted(tmp_path: Path) -> None:
    """A malformed ``rate`` on one port and a FIFO where another port's ``state`` should be:
    those two values are absent and counted, every port is still read, the cycle does not
    wait on the FIFO."""
    shutil.copytree(PROCFS_IB / "sys", tmp_path / "sys")
    base = tmp_path / "sys" / "class" / "infiniband"
    (base / "mlx4_0" / "ports" / "1" / "rate").write_text("fast\n")
    state = base / "hfi1_0" / "ports" / "1" / "state"
    state.unlink()
    os.mkfifo(state)
    (base / "mlx5_0" / "ports" / "1" / "counters" / "symbol_error").write_text("-1\n")

    started = time.monotonic()
    snapshot = one_cycle(Roots.under(tmp_path), ib.InfinibandSource())
    assert time.monotonic() - started < 4.0
    assert snapshot.status["infiniband"].up, snapshot.current["infiniband"].error
    data = snapshot.current["infiniband"].data
    assert isinstance(data, ib.InfinibandData)
    assert _ports(data) == [("hfi1_0", 1), ("mlx4_0", 1), ("mlx4_0", 2), ("mlx5_0", 1)]
    ports = {(p.device, p.port): p for p in data.ports()}
    assert ports[("mlx4_0", 1)].rate is None
    assert ports[("mlx4_0", 2)].rate == ib.LinkRate(40.0, 4, "QDR")
    assert ports[("hfi1_0", 1)].state is None
    assert ports[("hfi1_0", 1)].rate == ib.LinkRate(100.0, 4, "EDR")
    assert ports[("mlx5_0", 1)].counter("symbol_error") is None
    assert ports[("mlx5_0", 1)].counter("port_xmit_data") is not None
    assert skipped_metric(snapshot) == {
        ("infiniband", ib.SKIP_ATTRIBUTE_UNPARSABLE): 1,
        ("infiniband", ib.SKIP_FILE_REFUSED): 1,
        ("infiniband", ib.SKIP_COUNTER_UNPARSABLE): 1,
    }


# --------------------------------------------------------------------------------------------
# /proc/diskstats

_DISK_LINES = [
    "   8       0 sda 81234 3456 6498720 712000 23456 7890 1876480 298000 1 540000 1010000 77"
    " 3 616 90 12 4",
    "   8      16 sdb 5 0 40 3 0 0 0 0 0 3 3 0 0 0 0 0 0",
    " 259       0 nvme0n1 912345 10 7298760 152000 45678 9 365424 48000 0 250000 300000 12 0"
    " 96 4 1000 50",
]


def test_diskstats_malformed_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    """A truncated line, a line with a non-number and a line of garbage between good ones: the
    disks source stays up with every good disk."""
    lines = [
        _DISK_LINES[0],
        "   8      32 sdc 1 2 3",
        _DISK_LINES[1],
        "   8      48 sdd 1 2 3 4 5 6 7 8 9 10 eleven 0 0 0 0 0 0",
        "\x00\x01 garbage",
        _DISK_LINES[2],
    ]
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "diskstats").write_text("\n".join(lines) + "\n")
    (tmp_path / "proc" / "uptime").write_text("1000.00 2000.00\n")
    for disk in ("sda", "sdb", "sdc", "sdd", "nvme0n1"):
        (tmp_path / "sys" / "block" / disk).mkdir(parents=True)
    snapshot = one_cycle(Roots.under(tmp_path), diskstats.DisksSource())
    name = diskstats.SOURCE_NAME
    assert snapshot.status[name].up, snapshot.current[name].error
    data = snapshot.current[name].data
    assert isinstance(data, diskstats.DisksData)
    assert [d.name for d in data.disks] == ["nvme0n1", "sda", "sdb"]
    assert skipped_metric(snapshot) == {(name, diskstats.SKIP_LINE_UNPARSABLE): 3}


def test_diskstats_missing_as_a_whole_is_the_source_down(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    snapshot = one_cycle(Roots.under(tmp_path), diskstats.DisksSource())
    assert not snapshot.status[diskstats.SOURCE_NAME].up


# --------------------------------------------------------------------------------------------
# /proc/locks


def test_locks_malformed_lines_and_hostile_names_leave_the_source_up(tmp_path: Path) -> None:
    """A lock line of a class this parser does not know, a waiter whose blocker line was
    malformed, and a waiter named ``x\\ny) R 1``: every other lock is counted and the
    contended one resolved with the name as its process set it."""
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "locks").write_text(
        "1: POSIX  ADVISORY  WRITE 100 fe:00:10 0 EOF\n"
        "1: -> POSIX  ADVISORY  WRITE 101 fe:00:10 0 EOF\n"
        "2: NEWCLASS ADVISORY WRITE 102 fe:00:11 0 EOF\n"
        "3: POSIX  ADVISORY  WRITE 103 fe:00:12 0 whenever\n"
        "3: -> POSIX  ADVISORY  WRITE 104 fe:00:12 0 EOF\n"
        "4: FLOCK  ADVISORY  WRITE 105 fe:00:13 0 EOF\n"
    )
    (proc / "self" / "mountinfo").write_text(
        "24 1 254:0 / / rw,relatime - ext4 /dev/vda1 rw\nnot a mountinfo line\n"
    )
    for pid, comm in ((100, "holder"), (101, "x\ny) R 1")):
        (proc / str(pid)).mkdir()
        (proc / str(pid) / "comm").write_text(comm + "\n")
    snapshot = one_cycle(Roots.under(tmp_path), locks.LocksSource())
    assert snapshot.status[locks.NAME].up, snapshot.current[locks.NAME].error
    data = snapshot.current[locks.NAME].data
    assert isinstance(data, locks.LocksData)
    assert data.counts == (("FLOCK", 1), ("POSIX", 1))
    [lock] = data.contended
    assert lock.holder.comm == "holder"
    assert [(w.pid, w.comm) for w in lock.waiters] == [(101, "x\ny) R 1")]
    assert lock.mountpoint == "/"
    assert skipped_metric(snapshot) == {
        (locks.NAME, locks.SKIP_LOCK_LINE_UNPARSABLE): 2,
        (locks.NAME, locks.SKIP_LOCK_WAITER_ORPHANED): 1,
        (locks.NAME, locks.SKIP_MOUNTINFO_LINE_UNPARSABLE): 1,
    }


def test_locks_unreadable_as_a_whole_is_the_source_down(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    os.mkfifo(tmp_path / "proc" / "locks")
    snapshot = one_cycle(Roots.under(tmp_path), locks.LocksSource())
    assert not snapshot.status[locks.NAME].up
    assert "FIFO" in str(snapshot.current[locks.NAME].error)


# --------------------------------------------------------------------------------------------
# /proc/self/mountstats


def test_mountstats_malformed_block_is_skipped_and_counted(tmp_path: Path) -> None:
    nfs = (
        "device srv:/export mounted on /mnt/{name} with fstype nfs4 statvers=1.1\n"
        "\tage:\t{age}\n"
        "\tper-op statistics\n"
        "\t        NULL: 1 1 0 44 24 0 0 0 0\n"
        "\t        READ: 100 100 0 14000 104900000 5 150 200 0\n"
    )
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "mountstats").write_text(
        "device proc mounted on /proc with fstype proc\n"
        + nfs.format(name="a", age=10)
        + nfs.format(name="b", age="soon")
        + "device half a heading\n\tage:\t1\n"
        + nfs.format(name="c", age=30)
    )
    snapshot = one_cycle(Roots.under(tmp_path), mountstats.MountstatsSource())
    assert snapshot.status[mountstats.NAME].up, snapshot.current[mountstats.NAME].error
    data = snapshot.current[mountstats.NAME].data
    assert isinstance(data, mountstats.MountstatsData)
    assert [(m.mountpoint, m.age_seconds) for m in data.mounts] == [("/mnt/a", 10), ("/mnt/c", 30)]
    assert skipped_metric(snapshot) == {
        (mountstats.NAME, mountstats.SKIP_NFS_MOUNT_MALFORMED): 1,
        (mountstats.NAME, mountstats.SKIP_MOUNT_HEADING_UNPARSABLE): 1,
    }


MOUNTS_IN_NAMESPACE = 300

# Runs in a private mount namespace: mounts tmpfs many times — one with a source a user
# chose to look like an NFS heading — then reads mountstats as the source does and says what
# it saw next to the kernel's own count of mounts.
_IN_NAMESPACE = """
import json, os, subprocess, sys
from nodescope.collect import Collector, ScheduledSource
from nodescope.fileio import PROC_TABLE, read_text
from nodescope.roots import Roots
from nodescope.sources import mountstats
base, count = sys.argv[1], int(sys.argv[2])
hostile = "evil mounted on /etc with fstype nfs4 statvers=1.1\\n\\tage:\\tx"
for i in range(count):
    target = os.path.join(base, str(i))
    os.mkdir(target)
    source = hostile if i == count - 1 else f"tmpfs{i}"
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", source, target], check=True)
text = read_text("/proc/self/mountstats", PROC_TABLE)
with open("/proc/self/mountinfo", "rb") as handle:
    kernel_mounts = sum(1 for _ in handle)
collector = Collector(
    roots=Roots(), scheduled=[ScheduledSource(mountstats.MountstatsSource(), 1.0, 5.0)]
)
snapshot = collector.run_cycle()
collector.close()
status = snapshot.status[mountstats.NAME]
data = snapshot.current[mountstats.NAME].data
print(json.dumps({
    "bytes": len(text),
    "headings": sum(1 for line in text.split("\\n") if line.startswith("device ")),
    "kernel_mounts": kernel_mounts,
    "last_mount_seen": f" mounted on {base}/{count - 1} with fstype tmpfs" in text,
    "up": status.up,
    "skipped": dict(status.skipped_total),
    "nfs_mounts": [m.mountpoint for m in data.mounts] if data is not None else None,
}))
"""


def test_mountstats_of_hundreds_of_real_mounts_is_read_whole(tmp_path: Path) -> None:
    """300 tmpfs mounts in a private mount namespace make mountstats several pages long: it is
    read to its last mount, and a source string made to look like an NFS heading stays one
    escaped field of a tmpfs heading."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (util-linux) for a private mount namespace")
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"])
    if probe.returncode != 0:
        pytest.skip("unshare --mount is not permitted here")
    done = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            sys.executable,
            "-c",
            _IN_NAMESPACE,
            str(tmp_path),
            str(MOUNTS_IN_NAMESPACE),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["bytes"] > 4 * 4096
    assert seen["headings"] == seen["kernel_mounts"] >= MOUNTS_IN_NAMESPACE
    assert seen["last_mount_seen"]
    assert seen["up"] and seen["skipped"] == {} and seen["nfs_mounts"] == []


# --------------------------------------------------------------------------------------------
# PCI: a hot-plugged function's attributes

_TWO_PORTS = """\
00:01.0 PCI bridge: Intel Corporation Device 352a (rev 04) (prog-if 00 [Normal decode])
\tNUMA node: 0
\tBus: primary=00, secondary=18, subordinate=18, sec-latency=0
\tCapabilities: [40] Express (v2) Root Port (Slot+), MSI 00
\t\tLnkCap:\tPort #1, Speed 32GT/s, Width x16, ASPM not supported
\t\tLnkSta:\tSpeed 32GT/s (ok), Width x16 (ok)

00:02.0 PCI bridge: Intel Corporation Device 352a (rev 04) (prog-if 00 [Normal decode])
\tNUMA node: 0
\tBus: primary=00, secondary=19, subordinate=19, sec-latency=0
\tCapabilities: [40] Express (v2) Root Port (Slot+), MSI 00
\t\tLnkCap:\tPort #2, Speed 32GT/s, Width x16, ASPM not supported
\t\tLnkSta:\tSpeed 32GT/s (ok), Width x16 (ok)

18:00.0 3D controller: NVIDIA Corporation Device 2330 (rev a1)
\tNUMA node: 0
\tCapabilities: [60] Express (v2) Endpoint, MSI 00
\t\tLnkCap:\tPort #0, Speed 32GT/s, Width x16, ASPM L1
\t\tLnkSta:\tSpeed 32GT/s (ok), Width x16 (ok)
\tCapabilities: [1b8 v2] Advanced Error Reporting

19:00.0 3D controller: NVIDIA Corporation Device 2330 (rev a1)
\tNUMA node: 0
\tCapabilities: [60] Express (v2) Endpoint, MSI 00
\t\tLnkCap:\tPort #0, Speed 32GT/s, Width x16, ASPM L1
\t\tLnkSta:\tSpeed 32GT/s (ok), Width x16 (ok)
\tCapabilities: [1b8 v2] Advanced Error Reporting
"""


def _function_dir(root: Path, bdf: str) -> Path:
    return Path(os.path.realpath(root / "sys" / "bus" / "pci" / "devices" / bdf))


@pytest.mark.alone  # a cycle within 4 s
def test_pci_fifo_attributes_of_a_hot_plugged_gpu_skip_it_not_the_source(
    tmp_path: Path,
) -> None:
    """A GPU appears whose ``class`` is a FIFO (no writer will ever come), and the other GPU's
    ``aer_dev_fatal`` is one too: the first GPU is skipped, the second read without its AER
    file, the cycle never waits."""
    materialise(parse_lspci_vvv(_TWO_PORTS, "two-ports"), tmp_path, {0: (0, 1)})
    source = pci.PciSource()
    roots = Roots.under(tmp_path)
    first = one_cycle(roots, source)
    assert [d.bdf for d in first.current[pci.SOURCE_NAME].data.devices] == [
        "0000:00:01.0",
        "0000:00:02.0",
        "0000:18:00.0",
        "0000:19:00.0",
    ]
    for bdf, name in (("0000:18:00.0", "class"), ("0000:19:00.0", "aer_dev_fatal")):
        path = _function_dir(tmp_path, bdf) / name
        path.unlink()
        os.mkfifo(path)
    # A fresh source walks the tree, as after a hotplug event.
    started = time.monotonic()
    snapshot = one_cycle(roots, pci.PciSource())
    assert time.monotonic() - started < 4.0
    assert snapshot.status[pci.SOURCE_NAME].up, snapshot.current[pci.SOURCE_NAME].error
    topology = snapshot.current[pci.SOURCE_NAME].data
    assert [d.bdf for d in topology.devices] == ["0000:00:01.0", "0000:00:02.0", "0000:19:00.0"]
    gpu = topology.device("0000:19:00.0")
    assert [a.severity for a in gpu.aer] == ["correctable", "nonfatal"]
    assert skipped_metric(snapshot) == {
        (pci.SOURCE_NAME, pci.SKIP_FUNCTION_UNREADABLE): 1,
        (pci.SOURCE_NAME, pci.SKIP_FILE_REFUSED): 1,
    }
