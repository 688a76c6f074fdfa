"""Metrics of the cgroup source (cgroup v2).

Per-cgroup series are exported only down to :data:`EXPORT_MAX_DEPTH` levels below the v2 root
(``/``, ``/system.slice``, ``/system.slice/slurmstepd.scope``): job and step cgroups come and
go by the thousand, and a label per job would grow the series count without bound. Jobs get
their own metrics, joined through info metrics.

Units follow the files: bytes stay bytes, PSI ``total`` and ``cpu.stat`` microseconds become
seconds. Absent files and unlimited limits give no series.
"""

from __future__ import annotations

from collections.abc import Iterable

from nodescope.model.cgroup import CGROUPS, Cgroup, Pressure
from nodescope.model.snapshot import Snapshot
from nodescope_exporters.catalog import Metric, metric

AREA = "cgroup"
#: Built from the ``cgroups`` source alone: reused while it has not run again (every 5 s).
INPUTS = (CGROUPS,)

#: The deepest level below the v2 root that gets per-cgroup series.
EXPORT_MAX_DEPTH = 2

_USEC = 1e-6

HIERARCHY = metric(
    "nodescope_cgroup_hierarchy_info",
    "info",
    "Where the cgroup v2 hierarchy was found: unified (the cgroupfs root), hybrid "
    "(<cgroupfs>/unified beside v1 hierarchies) or none.",
    ("mode",),
    area=AREA,
)
COUNT = metric(
    "nodescope_cgroup_walk_cgroups",
    "gauge",
    "Number of cgroup v2 cgroups read in the last walk (the root included).",
    area=AREA,
)
TRUNCATED = metric(
    "nodescope_cgroup_walk_truncated",
    "gauge",
    "1 when the last walk left cgroups unread: reason=count (the max_cgroups limit) or "
    "reason=depth (cgroups below max_depth).",
    ("reason",),
    area=AREA,
)
MEMORY_CURRENT = metric(
    "nodescope_cgroup_memory_current_bytes",
    "gauge",
    "Memory used by the cgroup and its descendants (memory.current).",
    ("cgroup",),
    area=AREA,
)
MEMORY_MAX = metric(
    "nodescope_cgroup_memory_max_bytes",
    "gauge",
    "Hard memory limit (memory.max); no series when unlimited.",
    ("cgroup",),
    area=AREA,
)
MEMORY_HIGH = metric(
    "nodescope_cgroup_memory_high_bytes",
    "gauge",
    "Memory throttling limit (memory.high); no series when unlimited.",
    ("cgroup",),
    area=AREA,
)
MEMORY_EVENTS = metric(
    "nodescope_cgroup_memory_events_total",
    "counter",
    "Memory events of the cgroup and its descendants by event (memory.events: low, high, "
    "max, oom, oom_kill, oom_group_kill).",
    ("cgroup", "event"),
    area=AREA,
)
PRESSURE = metric(
    "nodescope_cgroup_pressure_stall_seconds_total",
    "counter",
    "Time tasks of the cgroup stalled on a resource (PSI total): kind=some (at least one "
    "task) or kind=full (all non-idle tasks at once).",
    ("cgroup", "resource", "kind"),
    area=AREA,
)
CPU_USAGE = metric(
    "nodescope_cgroup_cpu_usage_seconds_total",
    "counter",
    "CPU time used by the cgroup and its descendants (cpu.stat usage_usec).",
    ("cgroup",),
    area=AREA,
)
IO_BYTES = metric(
    "nodescope_cgroup_io_bytes_total",
    "counter",
    "Bytes transferred by the cgroup and its descendants per block device (MAJ:MIN) and "
    "direction (io.stat rbytes, wbytes).",
    ("cgroup", "device", "direction"),
    area=AREA,
)
PIDS_CURRENT = metric(
    "nodescope_cgroup_pids_current",
    "gauge",
    "Tasks in the cgroup and its descendants (pids.current).",
    ("cgroup",),
    area=AREA,
)


def _pressures(cgroup: Cgroup) -> Iterable[tuple[str, Pressure]]:
    for resource, pressure in (
        ("cpu", cgroup.cpu_pressure),
        ("memory", cgroup.memory_pressure),
        ("io", cgroup.io_pressure),
        ("irq", cgroup.irq_pressure),
    ):
        if pressure is not None:
            yield resource, pressure


def families(snapshot: Snapshot) -> Iterable[Metric]:
    tree = snapshot.latest(CGROUPS)
    if tree is None:
        return []
    hierarchy = HIERARCHY.family()
    hierarchy.add_metric([tree.mode], 1)
    if tree.mode == "none":
        return [hierarchy]

    count = COUNT.family()
    count.add_metric([], len(tree.cgroups))
    truncated = TRUNCATED.family()
    truncated.add_metric(["count"], int(tree.truncated))
    truncated.add_metric(["depth"], int(tree.depth_limited))

    memory_current = MEMORY_CURRENT.family()
    memory_max = MEMORY_MAX.family()
    memory_high = MEMORY_HIGH.family()
    memory_events = MEMORY_EVENTS.family()
    pressure = PRESSURE.family()
    cpu_usage = CPU_USAGE.family()
    io_bytes = IO_BYTES.family()
    pids_current = PIDS_CURRENT.family()

    for cgroup in tree.cgroups:
        if cgroup.depth > EXPORT_MAX_DEPTH:
            continue
        label = cgroup.path
        if cgroup.memory_current is not None:
            memory_current.add_metric([label], cgroup.memory_current)
        if cgroup.memory_max is not None and cgroup.memory_max.value is not None:
            memory_max.add_metric([label], cgroup.memory_max.value)
        if cgroup.memory_high is not None and cgroup.memory_high.value is not None:
            memory_high.add_metric([label], cgroup.memory_high.value)
        if cgroup.memory_events is not None:
            for event, value in cgroup.memory_events.items():
                memory_events.add_metric([label, event], value)
        for resource, stall in _pressures(cgroup):
            for kind, line in (("some", stall.some), ("full", stall.full)):
                if line is not None:
                    pressure.add_metric([label, resource, kind], line.total_usec * _USEC)
        if cgroup.cpu_stat is not None and cgroup.cpu_stat.usage_usec is not None:
            cpu_usage.add_metric([label], cgroup.cpu_stat.usage_usec * _USEC)
        if cgroup.io_stat is not None:
            for device in cgroup.io_stat.devices:
                for direction, nbytes in (("read", device.rbytes), ("write", device.wbytes)):
                    if nbytes is not None:
                        io_bytes.add_metric([label, device.device, direction], nbytes)
        if cgroup.pids_current is not None:
            pids_current.add_metric([label], cgroup.pids_current)

    built = [
        hierarchy,
        count,
        truncated,
        memory_current,
        memory_max,
        memory_high,
        memory_events,
        pressure,
        cpu_usage,
        io_bytes,
        pids_current,
    ]
    # A family with no samples would still print HELP/TYPE for data this node does not have.
    return [family for family in built if family.samples]
