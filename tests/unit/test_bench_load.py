"""The benchmark's load generator (bench/run.py) against the daemon's HTTP server: it must
time every response of a round and notice what a scraper would."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodescope.httpserver import JsonCache, MetricsHTTPServer
from nodescope_exporters.prometheus import MetricsCache, SnapshotCollector

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
bench = importlib.import_module("run")  # bench/run.py: a script, not a package


class FixedCache(MetricsCache):
    def __init__(self, body: bytes) -> None:
        super().__init__(SnapshotCollector([]))
        self.fixed = body

    def body(self) -> tuple[bool, bytes]:
        return True, self.fixed


@pytest.fixture
def port() -> Iterator[int]:
    body = b"# HELP x x\n" + b"".join(b'x{i="%d"} %d\n' % (i, i) for i in range(3000))
    srv = MetricsHTTPServer(("127.0.0.1", 0), FixedCache(body), JsonCache())
    srv.start()
    yield int(srv.bound.rsplit(":", 1)[1])
    srv.stop()


@pytest.mark.parametrize("gzip", [True, False])
def test_a_round_times_every_response(port: int, gzip: bool) -> None:
    load = bench.LoadGenerator(port, 10)
    try:
        for _ in range(3):  # keep-alive: the same connections every round
            latencies = load.round(gzip)
            assert len(latencies) == 10
            assert all(0 < t < 5 for t in latencies)
    finally:
        load.close()
    assert load.errors == [] and load.bodies_checked == 3


def test_a_response_split_across_reads_is_put_back_together() -> None:
    exchange: Any = bench._Exchange(None, keep_body=True)
    assert exchange.feed(memoryview(b"HTTP/1.1 200 OK\r\nContent-")) is False
    assert exchange.feed(memoryview(b"Length: 3\r\n\r\nab")) is False
    assert exchange.feed(memoryview(b"c")) is True
    assert (exchange.status, exchange.parts) == (200, [b"ab", b"c"])


def test_a_chunked_response_ends_at_its_last_chunk() -> None:
    # node_exporter (Go's net/http) sends a gzip body in chunks, without Content-Length.
    exchange: Any = bench._Exchange(None, keep_body=True)
    head = b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert exchange.feed(memoryview(head + b"3\r\nabc\r\n1")) is False
    assert exchange.feed(memoryview(b"0\r\n0123456789abcdef\r\n0\r\n")) is False
    assert exchange.feed(memoryview(b"\r\n")) is True
    assert b"".join(exchange.parts) == b"abc0123456789abcdef"
    assert exchange.encoding == "gzip"


#: The machine facts a report opens with.
MACHINE = {"date": "d", "cpus": 2, "cpu": "c", "memory_gib": 1, "os": "o", "kernel": "k",
           "python": "p", "node_exporter": "n", "loadavg_start": [0.0]}  # fmt: skip


def test_the_report_names_each_latency_mode() -> None:
    figures = {"requests": 1, "p50_ms": 0.2, "p99_ms": 0.9, "max_ms": 1.0}
    results: dict[str, Any] = {
        "machine": MACHINE,
        "overhead": {
            "scenario": "dgx-h100",
            "overhead": {"window_seconds": 20, "nodescope": {
                "cycles": 20, "cpu_ms_per_cycle_without_mirror": 4.0, "cpu_ms_per_cycle": 4.5,
                "nvml_mirror_refresh_ms_per_cycle": 0.5, "rss_mib_end": 50, "rss_mib_max": 51,
                "rss_mib_series": [50, 50], "series": 5000, "bytes": 400000,
                "main_thread_cycle_ms": {"p50": 4, "p99": 5, "max": 6},
                "serving_cpu_ms_per_cycle": 0.3, "daemon_rss_mib_end": 40,
                "serving_rss_mib_end": 10, "pss_mib_end": 38, "daemon_pss_mib_end": 32,
                "serving_pss_mib_end": 6}},
            "latency": {"nodescope": {
                "1": {**figures, "encoding": "gzip"},
                "1-plain": {**figures, "encoding": "plain"},
                "50": {**figures, "encoding": "gzip"},
            }},
        },
    }  # fmt: skip
    text = bench.report(results)
    assert "| scrape p50 / p99 ms, 1 scraper(s), gzip | 0.2 / 0.9 |" in text
    assert "| scrape p50 / p99 ms, 1 scraper(s), plain |" in text
    assert "| scrape p50 / p99 ms, 50 scraper(s), gzip |" in text
    assert "40 + 10 = 50 MiB" in text and "32 + 6 = 38 MiB" in text


def test_the_report_sets_this_tree_against_the_baseline_of_the_same_window() -> None:
    def daemon(cpu: float, p50: float, rss: float) -> dict[str, Any]:
        return {
            "cycles": 60, "cpu_ms_per_cycle_without_mirror": cpu, "cpu_ms_per_cycle": cpu + 1,
            "nvml_mirror_refresh_ms_per_cycle": 1.0, "rss_mib_end": rss, "rss_mib_max": rss,
            "rss_mib_series": [rss], "series": 5000, "bytes": 400000,
            "main_thread_cycle_ms": {"mean": p50, "p50": p50, "p99": 2 * p50, "max": 3 * p50},
        }  # fmt: skip

    latency = {"requests": 1, "p50_ms": 0.2, "p99_ms": 0.8, "max_ms": 1.0, "encoding": "gzip"}
    results: dict[str, Any] = {
        "machine": MACHINE,
        "overhead": {
            "scenario": "dgx-h100",
            "baseline": "v0.1",
            "overhead": {"window_seconds": 60, "nodescope": daemon(9.0, 12.0, 40.0),
                         "baseline": daemon(10.0, 15.0, 50.0)},
            "latency": {"nodescope": {"1": latency},
                        "baseline": {"1": {**latency, "p99_ms": 1.6}}},
        },
    }  # fmt: skip
    text = bench.report(results)
    assert "### Side by side with `v0.1` (same window, same node)" in text
    assert "| process CPU ms per cycle (without the mirror) | 9.0 | 10.0 | 0.900 |" in text
    assert "| main-thread cycle CPU p50 ms | 12.0 | 15.0 | 0.800 |" in text
    assert "| RSS MiB, end of window | 40.0 | 50.0 | 0.800 |" in text
    assert "| scrape p99 ms, 1 scraper(s) | 0.8 | 1.6 | 0.500 |" in text
    # Without a baseline the section is absent.
    del results["overhead"]["baseline"], results["overhead"]["overhead"]["baseline"]
    assert "Side by side" not in bench.report(results)


def test_the_profile_is_summed_by_part_with_blocked_threads_apart() -> None:
    raw = "\n".join(
        [
            "_bootstrap (threading.py:1);_Runner._loop (nodescope/collect.py:140);"
            "_call (nodescope/collect.py:159);NvmlSource.collect (nodescope/sources/nvml.py:1010);"
            "NvmlSource._read_gpu (nodescope/sources/nvml.py:1204) 6",
            "main (daemon.py:1);Service._run_cycle (nodescope/service.py:250);"
            "Analyzer.analyze (nodescope/analysis.py:182);detect (contention.py:216) 3",
            "main (daemon.py:1);Service._render_documents (nodescope/service.py:244);"
            "MetricsCache.render_latest (nodescope_exporters/prometheus.py:170);"
            "TextRenderer.render (nodescope_exporters/exposition.py:150) 2",
            "_bootstrap (threading.py:1);_Runner._loop (nodescope/collect.py:135);"
            "Condition.wait (threading.py:331) 9",
            "main (daemon.py:1);Service.run (nodescope/service.py:330);something (x.py:1) 1",
        ]
    )
    summary = bench.summarise_profile(raw)
    assert summary["samples"] == 21
    assert summary["busy_samples"] == 11
    parts = summary["parts_percent"]
    assert parts["collect NvmlSource.collect"] == round(6 / 21 * 100, 1)
    assert parts["analyse"] == round(3 / 21 * 100, 1)
    assert parts["render"] == round(2 / 21 * 100, 1)
    assert parts["waiting"] == round(9 / 21 * 100, 1)
    assert parts["other"] == round(1 / 21 * 100, 1)


def test_cpu_by_part_is_taken_over_the_cycles_of_each_window() -> None:
    stats = {
        "cycle_end_monotonic": [1.0, 2.0, 3.0, 4.0, 5.0],
        "parts": ["source nvml", "analysis"],
        # running totals (seconds) at each cycle's end
        "parts_cpu_cumulative": [
            [0.001, 0.002],
            [0.002, 0.004],
            [0.004, 0.007],
            [0.006, 0.010],
            [0.008, 0.013],
        ],
    }
    # Cycles 3 and 4 end inside: totals at cycle 4 less those at cycle 2, over 2 cycles.
    parts = bench._parts_in_window({"start": 2.5, "end": 4.5}, stats)
    assert parts == {"source nvml": 2.0, "analysis": 3.0}
    # From the first cycle on, against zero.
    assert bench._parts_in_window({"start": 0.0, "end": 1.5}, stats) == {
        "source nvml": 1.0,
        "analysis": 2.0,
    }
    assert bench._parts_in_window({"start": 9.0, "end": 10.0}, stats) == {}
    window = {"scrape_every_seconds": 1, "nodescope": {"cpu_ms_per_cycle": 6.5}}
    window["nodescope"]["parts_ms_per_cycle"] = parts
    table = "\n".join(bench._parts_table({"overhead": window}))
    assert "| source nvml | 2.0 |" in table and "| analysis | 3.0 |" in table
    assert "| 1.5 |" in table  # the rest: 6.5 - 5.0
