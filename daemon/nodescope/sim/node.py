"""The simulated node: a scenario materialised as sysfs / procfs / cgroupfs trees under a
directory, with a fake NVML, advanced tick by tick.

The daemon's own sources read it through their real read paths (``Roots.under(root)``), so
every file here is written in the format the kernel uses and the sources parse:

* ``sys/``: the PCIe tree (:mod:`nodescope.sim.sysfs_tree`, from the scenario's lspci
  capture), ``current_link_{speed,width}`` as the timeline changes them; ``class/nvme`` and
  ``block/nvme*`` (``device`` -> controller -> PCI function, drivers/nvme/host/core.c);
  ``class/infiniband/<dev>/ports/<n>/{state,phys_state,rate,link_layer,counters/*,
  hw_counters/*}`` (drivers/infiniband/core/sysfs.c; data counters in 4-byte words; error
  counters stop at their width's maximum); ``aer_dev_{correctable,nonfatal,fatal}`` of the
  functions the timeline gives errors (drivers/pci/pcie/aer.c, the total kept as the sum);
  ``module/<name>/refcnt`` for the scenario's loaded kernel modules (kernel/module/sysfs.c);
* ``sys/fs/cgroup``: a pure cgroup v2 hierarchy (Documentation/admin-guide/cgroup-v2.rst) with
  systemd's slices and Slurm's cgroup/v2 job layout
  (``system.slice/slurmstepd.scope/job_<id>/step_<s>/{slurm,user/task_<n>}``,
  docs/datasources.md §5): ``cgroup.{controllers,subtree_control,type,events,procs,threads}``,
  ``memory.{current,peak,max,high,events,events.local,stat}``, ``cpu.stat``, ``io.stat``,
  ``pids.{current,max}``, ``{cpu,memory,io}.pressure`` (kernel/sched/psi.c; zero but where
  a ``pressure`` activity sets them), ``io.stat`` (block/blk-cgroup.c; empty but where a
  ``job_io`` activity charges I/O); a process that exits leaves its cgroup;
* ``proc/``: ``diskstats`` (block/genhd.c, 20 fields), ``uptime``, ``<pid>/{stat,comm,cmdline,
  wchan,cgroup,environ}`` and ``<pid>/task/<tid>/{stat,comm,wchan}`` (fs/proc/array.c, 52
  stat fields), ``locks`` (fs/locks.c), ``self`` -> the daemon's pid with ``mountstats``
  (fs/nfs/super.c, net/sunrpc/stats.c) and ``mounts``, ``net/snmp`` (net/ipv4/proc.c);
* the fake NVML (:class:`nodescope.sim.fake_nvml.FakeNvml`) whose counters and field
  timestamps follow simulated time, and whose GPUs' health (ECC and remap counters,
  temperatures, power, clocks and their event reasons, fabric registration, GPM) follows
  their load and the timeline's GPU health activities;
* ``dev/nvlink_stats``: the ``nvlink_counter`` module's snapshot, one read per tick (in wall
  time, one per read of the daemon's nvlink_kmod source), in the module's ABI
  (:mod:`nodescope.sim.kmod`: window statistics of 100 µs samples, bursts included), unless
  the scenario's node runs without the module (``hardware.os.nvlink_counter``);
* ``dev/kmsg``: the kernel log as ``/dev/kmsg`` hands it out, a regular file of records
  ``PRIO,SEQ,USEC,FLAGS;MESSAGE`` (Documentation/ABI/testing/dev-kmsg), empty at t = 0 and
  only ever appended to, as the kernel's ring buffer only grows to a reader: the
  ``nvidia-nvswitch`` driver's SXid lines of the timeline's ``sxid`` activities, or the same
  text written from user space (a record with a facility).

Counters advance by rate × overlap of each timeline activity with the interval moved over,
and time is a real number, not a count of ticks: :meth:`SimulatedNode.refresh` moves the node
to any second and brings up to date only the parts of the trees one reader reads, so a driver
in wall time (:mod:`nodescope.sim.live`) can refresh a counter just before each read and the
daemon reads the value of that moment, as from a real counter, and a rate read back over any
interval is the configured one. Only files whose content changed are written,
each through a temporary file in a staging directory beside the trees and a rename, so a
concurrent reader sees either the old or the new content, never a torn one, and never a
temporary name in a directory it lists.

The node is composed of parts, each writing the files of one area from the node's shared
state (its time, counter accumulators and file writer, :mod:`nodescope.sim.node_base`): the
PCIe tree and its AER counters (:mod:`~nodescope.sim.node_pci`), the GPUs behind the fake
NVML (:mod:`~nodescope.sim.node_gpus`), the disks and mounts
(:mod:`~nodescope.sim.node_disks`), the InfiniBand ports and IP counters
(:mod:`~nodescope.sim.node_network`), the processes, cgroups and ``proc/`` files
(:mod:`~nodescope.sim.node_processes`) and the kernel log
(:mod:`~nodescope.sim.node_kernel_log`). The timeline, what it plans and the moves through
time (counters integrated, events fired, states applied, parts written) stay here.
"""

from __future__ import annotations

import enum
import math
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pynvml

from nodescope.model.udev import UdevEvent
from nodescope.roots import Roots
from nodescope.sim.fake_nvml import FakeNvml, FakeProcess
from nodescope.sim.kmod import SimulatedModule
from nodescope.sim.lspci import LspciDevice, bridge_chains
from nodescope.sim.node_base import CLK_TCK, EPOCH, IB_PACKET_BYTES, NodeFiles, write_bytes
from nodescope.sim.node_disks import DEFAULT_REQUEST_BYTES, DisksPart
from nodescope.sim.node_gpus import GpusPart
from nodescope.sim.node_kernel_log import KernelLogPart
from nodescope.sim.node_network import NetworkPart
from nodescope.sim.node_pci import GENERATIONS, NO_LINK, PciPart
from nodescope.sim.node_processes import SLURM_SCOPE, CgroupDir, Proc, ProcessesPart
from nodescope.sim.scenario import (
    GPU_HEALTH_KINDS,
    INSTANT_KINDS,
    Activity,
    Hardware,
    Scenario,
)
from nodescope.sources.base import Source
from nodescope.sources.registry import SOURCE_TABLE, SourceInputs, simulated_specs
from nodescope.sources.spec import SIM_PARTS

#: NVLink raw throughput counts protocol overhead on top of the payload.
NVLINK_RAW_OVERHEAD = 1.0625


class Part(enum.Enum):
    """A part of the node that a move brings up to date."""

    #: ``current_link_{speed,width}`` of every PCIe function
    PCI_LINKS = "pci_links"
    #: the traffic counters of every InfiniBand port
    INFINIBAND = "infiniband"
    #: ``/proc/<pid>/{stat,wchan}`` and their threads' (CPU time, state)
    PROCESSES = "processes"
    #: ``cpu.stat`` and ``memory.events`` of every cgroup
    CGROUPS = "cgroups"
    #: ``/proc/{uptime,diskstats,locks,loadavg,net/snmp}`` and the daemon's ``mountstats``
    PROC_FILES = "proc_files"
    #: a read of ``/dev/nvlink_stats``: it ends the module's window (samples since the
    #: previous read), so only the module's reader may take one
    NVLINK_WINDOW = "nvlink_window"


#: Every file of the node, the module's window excepted: what a refresh for no particular
#: reader writes.
FILE_PARTS = frozenset(Part) - {Part.NVLINK_WINDOW}

#: What each of the daemon's sources reads of the node, as its spec declares it
#: (``SourceSpec.sim_parts``). A source not named here is given every file.
PARTS_READ_BY: Mapping[str, frozenset[Part]] = MappingProxyType(
    {
        spec.name: frozenset(Part(part) for part in spec.sim_parts)
        for spec in SOURCE_TABLE
        if spec.sim_parts is not None
    }
)
if {part.value for part in Part} != SIM_PARTS:
    raise RuntimeError("the simulated node's parts differ from nodescope.sources.spec.SIM_PARTS")

#: The sources the simulated node builds itself (:meth:`SimulatedNode.sources`), over its fake
#: NVML and without device or netlink monitors: those whose spec says ``sim_stand_in``.
STAND_INS = frozenset({"nvml", "udev", "link_events"})
if {spec.name for spec in SOURCE_TABLE if spec.sim_stand_in} != STAND_INS:
    raise RuntimeError("the simulated node's stand-ins differ from the specs' sim_stand_in")


def _own(path: Path, uid: int) -> None:
    """Give ``path`` to ``uid`` (as root); left as it is for a simulator run by another user."""
    if os.geteuid() == 0:
        os.chown(path, uid, uid, follow_symlinks=False)


def parts_read_by(reader: str | None) -> frozenset[Part]:
    """The parts a refresh for the source named ``reader`` writes (``None``: every file)."""
    if reader is None:
        return FILE_PARTS
    return PARTS_READ_BY.get(reader, FILE_PARTS)


def preferred_temp_dir() -> str | None:
    """A tmpfs to build simulated nodes on when there is one (``/dev/shm``): tens of
    thousands of small files are written, which a disk-backed /tmp can make slow."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


def make_temp_root(prefix: str = "nodescope-sim-") -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix, dir=preferred_temp_dir()))


# --------------------------------------------------------------------------------------------
# The node


class SimulatedNode:
    """A scenario's node under ``root``; see the module docstring for what it writes.

    ``roots`` are the filesystem roots to hand the daemon, ``nvml`` the fake NVML.
    :meth:`materialise` writes the trees as they are at t = 0; :meth:`advance_to` moves the
    node to simulated second ``t`` (never backwards).
    """

    def __init__(self, scenario: Scenario, root: str | os.PathLike[str]) -> None:
        self.scenario = scenario
        self.hardware: Hardware = scenario.hardware
        self.root = Path(root)
        self.roots = Roots.under(self.root)
        self.t = 0.0
        self._started = False
        self.files = NodeFiles(self.root)
        self._fired: set[int] = set()
        self.removed: set[str] = set()
        #: where the node's device events go (the udev sources of :meth:`sources`)
        self._uevent_sinks: list[Callable[[UdevEvent], None]] = []
        self.dump = self.hardware.pcie
        self.functions: dict[str, LspciDevice] = {d.bdf: d for d in self.dump.devices}
        self.dirs: dict[str, Path] = {}
        #: float accumulators of every counter, by key
        self.acc: dict[tuple[Any, ...], float] = {}
        self.procs: dict[int, Proc] = {}
        self.cgroups: dict[str, CgroupDir] = {}
        self.by_key: dict[str, list[Proc]] = {}
        self.daemon_pid = 0
        self.overridden: set[int] = set()
        self.dirty_pids: set[int] = set()
        self._links: dict[str, tuple[float | None, int | None]] = {}
        self._parent_of: dict[str, str] = {
            bdf: chain[-2] for bdf, chain in bridge_chains(self.dump).items() if len(chain) > 1
        }
        self.nvlink_stall_ratio: dict[tuple[int, int], float] = {}
        # The parts of the node, each writing the files of one area from the state above.
        self.pci = PciPart(self)
        self.disks = DisksPart(self)
        self.network = NetworkPart(self)
        self.kernel_log = KernelLogPart(self)
        self.processes = ProcessesPart(self)
        self.gpus = GpusPart(self)
        self.nvml = FakeNvml(self.gpus.fake_gpus(), clock_us=self._clock_us)
        #: Where the nvlink_counter module's snapshot (``/dev/nvlink_stats``) is written.
        self.nvlink_snapshot_path = self.roots.dev / "nvlink_stats"
        self.nvlink_module = SimulatedModule(self.hardware, scenario.timeline)
        #: The kernel log (``/dev/kmsg``).
        self.kmsg_path = self.roots.dev / "kmsg"
        #: The traces spool (``[sources.traces] spool_dir``) when the timeline drops traces:
        #: the daemon then runs its ``traces`` source on it, as one configured with it does.
        self.spool_dir: Path | None = (
            self.root / "spool" if any(a.kind == "trace" for a in scenario.timeline) else None
        )
        self.processes.build_processes()
        #: each GPU's processes as NVML lists them, fixed once the processes are built; the
        #: lists are handed out anew at every move (the churn appends to them)
        self.gpu_processes: dict[int, tuple[tuple[int, int | None], ...]] = {
            gpu.index: tuple(
                (p.pid, p.spec.gpu_memory_bytes)
                for p in self.procs.values()
                if p.gpu == gpu.index and p.spec is not None
            )
            for gpu in self.hardware.gpus
        }
        #: cgroups whose membership changed (a process exited): their files are written again
        self.dirty_cgroups: set[str] = set()
        self._plan_timeline()

    # ---- public -------------------------------------------------------------------------

    @property
    def writes(self) -> int:
        """Files written so far (materialise and ticks): tests use it to prove that a tick
        rewrites only what changed."""
        return self.files.writes

    def pid_of(self, key: str, replica: int = 0) -> int:
        """The pid of replica ``replica`` of the scenario's process ``key``."""
        return self.by_key[key][replica].pid

    def materialise(self) -> None:
        """Write every tree as it is at t = 0 (``root`` must be empty or absent)."""
        if self.root.exists() and any(self.root.iterdir()):
            raise FileExistsError(f"{self.root} is not empty")
        self.files.mkdir(self.files.staging)
        for path in (self.roots.sysfs, self.roots.procfs, self.roots.dev, self.roots.run):
            self.files.mkdir(path)
        self.files.atomic = False
        self.pci.write_pci()
        self.pci.write_modules()
        self.disks.write_block()
        self.network.write_infiniband()
        self.processes.write_cgroups(initial=True)
        self.processes.write_processes(initial=True)
        self.processes.write_proc_files()
        # Empty: the kernel log of a healthy node holds nothing the daemon counts.
        write_bytes(self.kmsg_path, b"")
        if self.spool_dir is not None:
            # Mode 1733, as the traces source's documentation asks of a spool: anyone makes
            # a directory, nobody lists it.
            self.spool_dir.mkdir()
            self.spool_dir.chmod(0o1733)
        self.files.atomic = True
        self.write_nvlink_snapshot()

    def advance_to(self, t: float) -> None:
        """One tick: move to simulated second ``t`` (counters advance by rate × time for every
        activity overlapping (previous t, t], events due by ``t`` happen), write every file
        that changed and take one read of the nvlink_counter module."""
        self.move_to(t, frozenset(Part))

    def refresh(self, t: float, reader: str | None = None) -> None:
        """Move to second ``t`` (any real number from the present on) and write what the
        daemon's source ``reader`` reads (:data:`PARTS_READ_BY`; ``None``: every file), so
        that source reads the values of ``t``. The other parts catch up at their own reader's
        refresh: counters are integrated over time, not over refreshes, so how often a part
        is written changes no value."""
        self.move_to(t, parts_read_by(reader))

    def move_to(self, t: float, parts: frozenset[Part]) -> None:
        """Move to second ``t`` and write ``parts``."""
        if not math.isfinite(t) or t < self.t:
            raise ValueError(f"cannot go from t={self.t:g} to t={t:g}")
        t0, self.t = self.t, t
        # Several readers of one cycle move to the same second: the state of that second was
        # made by the first of them; the others only have their parts written.
        if t > t0 or not self._started:
            self._integrate(t0, t)
            self._fire_events(t0, t)
            self._apply_states(t)
        self._render(parts)
        if Part.NVLINK_WINDOW in parts:
            self.write_nvlink_snapshot()
        self._started = True

    def sources(self, inputs: SourceInputs | None = None) -> list[Source]:
        """The daemon's sources for this node: the tree sources of the registry, the kernel
        log's (``sxid``), the NVML source over the fake NVML and the nvlink_counter
        snapshot's (no netlink: the simulated node has no network namespace).

        Each is built as the daemon builds it, with its production cadence: the registry's
        makers for the tree sources, and for the three that read what the node has no real
        device for (NVML, the udev and rtnetlink monitors) the same class with the same
        cadence defaults (``slow_every``, ``health_every``, ``gpm_every``) as the registry's
        ``make_source``; only what they read from is the node's, and NVML's Xid thread waits
        50 ms instead of 2 s so a replay closes at once (a wait returns at an event anyway).
        tests/unit/test_replay_cadence.py holds the two to the same cadences. ``inputs``:
        what the sources share (the cgroup walk of a cycle, the topology generation); hand
        the same to the collector that runs them.
        """
        from nodescope.sources.infiniband import InfinibandSource
        from nodescope.sources.link_events import LinkEventsSource
        from nodescope.sources.nvml import NvmlSource
        from nodescope.sources.udev import UdevSource

        inputs = SourceInputs() if inputs is None else inputs
        nvml = NvmlSource(self.nvml, event_wait_ms=50, wall_clock=self.wall_clock)
        # No device or netlink monitor: the node's devices change only in its trees.
        udev = UdevSource(monitor=None, topology=inputs.topology)
        # The node's device events reach it as the monitor thread's would.
        self._uevent_sinks.append(udev.receive)
        stand_ins: dict[str, Source] = {
            "nvml": nvml,
            "udev": udev,
            "link_events": LinkEventsSource(netlink=False),
        }
        sources: list[Source] = []
        for spec in simulated_specs():
            if spec.sim_stand_in:
                sources.append(stand_ins[spec.name])
            elif spec.name != "traces" or inputs.spool is not None:
                # ``traces`` runs configured with a spool (the node's, when its timeline
                # drops traces), as the daemon leaves it off without one.
                sources.append(spec.make(inputs))
        for source in sources:
            if isinstance(source, InfinibandSource):
                # Its slow counters' span is timed on the node's clock, as NVML's is: replay
                # and the soak run simulated time faster than real time.
                source.clock = self.wall_clock
        return sources

    def wall_clock(self) -> float:
        return EPOCH + self.t

    def write_nvlink_snapshot(self) -> None:
        """Write the ``nvlink_counter`` snapshot at the present ``t``: its window is the
        samples since the previous one (a node without NVLinks has no module loaded)."""
        if not self.nvlink_module.links or not self.hardware.os.nvlink_counter:
            return
        data = self.nvlink_module.snapshot(self.t, self.removed)
        self.files.write(self.nvlink_snapshot_path, data)

    # ---- construction -------------------------------------------------------------------

    def _clock_us(self) -> int:
        return round((EPOCH + self.t) * 1_000_000)

    def _plan_timeline(self) -> None:
        """What the timeline's error, pressure and I/O activities touch, found once, so a move
        looks only at those counters and files."""
        #: GPU links with NVLink error counters that move
        self._error_links: set[tuple[int, int]] = set()
        self._replay_gpus: set[int] = set()
        #: (NIC, port, counter) of the InfiniBand error counters that move, in counters/ and
        #: in hw_counters/
        self.ib_errors: set[tuple[str, int, str]] = set()
        self.ib_hw_errors: set[tuple[str, int, str]] = set()
        #: PCI functions whose AER counters move
        self.aer_functions: set[str] = set()
        #: cgroups with pressure, and with block I/O, from the timeline
        self.psi_paths: set[str] = set()
        self.io_paths: set[str] = set()
        self.psi_avg: dict[tuple[str, str], tuple[float, ...]] = {}
        #: the GPU health activities, in timeline order (a later one's value wins)
        self.health_activities: tuple[Activity, ...] = tuple(
            a for a in self.scenario.timeline if a.kind in GPU_HEALTH_KINDS
        )
        for activity in self.scenario.timeline:
            get = activity.get
            if activity.kind == "errors":
                gpu = get("gpu")
                if gpu is not None:
                    if get("nvlink"):
                        links = get("links") or range(self.hardware.gpus[gpu].nvlink_count)
                        self._error_links.update((gpu, link) for link in links)
                    if get("pcie_replays_per_second"):
                        self._replay_gpus.add(gpu)
                if get("ib") is not None:
                    self.ib_errors.update((get("ib"), get("port"), n) for n, _ in get("counters"))
                    self.ib_hw_errors.update(
                        (get("ib"), get("port"), n) for n, _ in get("hw_counters")
                    )
                if get("pci") is not None and get("aer"):
                    self.aer_functions.add(get("pci"))
            elif activity.kind == "pressure":
                self.psi_paths.update(self._charged_cgroups(activity, stop_at_job=True))
            elif activity.kind == "job_io":
                self.io_paths.update(self._charged_cgroups(activity, stop_at_job=False))

    def _charged_cgroups(self, activity: Activity, stop_at_job: bool) -> list[str]:
        """The cgroup an activity names (its job's, or its job's step's) and its ancestors that
        count what it does: up to the job's cgroup (pressure, as the activity states it for
        the job) or up to the root, which has no ``io.stat`` (block I/O, hierarchical)."""
        job = next(j for j in self.scenario.jobs if j.id == activity.get("job"))
        job_path = f"{SLURM_SCOPE}/job_{job.id}"
        path = job_path if activity.get("level") == "job" else f"{job_path}/step_{job.step}"
        paths = [path]
        stop = job_path if stop_at_job else ""
        while path != stop and "/" in path.strip("/"):
            path = path.rsplit("/", 1)[0]
            paths.append(path)
        return paths

    def active(self, kind: str, t: float) -> list[Activity]:
        """The timeline's activities of ``kind`` under way at second ``t``."""
        return [a for a in self.scenario.timeline if a.kind == kind and a.active_at(t)]

    # ---- time ---------------------------------------------------------------------------

    def add(self, key: tuple[Any, ...], amount: float) -> None:
        if amount:
            self.acc[key] = self.acc.get(key, 0.0) + amount

    def _integrate(self, t0: float, t1: float) -> None:
        if t1 <= t0:
            return
        for activity in self.scenario.timeline:
            seconds = activity.overlap(t0, t1)
            if seconds <= 0:
                continue
            get = activity.get
            kind = activity.kind
            if kind == "gpu_pcie":
                gpu = get("gpu")
                self.add(("gpu", gpu, "rx"), get("h2d_bytes_per_second") * seconds)
                self.add(("gpu", gpu, "tx"), get("d2h_bytes_per_second") * seconds)
            elif kind == "nvlink":
                gpu = self.hardware.gpus[get("gpu")]
                links = get("links") or range(gpu.nvlink_count)
                for link in links:
                    self.add(
                        ("nvlink", gpu.index, link, "tx"),
                        get("tx_bytes_per_second") * seconds / 1024,
                    )
                    self.add(
                        ("nvlink", gpu.index, link, "rx"),
                        get("rx_bytes_per_second") * seconds / 1024,
                    )
            elif kind == "disk":
                self.disks.integrate_disk(activity, seconds)
            elif kind == "ib":
                key = ("ib", get("device"), get("port"))
                for direction, field_name in (("tx", "xmit"), ("rx", "rcv")):
                    moved = get(f"{direction}_bytes_per_second") * seconds
                    self.add((*key, f"port_{field_name}_data"), moved / 4)
                    self.add((*key, f"port_{field_name}_packets"), moved / IB_PACKET_BYTES)
                    self.add((*key, f"unicast_{field_name}_packets"), moved / IB_PACKET_BYTES)
                self.add((*key, "port_xmit_wait"), get("xmit_wait_per_second") * seconds)
            elif kind == "nfs":
                key = ("nfs", get("mount"), get("op"))
                ops = get("ops_per_second") * seconds
                self.add((*key, "ops"), ops)
                self.add((*key, "ntrans"), ops)
                self.add((*key, "bytes_sent"), ops * get("bytes_per_op") / 2)
                self.add((*key, "bytes_recv"), ops * get("bytes_per_op") / 2)
                self.add((*key, "queue_ms"), ops * 0.01)
                self.add((*key, "rtt_ms"), ops * get("rtt_ms"))
                self.add((*key, "execute_ms"), ops * get("execute_ms"))
                self.add((*key, "errors"), get("errors_per_second") * seconds)
            elif kind == "memory_event":
                job = next(j for j in self.scenario.jobs if j.id == get("job"))
                path = f"{SLURM_SCOPE}/job_{job.id}"
                if get("level") == "step":
                    path = f"{path}/step_{job.step}"
                events = self.cgroups[path].events
                events[get("event")] = events.get(get("event"), 0.0) + get("per_second") * seconds
            elif kind == "tcp":
                self.add(("tcp", "out_segs"), get("out_segs_per_second") * seconds)
                self.add(("tcp", "retrans_segs"), get("retrans_segs_per_second") * seconds)
            elif kind == "errors":
                self._integrate_errors(activity, seconds)
            elif kind == "pressure":
                for path in self._charged_cgroups(activity, stop_at_job=True):
                    for psi in ("some", "full"):
                        # total: microseconds stalled, the 10 s average's share of the time
                        stalled = get(f"{psi}_avg10") / 100.0 * seconds * 1_000_000
                        self.add(("psi", path, get("resource"), psi), stalled)
            elif kind == "job_io":
                self._integrate_job_io(activity, seconds)
            elif kind == "gpu_peer":
                self._integrate_gpu_peer(activity, seconds)
        # CPU time of the job processes, at their current share (set by _apply_states).
        for proc in self.procs.values():
            for task in proc.tasks:
                if task.cpu_share:
                    task.utime += task.cpu_share * (t1 - t0) * CLK_TCK * 0.9
                    task.stime += task.cpu_share * (t1 - t0) * CLK_TCK * 0.1
                    self.dirty_pids.add(proc.pid)

    def _integrate_errors(self, activity: Activity, seconds: float) -> None:
        get = activity.get
        gpu = get("gpu")
        if gpu is not None:
            links = get("links") or range(self.hardware.gpus[gpu].nvlink_count)
            for name, rate in get("nvlink"):
                for link in links:
                    self.add(("nvlink_error", gpu, link, name), rate * seconds)
            self.add(("gpu", gpu, "replays"), get("pcie_replays_per_second") * seconds)
        if get("ib") is not None:
            for name, rate in get("counters"):
                self.add(("ib", get("ib"), get("port"), name), rate * seconds)
            for name, rate in get("hw_counters"):
                self.add(("ib_hw", get("ib"), get("port"), name), rate * seconds)
        if get("pci") is not None:
            for severity, errors in get("aer"):
                for name, rate in errors:
                    self.add(("aer", get("pci"), severity, name), rate * seconds)

    def _integrate_job_io(self, activity: Activity, seconds: float) -> None:
        get = activity.get
        disk = get("device")
        read_bytes, write_bytes = get("read_bytes_per_second"), get("write_bytes_per_second")
        r_iops, w_iops = get("read_iops"), get("write_iops")
        discard = get("discard_bytes_per_second")
        amounts = {
            "rbytes": read_bytes,
            "wbytes": write_bytes,
            "rios": read_bytes / DEFAULT_REQUEST_BYTES if r_iops is None else r_iops,
            "wios": write_bytes / DEFAULT_REQUEST_BYTES if w_iops is None else w_iops,
            "dbytes": discard,
            "dios": discard / DEFAULT_REQUEST_BYTES,
        }
        for path in self._charged_cgroups(activity, stop_at_job=False):
            for name, rate in amounts.items():
                self.add(("io", path, disk, name), rate * seconds)
        if get("in_diskstats"):
            self.disks.integrate_drive(disk, seconds, read_bytes, write_bytes, r_iops, w_iops)

    def _integrate_gpu_peer(self, activity: Activity, seconds: float) -> None:
        """GPUDirect: the bytes cross the GPU's PCIe link and the peer's, both counting them."""
        get = activity.get
        gpu, peer = get("gpu"), get("peer")
        to_rate, from_rate = get("to_gpu_bytes_per_second"), get("from_gpu_bytes_per_second")
        to_gpu, from_gpu = to_rate * seconds, from_rate * seconds
        self.add(("gpu", gpu, "rx"), to_gpu)
        self.add(("gpu", gpu, "tx"), from_gpu)
        if isinstance(peer, int):
            # CUDA peer to peer over PCIe: what one GPU sends the other receives.
            self.add(("gpu", peer, "rx"), from_gpu)
            self.add(("gpu", peer, "tx"), to_gpu)
            return
        if any(d.disk == peer for d in self.hardware.nvme):
            # GPUDirect Storage: the drive reads into the GPU and writes what comes from it.
            self.disks.integrate_drive(peer, seconds, to_rate, from_rate)
            return
        # GPUDirect RDMA: the HCA receives from the network into the GPU, sends from it.
        key = ("ib", peer, get("port"))
        for moved, field_name in ((from_gpu, "xmit"), (to_gpu, "rcv")):
            self.add((*key, f"port_{field_name}_data"), moved / 4)
            self.add((*key, f"port_{field_name}_packets"), moved / IB_PACKET_BYTES)
            self.add((*key, f"unicast_{field_name}_packets"), moved / IB_PACKET_BYTES)

    def _fire_events(self, t0: float, t1: float) -> None:
        for number, activity in enumerate(self.scenario.timeline):
            if activity.kind not in INSTANT_KINDS or number in self._fired:
                continue
            due = activity.start <= t1 and (activity.start > t0 or not self._started)
            if not due:
                continue
            self._fired.add(number)
            if activity.kind == "xid" and activity.get("forged"):
                gpu = self.hardware.gpus[activity.get("gpu")]
                line = self.kernel_log.xid_line(gpu.pci, activity.get("xid"))
                self.kernel_log.append_kmsg([line], activity.start, activity.get("forged_as"))
            elif activity.kind == "xid":
                gpu = self.hardware.gpus[activity.get("gpu")]
                xid = activity.get("xid")
                self.nvml.inject_xid(gpu.index, xid)
                # The driver reports it in the kernel log as well, where the source reads
                # it when NVML has no event set for the GPU.
                self.kernel_log.append_kmsg(
                    [self.kernel_log.xid_line(gpu.pci, xid)], activity.start
                )
                falls = activity.get("falls_off_bus")
                if falls if falls is not None else xid == 79:
                    self.pci.remove_function(gpu.pci)
                    self.nvml.gpus[gpu.index].lost = True
            elif activity.kind == "sxid":
                self.kernel_log.log_sxid(activity)
            elif activity.kind == "driver_rebind":
                self.pci.rebind_driver(activity.get("pci"))
            elif activity.kind == "process_exit":
                for proc in self.processes.refs(activity.get("process")):
                    self.processes.exit_process(proc)
                    if activity.get("signal") == "SIGSEGV":
                        self.kernel_log.log_segfault(proc, activity.start)
            elif activity.kind == "gpu_ecc":
                # Counted from the timeline at every move (_apply_gpu_health), as the other
                # GPU health counters are.
                continue
            elif activity.kind == "trace":
                self._drop_trace(activity)
            else:
                self.pci.remove_function(activity.get("pci"))

    def _drop_trace(self, activity: Activity) -> None:
        """The job writes a trace into ``<spool>/<job id>/<file>``: the directory and the file
        owned by the job's user (what the traces source accepts), the file complete when it
        appears (written beside it, then renamed). Owning them needs root; a simulator run
        by another user leaves them its own, and the traces source skips them as a real one
        would (``job_dir_wrong_owner``)."""
        assert self.spool_dir is not None
        job = next(j for j in self.scenario.jobs if j.id == activity.get("job"))
        directory = self.spool_dir / str(job.id)
        if not directory.exists():
            directory.mkdir(mode=0o700)
            _own(directory, job.uid)
        data = Path(activity.get("path")).read_bytes()
        staged = directory / f".{activity.get('file')}.part"
        staged.write_bytes(data)
        _own(staged, job.uid)
        os.replace(staged, directory / activity.get("file"))

    def _apply_states(self, t: float) -> None:
        """The instantaneous state at ``t``: utilisation, link state, process states."""
        util = {g.index: [0.0] * 5 for g in self.hardware.gpus}
        for activity in self.active("gpu_util", t):
            values = util[activity.get("gpu")]
            for i, name in enumerate(
                (
                    "gpu_percent",
                    "memory_percent",
                    "decoder_percent",
                    "encoder_percent",
                    "jpeg_percent",
                )
            ):
                values[i] = min(100.0, values[i] + activity.get(name))
        for gpu in self.hardware.gpus:
            fake = self.nvml.gpus[gpu.index]
            (
                fake.gpu_util,
                fake.memory_util,
                fake.decoder_util,
                fake.encoder_util,
                fake.jpeg_util,
            ) = (round(v) for v in util[gpu.index])
            fake.pcie_tx_bytes = int(self.acc[("gpu", gpu.index, "tx")])
            fake.pcie_rx_bytes = int(self.acc[("gpu", gpu.index, "rx")])
            if gpu.index in self._replay_gpus:
                fake.replay_counter = int(self.acc.get(("gpu", gpu.index, "replays"), 0.0))
            for n, link in enumerate(fake.links):
                if (gpu.index, n) in self._error_links:
                    link.errors = {
                        counter: int(self.acc.get(("nvlink_error", gpu.index, n, name), 0.0))
                        for name, counter in _NVLINK_ERROR_COUNTERS
                    }
                tx = self.acc.get(("nvlink", gpu.index, n, "tx"), 0.0)
                rx = self.acc.get(("nvlink", gpu.index, n, "rx"), 0.0)
                link.data_tx_kib, link.data_rx_kib = int(tx), int(rx)
                link.raw_tx_kib = int(tx * NVLINK_RAW_OVERHEAD)
                link.raw_rx_kib = int(rx * NVLINK_RAW_OVERHEAD)
            fake.processes = [
                FakeProcess(pid, memory) for pid, memory in self.gpu_processes[gpu.index]
            ]
            fake.fb_used_bytes = min(
                fake.fb_total_bytes,
                sum(memory or 0 for _, memory in self.gpu_processes[gpu.index]),
            )
        self.gpus.apply_gpu_health(t, util)
        if self.psi_paths:
            self.psi_avg = self._pressure_averages(t)
        self.nvlink_stall_ratio = {}
        for activity in self.active("nvlink", t):
            gpu = self.hardware.gpus[activity.get("gpu")]
            for number in activity.get("links") or range(gpu.nvlink_count):
                self.nvlink_stall_ratio[(gpu.index, number)] = activity.get("stall_ratio")

        links: dict[str, tuple[float | None, int | None]] = {}
        for dev in self.dump.devices:
            if dev.express_type is not None and dev.express_type not in NO_LINK:
                links[dev.bdf] = (dev.link_sta_speed_gts, dev.link_sta_width)
        parents = self._parent_of
        for activity in self.active("pcie_link", t):
            bdf = activity.get("pci")
            speed, width = links.get(bdf, (None, None))
            speed = activity.get("speed_gts") if activity.get("speed_gts") is not None else speed
            width = activity.get("width") if activity.get("width") is not None else width
            links[bdf] = (speed, width)
            parent = parents.get(bdf)
            if parent is not None and parent in links:
                # Both ends of a link report the same Link Status.
                links[parent] = (speed, width)
        self._links = links
        for gpu in self.hardware.gpus:
            speed, width = links.get(gpu.pci, (None, None))
            fake = self.nvml.gpus[gpu.index]
            fake.curr_gen = GENERATIONS.get(speed or 0.0, 0)
            fake.curr_width = width or 0

        changed: set[int] = set()
        overrides: dict[int, dict[int, tuple[str | None, str | None, float | None]]] = {}
        for activity in self.active("process", t):
            thread = activity.get("thread")
            for proc in self.processes.refs(activity.get("process")):
                for task in proc.tasks:
                    if thread is None or task.comm == thread:
                        overrides.setdefault(proc.pid, {})[task.tid] = (
                            activity.get("state"),
                            activity.get("wchan"),
                            activity.get("cpu_percent"),
                        )
        for pid in self.overridden | set(overrides):
            proc = self.procs[pid]
            spec = proc.spec
            for index, task in enumerate(proc.tasks):
                state = spec.state if spec else "S"
                wchan = spec.wchan if spec else "0"
                share = (proc.cpu_percent / 100.0) if index == 0 else 0.0
                o = overrides.get(pid, {}).get(task.tid)
                if o is not None:
                    state = o[0] or state
                    wchan = o[1] or wchan
                    if o[2] is not None:
                        share = o[2] / 100.0
                if (task.state, task.wchan) != (state, wchan):
                    task.state, task.wchan = state, wchan
                    changed.add(pid)
                task.cpu_share = share
        for proc in self.procs.values():
            if (
                proc.spec is not None
                and proc.pid not in overrides
                and proc.pid not in self.overridden
            ):
                proc.tasks[0].cpu_share = proc.cpu_percent / 100.0
        self.overridden = set(overrides)
        self.dirty_pids |= changed

    def _pressure_averages(self, t: float) -> dict[tuple[str, str], tuple[float, ...]]:
        """Each cgroup's PSI averages at ``t``: those of the pressure activities active then,
        added up to at most 100 %; an average not given is the 10 s one."""
        averages: dict[tuple[str, str], list[float]] = {}
        for activity in self.active("pressure", t):
            get = activity.get
            values = []
            for psi in ("some", "full"):
                avg10 = get(f"{psi}_avg10")
                for window in ("avg10", "avg60", "avg300"):
                    value = get(f"{psi}_{window}")
                    values.append(avg10 if value is None else value)
            for path in self._charged_cgroups(activity, stop_at_job=True):
                sums = averages.setdefault((path, get("resource")), [0.0] * 6)
                for i, value in enumerate(values):
                    sums[i] = min(100.0, sums[i] + value)
        return {key: tuple(values) for key, values in averages.items()}

    def _render(self, parts: frozenset[Part]) -> None:
        if Part.PCI_LINKS in parts:
            self.pci.write_pci_links(self._links)
            if self.aer_functions:
                self.pci.write_aer()
        if Part.INFINIBAND in parts:
            self.network.write_ib_counters()
        if Part.PROCESSES in parts:
            # Processes whose CPU time or state moved since they were last written: the set
            # grows over moves that do not write processes.
            for pid in sorted(self.dirty_pids):
                self.processes.write_process(self.procs[pid], initial=False)
            self.dirty_pids = set()
        if Part.CGROUPS in parts:
            self.processes.write_cgroups()
        if Part.PROC_FILES in parts:
            self.processes.write_proc_files()


#: ``nvmlDeviceGetNvLinkErrorCounter`` counters (``NVML_NVLINK_ERROR_DL_*``) by activity name.
_NVLINK_ERROR_COUNTERS = (
    ("replay", pynvml.NVML_NVLINK_ERROR_DL_REPLAY),
    ("recovery", pynvml.NVML_NVLINK_ERROR_DL_RECOVERY),
    ("crc_flit", pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT),
    ("crc_data", pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA),
)


__all__ = [
    "EPOCH",
    "FILE_PARTS",
    "PARTS_READ_BY",
    "Part",
    "SimulatedNode",
    "make_temp_root",
    "parts_read_by",
    "preferred_temp_dir",
]
