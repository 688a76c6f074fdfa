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

from collections.abc import Iterable
from dataclasses import dataclass, field, fields

from nodescope.model.counters import column_rates, counter_rate
from nodescope.model.rows import Rows
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


#: One field of every record of a snapshot, in record order.
Column = tuple[int, ...]


def _columns(n: int) -> tuple[Column, ...]:
    return ((),) * n


@dataclass(frozen=True, slots=True)
class NvlcRecords(Rows[NvlcRecord]):
    """The records of one snapshot, held as columns: a tuple per field (per element for the
    array fields) whose item ``i`` is record ``i``'s. A reader of every link reads a column
    (the rates, the detector, the exporter's families); ``records[i]`` and iteration make
    :class:`NvlcRecord` rows on demand, for readers of one link or of a few.

    A daemon reads 144 links every second: as rows they were 144 new objects a cycle, each
    with six tuples, walked again by every reader; as columns a snapshot is about a hundred
    tuples that the parser takes in C from the bytes, and readers work over whole columns.
    """

    device: Column = ()
    link: Column = ()
    flags: Column = ()
    capacity_bps: Column = ()
    counters: tuple[Column, ...] = _columns(NUM_COUNTERS)
    samples: Column = ()
    window_samples: Column = ()
    window_max_delta: tuple[Column, ...] = _columns(NUM_COUNTERS)
    window_max_util: Column = ()
    window_max_stall: Column = ()
    window_over_stall: Column = ()
    window_over_util: Column = ()
    window_util_hist: tuple[Column, ...] = _columns(HIST_BUCKETS)
    window_stall_hist: tuple[Column, ...] = _columns(HIST_BUCKETS)
    util_hist: tuple[Column, ...] = _columns(HIST_BUCKETS)
    stall_hist: tuple[Column, ...] = _columns(HIST_BUCKETS)

    def __post_init__(self) -> None:
        n = len(self.device)
        arrays = (
            ("counters", self.counters, NUM_COUNTERS),
            ("window_max_delta", self.window_max_delta, NUM_COUNTERS),
            ("window_util_hist", self.window_util_hist, HIST_BUCKETS),
            ("window_stall_hist", self.window_stall_hist, HIST_BUCKETS),
            ("util_hist", self.util_hist, HIST_BUCKETS),
            ("stall_hist", self.stall_hist, HIST_BUCKETS),
        )
        scalars = (
            self.device,
            self.link,
            self.flags,
            self.capacity_bps,
            self.samples,
            self.window_samples,
            self.window_max_util,
            self.window_max_stall,
            self.window_over_stall,
            self.window_over_util,
        )
        lengths = {len(c) for c in scalars} | {len(c) for _, each, _ in arrays for c in each}
        if lengths - {n}:
            raise ValueError(f"columns of {sorted(lengths)} records, not all {n}")
        for name, columns, width in arrays:
            if len(columns) != width:
                raise ValueError(f"{name}: {len(columns)} columns, not {width}")

    @classmethod
    def of(cls, records: Iterable[NvlcRecord]) -> NvlcRecords:
        """The columns of ``records`` (rows, e.g. the simulated module's or a test's)."""
        rows = list(records)

        def each(arrays: list[tuple[int, ...]], width: int) -> tuple[Column, ...]:
            return tuple(zip(*arrays, strict=True)) if rows else _columns(width)

        return cls(
            device=tuple(r.device for r in rows),
            link=tuple(r.link for r in rows),
            flags=tuple(r.flags for r in rows),
            capacity_bps=tuple(r.capacity_bps for r in rows),
            counters=each([r.counters for r in rows], NUM_COUNTERS),
            samples=tuple(r.samples for r in rows),
            window_samples=tuple(r.window_samples for r in rows),
            window_max_delta=each([r.window_max_delta for r in rows], NUM_COUNTERS),
            window_max_util=tuple(r.window_max_util for r in rows),
            window_max_stall=tuple(r.window_max_stall for r in rows),
            window_over_stall=tuple(r.window_over_stall for r in rows),
            window_over_util=tuple(r.window_over_util for r in rows),
            window_util_hist=each([r.window_util_hist for r in rows], HIST_BUCKETS),
            window_stall_hist=each([r.window_stall_hist for r in rows], HIST_BUCKETS),
            util_hist=each([r.util_hist for r in rows], HIST_BUCKETS),
            stall_hist=each([r.stall_hist for r in rows], HIST_BUCKETS),
        )

    def __len__(self) -> int:
        return len(self.device)

    def row(self, index: int) -> NvlcRecord:
        return NvlcRecord(
            device=self.device[index],
            link=self.link[index],
            flags=self.flags[index],
            capacity_bps=self.capacity_bps[index],
            counters=tuple(c[index] for c in self.counters),
            samples=self.samples[index],
            window_samples=self.window_samples[index],
            window_max_delta=tuple(c[index] for c in self.window_max_delta),
            window_max_util=self.window_max_util[index],
            window_max_stall=self.window_max_stall[index],
            window_over_stall=self.window_over_stall[index],
            window_over_util=self.window_over_util[index],
            window_util_hist=tuple(c[index] for c in self.window_util_hist),
            window_stall_hist=tuple(c[index] for c in self.window_stall_hist),
            util_hist=tuple(c[index] for c in self.util_hist),
            stall_hist=tuple(c[index] for c in self.stall_hist),
        )

    def has_counter(self, index: int) -> tuple[bool, ...]:
        """Per record, whether its source provides the counter ``COUNTER_NAMES[index]``."""
        bit = 1 << (LINK_COUNTER_SHIFT + index)
        return tuple([bool(f & bit) for f in self.flags])

    @property
    def device_gone(self) -> tuple[bool, ...]:
        """Per record, whether the device holding the link's counters is gone."""
        return tuple([bool(f & LINK_DEVICE_GONE) for f in self.flags])


@dataclass(frozen=True, slots=True)
class NvlcSnapshot:
    header: NvlcHeader
    records: NvlcRecords


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


Rate = tuple[float | None, ...]


@dataclass(frozen=True, slots=True)
class LinkRatesTable(Rows[LinkRates]):
    """Every link's :class:`LinkRates`, held as columns in the order of the snapshot's
    records (see :class:`NvlcRecords`); ``table[i]`` and iteration make rows on demand."""

    device: Column = ()
    link: Column = ()
    tx_bytes_per_second: Rate = ()
    rx_bytes_per_second: Rate = ()
    stall_cycles_per_microsecond: Rate = ()
    replay_errors_per_second: Rate = ()
    crc_errors_per_second: Rate = ()
    utilisation: Rate = ()
    window_samples: Column = ()
    window_max_utilisation: tuple[float, ...] = ()
    window_max_stall_cycles_per_microsecond: Column = ()
    window_stall_over_threshold_ratio: Rate = ()
    window_utilisation_over_threshold_ratio: Rate = ()
    device_gone: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.device)
        if any(len(getattr(self, f.name)) != n for f in fields(self)):
            raise ValueError(f"columns of different lengths (links: {n})")

    def __len__(self) -> int:
        return len(self.device)

    def row(self, index: int) -> LinkRates:
        return LinkRates(**{f.name: getattr(self, f.name)[index] for f in fields(self)})


@dataclass(frozen=True, slots=True)
class NvlinkKmodRates:
    seconds: float
    samples_per_second: float | None
    missed_ticks: int
    links: LinkRatesTable


def interval_seconds(prev: NvlcSnapshot, cur: NvlcSnapshot, seconds: float) -> float:
    """The time between two snapshots: the module's sample timestamps when they are usable
    (they date the counters exactly), else the reader's measured ``seconds``."""
    if cur.header.timestamp_ns > prev.header.timestamp_ns > 0:
        return (cur.header.timestamp_ns - prev.header.timestamp_ns) / 1e9
    return seconds


def _counter_rates(before: NvlcRecords, now: NvlcRecords, seconds: float) -> list[Rate]:
    """Per counter, each link's rate; ``None`` for a link ``before`` did not have."""
    if before.device == now.device and before.link == now.link:
        # The same links in the same order, as every read of one module gives them.
        return [
            column_rates(b, c, seconds) for b, c in zip(before.counters, now.counters, strict=True)
        ]
    at = {key: i for i, key in enumerate(zip(before.device, before.link, strict=True))}
    where = [at.get(key) for key in zip(now.device, now.link, strict=True)]
    return [
        tuple(
            [
                None if i is None else counter_rate(b[i], value, seconds)
                for i, value in zip(where, c, strict=True)
            ]
        )
        for b, c in zip(before.counters, now.counters, strict=True)
    ]


def _ratio(counts: Column, samples: Column) -> Rate:
    return tuple([n / s if s else None for n, s in zip(counts, samples, strict=True)])


def snapshot_rates(prev: NvlcSnapshot, cur: NvlcSnapshot, seconds: float) -> NvlinkKmodRates:
    """Pure: per-link rates and window figures from two snapshots of one reader."""
    secs = interval_seconds(prev, cur, seconds)
    now = cur.records
    tx, rx, stall, replay, crc = _counter_rates(prev.records, now, secs)
    util = tuple(
        [
            max(t, r) / capacity if t is not None and r is not None and capacity > 0 else None
            for t, r, capacity in zip(tx, rx, now.capacity_bps, strict=True)
        ]
    )
    ws = now.window_samples
    links = LinkRatesTable(
        device=now.device,
        link=now.link,
        tx_bytes_per_second=tx,
        rx_bytes_per_second=rx,
        stall_cycles_per_microsecond=tuple([None if s is None else s / 1e6 for s in stall]),
        replay_errors_per_second=replay,
        crc_errors_per_second=crc,
        utilisation=util,
        window_samples=ws,
        window_max_utilisation=tuple([u / UTIL_ONE for u in now.window_max_util]),
        window_max_stall_cycles_per_microsecond=now.window_max_stall,
        window_stall_over_threshold_ratio=_ratio(now.window_over_stall, ws),
        window_utilisation_over_threshold_ratio=_ratio(now.window_over_util, ws),
        device_gone=now.device_gone,
    )
    samples = None
    if cur.header.sequence >= prev.header.sequence and secs > 0:
        samples = (cur.header.sequence - prev.header.sequence) / secs
    missed = max(0, cur.header.window_ticks - cur.header.window_samples)
    return NvlinkKmodRates(secs, samples, missed, links)


def link_rates(prev: NvlinkKmodData, cur: NvlinkKmodData, seconds: float) -> NvlinkKmodRates | None:
    """The rates of this source between two records. A snapshot file read twice before it
    was rewritten (same sequence and sample time) has no new samples: no rates, not zeros."""
    if prev.snapshot is None or cur.snapshot is None:
        return None
    p, c = prev.snapshot.header, cur.snapshot.header
    if c.timestamp_ns and (p.sequence, p.timestamp_ns) == (c.sequence, c.timestamp_ns):
        return None
    return snapshot_rates(prev.snapshot, cur.snapshot, seconds)
