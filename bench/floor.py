"""The floor of the overhead benchmark: the least any agent reading the simulated node's files
could do in Python, measured beside the daemon (docs/performance.md).

Three parts, standard library only:

:class:`FileRecorder`
    In a separate, short run of the benchmark's daemon (``bench/daemon.py --record-files``),
    an audit hook (:func:`sys.addaudithook`) notes every ``open``, ``os.listdir`` and
    ``os.scandir`` of the process, and a wrapper of :func:`os.readlink` every link read, for
    a stretch of cycles after warm-up. Audit hooks cannot be removed and cost CPU on every
    audited call, so the daemon that is measured never has one: recording and measuring are
    different processes.
:class:`FileList`
    What was read under the node's root, per recorded cycle: each path, its kind (``file``
    read, ``dir`` listed, ``link`` read, ``diropen``: a directory opened for ``*at`` calls)
    and how often it was read in each cycle, plus the opens per cycle and the process's read
    calls and bytes (``/proc/self/io``). JSON, paths relative to the root.
:class:`Floor`
    Replays one recorded cycle per tick: opens, reads to EOF and closes each file
    (``os.open``/``os.read``/``os.close``, no parsing), lists each directory and reads each
    link, cycle after cycle in the recorded order. Its process CPU per cycle is the floor.

    python bench/floor.py FILES.json ROOT --stats floor-stats.json
"""

from __future__ import annotations

import argparse
import errno
import gc
import json
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

FORMAT = "nodescope-file-list/1"
#: ``file``: opened and read; ``dir``: listed (``os.listdir``/``os.scandir``); ``link``: read
#: with ``os.readlink``; ``diropen``: a directory opened to read its files relative to it
#: (recorded, not replayed: the floor opens each file by its whole path).
KINDS = ("file", "dir", "link", "diropen")
#: Counters of each recorded cycle.
CYCLE_KEYS = ("opens", "dir_opens", "listings", "readlinks", "outside", "excluded",
              "unresolved", "read_calls", "bytes_read")  # fmt: skip
#: A file list is read from disk: bounds that refuse a damaged or planted one early.
MAX_CYCLES = 10_000
MAX_ENTRIES = 1_000_000

_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
#: Bytes per read: a sysfs attribute or a seq_file page in one call (the daemon's chunk).
READ_CHUNK = 64 << 10
#: The most the floor reads of one file: the daemon's cap for kernel files; a character
#: device put where a file was costs at most this, never an endless read.
MAX_FILE_BYTES = 16 << 20


# --------------------------------------------------------------------------------------------
# The file list


@dataclass(frozen=True)
class Entry:
    """One path under the root: its kind, how often it was read in each recorded cycle, and
    the threads that read it."""

    path: str
    kind: str
    counts: tuple[int, ...]
    threads: tuple[str, ...] = ()


@dataclass(frozen=True)
class FileList:
    cycles: int
    entries: tuple[Entry, ...]
    per_cycle: tuple[dict[str, int], ...]
    #: Cycles that ran before the recorded stretch (warm-up: the first reads everything).
    skipped_cycles: int = 0

    def dumps(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "cycles": self.cycles,
                "skipped_cycles": self.skipped_cycles,
                "entries": [
                    {
                        "path": e.path,
                        "kind": e.kind,
                        "counts": list(e.counts),
                        "threads": list(e.threads),
                    }
                    for e in self.entries
                ],
                "per_cycle": list(self.per_cycle),
            },
            indent=0,
        )

    @classmethod
    def loads(cls, text: str) -> FileList:
        """The list in ``text``; :class:`ValueError` naming the first thing wrong with it."""
        doc = json.loads(text)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"not a file list ({FORMAT!r} expected)")
        cycles = _count(doc.get("cycles"), "cycles")
        if not 1 <= cycles <= MAX_CYCLES:
            raise ValueError(f"cycles: {cycles}, not within 1..{MAX_CYCLES}")
        skipped = _count(doc.get("skipped_cycles", 0), "skipped_cycles")
        raw_entries = doc.get("entries")
        if not isinstance(raw_entries, list) or len(raw_entries) > MAX_ENTRIES:
            raise ValueError("entries: not a list, or too long")
        entries = []
        seen: set[tuple[str, str]] = set()
        for number, raw in enumerate(raw_entries):
            where = f"entry {number}"
            if not isinstance(raw, dict):
                raise ValueError(f"{where}: not an object")
            path = _relative_path(raw.get("path"), where)
            kind = raw.get("kind")
            if kind not in KINDS:
                raise ValueError(f"{where}: kind {kind!r} is none of {KINDS}")
            counts = raw.get("counts")
            if not isinstance(counts, list) or len(counts) != cycles:
                raise ValueError(f"{where}: counts must list one count per cycle ({cycles})")
            threads = raw.get("threads", [])
            if not isinstance(threads, list) or not all(isinstance(t, str) for t in threads):
                raise ValueError(f"{where}: threads must be a list of names")
            if (path, kind) in seen:
                raise ValueError(f"{where}: {kind} {path!r} listed twice")
            seen.add((path, kind))
            entries.append(
                Entry(path, kind, tuple(_count(c, f"{where} count") for c in counts),
                      tuple(threads))
            )  # fmt: skip
        raw_cycles = doc.get("per_cycle", [])
        if not isinstance(raw_cycles, list) or len(raw_cycles) not in (0, cycles):
            raise ValueError(f"per_cycle must hold one record per cycle ({cycles})")
        per_cycle = []
        for number, record in enumerate(raw_cycles):
            if not isinstance(record, dict):
                raise ValueError(f"per_cycle {number}: not an object")
            per_cycle.append(
                {str(k): _count(v, f"per_cycle {number} {k}") for k, v in record.items()}
            )
        return cls(cycles, tuple(entries), tuple(per_cycle), skipped)

    def write(self, path: Path) -> None:
        path.write_text(self.dumps())

    @classmethod
    def read(cls, path: Path) -> FileList:
        return cls.loads(path.read_text())

    def summary(self) -> dict[str, Any]:
        """Per cycle on average: reads of each kind and distinct paths of each kind; the
        recorded counters (opens, read calls, bytes) averaged over the cycles."""
        out: dict[str, Any] = {"cycles": self.cycles, "skipped_cycles": self.skipped_cycles}
        for kind in KINDS:
            chosen = [e for e in self.entries if e.kind == kind]
            out[f"{kind}_paths"] = len(chosen)
            out[f"{kind}_reads_per_cycle"] = round(
                sum(sum(e.counts) for e in chosen) / self.cycles, 1
            )
        for key in CYCLE_KEYS:
            values = [record.get(key, 0) for record in self.per_cycle]
            if values:
                out[f"{key}_per_cycle"] = round(sum(values) / len(values), 1)
        out["threads"] = sorted({t for e in self.entries for t in e.threads})
        return out


def _count(value: object, where: str) -> int:
    # bool is an int to Python, not a count to a file list.
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{where}: {value!r} is not a count")
    return value


def _relative_path(value: object, where: str) -> str:
    """A path relative to the root that stays under it: no leading ``/``, no ``..``, no
    empty or ``.`` component, no NUL (a list names files the floor will open)."""
    if not isinstance(value, str) or not value or "\0" in value:
        raise ValueError(f"{where}: path {value!r} is not a non-empty string")
    parts = value.split("/")
    if value.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{where}: path {value!r} is not a plain path under the root")
    return value


# --------------------------------------------------------------------------------------------
# Recording (in the recording run of bench/daemon.py)


class FileRecorder:
    """Notes what this process reads under ``root`` in cycles ``skip .. skip + cycles - 1``.

    The caller marks cycles with :meth:`begin` and :meth:`end`; events outside a recorded
    cycle cost the hook one attribute test. A relative path opened against a directory
    descriptor (``os.open(name, dir_fd=fd)``; the ``open`` audit event does not carry the
    descriptor) is resolved from the nearest calling frame with a ``dir_fd`` variable, and a
    descriptor through ``/proc/self/fd``. The paths in ``exclude`` (relative to the root) are
    counted, not listed.
    """

    def __init__(
        self, root: Path | str, skip: int, cycles: int, exclude: Iterable[str] = ()
    ) -> None:
        if cycles < 1 or skip < 0:
            raise ValueError("record at least one cycle, after zero or more")
        absolute = os.path.normpath(os.path.abspath(root))
        # /proc/self/fd/N names a descriptor's directory without symlinks: match both forms.
        self.roots = tuple(dict.fromkeys((absolute, os.path.realpath(absolute))))
        self.skip = skip
        self.cycles = cycles
        self.exclude = frozenset(exclude)
        self.active = False
        self.index = -1
        self.counts: dict[tuple[str, str], list[int]] = {}
        self.threads: dict[tuple[str, str], set[str]] = {}
        self.per_cycle: list[dict[str, int]] = []
        self._current: dict[str, int] = {}
        self._io: tuple[int, int] = (0, 0)
        self._readlink: Callable[..., Any] = os.readlink

    def install(self) -> None:
        """Adds the audit hook and wraps :func:`os.readlink` (which raises no audit event),
        for the rest of this process's life."""
        sys.addaudithook(self._hook)
        original = self._readlink
        recorder = self

        def readlink(path: Any, *, dir_fd: int | None = None) -> Any:
            if recorder.active:
                try:
                    recorder.note("link", path, dir_fd)
                except Exception:
                    recorder._current["unresolved"] += 1
            return original(path, dir_fd=dir_fd)

        os.readlink = readlink

    @property
    def done(self) -> bool:
        return len(self.per_cycle) >= self.cycles

    def begin(self, index: int) -> None:
        """Cycle ``index`` (0: the daemon's first) starts."""
        self.index = index - self.skip
        if 0 <= self.index < self.cycles and not self.done:
            self._current = dict.fromkeys(CYCLE_KEYS, 0)
            self._io = _process_io()
            self.active = True

    def end(self) -> None:
        if not self.active:
            return
        self.active = False
        calls, nbytes = _process_io()
        self._current["read_calls"] = calls - self._io[0]
        self._current["bytes_read"] = nbytes - self._io[1]
        self.per_cycle.append(self._current)

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.active:
            return
        try:
            if event == "open":
                target, _mode, flags = args
                if isinstance(target, int):
                    return  # io.open of a descriptor: no path was opened
                dir_fd = None
                if not os.path.isabs(os.fsdecode(target)):
                    dir_fd = _caller_dir_fd(sys._getframe(1))
                kind = "diropen" if isinstance(flags, int) and flags & os.O_DIRECTORY else "file"
                self.note(kind, target, dir_fd)
            elif event in ("os.listdir", "os.scandir"):
                self.note("dir", args[0], None)
        except Exception:
            # An exception from an audit hook fails the call it audits: the daemon's read
            # must go on whatever the recorder makes of it.
            self._current["unresolved"] += 1

    def note(self, kind: str, target: Any, dir_fd: int | None) -> None:
        path = self._absolute(target, dir_fd)
        current = self._current
        key = {"file": "opens", "diropen": "dir_opens", "dir": "listings", "link": "readlinks"}
        current[key[kind]] += 1
        if path is None:
            current["unresolved"] += 1
            return
        relative = self._relative(path)
        if relative is None:
            current["outside"] += 1
            return
        if relative in self.exclude:
            current["excluded"] += 1
            return
        entry = (kind, relative)
        counts = self.counts.get(entry)
        if counts is None:
            counts = self.counts[entry] = [0] * self.cycles
            self.threads[entry] = set()
        counts[self.index] += 1
        self.threads[entry].add(threading.current_thread().name)

    def _absolute(self, target: Any, dir_fd: int | None) -> str | None:
        try:
            if isinstance(target, int):
                return str(self._readlink(f"/proc/self/fd/{target}"))
            text = os.fsdecode("." if target is None else target)
            if not os.path.isabs(text):
                base = os.getcwd() if dir_fd is None else self._readlink(f"/proc/self/fd/{dir_fd}")
                text = os.path.join(base, text)
        except (OSError, TypeError, ValueError):
            return None
        return os.path.normpath(text)

    def _relative(self, path: str) -> str | None:
        for root in self.roots:
            if path.startswith(root + "/"):
                return path[len(root) + 1 :]
        return None

    def file_list(self) -> FileList:
        entries = tuple(
            Entry(path, kind, tuple(counts), tuple(sorted(self.threads[(kind, path)])))
            for (kind, path), counts in sorted(self.counts.items(), key=lambda i: i[0][::-1])
        )
        return FileList(len(self.per_cycle), entries, tuple(self.per_cycle), self.skip)


def _caller_dir_fd(frame: FrameType | None) -> int | None:
    """The ``dir_fd`` of the nearest of a few calling frames that has one (``None`` when the
    nearest has it unset, or none has it)."""
    for _ in range(4):
        if frame is None:
            return None
        if "dir_fd" in frame.f_code.co_varnames:
            value = frame.f_locals.get("dir_fd")
            return value if isinstance(value, int) else None
        frame = frame.f_back
    return None


def _process_io() -> tuple[int, int]:
    """(read calls, bytes read) of this process so far (``syscr``, ``rchar``), (0, 0) where
    the kernel keeps no I/O accounting."""
    try:
        fd = os.open("/proc/self/io", os.O_RDONLY | os.O_CLOEXEC)
        try:
            text = os.read(fd, 4096).decode()
        finally:
            os.close(fd)
        fields = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)
        return int(fields["syscr"]), int(fields["rchar"])
    except (OSError, KeyError, ValueError):
        return 0, 0


# --------------------------------------------------------------------------------------------
# The floor reader


@dataclass
class CycleCounts:
    files: int = 0
    bytes: int = 0
    dirs: int = 0
    names: int = 0
    links: int = 0
    #: Opens, listings or link reads that failed: the path was gone (the cost of the failed
    #: lookup is still paid, as the daemon pays it).
    missing: int = 0
    #: Files that could not be read (a FIFO with a writer: ``EAGAIN``; a directory).
    refused: int = 0


class Floor:
    """The recorded cycles of a file list, ready to replay under ``root``.

    When the list is loaded, each file is checked once with ``stat`` (following links, as the
    daemon's open does): a FIFO, socket or device is left out for good and counted in
    :attr:`skipped`; a path that does not exist stays (its failed open is work the daemon
    did). The cycle itself does no ``stat``: what changed since — a file replaced by a FIFO —
    is opened non-blocking, so nothing waits.
    """

    def __init__(self, files: FileList, root: Path | str) -> None:
        base = os.path.abspath(root)
        self.cycles = files.cycles
        self.skipped: list[str] = []
        plans: list[tuple[list[str], list[str], list[str]]] = [
            ([], [], []) for _ in range(files.cycles)
        ]
        for entry in files.entries:
            if entry.kind == "diropen":
                continue
            path = os.path.join(base, entry.path)
            if not self._admitted(entry.kind, path):
                self.skipped.append(entry.path)
                continue
            slot = {"file": 0, "dir": 1, "link": 2}[entry.kind]
            for index, count in enumerate(entry.counts):
                plans[index][slot].extend([path] * count)
        self.plans = plans

    @staticmethod
    def _admitted(kind: str, path: str) -> bool:
        try:
            mode = os.lstat(path).st_mode if kind == "link" else os.stat(path).st_mode
        except FileNotFoundError:
            return True
        except OSError:
            return False
        if kind == "file":
            return stat.S_ISREG(mode)
        if kind == "dir":
            return stat.S_ISDIR(mode)
        return stat.S_ISLNK(mode)

    def run(self, index: int) -> CycleCounts:
        """Cycle ``index`` (modulo the recorded cycles): every file read to EOF, every
        directory listed, every link read."""
        files, dirs, links = self.plans[index % self.cycles]
        counts = CycleCounts()
        nbytes = 0
        missing = refused = 0
        for path in files:
            try:
                fd = os.open(path, _OPEN_FLAGS)
            except OSError:
                missing += 1
                continue
            try:
                size = 0
                while data := os.read(fd, READ_CHUNK):
                    size += len(data)
                    if size >= MAX_FILE_BYTES:
                        break
                nbytes += size
            except OSError as exc:
                # EAGAIN: a FIFO whose writer has written nothing; EISDIR: a directory.
                if exc.errno not in (errno.EAGAIN, errno.EISDIR, errno.EINVAL, errno.EIO):
                    raise
                refused += 1
            finally:
                os.close(fd)
        names = 0
        for path in dirs:
            try:
                names += len(os.listdir(path))
            except OSError:
                missing += 1
        for path in links:
            try:
                os.readlink(path)
            except OSError:
                missing += 1
        counts.files = len(files)
        counts.bytes = nbytes
        counts.dirs = len(dirs)
        counts.names = names
        counts.links = len(links)
        counts.missing = missing
        counts.refused = refused
        return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", type=Path, help="the file list (bench/daemon.py --record-files)")
    parser.add_argument("root", type=Path)
    parser.add_argument("--stats", type=Path)
    parser.add_argument("--tick", type=float, default=1.0)
    args = parser.parse_args(argv)
    floor = Floor(FileList.read(args.files), args.root)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    signal.signal(signal.SIGINT, lambda *_: stopped.set())
    # As the daemon does after its first cycle: what exists now is not scanned again.
    gc.freeze()
    print("ready", flush=True)
    ends: list[float] = []
    cpu: list[float] = []
    tallies: list[CycleCounts] = []
    next_tick = time.monotonic()
    index = 0
    while not stopped.is_set():
        started = time.thread_time()
        tallies.append(floor.run(index))
        cpu.append(time.thread_time() - started)
        ends.append(time.monotonic())
        index += 1
        next_tick += args.tick
        if next_tick <= time.monotonic():
            next_tick = time.monotonic() + args.tick
        stopped.wait(max(0.0, next_tick - time.monotonic()))
    if args.stats is not None:
        stats = {
            "cycle_end_monotonic": ends,
            "cycle_thread_cpu_seconds": cpu,
            "cycles_recorded": floor.cycles,
            "skipped_at_load": floor.skipped,
            **{
                key: [getattr(t, key) for t in tallies]
                for key in ("files", "bytes", "dirs", "names", "links", "missing", "refused")
            },
        }
        args.stats.write_text(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
