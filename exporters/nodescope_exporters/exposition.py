"""The text exposition format (0.0.4) of our :class:`~nodescope_exporters.catalog.Family`.

The output is byte for byte what ``prometheus_client.exposition.generate_latest`` writes for
the equivalent prometheus_client families (the format: Prometheus' ``docs/instrumenting/
exposition_formats.md``; the reference: ``prometheus_client/exposition.py``), and a property
test holds it to that. prometheus_client itself is not imported: its package pulls in
``http.server``, ``email`` and ``ssl``, megabytes of a daemon that needs none of it.

A daemon renders the same few thousand series every second, so the renderer keeps what the
previous render made, per family (keyed by its name, type, help and label names):

* each series' line prefix (``name{labels} ``), kept while the series is exported: entries of
  series absent from a render are dropped, so what is kept is bounded by the live series;
* the family's whole text, reused while its label values and values are the previous
  render's (compared as lists and as the bits of their doubles, in C): error counters and
  info metrics then cost no formatting.

Names are escaped as ``generate_latest`` escapes them by default ("underscores"): a name
outside the legacy character set has each offending character replaced by ``_``.
"""

from __future__ import annotations

import math
import re
from array import array
from collections.abc import Iterable

from nodescope_exporters.catalog import Family

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_SPECIAL = {"inf": "+Inf", "-inf": "-Inf", "nan": "NaN"}


def go_float(value: float) -> str:
    """``floatToGoString``: Python's shortest repr, except infinities, NaN and large numbers,
    which Go writes differently (``+Inf``, ``NaN``, ``1.7e+14``)."""
    d = float(value)
    text = repr(d)
    if math.isfinite(d):
        dot = text.find(".")
        # Go switches to exponents sooner than Python.
        if d > 0 and dot > 6:
            mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
            return f"{mantissa}e+{dot - 1:02d}"
        return text
    if math.isnan(d):
        return "NaN"
    return "+Inf" if d > 0 else "-Inf"


def _go_text(text: str) -> str:
    """:func:`go_float` of a double given as its repr."""
    special = _SPECIAL.get(text)
    if special is not None:
        return special
    dot = text.find(".")
    if dot > 6 and text[0] != "-":
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return text


def go_floats(values: Iterable[float]) -> list[str]:
    """:func:`go_float` of each value: ``repr`` in C, and Go's form only where it differs
    (infinities, NaN, and a dot after the 7th character: Go's exponents start at 1e+06)."""
    return _go_texts(list(map(repr, map(float, values))))


def _go_texts(texts: list[str]) -> list[str]:
    return [t if (len(t) < 9 or t.find(".") < 7) and t[-1] <= "9" else _go_text(t) for t in texts]


def _name(name: str, valid: re.Pattern[str], colon: bool) -> str:
    if not name or valid.fullmatch(name):
        return name
    return "".join(
        c
        if (
            c.isascii() and (c.isalpha() or c == "_" or (colon and c == ":") or (i and c.isdigit()))
        )
        else "_"
        for i, c in enumerate(name)
    )


def _label_value(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


def _header(family: Family) -> str:
    name = _name(family.sample_name, _METRIC_NAME, True)
    doc = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {doc}\n# TYPE {name} {family.type}\n"


def _prefix(name: str, label_names: tuple[str, ...], values: tuple[str, ...]) -> str:
    """``name{labels} ``: the labels as prometheus_client's sample has them (a dict of the
    names zipped with the values), sorted by name."""
    labels = dict(zip(label_names, values, strict=False))
    if not labels:
        return name + " "
    inner = ",".join(
        f'{_name(k, _LABEL_NAME, False)}="{_label_value(v)}"' for k, v in sorted(labels.items())
    )
    return f"{name}{{{inner}}} "


_Key = tuple[str, str, str, tuple[str, ...]]


class _Kept:
    """What a family's previous render made: enough to tell whether it is the same again,
    its series' line prefixes, and its text."""

    __slots__ = ("bits", "header", "label_values", "prefixes", "text", "timestamps")

    def __init__(
        self,
        header: str,
        label_values: list[tuple[str, ...]],
        prefixes: list[str],
        bits: bytes,
        timestamps: dict[int, float] | None,
        text: bytes,
    ) -> None:
        self.header = header
        self.label_values = label_values
        self.prefixes = prefixes
        self.bits = bits
        self.timestamps = timestamps
        self.text = text


class TextRenderer:
    """Renders families to the text format, reusing what the previous render made (see the
    module docstring). One renderer per cache; not thread-safe."""

    def __init__(self) -> None:
        self._kept: dict[_Key | tuple[_Key, int], _Kept] = {}

    def render(self, families: Iterable[Family]) -> bytes:
        old = self._kept
        kept: dict[_Key | tuple[_Key, int], _Kept] = {}
        out: list[bytes] = []
        for family in families:
            family_key: _Key = (
                family.name,
                family.type,
                family.documentation,
                family.label_names,
            )
            key: _Key | tuple[_Key, int] = family_key
            if key in kept:
                # The same family twice (generate_latest writes both): kept apart.
                key = (family_key, len(kept))
            label_values = family.label_values
            # The doubles' bits, not the values: -0.0 == 0.0, but is written differently.
            doubles = array("d", family.values)
            bits = doubles.tobytes()
            timestamps = family.timestamps
            last = old.get(key)
            if last is not None and last.label_values == label_values:
                if last.bits == bits and last.timestamps == timestamps:
                    kept[key] = last
                    out.append(last.text)
                    continue
                header, label_values, prefixes = last.header, last.label_values, last.prefixes
            else:
                header = _header(family) if last is None else last.header
                known = (
                    {} if last is None else dict(zip(last.label_values, last.prefixes, strict=True))
                )
                name = _name(family.sample_name, _METRIC_NAME, True)
                names = family.label_names
                prefixes = [known.get(lv) or _prefix(name, names, lv) for lv in label_values]
                # A copy: what is compared next time must not change with the family.
                label_values = list(label_values)
            if prefixes:
                lines = list(map(str.__add__, prefixes, _go_texts(list(map(repr, doubles)))))
                if timestamps is not None:
                    for i, ts in timestamps.items():
                        # Milliseconds, as generate_latest writes them.
                        lines[i] += f" {int(float(ts) * 1000):d}"
                text = (header + "\n".join(lines) + "\n").encode()
            else:
                text = header.encode()
            kept[key] = _Kept(
                header,
                label_values,
                prefixes,
                bits,
                None if timestamps is None else dict(timestamps),
                text,
            )
            out.append(text)
        self._kept = kept
        return b"".join(out)


__all__ = ["TextRenderer", "go_float", "go_floats"]
