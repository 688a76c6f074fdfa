"""The report of one bandwidth probe (``nodescope probe``): typed records, JSON schema, parser.

The probe runs torch in its own process (``python -m nodescope.probe``) and prints this report
as JSON; the daemon reads it back with :func:`parse_report` without importing torch. Figures
follow nccl-tests' conventions (``doc/PERFORMANCE.md`` of NVIDIA/nccl-tests): bandwidth is
bytes moved per second of wall time on the device (``algbw``), and an all-reduce's ``busbw``
is ``algbw × 2(n−1)/n``, the rate each link carries, comparable with the hardware's peak.
Link capacities are those of :mod:`nodescope.model.topology` (per direction, after line
encoding). Of nodescope it imports only the error type and the JSON helper.

Version 2 added the sizes a run measured (``--sizes``), the all-reduce's small-message
latency, each device's NUMA node and each pair's path (``NV#``, PIX … SYS). A version 1 report,
written before an upgrade and still under the run root, reads with those fields empty.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from nodescope.errors import ParseError
from nodescope.jsonout import plain
from nodescope.model.source_key import SourceKey

SCHEMA_VERSION = 2
#: Versions :func:`parse_report` reads; what each later version added is absent from older ones.
READABLE_VERSIONS = (1, 2)

#: The two probe backends: real GPUs, or host memory copies and gloo standing in for them.
BACKENDS = ("cuda", "cpu")
DIRECTIONS = ("h2d", "d2h")

#: Exit statuses of ``nodescope probe``: every threshold held, one did not (the prolog drains
#: the node with the one-line reason on stderr), bad usage or configuration, nothing measured
#: (torch missing, a CUDA error, a timeout).
EXIT_PASSED = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NOT_MEASURED = 3


@dataclass(frozen=True, slots=True)
class ProbeDevice:
    """A device the probe measured: ``index`` is the CUDA index in PCI bus order (the NVML
    index); ``pci_address`` the sysfs BDF; capacities are per direction of the narrowest link
    between the device and its root port, at the trained (``current``) and the maximum speed
    and width, read from sysfs when the probe ran."""

    index: int
    name: str
    pci_address: str | None
    link: str | None
    capacity_bytes_per_second: float | None
    current_capacity_bytes_per_second: float | None
    #: the device's NUMA node from sysfs; ``None`` when unknown (no topology, -1, stand-in)
    numa_node: int | None = None


@dataclass(frozen=True, slots=True)
class CopyPoint:
    size_bytes: int
    seconds: float
    bytes_per_second: float


@dataclass(frozen=True, slots=True)
class CopySeries:
    """One direction of one device over the size sweep; ``peak`` is the best point and
    ``fraction_of_capacity`` the peak over the device's maximum link capacity (``None`` when
    the capacity is unknown, as for the CPU stand-in)."""

    device: int
    direction: str
    pinned: bool
    points: tuple[CopyPoint, ...]
    peak_bytes_per_second: float
    fraction_of_capacity: float | None


@dataclass(frozen=True, slots=True)
class PeerCopy:
    """A copy from device ``src`` to device ``dst``: bandwidth of large copies and the mean
    time of a small one (latency). ``peer_access`` says whether the driver allows direct
    peer access (otherwise the copy is staged through host memory). ``path`` is the class
    of the path between the two (:mod:`nodescope.model.paths`: ``NV#``, PIX, PXB, PHB, NODE,
    SYS), ``None`` where the topology does not place both devices."""

    src: int
    dst: int
    size_bytes: int
    bytes_per_second: float
    latency_seconds: float
    peer_access: bool
    path: str | None = None


@dataclass(frozen=True, slots=True)
class PairAsymmetry:
    """How much the two directions between ``a`` and ``b`` (``a < b``) differ:
    ``|x − y| / mean(x, y)`` for bandwidth and latency; ``slower`` names the slower
    direction as ``"src->dst"`` and ``flagged`` says whether a threshold was passed.
    ``path`` is the path class the slower direction takes and ``numa_a``/``numa_b`` the NUMA
    nodes of ``a`` and ``b`` (``None`` where unknown)."""

    a: int
    b: int
    bandwidth_asymmetry: float
    latency_asymmetry: float
    slower: str
    flagged: bool
    path: str | None = None
    numa_a: int | None = None
    numa_b: int | None = None


@dataclass(frozen=True, slots=True)
class AllReducePoint:
    size_bytes: int
    seconds: float
    algbw_bytes_per_second: float
    busbw_bytes_per_second: float


@dataclass(frozen=True, slots=True)
class AllReduceLatency:
    """The time of one all-reduce of a small message, each of ``iterations`` all-reduces
    timed on its own (the slowest rank's time for each): the latency floor, where a barrier
    of a few microseconds hidden in every collective shows, and the tail above it."""

    size_bytes: int
    iterations: int
    min_seconds: float
    median_seconds: float
    p99_seconds: float


@dataclass(frozen=True, slots=True)
class AllReduceResult:
    """A local all-reduce over ``ranks`` processes with torch.distributed (``nccl`` on GPUs,
    ``gloo`` for the CPU stand-in); ``avg_busbw`` is the mean over sizes as nccl-tests'
    "Avg bus bandwidth"; ``latency`` the small-message figures, smallest size first."""

    backend: str
    ranks: int
    dtype: str
    points: tuple[AllReducePoint, ...]
    peak_busbw_bytes_per_second: float
    avg_busbw_bytes_per_second: float
    latency: tuple[AllReduceLatency, ...] = ()

    @property
    def latency_floor(self) -> AllReduceLatency | None:
        """The figure of the smallest size measured: the floor below which no all-reduce
        on this node goes."""
        return self.latency[0] if self.latency else None


@dataclass(frozen=True, slots=True)
class ThresholdFailure:
    """A threshold of ``[probe]`` the measurement did not meet; ``message`` is one line."""

    check: str
    subject: str
    value: float
    limit: float
    message: str


@dataclass(frozen=True, slots=True)
class SweepSizes:
    """The sizes a run measured, in bytes, ascending: the copy sweep, the all-reduce's
    bandwidth sweep and its small-message latency; ``custom`` when ``--sizes`` chose them."""

    custom: bool
    copy: tuple[int, ...]
    allreduce: tuple[int, ...]
    allreduce_latency: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ProbeReport:
    schema_version: int
    hostname: str
    backend: str
    stand_in: bool
    note: str
    torch_version: str
    quick: bool
    started: float
    finished: float
    devices: tuple[ProbeDevice, ...]
    copies: tuple[CopySeries, ...]
    peers: tuple[PeerCopy, ...]
    asymmetry: tuple[PairAsymmetry, ...]
    allreduce: AllReduceResult | None
    skipped: tuple[str, ...]
    failures: tuple[ThresholdFailure, ...]
    #: ``None`` only in a version 1 report, which did not record them
    sizes: SweepSizes | None = None

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def duration_seconds(self) -> float:
        return self.finished - self.started


# --- JSON schema ------------------------------------------------------------------------------

_NUM = {"type": "number"}
_NUM_OR_NULL = {"type": ["number", "null"]}
_INT = {"type": "integer"}
_INT_OR_NULL = {"type": ["integer", "null"]}
_SIZES_LIST = {"type": "array", "items": {"type": "integer", "minimum": 1}}
_STR = {"type": "string"}


def _object(properties: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": dict(properties),
        "required": sorted(properties),
        "additionalProperties": False,
    }


def _array(items: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": dict(items)}


_DEVICE = _object(
    {
        "index": _INT,
        "name": _STR,
        "pci_address": {"type": ["string", "null"]},
        "link": {"type": ["string", "null"]},
        "capacity_bytes_per_second": _NUM_OR_NULL,
        "current_capacity_bytes_per_second": _NUM_OR_NULL,
        "numa_node": _INT_OR_NULL,
    }
)
_COPY_POINT = _object({"size_bytes": _INT, "seconds": _NUM, "bytes_per_second": _NUM})
_COPY = _object(
    {
        "device": _INT,
        "direction": {"enum": list(DIRECTIONS)},
        "pinned": {"type": "boolean"},
        "points": _array(_COPY_POINT),
        "peak_bytes_per_second": _NUM,
        "fraction_of_capacity": _NUM_OR_NULL,
    }
)
_PEER = _object(
    {
        "src": _INT,
        "dst": _INT,
        "size_bytes": _INT,
        "bytes_per_second": _NUM,
        "latency_seconds": _NUM,
        "peer_access": {"type": "boolean"},
        "path": {"type": ["string", "null"]},
    }
)
_ASYM = _object(
    {
        "a": _INT,
        "b": _INT,
        "bandwidth_asymmetry": _NUM,
        "latency_asymmetry": _NUM,
        "slower": _STR,
        "flagged": {"type": "boolean"},
        "path": {"type": ["string", "null"]},
        "numa_a": _INT_OR_NULL,
        "numa_b": _INT_OR_NULL,
    }
)
_AR_POINT = _object(
    {
        "size_bytes": _INT,
        "seconds": _NUM,
        "algbw_bytes_per_second": _NUM,
        "busbw_bytes_per_second": _NUM,
    }
)
_AR_LATENCY = _object(
    {
        "size_bytes": _INT,
        "iterations": _INT,
        "min_seconds": _NUM,
        "median_seconds": _NUM,
        "p99_seconds": _NUM,
    }
)
_ALLREDUCE = _object(
    {
        "backend": _STR,
        "ranks": _INT,
        "dtype": _STR,
        "points": _array(_AR_POINT),
        "peak_busbw_bytes_per_second": _NUM,
        "avg_busbw_bytes_per_second": _NUM,
        "latency": _array(_AR_LATENCY),
    }
)
_SIZES = _object(
    {
        "custom": {"type": "boolean"},
        "copy": _SIZES_LIST,
        "allreduce": _SIZES_LIST,
        "allreduce_latency": _SIZES_LIST,
    }
)
_FAILURE = _object({"check": _STR, "subject": _STR, "value": _NUM, "limit": _NUM, "message": _STR})

#: JSON Schema (draft 2020-12) of the report as ``python -m nodescope.probe --json`` prints it.
REPORT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "nodescope probe report",
    **_object(
        {
            "schema_version": {"const": SCHEMA_VERSION},
            "hostname": _STR,
            "backend": {"enum": list(BACKENDS)},
            "stand_in": {"type": "boolean"},
            "note": _STR,
            "torch_version": _STR,
            "quick": {"type": "boolean"},
            "started": _NUM,
            "finished": _NUM,
            "duration_seconds": _NUM,
            "passed": {"type": "boolean"},
            "devices": _array(_DEVICE),
            "copies": _array(_COPY),
            "peers": _array(_PEER),
            "asymmetry": _array(_ASYM),
            "allreduce": {"oneOf": [{"type": "null"}, _ALLREDUCE]},
            "skipped": _array(_STR),
            "failures": _array(_FAILURE),
            "sizes": _SIZES,
        }
    ),
}


def report_to_json(report: ProbeReport) -> dict[str, Any]:
    """The report as plain JSON values, with ``passed`` and ``duration_seconds`` spelt out."""
    out: dict[str, Any] = plain(report)
    out["duration_seconds"] = report.duration_seconds
    out["passed"] = report.passed
    return out


# --- parser -----------------------------------------------------------------------------------

T = TypeVar("T")
U = TypeVar("U")

#: Keys version 2 added (in whichever object holds them): a version 1 report lacks them.
_ADDED_IN_2 = frozenset({"numa_node", "path", "numa_a", "numa_b", "latency", "sizes"})


class _Reader:
    """Typed field access on decoded JSON; every mismatch is a ParseError naming the path."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.version = SCHEMA_VERSION

    def fail(self, where: str, message: str) -> ParseError:
        return ParseError(self.source, f"{where}: {message}")

    def obj(self, value: Any, where: str, keys: Mapping[str, Any]) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(where, "expected an object")
        required = set(keys["required"])
        if self.version < 2:
            required -= _ADDED_IN_2
        missing = sorted(required - set(value))
        if missing:
            raise self.fail(where, f"missing {', '.join(missing)}")
        return value

    def added(
        self, o: Mapping[str, Any], key: str, where: str, read: Callable[[Any, str], T], old: U
    ) -> T | U:
        """A key version 2 added: ``old`` when an older report lacks it, else read strictly."""
        if self.version < 2 and key not in o:
            return old
        return read(o[key], f"{where}.{key}" if where else key)

    def integer(self, value: Any, where: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(where, "expected an integer")
        return value

    def opt_integer(self, value: Any, where: str) -> int | None:
        return None if value is None else self.integer(value, where)

    def size(self, value: Any, where: str) -> int:
        number = self.integer(value, where)
        if number < 1:
            raise self.fail(where, f"size {number} is not above 0")
        return number

    def number(self, value: Any, where: str) -> float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise self.fail(where, "expected a number")
        number = float(value)
        if not math.isfinite(number):
            raise self.fail(where, "expected a finite number")
        return number

    def opt_number(self, value: Any, where: str) -> float | None:
        return None if value is None else self.number(value, where)

    def string(self, value: Any, where: str) -> str:
        if not isinstance(value, str):
            raise self.fail(where, "expected a string")
        return value

    def opt_string(self, value: Any, where: str) -> str | None:
        return None if value is None else self.string(value, where)

    def boolean(self, value: Any, where: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(where, "expected true or false")
        return value

    def items(self, value: Any, where: str, item: Callable[[Any, str], T]) -> tuple[T, ...]:
        if not isinstance(value, list):
            raise self.fail(where, "expected an array")
        return tuple(item(v, f"{where}[{i}]") for i, v in enumerate(value))


def parse_report(text: str, source: str = "probe report") -> ProbeReport:
    """A report from its JSON text; anything that does not match :data:`REPORT_SCHEMA` (in the
    fields the daemon uses) raises :class:`ParseError` naming the field. A version 1 report
    (:data:`READABLE_VERSIONS`) reads with the fields version 2 added left empty."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        line = getattr(exc, "lineno", None)
        raise ParseError(source, f"not JSON: {getattr(exc, 'msg', exc)}", line) from None
    r = _Reader(source)
    top = r.obj(data, "report", {"required": ["schema_version"]})
    version = r.integer(top["schema_version"], "schema_version")
    if version not in READABLE_VERSIONS:
        readable = " or ".join(str(v) for v in READABLE_VERSIONS)
        raise r.fail("schema_version", f"{version} is not {readable}")
    r.version = version
    top = r.obj(data, "report", REPORT_SCHEMA)
    backend = r.string(top["backend"], "backend")
    if backend not in BACKENDS:
        raise r.fail("backend", f"{backend!r} is not one of {', '.join(BACKENDS)}")

    def device(v: Any, w: str) -> ProbeDevice:
        o = r.obj(v, w, _DEVICE)
        return ProbeDevice(
            index=r.integer(o["index"], f"{w}.index"),
            name=r.string(o["name"], f"{w}.name"),
            pci_address=r.opt_string(o["pci_address"], f"{w}.pci_address"),
            link=r.opt_string(o["link"], f"{w}.link"),
            capacity_bytes_per_second=r.opt_number(
                o["capacity_bytes_per_second"], f"{w}.capacity_bytes_per_second"
            ),
            current_capacity_bytes_per_second=r.opt_number(
                o["current_capacity_bytes_per_second"], f"{w}.current_capacity_bytes_per_second"
            ),
            numa_node=r.added(o, "numa_node", w, r.opt_integer, None),
        )

    def copy_point(v: Any, w: str) -> CopyPoint:
        o = r.obj(v, w, _COPY_POINT)
        return CopyPoint(
            r.integer(o["size_bytes"], f"{w}.size_bytes"),
            r.number(o["seconds"], f"{w}.seconds"),
            r.number(o["bytes_per_second"], f"{w}.bytes_per_second"),
        )

    def copy(v: Any, w: str) -> CopySeries:
        o = r.obj(v, w, _COPY)
        direction = r.string(o["direction"], f"{w}.direction")
        if direction not in DIRECTIONS:
            raise r.fail(f"{w}.direction", f"{direction!r} is not h2d or d2h")
        return CopySeries(
            device=r.integer(o["device"], f"{w}.device"),
            direction=direction,
            pinned=r.boolean(o["pinned"], f"{w}.pinned"),
            points=r.items(o["points"], f"{w}.points", copy_point),
            peak_bytes_per_second=r.number(o["peak_bytes_per_second"], f"{w}.peak"),
            fraction_of_capacity=r.opt_number(
                o["fraction_of_capacity"], f"{w}.fraction_of_capacity"
            ),
        )

    def peer(v: Any, w: str) -> PeerCopy:
        o = r.obj(v, w, _PEER)
        return PeerCopy(
            src=r.integer(o["src"], f"{w}.src"),
            dst=r.integer(o["dst"], f"{w}.dst"),
            size_bytes=r.integer(o["size_bytes"], f"{w}.size_bytes"),
            bytes_per_second=r.number(o["bytes_per_second"], f"{w}.bytes_per_second"),
            latency_seconds=r.number(o["latency_seconds"], f"{w}.latency_seconds"),
            peer_access=r.boolean(o["peer_access"], f"{w}.peer_access"),
            path=r.added(o, "path", w, r.opt_string, None),
        )

    def asym(v: Any, w: str) -> PairAsymmetry:
        o = r.obj(v, w, _ASYM)
        return PairAsymmetry(
            a=r.integer(o["a"], f"{w}.a"),
            b=r.integer(o["b"], f"{w}.b"),
            bandwidth_asymmetry=r.number(o["bandwidth_asymmetry"], f"{w}.bandwidth_asymmetry"),
            latency_asymmetry=r.number(o["latency_asymmetry"], f"{w}.latency_asymmetry"),
            slower=r.string(o["slower"], f"{w}.slower"),
            flagged=r.boolean(o["flagged"], f"{w}.flagged"),
            path=r.added(o, "path", w, r.opt_string, None),
            numa_a=r.added(o, "numa_a", w, r.opt_integer, None),
            numa_b=r.added(o, "numa_b", w, r.opt_integer, None),
        )

    def ar_point(v: Any, w: str) -> AllReducePoint:
        o = r.obj(v, w, _AR_POINT)
        return AllReducePoint(
            size_bytes=r.integer(o["size_bytes"], f"{w}.size_bytes"),
            seconds=r.number(o["seconds"], f"{w}.seconds"),
            algbw_bytes_per_second=r.number(o["algbw_bytes_per_second"], f"{w}.algbw"),
            busbw_bytes_per_second=r.number(o["busbw_bytes_per_second"], f"{w}.busbw"),
        )

    def ar_latency(v: Any, w: str) -> AllReduceLatency:
        o = r.obj(v, w, _AR_LATENCY)
        figure = AllReduceLatency(
            size_bytes=r.size(o["size_bytes"], f"{w}.size_bytes"),
            iterations=r.integer(o["iterations"], f"{w}.iterations"),
            min_seconds=r.number(o["min_seconds"], f"{w}.min_seconds"),
            median_seconds=r.number(o["median_seconds"], f"{w}.median_seconds"),
            p99_seconds=r.number(o["p99_seconds"], f"{w}.p99_seconds"),
        )
        # The three are order statistics of one set of timings: a report where they are out
        # of order (or a count below 1) was not written by the probe.
        if figure.iterations < 1:
            raise r.fail(f"{w}.iterations", f"{figure.iterations} is not above 0")
        if not 0 <= figure.min_seconds <= figure.median_seconds <= figure.p99_seconds:
            raise r.fail(w, "expected 0 <= min_seconds <= median_seconds <= p99_seconds")
        return figure

    def allreduce(v: Any, w: str) -> AllReduceResult | None:
        if v is None:
            return None
        o = r.obj(v, w, _ALLREDUCE)
        return AllReduceResult(
            backend=r.string(o["backend"], f"{w}.backend"),
            ranks=r.integer(o["ranks"], f"{w}.ranks"),
            dtype=r.string(o["dtype"], f"{w}.dtype"),
            points=r.items(o["points"], f"{w}.points", ar_point),
            peak_busbw_bytes_per_second=r.number(o["peak_busbw_bytes_per_second"], f"{w}.peak"),
            avg_busbw_bytes_per_second=r.number(o["avg_busbw_bytes_per_second"], f"{w}.avg"),
            latency=r.added(o, "latency", w, lambda x, ww: r.items(x, ww, ar_latency), ()),
        )

    def failure(v: Any, w: str) -> ThresholdFailure:
        o = r.obj(v, w, _FAILURE)
        return ThresholdFailure(
            check=r.string(o["check"], f"{w}.check"),
            subject=r.string(o["subject"], f"{w}.subject"),
            value=r.number(o["value"], f"{w}.value"),
            limit=r.number(o["limit"], f"{w}.limit"),
            message=r.string(o["message"], f"{w}.message"),
        )

    def sizes(v: Any, w: str) -> SweepSizes:
        o = r.obj(v, w, _SIZES)
        return SweepSizes(
            custom=r.boolean(o["custom"], f"{w}.custom"),
            copy=r.items(o["copy"], f"{w}.copy", r.size),
            allreduce=r.items(o["allreduce"], f"{w}.allreduce", r.size),
            allreduce_latency=r.items(o["allreduce_latency"], f"{w}.allreduce_latency", r.size),
        )

    return ProbeReport(
        schema_version=version,
        hostname=r.string(top["hostname"], "hostname"),
        backend=backend,
        stand_in=r.boolean(top["stand_in"], "stand_in"),
        note=r.string(top["note"], "note"),
        torch_version=r.string(top["torch_version"], "torch_version"),
        quick=r.boolean(top["quick"], "quick"),
        started=r.number(top["started"], "started"),
        finished=r.number(top["finished"], "finished"),
        devices=r.items(top["devices"], "devices", device),
        copies=r.items(top["copies"], "copies", copy),
        peers=r.items(top["peers"], "peers", peer),
        asymmetry=r.items(top["asymmetry"], "asymmetry", asym),
        allreduce=allreduce(top["allreduce"], "allreduce"),
        skipped=r.items(top["skipped"], "skipped", r.string),
        failures=r.items(top["failures"], "failures", failure),
        sizes=r.added(top, "sizes", "", sizes, None),
    )


#: The ``probe`` source's records: the last report of the fabric probe.
PROBE = SourceKey("probe", ProbeReport)
