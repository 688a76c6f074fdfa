"""A job's end-of-job report: what it used, what went wrong on its GPUs, and whether it left
them clean — or, for a job the prolog gate stopped, when and why it never ran.

The daemon's epilog builds it from the job's registration, the counters at the end and what it
saw of the job while it ran (:class:`JobWindow`); the hook builds it alone, without a window,
when the daemon does not answer. :mod:`nodescope_exporters.reports` writes and renders it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nodescope.hooks.request import JobRequest
from nodescope.hooks.stops import GateStop
from nodescope.model.collectives import JobCollectives
from nodescope.text import sanitize
from nodescope_exporters.reports import REPORT_FORMAT, counter_deltas

#: A process name as the verdict quotes it, at most (the kernel's comm is 15 bytes; a name
#: from elsewhere may be longer).
MAX_COMM = 64
#: The most samples a job's timeline keeps; a longer job's timeline is thinned.
MAX_SAMPLES = 720


def build_report(
    job: JobRequest,
    registration: Mapping[str, Any] | None,
    end_sample: Mapping[str, Any],
    end_wall: float,
    *,
    daemon: bool,
    window: JobWindow | None = None,
    findings: Sequence[Mapping[str, Any]] = (),
    alerts: Sequence[Mapping[str, Any]] = (),
    contention: Sequence[Mapping[str, Any]] = (),
    holders: Sequence[Mapping[str, Any]] = (),
    issued_at: float | None = None,
    gate_stop: GateStop | None = None,
    actions: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """A job's report. ``issued_at``: when the epilog call began (wall clock), which orders
    two reports of one job (:func:`nodescope_exporters.reports.write_report`). ``gate_stop``:
    the prolog gate stopped the job (it never ran): the verdict fails with the gate's reason
    and the report starts when the gate stopped it. ``actions``: what nodescope did to the
    node during the job (a drain on a finding; the job went on), from the remediation
    record."""
    registration = registration or {}
    gpus = list(job.gpus) or list(registration.get("gpus", []))
    start = registration.get("registered_at")
    if not isinstance(start, int | float):
        start = window.first_seen if window is not None else None
    if start is None and gate_stop is not None:
        start = gate_stop.stopped_at
    baseline = registration.get("baseline")
    deltas = (
        counter_deltas(baseline, end_sample, gpus if gpus else None)
        if isinstance(baseline, Mapping)
        else None
    )
    reason = None
    if holders:
        shown = ", ".join(
            f"pid {h['pid']} ({sanitize(h.get('comm') or '?', MAX_COMM)}) on GPU {h['gpu']}"
            for h in holders
        )
        reason = f"nodescope: job {job.job_id} GPU(s) still held after the job: {shown}"[:200]
    elif gate_stop is not None:
        why = gate_stop.reason.removeprefix("nodescope: ")
        reason = f"nodescope: the prolog gate stopped job {job.job_id}: {why}"[:200]
    memory: dict[str, Any] = {}
    if window is not None:
        memory = {
            "peak_bytes": window.peak_memory,
            "limit_bytes": window.memory_limit,
            "oom_kills": window.oom_kills,
        }
    return {
        "format": REPORT_FORMAT,
        "job_id": job.job_id,
        "user": job.user or registration.get("user"),
        "uid": job.uid if job.uid is not None else registration.get("uid"),
        "partition": job.partition or registration.get("partition"),
        "gpus": gpus,
        "gpu_source": "SLURM_JOB_GPUS"
        if gpus
        else (window.gpu_source if window is not None else "none"),
        "exit_code": job.exit_code,
        "start": start,
        "end": end_wall,
        "duration_seconds": None if start is None else end_wall - start,
        "daemon": daemon,
        "registered": bool(registration),
        "deltas": deltas,
        "memory": memory,
        "findings": list(findings),
        "alerts": list(alerts),
        "contention": list(contention),
        "gpu_holders": list(holders),
        "gate": None if gate_stop is None else gate_stop.as_dict(),
        "actions": list(actions),
        "timeline": window.timeline() if window is not None else {"t": [], "series": {}},
        # The job's collective figures from its traces in the spool, when it dropped any.
        "collectives": window.collectives if window is not None else None,
        "verdict": {"ok": reason is None, "reason": reason},
        "issued_at": end_wall if issued_at is None else issued_at,
    }


def collective_figures(job: JobCollectives) -> dict[str, Any]:
    """A job's collective figures as its report holds them."""
    return {
        "analysed_at": job.analysed_at,
        "files": job.files,
        "failed_files": job.failed,
        "ranks": list(job.ranks),
        "max_skew": job.max_skew,
        "straggler": job.straggler,
        "max_wait_seconds": job.max_wait_seconds,
        "kinds": [
            {
                "kind": k.kind,
                "skew": k.skew,
                "straggler": k.straggler,
                "max_wait_seconds": k.max_wait_seconds,
            }
            for k in job.kinds
        ],
    }


@dataclass
class JobWindow:
    """What the daemon saw of one job while it ran."""

    job_id: str
    first_seen: float
    last_seen: float
    gpus: tuple[int, ...] = ()
    gpu_source: str = "none"
    peak_memory: int | None = None
    memory_limit: int | None = None
    oom_kills: int = 0
    times: list[float] = field(default_factory=list)
    series: dict[str, list[float | None]] = field(default_factory=dict)
    #: The latest analysis of the job's traces (:func:`collective_figures`), if any.
    collectives: dict[str, Any] | None = None

    def add_sample(self, t: float, values: Mapping[str, float | None]) -> None:
        self.times.append(t)
        for name in set(self.series) | set(values):
            column = self.series.setdefault(name, [None] * (len(self.times) - 1))
            column.append(values.get(name))
        if len(self.times) > MAX_SAMPLES:
            # Halve the resolution rather than forget the start of a long job.
            self.times = self.times[::2]
            self.series = {k: v[::2] for k, v in self.series.items()}

    def timeline(self) -> dict[str, Any]:
        return {"t": list(self.times), "series": {k: list(v) for k, v in self.series.items()}}
