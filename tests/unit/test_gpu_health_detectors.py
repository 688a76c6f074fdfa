"""The GPU health detector on records built directly: each kind on its fault, silence on the
healthy control and the near-misses, durations held by the derived stage across cycles."""

from __future__ import annotations

from dataclasses import replace

import pytest

from nodescope.assembly import default_config, from_mapping
from nodescope.config import Config
from nodescope.derive import DerivedStage
from nodescope.detectors import gpu_health as det
from nodescope.detectors.registry import ALERT_RULES, DETECTORS, gpu_health_inputs
from nodescope.errors import ConfigError
from nodescope.model.finding import Finding, Severity
from nodescope.model.gpu_health import (
    CLOCK_EVENT_GPU_IDLE,
    CLOCK_EVENT_HW_POWER_BRAKE_SLOWDOWN,
    CLOCK_EVENT_HW_SLOWDOWN,
    CLOCK_EVENT_HW_THERMAL_SLOWDOWN,
    CLOCK_EVENT_SW_POWER_CAP,
    CLOCK_EVENT_SW_THERMAL_SLOWDOWN,
    FABRIC_STATE_COMPLETED,
    FABRIC_STATE_IN_PROGRESS,
    FABRIC_STATE_NOT_SUPPORTED,
    HEALTH_EVERY,
    Clocks,
    EccErrors,
    Fabric,
    GpuHealth,
    Power,
    RetiredPages,
    RowRemap,
    Temperatures,
)
from nodescope.model.jobs import JobView
from nodescope.model.nvml import GpuProcess, GpuSample, NvmlData
from nodescope.model.snapshot import Snapshot, SourceSample
from tests.unit.gpu_helpers import gen5_sample, gpu_health, nvml_data

GPU0 = "0000:18:00.0"
GPU1 = "0000:2a:00.0"
BDFS = {0: GPU0, 1: GPU1}
CONFIG = default_config()
#: The default minimum duration of a slowdown.
MINIMUM = CONFIG.detectors.gpu_health.min_slowdown_seconds
#: A read interval of 1 s and a health read every 5 runs: health is stale after 15 s.
STALE_AFTER = det.STALE_READS * HEALTH_EVERY * 1.0

HEALTHY_ECC = EccErrors(0, 0, 0, 0)
HOT = Temperatures(gpu=89, memory=84, slowdown=87, shutdown=92, gpu_max=87, memory_max=95)
COOL = Temperatures(gpu=55, memory=50, slowdown=87, shutdown=92, gpu_max=87, memory_max=95)


def health(
    index: int = 0,
    read_at: float = 1000.0,
    *,
    ecc: EccErrors | None = HEALTHY_ECC,
    remap: RowRemap | None = None,
    pages: RetiredPages | None = None,
    temps: Temperatures | None = COOL,
    power: Power | None = None,
    reasons: int | None = 0,
    fabric: Fabric | None = None,
    sm_mhz: int = 1980,
    applications_sm_mhz: int | None = 1980,
) -> GpuHealth:
    return gpu_health(
        index,
        BDFS[index],
        read_at,
        ecc=ecc,
        retired_pages=pages,
        row_remap=remap,
        temperatures=temps,
        power=power,
        clocks=None if reasons is None else Clocks(sm_mhz, 2619, reasons, applications_sm_mhz),
        fabric=fabric,
    )


def sample(index: int = 0, util: int | None = 0, pids: tuple[int, ...] = ()) -> GpuSample:
    return gen5_sample(
        index,
        BDFS[index],
        gpu_util_percent=util,
        memory_util_percent=0,
        processes=tuple(GpuProcess(p, None) for p in pids),
    )


def nvml(*gpus: GpuHealth, samples: tuple[GpuSample, ...] | None = None) -> NvmlData:
    if samples is None:
        samples = tuple(sample(h.index) for h in gpus)
    return nvml_data(samples, gpus)


class Node:
    """Cycles of one daemon: snapshots through one derived stage, each holding the ``nvml``
    record of its cycle and the one before, as the collector hands them on."""

    def __init__(self, config: Config = CONFIG) -> None:
        self.config = config
        self.stage = DerivedStage()
        self.snapshot: Snapshot | None = None
        self.sample: SourceSample | None = None
        self.cycle = 0

    def at(self, t: float, data: NvmlData | None) -> list[Finding]:
        """The findings of the cycle at ``t`` whose nvml read gave ``data`` (``None``: the
        read failed)."""
        self.cycle += 1
        error = None if data is not None else "nvml down"
        current = SourceSample("nvml", t, 0.01, data, error)
        previous = {} if self.sample is None else {"nvml": self.sample}
        snapshot = self.stage.derive(
            Snapshot(self.cycle, t, 1.7e9 + t, {"nvml": current}, previous)
        )
        found = list(det.detect(self.snapshot, snapshot, gpu_health_inputs(self.config)))
        self.snapshot, self.sample = snapshot, current
        return found


def kinds(findings: list[Finding]) -> list[str]:
    return sorted(f.kind for f in findings)


@pytest.fixture
def job_on_gpu0(monkeypatch: pytest.MonkeyPatch) -> None:
    views = (JobView("81790", (4242,), (0,), (GPU0,), ("mlx5_0",), "all"),)
    monkeypatch.setattr(det, "jobs", lambda snapshot: views)


# --- the healthy control ---------------------------------------------------------------------


def test_a_healthy_busy_gpu_is_no_finding_over_time() -> None:
    node = Node()
    fabric = Fabric(FABRIC_STATE_COMPLETED, 0, 3, "cluster", False)
    remap = RowRemap(2, 0, False, False)
    pages = RetiredPages(0, 0, False)
    for t in range(0, 120, 1):
        read_at = 1000.0 + t - t % 5  # a new health read every fifth run
        h = health(read_at=read_at, remap=remap, pages=pages, fabric=fabric)
        assert node.at(float(t), nvml(h, samples=(sample(util=100, pids=(7,)),))) == []


def test_no_health_yet_and_a_gpu_absent_from_health_are_no_finding() -> None:
    node = Node()
    assert node.at(0.0, nvml()) == []
    pending = health(1, remap=RowRemap(0, 1, True, False))
    # GPU 0 has a sample but no health record: nothing is said of it.
    data = nvml(pending, samples=(sample(0, util=100), sample(1)))
    assert [f.subjects for f in node.at(1.0, data)] == [{"gpu": "1"}]


# --- ECC -------------------------------------------------------------------------------------


def test_uncorrected_errors_between_two_health_reads(job_on_gpu0: None) -> None:
    node = Node()
    assert node.at(0.0, nvml(health(read_at=1000.0, ecc=EccErrors(5, 0, 40, 3)))) == []
    # The same read carried on the next record: nothing new.
    assert node.at(1.0, nvml(health(read_at=1000.0, ecc=EccErrors(5, 0, 40, 3)))) == []
    [finding] = node.at(2.0, nvml(health(read_at=1005.0, ecc=EccErrors(5, 2, 40, 5))))
    assert finding.kind == det.ECC and finding.severity is Severity.CRITICAL
    assert finding.subjects == {"gpu": "0"}
    assert finding.evidence["new_uncorrected_errors"] == 2.0
    assert finding.evidence["volatile_uncorrected_errors"] == 2.0
    assert finding.evidence["aggregate_uncorrected_errors"] == 5.0
    assert all(isinstance(v, float) for v in finding.evidence.values())
    assert "2 uncorrectable ECC errors on GPU 0 (0000:18:00.0)" in finding.message
    assert "used by job 81790" in finding.message and "action: reset the GPU" in finding.message
    # The next record carries that read again: the alert rule holds what was found.
    assert node.at(3.0, nvml(health(read_at=1005.0, ecc=EccErrors(5, 2, 40, 5)))) == []
    assert det.RULES[det.ECC].for_seconds == 0.0
    assert det.RULES[det.ECC].resolve_after_seconds == det.ECC_HOLD_SECONDS


def test_a_job_gone_with_the_error_is_named_from_the_cycle_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fatal ECC error can end the job's processes before the cycle that reads it: the jobs
    of the cycle before are named too."""
    node = Node()
    # (the cycle running, the cycle of the snapshot whose jobs were asked)
    asked: list[tuple[int, int]] = []

    def jobs(snapshot: Snapshot) -> tuple[JobView, ...]:
        asked.append((node.cycle, snapshot.cycle))
        if snapshot.cycle != 3:
            return ()
        return (JobView("81790", (4242,), (0,), (GPU0,), ("mlx5_0",), "all"),)

    monkeypatch.setattr(det, "jobs", jobs)
    for t in range(3):
        assert node.at(float(t), nvml(health(read_at=1000.0, ecc=EccErrors(5, 0, 40, 3)))) == []
    [finding] = node.at(3.0, nvml(health(read_at=1005.0, ecc=EccErrors(5, 2, 40, 5))))
    assert (4, 3) in asked
    assert "used by job 81790" in finding.message


def test_aggregate_growth_alone_is_an_error() -> None:
    node = Node()
    node.at(0.0, nvml(health(read_at=1000.0, ecc=EccErrors(0, None, 0, 7))))
    [finding] = node.at(1.0, nvml(health(read_at=1005.0, ecc=EccErrors(0, None, 0, 8))))
    assert finding.evidence["new_uncorrected_errors"] == 1.0
    assert "volatile_uncorrected_errors" not in finding.evidence


def test_corrected_errors_only_are_no_finding() -> None:
    node = Node()
    node.at(0.0, nvml(health(read_at=1000.0, ecc=EccErrors(10, 0, 100, 0))))
    assert node.at(1.0, nvml(health(read_at=1005.0, ecc=EccErrors(5000, 0, 5090, 0)))) == []


def test_a_count_lower_than_before_is_a_driver_reload_not_errors() -> None:
    node = Node()
    node.at(0.0, nvml(health(read_at=1000.0, ecc=EccErrors(0, 4, 0, 9))))
    # The volatile count starts again at the reload; the aggregate did not move.
    assert node.at(1.0, nvml(health(read_at=1005.0, ecc=EccErrors(0, 1, 0, 9)))) == []
    # A reload with a new error: the aggregate count shows it.
    [finding] = node.at(2.0, nvml(health(read_at=1010.0, ecc=EccErrors(0, 0, 0, 10))))
    assert finding.evidence["new_uncorrected_errors"] == 1.0


def test_the_first_health_read_reports_a_volatile_count() -> None:
    [finding] = Node().at(0.0, nvml(health(ecc=EccErrors(0, 2, 0, 2))))
    assert finding.kind == det.ECC and finding.evidence["new_uncorrected_errors"] == 2.0
    assert "since the driver loaded" in finding.message
    # The first health read after records without one is a first read too.
    node = Node()
    assert node.at(0.0, nvml(samples=(sample(),))) == []
    assert kinds(node.at(1.0, nvml(health(ecc=EccErrors(0, 1, 0, 1))))) == [det.ECC]


def test_an_aggregate_count_from_the_gpus_past_is_no_finding_on_the_first_read() -> None:
    assert Node().at(0.0, nvml(health(ecc=EccErrors(0, 0, 0, 12)))) == []


def test_after_a_failed_read_nothing_is_new() -> None:
    node = Node()
    node.at(0.0, nvml(health(read_at=1000.0, ecc=EccErrors(0, 0, 0, 0))))
    node.at(1.0, None)
    # The pair is broken: a count seen now cannot be dated against any read before.
    assert node.at(2.0, nvml(health(read_at=1005.0, ecc=EccErrors(0, 3, 0, 3)))) == []


def test_no_ecc_answer_is_no_finding() -> None:
    node = Node()
    node.at(0.0, nvml(health(read_at=1000.0, ecc=None)))
    assert node.at(1.0, nvml(health(read_at=1005.0, ecc=None))) == []


# --- row remapping and page retirement ----------------------------------------------------


def test_remap_pending_holds_while_the_flag_is_set(job_on_gpu0: None) -> None:
    node = Node()
    for t in range(3):
        [finding] = node.at(float(t), nvml(health(remap=RowRemap(1, 1, True, False))))
        assert finding.kind == det.REMAP_PENDING and finding.severity is Severity.WARNING
        assert finding.subjects == {"gpu": "0"}
        assert finding.evidence == {
            "correctable_remapped_rows": 1.0,
            "uncorrectable_remapped_rows": 1.0,
            "remap_pending": 1.0,
        }
        assert "reset the GPU when its job ends" in finding.message
        assert "used by job 81790" in finding.message
    # The reset applied it: the flag is clear, the finding is gone.
    assert node.at(3.0, nvml(health(read_at=1005.0, remap=RowRemap(1, 1, False, False)))) == []


def test_remap_failed_is_critical_and_says_replace() -> None:
    found = Node().at(0.0, nvml(health(remap=RowRemap(0, 8, True, True))))
    assert kinds(found) == [det.REMAP_FAILED, det.REMAP_PENDING]
    failed = next(f for f in found if f.kind == det.REMAP_FAILED)
    assert failed.severity is Severity.CRITICAL and "replace the GPU" in failed.message
    assert "(remapped: 8 rows for uncorrectable errors)" in failed.message
    assert "correctable errors" not in failed.message.replace("uncorrectable", "")


def test_a_remap_for_correctable_errors_says_so() -> None:
    # A row that kept correcting single-bit errors is remapped pre-emptively: NVML counts it
    # among the correctable rows, and the message must not say "0 rows ... uncorrectable".
    [pending] = Node().at(0.0, nvml(health(remap=RowRemap(1, 0, True, False))))
    assert pending.kind == det.REMAP_PENDING
    assert "(remapped: 1 row for correctable errors)" in pending.message
    assert "uncorrectable" not in pending.message
    [both] = Node().at(0.0, nvml(health(remap=RowRemap(2, 1, True, False))))
    assert "(remapped: 2 rows for correctable errors and 1 row for uncorrectable errors)" in (
        both.message
    )


def test_remapped_rows_without_a_pending_or_failed_remap_are_no_finding() -> None:
    assert Node().at(0.0, nvml(health(remap=RowRemap(12, 3, False, False)))) == []
    assert Node().at(0.0, nvml(health(remap=RowRemap(None, None, None, None)))) == []


def test_page_retirement_pending() -> None:
    [finding] = Node().at(0.0, nvml(health(pages=RetiredPages(2, 1, True))))
    assert finding.kind == det.RETIREMENT_PENDING and finding.severity is Severity.WARNING
    assert finding.evidence["double_bit_ecc_retired_pages"] == 1.0
    assert Node().at(0.0, nvml(health(pages=RetiredPages(2, 1, False)))) == []


# --- slowdowns -------------------------------------------------------------------------------


def run_slowdown(
    node: Node,
    seconds: range,
    reasons: int,
    util: int = 100,
    pids: tuple[int, ...] = (),
    temps: Temperatures = COOL,
    power: Power | None = None,
    sm_mhz: int = 1980,
    applications_sm_mhz: int | None = 1980,
) -> dict[float, list[Finding]]:
    """Cycles every second over ``seconds`` with ``reasons`` in force, health read every 5 s."""
    out = {}
    for t in seconds:
        h = health(
            read_at=1000.0 + t - t % 5,
            reasons=reasons,
            temps=temps,
            power=power,
            sm_mhz=sm_mhz,
            applications_sm_mhz=applications_sm_mhz,
        )
        out[float(t)] = node.at(float(t), nvml(h, samples=(sample(util=util, pids=pids),)))
    return out


def test_thermal_slowdown_under_load_held_for_the_minimum(job_on_gpu0: None) -> None:
    found = run_slowdown(Node(), range(0, 40), CLOCK_EVENT_SW_THERMAL_SLOWDOWN, temps=HOT)
    assert all(found[t] == [] for t in range(0, int(MINIMUM)))
    [finding] = found[MINIMUM]
    assert finding.kind == det.THERMAL and finding.severity is Severity.WARNING
    assert finding.subjects == {"gpu": "0"}
    assert finding.evidence["held_seconds"] == MINIMUM
    assert finding.evidence["gpu_temperature_celsius"] == 89.0
    assert finding.evidence["slowdown_temperature_celsius"] == 87.0
    assert finding.evidence["clock_event_reasons"] == float(CLOCK_EVENT_SW_THERMAL_SLOWDOWN)
    assert all(isinstance(v, float) for v in finding.evidence.values())
    message = finding.message
    assert message.startswith("GPU 0 (0000:18:00.0) slowed by heat under load for 30 s")
    assert (
        "sw_thermal_slowdown" in message
        and "GPU at 89 °C against a slowdown threshold of 87 °C" in message
    )
    assert "used by job 81790" in message
    # Held on: the duration grows with each cycle.
    assert found[39.0][0].evidence["held_seconds"] == 39.0


def test_thermal_reasons_while_idle_are_no_finding() -> None:
    reasons = CLOCK_EVENT_SW_THERMAL_SLOWDOWN | CLOCK_EVENT_GPU_IDLE
    found = run_slowdown(Node(), range(0, 90), reasons, util=0, temps=HOT)
    assert all(f == [] for f in found.values())


def test_a_compute_process_makes_a_gpu_busy_whatever_its_utilisation() -> None:
    found = run_slowdown(Node(), range(0, 31), CLOCK_EVENT_SW_THERMAL_SLOWDOWN, util=0, pids=(9,))
    assert kinds(found[30.0]) == [det.THERMAL]
    assert found[30.0][0].evidence["compute_processes"] == 1.0


def test_busy_is_the_configured_utilisation() -> None:
    config = from_mapping({"detectors": {"gpu_health": {"busy_util_percent": 80}}})
    reasons = CLOCK_EVENT_SW_THERMAL_SLOWDOWN
    assert run_slowdown(Node(config), range(0, 31), reasons, util=79)[30.0] == []
    assert kinds(run_slowdown(Node(config), range(0, 31), reasons, util=80)[30.0]) == [det.THERMAL]


def test_a_slowdown_shorter_than_the_minimum_starts_again_when_it_clears() -> None:
    node = Node()
    found = run_slowdown(node, range(0, 25), CLOCK_EVENT_SW_THERMAL_SLOWDOWN)
    found.update(run_slowdown(node, range(25, 30), 0))
    found.update(run_slowdown(node, range(30, 75), CLOCK_EVENT_SW_THERMAL_SLOWDOWN))
    assert all(found[t] == [] for t in range(0, 60))
    assert found[60.0][0].evidence["held_seconds"] == 30.0


def test_a_load_that_stops_for_a_cycle_starts_the_slowdown_again() -> None:
    node = Node()
    found = run_slowdown(node, range(0, 20), CLOCK_EVENT_SW_THERMAL_SLOWDOWN)
    found.update(run_slowdown(node, range(20, 21), CLOCK_EVENT_SW_THERMAL_SLOWDOWN, util=0))
    found.update(run_slowdown(node, range(21, 52), CLOCK_EVENT_SW_THERMAL_SLOWDOWN))
    assert all(found[t] == [] for t in range(0, 51))
    assert kinds(found[51.0]) == [det.THERMAL]


def test_the_minimum_is_configured() -> None:
    config = from_mapping({"detectors": {"gpu_health": {"min_slowdown_seconds": 10}}})
    found = run_slowdown(Node(config), range(0, 11), CLOCK_EVENT_SW_THERMAL_SLOWDOWN)
    assert found[9.0] == [] and kinds(found[10.0]) == [det.THERMAL]
    at_once = from_mapping({"detectors": {"gpu_health": {"min_slowdown_seconds": 0}}})
    capped = run_slowdown(Node(at_once), range(0, 1), CLOCK_EVENT_SW_POWER_CAP, power=CAPPED)
    assert kinds(capped[0.0]) == [det.POWER]


#: Busy H100s at their normal operating point: drawing 694-698 W of the 700 W they ship
#: with, the driver's power cap holding the SM clock a little under the 1,980 MHz
#: applications clock.
AT_DEFAULT = Power(
    draw_watts=696.0, limit_watts=700.0, enforced_limit_watts=700.0, default_limit_watts=700.0
)
#: A 400 W limit enforced on a board that ships with 700 W.
CAPPED = Power(
    draw_watts=399.0, limit_watts=700.0, enforced_limit_watts=400.0, default_limit_watts=700.0
)


def test_busy_gpus_at_their_default_power_limit_are_healthy() -> None:
    # The healthy control: eight GPUs drawing 694-698 W of 700 W with sw_power_cap, clocks
    # at 1,755-1,830 MHz of 1,980, for two minutes: where an H100 runs when it works hard.
    node = Node()
    for t in range(0, 120):
        read_at = 1000.0 + t - t % 5
        gpus = tuple(
            gpu_health(
                i,
                f"0000:{0x18 + i:02x}:00.0",
                read_at,
                ecc=HEALTHY_ECC,
                temperatures=COOL,
                power=Power(694.0 + i % 5, 700.0, 700.0, 700.0),
                clocks=Clocks(1755 + 10 * i, 2619, CLOCK_EVENT_SW_POWER_CAP, 1980),
            )
            for i in range(8)
        )
        samples = tuple(
            gen5_sample(
                i,
                f"0000:{0x18 + i:02x}:00.0",
                gpu_util_percent=97,
                memory_util_percent=60,
                processes=(GpuProcess(4000 + i, None),),
            )
            for i in range(8)
        )
        assert node.at(float(t), nvml_data(samples, gpus)) == []


def test_a_limit_enforced_below_the_default_is_a_finding_naming_both() -> None:
    found = run_slowdown(Node(), range(0, 31), CLOCK_EVENT_SW_POWER_CAP, power=CAPPED, sm_mhz=1410)
    assert found[29.0] == []
    [finding] = found[30.0]
    assert finding.kind == det.POWER and finding.severity is Severity.WARNING
    assert finding.evidence["enforced_power_limit_watts"] == 400.0
    assert finding.evidence["default_power_limit_watts"] == 700.0
    assert finding.evidence["reason_sw_power_cap"] == 1.0
    message = finding.message
    assert "its power limit is set below the board's default" in message
    assert "drawing 399 W of an enforced 400 W, below the board's 700 W default limit" in message
    assert "SM clock 1410 MHz, 71% of its 1980 MHz applications clock" in message
    assert "100 % utilisation" in message


def test_a_cap_is_judged_against_the_management_limit_when_no_default_is_answered() -> None:
    power = Power(draw_watts=399.0, limit_watts=700.0, enforced_limit_watts=400.0)
    [finding] = run_slowdown(Node(), range(0, 31), CLOCK_EVENT_SW_POWER_CAP, power=power)[30.0]
    assert "below the board's 700 W management limit: a lower cap is set" in finding.message


def test_a_clock_far_below_the_applications_clock_at_the_default_limit() -> None:
    found = run_slowdown(
        Node(), range(0, 31), CLOCK_EVENT_SW_POWER_CAP, power=AT_DEFAULT, sm_mhz=900
    )
    [finding] = found[30.0]
    assert finding.kind == det.POWER
    assert finding.evidence["sm_clock_fraction"] == pytest.approx(900 / 1980)
    assert finding.evidence["power_clock_fraction"] == 0.5
    message = finding.message
    assert "its SM clock is below 50% of its applications clock at its default power limit" in (
        message
    )
    assert "SM clock 900 MHz, 45% of its 1980 MHz applications clock" in message
    assert "100 % utilisation" in message and "lower cap" not in message


def test_the_clock_fraction_is_configured_and_a_clock_above_it_is_healthy() -> None:
    # 1,000 MHz is 51 % of 1,980: above the default half, below a stated 60 %.
    kwargs = {"power": AT_DEFAULT, "sm_mhz": 1000}
    assert run_slowdown(Node(), range(0, 60), CLOCK_EVENT_SW_POWER_CAP, **kwargs)[59.0] == []
    config = from_mapping({"detectors": {"gpu_health": {"power_clock_fraction": 0.6}}})
    found = run_slowdown(Node(config), range(0, 31), CLOCK_EVENT_SW_POWER_CAP, **kwargs)
    assert kinds(found[30.0]) == [det.POWER]


def test_no_applications_clock_answered_judges_only_the_limit() -> None:
    found = run_slowdown(
        Node(),
        range(0, 60),
        CLOCK_EVENT_SW_POWER_CAP,
        power=AT_DEFAULT,
        sm_mhz=500,
        applications_sm_mhz=None,
    )
    assert all(f == [] for f in found.values())


def test_power_reasons_while_idle_are_no_finding() -> None:
    found = run_slowdown(Node(), range(0, 60), CLOCK_EVENT_SW_POWER_CAP, util=10, power=CAPPED)
    assert all(f == [] for f in found.values())


def test_hw_slowdown_whatever_the_load() -> None:
    idle = run_slowdown(Node(), range(0, 31), CLOCK_EVENT_HW_SLOWDOWN, util=0)
    assert idle[29.0] == []
    [finding] = idle[30.0]
    assert finding.kind == det.HW_SLOWDOWN and finding.severity is Severity.CRITICAL
    assert "hardware slowdown on GPU 0 (0000:18:00.0) while idle for 30 s: hw_slowdown" in (
        finding.message
    )
    busy = run_slowdown(Node(), range(0, 31), CLOCK_EVENT_HW_SLOWDOWN)
    assert "under load" in busy[30.0][0].message


def test_a_hardware_power_brake_is_one_hardware_finding() -> None:
    # The power brake is both a power and a hardware reason: under load it is reported once,
    # as the hardware slowdown, not as a power slowdown beside it.
    reasons = CLOCK_EVENT_HW_POWER_BRAKE_SLOWDOWN
    found = run_slowdown(Node(), range(0, 31), reasons, power=Power(350.0, 700.0, 700.0, 700.0))
    [finding] = found[30.0]
    assert finding.kind == det.HW_SLOWDOWN and "hw_power_brake_slowdown" in finding.message
    assert "drawing 350 W" in finding.message
    # With the driver's own cap under a lowered limit as well: still one finding, the
    # hardware one, naming both reasons.
    both = run_slowdown(Node(), range(0, 31), reasons | CLOCK_EVENT_SW_POWER_CAP, power=CAPPED)[
        30.0
    ]
    [finding] = both
    assert finding.kind == det.HW_SLOWDOWN
    assert finding.evidence["reason_hw_power_brake_slowdown"] == 1.0
    assert finding.evidence["reason_sw_power_cap"] == 1.0
    assert "sw_power_cap, hw_power_brake_slowdown" in finding.message


def test_one_thermal_fault_is_one_finding_with_every_reason() -> None:
    # Heat past the board's limit sets the hardware thermal reason and the driver's own:
    # one fault, one finding, the hardware kind, every reason in its evidence.
    reasons = (
        CLOCK_EVENT_HW_SLOWDOWN | CLOCK_EVENT_HW_THERMAL_SLOWDOWN | CLOCK_EVENT_SW_THERMAL_SLOWDOWN
    )
    found = run_slowdown(Node(), range(0, 45), reasons, temps=HOT, sm_mhz=990)
    assert all(found[t] == [] for t in range(0, 30))
    for t in range(30, 45):
        [finding] = found[float(t)]
        assert finding.kind == det.HW_SLOWDOWN and finding.severity is Severity.CRITICAL
    evidence = found[44.0][0].evidence
    for name in ("hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown"):
        assert evidence[f"reason_{name}"] == 1.0
    assert evidence["clock_event_reasons"] == float(reasons)
    message = found[44.0][0].message
    assert "hw_slowdown, sw_thermal_slowdown, hw_thermal_slowdown" in message
    assert "GPU at 89 °C against a slowdown threshold of 87 °C" in message


def test_a_driver_reason_held_longer_than_a_hardware_one_keeps_its_kind_until_both_hold() -> None:
    # The driver's thermal slowdown from t=0, the board's from t=20: thermal from t=30, the
    # hardware kind (naming both) from t=50, never both at once.
    node = Node()
    found = run_slowdown(node, range(0, 20), CLOCK_EVENT_SW_THERMAL_SLOWDOWN, temps=HOT)
    both = CLOCK_EVENT_SW_THERMAL_SLOWDOWN | CLOCK_EVENT_HW_THERMAL_SLOWDOWN
    found.update(run_slowdown(node, range(20, 55), both, temps=HOT))
    assert all(found[t] == [] for t in range(0, 30))
    assert all(kinds(found[float(t)]) == [det.THERMAL] for t in range(30, 50))
    assert all(kinds(found[float(t)]) == [det.HW_SLOWDOWN] for t in range(50, 55))


def test_slowdowns_of_two_gpus_are_held_apart() -> None:
    node = Node()
    found: dict[float, list[Finding]] = {}
    for t in range(0, 46):
        read_at = 1000.0 + t - t % 5
        gpu1_reasons = CLOCK_EVENT_SW_THERMAL_SLOWDOWN if t >= 15 else 0
        data = nvml(
            health(0, read_at, reasons=CLOCK_EVENT_SW_THERMAL_SLOWDOWN),
            health(1, read_at, reasons=gpu1_reasons),
            samples=(sample(0, util=100), sample(1, util=100)),
        )
        found[float(t)] = node.at(float(t), data)
    assert [f.subjects["gpu"] for f in found[30.0]] == ["0"]
    assert sorted(f.subjects["gpu"] for f in found[45.0]) == ["0", "1"]


def test_no_clock_reasons_answered_is_no_finding() -> None:
    node = Node()
    for t in range(0, 40):
        h = health(read_at=1000.0 + t - t % 5, reasons=None)
        assert node.at(float(t), nvml(h, samples=(sample(util=100),))) == []


# --- the fabric ------------------------------------------------------------------------------


def run_fabric(node: Node, seconds: range, fabric: Fabric) -> dict[float, list[Finding]]:
    out = {}
    for t in seconds:
        h = health(read_at=1000.0 + t - t % 5, fabric=fabric)
        out[float(t)] = node.at(float(t), nvml(h))
    return out


def test_fabric_registration_unfinished_past_the_grace(job_on_gpu0: None) -> None:
    found = run_fabric(Node(), range(0, 62), Fabric(FABRIC_STATE_IN_PROGRESS, None, 0, None, None))
    assert all(found[t] == [] for t in range(0, 61))
    [finding] = found[61.0]
    assert finding.kind == det.FABRIC and finding.severity is Severity.CRITICAL
    assert finding.subjects == {"gpu": "0"}
    assert finding.evidence["registration_pending_seconds"] == 61.0
    assert "registration in_progress for 61 s" in finding.message
    assert "used by job 81790" in finding.message


def test_fabric_registration_completed_within_the_grace_is_no_finding() -> None:
    node = Node()
    pending = Fabric(FABRIC_STATE_IN_PROGRESS, None, 0, None, None)
    done = Fabric(FABRIC_STATE_COMPLETED, 0, 7, "cluster", False)
    found = run_fabric(node, range(0, 50), pending)
    found.update(run_fabric(node, range(50, 200), done))
    assert all(f == [] for f in found.values())


def test_fabric_completed_with_an_error_status() -> None:
    [finding] = Node().at(
        0.0, nvml(health(fabric=Fabric(FABRIC_STATE_COMPLETED, 3, 0, None, None)))
    )
    assert finding.kind == det.FABRIC and finding.evidence["fabric_status"] == 3.0
    assert "registration completed with NVML status 3" in finding.message


def test_fabric_bandwidth_degraded() -> None:
    fabric = Fabric(FABRIC_STATE_COMPLETED, 0, 7, "cluster", True)
    [finding] = Node().at(0.0, nvml(health(fabric=fabric)))
    assert finding.kind == det.FABRIC and finding.evidence["bandwidth_degraded"] == 1.0
    assert "bandwidth degraded" in finding.message


def test_a_gpu_without_fabric_support_never_reports() -> None:
    # Whatever the other fields say: the state says there is no fabric to register with.
    fabric = Fabric(FABRIC_STATE_NOT_SUPPORTED, 5, None, None, True)
    found = run_fabric(Node(), range(0, 200), fabric)
    assert all(f == [] for f in found.values())


def test_the_fabric_grace_is_configured() -> None:
    config = from_mapping({"detectors": {"gpu_health": {"fabric_grace_seconds": 5}}})
    found = run_fabric(Node(config), range(0, 7), Fabric(1, None, None, None, None))
    assert found[5.0] == [] and kinds(found[6.0]) == [det.FABRIC]


# --- stale health ----------------------------------------------------------------------------


def test_stale_health_says_nothing() -> None:
    node = Node()
    pending = health(read_at=1000.0, remap=RowRemap(0, 1, True, False))
    # The same read on every record: no new health read for longer than three cadences.
    found = {float(t): node.at(float(t), nvml(pending)) for t in range(0, 20)}
    assert all(kinds(found[t]) == [det.REMAP_PENDING] for t in range(0, int(STALE_AFTER) + 1))
    assert all(found[t] == [] for t in range(int(STALE_AFTER) + 1, 20))
    # A new read is current again.
    assert kinds(node.at(20.0, nvml(replace(pending, read_at=1020.0)))) == [det.REMAP_PENDING]


def test_a_slowdown_on_stale_health_is_not_held() -> None:
    node = Node()
    h = health(read_at=1000.0, reasons=CLOCK_EVENT_HW_SLOWDOWN)
    found = {float(t): node.at(float(t), nvml(h)) for t in range(0, 40)}
    assert all(f == [] for f in found.values())


def test_the_cadence_follows_the_measured_read_interval() -> None:
    # Reads 4 s apart: a health read every 20 s, stale after 60 s.
    node = Node()
    pending = health(read_at=1000.0, remap=RowRemap(0, 1, True, False))
    found = {float(t): node.at(float(t), nvml(pending)) for t in range(0, 80, 4)}
    assert kinds(found[60.0]) == [det.REMAP_PENDING] and found[64.0] == []


def test_the_health_cadence_is_the_nvml_sources() -> None:
    from nodescope.sim.fake_nvml import FakeNvml
    from nodescope.sources import nvml as source

    assert source.NvmlSource(FakeNvml([])).health_every == HEALTH_EVERY


# --- wiring and configuration ----------------------------------------------------------------


def test_registered_with_a_rule_for_every_kind() -> None:
    assert det.detect in [getattr(d.detect, "detect", None) for d in DETECTORS]
    assert set(det.KINDS) <= set(ALERT_RULES)
    for kind in det.KINDS:
        assert ALERT_RULES[kind].for_seconds == 0.0


def test_disabled() -> None:
    config = from_mapping({"detectors": {"gpu_health": {"enabled": False}}})
    assert Node(config).at(0.0, nvml(health(remap=RowRemap(0, 1, True, True)))) == []


@pytest.mark.parametrize(
    "table",
    [
        {"busy_util_percent": 0},
        {"busy_util_percent": 101},
        {"busy_util_percent": "50"},
        {"min_slowdown_seconds": -1},
        {"min_slowdown_seconds": 3601},
        {"fabric_grace_seconds": -0.5},
        {"fabric_grace_seconds": float("inf")},
        {"enabled": 1},
        {"bogus": 1},
    ],
)
def test_bad_gpu_health_tables_are_config_errors(table: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match=r"detectors\.gpu_health"):
        from_mapping({"detectors": {"gpu_health": table}})


def test_defaults() -> None:
    settings = default_config().detectors.gpu_health
    assert settings.enabled and settings.busy_util_percent == 50.0
    assert settings.min_slowdown_seconds == 30.0 and settings.fabric_grace_seconds == 60.0
