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

The records, their rates (:func:`gpu_rates`) and the Xid meanings are declared in
:mod:`nodescope.model.nvml`, so what reads them need not load pynvml; this module names them
too, for the code that builds and tests the source.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import functools
import logging
import os
import re
import struct
import sys
import threading
import time
import uuid as _uuid
from collections import Counter as _Counter
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn, Protocol

import pynvml

from nodescope.errors import ParseError
from nodescope.model.gpu_health import (
    HEALTH_EVERY,
    Clocks,
    EccErrors,
    Fabric,
    FrameBuffer,
    Gpm,
    GpuHealth,
    Power,
    RetiredPages,
    RowRemap,
    Temperatures,
    fabric_bandwidth_degraded,
)
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
    NvLinks,
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
from nodescope.sources.kernel_log import (
    REFUSED_NOT_KERNEL,
    is_dictionary_line,
    printable,
    refusal,
    split_line,
)
from nodescope.sources.spec import SourceSpec

NAME = NVML.name

log = logging.getLogger("nodescope.sources.nvml")

FI_NVLINK_DATA_TX = 138  # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, KiB, payload
FI_NVLINK_DATA_RX = 139
FI_NVLINK_RAW_TX = 140  # _RAW_: payload plus protocol overhead, KiB
FI_NVLINK_RAW_RX = 141
FI_PCIE_TX_BYTES = 197  # NVML_FI_DEV_PCIE_COUNT_TX_BYTES, bytes, "can be wrapped"
FI_PCIE_RX_BYTES = 198
NVLINK_FIELDS = (FI_NVLINK_DATA_TX, FI_NVLINK_DATA_RX, FI_NVLINK_RAW_TX, FI_NVLINK_RAW_RX)
_PCIE_FIELDS = frozenset({(FI_PCIE_TX_BYTES, 0), (FI_PCIE_RX_BYTES, 0)})

#: NVML_NVLINK_ERROR_DL_* counters read per link, by the name the record gives them.
NVLINK_ERROR_COUNTERS: tuple[tuple[str, int], ...] = (
    ("replay", 0),  # NVML_NVLINK_ERROR_DL_REPLAY: data link transmit replays
    ("recovery", 1),  # NVML_NVLINK_ERROR_DL_RECOVERY: link recoveries
    ("crc_flit", 2),  # NVML_NVLINK_ERROR_DL_CRC_FLIT: flow-control digit CRC errors
    ("crc_data", 3),  # NVML_NVLINK_ERROR_DL_CRC_DATA: data CRC errors
)

_ERROR_COUNTER_KEYS = tuple(
    (name, counter, f"nvmlDeviceGetNvLinkErrorCounter:{name}")
    for name, counter in NVLINK_ERROR_COUNTERS
)

#: Runs between two reads of the NVLink states and error counters, the PCIe link
#: generation and width and the PCIe replay counter (see the module docstring).
SLOW_EVERY = 10

#: Runs between two GPM samples; health (ECC, row remapping, temperatures, power, clocks,
#: fabric: docs/datasources.md §1.8) is read every ``HEALTH_EVERY`` runs (model.gpu_health).
GPM_EVERY = 30

#: Longest ``nvmlEventSetWait`` of the Xid thread, in ms. The wait returns at once when an
#: event arrives, so this bounds only how often the thread wakes with nothing to do (a timeout)
#: and how long :meth:`NvmlSource.close` may wait for it. Each timeout is a thread wake-up
#: and a raised ``NVMLError_Timeout``, about 160 µs of CPU measured in a virtual machine: at
#: 200 ms the idle thread cost 0.8 ms of CPU a second on the simulated HGX node, as much as a
#: whole per-cycle source; at 2 s a tenth of that, and a close (daemon stop, NVML gone) waits
#: at most 2.5 s.
EVENT_WAIT_MS = 2000

#: ``SkipTally`` reason of a health value no GPU can answer (a negative count, a GPU at
#: 250 °C): the value is dropped, the rest of the read kept.
SKIP_HEALTH_VALUE_IMPOSSIBLE = "gpu_health_value_impossible"

# The range of each kind of health value a GPU can answer, both ends included. Counts, masks
# and byte sizes are NVML's unsigned 64-bit numbers; the other bounds are far beyond any GPU
# (the hottest thresholds are near 100 °C, the largest boards draw about 1.2 kW, GDDR7 memory
# clocks report about 14 GHz), so only garbage falls outside.
COUNT_RANGE = (0, (1 << 64) - 1)
FLAG_RANGE = (0, 1)
CELSIUS_RANGE = (0, 200)
MILLIWATTS_RANGE = (0, 10_000_000)
MHZ_RANGE = (0, 100_000)
PERCENT_RANGE = (0.0, 100.0)
#: GPM traffic in MiB/s: 10^8 MiB/s is about 100 TB/s, some 50 times today's NVLink.
MIB_PER_SECOND_RANGE = (0.0, 1e8)
#: fabric state numbers: a newer driver may add states (the record names them by number);
#: the v4 structure holds the state in one byte
FABRIC_STATE_RANGE = (0, 0xFF)
# A GPM percentage a hair above 100 is the driver's floating-point arithmetic, not garbage.
_FLOAT_SLACK = 1e-6


def plausible(value: object, bounds: tuple[int, int]) -> int | None:
    """``value`` when it is an integer within ``bounds``, else ``None``."""
    if not isinstance(value, int):
        return None
    low, high = bounds
    return value if low <= value <= high else None


def plausible_float(value: object, bounds: tuple[float, float]) -> float | None:
    """``value`` as a float when it is a finite number within ``bounds``, else ``None``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    low, high = bounds
    if not low - _FLOAT_SLACK <= number <= high + _FLOAT_SLACK:  # NaN fails both
        return None
    return min(max(number, low), high)


def fabric_uuid(raw: bytes) -> str | None:
    """The cluster UUID of a fabric registration in its usual form; ``None`` for all zeros
    (no cluster) or a size that is not 16 bytes."""
    if len(raw) != 16 or not any(raw):
        return None
    return str(_uuid.UUID(bytes=raw))


#: nvmlDeviceGetTotalEccErrors reads: (record field, errorType, counterType).
ECC_READS: tuple[tuple[str, int, int], ...] = (
    ("volatile_corrected", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC),
    ("volatile_uncorrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC),
    ("aggregate_corrected", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_AGGREGATE_ECC),
    (
        "aggregate_uncorrected",
        pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        pynvml.NVML_AGGREGATE_ECC,
    ),
)
#: nvmlDeviceGetRetiredPages causes: (record field, NVML_PAGE_RETIREMENT_CAUSE_*).
RETIRED_PAGE_READS: tuple[tuple[str, int], ...] = (
    ("single_bit_ecc", pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS),
    ("double_bit_ecc", pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR),
)
#: nvmlDeviceGetTemperatureThreshold reads: (record field, NVML_TEMPERATURE_THRESHOLD_*).
THRESHOLD_READS: tuple[tuple[str, int], ...] = (
    ("slowdown", pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
    ("shutdown", pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
    ("gpu_max", pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX),
    ("memory_max", pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX),
)
#: The HBM temperature field (°C), read with nvmlDeviceGetFieldValues on health runs.
FI_MEMORY_TEMP = 82  # NVML_FI_DEV_MEMORY_TEMP
#: GPM metrics read: (Gpm field, NVML_GPM_METRIC_*, MiB/s to be turned into bytes/s).
GPM_METRICS: tuple[tuple[str, int, bool], ...] = (
    ("sm_activity_percent", pynvml.NVML_GPM_METRIC_SM_UTIL, False),
    ("tensor_activity_percent", pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL, False),
    ("dram_bandwidth_percent", pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL, False),
    ("nvlink_tx_bytes_per_second", pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC, True),
    ("nvlink_rx_bytes_per_second", pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC, True),
    ("pcie_tx_bytes_per_second", pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC, True),
    ("pcie_rx_bytes_per_second", pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC, True),
)
_MIB = 1 << 20

# The keys NOT_SUPPORTED health calls are remembered under (and listed in
# GpuHealth.unsupported): the pynvml function, and for a call asked several ways the way.
_ECC_KEYS = tuple(f"nvmlDeviceGetTotalEccErrors:{name}" for name, _e, _c in ECC_READS)
_RETIRED_KEYS = tuple(f"nvmlDeviceGetRetiredPages:{name}" for name, _c in RETIRED_PAGE_READS)
_THRESHOLD_KEYS = tuple(f"nvmlDeviceGetTemperatureThreshold:{name}" for name, _t in THRESHOLD_READS)
_GPM_METRIC_KEYS = tuple(f"nvmlGpmMetricsGet:{name}" for name, _m, _b in GPM_METRICS)
_K_PENDING = "nvmlDeviceGetRetiredPagesPendingStatus"
_K_REMAP = "nvmlDeviceGetRemappedRows"
_K_TEMP = "nvmlDeviceGetTemperature:gpu"
_K_MEMORY_TEMP = "nvmlDeviceGetFieldValues:NVML_FI_DEV_MEMORY_TEMP"
_K_POWER = "nvmlDeviceGetPowerUsage"
_K_LIMIT = "nvmlDeviceGetPowerManagementLimit"
_K_ENFORCED = "nvmlDeviceGetEnforcedPowerLimit"
_K_DEFAULT_LIMIT = "nvmlDeviceGetPowerManagementDefaultLimit"
_K_APP_CLOCK = "nvmlDeviceGetApplicationsClock:sm"
_K_SM_CLOCK = "nvmlDeviceGetClockInfo:sm"
_K_MEM_CLOCK = "nvmlDeviceGetClockInfo:mem"
_K_EVENTS = "nvmlDeviceGetCurrentClocksEventReasons"
_K_THROTTLE = "nvmlDeviceGetCurrentClocksThrottleReasons"
_K_MEMORY = "nvmlDeviceGetMemoryInfo"
_K_FABRIC_V = "nvmlDeviceGetGpuFabricInfoV"
_K_FABRIC = "nvmlDeviceGetGpuFabricInfo"
_K_GPM_SUPPORT = "nvmlGpmQueryDeviceSupport"
_K_GPM_ALLOC = "nvmlGpmSampleAlloc"
_K_GPM_GET = "nvmlGpmSampleGet"
_K_GPM_METRICS = "nvmlGpmMetricsGet"
_HEALTH_KEYS = frozenset(
    (
        *_ECC_KEYS,
        *_RETIRED_KEYS,
        *_THRESHOLD_KEYS,
        *_GPM_METRIC_KEYS,
        _K_PENDING,
        _K_REMAP,
        _K_TEMP,
        _K_MEMORY_TEMP,
        _K_POWER,
        _K_LIMIT,
        _K_ENFORCED,
        _K_DEFAULT_LIMIT,
        _K_APP_CLOCK,
        _K_SM_CLOCK,
        _K_MEM_CLOCK,
        _K_EVENTS,
        _K_THROTTLE,
        _K_MEMORY,
        _K_FABRIC_V,
        _K_FABRIC,
        _K_GPM_SUPPORT,
        _K_GPM_ALLOC,
        _K_GPM_GET,
        _K_GPM_METRICS,
    )
)

#: nvmlDeviceGetNvLinkRemoteDeviceType values (nvml.h nvmlIntNvLinkDeviceType_t).
REMOTE_TYPES = {0: "gpu", 1: "ibmnpu", 2: "switch", 0xFF: "unknown"}

# Errors after which NVML as a whole is unusable until it is initialised again.
_LIBRARY_GONE: tuple[type[BaseException], ...] = (
    pynvml.NVMLError_Uninitialized,
    pynvml.NVMLError_DriverNotLoaded,
    pynvml.NVMLError_LibraryNotFound,
    pynvml.NVMLError_LibRmVersionMismatch,
)
# Errors that say a call or field will never answer on this GPU and driver.
_NEVER: tuple[type[BaseException], ...] = (
    pynvml.NVMLError_NotSupported,
    pynvml.NVMLError_FunctionNotFound,
)

# valueType -> (union member, width in bits; None for a double).
_VALUE_MEMBERS: dict[int, tuple[str, int | None]] = {
    0: ("dVal", None),
    1: ("uiVal", 32),
    2: ("ulVal", ctypes.sizeof(ctypes.c_ulong) * 8),
    3: ("ullVal", 64),
    4: ("sllVal", 63),
    5: ("siVal", 31),
    6: ("usVal", 16),
}
# valueType -> (the union member's native struct format, width in bits): every member of
# the c_nvmlValue_t union starts at its first byte.
_VALUE_FORMATS: dict[int, tuple[struct.Struct, int | None]] = {
    0: (struct.Struct("@d"), None),
    1: (struct.Struct("@I"), 32),
    2: (struct.Struct("@L"), ctypes.sizeof(ctypes.c_ulong) * 8),
    3: (struct.Struct("@Q"), 64),
    4: (struct.Struct("@q"), 63),
    5: (struct.Struct("@i"), 31),
    6: (struct.Struct("@H"), 16),
}
_VALUE_TYPE_ULL = 3
_UNION_BYTES = 8

#: ``c_nvmlFieldValue_t`` (nvml.h) as one native struct: fieldId, scopeId, timestamp,
#: latencyUsec, valueType, nvmlReturn, and the 8 bytes of the value union as an unsigned
#: 64-bit number (the ``ullVal`` member; the others are decoded from its bytes).
_FIELD_ROW = "IIqqIIQ"
_FIELD_ROW_SIZE = struct.calcsize("@" + _FIELD_ROW)
#: The columns of :func:`field_columns`, in this order.
FIELD_COLUMNS = (
    "fieldId",
    "scopeId",
    "timestamp",
    "latencyUsec",
    "valueType",
    "nvmlReturn",
    "value",
)


def _field_value_layout_matches() -> bool:
    """Whether pynvml declares ``c_nvmlFieldValue_t`` with nvml.h's layout, so an array of
    them can be unpacked from its memory; otherwise values are read attribute by attribute."""
    cls = pynvml.c_nvmlFieldValue_t
    names = ("fieldId", "scopeId", "timestamp", "latencyUsec", "valueType", "nvmlReturn", "value")
    try:
        placed = [(getattr(cls, name).offset, getattr(cls, name).size) for name in names]
    except AttributeError:
        return False
    expected = [(0, 4), (4, 4), (8, 8), (16, 8), (24, 4), (28, 4), (32, _UNION_BYTES)]
    return placed == expected and ctypes.sizeof(cls) == _FIELD_ROW_SIZE


_FIELD_ROWS_FROM_MEMORY = _field_value_layout_matches()


class NvmlAdapter(Protocol):
    """The pynvml functions this source calls, with pynvml's names and argument order.

    The ``pynvml`` module satisfies it; the simulated node hands in
    :class:`nodescope.sim.fake_nvml.FakeNvml`. ``nvmlDeviceGetJpgUtilization``,
    ``nvmlDeviceGetCurrentClocksEventReasons``, ``nvmlDeviceGetGpuFabricInfoV`` and the GPM
    functions are looked up with ``getattr``: older bindings lack them (the clock reasons then
    come from ``...ThrottleReasons``, the fabric from ``nvmlDeviceGetGpuFabricInfo``).
    """

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int, /) -> Any: ...
    def nvmlDeviceGetUUID(self, handle: Any, /) -> str: ...
    def nvmlDeviceGetName(self, handle: Any, /) -> str: ...
    def nvmlDeviceGetPciInfo(self, handle: Any, /) -> Any: ...
    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: Sequence[Any], /) -> Any: ...
    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any, /) -> int: ...
    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any, /) -> int: ...
    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any, /) -> int: ...
    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any, /) -> int: ...
    def nvmlDeviceGetPcieThroughput(self, device: Any, counter: int, /) -> int: ...
    def nvmlDeviceGetPcieReplayCounter(self, handle: Any, /) -> int: ...
    def nvmlDeviceGetNvLinkState(self, device: Any, link: int, /) -> int: ...
    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: Any, link: int, /) -> Any: ...
    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int, /) -> int: ...
    def nvmlDeviceGetNvLinkErrorCounter(self, device: Any, link: int, counter: int, /) -> int: ...
    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any, /) -> list[Any]: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any, /) -> Any: ...
    def nvmlDeviceGetDecoderUtilization(self, handle: Any, /) -> list[int]: ...
    def nvmlDeviceGetEncoderUtilization(self, handle: Any, /) -> list[int]: ...
    def nvmlDeviceGetJpgUtilization(self, handle: Any, /) -> list[int]: ...
    def nvmlDeviceGetSupportedEventTypes(self, handle: Any, /) -> int: ...
    def nvmlEventSetCreate(self) -> Any: ...
    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any, /) -> None: ...
    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int, /) -> Any: ...
    def nvmlEventSetFree(self, eventSet: Any, /) -> None: ...
    # Health (docs/datasources.md §1.8).
    def nvmlDeviceGetTotalEccErrors(
        self, handle: Any, errorType: int, counterType: int, /
    ) -> int: ...
    def nvmlDeviceGetRetiredPages(self, device: Any, sourceFilter: int, /) -> list[int]: ...
    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: Any, /) -> int: ...
    def nvmlDeviceGetRemappedRows(self, device: Any, /) -> tuple[int, int, int, int]: ...
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int, /) -> int: ...
    def nvmlDeviceGetTemperatureThreshold(self, handle: Any, threshold: int, /) -> int: ...
    def nvmlDeviceGetPowerUsage(self, handle: Any, /) -> int: ...
    def nvmlDeviceGetPowerManagementLimit(self, handle: Any, /) -> int: ...
    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any, /) -> int: ...
    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: Any, /) -> int: ...
    def nvmlDeviceGetApplicationsClock(self, handle: Any, type: int, /) -> int: ...
    def nvmlDeviceGetClockInfo(self, handle: Any, type: int, /) -> int: ...
    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any, /) -> int: ...
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any, /) -> int: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None, /) -> Any: ...
    def nvmlDeviceGetGpuFabricInfo(self, device: Any, gpuFabricInfo: Any, /) -> int: ...
    def nvmlDeviceGetGpuFabricInfoV(self, device: Any, gpuFabricInfo: Any, /) -> int: ...
    def nvmlGpmQueryDeviceSupport(self, device: Any, /) -> Any: ...
    def nvmlGpmSampleAlloc(self) -> Any: ...
    def nvmlGpmSampleFree(self, gpmSample: Any, /) -> None: ...
    def nvmlGpmSampleGet(self, device: Any, gpmSample: Any, /) -> Any: ...
    def nvmlGpmMetricsGet(self, metricsGet: Any, /) -> Any: ...


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used (no driver, no library, driver unloaded): the source is down."""


# --------------------------------------------------------------------------------------------
# Pure parsers


@dataclass(frozen=True, slots=True)
class KernelXid:
    """One ``NVRM: Xid`` line of the kernel log."""

    line: int
    pci_address: str
    xid: int
    pid: int | None
    process: str | None
    message: str
    #: /dev/kmsg sequence number and µs since boot, when the text was /dev/kmsg records
    sequence: int | None
    kernel_usec: int | None


_NVML_BUS_ID_RE = re.compile(
    r"([0-9a-fA-F]{1,8}):([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})(?:\.([0-7]))?"
)
#: The driver's line (``kernel_rc.c``), anchored at the start of the message: ``NVRM: Xid
#: (PCI:`` and the address as ``%04x:%02x:%02x``, MIG's ``GPU-I:``/``GPU-C:`` ids, the Xid,
#: ``pid=`` (a number or ``'<unknown>'``), ``name=`` (drivers before R525 print none) and
#: the driver's text.
_XID_RE = re.compile(
    r"NVRM: Xid \(PCI:([0-9a-f]{4,8}):([0-9a-f]{2}):([0-9a-f]{2})(?:\.([0-7]))?"
    r"(?: GPU-I:[0-9a-f]{1,2})?(?: GPU-C:[0-9a-f]{1,2})?\): ([0-9]{1,3}), "
    r"pid=([0-9]{1,10}|'[0-9]{1,10}'|'<unknown>'|<unknown>), "
    r"(?:name=(.{0,16}?), )?(.*)"
)
#: Skip reasons of the kernel-log Xids (``nodescope_source_records_skipped_total{source="nvml"}``).
SKIP_XID_UNPARSABLE = "xid_unparsable"
SKIP_XID_NOT_KERNEL = "xid_not_from_kernel"
SKIP_XID_LEVEL = "xid_not_driver_level"
SKIP_XID_TOO_LONG = "xid_line_too_long"
SKIP_XID_UNKNOWN_GPU = "xid_unknown_gpu"
#: A line longer than this is no kernel record (``CONSOLE_EXT_LOG_MAX`` is 8 KiB).
MAX_XID_LINE = 16384
#: Characters of the driver's text (and of a process name) kept per Xid: it may reach a
#: message, never a whole hostile line.
XID_TEXT_CHARS = 160


def sysfs_pci_address(domain: int, bus: int, device: int, function: int = 0) -> str:
    """The sysfs form ``%04x:%02x:%02x.%d``; wider domains keep all their digits."""
    return f"{domain:04x}:{bus:02x}:{device:02x}.{function}"


def parse_bus_id(text: str, source: str = "nvml busId") -> str:
    """An NVML ``busId`` (``"00000000:9B:00.0"``) or a kernel-log address (``0000:9b:00``) in
    the sysfs form (``"0000:9b:00.0"``)."""
    match = _NVML_BUS_ID_RE.fullmatch(text.strip())
    if match is None:
        raise ParseError(source, f"not a PCI bus id: {text[:40]!r}")
    domain, bus, device, function = match.groups()
    if int(device, 16) > 0x1F:
        raise ParseError(source, f"PCI device number out of range: {text[:40]!r}")
    return sysfs_pci_address(int(domain, 16), int(bus, 16), int(device, 16), int(function or 0))


def parse_kmsg_xid(text: str, tally: SkipTally | None = None) -> tuple[KernelXid, ...]:
    """The ``NVRM: Xid`` records of a kernel log: ``/dev/kmsg`` records, ``dmesg`` output
    (with or without ``[timestamp]``) or journal lines. Other lines are passed over. A line
    that mentions an Xid is one only where its message *starts* with the driver's exact form
    (:mod:`nodescope.sources.kernel_log`): one that does not, is longer than any kernel
    record, was written from user space or has a level the driver never prints it at is
    skipped and counted in ``tally``. Never raises on any text."""
    tally = SkipTally() if tally is None else tally
    found: list[KernelXid] = []
    for number, line in enumerate(text.split("\n"), start=1):
        if "NVRM: Xid" not in line or is_dictionary_line(line):
            continue
        if len(line) > MAX_XID_LINE:
            tally.skip(SKIP_XID_TOO_LONG, line)
            continue
        parts = split_line(line.rstrip("\r"))
        refused = refusal(parts.priority)
        if refused is not None:
            tally.skip(
                SKIP_XID_NOT_KERNEL if refused == REFUSED_NOT_KERNEL else SKIP_XID_LEVEL, line
            )
            continue
        match = _XID_RE.fullmatch(parts.message)
        if match is None or int(match.group(3), 16) > 0x1F:  # a device number has five bits
            tally.skip(SKIP_XID_UNPARSABLE, line)
            continue
        domain, bus, device, function, xid, pid, name, rest = match.groups()
        process = None if name is None or name.strip() in ("", "<unknown>") else name.strip()
        found.append(
            KernelXid(
                line=number,
                pci_address=sysfs_pci_address(
                    int(domain, 16), int(bus, 16), int(device, 16), int(function or 0)
                ),
                xid=int(xid),
                pid=int(pid.strip("'")) if pid.strip("'").isdigit() else None,
                process=None if process is None else printable(process, XID_TEXT_CHARS),
                message=printable(rest.strip(), XID_TEXT_CHARS),
                sequence=parts.sequence,
                kernel_usec=parts.usec,
            )
        )
    return tuple(found)


def field_value(value: Any) -> tuple[int | float, int | None]:
    """The number in a ``c_nvmlFieldValue_t`` and its width in bits, by ``valueType``."""
    member = _VALUE_MEMBERS.get(int(value.valueType))
    if member is None:
        raise ValueError(f"unknown NVML valueType {value.valueType}")
    name, bits = member
    number = getattr(value.value, name)
    return number, bits


def field_columns(values: Any) -> tuple[Sequence[int], ...]:
    """The results of ``nvmlDeviceGetFieldValues`` as the seven columns named by
    :data:`FIELD_COLUMNS`; ``value`` is the union's 8 bytes as an unsigned 64-bit number
    (see :func:`row_value`).

    pynvml returns a ctypes array of ``c_nvmlFieldValue_t``: it is unpacked from its memory
    in one call (pynvml's attribute access costs microseconds a value, and an H100 has 74;
    one flat tuple rather than a tuple per value also spares the garbage collector).
    Anything else is read attribute by attribute into the same columns.
    """
    if (
        _FIELD_ROWS_FROM_MEMORY
        and isinstance(values, ctypes.Array)
        and values._type_ is pynvml.c_nvmlFieldValue_t
    ):
        # Native alignment repeats every row: each row is 40 bytes, a multiple of 8. The
        # format is made per call (the struct module compiles it once and keeps it).
        flat = struct.unpack("@" + _FIELD_ROW * len(values), values)
        width = len(FIELD_COLUMNS)
        return tuple(flat[column::width] for column in range(width))
    rows = [
        (
            int(v.fieldId),
            int(v.scopeId),
            int(v.timestamp),
            int(v.latencyUsec),
            int(v.valueType),
            int(v.nvmlReturn),
            int.from_bytes(bytes(v.value)[:_UNION_BYTES], sys.byteorder),
        )
        for v in values
    ]
    return tuple([row[column] for row in rows] for column in range(len(FIELD_COLUMNS)))


def row_value(value_type: int, union: int) -> tuple[int | float, int | None]:
    """The number of a field row and its width in bits: the member of the value union that
    ``valueType`` names, decoded from the union's bytes (``union`` as
    :func:`field_columns` gives them)."""
    decoder = _VALUE_FORMATS.get(value_type)
    if decoder is None:
        raise ValueError(f"unknown NVML valueType {value_type}")
    fmt, bits = decoder
    number: int | float = fmt.unpack_from(union.to_bytes(_UNION_BYTES, sys.byteorder))[0]
    return number, bits


# --------------------------------------------------------------------------------------------
# The source


@dataclass
class _Link:
    index: int
    active: bool | None = None
    remote_type: str | None = None
    remote_pci_address: str | None = None
    #: the error counters of the last slow read, carried until the next one
    errors: tuple[tuple[str, int], ...] = ()
    #: the throughput fields of this link, as (fieldId, scopeId)
    field_keys: tuple[tuple[int, int], ...] = ()
    #: the keys its per-link calls are remembered under when NOT_SUPPORTED
    call_keys: tuple[str, str, str] = ("", "", "")

    def __post_init__(self) -> None:
        self.field_keys = tuple((fid, self.index) for fid in NVLINK_FIELDS)
        self.call_keys = (
            f"nvmlDeviceGetNvLinkState:{self.index}",
            f"nvmlDeviceGetNvLinkRemoteDeviceType:{self.index}",
            f"nvmlDeviceGetNvLinkRemotePciInfo:{self.index}",
        )


class _Fields:
    """The answers to one GPU's field-value call as columns, by position in the plan:
    value (bytes), timestamp (µs, ``None``: none given) and width (``None``: unknown);
    ``values[i]`` ``None`` where the field gave nothing."""

    __slots__ = ("bits", "stamps", "values")

    def __init__(
        self, values: list[int | None], stamps: list[int | None], bits: list[int | None]
    ) -> None:
        self.values, self.stamps, self.bits = values, stamps, bits

    @classmethod
    def none(cls, count: int) -> _Fields:
        empty: list[int | None] = [None] * count
        return cls(empty, empty, empty)

    def counter(self, at: int | None) -> CounterValue | None:
        value = None if at is None else self.values[at]
        if value is None or at is None:
            return None
        return CounterValue(value, self.stamps[at], self.bits[at])

    def column(self, positions: Sequence[int | None]) -> CounterColumn:
        values, stamps, bits = self.values, self.stamps, self.bits
        return CounterColumn(
            tuple([None if i is None else values[i] for i in positions]),
            tuple([None if i is None else stamps[i] for i in positions]),
            tuple([None if i is None else bits[i] for i in positions]),
        )


@dataclass(frozen=True)
class _FieldPlan:
    """The fields asked of one GPU every run and where each lands in the answer: the
    positions in ``wanted`` of the PCIe fields and of each link's four throughput fields
    (``None`` for a field not asked because it is unsupported)."""

    wanted: list[tuple[int, int]]
    #: per position: a NVLink throughput field, counted in KiB
    kib: list[bool]
    pcie: tuple[int | None, int | None]
    links: list[tuple[int | None, ...]]

    @cached_property
    def widths(self) -> list[int]:
        """Per position, the width an ``unsigned long long`` answer wraps at: 64 bits, and 74
        for a field counted in KiB (stored multiplied out)."""
        return [74 if kib else 64 for kib in self.kib]

    @cached_property
    def link_columns(self) -> tuple[tuple[int | None, ...], ...]:
        """Per throughput field of a link (in ``NVLINK_FIELDS`` order), each link's
        position."""
        return tuple(zip(*self.links, strict=True)) if self.links else ((),) * len(NVLINK_FIELDS)

    @classmethod
    def make(cls, links: Sequence[_Link], unsupported: set[tuple[int, int]]) -> _FieldPlan:
        wanted = [(fid, 0) for fid in (FI_PCIE_TX_BYTES, FI_PCIE_RX_BYTES)]
        for link in links:
            wanted.extend(link.field_keys)
        wanted = [w for w in wanted if w not in unsupported]
        at = {key: i for i, key in enumerate(wanted)}
        return cls(
            wanted=wanted,
            kib=[fid in NVLINK_FIELDS for fid, _ in wanted],
            pcie=(at.get((FI_PCIE_TX_BYTES, 0)), at.get((FI_PCIE_RX_BYTES, 0))),
            links=[tuple(at.get(key) for key in link.field_keys) for link in links],
        )


@dataclass
class _SlowGpu:
    """What a slow read gives a GPU, carried in its records until the next one: the same
    objects, so that what is made of them downstream (the exporter's link families, the
    NVLink graph) is made once per slow read."""

    pcie_gen_current: int | None
    pcie_width_current: int | None
    pcie_gen_max: int | None
    pcie_width_max: int | None
    pcie_replays: int | None
    #: the links' numbers, states, peers and error counters as the columns of NvLinks
    link: tuple[int, ...] = ()
    active: tuple[bool | None, ...] = ()
    remote_type: tuple[str | None, ...] = ()
    remote_pci_address: tuple[str | None, ...] = ()
    errors: tuple[tuple[tuple[str, int], ...], ...] = ()


@dataclass
class _Gpu:
    index: int
    handle: Any
    address: int | None
    uuid: str
    name: str
    pci_address: str
    links: list[_Link]
    unsupported_calls: set[str] = field(default_factory=set)
    unsupported_fields: set[tuple[int, int]] = field(default_factory=set)
    lost: bool = False
    #: the last slow read; None until the first
    slow: _SlowGpu | None = None
    #: the fields asked every run; rebuilt when one turns out unsupported
    plan: _FieldPlan | None = None
    #: calls the binding or the driver does not have (a fallback may stand in for them)
    missing_calls: set[str] = field(default_factory=set)
    #: the last health read, carried in the records until the next one
    health: GpuHealth | None = None
    #: temperature thresholds and the default power limit answered so far: constants of the
    #: board, asked until answered
    thresholds: dict[str, int] = field(default_factory=dict)
    #: whether the GPU has GPM (nvmlGpmQueryDeviceSupport); None until it answered
    gpm_supported: bool | None = None
    #: the two GPM sample buffers, the one holding the latest sample first; None until
    #: allocated
    gpm_samples: list[Any] | None = None
    #: wall-clock time of the sample in ``gpm_samples[0]``; None while it holds none
    gpm_sampled_at: float | None = None
    #: the latest GPM window, carried until the next GPM read
    gpm: Gpm | None = None
    _unsupported_names: tuple[int, int, tuple[str, ...]] = field(
        default=(0, 0, ()), init=False, repr=False
    )

    def unsupported_names(self) -> tuple[str, ...]:
        """The calls and fields that answered NOT_SUPPORTED, sorted, as the record has them."""
        calls, fields, names = self._unsupported_names
        # The sets only grow: their sizes tell whether the names are still those.
        if (calls, fields) != (len(self.unsupported_calls), len(self.unsupported_fields)):
            names = tuple(
                sorted(self.unsupported_calls)
                + [f"field:{fid}:{scope}" for fid, scope in sorted(self.unsupported_fields)]
            )
            calls, fields = len(self.unsupported_calls), len(self.unsupported_fields)
            self._unsupported_names = (calls, fields, names)
        return names


class _GpuLost(Exception):
    def __init__(self, where: str) -> None:
        super().__init__(where)
        self.where = where


def _handle_address(handle: Any) -> int | None:
    """The address behind an NVML handle: the driver hands out the same pointer for the same
    device, so it identifies the device of an event."""
    try:
        value = ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None
    return None if value is None else int(value)


def _error_name(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class KmsgReader:
    """Reads the records appended to ``/dev/kmsg`` since the last call, without blocking.

    ``/dev/kmsg`` returns one record per ``read`` and ``EAGAIN`` when none is left (so
    :func:`sources.base.read_text` does not fit); ``EPIPE`` means records were overwritten
    before we read them, and reading goes on. The first call returns what the ring buffer
    still holds, so Xids from before the daemon started are counted once. A regular file
    (the simulated node's) is read to its end and then followed.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._tail = b""

    def read_new(self) -> str:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        chunks: list[bytes] = [self._tail]
        for _ in range(100_000):
            try:
                chunk = os.read(self._fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue
                raise
            if not chunk:
                break
            chunks.append(chunk)
        # Keep a partial last line (a file still being written) for the next call.
        complete, _, self._tail = b"".join(chunks).rpartition(b"\n")
        return complete.decode("utf-8", errors="replace")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


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
        self._gpus: list[_Gpu] = []
        self._lost: list[LostGpu] = []
        self._events: deque[NvmlEvent] = deque(maxlen=64)
        self._lock = threading.Lock()
        self._xid_counts: _Counter[tuple[int | None, str, int]] = _Counter()
        self._xid_source: str | None = None
        self._watcher: _XidWatcher | None = None
        self._kmsg: KmsgReader | None = None

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
            self._fail_init(_error_name(exc))
        try:
            self._enumerate()
        except pynvml.NVMLError as exc:
            self._shutdown_quietly()
            self._fail_init(_error_name(exc))
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
        gpus: list[_Gpu] = []
        for index in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = nvml.nvmlDeviceGetUUID(handle)
                name = nvml.nvmlDeviceGetName(handle)
                pci = nvml.nvmlDeviceGetPciInfo(handle)
            except pynvml.NVMLError_GpuIsLost as exc:
                self._record_lost(index, "", "", f"at enumeration: {_error_name(exc)}")
                continue
            gpus.append(
                _Gpu(
                    index=index,
                    handle=handle,
                    address=_handle_address(handle),
                    uuid=str(uuid),
                    name=str(name),
                    pci_address=_pci_address_of(pci),
                    links=self._discover_links(handle),
                )
            )
        self._device_count = count
        self._gpus = gpus
        self._slow_left = 0
        self._health_left = 0
        self._gpm_left = 0
        self._health = ()

    def _discover_links(self, handle: Any) -> list[_Link]:
        """Links are probed once: NVML answers INVALID_ARGUMENT past the GPU's last link
        and NOT_SUPPORTED on a GPU without NVLink."""
        links: list[_Link] = []
        for link in range(int(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 36))):
            try:
                state = self.nvml.nvmlDeviceGetNvLinkState(handle, link)
            except (pynvml.NVMLError_InvalidArgument, *_NEVER):
                break
            except pynvml.NVMLError_GpuIsLost:
                raise
            except pynvml.NVMLError:
                state = None
            links.append(_Link(link, None if state is None else bool(state)))
        return links

    def _shutdown_quietly(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.debug("source=nvml shutdown_error=%r", _error_name(exc))

    def _teardown(self, reason: str) -> None:
        self._stop_watcher()
        if self._initialized:
            # NVML is gone: the frees fail, but a library that comes back mid-way still gets
            # them, and the buffers are dropped either way.
            self._free_all_gpm()
            self._shutdown_quietly()
        self._initialized = False
        self._gpus = []
        self._last_error = reason
        self._next_init = self.clock() + self.retry_seconds
        with self._lock:
            if self._xid_source == XID_SOURCE_EVENTS:
                self._xid_source = None

    def close(self) -> None:
        self._stop_watcher()
        if self._initialized:
            self._free_all_gpm()
            self._shutdown_quietly()
            self._initialized = False
        if self._kmsg is not None:
            self._kmsg.close()
            self._kmsg = None

    # ---- Xids ---------------------------------------------------------------------------

    def _start_watcher(self) -> None:
        if not self.watch_xids or self._watcher is not None:
            return
        targets = [(g.index, g.handle, g.address, g.pci_address) for g in self._gpus]
        self._watcher = _XidWatcher(self, targets)
        self._watcher.start()

    def _stop_watcher(self) -> None:
        watcher = self._watcher
        if watcher is None:
            return
        watcher.stop.set()
        watcher.join(timeout=self.event_wait_ms / 1000.0 + 0.5)
        if watcher.is_alive():
            log.warning("source=nvml xid_thread=still_running")
        self._watcher = None

    def count_xid(self, gpu: int | None, pci_address: str, xid: int) -> None:
        with self._lock:
            self._xid_counts[(gpu, pci_address, xid)] += 1

    def set_xid_source(self, source: str | None) -> None:
        with self._lock:
            self._xid_source = source

    def _read_kmsg(self, roots: Roots, tally: SkipTally) -> bool:
        """Count the Xids of the kernel-log records that arrived since the last call; an Xid
        line for an address that is no GPU NVML enumerated (or lost) is skipped and counted
        in ``tally``, never a count of its own, so no invented address makes a series."""
        if self._kmsg is None:
            self._kmsg = KmsgReader(roots.dev / "kmsg")
        try:
            text = self._kmsg.read_new()
        except OSError as exc:
            log.debug("source=nvml kmsg_error=%r", _error_name(exc))
            self._kmsg.close()
            self._kmsg = None
            return False
        if "NVRM: Xid" not in text:
            return True
        by_address = {g.pci_address: g.index for g in self._gpus}
        by_address.update({lost.pci_address: lost.gpu for lost in self._lost})
        for record in parse_kmsg_xid(text, tally):
            if record.pci_address not in by_address:
                tally.skip(SKIP_XID_UNKNOWN_GPU, record.pci_address)
                continue
            self.count_xid(by_address[record.pci_address], record.pci_address, record.xid)
        return True

    # ---- collection ---------------------------------------------------------------------

    def collect(self, roots: Roots) -> NvmlData:
        self._ensure_init()
        self._start_watcher()
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
                    gpu.health = self._read_health(gpu, gpm, tally)
                samples.append(sample)
            except _GpuLost as lost:
                gpu.lost = True
                self._free_gpm(gpu)
                self._record_lost(gpu.index, gpu.uuid, gpu.pci_address, lost.where)
                rebuild = True  # the lost GPU leaves the carried health
            except _LIBRARY_GONE as exc:
                self._teardown(_error_name(exc))
                raise NvmlUnavailable(f"NVML went away: {_error_name(exc)}") from exc
        if rebuild:
            self._health = tuple(
                g.health for g in self._gpus if g.health is not None and not g.lost
            )
        watcher = self._watcher
        if watcher is None or watcher.unsupported.is_set():
            # No NVML event set delivers Xids: the kernel log does, where it can be read.
            self.set_xid_source(XID_SOURCE_KMSG if self._read_kmsg(roots, tally) else None)
        with self._lock:
            xid_source = self._xid_source
            xids = tuple(
                XidCount(gpu, pci, xid, count)
                for (gpu, pci, xid), count in sorted(
                    self._xid_counts.items(), key=lambda kv: (kv[0][1], kv[0][2])
                )
            )
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

    def _call(self, gpu: _Gpu, key: str, fn: Callable[..., Any] | None, *args: Any) -> Any:
        """One NVML call for ``gpu``; ``None`` when it has no answer this time.

        NOT_SUPPORTED is remembered under ``key``; GPU_IS_LOST ends the GPU's read; errors
        that mean NVML is gone propagate; anything else costs this value, this cycle.
        """
        if key in gpu.unsupported_calls:
            return None
        if fn is None:
            gpu.unsupported_calls.add(key)
            gpu.missing_calls.add(key)
            return None
        try:
            return fn(*args)
        except _NEVER as exc:
            gpu.unsupported_calls.add(key)
            if isinstance(exc, pynvml.NVMLError_FunctionNotFound):
                gpu.missing_calls.add(key)
            return None
        except pynvml.NVMLError_GpuIsLost as exc:
            raise _GpuLost(f"{key}: {_error_name(exc)}") from exc
        except _LIBRARY_GONE:
            raise
        except pynvml.NVMLError as exc:
            log.debug("source=nvml gpu=%d call=%s error=%r", gpu.index, key, _error_name(exc))
            return None

    def _read_fields(self, gpu: _Gpu) -> tuple[_FieldPlan, _Fields]:
        """The counters of ``gpu``'s fields, in the order of the plan they were asked by."""
        plan = gpu.plan
        if plan is None:
            plan = gpu.plan = _FieldPlan.make(gpu.links, gpu.unsupported_fields)
        wanted = plan.wanted
        if not wanted:
            return plan, _Fields.none(0)
        values = self._call(
            gpu, "nvmlDeviceGetFieldValues", self.nvml.nvmlDeviceGetFieldValues, gpu.handle, wanted
        )
        if values is None:
            if "nvmlDeviceGetFieldValues" in gpu.unsupported_calls:
                gpu.unsupported_fields.update(wanted)
                gpu.plan = None
            return plan, _Fields.none(len(wanted))
        _fids, _scopes, stamps, _latency, vtypes, rets, unions = field_columns(values)
        success, ull, count = pynvml.NVML_SUCCESS, _VALUE_TYPE_ULL, len(wanted)
        if len(rets) == count and rets.count(success) == count and vtypes.count(ull) == count:
            # Every field an unsigned long long, as on current drivers: 74 per H100 a run.
            return plan, _Fields(
                [u << 10 if kib else u for kib, u in zip(plan.kib, unions, strict=True)],
                [t if t > 0 else None for t in stamps],
                list(plan.widths),
            )
        fields = _Fields([None] * count, [None] * count, [None] * count)
        for i, (kib, stamp, vtype, ret, union) in enumerate(
            zip(plan.kib, stamps, vtypes, rets, unions, strict=False)
        ):
            if ret == success and vtype == ull:
                counter: CounterValue | None = CounterValue(
                    union << 10 if kib else union, stamp if stamp > 0 else None, 74 if kib else 64
                )
            else:
                counter = self._odd_field(gpu, wanted[i], kib, stamp, vtype, ret, union)
            if counter is not None:
                fields.values[i] = counter.value
                fields.stamps[i] = counter.timestamp_us
                fields.bits[i] = counter.bits
        return plan, fields

    def _odd_field(
        self,
        gpu: _Gpu,
        key: tuple[int, int],
        kib: bool,
        stamp: int,
        vtype: int,
        ret: int,
        union: int,
    ) -> CounterValue | None:
        """A field that failed or is not an ``unsigned long long``."""
        if ret != pynvml.NVML_SUCCESS:
            if ret in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                gpu.unsupported_fields.add(key)
                gpu.plan = None
            elif ret == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise _GpuLost(f"nvmlDeviceGetFieldValues field {key[0]}: GPU is lost")
            return None
        try:
            number, width = row_value(vtype, union)
            count = int(number)  # a double has no width: width is None
        except (ValueError, OverflowError) as exc:  # an unknown type, NaN, infinity
            log.debug("source=nvml gpu=%d field=%s error=%r", gpu.index, key, str(exc))
            return None
        if count < 0:
            return None
        if kib:
            count *= 1024
            width = None if width is None else width + 10
        return CounterValue(count, stamp if stamp > 0 else None, width)

    def _read_slow(self, gpu: _Gpu) -> _SlowGpu:
        """The PCIe link and replay counter of ``gpu``, and the state, peer and error
        counters of each of its links (kept on the links)."""
        h, nvml = gpu.handle, self.nvml

        def simple(fn: Callable[[Any], int]) -> int | None:
            value = self._call(gpu, fn.__name__, fn, h)
            return None if value is None else int(value)

        slow = _SlowGpu(
            pcie_gen_current=simple(nvml.nvmlDeviceGetCurrPcieLinkGeneration),
            pcie_width_current=simple(nvml.nvmlDeviceGetCurrPcieLinkWidth),
            pcie_gen_max=simple(nvml.nvmlDeviceGetMaxPcieLinkGeneration),
            pcie_width_max=simple(nvml.nvmlDeviceGetMaxPcieLinkWidth),
            pcie_replays=simple(nvml.nvmlDeviceGetPcieReplayCounter),
        )
        links = gpu.links
        for link in links:
            self._read_link(gpu, link)
        slow.link = tuple([link.index for link in links])
        slow.active = tuple([link.active for link in links])
        slow.remote_type = tuple([link.remote_type for link in links])
        slow.remote_pci_address = tuple([link.remote_pci_address for link in links])
        slow.errors = tuple([link.errors for link in links])
        return slow

    def _read_gpu(self, gpu: _Gpu, slow: bool) -> GpuSample:
        h = gpu.handle
        plan, fields = self._read_fields(gpu)
        tx_at, rx_at = plan.pcie
        pcie_tx = fields.counter(tx_at)
        pcie_rx = fields.counter(rx_at)
        snapshot: PcieSnapshot | None = None
        pcie_source: str | None = "fields" if pcie_tx is not None and pcie_rx is not None else None
        if not _PCIE_FIELDS.isdisjoint(gpu.unsupported_fields):
            call, fn = "nvmlDeviceGetPcieThroughput", self.nvml.nvmlDeviceGetPcieThroughput
            tx = self._call(gpu, call, fn, h, pynvml.NVML_PCIE_UTIL_TX_BYTES)
            rx = self._call(gpu, call, fn, h, pynvml.NVML_PCIE_UTIL_RX_BYTES)
            if tx is not None or rx is not None:
                snapshot = PcieSnapshot(
                    None if tx is None else int(tx) * 1024,
                    None if rx is None else int(rx) * 1024,
                )
                pcie_source = "throughput-20ms"

        nvml = self.nvml
        util = self._call(
            gpu, "nvmlDeviceGetUtilizationRates", nvml.nvmlDeviceGetUtilizationRates, h
        )
        media: dict[str, int | None] = {}
        for engine, key in (
            ("decoder", "nvmlDeviceGetDecoderUtilization"),
            ("encoder", "nvmlDeviceGetEncoderUtilization"),
            ("jpeg", "nvmlDeviceGetJpgUtilization"),
        ):
            answer = self._call(gpu, key, getattr(nvml, key, None), h)
            media[engine] = None if answer is None else int(answer[0])
        procs = self._call(
            gpu,
            "nvmlDeviceGetComputeRunningProcesses",
            nvml.nvmlDeviceGetComputeRunningProcesses,
            h,
        )
        processes = tuple(
            sorted(
                (
                    GpuProcess(
                        int(p.pid),
                        None if p.usedGpuMemory is None else int(p.usedGpuMemory),
                    )
                    for p in (procs or ())
                ),
                key=lambda p: p.pid,
            )
        )
        carried = gpu.slow
        if slow or carried is None:
            carried = gpu.slow = self._read_slow(gpu)
        data_tx, data_rx, raw_tx, raw_rx = plan.link_columns
        nvlinks = NvLinks(
            link=carried.link,
            active=carried.active,
            remote_type=carried.remote_type,
            remote_pci_address=carried.remote_pci_address,
            data_tx=fields.column(data_tx),
            data_rx=fields.column(data_rx),
            raw_tx=fields.column(raw_tx),
            raw_rx=fields.column(raw_rx),
            errors=carried.errors,
        )
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
            gpu_util_percent=None if util is None else int(util.gpu),
            memory_util_percent=None if util is None else int(util.memory),
            decoder_util_percent=media["decoder"],
            encoder_util_percent=media["encoder"],
            jpeg_util_percent=media["jpeg"],
            processes=processes,
            nvlinks=nvlinks,
            unsupported=gpu.unsupported_names(),
        )

    def _read_link(self, gpu: _Gpu, link: _Link) -> None:
        """The state, peer (when the link came up) and error counters of one link."""
        h, n, nvml = gpu.handle, link.index, self.nvml
        state_key, type_key, remote_key = link.call_keys
        state = self._call(gpu, state_key, nvml.nvmlDeviceGetNvLinkState, h, n)
        active = None if state is None else bool(state)
        if active and (not link.active or link.remote_type is None):
            # The peer of a link changes only when the link retrains: read it when the link
            # comes up, not every cycle.
            kind = self._call(gpu, type_key, nvml.nvmlDeviceGetNvLinkRemoteDeviceType, h, n)
            remote = self._call(gpu, remote_key, nvml.nvmlDeviceGetNvLinkRemotePciInfo, h, n)
            link.remote_type = None if kind is None else REMOTE_TYPES.get(int(kind), "unknown")
            link.remote_pci_address = None if remote is None else _pci_address_of(remote)
        link.active = active
        errors: list[tuple[str, int]] = []
        read_counter = nvml.nvmlDeviceGetNvLinkErrorCounter
        for name, counter, key in _ERROR_COUNTER_KEYS:
            # NOT_SUPPORTED for one counter is a property of the GPU, not of one link.
            value = self._call(gpu, key, read_counter, h, n, counter)
            if value is not None:
                errors.append((name, int(value)))
        link.errors = tuple(errors)

    # ---- health (docs/datasources.md §1.8) ------------------------------------------------

    def _checked(
        self, gpu: _Gpu, tally: SkipTally, key: str, value: Any, bounds: tuple[int, int]
    ) -> int | None:
        """``value`` when a GPU can answer it; otherwise it is dropped and counted."""
        if value is None:
            return None
        number = plausible(value, bounds)
        if number is None:
            tally.skip(SKIP_HEALTH_VALUE_IMPOSSIBLE, f"gpu={gpu.index} {key}={value!r}")
        return number

    def _read_value(
        self,
        gpu: _Gpu,
        tally: SkipTally,
        key: str,
        fn: Callable[..., Any] | None,
        *args: Any,
        bounds: tuple[int, int],
    ) -> int | None:
        return self._checked(gpu, tally, key, self._call(gpu, key, fn, *args), bounds)

    def _read_health(self, gpu: _Gpu, gpm: bool, tally: SkipTally) -> GpuHealth:
        """Every health value of ``gpu``; ``gpm``: take a GPM sample too."""
        h, nvml = gpu.handle, self.nvml
        read_at = self.wall_clock()
        read = functools.partial(self._read_value, gpu, tally)

        ecc_fn = nvml.nvmlDeviceGetTotalEccErrors
        ecc_counts = [
            read(key, ecc_fn, h, error_type, counter_type, bounds=COUNT_RANGE)
            for key, (_name, error_type, counter_type) in zip(_ECC_KEYS, ECC_READS, strict=True)
        ]
        ecc = None if ecc_counts.count(None) == 4 else EccErrors(*ecc_counts)

        pages: list[int | None] = []
        for key, (_name, cause) in zip(_RETIRED_KEYS, RETIRED_PAGE_READS, strict=True):
            # The binding returns the retired pages' addresses: their number is the count.
            answer = self._call(gpu, key, nvml.nvmlDeviceGetRetiredPages, h, cause)
            if answer is not None and not isinstance(answer, list | tuple):
                tally.skip(SKIP_HEALTH_VALUE_IMPOSSIBLE, f"gpu={gpu.index} {key}={answer!r}")
                answer = None
            pages.append(None if answer is None else len(answer))
        pending = read(
            _K_PENDING, nvml.nvmlDeviceGetRetiredPagesPendingStatus, h, bounds=FLAG_RANGE
        )
        retired = (
            None
            if pages == [None, None] and pending is None
            else RetiredPages(pages[0], pages[1], None if pending is None else bool(pending))
        )

        remap = self._read_row_remap(gpu, tally)

        gpu_temp = read(
            _K_TEMP,
            nvml.nvmlDeviceGetTemperature,
            h,
            pynvml.NVML_TEMPERATURE_GPU,
            bounds=CELSIUS_RANGE,
        )
        memory_temp = self._read_memory_temperature(gpu, tally)
        for key, (name, threshold) in zip(_THRESHOLD_KEYS, THRESHOLD_READS, strict=True):
            # Thresholds are the board's constants: asked until answered, then carried.
            if name not in gpu.thresholds:
                value = read(
                    key,
                    nvml.nvmlDeviceGetTemperatureThreshold,
                    h,
                    threshold,
                    bounds=CELSIUS_RANGE,
                )
                if value is not None:
                    gpu.thresholds[name] = value
        limits = gpu.thresholds
        temperatures_read = (
            gpu_temp,
            memory_temp,
            limits.get("slowdown"),
            limits.get("shutdown"),
            limits.get("gpu_max"),
            limits.get("memory_max"),
        )
        temperatures = (
            None if temperatures_read.count(None) == 6 else Temperatures(*temperatures_read)
        )

        milliwatts = (
            read(_K_POWER, nvml.nvmlDeviceGetPowerUsage, h, bounds=MILLIWATTS_RANGE),
            read(_K_LIMIT, nvml.nvmlDeviceGetPowerManagementLimit, h, bounds=MILLIWATTS_RANGE),
            read(_K_ENFORCED, nvml.nvmlDeviceGetEnforcedPowerLimit, h, bounds=MILLIWATTS_RANGE),
            self._default_limit(gpu, tally),
        )
        power = (
            None
            if milliwatts.count(None) == 4
            else Power(*(None if mw is None else mw / 1000.0 for mw in milliwatts))
        )

        clock_fn = nvml.nvmlDeviceGetClockInfo
        sm_mhz = read(_K_SM_CLOCK, clock_fn, h, pynvml.NVML_CLOCK_SM, bounds=MHZ_RANGE)
        mem_mhz = read(_K_MEM_CLOCK, clock_fn, h, pynvml.NVML_CLOCK_MEM, bounds=MHZ_RANGE)
        reasons = None
        if _K_EVENTS not in gpu.missing_calls:
            events_fn = getattr(nvml, _K_EVENTS, None)
            reasons = read(_K_EVENTS, events_fn, h, bounds=COUNT_RANGE)
        if _K_EVENTS in gpu.missing_calls:
            # Drivers before the rename (and older bindings) have only the old name.
            throttle_fn = getattr(nvml, _K_THROTTLE, None)
            reasons = read(_K_THROTTLE, throttle_fn, h, bounds=COUNT_RANGE)
        # The applications clock is what the load is meant to run at: the measure of how far
        # a power cap pulls the SM clock down. Looked up by name, as newer bindings may drop
        # it (its NVML call is deprecated in favour of locked clocks).
        app_fn = getattr(nvml, "nvmlDeviceGetApplicationsClock", None)
        app_mhz = read(_K_APP_CLOCK, app_fn, h, pynvml.NVML_CLOCK_SM, bounds=MHZ_RANGE)
        clocks = (
            None
            if sm_mhz is None and mem_mhz is None and reasons is None and app_mhz is None
            else Clocks(sm_mhz, mem_mhz, reasons, app_mhz)
        )

        return GpuHealth(
            index=gpu.index,
            uuid=gpu.uuid,
            pci_address=gpu.pci_address,
            read_at=read_at,
            ecc=ecc,
            retired_pages=retired,
            row_remap=remap,
            temperatures=temperatures,
            power=power,
            clocks=clocks,
            framebuffer=self._read_framebuffer(gpu, tally),
            fabric=self._read_fabric(gpu, tally),
            gpm=self._read_gpm(gpu, tally) if gpm else gpu.gpm,
            unsupported=tuple(sorted(gpu.unsupported_calls & _HEALTH_KEYS)),
        )

    def _default_limit(self, gpu: _Gpu, tally: SkipTally) -> int | None:
        """``nvmlDeviceGetPowerManagementDefaultLimit`` in mW: the board's constant, asked
        until answered, then kept (in ``thresholds``, with the temperature limits)."""
        kept = gpu.thresholds.get(_K_DEFAULT_LIMIT)
        if kept is not None:
            return kept
        fn = getattr(self.nvml, _K_DEFAULT_LIMIT, None)
        value = self._read_value(
            gpu, tally, _K_DEFAULT_LIMIT, fn, gpu.handle, bounds=MILLIWATTS_RANGE
        )
        if value is not None:
            gpu.thresholds[_K_DEFAULT_LIMIT] = value
        return value

    def _read_row_remap(self, gpu: _Gpu, tally: SkipTally) -> RowRemap | None:
        """``nvmlDeviceGetRemappedRows``: (correctable, uncorrectable, pending, failure)."""
        rows = self._call(gpu, _K_REMAP, self.nvml.nvmlDeviceGetRemappedRows, gpu.handle)
        if rows is None:
            return None
        if not isinstance(rows, list | tuple) or len(rows) != 4:
            tally.skip(SKIP_HEALTH_VALUE_IMPOSSIBLE, f"gpu={gpu.index} {_K_REMAP}={rows!r}")
            return None
        correctable, uncorrectable, pending, failed = (
            self._checked(gpu, tally, f"{_K_REMAP}[{i}]", value, bounds)
            for i, (value, bounds) in enumerate(
                zip(rows, (COUNT_RANGE, COUNT_RANGE, FLAG_RANGE, FLAG_RANGE), strict=True)
            )
        )
        return RowRemap(
            correctable,
            uncorrectable,
            None if pending is None else bool(pending),
            None if failed is None else bool(failed),
        )

    def _read_memory_temperature(self, gpu: _Gpu, tally: SkipTally) -> int | None:
        """The HBM temperature: one field, asked in a call of its own on health runs."""
        values = self._call(
            gpu,
            _K_MEMORY_TEMP,
            self.nvml.nvmlDeviceGetFieldValues,
            gpu.handle,
            [(FI_MEMORY_TEMP, 0)],
        )
        if values is None:
            return None
        _fids, _scopes, _stamps, _latency, vtypes, rets, unions = field_columns(values)
        if len(rets) != 1:
            return None
        ret = rets[0]
        if ret in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
            gpu.unsupported_calls.add(_K_MEMORY_TEMP)
            return None
        if ret == pynvml.NVML_ERROR_GPU_IS_LOST:
            raise _GpuLost(f"{_K_MEMORY_TEMP}: GPU is lost")
        if ret != pynvml.NVML_SUCCESS:
            return None
        try:
            number, _bits = row_value(vtypes[0], unions[0])
        except ValueError:
            number = None  # an unknown value type
        celsius = plausible_float(number, (float(CELSIUS_RANGE[0]), float(CELSIUS_RANGE[1])))
        if celsius is None:
            tally.skip(SKIP_HEALTH_VALUE_IMPOSSIBLE, f"gpu={gpu.index} {_K_MEMORY_TEMP}={number!r}")
            return None
        return round(celsius)

    def _read_framebuffer(self, gpu: _Gpu, tally: SkipTally) -> FrameBuffer | None:
        info = self._call(gpu, _K_MEMORY, self.nvml.nvmlDeviceGetMemoryInfo, gpu.handle)
        if info is None:
            return None
        used = plausible(getattr(info, "used", None), COUNT_RANGE)
        total = plausible(getattr(info, "total", None), COUNT_RANGE)
        if used is None or total is None or used > total:
            example = f"gpu={gpu.index} {_K_MEMORY}=used {getattr(info, 'used', None)!r}"
            tally.skip(
                SKIP_HEALTH_VALUE_IMPOSSIBLE, f"{example} of {getattr(info, 'total', None)!r}"
            )
            return None
        return FrameBuffer(used, total)

    def _read_fabric(self, gpu: _Gpu, tally: SkipTally) -> Fabric | None:
        """The NVSwitch fabric registration: ``nvmlDeviceGetGpuFabricInfoV`` with pynvml's
        versioned structure (it has the health mask), else the first call and its plain
        structure, where the binding or the driver lacks the versioned one."""
        nvml, h = self.nvml, gpu.handle
        info: Any = None
        has_mask = False
        v_struct = getattr(pynvml, "c_nvmlGpuFabricInfoV_t", None)
        if v_struct is None:
            gpu.missing_calls.add(_K_FABRIC_V)
            gpu.unsupported_calls.add(_K_FABRIC_V)
        if v_struct is not None and _K_FABRIC_V not in gpu.missing_calls:
            candidate = v_struct()  # its constructor sets the version
            answer = self._call(
                gpu, _K_FABRIC_V, getattr(nvml, _K_FABRIC_V, None), h, ctypes.byref(candidate)
            )
            if answer is not None:
                info, has_mask = candidate, True
        if _K_FABRIC_V in gpu.missing_calls:
            candidate = pynvml.c_nvmlGpuFabricInfo_t()
            answer = self._call(
                gpu, _K_FABRIC, getattr(nvml, _K_FABRIC, None), h, ctypes.byref(candidate)
            )
            if answer is not None:
                info = candidate
        if info is None:
            return None
        state = plausible(int(info.state), FABRIC_STATE_RANGE)
        if state is None:
            tally.skip(SKIP_HEALTH_VALUE_IMPOSSIBLE, f"gpu={gpu.index} fabric state={info.state!r}")
            return None
        if state == pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED:
            # Not a fabric GPU (or no fabric manager role for it): the rest means nothing.
            return Fabric(state, None, None, None, None)
        return Fabric(
            state=state,
            status=int(info.status),
            clique_id=int(info.cliqueId),
            cluster_uuid=fabric_uuid(bytes(info.clusterUuid)),
            bandwidth_degraded=fabric_bandwidth_degraded(int(info.healthMask))
            if has_mask
            else None,
        )

    def _read_gpm(self, gpu: _Gpu, tally: SkipTally) -> Gpm | None:
        """Take a GPM sample of ``gpu``; the figures between it and the one before, once
        there is one before (the first read gives none)."""
        nvml, h = self.nvml, gpu.handle
        if gpu.gpm_supported is None:
            support = self._call(gpu, _K_GPM_SUPPORT, getattr(nvml, _K_GPM_SUPPORT, None), h)
            if support is None and _K_GPM_SUPPORT not in gpu.unsupported_calls:
                return None  # no answer this time: asked again on the next GPM read
            gpu.gpm_supported = support is not None and bool(int(support.isSupportedDevice))
            if not gpu.gpm_supported:
                # A GPU before Hopper answers "no" rather than NOT_SUPPORTED: listed alike.
                gpu.unsupported_calls.add(_K_GPM_SUPPORT)
        if not gpu.gpm_supported:
            return None
        if gpu.gpm_samples is None:
            alloc = getattr(nvml, _K_GPM_ALLOC, None)
            first = self._call(gpu, _K_GPM_ALLOC, alloc)
            second = None if first is None else self._call(gpu, _K_GPM_ALLOC, alloc)
            if second is None:
                self._free_samples([first] if first is not None else [])
                return None
            gpu.gpm_samples = [second, first]
        latest, spare = gpu.gpm_samples
        taken = self._call(gpu, _K_GPM_GET, nvml.nvmlGpmSampleGet, h, spare)
        if taken is None:
            # The older sample is untouched: the next window starts from it.
            return gpu.gpm
        now = self.wall_clock()
        before, gpu.gpm_sampled_at = gpu.gpm_sampled_at, now
        gpu.gpm_samples = [spare, latest]
        if before is None:
            return None
        gpu.gpm = self._gpm_metrics(gpu, tally, latest, spare, max(now - before, 0.0))
        return gpu.gpm

    def _gpm_metrics(
        self, gpu: _Gpu, tally: SkipTally, older: Any, newer: Any, seconds: float
    ) -> Gpm | None:
        """``nvmlGpmMetricsGet`` between two samples, the metrics this GPU has only."""
        wanted = [
            (key, name, metric, mib)
            for key, (name, metric, mib) in zip(_GPM_METRIC_KEYS, GPM_METRICS, strict=True)
            if key not in gpu.unsupported_calls
        ]
        if not wanted:
            return None
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(wanted)
        request.sample1 = older
        request.sample2 = newer
        for i, (_key, _name, metric, _mib) in enumerate(wanted):
            request.metrics[i].metricId = metric
        answer = self._call(gpu, _K_GPM_METRICS, self.nvml.nvmlGpmMetricsGet, request)
        if answer is None:
            return None
        figures: dict[str, float | None] = {name: None for name, _m, _b in GPM_METRICS}
        for i, (key, name, _metric, mib) in enumerate(wanted):
            result = request.metrics[i]
            ret = int(result.nvmlReturn)
            if ret in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                # A GPU without NVLink has no NVLink metrics: not asked again.
                gpu.unsupported_calls.add(key)
                continue
            if ret != pynvml.NVML_SUCCESS:
                continue
            value = plausible_float(
                float(result.value), MIB_PER_SECOND_RANGE if mib else PERCENT_RANGE
            )
            if value is None:
                tally.skip(SKIP_HEALTH_VALUE_IMPOSSIBLE, f"gpu={gpu.index} {key}={result.value!r}")
                continue
            figures[name] = value * _MIB if mib else value
        return Gpm(window_seconds=seconds, **figures)

    def _free_samples(self, samples: Iterable[Any]) -> None:
        free = getattr(self.nvml, "nvmlGpmSampleFree", None)
        for sample in samples:
            if free is None:
                return
            try:
                free(sample)
            except pynvml.NVMLError as exc:
                log.debug("source=nvml gpm_sample_free_error=%r", _error_name(exc))

    def _free_gpm(self, gpu: _Gpu) -> None:
        """Give ``gpu``'s GPM buffers back (a lost GPU, a close, a teardown)."""
        samples, gpu.gpm_samples = gpu.gpm_samples, None
        gpu.gpm_sampled_at = None
        self._free_samples(samples or ())

    def _free_all_gpm(self) -> None:
        for gpu in self._gpus:
            self._free_gpm(gpu)


def _pci_address_of(info: Any) -> str:
    """The sysfs address of an ``nvmlPciInfo_t``: from ``busId``, else its integer fields."""
    bus_id = info.busId
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode("ascii", errors="replace")
    try:
        return parse_bus_id(str(bus_id))
    except ParseError:
        return sysfs_pci_address(int(info.domain), int(info.bus), int(info.device), 0)


class _XidWatcher(threading.Thread):
    """Waits on an NVML event set and counts Xid critical errors into the source.

    ``unsupported`` is set when no GPU can deliver Xid events (the source then reads the
    kernel log). The set is created, used and freed in this thread.
    """

    def __init__(
        self, source: NvmlSource, targets: Iterable[tuple[int, Any, int | None, str]]
    ) -> None:
        super().__init__(name="nodescope-nvml-xid", daemon=True)
        self.source = source
        self.targets = list(targets)
        self.stop = threading.Event()
        self.unsupported = threading.Event()

    def run(self) -> None:
        nvml = self.source.nvml
        xid_bit = int(pynvml.nvmlEventTypeXidCriticalError)
        try:
            event_set = nvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            log.info("source=nvml xid_events=unavailable error=%r", _error_name(exc))
            self.unsupported.set()
            return
        try:
            by_address: dict[int, tuple[int, str]] = {}
            for index, handle, address, pci in self.targets:
                try:
                    if not int(nvml.nvmlDeviceGetSupportedEventTypes(handle)) & xid_bit:
                        continue
                    nvml.nvmlDeviceRegisterEvents(handle, xid_bit, event_set)
                except pynvml.NVMLError as exc:
                    log.info("source=nvml gpu=%d xid_events=unavailable error=%r", index, exc)
                    continue
                if address is not None:
                    by_address[address] = (index, pci)
            if not by_address:
                self.unsupported.set()
                return
            self.source.set_xid_source(XID_SOURCE_EVENTS)
            while not self.stop.is_set():
                try:
                    data = nvml.nvmlEventSetWait(event_set, self.source.event_wait_ms)
                except pynvml.NVMLError_Timeout:
                    continue
                except pynvml.NVMLError as exc:
                    # Wait can fail transiently (a GPU lost, an interrupted wait): pause
                    # rather than spin, and stop promptly on close.
                    log.debug("source=nvml xid_wait_error=%r", _error_name(exc))
                    self.stop.wait(0.5)
                    continue
                if not int(data.eventType) & xid_bit:
                    continue
                target = by_address.get(_handle_address(data.device) or -1)
                if target is None:
                    continue
                self.source.count_xid(target[0], target[1], int(data.eventData))
        finally:
            try:
                nvml.nvmlEventSetFree(event_set)
            except pynvml.NVMLError as exc:
                log.debug("source=nvml event_set_free_error=%r", _error_name(exc))


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
    "EVENT_WAIT_MS",
    "FIELD_COLUMNS",
    "FI_NVLINK_DATA_RX",
    "FI_NVLINK_DATA_TX",
    "FI_NVLINK_RAW_RX",
    "FI_NVLINK_RAW_TX",
    "FI_PCIE_RX_BYTES",
    "FI_PCIE_TX_BYTES",
    "GPM_EVERY",
    "HEALTH_EVERY",
    "NAME",
    "NVLINK_ERROR_COUNTERS",
    "NVLINK_FIELDS",
    "PCIE_THROUGHPUT_WINDOW_SECONDS",
    "REMOTE_TYPES",
    "SKIP_HEALTH_VALUE_IMPOSSIBLE",
    "SKIP_XID_LEVEL",
    "SKIP_XID_NOT_KERNEL",
    "SKIP_XID_TOO_LONG",
    "SKIP_XID_UNKNOWN_GPU",
    "SKIP_XID_UNPARSABLE",
    "SLOW_EVERY",
    "XID_MEANINGS",
    "XID_SOURCE_EVENTS",
    "XID_SOURCE_KMSG",
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
    "field_columns",
    "field_value",
    "gpu_rates",
    "make_source",
    "nvlink_pairs",
    "parse_bus_id",
    "parse_kmsg_xid",
    "plausible",
    "plausible_float",
    "row_value",
    "slow_pair",
    "sysfs_pci_address",
]
