"""The Xid catalog and the Xid detector: the packaged table loads and every entry is valid,
unknown codes, application Xids never above info, findings per class from hand-made
snapshots (new Xids only, Xid 79 left to the hotplug detector, the job named), the alert
rules, and the two bundled scenarios replayed."""

from __future__ import annotations

import copy
import json
from importlib import resources
from typing import Any

import pytest

from nodescope.assembly import default_config, from_mapping
from nodescope.detectors import xids
from nodescope.detectors.registry import ALERT_RULES, DETECTORS
from nodescope.errors import ParseError
from nodescope.model.finding import Severity
from nodescope.model.jobs import JobView
from nodescope.model.nvml import NVML, NvmlData, XidCount
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.model.xid_catalog import (
    ACTIONS,
    APPLICATION,
    CLASSES,
    KINDS,
    UNKNOWN,
    load_catalog,
    parse_catalog,
)

GPU2 = "0000:4c:00.0"
GPU5 = "0000:bb:00.0"
#: Codes the catalog must cover (the issue's list, as NVIDIA documents them).
REQUIRED = (8, 13, 31, 32, 38, 43, 45, 48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 109,
            119, 120, 121, 140, *range(144, 151))  # fmt: skip


def _document() -> dict[str, Any]:
    text = (resources.files("nodescope") / "data" / "xid_catalog.json").read_text("utf-8")
    document: dict[str, Any] = json.loads(text)
    return document


CATALOG = load_catalog()


# --- the catalog ----------------------------------------------------------------------------


def test_packaged_catalog_covers_the_documented_codes() -> None:
    assert set(REQUIRED) <= set(CATALOG.entries)
    for code in REQUIRED:
        info = CATALOG.lookup(code)
        assert info.known and info.code == code
        assert info.xid_class in CLASSES and info.xid_class != UNKNOWN
        assert info.action in ACTIONS and info.source.startswith("NVIDIA")
        assert info.name


def test_classes_of_well_known_codes() -> None:
    codes = (13, 31, 43, 45, 48, 74, 79, 94, 95, 119, 120, 145)
    classes = {code: CATALOG.lookup(code).xid_class for code in codes}
    assert classes == {
        13: "application", 31: "application", 43: "application", 45: "application",
        48: "memory", 94: "memory", 95: "memory", 74: "nvlink", 145: "nvlink",
        79: "bus", 119: "firmware", 120: "firmware",
    }  # fmt: skip
    assert CATALOG.lookup(48).severity is Severity.CRITICAL
    assert CATALOG.lookup(95).severity is Severity.CRITICAL
    assert CATALOG.lookup(94).severity is Severity.WARNING
    assert CATALOG.lookup(64).action == "replace_gpu"


def test_application_xids_are_never_above_info() -> None:
    apps = [info for info in CATALOG.entries.values() if info.xid_class == APPLICATION]
    assert {13, 31, 43, 45} <= {info.code for info in apps}
    assert all(info.severity is Severity.INFO for info in apps)
    # And the loader refuses a table that would page on one.
    bad = _document()
    entry = next(e for e in bad["entries"] if e["code"] == 13)
    entry["severity"] = "critical"
    with pytest.raises(ParseError, match=r"/entries/\d+/severity: an application Xid"):
        parse_catalog(bad)


def test_unknown_code() -> None:
    info = CATALOG.lookup(9999)
    assert not info.known and info.xid_class == UNKNOWN
    assert info.severity is Severity.WARNING and info.action == "investigate"
    assert info.kind == "gpu_xid_unknown"


@pytest.mark.parametrize(
    ("change", "pointer"),
    [
        (lambda d: d.update(format="other/1"), r"\(document\)"),
        (lambda d: d["entries"][0].update({"class": "cosmic"}), r"/entries/0/class"),
        (lambda d: d["entries"][0].update(severity="fatal"), r"/entries/0/severity"),
        (lambda d: d["entries"][0].update(action="pray"), r"/entries/0/action"),
        (lambda d: d["entries"][0].update(code=True), r"/entries/0/code"),
        (lambda d: d["entries"][0].update(code=0), r"/entries/0/code"),
        (lambda d: d["entries"][0].pop("name"), r"/entries/0/name"),
        (lambda d: d["entries"].append(copy.deepcopy(d["entries"][0])), r"listed twice"),
        (lambda d: d["unknown"].update(severity="loud"), r"/unknown/severity"),
    ],
)
def test_catalog_errors_name_the_entry(change: Any, pointer: str) -> None:
    document = _document()
    change(document)
    with pytest.raises(ParseError, match=pointer):
        parse_catalog(document)


# --- the detector ---------------------------------------------------------------------------


def _nvml(*xid_counts: XidCount) -> NvmlData:
    return NvmlData(
        device_count=8, gpus=(), lost=(), xids=xid_counts, xid_source="nvml-events", events=()
    )


def _snapshot(now: NvmlData, before: NvmlData | None = None, cycle: int = 2) -> Snapshot:
    previous = {} if before is None else {"nvml": SourceSample("nvml", 10.0, 0.01, before)}
    return Snapshot(cycle, 20.0, 1e9, {"nvml": SourceSample("nvml", 20.0, 0.01, now)}, previous)


DETECT = xids.XidDetector(CATALOG)
CONFIG = default_config()


def test_new_xid_is_a_finding_of_its_class_with_the_catalog_severity() -> None:
    before = _nvml(XidCount(2, GPU2, 13, 1))
    now = _nvml(XidCount(2, GPU2, 13, 1), XidCount(2, GPU2, 48, 2))
    [finding] = DETECT(None, _snapshot(now, before), CONFIG.detectors.xids)
    assert finding.kind == "gpu_xid_memory" and finding.severity is Severity.CRITICAL
    assert finding.subjects == {"gpu": "2", "xid": "48"}
    assert finding.evidence["new_xids"] == 2 and finding.evidence["xids_since_start"] == 2
    assert "Xid 48 ×2 on GPU 2 (0000:4c:00.0)" in finding.message
    assert "reset the GPU" in finding.message


def test_a_count_that_did_not_grow_is_no_finding() -> None:
    same = _nvml(XidCount(2, GPU2, 48, 1))
    assert DETECT(None, _snapshot(same, same), CONFIG.detectors.xids) == []


def test_first_read_counts_everything_it_holds() -> None:
    [finding] = DETECT(None, _snapshot(_nvml(XidCount(2, GPU2, 13, 1))), CONFIG.detectors.xids)
    assert finding.kind == "gpu_xid_application" and finding.severity is Severity.INFO


def test_a_restarted_source_counts_from_zero() -> None:
    before = _nvml(XidCount(2, GPU2, 94, 5))
    [finding] = DETECT(
        None, _snapshot(_nvml(XidCount(2, GPU2, 94, 1)), before), CONFIG.detectors.xids
    )
    assert finding.kind == "gpu_xid_memory" and finding.evidence["new_xids"] == 1


def test_xid79_is_left_to_the_hotplug_detector() -> None:
    before = _nvml()
    now = _nvml(XidCount(5, GPU5, 79, 1))
    assert DETECT(None, _snapshot(now, before), CONFIG.detectors.xids) == []


def test_unknown_code_and_unlisted_device() -> None:
    now = _nvml(XidCount(None, "0000:ee:00.0", 4242, 1))
    [finding] = DETECT(None, _snapshot(now, _nvml()), CONFIG.detectors.xids)
    assert finding.kind == "gpu_xid_unknown" and finding.severity is Severity.WARNING
    assert finding.subjects == {"bdf": "0000:ee:00.0", "xid": "4242"}
    assert "investigate" in finding.message


def test_the_job_on_the_gpu_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    views = (JobView("81790", (11,), (2,), (GPU2,), ("mlx5_0",), "NCCL_IB_HCA"),)
    monkeypatch.setattr(xids, "jobs", lambda snapshot: views)
    now = _nvml(XidCount(2, GPU2, 74, 1))
    [finding] = DETECT(None, _snapshot(now, _nvml()), CONFIG.detectors.xids)
    assert finding.kind == "gpu_xid_nvlink"
    assert "used by job 81790" in finding.message
    assert "job" not in finding.subjects  # the identity is the GPU's and the code's


def test_disabled() -> None:
    config = from_mapping({"detectors": {"xids": {"enabled": False}}})
    now = _nvml(XidCount(2, GPU2, 48, 1))
    assert DETECT(None, _snapshot(now, _nvml()), config.detectors.xids) == []


def test_every_kind_has_a_held_alert_rule_and_is_registered() -> None:
    assert any(info.name == "xids" for info in DETECTORS)
    for kind in KINDS:
        rule = ALERT_RULES[kind]
        assert rule.for_seconds == 0.0 and rule.resolve_after_seconds == xids.HOLD_SECONDS


def test_new_xids_uses_the_source_pair() -> None:
    snap = _snapshot(_nvml(XidCount(1, GPU2, 31, 3)), _nvml(XidCount(1, GPU2, 31, 1)))
    assert xids.new_xids(snap) == {(1, GPU2, 31): (2, 3)}
    assert snap.latest(NVML) is not None


def test_the_prolog_gate_default_codes_are_catalogued_hardware_faults() -> None:
    """``[slurm] xid_codes`` is its own list (not derived from the catalog); it must still
    name only codes the catalog knows, and no application fault."""
    for code in default_config().slurm.xid_codes:
        info = CATALOG.lookup(code)
        assert info.known, code
        assert info.xid_class != APPLICATION, code
