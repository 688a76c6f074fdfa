"""A local all-reduce over the node's devices with torch.distributed, as nccl-tests'
``all_reduce_perf`` measures it: one process per rank (NCCL, one GPU each; gloo on
127.0.0.1 for the CPU stand-in), float32 sum, ``-w`` warm-up and ``-n`` timed iterations per
size, the time of the slowest rank; ``algbw = size / time`` and
``busbw = algbw × 2(n−1)/n``.

Then the latency of small messages (8 B … 4 KiB by default): there a mean over a loop hides
what matters, a floor of a few microseconds that every collective pays (a barrier, a
handshake) and the tail above it, so each all-reduce is timed on its own (CUDA events around
it on the stream that waits for it; ``time.perf_counter`` around gloo's blocking call), the
slowest rank's time taken per iteration, and the figure is the median and the 99th
percentile of those times (:func:`nodescope.probe.sweep.latency_figure`).

The ranks rendezvous through a file store in a private temporary directory, so no TCP port
is picked; rank 0 writes the figures to a JSON file there. NCCL ranks are spawned (a fresh
interpreter: CUDA does not survive fork); gloo ranks are forked from the probe, which has
touched no accelerator, so they start without importing torch again.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import (
    ProcessExitedException,
    ProcessRaisedException,
    start_processes,
)

from nodescope.model.probe import AllReducePoint, AllReduceResult
from nodescope.probe.sweep import alg_bandwidth, bus_bandwidth, latency_figure


class AllReduceError(RuntimeError):
    """The all-reduce could not run (a rank failed, or the run took too long)."""


def _worker(
    rank: int,
    ranks: int,
    backend: str,
    store: str,
    sizes: tuple[int, ...],
    warmup: int,
    iters: int,
    out: str,
    timeout: float,
    latency: tuple[tuple[int, ...], int, int] = ((), 0, 0),
) -> None:
    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(1)
    dist.init_process_group(
        backend,
        init_method=f"file://{store}",
        rank=rank,
        world_size=ranks,
        timeout=datetime.timedelta(seconds=timeout),
    )
    try:
        points = []
        for size in sizes:
            tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
            for _ in range(warmup):
                dist.all_reduce(tensor)
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            begin = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(tensor)
            if cuda:
                torch.cuda.synchronize()
            elapsed = torch.tensor([(time.perf_counter() - begin) / iters], device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            points.append((size, max(float(elapsed.item()), 1e-9)))
        latency_sizes, latency_warmup, latency_iters = latency
        timings = [
            (size, _timed_one_by_one(size, device, latency_warmup, latency_iters))
            for size in latency_sizes
        ]
        if rank == 0:
            Path(out).write_text(json.dumps({"points": points, "latency": timings}))
    finally:
        dist.destroy_process_group()


def _timed_one_by_one(size: int, device: torch.device, warmup: int, iters: int) -> list[float]:
    """Seconds of each of ``iters`` all-reduces of ``size`` bytes, the slowest rank's each."""
    tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
    cuda = device.type == "cuda"
    for _ in range(warmup):
        dist.all_reduce(tensor)
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    if cuda:
        # Events on the current stream: NCCL's stream waits for the start event's work and
        # the current stream for the collective, so each pair brackets one all-reduce.
        marks = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))  # type: ignore[no-untyped-call]
            for _ in range(iters)
        ]
        for start, end in marks:
            start.record()
            dist.all_reduce(tensor)
            end.record()
        torch.cuda.synchronize()
        seconds = [float(start.elapsed_time(end)) / 1e3 for start, end in marks]
    else:
        seconds = []
        for _ in range(iters):
            begin = time.perf_counter()
            dist.all_reduce(tensor)
            seconds.append(time.perf_counter() - begin)
    slowest = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return [float(t) for t in slowest.tolist()]


def run(
    backend: str,
    ranks: int,
    sizes: tuple[int, ...],
    warmup: int,
    iters: int,
    timeout: float,
    latency_sizes: tuple[int, ...] = (),
    latency_warmup: int = 0,
    latency_iters: int = 0,
) -> AllReduceResult:
    with tempfile.TemporaryDirectory(prefix="nodescope-allreduce-") as tmp:
        store = os.path.join(tmp, "store")
        out = os.path.join(tmp, "result.json")
        if backend == "gloo":
            # Gloo picks its interface from the host name, which may resolve to anything.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        context = start_processes(  # type: ignore[no-untyped-call]
            _worker,
            args=(
                ranks,
                backend,
                store,
                sizes,
                warmup,
                iters,
                out,
                timeout,
                (latency_sizes, latency_warmup, latency_iters),
            ),
            nprocs=ranks,
            join=False,
            start_method="spawn" if backend == "nccl" else "fork",
        )
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise AllReduceError(f"no result after {timeout:.0f} s")
        except ProcessRaisedException as exc:
            first = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
            raise AllReduceError(f"a rank failed: {first}") from None
        except ProcessExitedException as exc:
            raise AllReduceError(f"a rank exited: {exc}") from None
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        try:
            raw = json.loads(Path(out).read_text())
        except (OSError, ValueError) as exc:
            raise AllReduceError(f"no result from rank 0: {exc}") from None
    points = []
    for size, seconds in raw["points"]:
        algbw = alg_bandwidth(int(size), float(seconds))
        points.append(AllReducePoint(int(size), float(seconds), algbw, bus_bandwidth(algbw, ranks)))
    busbw = [p.busbw_bytes_per_second for p in points]
    return AllReduceResult(
        backend=backend,
        ranks=ranks,
        dtype="float32",
        points=tuple(points),
        peak_busbw_bytes_per_second=max(busbw),
        avg_busbw_bytes_per_second=sum(busbw) / len(busbw),
        latency=tuple(latency_figure(int(size), times) for size, times in raw["latency"]),
    )
