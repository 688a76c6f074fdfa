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

from nodescope.model.probe import (
    EXIT_FAILED,
    EXIT_USAGE,
    REPORT_SCHEMA,
    AllReduceLatency,
    SweepSizes,
    parse_report,
)
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.probe.sweep import QUICK
from nodescope.probe_runner import ProbeRunner
from nodescope.roots import Roots
from nodescope.sources.probe_report import make_source, state_path
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
    # The small-message latency, beside the bandwidth: 8 B … 4 KiB by 8, each size timed
    # QUICK.allreduce_latency_iters times, one all-reduce at a time.
    assert report.sizes == SweepSizes(
        custom=False,
        copy=QUICK.copy_sizes,
        allreduce=QUICK.allreduce_sizes,
        allreduce_latency=(8, 64, 512, 4096),
    )
    _assert_latency(ar.latency, (8, 64, 512, 4096), QUICK.allreduce_latency_iters)
    # --record left the report where the daemon's probe source reads it.
    recorded = make_source().collect(Roots(run=tmp_path / "run"))
    assert recorded == report
    # The stderr carries no warnings (torch's NumPy one is filtered in every rank).
    assert "Warning" not in proc.stderr


def _assert_latency(
    latency: tuple[AllReduceLatency, ...], sizes: tuple[int, ...], iterations: int
) -> None:
    assert [f.size_bytes for f in latency] == list(sizes)
    for figure in latency:
        assert figure.iterations == iterations
        assert 0 < figure.min_seconds <= figure.median_seconds <= figure.p99_seconds
        # One all-reduce of a few bytes over loopback: microseconds to milliseconds.
        assert 1e-6 < figure.median_seconds < 0.5


def test_custom_sizes_replace_the_sweeps_and_the_small_ones_give_the_latency() -> None:
    proc = _probe("--quick", "--json", "--cpu", "--sizes", "1M,8,64K,4K")
    assert proc.returncode == 0, proc.stderr
    jsonschema.validate(json.loads(proc.stdout), REPORT_SCHEMA)
    report = parse_report(proc.stdout)
    wanted = (8, 4096, 65536, 1 << 20)
    assert report.sizes == SweepSizes(True, wanted, wanted, (8, 4096))
    for series in report.copies:
        assert tuple(p.size_bytes for p in series.points) == wanted
    ar = report.allreduce
    assert ar is not None, report.skipped
    assert tuple(p.size_bytes for p in ar.points) == wanted
    _assert_latency(ar.latency, (8, 4096), QUICK.allreduce_latency_iters)
    assert ar.latency_floor == ar.latency[0]
    # The table says it too.
    text = _probe("--quick", "--cpu", "--sizes", "8,64K")
    assert text.returncode == 0, text.stderr
    assert "sizes (--sizes): 8,64K" in text.stdout
    assert "Small-message latency: " in text.stdout and " us p99 (8B, " in text.stdout


# torch warns at import that NumPy is absent; the probe does not use NumPy.
@pytest.mark.filterwarnings("ignore:Failed to initialize NumPy")
@pytest.mark.alone  # medians a few milliseconds apart
def test_the_latency_figure_shows_a_delay_hidden_in_every_all_reduce(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank that waits 3 ms before each all-reduce, as a hidden barrier would: the other
    rank waits with it, and the median moves by the delay. The gloo ranks are forked from
    this process, so they inherit the patched call."""
    import torch.distributed as dist

    from nodescope.probe import allreduce

    def run() -> AllReduceLatency:
        result = allreduce.run(
            "gloo", 2, (8,), 1, 2, timeout=60.0, latency_sizes=(8,), latency_warmup=2,
            latency_iters=30,
        )  # fmt: skip
        (figure,) = result.latency
        assert figure.iterations == 30
        return figure

    plain = run()
    real = dist.all_reduce
    delay = 3e-3

    def behind_a_barrier(tensor: object, *args: object, **kwargs: object) -> object:
        if dist.get_rank() == 1:
            time.sleep(delay)
        return real(tensor, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(dist, "all_reduce", behind_a_barrier)
    slowed = run()
    print(f"8 B all-reduce median: {plain.median_seconds * 1e6:.0f} us plain,"
          f" {slowed.median_seconds * 1e6:.0f} us behind a {delay * 1e3:.0f} ms wait")  # fmt: skip
    assert slowed.min_seconds >= delay * 0.9
    assert slowed.median_seconds >= plain.median_seconds + delay * 0.9


def test_a_bad_size_list_exits_2_naming_it() -> None:
    proc = _probe("--sizes", "4K,1.5M", timeout=60)
    assert proc.returncode == EXIT_USAGE
    assert proc.stdout == ""
    assert proc.stderr.splitlines()[-1] == (
        "nodescope probe: error: argument --sizes: '1.5M' is not a size"
        " (a whole number with an optional K, M or G: 4K, 1M)"
    )


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
