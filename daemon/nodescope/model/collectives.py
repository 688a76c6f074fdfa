"""The ``traces`` source's records: per job, the collective figures the analysis of the trace
files the job dropped in the spool directory gave (``sources/traces.py``,
``docs/collectives.md`` "Daemon").

The figures come from :mod:`nodescope.collectives` (``Analysis.summary()``), copied into these
records so that the detectors and the exporters read them without importing the analysis.
Kinds are the fixed set the analysis names (:data:`KINDS`), so a label ``kind`` has at most
that many values whatever the files hold; ranks are numbers, never labels.
"""

from __future__ import annotations

from dataclasses import dataclass

from nodescope.model.skips import NOTHING_SKIPPED, Skipped
from nodescope.model.source_key import SourceKey

#: Every collective kind the analysis names (``nodescope.collectives.model.KIND_NAMES``'s
#: values; a unit test holds the two equal).
KINDS = frozenset(
    {
        "all_gather",
        "all_reduce",
        "all_to_all",
        "barrier",
        "broadcast",
        "gather",
        "reduce",
        "reduce_scatter",
        "scatter",
    }
)


@dataclass(frozen=True, slots=True)
class SpoolSettings:
    """What ``[sources.traces]`` configures (checked by ``nodescope.config``): the spool
    directory and the bounds of one scan and of the analysis queue."""

    spool_dir: str
    max_file_bytes: int = 16 << 20
    max_files_per_job: int = 64
    max_jobs: int = 16
    queue_size: int = 8
    #: The parser process's budget for one job (``sources/traces.py``, ``Budget``).
    max_objects_per_job: int = 2_000_000
    max_records_per_job: int = 250_000
    parser_memory_bytes: int = 160 << 20
    parser_cpu_seconds: int = 60
    #: Files the record of refused files holds (``sources/trace_refusals.py``).
    max_refused_files: int = 1024


@dataclass(frozen=True, slots=True)
class KindFigures:
    """One collective kind of one job: δ (``None``: not a kind whose send volume may differ,
    or too little to say), the rank that made the others wait longest, and the longest single
    wait."""

    kind: str
    skew: float | None
    straggler: int | None
    max_wait_seconds: float


@dataclass(frozen=True, slots=True)
class JobCollectives:
    """What one job's trace files gave when last analysed.

    ``files`` were analysed together (one per rank), ``failed`` of them could not be read or
    parsed (the analysis reported an error or raised); ``ranks`` the ranks found.
    ``analysed_at`` is the Unix time of the analysis."""

    job_id: str
    files: int
    failed: int
    ranks: tuple[int, ...]
    kinds: tuple[KindFigures, ...]
    max_skew: float | None
    straggler: int | None
    max_wait_seconds: float
    analysed_at: float

    def kind(self, name: str) -> KindFigures | None:
        return next((k for k in self.kinds if k.kind == name), None)


@dataclass(frozen=True, slots=True)
class TracesData:
    """One run of the ``traces`` source: the latest results of the jobs on the node,
    the files analysed and failed since the daemon started, the jobs whose analysis is still
    queued or running, and what this run (and the worker since the last run) skipped."""

    spool_dir: str
    jobs: tuple[JobCollectives, ...]
    files_analysed_total: int
    files_failed_total: int
    pending_jobs: int
    skipped: Skipped = NOTHING_SKIPPED

    def job(self, job_id: str) -> JobCollectives | None:
        return next((j for j in self.jobs if j.job_id == job_id), None)


#: The ``traces`` source's records.
TRACES = SourceKey("traces", TracesData)
