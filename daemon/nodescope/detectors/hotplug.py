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

``link_flapping`` (warning), one per network interface or InfiniBand port whose up/down
transitions within the ``link_events`` source's window reach ``flap_transitions``; the
evidence ``value``/``threshold`` pair lets the alert engine hold it.
"""

from __future__ import annotations

from dataclasses import dataclass

from nodescope.config import Config
from nodescope.detectors.common import jobs
from nodescope.model.finding import THRESHOLD, VALUE, Finding, Severity
from nodescope.model.link_events import LINK_EVENTS
from nodescope.model.nvml import NVML
from nodescope.model.snapshot import Snapshot
from nodescope.model.udev import UDEV

FELL_OFF_BUS = "gpu_fell_off_bus"
FLAPPING = "link_flapping"
XID_FELL_OFF_BUS = 79


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


def detect(previous: Snapshot | None, snapshot: Snapshot, config: Config) -> list[Finding]:
    if not config.detectors.hotplug.enabled:
        return []
    threshold = config.detectors.hotplug.flap_transitions
    return fell_off_bus(previous, snapshot) + flapping(snapshot, threshold)
