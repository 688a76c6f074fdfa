"""The NVLink pieces wired into the daemon: the detector in the registry with its
``[detectors.nvlink]`` table, the one rule for ``nodescope_nvlink_data_source_info``, and the
demo view's rows for the nvlink_counter module.
"""

from __future__ import annotations

import pytest

from nodescope.assembly import default_config, from_mapping
from nodescope.config import NvlinkSettings
from nodescope.detectors import nvlink as det
from nodescope.detectors.registry import ALERT_RULES, DETECTORS
from nodescope.errors import ConfigError
from nodescope.kmod_abi import parse_snapshot
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.roots import Roots
from nodescope.sim.driver import nvlink_kmod_view
from nodescope.sim.fake_nvml import FakeNvml, hgx_h100
from nodescope.sim.kmod import SimulatedModule
from nodescope.sim.scenario import load_scenario
from nodescope.sources import nvml as nv
from nodescope.sources.nvlink_kmod import NvlinkKmodData
from nodescope_exporters.gpu_metrics import nvlink_data_source
from nodescope_exporters.prometheus import render

NO_FILES = Roots.under("/nonexistent-nodescope-root")
PATH = "/dev/nvlink_stats"


def _pair(t0: float, t1: float) -> tuple[NvlinkKmodData, NvlinkKmodData]:
    """Two reads of the nvlink-stall-bursts module at simulated seconds ``t0`` and ``t1``."""
    scenario = load_scenario("nvlink-stall-bursts")
    module = SimulatedModule(scenario.hardware, scenario.timeline)
    a, b = (parse_snapshot(module.snapshot(t)) for t in (t0, t1))
    return NvlinkKmodData(PATH, "file", a), NvlinkKmodData(PATH, "file", b)


def _snapshot(
    t0: float, t1: float, kmod: tuple[NvlinkKmodData, NvlinkKmodData] | None, nvml: object = None
) -> Snapshot:
    current: dict[str, SourceSample] = {}
    previous: dict[str, SourceSample] = {}
    if kmod is not None:
        previous["nvlink_kmod"] = SourceSample("nvlink_kmod", t0, 0.0, kmod[0])
        current["nvlink_kmod"] = SourceSample("nvlink_kmod", t1, 0.0, kmod[1])
    if nvml is not None:
        current["nvml"] = SourceSample("nvml", t1, 0.0, nvml)
    return Snapshot(1, t1, t1, current=current, previous=previous)


def test_the_detector_is_registered() -> None:
    assert det.detect in [getattr(d.detect, "detect", None) for d in DETECTORS]
    assert ALERT_RULES[det.GONE].for_seconds == 0.0


def test_thresholds_come_from_the_detectors_nvlink_table() -> None:
    pair = _pair(10.0, 11.0)
    snapshot = _snapshot(10.0, 11.0, pair)

    def table(**options: object) -> NvlinkSettings:
        # Stalls reported at once: the bands are under test here, not the minimum duration.
        options = {"min_stall_seconds": 0, **options}
        return from_mapping({"detectors": {"nvlink": options}}).detectors.nvlink

    # Defaults: 450 cycles/µs on average is normal, the 2,250 peaks are bursts.
    assert {f.kind for f in det.detect(None, snapshot, table())} == {det.STALL_BURST}
    # A warning band from 400 makes the average itself a finding.
    found = det.detect(None, snapshot, table(stall_warning_cycles_per_us=400))
    assert {f.kind for f in found} == {det.STALL} and len(found) == 5
    assert det.detect(None, snapshot, table(enabled=False)) == []
    # Peaks up to 3,000 are no longer over the critical bound: no burst finding.
    assert det.detect(None, snapshot, table(stall_critical_cycles_per_us=3000)) == []
    # The default minimum duration: a burst seen in one snapshot only is not yet a finding.
    assert det.detect(None, snapshot, default_config().detectors.nvlink) == []


@pytest.mark.parametrize(
    "table",
    [
        {"stall_warning_cycles_per_us": 3000},
        {"utilisation_warning_ratio": 0.95},
        {"utilisation_critical_ratio": -1},
        {"burst_findings": 1},
        {"bogus": 1},
    ],
)
def test_bad_nvlink_tables_are_config_errors(table: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match=r"detectors\.nvlink"):
        from_mapping({"detectors": {"nvlink": table}})


def test_one_rule_says_which_source_served_nvlink() -> None:
    nvml = nv.NvmlSource(FakeNvml(hgx_h100(2)), watch_xids=False).collect(NO_FILES)
    no_links = nv.NvmlSource(FakeNvml(hgx_h100(1, links=0)), watch_xids=False).collect(NO_FILES)
    serving = _pair(1.0, 2.0)
    absent = NvlinkKmodData(PATH, "absent", None)
    assert nvlink_data_source(_snapshot(1.0, 2.0, serving, nvml)) == "kmod"
    assert nvlink_data_source(_snapshot(1.0, 2.0, serving)) == "kmod"
    assert nvlink_data_source(_snapshot(1.0, 2.0, (absent, absent), nvml)) == "nvml"
    assert nvlink_data_source(_snapshot(1.0, 2.0, None, nvml)) == "nvml"
    assert nvlink_data_source(_snapshot(1.0, 2.0, (absent, absent), no_links)) is None
    assert nvlink_data_source(_snapshot(1.0, 2.0, None)) is None
    # One family, one series, whichever areas have data.
    text = render(_snapshot(1.0, 2.0, serving, nvml)).decode()
    lines = [x for x in text.splitlines() if x.startswith("nodescope_nvlink_data_source_info")]
    assert lines == ['nodescope_nvlink_data_source_info{source="kmod"} 1.0']


def test_the_demo_view_shows_the_modules_peaks() -> None:
    pair = _pair(10.0, 11.0)
    rows = nvlink_kmod_view(_snapshot(10.0, 11.0, pair))
    assert "100 µs samples" in rows[0]
    gpu5 = next(r for r in rows if r.split()[:2] == ["5", "18"])
    gpu0 = next(r for r in rows if r.split()[:2] == ["0", "18"])
    # TX GB/s (18 links x 4 GB/s), average and peak utilisation, stall average and peak,
    # share of samples over the module's threshold.
    assert gpu5.split()[2:] == ["72.00", "72.00", "16%", "80%", "450", "2250", "20%"]
    assert gpu0.split()[2:] == ["72.00", "72.00", "16%", "80%", "0", "0", "0%"]
    assert nvlink_kmod_view(_snapshot(10.0, 11.0, None)) == []
