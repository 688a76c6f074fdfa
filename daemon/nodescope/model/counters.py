"""Counter arithmetic: deltas and rates over measured time, wraps and resets in one place.

Every rate nodescope exports goes through :func:`counter_delta`, so the policy is uniform:

* ``cur >= prev``: the plain difference.
* ``cur < prev`` on a counter of known width whose drop is consistent with one wrap
  (the previous value sat in the upper half of the range): the wrapped difference. This is the
  case of 32-bit IB data counters, NVML's PCIe byte fields (197/198) and the ms fields of
  /proc/diskstats that wrap at 2^32.
* any other decrease: a reset (a driver reload, ``nvmlDeviceResetNvLinkErrorCounters``, a
  remount). The interval is discarded (``None``) rather than guessed.
"""

from __future__ import annotations

from collections.abc import Sequence


def counter_delta(prev: int, cur: int, bits: int | None = 64) -> int | None:
    """The increase of a monotonic counter from ``prev`` to ``cur``, or ``None`` on a reset."""
    if prev < 0 or cur < 0:
        return None
    if cur >= prev:
        return cur - prev
    if bits is None:
        return None
    modulus = 1 << bits
    if prev >= modulus or cur >= modulus:
        return None
    if prev >= modulus // 2:
        return cur + modulus - prev
    return None


def counter_rate(prev: int, cur: int, seconds: float, bits: int | None = 64) -> float | None:
    """Per-second rate of a counter over ``seconds``; ``None`` when it cannot be known."""
    if seconds <= 0:
        return None
    delta = counter_delta(prev, cur, bits)
    if delta is None:
        return None
    return delta / seconds


def column_rates(
    prev: Sequence[int], cur: Sequence[int], seconds: float, bits: int | None = 64
) -> tuple[float | None, ...]:
    """:func:`counter_rate` of each pair of a column of counters read twice, the two reads in
    the same order. The plain increase is computed in one pass; a wrap, a reset or a negative
    reading goes through :func:`counter_rate`, so the policy is the same."""
    if seconds <= 0:
        return (None,) * len(cur)
    return tuple(
        [
            (b - a) / seconds if b >= a >= 0 else counter_rate(a, b, seconds, bits)
            for a, b in zip(prev, cur, strict=True)
        ]
    )
