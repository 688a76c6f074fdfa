"""The table of sources: name, module, default interval, what it reads.

Each module named here exposes ``make_source() -> Source`` whose ``name`` is the table's.
The config file's ``[sources.<name>]`` sections are validated against this table.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from nodescope.sources.base import Source


@dataclass(frozen=True, slots=True)
class SourceInfo:
    name: str
    module: str
    default_interval: float
    help: str

    def make(self) -> Source:
        module = importlib.import_module(self.module)
        source: Source = module.make_source()
        if source.name != self.name:
            raise RuntimeError(
                f"{self.module}.make_source() made {source.name!r}, not {self.name!r}"
            )
        return source


SOURCE_TABLE: tuple[SourceInfo, ...] = (
    SourceInfo(
        "pci",
        "nodescope.sources.pci",
        30.0,
        "PCIe tree, link speed/width, NUMA placement and AER counters from /sys/bus/pci",
    ),
    SourceInfo(
        "disks",
        "nodescope.sources.diskstats",
        1.0,
        "/proc/diskstats (iostat -dxm figures) and NVMe namespace to PCI mapping from /sys/block",
    ),
    SourceInfo(
        "infiniband",
        "nodescope.sources.infiniband",
        1.0,
        "InfiniBand/RoCE ports and counters from /sys/class/infiniband",
    ),
    SourceInfo(
        "netdev",
        "nodescope.sources.netlink",
        1.0,
        "network interface state and counters over rtnetlink (pyroute2)",
    ),
    SourceInfo(
        "cgroups",
        "nodescope.sources.cgroup",
        15.0,
        "cgroup v2 tree: memory, PSI, io.stat, cpu.stat, pids",
    ),
    SourceInfo(
        "procs",
        "nodescope.sources.procs",
        15.0,
        "Slurm job processes (cgroup.procs) with NCCL_IB_HCA from their environ; TCP counters",
    ),
    SourceInfo(
        "jobs",
        "nodescope.sources.jobs",
        15.0,
        "Slurm jobs: job cgroups (v2, SLUID, v1), their processes, threads and figures;"
        " prolog registrations",
    ),
    SourceInfo(
        "nvml",
        "nodescope.sources.nvml",
        1.0,
        "GPUs through NVML: PCIe and NVLink counters, link state, Xids, processes, utilisation",
    ),
    SourceInfo(
        "nvlink_kmod",
        "nodescope.sources.nvlink_kmod",
        1.0,
        "NVLink counters, per-link maxima and per-device burst histograms from the"
        " nvlink_counter module",
    ),
    SourceInfo(
        "probe",
        "nodescope.probe_runner",
        30.0,
        "the last bandwidth probe's report (nodescope probe --record, or one the daemon ran)"
        " from /run/nodescope/probe-report.json",
    ),
    SourceInfo(
        "locks",
        "nodescope.sources.locks",
        10.0,
        "/proc/locks; contended locks resolved to mount, path, holder and waiters",
    ),
    SourceInfo(
        "threads",
        "nodescope.sources.threads",
        10.0,
        "job threads (task/*/stat) every run, all threads every 10th; wchan of D threads",
    ),
    SourceInfo(
        "mountstats",
        "nodescope.sources.mountstats",
        10.0,
        "NFS per-op RPC statistics (ops, retransmissions, RTT, execute time) per mount",
    ),
    SourceInfo(
        "udev",
        "nodescope.sources.udev",
        1.0,
        "PCI/block/net device events (pyudev monitor thread) and removed GPUs; refreshes topology",
    ),
    SourceInfo(
        "link_events",
        "nodescope.sources.link_events",
        1.0,
        "link up/down transitions from an rtnetlink monitor thread and IB port states; flaps",
    ),
)

SOURCES: dict[str, SourceInfo] = {info.name: info for info in SOURCE_TABLE}
