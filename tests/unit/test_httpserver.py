from __future__ import annotations

import gzip
import http.client
import logging
import os
import re
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodescope import serving
from nodescope.assembly import default_config
from nodescope.collect import Collector
from nodescope.httpserver import MAX_SLOTS, JsonCache, MetricsHTTPServer
from nodescope.model.snapshot import Snapshot, SourceStatus
from nodescope.roots import Roots
from nodescope.sdnotify import Notifier
from nodescope.service import Service
from nodescope_exporters.prometheus import MetricsCache, SnapshotCollector
from nodescope_exporters.self_metrics import families
from tests.conftest import free_port


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
    server.publish()
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
        srv.publish()
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
        srv.publish()
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


# -- the serving process -----------------------------------------------------------------------


class StubCache(MetricsCache):
    """An exposition set by the test, as the loop's cache would hold it."""

    def __init__(self) -> None:
        super().__init__(SnapshotCollector([]))
        self.current: bytes | None = None

    def set(self, body: bytes) -> None:
        self.current = body

    def body(self) -> tuple[bool, bytes]:
        return self.current is not None, self.current or b""


def generation(n: int, lines: int = 5000) -> bytes:
    return "".join(f'x{{gen="{n}",i="{i}"}} {i}\n' for i in range(lines)).encode()


def scrape(port: int, conn: http.client.HTTPConnection | None, gz: bool) -> tuple[int, bytes]:
    assert conn is not None
    conn.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"} if gz else {})
    response = conn.getresponse()
    body = response.read()
    if response.getheader("Content-Encoding") == "gzip":
        body = gzip.decompress(body)
    return response.status, body


@pytest.fixture
def stub_server() -> Iterator[tuple[MetricsHTTPServer, StubCache]]:
    cache = StubCache()
    srv = MetricsHTTPServer(("127.0.0.1", 0), cache, JsonCache())
    srv.start()
    yield srv, cache
    srv.stop()


def port_of(srv: MetricsHTTPServer) -> int:
    return int(srv.bound.rsplit(":", 1)[1])


def test_bind_errors_are_the_daemons() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            MetricsHTTPServer(taken.getsockname(), MetricsCache())


def test_gzip_from_the_serving_process(stub_server: tuple[MetricsHTTPServer, StubCache]) -> None:
    srv, cache = stub_server
    cache.set(generation(1))
    srv.publish()
    conn = http.client.HTTPConnection("127.0.0.1", port_of(srv), timeout=5)
    conn.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
    response = conn.getresponse()
    assert response.getheader("Content-Encoding") == "gzip"
    assert gzip.decompress(response.read()) == generation(1)
    conn.close()


def test_documents_are_swapped_whole_under_load(
    stub_server: tuple[MetricsHTTPServer, StubCache],
) -> None:
    srv, cache = stub_server
    cache.set(generation(0))
    srv.publish()
    port = port_of(srv)
    stop = threading.Event()
    problems: list[str] = []
    seen: list[int] = []

    def scraper(gz: bool) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        last = -1
        while not stop.is_set():
            status, body = scrape(port, conn, gz)
            gens = set(re.findall(rb'gen="(\d+)"', body))
            if status != 200 or len(gens) != 1 or body.count(b"\n") != 5000:
                problems.append(f"status {status}, generations {gens}")
                return
            n = int(gens.pop())
            if n < last:
                problems.append(f"generation {n} after {last}")
            last = n
            seen.append(n)
        conn.close()

    threads = [threading.Thread(target=scraper, args=(i % 2 == 0,)) for i in range(8)]
    for t in threads:
        t.start()
    for n in range(1, 60):
        cache.set(generation(n))
        srv.publish()
        time.sleep(0.01)
    stop.set()
    for t in threads:
        t.join(10)
    assert not problems
    assert len(set(seen)) > 5  # the scrapes did see the documents change
    # The memfds are reused (a publish every 10 ms while 8 scrapers take the CPU: a few).
    assert srv.process is not None and srv.process.publisher.memfds <= MAX_SLOTS


def test_a_killed_serving_process_is_replaced_on_the_same_socket(
    stub_server: tuple[MetricsHTTPServer, StubCache], caplog: pytest.LogCaptureFixture
) -> None:
    srv, cache = stub_server
    cache.set(b"x 1\n")
    srv.publish()
    assert srv.process is not None
    first = srv.process.pid
    os.kill(first, signal.SIGKILL)
    srv.process.proc.wait(5)
    # Meanwhile a connection waits in the backlog; the next publish (a cycle) restarts.
    with caplog.at_level(logging.INFO, logger="nodescope.http"):
        srv.publish()
    assert srv.process.pid != first
    assert "event=serving_exited" in caplog.text and "signal=SIGKILL" in caplog.text
    assert get(f"http://{srv.bound}/metrics")[2] == "x 1\n"


def serving_process_running(srv: MetricsHTTPServer) -> bool:
    return srv.process is not None and srv.process.exit_status() is None


def test_a_serving_process_that_keeps_dying_is_restarted_with_a_delay(
    stub_server: tuple[MetricsHTTPServer, StubCache],
) -> None:
    srv, cache = stub_server
    cache.set(b"x 1\n")
    for _ in range(2):
        assert srv.process is not None
        os.kill(srv.process.pid, signal.SIGKILL)
        srv.process.proc.wait(5)
        srv.publish()
    # Two quick exits: the third start waits a second.
    assert not serving_process_running(srv)
    time.sleep(1.1)
    srv.publish()
    assert serving_process_running(srv)
    assert get(f"http://{srv.bound}/metrics")[0] == 200


def test_stop_ends_the_serving_process_and_it_does_not_talk_to_systemd(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "/nonexistent/notify")
    srv = MetricsHTTPServer(("127.0.0.1", 0), MetricsCache())
    srv.start()
    assert srv.process is not None
    proc = srv.process.proc
    environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
    srv.stop()
    assert proc.returncode == 0  # it exited by itself on the channel's end of file
    assert b"NOTIFY_SOCKET" not in environ


def test_a_reload_that_moves_the_listen_address_serves_there_at_once(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    roots = Roots.under(tmp_path)
    (tmp_path / "run").mkdir()
    configs = [default_config(listen=f"127.0.0.1:{port}", roots=roots) for port in ports]
    current = [configs[0]]
    service = Service(
        lambda: current[0],
        notifier=Notifier(address=""),
        make_collector=lambda cfg: Collector.from_config(cfg, []),
    )
    service.start_server()
    try:
        service.run_cycle()
        assert get(f"http://127.0.0.1:{ports[0]}/metrics")[0] == 200
        old = service.server.process if service.server is not None else None
        current[0] = configs[1]
        assert service.reload()
        # The new serving process has the last cycle's documents before the next cycle.
        code, _, body = get(f"http://127.0.0.1:{ports[1]}/metrics")
        assert code == 200 and "nodescope_cycles_total 1.0" in body
        assert old is not None and old.proc.returncode == 0
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/metrics", timeout=2)
    finally:
        service.shutdown()


def service_without_sources(tmp_path: Path, tick_seconds: float) -> tuple[Service, int]:
    """A service with no sources on a free loopback port, its tick ``tick_seconds``."""
    port = free_port()
    (tmp_path / "run").mkdir()
    config = default_config(
        listen=f"127.0.0.1:{port}", roots=Roots.under(tmp_path), tick_seconds=tick_seconds
    )
    service = Service(
        lambda: config,
        notifier=Notifier(address=""),
        make_collector=lambda cfg: Collector.from_config(cfg, []),
    )
    return service, port


def test_a_cycle_is_rendered_when_a_scrape_asks_and_each_cycle_while_scrapes_come(
    tmp_path: Path,
) -> None:
    service, port = service_without_sources(tmp_path, 0.5)
    rendered: list[int] = []

    def counting(snap: Snapshot) -> list[object]:
        rendered.append(snap.cycle)
        return list(families(snap))

    service.cache = MetricsCache(SnapshotCollector([counting]))  # type: ignore[list-item]
    service.start_server()
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        service.run_cycle()  # the first cycle is rendered: the serving process has a document
        for _ in range(3):
            service.run_cycle()
        assert len(rendered) == 1  # nobody asked for cycles 2 to 4
        code, _, body = get(url)
        assert code == 200 and "nodescope_cycles_total 4.0" in body
        assert len(rendered) == 2
        # Scrapes every cycle: each cycle is rendered as it ends (no scrape waits for it).
        for cycle in range(5, 9):
            service.run_cycle()
            assert f"nodescope_cycles_total {cycle}.0" in get(url)[2]
        assert len(rendered) == 6
        # Scrapes stopped for longer than one and a half ticks: rendering waits again.
        time.sleep(0.8)
        service.run_cycle()
        service.run_cycle()
        assert len(rendered) == 6
        assert "nodescope_cycles_total 10.0" in get(url)[2]
        assert "nodescope_cycles_total 10.0" in get(url)[2]
        assert len(rendered) == 7
        # The alerts document waits for a request the same way.
        service.run_cycle()
        time.sleep(0.8)
        service.run_cycle()
        code, _, alerts = get(f"http://127.0.0.1:{port}/api/v1/alerts")
        assert code == 200 and '"cycle": 12' in alerts
    finally:
        service.shutdown()


def test_a_render_that_fails_leaves_the_last_documents_after_the_wait(tmp_path: Path) -> None:
    service, port = service_without_sources(tmp_path, 0.2)
    service.start_server()
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        service.run_cycle()
        time.sleep(0.4)
        service.run_cycle()  # not rendered: nobody asked within 1.5 ticks

        def broken() -> bool:
            raise RuntimeError("render failed")

        service.cache.render_latest = broken  # type: ignore[method-assign]
        started = time.monotonic()
        code, _, body = get(url)
        waited = time.monotonic() - started
        # The first cycle's exposition, once the serving process gave up waiting.
        assert code == 200 and "nodescope_cycles_total 1.0" in body
        assert serving.RENDER_WAIT_SECONDS <= waited < serving.RENDER_WAIT_SECONDS + 2.5
        assert service.cycle_errors == {"export": 1}
    finally:
        service.shutdown()


def test_the_serving_process_runs_its_compiled_file_only_while_it_matches_the_source(
    tmp_path: Path,
) -> None:
    import py_compile

    from nodescope.httpserver import SERVING_COMMAND_LINE, serving_script

    source = tmp_path / "serving.py"
    source.write_text("x = 1\n")
    cached = str(tmp_path / "serving.pyc")
    assert serving_script(str(source), cached) == str(source)  # not compiled
    py_compile.compile(str(source), cfile=cached)
    assert serving_script(str(source), cached) == cached
    # An edit (another size, another time) makes the compiled file stale.
    source.write_text("x = 22\n")
    os.utime(source, (1e9, 1e9))
    assert serving_script(str(source), cached) == str(source)
    # A hash-based compiled file is not checked here: the source is run.
    py_compile.compile(
        str(source), cfile=cached, invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH
    )
    assert serving_script(str(source), cached) == str(source)
    # The daemon's own: whichever it picks, the serving process starts from it, and its
    # command line is known by either form (the benchmark and the tests find it so).
    assert serving_script().endswith((".py", ".pyc"))
    for script in (str(source), "/x/__pycache__/serving.cpython-311.pyc"):
        cmdline = f"/usr/bin/python3\0-I\0-S\0{script}\0--listen-fd\0003\0".encode()
        assert SERVING_COMMAND_LINE.search(cmdline)
    assert not SERVING_COMMAND_LINE.search(b"python3\0/x/observing.py\0")


def test_an_offer_made_while_the_last_one_renders_is_rendered_next() -> None:
    cache = JsonCache()

    def newer() -> object:
        return {"cycle": 2}

    def older() -> object:
        cache.offer(newer)  # the next cycle's, offered while this one is made
        return {"cycle": 1}

    cache.offer(older)
    cache.render_latest()
    assert cache.body() == b'{\n  "cycle": 1\n}\n'
    cache.render_latest()
    assert cache.body() == b'{\n  "cycle": 2\n}\n'
    cache.update({"cycle": 3})  # a document set outright replaces any offer
    cache.offer(newer)
    cache.update({"cycle": 3})
    cache.render_latest()
    assert cache.body() == b'{\n  "cycle": 3\n}\n'
