"""When the slowly-changing values of a record were read, and what the read before found.

A source that reads its fault counters (NVLink and InfiniBand error counters, PCIe replays)
only every ``slow_every`` runs carries the last values in its records in between. Two
consecutive records then usually hold the same values, and the one record after a slow read
holds the whole change since the read before: rates of those counters taken between
consecutive records would be zero nine times and ten times too high once. A record therefore
says when its slow values were read (:class:`SlowRead`) and holds the record of the slow read
before it, so that their change is taken over the span between the two reads, on every
record until the next one (:func:`slow_pair`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SlowRead(Generic[T]):
    """The slow read whose values a record carries: ``at`` on the source's clock (seconds),
    ``fresh`` when the record's own run made it. ``previous`` is the record of the slow read
    before (without its own :class:`SlowRead`, so records do not chain), made at
    ``previous_at``; both ``None`` until the source has read twice."""

    at: float
    fresh: bool
    previous: T | None = None
    previous_at: float | None = None


def slow_pair(
    previous: T, previous_slow: SlowRead[T] | None, current_slow: SlowRead[T] | None, seconds: float
) -> tuple[T, float] | None:
    """The record to take the slow counters' change against, and the seconds it spans, for a
    record with ``current_slow`` whose predecessor (``seconds`` before) is ``previous``.

    When both records made their own slow read (every run reads everything), or the record
    says nothing of slow reads, that is the predecessor over the measured ``seconds``, as for
    any other counter. Otherwise it is the record of the slow read before the one carried,
    over the span between the two reads; ``None`` before there have been two reads.
    """
    if current_slow is None or (
        current_slow.fresh and previous_slow is not None and previous_slow.fresh
    ):
        return previous, seconds
    if current_slow.previous is None or current_slow.previous_at is None:
        return None
    span = current_slow.at - current_slow.previous_at
    if span <= 0:  # a clock that went back (a wall clock set by hand)
        return None
    return current_slow.previous, span


class SlowReads(Generic[T]):
    """A source's memory of its last slow read: what to attach to each record it returns."""

    def __init__(self) -> None:
        self._last: T | None = None
        self._last_at: float | None = None
        self._carried: SlowRead[T] | None = None

    def read(self, record: T, at: float) -> SlowRead[T]:
        """A slow read at ``at`` produced ``record`` (which must not hold a :class:`SlowRead`
        itself): the :class:`SlowRead` for the record returned now."""
        fresh = SlowRead(at, True, self._last, self._last_at)
        self._carried = SlowRead(at, False, self._last, self._last_at)
        self._last, self._last_at = record, at
        return fresh

    def carried(self) -> SlowRead[T] | None:
        """The :class:`SlowRead` of a run that read no slow values; ``None`` before any."""
        return self._carried

    def clear(self) -> None:
        self._last = self._last_at = self._carried = None
