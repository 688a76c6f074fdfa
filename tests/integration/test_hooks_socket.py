"""The hook socket with real peers, the hooks without a daemon, and the atomic report writer
under ``kill -9``.

* A server on a real Unix socket answers root and the SlurmUser (a real process started with
  ``setpriv``, through the socket's ACL) and nobody else can connect.
* ``nodescope slurm prolog|epilog`` as real processes with no daemon listening: local gate
  (exit 1 with a one-line reason), local registration and report, exit 0 when fit.
* A writer process killed with SIGKILL in the middle of replacing a large report leaves the
  old report or the new one, never a part of either.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodescope.assembly import default_config
from nodescope.config import SlurmSettings
from nodescope.hooks.auth import Peer, allowed_uids, slurm_uid
from nodescope.hooks.transport import HookServer, HookUnavailable, call
from tests.conftest import nodescope_command
from tests.hook_peers import enterable_dir, hook_env, run_hook

pytestmark = pytest.mark.integration


@pytest.fixture
def world_dir() -> Iterator[Path]:
    with enterable_dir() as path:
        yield path


def test_socket_answers_root_and_the_slurm_user_and_nobody_else(world_dir: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to act as other users")
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) not installed")
    path = world_dir / "nodescope" / "nodescope.sock"
    slurm_user = "nobody"  # any account other than root stands in for the SlurmUser
    settings = SlurmSettings(slurm_user=slurm_user)
    server = HookServer(
        path,
        lambda peer: peer.uid in allowed_uids(settings),
        grant_uid=lambda: slurm_uid(slurm_user),
    )
    seen: list[Peer] = []

    def echo(request: dict[str, object], peer: Peer) -> dict[str, object]:
        seen.append(peer)
        return {"ok": True, "echo": request.get("value")}

    server.register("echo", echo)
    server.start()
    try:
        # Nothing for others; the group bits show the ACL mask, which admits the one entry.
        assert path.stat().st_mode & 0o007 == 0 and path.parent.stat().st_mode & 0o007 == 0
        assert call(path, {"command": "echo", "value": 7}) == {"ok": True, "echo": 7}
        assert seen[-1].uid == 0 and seen[-1].pid == os.getpid()
        assert call(path, {"command": "nope"})["ok"] is False
        assert call(path, {"command": "ping"})["pid"] == os.getpid()
        # The SlurmUser reaches the socket through its ACL entries; daemon (an unprivileged
        # account without them) cannot even connect.
        for user, expected in ((slurm_user, '{"ok": true, "echo": 1}'), ("daemon", "EACCES")):
            result = subprocess.run(
                [setpriv, f"--reuid={user}", "--regid=nogroup", "--clear-groups",
                 sys.executable, "-c", _CLIENT, str(path)],
                capture_output=True, text=True, timeout=20, check=False,
            )  # fmt: skip
            assert result.returncode == 0, result.stderr
            assert result.stdout.strip() == expected, user
        assert seen[-1].uid == slurm_uid(slurm_user)
    finally:
        server.stop()
    assert not path.exists()
    with pytest.raises(HookUnavailable):
        call(path, {"command": "ping"}, timeout=0.5)


_CLIENT = """
import json, socket, sys, time
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print("EACCES")
    sys.exit(0)
now = time.time()
s.sendall(json.dumps({"command": "echo", "value": 1, "issued_at": now,
                      "deadline": now + 2}).encode() + b"\\n")
s.shutdown(socket.SHUT_WR)
print(s.recv(4096).decode().strip())
"""


@pytest.mark.alone  # answered within 1.5 s
def test_a_silent_client_cannot_hold_the_server(world_dir: Path) -> None:
    path = world_dir / "s.sock"
    server = HookServer(path, lambda peer: True, timeout=lambda: 0.3)
    server.start()
    try:
        with socket.socket(socket.AF_UNIX) as silent:
            silent.connect(str(path))  # sends nothing
            started = time.monotonic()
            assert call(path, {"command": "ping"}, timeout=2.0)["ok"] is True
            assert time.monotonic() - started < 1.5
    finally:
        server.stop()


def test_a_second_server_does_not_steal_a_live_socket(world_dir: Path) -> None:
    path = world_dir / "s.sock"
    first = HookServer(path, lambda peer: True)
    first.start()
    try:
        with pytest.raises(OSError, match="another daemon"):
            HookServer(path, lambda peer: True).start()
        assert call(path, {"command": "ping"})["ok"] is True
    finally:
        first.stop()


def test_hooks_without_a_daemon(tmp_path: Path) -> None:
    run = tmp_path / "run"
    reports = tmp_path / "reports"
    config = tmp_path / "nodescope.toml"

    def write_config(expected: int) -> None:
        config.write_text(
            f'[roots]\nrun = "{run}"\ndev = "{tmp_path / "dev"}"\n'
            f'[slurm]\nreports_dir = "{reports}"\nscontrol = ""\nexpected_gpus = {expected}\n'
        )

    write_config(expected=8)
    started = time.monotonic()
    result = run_hook("prolog", config, hook_env("5", SLURM_JOB_GPUS="0,1"))
    assert time.monotonic() - started < 10
    assert result.returncode == 1, result.stderr
    assert result.stdout.strip().splitlines() == [
        f"nodescope: expected 8 GPUs, found 0 ({tmp_path / 'dev'}/nvidia devices)"
    ]
    assert "daemon not answering" in result.stderr
    # Unfit: the job will not run here, so it is not registered.
    assert not (run / "nodescope" / "jobs" / "5.json").exists()

    write_config(expected=0)
    result = run_hook("prolog", config, hook_env("5", SLURM_JOB_GPUS="0,1"))
    assert result.returncode == 0, result.stderr
    registration = json.loads((run / "nodescope" / "jobs" / "5.json").read_text())
    assert registration["gpus"] == [0, 1] and registration["format"] == "nodescope-registration/1"
    assert "disks" in registration["baseline"]
    result = run_hook(
        "epilog", config, hook_env("5", SLURM_JOB_GPUS="0,1", SLURM_JOB_EXIT_CODE="0")
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((reports / "5.json").read_text())
    assert report["daemon"] is False and report["gpus"] == [0, 1]
    assert report["deltas"] is not None and "disks" in report["deltas"]
    assert not (run / "nodescope" / "jobs" / "5.json").exists()
    shown = subprocess.run(
        [*nodescope_command(), "report", "5", "--dir", str(reports),
         "--svg", str(tmp_path / "5.svg")],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "job 5  user root" in shown.stdout and "daemon was down" in shown.stdout
    assert (tmp_path / "5.svg").read_text().startswith("<svg")
    # A hook run without a job in its environment does nothing and never fails the job.
    result = run_hook("prolog", config, {})
    assert result.returncode == 0 and "hook skipped" in result.stderr


_WRITER = """
import sys
from pathlib import Path
from nodescope_exporters.reports import atomic_write_bytes
target = Path(sys.argv[1])
payloads = [Path(sys.argv[2]).read_bytes(), Path(sys.argv[3]).read_bytes()]
i = 0
while True:
    print("writing", i % 2, flush=True)
    atomic_write_bytes(target, payloads[i % 2])
    i += 1
"""


def test_kill_minus_9_mid_write_leaves_old_or_new(tmp_path: Path) -> None:
    old = json.dumps({"format": "nodescope-job-report/1", "v": "old", "pad": "a" * (12 << 20)})
    new = json.dumps({"format": "nodescope-job-report/1", "v": "new", "pad": "b" * (12 << 20)})
    (tmp_path / "old").write_text(old)
    (tmp_path / "new").write_text(new)
    target = tmp_path / "reports" / "42.json"
    target.parent.mkdir()
    target.write_text(old)
    outcomes = set()
    for attempt in range(6):
        writer = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(target), str(tmp_path / "old"),
             str(tmp_path / "new")],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert writer.stdout is not None
        for _ in range(1 + attempt % 3):
            writer.stdout.readline()  # a write has begun
        time.sleep(0.003 * attempt)
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(timeout=10)
        writer.stdout.close()
        text = target.read_text()
        assert text in (old, new), f"partial report after kill -9 (attempt {attempt})"
        outcomes.add(json.loads(text)["v"])
    leftovers = [p.name for p in target.parent.iterdir() if p.name != "42.json"]
    # A temporary file left behind is a kill that landed inside a write: the case under test.
    assert leftovers, "no kill landed inside a write"
    assert all(name.startswith(".42.json.") and name.endswith(".tmp") for name in leftovers)


def test_default_config_has_the_slurm_defaults() -> None:
    slurm = default_config().slurm
    assert slurm.timeout_seconds <= 2.0 and slurm.reports_dir == "/var/lib/nodescope/jobs"


def test_gpu_holders_found_through_proc_fd(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    from nodescope.hooks.health import gpu_holders
    from nodescope.roots import Roots

    # No NVIDIA driver here: a node of /dev/zero's device number (1:5) stands in for a GPU,
    # so that a process can really hold it open.
    device = tmp_path / "gpu5"
    os.mknod(device, 0o666 | 0o020000, os.makedev(1, 5))
    holder = subprocess.Popen(
        ["/bin/sh", "-c", f"exec 3<>{device}; echo ready; exec sleep 60"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        _wait_for_comm(holder.pid, "sleep")
        found = gpu_holders(Roots(), [7, 5], major=1)
        assert {"pid": holder.pid, "gpu": 5, "comm": "sleep"} in found
        assert all(h["gpu"] in (7, 5) for h in found)
        assert not [h for h in gpu_holders(Roots(), [7], major=1) if h["pid"] == holder.pid]
        assert not [h for h in gpu_holders(Roots(), [5]) if h["pid"] == holder.pid]
    finally:
        holder.kill()
        holder.wait(timeout=10)
        if holder.stdout is not None:
            holder.stdout.close()


def _wait_for_comm(pid: int, comm: str) -> None:
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}/comm").read_text().strip() != comm:
        assert time.monotonic() < deadline
        time.sleep(0.01)
