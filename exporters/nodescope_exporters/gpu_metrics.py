"""Metrics of the NVML source (NVML): per GPU, per NVLink, Xids.

Series are labelled by ``gpu`` (the NVML index) and joined to UUID, name and PCI address
through ``nodescope_gpu_info``. Cumulative counters are exported as counters; the one PCIe
figure NVML gives only as a 20 ms snapshot (where fields 197/198 are not supported) is a gauge
that says so. Per NVLink: state, peer, payload bytes and the error counters (what names a
bad link); bytes with protocol overhead are summed per GPU. A GPU NVML lost stops having
series, except ``nodescope_gpu_lost_info`` and its Xid counters (Xid 79 is how a GPU falls
off the bus). Which source served the NVLink figures (``nodescope_nvlink_data_source_info``)
is decided here, for NVML and the nvlink_counter module alike (:func:`nvlink_data_source`).

Health (``NvmlData.health``, read on its own cadence: docs/datasources.md §1.8) is exported in
base units: °C, watts, hertz, bytes, ratios 0-1. A value the GPU did not answer has no series;
the calls it answered NOT_SUPPORTED to are named by ``nodescope_gpu_health_unsupported_info``.
Each clock-event reason has a series, 0 or 1, and so does each fabric state: a reason that
clears reads 0 rather than vanishing, which ``for:`` clauses and dashboards need.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from nodescope.model.gpu_health import (
    CLOCK_EVENT_REASONS,
    FABRIC_STATE_NOT_SUPPORTED,
    FABRIC_STATES,
    GpuHealth,
)
from nodescope.model.nvlink_graph import NvLinkGraph
from nodescope.model.nvlink_kmod import NVLINK_KMOD
from nodescope.model.nvml import NVML, XID_MEANINGS, CounterColumn, NvLinks, NvmlData
from nodescope.model.snapshot import Snapshot
from nodescope_exporters.catalog import Metric, metric
from nodescope_exporters.kept import KeptFamilies, kept_or_built

AREA = "gpu"

GPU_INFO = metric(
    "nodescope_gpu_info",
    "info",
    "a GPU NVML lists: index, UUID, product name and sysfs PCI address; value 1",
    ("gpu", "uuid", "name", "pci_address"),
    area=AREA,
)
GPU_LOST = metric(
    "nodescope_gpu_lost_info",
    "info",
    "a GPU that NVML reported lost (GPU_IS_LOST) since the daemon started; value 1",
    ("gpu", "uuid", "pci_address"),
    area=AREA,
)
PCIE_TX = metric(
    "nodescope_gpu_pcie_tx_bytes_total",
    "counter",
    "bytes the GPU transmitted on PCIe (NVML field 197; wraps, see rate())",
    ("gpu",),
    area=AREA,
)
PCIE_RX = metric(
    "nodescope_gpu_pcie_rx_bytes_total",
    "counter",
    "bytes the GPU received on PCIe (NVML field 198)",
    ("gpu",),
    area=AREA,
)
PCIE_SNAPSHOT = metric(
    "nodescope_gpu_pcie_snapshot_bytes_per_second",
    "gauge",
    "PCIe throughput over a 20 ms window (nvmlDeviceGetPcieThroughput), only where fields "
    "197/198 are not supported: a snapshot, not an average over the scrape interval",
    ("gpu", "direction"),
    area=AREA,
)
PCIE_GEN = metric(
    "nodescope_gpu_pcie_link_generation",
    "gauge",
    "current PCIe link generation (falls at idle to save power)",
    ("gpu",),
    area=AREA,
)
PCIE_GEN_MAX = metric(
    "nodescope_gpu_pcie_link_max_generation",
    "gauge",
    "maximum PCIe link generation possible with this GPU and system",
    ("gpu",),
    area=AREA,
)
PCIE_WIDTH = metric(
    "nodescope_gpu_pcie_link_width_lanes",
    "gauge",
    "current PCIe link width",
    ("gpu",),
    area=AREA,
)
PCIE_WIDTH_MAX = metric(
    "nodescope_gpu_pcie_link_max_width_lanes",
    "gauge",
    "maximum PCIe link width possible with this GPU and system",
    ("gpu",),
    area=AREA,
)
PCIE_REPLAYS = metric(
    "nodescope_gpu_pcie_replays_total",
    "counter",
    "PCIe replays counted by the GPU (nvmlDeviceGetPcieReplayCounter)",
    ("gpu",),
    area=AREA,
)
UTILIZATION = metric(
    "nodescope_gpu_utilization_ratio",
    "gauge",
    "fraction of the last sample period the engine was busy (gpu, memory, decoder, "
    "encoder, jpeg), 0-1",
    ("gpu", "engine"),
    area=AREA,
)
PROCESSES = metric(
    "nodescope_gpu_compute_processes",
    "gauge",
    "processes with a compute context on the GPU",
    ("gpu",),
    area=AREA,
)
PROCESS_MEMORY = metric(
    "nodescope_gpu_process_memory_used_bytes",
    "gauge",
    "GPU memory used by compute processes, summed over those that report it",
    ("gpu",),
    area=AREA,
)
NVLINK_INFO = metric(
    "nodescope_gpu_nvlink_info",
    "info",
    "an NVLink of a GPU and its peer: remote type (gpu, switch, ibmnpu, unknown) and the "
    "peer's PCI address; value 1",
    ("gpu", "link", "remote_type", "remote_pci_address"),
    area=AREA,
)
NVLINK_UP = metric(
    "nodescope_gpu_nvlink_up",
    "gauge",
    "1 if the NVLink is active, 0 if not",
    ("gpu", "link"),
    area=AREA,
)
NVLINK_DATA_TX = metric(
    "nodescope_gpu_nvlink_data_tx_bytes_total",
    "counter",
    "payload bytes sent on the NVLink (NVML field 138, KiB x 1024)",
    ("gpu", "link"),
    area=AREA,
)
NVLINK_DATA_RX = metric(
    "nodescope_gpu_nvlink_data_rx_bytes_total",
    "counter",
    "payload bytes received on the NVLink (NVML field 139)",
    ("gpu", "link"),
    area=AREA,
)
NVLINK_RAW_TX = metric(
    "nodescope_gpu_nvlink_raw_tx_bytes_total",
    "counter",
    "bytes sent on the GPU's NVLinks including protocol overhead (NVML field 140), summed "
    "over the links",
    ("gpu",),
    area=AREA,
)
NVLINK_RAW_RX = metric(
    "nodescope_gpu_nvlink_raw_rx_bytes_total",
    "counter",
    "bytes received on the GPU's NVLinks including protocol overhead (NVML field 141), "
    "summed over the links",
    ("gpu",),
    area=AREA,
)
NVLINK_ERRORS = metric(
    "nodescope_gpu_nvlink_errors_total",
    "counter",
    "NVLink data-link errors by counter (replay, recovery, crc_flit, crc_data); another "
    "tool may reset them",
    ("gpu", "link", "counter"),
    area=AREA,
)
NVLINK_BONDED = metric(
    "nodescope_gpu_nvlink_bonded_links",
    "gauge",
    "active NVLinks joining the GPU to the peer GPU, directly or through NVSwitches: the NV# "
    "of nvidia-smi topo -m; 0 where the pair talks over PCIe only. Only GPUs with NVLinks",
    ("gpu", "peer_gpu"),
    area=AREA,
)
XID_ERRORS = metric(
    "nodescope_gpu_xid_errors_total",
    "counter",
    "Xid critical errors seen since the daemon started, by GPU index (the PCI address for "
    "a device NVML does not list) and Xid code",
    ("gpu", "xid"),
    area=AREA,
)
XID_INFO = metric(
    "nodescope_xid_info",
    "info",
    "meaning of an Xid code seen on this node, from NVIDIA's Xid catalogue; value 1",
    ("xid", "meaning"),
    area=AREA,
)
XID_SOURCE = metric(
    "nodescope_gpu_xid_source_info",
    "info",
    "where Xids are counted from: nvml-events or kmsg (the kernel log); value 1",
    ("source",),
    area=AREA,
)
NVLINK_SOURCE = metric(
    "nodescope_nvlink_data_source_info",
    "info",
    "which source served the NVLink figures; value 1",
    ("source",),
    area=AREA,
)

# -- health ------------------------------------------------------------------------------------

ECC_ERRORS = metric(
    "nodescope_gpu_ecc_errors_total",
    "counter",
    "ECC errors the GPU counted (nvmlDeviceGetTotalEccErrors), by type (corrected, "
    "uncorrected) and counter: volatile since the driver loaded (starts again from 0 when "
    "the driver reloads or the GPU is reset), aggregate over the GPU's life",
    ("gpu", "type", "counter"),
    area=AREA,
)
RETIRED_PAGES = metric(
    "nodescope_gpu_retired_pages",
    "gauge",
    "framebuffer pages retired, by cause (single_bit_ecc, double_bit_ecc); GPUs before "
    "Ampere (later ones remap rows instead)",
    ("gpu", "cause"),
    area=AREA,
)
RETIRED_PAGES_PENDING = metric(
    "nodescope_gpu_retired_pages_pending",
    "gauge",
    "1 while a page retirement waits for the next driver reload or GPU reset, else 0",
    ("gpu",),
    area=AREA,
)
REMAPPED_ROWS = metric(
    "nodescope_gpu_remapped_rows",
    "gauge",
    "memory rows remapped to spare rows (nvmlDeviceGetRemappedRows), by the errors that "
    "caused it (correctable, uncorrectable)",
    ("gpu", "type"),
    area=AREA,
)
ROW_REMAP_PENDING = metric(
    "nodescope_gpu_row_remap_pending",
    "gauge",
    "1 while a row remap waits for the next GPU reset (reset the GPU when its job ends), else 0",
    ("gpu",),
    area=AREA,
)
ROW_REMAP_FAILED = metric(
    "nodescope_gpu_row_remap_failed",
    "gauge",
    "1 when a row remap failed (no spare row left in the bank: replace the GPU), else 0",
    ("gpu",),
    area=AREA,
)
TEMPERATURE = metric(
    "nodescope_gpu_temperature_celsius",
    "gauge",
    "temperature of the GPU die (sensor gpu) and of its memory (sensor memory, NVML field "
    "NVML_FI_DEV_MEMORY_TEMP)",
    ("gpu", "sensor"),
    area=AREA,
)
TEMPERATURE_THRESHOLD = metric(
    "nodescope_gpu_temperature_threshold_celsius",
    "gauge",
    "temperatures at which the GPU slows itself (slowdown) and shuts down (shutdown), and "
    "the highest the GPU and its memory may run at (gpu_max, memory_max)",
    ("gpu", "threshold"),
    area=AREA,
)
POWER = metric(
    "nodescope_gpu_power_watts",
    "gauge",
    "power the board draws (nvmlDeviceGetPowerUsage)",
    ("gpu",),
    area=AREA,
)
POWER_LIMIT = metric(
    "nodescope_gpu_power_limit_watts",
    "gauge",
    "power limits of the board: the management limit set on it (management), the limit "
    "in force, the lowest of all (enforced), and the limit it ships with (default)",
    ("gpu", "limit"),
    area=AREA,
)
CLOCK = metric(
    "nodescope_gpu_clock_hertz",
    "gauge",
    "current SM and memory clock (nvmlDeviceGetClockInfo, MHz x 1e6), and the SM "
    "applications clock the load is meant to run at (applications_sm)",
    ("gpu", "clock"),
    area=AREA,
)
CLOCK_EVENT = metric(
    "nodescope_gpu_clock_event_reason",
    "gauge",
    "1 while the clock-event (throttle) reason holds the clocks back, 0 when not; one series "
    "per reason NVML defines (nvmlDeviceGetCurrentClocksEventReasons)",
    ("gpu", "reason"),
    area=AREA,
)
FB_USED = metric(
    "nodescope_gpu_framebuffer_used_bytes",
    "gauge",
    "framebuffer memory in use (nvmlDeviceGetMemoryInfo)",
    ("gpu",),
    area=AREA,
)
FB_SIZE = metric(
    "nodescope_gpu_framebuffer_size_bytes",
    "gauge",
    "framebuffer memory the GPU has (nvmlDeviceGetMemoryInfo total)",
    ("gpu",),
    area=AREA,
)
FABRIC_STATE = metric(
    "nodescope_gpu_fabric_state",
    "gauge",
    "the GPU's registration with the NVSwitch fabric manager: 1 for the current state "
    "(not_supported, not_started, in_progress, completed), 0 for the others",
    ("gpu", "state"),
    area=AREA,
)
FABRIC_STATUS = metric(
    "nodescope_gpu_fabric_status",
    "gauge",
    "the nvmlReturn_t of the fabric registration: 0 succeeded; meaningful once the state is "
    "completed. Only GPUs on an NVSwitch fabric",
    ("gpu",),
    area=AREA,
)
FABRIC_INFO = metric(
    "nodescope_gpu_fabric_info",
    "info",
    "the NVLink clique the GPU belongs to and the fabric's cluster UUID; value 1. Only GPUs "
    "on an NVSwitch fabric",
    ("gpu", "clique_id", "cluster_uuid"),
    area=AREA,
)
FABRIC_DEGRADED = metric(
    "nodescope_gpu_fabric_bandwidth_degraded",
    "gauge",
    "1 when the fabric's health mask says the GPU's NVLink bandwidth is degraded, 0 when it "
    "says it is not; no series where the driver does not say",
    ("gpu",),
    area=AREA,
)
GPM_WINDOW = metric(
    "nodescope_gpu_gpm_window_seconds",
    "gauge",
    "seconds between the two GPM samples the nodescope_gpu_gpm_* figures cover (Hopper and later)",
    ("gpu",),
    area=AREA,
)
GPM_SM_ACTIVITY = metric(
    "nodescope_gpu_gpm_sm_activity_ratio",
    "gauge",
    "fraction of the SMs busy over the GPM window, 0-1 (NVML_GPM_METRIC_SM_UTIL)",
    ("gpu",),
    area=AREA,
)
GPM_TENSOR_ACTIVITY = metric(
    "nodescope_gpu_gpm_tensor_activity_ratio",
    "gauge",
    "fraction of the GPM window the SMs ran any tensor-core operation, 0-1 "
    "(NVML_GPM_METRIC_ANY_TENSOR_UTIL)",
    ("gpu",),
    area=AREA,
)
GPM_DRAM_BANDWIDTH = metric(
    "nodescope_gpu_gpm_dram_bandwidth_ratio",
    "gauge",
    "DRAM bandwidth used over the GPM window as a fraction of the theoretical maximum, 0-1 "
    "(NVML_GPM_METRIC_DRAM_BW_UTIL)",
    ("gpu",),
    area=AREA,
)
GPM_NVLINK = metric(
    "nodescope_gpu_gpm_nvlink_bytes_per_second",
    "gauge",
    "NVLink traffic over the GPM window, all links, by direction (tx, rx)",
    ("gpu", "direction"),
    area=AREA,
)
GPM_PCIE = metric(
    "nodescope_gpu_gpm_pcie_bytes_per_second",
    "gauge",
    "PCIe traffic over the GPM window by direction (tx: from the GPU, rx: to it)",
    ("gpu", "direction"),
    area=AREA,
)
HEALTH_READ = metric(
    "nodescope_gpu_health_read_timestamp_seconds",
    "gauge",
    "when the health figures of the GPU were read (Unix time): they are read every few "
    "cycles and carried between reads",
    ("gpu",),
    area=AREA,
)
HEALTH_UNSUPPORTED = metric(
    "nodescope_gpu_health_unsupported_info",
    "info",
    "a health call the GPU answered NOT_SUPPORTED to (not asked again): its figures have "
    "no series; value 1",
    ("gpu", "call"),
    area=AREA,
)

# Label values of the health families, built once: each cycle only looks them up.
_REASONS: tuple[tuple[int, str], ...] = tuple(CLOCK_EVENT_REASONS.items())
_FABRIC_STATES: tuple[tuple[int, str], ...] = tuple(FABRIC_STATES.items())


class _LinkStates(NamedTuple):
    """What a GPU's slow read says of its links, as the columns of ``NvLinks`` (they
    satisfy the NVLink graph's ``LinkColumns``)."""

    gpu: int
    pci_address: str
    link: tuple[int, ...]
    active: tuple[bool | None, ...]
    remote_type: tuple[str | None, ...]
    remote_pci_address: tuple[str | None, ...]
    errors: tuple[tuple[tuple[str, int], ...], ...]


@dataclass(frozen=True, slots=True)
class _GraphGpu:
    """A GPU as the NVLink graph reads one (``GpuLike``)."""

    index: int
    pci_address: str
    nvlinks: _LinkStates


def _link_states(data: NvmlData) -> list[_LinkStates]:
    return [
        _LinkStates(
            gpu.index,
            gpu.pci_address,
            links.link,
            links.active,
            links.remote_type,
            links.remote_pci_address,
            links.errors,
        )
        for gpu in data.gpus
        if (links := gpu.nvlinks)
    ]


def _link_state_families(gpus: Sequence[_LinkStates]) -> tuple[Metric, Metric, Metric, Metric]:
    """Per link of each GPU: whether it is up, its peer, its error counters; per GPU pair:
    the bonded links (``NV#``). All of them change only on a slow read."""
    up, info, errors = NVLINK_UP.family(), NVLINK_INFO.family(), NVLINK_ERRORS.family()
    for gpu in gpus:
        g = str(gpu.gpu)
        numbers = [str(n) for n in gpu.link]
        up.add_metrics([(g, n) for n in numbers], [_up(a) for a in gpu.active])
        for n, kind, address in zip(numbers, gpu.remote_type, gpu.remote_pci_address, strict=True):
            if kind is not None or address is not None:
                info.add_metric([g, n, kind or "", address or ""], 1)
        for n, counters in zip(numbers, gpu.errors, strict=True):
            for name, value in counters:
                errors.add_metric([g, n, name], value)
    # At most (GPUs with NVLinks)^2 - that many series: 56 on an 8-GPU node.
    bonded = NVLINK_BONDED.family()
    graph = NvLinkGraph.from_gpus(_GraphGpu(gpu.gpu, gpu.pci_address, gpu) for gpu in gpus)
    for a in graph.gpus:
        for b in graph.gpus:
            if a.index != b.index:
                pair = graph.bonded(a.index, b.index)
                bonded.add_metric([str(a.index), str(b.index)], 0 if pair is None else pair.links)
    return up, info, errors, bonded


def _up(active: bool | None) -> float | None:
    return None if active is None else 1.0 if active else 0.0


def _summed(counters: CounterColumn) -> int | None:
    """The sum of the counters present (none: ``None``). Parts that wrap at one known width
    give their sum modulo that width: the total then wraps as one part would, where a plain
    sum would fall by one part's wrap and rate() would count the whole rest as new bytes."""
    present = [
        (value, bits) for value, bits in zip(counters.values, counters.bits, strict=True)
        if value is not None
    ]  # fmt: skip
    if not present:
        return None
    total = sum(value for value, _ in present)
    widths = {bits for _, bits in present}
    if len(widths) == 1:
        (bits,) = widths
        if bits is not None:
            total %= 1 << bits
    return total


def _link_data_families(g: str, links: NvLinks, data_tx: Metric, data_rx: Metric) -> None:
    """The payload byte counters of each link of GPU ``g``, from the links' columns."""
    labels = [(g, str(n)) for n in links.link]
    data_tx.add_metrics(labels, links.data_tx.values)
    data_rx.add_metrics(labels, links.data_rx.values)


def nvlink_data_source(snapshot: Snapshot) -> str | None:
    """The one rule behind ``nodescope_nvlink_data_source_info``: ``kmod`` while the
    nvlink_counter module serves per-link records (``nvlink_kmod`` source), else NVML's own
    figures (``nvml``) when NVML lists NVLinks, else ``None`` (no series)."""
    kmod = snapshot.latest(NVLINK_KMOD)
    if kmod is not None and kmod.serving:
        return "kmod"
    nvml = snapshot.latest(NVML)
    if nvml is not None and any(gpu.nvlinks for gpu in nvml.gpus):
        return nvml.nvlink_data_source
    return None


#: The link states, peers, error counters and NV# are kept from one slow read to the next,
#: the health figures from one health read to the next.
KEEPS_FAMILIES = True


def families(snapshot: Snapshot, kept: KeptFamilies | None = None) -> Iterator[Metric]:
    data = snapshot.latest(NVML)
    if data is not None:
        yield from _nvml_families(data, kept)
        yield from _health_families(data, kept)
    source = nvlink_data_source(snapshot)
    if source is not None:
        family = NVLINK_SOURCE.family()
        family.add_metric([source], 1)
        yield family


def _nvml_families(data: NvmlData, kept: KeptFamilies | None) -> Iterator[Metric]:
    info, lost = GPU_INFO.family(), GPU_LOST.family()
    tx, rx, snap = PCIE_TX.family(), PCIE_RX.family(), PCIE_SNAPSHOT.family()
    gen, gen_max = PCIE_GEN.family(), PCIE_GEN_MAX.family()
    width, width_max = PCIE_WIDTH.family(), PCIE_WIDTH_MAX.family()
    replays, util = PCIE_REPLAYS.family(), UTILIZATION.family()
    procs, proc_mem = PROCESSES.family(), PROCESS_MEMORY.family()
    data_tx, data_rx = NVLINK_DATA_TX.family(), NVLINK_DATA_RX.family()
    raw_tx, raw_rx = NVLINK_RAW_TX.family(), NVLINK_RAW_RX.family()
    link_up, link_info, link_errors, bonded = kept_or_built(
        kept, _link_state_families, _link_states(data)
    )

    for gpu in data.gpus:
        g = str(gpu.index)
        info.add_metric([g, gpu.uuid, gpu.name, gpu.pci_address], 1)
        if gpu.pcie_tx is not None:
            tx.add_metric([g], gpu.pcie_tx.value)
        if gpu.pcie_rx is not None:
            rx.add_metric([g], gpu.pcie_rx.value)
        if gpu.pcie_snapshot is not None:
            for direction, value in (
                ("tx", gpu.pcie_snapshot.tx_bytes_per_second),
                ("rx", gpu.pcie_snapshot.rx_bytes_per_second),
            ):
                if value is not None:
                    snap.add_metric([g, direction], value)
        for family, number in (
            (gen, gpu.pcie_gen_current),
            (gen_max, gpu.pcie_gen_max),
            (width, gpu.pcie_width_current),
            (width_max, gpu.pcie_width_max),
            (replays, gpu.pcie_replays),
        ):
            if number is not None:
                family.add_metric([g], number)
        for engine, percent in (
            ("gpu", gpu.gpu_util_percent),
            ("memory", gpu.memory_util_percent),
            ("decoder", gpu.decoder_util_percent),
            ("encoder", gpu.encoder_util_percent),
            ("jpeg", gpu.jpeg_util_percent),
        ):
            if percent is not None:
                util.add_metric([g, engine], percent / 100.0)
        procs.add_metric([g], len(gpu.processes))
        used = [p.used_memory_bytes for p in gpu.processes if p.used_memory_bytes is not None]
        if used or not gpu.processes:
            proc_mem.add_metric([g], sum(used))
        links = gpu.nvlinks
        if links:
            _link_data_families(g, links, data_tx, data_rx)
        # Protocol overhead per GPU is enough: the payload counters above name the link.
        for family, total in ((raw_tx, _summed(links.raw_tx)), (raw_rx, _summed(links.raw_rx))):
            if total is not None:
                family.add_metric([g], total)
    for gone in data.lost:
        lost.add_metric([str(gone.gpu), gone.uuid, gone.pci_address], 1)
    yield from (info, lost, tx, rx, snap, gen, gen_max, width, width_max, replays, util)
    yield from (procs, proc_mem, link_info, link_up, data_tx, data_rx, raw_tx, raw_rx)
    yield link_errors
    yield bonded

    xids, meanings = XID_ERRORS.family(), XID_INFO.family()
    seen: set[int] = set()
    for count in data.xids:
        label = str(count.gpu) if count.gpu is not None else count.pci_address
        xids.add_metric([label, str(count.xid)], count.count)
        seen.add(count.xid)
    for code in sorted(seen):
        meaning = XID_MEANINGS.get(code)
        if meaning is not None:
            meanings.add_metric([str(code), meaning], 1)
    yield xids
    yield meanings
    source = XID_SOURCE.family()
    if data.xid_source is not None:
        source.add_metric([data.xid_source], 1)
    yield source


def _health_families(data: NvmlData, kept: KeptFamilies | None) -> tuple[Metric, ...]:
    """The health figures of the GPUs the record lists (a GPU lost since the last health read
    keeps no series, like the rest of its figures), kept from one health read to the next."""
    listed = {gpu.index for gpu in data.gpus}
    reads = [(health,) for health in data.health if health.index in listed]
    return kept_or_built(kept, _health_series, reads)


def _health_series(reads: Sequence[tuple[GpuHealth]]) -> Iterator[Metric]:
    series = _HealthSeries()
    for (health,) in reads:
        series.add(health)
    return series.families()


class _HealthSeries:
    """The health families of one render, filled GPU by GPU."""

    def __init__(self) -> None:
        self.ecc, self.retired = ECC_ERRORS.family(), RETIRED_PAGES.family()
        self.retired_pending = RETIRED_PAGES_PENDING.family()
        self.remapped, self.remap_pending = REMAPPED_ROWS.family(), ROW_REMAP_PENDING.family()
        self.remap_failed = ROW_REMAP_FAILED.family()
        self.temperature, self.threshold = TEMPERATURE.family(), TEMPERATURE_THRESHOLD.family()
        self.power, self.power_limit = POWER.family(), POWER_LIMIT.family()
        self.clock, self.reasons = CLOCK.family(), CLOCK_EVENT.family()
        self.fb_used, self.fb_size = FB_USED.family(), FB_SIZE.family()
        self.fabric_state, self.fabric_status = FABRIC_STATE.family(), FABRIC_STATUS.family()
        self.fabric_info, self.fabric_degraded = FABRIC_INFO.family(), FABRIC_DEGRADED.family()
        self.gpm_window, self.gpm_sm = GPM_WINDOW.family(), GPM_SM_ACTIVITY.family()
        self.gpm_tensor, self.gpm_dram = GPM_TENSOR_ACTIVITY.family(), GPM_DRAM_BANDWIDTH.family()
        self.gpm_nvlink, self.gpm_pcie = GPM_NVLINK.family(), GPM_PCIE.family()
        self.read_at, self.unsupported = HEALTH_READ.family(), HEALTH_UNSUPPORTED.family()

    def families(self) -> Iterator[Metric]:
        yield from (self.ecc, self.retired, self.retired_pending, self.remapped)
        yield from (self.remap_pending, self.remap_failed, self.temperature, self.threshold)
        yield from (self.power, self.power_limit, self.clock, self.reasons)
        yield from (self.fb_used, self.fb_size, self.fabric_state, self.fabric_status)
        yield from (self.fabric_info, self.fabric_degraded, self.gpm_window, self.gpm_sm)
        yield from (self.gpm_tensor, self.gpm_dram, self.gpm_nvlink, self.gpm_pcie)
        yield from (self.read_at, self.unsupported)

    def add(self, health: GpuHealth) -> None:
        g = str(health.index)
        self.read_at.add_metric([g], health.read_at)
        for call in health.unsupported:
            self.unsupported.add_metric([g, call], 1)
        self._memory(health, g)
        self._thermal_power_clocks(health, g)
        self._fabric(health, g)
        self._gpm(health, g)

    def _memory(self, health: GpuHealth, g: str) -> None:
        e = health.ecc
        if e is not None:
            for kind, counter, count in (
                ("corrected", "volatile", e.volatile_corrected),
                ("uncorrected", "volatile", e.volatile_uncorrected),
                ("corrected", "aggregate", e.aggregate_corrected),
                ("uncorrected", "aggregate", e.aggregate_uncorrected),
            ):
                if count is not None:
                    self.ecc.add_metric([g, kind, counter], count)
        r = health.retired_pages
        if r is not None:
            if r.single_bit_ecc is not None:
                self.retired.add_metric([g, "single_bit_ecc"], r.single_bit_ecc)
            if r.double_bit_ecc is not None:
                self.retired.add_metric([g, "double_bit_ecc"], r.double_bit_ecc)
            if r.pending is not None:
                self.retired_pending.add_metric([g], 1 if r.pending else 0)
        rows = health.row_remap
        if rows is not None:
            if rows.correctable is not None:
                self.remapped.add_metric([g, "correctable"], rows.correctable)
            if rows.uncorrectable is not None:
                self.remapped.add_metric([g, "uncorrectable"], rows.uncorrectable)
            if rows.pending is not None:
                self.remap_pending.add_metric([g], 1 if rows.pending else 0)
            if rows.failed is not None:
                self.remap_failed.add_metric([g], 1 if rows.failed else 0)
        fb = health.framebuffer
        if fb is not None:
            if fb.used_bytes is not None:
                self.fb_used.add_metric([g], fb.used_bytes)
            if fb.total_bytes is not None:
                self.fb_size.add_metric([g], fb.total_bytes)

    def _thermal_power_clocks(self, health: GpuHealth, g: str) -> None:
        t = health.temperatures
        if t is not None:
            for family, label, degrees in (
                (self.temperature, "gpu", t.gpu),
                (self.temperature, "memory", t.memory),
                (self.threshold, "slowdown", t.slowdown),
                (self.threshold, "shutdown", t.shutdown),
                (self.threshold, "gpu_max", t.gpu_max),
                (self.threshold, "memory_max", t.memory_max),
            ):
                if degrees is not None:
                    family.add_metric([g, label], degrees)
        p = health.power
        if p is not None:
            if p.draw_watts is not None:
                self.power.add_metric([g], p.draw_watts)
            if p.limit_watts is not None:
                self.power_limit.add_metric([g, "management"], p.limit_watts)
            if p.enforced_limit_watts is not None:
                self.power_limit.add_metric([g, "enforced"], p.enforced_limit_watts)
            if p.default_limit_watts is not None:
                self.power_limit.add_metric([g, "default"], p.default_limit_watts)
        c = health.clocks
        if c is not None:
            # MHz to hertz: Prometheus's base unit, so rules and panels need no scale factor.
            if c.sm_mhz is not None:
                self.clock.add_metric([g, "sm"], c.sm_mhz * 1_000_000)
            if c.memory_mhz is not None:
                self.clock.add_metric([g, "memory"], c.memory_mhz * 1_000_000)
            if c.applications_sm_mhz is not None:
                self.clock.add_metric([g, "applications_sm"], c.applications_sm_mhz * 1_000_000)
            mask = c.event_reasons
            if mask is not None:
                reasons = self.reasons
                for bit, name in _REASONS:
                    reasons.add_metric([g, name], 1 if mask & bit else 0)

    def _fabric(self, health: GpuHealth, g: str) -> None:
        f = health.fabric
        if f is None:
            return
        known = False
        for state, name in _FABRIC_STATES:
            current = f.state == state
            self.fabric_state.add_metric([g, name], 1 if current else 0)
            known = known or current
        if not known:
            # A state a newer driver added: one series at 1 all the same, named by its number.
            self.fabric_state.add_metric([g, f.state_name], 1)
        if f.state != FABRIC_STATE_NOT_SUPPORTED:
            if f.status is not None:
                self.fabric_status.add_metric([g], f.status)
            if f.clique_id is not None or f.cluster_uuid is not None:
                clique = "" if f.clique_id is None else str(f.clique_id)
                self.fabric_info.add_metric([g, clique, f.cluster_uuid or ""], 1)
        if f.bandwidth_degraded is not None:
            self.fabric_degraded.add_metric([g], 1 if f.bandwidth_degraded else 0)

    def _gpm(self, health: GpuHealth, g: str) -> None:
        m = health.gpm
        if m is None:
            return
        self.gpm_window.add_metric([g], m.window_seconds)
        # NVML gives percentages; ratios 0-1 are the base unit the other _ratio series use.
        for family, percent in (
            (self.gpm_sm, m.sm_activity_percent),
            (self.gpm_tensor, m.tensor_activity_percent),
            (self.gpm_dram, m.dram_bandwidth_percent),
        ):
            if percent is not None:
                family.add_metric([g], percent / 100.0)
        for family, direction, rate in (
            (self.gpm_nvlink, "tx", m.nvlink_tx_bytes_per_second),
            (self.gpm_nvlink, "rx", m.nvlink_rx_bytes_per_second),
            (self.gpm_pcie, "tx", m.pcie_tx_bytes_per_second),
            (self.gpm_pcie, "rx", m.pcie_rx_bytes_per_second),
        ):
            if rate is not None:
                family.add_metric([g, direction], rate)
