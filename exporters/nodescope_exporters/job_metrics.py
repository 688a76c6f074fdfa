"""Metrics of the job registry (:mod:`nodescope.model.jobs`: the ``jobs`` source, the prolog's
registrations and NVML's compute processes).

Per-job series carry only ``job_id`` (and a bounded second label: a resource, an event, a
device); who the job belongs to and which GPUs it has come once, in ``nodescope_job_info`` and
``nodescope_job_gpu_info``, for joins (``* on(job_id) group_left(user) nodescope_job_info``).
Built from the latest snapshot only, so a finished job's series disappear with its cgroup and
registration. Units follow the cgroup files: bytes stay bytes, PSI ``total`` and CPU usage
become seconds; absent files and unlimited limits give no series.
"""

from __future__ import annotations

from collections.abc import Iterable

from nodescope.model.snapshot import Snapshot
from nodescope_exporters.catalog import Metric, metric

AREA = "jobs"

_USEC = 1e-6

INFO = metric(
    "nodescope_job_info",
    "info",
    "A Slurm job on the node: its user, partition, cgroup layout (v2, v2-sluid, v1, or"
    " empty before its cgroup exists), whether the prolog registered it, and where its GPUs"
    " were learnt (registration, environ, device cgroup, processes, none).",
    ("job_id", "user", "partition", "layout", "registered", "gpu_source"),
    area=AREA,
)
GPU_INFO = metric(
    "nodescope_job_gpu_info",
    "info",
    "A GPU (NVML index) allocated to a job, for joins with per-GPU series.",
    ("job_id", "gpu"),
    area=AREA,
)
MEMORY_CURRENT = metric(
    "nodescope_job_memory_current_bytes",
    "gauge",
    "Memory used by the job's cgroup and its descendants (memory.current; v1"
    " memory.usage_in_bytes).",
    ("job_id",),
    area=AREA,
)
MEMORY_PEAK = metric(
    "nodescope_job_memory_peak_bytes",
    "gauge",
    "Peak memory of the job's cgroup (memory.peak; v1 memory.max_usage_in_bytes).",
    ("job_id",),
    area=AREA,
)
MEMORY_MAX = metric(
    "nodescope_job_memory_max_bytes",
    "gauge",
    "Hard memory limit of the job's cgroup itself (memory.max; v1 memory.limit_in_bytes); no"
    " series when unlimited.",
    ("job_id",),
    area=AREA,
)
MEMORY_REQUESTED = metric(
    "nodescope_job_memory_requested_bytes",
    "gauge",
    "The tightest memory.max anywhere in the job's subtree (steps included): the memory the"
    " job asked for; no series when no cgroup of the job is limited.",
    ("job_id",),
    area=AREA,
)
MEMORY_HIGH = metric(
    "nodescope_job_memory_high_bytes",
    "gauge",
    "Memory throttling limit of the job's cgroup (memory.high); no series when unlimited.",
    ("job_id",),
    area=AREA,
)
MEMORY_EVENTS = metric(
    "nodescope_job_memory_events_total",
    "counter",
    "Memory events of the job's cgroup and its descendants (memory.events: low, high, max,"
    " oom, oom_kill, oom_group_kill; v1: max = memory.failcnt, oom_kill from"
    " memory.oom_control).",
    ("job_id", "event"),
    area=AREA,
)
PRESSURE = metric(
    "nodescope_job_pressure_stall_seconds_total",
    "counter",
    "Time the job's tasks stalled on a resource (PSI total of cpu, memory, io): kind=some (at"
    " least one task) or kind=full (all non-idle tasks at once).",
    ("job_id", "resource", "kind"),
    area=AREA,
)
IO_BYTES = metric(
    "nodescope_job_io_bytes_total",
    "counter",
    "Bytes the job transferred per block device (MAJ:MIN) and direction (io.stat rbytes, wbytes).",
    ("job_id", "device", "direction"),
    area=AREA,
)
CPU_USAGE = metric(
    "nodescope_job_cpu_usage_seconds_total",
    "counter",
    "CPU time used by the job (cpu.stat usage_usec; v1 cpuacct.usage).",
    ("job_id",),
    area=AREA,
)
PIDS_CURRENT = metric(
    "nodescope_job_pids_current",
    "gauge",
    "Tasks (threads) in the job's cgroups (pids.current).",
    ("job_id",),
    area=AREA,
)
ESCAPED_PROCESSES = metric(
    "nodescope_job_escaped_processes",
    "gauge",
    "Compute processes on the job's GPUs that sit outside the job's cgroups.",
    ("job_id",),
    area=AREA,
)
ESCAPED_THREADS = metric(
    "nodescope_job_escaped_threads",
    "gauge",
    "Threads of the job's processes placed in cgroups outside the job.",
    ("job_id",),
    area=AREA,
)


def families(snapshot: Snapshot) -> Iterable[Metric]:
    jobs = snapshot.derived.jobs
    if not jobs:
        return []
    info = INFO.family()
    gpu_info = GPU_INFO.family()
    memory_current = MEMORY_CURRENT.family()
    memory_peak = MEMORY_PEAK.family()
    memory_max = MEMORY_MAX.family()
    memory_requested = MEMORY_REQUESTED.family()
    memory_high = MEMORY_HIGH.family()
    memory_events = MEMORY_EVENTS.family()
    pressure = PRESSURE.family()
    io_bytes = IO_BYTES.family()
    cpu_usage = CPU_USAGE.family()
    pids_current = PIDS_CURRENT.family()
    escaped_processes = ESCAPED_PROCESSES.family()
    escaped_threads = ESCAPED_THREADS.family()
    for job in jobs:
        jid = job.job_id
        info.add_metric(
            [
                jid,
                job.user or "",
                job.partition or "",
                job.layout or "",
                "true" if job.registered else "false",
                job.gpu_source,
            ],
            1,
        )
        for gpu in job.gpus:
            gpu_info.add_metric([jid, str(gpu)], 1)
        if job.memory_limit_bytes is not None:
            memory_requested.add_metric([jid], job.memory_limit_bytes)
        if job.running:
            escaped_processes.add_metric([jid], len(job.escaped_processes))
            escaped_threads.add_metric([jid], len(job.escaped_threads))
        stats = job.stats
        if stats is None:
            continue
        if stats.memory_current is not None:
            memory_current.add_metric([jid], stats.memory_current)
        if stats.memory_peak is not None:
            memory_peak.add_metric([jid], stats.memory_peak)
        if stats.memory_max is not None and stats.memory_max.value is not None:
            memory_max.add_metric([jid], stats.memory_max.value)
        if stats.memory_high is not None and stats.memory_high.value is not None:
            memory_high.add_metric([jid], stats.memory_high.value)
        if stats.memory_events is not None:
            for event, count in stats.memory_events.items():
                memory_events.add_metric([jid, event], count)
        for resource, psi in (
            ("cpu", stats.cpu_pressure),
            ("memory", stats.memory_pressure),
            ("io", stats.io_pressure),
        ):
            if psi is None:
                continue
            for kind, line in (("some", psi.some), ("full", psi.full)):
                if line is not None:
                    pressure.add_metric([jid, resource, kind], line.total_usec * _USEC)
        if stats.io_stat is not None:
            for device in stats.io_stat.devices:
                if device.rbytes is not None:
                    io_bytes.add_metric([jid, device.device, "read"], device.rbytes)
                if device.wbytes is not None:
                    io_bytes.add_metric([jid, device.device, "write"], device.wbytes)
        if stats.cpu_stat is not None and stats.cpu_stat.usage_usec is not None:
            cpu_usage.add_metric([jid], stats.cpu_stat.usage_usec * _USEC)
        if stats.pids_current is not None:
            pids_current.add_metric([jid], stats.pids_current)
    return [
        info,
        gpu_info,
        memory_current,
        memory_peak,
        memory_max,
        memory_requested,
        memory_high,
        memory_events,
        pressure,
        io_bytes,
        cpu_usage,
        pids_current,
        escaped_processes,
        escaped_threads,
    ]
