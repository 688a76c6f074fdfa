"""Checked reads of the loosely typed values in trace files: every helper returns a value of
the expected type and range or raises :class:`BadRecord`, which the parsers count as one
skipped record. Nothing here trusts a size, a nesting depth or a list length it is handed."""

from __future__ import annotations

import math
from collections.abc import Sequence

from nodescope.collectives.model import dtype_bytes

#: Larger than any tensor or byte count a real job has (2^62 bytes is 4 EiB), small enough
#: that sums of a few million of them stay exact integers.
MAX_COUNT = 1 << 62
#: Timestamps past the year 2200 in nanoseconds are not from a clock.
MAX_NS = 7_300_000_000 * 1_000_000_000


class BadRecord(ValueError):
    """One event or entry that cannot be read; the file's other records still count."""


def integer(value: object, *, low: int = 0, high: int = MAX_COUNT) -> int:
    """An integer in [low, high]: a JSON integer, or a float or decimal string holding one."""
    if isinstance(value, bool):
        raise BadRecord("a boolean where a number belongs")
    if isinstance(value, str) and 0 < len(value) <= 24:
        try:
            value = int(value.strip())
        except ValueError:
            raise BadRecord("not an integer") from None
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise BadRecord("not an integer")
        value = int(value)
    if not isinstance(value, int) or not low <= value <= high:
        raise BadRecord("an integer out of range")
    return value


def number(value: object, *, low: float = 0.0, high: float = float(MAX_NS)) -> float:
    """A finite number in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRecord("not a number")
    result = float(value)
    if not math.isfinite(result) or not low <= result <= high:
        raise BadRecord("a number out of range")
    return result


def text(value: object, *, limit: int = 200) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise BadRecord("not a short string")
    return value


def int_list(value: object, limit: int) -> tuple[int, ...] | None:
    """A list of non-negative integers, given as a JSON list or as the profiler's string
    ``"[1, 2, 3]"``. None when the profiler truncated it (``"[1, 2, ...]"``: past 30 entries
    only the first 30 are written) or it is absent; an empty list is ``()``."""
    if value is None:
        return None
    if isinstance(value, str):
        body = value.strip()
        if len(body) > limit * 24 + 2 or not (body.startswith("[") and body.endswith("]")):
            raise BadRecord("not a list")
        inner = body[1:-1].strip()
        if not inner:
            return ()
        parts = [p.strip() for p in inner.split(",")]
        if parts[-1] == "...":
            return None
        if len(parts) > limit:
            raise BadRecord("a list past the cap")
        return tuple(integer(p) for p in parts)
    if isinstance(value, list):
        if len(value) > limit:
            raise BadRecord("a list past the cap")
        return tuple(integer(v) for v in value)
    raise BadRecord("not a list")


def numel(dims: object, limit: int, depth: int = 0) -> int:
    """Elements of a tensor shape (``[4, 8]``), a tensor list's shapes (``[[4], [8]]``) or a
    list of tensor lists, summed. Walks at most ``limit`` entries in all and three levels, so
    a shape list that shares its sub-lists (a pickle can) costs no more than a flat one."""
    budget = [limit]
    return _numel(dims, budget, depth)


def _numel(dims: object, budget: list[int], depth: int) -> int:
    if not isinstance(dims, list | tuple) or depth > 3:
        raise BadRecord("not a shape")
    budget[0] -= len(dims) + 1
    if budget[0] < 0:
        raise BadRecord("a shape past the cap")
    if all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        product = 1
        for d in dims:
            product *= integer(d)
            if product > MAX_COUNT:
                raise BadRecord("a shape too large")
        return product
    total = sum(_numel(d, budget, depth + 1) for d in dims)
    if total > MAX_COUNT:
        raise BadRecord("a shape too large")
    return total


def element_bytes(names: Sequence[object]) -> int | None:
    """The element size of the first dtype name among ``names`` that is one."""
    for name in names:
        size = dtype_bytes(name)
        if size is not None:
            return size
    return None
