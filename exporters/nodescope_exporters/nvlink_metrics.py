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

from collections.abc import Callable, Iterable, Iterator

from nodescope.model.nvlink_kmod import COUNTER_NAMES, NVLINK_KMOD, UTIL_ONE, NvlcRecord
from nodescope.model.snapshot import Snapshot
from nodescope_exporters.catalog import Metric, MetricSpec, metric

AREA = NVLINK_KMOD.name
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


def _buckets(
    hist: tuple[int, ...], exported: tuple[int, ...], scale: float
) -> list[tuple[str, int]]:
    """Cumulative counts at the exported bounds, then +Inf."""
    out: list[tuple[str, int]] = []
    running = 0
    for b, count in enumerate(hist):
        running += count
        if b in exported:
            out.append((_le((1 << b) / scale), running))
    out.append(("+Inf", sum(hist)))
    return out


def _per_link(
    spec: MetricSpec, records: Iterable[NvlcRecord], value: Callable[[NvlcRecord], float | None]
) -> Iterator[Metric]:
    family = spec.family()
    filled = False
    for r in records:
        v = value(r)
        if v is None:
            continue
        family.add_metric([str(r.device), str(r.link)], float(v))
        filled = True
    if filled:
        yield family


def _counter_value(i: int) -> Callable[[NvlcRecord], float | None]:
    def value(r: NvlcRecord) -> float | None:
        # A counter the register map does not name is absent, not 0.
        return r.counters[i] if r.has_counter(COUNTER_NAMES[i]) else None

    return value


def _by_device(records: Iterable[NvlcRecord]) -> dict[int, list[NvlcRecord]]:
    groups: dict[int, list[NvlcRecord]] = {}
    for r in records:
        groups.setdefault(r.device, []).append(r)
    return groups


def _summed_hist(group: list[NvlcRecord], attr: str) -> tuple[int, ...]:
    return tuple(sum(column) for column in zip(*(getattr(r, attr) for r in group), strict=True))


def _device_families(records: Iterable[NvlcRecord]) -> Iterator[Metric]:
    """The per-device sums. A link whose device went away keeps its last counts in the sums
    (the module stops reading it), so a sum never goes down and rate() sees no reset."""
    capacity, links, gone, samples = (
        CAPACITY.family(),
        LINKS.family(),
        GONE.family(),
        LINK_SAMPLES.family(),
    )
    counters = [(i, spec.family()) for i, per_link, spec in COUNTERS if not per_link]
    hists = (
        (UTIL_HIST.family(), "util_hist", UTIL_BUCKETS, float(UTIL_ONE)),
        (STALL_HIST.family(), "stall_hist", STALL_BUCKETS, 1.0),
    )
    for device, group in sorted(_by_device(records).items()):
        d = str(device)
        capacity.add_metric([d], float(sum(r.capacity_bps for r in group)))
        links.add_metric([d], float(len(group)))
        gone.add_metric([d], 1.0 if any(r.device_gone for r in group) else 0.0)
        samples.add_metric([d], float(sum(r.samples for r in group)))
        for i, family in counters:
            name = COUNTER_NAMES[i]
            # Only the links whose register map names the counter; none: absent, not 0.
            have = [r.counters[i] for r in group if r.has_counter(name)]
            if have:
                family.add_metric([d], float(sum(have)))
        for family, attr, exported, scale in hists:
            for below, count in _buckets(_summed_hist(group, attr), exported, scale):
                family.add_metric([d, below], float(count))
    yield from (capacity, links, gone, samples)
    yield from (family for _, family in counters if family.samples)
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
    for i, per_link, spec in COUNTERS:
        if per_link:
            yield from _per_link(spec, records, _counter_value(i))
    yield from _per_link(
        WINDOW_MAX_UTIL,
        records,
        lambda r: r.window_max_util / UTIL_ONE if r.window_samples else None,
    )
    yield from _per_link(
        WINDOW_MAX_STALL, records, lambda r: r.window_max_stall if r.window_samples else None
    )
