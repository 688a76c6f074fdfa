"""Scenario files, format ``nodescope-scenario/1``: the hardware, jobs and timeline of a
simulated node, and what the daemon must show while it runs.

The format is stated once, as a JSON schema: ``nodescope/sim/schema/scenario-v1.schema.json``,
explained in ``docs/scenarios.md``; the bundled scenarios live in
``nodescope/sim/scenarios/<name>.json``. A :class:`ScenarioLoader` validates a document with
that schema (its hardware merged over its base first), then reads it into frozen records,
checking by hand only what a schema cannot state: references between sections (a job's GPUs,
an activity's disk, an NVLink's peer), uniqueness across entries, sums, the order of two values
and the PCIe tree itself. Every error is a :class:`~nodescope.errors.ParseError` naming the
file and the JSON pointer of the offending value (``/timeline/3/gpu: no GPU 9 (GPUs: 0-7)``).

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
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from itertools import pairwise
from pathlib import Path
from typing import Any

from nodescope.errors import ParseError
from nodescope.model.gpu_health import CLOCK_EVENT_REASONS, FABRIC_STATES
from nodescope.sim.expect import Expectations, parse_expectations
from nodescope.sim.fake_nvml import FakeNvml
from nodescope.sim.lspci import (
    ACS_FLAG_BITS,
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
SCHEMA_NAME = "scenario-v1.schema.json"
SCHEMA_PATH = PACKAGE_DIR / "schema" / SCHEMA_NAME

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}\Z")
_DISK = re.compile(r"nvme([0-9]{1,3})n[0-9]{1,3}\Z")
_PROCESS_REF = re.compile(
    r"(?P<key>[A-Za-z0-9][A-Za-z0-9_.\-]{0,63})(?:#(?P<replica>[0-9]{1,4}))?\Z"
)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_MAX_PROCESSES = 100_000
_MAX_THREADS = 4096
#: NVML_NVLINK_MAX_LINKS
_MAX_NVLINKS = 36


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
    #: NVML calls that answer NOT_SUPPORTED on this GPU (its model's driver lacks them)
    nvml_unsupported: frozenset[str] = frozenset()

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
    #: loaded kernel modules shown in ``/sys/module`` (e.g. ``nvidia_peermem``)
    kernel_modules: tuple[str, ...] = ()
    #: named processes outside every job (daemons, kernel threads) the timeline refers to
    system_processes: tuple[ProcessSpec, ...] = ()
    #: the ``nvlink_counter`` module is loaded (``/dev/nvlink_stats``) on a node with NVLinks;
    #: without it the daemon has only NVML's per-link counters
    nvlink_counter: bool = True


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
    #: a kernel thread (system processes only): no command line, no memory of its own
    kernel: bool = False
    #: threads (by name) in a cgroup of their own: a path relative to the process's cgroup
    #: (a threaded cgroup below it) or an absolute one
    thread_cgroups: tuple[tuple[str, str], ...] = ()

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
    ``None``: until the end). Instant kinds (:data:`INSTANT_KINDS`) happen at ``start``."""

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
        """The processes of the jobs by key (system processes have no job)."""
        return {p.key: (job, p) for job in self.jobs for p in job.processes}


# --------------------------------------------------------------------------------------------
# Loading


class ScenarioLoader:
    """Reads scenarios: validates each document with the format's JSON schema, then builds its
    records.

    The validator is built once per loader, and the captures scenarios refer to (the lspci
    dump, the InfiniBand counters) are parsed once per loader, so one loader reading many
    scenarios pays for each once. jsonschema is imported here rather than with the module:
    the records above are imported by code that never reads a scenario (the simulated node,
    the lspci converter), and jsonschema about doubles this module's import time.
    """

    def __init__(self) -> None:
        text = (resources.files("nodescope.sim") / "schema" / SCHEMA_NAME).read_text("utf-8")
        self._schema: dict[str, Any] = json.loads(text)
        self._validator = _schema_validator(self._schema)
        self._lspci_captures: dict[Path, LspciDump] = {}
        self._ib_captures: dict[Path, Mapping[str, Any]] = {}

    def load(self, name_or_path: str | Path) -> Scenario:
        """A scenario by bundled name (``dgx-h100``) or file path."""
        path = scenario_path(name_or_path)
        if isinstance(name_or_path, str) and path.parent == SCENARIO_DIR and not path.is_file():
            raise ParseError(
                str(name_or_path),
                f"(document): no bundled scenario {name_or_path!r} "
                f"(bundled: {', '.join(bundled_scenarios())}) and no such file",
            )
        return self.parse(_read_json(path), path)

    def parse(self, document: Any, path: Path) -> Scenario:
        """A scenario from its parsed JSON; ``path`` names it in errors and anchors references."""
        source = _Source(str(path), path.parent)
        if isinstance(document, dict) and isinstance(document.get("hardware"), dict):
            merged = resolve_hardware(source, document["hardware"], "/hardware", ())
            document = {**document, "hardware": merged}
        _reject_non_finite(source, document)
        self._validate(source, document)
        tick = float(document.get("tick_seconds", 1.0))
        duration = float(document["duration_seconds"])
        if duration < tick:
            raise source.fail("/duration_seconds", f"shorter than one tick ({tick:g} s)")
        hardware = self._hardware(source, document["hardware"])
        jobs = _jobs(source, document.get("jobs", []), hardware)
        timeline = _timeline(source, document.get("timeline", []), hardware, jobs, duration)
        expect = parse_expectations(document.get("expect"), source.name, "/expect")
        return Scenario(
            name=document["name"],
            description=document.get("description", ""),
            tick_seconds=tick,
            duration_seconds=duration,
            hardware=hardware,
            jobs=jobs,
            timeline=timeline,
            expect=expect,
            source_path=path,
        )

    def _validate(self, source: _Source, document: Any) -> None:
        """Raise the schema error that comes first in ``document`` as a ParseError of
        ``source``. jsonschema reports the entries of a keyed collection in no fixed order,
        so the error is chosen by where it sits, not by when it was found."""
        errors = list(self._validator.iter_errors(document))
        if errors:
            first = min(errors, key=lambda e: _reading_position(document, e.absolute_path))
            pointer, message = _schema_failure(first, self._schema)
            raise source.fail(pointer, message)

    def _hardware(self, source: _Source, spec: Mapping[str, Any]) -> Hardware:
        pcie = self._pcie_tree(source, spec["pcie"], "/hardware/pcie")
        functions = _PciFunctions(source, pcie)
        cpu = _cpu(source, spec.get("cpu", {}), pcie)
        nvswitches = _nvswitches(spec.get("nvswitches", []), functions)
        return Hardware(
            pcie=pcie,
            cpu=cpu,
            gpus=_gpus(source, spec.get("gpus", {}), functions, nvswitches),
            nvswitches=nvswitches,
            nvme=_nvme_drives(source, spec.get("nvme", {}), functions),
            nics=self._nics(source, spec.get("nics", {}), functions),
            mounts=_mounts(spec.get("mounts", {})),
            os=_os(source, spec.get("os", {})),
        )

    def _pcie_tree(self, source: _Source, spec: Mapping[str, Any], pointer: str) -> LspciDump:
        """The capture's functions, if any, with the document's functions added or changed;
        the tree must hold together (bridges and bus numbers)."""
        devices: dict[str, LspciDevice] = {}
        origin = source.name
        if "lspci" in spec:
            capture = self._lspci_capture(source, spec["lspci"], f"{pointer}/lspci")
            devices = {dev.bdf: dev for dev in capture.devices}
            origin = capture.source
        for bdf, function_spec in spec.get("functions", {}).items():
            where = pointer_join(f"{pointer}/functions", bdf)
            devices[bdf] = _function(source, bdf, function_spec, where, devices.get(bdf))
        if not devices:
            raise source.fail(pointer, "the PCIe tree has no functions")
        dump = LspciDump(origin, tuple(devices[bdf] for bdf in sorted(devices)))
        try:
            bridge_chains(dump)
        except ParseError as exc:
            raise source.fail(pointer, f"the PCIe tree is inconsistent: {exc}") from exc
        return dump

    def _lspci_capture(self, source: _Source, ref: str, pointer: str) -> LspciDump:
        path = _reference(source, ref, "lspci")
        if not path.is_file():
            raise source.fail(pointer, f"no bundled capture or file {ref!r}")
        dump = self._lspci_captures.get(path)
        if dump is None:
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ParseError(str(path), f"unreadable: {exc}") from exc
            dump = self._lspci_captures[path] = parse_lspci_vvv(text, str(path))
        return dump

    def _nics(
        self, source: _Source, specs: Mapping[str, Any], functions: _PciFunctions
    ) -> tuple[Nic, ...]:
        nics: list[Nic] = []
        owners: dict[str, str] = {}
        for name, spec in specs.items():
            where = pointer_join("/hardware/nics", name)
            capture: Mapping[str, Any] = {}
            if "capture" in spec:
                capture = self._ib_capture_device(source, spec["capture"], f"{where}/capture")
            addresses: list[str] = []
            for i, value in enumerate(spec["pci"]):
                address = functions.of_class(
                    value, f"{where}/pci/{i}", _is_network, "a network controller"
                )
                if address in owners:
                    raise source.fail(
                        f"{where}/pci/{i}", f"{address} already belongs to {owners[address]}"
                    )
                owners[address] = name
                addresses.append(address)
            nics.append(_nic(name, spec, tuple(addresses), capture, len(nics)))
        return tuple(nics)

    def _ib_capture_device(self, source: _Source, ref: str, pointer: str) -> Mapping[str, Any]:
        located = _ib_capture_location(ref)
        if located is not None:
            path, device = located
            capture = self._ib_captures.get(path)
            if capture is None:
                capture = self._ib_captures[path] = _read_ib_capture(path)
            found = capture["devices"].get(device)
            if isinstance(found, dict):
                return found
        raise source.fail(pointer, f"no bundled InfiniBand capture device {ref!r}")


def load_scenario(name_or_path: str | Path) -> Scenario:
    """Load and validate a scenario: a bundled name (``dgx-h100``) or a file path. A caller
    reading many scenarios keeps one :class:`ScenarioLoader` instead."""
    return ScenarioLoader().load(name_or_path)


def parse_scenario(document: Any, path: Path) -> Scenario:
    """A scenario from its parsed JSON; ``path`` names it in errors and anchors references."""
    return ScenarioLoader().parse(document, path)


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


@dataclass(frozen=True, slots=True)
class _Source:
    """The file being read: named in every error, and where its relative references start."""

    name: str
    directory: Path

    def fail(self, pointer: str, message: str) -> ParseError:
        """The error at ``pointer``, on one line: control characters of a key are escaped."""
        shown = _CONTROL.sub(lambda m: repr(m.group())[1:-1], pointer) or "(document)"
        return ParseError(self.name, f"{shown}: {message}")


def pointer_join(pointer: str, key: str | int) -> str:
    """RFC 6901: ``~`` and ``/`` in a key are escaped."""
    token = str(key).replace("~", "~0").replace("/", "~1")
    return f"{pointer}/{token}"


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


def _reject_non_finite(source: _Source, document: Any) -> None:
    """JSON text has no NaN or infinity (:func:`parse_json` refuses them), but a document built
    in memory may hold them, and a schema's bounds let NaN through. The walk keeps its own
    stack: a document may nest deeper than Python's recursion limit."""
    pending: list[tuple[str, Any]] = [("", document)]
    while pending:
        pointer, value = pending.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise source.fail(pointer, "must be finite")
        if isinstance(value, dict):
            items = [(pointer_join(pointer, key), item) for key, item in value.items()]
        elif isinstance(value, list):
            items = [(f"{pointer}/{index}", item) for index, item in enumerate(value)]
        else:
            continue
        pending.extend(reversed(items))


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


def resolve_hardware(
    source: _Source, hardware: dict[str, Any], pointer: str, seen: tuple[Path, ...]
) -> dict[str, Any]:
    """The hardware object with its ``base`` chain merged in, a JSON document for the schema
    to judge. Without a base, or with a base that is not a string (the schema says so), it is
    returned as written."""
    base = hardware.get("base")
    if not isinstance(base, str):
        return hardware
    where = pointer_join(pointer, "base")
    base_path = _reference(source, base)
    if base_path in seen:
        raise source.fail(where, f"base {base!r} refers back to itself")
    if not base_path.is_file():
        raise source.fail(
            where,
            f"no bundled scenario or file {base!r} (bundled: {', '.join(bundled_scenarios())})",
        )
    base_source = _Source(str(base_path), base_path.parent)
    base_hw = resolve_hardware(
        base_source, _base_hardware(base_source, _read_json(base_path)), "", (*seen, base_path)
    )
    # The base's own format and comment are not this hardware's; its relative references stay
    # relative to the base's file.
    base_hw = {k: v for k, v in base_hw.items() if k not in ("format", "comment")}
    pcie = base_hw.get("pcie")
    if isinstance(pcie, dict) and isinstance(pcie.get("lspci"), str):
        base_hw["pcie"] = {**pcie, "lspci": str(_reference(base_source, pcie["lspci"], "lspci"))}
    merged = merge_patch(base_hw, {k: v for k, v in hardware.items() if k != "base"})
    assert isinstance(merged, dict)
    return merged


def _base_hardware(source: _Source, document: Any) -> dict[str, Any]:
    """The hardware object of a base: a hardware file, or a scenario's ``hardware``."""
    if not isinstance(document, dict):
        raise source.fail("", f"must be an object, got {_type_name(document)}")
    if document.get("format") == HARDWARE_FORMAT:
        return document
    if document.get("format") != FORMAT:
        raise source.fail("/format", f"must be {FORMAT!r} or {HARDWARE_FORMAT!r}")
    hardware = document.get("hardware")
    if not isinstance(hardware, dict):
        raise source.fail("/hardware", f"must be an object, got {_type_name(hardware)}")
    return hardware


def _reference(source: _Source, ref: str, kind: str = "scenario") -> Path:
    """A bundled name or a path relative to the referring file."""
    if _NAME.match(ref) and "/" not in ref:
        bundled = (
            SCENARIO_DIR / f"{ref}.json" if kind == "scenario" else DATA_DIR / f"lspci-vvv.{ref}"
        )
        if bundled.is_file():
            return bundled
    path = Path(ref)
    return path if path.is_absolute() else (source.directory / path).resolve()


def _ib_capture_location(ref: str) -> tuple[Path, str] | None:
    """The file and device name of ``<capture>/<device>``, a bundled InfiniBand capture."""
    capture, _, device = ref.partition("/")
    if not _NAME.match(capture) or not device:
        return None
    path = DATA_DIR / f"{capture}.json"
    return (path, device) if path.is_file() else None


def _read_ib_capture(path: Path) -> Mapping[str, Any]:
    document = _read_json(path)
    if not isinstance(document, dict) or not isinstance(document.get("devices"), dict):
        raise ParseError(str(path), "/devices: missing")
    return document


def load_ib_capture_device(ref: str) -> dict[str, Any] | None:
    """The device ``<capture>/<device>`` of a bundled InfiniBand capture, or ``None``."""
    located = _ib_capture_location(ref)
    if located is None:
        return None
    path, device = located
    found = _read_ib_capture(path)["devices"].get(device)
    return found if isinstance(found, dict) else None


# --------------------------------------------------------------------------------------------
# Schema errors in the loader's words


def _schema_validator(schema: Mapping[str, Any]) -> Any:
    """A validator of the draft ``schema`` declares, whose ``pattern`` keeps ECMA-262's ``$``:
    the end of the text. Python's ``$`` also matches before a final newline, which would let
    ``"nvme0n1\\n"`` pass for a disk name."""
    from jsonschema import ValidationError, validators  # type: ignore[import-untyped]

    compiled: dict[str, re.Pattern[str]] = {}

    def pattern(validator: Any, expected: str, instance: Any, schema: Any) -> Iterator[Any]:
        if not validator.is_type(instance, "string"):
            return
        regex = compiled.get(expected)
        if regex is None:
            regex = compiled[expected] = re.compile(_python_regex(expected))
        if regex.search(instance) is None:
            yield ValidationError(f"{instance!r} does not match {expected!r}")

    draft = validators.validator_for(schema)
    return validators.extend(draft, {"pattern": pattern})(schema)


def _python_regex(pattern: str) -> str:
    """An ECMA-262 pattern with each ``$`` outside a character class spelt ``\\Z``, Python's
    end of the text."""
    out: list[str] = []
    escaped = in_class = False
    for char in pattern:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char == "$":
            char = r"\Z"
        out.append(char)
    return "".join(out)


def _reading_position(document: Any, path: Iterable[str | int]) -> tuple[int, ...]:
    """The index of each key or item on ``path``: sorts values in the order they are written."""
    position: list[int] = []
    node = document
    for token in path:
        if isinstance(node, dict):
            position.append(list(node).index(token))
        elif isinstance(node, list) and isinstance(token, int):
            position.append(token)
        else:
            break
        node = node[token]
    return tuple(position)


def _schema_failure(error: Any, root: Mapping[str, Any]) -> tuple[str, str]:
    """The JSON pointer and the one-line message of a jsonschema error. The pointer names the
    offending value itself: the unknown key, the missing key, the bad property name. A schema
    object's ``x-message`` gives the message of one of its keywords (``{value}``: the value,
    ``{allowed}``: an enum's values)."""
    pointer = ""
    for token in error.absolute_path:
        pointer = pointer_join(pointer, token)
    keyword: str | None = error.validator
    expected = error.validator_value
    value = error.instance
    schema: Mapping[str, Any] = error.schema if isinstance(error.schema, dict) else {}
    if _names_a_property(error.absolute_schema_path):
        pointer = pointer_join(pointer, value)
    key = None
    if keyword == "required":
        key = next(k for k in expected if k not in value)
    elif keyword == "additionalProperties":
        key = next(k for k in value if _is_additional(k, schema))
    if key is not None:
        pointer = pointer_join(pointer, key)
    custom = schema.get("x-message", {}).get(keyword)
    if custom is not None:
        allowed = _listed(expected) if keyword == "enum" else ""
        return pointer, custom.replace("{value}", _shown(value)).replace("{allowed}", allowed)
    if keyword == "required":
        property_schema = _resolved(schema.get("properties", {}).get(key, {}), root)
        if "type" in property_schema:
            return pointer, f"must be {_type_phrase(property_schema['type'])}, got nothing"
        return pointer, "missing"
    if keyword == "additionalProperties":
        return pointer, f"unknown key (known: {', '.join(sorted(schema.get('properties', {})))})"
    return pointer, _keyword_message(keyword, expected, value, error.message)


def _keyword_message(keyword: str | None, expected: Any, value: Any, fallback: str) -> str:
    if keyword == "type":
        return f"must be {_type_phrase(expected)}, got {_type_name(value)}"
    if keyword == "const":
        return f"must be {expected!r}, got {_shown(value)}"
    if keyword == "enum":
        return f"must be one of {_listed(expected)}, got {_shown(value)}"
    if keyword in _BOUNDS:
        return f"must be {_BOUNDS[keyword]} {_number(expected)}, got {_number(value)}"
    if keyword == "pattern":
        return f"must match {expected}, got {_shown(value)}"
    if keyword == "minItems":
        return f"needs at least {expected} item(s)"
    if keyword == "maxItems":
        return f"more than {expected} items"
    if keyword == "uniqueItems":
        return "lists the same value twice"
    if keyword == "minLength":
        return f"must be at least {expected} character(s) long"
    if keyword == "maxLength":
        return f"more than {expected} characters"
    if keyword in (None, "not"):
        return "not allowed here"
    return fallback


_BOUNDS = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}
_TYPE_PHRASES = {
    "object": "an object",
    "array": "an array",
    "string": "a string",
    "number": "a number",
    "integer": "an integer",
    "boolean": "true or false",
    "null": "null",
}


def _names_a_property(schema_path: Iterable[Any]) -> bool:
    """Whether an error came from ``propertyNames``: then it is about a key, not a value."""
    return any(
        token == "propertyNames" and before != "properties"
        for before, token in pairwise(("", *schema_path))
    )


def _is_additional(key: str, schema: Mapping[str, Any]) -> bool:
    return key not in schema.get("properties", {}) and not any(
        re.search(_python_regex(p), key) for p in schema.get("patternProperties", {})
    )


def _resolved(schema: Mapping[str, Any], root: Mapping[str, Any]) -> Mapping[str, Any]:
    """``schema``, or the definition its local ``$ref`` (``#/$defs/<name>``) names."""
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        found = root.get("$defs", {}).get(ref.removeprefix("#/$defs/"))
        if isinstance(found, dict):
            return found
    return schema


def _type_phrase(types: str | list[str]) -> str:
    names = [types] if isinstance(types, str) else types
    return " or ".join(_TYPE_PHRASES.get(name, name) for name in names)


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


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _listed(values: Iterable[Any]) -> str:
    return ", ".join(
        "null" if v is None else v if isinstance(v, str) else _number(v) for v in values
    )


# --------------------------------------------------------------------------------------------
# Hardware


class _PciFunctions:
    """The functions of the PCIe tree by address, for the devices that name one."""

    def __init__(self, source: _Source, dump: LspciDump) -> None:
        self._source = source
        self._by_address = {dev.bdf: dev for dev in dump.devices}

    def of_class(self, bdf: str, where: str, wanted: Callable[[int], bool], what: str) -> str:
        """``bdf``, which must be a function of the tree whose class code is ``wanted``."""
        dev = self._by_address.get(bdf)
        if dev is None:
            raise self._source.fail(where, f"no PCI function {bdf} in the PCIe tree")
        if dev.class_code is None or not wanted(dev.class_code):
            raise self._source.fail(
                where, f"{bdf} is not {what} (class {dev.class_code or 0:#08x})"
            )
        return bdf


def _is_display(class_code: int) -> bool:
    return class_code >> 16 == 0x03


def _is_nvswitch(class_code: int) -> bool:
    return class_code >> 8 == 0x0680


def _is_nvme(class_code: int) -> bool:
    return class_code == 0x010802


def _is_network(class_code: int) -> bool:
    return class_code >> 16 == 0x02


def _function(
    source: _Source,
    bdf: str,
    spec: Mapping[str, Any],
    pointer: str,
    existing: LspciDevice | None,
) -> LspciDevice:
    """A function of the tree: the capture's, with what ``spec`` states replaced, or a new one,
    which needs its class, vendor and device."""
    if existing is None:
        for key in ("class", "vendor", "device"):
            if key not in spec:
                raise source.fail(pointer_join(pointer, key), "missing (a new function needs it)")
        existing = _blank_function(bdf)
    function = replace(existing, **_function_changes(spec))
    if "acs_redirect" in spec:
        if function.express_type is None:
            raise source.fail(
                pointer_join(pointer, "acs_redirect"),
                "ACS is a PCI Express capability: the function has no 'express' port type",
            )
        function = _with_acs_redirect(function, spec["acs_redirect"])
    return function


#: ACS control bits a port redirects peer-to-peer traffic with: requests and completions.
_ACS_REDIRECT_BITS = ACS_FLAG_BITS["ReqRedir"] | ACS_FLAG_BITS["CmpltRedir"]


def _with_acs_redirect(function: LspciDevice, redirect: bool) -> LspciDevice:
    """``function`` with P2P Request and Completion Redirect set or cleared in its ACS control
    (an ACS capability added where it had none). Setting them also sets them in a captured
    capability register: hardware only lets a control bit be set where the capability has it."""
    control = function.acs_control or 0
    capability = function.acs_capability
    if redirect:
        control |= _ACS_REDIRECT_BITS
        if capability is not None:
            capability |= _ACS_REDIRECT_BITS
    else:
        control &= ~_ACS_REDIRECT_BITS
    return replace(function, acs_control=control, acs_capability=capability)


def _blank_function(bdf: str) -> LspciDevice:
    return LspciDevice(
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


#: Function keys holding a number, 0x-prefixed hex or an integer, and the fields they set.
_HEX_FIELDS = (
    ("class", "class_code"),
    ("vendor", "vendor_id"),
    ("device", "device_id"),
    ("revision", "revision"),
)


def _function_changes(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`LspciDevice` fields a function's keys set; ``null`` clears a field."""
    changes: dict[str, Any] = {}
    for key, name in _HEX_FIELDS:
        if key in spec:
            value = spec[key]
            changes[name] = int(value, 16) if isinstance(value, str) else int(value)
    if "name" in spec:
        changes["device_name"] = spec["name"]
    if "numa_node" in spec:
        changes["numa_node"] = _optional_int(spec["numa_node"])
    if "express" in spec:
        express = spec["express"]
        changes["express_type"] = None if express is None else ExpressType(express)
    if "link_cap" in spec:
        changes["link_cap_speed_gts"], changes["link_cap_width"] = _link(spec["link_cap"])
    if "link" in spec:
        changes["link_sta_speed_gts"], changes["link_sta_width"] = _link(spec["link"])
    if "bus" in spec:
        bus = spec["bus"]
        changes["bus"] = (
            None
            if bus is None
            else BusNumbers(int(bus["primary"]), int(bus["secondary"]), int(bus["subordinate"]))
        )
    if "aer" in spec:
        changes["has_aer"] = spec["aer"]
    if "driver" in spec:
        changes["driver"] = spec["driver"]
    return changes


def _link(spec: Mapping[str, Any] | None) -> tuple[float | None, int | None]:
    """Speed (GT/s) and width of a link capability or status."""
    if spec is None:
        return None, None
    speed = spec.get("speed_gts")
    return (None if speed is None else float(speed)), _optional_int(spec.get("width"))


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _cpu(source: _Source, spec: Mapping[str, Any], pcie: LspciDump) -> CpuLayout:
    """The CPU layout; one socket per NUMA node, so every node the tree names needs one."""
    cpu = CpuLayout(
        int(spec.get("sockets", 2)),
        int(spec.get("cores_per_socket", 56)),
        int(spec.get("threads_per_core", 2)),
    )
    numa_nodes = {d.numa_node for d in pcie.devices if d.numa_node is not None}
    if numa_nodes and max(numa_nodes) >= cpu.sockets:
        raise source.fail(
            "/hardware/cpu/sockets",
            f"the PCIe tree has NUMA node {max(numa_nodes)}: needs at least "
            f"{max(numa_nodes) + 1} sockets",
        )
    return cpu


def _nvswitches(specs: list[str], functions: _PciFunctions) -> tuple[str, ...]:
    return tuple(
        functions.of_class(
            bdf, f"/hardware/nvswitches/{i}", _is_nvswitch, "an NVSwitch (class 0x0680)"
        )
        for i, bdf in enumerate(specs)
    )


def _gpus(
    source: _Source,
    specs: Mapping[str, Any],
    functions: _PciFunctions,
    nvswitches: tuple[str, ...],
) -> tuple[Gpu, ...]:
    """The GPUs by NVML index: 0..N-1, each on its own display controller, NVLinked to
    NVSwitches or to each other."""
    pointer = "/hardware/gpus"
    addresses = {
        int(key): functions.of_class(
            spec["pci"], f"{pointer}/{key}/pci", _is_display, "a display controller (class 0x03)"
        )
        for key, spec in specs.items()
    }
    if sorted(addresses) != list(range(len(addresses))):
        raise source.fail(pointer, "indices must be 0..N-1 without gaps")
    if len(set(addresses.values())) != len(addresses):
        raise source.fail(pointer, "two GPUs share a PCI address")
    peers = set(nvswitches) | set(addresses.values())
    gpus: list[Gpu] = []
    for index in range(len(addresses)):
        spec = specs[str(index)]
        nvlinks = _nvlinks(
            source, spec.get("nvlinks", []), f"{pointer}/{index}/nvlinks", addresses[index], peers
        )
        uuid_default = f"GPU-{index:08x}-5e1f-4a0b-9c3d-{0x1000 + index:012x}"
        gpus.append(
            Gpu(
                index=index,
                pci=addresses[index],
                name=spec.get("name", "NVIDIA GPU"),
                uuid=spec.get("uuid", uuid_default),
                memory_bytes=int(spec.get("memory_bytes", 80 * 2**30)),
                nvlinks=nvlinks,
                nvml_unsupported=_nvml_unsupported(
                    source, spec.get("nvml_unsupported", []), f"{pointer}/{index}"
                ),
            )
        )
    return tuple(gpus)


def _nvml_unsupported(source: _Source, names: list[str], pointer: str) -> frozenset[str]:
    """The calls a GPU does not support, each one the fake NVML answers: a misspelt name
    would leave the call supported without a word."""
    for i, name in enumerate(names):
        per_gpu = name.startswith(("nvmlDevice", "nvmlGpm"))
        if not per_gpu or not callable(getattr(FakeNvml, name, None)):
            raise source.fail(
                f"{pointer}/nvml_unsupported/{i}",
                f"{name!r} is no NVML call of a GPU that the node answers",
            )
    return frozenset(names)


def _nvlinks(
    source: _Source,
    specs: list[Mapping[str, Any]],
    pointer: str,
    own_address: str,
    peers: set[str],
) -> tuple[NvLinkGroup, ...]:
    """A GPU's NVLinks: groups to an NVSwitch or another GPU, at most 36 links in all."""
    groups: list[NvLinkGroup] = []
    for i, spec in enumerate(specs):
        peer = spec["peer"]
        if peer not in peers or peer == own_address:
            raise source.fail(
                f"{pointer}/{i}/peer", f"{peer} is neither an NVSwitch nor another GPU"
            )
        groups.append(NvLinkGroup(peer, int(spec["count"])))
    if sum(group.count for group in groups) > _MAX_NVLINKS:
        raise source.fail(pointer, "more than 36 NVLinks (NVML_NVLINK_MAX_LINKS)")
    return tuple(groups)


def _nvme_drives(
    source: _Source, specs: Mapping[str, Any], functions: _PciFunctions
) -> tuple[NvmeDrive, ...]:
    """NVMe disks by name, each on its own controller function, with distinct device numbers
    and controller names."""
    drives: list[NvmeDrive] = []
    served: dict[str, str] = {}
    for disk, spec in specs.items():
        where = pointer_join("/hardware/nvme", disk)
        pci = functions.of_class(spec["pci"], f"{where}/pci", _is_nvme, "an NVMe controller")
        if pci in served:
            raise source.fail(f"{where}/pci", f"{pci} already serves {served[pci]}")
        served[pci] = disk
        match = _DISK.match(disk)
        assert match is not None  # the schema's pattern for disk names
        drives.append(
            NvmeDrive(
                disk=disk,
                controller=spec.get("controller", f"nvme{int(match.group(1))}"),
                pci=pci,
                major=int(spec.get("major", 259)),
                minor=int(spec.get("minor", len(drives))),
                model=spec.get("model", "NVMe SSD"),
                size_bytes=int(spec.get("size_bytes", 3_840_755_982_336)),
            )
        )
    if len({(d.major, d.minor) for d in drives}) != len(drives):
        raise source.fail("/hardware/nvme", "two disks share a major:minor")
    if len({d.controller for d in drives}) != len(drives):
        raise source.fail("/hardware/nvme", "two disks share a controller")
    return tuple(drives)


def _nic(
    name: str,
    spec: Mapping[str, Any],
    addresses: tuple[str, ...],
    capture: Mapping[str, Any],
    position: int,
) -> Nic:
    """An RDMA device; what the document leaves out comes from its capture device, if it names
    one, else from a ConnectX-7 at NDR."""
    ports = capture.get("ports", {})
    port1 = ports.get("1", {})
    return Nic(
        name=name,
        pci=addresses,
        role=spec.get("role", "compute"),
        link_layer=spec.get("link_layer", port1.get("link_layer", "InfiniBand")),
        rate=spec.get("rate", port1.get("rate", "400 Gb/sec (4X NDR)")),
        ports=int(spec.get("ports", max(1, len(ports)))),
        hca_type=spec.get("hca_type", capture.get("hca_type", "MT4129")),
        fw_ver=spec.get("fw_ver", capture.get("fw_ver", "28.41.1000")),
        board_id=spec.get("board_id", capture.get("board_id", "MT_0000000838")),
        node_guid=spec.get("node_guid", f"b83f:d203:00{position:02x}:{0x1A2B + position:04x}"),
        capture=spec.get("capture"),
    )


def _mounts(specs: Mapping[str, Any]) -> tuple[Mount, ...]:
    mounts: list[Mount] = []
    for mountpoint, spec in specs.items():
        mounts.append(
            Mount(
                mountpoint=mountpoint,
                device=spec["device"],
                fstype=spec.get("fstype", "nfs4"),
                version=spec.get("version", "4.2"),
                server_addr=spec.get("server_addr", "10.0.0.1"),
                major=int(spec.get("major", 0)),
                minor=int(spec.get("minor", 50 + len(mounts))),
            )
        )
    return tuple(mounts)


def _os(source: _Source, spec: Mapping[str, Any]) -> OsSpec:
    system: list[ProcessSpec] = []
    for k, entry in enumerate(spec.get("system_processes", [])):
        where = f"/hardware/os/system_processes/{k}"
        if any(p.key == entry["key"] for p in system):
            raise source.fail(f"{where}/key", f"process key {entry['key']!r} used twice")
        if sum(entry.get("threads", {}).values()) >= _MAX_THREADS:
            raise source.fail(f"{where}/threads", f"at most {_MAX_THREADS} threads per process")
        kernel = bool(entry.get("kernel", False))
        default_cgroup = "/" if kernel else f"/system.slice/{entry['key']}.service"
        system.append(
            ProcessSpec(
                key=entry["key"],
                comm=entry["comm"],
                # A kernel thread has an empty command line.
                cmdline="" if kernel else entry.get("cmdline", entry["comm"]),
                count=int(entry.get("count", 1)),
                threads=tuple((name, int(n)) for name, n in entry.get("threads", {}).items()),
                cgroup=entry.get("cgroup", default_cgroup),
                state=entry.get("state", "S"),
                wchan=entry.get("wchan", "0" if kernel else "do_epoll_wait"),
                gpu=None,
                gpu_memory_bytes=None,
                cpu_percent=float(entry.get("cpu_percent", 0.0)),
                environ=(),
                rss_bytes=0 if kernel else int(entry.get("rss_bytes", 12 * 2**20)),
                kernel=kernel,
            )
        )
    return OsSpec(
        hostname=spec.get("hostname", "sim"),
        uptime_seconds=float(spec.get("uptime_seconds", 864_000)),
        background_processes=int(spec.get("background_processes", 300)),
        kernel_modules=tuple(spec.get("kernel_modules", ())),
        system_processes=tuple(system),
        nvlink_counter=bool(spec.get("nvlink_counter", True)),
    )


# --------------------------------------------------------------------------------------------
# Jobs


def _jobs(source: _Source, specs: list[Mapping[str, Any]], hardware: Hardware) -> tuple[Job, ...]:
    """Jobs with distinct ids and process keys unique across all jobs, at most 100,000
    processes on the node in all."""
    jobs: list[Job] = []
    keys: set[str] = {p.key for p in hardware.os.system_processes}
    total = hardware.os.background_processes + sum(p.count for p in hardware.os.system_processes)
    for i, spec in enumerate(specs):
        where = f"/jobs/{i}"
        job_id = int(spec["id"])
        if any(job.id == job_id for job in jobs):
            raise source.fail(f"{where}/id", f"job {job_id} listed twice")
        gpus = tuple(
            _gpu_ref(source, gpu, f"{where}/gpus/{k}", hardware)
            for k, gpu in enumerate(spec.get("gpus", []))
        )
        nics = tuple(
            _nic_ref(source, nic, f"{where}/nics/{k}", hardware)
            for k, nic in enumerate(spec.get("nics", []))
        )
        processes: list[ProcessSpec] = []
        for k, process_spec in enumerate(spec.get("processes", [])):
            process = _process(source, process_spec, f"{where}/processes/{k}", hardware, gpus)
            if process.key in keys:
                raise source.fail(
                    f"{where}/processes/{k}/key", f"process key {process.key!r} used twice"
                )
            keys.add(process.key)
            processes.append(process)
            total += process.count
        memory_max = spec.get("memory_max", {})
        jobs.append(
            Job(
                id=job_id,
                user=spec.get("user", "user"),
                uid=int(spec.get("uid", 1000)),
                gpus=gpus,
                nics=nics,
                step=spec.get("step", "0"),
                memory_max_job=_limit(memory_max.get("job")),
                memory_max_step=_limit(memory_max.get("step")),
                memory_current_bytes=int(spec.get("memory_current_bytes", 0)),
                processes=tuple(processes),
            )
        )
    if total > _MAX_PROCESSES:
        raise source.fail("/jobs", f"{total} processes in all; at most {_MAX_PROCESSES}")
    return tuple(jobs)


def _limit(value: int | str | None) -> int | None:
    """A ``memory.max``: bytes, or ``None`` for ``"max"`` (no limit)."""
    return None if value is None or value == "max" else int(value)


def _gpu_ref(source: _Source, index: int, pointer: str, hardware: Hardware) -> int:
    if index >= len(hardware.gpus):
        span = f"0-{len(hardware.gpus) - 1}" if hardware.gpus else "none"
        raise source.fail(pointer, f"no GPU {index} (GPUs: {span})")
    return int(index)


def _nic_ref(source: _Source, name: str, pointer: str, hardware: Hardware) -> str:
    if name not in {nic.name for nic in hardware.nics}:
        raise source.fail(pointer, f"no NIC {name!r}")
    return name


def _process(
    source: _Source,
    spec: Mapping[str, Any],
    pointer: str,
    hardware: Hardware,
    job_gpus: tuple[int, ...],
) -> ProcessSpec:
    count = int(spec.get("count", 1))
    threads = tuple((name, int(n)) for name, n in spec.get("threads", {}).items())
    if sum(n for _, n in threads) >= _MAX_THREADS:
        raise source.fail(f"{pointer}/threads", f"at most {_MAX_THREADS} threads per process")
    thread_cgroups = tuple(spec.get("thread_cgroups", {}).items())
    for name, path in thread_cgroups:
        if name not in dict(threads):
            raise source.fail(f"{pointer}/thread_cgroups/{name}", "no such thread in threads")
        if any(part in (".", "..") for part in path.split("/")):
            raise source.fail(f"{pointer}/thread_cgroups/{name}", "no . or .. in a cgroup path")
    gpu_value = spec.get("gpu")
    gpu: int | None
    if gpu_value is None:
        gpu = None
    elif gpu_value == "each":
        if count > len(job_gpus):
            raise source.fail(f"{pointer}/gpu", f"'each' needs a job GPU per process ({count})")
        gpu = -1
    else:
        gpu = _gpu_ref(source, gpu_value, f"{pointer}/gpu", hardware)
    memory = spec.get("gpu_memory_bytes")
    rss = spec.get("rss_bytes")
    return ProcessSpec(
        key=spec["key"],
        comm=spec["comm"],
        cmdline=spec.get("cmdline", spec["comm"]),
        count=count,
        threads=threads,
        cgroup=spec.get("cgroup", "task"),
        state=spec.get("state", "S"),
        wchan=spec.get("wchan", "0"),
        gpu=gpu,
        gpu_memory_bytes=_optional_int(memory),
        cpu_percent=float(spec.get("cpu_percent", 0.0)),
        environ=tuple(spec.get("environ", {}).items()),
        thread_cgroups=thread_cgroups,
        rss_bytes=_optional_int(rss),
    )


# --------------------------------------------------------------------------------------------
# Timeline

#: field -> (what its value is, default); ``...``: the field is required. The schema states
#: each field's type and range; the kinds here say how the loader reads a value (``number``:
#: a float, ``integer``, ``text`` and ``bool``: as written; ``reasons``: clock-event reason
#: names as NVML's bit mask; ``fabric_state``: a fabric state name as NVML's number) and what
#: it refers to (``gpu``, ``disk``, ``nic``, ``pci``, ``process``, ``processes``, ``mount``,
#: ``job``: by name or index; ``links``: NVLinks of the activity's GPU; ``burst``: an on/off
#: pattern).
_Fields = Mapping[str, tuple[str, Any]]

#: How a forged Xid or SXid line (``forged: true``) reaches the kernel log: written to
#: ``/dev/kmsg`` from user space (a record of the user facility), or as the file name of a
#: crashing binary in the kernel's own ``segfault at`` report (facility 0, ``KERN_INFO``).
FORGED_DEVKMSG = "devkmsg"
FORGED_SEGFAULT = "segfault"

ACTIVITY_FIELDS: Mapping[str, _Fields] = {
    "gpu_pcie": {
        "gpu": ("gpu", ...),
        "h2d_bytes_per_second": ("number", 0.0),
        "d2h_bytes_per_second": ("number", 0.0),
    },
    "gpu_util": {
        "gpu": ("gpu", ...),
        "gpu_percent": ("number", 0.0),
        "memory_percent": ("number", 0.0),
        "decoder_percent": ("number", 0.0),
        "encoder_percent": ("number", 0.0),
        "jpeg_percent": ("number", 0.0),
    },
    "nvlink": {
        "gpu": ("gpu", ...),
        "links": ("links", None),
        "tx_bytes_per_second": ("number", 0.0),
        "rx_bytes_per_second": ("number", 0.0),
        "burst": ("burst", None),
        "stall_ratio": ("number", 0.0),
    },
    "disk": {
        "disk": ("disk", ...),
        "read_bytes_per_second": ("number", 0.0),
        "write_bytes_per_second": ("number", 0.0),
        "read_iops": ("number", None),
        "write_iops": ("number", None),
        "read_latency_ms": ("number", 0.1),
        "write_latency_ms": ("number", 0.05),
    },
    "ib": {
        "device": ("nic", ...),
        "port": ("integer", 1),
        "tx_bytes_per_second": ("number", 0.0),
        "rx_bytes_per_second": ("number", 0.0),
        "xmit_wait_per_second": ("number", 0.0),
    },
    "pcie_link": {
        "pci": ("pci", ...),
        "speed_gts": ("number", None),
        "width": ("integer", None),
    },
    "xid": {
        "gpu": ("gpu", ...),
        "xid": ("integer", ...),
        "falls_off_bus": ("bool", None),
        "forged": ("bool", False),
        "forged_as": ("text", FORGED_DEVKMSG),
    },
    # An NVSwitch error as the nvidia-nvswitch driver logs it: ``count`` SXids at ``from``.
    "sxid": {
        "nvswitch": ("nvswitch", ...),
        "sxid": ("integer", ...),
        "fatal": ("bool", ...),
        "link": ("integer", None),
        "message": ("text", ...),
        "count": ("integer", 1),
        "forged": ("bool", False),
        "forged_as": ("text", FORGED_DEVKMSG),
    },
    "hot_unplug": {"pci": ("pci", ...)},
    "driver_rebind": {"pci": ("pci", ...)},
    "process": {
        "process": ("process", ...),
        "thread": ("text", None),
        "state": ("text", None),
        "wchan": ("text", None),
        "cpu_percent": ("number", None),
    },
    "lock": {
        "holder": ("process", ...),
        "waiters": ("processes", ()),
        "mount": ("mount", ...),
        "inode": ("integer", ...),
        "type": ("text", "WRITE"),
    },
    "nfs": {
        "mount": ("mount", ...),
        "op": ("text", ...),
        "ops_per_second": ("number", 0.0),
        "rtt_ms": ("number", 0.5),
        "execute_ms": ("number", 1.0),
        "errors_per_second": ("number", 0.0),
        "bytes_per_op": ("number", 256.0),
    },
    "memory_event": {
        "job": ("job", ...),
        "level": ("text", "step"),
        "event": ("text", ...),
        "per_second": ("number", 1.0),
    },
    "tcp": {
        "out_segs_per_second": ("number", 0.0),
        "retrans_segs_per_second": ("number", 0.0),
    },
    "errors": {
        "gpu": ("gpu", None),
        "links": ("links", None),
        "nvlink": ("rates", ()),
        "pcie_replays_per_second": ("number", 0.0),
        "ib": ("nic", None),
        "port": ("integer", 1),
        "counters": ("rates", ()),
        "hw_counters": ("rates", ()),
        "pci": ("pci", None),
        "aer": ("aer", ()),
    },
    "pressure": {
        "job": ("job", ...),
        "level": ("text", "job"),
        "resource": ("text", ...),
        "some_avg10": ("number", 0.0),
        "some_avg60": ("number", None),
        "some_avg300": ("number", None),
        "full_avg10": ("number", 0.0),
        "full_avg60": ("number", None),
        "full_avg300": ("number", None),
    },
    "job_io": {
        "job": ("job", ...),
        "level": ("text", "step"),
        "device": ("disk", ...),
        "read_bytes_per_second": ("number", 0.0),
        "write_bytes_per_second": ("number", 0.0),
        "read_iops": ("number", None),
        "write_iops": ("number", None),
        "discard_bytes_per_second": ("number", 0.0),
        "in_diskstats": ("bool", True),
    },
    "process_exit": {
        "process": ("process", ...),
        "signal": ("text", None),
        "exit_code": ("integer", None),
    },
    "gpu_peer": {
        "gpu": ("gpu", ...),
        "peer": ("peer", ...),
        "port": ("integer", 1),
        "to_gpu_bytes_per_second": ("number", 0.0),
        "from_gpu_bytes_per_second": ("number", 0.0),
    },
    # A collective trace dropped in a job's spool directory at ``from``.
    "trace": {
        "job": ("job", ...),
        "file": ("text", ...),
        "path": ("trace_file", ...),
    },
    # GPU health. Counts are added once, at ``from``, and never taken back (a real counter
    # only grows); every other value holds while the activity is active, ``None`` leaving
    # the GPU's own value (idle or loaded, see docs/scenarios.md).
    "gpu_ecc": {
        "gpu": ("gpu", ...),
        "corrected": ("integer", 0),
        "uncorrected": ("integer", 0),
    },
    "gpu_row_remap": {
        "gpu": ("gpu", ...),
        "correctable_rows": ("integer", 0),
        "uncorrectable_rows": ("integer", 0),
        "pending": ("bool", False),
        "failed": ("bool", False),
    },
    "gpu_retired_pages": {
        "gpu": ("gpu", ...),
        "single_bit": ("integer", 0),
        "double_bit": ("integer", 0),
        "pending": ("bool", False),
    },
    "gpu_temperature": {
        "gpu": ("gpu", ...),
        "gpu_celsius": ("integer", None),
        "memory_celsius": ("integer", None),
    },
    "gpu_power": {
        "gpu": ("gpu", ...),
        "draw_watts": ("number", None),
        "limit_watts": ("number", None),
        "enforced_limit_watts": ("number", None),
        "default_limit_watts": ("number", None),
    },
    "gpu_clocks": {
        "gpu": ("gpu", ...),
        "sm_mhz": ("integer", None),
        "memory_mhz": ("integer", None),
        "reasons": ("reasons", None),
        "applications_sm_mhz": ("integer", None),
    },
    "gpu_fabric": {
        "gpu": ("gpu", ...),
        "state": ("fabric_state", ...),
        "status": ("integer", None),
        "bandwidth_degraded": ("bool", None),
    },
    "gpu_gpm": {
        "gpu": ("gpu", ...),
        "sm_activity_percent": ("number", None),
        "tensor_activity_percent": ("number", None),
        "dram_bandwidth_percent": ("number", None),
        "nvlink_tx_bytes_per_second": ("number", None),
        "nvlink_rx_bytes_per_second": ("number", None),
        "pcie_tx_bytes_per_second": ("number", None),
        "pcie_rx_bytes_per_second": ("number", None),
    },
}

#: The largest trace file a ``trace`` activity drops: the traces source's default bound.
MAX_TRACE_BYTES = 16 << 20

#: Kinds that happen once, at ``from``.
INSTANT_KINDS = frozenset(
    {"xid", "sxid", "hot_unplug", "driver_rebind", "process_exit", "gpu_ecc", "trace"}
)

#: The GPU health kinds: what the simulated node applies to its fake GPUs' health fields.
GPU_HEALTH_KINDS = frozenset(
    {
        "gpu_ecc",
        "gpu_row_remap",
        "gpu_retired_pages",
        "gpu_temperature",
        "gpu_power",
        "gpu_clocks",
        "gpu_fabric",
        "gpu_gpm",
    }
)

#: Clock-event reason names a ``gpu_clocks`` activity may give, each with its NVML bit: the
#: schema's enum is these names.
CLOCK_EVENT_BITS: Mapping[str, int] = {name: bit for bit, name in CLOCK_EVENT_REASONS.items()}
#: Fabric registration states by name, as a ``gpu_fabric`` activity gives them.
FABRIC_STATE_NUMBERS: Mapping[str, int] = {name: n for n, name in FABRIC_STATES.items()}

#: NFSv4 operations of ``/proc/self/mountstats`` (fs/nfs/nfs4xdr.c ``nfs4_procedures``), the
#: values the schema allows for an ``nfs`` activity's ``op``.
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


@dataclass(frozen=True, slots=True)
class _Named:
    """What an activity may refer to, by name or index."""

    hardware: Hardware
    jobs: tuple[Job, ...]
    processes: Mapping[str, ProcessSpec]


def _timeline(
    source: _Source,
    entries: list[Mapping[str, Any]],
    hardware: Hardware,
    jobs: tuple[Job, ...],
    duration: float,
) -> tuple[Activity, ...]:
    """The activities, each active from ``from`` to after it and starting within the run."""
    named = _Named(
        hardware,
        jobs,
        {
            **{p.key: p for p in hardware.os.system_processes},
            **{p.key: p for job in jobs for p in job.processes},
        },
    )
    activities: list[Activity] = []
    for i, entry in enumerate(entries):
        where = f"/timeline/{i}"
        kind = entry["kind"]
        start = float(entry.get("from", 0.0))
        end = None if "to" not in entry else float(entry["to"])
        if end is not None and end <= start:
            raise source.fail(f"{where}/to", f"must be after from ({start:g})")
        if start > duration:
            raise source.fail(f"{where}/from", f"after the end of the scenario ({duration:g} s)")
        params = tuple(
            (name, _param(source, kind_of, entry, name, f"{where}/{name}", named))
            if name in entry
            else (name, default)
            for name, (kind_of, default) in ACTIVITY_FIELDS[kind].items()
        )
        activity = Activity(kind, start, end, params, where)
        _check_activity(source, activity, hardware)
        activities.append(activity)
    return tuple(activities)


def _param(
    source: _Source,
    kind_of: str,
    entry: Mapping[str, Any],
    name: str,
    where: str,
    named: _Named,
) -> Any:
    """The field ``name`` of an activity, read and, if it refers to something, checked."""
    raw = entry[name]
    hardware = named.hardware
    if kind_of == "number":
        return float(raw)
    if kind_of == "integer":
        return int(raw)
    if kind_of in ("text", "bool"):
        return raw
    if kind_of == "gpu":
        return _gpu_ref(source, raw, where, hardware)
    if kind_of == "nvswitch":
        if raw >= len(hardware.nvswitches):
            span = f"0-{len(hardware.nvswitches) - 1}" if hardware.nvswitches else "none"
            raise source.fail(where, f"no NVSwitch {raw} (NVSwitches: {span})")
        return int(raw)
    if kind_of == "links":
        # The activity's GPU was read (and checked) before its links.
        upper = max(0, hardware.gpus[entry["gpu"]].nvlink_count - 1)
        for k, link in enumerate(raw):
            if link > upper:
                raise source.fail(f"{where}/{k}", f"must be in 0..{upper}, got {link}")
        return tuple(int(link) for link in raw)
    if kind_of == "burst":
        period, on = float(raw["period_seconds"]), float(raw["on_seconds"])
        if on > period:
            raise source.fail(f"{where}/on_seconds", f"must be <= {period:g}, got {on:g}")
        return Burst(period, on)
    if kind_of == "disk":
        if raw not in {d.disk for d in hardware.nvme}:
            raise source.fail(where, f"no disk {raw!r}")
        return raw
    if kind_of == "nic":
        return _nic_ref(source, raw, where, hardware)
    if kind_of == "peer":
        if isinstance(raw, int):
            # Another GPU: CUDA peer-to-peer copies over PCIe.
            peer_gpu = _gpu_ref(source, raw, where, hardware)
            if peer_gpu == entry.get("gpu"):
                raise source.fail(where, "a GPU is not its own peer")
            return peer_gpu
        if raw in {d.disk for d in hardware.nvme} or raw in {n.name for n in hardware.nics}:
            return raw
        raise source.fail(where, f"no NIC or disk {raw!r}")
    if kind_of == "rates":
        return tuple(sorted((str(k), float(v)) for k, v in raw.items()))
    if kind_of == "aer":
        return tuple(
            (severity, tuple(sorted((str(k), float(v)) for k, v in errors.items())))
            for severity, errors in sorted(raw.items())
        )
    if kind_of == "pci":
        if raw not in {d.bdf for d in hardware.pcie.devices}:
            raise source.fail(where, f"no PCI function {raw}")
        return raw
    if kind_of == "process":
        return _process_ref(source, raw, where, named.processes)
    if kind_of == "processes":
        return tuple(
            _process_ref(source, ref, f"{where}/{k}", named.processes) for k, ref in enumerate(raw)
        )
    if kind_of == "mount":
        if raw not in {m.mountpoint for m in hardware.mounts}:
            raise source.fail(where, f"no mount {raw!r}")
        return raw
    if kind_of == "job":
        if raw not in {j.id for j in named.jobs}:
            raise source.fail(where, f"no job {raw}")
        return int(raw)
    if kind_of == "trace_file":
        # Read when the trace is dropped; checked now so a typo fails the load, not the run.
        path = (source.directory / raw).resolve()
        if not path.is_file():
            raise source.fail(where, f"no file {raw!r} (relative to {source.directory})")
        if path.stat().st_size > MAX_TRACE_BYTES:
            raise source.fail(where, f"larger than {MAX_TRACE_BYTES} bytes")
        return str(path)
    if kind_of == "reasons":
        # The names are checked by the schema; the node keeps NVML's bit mask.
        mask = 0
        for name in raw:
            mask |= CLOCK_EVENT_BITS[name]
        return mask
    if kind_of == "fabric_state":
        return FABRIC_STATE_NUMBERS[raw]
    raise AssertionError(kind_of)  # pragma: no cover - the table names only the kinds above


def _process_ref(
    source: _Source, ref: str, where: str, processes: Mapping[str, ProcessSpec]
) -> str:
    """``key`` or ``key#replica`` of a process of some job."""
    match = _PROCESS_REF.match(ref)
    if match is None or match.group("key") not in processes:
        known = ", ".join(sorted(processes)) or "none"
        raise source.fail(where, f"no process {ref[:40]!r} (processes: {known})")
    key, replica = match.group("key"), match.group("replica")
    if replica is not None and int(replica) >= processes[key].count:
        raise source.fail(where, f"{key} has {processes[key].count} replicas")
    return ref


def _check_activity(source: _Source, activity: Activity, hardware: Hardware) -> None:
    """What an activity needs of the hardware it names."""
    if activity.kind == "ib":
        nic = hardware.nic(activity.get("device"))
        if activity.get("port") > nic.ports:
            raise source.fail(f"{activity.pointer}/port", f"{nic.name} has {nic.ports} port(s)")
    if activity.kind == "nvlink" and not hardware.gpus[activity.get("gpu")].nvlinks:
        raise source.fail(f"{activity.pointer}/gpu", "this GPU has no NVLinks")
    if activity.kind == "errors":
        _check_errors(source, activity, hardware)
    if activity.kind == "pressure":
        for window in ("avg10", "avg60", "avg300"):
            some, full = activity.get(f"some_{window}"), activity.get(f"full_{window}")
            if some is not None and full is not None and full > some:
                # All tasks stalled is a part of the time some stalled.
                raise source.fail(
                    f"{activity.pointer}/full_{window}", f"must be <= some_{window} ({some:g})"
                )
    if activity.kind == "gpu_peer" and activity.get("peer") in {n.name for n in hardware.nics}:
        nic = hardware.nic(activity.get("peer"))
        if activity.get("port") > nic.ports:
            raise source.fail(f"{activity.pointer}/port", f"{nic.name} has {nic.ports} port(s)")
    if activity.kind in ("lock", "nfs") and not hardware.mount(activity.get("mount")).is_nfs:
        raise source.fail(f"{activity.pointer}/mount", "not an NFS mount")
    if activity.kind == "gpu_power":
        limit, enforced = activity.get("limit_watts"), activity.get("enforced_limit_watts")
        if limit is not None and enforced is not None and enforced > limit:
            # The enforced limit is the lowest of every limit in force, this one included.
            raise source.fail(
                f"{activity.pointer}/enforced_limit_watts", f"must be <= limit_watts ({limit:g})"
            )


def _check_errors(source: _Source, activity: Activity, hardware: Hardware) -> None:
    """An ``errors`` activity's target has what its counters live on."""
    where = activity.pointer
    gpu = activity.get("gpu")
    if gpu is not None and activity.get("nvlink") and not hardware.gpus[gpu].nvlinks:
        raise source.fail(f"{where}/gpu", "this GPU has no NVLinks")
    if activity.get("ib") is not None:
        nic = hardware.nic(activity.get("ib"))
        if activity.get("port") > nic.ports:
            raise source.fail(f"{where}/port", f"{nic.name} has {nic.ports} port(s)")
    bdf = activity.get("pci")
    if bdf is not None and activity.get("aer"):
        function = next(d for d in hardware.pcie.devices if d.bdf == bdf)
        if not function.has_aer:
            raise source.fail(f"{where}/pci", f"{bdf} has no AER capability (no aer_dev_* files)")


def iter_activities(scenario: Scenario, kind: str) -> Iterable[Activity]:
    return (a for a in scenario.timeline if a.kind == kind)
