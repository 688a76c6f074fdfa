"""The collective layer: per-rank PyTorch traces (profiler files, flight recorder dumps) in,
per-kind and per-rank bytes, waits, AllToAll skew δ and straggler ranks out.

Pure and free of torch: :func:`analyze_files` reads the files (bounded: a size cap per file,
an event cap, bad records skipped and counted) and returns an :class:`Analysis` of frozen
dataclasses; :meth:`Analysis.summary` gives the per-job figures a report or a metric needs.
"""

from nodescope.collectives.analysis import analyze, analyze_files, parse_bytes, read_file
from nodescope.collectives.model import (
    Analysis,
    CallRecord,
    Destination,
    FileReport,
    Instance,
    JobSummary,
    KindReport,
    KindSummary,
    Limits,
    ParsedFile,
    RankFigures,
)

__all__ = [
    "Analysis",
    "CallRecord",
    "Destination",
    "FileReport",
    "Instance",
    "JobSummary",
    "KindReport",
    "KindSummary",
    "Limits",
    "ParsedFile",
    "RankFigures",
    "analyze",
    "analyze_files",
    "parse_bytes",
    "read_file",
]
