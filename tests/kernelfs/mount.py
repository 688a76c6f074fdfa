"""Mounting the kernel-semantics filesystem (:mod:`tests.kernelfs.server`) over a backing
directory, in a child process, for the length of a ``with`` block.

The server runs in its own process: a FUSE server in the test's process would serve the
test's own reads on threads that need the interpreter lock the reading thread may hold, and a
child can be unmounted and reaped whatever state the test ends in.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from nodescope.roots import Roots
from tests.conftest import REPO

FUSE_DEVICE = Path("/dev/fuse")
#: How long a mount may take to appear: the child imports mfusepy and libfuse mounts.
MOUNT_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class KernelFsMount:
    """A live mount: ``mountpoint`` serves ``backing`` with kernel read semantics."""

    backing: Path
    mountpoint: Path

    def roots(self) -> Roots:
        """The filesystem roots of a host-shaped tree, through the mount."""
        return Roots.under(self.mountpoint)


def fuse_unavailable_reason() -> str | None:
    """Why no FUSE filesystem can be mounted here, or ``None`` when one can."""
    if not FUSE_DEVICE.exists():
        return f"{FUSE_DEVICE} is missing: this kernel or container offers no FUSE"
    return None


def _is_mounted(path: Path) -> bool:
    try:
        return os.path.ismount(path)
    except OSError:
        return False


def unmount(path: Path) -> None:
    """Unmount ``path``: lazily when a reader still holds a file open there."""
    fusermount = shutil.which("fusermount3")
    commands = [["umount", str(path)], ["umount", "-l", str(path)]]
    if fusermount is not None:
        commands.insert(0, [fusermount, "-u", "-q", str(path)])
    for command in commands:
        if not _is_mounted(path):
            return
        subprocess.run(command, capture_output=True, check=False, timeout=30)


@contextmanager
def kernelfs(
    backing: Path,
    mountpoint: Path,
    *,
    sysfs: str = "sys",
    procfs: str = "proc",
    cgroupfs: str = "sys/fs/cgroup",
    entry_timeout: float = 0.0,
    attr_timeout: float = 0.0,
) -> Iterator[KernelFsMount]:
    """Serve ``backing`` at ``mountpoint`` (an empty directory) with kernel read semantics;
    ``sysfs``, ``procfs`` and ``cgroupfs`` are where those roots sit inside ``backing``."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    log = mountpoint.parent / f".{mountpoint.name}.kernelfs.log"
    command = [
        sys.executable, "-m", "tests.kernelfs.server", str(backing), str(mountpoint),
        "--sysfs", sysfs, "--procfs", procfs, "--cgroupfs", cgroupfs,
        "--entry-timeout", str(entry_timeout), "--attr-timeout", str(attr_timeout),
    ]  # fmt: skip
    with log.open("wb") as log_file:
        child = subprocess.Popen(
            command,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while not _is_mounted(mountpoint):
            if child.poll() is not None:
                raise RuntimeError(
                    f"kernelfs server exited with {child.returncode} before mounting "
                    f"{mountpoint}: {log.read_text(errors='replace')[-2000:]}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"kernelfs did not mount {mountpoint} in {MOUNT_TIMEOUT_S} s")
            time.sleep(0.02)
        yield KernelFsMount(backing, mountpoint)
    finally:
        unmount(mountpoint)
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        log.unlink(missing_ok=True)
