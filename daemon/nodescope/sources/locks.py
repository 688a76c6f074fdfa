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

A line of ``/proc/locks`` or ``mountinfo`` that does not parse (a kernel with a new lock
class, say) is left out and counted in ``LocksData.skipped``; only a ``/proc/locks`` that
cannot be read at all takes the source down. A process name is whatever its process chose
(``prctl(PR_SET_NAME)`` takes newlines too): it is read as the kernel writes it, never
rejected. The records the source hands on are declared in :mod:`nodescope.model.locks`.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, replace

from nodescope.errors import ParseError
from nodescope.fileio import PROC_PROCESS, PROC_TABLE
from nodescope.model.locks import LOCKS, ContendedLock, LockParty, LocksData
from nodescope.model.skips import SkipTally
from nodescope.roots import Roots
from nodescope.sources.base import read_optional, read_text
from nodescope.sources.cgroup import read_proc_cgroup

NAME = LOCKS.name

#: At most this many open files of a holder are examined for the locked file's path.
MAX_FDS_SCANNED = 4096
#: At most this many contended locks are resolved per run (each costs a holder fd scan).
MAX_CONTENDED = 64

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


def resolve(
    roots: Roots, entries: tuple[LockEntry, ...], mounts: tuple[MountInfo, ...] | None
) -> tuple[ContendedLock, ...]:
    """The contended locks of ``entries`` with mount, path and process names."""
    out: list[ContendedLock] = []
    for holder, waiters in contended(entries)[:MAX_CONTENDED]:
        lock = ContendedLock(
            id=holder.id,
            kind=holder.kind,
            holder=LockParty(
                holder.pid, _comm(roots, holder.pid), holder.access, _cgroup(roots, holder.pid)
            ),
            waiters=tuple(LockParty(w.pid, _comm(roots, w.pid), w.access) for w in waiters),
            major=holder.major,
            minor=holder.minor,
            inode=holder.inode,
            start=holder.start,
            end=holder.end,
        )
        if holder.major is not None and holder.minor is not None and holder.inode is not None:
            mount = mount_of(mounts or (), holder.major, holder.minor)
            if mount is not None:
                lock = replace(
                    lock,
                    mountpoint=mount.mountpoint,
                    fstype=mount.fstype,
                    mount_source=mount.source,
                )
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


def read_locks(roots: Roots) -> LocksData:
    """The locks of ``/proc/locks``; raises only when the file cannot be read at all."""
    path = roots.procfs / "locks"
    tally = SkipTally()
    entries = parse_locks(read_text(path, PROC_TABLE), str(path), tally)
    counts = Counter(e.kind for e in entries if e.depth == 0)
    mounts: tuple[MountInfo, ...] | None = None
    if any(e.blocker is not None for e in entries):
        info_path = roots.procfs / "self" / "mountinfo"
        text = read_optional(info_path, PROC_TABLE)
        mounts = None if text is None else parse_mountinfo(text, str(info_path), tally)
    return LocksData(
        counts=tuple(sorted(counts.items())),
        blocked=sum(1 for e in entries if e.depth > 0),
        contended=resolve(roots, entries, mounts),
        skipped=tally.freeze(),
    )


class LocksSource:
    name = NAME

    def collect(self, roots: Roots) -> LocksData:
        return read_locks(roots)

    def close(self) -> None:
        return None


def make_source() -> LocksSource:
    return LocksSource()


__all__ = [
    "MAX_CONTENDED",
    "MAX_FDS_SCANNED",
    "NAME",
    "SKIP_LOCK_LINE_UNPARSABLE",
    "SKIP_LOCK_WAITER_ORPHANED",
    "SKIP_MOUNTINFO_LINE_UNPARSABLE",
    "ContendedLock",
    "LockEntry",
    "LockParty",
    "LocksData",
    "LocksSource",
    "MountInfo",
    "contended",
    "locked_path",
    "make_source",
    "mount_of",
    "parse_comm",
    "parse_locks",
    "parse_mountinfo",
    "parse_mountinfo_line",
    "read_locks",
    "resolve",
    "unescape_mount_field",
]
