"""``nodescope slurm health`` as a process, with a stand-in scontrol and no daemon: its exit
statuses, the node it picks, the gate's checks as problems, and no resume while the daemon's
alerts cannot be known."""

from __future__ import annotations

import fcntl
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

from tests.conftest import nodescope_command

NODES = "NodeName=n1 NodeHostName=h1 State={state} Partitions=p{reason}\n"
PARTITIONS = "PartitionName=p Nodes=n1 State=UP TotalNodes=1\n"


def _scontrol(tmp: Path, state: str = "IDLE", reason: str = "") -> Path:
    (tmp / "nodes").write_text(
        NODES.format(
            state=state, reason=f" Reason={reason} [root@2026-12-03T18:52:12]" if reason else ""
        )
    )
    (tmp / "partitions").write_text(PARTITIONS)
    script = tmp / "scontrol"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ "$1 $2" = "show node" ]; then cat {tmp}/nodes; exit 0; fi\n'
        f'if [ "$1 $2" = "show partition" ]; then cat {tmp}/partitions; exit 0; fi\n'
        f'for a in "$@"; do printf "[%s]" "$a"; done >> {tmp}/calls; echo >> {tmp}/calls\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def _config(tmp: Path, scontrol: Path | str, extra: str = "") -> Path:
    (tmp / "dev").mkdir(exist_ok=True)
    path = tmp / "n.toml"
    path.write_text(
        f'[roots]\nrun = "{tmp / "run"}"\ndev = "{tmp / "dev"}"\n'
        f'[slurm]\nscontrol = "{scontrol}"\nexpected_gpus = 8\ntimeout_seconds = 0.5\n'
        f"[remediation]\ncooldown_seconds = 0\n{extra}"
    )
    return path


def _health(config: Path, *args: str, node: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "SLURMD_NODENAME"}
    if node is not None:
        env["SLURMD_NODENAME"] = node
    return subprocess.run(
        [*nodescope_command(), "slurm", "health", "--config", str(config), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_bad_configuration_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[remediation]\ncritical = "reboot"\n')
    result = _health(bad)
    assert result.returncode == 2 and "remediation.critical" in result.stderr
    assert _health(_config(tmp_path, "")).returncode == 2


def test_without_the_daemon_the_gate_checks_drain_and_nothing_resumes(tmp_path: Path) -> None:
    scontrol = _scontrol(tmp_path)
    config = _config(tmp_path, scontrol)
    result = _health(config, node="n1")
    assert result.returncode == 0, result.stderr
    assert "daemon not answering" in result.stderr
    reason = "nodescope: gate_gpus: expected 8 GPUs, found 0 (" + str(tmp_path / "dev")
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0].startswith(f"[update][nodename=n1][state=drain][reason={reason}")
    # The gate passes now, but the daemon's alerts are unknown: the drain stays.
    drained = calls[0].split("[reason=", 1)[1].rstrip("]")
    _scontrol(tmp_path, "IDLE+DRAIN", drained)
    config.write_text(config.read_text().replace("expected_gpus = 8", "expected_gpus = 0"))
    result = _health(config, node="n1")
    assert "stays drained: its problems are not all known now" in result.stdout, result.stdout
    assert len((tmp_path / "calls").read_text().splitlines()) == 1


def test_the_node_is_found_by_this_hosts_name_or_given(tmp_path: Path) -> None:
    scontrol = _scontrol(tmp_path)
    config = _config(tmp_path, scontrol)
    result = _health(config, "--dry-run")
    # This host is not h1 nor n1: the command says so and does nothing.
    assert result.returncode == 0 and "give --node" in result.stderr
    result = _health(config, "--dry-run", "--node", "n1")
    assert result.stdout.startswith('dry run: would drain n1: reason "nodescope: gate_gpus')
    assert not (tmp_path / "calls").exists()
    result = _health(config, "--node", "n1 state=down")
    assert result.returncode == 0 and "give --node" in result.stderr


def test_without_the_daemon_a_local_check_runs_on_this_node(tmp_path: Path) -> None:
    """The real check, on this machine's /sys and /proc, for the few seconds health gives it."""
    scontrol = _scontrol(tmp_path)
    config = _config(tmp_path, scontrol, "").read_text().replace("expected_gpus = 8", "")
    (tmp_path / "n.toml").write_text(config)
    result = _health(tmp_path / "n.toml", "--dry-run", node="n1")
    assert result.returncode == 0, result.stderr
    assert "a local check and the gate's checks" in result.stderr
    assert re.search(r"a 3 s local check found \d+ problem\(s\)", result.stderr), result.stderr


def test_a_local_checks_findings_drain_through_the_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A critical finding of the local check drains the node with a reason naming it; a
    warning alerts (the default policy); nothing resumes on a few seconds' view."""
    from nodescope.cli import check
    from nodescope.cli.main import main
    from nodescope.model.finding import Finding, Severity

    found = [
        Finding("pcie_aer_errors", Severity.CRITICAL, {"device": "0000:3b:00.0"}, {}, "fatal AER"),
        Finding("ib_xmit_wait", Severity.WARNING, {"hca": "mlx5_0", "port": "1"}, {}, "waits"),
        Finding("gpu_ecc_corrected", Severity.INFO, {"gpu": "0"}, {}, "a few"),
    ]

    def watch_node(
        config: object, seconds: float, watch: check.Watch, progress: object = None
    ) -> None:
        assert seconds == 3.0
        watch.add(found)

    monkeypatch.setattr(check, "watch_node", watch_node)
    monkeypatch.delenv("SLURMD_NODENAME", raising=False)
    scontrol = _scontrol(tmp_path)
    config = _config(tmp_path, scontrol).read_text().replace("expected_gpus = 8", "")
    (tmp_path / "n.toml").write_text(config)
    assert main(["slurm", "health", "--config", str(tmp_path / "n.toml"), "--node", "n1"]) == 0
    captured = capsys.readouterr()
    assert "a 3 s local check found 2 problem(s)" in captured.err
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 1
    assert calls[0].startswith(
        "[update][nodename=n1][state=drain][reason=nodescope: pcie_aer_errors"
    )


def test_a_run_that_finds_an_earlier_one_still_running_stops(tmp_path: Path) -> None:
    """slurmd starts a health check on its interval whether or not the last has ended: runs
    must not stack up on a loaded node."""
    scontrol = _scontrol(tmp_path)
    config = _config(tmp_path, scontrol)
    (tmp_path / "run" / "nodescope").mkdir(parents=True)
    earlier = os.open(tmp_path / "run" / "nodescope" / "health.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(earlier, fcntl.LOCK_EX)
        result = _health(config, node="n1")
        assert result.returncode == 0, result.stderr
        assert "an earlier health check still runs on this node" in result.stderr
        assert not (tmp_path / "calls").exists() and result.stdout == ""
    finally:
        os.close(earlier)
    # The earlier run ended: the next one decides and acts.
    result = _health(config, node="n1")
    assert "earlier health check" not in result.stderr
    assert (tmp_path / "calls").read_text().startswith("[update][nodename=n1][state=drain]")
