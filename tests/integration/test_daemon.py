"""The daemon as a real process on this machine: READY, /metrics, reload, a source losing its
input mid-run, and a clean SIGTERM."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import nodescope_command
from tests.integration.daemon_harness import Daemon, sample_value, wait_for

# Ready within 5 s, stopped within 2 s of SIGTERM: bounds on a machine of its own.
pytestmark = pytest.mark.alone

CONFIG = """
[daemon]
tick_seconds = 0.2
log_level = "info"
[sources.disks]
interval_seconds = 0.2
[sources.pci]
interval_seconds = 0.2
"""


@pytest.fixture
def procfs(tmp_path: Path) -> Path:
    """A procfs root whose diskstats the test can take away; the rest is the real /proc."""
    root = tmp_path / "proc"
    root.mkdir()
    for name in ("diskstats", "uptime"):
        shutil.copyfile(f"/proc/{name}", root / name)
    return root


def promtool_check(exposition: str) -> None:
    if shutil.which("promtool") is None:
        pytest.fail("promtool is not installed (scripts/test.sh installs Debian's prometheus)")
    proc = subprocess.run(
        ["promtool", "check", "metrics"], input=exposition, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_daemon_lifecycle(tmp_path: Path, procfs: Path) -> None:
    cfg = tmp_path / "nodescope.toml"
    cfg.write_text(CONFIG)
    daemon = Daemon(tmp_path, ["--config", str(cfg), "--procfs", str(procfs)])
    try:
        daemon.wait_message("READY=1", timeout=5)
        assert time.monotonic() - daemon.started < 5
        body = daemon.scrape()
        assert sample_value(body, 'nodescope_source_up{source="disks"}') == 1
        assert sample_value(body, 'nodescope_source_up{source="pci"}') == 1
        assert "nodescope_build_info{" in body
        promtool_check(body)

        # A broken config on SIGHUP: the old one stays, the reason is logged.
        cfg.write_text("[daemon]\ntick_seconds = 'often'\n")
        daemon.signal(signal.SIGHUP)
        daemon.wait_message("RELOADING=1", timeout=5)
        daemon.wait_message("READY=1", timeout=5)
        wait_for(lambda: "reload_failed" in daemon.stderr(), 5, "the reload error in the log")
        assert "daemon.tick_seconds" in daemon.stderr()
        cycles_before = sample_value(daemon.scrape(), "nodescope_cycles_total") or 0
        wait_for(
            lambda: (
                (sample_value(daemon.scrape(), "nodescope_cycles_total") or 0) >= cycles_before + 3
            ),
            5,
            "cycles at the old 0.2 s tick",
        )

        # The disks source loses its input: it goes down, the others are still served.
        (procfs / "diskstats").unlink()
        wait_for(
            lambda: sample_value(daemon.scrape(), 'nodescope_source_up{source="disks"}') == 0,
            5,
            "disks down",
        )
        body = daemon.scrape()
        assert sample_value(body, 'nodescope_source_up{source="pci"}') == 1
        assert (sample_value(body, 'nodescope_source_errors_total{source="disks"}') or 0) >= 1
        promtool_check(body)
        assert daemon.stderr().count("source=disks state=down") == 1

        # The input comes back: the source recovers.
        shutil.copyfile("/proc/diskstats", procfs / "diskstats")
        wait_for(
            lambda: sample_value(daemon.scrape(), 'nodescope_source_up{source="disks"}') == 1,
            5,
            "disks up again",
        )

        # A good config on SIGHUP takes effect.
        cfg.write_text(CONFIG + "\n[sources.cgroups]\nenabled = false\n")
        daemon.signal(signal.SIGHUP)
        daemon.wait_message("READY=1", timeout=5)
        wait_for(
            lambda: 'nodescope_source_up{source="cgroups"}' not in daemon.scrape(),
            5,
            "the cgroups source to go away",
        )
        assert "event=reloaded" in daemon.stderr()

        start = time.monotonic()
        daemon.signal(signal.SIGTERM)
        daemon.proc.wait(timeout=5)
        assert time.monotonic() - start < 2.0
        assert daemon.proc.returncode == 0
        daemon.wait_message("STOPPING=1", timeout=1)
    finally:
        daemon.stop()


def test_daemon_on_the_default_roots_serves_within_5_seconds(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, [], host_run=True)
    try:
        daemon.wait_message("READY=1", timeout=5)
        body = daemon.scrape()
        assert "nodescope_source_up" in body
        promtool_check(body)
        assert daemon.scrape("/healthz") == "ok\n"
    finally:
        assert daemon.stop() == 0


def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    first = Daemon(tmp_path, [])
    try:
        first.wait_message("READY=1", timeout=5)
        proc = subprocess.run(
            [*nodescope_command(), "run", "--listen", f"127.0.0.1:{first.port}"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        assert proc.returncode == 1
        assert "cannot listen" in proc.stderr
    finally:
        first.stop()
