"""The NVML source's health reads against the fake NVML: every value in its unit, the
cadence (health every ``health_every`` runs, never on a slow run, carried between), calls
asked once when NOT_SUPPORTED, a GPU lost mid-read, impossible values dropped and counted,
GPM figures from the second sample on, and the fallbacks for older bindings and drivers."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import pynvml
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.collect import Collector, ScheduledSource
from nodescope.model.gpu_health import (
    CLOCK_EVENT_HW_SLOWDOWN,
    CLOCK_EVENT_SW_THERMAL_SLOWDOWN,
    FABRIC_STATE_COMPLETED,
    FABRIC_STATE_IN_PROGRESS,
    Clocks,
    EccErrors,
    Fabric,
    FrameBuffer,
    Gpm,
    Power,
    RetiredPages,
    RowRemap,
    Temperatures,
)
from nodescope.roots import Roots
from nodescope.sim.fake_nvml import (
    HGX_H100_FABRIC_CLUSTER_UUID,
    FakeGpu,
    FakeNvml,
    hgx_h100,
)
from nodescope.sources import nvml as nv
from tests.unit.gpu_helpers import HEALTH_CALLS

NO_FILES = Roots.under("/nonexistent-nodescope-root")
SKIP = nv.SKIP_HEALTH_VALUE_IMPOSSIBLE
MIB = 1 << 20


class Wall:
    """A wall clock the test moves."""

    def __init__(self) -> None:
        self.now = 1_750_000_000.0

    def __call__(self) -> float:
        return self.now


def health_calls(fake: FakeNvml) -> dict[str, int]:
    return {name: fake.calls[name] for name in HEALTH_CALLS}


@pytest.fixture
def wall() -> Wall:
    return Wall()


def make_source(fake: Any, wall: Wall, **kwargs: Any) -> nv.NvmlSource:
    return nv.NvmlSource(fake, watch_xids=False, wall_clock=wall, **kwargs)


@pytest.fixture
def pair(wall: Wall) -> Iterator[tuple[FakeNvml, nv.NvmlSource]]:
    fake = FakeNvml(hgx_h100(2, 2))
    src = make_source(fake, wall, health_every=1)
    yield fake, src
    src.close()


def read_health(src: nv.NvmlSource, wall: Wall, runs: int = 1) -> nv.NvmlData:
    data = None
    for _ in range(runs):
        wall.now += 1.0
        data = src.collect(NO_FILES)
    assert data is not None
    return data


# ---- values and units ---------------------------------------------------------------------


def test_every_value_lands_in_its_record_in_nodescope_units(
    pair: tuple[FakeNvml, nv.NvmlSource], wall: Wall
) -> None:
    fake, src = pair
    gpu = fake.gpus[1]
    gpu.ecc_volatile_corrected, gpu.ecc_volatile_uncorrected = 11, 2
    gpu.ecc_aggregate_corrected, gpu.ecc_aggregate_uncorrected = 307, 5
    gpu.retired_pages_single_bit, gpu.retired_pages_double_bit = 3, 1
    gpu.retired_pages_pending = True
    gpu.remapped_rows_correctable, gpu.remapped_rows_uncorrectable = 4, 1
    gpu.remap_pending, gpu.remap_failed = True, False
    gpu.temperature_gpu, gpu.temperature_memory = 81, 77
    gpu.temperature_slowdown, gpu.temperature_shutdown = 90, 95
    gpu.temperature_gpu_max, gpu.temperature_memory_max = 88, 105
    gpu.power_draw_mw, gpu.power_limit_mw, gpu.power_enforced_limit_mw = 651_250, 700_000, 650_000
    gpu.power_default_limit_mw = 720_000
    gpu.sm_clock_mhz, gpu.memory_clock_mhz = 1410, 2619
    gpu.applications_sm_clock_mhz = 1755
    gpu.clock_event_reasons = CLOCK_EVENT_SW_THERMAL_SLOWDOWN | CLOCK_EVENT_HW_SLOWDOWN
    gpu.fb_used_bytes, gpu.fb_total_bytes = 60 * 1024**3, 80 * 1024**3
    gpu.fabric_state, gpu.fabric_status = FABRIC_STATE_IN_PROGRESS, pynvml.NVML_SUCCESS
    gpu.fabric_clique_id = 7
    gpu.fabric_health_mask = pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE

    data = read_health(src, wall)
    health = data.health[1]
    assert (health.index, health.uuid, health.pci_address) == (1, gpu.uuid, "0000:3b:00.0")
    assert health.read_at == wall.now
    assert health.ecc == EccErrors(11, 2, 307, 5)
    assert health.retired_pages == RetiredPages(3, 1, True)
    assert health.row_remap == RowRemap(4, 1, True, False)
    assert health.temperatures == Temperatures(81, 77, 90, 95, 88, 105)
    assert health.power == Power(651.25, 700.0, 650.0, 720.0)
    assert health.clocks == Clocks(1410, 2619, 0x28, 1755)
    assert health.framebuffer == FrameBuffer(60 * 1024**3, 80 * 1024**3)
    assert health.fabric == Fabric(
        FABRIC_STATE_IN_PROGRESS, pynvml.NVML_SUCCESS, 7, HGX_H100_FABRIC_CLUSTER_UUID, True
    )
    assert health.unsupported == ()
    # The other GPU keeps the fake's defaults: an H100 at rest, registered with the fabric.
    other = data.health[0]
    assert other.temperatures == Temperatures(34, 38, 87, 92, 87, 95)
    assert other.power == Power(72.0, 700.0, 700.0, 700.0)
    assert other.clocks is not None and other.clocks.applications_sm_mhz == 1980
    assert other.fabric is not None and other.fabric.state == FABRIC_STATE_COMPLETED
    assert other.fabric.bandwidth_degraded is None  # health mask 0: not said
    assert data.skipped.counts == {}


def test_a_fabric_not_supported_state_carries_nothing_else(wall: Wall) -> None:
    gpus = hgx_h100(1, 1)
    gpus[0].fabric_state = pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED
    gpus[0].fabric_clique_id = 9
    src = make_source(FakeNvml(gpus), wall, health_every=1)
    (health,) = read_health(src, wall).health
    assert health.fabric == Fabric(
        pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, None, None, None, None
    )


def test_a_zero_cluster_uuid_is_none(wall: Wall) -> None:
    gpus = hgx_h100(1, 1)
    gpus[0].fabric_cluster_uuid = "00000000-0000-0000-0000-000000000000"
    src = make_source(FakeNvml(gpus), wall, health_every=1)
    (health,) = read_health(src, wall).health
    assert health.fabric is not None and health.fabric.cluster_uuid is None
    assert nv.fabric_uuid(bytes(15)) is None


# ---- cadence ----------------------------------------------------------------------------------


def test_health_is_read_every_health_every_runs_and_carried_between(wall: Wall) -> None:
    fake = FakeNvml(hgx_h100(2, 2))
    src = make_source(fake, wall, health_every=3, slow_every=100)
    records = []
    asked = []
    for _ in range(8):
        wall.now += 1.0
        records.append(src.collect(NO_FILES))
        asked.append(health_calls(fake))
    # Run 0 reads everything slow: its health read waits one run. Then every third run.
    health_runs = [i for i in range(8) if i == 0 or asked[i] != asked[i - 1]]
    assert health_runs[1:] == [1, 4, 7]
    assert asked[0] == dict.fromkeys(HEALTH_CALLS, 0)
    assert records[0].health == ()
    for run in (2, 3):
        # Carried: the very records of the last read, dated by it.
        assert all(a is b for a, b in zip(records[run].health, records[1].health, strict=True))
        assert records[run].health[0].read_at == records[1].health[0].read_at
    assert records[4].health[0].read_at == records[4].health[1].read_at == 1_750_000_005.0
    # Each health run asks every GPU's power draw once.
    assert fake.calls["nvmlDeviceGetPowerUsage"] == 2 * 3


def test_no_run_reads_health_and_the_slow_values_together(wall: Wall) -> None:
    fake = FakeNvml(hgx_h100(1, 2))
    src = make_source(fake, wall, health_every=2, slow_every=4)
    both = []
    for run in range(16):
        slow_before = fake.calls["nvmlDeviceGetNvLinkErrorCounter"]
        health_before = fake.calls["nvmlDeviceGetPowerUsage"]
        wall.now += 1.0
        src.collect(NO_FILES)
        slow = fake.calls["nvmlDeviceGetNvLinkErrorCounter"] > slow_before
        health = fake.calls["nvmlDeviceGetPowerUsage"] > health_before
        both.append((run, slow, health))
    assert [run for run, slow, _h in both if slow] == [0, 4, 8, 12]
    assert [run for run, _s, health in both if health] == [1, 3, 5, 7, 9, 11, 13, 15]


def test_health_every_run_when_every_run_is_slow(wall: Wall) -> None:
    fake = FakeNvml(hgx_h100(1, 1))
    src = make_source(fake, wall, health_every=2, slow_every=1)
    records = [read_health(src, wall) for _ in range(4)]
    # Nothing to stagger with: health on its own cadence, from the first run.
    assert fake.calls["nvmlDeviceGetPowerUsage"] == 2
    assert records[0].health != ()


def test_a_lost_gpu_brings_the_next_health_read_forward(wall: Wall) -> None:
    fake = FakeNvml(hgx_h100(2, 1))
    src = make_source(fake, wall, health_every=50, slow_every=100)
    read_health(src, wall, runs=3)  # run 1 read health; the next is 50 runs away
    asked = fake.calls["nvmlDeviceGetPowerUsage"]
    fake.gpus[0].lost = True
    lost_run = read_health(src, wall)
    assert [h.index for h in lost_run.health] == [1]  # the lost GPU leaves the health
    read_health(src, wall)  # the slow read of the GPUs left
    read_health(src, wall)  # then their health
    assert fake.calls["nvmlDeviceGetPowerUsage"] == asked + 1


def test_default_cadences() -> None:
    src = nv.NvmlSource(FakeNvml([]), watch_xids=False)
    assert (src.health_every, src.gpm_every) == (nv.HEALTH_EVERY, nv.GPM_EVERY) == (5, 30)


# ---- unsupported, lost, library gone ---------------------------------------------------------


def test_unsupported_calls_are_asked_once_and_listed(wall: Wall) -> None:
    gpus = hgx_h100(2, 1)
    # An Ampere-or-later GPU retires no pages (it remaps rows); no HBM temperature field.
    gpus[0].unsupported |= {
        "nvmlDeviceGetRetiredPages",
        "nvmlDeviceGetRetiredPagesPendingStatus",
        "nvmlDeviceGetGpuFabricInfoV",
        pynvml.NVML_FI_DEV_MEMORY_TEMP,
    }
    fake = FakeNvml(gpus)
    src = make_source(fake, wall, health_every=1)
    data = read_health(src, wall, runs=4)
    first = data.health[0]
    assert first.retired_pages is None and first.fabric is None
    assert first.temperatures is not None and first.temperatures.memory is None
    assert first.unsupported == (
        "nvmlDeviceGetFieldValues:NVML_FI_DEV_MEMORY_TEMP",
        "nvmlDeviceGetGpuFabricInfoV",
        "nvmlDeviceGetRetiredPages:double_bit_ecc",
        "nvmlDeviceGetRetiredPages:single_bit_ecc",
        "nvmlDeviceGetRetiredPagesPendingStatus",
    )
    assert data.health[1].unsupported == ()
    assert data.health[1].retired_pages == RetiredPages(0, 0, False)
    # GPU 0 was asked once per cause, GPU 1 on each of the four runs.
    assert fake.calls["nvmlDeviceGetRetiredPages"] == 2 + 2 * 4
    assert fake.calls["nvmlDeviceGetRetiredPagesPendingStatus"] == 1 + 4
    # NOT_SUPPORTED from the versioned fabric call is the GPU's answer, not a missing
    # function: the first call is not tried in its place.
    assert fake.calls["nvmlDeviceGetGpuFabricInfo"] == 0
    memory_temp_requests = [
        gpu for gpu, ids in fake.field_requests if ids == [(nv.FI_MEMORY_TEMP, 0)]
    ]
    assert memory_temp_requests.count(0) == 1 and memory_temp_requests.count(1) == 4


def test_temperature_thresholds_are_asked_until_answered_then_carried(wall: Wall) -> None:
    fake = FakeNvml(hgx_h100(1, 1))
    src = make_source(fake, wall, health_every=1)
    read_health(src, wall, runs=3)
    assert fake.calls["nvmlDeviceGetTemperatureThreshold"] == 4
    fake.gpus[0].temperature_slowdown = 80  # a threshold is the board's: not read again
    (health,) = read_health(src, wall).health
    assert health.temperatures is not None and health.temperatures.slowdown == 87


def test_the_default_power_limit_is_asked_until_answered_then_carried(wall: Wall) -> None:
    fake = FakeNvml(hgx_h100(1, 1))
    src = make_source(fake, wall, health_every=1)
    read_health(src, wall, runs=3)
    assert fake.calls["nvmlDeviceGetPowerManagementDefaultLimit"] == 1
    # The applications clock can be changed (nvidia-smi -ac): it is read on every health read.
    assert fake.calls["nvmlDeviceGetApplicationsClock"] == 3
    fake.gpus[0].power_default_limit_mw = 500_000  # the board's constant: not read again
    fake.gpus[0].applications_sm_clock_mhz = 1410
    (health,) = read_health(src, wall).health
    assert health.power is not None and health.power.default_limit_watts == 700.0
    assert health.clocks is not None and health.clocks.applications_sm_mhz == 1410


class WithoutLimitAndAppClock:
    """A binding without ``nvmlDeviceGetPowerManagementDefaultLimit`` and
    ``nvmlDeviceGetApplicationsClock`` (one that dropped the deprecated call)."""

    missing = frozenset(
        {"nvmlDeviceGetPowerManagementDefaultLimit", "nvmlDeviceGetApplicationsClock"}
    )

    def __init__(self, fake: FakeNvml) -> None:
        self.fake = fake

    def __getattr__(self, name: str) -> Any:
        if name in self.missing:
            raise AttributeError(name)
        return getattr(self.fake, name)


def test_a_binding_without_the_default_limit_or_applications_clock_leaves_them_none(
    wall: Wall,
) -> None:
    fake = FakeNvml(hgx_h100(1, 1))
    src = make_source(WithoutLimitAndAppClock(fake), wall, health_every=1)
    (health,) = read_health(src, wall, runs=2).health
    assert health.power == Power(72.0, 700.0, 700.0, None)
    assert health.clocks is not None and health.clocks.applications_sm_mhz is None
    assert health.clocks.sm_mhz == 1980
    assert "nvmlDeviceGetApplicationsClock:sm" in health.unsupported


def address(handle: Any) -> int | None:
    return ctypes.cast(handle, ctypes.c_void_p).value


class LosesGpuMidHealth(FakeNvml):
    """GPU ``victim`` falls off the bus while its power draw is being read."""

    victim = 0
    armed = False

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        if self.armed and address(self.handle(self.victim)) == address(handle):
            self.gpus[self.victim].lost = True
        return super().nvmlDeviceGetPowerUsage(handle)


def test_a_gpu_lost_mid_health_read_leaves_the_record_and_frees_its_gpm_samples(
    wall: Wall,
) -> None:
    fake = LosesGpuMidHealth(hgx_h100(3, 1))
    src = make_source(fake, wall, health_every=2, gpm_every=2)
    read_health(src, wall, runs=2)  # run 1: health and the first GPM samples
    assert fake.gpm_samples_allocated() == 2 * 3
    fake.armed = True
    data = read_health(src, wall, runs=2)  # run 3: health again, GPU 0 lost within it
    assert [g.index for g in data.gpus] == [1, 2]
    assert [h.index for h in data.health] == [1, 2]
    assert [lost.gpu for lost in data.lost] == [0]
    assert data.events[-1].kind == "gpu_lost"
    assert "nvmlDeviceGetPowerUsage" in data.events[-1].detail
    assert fake.gpm_samples_allocated() == 2 * 2
    later = read_health(src, wall, runs=2)
    assert [h.index for h in later.health] == [1, 2]


def test_nvml_gone_takes_the_source_down_and_the_gpm_buffers_with_it(wall: Wall) -> None:
    fake = FakeNvml(hgx_h100(2, 1))
    src = make_source(fake, wall, health_every=2, gpm_every=2)
    read_health(src, wall, runs=2)
    assert fake.gpm_samples_allocated() == 4
    fake.nvmlShutdown()  # NVML goes away under the source
    with pytest.raises(nv.NvmlUnavailable):
        src.collect(NO_FILES)
    # The frees were tried (and failed, NVML being gone); the source holds no buffer now.
    assert fake.calls["nvmlGpmSampleFree"] == 4
    fake.nvmlInit()
    src.close()
    assert fake.calls["nvmlGpmSampleFree"] == 4


def test_close_frees_the_gpm_samples(wall: Wall) -> None:
    fake = FakeNvml(hgx_h100(2, 1))
    src = make_source(fake, wall, health_every=1, gpm_every=1)
    read_health(src, wall, runs=2)
    assert fake.gpm_samples_allocated() == 4
    src.close()
    assert fake.gpm_samples_allocated() == 0
    assert fake.calls["nvmlGpmSampleFree"] == 4


# ---- impossible values --------------------------------------------------------------------


def test_impossible_values_are_dropped_and_counted_the_rest_kept(wall: Wall) -> None:
    fake = FakeNvml(hgx_h100(2, 1))
    gpu = fake.gpus[0]
    gpu.temperature_gpu = 250
    gpu.power_draw_mw = 12_000_000  # 12 kW
    gpu.clock_event_reasons = 1 << 64
    gpu.ecc_volatile_corrected = -3
    gpu.remap_pending = 7  # type: ignore[assignment]  # not a flag
    gpu.fb_used_bytes = gpu.fb_total_bytes + 1
    src = make_source(fake, wall, health_every=1)
    data = read_health(src, wall)
    health = data.health[0]
    assert health.temperatures is not None
    assert (health.temperatures.gpu, health.temperatures.memory) == (None, 38)
    assert health.power == Power(None, 700.0, 700.0, 700.0)
    assert health.clocks == Clocks(1980, 2619, None, 1980)
    assert health.ecc == EccErrors(None, 0, 0, 0)
    assert health.row_remap == RowRemap(0, 0, None, False)
    assert health.framebuffer is None
    assert data.skipped.counts == {SKIP: 6}
    assert "gpu=0" in data.skipped.examples[SKIP]
    assert data.health[1].temperatures is not None and data.health[1].temperatures.gpu == 34


def test_skipped_values_reach_the_collectors_totals(wall: Wall) -> None:
    fake = FakeNvml(hgx_h100(1, 1))
    fake.gpus[0].temperature_gpu = 500
    src = make_source(fake, wall, health_every=1, slow_every=1)
    collector = Collector(roots=NO_FILES, scheduled=[ScheduledSource(src, 1.0)])
    try:
        for _ in range(3):
            snapshot = collector.run_cycle(force=True)
        assert dict(snapshot.status["nvml"].skipped_total) == {SKIP: 3}
    finally:
        collector.close()


def test_impossible_gpm_figures_are_dropped_and_counted(wall: Wall) -> None:
    fake = FakeNvml(hgx_h100(1, 1))
    fake.gpus[0].gpm_sm_activity_percent = 140.0
    fake.gpus[0].gpm_pcie_rx_mib_per_second = float("nan")
    fake.gpus[0].gpm_dram_bandwidth_percent = 100.0000001  # arithmetic, not garbage
    src = make_source(fake, wall, health_every=1, gpm_every=1)
    read_health(src, wall)
    data = read_health(src, wall)
    gpm = data.health[0].gpm
    assert gpm is not None
    assert gpm.sm_activity_percent is None and gpm.pcie_rx_bytes_per_second is None
    assert gpm.dram_bandwidth_percent == 100.0
    assert data.skipped.counts == {SKIP: 2}


@settings(max_examples=60, deadline=None)
@given(
    temperature=st.integers(-(1 << 40), 1 << 40),
    milliwatts=st.integers(-(1 << 40), 1 << 40),
    reasons=st.integers(-(1 << 70), 1 << 70),
    mhz=st.integers(-(1 << 20), 1 << 20),
)
def test_fuzz_each_value_is_kept_exactly_or_dropped_and_counted(
    temperature: int, milliwatts: int, reasons: int, mhz: int
) -> None:
    fake = FakeNvml(hgx_h100(1, 1))
    gpu = fake.gpus[0]
    gpu.temperature_gpu, gpu.power_draw_mw = temperature, milliwatts
    gpu.clock_event_reasons, gpu.sm_clock_mhz = reasons, mhz
    wall = Wall()
    src = make_source(fake, wall, health_every=1)
    data = read_health(src, wall)
    (health,) = data.health
    assert health.temperatures is not None and health.power is not None
    assert health.clocks is not None
    kept = {
        "temperature": (health.temperatures.gpu, temperature, 0 <= temperature <= 200),
        "power": (health.power.draw_watts, milliwatts / 1000.0, 0 <= milliwatts <= 10_000_000),
        "reasons": (health.clocks.event_reasons, reasons, 0 <= reasons < 1 << 64),
        "mhz": (health.clocks.sm_mhz, mhz, 0 <= mhz <= 100_000),
    }
    for name, (read, given_value, possible) in kept.items():
        assert read == (given_value if possible else None), name
    dropped = sum(1 for _r, _g, possible in kept.values() if not possible)
    assert data.skipped.counts.get(SKIP, 0) == dropped


@settings(max_examples=200, deadline=None)
@given(value=st.one_of(st.integers(), st.floats(allow_nan=True), st.booleans(), st.text()))
def test_fuzz_plausible_keeps_only_numbers_in_range(value: object) -> None:
    bounds = (0, 200)
    kept = nv.plausible(value, bounds)
    if isinstance(value, int) and 0 <= value <= 200:
        assert kept == value
    else:
        assert kept is None
    as_float = nv.plausible_float(value, (0.0, 100.0))
    if as_float is not None:
        assert isinstance(value, int | float) and not isinstance(value, bool)
        assert 0.0 <= as_float <= 100.0 and abs(as_float - float(value)) <= 1e-6


# ---- GPM ----------------------------------------------------------------------------------


def test_gpm_needs_two_samples_then_gives_figures_in_bytes_per_second(wall: Wall) -> None:
    fake = FakeNvml(hgx_h100(1, 2))
    gpu = fake.gpus[0]
    gpu.gpm_sm_activity_percent, gpu.gpm_tensor_activity_percent = 87.5, 61.0
    gpu.gpm_dram_bandwidth_percent = 43.25
    gpu.gpm_nvlink_tx_mib_per_second, gpu.gpm_nvlink_rx_mib_per_second = 150_000.0, 149_000.0
    gpu.gpm_pcie_tx_mib_per_second, gpu.gpm_pcie_rx_mib_per_second = 1_000.0, 24_000.0
    src = make_source(fake, wall, health_every=2, gpm_every=4)
    records = [read_health(src, wall) for _ in range(10)]
    # Health on runs 1, 3, 5, 7, 9; GPM samples on runs 1, 5, 9.
    assert fake.calls["nvmlGpmSampleGet"] == 3
    assert fake.calls["nvmlGpmQueryDeviceSupport"] == 1
    assert fake.calls["nvmlGpmSampleAlloc"] == 2
    assert fake.calls["nvmlGpmMetricsGet"] == 2
    assert all(r.health[0].gpm is None for r in records[1:5])
    gpm = records[5].health[0].gpm
    assert gpm == Gpm(
        window_seconds=4.0,
        sm_activity_percent=87.5,
        tensor_activity_percent=61.0,
        dram_bandwidth_percent=43.25,
        nvlink_tx_bytes_per_second=150_000.0 * MIB,
        nvlink_rx_bytes_per_second=149_000.0 * MIB,
        pcie_tx_bytes_per_second=1_000.0 * MIB,
        pcie_rx_bytes_per_second=24_000.0 * MIB,
    )
    assert records[7].health[0].gpm is gpm  # carried until the next GPM read
    gpu.gpm_sm_activity_percent = 12.0
    assert records[9].health[0].gpm is not None
    assert records[9].health[0].gpm.sm_activity_percent == 87.5  # read before the change
    assert read_health(src, wall, runs=4).health[0].gpm.sm_activity_percent == 12.0  # type: ignore[union-attr]


def test_gpm_without_nvlink_drops_those_metrics_for_good(wall: Wall) -> None:
    gpus = [FakeGpu(uuid="GPU-pcie", name="NVIDIA H100 PCIe", pci_bus_id="00000000:17:00.0")]
    gpus[0].gpm_pcie_rx_mib_per_second = 512.0
    fake = FakeNvml(gpus)
    src = make_source(fake, wall, health_every=1, gpm_every=1)
    gpm = read_health(src, wall, runs=4).health[0].gpm
    assert gpm is not None and gpm.pcie_rx_bytes_per_second == 512.0 * MIB
    assert gpm.nvlink_tx_bytes_per_second is None and gpm.nvlink_rx_bytes_per_second is None
    unsupported = read_health(src, wall).health[0].unsupported
    assert "nvmlGpmMetricsGet:nvlink_tx_bytes_per_second" in unsupported
    assert "nvmlGpmMetricsGet:nvlink_rx_bytes_per_second" in unsupported


class NoGpm(FakeNvml):
    """A GPU before Hopper: the support query answers, and the answer is no."""

    def nvmlGpmQueryDeviceSupport(self, device: Any) -> Any:
        support = super().nvmlGpmQueryDeviceSupport(device)
        support.isSupportedDevice = 0
        return support


def test_a_gpu_without_gpm_is_asked_once_and_never_sampled(wall: Wall) -> None:
    fake = NoGpm(hgx_h100(1, 1))
    src = make_source(fake, wall, health_every=1, gpm_every=1)
    health = read_health(src, wall, runs=5).health[0]
    assert health.gpm is None and "nvmlGpmQueryDeviceSupport" in health.unsupported
    assert fake.calls["nvmlGpmQueryDeviceSupport"] == 1
    assert fake.calls["nvmlGpmSampleAlloc"] == 0 and fake.calls["nvmlGpmSampleGet"] == 0


def test_gpm_not_supported_error_is_remembered_too(wall: Wall) -> None:
    gpus = hgx_h100(1, 1)
    gpus[0].unsupported.add("nvmlGpmQueryDeviceSupport")
    fake = FakeNvml(gpus)
    src = make_source(fake, wall, health_every=1, gpm_every=1)
    read_health(src, wall, runs=4)
    assert fake.calls["nvmlGpmQueryDeviceSupport"] == 1
    assert fake.calls["nvmlGpmSampleAlloc"] == 0


# ---- fallbacks ----------------------------------------------------------------------------


class OldBinding:
    """A binding that has neither ``nvmlDeviceGetGpuFabricInfoV`` nor
    ``nvmlDeviceGetCurrentClocksEventReasons`` (older nvidia-ml-py releases)."""

    missing = frozenset({"nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetCurrentClocksEventReasons"})

    def __init__(self, fake: FakeNvml) -> None:
        self.fake = fake

    def __getattr__(self, name: str) -> Any:
        if name in self.missing:
            raise AttributeError(name)
        return getattr(self.fake, name)


class OldDriver(FakeNvml):
    """A driver without the two newer symbols: the binding raises FunctionNotFound."""

    def nvmlDeviceGetGpuFabricInfoV(self, device: Any, gpuFabricInfo: Any) -> int:
        self.calls["nvmlDeviceGetGpuFabricInfoV"] += 1
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        self.calls["nvmlDeviceGetCurrentClocksEventReasons"] += 1
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)


@pytest.mark.parametrize("old", ["binding", "driver"])
def test_older_binding_or_driver_falls_back_to_the_first_calls(old: str, wall: Wall) -> None:
    gpus = hgx_h100(1, 1)
    gpus[0].clock_event_reasons = CLOCK_EVENT_HW_SLOWDOWN
    gpus[0].fabric_health_mask = pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE
    fake: FakeNvml = OldDriver(gpus) if old == "driver" else FakeNvml(gpus)
    adapter: Any = fake if old == "driver" else OldBinding(fake)
    src = make_source(adapter, wall, health_every=1)
    health = read_health(src, wall, runs=3).health[0]
    assert health.clocks is not None and health.clocks.event_reasons == CLOCK_EVENT_HW_SLOWDOWN
    # The first fabric call has no health mask: the degraded bit is not said.
    assert health.fabric == Fabric(
        FABRIC_STATE_COMPLETED, pynvml.NVML_SUCCESS, 1, HGX_H100_FABRIC_CLUSTER_UUID, None
    )
    assert fake.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 3
    assert fake.calls["nvmlDeviceGetGpuFabricInfo"] == 3
    # The newer calls were tried once (or not at all, where the binding lacks them).
    expected = 1 if old == "driver" else 0
    assert fake.calls["nvmlDeviceGetGpuFabricInfoV"] == expected
    assert fake.calls["nvmlDeviceGetCurrentClocksEventReasons"] == expected
    assert "nvmlDeviceGetGpuFabricInfoV" in health.unsupported


def test_the_current_calls_are_used_where_they_exist(wall: Wall) -> None:
    fake = FakeNvml(hgx_h100(1, 1))
    src = make_source(fake, wall, health_every=1)
    read_health(src, wall, runs=2)
    assert fake.calls["nvmlDeviceGetCurrentClocksEventReasons"] == 2
    assert fake.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 0
    assert fake.calls["nvmlDeviceGetGpuFabricInfoV"] == 2
    assert fake.calls["nvmlDeviceGetGpuFabricInfo"] == 0
