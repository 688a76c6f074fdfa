"""The cgroup v2 tree as one walk reads it: each cgroup's interface files as typed records.

Built by ``sources/cgroup.py`` (the ``cgroups`` source, and the walk the ``jobs``, ``procs``
and ``threads`` sources share) from the unified hierarchy under the cgroupfs root. Formats
are the kernel's: ``Documentation/admin-guide/cgroup-v2.rst`` ("Interface Files" of each
controller), ``Documentation/accounting/psi.rst`` for ``*.pressure`` and
``kernel/cgroup/cgroup.c`` ``proc_cgroup_show()`` for ``/proc/<pid>/cgroup``. A field is
``None`` when its file is absent (controller not enabled, the root cgroup, an older kernel),
never 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

from nodescope.model.skips import NOTHING_SKIPPED, Skipped
from nodescope.model.source_key import SourceKey


@dataclass(frozen=True, slots=True)
class KeyValues:
    """A flat ``key value`` file (``memory.stat``, ``cgroup.stat``, ``pids.events``), in file
    order. The kernel adds keys over time, also "in the middle", so read it by key."""

    items: tuple[tuple[str, int], ...]

    def get(self, key: str) -> int | None:
        for name, value in self.items:
            if name == key:
                return value
        return None

    def keys(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.items)


@dataclass(frozen=True, slots=True)
class MemoryEvents:
    """``memory.events`` (this cgroup and its descendants) or ``memory.events.local``.

    ``high``: times throttled into reclaim above ``memory.high``; ``max``: times usage was
    about to exceed ``memory.max``; ``oom``: times the limit was hit and an allocation was
    about to fail; ``oom_kill``: processes killed by the OOM killer. Keys this version does
    not name are kept in ``other``.
    """

    low: int | None = None
    high: int | None = None
    max: int | None = None
    oom: int | None = None
    oom_kill: int | None = None
    oom_group_kill: int | None = None
    other: tuple[tuple[str, int], ...] = ()

    def items(self) -> tuple[tuple[str, int], ...]:
        """Every event present in the file, named ones first, then the others in file order."""
        named = tuple(
            (name, value)
            for name in MEMORY_EVENT_NAMES
            if (value := getattr(self, name)) is not None
        )
        return named + self.other


#: The events :class:`MemoryEvents` names; the parser keeps any other in ``other``.
MEMORY_EVENT_NAMES = ("low", "high", "max", "oom", "oom_kill", "oom_group_kill")


@dataclass(frozen=True, slots=True)
class CpuStat:
    """``cpu.stat`` in microseconds and counts. ``usage_usec``, ``user_usec`` and
    ``system_usec`` exist without the cpu controller; the throttling fields need it."""

    usage_usec: int | None = None
    user_usec: int | None = None
    system_usec: int | None = None
    nice_usec: int | None = None
    nr_periods: int | None = None
    nr_throttled: int | None = None
    throttled_usec: int | None = None
    nr_bursts: int | None = None
    burst_usec: int | None = None
    other: tuple[tuple[str, int], ...] = ()


#: The ``cpu.stat`` keys :class:`CpuStat` names.
CPU_STAT_NAMES = (
    "usage_usec",
    "user_usec",
    "system_usec",
    "nice_usec",
    "nr_periods",
    "nr_throttled",
    "throttled_usec",
    "nr_bursts",
    "burst_usec",
)


@dataclass(frozen=True, slots=True)
class CgroupEvents:
    """``cgroup.events``: ``populated`` is true when this cgroup or a descendant has live
    processes; ``frozen`` when the freezer has stopped it."""

    populated: bool | None = None
    frozen: bool | None = None
    other: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class PressureLine:
    """One PSI line: share of wall time stalled (percent) over 10/60/300 s, and the
    cumulative stall time in microseconds."""

    avg10: float
    avg60: float
    avg300: float
    total_usec: int


@dataclass(frozen=True, slots=True)
class Pressure:
    """A ``<resource>.pressure`` file. ``some``: at least one task stalled; ``full``: all
    non-idle tasks stalled at once. ``cpu.pressure`` lacks ``full`` before Linux 5.13 and shows
    zeros there at the system level; ``irq.pressure`` has only ``full``."""

    some: PressureLine | None
    full: PressureLine | None


@dataclass(frozen=True, slots=True)
class IoDeviceStat:
    """One ``MAJ:MIN`` line of ``io.stat``: cumulative bytes and operations per direction
    (``d`` = discard). Keys added by io.latency/io.cost (``depth``, ``avg_lat``,
    ``cost.vrate`` …) are kept as text in ``other``."""

    major: int
    minor: int
    rbytes: int | None = None
    wbytes: int | None = None
    rios: int | None = None
    wios: int | None = None
    dbytes: int | None = None
    dios: int | None = None
    other: tuple[tuple[str, str], ...] = ()

    @property
    def device(self) -> str:
        return f"{self.major}:{self.minor}"


#: The ``io.stat`` keys :class:`IoDeviceStat` holds as integers.
IO_STAT_NAMES = ("rbytes", "wbytes", "rios", "wios", "dbytes", "dios")


@dataclass(frozen=True, slots=True)
class IoStat:
    devices: tuple[IoDeviceStat, ...]

    def get(self, device: str) -> IoDeviceStat | None:
        for entry in self.devices:
            if entry.device == device:
                return entry
        return None


@dataclass(frozen=True, slots=True)
class Limit:
    """A limit file that reads ``max`` or a number: ``value`` is ``None`` when unlimited.

    A cgroup field of type ``Limit | None`` is ``None`` when the file is absent, which is not
    the same as unlimited.
    """

    value: int | None

    @property
    def unlimited(self) -> bool:
        return self.value is None


@dataclass(frozen=True, slots=True)
class ProcCgroupEntry:
    """One line of ``/proc/<pid>/cgroup``. ``hierarchy_id`` 0 with no controllers is the v2
    hierarchy; v1 lines name their controllers (``memory``, ``cpu,cpuacct``,
    ``name=systemd``). Inside a cgroup namespace ``path`` is relative to the namespace root
    and may start with ``/..``."""

    hierarchy_id: int
    controllers: tuple[str, ...]
    path: str
    deleted: bool = False


@dataclass(frozen=True, slots=True)
class ProcCgroup:
    entries: tuple[ProcCgroupEntry, ...]

    @property
    def v2_path(self) -> str | None:
        """The path in the unified hierarchy (``0::<path>``), or ``None`` on a pure v1 host."""
        for entry in self.entries:
            if entry.hierarchy_id == 0 and not entry.controllers:
                return entry.path
        return None

    def v1_path(self, controller: str) -> str | None:
        """The path in the v1 hierarchy that has ``controller`` (``memory``, ``name=systemd``)."""
        for entry in self.entries:
            if controller in entry.controllers:
                return entry.path
        return None


HierarchyMode = Literal["unified", "hybrid", "none"]


@dataclass(frozen=True, slots=True)
class V2Hierarchy:
    """Where the cgroup v2 hierarchy is: ``unified`` when it is the cgroupfs root itself,
    ``hybrid`` when v1 hierarchies own the root and v2 sits at ``<root>/unified``."""

    mode: HierarchyMode
    path: Path | None


@dataclass(frozen=True, slots=True)
class Cgroup:
    """One cgroup as read in one walk.

    ``path`` is relative to the v2 root in the form ``/proc/<pid>/cgroup`` uses: ``/`` for the
    root, ``/system.slice/slurmstepd.scope`` below it. Every file field is ``None`` when the
    file is absent (controller not enabled, the root cgroup, an older kernel).

    ``nr_procs``/``nr_threads`` count distinct ids in ``cgroup.procs``/``cgroup.threads``
    (direct members only, not descendants). ``nr_procs`` is ``None`` in a ``threaded`` cgroup,
    where the kernel refuses to list processes. ``procs``/``threads`` hold the ids only when
    the source was made with ``keep_pids``.
    """

    path: str
    depth: int
    type: str | None
    controllers: tuple[str, ...] | None
    nr_children: int
    events: CgroupEvents | None = None
    nr_procs: int | None = None
    nr_threads: int | None = None
    procs: tuple[int, ...] | None = None
    threads: tuple[int, ...] | None = None
    memory_current: int | None = None
    memory_peak: int | None = None
    memory_high: Limit | None = None
    memory_max: Limit | None = None
    memory_events: MemoryEvents | None = None
    memory_events_local: MemoryEvents | None = None
    memory_stat: KeyValues | None = None
    cpu_stat: CpuStat | None = None
    io_stat: IoStat | None = None
    pids_current: int | None = None
    pids_max: Limit | None = None
    pids_events: KeyValues | None = None
    cpu_pressure: Pressure | None = None
    memory_pressure: Pressure | None = None
    io_pressure: Pressure | None = None
    irq_pressure: Pressure | None = None

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1] or "/"

    @property
    def parent_path(self) -> str | None:
        if self.path == "/":
            return None
        parent = self.path.rsplit("/", 1)[0]
        return parent or "/"


@dataclass(frozen=True)
class CgroupTree:
    """The cgroup v2 tree as read in one walk.

    ``cgroups`` is breadth first, siblings by name, the root first, so a walk cut short by
    ``max_cgroups`` keeps the shallow cgroups. ``truncated``: cgroups exist that the walk did
    not reach because of ``max_cgroups``; ``depth_limited``: cgroups exist below
    ``max_depth`` (a chosen limit, not a loss of the configured view).
    """

    mode: HierarchyMode
    root: str | None
    cgroups: tuple[Cgroup, ...]
    max_depth: int | None
    max_cgroups: int
    truncated: bool = False
    depth_limited: bool = False
    #: What the walk skipped: cgroups it could not list, files it could not read or parse.
    skipped: Skipped = NOTHING_SKIPPED

    @cached_property
    def _index(self) -> dict[str, Cgroup]:
        return {cgroup.path: cgroup for cgroup in self.cgroups}

    def get(self, path: str) -> Cgroup | None:
        return self._index.get(_normalise(path))

    def children(self, path: str) -> tuple[Cgroup, ...]:
        parent = _normalise(path)
        return tuple(c for c in self.cgroups if c.parent_path == parent)

    def subtree(self, path: str) -> tuple[Cgroup, ...]:
        """The cgroup at ``path`` and every descendant that was read, in walk order."""
        top = _normalise(path)
        if top == "/":
            return self.cgroups
        prefix = top + "/"
        return tuple(c for c in self.cgroups if c.path == top or c.path.startswith(prefix))


def _normalise(path: str) -> str:
    stripped = path.strip("/")
    return "/" + stripped if stripped else "/"


#: The ``cgroups`` source's records: the v2 tree of one walk (without the id lists unless the
#: source was made with ``keep_pids``).
CGROUPS = SourceKey("cgroups", CgroupTree)
