"""GPU health series from ``NvmlData.health`` records built directly: base units, no series for
an unanswered value, every clock-event reason and fabric state as 0/1, and promtool's lint."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

from nodescope.model import gpu_health as gh
from nodescope.model.nvml import NvmlData
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope_exporters import gpu_metrics
from nodescope_exporters.catalog import CATALOG
from nodescope_exporters.prometheus import render
from tests.unit.gpu_helpers import gpu_health, gpu_sample, nvml_data

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def address(index: int) -> str:
    return f"0000:{0x19 + index:02x}:00.0"


def health(index: int = 0) -> gh.GpuHealth:
    """An H100 under a job that its power cap holds back, with a pending remap."""
    return gpu_health(
        index,
        address(index),
        1_796_000_123.5,
        ecc=gh.EccErrors(
            volatile_corrected=7,
            volatile_uncorrected=1,
            aggregate_corrected=42,
            aggregate_uncorrected=3,
        ),
        retired_pages=gh.RetiredPages(single_bit_ecc=2, double_bit_ecc=1, pending=True),
        row_remap=gh.RowRemap(correctable=5, uncorrectable=1, pending=True, failed=False),
        temperatures=gh.Temperatures(
            gpu=71, memory=80, slowdown=87, shutdown=92, gpu_max=85, memory_max=95
        ),
        power=gh.Power(
            draw_watts=689.5,
            limit_watts=700.0,
            enforced_limit_watts=650.0,
            default_limit_watts=700.0,
        ),
        clocks=gh.Clocks(
            sm_mhz=1755,
            memory_mhz=2619,
            event_reasons=gh.CLOCK_EVENT_SW_POWER_CAP | gh.CLOCK_EVENT_HW_SLOWDOWN,
            applications_sm_mhz=1980,
        ),
        framebuffer=gh.FrameBuffer(used_bytes=60 * 1024**3, total_bytes=80 * 1024**3),
        fabric=gh.Fabric(
            state=gh.FABRIC_STATE_COMPLETED,
            status=gh.NVML_SUCCESS,
            clique_id=7,
            cluster_uuid="5f2d6c1a-0000-4000-8000-00000000abcd",
            bandwidth_degraded=True,
        ),
        gpm=gh.Gpm(
            window_seconds=30.0,
            sm_activity_percent=87.5,
            tensor_activity_percent=50.0,
            dram_bandwidth_percent=25.0,
            nvlink_tx_bytes_per_second=3e11,
            nvlink_rx_bytes_per_second=2.5e11,
            pcie_tx_bytes_per_second=1e9,
            pcie_rx_bytes_per_second=2e9,
        ),
        unsupported=("nvmlDeviceGetRetiredPages_v2",),
    )


def bare(index: int = 0) -> gh.GpuHealth:
    """A GPU that answered none of the health calls."""
    return gpu_health(index, address(index), 1_796_000_000.0)


def data(*records: gh.GpuHealth, gpus: tuple[int, ...] | None = None) -> NvmlData:
    listed = tuple(r.index for r in records) if gpus is None else gpus
    return nvml_data(tuple(gpu_sample(i, address(i)) for i in listed), records)


def exposition(record: NvmlData) -> str:
    snapshot = Snapshot(
        cycle=1,
        monotonic=1.0,
        wall_time=0.0,
        current={"nvml": SourceSample("nvml", 1.0, 0.0, record)},
    )
    return render(snapshot, [gpu_metrics.families]).decode()


def series(record: NvmlData) -> Series:
    out: Series = {}
    for family in text_string_to_metric_families(exposition(record)):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out, f"duplicate series {key}"
            out[key] = s.value
    return out


def value(s: Series, name: str, **labels: str) -> float:
    return s[(name, tuple(sorted(labels.items())))]


def by_label(s: Series, name: str, label: str) -> dict[str, float]:
    """The values of the series ``name`` by the value of their label ``label``."""
    return {dict(labels)[label]: v for (n, labels), v in s.items() if n == name}


#: The series names of the health families.
HEALTH_NAMES = frozenset(f.sample_name for f in gpu_metrics._HealthSeries().families())


def health_names(s: Series) -> set[str]:
    return {name for name, _ in s} & HEALTH_NAMES


def test_every_figure_lands_in_its_series_in_base_units() -> None:
    s = series(data(health()))
    ecc = "nodescope_gpu_ecc_errors_total"
    assert value(s, ecc, gpu="0", type="corrected", counter="volatile") == 7
    assert value(s, ecc, gpu="0", type="uncorrected", counter="volatile") == 1
    assert value(s, ecc, gpu="0", type="corrected", counter="aggregate") == 42
    assert value(s, ecc, gpu="0", type="uncorrected", counter="aggregate") == 3
    assert value(s, "nodescope_gpu_retired_pages", gpu="0", cause="single_bit_ecc") == 2
    assert value(s, "nodescope_gpu_retired_pages", gpu="0", cause="double_bit_ecc") == 1
    assert value(s, "nodescope_gpu_retired_pages_pending", gpu="0") == 1
    assert value(s, "nodescope_gpu_remapped_rows", gpu="0", type="correctable") == 5
    assert value(s, "nodescope_gpu_remapped_rows", gpu="0", type="uncorrectable") == 1
    assert value(s, "nodescope_gpu_row_remap_pending", gpu="0") == 1
    assert value(s, "nodescope_gpu_row_remap_failed", gpu="0") == 0
    temp, threshold = (
        "nodescope_gpu_temperature_celsius",
        "nodescope_gpu_temperature_threshold_celsius",
    )
    assert value(s, temp, gpu="0", sensor="gpu") == 71
    assert value(s, temp, gpu="0", sensor="memory") == 80
    assert value(s, threshold, gpu="0", threshold="slowdown") == 87
    assert value(s, threshold, gpu="0", threshold="shutdown") == 92
    assert value(s, threshold, gpu="0", threshold="gpu_max") == 85
    assert value(s, threshold, gpu="0", threshold="memory_max") == 95
    assert value(s, "nodescope_gpu_power_watts", gpu="0") == 689.5
    assert value(s, "nodescope_gpu_power_limit_watts", gpu="0", limit="management") == 700
    assert value(s, "nodescope_gpu_power_limit_watts", gpu="0", limit="enforced") == 650
    assert value(s, "nodescope_gpu_power_limit_watts", gpu="0", limit="default") == 700
    assert value(s, "nodescope_gpu_clock_hertz", gpu="0", clock="sm") == 1_755_000_000
    assert value(s, "nodescope_gpu_clock_hertz", gpu="0", clock="applications_sm") == 1.98e9
    assert value(s, "nodescope_gpu_clock_hertz", gpu="0", clock="memory") == 2_619_000_000
    assert value(s, "nodescope_gpu_framebuffer_used_bytes", gpu="0") == 60 * 1024**3
    assert value(s, "nodescope_gpu_framebuffer_size_bytes", gpu="0") == 80 * 1024**3
    assert value(s, "nodescope_gpu_fabric_status", gpu="0") == 0
    assert (
        value(
            s,
            "nodescope_gpu_fabric_info",
            gpu="0",
            clique_id="7",
            cluster_uuid="5f2d6c1a-0000-4000-8000-00000000abcd",
        )
        == 1
    )
    assert value(s, "nodescope_gpu_fabric_bandwidth_degraded", gpu="0") == 1
    assert value(s, "nodescope_gpu_gpm_window_seconds", gpu="0") == 30
    assert value(s, "nodescope_gpu_gpm_sm_activity_ratio", gpu="0") == 0.875
    assert value(s, "nodescope_gpu_gpm_tensor_activity_ratio", gpu="0") == 0.5
    assert value(s, "nodescope_gpu_gpm_dram_bandwidth_ratio", gpu="0") == 0.25
    nvlink, pcie = (
        "nodescope_gpu_gpm_nvlink_bytes_per_second",
        "nodescope_gpu_gpm_pcie_bytes_per_second",
    )
    assert value(s, nvlink, gpu="0", direction="tx") == 3e11
    assert value(s, nvlink, gpu="0", direction="rx") == 2.5e11
    assert value(s, pcie, gpu="0", direction="tx") == 1e9
    assert value(s, pcie, gpu="0", direction="rx") == 2e9
    assert value(s, "nodescope_gpu_health_read_timestamp_seconds", gpu="0") == 1_796_000_123.5
    assert (
        value(
            s, "nodescope_gpu_health_unsupported_info", gpu="0", call="nvmlDeviceGetRetiredPages_v2"
        )
        == 1
    )


def test_every_clock_event_reason_has_a_series_set_only_for_the_bits_in_the_mask() -> None:
    s = series(data(health()))
    reasons = by_label(s, "nodescope_gpu_clock_event_reason", "reason")
    assert set(reasons) == set(gh.CLOCK_EVENT_REASONS.values())
    assert {r for r, v in reasons.items() if v == 1} == {"sw_power_cap", "hw_slowdown"}
    assert all(v in (0, 1) for v in reasons.values())

    # The cap lifts: its series reads 0 rather than vanishing.
    cleared = dataclasses.replace(
        health(), clocks=gh.Clocks(sm_mhz=1980, memory_mhz=2619, event_reasons=0)
    )
    after = series(data(cleared))
    assert value(after, "nodescope_gpu_clock_event_reason", gpu="0", reason="sw_power_cap") == 0
    # Bits no known reason has (a newer driver's) make no series of their own.
    unknown = dataclasses.replace(
        health(), clocks=gh.Clocks(sm_mhz=None, memory_mhz=None, event_reasons=1 << 40)
    )
    odd = series(data(unknown))
    values = [v for (name, _), v in odd.items() if name == "nodescope_gpu_clock_event_reason"]
    assert len(values) == len(gh.CLOCK_EVENT_REASONS) and set(values) == {0}
    assert not any(name == "nodescope_gpu_clock_hertz" for name, _ in odd)


def test_fabric_state_is_one_for_the_current_state_only() -> None:
    s = series(data(health()))
    states = by_label(s, "nodescope_gpu_fabric_state", "state")
    assert states == {"not_supported": 0, "not_started": 0, "in_progress": 0, "completed": 1}

    stuck = dataclasses.replace(
        health(),
        fabric=gh.Fabric(
            state=gh.FABRIC_STATE_IN_PROGRESS,
            status=None,
            clique_id=None,
            cluster_uuid=None,
            bandwidth_degraded=None,
        ),
    )
    s = series(data(stuck))
    assert value(s, "nodescope_gpu_fabric_state", gpu="0", state="in_progress") == 1
    assert value(s, "nodescope_gpu_fabric_state", gpu="0", state="completed") == 0
    for name in (
        "nodescope_gpu_fabric_status",
        "nodescope_gpu_fabric_info",
        "nodescope_gpu_fabric_bandwidth_degraded",
    ):
        assert not any(n == name for n, _ in s), name

    newer = dataclasses.replace(
        health(),
        fabric=gh.Fabric(
            state=9, status=0, clique_id=1, cluster_uuid=None, bandwidth_degraded=False
        ),
    )
    s = series(data(newer))
    states = by_label(s, "nodescope_gpu_fabric_state", "state")
    assert states == {
        "not_supported": 0,
        "not_started": 0,
        "in_progress": 0,
        "completed": 0,
        "state_9": 1,
    }
    assert value(s, "nodescope_gpu_fabric_bandwidth_degraded", gpu="0") == 0


def test_a_gpu_off_the_fabric_has_no_registration_series() -> None:
    pcie_card = dataclasses.replace(
        health(),
        fabric=gh.Fabric(
            state=gh.FABRIC_STATE_NOT_SUPPORTED,
            status=gh.NVML_SUCCESS,
            clique_id=0,
            cluster_uuid=None,
            bandwidth_degraded=None,
        ),
    )
    s = series(data(pcie_card))
    assert value(s, "nodescope_gpu_fabric_state", gpu="0", state="not_supported") == 1
    assert not any(n in ("nodescope_gpu_fabric_status", "nodescope_gpu_fabric_info") for n, _ in s)


def test_values_the_gpu_did_not_answer_have_no_series() -> None:
    s = series(data(bare()))
    assert health_names(s) == {"nodescope_gpu_health_read_timestamp_seconds"}

    partial = dataclasses.replace(
        health(),
        ecc=gh.EccErrors(None, 4, None, None),
        retired_pages=gh.RetiredPages(None, None, None),
        row_remap=gh.RowRemap(None, None, None, True),
        temperatures=gh.Temperatures(66, None, None, None, None, None),
        power=gh.Power(None, None, 300.0),
        clocks=gh.Clocks(None, 1593, None),
        framebuffer=gh.FrameBuffer(None, 16 * 1024**3),
        gpm=gh.Gpm(1.0, None, None, None, None, None, None, None),
        fabric=None,
        unsupported=(),
    )
    s = series(data(partial))
    ecc = [labels for name, labels in s if name == "nodescope_gpu_ecc_errors_total"]
    assert ecc == [(("counter", "volatile"), ("gpu", "0"), ("type", "uncorrected"))]
    temperatures = [labels for name, labels in s if name == "nodescope_gpu_temperature_celsius"]
    assert temperatures == [(("gpu", "0"), ("sensor", "gpu"))]
    assert (
        value(s, "nodescope_gpu_ecc_errors_total", gpu="0", type="uncorrected", counter="volatile")
        == 4
    )
    assert value(s, "nodescope_gpu_row_remap_failed", gpu="0") == 1
    assert value(s, "nodescope_gpu_power_limit_watts", gpu="0", limit="enforced") == 300
    assert value(s, "nodescope_gpu_clock_hertz", gpu="0", clock="memory") == 1_593_000_000
    assert value(s, "nodescope_gpu_framebuffer_size_bytes", gpu="0") == 16 * 1024**3
    assert value(s, "nodescope_gpu_gpm_window_seconds", gpu="0") == 1
    for absent in (
        "nodescope_gpu_retired_pages",
        "nodescope_gpu_retired_pages_pending",
        "nodescope_gpu_remapped_rows",
        "nodescope_gpu_row_remap_pending",
        "nodescope_gpu_temperature_threshold_celsius",
        "nodescope_gpu_power_watts",
        "nodescope_gpu_clock_event_reason",
        "nodescope_gpu_framebuffer_used_bytes",
        "nodescope_gpu_fabric_state",
        "nodescope_gpu_gpm_sm_activity_ratio",
        "nodescope_gpu_gpm_nvlink_bytes_per_second",
        "nodescope_gpu_health_unsupported_info",
    ):
        assert not any(n == absent for n, _ in s), absent


def test_only_gpus_the_record_lists_have_health_series() -> None:
    # GPU 1 was lost after the last health read: its carried figures are not exported.
    s = series(data(health(0), health(1), gpus=(0,)))
    assert {dict(labels)["gpu"] for name, labels in s if name.startswith("nodescope_gpu_")} == {"0"}
    assert health_names(s) == HEALTH_NAMES  # the full record fills every health family
    assert not health_names(series(data(gpus=(0, 1))))


def test_health_families_are_declared_with_the_gpu_labels() -> None:
    names = {
        "nodescope_gpu_ecc_errors_total": ("gpu", "type", "counter"),
        "nodescope_gpu_clock_event_reason": ("gpu", "reason"),
        "nodescope_gpu_fabric_state": ("gpu", "state"),
        "nodescope_gpu_health_read_timestamp_seconds": ("gpu",),
    }
    for name, labels in names.items():
        assert CATALOG[name].labels == labels
        assert CATALOG[name].area == gpu_metrics.AREA
    assert CATALOG["nodescope_gpu_ecc_errors_total"].kind == "counter"
    assert "driver reloads" in CATALOG["nodescope_gpu_ecc_errors_total"].help


def test_promtool_accepts_the_health_series() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed (scripts/test.sh installs Debian's prometheus)")
    text = exposition(data(health(0), dataclasses.replace(health(1), gpm=None)))
    assert "nodescope_gpu_clock_event_reason{" in text
    lint = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
