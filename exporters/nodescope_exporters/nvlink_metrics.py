"""Metrics of the ``nvlink_kmod`` source: NVLink counters sampled by the ``nvlink_counter``
kernel module (``/dev/nvlink_stats``, ABI in ``kmod/include/uapi/linux/nvlink_counter.h``).

Per link, only what the module alone knows: the stall-cycle counter (NVML has none) and the
per-sample maxima of the last window (the interval since the daemon's previous read), which
name the link that burst. Everything else is per ``device`` (the register map's device index),
summed over the device's links: the byte and error counters (NVML exports the same per link,
``nodescope_gpu_nvlink_*``), the capacity, the number of links read, the samples, and the
per-sample utilisation and stall-rate distributions as cumulative bucket counters with a
``below`` label (the bucket bound: promtool reserves ``le`` for histogram types). Averages
are rates of counters (Prometheus computes them); per-window shares of samples over the
module's thresholds are not exported: the bucket counters count every sample, where a gauge
of the last window would show a scrape one window in many.

Units: utilisation is a fraction of the link's capacity per direction (the larger of TX and
RX); stall rates are stall cycles per microsecond. Bucket bounds are the module's log2
buckets: a value lands in bucket b when it is below 2^b (in 1/65536 of capacity for
utilisation, in cycles per microsecond for stalls); ``below`` is that bound, rounded to 6 digits.
``nodescope_nvlink_data_source_info{source="kmod"}`` (the gpu area's, decided by
:func:`nodescope_exporters.gpu_metrics.nvlink_data_source`) says the module served the NVLink
figures.

Only the buckets between 1.6 % and 200 % utilisation and 64 and 16384 cycles/µs are exported
(plus ``+Inf``), which bounds the series to 19 per device and histogram.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import accumulate
from typing import TypeVar

from nodescope.model.nvlink_kmod import COUNTER_NAMES, NVLINK_KMOD, UTIL_ONE, NvlcRecords
from nodescope.model.snapshot import Snapshot
from nodescope_exporters.catalog import Metric, MetricSpec, metric

AREA = NVLINK_KMOD.name
T = TypeVar("T")
_LINK = ("device", "link")
_DEVICE = ("device",)
# The bucket bound is "below", not "le": these are counters per bucket, and promtool keeps
# "le" for histogram types.
_BUCKET = ("device", "below")

#: counters exported per link; the others are summed per device (NVML has them per link)
PER_LINK_COUNTERS = frozenset({"stall_cycles"})

#: exported log2 bucket indices (bucket b counts values below 2^b)
UTIL_BUCKETS = tuple(range(10, 18))  # 2^10/65536 = 1.6 % .. 2^17/65536 = 200 %
STALL_BUCKETS = tuple(range(6, 15))  # 64 .. 16384 cycles per microsecond

SOURCE_INFO = metric(
    "nodescope_nvlink_kmod_source_info",
    "info",
    "where the nvlink_counter module's snapshot came from: kind is device (the loaded "
    "module) or file (a snapshot file, e.g. the simulated node), source is the module's "
    "counter source (sim or mmio); value 1",
    ("kind", "source", "path"),
    area=AREA,
)
SERVED = metric(
    "nodescope_nvlink_kmod_serving",
    "gauge",
    "1 when the nvlink_counter module served per-link NVLink figures this cycle, 0 when it "
    "is absent and NVLink figures come from NVML alone",
    (),
    area=AREA,
)
PERIOD = metric(
    "nodescope_nvlink_kmod_sampling_period_seconds",
    "gauge",
    "the module's hrtimer sampling period",
    (),
    area=AREA,
)
SAMPLES = metric(
    "nodescope_nvlink_kmod_samples_total",
    "counter",
    "samples the module took since it was loaded",
    (),
    area=AREA,
)
MISSED = metric(
    "nodescope_nvlink_kmod_missed_periods_total",
    "counter",
    "sampling periods that passed without a sample (hrtimer overruns) since load",
    (),
    area=AREA,
)
CAPACITY = metric(
    "nodescope_nvlink_kmod_capacity_bytes_per_second",
    "gauge",
    "configured capacity per direction of the device's links, summed over them (divide by "
    "nodescope_nvlink_kmod_links for one link's)",
    _DEVICE,
    area=AREA,
)
LINKS = metric(
    "nodescope_nvlink_kmod_links",
    "gauge",
    "links of the device that the module reads (the register map's links)",
    _DEVICE,
    area=AREA,
)
GONE = metric(
    "nodescope_nvlink_kmod_device_gone",
    "gauge",
    "1 when a device holding counters of the device's links stopped answering (all-ones "
    "reads) or was removed; its counters are no longer read",
    _DEVICE,
    area=AREA,
)
LINK_SAMPLES = metric(
    "nodescope_nvlink_kmod_link_samples_total",
    "counter",
    "samples that read a link of the device since its source was configured, summed over "
    "the device's links (one per link per sample)",
    _DEVICE,
    area=AREA,
)
_COUNTER_HELP = {
    "tx_bytes": (
        "nodescope_nvlink_kmod_transmit_bytes_total",
        "bytes sent on the device's links, summed over them",
    ),
    "rx_bytes": (
        "nodescope_nvlink_kmod_receive_bytes_total",
        "bytes received on the device's links, summed over them",
    ),
    "stall_cycles": (
        "nodescope_nvlink_kmod_stall_cycles_total",
        "cycles the link stalled (arbitration/credit stall as the register map defines it)",
    ),
    "replay_errors": (
        "nodescope_nvlink_kmod_replay_errors_total",
        "data link replays on the device's links, summed over them",
    ),
    "crc_errors": (
        "nodescope_nvlink_kmod_crc_errors_total",
        "CRC errors on the device's links, summed over them",
    ),
}
#: (index in COUNTER_NAMES, per link?, spec); only links that have the counter are summed
COUNTERS: tuple[tuple[int, bool, MetricSpec], ...] = tuple(
    (
        i,
        n in PER_LINK_COUNTERS,
        metric(
            _COUNTER_HELP[n][0],
            "counter",
            _COUNTER_HELP[n][1],
            _LINK if n in PER_LINK_COUNTERS else _DEVICE,
            area=AREA,
        ),
    )
    for i, n in enumerate(COUNTER_NAMES)
)
WINDOW_MAX_UTIL = metric(
    "nodescope_nvlink_kmod_window_max_utilisation_ratio",
    "gauge",
    "largest per-sample utilisation (fraction of capacity, max of TX and RX) in the last window",
    _LINK,
    area=AREA,
)
WINDOW_MAX_STALL = metric(
    "nodescope_nvlink_kmod_window_max_stall_cycles_per_microsecond",
    "gauge",
    "largest per-sample stall rate in the last window",
    _LINK,
    area=AREA,
)
UTIL_HIST = metric(
    "nodescope_nvlink_kmod_utilisation_samples_total",
    "counter",
    "link samples whose utilisation (fraction of capacity) was below the bound, since the "
    "source was configured, summed over the device's links",
    _BUCKET,
    area=AREA,
)
STALL_HIST = metric(
    "nodescope_nvlink_kmod_stall_samples_total",
    "counter",
    "link samples whose stall rate (cycles per microsecond) was below the bound, since the "
    "source was configured, summed over the device's links",
    _BUCKET,
    area=AREA,
)


def _le(value: float) -> str:
    return f"{value:.6g}"


def _bounds(exported: tuple[int, ...], scale: float) -> tuple[str, ...]:
    """The ``below`` label of each exported bucket (its bound, in the figure's unit), then
    ``+Inf``."""
    return (*(_le((1 << b) / scale) for b in exported), "+Inf")


UTIL_BOUNDS = _bounds(UTIL_BUCKETS, UTIL_ONE)
STALL_BOUNDS = _bounds(STALL_BUCKETS, 1)


def _buckets(hist: Sequence[int], exported: tuple[int, ...]) -> list[int]:
    """Cumulative counts at the exported buckets, then the count of every bucket (+Inf)."""
    running = list(accumulate(hist))
    return [*(running[b] for b in exported), running[-1]]


def _per_link(
    spec: MetricSpec, labels: list[tuple[str, str]], values: Sequence[float | None]
) -> Iterator[Metric]:
    """A family of the links whose value is not ``None``, if any."""
    family = spec.family()
    family.add_metrics(labels, values)
    if family.values:
        yield family


def _picker(indices: list[int]) -> Callable[[Sequence[T]], tuple[T, ...]]:
    """A function that picks the items at ``indices`` of a column, in C."""
    if len(indices) == 1:
        only = indices[0]
        return lambda column: (column[only],)
    return operator.itemgetter(*indices)


def _device_families(records: NvlcRecords) -> Iterator[Metric]:
    """The per-device sums. A link whose device went away keeps its last counts in the sums
    (the module stops reading it), so a sum never goes down and rate() sees no reset."""
    capacity, links, gone, samples = (
        CAPACITY.family(),
        LINKS.family(),
        GONE.family(),
        LINK_SAMPLES.family(),
    )
    counters = [
        (records.counters[i], records.has_counter(i), spec.family())
        for i, per_link, spec in COUNTERS
        if not per_link
    ]
    hists = (
        (UTIL_HIST.family(), records.util_hist, UTIL_BUCKETS, UTIL_BOUNDS),
        (STALL_HIST.family(), records.stall_hist, STALL_BUCKETS, STALL_BOUNDS),
    )
    gone_links = records.device_gone
    groups: dict[int, list[int]] = {}
    for i, device in enumerate(records.device):
        groups.setdefault(device, []).append(i)
    for device, indices in sorted(groups.items()):
        d = str(device)
        pick = _picker(indices)
        capacity.add_metric([d], float(sum(pick(records.capacity_bps))))
        links.add_metric([d], float(len(indices)))
        gone.add_metric([d], 1.0 if any(pick(gone_links)) else 0.0)
        samples.add_metric([d], float(sum(pick(records.samples))))
        for column, has, family in counters:
            # Only the links whose register map names the counter; none: absent, not 0.
            have = [v for v, h in zip(pick(column), pick(has), strict=True) if h]
            if have:
                family.add_metric([d], float(sum(have)))
        for family, hist, exported, bounds in hists:
            counts = _buckets([sum(pick(bucket)) for bucket in hist], exported)
            family.add_metrics([(d, below) for below in bounds], counts)
    yield from (capacity, links, gone, samples)
    yield from (family for _, _, family in counters if family.values)
    yield from (family for family, _, _, _ in hists)


def families(snapshot: Snapshot) -> Iterable[Metric]:
    data = snapshot.latest(NVLINK_KMOD)
    if data is None:
        return
    served = SERVED.family()
    served.add_metric([], 1.0 if data.serving else 0.0)
    yield served
    snap = data.snapshot
    if snap is None:
        return
    h = snap.header
    info = SOURCE_INFO.family()
    info.add_metric([data.kind, h.source_name, data.path], 1.0)
    yield info
    for spec, value in (
        (PERIOD, h.period_ns / 1e9),
        (SAMPLES, float(h.sequence)),
        (MISSED, float(max(0, h.ticks - h.sequence))),
    ):
        family = spec.family()
        family.add_metric([], value)
        yield family
    records = snap.records
    if not records:
        return
    yield from _device_families(records)
    labels = list(zip(map(str, records.device), map(str, records.link), strict=True))
    for i, per_link, spec in COUNTERS:
        if per_link:
            values = records.counters[i]
            # A counter the register map does not name is absent, not 0.
            has = records.has_counter(i)
            yield from _per_link(
                spec, labels, [v if h else None for v, h in zip(values, has, strict=True)]
            )
    ws = records.window_samples
    yield from _per_link(
        WINDOW_MAX_UTIL,
        labels,
        [u / UTIL_ONE if n else None for u, n in zip(records.window_max_util, ws, strict=True)],
    )
    yield from _per_link(
        WINDOW_MAX_STALL,
        labels,
        [s if n else None for s, n in zip(records.window_max_stall, ws, strict=True)],
    )
