"""A flood of file locks cannot hide a job's own lock waits.

Finding: an unprivileged user taking 100,000 POSIX lock ranges made one read of
``/proc/locks`` take seconds (the kernel walks its lock list from the start again for every
page it hands out), so the ``locks`` source timed out run after run and the hang diagnoses
lost their evidence; and with more than 64 contended locks the list was cut without
preferring job waiters, uncounted.

Real locks and real processes throughout: the flood is taken by a process running as
``nobody``; the job is two processes of this test (one holds a lock, the other waits on it)
whose pids a job cgroup lists (a cgroup v2 tree in a temporary directory: the test machine's
own hierarchy is not Slurm's). Every process is stopped by its pid, also on failure.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodescope.model.locks import LOCKS, ContendedLock
from nodescope.roots import Roots
from nodescope.sources import locks
from nodescope_exporters import event_metrics
from nodescope_exporters.prometheus import render
from tests.adversarial.common import one_cycle, skipped_metric

pytestmark = pytest.mark.integration

#: Locks of the flood: 500 files of 200 one-byte ranges each (the kernel checks a new lock
#: against every lock of its file, so one file of 100,000 would take minutes to make).
FLOOD = 100_000
FILES = 500

FLOOD_SCRIPT = """
import fcntl, os, sys
directory, count, files, uid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
# Started by root (the interpreter lives where only root may read): an unprivileged user from
# here on.
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
per = count // files
fds = []
for f in range(files):
    fd = os.open(f"{directory}/f{f}", os.O_RDWR | os.O_CREAT, 0o600)
    fds.append(fd)
    for i in range(per):
        # Every other byte, from the top down: no two merge, each insert is at the head.
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 2 * (per - i))
print("held", flush=True)
sys.stdin.read()
"""

HOLD = """
import fcntl, os, struct, sys
path, how = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_RDWR)
if how == "posix":
    fcntl.lockf(fd, fcntl.LOCK_EX)
else:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, 0, 0, 0))
print("held", flush=True)
sys.stdin.read()
"""

WAIT = """
import fcntl, os, struct, sys
path, how = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_RDWR)
if how == "posix":
    fcntl.lockf(fd, fcntl.LOCK_EX, 10, 0)
else:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, 0, 0, 0))
"""

# Holds an OFD lock on each file named, then waits on each through another open file from a
# thread of its own: one process, as many contended locks as files.
CONTEND = """
import fcntl, os, struct, sys, threading
paths = sys.argv[1:]
lock = struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, 0, 0, 0)
held = [os.open(p, os.O_RDWR) for p in paths]
for fd in held:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, lock)
def wait(path):
    fcntl.fcntl(os.open(path, os.O_RDWR), fcntl.F_OFD_SETLKW, lock)
for p in paths:
    threading.Thread(target=wait, args=(p,), daemon=True).start()
print("held", flush=True)
sys.stdin.read()
"""


class Processes:
    """Processes started by a test, each stopped by its pid at the end."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[str]] = []

    def start(self, script: str, *args: str) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [sys.executable, "-c", script, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            # One CPU for every locker: the kernel lists the locks taken on each CPU apart,
            # newest first, so those taken first are listed last.
            preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}),
        )
        self.started.append(process)
        return process

    def held(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.strip() == "held", f"no lock taken: exit {process.poll()}"

    def stop(self) -> None:
        for process in self.started:
            process.kill()
            process.wait(timeout=30)


@pytest.fixture
def processes() -> Iterator[Processes]:
    if os.geteuid() != 0:
        pytest.skip("needs root to run the flood as another user and read other processes")
    found = Processes()
    try:
        yield found
    finally:
        found.stop()


@pytest.fixture
def directory() -> Iterator[Path]:
    # Under /tmp itself: the flood's user must reach it.
    path = Path(tempfile.mkdtemp(prefix="nodescope-lockflood-", dir="/tmp"))
    path.chmod(0o777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _job_cgroup(base: Path, job: str, pids: list[int]) -> Roots:
    """A Slurm cgroup/v2 tree with ``job`` whose step holds ``pids``; the real /proc."""
    cgroupfs = base / "cgroup"
    step = cgroupfs / "system.slice" / "slurmstepd.scope" / f"job_{job}" / "step_0"
    step.mkdir(parents=True)
    (cgroupfs / "cgroup.controllers").write_text("cpu io memory pids\n")
    (step / "cgroup.procs").write_text("".join(f"{pid}\n" for pid in pids))
    return Roots(cgroupfs=cgroupfs)


def _waits_of(data: locks.LocksData, pid: int) -> list[ContendedLock]:
    return [lock for lock in data.contended if any(w.pid == pid for w in lock.waiters)]


def _until_blocked(pid: int) -> None:
    deadline = time.monotonic() + 10
    while "fcntl" not in Path(f"/proc/{pid}/wchan").read_text():
        assert time.monotonic() < deadline, "the waiter never blocked"
        time.sleep(0.02)


def test_a_flood_of_locks_neither_times_the_source_out_nor_hides_a_job_wait(
    processes: Processes, directory: Path, tmp_path: Path
) -> None:
    shared = directory / "checkpoint.lock"
    shared.write_bytes(b"\0" * 64)
    # The job's locks first: the flood's, taken after them, are listed before them.
    holder = processes.start(HOLD, str(shared), "posix")
    processes.held(holder)
    waiter = processes.start(WAIT, str(shared), "posix")
    _until_blocked(waiter.pid)
    nobody = pwd.getpwnam("nobody").pw_uid
    flood = processes.start(FLOOD_SCRIPT, str(directory), str(FLOOD), str(FILES), str(nobody))
    processes.held(flood)
    roots = _job_cgroup(tmp_path, "4242", [holder.pid, waiter.pid])

    start = time.monotonic()
    snapshot = one_cycle(roots, locks.make_source(), timeout=5.0)
    took = time.monotonic() - start
    data = snapshot.latest(LOCKS)
    assert data is not None, snapshot.current[locks.NAME].error
    assert took < 5.0
    # The table was read in part, and that is counted.
    assert data.truncated
    assert skipped_metric(snapshot)[(locks.NAME, locks.SKIP_LOCK_TABLE_TRUNCATED)] == 1
    # The job's wait is there, with its holder (from the job's fdinfo) and the file.
    [wait] = _waits_of(data, waiter.pid)
    assert wait.holder.pid == holder.pid and wait.holder.access == "WRITE"
    assert wait.kind == "POSIX" and wait.path == str(shared)
    assert [(w.pid, w.access) for w in wait.waiters] == [(waiter.pid, "WRITE")]
    assert (wait.start, wait.end) == (0, 9)
    assert wait.inode == shared.stat().st_ino
    # The flood's user is named, with at least the locks of the part read.
    assert data.flood_holders and data.flood_holders[0].uid == nobody
    assert data.flood_holders[0].locks >= locks.FLOOD_LOCKS
    text = render(snapshot, [event_metrics.families]).decode()
    assert f'nodescope_lock_holder_locks{{uid="{nobody}"}}' in text


def test_the_job_wait_among_70_contended_ofd_locks_is_kept_and_the_cut_counted(
    processes: Processes, directory: Path, tmp_path: Path
) -> None:
    paths = []
    for i in range(71):
        path = directory / f"shared{i}"
        path.write_bytes(b"\0")
        paths.append(path)
    # The job's contended lock is taken first: listed last in the table.
    holder = processes.start(HOLD, str(paths[0]), "posix")
    processes.held(holder)
    waiter = processes.start(WAIT, str(paths[0]), "posix")
    _until_blocked(waiter.pid)
    others = processes.start(CONTEND, *map(str, paths[1:]))
    processes.held(others)
    deadline = time.monotonic() + 10
    while Path("/proc/locks").read_text().count("-> OFDLCK") < 70:
        assert time.monotonic() < deadline, "the other waiters never blocked"
        time.sleep(0.05)
    roots = _job_cgroup(tmp_path, "77", [waiter.pid])

    snapshot = one_cycle(roots, locks.make_source(), timeout=5.0)
    data = snapshot.latest(LOCKS)
    assert data is not None, snapshot.current[locks.NAME].error
    assert len(data.contended) == locks.MAX_CONTENDED
    [wait] = _waits_of(data, waiter.pid)
    assert wait.holder.pid == holder.pid and wait.path == str(paths[0])
    # The job's lock came from the table itself, first in the list.
    assert data.contended[0] == wait
    skipped = skipped_metric(snapshot)
    assert skipped[(locks.NAME, locks.SKIP_LOCK_CONTENDED_DROPPED)] == 71 - locks.MAX_CONTENDED


def test_a_job_ofd_wait_is_found_though_the_table_shows_no_pid(
    processes: Processes, directory: Path, tmp_path: Path
) -> None:
    shared = directory / "ofd.lock"
    shared.write_bytes(b"\0")
    holder = processes.start(HOLD, str(shared), "ofd")
    processes.held(holder)
    waiter = processes.start(WAIT, str(shared), "ofd")
    _until_blocked(waiter.pid)
    roots = _job_cgroup(tmp_path, "88", [waiter.pid])
    data = locks.make_source().collect(roots)
    [wait] = _waits_of(data, waiter.pid)
    assert wait.kind == "OFDLCK" and wait.inode == shared.stat().st_ino
    # The table's own line for the same wait (pid -1) joined it: one lock, not two.
    assert sum(1 for lock in data.contended if lock.inode == shared.stat().st_ino) == 1
