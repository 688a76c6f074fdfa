"""The ``nvml`` source's health reader: each GPU's ECC counts, retired pages, row remapping,
temperatures and their thresholds, power and its limits, clocks and clock-event reasons,
framebuffer, fabric registration and GPM figures (docs/datasources.md §1.8), read on health
runs and carried in the records between them (:mod:`nodescope.sources.nvml` says why).
"""

from __future__ import annotations

import ctypes
import functools
import uuid as _uuid
from collections.abc import Callable, Iterable
from typing import Any

import pynvml

from nodescope.model.gpu_health import (
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
from nodescope.model.skips import SkipTally
from nodescope.sources.nvml_device import (
    Gpu,
    GpuLost,
    NvmlAdapter,
    call,
    error_name,
    field_columns,
    log,
    row_value,
)

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


class HealthReader:
    """Reads every health value of a GPU, and holds its GPM sample buffers until they are
    given back. ``wall_clock`` dates each read and GPM sample."""

    def __init__(self, nvml: NvmlAdapter, wall_clock: Callable[[], float]) -> None:
        self.nvml = nvml
        self.wall_clock = wall_clock

    def read(self, gpu: Gpu, gpm: bool, tally: SkipTally) -> GpuHealth:
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
            answer = call(gpu, key, nvml.nvmlDeviceGetRetiredPages, h, cause)
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

    def _checked(
        self, gpu: Gpu, tally: SkipTally, key: str, value: Any, bounds: tuple[int, int]
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
        gpu: Gpu,
        tally: SkipTally,
        key: str,
        fn: Callable[..., Any] | None,
        *args: Any,
        bounds: tuple[int, int],
    ) -> int | None:
        return self._checked(gpu, tally, key, call(gpu, key, fn, *args), bounds)

    def _default_limit(self, gpu: Gpu, tally: SkipTally) -> int | None:
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

    def _read_row_remap(self, gpu: Gpu, tally: SkipTally) -> RowRemap | None:
        """``nvmlDeviceGetRemappedRows``: (correctable, uncorrectable, pending, failure)."""
        rows = call(gpu, _K_REMAP, self.nvml.nvmlDeviceGetRemappedRows, gpu.handle)
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

    def _read_memory_temperature(self, gpu: Gpu, tally: SkipTally) -> int | None:
        """The HBM temperature: one field, asked in a call of its own on health runs."""
        values = call(
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
            raise GpuLost(f"{_K_MEMORY_TEMP}: GPU is lost")
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

    def _read_framebuffer(self, gpu: Gpu, tally: SkipTally) -> FrameBuffer | None:
        info = call(gpu, _K_MEMORY, self.nvml.nvmlDeviceGetMemoryInfo, gpu.handle)
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

    def _read_fabric(self, gpu: Gpu, tally: SkipTally) -> Fabric | None:
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
            answer = call(
                gpu, _K_FABRIC_V, getattr(nvml, _K_FABRIC_V, None), h, ctypes.byref(candidate)
            )
            if answer is not None:
                info, has_mask = candidate, True
        if _K_FABRIC_V in gpu.missing_calls:
            candidate = pynvml.c_nvmlGpuFabricInfo_t()
            answer = call(
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

    def _read_gpm(self, gpu: Gpu, tally: SkipTally) -> Gpm | None:
        """Take a GPM sample of ``gpu``; the figures between it and the one before, once
        there is one before (the first read gives none)."""
        nvml, h = self.nvml, gpu.handle
        if gpu.gpm_supported is None:
            support = call(gpu, _K_GPM_SUPPORT, getattr(nvml, _K_GPM_SUPPORT, None), h)
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
            first = call(gpu, _K_GPM_ALLOC, alloc)
            second = None if first is None else call(gpu, _K_GPM_ALLOC, alloc)
            if second is None:
                self._free_samples([first] if first is not None else [])
                return None
            gpu.gpm_samples = [second, first]
        latest, spare = gpu.gpm_samples
        taken = call(gpu, _K_GPM_GET, nvml.nvmlGpmSampleGet, h, spare)
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
        self, gpu: Gpu, tally: SkipTally, older: Any, newer: Any, seconds: float
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
        answer = call(gpu, _K_GPM_METRICS, self.nvml.nvmlGpmMetricsGet, request)
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
                log.debug("source=nvml gpm_sample_free_error=%r", error_name(exc))

    def free_gpm(self, gpu: Gpu) -> None:
        """Give ``gpu``'s GPM buffers back (a lost GPU, a close, a teardown)."""
        samples, gpu.gpm_samples = gpu.gpm_samples, None
        gpu.gpm_sampled_at = None
        self._free_samples(samples or ())

    def free_all_gpm(self, gpus: Iterable[Gpu]) -> None:
        for gpu in gpus:
            self.free_gpm(gpu)
