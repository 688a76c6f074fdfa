"""``nodescope demo`` as a real process: /metrics of the simulated node while it runs (GPU
series from the fake NVML, disk and InfiniBand series from the files the simulator writes),
linted by ``promtool check metrics``, and a clean exit that removes the node's directory."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from tests.conftest import nodescope_command
from tests.integration.daemon_harness import free_port

pytestmark = pytest.mark.integration

#: Counter families that must be exported and move while the default scenario runs.
MOVING = {
    "gpu": ("nodescope_gpu_pcie_tx_bytes_total", "nodescope_gpu_pcie_rx_bytes_total"),
    "disk": ("nodescope_disk_read_bytes_total", "nodescope_disk_written_bytes_total"),
    "infiniband": (
        "nodescope_infiniband_port_data_transmitted_bytes_total",
        "nodescope_infiniband_port_data_received_bytes_total",
    ),
}

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def samples(text: str) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return out


class Demo:
    """``nodescope demo ARGS`` on a free port; ``wrapper`` runs it under another command
    (strace, say), ``env`` adds to its environment."""

    def __init__(
        self,
        workdir: Path,
        *args: str,
        wrapper: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.stdout_path = workdir / "demo.stdout"
        self.stderr_path = workdir / "demo.stderr"
        environ = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        environ.pop("NOTIFY_SOCKET", None)
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            self.proc = subprocess.Popen(
                [
                    *wrapper,
                    *nodescope_command(),
                    "demo",
                    "--no-tty",
                    "--listen",
                    f"127.0.0.1:{self.port}",
                    *args,
                ],
                stdout=out,
                stderr=err,
                env=environ,
            )

    def output(self) -> str:
        return self.stdout_path.read_text(errors="replace") + self.stderr_path.read_text(
            errors="replace"
        )

    def scrape(self, timeout: float = 60.0) -> str:
        """/metrics once the first cycle is done (materialising a DGX takes a moment)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"demo exited early:\n{self.output()}"
            try:
                url = f"http://127.0.0.1:{self.port}/metrics"
                with urllib.request.urlopen(url, timeout=5) as r:
                    body: bytes = r.read()
                    return body.decode()
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.1)
        raise AssertionError(f"no /metrics within {timeout}s:\n{self.output()}")

    def root(self) -> Path:
        m = re.search(r"node under (\S+), serving", self.output())
        assert m, self.output()
        return Path(m.group(1))

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"demo did not stop within {timeout}s:\n{self.output()}") from None


@pytest.fixture
def demos(tmp_path: Path) -> Iterator[list[Demo]]:
    started: list[Demo] = []
    yield started
    for d in started:
        if d.proc.poll() is None:
            # SIGTERM first, so a failed test still lets the demo remove its directory.
            d.proc.terminate()
            try:
                d.proc.wait(10)
            except subprocess.TimeoutExpired:
                d.proc.kill()
                d.proc.wait()


def test_demo_serves_changing_gpu_disk_and_ib_series(tmp_path: Path, demos: list[Demo]) -> None:
    # The healthy baseline: every GPU, drive and HCA carries traffic from t=0 (the default
    # scenario's NVMe reads start only at t=10).
    demo = Demo(tmp_path, "dgx-h100", "--duration", "8")
    demos.append(demo)
    first = demo.scrape()
    root = demo.root()
    assert root.is_dir()
    time.sleep(3.0)
    second = demo.scrape()

    before, after = samples(first), samples(second)
    for area, names in MOVING.items():
        present = [k for k in after if k[0] in names]
        assert present, f"no {area} series in /metrics:\n{second[:2000]}"
        moved = [k for k in present if k in before and after[k] != before[k]]
        assert moved, f"{area} series did not change in 3 s: {present[:4]}"
    assert after[("nodescope_source_up", '{source="nvml"}')] == 1

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed (scripts/lib.sh installs Debian's prometheus)")
    lint = subprocess.run(
        [promtool, "check", "metrics"], input=second, capture_output=True, text=True
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr

    assert demo.wait(30) == 0, demo.output()
    out = demo.stdout_path.read_text()
    assert out.count("--- t=") >= 5, out  # one block per second for 8 s
    assert "sources:" in out
    assert not root.exists(), f"{root} left behind"
    assert f"removed {root}" in out


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_demo_stops_cleanly_on_a_signal(
    tmp_path: Path, demos: list[Demo], signum: signal.Signals
) -> None:
    demo = Demo(tmp_path, "--duration", "120")  # the default scenario
    demos.append(demo)
    demo.scrape()
    root = demo.root()
    assert "nodescope demo: scenario root-port-contention" in demo.output()
    demo.proc.send_signal(signum)
    assert demo.wait(15) == 0, demo.output()
    assert not root.exists(), f"{root} left behind"
    assert "Traceback" not in demo.output()
