"""Text a user controls and the actions nodescope takes on Slurm.

* Processes with hostile names (an ESC sequence, quotes, ``$``, backticks, ``;``, ``\\``, a
  newline, bytes that are not UTF-8, a bidirectional override; set through
  ``/proc/self/comm`` as any user can) hold a GPU after their job: the real epilog hook runs
  against a recording ``scontrol``, and the drain reason it hands over, what it prints, the
  report ``nodescope report`` shows and the log lines are one safe line each.
* ``[remediation] dry_run = true``: the same epilog drains nothing and exits 0 (Slurm drains a
  node on any other exit status of its epilog); the cool-down and the partition guard hold an
  epilog's drain back as they hold the policy's.
* Every place in ``daemon/`` that runs a program or changes Slurm is listed (an AST scan): a
  new one outside the gateway fails.
"""

from __future__ import annotations

import ast
import io
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.cli.alerts import format_alerts
from nodescope.logs import FieldFormatter
from nodescope.text import sanitize
from tests.conftest import nodescope_command
from tests.hook_peers import hook_env, run_hook

REPO = Path(__file__).resolve().parents[2]
DAEMON = REPO / "daemon" / "nodescope"
#: The GPU the hostile processes hold: a character device 195:<minor>, as /dev/nvidia<minor>.
#: The epilog looks for its holders in every process of the machine: a minor of this
#: process's own (nvidia0-99 left to the other tests, 255 is nvidiactl), so that the holders
#: of a test run beside this one are not taken for this test's.
MINOR = 100 + os.getpid() % 150
#: Names a user gives its processes (the kernel keeps 15 bytes of each).
HOSTILE_NAMES = (
    b"\x1b]0;owned\x07\x1b[2J",
    b"\"$(id)`;\\'x",
    b"a\nb\rc\x7f\xff\xfe",
    b"\xe2\x80\xaeexe.txt\x1b[8m",
)
#: What a drain reason may hold once sanitised (``?`` marks what was replaced).
REASON_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _.,:=/+()#%@-?")

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a GPU device node")


def one_safe_line(text: str) -> bool:
    return text.isprintable() and "\x1b" not in text


def safe_output(text: str) -> bool:
    return all(one_safe_line(line) for line in text.splitlines())


@pytest.fixture
def holders(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes named as :data:`HOSTILE_NAMES`, each holding the GPU device node (an
    ``O_PATH`` descriptor: no driver needed, and ``/proc/<pid>/fd`` shows it as the device)."""
    node = tmp_path / f"nvidia{MINOR}"
    os.mknod(node, 0o600 | 0o020000, os.makedev(195, MINOR))
    script = textwrap.dedent(
        """
        import os, sys
        fd = os.open(sys.argv[1], os.O_PATH)
        with open("/proc/self/comm", "wb") as comm:
            comm.write(bytes.fromhex(sys.argv[2]))
        print("ready", flush=True)
        sys.stdin.read()
        """
    )
    started = []
    try:
        for name in HOSTILE_NAMES:
            proc = subprocess.Popen(
                [sys.executable, "-c", script, str(node), name.hex()],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            started.append(proc)
            assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        yield started
    finally:
        for proc in started:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(10)


def recording_scontrol(directory: Path, *, drained_share: int = 0) -> tuple[Path, Path]:
    """An ``scontrol`` that logs every argument vector it is given (one JSON line each) and
    shows node ``node1`` idle in partition ``p`` of 10 nodes, ``drained_share`` others of them
    drained by nodescope."""
    log = directory / "scontrol.log"
    tool = directory / "scontrol"
    others = "".join(
        f"NodeName=other{i} State=IDLE+DRAIN Partitions=p Reason=nodescope: x [root@1]\\n"
        for i in range(drained_share)
    )
    tool.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        f"with open({str(log)!r}, 'a') as out:\n"
        "    out.write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "if sys.argv[1:3] == ['show', 'node']:\n"
        f"    sys.stdout.write('NodeName=node1 State=IDLE Partitions=p\\n{others}')\n"
        "elif sys.argv[1:3] == ['show', 'partition']:\n"
        "    print('PartitionName=p TotalNodes=10')\n"
    )
    tool.chmod(0o755)
    return tool, log


def calls(log: Path) -> list[list[str]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


def write_config(tmp_path: Path, tool: Path, remediation: str = "") -> Path:
    config = tmp_path / "nodescope.toml"
    config.write_text(
        f'[roots]\nrun = "{tmp_path / "run"}"\n'
        f'[slurm]\nreports_dir = "{tmp_path / "reports"}"\nscontrol = "{tool}"\n'
        f"[remediation]\n{remediation}"
    )
    return config


def epilog(config: Path, job: str) -> subprocess.CompletedProcess[str]:
    env = hook_env(job, SLURM_JOB_GPUS=str(MINOR), SLURMD_NODENAME="node1")
    return run_hook("epilog", config, env)


@needs_root
def test_hostile_process_names_reach_scontrol_and_terminals_as_safe_text(
    tmp_path: Path, holders: list[subprocess.Popen[bytes]]
) -> None:
    tool, log = recording_scontrol(tmp_path)
    config = write_config(tmp_path, tool)
    result = epilog(config, "71")
    assert result.returncode == 1, result.stderr
    updates = [argv for argv in calls(log) if argv[0] == "update"]
    assert len(updates) == 1, calls(log)
    argv = updates[0]
    assert argv[:3] == ["update", "nodename=node1", "state=drain"]
    reason = argv[3].removeprefix("reason=")
    assert reason.startswith("nodescope: job 71 GPU(s) still held after the job")
    assert set(reason) <= REASON_CHARS, reason
    for holder in holders:
        assert f"pid {holder.pid} (" in reason  # every holder named, its name made safe
    assert safe_output(result.stdout) and safe_output(result.stderr)
    # The report keeps the names as data; `nodescope report` shows them as safe text.
    shown = subprocess.run(
        [*nodescope_command(), "report", "71", "--dir", str(tmp_path / "reports")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "still held" in shown.stdout and safe_output(shown.stdout)


@needs_root
def test_a_dry_run_epilog_drains_nothing_and_passes(
    tmp_path: Path, holders: list[subprocess.Popen[bytes]]
) -> None:
    tool, log = recording_scontrol(tmp_path)
    config = write_config(tmp_path, tool, "dry_run = true\n")
    result = epilog(config, "72")
    assert result.returncode == 0, result.stderr
    assert calls(log) == []  # not even read: a dry run changes nothing and needs nothing
    assert "dry run: would drain node1" in result.stderr
    assert safe_output(result.stdout) and safe_output(result.stderr)


@needs_root
def test_the_partition_guard_holds_an_epilog_drain_back(
    tmp_path: Path, holders: list[subprocess.Popen[bytes]]
) -> None:
    # 3 of the partition's 10 nodes drained by nodescope already: over the default 10 %.
    tool, log = recording_scontrol(tmp_path, drained_share=3)
    config = write_config(tmp_path, tool)
    result = epilog(config, "73")
    assert result.returncode == 0, result.stderr
    assert [argv for argv in calls(log) if argv[0] == "update"] == []
    assert "held: would drain node1" in result.stderr and "partition p" in result.stderr


def test_the_cool_down_holds_a_drain_through_the_gateway(tmp_path: Path) -> None:
    from nodescope import assembly
    from nodescope.remediation.gateway import Verb, apply
    from nodescope.remediation.policy import Memory, NodeView, PartitionLoad
    from nodescope.remediation.slurm import Scontrol

    tool, log = recording_scontrol(tmp_path)
    config = assembly.load(str(write_config(tmp_path, tool)))
    view = NodeView("node1", False, None, (PartitionLoad("p", 10, 0),))
    now = time.time()
    recent = Memory(last_change=now - 60)
    scontrol = Scontrol(str(tool))
    held = apply(config, Verb.DRAIN, "node1", "x", tool=scontrol, view=view, memory=recent)
    assert held.held.startswith("cool-down") and not held.done
    resume = apply(config, Verb.RESUME, "node1", tool=scontrol, view=view, memory=recent)
    assert resume.held.startswith("cool-down") and not resume.done
    assert calls(log) == []
    later = Memory(last_change=now - 3600)
    done = apply(config, Verb.DRAIN, "node1", "$(x)`\x1b", tool=scontrol, view=view, memory=later)
    assert done.done and calls(log) == [
        ["update", "nodename=node1", "state=drain", "reason=nodescope: ?(x)?"]
    ]


# --------------------------------------------------------------------------------------------
# The sanitiser where text leaves: log lines, the alerts a terminal shows


def test_log_lines_and_the_alerts_listing_are_safe_text() -> None:
    hostile = 'gpu\x1b[2J\x1b]0;t\x07 "$(id)`;\\\nlevel=ERROR forged=1 \udcff\u202e'
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(FieldFormatter("logfmt", with_time=False))
    logger = logging.getLogger("nodescope.test_actions")
    logger.addHandler(handler)
    try:
        logger.warning("event=x name=%s", hostile)
    finally:
        logger.removeHandler(handler)
    line = out.getvalue()
    assert line.count("\n") == 1 and one_safe_line(line.rstrip("\n"))
    document = {
        "alerts": [
            {"state": "firing", "kind": "k\x1b[31m", "severity": "critical", "subject": hostile,
             "message": hostile * 50, "fingerprint": "f", "key": "k", "started_wall": 0.0,
             "fired_wall": 0.0}
        ]
    }  # fmt: skip
    shown = io.StringIO()
    format_alerts(document, shown)
    assert safe_output(shown.getvalue())


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(st.text(max_size=3000), st.binary(max_size=3000)),
    st.integers(1, 2000),
    st.booleans(),
)
def test_any_text_comes_out_as_one_bounded_safe_line(
    text: str | bytes, limit: int, ascii_only: bool
) -> None:
    out = sanitize(text, limit, ascii_only=ascii_only)
    assert len(out) <= limit and one_safe_line(out)
    if ascii_only:
        assert set(out) <= REASON_CHARS
    assert sanitize(out, limit, ascii_only=ascii_only) == out  # applying it twice changes nothing


# --------------------------------------------------------------------------------------------
# One gateway: every program run and every change of Slurm, listed

#: Where ``daemon/`` may run a program, each with why; scontrol runs only in Scontrol.run.
PROGRAM_RUNNERS = {
    ("remediation/slurm.py", "Scontrol.run"): "scontrol, for the gateway and Slurm's reads",
    ("httpserver.py", "ServingProcess.__init__"): "the serving process",
    ("probe_runner.py", "run_process"): "the probe's worker process",
    ("cli/probe.py", "run"): "the probe command",
    ("cli/slurm.py", "_probe"): "the quick probe at the prolog",
    ("cli/demo.py", "Child.__init__"): "the demo's daemon",
    ("sources/traces.py", "parse_job"): "the trace parser's process",
}
_RUNNER_CALLS = {
    "run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput",
    "system", "popen", "execv", "execve", "execvp", "execvpe", "execl", "execlp", "execle",
    "execlpe", "spawnv", "spawnve", "spawnvp", "spawnl", "posix_spawn", "posix_spawnp",
    "fork", "forkpty",
}  # fmt: skip
#: Methods that change Slurm: called only by the gateway.
_CHANGES = {"drain", "resume", "requeue", "_update"}


def _calls_in(path: Path) -> Iterator[tuple[str, ast.Call]]:
    """Every call in ``path`` with the qualified name of the function it is in."""
    tree = ast.parse(path.read_text(), str(path))

    def walk(node: ast.AST, scope: str) -> Iterator[tuple[str, ast.Call]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                yield from walk(child, f"{scope}.{child.name}" if scope else child.name)
            else:
                if isinstance(child, ast.Call):
                    yield scope, child
                yield from walk(child, scope)

    yield from walk(tree, "")


def _module_aliases(path: Path) -> set[str]:
    """Names under which ``subprocess``, ``os`` or ``pty`` (or their functions) are imported."""
    names = {"subprocess", "os", "pty"}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module in ("subprocess", "os", "pty"):
            names |= {a.asname or a.name for a in node.names if a.name in _RUNNER_CALLS}
        if isinstance(node, ast.Import):
            names |= {
                a.asname for a in node.names if a.name in ("subprocess", "os", "pty") and a.asname
            }
    return names


def program_runs_and_slurm_changes(
    root: Path = DAEMON,
) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    runs: set[tuple[str, str]] = set()
    changes: set[tuple[str, str]] = set()
    for path in sorted(root.rglob("*.py")):
        where = str(path.relative_to(root))
        aliases = _module_aliases(path)
        for scope, call in _calls_in(path):
            func = call.func
            if isinstance(func, ast.Attribute):
                base = func.value
                if func.attr in _RUNNER_CALLS and isinstance(base, ast.Name) and base.id in aliases:
                    runs.add((where, scope))
                # A change names its node or job (a queue's drain() of its own names none).
                if (
                    func.attr in _CHANGES
                    and call.args
                    and not (isinstance(base, ast.Name) and base.id == "self")
                ):
                    changes.add((where, scope))
            elif isinstance(func, ast.Name) and func.id in aliases - {"subprocess", "os", "pty"}:
                runs.add((where, scope))
        # A program named in a string handed to something: scontrol's sub-commands that
        # change Slurm appear in remediation/slurm.py only.
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value.startswith(("state=drain", "state=resume", "state=undrain"))
            ):
                changes.add((where, "<string " + node.value + ">"))
    return runs, changes


def test_every_program_run_and_every_change_of_slurm_is_known() -> None:
    runs, changes = program_runs_and_slurm_changes()
    assert runs == set(PROGRAM_RUNNERS), (
        "a program is run where none was: scontrol goes through "
        "nodescope.remediation.gateway.apply, anything else is added to PROGRAM_RUNNERS "
        f"with why; new: {sorted(runs - set(PROGRAM_RUNNERS))}, "
        f"gone: {sorted(set(PROGRAM_RUNNERS) - runs)}"
    )
    assert changes == {
        ("remediation/gateway.py", "apply"),
        ("remediation/slurm.py", "<string state=drain>"),
        ("remediation/slurm.py", "<string state=resume>"),
    }, changes


def test_the_scan_finds_a_direct_scontrol_call(tmp_path: Path) -> None:
    """The scan itself, on code like the epilog's drain before the gateway existed."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import subprocess\n"
        "def drain(config, node, reason):\n"
        "    subprocess.run([config.slurm.scontrol, 'update', f'nodename={node}',\n"
        "                    'state=drain', f'reason={reason}'])\n"
    )
    (tmp_path / "other.py").write_text(
        "from subprocess import run as go\n"
        "class Hook:\n"
        "    def act(self, tool, node):\n"
        "        go(['x'])\n"
        "        tool.resume(node)\n"
    )
    runs, changes = program_runs_and_slurm_changes(tmp_path)
    assert runs == {("sample.py", "drain"), ("other.py", "Hook.act")}
    assert changes == {("sample.py", "<string state=drain>"), ("other.py", "Hook.act")}


def test_the_remediation_imports_nothing_of_the_hooks() -> None:
    """The hooks call the gateway; the remediation never needs the hooks (no import cycle
    between ``hooks.health`` and ``remediation.act``)."""
    for path in sorted((DAEMON / "remediation").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("nodescope.hooks"), path
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("nodescope.hooks") for a in node.names), path


def test_a_dry_run_prolog_drains_nothing_and_lets_the_job_run(tmp_path: Path) -> None:
    """The gate fails on a check of its own (no GPU where 8 are expected): in a dry run the
    hook drains nothing and exits 0, and the job is registered as on a fit node."""
    tool, log = recording_scontrol(tmp_path)
    (tmp_path / "dev").mkdir()
    config = tmp_path / "nodescope.toml"
    config.write_text(
        f'[roots]\nrun = "{tmp_path / "run"}"\ndev = "{tmp_path / "dev"}"\n'
        f'[slurm]\nreports_dir = "{tmp_path / "reports"}"\nscontrol = "{tool}"\n'
        "expected_gpus = 8\n[remediation]\ndry_run = true\n"
    )
    env = hook_env("74", SLURMD_NODENAME="node1")
    result = run_hook("prolog", config, env)
    assert result.returncode == 0, result.stderr
    assert "dry run: would drain node1" in result.stderr
    assert calls(log) == []
    assert (tmp_path / "run" / "nodescope" / "jobs" / "74.json").exists()
    # Without the dry run the same gate drains, through the gateway, and fails the job.
    config.write_text(config.read_text().replace("dry_run = true", "dry_run = false"))
    result = run_hook("prolog", config, hook_env("75", SLURMD_NODENAME="node1"))
    assert result.returncode == 1, result.stderr
    assert [a[:3] for a in calls(log) if a[0] == "update"] == [
        ["update", "nodename=node1", "state=drain"]
    ]
