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

from nodescope.model.counters import counter_rate
from nodescope.model.gpu_health import GpuHealth
from nodescope.model.nvlink_graph import BondedPair, NvLinkGraph
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
    nvlinks: tuple[NvLinkSample, ...]
    #: calls and fields this GPU answered NOT_SUPPORTED to (not asked again)
    unsupported: tuple[str, ...]


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


@dataclass(frozen=True, slots=True)
class GpuRates:
    index: int
    uuid: str
    pcie_tx_bytes_per_second: float | None
    pcie_rx_bytes_per_second: float | None
    #: "counter" (fields 197/198 over the interval) or "throughput-20ms" (a snapshot)
    pcie_rate_basis: str | None
    nvlinks: tuple[NvLinkRates, ...]


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
        old_links = {link.link: link for link in old.nvlinks}
        links = []
        for link in gpu.nvlinks:
            prev_link = old_links.get(link.link)
            if prev_link is None:
                continue
            links.append(
                NvLinkRates(
                    link.link,
                    _rate(prev_link.data_tx, link.data_tx, seconds),
                    _rate(prev_link.data_rx, link.data_rx, seconds),
                    _rate(prev_link.raw_tx, link.raw_tx, seconds),
                    _rate(prev_link.raw_rx, link.raw_rx, seconds),
                )
            )
        result.append(GpuRates(gpu.index, gpu.uuid, tx, rx, basis, tuple(links)))
    return NvmlRates(tuple(result))
