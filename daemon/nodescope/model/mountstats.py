"""The records of the ``mountstats`` source: NFS client statistics per mount and per RPC
operation, and ``nfsiostat``'s figures of two samples.

``sources/mountstats.py`` reads them from ``/proc/self/mountstats``. ``queue`` is task start
to transmit, ``rtt`` the request round trip, ``execute`` start to completion, all cumulative
milliseconds; ``errors`` is absent on kernels before 5.3; bytes include the RPC headers.

:func:`nfs_rates` is ``nfsiostat``'s interval arithmetic (nfs-utils
``tools/nfs-iostat/nfs-iostat.py``): ``avg RTT = Δrtt/Δops``, ``avg exe = Δexecute/Δops``,
``avg queue = Δqueue/Δops``, ``retrans = Δntrans − Δops``, ``kB/op = (Δsent+Δrecv)/1024/Δops``.
The counters restart on a remount: a mount whose ``age`` went down is left out of that
interval.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nodescope.model.counters import counter_delta
from nodescope.model.skips import NOTHING_SKIPPED, Skipped
from nodescope.model.source_key import SourceKey


@dataclass(frozen=True, slots=True)
class NfsOp:
    """Cumulative statistics of one RPC operation on one mount. Times in ms."""

    name: str
    ops: int
    transmissions: int
    timeouts: int
    bytes_sent: int
    bytes_received: int
    queue_ms: int
    rtt_ms: int
    execute_ms: int
    errors: int | None


@dataclass(frozen=True, slots=True)
class NfsMount:
    """One NFS mount: ``device`` is ``server:/export``; ``age_seconds`` since mount."""

    device: str
    mountpoint: str
    fstype: str
    statvers: str | None
    age_seconds: int | None
    ops: tuple[NfsOp, ...]

    def op(self, name: str) -> NfsOp | None:
        for op in self.ops:
            if op.name == name:
                return op
        return None


@dataclass(frozen=True, slots=True)
class MountstatsData:
    mounts: tuple[NfsMount, ...]
    #: mount blocks and lines left out of this run as malformed
    skipped: Skipped = field(default=NOTHING_SKIPPED, compare=False)

    def mount(self, mountpoint: str) -> NfsMount | None:
        for mount in self.mounts:
            if mount.mountpoint == mountpoint:
                return mount
        return None


# --- interval figures (nfsiostat) -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NfsOpRates:
    """One operation over an interval. The per-op averages are ``None`` when no operation
    completed in it (nfsiostat prints 0 there; "no sample" is not "0 ms")."""

    name: str
    ops: int
    ops_per_second: float
    retransmissions: int
    retransmissions_per_second: float
    errors: int | None
    errors_per_second: float | None
    kilobytes_per_second: float
    kilobytes_per_op: float | None
    avg_rtt_ms: float | None
    avg_execute_ms: float | None
    avg_queue_ms: float | None


@dataclass(frozen=True, slots=True)
class NfsMountRates:
    mountpoint: str
    device: str
    ops: tuple[NfsOpRates, ...]

    def op(self, name: str) -> NfsOpRates | None:
        for op in self.ops:
            if op.name == name:
                return op
        return None

    def slowest(self) -> NfsOpRates | None:
        """The operation with the highest average execute time in the interval."""
        timed = [o for o in self.ops if o.avg_execute_ms is not None]
        return max(timed, key=lambda o: (o.avg_execute_ms or 0.0, o.name), default=None)


@dataclass(frozen=True, slots=True)
class MountstatsRates:
    seconds: float
    mounts: tuple[NfsMountRates, ...]

    def mount(self, mountpoint: str) -> NfsMountRates | None:
        for mount in self.mounts:
            if mount.mountpoint == mountpoint:
                return mount
        return None


def _op_rates(prev: NfsOp, cur: NfsOp, seconds: float) -> NfsOpRates | None:
    # sunrpc keeps these as unsigned long (64-bit) / ktime sums: a decrease is a reset.
    deltas = [
        counter_delta(getattr(prev, f), getattr(cur, f))
        for f in (
            "ops",
            "transmissions",
            "bytes_sent",
            "bytes_received",
            "queue_ms",
            "rtt_ms",
            "execute_ms",
        )
    ]
    if any(d is None for d in deltas):
        return None
    ops, trans, sent, received, queue, rtt, execute = (d or 0 for d in deltas)
    errors = None
    if prev.errors is not None and cur.errors is not None:
        errors = counter_delta(prev.errors, cur.errors)
    kilobytes = (sent + received) / 1024
    retrans = max(0, trans - ops)
    return NfsOpRates(
        name=cur.name,
        ops=ops,
        ops_per_second=ops / seconds,
        retransmissions=retrans,
        retransmissions_per_second=retrans / seconds,
        errors=errors,
        errors_per_second=None if errors is None else errors / seconds,
        kilobytes_per_second=kilobytes / seconds,
        kilobytes_per_op=kilobytes / ops if ops else None,
        avg_rtt_ms=rtt / ops if ops else None,
        avg_execute_ms=execute / ops if ops else None,
        avg_queue_ms=queue / ops if ops else None,
    )


def nfs_rates(previous: MountstatsData, current: MountstatsData, seconds: float) -> MountstatsRates:
    """nfsiostat's figures for every mount in both samples (same mountpoint and device)."""
    if seconds <= 0:
        return MountstatsRates(seconds, ())
    before = {(m.mountpoint, m.device): m for m in previous.mounts}
    out: list[NfsMountRates] = []
    for mount in current.mounts:
        old = before.get((mount.mountpoint, mount.device))
        if old is None:
            continue
        if (
            old.age_seconds is not None
            and mount.age_seconds is not None
            and mount.age_seconds < old.age_seconds
        ):
            continue  # remounted: the counters started again
        old_ops = {op.name: op for op in old.ops}
        rates = []
        for op in mount.ops:
            prev = old_ops.get(op.name)
            if prev is None:
                continue
            r = _op_rates(prev, op, seconds)
            if r is not None:
                rates.append(r)
        out.append(NfsMountRates(mount.mountpoint, mount.device, tuple(rates)))
    return MountstatsRates(seconds, tuple(out))


#: The ``mountstats`` source's records: the NFS mounts the daemon sees.
MOUNTSTATS = SourceKey("mountstats", MountstatsData)
