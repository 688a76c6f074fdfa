"""Records held as columns, read as a sequence of rows made on demand.

A source that reports hundreds of like elements every second (NVLinks, their counters) holds
them as one tuple per field: readers of every element read a column, and the few readers of
one element or of each in turn get a row record from :class:`Rows`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar, overload

R = TypeVar("R")


class Rows(Sequence[R]):
    """A sequence whose item ``i`` is :meth:`row` ``(i)``, made when it is read; a subclass
    gives :meth:`row` and ``__len__``. Negative indices count from the end; an index out of
    range raises ``IndexError``, as the columns' tuples do."""

    __slots__ = ()

    def row(self, index: int) -> R:
        raise NotImplementedError

    @overload
    def __getitem__(self, index: int) -> R: ...
    @overload
    def __getitem__(self, index: slice) -> list[R]: ...
    def __getitem__(self, index: int | slice) -> R | list[R]:
        if isinstance(index, slice):
            return [self.row(i) for i in range(*index.indices(len(self)))]
        return self.row(index)

    def __iter__(self) -> Iterator[R]:
        return (self.row(i) for i in range(len(self)))
