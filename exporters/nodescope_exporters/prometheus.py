"""The Prometheus exposition: a collector that only yields families built from the last
snapshot, rendered once per cycle into a cache that the HTTP server serves.

No IO happens in ``collect()`` and no state is carried between scrapes; the registry is our
own ``CollectorRegistry``, never the global one.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from nodescope.model.snapshot import Snapshot

log = logging.getLogger("nodescope.exporter")

#: Area modules, each exposing ``families(snapshot) -> Iterable[Metric]``. Order is the order
#: of families in /metrics.
AREAS: tuple[str, ...] = (
    "nodescope_exporters.self_metrics",
    "nodescope_exporters.pci_metrics",
    "nodescope_exporters.disk_metrics",
    "nodescope_exporters.network_metrics",
    "nodescope_exporters.cgroup_metrics",
    "nodescope_exporters.gpu_metrics",
    "nodescope_exporters.fabric_metrics",
    "nodescope_exporters.nvlink_metrics",
    "nodescope_exporters.alert_metrics",
)

FamilyBuilder = Callable[[Snapshot], Iterable[Metric]]


def load_areas(names: Iterable[str] = AREAS) -> list[FamilyBuilder]:
    """Import every area module (this also fills the metric catalogue)."""
    builders: list[FamilyBuilder] = []
    for name in names:
        module: ModuleType = importlib.import_module(name)
        builders.append(module.families)
    return builders


class SnapshotCollector(Collector):
    """Yields the families of the snapshot it was last given."""

    def __init__(self, builders: list[FamilyBuilder] | None = None) -> None:
        self._builders = builders if builders is not None else load_areas()
        self._snapshot: Snapshot | None = None
        self._failing: set[str] = set()

    def set_snapshot(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snapshot = self._snapshot
        if snapshot is None:
            return
        for build in self._builders:
            # An area that fails on odd data loses its own families for this cycle; the
            # others are still exported. Built whole first, so no half area is yielded.
            try:
                built = list(build(snapshot))
            except Exception as exc:
                area = getattr(build, "__module__", repr(build))
                if area not in self._failing:
                    log.error(
                        "area=%s state=failing error=%r", area, f"{type(exc).__name__}: {exc}"
                    )
                    self._failing.add(area)
                continue
            self._failing.discard(getattr(build, "__module__", repr(build)))
            yield from built


class MetricsCache:
    """The rendered exposition of the latest cycle, shared between the loop and the server."""

    def __init__(self, collector: SnapshotCollector | None = None) -> None:
        self.collector = collector or SnapshotCollector()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self._lock = threading.Lock()
        self._body = b""
        self._ready = False

    def update(self, snapshot: Snapshot) -> bytes:
        """Render ``snapshot`` once; scrapes are then served from the cached bytes."""
        self.collector.set_snapshot(snapshot)
        body = generate_latest(self.registry)
        with self._lock:
            self._body = body
            self._ready = True
        return body

    def body(self) -> tuple[bool, bytes]:
        with self._lock:
            return self._ready, self._body


def render(snapshot: Snapshot, builders: list[FamilyBuilder] | None = None) -> bytes:
    """The exposition text of one snapshot (for tests, golden files and ``--once``)."""
    return MetricsCache(SnapshotCollector(builders)).update(snapshot)
