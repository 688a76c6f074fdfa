"""The ``nvml`` source's process reader: each GPU's compute processes and how busy its
engines are (GPU, memory, decoder, encoder and JPEG utilisation), read every run."""

from __future__ import annotations

from nodescope.model.nvml import GpuProcess
from nodescope.sources.nvml_device import Gpu, NvmlAdapter, call

#: The media engines' utilisation calls, in the order :meth:`ProcessReader.utilisation`
#: answers them.
_MEDIA_CALLS = (
    "nvmlDeviceGetDecoderUtilization",
    "nvmlDeviceGetEncoderUtilization",
    "nvmlDeviceGetJpgUtilization",
)


class ProcessReader:
    """Reads what runs on a GPU: its compute processes and its engines' utilisation."""

    def __init__(self, nvml: NvmlAdapter) -> None:
        self.nvml = nvml

    def utilisation(
        self, gpu: Gpu
    ) -> tuple[int | None, int | None, int | None, int | None, int | None]:
        """GPU, memory, decoder, encoder and JPEG utilisation in percent (``None``: no
        answer). The media calls are looked up by name: older bindings lack some."""
        nvml, h = self.nvml, gpu.handle
        util = call(gpu, "nvmlDeviceGetUtilizationRates", nvml.nvmlDeviceGetUtilizationRates, h)
        media: list[int | None] = []
        for key in _MEDIA_CALLS:
            answer = call(gpu, key, getattr(nvml, key, None), h)
            media.append(None if answer is None else int(answer[0]))
        decoder, encoder, jpeg = media
        return (
            None if util is None else int(util.gpu),
            None if util is None else int(util.memory),
            decoder,
            encoder,
            jpeg,
        )

    def processes(self, gpu: Gpu) -> tuple[GpuProcess, ...]:
        """The compute processes on ``gpu`` by pid, with the GPU memory each uses."""
        procs = call(
            gpu,
            "nvmlDeviceGetComputeRunningProcesses",
            self.nvml.nvmlDeviceGetComputeRunningProcesses,
            gpu.handle,
        )
        return tuple(
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
