"""Metrics of the ``disks`` source: the raw /proc/diskstats counters of every whole disk and the
NVMe namespace → controller → PCI function mapping.

Names follow node_exporter's diskstats collector with the ``nodescope_`` prefix; sectors are
exported as bytes (512 per sector, ``include/linux/blk_types.h``) and milliseconds as seconds.
The millisecond counters wrap at 2^32 ms in the kernel; Prometheus reads that as a counter reset.
Rates (the ``iostat -dxm`` columns) are left to PromQL: ``rate()`` of these counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from nodescope.model.disks import DISKS, DisksData, DiskStat
from nodescope.model.snapshot import Snapshot
from nodescope_exporters.catalog import Metric, MetricSpec, metric

AREA = "disks"
_DEVICE = ("device",)


def _counter(name: str, help: str) -> MetricSpec:
    return metric(name, "counter", help, _DEVICE, area=AREA)


def _ms(value: int | None) -> float | None:
    return None if value is None else value / 1000.0


#: (metric, value of one disk or None when the kernel does not report it)
_DISK_SERIES: tuple[tuple[MetricSpec, Callable[[DiskStat], float | None]], ...] = (
    (
        _counter("nodescope_disk_reads_completed_total", "Reads completed successfully."),
        lambda s: s.reads_completed,
    ),
    (
        _counter("nodescope_disk_reads_merged_total", "Adjacent reads merged into one request."),
        lambda s: s.reads_merged,
    ),
    (
        _counter("nodescope_disk_read_bytes_total", "Bytes read (512-byte sectors)."),
        lambda s: s.bytes_read,
    ),
    (
        _counter("nodescope_disk_read_time_seconds_total", "Time spent by all reads."),
        lambda s: _ms(s.read_ms),
    ),
    (
        _counter("nodescope_disk_writes_completed_total", "Writes completed successfully."),
        lambda s: s.writes_completed,
    ),
    (
        _counter("nodescope_disk_writes_merged_total", "Adjacent writes merged into one request."),
        lambda s: s.writes_merged,
    ),
    (
        _counter("nodescope_disk_written_bytes_total", "Bytes written (512-byte sectors)."),
        lambda s: s.bytes_written,
    ),
    (
        _counter("nodescope_disk_write_time_seconds_total", "Time spent by all writes."),
        lambda s: _ms(s.write_ms),
    ),
    (
        metric(
            "nodescope_disk_io_in_flight_requests",
            "gauge",
            "Requests issued to the device driver and not yet completed.",
            _DEVICE,
            area=AREA,
        ),
        lambda s: s.in_flight,
    ),
    (
        _counter(
            "nodescope_disk_io_time_seconds_total",
            "Time the device had requests in flight (the basis of iostat's %util).",
        ),
        lambda s: _ms(s.io_ms),
    ),
    (
        _counter(
            "nodescope_disk_io_time_weighted_seconds_total",
            "Sum of the time of every request (the basis of iostat's aqu-sz).",
        ),
        lambda s: _ms(s.weighted_io_ms),
    ),
    (
        _counter("nodescope_disk_discards_completed_total", "Discards completed successfully."),
        lambda s: s.discards_completed,
    ),
    (
        _counter("nodescope_disk_discards_merged_total", "Adjacent discards merged."),
        lambda s: s.discards_merged,
    ),
    (
        _counter("nodescope_disk_discarded_bytes_total", "Bytes discarded (512-byte sectors)."),
        lambda s: s.bytes_discarded,
    ),
    (
        _counter("nodescope_disk_discard_time_seconds_total", "Time spent by all discards."),
        lambda s: _ms(s.discard_ms),
    ),
    (
        _counter("nodescope_disk_flush_requests_total", "Flush requests completed."),
        lambda s: s.flushes_completed,
    ),
    (
        _counter("nodescope_disk_flush_requests_time_seconds_total", "Time spent by all flushes."),
        lambda s: _ms(s.flush_ms),
    ),
)

DISK_INFO = metric(
    "nodescope_disk_info",
    "info",
    "An NVMe disk and a controller it is reached through, with the controller's PCI function "
    "(empty for fabrics); one series per path under native multipath.",
    ("device", "pci_address", "controller"),
    area=AREA,
)


def _disk_families(data: DisksData) -> Iterator[Metric]:
    for spec, value_of in _DISK_SERIES:
        family = spec.family()
        filled = False
        for stat in data.disks:
            value = value_of(stat)
            if value is None:
                continue
            family.add_metric([stat.name], float(value))
            filled = True
        if filled:
            yield family


def _info_family(data: DisksData) -> Iterator[Metric]:
    if not data.nvme:
        return
    family = DISK_INFO.family()
    for ns in data.nvme:
        for path in ns.paths:
            family.add_metric([ns.disk, path.pci_address or "", path.controller], 1.0)
    yield family


def families(snapshot: Snapshot) -> Iterable[Metric]:
    data = snapshot.latest(DISKS)
    if data is None:
        return
    yield from _disk_families(data)
    yield from _info_family(data)
