"""The GPU side of the node through NVML (nvidia-ml-py, ``import pynvml``).

Reads, per GPU: identity (index, UUID, name, PCI address), PCIe byte counters (fields 197/198),
current and maximum link generation and width, the PCIe replay counter; per NVLink: state,
remote device type and PCI address, throughput fields 138-141 and the DL error counters;
compute processes; GPU, memory, decoder, encoder and JPEG utilisation; Xid critical errors
from an NVML event set, or from the kernel log (``/dev/kmsg``) where event sets are not
supported; and each GPU's health (ECC counts, retired pages, row remapping, temperatures and
their thresholds, power, clocks and clock-event reasons, framebuffer, fabric registration,
GPM figures).

The call surface and the formats are those of ``pynvml.py`` (nvidia-ml-py 13.615) and NVIDIA's
``nvml.h``; docs/datasources.md §1 names the calls, fields and units. What the code relies on:

* ``nvmlDeviceGetFieldValues(h, [(fieldId, scopeId), ...])`` succeeds when *any* value was
  filled: every ``c_nvmlFieldValue_t.nvmlReturn`` is checked on its own, and the value is
  read from the union member that ``valueType`` names. NVLink fields take the link index as
  ``scopeId``; 138-141 are cumulative KiB (stored here as bytes), 197/198 cumulative bytes
  that "can be wrapped" (nvml.h). Their width is taken from ``valueType`` (``unsigned int``
  32 bits, ``unsigned long long`` 64 bits); nvml.h states no width, so a driver that reports
  them as 64-bit values is taken to wrap at 2^64. All fields of one GPU are read in ONE call
  per cycle; each value carries its own timestamp (µs since the epoch), which the rates use.
  The returned ``c_nvmlFieldValue_t`` array is decoded in bulk from its memory (the layout
  of ``nvml.h``, checked against pynvml's ctypes declaration at import); pynvml's
  per-attribute access costs microseconds per value, and a GPU has 74 of them.
* What moves only on faults or link retraining is read every ``slow_every`` runs
  (:data:`SLOW_EVERY` by default) and carried in the records between reads: the NVLink
  states and DL error counters (four calls per link: 576 calls on an 8-GPU HGX), the PCIe
  link generation and width, the PCIe replay counter. The first run, a re-initialisation
  and a lost GPU make the next run read everything. Byte counters, utilisation and
  processes are read every run. Each record says when its slow values were read (on
  ``wall_clock``) and holds the record of the slow read before (``NvmlData.slow``), so the
  error rates are taken over the span between the two reads (:func:`slow_pair`).
* Health is read every ``health_every`` runs (:data:`HEALTH_EVERY`) and carried in the
  records between reads (``NvmlData.health``, each GPU's record dated by its read): about 20
  calls a GPU, none on the runs between. A health read due on a slow run waits one run, so
  no run pays for both; the cadences then stay apart. The temperature thresholds and the
  default power limit are the board's constants: asked until answered, then kept. The
  memory temperature is field ``NVML_FI_DEV_MEMORY_TEMP``, asked in a call of its own. The
  fabric comes from ``nvmlDeviceGetGpuFabricInfoV`` with pynvml's
  ``c_nvmlGpuFabricInfoV_t`` passed by reference, or, where the binding or driver lacks it,
  ``nvmlDeviceGetGpuFabricInfo`` with ``c_nvmlGpuFabricInfo_t`` (no health mask); the
  clock-event reasons likewise fall back to ``nvmlDeviceGetCurrentClocksThrottleReasons``. A
  value no GPU can answer (a negative count, a temperature above 200 °C, a draw above 10 kW,
  a mask wider than 64 bits) is dropped and counted in ``NvmlData.skipped``; the rest of the
  read stands. The default power limit and the SM applications clock
  (``nvmlDeviceGetPowerManagementDefaultLimit``, ``nvmlDeviceGetApplicationsClock``) are
  looked up by name: a binding without them leaves them unanswered.
* GPM (Hopper and later) is sampled on a health run every ``gpm_every`` runs
  (:data:`GPM_EVERY`): ``nvmlGpmQueryDeviceSupport`` once per GPU, two buffers from
  ``nvmlGpmSampleAlloc`` used in turn, ``nvmlGpmSampleGet`` each time, then
  ``nvmlGpmMetricsGet`` between the previous sample and this one, so the figures are
  averages over ``gpm_every`` runs and the first sample gives none. The buffers are freed
  when the GPU is lost, on a teardown and on :meth:`NvmlSource.close`.
* ``nvmlDeviceGetPcieThroughput`` is "a byte counter over a 20ms interval" in KB/s: a 20 ms
  snapshot, not an average over the poll interval. It is read only where fields 197/198 are
  not supported, and the record says so (``pcie_bytes_source = "throughput-20ms"``). KB is
  taken as 1024 bytes (the header's "1KB granularity" does not say).
* ``nvmlDeviceGetPciInfo(h).busId`` is ``"%08X:%02X:%02X.0"``; sysfs names devices
  ``"%04x:%02x:%02x.%d"`` (drivers/pci/probe.c). Addresses are converted by parsing the
  integers, because VMD domains start at 0x10000 and do not fit four digits.
* Errors are pynvml's ``NVMLError_<Name>`` classes. ``NotSupported`` (and
  ``FunctionNotFound`` from an older driver) is remembered per (GPU, call or field) and not
  asked again; ``GpuIsLost`` records an event and drops that GPU from later records;
  ``Uninitialized``/``DriverNotLoaded``/``LibraryNotFound`` mean NVML itself is gone:
  ``collect`` raises and initialisation is retried at ``retry_seconds`` pace.
* Xid events: ``nvmlEventSetCreate`` + ``nvmlDeviceRegisterEvents(h,
  nvmlEventTypeXidCriticalError, set)`` for GPUs whose ``nvmlDeviceGetSupportedEventTypes``
  has the bit, then ``nvmlEventSetWait`` (raises ``NVMLError_Timeout``) in a thread the source
  owns, so ``collect`` never waits. ``eventData`` is the Xid number.
* The kernel-log line is printed by ``kernel_rc.c`` (open-gpu-kernel-modules
  ``src/nvidia/src/kernel/gpu/rc/kernel_rc.c``): ``NVRM: Xid (PCI:0000:9b:00): 119,
  pid=2024380, name=nvidia-smi, <message>``. Older drivers print no ``PCI:``, MIG adds
  ``GPU-I:``/``GPU-C:`` after the address. ``/dev/kmsg`` records are
  ``prio,seq,usec,flags;text`` (Documentation/ABI/testing/dev-kmsg). The kernel log also holds
  text any user chose (a record written to ``/dev/kmsg``, a crashing binary's file name in the
  kernel's ``segfault at`` report), so an Xid is read only where the driver's exact line
  starts the message, from the kernel's facility at the driver's level
  (:mod:`nodescope.sources.kernel_log`), and counted only for a GPU NVML enumerated.

NVIDIA's Xid catalogue (docs.nvidia.com/deploy/xid-errors) gives the meanings in
:data:`XID_MEANINGS`.

The source is composed of four readers, each in a module of its own: the link reader
(:mod:`~nodescope.sources.nvml_links`: PCIe and NVLink counters, link state and errors), the
health reader (:mod:`~nodescope.sources.nvml_health`), the Xid reader
(:mod:`~nodescope.sources.nvml_xids`: event set and kernel log) and the process reader
(:mod:`~nodescope.sources.nvml_processes`: compute processes and utilisation), over what
they share (:mod:`~nodescope.sources.nvml_device`: the adapter, one GPU as enumerated, one
guarded call). This module owns the lifecycle, the cadences and the record.

The records, their rates (:func:`gpu_rates`) and the Xid meanings are declared in
:mod:`nodescope.model.nvml`, so what reads them need not load pynvml; this module names them
too, for the code that builds and tests the source.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import NoReturn

import pynvml

from nodescope.model.gpu_health import HEALTH_EVERY, GpuHealth
from nodescope.model.nvml import (
    NVML,
    PCIE_THROUGHPUT_WINDOW_SECONDS,
    XID_MEANINGS,
    XID_SOURCE_EVENTS,
    XID_SOURCE_KMSG,
    CounterColumn,
    CounterValue,
    GpuProcess,
    GpuRates,
    GpuSample,
    LostGpu,
    NvLinkRates,
    NvLinkSample,
    NvmlData,
    NvmlEvent,
    NvmlRates,
    PcieSnapshot,
    XidCount,
    gpu_rates,
    nvlink_pairs,
    slow_pair,
)
from nodescope.model.skips import SkipTally
from nodescope.model.slow import SlowReads
from nodescope.roots import Roots
from nodescope.sources.nvml_device import (
    FI_NVLINK_DATA_RX,
    FI_NVLINK_DATA_TX,
    FI_NVLINK_RAW_RX,
    FI_NVLINK_RAW_TX,
    FI_PCIE_RX_BYTES,
    FI_PCIE_TX_BYTES,
    FIELD_COLUMNS,
    LIBRARY_GONE,
    NVLINK_FIELDS,
    Gpu,
    GpuLost,
    NvmlAdapter,
    NvmlUnavailable,
    error_name,
    field_columns,
    field_value,
    handle_address,
    parse_bus_id,
    pci_address_of,
    row_value,
    sysfs_pci_address,
)
from nodescope.sources.nvml_health import (
    ECC_READS,
    FI_MEMORY_TEMP,
    GPM_METRICS,
    RETIRED_PAGE_READS,
    SKIP_HEALTH_VALUE_IMPOSSIBLE,
    THRESHOLD_READS,
    HealthReader,
    fabric_uuid,
    plausible,
    plausible_float,
)
from nodescope.sources.nvml_links import NVLINK_ERROR_COUNTERS, REMOTE_TYPES, LinkReader
from nodescope.sources.nvml_processes import ProcessReader
from nodescope.sources.nvml_xids import (
    EVENT_WAIT_MS,
    MAX_XID_LINE,
    SKIP_XID_LEVEL,
    SKIP_XID_NOT_KERNEL,
    SKIP_XID_TOO_LONG,
    SKIP_XID_UNKNOWN_GPU,
    SKIP_XID_UNPARSABLE,
    KernelXid,
    KmsgReader,
    XidReader,
    parse_kmsg_xid,
)
from nodescope.sources.spec import SourceSpec

NAME = NVML.name

log = logging.getLogger("nodescope.sources.nvml")

#: Runs between two reads of the NVLink states and error counters, the PCIe link
#: generation and width and the PCIe replay counter (see the module docstring).
SLOW_EVERY = 10

#: Runs between two GPM samples; health (ECC, row remapping, temperatures, power, clocks,
#: fabric: docs/datasources.md §1.8) is read every ``HEALTH_EVERY`` runs (model.gpu_health).
GPM_EVERY = 30


class NvmlSource:
    """The ``nvml`` source: one adapter object with the pynvml surface, initialised lazily.

    ``clock`` paces initialisation retries; ``wall_clock`` stamps events and slow reads.
    ``event_wait_ms`` bounds one ``nvmlEventSetWait`` of the Xid thread, and so how long
    :meth:`close` waits for it. ``slow_every`` is the number of runs between two reads of
    what moves only on faults (1: every run reads everything); ``health_every`` the runs
    between two health reads, ``gpm_every`` the runs between two GPM samples (taken on a
    health run).
    """

    name = NAME

    def __init__(
        self,
        nvml: NvmlAdapter,
        *,
        retry_seconds: float = 60.0,
        event_wait_ms: int = EVENT_WAIT_MS,
        watch_xids: bool = True,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        slow_every: int = SLOW_EVERY,
        health_every: int = HEALTH_EVERY,
        gpm_every: int = GPM_EVERY,
    ) -> None:
        self.nvml = nvml
        self.slow_every = slow_every
        self.health_every = health_every
        self.gpm_every = gpm_every
        # Runs left until the next slow read; 0 makes the next run read everything.
        self._slow_left = 0
        # Runs left until the next health read and GPM sample; 0: due now.
        self._health_left = 0
        self._gpm_left = 0
        # The health of the GPUs not lost, as of their last health read.
        self._health: tuple[GpuHealth, ...] = ()
        self._slow_reads = SlowReads[NvmlData]()
        self.retry_seconds = retry_seconds
        self.event_wait_ms = event_wait_ms
        self.watch_xids = watch_xids
        self.clock = clock
        self.wall_clock = wall_clock
        self._initialized = False
        self._next_init = 0.0
        self._last_error = ""
        self._device_count = 0
        self._gpus: list[Gpu] = []
        self._lost: list[LostGpu] = []
        self._events: deque[NvmlEvent] = deque(maxlen=64)
        self._links = LinkReader(nvml)
        self._health_reader = HealthReader(nvml, wall_clock)
        self._xids = XidReader(nvml, event_wait_ms=event_wait_ms, watch=watch_xids)
        self._processes = ProcessReader(nvml)

    # ---- lifecycle ----------------------------------------------------------------------

    def _ensure_init(self) -> None:
        if self._initialized:
            return
        now = self.clock()
        if now < self._next_init:
            raise NvmlUnavailable(
                f"NVML unavailable ({self._last_error}); "
                f"next attempt in {self._next_init - now:.0f} s"
            )
        try:
            self.nvml.nvmlInit()
        except pynvml.NVMLError as exc:
            self._fail_init(error_name(exc))
        try:
            self._enumerate()
        except pynvml.NVMLError as exc:
            self._shutdown_quietly()
            self._fail_init(error_name(exc))
        self._initialized = True
        log.info("source=nvml state=initialized gpus=%d", len(self._gpus))

    def _fail_init(self, reason: str) -> NoReturn:
        self._last_error = reason
        self._next_init = self.clock() + self.retry_seconds
        raise NvmlUnavailable(
            f"NVML unavailable ({reason}); retrying every {self.retry_seconds:g} s"
        )

    def _enumerate(self) -> None:
        nvml = self.nvml
        count = nvml.nvmlDeviceGetCount()
        gpus: list[Gpu] = []
        for index in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = nvml.nvmlDeviceGetUUID(handle)
                name = nvml.nvmlDeviceGetName(handle)
                pci = nvml.nvmlDeviceGetPciInfo(handle)
            except pynvml.NVMLError_GpuIsLost as exc:
                self._record_lost(index, "", "", f"at enumeration: {error_name(exc)}")
                continue
            gpus.append(
                Gpu(
                    index=index,
                    handle=handle,
                    address=handle_address(handle),
                    uuid=str(uuid),
                    name=str(name),
                    pci_address=pci_address_of(pci),
                    links=self._links.discover(handle),
                )
            )
        self._device_count = count
        self._gpus = gpus
        self._slow_left = 0
        self._health_left = 0
        self._gpm_left = 0
        self._health = ()

    def _shutdown_quietly(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.debug("source=nvml shutdown_error=%r", error_name(exc))

    def _teardown(self, reason: str) -> None:
        self._xids.teardown()
        if self._initialized:
            # NVML is gone: the frees fail, but a library that comes back mid-way still gets
            # them, and the buffers are dropped either way.
            self._health_reader.free_all_gpm(self._gpus)
            self._shutdown_quietly()
        self._initialized = False
        self._gpus = []
        self._last_error = reason
        self._next_init = self.clock() + self.retry_seconds

    def close(self) -> None:
        self._xids.stop()
        if self._initialized:
            self._health_reader.free_all_gpm(self._gpus)
            self._shutdown_quietly()
            self._initialized = False
        self._xids.close()

    # ---- collection ---------------------------------------------------------------------

    def collect(self, roots: Roots) -> NvmlData:
        self._ensure_init()
        self._xids.start(self._gpus)
        slow = self._slow_left <= 0
        self._slow_left = max(self.slow_every, 1) - 1 if slow else self._slow_left - 1
        # A health read that falls on a slow run waits one run, so no run pays for both
        # (unless every run is one or the other); once shifted, the cadences stay apart.
        health = self._health_left <= 0 and not (
            slow and self.slow_every > 1 and self.health_every > 1
        )
        self._health_left = max(self.health_every, 1) - 1 if health else self._health_left - 1
        # GPM samples are taken on health runs only: no run pays for GPM alone.
        gpm = health and self._gpm_left <= 0
        self._gpm_left = max(self.gpm_every, 1) - 1 if gpm else self._gpm_left - 1
        tally = SkipTally()
        rebuild = health
        # The wall clock is the one the simulated node drives; spans are taken between two
        # of its readings ten seconds apart, and one that went back gives no span.
        slow_at = self.wall_clock() if slow else 0.0
        samples: list[GpuSample] = []
        for gpu in self._gpus:
            if gpu.lost:
                continue
            try:
                sample = self._read_gpu(gpu, slow)
                if health:
                    gpu.health = self._health_reader.read(gpu, gpm, tally)
                samples.append(sample)
            except GpuLost as lost:
                gpu.lost = True
                self._health_reader.free_gpm(gpu)
                self._record_lost(gpu.index, gpu.uuid, gpu.pci_address, lost.where)
                rebuild = True  # the lost GPU leaves the carried health
            except LIBRARY_GONE as exc:
                self._teardown(error_name(exc))
                raise NvmlUnavailable(f"NVML went away: {error_name(exc)}") from exc
        if rebuild:
            self._health = tuple(
                g.health for g in self._gpus if g.health is not None and not g.lost
            )
        xid_source, xids = self._xids.read(roots, self._gpus, self._lost, tally)
        record = NvmlData(
            device_count=self._device_count,
            gpus=tuple(samples),
            lost=tuple(self._lost),
            xids=xids,
            xid_source=xid_source,
            events=tuple(self._events),
            health=self._health,
            skipped=tally.freeze(),
        )
        if slow:
            return dataclasses.replace(record, slow=self._slow_reads.read(record, slow_at))
        return dataclasses.replace(record, slow=self._slow_reads.carried())

    def _record_lost(self, index: int, uuid: str, pci_address: str, where: str) -> None:
        log.warning("source=nvml gpu=%d uuid=%s event=gpu_lost where=%r", index, uuid, where)
        self._lost.append(LostGpu(index, uuid, pci_address))
        self._events.append(
            NvmlEvent("gpu_lost", index, uuid, pci_address, self.wall_clock(), where)
        )
        # The GPUs left may have gone through the same fault: read all of them next run,
        # their health too.
        self._slow_left = 0
        self._health_left = 0

    def _read_gpu(self, gpu: Gpu, slow: bool) -> GpuSample:
        links = self._links
        plan, fields = links.read_fields(gpu)
        tx_at, rx_at = plan.pcie
        pcie_tx = fields.counter(tx_at)
        pcie_rx = fields.counter(rx_at)
        snapshot = links.pcie_snapshot(gpu)
        pcie_source: str | None = "fields" if pcie_tx is not None and pcie_rx is not None else None
        if snapshot is not None:
            pcie_source = "throughput-20ms"
        gpu_util, memory_util, decoder, encoder, jpeg = self._processes.utilisation(gpu)
        processes = self._processes.processes(gpu)
        carried = links.slow_reads(gpu, slow)
        return GpuSample(
            index=gpu.index,
            uuid=gpu.uuid,
            name=gpu.name,
            pci_address=gpu.pci_address,
            pcie_tx=pcie_tx,
            pcie_rx=pcie_rx,
            pcie_snapshot=snapshot,
            pcie_bytes_source=pcie_source,
            pcie_gen_current=carried.pcie_gen_current,
            pcie_width_current=carried.pcie_width_current,
            pcie_gen_max=carried.pcie_gen_max,
            pcie_width_max=carried.pcie_width_max,
            pcie_replays=carried.pcie_replays,
            gpu_util_percent=gpu_util,
            memory_util_percent=memory_util,
            decoder_util_percent=decoder,
            encoder_util_percent=encoder,
            jpeg_util_percent=jpeg,
            processes=processes,
            nvlinks=links.nvlinks(plan, fields, carried),
            unsupported=gpu.unsupported_names(),
        )


def make_source() -> NvmlSource:
    return NvmlSource(pynvml)


SPEC = SourceSpec(
    name="nvml",
    default_interval=1.0,
    help="GPUs through NVML: PCIe and NVLink counters, link state, Xids, processes, utilisation",
    build=lambda inputs: make_source(),
    rates=lambda derived: derived.gpu_rates,
    metric_area="nodescope_exporters.gpu_metrics",
    sim_parts=frozenset(),
    # The simulated node's runs over its fake NVML, whose every move sets the counters.
    sim_stand_in=True,
    reads="the NVML library",
)


__all__ = [
    "ECC_READS",
    "EVENT_WAIT_MS",
    "FIELD_COLUMNS",
    "FI_MEMORY_TEMP",
    "FI_NVLINK_DATA_RX",
    "FI_NVLINK_DATA_TX",
    "FI_NVLINK_RAW_RX",
    "FI_NVLINK_RAW_TX",
    "FI_PCIE_RX_BYTES",
    "FI_PCIE_TX_BYTES",
    "GPM_EVERY",
    "GPM_METRICS",
    "HEALTH_EVERY",
    "MAX_XID_LINE",
    "NAME",
    "NVLINK_ERROR_COUNTERS",
    "NVLINK_FIELDS",
    "PCIE_THROUGHPUT_WINDOW_SECONDS",
    "REMOTE_TYPES",
    "RETIRED_PAGE_READS",
    "SKIP_HEALTH_VALUE_IMPOSSIBLE",
    "SKIP_XID_LEVEL",
    "SKIP_XID_NOT_KERNEL",
    "SKIP_XID_TOO_LONG",
    "SKIP_XID_UNKNOWN_GPU",
    "SKIP_XID_UNPARSABLE",
    "SLOW_EVERY",
    "THRESHOLD_READS",
    "XID_MEANINGS",
    "XID_SOURCE_EVENTS",
    "XID_SOURCE_KMSG",
    "CounterColumn",
    "CounterValue",
    "GpuProcess",
    "GpuRates",
    "GpuSample",
    "KernelXid",
    "KmsgReader",
    "LostGpu",
    "NvLinkRates",
    "NvLinkSample",
    "NvmlAdapter",
    "NvmlData",
    "NvmlEvent",
    "NvmlRates",
    "NvmlSource",
    "NvmlUnavailable",
    "PcieSnapshot",
    "XidCount",
    "fabric_uuid",
    "field_columns",
    "field_value",
    "gpu_rates",
    "make_source",
    "nvlink_pairs",
    "parse_bus_id",
    "parse_kmsg_xid",
    "pci_address_of",
    "plausible",
    "plausible_float",
    "row_value",
    "slow_pair",
    "sysfs_pci_address",
]
