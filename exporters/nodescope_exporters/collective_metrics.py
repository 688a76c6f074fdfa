"""Metrics of the ``traces`` source (:mod:`nodescope.model.collectives`): per job on the node,
the collective figures of the traces it dropped in the spool, and the source's file counters.

Labels are bounded: ``job_id`` (jobs on the node, at most ``[sources.traces] max_jobs``) and
``kind`` (the fixed set of kinds the analysis names). Rank numbers are values, never labels.
A job's series go with it: the source drops the results of a job that left the node.
"""

from __future__ import annotations

from collections.abc import Iterable

from nodescope.model.collectives import TRACES
from nodescope.model.snapshot import Snapshot
from nodescope_exporters.catalog import Metric, metric

AREA = "collectives"

#: Built from the ``traces`` samples alone, so reused while they are unchanged.
INPUTS = (TRACES,)

SKEW = metric(
    "nodescope_job_collective_skew",
    "gauge",
    "Send skew δ of a collective kind in the job's latest traces: population std/mean of the"
    " ranks' total send bytes (all-to-all only; no series where δ is undefined).",
    ("job_id", "kind"),
    area=AREA,
)
STRAGGLER_RANK = metric(
    "nodescope_job_collective_straggler_rank",
    "gauge",
    "The rank that kept the others of a collective kind waiting longest in total in the"
    " job's latest traces (no series when no rank arrived last with a wait).",
    ("job_id", "kind"),
    area=AREA,
)
MAX_WAIT = metric(
    "nodescope_job_collective_max_wait_seconds",
    "gauge",
    "The longest time a rank waited for the last rank in one collective of a kind in the"
    " job's latest traces.",
    ("job_id", "kind"),
    area=AREA,
)
RANKS = metric(
    "nodescope_job_collective_ranks",
    "gauge",
    "Ranks found in the trace files of the job's latest analysis.",
    ("job_id",),
    area=AREA,
)
ANALYSED_AT = metric(
    "nodescope_job_collective_analysed_timestamp_seconds",
    "gauge",
    "UNIX time of the job's latest trace analysis.",
    ("job_id",),
    area=AREA,
)
FILES_ANALYSED = metric(
    "nodescope_collective_trace_files_analysed_total",
    "counter",
    "Trace files read and parsed by the spool's analysis worker since the daemon started.",
    area=AREA,
)
FILES_FAILED = metric(
    "nodescope_collective_trace_files_failed_total",
    "counter",
    "Trace files the analysis could not use (not a trace, corrupt, a rank read twice, or the"
    " parser raised); files the spool checks refused are in"
    ' nodescope_source_records_skipped_total{source="traces"}.',
    area=AREA,
)
PENDING = metric(
    "nodescope_collective_trace_jobs_pending",
    "gauge",
    "Jobs queued for or in the analysis worker.",
    area=AREA,
)


def families(snapshot: Snapshot) -> Iterable[Metric]:
    data = snapshot.latest(TRACES)
    if data is None:
        return []
    skew = SKEW.family()
    straggler = STRAGGLER_RANK.family()
    max_wait = MAX_WAIT.family()
    ranks = RANKS.family()
    analysed_at = ANALYSED_AT.family()
    for job in data.jobs:
        ranks.add_metric([job.job_id], len(job.ranks))
        analysed_at.add_metric([job.job_id], job.analysed_at)
        for kind in job.kinds:
            labels = [job.job_id, kind.kind]
            if kind.skew is not None:
                skew.add_metric(labels, kind.skew)
            if kind.straggler is not None:
                straggler.add_metric(labels, kind.straggler)
            max_wait.add_metric(labels, kind.max_wait_seconds)
    files_analysed = FILES_ANALYSED.family()
    files_analysed.add_metric([], data.files_analysed_total)
    files_failed = FILES_FAILED.family()
    files_failed.add_metric([], data.files_failed_total)
    pending = PENDING.family()
    pending.add_metric([], data.pending_jobs)
    return [skew, straggler, max_wait, ranks, analysed_at, files_analysed, files_failed, pending]
