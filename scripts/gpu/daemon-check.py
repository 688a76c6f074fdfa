#!/usr/bin/env python3
"""Run ``nodescope run`` on this machine for a while and say what it cost and served.

    python3 scripts/gpu/daemon-check.py --seconds 30 --metrics metrics.txt > summary.json

The daemon runs from this tree with the configuration's defaults (an empty configuration file,
so an ``/etc/nodescope`` left on the machine changes nothing), on a loopback port and with a
run directory of its own. Once
``/healthz`` answers 200 and a few cycles have passed, its CPU time (user and system, the
daemon and its serving process together) and RSS are read, again after ``--seconds``, then
``/metrics`` is scraped and saved; the daemon is stopped with SIGTERM. The JSON on stdout
gives CPU milliseconds per one-second cycle, RSS, the series count, each source's
``nodescope_source_up`` and the tail of the daemon's log. Exit status 0 when the daemon
served and stopped cleanly, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
#: Cycles left to pass after /healthz first answers, before the window: the first cycles read
#: everything (the PCI tree, every cgroup) and are not the steady state.
WARM_UP_SECONDS = 5.0
READY_SECONDS = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def cpu_seconds(pid: int) -> float:
    """User and system time of ``pid`` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def sources_up(exposition: str) -> dict[str, float]:
    up: dict[str, float] = {}
    for line in exposition.splitlines():
        if line.startswith("nodescope_source_up{"):
            labels, _, value = line.rpartition(" ")
            name = labels.split('source="', 1)[1].split('"', 1)[0]
            up[name] = float(value)
    return up


def check(
    seconds: float, metrics_path: Path | None, python: str = sys.executable
) -> dict[str, Any]:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="nodescope-daemon-check-") as tmp:
        config = Path(tmp) / "nodescope.toml"
        config.write_text("")
        log_path = Path(tmp) / "daemon.log"
        # Its own /run: the hooks socket and state of a daemon already on the machine stay
        # untouched.
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO / "daemon"), str(REPO / "exporters"), env.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep)
        base = f"http://127.0.0.1:{port}"
        summary: dict[str, Any] = {"listen": f"127.0.0.1:{port}", "seconds": seconds}
        with log_path.open("w") as log:
            daemon = subprocess.Popen(
                [python, "-m", "nodescope.cli.main", "run", "--config", str(config),
                 "--listen", f"127.0.0.1:{port}", "--run", str(run_dir)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        try:
            started = time.monotonic()
            while get(f"{base}/healthz", 2.0)[0] != 200:
                if daemon.poll() is not None or time.monotonic() - started > READY_SECONDS:
                    summary["error"] = "the daemon never answered /healthz with 200"
                    break
                time.sleep(0.2)
            else:
                summary["ready_seconds"] = round(time.monotonic() - started, 2)
                time.sleep(WARM_UP_SECONDS)
                pids = [daemon.pid, *children(daemon.pid)]
                before = {pid: cpu_seconds(pid) for pid in pids}
                t0 = time.monotonic()
                time.sleep(seconds)
                after = {pid: cpu_seconds(pid) for pid in pids}
                window = time.monotonic() - t0
                status, body = get(f"{base}/metrics")
                text = body.decode(errors="replace")
                if metrics_path is not None:
                    metrics_path.write_bytes(body)
                cpu = sum(after[p] - before[p] for p in pids)
                summary.update(
                    window_seconds=round(window, 3),
                    # The tick is one second: CPU per second is CPU per cycle.
                    cpu_ms_per_cycle=round(cpu * 1000 / window, 3),
                    daemon_cpu_ms_per_cycle=round(
                        (after[daemon.pid] - before[daemon.pid]) * 1000 / window, 3
                    ),
                    rss_kib={str(pid): rss_kib(pid) for pid in pids},
                    metrics_status=status,
                    metrics_bytes=len(body),
                    series=sum(1 for line in text.splitlines() if line and line[0] != "#"),
                    sources_up=sources_up(text),
                )
        finally:
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
                try:
                    daemon.wait(30)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
            summary["exit_status"] = daemon.returncode
            summary["log_tail"] = log_path.read_text(errors="replace").splitlines()[-30:]
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=30.0, help="the measured window")
    parser.add_argument("--metrics", type=Path, help="where to save the scraped /metrics")
    args = parser.parse_args(argv)
    summary = check(args.seconds, args.metrics)
    print(json.dumps(summary, indent=2))
    served = summary.get("metrics_status") == 200 and summary.get("exit_status") == 0
    return 0 if served else 1


if __name__ == "__main__":
    sys.exit(main())
