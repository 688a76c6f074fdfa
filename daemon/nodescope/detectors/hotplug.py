"""Hardware that went away or will not stay: GPUs that fell off the bus, links that flap.

``gpu_fell_off_bus`` (critical), one per GPU, from any of three signs:

* NVML answers ``GPU_IS_LOST`` for it (the ``nvml`` source's ``lost`` list);
* Xid 79, "GPU has fallen off the bus" (NVML Xid events or the kernel log fallback);
* its PCI function disappeared from ``/sys/bus/pci/devices`` (the ``udev`` source: a
  removal event or a GPU missing from the listing), which also covers a driver that never
  got to report anything.

The finding holds while any sign does, so it stays until the GPU is back (a reset or a
reboot) and names the GPU by index and PCI address, with the job that used it in the previous
cycle when the job view still knew (in the message: the identity is the GPU's).

``pci_device_removed`` (critical or warning), one per PCI function of any other class that
left the bus — an NVMe controller, a NIC, a PCIe switch or root port with all it led to —
from what the node shows between two reads:

* the ``pci`` source's two latest topologies (``snapshot.pair(PCI)``): a function present in
  the earlier and absent from the later. A read that skipped something (a function it could
  not finish reading is left out with all below it) proves no removal on its own: then only
  a function the ``udev`` source saw a removal event for counts;
* the ``udev`` source's removal events of this run (``remove`` on the ``pci`` subsystem, of
  any class) for a function the latest topology no longer has.

A function removed and added back before the topology was read again is present in both
reads and is not reported, nor is a driver unbound from a function that stays on the bus
(``unbind`` is no removal, and the function is in both reads). One finding names the
topmost function that went (a switch's upstream port, not each of its ports); the functions
below it, read from the earlier topology, are in its message and evidence. A GPU is
``gpu_fell_off_bus``'s, and so are the other functions of its slot (its audio function); a
switch that took GPUs with it is reported here as well, listing them. The jobs that used what
went: GPUs through the job registry and placement view, NVMe controllers through the disks'
namespaces and the block device the jobs' cgroups show I/O on (``io.stat``), HCAs through the
placement view (``NCCL_IB_HCA``, or every HCA when unset). Critical when a GPU or NVMe
controller that a running job used went; otherwise a warning. Once critical it stays critical
while it lasts, naming the jobs it named first (the disks' reads stop listing a removed drive's
namespaces before the pci source reads the tree again). The finding lasts while the two reads
differ; its alert rule keeps it firing for half an hour after.

``link_flapping`` (warning), one per network interface or InfiniBand port whose up/down
transitions within the ``link_events`` source's window reach ``flap_transitions``; the
evidence ``value``/``threshold`` pair lets the alert engine hold it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from nodescope.alerts import AlertRule
from nodescope.config import HotplugSettings
from nodescope.detectors.common import jobs
from nodescope.detectors.kinds import FindingKind, actions, severities
from nodescope.model.disks import DISKS
from nodescope.model.finding import THRESHOLD, VALUE, Finding, Severity
from nodescope.model.link_events import LINK_EVENTS
from nodescope.model.nvml import NVML
from nodescope.model.snapshot import Snapshot
from nodescope.model.topology import PCI, DeviceClass, PciDevice, Topology, switch_of
from nodescope.model.udev import UDEV, UdevEvent, is_gpu_class

FELL_OFF_BUS = "gpu_fell_off_bus"
REMOVED = "pci_device_removed"
FLAPPING = "link_flapping"
XID_FELL_OFF_BUS = 79

SPECS = (
    FindingKind(
        FELL_OFF_BUS,
        severities(Severity.CRITICAL),
        actions(critical="drain"),
        meaning="a GPU stopped answering on the bus (lost to NVML, Xid 79, or its PCI"
        " function left sysfs)",
        signal="NVML `GPU_IS_LOST`, Xid 79, the PCI function leaving sysfs (udev)",
        hardware="yes",
        alert=AlertRule(for_seconds=0.0, resolve_after_seconds=600.0),
    ),
    FindingKind(
        REMOVED,
        severities(Severity.WARNING, Severity.CRITICAL),
        actions(critical="drain", warning="alert"),
        meaning="a PCI device left the system (critical when a running job used it)",
        signal="udev remove events and the sysfs device listing",
        hardware="yes",
        # Found in the one cycle whose two reads differ: held long enough to be seen.
        alert=AlertRule(for_seconds=0.0, resolve_after_seconds=1800.0),
    ),
    FindingKind(
        FLAPPING,
        severities(Severity.WARNING),
        actions(warning="alert"),
        meaning="a network link went down and up again and again within minutes",
        signal="link state changes of the network interfaces over netlink",
        hardware="yes",
        alert=AlertRule(for_seconds=0.0, resolve_after_seconds=300.0),
    ),
)


@dataclass
class _Signs:
    lost: bool = False
    xid79: int = 0
    removed: bool = False


def fell_off_bus(previous: Snapshot | None, snapshot: Snapshot) -> list[Finding]:
    nvml = snapshot.latest(NVML)
    udev = snapshot.latest(UDEV)
    signs: dict[str, _Signs] = {}
    index_of: dict[str, int] = {}
    if nvml is not None:
        for sample in nvml.gpus:
            index_of[sample.pci_address.lower()] = sample.index
        for lost in nvml.lost:
            if lost.pci_address:
                index_of[lost.pci_address.lower()] = lost.gpu
                signs.setdefault(lost.pci_address.lower(), _Signs()).lost = True
        for xid in nvml.xids:
            if xid.xid == XID_FELL_OFF_BUS and xid.count > 0 and xid.pci_address:
                if xid.gpu is not None:
                    index_of[xid.pci_address.lower()] = xid.gpu
                signs.setdefault(xid.pci_address.lower(), _Signs()).xid79 += xid.count
    if udev is not None:
        for bdf in udev.gpus_missing:
            signs.setdefault(bdf.lower(), _Signs()).removed = True
    if not signs:
        return []
    job_of: dict[int, list[str]] = {}
    if previous is not None:
        for view in jobs(previous):
            for gpu in view.gpus:
                job_of.setdefault(gpu, []).append(view.job_id)
    removals = {r.bdf: r.count for r in udev.gpu_removals} if udev is not None else {}
    findings = []
    for bdf, sign in sorted(signs.items()):
        index = index_of.get(bdf)
        subjects = {"bdf": bdf}
        if index is not None:
            subjects["gpu"] = str(index)
        how = []
        if sign.xid79:
            how.append(f"Xid 79 ×{sign.xid79}")
        if sign.lost:
            how.append("NVML reports it lost")
        if sign.removed:
            how.append("its PCI function is gone from sysfs")
        jobs_text = ""
        owners = job_of.get(index, []) if index is not None else []
        if owners:
            # In the message only: the job view forgets the GPU a cycle later, and the
            # finding's identity must not change with it.
            jobs_text = f"; job {', '.join(owners)} used it"
        name = f"GPU {index} ({bdf})" if index is not None else f"GPU {bdf}"
        findings.append(
            Finding(
                FELL_OFF_BUS,
                Severity.CRITICAL,
                subjects,
                {
                    "xid79_events": float(sign.xid79),
                    "nvml_lost": float(sign.lost),
                    "pci_removed": float(sign.removed),
                    "pci_removals": float(removals.get(bdf, 0)),
                },
                f"{name} fell off the bus: {', '.join(how)}{jobs_text}",
            )
        )
    return findings


@dataclass(frozen=True, slots=True)
class _Gone:
    """A function that left the bus: as the earlier topology knew it, or (``device`` None)
    only as its removal event described it."""

    bdf: str
    device: PciDevice | None
    event: UdevEvent | None

    @property
    def is_gpu(self) -> bool:
        if self.device is not None:
            return self.device.device_class is DeviceClass.GPU
        return self.event is not None and is_gpu_class(self.event.pci_class)

    def describe(self) -> str:
        if self.device is not None:
            dev = self.device
            what = dev.device_class.value
            if dev.device_class is DeviceClass.BRIDGE:
                what = dev.role.value.replace("_", " ")
            names = f" {'/'.join(dev.os_names)}" if dev.os_names else ""
            return (
                f"{what}{names} {dev.bdf} (class {dev.class_code:06x},"
                f" {dev.vendor_id:04x}:{dev.device_id:04x})"
            )
        event = self.event
        cls = f"class {event.pci_class:06x}" if event and event.pci_class is not None else ""
        ids = f"{event.pci_id[0]:04x}:{event.pci_id[1]:04x}" if event and event.pci_id else ""
        detail = ", ".join(x for x in (cls, ids) if x)
        return f"function {self.bdf}" + (f" ({detail})" if detail else "")


def _slot(bdf: str) -> str:
    return bdf.rpartition(".")[0]


def _gone_functions(snapshot: Snapshot) -> dict[str, _Gone]:
    """Every function that left the bus between the two latest reads, by BDF."""
    udev = snapshot.latest(UDEV)
    removed: dict[str, UdevEvent] = {}
    if udev is not None:
        for event in udev.recent:
            if event.is_pci_removal and event.pci_slot is not None:
                removed[event.pci_slot] = event
    pair = snapshot.pair(PCI)
    now: Topology | None = snapshot.latest(PCI)
    gone: dict[str, _Gone] = {}
    before: Topology | None = None
    if pair is not None:
        before, now, _seconds = pair
        for device in before.devices:
            if now.get(device.bdf) is not None or _retired_vf(device, now):
                continue
            if now.skipped and device.bdf not in removed:
                continue
            gone[device.bdf] = _Gone(device.bdf, device, removed.get(device.bdf))
    if now is not None:
        for bdf, event in removed.items():
            # Present in the latest read: back again (a rescan), or not yet read without it.
            if bdf in gone or now.get(bdf) is not None:
                continue
            known = before.get(bdf) if before is not None else None
            if known is not None and _retired_vf(known, now):
                continue
            gone[bdf] = _Gone(bdf, known, event)
    # Virtual functions that left with their physical function are its finding's to tell.
    return {
        bdf: g
        for bdf, g in gone.items()
        if g.device is None or g.device.physical_function not in gone
    }


def _retired_vf(device: PciDevice, now: Topology) -> bool:
    """An SR-IOV virtual function whose physical function is still on the bus: its driver
    took the VF away (``sriov_numvfs`` lowered, the PF's driver reloaded), nothing left the
    bus."""
    pf = device.physical_function
    return pf is not None and now.get(pf) is not None


def _below(top: _Gone, gone: Mapping[str, _Gone]) -> list[_Gone]:
    return [
        g
        for g in gone.values()
        if g is not top and g.device is not None and top.bdf in g.device.chain[:-1]
    ]


def _gpu_jobs(previous: Snapshot | None, snapshot: Snapshot) -> dict[str, set[str]]:
    """GPU BDF -> the jobs that used it: the placement view of the cycle before (this one's
    may have lost the GPU already) and this one's, and the registry's GPUs by index."""
    out: dict[str, set[str]] = {}
    index_to_bdf: dict[int, str] = {}
    for snap in (previous, snapshot):
        if snap is None:
            continue
        for view in jobs(snap):
            for bdf in view.gpu_bdfs:
                out.setdefault(bdf.lower(), set()).add(view.job_id)
        nvml = snap.latest(NVML)
        if nvml is not None:
            for sample in nvml.gpus:
                index_to_bdf[sample.index] = sample.pci_address.lower()
            for lost in nvml.lost:
                if lost.pci_address:
                    index_to_bdf[lost.gpu] = lost.pci_address.lower()
    for job in snapshot.derived.jobs:
        if not job.running:
            continue
        for index in job.gpus:
            address = index_to_bdf.get(index)
            if address is not None:
                out.setdefault(address, set()).add(job.job_id)
    return out


def _nvme_jobs(previous: Snapshot | None, snapshot: Snapshot, bdf: str) -> tuple[set[str], str]:
    """The jobs whose cgroups show I/O on the namespaces of the NVMe controller at ``bdf``,
    and the namespaces' names. The disks' record of the cycle before still lists them."""
    devices: set[str] = set()
    names: list[str] = []
    for snap in (previous, snapshot):
        data = snap.latest(DISKS) if snap is not None else None
        if data is None:
            continue
        disks = {d.name: f"{d.major}:{d.minor}" for d in data.disks}
        for namespace in data.nvme:
            if any(p.pci_address and p.pci_address.lower() == bdf for p in namespace.paths):
                if namespace.disk not in names:
                    names.append(namespace.disk)
                if namespace.disk in disks:
                    devices.add(disks[namespace.disk])
    users: set[str] = set()
    for job in snapshot.derived.jobs:
        io = job.stats.io_stat if job.running and job.stats is not None else None
        if io is None:
            continue
        for device in devices:
            entry = io.get(device)
            if entry is not None and ((entry.rbytes or 0) + (entry.wbytes or 0)) > 0:
                users.add(job.job_id)
    return users, ", ".join(names)


def _hca_jobs(previous: Snapshot | None, snapshot: Snapshot, hcas: set[str]) -> set[str]:
    users: set[str] = set()
    for snap in (previous, snapshot):
        if snap is None:
            continue
        for view in jobs(snap):
            if hcas.intersection(view.hcas):
                users.add(view.job_id)
    return users


def pci_removed(previous: Snapshot | None, snapshot: Snapshot) -> list[Finding]:
    gone = _gone_functions(snapshot)
    if not gone:
        return []
    gpu_slots = {_slot(g.bdf) for g in gone.values() if g.is_gpu}
    tops = [
        g
        for g in gone.values()
        if not any(
            other.bdf in g.device.chain[:-1] for other in gone.values() if g.device is not None
        )
    ]
    gpu_jobs = _gpu_jobs(previous, snapshot)
    # The jobs a function served are read from what the node still shows as it goes: the
    # disks' reads stop listing a removed drive's namespaces before the pci source reads the
    # tree again. A removal found critical stays critical, with the message that named its
    # jobs, for as long as it is found: the same event never reads as a lesser one later.
    critical_before = {
        f.subjects.get("bdf"): f
        for f in (previous.findings if previous is not None else ())
        if f.kind == REMOVED and f.severity is Severity.CRITICAL
    }
    findings = []
    for top in sorted(tops, key=lambda g: g.bdf):
        # A GPU and the other functions of its slot are gpu_fell_off_bus's.
        if top.is_gpu or _slot(top.bdf) in gpu_slots:
            continue
        below = sorted(_below(top, gone), key=lambda g: g.bdf)
        affected = [top, *below]
        gpus = [g for g in affected if g.is_gpu]
        nvmes = [g for g in affected if g.device and g.device.device_class is DeviceClass.NVME]
        hcas = {name for g in affected if g.device is not None for name in g.device.ib_devices}
        critical_jobs: set[str] = set()
        notes: list[str] = []
        for gpu in gpus:
            users = gpu_jobs.get(gpu.bdf, set())
            critical_jobs |= users
            if users:
                notes.append(f"GPU {gpu.bdf} of job {', '.join(sorted(users))}")
        for nvme in nvmes:
            users, disks = _nvme_jobs(previous, snapshot, nvme.bdf)
            critical_jobs |= users
            label = disks or nvme.bdf
            if users:
                notes.append(f"{label} with I/O from job {', '.join(sorted(users))}")
        hca_users = _hca_jobs(previous, snapshot, hcas) if hcas else set()
        if hca_users:
            notes.append(f"HCA {'/'.join(sorted(hcas))} of job {', '.join(sorted(hca_users))}")
        # What sat beside it: jobs on GPUs under the same switch lose what the function
        # gave them (local storage, the network) even without I/O that names them.
        beside: set[str] = set()
        anchor = _switch_above(snapshot, top)
        if anchor is not None:
            for bdf, users in gpu_jobs.items():
                gpu_chain = _chain_of(snapshot, bdf)
                if gpu_chain is not None and anchor in gpu_chain[:-1] and bdf not in gone:
                    beside |= users
        beside -= critical_jobs | hca_users
        used = critical_jobs | hca_users
        severity = Severity.CRITICAL if critical_jobs else Severity.WARNING
        earlier = critical_before.get(top.bdf)
        if severity is Severity.WARNING and earlier is not None:
            findings.append(
                Finding(REMOVED, Severity.CRITICAL, {"bdf": top.bdf}, earlier.evidence,
                        earlier.message)
            )  # fmt: skip
            continue
        text = f"PCI {top.describe()} left the bus"
        if below:
            text += f", with {len(below)} function(s) below it: " + "; ".join(
                g.describe() for g in below
            )
        if notes:
            text += "; used by " + "; ".join(notes)
        elif beside:
            text += f"; beside the GPUs of job {', '.join(sorted(beside))}"
        evidence = {
            "functions_below": float(len(below)),
            "gpus_removed": float(len(gpus)),
            "nvme_removed": float(len(nvmes)),
            "hcas_removed": float(len(hcas)),
            "jobs_affected": float(len(used)),
            "removal_events": float(sum(1 for g in affected if g.event is not None)),
        }
        findings.append(Finding(REMOVED, severity, {"bdf": top.bdf}, evidence, text))
    return findings


def _switch_above(snapshot: Snapshot, top: _Gone) -> str | None:
    """The switch (its upstream port) or root port the function hung from, in the read
    before it went."""
    pair = snapshot.pair(PCI)
    if pair is None or top.device is None or top.device.parent is None:
        return None
    before = pair[0]
    if before.get(top.device.parent) is None:
        return None
    return switch_of(before, top.device.parent)


def _chain_of(snapshot: Snapshot, bdf: str) -> tuple[str, ...] | None:
    pair = snapshot.pair(PCI)
    for topology in (pair[0] if pair else None, snapshot.latest(PCI)):
        device = topology.get(bdf) if topology is not None else None
        if device is not None:
            return device.chain
    return None


def flapping(snapshot: Snapshot, threshold: float) -> list[Finding]:
    data = snapshot.latest(LINK_EVENTS)
    if data is None:
        return []
    findings = []
    for link in data.links:
        if link.recent < threshold:
            continue
        what = "InfiniBand port" if link.kind == "infiniband" else "link"
        minutes = data.window_seconds / 60
        findings.append(
            Finding(
                FLAPPING,
                Severity.WARNING,
                {"interface": link.interface},
                {
                    VALUE: float(link.recent),
                    THRESHOLD: threshold,
                    "up_transitions_total": float(link.up_total),
                    "down_transitions_total": float(link.down_total),
                },
                f"{what} {link.interface} flapping: {link.recent} up/down transitions in the"
                f" last {minutes:g} min ({link.down_total} down, {link.up_total} up since start;"
                f" now {link.state})",
            )
        )
    return findings


def detect(
    previous: Snapshot | None, snapshot: Snapshot, settings: HotplugSettings
) -> list[Finding]:
    if not settings.enabled:
        return []
    threshold = settings.flap_transitions
    return (
        fell_off_bus(previous, snapshot)
        + pci_removed(previous, snapshot)
        + flapping(snapshot, threshold)
    )
