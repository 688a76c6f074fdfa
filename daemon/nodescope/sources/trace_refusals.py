"""The record of trace files the parser process refused: over the job's budget, killed at its
memory or CPU limit, or being parsed when the daemon itself stopped. Such a file is never
parsed again while it stays the same file (same job, name, inode, size and mtime), and the
record outlives the daemon, so a file that took a daemon down cannot do it again after the
restart (``Restart=on-failure`` would otherwise re-read the spool and fall again).

The record is ``<run root>/nodescope/trace-refusals.json`` (the unit keeps ``/run/nodescope``
across restarts; a reboot empties it, as it ends the jobs). Before the parser starts on a
job's files they are written down as pending; a daemon that finds pending files when it
starts did not see their parse end, and refuses them as ``parser_interrupted``. The record
holds at most ``limit`` files, the oldest forgotten first, and its reads are bounded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("nodescope.sources.traces")

FILE_NAME = "trace-refusals.json"
FORMAT = "nodescope-trace-refusals/1"

#: Why a file was refused: constants, so the reasons stay a bounded label set.
OVER_BUDGET = "over_budget"
PARSER_KILLED = "parser_killed"
PARSER_INTERRUPTED = "parser_interrupted"
REASONS = frozenset({OVER_BUDGET, PARSER_KILLED, PARSER_INTERRUPTED})

#: A record of ``limit`` files is ~200 bytes each; the reader refuses more than this.
MAX_RECORD_BYTES = 4 << 20


@dataclass(frozen=True, slots=True, order=True)
class FileKey:
    """One version of one job's file: a file rewritten in place is a new version."""

    job_id: str
    name: str
    inode: int
    size: int
    mtime_ns: int


class Refusals:
    """The refused files (oldest first) and the files of the parse in progress, kept in
    ``directory`` (None: in memory only). Used by the trace worker's thread alone."""

    def __init__(self, directory: Path | None, limit: int) -> None:
        self.directory = directory
        self.limit = limit
        self._refused: dict[FileKey, str] = {}
        self._pending: set[FileKey] = set()
        self._loaded = False

    def reason(self, key: FileKey) -> str | None:
        self._load()
        return self._refused.get(key)

    def refused(self) -> dict[FileKey, str]:
        self._load()
        return dict(self._refused)

    def begin(self, keys: list[FileKey]) -> None:
        """Write ``keys`` down as being parsed, before the parser starts on them."""
        self._load()
        self._pending = set(keys)
        self._save()

    def end(self, refused: dict[FileKey, str]) -> list[FileKey]:
        """The parse is over: nothing pending, ``refused`` added; returns the keys newly
        refused."""
        self._load()
        self._pending = set()
        added = [key for key in refused if key not in self._refused]
        for key, reason in refused.items():
            self._refused[key] = reason
        self._trim()
        self._save()
        return added

    def _trim(self) -> None:
        while len(self._refused) > self.limit:
            del self._refused[next(iter(self._refused))]

    def _path(self) -> Path | None:
        return None if self.directory is None else self.directory / FILE_NAME

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        path = self._path()
        if path is None:
            return
        try:
            document = _read(path)
        except FileNotFoundError:
            return
        except (OSError, ValueError, RecursionError) as exc:
            # A record that cannot be read is started again: the files it named may be
            # parsed once more, each within the parser's limits.
            log.warning("event=trace_refusals_unreadable path=%s error=%s", path, exc)
            return
        for item in _entries(document, "refused"):
            self._refused[item[0]] = item[1]
        interrupted = [key for key, _ in _entries(document, "pending")]
        for key in interrupted:
            self._refused.setdefault(key, PARSER_INTERRUPTED)
        self._trim()
        if interrupted:
            log.warning(
                "event=trace_parse_interrupted files=%d refused=true retried=false",
                len(interrupted),
            )
            self._save()

    def _save(self) -> None:
        if self.directory is None:
            return
        document = {
            "format": FORMAT,
            "refused": [_encode(key, reason) for key, reason in self._refused.items()],
            "pending": [_encode(key, "") for key in sorted(self._pending)],
        }
        try:
            _write(self.directory, (json.dumps(document) + "\n").encode())
        except OSError as exc:
            log.warning("event=trace_refusals_unwritable dir=%s error=%s", self.directory, exc)


def _encode(key: FileKey, reason: str) -> list[object]:
    return [key.job_id, key.name, key.inode, key.size, key.mtime_ns, reason]


def _entries(document: object, field: str) -> list[tuple[FileKey, str]]:
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        return []
    items = document.get(field)
    if not isinstance(items, list):
        return []
    out = []
    for item in items:
        if not isinstance(item, list) or len(item) != 6:
            continue
        job_id, name, inode, size, mtime_ns, reason = item
        if not (isinstance(job_id, str) and isinstance(name, str) and isinstance(reason, str)):
            continue
        if not all(type(v) is int for v in (inode, size, mtime_ns)):
            continue
        out.append((FileKey(job_id, name, inode, size, mtime_ns), reason or PARSER_INTERRUPTED))
    return out


def _read(path: Path) -> object:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise ValueError("not a regular file of this user")
        if info.st_size > MAX_RECORD_BYTES:
            raise ValueError(f"{info.st_size} bytes")
        data = os.read(fd, MAX_RECORD_BYTES + 1)
    finally:
        os.close(fd)
    return json.loads(data)


def _write(directory: Path, data: bytes) -> None:
    """Replace the record: a new file beside it, renamed over it. The directory is made
    0750 when missing and must be this user's and writable by nobody else."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o750)
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise PermissionError(f"{directory}: not a directory of this user writable by it alone")
    temporary = directory / f".{FILE_NAME}.new"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temporary, flags, 0o640)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(temporary, directory / FILE_NAME)
