"""The table of sources: name, module, default interval, what it reads; and what the sources
built together share.

Each module named here exposes ``make_source() -> Source`` whose ``name`` is the table's; a
source that shares an input with others takes it as an argument of ``make_source``
(:class:`SourceInputs`). The config file's ``[sources.<name>]`` sections are validated against
this table.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

from nodescope.model.collectives import SpoolSettings
from nodescope.model.job_records import DEFAULT_MAX_REGISTRATIONS, JobsData
from nodescope.model.link_events import LinkEventsOptions
from nodescope.model.netdev import NetdevOptions
from nodescope.sources.base import Source, TopologyGeneration

if TYPE_CHECKING:
    from nodescope.sources.cgroup import CycleWalk


def _cycle_walk() -> CycleWalk:
    # Imported here: the config validates against this table, and the CLI that reads a config
    # does not need the cgroup parsers.
    from nodescope.sources.cgroup import CycleWalk

    return CycleWalk()


class LatestJobs:
    """The ``jobs`` source's latest record, which the ``jobs`` source publishes after each
    run and the ``traces`` source reads (the uid each job's spool directory must have)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: JobsData | None = None

    def publish(self, data: JobsData) -> None:
        with self._lock:
            self._data = data

    def get(self) -> JobsData | None:
        with self._lock:
            return self._data


@dataclass(frozen=True)
class SourceInputs:
    """What the sources of one collector share, made once where they are built and handed to
    each source that needs it, so no source reaches into another:

    * ``topology``: the generation the ``udev`` source's monitor advances on a PCI device
      event and the ``pci`` source watches;
    * ``cgroup_walk``: one walk of the cgroup tree per cycle for the ``cgroups``, ``jobs``,
      ``procs`` and ``threads`` sources; the collector begins each cycle on it.
    * ``jobs``: the ``jobs`` source's latest record, for the ``traces`` source;
    * ``spool``: the ``traces`` source's settings (``[sources.traces]``), None when unset;
    * ``netdev`` and ``link_events``: how those sources read (``[sources.netdev]``,
      ``[sources.link_events]``);
    * ``max_registrations``: the prolog registrations the ``jobs`` source reads at most
      (``[slurm] max_registrations``).
    """

    topology: TopologyGeneration = field(default_factory=TopologyGeneration)
    cgroup_walk: CycleWalk = field(default_factory=_cycle_walk)
    jobs: LatestJobs = field(default_factory=LatestJobs)
    spool: SpoolSettings | None = None
    netdev: NetdevOptions = field(default_factory=NetdevOptions)
    link_events: LinkEventsOptions = field(default_factory=LinkEventsOptions)
    max_registrations: int = DEFAULT_MAX_REGISTRATIONS

    def begin_cycle(self, due: Iterable[str]) -> None:
        """A collection cycle starts in which the sources named ``due`` run."""
        self.cgroup_walk.begin_cycle(due)


#: How a module's ``make_source`` is called: with nothing, or with the inputs it shares.
Maker = Callable[[ModuleType, SourceInputs], Source]


def _alone(module: ModuleType, inputs: SourceInputs) -> Source:
    source: Source = module.make_source()
    return source


def _with_topology(module: ModuleType, inputs: SourceInputs) -> Source:
    source: Source = module.make_source(topology=inputs.topology)
    return source


def _with_cgroup_walk(module: ModuleType, inputs: SourceInputs) -> Source:
    source: Source = module.make_source(walk=inputs.cgroup_walk)
    return source


def _jobs_published(module: ModuleType, inputs: SourceInputs) -> Source:
    source: Source = module.make_source(
        walk=inputs.cgroup_walk,
        publish=inputs.jobs.publish,
        max_registrations=inputs.max_registrations,
    )
    return source


def _with_netdev_options(module: ModuleType, inputs: SourceInputs) -> Source:
    source: Source = module.make_source(inputs.netdev)
    return source


def _with_link_events_options(module: ModuleType, inputs: SourceInputs) -> Source:
    source: Source = module.make_source(inputs.link_events)
    return source


def _with_spool(module: ModuleType, inputs: SourceInputs) -> Source:
    source: Source = module.make_source(inputs.spool, inputs.jobs.get)
    return source


@dataclass(frozen=True, slots=True)
class SourceInfo:
    name: str
    module: str
    default_interval: float
    help: str
    maker: Maker = _alone
    #: Due also in any cycle in which ``SourceInputs.topology`` moved since its last run (a
    #: device event the ``udev`` source reported), not only at the end of its interval.
    due_on_topology_change: bool = False

    def make(self, inputs: SourceInputs | None = None) -> Source:
        """The source, sharing ``inputs`` with the others built with them (its own when not
        given: a source built alone)."""
        module = importlib.import_module(self.module)
        source = self.maker(module, SourceInputs() if inputs is None else inputs)
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
        _with_topology,
        # A function hot-removed is judged while what used it is still in the reads.
        due_on_topology_change=True,
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
        "network interface state and counters over rtnetlink",
        _with_netdev_options,
    ),
    SourceInfo(
        "cgroups",
        "nodescope.sources.cgroup",
        15.0,
        "cgroup v2 tree: memory, PSI, io.stat, cpu.stat, pids",
        _with_cgroup_walk,
    ),
    SourceInfo(
        "procs",
        "nodescope.sources.procs",
        15.0,
        "Slurm job processes (cgroup.procs) with NCCL_IB_HCA from their environ; TCP counters",
        _with_cgroup_walk,
    ),
    SourceInfo(
        "jobs",
        "nodescope.sources.jobs",
        15.0,
        "Slurm jobs: job cgroups (v2, SLUID, v1), their processes, threads and figures;"
        " prolog registrations",
        _jobs_published,
    ),
    SourceInfo(
        "nvml",
        "nodescope.sources.nvml",
        1.0,
        "GPUs through NVML: PCIe and NVLink counters, link state, Xids, processes, utilisation",
    ),
    SourceInfo(
        "sxid",
        "nodescope.sources.sxid",
        5.0,
        "NVSwitch SXids (nvidia-nvswitch errors) counted from the kernel log, /dev/kmsg",
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
        _with_cgroup_walk,
    ),
    SourceInfo(
        "threads",
        "nodescope.sources.threads",
        10.0,
        "job threads (task/*/stat) every run, all threads every 10th; wchan of D threads",
        _with_cgroup_walk,
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
        _with_topology,
    ),
    SourceInfo(
        "link_events",
        "nodescope.sources.link_events",
        1.0,
        "link up/down transitions from an rtnetlink monitor thread and IB port states; flaps",
        _with_link_events_options,
    ),
    SourceInfo(
        "remediation",
        "nodescope.sources.remediation",
        5.0,
        "drains, resumes and held drains nodescope recorded (<run>/nodescope/remediation.json)",
    ),
    # After ``jobs``: a cycle that runs both reads the jobs of this cycle.
    SourceInfo(
        "traces",
        "nodescope.sources.traces",
        15.0,
        "PyTorch traces jobs drop in <spool_dir>/<job id>/, analysed off the cycle: per-job"
        " collective skew, straggler rank and longest wait (runs only with spool_dir set)",
        _with_spool,
    ),
)

SOURCES: dict[str, SourceInfo] = {info.name: info for info in SOURCE_TABLE}
