"""The daemon's hot paths made cheaper for the overhead benchmark (issue 10), held to what
they replace: the exposition renderer against prometheus_client's ``generate_latest``, area
families reused while their sources did not run, derived rates and the traffic attribution
computed once per pair of samples, files read in 64 KiB calls."""

from __future__ import annotations

import math
import shutil
import sys
import types
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric as ClientMetric
from prometheus_client.utils import floatToGoString

from nodescope.assembly import default_config
from nodescope.config import Config
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.model.source_key import SourceKey
from nodescope.service import Service
from nodescope_exporters import exposition
from nodescope_exporters.catalog import Family, Metric
from nodescope_exporters.exposition import TextRenderer, go_float, go_floats
from nodescope_exporters.prometheus import MetricsCache, SnapshotCollector


class _Families:
    def __init__(self, families: Iterable[ClientMetric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[ClientMetric]:
        return iter(self.families)


def client_family(family: Family) -> ClientMetric:
    """The prometheus_client family equivalent to one of ours, built from its lists."""
    cls = CounterMetricFamily if family.type == "counter" else GaugeMetricFamily
    out = cls(family.name, family.documentation, labels=family.label_names)
    stamps = family.timestamps or {}
    for i, (labels, value) in enumerate(zip(family.label_values, family.values, strict=True)):
        out.add_metric(list(labels), value, timestamp=stamps.get(i))
    return out


def reference(families: Iterable[Family]) -> bytes:
    """generate_latest's text of the equivalent prometheus_client families."""
    return generate_latest(_Families(map(client_family, families)))  # type: ignore[arg-type]


def gauge(name: str, labels: Sequence[str] = (), help: str = "help") -> Family:
    return Family(name, "gauge", help, tuple(labels))


# --- the renderer -------------------------------------------------------------------------


_GO_VALUES = [0, 0.0, -0.0, 1, -1, 1.5, 1e-7, 123456.0, 1234567.0, 1.7e14, 2**63, -1e22,
              0.1 + 0.2, 12345678.25, -12345678.0, 1e16, 5e-324, math.inf, -math.inf, math.nan,
              True]  # fmt: skip


@pytest.mark.parametrize("value", _GO_VALUES)
def test_values_are_written_as_go_writes_them(value: float) -> None:
    assert go_float(value) == floatToGoString(value)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.floats(), st.integers(-(2**70), 2**70)), max_size=20))
def test_values_in_bulk_are_written_as_go_writes_them(values: list[float]) -> None:
    assert go_floats(values) == [floatToGoString(v) for v in values]
    assert go_floats(_GO_VALUES) == [floatToGoString(v) for v in _GO_VALUES]


def test_gauges_and_counters_match_generate_latest() -> None:
    counter = Family("c", "counter", "a\\counter\nhelp", ("b", "a"))
    counter.add_metric(["x", "y"], 3)
    counter.add_metric(['q"uo\\te', "new\nline"], 1e21)
    g = gauge("g", ["z", "a", "m"])
    g.add_metric(["1", "2", "3"], math.nan, timestamp=1700000000.25)
    g.add_metric(("é", "", "-"), -0.0)
    g.add_metric(["x", "y", "z"], 7, timestamp=0)
    odd = gauge("bad.name-x", ["la-bel", "9x"])
    odd.add_metric(["v", "w"], 1)
    short = gauge("short", ["a", "b"])
    short.add_metric(["only a"], 2**63)
    plain = gauge("plain")
    plain.add_metric([], 1.5)
    empty = gauge("nothing", ["a"])
    families = [counter, g, odd, short, plain, empty]
    assert TextRenderer().render(families) == reference(families)


_names = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_:.\-]{0,12}", fullmatch=True)
_label_names = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_.\-]{0,8}", fullmatch=True)
_values = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**70), 2**70))


@st.composite
def families(draw: Any) -> list[Family]:
    out: list[Family] = []
    for i in range(draw(st.integers(0, 4))):
        labels = tuple(draw(st.lists(_label_names, max_size=3, unique=True)))
        kind = draw(st.sampled_from(["gauge", "counter"]))
        family = Family(f"{draw(_names)}_{i}", kind, draw(st.text(max_size=20)), labels)
        for _ in range(draw(st.integers(0, 4))):
            values = [draw(st.text(max_size=6)) for _ in labels]
            timestamp = draw(st.one_of(st.none(), st.floats(0, 2e9)))
            family.add_metric(values, draw(_values), timestamp=timestamp)
        out.append(family)
    return out


@settings(max_examples=200, deadline=None)
@given(families(), families())
def test_random_families_match_generate_latest(first: list[Family], then: list[Family]) -> None:
    renderer = TextRenderer()
    assert renderer.render(first) == reference(first)
    # The next cycles, from what the renderer kept: the same families, then others.
    assert renderer.render(first) == reference(first)
    assert renderer.render(then) == reference(then)
    assert renderer.render(first + then) == reference(first + then)


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the values the renderer formats."""
    formatted: list[int] = []
    real = exposition._go_texts

    def counting(texts: list[str]) -> list[str]:
        formatted.append(len(texts))
        return real(texts)

    monkeypatch.setattr(exposition, "_go_texts", counting)
    return formatted


def test_an_unchanged_family_reuses_its_text_and_a_changed_value_shows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    formatted = _counting(monkeypatch)
    renderer = TextRenderer()

    def cycle(errors: float, temperature: float) -> list[Family]:
        slow = Family("errors", "counter", "errors", ("gpu",))
        slow.add_metric(["0"], errors)
        fast = gauge("temperature", ["gpu"])
        fast.add_metric(["0"], temperature)
        return [slow, fast]

    renderer.render(cycle(0, 40))
    assert formatted == [1, 1]
    body = renderer.render(cycle(0, 41))
    assert formatted == [1, 1, 1]  # only the temperature
    assert body == reference(cycle(0, 41))
    # -0.0 == 0.0, but Go writes it "-0.0": not taken as unchanged.
    body = renderer.render(cycle(-0.0, 41))
    assert b'errors_total{gpu="0"} -0.0\n' in body
    assert body == reference(cycle(-0.0, 41))
    assert renderer.render(cycle(1, 41)) == reference(cycle(1, 41))


def test_a_family_changed_in_place_is_rendered_again() -> None:
    renderer = TextRenderer()
    kept = gauge("kept", ["a"])
    kept.add_metric(["1"], 1)
    renderer.render([kept])
    kept.values[0] = 2
    assert renderer.render([kept]) == reference([kept])
    kept.label_values[0] = ("3",)
    assert renderer.render([kept]) == reference([kept])
    kept.add_metric(["4"], 4, timestamp=1.5)
    assert renderer.render([kept]) == reference([kept])
    kept.timestamps = {1: 2.5}
    assert renderer.render([kept]) == reference([kept])


def test_series_that_went_away_are_not_written_nor_kept() -> None:
    renderer = TextRenderer()
    before = gauge("nodescope_job_x", ["job_id"])
    for job in ("81730", "81731", "81732"):
        before.add_metric([job], 1)
    renderer.render([before])
    after = gauge("nodescope_job_x", ["job_id"])
    after.add_metric(["81731"], 1)
    after.add_metric(["81733"], 2)
    text = renderer.render([after]).decode()
    assert "81730" not in text and "81733" in text
    assert text == reference([after]).decode()
    # What is kept of the family is its live series' prefixes alone.
    (kept,) = renderer._kept.values()
    assert kept.prefixes == ['nodescope_job_x{job_id="81731"} ', 'nodescope_job_x{job_id="81733"} ']
    # A family gone from a render is gone from what is kept.
    renderer.render([gauge("other")])
    assert len(renderer._kept) == 1


def test_families_of_the_same_name_are_both_written() -> None:
    renderer = TextRenderer()
    one, two = gauge("same", ["a"]), gauge("same", ["a"])
    one.add_metric(["1"], 1)
    two.add_metric(["2"], 2)
    for _ in range(2):
        assert renderer.render([one, two]) == reference([one, two])
    two.values[0] = 3
    assert renderer.render([one, two]) == reference([one, two])
    # The same label names under another help or type: another family.
    other = Family("same", "counter", "help", ("a",))
    other.add_metric(["1"], 1)
    assert renderer.render([one, other]) == reference([one, other])


# --- areas reused while their inputs did not change ---------------------------------------


def _area(name: str, inputs: tuple[str, ...] | None) -> tuple[types.ModuleType, list[int]]:
    calls: list[int] = []
    module = types.ModuleType(name)

    def families(snapshot: Snapshot) -> Iterable[Metric]:
        # An area with inputs sees no cycle: it shows the value of its one source instead.
        value = snapshot.cycle if inputs is None else snapshot.current[inputs[0]].data
        assert isinstance(value, int)
        calls.append(value)
        family = gauge(f"{name}_cycle", help="cycle or value built from")
        family.add_metric([], value)
        return [family]

    families.__module__ = name
    module.families = families  # type: ignore[attr-defined]
    if inputs is not None:
        module.INPUTS = tuple(SourceKey(n, int) for n in inputs)  # type: ignore[attr-defined]
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
        assert declared_calls == [1, 2]
        assert "perf_test_declared_cycle 2.0" in body
    finally:
        del sys.modules["perf_test_declared"], sys.modules["perf_test_plain"]


def test_an_area_with_inputs_sees_only_their_samples() -> None:
    name = "perf_test_narrow"
    module = types.ModuleType(name)
    seen: list[tuple[list[str], int, float]] = []

    def families(snapshot: Snapshot) -> Iterable[Metric]:
        seen.append((sorted(snapshot.current), snapshot.cycle, snapshot.wall_time))
        return []

    families.__module__ = name
    module.families = families  # type: ignore[attr-defined]
    module.INPUTS = (SourceKey("slow", int),)  # type: ignore[attr-defined]
    sys.modules[name] = module
    try:
        cache = MetricsCache(SnapshotCollector([families]))
        samples = {
            "slow": SourceSample("slow", 1.0, 0.0, 1),
            "fast": SourceSample("fast", 1.0, 0.0, 2),
        }
        cache.update(_snapshot(7, samples))
        # Nothing but the declared source, and no clock to make the families depend on.
        assert seen == [(["slow"], 0, 0.0)]
    finally:
        del sys.modules[name]


def test_a_failing_area_with_inputs_is_not_served_from_an_older_build() -> None:
    name = "perf_test_flaky"
    module = types.ModuleType(name)
    state = {"fail": False}

    def families(snapshot: Snapshot) -> Iterable[Metric]:
        if state["fail"]:
            raise ValueError("odd data")
        family = gauge("flaky")
        family.add_metric([], snapshot.current["s"].data)
        return [family]

    families.__module__ = name
    module.families = families  # type: ignore[attr-defined]
    module.INPUTS = (SourceKey("s", int),)  # type: ignore[attr-defined]
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

    config = default_config(roots=node.roots)
    service = Service(lambda: config, make_collector=make)
    try:
        # Through the default intervals: pci (10 s) and cgroups (5 s) areas are reused.
        for t in range(0, 11):
            now[0] = float(t)
            node.advance_to(float(t))
            service.run_cycle()
            _, body = service.cache.body()
            # The cycle's families (areas reused or built again from the same snapshot).
            assert body == reference(service.cache.collector.collect())
    finally:
        service.shutdown()
        shutil.rmtree(root, ignore_errors=True)
