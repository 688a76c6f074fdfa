"""``nodescope slurm health`` as a process, with a stand-in scontrol and no daemon: its exit
statuses, the node it picks, the gate's checks as problems, and no resume while the daemon's
alerts cannot be known."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

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
