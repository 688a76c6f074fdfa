"""The records of the ``nvml`` source (the GPUs through NVML), their rates and Xid meanings.

What the records hold, as the source stores it (docs/datasources.md §1): byte counters in
bytes (NVLink throughput fields 138-141 count KiB and are stored multiplied out), each with
the field's own timestamp (µs since the epoch) and the width at which it wraps; the fallback
PCIe throughput as bytes/s over a 20 ms window; the NVLink states, DL error counters, PCIe
link and replay counter as of the last slow read, which the record dates (``NvmlData.slow``).

This module knows nothing of NVML's library: detectors, exporters and the simulated node
read GPU records without loading pynvml.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

from nodescope.model.counters import counter_rate
from nodescope.model.gpu_health import GpuHealth
from nodescope.model.nvlink_graph import BondedPair, NvLinkGraph
from nodescope.model.rows import Rows
from nodescope.model.skips import NOTHING_SKIPPED, Skipped
from nodescope.model.slow import SlowRead
from nodescope.model.slow import slow_pair as _slow_pair
from nodescope.model.source_key import SourceKey

#: Seconds a ``nvmlDeviceGetPcieThroughput`` reading covers (nvml.h: "over a 20ms interval").
PCIE_THROUGHPUT_WINDOW_SECONDS = 0.02

#: ``NvmlData.xid_source``: Xids counted from an NVML event set.
XID_SOURCE_EVENTS = "nvml-events"
#: ``NvmlData.xid_source``: Xids counted from the kernel log (``/dev/kmsg``).
XID_SOURCE_KMSG = "kmsg"

#: Meanings of common Xids. Source of every entry: NVIDIA, "Xid Errors" catalogue,
#: docs.nvidia.com/deploy/xid-errors (the table of Xid numbers and their descriptions).
XID_MEANINGS: dict[int, str] = {
    8: "GPU stopped processing",
    13: "Graphics Engine Exception",
    31: "GPU memory page fault",
    32: "Invalid or corrupted push buffer stream",
    38: "Driver firmware error",
    43: "GPU stopped processing",
    45: "Preemptive cleanup, due to previous errors",
    48: "Double Bit ECC Error",
    61: "Internal micro-controller breakpoint/warning",
    62: "Internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure",
    68: "NVDEC0 Exception",
    69: "Graphics Engine class error",
    74: "NVLINK Error",
    79: "GPU has fallen off the bus",
    92: "High single-bit ECC error rate",
    94: "Contained ECC error",
    95: "Uncontained ECC error",
    109: "Context Switch Timeout Error",
    119: "GSP RPC Timeout",
    120: "GSP Error",
    140: "Unrecovered ECC Error",
}


# --------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True, slots=True)
class CounterValue:
    """A cumulative counter read from a field: ``value`` in bytes, the field's own timestamp
    (µs since the epoch, ``None`` when the driver gave none) and the width at which the
    count wraps (``None``: unknown, a decrease is then a reset)."""

    value: int
    timestamp_us: int | None
    bits: int | None


@dataclass(frozen=True, slots=True)
class PcieSnapshot:
    """``nvmlDeviceGetPcieThroughput``: bytes/s over a ``window_seconds`` window, not an
    average over the poll interval."""

    tx_bytes_per_second: int | None
    rx_bytes_per_second: int | None
    window_seconds: float = PCIE_THROUGHPUT_WINDOW_SECONDS


@dataclass(frozen=True, slots=True)
class NvLinkSample:
    link: int
    active: bool | None
    remote_type: str | None
    remote_pci_address: str | None
    data_tx: CounterValue | None
    data_rx: CounterValue | None
    raw_tx: CounterValue | None
    raw_rx: CounterValue | None
    #: DL error counter name ("replay", "recovery", "crc_flit", "crc_data") -> value, only
    #: the counters the GPU answers
    errors: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class CounterColumn:
    """One counter of each link of a GPU: the ``i``-th item of each tuple is link ``i``'s
    :class:`CounterValue` (``values[i]`` ``None``: not read)."""

    values: tuple[int | None, ...] = ()
    stamps: tuple[int | None, ...] = ()
    bits: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        if not len(self.values) == len(self.stamps) == len(self.bits):
            raise ValueError("a counter column's values, stamps and widths differ in length")

    @classmethod
    def of(cls, counters: Sequence[CounterValue | None]) -> CounterColumn:
        return cls(
            tuple(None if c is None else c.value for c in counters),
            tuple(None if c is None else c.timestamp_us for c in counters),
            tuple(None if c is None else c.bits for c in counters),
        )

    def __getitem__(self, index: int) -> CounterValue | None:
        value = self.values[index]
        return None if value is None else CounterValue(value, self.stamps[index], self.bits[index])


@dataclass(frozen=True, slots=True)
class NvLinks(Rows[NvLinkSample]):
    """A GPU's NVLinks held as columns: the ``i``-th item of each field is link ``i``'s.

    A node's GPUs report 144 links every second, and every reader of all of them (the rates,
    the exporter, the NVLink graph, the error check) reads a field of each: as rows they were
    144 records and 576 counter objects a cycle. ``links[i]`` and iteration make
    :class:`NvLinkSample` rows on demand, for readers of one link or of a few.
    """

    link: tuple[int, ...] = ()
    active: tuple[bool | None, ...] = ()
    remote_type: tuple[str | None, ...] = ()
    remote_pci_address: tuple[str | None, ...] = ()
    data_tx: CounterColumn = CounterColumn()
    data_rx: CounterColumn = CounterColumn()
    raw_tx: CounterColumn = CounterColumn()
    raw_rx: CounterColumn = CounterColumn()
    #: per link, its DL error counters (name, value): only the counters the GPU answers
    errors: tuple[tuple[tuple[str, int], ...], ...] = ()

    def __post_init__(self) -> None:
        n = len(self.link)
        lengths = {
            len(self.active),
            len(self.remote_type),
            len(self.remote_pci_address),
            len(self.errors),
            *(len(c.values) for c in (self.data_tx, self.data_rx, self.raw_tx, self.raw_rx)),
        }
        if lengths - {n}:
            raise ValueError(f"link columns of {sorted(lengths)} links, not all {n}")

    @classmethod
    def of(cls, links: Sequence[NvLinkSample]) -> NvLinks:
        """The columns of ``links`` (rows: a test's, a replay's)."""
        return cls(
            link=tuple(x.link for x in links),
            active=tuple(x.active for x in links),
            remote_type=tuple(x.remote_type for x in links),
            remote_pci_address=tuple(x.remote_pci_address for x in links),
            data_tx=CounterColumn.of([x.data_tx for x in links]),
            data_rx=CounterColumn.of([x.data_rx for x in links]),
            raw_tx=CounterColumn.of([x.raw_tx for x in links]),
            raw_rx=CounterColumn.of([x.raw_rx for x in links]),
            errors=tuple(x.errors for x in links),
        )

    def __len__(self) -> int:
        return len(self.link)

    def row(self, index: int) -> NvLinkSample:
        return NvLinkSample(
            self.link[index],
            self.active[index],
            self.remote_type[index],
            self.remote_pci_address[index],
            self.data_tx[index],
            self.data_rx[index],
            self.raw_tx[index],
            self.raw_rx[index],
            self.errors[index],
        )


@dataclass(frozen=True, slots=True)
class GpuProcess:
    pid: int
    used_memory_bytes: int | None


@dataclass(frozen=True, slots=True)
class GpuSample:
    index: int
    uuid: str
    name: str
    pci_address: str
    pcie_tx: CounterValue | None
    pcie_rx: CounterValue | None
    pcie_snapshot: PcieSnapshot | None
    #: "fields" (197/198), "throughput-20ms" (the fallback) or None
    pcie_bytes_source: str | None
    pcie_gen_current: int | None
    pcie_width_current: int | None
    pcie_gen_max: int | None
    pcie_width_max: int | None
    pcie_replays: int | None
    gpu_util_percent: int | None
    memory_util_percent: int | None
    decoder_util_percent: int | None
    encoder_util_percent: int | None
    jpeg_util_percent: int | None
    processes: tuple[GpuProcess, ...]
    #: held as columns; rows given (a test's) are made columns
    nvlinks: NvLinks
    #: calls and fields this GPU answered NOT_SUPPORTED to (not asked again)
    unsupported: tuple[str, ...]

    def __post_init__(self) -> None:
        links: object = self.nvlinks
        if not isinstance(links, NvLinks):
            rows = cast(Sequence[NvLinkSample], links)
            object.__setattr__(self, "nvlinks", NvLinks.of(rows))


@dataclass(frozen=True, slots=True)
class XidCount:
    """Xid critical errors of one GPU and code since the source started. ``gpu`` is ``None``
    for a device that NVML does not list (seen only in the kernel log)."""

    gpu: int | None
    pci_address: str
    xid: int
    count: int


@dataclass(frozen=True, slots=True)
class NvmlEvent:
    """Something that happened to a GPU (``kind`` ``"gpu_lost"``), with Unix time."""

    kind: str
    gpu: int
    uuid: str
    pci_address: str
    wall_time: float
    detail: str


@dataclass(frozen=True, slots=True)
class LostGpu:
    gpu: int
    uuid: str
    pci_address: str


@dataclass(frozen=True, slots=True)
class NvmlData:
    device_count: int
    gpus: tuple[GpuSample, ...]
    lost: tuple[LostGpu, ...]
    xids: tuple[XidCount, ...]
    #: XID_SOURCE_EVENTS, XID_SOURCE_KMSG, or None while neither is available
    xid_source: str | None
    events: tuple[NvmlEvent, ...]
    #: which source served the NVLink figures of this record
    nvlink_data_source: str = "nvml"
    #: each GPU's health as of the last health read (carried between reads; each record
    #: dates itself), in GPU order; empty before the first read
    health: tuple[GpuHealth, ...] = ()
    #: health values this run dropped as no GPU could answer them (counted per source)
    skipped: Skipped = field(default=NOTHING_SKIPPED, compare=False)
    #: when the slowly-read values (link states and error counters, PCIe link and replays)
    #: were read, on the source's ``wall_clock``, and the record of the read before;
    #: ``None`` in a record that does not say (see :func:`slow_pair`)
    slow: SlowRead[NvmlData] | None = field(default=None, compare=False, repr=False)


#: The ``nvml`` source's records: the node's GPUs.
NVML = SourceKey("nvml", NvmlData)


def slow_pair(
    previous: NvmlData, current: NvmlData, seconds: float
) -> tuple[NvmlData, float] | None:
    """The record to take the change of the slowly-read counters (NVLink errors, PCIe
    replays) of ``current`` against, and the seconds between them: ``previous`` (read
    ``seconds`` before) when both read those counters, else the record of the slow read
    before the one ``current`` carries (see :mod:`nodescope.model.slow`)."""
    return _slow_pair(previous, previous.slow, current.slow, seconds)


# --------------------------------------------------------------------------------------------
# NV# link counting (docs/datasources.md §9)


def nvlink_pairs(gpus: Sequence[GpuSample]) -> tuple[BondedPair, ...]:
    """NV# per GPU pair (``nvidia-smi topo -m``), counted by the NVLink graph model."""
    return NvLinkGraph.from_gpus(gpus).bonded_pairs()


# --------------------------------------------------------------------------------------------
# Rates


@dataclass(frozen=True, slots=True)
class NvLinkRates:
    link: int
    data_tx_bytes_per_second: float | None
    data_rx_bytes_per_second: float | None
    raw_tx_bytes_per_second: float | None
    raw_rx_bytes_per_second: float | None


Rates = tuple[float | None, ...]


@dataclass(frozen=True, slots=True)
class NvLinkRatesTable(Rows[NvLinkRates]):
    """The rates of a GPU's links held as columns, in the order of its links;
    ``table[i]`` and iteration make :class:`NvLinkRates` rows on demand."""

    link: tuple[int, ...] = ()
    data_tx_bytes_per_second: Rates = ()
    data_rx_bytes_per_second: Rates = ()
    raw_tx_bytes_per_second: Rates = ()
    raw_rx_bytes_per_second: Rates = ()

    def __len__(self) -> int:
        return len(self.link)

    def row(self, index: int) -> NvLinkRates:
        return NvLinkRates(
            self.link[index],
            self.data_tx_bytes_per_second[index],
            self.data_rx_bytes_per_second[index],
            self.raw_tx_bytes_per_second[index],
            self.raw_rx_bytes_per_second[index],
        )


@dataclass(frozen=True, slots=True)
class GpuRates:
    index: int
    uuid: str
    pcie_tx_bytes_per_second: float | None
    pcie_rx_bytes_per_second: float | None
    #: "counter" (fields 197/198 over the interval) or "throughput-20ms" (a snapshot)
    pcie_rate_basis: str | None
    #: the links of the GPU read in both records, in its current order
    nvlinks: NvLinkRatesTable


@dataclass(frozen=True, slots=True)
class NvmlRates:
    gpus: tuple[GpuRates, ...]


def _rate(prev: CounterValue | None, cur: CounterValue | None, seconds: float) -> float | None:
    """Bytes/s between two readings, over the fields' own timestamps when both have one
    (they say when the driver sampled, which the poll clock does not)."""
    if prev is None or cur is None:
        return None
    if prev.timestamp_us is not None and cur.timestamp_us is not None:
        if cur.timestamp_us <= prev.timestamp_us:
            return None
        seconds = (cur.timestamp_us - prev.timestamp_us) / 1e6
    bits = cur.bits if cur.bits == prev.bits else None
    return counter_rate(prev.value, cur.value, seconds, bits)


def _column_rates(
    before: CounterColumn, now: CounterColumn, at: Sequence[int], seconds: float
) -> Rates:
    """:func:`_rate` of each link: ``at[i]`` is the position in ``before`` of the link at
    position ``i`` in ``now``."""
    values, stamps, bits = before.values, before.stamps, before.bits
    out: list[float | None] = []
    for i, value, stamp, width in zip(at, now.values, now.stamps, now.bits, strict=True):
        old = values[i]
        if old is None or value is None:
            out.append(None)
            continue
        old_stamp, span = stamps[i], seconds
        if old_stamp is not None and stamp is not None:
            if stamp <= old_stamp:
                out.append(None)
                continue
            span = (stamp - old_stamp) / 1e6
        if value >= old >= 0 and span > 0:
            out.append((value - old) / span)  # the plain increase, as counter_rate has it
        else:
            out.append(counter_rate(old, value, span, width if width == bits[i] else None))
    return tuple(out)


def _link_rates(before: NvLinks, now: NvLinks, seconds: float) -> NvLinkRatesTable:
    """The rates of the links of ``now`` that ``before`` has too (matched by link number)."""
    if before.link == now.link:
        at: Sequence[int] = range(len(now))
        kept = now.link
    else:
        position = {n: i for i, n in enumerate(before.link)}
        pairs = [(position[n], n) for n in now.link if n in position]
        at = [i for i, _ in pairs]
        kept = tuple(n for _, n in pairs)
        now = now if len(kept) == len(now) else _only(now, kept)
    return NvLinkRatesTable(
        kept,
        _column_rates(before.data_tx, now.data_tx, at, seconds),
        _column_rates(before.data_rx, now.data_rx, at, seconds),
        _column_rates(before.raw_tx, now.raw_tx, at, seconds),
        _column_rates(before.raw_rx, now.raw_rx, at, seconds),
    )


def _only(links: NvLinks, numbers: tuple[int, ...]) -> NvLinks:
    """The links of ``links`` numbered ``numbers``, in that order."""
    rows = {x.link: x for x in links}
    return NvLinks.of([rows[n] for n in numbers])


def gpu_rates(previous: NvmlData, current: NvmlData, seconds: float) -> NvmlRates:
    """PCIe and per-link NVLink bytes/s of every GPU present in both records (by UUID).

    Fields 197/198 are taken to wrap at the width their ``valueType`` reports (nvml.h states
    no width: docs/datasources.md §1.4); a decrease that is not one wrap is a reset and gives
    no rate.
    """
    before = {g.uuid: g for g in previous.gpus}
    result: list[GpuRates] = []
    for gpu in current.gpus:
        old = before.get(gpu.uuid)
        if old is None:
            continue
        tx = _rate(old.pcie_tx, gpu.pcie_tx, seconds)
        rx = _rate(old.pcie_rx, gpu.pcie_rx, seconds)
        basis: str | None = "counter" if tx is not None or rx is not None else None
        if basis is None and gpu.pcie_snapshot is not None:
            snap = gpu.pcie_snapshot
            tx = None if snap.tx_bytes_per_second is None else float(snap.tx_bytes_per_second)
            rx = None if snap.rx_bytes_per_second is None else float(snap.rx_bytes_per_second)
            basis = "throughput-20ms"
        links = _link_rates(old.nvlinks, gpu.nvlinks, seconds)
        result.append(GpuRates(gpu.index, gpu.uuid, tx, rx, basis, links))
    return NvmlRates(tuple(result))
