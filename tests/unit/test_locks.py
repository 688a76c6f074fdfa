"""The locks source: /proc/locks parsed and waiters linked, mountinfo, contended locks resolved
to mount, path and processes on a fixture tree; the capture of this host."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.errors import ParseError
from nodescope.model.skips import SkipTally
from nodescope.roots import Roots
from nodescope.sources.locks import (
    LOCK_SYSCALLS,
    SKIP_LOCK_LINE_UNPARSABLE,
    SKIP_LOCK_WAITER_ORPHANED,
    SKIP_MOUNTINFO_LINE_UNPARSABLE,
    LockEntry,
    LocksData,
    LockWait,
    MountInfo,
    contended,
    make_source,
    mount_of,
    parse_comm,
    parse_locks,
    parse_mountinfo,
    parse_mountinfo_line,
    parse_syscall,
    read_locks,
    read_table,
    unescape_mount_field,
)

HOST = Path(__file__).parent.parent / "fixtures" / "hosts" / "kvm-epyc-debian12"

# Read back from Linux 6.18's /proc/locks on this machine: a POSIX write lock, a write request
# blocked on it and a read request blocked behind that request (depth 2).
REAL = (
    "1: POSIX  ADVISORY  WRITE 7806 fe:00:2146341 0 EOF\n"
    "1: -> POSIX  ADVISORY  WRITE 7807 fe:00:2146341 0 EOF\n"
    "1:  -> POSIX  ADVISORY  READ 7808 fe:00:2146341 0 9\n"
)

EVERY_CLASS = (
    "1: POSIX  ADVISORY  READ 10 00:2f:1054 100 199\n"
    "2: FLOCK  ADVISORY  WRITE 11 fd:01:12 0 EOF\n"
    "3: OFDLCK ADVISORY  READ -1 00:05:3 0 EOF\n"
    "4: LEASE  ACTIVE    READ 12 08:02:5 0 EOF\n"
    "5: DELEG  BREAKING  WRITE 0 00:33:77 0 EOF\n"
    "6: LEASE  BREAKER   UNLCK 13 08:02:6 0 EOF\n"
    "7: ACCESS ADVISORY  READ 14 00:2f:99 0 EOF\n"
    "8: POSIX *NOINODE* WRITE 15 <none>:0 0 EOF\n"
    "9: POSIX  MANDATORY WRITE 16 103:1f:8 0 EOF\n"
)


def test_real_waiter_tree() -> None:
    entries = parse_locks(REAL)
    assert [(e.pid, e.depth, e.blocker) for e in entries] == [(7806, 0, None), (7807, 1, 0),
                                                              (7808, 2, 1)]  # fmt: skip
    holder = entries[0]
    assert holder == LockEntry(1, 0, "POSIX", "ADVISORY", "WRITE", 7806, 0xFE, 0, 2146341, 0,
                               None, 1)  # fmt: skip
    assert holder.device == "fe:00"
    assert holder.st_dev == os.makedev(254, 0)
    assert entries[2].access == "READ" and entries[2].end == 9
    # Both requests wait, directly or not, on the one granted lock.
    [(granted, waiting)] = contended(entries)
    assert granted is holder
    assert [w.pid for w in waiting] == [7807, 7808]


def test_every_lock_class() -> None:
    entries = parse_locks(EVERY_CLASS)
    assert [(e.kind, e.mode, e.access, e.pid) for e in entries] == [
        ("POSIX", "ADVISORY", "READ", 10),
        ("FLOCK", "ADVISORY", "WRITE", 11),
        ("OFDLCK", "ADVISORY", "READ", -1),
        ("LEASE", "ACTIVE", "READ", 12),
        ("DELEG", "BREAKING", "WRITE", 0),
        ("LEASE", "BREAKER", "UNLCK", 13),
        ("ACCESS", "ADVISORY", "READ", 14),
        ("POSIX", "*NOINODE*", "WRITE", 15),
        ("POSIX", "MANDATORY", "WRITE", 16),
    ]
    assert (entries[0].start, entries[0].end) == (100, 199)
    assert (entries[1].major, entries[1].minor, entries[1].inode) == (0xFD, 1, 12)
    assert entries[7].major is None and entries[7].device is None and entries[7].st_dev is None
    # Majors above 0xff print with more digits.
    assert (entries[8].major, entries[8].minor) == (0x103, 0x1F)
    assert contended(entries) == []


def test_waiters_of_two_locks_with_the_same_id_space() -> None:
    text = (
        "1: POSIX  ADVISORY  WRITE 1 00:2f:10 0 EOF\n"
        "1: -> POSIX  ADVISORY  WRITE 2 00:2f:10 0 EOF\n"
        "2: FLOCK  ADVISORY  WRITE 3 00:2f:11 0 EOF\n"
        "2: -> FLOCK  ADVISORY  WRITE 4 00:2f:11 0 EOF\n"
        "2: -> FLOCK  ADVISORY  WRITE 5 00:2f:11 0 EOF\n"
    )
    pairs = contended(parse_locks(text))
    assert [(h.pid, [w.pid for w in ws]) for h, ws in pairs] == [(1, [2]), (3, [4, 5])]


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("x: POSIX  ADVISORY  WRITE 1 00:2f:10 0 EOF\n", 1),
        ("1: POSIX  ADVISORY  WRITE 1 00:2f:10 0 EOF\n2: BOGUS A WRITE 1 00:2f:10 0 EOF\n", 2),
        ("1: POSIX  ADVISORY  WRITE 1 00:2f:10 0\n", 1),
        ("1: POSIX  ADVISORY  WRITE 1 0g:2f:10 0 EOF\n", 1),
        ("1: POSIX  ADVISORY  WRITE 1 00:2f:0x10 0 EOF\n", 1),
        ("1: POSIX  ACTIVE  WRITE 1 00:2f:10 0 EOF\n", 1),
        ("1: LEASE  ADVISORY  WRITE 1 00:2f:10 0 EOF\n", 1),
        ("1: POSIX  ADVISORY  WRLCK 1 00:2f:10 0 EOF\n", 1),
        ("1: POSIX  ADVISORY  WRITE one 00:2f:10 0 EOF\n", 1),
        ("1: POSIX  ADVISORY  WRITE 1 00:2f:10 0 END\n", 1),
        ("1: -> POSIX  ADVISORY  WRITE 1 00:2f:10 0 EOF\n", 1),
        ("1: POSIX  ADVISORY  WRITE 1 00:2f:10 0 EOF\n1:  -> POSIX  ADVISORY  WRITE 2 00:2f:10"
         " 0 EOF\n", 2),
        ("1:\n", 1),
    ],
)  # fmt: skip
def test_parse_locks_skips_and_counts_a_malformed_line(text: str, line: int) -> None:
    tally = SkipTally()
    good = "9: FLOCK  ADVISORY  WRITE 77 00:19:1042 0 EOF\n"
    entries = parse_locks(text + good, "locks", tally)
    # The lines before and after the bad one are read; the bad one is named in the example.
    assert entries[-1].id == 9 and entries[-1].pid == 77
    assert len(entries) == len([ln for ln in text.split("\n") if ln.strip()])
    skipped = tally.freeze()
    assert sum(skipped.counts.values()) == 1
    (example,) = skipped.examples.values()
    assert example.startswith(f"locks:{line}")


def test_waiter_of_a_skipped_lock_is_skipped_too() -> None:
    tally = SkipTally()
    text = (
        "1: POSIX  ADVISORY  WRITE 7806 fe:00:2146341 0 SOMEDAY\n"
        "1: -> POSIX  ADVISORY  WRITE 7807 fe:00:2146341 0 EOF\n"
        "2: FLOCK  ADVISORY  WRITE 11 fd:01:12 0 EOF\n"
    )
    entries = parse_locks(text, "locks", tally)
    assert [(e.id, e.pid) for e in entries] == [(2, 11)]
    assert tally.freeze().counts == {
        SKIP_LOCK_LINE_UNPARSABLE: 1,
        SKIP_LOCK_WAITER_ORPHANED: 1,
    }


MOUNTINFO = (
    "24 1 9:0 / / rw,relatime shared:1 - ext4 /dev/md0 rw\n"
    "40 24 0:52 / /mnt/ckpt rw,relatime shared:40 - nfs4 ckpt-nfs:/export/ckpt rw,vers=4.2\n"
    "41 24 0:52 /run41 /mnt/run\\04041 rw shared:41 master:2 - nfs4 ckpt-nfs:/export/ckpt rw\n"
)


def test_parse_mountinfo() -> None:
    mounts = parse_mountinfo(MOUNTINFO)
    assert mounts[1] == MountInfo(40, 24, 0, 52, "/", "/mnt/ckpt", "nfs4", "ckpt-nfs:/export/ckpt")
    # Octal escapes undone; any number of optional fields before the "-".
    assert mounts[2].mountpoint == "/mnt/run 41" and mounts[2].root == "/run41"
    # A bind mount of the same superblock: the one showing its root wins.
    assert mount_of(mounts, 0, 52) == mounts[1]
    assert mount_of(mounts, 0, 53) is None
    assert unescape_mount_field("a\\011b\\134c") == "a\tb\\c"


@pytest.mark.parametrize(
    "text",
    [
        "24 1 9:0 / / rw,relatime shared:1 ext4 /dev/md0 rw\n",
        "24 1 9:0 / / rw - ext4\n",
        "24 1 9-0 / / rw - ext4 /dev/md0 rw\n",
        "x 1 9:0 / / rw - ext4 /dev/md0 rw\n",
    ],
)
def test_parse_mountinfo_skips_and_counts_a_malformed_line(text: str) -> None:
    with pytest.raises(ParseError) as err:
        parse_mountinfo_line(text.rstrip("\n"), 1, "mi")
    assert err.value.line == 1
    tally = SkipTally()
    assert parse_mountinfo(text + MOUNTINFO, "mi", tally) == parse_mountinfo(MOUNTINFO)
    assert tally.freeze().counts == {SKIP_MOUNTINFO_LINE_UNPARSABLE: 1}


def test_parse_comm() -> None:
    assert parse_comm("rsync\n") == "rsync"
    assert parse_comm("NCCL Progress 0\n") == "NCCL Progress 0"
    # A name a process chose with prctl(PR_SET_NAME): newlines are part of it.
    assert parse_comm("x\ny) R 1\n") == "x\ny) R 1"
    assert parse_comm("\n\n") == "\n"


def _tree(tmp_path: Path, locked: Path, holder: int, waiter: int) -> Roots:
    """A procfs with /proc/locks naming ``locked`` (the real file's device and inode), its
    holder's open file as an ``fd`` link, comm files and mountinfo."""
    st = os.stat(locked)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    where = f"{major:02x}:{minor:02x}:{st.st_ino}"
    (proc / "locks").write_text(
        f"1: FLOCK  ADVISORY  WRITE 9 00:19:1042 0 EOF\n"
        f"2: POSIX  ADVISORY  WRITE {holder} {where} 0 EOF\n"
        f"2: -> POSIX  ADVISORY  WRITE {waiter} {where} 0 EOF\n"
    )
    (proc / "self" / "mountinfo").write_text(
        f"24 1 {major}:{minor} / /data rw,relatime - ext4 /dev/data rw\n"
    )
    for pid, comm in ((holder, "rsync"), (waiter, "python3")):
        (proc / str(pid) / "fd").mkdir(parents=True)
        (proc / str(pid) / "comm").write_text(f"{comm}\n")
    (proc / str(holder) / "fd" / "0").symlink_to("/dev/null")
    (proc / str(holder) / "fd" / "7").symlink_to(locked)
    return Roots.under(tmp_path)


def test_read_locks_resolves_the_contended_lock(tmp_path: Path) -> None:
    locked = tmp_path / "run42" / "latest.lock"
    locked.parent.mkdir()
    locked.write_text("")
    data = read_locks(_tree(tmp_path, locked, holder=3017, waiter=2146))
    assert data.counts == (("FLOCK", 1), ("POSIX", 1))
    assert data.blocked == 1
    [lock] = data.contended
    assert (lock.holder.pid, lock.holder.comm, lock.holder.access) == (3017, "rsync", "WRITE")
    assert [(w.pid, w.comm) for w in lock.waiters] == [(2146, "python3")]
    assert lock.inode == os.stat(locked).st_ino
    assert (lock.mountpoint, lock.fstype, lock.mount_source) == ("/data", "ext4", "/dev/data")
    assert lock.path == str(locked)
    assert not lock.is_nfs


def test_path_unresolved_when_the_holder_has_no_such_open_file(tmp_path: Path) -> None:
    locked = tmp_path / "f"
    locked.write_text("")
    roots = _tree(tmp_path, locked, holder=30, waiter=31)
    (roots.procfs / "30" / "fd" / "7").unlink()
    [lock] = read_locks(roots).contended
    assert lock.path is None and lock.holder.comm == "rsync"


def test_a_holder_outside_any_job_is_named_by_its_unit(tmp_path: Path) -> None:
    # /proc/<pid>/cgroup of a hybrid host's system service: v1 lines, then the unified one.
    locked = tmp_path / "f"
    locked.write_text("")
    roots = _tree(tmp_path, locked, holder=3017, waiter=2146)
    (roots.procfs / "3017" / "cgroup").write_text(
        "12:memory:/system.slice/rsync-backup.service\n"
        "1:name=systemd:/system.slice/rsync-backup.service\n"
        "0::/system.slice/rsync-backup.service\n"
    )
    [lock] = read_locks(roots).contended
    assert lock.holder.cgroup == "/system.slice/rsync-backup.service"
    assert lock.holder.unit == "rsync-backup.service"
    # A user's shell: its session scope; a cgroup v1-only host: systemd's hierarchy.
    (roots.procfs / "3017" / "cgroup").write_text(
        "0::/user.slice/user-1000.slice/session-4.scope\n"
    )
    [lock] = read_locks(roots).contended
    assert lock.holder.unit == "session-4.scope"
    (roots.procfs / "3017" / "cgroup").write_text("1:name=systemd:/system.slice/cron.service\n")
    [lock] = read_locks(roots).contended
    assert lock.holder.cgroup == "/system.slice/cron.service"
    # Unreadable or malformed: nothing claimed.
    (roots.procfs / "3017" / "cgroup").write_text("garbage\n")
    [lock] = read_locks(roots).contended
    assert lock.holder.cgroup is None and lock.holder.unit is None
    (roots.procfs / "3017" / "cgroup").unlink()
    [lock] = read_locks(roots).contended
    assert lock.holder.cgroup is None and lock.holder.comm == "rsync"


def test_a_real_holder_s_cgroup_is_read_from_its_proc(tmp_path: Path) -> None:
    """flock(1) holding a lock and another waiting on it, real processes on this host: the
    holder's cgroup is what its /proc/<pid>/cgroup says."""
    import shutil
    import subprocess
    import time

    from nodescope.sources.cgroup import read_proc_cgroup

    if shutil.which("flock") is None:
        pytest.skip("no flock(1)")
    locked = tmp_path / "held.lock"
    locked.write_text("")
    holder = subprocess.Popen(["flock", str(locked), "sleep", "60"])
    waiter = None
    try:
        time.sleep(0.3)
        waiter = subprocess.Popen(["flock", str(locked), "true"])
        mine: list[object] = []
        for _ in range(50):
            data = read_locks(Roots())
            mine = [c for c in data.contended if any(w.pid == waiter.pid for w in c.waiters)]
            if mine:
                break
            time.sleep(0.1)
        [lock] = mine
        assert isinstance(lock, type(data.contended[0]))
        seen = read_proc_cgroup(Roots(), lock.holder.pid)
        assert seen is not None
        assert lock.holder.cgroup == (seen.v2_path or seen.v1_path("name=systemd"))
        assert lock.holder.cgroup is not None and lock.holder.cgroup.startswith("/")
    finally:
        for proc in (waiter, holder):
            if proc is not None:
                proc.kill()
                proc.wait(timeout=10)


def test_uncontended_locks_read_no_mountinfo(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "locks").write_text("1: POSIX  ADVISORY  WRITE 1 00:19:1 0 EOF\n")
    source = make_source()
    assert source.name == "locks"
    data = source.collect(Roots.under(tmp_path))
    assert data == LocksData((("POSIX", 1),), 0, ())


def test_capture_of_this_host() -> None:
    """scripts/capture/hangs.sh: flock(1) waiting on a lock held by another process."""
    roots = Roots.under(HOST)
    data = read_locks(roots)
    flocks = [lock for lock in data.contended if lock.kind == "FLOCK"]
    assert flocks, data
    lock = flocks[0]
    assert lock.waiters[0].comm == "flock"
    assert lock.device == "fe:00" and lock.mountpoint == "/" and lock.fstype == "ext4"
    # The holder's process is gone since the capture: nothing more is claimed.
    assert lock.holder.comm is None and lock.path is None
    assert parse_mountinfo((HOST / "proc/self/mountinfo").read_text())


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_parse_locks_fuzz(text: str) -> None:
    tally = SkipTally()
    entries = parse_locks(text, tally=tally)
    lines = [ln for ln in text.split("\n") if ln.strip()]
    assert len(entries) + sum(tally.freeze().counts.values()) == len(lines)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 3),
            st.integers(0, 2),
            st.sampled_from(["POSIX  ADVISORY ", "FLOCK  ADVISORY ", "LEASE  ACTIVE   ", "X Y"]),
            st.sampled_from(["READ", "WRITE", "UNLCK", "?"]),
            st.integers(-2, 99999),
            st.sampled_from(["00:2f:1054", "fe:00:1", "<none>:0", "0:0"]),
            st.sampled_from(["0 EOF", "1 2", "0", "a b"]),
        ),
        max_size=8,
    )
)
def test_parse_locks_fuzz_structured(
    lines: list[tuple[int, int, str, str, int, str, str]],
) -> None:
    text = "".join(
        f"{i}:{' ' * d}{'-> ' if d else ''}{kind} {access} {pid} {where} {span}\n"
        for i, d, kind, access, pid, where, span in lines
    )
    tally = SkipTally()
    entries = parse_locks(text, tally=tally)
    assert len(entries) + sum(tally.freeze().counts.values()) == len(lines)
    for entry in entries:
        assert (entry.blocker is None) == (entry.depth == 0)
        if entry.blocker is not None:
            assert entries[entry.blocker].depth == entry.depth - 1


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_parse_mountinfo_fuzz(text: str) -> None:
    tally = SkipTally()
    mounts = parse_mountinfo(text, tally=tally)
    lines = [ln for ln in text.split("\n") if ln.strip()]
    assert len(mounts) + sum(tally.freeze().counts.values()) == len(lines)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_parse_comm_fuzz(text: str) -> None:
    name = parse_comm(text)
    assert name + "\n" == text or (name == text and not text.endswith("\n"))


# --- /proc/<pid>/syscall and the table's budget --------------------------------------------

X86 = LOCK_SYSCALLS["x86_64"]


@pytest.mark.parametrize(
    ("line", "wait"),
    [
        # Read from processes of this machine blocked in fcntl(F_SETLKW), fcntl(F_OFD_SETLKW)
        # and flock(LOCK_EX): the kernel's own lines.
        ("72 0x3 0x7 0x7fff5ca6b410 0x7f3dd440ea78 0x0 0x0 0x7fff5ca6b390 0x7f3dd4316810\n",
         LockWait(3, "POSIX", None, 0x7FFF5CA6B410)),
        ("72 0x3 0x26 0x7ffcee1ecaa0 0x0 0x0 0x0 0x7ffcee1eca10 0x7f237dd16810\n",
         LockWait(3, "OFDLCK", None, 0x7FFCEE1ECAA0)),
        ("73 0x5 0x2 0x0 0x0 0x0 0x0 0x7ffd1 0x7f1\n", LockWait(5, "FLOCK", "WRITE", None)),
        ("73 0x5 0x1 0x0 0x0 0x0 0x0 0x7ffd1 0x7f1\n", LockWait(5, "FLOCK", "READ", None)),
        # Not a wait: LOCK_NB, F_SETLK, another call, running, outside a call.
        ("73 0x5 0x6 0x0 0x0 0x0 0x0 0x7ffd1 0x7f1\n", None),
        ("72 0x3 0x6 0x7fff5ca6b410 0x0 0x0 0x0 0x7ffd1 0x7f1\n", None),
        ("7 0x7ffd 0x1 0xffffffff 0x0 0x0 0x0 0x7ffd1 0x7f1\n", None),
        ("running\n", None),
        ("-1 0x7ffd1 0x7f1\n", None),
    ],
)  # fmt: skip
def test_parse_syscall(line: str, wait: LockWait | None) -> None:
    assert parse_syscall(line, X86) == wait


@pytest.mark.parametrize("line", ["", "72 0x3\n", "72 0x3 0x7 zz 0x0 0x0 0x0 0x1 0x2\n"])
def test_parse_syscall_refuses_what_the_kernel_does_not_write(line: str) -> None:
    with pytest.raises(ParseError):
        parse_syscall(line, X86)


@given(st.text(max_size=200))
def test_parse_syscall_never_fails_otherwise(text: str) -> None:
    try:
        wait = parse_syscall(text, X86)
    except ParseError:
        return
    assert wait is None or wait.kind in ("POSIX", "OFDLCK", "FLOCK")


def test_read_table_stops_at_its_budget_on_a_whole_line(tmp_path: Path) -> None:
    line = "1: POSIX  ADVISORY  WRITE 4242 fd:00:123 0 EOF\n"
    table = tmp_path / "locks"
    table.write_text(line * 100_000)
    text, cut = read_table(str(table), 70_000, 10.0)
    assert cut and 0 < len(text) <= 70_000 + 65536 and text.endswith("\n")
    assert len(parse_locks(text)) == len(text) // len(line)
    whole, cut = read_table(str(table), 1 << 30, 10.0)
    assert not cut and whole == line * 100_000
