"""File locks: ``/proc/locks``, with the contended ones resolved to mount, path and holder.

Reads, under the injected roots:

* ``<procfs>/locks`` (``fs/locks.c`` ``locks_show``/``lock_get_status``,
  ``docs/datasources.md`` §6): one line per lock, ``<id>: `` then the class (``POSIX`` and its
  mode ``ADVISORY``/``MANDATORY`` — or ``*NOINODE*``; ``OFDLCK``; ``ACCESS``; ``FLOCK
  ADVISORY``; ``LEASE``/``DELEG`` with ``ACTIVE``/``BREAKING``/``BREAKER``), the type
  ``READ|WRITE|UNLCK``, the owner pid (``-1`` for OFD locks, ``<= 0`` for locks of remote
  owners), ``MAJ:MIN:INODE`` with the device numbers in **hexadecimal** (``%02x``) and the
  inode in decimal (``<none>:0`` without an inode), then ``start end`` or ``start EOF``.
  Requests blocked on a lock follow it with the same id and ``-> `` indented by their depth
  in the waiter tree (``"%*s"`` of width ``depth - 1 + 3``): a waiter's blocker is the nearest
  line above it with the same id and one level less;
* ``<procfs>/self/mountinfo`` (``Documentation/filesystems/proc.rst`` §3.5) once per run and
  only when a lock is contended: the mount whose ``MAJ:MIN`` (decimal there) is the lock's;
* for the holder of a contended lock only: ``<procfs>/<pid>/comm``, ``<procfs>/<pid>/cgroup``
  (what names a holder outside any job: its systemd unit) and the ``stat`` of its ``fd/*``
  links (the open file's device and inode) to find the path of the locked file, and the
  ``comm`` of each waiter.

Uncontended locks are counted, not resolved: a node holds thousands of them.

Any user can take locks by the hundred thousand, and the kernel hands ``/proc/locks`` out a
page per ``read``, walking its list from the start for each: the cost of reading the whole
table grows with the square of its length. The table is therefore read within a budget
(:data:`MAX_TABLE_BYTES`, :data:`TABLE_SECONDS`; a cut is counted), and the lock waits of
the jobs' processes are read from the processes themselves, wherever the cut falls:

* ``<procfs>/<pid>/syscall`` of each process of a job (``fs/proc/base.c``
  ``proc_pid_syscall``): a process blocked in ``fcntl(fd, F_SETLKW | F_OFD_SETLKW, &flock)``
  or ``flock(fd, LOCK_SH | LOCK_EX)`` waits on the file open as ``fd`` (``fd/<fd>``: device,
  inode and path); the range and type of an ``fcntl`` request are read from its ``struct
  flock`` in ``<procfs>/<pid>/mem``;
* the holder: the lock of that file in the part of the table read, else the ``lock:`` lines
  of the job's other processes' ``<procfs>/<pid>/fdinfo/<fd>`` (``fs/locks.c``
  ``show_fd_locks``: the locks taken through that open file, in the table's own format).

The contended locks with a job process on either side are resolved first; a user holding a
flood of locks is named by uid (:func:`flood_holders`).

A line of ``/proc/locks`` or ``mountinfo`` that does not parse (a kernel with a new lock
class, say) is left out and counted in ``LocksData.skipped``; only a ``/proc/locks`` that
cannot be read at all takes the source down. A process name is whatever its process chose
(``prctl(PR_SET_NAME)`` takes newlines too): it is read as the kernel writes it, never
rejected. The records the source hands on are declared in :mod:`nodescope.model.locks`.
"""

from __future__ import annotations

import os
import platform
import re
import struct
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from nodescope.errors import ParseError
from nodescope.fileio import PROC_PROCESS, PROC_TABLE, read_prefix
from nodescope.model.locks import LOCKS, ContendedLock, LockHolder, LockParty, LocksData
from nodescope.model.skips import Skipped, SkipTally
from nodescope.roots import Roots
from nodescope.sources.base import read_optional
from nodescope.sources.cgroup import CycleWalk, read_proc_cgroup
from nodescope.sources.spec import SourceSpec
from nodescope.sources.threads import job_pids

NAME = LOCKS.name

#: At most this many open files of a holder are examined for the locked file's path.
MAX_FDS_SCANNED = 4096
#: At most this many contended locks are resolved per run (each costs a holder fd scan).
MAX_CONTENDED = 64
#: ``/proc/locks`` is read at most this far per run (about 15,000 locks)...
MAX_TABLE_BYTES = 1 << 20
#: ... and for at most this long (see :func:`read_table`): a safety net, the bytes bound the
#: read; well within the source's deadline, so that parsing and resolving still fit.
TABLE_SECONDS = 2.0
#: Job processes whose system call is read per run for a lock wait.
MAX_JOB_PROCESSES = 1024
#: A user holding this many granted locks is named (:attr:`LocksData.flood_holders`).
FLOOD_LOCKS = 4096
#: Users named at most, and processes whose owner is looked up to name them.
MAX_FLOOD_HOLDERS = 8
MAX_PIDS_ATTRIBUTED = 64

_ID = re.compile(r"[0-9]{1,19}")
_DEVICE = re.compile(r"([0-9a-fA-F]{1,8}):([0-9a-fA-F]{1,8}):([0-9]{1,20})")
_INT = re.compile(r"-?[0-9]{1,20}")
_DEVNUM = re.compile(r"([0-9]{1,10}):([0-9]{1,10})")
_ACCESS = ("READ", "WRITE", "UNLCK")
_LEASE_STATES = ("ACTIVE", "BREAKING", "BREAKER")
_MODES = ("ADVISORY", "MANDATORY", "*NOINODE*")

# Reasons a record was skipped (nodescope_source_records_skipped_total{reason}).
#: a /proc/locks line that does not parse
SKIP_LOCK_LINE_UNPARSABLE = "lock_line_unparsable"
#: a blocked request whose blocker is not on the lines before it (or was skipped)
SKIP_LOCK_WAITER_ORPHANED = "lock_waiter_orphaned"
#: a mountinfo line that does not parse (only read when a lock is contended)
SKIP_MOUNTINFO_LINE_UNPARSABLE = "mountinfo_line_unparsable"
#: /proc/locks left unread past its byte or time budget (one a run)
SKIP_LOCK_TABLE_TRUNCATED = "lock_table_truncated"
#: a contended lock past MAX_CONTENDED, left unresolved (the job's are kept first)
SKIP_LOCK_CONTENDED_DROPPED = "lock_contended_dropped"
#: a job process's /proc/<pid>/syscall that is not in the kernel's form
SKIP_SYSCALL_UNPARSABLE = "syscall_unparsable"


@dataclass(frozen=True, slots=True)
class LockEntry:
    """One line of ``/proc/locks``.

    ``kind``: ``POSIX``, ``OFDLCK``, ``ACCESS``, ``FLOCK``, ``LEASE``, ``DELEG`` or
    ``UNKNOWN``; ``mode``: ``ADVISORY``, ``MANDATORY`` or ``*NOINODE*`` for byte-range and
    flock locks, ``ACTIVE``/``BREAKING``/``BREAKER`` for leases and delegations. ``depth`` 0
    is a granted lock, ``>= 1`` a request blocked behind ``blocker`` (an index into the same
    tuple). ``major``/``minor``/``inode`` are ``None`` for ``<none>:0``; ``end`` is ``None``
    for ``EOF``. ``line`` is the 1-based line in the file.
    """

    id: int
    depth: int
    kind: str
    mode: str
    access: str
    pid: int
    major: int | None
    minor: int | None
    inode: int | None
    start: int
    end: int | None
    line: int
    blocker: int | None = None

    @property
    def device(self) -> str | None:
        """``MAJ:MIN`` as ``/proc/locks`` prints it (hex, two digits at least)."""
        if self.major is None or self.minor is None:
            return None
        return f"{self.major:02x}:{self.minor:02x}"

    @property
    def st_dev(self) -> int | None:
        """The device number as ``stat`` reports it (``st_dev``) for the locked file."""
        if self.major is None or self.minor is None:
            return None
        return os.makedev(self.major, self.minor)


@dataclass(frozen=True, slots=True)
class MountInfo:
    """One line of ``/proc/<pid>/mountinfo``; ``major``/``minor`` are the superblock's
    device numbers (``st_dev`` of its files)."""

    mount_id: int
    parent_id: int
    major: int
    minor: int
    root: str
    mountpoint: str
    fstype: str
    source: str


# --- parsers (pure) -------------------------------------------------------------------------


def _int(token: str, what: str, source: str, line: int) -> int:
    if not _INT.fullmatch(token):
        raise ParseError(source, f"{what}: not an integer: {token!r}", line)
    return int(token)


def _parse_line(raw: str, number: int, source: str) -> tuple[int, int, list[str]]:
    """(id, depth, the tokens after the id and the ``->`` marker)."""
    head, sep, rest = raw.partition(":")
    if not sep or not _ID.fullmatch(head.strip()):
        raise ParseError(source, f"no lock id: {raw!r}", number)
    lock_id = int(head.strip())
    depth = 0
    body = rest.lstrip(" ")
    if body.startswith("->"):
        # "%*s" of width depth - 1 + len("-> ") before the marker: the spaces after the colon
        # are the one separator plus depth - 1.
        depth = len(rest) - len(body)
        body = body[2:]
    return lock_id, depth, body.split()


def _parse_entry(raw: str, number: int, source: str) -> LockEntry:
    """One line of ``/proc/locks`` (its ``blocker`` still unset); :class:`ParseError` naming
    the line when it does not parse."""
    lock_id, depth, tokens = _parse_line(raw, number, source)
    if not tokens:
        raise ParseError(source, "empty lock line", number)
    kind = tokens[0]
    expected_mode: tuple[str, ...]
    if kind in ("POSIX", "OFDLCK", "ACCESS", "FLOCK"):
        expected_mode = _MODES
    elif kind in ("LEASE", "DELEG"):
        expected_mode = _LEASE_STATES
    elif kind == "UNKNOWN":
        expected_mode = ("UNKNOWN",)
    else:
        raise ParseError(source, f"unknown lock class {kind!r}", number)
    if len(tokens) != 7:
        raise ParseError(source, f"expected 7 fields after the id, got {len(tokens)}", number)
    _, mode, access, pid_text, where, start_text, end_text = tokens
    if mode not in expected_mode:
        raise ParseError(source, f"{kind}: unknown mode {mode!r}", number)
    if access not in _ACCESS:
        raise ParseError(source, f"unknown lock type {access!r}", number)
    pid = _int(pid_text, "pid", source, number)
    major: int | None
    minor: int | None
    inode: int | None
    if where == "<none>:0":
        major = minor = inode = None
    else:
        match = _DEVICE.fullmatch(where)
        if match is None:
            raise ParseError(source, f"not MAJ:MIN:INODE: {where!r}", number)
        major, minor, inode = (
            int(match.group(1), 16),
            int(match.group(2), 16),
            int(match.group(3)),
        )
    start = _int(start_text, "start", source, number)
    end = None if end_text == "EOF" else _int(end_text, "end", source, number)
    return LockEntry(
        lock_id, depth, kind, mode, access, pid, major, minor, inode, start, end, number
    )


def parse_locks(
    text: str, source: str = "/proc/locks", tally: SkipTally | None = None
) -> tuple[LockEntry, ...]:
    """Every well-formed line of ``/proc/locks``, waiters linked to their blockers.

    A line that does not parse is left out and counted in ``tally``, and so is a waiter whose
    blocker is not on a line before it (its blocker was malformed, or the file is not
    ``/proc/locks``): the other locks are counted whatever one line holds.
    """
    tally = SkipTally() if tally is None else tally
    entries: list[LockEntry] = []
    #: per lock id, the index of the latest entry at each depth
    open_levels: dict[int, list[int]] = {}
    for number, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        try:
            entry = _parse_entry(raw, number, source)
        except ParseError as exc:
            tally.skip(SKIP_LOCK_LINE_UNPARSABLE, str(exc))
            continue
        depth = entry.depth
        levels = open_levels.setdefault(entry.id, [])
        if depth == 0:
            levels[:] = [len(entries)]
        else:
            if depth > len(levels):
                tally.skip(
                    SKIP_LOCK_WAITER_ORPHANED,
                    f"{source}:{number}: waiter at depth {depth} without a blocker at depth "
                    f"{depth - 1}",
                )
                continue
            entry = replace(entry, blocker=levels[depth - 1])
            del levels[depth:]
            levels.append(len(entries))
        entries.append(entry)
    return tuple(entries)


_ESCAPE = re.compile(r"\\([0-7]{3})")


def unescape_mount_field(text: str) -> str:
    """Undo the octal escapes (``\\040`` for a space) of mountinfo's path fields."""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), text)


def parse_mountinfo_line(line: str, number: int = 1, source: str = "mountinfo") -> MountInfo:
    """One line of ``/proc/<pid>/mountinfo``: ``id parent MAJ:MIN root mountpoint options
    [optional…] - fstype source super-options``; :class:`ParseError` when malformed."""
    fields = line.split()
    try:
        dash = fields.index("-", 6)
    except ValueError:
        raise ParseError(source, "no '-' separator after the optional fields", number) from None
    if len(fields) < dash + 3:
        raise ParseError(source, "missing fstype or source after '-'", number)
    mount_id = _int(fields[0], "mount id", source, number)
    parent = _int(fields[1], "parent id", source, number)
    devnum = _DEVNUM.fullmatch(fields[2])
    if devnum is None:
        raise ParseError(source, f"not MAJ:MIN: {fields[2]!r}", number)
    return MountInfo(
        mount_id,
        parent,
        int(devnum.group(1)),
        int(devnum.group(2)),
        unescape_mount_field(fields[3]),
        unescape_mount_field(fields[4]),
        fields[dash + 1],
        unescape_mount_field(fields[dash + 2]),
    )


def parse_mountinfo(
    text: str, source: str = "/proc/self/mountinfo", tally: SkipTally | None = None
) -> tuple[MountInfo, ...]:
    """Every well-formed line of ``/proc/<pid>/mountinfo`` (see :func:`parse_mountinfo_line`);
    a malformed one is left out and counted in ``tally``."""
    mounts: list[MountInfo] = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            mounts.append(parse_mountinfo_line(line, number, source))
        except ParseError as exc:
            if tally is not None:
                tally.skip(SKIP_MOUNTINFO_LINE_UNPARSABLE, str(exc))
    return tuple(mounts)


def parse_comm(text: str) -> str:
    """``/proc/<pid>/comm``: the name, then the one newline the kernel adds
    (``fs/proc/base.c`` ``comm_show``). The name is what its process chose and may hold
    newlines of its own: everything before that last newline is the name."""
    return text[:-1] if text.endswith("\n") else text


def contended(entries: tuple[LockEntry, ...]) -> list[tuple[LockEntry, list[LockEntry]]]:
    """Each granted lock that has blocked requests, with all of them (any depth)."""
    waiting: dict[int, list[LockEntry]] = {}
    for entry in entries:
        if entry.blocker is None:
            continue
        root = entry.blocker
        while entries[root].blocker is not None:
            root = entries[root].blocker  # type: ignore[assignment]
        waiting.setdefault(root, []).append(entry)
    return [(entries[i], waiting[i]) for i in sorted(waiting)]


def mount_of(mounts: tuple[MountInfo, ...], major: int, minor: int) -> MountInfo | None:
    """The mount of a superblock; with bind mounts the first one listed whose root is ``/``,
    else the first one."""
    found = [m for m in mounts if m.major == major and m.minor == minor]
    for m in found:
        if m.root == "/":
            return m
    return found[0] if found else None


# --- readers (IO) ---------------------------------------------------------------------------


def _comm(roots: Roots, pid: int) -> str | None:
    if pid <= 0:
        return None
    path = roots.procfs / str(pid) / "comm"
    text = read_optional(path, PROC_PROCESS)
    return None if text is None else parse_comm(text)


def locked_path(roots: Roots, pid: int, st_dev: int, inode: int) -> str | None:
    """The path under which process ``pid`` has the file (``st_dev``, ``inode``) open: the
    target of the first ``fd/N`` link whose ``stat`` (which follows the link to the open
    file) names that file."""
    if pid <= 0:
        return None
    fd_dir = roots.procfs / str(pid) / "fd"
    try:
        with os.scandir(fd_dir) as it:
            names = [e.name for e in it]
    except OSError:
        return None
    for name in sorted(names, key=lambda n: (len(n), n))[:MAX_FDS_SCANNED]:
        link = fd_dir / name
        try:
            st = os.stat(link)
        except OSError:
            continue
        if st.st_ino == inode and st.st_dev == st_dev:
            try:
                return os.readlink(link)
            except OSError:
                return None
    return None


def _cgroup(roots: Roots, pid: int) -> str | None:
    """The cgroup of a lock holder (``/proc/<pid>/cgroup``): the unified hierarchy's path,
    else systemd's v1 one; ``None`` for a remote owner, a process gone, a file that does not
    parse."""
    if pid <= 0:
        return None
    try:
        seen = read_proc_cgroup(roots, pid)
    except ParseError:
        return None
    if seen is None:
        return None
    return seen.v2_path or seen.v1_path("name=systemd")


def _party(roots: Roots, entry: LockEntry) -> LockParty:
    return LockParty(entry.pid, _comm(roots, entry.pid), entry.access)


def resolve(
    roots: Roots,
    entries: tuple[LockEntry, ...],
    mounts: tuple[MountInfo, ...] | None,
    job_pids: frozenset[int] = frozenset(),
    tally: SkipTally | None = None,
) -> tuple[ContendedLock, ...]:
    """The contended locks of ``entries`` with mount, path and process names: at most
    :data:`MAX_CONTENDED`, those with a process of ``job_pids`` on either side first; each
    one left out is counted in ``tally`` (:data:`SKIP_LOCK_CONTENDED_DROPPED`)."""
    found = contended(entries)
    if len(found) > MAX_CONTENDED:
        # Stable: the job's locks first, each group in the table's order.
        found.sort(
            key=lambda pair: (
                not (pair[0].pid in job_pids or any(w.pid in job_pids for w in pair[1]))
            )
        )
        if tally is not None:
            left = len(found) - MAX_CONTENDED
            tally.merge(
                Skipped(
                    {SKIP_LOCK_CONTENDED_DROPPED: left},
                    {SKIP_LOCK_CONTENDED_DROPPED: f"{left} contended locks past {MAX_CONTENDED}"},
                )
            )
        del found[MAX_CONTENDED:]
    out: list[ContendedLock] = []
    for holder, waiters in found:
        lock = ContendedLock(
            id=holder.id,
            kind=holder.kind,
            holder=LockParty(
                holder.pid, _comm(roots, holder.pid), holder.access, _cgroup(roots, holder.pid)
            ),
            waiters=tuple(_party(roots, w) for w in waiters),
            major=holder.major,
            minor=holder.minor,
            inode=holder.inode,
            start=holder.start,
            end=holder.end,
        )
        if holder.major is not None and holder.minor is not None and holder.inode is not None:
            lock = _placed(lock, mounts)
            path = locked_path(
                roots, holder.pid, os.makedev(holder.major, holder.minor), holder.inode
            )
            if path is None:
                for waiter in waiters:
                    path = locked_path(
                        roots, waiter.pid, os.makedev(holder.major, holder.minor), holder.inode
                    )
                    if path is not None:
                        break
            lock = replace(lock, path=path)
        out.append(lock)
    return tuple(out)


def _placed(lock: ContendedLock, mounts: tuple[MountInfo, ...] | None) -> ContendedLock:
    if lock.major is None or lock.minor is None:
        return lock
    mount = mount_of(mounts or (), lock.major, lock.minor)
    if mount is None:
        return lock
    return replace(
        lock, mountpoint=mount.mountpoint, fstype=mount.fstype, mount_source=mount.source
    )


# --- the table, read within a budget -------------------------------------------------------


def read_table(path: str, max_bytes: int, seconds: float) -> tuple[str, bool]:
    """``/proc/locks`` up to ``max_bytes`` or ``seconds``, whichever ends first, cut at its
    last whole line; and whether it was cut.

    The kernel's ``seq_file`` serves the table a page per ``read`` and walks the lock list
    from its start again on each one, so reading the whole of a table of ``n`` locks costs in
    the square of ``n`` (100,000 locks, 7 s): a prefix costs in the square of its own length
    only (1 MiB, about 15,000 locks, 0.1 s), whatever the rest holds.
    """
    data, cut = read_prefix(path, max_bytes, seconds)
    text = data.decode("utf-8", errors="replace")
    if cut:
        text = text[: text.rfind("\n") + 1]
    return text, cut


def flood_holders(
    roots: Roots, entries: tuple[LockEntry, ...], truncated: bool
) -> tuple[LockHolder, ...]:
    """The users holding :data:`FLOOD_LOCKS` granted locks or more among ``entries`` (when
    the table was cut, also those holding an eighth of the part read or more: what cut it): at
    most :data:`MAX_FLOOD_HOLDERS`, the most first. OFD locks carry no pid in the table and
    are not attributed."""
    by_pid = Counter(e.pid for e in entries if e.depth == 0 and e.pid > 0)
    least = min(FLOOD_LOCKS, max(1, len(entries) // 8)) if truncated else FLOOD_LOCKS
    by_uid: Counter[int] = Counter()
    for pid, count in by_pid.most_common(MAX_PIDS_ATTRIBUTED):
        if count < least // MAX_PIDS_ATTRIBUTED:
            break
        try:
            by_uid[os.stat(roots.procfs / str(pid)).st_uid] += count
        except OSError:
            continue  # exited since
    return tuple(
        LockHolder(uid, count)
        for uid, count in by_uid.most_common(MAX_FLOOD_HOLDERS)
        if count >= least
    )


# --- the lock waits of job processes --------------------------------------------------------

#: ``fcntl`` and ``flock`` system call numbers (``arch/x86/entry/syscalls/syscall_64.tbl``,
#: ``include/uapi/asm-generic/unistd.h`` for arm64).
LOCK_SYSCALLS: dict[str, tuple[int, int]] = {"x86_64": (72, 73), "aarch64": (25, 32)}
#: ``fcntl`` commands that wait for a lock (``include/uapi/asm-generic/fcntl.h``).
F_SETLKW = 7
F_OFD_SETLKW = 38
#: ``flock`` operations (``include/uapi/asm-generic/fcntl.h``).
LOCK_SH, LOCK_EX, LOCK_NB = 1, 2, 4
#: ``struct flock``'s ``l_type`` values.
_FLOCK_TYPES = {0: "READ", 1: "WRITE"}
_SYSCALL_FIELD = re.compile(r"-?[0-9]{1,10}|0x[0-9a-f]{1,16}")


@dataclass(frozen=True, slots=True)
class LockWait:
    """A process blocked in a lock request: its ``fd``, the class the request is of
    (``POSIX``, ``OFDLCK``, ``FLOCK``), its type when known and, for ``fcntl``, the address
    of its ``struct flock``."""

    fd: int
    kind: str
    access: str | None
    flock_address: int | None


def parse_syscall(text: str, calls: tuple[int, int], source: str = "syscall") -> LockWait | None:
    """``/proc/<pid>/syscall`` (``fs/proc/base.c`` ``proc_pid_syscall``: the number and six
    arguments in hex, then the stack and program counters; ``running``, or ``-1`` and the two
    counters outside a system call): the lock request it is blocked in, else ``None``.
    :class:`ParseError` when the line is not in that form."""
    fields = text.split()
    if fields == ["running"] or (fields and fields[0] == "-1"):
        return None
    if len(fields) != 9 or not all(_SYSCALL_FIELD.fullmatch(f) for f in fields):
        raise ParseError(source, f"not a syscall line: {text[:80]!r}")
    number = int(fields[0])
    args = [int(f, 16) for f in fields[1:7]]
    fcntl_nr, flock_nr = calls
    fd = args[0] & 0xFFFFFFFF
    if number == fcntl_nr and args[1] in (F_SETLKW, F_OFD_SETLKW):
        kind = "POSIX" if args[1] == F_SETLKW else "OFDLCK"
        return LockWait(fd, kind, None, args[2])
    if number == flock_nr and not args[1] & LOCK_NB and args[1] & (LOCK_SH | LOCK_EX):
        return LockWait(fd, "FLOCK", "WRITE" if args[1] & LOCK_EX else "READ", None)
    return None


def _flock_request(roots: Roots, pid: int, address: int) -> tuple[str | None, int, int | None]:
    """The type, start and end of the ``struct flock`` a process passed to ``fcntl``, read
    from its memory (``l_type``, ``l_whence``, ``l_start``, ``l_len``); unknown parts when it
    cannot be read or the range is not from the file's start."""
    try:
        fd = os.open(roots.procfs / str(pid) / "mem", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None, 0, None
    try:
        raw = os.pread(fd, 24, address)
    except (OSError, OverflowError, ValueError):
        return None, 0, None
    finally:
        os.close(fd)
    if len(raw) != 24:
        return None, 0, None
    l_type, l_whence, l_start, l_len = struct.unpack("=hh4xqq", raw)
    access = _FLOCK_TYPES.get(l_type)
    if l_whence != 0 or l_start < 0 or l_len < 0:
        return access, 0, None
    return access, l_start, None if l_len == 0 else l_start + l_len - 1


def _fd_holders(
    roots: Roots, pids: Iterable[int], st_dev: int, inode: int, budget: list[int]
) -> LockParty | None:
    """A process of ``pids`` holding a lock on the file (``fdinfo``'s ``lock:`` lines, which
    the kernel prints for the locks taken through that open file): at most ``budget[0]`` open
    files are looked at, all calls together."""
    for pid in pids:
        fd_dir = roots.procfs / str(pid) / "fd"
        try:
            with os.scandir(fd_dir) as it:
                names = [e.name for e in it]
        except OSError:
            continue
        for name in names:
            if budget[0] <= 0:
                return None
            budget[0] -= 1
            try:
                st = os.stat(fd_dir / name)
            except OSError:
                continue
            if st.st_ino != inode or st.st_dev != st_dev:
                continue
            text = read_optional(roots.procfs / str(pid) / "fdinfo" / name, PROC_PROCESS)
            for line in (text or "").splitlines():
                if not line.startswith("lock:"):
                    continue
                try:
                    entry = _parse_entry(line[len("lock:") :].strip(), 1, "fdinfo")
                except ParseError:
                    continue
                return LockParty(pid, _comm(roots, pid), entry.access, _cgroup(roots, pid))
    return None


def job_lock_waits(
    roots: Roots,
    pids: Iterable[int],
    calls: tuple[int, int] | None,
    known: tuple[ContendedLock, ...],
    entries: tuple[LockEntry, ...],
    mounts: Callable[[], tuple[MountInfo, ...] | None],
    tally: SkipTally,
) -> tuple[ContendedLock, ...]:
    """``known`` with the lock waits of the processes ``pids`` added, read from each
    process's ``syscall``: a wait on a file of a known contended lock joins its waiters, any
    other becomes a contended lock of its own, its holder taken from ``entries`` (the part of
    the table read) or from the other processes' ``fdinfo`` (pid 0 when neither has it).
    This finds a job's waits wherever the table's cut falls, and OFD waits, which the table
    lists with pid -1. ``mounts`` gives the mount table, read only when a wait is found."""
    if calls is None:
        return known
    out = list(known)
    listed = {w.pid for lock in known for w in lock.waiters}
    candidates = [pid for pid in pids if pid not in listed][:MAX_JOB_PROCESSES]
    budget = [MAX_FDS_SCANNED]
    for pid in candidates:
        path = roots.procfs / str(pid) / "syscall"
        text = read_optional(path, PROC_PROCESS)
        if text is None:
            continue
        try:
            wait = parse_syscall(text, calls, str(path))
        except ParseError as exc:
            tally.skip(SKIP_SYSCALL_UNPARSABLE, str(exc))
            continue
        if wait is None:
            continue
        link = roots.procfs / str(pid) / "fd" / str(wait.fd)
        try:
            st = os.stat(link)
            target: str | None = os.readlink(link)
        except OSError:
            continue  # the wait ended, or the process did
        access, start, end = wait.access, 0, None
        if wait.flock_address is not None:
            access, start, end = _flock_request(roots, pid, wait.flock_address)
        waiter = LockParty(pid, _comm(roots, pid), access or "UNKNOWN")
        major, minor = os.major(st.st_dev), os.minor(st.st_dev)
        index = next(
            (i for i, c in enumerate(out)
             if (c.major, c.minor, c.inode) == (major, minor, st.st_ino)),
            None,
        )  # fmt: skip
        if index is not None:
            out[index] = replace(out[index], waiters=(*out[index].waiters, waiter))
            continue
        holder_entry = next(
            (e for e in entries
             if e.depth == 0 and (e.major, e.minor, e.inode) == (major, minor, st.st_ino)),
            None,
        )  # fmt: skip
        others = [p for p in candidates if p != pid]
        holder = (
            _party(roots, holder_entry)
            if holder_entry is not None
            else _fd_holders(roots, others, st.st_dev, st.st_ino, budget)
        ) or LockParty(0, None, "UNKNOWN")
        lock = ContendedLock(
            id=holder_entry.id if holder_entry is not None else 0,
            kind=wait.kind,
            holder=holder,
            waiters=(waiter,),
            major=major,
            minor=minor,
            inode=st.st_ino,
            start=start,
            end=end,
            path=target,
        )
        out.append(_placed(lock, mounts()))
    return tuple(out)


# --- the source -----------------------------------------------------------------------------


def read_locks(
    roots: Roots,
    job_pids: Iterable[int] | Callable[[], Iterable[int]] = (),
    calls: tuple[int, int] | None = None,
    max_bytes: int = MAX_TABLE_BYTES,
    seconds: float = TABLE_SECONDS,
) -> LocksData:
    """The locks of ``/proc/locks`` (read within ``max_bytes`` and ``seconds``) with the lock
    waits of the processes ``job_pids`` (``calls``: this machine's ``fcntl`` and ``flock``
    numbers; ``None``: not looked for); raises only when the table cannot be read at all.

    ``job_pids`` may be a function, called only when the table alone may not show every wait
    of a job: it was cut, a waiter has no pid there (OFD locks, remote owners), or more locks
    are contended than are resolved. A table read whole with no such line costs no more than
    the table itself."""
    path = roots.procfs / "locks"
    tally = SkipTally()
    text, truncated = read_table(str(path), max_bytes, seconds)
    if truncated:
        tally.skip(
            SKIP_LOCK_TABLE_TRUNCATED,
            f"{path}: {len(text)} bytes read within {max_bytes} bytes and {seconds:g} s,"
            " the rest left unread",
        )
    entries = parse_locks(text, str(path), tally)
    counts = Counter(e.kind for e in entries if e.depth == 0)
    waiters = [e for e in entries if e.blocker is not None]
    pids: frozenset[int] = frozenset()
    if (
        truncated
        or any(e.pid <= 0 for e in waiters)
        or len({e.id for e in waiters}) > MAX_CONTENDED
    ):
        pids = frozenset(job_pids() if callable(job_pids) else job_pids)
    read: list[tuple[MountInfo, ...] | None] = []

    def mounts() -> tuple[MountInfo, ...] | None:
        # Read once, and only when a lock is contended: most runs find none.
        if not read:
            info_path = roots.procfs / "self" / "mountinfo"
            info = read_optional(info_path, PROC_TABLE)
            read.append(None if info is None else parse_mountinfo(info, str(info_path), tally))
        return read[0]

    locks = resolve(roots, entries, mounts() if waiters else None, pids, tally)
    if pids:
        locks = job_lock_waits(roots, sorted(pids), calls, locks, entries, mounts, tally)
    return LocksData(
        counts=tuple(sorted(counts.items())),
        blocked=len(waiters),
        contended=locks,
        skipped=tally.freeze(),
        truncated=truncated,
        flood_holders=flood_holders(roots, entries, truncated),
    )


class LocksSource:
    """``/proc/locks`` within its budget, and, when the table may not show them all, the lock
    waits of the processes of the jobs (their pids from the cgroup walk it shares with the
    other cgroup sources, when one runs in the same cycle; else read from the job cgroups'
    ``cgroup.procs``)."""

    name = NAME

    def __init__(self, walk: CycleWalk | None = None) -> None:
        self.walk = CycleWalk() if walk is None else walk
        self.calls = LOCK_SYSCALLS.get(platform.machine())

    def collect(self, roots: Roots) -> LocksData:
        tally = SkipTally()

        def pids() -> list[int]:
            jobs = job_pids(roots, self.walk.if_shared(roots), tally)
            return [pid for group in jobs.values() for pid in group]

        data = read_locks(roots, pids, self.calls)
        return replace(data, skipped=tally.freeze() + data.skipped) if tally else data

    def close(self) -> None:
        return None


def make_source(walk: CycleWalk | None = None) -> LocksSource:
    return LocksSource(walk)


SPEC = SourceSpec(
    name="locks",
    default_interval=10.0,
    help="/proc/locks; contended locks resolved to mount, path, holder and waiters",
    build=lambda inputs: make_source(inputs.cgroup_walk),
    rates=None,
    metric_area="nodescope_exporters.event_metrics",
    sim_parts=frozenset({"proc_files"}),
)


__all__ = [
    "FLOOD_LOCKS",
    "LOCK_SYSCALLS",
    "MAX_CONTENDED",
    "MAX_FDS_SCANNED",
    "MAX_TABLE_BYTES",
    "NAME",
    "SKIP_LOCK_CONTENDED_DROPPED",
    "SKIP_LOCK_LINE_UNPARSABLE",
    "SKIP_LOCK_TABLE_TRUNCATED",
    "SKIP_LOCK_WAITER_ORPHANED",
    "SKIP_MOUNTINFO_LINE_UNPARSABLE",
    "SKIP_SYSCALL_UNPARSABLE",
    "TABLE_SECONDS",
    "ContendedLock",
    "LockEntry",
    "LockHolder",
    "LockParty",
    "LockWait",
    "LocksData",
    "LocksSource",
    "MountInfo",
    "contended",
    "flood_holders",
    "job_lock_waits",
    "locked_path",
    "make_source",
    "mount_of",
    "parse_comm",
    "parse_locks",
    "parse_mountinfo",
    "parse_mountinfo_line",
    "parse_syscall",
    "read_locks",
    "read_table",
    "resolve",
    "unescape_mount_field",
]
