"""The records of the collective layer: what one rank's trace says about one collective call,
what a file held, and the figures an analysis of many ranks' files produces.

Everything here is immutable and free of torch: the parsers (:mod:`.kineto`, :mod:`.flight`)
turn files into :class:`CallRecord` tuples, :mod:`.analysis` turns those into an
:class:`Analysis`, and the daemon, the CLI and the tests read the same objects.

Times are integer nanoseconds on the clock the trace was written with (Unix time for both
formats). Bytes are message sizes: the elements a rank handed to the collective and got back,
times the element size of their dtype, not the bytes that crossed a wire (a ring all-reduce
moves about twice its message; an all-to-all moves exactly its splits).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

#: Collective kinds whose send volume can differ between ranks by design; δ is reported for
#: them only (an all-reduce's message is the same on every rank, its δ would always be 0).
SKEWED_KINDS = frozenset({"all_to_all"})

#: The kinds nodescope names, keyed by the name squashed to lower-case letters and digits:
#: c10d's op names (``alltoall_base_``), the profiler's ``Collective name`` values
#: (``_allgather_base``, ``all_to_allv``) and the flight recorder's ``gloo:all_reduce``
#: all land on one name per kind.
KIND_NAMES = {
    "allreduce": "all_reduce",
    "allreducecoalesced": "all_reduce",
    "alltoall": "all_to_all",
    "alltoallbase": "all_to_all",
    "alltoallv": "all_to_all",
    "alltoallsingle": "all_to_all",
    "allgather": "all_gather",
    "allgatherbase": "all_gather",
    "allgathercoalesced": "all_gather",
    "allgatherintotensor": "all_gather",
    "allgatherintotensorcoalesced": "all_gather",
    "reducescatter": "reduce_scatter",
    "reducescatterbase": "reduce_scatter",
    "reducescattertensor": "reduce_scatter",
    "reducescattertensorcoalesced": "reduce_scatter",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "gather": "gather",
    "scatter": "scatter",
    "barrier": "barrier",
}

#: Element sizes by dtype name, keyed by the name lower-cased with ``c10::``, spaces and
#: underscores removed. Kineto writes C++ type names (``float``, ``c10::BFloat16``,
#: ``long int``); the profiler's comms metadata and the flight recorder write ScalarType
#: names (``Float``, ``BFloat16``, ``Long``).
DTYPE_BYTES = {
    "float": 4,
    "float32": 4,
    "double": 8,
    "float64": 8,
    "half": 2,
    "float16": 2,
    "bfloat16": 2,
    "long": 8,
    "longint": 8,
    "longlong": 8,
    "int64": 8,
    "int64t": 8,
    "int": 4,
    "int32": 4,
    "int32t": 4,
    "short": 2,
    "shortint": 2,
    "int16": 2,
    "int16t": 2,
    "char": 1,
    "signedchar": 1,
    "int8": 1,
    "int8t": 1,
    "byte": 1,
    "unsignedchar": 1,
    "uint8": 1,
    "uint8t": 1,
    "bool": 1,
    "uint16": 2,
    "uint16t": 2,
    "unsignedshort": 2,
    "uint32": 4,
    "uint32t": 4,
    "unsignedint": 4,
    "uint64": 8,
    "uint64t": 8,
    "unsignedlong": 8,
    "complexhalf": 4,
    "complex32": 4,
    "complex<half>": 4,
    "complexfloat": 8,
    "complex64": 8,
    "complex<float>": 8,
    "complexdouble": 16,
    "complex128": 16,
    "complex<double>": 16,
}

_SQUASH = re.compile(r"[^a-z0-9]")
_DTYPE_SQUASH = re.compile(r"c10::|[\s_]")


def kind_of(name: str) -> str | None:
    """The collective kind a name from a trace stands for, or None for anything else (a
    ``wait``, a point-to-point ``send``, an op nodescope does not know)."""
    if len(name) > 200:
        return None
    base = name.split(":")[-1].strip().split(" ")[0] if ":" in name else name.strip()
    return KIND_NAMES.get(_SQUASH.sub("", base.lower()))


def dtype_bytes(name: object) -> int | None:
    """The element size of a dtype name from a trace, or None when it is not one."""
    if not isinstance(name, str) or len(name) > 64:
        return None
    squashed = _DTYPE_SQUASH.sub("", name.lower())
    if squashed.startswith(("float8", "float4")):
        return 1  # float8 variants are one byte; float4_e2m1fn_x2 packs two in one
    return DTYPE_BYTES.get(squashed)


@dataclass(frozen=True)
class Limits:
    """What one analysis reads at most. A file past ``max_file_bytes`` (after
    decompression) is refused; past ``max_events`` events or entries the rest of the file is
    left unread and the file marked truncated; past ``max_files`` files the rest are not
    opened; past ``max_ranks`` distinct ranks the records of further ranks are dropped. Past
    ``max_objects`` or ``max_records`` a file is refused (the daemon gives each file what is
    left of its job's budget)."""

    max_file_bytes: int = 256 << 20
    max_events: int = 5_000_000
    max_files: int = 4096
    max_ranks: int = 65536
    #: Entries of one split list or shape list; a longer one makes its record bad.
    max_list: int = 65536
    #: Objects one file may decode to (``nodescope.collectives.budget``: counted from its
    #: bytes before decoding); a file over it is refused whole.
    max_objects: int = 50_000_000
    #: Call records one file may give; a file over it is refused whole.
    max_records: int = 20_000_000


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One rank's view of one collective call.

    ``key`` is the collective's sequence number in its process group when the trace records
    one (the profiler's ``Seq``, the flight recorder's ``collective_seq_id``); the ranks'
    records of one collective share it. Without one (the c10d ops of a gloo trace) the n-th
    call of a kind in a group is matched with the n-th call of every other rank.

    ``arrive_ns`` is when the rank reached the collective: the call on the CPU, or the
    start of the collective kernel on the device when the trace has device activity.
    ``duration_ns`` is how long the collective ran on this rank (waiting for the others
    included), None when the trace does not time it. ``send_splits`` are the bytes sent to
    each member of the group, in the order of ``group_ranks`` (all-to-all only).
    """

    rank: int
    group: str
    kind: str
    key: int | None
    arrive_ns: int
    duration_ns: int | None
    send_bytes: int | None
    recv_bytes: int | None
    send_splits: tuple[int, ...] | None = None
    group_ranks: tuple[int, ...] | None = None


@dataclass(frozen=True)
class FileReport:
    """What one file gave: its format (``kineto`` or ``flight_recorder``), the rank it
    belongs to, the records kept, the bad ones skipped, whether reading stopped at the event
    cap, and why the whole file was refused when it was."""

    path: str
    format: str | None
    rank: int | None
    records: int
    skipped: int
    truncated: bool
    error: str | None = None
    #: The bound on the objects decoding the file built (``nodescope.collectives.budget``).
    objects: int = 0
    #: How many ranks the job has, as the file says (None when it does not).
    world_size: int | None = None


@dataclass(frozen=True)
class ParsedFile:
    report: FileReport
    calls: tuple[CallRecord, ...]


@dataclass(frozen=True)
class RankFigures:
    """One rank's totals over every collective of one kind.

    ``wait_ns`` is the time the rank spent waiting for the last rank to arrive, summed;
    ``caused_ns`` the longest wait it imposed on the others, summed over the collectives it
    reached last (``last_count`` of them)."""

    rank: int
    calls: int
    send_bytes: int | None
    recv_bytes: int | None
    busy_ns: int | None
    wait_ns: int
    max_wait_ns: int
    last_count: int
    caused_ns: int


@dataclass(frozen=True)
class Destination:
    """Bytes an all-to-all delivered to one rank, from the senders' split sizes."""

    rank: int
    recv_bytes: int


@dataclass(frozen=True)
class Instance:
    """One collective as every rank that recorded it saw it: the rank that arrived last, the
    longest time another rank waited for it, and the ranks that did not record it."""

    kind: str
    group: str
    index: int
    ranks: tuple[int, ...]
    straggler: int | None
    max_wait_ns: int
    skew: float | None
    #: Ranks that recorded other collectives of this kind but not this one: in a flight
    #: recorder dump taken on a hang, the ranks that never reached it.
    missing: tuple[int, ...] = ()


@dataclass(frozen=True)
class KindReport:
    """Every collective of one kind across the ranks.

    ``skew`` is δ = std/mean (population standard deviation) of the ranks' total send bytes,
    for the kinds in :data:`SKEWED_KINDS`; ``max_instance_skew`` the largest δ of a single
    collective. ``destinations`` are the bytes each rank received, summed from the senders'
    splits, with their own δ and the rank that received most (``hot_destination``): the rank
    holding the experts the router favours. ``straggler`` is the rank that made the others
    wait longest in total; ``worst`` the collective with the longest single wait, and
    ``slowest`` the few with the longest waits."""

    kind: str
    collectives: int
    incomplete: int
    ranks: tuple[RankFigures, ...]
    skew: float | None
    max_instance_skew: float | None
    destinations: tuple[Destination, ...]
    destination_skew: float | None
    hot_destination: int | None
    straggler: int | None
    max_wait_ns: int
    worst: Instance | None
    #: The collectives with the longest waits, longest first (at most :data:`SLOWEST`), each
    #: with the rank that arrived last.
    slowest: tuple[Instance, ...] = ()
    #: The last collectives (at most :data:`SLOWEST`) that some rank did not record.
    partial: tuple[Instance, ...] = ()


#: How many of a kind's collectives a report lists by their wait.
SLOWEST = 10


@dataclass(frozen=True)
class KindSummary:
    kind: str
    skew: float | None
    straggler: int | None
    max_wait_ns: int


@dataclass(frozen=True)
class JobSummary:
    """The few figures a job's report and the daemon's metrics carry: per kind δ, the
    straggler rank and the longest wait; over all kinds the worst of each."""

    kinds: tuple[KindSummary, ...]
    max_skew: float | None
    straggler: int | None
    max_wait_ns: int


@dataclass(frozen=True)
class Analysis:
    files: tuple[FileReport, ...]
    ranks: tuple[int, ...]
    kinds: tuple[KindReport, ...]
    #: Files named but not opened because of ``Limits.max_files``.
    files_dropped: int = 0
    #: How many ranks the job has: the largest the files name, None when none names one.
    world_size: int | None = None

    def missing_ranks(self) -> tuple[tuple[int, int], ...]:
        """The ranks of the world no file was read for, as (first, last) runs: the gaps
        between the ranks read, so a world of 65536 with one rank read is one run, not a
        list of 65535 numbers."""
        if self.world_size is None:
            return ()
        runs = []
        expected = 0
        for rank in [r for r in self.ranks if r < self.world_size] + [self.world_size]:
            if rank > expected:
                runs.append((expected, rank - 1))
            expected = rank + 1
        return tuple(runs)

    def missing_count(self) -> int:
        return sum(last - first + 1 for first, last in self.missing_ranks())

    def kind(self, name: str) -> KindReport | None:
        return next((k for k in self.kinds if k.kind == name), None)

    def summary(self) -> JobSummary:
        kinds = tuple(KindSummary(k.kind, k.skew, k.straggler, k.max_wait_ns) for k in self.kinds)
        skews = [k.skew for k in self.kinds if k.skew is not None]
        caused: dict[int, int] = {}
        for report in self.kinds:
            for figures in report.ranks:
                caused[figures.rank] = caused.get(figures.rank, 0) + figures.caused_ns
        straggler = max(caused, key=lambda r: (caused[r], -r)) if caused else None
        if straggler is not None and caused[straggler] == 0:
            straggler = None
        return JobSummary(
            kinds=kinds,
            max_skew=max(skews) if skews else None,
            straggler=straggler,
            max_wait_ns=max((k.max_wait_ns for k in self.kinds), default=0),
        )


def skew(values: list[int]) -> float | None:
    """δ = population std / mean of ``values``; None with fewer than two values or a mean
    of zero (nothing sent: no imbalance to speak of)."""
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    if mean <= 0:
        return None
    variance = sum((v - mean) ** 2 for v in values) / len(values)
    result = math.sqrt(variance) / mean
    return result if math.isfinite(result) else None
