"""The prolog gate and the daemon's actions during a job, with a real Slurm.

munged, slurmctld and slurmd as :mod:`tests.integration.slurm_harness` starts them (one node,
two fake GPUs, cgroup/v1), the Prolog/Epilog wrappers of ``packaging/slurm`` pointing at this
venv's ``nodescope``, and a ``nodescope run`` daemon serving the hook socket, reading a sysfs
tree materialised from the HGX H100 capture (where the test raises a PCIe function's
``TOTAL_ERR_FATAL``: a critical ``pcie_aer_errors`` alert fires) and the real cgroups of the
jobs; it runs scontrol against the test's Slurm (``SLURM_CONF``):

* a job the gate stops (it expects 8 GPUs where 2 exist) drains the node with the gate's
  reason, and its epilog writes a report that says the job did not run, when and why the gate
  stopped it, and fails its verdict — without replacing the node's drain reason;
* the gate consults the firing alerts under the remediation policy: a firing alert whose kind
  the policy only alerts on lets the job run, the same alert under the default policy (critical:
  drain) stops the job, with the alert in the reason; the hook records that drain as
  nodescope's, and ``nodescope slurm health`` resumes the node once the alert has cleared;
* the policy's partition guard holds back a drain for an alert at the gate as anywhere: with
  the partition's other node drained by nodescope, the job runs, the hold recorded once;
* in a dry run the gate and the daemon say what they would do and change nothing;
* a critical alert that fires during a job drains the node (the job goes on and completes),
  once, recorded in the remediation record, and the job's report notes it;
* with no daemon listening, the hooks record the stop and write the report themselves, and a
  later start of the job that passes the gate is not reported as stopped;
* an scontrol that hangs holds the prolog's policy pass no longer than its bound.

Needs root, Slurm and munge (``slurm-wlm munge``) and v1 memory/freezer hierarchies; skips
with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest

from nodescope.hooks.auth import Peer
from nodescope.hooks.transport import HookServer, HookUnavailable, call
from nodescope.sim.sysfs_tree import aer_text, load_capture, materialise
from tests.conftest import REPO, nodescope_command
from tests.hook_peers import hook_env, run_hook
from tests.integration.daemon_harness import READY_S, Daemon
from tests.integration.slurm_harness import (
    SlurmCluster,
    find_binary,
    skip_reason,
)

# One worker for every file's clusters: SHARED_WORKER in tests/conftest.py.
pytestmark = pytest.mark.integration

T = TypeVar("T")
CAPTURE = REPO / "tests" / "fixtures" / "captures" / "hgx-h100" / "lspci-vvv.hgx-h100"
#: How long the AER alert stays firing after the counter stops moving.
RESOLVE_AFTER = 4


@dataclass
class Setup:
    work: Path
    cluster: SlurmCluster
    config: Path
    reports: Path
    run: Path
    sysfs: Path
    aer_file: Path
    daemon: Daemon = field(init=False)
    fatal: int = 0

    def write_config(self, expected_gpus: int = 2, remediation: str = "") -> None:
        """One file for the daemon and the hooks (the wrappers pass it with NODESCOPE_ARGS)."""
        self.config.write_text(
            "[daemon]\ntick_seconds = 0.5\n"
            f'[roots]\nrun = "{self.run}"\ndev = "{self.cluster.dev}"\nsysfs = "{self.sysfs}"\n'
            "[sources.jobs]\ninterval_seconds = 0.5\n[sources.pci]\ninterval_seconds = 0.5\n"
            f"[alerts.rules.pcie_aer_errors]\nresolve_after_seconds = {RESOLVE_AFTER}\n"
            f'[slurm]\nslurm_user = "root"\nreports_dir = "{self.reports}"\n'
            f'scontrol = "{find_binary("scontrol")}"\nexpected_gpus = {expected_gpus}\n'
            f"[remediation]\n{remediation}"
        )

    def sbatch(self, script: str) -> str:
        """A job on both GPUs, its output in the test's directory (not the current one)."""
        return self.cluster.sbatch(["--gres=gpu:2", "-o", str(self.work / "slurm-%j.out")], script)

    def reload(self) -> None:
        before = self.daemon.stderr().count("event=reloaded")
        self.daemon.signal(signal.SIGHUP)
        _wait(lambda: self.daemon.stderr().count("event=reloaded") > before, 10, "reload")

    def resume(self) -> None:
        self.cluster.client(["scontrol", "update", f"nodename={self.cluster.node}", "state=resume"])
        self.cluster.wait_node_state(("IDLE",), 30)

    @property
    def record(self) -> Path:
        return self.run / "nodescope" / "remediation.json"

    def entries(self) -> list[dict[str, object]]:
        if not self.record.exists():
            return []
        entries: list[dict[str, object]] = json.loads(self.record.read_text())["entries"]
        return entries

    def firing(self) -> list[dict[str, object]]:
        try:
            response = call(self.run / "nodescope" / "nodescope.sock", {"command": "alerts"}, 2.0)
        except HookUnavailable:
            return []
        return [a for a in response.get("alerts", []) if a.get("kind") == "pcie_aer_errors"]

    def raise_fatal_aer(self) -> dict[str, object]:
        """One more fatal AER error on a PCIe function of the tree; the alert it fires."""
        self.fatal += 1
        text = aer_text("fatal", {}).replace("TOTAL_ERR_FATAL 0", f"TOTAL_ERR_FATAL {self.fatal}")
        self.aer_file.write_text(text)
        return _wait(lambda: next(iter(self.firing()), None), 20, "the AER alert firing")

    def wait_cleared(self) -> None:
        # The finding holds while the error is in its one-minute window, then the alert
        # resolves after its rule's grace.
        _wait(lambda: not self.firing(), 100, "the AER alert resolved")

    def registered(self, job: str) -> bool:
        """Whether the daemon sees the job on the node with its registration."""
        return f'job_id="{job}"' in "".join(
            line
            for line in self.daemon.scrape().splitlines()
            if line.startswith("nodescope_job_info{") and 'registered="true"' in line
        )

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


def _wait(predicate: Callable[[], T | None], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    reason = skip_reason()
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
    tree = materialise(load_capture(CAPTURE), work / "node", {0: (0, 1)})
    aer_file = next(
        d / "aer_dev_fatal" for d in tree.function_dirs.values() if (d / "aer_dev_fatal").exists()
    )
    # ghost1 exists only in slurm.conf (Slurm holds it DOWN): a partition of two, for the
    # partition guard.
    cluster = SlurmCluster(
        work / "slurm", gpus=2, prolog=str(hooks / "prolog"), epilog=str(hooks / "epilog"),
        extra_nodes=("ghost1",),
    )  # fmt: skip
    run = work / "run"
    run.mkdir()
    cluster.write_config()  # makes the fake GPU devices the daemon's roots point at
    s = Setup(work, cluster, config, work / "reports", run, tree.root / "sys", aer_file)
    s.write_config()
    # The daemon reaches this Slurm as slurmd's hooks do: through SLURM_CONF.
    s.daemon = Daemon(work, ["--config", str(config)], env={"SLURM_CONF": str(cluster.slurm_conf)})
    try:
        s.daemon.wait_message("READY=1", timeout=READY_S)
        _wait((run / "nodescope" / "nodescope.sock").exists, 10, "the hook socket")
        cluster.start()
        yield s
    finally:
        cluster.stop()
        s.daemon.stop()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture
def fresh(setup: Setup) -> Iterator[Setup]:
    """Each test starts with the default configuration, no alert, no record and the node in
    service, and leaves it so."""
    setup.write_config()
    setup.reload()
    setup.wait_cleared()
    setup.record.unlink(missing_ok=True)
    try:
        yield setup
    finally:
        setup.write_config()
        setup.reload()
        setup.cluster.scontrol_quiet(["scancel", "--quiet", "-u", "root"])
        setup.cluster.client(["scontrol", "update", "nodename=ghost1", "state=undrain"])
        setup.resume()


def test_a_job_the_gate_stopped_has_a_report_that_says_when_and_why(fresh: Setup) -> None:
    setup = fresh
    setup.write_config(expected_gpus=8)
    setup.reload()
    job = ""
    try:
        before = time.time()
        job = setup.sbatch("true")
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
        # The drain is nodescope's, for the failed check, as `nodescope slurm health` sees it.
        assert [(e["action"], e["kind"], e["source"]) for e in setup.entries()] == [
            ("drain", "gate_gpus", "prolog")
        ]
        reason = setup.cluster.node_info().get("Reason", "")
        assert "expected 8 GPUs, found 2" in reason and "prolog gate stopped" not in reason
    finally:
        if job:
            setup.cluster.client(["scancel", job])


def test_the_gate_fails_on_a_firing_alert_only_when_the_policy_drains_for_it(
    fresh: Setup,
) -> None:
    s = fresh
    # The policy only alerts on this kind: the alert fires, the job runs.
    s.write_config(remediation='[remediation.rules.pcie_aer_errors]\ncritical = "alert"\n')
    s.reload()
    alert = s.raise_fatal_aer()
    assert alert["severity"] == "critical"
    job = s.sbatch("true")
    assert s.cluster.wait_job_done(job, 60) == "COMPLETED"
    report = s.report(job)
    assert report["verdict"] == {"ok": True, "reason": None} and report["gate"] is None
    assert "DRAIN" not in s.cluster.node_info()["State"].split("+")

    # The default policy drains on a critical finding: the same alert stops the next job.
    s.write_config()
    s.reload()
    alert = s.raise_fatal_aer()
    job = s.sbatch("true")
    info = s.cluster.wait_node_state(("DRAIN", "DRAINED", "DRAINING"), 30)
    reason = info["Reason"].rsplit(" [", 1)[0]
    # The policy's pass drained it: the reason is the one every nodescope drain gives.
    # The count is the window's: the error raised for the first half is still in its minute.
    assert re.match(
        rf"nodescope: pcie_aer_errors {re.escape(alert['subject'])}: \d+ fatal", reason
    ), info
    report = s.report(job)
    gate = report["gate"]
    assert isinstance(gate, dict) and gate["reason"] == reason
    assert [c["name"] for c in gate["checks"] if not c["ok"]] == ["alerts"]
    assert report["verdict"]["ok"] is False  # type: ignore[index]
    # The job never ran, so the daemon had no job to drain the node for: only the gate did,
    # and the hook recorded that drain as nodescope's, for the alert.
    drains = [e for e in s.entries() if e["action"] == "drain"]
    assert [(e["source"], e["kind"], e["reason"]) for e in drains] == [
        ("prolog", "pcie_aer_errors", reason)
    ], s.entries()
    # So once the alert has cleared, `nodescope slurm health` resumes the node.
    s.wait_cleared()
    s.write_config(remediation="cooldown_seconds = 0\n")
    env = {"SLURM_CONF": str(s.cluster.slurm_conf), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    health = subprocess.run(
        [*nodescope_command(), "slurm", "health", "--config", str(s.config)],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert f"resumed {s.cluster.node}" in health.stdout, (health.stdout, health.stderr)
    s.cluster.wait_node_state(("IDLE",), 20)


def test_the_partition_guard_lets_the_job_run_despite_the_alert(fresh: Setup) -> None:
    s = fresh
    other = "nodescope: gpu_xid_memory gpu=0: Xid 48 on GPU 0"
    done = s.cluster.client(
        ["scontrol", "update", "nodename=ghost1", "state=drain", f"reason={other}"]
    )
    assert done.returncode == 0, done.stderr
    # One of the partition's two nodes is drained by nodescope: at a share of one half no
    # further drain, and a gate that would drain the node for an alert lets the job run.
    s.write_config(remediation="max_drained_share = 0.5\n")
    s.reload()
    s.raise_fatal_aer()
    job = s.sbatch("sleep 3")
    assert s.cluster.wait_job_done(job, 60) == "COMPLETED", s.cluster.logs()
    assert "DRAIN" not in s.cluster.node_info()["State"].split("+")
    assert f"event=prolog_alerts_held job={job}" in s.daemon.stderr()
    report = s.report(job)
    assert report["verdict"] == {"ok": True, "reason": None} and report["gate"] is None
    # Held back once, recorded once (the daemon, during the job, held the same drain).
    held = [e for e in s.entries() if e["action"] == "held"]
    assert [(e["source"], e["kind"]) for e in held] == [("prolog", "pcie_aer_errors")], held
    assert "partition test: 1 of 2 nodes already drained by nodescope" in str(held[0]["why"])
    assert not [e for e in s.entries() if e["action"] == "drain"]
    actions = report["actions"]
    assert isinstance(actions, list) and [a["action"] for a in actions] == ["held"]


def test_a_critical_finding_during_a_job_drains_the_node_and_the_job_goes_on(
    fresh: Setup,
) -> None:
    s = fresh
    started = time.time()
    # Long enough to be still running when the drain lands on a loaded machine.
    job = s.sbatch("sleep 20")
    _wait(lambda: s.registered(job), 30, f"job {job} registered; {s.cluster.logs()}")
    alert = s.raise_fatal_aer()
    info = s.cluster.wait_node_state(("DRAIN", "DRAINED", "DRAINING"), 30)
    reason = info["Reason"].rsplit(" [", 1)[0]
    assert re.match(
        rf"nodescope: pcie_aer_errors {re.escape(alert['subject'])}: \d+ fatal AER", reason
    ), info
    # Drained, not stopped: the job still runs and ends as it would have.
    assert s.cluster.job_state(job) == "RUNNING"
    s.raise_fatal_aer()  # still firing, the node already drained: nothing more is done
    assert s.cluster.wait_job_done(job, 60) == "COMPLETED"
    drains = [e for e in s.entries() if e["action"] == "drain"]
    assert len(drains) == 1, s.entries()
    drain = drains[0]
    assert drain["source"] == "daemon" and drain["ok"] is True and drain["reason"] == reason
    assert drain["kind"] == "pcie_aer_errors" and drain["node"] == s.cluster.node
    assert "event=job_drain" in s.daemon.stderr()

    report = s.report(job)
    assert report["verdict"] == {"ok": True, "reason": None}
    actions = report["actions"]
    assert isinstance(actions, list) and [a["action"] for a in actions] == ["drain"], actions
    noted = actions[0]
    assert noted["kind"] == "pcie_aer_errors" and noted["reason"] == reason
    assert started <= noted["time"] <= time.time()
    text = s.shown(job)
    assert "nodescope acted on the node during the job (the job went on):" in text, text
    assert f"drain (daemon): pcie_aer_errors {alert['subject']}: " in text, text
    assert f"reason: {reason}" in text, text
    # The node stays drained after the job, for an operator or `nodescope slurm health`.
    assert "DRAIN" in s.cluster.node_info()["State"].split("+")


def test_a_dry_run_at_the_gate_and_during_a_job_says_what_it_would_do_and_changes_nothing(
    fresh: Setup,
) -> None:
    s = fresh
    s.write_config(remediation="dry_run = true\n")
    s.reload()
    s.raise_fatal_aer()
    # The gate would fail on the alert: it says so and lets the job run.
    job = s.sbatch("sleep 8")
    _wait(lambda: s.registered(job), 30, f"job {job} registered; {s.cluster.logs()}")
    assert f"event=prolog_dry_run job={job}" in s.daemon.stderr()
    assert "the gate would fail: firing pcie_aer_errors" in s.daemon.stderr()
    # During the job the daemon would drain the node: it says so, once, and does not.
    s.raise_fatal_aer()
    _wait(lambda: "would drain" in s.daemon.stderr(), 20, "the dry run said")
    assert s.cluster.wait_job_done(job, 60) == "COMPLETED"
    assert "DRAIN" not in s.cluster.node_info()["State"].split("+")
    assert not s.record.exists()
    assert s.daemon.stderr().count("would drain") == 1


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


def test_a_slurm_that_does_not_answer_never_holds_the_prolog_long(tmp_path: Path) -> None:
    """A daemon whose gate failed on a firing alert alone, and an scontrol that hangs: the
    hook's policy pass gives up after its bound, the gate fails with the check's reason, and
    the prolog ends within the bounds of its scontrol calls."""
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\nexec sleep 60\n")
    scontrol.chmod(0o755)
    config = tmp_path / "nodescope.toml"
    config.write_text(
        f'[roots]\nrun = "{run}"\ndev = "{tmp_path / "dev"}"\n'
        f'[slurm]\nreports_dir = "{tmp_path / "reports"}"\nscontrol = "{scontrol}"\n'
    )
    reason = "nodescope: firing pcie_aer_errors device=0000:1b:00.0: 1 fatal AER error"
    cause = {"kind": "pcie_aer_errors", "severity": "critical", "subject": "device=0000:1b:00.0",
             "message": "1 fatal AER error", "source": "alert",
             "key": "pcie_aer_errors{device=0000:1b:00.0}"}  # fmt: skip

    def prolog(request: dict[str, object], peer: Peer) -> dict[str, object]:
        return {
            "ok": True, "fit": False, "reason": reason, "causes": [cause],
            "checks": [{"name": "alerts", "ok": False, "detail": reason[11:]}],
        }  # fmt: skip

    server = HookServer(run / "nodescope" / "nodescope.sock", lambda peer: peer.uid == 0)
    server.register("prolog", prolog)
    server.start()
    try:
        started = time.monotonic()
        result = run_hook("prolog", config, hook_env("9", SLURMD_NODENAME="n1"))
        took = time.monotonic() - started
    finally:
        server.stop()
    assert result.returncode == 1, result.stderr
    assert result.stdout.strip() == reason
    assert "the policy could not be applied" in result.stderr and "did not answer" in result.stderr
    # One bounded scontrol call of the policy's pass (5 s); no drain of its own after it.
    assert took < 9, took
    assert json.loads((run / "nodescope" / "gate-stops" / "9.json").read_text())["reason"] == reason
