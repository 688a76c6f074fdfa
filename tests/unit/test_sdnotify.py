from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from nodescope.sdnotify import Notifier


def test_without_socket_every_call_is_a_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = Notifier()
    assert not n.enabled
    assert n.ready() is False


def test_messages_reach_the_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "notify"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(path))
    server.settimeout(2)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    monkeypatch.setenv("WATCHDOG_USEC", "4000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    n = Notifier()
    assert n.watchdog_seconds == 4.0
    n.ready("collecting")
    assert server.recv(4096) == b"READY=1\nSTATUS=collecting"
    n.reloading()
    msg = server.recv(4096).decode()
    assert msg.startswith("RELOADING=1\nMONOTONIC_USEC=")
    assert int(msg.rsplit("=", 1)[1]) > 0
    n.watchdog()
    assert server.recv(4096) == b"WATCHDOG=1"
    n.detach_environment()
    n.stopping()
    assert server.recv(4096) == b"STOPPING=1"
    import os

    assert "NOTIFY_SOCKET" not in os.environ
    n.close()
    server.close()


def test_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"nodescope-test-{os.getpid()}-{id(monkeypatch)}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind("\0" + name)
    server.settimeout(2)
    n = Notifier("@" + name)
    assert n.ready()
    assert server.recv(100) == b"READY=1"
    server.close()


def test_watchdog_for_another_pid_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert Notifier("/nonexistent").watchdog_seconds is None


def test_no_watchdog_pings_unless_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    path = tmp_path / "notify"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(path))
    n = Notifier(str(path))
    assert n.watchdog() is False
    server.close()


@pytest.mark.alone  # a bound on wall-clock time
def test_a_full_notify_socket_never_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nobody reads the socket: sends fail fast instead of stopping the loop."""
    import time

    path = tmp_path / "notify"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(path))
    n = Notifier(str(path))
    start = time.monotonic()
    results = [n.status("x" * 1000) for _ in range(2000)]
    assert time.monotonic() - start < 5
    assert False in results  # the queue filled up and sends were dropped, not waited on
    server.close()
