"""An exporter area's families as the exposition shows them, through prometheus_client's own
renderer and parser, so a test reads what a scrape reads."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

#: (sample name, sorted labels) -> value.
SampleValues = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def exposition(families: Iterable[Any]) -> str:
    """The text prometheus_client renders for the area's families."""
    collected = list(families)

    class Area:
        def collect(self) -> Any:
            return collected

    registry = CollectorRegistry()
    registry.register(Area())  # type: ignore[arg-type]
    return generate_latest(registry).decode()


def sample_values(text: str) -> SampleValues:
    """Every sample of an exposition text by name and labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
