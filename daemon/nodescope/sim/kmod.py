"""The ``nvlink_counter`` kernel module as it would run on the simulated node.

Writes what one reader of ``/dev/nvlink_stats`` would get once per tick: a snapshot in the
module's ABI (``kmod/include/uapi/linux/nvlink_counter.h``, encoded by
:func:`nodescope.kmod_abi.encode_snapshot`), one record per (GPU, NVLink) with cumulative TX/RX
bytes, stall cycles and error counters, and the window statistics of the samples taken since
the previous tick, computed as the module computes them (``kmod/nvlc_sample.c``) when it
samples every 100 µs (``NVLC_PERIOD_DEFAULT_NS``). The daemon's ``nvlink_kmod`` source reads
the file through its real path (a regular file in the device's place).

What the simulated module is: an operator's register map (``NVLC_SOURCE_MMIO``) naming all five
counters of every NVLink of every GPU, configured when the node starts (t = 0, counters at 0,
the first sample already primed), the module's default thresholds (2,000 stall cycles per µs,
90 % utilisation), and the capacity of an NVLink 3/4 link, 25 GB/s per direction. A GPU whose
PCI function goes away (hot-unplug, Xid 79) is a device whose registers read all-ones from
that tick on: its links carry ``NVLC_LINK_DEVICE_GONE``, are no longer sampled and keep their
last counters.

Stall cycles: no public document defines an NVLink stall counter, so the simulated map counts
them at :data:`STALL_CLOCK_HZ` (5 GHz): a link stalled all the time reads 5,000 cycles per µs,
and the detector's default bands (500 and 2,000 cycles per µs) are 10 % and 40 % of the time
stalled. A scenario's ``stall_ratio`` is the fraction of the time its traffic is on (the
burst) that the link stalls.

How the window statistics are computed without taking 10,000 samples a second one by one:
each link's load is a sum of timeline activities, each constant while it is on (all the time,
or during the first ``on_seconds`` of every ``period_seconds`` of a burst). Over a window the
edges of the on-intervals (activity start and end, burst starts and ends) cut time into a few
segments of constant rates. A sample covers one period ``[(k-1)·P, k·P)``; the samples that lie
inside one segment all see the same deltas (rate × P), so each segment adds ``n`` identical
samples at once; a sample that straddles an edge gets the integral of the rates over its
period. The module's per-sample figures (utilisation, stall rate, histogram bucket, over
threshold) are then computed once per distinct delta triple and weighted by its sample count.
The cost is proportional to the edges in a tick (two per burst), not to the samples; links
with the same activities and capacity share one computation. Per-sample deltas are the
integrals rounded to whole counts (a real counter's flooring adds ±1 to some samples, which no
statistic here can show). A burst period shorter than two sampling periods cannot be resolved
by the module either: such an activity counts as steady at its average rate.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from nodescope.kmod_abi import (
    HIST_BUCKETS,
    NUM_COUNTERS,
    UTIL_ONE,
    NvlcHeader,
    NvlcRecord,
    encode_snapshot,
    lib,
)
from nodescope.sim.scenario import Activity, Burst, Hardware

#: The module's default sampling period (ns).
PERIOD_NS: int = lib.NVLC_PERIOD_DEFAULT_NS
#: The module's default thresholds (``kmod/nvlc_sample.c``): stall cycles per µs, and
#: utilisation in 1/65536 of capacity.
STALL_THRESHOLD = 2000
UTIL_THRESHOLD = UTIL_ONE * 9 // 10
#: Stall cycles per second of a link that stalls all the time (see the module docstring).
STALL_CLOCK_HZ = 5e9
#: Bytes per second per direction of one NVLink: NVLink 3 (A100, 12 links) and NVLink 4
#: (H100, 18 links) both carry 50 GB/s per link, both directions together.
NVLINK_CAPACITY_BPS = 25_000_000_000
#: NVLink 5 (Blackwell): 100 GB/s per link, both directions together.
NVLINK5_CAPACITY_BPS = 50_000_000_000
_NVLINK5_MODELS = ("B100", "B200", "GB200", "B300", "GB300")

_NS = 1_000_000_000
_ALL_COUNTERS = sum(1 << (lib.NVLC_LINK_COUNTER_SHIFT + c) for c in range(NUM_COUNTERS))


def link_capacity(gpu_name: str) -> int:
    """Capacity per direction of one NVLink of a GPU model."""
    upper = gpu_name.upper()
    return NVLINK5_CAPACITY_BPS if any(m in upper for m in _NVLINK5_MODELS) else NVLINK_CAPACITY_BPS


def bucket(value: int) -> int:
    """The module's log2 bucket (``nvlc_bucket``): 0 for 0, else the bit length, capped."""
    return min(value.bit_length(), HIST_BUCKETS - 1)


def _ns(seconds: float) -> int:
    return round(seconds * _NS)


@dataclass(frozen=True, slots=True)
class LinkLoad:
    """One activity's load on a link: rates while it is on, in [start_ns, end_ns), bursting
    for ``on_ns`` at the start of every ``period_ns`` when ``period_ns`` is set."""

    tx_bytes_per_second: float
    rx_bytes_per_second: float
    stall_cycles_per_second: float
    start_ns: int
    end_ns: int | None = None
    period_ns: int | None = None
    on_ns: int | None = None

    @classmethod
    def of_activity(cls, activity: Activity) -> LinkLoad:
        get = activity.get
        tx, rx = float(get("tx_bytes_per_second")), float(get("rx_bytes_per_second"))
        stall = float(get("stall_ratio")) * STALL_CLOCK_HZ
        start = _ns(activity.start)
        end = None if activity.end is None else _ns(activity.end)
        burst = get("burst")
        if isinstance(burst, Burst):
            period, on = _ns(burst.period_seconds), _ns(burst.on_seconds)
            if period >= 2 * PERIOD_NS and on < period:
                return cls(tx, rx, stall, start, end, period, on)
            if period > 0 and on < period:
                duty = on / period  # unresolvable by a 100 µs sampler: its average
                return cls(tx * duty, rx * duty, stall * duty, start, end)
        return cls(tx, rx, stall, start, end)

    def on_intervals(self, lo: int, hi: int) -> Iterator[tuple[int, int]]:
        """The parts of [lo, hi) during which the load is on."""
        a = max(lo, self.start_ns)
        b = hi if self.end_ns is None else min(hi, self.end_ns)
        if b <= a:
            return
        if self.period_ns is None or self.on_ns is None:
            yield a, b
            return
        n = (a - self.start_ns) // self.period_ns
        while True:
            on_start = self.start_ns + n * self.period_ns
            if on_start >= b:
                return
            s, e = max(a, on_start), min(b, on_start + self.on_ns)
            if s < e:
                yield s, e
            n += 1


@dataclass(frozen=True, slots=True)
class WindowStats:
    """What the samples of one window add to a link: the module's ``nvlc_win`` plus the
    counter increases (floats; the record carries their integer part)."""

    samples: int
    increase: tuple[float, float, float]
    max_delta: tuple[int, int, int]
    max_util: int
    max_stall: int
    over_stall: int
    over_util: int
    util_hist: tuple[int, ...]
    stall_hist: tuple[int, ...]
    #: whether the window's last sample was over the stall / utilisation threshold
    last_over_stall: bool
    last_over_util: bool


def _segments(
    loads: Sequence[LinkLoad], lo: int, hi: int
) -> Iterator[tuple[int, int, float, float, float]]:
    """Contiguous segments covering [lo, hi) with the summed TX, RX and stall rates in each
    (stall capped at the clock: a link cannot stall more than all of its cycles)."""
    edges: list[tuple[int, int, int]] = []
    for i, load in enumerate(loads):
        for s, e in load.on_intervals(lo, hi):
            edges.append((s, 1, i))
            edges.append((e, -1, i))
    edges.sort()
    active: set[int] = set()
    at = lo
    k = 0
    while at < hi:
        while k < len(edges) and edges[k][0] <= at:
            _, step, i = edges[k]
            if step > 0:
                active.add(i)
            else:
                active.discard(i)
            k += 1
        nxt = edges[k][0] if k < len(edges) else hi
        tx = sum(loads[i].tx_bytes_per_second for i in active)
        rx = sum(loads[i].rx_bytes_per_second for i in active)
        stall = min(STALL_CLOCK_HZ, sum(loads[i].stall_cycles_per_second for i in active))
        yield at, min(nxt, hi), tx, rx, stall
        at = min(nxt, hi)


def window_stats(
    loads: Sequence[LinkLoad],
    first_sample: int,
    last_sample: int,
    capacity_bps: int,
    period_ns: int = PERIOD_NS,
    stall_threshold: int = STALL_THRESHOLD,
    util_threshold: int = UTIL_THRESHOLD,
) -> WindowStats:
    """The statistics of samples ``first_sample..last_sample`` (sample k covers
    [(k-1)·period, k·period) in ns since configuration) of a link carrying ``loads``."""
    groups: dict[tuple[int, int, int], int] = {}
    last: tuple[int, int, int] | None = None
    totals = [0.0, 0.0, 0.0]
    lo, hi = (first_sample - 1) * period_ns, last_sample * period_ns
    partial = [0.0, 0.0, 0.0]  # deltas of the sample in progress, bytes and cycles

    def emit(values: Sequence[float], count: int) -> None:
        nonlocal last
        key = (round(values[0]), round(values[1]), round(values[2]))
        groups[key] = groups.get(key, 0) + count
        last = key

    if hi > lo:
        for a, b, tx, rx, stall in _segments(loads, lo, hi):
            rates = (tx / _NS, rx / _NS, stall / _NS)  # per ns
            for c in range(3):
                totals[c] += rates[c] * (b - a)
            x = a
            if x % period_ns:
                end = min(b, (x // period_ns + 1) * period_ns)
                for c in range(3):
                    partial[c] += rates[c] * (end - x)
                x = end
                if x % period_ns == 0:
                    emit(partial, 1)
                    partial = [0.0, 0.0, 0.0]
            if x >= b:
                continue
            full = (b - x) // period_ns
            if full:
                emit([r * period_ns for r in rates], full)
                x += full * period_ns
            for c in range(3):
                partial[c] += rates[c] * (b - x)
    util_hist = [0] * HIST_BUCKETS
    stall_hist = [0] * HIST_BUCKETS
    max_delta = [0, 0, 0]
    max_util = max_stall = over_stall = over_util = 0
    last_over = (False, False)
    for key, count in groups.items():
        dtx, drx, dstall = key
        # nvlc_sample_locked(): bytes per second of the sample, then 1/65536 of capacity;
        # stall cycles per microsecond of the sample.
        per_second = max(dtx * _NS // period_ns, drx * _NS // period_ns)
        util = per_second * UTIL_ONE // capacity_bps
        stall = dstall * 1000 // period_ns
        for c in range(3):
            max_delta[c] = max(max_delta[c], key[c])
        max_util, max_stall = max(max_util, util), max(max_stall, stall)
        util_hist[bucket(util)] += count
        stall_hist[bucket(stall)] += count
        over = (stall > stall_threshold, util > util_threshold)
        over_stall += count if over[0] else 0
        over_util += count if over[1] else 0
        if key == last:
            last_over = over
    return WindowStats(
        samples=sum(groups.values()),
        increase=(totals[0], totals[1], totals[2]),
        max_delta=(max_delta[0], max_delta[1], max_delta[2]),
        max_util=max_util,
        max_stall=max_stall,
        over_stall=over_stall,
        over_util=over_util,
        util_hist=tuple(util_hist),
        stall_hist=tuple(stall_hist),
        last_over_stall=last_over[0],
        last_over_util=last_over[1],
    )


@dataclass
class _Link:
    device: int
    link: int
    capacity: int
    loads: tuple[int, ...]  # indices into SimulatedModule.loads
    counters: list[float] = field(default_factory=lambda: [0.0] * NUM_COUNTERS)
    samples: int = 0
    util_hist: list[int] = field(default_factory=lambda: [0] * HIST_BUCKETS)
    stall_hist: list[int] = field(default_factory=lambda: [0] * HIST_BUCKETS)
    gone: bool = False


class SimulatedModule:
    """The module's state on one simulated node: every NVLink of every GPU, sampled in
    simulated time. :meth:`snapshot` advances to ``t`` and returns the bytes of a read."""

    def __init__(self, hardware: Hardware, timeline: Sequence[Activity]) -> None:
        self.loads: list[LinkLoad] = []
        by_link: dict[tuple[int, int], list[int]] = {}
        for activity in timeline:
            if activity.kind != "nvlink":
                continue
            gpu = hardware.gpus[activity.get("gpu")]
            self.loads.append(LinkLoad.of_activity(activity))
            for link in activity.get("links") or range(gpu.nvlink_count):
                by_link.setdefault((gpu.index, link), []).append(len(self.loads) - 1)
        self.links = [
            _Link(gpu.index, n, link_capacity(gpu.name), tuple(by_link.get((gpu.index, n), ())))
            for gpu in hardware.gpus
            for n in range(gpu.nvlink_count)
        ]
        self.pci = {gpu.index: gpu.pci for gpu in hardware.gpus}
        #: CLOCK_MONOTONIC at simulated t = 0: the node's uptime
        self.monotonic_base_ns = _ns(hardware.os.uptime_seconds)
        self.sample = 0  # samples taken since configuration (t = 0)

    def snapshot(self, t: float, removed: frozenset[str] | set[str] = frozenset()) -> bytes:
        """Sample up to simulated second ``t`` and read: the window is the samples since the
        previous call. ``removed`` are the PCI functions gone from the node."""
        last = max(self.sample, _ns(t) // PERIOD_NS)
        first = self.sample + 1
        cache: dict[tuple[tuple[int, ...], int], WindowStats] = {}
        records: list[NvlcRecord] = []
        header_flags = 0
        for ln in self.links:
            if not ln.gone and self.pci.get(ln.device) in removed:
                ln.gone = True
            window: WindowStats | None = None
            if not ln.gone and last >= first:
                key = (ln.loads, ln.capacity)
                window = cache.get(key)
                if window is None:
                    loads = [self.loads[i] for i in ln.loads]
                    window = window_stats(loads, first, last, ln.capacity)
                    cache[key] = window
                for c in range(3):
                    ln.counters[c] += window.increase[c]
                ln.samples += window.samples
                for b in range(HIST_BUCKETS):
                    ln.util_hist[b] += window.util_hist[b]
                    ln.stall_hist[b] += window.stall_hist[b]
            flags = _ALL_COUNTERS
            if ln.gone:
                flags |= lib.NVLC_LINK_DEVICE_GONE
                header_flags |= lib.NVLC_HDR_DEVICE_GONE
            if window is not None:
                if window.last_over_stall:
                    flags |= lib.NVLC_LINK_OVER_STALL
                if window.last_over_util:
                    flags |= lib.NVLC_LINK_OVER_UTIL
                if window.over_stall or window.over_util:
                    header_flags |= lib.NVLC_HDR_THRESHOLD_EVENT
            records.append(_record(ln, flags, window))
        header = NvlcHeader(
            flags=header_flags,
            source=lib.NVLC_SOURCE_MMIO,
            sequence=last,
            ticks=last,
            timestamp_ns=self.monotonic_base_ns + last * PERIOD_NS,
            period_ns=PERIOD_NS,
            window_ns=(last - self.sample) * PERIOD_NS,
            window_samples=last - self.sample,
            window_ticks=last - self.sample,
            stall_threshold=STALL_THRESHOLD,
            util_threshold=UTIL_THRESHOLD,
        )
        self.sample = last
        return encode_snapshot(header, records)


def _record(ln: _Link, flags: int, w: WindowStats | None) -> NvlcRecord:
    record = NvlcRecord(
        device=ln.device,
        link=ln.link,
        flags=flags,
        capacity_bps=ln.capacity,
        counters=tuple(math.floor(v) for v in ln.counters),
        samples=ln.samples,
        util_hist=tuple(ln.util_hist),
        stall_hist=tuple(ln.stall_hist),
    )
    if w is None:
        return record
    return dataclasses.replace(
        record,
        window_samples=w.samples,
        window_max_delta=(*w.max_delta, 0, 0),
        window_max_util=w.max_util,
        window_max_stall=w.max_stall,
        window_over_stall=w.over_stall,
        window_over_util=w.over_util,
        window_util_hist=w.util_hist,
        window_stall_hist=w.stall_hist,
    )
