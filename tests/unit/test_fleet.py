"""Fleet files (``nodescope-fleet/1``) and the scenario each node of a fleet runs: the bundled
``job-straggler`` carries its phases' loads, every error is a ParseError naming the value,
and the parser takes any JSON without another exception."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.errors import ParseError
from nodescope.model.gpu_health import clock_event_names
from nodescope.sim.fleet import (
    FLEET_DIR,
    LOAD_KINDS,
    FleetSchema,
    Load,
    bundled_fleets,
    check_nodes,
    file_sd,
    load_at,
    load_fleet,
    node_name,
    node_scenario,
    parse_fleet,
)
from nodescope.sim.scenario import SCENARIO_DIR, Scenario, ScenarioLoader
from tests.unit.json_strategy import json_paths, json_values
from tests.unit.test_scenario import small_document

LOADER = ScenarioLoader()
SCHEMA = FleetSchema()
NICS = ("mlx5_0", "mlx5_1", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_9")


def small_fleet() -> dict[str, Any]:
    """A fleet of the small test node (one GPU, one NIC), one phase of each sort."""
    return {
        "format": "nodescope-fleet/1",
        "name": "small",
        "duration_seconds": 100,
        "hardware": small_document()["hardware"],
        "job": {"id": 42, "user": "alice", "gpus_per_node": 1, "nics": ["mlx5_0"]},
        "load": {
            "gpu_percent": 90,
            "memory_percent": 50,
            "nvlink_tx_bytes_per_second": 1e9,
            "nvlink_rx_bytes_per_second": 2e9,
            "pcie_h2d_bytes_per_second": 3e9,
            "pcie_d2h_bytes_per_second": 4e9,
            "ib_tx_bytes_per_second": 5e9,
            "ib_rx_bytes_per_second": 6e9,
        },
        "phases": [
            {"from": 10, "to": 20, "nodes": [2], "gpu_util_factor": 0.5},
            {"from": 15, "to": 30, "nodes": [2, 3], "ib_rx_factor": 0.5, "ib_tx_factor": 0.25},
            {
                "from": 10,
                "to": 20,
                "nodes": [3],
                "fault": [{"kind": "gpu_clocks", "gpu": 0, "reasons": ["hw_slowdown"]}],
            },
            {"from": 40, "to": 50, "stall": {"gpu_percent": 0}},
        ],
    }


def parsed(document: dict[str, Any], name: str = "/fleets/test.json") -> Any:
    return parse_fleet(document, Path(name), SCHEMA)


def scenario_of(fleet: Any, node: int) -> Scenario:
    """The node's scenario as ``nodescope demo`` would run it: read by the scenario loader."""
    return LOADER.parse(node_scenario(fleet, node), Path(f"/fleet/{node_name(node)}.json"))


def active(scenario: Scenario, kind: str, t: float) -> list[dict[str, Any]]:
    """The parameters of each ``kind`` activity in force at ``t``."""
    return [dict(a.params) for a in scenario.timeline if a.kind == kind and a.active_at(t)]


# --------------------------------------------------------------------------------------------
# The bundled fleet


def test_bundled_fleets_are_the_files_shipped() -> None:
    assert bundled_fleets() == ["job-straggler"]
    assert (FLEET_DIR / "job-straggler.json").is_file()


@pytest.fixture(scope="module")
def straggler() -> dict[int, Scenario]:
    fleet = load_fleet("job-straggler")
    check_nodes(fleet, 4)
    return {node: scenario_of(fleet, node) for node in range(1, 5)}


def test_every_node_runs_the_job_on_all_eight_gpus_under_its_own_name(
    straggler: dict[int, Scenario],
) -> None:
    for node, scenario in straggler.items():
        (job,) = scenario.jobs
        assert (job.id, job.gpus, job.nics) == (90210, tuple(range(8)), NICS)
        assert scenario.hardware.os.hostname == node_name(node)
        assert scenario.name == f"job-straggler-{node_name(node)}"
        # Long enough to measure for minutes after the last phase.
        assert scenario.duration_seconds == 3600


# Per node and moment: GPU utilisation, (IB tx, IB rx) per job NIC, NVLink tx/rx, PCIe h2d.
HEALTHY = (95.0, (4e9, 4e9), (12e9, 12e9), 2e9)
STALLED = (100.0, (0.0, 0.0), (0.0, 0.0), 0.0)
EXPECTED_LOADS = {
    (1, 10): HEALTHY,
    (2, 10): HEALTHY,
    (2, 50): (38.0, (4e9, 4e9), (12e9, 12e9), 2e9),
    (3, 50): (95.0, (4e9, 4e9 * 0.58), (12e9, 12e9), 2e9),
    (4, 50): HEALTHY,
    (1, 50): HEALTHY,
    (2, 100): HEALTHY,
    (3, 100): HEALTHY,
    **{(node, 150): STALLED for node in range(1, 5)},
    **{(node, 250): HEALTHY for node in range(1, 5)},
    (3, 3599): HEALTHY,
}


@pytest.mark.parametrize(("node", "t"), sorted(EXPECTED_LOADS))
def test_each_node_carries_its_phase_load(
    straggler: dict[int, Scenario], node: int, t: int
) -> None:
    scenario = straggler[node]
    util = active(scenario, "gpu_util", t)
    ib = active(scenario, "ib", t)
    nvlink = active(scenario, "nvlink", t)
    pcie = active(scenario, "gpu_pcie", t)
    # One activity per GPU (or NIC) at a time: two in force would add up.
    assert sorted(a["gpu"] for a in util) == list(range(8))
    assert sorted(a["gpu"] for a in nvlink) == sorted(a["gpu"] for a in pcie) == list(range(8))
    assert sorted(a["device"] for a in ib) == sorted(NICS)
    gpu_percent, (ib_tx, ib_rx), (nv_tx, nv_rx), h2d = EXPECTED_LOADS[node, t]
    assert [a["gpu_percent"] for a in util] == pytest.approx([gpu_percent] * 8)
    assert [a["tx_bytes_per_second"] for a in ib] == pytest.approx([ib_tx] * 8)
    assert [a["rx_bytes_per_second"] for a in ib] == pytest.approx([ib_rx] * 8)
    assert {(a["tx_bytes_per_second"], a["rx_bytes_per_second"]) for a in nvlink} == {
        (nv_tx, nv_rx)
    }
    assert {a["h2d_bytes_per_second"] for a in pcie} == {h2d}


def test_the_faulty_node_asserts_hardware_slowdown_during_its_phase_only(
    straggler: dict[int, Scenario],
) -> None:
    for t, expected in ((19, []), (20, list(range(8))), (89, list(range(8))), (90, [])):
        clocks = active(straggler[4], "gpu_clocks", t)
        assert sorted(a["gpu"] for a in clocks) == expected, t
        # The board's own reason: gpu_hw_slowdown, the critical kind, not a driver throttle.
        assert all(clock_event_names(a["reasons"]) == ("hw_slowdown",) for a in clocks)
    for node in (1, 2, 3):
        assert not any(a.kind == "gpu_clocks" for a in straggler[node].timeline)


def test_a_node_no_phase_names_holds_one_piece_of_load_outside_the_stall(
    straggler: dict[int, Scenario],
) -> None:
    starts = sorted({a.start for a in straggler[1].timeline if a.kind == "gpu_util"})
    assert starts == [0, 130, 200]
    last = [a for a in straggler[1].timeline if a.kind == "gpu_util" and a.start == 200]
    # After its timeline a node keeps its last load: the last piece has no end.
    assert all(a.end is None for a in last)


def test_node_numbers_past_the_fleet_are_refused() -> None:
    fleet = load_fleet("job-straggler")
    with pytest.raises(ParseError) as caught:
        check_nodes(fleet, 3)
    assert "/phases/2/nodes/0: names node 4, and the fleet runs 3 nodes (node01-node03)" in str(
        caught.value
    )
    assert caught.value.source.endswith("job-straggler.json")
    for nodes in (1, 65):
        with pytest.raises(ValueError, match="2 to 64"):
            check_nodes(fleet, nodes)


# --------------------------------------------------------------------------------------------
# Loads of overlapping phases


def test_factors_of_overlapping_phases_multiply_and_a_stall_zeroes_every_link() -> None:
    fleet = parsed(small_fleet())
    base = fleet.load
    assert load_at(fleet, 2, 12) == Load(
        45.0, 25.0, 1e9, 2e9, 3e9, 4e9, base.ib_tx_bytes_per_second, base.ib_rx_bytes_per_second
    )
    assert load_at(fleet, 2, 17) == Load(45.0, 25.0, 1e9, 2e9, 3e9, 4e9, 1.25e9, 3e9)
    assert load_at(fleet, 2, 25) == Load(90.0, 50.0, 1e9, 2e9, 3e9, 4e9, 1.25e9, 3e9)
    assert load_at(fleet, 1, 17) == base
    for node in (1, 2, 3):
        assert load_at(fleet, node, 45) == Load(0.0, 0.0)
    assert load_at(fleet, 3, 50) == base


def test_the_small_fleets_node_scenarios_are_valid_and_timed_at_the_cuts() -> None:
    fleet = parsed(small_fleet())
    scenario = scenario_of(fleet, 2)
    pieces = sorted((a.start, a.end) for a in scenario.timeline if a.kind == "ib")
    assert pieces == [(0, 10), (10, 15), (15, 20), (20, 30), (30, 40), (40, 50), (50, None)]
    faults = [a for a in scenario_of(fleet, 3).timeline if a.kind == "gpu_clocks"]
    assert [(a.start, a.end, clock_event_names(a.get("reasons"))) for a in faults] == [
        (10, 20, ("hw_slowdown",))
    ]


def test_a_relative_hardware_base_is_read_from_the_fleets_folder(tmp_path: Path) -> None:
    (tmp_path / "hw").mkdir()
    shutil.copy(SCENARIO_DIR / "dgx-h100.json", tmp_path / "hw" / "server.json")
    document = json.loads((FLEET_DIR / "job-straggler.json").read_text())
    document["hardware"] = {"base": "../hw/server.json", "os": {"uptime_seconds": 60}}
    (tmp_path / "fleets").mkdir()
    path = tmp_path / "fleets" / "mine.json"
    path.write_text(json.dumps(document))
    fleet = load_fleet(str(path))
    # Written elsewhere, as the demo writes it, the node's scenario still finds its base.
    scenario = LOADER.parse(node_scenario(fleet, 2), Path("/elsewhere/node02.json"))
    assert len(scenario.hardware.gpus) == 8
    assert scenario.hardware.os.uptime_seconds == 60
    assert scenario.hardware.os.hostname == "node02"


def test_file_sd_names_each_node_as_its_instance() -> None:
    document = file_sd([("node01", "127.0.0.1:9001"), ("node02", "127.0.0.1:9002")])
    assert document == [
        {"targets": ["127.0.0.1:9001"], "labels": {"instance": "node01"}},
        {"targets": ["127.0.0.1:9002"], "labels": {"instance": "node02"}},
    ]


# --------------------------------------------------------------------------------------------
# Errors


def _set(document: dict[str, Any], pointer: str, value: Any) -> dict[str, Any]:
    """``document`` with the value at ``pointer`` replaced (``...`` deletes it)."""
    changed = copy.deepcopy(document)
    *path, last = [int(t) if t.isdigit() else t for t in pointer.strip("/").split("/")]
    parent: Any = changed
    for token in path:
        parent = parent[token]
    if value is ...:
        del parent[last]
    else:
        parent[last] = value
    return changed


ERRORS = [
    ("/format", "nodescope-scenario/1", "/format: must be 'nodescope-fleet/1'"),
    ("/name", "-x", "/name: must match"),
    ("/job/gpus_per_node", 0, "/job/gpus_per_node: must be >= 1, got 0"),
    ("/job/nics", ["mlx5_0", "mlx5_0"], "/job/nics: names a device twice"),
    ("/load/gpu_percent", 101, "/load/gpu_percent: must be <= 100, got 101"),
    ("/load/ib_bytes", 1, "/load/ib_bytes: unknown key"),
    ("/phases/0/gpu_util_factor", 1.5, "/phases/0/gpu_util_factor: must be <= 1, got 1.5"),
    ("/phases/0/nodes", [2, 2], "/phases/0/nodes: names a node twice"),
    ("/phases/0/nodes", [0], "/phases/0/nodes/0: must be >= 1, got 0"),
    ("/phases/0/to", 10, "/phases/0/to: must be after from (10)"),
    ("/phases/0/to", 101, "/phases/0/to: after the end (100 s)"),
    ("/phases/0/from", 100, "/phases/0/from: at or after the end (100 s)"),
    ("/phases/0/nodes", ..., "/phases/0/nodes: needs the nodes it changes"),
    ("/phases/0/gpu_util_factor", ..., "/phases/0: changes nothing"),
    ("/phases/3/nodes", [1], "/phases/3/nodes: a stall applies to every node"),
    ("/phases/3/ib_rx_factor", 0.5, "/phases/3/ib_rx_factor: a stall phase changes nothing else"),
    ("/phases/2/fault/0/kind", "ib", "/phases/2/fault/0/kind: ib carries the load"),
    ("/phases/2/fault/0/to", 5, "/phases/2/fault/0/to: the phase gives the time"),
    ("/phases/2/fault/0", 7, "/phases/2/fault/0: must be an object, got a number"),
    ("/duration_seconds", float("nan"), "/duration_seconds: must be finite"),
]


@pytest.mark.parametrize(("pointer", "value", "message"), ERRORS)
def test_an_error_names_the_value(pointer: str, value: Any, message: str) -> None:
    with pytest.raises(ParseError) as caught:
        parsed(_set(small_fleet(), pointer, value))
    assert message in str(caught.value)
    assert caught.value.source == "/fleets/test.json"


def test_every_load_kind_is_refused_as_a_fault() -> None:
    for kind in sorted(LOAD_KINDS):
        with pytest.raises(ParseError, match=f"{kind} carries the load"):
            parsed(_set(small_fleet(), "/phases/2/fault/0/kind", kind))


def test_an_unknown_bundled_fleet_lists_the_bundled_ones() -> None:
    with pytest.raises(ParseError, match="no bundled fleet 'nope' \\(bundled: job-straggler\\)"):
        load_fleet("nope")


def test_a_file_that_is_not_json_is_a_parse_error(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    path.write_text('{"format": "nodescope-fleet/1", "format": 1}')
    with pytest.raises(ParseError, match="duplicate key 'format'"):
        load_fleet(str(path))


# --------------------------------------------------------------------------------------------
# Fuzz


# The hardware section is the scenario loader's, fuzzed with the scenarios.
SMALL_PATHS = json_paths(small_fleet(), skip=("hardware",))


@settings(max_examples=300, deadline=None)
@given(
    where=st.lists(st.sampled_from(SMALL_PATHS[1:]), min_size=1, max_size=3),
    values=st.lists(json_values(20), min_size=3, max_size=3),
    delete=st.booleans(),
    nodes=st.integers(2, 64),
)
def test_fuzz_mutated_fleets_raise_parse_error_only(
    where: list[tuple[Any, ...]], values: list[Any], delete: bool, nodes: int
) -> None:
    document = small_fleet()
    for path, value in zip(where, values, strict=False):
        parent: Any = document
        try:
            for key in path[:-1]:
                parent = parent[key]
            if delete and isinstance(parent, dict):
                parent.pop(path[-1], None)
            else:
                parent[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue
    try:
        fleet = parsed(document, "/fuzz/fleet.json")
        check_nodes(fleet, nodes)
    except ParseError as exc:
        assert exc.source == "/fuzz/fleet.json"
        return
    # What the parser accepts, the node scenarios are built from without another exception.
    for node in range(1, min(nodes, 4) + 1):
        assert node_scenario(fleet, node)["hardware"]["os"]["hostname"] == node_name(node)


@settings(max_examples=200, deadline=None)
@given(document=json_values(20))
def test_fuzz_arbitrary_json_raises_parse_error_only(document: Any) -> None:
    with pytest.raises(ParseError):
        parsed(document, "/fuzz/any.json")
