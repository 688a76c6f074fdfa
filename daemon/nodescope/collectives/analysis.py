"""From trace files to figures: read each rank's file, match the ranks' records of one
collective, and compute per kind and per rank the bytes, the waits, δ and the straggler.

A collective cannot finish before its last rank arrives, so every other rank waits for that
one: the wait of rank r is ``last arrival − arrival of r``, the straggler is the rank that
arrived last, and the longest wait is what the straggler cost the group. Arrivals come from
different processes' clocks: on one host they are one clock; across hosts the figures are as
good as the hosts' clock agreement (NTP or PTP), so waits far below it mean nothing there.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nodescope import fileio
from nodescope.collectives import budget, flight, kineto
from nodescope.collectives.model import (
    SKEWED_KINDS,
    SLOWEST,
    Analysis,
    CallRecord,
    Destination,
    FileReport,
    Instance,
    KindReport,
    Limits,
    ParsedFile,
    RankFigures,
    skew,
)
from nodescope.collectives.values import BadRecord

_GZIP_MAGIC = b"\x1f\x8b"
_PICKLE_PROTO = b"\x80"
#: Limits are frozen: one instance serves as every call's default.
DEFAULT_LIMITS = Limits()


def analyze_files(paths: Iterable[str | Path], limits: Limits = DEFAULT_LIMITS) -> Analysis:
    """Read every file (one per rank: Kineto traces, flight recorder dumps, gzip or not) and
    analyse them together. A file that cannot be read is reported with its error; the others
    still count."""
    named = [str(p) for p in paths]
    parsed = [read_file(p, limits) for p in named[: limits.max_files]]
    return analyze(parsed, limits, files_dropped=max(0, len(named) - limits.max_files))


def read_file(path: str, limits: Limits) -> ParsedFile:
    kind = fileio.FileKind("collective trace", limits.max_file_bytes)
    try:
        data = fileio.read_bytes(path, kind)
    except OSError as exc:
        return ParsedFile(FileReport(path, None, None, 0, 0, False, str(exc)), ())
    return parse_bytes(data, path, limits)


def parse_bytes(data: bytes, path: str, limits: Limits) -> ParsedFile:
    """One file's records from its bytes: pure, so the fuzz tests call it directly. The
    report's ``objects`` is the bound on what decoding built (:mod:`.budget`), 0 when the
    file was refused before."""
    fmt: str | None = None
    objects = 0
    try:
        if data[:2] == _GZIP_MAGIC:
            data = _gunzip(data, limits.max_file_bytes)
        # The objects are counted before anything is built: a file over the budget is
        # refused without the memory its decoding would take.
        if data[:1] == _PICKLE_PROTO:
            objects = budget.check_pickle(data, limits.max_objects)
            doc = flight.unpickle(data)
        else:
            objects = budget.check_json(data, limits.max_objects)
            try:
                doc = json.loads(data)
            except RecursionError:
                raise BadRecord("JSON nested too deep") from None
            except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
                raise BadRecord(f"not JSON: {str(exc)[:80]}") from None
        del data
        if flight.is_dump(doc):
            fmt = "flight_recorder"
            rank, calls, skipped, truncated, world = flight.parse(doc, path, limits)
        else:
            fmt = "kineto"
            rank, calls, skipped, truncated, world = kineto.parse(doc, limits)
        budget.check_records(len(calls), limits.max_records)
    except BadRecord as exc:
        return ParsedFile(FileReport(path, fmt, None, 0, 0, False, str(exc), objects), ())
    report = FileReport(path, fmt, rank, len(calls), skipped, truncated, None, objects, world)
    return ParsedFile(report, calls)


def _gunzip(data: bytes, limit: int) -> bytes:
    """Decompress at most ``limit`` bytes: a small file that inflates without end is refused
    at the cap instead of filling memory."""
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(data, limit + 1)
    except zlib.error as exc:
        raise BadRecord(f"not gzip: {exc}") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise BadRecord(f"more than {limit} bytes once decompressed")
    return out


def compress(data: bytes) -> bytes:
    """gzip, for the tests and for tools that write traces as torch does."""
    return gzip.compress(data, mtime=0)


@dataclass
class _RankTotals:
    calls: int = 0
    send: int | None = None
    recv: int | None = None
    busy: int | None = None
    wait: int = 0
    max_wait: int = 0
    last: int = 0
    caused: int = 0
    #: Send bytes over the collectives every rank recorded: what δ compares.
    complete_send: int | None = None
    unknown_send: bool = False


@dataclass
class _KindState:
    ranks: dict[int, _RankTotals] = field(default_factory=dict)
    collectives: int = 0
    destinations: dict[int, int] = field(default_factory=dict)
    instance_skews: list[float] = field(default_factory=list)
    #: Collectives that had a straggler, for the report's slowest few.
    late: list[Instance] = field(default_factory=list)
    #: Collectives some rank of the kind did not record.
    partial: list[Instance] = field(default_factory=list)


def analyze(
    parsed: Sequence[ParsedFile], limits: Limits = DEFAULT_LIMITS, *, files_dropped: int = 0
) -> Analysis:
    """Match the ranks' records and compute the figures. Two files of one rank: the first is
    used, the second reported as a duplicate (its records would count the rank twice)."""
    reports: list[FileReport] = []
    records: list[CallRecord] = []
    owners: dict[int, str] = {}
    for item in parsed:
        report = item.report
        rank = report.rank
        if rank is not None and rank in owners:
            report = FileReport(
                report.path,
                report.format,
                rank,
                0,
                report.skipped,
                report.truncated,
                f"rank {rank} already read from {owners[rank]}",
            )
        elif rank is not None and len(owners) >= limits.max_ranks:
            report = FileReport(
                report.path,
                report.format,
                rank,
                0,
                report.skipped,
                report.truncated,
                f"more than {limits.max_ranks} ranks",
            )
        elif rank is not None:
            owners[rank] = report.path
            records.extend(item.calls)
        reports.append(report)
    instances = _instances(records)
    # A group's members are the ranks that recorded any of its collectives of the kind. A
    # collective recorded by fewer (a rank's profiler window began later or ended sooner, or
    # a rank hung before it) still gives its waits, but its bytes would bias the ranks'
    # totals that δ compares, so those count complete collectives only.
    members: dict[tuple[str, str], set[int]] = {}
    for key, by_rank in instances:
        members.setdefault(key, set()).update(by_rank)
    states: dict[str, _KindState] = {}
    for (group, kind), by_rank in instances:
        state = states.setdefault(kind, _KindState())
        _account(state, group, kind, by_rank, members[(group, kind)])
    kinds = tuple(_kind_report(kind, states[kind]) for kind in sorted(states))
    worlds = [r.world_size for r in reports if r.world_size is not None and r.error is None]
    return Analysis(
        tuple(reports), tuple(sorted(owners)), kinds, files_dropped, max(worlds, default=None)
    )


def _instances(
    records: list[CallRecord],
) -> list[tuple[tuple[str, str], dict[int, CallRecord]]]:
    """The ranks' records of each collective, keyed by group and kind.

    With sequence numbers on every record of a group and kind, records sharing one are one
    collective. Without, the n-th call of each rank (in the order it made them) is matched:
    the collectives of a group are issued in the same order on every member, which the
    backends require."""
    buckets: dict[tuple[str, str], list[CallRecord]] = {}
    for record in records:
        buckets.setdefault((record.group, record.kind), []).append(record)
    out: list[tuple[tuple[str, str], dict[int, CallRecord]]] = []
    for bucket_key in sorted(buckets):
        bucket = buckets[bucket_key]
        matched: dict[int, dict[int, CallRecord]] = {}
        if all(r.key is not None for r in bucket):
            for record in bucket:
                assert record.key is not None
                matched.setdefault(record.key, {}).setdefault(record.rank, record)
        else:
            per_rank: dict[int, list[CallRecord]] = {}
            for record in bucket:
                per_rank.setdefault(record.rank, []).append(record)
            for rank, calls in per_rank.items():
                for index, record in enumerate(sorted(calls, key=lambda r: r.arrive_ns)):
                    matched.setdefault(index, {})[rank] = record
        out.extend((bucket_key, matched[index]) for index in sorted(matched))
    return out


def _account(
    state: _KindState, group: str, kind: str, by_rank: dict[int, CallRecord], members: set[int]
) -> None:
    state.collectives += 1
    missing = tuple(sorted(members - by_rank.keys()))
    complete = not missing
    last_rank, last = max(
        ((r, c.arrive_ns) for r, c in by_rank.items()), key=lambda x: (x[1], -x[0])
    )
    waits = {rank: last - call.arrive_ns for rank, call in by_rank.items()}
    max_wait = max(waits.values())
    straggler = last_rank if len(by_rank) > 1 and max_wait > 0 else None
    sends = [c.send_bytes for c in by_rank.values()]
    instance_skew = None
    if kind in SKEWED_KINDS and complete and None not in sends:
        instance_skew = skew([s for s in sends if s is not None])
    if instance_skew is not None:
        state.instance_skews.append(instance_skew)
    instance = Instance(
        kind,
        group,
        state.collectives - 1,
        tuple(sorted(by_rank)),
        straggler,
        max_wait,
        instance_skew,
        missing,
    )
    if straggler is not None:
        state.late.append(instance)
    if missing:
        state.partial.append(instance)
    for rank, call in by_rank.items():
        totals = state.ranks.setdefault(rank, _RankTotals())
        totals.calls += 1
        totals.send = _add(totals.send, call.send_bytes)
        totals.recv = _add(totals.recv, call.recv_bytes)
        totals.busy = _add(totals.busy, call.duration_ns)
        totals.wait += waits[rank]
        totals.max_wait = max(totals.max_wait, waits[rank])
        if rank == straggler:
            totals.last += 1
            totals.caused += max_wait
        if not complete:
            continue
        if call.send_bytes is None:
            totals.unknown_send = True
        totals.complete_send = _add(totals.complete_send, call.send_bytes)
        if call.send_splits is not None:
            order = call.group_ranks
            known = order is not None and len(order) == len(call.send_splits)
            for index, size in enumerate(call.send_splits):
                dest = order[index] if known and order else index
                state.destinations[dest] = state.destinations.get(dest, 0) + size


def _add(total: int | None, value: int | None) -> int | None:
    if value is None:
        return total
    return value if total is None else total + value


def _kind_report(kind: str, state: _KindState) -> KindReport:
    ranks = tuple(
        RankFigures(
            rank=rank,
            calls=t.calls,
            send_bytes=t.send,
            recv_bytes=t.recv,
            busy_ns=t.busy,
            wait_ns=t.wait,
            max_wait_ns=t.max_wait,
            last_count=t.last,
            caused_ns=t.caused,
        )
        for rank, t in sorted(state.ranks.items())
    )
    kind_skew = None
    if kind in SKEWED_KINDS and not any(t.unknown_send for t in state.ranks.values()):
        totals = [t.complete_send for t in state.ranks.values()]
        if None not in totals:
            kind_skew = skew([t for t in totals if t is not None])
    destinations = tuple(Destination(r, b) for r, b in sorted(state.destinations.items()))
    hot = max(destinations, key=lambda d: (d.recv_bytes, -d.rank)).rank if destinations else None
    slowest = tuple(sorted(state.late, key=lambda i: (-i.max_wait_ns, i.index))[:SLOWEST])
    caused = {t.rank: t.caused_ns for t in ranks}
    straggler = max(caused, key=lambda r: (caused[r], -r)) if caused else None
    if straggler is not None and caused[straggler] == 0:
        straggler = None
    return KindReport(
        kind=kind,
        collectives=state.collectives,
        incomplete=len(state.partial),
        ranks=ranks,
        skew=kind_skew,
        max_instance_skew=max(state.instance_skews) if state.instance_skews else None,
        destinations=destinations,
        destination_skew=skew([d.recv_bytes for d in destinations]) if destinations else None,
        hot_destination=hot,
        straggler=straggler,
        max_wait_ns=max((t.max_wait_ns for t in ranks), default=0),
        worst=slowest[0] if slowest else None,
        slowest=slowest,
        partial=tuple(state.partial[-SLOWEST:]),
    )
