"""A fake NVML with the call surface of ``pynvml`` (nvidia-ml-py), for the simulated node.

The NVML source takes an adapter object with pynvml's function names and argument order; the
real ``pynvml`` module is one such object and :class:`FakeNvml` is another. The fake is driven
by a plain description of GPUs (:class:`FakeGpu`, :class:`FakeLink`) whose counters a
simulator advances by assigning to their fields.

It behaves like the real binding where the source depends on it:

* errors are pynvml's own classes, made the way pynvml makes them (``pynvml.NVMLError(code)``
  returns the ``NVMLError_<Name>`` subclass), so ``except pynvml.NVMLError_NotSupported``
  works the same against both;
* every call before ``nvmlInit`` raises ``NVMLError_Uninitialized``; ``init_error`` makes
  ``nvmlInit`` fail (``NVML_ERROR_LIBRARY_NOT_FOUND`` is what pynvml raises on a machine with
  no driver);
* handles and event sets are pynvml's opaque pointer types (``c_nvmlDevice_t``,
  ``c_nvmlEventSet_t``) and results are pynvml's structs (``nvmlPciInfo_t``,
  ``c_nvmlUtilization_t``, ``c_nvmlFieldValue_t``, ``c_nvmlEventData_t``); processes are the
  binding's friendly objects with ``usedGpuMemory`` ``None`` when not available;
* ``nvmlDeviceGetFieldValues`` fills each ``c_nvmlFieldValue_t`` with its own
  ``nvmlReturn``, ``valueType``, ``value`` and ``timestamp`` (µs since the epoch) and
  succeeds as a call, as NVML does when any value was filled (nvml.h,
  ``nvmlDeviceGetFieldValues``); the array is pynvml's ``c_nvmlFieldValue_t * n``, built
  from the bytes the attributes would hold;
* a link index past the GPU's links raises ``NVMLError_InvalidArgument``; a lost GPU raises
  ``NVMLError_GpuIsLost`` from every call on its handle; ``nvmlEventSetWait`` raises
  ``NVMLError_Timeout`` when nothing arrived in time.

``calls`` counts every call by function name, so tests can prove what the source asks for.
"""

from __future__ import annotations

import ctypes
import itertools
import struct
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pynvml

#: Field ids the fake serves (pynvml's ``NVML_FI_DEV_*``).
FI_NVLINK_DATA_TX = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
FI_NVLINK_DATA_RX = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
FI_NVLINK_RAW_TX = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX
FI_NVLINK_RAW_RX = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX
FI_PCIE_TX_BYTES = pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES
FI_PCIE_RX_BYTES = pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES

_HANDLE_BASE = 0x7E5700000000
_EVENT_SET_BASE = 0x7E5800000000
_GPM_SAMPLE_BASE = 0x7E5900000000
_U64 = (1 << 64) - 1

#: The names under which FakeGpu.unsupported lists one error counter of
#: nvmlDeviceGetNvLinkErrorCounter, by counter.
_ERROR_COUNTER_CALLS = tuple(
    f"nvmlDeviceGetNvLinkErrorCounter:{counter}"
    for counter in range(pynvml.NVML_NVLINK_ERROR_DL_ECC_DATA + 1)
)

_NVLINK_FIELD_ATTRS = {
    FI_NVLINK_DATA_TX: "data_tx_kib",
    FI_NVLINK_DATA_RX: "data_rx_kib",
    FI_NVLINK_RAW_TX: "raw_tx_kib",
    FI_NVLINK_RAW_RX: "raw_rx_kib",
}

#: GPM metric -> (the FakeGpu field it is taken from). Other metrics answer NOT_SUPPORTED.
_GPM_METRIC_ATTRS = {
    pynvml.NVML_GPM_METRIC_SM_UTIL: "gpm_sm_activity_percent",
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: "gpm_tensor_activity_percent",
    pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: "gpm_dram_bandwidth_percent",
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: "gpm_nvlink_tx_mib_per_second",
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: "gpm_nvlink_rx_mib_per_second",
    pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: "gpm_pcie_tx_mib_per_second",
    pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: "gpm_pcie_rx_mib_per_second",
}
#: GPM metrics that need NVLink: NOT_SUPPORTED on a GPU without links.
_GPM_NVLINK_METRICS = frozenset(
    {pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC, pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC}
)

#: ``c_nvmlFieldValue_t`` (nvml.h): fieldId, scopeId, timestamp, latencyUsec, valueType,
#: nvmlReturn and the 8 bytes of the ``c_nvmlValue_t`` union, in native layout.
_FIELD_VALUE = struct.Struct("@IIqqII8s")


def _record(member: str) -> struct.Struct:
    # The union's members all start at its first byte; the rest of its 8 bytes stay zero.
    return struct.Struct(f"@IIqqII{member}{8 - struct.calcsize('@' + member)}x")


#: valueType -> the whole c_nvmlFieldValue_t with the union member that valueType names.
_RECORDS = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: _record("d"),
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: _record("I"),
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: _record("L"),
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: _record("Q"),
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: _record("q"),
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: _record("i"),
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: _record("H"),
}
_NO_VALUE = bytes(8)


def _check_field_value_layout() -> None:
    """The fake builds field values from bytes: pynvml's struct must have nvml.h's layout."""
    cls = pynvml.c_nvmlFieldValue_t
    names = ("fieldId", "scopeId", "timestamp", "latencyUsec", "valueType", "nvmlReturn", "value")
    offsets = [getattr(cls, name).offset for name in names]
    if offsets != [0, 4, 8, 16, 24, 28, 32] or ctypes.sizeof(cls) != _FIELD_VALUE.size:
        raise ImportError(f"pynvml's c_nvmlFieldValue_t is not laid out as in nvml.h: {offsets}")


_check_field_value_layout()


@dataclass
class FakeLink:
    """One NVLink of a fake GPU. Throughput counters are in KiB, as NVML reports them."""

    remote_pci_bus_id: str
    remote_type: int = pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
    active: bool = True
    data_tx_kib: int = 0
    data_rx_kib: int = 0
    raw_tx_kib: int = 0
    raw_rx_kib: int = 0
    #: ``NVML_NVLINK_ERROR_DL_*`` -> value
    errors: dict[int, int] = field(default_factory=dict)


@dataclass
class FakeProcess:
    pid: int
    used_memory_bytes: int | None = None


@dataclass
class FakeGpu:
    """A GPU as the fake NVML shows it.

    ``pci_bus_id`` is in NVML's form (``"00000000:18:00.0"``). ``unsupported`` holds field ids
    (ints) and pynvml function names (strs) that answer ``NOT_SUPPORTED`` on this GPU.
    ``pcie_counter_bits`` is the width of fields 197/198: 32 makes them ``unsigned int``
    values that wrap at 2^32, 64 ``unsigned long long``.
    """

    uuid: str
    name: str
    pci_bus_id: str
    pci_device_id: int = 0x233010DE
    curr_gen: int = 5
    curr_width: int = 16
    max_gen: int = 5
    max_width: int = 16
    pcie_tx_bytes: int = 0
    pcie_rx_bytes: int = 0
    pcie_counter_bits: int = 64
    pcie_throughput_tx_kbps: int = 0
    pcie_throughput_rx_kbps: int = 0
    replay_counter: int = 0
    links: list[FakeLink] = field(default_factory=list)
    processes: list[FakeProcess] = field(default_factory=list)
    gpu_util: int = 0
    memory_util: int = 0
    decoder_util: int = 0
    encoder_util: int = 0
    jpeg_util: int = 0
    sampling_period_us: int = 167000
    unsupported: set[int | str] = field(default_factory=set)
    supported_events: int = (
        pynvml.nvmlEventTypeXidCriticalError
        | pynvml.nvmlEventTypeSingleBitEccError
        | pynvml.nvmlEventTypeDoubleBitEccError
    )
    lost: bool = False
    # Health, in NVML's own units (what the health calls answer; docs/datasources.md §1.8).
    #: nvmlDeviceGetTotalEccErrors: (volatile, aggregate) × (corrected, uncorrected)
    ecc_volatile_corrected: int = 0
    ecc_volatile_uncorrected: int = 0
    ecc_aggregate_corrected: int = 0
    ecc_aggregate_uncorrected: int = 0
    #: nvmlDeviceGetRetiredPages per cause (page counts) and ...PendingStatus
    retired_pages_single_bit: int = 0
    retired_pages_double_bit: int = 0
    retired_pages_pending: bool = False
    #: nvmlDeviceGetRemappedRows: (correctable rows, uncorrectable rows, pending, failure)
    remapped_rows_correctable: int = 0
    remapped_rows_uncorrectable: int = 0
    remap_pending: bool = False
    remap_failed: bool = False
    #: °C: nvmlDeviceGetTemperature(GPU), field NVML_FI_DEV_MEMORY_TEMP, and the thresholds
    #: of nvmlDeviceGetTemperatureThreshold (an H100 SXM's as its driver reports them)
    temperature_gpu: int = 34
    temperature_memory: int = 38
    temperature_slowdown: int = 87
    temperature_shutdown: int = 92
    temperature_gpu_max: int = 87
    temperature_memory_max: int = 95
    #: milliwatts: nvmlDeviceGetPowerUsage, ...PowerManagementLimit, ...EnforcedPowerLimit
    power_draw_mw: int = 72_000
    power_limit_mw: int = 700_000
    power_enforced_limit_mw: int = 700_000
    #: nvmlDeviceGetPowerManagementDefaultLimit: the limit the board ships with (an H100
    #: SXM's 700 W)
    power_default_limit_mw: int = 700_000
    #: MHz: nvmlDeviceGetClockInfo(NVML_CLOCK_SM / NVML_CLOCK_MEM)
    sm_clock_mhz: int = 1980
    memory_clock_mhz: int = 2619
    #: MHz: nvmlDeviceGetApplicationsClock(NVML_CLOCK_SM / NVML_CLOCK_MEM), the clocks the
    #: applications run at when power and heat allow (an H100 SXM's defaults)
    applications_sm_clock_mhz: int = 1980
    applications_memory_clock_mhz: int = 2619
    #: nvmlDeviceGetCurrentClocksEventReasons' bit mask (nvmlClocksEventReason*)
    clock_event_reasons: int = pynvml.nvmlClocksEventReasonGpuIdle
    #: bytes: nvmlDeviceGetMemoryInfo
    fb_total_bytes: int = 80 * 1024**3
    fb_used_bytes: int = 0
    #: nvmlDeviceGetGpuFabricInfo(V): NVML_GPU_FABRIC_STATE_*, the registration's
    #: nvmlReturn_t, clique id, cluster UUID (text form here, so the state stays JSON; the
    #: calls answer its 16 bytes) and the V call's healthMask
    fabric_state: int = pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED
    fabric_status: int = pynvml.NVML_SUCCESS
    fabric_clique_id: int = 0
    fabric_cluster_uuid: str = "00000000-0000-0000-0000-000000000000"
    fabric_health_mask: int = 0
    #: GPM (Hopper and later): the activity the GPU shows between two GPM samples, as
    #: nvmlGpmMetricsGet would compute it (percent, MiB/s)
    gpm_sm_activity_percent: float = 0.0
    gpm_tensor_activity_percent: float = 0.0
    gpm_dram_bandwidth_percent: float = 0.0
    gpm_nvlink_tx_mib_per_second: float = 0.0
    gpm_nvlink_rx_mib_per_second: float = 0.0
    gpm_pcie_tx_mib_per_second: float = 0.0
    gpm_pcie_rx_mib_per_second: float = 0.0


def _raise(code: int) -> None:
    # pynvml.NVMLError.__new__ maps the code to its NVMLError_<Name> subclass.
    raise pynvml.NVMLError(code)


def _pointer_address(pointer: Any) -> int | None:
    try:
        # A pointer object's own bytes are the address: a quarter of the cost of a cast.
        value = ctypes.c_void_p.from_buffer(pointer).value
    except (TypeError, ValueError):
        try:
            value = ctypes.cast(pointer, ctypes.c_void_p).value
        except (TypeError, ctypes.ArgumentError):
            return None
    return None if value is None else int(value)


def _pci_info(bus_id: str, device_id: int) -> Any:
    domain_s, bus_s, devfn = bus_id.split(":")
    device_s, _, _function = devfn.partition(".")
    info = pynvml.nvmlPciInfo_t()
    info.busId = bus_id.encode()
    info.busIdLegacy = f"{int(domain_s, 16) & 0xFFFF:04X}:{bus_s.upper()}:{device_s.upper()}.0"
    info.domain = int(domain_s, 16)
    info.bus = int(bus_s, 16)
    info.device = int(device_s, 16)
    info.pciDeviceId = device_id
    info.pciSubSystemId = 0
    return info


def _struct_of(argument: Any, kinds: tuple[type[Any], ...]) -> Any:
    """The structure a pointer argument points at: ``ctypes.byref(s)`` or
    ``ctypes.pointer(s)``, as a caller of the real binding must pass it (pynvml hands the
    argument to the C function as it is; a structure itself would go by value). ``None``
    for anything else."""
    target = getattr(argument, "_obj", None)  # what ctypes.byref made
    if target is None and isinstance(argument, ctypes._Pointer):
        target = argument.contents
    return target if isinstance(target, kinds) else None


@dataclass
class _GpmSample:
    """A GPM sample buffer: the GPU and time (µs) of the sample it holds, if any."""

    gpu: int | None = None
    taken_us: int | None = None


@dataclass
class _EventSet:
    masks: dict[int, int] = field(default_factory=dict)
    queue: deque[tuple[int, int, int]] = field(default_factory=deque)
    freed: bool = False


class FakeNvml:
    """NVML with pynvml's function names and argument order, over :class:`FakeGpu` records."""

    def __init__(
        self,
        gpus: Sequence[FakeGpu],
        *,
        init_error: int | None = None,
        clock_us: Callable[[], int] | None = None,
    ) -> None:
        self.gpus = list(gpus)
        self.init_error = init_error
        self.calls: Counter[str] = Counter()
        #: the (fieldId, scopeId) lists of every nvmlDeviceGetFieldValues call, in order
        self.field_requests: list[tuple[int, list[tuple[int, int]]]] = []
        self._clock_us = clock_us or (lambda: int(time.time() * 1_000_000))
        self._refcount = 0
        self._event_sets: dict[int, _EventSet] = {}
        self._event_ids = itertools.count(1)
        self._cond = threading.Condition()
        self._gpm_samples: dict[int, _GpmSample] = {}
        self._gpm_ids = itertools.count(1)

    @classmethod
    def no_driver(cls) -> FakeNvml:
        """A node without the NVIDIA driver: ``nvmlInit`` fails like pynvml's does."""
        return cls([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    # ---- simulator side ---------------------------------------------------------------

    def handle(self, index: int) -> Any:
        return ctypes.cast(ctypes.c_void_p(_HANDLE_BASE + 0x100 * index), pynvml.c_nvmlDevice_t)

    def inject_xid(self, index: int, xid: int) -> None:
        """Deliver an Xid critical error event of GPU ``index`` to every set registered for it."""
        with self._cond:
            for event_set in self._event_sets.values():
                mask = event_set.masks.get(index, 0)
                if not event_set.freed and mask & pynvml.nvmlEventTypeXidCriticalError:
                    event_set.queue.append((index, pynvml.nvmlEventTypeXidCriticalError, xid))
            self._cond.notify_all()

    def registered_event_sets(self) -> int:
        with self._cond:
            return sum(1 for s in self._event_sets.values() if not s.freed and s.masks)

    def gpm_samples_allocated(self) -> int:
        """GPM sample buffers allocated and not yet freed."""
        return len(self._gpm_samples)

    # ---- helpers ------------------------------------------------------------------------

    def _enter(self, name: str) -> None:
        self.calls[name] += 1
        if self._refcount <= 0:
            _raise(pynvml.NVML_ERROR_UNINITIALIZED)

    def _gpu(self, handle: Any, name: str) -> tuple[int, FakeGpu]:
        self.calls[name] += 1
        if self._refcount <= 0:
            _raise(pynvml.NVML_ERROR_UNINITIALIZED)
        address = _pointer_address(handle)
        if address is None:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        assert address is not None
        index, rest = divmod(address - _HANDLE_BASE, 0x100)
        if index < 0 or rest or index >= len(self.gpus):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[index]
        if gpu.lost:
            _raise(pynvml.NVML_ERROR_GPU_IS_LOST)
        if name in gpu.unsupported:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return index, gpu

    def _link(self, gpu: FakeGpu, link: int) -> FakeLink:
        if not gpu.links:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < len(gpu.links):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.links[link]

    def _event_set(self, event_set: Any) -> _EventSet:
        state = self._event_sets.get(_pointer_address(event_set) or -1)
        if state is None or state.freed:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        assert state is not None
        return state

    # ---- library ------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            _raise(self.init_error)
        self._refcount += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self._refcount -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self.gpus[index].lost:
            _raise(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self.handle(index)

    # ---- identity and PCIe --------------------------------------------------------------

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._gpu(handle, "nvmlDeviceGetUUID")[1].uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._gpu(handle, "nvmlDeviceGetName")[1].name

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        gpu = self._gpu(handle, "nvmlDeviceGetPciInfo")[1]
        return _pci_info(gpu.pci_bus_id, gpu.pci_device_id)

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetCurrPcieLinkGeneration")[1].curr_gen

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetCurrPcieLinkWidth")[1].curr_width

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetMaxPcieLinkGeneration")[1].max_gen

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetMaxPcieLinkWidth")[1].max_width

    def nvmlDeviceGetPcieThroughput(self, device: Any, counter: int) -> int:
        gpu = self._gpu(device, "nvmlDeviceGetPcieThroughput")[1]
        if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES:
            return gpu.pcie_throughput_tx_kbps
        if counter == pynvml.NVML_PCIE_UTIL_RX_BYTES:
            return gpu.pcie_throughput_rx_kbps
        _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return 0

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetPcieReplayCounter")[1].replay_counter

    # ---- field values -------------------------------------------------------------------

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: Sequence[Any]) -> Any:
        index, gpu = self._gpu(handle, "nvmlDeviceGetFieldValues")
        requested = [w if isinstance(w, tuple) else (w, 0) for w in fieldIds]
        self.field_requests.append((index, requested))
        now = self._clock_us()
        links, unsupported = gpu.links, gpu.unsupported
        ok, ull, u64 = pynvml.NVML_SUCCESS, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, _U64
        ull_record, throughput = _RECORDS[ull], _NVLINK_FIELD_ATTRS
        records: list[bytes] = []
        for field_id, scope_id in requested:
            attr = throughput.get(field_id)
            if attr is not None and 0 <= scope_id < len(links) and field_id not in unsupported:
                # One link's throughput counter: 72 of the 74 fields an H100 is asked for.
                number = getattr(links[scope_id], attr) & u64
                records.append(ull_record.pack(field_id, scope_id, now, 0, ull, ok, number))
                continue
            ret, value_type, number = self._field(gpu, field_id, scope_id)
            if ret == ok:
                record = _RECORDS[value_type]
                records.append(record.pack(field_id, scope_id, now, 0, value_type, ret, number))
            else:
                # A field that failed has only its ids and its return filled in.
                records.append(_FIELD_VALUE.pack(field_id, scope_id, 0, 0, 0, ret, _NO_VALUE))
        # The array is built from its bytes: filling pynvml's structs attribute by attribute
        # costs more than the simulated node's whole NVML read. The layout is nvml.h's, checked
        # against pynvml's declaration (_check_field_value_layout).
        array_type = pynvml.c_nvmlFieldValue_t * len(records)
        return array_type.from_buffer_copy(b"".join(records)) if records else array_type()

    def _field(self, gpu: FakeGpu, field_id: int, scope_id: int) -> tuple[int, int, int]:
        """One field of ``gpu``: (nvmlReturn, valueType, number). A per-link throughput
        field of a link the GPU has is answered before this, in the same way."""
        if field_id in gpu.unsupported:
            return pynvml.NVML_ERROR_NOT_SUPPORTED, 0, 0
        if field_id in (FI_PCIE_TX_BYTES, FI_PCIE_RX_BYTES):
            raw = gpu.pcie_tx_bytes if field_id == FI_PCIE_TX_BYTES else gpu.pcie_rx_bytes
            number = raw & ((1 << gpu.pcie_counter_bits) - 1)
            if gpu.pcie_counter_bits <= 32:
                return pynvml.NVML_SUCCESS, pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, number
            return pynvml.NVML_SUCCESS, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, number
        if field_id == pynvml.NVML_FI_DEV_MEMORY_TEMP:
            return pynvml.NVML_SUCCESS, pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, gpu.temperature_memory
        attr = _NVLINK_FIELD_ATTRS.get(field_id)
        if attr is None:
            return pynvml.NVML_ERROR_NOT_SUPPORTED, 0, 0
        if not gpu.links:
            return pynvml.NVML_ERROR_NOT_SUPPORTED, 0, 0
        if scope_id == 0xFFFFFFFF:
            number = sum(getattr(link, attr) for link in gpu.links)
        elif scope_id < len(gpu.links):
            number = getattr(gpu.links[scope_id], attr)
        else:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT, 0, 0
        return pynvml.NVML_SUCCESS, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, number & _U64

    # ---- NVLink -------------------------------------------------------------------------

    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        gpu = self._gpu(device, "nvmlDeviceGetNvLinkState")[1]
        return pynvml.NVML_FEATURE_ENABLED if self._link(gpu, link).active else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: Any, link: int) -> Any:
        gpu = self._gpu(device, "nvmlDeviceGetNvLinkRemotePciInfo")[1]
        remote = self._link(gpu, link).remote_pci_bus_id
        return _pci_info(remote, 0)

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetNvLinkRemoteDeviceType")[1]
        return self._link(gpu, link).remote_type

    def nvmlDeviceGetNvLinkErrorCounter(self, device: Any, link: int, counter: int) -> int:
        gpu = self._gpu(device, "nvmlDeviceGetNvLinkErrorCounter")[1]
        fake_link = self._link(gpu, link)
        if not 0 <= counter <= pynvml.NVML_NVLINK_ERROR_DL_ECC_DATA:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if gpu.unsupported and _ERROR_COUNTER_CALLS[counter] in gpu.unsupported:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return fake_link.errors.get(counter, 0)

    # ---- processes and utilisation ------------------------------------------------------

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        gpu = self._gpu(handle, "nvmlDeviceGetComputeRunningProcesses")[1]
        result = []
        for proc in gpu.processes:
            info = pynvml.c_nvmlProcessInfo_t()
            info.pid = proc.pid
            info.usedGpuMemory = (
                pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
                if proc.used_memory_bytes is None
                else proc.used_memory_bytes
            )
            info.gpuInstanceId = 0xFFFFFFFF
            info.computeInstanceId = 0xFFFFFFFF
            obj = pynvml.nvmlStructToFriendlyObject(info)
            if obj.usedGpuMemory == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                obj.usedGpuMemory = None
            result.append(obj)
        return result

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        gpu = self._gpu(handle, "nvmlDeviceGetUtilizationRates")[1]
        util = pynvml.c_nvmlUtilization_t()
        util.gpu = gpu.gpu_util
        util.memory = gpu.memory_util
        return util

    def nvmlDeviceGetDecoderUtilization(self, handle: Any) -> list[int]:
        gpu = self._gpu(handle, "nvmlDeviceGetDecoderUtilization")[1]
        return [gpu.decoder_util, gpu.sampling_period_us]

    def nvmlDeviceGetEncoderUtilization(self, handle: Any) -> list[int]:
        gpu = self._gpu(handle, "nvmlDeviceGetEncoderUtilization")[1]
        return [gpu.encoder_util, gpu.sampling_period_us]

    def nvmlDeviceGetJpgUtilization(self, handle: Any) -> list[int]:
        gpu = self._gpu(handle, "nvmlDeviceGetJpgUtilization")[1]
        return [gpu.jpeg_util, gpu.sampling_period_us]

    # ---- health -------------------------------------------------------------------------

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetTotalEccErrors")[1]
        counts = {
            (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC): (
                gpu.ecc_volatile_corrected
            ),
            (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC): (
                gpu.ecc_volatile_uncorrected
            ),
            (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_AGGREGATE_ECC): (
                gpu.ecc_aggregate_corrected
            ),
            (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_AGGREGATE_ECC): (
                gpu.ecc_aggregate_uncorrected
            ),
        }
        count = counts.get((errorType, counterType))
        if count is None:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(count or 0)

    def nvmlDeviceGetRetiredPages(self, device: Any, sourceFilter: int) -> list[int]:
        gpu = self._gpu(device, "nvmlDeviceGetRetiredPages")[1]
        if sourceFilter == pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS:
            count, base = gpu.retired_pages_single_bit, 0x10_0000_0000
        elif sourceFilter == pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR:
            count, base = gpu.retired_pages_double_bit, 0x20_0000_0000
        else:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        # The binding returns the retired pages' addresses; the fake makes up distinct ones.
        return [base + 0x1000 * n for n in range(count)]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: Any) -> int:
        gpu = self._gpu(device, "nvmlDeviceGetRetiredPagesPendingStatus")[1]
        return pynvml.NVML_FEATURE_ENABLED if gpu.retired_pages_pending else 0

    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]:
        gpu = self._gpu(device, "nvmlDeviceGetRemappedRows")[1]
        return (
            gpu.remapped_rows_correctable,
            gpu.remapped_rows_uncorrectable,
            int(gpu.remap_pending),
            int(gpu.remap_failed),
        )

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetTemperature")[1]
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.temperature_gpu

    def nvmlDeviceGetTemperatureThreshold(self, handle: Any, threshold: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetTemperatureThreshold")[1]
        thresholds = {
            pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: gpu.temperature_shutdown,
            pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: gpu.temperature_slowdown,
            pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX: gpu.temperature_memory_max,
            pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX: gpu.temperature_gpu_max,
        }
        value = thresholds.get(threshold)
        if value is None:
            # The acoustic and GPS thresholds are not a data-center GPU's.
            valid = 0 <= threshold < pynvml.NVML_TEMPERATURE_THRESHOLD_COUNT
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED if valid else pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(value or 0)

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return int(self._gpu(handle, "nvmlDeviceGetPowerUsage")[1].power_draw_mw)

    def nvmlDeviceGetPowerManagementLimit(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetPowerManagementLimit")[1].power_limit_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetEnforcedPowerLimit")[1].power_enforced_limit_mw

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: Any) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetPowerManagementDefaultLimit")[1]
        return gpu.power_default_limit_mw

    def nvmlDeviceGetApplicationsClock(self, handle: Any, type: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetApplicationsClock")[1]
        if type in (pynvml.NVML_CLOCK_GRAPHICS, pynvml.NVML_CLOCK_SM):
            return gpu.applications_sm_clock_mhz
        if type == pynvml.NVML_CLOCK_MEM:
            return gpu.applications_memory_clock_mhz
        _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return 0

    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetClockInfo")[1]
        if type in (pynvml.NVML_CLOCK_GRAPHICS, pynvml.NVML_CLOCK_SM):
            # A data-center GPU runs its graphics and SM clocks together.
            return gpu.sm_clock_mhz
        if type == pynvml.NVML_CLOCK_MEM:
            return gpu.memory_clock_mhz
        if type == pynvml.NVML_CLOCK_VIDEO:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)  # not modelled
        _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return 0

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetCurrentClocksEventReasons")[1]
        return gpu.clock_event_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        # The name drivers before the clock-event rename have: the same mask.
        gpu = self._gpu(handle, "nvmlDeviceGetCurrentClocksThrottleReasons")[1]
        return gpu.clock_event_reasons

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
        gpu = self._gpu(handle, "nvmlDeviceGetMemoryInfo")[1]
        free = max(gpu.fb_total_bytes - gpu.fb_used_bytes, 0)
        if not version:
            memory = pynvml.c_nvmlMemory_t()
        else:
            if version != pynvml.nvmlMemory_v2:
                _raise(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
            memory = pynvml.c_nvmlMemory_v2_t()
            memory.version = version
            memory.reserved = 0  # not modelled: used then matches the first version's
        memory.total = gpu.fb_total_bytes
        memory.used = gpu.fb_used_bytes
        memory.free = free
        return memory

    def _fill_fabric(self, gpu: FakeGpu, info: Any, with_mask: bool) -> None:
        info.clusterUuid[:] = list(uuid.UUID(gpu.fabric_cluster_uuid).bytes)
        info.status = gpu.fabric_status
        info.cliqueId = gpu.fabric_clique_id
        info.state = gpu.fabric_state
        if with_mask:
            info.healthMask = gpu.fabric_health_mask

    def nvmlDeviceGetGpuFabricInfo(self, device: Any, gpuFabricInfo: Any) -> int:
        gpu = self._gpu(device, "nvmlDeviceGetGpuFabricInfo")[1]
        info = _struct_of(gpuFabricInfo, (pynvml.c_nvmlGpuFabricInfo_t,))
        if info is None:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._fill_fabric(gpu, info, with_mask=False)
        return int(pynvml.NVML_SUCCESS)

    def nvmlDeviceGetGpuFabricInfoV(self, device: Any, gpuFabricInfo: Any) -> int:
        gpu = self._gpu(device, "nvmlDeviceGetGpuFabricInfoV")[1]
        info = _struct_of(
            gpuFabricInfo, (pynvml.c_nvmlGpuFabricInfo_v2_t, pynvml.c_nvmlGpuFabricInfo_v3_t)
        )
        if info is None:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        # The driver reads the layout from the version: it must name the structure passed.
        expected = (
            pynvml.nvmlGpuFabricInfo_v3
            if isinstance(info, pynvml.c_nvmlGpuFabricInfo_v3_t)
            else pynvml.nvmlGpuFabricInfo_v2
        )
        if info.version != expected:
            _raise(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        self._fill_fabric(gpu, info, with_mask=True)
        return int(pynvml.NVML_SUCCESS)

    # ---- GPM ----------------------------------------------------------------------------

    def _gpm_sample(self, gpmSample: Any) -> _GpmSample:
        state = self._gpm_samples.get(_pointer_address(gpmSample) or -1)
        if state is None:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        assert state is not None
        return state

    def nvmlGpmQueryDeviceSupport(self, device: Any) -> Any:
        self._gpu(device, "nvmlGpmQueryDeviceSupport")
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = 1
        return support

    def nvmlGpmSampleAlloc(self) -> Any:
        self._enter("nvmlGpmSampleAlloc")
        address = _GPM_SAMPLE_BASE + 0x100 * next(self._gpm_ids)
        self._gpm_samples[address] = _GpmSample()
        return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlGpmSample_t)

    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        self._enter("nvmlGpmSampleFree")
        self._gpm_sample(gpmSample)
        del self._gpm_samples[_pointer_address(gpmSample) or -1]

    def nvmlGpmSampleGet(self, device: Any, gpmSample: Any) -> Any:
        index, gpu = self._gpu(device, "nvmlGpmSampleGet")
        if "nvmlGpmQueryDeviceSupport" in gpu.unsupported:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        sample = self._gpm_sample(gpmSample)
        sample.gpu, sample.taken_us = index, self._clock_us()
        return gpmSample

    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        self._enter("nvmlGpmMetricsGet")
        if not isinstance(metricsGet, pynvml.c_nvmlGpmMetricsGet_t):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if metricsGet.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            _raise(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        first = self._gpm_sample(metricsGet.sample1)
        second = self._gpm_sample(metricsGet.sample2)
        if (
            first.gpu is None
            or first.gpu != second.gpu
            or second.taken_us is None
            or first.taken_us is None
            or second.taken_us < first.taken_us
            or not 0 <= metricsGet.numMetrics <= pynvml.NVML_GPM_METRIC_MAX
        ):
            # Two samples of one GPU, the older first.
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[first.gpu or 0]
        for i in range(metricsGet.numMetrics):
            metric = metricsGet.metrics[i]
            attr = _GPM_METRIC_ATTRS.get(metric.metricId)
            unsupported = (
                attr is None
                or f"nvmlGpmMetricsGet:{metric.metricId}" in gpu.unsupported
                or (metric.metricId in _GPM_NVLINK_METRICS and not gpu.links)
            )
            if unsupported:
                metric.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                metric.value = 0.0
            else:
                metric.nvmlReturn = pynvml.NVML_SUCCESS
                metric.value = float(getattr(gpu, str(attr)))
        return metricsGet

    # ---- events -------------------------------------------------------------------------

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        return self._gpu(handle, "nvmlDeviceGetSupportedEventTypes")[1].supported_events

    def nvmlEventSetCreate(self) -> Any:
        self._enter("nvmlEventSetCreate")
        with self._cond:
            address = _EVENT_SET_BASE + 0x100 * next(self._event_ids)
            self._event_sets[address] = _EventSet()
        return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlEventSet_t)

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        index, gpu = self._gpu(handle, "nvmlDeviceRegisterEvents")
        with self._cond:
            state = self._event_set(eventSet)
            if eventTypes & ~gpu.supported_events:
                _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
            state.masks[index] = state.masks.get(index, 0) | eventTypes

    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> Any:
        self._enter("nvmlEventSetWait")
        deadline = time.monotonic() + timeoutms / 1000.0
        with self._cond:
            state = self._event_set(eventSet)
            while not state.queue:
                left = deadline - time.monotonic()
                if left <= 0 or state.freed:
                    _raise(pynvml.NVML_ERROR_TIMEOUT)
                self._cond.wait(left)
            index, event_type, data = state.queue.popleft()
        event = pynvml.c_nvmlEventData_t()
        event.device = self.handle(index)
        event.eventType = event_type
        event.eventData = data
        event.gpuInstanceId = 0xFFFFFFFF
        event.computeInstanceId = 0xFFFFFFFF
        return event

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        self._enter("nvmlEventSetFree")
        with self._cond:
            state = self._event_set(eventSet)
            state.freed = True
            self._cond.notify_all()


#: PCI buses of the H100s and NVSwitches of the HGX H100 server whose ``lspci -vvv`` is in
#: ``tests/fixtures/captures/hgx-h100`` (devices 10de:2330 and the 10de:22a3 bridges).
HGX_H100_GPU_BUSES = (0x19, 0x3B, 0x4C, 0x5D, 0x9B, 0xBB, 0xCB, 0xDB)
HGX_H100_NVSWITCH_BUSES = (0x83, 0x84, 0x85, 0x86)
#: The fabric clique and cluster the fake HGX H100's GPUs registered in (made up: one per
#: node, the same for every GPU of it).
HGX_H100_FABRIC_CLIQUE_ID = 1
HGX_H100_FABRIC_CLUSTER_UUID = "5e1f4a0b-9c3d-4e00-8000-00000000c1a5"


def hgx_h100(gpus: int = 8, links: int = 18) -> list[FakeGpu]:
    """An HGX H100-like node: H100 SXM GPUs with 18 NVLinks each, all to the 4 NVSwitches.

    Bus numbers are those of a real HGX H100 server (see the constants above); links are
    spread over the switches 5/4/4/5, as on the HGX H100 8-GPU baseboard. Every GPU has
    registered with the fabric manager (state completed, status success), in one clique of
    one cluster, as the GPUs of an NVSwitch baseboard do.
    """
    switches = [f"00000000:{bus:02X}:00.0" for bus in HGX_H100_NVSWITCH_BUSES]
    per_switch = (5, 4, 4, 5)
    switch_of_link = [s for s, n in enumerate(per_switch) for _ in range(n)]
    result = []
    for i in range(gpus):
        result.append(
            FakeGpu(
                uuid=f"GPU-{i:08x}-5e1f-4a0b-9c3d-{0x1000 + i:012x}",
                name="NVIDIA H100 80GB HBM3",
                pci_bus_id=f"00000000:{HGX_H100_GPU_BUSES[i % 8]:02X}:00.0",
                links=[
                    FakeLink(remote_pci_bus_id=switches[switch_of_link[n % len(switch_of_link)]])
                    for n in range(links)
                ],
                fabric_state=pynvml.NVML_GPU_FABRIC_STATE_COMPLETED,
                fabric_status=pynvml.NVML_SUCCESS,
                fabric_clique_id=HGX_H100_FABRIC_CLIQUE_ID,
                fabric_cluster_uuid=HGX_H100_FABRIC_CLUSTER_UUID,
            )
        )
    return result
