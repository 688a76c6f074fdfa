"""The daemon's process figures: measured on real processes whose memory, descriptors,
threads, limits and CPU time the test sets, and exported under the process collector's names."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodescope.assembly import default_config
from nodescope.collect import Collector
from nodescope.model.process import PSS_EVERY_SECONDS, ProcessFigures
from nodescope.model.snapshot import Snapshot
from nodescope.roots import Roots
from nodescope.sdnotify import Notifier
from nodescope.selfstats import ProcessMeter, parse_max_open_files
from nodescope.service import Service
from nodescope_exporters.catalog import metric
from nodescope_exporters.prometheus import render
from nodescope_exporters.self_metrics import families

MIB = 1 << 20

#: What the child's "grow" step adds: anonymous memory it writes, descriptors, threads.
BALLAST_BYTES = 64 * MIB
EXTRA_FDS = 100
EXTRA_THREADS = 3
#: The soft descriptor limit the child sets for itself.
CHILD_MAX_FDS = 777

#: A process the test steers over its stdin: each command answers one line on stdout.
CHILD = f"""
import os, resource, sys, threading, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, ({CHILD_MAX_FDS}, hard))
kept = []
stop = threading.Event()
print("ready", flush=True)
for line in sys.stdin:
    command = line.strip()
    if command == "grow":
        kept.append(b"\\x01" * {BALLAST_BYTES})  # written, so resident
        kept.extend(open(os.devnull) for _ in range({EXTRA_FDS}))
        for _ in range({EXTRA_THREADS}):
            threading.Thread(target=stop.wait, daemon=True).start()
        print("grown", flush=True)
    elif command == "burn":
        start = time.process_time()
        while time.process_time() - start < 0.3:
            pass
        print(time.process_time(), flush=True)
"""


class Child:
    def __init__(self) -> None:
        self.started = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.ask(None) == "ready"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ask(self, command: str | None) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def child() -> Iterator[Child]:
    process = Child()
    yield process
    process.close()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def serving(meter: ProcessMeter, pid: int) -> ProcessFigures:
    daemon, figures = meter.measure(pid)
    assert daemon.role == "daemon" and daemon.pid == os.getpid()
    assert figures.role == "serving" and figures.pid == pid
    return figures


def test_a_child_that_grows_is_measured_by_what_it_added(child: Child) -> None:
    meter = ProcessMeter(clock=Clock())
    before = serving(meter, child.pid)
    assert child.ask("grow") == "grown"
    after = serving(meter, child.pid)

    grown = after.resident_bytes - before.resident_bytes
    assert BALLAST_BYTES - 2 * MIB <= grown <= BALLAST_BYTES + 8 * MIB
    assert after.virtual_bytes - before.virtual_bytes >= BALLAST_BYTES
    assert before.open_fds is not None and after.open_fds is not None
    assert after.open_fds - before.open_fds == EXTRA_FDS
    assert after.threads - before.threads == EXTRA_THREADS
    assert before.threads == 1
    assert before.max_fds == after.max_fds == CHILD_MAX_FDS
    # /proc/stat's boot time is whole seconds, so the start time is good to about a second.
    assert abs(after.start_time_seconds - child.started) < 2.0
    assert after.start_time_seconds == before.start_time_seconds


def test_cpu_seconds_are_the_childs_own_cpu_time(child: Child) -> None:
    meter = ProcessMeter()
    used = float(child.ask("burn"))
    figures = serving(meter, child.pid)
    assert used >= 0.3
    # utime and stime count in clock ticks (10 ms) and are split from the precise runtime.
    assert figures.cpu_seconds == pytest.approx(used, abs=0.05)


def test_pss_is_read_on_its_own_cadence(child: Child) -> None:
    clock = Clock()
    meter = ProcessMeter(clock=clock)
    first = serving(meter, child.pid).pss_bytes
    assert first is not None and 0 < first < BALLAST_BYTES
    assert child.ask("grow") == "grown"

    clock.now = PSS_EVERY_SECONDS - 0.5
    held = serving(meter, child.pid)
    assert held.pss_bytes == first
    assert held.resident_bytes >= BALLAST_BYTES  # the rest is read every time

    clock.now = PSS_EVERY_SECONDS
    fresh = serving(meter, child.pid).pss_bytes
    # The ballast is private to the child: all of it counts in its PSS.
    assert fresh is not None and fresh - first >= BALLAST_BYTES - 2 * MIB


def test_a_new_serving_process_is_measured_at_once(child: Child) -> None:
    clock = Clock()
    meter = ProcessMeter(clock=clock)
    assert child.ask("grow") == "grown"
    big = serving(meter, child.pid).pss_bytes
    replacement = Child()
    try:
        clock.now = 1.0
        small = serving(meter, replacement.pid).pss_bytes
    finally:
        replacement.close()
    assert big is not None and big >= BALLAST_BYTES
    assert small is not None and small < BALLAST_BYTES


def test_a_serving_process_that_is_gone_is_left_out(child: Child) -> None:
    meter = ProcessMeter()
    serving(meter, child.pid)
    child.close()
    (daemon,) = meter.measure(child.pid)
    assert daemon.role == "daemon"


def test_the_daemon_measures_itself() -> None:
    meter = ProcessMeter()
    before_cpu = sum(os.times()[:2])
    (before,) = meter.measure()
    stop = threading.Event()
    threads = [threading.Thread(target=stop.wait) for _ in range(2)]
    files = [open(os.devnull) for _ in range(10)]  # noqa: SIM115
    try:
        for thread in threads:
            thread.start()
        (after,) = meter.measure()
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        for handle in files:
            handle.close()
    after_cpu = sum(os.times()[:2])
    assert before.pid == after.pid == os.getpid()
    assert before_cpu - 0.02 <= before.cpu_seconds <= after.cpu_seconds <= after_cpu + 0.02
    assert after.threads - before.threads == 2
    assert before.open_fds is not None and after.open_fds is not None
    assert after.open_fds - before.open_fds == 10
    assert after.pss_bytes is not None and 0 < after.pss_bytes <= after.resident_bytes


def test_max_open_files_from_proc_limits() -> None:
    header = "Limit                     Soft Limit           Hard Limit           Units     \n"
    row = "Max open files            {}                1048576              files     \n"
    assert parse_max_open_files(header + row.format("1024")) == 1024
    assert parse_max_open_files(header + row.format("unlimited")) is None
    assert parse_max_open_files(header) is None
    own = parse_max_open_files(Path("/proc/self/limits").read_text())
    assert own == resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def figures(role: str, **changes: object) -> ProcessFigures:
    values: dict[str, object] = {
        "role": role,
        "pid": 100,
        "cpu_seconds": 1.5,
        "resident_bytes": 40 * MIB,
        "virtual_bytes": 300 * MIB,
        "threads": 4,
        "start_time_seconds": 1_700_000_000.25,
        "open_fds": 12,
        "max_fds": 1024,
        "pss_bytes": 30 * MIB,
    }
    values.update(changes)
    return ProcessFigures(**values)  # type: ignore[arg-type]


def test_process_figures_are_exported_under_the_process_collectors_names() -> None:
    snapshot = Snapshot(
        cycle=1,
        monotonic=1.0,
        wall_time=1.0,
        processes=(figures("daemon"), figures("serving", max_fds=None, pss_bytes=None)),
    )
    lines = set(render(snapshot, [families]).decode().splitlines())
    for series in (
        'process_cpu_seconds_total{process="daemon"} 1.5',
        'process_resident_memory_bytes{process="daemon"} 4.194304e+07',
        'process_virtual_memory_bytes{process="serving"} 3.145728e+08',
        'process_open_fds{process="serving"} 12.0',
        'process_max_fds{process="daemon"} 1024.0',
        'process_start_time_seconds{process="daemon"} 1.70000000025e+09',
        'nodescope_process_threads{process="serving"} 4.0',
        'nodescope_process_pss_bytes{process="daemon"} 3.145728e+07',
        "# TYPE process_cpu_seconds_total counter",
    ):
        assert series in lines
    # A figure that could not be read (or an unlimited limit) has no series.
    assert not any(line.startswith('process_max_fds{process="serving"}') for line in lines)
    assert not any(
        line.startswith('nodescope_process_pss_bytes{process="serving"') for line in lines
    )


def test_snapshots_outside_the_daemon_have_no_process_families() -> None:
    text = render(Snapshot(cycle=1, monotonic=1.0, wall_time=1.0), [families]).decode()
    assert "process_" not in text


def test_only_the_process_collectors_names_go_without_the_prefix() -> None:
    with pytest.raises(ValueError, match="nodescope_ prefix"):
        metric("process_cpu_seconds", "gauge", "not a name of the process collector", area="self")


def test_the_daemon_exports_its_own_and_its_serving_processs_figures(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    config = default_config(listen="127.0.0.1:0", roots=Roots.under(tmp_path))
    service = Service(
        lambda: config,
        notifier=Notifier(address=""),
        make_collector=lambda cfg: Collector.from_config(cfg, []),
    )
    service.start_server()
    try:
        assert service.server is not None and service.server.process is not None
        assert service.run_cycle()
        _, body = service.cache.body()
    finally:
        service.shutdown()
    text = body.decode()
    value = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("process_")
    }
    for role in ("daemon", "serving"):
        assert f'process_open_fds{{process="{role}"}}' in value
    # The serving process is a small interpreter the daemon (this test) started.
    assert (
        value['process_resident_memory_bytes{process="serving"}']
        < value['process_resident_memory_bytes{process="daemon"}']
    )
    assert (
        value['process_start_time_seconds{process="serving"}']
        >= value['process_start_time_seconds{process="daemon"}']
    )
