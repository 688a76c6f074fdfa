"""The catalogue of every metric nodescope exports: name, type, labels, help.

One table for the whole exporter, so the README's metrics reference is generated from the
code and a metric cannot be exported without a HELP text. Area modules declare their
metrics here with :func:`metric` at import time and build families with :meth:`MetricSpec.family`.

A family is our own small :class:`Family`, not prometheus_client's: the daemon builds
thousands of series a second, and a ``Sample`` named tuple with a label dict per series was
a third of the exposition's cost. Its attributes mirror prometheus_client's
``GaugeMetricFamily``/``CounterMetricFamily`` (``name``, ``type``, ``documentation``,
``samples``), so tests can still hand families to ``generate_latest``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from nodescope.model.rows import Rows

Kind = Literal["gauge", "counter", "info"]


class Sample(NamedTuple):
    """One series as prometheus_client's ``Sample`` has it (the fields its renderer reads)."""

    name: str
    labels: dict[str, str]
    value: float
    timestamp: float | None = None


class Family:
    """The series of one metric: label values and values in parallel lists.

    ``name`` is the family name as prometheus_client has it: a counter's without ``_total``
    (its samples carry the suffix). ``timestamps`` (series index to timestamp) stays ``None``
    until a series is given one.
    """

    __slots__ = (
        "documentation",
        "label_names",
        "label_values",
        "name",
        "timestamps",
        "type",
        "values",
    )

    def __init__(
        self, name: str, kind: Literal["gauge", "counter"], help: str, labels: tuple[str, ...]
    ) -> None:
        self.name = name
        self.type: Literal["gauge", "counter"] = kind
        self.documentation = help
        self.label_names = labels
        self.label_values: list[tuple[str, ...]] = []
        self.values: list[float] = []
        self.timestamps: dict[int, float] | None = None

    def add_metric(
        self, labels: Sequence[str], value: float, timestamp: float | None = None
    ) -> None:
        """One series: its label values in the order of the label names, and its value."""
        self.label_values.append(tuple(labels))
        self.values.append(value)
        if timestamp is not None:
            if self.timestamps is None:
                self.timestamps = {}
            self.timestamps[len(self.values) - 1] = timestamp

    def add_metrics(
        self, label_values: Sequence[tuple[str, ...]], values: Sequence[float | None]
    ) -> None:
        """Many series at once, without timestamps: ``label_values[i]`` (label values in the
        order of the label names) and ``values[i]`` are one series; a value ``None`` (not
        known, not read) adds none."""
        if len(label_values) != len(values):
            raise ValueError(f"{len(label_values)} label sets for {len(values)} values")
        self.label_values.extend(
            [labels for labels, v in zip(label_values, values, strict=True) if v is not None]
        )
        self.values.extend([float(v) for v in values if v is not None])

    @property
    def sample_name(self) -> str:
        """The name each series is written under."""
        return self.name + "_total" if self.type == "counter" else self.name

    @property
    def samples(self) -> Samples:
        """The series as prometheus_client samples, made on demand (tests, checks)."""
        return Samples(self)

    def __repr__(self) -> str:
        return f"Family({self.name!r}, {self.type!r}, {len(self.values)} series)"


class Samples(Rows[Sample]):
    """A family's series as :class:`Sample` tuples; only its length is free to ask."""

    __slots__ = ("_family",)

    def __init__(self, family: Family) -> None:
        self._family = family

    def __len__(self) -> int:
        return len(self._family.values)

    def row(self, index: int) -> Sample:
        f = self._family
        value = f.values[index]
        index %= len(f.values)
        timestamp = None if f.timestamps is None else f.timestamps.get(index)
        labels = dict(zip(f.label_names, f.label_values[index], strict=False))
        return Sample(f.sample_name, labels, value, timestamp)


#: What an area module yields (the name areas annotate with).
Metric = Family


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...]
    area: str

    def family(self) -> Family:
        """An empty family to fill with ``add_metric(label_values, value)``.

        Info metrics are gauges of value 1 whose labels carry the information, the form that
        joins with ``* on(...) group_left`` in PromQL.
        """
        if self.kind == "counter":
            # Named as prometheus_client names a counter family: the samples add _total.
            return Family(self.name.removesuffix("_total"), "counter", self.help, self.labels)
        return Family(self.name, "gauge", self.help, self.labels)


CATALOG: dict[str, MetricSpec] = {}

#: The names Prometheus's client libraries give a process's own figures, unprefixed so that
#: one dashboard or alert serves every exporter: the self-metrics use them as they are.
PROCESS_COLLECTOR_NAMES = frozenset(
    {
        "process_cpu_seconds_total",
        "process_max_fds",
        "process_open_fds",
        "process_resident_memory_bytes",
        "process_start_time_seconds",
        "process_virtual_memory_bytes",
    }
)


def metric(
    name: str, kind: Kind, help: str, labels: tuple[str, ...] = (), *, area: str
) -> MetricSpec:
    """Declare a metric. Names follow Prometheus conventions: ``nodescope_`` prefix, the unit
    in the name, ``_total`` on counters, ``_info`` on info metrics; the process collector's
    names (:data:`PROCESS_COLLECTOR_NAMES`) are the one exception to the prefix."""
    if not name.startswith("nodescope_") and name not in PROCESS_COLLECTOR_NAMES:
        raise ValueError(f"metric {name} lacks the nodescope_ prefix")
    if kind == "counter" and not name.endswith("_total"):
        raise ValueError(f"counter {name} must end in _total")
    if kind == "info" and not name.endswith("_info"):
        raise ValueError(f"info metric {name} must end in _info")
    existing = CATALOG.get(name)
    spec = MetricSpec(name, kind, help, tuple(labels), area)
    if existing is not None and existing != spec:
        raise ValueError(f"metric {name} declared twice with different definitions")
    CATALOG[name] = spec
    return spec
