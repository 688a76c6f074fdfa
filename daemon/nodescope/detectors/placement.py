"""Jobs whose GPUs talk to the network through HCAs far from them.

Input: the job view (:mod:`nodescope.model.jobs`: a job's GPUs from its processes' NVML
compute contexts, its HCAs from ``NCCL_IB_HCA`` or all of them), the topology (each
function's host bridge and NUMA node, ``docs/datasources.md`` §2) and the RDMA devices'
PCI functions (§7).

For every GPU of a job the detector compares the nearest HCA the job may use with the
nearest HCA the node has: nearest is the same host bridge (root complex), then the same NUMA
node, then anything (the socket interconnect). A GPU whose best allowed HCA is on another
NUMA node while one on its own exists is a ``job_hca_placement`` warning: its inter-node
traffic crosses the socket interconnect twice. A GPU whose best allowed HCA is only on its
NUMA node while one shares its root complex is reported as info. A node without a nearer HCA
is no finding: the job could not do better.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from nodescope.config import PlacementSettings
from nodescope.detectors.common import jobs
from nodescope.detectors.kinds import FindingKind, actions, severities
from nodescope.model.finding import Finding, Severity
from nodescope.model.infiniband import INFINIBAND
from nodescope.model.jobs import JobView
from nodescope.model.snapshot import Snapshot
from nodescope.model.topology import PCI, Topology

KIND = "job_hca_placement"

SPEC = FindingKind(
    KIND,
    severities(Severity.WARNING, Severity.INFO),
    actions(warning="alert", info="none"),
    meaning="a job's GPUs use an InfiniBand HCA farther away than the nearest one (a warning"
    " across sockets)",
    signal="the job's `NCCL_IB_HCA`, the PCI tree's host bridges and NUMA nodes",
    hardware="yes",
)

#: Distance of a GPU to an HCA: same root complex, same NUMA node, across sockets.
SAME_ROOT, SAME_NUMA, REMOTE = 0, 1, 2
_DISTANCE_TEXT = {SAME_ROOT: "root complex", SAME_NUMA: "NUMA node", REMOTE: "socket"}


def distance(topology: Topology, gpu_bdf: str, hca_bdf: str) -> int | None:
    gpu, hca = topology.get(gpu_bdf), topology.get(hca_bdf)
    if gpu is None or hca is None:
        return None
    if gpu.root == hca.root:
        return SAME_ROOT
    if gpu.numa_node is not None and gpu.numa_node == hca.numa_node:
        return SAME_NUMA
    return REMOTE


def evaluate(
    views: Iterable[JobView], topology: Topology, hca_functions: Mapping[str, str]
) -> list[Finding]:
    """``hca_functions``: RDMA device name -> its PCI function."""
    findings: list[Finding] = []
    every = {name: bdf for name, bdf in hca_functions.items() if topology.get(bdf) is not None}
    for view in views:
        allowed = {n: b for n, b in every.items() if n in view.hcas}
        if not allowed:
            continue
        worse: list[tuple[int, str, int, int, str]] = []  # (gpu, bdf, got, best, nearest hca)
        for index, gpu_bdf in zip(view.gpus, view.gpu_bdfs, strict=True):
            got = _nearest(topology, gpu_bdf, allowed)
            best = _nearest(topology, gpu_bdf, every)
            if got is None or best is None or got[0] <= best[0]:
                continue
            worse.append((index, gpu_bdf, got[0], best[0], best[1]))
        if not worse:
            continue
        remote = [w for w in worse if w[2] == REMOTE]
        severity = Severity.WARNING if remote else Severity.INFO
        gpu_numa = sorted(
            {str(topology.device(b).numa_node) for b in view.gpu_bdfs if topology.get(b)}
        )
        hca_numa = sorted(
            {
                f"{n} (NUMA {topology.device(b).numa_node})"
                for n, b in allowed.items()
                if topology.get(b)
            }
        )
        gpus_text = ",".join(str(w[0]) for w in worse)
        beside = ", ".join(f"{w[4]} (GPU {w[0]})" for w in worse)
        crossing = "the socket interconnect" if remote else "another root complex"
        message = (
            f"job {view.job_id}: GPUs {gpus_text} (NUMA {', '.join(gpu_numa)}) use HCAs"
            f" {', '.join(hca_numa)} from {view.hca_source}: their network traffic crosses"
            f" {crossing}; nearer HCAs: {beside}"
        )
        evidence = {
            "gpus": float(len(view.gpus)),
            "hcas": float(len(allowed)),
            "gpus_across_numa": float(len(remote)),
            "gpus_across_root_complex": float(len(worse) - len(remote)),
        }
        findings.append(Finding(KIND, severity, {"job": view.job_id}, evidence, message))
    return findings


def _nearest(topology: Topology, gpu_bdf: str, hcas: Mapping[str, str]) -> tuple[int, str] | None:
    ranked = [
        (d, name)
        for name, bdf in hcas.items()
        if (d := distance(topology, gpu_bdf, bdf)) is not None
    ]
    return min(ranked) if ranked else None


def detect(
    previous: Snapshot | None, snapshot: Snapshot, settings: PlacementSettings
) -> list[Finding]:
    """The registry's form."""
    if not settings.enabled:
        return []
    topology = snapshot.latest(PCI)
    ib = snapshot.latest(INFINIBAND)
    if topology is None or ib is None:
        return []
    functions = {d.name: d.pci_address for d in ib.devices if d.pci_address is not None}
    views = jobs(snapshot)
    # The job view, the topology and the HCA functions stay the same between the 15 s jobs
    # and 30 s pci reads: so do the findings.
    return snapshot.derived.reuse(
        KIND, (views, topology), functions, lambda: evaluate(views, topology, functions)
    )
