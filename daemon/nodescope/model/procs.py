"""The processes of Slurm jobs and the node's TCP counters: the ``procs`` source's records.

Built by ``sources/procs.py`` from the job cgroups' ``cgroup.procs``, the kept environment of
those processes (only what NCCL reads) and the ``Tcp:`` group of ``/proc/net/snmp``
(``net/ipv4/proc.c`` ``snmp_seq_show``); :func:`procs_rates` turns two reads into rates.
"""

from __future__ import annotations

from dataclasses import dataclass

from nodescope.model.counters import counter_rate
from nodescope.model.jobs import JobProcess
from nodescope.model.skips import NOTHING_SKIPPED, Skipped
from nodescope.model.source_key import SourceKey


@dataclass(frozen=True, slots=True)
class TcpCounters:
    """The ``Tcp:`` group of ``/proc/net/snmp`` (cumulative segment counts)."""

    in_segs: int
    out_segs: int
    retrans_segs: int


@dataclass(frozen=True, slots=True)
class ProcsData:
    processes: tuple[JobProcess, ...]
    tcp: TcpCounters | None
    skipped: Skipped = NOTHING_SKIPPED


@dataclass(frozen=True, slots=True)
class TcpRates:
    out_segs_per_second: float | None
    retrans_segs_per_second: float | None

    @property
    def retransmit_ratio(self) -> float | None:
        """Retransmitted over sent segments in the interval (``None`` when nothing was sent)."""
        if not self.out_segs_per_second or self.retrans_segs_per_second is None:
            return None
        return self.retrans_segs_per_second / self.out_segs_per_second


@dataclass(frozen=True, slots=True)
class ProcsRates:
    tcp: TcpRates | None


def procs_rates(previous: ProcsData, current: ProcsData, seconds: float) -> ProcsRates:
    """TCP segments sent and retransmitted per second between two reads."""
    if previous.tcp is None or current.tcp is None:
        return ProcsRates(None)
    # The MIB counters are unsigned long: 64 bits on the 64-bit hosts nodescope runs on.
    return ProcsRates(
        TcpRates(
            counter_rate(previous.tcp.out_segs, current.tcp.out_segs, seconds),
            counter_rate(previous.tcp.retrans_segs, current.tcp.retrans_segs, seconds),
        )
    )


#: The ``procs`` source's records.
PROCS = SourceKey("procs", ProcsData)
