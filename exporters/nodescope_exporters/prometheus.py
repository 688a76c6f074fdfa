"""The Prometheus exposition: a collector that only yields families built from the last
snapshot, rendered once per cycle into a cache that the HTTP server serves.

No IO happens in ``collect()`` and no state is carried between scrapes. Nothing here imports
prometheus_client (the daemon does not load it at all): the families are our own
(:mod:`nodescope_exporters.catalog`) and so is the renderer
(:mod:`nodescope_exporters.exposition`).
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import cast

from nodescope.memo import Memo
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.model.source_key import SourceKey
from nodescope_exporters.catalog import Metric
from nodescope_exporters.exposition import TextRenderer
from nodescope_exporters.kept import KeptFamilies

log = logging.getLogger("nodescope.exporter")

#: Where the area modules' families sit in /metrics, in this order. An area module is any
#: ``*_metrics`` module of this package, exposing ``families(snapshot) -> Iterable[Metric]``; one
#: not named here is loaded too, after these, in name order: a new source's area is exported
#: without a line here.
ORDER: tuple[str, ...] = (
    "self_metrics",
    "pci_metrics",
    "disk_metrics",
    "pressure_metrics",
    "network_metrics",
    "cgroup_metrics",
    "job_metrics",
    "collective_metrics",
    "gpu_metrics",
    "fabric_metrics",
    "nvlink_metrics",
    "probe_metrics",
    "alert_metrics",
    "event_metrics",
    "remediation_metrics",
)
_AREA_SUFFIX = "_metrics"


def area_modules(order: Iterable[str] = ORDER) -> tuple[str, ...]:
    """The full names of this package's area modules: those of ``order`` first, then the rest
    by name."""
    found = {
        info.name
        for info in pkgutil.iter_modules([str(Path(__file__).parent)])
        if info.name.endswith(_AREA_SUFFIX)
    }
    placed = [name for name in order if name in found]
    names = placed + sorted(found.difference(placed))
    return tuple(f"{__package__}.{name}" for name in names)


#: Every area module, in the order of /metrics.
AREAS: tuple[str, ...] = area_modules()

FamilyBuilder = Callable[[Snapshot], Iterable[Metric]]


def load_areas(names: Iterable[str] = AREAS) -> list[FamilyBuilder]:
    """Import every area module (this also fills the metric catalogue)."""
    builders: list[FamilyBuilder] = []
    for name in names:
        module: ModuleType = importlib.import_module(name)
        builders.append(module.families)
    return builders


def _area_declaration(build: FamilyBuilder, name: str) -> object:
    """What the area module whose ``families`` is ``build`` declares as ``name`` (``None``:
    nothing, or ``build`` is not an area's ``families``)."""
    module = sys.modules.get(getattr(build, "__module__", ""))
    return getattr(module, name, None) if getattr(module, "families", None) is build else None


def declared_inputs(build: FamilyBuilder) -> tuple[str, ...] | None:
    """The names of the sources an area module declares its families are made of
    (``INPUTS``, a tuple of :class:`~nodescope.model.source_key.SourceKey`), if any.

    An area that declares ``INPUTS`` is handed a snapshot that holds those sources' current
    and previous samples and nothing else (:func:`inputs_only`), so its families are a
    function of those samples by construction; they are then reused while those samples are
    the same objects.
    """
    inputs = _area_declaration(build, "INPUTS")
    if inputs is None:
        return None
    keys: tuple[SourceKey[object], ...] = tuple(cast(Iterable[SourceKey[object]], inputs))
    return tuple(key.name for key in keys)


def inputs_only(snapshot: Snapshot, names: tuple[str, ...]) -> Snapshot:
    """A snapshot with only the samples of the sources ``names`` and no cycle, clock, status,
    findings or alerts: what an area that declares its inputs may read."""
    return Snapshot(
        cycle=0,
        monotonic=0.0,
        wall_time=0.0,
        current={n: s for n in names if (s := snapshot.current.get(n)) is not None},
        previous={n: s for n in names if (s := snapshot.previous.get(n)) is not None},
    )


def keeps_families(build: FamilyBuilder) -> bool:
    """Whether an area module declares ``KEEPS_FAMILIES = True``: its ``families`` then takes
    a :class:`~nodescope_exporters.kept.KeptFamilies` of its own as a second argument."""
    return _area_declaration(build, "KEEPS_FAMILIES") is True


_InputsKey = tuple[SourceSample | None, ...]


def _build(build: FamilyBuilder, snapshot: Snapshot, kept: KeptFamilies | None) -> list[Metric]:
    if kept is None:
        return list(build(snapshot))
    return list(build(snapshot, kept))  # type: ignore[call-arg]


def _build_all(
    build: FamilyBuilder, snapshot: Snapshot, names: tuple[str, ...], kept: KeptFamilies | None
) -> list[Metric]:
    return _build(build, inputs_only(snapshot, names), kept)


class SnapshotCollector:
    """Yields the families of the snapshot it was last given."""

    def __init__(self, builders: list[FamilyBuilder] | None = None) -> None:
        self._builders = builders if builders is not None else load_areas()
        self._inputs = [declared_inputs(build) for build in self._builders]
        # An area that keeps families gets its own KeptFamilies, owned here.
        self._kept = [KeptFamilies() if keeps_families(b) else None for b in self._builders]
        # Per area that declares its inputs: what it built from the samples it last saw.
        self._reuse: dict[int, Memo[list[Metric]]] = {
            index: Memo() for index, inputs in enumerate(self._inputs) if inputs is not None
        }
        self._snapshot: Snapshot | None = None
        self._failing: set[str] = set()

    def set_snapshot(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snapshot = self._snapshot
        if snapshot is None:
            return
        for index, build in enumerate(self._builders):
            inputs = self._inputs[index]
            # An area that fails on odd data loses its own families for this cycle; the
            # others are still exported. Built whole first, so no half area is yielded.
            try:
                kept = self._kept[index]
                if inputs is None:
                    built = _build(build, snapshot, kept)
                else:
                    key: _InputsKey = tuple(
                        sample
                        for name in inputs
                        for sample in (snapshot.current.get(name), snapshot.previous.get(name))
                    )
                    # Its sources did not run since: the very same families (and text).
                    built = self._reuse[index].get(
                        key, None, partial(_build_all, build, snapshot, inputs, kept)
                    )
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
    """The rendered exposition, shared between the loop, the server and its render thread.

    The loop offers each cycle's snapshot (:meth:`offer`); :meth:`render_latest` renders the
    newest one offered unless it was rendered already — as the cycle ends, or only when a
    request asks for it (:class:`nodescope.httpserver.MetricsHTTPServer`). Generations count
    the offered snapshots, so the server can tell a rendered exposition from a newer cycle's
    that is not."""

    def __init__(self, collector: SnapshotCollector | None = None) -> None:
        self.collector = collector or SnapshotCollector()
        self._lock = threading.Lock()
        # The renderer and the collector keep what the previous render made: one at a time.
        self._render_lock = threading.Lock()
        self._body = b""
        self._ready = False
        self._offered: Snapshot | None = None
        #: Snapshots offered so far.
        self.offered_generation = 0
        #: The generation of the exposition in :meth:`body`.
        self.generation = 0
        self._renderer = TextRenderer()

    def offer(self, snapshot: Snapshot) -> int:
        """The newest snapshot, rendered when :meth:`render_latest` is called; its
        generation."""
        with self._lock:
            self._offered = snapshot
            self.offered_generation += 1
            return self.offered_generation

    def render_latest(self) -> bool:
        """Render the newest offered snapshot unless it was rendered already; whether this
        rendered."""
        with self._render_lock:
            with self._lock:
                snapshot, generation = self._offered, self.offered_generation
            if snapshot is None:
                return False
            self.collector.set_snapshot(snapshot)
            # generate_latest's text, from a renderer that remembers the previous render's.
            body = self._renderer.render(self.collector.collect())
            with self._lock:
                self._body = body
                self._ready = True
                self.generation = generation
                if self._offered is snapshot:
                    self._offered = None  # rendered: not held beyond its cycle
            return True

    def update(self, snapshot: Snapshot) -> bytes:
        """Render ``snapshot`` now; scrapes are then served from the cached bytes."""
        self.offer(snapshot)
        self.render_latest()
        return self.body()[1]

    def body(self) -> tuple[bool, bytes]:
        with self._lock:
            return self._ready, self._body


def render(snapshot: Snapshot, builders: list[FamilyBuilder] | None = None) -> bytes:
    """The exposition text of one snapshot (for tests, golden files and ``--once``)."""
    return MetricsCache(SnapshotCollector(builders)).update(snapshot)
