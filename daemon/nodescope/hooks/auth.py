"""Who may reach the hook socket.

* The directory ``<run>/nodescope`` is root's, mode 0750 (:func:`prepare_directory`), and a
  POSIX ACL entry gives the SlurmUser search (``--x``) on it; the socket is 0600 with an ACL
  entry giving the SlurmUser read-write (:func:`grant`). Nobody else can ``connect()``.
* The server reads the peer's credentials (:func:`peer_of`, ``SO_PEERCRED``) as soon as it
  accepts a connection, before a byte is read; the daemon serves :func:`allowed_uids`: root
  and the SlurmUser.
"""

from __future__ import annotations

import os
import pwd
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from nodescope.config import SlurmSettings
from nodescope.safedir import ensure_directory

_UCRED = struct.Struct("3i")


@dataclass(frozen=True, slots=True)
class Peer:
    """The connecting process as the kernel saw it at ``connect()`` (``SO_PEERCRED``)."""

    pid: int
    uid: int
    gid: int


def peer_of(conn: socket.socket) -> Peer:
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return Peer(pid, uid, gid)


def slurm_uid(slurm_user: str) -> int | None:
    """The SlurmUser's uid, or ``None`` when the name does not resolve on this host."""
    try:
        return pwd.getpwnam(slurm_user).pw_uid
    except KeyError:
        return None


def allowed_uids(settings: SlurmSettings) -> frozenset[int]:
    """Root and the SlurmUser (``settings.slurm_user``, when the name resolves here)."""
    uid = slurm_uid(settings.slurm_user)
    return frozenset({0} if uid is None else {0, uid})


# POSIX ACL as the kernel takes it in the ``system.posix_acl_access`` attribute
# (include/uapi/linux/posix_acl_xattr.h): a version, then (tag, permissions, id) entries
# sorted by tag, then id.
_ACL_VERSION = 2
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_ACL_UNDEFINED_ID = 0xFFFFFFFF


def _acl_granting(mode: int, uid: int, permissions: int) -> bytes:
    """The ACL of a file of ``mode`` plus one named-user entry; the mask admits it."""
    owner, group, other = (mode >> 6) & 7, (mode >> 3) & 7, mode & 7
    entries = [
        (_ACL_USER_OBJ, owner, _ACL_UNDEFINED_ID),
        (_ACL_USER, permissions, uid),
        (_ACL_GROUP_OBJ, group, _ACL_UNDEFINED_ID),
        (_ACL_MASK, group | permissions, _ACL_UNDEFINED_ID),
        (_ACL_OTHER, other, _ACL_UNDEFINED_ID),
    ]
    return struct.pack("<I", _ACL_VERSION) + b"".join(
        struct.pack("<HHI", tag, perm, ident) for tag, perm, ident in entries
    )


def grant(path: Path, uid: int, permissions: int) -> None:
    """Give user ``uid`` ``permissions`` (rwx bits, 0-7) on ``path`` with an ACL entry.

    An ACL rather than a group: the SlurmUser's primary group may be shared with every user
    of the node, and the daemon may not ``chown`` (the unit leaves it no ``CAP_CHOWN``)."""
    mode = stat.S_IMODE(os.lstat(path).st_mode)
    os.setxattr(path, "system.posix_acl_access", _acl_granting(mode, uid, permissions))


def prepare_directory(directory: Path) -> bool:
    """Create ``directory`` root-only (0750) or check the existing one, reached from ``/``
    through directories nobody else can change and no link another user made
    (:func:`nodescope.safedir.ensure_directory`): owned by this process's user and writable
    by nobody else, else :class:`~nodescope.safedir.UnsafeDirectory` (a PermissionError).
    Returns whether it was created here."""
    return ensure_directory(directory)
