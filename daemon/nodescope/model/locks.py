"""The records of the ``locks`` source: counts of the node's file locks and the contended
ones, resolved to mount, path and the processes on each side.

``sources/locks.py`` reads them from ``/proc/locks``, ``/proc/self/mountinfo`` and, for the
holder and waiters of a contended lock only, ``/proc/<pid>``. Device numbers are kept as
numbers; :attr:`ContendedLock.device` prints them as ``/proc/locks`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nodescope.model.skips import NOTHING_SKIPPED, Skipped
from nodescope.model.source_key import SourceKey


@dataclass(frozen=True, slots=True)
class LockParty:
    """A process on one side of a contended lock: pid, ``comm`` (``None``: not readable or
    not a local process) and the type it holds or asks for. ``cgroup`` (the holder's only)
    is its cgroup as ``/proc/<pid>/cgroup`` gives it (the unified hierarchy's path, or on a
    v1-only host systemd's ``name=systemd`` one): what names a holder outside any job, a
    system service's unit."""

    pid: int
    comm: str | None
    access: str
    cgroup: str | None = None

    @property
    def unit(self) -> str | None:
        """The systemd unit the process runs in: the last ``.service`` or ``.scope``
        component of its cgroup (``/system.slice/rsync-backup.service`` ->
        ``rsync-backup.service``), ``None`` outside any."""
        if not self.cgroup:
            return None
        for part in reversed(self.cgroup.split("/")):
            if part.endswith((".service", ".scope")):
                return part
        return None


@dataclass(frozen=True, slots=True)
class ContendedLock:
    """A granted lock with requests blocked behind it, resolved as far as the node allows.

    ``waiters`` are every request blocked in its tree, at any depth. ``mountpoint``/``fstype``
    /``mount_source`` come from mountinfo, ``path`` from the holder's open files (``None``
    when the holder is not local, has closed the file, or cannot be read).
    """

    id: int
    kind: str
    holder: LockParty
    waiters: tuple[LockParty, ...]
    major: int | None
    minor: int | None
    inode: int | None
    start: int
    end: int | None
    mountpoint: str | None = None
    fstype: str | None = None
    mount_source: str | None = None
    path: str | None = None

    @property
    def device(self) -> str | None:
        if self.major is None or self.minor is None:
            return None
        return f"{self.major:02x}:{self.minor:02x}"

    @property
    def is_nfs(self) -> bool:
        return self.fstype in ("nfs", "nfs4")


@dataclass(frozen=True, slots=True)
class LockHolder:
    """A user holding a flood of locks: the uid of the processes and how many granted locks
    they hold in the part of ``/proc/locks`` that was read (more when it was cut)."""

    uid: int
    locks: int


@dataclass(frozen=True, slots=True)
class LocksData:
    """Counts of every lock by kind (granted ones only), the number of blocked requests, and
    the contended locks resolved, those with a job process on either side first.

    ``truncated``: ``/proc/locks`` was read only in part (its byte or time budget ran out;
    the counts are of that part); ``flood_holders``: the users holding the most locks when
    that happened or when one holds a flood of them."""

    counts: tuple[tuple[str, int], ...]
    blocked: int
    contended: tuple[ContendedLock, ...]
    truncated: bool = False
    flood_holders: tuple[LockHolder, ...] = ()
    #: lines of /proc/locks and mountinfo left out of this run as malformed
    skipped: Skipped = field(default=NOTHING_SKIPPED, compare=False)


#: The ``locks`` source's records: the node's file locks.
LOCKS = SourceKey("locks", LocksData)
