"""No user can page or drain the node by making the kernel log an Xid or SXid line.

The kernel itself writes text any user chooses into its log: the file name of a crashing
binary in its ``segfault at`` report (facility 0, ``KERN_INFO``; the first 15 characters of
the name also start the record, as the task's ``comm``), the option a user passed to
``mount`` in tmpfs's ``Unknown parameter '…'`` error (``KERN_ERR``), and every record a user
writes to ``/dev/kmsg`` (given the user facility). Here the real kernel writes each of those
with a driver's Xid or SXid line in it, naming a GPU and an NVSwitch the node has, and the
real ``nvml`` (over the fake NVML, reading Xids from the kernel log) and ``sxid`` sources read
them from the real ``/dev/kmsg`` through the collector, followed by every detector: no Xid or
SXid is counted, nothing fires, and each forged record is counted as skipped.

Needs root (``/dev/kmsg`` readable and writable, ``mount(2)``), a C compiler (a binary that
faults in its own code, so the kernel names its file) and ``debug.exception-trace`` on; a
test skips with the reason where the machine lacks one.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodescope.analysis import Analyzer
from nodescope.assembly import default_config
from nodescope.collect import Collector, ScheduledSource
from nodescope.model.snapshot import Snapshot
from nodescope.roots import Roots
from nodescope.sim.fake_nvml import FakeNvml, hgx_h100
from nodescope.sources import nvml as nv
from nodescope.sources import sxid as sx

#: A fatal SXid of NVSwitch 0000:05:00.0, an NVSwitch of the test's node.
SXID_LINE = (
    "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 24007, Fatal, Link 30 sourcetrack timeout error"
)
#: An uncorrectable-ECC Xid (critical) of GPU 0 of the fake HGX H100 (0000:19:00.0).
XID_LINE = "NVRM: Xid (PCI:0000:19:00): 48, pid=1, name=x, An uncorrectable double bit error (DBE)"
#: The kinds a forged line would raise (and nothing else is to fire either).
XID_AND_SXID_KINDS = ("gpu_xid_", "nvswitch_sxid_", "gpu_fell_off_bus")

CRASH_C = "int main(void) { volatile int *p = 0; return *p; }\n"


def _need_kernel_log() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: /dev/kmsg and mount(2)")
    try:
        fd = os.open("/dev/kmsg", os.O_RDWR | os.O_NONBLOCK)
    except OSError as exc:
        pytest.skip(f"/dev/kmsg cannot be opened here: {exc}")
    os.close(fd)


@contextlib.contextmanager
def _kmsg_from_now() -> Iterator[int]:
    """A reader of ``/dev/kmsg`` positioned after the records already there."""
    fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    try:
        os.lseek(fd, 0, os.SEEK_END)
        yield fd
    finally:
        os.close(fd)


def _drain(fd: int) -> list[str]:
    records = []
    while True:
        try:
            records.append(os.read(fd, 8192).decode("utf-8", "replace"))
        except BlockingIOError:
            return records
        except BrokenPipeError:
            continue  # records overwritten before this read: go on


def _crash(binary: Path) -> None:
    """Run ``binary`` (it faults at once) without a core file."""

    def no_core() -> None:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    done = subprocess.run([str(binary)], preexec_fn=no_core, check=False, timeout=30)
    assert done.returncode == -11, done


def _mount_tmpfs_with_option(target: Path, option: str) -> None:
    """``mount(2)`` of a tmpfs with ``option``: the kernel refuses it and logs it (the
    legacy call has no fs_context log to keep the message from the kernel log)."""
    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.mount(b"none", str(target).encode(), b"tmpfs", 0, option.encode())
    if result == 0:  # never expected; leave nothing mounted
        libc.umount2(str(target).encode(), 0)
    assert result != 0


def _forge(tmp_path: Path) -> list[str]:
    """Make the kernel write every forged record; returns what it wrote (the records seen
    after a reader placed at the log's end, the kernel's own ones whose text we chose)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler: a crashing binary of our own file name cannot be made")
    if Path("/proc/sys/debug/exception-trace").read_text().strip() != "1":
        pytest.skip("debug.exception-trace is 0: the kernel does not report segfaults")
    source = tmp_path / "crash.c"
    source.write_text(CRASH_C)
    built = tmp_path / "crash"
    subprocess.run([compiler, "-O0", "-o", str(built), str(source)], check=True, timeout=120)
    # The SXid line is the whole file name, and its first 15 characters the comm that starts
    # the record; the Xid line follows 16 characters, so the comm holds none of it.
    crashers = [tmp_path / SXID_LINE, tmp_path / f"kernel-log-test {XID_LINE}"]
    for crasher in crashers:
        shutil.copy(built, crasher)
    target = tmp_path / "mnt"
    target.mkdir()
    wanted = {
        "segfault_sxid": lambda text: "segfault at" in text and "SXid (" in text,
        "segfault_xid": lambda text: "segfault at" in text and "NVRM: Xid" in text,
        "tmpfs_sxid": lambda text: text.startswith("3,") and "tmpfs" in text and "SXid" in text,
        "tmpfs_xid": lambda text: text.startswith("3,") and "tmpfs" in text and "Xid (" in text,
        "user_sxid": lambda text: text.startswith("11,") and "SXid (" in text,
        "user_xid": lambda text: text.startswith("11,") and "NVRM: Xid" in text,
    }
    seen: dict[str, str] = {}
    with _kmsg_from_now() as reader:
        # Segfault reports are rate-limited across the kernel (printk_ratelimit): a burst
        # elsewhere can swallow one, so the crashes are tried again a few times.
        for _attempt in range(4):
            for crasher in crashers:
                _crash(crasher)
            # A key cannot hold a comma: the text up to the Xid or SXid code.
            _mount_tmpfs_with_option(target, SXID_LINE.split(",")[0])
            _mount_tmpfs_with_option(target, XID_LINE.split(",")[0])
            writer = os.open("/dev/kmsg", os.O_WRONLY)
            try:
                # A priority of KERN_ERR in the kernel's facility is asked for; the kernel
                # gives the records the user facility all the same.
                os.write(writer, f"<3>{SXID_LINE}\n".encode())
                os.write(writer, f"<3>{XID_LINE}\n".encode())
            finally:
                os.close(writer)
            time.sleep(0.2)
            for record in _drain(reader):
                for name, matches in wanted.items():
                    if name not in seen and matches(record):
                        seen[name] = record
            if len(seen) == len(wanted):
                break
            time.sleep(5.0)
    missing = sorted(set(wanted) - set(seen))
    assert not missing, f"the kernel did not log {missing}"
    return list(seen.values())


def _nvswitch_sysfs(root: Path) -> Path:
    """A sysfs holding the node's NVSwitches (those of the fake HGX H100 and the forged
    line's 0000:05:00.0): a forged line names a switch the node really has."""
    sysfs = root / "sys"
    for bdf in ("0000:05:00.0", "0000:83:00.0", "0000:84:00.0"):
        device = sysfs / "bus" / "pci" / "devices" / bdf
        device.mkdir(parents=True)
        (device / "vendor").write_text("0x10de\n")
        (device / "class").write_text("0x068000\n")
    return sysfs


def _xid_and_sxid(snapshot: Snapshot) -> tuple[tuple[object, ...], tuple[object, ...]]:
    nvml_data = snapshot.current["nvml"].data
    sxid_data = snapshot.current["sxid"].data
    assert isinstance(nvml_data, nv.NvmlData) and isinstance(sxid_data, sx.SxidData)
    return nvml_data.xids, sxid_data.counts


def test_lines_the_kernel_writes_for_a_user_are_no_xid_or_sxid(tmp_path: Path) -> None:
    _need_kernel_log()
    gpus = hgx_h100()
    for gpu in gpus:
        gpu.supported_events = 0  # no NVML event set: Xids come from the kernel log
    nvml_source = nv.NvmlSource(FakeNvml(gpus), event_wait_ms=50)
    sxid_source = sx.SxidSource()
    roots = Roots(sysfs=_nvswitch_sysfs(tmp_path), dev=Path("/dev"))
    collector = Collector(
        roots=roots,
        scheduled=[ScheduledSource(s, 1.0, 30.0) for s in (nvml_source, sxid_source)],
    )
    analyzer = Analyzer.from_config(default_config())
    fired: list[str] = []

    def cycle() -> Snapshot:
        snapshot = analyzer.analyze(collector.run_cycle(force=True))
        fired.extend(f.kind for f in snapshot.findings if f.kind.startswith(XID_AND_SXID_KINDS))
        return snapshot

    try:
        # The first runs read what the ring buffer already holds, until the NVML source has
        # found it gets no Xid events and reads the kernel log.
        deadline = time.monotonic() + 30.0
        snapshot = cycle()
        while snapshot.current["nvml"].data is None or (
            snapshot.current["nvml"].data.xid_source != nv.XID_SOURCE_KMSG
        ):
            assert time.monotonic() < deadline, "the nvml source never read the kernel log"
            time.sleep(0.05)
            snapshot = cycle()
        snapshot = cycle()
        before = {name: dict(snapshot.status[name].skipped_total) for name in ("nvml", "sxid")}
        xids_before, sxids_before = _xid_and_sxid(snapshot)

        written = _forge(tmp_path)
        # One segfault report is enough to page on the code before: each is a record the
        # kernel wrote at facility 0, with the driver's line after its own text.
        assert any(r.startswith("6,") and SXID_LINE in r for r in written), written
        assert any(r.startswith("6,") and XID_LINE in r for r in written), written

        for _ in range(3):
            snapshot = cycle()
        after = {name: dict(snapshot.status[name].skipped_total) for name in ("nvml", "sxid")}
    finally:
        collector.close()

    assert _xid_and_sxid(snapshot) == (xids_before, sxids_before), "a forged line was counted"
    assert fired == [], f"forged kernel-log lines raised {fired}"
    assert snapshot.status["nvml"].up and snapshot.status["sxid"].up

    def grown(name: str, reason: str) -> int:
        return after[name].get(reason, 0) - before[name].get(reason, 0)

    # Each forged record is counted as skipped, with why: the segfault report's level
    # (KERN_INFO), tmpfs's error not starting with the driver's line, the user facility.
    assert grown("sxid", sx.SKIP_LEVEL) >= 1
    assert grown("sxid", sx.SKIP_UNPARSABLE) >= 1
    assert grown("sxid", sx.SKIP_NOT_KERNEL) >= 1
    assert grown("nvml", nv.SKIP_XID_LEVEL) >= 1
    assert grown("nvml", nv.SKIP_XID_UNPARSABLE) >= 1
    assert grown("nvml", nv.SKIP_XID_NOT_KERNEL) >= 1


#: A Python process that waits for a line on stdin, then faults in C (a read of address 0).
FAULTING_PY = "import ctypes, sys; sys.stdin.readline(); ctypes.string_at(0)"


def test_the_kernels_own_segfault_record_names_the_process_it_ended(tmp_path: Path) -> None:
    """A real process killed by SIGSEGV: the sxid source reads the kernel's record of it
    from the real ``/dev/kmsg`` with its pid, its name and the signal; the same text written
    to ``/dev/kmsg`` from user space is refused and counted."""
    _need_kernel_log()
    if Path("/proc/sys/debug/exception-trace").read_text().strip() != "1":
        pytest.skip("debug.exception-trace is 0: the kernel does not report segfaults")
    source = sx.SxidSource()
    roots = Roots(sysfs=tmp_path, dev=Path("/dev"))

    def no_core() -> None:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    try:
        source.collect(roots)  # what the ring buffer held before
        found = []
        # Segfault reports are rate-limited across the kernel: tried again a few times.
        for _attempt in range(4):
            child = subprocess.Popen(
                [sys.executable, "-c", FAULTING_PY], stdin=subprocess.PIPE, preexec_fn=no_core
            )
            comm = Path(f"/proc/{child.pid}/comm").read_text().rstrip("\n")
            child.communicate(b"go\n", timeout=30)
            assert child.returncode == -11
            forger = os.open("/dev/kmsg", os.O_WRONLY)
            try:
                forged_pid = child.pid + 1_000_000
                os.write(
                    forger,
                    f"<6>{comm}[{forged_pid}]: segfault at 0 ip 0000000000401126 sp"
                    f" 00007ffc8a1e9f30 error 4 in libc.so.6[7f0000000000+1000]\n".encode(),
                )
            finally:
                os.close(forger)
            time.sleep(0.2)
            data = source.collect(roots)
            assert forged_pid not in {e.pid for e in data.ended}
            assert data.skipped.counts.get("process_end_not_from_kernel", 0) >= 1
            found = [e for e in data.ended if e.pid == child.pid]
            if found:
                break
    finally:
        source.close()
    assert [(e.pid, e.comm, e.signal, e.cause) for e in found] == [
        (child.pid, comm, "SIGSEGV", "segfault")
    ]
    assert found[0].kernel_usec is not None and found[0].kernel_usec > 0
