"""A node's health as one verdict per component: what ``nodescope check`` prints.

An operator asking "is this node healthy?" thinks in parts they can replace or drain for: each
GPU, the NVLink/NVSwitch fabric, each PCIe root port, each InfiniBand port, the disks, each job
and the kernel log. :func:`assess` files every finding of an analysed snapshot (and, when a
daemon answered, every alert it is firing) under the component it is about, and gives each
component the worst status among its concerns: a critical finding fails it, a warning degrades
it, an informational one is shown and leaves it healthy. Components come from what the sources
saw, so a healthy GPU is listed as healthy rather than left out; a part nodescope could not look
at is said to be unchecked, with why.

Pure: records in, records out. The command (``nodescope/cli/check.py``) collects, analyses and
prints.
"""

from __future__ import annotations

import enum
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from nodescope.model.disks import DISKS
from nodescope.model.finding import Finding, Severity
from nodescope.model.infiniband import INFINIBAND
from nodescope.model.job_records import JOBS
from nodescope.model.nvml import NVML
from nodescope.model.snapshot import Snapshot
from nodescope.model.sxid import SXID
from nodescope.model.topology import PCI, DeviceClass, Topology

#: NVIDIA's PCI vendor id: GPUs on the bus that NVML does not answer for are a failed driver.
NVIDIA_VENDOR_ID = 0x10DE

#: Kinds about the fabric between GPUs rather than one GPU: NVLink counters and stalls,
#: NVSwitch SXids and the fabric manager's registration of a GPU.
_FABRIC_PREFIXES = ("nvlink_", "nvswitch_", "gpu_fabric_")

#: Sources whose absence on a node without that hardware is not a fault: the kernel module's
#: device is optional, and NVML is judged against the GPUs on the PCI bus instead.
_JUDGED_ELSEWHERE = frozenset({"nvml"})


#: What the remediation policy does about a kind at a severity, in the configuration's words.
ActionOf = Callable[[str, Severity], str]


class Status(enum.IntEnum):
    """Ordered, and the command's exit status: 0 healthy, 1 degraded, 2 failed."""

    HEALTHY = 0
    DEGRADED = 1
    FAILED = 2

    @property
    def label(self) -> str:
        return self.name.lower()


def status_of(severity: Severity) -> Status:
    if severity >= Severity.CRITICAL:
        return Status.FAILED
    if severity >= Severity.WARNING:
        return Status.DEGRADED
    return Status.HEALTHY


@dataclass(frozen=True, slots=True)
class Concern:
    """One finding or firing alert filed under a component. ``origin`` is ``check`` for what
    this run found, ``daemon`` for an alert the running daemon is firing; ``action`` is what
    the remediation policy does about this kind at this severity (``none``, ``alert``,
    ``drain``, ``drain_requeue``)."""

    kind: str
    severity: Severity
    message: str
    subjects: Mapping[str, str]
    evidence: Mapping[str, float]
    action: str
    origin: str = "check"


@dataclass(frozen=True, slots=True)
class Component:
    """``category``: ``gpu``, ``fabric``, ``pcie``, ``infiniband``, ``disks``, ``jobs``,
    ``kernel_log``, ``node``; ``name`` identifies it within its category (a GPU index, a root
    port's address); ``facts`` are what was seen of it when nothing is wrong, in words."""

    category: str
    name: str
    title: str
    facts: tuple[str, ...] = ()
    concerns: tuple[Concern, ...] = ()
    unchecked: str | None = None

    @property
    def status(self) -> Status:
        worst = max((status_of(c.severity) for c in self.concerns), default=Status.HEALTHY)
        if self.unchecked is not None:
            worst = max(worst, Status.DEGRADED)
        return worst


@dataclass(frozen=True, slots=True)
class NodeVerdict:
    components: tuple[Component, ...]
    #: sources that were down at the end of the run, with their errors
    sources_down: Mapping[str, str] = field(default_factory=dict)

    @property
    def status(self) -> Status:
        return max((c.status for c in self.components), default=Status.HEALTHY)


#: What a component's title says for each category when the node has several of a kind.
_CATEGORY_ORDER = ("gpu", "fabric", "pcie", "infiniband", "disks", "jobs", "kernel_log", "node")


class _Place:
    """Where a concern goes: the snapshot's devices resolved once."""

    def __init__(self, snapshot: Snapshot) -> None:
        nvml = snapshot.latest(NVML)
        self.gpu_by_address: dict[str, str] = {}
        if nvml is not None:
            for gpu in nvml.gpus:
                self.gpu_by_address[gpu.pci_address.lower()] = str(gpu.index)
        self.topology: Topology | None = snapshot.latest(PCI)

    def root_port(self, bdf: str) -> str | None:
        if self.topology is None:
            return None
        device = self.topology.get(bdf)
        return device.root_port if device is not None else None

    def gpu_of(self, bdf: str) -> str | None:
        return self.gpu_by_address.get(bdf.lower())

    def of(self, kind: str, subjects: Mapping[str, str]) -> tuple[str, str]:
        """(category, name) of the component a concern of ``kind`` about ``subjects`` is
        filed under."""
        if kind.startswith(_FABRIC_PREFIXES):
            return "fabric", "nvlink"
        if "gpu" in subjects:
            return "gpu", subjects["gpu"]
        if kind.startswith("ib_") or "hca" in subjects:
            hca = subjects.get("hca", subjects.get("device", "?"))
            port = subjects.get("port")
            return "infiniband", f"{hca}/{port}" if port else hca
        if "job" in subjects:
            return "jobs", subjects["job"]
        for role in ("device", "link", "root_port", "bdf"):
            bdf = subjects.get(role)
            if bdf is None:
                continue
            gpu = self.gpu_of(bdf)
            if gpu is not None:
                return "gpu", gpu
            return "pcie", self.root_port(bdf) or bdf
        if "xid" in kind:
            return "kernel_log", "kmsg"
        return "node", "node"


def _gpu_components(snapshot: Snapshot, place: _Place) -> list[Component]:
    nvml = snapshot.latest(NVML)
    sample = snapshot.current.get(NVML.name)
    if nvml is not None:
        components = []
        for gpu in nvml.gpus:
            facts = [gpu.pci_address]
            if gpu.gpu_util_percent is not None:
                facts.append(f"{gpu.gpu_util_percent}% busy")
            if gpu.pcie_gen_current is not None and gpu.pcie_width_current is not None:
                facts.append(f"PCIe Gen{gpu.pcie_gen_current} x{gpu.pcie_width_current}")
            components.append(
                Component("gpu", str(gpu.index), f"GPU {gpu.index} {gpu.name}", tuple(facts))
            )
        listed = {gpu.index for gpu in nvml.gpus}
        for lost in nvml.lost:
            if lost.gpu in listed:
                continue
            # A GPU the driver stopped answering for: its own finding (gpu_fell_off_bus)
            # says what happened; here it is at least not shown as healthy.
            components.append(
                Component(
                    "gpu",
                    str(lost.gpu),
                    f"GPU {lost.gpu} ({lost.pci_address})",
                    unchecked="NVML no longer answers for this GPU",
                )
            )
        return components
    on_bus = _nvidia_gpus_on_bus(place.topology)
    if not on_bus:
        return []
    error = sample.error if sample is not None and sample.error else "no NVML record"
    # GPUs the bus shows that the driver does not answer for: the node cannot run GPU jobs.
    return [
        Component(
            "gpu",
            "all",
            f"{len(on_bus)} NVIDIA GPU(s) on the PCI bus",
            (", ".join(on_bus),),
            (
                Concern(
                    "gpu_driver_unavailable",
                    Severity.CRITICAL,
                    f"{len(on_bus)} NVIDIA GPU(s) on the PCI bus but NVML does not answer: {error}",
                    {},
                    {"gpus_on_bus": float(len(on_bus))},
                    "drain",
                ),
            ),
        )
    ]


def _nvidia_gpus_on_bus(topology: Topology | None) -> list[str]:
    if topology is None:
        return []
    return [
        d.bdf
        for d in topology.of_class(DeviceClass.GPU)
        if d.vendor_id == NVIDIA_VENDOR_ID and d.physical_function is None
    ]


def _fabric_component(snapshot: Snapshot) -> list[Component]:
    nvml = snapshot.latest(NVML)
    if nvml is None or not nvml.gpus:
        return []
    links = sum(len(g.nvlinks.link) for g in nvml.gpus)
    active = sum(1 for g in nvml.gpus for a in g.nvlinks.active if a)
    if links == 0:
        return []
    return [Component("fabric", "nvlink", "NVLink fabric", (f"{active} of {links} links up",))]


def _pcie_components(place: _Place) -> list[Component]:
    topology = place.topology
    if topology is None:
        return []
    components = []
    for port in topology.devices:
        if port.root_port != port.bdf or port.device_class is not DeviceClass.BRIDGE:
            continue
        below = [d for d in topology.below(port.bdf) if d.device_class is not DeviceClass.BRIDGE]
        if not below:
            continue
        facts = []
        if port.link is not None and port.link.current_speed_gts is not None:
            facts.append(f"{port.link.current_speed_gts:g} GT/s x{port.link.current_width}")
        classes = sorted({d.device_class.value for d in below})
        facts.append(f"{len(below)} function(s) below: {', '.join(classes)}")
        components.append(Component("pcie", port.bdf, f"PCIe root port {port.bdf}", tuple(facts)))
    return components


def _infiniband_components(snapshot: Snapshot) -> list[Component]:
    data = snapshot.latest(INFINIBAND)
    if data is None:
        return []
    components = []
    for port in data.ports():
        facts = []
        if port.state is not None:
            facts.append(port.state.name)
        if port.rate is not None:
            facts.append(f"{port.rate.gbps:g} Gb/s")
        if port.link_layer:
            facts.append(port.link_layer)
        components.append(
            Component(
                "infiniband",
                f"{port.device}/{port.port}",
                # RoCE ports are RDMA over Ethernet: the same counters, another name.
                f"{'RoCE' if port.link_layer == 'Ethernet' else 'InfiniBand'}"
                f" {port.device} port {port.port}",
                tuple(facts),
            )
        )
    return components


def _disk_order(name: str) -> tuple[str | int, ...]:
    """A sort key that puts loop2 before loop10 (numbers compared as numbers, as disk names
    are numbered in decimal; PCI addresses, in hex, are not sorted with it)."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def _disks_component(snapshot: Snapshot) -> list[Component]:
    data = snapshot.latest(DISKS)
    if data is None or not data.disks:
        return []
    # Storage hardware by name, virtual disks by count: a host can carry dozens of loop devices
    # (one per snap or image ever attached), and a list of them would hide the NVMe drives.
    hardware = sorted((d.name for d in data.disks if not d.virtual), key=_disk_order)
    virtual = Counter(d.virtual_kind for d in data.disks if d.virtual_kind)
    parts = []
    if hardware:
        parts.append(
            ", ".join(hardware[:8])
            + (f" and {len(hardware) - 8} more" if len(hardware) > 8 else "")
        )
    if virtual:
        parts.append("virtual: " + ", ".join(f"{n} {kind}" for kind, n in sorted(virtual.items())))
    return [Component("disks", "disks", "Disks", ("; ".join(parts),))]


def _jobs_components(snapshot: Snapshot) -> list[Component]:
    data = snapshot.latest(JOBS)
    if data is None:
        return []
    seen: dict[str, Component] = {}
    for job in data.jobs:
        name = job.job_id or job.key
        seen[name] = Component("jobs", name, f"Job {name}", (f"cgroup {job.path}",))
    for registration in data.registrations:
        if registration.job_id not in seen:
            seen[registration.job_id] = Component(
                "jobs", registration.job_id, f"Job {registration.job_id}", ("registered",)
            )
    return list(seen.values())


def _kernel_log_component(snapshot: Snapshot) -> list[Component]:
    sxid = snapshot.latest(SXID)
    nvml = snapshot.latest(NVML)
    facts = []
    if nvml is not None and nvml.xid_source is not None:
        facts.append(f"{sum(x.count for x in nvml.xids)} Xid(s) since start ({nvml.xid_source})")
    if sxid is not None:
        facts.append(f"{sum(c.count for c in sxid.counts)} SXid(s) since start")
        if sxid.lost:
            facts.append(f"{sxid.lost} time(s) records were lost before they were read")
    if not facts:
        return []
    return [Component("kernel_log", "kmsg", "Kernel log", tuple(facts))]


def assess(
    snapshot: Snapshot,
    findings: Iterable[Finding],
    action_of: ActionOf,
    daemon_alerts: Sequence[Mapping[str, object]] = (),
) -> NodeVerdict:
    """Every component the snapshot shows, with the findings and the daemon's firing alerts
    filed under them. ``action_of(kind, severity)`` names what the remediation policy does."""
    place = _Place(snapshot)
    components: dict[tuple[str, str], Component] = {}
    for component in (
        *_gpu_components(snapshot, place),
        *_fabric_component(snapshot),
        *_pcie_components(place),
        *_infiniband_components(snapshot),
        *_disks_component(snapshot),
        *_jobs_components(snapshot),
        *_kernel_log_component(snapshot),
    ):
        components[(component.category, component.name)] = component
    concerns: dict[tuple[str, str], list[Concern]] = {}
    for finding in findings:
        concern = Concern(
            finding.kind,
            finding.severity,
            finding.message,
            finding.subjects,
            finding.evidence,
            action_of(finding.kind, finding.severity),
        )
        concerns.setdefault(place.of(finding.kind, finding.subjects), []).append(concern)
    for alert in daemon_alerts:
        fired = _alert_concern(alert, action_of)
        if fired is not None:
            concerns.setdefault(place.of(fired.kind, fired.subjects), []).append(fired)
    for where, found in concerns.items():
        known = components.get(where)
        if known is None:
            category, name = where
            known = Component(category, name, _title(category, name))
        components[where] = Component(
            known.category,
            known.name,
            known.title,
            known.facts,
            tuple(sorted(known.concerns + tuple(found), key=_worst_first)),
            known.unchecked,
        )
    down = {
        name: sample.error or "down"
        for name, sample in snapshot.current.items()
        if not sample.ok and name not in _JUDGED_ELSEWHERE
    }
    if down:
        where = ("node", "node")
        node = components.get(where, Component("node", "node", "nodescope sources"))
        components[where] = Component(
            node.category,
            node.name,
            node.title,
            node.facts,
            node.concerns,
            "down: " + "; ".join(f"{name} ({error})" for name, error in sorted(down.items())),
        )
    ordered = sorted(
        components.values(),
        key=lambda c: (_CATEGORY_ORDER.index(c.category), _natural(c.name)),
    )
    return NodeVerdict(tuple(ordered), down)


def _worst_first(concern: Concern) -> tuple[int, str, str]:
    return (-int(concern.severity), concern.kind, concern.message)


def _natural(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 30, name)


def _title(category: str, name: str) -> str:
    return {
        "gpu": f"GPU {name}",
        "fabric": "NVLink fabric",
        "pcie": f"PCIe root port {name}",
        "infiniband": f"InfiniBand {name}",
        "disks": "Disks",
        "jobs": f"Job {name}",
        "kernel_log": "Kernel log",
        "node": "Node",
    }[category]


def _alert_concern(alert: Mapping[str, object], action_of: ActionOf) -> Concern | None:
    if alert.get("state") != "firing":
        return None
    kind = alert.get("kind")
    severity = {s.label: s for s in Severity}.get(str(alert.get("severity")))
    if not isinstance(kind, str) or severity is None:
        return None
    raw_subjects = alert.get("subjects")
    subjects = (
        {str(k): str(v) for k, v in raw_subjects.items()} if isinstance(raw_subjects, dict) else {}
    )
    raw_evidence = alert.get("evidence_last")
    evidence = (
        {str(k): float(v) for k, v in raw_evidence.items() if isinstance(v, int | float)}
        if isinstance(raw_evidence, dict)
        else {}
    )
    message = alert.get("message")
    return Concern(
        kind,
        severity,
        message if isinstance(message, str) else "",
        subjects,
        evidence,
        action_of(kind, severity),
        origin="daemon",
    )
