"""What the parts of the simulated node share: its units, the writer of its files, and the
base of each part (:mod:`nodescope.sim.node` composes them)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nodescope.sim.node import SimulatedNode

#: Unix time of simulated t = 0 (NVML field timestamps, process start times).
EPOCH = 1_750_000_000.0
CLK_TCK = 100
PAGE = 4096
SECTOR = 512
IB_PACKET_BYTES = 4096


class NodePart:
    """One part of the simulated node: the files and counters of one area of the machine,
    written from the node's shared state (its time, counters, file writer and hardware)."""

    def __init__(self, node: SimulatedNode) -> None:
        self.node = node


class NodeFiles:
    """Writes files once per content: a cache of what each path holds, and atomic replaces."""

    def __init__(self, root: Path) -> None:
        self.staging = root / ".sim-staging"
        self.cache: dict[Path, bytes] = {}
        self.made: set[Path] = set()
        self.atomic = False
        self.writes = 0
        self._serial = 0

    def mkdir(self, path: Path) -> None:
        if path not in self.made:
            path.mkdir(parents=True, exist_ok=True)
            self.made.add(path)

    def write(self, path: Path, content: str | bytes) -> bool:
        data = content.encode() if isinstance(content, str) else content
        if self.cache.get(path) == data:
            return False
        self.mkdir(path.parent)
        if self.atomic:
            self._serial += 1
            tmp = self.staging / f"{self._serial}"
            write_bytes(tmp, data)
            os.replace(tmp, path)
        else:
            write_bytes(path, data)
        self.cache[path] = data
        self.writes += 1
        return True

    def assume(self, path: Path, content: str) -> None:
        """Record what another writer put at ``path``."""
        self.cache[path] = content.encode()

    def symlink(self, link: Path, target: Path) -> None:
        self.mkdir(link.parent)
        link.symlink_to(os.path.relpath(target, link.parent))

    def append(self, path: Path, data: bytes) -> None:
        """Append ``data`` in one write. A file that only grows is never replaced: a reader
        that keeps it open (the kernel log's) goes on reading the same file."""
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        self.writes += 1

    def remove_tree(self, path: Path) -> None:
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        prefix = f"{path}{os.sep}"
        for cached in [p for p in self.cache if p == path or str(p).startswith(prefix)]:
            del self.cache[cached]
        self.made = {p for p in self.made if p != path and not str(p).startswith(prefix)}


def write_bytes(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
