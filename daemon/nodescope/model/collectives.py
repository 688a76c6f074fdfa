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
from typing import Any

from nodescope.model.skips import NOTHING_SKIPPED, Skipped
from nodescope.model.source_key import SourceKey
from nodescope.options import Range, option

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


def _spool_dir(value: Any) -> str | None:
    """Empty (the source does not run) or an absolute path without ``.``/``..`` parts: the
    daemon trusts the spool directory itself, so it must be the one the operator named."""
    if value == "":
        return None
    if not value.startswith("/") or any(p in (".", "..") for p in value.split("/")):
        return "must be empty or an absolute path without . or .. components"
    return None


@dataclass(frozen=True, slots=True)
class SpoolSettings:
    """What ``[sources.traces]`` configures beyond the common keys, declared here once: the
    spool directory (empty: the source does not run) and the bounds of one scan, of the
    analysis queue and of the parser process's budget for one job (``sources/traces.py``,
    ``Budget``; the record of refused files, ``sources/trace_refusals.py``)."""

    spool_dir: str = option(
        "",
        "directory where jobs drop PyTorch traces, one <job id>/ directory per job (mode 1733,"
        " owned by root); empty: the source does not run",
        _spool_dir,
    )
    max_file_bytes: int = option(
        16 << 20,
        "a trace file larger than this is skipped (reason too_large), gzip files also once"
        " decompressed, bytes; what decoding may build is bounded by max_objects_per_job",
        Range(1024, 1 << 30, integer=True),
    )
    max_files_per_job: int = option(
        64,
        "files of one job analysed together (one per rank); the rest are skipped",
        Range(1, 4096, integer=True),
    )
    max_jobs: int = option(
        16, "jobs whose directories one scan looks at", Range(1, 1024, integer=True)
    )
    queue_size: int = option(
        8,
        "jobs waiting for the analysis worker; a job that finds it full is offered again on"
        " the next run",
        Range(1, 1024, integer=True),
    )
    max_objects_per_job: int = option(
        2_000_000,
        "objects the parser process may decode from one job's files, counted from their"
        " bytes before decoding (JSON values and keys, pickled objects and memo references);"
        " a file over what the job has left is refused (reason over_budget) and never read"
        " again",
        Range(1000, 100_000_000, integer=True),
    )
    max_records_per_job: int = option(
        250_000,
        "collective call records the parser process may keep for one job; a file past what"
        " the job has left is refused (reason over_budget) and never read again",
        Range(1000, 100_000_000, integer=True),
    )
    parser_memory_bytes: int = option(
        160 << 20,
        "address space of the parser process (RLIMIT_AS), bytes: its last line; with the"
        " daemon it must fit in the unit's MemoryMax (256M)",
        Range(64 << 20, 64 << 30, integer=True),
    )
    parser_cpu_seconds: int = option(
        60,
        "CPU time of the parser process for one job (RLIMIT_CPU); a parser that reaches it is"
        " killed and the file it was reading never read again (reason parser_killed)",
        Range(1, 3600, integer=True),
    )
    max_refused_files: int = option(
        1024,
        "files the record of refused files (<run>/nodescope/trace-refusals.json) holds; the"
        " oldest are forgotten first",
        Range(1, 100_000, integer=True),
    )


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
