"""Metrics of the NVML source (NVML): per GPU, per NVLink, Xids.

Series are labelled by ``gpu`` (the NVML index) and joined to UUID, name and PCI address
through ``nodescope_gpu_info``. Cumulative counters are exported as counters; the one PCIe
figure NVML gives only as a 20 ms snapshot (where fields 197/198 are not supported) is a gauge
that says so. Per NVLink: state, peer, payload bytes and the error counters (what names a
bad link); bytes with protocol overhead are summed per GPU. A GPU NVML lost stops having
series, except ``nodescope_gpu_lost_info`` and its Xid counters (Xid 79 is how a GPU falls
off the bus). Which source served the NVLink figures (``nodescope_nvlink_data_source_info``)
is decided here, for NVML and the nvlink_counter module alike (:func:`nvlink_data_source`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from nodescope.model.nvlink_graph import NvLinkGraph
from nodescope.model.nvlink_kmod import NVLINK_KMOD
from nodescope.model.nvml import NVML, XID_MEANINGS, CounterValue, NvmlData
from nodescope.model.snapshot import Snapshot
from nodescope_exporters.catalog import Metric, metric

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


def _bonded(data: NvmlData) -> Metric:
    # At most (GPUs with NVLinks)^2 - that many series: 56 on an 8-GPU node.
    family = NVLINK_BONDED.family()
    graph = NvLinkGraph.from_gpus(g for g in data.gpus if g.nvlinks)
    for a in graph.gpus:
        for b in graph.gpus:
            if a.index != b.index:
                pair = graph.bonded(a.index, b.index)
                family.add_metric([str(a.index), str(b.index)], 0 if pair is None else pair.links)
    return family


def _summed(counters: Iterable[CounterValue | None]) -> int | None:
    """The sum of the counters present (none: ``None``). Parts that wrap at one known width
    give their sum modulo that width: the total then wraps as one part would, where a plain
    sum would fall by one part's wrap and rate() would count the whole rest as new bytes."""
    present = [c for c in counters if c is not None]
    if not present:
        return None
    total = sum(c.value for c in present)
    widths = {c.bits for c in present}
    if len(widths) == 1:
        (bits,) = widths
        if bits is not None:
            total %= 1 << bits
    return total


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


def families(snapshot: Snapshot) -> Iterator[Metric]:
    data = snapshot.latest(NVML)
    if data is not None:
        yield from _nvml_families(data)
    source = nvlink_data_source(snapshot)
    if source is not None:
        family = NVLINK_SOURCE.family()
        family.add_metric([source], 1)
        yield family


def _nvml_families(data: NvmlData) -> Iterator[Metric]:
    info, lost = GPU_INFO.family(), GPU_LOST.family()
    tx, rx, snap = PCIE_TX.family(), PCIE_RX.family(), PCIE_SNAPSHOT.family()
    gen, gen_max = PCIE_GEN.family(), PCIE_GEN_MAX.family()
    width, width_max = PCIE_WIDTH.family(), PCIE_WIDTH_MAX.family()
    replays, util = PCIE_REPLAYS.family(), UTILIZATION.family()
    procs, proc_mem = PROCESSES.family(), PROCESS_MEMORY.family()
    link_info, link_up = NVLINK_INFO.family(), NVLINK_UP.family()
    data_tx, data_rx = NVLINK_DATA_TX.family(), NVLINK_DATA_RX.family()
    raw_tx, raw_rx = NVLINK_RAW_TX.family(), NVLINK_RAW_RX.family()
    link_errors = NVLINK_ERRORS.family()

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
        for link in gpu.nvlinks:
            n = str(link.link)
            if link.active is not None:
                link_up.add_metric([g, n], 1 if link.active else 0)
            if link.remote_type is not None or link.remote_pci_address is not None:
                link_info.add_metric(
                    [g, n, link.remote_type or "", link.remote_pci_address or ""], 1
                )
            for family, counter in ((data_tx, link.data_tx), (data_rx, link.data_rx)):
                if counter is not None:
                    family.add_metric([g, n], counter.value)
            for name, value in link.errors:
                link_errors.add_metric([g, n, name], value)
        # Protocol overhead per GPU is enough: the payload counters above name the link.
        for family, total in (
            (raw_tx, _summed(link.raw_tx for link in gpu.nvlinks)),
            (raw_rx, _summed(link.raw_rx for link in gpu.nvlinks)),
        ):
            if total is not None:
                family.add_metric([g], total)
    for gone in data.lost:
        lost.add_metric([str(gone.gpu), gone.uuid, gone.pci_address], 1)
    yield from (info, lost, tx, rx, snap, gen, gen_max, width, width_max, replays, util)
    yield from (procs, proc_mem, link_info, link_up, data_tx, data_rx, raw_tx, raw_rx)
    yield link_errors
    yield _bonded(data)

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
