"""Start ``nodescope run`` as a real subprocess with a NOTIFY_SOCKET the test owns."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import tomllib
import urllib.request
from pathlib import Path

from tests.conftest import free_port as free_port  # the tests start daemons on it
from tests.conftest import nodescope_command

#: How long a test may wait for a daemon it started to say READY=1 (or RELOADING=1): beside
#: several test workers sharing two cores, the interpreter's imports alone take seconds. The
#: tests that bound the time to READY run alone (tests/integration/test_daemon.py).
READY_S = 60.0


def _names_a_run_directory(args: list[str]) -> bool:
    """Whether ``args`` give the daemon its run directory: ``--run``, or ``[roots] run`` in the
    ``--config`` file (a file that does not parse names none)."""
    if "--run" in args:
        return True
    if "--config" not in args or args.index("--config") + 1 >= len(args):
        return False
    try:
        config = tomllib.loads(Path(args[args.index("--config") + 1]).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False
    roots = config.get("roots")
    return isinstance(roots, dict) and "run" in roots


class Daemon:
    def __init__(
        self,
        workdir: Path,
        args: list[str],
        env: dict[str, str] | None = None,
        *,
        host_run: bool = False,
    ) -> None:
        """``nodescope run`` with ``args``. Its hook socket and records go to ``workdir/run``
        unless ``args`` name a run directory or ``host_run`` asks for the host's ``/run``: the
        daemons of tests running side by side would otherwise share one socket,
        ``/run/nodescope/nodescope.sock``."""
        if not host_run and not _names_a_run_directory(args):
            (workdir / "run").mkdir(exist_ok=True)
            args = [*args, "--run", str(workdir / "run")]
        self.port = free_port()
        self.notify_path = workdir / "notify.sock"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(self.notify_path))
        self.stderr_path = workdir / "daemon.stderr"
        self._stderr = self.stderr_path.open("wb")
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env["NOTIFY_SOCKET"] = str(self.notify_path)
        full_env["PYTHONUNBUFFERED"] = "1"
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [*nodescope_command(), "run", "--listen", f"127.0.0.1:{self.port}", *args],
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
            env=full_env,
        )
        self.messages: list[str] = []

    def wait_message(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.notify.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.notify.recv(4096).decode()
            except TimeoutError:
                break
            self.messages.append(data)
            if data.startswith(prefix) or f"\n{prefix}" in data:
                return data
        raise AssertionError(
            f"no {prefix!r} within {timeout}s; got {self.messages}; stderr:\n{self.stderr()}"
        )

    def scrape(self, path: str = "/metrics") -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
            body: bytes = r.read()
            return body.decode()

    def stderr(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def stop(self, timeout: float = 5.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.notify.close()
        self._stderr.close()
        return self.proc.returncode


def sample_value(exposition: str, series: str) -> float | None:
    """The value of one exact series line (``name{labels}``) in an exposition."""
    for line in exposition.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


def wait_for(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(predicate) and predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
