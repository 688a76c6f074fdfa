"""Real kernel files longer than a page, read end to end by a source on this machine.

Many POSIX locks (tests/integration/test_locks_real.py), a job cgroup with thousands of
threads and a mount namespace with hundreds of tmpfs mounts (tests/adversarial/
test_process_and_cgroup_records.py and test_device_and_table_records.py) are covered where
their sources are tested; this
file adds the disks: ``/proc/diskstats`` with more block devices than one page holds,
attached as loop devices when the machine has too few of its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodescope.roots import Roots
from nodescope.sources.diskstats import DisksData
from nodescope.sources.registry import SOURCES
from tests.conftest import is_root
from tests.kernelfs.server import PAGE

DISKSTATS = Path("/proc/diskstats")
#: /proc/diskstats must be longer than this, so one read cannot hold it. Loop devices are
#: global: attach only as many as that takes (an unattached loopN is listed already, so only
#: those past the machine's existing ones add lines).
LENGTH_WANTED = PAGE + PAGE // 4
#: Loop devices attached at most, whatever the machine has.
MAX_LOOPS = 160


#: ``LOOP_CTL_REMOVE`` (linux/loop.h): remove a free loop device this test created.
LOOP_CTL_REMOVE = 0x4C81


def first_read_length(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return len(os.read(fd, 65536))
    finally:
        os.close(fd)


def loop_devices() -> set[str]:
    return {name for name in os.listdir("/sys/block") if name.startswith("loop")}


@pytest.fixture
def diskstats_pages(tmp_path: Path) -> Iterator[None]:
    """A /proc/diskstats longer than a page: the machine's own, or grown with loop devices
    over small sparse files (each read once, so it is no idle device the source leaves
    out), detached and removed afterwards."""
    before = loop_devices()
    attached: list[str] = []
    try:
        while len(DISKSTATS.read_bytes()) < LENGTH_WANTED:
            if not is_root() or shutil.which("losetup") is None:
                pytest.skip("/proc/diskstats is short and loop devices need root and losetup")
            if len(attached) >= MAX_LOOPS:
                pytest.skip(f"{MAX_LOOPS} loop devices did not fill {LENGTH_WANTED} bytes")
            backing = tmp_path / f"loop{len(attached)}.img"
            with backing.open("wb") as f:
                f.truncate(1 << 20)
            run = subprocess.run(
                ["losetup", "--find", "--show", str(backing)],
                capture_output=True,
                text=True,
                check=False,
            )
            if run.returncode != 0:
                pytest.skip(f"cannot attach a loop device: {run.stderr.strip()}")
            attached.append(run.stdout.strip())
            with open(attached[-1], "rb") as device:
                device.read(4096)
        yield
    finally:
        for device in attached:
            subprocess.run(["losetup", "-d", device], capture_output=True, check=False)
        created = loop_devices() - before
        if created:
            control = os.open("/dev/loop-control", os.O_RDWR)
            try:
                for name in created:
                    with contextlib.suppress(OSError, ValueError):
                        fcntl.ioctl(control, LOOP_CTL_REMOVE, int(name.removeprefix("loop")))
            finally:
                os.close(control)


def test_the_disks_source_reads_every_disk_of_a_diskstats_longer_than_a_page(
    diskstats_pages: None,
):
    # The kernel hands /proc/diskstats out a page at a time: one read does not hold it.
    first_page = first_read_length(DISKSTATS)
    text = DISKSTATS.read_text()
    assert first_page <= PAGE < len(text)

    data = SOURCES["disks"].make().collect(Roots())
    assert isinstance(data, DisksData)
    seen = {disk.name for disk in data.disks}

    # What the source must report, read here by Python's own loop to EOF: every whole disk
    # (one with an entry in /sys/block), less loop, ram and zram devices that never
    # completed a request (left out on purpose: every host carries idle ones).
    whole = set(os.listdir("/sys/block"))
    expected: set[str] = set()
    past_first_page: set[str] = set()
    offset = 0
    for line in text.splitlines(keepends=True):
        fields = line.split()
        offset += len(line)
        if len(fields) < 14 or fields[2] not in whole:
            continue
        completed = [fields[i] for i in (3, 7, 14, 18) if i < len(fields)]
        if re.fullmatch(r"(loop|ram|zram)\d+", fields[2]) and set(completed) == {"0"}:
            continue
        expected.add(fields[2])
        if offset > first_page:
            past_first_page.add(fields[2])
    # Devices can come and go between the two reads (another process's loop device): allow
    # that much difference, never the disks past the first page.
    assert past_first_page, "no disk the source must report lies past the first page"
    assert past_first_page <= seen, sorted(past_first_page - seen)
    assert len(expected ^ seen) <= 2, sorted(expected ^ seen)
