"""A source that blocks in the kernel, a planted FIFO, a failure outside any source: the
collection cycle goes on."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nodescope.collect import Collector, ScheduledSource
from nodescope.roots import Roots
from nodescope.sources import diskstats


@dataclass
class BlockingRead:
    """Opens a FIFO without O_NONBLOCK — a read that blocks in the kernel, as a ``stat`` on a
    hung NFS server or an NVML call on a GPU in a bad state does."""

    fifo: Path
    name: str = "blocking"
    calls: int = 0
    returned: threading.Event = field(default_factory=threading.Event)

    def collect(self, roots: Roots) -> int:
        self.calls += 1
        if not self.returned.is_set():
            with open(self.fifo, "rb") as handle:  # blocks until a writer opens the FIFO
                handle.read()
            self.returned.set()
        return self.calls

    def close(self) -> None:
        return None


@dataclass
class Counting:
    name: str
    calls: int = 0

    def collect(self, roots: Roots) -> int:
        self.calls += 1
        return self.calls

    def close(self) -> None:
        return None


def test_a_blocked_source_times_out_and_never_piles_up(tmp_path: Path) -> None:
    fifo = tmp_path / "hung"
    os.mkfifo(fifo)
    blocking, other = BlockingRead(fifo), Counting("other")
    collector = Collector(
        roots=Roots(),
        scheduled=[ScheduledSource(blocking, 0.2, timeout=0.5), ScheduledSource(other, 0.2, 0.5)],
    )
    started = time.monotonic()
    snapshot = collector.run_cycle()
    took = time.monotonic() - started
    # The cycle waited for the deadline, not for the read.
    assert 0.5 <= took < 2.0
    assert snapshot.status["blocking"].up is False
    assert "timeout" in (snapshot.current["blocking"].error or "")
    assert snapshot.status["other"].up is True and snapshot.current["other"].data == 1
    threads_before = threading.active_count()
    for _ in range(5):
        time.sleep(0.2)
        snapshot = collector.run_cycle(force=True)
    # Still blocked: reported down each cycle, called no second time, no thread added.
    assert blocking.calls == 1
    assert threading.active_count() <= threads_before
    assert snapshot.status["blocking"].timeouts_total == 6
    assert snapshot.current["other"].data == 6
    # The blocked call returns (the NFS server comes back): the source runs again.
    writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    os.close(writer)
    assert blocking.returned.wait(5)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        snapshot = collector.run_cycle(force=True)
        if snapshot.status["blocking"].up:
            break
        time.sleep(0.05)
    assert snapshot.status["blocking"].up is True
    assert blocking.calls >= 2
    collector.close()


@pytest.mark.alone  # a cycle within 2 s
def test_a_fifo_in_place_of_diskstats_downs_the_source_at_once(tmp_path: Path) -> None:
    procfs = tmp_path / "proc"
    procfs.mkdir()
    os.mkfifo(procfs / "diskstats")
    (procfs / "uptime").write_text("100.0 50.0\n")
    roots = Roots(procfs=procfs, sysfs=tmp_path / "sys")
    collector = Collector(
        roots=roots, scheduled=[ScheduledSource(diskstats.make_source(), 1.0, timeout=30.0)]
    )
    started = time.monotonic()
    snapshot = collector.run_cycle()
    assert time.monotonic() - started < 2.0
    assert snapshot.status["disks"].up is False
    assert "FIFO" in (snapshot.current["disks"].error or "")
    collector.close()


def test_snapshot_cli_over_a_fifo_ends(tmp_path: Path) -> None:
    import subprocess

    from tests.conftest import nodescope_command

    procfs = tmp_path / "proc"
    procfs.mkdir()
    os.mkfifo(procfs / "diskstats")
    result = subprocess.run(
        [*nodescope_command(), "snapshot", "--json", "--interval", "0.1", "--procfs", str(procfs)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "FIFO" in result.stdout


class RaisingJobs:
    """Stands in for the job tracker with a bug that any cycle's input triggers."""

    calls = 0

    def observe(self, snapshot: object) -> None:
        self.calls += 1
        raise KeyError("job 42")

    def stop(self) -> None:
        return None


def test_an_exception_outside_the_sources_is_survived_counted_and_exported() -> None:
    from nodescope.config import Config
    from nodescope.service import Service

    counting = Counting("other")
    service = Service(
        load_config=Config,
        make_collector=lambda config: Collector(
            roots=Roots(), scheduled=[ScheduledSource(counting, 0.0, timeout=5.0)]
        ),
    )
    jobs = RaisingJobs()
    service.hooks = jobs  # type: ignore[assignment]
    for _ in range(3):
        service.run_cycle()
    assert jobs.calls == 3 and counting.calls == 3
    assert service.cycle_errors == {"jobs": 3}
    ready, body = service.cache.body()
    text = body.decode()
    assert ready
    assert 'nodescope_cycle_errors_total{stage="jobs"} 3.0' in text
    service.hooks = None
    service.collector.close()


def test_the_watchdog_is_fed_only_while_cycles_complete(monkeypatch: pytest.MonkeyPatch) -> None:
    from nodescope.config import Config
    from nodescope.service import Service
    from nodescope.timing import CYCLE_GRACE

    service = Service(
        load_config=Config,
        make_collector=lambda config: Collector(roots=Roots(), scheduled=[]),
    )
    assert service.run_cycle() is True
    assert service.cycles_on_time()
    # Cycles stop completing (every collect raises): after a tick and the grace, no more
    # WATCHDOG=1, so systemd restarts the daemon.
    monkeypatch.setattr(service.collector, "run_cycle", lambda: 1 / 0)
    assert service.run_cycle() is False
    assert service.cycle_errors == {"collect": 1}
    service.cycle.last_completed -= service.config.tick_seconds + CYCLE_GRACE + 1
    assert not service.cycles_on_time()


def test_healthz_turns_unhealthy_when_publishes_stop() -> None:
    """The real serving process: /healthz is 200 while the daemon publishes, 503 once nothing
    was published for ``stale_after`` seconds (cycles stopped), 200 again after a publish."""
    import urllib.error
    import urllib.request

    from nodescope.httpserver import MetricsHTTPServer
    from nodescope.model.snapshot import Snapshot, SourceStatus
    from nodescope.timing import Timing
    from nodescope_exporters.prometheus import MetricsCache, SnapshotCollector
    from nodescope_exporters.self_metrics import families

    def status(url: str) -> int:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return int(response.status)
        except urllib.error.HTTPError as error:
            return int(error.code)

    server = MetricsHTTPServer(
        ("127.0.0.1", 0),
        MetricsCache(SnapshotCollector([families])),
        timing=Timing(tick_seconds=0.5, stale_after=1.0, render_window=0.75),
    )
    server.start()
    try:
        url = f"http://{server.bound}/healthz"

        def publish(cycle: int) -> None:
            status_of = {"disks": SourceStatus("disks", True, cycle, 0, 1.0)}
            server.cache.update(Snapshot(cycle, float(cycle), 1.7e9 + cycle, status=status_of))
            server.publish()

        publish(1)
        deadline = time.monotonic() + 5
        while status(url) != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status(url) == 200
        time.sleep(1.5)
        assert status(url) == 503
        publish(2)
        deadline = time.monotonic() + 5
        while status(url) != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status(url) == 200
    finally:
        server.stop()
