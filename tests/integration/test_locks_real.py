"""The locks and threads sources against the real kernel: test processes hold and wait on
POSIX (fcntl), OFD and flock locks and a lease on files in a temporary directory, and the
sources read them back from the real /proc/locks and /proc/<pid>/task. Every process is
stopped, by its pid, also when an assertion fails."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodescope.roots import Roots
from nodescope.sources.locks import LocksData, parse_locks, read_locks
from nodescope.sources.threads import read_process_threads

pytestmark = pytest.mark.integration

HOLD = """
import fcntl, os, sys
path, how = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_RDWR)
if how == "posix":
    fcntl.lockf(fd, fcntl.LOCK_EX)
elif how == "flock":
    fcntl.flock(fd, fcntl.LOCK_EX)
elif how == "ofd":
    import struct
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0))
elif how == "lease":
    os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
print("held", flush=True)
sys.stdin.read()
"""

WAIT = """
import fcntl, os, sys
path, how = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_RDWR)
if how == "write":
    fcntl.lockf(fd, fcntl.LOCK_EX)
elif how == "read10":
    fcntl.lockf(fd, fcntl.LOCK_SH, 10, 0)
elif how == "flock":
    fcntl.flock(fd, fcntl.LOCK_EX)
"""

# Holds ``count`` separate POSIX locks: every other byte, so that the kernel cannot merge
# neighbours into one lock.
HOLD_MANY = """
import fcntl, os, sys
path, count = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_RDWR)
for i in range(count):
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 2 * i)
print("held", flush=True)
sys.stdin.read()
"""

# Names itself with prctl(PR_SET_NAME) — any user may choose any 15 bytes, newlines and
# parentheses included — then waits for a write lock.
WAIT_NAMED = """
import ctypes, fcntl, os, sys
path, name = sys.argv[1], sys.argv[2].encode()
PR_SET_NAME = 15
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0) != 0:
    raise OSError(ctypes.get_errno(), "prctl")
fd = os.open(path, os.O_RDWR)
fcntl.lockf(fd, fcntl.LOCK_EX)
"""


class Processes:
    def __init__(self) -> None:
        self.started: list[subprocess.Popen[str]] = []

    def _holding(self, script: str, *args: str) -> subprocess.Popen[str]:
        """A child running ``script`` that says "held" once its locks are taken."""
        proc = subprocess.Popen(
            [sys.executable, "-c", script, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.started.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "held"
        return proc

    def hold(self, path: Path, how: str) -> subprocess.Popen[str]:
        return self._holding(HOLD, str(path), how)

    def wait(self, path: Path, how: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-c", WAIT, str(path), how])
        self.started.append(proc)
        return proc

    def hold_many(self, path: Path, count: int) -> subprocess.Popen[str]:
        return self._holding(HOLD_MANY, str(path), str(count))

    def wait_named(self, path: Path, name: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-c", WAIT_NAMED, str(path), name])
        self.started.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def processes() -> Iterator[Processes]:
    procs = Processes()
    try:
        yield procs
    finally:
        procs.stop()


def _until_blocked(pid: int, timeout: float = 10.0) -> LocksData:
    """Read the real /proc/locks until a request of ``pid`` waits in it."""
    deadline = time.monotonic() + timeout
    while True:
        data = read_locks(Roots())
        if any(w.pid == pid for lock in data.contended for w in lock.waiters):
            return data
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid} never showed as a waiter in /proc/locks")
        time.sleep(0.02)


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def test_posix_holder_and_waiters_linked(tmp_path: Path, processes: Processes) -> None:
    locked = tmp_path / "latest.lock"
    locked.write_text("x" * 100)
    st = os.stat(locked)
    holder = processes.hold(locked, "posix")
    writer = processes.wait(locked, "write")
    _until_blocked(writer.pid)
    # A read of bytes 0-9 conflicts with the queued write request too: the kernel queues it
    # behind that request, one level deeper.
    reader = processes.wait(locked, "read10")
    data = _until_blocked(reader.pid)

    [lock] = [c for c in data.contended if c.holder.pid == holder.pid]
    assert lock.kind == "POSIX"
    assert (lock.holder.access, lock.holder.comm) == ("WRITE", _comm(holder.pid))
    assert {(w.pid, w.access) for w in lock.waiters} == {(writer.pid, "WRITE"),
                                                        (reader.pid, "READ")}  # fmt: skip
    # The hex device numbers decode to the file's st_dev, the inode is the file's.
    assert lock.major is not None and lock.minor is not None
    assert os.makedev(lock.major, lock.minor) == st.st_dev
    assert lock.inode == st.st_ino
    # Resolved through the holder's open files and mountinfo.
    assert lock.path == str(locked)
    assert lock.mountpoint is not None
    assert os.stat(lock.mountpoint).st_dev == st.st_dev
    assert data.blocked >= 2

    # The raw lines: the writer waits on the holder, the reader on the writer's request.
    text = Path("/proc/locks").read_text()
    entries = parse_locks(text, "/proc/locks")
    by_pid = {e.pid: e for e in entries if e.inode == st.st_ino}
    assert by_pid[holder.pid].depth == 0
    blocker = by_pid[writer.pid].blocker
    assert blocker is not None and entries[blocker].pid == holder.pid
    # Since Linux 5.1 blocked requests form a tree (fs/locks.c locks_insert_block).
    assert by_pid[reader.pid].depth == 2
    reader_blocker = by_pid[reader.pid].blocker
    assert reader_blocker is not None and entries[reader_blocker].pid == writer.pid

    # The waiter sleeps interruptibly (S) in its fcntl: a lock wait, not D state.
    stats, blocked = read_process_threads(Roots(), writer.pid, None)
    assert [s.state for s in stats] == ["S"] and blocked == []

    # Released: the writer gets the lock, the reader gets it after the writer exits.
    holder.kill()
    holder.wait(timeout=10)
    assert writer.wait(timeout=10) == 0
    assert reader.wait(timeout=10) == 0
    after = read_locks(Roots())
    assert not any(c.inode == st.st_ino for c in after.contended)


def test_flock_ofd_and_lease(tmp_path: Path, processes: Processes) -> None:
    files = {how: tmp_path / f"{how}.file" for how in ("flock", "ofd", "lease")}
    for path in files.values():
        path.write_text("")
    flock_holder = processes.hold(files["flock"], "flock")
    ofd_holder = processes.hold(files["ofd"], "ofd")
    lease_holder = processes.hold(files["lease"], "lease")
    flock_waiter = processes.wait(files["flock"], "flock")
    data = _until_blocked(flock_waiter.pid)

    [lock] = [c for c in data.contended if c.holder.pid == flock_holder.pid]
    assert lock.kind == "FLOCK" and lock.inode == os.stat(files["flock"]).st_ino
    assert [w.pid for w in lock.waiters] == [flock_waiter.pid]
    assert lock.path == str(files["flock"])

    entries = parse_locks(Path("/proc/locks").read_text())
    by_inode = {e.inode: e for e in entries if e.depth == 0}
    ofd = by_inode[os.stat(files["ofd"]).st_ino]
    # OFD locks belong to the open file, not a process: pid -1.
    assert (ofd.kind, ofd.pid, ofd.access, ofd.end) == ("OFDLCK", -1, "WRITE", None)
    lease = by_inode[os.stat(files["lease"]).st_ino]
    assert (lease.kind, lease.mode, lease.access, lease.pid) == (
        "LEASE",
        "ACTIVE",
        "READ",
        lease_holder.pid,
    )
    counts = dict(data.counts)
    assert counts["FLOCK"] >= 1 and counts["OFDLCK"] >= 1 and counts["LEASE"] >= 1
    assert ofd_holder.poll() is None


def _kernel_text(path: str) -> str:
    """The file read to EOF a page at a time, as ``cat`` reads it."""
    fd = os.open(path, os.O_RDONLY)
    chunks = []
    try:
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode()


MANY_LOCKS = 900


def test_many_real_posix_locks_are_all_counted(tmp_path: Path, processes: Processes) -> None:
    """900 POSIX locks make /proc/locks about 50 KB, served a page per read: every one of them
    is counted, not the first page's."""
    locked = tmp_path / "many.lock"
    locked.write_bytes(b"\0" * (2 * MANY_LOCKS))
    inode = os.stat(locked).st_ino
    holder = processes.hold_many(locked, MANY_LOCKS)
    kernel = _kernel_text("/proc/locks")
    assert len(kernel) > 8 * 4096
    ours = [
        e for e in parse_locks(kernel, "/proc/locks") if e.inode == inode and e.pid == holder.pid
    ]
    assert len(ours) == MANY_LOCKS
    data = read_locks(Roots())
    assert not data.skipped
    assert dict(data.counts)["POSIX"] >= MANY_LOCKS


@pytest.mark.parametrize("name", ["x\ny) R 1", "\n\n\n", "a\nb\nc\nd\ne\nf\ng"])
def test_a_waiter_with_newlines_in_its_name_is_read_as_named(
    tmp_path: Path, processes: Processes, name: str
) -> None:
    """Any user can name a process with newlines and wait on a lock; its name is taken up to
    the newline the kernel adds, and the locks source stays whole."""
    locked = tmp_path / "named.lock"
    locked.write_text("x")
    holder = processes.hold(locked, "posix")
    waiter = processes.wait_named(locked, name)
    data = _until_blocked(waiter.pid)
    assert not data.skipped
    [lock] = [c for c in data.contended if c.holder.pid == holder.pid]
    assert [(w.pid, w.comm) for w in lock.waiters] == [(waiter.pid, name)]
