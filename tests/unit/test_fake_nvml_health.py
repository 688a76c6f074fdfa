"""The fake NVML's health and GPM calls keep pynvml's signatures, return what pynvml returns
(its structures, tuples and lists), raise pynvml's errors, and are driven by the fake GPU's
health fields."""

from __future__ import annotations

import ctypes
import inspect
import uuid
from pathlib import Path

import pynvml
import pytest

from nodescope.roots import Roots
from nodescope.sim.fake_nvml import (
    HGX_H100_FABRIC_CLIQUE_ID,
    HGX_H100_FABRIC_CLUSTER_UUID,
    FakeGpu,
    FakeNvml,
    hgx_h100,
)
from nodescope.sim.nvml_mirror import MirroredNvml, state_document, write_state
from nodescope.sources.nvml import NvmlSource
from tests.unit.gpu_helpers import HEALTH_CALLS

#: Every health call the nvml source makes, the fallbacks it may make and the GPM sample's
#: release.
HEALTH_FUNCTIONS = (
    *HEALTH_CALLS,
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetGpuFabricInfo",
    "nvmlGpmSampleFree",
)

#: The ones that take a device handle and nothing else.
HANDLE_ONLY = (
    "nvmlDeviceGetRetiredPagesPendingStatus",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetPowerManagementLimit",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetMemoryInfo",
    "nvmlGpmQueryDeviceSupport",
)


@pytest.fixture
def fake() -> FakeNvml:
    nvml = FakeNvml(hgx_h100(gpus=2, links=2))
    nvml.nvmlInit()
    return nvml


def raised(fn: object, *args: object) -> type[BaseException]:
    assert callable(fn)
    with pytest.raises(pynvml.NVMLError) as info:
        fn(*args)
    return info.type


def test_the_fake_keeps_pynvmls_signatures_for_every_health_call() -> None:
    for name in HEALTH_FUNCTIONS:
        real = inspect.signature(getattr(pynvml, name))
        ours = inspect.signature(getattr(FakeNvml, name))
        ours_params = list(ours.parameters.values())[1:]  # without self
        assert [p.name for p in ours_params] == list(real.parameters), name
        assert [p.default for p in ours_params] == [p.default for p in real.parameters.values()], (
            name
        )


def test_counts_and_flags_have_pynvmls_return_types(fake: FakeNvml) -> None:
    gpu = fake.gpus[0]
    gpu.ecc_volatile_corrected, gpu.ecc_volatile_uncorrected = 5, 1
    gpu.ecc_aggregate_corrected, gpu.ecc_aggregate_uncorrected = 50, 2
    gpu.retired_pages_single_bit, gpu.retired_pages_double_bit = 3, 2
    gpu.retired_pages_pending = True
    gpu.remapped_rows_correctable, gpu.remapped_rows_uncorrectable = 6, 1
    gpu.remap_failed = True
    h = fake.handle(0)
    ecc = fake.nvmlDeviceGetTotalEccErrors
    assert ecc(h, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC) == 5
    assert ecc(h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC) == 1
    assert ecc(h, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_AGGREGATE_ECC) == 50
    assert ecc(h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_AGGREGATE_ECC) == 2
    single = fake.nvmlDeviceGetRetiredPages(
        h, pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
    )
    double = fake.nvmlDeviceGetRetiredPages(
        h, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
    )
    # pynvml returns the pages' addresses as a list of ints.
    assert isinstance(single, list) and len(single) == 3 and len(set(single)) == 3
    assert len(double) == 2 and not set(single) & set(double)
    assert fake.nvmlDeviceGetRetiredPagesPendingStatus(h) == pynvml.NVML_FEATURE_ENABLED
    rows = fake.nvmlDeviceGetRemappedRows(h)
    assert isinstance(rows, tuple) and rows == (6, 1, 0, 1)
    other = fake.handle(1)
    assert fake.nvmlDeviceGetRetiredPagesPendingStatus(other) == 0
    assert fake.nvmlDeviceGetRemappedRows(other) == (0, 0, 0, 0)


def test_temperatures_power_and_clocks_answer_the_fields(fake: FakeNvml) -> None:
    gpu = fake.gpus[1]
    gpu.temperature_gpu, gpu.temperature_memory = 70, 66
    gpu.power_draw_mw, gpu.power_limit_mw, gpu.power_enforced_limit_mw = 500_500, 650_000, 600_000
    gpu.sm_clock_mhz, gpu.memory_clock_mhz = 1755, 2619
    gpu.clock_event_reasons = pynvml.nvmlClocksEventReasonSwPowerCap
    h = fake.handle(1)
    assert fake.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU) == 70
    threshold = fake.nvmlDeviceGetTemperatureThreshold
    assert threshold(h, pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN) == gpu.temperature_slowdown
    assert threshold(h, pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN) == gpu.temperature_shutdown
    assert threshold(h, pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX) == gpu.temperature_gpu_max
    assert threshold(h, pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX) == gpu.temperature_memory_max
    assert fake.nvmlDeviceGetPowerUsage(h) == 500_500
    assert fake.nvmlDeviceGetPowerManagementLimit(h) == 650_000
    assert fake.nvmlDeviceGetEnforcedPowerLimit(h) == 600_000
    assert fake.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) == 1755
    assert fake.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM) == 2619
    assert fake.nvmlDeviceGetCurrentClocksEventReasons(h) == pynvml.nvmlClocksEventReasonSwPowerCap
    assert fake.nvmlDeviceGetCurrentClocksThrottleReasons(h) == (
        pynvml.nvmlClocksThrottleReasonSwPowerCap
    )
    (value,) = fake.nvmlDeviceGetFieldValues(h, [(pynvml.NVML_FI_DEV_MEMORY_TEMP, 0)])
    assert value.nvmlReturn == pynvml.NVML_SUCCESS
    assert value.valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT and value.value.uiVal == 66


def test_memory_info_is_pynvmls_structure_of_either_version(fake: FakeNvml) -> None:
    gpu = fake.gpus[0]
    gpu.fb_used_bytes = 30 * 1024**3
    info = fake.nvmlDeviceGetMemoryInfo(fake.handle(0))
    assert type(info) is pynvml.c_nvmlMemory_t
    assert (info.total, info.used, info.free) == (80 * 1024**3, 30 * 1024**3, 50 * 1024**3)
    v2 = fake.nvmlDeviceGetMemoryInfo(fake.handle(0), pynvml.nvmlMemory_v2)
    assert type(v2) is pynvml.c_nvmlMemory_v2_t and v2.version == pynvml.nvmlMemory_v2
    assert (v2.total, v2.used, v2.free) == (info.total, info.used, info.free)
    assert (
        raised(fake.nvmlDeviceGetMemoryInfo, fake.handle(0), 0x1000028)
        is pynvml.NVMLError_ArgumentVersionMismatch
    )


def test_fabric_info_fills_the_structure_passed_by_reference(fake: FakeNvml) -> None:
    h = fake.handle(0)
    fake.gpus[0].fabric_health_mask = pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_FALSE
    info = pynvml.c_nvmlGpuFabricInfoV_t()
    assert fake.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info)) == pynvml.NVML_SUCCESS
    assert info.state == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
    assert info.status == pynvml.NVML_SUCCESS
    assert info.cliqueId == HGX_H100_FABRIC_CLIQUE_ID
    assert uuid.UUID(bytes=bytes(info.clusterUuid)) == uuid.UUID(HGX_H100_FABRIC_CLUSTER_UUID)
    assert info.healthMask == pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_FALSE
    # ctypes.pointer works as well as byref; the first call fills its plain structure.
    plain = pynvml.c_nvmlGpuFabricInfo_t()
    assert fake.nvmlDeviceGetGpuFabricInfo(h, ctypes.pointer(plain)) == pynvml.NVML_SUCCESS
    assert (plain.state, plain.cliqueId) == (info.state, info.cliqueId)
    # A structure passed as it is would go to the C function by value: refused.
    assert (
        raised(fake.nvmlDeviceGetGpuFabricInfoV, h, pynvml.c_nvmlGpuFabricInfoV_t())
        is pynvml.NVMLError_InvalidArgument
    )
    # The version names the layout: the plain structure is not the versioned one.
    assert (
        raised(fake.nvmlDeviceGetGpuFabricInfoV, h, ctypes.byref(plain))
        is pynvml.NVMLError_InvalidArgument
    )
    wrong = pynvml.c_nvmlGpuFabricInfoV_t()
    wrong.version = pynvml.nvmlGpuFabricInfo_v3
    assert (
        raised(fake.nvmlDeviceGetGpuFabricInfoV, h, ctypes.byref(wrong))
        is pynvml.NVMLError_ArgumentVersionMismatch
    )


def test_only_the_hgx_builder_registers_its_gpus_with_the_fabric() -> None:
    (hgx,) = hgx_h100(1, 1)
    assert hgx.fabric_state == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
    assert hgx.fabric_status == pynvml.NVML_SUCCESS
    assert uuid.UUID(hgx.fabric_cluster_uuid).int != 0 and hgx.fabric_clique_id != 0
    plain = FakeGpu(uuid="GPU-x", name="NVIDIA A100-PCIE-40GB", pci_bus_id="00000000:17:00.0")
    assert plain.fabric_state == pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED
    assert {g.fabric_cluster_uuid for g in hgx_h100(8, 1)} == {HGX_H100_FABRIC_CLUSTER_UUID}


def test_gpm_samples_are_opaque_handles_and_metrics_come_from_the_fields(fake: FakeNvml) -> None:
    gpu = fake.gpus[0]
    gpu.gpm_sm_activity_percent, gpu.gpm_nvlink_rx_mib_per_second = 91.5, 123_456.0
    h = fake.handle(0)
    support = fake.nvmlGpmQueryDeviceSupport(h)
    assert type(support) is pynvml.c_nvmlGpmSupport_t and support.isSupportedDevice == 1
    first, second = fake.nvmlGpmSampleAlloc(), fake.nvmlGpmSampleAlloc()
    assert type(first) is pynvml.c_nvmlGpmSample_t
    assert fake.nvmlGpmSampleGet(h, first) is first
    fake.nvmlGpmSampleGet(h, second)
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    request.numMetrics = 3
    request.sample1, request.sample2 = first, second
    request.metrics[0].metricId = pynvml.NVML_GPM_METRIC_SM_UTIL
    request.metrics[1].metricId = pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC
    request.metrics[2].metricId = pynvml.NVML_GPM_METRIC_SM_OCCUPANCY  # not modelled
    assert fake.nvmlGpmMetricsGet(request) is request
    assert (request.metrics[0].nvmlReturn, request.metrics[0].value) == (0, 91.5)
    assert (request.metrics[1].nvmlReturn, request.metrics[1].value) == (0, 123_456.0)
    assert request.metrics[2].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert fake.gpm_samples_allocated() == 2
    fake.nvmlGpmSampleFree(first)
    fake.nvmlGpmSampleFree(second)
    assert fake.gpm_samples_allocated() == 0
    assert raised(fake.nvmlGpmSampleFree, first) is pynvml.NVMLError_InvalidArgument
    assert raised(fake.nvmlGpmMetricsGet, request) is pynvml.NVMLError_InvalidArgument
    assert fake.calls["nvmlGpmSampleAlloc"] == 2 and fake.calls["nvmlGpmMetricsGet"] == 2


def gpm_request(fake: FakeNvml, gpu1: int, gpu2: int) -> object:
    first, second = fake.nvmlGpmSampleAlloc(), fake.nvmlGpmSampleAlloc()
    fake.nvmlGpmSampleGet(fake.handle(gpu1), first)
    fake.nvmlGpmSampleGet(fake.handle(gpu2), second)
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    request.numMetrics = 1
    request.sample1, request.sample2 = first, second
    request.metrics[0].metricId = pynvml.NVML_GPM_METRIC_SM_UTIL
    return request


def test_gpm_metrics_want_two_samples_of_one_gpu_and_the_version(fake: FakeNvml) -> None:
    assert (
        raised(fake.nvmlGpmMetricsGet, gpm_request(fake, 0, 1)) is pynvml.NVMLError_InvalidArgument
    )
    request = gpm_request(fake, 1, 1)
    request.version = 2  # type: ignore[attr-defined]
    assert raised(fake.nvmlGpmMetricsGet, request) is pynvml.NVMLError_ArgumentVersionMismatch
    unsampled = pynvml.c_nvmlGpmMetricsGet_t()
    unsampled.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    unsampled.sample1, unsampled.sample2 = fake.nvmlGpmSampleAlloc(), fake.nvmlGpmSampleAlloc()
    assert raised(fake.nvmlGpmMetricsGet, unsampled) is pynvml.NVMLError_InvalidArgument


def test_gpm_nvlink_metrics_are_not_supported_without_links() -> None:
    gpus = [FakeGpu(uuid="GPU-p", name="NVIDIA H100 PCIe", pci_bus_id="00000000:17:00.0")]
    fake = FakeNvml(gpus)
    fake.nvmlInit()
    request = gpm_request(fake, 0, 0)
    request.metrics[0].metricId = pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC  # type: ignore[attr-defined]
    fake.nvmlGpmMetricsGet(request)
    assert request.metrics[0].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED  # type: ignore[attr-defined]


def test_gpm_unsupported_gpu_refuses_the_query_and_the_sample() -> None:
    gpus = hgx_h100(1, 1)
    gpus[0].unsupported.add("nvmlGpmQueryDeviceSupport")
    fake = FakeNvml(gpus)
    fake.nvmlInit()
    h = fake.handle(0)
    assert raised(fake.nvmlGpmQueryDeviceSupport, h) is pynvml.NVMLError_NotSupported
    sample = fake.nvmlGpmSampleAlloc()
    assert raised(fake.nvmlGpmSampleGet, h, sample) is pynvml.NVMLError_NotSupported


def test_bad_enum_values_are_invalid_arguments(fake: FakeNvml) -> None:
    h = fake.handle(0)
    invalid = pynvml.NVMLError_InvalidArgument
    ecc = fake.nvmlDeviceGetTotalEccErrors
    assert raised(ecc, h, pynvml.NVML_MEMORY_ERROR_TYPE_COUNT, pynvml.NVML_VOLATILE_ECC) is invalid
    assert raised(ecc, h, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, 2) is invalid
    cause = pynvml.NVML_PAGE_RETIREMENT_CAUSE_COUNT
    assert raised(fake.nvmlDeviceGetRetiredPages, h, cause) is invalid
    assert raised(fake.nvmlDeviceGetTemperature, h, 7) is invalid
    count = pynvml.NVML_TEMPERATURE_THRESHOLD_COUNT
    assert raised(fake.nvmlDeviceGetTemperatureThreshold, h, count) is invalid
    assert raised(fake.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_COUNT) is invalid
    # An acoustic threshold is a valid question a data-center GPU does not answer.
    acoustic = pynvml.NVML_TEMPERATURE_THRESHOLD_ACOUSTIC_MIN
    assert (
        raised(fake.nvmlDeviceGetTemperatureThreshold, h, acoustic) is pynvml.NVMLError_NotSupported
    )


def health_calls_with_arguments(fake: FakeNvml, index: int) -> list[tuple[str, tuple[object, ...]]]:
    h = fake.handle(index)
    calls: list[tuple[str, tuple[object, ...]]] = [(name, (h,)) for name in HANDLE_ONLY]
    calls += [
        (
            "nvmlDeviceGetTotalEccErrors",
            (h, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC),
        ),
        ("nvmlDeviceGetRetiredPages", (h, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)),
        ("nvmlDeviceGetTemperature", (h, pynvml.NVML_TEMPERATURE_GPU)),
        ("nvmlDeviceGetTemperatureThreshold", (h, pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)),
        ("nvmlDeviceGetClockInfo", (h, pynvml.NVML_CLOCK_SM)),
        ("nvmlDeviceGetGpuFabricInfo", (h, ctypes.byref(pynvml.c_nvmlGpuFabricInfo_t()))),
        ("nvmlDeviceGetGpuFabricInfoV", (h, ctypes.byref(pynvml.c_nvmlGpuFabricInfoV_t()))),
    ]
    return calls


def test_not_supported_lost_and_uninitialized_like_every_other_call() -> None:
    fake = FakeNvml(hgx_h100(3, 1))
    calls = health_calls_with_arguments(fake, 0)
    for name, args in calls:
        assert raised(getattr(fake, name), *args) is pynvml.NVMLError_Uninitialized, name
    assert raised(fake.nvmlGpmSampleAlloc) is pynvml.NVMLError_Uninitialized
    fake.nvmlInit()
    fake.gpus[1].unsupported |= {name for name, _args in calls}
    fake.gpus[2].lost = True
    for name, args in health_calls_with_arguments(fake, 1):
        assert raised(getattr(fake, name), *args) is pynvml.NVMLError_NotSupported, name
    for name, args in health_calls_with_arguments(fake, 2):
        assert raised(getattr(fake, name), *args) is pynvml.NVMLError_GpuIsLost, name
    for name, args in calls:
        getattr(fake, name)(*args)  # GPU 0 answers every one
    # Every call was counted: once before init and once on each of the three GPUs.
    assert all(fake.calls[name] == 4 for name, _args in calls)


def test_the_published_state_carries_the_health_fields_to_a_mirror(tmp_path: Path) -> None:
    fake = FakeNvml(hgx_h100(2, 1), clock_us=lambda: 1_750_000_000_000_000)
    gpu = fake.gpus[1]
    gpu.ecc_aggregate_uncorrected, gpu.remap_pending = 3, True
    gpu.temperature_gpu, gpu.power_draw_mw = 88, 690_000
    gpu.clock_event_reasons = pynvml.nvmlClocksEventReasonHwSlowdown
    gpu.fabric_health_mask = pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE
    gpu.gpm_tensor_activity_percent = 55.5
    path = tmp_path / "nvml-state.json"
    write_state(path, state_document(fake, 0.0, 1.75e9, []))
    mirror = MirroredNvml(path)
    clock = lambda: 1.75e9  # noqa: E731
    direct = NvmlSource(fake, watch_xids=False, wall_clock=clock, health_every=1, gpm_every=1)
    mirrored = NvmlSource(mirror, watch_xids=False, wall_clock=clock, health_every=1, gpm_every=1)
    try:
        for _ in range(3):
            ours, theirs = direct.collect(Roots()), mirrored.collect(Roots())
            assert theirs.health == ours.health
        assert ours.health[1].ecc is not None and ours.health[1].ecc.aggregate_uncorrected == 3
        assert ours.health[1].gpm is not None and ours.health[1].gpm.tensor_activity_percent == 55.5
        gpu.temperature_gpu = 91  # a later state reaches the mirror on refresh
        write_state(path, state_document(fake, 1.0, 1.75e9, []))
        assert mirror.refresh()
        ours, theirs = direct.collect(Roots()), mirrored.collect(Roots())
        assert theirs.health == ours.health
        assert theirs.health[1].temperatures is not None
        assert theirs.health[1].temperatures.gpu == 91
    finally:
        direct.close()
        mirrored.close()
