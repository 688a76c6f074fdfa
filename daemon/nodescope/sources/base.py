"""The contract every source implements, and the helpers they share for reading files."""

from __future__ import annotations

import os
from collections.abc import Callable
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


def read_text(path: Path) -> str:
    """Read a sysfs/procfs file in one ``read``: ``stat`` sizes lie for pseudo files."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            if len(chunk) < (1 << 20):
                break
        return b"".join(chunks).decode("utf-8", errors="replace")
    finally:
        os.close(fd)


def read_optional(path: Path) -> str | None:
    """The file's text, or ``None`` when it does not exist or cannot be read.

    Optional files parse to "absent", not to zero.
    """
    try:
        return read_text(path)
    except (FileNotFoundError, NotADirectoryError, PermissionError, OSError):
        return None


def read_strip(path: Path) -> str | None:
    text = read_optional(path)
    return None if text is None else text.strip()
