"""Fuzzing the collective layer: whatever a trace file holds, the parsers return a report
(an error, or records and a count of the bad ones) and never raise; the analysis of any
records keeps its invariants, and what it renders stays well-formed."""

from __future__ import annotations

import json
import pickle
import xml.etree.ElementTree as ET
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nodescope.collectives import Limits, analyze, parse_bytes
from nodescope.collectives.analysis import compress
from nodescope.collectives.model import CallRecord, FileReport, ParsedFile
from nodescope.collectives.render import render_svg, render_text, to_document
from tests.unit.json_strategy import json_values
from tests.unit.test_collectives import FR_JSON, FR_PICKLE, KINETO

SMALL = Limits(max_file_bytes=1 << 20, max_events=2000, max_list=256)


def _check(parsed: ParsedFile) -> None:
    report = parsed.report
    if report.error is not None:
        assert parsed.calls == () and report.records == 0
        return
    assert report.records == len(parsed.calls) and report.skipped >= 0
    for call in parsed.calls:
        assert call.rank == report.rank
        assert call.arrive_ns >= 0
        for value in (call.send_bytes, call.recv_bytes, call.duration_ns):
            assert value is None or value >= 0
        if call.send_splits is not None:
            assert all(s >= 0 for s in call.send_splits)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=512))
@example(data=b"\x1f\x8b")
@example(data=b"\x80\x05")
@example(data=b"[" * 100_000)
def test_any_bytes_give_a_report(data: bytes) -> None:
    _check(parse_bytes(data, "fr_trace_rank_1", SMALL))


_EVENT_KEYS = st.sampled_from(["ph", "name", "cat", "ts", "dur", "args", "pid", "tid"])
_ARG_KEYS = st.sampled_from(
    [
        "Input Dims",
        "Input type",
        "Concrete Inputs",
        "Collective name",
        "In msg nelems",
        "Out msg nelems",
        "In split size",
        "dtype",
        "Seq",
        "Rank",
        "Process Group Ranks",
        "Group size",
    ]
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    index=st.integers(0, 10_000),
    key=_EVENT_KEYS | _ARG_KEYS,
    value=json_values(max_text=40),
    which=st.integers(0, len(KINETO) - 1),
)
def test_a_real_trace_with_one_field_changed_gives_a_report(
    index: int, key: str, value: Any, which: int
) -> None:
    doc = json.loads(KINETO[which].read_text())
    events = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    event = events[index % len(events)]
    if key[0].isupper():
        event.setdefault("args", {})[key] = value
    else:
        event[key] = value
    _check(parse_bytes(json.dumps(doc).encode(), KINETO[which].name, SMALL))


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(
        st.dictionaries(_EVENT_KEYS | st.text(max_size=6), json_values(max_text=30), max_size=8),
        max_size=8,
    ),
    info=json_values(max_text=10),
    base=json_values(max_text=10),
)
def test_any_kineto_shaped_document_gives_a_report(
    events: list[dict[str, Any]], info: Any, base: Any
) -> None:
    for event in events:
        event.setdefault("ph", "X")
        event.setdefault("name", "c10d::allreduce_")
    doc = {"traceEvents": events, "distributedInfo": info, "baseTimeNanoseconds": base}
    _check(parse_bytes(json.dumps(doc).encode(), "rank0.json", SMALL))


@settings(max_examples=200, deadline=None)
@given(
    entries=st.lists(
        st.dictionaries(
            st.sampled_from(
                [
                    "profiling_name",
                    "process_group",
                    "collective_seq_id",
                    "time_created_ns",
                    "input_sizes",
                    "output_sizes",
                    "input_dtypes",
                    "is_p2p",
                    "duration_ms",
                    "time_discovered_started_ns",
                    "time_discovered_completed_ns",
                ]
            ),
            json_values(max_text=20),
            max_size=11,
        ),
        max_size=6,
    ),
    config=json_values(max_text=10),
    protocol=st.integers(0, pickle.HIGHEST_PROTOCOL),
)
def test_a_dump_reads_the_same_as_json_and_as_pickle(
    entries: list[dict[str, Any]], config: Any, protocol: int
) -> None:
    doc = {"version": "2.10", "pg_config": config, "entries": entries}
    as_json = parse_bytes(json.dumps(doc).encode(), "fr_trace_rank_2.json", SMALL)
    as_pickle = parse_bytes(pickle.dumps(doc, protocol=protocol), "fr_trace_rank_2", SMALL)
    _check(as_json)
    if protocol >= 2:  # protocols 0 and 1 do not begin with the PROTO opcode
        assert as_pickle.calls == as_json.calls
        assert as_pickle.report.skipped == as_json.report.skipped


@settings(max_examples=300, deadline=None)
@given(
    which=st.integers(0, len(FR_PICKLE) - 1),
    position=st.integers(0, 1 << 16),
    byte=st.integers(0, 255),
    cut=st.booleans(),
)
def test_a_real_pickle_dump_damaged_anywhere_gives_a_report(
    which: int, position: int, byte: int, cut: bool
) -> None:
    data = bytearray(FR_PICKLE[which].read_bytes())
    position %= len(data)
    if cut:
        del data[position:]
    else:
        data[position] = byte
    _check(parse_bytes(bytes(data), FR_PICKLE[which].name, SMALL))


@settings(max_examples=100, deadline=None)
@given(which=st.integers(0, len(FR_JSON) - 1), position=st.integers(0, 1 << 16))
def test_a_real_gzip_trace_cut_anywhere_gives_a_report(which: int, position: int) -> None:
    data = compress(FR_JSON[which].read_bytes())
    _check(parse_bytes(data[: position % len(data)], FR_JSON[which].name, SMALL))


_records = st.builds(
    CallRecord,
    rank=st.integers(0, 5),
    group=st.sampled_from(["", "0", "ep"]),
    kind=st.sampled_from(["all_reduce", "all_to_all", "barrier"]),
    key=st.none() | st.integers(0, 4),
    arrive_ns=st.integers(0, 10**12),
    duration_ns=st.none() | st.integers(0, 10**9),
    send_bytes=st.none() | st.integers(0, 10**9),
    recv_bytes=st.none() | st.integers(0, 10**9),
    send_splits=st.none() | st.lists(st.integers(0, 10**6), max_size=6).map(tuple),
    group_ranks=st.none() | st.lists(st.integers(0, 5), max_size=6).map(tuple),
)


@settings(max_examples=300, deadline=None)
@given(records=st.lists(_records, max_size=30))
def test_the_analysis_of_any_records_keeps_its_invariants(records: list[CallRecord]) -> None:
    by_rank: dict[int, list[CallRecord]] = {}
    for record in records:
        by_rank.setdefault(record.rank, []).append(record)
    parsed = [
        ParsedFile(FileReport(f"rank{r}", "kineto", r, len(calls), 0, False), tuple(calls))
        for r, calls in sorted(by_rank.items())
    ]
    analysis = analyze(parsed)
    assert analysis.ranks == tuple(sorted(by_rank))
    for kind in analysis.kinds:
        ranks = {r.rank for r in kind.ranks}
        assert kind.straggler is None or kind.straggler in ranks
        assert kind.max_wait_ns == max(r.max_wait_ns for r in kind.ranks)
        assert all(0 <= r.max_wait_ns <= r.wait_ns or r.wait_ns == 0 for r in kind.ranks)
        assert sum(r.calls for r in kind.ranks) == sum(
            1 for c in records if c.kind == kind.kind
        ) - _duplicates(records, kind.kind)
        for value in (kind.skew, kind.max_instance_skew, kind.destination_skew):
            assert value is None or value >= 0
        if kind.straggler is not None:
            assert kind.max_wait_ns > 0
    summary = analysis.summary()
    assert summary.straggler is None or summary.straggler in analysis.ranks
    render_text(analysis)
    json.dumps(to_document(analysis))
    ET.fromstring(render_svg(analysis))


def _duplicates(records: list[CallRecord], kind: str) -> int:
    """Records a keyed group holds twice for one rank and key: the first is kept."""
    seen: set[tuple[str, int, int | None]] = set()
    dropped = 0
    keyed = {
        c.group
        for c in records
        if c.kind == kind
        and all(o.key is not None for o in records if o.kind == kind and o.group == c.group)
    }
    for record in records:
        if record.kind != kind or record.group not in keyed:
            continue
        marker = (record.group, record.rank, record.key)
        if marker in seen:
            dropped += 1
        seen.add(marker)
    return dropped


@settings(max_examples=200, deadline=None)
@given(
    index=st.integers(0, 10_000),
    dims=st.lists(json_values(max_text=10), max_size=8),
    types=st.lists(st.sampled_from(["float", "c10::BFloat16", "TensorList", "", "x"]), max_size=8),
    concrete=st.lists(st.text(max_size=20) | st.just("[1, 2, 3, 4]"), max_size=8),
)
def test_a_c10d_op_with_any_shapes_gives_a_report(
    index: int, dims: list[Any], types: list[str], concrete: list[str]
) -> None:
    """The shapes, dtypes and concrete inputs of one op replaced together, of equal length
    (the parser's first check) or not."""
    doc = json.loads(KINETO[0].read_text())
    ops = [e for e in doc["traceEvents"] if str(e.get("name", "")).startswith("c10d::")]
    args = ops[index % len(ops)]["args"]
    args["Input Dims"] = dims
    args["Input type"] = (types * 8)[: len(dims)] if types else ["float"] * len(dims)
    args["Concrete Inputs"] = concrete
    _check(parse_bytes(json.dumps(doc).encode(), KINETO[0].name, SMALL))
