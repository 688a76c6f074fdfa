"""The report of one bandwidth probe (``nodescope probe``): typed records, JSON schema, parser.

The probe runs torch in its own process (``python -m nodescope.probe``) and prints this report
as JSON; the daemon reads it back with :func:`parse_report` without importing torch. Figures
follow nccl-tests' conventions (``doc/PERFORMANCE.md`` of NVIDIA/nccl-tests): bandwidth is
bytes moved per second of wall time on the device (``algbw``), and an all-reduce's ``busbw``
is ``algbw × 2(n−1)/n``, the rate each link carries, comparable with the hardware's peak.
Link capacities are those of :mod:`nodescope.model.topology` (per direction, after line
encoding). Of nodescope it imports only the error type and the JSON helper.
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

SCHEMA_VERSION = 1

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
    peer access (otherwise the copy is staged through host memory)."""

    src: int
    dst: int
    size_bytes: int
    bytes_per_second: float
    latency_seconds: float
    peer_access: bool


@dataclass(frozen=True, slots=True)
class PairAsymmetry:
    """How much the two directions between ``a`` and ``b`` (``a < b``) differ:
    ``|x − y| / mean(x, y)`` for bandwidth and latency; ``slower`` names the slower
    direction as ``"src->dst"`` and ``flagged`` says whether a threshold was passed."""

    a: int
    b: int
    bandwidth_asymmetry: float
    latency_asymmetry: float
    slower: str
    flagged: bool


@dataclass(frozen=True, slots=True)
class AllReducePoint:
    size_bytes: int
    seconds: float
    algbw_bytes_per_second: float
    busbw_bytes_per_second: float


@dataclass(frozen=True, slots=True)
class AllReduceResult:
    """A local all-reduce over ``ranks`` processes with torch.distributed (``nccl`` on GPUs,
    ``gloo`` for the CPU stand-in); ``avg_busbw`` is the mean over sizes as nccl-tests'
    "Avg bus bandwidth"."""

    backend: str
    ranks: int
    dtype: str
    points: tuple[AllReducePoint, ...]
    peak_busbw_bytes_per_second: float
    avg_busbw_bytes_per_second: float


@dataclass(frozen=True, slots=True)
class ThresholdFailure:
    """A threshold of ``[probe]`` the measurement did not meet; ``message`` is one line."""

    check: str
    subject: str
    value: float
    limit: float
    message: str


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
_ALLREDUCE = _object(
    {
        "backend": _STR,
        "ranks": _INT,
        "dtype": _STR,
        "points": _array(_AR_POINT),
        "peak_busbw_bytes_per_second": _NUM,
        "avg_busbw_bytes_per_second": _NUM,
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


class _Reader:
    """Typed field access on decoded JSON; every mismatch is a ParseError naming the path."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, message: str) -> ParseError:
        return ParseError(self.source, f"{where}: {message}")

    def obj(self, value: Any, where: str, keys: Mapping[str, Any]) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(where, "expected an object")
        missing = sorted(set(keys["required"]) - set(value))
        if missing:
            raise self.fail(where, f"missing {', '.join(missing)}")
        return value

    def integer(self, value: Any, where: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(where, "expected an integer")
        return value

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
    fields the daemon uses) raises :class:`ParseError` naming the field."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        line = getattr(exc, "lineno", None)
        raise ParseError(source, f"not JSON: {getattr(exc, 'msg', exc)}", line) from None
    r = _Reader(source)
    top = r.obj(data, "report", REPORT_SCHEMA)
    version = r.integer(top["schema_version"], "schema_version")
    if version != SCHEMA_VERSION:
        raise r.fail("schema_version", f"{version} is not {SCHEMA_VERSION}")
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
        )

    def ar_point(v: Any, w: str) -> AllReducePoint:
        o = r.obj(v, w, _AR_POINT)
        return AllReducePoint(
            size_bytes=r.integer(o["size_bytes"], f"{w}.size_bytes"),
            seconds=r.number(o["seconds"], f"{w}.seconds"),
            algbw_bytes_per_second=r.number(o["algbw_bytes_per_second"], f"{w}.algbw"),
            busbw_bytes_per_second=r.number(o["busbw_bytes_per_second"], f"{w}.busbw"),
        )

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
    )


#: The ``probe`` source's records: the last report of the fabric probe.
PROBE = SourceKey("probe", ProbeReport)
