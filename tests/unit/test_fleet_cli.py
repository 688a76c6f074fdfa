"""``nodescope demo --nodes N [FLEET]``: the arguments it refuses, each node's configuration,
and (with real child processes on the small test node) where the nodes serve, the file_sd
targets, a node that dies, and SIGTERM or Ctrl-C stopping every node and removing every folder."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope import assembly
from nodescope.cli import demo as demo_cli
from nodescope.cli.main import main
from nodescope.sim import fleet as fleet_mod
from tests.conftest import free_port_run
from tests.unit.test_fleet import small_fleet


def test_the_clis_bounds_are_the_fleets() -> None:
    assert (demo_cli.MIN_NODES, demo_cli.MAX_NODES) == (fleet_mod.MIN_NODES, fleet_mod.MAX_NODES)


# --------------------------------------------------------------------------------------------
# Arguments


def _fleet_file(tmp_path: Path, document: dict[str, Any] | None = None) -> Path:
    path = tmp_path / "small-fleet.json"
    path.write_text(json.dumps(document or small_fleet()))
    return path


BAD_ARGUMENTS = [
    (["--nodes", "1"], "--nodes must be 2 to 64, got 1"),
    (["--nodes", "65"], "--nodes must be 2 to 64, got 65"),
    (["--nodes", "-3"], "--nodes must be 2 to 64, got -3"),
    (
        ["--nodes", "4", "no-such-fleet"],
        "no bundled fleet 'no-such-fleet' (bundled: job-straggler)",
    ),
    (["--nodes", "3"], "/phases/2/nodes/0: names node 4, and the fleet runs 3 nodes"),
    (["--nodes", "4", "--listen", "127.0.0.1:65534"], "ports 65534-65537 go past 65535"),
    (["--nodes", "4", "--listen", "nowhere"], "--listen:"),
    (["--nodes", "4", "--duration", "0"], "--duration must be a number greater than 0"),
    (["--nodes", "4", "--duration", "nan"], "--duration must be a number greater than 0"),
    (["--targets", "t.json"], "--targets needs --nodes"),
]


@pytest.mark.parametrize(("arguments", "message"), BAD_ARGUMENTS)
def test_bad_arguments_exit_2_with_the_reason(
    arguments: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", *arguments]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith("nodescope demo: ")


def test_a_bad_config_file_exits_2_before_any_node_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[alerts]\nfor_seconds = -1\n")
    assert main(["demo", "--nodes", "2", str(_fleet_file(tmp_path)), "--config", str(config)]) == 2
    assert "for_seconds" in capsys.readouterr().err


def test_a_fault_the_scenario_loader_refuses_names_the_fleet_and_node(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    document = small_fleet()
    document["phases"][2]["fault"][0]["gpu"] = 5  # the small node has GPU 0 only
    path = _fleet_file(tmp_path, document)
    assert main(["demo", "--nodes", "3", str(path), "--listen", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: node03's scenario:" in err
    assert "gpu: no GPU 5" in err


# --------------------------------------------------------------------------------------------
# Each node's configuration


def test_a_nodes_config_keeps_the_alerts_and_detectors_and_names_the_node(tmp_path: Path) -> None:
    path = tmp_path / "nodescope.toml"
    path.write_text(
        '[daemon]\nlisten = "0.0.0.0:1"\n\n'
        '[alerts]\nfor_seconds = 3.0\ninstance = "everyone"\n'
        'alertmanager_url = "http://127.0.0.1:9093"\n\n'
        "[alerts.rules.gpu_hw_slowdown]\nfor_seconds = 1.0\n\n"
        "[detectors.gpu_health]\nmin_slowdown_seconds = 5.0\n"
    )
    node = tmp_path / "node03.toml"
    node.write_text(demo_cli.node_config(demo_cli.node_config_tables(path), "node03"))
    settings_ = assembly.load(node)
    assert settings_.alerts.instance == "node03"
    assert settings_.alerts.for_seconds == 3.0
    assert settings_.alerts.alertmanager_url == "http://127.0.0.1:9093"
    assert settings_.alerts.rules["gpu_hw_slowdown"].for_seconds == 1.0
    assert settings_.detectors.gpu_health.min_slowdown_seconds == 5.0
    assert "daemon" not in tomllib.loads(node.read_text())  # the demo's own, not the file's


def test_without_a_config_a_node_still_names_itself() -> None:
    assert tomllib.loads(demo_cli.node_config({}, "node01")) == {"alerts": {"instance": "node01"}}


_SCALARS = (
    st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=30)
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(tables=st.dictionaries(st.text(max_size=8), st.dictionaries(st.text(max_size=8), _VALUES)))
def test_fuzz_toml_text_reads_back_as_written(tables: dict[str, dict[str, Any]]) -> None:
    # Keys and strings of any characters (quotes, control characters, DEL) survive the trip.
    assert tomllib.loads(demo_cli.toml_text(tables)) == tables


def test_infinite_floats_are_written_as_toml_spells_them() -> None:
    read = tomllib.loads(demo_cli.toml_text({"t": {"a": math.inf, "b": -math.inf}}))
    assert read == {"t": {"a": math.inf, "b": -math.inf}}


# --------------------------------------------------------------------------------------------
# Real nodes (the small test node: a child serves within a second or two)


class Orchestrator:
    def __init__(self, arguments: list[str], tmp_path: Path) -> None:
        self.out_path = tmp_path / "out.txt"
        self.err_path = tmp_path / "err.txt"
        with self.out_path.open("wb") as out, self.err_path.open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "nodescope.cli.main", "demo", *arguments],
                stdout=out,
                stderr=err,
            )

    def out(self) -> str:
        return self.out_path.read_text(errors="replace")

    def err(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = 60.0, where: str = "out") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in (self.out() if where == "out" else self.err()):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no {text!r} in the {where}\n{self.out()[-3000:]}\n{self.err()}")

    def children(self) -> list[int]:
        tasks = Path(f"/proc/{self.proc.pid}/task")
        found: list[int] = []
        for task in tasks.iterdir():
            found += [int(p) for p in (task / "children").read_text().split()]
        return sorted(found)


@pytest.fixture
def orchestrators() -> Iterator[list[Orchestrator]]:
    started: list[Orchestrator] = []
    yield started
    for orchestrator in started:
        if orchestrator.proc.poll() is None:
            orchestrator.proc.kill()
            orchestrator.proc.wait()


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _metrics(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def _first_metrics(url: str, within: float = 30.0) -> str:
    """A node's first exposition. It listens (and the fleet shows its URL) before its first
    cycle completes; until then /metrics rightly answers 503, which a scraper retries."""
    deadline = time.monotonic() + within
    while True:
        try:
            return _metrics(url)
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or time.monotonic() > deadline:
                raise
        time.sleep(0.2)


@pytest.mark.integration
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_nodes_serve_on_consecutive_ports_and_a_signal_stops_every_one(
    tmp_path: Path, orchestrators: list[Orchestrator], stop: signal.Signals
) -> None:
    port = free_port_run(2)
    targets = tmp_path / "targets.json"
    config = tmp_path / "nodescope.toml"
    config.write_text("[alerts]\nfor_seconds = 2.0\n")
    fleet = _fleet_file(tmp_path, {**small_fleet(), "phases": []})
    orchestrator = Orchestrator(
        [
            "--nodes", "2", str(fleet), "--listen", f"127.0.0.1:{port}", "--no-tty",
            "--targets", str(targets), "--config", str(config),
        ],
        tmp_path,
    )  # fmt: skip
    orchestrators.append(orchestrator)
    orchestrator.wait_for(f"Prometheus targets: {targets}")
    urls = [f"http://127.0.0.1:{port + i}/metrics" for i in (0, 1)]
    assert f"  node01  {urls[0]}\n  node02  {urls[1]}\n" in orchestrator.out()
    assert json.loads(targets.read_text()) == [
        {"targets": [f"127.0.0.1:{port}"], "labels": {"instance": "node01"}},
        {"targets": [f"127.0.0.1:{port + 1}"], "labels": {"instance": "node02"}},
    ]
    for url in urls:
        assert "nodescope_source_up" in _first_metrics(url)
    children = orchestrator.children()
    assert len(children) == 2
    for name, pid in zip(("node01", "node02"), children, strict=True):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        node_config = Path(argv[argv.index(b"--config") + 1].decode())
        read = assembly.load(node_config)
        assert (read.alerts.instance, read.alerts.for_seconds) == (name, 2.0)
    # One line per node per refresh, the GPU at the fleet's load.
    orchestrator.wait_for("] node02  t=")
    orchestrator.wait_for("GPU util  90%  findings: none")

    # SIGINT is a terminal's Ctrl-C, sent to the orchestrator alone: the nodes run in their own
    # process group and are stopped by it.
    orchestrator.proc.send_signal(stop)
    assert orchestrator.proc.wait(60) == 0
    assert not any(_alive(pid) for pid in children)
    for url in urls:
        with pytest.raises(urllib.error.URLError):
            _metrics(url)
    (removed,) = [line for line in orchestrator.out().splitlines() if line.startswith("removed ")]
    assert not Path(removed.removeprefix("removed ")).exists()
    assert "exited early" not in orchestrator.err()


@pytest.mark.integration
def test_a_node_that_dies_is_reported_the_others_go_on_and_the_status_says_so(
    tmp_path: Path, orchestrators: list[Orchestrator]
) -> None:
    fleet = _fleet_file(tmp_path, {**small_fleet(), "phases": []})
    targets = tmp_path / "targets.json"
    orchestrator = Orchestrator(
        [
            "--nodes",
            "3",
            str(fleet),
            "--listen",
            "127.0.0.1:0",
            "--no-tty",
            "--targets",
            str(targets),
        ],
        tmp_path,
    )
    orchestrators.append(orchestrator)
    orchestrator.wait_for("Prometheus targets:")
    addresses = [entry["targets"][0] for entry in json.loads(targets.read_text())]
    assert len(set(addresses)) == 3  # port 0: each node its own free port
    children = orchestrator.children()
    os.kill(children[1], signal.SIGKILL)
    orchestrator.wait_for("node02 exited early with status -9", where="err")
    time.sleep(1.5)  # the others keep serving and refreshing
    for address in (addresses[0], addresses[2]):
        assert "nodescope_source_up" in _metrics(f"http://{address}/metrics")
    orchestrator.wait_for("node02  t=")
    orchestrator.wait_for("EXITED (-9)")
    orchestrator.proc.send_signal(signal.SIGTERM)
    assert orchestrator.proc.wait(60) == 128 + signal.SIGKILL
    assert not any(_alive(pid) for pid in children)


@pytest.mark.integration
def test_duration_ends_every_node_and_the_orchestrator(
    tmp_path: Path, orchestrators: list[Orchestrator]
) -> None:
    fleet = _fleet_file(tmp_path)
    orchestrator = Orchestrator(
        ["--nodes", "3", str(fleet), "--listen", "127.0.0.1:0", "--no-tty", "--duration", "4"],
        tmp_path,
    )
    orchestrators.append(orchestrator)
    assert orchestrator.proc.wait(90) == 0
    out = orchestrator.out()
    assert "  node03  http://127.0.0.1:" in out
    assert "exited early" not in orchestrator.err()
