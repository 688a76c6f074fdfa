"""Contention on a shared PCIe link: devices of different classes filling one link together.

Input: the attribution of the snapshot's traffic over its topology
(:mod:`nodescope.model.attribution`). A shared link (root port, switch port or host bridge
with at least two data-moving functions below it) is *contended* when

* its busier direction carries at least ``[detectors.contention] utilisation_ratio`` of the
  link's capacity, and
* at least two endpoints of different classes (GPU, NVMe, NIC) each carry at least
  ``min_share`` of the link's traffic, both directions counted. Both directions, because a
  read in one direction costs the other direction its request TLPs and flow-control credits
  and the root complex serves both from one set of buffers: the seeds measured an A100 link
  saturating at 38 GB/s both ways together, far below twice its one-way capacity. A data
  loader that reads NVMe (upstream) while copying frames to a GPU (downstream) contends for
  the root port although the two streams cross it in opposite directions.

Traffic that a GPU and a NIC or NVMe drive below one switch move between each other
(GPUDirect RDMA and Storage: :mod:`nodescope.model.attribution`) turns inside the switch and
is not in the root port's demand; the message names it. Where ACS "P2P Request Redirect" on
a switch port sends such traffic (a GPU's with a NIC, a drive or another GPU below the same
switch) up through the root complex instead, the message says so, names the ports and the
pairs (``acs_redirect`` in the evidence): the setting, not the load, is why the link carries
it. A direction whose demand is over
``IMPOSSIBLE_UTILISATION`` of the link is no contention: no link carries more than it can, so
part of what its functions moved took another path (the attribution already takes a GPU's
and a NIC's matching traffic below an overloaded switch as peer to peer, GPUDirect RDMA
through DMA-BUF needing no module) or a counter is wrong.

"Sustained for N seconds" is not decided here: a detector has no memory. The finding holds in
every cycle whose interval meets the condition, and the alert engine fires it once it has held
for the ``for_seconds`` of ``[alerts.rules.pcie_contention]`` (default ``[alerts]
for_seconds``), no later than one cycle after that. The evidence carries ``value`` (the busier
direction's utilisation) and ``threshold`` for the engine's hysteresis (``clear_below``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from nodescope.alerts import AlertRule
from nodescope.config import ContentionSettings
from nodescope.detectors.common import (
    emit_floor,
    gb,
    jobs,
    jobs_of_gpus,
    tcp_evidence,
    tcp_text,
)
from nodescope.detectors.kinds import FindingKind, actions, severities
from nodescope.model.attribution import (
    IMPOSSIBLE_UTILISATION,
    Direction,
    DirectionLoad,
    EndpointFlow,
    LinkKind,
    LinkLoad,
    PeerFlow,
    PeerKind,
    acs_redirects,
)
from nodescope.model.finding import THRESHOLD, VALUE, Finding, Severity
from nodescope.model.snapshot import Snapshot
from nodescope.model.topology import PCI, DeviceClass, Topology, generation_of

KIND = "pcie_contention"
#: Its alert rule, declared here because :func:`detect` reports the keep band down to
#: ``clear_below``: a firing alert holds while the link stays at least half busy.
RULE = AlertRule(for_seconds=30.0, resolve_after_seconds=60.0, clear_below=0.5)

SPEC = FindingKind(
    KIND,
    severities(Severity.WARNING),
    actions(warning="alert"),
    meaning="endpoints of different classes (GPUs, NVMe, NICs) share a PCIe link that their"
    " traffic together saturates",
    signal="per-endpoint bytes under one shared link: GPUs from NVML fields 197/198 (or the"
    " 20 ms throughput call), NVMe from `/proc/diskstats`, NICs from InfiniBand"
    " `port_{xmit,rcv}_data`; the link's capacity from sysfs `current_link_{speed,width}`",
    hardware="yes — no root port or switch exposes its own byte counter, so a link's traffic"
    " is the sum of what its endpoints report",
    alert=RULE,
    contention=True,
)

_PEER_TEXT = {
    PeerKind.GPUDIRECT_RDMA: "GPUDirect RDMA",
    PeerKind.GPUDIRECT_STORAGE: "GPUDirect Storage",
}

_KIND_TEXT = {
    LinkKind.ROOT_PORT: "root port",
    LinkKind.SWITCH_PORT: "switch port",
    LinkKind.HOST_BRIDGE: "host bridge",
}

_VERB = {
    # what each class's bytes are, per direction (see nodescope.model.attribution)
    (DeviceClass.GPU, Direction.DOWNSTREAM): "H2D",
    (DeviceClass.GPU, Direction.UPSTREAM): "D2H",
    (DeviceClass.NVME, Direction.DOWNSTREAM): "writes",
    (DeviceClass.NVME, Direction.UPSTREAM): "reads",
    (DeviceClass.INFINIBAND, Direction.DOWNSTREAM): "transmit",
    (DeviceClass.INFINIBAND, Direction.UPSTREAM): "receive",
    (DeviceClass.ETHERNET, Direction.DOWNSTREAM): "transmit",
    (DeviceClass.ETHERNET, Direction.UPSTREAM): "receive",
}


def participants(link: LinkLoad, min_share: float) -> list[tuple[EndpointFlow, float]]:
    """Endpoints carrying at least ``min_share`` of the link's traffic (both directions),
    largest first, with their shares."""
    total = link.total_bytes_per_second
    if total <= 0:
        return []
    shares = [(f, f.total_bytes_per_second / total) for f in link.flows]
    chosen = [(f, s) for f, s in shares if s >= min_share]
    return sorted(chosen, key=lambda fs: (-fs[1], fs[0].name))


def link_text(link: LinkLoad) -> str:
    where = f"{_KIND_TEXT[link.kind]} {link.name}"
    parts = []
    if link.speed_gts is not None:
        gen = generation_of(link.speed_gts)
        parts.append(f"PCIe Gen{gen}" if gen is not None else f"{link.speed_gts:g} GT/s")
        if link.width is not None:
            parts[-1] += f" x{link.width}"
    if link.capacity_bytes_per_second is not None:
        parts.append(f"{gb(link.capacity_bytes_per_second)} per direction")
    return f"{where} ({', '.join(parts)})" if parts else where


def direction_text(
    load: DirectionLoad,
    min_share: float,
    jobs_by_bdf: dict[str, list[str]],
    named: frozenset[str] = frozenset(),
) -> str | None:
    """What one direction of a link carries, as parts that add up to its percentage: every
    endpoint with at least ``min_share`` of that direction's demand or among ``named`` (the
    contention's participants, by BDF), largest first, then the rest together. Only traffic in
    this direction counts toward its percentage: a NIC's receive is not part of the downstream
    figure. ``None`` when the direction is idle."""
    demand = load.demand_bytes_per_second
    if demand <= 0:
        return None
    parts: list[str] = []
    listed = 0.0
    for c in load.contributions:
        if c.bytes_per_second <= 0 or (c.share < min_share and c.bdf not in named):
            continue
        verb = _VERB.get((c.device_class, c.direction), c.direction.value)
        job = jobs_by_bdf.get(c.bdf)
        owner = f" (job {', '.join(job)})" if job else ""
        parts.append(f"{c.endpoint} {verb} {gb(c.bytes_per_second)}{owner} [{c.share:.0%}]")
        listed += c.bytes_per_second
    rest = demand - listed
    if rest > 0.005 * demand:
        parts.append(f"others {gb(rest)}")
    share = f"{load.utilisation:.0%}" if load.utilisation is not None else gb(demand)
    return f"{' + '.join(parts)} = {share} {load.direction.value}"


def peer_text(flows: tuple[PeerFlow, ...]) -> str:
    """What turned below the link, for the message; empty when nothing did."""
    if not flows:
        return ""
    parts = [
        f"{f.gpu_name}↔{f.peer_name} {gb(f.to_gpu_bytes_per_second)} to the GPU,"
        f" {gb(f.from_gpu_bytes_per_second)} from it ({_PEER_TEXT[f.kind]}: {f.basis})"
        for f in sorted(flows, key=lambda f: (-f.total_bytes_per_second, f.gpu, f.peer))
    ]
    return f"; peer to peer below it, not counted: {'; '.join(parts)}"


def acs_text(topology: Topology | None, chosen: list[tuple[EndpointFlow, float]]) -> str:
    """Why peer-to-peer traffic of the contending endpoints crosses the link, when ACS is the
    reason: the pairs below one switch whose requests its ports redirect to the root
    complex. Empty otherwise (no topology, no such pair)."""
    if topology is None:
        return ""
    names = {f.bdf: f.name for f, _s in chosen}
    redirects = acs_redirects(topology, names)
    if not redirects:
        return ""
    ports = sorted({p for r in redirects for p in r.ports})
    pairs = "; ".join(
        f"{names[r.first]}↔{names[r.second]} below switch port {r.turn}" for r in redirects[:4]
    )
    return (
        f"; ACS P2P Request Redirect is on at switch port{'s' if len(ports) > 1 else ''}"
        f" {', '.join(ports)}: the peer-to-peer traffic of {pairs} goes up through the root"
        " complex and back instead of turning in the switch, so this link carries it;"
        " action: clear ACS redirect on those ports (BIOS or setpci) where the platform's"
        " IOMMU policy allows"
    )


def evaluate(
    links: Iterable[LinkLoad],
    utilisation_ratio: float,
    min_share: float,
    floor: float | None = None,
    jobs_by_bdf: dict[str, list[str]] | None = None,
    extra_evidence: dict[str, float] | None = None,
    topology: Topology | None = None,
) -> list[Finding]:
    """Findings for every contended shared link. ``floor`` (default: the threshold) is the
    least utilisation reported; between it and the threshold a finding only keeps a firing
    alert firing."""
    lowest = utilisation_ratio if floor is None else min(floor, utilisation_ratio)
    owners = jobs_by_bdf or {}
    extra = extra_evidence or {}
    findings: list[Finding] = []
    for link in links:
        if not link.shared:
            continue
        busier = link.busier
        utilisation = busier.utilisation
        if utilisation is None or utilisation < lowest or utilisation > IMPOSSIBLE_UTILISATION:
            continue
        chosen = participants(link, min_share)
        classes = {f.device_class for f, _s in chosen}
        if len(classes) < 2:
            continue
        evidence: dict[str, float] = {
            VALUE: utilisation,
            THRESHOLD: utilisation_ratio,
            "min_share_ratio": min_share,
            "capacity_bytes_per_second": link.capacity_bytes_per_second or 0.0,
            "downstream_bytes_per_second": link.downstream.demand_bytes_per_second,
            "upstream_bytes_per_second": link.upstream.demand_bytes_per_second,
            "downstream_utilisation_ratio": link.downstream.utilisation or 0.0,
            "upstream_utilisation_ratio": link.upstream.utilisation or 0.0,
            "endpoints": float(len(chosen)),
            "peer_to_peer_bytes_per_second": sum(
                f.total_bytes_per_second for f in link.peer_to_peer
            ),
        }
        for flow, share in chosen:
            evidence[f"{flow.name}_downstream_bytes_per_second"] = flow.downstream_bytes_per_second
            evidence[f"{flow.name}_upstream_bytes_per_second"] = flow.upstream_bytes_per_second
            evidence[f"{flow.name}_share_ratio"] = share
        evidence.update(extra)
        # The busier direction first: it is the one held to the threshold.
        other = link.load(
            Direction.UPSTREAM if busier.direction is Direction.DOWNSTREAM else Direction.DOWNSTREAM
        )
        named = frozenset(f.bdf for f, _s in chosen)
        sides = [direction_text(d, min_share, owners, named) for d in (busier, other)]
        who = "; ".join(text for text in sides if text is not None)
        acs = acs_text(topology, chosen)
        if acs:
            evidence["acs_redirect"] = 1.0
        message = (
            f"contention on {link_text(link)}: {who} (threshold {utilisation_ratio:.0%})"
            f"{peer_text(link.peer_to_peer)}{acs}{tcp_text(extra)}"
        )
        findings.append(Finding(KIND, Severity.WARNING, {"link": link.name}, evidence, message))
    return findings


@dataclass(frozen=True, slots=True)
class ContentionInputs:
    """``[detectors.contention]`` and the least value that keeps this kind's firing alert
    firing (its rule's ``clear_below`` as configured; ``None``: none)."""

    settings: ContentionSettings
    keep_below: float | None


def detect(
    previous: Snapshot | None, snapshot: Snapshot, inputs: ContentionInputs
) -> list[Finding]:
    settings = inputs.settings
    if not settings.enabled:
        return []
    attribution = snapshot.derived.attribution
    if attribution is None:
        return []
    threshold = settings.utilisation_ratio
    return evaluate(
        attribution.shared_links,
        threshold,
        settings.min_share,
        floor=emit_floor(inputs.keep_below, threshold),
        jobs_by_bdf=jobs_of_gpus(jobs(snapshot)),
        extra_evidence=tcp_evidence(snapshot),
        topology=snapshot.latest(PCI),
    )
