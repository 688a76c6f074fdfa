"""GPU health in the scenario format: the activity kinds that set a GPU's ECC and remap
counters, temperatures, power, clocks and clock-event reasons, fabric state and GPM figures,
how the loader reads and rejects them, and the fake GPU the simulated node shows before,
during and after each.

Each node test builds the small node of ``test_scenario.small_document`` (one H100 with four
NVLinks to one NVSwitch) with only its own activities, on a tmpfs when there is one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodescope.errors import ParseError
from nodescope.model.gpu_health import (
    CLOCK_EVENT_GPU_IDLE,
    CLOCK_EVENT_HW_POWER_BRAKE_SLOWDOWN,
    CLOCK_EVENT_HW_SLOWDOWN,
    CLOCK_EVENT_REASONS,
    CLOCK_EVENT_SW_THERMAL_SLOWDOWN,
    FABRIC_STATE_COMPLETED,
    FABRIC_STATE_IN_PROGRESS,
    FABRIC_STATE_NOT_SUPPORTED,
    FABRIC_STATES,
    GpuHealth,
    fabric_bandwidth_degraded,
)
from nodescope.sim.fake_nvml import FakeGpu
from nodescope.sim.node import SimulatedNode
from nodescope.sim.scenario import (
    GPU_HEALTH_KINDS,
    INSTANT_KINDS,
    SCHEMA_PATH,
    Scenario,
)
from nodescope.sources.nvml import NvmlSource
from tests.unit.scenario_helpers import (
    load_document,
    load_timeline,
    scratch_root,
    timeline_document,
)

SCHEMA = json.loads(SCHEMA_PATH.read_text())
MIB = 1024 * 1024


def load(timeline: list[dict[str, Any]]) -> Scenario:
    return load_timeline(timeline, "health.json")


@pytest.fixture
def scratch() -> Iterator[Path]:
    yield from scratch_root("nodescope-test-health-")


def gpu_at(root: Path, scenario: Scenario, times: tuple[float, ...]) -> dict[float, FakeGpu]:
    """The fake GPU 0 as it is at each of ``times`` (a copy of its fields at that move)."""
    node = SimulatedNode(scenario, root / "node")
    node.materialise()
    seen: dict[float, FakeGpu] = {}
    for t in times:
        node.advance_to(t)
        live = node.nvml.gpus[0]
        seen[t] = FakeGpu(**{name: getattr(live, name) for name in live.__dataclass_fields__})
    return seen


# --------------------------------------------------------------------------------------------
# The loader


def test_each_health_kind_loads_with_its_values() -> None:
    scenario = load(
        [
            {"kind": "gpu_ecc", "from": 3, "gpu": 0, "uncorrected": 2},
            {"kind": "gpu_row_remap", "from": 3, "to": 6, "gpu": 0, "uncorrectable_rows": 1,
             "pending": True},
            {"kind": "gpu_retired_pages", "gpu": 0, "double_bit": 4, "pending": True},
            {"kind": "gpu_temperature", "gpu": 0, "gpu_celsius": 88},
            {"kind": "gpu_power", "gpu": 0, "draw_watts": 398.5, "enforced_limit_watts": 400},
            {"kind": "gpu_clocks", "gpu": 0, "sm_mhz": 1410,
             "reasons": ["sw_thermal_slowdown", "hw_slowdown"]},
            {"kind": "gpu_fabric", "gpu": 0, "state": "in_progress"},
            {"kind": "gpu_gpm", "gpu": 0, "tensor_activity_percent": 41.5},
        ]
    )  # fmt: skip
    ecc, remap, pages, temperature, power, clocks, fabric, gpm = scenario.timeline
    assert (ecc.start, ecc.get("uncorrected"), ecc.get("corrected")) == (3.0, 2, 0)
    assert (remap.start, remap.end, remap.get("pending"), remap.get("failed")) == (
        3.0,
        6.0,
        True,
        False,
    )
    assert (pages.get("double_bit"), pages.get("single_bit"), pages.get("pending")) == (4, 0, True)
    # What an activity does not state is None: the GPU keeps its own value.
    assert (temperature.get("gpu_celsius"), temperature.get("memory_celsius")) == (88, None)
    assert (power.get("draw_watts"), power.get("limit_watts")) == (398.5, None)
    # Reasons by name become NVML's bit mask; fabric states by name NVML's numbers.
    assert clocks.get("reasons") == CLOCK_EVENT_SW_THERMAL_SLOWDOWN | CLOCK_EVENT_HW_SLOWDOWN
    assert clocks.get("sm_mhz") == 1410
    assert fabric.get("state") == FABRIC_STATE_IN_PROGRESS
    assert fabric.get("status") is None
    assert gpm.get("tensor_activity_percent") == 41.5


def test_schema_names_the_models_reasons_and_fabric_states() -> None:
    defs = SCHEMA["$defs"]
    reasons = defs["activity_gpu_clocks"]["properties"]["reasons"]["items"]["enum"]
    assert reasons == list(CLOCK_EVENT_REASONS.values())
    assert defs["activity_gpu_fabric"]["properties"]["state"]["enum"] == list(
        FABRIC_STATES.values()
    )
    kinds = set(defs["activity"]["properties"]["kind"]["enum"])
    assert kinds >= GPU_HEALTH_KINDS
    # ECC errors are counted at one time; every other health kind holds over a span.
    instant = INSTANT_KINDS & GPU_HEALTH_KINDS
    assert instant == {"gpu_ecc"}


BAD: list[tuple[str, dict[str, Any], str]] = [
    (
        "unknown reason",
        {"kind": "gpu_clocks", "gpu": 0, "reasons": ["too_hot"]},
        "/timeline/0/reasons/0: unknown clock-event reason 'too_hot' (reasons: gpu_idle,",
    ),
    (
        "reason twice",
        {"kind": "gpu_clocks", "gpu": 0, "reasons": ["hw_slowdown", "hw_slowdown"]},
        "/timeline/0/reasons: names a reason twice",
    ),
    (
        "fabric state",
        {"kind": "gpu_fabric", "gpu": 0, "state": "broken"},
        "/timeline/0/state: unknown fabric state 'broken' (states: not_supported,",
    ),
    ("fabric without state", {"kind": "gpu_fabric", "gpu": 0}, "/timeline/0/state: missing"),
    (
        "ecc with to",
        {"kind": "gpu_ecc", "gpu": 0, "uncorrected": 1, "to": 5},
        "/timeline/0/to: gpu_ecc happens once, at 'from'",
    ),
    (
        "gpu ref",
        {"kind": "gpu_ecc", "gpu": 9, "uncorrected": 1},
        "/timeline/0/gpu: no GPU 9 (GPUs: 0-0)",
    ),
    (
        "gpu ref of a span",
        {"kind": "gpu_temperature", "gpu": 1, "gpu_celsius": 80},
        "/timeline/0/gpu: no GPU 1 (GPUs: 0-0)",
    ),
    ("no count", {"kind": "gpu_ecc", "gpu": 0}, "/timeline/0: needs corrected, uncorrected"),
    (
        "negative count",
        {"kind": "gpu_ecc", "gpu": 0, "uncorrected": -1},
        "/timeline/0/uncorrected: must be >= 0, got -1",
    ),
    (
        "enforced above limit",
        {"kind": "gpu_power", "gpu": 0, "limit_watts": 500, "enforced_limit_watts": 600},
        "/timeline/0/enforced_limit_watts: must be <= limit_watts (500)",
    ),
    (
        "no temperature",
        {"kind": "gpu_temperature", "gpu": 0},
        "/timeline/0: needs gpu_celsius, memory_celsius or both",
    ),
    (
        "temperature range",
        {"kind": "gpu_temperature", "gpu": 0, "gpu_celsius": 200},
        "/timeline/0/gpu_celsius: must be <= 150, got 200",
    ),
    (
        "unknown key",
        {"kind": "gpu_temperature", "gpu": 0, "celsius": 80},
        "/timeline/0/celsius: unknown key",
    ),
    (
        "to before from",
        {"kind": "gpu_temperature", "gpu": 0, "gpu_celsius": 80, "from": 5, "to": 3},
        "/timeline/0/to: must be after from (5)",
    ),
    (
        "flag type",
        {"kind": "gpu_row_remap", "gpu": 0, "pending": "yes"},
        "/timeline/0/pending: must be true or false",
    ),
    (
        "percent range",
        {"kind": "gpu_gpm", "gpu": 0, "sm_activity_percent": 120},
        "/timeline/0/sm_activity_percent: must be <= 100, got 120",
    ),
    (
        "clock type",
        {"kind": "gpu_clocks", "gpu": 0, "sm_mhz": 1410.5},
        "/timeline/0/sm_mhz: must be an integer",
    ),
]


@pytest.mark.parametrize(("activity", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_health_activity_is_rejected_with_its_pointer(
    activity: dict[str, Any], message: str
) -> None:
    with pytest.raises(ParseError) as caught:
        load([activity])
    assert str(caught.value).startswith(f"health.json: {message}"), str(caught.value)


# --------------------------------------------------------------------------------------------
# The simulated node


def test_a_span_holds_its_values_and_they_return_when_it_ends(scratch: Path) -> None:
    scenario = load(
        [
            {"kind": "gpu_temperature", "from": 3, "to": 6, "gpu": 0, "gpu_celsius": 90,
             "memory_celsius": 93},
            {"kind": "gpu_power", "from": 3, "to": 6, "gpu": 0, "draw_watts": 395.5,
             "limit_watts": 700, "enforced_limit_watts": 400},
            {"kind": "gpu_clocks", "from": 3, "to": 6, "gpu": 0, "sm_mhz": 1095,
             "memory_mhz": 1593, "reasons": ["sw_thermal_slowdown"]},
        ]
    )  # fmt: skip
    seen = gpu_at(scratch, scenario, (2, 3, 5, 6))
    before, during, late, after = (seen[t] for t in (2, 3, 5, 6))
    for gpu in (during, late):
        assert (gpu.temperature_gpu, gpu.temperature_memory) == (90, 93)
        assert (gpu.power_draw_mw, gpu.power_limit_mw, gpu.power_enforced_limit_mw) == (
            395_500,
            700_000,
            400_000,
        )
        assert (gpu.sm_clock_mhz, gpu.memory_clock_mhz) == (1095, 1593)
        # The reasons stated replace the GPU's own: an idle GPU's idle bit is not kept.
        assert gpu.clock_event_reasons == CLOCK_EVENT_SW_THERMAL_SLOWDOWN
    healthy = FakeGpu(uuid="", name="", pci_bus_id="", pci_device_id=0)
    for gpu in (before, after):
        assert (gpu.temperature_gpu, gpu.temperature_memory) == (
            healthy.temperature_gpu,
            healthy.temperature_memory,
        )
        assert (gpu.power_draw_mw, gpu.power_enforced_limit_mw) == (
            healthy.power_draw_mw,
            healthy.power_enforced_limit_mw,
        )
        assert (gpu.sm_clock_mhz, gpu.memory_clock_mhz) == (
            healthy.sm_clock_mhz,
            healthy.memory_clock_mhz,
        )
        assert gpu.clock_event_reasons == CLOCK_EVENT_GPU_IDLE


def test_counters_grow_at_from_and_never_go_back(scratch: Path) -> None:
    scenario = load(
        [
            {"kind": "gpu_ecc", "from": 3, "gpu": 0, "corrected": 5, "uncorrected": 2},
            {"kind": "gpu_ecc", "from": 5, "gpu": 0, "uncorrected": 1},
            {"kind": "gpu_row_remap", "from": 3, "to": 6, "gpu": 0, "uncorrectable_rows": 1,
             "pending": True},
            {"kind": "gpu_row_remap", "from": 7, "gpu": 0, "correctable_rows": 2,
             "failed": True},
            {"kind": "gpu_retired_pages", "from": 4, "to": 6, "gpu": 0, "single_bit": 3,
             "pending": True},
        ]
    )  # fmt: skip
    seen = gpu_at(scratch, scenario, (2, 3, 4, 5, 6, 7, 10))

    def ecc(gpu: FakeGpu) -> tuple[int, ...]:
        return (
            gpu.ecc_volatile_corrected,
            gpu.ecc_aggregate_corrected,
            gpu.ecc_volatile_uncorrected,
            gpu.ecc_aggregate_uncorrected,
        )

    assert ecc(seen[2]) == (0, 0, 0, 0)
    # Volatile and aggregate move together, as one error counts in both on a GPU.
    assert ecc(seen[3]) == ecc(seen[4]) == (5, 5, 2, 2)
    assert ecc(seen[5]) == ecc(seen[10]) == (5, 5, 3, 3)

    def remap(gpu: FakeGpu) -> tuple[int, int, bool, bool]:
        return (
            gpu.remapped_rows_correctable,
            gpu.remapped_rows_uncorrectable,
            gpu.remap_pending,
            gpu.remap_failed,
        )

    assert remap(seen[2]) == (0, 0, False, False)
    assert remap(seen[3]) == (0, 1, True, False)
    # The pending remap is done (a reset at t=6): the row stays remapped.
    assert remap(seen[6]) == (0, 1, False, False)
    assert remap(seen[7]) == remap(seen[10]) == (2, 1, False, True)

    def pages(gpu: FakeGpu) -> tuple[int, int, bool]:
        return (
            gpu.retired_pages_single_bit,
            gpu.retired_pages_double_bit,
            gpu.retired_pages_pending,
        )

    assert pages(seen[3]) == (0, 0, False)
    assert pages(seen[4]) == (3, 0, True)
    assert pages(seen[6]) == pages(seen[10]) == (3, 0, False)


def test_overlapping_reasons_add_up_and_a_busy_gpu_is_not_idle(scratch: Path) -> None:
    scenario = load(
        [
            {"kind": "gpu_util", "from": 2, "to": 8, "gpu": 0, "gpu_percent": 95},
            {"kind": "gpu_clocks", "from": 4, "to": 6, "gpu": 0, "reasons": ["hw_slowdown"]},
            {"kind": "gpu_clocks", "from": 5, "to": 7, "gpu": 0,
             "reasons": ["hw_power_brake_slowdown"]},
            {"kind": "gpu_clocks", "from": 9, "gpu": 0, "reasons": []},
        ]
    )  # fmt: skip
    seen = gpu_at(scratch, scenario, (1, 2, 4, 5, 6, 8, 9))
    assert seen[1].clock_event_reasons == CLOCK_EVENT_GPU_IDLE
    assert seen[2].clock_event_reasons == 0
    assert seen[4].clock_event_reasons == CLOCK_EVENT_HW_SLOWDOWN
    assert seen[5].clock_event_reasons == (
        CLOCK_EVENT_HW_SLOWDOWN | CLOCK_EVENT_HW_POWER_BRAKE_SLOWDOWN
    )
    assert seen[6].clock_event_reasons == CLOCK_EVENT_HW_POWER_BRAKE_SLOWDOWN
    assert seen[8].clock_event_reasons == CLOCK_EVENT_GPU_IDLE
    # An empty list states that no reason is in force, not even idle.
    assert seen[9].clock_event_reasons == 0


def test_temperature_and_draw_follow_the_load_unless_stated(scratch: Path) -> None:
    scenario = load(
        [
            {"kind": "gpu_util", "from": 2, "to": 4, "gpu": 0, "gpu_percent": 100},
            {"kind": "gpu_util", "from": 4, "to": 6, "gpu": 0, "gpu_percent": 50},
            {"kind": "gpu_util", "from": 6, "gpu": 0, "gpu_percent": 100},
            {"kind": "gpu_power", "from": 6, "gpu": 0, "enforced_limit_watts": 400},
            {"kind": "gpu_temperature", "from": 8, "gpu": 0, "gpu_celsius": 84},
        ]
    )  # fmt: skip
    seen = gpu_at(scratch, scenario, (1, 2, 4, 6, 8))
    idle, full, half, capped, hot = (seen[t] for t in (1, 2, 4, 6, 8))
    # An H100 SXM flat out: die near 70 °C, HBM cooler, 90 % of its 700 W limit.
    assert (full.temperature_gpu, full.temperature_memory, full.power_draw_mw) == (70, 66, 630_000)
    assert idle.temperature_gpu < half.temperature_gpu < full.temperature_gpu
    assert idle.power_draw_mw < half.power_draw_mw < full.power_draw_mw
    # Under a lower enforced limit the same load draws less, still below that limit.
    assert capped.power_enforced_limit_mw == 400_000
    assert capped.power_draw_mw == 360_000
    assert capped.power_limit_mw == 700_000
    # A stated temperature wins over the load's; the memory's still follows the load.
    assert (hot.temperature_gpu, hot.temperature_memory) == (84, 66)


def test_fabric_is_registered_on_an_nvswitch_node_and_follows_its_spans(scratch: Path) -> None:
    scenario = load(
        [
            {"kind": "gpu_fabric", "from": 0, "to": 3, "gpu": 0, "state": "in_progress"},
            {"kind": "gpu_fabric", "from": 5, "to": 7, "gpu": 0, "state": "completed",
             "status": 3, "bandwidth_degraded": True},
        ]
    )  # fmt: skip
    seen = gpu_at(scratch, scenario, (0, 3, 5, 7))
    assert seen[0].fabric_state == FABRIC_STATE_IN_PROGRESS
    for t in (3, 7):
        # The GPU's own registration: what the fabric manager leaves on an NVSwitch system.
        assert (seen[t].fabric_state, seen[t].fabric_status) == (FABRIC_STATE_COMPLETED, 0)
        assert fabric_bandwidth_degraded(seen[t].fabric_health_mask) is False
    assert (seen[5].fabric_state, seen[5].fabric_status) == (FABRIC_STATE_COMPLETED, 3)
    assert fabric_bandwidth_degraded(seen[5].fabric_health_mask) is True


def test_a_gpu_without_nvswitch_links_has_no_fabric(scratch: Path) -> None:
    doc = timeline_document([])
    doc["hardware"]["gpus"]["0"]["nvlinks"] = []
    doc["hardware"]["nvswitches"] = []
    del doc["hardware"]["pcie"]["functions"]["0000:06:00.0"]
    scenario = load_document(doc, "health.json")
    assert gpu_at(scratch, scenario, (0,))[0].fabric_state == FABRIC_STATE_NOT_SUPPORTED


def test_gpm_follows_the_timeline_unless_stated(scratch: Path) -> None:
    scenario = load(
        [
            {"kind": "gpu_util", "gpu": 0, "gpu_percent": 80, "memory_percent": 45},
            {"kind": "gpu_pcie", "gpu": 0, "h2d_bytes_per_second": 2e9,
             "d2h_bytes_per_second": 5e8},
            {"kind": "nvlink", "gpu": 0, "links": [0, 1], "tx_bytes_per_second": 1e10,
             "rx_bytes_per_second": 4e9, "burst": {"period_seconds": 1, "on_seconds": 0.25}},
            {"kind": "gpu_gpm", "from": 4, "to": 6, "gpu": 0, "sm_activity_percent": 61,
             "tensor_activity_percent": 38, "nvlink_tx_bytes_per_second": 1e9},
        ]
    )  # fmt: skip
    seen = gpu_at(scratch, scenario, (2, 4, 6))
    derived, stated, back = seen[2], seen[4], seen[6]
    for gpu in (derived, back):
        assert (gpu.gpm_sm_activity_percent, gpu.gpm_tensor_activity_percent) == (80.0, 0.0)
        assert gpu.gpm_dram_bandwidth_percent == 45.0
        # Two links at 10 GB/s a quarter of the time.
        assert gpu.gpm_nvlink_tx_mib_per_second == pytest.approx(5e9 / MIB)
        assert gpu.gpm_nvlink_rx_mib_per_second == pytest.approx(2e9 / MIB)
        assert gpu.gpm_pcie_rx_mib_per_second == pytest.approx(2e9 / MIB)
        assert gpu.gpm_pcie_tx_mib_per_second == pytest.approx(5e8 / MIB)
    assert (stated.gpm_sm_activity_percent, stated.gpm_tensor_activity_percent) == (61.0, 38.0)
    assert stated.gpm_nvlink_tx_mib_per_second == pytest.approx(1e9 / MIB)
    assert stated.gpm_pcie_rx_mib_per_second == pytest.approx(2e9 / MIB)


def test_framebuffer_is_the_gpu_memory_its_processes_hold(scratch: Path) -> None:
    doc = timeline_document([{"kind": "process_exit", "from": 3, "process": "rank"}])
    doc["hardware"]["gpus"]["0"]["memory_bytes"] = 85_899_345_920
    doc["jobs"][0]["processes"][0]["gpu_memory_bytes"] = 73_014_444_032
    scenario = load_document(doc, "health.json")
    seen = gpu_at(scratch, scenario, (1, 3))
    assert seen[1].fb_total_bytes == 85_899_345_920
    assert seen[1].fb_used_bytes == 73_014_444_032
    assert seen[3].fb_used_bytes == 0


@pytest.mark.parametrize("loaded", [True, False])
def test_a_node_may_run_without_the_nvlink_counter_module(scratch: Path, loaded: bool) -> None:
    doc = timeline_document([])
    if not loaded:
        doc["hardware"]["os"]["nvlink_counter"] = False
    node = SimulatedNode(load_document(doc, "health.json"), scratch / "node")
    node.materialise()
    node.advance_to(1)
    assert node.nvlink_snapshot_path.exists() is loaded


def test_the_nvml_source_reads_what_the_timeline_sets(scratch: Path) -> None:
    """The node's health reaches the daemon through the nvml source's real health reads."""
    scenario = load(
        [
            {"kind": "gpu_util", "gpu": 0, "gpu_percent": 95},
            {"kind": "gpu_ecc", "from": 2, "gpu": 0, "uncorrected": 1},
            {"kind": "gpu_row_remap", "from": 2, "gpu": 0, "uncorrectable_rows": 1,
             "pending": True},
            {"kind": "gpu_temperature", "from": 2, "to": 4, "gpu": 0, "gpu_celsius": 88},
            {"kind": "gpu_clocks", "from": 2, "to": 4, "gpu": 0, "sm_mhz": 1440,
             "reasons": ["sw_thermal_slowdown"]},
            {"kind": "gpu_fabric", "from": 2, "to": 4, "gpu": 0, "state": "completed",
             "bandwidth_degraded": True},
        ]
    )  # fmt: skip
    node = SimulatedNode(scenario, scratch / "node")
    node.materialise()
    (source,) = [s for s in node.sources() if isinstance(s, NvmlSource)]
    source.health_every = 1
    read: dict[float, GpuHealth] = {}
    try:
        for t in (1, 2, 4):
            node.advance_to(t)
            data = source.collect(node.roots)
            read[t] = data.health[0]
    finally:
        source.close()
    before, during, after = read[1], read[2], read[4]
    assert before.ecc is not None and during.ecc is not None
    assert (before.ecc.volatile_uncorrected, during.ecc.volatile_uncorrected) == (0, 1)
    assert during.ecc.aggregate_uncorrected == 1
    assert during.row_remap is not None and during.row_remap.pending is True
    assert during.temperatures is not None and during.temperatures.gpu == 88
    assert during.clocks is not None
    assert (during.clocks.sm_mhz, during.clocks.event_reasons) == (
        1440,
        CLOCK_EVENT_SW_THERMAL_SLOWDOWN,
    )
    assert during.fabric is not None and during.fabric.bandwidth_degraded is True
    # After the spans: the loaded GPU's own values, the counters and the pending remap kept.
    assert after.temperatures is not None and after.temperatures.gpu == 68
    assert after.clocks is not None and after.clocks.event_reasons == 0
    assert after.fabric is not None
    assert (after.fabric.state, after.fabric.bandwidth_degraded) == (FABRIC_STATE_COMPLETED, False)
    assert after.ecc is not None and after.ecc.volatile_uncorrected == 1
    assert after.row_remap is not None and after.row_remap.pending is True
