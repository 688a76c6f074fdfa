"""What several detectors read from a snapshot: the job view, the TCP evidence, formatting.

Pure: reads only the snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import TypeVar

from nodescope.model.jobs import JobView
from nodescope.model.snapshot import Snapshot
from nodescope.model.source_key import SourceKey

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


def jobs(snapshot: Snapshot) -> tuple[JobView, ...]:
    """The jobs with GPU processes in their cgroups (job registry × NVML compute processes)."""
    return snapshot.derived.job_views


def jobs_of_gpus(views: tuple[JobView, ...]) -> dict[str, list[str]]:
    """GPU BDF -> the jobs running on it."""
    out: dict[str, list[str]] = {}
    for view in views:
        for bdf in view.gpu_bdfs:
            out.setdefault(bdf, []).append(view.job_id)
    return out


def grown_counts(
    snapshot: Snapshot, source: SourceKey[T], counts: Callable[[T], Mapping[K, int]]
) -> dict[K, tuple[int, int]]:
    """key -> (new events, events since the source started), for every key whose count of
    events since the source started grew between the source's two latest reads, in the order
    of the latest read.

    The source's first read has no read before it: everything it holds is new. A count lower
    than the read before is a restarted source: all of it is new."""
    pair = snapshot.pair(source)
    if pair is not None:
        before, now = counts(pair[0]), counts(pair[1])
    else:
        latest = snapshot.latest(source)
        # A previous sample that makes no pair (a failed read, a record of another type)
        # proves nothing new; only the source's first read counts everything it holds.
        if latest is None or source.name in snapshot.previous:
            return {}
        before, now = {}, counts(latest)
    grown: dict[K, tuple[int, int]] = {}
    for key, count in now.items():
        old = before.get(key, 0)
        added = count - old if count >= old else count
        if added > 0:
            grown[key] = (added, count)
    return grown


def tcp_evidence(snapshot: Snapshot) -> dict[str, float]:
    """TCP segments sent and retransmitted per second (``/proc/net/snmp``): evidence on every
    PCIe finding that a stall is in the PCIe domain and not on the network. Empty before the
    ``procs`` source has read twice."""
    rates = snapshot.derived.procs_rates
    if rates is None or rates.tcp is None:
        return {}
    tcp = rates.tcp
    out: dict[str, float] = {}
    if tcp.out_segs_per_second is not None:
        out["tcp_sent_segments_per_second"] = tcp.out_segs_per_second
    if tcp.retrans_segs_per_second is not None:
        out["tcp_retransmitted_segments_per_second"] = tcp.retrans_segs_per_second
    ratio = tcp.retransmit_ratio
    if ratio is not None:
        out["tcp_retransmit_ratio"] = ratio
    return out


def tcp_text(evidence: dict[str, float]) -> str:
    retrans = evidence.get("tcp_retransmitted_segments_per_second")
    if retrans is None:
        return ""
    ratio = evidence.get("tcp_retransmit_ratio")
    share = f" ({ratio:.2%} of sent)" if ratio is not None else ""
    return f"; TCP retransmits {retrans:.1f}/s{share}"


def emit_floor(keep_below: float | None, threshold: float) -> float:
    """The least ``value`` worth a finding: the raise threshold, or ``keep_below`` (the kind's
    alert rule's ``clear_below`` as configured, :func:`nodescope.alerts.keep_floor`) when
    lower (a finding in that band keeps a firing alert firing; the alert engine decides, the
    detector only reports)."""
    return threshold if keep_below is None else min(threshold, keep_below)


def gb(value: float) -> str:
    """Bytes per second as ``41.0 GB/s`` (decimal, as link capacities are quoted)."""
    return f"{value / 1e9:.1f} GB/s"
