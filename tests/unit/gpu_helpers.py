"""NVML records built directly for the GPU detector, health and metric tests (a GPU sample,
a health record and the ``nvml`` record that holds them, each with nothing answered but what
a test names), and the NVML functions the health read calls."""

from __future__ import annotations

import dataclasses
from typing import Any

from nodescope.model.gpu_health import GpuHealth
from nodescope.model.nvml import GpuSample, NvmlData

H100 = "NVIDIA H100 80GB HBM3"

#: The NVML functions the ``nvml`` source's health read calls, by the name ``FakeNvml.calls``
#: counts them under.
HEALTH_CALLS = (
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRetiredPages",
    "nvmlDeviceGetRetiredPagesPendingStatus",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetTemperatureThreshold",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetPowerManagementLimit",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetPowerManagementDefaultLimit",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetApplicationsClock",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetGpuFabricInfoV",
    "nvmlGpmQueryDeviceSupport",
    "nvmlGpmSampleAlloc",
    "nvmlGpmSampleGet",
    "nvmlGpmMetricsGet",
)


def gpu_sample(index: int, pci_address: str, **fields: Any) -> GpuSample:
    """GPU ``index`` (an H100 with uuid ``GPU-<index>``) that answered none of the PCIe and
    utilisation queries and runs nothing, with ``fields`` as given."""
    bare = GpuSample(
        index=index,
        uuid=f"GPU-{index}",
        name=H100,
        pci_address=pci_address,
        pcie_tx=None,
        pcie_rx=None,
        pcie_snapshot=None,
        pcie_bytes_source=None,
        pcie_gen_current=None,
        pcie_width_current=None,
        pcie_gen_max=None,
        pcie_width_max=None,
        pcie_replays=None,
        gpu_util_percent=None,
        memory_util_percent=None,
        decoder_util_percent=None,
        encoder_util_percent=None,
        jpeg_util_percent=None,
        processes=(),
        nvlinks=(),
        unsupported=(),
    )
    return dataclasses.replace(bare, **fields)


def gen5_sample(index: int, pci_address: str, **fields: Any) -> GpuSample:
    """GPU ``index`` (as :func:`gpu_sample`) on its full PCIe Gen5 x16 link without replays,
    its media engines idle, with ``fields`` as given."""
    full_link = {
        "pcie_gen_current": 5,
        "pcie_width_current": 16,
        "pcie_gen_max": 5,
        "pcie_width_max": 16,
        "pcie_replays": 0,
        "decoder_util_percent": 0,
        "encoder_util_percent": 0,
        "jpeg_util_percent": 0,
    }
    return gpu_sample(index, pci_address, **{**full_link, **fields})


def gpu_health(index: int, pci_address: str, read_at: float, **fields: Any) -> GpuHealth:
    """The health of GPU ``index`` read at ``read_at``, answering none of the health calls
    but ``fields``."""
    bare = GpuHealth(
        index=index,
        uuid=f"GPU-{index}",
        pci_address=pci_address,
        read_at=read_at,
        ecc=None,
        retired_pages=None,
        row_remap=None,
        temperatures=None,
        power=None,
        clocks=None,
        framebuffer=None,
        fabric=None,
        gpm=None,
    )
    return dataclasses.replace(bare, **fields)


def nvml_data(gpus: tuple[GpuSample, ...], health: tuple[GpuHealth, ...] = ()) -> NvmlData:
    """The ``nvml`` record of ``gpus`` and their ``health``, with no lost GPU, Xid or event."""
    return NvmlData(
        device_count=len(gpus),
        gpus=gpus,
        lost=(),
        xids=(),
        xid_source=None,
        events=(),
        health=health,
    )
