"""Directories root writes in, opened from ``/`` one component at a time, never through a
link or a directory another user could change.

``os.makedirs`` and ``open(path)`` resolve every component of a path and follow every
symbolic link in it; checking the last directory afterwards says nothing of the way there. A
user who can write in any ancestor of ``[slurm] reports_dir`` (or the run root, or the probe's
report) can put a link there, and root then creates and writes in a directory of the user's
choosing. So :func:`open_directory` walks the path from a descriptor of ``/``: each component
is opened relative to its parent's descriptor with ``O_NOFOLLOW | O_DIRECTORY`` (the
``openat`` way: ``os.open(name, ..., dir_fd=parent)``), created there with ``mkdirat`` when it
is missing and the caller asks, and checked on its descriptor as sshd's ``StrictModes`` checks
the way to ``authorized_keys``:

* every directory on the way is owned by root or by this process's user, and writable by group
  or others only with the sticky bit set (``/tmp``: there nobody can rename or remove what
  another user made);
* the directory itself (``private``) is owned by this process's user and writable by nobody
  else;
* a symbolic link on the way is followed only when root or this process's user owns it (a
  system's ``/var/run -> /run``), and the walk goes on from its target with the same checks; a
  link any other user made is refused, whatever it points to, and so is the directory itself
  when it is a link. At most :data:`MAX_LINKS` links.

Anything else raises :class:`UnsafeDirectory`. The descriptor returned is the checked
directory itself: a later rename of any component cannot redirect writes made relative to it.

A leaf: the standard library only.
"""

from __future__ import annotations

import errno
import os
import stat
from collections import deque
from pathlib import Path

#: Symbolic links followed on one walk at most (the kernel's own limit is 40).
MAX_LINKS = 40
_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeDirectory(PermissionError):
    """A directory on the way that others could change under the writer: owned by another
    user, writable by group or others without the sticky bit, a symbolic link another user
    made, or not a directory."""


def _ancestor_problem(info: os.stat_result, me: int) -> str | None:
    if info.st_uid not in (0, me):
        return f"is owned by uid {info.st_uid}, neither root nor {me}"
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        return (
            f"is writable by group or others without the sticky bit"
            f" (mode {stat.S_IMODE(info.st_mode):04o})"
        )
    return None


def _private_problem(info: os.stat_result, me: int) -> str | None:
    if info.st_uid != me:
        return f"is owned by uid {info.st_uid}, not {me}"
    if info.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def open_directory(
    path: str | os.PathLike[str],
    *,
    create: bool = True,
    mode: int = 0o750,
    private: bool = True,
) -> int:
    """A descriptor of directory ``path`` reached and checked as the module docstring says;
    missing components are created when ``create`` (the last with ``mode``, those above it
    0755). ``private``: the directory itself must be this user's alone; otherwise it is held
    to the ancestors' rule (a sticky ``/tmp`` passes). FileNotFoundError when a component is
    missing and ``create`` is false; :class:`UnsafeDirectory` on a check that fails."""
    me = os.geteuid()
    text = os.path.abspath(os.fspath(path))
    todo = deque(part for part in text.split("/") if part and part != ".")
    where = "/"
    fd = os.open("/", _OPEN)
    links = 0
    try:
        _check(fd, where, me, last=not todo, private=private)
        while todo:
            name = todo.popleft()
            last = not todo
            mine = False
            try:
                child = os.open(name, _OPEN, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, mode if last else 0o755, dir_fd=fd)
                    mine = True
                except FileExistsError:
                    pass  # another writer made it meanwhile: checked below like any other
                child = os.open(name, _OPEN, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
                place = os.path.join(where, name)
                if not stat.S_ISLNK(info.st_mode):
                    raise UnsafeDirectory(errno.ENOTDIR, f"{place} is not a directory") from None
                if last:
                    raise UnsafeDirectory(
                        errno.ELOOP, f"{place} is a symbolic link: refusing to write there"
                    ) from None
                if info.st_uid not in (0, me) or links >= MAX_LINKS:
                    raise UnsafeDirectory(
                        errno.ELOOP,
                        f"{place} is a symbolic link made by uid {info.st_uid}: refusing to"
                        " follow it (only root's links are followed)",
                    ) from None
                links += 1
                target = os.readlink(name, dir_fd=fd)
                todo.extendleft(reversed([p for p in target.split("/") if p and p != "."]))
                if target.startswith("/"):
                    os.close(fd)
                    fd, where = os.open("/", _OPEN), "/"
                continue
            os.close(fd)
            fd, where = child, os.path.normpath(os.path.join(where, name))
            if mine:
                os.fchmod(fd, mode if last else 0o755)  # whatever the umask
            _check(fd, where, me, last=last, private=private)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check(fd: int, where: str, me: int, *, last: bool, private: bool) -> None:
    info = os.fstat(fd)
    problem = _private_problem(info, me) if last and private else _ancestor_problem(info, me)
    if problem is not None:
        raise UnsafeDirectory(
            errno.EPERM,
            f"{where} {problem}: refusing to write there"
            + ("; make it a directory of its own (chown root, chmod 0750)" if last else ""),
        )


def ensure_directory(path: str | os.PathLike[str], mode: int = 0o750, private: bool = True) -> bool:
    """Create ``path`` (see :func:`open_directory`) or check the existing one; whether the
    directory itself did not exist before."""
    existed = os.path.lexists(path)
    os.close(open_directory(Path(path), create=True, mode=mode, private=private))
    return not existed
