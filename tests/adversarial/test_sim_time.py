"""Time on a loaded machine: ``nodescope demo root-port-contention`` fires its contention
alert with the default settings while every CPU is busy.

The scenario's loader reads 6.5 GB/s from nvme0n1 while GPU 0 copies 41 GB/s over the same
root port from t = 10 to 50. The contention finding needs the drive's share of the port's
traffic (about 13 %) over ``min_share`` (10 %): a disk rate read as half of the true one, or a
cycle without it, drops the finding, and the built-in rule wants it held for 30 s. Counters
that advanced in per-tick steps, read by a daemon whose cycles a busy machine delays by a
fraction of a second, gave 0, 1 or 2 ticks of traffic between two reads a second apart, and
the pending alert was cancelled before it could fire.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.conftest import nodescope_command
from tests.integration.daemon_harness import free_port

#: Seconds the busy loops may run at most, whatever happens to the test.
LOAD_LIMIT_SECONDS = 150
_ALERT = re.compile(
    r"^nodescope_alert_active\{"
    r'(?=[^}]*kind="pcie_contention")(?=[^}]*state="firing")[^}]*\} 1(\.0)?$',
    re.MULTILINE,
)
_CANCELLED = re.compile(
    r'^nodescope_alert_transitions_total\{kind="pcie_contention",to="cancelled"\} (\S+)$',
    re.MULTILINE,
)


@contextmanager
def busy_cpus(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` processes that spin until killed, or ``LOAD_LIMIT_SECONDS`` at most."""
    spin = (
        "import time\n"
        f"end = time.monotonic() + {LOAD_LIMIT_SECONDS}\n"
        "while time.monotonic() < end:\n"
        "    pass\n"
    )
    loops = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(count)]
    try:
        yield loops
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            body: bytes = r.read()
            return body.decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def test_the_contention_demo_fires_its_alert_on_a_loaded_machine(tmp_path: Path) -> None:
    port = free_port()
    out_path, err_path = tmp_path / "demo.stdout", tmp_path / "demo.stderr"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("NOTIFY_SOCKET", None)
    fired_at: float | None = None
    last = ""
    # Two spinning processes per CPU: the daemon's threads wait for a CPU at every wake-up,
    # so its reads land late by a varying fraction of its tick.
    with busy_cpus(2 * (os.cpu_count() or 2)) as loops:
        with out_path.open("wb") as out, err_path.open("wb") as err:
            demo = subprocess.Popen(
                [
                    *nodescope_command(),
                    "demo",
                    "--no-tty",
                    "--listen",
                    f"127.0.0.1:{port}",
                    # The contention lasts from t = 10 to 50 and the rule's `for` is 30 s.
                    "--duration",
                    "55",
                    "root-port-contention",
                ],
                stdout=out,
                stderr=err,
                env=env,
            )
        started = time.monotonic()
        try:
            while demo.poll() is None and time.monotonic() - started < 100:
                body = _scrape(port)
                if body is not None:
                    last = body
                    if _ALERT.search(body):
                        fired_at = time.monotonic() - started
                        break
                time.sleep(0.5)
            spun = sum(_cpu_seconds(loop.pid) for loop in loops)
        finally:
            demo.terminate()
            try:
                demo.wait(20)
            except subprocess.TimeoutExpired:
                demo.kill()
                demo.wait()
    elapsed = time.monotonic() - started
    output = out_path.read_text(errors="replace") + err_path.read_text(errors="replace")
    cancelled = _CANCELLED.search(last)
    assert fired_at is not None, (
        f"no firing pcie_contention alert in {elapsed:.0f}s (cancelled "
        f"{cancelled.group(1) if cancelled else 0} times)\n{output[-4000:]}"
    )
    # The loops had the CPUs the demo did not take (less on a machine shared with others).
    assert spun > 0.25 * elapsed, f"the busy loops ran {spun:.0f} CPU s in {elapsed:.0f} s"
    assert cancelled is None or float(cancelled.group(1)) == 0, last
