"""PyTorch's collective flight recorder: the last N collectives of every process group of one
rank, dumped on a timeout or on request.

torch 2.13 records for gloo as well as NCCL when ``TORCH_FR_BUFFER_SIZE`` (formerly
``TORCH_NCCL_TRACE_BUFFER_SIZE``) is above 0. The watchdog of a timed-out NCCL group writes
the dump to ``${TORCH_FR_DUMP_TEMP_FILE}<rank>`` (``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` before);
``torch._C._distributed_c10d._dump_fr_trace_json()`` returns the same document as JSON and
``_dump_fr_trace()`` as a pickle. The dump does not name its own rank: like torch's own
reader (``torch/distributed/flight_recorder/components/loader.py``) nodescope takes it from
the digits that end the file name.

The document (``version`` "2.10" in torch 2.13) has ``pg_config`` (group name → ``ranks``,
a string ``"[0, 1]"``) and ``entries``, each with ``profiling_name`` (``gloo:all_to_all``,
``nccl:all_reduce``, ``nccl:send 0->1``), ``process_group`` ([name, description]),
``collective_seq_id`` (the same on every rank for one collective of a group),
``time_created_ns`` (when the rank enqueued it), ``input_sizes``/``output_sizes`` (tensor
shapes), ``input_dtypes``/``output_dtypes``, ``is_p2p``, and, where the backend times its
work, ``time_discovered_started_ns``/``time_discovered_completed_ns`` or ``duration_ms``
(gloo leaves them 0). There are no split sizes: an all-to-all's δ comes from the ranks'
totals, with no per-destination figures.

A pickle is decoded by an unpickler that resolves no global at all (:class:`PlainUnpickler`):
the dump holds only dicts, lists, tuples, strings and numbers, and a pickle that names any
class or function — the only way a pickle runs code — is refused.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import Any, NoReturn, TypeGuard

from nodescope.collectives import budget
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

#: The digits that end a dump's file name, before any ``.json``/``.pkl``/``.gz``.
_RANK_SUFFIX = re.compile(r"(\d+)(?:\.[A-Za-z]+)*$")


class PlainUnpickler(pickle.Unpickler):
    """Builds only what pickle's opcodes build by themselves (dicts, lists, tuples, sets,
    strings, bytes, numbers, booleans, None). ``find_class`` — the only way from a pickle to
    a callable, including the copyreg extension codes — refuses every name, and persistent
    ids are refused as well."""

    def find_class(self, module: str, name: str) -> NoReturn:
        raise pickle.UnpicklingError(f"refused: the pickle names {module[:40]}.{name[:40]}")

    def persistent_load(self, pid: Any) -> NoReturn:
        raise pickle.UnpicklingError("refused: the pickle holds a persistent id")


def unpickle(data: bytes) -> object:
    """The plain value a pickle holds, or :class:`BadRecord` when it names anything."""
    try:
        return PlainUnpickler(io.BytesIO(data)).load()
    except RecursionError:
        raise BadRecord("a pickle nested too deep") from None
    except MemoryError:
        raise BadRecord("a pickle too large to build") from None
    except pickle.UnpicklingError as exc:
        raise BadRecord(f"not a readable pickle: {str(exc)[:120]}") from None
    # The unpickler raises whatever its opcodes' arguments provoke (UnpicklingError,
    # EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError,
    # UnicodeDecodeError...); every one of them means the same: not a dump.
    except Exception as exc:
        raise BadRecord(f"not a readable pickle: {type(exc).__name__}") from None


def rank_from_name(path: str) -> int | None:
    name = path.rsplit("/", 1)[-1]
    match = _RANK_SUFFIX.search(name)
    if match is None or len(match.group(1)) > 9:
        return None
    return int(match.group(1))


def is_dump(doc: object) -> TypeGuard[dict[str, Any]]:
    return isinstance(doc, dict) and "entries" in doc and "version" in doc


def parse(
    doc: object, path: str, limits: Limits
) -> tuple[int | None, tuple[CallRecord, ...], int, bool, int | None]:
    """(rank, records, bad entries skipped, truncated at the entry cap, world size) of one
    dump. The world size is one past the highest rank of its process groups (the default
    group holds them all), None when it lists none."""
    if not is_dump(doc):
        raise BadRecord("not a flight recorder dump")
    entries = doc.get("entries")
    if not isinstance(entries, list):
        raise BadRecord("entries is not a list")
    rank = rank_from_name(path)
    if rank is None or rank > limits.max_ranks:
        raise BadRecord("no rank: a dump's file name ends with its rank")
    groups = _group_ranks(doc.get("pg_config"), limits)
    highest = max((max(ranks) for ranks in groups.values()), default=None)
    world_size = highest + 1 if highest is not None and highest < limits.max_ranks else None
    truncated = len(entries) > limits.max_events
    skipped = 0
    records = []
    for entry in entries[: limits.max_events]:
        try:
            record = _entry(entry, rank, groups, limits)
        except BadRecord:
            skipped += 1
            continue
        if record is not None:
            records.append(record)
            # Entries may all be one object referred to a million times (a pickle's memo):
            # the records stop at the budget, not at the entries.
            budget.check_records(len(records), limits.max_records)
    return rank, tuple(records), skipped, truncated, world_size


def _group_ranks(config: object, limits: Limits) -> dict[str, tuple[int, ...]]:
    groups: dict[str, tuple[int, ...]] = {}
    if not isinstance(config, dict):
        return groups
    members = 0
    for name, value in list(config.items())[:4096]:
        if not isinstance(name, str) or not isinstance(value, dict):
            continue
        try:
            ranks = int_list(value.get("ranks"), limits.max_list)
        except BadRecord:
            continue
        if ranks:
            # One rank list referred to from every group (a pickle's memo) is counted once
            # per group: the members the groups list are bounded like the file's objects.
            members += len(ranks)
            if members > limits.max_objects:
                raise budget.OverBudget(f"more than {limits.max_objects} group members")
            groups[name] = ranks
    return groups


def _entry(
    entry: object, rank: int, groups: dict[str, tuple[int, ...]], limits: Limits
) -> CallRecord | None:
    if not isinstance(entry, dict):
        raise BadRecord("an entry that is not an object")
    name = text(entry.get("profiling_name"))
    if entry.get("is_p2p") is True:
        return None  # point-to-point: no collective to match across the group
    kind = kind_of(name)
    if kind is None:
        return None
    group_field = entry.get("process_group")
    if not isinstance(group_field, list | tuple) or not group_field:
        raise BadRecord("no process_group")
    group = text(group_field[0])
    key = integer(entry.get("collective_seq_id"), high=1 << 62)
    arrive = integer(entry.get("time_created_ns"), low=1, high=MAX_NS)
    size = element_bytes(_names(entry.get("input_dtypes")) + _names(entry.get("output_dtypes")))
    send_n = numel(entry.get("input_sizes", []), limits.max_list) if kind != "barrier" else 0
    recv_n = numel(entry.get("output_sizes", []), limits.max_list) if kind != "barrier" else 0
    if kind == "barrier":
        size = size or 1
    return CallRecord(
        rank=rank,
        group=group,
        kind=kind,
        key=key,
        arrive_ns=arrive,
        duration_ns=_duration(entry),
        send_bytes=send_n * size if size is not None else None,
        recv_bytes=recv_n * size if size is not None else None,
        send_splits=None,
        group_ranks=groups.get(group),
    )


def _names(value: object) -> list[object]:
    return list(value[:8]) if isinstance(value, list | tuple) else []


def _duration(entry: dict[Any, Any]) -> int | None:
    """The collective's run time where the backend measured it: ``duration_ms`` (NCCL with
    timing enabled), else completion minus start as the watchdog discovered them."""
    millis = entry.get("duration_ms")
    if millis is not None:
        try:
            return round(number(millis, high=1e12) * 1_000_000)
        except BadRecord:
            pass
    try:
        started = integer(entry.get("time_discovered_started_ns", 0), high=MAX_NS)
        completed = integer(entry.get("time_discovered_completed_ns", 0), high=MAX_NS)
    except BadRecord:
        return None
    if started and completed >= started:
        return completed - started
    return None
