"""The Slurm hook socket against hostile and crowded clients, on a real Unix socket.

Unprivileged clients are real processes running as ``nobody`` (a forked child that calls
``os.setuid``). The socket is opened up by hand (directory 0755, socket 0666) where a test
needs a stranger to reach it at all: what is tested then is the second layer, ``SO_PEERCRED``
checked before anything is read.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodescope.assembly import default_config
from nodescope.config import Config, SlurmSettings
from nodescope.hooks.auth import Peer, allowed_uids
from nodescope.hooks.health import write_gate_state
from nodescope.hooks.tracker import JobTracker
from nodescope.hooks.transport import HookServer, HookUnavailable, call
from nodescope.roots import Roots
from tests.conftest import nodescope_command
from tests.hook_peers import NOBODY, as_nobody, enterable_dir, hook_env, run_hook
from tests.integration.daemon_harness import Daemon

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as nobody")


@pytest.fixture
def world_dir() -> Iterator[Path]:
    with enterable_dir() as path:
        yield path


def _root_only(peer: Peer) -> bool:
    return peer.uid in allowed_uids(SlurmSettings(slurm_user="root"))


def _open_up(server: HookServer) -> None:
    """What an operator's mistake (or a filesystem without ACLs) would leave: anyone can
    connect, so only SO_PEERCRED stands between a stranger and the daemon."""
    os.chmod(server.path.parent, 0o755)
    os.chmod(server.path, 0o666)


@pytest.mark.alone  # 20 calls within 2 s
def test_idle_strangers_cannot_starve_root(world_dir: Path) -> None:
    """Finding: 40 idle connections of an unprivileged user held the one-at-a-time server
    (2 s each), so every prolog fell back to local checks."""
    server = HookServer(world_dir / "nodescope" / "nodescope.sock", _root_only)
    server.start()
    ready_r, ready_w = os.pipe()
    release_r, release_w = os.pipe()

    def hold_forty() -> None:
        held = []
        for _ in range(40):
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(server.path))
            held.append(s)
        os.write(ready_w, b"x")
        os.read(release_r, 1)  # until the parent has made its calls

    try:
        _open_up(server)
        holder = threading.Thread(target=lambda: as_nobody(hold_forty))
        holder.start()
        assert os.read(ready_r, 1) == b"x"
        started = time.monotonic()
        answers = [call(server.path, {"command": "ping"}, timeout=2.0) for _ in range(20)]
        elapsed = time.monotonic() - started
        os.write(release_w, b"x")
        holder.join(timeout=10)
        assert all(a["ok"] for a in answers)
        assert elapsed < 2.0, f"20 root calls took {elapsed:.2f} s"
        assert server.refused.total >= 40
        assert server.open_connections == 0  # refused ones were closed at once
    finally:
        server.stop()
        for fd in (ready_r, ready_w, release_r, release_w):
            os.close(fd)


def test_a_stranger_is_refused_before_anything_is_read(world_dir: Path) -> None:
    server = HookServer(world_dir / "nodescope" / "nodescope.sock", _root_only)
    reached: list[Peer] = []
    server.register("echo", lambda request, peer: reached.append(peer) or {"ok": True})
    server.start()
    answer_r, answer_w = os.pipe()

    def talk() -> None:
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(server.path))
        s.settimeout(2.0)
        # The answer comes without the client having sent a byte.
        os.write(answer_w, s.recv(4096))

    try:
        _open_up(server)
        assert as_nobody(talk) == 0
        os.close(answer_w)
        assert json.loads(os.read(answer_r, 4096)) == {"ok": False, "error": "permission denied"}
        assert reached == [] and server.refused.total == 1
    finally:
        server.stop()
        os.close(answer_r)


def test_refusals_are_logged_as_a_count_not_a_line_each(
    world_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding: 5,000 refused requests wrote 5,000 WARNING lines."""
    server = HookServer(world_dir / "nodescope" / "nodescope.sock", _root_only)
    server.start()
    caplog.set_level(logging.INFO, logger="nodescope.hooks")

    def knock() -> None:
        for _ in range(5000):
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(server.path))
                s.settimeout(2.0)
                s.recv(4096)  # the refusal: then the server has counted it

    try:
        _open_up(server)
        assert as_nobody(knock) == 0
    finally:
        server.stop()
    lines = [r.getMessage() for r in caplog.records if "event=hook_refused" in r.getMessage()]
    assert server.refused.total == 5000
    assert 1 <= len(lines) <= 2, lines
    assert f"uid={NOBODY}" in lines[0]


def test_per_uid_limit_keeps_one_allowed_user_from_holding_every_slot(world_dir: Path) -> None:
    """The SlurmUser is allowed but gets at most max_per_uid connections; root still gets
    through while they are all held."""
    settings = SlurmSettings(slurm_user="nobody")
    server = HookServer(
        world_dir / "nodescope" / "nodescope.sock",
        lambda peer: peer.uid in allowed_uids(settings),
        max_per_uid=8,
    )
    server.start()
    result_r, result_w = os.pipe()

    def crowd() -> None:
        sockets = []
        for _ in range(20):
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(server.path))
            sockets.append(s)
        time.sleep(0.3)  # the server has accepted every one (within its 2 s deadline)
        held = busy = 0
        for s in sockets:
            try:
                busy += b"busy" in s.recv(4096, socket.MSG_DONTWAIT)
            except BlockingIOError:
                held += 1  # admitted: the server is waiting for its request
        os.write(result_w, f"{held} {busy}".encode())

    try:
        _open_up(server)
        assert as_nobody(crowd) == 0
        os.close(result_w)
        held, busy = map(int, os.read(result_r, 64).split())
        assert (held, busy) == (8, 12)
        assert call(server.path, {"command": "ping"})["ok"] is True
    finally:
        server.stop()
        os.close(result_r)


_SERVER = """
import sys, time
from pathlib import Path
from nodescope.hooks.transport import HookServer
server = HookServer(Path(sys.argv[1]), lambda peer: peer.uid == 0)
server.start()
print("ready", flush=True)
sys.stdin.read()
server.stop()
"""


def test_five_hundred_parallel_prologs_all_get_an_answer(world_dir: Path) -> None:
    """Finding: 500 parallel root prologs, 459 got EAGAIN (backlog 16, one at a time)."""
    path = world_dir / "nodescope" / "nodescope.sock"
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    failures: list[str] = []
    gate = threading.Barrier(500)

    def one() -> None:
        gate.wait()
        try:
            call(path, {"command": "ping"}, timeout=2.0)
        except HookUnavailable as exc:
            failures.append(str(exc))

    try:
        threads = [threading.Thread(target=one) for _ in range(500)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(timeout=10)
        server.stdout.close()
    assert not failures, f"{len(failures)} of 500 failed, e.g. {failures[:3]}"


def _tracker_server(world_dir: Path, dev: Path) -> tuple[HookServer, Config]:
    config = default_config()
    roots = Roots(run=world_dir / "run", dev=dev)
    from dataclasses import replace

    config = replace(
        config,
        roots=roots,
        slurm=replace(config.slurm, reports_dir=str(world_dir / "reports"), scontrol=""),
    )
    tracker = JobTracker(lambda: config)
    server = HookServer(roots.run / "nodescope" / "nodescope.sock", _root_only)
    server.register("prolog", tracker.prolog)
    server.register("epilog", tracker.epilog)
    server.start()
    return server, config


def test_request_fields_are_bounded(world_dir: Path) -> None:
    """Finding: one prolog with gpus=[0..99999] created 100k series."""
    dev = world_dir / "dev"
    dev.mkdir()
    for minor in (0, 1):  # the node's two GPUs, as device nodes (no driver needed)
        os.mknod(dev / f"nvidia{minor}", 0o600 | 0o020000, os.makedev(195, minor))
    server, config = _tracker_server(world_dir, dev)
    registrations = config.roots.run / "nodescope" / "jobs"
    try:
        huge = call(server.path, {"command": "prolog", "job_id": "7", "gpus": list(range(100_000))})
        assert huge["ok"] is False and huge["invalid"] is True
        assert "at most 2" in huge["error"]
        foreign = call(server.path, {"command": "prolog", "job_id": "7", "gpus": [0, 5]})
        assert foreign["ok"] is False and "5 is not a GPU of this node" in foreign["error"]
        for bad in (
            {"job_id": "1" * 11},
            {"job_id": "7", "user": "x" * 300},
            {"job_id": "7", "partition": "a\nb"},
            {"job_id": "7", "uid": -1},
            {"job_id": "7", "gpus": [True]},
        ):
            answer = call(server.path, {"command": "prolog", **bad})
            assert answer["ok"] is False and answer["invalid"] is True, bad
        assert not registrations.exists() or not list(registrations.iterdir())
        good = call(server.path, {"command": "prolog", "job_id": "7", "gpus": [1, 0]})
        assert good["ok"] is True
        assert json.loads((registrations / "7.json").read_text())["gpus"] == [0, 1]
    finally:
        server.stop()


def test_a_deadline_in_the_past_or_far_ahead_is_refused(world_dir: Path) -> None:
    server = HookServer(world_dir / "nodescope" / "nodescope.sock", _root_only)
    server.start()

    def raw(message: dict[str, object]) -> dict[str, object]:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(server.path))
            s.sendall(json.dumps(message).encode() + b"\n")
            s.settimeout(2.0)
            answer: dict[str, object] = json.loads(s.recv(4096))
            return answer

    try:
        now = time.time()
        assert "deadline passed" in str(
            raw({"command": "ping", "issued_at": now - 5, "deadline": now - 3})["error"]
        )
        assert raw({"command": "ping", "issued_at": now, "deadline": now + 1e9})["ok"] is False
        assert raw({"command": "ping"})["ok"] is False  # no deadline at all
        assert raw({"command": "ping", "issued_at": now, "deadline": now + 2})["ok"] is True
        assert server.expired.total == 1
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------
# A real daemon


def _daemon_config(work: Path) -> Path:
    config = work / "nodescope.toml"
    sources = "".join(
        f"[sources.{name}]\nenabled = false\n"
        for name in ("pci", "infiniband", "netdev", "cgroups", "procs", "nvml", "nvlink_kmod",
                     "probe", "locks", "threads", "mountstats", "udev", "link_events")
    )  # fmt: skip
    config.write_text(
        "[daemon]\ntick_seconds = 0.5\n"
        f'[roots]\nrun = "{work / "run"}"\ndev = "{work / "dev"}"\n'
        f"{sources}"
        f'[slurm]\nslurm_user = "root"\nreports_dir = "{work / "reports"}"\nscontrol = ""\n'
    )
    return config


def _hook(action: str, config: Path, job: str) -> subprocess.CompletedProcess[str]:
    return run_hook(action, config, hook_env(job, SLURM_JOB_EXIT_CODE="0"))


def test_a_stalled_daemon_does_not_act_on_requests_given_up(tmp_path: Path) -> None:
    """Finding: requests the client had given up on still ran after SIGSTOP/SIGCONT and
    overwrote a finished job's report with a 0 s duration."""
    config = _daemon_config(tmp_path)
    (tmp_path / "dev").mkdir()
    daemon = Daemon(tmp_path, ["--config", str(config)])
    try:
        daemon.wait_message("READY=1", timeout=60)
        assert _hook("prolog", config, "31").returncode == 0
        time.sleep(1.1)  # the job runs a little: its report must say so
        daemon.signal(signal.SIGSTOP)
        try:
            epilog = _hook("epilog", config, "31")
        finally:
            daemon.signal(signal.SIGCONT)
        assert epilog.returncode == 0 and "daemon not answering" in epilog.stderr
        report_path = tmp_path / "reports" / "31.json"
        local = report_path.read_text()
        assert json.loads(local)["daemon"] is False
        assert json.loads(local)["duration_seconds"] >= 1.0
        # The resumed daemon finds the request in its queue, past its deadline.
        deadline = time.monotonic() + 10
        while "event=hook_deadline_passed" not in daemon.stderr():
            assert time.monotonic() < deadline, daemon.stderr()
            time.sleep(0.1)
        time.sleep(0.5)
        assert report_path.read_text() == local, "a stale request replaced the report"
        assert "event=epilog " not in daemon.stderr()
    finally:
        daemon.stop()


def test_registrations_and_the_gate_record_survive_a_daemon_restart(tmp_path: Path) -> None:
    config = _daemon_config(tmp_path)
    (tmp_path / "dev").mkdir()
    first = Daemon(tmp_path, ["--config", str(config)])
    try:
        first.wait_message("READY=1", timeout=60)
        assert _hook("prolog", config, "41").returncode == 0
    finally:
        assert first.stop() == 0
    registration = tmp_path / "run" / "nodescope" / "jobs" / "41.json"
    assert registration.exists(), "stopping the daemon removed the registration"
    (tmp_path / "notify.sock").unlink()
    second = Daemon(tmp_path, ["--config", str(config)])
    try:
        second.wait_message("READY=1", timeout=60)
        assert _hook("epilog", config, "41").returncode == 0
        report = json.loads((tmp_path / "reports" / "41.json").read_text())
        assert report["daemon"] is True and report["registered"] is True
        assert not registration.exists()
    finally:
        second.stop()


def test_an_unreachable_daemon_does_not_pass_a_node_with_an_uncleared_xid(
    tmp_path: Path,
) -> None:
    """Finding: with the daemon out of reach, a node with an uncleared Xid 79 passed the
    prolog gate on local checks. The daemon's record of uncleared Xids now fails it."""
    config = _daemon_config(tmp_path)
    (tmp_path / "dev").mkdir()
    roots = Roots(run=tmp_path / "run")
    write_gate_state(roots, [("0", 79, 1)], time.time())
    result = _hook("prolog", config, "51")
    assert result.returncode == 1, result.stderr
    assert "Xid 79 on GPU 0" in result.stdout
    assert "daemon not answering" in result.stderr
    # A fresh daemon carries the record over (its own Xid counts start from zero).
    tracker = JobTracker(lambda: default_config(roots=roots))
    inputs = tracker.gate_inputs(default_config(roots=roots, slurm=SlurmSettings(scontrol="")))
    assert inputs.xids == (("0", 79, 1),)
    # Cleared by the operator, the node passes again.
    cleared = subprocess.run(
        [*nodescope_command(), "slurm", "clear-xids", "--config", str(config)],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert cleared.returncode == 0, cleared.stderr
    assert _hook("prolog", config, "52").returncode == 0
    # A spoiled record is not "no Xids".
    (tmp_path / "run" / "nodescope" / "gate-state.json").write_text("{")
    assert _hook("prolog", config, "53").returncode == 1
