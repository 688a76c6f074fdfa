"""scripts/gpu/device-check.sh, the one run prepared for a machine with a real GPU, run here on
this machine (no GPU: the NVML steps say so; the daemon, the snapshot and the probe's CPU
stand-in run for real). What comes back from such a machine is at most eight files in one
folder, named in letters, digits, '.', '_' and '-': the script must fit that."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.unit.test_fake_nvml import real_nvml_missing

SCRIPT = REPO / "scripts" / "gpu" / "device-check.sh"
EXPECTED = {
    "log.txt",
    "nvml-check.json",
    "nvml-source.txt",
    "snapshot.json",
    "summary.json",
    "metrics.txt",
    "probe.json",
    "probe-check.txt",
}


@pytest.mark.integration
def test_the_device_run_leaves_its_eight_files_with_what_each_step_found(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {
        **os.environ,
        "OUT": str(out),
        "PYTHON": sys.executable,
        "WHEELS": str(tmp_path / "no-wheels"),
        "COST_REPEAT": "3",
        "RUN_SECONDS": "3",
        # A budget under the 20 s probe-check.sh wants for a full sweep: whatever the quick
        # run takes, the full sweep is skipped, as the script says (25 s left 20 when the
        # quick run took 5 s, and the sweep ran).
        "PROBE_BUDGET": "19",
    }
    proc = subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=420, cwd=REPO
    )
    files = {p.name for p in out.iterdir()}
    assert files == EXPECTED, proc.stdout + proc.stderr
    for path in out.iterdir():
        assert path.is_file() and re.fullmatch(r"[A-Za-z0-9._-]+", path.name)
        assert path.stat().st_size < 16 << 20

    log = (out / "log.txt").read_text()
    nvml = json.loads((out / "nvml-check.json").read_text())
    if not real_nvml_missing():
        assert nvml["initialised"] is True
        assert "== nvml-check: exit 0 " in log
    else:  # each NVML step ran and said NVML is not there; the run as a whole did not pass
        assert nvml["initialised"] is False
        assert "== nvml-check: exit 2 " in log and "== nvml-source: exit 2 " in log
        assert "NVML is unavailable" in (out / "nvml-source.txt").read_text()
        assert proc.returncode == 1

    summary = json.loads((out / "summary.json").read_text())
    assert summary["metrics_status"] == 200 and summary["exit_status"] == 0
    assert summary["cpu_ms_per_cycle"] > 0 and summary["series"] > 100
    assert summary["sources_up"]["pci"] == 1.0 and "nvml" in summary["sources_up"]
    metrics = (out / "metrics.txt").read_text()
    assert 'nodescope_source_up{source="nvml"}' in metrics

    snapshot = json.loads((out / "snapshot.json").read_text())
    assert snapshot  # every source read twice, as `nodescope snapshot --json` prints it
    probe = json.loads((out / "probe.json").read_text())
    assert probe["quick"] is True and probe["backend"]
    assert re.search(r"== probe --quick: exit \d+ after \d+ ms", log)
    assert "no time left for the full sweep" in (out / "probe-check.txt").read_text()
    assert "== done: " in log
