"""``nodescope demo`` keeps every file it writes under its own directory: a real demo process
given a configuration that names host paths, the real ``nodescope slurm prolog`` and
``epilog`` run against it as slurmd runs them, and the host compared before and after."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodescope.sim.node import preferred_temp_dir
from tests.conftest import nodescope_command
from tests.hook_peers import hook_env
from tests.integration.test_demo import Demo
from tests.unit.test_fleet import small_fleet

# The host's own directories are compared before and after: any other test that runs a daemon
# or a hook on the default roots meanwhile would change them, so these run with the machine to
# themselves.
pytestmark = [pytest.mark.integration, pytest.mark.alone]

#: Where a nodescope daemon or hook run on the host keeps its files.
HOST_DIRS = (Path("/var/lib/nodescope"), Path("/run/nodescope"), Path("/etc/nodescope"))

#: The system calls that create, change or remove a file system entry (the open family only
#: with a flag that writes), traced in the demo and in every hook. Whatever path they name is
#: a path the process wrote: strace attributes each call to our processes, where a listing
#: of /tmp or /dev/shm would also see every other program on the machine.
WRITING_CALLS = (
    "open,openat,openat2,creat,mkdir,mkdirat,rename,renameat,renameat2,link,linkat,symlink,"
    "symlinkat,mknod,mknodat,bind,unlink,unlinkat,rmdir,truncate,chmod,fchmodat,chown,lchown,"
    "fchownat,utimensat,setxattr,lsetxattr,removexattr,lremovexattr"
)
_OPEN_WRITES = re.compile(r"\b(O_WRONLY|O_RDWR|O_CREAT|O_TRUNC)\b")
_CALL = re.compile(r"^(?P<name>\w+)\((?P<args>.*)\)\s+=\s+\S+")
#: A descriptor as ``strace -y`` shows it (``AT_FDCWD</cwd>``, ``5</dir>``), or a string.
_TOKEN = re.compile(r'(?:AT_FDCWD|\d+)<(?P<fd>[^>]*)>|"(?P<text>(?:[^"\\]|\\.)*)"')


def strace(prefix: Path) -> list[str]:
    """The command prefix that traces the writing calls of a process and its children, one
    file per process (``PREFIX.PID``: no call split across lines by another's)."""
    binary = shutil.which("strace")
    if binary is None:
        pytest.fail("strace is not installed (scripts/lib.sh installs it)")
    return [binary, "-ff", "-qq", "-y", "--seccomp-bpf", "-e", "status=successful",
            "-e", f"trace={WRITING_CALLS}", "-o", str(prefix)]  # fmt: skip


def written_paths(prefix: Path, cwd: Path) -> set[str]:
    """Every path the traced processes created, changed or removed."""
    paths: set[str] = set()
    traces = sorted(prefix.parent.glob(f"{prefix.name}.*"))
    assert traces, f"no trace files {prefix}.*"
    for trace in traces:
        for line in trace.read_text(errors="replace").splitlines():
            call = _CALL.match(line)
            if call is None:
                continue
            name, args = call["name"], call["args"]
            if name.startswith("open") and not _OPEN_WRITES.search(args):
                continue
            if name == "bind" and "AF_UNIX" not in args:
                continue
            directory = str(cwd)
            strings: list[str] = []
            for token in _TOKEN.finditer(args):
                if token["fd"] is not None:
                    directory = token["fd"]
                elif token["text"]:
                    strings.append(os.path.join(directory, token["text"]))
            if name.startswith("symlink"):
                strings = strings[1:]  # the first is the link's target: text, not a path written
            elif not name.startswith(("rename", "link")):
                strings = strings[:1]  # the others are an attribute's name and value
            paths.update(os.path.normpath(p) for p in strings)
    return paths


def tree(path: Path) -> dict[str, tuple[int, int]]:
    """Every entry under ``path`` (itself included): its type bits and mtime."""
    out: dict[str, tuple[int, int]] = {}
    if not os.path.lexists(path):
        return out
    for entry in [path, *path.rglob("*")] if path.is_dir() else [path]:
        info = entry.lstat()
        out[str(entry)] = (stat.S_IFMT(info.st_mode), info.st_mtime_ns)
    return out


def host_state(home: Path, outside: Path) -> dict[str, object]:
    state: dict[str, object] = {f"tree {d}": tree(d) for d in (*HOST_DIRS, outside)}
    state[f"entries {home}"] = set(os.listdir(home))
    return state


def run_hook(
    action: str, env: dict[str, str], trace: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    """``nodescope slurm ACTION ARGS`` with ``env`` as its whole environment, as slurmd runs
    it (no PATH), its writing calls traced to ``trace.*``."""
    return subprocess.run(
        [*strace(trace), *nodescope_command(), "slurm", action, *args],
        env={**env, "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def traced_pid(tracer: subprocess.Popen[bytes]) -> int | None:
    """The process strace started (its only child), while it runs."""
    try:
        children = Path(f"/proc/{tracer.pid}/task/{tracer.pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if len(children) == 1 else None


@pytest.fixture
def traced_demo() -> Iterator[list[Demo]]:
    """Demos run under strace, stopped after a failed test too: SIGTERM to the demo itself
    (strace would only detach from it), so that it still removes its directory."""
    started: list[Demo] = []
    yield started
    for d in started:
        pid = traced_pid(d.proc)
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
        try:
            d.proc.wait(30)
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait()


def test_demo_and_its_hooks_write_only_under_the_demo_directory(
    tmp_path: Path, traced_demo: list[Demo]
) -> None:
    # A configuration as a host's would be, every path in it outside the demo: a demo takes
    # only its [alerts] and [detectors]; a hook takes it whole, and --run points the hook at
    # the demo's daemon. Its scontrol records each call: nothing may reach a Slurm.
    outside = tmp_path / "host"
    outside.mkdir()
    calls = tmp_path / "scontrol-calls"
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit 0\n')
    scontrol.chmod(0o755)
    config = tmp_path / "host.toml"
    config.write_text(
        f'[roots]\nrun = "{outside / "run"}"\n'
        f'[slurm]\nreports_dir = "{outside / "jobs"}"\nscontrol = "{scontrol}"\n'
        "[alerts]\nfor_seconds = 0\n"
    )
    home = Path(os.path.expanduser("~"))
    before = host_state(home, outside)

    traces = tmp_path / "traces"
    traces.mkdir()
    demo = Demo(
        tmp_path, "dgx-h100", "--duration", "300", "--config", str(config),
        wrapper=strace(traces / "demo"), env={"PYTHONDONTWRITEBYTECODE": "1"},
    )  # fmt: skip
    traced_demo.append(demo)
    demo.scrape(timeout=240)  # the node is built under strace
    root = demo.root()
    run_root = root / "run"
    reports = root / "var" / "lib" / "nodescope" / "jobs"
    hook_config = root / "etc" / "nodescope" / "nodescope.toml"
    assert f"--config {hook_config}" in demo.output()
    assert (run_root / "nodescope" / "nodescope.sock").is_socket()

    # Job 5 through the host's configuration and --run: the daemon answers, registers it and
    # writes its report, both in the demo's tree.
    env = hook_env("5", SLURM_JOB_GPUS="0,1")
    hook = ["--config", str(config), "--run", str(run_root)]
    result = run_hook("prolog", env, traces / "prolog5", *hook)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "daemon not answering" not in result.stderr
    assert (run_root / "nodescope" / "jobs" / "5.json").is_file()
    # The scenario's own processes hold every GPU: the epilog fails, and would drain
    # SLURMD_NODENAME with the host's scontrol; the demo's daemon answers that it drains
    # nothing, so none runs (checked at the end).
    result = run_hook("epilog", {**env, "SLURM_JOB_EXIT_CODE": "0"}, traces / "epilog5", *hook)
    assert "daemon not answering" not in result.stderr
    report = json.loads((reports / "5.json").read_text())
    assert report["daemon"] is True and report["gpus"] == [0, 1]
    assert result.returncode == (1 if report["gpu_holders"] else 0), result.stderr
    assert not (run_root / "nodescope" / "jobs" / "5.json").exists()

    # Job 6 through the configuration the demo wrote for its hooks.
    env6 = hook_env("6", SLURM_JOB_GPUS="2")
    result = run_hook("prolog", env6, traces / "prolog6", "--config", str(hook_config))
    assert result.returncode == 0, result.stdout + result.stderr
    result = run_hook(
        "epilog", {**env6, "SLURM_JOB_EXIT_CODE": "0"}, traces / "epilog6",
        "--config", str(hook_config),
    )  # fmt: skip
    report6 = json.loads((reports / "6.json").read_text())
    assert report6["daemon"] is True and report6["gpus"] == [2]
    assert result.returncode == (1 if report6["gpu_holders"] else 0), result.stderr

    # Job 7 asks for a GPU the node does not have: the prolog fails (Slurm and the node
    # disagree), and would drain SLURMD_NODENAME with the host's scontrol; the demo's daemon
    # answers that it drains nothing, so no scontrol runs.
    env7 = hook_env("7", SLURM_JOB_GPUS="0,99")
    result = run_hook("prolog", env7, traces / "prolog7", *hook)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "prolog refused" in result.stdout
    assert (run_root / "nodescope" / "gate-stops" / "7.json").is_file()

    shown = subprocess.run(
        [*nodescope_command(), "report", "5", "--dir", str(reports)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"job 5\s+user root", shown.stdout), shown.stdout

    after_running = host_state(home, outside)
    # SIGTERM to the demo itself (strace's child): strace would only detach from it.
    pid = traced_pid(demo.proc)
    assert pid is not None, demo.output()
    os.kill(pid, signal.SIGTERM)
    assert demo.wait(60) == 0, demo.output()
    assert not root.exists(), f"{root} left behind"
    after = host_state(home, outside)

    assert not calls.exists(), f"scontrol was run: {calls.read_text()}"
    for state in (after_running, after):
        for key, value in before.items():
            seen = state[key]
            if isinstance(value, set):
                assert isinstance(seen, set)
                assert not seen - value, f"{key}: new entries {sorted(seen - value)}"
            else:
                assert seen == value, f"{key} changed: {seen} != {value}"
    # Every path the demo and the hooks wrote, as the kernel was asked to write it.
    cwd = Path.cwd()
    written = set()
    for name in ("demo", "prolog5", "epilog5", "prolog6", "epilog6", "prolog7"):
        written |= written_paths(traces / name, cwd)
    assert any(p.startswith(f"{root}/var/lib/nodescope/jobs/") for p in written)
    allowed = {str(root), "/dev/null"}
    outside_root = sorted(p for p in written if not p.startswith(f"{root}/") and p not in allowed)
    assert not outside_root, f"written outside {root}: {outside_root[:20]}"


def test_a_fleet_writes_only_under_its_nodes_and_its_own_directories(tmp_path: Path) -> None:
    """``nodescope demo --nodes 2``: the orchestrator and both node processes traced; every
    path written is under a ``nodescope-fleet-*`` or ``nodescope-demo-*`` directory one of
    them created (and removed by the end), or is the ``--targets`` file asked for."""
    fleet = {k: v for k, v in small_fleet().items() if k != "phases"}
    fleet_path = tmp_path / "small.json"
    fleet_path.write_text(json.dumps(fleet))
    targets = tmp_path / "targets.json"
    home = Path(os.path.expanduser("~"))
    before = host_state(home, tmp_path / "nothing")
    traces = tmp_path / "traces"
    traces.mkdir()
    result = subprocess.run(
        [*strace(traces / "fleet"), *nodescope_command(), "demo", "--nodes", "2",
         str(fleet_path), "--listen", "127.0.0.1:0", "--no-tty", "--duration", "8",
         "--targets", str(targets)],
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "node01  http://127.0.0.1:" in result.stdout, result.stdout[-3000:]
    assert json.loads(targets.read_text())  # what was asked for

    written = written_paths(traces / "fleet", Path.cwd())
    base = re.escape(preferred_temp_dir() or tempfile.gettempdir())
    roots = {p for p in written if re.fullmatch(rf"{base}/nodescope-(demo|fleet)-[^/]+", p)}
    assert sum("nodescope-demo-" in r for r in roots) == 2 and len(roots) == 3, roots
    allowed = {*roots, str(targets), str(targets.with_name(".targets.json.partial")), "/dev/null"}
    outside = sorted(
        p for p in written if p not in allowed and not any(p.startswith(f"{r}/") for r in roots)
    )
    assert not outside, f"written outside the fleet's directories: {outside[:20]}"
    assert not [r for r in roots if os.path.lexists(r)], "left behind"
    assert host_state(home, tmp_path / "nothing") == before
