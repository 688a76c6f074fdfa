"""Scenario files, format ``nodescope-scenario/1``: the hardware, jobs and timeline of a
simulated node, and what the daemon must show while it runs.

The format is documented in ``docs/scenarios.md`` and, as a JSON schema, in
``nodescope/sim/schema/scenario-v1.schema.json``; the bundled scenarios live in
``nodescope/sim/scenarios/<name>.json``. This module reads a file into frozen records and
checks everything the schema cannot: references between sections (a job's GPUs, an activity's
disk, an NVLink's peer), the PCIe tree itself, value ranges. Every error is a
:class:`~nodescope.errors.ParseError` naming the file and the JSON pointer of the offending
value (``/timeline/3/gpu: no GPU 9 (GPUs: 0-7)``).

Hardware may be shared: ``"hardware": {"base": "dgx-h100", ...}`` takes the hardware of a
bundled scenario (or of a scenario or hardware file, by path relative to this file) and
applies the other keys as a JSON merge patch (RFC 7396): objects merge key by key, any other
value replaces, ``null`` deletes. Keyed collections (GPUs by index, disks, NICs, mounts,
PCIe functions by address) are objects for exactly that reason.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from nodescope.errors import ParseError
from nodescope.sim.expect import Expectations, parse_expectations
from nodescope.sim.lspci import (
    BusNumbers,
    ExpressType,
    LspciDevice,
    LspciDump,
    bridge_chains,
    parse_lspci_vvv,
)

FORMAT = "nodescope-scenario/1"
HARDWARE_FORMAT = "nodescope-hardware/1"

PACKAGE_DIR = Path(__file__).resolve().parent
SCENARIO_DIR = PACKAGE_DIR / "scenarios"
DATA_DIR = PACKAGE_DIR / "data"
SCHEMA_PATH = PACKAGE_DIR / "schema" / "scenario-v1.schema.json"

_BDF = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[01][0-9a-f]\.[0-7]\Z")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}\Z")
_DISK = re.compile(r"nvme([0-9]{1,3})n([0-9]{1,3})\Z")
_CONTROLLER = re.compile(r"nvme[0-9]{1,3}\Z")
_COMM = re.compile(r"[^\x00/\n]{1,15}\Z")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}\Z")
_PROCESS_REF = re.compile(
    r"(?P<key>[A-Za-z0-9][A-Za-z0-9_.\-]{0,63})(?:#(?P<replica>[0-9]{1,4}))?\Z"
)
_RATE = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,9})? Gb/sec \([0-9]{1,4}X(?: [A-Za-z0-9]+)?\)\Z")
_WCHAN = re.compile(r"[A-Za-z0-9_.]{1,64}\Z")

#: Process states of ``/proc/<pid>/stat`` (fs/proc/array.c ``task_state_array``).
PROCESS_STATES = ("R", "S", "D", "T", "t", "X", "Z", "P", "I")
#: ``memory.events`` keys (Documentation/admin-guide/cgroup-v2.rst).
MEMORY_EVENTS = ("low", "high", "max", "oom", "oom_kill", "oom_group_kill")
NIC_ROLES = ("compute", "storage", "management")
LINK_LAYERS = ("InfiniBand", "Ethernet")
_MAX_PROCESSES = 100_000
_MAX_THREADS = 4096


# --------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True, slots=True)
class CpuLayout:
    """Sockets, cores and SMT threads; one NUMA node per socket, Linux's numbering."""

    sockets: int = 2
    cores_per_socket: int = 56
    threads_per_core: int = 2

    @property
    def cpu_count(self) -> int:
        return self.sockets * self.cores_per_socket * self.threads_per_core


@dataclass(frozen=True, slots=True)
class NvLinkGroup:
    """``count`` NVLinks from a GPU to the device at ``peer`` (sysfs address)."""

    peer: str
    count: int


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    pci: str
    name: str
    uuid: str
    memory_bytes: int
    nvlinks: tuple[NvLinkGroup, ...]

    @property
    def nvlink_count(self) -> int:
        return sum(group.count for group in self.nvlinks)

    def link_peers(self) -> tuple[str, ...]:
        """The peer address of each NVLink, link 0 first."""
        return tuple(group.peer for group in self.nvlinks for _ in range(group.count))


@dataclass(frozen=True, slots=True)
class NvmeDrive:
    disk: str
    controller: str
    pci: str
    major: int
    minor: int
    model: str
    size_bytes: int


@dataclass(frozen=True, slots=True)
class Nic:
    """An RDMA device (``/sys/class/infiniband/<name>``) over one or more PCI functions (a
    RoCE bond spans two). ``capture`` names a device of a bundled InfiniBand capture
    (``h100-node-infiniband/mlx5_0``) whose counter files and starting values it takes."""

    name: str
    pci: tuple[str, ...]
    role: str
    link_layer: str
    rate: str
    ports: int
    hca_type: str
    fw_ver: str
    board_id: str
    node_guid: str
    capture: str | None


@dataclass(frozen=True, slots=True)
class Mount:
    mountpoint: str
    device: str
    fstype: str
    version: str
    server_addr: str
    #: the superblock's device number (anonymous for NFS: major 0)
    major: int
    minor: int

    @property
    def is_nfs(self) -> bool:
        return self.fstype in ("nfs", "nfs4")


@dataclass(frozen=True, slots=True)
class OsSpec:
    hostname: str = "sim"
    uptime_seconds: float = 864_000.0
    #: processes besides the jobs' (kernel threads, daemons, login sessions)
    background_processes: int = 300


@dataclass(frozen=True, slots=True)
class Hardware:
    pcie: LspciDump
    cpu: CpuLayout
    gpus: tuple[Gpu, ...]
    nvswitches: tuple[str, ...]
    nvme: tuple[NvmeDrive, ...]
    nics: tuple[Nic, ...]
    mounts: tuple[Mount, ...]
    os: OsSpec

    def gpu(self, index: int) -> Gpu:
        return self.gpus[index]

    def nic(self, name: str) -> Nic:
        for nic in self.nics:
            if nic.name == name:
                return nic
        raise KeyError(name)

    def mount(self, mountpoint: str) -> Mount:
        for mount in self.mounts:
            if mount.mountpoint == mountpoint:
                return mount
        raise KeyError(mountpoint)


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    """``count`` processes of one kind in a job. ``cgroup`` is ``"task"`` (replica *i* in
    ``step_<s>/user/task_<i>``), ``"batch"``, ``"extern"`` or an absolute cgroup path
    outside the job. ``gpu`` is a GPU index, ``-1`` for "replica *i* uses the job's *i*-th
    GPU", or ``None``. ``threads`` are the extra threads beyond the main one, by name."""

    key: str
    comm: str
    cmdline: str
    count: int
    threads: tuple[tuple[str, int], ...]
    cgroup: str
    state: str
    wchan: str
    gpu: int | None
    gpu_memory_bytes: int | None
    cpu_percent: float
    environ: tuple[tuple[str, str], ...]
    #: resident memory of each process; ``None``: a share of the job's memory.current
    rss_bytes: int | None = None

    @property
    def thread_count(self) -> int:
        return 1 + sum(n for _, n in self.threads)


@dataclass(frozen=True, slots=True)
class Job:
    """A Slurm job with one step besides ``batch`` and ``extern``, laid out as Slurm's
    cgroup/v2 plugin does (docs/datasources.md §5)."""

    id: int
    user: str
    uid: int
    gpus: tuple[int, ...]
    nics: tuple[str, ...]
    step: str
    memory_max_job: int | None
    memory_max_step: int | None
    memory_current_bytes: int
    processes: tuple[ProcessSpec, ...]


@dataclass(frozen=True, slots=True)
class Burst:
    """On for ``on_seconds`` at the start of every ``period_seconds``."""

    period_seconds: float
    on_seconds: float

    def on_time(self, t0: float, t1: float, origin: float) -> float:
        """Seconds of [t0, t1) that fall in on-windows of a pattern starting at ``origin``."""
        return _on_until(t1, origin, self) - _on_until(t0, origin, self)


def _on_until(t: float, origin: float, burst: Burst) -> float:
    if t <= origin:
        return 0.0
    periods, rest = divmod(t - origin, burst.period_seconds)
    return periods * burst.on_seconds + min(rest, burst.on_seconds)


@dataclass(frozen=True, slots=True)
class Activity:
    """One timeline entry: ``kind`` with its parameters, active in [start, end) (``end``
    ``None``: until the end). Instant kinds (``xid``, ``hot_unplug``) happen at ``start``."""

    kind: str
    start: float
    end: float | None
    params: tuple[tuple[str, Any], ...]
    pointer: str = ""

    def get(self, name: str, default: Any = None) -> Any:
        for key, value in self.params:
            if key == name:
                return value
        return default

    def overlap(self, t0: float, t1: float) -> float:
        """Seconds of [t0, t1) during which this activity is active (and on, for bursts)."""
        lo = max(t0, self.start)
        hi = t1 if self.end is None else min(t1, self.end)
        if hi <= lo:
            return 0.0
        burst = self.get("burst")
        if isinstance(burst, Burst):
            return burst.on_time(lo, hi, self.start)
        return hi - lo

    def active_at(self, t: float) -> bool:
        return t >= self.start and (self.end is None or t < self.end)


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    description: str
    tick_seconds: float
    duration_seconds: float
    hardware: Hardware
    jobs: tuple[Job, ...]
    timeline: tuple[Activity, ...]
    expect: Expectations = field(default_factory=Expectations)
    source_path: Path | None = None

    def process_keys(self) -> dict[str, tuple[Job, ProcessSpec]]:
        return {p.key: (job, p) for job in self.jobs for p in job.processes}


# --------------------------------------------------------------------------------------------
# Validation helpers


def pointer_join(pointer: str, key: str | int) -> str:
    """RFC 6901: ``~`` and ``/`` in a key are escaped."""
    token = str(key).replace("~", "~0").replace("/", "~1")
    return f"{pointer}/{token}"


class _Ctx:
    """Where we are: the file (for messages) and its directory (for relative references)."""

    def __init__(self, source: str, base_dir: Path) -> None:
        self.source = source
        self.base_dir = base_dir

    def fail(self, pointer: str, message: str) -> ParseError:
        return ParseError(self.source, f"{pointer or '(document)'}: {message}")

    def obj(
        self, value: Any, pointer: str, known: Collection[str] | None = None
    ) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(pointer, f"must be an object, got {_type_name(value)}")
        if known is not None:
            for key in value:
                if key not in known:
                    raise self.fail(
                        pointer_join(pointer, key),
                        f"unknown key (known: {', '.join(sorted(known))})",
                    )
        return value

    def array(self, value: Any, pointer: str, max_items: int = 100_000) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(pointer, f"must be an array, got {_type_name(value)}")
        if len(value) > max_items:
            raise self.fail(pointer, f"more than {max_items} items")
        return value

    def string(self, value: Any, pointer: str, pattern: re.Pattern[str] | None = None) -> str:
        if not isinstance(value, str):
            raise self.fail(pointer, f"must be a string, got {_type_name(value)}")
        if pattern is not None and not pattern.match(value):
            raise self.fail(pointer, f"{value[:80]!r} is not valid here")
        return value

    def number(
        self,
        value: Any,
        pointer: str,
        minimum: float = 0.0,
        maximum: float | None = None,
        exclusive_minimum: bool = False,
    ) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(pointer, f"must be a number, got {_type_name(value)}")
        number = float(value)
        if not math.isfinite(number):
            raise self.fail(pointer, "must be finite")
        if number < minimum or (exclusive_minimum and number == minimum):
            relation = ">" if exclusive_minimum else ">="
            raise self.fail(pointer, f"must be {relation} {minimum:g}, got {number:g}")
        if maximum is not None and number > maximum:
            raise self.fail(pointer, f"must be <= {maximum:g}, got {number:g}")
        return number

    def integer(
        self, value: Any, pointer: str, minimum: int = 0, maximum: int = (1 << 63) - 1
    ) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer() and math.isfinite(value):
                value = int(value)
            else:
                raise self.fail(pointer, f"must be an integer, got {_type_name(value)}")
        if not minimum <= value <= maximum:
            raise self.fail(pointer, f"must be in {minimum}..{maximum}, got {value}")
        return int(value)

    def boolean(self, value: Any, pointer: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(pointer, f"must be true or false, got {_type_name(value)}")
        return value

    def hex_or_int(self, value: Any, pointer: str, bits: int) -> int:
        if isinstance(value, str):
            if not re.fullmatch(r"0x[0-9a-fA-F]{1,8}", value):
                raise self.fail(pointer, f"{value[:40]!r} is not a 0x-prefixed hex number")
            number = int(value, 16)
        else:
            number = self.integer(value, pointer)
        if number >= 1 << bits:
            raise self.fail(pointer, f"does not fit {bits} bits")
        return number

    def bdf(self, value: Any, pointer: str) -> str:
        text = self.string(value, pointer)
        if not _BDF.match(text):
            raise self.fail(pointer, f"{text[:40]!r} is not a PCI address like 0000:19:00.0")
        return text


def _type_name(value: Any) -> str:
    return {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def _get(obj: Mapping[str, Any], key: str, default: Any) -> Any:
    value = obj.get(key, default)
    return default if value is None else value


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7396 JSON merge patch of ``patch`` onto ``target`` (neither is modified)."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# --------------------------------------------------------------------------------------------
# Files


class _DuplicateKey(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(text: str, source: str) -> Any:
    """JSON as the format allows it: no duplicate keys, no NaN/Infinity."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except _DuplicateKey as exc:
        raise ParseError(source, f"(document): duplicate key {exc.args[0]!r} in an object") from exc
    except json.JSONDecodeError as exc:
        raise ParseError(source, f"(document): not JSON: {exc.msg}", exc.lineno) from exc
    except (ValueError, RecursionError) as exc:
        raise ParseError(source, f"(document): not JSON: {exc}") from exc


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ParseError(str(path), "(document): no such file") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ParseError(str(path), f"(document): unreadable: {exc}") from exc
    return parse_json(text, str(path))


def bundled_scenarios() -> list[str]:
    """Names of the scenarios shipped in ``nodescope/sim/scenarios``."""
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.json"))


def scenario_path(name_or_path: str | Path) -> Path:
    """The file a scenario name or path refers to: a bundled name (no ``/``, no ``.json``)
    resolves to package data, anything else is a path."""
    text = str(name_or_path)
    if isinstance(name_or_path, str) and _NAME.match(text) and not text.endswith(".json"):
        bundled = SCENARIO_DIR / f"{text}.json"
        if bundled.is_file() or not Path(text).exists():
            return bundled
    return Path(name_or_path)


def load_scenario(name_or_path: str | Path) -> Scenario:
    """Load and validate a scenario: a bundled name (``dgx-h100``) or a file path."""
    path = scenario_path(name_or_path)
    if isinstance(name_or_path, str) and path.parent == SCENARIO_DIR and not path.is_file():
        raise ParseError(
            str(name_or_path),
            f"(document): no bundled scenario {name_or_path!r} "
            f"(bundled: {', '.join(bundled_scenarios())}) and no such file",
        )
    return parse_scenario(_read_json(path), path)


def parse_scenario(document: Any, path: Path) -> Scenario:
    """A scenario from its parsed JSON; ``path`` names it in errors and anchors references."""
    ctx = _Ctx(str(path), path.parent)
    top = ctx.obj(
        document,
        "",
        (
            "$schema",
            "format",
            "name",
            "description",
            "tick_seconds",
            "duration_seconds",
            "hardware",
            "jobs",
            "timeline",
            "expect",
        ),
    )
    if top.get("format") != FORMAT:
        raise ctx.fail("/format", f"must be {FORMAT!r}, got {top.get('format')!r}")
    name = ctx.string(top.get("name"), "/name", _NAME)
    description = ctx.string(_get(top, "description", ""), "/description")
    tick = ctx.number(top.get("tick_seconds", 1.0), "/tick_seconds", 0.0, 3600.0, True)
    duration = ctx.number(top.get("duration_seconds"), "/duration_seconds", 0.0, 1e7, True)
    if duration < tick:
        raise ctx.fail("/duration_seconds", f"shorter than one tick ({tick:g} s)")
    if "hardware" not in top:
        raise ctx.fail("/hardware", "missing")
    hardware = _hardware(ctx, resolve_hardware(ctx, top["hardware"], "/hardware", ()))
    jobs = _jobs(ctx, top.get("jobs", []), hardware)
    timeline = _timeline(ctx, top.get("timeline", []), hardware, jobs, duration)
    expect = parse_expectations(top.get("expect"), ctx.source, "/expect")
    return Scenario(name, description, tick, duration, hardware, jobs, timeline, expect, path)


# --------------------------------------------------------------------------------------------
# Hardware


def resolve_hardware(ctx: _Ctx, value: Any, pointer: str, seen: tuple[Path, ...]) -> dict[str, Any]:
    """The hardware object with its ``base`` chain merged in (a JSON document, not checked)."""
    obj = ctx.obj(value, pointer)
    base = obj.get("base")
    patch = {k: v for k, v in obj.items() if k not in ("base", "format", "comment")}
    if base is None:
        return patch
    base_ref = ctx.string(base, pointer_join(pointer, "base"))
    base_path = _reference(ctx, base_ref)
    if base_path in seen:
        raise ctx.fail(pointer_join(pointer, "base"), f"base {base_ref!r} refers back to itself")
    if not base_path.is_file():
        raise ctx.fail(
            pointer_join(pointer, "base"),
            f"no bundled scenario or file {base_ref!r} (bundled: {', '.join(bundled_scenarios())})",
        )
    document = _read_json(base_path)
    base_ctx = _Ctx(str(base_path), base_path.parent)
    top = base_ctx.obj(document, "")
    if top.get("format") == HARDWARE_FORMAT:
        base_hw = resolve_hardware(base_ctx, top, "", (*seen, base_path))
    elif top.get("format") == FORMAT:
        if "hardware" not in top:
            raise base_ctx.fail("/hardware", "missing")
        base_hw = resolve_hardware(base_ctx, top["hardware"], "/hardware", (*seen, base_path))
    else:
        raise base_ctx.fail("/format", f"must be {FORMAT!r} or {HARDWARE_FORMAT!r}")
    # Relative references inside the base stay relative to the base's file.
    pcie = base_hw.get("pcie")
    if isinstance(pcie, dict) and isinstance(pcie.get("lspci"), str):
        base_hw["pcie"] = {**pcie, "lspci": str(_reference(base_ctx, pcie["lspci"], "lspci"))}
    merged = merge_patch(base_hw, patch)
    assert isinstance(merged, dict)
    return merged


def _reference(ctx: _Ctx, ref: str, kind: str = "scenario") -> Path:
    """A bundled name or a path relative to the referring file."""
    if _NAME.match(ref) and "/" not in ref:
        bundled = (
            SCENARIO_DIR / f"{ref}.json" if kind == "scenario" else DATA_DIR / f"lspci-vvv.{ref}"
        )
        if bundled.is_file():
            return bundled
    path = Path(ref)
    return path if path.is_absolute() else (ctx.base_dir / path).resolve()


@lru_cache(maxsize=8)
def _parse_capture(path: str) -> LspciDump:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ParseError(path, f"unreadable: {exc}") from exc
    return parse_lspci_vvv(text, path)


_FUNCTION_KEYS = (
    "class",
    "vendor",
    "device",
    "revision",
    "name",
    "numa_node",
    "express",
    "link_cap",
    "link",
    "bus",
    "aer",
    "driver",
)


def _link(ctx: _Ctx, value: Any, pointer: str) -> tuple[float | None, int | None]:
    if value is None:
        return None, None
    obj = ctx.obj(value, pointer, ("speed_gts", "width"))
    speed_value = obj.get("speed_gts")
    speed = None
    if speed_value is not None:
        speed = ctx.number(speed_value, pointer_join(pointer, "speed_gts"), 0.0, 256.0, True)
    width_value = obj.get("width")
    width = None if width_value is None else ctx.integer(width_value, f"{pointer}/width", 0, 32)
    return speed, width


def _function(
    ctx: _Ctx, bdf: str, value: Any, pointer: str, existing: LspciDevice | None
) -> LspciDevice:
    obj = ctx.obj(value, pointer, _FUNCTION_KEYS)
    if existing is None:
        for key in ("class", "vendor", "device"):
            if key not in obj:
                raise ctx.fail(pointer_join(pointer, key), "missing (a new function needs it)")
        existing = LspciDevice(
            bdf=bdf,
            line=0,
            class_name="",
            class_code=None,
            vendor_name=None,
            vendor_id=None,
            device_name="",
            device_id=None,
            ids_inferred=False,
            revision=None,
            numa_node=None,
            express_type=None,
            link_cap_speed_gts=None,
            link_cap_width=None,
            link_sta_speed_gts=None,
            link_sta_width=None,
            bus=None,
            has_aer=False,
            driver=None,
        )
    changes: dict[str, Any] = {}
    if "class" in obj:
        changes["class_code"] = ctx.hex_or_int(obj["class"], f"{pointer}/class", 24)
    if "vendor" in obj:
        changes["vendor_id"] = ctx.hex_or_int(obj["vendor"], f"{pointer}/vendor", 16)
    if "device" in obj:
        changes["device_id"] = ctx.hex_or_int(obj["device"], f"{pointer}/device", 16)
    if "revision" in obj:
        changes["revision"] = ctx.hex_or_int(obj["revision"], f"{pointer}/revision", 8)
    if "name" in obj:
        changes["device_name"] = ctx.string(obj["name"], f"{pointer}/name")
    if "numa_node" in obj:
        node = obj["numa_node"]
        changes["numa_node"] = (
            None if node is None else ctx.integer(node, f"{pointer}/numa_node", 0, 1023)
        )
    if "express" in obj:
        express = obj["express"]
        if express is None:
            changes["express_type"] = None
        else:
            text = ctx.string(express, f"{pointer}/express")
            try:
                changes["express_type"] = ExpressType(text)
            except ValueError as exc:
                raise ctx.fail(
                    f"{pointer}/express",
                    f"{text!r} is not one of {', '.join(t.value for t in ExpressType)}",
                ) from exc
    if "link_cap" in obj:
        speed, width = _link(ctx, obj["link_cap"], f"{pointer}/link_cap")
        changes["link_cap_speed_gts"], changes["link_cap_width"] = speed, width
    if "link" in obj:
        speed, width = _link(ctx, obj["link"], f"{pointer}/link")
        changes["link_sta_speed_gts"], changes["link_sta_width"] = speed, width
    if "bus" in obj:
        bus = obj["bus"]
        if bus is None:
            changes["bus"] = None
        else:
            bus_obj = ctx.obj(bus, f"{pointer}/bus", ("primary", "secondary", "subordinate"))
            numbers = [
                ctx.integer(bus_obj.get(k), f"{pointer}/bus/{k}", 0, 255)
                for k in ("primary", "secondary", "subordinate")
            ]
            changes["bus"] = BusNumbers(*numbers)
    if "aer" in obj:
        changes["has_aer"] = ctx.boolean(obj["aer"], f"{pointer}/aer")
    if "driver" in obj:
        driver = obj["driver"]
        changes["driver"] = None if driver is None else ctx.string(driver, f"{pointer}/driver")
    return replace(existing, **changes)


def _pcie(ctx: _Ctx, value: Any, pointer: str) -> LspciDump:
    obj = ctx.obj(value, pointer, ("lspci", "functions"))
    base: dict[str, LspciDevice] = {}
    source = ctx.source
    if "lspci" in obj:
        ref = ctx.string(obj["lspci"], f"{pointer}/lspci")
        path = _reference(ctx, ref, "lspci")
        if not path.is_file():
            raise ctx.fail(f"{pointer}/lspci", f"no bundled capture or file {ref!r}")
        dump = _parse_capture(str(path))
        base = {dev.bdf: dev for dev in dump.devices}
        source = dump.source
    functions = ctx.obj(obj.get("functions", {}), f"{pointer}/functions")
    if not base and not functions:
        raise ctx.fail(pointer, "needs an lspci capture or functions")
    devices = dict(base)
    for bdf, spec in functions.items():
        where = pointer_join(f"{pointer}/functions", bdf)
        ctx.bdf(bdf, where)
        devices[bdf] = _function(ctx, bdf, spec, where, devices.get(bdf))
    dump = LspciDump(source, tuple(devices[b] for b in sorted(devices)))
    try:
        bridge_chains(dump)
    except ParseError as exc:
        raise ctx.fail(pointer, f"the PCIe tree is inconsistent: {exc}") from exc
    return dump


_HARDWARE_KEYS = ("pcie", "cpu", "gpus", "nvswitches", "nvme", "nics", "mounts", "os")


def _hardware(ctx: _Ctx, hw: dict[str, Any]) -> Hardware:
    pointer = "/hardware"
    ctx.obj(hw, pointer, _HARDWARE_KEYS)
    if "pcie" not in hw:
        raise ctx.fail(f"{pointer}/pcie", "missing")
    dump = _pcie(ctx, hw["pcie"], f"{pointer}/pcie")
    functions = {dev.bdf: dev for dev in dump.devices}

    def function(value: Any, where: str, wanted: Callable[[int], bool], what: str) -> str:
        bdf = ctx.bdf(value, where)
        dev = functions.get(bdf)
        if dev is None:
            raise ctx.fail(where, f"no PCI function {bdf} in the PCIe tree")
        if dev.class_code is None or not wanted(dev.class_code):
            raise ctx.fail(where, f"{bdf} is not {what} (class {dev.class_code or 0:#08x})")
        return bdf

    cpu_obj = ctx.obj(
        _get(hw, "cpu", {}), f"{pointer}/cpu", ("sockets", "cores_per_socket", "threads_per_core")
    )
    cpu = CpuLayout(
        ctx.integer(cpu_obj.get("sockets", 2), f"{pointer}/cpu/sockets", 1, 16),
        ctx.integer(cpu_obj.get("cores_per_socket", 56), f"{pointer}/cpu/cores_per_socket", 1, 512),
        ctx.integer(cpu_obj.get("threads_per_core", 2), f"{pointer}/cpu/threads_per_core", 1, 8),
    )
    numa_nodes = {d.numa_node for d in dump.devices if d.numa_node is not None}
    if numa_nodes and max(numa_nodes) >= cpu.sockets:
        raise ctx.fail(
            f"{pointer}/cpu/sockets",
            f"the PCIe tree has NUMA node {max(numa_nodes)}: needs at least "
            f"{max(numa_nodes) + 1} sockets",
        )

    nvswitches = tuple(
        function(
            v,
            f"{pointer}/nvswitches/{i}",
            lambda c: c >> 8 == 0x0680,
            "an NVSwitch (class 0x0680)",
        )
        for i, v in enumerate(ctx.array(_get(hw, "nvswitches", []), f"{pointer}/nvswitches", 64))
    )
    if len(set(nvswitches)) != len(nvswitches):
        raise ctx.fail(f"{pointer}/nvswitches", "lists an NVSwitch twice")

    gpus_obj = ctx.obj(_get(hw, "gpus", {}), f"{pointer}/gpus")
    gpu_addresses: dict[str, str] = {}
    for key, spec in gpus_obj.items():
        where = pointer_join(f"{pointer}/gpus", key)
        if not re.fullmatch(r"[0-9]{1,3}", key):
            raise ctx.fail(where, "GPU keys are their NVML indices: 0, 1, ...")
        gpu_addresses[key] = function(
            ctx.obj(spec, where).get("pci"),
            f"{where}/pci",
            lambda c: c >> 16 == 0x03,
            "a display controller (class 0x03)",
        )
    if sorted(int(k) for k in gpus_obj) != list(range(len(gpus_obj))):
        raise ctx.fail(f"{pointer}/gpus", "indices must be 0..N-1 without gaps")
    if len(set(gpu_addresses.values())) != len(gpu_addresses):
        raise ctx.fail(f"{pointer}/gpus", "two GPUs share a PCI address")
    peers = set(nvswitches) | set(gpu_addresses.values())
    gpus: list[Gpu] = []
    for index in range(len(gpus_obj)):
        where = f"{pointer}/gpus/{index}"
        spec = ctx.obj(
            gpus_obj[str(index)], where, ("pci", "name", "uuid", "memory_bytes", "nvlinks")
        )
        groups: list[NvLinkGroup] = []
        links = ctx.array(_get(spec, "nvlinks", []), f"{where}/nvlinks", 64)
        for i, group in enumerate(links):
            g_where = f"{where}/nvlinks/{i}"
            g = ctx.obj(group, g_where, ("peer", "count"))
            peer = ctx.bdf(g.get("peer"), f"{g_where}/peer")
            if peer not in peers or peer == gpu_addresses[str(index)]:
                raise ctx.fail(f"{g_where}/peer", f"{peer} is neither an NVSwitch nor another GPU")
            groups.append(NvLinkGroup(peer, ctx.integer(g.get("count"), f"{g_where}/count", 1, 36)))
        if sum(g.count for g in groups) > 36:
            raise ctx.fail(f"{where}/nvlinks", "more than 36 NVLinks (NVML_NVLINK_MAX_LINKS)")
        uuid_default = f"GPU-{index:08x}-5e1f-4a0b-9c3d-{0x1000 + index:012x}"
        gpus.append(
            Gpu(
                index=index,
                pci=gpu_addresses[str(index)],
                name=ctx.string(_get(spec, "name", "NVIDIA GPU"), f"{where}/name"),
                uuid=ctx.string(
                    _get(spec, "uuid", uuid_default),
                    f"{where}/uuid",
                    re.compile(r"GPU-[0-9a-f-]+\Z"),
                ),
                memory_bytes=ctx.integer(
                    _get(spec, "memory_bytes", 80 * 2**30), f"{where}/memory_bytes"
                ),
                nvlinks=tuple(groups),
            )
        )

    nvme: list[NvmeDrive] = []
    nvme_obj = ctx.obj(_get(hw, "nvme", {}), f"{pointer}/nvme")
    used_pci: dict[str, str] = {}
    for disk, spec in nvme_obj.items():
        where = pointer_join(f"{pointer}/nvme", disk)
        if not _DISK.match(disk):
            raise ctx.fail(where, "disk names are nvme<N>n<M>")
        s = ctx.obj(spec, where, ("pci", "controller", "major", "minor", "model", "size_bytes"))
        pci = function(s.get("pci"), f"{where}/pci", lambda c: c == 0x010802, "an NVMe controller")
        if pci in used_pci:
            raise ctx.fail(f"{where}/pci", f"{pci} already serves {used_pci[pci]}")
        used_pci[pci] = disk
        number = int(_DISK.match(disk).group(1))  # type: ignore[union-attr]
        nvme.append(
            NvmeDrive(
                disk=disk,
                controller=ctx.string(
                    _get(s, "controller", f"nvme{number}"), f"{where}/controller", _CONTROLLER
                ),
                pci=pci,
                major=ctx.integer(_get(s, "major", 259), f"{where}/major", 1, 4095),
                minor=ctx.integer(_get(s, "minor", len(nvme)), f"{where}/minor", 0, 1 << 20),
                model=ctx.string(_get(s, "model", "NVMe SSD"), f"{where}/model"),
                size_bytes=ctx.integer(_get(s, "size_bytes", 3_840_755_982_336), f"{where}/size"),
            )
        )
    if len({(d.major, d.minor) for d in nvme}) != len(nvme):
        raise ctx.fail(f"{pointer}/nvme", "two disks share a major:minor")
    if len({d.controller for d in nvme}) != len(nvme):
        raise ctx.fail(f"{pointer}/nvme", "two disks share a controller")

    nics: list[Nic] = []
    nic_pci: dict[str, str] = {}
    nics_obj = ctx.obj(_get(hw, "nics", {}), f"{pointer}/nics")
    for name, spec in nics_obj.items():
        where = pointer_join(f"{pointer}/nics", name)
        if not re.fullmatch(r"[A-Za-z0-9_]{1,32}", name):
            raise ctx.fail(where, "not an RDMA device name")
        s = ctx.obj(
            spec,
            where,
            (
                "pci",
                "role",
                "link_layer",
                "rate",
                "ports",
                "hca_type",
                "fw_ver",
                "board_id",
                "node_guid",
                "capture",
            ),
        )
        capture_name = s.get("capture")
        capture: dict[str, Any] = {}
        if capture_name is not None:
            capture = _capture_device(ctx, capture_name, f"{where}/capture")
        pcis = ctx.array(s.get("pci"), f"{where}/pci", 8)
        if not pcis:
            raise ctx.fail(f"{where}/pci", "needs at least one PCI function")
        addresses: list[str] = []
        for i, value in enumerate(pcis):
            address = function(
                value, f"{where}/pci/{i}", lambda c: c >> 16 == 0x02, "a network controller"
            )
            if address in nic_pci:
                raise ctx.fail(
                    f"{where}/pci/{i}", f"{address} already belongs to {nic_pci[address]}"
                )
            nic_pci[address] = name
            addresses.append(address)
        port1 = capture.get("ports", {}).get("1", {})
        link_layer = ctx.string(
            _get(s, "link_layer", port1.get("link_layer", "InfiniBand")), f"{where}/link_layer"
        )
        if link_layer not in LINK_LAYERS:
            raise ctx.fail(f"{where}/link_layer", f"must be one of {', '.join(LINK_LAYERS)}")
        role = ctx.string(_get(s, "role", "compute"), f"{where}/role")
        if role not in NIC_ROLES:
            raise ctx.fail(f"{where}/role", f"must be one of {', '.join(NIC_ROLES)}")
        guid_default = f"b83f:d203:00{len(nics):02x}:{0x1A2B + len(nics):04x}"
        nics.append(
            Nic(
                name=name,
                pci=tuple(addresses),
                role=role,
                link_layer=link_layer,
                rate=ctx.string(
                    _get(s, "rate", port1.get("rate", "400 Gb/sec (4X NDR)")),
                    f"{where}/rate",
                    _RATE,
                ),
                ports=ctx.integer(
                    _get(s, "ports", max(1, len(capture.get("ports", {})))), f"{where}/ports", 1, 4
                ),
                hca_type=ctx.string(
                    _get(s, "hca_type", capture.get("hca_type", "MT4129")), f"{where}/hca_type"
                ),
                fw_ver=ctx.string(
                    _get(s, "fw_ver", capture.get("fw_ver", "28.41.1000")), f"{where}/fw_ver"
                ),
                board_id=ctx.string(
                    _get(s, "board_id", capture.get("board_id", "MT_0000000838")),
                    f"{where}/board_id",
                ),
                node_guid=ctx.string(
                    _get(s, "node_guid", guid_default),
                    f"{where}/node_guid",
                    re.compile(r"[0-9a-f]{4}(?::[0-9a-f]{4}){3}\Z"),
                ),
                capture=None if capture_name is None else str(capture_name),
            )
        )

    mounts: list[Mount] = []
    mounts_obj = ctx.obj(_get(hw, "mounts", {}), f"{pointer}/mounts")
    for mountpoint, spec in mounts_obj.items():
        where = pointer_join(f"{pointer}/mounts", mountpoint)
        if not re.fullmatch(r"/[^\s\x00]{0,200}", mountpoint):
            raise ctx.fail(where, "mount points are absolute paths without spaces")
        s = ctx.obj(spec, where, ("device", "fstype", "version", "server_addr", "major", "minor"))
        fstype = ctx.string(
            _get(s, "fstype", "nfs4"), f"{where}/fstype", re.compile(r"[a-z0-9]{1,16}\Z")
        )
        mounts.append(
            Mount(
                mountpoint=mountpoint,
                device=ctx.string(
                    s.get("device"), f"{where}/device", re.compile(r"[^\s\x00]{1,200}\Z")
                ),
                fstype=fstype,
                version=ctx.string(
                    _get(s, "version", "4.2"), f"{where}/version", re.compile(r"[0-9.]{1,8}\Z")
                ),
                server_addr=ctx.string(
                    _get(s, "server_addr", "10.0.0.1"),
                    f"{where}/server_addr",
                    re.compile(r"[0-9a-fA-F.:]{2,45}\Z"),
                ),
                major=ctx.integer(_get(s, "major", 0), f"{where}/major", 0, 4095),
                minor=ctx.integer(_get(s, "minor", 50 + len(mounts)), f"{where}/minor", 0, 255),
            )
        )

    os_obj = ctx.obj(
        _get(hw, "os", {}), f"{pointer}/os", ("hostname", "uptime_seconds", "background_processes")
    )
    os_spec = OsSpec(
        hostname=ctx.string(_get(os_obj, "hostname", "sim"), f"{pointer}/os/hostname", _NAME),
        uptime_seconds=ctx.number(
            _get(os_obj, "uptime_seconds", 864_000), f"{pointer}/os/uptime_seconds", 0, 1e10
        ),
        background_processes=ctx.integer(
            _get(os_obj, "background_processes", 300),
            f"{pointer}/os/background_processes",
            0,
            _MAX_PROCESSES,
        ),
    )
    return Hardware(
        pcie=dump,
        cpu=cpu,
        gpus=tuple(gpus),
        nvswitches=nvswitches,
        nvme=tuple(nvme),
        nics=tuple(nics),
        mounts=tuple(mounts),
        os=os_spec,
    )


@lru_cache(maxsize=8)
def _load_ib_capture(path: str) -> dict[str, Any]:
    document = _read_json(Path(path))
    if not isinstance(document, dict) or not isinstance(document.get("devices"), dict):
        raise ParseError(path, "/devices: missing")
    return document


def load_ib_capture_device(ref: str) -> dict[str, Any] | None:
    """The device ``<capture>/<device>`` of a bundled InfiniBand capture, or ``None``."""
    capture, _, device = ref.partition("/")
    if not _NAME.match(capture) or not device:
        return None
    path = DATA_DIR / f"{capture}.json"
    if not path.is_file():
        return None
    found = _load_ib_capture(str(path))["devices"].get(device)
    return found if isinstance(found, dict) else None


def _capture_device(ctx: _Ctx, value: Any, pointer: str) -> dict[str, Any]:
    ref = ctx.string(value, pointer)
    found = load_ib_capture_device(ref)
    if found is None:
        raise ctx.fail(pointer, f"no bundled InfiniBand capture device {ref!r}")
    return found


# --------------------------------------------------------------------------------------------
# Jobs


def _jobs(ctx: _Ctx, value: Any, hardware: Hardware) -> tuple[Job, ...]:
    jobs: list[Job] = []
    seen_keys: set[str] = set()
    total = hardware.os.background_processes
    for i, spec in enumerate(ctx.array(value, "/jobs", 1000)):
        where = f"/jobs/{i}"
        s = ctx.obj(
            spec,
            where,
            (
                "id",
                "user",
                "uid",
                "gpus",
                "nics",
                "step",
                "memory_max",
                "memory_current_bytes",
                "processes",
            ),
        )
        job_id = ctx.integer(s.get("id"), f"{where}/id", 1, 2**31)
        if any(j.id == job_id for j in jobs):
            raise ctx.fail(f"{where}/id", f"job {job_id} listed twice")
        gpus = tuple(
            _gpu_ref(ctx, g, f"{where}/gpus/{k}", hardware)
            for k, g in enumerate(ctx.array(_get(s, "gpus", []), f"{where}/gpus", 64))
        )
        nics: list[str] = []
        for k, name in enumerate(ctx.array(_get(s, "nics", []), f"{where}/nics", 64)):
            nic = ctx.string(name, f"{where}/nics/{k}")
            if nic not in {n.name for n in hardware.nics}:
                raise ctx.fail(f"{where}/nics/{k}", f"no NIC {nic!r}")
            nics.append(nic)
        memory_max = ctx.obj(_get(s, "memory_max", {}), f"{where}/memory_max", ("job", "step"))
        processes: list[ProcessSpec] = []
        for k, proc in enumerate(ctx.array(_get(s, "processes", []), f"{where}/processes", 1000)):
            p = _process(ctx, proc, f"{where}/processes/{k}", hardware, gpus)
            if p.key in seen_keys:
                raise ctx.fail(f"{where}/processes/{k}/key", f"process key {p.key!r} used twice")
            seen_keys.add(p.key)
            processes.append(p)
            total += p.count
        jobs.append(
            Job(
                id=job_id,
                user=ctx.string(
                    _get(s, "user", "user"),
                    f"{where}/user",
                    re.compile(r"[a-z_][a-z0-9_-]{0,31}\Z"),
                ),
                uid=ctx.integer(_get(s, "uid", 1000), f"{where}/uid", 1, 2**31),
                gpus=gpus,
                nics=tuple(nics),
                step=ctx.string(_get(s, "step", "0"), f"{where}/step", re.compile(r"[0-9]{1,6}\Z")),
                memory_max_job=_limit(ctx, memory_max.get("job"), f"{where}/memory_max/job"),
                memory_max_step=_limit(ctx, memory_max.get("step"), f"{where}/memory_max/step"),
                memory_current_bytes=ctx.integer(
                    _get(s, "memory_current_bytes", 0), f"{where}/memory_current_bytes"
                ),
                processes=tuple(processes),
            )
        )
    if total > _MAX_PROCESSES:
        raise ctx.fail("/jobs", f"{total} processes in all; at most {_MAX_PROCESSES}")
    return tuple(jobs)


def _limit(ctx: _Ctx, value: Any, pointer: str) -> int | None:
    if value is None or value == "max":
        return None
    return ctx.integer(value, pointer, 0)


def _gpu_ref(ctx: _Ctx, value: Any, pointer: str, hardware: Hardware) -> int:
    index = ctx.integer(value, pointer, 0, 1023)
    if index >= len(hardware.gpus):
        span = f"0-{len(hardware.gpus) - 1}" if hardware.gpus else "none"
        raise ctx.fail(pointer, f"no GPU {index} (GPUs: {span})")
    return index


def _process(
    ctx: _Ctx, value: Any, pointer: str, hardware: Hardware, job_gpus: tuple[int, ...]
) -> ProcessSpec:
    s = ctx.obj(
        value,
        pointer,
        (
            "key",
            "comm",
            "cmdline",
            "count",
            "threads",
            "cgroup",
            "state",
            "wchan",
            "gpu",
            "gpu_memory_bytes",
            "cpu_percent",
            "environ",
            "rss_bytes",
        ),
    )
    key = ctx.string(s.get("key"), f"{pointer}/key", _NAME)
    comm = ctx.string(s.get("comm"), f"{pointer}/comm", _COMM)
    count = ctx.integer(_get(s, "count", 1), f"{pointer}/count", 1, _MAX_PROCESSES)
    threads_obj = ctx.obj(_get(s, "threads", {}), f"{pointer}/threads")
    threads: list[tuple[str, int]] = []
    for name, n in threads_obj.items():
        where = pointer_join(f"{pointer}/threads", name)
        if not _COMM.match(name):
            raise ctx.fail(where, "thread names are 1-15 characters, no '/'")
        threads.append((name, ctx.integer(n, where, 1, _MAX_THREADS)))
    if sum(n for _, n in threads) >= _MAX_THREADS:
        raise ctx.fail(f"{pointer}/threads", f"at most {_MAX_THREADS} threads per process")
    cgroup = ctx.string(_get(s, "cgroup", "task"), f"{pointer}/cgroup")
    if cgroup not in ("task", "batch", "extern") and not re.fullmatch(
        r"(/[A-Za-z0-9_@:.\-]{1,64}){1,12}", cgroup
    ):
        raise ctx.fail(
            f"{pointer}/cgroup", "must be task, batch, extern or an absolute cgroup path"
        )
    state = ctx.string(_get(s, "state", "S"), f"{pointer}/state")
    if state not in PROCESS_STATES:
        raise ctx.fail(f"{pointer}/state", f"must be one of {' '.join(PROCESS_STATES)}")
    gpu_value = s.get("gpu")
    gpu: int | None
    if gpu_value is None:
        gpu = None
    elif gpu_value == "each":
        if count > len(job_gpus):
            raise ctx.fail(f"{pointer}/gpu", f"'each' needs a job GPU per process ({count})")
        gpu = -1
    else:
        gpu = _gpu_ref(ctx, gpu_value, f"{pointer}/gpu", hardware)
    environ_obj = ctx.obj(_get(s, "environ", {}), f"{pointer}/environ")
    environ: list[tuple[str, str]] = []
    for name, text in environ_obj.items():
        where = pointer_join(f"{pointer}/environ", name)
        if not _ENV_KEY.match(name):
            raise ctx.fail(where, "not an environment variable name")
        environ.append((name, ctx.string(text, where, re.compile(r"[^\x00]{0,4096}\Z"))))
    memory = s.get("gpu_memory_bytes")
    rss = s.get("rss_bytes")
    return ProcessSpec(
        key=key,
        comm=comm,
        cmdline=ctx.string(
            _get(s, "cmdline", comm), f"{pointer}/cmdline", re.compile(r"[^\x00]{1,4096}\Z")
        ),
        count=count,
        threads=tuple(threads),
        cgroup=cgroup,
        state=state,
        wchan=ctx.string(_get(s, "wchan", "0"), f"{pointer}/wchan", _WCHAN),
        gpu=gpu,
        gpu_memory_bytes=None
        if memory is None
        else ctx.integer(memory, f"{pointer}/gpu_memory_bytes"),
        cpu_percent=ctx.number(
            _get(s, "cpu_percent", 0.0), f"{pointer}/cpu_percent", 0.0, 100.0 * _MAX_THREADS
        ),
        environ=tuple(environ),
        rss_bytes=None if rss is None else ctx.integer(rss, f"{pointer}/rss_bytes"),
    )


# --------------------------------------------------------------------------------------------
# Timeline

#: field -> (kind of value, default); kinds are checked by _field.
_Fields = Mapping[str, tuple[str, Any]]

ACTIVITY_FIELDS: Mapping[str, _Fields] = {
    "gpu_pcie": {
        "gpu": ("gpu", ...),
        "h2d_bytes_per_second": ("rate", 0.0),
        "d2h_bytes_per_second": ("rate", 0.0),
    },
    "gpu_util": {
        "gpu": ("gpu", ...),
        "gpu_percent": ("percent", 0.0),
        "memory_percent": ("percent", 0.0),
        "decoder_percent": ("percent", 0.0),
        "encoder_percent": ("percent", 0.0),
        "jpeg_percent": ("percent", 0.0),
    },
    "nvlink": {
        "gpu": ("gpu", ...),
        "links": ("links", None),
        "tx_bytes_per_second": ("rate", 0.0),
        "rx_bytes_per_second": ("rate", 0.0),
        "burst": ("burst", None),
        "stall_ratio": ("fraction", 0.0),
    },
    "disk": {
        "disk": ("disk", ...),
        "read_bytes_per_second": ("rate", 0.0),
        "write_bytes_per_second": ("rate", 0.0),
        "read_iops": ("rate", None),
        "write_iops": ("rate", None),
        "read_latency_ms": ("rate", 0.1),
        "write_latency_ms": ("rate", 0.05),
    },
    "ib": {
        "device": ("nic", ...),
        "port": ("port", 1),
        "tx_bytes_per_second": ("rate", 0.0),
        "rx_bytes_per_second": ("rate", 0.0),
        "xmit_wait_per_second": ("rate", 0.0),
    },
    "pcie_link": {
        "pci": ("pci", ...),
        "speed_gts": ("speed", None),
        "width": ("width", None),
    },
    "xid": {
        "gpu": ("gpu", ...),
        "xid": ("xid", ...),
        "falls_off_bus": ("bool", None),
    },
    "hot_unplug": {"pci": ("pci", ...)},
    "process": {
        "process": ("process", ...),
        "thread": ("comm", None),
        "state": ("state", None),
        "wchan": ("wchan", None),
        "cpu_percent": ("rate", None),
    },
    "lock": {
        "holder": ("process", ...),
        "waiters": ("processes", ()),
        "mount": ("mount", ...),
        "inode": ("inode", ...),
        "type": ("locktype", "WRITE"),
    },
    "nfs": {
        "mount": ("mount", ...),
        "op": ("nfsop", ...),
        "ops_per_second": ("rate", 0.0),
        "rtt_ms": ("rate", 0.5),
        "execute_ms": ("rate", 1.0),
        "errors_per_second": ("rate", 0.0),
        "bytes_per_op": ("rate", 256.0),
    },
    "memory_event": {
        "job": ("job", ...),
        "level": ("level", "step"),
        "event": ("memevent", ...),
        "per_second": ("rate", 1.0),
    },
    "tcp": {
        "out_segs_per_second": ("rate", 0.0),
        "retrans_segs_per_second": ("rate", 0.0),
    },
}

#: Kinds that happen once, at ``from``.
INSTANT_KINDS = frozenset({"xid", "hot_unplug"})

#: NFSv4 operations of ``/proc/self/mountstats`` (fs/nfs/nfs4xdr.c ``nfs4_procedures``).
NFS4_OPS = (
    "NULL", "READ", "WRITE", "COMMIT", "OPEN", "OPEN_CONFIRM", "OPEN_NOATTR", "OPEN_DOWNGRADE",
    "CLOSE", "SETATTR", "FSINFO", "RENEW", "SETCLIENTID", "SETCLIENTID_CONFIRM", "LOCK",
    "LOCKT", "LOCKU", "ACCESS", "GETATTR", "LOOKUP", "LOOKUP_ROOT", "REMOVE", "RENAME", "LINK",
    "SYMLINK", "CREATE", "PATHCONF", "STATFS", "READLINK", "READDIR", "SERVER_CAPS",
    "DELEGRETURN", "GETACL", "SETACL", "FS_LOCATIONS", "RELEASE_LOCKOWNER", "SECINFO",
    "FSID_PRESENT", "EXCHANGE_ID", "CREATE_SESSION", "DESTROY_SESSION", "SEQUENCE",
    "GET_LEASE_TIME", "RECLAIM_COMPLETE", "LAYOUTGET", "GETDEVICEINFO", "LAYOUTCOMMIT",
    "LAYOUTRETURN", "SECINFO_NO_NAME", "TEST_STATEID", "FREE_STATEID", "GETDEVICELIST",
    "BIND_CONN_TO_SESSION", "DESTROY_CLIENTID", "SEEK", "ALLOCATE", "DEALLOCATE", "LAYOUTSTATS",
    "CLONE", "COPY", "OFFLOAD_CANCEL", "LOOKUPP", "LAYOUTERROR", "COPY_NOTIFY", "GETXATTR",
    "SETXATTR", "LISTXATTRS", "REMOVEXATTR", "READ_PLUS",
)  # fmt: skip


def _timeline(
    ctx: _Ctx, value: Any, hardware: Hardware, jobs: tuple[Job, ...], duration: float
) -> tuple[Activity, ...]:
    processes = {p.key: p for job in jobs for p in job.processes}
    activities: list[Activity] = []
    for i, entry in enumerate(ctx.array(value, "/timeline", 10_000)):
        where = f"/timeline/{i}"
        obj = ctx.obj(entry, where)
        kind = ctx.string(obj.get("kind"), f"{where}/kind")
        fields = ACTIVITY_FIELDS.get(kind)
        if fields is None:
            raise ctx.fail(
                f"{where}/kind", f"unknown kind {kind!r} (kinds: {', '.join(ACTIVITY_FIELDS)})"
            )
        ctx.obj(obj, where, ("kind", "from", "to", "description", *fields))
        if "description" in obj:
            ctx.string(obj["description"], f"{where}/description")
        start = ctx.number(_get(obj, "from", 0.0), f"{where}/from", 0.0, 1e7)
        end: float | None = None
        if obj.get("to") is not None:
            if kind in INSTANT_KINDS:
                raise ctx.fail(f"{where}/to", f"{kind} happens once, at 'from'")
            end = ctx.number(obj["to"], f"{where}/to", 0.0, 1e7)
            if end <= start:
                raise ctx.fail(f"{where}/to", f"must be after from ({start:g})")
        if start > duration:
            raise ctx.fail(f"{where}/from", f"after the end of the scenario ({duration:g} s)")
        params: list[tuple[str, Any]] = []
        for name, (type_name, default) in fields.items():
            f_where = f"{where}/{name}"
            raw = obj.get(name)
            if raw is None:
                if default is ...:
                    raise ctx.fail(f_where, "missing")
                params.append((name, default))
                continue
            params.append(
                (name, _field(ctx, type_name, raw, f_where, hardware, jobs, processes, obj))
            )
        activity = Activity(kind, start, end, tuple(params), where)
        _check_activity(ctx, activity, hardware)
        activities.append(activity)
    return tuple(activities)


def _field(
    ctx: _Ctx,
    type_name: str,
    raw: Any,
    where: str,
    hardware: Hardware,
    jobs: tuple[Job, ...],
    processes: Mapping[str, ProcessSpec],
    entry: Mapping[str, Any],
) -> Any:
    if type_name == "gpu":
        return _gpu_ref(ctx, raw, where, hardware)
    if type_name == "rate":
        return ctx.number(raw, where, 0.0, 1e15)
    if type_name == "percent":
        return ctx.number(raw, where, 0.0, 100.0)
    if type_name == "fraction":
        return ctx.number(raw, where, 0.0, 1.0)
    if type_name == "bool":
        return ctx.boolean(raw, where)
    if type_name == "links":
        gpu_index = entry.get("gpu")
        nlinks = (
            hardware.gpus[gpu_index].nvlink_count
            if isinstance(gpu_index, int)
            and not isinstance(gpu_index, bool)
            and 0 <= gpu_index < len(hardware.gpus)
            else 36
        )
        links = []
        for k, link in enumerate(ctx.array(raw, where, 36)):
            links.append(ctx.integer(link, f"{where}/{k}", 0, max(0, nlinks - 1)))
        return tuple(links)
    if type_name == "burst":
        b = ctx.obj(raw, where, ("period_seconds", "on_seconds"))
        period = ctx.number(b.get("period_seconds"), f"{where}/period_seconds", 0.0, 3600.0, True)
        on = ctx.number(b.get("on_seconds"), f"{where}/on_seconds", 0.0, period, True)
        return Burst(period, on)
    if type_name == "disk":
        disk = ctx.string(raw, where)
        if disk not in {d.disk for d in hardware.nvme}:
            raise ctx.fail(where, f"no disk {disk!r}")
        return disk
    if type_name == "nic":
        name = ctx.string(raw, where)
        if name not in {n.name for n in hardware.nics}:
            raise ctx.fail(where, f"no NIC {name!r}")
        return name
    if type_name == "port":
        return ctx.integer(raw, where, 1, 4)
    if type_name == "pci":
        bdf = ctx.bdf(raw, where)
        if bdf not in {d.bdf for d in hardware.pcie.devices}:
            raise ctx.fail(where, f"no PCI function {bdf}")
        return bdf
    if type_name == "speed":
        speed = ctx.number(raw, where, 0.0, 64.0, True)
        if speed not in (2.5, 5.0, 8.0, 16.0, 32.0, 64.0):
            raise ctx.fail(where, "must be 2.5, 5, 8, 16, 32 or 64 GT/s")
        return speed
    if type_name == "width":
        width = ctx.integer(raw, where, 0, 32)
        if width not in (0, 1, 2, 4, 8, 12, 16, 32):
            raise ctx.fail(where, "must be 0, 1, 2, 4, 8, 12, 16 or 32 lanes")
        return width
    if type_name == "xid":
        return ctx.integer(raw, where, 1, 999)
    if type_name == "process":
        return _process_ref(ctx, raw, where, processes)
    if type_name == "processes":
        return tuple(
            _process_ref(ctx, item, f"{where}/{k}", processes)
            for k, item in enumerate(ctx.array(raw, where, 1000))
        )
    if type_name == "comm":
        return ctx.string(raw, where, _COMM)
    if type_name == "state":
        state = ctx.string(raw, where)
        if state not in PROCESS_STATES:
            raise ctx.fail(where, f"must be one of {' '.join(PROCESS_STATES)}")
        return state
    if type_name == "wchan":
        return ctx.string(raw, where, _WCHAN)
    if type_name == "mount":
        mountpoint = ctx.string(raw, where)
        mounts = {m.mountpoint: m for m in hardware.mounts}
        if mountpoint not in mounts:
            raise ctx.fail(where, f"no mount {mountpoint!r}")
        return mountpoint
    if type_name == "inode":
        return ctx.integer(raw, where, 1, 2**63)
    if type_name == "locktype":
        lock_type = ctx.string(raw, where)
        if lock_type not in ("READ", "WRITE"):
            raise ctx.fail(where, "must be READ or WRITE")
        return lock_type
    if type_name == "nfsop":
        op = ctx.string(raw, where)
        if op not in NFS4_OPS:
            raise ctx.fail(where, f"{op[:40]!r} is not an NFSv4 operation")
        return op
    if type_name == "job":
        job_id = ctx.integer(raw, where, 1, 2**31)
        if job_id not in {j.id for j in jobs}:
            raise ctx.fail(where, f"no job {job_id}")
        return job_id
    if type_name == "level":
        level = ctx.string(raw, where)
        if level not in ("job", "step"):
            raise ctx.fail(where, "must be job or step")
        return level
    if type_name == "memevent":
        event = ctx.string(raw, where)
        if event not in MEMORY_EVENTS:
            raise ctx.fail(where, f"must be one of {', '.join(MEMORY_EVENTS)}")
        return event
    raise AssertionError(type_name)  # pragma: no cover - the table names only the kinds above


def _process_ref(ctx: _Ctx, raw: Any, where: str, processes: Mapping[str, ProcessSpec]) -> str:
    ref = ctx.string(raw, where)
    match = _PROCESS_REF.match(ref)
    if match is None or match.group("key") not in processes:
        known = ", ".join(sorted(processes)) or "none"
        raise ctx.fail(where, f"no process {ref[:40]!r} (processes: {known})")
    replica = match.group("replica")
    if replica is not None and int(replica) >= processes[match.group("key")].count:
        raise ctx.fail(
            where, f"{match.group('key')} has {processes[match.group('key')].count} replicas"
        )
    return ref


def _check_activity(ctx: _Ctx, activity: Activity, hardware: Hardware) -> None:
    if activity.kind == "ib":
        nic = hardware.nic(activity.get("device"))
        if activity.get("port") > nic.ports:
            raise ctx.fail(f"{activity.pointer}/port", f"{nic.name} has {nic.ports} port(s)")
    if activity.kind == "nvlink" and not hardware.gpus[activity.get("gpu")].nvlinks:
        raise ctx.fail(f"{activity.pointer}/gpu", "this GPU has no NVLinks")
    if (
        activity.kind == "pcie_link"
        and activity.get("speed_gts") is None
        and activity.get("width") is None
    ):
        raise ctx.fail(activity.pointer, "needs speed_gts, width or both")
    if activity.kind in ("lock", "nfs") and not hardware.mount(activity.get("mount")).is_nfs:
        raise ctx.fail(f"{activity.pointer}/mount", "not an NFS mount")


def iter_activities(scenario: Scenario, kind: str) -> Iterable[Activity]:
    return (a for a in scenario.timeline if a.kind == kind)
