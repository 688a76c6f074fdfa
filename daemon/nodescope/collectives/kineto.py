"""PyTorch profiler (Kineto) Chrome-trace files: one rank's collectives.

What torch writes, as found in the files of torch 2.13 (``export_chrome_trace``, or
``tensorboard_trace_handler``'s ``*.pt.trace.json[.gz]``):

* the document's ``distributedInfo`` names the rank (``rank``), the backend and the process
  groups (``pg_config``: ``pg_name``, ``ranks``); ``baseTimeNanoseconds`` is the Unix time
  every event's ``ts`` (microseconds, a float) counts from, the same base in every process
  of the job, so the ranks' times compare directly (on one host; across hosts as well as
  their clocks agree);
* every c10d call is a ``cpu_op`` named ``c10d::<op>`` on the calling thread: its ``ts`` is
  when the rank called the collective. With ``record_shapes=True`` its ``Input Dims`` and
  ``Input type`` give the tensors' shapes and dtypes in the op's argument order, and
  ``Concrete Inputs`` the integer lists: for ``c10d::alltoall_base_`` entry 3 holds the
  output (receive) split sizes and entry 4 the input (send) split sizes, in elements;
* with gloo, the work itself is a ``user_annotation`` named ``gloo:<collective>`` on one of
  gloo's worker threads: its ``dur`` is how long the collective ran on this rank, waiting for
  the others included, and its ``Input type`` is the dtype (a ``c10d::allreduce_`` takes a
  tensor list, whose dtype the op event does not record);
* with NCCL, c10d also records a ``record_param_comms`` op whose ``args`` carry the
  collective's metadata — ``Collective name``, ``dtype``, ``In msg nelems``, ``Out msg
  nelems``, ``In split size``, ``Out split size`` (strings ``"[1, 2]"``, cut to 30 entries
  and ``...``), ``Process Group Name``, ``Process Group Ranks``, ``Rank``, ``Seq`` — and the
  profiler copies the same keys onto the collective's GPU kernel event (``cat`` ``kernel``).
  These are taken from torch's source (``torch/csrc/profiler/util.h``, ``saveNcclMeta``):
  gloo does not record them, so no file made on a CPU-only machine has them.

Records are taken from the richest source the file has: device kernels with the metadata
(arrival and duration on the device), else ``record_param_comms`` ops (arrival on the CPU),
else the c10d ops paired in order with the backend's ``<backend>:<kind>`` annotations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nodescope.collectives.model import CallRecord, Limits, kind_of
from nodescope.collectives.values import (
    MAX_NS,
    BadRecord,
    element_bytes,
    int_list,
    integer,
    number,
    numel,
    text,
)

#: Backends whose work appears as ``<backend>:<kind>`` annotations.
BACKENDS = frozenset({"gloo", "nccl", "ncclx", "rccl", "xccl", "mpi", "ucc", "hccl"})

#: For each c10d op: the argument holding what the rank sends and the one holding what it
#: receives (the op schemas of ``torch.ops.c10d``; None where the op has no such side).
C10D_ARGS: dict[str, tuple[int | None, int | None]] = {
    "allreduce_": (0, 0),
    "allreduce_coalesced_": (0, 0),
    "broadcast_": (0, 0),
    "reduce_": (0, 0),
    "alltoall_": (1, 0),
    "alltoall_base_": (1, 0),
    "allgather_": (1, 0),
    "_allgather_base_": (1, 0),
    "allgather_coalesced_": (1, 0),
    "allgather_into_tensor_coalesced_": (1, 0),
    "reduce_scatter_": (1, 0),
    "_reduce_scatter_base_": (1, 0),
    "reduce_scatter_tensor_coalesced_": (1, 0),
    "gather_": (1, 0),
    "scatter_": (1, 0),
    "barrier": (None, None),
}

#: ``c10d::alltoall_base_``'s ``Concrete Inputs`` entries for the receive and send splits.
ALLTOALL_RECV_SPLITS = 3
ALLTOALL_SEND_SPLITS = 4

#: Names that are not dtypes in an ``Input type`` list.
_NOT_DTYPES = frozenset({"", "TensorList", "GenericList", "ScalarList", "Scalar", "Int"})


@dataclass(frozen=True)
class _Event:
    name: str
    cat: str
    ts_ns: int
    dur_ns: int
    args: dict[str, Any]


@dataclass
class _Tally:
    skipped: int = 0
    #: One tuple per distinct rank or split list: records of one group share it, and a
    #: document that refers to one long list from every event (a pickle's memo) costs that
    #: list once, not once per record.
    shared: dict[tuple[int, ...], tuple[int, ...]] = field(default_factory=dict)

    def share(self, values: tuple[int, ...] | None) -> tuple[int, ...] | None:
        return None if values is None else self.shared.setdefault(values, values)


def parse(
    doc: object, limits: Limits
) -> tuple[int | None, tuple[CallRecord, ...], int, bool, int | None]:
    """(rank, records, bad records skipped, truncated at the event cap, world size) of one
    decoded trace. The world size is ``distributedInfo``'s ``world_size``, else the size of
    its one process group, None when the trace names neither.

    Raises :class:`BadRecord` when the document is not a Kineto trace at all or names no
    rank."""
    if isinstance(doc, dict):
        events = doc.get("traceEvents")
        info = doc.get("distributedInfo")
        base = doc.get("baseTimeNanoseconds", 0)
    elif isinstance(doc, list):
        events, info, base = doc, None, 0
    else:
        raise BadRecord("not a Chrome trace")
    if not isinstance(events, list):
        raise BadRecord("no traceEvents list")
    try:
        base_ns = integer(base, high=MAX_NS)
    except BadRecord:
        base_ns = 0
    rank, pg_name, pg_ranks = _distributed_info(info, limits)
    world_size = _world_size(info, pg_ranks, limits)
    truncated = len(events) > limits.max_events
    tally = _Tally()
    kernels: list[_Event] = []
    comms: list[_Event] = []
    ops: list[_Event] = []
    work: list[_Event] = []
    for raw in events[: limits.max_events]:
        event = _event(raw, base_ns, tally)
        if event is None:
            continue
        if "Collective name" in event.args:
            (kernels if event.cat == "kernel" else comms).append(event)
        elif event.name.startswith("c10d::"):
            ops.append(event)
        elif event.cat == "user_annotation" and event.name.split(":")[0] in BACKENDS:
            work.append(event)
    if rank is None:
        rank = _rank_from_comms(comms or kernels)
    if rank is None:
        raise BadRecord("no rank: the trace has no distributedInfo")
    if kernels or comms:
        records = _from_comms(
            kernels or comms, rank, device=bool(kernels), limits=limits, tally=tally
        )
    else:
        records = _from_ops(ops, work, rank, (pg_name, pg_ranks), limits, tally)
    return rank, tuple(records), tally.skipped, truncated, world_size


def _world_size(info: object, pg_ranks: tuple[int, ...] | None, limits: Limits) -> int | None:
    """How many ranks the job has: one number read, bounded like a rank."""
    if isinstance(info, dict):
        try:
            size = integer(info.get("world_size"), high=limits.max_ranks)
        except BadRecord:
            size = 0
        if size > 0:
            return size
    if pg_ranks and max(pg_ranks) < limits.max_ranks:
        return max(pg_ranks) + 1
    return None


def _distributed_info(
    info: object, limits: Limits
) -> tuple[int | None, str, tuple[int, ...] | None]:
    """The rank, and the name and ranks of the group when the trace has exactly one (the
    c10d op events do not say which group a call went to)."""
    if not isinstance(info, dict):
        return None, "", None
    try:
        rank: int | None = integer(info.get("rank"), high=limits.max_ranks)
    except BadRecord:
        rank = None
    groups = info.get("pg_config")
    pg_ranks = None
    pg_name = ""
    if isinstance(groups, list) and len(groups) == 1 and isinstance(groups[0], dict):
        try:
            pg_ranks = int_list(groups[0].get("ranks"), limits.max_list)
            pg_name = text(groups[0].get("pg_name", ""))
        except BadRecord:
            pg_ranks, pg_name = None, ""
    return rank, pg_name, pg_ranks


def _event(raw: object, base_ns: int, tally: _Tally) -> _Event | None:
    """A complete (``ph`` X) event with the fields the parser reads, or None for every
    other event (metadata, flows, counters); a complete event that cannot be read counts
    as skipped."""
    if not isinstance(raw, dict) or raw.get("ph") != "X":
        return None
    name = raw.get("name")
    args = raw.get("args", {})
    if not isinstance(name, str) or len(name) > 400:
        return None  # collective events have short names; Python frames can be long
    interesting = (
        (isinstance(args, dict) and "Collective name" in args)
        or name.startswith("c10d::")
        or name.split(":")[0] in BACKENDS
    )
    if not interesting:
        return None
    try:
        if not isinstance(args, dict):
            raise BadRecord("args is not an object")
        cat = raw.get("cat", "")
        ts_us = number(raw.get("ts"), high=MAX_NS / 1000)
        dur_us = number(raw.get("dur", 0), high=MAX_NS / 1000)
        ts_ns = base_ns + round(ts_us * 1000)
        if ts_ns > MAX_NS:
            raise BadRecord("a timestamp past any clock")
        return _Event(name, cat if isinstance(cat, str) else "", ts_ns, round(dur_us * 1000), args)
    except BadRecord:
        tally.skipped += 1
        return None


def _rank_from_comms(events: list[_Event]) -> int | None:
    for event in events:
        try:
            return integer(event.args.get("Rank"), high=1 << 31)
        except BadRecord:
            continue
    return None


def _from_comms(
    events: list[_Event], rank: int, *, device: bool, limits: Limits, tally: _Tally
) -> list[CallRecord]:
    records = []
    for event in events:
        args = event.args
        try:
            name = text(args.get("Collective name"))
            kind = kind_of(name)
            if kind is None:
                continue  # "wait", send/recv and ops nodescope does not analyse
            size = element_bytes([args.get("dtype")])
            in_n = integer(args.get("In msg nelems"))
            out_n = integer(args.get("Out msg nelems"))
            group = args.get("Process Group Name", "")
            group = text(group) if group is not None else ""
            group_ranks = tally.share(int_list(args.get("Process Group Ranks"), limits.max_list))
            seq = args.get("Seq")
            key = integer(seq, high=1 << 62) if seq is not None else None
            splits = None
            if kind == "all_to_all" and size is not None:
                elements = int_list(args.get("In split size"), limits.max_list)
                splits = _splits(elements, in_n, group_ranks, args.get("Group size"))
                splits = tally.share(
                    tuple(e * size for e in splits) if splits is not None else None
                )
            records.append(
                CallRecord(
                    rank=rank,
                    group=group,
                    kind=kind,
                    key=key,
                    arrive_ns=event.ts_ns,
                    duration_ns=event.dur_ns if device else None,
                    send_bytes=in_n * size if size is not None else None,
                    recv_bytes=out_n * size if size is not None else None,
                    send_splits=splits,
                    group_ranks=group_ranks or None,
                )
            )
        except BadRecord:
            tally.skipped += 1
    return records


def _splits(
    elements: tuple[int, ...] | None,
    total: int,
    group_ranks: tuple[int, ...] | None,
    group_size: object,
) -> tuple[int, ...] | None:
    """Per-destination elements. Split sizes count rows of the first dimension, so they are
    scaled by the elements of a row (the message over the rows). An empty split list means
    equal splits (what ``all_to_all_single`` without splits passes), which needs the
    group's size."""
    if elements:
        rows = sum(elements)
        if rows == 0 and total == 0:
            return elements  # a rank with nothing to send this step
        if rows == 0 or total % rows:
            raise BadRecord("split sizes that do not divide the message")
        row = total // rows
        return tuple(e * row for e in elements)
    if elements is None:
        return None  # cut by the profiler: the totals still give δ
    size = len(group_ranks) if group_ranks else None
    if size is None and group_size is not None:
        size = integer(group_size, low=1, high=1 << 31)
    if not size or total % size:
        return None
    return (total // size,) * size


def _from_ops(
    ops: list[_Event],
    work: list[_Event],
    rank: int,
    group: tuple[str, tuple[int, ...] | None],
    limits: Limits,
    tally: _Tally,
) -> list[CallRecord]:
    """Records from the c10d ops, each paired with the n-th annotation of its kind: both
    follow the order the rank issued its collectives in (gloo's worker threads take them
    from one queue), so the order of start times pairs them."""
    by_kind: dict[str, list[_Event]] = {}
    for event in sorted(work, key=lambda e: e.ts_ns):
        kind = kind_of(event.name)
        if kind is not None:
            by_kind.setdefault(kind, []).append(event)
    seen: dict[str, int] = {}
    records = []
    for event in sorted(ops, key=lambda e: e.ts_ns):
        op = event.name.removeprefix("c10d::")
        if op not in C10D_ARGS:
            continue
        kind = kind_of(op)
        if kind is None:
            continue
        index = seen.get(kind, 0)
        seen[kind] = index + 1
        candidates = by_kind.get(kind, [])
        partner = candidates[index] if index < len(candidates) else None
        try:
            records.append(_op_record(event, op, kind, partner, rank, group, limits, tally))
        except BadRecord:
            tally.skipped += 1
    return records


def _op_record(
    event: _Event,
    op: str,
    kind: str,
    partner: _Event | None,
    rank: int,
    group: tuple[str, tuple[int, ...] | None],
    limits: Limits,
    tally: _Tally,
) -> CallRecord:
    pg_name, pg_ranks = group
    args = event.args
    dims = args.get("Input Dims")
    types = args.get("Input type")
    if not isinstance(dims, list) or not isinstance(types, list) or len(dims) != len(types):
        raise BadRecord("no shapes: the profiler ran without record_shapes")
    send_arg, recv_arg = C10D_ARGS[op]
    if len(dims) <= max(send_arg or 0, recv_arg or 0):
        raise BadRecord("fewer arguments than the op takes")
    names: list[object] = [t for t in types if t not in _NOT_DTYPES]
    if partner is not None:
        partner_types = partner.args.get("Input type")
        if isinstance(partner_types, list):
            names += partner_types
    size = element_bytes(names)
    if kind == "barrier":
        size = size or 1
        send_n = recv_n = 0
    else:
        send_n = numel(dims[send_arg], limits.max_list) if send_arg is not None else 0
        recv_n = numel(dims[recv_arg], limits.max_list) if recv_arg is not None else 0
    splits = None
    if op == "alltoall_base_" and size is not None:
        concrete = args.get("Concrete Inputs")
        if isinstance(concrete, list) and len(concrete) > ALLTOALL_SEND_SPLITS:
            elements = int_list(concrete[ALLTOALL_SEND_SPLITS], limits.max_list)
            elements = _splits(elements, send_n, pg_ranks, None)
            splits = tuple(e * size for e in elements) if elements is not None else None
    elif op == "alltoall_" and size is not None and isinstance(dims[1], list):
        splits = tuple(numel(d, limits.max_list) * size for d in dims[1])
    return CallRecord(
        rank=rank,
        group=pg_name,
        kind=kind,
        key=None,
        arrive_ns=event.ts_ns,
        duration_ns=partner.dur_ns if partner is not None else None,
        send_bytes=send_n * size if size is not None else None,
        recv_bytes=recv_n * size if size is not None else None,
        send_splits=tally.share(splits),
        group_ranks=pg_ranks,
    )
