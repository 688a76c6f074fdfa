"""The prolog gate and the daemon's actions during a job, with a real Slurm.

munged, slurmctld and slurmd as :mod:`tests.integration.slurm_harness` starts them (one node,
two fake GPUs, cgroup/v1), the Prolog/Epilog wrappers of ``packaging/slurm`` pointing at this
venv's ``nodescope``, and a ``nodescope run`` daemon serving the hook socket:

* a job the gate stops (it expects 8 GPUs where 2 exist) drains the node with the gate's
  reason, and its epilog writes a report that says the job did not run, when and why the gate
  stopped it, and fails its verdict — without replacing the node's drain reason;
* the same with no daemon listening: the hooks record the stop and write the report
  themselves, and a later start of the job that passes the gate is not reported as stopped.

Needs root, Slurm and munge (``slurm-wlm munge``) and v1 memory/freezer hierarchies; skips
with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from tests.conftest import REPO, nodescope_command
from tests.hook_peers import hook_env, run_hook
from tests.integration.daemon_harness import Daemon
from tests.integration.slurm_harness import SlurmCluster, missing_binaries

pytestmark = pytest.mark.integration

T = TypeVar("T")


@dataclass
class Setup:
    work: Path
    cluster: SlurmCluster
    daemon: Daemon
    config: Path
    reports: Path
    run: Path

    def write_config(self, expected_gpus: int = 2, extra: str = "") -> None:
        self.config.write_text(
            "[daemon]\ntick_seconds = 0.5\n"
            f'[roots]\nrun = "{self.run}"\ndev = "{self.cluster.dev}"\n'
            "[sources.jobs]\ninterval_seconds = 0.5\n"
            f'[slurm]\nslurm_user = "root"\nreports_dir = "{self.reports}"\n'
            f"expected_gpus = {expected_gpus}\n" + extra
        )

    def reload(self) -> None:
        before = self.daemon.stderr().count("event=reloaded")
        self.daemon.signal(signal.SIGHUP)
        _wait(lambda: self.daemon.stderr().count("event=reloaded") > before, 10, "reload")

    def resume(self) -> None:
        self.cluster.client(["scontrol", "update", f"nodename={self.cluster.node}", "state=resume"])
        self.cluster.wait_node_state(("IDLE",), 30)

    def report(self, job: str, timeout: float = 30) -> dict[str, object]:
        path = self.reports / f"{job}.json"
        _wait(
            path.exists,
            timeout,
            f"report {path}; {self.cluster.logs()}\n{self.daemon.stderr()}",
        )
        document: dict[str, object] = json.loads(path.read_text())
        return document

    def shown(self, job: str) -> str:
        return subprocess.run(
            [*nodescope_command(), "report", job, "--dir", str(self.reports)],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "Slurm daemons need root"
    missing = missing_binaries()
    if missing:
        return f"not installed: {', '.join(missing)} (Debian: slurm-wlm munge)"
    for controller in ("memory", "freezer"):
        if not (Path("/sys/fs/cgroup") / controller / "cgroup.procs").exists():
            return f"no cgroup v1 {controller} hierarchy for Slurm's cgroup/v1"
    return None


def _wait(predicate: Callable[[], T], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    work = Path(tempfile.mkdtemp(prefix="nodescope-gate-", dir="/tmp"))
    os.chmod(work, 0o755)
    hooks = work / "hooks"
    env_file = work / "slurm.env"
    config = work / "nodescope.toml"
    env_file.write_text(f'NODESCOPE_ARGS="--config {config}"\n')
    subprocess.run(
        [str(REPO / "packaging" / "slurm" / "install.sh"), str(hooks), nodescope_command()[0],
         str(env_file)],
        check=True,
    )  # fmt: skip
    cluster = SlurmCluster(
        work / "slurm", gpus=2, prolog=str(hooks / "prolog"), epilog=str(hooks / "epilog")
    )
    run = work / "run"
    run.mkdir()
    cluster.write_config()  # makes the fake GPU devices the daemon's roots point at
    s = Setup(work, cluster, None, config, work / "reports", run)  # type: ignore[arg-type]
    s.write_config()
    s.daemon = Daemon(work, ["--config", str(config)])
    try:
        s.daemon.wait_message("READY=1", timeout=15)
        _wait((run / "nodescope" / "nodescope.sock").exists, 10, "the hook socket")
        cluster.start()
        yield s
    finally:
        cluster.stop()
        s.daemon.stop()
        shutil.rmtree(work, ignore_errors=True)


def test_a_job_the_gate_stopped_has_a_report_that_says_when_and_why(setup: Setup) -> None:
    setup.write_config(expected_gpus=8)
    setup.reload()
    job = ""
    try:
        before = time.time()
        job = setup.cluster.sbatch(["--gres=gpu:2"], "true")
        info = setup.cluster.wait_node_state(("DRAIN", "DRAINED", "DRAINING"), 30)
        assert "nodescope: expected 8 GPUs, found 2" in info.get("Reason", ""), info
        report = setup.report(job)
        after = time.time()
        verdict = report["verdict"]
        assert isinstance(verdict, dict) and verdict["ok"] is False, verdict
        gate = report["gate"]
        assert isinstance(gate, dict) and gate["stopped"] is True
        # The node's drain reason is the gate's, word for word.
        assert gate["reason"] == info["Reason"].split(" [")[0], (gate, info)
        assert gate["reason"].startswith("nodescope: expected 8 GPUs, found 2 (")
        assert verdict["reason"] == (
            f"nodescope: the prolog gate stopped job {job}: "
            + gate["reason"].removeprefix("nodescope: ")
        )
        assert before <= gate["stopped_at"] <= after
        failed = [c for c in gate["checks"] if not c["ok"]]
        assert [c["name"] for c in failed] == ["gpus"], gate
        assert report["start"] == gate["stopped_at"] and report["registered"] is False
        text = setup.shown(job)
        assert "not run: stopped by the prolog gate at " in text, text
        assert f"gate: {gate['reason']}" in text, text
        assert "failed check gpus: expected 8 GPUs, found 2" in text, text
        assert "verdict: FAILED: nodescope: the prolog gate stopped job" in text, text
        assert "ran ?" not in text and "verdict: ok" not in text, text
        # The epilog recorded the stop and left the node's reason to the gate.
        assert f"event=epilog job={job}" in setup.daemon.stderr()
        assert not (setup.run / "nodescope" / "gate-stops" / f"{job}.json").exists()
        reason = setup.cluster.node_info().get("Reason", "")
        assert "expected 8 GPUs, found 2" in reason and "prolog gate stopped" not in reason
    finally:
        setup.write_config(expected_gpus=2)
        setup.reload()
        if job:
            setup.cluster.client(["scancel", job])
        setup.resume()


def test_without_a_daemon_the_hooks_record_the_stop_and_report_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    reports = tmp_path / "reports"
    config = tmp_path / "nodescope.toml"
    record = run / "nodescope" / "gate-stops" / "7.json"

    def write_config(expected: int) -> None:
        config.write_text(
            f'[roots]\nrun = "{run}"\ndev = "{tmp_path / "dev"}"\n'
            f'[slurm]\nreports_dir = "{reports}"\nscontrol = ""\nexpected_gpus = {expected}\n'
        )

    write_config(expected=8)
    before = time.time()
    result = run_hook("prolog", config, hook_env("7", SLURM_JOB_GPUS="0"))
    assert result.returncode == 1, result.stderr
    stopped = json.loads(record.read_text())
    assert stopped["reason"] == result.stdout.strip() and before <= stopped["stopped_at"]
    assert [c["name"] for c in stopped["checks"] if not c["ok"]] == ["gpus"]
    assert not (run / "nodescope" / "jobs" / "7.json").exists()

    # The epilog of the stopped job: its report says so, and it leaves the drain to the prolog.
    result = run_hook("epilog", config, hook_env("7", SLURM_JOB_GPUS="0"))
    assert result.returncode == 0, result.stderr
    assert "the prolog gate stopped job 7" in result.stdout
    report = json.loads((reports / "7.json").read_text())
    assert report["verdict"]["ok"] is False and report["daemon"] is False
    assert report["gate"]["stopped_at"] == stopped["stopped_at"] == report["start"]
    assert not record.exists()

    # A requeued start of the job that passes the gate is not reported as stopped.
    result = run_hook("prolog", config, hook_env("7", SLURM_JOB_GPUS="0"))
    assert result.returncode == 1 and record.exists()
    write_config(expected=0)
    result = run_hook("prolog", config, hook_env("7", SLURM_JOB_GPUS="0"))
    assert result.returncode == 0, result.stderr
    assert not record.exists()
    result = run_hook("epilog", config, hook_env("7", SLURM_JOB_GPUS="0"))
    report = json.loads((reports / "7.json").read_text())
    assert report["verdict"] == {"ok": True, "reason": None} and report["gate"] is None
