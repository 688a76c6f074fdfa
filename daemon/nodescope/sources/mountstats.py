"""NFS client statistics per mount and per RPC operation, from ``/proc/self/mountstats``.

Reads ``<procfs>/self/mountstats`` (``fs/proc_namespace.c`` ``show_vfsstat``; NFS part
``fs/nfs/super.c`` ``nfs_show_stats``; RPC part ``net/sunrpc/stats.c`` ``rpc_clnt_show_stats``;
``docs/datasources.md`` §6). Each mount starts with
``device SRV:/export mounted on /mnt with fstype nfs4 statvers=1.1``; only NFS mounts carry
the tab-indented block that follows: ``age:`` (seconds since mount), ``events:``, ``bytes:``,
``RPC iostats version: 1.1  p/v: 100003/4 (nfs)``, ``xprt: …`` and, after
``per-op statistics``, one line per operation::

    \\t        READ: ops ntrans timeouts bytes_sent bytes_recv queue_ms rtt_ms execute_ms errors

``queue`` is task start to transmit, ``rtt`` the request round trip, ``execute`` start to
completion, all cumulative milliseconds; ``errors`` (ops that ended with ``tk_status < 0``)
is absent on kernels before 5.3. Bytes include the RPC headers.

The records and ``nfsiostat``'s interval figures of two of them (:func:`nfs_rates`) are
declared in :mod:`nodescope.model.mountstats`.

A mount block that does not parse — its heading, its ``age:`` or one of its per-op lines —
is left out whole and counted in ``MountstatsData.skipped``; the other mounts are read. Only
a ``mountstats`` that cannot be read at all takes the source down.
"""

from __future__ import annotations

import re

from nodescope.errors import ParseError
from nodescope.fileio import PROC_TABLE
from nodescope.model.mountstats import (
    MOUNTSTATS,
    MountstatsData,
    MountstatsRates,
    NfsMount,
    NfsMountRates,
    NfsOp,
    NfsOpRates,
    nfs_rates,
)
from nodescope.model.skips import SkipTally
from nodescope.roots import Roots
from nodescope.sources.base import read_text
from nodescope.sources.spec import SourceSpec

NAME = MOUNTSTATS.name

NFS_FSTYPES = ("nfs", "nfs4")

_HEADING = re.compile(r"device (.+) mounted on (.+) with fstype (\S+)(?: statvers=(\S+))?")
_OP = re.compile(r"\s*([A-Za-z0-9_]+):((?:\s+[0-9]{1,20}){8,9})\s*")
_NUMBER = re.compile(r"[0-9]{1,20}")

# Reasons a record was skipped (nodescope_source_records_skipped_total{reason}).
#: a ``device ... mounted on ... with fstype ...`` heading that does not parse: its block
SKIP_MOUNT_HEADING_UNPARSABLE = "mount_heading_unparsable"
#: an NFS mount whose ``age:`` or per-op lines do not parse: the whole mount
SKIP_NFS_MOUNT_MALFORMED = "nfs_mount_malformed"
#: a line before the first mount heading
SKIP_LINE_OUTSIDE_MOUNT = "line_outside_mount"


# --- parser (pure) --------------------------------------------------------------------------


def _unescape(text: str) -> str:
    # show_vfsstat prints paths with mangle(): space, tab, newline and backslash as \ooo.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


class _MountBlock:
    """The NFS mount being read: its heading's fields, ``age`` and operations so far."""

    __slots__ = ("age", "device", "fstype", "mountpoint", "names", "ops", "statvers")

    def __init__(self, device: str, mountpoint: str, fstype: str, statvers: str | None) -> None:
        self.device = device
        self.mountpoint = mountpoint
        self.fstype = fstype
        self.statvers = statvers
        self.age: int | None = None
        self.ops: list[NfsOp] = []
        #: the operations' names so far: an NFSv4 mount lists about seventy
        self.names: set[str] = set()

    def mount(self) -> NfsMount:
        return NfsMount(
            self.device, self.mountpoint, self.fstype, self.statvers, self.age, tuple(self.ops)
        )


def _op(line: str, number: int, source: str, known: set[str]) -> NfsOp:
    match = _OP.fullmatch(line)
    if match is None:
        raise ParseError(source, f"malformed per-op line: {line!r}", number)
    values = [int(v) for v in match.group(2).split()]
    name = match.group(1)
    if name in known:
        raise ParseError(source, f"operation {name} listed twice", number)
    known.add(name)
    return NfsOp(
        name=name,
        ops=values[0],
        transmissions=values[1],
        timeouts=values[2],
        bytes_sent=values[3],
        bytes_received=values[4],
        queue_ms=values[5],
        rtt_ms=values[6],
        execute_ms=values[7],
        errors=values[8] if len(values) == 9 else None,
    )


def parse_mountstats(
    text: str, source: str = "/proc/self/mountstats", tally: SkipTally | None = None
) -> MountstatsData:
    """The NFS mounts of ``mountstats`` with their per-op statistics; other mounts passed
    over. A malformed mount block is left out whole and counted in ``tally`` (and in the
    record's ``skipped``), as is a line before the first heading."""
    tally = SkipTally() if tally is None else tally
    mounts: list[NfsMount] = []
    #: the NFS mount being read; None in the block of another mount or a skipped one
    current: _MountBlock | None = None
    in_ops = False
    seen_device = False

    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        if line.startswith("device "):
            seen_device = True
            if current is not None:
                mounts.append(current.mount())
            current = None
            in_ops = False
            match = _HEADING.fullmatch(line.rstrip())
            if match is None:
                tally.skip(
                    SKIP_MOUNT_HEADING_UNPARSABLE,
                    f"{source}:{number}: malformed device line: {line!r}",
                )
            elif match.group(3) in NFS_FSTYPES:
                current = _MountBlock(
                    _unescape(match.group(1)),
                    _unescape(match.group(2)),
                    match.group(3),
                    match.group(4),
                )
            continue
        if current is None:
            if not seen_device:
                tally.skip(SKIP_LINE_OUTSIDE_MOUNT, f"{source}:{number}: {line!r}")
            continue  # the body of a mount that is not NFS, or of one skipped
        stripped = line.strip()
        try:
            if stripped.startswith("age:"):
                value = stripped[4:].strip()
                if not _NUMBER.fullmatch(value):
                    raise ParseError(source, f"age: not an integer: {value!r}", number)
                current.age = int(value)
            elif stripped == "per-op statistics":
                in_ops = True
            elif in_ops:
                current.ops.append(_op(line, number, source, current.names))
        except ParseError as exc:
            # Half a mount's operations would read as operations that stopped: none of it.
            tally.skip(SKIP_NFS_MOUNT_MALFORMED, str(exc))
            current = None
    if current is not None:
        mounts.append(current.mount())
    return MountstatsData(tuple(mounts), tally.freeze())


# --- reader (IO) ----------------------------------------------------------------------------


def read_mountstats(roots: Roots) -> MountstatsData:
    path = roots.procfs / "self" / "mountstats"
    return parse_mountstats(read_text(path, PROC_TABLE), str(path))


class MountstatsSource:
    name = NAME

    def collect(self, roots: Roots) -> MountstatsData:
        return read_mountstats(roots)

    def close(self) -> None:
        return None


def make_source() -> MountstatsSource:
    return MountstatsSource()


SPEC = SourceSpec(
    name="mountstats",
    default_interval=10.0,
    help="NFS per-op RPC statistics (ops, retransmissions, RTT, execute time) per mount",
    build=lambda inputs: make_source(),
    rates=lambda derived: derived.nfs_rates,
    metric_area="nodescope_exporters.event_metrics",
    sim_parts=frozenset({"proc_files"}),
)


__all__ = [
    "NAME",
    "NFS_FSTYPES",
    "SKIP_LINE_OUTSIDE_MOUNT",
    "SKIP_MOUNT_HEADING_UNPARSABLE",
    "SKIP_NFS_MOUNT_MALFORMED",
    "MountstatsData",
    "MountstatsRates",
    "MountstatsSource",
    "NfsMount",
    "NfsMountRates",
    "NfsOp",
    "NfsOpRates",
    "make_source",
    "nfs_rates",
    "parse_mountstats",
    "read_mountstats",
]
