"""What a command line user expects of every command: -V, lists of what can be named, a
progress line on a terminal for what takes seconds, and one clear line (no traceback, no new
directories) when an output path cannot be written."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nodescope import __version__
from nodescope.cli.main import main
from nodescope.sim.fleet import bundled_fleets
from nodescope.sim.scenario import bundled_scenarios, scenario_path
from tests.conftest import nodescope_command
from tests.unit.test_collectives import KINETO


def test_dash_capital_v_prints_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["-V"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"nodescope {__version__}"


def test_replay_and_demo_list_every_bundled_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--list"]) == 0
    replay_names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert replay_names == bundled_scenarios()
    assert main(["demo", "--list"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == replay_names
    assert main(["demo", "--list", "--nodes", "2"]) == 0
    fleets = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert fleets == bundled_fleets()


def test_replay_without_a_name_points_at_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay"]) == 2
    assert "--list" in capsys.readouterr().err


def _run_on_a_terminal(args: list[str], timeout: float = 300.0) -> tuple[int, str]:
    """Run the command with stderr on a pseudo-terminal (stdout to a pipe): what it draws
    there and its exit status."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=follower, close_fds=True)
    os.close(follower)
    chunks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.5)
        if ready:
            try:
                data = os.read(leader, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(leader)
    return proc.wait(timeout=30), b"".join(chunks).decode(errors="replace")


@pytest.mark.slow  # a scenario replayed twice
def test_replay_draws_its_progress_on_a_terminal_and_nothing_in_a_pipe(tmp_path: Path) -> None:
    # A bundled node cut to a few seconds of simulated time, its expectations left out.
    document = json.loads(scenario_path("dgx-h100").read_text())
    document.update(name="short", duration_seconds=4)
    document.pop("expect", None)
    short = tmp_path / "short.json"
    short.write_text(json.dumps(document))
    name = "short"
    status, drawn = _run_on_a_terminal([*nodescope_command(), "replay", str(short)])
    assert status == 0
    assert f"{name} t=" in drawn and "\r" in drawn
    piped = subprocess.run(
        [*nodescope_command(), "replay", str(short)], capture_output=True, text=True, check=False
    )
    assert piped.returncode == 0
    assert "\r" not in piped.stderr and f"{name} t=" not in piped.stderr


@pytest.mark.parametrize("command", ["analyze", "report"])
def test_an_output_path_in_a_missing_directory_is_one_line_and_creates_nothing(
    tmp_path: Path, command: str
) -> None:
    target = tmp_path / "no" / "such" / "dir" / "x.svg"
    args = _svg_args(command, tmp_path, target)
    result = subprocess.run(
        [*nodescope_command(), *args], capture_output=True, text=True, check=False
    )
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert f"cannot write {target}" in result.stderr
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("command", ["analyze", "report"])
@pytest.mark.parametrize("where", ["a file as the directory", "sysfs"])
def test_an_unwritable_output_path_is_one_line(tmp_path: Path, command: str, where: str) -> None:
    if where == "sysfs":
        # Even root cannot create a file at the top of sysfs.
        target = Path("/sys/nodescope-test.svg")
    else:
        (tmp_path / "plain").write_text("")
        target = tmp_path / "plain" / "x.svg"
    args = _svg_args(command, tmp_path, target)
    result = subprocess.run(
        [*nodescope_command(), *args], capture_output=True, text=True, check=False
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert f"cannot write {target}" in result.stderr
    assert result.stderr.strip().count("\n") == 0
    assert not target.exists()


def _svg_args(command: str, tmp_path: Path, target: Path) -> list[str]:
    if command == "analyze":
        return ["analyze", "--svg", str(target), *map(str, KINETO)]
    # A report as the epilog writes it, from the job tests' builder.
    from tests.unit.test_jobs import _report

    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "42.json").write_text(json.dumps(_report()))
    return ["report", "42", "--dir", str(reports), "--svg", str(target)]


def test_the_module_entry_point_matches_the_console_script() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "nodescope.cli.main", "-V"], capture_output=True, text=True
    )
    assert result.stdout.strip() == f"nodescope {__version__}"
