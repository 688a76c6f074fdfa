"""A job the prolog gate stopped: its record (written by the prolog, read by the epilog), its
report's verdict and how the report reads."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.hooks.health import Check
from nodescope.hooks.reports import build_report
from nodescope.hooks.request import JobRequest
from nodescope.hooks.stops import (
    GATE_STOP_FORMAT,
    MAX_REASON,
    STALE_SECONDS,
    GateStop,
    checks_of,
    gate_stops_dir,
    parse_gate_stop,
    read_gate_stop,
    remove_gate_stop,
    remove_stale_gate_stops,
    write_gate_stop,
)
from nodescope.roots import Roots
from nodescope_exporters.reports import render_text
from tests.unit.json_strategy import json_values

JOB = JobRequest("42", uid=0, user="root", partition="gpu", gpus=(0, 1))
STOP = GateStop(
    "42",
    1_764_750_000.0,
    "nodescope: expected 8 GPUs, found 2 (NVML)",
    (Check("gpus", False, "expected 8 GPUs, found 2 (NVML)"), Check("xid", True, "no Xid")),
)


def _roots(tmp_path: Path) -> Roots:
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    return Roots(run=run)


def test_a_record_round_trips_and_goes(tmp_path: Path) -> None:
    roots = _roots(tmp_path)
    assert read_gate_stop(roots, "42") is None
    path = write_gate_stop(roots, STOP)
    assert path == gate_stops_dir(roots) / "42.json"
    assert os.stat(path).st_mode & 0o777 == 0o640
    assert read_gate_stop(roots, "42") == STOP
    assert read_gate_stop(roots, "43") is None
    remove_gate_stop(roots, "42")
    remove_gate_stop(roots, "42")  # twice: the epilog may run after a hook did it
    assert read_gate_stop(roots, "42") is None


def test_a_record_that_cannot_be_read_still_says_the_gate_stopped_the_job(tmp_path: Path) -> None:
    roots = _roots(tmp_path)
    write_gate_stop(roots, STOP)
    path = gate_stops_dir(roots) / "42.json"
    for text in ("", "{", "[]", '{"format": "other"}', json.dumps({"format": GATE_STOP_FORMAT})):
        path.write_text(text)
        stop = read_gate_stop(roots, "42")
        assert stop is not None and stop.stopped_at is None and "unreadable" in stop.reason
    # Another job's record under this job's name is not this job's.
    path.write_text(json.dumps({**_document(STOP), "job_id": "41"}))
    stop = read_gate_stop(roots, "42")
    assert stop is not None and "unreadable" in stop.reason
    # A link is never followed, whatever it points at.
    path.unlink()
    secret = tmp_path / "secret"
    secret.write_text(json.dumps(_document(STOP)))
    path.symlink_to(secret)
    stop = read_gate_stop(roots, "42")
    assert stop is not None and "unreadable" in stop.reason
    # Nor is anything too large to be a record read.
    path.unlink()
    path.write_text(" " * (1 << 16) + json.dumps(_document(STOP)))
    stop = read_gate_stop(roots, "42")
    assert stop is not None and "unreadable" in stop.reason


def _document(stop: GateStop) -> dict[str, object]:
    return {"format": GATE_STOP_FORMAT, "job_id": stop.job_id, **stop.as_dict()}


_json = json_values(300)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(max_size=500),
        _json.map(lambda v: json.dumps(v, allow_nan=True)),
        st.fixed_dictionaries(
            {"format": st.just(GATE_STOP_FORMAT), "job_id": st.just("42")},
            optional={"stopped_at": _json, "reason": _json, "checks": _json},
        ).map(json.dumps),
    )
)
def test_any_record_parses_to_one_printable_bounded_stop(text: str) -> None:
    stop = parse_gate_stop("42", text)
    assert stop.job_id == "42"
    assert stop.reason.isprintable() and 0 < len(stop.reason) <= MAX_REASON
    assert stop.stopped_at is None or isinstance(stop.stopped_at, float)
    for check in stop.checks:
        assert isinstance(check.ok, bool) and check.detail.isprintable()
    json.dumps(stop.as_dict(), allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(_json)
def test_checks_of_takes_only_checks(value: object) -> None:
    for check in checks_of(value):
        assert isinstance(check.name, str) and isinstance(check.ok, bool)


def test_a_reason_with_a_newline_is_one_line(tmp_path: Path) -> None:
    roots = _roots(tmp_path)
    write_gate_stop(roots, GateStop("42", 1.0, "nodescope: probe failed:\nline two\x1b[31m"))
    stop = read_gate_stop(roots, "42")
    assert stop is not None and stop.reason == "nodescope: probe failed: line two [31m"


def test_only_old_records_are_swept(tmp_path: Path) -> None:
    roots = _roots(tmp_path)
    assert remove_stale_gate_stops(roots) == []  # no directory yet
    write_gate_stop(roots, STOP)
    write_gate_stop(roots, GateStop("43", 2.0, "nodescope: old"))
    old = gate_stops_dir(roots) / "43.json"
    now = os.stat(old).st_mtime
    os.utime(old, (now - STALE_SECONDS - 1, now - STALE_SECONDS - 1))
    assert remove_stale_gate_stops(roots, now) == ["43.json"]
    assert read_gate_stop(roots, "42") == STOP and read_gate_stop(roots, "43") is None


def test_a_stopped_job_fails_its_verdict_with_the_gates_reason_and_time() -> None:
    report = build_report(JOB, None, {}, 1_764_750_002.0, daemon=True, gate_stop=STOP)
    assert report["verdict"] == {
        "ok": False,
        "reason": "nodescope: the prolog gate stopped job 42: expected 8 GPUs, found 2 (NVML)",
    }
    assert report["gate"] == STOP.as_dict() and report["gate"]["stopped_at"] == STOP.stopped_at
    assert report["start"] == STOP.stopped_at and report["duration_seconds"] == 2.0
    text = render_text(report)
    assert "not run: stopped by the prolog gate at " in text
    assert "gate: nodescope: expected 8 GPUs, found 2 (NVML)" in text
    assert "failed check gpus: expected 8 GPUs, found 2 (NVML)" in text
    assert "failed check xid" not in text
    assert "verdict: FAILED: nodescope: the prolog gate stopped job 42" in text
    assert "ran " not in text and "verdict: ok" not in text


def test_gpus_still_held_are_the_verdicts_reason_before_the_gate() -> None:
    holders = [{"pid": 9, "gpu": 0, "comm": "python"}]
    report = build_report(JOB, None, {}, 1.0, daemon=True, holders=holders, gate_stop=STOP)
    assert report["verdict"]["reason"].startswith("nodescope: job 42 GPU(s) still held")


def test_a_job_that_ran_has_no_gate_record_and_reads_as_before() -> None:
    registration = {"registered_at": 1_764_750_000.0, "gpus": [0, 1]}
    report = build_report(JOB, registration, {}, 1_764_750_060.0, daemon=True)
    assert report["gate"] is None and report["verdict"] == {"ok": True, "reason": None}
    text = render_text(report)
    assert "ran " in text and "(1 min 0 s)" in text and "verdict: ok" in text


def test_a_hostile_report_still_renders() -> None:
    report = build_report(JOB, None, {}, 1.0, daemon=False, gate_stop=STOP)
    for spoiled in (
        {**report, "start": "yesterday", "end": True, "duration_seconds": float("nan")},
        {**report, "gate": {"stopped": True, "stopped_at": "x", "checks": [1, {"ok": False}]}},
        {**report, "gate": "stopped"},
    ):
        render_text(spoiled)
