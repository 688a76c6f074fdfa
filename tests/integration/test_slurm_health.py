"""``nodescope slurm health`` against a real Slurm and a real daemon: from a firing alert to a
drain, and back.

munged, slurmctld and slurmd as :mod:`tests.integration.slurm_harness` starts them, with two
more nodes in the partition that exist only in slurm.conf (Slurm holds them DOWN): a partition
of three. A ``nodescope run`` daemon reads a sysfs tree materialised from the HGX H100 capture;
the test raises a PCIe function's ``TOTAL_ERR_FATAL`` there, the daemon finds a critical
``pcie_aer_errors`` and its alert fires; with the counter still, the finding goes and the alert
resolves a few seconds later. ``nodescope slurm health`` runs as slurmd's HealthCheckProgram
would: as root, with no job environment and no ``SLURMD_NODENAME``.

* a fired alert drains the node with a reason naming the finding (``scontrol show node``,
  ``sinfo -R``), recorded once; once the alert has cleared the next run resumes the node;
* a drain set by a person is left alone, alert or not;
* ``--dry-run`` changes nothing and says what it would do;
* with another node of the partition drained by nodescope, the partition guard holds the
  drain back, says why, and records it once.

Needs root, Slurm and munge (``slurm-wlm munge``); skips with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from nodescope.hooks.transport import HookUnavailable, call
from nodescope.remediation.slurm import parse_sinfo_reasons
from nodescope.sim.sysfs_tree import aer_text, load_capture, materialise
from tests.conftest import REPO, nodescope_command
from tests.integration.daemon_harness import READY_S, Daemon
from tests.integration.slurm_harness import (
    SlurmCluster,
    find_binary,
    missing_binaries,
)

# One worker for every file's clusters: SHARED_WORKER in tests/conftest.py.
pytestmark = pytest.mark.integration

T = TypeVar("T")
CAPTURE = REPO / "tests" / "fixtures" / "captures" / "hgx-h100" / "lspci-vvv.hgx-h100"
#: How long the alert stays firing after the counter stops moving: long enough for a health
#: run to see it, short enough for the clearing to be waited for.
RESOLVE_AFTER = 4


@dataclass
class Setup:
    work: Path
    cluster: SlurmCluster
    daemon: Daemon
    run: Path
    aer_file: Path
    fatal: int = 0

    @property
    def socket(self) -> Path:
        return self.run / "nodescope" / "nodescope.sock"

    @property
    def record(self) -> Path:
        return self.run / "nodescope" / "remediation.json"

    def health_config(self, remediation: str) -> Path:
        path = self.work / "health.toml"
        path.write_text(
            f'[roots]\nrun = "{self.run}"\ndev = "{self.cluster.dev}"\n'
            f'[slurm]\nslurm_user = "root"\nscontrol = "{find_binary("scontrol")}"\n'
            "expected_gpus = 2\n"
            f"[remediation]\n{remediation}"
        )
        return path

    def health(self, remediation: str = "", *args: str) -> subprocess.CompletedProcess[str]:
        """One run as slurmd runs a HealthCheckProgram: root, no PATH, no job, no node name."""
        config = self.health_config(remediation)
        env = {"SLURM_CONF": str(self.cluster.slurm_conf)}
        return subprocess.run(
            [*nodescope_command(), "slurm", "health", "--config", str(config), *args],
            env={**env, "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
            capture_output=True,
            text=True,
            timeout=60,
        )

    def firing(self) -> list[dict[str, object]]:
        try:
            response = call(self.socket, {"command": "alerts"}, 2.0)
        except HookUnavailable:
            return []
        return [a for a in response.get("alerts", []) if a.get("kind") == "pcie_aer_errors"]

    def raise_fatal_aer(self) -> dict[str, object]:
        """One more fatal AER error on the PCIe function; the alert it fires."""
        self.fatal += 1
        text = aer_text("fatal", {}).replace("TOTAL_ERR_FATAL 0", f"TOTAL_ERR_FATAL {self.fatal}")
        self.aer_file.write_text(text)
        return _wait(lambda: next(iter(self.firing()), None), 20, "the AER alert firing")

    def wait_cleared(self) -> None:
        # The finding holds while the error is in its one-minute window, then the alert
        # resolves after its rule's grace.
        _wait(lambda: not self.firing(), 100, "the AER alert resolved")

    def node(self, name: str | None = None) -> dict[str, str]:
        return self.cluster.node_info(name)

    def drained_node(self) -> dict[str, str] | None:
        info = self.node()
        return info if "DRAIN" in info.get("State", "").split("+") else None

    def entries(self) -> list[dict[str, object]]:
        if not self.record.exists():
            return []
        entries: list[dict[str, object]] = json.loads(self.record.read_text())["entries"]
        return entries


def _wait(
    predicate: Callable[[], T | None],
    timeout: float,
    what: str,
    context: Callable[[], str] = lambda: "",
) -> T:
    """``predicate``'s first true value within ``timeout``; a failure names ``what`` and adds
    ``context()`` (logs read at the moment of failing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}\n{context()}".rstrip())


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "Slurm daemons need root"
    missing = missing_binaries()
    if missing or find_binary("sinfo") is None:
        return f"not installed: {', '.join(missing) or 'sinfo'} (Debian: slurm-wlm munge)"
    for controller in ("memory", "freezer"):
        if not (Path("/sys/fs/cgroup") / controller / "cgroup.procs").exists():
            return f"no cgroup v1 {controller} hierarchy for Slurm's cgroup/v1"
    return None


@contextlib.contextmanager
def running(prefix: str, extra_config: tuple[str, ...] = ()) -> Iterator[Setup]:
    """The daemon on the materialised node, then Slurm (with ``extra_config`` lines)."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    work = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(work, 0o755)
    tree = materialise(load_capture(CAPTURE), work / "node", {0: (0, 1)})
    aer_file = next(
        d / "aer_dev_fatal" for d in tree.function_dirs.values() if (d / "aer_dev_fatal").exists()
    )
    run = work / "run"
    run.mkdir()
    cluster = SlurmCluster(
        work / "slurm", gpus=2, extra_nodes=("ghost1", "ghost2"), extra_config=extra_config
    )
    cluster.write_config()
    config = work / "daemon.toml"
    config.write_text(
        f'[daemon]\ntick_seconds = 0.5\n[roots]\nrun = "{run}"\nsysfs = "{tree.root / "sys"}"\n'
        f'dev = "{cluster.dev}"\n[sources.pci]\ninterval_seconds = 0.5\n'
        "[sources.remediation]\ninterval_seconds = 0.5\n"
        f"[alerts.rules.pcie_aer_errors]\nresolve_after_seconds = {RESOLVE_AFTER}\n"
        '[slurm]\nslurm_user = "root"\n'
    )
    s = Setup(work, cluster, Daemon(work, ["--config", str(config)]), run, aer_file)
    try:
        s.daemon.wait_message("READY=1", timeout=READY_S)
        _wait(lambda: s.socket.exists(), 10, "the hook socket")
        cluster.start()
        yield s
    finally:
        cluster.stop()
        s.daemon.stop()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    with running("nodescope-health-") as s:
        yield s


@pytest.fixture
def fresh(setup: Setup) -> Iterator[Setup]:
    """Each test starts with no alert, no record and the node in service."""
    setup.wait_cleared()
    setup.record.unlink(missing_ok=True)
    yield setup
    for node in (setup.cluster.node, "ghost1"):
        setup.cluster.client(["scontrol", "update", f"nodename={node}", "state=undrain"])
    setup.cluster.wait_node_state(("IDLE",), 20)


def test_a_fired_alert_drains_the_node_and_its_clearing_resumes_it(fresh: Setup) -> None:
    s = fresh
    alert = s.raise_fatal_aer()
    assert alert["severity"] == "critical"
    result = s.health("cooldown_seconds = 0\n")
    assert result.returncode == 0, result.stderr
    node = s.node()
    assert "DRAIN" in node["State"].split("+"), (node, result.stdout, result.stderr)
    reason = node["Reason"].rsplit(" [", 1)[0]
    # The count is the error window's (errors raised earlier in the minute count too).
    assert re.match(
        rf"nodescope: pcie_aer_errors {re.escape(alert['subject'])}: \d+ fatal AER error", reason
    ), reason
    assert f'drained {s.cluster.node}: reason "{reason}"' in result.stdout
    # What an operator reads in sinfo -R is the same reason.
    sinfo = s.cluster.client(["sinfo", "-R", "-h", "-N", "-o", "%N|%E"]).stdout
    assert (s.cluster.node, reason) in parse_sinfo_reasons(sinfo).items
    drains = [e for e in s.entries() if e["action"] == "drain"]
    assert len(drains) == 1 and drains[0]["kind"] == "pcie_aer_errors" and drains[0]["ok"]
    # The daemon reads the record back: counted, and listed under its alert.
    counted = 'nodescope_remediation_actions_total{action="drain",kind="pcie_aer_errors"} 1.0'
    _wait(lambda: counted in s.daemon.scrape(), 10, "the drain counted in /metrics")
    s.raise_fatal_aer()  # the alert still firing, the action is shown under it
    listed = subprocess.run(
        [*nodescope_command(), "alerts", "--url", f"http://127.0.0.1:{s.daemon.port}"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "action: " in listed.stdout and f"drained {s.cluster.node} by health: {reason}" in (
        listed.stdout
    ), listed.stdout

    # Still firing: a second run leaves the drain as it is and records nothing more.
    s.raise_fatal_aer()
    again = s.health("cooldown_seconds = 0\n")
    assert again.returncode == 0 and "drained" not in again.stdout, again.stdout
    assert len(s.entries()) == 1
    s.wait_cleared()
    result = s.health("cooldown_seconds = 0\n")
    assert result.returncode == 0, result.stderr
    assert f"resumed {s.cluster.node}" in result.stdout
    node = s.cluster.wait_node_state(("IDLE",), 10)
    assert "DRAIN" not in node["State"].split("+")
    assert [e["action"] for e in s.entries()] == ["drain", "resume"]


def test_a_drain_set_by_a_person_stays(fresh: Setup) -> None:
    s = fresh
    person = "maintenance by bob; ticket 42"
    s.cluster.client(
        ["scontrol", "update", f"nodename={s.cluster.node}", "state=drain", f"reason={person}"]
    )
    s.raise_fatal_aer()
    result = s.health("cooldown_seconds = 0\n")
    assert result.returncode == 0, result.stderr
    assert "already drained by someone else" in result.stdout
    assert s.node()["Reason"].rsplit(" [", 1)[0] == person
    s.wait_cleared()
    result = s.health("cooldown_seconds = 0\n")
    assert "resumed" not in result.stdout
    node = s.node()
    assert "DRAIN" in node["State"].split("+") and node["Reason"].startswith(person)
    assert not [e for e in s.entries() if e["action"] in ("drain", "resume")]


def test_dry_run_changes_nothing_and_says_what_it_would_do(fresh: Setup) -> None:
    s = fresh
    alert = s.raise_fatal_aer()
    result = s.health("cooldown_seconds = 0\n", "--dry-run")
    assert result.returncode == 0, result.stderr
    subject = alert["subject"]
    expected = (
        f'dry run: would drain {s.cluster.node}: reason "nodescope: pcie_aer_errors {subject}'
    )
    assert expected in result.stdout, result.stdout
    node = s.node()
    assert "DRAIN" not in node["State"].split("+") and "Reason" not in node
    assert not s.record.exists()
    # The configuration's dry_run is the same switch.
    result = s.health("dry_run = true\ncooldown_seconds = 0\n")
    assert "dry run: would drain" in result.stdout
    assert "DRAIN" not in s.node()["State"].split("+") and not s.record.exists()


def test_the_partition_guard_holds_back_a_drain(fresh: Setup) -> None:
    s = fresh
    other = "nodescope: gpu_xid_memory gpu=0: Xid 48 on GPU 0"
    done = s.cluster.client(
        ["scontrol", "update", "nodename=ghost1", "state=drain", f"reason={other}"]
    )
    assert done.returncode == 0, done.stderr
    s.raise_fatal_aer()
    # One of three nodes drained by nodescope: at a share of 0.3 no further drain.
    result = s.health("max_drained_share = 0.3\ncooldown_seconds = 0\n")
    assert result.returncode == 0, result.stderr
    assert "held: pcie_aer_errors" in result.stdout
    assert "partition test: 1 of 3 nodes already drained by nodescope" in result.stdout
    assert "DRAIN" not in s.node()["State"].split("+")
    assert [e["action"] for e in s.entries()] == ["held"]
    # Said again while it holds, recorded once.
    s.raise_fatal_aer()
    result = s.health("max_drained_share = 0.3\ncooldown_seconds = 0\n")
    assert "held (already said)" in result.stdout, result.stdout
    assert [e["action"] for e in s.entries()] == ["held"]
    # At a share of one half the same drain goes ahead.
    s.raise_fatal_aer()
    result = s.health("max_drained_share = 0.5\ncooldown_seconds = 0\n")
    assert f"drained {s.cluster.node}" in result.stdout, result.stdout
    assert [e["action"] for e in s.entries()] == ["held", "drain"]


def test_slurmd_runs_it_as_its_health_check_program() -> None:
    """Installed by packaging/slurm/install.sh and run by slurmd itself every few seconds:
    the alert drains the node, its clearing resumes it."""
    work = Path(tempfile.mkdtemp(prefix="nodescope-hcp-", dir="/tmp"))
    os.chmod(work, 0o755)
    try:
        env_file = work / "slurm.env"
        config = work / "health.toml"
        env_file.write_text(f'NODESCOPE_ARGS="--config {config}"\n')
        subprocess.run(
            [str(REPO / "packaging" / "slurm" / "install.sh"), str(work / "hooks"),
             nodescope_command()[0], str(env_file)],
            check=True,
        )  # fmt: skip
        program = (
            f"HealthCheckProgram={work / 'hooks' / 'health'}",
            "HealthCheckInterval=2",
            "HealthCheckNodeState=ANY",
        )
        # slurmctld asks slurmd for a run every HealthCheckInterval once its round of pings has
        # ended; the pings of the two nodes with no slurmd wait out Slurm's connection retries,
        # so a run comes every 13 s or so here (measured): the waits below allow several runs.
        with running("nodescope-hcp-run-", program) as s:
            config.write_text(s.health_config("cooldown_seconds = 0\n").read_text())
            # slurmd gives its HealthCheckProgram no SLURM_CONF (only SLURMD_NODENAME): a
            # slurm.conf away from the default is named in the env file, as docs/remediation.md
            # says. Each run's output, stamped, goes to a log that a failure below quotes:
            # slurmd keeps only an exit status.
            runs = work / "health.log"
            env_file.write_text(
                f'NODESCOPE_ARGS="--config {config}"\nexport SLURM_CONF={s.cluster.slurm_conf}\n'
                f'exec >>{runs} 2>&1\n/bin/date "+--- %T.%N"\n'
            )

            def said() -> str:
                lines = runs.read_text(errors="replace").splitlines() if runs.exists() else []
                return "\n".join(lines[-40:]) + "\n" + s.cluster.logs()

            alert = s.raise_fatal_aer()
            # The counter keeps moving until slurmd's next run has seen the alert.
            node = _wait(
                lambda: s.drained_node() if s.raise_fatal_aer() else None,
                90,
                "slurmd's health check draining the node",
                said,
            )
            assert node["Reason"].startswith(f"nodescope: pcie_aer_errors {alert['subject']}")
            s.wait_cleared()
            s.cluster.wait_node_state(("IDLE",), 60)
            _wait(
                lambda: "DRAIN" not in s.node()["State"].split("+"),
                90,
                "slurmd's health check resuming the node",
                said,
            )
            # The record is written once scontrol has answered: a moment after the resume.
            _wait(lambda: len(s.entries()) >= 2, 10, "the resume recorded", said)
            assert [e["action"] for e in s.entries()][:2] == ["drain", "resume"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
