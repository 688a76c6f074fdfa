"""sysstat's own iostat as the oracle for ``iostat_figures`` and ``nodescope iostat``.

iostat 12.6 reads /proc/uptime (its interval, in hundredths of a second), /proc/diskstats (with
``-p ALL``) and ``<dir>/block/<disk>/stat`` (by default, from /sys or the ``-f <dir>`` tree). The
test feeds it our fixture input: in a private mount namespace, the fixture's diskstats and uptime
are bind-mounted over /proc's, and ``-f`` points it at a sysfs-like tree holding the same
counters. Every column it prints (2 decimals) must match ours within rounding.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from nodescope.cli.iostat import run_iostat
from nodescope.roots import Roots
from nodescope.sources.diskstats import (
    IOSTAT_COLUMNS,
    DisksData,
    IostatReport,
    iostat_figures,
    parse_diskstats,
    read_disks,
    since_boot,
)
from tests.conftest import HOST_FIXTURE

pytestmark = pytest.mark.integration

# JSON and text carry two decimals: ours (unrounded) may differ by half a unit of the last digit.
TOLERANCE = 0.0051

# A GPU node's NVMe drives after weeks of checkpoints (20 fields, big counters, ms fields near
# 2^32), a partition, a SATA disk on a 4.18-5.4 kernel (18 fields) and an unused loop device.
NVME_LARGE = (
    "  259       0 nvme0n1 48123456789 1234567 98765432109876 4000000000"
    " 23456789012 7654321 87654321098765 4100000000 37 4200000000"
    " 4290000000 123456789 2345 9876543210 3999999999 987654321 4012345678\n"
    "  259       1 nvme0n1p1 48123456000 1234567 98765432100000 3999999000"
    " 23456789000 7654321 87654321090000 4099999000 37 4199999000"
    " 4289999000 123456789 2345 9876543210 3999999999 0 0\n"
    "  259       2 nvme1n1 912345 10 7298760 152000 45678 9 365424 48000 0"
    " 250000 300000 12 0 96 4 1000 50\n"
    "    8       0 sda 81234 3456 6498720 712000 23456 7890 1876480 298000"
    " 1 540000 1010000 77 3 616 90\n"
    "    7       0 loop0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n"
)
NVME_LARGE_UPTIME = "4000000.00 7000000.00\n"

# A kernel before 4.18: 14 fields, no discards or flushes.
OLD_KERNEL = (
    "    8       0 sda 215034 18034 9857464 1203456 103456 45678 4567890"
    " 876543 0 987654 2080000\n"
    "    8       1 sda1 214000 18000 9850000 1203000 103000 45600 4560000"
    " 876000 0 987000 2079000\n"
    "    8      16 sdb 5 0 40 3 0 0 0 0 0 3 3\n"
    "  253       0 dm-0 230000 0 9850000 1400000 149000 0 4560000 1100000 0"
    " 990000 2500000\n"
)
OLD_KERNEL_UPTIME = "86400.37 170000.00\n"


def _require_namespace() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the oracle bind-mounts over /proc in a private mount namespace")
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not available")
    if shutil.which("iostat") is None:
        pytest.fail("iostat is not installed (scripts/test.sh installs Debian's sysstat)")
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "true"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        pytest.skip(f"unshare -m is not permitted here: {probe.stderr.strip()}")


def make_root(root: Path, diskstats: str, uptime: str, whole: list[str]) -> Roots:
    """A tree laid out like a host: proc/diskstats, proc/uptime, sys/block/<disk>/stat."""
    for line in diskstats.splitlines():
        # iostat reads /proc/diskstats with a 256-byte fgets buffer.
        assert len(line) < 255, f"line too long for iostat: {line}"
    (root / "proc").mkdir(parents=True)
    (root / "proc" / "diskstats").write_text(diskstats)
    (root / "proc" / "uptime").write_text(uptime)
    write_sys_stats(root, diskstats, whole)
    return Roots.under(root)


def write_sys_stats(root: Path, diskstats: str, whole: list[str]) -> None:
    """/sys/block/<disk>/stat carries the counters of the diskstats line (block/genhd.c
    part_stat_show prints the same fields)."""
    for line in diskstats.splitlines():
        tokens = line.split()
        if tokens and tokens[2] in whole:
            d = root / "sys" / "block" / tokens[2]
            d.mkdir(parents=True, exist_ok=True)
            (d / "stat").write_text(" ".join(f"{t:>8}" for t in tokens[3:]) + "\n")


def in_namespace(root: Path, iostat_args: str) -> list[str]:
    """The command line that runs iostat with the fixture's /proc/diskstats and /proc/uptime."""
    q = shlex.quote
    script = (
        f"mount --bind {q(str(root / 'proc' / 'uptime'))} /proc/uptime && "
        f"mount --bind {q(str(root / 'proc' / 'diskstats'))} /proc/diskstats && "
        f"exec iostat {iostat_args}"
    )
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script]


# C locale for the decimal point, no colours; POSIXLY_CORRECT would switch iostat's units.
ENV = {k: v for k, v in os.environ.items() if k != "POSIXLY_CORRECT"} | {
    "LC_ALL": "C",
    "S_COLORS": "never",
}


def run_oracle(root: Path, iostat_args: str) -> str:
    done = subprocess.run(
        in_namespace(root, iostat_args), capture_output=True, text=True, timeout=60, env=ENV
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def json_reports(text: str) -> list[dict[str, dict[str, Any]]]:
    doc = json.loads(text)
    stats = doc["sysstat"]["hosts"][0]["statistics"]
    return [{d["disk_device"]: d for d in s["disk"]} for s in stats]


def assert_matches(report: IostatReport, theirs: dict[str, dict[str, Any]]) -> None:
    assert report.devices, "nothing to compare"
    for fig in report.devices:
        row = theirs[fig.device]
        for header, attr, key in IOSTAT_COLUMNS:
            ours = getattr(fig, attr)
            ours = 0.0 if ours is None else ours
            assert abs(ours - row[key]) <= TOLERANCE, (
                f"{fig.device} {header}: ours {ours!r}, iostat {row[key]!r}"
            )


def first_report(data: DisksData) -> IostatReport:
    assert data.uptime_seconds is not None
    return iostat_figures(since_boot(data), data, data.uptime_seconds)


CASES = {
    "this-machine": (
        (HOST_FIXTURE / "proc" / "diskstats").read_text(),
        (HOST_FIXTURE / "proc" / "uptime").read_text(),
        sorted(os.listdir(HOST_FIXTURE / "sys" / "block")),
    ),
    "nvme-large": (NVME_LARGE, NVME_LARGE_UPTIME, ["loop0", "nvme0n1", "nvme1n1", "sda"]),
    "14-fields": (OLD_KERNEL, OLD_KERNEL_UPTIME, ["dm-0", "sda", "sdb"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_since_boot_report_matches_iostat(case: str, tmp_path: Path) -> None:
    _require_namespace()
    diskstats, uptime, whole = CASES[case]
    roots = make_root(tmp_path, diskstats, uptime, whole)
    data = read_disks(roots)
    report = first_report(data)
    shown = {d.name for d in data.disks if not d.idle_since_boot}
    assert {f.device for f in report.devices} >= shown

    # Default mode: whole disks from <dir>/block/*/stat, idle ones hidden.
    by_sysfs = json_reports(
        run_oracle(tmp_path, f"-dxm -o JSON -f {shlex.quote(str(roots.sysfs))}")
    )
    assert set(by_sysfs[0]) == shown
    assert_matches(report, by_sysfs[0])

    # -p ALL: every line of /proc/diskstats, partitions included; ours are the whole disks.
    by_diskstats = json_reports(run_oracle(tmp_path, "-dxm -p ALL -o JSON"))
    assert set(by_diskstats[0]) == {s.name for s in parse_diskstats(diskstats)}
    assert_matches(report, by_diskstats[0])


@pytest.mark.parametrize("case", sorted(CASES))
def test_cli_prints_iostats_text(case: str, tmp_path: Path) -> None:
    _require_namespace()
    diskstats, uptime, whole = CASES[case]
    roots = make_root(tmp_path, diskstats, uptime, whole)
    theirs = run_oracle(tmp_path, "-dxm -p ALL").splitlines()
    out = io.StringIO()
    assert run_iostat(roots, None, None, out=out, show_banner=False) == 0
    ours = [line for line in out.getvalue().splitlines() if line]

    header = next(line for line in theirs if line.startswith("Device"))
    assert ours[0] == header
    rows = {line.split()[0]: line for line in theirs[theirs.index(header) + 1 :] if line}
    assert len(ours) > 1
    for line in ours[1:]:
        their = rows[line.split()[0]]
        # Same alignment, and every cell equal up to the last digit's rounding.
        assert len(line) == len(their), f"\nours:   {line}\niostat: {their}"
        for a, b in zip(line.split()[1:], their.split()[1:], strict=True):
            assert abs(float(a) - float(b)) <= 0.0101, f"\nours:   {line}\niostat: {their}"


# Two samples 2.5 s apart (by uptime). nvme0n1's read_ms and weighted_io_ms wrap at 2^32;
# sdb was removed and plugged in again (every count went down).
SAMPLE_A = (
    "  259 0 nvme0n1 1000000 5000 80000000 4294967000 300000 9000 24000000"
    " 900000 3 1200000 4294960000 5000 10 400000 2500 20000 1000\n"
    "    8 16 sdb 90000 100 7200000 45000 30000 50 2400000 60000 0 80000"
    " 105000 0 0 0 0 300 30\n"
)
SAMPLE_B = (
    "  259 0 nvme0n1 1010000 5100 80640000 700 303000 9150 24480000 912000"
    " 5 1202100 5000 5040 11 403200 2540 20250 1020\n"
    "    8 16 sdb 100 0 8000 50 20 0 160 40 0 90 90 0 0 0 0 2 1\n"
)


def test_two_samples_match_iostat_including_wraps_and_reinsertion(tmp_path: Path) -> None:
    _require_namespace()
    whole = ["nvme0n1", "sdb"]
    roots = make_root(tmp_path, SAMPLE_A, "1000.00 1900.00\n", whole)
    first = read_disks(roots)

    proc = subprocess.Popen(
        in_namespace(tmp_path, f"-dxm -o JSON -f {shlex.quote(str(roots.sysfs))} 1 2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    assert proc.stdout is not None
    head = []
    try:
        # iostat does not buffer its output: once the first report's disk array is closed,
        # its first sample has been taken and the files can move on to the second.
        while line := proc.stdout.readline():
            head.append(line)
            if line.strip() == "]":
                break
        write_sys_stats(tmp_path, SAMPLE_B, whole)
        (tmp_path / "proc" / "diskstats").write_text(SAMPLE_B)
        (tmp_path / "proc" / "uptime").write_text("1002.50 1904.00\n")
        rest = proc.stdout.read()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.stderr is not None
    assert proc.returncode == 0, proc.stderr.read()
    reports = json_reports("".join(head) + rest)
    assert len(reports) == 2

    second = read_disks(roots)
    assert_matches(first_report(first), reports[0])
    interval = iostat_figures(first, second, 2.5)
    assert_matches(interval, reports[1])
    # The wraps were counted as 996 ms of reads and 12296 weighted ms, not as resets.
    nvme = next(f for f in interval.devices if f.device == "nvme0n1")
    assert nvme.r_await == pytest.approx(996 / 10000)
    assert nvme.aqu_sz == pytest.approx(12296 / 2500)


# Real block devices: many loop devices make /proc/diskstats several pages long.

LOOP_DEVICES = 96


def _attach_loops(backing: Path, count: int) -> list[str]:
    """``count`` read-only loop devices over the sparse file ``backing``; the caller detaches
    them."""
    attached: list[str] = []
    try:
        for _ in range(count):
            done = subprocess.run(
                ["losetup", "--read-only", "--find", "--show", str(backing)],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if done.returncode != 0:
                pytest.skip(f"losetup cannot attach a loop device here: {done.stderr.strip()}")
            attached.append(done.stdout.strip())
    except BaseException:
        _detach_loops(attached)
        raise
    return attached


def _detach_loops(devices: list[str]) -> None:
    for device in devices:
        subprocess.run(["losetup", "--detach", device], capture_output=True, timeout=30)


def _kernel_lines(path: str) -> list[str]:
    """The file as the kernel serves it, read to EOF a page at a time like ``cat``."""
    fd = os.open(path, os.O_RDONLY)
    chunks = []
    try:
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode().splitlines()


def test_many_real_loop_devices_are_read_whole_as_iostat_sees_them(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("losetup") is None:
        pytest.skip("needs root and losetup (util-linux) to attach loop devices")
    if shutil.which("iostat") is None:
        pytest.fail("iostat is not installed (scripts/test.sh installs Debian's sysstat)")
    backing = tmp_path / "backing.img"
    with open(backing, "wb") as handle:
        handle.truncate(1 << 20)  # sparse: no disk space used
    devices = _attach_loops(backing, LOOP_DEVICES)
    try:
        # One read each, so that no device is an idle loop device (left out by design).
        for device in devices:
            fd = os.open(device, os.O_RDONLY | os.O_DIRECT)
            try:
                buffer = mmap.mmap(-1, 4096)
                os.readv(fd, [buffer])
            finally:
                os.close(fd)
        ours_names = {os.path.basename(d) for d in devices}

        kernel = _kernel_lines("/proc/diskstats")
        assert sum(len(line) + 1 for line in kernel) > 4096, "diskstats fits one page"
        data = read_disks(Roots())
        assert not data.skipped
        whole = {d.name for d in data.disks}
        assert ours_names <= whole
        # Every whole disk of the kernel's file, not only the first page's.
        listed = set(os.listdir("/sys/block"))
        kernel_whole = {line.split()[2] for line in kernel if line.split()[2] in listed}
        assert {d.name for d in data.disks} == {
            name
            for name in kernel_whole
            if name in whole or not re.fullmatch(r"(loop|ram|zram)\d+", name)
        }
        for disk in data.disks:
            if disk.name in ours_names:
                assert disk.reads_completed >= 1

        theirs = json_reports(
            subprocess.run(
                ["iostat", "-dx", "-p", "ALL", "-o", "JSON"],
                capture_output=True,
                text=True,
                timeout=60,
                env=ENV,
                check=True,
            ).stdout
        )[0]
        assert ours_names <= set(theirs)
        ours = {d.name: d for d in data.disks}
        for name in ours_names:
            # Since boot, r/s is reads / uptime: one read over hours rounds to 0.00, so compare
            # what does not depend on the clock: kilobytes per read, from our read of the
            # counters (a loop device keeps them across detach and attach: this test's one
            # 4 KiB read may not be the only one it has seen).
            disk = ours[name]
            expected = disk.sectors_read / 2 / disk.reads_completed
            assert theirs[name]["rareq-sz"] == pytest.approx(expected, abs=0.01)
    finally:
        _detach_loops(devices)
    remaining = subprocess.run(
        ["losetup", "--list", "--noheadings", "--output", "BACK-FILE"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    assert str(backing) not in remaining
