"""Declaring the keys of a settings table: :func:`option` and :func:`about` attach a key's
help and check (:class:`Range`, :class:`OneOf`, …) to a dataclass field, :func:`options_of`
reads them back as :class:`Option` rows.

The configuration (:mod:`nodescope.config`) validates the file and writes its documents from
these declarations; a source declares the keys of its ``[sources.<name>]`` table with them in
its own module, so this module depends on nothing of nodescope's.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: What an option's check says of a value: ``None`` when it is accepted, else the problem.
Check = Callable[[Any], str | None]


def display(text: str, limit: int = 80) -> str:
    """``text`` on one line and at most ``limit`` characters: keys and values come from the
    file, and an error message stays one line however they were written."""
    cut = text if len(text) <= limit else text[:limit] + "…"
    return "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in cut
    )


def number_text(number: float) -> str:
    """A bound as an operator writes it: ``3600``, ``0.1``, ``1e13``."""
    if abs(number) >= 1e7:
        return f"{number:.0e}".replace("e+", "e")
    if number == int(number):
        return str(int(number))
    return repr(number)


def value_text(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    return display(repr(value))


@dataclass(frozen=True, slots=True)
class Range:
    """The numbers an option accepts: finite, from ``low`` to ``high``, with ``low`` itself
    refused when ``low_open`` (a ratio or timeout of 0 would mean nothing). The error message
    and the configuration reference both name the bounds."""

    low: float
    high: float
    low_open: bool = False
    integer: bool = False

    @property
    def allowed(self) -> str:
        low, high = number_text(self.low), number_text(self.high)
        what = "an integer" if self.integer else "a finite number"
        if self.low_open:
            return f"{what} above {low} and at most {high}"
        return f"{what} between {low} and {high}"

    def __call__(self, value: Any) -> str | None:
        # Compared as written: an integer too large for a float must give this message, not
        # an OverflowError from converting it.
        if isinstance(value, float) and not math.isfinite(value):
            ok = False
        else:
            above_low = value > self.low if self.low_open else value >= self.low
            ok = above_low and value <= self.high
        return None if ok else f"must be {self.allowed}, not {value_text(value)}"


@dataclass(frozen=True, slots=True)
class IntList:
    """A list of integers, each within bounds, and not too long."""

    low: int
    high: int
    max_items: int

    @property
    def allowed(self) -> str:
        return f"at most {self.max_items} integers between {self.low} and {self.high}"

    def __call__(self, value: Any) -> str | None:
        ok = len(value) <= self.max_items and all(
            isinstance(v, int) and not isinstance(v, bool) and self.low <= v <= self.high
            for v in value
        )
        return None if ok else f"must be a list of {self.allowed}"


@dataclass(frozen=True, slots=True)
class NameList:
    """A list of names (letters, digits, ``_`` and ``-``), each short, and not too many."""

    max_items: int
    max_length: int

    @property
    def allowed(self) -> str:
        return f"at most {self.max_items} names of 1 to {self.max_length} letters, digits, _ and -"

    def __call__(self, value: Any) -> str | None:
        ok = len(value) <= self.max_items and all(
            isinstance(v, str) and len(v) <= self.max_length and NAME_PATTERN.fullmatch(v)
            for v in value
        )
        return None if ok else f"must be a list of {self.allowed}"


@dataclass(frozen=True, slots=True)
class OneOf:
    """One word of a fixed list."""

    words: tuple[str, ...]

    @property
    def allowed(self) -> str:
        return "one of " + ", ".join(self.words)

    def __call__(self, value: Any) -> str | None:
        return None if value in self.words else f"must be {self.allowed}, not {display(value)!r}"


#: A kernel module's name, as ``required_modules`` lists them.
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]+")


@dataclass(frozen=True, slots=True)
class Option:
    """One key of a table as the validator and the generated documents see it, derived from
    its field by :func:`options_of`. ``kind`` is the TOML type (``list`` for a tuple field)."""

    key: str
    kind: type
    default: Any
    help: str
    check: Check | None = None


@dataclass(frozen=True, slots=True)
class _About:
    """What a field's metadata adds to its annotation and default."""

    help: str
    check: Check | None
    #: The default the documents name when the field's own default is ``None`` for "unset".
    unset_means: Any


_ABOUT = "nodescope.options.option"


def about(help: str, check: Check | None = None, *, unset_means: Any = None) -> dict[str, Any]:
    """The metadata that makes a field a key of the config file: the help the sample and the
    reference show, and the check every value from a file must pass. ``unset_means`` is what
    an unset key stands for where the field's default is ``None`` because the value comes
    from elsewhere (an alert rule falls back to the kind's built-in rule)."""
    return {_ABOUT: _About(help, check, unset_means)}


def option(default: Any, help: str, check: Check | None = None, *, unset_means: Any = None) -> Any:
    """A key of the config file with its default: ``field(default=..., metadata=about(...))``.
    A key without a default of its own is declared with :func:`dataclasses.field` and
    :func:`about`, so that mypy knows it must be given."""
    return field(default=default, metadata=about(help, check, unset_means=unset_means))


def _toml_kind(hint: Any) -> type:
    """The TOML type of a field's annotation: ``float | None`` is a float that may be unset,
    a tuple is written as an array."""
    if isinstance(hint, types.UnionType):
        (hint,) = (arg for arg in typing.get_args(hint) if arg is not type(None))
    origin = typing.get_origin(hint) or hint
    return list if origin is tuple else typing.cast(type, origin)


def options_of(settings: type) -> tuple[Option, ...]:
    """The options a settings class declares, in field order; fields without :func:`about`
    metadata (nested tables, the typed detector sections) are not options."""
    hints = typing.get_type_hints(settings)
    found: list[Option] = []
    for f in dataclasses.fields(settings):
        described = f.metadata.get(_ABOUT)
        if described is None:
            continue
        default = None if f.default is dataclasses.MISSING else f.default
        if default is None:
            default = described.unset_means
        kind = _toml_kind(hints[f.name])
        found.append(Option(f.name, kind, default, described.help, described.check))
    return tuple(found)


__all__ = [
    "NAME_PATTERN",
    "Check",
    "IntList",
    "NameList",
    "OneOf",
    "Option",
    "Range",
    "about",
    "display",
    "number_text",
    "option",
    "options_of",
    "value_text",
]
