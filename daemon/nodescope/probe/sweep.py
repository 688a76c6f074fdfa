"""Size sweeps and bandwidth formulas, as nccl-tests defines them.

nccl-tests (``src/common.cu``, ``doc/PERFORMANCE.md``): ``-b`` the first size, ``-e`` the
last, ``-f`` the factor between two sizes; ``algbw = size / time``; for an all-reduce over
``n`` ranks ``busbw = algbw × 2(n−1)/n``, because each rank sends and receives
``2(n−1)/n`` of the buffer in a ring, so busbw is comparable with a link's peak rate.
"""

from __future__ import annotations

from dataclasses import dataclass

KIB = 1 << 10
MIB = 1 << 20


def size_sweep(begin: int, end: int, factor: int) -> tuple[int, ...]:
    """``begin, begin·factor, …`` up to and including ``end`` when the steps reach it."""
    if begin <= 0:
        raise ValueError(f"first size {begin} must be above 0")
    if end < begin:
        raise ValueError(f"last size {end} is below the first {begin}")
    if factor < 2:
        raise ValueError(f"factor {factor} must be 2 or more")
    sizes = []
    size = begin
    while size <= end:
        sizes.append(size)
        size *= factor
    return tuple(sizes)


def alg_bandwidth(size_bytes: int, seconds: float) -> float:
    """Bytes per second of one operation on ``size_bytes`` that took ``seconds``."""
    if seconds <= 0:
        raise ValueError(f"time {seconds} must be above 0")
    return size_bytes / seconds


def bus_bandwidth(algbw: float, ranks: int) -> float:
    """nccl-tests' all-reduce bus bandwidth: ``algbw × 2(n−1)/n`` (0 for one rank)."""
    if ranks < 1:
        raise ValueError(f"{ranks} ranks")
    return algbw * 2 * (ranks - 1) / ranks


def asymmetry(forward: float, backward: float) -> float:
    """``|forward − backward| / mean``: 0 for equal directions, 2 when one of them is 0."""
    if forward < 0 or backward < 0:
        raise ValueError("negative figure")
    mean = (forward + backward) / 2
    if mean == 0:
        return 0.0
    return abs(forward - backward) / mean


@dataclass(frozen=True, slots=True)
class Plan:
    """What one run measures: the copy sweep, the pair copies and the all-reduce sweep, each
    with nccl-tests' warm-up (``-w``) and timed iterations (``-n``)."""

    copy_sizes: tuple[int, ...]
    copy_warmup: int
    copy_iters: int
    peer_size: int
    peer_iters: int
    latency_size: int
    latency_iters: int
    allreduce_sizes: tuple[int, ...]
    allreduce_warmup: int
    allreduce_iters: int


#: The full run: 8 KiB … 256 MiB doubling, like ``-b 8K -e 256M -f 2 -w 5 -n 20``.
FULL = Plan(
    copy_sizes=size_sweep(8 * KIB, 256 * MIB, 2),
    copy_warmup=5,
    copy_iters=20,
    peer_size=64 * MIB,
    peer_iters=20,
    latency_size=8,
    latency_iters=200,
    allreduce_sizes=size_sweep(8 * KIB, 256 * MIB, 2),
    allreduce_warmup=5,
    allreduce_iters=20,
)

#: ``--quick``: four copy sizes (factor 16), few iterations; finishes within 15 s on 8 GPUs
#: (16 copy series of ~0.3 GiB each, 56 pairs, a 4-size all-reduce).
QUICK = Plan(
    copy_sizes=size_sweep(64 * KIB, 256 * MIB, 16),
    copy_warmup=1,
    copy_iters=5,
    peer_size=32 * MIB,
    peer_iters=5,
    latency_size=8,
    latency_iters=50,
    allreduce_sizes=size_sweep(1 * MIB, 64 * MIB, 8),
    allreduce_warmup=1,
    allreduce_iters=5,
)


def human_bytes(size: int) -> str:
    """``8K``, ``1M``, ``256M`` (powers of two), as nccl-tests' size arguments read."""
    for unit, scale in (("G", 1 << 30), ("M", MIB), ("K", KIB)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return f"{size}B"
