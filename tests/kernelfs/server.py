"""A FUSE filesystem that serves a directory tree the way the kernel serves sysfs, procfs and
cgroupfs, so the daemon's readers meet the kernel's read semantics over fixture trees and the
simulated node.

A tree written as regular files hides how the kernel hands out its pseudo-files: a regular
file comes whole in one ``read`` and ``stat`` tells its true size, so a reader that stops
after the first short read, or trusts ``st_size``, passes every test and undercounts on a real
node. Served through this filesystem, by path under the mount:

* **sysfs attributes** (regular files under the sysfs root, outside cgroupfs): ``st_size``
  4096 whatever the content (kernfs reports a page for every text attribute); the whole
  content in the first ``read`` up to the buffer, then EOF.
* **Tables of many records** (procfs files other than the one-record ones below; cgroupfs
  ``cgroup.procs``, ``cgroup.threads``, ``tasks``): ``st_size`` 0 and at most one page per
  ``read``, cut after the last whole line that fits, as ``seq_read`` stops at the record
  that would overflow its page buffer. A line longer than a page comes alone, whole up to
  the buffer (``seq_file`` grows its buffer for a record that does not fit).
* **One-record files** (``/proc/<pid>/stat``, ``status``, ``wchan``, ``comm``, ``cgroup``
  and the like, made by ``single_open``; every other cgroupfs file: ``*.stat``, ``*.max``,
  ``*.events``, ``*.current``, ``*.pressure``): ``st_size`` 0, whole in the first ``read``
  up to the buffer.
* **``environ`` and ``cmdline``**: ``st_size`` 0, a page per ``read`` cut anywhere (they
  are copied out of the process's memory, not made of records; a kernel read may fill
  more than a page, so a page is the stricter case a reader must handle).
* **Everything else** (the ``dev`` and ``run`` roots): the backing file as it is.

Every file is opened with ``direct_io`` and without ``keep_cache``, so each ``read`` reaches
this server and the page cache never joins short reads into a long one. Each read is made
from the backing file as it is at that read, as ``seq_read`` makes each page from the
records as they are then. By default the kernel keeps no name and no attribute either, as
procfs shows a process the moment it exists; a mount may let it keep them for a while
(``--entry-timeout``, ``--attr-timeout``), which costs only how fresh a ``stat`` is:
directories are listed afresh every time and reads always reach the backing file.

Writes, creates, renames and removals pass through to the backing directory, so the tree can
be written through the mount as well as beside it. Inode numbers are the backing files'
(``use_ino``): sources that key cgroups by inode see the same numbers either way. An absolute
symbolic link into the backing directory is shown pointing into the mount, so following it
does not step out of the kernel semantics.

Run as ``python -m tests.kernelfs.server BACKING MOUNTPOINT [--sysfs REL] [--procfs REL]
[--cgroupfs REL]``; it serves in the foreground until unmounted.
"""

from __future__ import annotations

import argparse
import errno
import os
import stat
import sys
from dataclasses import dataclass
from enum import Enum
from typing import Any

#: What the kernel hands out per ``read`` of a table or an environment block: one page.
PAGE = 4096
#: ``st_size`` of every sysfs text attribute (kernfs sets a page whatever the content).
SYSFS_ATTRIBUTE_SIZE = 4096

#: ``FUSE_CAP_CACHE_SYMLINKS`` (fuse_common.h): the kernel keeps a link's target in its page
#: cache instead of asking again on every path walk through it.
FUSE_CAP_CACHE_SYMLINKS = 1 << 23

#: cgroupfs files that list tasks: ``seq_file`` tables of one line per task.
CGROUP_TABLES = frozenset({"cgroup.procs", "cgroup.threads", "tasks"})
#: procfs files made in one go by ``single_open`` (per process, per thread, and node-wide).
PROC_ONE_RECORD = frozenset(
    {
        "stat", "status", "wchan", "comm", "cgroup", "statm", "io", "schedstat", "loginuid",
        "oom_score", "oom_score_adj", "personality", "timerslack_ns", "uptime", "loadavg",
        "version", "cpuset", "limits", "sessionid",
    }
)  # fmt: skip
#: procfs files copied out of a process's memory: no records, served a page at a time.
PROC_PAGED = frozenset({"environ", "cmdline"})


class Serving(Enum):
    """How a regular file is served."""

    PLAIN = "plain"
    SYSFS_ATTRIBUTE = "sysfs attribute"
    TABLE = "table"
    ONE_RECORD = "one record"
    PAGED = "paged"


@dataclass(frozen=True)
class Layout:
    """Where the pseudo-filesystems sit, relative to the mount's root (``""`` for none)."""

    sysfs: str = "sys"
    procfs: str = "proc"
    cgroupfs: str = "sys/fs/cgroup"

    def serving(self, relative: str) -> Serving:
        """How the regular file at ``relative`` (no leading slash) is served."""
        # String prefixes, not pathlib: this runs for every stat and read the mount serves.
        name = relative.rpartition("/")[2]
        # cgroupfs first: it is mounted inside sysfs.
        if _under(relative, self.cgroupfs):
            return Serving.TABLE if name in CGROUP_TABLES else Serving.ONE_RECORD
        if _under(relative, self.procfs):
            if name in PROC_PAGED:
                return Serving.PAGED
            if name in PROC_ONE_RECORD:
                return Serving.ONE_RECORD
            # Any other procfs file is a table: the stricter case for a reader.
            return Serving.TABLE
        if _under(relative, self.sysfs):
            return Serving.SYSFS_ATTRIBUTE
        return Serving.PLAIN


def _under(relative: str, root: str) -> bool:
    root = root.strip("/")
    if not root:
        return False
    return relative == root or relative.startswith(root + "/")


def reported_size(serving: Serving, real_size: int) -> int:
    """``st_size`` as the kernel reports it for a file served this way."""
    if serving is Serving.PLAIN:
        return real_size
    if serving is Serving.SYSFS_ATTRIBUTE:
        return SYSFS_ATTRIBUTE_SIZE
    return 0


def table_chunk(data: bytes, offset: int, size: int) -> bytes:
    """The bytes one ``read(size)`` at ``offset`` of a ``seq_file`` table returns: at most a
    page, ending after the last whole line that fits; a line longer than a page alone, up to
    ``size``."""
    if offset >= len(data) or size <= 0:
        return b""
    end = offset + min(size, PAGE)
    if end >= len(data):
        return data[offset:]
    cut = data.rfind(b"\n", offset, end)
    if cut >= 0:
        return data[offset : cut + 1]
    newline = data.find(b"\n", end)
    record_end = len(data) if newline < 0 else newline + 1
    return data[offset : min(record_end, offset + size)]


def chunk(serving: Serving, data: bytes, offset: int, size: int) -> bytes:
    """The bytes one ``read(size)`` at ``offset`` returns of a pseudo-file holding ``data``."""
    if serving is Serving.TABLE:
        return table_chunk(data, offset, size)
    if serving is Serving.PAGED:
        return data[offset : offset + min(size, PAGE)]
    # sysfs attributes and one-record files: whole in the first read, up to the buffer.
    return data[offset : offset + size]


class KernelSemanticsFs:
    """The FUSE operations (mfusepy's high-level API with ``raw_fi``)."""

    use_ns = True

    def __init__(
        self,
        backing: str,
        mountpoint: str,
        layout: Layout,
        entry_timeout: float = 0.0,
        attr_timeout: float = 0.0,
    ) -> None:
        self.backing = os.path.realpath(backing)
        self.entry_timeout = entry_timeout
        self.attr_timeout = attr_timeout
        self.mountpoint = os.path.realpath(mountpoint)
        self.layout = layout

    # ---- paths -----------------------------------------------------------------------------

    def _real(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def _serving(self, path: str) -> Serving:
        return self.layout.serving(path.lstrip("/"))

    # ---- setup -----------------------------------------------------------------------------

    def init_with_config(self, conn: Any, config: Any) -> None:
        if conn is not None and conn.capable & FUSE_CAP_CACHE_SYMLINKS:
            conn.want |= FUSE_CAP_CACHE_SYMLINKS
        if config is None:
            return
        # Names and attributes are kept only as long as the mount was told (none by
        # default); a name not found is never kept, so a new file is seen at once.
        config.entry_timeout = self.entry_timeout
        config.negative_timeout = 0.0
        config.attr_timeout = self.attr_timeout
        config.use_ino = 1
        config.direct_io = 1
        config.kernel_cache = 0
        config.auto_cache = 0

    # ---- metadata --------------------------------------------------------------------------

    def getattr(self, path: str, fh: Any = None) -> dict[str, int]:
        st = os.lstat(self._real(path))
        attrs = {
            key: getattr(st, key)
            for key in (
                "st_mode", "st_ino", "st_nlink", "st_uid", "st_gid", "st_size", "st_rdev",
                "st_blocks",
            )
        }  # fmt: skip
        attrs["st_atime"] = st.st_atime_ns
        attrs["st_mtime"] = st.st_mtime_ns
        attrs["st_ctime"] = st.st_ctime_ns
        if stat.S_ISREG(st.st_mode):
            attrs["st_size"] = reported_size(self._serving(path), st.st_size)
        return attrs

    def readlink(self, path: str) -> str:
        target = os.readlink(self._real(path))
        if os.path.isabs(target):
            relative = os.path.relpath(target, self.backing)
            if not relative.startswith(".."):
                return os.path.join(self.mountpoint, relative)
        return target

    def readdir(self, path: str, fh: Any) -> list[tuple[str, dict[str, int], int]]:
        # Each entry carries its inode: with use_ino an entry without one has inode 0, and
        # readdir(3) drops entries of inode 0 as deleted.
        real = self._real(path)
        here = os.lstat(real)
        entries = [(".", _entry_attrs(here.st_ino, here.st_mode), 0)]
        parent = os.lstat(os.path.dirname(real.rstrip("/")) if path.strip("/") else real)
        entries.append(("..", _entry_attrs(parent.st_ino, parent.st_mode), 0))
        with os.scandir(real) as it:
            for entry in it:
                entries.append((entry.name, _entry_attrs(entry.inode(), _entry_mode(entry)), 0))
        return entries

    def statfs(self, path: str) -> dict[str, int]:
        sv = os.statvfs(self._real(path))
        return {
            key: getattr(sv, key)
            for key in (
                "f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                "f_files", "f_flag", "f_frsize", "f_namemax",
            )
        }  # fmt: skip

    def access(self, path: str, amode: int) -> int:
        if not os.access(self._real(path), amode):
            raise _error(errno.EACCES)
        return 0

    # ---- file content ----------------------------------------------------------------------

    # No open and no release: libfuse answers them itself (direct_io comes from the config),
    # and every read makes its answer from the file as it is at that read, as seq_file makes
    # each page from the records as they are then. Two requests per file read fewer through
    # the interpreter is what lets a whole replay run through the mount. Unlike seq_file, a
    # table rewritten between two reads of one open could be cut inside a line; the
    # simulated node writes only between the daemon's cycles, never during one.

    def read(self, path: str, size: int, offset: int, fi: Any) -> bytes:
        serving = self._serving(path)
        fd = os.open(self._real(path), os.O_RDONLY | os.O_CLOEXEC)
        try:
            if serving is Serving.PLAIN:
                return os.pread(fd, size, offset)
            data = _read_all(fd)
        finally:
            os.close(fd)
        return chunk(serving, data, offset, size)

    def create(self, path: str, mode: int, fi: Any) -> int:
        os.close(os.open(self._real(path), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, mode))
        fi.direct_io = 1
        fi.keep_cache = 0
        return 0

    def write(self, path: str, data: bytes, offset: int, fi: Any) -> int:
        fd = os.open(self._real(path), os.O_WRONLY | os.O_CLOEXEC)
        try:
            return os.pwrite(fd, data, offset)
        finally:
            os.close(fd)

    def truncate(self, path: str, length: int, fh: Any = None) -> int:
        os.truncate(self._real(path), length)
        return 0

    # ---- tree changes, passed through ------------------------------------------------------

    def mkdir(self, path: str, mode: int) -> int:
        os.mkdir(self._real(path), mode)
        return 0

    def rmdir(self, path: str) -> int:
        os.rmdir(self._real(path))
        return 0

    def unlink(self, path: str) -> int:
        os.unlink(self._real(path))
        return 0

    def rename(self, old: str, new: str) -> int:
        os.rename(self._real(old), self._real(new))
        return 0

    def symlink(self, target: str, source: str) -> int:
        # mfusepy passes (link path, what it points to).
        os.symlink(source, self._real(target))
        return 0

    def link(self, target: str, source: str) -> int:
        os.link(self._real(source), self._real(target))
        return 0

    def chmod(self, path: str, mode: int) -> int:
        os.chmod(self._real(path), mode)
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        os.lchown(self._real(path), uid, gid)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        if times is None:
            os.utime(self._real(path), follow_symlinks=False)
        else:
            os.utime(self._real(path), ns=times, follow_symlinks=False)
        return 0


def _read_all(fd: int) -> bytes:
    chunks = []
    while part := os.read(fd, 1 << 20):
        chunks.append(part)
    return b"".join(chunks)


def _entry_mode(entry: os.DirEntry[str]) -> int:
    """The file type of a directory entry, from its d_type where the filesystem gives one."""
    if entry.is_symlink():
        return stat.S_IFLNK
    if entry.is_dir(follow_symlinks=False):
        return stat.S_IFDIR
    if entry.is_file(follow_symlinks=False):
        return stat.S_IFREG
    return entry.stat(follow_symlinks=False).st_mode


def _entry_attrs(inode: int, mode: int) -> dict[str, int]:
    return {"st_ino": inode, "st_mode": stat.S_IFMT(mode)}


def _error(code: int) -> OSError:
    return OSError(code, os.strerror(code))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backing")
    parser.add_argument("mountpoint")
    parser.add_argument("--sysfs", default="sys", help="sysfs root, relative ('' for none)")
    parser.add_argument("--procfs", default="proc", help="procfs root, relative")
    parser.add_argument("--cgroupfs", default="sys/fs/cgroup", help="cgroupfs root, relative")
    parser.add_argument("--entry-timeout", type=float, default=0.0, help="seconds")
    parser.add_argument("--attr-timeout", type=float, default=0.0, help="seconds")
    args = parser.parse_args(argv)

    import mfusepy

    operations = KernelSemanticsFs(
        args.backing,
        args.mountpoint,
        Layout(args.sysfs, args.procfs, args.cgroupfs),
        args.entry_timeout,
        args.attr_timeout,
    )
    # One thread: every request is served from memory or one pread, and a single thread
    # keeps the handle table free of races.
    mfusepy.FUSE(
        operations,
        args.mountpoint,
        raw_fi=True,
        foreground=True,
        nothreads=True,
        fsname="nodescope-kernelfs",
        subtype="kernelfs",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
