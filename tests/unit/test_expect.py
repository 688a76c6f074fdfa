"""The scenario ``expect`` object: parsing, validation errors, exposition reading, evaluation."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.errors import ParseError
from nodescope.model.finding import Finding, Severity
from nodescope.sim.expect import (
    NOT_CHECKABLE,
    Evaluator,
    Expectations,
    FindingExpectation,
    MetricExpectation,
    check_catalog,
    evaluate,
    finding_matches,
    parse_expectations,
    parse_exposition,
)
from nodescope_exporters.catalog import CATALOG
from nodescope_exporters.prometheus import load_areas

SRC = "scenarios/test.json"


def parse(obj: Any) -> Expectations:
    return parse_expectations(obj, SRC)


def error_of(obj: Any) -> ParseError:
    with pytest.raises(ParseError) as info:
        parse(obj)
    return info.value


# --------------------------------------------------------------------------------------------
# Parsing


def test_full_object_parses_with_every_field() -> None:
    e = parse(
        {
            "metrics": [
                {
                    "name": "nodescope_gpu_pcie_rx_bytes_total",
                    "labels": {"gpu": "2"},
                    "aggregate": "rate",
                    "min": 30e9,
                    "max": 45e9,
                    "from": 10,
                    "to": 40.5,
                    "description": "H2D copies of the loader",
                },
                {"name": "nodescope_source_up", "labels": {"source": "nvml"}, "min": 1},
            ],
            "findings": [
                {
                    "kind": "root_port_contention",
                    "subjects": ["0000:16:01.0", "nvme3n1"],
                    "from": 5,
                    "to": 60,
                }
            ],
            "no_other_findings": True,
        }
    )
    assert e.metrics[0] == MetricExpectation(
        name="nodescope_gpu_pcie_rx_bytes_total",
        labels=(("gpu", "2"),),
        aggregate="rate",
        min=30e9,
        max=45e9,
        start=10.0,
        end=40.5,
        description="H2D copies of the loader",
        pointer="/expect/metrics/0",
    )
    second = e.metrics[1]
    assert (second.aggregate, second.min, second.max, second.start, second.end) == (
        "value",
        1.0,
        None,
        0.0,
        None,
    )
    assert e.findings == (
        FindingExpectation(
            "root_port_contention",
            ("0000:16:01.0", "nvme3n1"),
            5.0,
            60.0,
            None,
            "/expect/findings/0",
        ),
    )
    assert e.no_other_findings is True


def test_absent_and_empty_expect_mean_nothing_expected() -> None:
    assert parse(None) == Expectations()
    assert parse({}) == Expectations((), (), False)


def test_labels_are_sorted_so_order_in_the_file_does_not_matter() -> None:
    a = parse({"metrics": [{"name": "m", "labels": {"b": "1", "a": "2"}}]})
    assert a.metrics[0].labels == (("a", "2"), ("b", "1"))


@pytest.mark.parametrize(
    ("obj", "pointer", "words"),
    [
        ([], "/expect", "must be an object"),
        ({"metric": []}, "/expect/metric", "unknown key"),
        ({"metrics": {}}, "/expect/metrics", "must be an array"),
        ({"metrics": [3]}, "/expect/metrics/0", "must be an object"),
        ({"metrics": [{}]}, "/expect/metrics/0/name", "must be a metric name"),
        ({"metrics": [{"name": "no spaces"}]}, "/expect/metrics/0/name", "metric name"),
        ({"metrics": [{"name": "m", "minimum": 1}]}, "/expect/metrics/0/minimum", "unknown"),
        ({"metrics": [{"name": "m", "labels": []}]}, "/expect/metrics/0/labels", "object"),
        (
            {"metrics": [{"name": "m", "labels": {"gpu": 2}}]},
            "/expect/metrics/0/labels/gpu",
            'write "2"',
        ),
        (
            {"metrics": [{"name": "m", "labels": {"1x": "a"}}]},
            "/expect/metrics/0/labels/1x",
            "not a label name",
        ),
        ({"metrics": [{"name": "m", "aggregate": "sum"}]}, "/expect/metrics/0/aggregate", "one of"),
        ({"metrics": [{"name": "m", "min": "1"}]}, "/expect/metrics/0/min", "finite number"),
        ({"metrics": [{"name": "m", "max": True}]}, "/expect/metrics/0/max", "finite number"),
        ({"metrics": [{"name": "m", "max": None}]}, "/expect/metrics/0/max", "finite number"),
        ({"findings": [{"kind": "k", "from": None}]}, "/expect/findings/0/from", "finite number"),
        ({"metrics": [{"name": "m", "min": 2, "max": 1}]}, "/expect/metrics/0/max", ">= min"),
        ({"metrics": [{"name": "m", "from": -1}]}, "/expect/metrics/0/from", ">= 0"),
        ({"metrics": [{"name": "m", "from": 5, "to": 4}]}, "/expect/metrics/0/to", ">= from"),
        ({"metrics": [{"name": "m", "description": 1}]}, "/expect/metrics/0/description", "string"),
        (
            {"findings": [{"kind": "k", "description": None}]},
            "/expect/findings/0/description",
            "string",
        ),
        ({"findings": [{"subjects": []}]}, "/expect/findings/0/kind", "non-empty string"),
        ({"findings": [{"kind": "k", "subjects": "gpu0"}]}, "/expect/findings/0/subjects", "array"),
        ({"findings": [{"kind": "k", "subjects": [""]}]}, "/expect/findings/0/subjects/0", "empty"),
        ({"findings": [{"kind": "k", "to": 1, "from": 2}]}, "/expect/findings/0/to", ">= from"),
        ({"no_other_findings": "yes"}, "/expect/no_other_findings", "true or false"),
    ],
)
def test_errors_name_the_file_and_the_json_pointer(obj: Any, pointer: str, words: str) -> None:
    err = error_of(obj)
    assert err.source == SRC
    assert str(err).startswith(f"{SRC}: {pointer}: ")
    assert words in str(err)


def test_non_finite_bounds_are_rejected() -> None:
    assert "finite" in str(error_of({"metrics": [{"name": "m", "max": float("inf")}]}))
    assert "finite" in str(error_of({"metrics": [{"name": "m", "min": float("nan")}]}))


def test_pointer_prefix_follows_the_caller() -> None:
    with pytest.raises(ParseError, match=r"/scenario/expect/metrics/0/name"):
        parse_expectations({"metrics": [{}]}, SRC, "/scenario/expect")


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=8)
    | st.sampled_from(["m", "value", "rate", "gpu", "name", "min", "max", "from", "to"]),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "metrics",
                    "findings",
                    "no_other_findings",
                    "name",
                    "labels",
                    "aggregate",
                    "min",
                    "max",
                    "from",
                    "to",
                    "kind",
                    "subjects",
                    "description",
                    "gpu",
                    "x",
                ]
            ),
            children,
            max_size=6,
        )
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_fuzz_malformed_expect_raises_only_parse_error(obj: Any) -> None:
    try:
        result = parse(obj)
    except ParseError as err:
        assert str(err).startswith(f"{SRC}: /expect")
    else:
        assert isinstance(result, Expectations)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.fixed_dictionaries(
            {"name": st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True)},
            optional={
                "labels": st.dictionaries(
                    st.from_regex(r"[a-z_][a-z0-9_]{0,5}", fullmatch=True), st.text(max_size=5)
                ),
                "aggregate": st.sampled_from(["value", "rate"]),
                "min": st.floats(-1e12, 1e12),
                "from": st.floats(0, 1e6),
            },
        ),
        max_size=4,
    )
)
def test_fuzz_valid_metric_lists_round_trip_through_json(entries: list[dict[str, Any]]) -> None:
    obj = json.loads(json.dumps({"metrics": entries}))
    parsed = parse(obj)
    assert [m.name for m in parsed.metrics] == [e["name"] for e in entries]
    for m, e in zip(parsed.metrics, entries, strict=True):
        assert dict(m.labels) == e.get("labels", {})
        assert m.aggregate == e.get("aggregate", "value")


# --------------------------------------------------------------------------------------------
# Catalogue check


def test_check_catalog_accepts_exported_names_and_labels() -> None:
    load_areas()
    e = parse(
        {
            "metrics": [
                {"name": "nodescope_disk_read_bytes_total", "labels": {"device": "nvme0n1"}},
                {"name": "nodescope_source_up", "labels": {"source": "disks"}},
            ]
        }
    )
    check_catalog(e, CATALOG, SRC)


def test_check_catalog_names_unknown_metric_and_label() -> None:
    load_areas()
    typo = parse({"metrics": [{"name": "m"}, {"name": "nodescope_disk_read_byte_total"}]})
    with pytest.raises(ParseError, match=r"/expect/metrics/0/name: nodescope exports no m"):
        check_catalog(typo, CATALOG, SRC)
    label = parse(
        {"metrics": [{"name": "nodescope_disk_read_bytes_total", "labels": {"disk": "sda"}}]}
    )
    with pytest.raises(ParseError, match=r"/expect/metrics/0/labels/disk: .*labels: device"):
        check_catalog(label, CATALOG, SRC)


# --------------------------------------------------------------------------------------------
# Reading the exposition

EXPOSITION = """\
# HELP nodescope_disk_read_bytes_total Bytes read (512-byte sectors).
# TYPE nodescope_disk_read_bytes_total counter
nodescope_disk_read_bytes_total{device="nvme0n1"} 1024.0
nodescope_disk_read_bytes_total{device="sda"} 5.0e+09
# HELP nodescope_source_up 1 if the source's last run succeeded, 0 if it failed
# TYPE nodescope_source_up gauge
nodescope_source_up{source="disks"} 1.0
nodescope_source_up{source="nvml"} 0.0
# HELP nodescope_gpu_info a GPU
# TYPE nodescope_gpu_info gauge
nodescope_gpu_info{gpu="0",name="H100 \\"SXM\\", 80GB",pci_address="0000:18:00.0"} 1.0
# HELP nodescope_cycles_total collection cycles completed
# TYPE nodescope_cycles_total counter
nodescope_cycles_total 7.0
"""


def test_parse_exposition_keeps_only_the_wanted_names() -> None:
    got = parse_exposition(
        EXPOSITION, {"nodescope_disk_read_bytes_total", "nodescope_cycles_total", "absent_x"}
    )
    assert got == {
        "nodescope_disk_read_bytes_total": {
            (("device", "nvme0n1"),): 1024.0,
            (("device", "sda"),): 5e9,
        },
        "nodescope_cycles_total": {(): 7.0},
        "absent_x": {},
    }


def test_parse_exposition_unescapes_label_values_with_the_client_parser() -> None:
    got = parse_exposition(EXPOSITION, {"nodescope_gpu_info"})
    (labels,) = got["nodescope_gpu_info"]
    assert dict(labels)["name"] == 'H100 "SXM", 80GB'


def test_parse_exposition_of_a_real_render() -> None:
    from nodescope.model.snapshot import Snapshot, SourceStatus
    from nodescope_exporters.prometheus import render

    snapshot = Snapshot(
        cycle=3,
        monotonic=3.0,
        wall_time=1.0,
        status={"disks": SourceStatus("disks", True, 3, 0, 1.0)},
    )
    body = render(snapshot).decode()
    got = parse_exposition(body, {"nodescope_cycles_total", "nodescope_source_runs_total"})
    assert got["nodescope_cycles_total"] == {(): 3.0}
    assert got["nodescope_source_runs_total"] == {(("source", "disks"),): 3.0}


# --------------------------------------------------------------------------------------------
# Evaluation


def exposition(**series: float) -> str:
    """``gpu0=5`` -> one gauge ``m{gpu="0"} 5`` per keyword."""
    lines = ["# TYPE m gauge"]
    lines += [f'm{{gpu="{k.removeprefix("gpu")}",dir="rx"}} {v}' for k, v in series.items()]
    return "\n".join(lines) + "\n"


def metric(**fields: Any) -> Expectations:
    return parse({"metrics": [{"name": "m", **fields}]})


def test_value_in_range_every_cycle_of_the_window_passes() -> None:
    e = metric(labels={"gpu": "0"}, min=10, max=20, **{"from": 2, "to": 4})
    # Outside the window anything goes; inside, 10..20.
    cycles = [(t, exposition(gpu0=v)) for t, v in [(0, 99), (1, 0), (2, 10), (3, 15), (4, 20)]]
    (r,) = evaluate(e, [*cycles, (5, exposition(gpu0=-7))])
    assert r.passed, r.reason
    assert (r.cycles_in_window, r.cycles_evaluated) == (3, 3)
    assert (r.observed_min, r.observed_max) == (10, 20)


def test_one_value_out_of_range_fails_and_names_when_and_what() -> None:
    e = metric(labels={"gpu": "0"}, max=20, **{"from": 1})
    (r,) = evaluate(e, [(0, exposition(gpu0=1)), (1, exposition(gpu0=5)), (2, exposition(gpu0=21))])
    assert not r.passed
    assert r.violations == 1
    assert r.first_violation is not None
    assert (r.first_violation.t, r.first_violation.value) == (2, 21)
    assert "first at t=2s: 21" in r.reason
    assert 'm{dir="rx",gpu="0"}' in r.reason
    assert (r.observed_min, r.observed_max) == (5, 21)


def test_rate_is_per_simulated_second_between_consecutive_cycles() -> None:
    e = metric(labels={"gpu": "0"}, aggregate="rate", min=99, max=101)
    # A 0.5 s tick: +50 per tick is 100/s.
    cycles = [(i * 0.5, exposition(gpu0=1000 + 50 * i)) for i in range(6)]
    (r,) = evaluate(e, cycles)
    assert r.passed, r.reason
    assert r.cycles_in_window == 6
    assert r.cycles_evaluated == 5  # the first cycle has no predecessor
    assert r.observed_min == pytest.approx(100)
    assert r.observed_max == pytest.approx(100)


def test_rate_uses_the_cycle_before_the_window() -> None:
    e = metric(aggregate="rate", min=10, **{"from": 1, "to": 1})
    (r,) = evaluate(e, [(0, exposition(gpu0=0)), (1, exposition(gpu0=10))])
    assert r.passed and r.cycles_evaluated == 1 and r.observed_min == 10


def test_rate_skips_a_counter_reset() -> None:
    e = metric(aggregate="rate", min=0, max=10)
    values = [0, 10, 20, 3, 13]  # the drop to 3 is a reset, not a rate of -17/s
    (r,) = evaluate(e, [(t, exposition(gpu0=v)) for t, v in enumerate(values)])
    assert r.passed, r.reason
    assert r.cycles_evaluated == 3
    assert r.observed_min == 10


def test_rate_fails_when_it_is_out_of_range() -> None:
    e = metric(aggregate="rate", max=5)
    (r,) = evaluate(e, [(0, exposition(gpu0=0)), (1, exposition(gpu0=3)), (2, exposition(gpu0=9))])
    assert not r.passed
    assert r.first_violation is not None and r.first_violation.value == 6


def test_rate_without_two_consecutive_cycles_fails() -> None:
    e = metric(aggregate="rate", **{"from": 1})
    cycles = [(0, "# TYPE m gauge\n"), (1, exposition(gpu0=1)), (2, "# TYPE m gauge\n")]
    (r,) = evaluate(e, cycles)
    assert not r.passed
    assert "no rate" in r.reason


def test_a_label_subset_requires_every_matching_series_in_range() -> None:
    e = metric(labels={"dir": "rx"}, min=0, max=10)
    (ok,) = evaluate(e, [(0, exposition(gpu0=1, gpu1=9))])
    assert ok.passed and len(ok.series) == 2
    (bad,) = evaluate(e, [(0, exposition(gpu0=1, gpu1=11))])
    assert not bad.passed
    assert bad.first_violation is not None
    assert dict(bad.first_violation.labels)["gpu"] == "1"


def test_labels_must_match_exactly() -> None:
    e = metric(labels={"gpu": "1"})
    (r,) = evaluate(e, [(0, exposition(gpu0=1, gpu10=1))])
    assert not r.passed
    assert "never" in r.reason


def test_every_label_of_the_matcher_must_match() -> None:
    e = metric(labels={"gpu": "0", "dir": "tx"})
    (r,) = evaluate(e, [(0, exposition(gpu0=1))])  # gpu 0 exists, but only dir="rx"
    assert not r.passed
    (ok,) = evaluate(metric(labels={"gpu": "0", "dir": "rx"}), [(0, exposition(gpu0=1))])
    assert ok.passed


def test_presence_only_expectation() -> None:
    e = metric(labels={"gpu": "3"})
    (present,) = evaluate(e, [(0, exposition(gpu3=0))])
    assert present.passed
    (absent,) = evaluate(e, [(0, exposition(gpu2=0))])
    assert not absent.passed


def test_series_missing_in_some_cycles_counts_only_where_present() -> None:
    e = metric(labels={"gpu": "0"}, min=1)
    cycles = [(0, exposition(gpu0=2)), (1, exposition(gpu1=0)), (2, exposition(gpu0=3))]
    (r,) = evaluate(e, cycles)
    assert r.passed
    assert (r.cycles_in_window, r.cycles_evaluated) == (3, 2)


def test_series_only_outside_the_window_is_said_so() -> None:
    e = metric(**{"from": 5})
    (r,) = evaluate(e, [(0, exposition(gpu0=1)), (5, "# TYPE m gauge\n")])
    assert not r.passed
    assert "only outside the window" in r.reason


def test_window_beyond_the_run_fails() -> None:
    e = metric(**{"from": 100, "to": 200})
    (r,) = evaluate(e, [(0, exposition(gpu0=1)), (1, exposition(gpu0=1))])
    assert not r.passed
    assert r.cycles_in_window == 0
    assert "no cycle fell in the window t=100..200s" in r.reason


def test_finding_expectations_are_reported_not_checkable_without_detectors() -> None:
    e = parse({"findings": [{"kind": "nvlink_stall"}], "no_other_findings": True})
    results = Evaluator(e).finding_results(checkable=False)
    assert [r.status for r in results] == ["unchecked", "unchecked"]
    assert all(r.reason == NOT_CHECKABLE for r in results)
    assert results[0].describe() == "finding nvlink_stall within t>=0s"
    assert results[1].describe() == "no other findings"


def test_describe_names_series_bounds_and_window() -> None:
    e = parse(
        {
            "metrics": [
                {
                    "name": "x_total",
                    "labels": {"gpu": "2"},
                    "aggregate": "rate",
                    "min": 3e10,
                    "max": 4.5e10,
                    "from": 10,
                    "to": 40,
                },
                {"name": "y", "min": 1},
                {"name": "y", "max": 0.5},
            ]
        }
    )
    assert [m.describe() for m in e.metrics] == [
        'rate(x_total{gpu="2"}) in [3e+10, 4.5e+10] over t=10..40s',
        "y >= 1 over t>=0s",
        "y <= 0.5 over t>=0s",
    ]


def finding(kind: str, **subjects: str) -> Finding:
    return Finding(kind, Severity.WARNING, subjects, {"x": 1.0}, f"{kind} happened")


def test_finding_matches_kind_subjects_and_window() -> None:
    e = FindingExpectation("pcie_contention", ("0000:15:01.0", "0"), 10.0, 20.0)
    hit = finding("pcie_contention", link="0000:15:01.0", gpu="0", job="81740")
    assert finding_matches(e, hit, 10.0) and finding_matches(e, hit, 20.0)
    assert not finding_matches(e, hit, 9.0) and not finding_matches(e, hit, 21.0)
    assert not finding_matches(e, finding("nvlink_stall", link="0000:15:01.0", gpu="0"), 15)
    assert not finding_matches(e, finding("pcie_contention", link="0000:15:01.0"), 15)


def test_finding_expectations_are_checked_when_detectors_ran() -> None:
    e = parse(
        {
            "findings": [
                {"kind": "pcie_contention", "subjects": ["0000:15:01.0"], "from": 10, "to": 50},
                {"kind": "nvlink_stall", "from": 0},
            ],
            "no_other_findings": True,
        }
    )
    ev = Evaluator(e)
    contention = finding("pcie_contention", link="0000:15:01.0")
    ev.observe_findings(5, [contention])  # too early: not accounted for
    ev.observe_findings(12, [contention, finding("link_downtrained", gpu="3")])
    ev.observe_findings(13, [contention])
    found, stall, others = ev.finding_results()
    assert (found.status, found.first_seen, found.finding) == (
        "pass",
        12,
        "pcie_contention{link=0000:15:01.0}",
    )
    assert (stall.status, stall.reason) == ("fail", "no such finding in the window")
    assert others.status == "fail"
    assert others.reason == (
        "2 unexpected finding(s): pcie_contention{link=0000:15:01.0} at t=5s; "
        "link_downtrained{gpu=3} at t=12s"
    )
    assert [r.passed for r in (found, stall, others)] == [True, False, False]


def test_no_other_findings_passes_when_none_appear() -> None:
    ev = Evaluator(parse({"no_other_findings": True}))
    ev.observe_findings(0, [])
    (result,) = ev.finding_results()
    assert (result.status, result.reason) == ("pass", "none appeared")


def test_labelled_subjects_match_in_their_role_only() -> None:
    (e,) = parse({"findings": [{"kind": "nvlink_stall", "subjects": {"device": "7"}}]}).findings
    assert e.labelled == (("device", "7"),) and e.subjects == ()
    assert finding_matches(e, finding("nvlink_stall", device="7", link="2"), 1.0)
    # Link 7 of GPU 2 has a 7 among its subjects, but not as the device.
    assert not finding_matches(e, finding("nvlink_stall", device="2", link="7"), 1.0)
    (plain,) = parse({"findings": [{"kind": "nvlink_stall", "subjects": ["7"]}]}).findings
    assert finding_matches(plain, finding("nvlink_stall", device="2", link="7"), 1.0)


def test_severity_is_matched_when_named() -> None:
    expect = {"findings": [{"kind": "job_stalled_on_storage", "severity": "critical"}]}
    (e,) = parse(expect).findings
    critical = Finding("job_stalled_on_storage", Severity.CRITICAL, {"job": "1"}, {}, "")
    warning = Finding("job_stalled_on_storage", Severity.WARNING, {"job": "1"}, {}, "")
    assert finding_matches(e, critical, 0.0) and not finding_matches(e, warning, 0.0)
    with pytest.raises(ParseError, match=r"/expect/findings/0/severity: must be one of"):
        parse({"findings": [{"kind": "x", "severity": "bad"}]})


def test_an_optional_finding_may_be_absent_and_is_no_other_finding() -> None:
    e = parse(
        {
            "findings": [{"kind": "nvlink_stall", "subjects": {"device": "5"}, "optional": True}],
            "no_other_findings": True,
        }
    )
    quiet = Evaluator(e)
    quiet.observe_findings(1, [])
    assert [(r.status, r.reason) for r in quiet.finding_results()] == [
        ("pass", "optional: not seen"),
        ("pass", "none appeared"),
    ]
    seen = Evaluator(e)
    seen.observe_findings(1, [finding("nvlink_stall", device="5", link="0")])
    seen.observe_findings(2, [finding("nvlink_stall", device="6", link="0")])
    optional, others = seen.finding_results()
    assert (optional.status, optional.first_seen) == ("pass", 1)
    assert others.reason == "1 unexpected finding(s): nvlink_stall{device=6,link=0} at t=2s"
    with pytest.raises(ParseError, match=r"/expect/findings/0/optional: must be true or false"):
        parse({"findings": [{"kind": "x", "optional": "yes"}]})
