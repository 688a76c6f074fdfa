from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from nodescope.httpserver import MetricsHTTPServer
from nodescope.model.snapshot import Snapshot, SourceStatus
from nodescope_exporters.prometheus import MetricsCache, SnapshotCollector
from nodescope_exporters.self_metrics import families


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


@pytest.fixture
def server() -> Iterator[MetricsHTTPServer]:
    srv = MetricsHTTPServer(("127.0.0.1", 0), MetricsCache(SnapshotCollector([families])))
    srv.start()
    yield srv
    srv.stop()


def snapshot() -> Snapshot:
    return Snapshot(
        cycle=3,
        monotonic=10.0,
        wall_time=1.7e9,
        status={"disks": SourceStatus("disks", True, 3, 0, 1.0)},
    )


def test_503_until_the_first_cycle_then_cached_exposition(server: MetricsHTTPServer) -> None:
    base = f"http://{server.bound}"
    assert get(base + "/metrics")[0] == 503
    assert get(base + "/healthz")[0] == 503
    server.cache.update(snapshot())
    code, ctype, body = get(base + "/metrics")
    assert code == 200
    assert ctype.startswith("text/plain; version=0.0.4")
    assert 'nodescope_source_up{source="disks"} 1.0' in body
    assert "nodescope_cycles_total 3.0" in body
    assert get(base + "/healthz")[:1] == (200,)
    assert get(base + "/nope")[0] == 404
    assert "/metrics" in get(base + "/")[2]


def test_ipv6_loopback_listen() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 support in this kernel")
    try:
        srv = MetricsHTTPServer(("::1", 0), MetricsCache(SnapshotCollector([families])))
    except OSError as exc:
        pytest.skip(f"::1 not available here: {exc}")
    srv.start()
    try:
        srv.cache.update(snapshot())
        assert srv.bound.startswith("[::1]:")
        assert get(f"http://{srv.bound}/metrics")[0] == 200
    finally:
        srv.stop()


def test_scrapes_never_collect() -> None:
    calls = 0

    def counting(snap: Snapshot) -> list[object]:
        nonlocal calls
        calls += 1
        return []

    cache = MetricsCache(SnapshotCollector([counting]))  # type: ignore[list-item]
    srv = MetricsHTTPServer(("127.0.0.1", 0), cache)
    srv.start()
    try:
        cache.update(snapshot())
        for _ in range(5):
            get(f"http://{srv.bound}/metrics")
        assert calls == 1
    finally:
        srv.stop()


def test_a_failing_area_does_not_take_the_others_down() -> None:
    def broken(snap: Snapshot) -> list[object]:
        raise KeyError("odd data")

    cache = MetricsCache(SnapshotCollector([broken, families]))  # type: ignore[list-item]
    body = cache.update(snapshot()).decode()
    assert 'nodescope_source_up{source="disks"} 1.0' in body
