"""The collectives detector: δ and waits against the configured bounds, the straggler rank in
the message, one finding per job and kind, nothing without the ``traces`` source; and the
exporter's series for the same record (bounded labels, ranks as values)."""

from __future__ import annotations

from nodescope.assembly import from_mapping
from nodescope.config import CollectivesSettings
from nodescope.detectors import collectives
from nodescope.detectors.registry import ALERT_RULES, DETECTORS
from nodescope.model.collectives import JobCollectives, KindFigures, TracesData
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope_exporters import collective_metrics


def _job(job_id: str, *kinds: KindFigures) -> JobCollectives:
    return JobCollectives(job_id, 4, 0, (0, 1, 2, 3), kinds, None, None, 0.0, 1.0)


def _snapshot(*jobs: JobCollectives) -> Snapshot:
    data = TracesData("/spool", jobs, 4, 0, 0)
    return Snapshot(1, 1.0, 1.0, current={"traces": SourceSample("traces", 1.0, 0.0, data)})


def _config(**detector: float) -> CollectivesSettings:
    return from_mapping({"detectors": {"collectives": dict(detector)}}).detectors.collectives


def test_skew_above_the_bound_is_a_finding_naming_job_and_kind() -> None:
    snapshot = _snapshot(
        _job("11", KindFigures("all_to_all", 0.4874, None, 0.0)),
        _job("12", KindFigures("all_to_all", 0.62, None, 0.0)),
    )
    (found,) = collectives.detect(None, snapshot, _config())
    assert found.kind == collectives.SKEW
    assert dict(found.subjects) == {"job": "12", "kind": "all_to_all"}
    assert "δ = 0.62" in found.message and found.evidence["value"] == 0.62
    # A lower bound takes the first job too.
    lowered = collectives.detect(None, snapshot, _config(max_skew=0.4))
    assert sorted(f.subjects["job"] for f in lowered) == ["11", "12"]


def test_a_wait_above_the_bound_names_the_straggler_rank() -> None:
    snapshot = _snapshot(
        _job(
            "20",
            KindFigures("all_reduce", None, 3, 0.21),
            KindFigures("all_to_all", 0.1, 1, 0.004),
        )
    )
    assert collectives.detect(None, snapshot, _config()) == []
    (found,) = collectives.detect(None, snapshot, _config(max_wait_seconds=0.1))
    assert found.kind == collectives.STRAGGLER
    assert dict(found.subjects) == {"job": "20", "kind": "all_reduce"}
    assert "rank 3" in found.message and found.evidence["straggler_rank"] == 3.0
    # The rank is evidence and message, never identity: another rank is the same finding.
    other = _snapshot(_job("20", KindFigures("all_reduce", None, 1, 0.3)))
    (moved,) = collectives.detect(None, other, _config(max_wait_seconds=0.1))
    assert moved.key == found.key and "rank 1" in moved.message


def test_disabled_or_without_the_source_nothing_is_found() -> None:
    snapshot = _snapshot(_job("1", KindFigures("all_to_all", 5.0, 0, 9.0)))
    assert collectives.detect(None, snapshot, _config(enabled=False)) == []
    assert len(collectives.detect(None, snapshot, _config())) == 2
    assert collectives.detect(None, Snapshot(1, 1.0, 1.0), _config()) == []


def test_registered_with_rules_that_fire_at_once() -> None:
    assert "collectives" in [d.name for d in DETECTORS]
    for kind in (collectives.SKEW, collectives.STRAGGLER):
        assert ALERT_RULES[kind].for_seconds == 0.0


def test_exported_series_carry_job_and_kind_and_ranks_as_values() -> None:
    snapshot = _snapshot(
        _job("5", KindFigures("all_to_all", 0.5, 2, 0.01), KindFigures("all_reduce", None, 3, 0.2))
    )
    families = {f.name: f for f in collective_metrics.families(snapshot)}
    skew = families["nodescope_job_collective_skew"]
    assert list(zip(skew.label_values, skew.values, strict=True)) == [(("5", "all_to_all"), 0.5)]
    rank = families["nodescope_job_collective_straggler_rank"]
    assert dict(zip(rank.label_values, rank.values, strict=True)) == {
        ("5", "all_to_all"): 2,
        ("5", "all_reduce"): 3,
    }
    assert all(spec.labels in ((), ("job_id",), ("job_id", "kind")) for spec in (
        collective_metrics.SKEW, collective_metrics.STRAGGLER_RANK, collective_metrics.MAX_WAIT,
        collective_metrics.RANKS, collective_metrics.FILES_ANALYSED,
    ))  # fmt: skip
    assert families["nodescope_collective_trace_files_analysed"].values == [4]
