"""Our metric families and what the daemon imports for its exposition: families that read
like prometheus_client's, and no prometheus_client in the daemon's process."""

from __future__ import annotations

import subprocess
import sys

import pytest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest

from nodescope_exporters.catalog import Family, MetricSpec, Sample
from nodescope_exporters.exposition import TextRenderer
from tests.conftest import REPO


def test_specs_make_families_named_as_prometheus_client_names_them() -> None:
    counter = MetricSpec("nodescope_x_total", "counter", "x", ("a",), "test").family()
    assert (counter.name, counter.type, counter.sample_name) == (
        "nodescope_x",
        "counter",
        "nodescope_x_total",
    )
    info = MetricSpec("nodescope_y_info", "info", "y", ("v",), "test").family()
    assert (info.name, info.type, info.documentation, info.label_names) == (
        "nodescope_y_info",
        "gauge",
        "y",
        ("v",),
    )


def test_samples_read_as_prometheus_client_samples() -> None:
    ours = Family("nodescope_x", "counter", "x", ("b", "a"))
    theirs = CounterMetricFamily("nodescope_x", "x", labels=("b", "a"))
    for labels, value, timestamp in ((["1", "2"], 3, None), (("3", "4"), 0.5, 17.0)):
        ours.add_metric(labels, value, timestamp=timestamp)
        theirs.add_metric(list(labels), value, timestamp=timestamp)
    assert len(ours.samples) == 2 and ours.samples
    assert not Family("e", "gauge", "e", ()).samples
    assert [tuple(s) for s in ours.samples] == [tuple(s)[:4] for s in theirs.samples]
    assert ours.samples[-1] == Sample("nodescope_x_total", {"b": "3", "a": "4"}, 0.5, 17.0)
    assert ours.samples[:1] == [ours.samples[0]]


class _Collector:
    def __init__(self, *families: object) -> None:
        self.families = families

    def collect(self) -> tuple[object, ...]:
        return self.families


def test_prometheus_client_renders_our_families_as_its_own() -> None:
    """Tests that hand area families to generate_latest read what they read before."""
    gauge = Family("g", "gauge", "g", ("a",))
    gauge.add_metric(["1"], 2.5)
    counter = Family("c", "counter", "c", ())
    counter.add_metric([], 7)
    their_gauge = GaugeMetricFamily("g", "g", labels=["a"])
    their_gauge.add_metric(["1"], 2.5)
    their_counter = CounterMetricFamily("c", "c")
    their_counter.add_metric([], 7)
    ours = generate_latest(_Collector(gauge, counter))  # type: ignore[arg-type]
    assert ours == generate_latest(_Collector(their_gauge, their_counter))  # type: ignore[arg-type]
    assert ours == TextRenderer().render([gauge, counter])


def test_the_daemon_does_not_import_prometheus_client() -> None:
    """Its package import pulls in http.server, email and ssl: megabytes of RSS."""
    code = """
import sys
from nodescope.cli.main import build_parser
build_parser()  # what `nodescope run` imports: every subcommand registers
import nodescope.cli.run, nodescope.service, nodescope.httpserver
from nodescope.model.snapshot import Snapshot
from nodescope_exporters.prometheus import MetricsCache
MetricsCache().update(Snapshot(1, 1.0, 1.7e9, {}))  # every area, imported and run
print(",".join(sorted(m for m in sys.modules if m.split(".")[0] == "prometheus_client")))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""


def test_add_metrics_adds_a_series_for_each_known_value() -> None:
    family = Family("nodescope_x", "gauge", "x", ("gpu", "link"))
    family.add_metrics([("0", "0"), ("0", "1"), ("0", "2")], [3, None, 0.5])
    assert family.label_values == [("0", "0"), ("0", "2")]
    assert family.values == [3.0, 0.5] and all(type(v) is float for v in family.values)
    with pytest.raises(ValueError, match="2 label sets for 1 values"):
        family.add_metrics([("1", "0"), ("1", "1")], [1.0])
    assert len(family.values) == 2
