"""The daemon's serving process as real processes: replaced when it dies, gone when the daemon
stops or is killed, and never the one that talks to systemd."""

from __future__ import annotations

import base64
import gzip
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodescope.httpserver import SERVING_COMMAND_LINE
from tests.integration.daemon_harness import Daemon, sample_value, wait_for

# A serving process replaced within a cycle or two, the daemon ready within 5 s: bounds on a
# machine of its own.
pytestmark = pytest.mark.alone

CONFIG = """
[daemon]
tick_seconds = 0.2
log_level = "info"
"""


def serving_children(pid: int) -> list[int]:
    """The serving processes whose parent is ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if ppid == pid and SERVING_COMMAND_LINE.search(cmdline):
            found.append(int(entry))
    return found


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (reaped, or a zombie waiting for its new parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"


def the_serving_process(daemon: Daemon) -> int:
    wait_for(lambda: len(serving_children(daemon.proc.pid)) == 1, 5, "one serving process")
    (child,) = serving_children(daemon.proc.pid)
    return child


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    cfg = tmp_path / "nodescope.toml"
    cfg.write_text(CONFIG)
    started = Daemon(tmp_path, ["--config", str(cfg)])
    yield started
    started.stop()  # again for a test that did; for one that failed, its only stop


def test_a_killed_serving_process_is_replaced_within_a_cycle_or_two(daemon: Daemon) -> None:
    try:
        daemon.wait_message("READY=1", timeout=5)
        child = the_serving_process(daemon)
        environ = Path(f"/proc/{child}/environ").read_bytes()
        assert b"NOTIFY_SOCKET" not in environ  # only the daemon talks to systemd
        os.kill(child, signal.SIGKILL)
        killed = time.monotonic()
        body = daemon.scrape()  # waits in the backlog until the new process takes it
        assert time.monotonic() - killed < 2 * 0.2 + 1.0
        assert (sample_value(body, "nodescope_cycles_total") or 0) >= 1
        wait_for(lambda: "event=serving_exited" in daemon.stderr(), 5, "the exit in the log")
        assert f'pid={child} ended="signal=SIGKILL"' in daemon.stderr()
        assert the_serving_process(daemon) != child
        # gzip as Prometheus asks for it, from the new process.
        request = urllib.request.Request(
            f"http://127.0.0.1:{daemon.port}/metrics", headers={"Accept-Encoding": "gzip"}
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.headers["Content-Encoding"] == "gzip"
            assert b"nodescope_cycles_total" in gzip.decompress(response.read())
    finally:
        assert daemon.stop() == 0


def test_sigterm_stops_the_serving_process_too(daemon: Daemon) -> None:
    daemon.wait_message("READY=1", timeout=5)
    child = the_serving_process(daemon)
    start = time.monotonic()
    assert daemon.stop() == 0
    assert time.monotonic() - start < 2.0
    wait_for(lambda: gone(child), 2, "the serving process to exit")


def test_no_orphan_when_the_daemon_is_killed(daemon: Daemon) -> None:
    daemon.wait_message("READY=1", timeout=5)
    child = the_serving_process(daemon)
    daemon.proc.kill()
    daemon.proc.wait(5)
    # The channel's other end closed with the daemon: the serving process exits by itself.
    wait_for(lambda: gone(child), 3, "the serving process to exit")
    daemon.stop()


@pytest.mark.skipif(shutil.which("htpasswd") is None, reason="htpasswd: apache2-utils")
def test_nodescope_run_with_a_web_config_asks_for_the_password(tmp_path: Path) -> None:
    """``--web-config-file`` reaches the serving process: 401 without the password, 200 with
    it (a hash made by htpasswd); the serving process is not root when the daemon is."""
    line = subprocess.run(
        ["htpasswd", "-nbBC", "10", "prometheus", "s3cret"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout.strip()  # fmt: skip
    web = tmp_path / "web-config.yml"
    web.write_text(f"basic_auth_users:\n  prometheus: '{line.split(':', 1)[1]}'\n")
    cfg = tmp_path / "nodescope.toml"
    cfg.write_text(CONFIG)
    daemon = Daemon(tmp_path, ["--config", str(cfg), "--web-config-file", str(web)])
    try:
        daemon.wait_message("READY=1", timeout=5)
        with pytest.raises(urllib.error.HTTPError) as refused:
            daemon.scrape()
        assert refused.value.code == 401
        assert refused.value.headers["WWW-Authenticate"].startswith("Basic ")
        token = base64.b64encode(b"prometheus:s3cret").decode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{daemon.port}/metrics", headers={"Authorization": f"Basic {token}"}
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            assert b"nodescope_cycles_total" in response.read()
        if os.geteuid() == 0:
            status = Path(f"/proc/{the_serving_process(daemon)}/status").read_text()
            assert re.search(r"^Uid:\s+(\d+)", status, re.M).group(1) != "0"  # type: ignore[union-attr]
    finally:
        assert daemon.stop() == 0
