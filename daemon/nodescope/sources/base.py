"""The contract every source implements, the helpers they share for reading files
(:mod:`nodescope.fileio` does the reading), and the topology generation that two sources
share."""

from __future__ import annotations

import threading
from collections.abc import Callable, Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from nodescope.fileio import (
    KERNEL_FILE,
    PROC_ENVIRON,
    FileKind,
    read_optional,
    read_text,
)
from nodescope.roots import Roots

__all__ = [
    "Environ",
    "EnvironMemo",
    "FunctionSource",
    "Source",
    "TopologyGeneration",
    "kept_environ",
    "read_optional",
    "read_strip",
    "read_text",
]


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


def read_strip(path: Path | str, kind: FileKind = KERNEL_FILE) -> str | None:
    """:func:`read_optional` without the whitespace around it (sysfs attributes end in a
    newline, some drivers' in several)."""
    text = read_optional(path, kind)
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
            text = read_optional(path, PROC_ENVIRON)
            if text is None:
                return None
            environ = self._parse(text, path)
        self._seen[pid] = environ
        return environ

    def end_run(self) -> None:
        """Keep only what this run saw."""
        self._kept, self._seen = self._seen, {}
        self.refresh = False


class TopologyGeneration:
    """A number that moves whenever a device event changed the PCI topology: the ``udev``
    source's monitor thread advances it, the ``pci`` source walks the tree again on its next
    run when it moved instead of waiting for its slow cadence. The sources of one collector
    share one, made where they are built (:class:`nodescope.sources.registry.SourceInputs`); a
    source made on its own has its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0

    def advance(self) -> int:
        """Note that devices changed; the new generation."""
        with self._lock:
            self._value += 1
            return self._value

    @property
    def value(self) -> int:
        with self._lock:
            return self._value
