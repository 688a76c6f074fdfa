"""cgroup v2: find the unified hierarchy, walk it, parse its interface files.

Reads, under ``roots.cgroupfs``, the cgroup v2 hierarchy (the root itself on a pure v2 host,
``<root>/unified`` on a hybrid one), and ``/proc/<pid>/cgroup`` under ``roots.procfs``.

Formats are defined by the kernel:

* interface files (``cgroup.*``, ``memory.*``, ``cpu.stat``, ``io.stat``, ``pids.*``):
  ``Documentation/admin-guide/cgroup-v2.rst``, section "Interface Files" of each controller;
* ``*.pressure``: ``Documentation/accounting/psi.rst`` (``some``/``full`` lines, averages in
  percent with two decimals, ``total`` in microseconds);
* ``/proc/<pid>/cgroup``: ``kernel/cgroup/cgroup.c`` ``proc_cgroup_show()``, one
  ``hierarchy-id:controllers:path`` line per hierarchy, ``" (deleted)"`` appended when the
  cgroup was removed.

The parsers are pure and raise only :class:`~nodescope.errors.ParseError`. The walk reads
only files that the directory listing shows, so files a controller does not provide cost
nothing and parse to ``None`` ("absent"), never to 0.
"""

from __future__ import annotations

import math
import os
import re
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

from nodescope.errors import ParseError
from nodescope.roots import Roots
from nodescope.sources.base import read_optional

SOURCE_NAME = "cgroups"

DEFAULT_MAX_CGROUPS = 10_000

_INT = re.compile(r"-?[0-9]+")
_UINT = re.compile(r"[0-9]+")
# PSI averages are printed as "%lu.%02lu" (kernel/sched/psi.c psi_show()).
_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]+)?")
_KEY = re.compile(r"[A-Za-z0-9_.]+")
_DEVICE = re.compile(r"([0-9]+):([0-9]+)")
_CGROUP_TYPE = re.compile(r"[a-z]+(?: [a-z]+)*")
_CONTROLLER = re.compile(r"[A-Za-z0-9_]+")

_DELETED_SUFFIX = " (deleted)"


# ---------------------------------------------------------------------------------------------
# Records


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
            for name in _MEMORY_EVENT_NAMES
            if (value := getattr(self, name)) is not None
        )
        return named + self.other


_MEMORY_EVENT_NAMES = ("low", "high", "max", "oom", "oom_kill", "oom_group_kill")


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


_CPU_STAT_NAMES = (
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


_IO_STAT_NAMES = ("rbytes", "wbytes", "rios", "wios", "dbytes", "dios")


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


# ---------------------------------------------------------------------------------------------
# Parsers (pure)


def _to_int(token: str, source: str, line: int, what: str, signed: bool = False) -> int:
    pattern = _INT if signed else _UINT
    if not pattern.fullmatch(token):
        raise ParseError(source, f"{what}: {token!r} is not an integer", line)
    try:
        return int(token)
    except ValueError as exc:  # more digits than int() accepts
        raise ParseError(source, f"{what}: {exc}", line) from None


def _lines(text: str) -> Iterator[tuple[int, str]]:
    """Non-blank lines with their 1-based numbers."""
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            yield number, line


def _single_token(text: str, source: str) -> str:
    lines = list(_lines(text))
    if len(lines) != 1:
        raise ParseError(source, f"expected one value, found {len(lines)} lines", 1)
    number, line = lines[0]
    tokens = line.split()
    if len(tokens) != 1:
        raise ParseError(source, f"expected one value, found {line.strip()!r}", number)
    return tokens[0]


def parse_value(text: str, source: str = "memory.current") -> int:
    """A file holding one non-negative integer: ``memory.current``, ``memory.peak`` (bytes),
    ``pids.current`` (tasks)."""
    token = _single_token(text, source)
    return _to_int(token, source, 1, "value")


def parse_limit(text: str, source: str = "memory.max") -> int | None:
    """``memory.max``, ``memory.high``, ``pids.max``: a number, or ``max`` (returned as
    ``None``: unlimited)."""
    token = _single_token(text, source)
    if token == "max":
        return None
    return _to_int(token, source, 1, "limit")


def _key_value_lines(text: str, source: str) -> list[tuple[int, str, int]]:
    """(line number, key, value) of ``key value`` lines; keys must not repeat."""
    rows: list[tuple[int, str, int]] = []
    seen: set[str] = set()
    for number, line in _lines(text):
        parts = line.split()
        if len(parts) != 2:
            raise ParseError(source, f"expected 'key value', found {line.strip()!r}", number)
        key, value = parts
        if not _KEY.fullmatch(key):
            raise ParseError(source, f"bad key {key!r}", number)
        if key in seen:
            raise ParseError(source, f"key {key!r} repeated", number)
        seen.add(key)
        # Some of these counters have signed kernel types: a negative value is odd, not
        # malformed, and must not take the whole walk down.
        rows.append((number, key, _to_int(value, source, number, key, signed=True)))
    return rows


def parse_key_values(text: str, source: str = "memory.stat") -> KeyValues:
    """``key value`` lines (``memory.stat``, ``cgroup.stat``, ``pids.events``, …)."""
    return KeyValues(tuple((key, value) for _, key, value in _key_value_lines(text, source)))


def _split_named(
    kv: KeyValues, names: tuple[str, ...]
) -> tuple[dict[str, int], tuple[tuple[str, int], ...]]:
    known = {key: value for key, value in kv.items if key in names}
    other = tuple((key, value) for key, value in kv.items if key not in names)
    return known, other


def parse_memory_events(text: str, source: str = "memory.events") -> MemoryEvents:
    """``memory.events`` or ``memory.events.local``; unknown event names are kept."""
    known, other = _split_named(parse_key_values(text, source), _MEMORY_EVENT_NAMES)
    return MemoryEvents(**known, other=other)


def parse_cpu_stat(text: str, source: str = "cpu.stat") -> CpuStat:
    """``cpu.stat`` (microseconds and counts); unknown keys are kept."""
    known, other = _split_named(parse_key_values(text, source), _CPU_STAT_NAMES)
    return CpuStat(**known, other=other)


def parse_cgroup_events(text: str, source: str = "cgroup.events") -> CgroupEvents:
    """``cgroup.events``: ``populated``/``frozen`` flags (0 or 1), other keys kept."""
    flags: dict[str, bool] = {}
    other: list[tuple[str, int]] = []
    for number, key, value in _key_value_lines(text, source):
        if key in ("populated", "frozen"):
            if value not in (0, 1):
                raise ParseError(source, f"{key} must be 0 or 1, not {value}", number)
            flags[key] = value == 1
        else:
            other.append((key, value))
    return CgroupEvents(
        populated=flags.get("populated"), frozen=flags.get("frozen"), other=tuple(other)
    )


def _pressure_line(parts: list[str], source: str, number: int) -> PressureLine:
    values: dict[str, str] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or not key or not value:
            raise ParseError(source, f"expected key=value, found {part!r}", number)
        if key in values:
            raise ParseError(source, f"{key} repeated", number)
        values[key] = value
    averages: list[float] = []
    for key in ("avg10", "avg60", "avg300"):
        raw = values.get(key)
        if raw is None:
            raise ParseError(source, f"{key} missing", number)
        if not _DECIMAL.fullmatch(raw):
            raise ParseError(source, f"{key}: {raw!r} is not a decimal", number)
        avg = float(raw)
        if not math.isfinite(avg):
            raise ParseError(source, f"{key}: {raw!r} out of range", number)
        averages.append(avg)
    raw_total = values.get("total")
    if raw_total is None:
        raise ParseError(source, "total missing", number)
    total = _to_int(raw_total, source, number, "total")
    return PressureLine(averages[0], averages[1], averages[2], total)


def parse_pressure(text: str, source: str = "cpu.pressure") -> Pressure:
    """A PSI file: a ``some`` and/or a ``full`` line."""
    lines: dict[str, PressureLine] = {}
    for number, line in _lines(text):
        parts = line.split()
        kind = parts[0]
        if kind not in ("some", "full"):
            raise ParseError(source, f"expected 'some' or 'full', found {kind!r}", number)
        if kind in lines:
            raise ParseError(source, f"second {kind!r} line", number)
        lines[kind] = _pressure_line(parts[1:], source, number)
    if not lines:
        raise ParseError(source, "no 'some' or 'full' line", 1)
    return Pressure(some=lines.get("some"), full=lines.get("full"))


def parse_io_stat(text: str, source: str = "io.stat") -> IoStat:
    """``io.stat``: ``MAJ:MIN key=value …`` per device, unordered. Values of the standard
    keys are integers; any other key is kept as text (io.cost prints decimals)."""
    devices: list[IoDeviceStat] = []
    seen: set[tuple[int, int]] = set()
    for number, line in _lines(text):
        parts = line.split()
        match = _DEVICE.fullmatch(parts[0])
        if match is None:
            raise ParseError(source, f"expected MAJ:MIN, found {parts[0]!r}", number)
        major = _to_int(match.group(1), source, number, "major")
        minor = _to_int(match.group(2), source, number, "minor")
        if (major, minor) in seen:
            raise ParseError(source, f"device {major}:{minor} repeated", number)
        seen.add((major, minor))
        known: dict[str, int] = {}
        other: list[tuple[str, str]] = []
        keys: set[str] = set()
        for part in parts[1:]:
            key, sep, value = part.partition("=")
            if not sep or not key or not value or not _KEY.fullmatch(key):
                raise ParseError(source, f"expected key=value, found {part!r}", number)
            if key in keys:
                raise ParseError(source, f"{key} repeated for {major}:{minor}", number)
            keys.add(key)
            if key in _IO_STAT_NAMES:
                known[key] = _to_int(value, source, number, key)
            else:
                other.append((key, value))
        devices.append(IoDeviceStat(major, minor, **known, other=tuple(other)))
    return IoStat(tuple(devices))


def parse_ids(text: str, source: str = "cgroup.procs") -> tuple[int, ...]:
    """``cgroup.procs``/``cgroup.threads``: one id per line, unordered; the kernel may list an
    id twice when tasks move during the read, so the tuple keeps what was read."""
    ids: list[int] = []
    for number, line in _lines(text):
        ids.append(_to_int(line.strip(), source, number, "id"))
    return tuple(ids)


def parse_cgroup_type(text: str, source: str = "cgroup.type") -> str:
    """``cgroup.type``: ``domain``, ``domain threaded``, ``domain invalid`` or ``threaded``."""
    lines = list(_lines(text))
    if len(lines) != 1:
        raise ParseError(source, f"expected one line, found {len(lines)}", 1)
    number, line = lines[0]
    value = line.strip()
    if not _CGROUP_TYPE.fullmatch(value):
        raise ParseError(source, f"bad cgroup type {value!r}", number)
    return value


def parse_controllers(text: str, source: str = "cgroup.controllers") -> tuple[str, ...]:
    """``cgroup.controllers`` (or ``cgroup.subtree_control``): space-separated names on one
    line; empty when no controller is available."""
    lines = list(_lines(text))
    if len(lines) > 1:
        raise ParseError(source, f"expected one line, found {len(lines)}", lines[1][0])
    if not lines:
        return ()
    number, line = lines[0]
    names = tuple(line.split())
    for name in names:
        if not _CONTROLLER.fullmatch(name):
            raise ParseError(source, f"bad controller name {name!r}", number)
    return names


def parse_proc_cgroup(text: str, source: str = "/proc/self/cgroup") -> ProcCgroup:
    """``/proc/<pid>/cgroup``: ``hierarchy-id:controllers:path`` per line (hybrid hosts have
    one line per v1 hierarchy plus ``0::<path>``)."""
    entries: list[ProcCgroupEntry] = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line:
            continue
        fields = line.split(":", 2)
        if len(fields) != 3:
            raise ParseError(source, f"expected id:controllers:path, found {line!r}", number)
        raw_id, raw_controllers, path = fields
        hierarchy_id = _to_int(raw_id, source, number, "hierarchy id")
        controllers = tuple(raw_controllers.split(",")) if raw_controllers else ()
        if any(not name for name in controllers):
            raise ParseError(source, f"empty controller name in {raw_controllers!r}", number)
        deleted = path.endswith(_DELETED_SUFFIX)
        if deleted:
            path = path[: -len(_DELETED_SUFFIX)]
        if not path.startswith("/"):
            raise ParseError(source, f"path {path!r} is not absolute", number)
        entries.append(ProcCgroupEntry(hierarchy_id, controllers, path, deleted))
    if not entries:
        raise ParseError(source, "no cgroup lines", 1)
    return ProcCgroup(tuple(entries))


# ---------------------------------------------------------------------------------------------
# Readers (IO)


def find_v2_root(cgroupfs: Path) -> V2Hierarchy:
    """Where the v2 hierarchy is mounted under the cgroupfs root.

    Every v2 cgroup, the root included, has ``cgroup.controllers``; no v1 hierarchy has it.
    """
    if (cgroupfs / "cgroup.controllers").is_file():
        return V2Hierarchy("unified", cgroupfs)
    unified = cgroupfs / "unified"
    if (unified / "cgroup.controllers").is_file():
        return V2Hierarchy("hybrid", unified)
    return V2Hierarchy("none", None)


def read_proc_cgroup(roots: Roots, pid: int | str = "self") -> ProcCgroup | None:
    """``/proc/<pid>/cgroup``, or ``None`` when the process is gone."""
    path = roots.procfs / str(pid) / "cgroup"
    text = read_optional(path)
    return None if text is None else parse_proc_cgroup(text, str(path))


def _read_file(directory: Path, files: frozenset[str], name: str) -> tuple[str, str] | None:
    if name not in files:
        return None
    # A string path: a cgroup walk reads thousands of files, and a Path per file costs more
    # than reading it.
    path = f"{directory}/{name}"
    text = read_optional(path)
    return None if text is None else (text, path)


def read_cgroup(
    directory: Path,
    path: str,
    depth: int,
    files: frozenset[str],
    nr_children: int,
    keep_pids: bool = False,
) -> Cgroup | None:
    """Read one cgroup directory whose listing gave ``files``; ``None`` when it vanished
    between the listing and the reads."""
    controllers_file = _read_file(directory, files, "cgroup.controllers")
    if controllers_file is None and "cgroup.controllers" in files:
        return None
    controllers = None if controllers_file is None else parse_controllers(*controllers_file)

    def one(name: str) -> tuple[str, str] | None:
        return _read_file(directory, files, name)

    type_file = one("cgroup.type")
    cgroup_type = None if type_file is None else parse_cgroup_type(*type_file)
    events_file = one("cgroup.events")
    events = None if events_file is None else parse_cgroup_events(*events_file)

    procs: tuple[int, ...] | None
    threads: tuple[int, ...] | None
    if events is not None and events.populated is False:
        # Nothing lives here or below: skip reading the id lists.
        procs = None if cgroup_type == "threaded" else ()
        threads = ()
    else:
        # A threaded cgroup refuses to list processes (EOPNOTSUPP), which reads as absent.
        procs_file = None if cgroup_type == "threaded" else one("cgroup.procs")
        procs = None if procs_file is None else parse_ids(*procs_file)
        threads_file = one("cgroup.threads")
        threads = None if threads_file is None else parse_ids(*threads_file)

    def value(name: str) -> int | None:
        found = one(name)
        return None if found is None else parse_value(*found)

    def limit(name: str) -> Limit | None:
        found = one(name)
        return None if found is None else Limit(parse_limit(*found))

    def memory_events(name: str) -> MemoryEvents | None:
        found = one(name)
        return None if found is None else parse_memory_events(*found)

    def pressure(name: str) -> Pressure | None:
        found = one(name)
        return None if found is None else parse_pressure(*found)

    memory_stat = one("memory.stat")
    cpu_stat = one("cpu.stat")
    io_stat = one("io.stat")
    pids_events = one("pids.events")
    return Cgroup(
        path=path,
        depth=depth,
        type=cgroup_type,
        controllers=controllers,
        nr_children=nr_children,
        events=events,
        nr_procs=None if procs is None else len(set(procs)),
        nr_threads=None if threads is None else len(set(threads)),
        procs=procs if keep_pids else None,
        threads=threads if keep_pids else None,
        memory_current=value("memory.current"),
        memory_peak=value("memory.peak"),
        memory_high=limit("memory.high"),
        memory_max=limit("memory.max"),
        memory_events=memory_events("memory.events"),
        memory_events_local=memory_events("memory.events.local"),
        memory_stat=None if memory_stat is None else parse_key_values(*memory_stat),
        cpu_stat=None if cpu_stat is None else parse_cpu_stat(*cpu_stat),
        io_stat=None if io_stat is None else parse_io_stat(*io_stat),
        pids_current=value("pids.current"),
        pids_max=limit("pids.max"),
        pids_events=None if pids_events is None else parse_key_values(*pids_events),
        cpu_pressure=pressure("cpu.pressure"),
        memory_pressure=pressure("memory.pressure"),
        io_pressure=pressure("io.pressure"),
        irq_pressure=pressure("irq.pressure"),
    )


def _list_dir(directory: Path) -> tuple[frozenset[str], list[str]] | None:
    """(file names, subdirectory names) of a cgroup directory; ``None`` when it is gone.
    Symlinks are neither followed nor read: cgroupfs has none, a fixture tree might."""
    files: set[str] = set()
    subdirs: list[str] = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        subdirs.append(entry.name)
                    elif entry.is_file(follow_symlinks=False):
                        files.add(entry.name)
                except OSError:
                    continue
    except (FileNotFoundError, NotADirectoryError):
        return None
    return frozenset(files), sorted(subdirs)


def read_tree(
    roots: Roots,
    max_depth: int | None = None,
    max_cgroups: int = DEFAULT_MAX_CGROUPS,
    keep_pids: bool = False,
) -> CgroupTree:
    """Walk the v2 hierarchy breadth first, at most ``max_cgroups`` cgroups and ``max_depth``
    levels below the root (``None``: no depth limit)."""
    hierarchy = find_v2_root(roots.cgroupfs)
    if hierarchy.path is None:
        return CgroupTree("none", None, (), max_depth, max_cgroups)
    cgroups: list[Cgroup] = []
    truncated = False
    depth_limited = False
    queue: deque[tuple[str, Path, int]] = deque([("/", hierarchy.path, 0)])
    while queue:
        if len(cgroups) >= max_cgroups:
            truncated = True
            break
        path, directory, depth = queue.popleft()
        listing = _list_dir(directory)
        if listing is None:
            continue  # removed since its parent was listed
        files, subdirs = listing
        cgroup = read_cgroup(directory, path, depth, files, len(subdirs), keep_pids)
        if cgroup is None:
            continue
        cgroups.append(cgroup)
        if max_depth is not None and depth >= max_depth:
            depth_limited = depth_limited or bool(subdirs)
            continue
        prefix = "" if path == "/" else path
        for name in subdirs:
            queue.append((f"{prefix}/{name}", directory / name, depth + 1))
    return CgroupTree(
        hierarchy.mode,
        str(hierarchy.path),
        tuple(cgroups),
        max_depth,
        max_cgroups,
        truncated=truncated,
        depth_limited=depth_limited,
    )


@dataclass
class CgroupSource:
    """The ``cgroups`` source: one walk of the v2 tree per run."""

    max_depth: int | None = None
    max_cgroups: int = DEFAULT_MAX_CGROUPS
    keep_pids: bool = False
    name: str = SOURCE_NAME

    def collect(self, roots: Roots) -> CgroupTree:
        return read_tree(roots, self.max_depth, self.max_cgroups, self.keep_pids)

    def close(self) -> None:
        return None


def make_source(
    max_depth: int | None = None,
    max_cgroups: int = DEFAULT_MAX_CGROUPS,
    keep_pids: bool = False,
) -> CgroupSource:
    """The source; ``max_depth`` and ``max_cgroups`` bound the cost of one walk, ``keep_pids``
    keeps the id lists of ``cgroup.procs``/``cgroup.threads`` (counts are always kept)."""
    if max_depth is not None and max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, not {max_depth}")
    if max_cgroups < 1:
        raise ValueError(f"max_cgroups must be >= 1, not {max_cgroups}")
    return CgroupSource(max_depth=max_depth, max_cgroups=max_cgroups, keep_pids=keep_pids)
