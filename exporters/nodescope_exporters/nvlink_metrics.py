"""Metrics of the ``nvlink_kmod`` source: NVLink counters sampled by the ``nvlink_counter``
kernel module (``/dev/nvlink_stats``, ABI in ``kmod/include/uapi/linux/nvlink_counter.h``).

Raw cumulative counters are counters (Prometheus computes rates). What only the module can
see is exported beside them: the per-sample maxima and the share of samples over the module's
thresholds in the last window (the interval since the daemon's previous read), and the
per-sample utilisation and stall-rate distributions as cumulative bucket counters with an
``below`` label (the bucket bound: promtool reserves ``le`` for histogram types).

Units: utilisation is a fraction of the link's capacity per direction (the larger of TX and
RX); stall rates are stall cycles per microsecond. Bucket bounds are the module's log2
buckets: a value lands in bucket b when it is below 2^b (in 1/65536 of capacity for
utilisation, in cycles per microsecond for stalls); ``below`` is that bound, rounded to 6 digits.
``nodescope_nvlink_data_source_info{source="kmod"}`` (the gpu area's, decided by
:func:`nodescope_exporters.gpu_metrics.nvlink_data_source`) says the module served the NVLink
figures.

Only the buckets between 1.6 % and 200 % utilisation and 64 and 16384 cycles/µs are exported
(plus ``+Inf``), which bounds the series to 19 per link and histogram.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.metrics_core import Metric

from nodescope import derive
from nodescope.kmod_abi import COUNTER_NAMES, UTIL_ONE, NvlcRecord
from nodescope.model.snapshot import Snapshot
from nodescope.sources.nvlink_kmod import NAME, LinkRates, NvlinkKmodData, NvlinkKmodRates
from nodescope_exporters.catalog import MetricSpec, metric

AREA = NAME
_LINK = ("device", "link")
# The bucket bound is "below", not "le": these are counters per bucket, and promtool keeps
# "le" for histogram types.
_BUCKET = ("device", "link", "below")

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
    "configured capacity of the link per direction",
    _LINK,
    area=AREA,
)
GONE = metric(
    "nodescope_nvlink_kmod_device_gone",
    "gauge",
    "1 when the device holding the link's counters stopped answering (all-ones reads) or was "
    "removed; its counters are no longer read",
    _LINK,
    area=AREA,
)
LINK_SAMPLES = metric(
    "nodescope_nvlink_kmod_link_samples_total",
    "counter",
    "samples that read this link since its source was configured",
    _LINK,
    area=AREA,
)
_COUNTER_HELP = {
    "tx_bytes": ("nodescope_nvlink_kmod_transmit_bytes_total", "bytes sent on the link"),
    "rx_bytes": ("nodescope_nvlink_kmod_receive_bytes_total", "bytes received on the link"),
    "stall_cycles": (
        "nodescope_nvlink_kmod_stall_cycles_total",
        "cycles the link stalled (arbitration/credit stall as the register map defines it)",
    ),
    "replay_errors": ("nodescope_nvlink_kmod_replay_errors_total", "data link replays"),
    "crc_errors": ("nodescope_nvlink_kmod_crc_errors_total", "CRC errors"),
}
COUNTERS: tuple[tuple[int, MetricSpec], ...] = tuple(
    (i, metric(_COUNTER_HELP[n][0], "counter", _COUNTER_HELP[n][1], _LINK, area=AREA))
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
WINDOW_OVER_STALL = metric(
    "nodescope_nvlink_kmod_window_stall_over_threshold_ratio",
    "gauge",
    "share of the last window's samples whose stall rate was above the module's threshold",
    _LINK,
    area=AREA,
)
WINDOW_OVER_UTIL = metric(
    "nodescope_nvlink_kmod_window_utilisation_over_threshold_ratio",
    "gauge",
    "share of the last window's samples whose utilisation was above the module's threshold",
    _LINK,
    area=AREA,
)
UTIL_HIST = metric(
    "nodescope_nvlink_kmod_utilisation_samples_total",
    "counter",
    "samples whose utilisation (fraction of capacity) was at most le, since the source was "
    "configured",
    _BUCKET,
    area=AREA,
)
STALL_HIST = metric(
    "nodescope_nvlink_kmod_stall_samples_total",
    "counter",
    "samples whose stall rate (cycles per microsecond) was at most le, since the source was "
    "configured",
    _BUCKET,
    area=AREA,
)
RATE_UTIL = metric(
    "nodescope_nvlink_kmod_utilisation_ratio",
    "gauge",
    "average utilisation (fraction of capacity, max of TX and RX) between the last two reads",
    _LINK,
    area=AREA,
)
RATE_STALL = metric(
    "nodescope_nvlink_kmod_stall_cycles_per_microsecond",
    "gauge",
    "average stall rate between the last two reads",
    _LINK,
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


_RATES: tuple[tuple[MetricSpec, Callable[[LinkRates], float | None]], ...] = (
    (RATE_UTIL, lambda lr: lr.utilisation),
    (RATE_STALL, lambda lr: lr.stall_cycles_per_microsecond),
)


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def families(snapshot: Snapshot) -> Iterable[Metric]:
    data = snapshot.data(AREA, NvlinkKmodData)
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
    yield from _per_link(CAPACITY, records, lambda r: r.capacity_bps)
    yield from _per_link(GONE, records, lambda r: 1.0 if r.device_gone else 0.0)
    yield from _per_link(LINK_SAMPLES, records, lambda r: r.samples)
    for i, spec in COUNTERS:
        yield from _per_link(
            spec,
            records,
            _counter_value(i),
        )
    yield from _per_link(
        WINDOW_MAX_UTIL,
        records,
        lambda r: r.window_max_util / UTIL_ONE if r.window_samples else None,
    )
    yield from _per_link(
        WINDOW_MAX_STALL, records, lambda r: r.window_max_stall if r.window_samples else None
    )
    yield from _per_link(
        WINDOW_OVER_STALL, records, lambda r: _ratio(r.window_over_stall, r.window_samples)
    )
    yield from _per_link(
        WINDOW_OVER_UTIL, records, lambda r: _ratio(r.window_over_util, r.window_samples)
    )
    for spec, attr, exported, scale in (
        (UTIL_HIST, "util_hist", UTIL_BUCKETS, float(UTIL_ONE)),
        (STALL_HIST, "stall_hist", STALL_BUCKETS, 1.0),
    ):
        family = spec.family()
        for r in records:
            for le, count in _buckets(getattr(r, attr), exported, scale):
                family.add_metric([str(r.device), str(r.link), le], float(count))
        yield family
    rates = derive.derived(snapshot, AREA)
    if isinstance(rates, NvlinkKmodRates):
        for spec, get in _RATES:
            family = spec.family()
            filled = False
            for lr in rates.links:
                v = get(lr)
                if v is not None:
                    family.add_metric([str(lr.device), str(lr.link)], v)
                    filled = True
            if filled:
                yield family
