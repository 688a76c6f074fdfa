"""The collective layer's parsers and analysis on real torch files (tests/fixtures/torch-traces,
made by tests/collectives_torch.py with the parameters below), on the profiler's NCCL
metadata as torch's source documents it, and on hostile input."""

from __future__ import annotations

import json
import os
import pickle
import statistics
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from nodescope.collectives import Limits, analyze, analyze_files, parse_bytes, read_file
from nodescope.collectives.analysis import compress
from nodescope.collectives.flight import rank_from_name
from nodescope.collectives.model import (
    Analysis,
    CallRecord,
    FileReport,
    ParsedFile,
    dtype_bytes,
    kind_of,
    skew,
)
from nodescope.collectives.render import render_svg, render_text, to_document
from tests.conftest import FIXTURES

TRACES = FIXTURES / "torch-traces"
KINETO = sorted(TRACES.glob("rank*.json"))
FR_JSON = sorted(TRACES.glob("fr_trace_rank_*.json"))
FR_PICKLE = sorted(p for p in TRACES.glob("fr_trace_rank_*") if not p.suffix)

#: The parameters the fixture was made with (its README holds the command).
SPLITS = [[4, 8, 2, 2], [6, 20, 4, 2], [2, 12, 2, 2], [8, 30, 10, 4]]
HIDDEN = 16
FLOAT32 = 4
STEPS = 3
ALLREDUCE_ELEMENTS = 4096
DELAY_RANK = 3
DELAY_NS = 200_000_000
#: Scheduling noise on a loaded 2-core machine over the sleep itself.
DELAY_SLACK_NS = 100_000_000


def expected_skew() -> float:
    sends = [sum(row) for row in SPLITS]
    return statistics.pstdev(sends) / statistics.mean(sends)


def test_fixture_set_is_complete() -> None:
    assert len(KINETO) == len(FR_JSON) == len(FR_PICKLE) == len(SPLITS)


@pytest.mark.parametrize("path", KINETO, ids=lambda p: p.name)
def test_kineto_records_carry_the_split_sizes_the_job_chose(path: Path) -> None:
    parsed = read_file(str(path), Limits())
    assert parsed.report.error is None and parsed.report.format == "kineto"
    rank = parsed.report.rank
    assert rank is not None and 0 <= rank < len(SPLITS)
    assert parsed.report.skipped == 0 and not parsed.report.truncated
    a2a = [c for c in parsed.calls if c.kind == "all_to_all"]
    assert len(a2a) == STEPS
    row = HIDDEN * FLOAT32
    for call in a2a:
        assert call.send_splits == tuple(n * row for n in SPLITS[rank])
        assert call.send_bytes == sum(SPLITS[rank]) * row
        assert call.recv_bytes == sum(SPLITS[s][rank] for s in range(len(SPLITS))) * row
        assert call.group_ranks == (0, 1, 2, 3)
        assert call.duration_ns is not None and call.duration_ns > 0
    reduces = [c for c in parsed.calls if c.kind == "all_reduce"]
    assert len(reduces) == STEPS
    # c10d::allreduce_ takes a tensor list, whose dtype only gloo's annotation records.
    assert {c.send_bytes for c in reduces} == {ALLREDUCE_ELEMENTS * FLOAT32}


def test_kineto_analysis_gives_the_skew_the_hot_destination_and_the_delayed_rank() -> None:
    analysis = analyze_files(KINETO)
    assert analysis.ranks == (0, 1, 2, 3)
    a2a = analysis.kind("all_to_all")
    assert a2a is not None and a2a.collectives == STEPS and a2a.incomplete == 0
    assert a2a.skew == pytest.approx(expected_skew(), rel=1e-9)
    assert a2a.max_instance_skew == pytest.approx(expected_skew(), rel=1e-9)
    columns = [sum(SPLITS[s][d] for s in range(4)) * HIDDEN * FLOAT32 * STEPS for d in range(4)]
    assert [d.recv_bytes for d in a2a.destinations] == columns
    assert a2a.hot_destination == columns.index(max(columns))
    reduce_ = analysis.kind("all_reduce")
    assert reduce_ is not None
    assert reduce_.straggler == DELAY_RANK
    assert DELAY_NS <= reduce_.max_wait_ns <= DELAY_NS + DELAY_SLACK_NS
    assert reduce_.worst is not None and reduce_.worst.straggler == DELAY_RANK
    assert reduce_.slowest[0] == reduce_.worst
    waits = [i.max_wait_ns for i in reduce_.slowest]
    assert waits == sorted(waits, reverse=True) and len(waits) <= reduce_.collectives
    others = [r for r in reduce_.ranks if r.rank != DELAY_RANK]
    assert all(DELAY_NS <= r.max_wait_ns <= DELAY_NS + DELAY_SLACK_NS for r in others)
    summary = analysis.summary()
    assert summary.straggler == DELAY_RANK
    assert summary.max_skew == pytest.approx(expected_skew())
    assert summary.max_wait_ns == reduce_.max_wait_ns


def test_flight_recorder_json_and_pickle_read_the_same() -> None:
    for as_json, as_pickle in zip(FR_JSON, FR_PICKLE, strict=True):
        a = read_file(str(as_json), Limits())
        b = read_file(str(as_pickle), Limits())
        assert a.report.error is None and b.report.error is None
        assert a.report.format == b.report.format == "flight_recorder"
        assert a.calls == b.calls and a.calls


def test_flight_recorder_analysis_matches_by_sequence_number() -> None:
    analysis = analyze_files(FR_PICKLE)
    a2a = analysis.kind("all_to_all")
    assert a2a is not None
    # The ring holds the warm-up step as well: every all-to-all has the same splits.
    assert a2a.skew == pytest.approx(expected_skew(), rel=1e-9)
    assert a2a.destinations == ()  # the recorder keeps no split sizes
    reduce_ = analysis.kind("all_reduce")
    assert reduce_ is not None and reduce_.straggler == DELAY_RANK
    assert DELAY_NS <= reduce_.max_wait_ns <= DELAY_NS + DELAY_SLACK_NS
    keys = {c.key for f in FR_PICKLE for c in read_file(str(f), Limits()).calls}
    assert None not in keys


def test_a_pickle_that_names_a_callable_is_refused_and_never_run(tmp_path: Path) -> None:
    target = tmp_path / "made-by-the-pickle"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.mkdir, (str(target),))

    data = pickle.dumps({"version": "2.10", "entries": [Payload()]})
    parsed = parse_bytes(data, str(tmp_path / "fr_trace_rank_0"), Limits())
    assert parsed.report.error is not None and "refused" in parsed.report.error
    assert not target.exists()


def test_gzip_traces_read_like_plain_ones_and_a_bomb_is_refused(tmp_path: Path) -> None:
    plain = read_file(str(KINETO[0]), Limits())
    packed = tmp_path / "rank0.json.gz"
    packed.write_bytes(compress(KINETO[0].read_bytes()))
    assert read_file(str(packed), Limits()).calls == plain.calls
    bomb = tmp_path / "bomb.json.gz"
    bomb.write_bytes(compress(b" " * (4 << 20)))
    refused = read_file(str(bomb), Limits(max_file_bytes=1 << 20))
    assert refused.report.error is not None and "decompressed" in refused.report.error
    assert bomb.stat().st_size < 1 << 20  # small on disk: the cap is on what it inflates to


def test_a_file_over_the_cap_and_a_fifo_are_refused(tmp_path: Path) -> None:
    big = read_file(str(KINETO[0]), Limits(max_file_bytes=100))
    assert big.report.error is not None and big.calls == ()
    fifo = tmp_path / "rank9.json"
    os.mkfifo(fifo)
    refused = read_file(str(fifo), Limits())
    assert refused.report.error is not None and "not a regular file" in refused.report.error


def _kineto_doc() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(KINETO[1].read_text())
    return doc


def test_a_bad_event_is_skipped_and_counted() -> None:
    doc = _kineto_doc()
    good = parse_bytes(json.dumps(doc).encode(), "rank1.json", Limits())
    ops = [e for e in doc["traceEvents"] if str(e.get("name", "")).startswith("c10d::")]
    ops[0]["ts"] = "soon"
    ops[1]["args"]["Input Dims"] = [[-4], [8]]
    ops[2]["args"]["Input Dims"] = ops[2]["args"]["Input type"] = []
    # Events that are no collective's are passed over, however odd: not counted as bad.
    doc["traceEvents"].append({"ph": "X", "name": "f" * 5000, "ts": "x"})
    doc["traceEvents"].append({"ph": "X", "name": ["c10d::allreduce_"]})
    bad = parse_bytes(json.dumps(doc).encode(), "rank1.json", Limits())
    assert bad.report.error is None
    assert bad.report.skipped == 3
    assert len(bad.calls) == len(good.calls) - 3


def test_the_event_cap_stops_reading_and_says_so() -> None:
    doc = _kineto_doc()
    parsed = parse_bytes(json.dumps(doc).encode(), "rank1.json", Limits(max_events=10))
    assert parsed.report.truncated
    assert len(parsed.calls) < len(read_file(str(KINETO[1]), Limits()).calls)


def test_a_second_file_of_one_rank_is_reported_not_counted_twice() -> None:
    analysis = analyze_files([*KINETO, KINETO[0]])
    assert [f.error is None for f in analysis.files] == [True] * 4 + [False]
    assert "already read" in str(analysis.files[-1].error)
    a2a = analysis.kind("all_to_all")
    assert a2a is not None and {r.calls for r in a2a.ranks} == {STEPS}


def test_the_file_cap_leaves_the_rest_unread() -> None:
    analysis = analyze_files(KINETO, Limits(max_files=2))
    assert len(analysis.files) == 2 and analysis.files_dropped == 2


def _param_comms(
    rank: int, seq: int, ts_us: float, splits: list[int], *, kernel: bool = False
) -> dict[str, Any]:
    """A ``record_param_comms`` event (or the GPU kernel the profiler copies its metadata
    to) with the keys and value formats of torch's ``saveNcclMeta``: strings for names and
    lists (``"[1, 2]"``), integers for counts."""
    return {
        "ph": "X",
        "cat": "kernel" if kernel else "cpu_op",
        "name": "ncclDevKernel_SendRecv" if kernel else "record_param_comms",
        "pid": 0 if kernel else 100 + rank,
        "tid": 7,
        "ts": ts_us,
        "dur": 50.0,
        "args": {
            "Collective name": "all_to_allv",
            "dtype": "BFloat16",
            "In msg nelems": sum(splits) * 8,
            "Out msg nelems": 64,
            "Group size": 2,
            "In split size": json.dumps(splits).replace(",", ", "),
            "Out split size": "[]",
            "Process Group Name": "3",
            "Process Group Description": "ep_group",
            "Process Group Ranks": "[0, 1]",
            "Rank": rank,
            "Seq": seq,
        },
    }


def _nccl_trace(rank: int, events: list[dict[str, Any]]) -> bytes:
    return json.dumps(
        {"traceEvents": events, "baseTimeNanoseconds": 1_700_000_000 * 10**9}
    ).encode()


def test_nccl_metadata_is_matched_by_seq_and_kernels_win_over_cpu_records() -> None:
    # Rank 1's records are written out of order, and its seq 5 begins 3 ms after rank 0's.
    rank0 = [_param_comms(0, 4, 1000.0, [3, 1]), _param_comms(0, 5, 2000.0, [3, 1])]
    rank1 = [_param_comms(1, 5, 5000.0, [1, 1]), _param_comms(1, 4, 1000.0, [1, 1])]
    parsed = [
        parse_bytes(_nccl_trace(0, rank0), "a.json", Limits()),
        parse_bytes(_nccl_trace(1, rank1), "b.json", Limits()),
    ]
    assert [p.report.rank for p in parsed] == [0, 1]
    analysis = analyze(parsed)
    a2a = analysis.kind("all_to_all")
    assert a2a is not None and a2a.collectives == 2
    assert a2a.straggler == 1 and a2a.max_wait_ns == 3_000_000
    assert a2a.skew == pytest.approx(skew([4 * 8 * 2, 2 * 8 * 2]))
    assert [(d.rank, d.recv_bytes) for d in a2a.destinations] == [(0, 2 * 64), (1, 2 * 32)]
    # The CPU record carries no device time; a kernel event with the metadata does.
    assert {r.busy_ns for r in a2a.ranks} == {None}
    kernels = [_param_comms(0, 4, 1500.0, [3, 1], kernel=True), *rank0]
    device = parse_bytes(_nccl_trace(0, kernels), "a.json", Limits())
    assert [(c.arrive_ns, c.duration_ns) for c in device.calls] == [
        (1_700_000_000 * 10**9 + 1_500_000, 50_000)
    ]


def test_nccl_split_sizes_cut_by_the_profiler_still_give_the_totals() -> None:
    event = _param_comms(0, 1, 10.0, [1] * 40)
    event["args"]["In split size"] = "[" + ", ".join(["1"] * 30) + ", ...]"
    parsed = parse_bytes(_nccl_trace(0, [event]), "a.json", Limits())
    (call,) = parsed.calls
    assert call.send_splits is None and call.send_bytes == 40 * 8 * 2


def test_a_trace_without_a_rank_is_refused() -> None:
    doc = _kineto_doc()
    del doc["distributedInfo"]
    parsed = parse_bytes(json.dumps(doc).encode(), "x.json", Limits())
    assert parsed.report.error is not None and "rank" in parsed.report.error


@pytest.mark.parametrize(
    ("name", "rank"),
    [
        ("/tmp/nccl_trace_rank_12", 12),
        ("fr_trace_rank_3.json", 3),
        ("fr_trace_rank_3.json.gz", 3),
        ("dump", None),
        ("rank_1234567890", None),
    ],
)
def test_a_dump_takes_its_rank_from_its_file_name(name: str, rank: int | None) -> None:
    assert rank_from_name(name) == rank


def test_names_of_kinds_and_dtypes() -> None:
    assert kind_of("c10d::alltoall_base_") == kind_of("gloo:all_to_all") == "all_to_all"
    assert kind_of("_allgather_base") == kind_of("nccl:all_gather") == "all_gather"
    assert kind_of("nccl:send 0->1") is None and kind_of("wait") is None
    assert dtype_bytes("c10::BFloat16") == dtype_bytes("BFloat16") == 2
    assert dtype_bytes("long int") == dtype_bytes("Long") == 8
    assert dtype_bytes("Float8_e4m3fn") == 1 and dtype_bytes("quaternion") is None


def test_text_json_and_svg_say_the_same() -> None:
    analysis = analyze_files(KINETO)
    text = render_text(analysis)
    assert f"{expected_skew():.4f}" in text
    assert f"straggler: rank {DELAY_RANK}," in text
    document = to_document(analysis)
    assert json.loads(json.dumps(document)) == document
    assert document["summary"]["straggler"] == DELAY_RANK
    svg = ET.fromstring(render_svg(analysis))
    bars = svg.findall(".//{http://www.w3.org/2000/svg}rect")
    # Per kind two bars per rank for bytes and one for waits, plus frames and background.
    assert len(bars) >= len(analysis.kinds) * 4 * 3
    assert f"straggler rank {DELAY_RANK}" in render_svg(analysis)


def test_records_without_a_second_rank_have_no_straggler() -> None:
    alone = CallRecord(0, "g", "all_reduce", None, 10, None, 4, 4)
    analysis = analyze([])
    assert analysis.kinds == ()
    single = ParsedFile(FileReport("a", "kineto", 0, 1, 0, False), (alone,))
    report = analyze([single]).kind("all_reduce")
    assert report is not None and report.straggler is None and report.max_wait_ns == 0


def test_the_worked_example_in_the_docs_is_the_fixtures() -> None:
    text = " ".join((FIXTURES.parent.parent / "docs" / "collectives.md").read_text().split())
    sends = [sum(row) for row in SPLITS]
    busiest, mean = max(sends), statistics.mean(sends)
    assert f"δ = {expected_skew():.2f} on {len(SPLITS)} ranks" in text
    assert f"sends {busiest} rows against a mean of {mean:g}" in text
    assert f"{busiest / mean:.2f} times the mean" in text
    # Samuelson's bound, which the docs state: no value is further than std·√(n−1) above the mean.
    assert busiest <= mean * (1 + expected_skew() * (len(sends) - 1) ** 0.5)


def test_a_rank_that_never_reached_a_collective_is_named(tmp_path: Path) -> None:
    """A dump taken on a hang: rank 2 never enqueued the last all-reduce the others did."""
    paths = []
    for path in FR_JSON:
        doc = json.loads(path.read_text())
        if path.name == "fr_trace_rank_2.json":
            last = max(
                i
                for i, e in enumerate(doc["entries"])
                if e["profiling_name"].endswith("all_reduce")
            )
            doc["entries"] = doc["entries"][:last]
        (tmp_path / path.name).write_text(json.dumps(doc))
        paths.append(tmp_path / path.name)
    reduce_ = analyze_files(paths).kind("all_reduce")
    assert reduce_ is not None and reduce_.incomplete == 1
    (partial,) = reduce_.partial
    assert partial.missing == (2,) and partial.ranks == (0, 1, 3)
    assert partial.index == reduce_.collectives - 1
    assert "without rank 2" in render_text(analyze_files(paths))


def test_two_groups_of_one_kind_are_each_complete() -> None:
    """Expert-parallel groups {0, 1} and {2, 3}: neither group misses the other's ranks."""

    def record(rank: int, group: str, arrive: int) -> CallRecord:
        return CallRecord(rank, group, "all_to_all", 7, arrive, None, 100 * (rank + 1), 0)

    parsed = []
    for rank, group in ((0, "ep0"), (1, "ep0"), (2, "ep1"), (3, "ep1")):
        call = record(rank, group, 1000 * rank)
        parsed.append(ParsedFile(FileReport(f"r{rank}", "kineto", rank, 1, 0, False), (call,)))
    a2a = analyze(parsed).kind("all_to_all")
    assert a2a is not None and a2a.collectives == 2 and a2a.incomplete == 0
    assert a2a.skew == pytest.approx(skew([100, 200, 300, 400]))
    assert {(i.group, i.straggler) for i in a2a.slowest} == {("ep0", 1), ("ep1", 3)}


def test_missing_ranks_are_runs_between_the_ranks_read() -> None:
    assert Analysis((), (0, 5, 65535), (), world_size=65536).missing_ranks() == (
        (1, 4),
        (6, 65534),
    )
    assert Analysis((), (0, 5, 65535), (), world_size=65536).missing_count() == 65533
    assert Analysis((), (1, 2), (), world_size=4).missing_ranks() == ((0, 0), (3, 3))
    # A rank past the world size the files name is not a reason to invent negative runs.
    assert Analysis((), (0, 7), (), world_size=4).missing_ranks() == ((1, 3),)
    assert Analysis((), (0,), (), world_size=None).missing_ranks() == ()


@pytest.mark.parametrize(
    ("world", "expected"),
    [(8, 8), ("8", 8), (0, 4), (-3, 4), ("many", 4), (10**12, 4), (True, 4), (None, 4)],
)
def test_a_kineto_world_size_is_read_bounded_else_taken_from_the_group(
    world: object, expected: int
) -> None:
    doc = _kineto_doc()
    doc["distributedInfo"]["world_size"] = world
    parsed = parse_bytes(json.dumps(doc).encode(), "rank1.json", Limits())
    assert parsed.report.error is None
    # The fixture's one process group lists ranks 0..3: its size stands in for a world size
    # that is not a number of ranks.
    assert parsed.report.world_size == expected
