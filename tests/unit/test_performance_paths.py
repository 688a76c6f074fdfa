"""The daemon's hot paths made cheaper for the overhead benchmark (issue 10), held to what
they replace: the exposition renderer against prometheus_client's ``generate_latest``, area
families reused while their sources did not run, derived rates and the traffic attribution
computed once per pair of samples, files read in 64 KiB calls."""

from __future__ import annotations

import math
import shutil
import sys
import types
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    StateSetMetricFamily,
    SummaryMetricFamily,
    UnknownMetricFamily,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric

from nodescope import derive
from nodescope.config import Config
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.service import Service
from nodescope.sources import base
from nodescope_exporters.exposition import TextRenderer, go_float
from nodescope_exporters.prometheus import MetricsCache, SnapshotCollector


class _Families:
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def reference(families: Iterable[Metric]) -> bytes:
    return generate_latest(_Families(families))  # type: ignore[arg-type]


# --- the renderer -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [0, 0.0, -0.0, 1, -1, 1.5, 1e-7, 123456.0, 1234567.0, 1.7e14, 2**63, -1e22, 0.1 + 0.2,
     math.inf, -math.inf, math.nan, True],
)  # fmt: skip
def test_values_are_written_as_go_writes_them(value: float) -> None:
    from prometheus_client.utils import floatToGoString

    assert go_float(value) == floatToGoString(value)


def test_every_family_type_matches_generate_latest() -> None:
    counter = CounterMetricFamily("c_total", "a\\counter\nhelp", labels=["b", "a"])
    counter.add_metric(["x", "y"], 3, created=1700000000.5)
    counter.add_metric(['q"uo\\te', "new\nline"], 1e21)
    gauge = GaugeMetricFamily("g", "gauge", labels=["z", "a", "m"])
    gauge.add_metric(["1", "2", "3"], math.nan, timestamp=1700000000.25)
    gauge.add_metric(["é", "", "-"], -0.0)
    info = InfoMetricFamily("build", "info", value={"version": "1", "python": "3.11"})
    states = StateSetMetricFamily("s", "states", value={"a": True, "b": False})
    hist = HistogramMetricFamily("h", "histogram", labels=["k"])
    hist.add_metric(["v"], buckets=[("1", 2), ("+Inf", 5)], sum_value=7)
    summary = SummaryMetricFamily("sm", "summary", count_value=3, sum_value=1.5)
    unknown = UnknownMetricFamily("u", "untyped", value=2)
    odd = GaugeMetricFamily("bad.name-x", "invalid characters", labels=["la-bel", "9x"])
    odd.add_metric(["v", "w"], 1)
    empty = GaugeMetricFamily("nothing", "no samples")
    families = [counter, gauge, info, states, hist, summary, unknown, odd, empty]
    assert TextRenderer().render(families) == reference(families)


_names = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_:.\-]{0,12}", fullmatch=True)
_label_names = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_.\-]{0,8}", fullmatch=True)
_values = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**70), 2**70))


@st.composite
def families(draw: Any) -> list[Metric]:
    out: list[Metric] = []
    for i in range(draw(st.integers(0, 4))):
        labels = draw(st.lists(_label_names, max_size=3, unique=True))
        kind = draw(st.sampled_from(["gauge", "counter"]))
        name = f"{draw(_names)}_{i}"
        family: Metric = (
            GaugeMetricFamily(name, draw(st.text(max_size=20)), labels=labels)
            if kind == "gauge"
            else CounterMetricFamily(name, draw(st.text(max_size=20)), labels=labels)
        )
        for _ in range(draw(st.integers(0, 4))):
            values = [draw(st.text(max_size=6)) for _ in labels]
            timestamp = draw(st.one_of(st.none(), st.floats(0, 2e9)))
            family.add_metric(values, draw(_values), timestamp=timestamp)  # type: ignore[call-arg]
        out.append(family)
    return out


@settings(max_examples=200, deadline=None)
@given(families())
def test_random_families_match_generate_latest(built: list[Metric]) -> None:
    renderer = TextRenderer()
    assert renderer.render(built) == reference(built)
    # A second render, as the next cycle: the same text from whatever it kept.
    assert renderer.render(built) == reference(built)


def test_a_family_handed_in_again_reuses_its_text_and_a_new_one_is_rendered() -> None:
    renderer = TextRenderer()
    kept = GaugeMetricFamily("kept", "kept", labels=["a"])
    kept.add_metric(["1"], 1)
    first = renderer.render([kept])
    # The same object is taken as unchanged (the collector only hands in an area's old
    # families while its inputs did not change).
    kept.samples[0] = kept.samples[0]._replace(value=2)
    assert renderer.render([kept]) == first
    fresh = GaugeMetricFamily("kept", "kept", labels=["a"])
    fresh.add_metric(["1"], 2)
    assert renderer.render([fresh]) == reference([fresh])


def test_series_that_went_away_are_not_written() -> None:
    renderer = TextRenderer()
    before = GaugeMetricFamily("nodescope_job_x", "x", labels=["job_id"])
    before.add_metric(["81730"], 1)
    before.add_metric(["81731"], 1)
    renderer.render([before])
    after = GaugeMetricFamily("nodescope_job_x", "x", labels=["job_id"])
    after.add_metric(["81731"], 1)
    text = renderer.render([after]).decode()
    assert "81730" not in text
    assert text == reference([after]).decode()


# --- areas reused while their inputs did not change ---------------------------------------


def _area(name: str, inputs: tuple[str, ...] | None) -> tuple[types.ModuleType, list[int]]:
    calls: list[int] = []
    module = types.ModuleType(name)

    def families(snapshot: Snapshot) -> Iterable[Metric]:
        calls.append(snapshot.cycle)
        family = GaugeMetricFamily(f"{name}_cycle", "cycle built at")
        family.add_metric([], snapshot.cycle)
        return [family]

    families.__module__ = name
    module.families = families  # type: ignore[attr-defined]
    if inputs is not None:
        module.INPUTS = inputs  # type: ignore[attr-defined]
    sys.modules[name] = module
    return module, calls


def _snapshot(cycle: int, samples: dict[str, SourceSample]) -> Snapshot:
    return Snapshot(cycle=cycle, monotonic=float(cycle), wall_time=1.7e9, current=samples)


def test_an_area_with_inputs_is_built_again_only_when_they_ran() -> None:
    declared, declared_calls = _area("perf_test_declared", ("slow",))
    plain, plain_calls = _area("perf_test_plain", None)
    try:
        cache = MetricsCache(SnapshotCollector([declared.families, plain.families]))
        slow = SourceSample("slow", 0.0, 0.0, data=1)
        bodies = []
        for cycle in range(1, 4):
            fast = SourceSample("fast", float(cycle), 0.0, data=cycle)
            bodies.append(cache.update(_snapshot(cycle, {"slow": slow, "fast": fast})).decode())
        assert declared_calls == [1]
        assert plain_calls == [1, 2, 3]
        assert "perf_test_declared_cycle 1.0" in bodies[-1]
        assert "perf_test_plain_cycle 3.0" in bodies[-1]
        slow = SourceSample("slow", 4.0, 0.0, data=2)
        body = cache.update(_snapshot(4, {"slow": slow})).decode()
        assert declared_calls == [1, 4]
        assert "perf_test_declared_cycle 4.0" in body
    finally:
        del sys.modules["perf_test_declared"], sys.modules["perf_test_plain"]


def test_a_failing_area_with_inputs_is_not_served_from_an_older_build() -> None:
    name = "perf_test_flaky"
    module = types.ModuleType(name)
    state = {"fail": False}

    def families(snapshot: Snapshot) -> Iterable[Metric]:
        if state["fail"]:
            raise ValueError("odd data")
        family = GaugeMetricFamily("flaky", "flaky")
        family.add_metric([], snapshot.cycle)
        return [family]

    families.__module__ = name
    module.families = families  # type: ignore[attr-defined]
    module.INPUTS = ("s",)  # type: ignore[attr-defined]
    sys.modules[name] = module
    try:
        cache = MetricsCache(SnapshotCollector([families]))
        assert b"flaky 1.0" in cache.update(_snapshot(1, {"s": SourceSample("s", 1.0, 0.0, 1)}))
        state["fail"] = True
        body = cache.update(_snapshot(2, {"s": SourceSample("s", 2.0, 0.0, 2)}))
        assert b"flaky" not in body
    finally:
        del sys.modules[name]


def test_the_daemon_cycle_renders_what_generate_latest_renders(tmp_path: Path) -> None:
    from nodescope.collect import Collector
    from nodescope.sim.node import SimulatedNode, make_temp_root
    from nodescope.sim.scenario import load_scenario

    # dgx-h100's hardware with one GPU and few processes: every area, at a fraction of the cost.
    scenario = tmp_path / "small.json"
    scenario.write_text(
        '{"format": "nodescope-scenario/1", "name": "small", "duration_seconds": 10,'
        ' "hardware": {"base": "dgx-h100", "os": {"background_processes": 40},'
        ' "gpus": {"1": null, "2": null, "3": null, "4": null, "5": null, "6": null,'
        ' "7": null}},'
        ' "jobs": [{"id": 7, "user": "u", "uid": 1000, "gpus": [0],'
        ' "processes": [{"key": "r", "comm": "python3", "gpu": "each", "count": 1}]}],'
        ' "timeline": [{"kind": "gpu_pcie", "gpu": 0, "h2d_bytes_per_second": 1e9,'
        ' "d2h_bytes_per_second": 1e8}]}'
    )
    root = make_temp_root("nodescope-test-")  # a tmpfs when there is one: many small files
    node = SimulatedNode(load_scenario(str(scenario)), root)
    node.materialise()
    now = [0.0]
    sources = node.sources()

    def make(cfg: Config) -> Collector:
        collector = Collector.from_config(cfg, sources)
        collector.clock = lambda: now[0]
        return collector

    config = Config(roots=node.roots)
    service = Service(lambda: config, make_collector=make)
    try:
        # Through the default intervals: pci (10 s) and cgroups (5 s) areas are reused.
        for t in range(0, 11):
            now[0] = float(t)
            node.advance_to(float(t))
            service.run_cycle()
            _, body = service.cache.body()
            assert body == generate_latest(service.cache.registry)
    finally:
        service.shutdown()
        shutil.rmtree(root, ignore_errors=True)


# --- derived rates and attribution, once per pair of samples -------------------------------


def test_derived_rates_are_computed_once_per_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, Any, float]] = []

    def fake(prev: Any, cur: Any, seconds: float) -> object:
        calls.append((prev, cur, seconds))
        return object()

    monkeypatch.setitem(derive._loaded, "perf_test", fake)
    monkeypatch.setitem(derive.DERIVERS, "perf_test", "unused:unused")
    a = SourceSample("perf_test", 1.0, 0.0, data=1)
    b = SourceSample("perf_test", 2.0, 0.0, data=2)
    c = SourceSample("perf_test", 3.0, 0.0, data=3)
    snap = Snapshot(1, 2.0, 0.0, current={"perf_test": b}, previous={"perf_test": a})
    first = derive.derived(snap, "perf_test")
    # A copy of the snapshot (the analysed one) with the same samples: the same record.
    again = Snapshot(2, 2.5, 0.0, current={"perf_test": b}, previous={"perf_test": a})
    assert derive.derived(again, "perf_test") is first
    assert len(calls) == 1
    later = Snapshot(3, 3.0, 0.0, current={"perf_test": c}, previous={"perf_test": b})
    assert derive.derived(later, "perf_test") is not first
    assert calls[-1] == (2, 3, 1.0)


def test_attribution_of_an_analysed_copy_is_not_computed_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dataclasses import replace

    from nodescope.detectors import traffic

    calls: list[int] = []
    monkeypatch.setattr(traffic, "endpoint_flows", lambda s, t: calls.append(1) or ())
    monkeypatch.setattr(traffic, "attribute", lambda topology, flows: ("attributed", topology))
    monkeypatch.setattr(traffic, "_last", None)
    topo = SourceSample("pci", 1.0, 0.0, data=None)
    snap = Snapshot(1, 1.0, 0.0, current={"pci": topo})
    monkeypatch.setattr(Snapshot, "data", lambda self, source, kind: object())
    first = traffic.snapshot_attribution(snap)
    assert traffic.snapshot_attribution(replace(snap, findings=())) is first
    assert len(calls) == 1
    newer = Snapshot(2, 2.0, 0.0, current={"pci": SourceSample("pci", 2.0, 0.0, data=None)})
    traffic.snapshot_attribution(newer)
    assert len(calls) == 2


# --- reading files ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "size", [0, 1, base.READ_CHUNK - 1, base.READ_CHUNK, 3 * base.READ_CHUNK + 5]
)
def test_files_of_any_size_are_read_whole(tmp_path: Path, size: int) -> None:
    path = tmp_path / "f"
    data = bytes((i * 7) % 95 + 32 for i in range(size))
    path.write_bytes(data)
    assert base.read_text(path) == data.decode()
    assert base.read_text(str(path)) == data.decode()
    assert base.read_optional(str(tmp_path / "absent")) is None
