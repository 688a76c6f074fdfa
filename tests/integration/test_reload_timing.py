"""A reload that changes the tick reaches every process of the daemon: the real daemon, its
config file rewritten and SIGHUP sent, tick 1 s -> 30 s -> 1 s, and /healthz (answered by the
serving process, a process of its own) polled every half second throughout: 200 every time.

The staleness bound /healthz uses follows from the tick (nodescope.timing). A serving
process that kept the bound of the tick it was started with (1 s: 11 s) would answer 503 from
11 s after each cycle until the next, 30 s later, for as long as the long tick holds."""

from __future__ import annotations

import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.integration.daemon_harness import Daemon, sample_value

pytestmark = pytest.mark.integration

#: Two quick sources, so that the 1 s tick is cheap on a loaded test machine.
CONFIG = """
[daemon]
tick_seconds = {tick}
[sources.disks]
interval_seconds = 1
[sources.pci]
interval_seconds = 1
"""

POLL_SECONDS = 0.5


def healthz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def cycles(daemon: Daemon) -> float:
    return sample_value(daemon.scrape(), "nodescope_cycles_total") or 0.0


def test_a_reload_from_1_to_30_to_1_second_ticks_keeps_healthz_healthy(tmp_path: Path) -> None:
    cfg = tmp_path / "nodescope.toml"
    cfg.write_text(CONFIG.format(tick=1))
    daemon = Daemon(tmp_path, ["--config", str(cfg)])
    answers: list[tuple[float, str, int]] = []

    def poll(phase: str, seconds: float) -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            since_start = round(time.monotonic() - daemon.started, 1)
            answers.append((since_start, phase, healthz(daemon.port)))
            time.sleep(POLL_SECONDS)

    def reload_to(tick: int) -> None:
        cfg.write_text(CONFIG.format(tick=tick))
        daemon.signal(signal.SIGHUP)

    try:
        daemon.wait_message("READY=1", timeout=10)
        poll("tick 1 s", 4)
        reload_to(30)
        poll("tick 30 s", 2)
        # The first cycle on the new tick has run (it comes within the old tick): from now
        # on cycles are 30 s apart, well beyond the 11 s bound of a 1 s tick.
        long_tick_from = cycles(daemon)
        poll("tick 30 s", 38)
        long_tick_cycles = cycles(daemon) - long_tick_from
        reload_to(1)
        poll("tick 1 s again", 2)
        short_tick_from = cycles(daemon)
        poll("tick 1 s again", 20)
        short_tick_cycles = cycles(daemon) - short_tick_from
        stderr = daemon.stderr()
    finally:
        daemon.stop()

    unhealthy = [answer for answer in answers if answer[2] != 200]
    assert not unhealthy, f"/healthz not 200 at (seconds since start, phase, status): {unhealthy}"
    assert len(answers) >= 100
    # Both reloads took effect: cycles 30 s apart, then about one a second again.
    assert stderr.count("event=reloaded") == 2, stderr
    assert 1 <= long_tick_cycles <= 2
    assert short_tick_cycles >= 10
