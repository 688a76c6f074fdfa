"""What every NVML reader of the ``nvml`` source shares: the adapter with pynvml's call
surface, the errors that end a read, one GPU as NVML enumerated it (with what each reader
remembers of it between runs), one guarded call, the field-value decoding and PCI addresses.

The source (:mod:`nodescope.sources.nvml`) composes the readers that use it: links
(:mod:`~nodescope.sources.nvml_links`), health (:mod:`~nodescope.sources.nvml_health`), Xids
(:mod:`~nodescope.sources.nvml_xids`) and processes (:mod:`~nodescope.sources.nvml_processes`).
The module docstring of :mod:`nodescope.sources.nvml` says what the calls return and why
they are read as they are.
"""

from __future__ import annotations

import ctypes
import logging
import re
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import pynvml

from nodescope.errors import ParseError
from nodescope.model.gpu_health import Gpm, GpuHealth

# The readers log as the source they belong to.
log = logging.getLogger("nodescope.sources.nvml")


FI_NVLINK_DATA_TX = 138  # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, KiB, payload
FI_NVLINK_DATA_RX = 139
FI_NVLINK_RAW_TX = 140  # _RAW_: payload plus protocol overhead, KiB
FI_NVLINK_RAW_RX = 141
FI_PCIE_TX_BYTES = 197  # NVML_FI_DEV_PCIE_COUNT_TX_BYTES, bytes, "can be wrapped"
FI_PCIE_RX_BYTES = 198
NVLINK_FIELDS = (FI_NVLINK_DATA_TX, FI_NVLINK_DATA_RX, FI_NVLINK_RAW_TX, FI_NVLINK_RAW_RX)

# Errors after which NVML as a whole is unusable until it is initialised again.
LIBRARY_GONE: tuple[type[BaseException], ...] = (
    pynvml.NVMLError_Uninitialized,
    pynvml.NVMLError_DriverNotLoaded,
    pynvml.NVMLError_LibraryNotFound,
    pynvml.NVMLError_LibRmVersionMismatch,
)
# Errors that say a call or field will never answer on this GPU and driver.
NEVER: tuple[type[BaseException], ...] = (
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
VALUE_TYPE_ULL = 3
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


_NVML_BUS_ID_RE = re.compile(
    r"([0-9a-fA-F]{1,8}):([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})(?:\.([0-7]))?"
)


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


def pci_address_of(info: Any) -> str:
    """The sysfs address of an ``nvmlPciInfo_t``: from ``busId``, else its integer fields."""
    bus_id = info.busId
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode("ascii", errors="replace")
    try:
        return parse_bus_id(str(bus_id))
    except ParseError:
        return sysfs_pci_address(int(info.domain), int(info.bus), int(info.device), 0)


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
# One GPU and what the readers remember of it


@dataclass
class Link:
    """One NVLink of a GPU: its state, peer and error counters as of the last slow read."""

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


@dataclass(frozen=True)
class FieldPlan:
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
    def make(cls, links: Sequence[Link], unsupported: set[tuple[int, int]]) -> FieldPlan:
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
class SlowGpu:
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
class Gpu:
    """One GPU as NVML enumerated it, and what the readers remember of it between runs: the
    calls and fields that never answer, the carried slow and health reads, the field plan,
    the board's constants and the GPM buffers."""

    index: int
    handle: Any
    address: int | None
    uuid: str
    name: str
    pci_address: str
    links: list[Link]
    unsupported_calls: set[str] = field(default_factory=set)
    unsupported_fields: set[tuple[int, int]] = field(default_factory=set)
    lost: bool = False
    #: the last slow read; None until the first
    slow: SlowGpu | None = None
    #: the fields asked every run; rebuilt when one turns out unsupported
    plan: FieldPlan | None = None
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


class GpuLost(Exception):
    """NVML answered GPU_IS_LOST: the read of this GPU ends, and the GPU leaves the records."""

    def __init__(self, where: str) -> None:
        super().__init__(where)
        self.where = where


def handle_address(handle: Any) -> int | None:
    """The address behind an NVML handle: the driver hands out the same pointer for the same
    device, so it identifies the device of an event."""
    try:
        value = ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None
    return None if value is None else int(value)


def error_name(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def call(gpu: Gpu, key: str, fn: Callable[..., Any] | None, *args: Any) -> Any:
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
    except NEVER as exc:
        gpu.unsupported_calls.add(key)
        if isinstance(exc, pynvml.NVMLError_FunctionNotFound):
            gpu.missing_calls.add(key)
        return None
    except pynvml.NVMLError_GpuIsLost as exc:
        raise GpuLost(f"{key}: {error_name(exc)}") from exc
    except LIBRARY_GONE:
        raise
    except pynvml.NVMLError as exc:
        log.debug("source=nvml gpu=%d call=%s error=%r", gpu.index, key, error_name(exc))
        return None
