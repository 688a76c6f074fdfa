"""Reading files as the kernel serves them, and refusing what a hostile user could plant.

Every file nodescope reads — sysfs attributes, procfs and cgroupfs tables, the config — goes
through :func:`read_bytes`. Three things make that one function necessary:

* **Pseudo-files are read to EOF.** procfs and cgroupfs are ``seq_file`` files: each ``read()``
  returns about one page whatever the buffer asked for, and ``stat`` reports a size of 0, so a
  reader that stops at the first short read sees only the first page of ``/proc/locks`` or of a
  large ``cgroup.threads``. sysfs attributes report ``st_size`` 4096 and hand out their whole
  text (one page at most) in the first read, so a short first read of a file with a non-zero
  size is its end: a sysfs attribute costs one ``read`` and no second one to see EOF.
* **Only regular files are read.** The file is opened with ``O_NONBLOCK`` — opening a FIFO
  without it waits for a writer — and checked with ``fstat`` before the first read: a FIFO, a
  socket, a directory or a device (``/dev/zero`` behind a symlink) is refused with
  :class:`NotARegularFile`, never read. Kernel pseudo-files are regular files to ``fstat``.
* **Every read has a size cap**, named per kind of file (:class:`FileKind`), so a huge file —
  or one that never ends — costs at most the cap, and the error names it.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FileKind:
    """A kind of file, the most bytes nodescope reads of one, and whether the kernel hands
    out the whole file in its first ``read``.

    ``whole_in_first_read`` holds for files the kernel makes in one go: sysfs attributes and
    ``seq_file`` files with a single record (``single_open``: ``/proc/<pid>/stat``,
    ``status``, ``wchan``, ``cgroup``; cgroup ``*.stat`` and ``*.max`` files). A read shorter
    than the buffer is then the end of the file, and the second ``read`` that would return 0
    is saved. Tables of many records (``/proc/locks``, ``cgroup.threads``) and
    ``/proc/<pid>/environ`` come a page at a time and are always read to EOF.
    """

    name: str
    max_bytes: int
    whole_in_first_read: bool = False


KIB = 1 << 10
MIB = 1 << 20

#: A sysfs attribute is one page at most (``sysfs_emit``); binary attributes such as a PCI
#: function's ``config`` are 4 KiB of extended configuration space. 64 KiB leaves room for
#: a fixture written by hand and refuses anything else.
SYSFS_ATTRIBUTE = FileKind("sysfs attribute", 64 * KIB, whole_in_first_read=True)
#: ``/proc/<pid>/stat``, ``status``, ``wchan``, ``cgroup`` (and a thread's): one record each.
PROC_PROCESS = FileKind("per-process procfs file", 1 * MIB, whole_in_first_read=True)
#: ``/proc/<pid>/environ``: the kernel caps argv and environment together at a quarter of
#: the stack limit, 2 MiB with the default 8 MiB stack; it is served a page per read.
PROC_ENVIRON = FileKind("process environment", 4 * MIB)
#: Node-wide procfs tables: ``/proc/locks`` (about 56 bytes a lock), ``/proc/diskstats``
#: (about 150 bytes a disk), ``/proc/self/mountstats`` (3–4 KiB per NFS mount),
#: ``/proc/net/dev``. 64 MiB holds a million locks or ten thousand NFS mounts.
PROC_TABLE = FileKind("procfs table", 64 * MIB)
#: ``cgroup.procs`` and ``cgroup.threads``: up to 8 bytes a task (the kernel's ``pid_max`` is
#: at most 4,194,304), a page per read.
CGROUP_LIST = FileKind("cgroup task list", 40 * MIB)
#: cgroup stat, limit and event files (``memory.stat``, ``io.stat``, ``memory.max``, ...): one
#: record each; ``io.stat`` grows with the disks a cgroup touched.
CGROUP_STAT = FileKind("cgroup stat file", 4 * MIB, whole_in_first_read=True)
#: The TOML config and files like it that an operator writes by hand.
CONFIG = FileKind("config file", 1 * MIB)
#: Any other kernel or fixture file: read to EOF, 16 MiB at most.
KERNEL_FILE = FileKind("kernel file", 16 * MIB)

#: Bytes asked for per ``read``. Python allocates the whole buffer before the call: 1 MiB
#: would be an mmap and munmap per file (glibc maps blocks over 128 KiB), several times the
#: cost of reading a small sysfs file; 64 KiB comes from the heap and holds any sysfs
#: attribute and nearly every procfs file's first page in one call.
READ_CHUNK = 64 * KIB

_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY


class NotARegularFile(OSError):
    """The path names a FIFO, socket, directory or device where a file was expected."""


class FileTooLarge(OSError):
    """The file holds more than its kind's cap."""


def _file_type(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    return "not a regular file"


def read_bytes(
    path: Path | str, kind: FileKind = KERNEL_FILE, *, dir_fd: int | None = None
) -> bytes:
    """The whole content of the regular file ``path`` (relative to ``dir_fd`` when given).

    Raises :class:`NotARegularFile` for anything but a regular file, :class:`FileTooLarge`
    past ``kind.max_bytes``, and the ``OSError`` of the open or read otherwise.
    """
    try:
        fd = os.open(path, _OPEN_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            # What open(2) answers for a unix socket (and a device with no driver behind it).
            raise NotARegularFile(
                f"{os.fspath(path)}: a socket or a device without a driver, not a regular"
                " file; refused"
            ) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotARegularFile(
                f"{os.fspath(path)}: {_file_type(info.st_mode)}, not a regular file; refused"
            )
        size = info.st_size
        limit = kind.max_bytes
        if size > limit:
            raise FileTooLarge(_too_large(path, kind, f"{size} bytes"))
        data = os.read(fd, READ_CHUNK)
        # A short first read of a file with a size is the whole file: a regular file is
        # read to its size, a sysfs attribute (size 4096) whole in its first read. Files of
        # size 0 — procfs and cgroupfs seq_files — hand out a page per read and are read to
        # EOF unless their kind is made in one go.
        if len(data) < READ_CHUNK and (size or kind.whole_in_first_read):
            return data
        if not data:
            return data
        chunks = [data]
        total = len(data)
        while chunk := os.read(fd, READ_CHUNK):
            total += len(chunk)
            if total > limit:
                raise FileTooLarge(_too_large(path, kind, f"more than {limit} bytes"))
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_prefix(path: Path | str, max_bytes: int, seconds: float) -> tuple[bytes, bool]:
    """The start of the regular file ``path``: read until its end, ``max_bytes`` or
    ``seconds`` (checked between reads), whichever comes first; and whether more was left.

    For a procfs table whose every read costs more than the last (``/proc/locks``): a
    caller that can use part of it takes the part its budget allows. Refuses what
    :func:`read_bytes` refuses.
    """
    deadline = time.monotonic() + seconds
    fd = os.open(path, _OPEN_FLAGS)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotARegularFile(
                f"{os.fspath(path)}: {_file_type(info.st_mode)}, not a regular file; refused"
            )
        chunks: list[bytes] = []
        total = 0
        while chunk := os.read(fd, READ_CHUNK):
            chunks.append(chunk)
            total += len(chunk)
            if total >= max_bytes or time.monotonic() >= deadline:
                # Cut only when more is there: a file that ends here was read whole.
                return b"".join(chunks), bool(os.read(fd, 1))
        return b"".join(chunks), False
    finally:
        os.close(fd)


def _too_large(path: Path | str, kind: FileKind, found: str) -> str:
    return (
        f"{os.fspath(path)}: {found}, over the {kind.max_bytes // KIB} KiB cap for a "
        f"{kind.name}; refused"
    )


def read_text(path: Path | str, kind: FileKind = KERNEL_FILE) -> str:
    """:func:`read_bytes` decoded as UTF-8, undecodable bytes replaced (names in kernel files
    are bytes a user chose)."""
    return read_bytes(path, kind).decode("utf-8", errors="replace")


def read_optional(path: Path | str, kind: FileKind = KERNEL_FILE) -> str | None:
    """The file's text, or ``None`` when it does not exist or cannot be read.

    Optional files parse to "absent", not to zero. A refused file (a FIFO, a device, over its
    cap) is absent too: the caller's record is skipped, not its whole source.
    """
    try:
        return read_text(path, kind)
    except OSError:
        return None


def read_optional_bytes(
    path: Path | str, kind: FileKind = KERNEL_FILE, *, dir_fd: int | None = None
) -> bytes | None:
    """:func:`read_bytes`, or ``None`` when the file cannot be opened, read or is refused."""
    try:
        return read_bytes(path, kind, dir_fd=dir_fd)
    except OSError:
        return None
