"""`nodescope probe` for real on the CPU stand-in: torch tensors in host memory and a
two-process all-reduce over gloo on 127.0.0.1, the code paths a GPU node runs with CUDA.

Needs torch (the ``probe`` extra); without it the tests are skipped and say why.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest

from nodescope.model.probe import EXIT_FAILED, EXIT_USAGE, REPORT_SCHEMA, parse_report
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.probe_runner import ProbeRunner, make_source, state_path
from nodescope.roots import Roots
from nodescope_exporters import probe_metrics
from nodescope_exporters.prometheus import render
from tests.conftest import REPO, nodescope_command

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("torch") is None,
        reason="torch is not importable: install the probe extra (pip install -e '.[probe]')",
    ),
]

#: The brief's target is ~30 s on an idle 2-core machine; the limit leaves room for a loaded one.
QUICK_LIMIT_SECONDS = 90


def _probe(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*nodescope_command(), "probe", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
    )


def test_quick_probe_on_the_cpu_stand_in_reports_valid_json_and_passes(tmp_path: Path) -> None:
    begin = time.monotonic()
    proc = _probe("--quick", "--json", "--cpu", f"--run={tmp_path / 'run'}", "--record")
    seconds = time.monotonic() - begin
    print(f"nodescope probe --quick --json --cpu: {seconds:.1f} s")
    assert proc.returncode == 0, proc.stderr
    assert seconds < QUICK_LIMIT_SECONDS
    document = json.loads(proc.stdout)
    jsonschema.validate(document, REPORT_SCHEMA)
    report = parse_report(proc.stdout)
    assert report.backend == "cpu" and report.stand_in and report.quick
    assert "CPU stand-in" in report.note and "not PCIe figures" in report.note
    assert report.passed and document["passed"] is True
    # Two stand-in devices, both directions, the quick sweep: 64K 1M 16M 256M.
    assert [(s.device, s.direction) for s in report.copies] == [
        (0, "h2d"),
        (0, "d2h"),
        (1, "h2d"),
        (1, "d2h"),
    ]
    for series in report.copies:
        assert [p.size_bytes for p in series.points] == [1 << 16, 1 << 20, 1 << 24, 1 << 28]
        assert all(p.bytes_per_second > 0 for p in series.points)
        assert series.fraction_of_capacity is None  # no link to compare a memcpy with
        assert not series.pinned
    assert {(p.src, p.dst) for p in report.peers} == {(0, 1), (1, 0)}
    assert len(report.asymmetry) == 1
    ar = report.allreduce
    assert ar is not None, report.skipped
    assert (ar.backend, ar.ranks, ar.dtype) == ("gloo", 2, "float32")
    for point in ar.points:
        # Two ranks: busbw = algbw × 2(2−1)/2 = algbw.
        assert point.busbw_bytes_per_second == pytest.approx(point.algbw_bytes_per_second)
        assert point.algbw_bytes_per_second == pytest.approx(point.size_bytes / point.seconds)
    # --record left the report where the daemon's probe source reads it.
    recorded = make_source().collect(Roots(run=tmp_path / "run"))
    assert recorded == report
    # The stderr carries no warnings (torch's NumPy one is filtered in every rank).
    assert "Warning" not in proc.stderr


def test_impossible_threshold_fails_with_one_line_and_the_daemon_exports_it(
    tmp_path: Path,
) -> None:
    config = tmp_path / "nodescope.toml"
    # 10 TB/s, the most the config allows: no host-to-device copy comes near it.
    config.write_text("[probe]\nmin_h2d_bytes_per_second = 1e13\n")
    table = _probe("--quick", "--cpu", "--no-allreduce", "--config", str(config))
    assert table.returncode == EXIT_FAILED
    reason = [line for line in table.stderr.splitlines() if "FAILED" in line]
    assert len(reason) == 1
    assert reason[0].startswith("nodescope probe: FAILED: cpu0 H2D ")
    assert reason[0].endswith("is below the minimum 10000.0 GB/s (+1 more)")
    assert "CPU stand-in (no GPU)" in table.stdout
    assert "FAILED: 2 threshold(s)" in table.stdout

    # The same through the daemon's runner, which records the report for the exporter.
    roots = Roots.under(tmp_path)
    runner = ProbeRunner(roots, config_path=str(config), timeout=180, extra=["--no-allreduce"])
    outcome = runner.request(quick=True)
    assert outcome.status == EXIT_FAILED, outcome.reason
    assert outcome.report is not None and not outcome.passed
    assert outcome.reason.startswith("cpu0 H2D ")
    assert state_path(roots).exists()
    data = make_source().collect(roots)
    assert data == outcome.report
    snapshot = Snapshot(1, 1.0, time.time(), {"probe": SourceSample("probe", 1.0, 0.0, data)})
    text = render(snapshot, [probe_metrics.families]).decode()
    assert "nodescope_probe_passed 0.0" in text
    assert 'nodescope_probe_threshold_failures{check="min_h2d_bytes_per_second"} 2.0' in text
    assert 'nodescope_probe_h2d_bytes_per_second{gpu="1"}' in text
    stamp = next(line for line in text.splitlines() if line.startswith("nodescope_probe_last_run_"))
    assert abs(float(stamp.split()[-1]) - time.time()) < 300


def test_bad_config_exits_2_before_measuring(tmp_path: Path) -> None:
    config = tmp_path / "nodescope.toml"
    config.write_text("[probe]\nmax_bandwidth_asymmetry = -1\n")
    proc = _probe("--quick", "--config", str(config), timeout=60)
    assert proc.returncode == EXIT_USAGE
    assert proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert "probe.max_bandwidth_asymmetry" in line


def test_the_probe_entry_point_is_its_own_process() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "nodescope.probe", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert proc.returncode == 0
    assert "--quick" in proc.stdout and "--write-report" in proc.stdout
