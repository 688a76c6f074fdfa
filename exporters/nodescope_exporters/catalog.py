"""The catalogue of every metric nodescope exports: name, type, labels, help.

One table for the whole exporter, so the README's metrics reference is generated from the
code and a metric cannot be exported without a HELP text. Area modules declare their
metrics here with :func:`metric` at import time and build families with :meth:`MetricSpec.family`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

Kind = Literal["gauge", "counter", "info"]


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...]
    area: str

    def family(self) -> GaugeMetricFamily | CounterMetricFamily:
        """An empty family to fill with ``add_metric(label_values, value)``.

        Info metrics are gauges of value 1 whose labels carry the information, the form that
        joins with ``* on(...) group_left`` in PromQL.
        """
        if self.kind == "counter":
            # prometheus-client appends _total itself.
            return CounterMetricFamily(
                self.name.removesuffix("_total"), self.help, labels=self.labels
            )
        return GaugeMetricFamily(self.name, self.help, labels=self.labels)


CATALOG: dict[str, MetricSpec] = {}


def metric(
    name: str, kind: Kind, help: str, labels: tuple[str, ...] = (), *, area: str
) -> MetricSpec:
    """Declare a metric. Names follow Prometheus conventions: ``nodescope_`` prefix, the unit
    in the name, ``_total`` on counters, ``_info`` on info metrics."""
    if not name.startswith("nodescope_"):
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
