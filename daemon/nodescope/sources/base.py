"""The contract every source implements, and the helpers they share for reading files."""

from __future__ import annotations

import os
from collections.abc import Callable, Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from nodescope.roots import Roots


class Source(Protocol):
    """A source reads one kind of data from the node.

    ``collect`` does the IO and returns an immutable typed record; it may raise anything: the
    collector turns an exception into ``nodescope_source_up{source} 0`` and goes on with the
    other sources. A source may keep open file handles or caches between runs (state that
    only saves work, never changes results); ``close`` releases them.
    """

    name: str

    def collect(self, roots: Roots) -> Any: ...

    def close(self) -> None: ...


@dataclass
class FunctionSource:
    """A stateless source made from a reader function ``read(roots) -> record``."""

    name: str
    read: Callable[[Roots], Any]

    def collect(self, roots: Roots) -> Any:
        return self.read(roots)

    def close(self) -> None:
        return None


#: Bytes asked for per ``read``. Python allocates the whole buffer before the call: 1 MiB
#: would be an mmap and munmap per file (glibc maps blocks over 128 KiB), several times the
#: cost of reading a small sysfs file; 64 KiB comes from the heap and holds any sysfs
#: attribute (one page at most) and nearly every procfs file in one call.
READ_CHUNK = 1 << 16


def read_text(path: Path | str) -> str:
    """Read a sysfs/procfs file in one ``read``: ``stat`` sizes lie for pseudo files."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while True:
            chunk = os.read(fd, READ_CHUNK)
            if not chunk:
                break
            chunks.append(chunk)
            if len(chunk) < READ_CHUNK:
                break
        return b"".join(chunks).decode("utf-8", errors="replace")
    finally:
        os.close(fd)


def read_optional(path: Path | str) -> str | None:
    """The file's text, or ``None`` when it does not exist or cannot be read.

    Optional files parse to "absent", not to zero.
    """
    try:
        return read_text(path)
    except (FileNotFoundError, NotADirectoryError, PermissionError, OSError):
        return None


def read_strip(path: Path | str) -> str | None:
    text = read_optional(path)
    return None if text is None else text.strip()


Environ = tuple[tuple[str, str], ...]


def kept_environ(text: str, kept: Container[str]) -> Environ:
    """The variables named in ``kept`` of a NUL-separated environment block, in file order.

    An entry without ``=`` (a process may overwrite its environment block) names nothing and
    is skipped; nothing else is kept, so secrets never enter a snapshot.
    """
    found: list[tuple[str, str]] = []
    for entry in text.split("\0"):
        name, sep, value = entry.partition("=")
        if sep and name in kept:
            found.append((name, value))
    return tuple(found)


class EnvironMemo:
    """The kept environment of each process (``parse`` picks the variables), read when its
    pid is first seen and on every ``refresh``: a process's ``environ`` is the block it was
    started with (``execve`` sets it), so reading it each run only re-reads the same bytes.
    Pids not seen in a run are forgotten."""

    def __init__(self, parse: Callable[[str, str], Environ]) -> None:
        self._parse = parse
        self._kept: dict[int, Environ] = {}
        self._seen: dict[int, Environ] = {}
        self.refresh = True

    def get(self, roots: Roots, pid: int) -> Environ | None:
        """The kept environment of ``pid``; ``None`` when it cannot be read (it exited)."""
        environ = None if self.refresh else self._kept.get(pid)
        if environ is None:
            path = f"{roots.procfs}/{pid}/environ"
            text = read_optional(path)
            if text is None:
                return None
            environ = self._parse(text, path)
        self._seen[pid] = environ
        return environ

    def end_run(self) -> None:
        """Keep only what this run saw."""
        self._kept, self._seen = self._seen, {}
        self.refresh = False
