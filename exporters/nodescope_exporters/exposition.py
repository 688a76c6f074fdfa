"""The text exposition format (0.0.4), rendered faster than ``generate_latest``.

The output is byte for byte what ``prometheus_client.exposition.generate_latest`` writes for
the same families (the format: Prometheus' ``docs/instrumenting/exposition_formats.md``; the
reference: ``prometheus_client/exposition.py``), and a test holds it to that. What changes is
the cost of a daemon rendering the same few thousand series every second:

* metric and label names are checked and escaped once per name (and per set of label names)
  instead of once per sample, and label values only when they hold a character to escape;
* values take a short path to Go's float formatting for the common case;
* a family object handed in again (an area that reused its families because its inputs did
  not change, :class:`~nodescope_exporters.prometheus.SnapshotCollector`) reuses its text.

Nothing of a cycle's series is kept (families are held by weak reference): a cache of
prefixes or lines would be faster still, but costs megabytes of a daemon's memory budget.
"""

from __future__ import annotations

import math
import re
import weakref
from collections.abc import Iterable

from prometheus_client.metrics_core import Metric

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
#: OpenMetrics samples that generate_latest moves to a gauge family of their own at the end.
_OM_SUFFIXES = ("_created", "_gsum", "_gcount")


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


def _name(name: str, valid: re.Pattern[str], colon: bool) -> str:
    # generate_latest's default escaping ("underscores"): a name outside the legacy
    # character set has each offending character replaced by "_".
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


def _metric_name(name: str) -> str:
    return _name(name, _METRIC_NAME, True)


def _label_value(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


def _header(metric: Metric) -> str:
    name, kind = metric.name, metric.type
    # The munging generate_latest does from OpenMetrics types into the text format.
    if kind == "counter":
        name += "_total"
    elif kind == "info":
        name += "_info"
        kind = "gauge"
    elif kind == "stateset":
        kind = "gauge"
    elif kind == "gaugehistogram":
        kind = "histogram"
    elif kind == "unknown":
        kind = "untyped"
    escaped = _metric_name(name)
    doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {escaped} {doc}\n# TYPE {escaped} {kind}\n"


_Layout = tuple[tuple[int, ...], tuple[str, ...]]


def _layout(keys: tuple[str, ...]) -> _Layout:
    """For a sample's label names in dict order: the order to write them in (sorted, as
    generate_latest does) and each one escaped with its ``="`` attached."""
    order = tuple(sorted(range(len(keys)), key=keys.__getitem__))
    return order, tuple(f'{_name(k, _LABEL_NAME, False)}="' for k in keys)


class TextRenderer:
    """Renders families to the text format. Keeps nothing of a cycle's series: only the
    text of families that are handed in again as the same object (held by weak reference)
    and the escaped forms of names and label name sets. One renderer per cache; not
    thread-safe."""

    def __init__(self) -> None:
        #: family object id -> (weak reference to it, its text), from the previous render
        self._families: dict[int, tuple[weakref.ref[Metric], str]] = {}
        self._headers: dict[tuple[str, str, str], str] = {}
        self._names: dict[str, str] = {}
        self._layouts: dict[tuple[str, ...], _Layout] = {}

    def render(self, metrics: Iterable[Metric]) -> bytes:
        old_families, families = self._families, {}
        old_headers, headers = self._headers, {}
        names, layouts = self._names, self._layouts
        out: list[str] = []
        for metric in metrics:
            seen = old_families.get(id(metric))
            if seen is not None and seen[0]() is metric:
                families[id(metric)] = seen
                out.append(seen[1])
                continue
            header_key = (metric.name, metric.type, metric.documentation)
            header = old_headers.get(header_key) or _header(metric)
            headers[header_key] = header
            text = [header]
            om_names = {metric.name + suffix: suffix for suffix in _OM_SUFFIXES}
            om_lines: dict[str, list[str]] = {}
            for s in metric.samples:
                name = names.get(s.name)
                if name is None:
                    name = names[s.name] = _metric_name(s.name)
                labels = s.labels
                if labels:
                    keys = tuple(labels)
                    layout = layouts.get(keys)
                    if layout is None:
                        layout = layouts[keys] = _layout(keys)
                    order, heads = layout
                    values = tuple(labels.values())
                    inner = ",".join([heads[j] + _label_value(values[j]) + '"' for j in order])
                    line = f"{name}{{{inner}}} {go_float(s.value)}"
                else:
                    line = f"{name} {go_float(s.value)}"
                if s.timestamp is not None:
                    # Milliseconds, as generate_latest writes them.
                    line += f" {int(float(s.timestamp) * 1000):d}"
                suffix = om_names.get(s.name)
                if suffix is None:
                    text.append(line)
                else:
                    om_lines.setdefault(suffix, []).append(line)
            for suffix, extra in sorted(om_lines.items()):
                escaped = _metric_name(metric.name + suffix)
                doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
                text.append(f"# HELP {escaped} {doc}\n# TYPE {escaped} gauge")
                text.extend(extra)
            joined = header + "\n".join(text[1:]) + "\n" if len(text) > 1 else header
            families[id(metric)] = (weakref.ref(metric), joined)
            out.append(joined)
        # Only families someone still holds can come back; the others' text goes now.
        self._families = {k: v for k, v in families.items() if v[0]() is not None}
        self._headers = headers
        if len(names) > 4 * len(headers) + 1024:
            # Names of series that are gone; the sets of label names are few and bounded.
            names.clear()
        return "".join(out).encode("utf-8")


__all__ = ["TextRenderer", "go_float"]
