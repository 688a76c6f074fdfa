"""A cache of one result, keyed on the identity of the immutable records it was made from.

A snapshot's samples are immutable, and a source that did not run in a cycle hands the very
same sample object on to the next snapshot; most inputs of the analysis step come from
sources that run every 5 to 30 s. "The same objects as last time" then means "the same
answer", and an identity test costs nothing whatever the size of the record, where an
equality test of a job table or a PCI topology would walk all of it. Small values (a
threshold, a few GPU indices) are compared by equality instead.

Nothing is read from the clock or the system: a :class:`Memo` never changes what a pure
function returns, only whether it runs. It keeps its last inputs alive until the next miss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


def _identical(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


class Memo(Generic[T]):
    """The last result of one computation and the inputs it was computed from.

    ``get(same, equal, compute)`` returns the stored result when every object of ``same`` is
    the object stored with it and ``equal`` equals the stored ``equal``; otherwise it calls
    ``compute()``, stores the result with these inputs and returns it. ``compute`` must be a
    pure function of exactly those inputs. The entry is one tuple, replaced whole, so a
    reader on another thread sees either the old entry or the new one.
    """

    __slots__ = ("_entry", "hits", "misses")

    def __init__(self) -> None:
        self._entry: tuple[tuple[object, ...], object, T] | None = None
        self.hits = 0
        self.misses = 0

    def get(self, same: tuple[object, ...], equal: object, compute: Callable[[], T]) -> T:
        entry = self._entry
        if entry is not None and _identical(entry[0], same) and entry[1] == equal:
            self.hits += 1
            return entry[2]
        self.misses += 1
        value = compute()
        self._entry = (same, equal, value)
        return value

    def clear(self) -> None:
        self._entry = None
