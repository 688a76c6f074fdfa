"""The records of the ``nvlink_kmod`` source (the ``nvlink_counter`` module's snapshots) and
their rates.

The snapshot records mirror the structs of the module's uapi header
(``kmod/include/uapi/linux/nvlink_counter.h``, docs/datasources.md §3): field names are the C
names, reserved fields are not carried. The ABI values the records need (sizes, flags,
counter order, the utilisation unit) are stated here as plain numbers so that detectors and
exporters can read snapshots without loading the ABI's C declarations;
:mod:`nodescope.kmod_abi`, which decodes the bytes, checks every one of them against the
header when it is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nodescope.model.counters import counter_rate
from nodescope.model.source_key import SourceKey

# --------------------------------------------------------------------------------------------
# ABI values the records carry (each checked against the header by nodescope.kmod_abi)

#: ``NVLC_MAGIC``: "NVLC" in a little-endian 32-bit word.
MAGIC = 0x434C564E
#: ``NVLC_ABI_VERSION``: major in the upper 16 bits, minor in the lower.
ABI_VERSION = 0x00010000
#: ``sizeof(struct nvlc_header)`` and ``sizeof(struct nvlc_record)`` of this ABI version.
HEADER_SIZE = 128
RECORD_SIZE = 824
#: ``NVLC_NUM_COUNTERS``, ``NVLC_HIST_BUCKETS``.
NUM_COUNTERS = 5
HIST_BUCKETS = 20
#: ``NVLC_UTIL_ONE``: utilisation figures are in units of 1/65536 of the link's capacity.
UTIL_ONE = 65536
#: ``NVLC_HDR_*`` bits of ``nvlc_header.flags``.
HDR_DEVICE_GONE = 0x1
HDR_THRESHOLD_EVENT = 0x2
#: ``NVLC_LINK_*`` bits of ``nvlc_record.flags``: the device is gone; from bit
#: ``LINK_COUNTER_SHIFT`` on, one bit per counter (in :data:`COUNTER_NAMES` order) that the
#: link's source provides.
LINK_DEVICE_GONE = 0x1
LINK_COUNTER_SHIFT = 8

#: NVLC_COUNTER_* order of ``nvlc_record.counters``.
COUNTER_NAMES: tuple[str, ...] = (
    "tx_bytes",
    "rx_bytes",
    "stall_cycles",
    "replay_errors",
    "crc_errors",
)
#: ``nvlc_header.source``: NVLC_SOURCE_NONE, _SIM, _MMIO.
SOURCE_NAMES: dict[int, str] = {0: "none", 1: "sim", 2: "mmio"}


# --------------------------------------------------------------------------------------------
# Snapshot records


def _zeros(n: int) -> tuple[int, ...]:
    return (0,) * n


@dataclass(frozen=True, slots=True)
class NvlcHeader:
    """``struct nvlc_header``. Times in ns (CLOCK_MONOTONIC), thresholds in the header's units:
    stall cycles per microsecond, utilisation in 1/65536 of capacity."""

    magic: int = MAGIC
    abi_version: int = ABI_VERSION
    header_size: int = HEADER_SIZE
    record_size: int = RECORD_SIZE
    record_count: int = 0
    flags: int = 0
    source: int = 0
    sequence: int = 0
    ticks: int = 0
    timestamp_ns: int = 0
    period_ns: int = 0
    window_ns: int = 0
    window_samples: int = 0
    window_ticks: int = 0
    stall_threshold: int = 0
    util_threshold: int = 0

    @property
    def source_name(self) -> str:
        return SOURCE_NAMES.get(self.source, f"unknown-{self.source}")

    @property
    def device_gone(self) -> bool:
        return bool(self.flags & HDR_DEVICE_GONE)

    @property
    def threshold_event(self) -> bool:
        return bool(self.flags & HDR_THRESHOLD_EVENT)


@dataclass(frozen=True, slots=True)
class NvlcRecord:
    """``struct nvlc_record``: one (device, link). ``counters`` in :data:`COUNTER_NAMES` order;
    histograms have :data:`HIST_BUCKETS` buckets (see the header for the bucket bounds)."""

    device: int = 0
    link: int = 0
    flags: int = 0
    capacity_bps: int = 0
    counters: tuple[int, ...] = field(default_factory=lambda: _zeros(NUM_COUNTERS))
    samples: int = 0
    window_samples: int = 0
    window_max_delta: tuple[int, ...] = field(default_factory=lambda: _zeros(NUM_COUNTERS))
    window_max_util: int = 0
    window_max_stall: int = 0
    window_over_stall: int = 0
    window_over_util: int = 0
    window_util_hist: tuple[int, ...] = field(default_factory=lambda: _zeros(HIST_BUCKETS))
    window_stall_hist: tuple[int, ...] = field(default_factory=lambda: _zeros(HIST_BUCKETS))
    util_hist: tuple[int, ...] = field(default_factory=lambda: _zeros(HIST_BUCKETS))
    stall_hist: tuple[int, ...] = field(default_factory=lambda: _zeros(HIST_BUCKETS))

    def counter(self, name: str) -> int:
        return self.counters[COUNTER_NAMES.index(name)]

    @property
    def device_gone(self) -> bool:
        return bool(self.flags & LINK_DEVICE_GONE)

    def has_counter(self, name: str) -> bool:
        bit = LINK_COUNTER_SHIFT + COUNTER_NAMES.index(name)
        return bool(self.flags & (1 << bit))


@dataclass(frozen=True, slots=True)
class NvlcSnapshot:
    header: NvlcHeader
    records: tuple[NvlcRecord, ...]


@dataclass(frozen=True, slots=True)
class NvlinkKmodData:
    """What ``<dev>/nvlink_stats`` held: ``kind`` is ``device`` (the module), ``file`` (a
    snapshot file) or ``absent`` (then ``snapshot`` is None and NVLink figures come from NVML
    alone)."""

    path: str
    kind: str
    snapshot: NvlcSnapshot | None

    @property
    def serving(self) -> bool:
        return self.snapshot is not None and bool(self.snapshot.records)


#: The ``nvlink_kmod`` source's records: the module's per-link counters and window figures.
NVLINK_KMOD = SourceKey("nvlink_kmod", NvlinkKmodData)


# --------------------------------------------------------------------------------------------
# Rates


@dataclass(frozen=True, slots=True)
class LinkRates:
    """Figures of one link between two reads.

    Rates are averages over the interval; ``window_*`` figures are the module's per-sample
    statistics over the same interval (the kernel sampled every ``period_ns``). Utilisation is
    a fraction of the link's capacity per direction (the larger of TX and RX); stall rates are
    stall cycles per microsecond.
    """

    device: int
    link: int
    tx_bytes_per_second: float | None
    rx_bytes_per_second: float | None
    stall_cycles_per_microsecond: float | None
    replay_errors_per_second: float | None
    crc_errors_per_second: float | None
    utilisation: float | None
    window_samples: int
    window_max_utilisation: float
    window_max_stall_cycles_per_microsecond: int
    window_stall_over_threshold_ratio: float | None
    window_utilisation_over_threshold_ratio: float | None
    device_gone: bool


@dataclass(frozen=True, slots=True)
class NvlinkKmodRates:
    seconds: float
    samples_per_second: float | None
    missed_ticks: int
    links: tuple[LinkRates, ...]


def interval_seconds(prev: NvlcSnapshot, cur: NvlcSnapshot, seconds: float) -> float:
    """The time between two snapshots: the module's sample timestamps when they are usable
    (they date the counters exactly), else the reader's measured ``seconds``."""
    if cur.header.timestamp_ns > prev.header.timestamp_ns > 0:
        return (cur.header.timestamp_ns - prev.header.timestamp_ns) / 1e9
    return seconds


def snapshot_rates(prev: NvlcSnapshot, cur: NvlcSnapshot, seconds: float) -> NvlinkKmodRates:
    """Pure: per-link rates and window figures from two snapshots of one reader."""
    secs = interval_seconds(prev, cur, seconds)
    before = {(r.device, r.link): r for r in prev.records}
    links: list[LinkRates] = []
    for r in cur.records:
        p = before.get((r.device, r.link))
        if p is None:
            tx = rx = stall = replay = crc = None
        else:
            tx, rx, stall, replay, crc = (
                counter_rate(a, b, secs) for a, b in zip(p.counters, r.counters, strict=True)
            )
        util = None
        if tx is not None and rx is not None and r.capacity_bps > 0:
            util = max(tx, rx) / r.capacity_bps
        ws = r.window_samples
        links.append(
            LinkRates(
                device=r.device,
                link=r.link,
                tx_bytes_per_second=tx,
                rx_bytes_per_second=rx,
                stall_cycles_per_microsecond=None if stall is None else stall / 1e6,
                replay_errors_per_second=replay,
                crc_errors_per_second=crc,
                utilisation=util,
                window_samples=ws,
                window_max_utilisation=r.window_max_util / UTIL_ONE,
                window_max_stall_cycles_per_microsecond=r.window_max_stall,
                window_stall_over_threshold_ratio=r.window_over_stall / ws if ws else None,
                window_utilisation_over_threshold_ratio=r.window_over_util / ws if ws else None,
                device_gone=r.device_gone,
            )
        )
    samples = None
    if cur.header.sequence >= prev.header.sequence and secs > 0:
        samples = (cur.header.sequence - prev.header.sequence) / secs
    missed = max(0, cur.header.window_ticks - cur.header.window_samples)
    return NvlinkKmodRates(secs, samples, missed, tuple(links))


def link_rates(prev: NvlinkKmodData, cur: NvlinkKmodData, seconds: float) -> NvlinkKmodRates | None:
    """The rates of this source between two records. A snapshot file read twice before it
    was rewritten (same sequence and sample time) has no new samples: no rates, not zeros."""
    if prev.snapshot is None or cur.snapshot is None:
        return None
    p, c = prev.snapshot.header, cur.snapshot.header
    if c.timestamp_ns and (p.sequence, p.timestamp_ns) == (c.sequence, c.timestamp_ns):
        return None
    return snapshot_rates(prev.snapshot, cur.snapshot, seconds)
