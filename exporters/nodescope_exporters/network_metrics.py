"""Metrics of the network sources."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.metrics_core import Metric

from nodescope.model.snapshot import Snapshot


def families(snapshot: Snapshot) -> Iterable[Metric]:
    return ()
