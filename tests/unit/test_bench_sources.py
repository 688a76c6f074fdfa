"""The benchmark's daemon (bench/daemon.py) runs the simulated node's sources without loading
the simulator: its list must stay the one :meth:`SimulatedNode.sources` builds (same sources,
same order, same settings), NVML aside and with the rtnetlink sources a real node runs on
this machine's network namespace, and importing it must not load the simulator."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodescope.sim.node import SimulatedNode, make_temp_root
from nodescope.sim.nvml_mirror import STATE_FILE, MirroredNvml, state_document, write_state
from nodescope.sim.scenario import load_scenario
from nodescope.sources.infiniband import InfinibandSource
from nodescope.sources.link_events import LinkEventsSource
from nodescope.sources.netlink import NetdevSource
from nodescope.sources.nvml import NvmlSource
from nodescope.sources.registry import SourceInputs

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
daemon = importlib.import_module("daemon")  # bench/daemon.py: a script, not a package

ONE_GPU = (
    '{"format": "nodescope-scenario/1", "name": "one", "duration_seconds": 10,'
    ' "hardware": {"base": "dgx-h100", "os": {"background_processes": 5},'
    ' "gpus": {"1": null, "2": null, "3": null, "4": null, "5": null, "6": null, "7": null}}}'
)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[SimulatedNode]:
    scenario = tmp_path / "one.json"
    scenario.write_text(ONE_GPU)
    base = make_temp_root("nodescope-test-")
    try:
        yield SimulatedNode(load_scenario(str(scenario)), base / "node")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_benchmark_runs_the_simulated_nodes_sources(
    node: SimulatedNode, tmp_path: Path
) -> None:
    path = tmp_path / STATE_FILE
    write_state(path, state_document(node.nvml, node.t, node.wall_clock() - node.t, []))
    mirror = MirroredNvml(path)
    ours = daemon.node_sources(mirror, SourceInputs())
    theirs = SimulatedNode.sources(node, inputs=SourceInputs())
    try:
        # The one source more: the interface dump, which the simulated node has no namespace
        # for; link_events' monitor reads this machine's links where the node's cannot.
        netdev = [s for s in ours if s.name == "netdev"]
        assert len(netdev) == 1 and isinstance(netdev[0], NetdevSource)
        assert netdev[0].netns is None
        assert [s.name for s in ours if s.name != "netdev"] == [s.name for s in theirs]
        for mine, sim in zip((s for s in ours if s.name != "netdev"), theirs, strict=True):
            if sim.name == "nvml":
                assert isinstance(sim, NvmlSource)
                assert isinstance(mine, daemon.MirroredNvmlSource)
                assert mine.inner.nvml is mirror
                continue
            assert type(mine) is type(sim), sim.name
            # Production cadence in both: no source told to read its slow files every run.
            assert getattr(mine, "slow_every", None) == getattr(sim, "slow_every", None)
            if isinstance(sim, LinkEventsSource):
                assert isinstance(mine, LinkEventsSource)
                assert (mine.netlink, sim.netlink) == (True, False)
            if isinstance(sim, InfinibandSource):
                assert isinstance(mine, InfinibandSource)
                assert mine.clock == mirror.wall_clock
                assert sim.clock == node.wall_clock
    finally:
        for source in (*ours, *theirs):
            close = getattr(source, "close", None)
            if close is not None:
                close()


#: Modules the daemon has no use for, each a measured share of its resident memory:
#: hashlib loads OpenSSL's libcrypto (3.6 MiB); importlib.resources brings zipfile (1.4 MiB with
#: its imports); html its entity table; statistics brings fractions and decimal.
UNUSED = ("hashlib", "importlib.resources", "zipfile", "html", "statistics")


def test_the_benchmark_daemon_loads_neither_the_simulator_nor_unused_modules() -> None:
    # A node's daemon never imports the simulated node: its modules would be counted in the
    # benchmark's RSS. The NVML mirror (and the fake NVML under it) stand in for libnvidia-ml.
    code = (
        f"import sys; sys.path.insert(0, {str(BENCH)!r}); import daemon; "
        "print(' '.join(sorted(sys.modules)))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    loaded = set(done.stdout.split())
    simulator = {m for m in loaded if m.startswith("nodescope.sim")}
    assert "nodescope.sim.nvml_mirror" in simulator  # the probe sees what it looks for
    assert simulator <= {"nodescope.sim", "nodescope.sim.nvml_mirror", "nodescope.sim.fake_nvml"}
    assert {"nodescope.collect", "nodescope.service"} <= loaded
    assert loaded.isdisjoint(UNUSED), sorted(loaded.intersection(UNUSED))
