"""Families an area builds from values that change only on a slow read, kept from one render
to the next while those values are the same objects.

Sources read what moves only on faults or retraining (NVLink states, peers and error
counters, among others) every ``slow_every`` runs and carry the very same objects in their
records in between (:mod:`nodescope.model.slow`). The families made of them are then the
same too: an area asks :class:`KeptFamilies` for them with the function that builds them
and the parts they are made of, and gets the families of the last render again while every
field of every part is the object it was (:class:`nodescope.memo.Memo`), so the area does
not build them again (the renderer still compares their values, and reuses their text). A
part that is a new object — a slow read, a record from a replay or a test — builds them
again: identity decides only whether the work is done, never what it gives.

An area declares that it keeps families with ``KEEPS_FAMILIES = True``; the collector then
hands it its own :class:`KeptFamilies` (``families(snapshot, kept)``), which the composition
root owns through the collector. What is kept is one set of families per building
function, module-level functions of the area: bounded by the code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from nodescope.memo import Memo
from nodescope_exporters.catalog import Metric

Part = TypeVar("Part", bound=tuple[object, ...])


class KeptFamilies:
    """The families of one area, kept per function that builds them (see the module
    docstring)."""

    __slots__ = ("_memos",)

    def __init__(self) -> None:
        self._memos: dict[Callable[..., Iterable[Metric]], Memo[tuple[Metric, ...]]] = {}

    def get(
        self, build: Callable[[Sequence[Part]], Iterable[Metric]], parts: Sequence[Part]
    ) -> tuple[Metric, ...]:
        """``build(parts)``, or what it gave last time when every field of every one of
        ``parts`` is the object it was then. ``build`` must read nothing but ``parts``."""
        memo = self._memos.get(build)
        if memo is None:
            memo = self._memos[build] = Memo()
        same = tuple(field for part in parts for field in part)
        return memo.get(same, len(parts), lambda: tuple(build(parts)))


def kept_or_built(
    kept: KeptFamilies | None,
    build: Callable[[Sequence[Part]], Iterable[Metric]],
    parts: Sequence[Part],
) -> tuple[Metric, ...]:
    """What ``kept`` gives, or ``build(parts)`` for a caller that keeps nothing (an area
    called on its own)."""
    if kept is None:
        return tuple(build(parts))
    return kept.get(build, parts)


__all__ = ["KeptFamilies", "kept_or_built"]
