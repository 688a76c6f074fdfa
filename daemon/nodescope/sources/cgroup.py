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

What a walk costs is one ``read`` per file, so a walk reads what can have changed: the
:data:`STATIC_FILES` (limits, controllers, type) when a cgroup is first seen or made again
under the same name (a new inode) and every ``slow_every`` walks; ``memory.events.local``
when ``memory.events`` moved; ``cgroup.threads`` only where ``cgroup.procs`` lists a process;
the other files on every walk, parsed again only when their text changed. One walk serves
the ``cgroups``, ``jobs``, ``procs`` and ``threads`` sources of a cycle (:class:`CycleWalk`).
The records are declared in :mod:`nodescope.model.cgroup`.
"""

from __future__ import annotations

import errno
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple, TypeVar, cast

from nodescope.errors import ParseError
from nodescope.fileio import CGROUP_LIST, CGROUP_STAT, PROC_PROCESS
from nodescope.model.cgroup import (
    CGROUPS,
    CPU_STAT_NAMES,
    IO_STAT_NAMES,
    MEMORY_EVENT_NAMES,
    Cgroup,
    CgroupEvents,
    CgroupTree,
    CpuStat,
    HierarchyMode,
    IoDeviceStat,
    IoStat,
    KeyValues,
    Limit,
    MemoryEvents,
    Pressure,
    PressureLine,
    ProcCgroup,
    ProcCgroupEntry,
    V2Hierarchy,
)
from nodescope.model.skips import NOTHING_SKIPPED, Skipped, SkipTally
from nodescope.roots import Roots
from nodescope.sources.base import read_optional, read_text
from nodescope.sources.psi_format import parse_psi_line
from nodescope.sources.spec import SourceSpec

SOURCE_NAME = CGROUPS.name

DEFAULT_MAX_CGROUPS = 10_000

_INT = re.compile(r"-?[0-9]+")
_UINT = re.compile(r"[0-9]+")
_KEY = re.compile(r"[A-Za-z0-9_.]+")
_DEVICE = re.compile(r"([0-9]+):([0-9]+)")
_CGROUP_TYPE = re.compile(r"[a-z]+(?: [a-z]+)*")
_CONTROLLER = re.compile(r"[A-Za-z0-9_]+")

_DELETED_SUFFIX = " (deleted)"

_T = TypeVar("_T")

#: Why part of the tree was skipped (the ``reason`` of
#: ``nodescope_source_records_skipped_total``): a cgroup directory that cannot be listed
#: (``EACCES``; the cgroup and what is below it are left out); an interface file that cannot
#: be read (refused, over its cap) or does not parse (the cgroup is kept, that figure is
#: absent); a line of ``cgroup.procs``/``cgroup.threads`` that is not an id.
CGROUP_UNREADABLE = "cgroup_unreadable"
FILE_UNREADABLE = "cgroup_file_unreadable"
FILE_UNPARSABLE = "cgroup_file_unparsable"
ID_UNPARSABLE = "id_unparsable"

#: The task lists, read to EOF a page at a time; every other interface file is one record.
_ID_FILES = frozenset({"cgroup.procs", "cgroup.threads"})


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
    known, other = _split_named(parse_key_values(text, source), MEMORY_EVENT_NAMES)
    return MemoryEvents(**known, other=other)


def parse_cpu_stat(text: str, source: str = "cpu.stat") -> CpuStat:
    """``cpu.stat`` (microseconds and counts); unknown keys are kept."""
    known, other = _split_named(parse_key_values(text, source), CPU_STAT_NAMES)
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


def parse_pressure(text: str, source: str = "cpu.pressure") -> Pressure:
    """A PSI file: a ``some`` and/or a ``full`` line in the kernel's format
    (:mod:`~nodescope.sources.psi_format`); any other line refuses the whole file."""
    lines: dict[str, PressureLine] = {}
    for number, line in _lines(text):
        parsed = parse_psi_line(line)
        if parsed is None:
            raise ParseError(source, f"not in the kernel's PSI format: {line[:80]!r}", number)
        kind, figures = parsed
        if kind in lines:
            raise ParseError(source, f"second {kind!r} line", number)
        lines[kind] = figures
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
            if key in IO_STAT_NAMES:
                known[key] = _to_int(value, source, number, key)
            else:
                other.append((key, value))
        devices.append(IoDeviceStat(major, minor, **known, other=tuple(other)))
    return IoStat(tuple(devices))


def parse_ids(
    text: str, source: str = "cgroup.procs", tally: SkipTally | None = None
) -> tuple[int, ...]:
    """``cgroup.procs``/``cgroup.threads``: one id per line, unordered; the kernel may list an
    id twice when tasks move during the read, so the tuple keeps what was read. A line that
    is not an id is skipped, counted in ``tally`` as :data:`ID_UNPARSABLE`."""
    ids: list[int] = []
    for _, line in _lines(text):
        token = line.strip()
        # pid_max is at most 2^22: ten digits hold any id.
        if len(token) <= 10 and _UINT.fullmatch(token):
            ids.append(int(token))
        elif tally is not None:
            tally.skip(ID_UNPARSABLE, f"{source}: {token}")
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
    one line per v1 hierarchy plus ``0::<path>``).

    The kernel prints paths as they are; a line break still ends an entry, as
    ``cgroup_mkdir`` refuses a name that holds one (``EINVAL``), so a user who names the
    cgroups delegated to them cannot forge an entry. A malformed file raises: the caller
    skips that process or thread."""
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
    text = read_optional(path, PROC_PROCESS)
    return None if text is None else parse_proc_cgroup(text, str(path))


#: Files that change only when someone sets a limit or the cgroup's role: read when a cgroup
#: is first seen (or was made again under the same name) and on every ``slow_every``-th walk.
STATIC_FILES = ("cgroup.controllers", "cgroup.type", "memory.high", "memory.max", "pids.max")

#: Default of :attr:`CycleWalk.slow_every` (and of the jobs source's environments): walks
#: between two reads of the :data:`STATIC_FILES`.
SLOW_EVERY = 10

#: Seconds a source waits for the walk of its cycle that another thread is making (a source
#: that overran its deadline left it running) before it gives up on that walk.
WALK_WAIT_SECONDS = 5.0

_NO_IDS: tuple[int, ...] = ()

#: The parsed :data:`STATIC_FILES`: controllers, type, memory.high, memory.max, pids.max.
_Static = tuple[tuple[str, ...] | None, str | None, Limit | None, Limit | None, Limit | None]


class _Inputs(NamedTuple):
    """What one cgroup's record is made of, as one read gathered it: the memo keeps the last
    read's, and a read whose inputs are equal to them gives the memo's record again."""

    depth: object
    nr_children: object
    static: object
    events: object
    procs: object
    threads: object
    memory_events: object
    memory_events_local: object
    memory_current: object
    memory_peak: object
    memory_stat: object
    cpu_stat: object
    io_stat: object
    pids_current: object
    pids_events: object
    cpu_pressure: object
    memory_pressure: object
    io_pressure: object
    irq_pressure: object


class _Memo:
    """What one walk learned about one cgroup directory and the next walk reuses: the static
    files, the text and parsed value of every other file (a file whose text did not change is
    not parsed again), and the records built from them (reused while every input is the
    same object)."""

    __slots__ = ("bare", "inode", "inputs", "parsed", "record", "skips", "static", "texts")

    def __init__(self, inode: int) -> None:
        self.inode = inode
        self.static: _Static | None = None
        self.texts: dict[str, str] = {}
        self.parsed: dict[str, object] = {}
        #: Lines skipped in the parse of an id list that is reused unparsed: they count again
        #: on every walk that reads the same text.
        self.skips: dict[str, Skipped] = {}
        self.inputs: _Inputs | None = None
        self.record: Cgroup | None = None
        self.bare: Cgroup | None = None

    def bare_record(self) -> Cgroup:
        """The record without the id lists (what the ``cgroups`` source exports)."""
        assert self.record is not None
        if self.bare is None:
            record = self.record
            self.bare = (
                record
                if record.procs is None and record.threads is None
                else replace(record, procs=None, threads=None)
            )
        return self.bare


#: Errors of a read that mean the file or its cgroup is gone, or the file is not offered
#: (``cgroup.procs`` of a threaded cgroup): absent, not skipped.
_ABSENT_ERRNOS = frozenset({errno.ENOENT, errno.ENODEV, errno.ESRCH, errno.EOPNOTSUPP})


class _DirectoryRead:
    """One read of one cgroup directory whose listing gave ``files``, into its memo: each
    file's text is compared with the one the memo holds, and parsed only when it changed. A
    file that cannot be read or parsed is forgotten, noted in ``failed`` and counted in
    ``tally``."""

    __slots__ = ("directory", "failed", "files", "parsed", "skips", "tally", "texts")

    def __init__(
        self, directory: str, files: frozenset[str], memo: _Memo, tally: SkipTally
    ) -> None:
        self.directory = directory
        self.files = files
        self.texts = memo.texts
        self.parsed = memo.parsed
        self.skips = memo.skips
        self.tally = tally
        #: files present but unreadable or unparsable in this read
        self.failed: set[str] = set()

    def vanished(self, name: str, text: object) -> bool:
        """Whether ``name`` gave nothing though the listing had it and its read did not
        fail: the cgroup went away between the listing and the read."""
        return text is None and name in self.files and name not in self.failed

    def forget(self, name: str) -> None:
        # Unreadable now: what it held before must not stand in for it.
        self.texts.pop(name, None)
        self.parsed.pop(name, None)
        self.skips.pop(name, None)

    def text_of(self, name: str) -> tuple[str, str] | None:
        if name not in self.files:
            return None
        # A string path: a cgroup walk reads thousands of files, and a Path per file costs
        # more than reading it.
        full = f"{self.directory}/{name}"
        try:
            text = read_text(full, CGROUP_LIST if name in _ID_FILES else CGROUP_STAT)
        except OSError as exc:
            self.forget(name)
            if exc.errno not in _ABSENT_ERRNOS:
                self.failed.add(name)
                self.tally.skip(FILE_UNREADABLE, full)
            return None
        return text, full

    def parsed_or_none(
        self, name: str, parse: Callable[[str, str], _T], text: str, full: str
    ) -> _T | None:
        try:
            return parse(text, full)
        except ParseError as exc:
            self.forget(name)
            self.failed.add(name)
            self.tally.skip(FILE_UNPARSABLE, str(exc))
            return None

    def one(self, name: str, parse: Callable[[str, str], object]) -> object:
        """The parsed value of a figures file: the memo's while its text is the same."""
        found = self.text_of(name)
        if found is None:
            return None
        text, full = found
        texts = self.texts
        if texts.get(name) == text:
            return self.parsed[name]
        value = self.parsed_or_none(name, parse, text, full)
        if value is not None:
            texts[name] = text
            self.parsed[name] = value
        return value

    def ids(self, name: str) -> tuple[int, ...] | None:
        """An id list (``cgroup.procs``, ``cgroup.threads``); its skipped lines count on
        every read, the memo's included."""
        found = self.text_of(name)
        if found is None:
            return None
        text, full = found
        texts, parsed, skips, tally = self.texts, self.parsed, self.skips, self.tally
        if texts.get(name) == text:
            tally.merge(skips.get(name, NOTHING_SKIPPED))
            return cast(tuple[int, ...], parsed[name])
        lines = SkipTally()
        value = parse_ids(text, full, lines)
        texts[name] = text
        parsed[name] = value
        skips[name] = lines.freeze()
        tally.merge(skips[name])
        return value

    def limit(self, name: str) -> Limit | None:
        found = self.text_of(name)
        if found is None:
            return None
        return self.parsed_or_none(name, lambda text, full: Limit(parse_limit(text, full)), *found)


def _read_static(read: _DirectoryRead) -> _Static | None:
    """The :data:`STATIC_FILES` of the directory; ``None`` when it vanished (its
    ``cgroup.controllers`` listed but gone)."""
    controllers_file = read.text_of("cgroup.controllers")
    if read.vanished("cgroup.controllers", controllers_file):
        return None
    type_file = read.text_of("cgroup.type")
    return (
        None
        if controllers_file is None
        else read.parsed_or_none("cgroup.controllers", parse_controllers, *controllers_file),
        None
        if type_file is None
        else read.parsed_or_none("cgroup.type", parse_cgroup_type, *type_file),
        read.limit("memory.high"),
        read.limit("memory.max"),
        read.limit("pids.max"),
    )


def _read_id_lists(
    read: _DirectoryRead, events: CgroupEvents | None, cgroup_type: str | None, slow: bool
) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """``cgroup.procs`` and ``cgroup.threads``, not read where they must be empty."""
    if events is not None and events.populated is False:
        # Nothing lives here or below: skip reading the id lists.
        return (None if cgroup_type == "threaded" else _NO_IDS), _NO_IDS
    # A threaded cgroup refuses to list processes (EOPNOTSUPP), which reads as absent.
    procs = None if cgroup_type == "threaded" else read.ids("cgroup.procs")
    if procs == () and cgroup_type is not None and not slow:
        # No process here: no thread either. A domain cgroup holds whole processes, and
        # a threaded domain's cgroup.procs lists every process of its threaded subtree.
        return procs, _NO_IDS
    return procs, read.ids("cgroup.threads")


def _read_memory_events(read: _DirectoryRead, slow: bool) -> tuple[object, object]:
    """``memory.events`` and ``memory.events.local``, the second read only when the first
    changed (or on a slow read)."""
    texts, parsed = read.texts, read.parsed
    old_events = texts.get("memory.events")
    memory_events = read.one("memory.events", parse_memory_events)
    if (
        slow
        or memory_events is None
        or old_events is None
        or texts.get("memory.events") != old_events
        or "memory.events.local" not in parsed
        or "memory.events.local" not in read.files
    ):
        return memory_events, read.one("memory.events.local", parse_memory_events)
    return memory_events, parsed["memory.events.local"]


def _read_memo(
    directory: str,
    path: str,
    depth: int,
    files: frozenset[str],
    nr_children: int,
    memo: _Memo,
    slow: bool,
    tally: SkipTally,
) -> Cgroup | None:
    """Read one cgroup directory whose listing gave ``files`` into ``memo``; its record (with
    the id lists), or ``None`` when it vanished between the listing and the reads.

    On a ``slow`` read (or the first of this directory) every file is read; otherwise the
    :data:`STATIC_FILES` are taken from the memo, and ``memory.events.local`` is read only when
    ``memory.events`` changed: every local event also counts in the hierarchical file
    (``mm/memcontrol.c`` ``memcg_memory_event()``), so an unchanged ``memory.events`` means an
    unchanged ``memory.events.local``.

    A file that cannot be read or parsed is absent from the record and counted in ``tally``:
    one junk or refused file costs that figure of that cgroup, never the walk.

    The steps: the static files, ``cgroup.events`` (whether anything lives here), the id
    lists, the memory events, the figures; then the memo's record again when every input is
    the same, else a new one.
    """
    read = _DirectoryRead(directory, files, memo, tally)
    static = memo.static
    if slow or static is None:
        static = _read_static(read)
        if static is None:
            return None
        memo.static = static
    cgroup_type = static[1]

    events = cast(CgroupEvents | None, read.one("cgroup.events", parse_cgroup_events))
    if not slow and read.vanished("cgroup.events", events):
        return None  # vanished: the static files that would have said so were not read
    procs, threads = _read_id_lists(read, events, cgroup_type, slow)
    memory_events, memory_events_local = _read_memory_events(read, slow)

    one = read.one
    inputs = _Inputs(
        depth=depth,
        nr_children=nr_children,
        static=static,
        events=events,
        procs=procs,
        threads=threads,
        memory_events=memory_events,
        memory_events_local=memory_events_local,
        memory_current=one("memory.current", parse_value),
        memory_peak=one("memory.peak", parse_value),
        memory_stat=one("memory.stat", parse_key_values),
        cpu_stat=one("cpu.stat", parse_cpu_stat),
        io_stat=one("io.stat", parse_io_stat),
        pids_current=one("pids.current", parse_value),
        pids_events=one("pids.events", parse_key_values),
        cpu_pressure=one("cpu.pressure", parse_pressure),
        memory_pressure=one("memory.pressure", parse_pressure),
        io_pressure=one("io.pressure", parse_pressure),
        irq_pressure=one("irq.pressure", parse_pressure),
    )
    if inputs == memo.inputs and memo.record is not None and memo.record.path == path:
        return memo.record
    record = _record(path, inputs)
    memo.inputs = inputs
    memo.record = record
    memo.bare = None
    return record


def _record(path: str, inputs: _Inputs) -> Cgroup:
    """The record of one cgroup from the inputs :func:`_read_memo` gathered."""
    controllers, cgroup_type, memory_high, memory_max, pids_max = cast(_Static, inputs.static)
    procs = cast(tuple[int, ...] | None, inputs.procs)
    threads = cast(tuple[int, ...] | None, inputs.threads)
    return Cgroup(
        path=path,
        depth=cast(int, inputs.depth),
        type=cgroup_type,
        controllers=controllers,
        nr_children=cast(int, inputs.nr_children),
        events=cast(CgroupEvents | None, inputs.events),
        nr_procs=None if procs is None else len(set(procs)),
        nr_threads=None if threads is None else len(set(threads)),
        procs=procs,
        threads=threads,
        memory_current=cast(int | None, inputs.memory_current),
        memory_peak=cast(int | None, inputs.memory_peak),
        memory_high=memory_high,
        memory_max=memory_max,
        memory_events=cast(MemoryEvents | None, inputs.memory_events),
        memory_events_local=cast(MemoryEvents | None, inputs.memory_events_local),
        memory_stat=cast(KeyValues | None, inputs.memory_stat),
        cpu_stat=cast(CpuStat | None, inputs.cpu_stat),
        io_stat=cast(IoStat | None, inputs.io_stat),
        pids_current=cast(int | None, inputs.pids_current),
        pids_max=pids_max,
        pids_events=cast(KeyValues | None, inputs.pids_events),
        cpu_pressure=cast(Pressure | None, inputs.cpu_pressure),
        memory_pressure=cast(Pressure | None, inputs.memory_pressure),
        io_pressure=cast(Pressure | None, inputs.io_pressure),
        irq_pressure=cast(Pressure | None, inputs.irq_pressure),
    )


def read_cgroup(
    directory: Path,
    path: str,
    depth: int,
    files: frozenset[str],
    nr_children: int,
    keep_pids: bool = False,
    tally: SkipTally | None = None,
) -> Cgroup | None:
    """Read one cgroup directory whose listing gave ``files``, every file of it; ``None`` when
    it vanished between the listing and the reads. Files that cannot be read or parsed are
    absent from the record, counted in ``tally``."""
    memo = _Memo(0)
    tally = SkipTally() if tally is None else tally
    record = _read_memo(str(directory), path, depth, files, nr_children, memo, True, tally)
    if record is None:
        return None
    return record if keep_pids else memo.bare_record()


def _list_dir(directory: str) -> tuple[frozenset[str], list[tuple[str, int]]] | None:
    """(file names, sorted (subdirectory name, inode)) of a cgroup directory; ``None`` when it
    is gone. Symlinks are neither followed nor read: cgroupfs has none, a fixture tree might.
    The inode tells a cgroup made again under the same name from the one read before."""
    files: set[str] = set()
    subdirs: list[tuple[str, int]] = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        subdirs.append((entry.name, entry.inode()))
                    elif entry.is_file(follow_symlinks=False):
                        files.add(entry.name)
                except OSError:
                    continue
    except (FileNotFoundError, NotADirectoryError):
        return None
    subdirs.sort()
    return frozenset(files), subdirs


class CgroupWalker:
    """Walks one v2 hierarchy breadth first, at most ``max_cgroups`` cgroups and ``max_depth``
    levels below the root (``None``: no depth limit), keeping a :class:`_Memo` per cgroup
    between walks. Records keep the id lists; :meth:`bare` drops them."""

    def __init__(self, max_depth: int | None = None, max_cgroups: int = DEFAULT_MAX_CGROUPS):
        self.max_depth = max_depth
        self.max_cgroups = max_cgroups
        self.walks = 0
        self._root: str | None = None
        self._memos: dict[str, _Memo] = {}
        self._last: dict[int, _Memo] = {}  # id(record) → memo of the latest walk

    def walk(self, roots: Roots, slow_every: int = 1) -> CgroupTree:
        """One walk; the static files of known cgroups are read on every ``slow_every``-th
        walk (the first included)."""
        slow = self.walks % max(1, slow_every) == 0
        self.walks += 1
        hierarchy = find_v2_root(roots.cgroupfs)
        if hierarchy.path is None:
            self._root, self._memos, self._last = None, {}, {}
            return CgroupTree("none", None, (), self.max_depth, self.max_cgroups)
        root = str(hierarchy.path)
        old = self._memos if root == self._root else {}
        memos: dict[str, _Memo] = {}
        last: dict[int, _Memo] = {}
        cgroups: list[Cgroup] = []
        truncated = False
        depth_limited = False
        tally = SkipTally()
        try:
            root_inode = os.stat(root).st_ino
        except OSError:
            root_inode = 0
        queue: deque[tuple[str, str, int, int]] = deque([("/", root, 0, root_inode)])
        while queue:
            if len(cgroups) >= self.max_cgroups:
                truncated = True
                break
            path, directory, depth, inode = queue.popleft()
            try:
                listing = _list_dir(directory)
            except OSError:
                if path == "/":
                    raise  # the hierarchy itself cannot be read: the source is down
                # One cgroup refused (EACCES): it and its subtree are left out, the walk
                # goes on.
                tally.skip(CGROUP_UNREADABLE, directory)
                continue
            if listing is None:
                continue  # removed since its parent was listed
            files, subdirs = listing
            memo = old.get(path)
            if memo is None or memo.inode != inode:
                memo = _Memo(inode)
            cgroup = _read_memo(directory, path, depth, files, len(subdirs), memo, slow, tally)
            if cgroup is None:
                continue
            memos[path] = memo
            last[id(cgroup)] = memo
            cgroups.append(cgroup)
            if self.max_depth is not None and depth >= self.max_depth:
                depth_limited = depth_limited or bool(subdirs)
                continue
            prefix = "" if path == "/" else path
            for name, child_inode in subdirs:
                queue.append((f"{prefix}/{name}", f"{directory}/{name}", depth + 1, child_inode))
        self._root, self._memos, self._last = root, memos, last
        return CgroupTree(
            hierarchy.mode,
            root,
            tuple(cgroups),
            self.max_depth,
            self.max_cgroups,
            truncated=truncated,
            depth_limited=depth_limited,
            skipped=tally.freeze(),
        )

    def bare(self, tree: CgroupTree) -> CgroupTree:
        """``tree`` (this walker's latest) without the id lists."""
        cgroups = tuple(
            memo.bare_record()
            if (memo := self._last.get(id(c))) is not None
            else replace(c, procs=None, threads=None)
            for c in tree.cgroups
        )
        return replace(tree, cgroups=cgroups)


def read_tree(
    roots: Roots,
    max_depth: int | None = None,
    max_cgroups: int = DEFAULT_MAX_CGROUPS,
    keep_pids: bool = False,
) -> CgroupTree:
    """Walk the v2 hierarchy breadth first, every file of every cgroup, at most
    ``max_cgroups`` cgroups and ``max_depth`` levels below the root (``None``: no depth
    limit)."""
    walker = CgroupWalker(max_depth, max_cgroups)
    tree = walker.walk(roots)
    return tree if keep_pids else walker.bare(tree)


class CgroupWalkBusy(RuntimeError):
    """The shared walk could not be had: a walk that another thread is making has not
    returned (a read blocked in the kernel, a tree too large for the deadline)."""


class CycleWalk:
    """The walk of the v2 tree that the ``cgroups``, ``jobs``, ``procs`` and ``threads``
    sources of one collector share: at most one per collection cycle, made when the first of
    them asks, whichever that is, and handed to every other that asks in the same cycle. The
    next cycle walks again (the :data:`STATIC_FILES` every :attr:`slow_every` walks, the first
    included).

    The collector calls :meth:`begin_cycle` at the start of every cycle with the names of the
    sources due in it. A source that needs the whole tree says so once (:meth:`needed_by`) and
    asks with :meth:`tree`; a source with a cheaper way to read what it needs asks with
    :meth:`if_shared`, which walks only in a cycle where a source that needs the tree runs.
    Until a collector begins a cycle, every request walks: a source used on its own reads the
    tree afresh on each run.

    Sources run on the collector's worker thread, and one that overruns its deadline is left
    running there while the cycle goes on in another: the walk is made under a lock. A source
    waits for a walk of its own cycle in progress at most :attr:`wait_seconds`; a walk begun
    in an earlier cycle that has not returned is not waited for, so a read blocked in the
    kernel holds one thread and takes the sources that need the tree down with a reason
    (:class:`CgroupWalkBusy`) until it returns, instead of holding every source that asks.
    """

    def __init__(
        self,
        max_depth: int | None = None,
        max_cgroups: int = DEFAULT_MAX_CGROUPS,
        slow_every: int = SLOW_EVERY,
        wait_seconds: float = WALK_WAIT_SECONDS,
    ) -> None:
        self.walker = CgroupWalker(max_depth, max_cgroups)
        self.slow_every = slow_every
        self.wait_seconds = wait_seconds
        self._needed_by: set[str] = set()
        # ``_state`` guards the fields below it and is never held while reading files;
        # ``_walking`` is held by the thread making a walk.
        self._walking = threading.Lock()
        self._state = threading.Lock()
        self._cycle: int | None = None
        self._due = False
        self._made: tuple[int, Path, CgroupTree] | None = None
        self._in_progress: tuple[int | None, float] | None = None

    def needed_by(self, source: str) -> None:
        """``source`` reads the whole tree: a cycle where it runs walks for every source."""
        with self._state:
            self._needed_by.add(source)

    def begin_cycle(self, due: Iterable[str]) -> None:
        """A collection cycle starts in which the sources named ``due`` run: the next request
        walks again."""
        with self._state:
            self._cycle = 0 if self._cycle is None else self._cycle + 1
            self._due = not self._needed_by.isdisjoint(due)
            self._made = None

    def tree(self, roots: Roots, keep_pids: bool = True) -> CgroupTree:
        """The walk of this cycle, made now if no source has asked yet; ``keep_pids``: records
        with the id lists. Raises :class:`CgroupWalkBusy` when a walk another thread is making
        does not return in time."""
        with self._state:
            cycle = self._cycle
            running = self._in_progress
        if running is not None and running[0] != cycle:
            raise CgroupWalkBusy(
                "the cgroup walk of an earlier cycle has not returned after"
                f" {time.monotonic() - running[1]:.1f} s"
            )
        if not self._walking.acquire(timeout=self.wait_seconds):
            raise CgroupWalkBusy(
                f"the cgroup walk of this cycle did not return within {self.wait_seconds:g} s"
            )
        try:
            tree = self._walk_once(roots, cycle)
            return tree if keep_pids else self.walker.bare(tree)
        finally:
            self._walking.release()

    def if_shared(self, roots: Roots) -> CgroupTree | None:
        """The walk of this cycle (with the id lists) when a source that needs the whole tree
        runs in it, made now if no source has asked yet; else ``None``, as when that walk
        cannot be had: for a source that reads what it needs itself otherwise."""
        with self._state:
            if self._cycle is None or not self._due:
                return None
        try:
            return self.tree(roots)
        except (CgroupWalkBusy, OSError):
            # The tree cannot be had (a blocked walk, a hierarchy that cannot be listed): the
            # caller's own reads say what they can.
            return None

    def _walk_once(self, roots: Roots, cycle: int | None) -> CgroupTree:
        """This cycle's walk, made now if there is none yet (the caller holds ``_walking``)."""
        with self._state:
            if cycle is not None and cycle != self._cycle:
                # Asked for in a cycle that has ended: the collector gave up on the source
                # that asks, and a walk now would only hold the next cycle's sources.
                raise CgroupWalkBusy("the cycle the cgroup walk was asked for has ended")
            made = self._made
            if made is not None and made[0] == cycle and made[1] == roots.cgroupfs:
                return made[2]
            self._in_progress = (cycle, time.monotonic())
        try:
            tree = self.walker.walk(roots, self.slow_every)
        finally:
            with self._state:
                self._in_progress = None
        with self._state:
            if cycle is not None and cycle == self._cycle:
                self._made = (cycle, roots.cgroupfs, tree)
        return tree


class CgroupSource:
    """The ``cgroups`` source: the v2 tree of the walk it shares with the ``jobs``, ``procs``
    and ``threads`` sources (:class:`CycleWalk`); the limits and identities of known cgroups
    are read every :attr:`slow_every` walks. Bounds other than the shared walk's give it a
    walk of its own."""

    name = SOURCE_NAME

    def __init__(
        self,
        max_depth: int | None = None,
        max_cgroups: int = DEFAULT_MAX_CGROUPS,
        keep_pids: bool = False,
        walk: CycleWalk | None = None,
        slow_every: int = SLOW_EVERY,
    ) -> None:
        self.max_depth = max_depth
        self.max_cgroups = max_cgroups
        self.keep_pids = keep_pids
        bounds = (self.max_depth, self.max_cgroups)
        if walk is None or (walk.walker.max_depth, walk.walker.max_cgroups) != bounds:
            walk = CycleWalk(max_depth, max_cgroups)
        self.walk = walk
        walk.needed_by(self.name)
        self.slow_every = slow_every

    @property
    def slow_every(self) -> int:
        """Walks between two reads of the static files: the cadence of the walk it reads
        through, shared with the sources that read the same walk."""
        return self.walk.slow_every

    @slow_every.setter
    def slow_every(self, value: int) -> None:
        self.walk.slow_every = value

    def collect(self, roots: Roots) -> CgroupTree:
        return self.walk.tree(roots, self.keep_pids)

    def close(self) -> None:
        return None


def make_source(
    max_depth: int | None = None,
    max_cgroups: int = DEFAULT_MAX_CGROUPS,
    keep_pids: bool = False,
    walk: CycleWalk | None = None,
) -> CgroupSource:
    """The source; ``max_depth`` and ``max_cgroups`` bound the cost of one walk, ``keep_pids``
    keeps the id lists of ``cgroup.procs``/``cgroup.threads`` (counts are always kept);
    ``walk``: the walk it shares with the other cgroup sources of its collector."""
    if max_depth is not None and max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, not {max_depth}")
    if max_cgroups < 1:
        raise ValueError(f"max_cgroups must be >= 1, not {max_cgroups}")
    return CgroupSource(max_depth, max_cgroups, keep_pids, walk)


SPEC = SourceSpec(
    name="cgroups",
    default_interval=15.0,
    help="cgroup v2 tree: memory, PSI, io.stat, cpu.stat, pids",
    build=lambda inputs: make_source(walk=inputs.cgroup_walk),
    rates=None,
    metric_area="nodescope_exporters.cgroup_metrics",
    sim_parts=frozenset({"cgroups"}),
)


__all__ = [
    "CGROUPS",
    "CGROUP_UNREADABLE",
    "CPU_STAT_NAMES",
    "DEFAULT_MAX_CGROUPS",
    "FILE_UNPARSABLE",
    "FILE_UNREADABLE",
    "ID_UNPARSABLE",
    "IO_STAT_NAMES",
    "MEMORY_EVENT_NAMES",
    "SLOW_EVERY",
    "SOURCE_NAME",
    "STATIC_FILES",
    "WALK_WAIT_SECONDS",
    "Cgroup",
    "CgroupEvents",
    "CgroupSource",
    "CgroupTree",
    "CgroupWalkBusy",
    "CgroupWalker",
    "CpuStat",
    "CycleWalk",
    "HierarchyMode",
    "IoDeviceStat",
    "IoStat",
    "KeyValues",
    "Limit",
    "MemoryEvents",
    "Pressure",
    "PressureLine",
    "ProcCgroup",
    "ProcCgroupEntry",
    "V2Hierarchy",
    "find_v2_root",
    "make_source",
    "parse_cgroup_events",
    "parse_cgroup_type",
    "parse_controllers",
    "parse_cpu_stat",
    "parse_ids",
    "parse_io_stat",
    "parse_key_values",
    "parse_limit",
    "parse_memory_events",
    "parse_pressure",
    "parse_proc_cgroup",
    "parse_value",
    "read_cgroup",
    "read_proc_cgroup",
    "read_tree",
]
