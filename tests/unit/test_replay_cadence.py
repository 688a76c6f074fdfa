"""A replay runs the daemon's cadences: every source at the interval the daemon's composition
root schedules it at, and every slow read (``*_every``: error counters, GPU health, the cgroup
tree's static files, the host's threads) as often as the daemon's own sources do it.

The daemon's side is what :class:`~nodescope.service.Service` builds for a default
configuration (its collector, from the registry); the replay's is what
:func:`~nodescope.sim.driver.replay_schedule` builds over the simulated node's sources. A
scenario that raises an InfiniBand error counter and NVLink CRC errors between two slow
reads must show them in the replay's /metrics only from the daemon's next slow read on.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodescope.assembly import default_config
from nodescope.collect import ScheduledSource
from nodescope.model.snapshot import Snapshot
from nodescope.roots import Roots
from nodescope.service import Service
from nodescope.sim.driver import replay, replay_schedule, replay_steps
from nodescope.sim.node import SimulatedNode, make_temp_root
from nodescope.sim.scenario import load_scenario
from nodescope.sources.registry import SOURCE_TABLE, SourceInputs


def cadence(item: ScheduledSource) -> dict[str, Any]:
    """What decides when a scheduled source reads what: its interval, every ``*_every``
    count of runs it has (``slow_every``, ``health_every``, ``gpm_every``, ``host_every``) and
    whether a move of the topology generation makes it due (the one its source follows)."""
    # The replay's sources move the node before they read: the source read is inside.
    source = getattr(item.source, "source", item.source)
    counts = {
        name: getattr(source, name)
        for name in dir(source)
        if name.endswith("_every") and not name.startswith("_")
    }
    if item.watches is not None:
        assert item.watches is source.topology, item.source.name
    return {"interval": item.interval, "due_on_topology": item.watches is not None, **counts}


def _scenario(tmp_path: Path, doc: dict[str, Any]) -> Path:
    path = tmp_path / f"{doc['name']}.json"
    path.write_text(json.dumps(doc))
    return path


ONE_GPU_NODE = {
    "base": "dgx-h100",
    "os": {"background_processes": 5},
    "gpus": {str(i): None for i in range(2, 8)},
}


@pytest.fixture
def node(tmp_path: Path) -> Iterator[SimulatedNode]:
    path = _scenario(
        tmp_path,
        {
            "format": "nodescope-scenario/1",
            "name": "cadence",
            "duration_seconds": 10,
            "hardware": ONE_GPU_NODE,
        },
    )
    base = make_temp_root("nodescope-test-")
    try:
        yield SimulatedNode(load_scenario(str(path)), base / "node")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_replay_schedules_every_source_as_the_daemon_does(
    node: SimulatedNode, tmp_path: Path
) -> None:
    daemon = Service(lambda: default_config(roots=Roots.under(tmp_path / "host")))
    inputs = SourceInputs()
    sources = node.sources(inputs=inputs)
    try:
        ours = {item.source.name: cadence(item) for item in daemon.collector.scheduled}
        replayed = {
            item.source.name: cadence(item)
            for item in replay_schedule(default_config(roots=node.roots), sources, inputs)
        }
        # The node runs every source of the daemon's but those whose spec says it does not
        # (no sim_parts): the rtnetlink dump (it has no network namespace), the probe
        # report's, the remediation record's and /proc/pressure's (none of which it writes).
        not_simulated = {spec.name for spec in SOURCE_TABLE if spec.sim_parts is None}
        assert not_simulated == {"netdev", "probe", "remediation", "pressure"}
        assert set(ours) - set(replayed) == not_simulated
        assert set(replayed) <= set(ours)
        for name, replay_cadence in replayed.items():
            assert replay_cadence == ours[name], name
        # The slow reads the simulated node's error counters wait for are there to compare.
        for name in ("nvml", "infiniband", "pci", "cgroups", "jobs", "procs", "threads"):
            assert "slow_every" in replayed[name], name
        assert ours["nvml"]["slow_every"] > 1 and ours["nvml"]["health_every"] > 1
        # The pci source reads the tree when the udev source reports a device event.
        assert {name for name, c in replayed.items() if c["due_on_topology"]} == {"pci"}
    finally:
        daemon.collector.close()
        daemon.analyzer.close()
        for source in sources:
            source.close()


def test_replay_steps_merge_the_daemons_cycles_and_the_scenarios_scrapes() -> None:
    steps = replay_steps(2.0, 1.0, 4.0)
    assert [(s.t, s.collect, s.scrape) for s in steps] == [
        (0.0, True, True),
        (1.0, True, False),
        (2.0, True, True),
        (3.0, True, False),
        (4.0, True, True),
    ]
    # A scenario finer than the daemon's tick moves the node in between, without a cycle.
    assert [(s.t, s.collect, s.scrape) for s in replay_steps(0.5, 1.0, 1.0)] == [
        (0.0, True, True),
        (0.5, False, True),
        (1.0, True, True),
    ]


_SAMPLE = re.compile(r"^(?P<name>[a-z_]+)\{(?P<labels>[^}]*)\} (?P<value>\S+)$", re.M)


def _value(body: str, name: str, **labels: str) -> float | None:
    for match in _SAMPLE.finditer(body):
        if match.group("name") != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group("labels")))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(match.group("value"))
    return None


def test_a_raised_counter_shows_at_the_daemons_slow_read(tmp_path: Path) -> None:
    # Errors between t=3 and t=5: the daemon's InfiniBand and NVML sources read error
    # counters on their first run and every slow_every runs after, one run a second.
    path = _scenario(
        tmp_path,
        {
            "format": "nodescope-scenario/1",
            "name": "raised-counters",
            "duration_seconds": 24,
            "hardware": ONE_GPU_NODE,
            "timeline": [
                {
                    "kind": "errors",
                    "from": 3,
                    "to": 5,
                    "ib": "mlx5_0",
                    "port": 1,
                    "counters": {"symbol_error": 50},
                },
                {"kind": "errors", "from": 3, "to": 5, "gpu": 0, "nvlink": {"crc_flit": 50}},
            ],
            "expect": {
                "metrics": [
                    {
                        "name": "nodescope_infiniband_port_errors_total",
                        "labels": {"device": "mlx5_0", "counter": "symbol_error"},
                        "min": 0,
                    }
                ]
            },
        },
    )
    scraped: dict[float, str] = {}

    def keep(t: float, snapshot: Snapshot, body: bytes) -> None:
        scraped[t] = body.decode()

    base = make_temp_root("nodescope-test-")
    try:
        result = replay(load_scenario(str(path)), base / "node", on_cycle=keep)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert result.cycles == 25

    daemon = Service(lambda: default_config(roots=Roots.under(tmp_path / "host")))
    try:
        schedule = {item.source.name: cadence(item) for item in daemon.collector.scheduled}
    finally:
        daemon.collector.close()
        daemon.analyzer.close()

    def first_slow_read_after(name: str, t: float) -> float:
        period = schedule[name]["interval"] * schedule[name]["slow_every"]
        return float(-(-t // period) * period)

    ib = {
        t: _value(body, "nodescope_infiniband_port_errors_total", device="mlx5_0",
                  port="1", counter="symbol_error")
        for t, body in scraped.items()
    }  # fmt: skip
    seen_ib = min(t for t, v in ib.items() if v)
    assert seen_ib == first_slow_read_after("infiniband", 5.0) == 10.0
    assert ib[seen_ib] == 100  # 50/s over the two seconds, read whole at the slow read
    assert all(ib[t] == 0 for t in ib if t < seen_ib)

    nvlink = {
        t: sum(
            float(m.group("value"))
            for m in _SAMPLE.finditer(body)
            if m.group("name") == "nodescope_gpu_nvlink_errors_total"
            and 'gpu="0"' in m.group("labels")
            and 'counter="crc_flit"' in m.group("labels")
        )
        for t, body in scraped.items()
    }
    seen_nvlink = min(t for t, v in nvlink.items() if v)
    assert seen_nvlink == first_slow_read_after("nvml", 5.0) == 10.0
    assert all(nvlink[t] == 0 for t in nvlink if t < seen_nvlink)
