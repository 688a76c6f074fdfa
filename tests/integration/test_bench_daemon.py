"""The benchmark's own processes start and measure: ``bench/daemon.py`` on the simulated node
in real time serves ``/metrics`` with every source up, and ``--baseline`` runs a second
revision's daemon (a git worktree) beside it on the same node."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPOSITORY = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPOSITORY / "bench"))
bench = importlib.import_module("run")  # bench/run.py: a script, not a package

SOURCES = {"pci", "disks", "infiniband", "cgroups", "procs", "locks", "threads", "mountstats",
           "jobs", "udev", "link_events", "nvml", "nvlink_kmod"}  # fmt: skip


def _sources_up(port: int, deadline: float) -> dict[str, str]:
    """``nodescope_source_up`` by source once the slowest source (30 s) has run, or what the
    last scrape said at ``deadline``."""
    up: dict[str, str] = {}
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            body = reply.read().decode()
        up = dict(re.findall(r'^nodescope_source_up\{source="([^"]+)"\} (\S+)$', body, re.M))
        if up.keys() >= SOURCES:
            return up
        time.sleep(1.0)
    return up


def test_the_benchmark_daemon_and_a_baseline_serve_the_simulated_node(tmp_path: Path) -> None:
    head = subprocess.run(
        ["git", "-C", str(REPOSITORY), "rev-parse", "HEAD"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if head.returncode != 0:
        pytest.skip("not a git checkout: no revision to run as the baseline")
    with bench.temp_root("nodescope-benchtest-") as base, bench._checked_out("HEAD") as tree:
        assert (tree / "bench" / "daemon.py").is_file()
        root = base / "node"
        sim = bench.start_simulator("dgx-h100", root)
        targets = []
        # As the overhead phase does: neither daemon serves the node's hook socket.
        try:
            with bench._hook_socket_taken(root):
                port = bench.free_port()
                ours = subprocess.Popen(
                    [bench.PYTHON, str(REPOSITORY / "bench" / "daemon.py"), str(root),
                     "--listen", f"127.0.0.1:{port}", "--stats", str(base / "stats.json")],
                )  # fmt: skip
                targets.append(bench.Target("nodescope", port, ours))
                targets.append(bench._start_baseline(tree, root, base / "baseline-stats.json"))
                deadline = time.monotonic() + 120
                for target in targets:
                    bench.wait_ready(target.port, 120, target.process)
                for target in targets:
                    up = _sources_up(target.port, deadline)
                    assert up.keys() >= SOURCES, (target.name, up)
                    assert {s for s, v in up.items() if v != "1.0"} == set(), (target.name, up)
                for target in targets:
                    bench.stop(target.process)
        finally:
            for target in targets:
                bench.stop(target.process)
            bench.stop(sim)
        for stats in (base / "stats.json", base / "baseline-stats.json"):
            assert stats.is_file(), f"{stats.name}: the daemon wrote no figures on SIGTERM"
    # The worktree is gone from git's list once the run ends.
    listed = subprocess.run(
        ["git", "-C", str(REPOSITORY), "worktree", "list", "--porcelain"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert str(tree) not in listed
