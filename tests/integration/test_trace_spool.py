"""The spool end to end: a real ``nodescope run`` daemon with ``[sources.traces]`` on a spool
in a temp dir, jobs registered by the real prolog hook over the daemon's socket, the real torch
fixtures dropped in a job's directory owned by the job's uid; then /metrics, ``nodescope alerts
--json``, the epilog's report and ``nodescope report``.

* The fixtures' figures (δ 0.4874 from the splits, rank 3 delayed 0.2 s before one all-reduce:
  tests/fixtures/torch-traces/README.md) come out as the job's series, and the bounds set
  below them make both findings fire, naming the job, the kind and rank 3.
* A file owned by another uid, a symbolic link and a FIFO in the same directory are skipped and
  counted by reason; nothing blocks on the FIFO.
* A large trace of another job keeps the analysis busy for seconds while the cycles go on at
  their cadence and stay short: the cycle never waits for the analysis.
* The epilog's report holds the figures; after it the job's series are gone.

Needs root (files chowned to the job's uid, the hook socket's ACL).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import nodescope_command
from tests.hook_peers import hook_env, run_hook
from tests.integration.daemon_harness import Daemon, sample_value, wait_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="chowns files to the job's uid; needs root"),
]

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "torch-traces"
JOB, BIG_JOB = "7301", "7302"
JOB_UID, OTHER_UID = 4242, 4343
#: Below the fixture's δ (0.4874) and its delayed rank's wait (about 0.2 s).
MAX_SKEW, MAX_WAIT = 0.4, 0.1


def _owned(path: Path, uid: int) -> Path:
    os.chown(path, uid, uid, follow_symlinks=False)
    return path


def _big_trace(path: Path, events: int) -> None:
    """A Kineto trace of rank 0 with ``events`` CPU ops and no collective: tens of MB that
    take the parser seconds."""
    ops = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": i, "dur": 1, "pid": 1, "tid": 1}
        for i in range(events)
    ]
    path.write_text(json.dumps({"distributedInfo": {"rank": 0}, "traceEvents": ops}))


def _alerts(port: int) -> list[dict[str, Any]]:
    done = subprocess.run(
        [*nodescope_command(), "alerts", "--json", "--url", f"http://127.0.0.1:{port}"],
        capture_output=True, text=True, timeout=10, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    alerts: list[dict[str, Any]] = json.loads(done.stdout)["alerts"]
    return [a for a in alerts if a["kind"].startswith("collective_")]


def test_traces_dropped_in_the_spool_become_metrics_findings_and_the_report(
    tmp_path: Path,
) -> None:
    os.chmod(tmp_path, 0o755)
    run, reports, spool = tmp_path / "run", tmp_path / "reports", tmp_path / "spool"
    run.mkdir()
    (tmp_path / "dev").mkdir()
    spool.mkdir()
    os.chmod(spool, 0o1733)  # as packaged: anyone may make a directory, nobody may list
    config = tmp_path / "nodescope.toml"
    config.write_text(
        "[daemon]\ntick_seconds = 0.2\n"
        f'[roots]\nrun = "{run}"\ndev = "{tmp_path / "dev"}"\n'
        "[sources.jobs]\ninterval_seconds = 0.2\n"
        f'[sources.traces]\nspool_dir = "{spool}"\ninterval_seconds = 0.2\n'
        f"max_file_bytes = {96 << 20}\n"
        # The large trace must be parsed, not refused: a budget and a parser memory for it.
        f"max_objects_per_job = 20000000\nparser_memory_bytes = {3 << 30}\n"
        f"[detectors.collectives]\nmax_skew = {MAX_SKEW}\nmax_wait_seconds = {MAX_WAIT}\n"
        f'[slurm]\nslurm_user = "root"\nreports_dir = "{reports}"\nscontrol = ""\n'
        "expected_gpus = 0\n"
    )
    daemon = Daemon(tmp_path, ["--config", str(config)])
    try:
        daemon.wait_message("READY=1", timeout=30)
        wait_for((run / "nodescope" / "nodescope.sock").exists, 10, "the hook socket")
        for job in (JOB, BIG_JOB):
            env = hook_env(job, SLURM_JOB_UID=str(JOB_UID), SLURM_JOB_USER="trainer")
            done = run_hook("prolog", config, env)
            assert done.returncode == 0, done.stderr + daemon.stderr()

        # -- a large trace keeps the analysis busy; the cycles go on meanwhile -----------
        big = spool / BIG_JOB
        big.mkdir(mode=0o700)
        _owned(big, JOB_UID)
        staged = tmp_path / "big.json"
        _big_trace(staged, 700_000)
        assert staged.stat().st_size > 50 << 20
        shutil.move(staged, big / "rank0.json")
        _owned(big / "rank0.json", JOB_UID)

        def pending() -> float:
            return sample_value(daemon.scrape(), "nodescope_collective_trace_jobs_pending") or 0.0

        wait_for(lambda: pending() >= 1, 20, "the large trace in the worker")
        seen: list[tuple[float, float, float]] = []  # (time, cycles, last cycle's duration)
        while True:
            text = daemon.scrape()
            if (sample_value(text, "nodescope_collective_trace_jobs_pending") or 0) < 1:
                break
            seen.append(
                (
                    time.monotonic(),
                    sample_value(text, "nodescope_cycles_total") or 0.0,
                    sample_value(text, "nodescope_cycle_duration_seconds") or 0.0,
                )
            )
            time.sleep(0.05)
        busy = seen[-1][0] - seen[0][0]
        cycles = seen[-1][1] - seen[0][1]
        assert busy > 0.5, f"the analysis took only {busy:.2f} s: too short to tell"
        # A cycle every 0.2 s tick all the while (half of them at least, on a loaded
        # machine), and none of them long.
        assert cycles >= 0.5 * busy / 0.2, (busy, cycles, daemon.stderr())
        assert max(d for _, _, d in seen) < 0.5, seen

        # -- the job's real traces, and what must not be read beside them ----------------
        # Made whole beside the spool and moved in with one rename, as a job would: a scan
        # never sees half the ranks.
        staged_dir = tmp_path / "staged"
        staged_dir.mkdir(mode=0o700)
        _owned(staged_dir, JOB_UID)
        for rank in range(4):
            shutil.copy(FIXTURES / f"rank{rank}.json", staged_dir / f"rank{rank}.json")
            _owned(staged_dir / f"rank{rank}.json", JOB_UID)
        shutil.copy(FIXTURES / "rank0.json", staged_dir / "planted.json")
        _owned(staged_dir / "planted.json", OTHER_UID)
        (staged_dir / "link.json").symlink_to("rank0.json")
        _owned(staged_dir / "link.json", JOB_UID)
        os.mkfifo(staged_dir / "fifo.json")
        _owned(staged_dir / "fifo.json", JOB_UID)
        os.rename(staged_dir, spool / JOB)

        skew = f'nodescope_job_collective_skew{{job_id="{JOB}",kind="all_to_all"}}'
        wait_for(lambda: sample_value(daemon.scrape(), skew) is not None, 30, "the job's δ")
        text = daemon.scrape()
        assert sample_value(text, skew) == pytest.approx(0.4874, abs=1e-3)
        reduce = f'{{job_id="{JOB}",kind="all_reduce"}}'
        assert sample_value(text, f"nodescope_job_collective_straggler_rank{reduce}") == 3
        wait = sample_value(text, f"nodescope_job_collective_max_wait_seconds{reduce}")
        assert wait is not None and 0.15 < wait < 1.0
        assert sample_value(text, f'nodescope_job_collective_ranks{{job_id="{JOB}"}}') == 4
        for reason in ("wrong_owner", "symlink", "not_regular_file"):
            series = f'nodescope_source_records_skipped_total{{reason="{reason}",source="traces"}}'
            assert (sample_value(text, series) or 0) >= 1, [
                line for line in text.splitlines() if "traces" in line
            ]
        # The four ranks and the large file, nothing else.
        assert sample_value(text, "nodescope_collective_trace_files_analysed_total") == 5

        def findings() -> dict[str, dict[str, Any]]:
            return {a["kind"]: a for a in _alerts(daemon.port) if a["state"] == "firing"}

        wait_for(lambda: len(findings()) == 2, 15, "both collective alerts firing")
        fired = findings()
        straggler = fired["collective_straggler"]
        assert straggler["subjects"] == {"job": JOB, "kind": "all_reduce"}
        assert "rank 3" in straggler["message"]
        assert fired["collective_skew"]["subjects"] == {"job": JOB, "kind": "all_to_all"}

        # -- the epilog's report, then the job is gone -----------------------------------
        env = hook_env(JOB, SLURM_JOB_UID=str(JOB_UID), SLURM_JOB_EXIT_CODE="0")
        done = run_hook("epilog", config, env)
        assert done.returncode == 0, done.stderr
        report = json.loads((reports / f"{JOB}.json").read_text())
        collectives = report["collectives"]
        assert collectives["ranks"] == [0, 1, 2, 3]
        kinds = {k["kind"]: k for k in collectives["kinds"]}
        assert kinds["all_to_all"]["skew"] == pytest.approx(0.4874, abs=1e-3)
        assert kinds["all_reduce"]["straggler"] == 3
        assert {f["kind"] for f in report["findings"]} >= {
            "collective_skew",
            "collective_straggler",
        }
        shown = subprocess.run(
            [*nodescope_command(), "report", JOB, "--dir", str(reports)],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        table = lines.index("collectives (traces in the spool, 4 files, ranks 4):")
        rows = {line.split()[0]: line.split()[1:] for line in lines[table + 2 : table + 4]}
        assert rows["all_reduce"][:3] == ["-", "rank", "3"], shown.stdout
        assert rows["all_to_all"][0] == "0.49", shown.stdout
        wait_for(lambda: sample_value(daemon.scrape(), skew) is None, 10, "the job's series to go")
    finally:
        daemon.stop()
