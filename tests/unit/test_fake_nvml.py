"""The fake NVML raises what pynvml raises, returns pynvml's own structs, and has pynvml's
call surface; on this machine (no driver) the real binding fails the way the fake's
"no driver" mode does."""

from __future__ import annotations

import ctypes
import inspect
import time

import pynvml
import pytest

from nodescope.sim.fake_nvml import FakeGpu, FakeLink, FakeNvml, FakeProcess, hgx_h100
from nodescope.sources.nvml import NvmlAdapter


def error_class(code: int) -> type[BaseException]:
    """The class pynvml itself builds for ``code``."""
    return type(pynvml.NVMLError(code))


def raised(fn: object, *args: object) -> type[BaseException]:
    assert callable(fn)
    with pytest.raises(pynvml.NVMLError) as info:
        fn(*args)
    return info.type


def real_nvml_missing() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        return True
    pynvml.nvmlShutdown()
    return False


@pytest.fixture
def fake() -> FakeNvml:
    nvml = FakeNvml(hgx_h100(gpus=2, links=4))
    nvml.nvmlInit()
    return nvml


def address(pointer: object) -> int | None:
    return ctypes.cast(pointer, ctypes.c_void_p).value


@pytest.mark.skipif(not real_nvml_missing(), reason="this machine has an NVIDIA driver")
def test_real_pynvml_without_driver_raises_what_the_fake_no_driver_mode_raises() -> None:
    real = raised(pynvml.nvmlInit)
    assert real is pynvml.NVMLError_LibraryNotFound
    assert real is error_class(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    assert raised(FakeNvml.no_driver().nvmlInit) is real
    # Without the library every other call answers Uninitialized, as the fake does before init.
    assert raised(pynvml.nvmlDeviceGetCount) is pynvml.NVMLError_Uninitialized
    assert raised(FakeNvml(hgx_h100(1)).nvmlDeviceGetCount) is pynvml.NVMLError_Uninitialized


def test_every_call_before_init_and_after_shutdown_is_uninitialized() -> None:
    nvml = FakeNvml(hgx_h100(1))
    expected = error_class(pynvml.NVML_ERROR_UNINITIALIZED)
    assert raised(nvml.nvmlDeviceGetHandleByIndex, 0) is expected
    assert raised(nvml.nvmlEventSetCreate) is expected
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlShutdown()
    assert raised(nvml.nvmlDeviceGetUUID, handle) is expected


def test_not_supported_lost_and_bad_link_raise_pynvml_classes(fake: FakeNvml) -> None:
    h0 = fake.nvmlDeviceGetHandleByIndex(0)
    fake.gpus[0].unsupported.add("nvmlDeviceGetJpgUtilization")
    assert raised(fake.nvmlDeviceGetJpgUtilization, h0) is error_class(
        pynvml.NVML_ERROR_NOT_SUPPORTED
    )
    assert raised(fake.nvmlDeviceGetNvLinkState, h0, 4) is error_class(
        pynvml.NVML_ERROR_INVALID_ARGUMENT
    )
    assert raised(fake.nvmlDeviceGetNvLinkErrorCounter, h0, 99, 0) is error_class(
        pynvml.NVML_ERROR_INVALID_ARGUMENT
    )
    fake.gpus[1].lost = True
    lost = error_class(pynvml.NVML_ERROR_GPU_IS_LOST)
    assert lost is pynvml.NVMLError_GpuIsLost
    assert raised(fake.nvmlDeviceGetHandleByIndex, 1) is lost
    assert raised(fake.nvmlDeviceGetUUID, fake.handle(1)) is lost
    assert raised(fake.nvmlDeviceGetFieldValues, fake.handle(1), [197]) is lost


def test_gpu_without_nvlink_answers_not_supported() -> None:
    nvml = FakeNvml([FakeGpu("GPU-x", "NVIDIA L4", "00000000:01:00.0")])
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert raised(nvml.nvmlDeviceGetNvLinkState, h, 0) is pynvml.NVMLError_NotSupported


def test_pci_info_is_pynvml_struct_with_nvml_bus_id(fake: FakeNvml) -> None:
    info = fake.nvmlDeviceGetPciInfo(fake.nvmlDeviceGetHandleByIndex(1))
    assert isinstance(info, pynvml.nvmlPciInfo_t)
    assert info.busId == "00000000:3B:00.0"
    assert (info.domain, info.bus, info.device) == (0, 0x3B, 0)
    remote = fake.nvmlDeviceGetNvLinkRemotePciInfo(fake.handle(1), 0)
    assert remote.busId == "00000000:83:00.0"


def test_field_values_are_real_structs_with_per_field_returns(fake: FakeNvml) -> None:
    gpu = fake.gpus[0]
    gpu.pcie_tx_bytes = 12345
    gpu.links[2].data_rx_kib = 77
    gpu.unsupported.add(pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES)
    values = fake.nvmlDeviceGetFieldValues(
        fake.handle(0),
        [
            pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
            (pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, 0),
            (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, 2),
            (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, 9),
        ],
    )
    assert all(isinstance(v, pynvml.c_nvmlFieldValue_t) for v in values)
    tx, rx, link2, link9 = values
    assert tx.nvmlReturn == pynvml.NVML_SUCCESS
    assert tx.valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    assert tx.value.ullVal == 12345
    assert tx.timestamp > 1_600_000_000_000_000  # µs since the epoch
    assert rx.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert (link2.fieldId, link2.scopeId, link2.value.ullVal) == (139, 2, 77)
    assert link9.nvmlReturn == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_field_values_hold_the_bytes_pynvml_attribute_writes_would(fake: FakeNvml) -> None:
    """The fake builds the array from bytes; NVML and pynvml fill it field by field. Both
    must leave the same memory, so a reader can take either path."""
    now = 1_750_000_000_123_456
    fake._clock_us = lambda: now
    gpu = fake.gpus[1]
    gpu.pcie_counter_bits = 32
    gpu.pcie_tx_bytes = (1 << 32) + 77
    gpu.pcie_rx_bytes = 1 << 20
    for n, link in enumerate(gpu.links):
        link.data_tx_kib, link.raw_rx_kib = 10 + n, (1 << 64) + n
    gpu.unsupported.add(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX)
    asked: list[object] = [
        pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES,  # a bare id: scope 0
        (pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, 0),
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 3),
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 0xFFFFFFFF),  # all links summed
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX, 1),
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX, 1),  # unsupported
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, 4),  # past the last link
        (pynvml.NVML_FI_DEV_ECC_CURRENT, 0),  # a field the fake does not serve
    ]
    ok, ui, ull = (
        pynvml.NVML_SUCCESS,
        pynvml.NVML_VALUE_TYPE_UNSIGNED_INT,
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
    )
    fid_tx, fid_rx = pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES
    data_tx = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
    expected_rows: list[tuple[int, int, int, int, str, int]] = [
        (fid_tx, 0, ok, ui, "uiVal", 77),
        (fid_rx, 0, ok, ui, "uiVal", 1 << 20),
        (data_tx, 3, ok, ull, "ullVal", 13),
        (data_tx, 0xFFFFFFFF, ok, ull, "ullVal", 10 + 11 + 12 + 13),
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX, 1, ok, ull, "ullVal", 1),
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX, 1, pynvml.NVML_ERROR_NOT_SUPPORTED, 0, "", 0),
        (
            pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
            4,
            pynvml.NVML_ERROR_INVALID_ARGUMENT,
            0,
            "",
            0,
        ),
        (pynvml.NVML_FI_DEV_ECC_CURRENT, 0, pynvml.NVML_ERROR_NOT_SUPPORTED, 0, "", 0),
    ]
    expected = (pynvml.c_nvmlFieldValue_t * len(expected_rows))()
    for value, (fid, scope, ret, vtype, member, number) in zip(
        expected, expected_rows, strict=True
    ):
        value.fieldId, value.scopeId, value.latencyUsec = fid, scope, 0
        value.nvmlReturn = ret
        if ret == ok:
            value.valueType, value.timestamp = vtype, now
            setattr(value.value, member, number)
    values = fake.nvmlDeviceGetFieldValues(fake.handle(1), asked)
    assert type(values) is type(expected)
    assert bytes(values) == bytes(expected)
    assert fake.field_requests[-1] == (1, [(fid_tx, 0), *asked[1:]])
    assert len(fake.nvmlDeviceGetFieldValues(fake.handle(1), [])) == 0


def test_32_bit_pcie_counter_wraps_and_says_so(fake: FakeNvml) -> None:
    fake.gpus[0].pcie_counter_bits = 32
    fake.gpus[0].pcie_tx_bytes = (1 << 32) + 5
    (value,) = fake.nvmlDeviceGetFieldValues(fake.handle(0), [197])
    assert value.valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    assert value.value.uiVal == 5


def test_processes_are_friendly_objects_with_none_for_unavailable_memory(fake: FakeNvml) -> None:
    fake.gpus[0].processes = [FakeProcess(4242, 1 << 30), FakeProcess(4243, None)]
    procs = fake.nvmlDeviceGetComputeRunningProcesses(fake.handle(0))
    assert [(p.pid, p.usedGpuMemory) for p in procs] == [(4242, 1 << 30), (4243, None)]
    util = fake.nvmlDeviceGetUtilizationRates(fake.handle(0))
    assert isinstance(util, pynvml.c_nvmlUtilization_t)


def test_event_set_delivers_registered_xids_and_times_out_otherwise(fake: FakeNvml) -> None:
    event_set = fake.nvmlEventSetCreate()
    h0 = fake.nvmlDeviceGetHandleByIndex(0)
    fake.nvmlDeviceRegisterEvents(h0, pynvml.nvmlEventTypeXidCriticalError, event_set)
    fake.inject_xid(1, 13)  # GPU 1 is not registered
    start = time.monotonic()
    assert raised(fake.nvmlEventSetWait, event_set, 50) is error_class(pynvml.NVML_ERROR_TIMEOUT)
    assert time.monotonic() - start >= 0.04
    fake.inject_xid(0, 79)
    data = fake.nvmlEventSetWait(event_set, 1000)
    assert isinstance(data, pynvml.c_nvmlEventData_t)
    assert address(data.device) == address(h0)
    assert (data.eventType, data.eventData) == (pynvml.nvmlEventTypeXidCriticalError, 79)
    fake.nvmlEventSetFree(event_set)
    assert raised(fake.nvmlEventSetWait, event_set, 10) is pynvml.NVMLError_InvalidArgument


def test_registering_an_unsupported_event_type_is_not_supported() -> None:
    gpus = hgx_h100(1, 1)
    gpus[0].supported_events = 0
    nvml = FakeNvml(gpus)
    nvml.nvmlInit()
    event_set = nvml.nvmlEventSetCreate()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    assert (
        raised(nvml.nvmlDeviceRegisterEvents, h, pynvml.nvmlEventTypeXidCriticalError, event_set)
        is pynvml.NVMLError_NotSupported
    )


def test_nvlink_error_counter_unsupported_per_counter() -> None:
    gpus = [FakeGpu("GPU-a", "H100", "00000000:19:00.0", links=[FakeLink("00000000:83:00.0")])]
    gpus[0].links[0].errors[0] = 3
    gpus[0].unsupported.add("nvmlDeviceGetNvLinkErrorCounter:3")
    nvml = FakeNvml(gpus)
    nvml.nvmlInit()
    assert nvml.nvmlDeviceGetNvLinkErrorCounter(nvml.handle(0), 0, 0) == 3
    assert raised(nvml.nvmlDeviceGetNvLinkErrorCounter, nvml.handle(0), 0, 3) is (
        pynvml.NVMLError_NotSupported
    )


def adapter_functions() -> list[str]:
    return [
        name
        for name, member in inspect.getmembers(NvmlAdapter)
        if name.startswith("nvml") and callable(member)
    ]


def test_adapter_lists_pynvml_functions_and_the_fake_matches_their_parameters() -> None:
    names = adapter_functions()
    assert "nvmlDeviceGetFieldValues" in names and "nvmlEventSetWait" in names
    for name in names:
        real = inspect.signature(getattr(pynvml, name))
        ours = inspect.signature(getattr(FakeNvml, name))
        declared = inspect.signature(getattr(NvmlAdapter, name))
        real_params = list(real.parameters)
        assert list(ours.parameters)[1:] == real_params, name
        assert list(declared.parameters)[1:] == real_params, name
