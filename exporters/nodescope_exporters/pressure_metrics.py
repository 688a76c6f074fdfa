"""Metrics of the ``pressure`` source: the node's pressure stall information.

Named as node_exporter's pressure collector names them, with the ``nodescope_`` prefix, and
with its meaning: ``waiting`` is the ``some`` line's total (some task waited for the
resource), ``stalled`` the ``full`` line's (no task could make progress on it); microseconds
are exported as seconds. CPU has no ``stalled`` counter: the kernel defines CPU ``full`` only
for cgroups and prints zeros for the node. A kernel without PSI exports none of them (the
source stays up). Stall fractions are ``rate()`` of these counters.
"""

from __future__ import annotations

from collections.abc import Iterator

from nodescope.model.cgroup import PressureLine
from nodescope.model.pressure import PRESSURE, NodePressure
from nodescope.model.snapshot import Snapshot
from nodescope_exporters.catalog import Metric, MetricSpec, metric

AREA = "pressure"
#: Built from the pressure source's samples only.
INPUTS = (PRESSURE,)

_USEC_PER_SECOND = 1e6


def _counter(name: str, help: str) -> MetricSpec:
    return metric(name, "counter", help, area=AREA)


#: (metric, resource, line: ``some`` or ``full``)
SERIES: tuple[tuple[MetricSpec, str, str], ...] = (
    (
        _counter(
            "nodescope_pressure_cpu_waiting_seconds_total",
            "Time in seconds at least one runnable task waited for a CPU (PSI cpu some).",
        ),
        "cpu",
        "some",
    ),
    (
        _counter(
            "nodescope_pressure_memory_waiting_seconds_total",
            "Time in seconds at least one task stalled on memory: reclaim, refaults, swap-in"
            " (PSI memory some).",
        ),
        "memory",
        "some",
    ),
    (
        _counter(
            "nodescope_pressure_memory_stalled_seconds_total",
            "Time in seconds every non-idle task stalled on memory at once: no progress"
            " (PSI memory full).",
        ),
        "memory",
        "full",
    ),
    (
        _counter(
            "nodescope_pressure_io_waiting_seconds_total",
            "Time in seconds at least one task waited for IO (PSI io some).",
        ),
        "io",
        "some",
    ),
    (
        _counter(
            "nodescope_pressure_io_stalled_seconds_total",
            "Time in seconds every non-idle task waited for IO at once: no progress (PSI io full).",
        ),
        "io",
        "full",
    ),
)


def _line(data: NodePressure, resource: str, kind: str) -> PressureLine | None:
    pressure = data.of(resource)
    if pressure is None:
        return None
    return pressure.some if kind == "some" else pressure.full


def families(snapshot: Snapshot) -> Iterator[Metric]:
    data = snapshot.latest(PRESSURE)
    if data is None:
        return
    for spec, resource, kind in SERIES:
        line = _line(data, resource, kind)
        if line is not None:
            family = spec.family()
            family.add_metric([], line.total_usec / _USEC_PER_SECOND)
            yield family
