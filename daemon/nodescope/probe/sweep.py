"""Size sweeps and bandwidth formulas, as nccl-tests defines them.

nccl-tests (``src/common.cu``, ``doc/PERFORMANCE.md``): ``-b`` the first size, ``-e`` the
last, ``-f`` the factor between two sizes; ``algbw = size / time``; for an all-reduce over
``n`` ranks ``busbw = algbw × 2(n−1)/n``, because each rank sends and receives
``2(n−1)/n`` of the buffer in a ring, so busbw is comparable with a link's peak rate.

Also the ``--sizes`` list (:func:`parse_sizes`) and the small-message latency figure
(:func:`latency_figure`). Pure: no torch here.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from nodescope.model.probe import AllReduceLatency

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30


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
    #: the all-reduce's small messages, each all-reduce timed on its own: the latency floor
    allreduce_latency_sizes: tuple[int, ...] = ()
    allreduce_latency_warmup: int = 0
    allreduce_latency_iters: int = 0


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
    # 8 B … 4 KiB doubling; 1000 timings put the p99 on the tenth slowest, not on one outlier.
    allreduce_latency_sizes=size_sweep(8, 4 * KIB, 2),
    allreduce_latency_warmup=20,
    allreduce_latency_iters=1000,
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
    allreduce_latency_sizes=size_sweep(8, 4 * KIB, 8),
    allreduce_latency_warmup=10,
    allreduce_latency_iters=200,
)


def human_bytes(size: int) -> str:
    """``8K``, ``1M``, ``256M`` (powers of two), as nccl-tests' size arguments read."""
    for unit, scale in (("G", 1 << 30), ("M", MIB), ("K", KIB)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return f"{size}B"


# --- custom sizes (--sizes) -------------------------------------------------------------------

#: Bounds of ``--sizes``: each size is a whole number of float32 elements (the all-reduce sums
#: float32, nccl-tests' default type), at most 1 GiB (the copy sweep holds one host buffer and
#: one device buffer of the largest size per device), at most 32 of them (the full sweep has 16).
MIN_SIZE = 4
MAX_SIZE = GIB
MAX_SIZES = 32
#: The largest size whose all-reduce counts as a small message for the latency figure.
LATENCY_MAX_SIZE = 4 * KIB

_UNITS = {"": 1, "B": 1, "K": KIB, "M": MIB, "G": GIB}
_SIZE = re.compile(r"([0-9]{1,10})([KMGB]?)", re.IGNORECASE)


def check_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    """``sizes`` ascending, or ``ValueError`` saying which one breaks which bound."""
    if not sizes:
        raise ValueError("no size given")
    if len(sizes) > MAX_SIZES:
        raise ValueError(f"{len(sizes)} sizes; at most {MAX_SIZES}")
    seen: set[int] = set()
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int):
            raise ValueError(f"{ascii(size)[:40]} is not a whole number of bytes")
        if not MIN_SIZE <= size <= MAX_SIZE:
            raise ValueError(
                f"{human_bytes(size) if size > 0 else size} is outside"
                f" {human_bytes(MIN_SIZE)}..{human_bytes(MAX_SIZE)}"
            )
        if size % MIN_SIZE:
            raise ValueError(
                f"{size} bytes is not a multiple of {MIN_SIZE} (the all-reduce sums float32)"
            )
        if size in seen:
            raise ValueError(f"{human_bytes(size)} is given twice")
        seen.add(size)
    return tuple(sorted(sizes))


def parse_sizes(text: str) -> tuple[int, ...]:
    """``4K,64K,1M,256M`` to bytes, ascending: a comma-separated list of whole numbers with an
    optional unit K, M or G (powers of 1024, as nccl-tests' ``-b``/``-e`` read them) or B.
    Anything else, and sizes out of bounds (:func:`check_sizes`), raise ``ValueError``."""
    if len(text) > 1024:
        raise ValueError("the list is longer than 1024 characters")
    items = [item.strip() for item in text.split(",")]
    sizes = []
    for item in items:
        match = _SIZE.fullmatch(item)
        if match is None:
            shown = item if item.isprintable() else ascii(item)
            raise ValueError(
                f"{shown!r} is not a size (a whole number with an optional K, M or G: 4K, 1M)"
            )
        sizes.append(int(match.group(1)) * _UNITS[match.group(2).upper()])
    return check_sizes(sizes)


def format_sizes(sizes: Sequence[int]) -> str:
    """The ``--sizes`` argument that :func:`parse_sizes` reads back as ``sizes``."""
    return ",".join(human_bytes(s).removesuffix("B") for s in sizes)


def with_sizes(plan: Plan, sizes: Sequence[int]) -> Plan:
    """``plan`` measuring the copy sweep and the all-reduce at ``sizes`` instead of its own.
    The latency figure takes those of ``sizes`` that are small messages (up to
    :data:`LATENCY_MAX_SIZE`); when there are none it keeps the plan's own small sizes, so a
    list of large sizes still reports the latency floor."""
    chosen = check_sizes(sizes)
    small = tuple(s for s in chosen if s <= LATENCY_MAX_SIZE)
    return replace(
        plan,
        copy_sizes=chosen,
        allreduce_sizes=chosen,
        allreduce_latency_sizes=small or plan.allreduce_latency_sizes,
    )


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q ≤ 100): the smallest value that at least
    ``q`` % of the values do not exceed, always one of the values (no interpolation between
    two timings that were never measured)."""
    if not values:
        raise ValueError("no values")
    if not 0 < q <= 100:
        raise ValueError(f"percentile {q} is outside (0, 100]")
    ordered = sorted(values)
    rank = math.ceil(q / 100 * len(ordered))
    return ordered[max(rank, 1) - 1]


def latency_figure(size: int, timings: Sequence[float]) -> AllReduceLatency:
    """The small-message figure of ``timings`` (seconds, one per all-reduce of ``size``
    bytes): fastest, median and 99th percentile."""
    if not timings:
        raise ValueError(f"no timings for {size} bytes")
    if any(not math.isfinite(t) or t < 0 for t in timings):
        raise ValueError(f"a timing of {size} bytes is negative or not finite")
    # Imported here: only the probe process measures; the daemon imports this module for the
    # size list and would load statistics, fractions and decimal for nothing.
    import statistics

    return AllReduceLatency(
        size_bytes=size,
        iterations=len(timings),
        min_seconds=min(timings),
        median_seconds=statistics.median(timings),
        p99_seconds=percentile(timings, 99),
    )


def sizes_argument(text: str) -> tuple[int, ...]:
    """``--sizes`` for argparse: a bad list is a usage error (exit status 2) naming why."""
    try:
        return parse_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}") from None


SIZES_HELP = (
    "comma-separated message sizes for the copy sweep and the all-reduce, e.g."
    f" 4K,64K,1M,256M (units K, M, G: powers of 1024; {MIN_SIZE} B to 1G, multiples of"
    f" {MIN_SIZE}, at most {MAX_SIZES}); those up to 4K also give the all-reduce latency"
)
