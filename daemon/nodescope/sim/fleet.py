"""Fleet files, format ``nodescope-fleet/1``: nodes that run one multi-node Slurm job, the
healthy load each node carries, and the phases that change one node's load or stall the job.

The format is stated as a JSON schema, ``nodescope/sim/schema/fleet-v1.schema.json``,
explained in ``docs/scenarios.md`` (Fleets); the bundled fleets live in
``nodescope/sim/fleets/<name>.json``. :func:`parse_fleet` is pure: it validates a parsed
document with the schema, checks by hand what a schema cannot state (a phase's end after its
start, a stall that names no nodes, a fault that would fight the load) and returns a frozen
:class:`Fleet`. Every error is a :class:`~nodescope.errors.ParseError` naming the file and the
JSON pointer of the offending value, as the scenario loader's are.

:func:`node_scenario` turns a fleet into the scenario document of one node
(``nodescope-scenario/1``): the fleet's hardware with the node's host name, the job holding
GPUs ``0 … gpus_per_node - 1`` with one rank on each, and a timeline cut where any phase
starts or ends, each piece carrying the load in force then. ``nodescope demo --nodes N``
writes one per node and runs a daemon on each; the scenario loader judges every document, so
a fault's activity is checked as any scenario's is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from importlib import resources
from itertools import pairwise
from pathlib import Path
from typing import Any

from nodescope.errors import ParseError
from nodescope.sim.scenario import (  # the scenario loader's own checks, shared
    _NAME,
    _read_json,
    _reading_position,
    _reference,
    _reject_non_finite,
    _schema_failure,
    _schema_validator,
    _Source,
)
from nodescope.sim.scenario import FORMAT as SCENARIO_FORMAT

FORMAT = "nodescope-fleet/1"
PACKAGE_DIR = Path(__file__).resolve().parent
FLEET_DIR = PACKAGE_DIR / "fleets"
SCHEMA_NAME = "fleet-v1.schema.json"

#: ``nodescope demo --nodes``: two nodes make a job multi-node; 64 child daemons is already
#: more than one machine's cores serve in real time.
MIN_NODES = 2
MAX_NODES = 64

#: The activities that carry the load: a fault of one of these kinds would overlap the
#: load's own activity on the same GPU or device, and which one wins is not the fleet's to say.
LOAD_KINDS = frozenset({"gpu_util", "gpu_pcie", "nvlink", "ib"})

#: The job's rank processes: a training step of PyTorch with NCCL, one rank per GPU.
_RANK_THREADS = {
    "python3": 10,
    "pt_autograd_0": 1,
    "cuda-EvtHandlr": 1,
    "NCCL Service 0": 1,
    "NCCL Progress 0": 2,
}
_GPU_MEMORY_BYTES = 64 * 1024**3


@dataclass(frozen=True, slots=True)
class Load:
    """What one node carries at a moment: per GPU (utilisation, NVLink each way, PCIe each
    way) and per job NIC (InfiniBand each way, port 1)."""

    gpu_percent: float
    memory_percent: float = 0.0
    nvlink_tx_bytes_per_second: float = 0.0
    nvlink_rx_bytes_per_second: float = 0.0
    pcie_h2d_bytes_per_second: float = 0.0
    pcie_d2h_bytes_per_second: float = 0.0
    ib_tx_bytes_per_second: float = 0.0
    ib_rx_bytes_per_second: float = 0.0


@dataclass(frozen=True, slots=True)
class FleetJob:
    id: int
    user: str
    uid: int
    gpus_per_node: int
    nics: tuple[str, ...]
    memory_current_bytes: int


@dataclass(frozen=True, slots=True)
class Phase:
    """In force in [start, end) (``end`` ``None``: until the end). A stall phase
    (``stall_gpu_percent`` set) applies to every node and names none; any other phase names
    its nodes and multiplies their load by its factors, and holds its fault activities."""

    start: float
    end: float | None
    nodes: tuple[int, ...]
    gpu_util_factor: float = 1.0
    ib_tx_factor: float = 1.0
    ib_rx_factor: float = 1.0
    faults: tuple[Mapping[str, Any], ...] = ()
    stall_gpu_percent: float | None = None
    description: str = ""
    pointer: str = ""

    @property
    def is_stall(self) -> bool:
        return self.stall_gpu_percent is not None

    def applies_to(self, node: int) -> bool:
        return self.is_stall or node in self.nodes

    def active_at(self, t: float) -> bool:
        return t >= self.start and (self.end is None or t < self.end)


@dataclass(frozen=True, slots=True)
class Fleet:
    name: str
    description: str
    duration_seconds: float
    #: the scenario ``hardware`` object as written (a ``base`` stays a reference)
    hardware: Mapping[str, Any]
    job: FleetJob
    load: Load
    phases: tuple[Phase, ...]
    source: str = "<fleet>"
    directory: Path = PACKAGE_DIR

    def highest_node(self) -> int:
        """The highest node number a phase names (0: none)."""
        return max((n for p in self.phases for n in p.nodes), default=0)


def node_name(node: int) -> str:
    """Node ``i`` (from 1) is ``node01`` … ``node64``: the host name and the instance label."""
    return f"node{node:02d}"


# --------------------------------------------------------------------------------------------
# Loading


def bundled_fleets() -> list[str]:
    """Names of the fleets shipped in ``nodescope/sim/fleets``."""
    return sorted(p.stem for p in FLEET_DIR.glob("*.json"))


def fleet_path(name_or_path: str | Path) -> Path:
    """A bundled name (no ``/``, no ``.json``) resolves to package data, anything else is a
    path (as :func:`nodescope.sim.scenario.scenario_path` does for scenarios)."""
    text = str(name_or_path)
    if isinstance(name_or_path, str) and _NAME.match(text) and not text.endswith(".json"):
        bundled = FLEET_DIR / f"{text}.json"
        if bundled.is_file() or not Path(text).exists():
            return bundled
    return Path(name_or_path)


def load_fleet(name_or_path: str | Path) -> Fleet:
    """A fleet by bundled name (``job-straggler``) or file path."""
    path = fleet_path(name_or_path)
    if isinstance(name_or_path, str) and path.parent == FLEET_DIR and not path.is_file():
        raise ParseError(
            str(name_or_path),
            f"(document): no bundled fleet {name_or_path!r} "
            f"(bundled: {', '.join(bundled_fleets())}) and no such file",
        )
    return parse_fleet(_read_json(path), path)


class FleetSchema:
    """The fleet schema and its validator, built once per holder: a caller that parses many
    documents (the fuzz tests parse thousands) keeps one and passes it in."""

    def __init__(self) -> None:
        text = (resources.files("nodescope.sim") / "schema" / SCHEMA_NAME).read_text("utf-8")
        self.schema: dict[str, Any] = json.loads(text)
        self.validator: Any = _schema_validator(self.schema)


def parse_fleet(document: Any, path: Path, schema: FleetSchema | None = None) -> Fleet:
    """A fleet from its parsed JSON; ``path`` names it in errors and anchors a relative
    hardware ``base``."""
    source = _Source(str(path), path.parent)
    _reject_non_finite(source, document)
    checker = schema or FleetSchema()
    validator = checker.validator
    errors = list(validator.iter_errors(document))
    if errors:
        first = min(errors, key=lambda e: _reading_position(document, e.absolute_path))
        pointer, message = _schema_failure(first, checker.schema)
        raise source.fail(pointer, message)
    duration = float(document["duration_seconds"])
    job_spec = document["job"]
    job = FleetJob(
        id=job_spec["id"],
        user=job_spec["user"],
        uid=job_spec.get("uid", 1000),
        gpus_per_node=job_spec["gpus_per_node"],
        nics=tuple(job_spec["nics"]),
        memory_current_bytes=job_spec.get("memory_current_bytes", 0),
    )
    load_spec = document["load"]
    load = Load(**{key: float(value) for key, value in load_spec.items()})
    phases = tuple(
        _phase(source, spec, f"/phases/{i}", duration)
        for i, spec in enumerate(document.get("phases", []))
    )
    return Fleet(
        name=document["name"],
        description=document.get("description", ""),
        duration_seconds=duration,
        hardware=document["hardware"],
        job=job,
        load=load,
        phases=phases,
        source=str(path),
        directory=path.parent,
    )


def _phase(source: _Source, spec: Mapping[str, Any], where: str, duration: float) -> Phase:
    start = float(spec["from"])
    end = float(spec["to"]) if "to" in spec else None
    if start >= duration:
        raise source.fail(f"{where}/from", f"at or after the end ({duration:g} s)")
    if end is not None and end <= start:
        raise source.fail(f"{where}/to", f"must be after from ({start:g})")
    if end is not None and end > duration:
        raise source.fail(f"{where}/to", f"after the end ({duration:g} s)")
    changes = [k for k in ("gpu_util_factor", "ib_tx_factor", "ib_rx_factor", "fault") if k in spec]
    if "stall" in spec:
        # A stalled collective holds every rank: a stall on some nodes only is a straggler.
        if "nodes" in spec:
            raise source.fail(f"{where}/nodes", "a stall applies to every node: no nodes")
        if changes:
            raise source.fail(f"{where}/{changes[0]}", "a stall phase changes nothing else")
        return Phase(
            start,
            end,
            (),
            stall_gpu_percent=float(spec["stall"]["gpu_percent"]),
            description=spec.get("description", ""),
            pointer=where,
        )
    if "nodes" not in spec:
        raise source.fail(f"{where}/nodes", "needs the nodes it changes (or stall: every node)")
    if not changes:
        raise source.fail(
            where,
            "changes nothing: needs gpu_util_factor, ib_tx_factor, ib_rx_factor, fault or stall",
        )
    faults = tuple(spec.get("fault", ()))
    for i, fault in enumerate(faults):
        if fault["kind"] in LOAD_KINDS:
            raise source.fail(
                f"{where}/fault/{i}/kind",
                f"{fault['kind']} carries the load; change it with a factor",
            )
    return Phase(
        start,
        end,
        tuple(sorted(spec["nodes"])),
        gpu_util_factor=float(spec.get("gpu_util_factor", 1.0)),
        ib_tx_factor=float(spec.get("ib_tx_factor", 1.0)),
        ib_rx_factor=float(spec.get("ib_rx_factor", 1.0)),
        faults=faults,
        description=spec.get("description", ""),
        pointer=where,
    )


def check_nodes(fleet: Fleet, nodes: int) -> None:
    """A fleet run on ``nodes`` nodes: every phase names nodes that exist."""
    if not MIN_NODES <= nodes <= MAX_NODES:
        raise ValueError(f"the number of nodes must be {MIN_NODES} to {MAX_NODES}, got {nodes}")
    for phase in fleet.phases:
        for i, node in enumerate(phase.nodes):
            if node > nodes:
                raise ParseError(
                    fleet.source,
                    f"{phase.pointer}/nodes/{i}: names node {node}, "
                    f"and the fleet runs {nodes} nodes ({node_name(1)}-{node_name(nodes)})",
                )


# --------------------------------------------------------------------------------------------
# Per-node scenarios


def load_at(fleet: Fleet, node: int, t: float) -> Load:
    """The load node ``node`` carries at ``t``: the healthy load with the factors of every
    phase on it in force (several multiply), and a stall's zero traffic over all."""
    load = fleet.load
    gpu = ib_tx = ib_rx = 1.0
    stall: float | None = None
    for phase in fleet.phases:
        if not (phase.active_at(t) and phase.applies_to(node)):
            continue
        if phase.stall_gpu_percent is not None:
            stall = phase.stall_gpu_percent
        gpu *= phase.gpu_util_factor
        ib_tx *= phase.ib_tx_factor
        ib_rx *= phase.ib_rx_factor
    if stall is not None:
        # Every rank waits in the collective: nothing crosses any link. A rank that spins
        # in the wait keeps its GPU busy polling one flag, which moves no memory either.
        return Load(gpu_percent=stall, memory_percent=0.0)
    return replace(
        load,
        # A straggler's GPU does a fraction of its peers' work in the same wall time.
        gpu_percent=load.gpu_percent * gpu,
        memory_percent=load.memory_percent * gpu,
        ib_tx_bytes_per_second=load.ib_tx_bytes_per_second * ib_tx,
        ib_rx_bytes_per_second=load.ib_rx_bytes_per_second * ib_rx,
    )


def _pieces(fleet: Fleet, node: int) -> list[tuple[float, float | None, Load]]:
    """The node's timeline as pieces of constant load: cut where a phase starts or ends,
    neighbours with the same load joined (a node no phase names is one piece, a stall
    aside). The last piece has no end: after the timeline the node keeps its load."""
    cuts = {0.0, fleet.duration_seconds}
    for phase in fleet.phases:
        cuts.add(phase.start)
        if phase.end is not None:
            cuts.add(phase.end)
    ordered = sorted(c for c in cuts if c <= fleet.duration_seconds)
    pieces: list[tuple[float, float | None, Load]] = []
    for start, end in pairwise(ordered):
        load = load_at(fleet, node, start)
        if pieces and pieces[-1][2] == load:
            pieces[-1] = (pieces[-1][0], end, load)
        else:
            pieces.append((start, end, load))
    last_start, _, last_load = pieces[-1]
    pieces[-1] = (last_start, None, last_load)
    return pieces


def _timed(activity: Mapping[str, Any], start: float, end: float | None) -> dict[str, Any]:
    timed = {"kind": activity["kind"], "from": start}
    if end is not None:
        timed["to"] = end
    timed.update((k, v) for k, v in activity.items() if k != "kind")
    return timed


def node_scenario(fleet: Fleet, node: int) -> dict[str, Any]:
    """The ``nodescope-scenario/1`` document of node ``node`` (from 1)."""
    name = node_name(node)
    job = fleet.job
    gpus = list(range(job.gpus_per_node))
    timeline: list[dict[str, Any]] = []
    for start, end, load in _pieces(fleet, node):
        for gpu in gpus:
            per_gpu = (
                {
                    "kind": "gpu_util",
                    "gpu": gpu,
                    "gpu_percent": load.gpu_percent,
                    "memory_percent": load.memory_percent,
                },
                {
                    "kind": "nvlink",
                    "gpu": gpu,
                    "tx_bytes_per_second": load.nvlink_tx_bytes_per_second,
                    "rx_bytes_per_second": load.nvlink_rx_bytes_per_second,
                },
                {
                    "kind": "gpu_pcie",
                    "gpu": gpu,
                    "h2d_bytes_per_second": load.pcie_h2d_bytes_per_second,
                    "d2h_bytes_per_second": load.pcie_d2h_bytes_per_second,
                },
            )
            timeline.extend(_timed(a, start, end) for a in per_gpu)
        for nic in job.nics:
            ib = {
                "kind": "ib",
                "device": nic,
                "tx_bytes_per_second": load.ib_tx_bytes_per_second,
                "rx_bytes_per_second": load.ib_rx_bytes_per_second,
            }
            timeline.append(_timed(ib, start, end))
    for phase in fleet.phases:
        if phase.applies_to(node):
            timeline.extend(_timed(fault, phase.start, phase.end) for fault in phase.faults)
    described = [
        f"{p.start:g}-{'end' if p.end is None else format(p.end, 'g')} s: {p.description}"
        for p in fleet.phases
        if p.applies_to(node) and p.description
    ]
    return {
        "format": SCENARIO_FORMAT,
        "name": f"{fleet.name}-{name}",
        "description": f"{name} of fleet {fleet.name}, job {job.id}"
        + (": " + "; ".join(described) if described else ": healthy throughout"),
        "tick_seconds": 1,
        "duration_seconds": fleet.duration_seconds,
        "hardware": _node_hardware(fleet, name),
        "jobs": [
            {
                "id": job.id,
                "user": job.user,
                "uid": job.uid,
                "gpus": gpus,
                "nics": list(job.nics),
                "memory_current_bytes": job.memory_current_bytes,
                "processes": [
                    {
                        "key": "rank",
                        "comm": "python3",
                        "cmdline": "python3 train.py",
                        "count": len(gpus),
                        "threads": _RANK_THREADS,
                        "gpu": "each",
                        "gpu_memory_bytes": _GPU_MEMORY_BYTES,
                        "cpu_percent": 100,
                        "state": "R",
                        "wchan": "0",
                    }
                ],
            }
        ],
        "timeline": timeline,
    }


def _node_hardware(fleet: Fleet, name: str) -> dict[str, Any]:
    """The fleet's hardware with the node's host name. The node's scenario lives elsewhere
    than the fleet file, so a ``base`` or capture it refers to is named by absolute path."""
    hardware = dict(fleet.hardware)
    source = _Source(fleet.source, fleet.directory)
    base = hardware.get("base")
    if isinstance(base, str):
        hardware["base"] = str(_reference(source, base))
    pcie = hardware.get("pcie")
    if isinstance(pcie, dict) and isinstance(pcie.get("lspci"), str):
        hardware["pcie"] = {**pcie, "lspci": str(_reference(source, pcie["lspci"], "lspci"))}
    os_spec = hardware.get("os")
    hardware["os"] = {**(os_spec if isinstance(os_spec, dict) else {}), "hostname": name}
    return hardware


# --------------------------------------------------------------------------------------------
# Prometheus


def file_sd(targets: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
    """Prometheus file-based service discovery for ``(node name, host:port)`` pairs. Every
    node serves on loopback, so the address would make every ``instance`` the same host:
    the label is set to the node's name."""
    return [{"targets": [address], "labels": {"instance": name}} for name, address in targets]
