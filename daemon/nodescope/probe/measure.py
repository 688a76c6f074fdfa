"""The measurements, with torch: host↔device copies over a size sweep, the device pair matrix
and (through :mod:`.allreduce`) a local all-reduce.

On CUDA, times come from CUDA events on the stream that runs the copies (what nccl-tests and
CUDA's bandwidthTest do), host buffers are pinned and copies are asynchronous, so the figure
is the DMA engines' over the PCIe link. Without a GPU the same loops run on CPU tensors: the
"devices" are two host buffers, "H2D"/"D2H" are copies between host memory and those buffers
(pinning needs an accelerator), times come from ``time.perf_counter``; the report says it is
a stand-in, whose figures exercise the probe and say nothing about PCIe.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from nodescope.model.paths import pair_path
from nodescope.model.probe import (
    SCHEMA_VERSION,
    CopyPoint,
    CopySeries,
    PeerCopy,
    ProbeDevice,
    ProbeReport,
    SweepSizes,
)
from nodescope.model.topology import Topology
from nodescope.probe import allreduce
from nodescope.probe.links import NO_LINK, LinkInfo, bdf_of, link_info, normalise_bdf
from nodescope.probe.sweep import Plan, alg_bandwidth, human_bytes
from nodescope.progress import Progress

#: Buffers the CPU stand-in uses as its "devices": two, so the pair matrix has a pair.
STAND_IN_DEVICES = 2

STAND_IN_NOTE = (
    "no CUDA device: CPU stand-in. 'H2D'/'D2H' are copies between pageable host buffers"
    " (pinning needs a GPU), pair copies are between two host buffers, the all-reduce ran"
    " over gloo on 127.0.0.1. These figures test the probe; they are not PCIe figures."
)


@dataclass(frozen=True, slots=True)
class Target:
    index: int
    name: str
    device: torch.device
    pci_address: str | None
    link: LinkInfo
    numa_node: int | None = None


def _numa_node(topology: Topology | None, bdf: str | None) -> int | None:
    device = None if topology is None or bdf is None else topology.get(bdf)
    return None if device is None else device.numa_node


def _nvml_bdf(uuid: str) -> str | None:
    """The GPU's BDF through NVML, for torch builds whose properties lack PCI numbers."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            bus_id = pynvml.nvmlDeviceGetPciInfo(handle).busId
            return normalise_bdf(bus_id.decode() if isinstance(bus_id, bytes) else bus_id)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def cuda_pci_address(index: int) -> str | None:
    props = torch.cuda.get_device_properties(index)
    numbers = [getattr(props, f"pci_{n}_id", None) for n in ("domain", "bus", "device")]
    if all(isinstance(n, int) for n in numbers):
        domain, bus, device = (int(n) for n in numbers)  # type: ignore[arg-type]
        return bdf_of(domain, bus, device)
    uuid = getattr(props, "uuid", None)
    return _nvml_bdf(f"GPU-{uuid}") if uuid is not None else None


def discover(topology: Topology | None, force_cpu: bool = False) -> tuple[str, list[Target]]:
    """``("cuda", GPUs)`` or ``("cpu", stand-in buffers)``."""
    if not force_cpu and torch.cuda.is_available() and torch.cuda.device_count() > 0:
        targets = []
        for i in range(torch.cuda.device_count()):
            bdf = cuda_pci_address(i)
            targets.append(
                Target(
                    i,
                    torch.cuda.get_device_name(i),
                    torch.device("cuda", i),
                    bdf,
                    link_info(topology, bdf),
                    _numa_node(topology, bdf),
                )
            )
        return "cuda", targets
    return "cpu", [
        Target(i, f"host buffer {i}", torch.device("cpu"), None, NO_LINK)
        for i in range(STAND_IN_DEVICES)
    ]


Op = Callable[[], object]


def time_op(op: Op, device: torch.device, warmup: int, iters: int) -> float:
    """Seconds per call of ``op`` (mean over ``iters`` after ``warmup`` calls)."""
    for _ in range(warmup):
        op()
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            for _ in range(iters):
                op()
            end.record()
            end.synchronize()
            return max(float(start.elapsed_time(end)) / 1e3 / iters, 1e-9)
    begin = time.perf_counter()
    for _ in range(iters):
        op()
    return max((time.perf_counter() - begin) / iters, 1e-9)


def _host_buffer(size: int, pinned: bool) -> torch.Tensor:
    buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
    buffer.fill_(1)  # touch every page: first-touch faults must not land in the timing
    return buffer


def copy_series(
    target: Target,
    host: torch.Tensor,
    direction: str,
    plan: Plan,
    progress: Progress,
) -> CopySeries:
    size = plan.copy_sizes[-1]
    dev = torch.empty(size, dtype=torch.uint8, device=target.device)
    dev.fill_(2)
    points = []
    for n in plan.copy_sizes:
        src, dst = (host[:n], dev[:n]) if direction == "h2d" else (dev[:n], host[:n])

        def op(src: torch.Tensor = src, dst: torch.Tensor = dst) -> object:
            return dst.copy_(src, non_blocking=True)

        seconds = time_op(op, target.device, plan.copy_warmup, plan.copy_iters)
        points.append(CopyPoint(n, seconds, alg_bandwidth(n, seconds)))
        progress.step(f"{direction} {target.index} {human_bytes(n)}")
    del dev
    peak = max(p.bytes_per_second for p in points)
    capacity = target.link.capacity_bytes_per_second
    return CopySeries(
        device=target.index,
        direction=direction,
        pinned=bool(host.is_pinned()),
        points=tuple(points),
        peak_bytes_per_second=peak,
        fraction_of_capacity=peak / capacity if capacity else None,
    )


def peer_copies(
    targets: list[Target],
    plan: Plan,
    progress: Progress,
    topology: Topology | None = None,
    nvlinks: Mapping[frozenset[str], int] | None = None,
) -> list[PeerCopy]:
    """Every ordered pair: bandwidth of ``peer_size`` copies and the latency of small ones,
    timed on the sending device (torch copies between GPUs on the source's stream), and the
    path between the two (``NV#`` from ``nvlinks``, else the PCIe class of ``topology``)."""
    buffers = {}
    for t in targets:
        buffers[t.index] = torch.empty(plan.peer_size, dtype=torch.uint8, device=t.device)
        buffers[t.index].fill_(t.index)
    out = []
    for a in targets:
        for b in targets:
            if a.index == b.index:
                continue
            src, dst = buffers[a.index], buffers[b.index]
            small_src, small_dst = src[: plan.latency_size], dst[: plan.latency_size]
            seconds = time_op(
                lambda s=src, d=dst: d.copy_(s, non_blocking=True),  # type: ignore[misc]
                a.device,
                1,
                plan.peer_iters,
            )
            latency = time_op(
                lambda s=small_src, d=small_dst: d.copy_(s, non_blocking=True),  # type: ignore[misc]
                a.device,
                5,
                plan.latency_iters,
            )
            access = (
                bool(torch.cuda.can_device_access_peer(a.index, b.index))
                if a.device.type == "cuda"
                else False
            )
            path = pair_path(topology, a.pci_address, b.pci_address, nvlinks)
            out.append(
                PeerCopy(
                    a.index,
                    b.index,
                    plan.peer_size,
                    alg_bandwidth(plan.peer_size, seconds),
                    latency,
                    access,
                    None if path is None else path.path,
                )
            )
            progress.step(f"pair {a.index}->{b.index}")
    return out


def steps(plan: Plan, devices: int, with_allreduce: bool) -> int:
    """Progress steps of a run: copy sizes, pairs, and the all-reduce as one."""
    return 2 * devices * len(plan.copy_sizes) + devices * (devices - 1) + int(with_allreduce)


def measure(
    plan: Plan,
    quick: bool,
    topology: Topology | None,
    progress_stream: object,
    progress_enabled: bool | None = None,
    with_allreduce: bool = True,
    force_cpu: bool = False,
    allreduce_timeout: float = 120.0,
    custom_sizes: bool = False,
    nvlinks: Mapping[frozenset[str], int] | None = None,
) -> ProbeReport:
    """One run of the whole probe; thresholds are applied afterwards (:mod:`.verdict`).
    ``custom_sizes`` says the plan's sizes came from ``--sizes``; ``nvlinks`` are the NVLink
    counts of GPU pairs by PCI address, for the pairs' paths."""
    started = time.time()
    backend, targets = discover(topology, force_cpu)
    stand_in = backend == "cpu"
    skipped: list[str] = []
    run_allreduce = with_allreduce and len(targets) > 1
    if with_allreduce and len(targets) < 2:
        skipped.append("all-reduce: one GPU only")
    if not with_allreduce:
        skipped.append("all-reduce: not requested")
    progress = Progress(
        steps(plan, len(targets), run_allreduce),
        progress_stream,  # type: ignore[arg-type]
        progress_enabled,
    )
    try:
        host = _host_buffer(plan.copy_sizes[-1], pinned=not stand_in)
        copies = [
            copy_series(t, host, direction, plan, progress)
            for t in targets
            for direction in ("h2d", "d2h")
        ]
        del host
        peers = (
            peer_copies(targets, plan, progress, None if stand_in else topology, nvlinks)
            if len(targets) > 1
            else []
        )
        result = None
        if run_allreduce:
            progress.show("all-reduce")
            try:
                result = allreduce.run(
                    backend="gloo" if stand_in else "nccl",
                    ranks=len(targets),
                    sizes=plan.allreduce_sizes,
                    warmup=plan.allreduce_warmup,
                    iters=plan.allreduce_iters,
                    timeout=allreduce_timeout,
                    latency_sizes=plan.allreduce_latency_sizes,
                    latency_warmup=plan.allreduce_latency_warmup,
                    latency_iters=plan.allreduce_latency_iters,
                )
            except allreduce.AllReduceError as exc:
                skipped.append(f"all-reduce: {exc}")
            progress.step("all-reduce")
    finally:
        progress.close()
    return ProbeReport(
        schema_version=SCHEMA_VERSION,
        hostname=socket.gethostname(),
        backend=backend,
        stand_in=stand_in,
        note=STAND_IN_NOTE if stand_in else "",
        torch_version=torch.__version__.split("+")[0],
        quick=quick,
        started=started,
        finished=time.time(),
        devices=tuple(
            ProbeDevice(
                index=t.index,
                name=t.name,
                pci_address=t.pci_address,
                link=t.link.description,
                capacity_bytes_per_second=t.link.capacity_bytes_per_second,
                current_capacity_bytes_per_second=t.link.current_capacity_bytes_per_second,
                numa_node=t.numa_node,
            )
            for t in targets
        ),
        copies=tuple(copies),
        peers=tuple(peers),
        asymmetry=(),
        allreduce=result,
        skipped=tuple(skipped),
        failures=(),
        sizes=SweepSizes(
            custom=custom_sizes,
            copy=plan.copy_sizes,
            allreduce=plan.allreduce_sizes if result is not None else (),
            allreduce_latency=plan.allreduce_latency_sizes if result is not None else (),
        ),
    )


def configure_threads() -> None:
    """The CPU stand-in copies with torch's intra-op threads; keep them to the CPUs this
    process may use, not every core of the node."""
    with contextlib.suppress(AttributeError, OSError):
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
