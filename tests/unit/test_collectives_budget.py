"""The object budgets of the trace parser: the bound counted from a file's bytes is never
below what decoding builds (fuzzed over JSON documents and pickles), a file over the budget is
refused before it is decoded, and a pickle of one entry referred to many times stops at the
record budget instead of building a record per reference."""

from __future__ import annotations

import json
import pickle
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.collectives import Limits, parse_bytes
from nodescope.collectives.budget import OVER_BUDGET, check_pickle, json_objects
from tests.adversarial.hostile_traces import flight_json_dump, flight_pickle_bomb

_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
_DOCS = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=60,
)


def _built(value: object) -> int:
    """Values and keys a decoder builds for ``value`` (the document itself included)."""
    if isinstance(value, list):
        return 1 + sum(_built(v) for v in value)
    if isinstance(value, dict):
        return 1 + sum(1 + _built(v) for v in value.values())
    return 1


@settings(max_examples=300, deadline=None)
@given(_DOCS)
def test_the_json_bound_is_never_below_what_decoding_builds(doc: object) -> None:
    data = json.dumps(doc).encode()
    assert json_objects(data) >= _built(json.loads(data))


@settings(max_examples=300, deadline=None)
@given(_DOCS)
def test_the_pickle_count_is_never_below_what_unpickling_builds(doc: object) -> None:
    for protocol in (2, 4, 5):
        assert check_pickle(pickle.dumps(doc, protocol=protocol), 1 << 30) >= _built(doc)


def test_repeated_references_count_once_each() -> None:
    entry = {"a": [1, 2, 3]}
    one = check_pickle(pickle.dumps([entry], protocol=4), 1 << 30)
    many = check_pickle(pickle.dumps([entry] * 1000, protocol=4), 1 << 30)
    assert many >= one + 999


def test_a_json_file_over_the_budget_is_refused_before_decoding() -> None:
    data = flight_json_dump(0, 1 << 20)
    ok = parse_bytes(data, "fr_trace_rank_0.json", Limits())
    assert ok.report.error is None and ok.report.records > 1000
    assert ok.report.objects == json_objects(data)
    refused = parse_bytes(data, "fr_trace_rank_0.json", Limits(max_objects=ok.report.objects - 1))
    assert refused.report.error is not None and refused.report.error.startswith(OVER_BUDGET)
    assert refused.calls == ()


def test_a_pickle_of_repeated_references_stops_at_the_budgets() -> None:
    bomb = flight_pickle_bomb(1_000_000)
    assert len(bomb) < 2_100_000
    started = time.monotonic()
    by_objects = parse_bytes(bomb, "fr_trace_rank_0", Limits(max_objects=100_000))
    assert by_objects.report.error is not None and "pickled objects" in by_objects.report.error
    by_records = parse_bytes(bomb, "fr_trace_rank_0", Limits(max_records=10_000))
    assert by_records.report.error is not None and "call records" in by_records.report.error
    assert by_records.calls == ()
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("data", [b"\x80\x04\x95", b"\x80\x04K\x01\xff", b"\x80\x02]q\x00(h\x09"])
def test_a_damaged_pickle_is_refused_by_the_count(data: bytes) -> None:
    report = parse_bytes(data, "fr_trace_rank_0", Limits()).report
    assert report.error is not None and report.records == 0


def test_groups_referring_to_one_long_rank_list_stop_at_the_budget() -> None:
    ranks = str(list(range(60_000)))
    document = {
        "version": "2.10",
        "pg_config": {str(g): {"ranks": ranks} for g in range(4096)},
        "entries": [],
    }
    data = pickle.dumps(document, protocol=4)
    assert len(data) < 1 << 20
    started = time.monotonic()
    report = parse_bytes(data, "fr_trace_rank_0", Limits(max_objects=2_000_000)).report
    assert report.error is not None and "group members" in report.error
    assert time.monotonic() - started < 30


def test_records_of_one_long_rank_list_share_it() -> None:
    """A profiler trace whose every collective refers to one args dict with a long rank list
    (one object in a pickle): the records hold one tuple between them, not one each."""
    args = {
        "Collective name": "allreduce",
        "dtype": "Float",
        "In msg nelems": 4,
        "Out msg nelems": 4,
        "Process Group Name": "0",
        "Process Group Ranks": list(range(5_000)),
        "Rank": 0,
    }
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "ts": i, "dur": 1, "args": args}
        for i in range(500)
    ]
    data = pickle.dumps({"distributedInfo": {"rank": 0}, "traceEvents": events}, protocol=4)
    parsed = parse_bytes(data, "rank0.pkl", Limits())
    assert parsed.report.error is None and len(parsed.calls) == 500
    assert len({id(c.group_ranks) for c in parsed.calls}) == 1
