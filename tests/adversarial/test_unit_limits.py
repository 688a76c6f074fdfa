"""The real daemon under the shipped unit's limits (its MemoryMax= and CPUQuota= as cgroups),
with many of the attacks at once: a FIFO for /proc/diskstats, a 100 MB /proc/locks, a FIFO as
a PCI function's attribute, a process named like a stat line, half-sent HTTP requests and idle
connections. It must keep its cycles, its watchdog and its health, and stay within memory."""

from __future__ import annotations

import os
import re
import shutil
import socket
import time
from pathlib import Path

import pytest

from tests.adversarial.common import cgroup_v1_limits, unit_limits
from tests.conftest import HOST_FIXTURE
from tests.integration.daemon_harness import Daemon

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="cgroups need root")


def _hostile_tree(root: Path) -> None:
    shutil.copytree(HOST_FIXTURE, root, symlinks=True)
    (root / "proc" / "diskstats").unlink()
    os.mkfifo(root / "proc" / "diskstats")
    with open(root / "proc" / "locks", "wb") as handle:  # sparse: 100 MB long, nothing in it
        handle.truncate(100 << 20)
    devices = root / "sys" / "bus" / "pci" / "devices"
    first = sorted(devices.iterdir())[0].resolve()
    (first / "class").unlink()
    os.mkfifo(first / "class")
    # A process named like a stat line, as prctl(PR_SET_NAME) lets any user do; its fields
    # after the name are this test's own.
    own = Path("/proc/self/stat").read_text()
    tail = own[own.rindex(")") + 2 :]
    pid = root / "proc" / "4285"
    for stat in (pid / "stat", pid / "task" / "4285" / "stat"):
        stat.write_text(f"4285 (x\ny) R 1) {tail}")


def _value(text: str, sample: str) -> float | None:
    match = re.search(rf"^{re.escape(sample)} (\S+)$", text, flags=re.MULTILINE)
    return float(match.group(1)) if match else None


def test_the_daemon_survives_the_attacks_under_the_units_limits(tmp_path: Path) -> None:
    limits = unit_limits()
    assert "MemoryMax" in limits and "CPUQuota" in limits
    root = tmp_path / "root"
    _hostile_tree(root)
    (root / "run").mkdir()
    config = tmp_path / "nodescope.toml"
    config.write_text("[daemon]\ntick_seconds = 0.2\n")
    daemon = Daemon(
        tmp_path,
        ["--config", str(config), "--sysfs", str(root / "sys"), "--procfs", str(root / "proc"),
         "--cgroupfs", str(root / "sys" / "fs" / "cgroup"), "--run", str(root / "run")],
        env={"WATCHDOG_USEC": "2000000"},
    )  # fmt: skip
    attackers: list[socket.socket] = []
    try:
        with cgroup_v1_limits(daemon.proc.pid, limits) as applied:
            daemon.wait_message("READY=1", 30)
            for i in range(300):
                conn = socket.create_connection(("127.0.0.1", daemon.port), timeout=5)
                if i % 2:
                    conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finished
                attackers.append(conn)
            first = daemon.scrape()
            time.sleep(3)
            # The watchdog is still fed: cycles complete (wait_message raises otherwise).
            daemon.wait_message("WATCHDOG=1", 5)
            second = daemon.scrape()
            health = daemon.scrape("/healthz")
            assert daemon.proc.poll() is None, daemon.stderr()
            assert any(line.startswith("memory.limit_in_bytes=") for line in applied), applied
            peak = None
            for line in Path(f"/proc/{daemon.proc.pid}/cgroup").read_text().splitlines():
                _, controllers, where = line.split(":", 2)
                if "memory" in controllers.split(","):
                    peak_file = Path("/sys/fs/cgroup/memory") / where.lstrip("/")
                    peak_file = peak_file / "memory.max_usage_in_bytes"
                    if peak_file.exists():
                        peak = int(peak_file.read_text())
        log = daemon.stderr()
    finally:
        for conn in attackers:
            conn.close()
        daemon.stop()
    cycles_before = _value(first, "nodescope_cycles_total")
    cycles_after = _value(second, "nodescope_cycles_total")
    assert cycles_before is not None and cycles_after is not None
    # 0.2 s ticks for 3 s under a 50 % CPU quota: cycles go on.
    assert cycles_after - cycles_before >= 5
    assert health.strip() == "ok"
    assert _value(second, 'nodescope_source_up{source="disks"}') == 0.0
    # A lock table past its byte budget is read up to it, and the cut is counted: a flood of
    # locks must not blind the source (docs/security.md, "Lock floods").
    assert _value(second, 'nodescope_source_up{source="locks"}') == 1.0
    truncated = (
        'nodescope_source_records_skipped_total{reason="lock_table_truncated",source="locks"}'
    )
    assert (_value(second, truncated) or 0) >= 1, second
    assert _value(second, 'nodescope_source_up{source="pci"}') == 1.0
    assert _value(second, 'nodescope_source_up{source="threads"}') == 1.0
    assert "FIFO" in log
    assert "Traceback" not in log
    assert peak is not None and peak < 256 << 20
