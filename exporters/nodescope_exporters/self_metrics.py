"""The daemon's own metrics: build, cycles, the health of every source, and what its
processes cost the node.

Like node_exporter's ``*_scrape_collector_success``: a source that fails shows
``nodescope_source_up{source} 0`` and counts an error, while the other sources' series go on.

The process figures carry the names Prometheus's process collector gives them
(``process_cpu_seconds_total``, ``process_resident_memory_bytes``, ...), with a ``process``
label: ``daemon`` for the process that collects and renders, ``serving`` for the one that
answers scrapes. One family per figure rather than a second set of names for the serving
process, so ``sum without (process)`` is what nodescope as a whole costs, the figure to hold
against another agent's ``process_*``. The daemon measures them
(:mod:`nodescope.selfstats`) and hands them over in ``Snapshot.processes``; only the daemon
does, so renderings of fixtures and replays have none of these families.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator, Sequence

from nodescope import __version__
from nodescope.model.process import PSS_EVERY_SECONDS, ProcessFigures
from nodescope.model.snapshot import Snapshot
from nodescope_exporters.catalog import Metric, MetricSpec, metric

AREA = "self"

BUILD_INFO = metric(
    "nodescope_build_info",
    "info",
    "nodescope version and the Python that runs it; value 1",
    ("version", "python"),
    area=AREA,
)
CYCLES = metric("nodescope_cycles_total", "counter", "collection cycles completed", area=AREA)
CYCLE_DURATION = metric(
    "nodescope_cycle_duration_seconds",
    "gauge",
    "wall time of the last collection cycle",
    area=AREA,
)
LAST_CYCLE = metric(
    "nodescope_last_cycle_timestamp_seconds",
    "gauge",
    "Unix time at the end of the last collection cycle",
    area=AREA,
)
SOURCE_UP = metric(
    "nodescope_source_up",
    "gauge",
    "1 if the source's last run succeeded, 0 if it failed",
    ("source",),
    area=AREA,
)
SOURCE_DURATION = metric(
    "nodescope_source_duration_seconds",
    "gauge",
    "wall time of the source's last run",
    ("source",),
    area=AREA,
)
SOURCE_RUNS = metric(
    "nodescope_source_runs_total", "counter", "runs of the source", ("source",), area=AREA
)
SOURCE_ERRORS = metric(
    "nodescope_source_errors_total",
    "counter",
    "runs of the source that failed",
    ("source",),
    area=AREA,
)
SOURCE_RECORDS_SKIPPED = metric(
    "nodescope_source_records_skipped_total",
    "counter",
    "malformed or unreadable records (a process, a cgroup, a port, a line) the source skipped",
    ("source", "reason"),
    area=AREA,
)
SOURCE_TIMEOUTS = metric(
    "nodescope_source_timeouts_total",
    "counter",
    "runs of the source reported down because they overran their deadline",
    ("source",),
    area=AREA,
)
CYCLE_ERRORS = metric(
    "nodescope_cycle_errors_total",
    "counter",
    "exceptions outside the sources that a collection cycle survived, by stage",
    ("stage",),
    area=AREA,
)
CONFIG_RELOADS = metric(
    "nodescope_config_reloads_total",
    "counter",
    "configuration reloads (SIGHUP) by result; a failed one keeps the previous configuration",
    ("result",),
    area=AREA,
)
PROCESS_LABELS = ("process",)
PROCESS_CPU = metric(
    "process_cpu_seconds_total",
    "counter",
    "user and system CPU time of the nodescope process (daemon or serving), children excluded",
    PROCESS_LABELS,
    area=AREA,
)
PROCESS_RESIDENT = metric(
    "process_resident_memory_bytes",
    "gauge",
    "resident memory of the nodescope process, the pages it shares with others counted whole",
    PROCESS_LABELS,
    area=AREA,
)
PROCESS_VIRTUAL = metric(
    "process_virtual_memory_bytes",
    "gauge",
    "virtual memory size of the nodescope process",
    PROCESS_LABELS,
    area=AREA,
)
PROCESS_PSS = metric(
    "nodescope_process_pss_bytes",
    "gauge",
    "proportional set size of the nodescope process (smaps_rollup: each shared page divided "
    f"among its sharers), read every {PSS_EVERY_SECONDS:g} s",
    PROCESS_LABELS,
    area=AREA,
)
PROCESS_OPEN_FDS = metric(
    "process_open_fds",
    "gauge",
    "open file descriptors of the nodescope process",
    PROCESS_LABELS,
    area=AREA,
)
PROCESS_MAX_FDS = metric(
    "process_max_fds",
    "gauge",
    "soft limit on open file descriptors of the nodescope process; no series when unlimited",
    PROCESS_LABELS,
    area=AREA,
)
PROCESS_THREADS = metric(
    "nodescope_process_threads",
    "gauge",
    "threads of the nodescope process",
    PROCESS_LABELS,
    area=AREA,
)
PROCESS_START_TIME = metric(
    "process_start_time_seconds",
    "gauge",
    "Unix time the nodescope process started",
    PROCESS_LABELS,
    area=AREA,
)
SOURCE_INTERVAL = metric(
    "nodescope_source_interval_seconds",
    "gauge",
    "configured seconds between runs of the source",
    ("source",),
    area=AREA,
)


def families(snapshot: Snapshot) -> Iterator[Metric]:
    build = BUILD_INFO.family()
    build.add_metric([__version__, platform.python_version()], 1)
    yield build
    cycles = CYCLES.family()
    cycles.add_metric([], snapshot.cycle)
    yield cycles
    duration = CYCLE_DURATION.family()
    duration.add_metric([], snapshot.cycle_duration)
    yield duration
    last = LAST_CYCLE.family()
    last.add_metric([], snapshot.wall_time)
    yield last

    up, took, runs, errors, interval = (
        SOURCE_UP.family(),
        SOURCE_DURATION.family(),
        SOURCE_RUNS.family(),
        SOURCE_ERRORS.family(),
        SOURCE_INTERVAL.family(),
    )
    for name in sorted(snapshot.status):
        status = snapshot.status[name]
        up.add_metric([name], 1 if status.up else 0)
        runs.add_metric([name], status.runs_total)
        errors.add_metric([name], status.errors_total)
        interval.add_metric([name], status.interval)
        sample = snapshot.current.get(name)
        if sample is not None:
            took.add_metric([name], sample.duration)
    yield from (up, took, runs, errors, interval)

    skipped, timeouts = SOURCE_RECORDS_SKIPPED.family(), SOURCE_TIMEOUTS.family()
    for name in sorted(snapshot.status):
        status = snapshot.status[name]
        timeouts.add_metric([name], status.timeouts_total)
        for reason in sorted(status.skipped_total):
            skipped.add_metric([name, reason], status.skipped_total[reason])
    yield skipped
    yield timeouts
    cycle_errors = CYCLE_ERRORS.family()
    for stage in sorted(snapshot.cycle_errors):
        cycle_errors.add_metric([stage], snapshot.cycle_errors[stage])
    yield cycle_errors
    # Only the daemon reloads: snapshots of replays and of `nodescope snapshot` have none.
    if snapshot.config_reloads:
        reloads = CONFIG_RELOADS.family()
        for result in sorted(snapshot.config_reloads):
            reloads.add_metric([result], snapshot.config_reloads[result])
        yield reloads
    if snapshot.processes:
        yield from process_families(snapshot.processes)


def process_families(processes: Sequence[ProcessFigures]) -> Iterator[Metric]:
    """One family per figure, a series per process; a figure the daemon could not read has
    no series rather than a made-up value."""
    figures: tuple[tuple[MetricSpec, Callable[[ProcessFigures], float | None]], ...] = (
        (PROCESS_CPU, lambda p: p.cpu_seconds),
        (PROCESS_RESIDENT, lambda p: p.resident_bytes),
        (PROCESS_VIRTUAL, lambda p: p.virtual_bytes),
        (PROCESS_PSS, lambda p: p.pss_bytes),
        (PROCESS_OPEN_FDS, lambda p: p.open_fds),
        (PROCESS_MAX_FDS, lambda p: p.max_fds),
        (PROCESS_THREADS, lambda p: p.threads),
        (PROCESS_START_TIME, lambda p: p.start_time_seconds),
    )
    for spec, figure in figures:
        family = spec.family()
        for process in processes:
            value = figure(process)
            if value is not None:
                family.add_metric([process.role], value)
        yield family
