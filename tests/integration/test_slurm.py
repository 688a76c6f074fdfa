"""A real single-node Slurm running nodescope's real hooks against a real daemon.

munged, slurmctld and slurmd (Debian's slurm-wlm 22.05) on 127.0.0.1 with non-default ports
and two fake GPUs (GRES on ``mknod`` character devices), ``proctrack/cgroup`` +
``task/cgroup`` with ``CgroupPlugin=cgroup/v1``, and as Prolog/Epilog the wrappers of
``packaging/slurm`` installed by ``packaging/slurm/install.sh`` pointing at this venv's
``nodescope``. A ``nodescope run`` daemon with ``--run`` in a temp dir serves the hook socket.

* ``sbatch``/``srun`` jobs with ``--gres=gpu:2``: the daemon registers them with GPUs 0,1 from
  ``SLURM_JOB_GPUS``, sees their cgroup/v1 layout live, and the epilog has it write their
  reports with counter deltas; a finished job's series leave /metrics.
* A prolog veto (the gate expects 8 GPUs where 2 exist) drains the node with the gate's reason
  in ``scontrol show node``; the test resumes the node.

Needs root, Slurm and munge (``slurm-wlm munge``) and v1 memory/freezer hierarchies; skips
with the reason otherwise. Slurm is shut down in teardown: queue empty, then slurmd, slurmctld
and munged by PID.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO, nodescope_command
from tests.integration.daemon_harness import READY_S, Daemon
from tests.integration.slurm_harness import SlurmCluster, skip_reason

# One worker for every file's clusters: SHARED_WORKER in tests/conftest.py.
pytestmark = pytest.mark.integration


@dataclass
class Setup:
    work: Path
    cluster: SlurmCluster
    daemon: Daemon
    config: Path
    reports: Path
    run: Path

    def write_config(self, expected_gpus: int) -> None:
        write_config(self.config, self.run, self.cluster.dev, self.reports, expected_gpus)

    def reload(self) -> None:
        before = self.daemon.stderr().count("event=reloaded")
        self.daemon.signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while self.daemon.stderr().count("event=reloaded") == before:
            assert time.monotonic() < deadline, self.daemon.stderr()
            time.sleep(0.05)

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        text = self.daemon.scrape()
        return [
            (s.name, dict(s.labels), s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples
        ]


def write_config(config: Path, run: Path, dev: Path, reports: Path, expected_gpus: int) -> None:
    """One file for the daemon and the hooks (the wrappers pass it with NODESCOPE_ARGS)."""
    config.write_text(
        "[daemon]\ntick_seconds = 0.5\n"
        f'[roots]\nrun = "{run}"\ndev = "{dev}"\n'
        "[sources.jobs]\ninterval_seconds = 0.5\n"
        f'[slurm]\nslurm_user = "root"\nreports_dir = "{reports}"\n'
        f"expected_gpus = {expected_gpus}\n"
    )


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    work = Path(tempfile.mkdtemp(prefix="nodescope-slurm-", dir="/tmp"))
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
    reports = work / "reports"
    run.mkdir()
    cluster.write_config()  # makes the fake GPU devices the daemon's roots point at
    write_config(config, run, cluster.dev, reports, expected_gpus=2)
    s = Setup(work, cluster, Daemon(work, ["--config", str(config)]), config, reports, run)
    try:
        s.daemon.wait_message("READY=1", timeout=READY_S)
        deadline = time.monotonic() + 10
        while not (run / "nodescope" / "nodescope.sock").exists():
            assert time.monotonic() < deadline, s.daemon.stderr()
            time.sleep(0.05)
        cluster.start()
        yield s
    finally:
        cluster.stop()
        s.daemon.stop()
        shutil.rmtree(work, ignore_errors=True)


def _wait(predicate, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _report(setup: Setup, job: str, timeout: float = 30) -> dict[str, object]:
    path = setup.reports / f"{job}.json"
    _wait(path.exists, timeout, f"report {path}; {setup.cluster.logs()}\n{setup.daemon.stderr()}")
    document: dict[str, object] = json.loads(path.read_text())
    return document


def test_sbatch_job_is_registered_seen_in_v1_and_reported(setup: Setup) -> None:
    out = setup.work / "job-output"
    job = setup.cluster.sbatch(
        ["--gres=gpu:2", "-o", str(setup.work / "slurm-%j.out")],
        f"dd if=/dev/zero of={out} bs=1M count=32 conv=fsync status=none; sleep 3",
    )

    def registered() -> list[tuple[str, dict[str, str], float]]:
        return [
            m
            for m in setup.metrics()
            if m[1].get("job_id") == job
            and m[0] in ("nodescope_job_info", "nodescope_job_gpu_info")
        ]

    def running_in_v1() -> list[tuple[str, dict[str, str], float]] | None:
        found = registered()
        info = [m for m in found if m[0] == "nodescope_job_info"]
        return found if info and info[0][1]["layout"] == "v1" else None

    found = _wait(running_in_v1, 30, f"job {job} in /metrics; {setup.cluster.logs()}")
    info = next(labels for name, labels, _ in found if name == "nodescope_job_info")
    assert info["registered"] == "true" and info["user"] == "root"
    assert info["gpu_source"] == "registration"
    assert sorted(lab["gpu"] for name, lab, _ in found if name == "nodescope_job_gpu_info") == [
        "0",
        "1",
    ]
    registration = json.loads((setup.run / "nodescope" / "jobs" / f"{job}.json").read_text())
    assert registration["gpus"] == [0, 1] and "disks" in registration["baseline"]
    memory = [m for m in setup.metrics() if m[0] == "nodescope_job_memory_current_bytes"]
    assert any(labels["job_id"] == job for _, labels, _ in memory)

    assert setup.cluster.wait_job_done(job, 60) == "COMPLETED"
    report = _report(setup, job)
    assert report["gpus"] == [0, 1] and report["gpu_source"] == "SLURM_JOB_GPUS"
    assert report["daemon"] is True and report["registered"] is True
    assert report["verdict"] == {"ok": True, "reason": None}
    deltas = report["deltas"]
    assert isinstance(deltas, dict) and deltas["seconds"] > 0
    written = sum(d.get("written_bytes", 0) for d in deltas["disks"].values())
    assert written >= 32 << 20, deltas["disks"]
    memory_report = report["memory"]
    assert isinstance(memory_report, dict) and memory_report["peak_bytes"] > 0
    assert not (setup.run / "nodescope" / "jobs" / f"{job}.json").exists()
    # The job is over: its series are gone.
    _wait(lambda: not registered(), 10, f"job {job} series to disappear")
    shown = subprocess.run(
        [*nodescope_command(), "report", job, "--dir", str(setup.reports)],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    assert f"job {job}  user root" in shown.stdout and "verdict: ok" in shown.stdout


def test_srun_job_is_reported(setup: Setup) -> None:
    result = setup.cluster.client(
        ["srun", "--gres=gpu:2", "-N1", "sh", "-c", "echo $SLURM_JOB_ID $SLURM_STEP_GPUS"],
        timeout=60,
    )
    assert result.returncode == 0, result.stderr + setup.cluster.logs()
    job, gpus = result.stdout.split()
    assert gpus == "0,1"
    report = _report(setup, job)
    assert report["gpus"] == [0, 1] and report["deltas"] is not None


def test_prolog_veto_drains_the_node_with_its_reason(setup: Setup) -> None:
    setup.write_config(expected_gpus=8)
    setup.reload()
    job = ""
    try:
        job = setup.cluster.sbatch(["--gres=gpu:2"], "true")
        info = setup.cluster.wait_node_state(("DRAIN", "DRAINED", "DRAINING"), 30)
        assert "nodescope: expected 8 GPUs, found 2" in info.get("Reason", ""), info
        assert not (setup.run / "nodescope" / "jobs" / f"{job}.json").exists()
    finally:
        setup.write_config(expected_gpus=2)
        setup.reload()
        if job:
            setup.cluster.client(["scancel", job])
        setup.cluster.client(
            ["scontrol", "update", f"nodename={setup.cluster.node}", "state=resume"]
        )
    setup.cluster.wait_node_state(("IDLE",), 30)
