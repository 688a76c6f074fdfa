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
"""

from __future__ import annotations

import enum
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pynvml

from nodescope.model.gpu_health import (
    CLOCK_EVENT_GPU_IDLE,
    FABRIC_HEALTH_DEGRADED_BW_FALSE,
    FABRIC_HEALTH_DEGRADED_BW_SHIFT,
    FABRIC_HEALTH_DEGRADED_BW_TRUE,
    FABRIC_HEALTH_DEGRADED_BW_WIDTH,
    FABRIC_STATE_COMPLETED,
    NVML_SUCCESS,
)
from nodescope.model.infiniband import ERROR_COUNTER_BITS
from nodescope.model.udev import UdevEvent
from nodescope.model.xid_catalog import load_catalog
from nodescope.roots import Roots
from nodescope.sim.fake_nvml import FakeGpu, FakeLink, FakeNvml, FakeProcess
from nodescope.sim.kmod import SimulatedModule
from nodescope.sim.lspci import ExpressType, LspciDevice, bridge_chains
from nodescope.sim.scenario import (
    FORGED_SEGFAULT,
    GPU_HEALTH_KINDS,
    INSTANT_KINDS,
    NFS4_OPS,
    Activity,
    Hardware,
    Job,
    Mount,
    ProcessSpec,
    Scenario,
    load_ib_capture_device,
)
from nodescope.sim.sysfs_tree import (
    AER_CORRECTABLE_NAMES,
    AER_TOTALS,
    AER_UNCORRECTABLE_NAMES,
    aer_text,
    cpus_of_sockets,
    materialise,
    speed_string,
)
from nodescope.sources.base import Source
from nodescope.sources.registry import SOURCE_TABLE, SourceInputs, simulated_specs
from nodescope.sources.spec import SIM_PARTS
from nodescope.sources.udev import event_from_properties

#: Unix time of simulated t = 0 (NVML field timestamps, process start times).
EPOCH = 1_750_000_000.0
CLK_TCK = 100
PAGE = 4096
SECTOR = 512
IB_PACKET_BYTES = 4096
#: NVLink raw throughput counts protocol overhead on top of the payload.
NVLINK_RAW_OVERHEAD = 1.0625
#: Request size assumed when a disk activity gives bytes but no IOPS.
DEFAULT_REQUEST_BYTES = 131072
#: Latencies of traffic a ``disk`` activity does not state (``job_io``, ``gpu_peer``): the
#: ``disk`` activity's defaults.
_DEFAULT_READ_MS = 0.1
_DEFAULT_WRITE_MS = 0.05
#: Controllers of the root cgroup of a typical systemd host.
ROOT_CONTROLLERS = "cpuset cpu io memory hugetlb pids rdma misc"
CHILD_CONTROLLERS = "cpuset cpu io memory pids"

_PF_KTHREAD = 0x00200000
_PF_USER = 0x00400100
_ZERO_PSI = "".join(
    f"{kind} avg10=0.00 avg60=0.00 avg300=0.00 total=0\n" for kind in ("some", "full")
)


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
# Writing


class _Files:
    """Writes files once per content: a cache of what each path holds, and atomic replaces."""

    def __init__(self, root: Path) -> None:
        self.staging = root / ".sim-staging"
        self.cache: dict[Path, bytes] = {}
        self.made: set[Path] = set()
        self.atomic = False
        self.writes = 0
        self._serial = 0

    def mkdir(self, path: Path) -> None:
        if path not in self.made:
            path.mkdir(parents=True, exist_ok=True)
            self.made.add(path)

    def write(self, path: Path, content: str | bytes) -> bool:
        data = content.encode() if isinstance(content, str) else content
        if self.cache.get(path) == data:
            return False
        self.mkdir(path.parent)
        if self.atomic:
            self._serial += 1
            tmp = self.staging / f"{self._serial}"
            _write_bytes(tmp, data)
            os.replace(tmp, path)
        else:
            _write_bytes(path, data)
        self.cache[path] = data
        self.writes += 1
        return True

    def assume(self, path: Path, content: str) -> None:
        """Record what another writer put at ``path``."""
        self.cache[path] = content.encode()

    def symlink(self, link: Path, target: Path) -> None:
        self.mkdir(link.parent)
        link.symlink_to(os.path.relpath(target, link.parent))

    def append(self, path: Path, data: bytes) -> None:
        """Append ``data`` in one write. A file that only grows is never replaced: a reader
        that keeps it open (the kernel log's) goes on reading the same file."""
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        self.writes += 1

    def remove_tree(self, path: Path) -> None:
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        prefix = f"{path}{os.sep}"
        for cached in [p for p in self.cache if p == path or str(p).startswith(prefix)]:
            del self.cache[cached]
        self.made = {p for p in self.made if p != path and not str(p).startswith(prefix)}


def _write_bytes(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------
# Processes and cgroups


@dataclass
class _Task:
    tid: int
    comm: str
    state: str
    wchan: str
    #: seconds of CPU per second of this thread
    cpu_share: float = 0.0
    utime: float = 0.0  # ticks
    stime: float = 0.0
    #: the cgroup the thread sits in when it is not its process's (``thread_cgroups``)
    cgroup: str | None = None


@dataclass
class _Proc:
    pid: int
    ppid: int
    comm: str
    cmdline: str
    cgroup: str
    environ: bytes
    tasks: list[_Task]
    rss_bytes: int
    kernel: bool = False
    job: Job | None = None
    spec: ProcessSpec | None = None
    replica: int = 0
    gpu: int | None = None
    starttime: int = 0
    cpu_percent: float = 0.0
    #: how many of its threads sit in another cgroup (``thread_cgroups``)
    placed: int = 0


@dataclass
class _Cgroup:
    path: str
    children: list[str] = field(default_factory=list)
    procs: list[int] = field(default_factory=list)
    memory_max: int | None = None
    events: dict[str, float] = field(default_factory=dict)
    #: threads placed here whose processes live in another cgroup, as (pid, tid)
    threads: list[tuple[int, int]] = field(default_factory=list)
    #: a threaded cgroup (``cgroup.type`` ``threaded``): it holds threads, never processes
    threaded: bool = False


#: systemd units of a GPU training node: (unit, comm, processes, threads per process)
_SERVICES: tuple[tuple[str, str, int, int], ...] = (
    ("systemd-journald.service", "systemd-journal", 1, 1),
    ("systemd-udevd.service", "systemd-udevd", 1, 1),
    ("systemd-logind.service", "systemd-logind", 1, 1),
    ("dbus.service", "dbus-daemon", 1, 1),
    ("ssh.service", "sshd", 1, 1),
    ("cron.service", "cron", 1, 1),
    ("rsyslog.service", "rsyslogd", 1, 4),
    ("chrony.service", "chronyd", 1, 1),
    ("munge.service", "munged", 1, 4),
    ("slurmd.service", "slurmd", 1, 3),
    ("nvidia-persistenced.service", "nvidia-persiste", 1, 1),
    ("nvidia-fabricmanager.service", "nv-fabricmanage", 1, 12),
    ("nvidia-dcgm.service", "nv-hostengine", 1, 24),
    ("containerd.service", "containerd", 1, 40),
    ("irqbalance.service", "irqbalance", 1, 2),
    ("lldpd.service", "lldpd", 2, 1),
    ("rpcbind.service", "rpcbind", 1, 1),
    ("rpc-gssd.service", "rpc.gssd", 1, 2),
    ("nfs-idmapd.service", "rpc.idmapd", 1, 1),
    ("node-exporter.service", "node_exporter", 1, 8),
    ("nodescope.service", "nodescope", 1, 3),
    ("opensm.service", "opensm", 1, 6),
    ("getty@tty1.service", "agetty", 1, 1),
    ("polkit.service", "polkitd", 1, 3),
    ("systemd-networkd.service", "systemd-network", 1, 1),
)
_KTHREAD_NAMES = (
    "kworker/{c}:0",
    "kworker/{c}:1H",
    "ksoftirqd/{c}",
    "migration/{c}",
    "cpuhp/{c}",
    "rcu_preempt",
    "kcompactd{n}",
    "nvme-wq",
    "ib-comp-wq",
    "irq/{i}-mlx5_comp{c}",
    "nv_queue",
    "kswapd{n}",
)
_SLURM_SCOPE = "/system.slice/slurmstepd.scope"


def _proc_stat(proc: _Proc, task: _Task | None, threads: int, utime: float, stime: float) -> str:
    """One ``/proc/<pid>/stat`` or ``task/<tid>/stat`` line: 52 fields (fs/proc/array.c
    ``do_task_stat``); the comm is in parentheses and may hold spaces."""
    pid = proc.pid if task is None else task.tid
    head = proc.tasks[0]
    state = head.state if task is None else task.state
    comm = proc.comm if task is None else task.comm
    rss_pages = proc.rss_bytes // PAGE
    flags = _PF_KTHREAD if proc.kernel else _PF_USER
    vsize = 0 if proc.kernel else proc.rss_bytes * 4 + 200 * 2**20
    processor = pid % 224
    fields: list[int | str] = [
        pid, f"({comm})", state, proc.ppid, proc.pid, proc.pid if proc.kernel else 1, 0, -1,
        flags, 1000 + proc.pid % 997, 0, proc.pid % 7, 0, int(utime), int(stime), 0, 0,
        20, 0, threads, 0, proc.starttime, vsize, rss_pages, 18446744073709551615,
        1 if not proc.kernel else 0, 1 if not proc.kernel else 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0, 0, 17, processor, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ]  # fmt: skip
    return " ".join(str(f) for f in fields) + "\n"


# --------------------------------------------------------------------------------------------
# The node


def _nvml_bus_id(bdf: str) -> str:
    domain, bus, devfn = bdf.split(":")
    device, _, function = devfn.partition(".")
    return f"{int(domain, 16):08X}:{int(bus, 16):02X}:{int(device, 16):02X}.{function}"


_GENERATIONS = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
#: Express functions without a link of their own (sysfs shows ``Unknown``/0 for them).
_NO_LINK = (ExpressType.RC_INTEGRATED_ENDPOINT, ExpressType.RC_EVENT_COLLECTOR)

#: A GPU at full utilisation when no ``gpu_temperature`` or ``gpu_power`` activity says
#: otherwise: an H100 SXM training flat out runs its die near 70 °C, its HBM a little cooler,
#: and draws most of its power limit without reaching it (no power-cap clock events). Between
#: idle (the fake GPU's resting values) and these, temperature and draw follow utilisation.
_LOADED_GPU_CELSIUS = 70
_LOADED_MEMORY_CELSIUS = 66
_LOADED_DRAW_SHARE_OF_LIMIT = 0.9
_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class _HealthyGpu:
    """A GPU's health values before the timeline touches it: what a value returns to when
    the activity that set it ends (counters start from these and only grow)."""

    temperature_gpu: int
    temperature_memory: int
    power_draw_mw: int
    power_limit_mw: int
    power_enforced_limit_mw: int
    power_default_limit_mw: int
    sm_clock_mhz: int
    memory_clock_mhz: int
    clock_event_reasons: int
    applications_sm_clock_mhz: int
    fabric_state: int
    fabric_status: int
    fabric_health_mask: int
    counters: tuple[tuple[str, int], ...]


#: The FakeGpu counters health activities add to (activity field -> fake GPU field, by kind).
_HEALTH_COUNTERS: Mapping[str, tuple[tuple[str, str], ...]] = {
    "gpu_ecc": (
        ("corrected", "ecc_volatile_corrected"),
        ("corrected", "ecc_aggregate_corrected"),
        ("uncorrected", "ecc_volatile_uncorrected"),
        ("uncorrected", "ecc_aggregate_uncorrected"),
    ),
    "gpu_row_remap": (
        ("correctable_rows", "remapped_rows_correctable"),
        ("uncorrectable_rows", "remapped_rows_uncorrectable"),
    ),
    "gpu_retired_pages": (
        ("single_bit", "retired_pages_single_bit"),
        ("double_bit", "retired_pages_double_bit"),
    ),
}
_COUNTER_FIELDS = tuple(
    sorted({fake_field for pairs in _HEALTH_COUNTERS.values() for _, fake_field in pairs})
)


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
        self._files = _Files(self.root)
        self._fired: set[int] = set()
        self._removed: set[str] = set()
        #: where the node's device events go (the udev sources of :meth:`sources`), and the
        #: kernel's event number of the last one
        self._uevent_sinks: list[Callable[[UdevEvent], None]] = []
        self._seqnum = 4000
        self._dump = self.hardware.pcie
        self._functions: dict[str, LspciDevice] = {d.bdf: d for d in self._dump.devices}
        self._dirs: dict[str, Path] = {}
        #: float accumulators of every counter, by key
        self._acc: dict[tuple[Any, ...], float] = {}
        self._procs: dict[int, _Proc] = {}
        self._cgroups: dict[str, _Cgroup] = {}
        self._by_key: dict[str, list[_Proc]] = {}
        self._daemon_pid = 0
        self._overridden: set[int] = set()
        self._dirty_pids: set[int] = set()
        self._links: dict[str, tuple[float | None, int | None]] = {}
        self._parent_of: dict[str, str] = {
            bdf: chain[-2] for bdf, chain in bridge_chains(self._dump).items() if len(chain) > 1
        }
        self.nvlink_stall_ratio: dict[tuple[int, int], float] = {}
        self.nvml = FakeNvml(self._fake_gpus(), clock_us=self._clock_us)
        #: Where the nvlink_counter module's snapshot (``/dev/nvlink_stats``) is written.
        self.nvlink_snapshot_path = self.roots.dev / "nvlink_stats"
        self.nvlink_module = SimulatedModule(self.hardware, scenario.timeline)
        #: The kernel log (``/dev/kmsg``) and the sequence number of its next record.
        self.kmsg_path = self.roots.dev / "kmsg"
        #: The traces spool (``[sources.traces] spool_dir``) when the timeline drops traces:
        #: the daemon then runs its ``traces`` source on it, as one configured with it does.
        self.spool_dir: Path | None = (
            self.root / "spool" if any(a.kind == "trace" for a in scenario.timeline) else None
        )
        self._kmsg_sequence = 0
        self._build_processes()
        #: each GPU's processes as NVML lists them, fixed once the processes are built; the
        #: lists are handed out anew at every move (the churn appends to them)
        self._gpu_processes: dict[int, tuple[tuple[int, int | None], ...]] = {
            gpu.index: tuple(
                (p.pid, p.spec.gpu_memory_bytes)
                for p in self._procs.values()
                if p.gpu == gpu.index and p.spec is not None
            )
            for gpu in self.hardware.gpus
        }
        #: (InfiniBand port, counter file) of every traffic counter, with its accumulator key
        self._ib_counter_files: list[tuple[str, tuple[Any, ...], Path]] = []
        #: cgroups whose membership changed (a process exited): their files are written again
        self._dirty_cgroups: set[str] = set()
        self._plan_timeline()

    # ---- public -------------------------------------------------------------------------

    @property
    def writes(self) -> int:
        """Files written so far (materialise and ticks): tests use it to prove that a tick
        rewrites only what changed."""
        return self._files.writes

    def pid_of(self, key: str, replica: int = 0) -> int:
        """The pid of replica ``replica`` of the scenario's process ``key``."""
        return self._by_key[key][replica].pid

    def materialise(self) -> None:
        """Write every tree as it is at t = 0 (``root`` must be empty or absent)."""
        if self.root.exists() and any(self.root.iterdir()):
            raise FileExistsError(f"{self.root} is not empty")
        self._files.mkdir(self._files.staging)
        for path in (self.roots.sysfs, self.roots.procfs, self.roots.dev, self.roots.run):
            self._files.mkdir(path)
        self._files.atomic = False
        self._write_pci()
        self._write_modules()
        self._write_block()
        self._write_infiniband()
        self._write_cgroups(initial=True)
        self._write_processes(initial=True)
        self._write_proc_files()
        # Empty: the kernel log of a healthy node holds nothing the daemon counts.
        _write_bytes(self.kmsg_path, b"")
        if self.spool_dir is not None:
            # Mode 1733, as the traces source's documentation asks of a spool: anyone makes
            # a directory, nobody lists it.
            self.spool_dir.mkdir()
            self.spool_dir.chmod(0o1733)
        self._files.atomic = True
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
        data = self.nvlink_module.snapshot(self.t, self._removed)
        self._files.write(self.nvlink_snapshot_path, data)

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
        self._ib_errors: set[tuple[str, int, str]] = set()
        self._ib_hw_errors: set[tuple[str, int, str]] = set()
        #: PCI functions whose AER counters move
        self._aer_functions: set[str] = set()
        #: cgroups with pressure, and with block I/O, from the timeline
        self._psi_paths: set[str] = set()
        self._io_paths: set[str] = set()
        self._psi_avg: dict[tuple[str, str], tuple[float, ...]] = {}
        #: the GPU health activities, in timeline order (a later one's value wins)
        self._health: tuple[Activity, ...] = tuple(
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
                    self._ib_errors.update((get("ib"), get("port"), n) for n, _ in get("counters"))
                    self._ib_hw_errors.update(
                        (get("ib"), get("port"), n) for n, _ in get("hw_counters")
                    )
                if get("pci") is not None and get("aer"):
                    self._aer_functions.add(get("pci"))
            elif activity.kind == "pressure":
                self._psi_paths.update(self._charged_cgroups(activity, stop_at_job=True))
            elif activity.kind == "job_io":
                self._io_paths.update(self._charged_cgroups(activity, stop_at_job=False))

    def _charged_cgroups(self, activity: Activity, stop_at_job: bool) -> list[str]:
        """The cgroup an activity names (its job's, or its job's step's) and its ancestors that
        count what it does: up to the job's cgroup (pressure, as the activity states it for
        the job) or up to the root, which has no ``io.stat`` (block I/O, hierarchical)."""
        job = next(j for j in self.scenario.jobs if j.id == activity.get("job"))
        job_path = f"{_SLURM_SCOPE}/job_{job.id}"
        path = job_path if activity.get("level") == "job" else f"{job_path}/step_{job.step}"
        paths = [path]
        stop = job_path if stop_at_job else ""
        while path != stop and "/" in path.strip("/"):
            path = path.rsplit("/", 1)[0]
            paths.append(path)
        return paths

    def _fake_gpus(self) -> list[FakeGpu]:
        gpus = []
        gpu_addresses = {g.pci for g in self.hardware.gpus}
        switches = set(self.hardware.nvswitches)
        uptime = self.hardware.os.uptime_seconds
        #: each GPU's health before the timeline touches it, by index
        self._healthy: list[_HealthyGpu] = []
        for gpu in self.hardware.gpus:
            dev = self._functions[gpu.pci]
            links = [
                FakeLink(
                    remote_pci_bus_id=_nvml_bus_id(peer),
                    remote_type=(
                        pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
                        if peer in gpu_addresses
                        else pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
                    ),
                )
                for peer in gpu.link_peers()
            ]
            fake = FakeGpu(
                uuid=gpu.uuid,
                name=gpu.name,
                pci_bus_id=_nvml_bus_id(gpu.pci),
                pci_device_id=((dev.device_id or 0) << 16) | (dev.vendor_id or 0x10DE),
                curr_gen=_GENERATIONS.get(dev.link_sta_speed_gts or 0.0, 0),
                curr_width=dev.link_sta_width or 0,
                max_gen=_GENERATIONS.get(dev.link_cap_speed_gts or 0.0, 0),
                max_width=dev.link_cap_width or 0,
                links=links,
                unsupported=set(gpu.nvml_unsupported),
            )
            # Counters since the driver loaded: a steady trickle over the uptime.
            self._acc[("gpu", gpu.index, "tx")] = uptime * 2.0e8
            self._acc[("gpu", gpu.index, "rx")] = uptime * 3.0e8
            fake.pcie_tx_bytes = int(self._acc[("gpu", gpu.index, "tx")])
            fake.pcie_rx_bytes = int(self._acc[("gpu", gpu.index, "rx")])
            fake.fb_total_bytes = gpu.memory_bytes
            if any(peer in switches for peer in gpu.link_peers()):
                # On an NVSwitch system the fabric manager has registered every GPU before
                # jobs run: state completed, status success, bandwidth not degraded.
                fake.fabric_state = FABRIC_STATE_COMPLETED
                fake.fabric_status = NVML_SUCCESS
                fake.fabric_health_mask = (
                    FABRIC_HEALTH_DEGRADED_BW_FALSE << FABRIC_HEALTH_DEGRADED_BW_SHIFT
                )
            self._healthy.append(
                _HealthyGpu(
                    temperature_gpu=fake.temperature_gpu,
                    temperature_memory=fake.temperature_memory,
                    power_draw_mw=fake.power_draw_mw,
                    power_limit_mw=fake.power_limit_mw,
                    power_enforced_limit_mw=fake.power_enforced_limit_mw,
                    power_default_limit_mw=fake.power_default_limit_mw,
                    sm_clock_mhz=fake.sm_clock_mhz,
                    memory_clock_mhz=fake.memory_clock_mhz,
                    clock_event_reasons=fake.clock_event_reasons,
                    applications_sm_clock_mhz=fake.applications_sm_clock_mhz,
                    fabric_state=fake.fabric_state,
                    fabric_status=fake.fabric_status,
                    fabric_health_mask=fake.fabric_health_mask,
                    counters=tuple((name, getattr(fake, name)) for name in _COUNTER_FIELDS),
                )
            )
            gpus.append(fake)
        return gpus

    def _build_processes(self) -> None:
        hw = self.hardware
        next_pid = 1
        boot_ticks = 0

        def cgroup(path: str) -> _Cgroup:
            found = self._cgroups.get(path)
            if found is None:
                found = _Cgroup(path)
                self._cgroups[path] = found
                if path != "/":
                    parent = path.rsplit("/", 1)[0] or "/"
                    cgroup(parent).children.append(path)
            return found

        cgroup("/")

        def add(
            comm: str,
            cg: str,
            *,
            threads: Sequence[tuple[str, int]] = (),
            kernel: bool = False,
            ppid: int = 1,
            cmdline: str | None = None,
            environ: Mapping[str, str] | None = None,
            rss: int = 12 * 2**20,
            state: str = "S",
            wchan: str = "do_epoll_wait",
        ) -> _Proc:
            nonlocal next_pid
            pid = next_pid
            next_pid += 1
            tasks = [_Task(pid, comm, state, wchan)]
            for name, n in threads:
                for _ in range(n):
                    tasks.append(_Task(next_pid, name, "S", "futex_wait_queue"))
                    next_pid += 1
            env = b"".join(f"{k}={v}\0".encode() for k, v in (environ or {}).items())
            proc = _Proc(
                pid=pid,
                ppid=ppid,
                comm=comm,
                cmdline="" if kernel else (cmdline or comm),
                cgroup=cg,
                environ=env,
                tasks=tasks,
                rss_bytes=0 if kernel else rss,
                kernel=kernel,
                starttime=boot_ticks + pid,
            )
            self._procs[pid] = proc
            cgroup(cg).procs.append(pid)
            return proc

        budget = hw.os.background_processes
        base_env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
        if budget > 0:
            add("systemd", "/init.scope", cmdline="/sbin/init", environ=base_env, rss=14 * 2**20)
        if budget > 1:
            add("kthreadd", "/", kernel=True, ppid=0, state="S", wchan="kthreadd")
        made = min(budget, 2)
        for unit, comm, count, nthreads in _SERVICES:
            for _ in range(count):
                if made >= budget:
                    break
                extra = [(comm, nthreads - 1)] if nthreads > 1 else []
                proc = add(comm, f"/system.slice/{unit}", threads=extra, environ=base_env)
                if unit == "nodescope.service":
                    self._daemon_pid = proc.pid
                made += 1
        sessions = 0
        while made < budget and sessions < 4:
            uid = 1001 + sessions
            scope = f"/user.slice/user-{uid}.slice/session-{sessions + 3}.scope"
            for comm in ("sshd", "bash", "tmux: server", "top"):
                if made >= budget:
                    break
                add(comm, scope, environ={**base_env, "USER": f"user{uid}"}, rss=6 * 2**20)
                made += 1
            sessions += 1
        cpus = hw.cpu.cpu_count
        i = 0
        while made < budget:
            pattern = _KTHREAD_NAMES[i % len(_KTHREAD_NAMES)]
            name = pattern.format(c=(i // len(_KTHREAD_NAMES)) % cpus, n=i % 2, i=100 + i)[:15]
            add(name, "/", kernel=True, ppid=2, state="I" if "kworker" in name else "S", wchan="0")
            made += 1
            i += 1

        for spec in hw.os.system_processes:
            procs = []
            for replica in range(spec.count):
                proc = add(
                    spec.comm,
                    spec.cgroup,
                    threads=spec.threads,
                    kernel=spec.kernel,
                    ppid=2 if spec.kernel else 1,
                    cmdline=spec.cmdline,
                    environ=None if spec.kernel else base_env,
                    rss=spec.rss_bytes or 0,
                    state=spec.state,
                    wchan=spec.wchan,
                )
                for task in proc.tasks:
                    task.state, task.wchan = spec.state, spec.wchan
                proc.spec, proc.replica = spec, replica
                proc.cpu_percent = spec.cpu_percent
                procs.append(proc)
            self._by_key[spec.key] = procs
        for job in self.scenario.jobs:
            next_pid = (next_pid // 1000 + 1) * 1000
            self._add_job(job, add, cgroup)
        for job in self.scenario.jobs:
            self._cgroups[f"{_SLURM_SCOPE}/job_{job.id}"].memory_max = job.memory_max_job
            self._cgroups[
                f"{_SLURM_SCOPE}/job_{job.id}/step_{job.step}"
            ].memory_max = job.memory_max_step
        if not self._daemon_pid:
            self._daemon_pid = (
                1 if self._procs else add("nodescope", "/system.slice/nodescope.service").pid
            )

    def _add_job(self, job: Job, add: Any, cgroup: Any) -> None:
        job_cg = f"{_SLURM_SCOPE}/job_{job.id}"
        if self.scenario.jobs and f"{_SLURM_SCOPE}/system" not in self._cgroups:
            add("slurmstepd", f"{_SLURM_SCOPE}/system", cmdline="slurmstepd: [infinity]")
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "USER": job.user,
            "HOME": f"/home/{job.user}",
            "SLURM_JOB_ID": str(job.id),
            "SLURM_JOB_USER": job.user,
            "SLURM_JOB_UID": str(job.uid),
        }
        if job.gpus:
            # Slurm sets the job's global GPU indices in the batch environment.
            env["SLURM_JOB_GPUS"] = ",".join(str(g) for g in job.gpus)
        for step in ("extern", "batch", job.step):
            add(
                "slurmstepd",
                f"{job_cg}/step_{step}/slurm",
                threads=[("slurmstepd", 4)],
                cmdline=f"slurmstepd: [{job.id}.{step}]",
                rss=24 * 2**20,
            )
        add(
            "sleep",
            f"{job_cg}/step_extern/user/task_special",
            cmdline="sleep 100000000",
            environ=env,
            rss=2**20,
            wchan="hrtimer_nanosleep",
        )
        add(
            "bash",
            f"{job_cg}/step_batch/user/task_0",
            cmdline=f"/bin/bash /var/spool/slurmd/job{job.id}/slurm_script",
            environ=env,
            rss=4 * 2**20,
            wchan="do_wait",
        )
        # Processes without their own rss share what the job's memory.current leaves.
        fixed = sum(p.count * p.rss_bytes for p in job.processes if p.rss_bytes is not None)
        weight = sum(p.count for p in job.processes if p.rss_bytes is None) or 1
        share = max(0, job.memory_current_bytes - fixed) // weight
        for spec in job.processes:
            procs: list[_Proc] = []
            for replica in range(spec.count):
                gpu = job.gpus[replica] if spec.gpu == -1 else spec.gpu
                if spec.cgroup == "task":
                    # Ranks have a task each; helpers share them round-robin.
                    cg = f"{job_cg}/step_{job.step}/user/task_{replica % max(1, len(job.gpus))}"
                elif spec.cgroup == "batch":
                    cg = f"{job_cg}/step_batch/user/task_0"
                elif spec.cgroup == "extern":
                    cg = f"{job_cg}/step_extern/user/task_special"
                else:
                    cg = spec.cgroup
                environ = {
                    **env,
                    "SLURM_STEP_ID": job.step,
                    "SLURM_PROCID": str(replica),
                    "SLURM_LOCALID": str(replica),
                }
                if gpu is not None:
                    environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
                elif job.gpus:
                    environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in job.gpus)
                if job.nics:
                    environ["NCCL_IB_HCA"] = ",".join(job.nics)
                environ.update(dict(spec.environ))
                proc = add(
                    spec.comm,
                    cg,
                    threads=spec.threads,
                    cmdline=spec.cmdline,
                    environ=environ,
                    rss=share if spec.rss_bytes is None else spec.rss_bytes,
                    state=spec.state,
                    wchan=spec.wchan,
                )
                for task in proc.tasks:
                    task.state, task.wchan = spec.state, spec.wchan
                self._place_threads(proc, spec, cgroup)
                proc.job, proc.spec, proc.replica, proc.gpu = job, spec, replica, gpu
                proc.cpu_percent = spec.cpu_percent
                procs.append(proc)
            self._by_key[spec.key] = procs
        cgroup(job_cg)

    def _place_threads(
        self, proc: _Proc, spec: ProcessSpec, cgroup: Callable[[str], _Cgroup]
    ) -> None:
        """Move the threads ``thread_cgroups`` names into their cgroup: a threaded cgroup,
        below the process's own for a relative path (its threaded subtree) or elsewhere for
        an absolute one, whose ``cgroup.threads`` lists them and not the process's."""
        placed = dict(spec.thread_cgroups)
        for task in proc.tasks[1:]:
            where = placed.get(task.comm)
            if where is None:
                continue
            path = where if where.startswith("/") else f"{proc.cgroup}/{where}"
            target = cgroup(path)
            target.threaded = True
            target.threads.append((proc.pid, task.tid))
            task.cgroup = path
            proc.placed += 1

    # ---- sysfs --------------------------------------------------------------------------

    def _write_pci(self) -> None:
        tree = materialise(
            self._dump,
            self.root,
            cpus_of_sockets(
                self.hardware.cpu.sockets,
                self.hardware.cpu.cores_per_socket,
                self.hardware.cpu.threads_per_core,
            ),
        )
        self._dirs = dict(tree.function_dirs)
        sysfs = self.roots.sysfs
        # The tree wrote each function's Link Status: remember it, so a tick rewrites only
        # the links the timeline changes.
        for dev in self._dump.devices:
            if dev.express_type is not None and dev.express_type not in _NO_LINK:
                directory = self._dirs[dev.bdf]
                self._files.assume(
                    directory / "current_link_speed", f"{speed_string(dev.link_sta_speed_gts)}\n"
                )
                self._files.assume(directory / "current_link_width", f"{dev.link_sta_width or 0}\n")
        # OS names are the scenario's: replace the tree's guesses (address order).
        for bdf, name in tree.nvme.items():
            (sysfs / "class" / "nvme" / name).unlink()
            shutil.rmtree(self._dirs[bdf] / "nvme")
        for bdf, name in tree.infiniband.items():
            (sysfs / "class" / "infiniband" / name).unlink()
            shutil.rmtree(self._dirs[bdf] / "infiniband")

    def _write_modules(self) -> None:
        """A directory per loaded module, as the kernel makes one when it loads a module; its
        ``refcnt``, the users holding it, is 0 as nothing here uses the modules."""
        for name in self.hardware.os.kernel_modules:
            self._files.write(self.roots.sysfs / "module" / name / "refcnt", "0\n")

    def _write_block(self) -> None:
        sysfs = self.roots.sysfs
        files = self._files
        for drive in self.hardware.nvme:
            function = self._dirs[drive.pci]
            ctrl = function / "nvme" / drive.controller
            disk = ctrl / drive.disk
            files.mkdir(disk)
            files.symlink(ctrl / "device", function)
            files.symlink(sysfs / "class" / "nvme" / drive.controller, ctrl)
            files.write(ctrl / "address", drive.pci)
            files.write(ctrl / "transport", "pcie\n")
            files.write(ctrl / "model", f"{drive.model}\n")
            files.write(ctrl / "state", "live\n")
            files.symlink(disk / "device", ctrl)
            files.write(disk / "dev", f"{drive.major}:{drive.minor}\n")
            files.write(disk / "size", f"{drive.size_bytes // SECTOR}\n")
            files.symlink(sysfs / "block" / drive.disk, disk)
            files.symlink(sysfs / "class" / "block" / drive.disk, disk)
            uptime = self.hardware.os.uptime_seconds
            # Since boot: a modest history, so the first rates are the timeline's, not boot's.
            for name, per_s in (
                ("reads_completed", 400.0),
                ("sectors_read", 400.0 * 256),
                ("read_ms", 400.0 * 0.1),
                ("writes_completed", 50.0),
                ("sectors_written", 50.0 * 64),
                ("write_ms", 50.0 * 0.05),
                ("io_ms", 45.0),
                ("weighted_io_ms", 42.5),
                ("flushes_completed", 1.0),
                ("flush_ms", 0.1),
            ):
                self._acc[("disk", drive.disk, name)] = per_s * uptime

    def _write_infiniband(self) -> None:
        sysfs = self.roots.sysfs
        files = self._files
        for nic in self.hardware.nics:
            function = self._dirs[nic.pci[0]]
            device = function / "infiniband" / nic.name
            files.mkdir(device)
            files.symlink(device / "device", function)
            files.symlink(sysfs / "class" / "infiniband" / nic.name, device)
            files.write(device / "node_guid", f"{nic.node_guid}\n")
            files.write(device / "hca_type", f"{nic.hca_type}\n")
            files.write(device / "fw_ver", f"{nic.fw_ver}\n")
            files.write(device / "board_id", f"{nic.board_id}\n")
            files.write(device / "node_type", "1: CA\n")
            capture = load_ib_capture_device(nic.capture) if nic.capture else None
            for port in range(1, nic.ports + 1):
                captured = (capture or {}).get("ports", {}).get(str(port), {})
                port_dir = device / "ports" / str(port)
                files.write(port_dir / "state", "4: ACTIVE\n")
                files.write(port_dir / "phys_state", "5: LinkUp\n")
                files.write(port_dir / "rate", f"{nic.rate}\n")
                files.write(port_dir / "link_layer", f"{nic.link_layer}\n")
                counters = captured.get("counters") or _default_ib_counters()
                hw_counters = captured.get("hw_counters") or _default_ib_hw_counters()
                for name, value in counters.items():
                    self._acc[("ib", nic.name, port, name)] = float(value)
                    files.write(port_dir / "counters" / name, f"{int(value)}\n")
                for name, value in hw_counters.items():
                    self._acc[("ib_hw", nic.name, port, name)] = float(value)
                    files.write(port_dir / "hw_counters" / name, f"{int(value)}\n")

    def _write_pci_links(self, links: Mapping[str, tuple[float | None, int | None]]) -> None:
        for bdf, (speed, width) in links.items():
            if bdf in self._removed or bdf not in self._dirs:
                continue
            directory = self._dirs[bdf]
            self._files.write(directory / "current_link_speed", f"{speed_string(speed)}\n")
            self._files.write(directory / "current_link_width", f"{width or 0}\n")

    def _uevent(
        self, action: str, subsystem: str, directory: Path, function: LspciDevice | None = None
    ) -> None:
        """A device event as the kernel sends it (``lib/kobject_uevent.c``; a PCI function's
        properties from ``drivers/pci/pci-driver.c`` ``pci_uevent``), to every udev source."""
        self._seqnum += 1
        properties = {
            "ACTION": action,
            "DEVPATH": "/" + directory.relative_to(self.roots.sysfs).as_posix(),
            "SUBSYSTEM": subsystem,
            "SEQNUM": str(self._seqnum),
        }
        if function is not None:
            if function.class_code is not None:
                properties["PCI_CLASS"] = f"{function.class_code:X}"
            if function.vendor_id is not None and function.device_id is not None:
                properties["PCI_ID"] = f"{function.vendor_id:04X}:{function.device_id:04X}"
            properties["PCI_SLOT_NAME"] = function.bdf
        event = event_from_properties(properties, "simulated uevent")
        for sink in self._uevent_sinks:
            sink(event)

    def _remove_function(self, bdf: str) -> None:
        """Hot-unplug: the function, its children and the class links into them vanish, and
        the kernel's events say so, deepest first: the block devices and interfaces drivers
        made of them, then each function's driver unbound and the function removed."""
        if bdf in self._removed or bdf not in self._dirs:
            return
        chains = bridge_chains(self._dump)
        gone = {b for b, chain in chains.items() if bdf in chain}
        sysfs = self.roots.sysfs
        for drive in self.hardware.nvme:
            if drive.pci in gone:
                ctrl = self._dirs[drive.pci] / "nvme" / drive.controller
                self._uevent("remove", "block", ctrl / drive.disk)
        for b in sorted(gone, key=lambda b: (-len(chains[b]), b)):
            directory = self._dirs[b]
            for net in (directory / "net").glob("*") if (directory / "net").is_dir() else ():
                self._uevent("remove", "net", directory / "net" / net.name)
            function = self._functions[b]
            if function.driver:
                self._uevent("unbind", "pci", directory, function)
            self._uevent("remove", "pci", directory, function)
        self._removed |= gone
        for drive in self.hardware.nvme:
            if drive.pci in gone:
                for link in (
                    sysfs / "block" / drive.disk,
                    sysfs / "class" / "block" / drive.disk,
                    sysfs / "class" / "nvme" / drive.controller,
                ):
                    self._files.remove_tree(link)
        for nic in self.hardware.nics:
            if nic.pci[0] in gone:
                self._files.remove_tree(sysfs / "class" / "infiniband" / nic.name)
        for b in gone:
            directory = self._dirs[b]
            for net in (directory / "net").glob("*") if (directory / "net").is_dir() else ():
                self._files.remove_tree(sysfs / "class" / "net" / net.name)
            self._files.remove_tree(sysfs / "bus" / "pci" / "devices" / b)
        self._files.remove_tree(self._dirs[bdf])
        for gpu in self.hardware.gpus:
            if gpu.pci in gone:
                self.nvml.gpus[gpu.index].lost = True

    def _rebind_driver(self, bdf: str) -> None:
        """The function's driver unbound and bound again (``echo BDF > .../unbind``, then
        ``bind``) between two reads: the events of both, the function never leaving the bus.
        What the driver made (a namespace's block device) goes and comes back with it, so the
        tree the next read sees is the one before."""
        if bdf in self._removed or bdf not in self._dirs:
            return
        function = self._functions[bdf]
        directory = self._dirs[bdf]
        disks = [
            directory / "nvme" / d.controller / d.disk for d in self.hardware.nvme if d.pci == bdf
        ]
        for disk in disks:
            self._uevent("remove", "block", disk)
        self._uevent("unbind", "pci", directory, function)
        self._uevent("bind", "pci", directory, function)
        for disk in disks:
            self._uevent("add", "block", disk)

    # ---- cgroups ------------------------------------------------------------------------

    def _subtree(self, path: str) -> Iterable[_Cgroup]:
        stack = [path]
        while stack:
            cg = self._cgroups[stack.pop()]
            yield cg
            stack.extend(cg.children)

    def _write_cgroups(self, initial: bool = False) -> None:
        files = self._files
        base = self.roots.cgroupfs
        dirty, self._dirty_cgroups = self._dirty_cgroups, set()
        # Totals over each subtree, children before parents.
        order = sorted(self._cgroups, key=lambda p: p.count("/") if p != "/" else 0, reverse=True)
        memory: dict[str, int] = {}
        usage: dict[str, float] = {}
        tasks: dict[str, int] = {}
        events: dict[str, dict[str, float]] = {}
        for path in order:
            cg = self._cgroups[path]
            procs = [self._procs[pid] for pid in cg.procs]
            memory[path] = sum(p.rss_bytes for p in procs) + sum(memory[c] for c in cg.children)
            usage[path] = sum(
                (t.utime + t.stime) * (1_000_000 / CLK_TCK) for p in procs for t in p.tasks
            ) + sum(usage[c] for c in cg.children)
            own_threads = sum(len(p.tasks) - p.placed for p in procs)
            placed = sum(1 for pid, _ in cg.threads if pid in self._procs) if cg.threads else 0
            tasks[path] = own_threads + placed + sum(tasks[c] for c in cg.children)
            merged = dict(cg.events)
            for child in cg.children:
                for key, value in events[child].items():
                    merged[key] = merged.get(key, 0.0) + value
            events[path] = merged
        for path, cg in self._cgroups.items():
            directory = base if path == "/" else base / path.lstrip("/")
            root = path == "/"
            used = int(usage[path])
            user = int(used * 0.9)
            cpu_stat = f"usage_usec {used}\nuser_usec {user}\nsystem_usec {used - user}\n"
            if not root:  # the cpu controller's throttling fields
                cpu_stat += "".join(f"{k} 0\n" for k in _CPU_THROTTLE_FIELDS)
            files.write(directory / "cpu.stat", cpu_stat)
            if not root:
                files.write(directory / "memory.events", _memory_events(events[path]))
                files.write(directory / "memory.events.local", _memory_events(cg.events))
            if path in self._psi_paths:
                for resource in ("cpu", "memory", "io"):
                    files.write(directory / f"{resource}.pressure", self._pressure(path, resource))
            if path in self._io_paths:
                files.write(directory / "io.stat", self._io_stat(path))
            if not initial and path not in dirty:
                continue
            procs = [self._procs[pid] for pid in cg.procs]
            if not cg.threaded:
                # A threaded cgroup refuses to list processes (EOPNOTSUPP): no file to read.
                files.write(directory / "cgroup.procs", "".join(f"{p.pid}\n" for p in procs))
            own = [t.tid for p in procs for t in p.tasks if not p.placed or t.cgroup is None]
            here = [tid for pid, tid in cg.threads if pid in self._procs]
            files.write(directory / "cgroup.threads", "".join(f"{tid}\n" for tid in own + here))
            files.write(
                directory / "cgroup.subtree_control",
                f"{CHILD_CONTROLLERS}\n" if cg.children else "\n",
            )
            files.write(
                directory / "cgroup.stat",
                f"nr_descendants {len(list(self._subtree(path))) - 1}\nnr_dying_descendants 0\n",
            )
            if initial:
                if path not in self._io_paths:
                    files.write(directory / "io.stat", "")
                if path not in self._psi_paths:
                    for kind in ("cpu", "memory", "io"):
                        files.write(directory / f"{kind}.pressure", _ZERO_PSI)
            if root:
                files.write(directory / "cgroup.controllers", f"{ROOT_CONTROLLERS}\n")
                files.write(directory / "memory.stat", _memory_stat(memory[path]))
                continue
            files.write(directory / "cgroup.controllers", f"{CHILD_CONTROLLERS}\n")
            files.write(directory / "cgroup.type", f"{self._cgroup_type(cg)}\n")
            files.write(
                directory / "cgroup.events", f"populated {1 if tasks[path] else 0}\nfrozen 0\n"
            )
            files.write(directory / "memory.current", f"{memory[path]}\n")
            files.write(directory / "memory.peak", f"{memory[path]}\n")
            files.write(directory / "memory.max", _limit(cg.memory_max))
            files.write(directory / "memory.high", "max\n")
            files.write(directory / "memory.stat", _memory_stat(memory[path]))
            files.write(directory / "pids.current", f"{tasks[path]}\n")
            files.write(directory / "pids.max", "max\n")

    def _cgroup_type(self, cg: _Cgroup) -> str:
        """``threaded`` for a cgroup of threads, ``domain threaded`` for the root of a
        threaded subtree (a process's cgroup with threaded cgroups below it), else
        ``domain`` (Documentation/admin-guide/cgroup-v2.rst, "Threads")."""
        if cg.threaded:
            return "threaded"
        if any(self._cgroups[c].threaded for c in cg.children):
            return "domain threaded"
        return "domain"

    def _pressure(self, path: str, resource: str) -> str:
        """``<resource>.pressure`` (kernel/sched/psi.c ``psi_show``): the share of time some or
        all of the cgroup's tasks stalled, averaged over 10, 60 and 300 s, and the total
        stall in microseconds."""
        averages = self._psi_avg.get((path, resource), (0.0,) * 6)
        lines = []
        for i, kind in enumerate(("some", "full")):
            avg10, avg60, avg300 = averages[3 * i : 3 * i + 3]
            total = int(self._acc.get(("psi", path, resource, kind), 0.0))
            lines.append(
                f"{kind} avg10={avg10:.2f} avg60={avg60:.2f} avg300={avg300:.2f} total={total}\n"
            )
        return "".join(lines)

    def _io_stat(self, path: str) -> str:
        """``io.stat`` (block/blk-cgroup.c ``blkcg_print_one_stat``): one line per device the
        cgroup's tasks did I/O on, bytes and requests since the cgroup was made."""
        lines = []
        for drive in self.hardware.nvme:
            values = [int(self._acc.get(("io", path, drive.disk, f), 0.0)) for f in _IO_FIELDS]
            if any(values):
                named = " ".join(f"{f}={v}" for f, v in zip(_IO_FIELDS, values, strict=True))
                lines.append(f"{drive.major}:{drive.minor} {named}\n")
        return "".join(lines)

    # ---- procfs -------------------------------------------------------------------------

    def _write_process(self, proc: _Proc, initial: bool) -> None:
        files = self._files
        directory = self.roots.procfs / str(proc.pid)
        threads = len(proc.tasks)
        utime = sum(t.utime for t in proc.tasks)
        stime = sum(t.stime for t in proc.tasks)
        files.write(directory / "stat", _proc_stat(proc, None, threads, utime, stime))
        files.write(directory / "wchan", proc.tasks[0].wchan)
        for task in proc.tasks:
            task_dir = directory / "task" / str(task.tid)
            files.write(task_dir / "stat", _proc_stat(proc, task, threads, task.utime, task.stime))
            files.write(task_dir / "wchan", task.wchan)
            if initial:
                files.write(task_dir / "comm", f"{task.comm}\n")
                if proc.job is not None:
                    # Where each thread of a job process sits (what the jobs source reads of
                    # a thread missing from the job's cgroup.threads).
                    files.write(task_dir / "cgroup", f"0::{task.cgroup or proc.cgroup}\n")
        if initial:
            files.write(directory / "comm", f"{proc.comm}\n")
            files.write(
                directory / "cmdline",
                b"" if proc.kernel else proc.cmdline.replace(" ", "\0").encode() + b"\0",
            )
            files.write(directory / "cgroup", f"0::{proc.cgroup}\n")
            files.write(directory / "environ", proc.environ)

    def _write_processes(self, initial: bool = False) -> None:
        for proc in self._procs.values():
            self._write_process(proc, initial)
        if initial:
            self._files.symlink(
                self.roots.procfs / "self", self.roots.procfs / str(self._daemon_pid)
            )
            self._files.symlink(self.roots.procfs / "mounts", self.roots.procfs / "self" / "mounts")

    def _write_proc_files(self) -> None:
        procfs = self.roots.procfs
        files = self._files
        uptime = self.hardware.os.uptime_seconds + self.t
        idle = uptime * self.hardware.cpu.cpu_count * 0.9
        files.write(procfs / "uptime", f"{uptime:.2f} {idle:.2f}\n")
        files.write(procfs / "diskstats", self._diskstats())
        files.write(procfs / "locks", self._locks())
        daemon = procfs / str(self._daemon_pid)
        files.write(daemon / "mountstats", self._mountstats())
        files.write(daemon / "mounts", self._mounts())
        files.write(daemon / "mountinfo", self._mountinfo())
        files.write(procfs / "net" / "snmp", self._snmp())
        load = sum(p.cpu_percent for p in self._procs.values()) / 100.0
        last_pid = max(self._procs, default=1)
        files.write(
            procfs / "loadavg",
            f"{load:.2f} {load:.2f} {load:.2f} 3/{len(self._procs)} {last_pid}\n",
        )

    def _diskstats(self) -> str:
        lines = [f"   7       {n} loop{n} 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n" for n in range(8)]
        fields = (
            "reads_completed", "reads_merged", "sectors_read", "read_ms", "writes_completed",
            "writes_merged", "sectors_written", "write_ms", "in_flight", "io_ms",
            "weighted_io_ms", "discards_completed", "discards_merged", "sectors_discarded",
            "discard_ms", "flushes_completed", "flush_ms",
        )  # fmt: skip
        for drive in self.hardware.nvme:
            if drive.pci in self._removed:
                continue
            values = []
            for name in fields:
                value = int(self._acc.get(("disk", drive.disk, name), 0.0))
                if name.endswith("_ms"):
                    value %= 1 << 32  # unsigned int in diskstats_show()
                values.append(str(value))
            lines.append(f" {drive.major:3d} {drive.minor:7d} {drive.disk} {' '.join(values)}\n")
        return "".join(lines)

    def _active(self, kind: str, t: float) -> list[Activity]:
        return [a for a in self.scenario.timeline if a.kind == kind and a.active_at(t)]

    def _locks(self) -> str:
        lines = [
            f"1: FLOCK  ADVISORY  WRITE {self._daemon_pid} 00:19:1042 0 EOF\n",
            "2: POSIX  ADVISORY  WRITE 1 00:19:1 0 EOF\n",
        ]
        number = 3
        for activity in self._active("lock", self.t):
            mount = self.hardware.mount(activity.get("mount"))
            device = f"{mount.major:02x}:{mount.minor:02x}:{activity.get('inode')}"
            lock_type = activity.get("type")
            holders = self._refs(activity.get("holder"))
            if not holders:
                continue
            lines.append(
                f"{number}: POSIX  ADVISORY  {lock_type} {holders[0].pid} {device} 0 EOF\n"
            )
            for ref in activity.get("waiters"):
                for waiter in self._refs(ref):
                    lines.append(
                        f"{number}: -> POSIX  ADVISORY  {lock_type} {waiter.pid} {device} 0 EOF\n"
                    )
            number += 1
        return "".join(lines)

    def _refs(self, ref: str) -> list[_Proc]:
        """The processes ``key`` or ``key#replica`` names that have not exited."""
        key, _, replica = ref.partition("#")
        procs = self._by_key.get(key, [])
        named = procs if not replica else [procs[int(replica)]]
        return [p for p in named if p.pid in self._procs]

    def _mounts(self) -> str:
        lines = [
            "sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0\n",
            "proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0\n",
            "/dev/md0 / ext4 rw,relatime 0 0\n",
            "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate 0 0\n",
        ]
        for mount in self.hardware.mounts:
            lines.append(
                f"{mount.device} {mount.mountpoint} {mount.fstype} {self._nfs_opts(mount)} 0 0\n"
            )
        return "".join(lines)

    def _mountinfo(self) -> str:
        """``/proc/self/mountinfo`` (Documentation/filesystems/proc.rst §3.5): the mounts
        with their superblock's device numbers, which /proc/locks names a file by."""
        lines = [
            "22 1 0:21 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw\n",
            "23 1 0:22 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw\n",
            "24 1 9:0 / / rw,relatime shared:1 - ext4 /dev/md0 rw\n",
            "25 22 0:25 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2"
            " cgroup2 rw,nsdelegate\n",
        ]
        for number, mount in enumerate(self.hardware.mounts, start=40):
            lines.append(
                f"{number} 24 {mount.major}:{mount.minor} / {mount.mountpoint} rw,relatime"
                f" shared:{number} - {mount.fstype} {mount.device} {self._nfs_opts(mount)}\n"
            )
        return "".join(lines)

    @staticmethod
    def _nfs_opts(mount: Mount) -> str:
        return (
            f"rw,relatime,vers={mount.version},rsize=1048576,wsize=1048576,namlen=255,hard,"
            f"proto=tcp,timeo=600,retrans=2,sec=sys,clientaddr=10.20.1.17,local_lock=none,"
            f"addr={mount.server_addr}"
        )

    def _mountstats(self) -> str:
        out = [
            "device sysfs mounted on /sys with fstype sysfs\n",
            "device proc mounted on /proc with fstype proc\n",
            "device /dev/md0 mounted on / with fstype ext4\n",
            "device cgroup2 mounted on /sys/fs/cgroup with fstype cgroup2\n",
        ]
        age = int(self.hardware.os.uptime_seconds + self.t)
        for mount in self.hardware.mounts:
            heading = (
                f"device {mount.device} mounted on {mount.mountpoint} with fstype {mount.fstype}"
            )
            if not mount.is_nfs:
                out.append(f"{heading}\n")
                continue
            ops = {
                op: [
                    int(self._acc.get(("nfs", mount.mountpoint, op, k), 0.0))
                    for k in _NFS_OP_FIELDS
                ]
                for op in NFS4_OPS
            }
            sends = sum(v[1] for v in ops.values())
            read_bytes = int(self._acc.get(("nfs", mount.mountpoint, "READ", "bytes_recv"), 0.0))
            write_bytes = int(self._acc.get(("nfs", mount.mountpoint, "WRITE", "bytes_sent"), 0.0))
            # include/linux/nfs_iostat.h: 27 event counters, NFSIOS_INODEREVALIDATE first,
            # NFSIOS_VFSLOCK the 17th.
            events = [0] * 27
            events[0] = ops["GETATTR"][0]
            events[16] = ops["LOCK"][0]
            pages = f"{read_bytes // PAGE} {write_bytes // PAGE}"
            out.append(
                f"{heading} statvers=1.1\n"
                f"\topts:\t{self._nfs_opts(mount)}\n"
                f"\tage:\t{age}\n"
                "\timpl_id:\tname='',domain='',date='0,0'\n"
                "\tcaps:\tcaps=0x3ffbffff,wtmult=512,dtsize=1048576,bsize=0,namlen=255\n"
                "\tnfsv4:\tbm0=0xfdffbfff,bm1=0x40fdbe3e,bm2=0x60803,acl=0x3,sessions,"
                "pnfs=not configured,lease_time=90,lease_expired=0\n"
                "\tsec:\tflavor=1,pseudoflavor=1\n"
                f"\tevents:\t{' '.join(str(e) for e in events)}\n"
                f"\tbytes:\t{read_bytes} {write_bytes} 0 0 {read_bytes} {write_bytes} {pages}\n"
                "\tRPC iostats version: 1.1  p/v: 100003/4 (nfs)\n"
                f"\txprt:\ttcp 718 1 1 0 0 {sends} {sends} 0 {sends} 0 64 0 0\n"
                "\tper-op statistics\n"
            )
            for op in NFS4_OPS:
                values = ops[op]
                out.append(f"\t{op:>12s}: {' '.join(str(v) for v in values)}\n")
            out.append("\n")
        return "".join(out)

    def _snmp(self) -> str:
        out_segs = int(self._acc.get(("tcp", "out_segs"), 0.0)) + 48_000_000
        retrans = int(self._acc.get(("tcp", "retrans_segs"), 0.0)) + 1_200
        in_segs = out_segs - 2_000_000
        packets_in, packets_out = in_segs + 90_000, out_segs + 80_000
        values = {
            "Ip": [1, 64, packets_in, 0, 0, 0, 0, 0, packets_in, packets_out]
            + [0] * 9
            + [packets_out],
            "Icmp": [40, 0, 0, 40] + [0] * 10 + [40, 0, 0, 0, 40] + [0] * 10,
            "Tcp": [
                1,
                200,
                120000,
                -1,
                3120,
                1850,
                12,
                40,
                42,
                in_segs,
                out_segs,
                retrans,
                0,
                310,
                0,
            ],
            "Udp": [90000, 12, 0, 80000, 0, 0, 0, 400, 0],
            "UdpLite": [0] * 9,
        }
        return "".join(
            f"{group}: {' '.join(_SNMP_FIELDS[group])}\n{group}: {' '.join(map(str, row))}\n"
            for group, row in values.items()
        )

    # ---- time ---------------------------------------------------------------------------

    def _add(self, key: tuple[Any, ...], amount: float) -> None:
        if amount:
            self._acc[key] = self._acc.get(key, 0.0) + amount

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
                self._add(("gpu", gpu, "rx"), get("h2d_bytes_per_second") * seconds)
                self._add(("gpu", gpu, "tx"), get("d2h_bytes_per_second") * seconds)
            elif kind == "nvlink":
                gpu = self.hardware.gpus[get("gpu")]
                links = get("links") or range(gpu.nvlink_count)
                for link in links:
                    self._add(
                        ("nvlink", gpu.index, link, "tx"),
                        get("tx_bytes_per_second") * seconds / 1024,
                    )
                    self._add(
                        ("nvlink", gpu.index, link, "rx"),
                        get("rx_bytes_per_second") * seconds / 1024,
                    )
            elif kind == "disk":
                self._integrate_disk(activity, seconds)
            elif kind == "ib":
                key = ("ib", get("device"), get("port"))
                for direction, field_name in (("tx", "xmit"), ("rx", "rcv")):
                    moved = get(f"{direction}_bytes_per_second") * seconds
                    self._add((*key, f"port_{field_name}_data"), moved / 4)
                    self._add((*key, f"port_{field_name}_packets"), moved / IB_PACKET_BYTES)
                    self._add((*key, f"unicast_{field_name}_packets"), moved / IB_PACKET_BYTES)
                self._add((*key, "port_xmit_wait"), get("xmit_wait_per_second") * seconds)
            elif kind == "nfs":
                key = ("nfs", get("mount"), get("op"))
                ops = get("ops_per_second") * seconds
                self._add((*key, "ops"), ops)
                self._add((*key, "ntrans"), ops)
                self._add((*key, "bytes_sent"), ops * get("bytes_per_op") / 2)
                self._add((*key, "bytes_recv"), ops * get("bytes_per_op") / 2)
                self._add((*key, "queue_ms"), ops * 0.01)
                self._add((*key, "rtt_ms"), ops * get("rtt_ms"))
                self._add((*key, "execute_ms"), ops * get("execute_ms"))
                self._add((*key, "errors"), get("errors_per_second") * seconds)
            elif kind == "memory_event":
                job = next(j for j in self.scenario.jobs if j.id == get("job"))
                path = f"{_SLURM_SCOPE}/job_{job.id}"
                if get("level") == "step":
                    path = f"{path}/step_{job.step}"
                events = self._cgroups[path].events
                events[get("event")] = events.get(get("event"), 0.0) + get("per_second") * seconds
            elif kind == "tcp":
                self._add(("tcp", "out_segs"), get("out_segs_per_second") * seconds)
                self._add(("tcp", "retrans_segs"), get("retrans_segs_per_second") * seconds)
            elif kind == "errors":
                self._integrate_errors(activity, seconds)
            elif kind == "pressure":
                for path in self._charged_cgroups(activity, stop_at_job=True):
                    for psi in ("some", "full"):
                        # total: microseconds stalled, the 10 s average's share of the time
                        stalled = get(f"{psi}_avg10") / 100.0 * seconds * 1_000_000
                        self._add(("psi", path, get("resource"), psi), stalled)
            elif kind == "job_io":
                self._integrate_job_io(activity, seconds)
            elif kind == "gpu_peer":
                self._integrate_gpu_peer(activity, seconds)
        # CPU time of the job processes, at their current share (set by _apply_states).
        for proc in self._procs.values():
            for task in proc.tasks:
                if task.cpu_share:
                    task.utime += task.cpu_share * (t1 - t0) * CLK_TCK * 0.9
                    task.stime += task.cpu_share * (t1 - t0) * CLK_TCK * 0.1
                    self._dirty_pids.add(proc.pid)

    def _integrate_disk(self, activity: Activity, seconds: float) -> None:
        get = activity.get
        self._integrate_drive(
            get("disk"),
            seconds,
            get("read_bytes_per_second"),
            get("write_bytes_per_second"),
            get("read_iops"),
            get("write_iops"),
            get("read_latency_ms"),
            get("write_latency_ms"),
        )

    def _integrate_drive(
        self,
        disk: str,
        seconds: float,
        read_bytes: float,
        write_bytes: float,
        r_iops: float | None = None,
        w_iops: float | None = None,
        r_lat: float = _DEFAULT_READ_MS,
        w_lat: float = _DEFAULT_WRITE_MS,
    ) -> None:
        """``/proc/diskstats`` of ``disk`` for ``seconds`` of this traffic."""
        r_iops = read_bytes / DEFAULT_REQUEST_BYTES if r_iops is None else r_iops
        w_iops = write_bytes / DEFAULT_REQUEST_BYTES if w_iops is None else w_iops
        queue = (r_iops * r_lat + w_iops * w_lat) / 1000.0  # requests in flight on average
        key = ("disk", disk)
        self._add((*key, "reads_completed"), r_iops * seconds)
        self._add((*key, "sectors_read"), read_bytes * seconds / SECTOR)
        self._add((*key, "read_ms"), r_iops * seconds * r_lat)
        self._add((*key, "writes_completed"), w_iops * seconds)
        self._add((*key, "sectors_written"), write_bytes * seconds / SECTOR)
        self._add((*key, "write_ms"), w_iops * seconds * w_lat)
        self._add((*key, "io_ms"), min(1.0, queue) * seconds * 1000)
        self._add((*key, "weighted_io_ms"), queue * seconds * 1000)

    def _integrate_errors(self, activity: Activity, seconds: float) -> None:
        get = activity.get
        gpu = get("gpu")
        if gpu is not None:
            links = get("links") or range(self.hardware.gpus[gpu].nvlink_count)
            for name, rate in get("nvlink"):
                for link in links:
                    self._add(("nvlink_error", gpu, link, name), rate * seconds)
            self._add(("gpu", gpu, "replays"), get("pcie_replays_per_second") * seconds)
        if get("ib") is not None:
            for name, rate in get("counters"):
                self._add(("ib", get("ib"), get("port"), name), rate * seconds)
            for name, rate in get("hw_counters"):
                self._add(("ib_hw", get("ib"), get("port"), name), rate * seconds)
        if get("pci") is not None:
            for severity, errors in get("aer"):
                for name, rate in errors:
                    self._add(("aer", get("pci"), severity, name), rate * seconds)

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
                self._add(("io", path, disk, name), rate * seconds)
        if get("in_diskstats"):
            self._integrate_drive(disk, seconds, read_bytes, write_bytes, r_iops, w_iops)

    def _integrate_gpu_peer(self, activity: Activity, seconds: float) -> None:
        """GPUDirect: the bytes cross the GPU's PCIe link and the peer's, both counting them."""
        get = activity.get
        gpu, peer = get("gpu"), get("peer")
        to_rate, from_rate = get("to_gpu_bytes_per_second"), get("from_gpu_bytes_per_second")
        to_gpu, from_gpu = to_rate * seconds, from_rate * seconds
        self._add(("gpu", gpu, "rx"), to_gpu)
        self._add(("gpu", gpu, "tx"), from_gpu)
        if isinstance(peer, int):
            # CUDA peer to peer over PCIe: what one GPU sends the other receives.
            self._add(("gpu", peer, "rx"), from_gpu)
            self._add(("gpu", peer, "tx"), to_gpu)
            return
        if any(d.disk == peer for d in self.hardware.nvme):
            # GPUDirect Storage: the drive reads into the GPU and writes what comes from it.
            self._integrate_drive(peer, seconds, to_rate, from_rate)
            return
        # GPUDirect RDMA: the HCA receives from the network into the GPU, sends from it.
        key = ("ib", peer, get("port"))
        for moved, field_name in ((from_gpu, "xmit"), (to_gpu, "rcv")):
            self._add((*key, f"port_{field_name}_data"), moved / 4)
            self._add((*key, f"port_{field_name}_packets"), moved / IB_PACKET_BYTES)
            self._add((*key, f"unicast_{field_name}_packets"), moved / IB_PACKET_BYTES)

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
                line = self._xid_line(gpu.pci, activity.get("xid"))
                self._append_kmsg([line], activity.start, activity.get("forged_as"))
            elif activity.kind == "xid":
                gpu = self.hardware.gpus[activity.get("gpu")]
                xid = activity.get("xid")
                self.nvml.inject_xid(gpu.index, xid)
                # The driver reports it in the kernel log as well, where the source reads
                # it when NVML has no event set for the GPU.
                self._append_kmsg([self._xid_line(gpu.pci, xid)], activity.start)
                falls = activity.get("falls_off_bus")
                if falls if falls is not None else xid == 79:
                    self._remove_function(gpu.pci)
                    self.nvml.gpus[gpu.index].lost = True
            elif activity.kind == "sxid":
                self._log_sxid(activity)
            elif activity.kind == "driver_rebind":
                self._rebind_driver(activity.get("pci"))
            elif activity.kind == "process_exit":
                for proc in self._refs(activity.get("process")):
                    self._exit_process(proc)
                    if activity.get("signal") == "SIGSEGV":
                        self._log_segfault(proc, activity.start)
            elif activity.kind == "gpu_ecc":
                # Counted from the timeline at every move (_apply_gpu_health), as the other
                # GPU health counters are.
                continue
            elif activity.kind == "trace":
                self._drop_trace(activity)
            else:
                self._remove_function(activity.get("pci"))

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

    def _log_sxid(self, activity: Activity) -> None:
        """Append an ``sxid`` activity's records to the kernel log: per SXid, the line of
        ``NVSWITCH_PRINT_SXID`` and the two lines of the driver's error-log entry
        (``_nvswitch_dump_error_entry``), as docs/sxid.md shows them."""
        index = activity.get("nvswitch")
        bdf = self.hardware.nvswitches[index]
        forged = activity.get("forged")
        if bdf in self._removed and not forged:
            return  # a switch off the bus raises no error
        fatal, link, code = activity.get("fatal"), activity.get("link"), activity.get("sxid")
        prefix = f"nvidia-nvswitch{index}: SXid (PCI:{bdf}): {code:05d}, "
        where = "" if link is None else f"Link {link:02d} "
        lines = (
            f"{'Fatal' if fatal else 'Non-fatal'}, {where}{activity.get('message')}",
            # The entry's severity (1 fatal, 0 non-fatal) and the port as its engine instance.
            f"Severity {1 if fatal else 0} Engine instance {link or 0:02d} Sub-engine instance 00",
            # The entry's raw words: nothing reads them.
            "Data {" + ", ".join(["0x00000000"] * 8) + "}",
        )
        forged_as = activity.get("forged_as") if forged else None
        # A crashing binary carries one line in its name: the SXid line alone.
        written = lines[:1] if forged_as == FORGED_SEGFAULT else lines
        for _ in range(activity.get("count")):
            self._append_kmsg([prefix + line for line in written], activity.start, forged_as)

    def _log_segfault(self, proc: _Proc, start: float) -> None:
        """The kernel's report of a process killed by a fault it did not handle
        (``show_signal_msg``, ``arch/x86/mm/fault.c``): facility 0, ``KERN_INFO``, the task's
        name (its first 15 characters) and pid first."""
        usec = round((self.hardware.os.uptime_seconds + start) * 1_000_000)
        text = (
            f"{proc.comm[:15]}[{proc.pid}]: segfault at 0 ip 00007f3a1c2b4d10 sp"
            f" 00007ffd5e1f2a40 error 4 in libc.so.6[7f3a1c200000+195000]"
            " likely on CPU 3 (core 3, socket 0)"
        )
        record = f"{0 * 8 + 6},{self._kmsg_sequence},{usec},-;{text}\n"
        self._kmsg_sequence += 1
        self._files.append(self.kmsg_path, record.encode())

    @staticmethod
    def _xid_line(pci: str, xid: int) -> str:
        """The GPU driver's Xid line (``kernel_rc.c``): the address without its function,
        then the code, the process (none for a fault of the GPU's own) and the meaning."""
        meaning = load_catalog().lookup(xid).name
        address = pci.rsplit(".", 1)[0]
        return f"NVRM: Xid (PCI:{address}): {xid}, pid='<unknown>', name=<unknown>, {meaning}"

    def _append_kmsg(self, lines: list[str], start: float, forged_as: str | None = None) -> None:
        """Append ``lines`` to the kernel log as records at ``start``: the driver's (facility
        0, ``KERN_ERR``), or with ``forged_as`` the same text as a user makes the kernel log
        it (:data:`FORGED_DEVKMSG`, :data:`FORGED_SEGFAULT`)."""
        usec = round((self.hardware.os.uptime_seconds + start) * 1_000_000)
        records = []
        for line in lines:
            if forged_as is None:
                # The drivers print at KERN_ERR (3) in the kernel's facility 0.
                prio, text = 0 * 8 + 3, line
            elif forged_as == FORGED_SEGFAULT:
                # The kernel's report of a crashing binary named after the line
                # (show_signal_msg, arch/x86/mm/fault.c): KERN_INFO, its comm (the name's
                # first 15 characters) first, the whole file name after "in".
                prio = 0 * 8 + 6
                text = (
                    f"{line[:15]}[{4242 + self._kmsg_sequence}]: segfault at 0 ip "
                    f"000055d0c0de1139 sp 00007ffd5e1f2a40 error 4 in {line}"
                    "[55d0c0de1000+1000] likely on CPU 3 (core 3, socket 0)"
                )
            else:
                # A write to /dev/kmsg from user space gets facility 1 (LOG_USER) and the
                # default level 4 (devkmsg_write, kernel/printk/printk.c).
                prio, text = 1 * 8 + 4, line
            records.append(f"{prio},{self._kmsg_sequence},{usec},-;{text}\n")
            self._kmsg_sequence += 1
        self._files.append(self.kmsg_path, "".join(records).encode())

    def _exit_process(self, proc: _Proc) -> None:
        """The process and its threads are gone: its ``/proc`` directory, its place in its
        cgroup (which no longer counts its memory and tasks) and its NVML compute process."""
        del self._procs[proc.pid]
        self._dirty_pids.discard(proc.pid)
        self._overridden.discard(proc.pid)
        cg = self._cgroups[proc.cgroup]
        cg.procs.remove(proc.pid)
        # Its cgroup and those its threads were placed in, with their ancestors.
        for path in {proc.cgroup, *(t.cgroup for t in proc.tasks if t.cgroup is not None)}:
            while True:
                self._dirty_cgroups.add(path)
                if path == "/":
                    break
                path = path.rsplit("/", 1)[0] or "/"
        self._files.remove_tree(self.roots.procfs / str(proc.pid))
        if proc.gpu is not None:
            self._gpu_processes[proc.gpu] = tuple(
                entry for entry in self._gpu_processes[proc.gpu] if entry[0] != proc.pid
            )

    def _apply_states(self, t: float) -> None:
        """The instantaneous state at ``t``: utilisation, link state, process states."""
        util = {g.index: [0.0] * 5 for g in self.hardware.gpus}
        for activity in self._active("gpu_util", t):
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
            fake.pcie_tx_bytes = int(self._acc[("gpu", gpu.index, "tx")])
            fake.pcie_rx_bytes = int(self._acc[("gpu", gpu.index, "rx")])
            if gpu.index in self._replay_gpus:
                fake.replay_counter = int(self._acc.get(("gpu", gpu.index, "replays"), 0.0))
            for n, link in enumerate(fake.links):
                if (gpu.index, n) in self._error_links:
                    link.errors = {
                        counter: int(self._acc.get(("nvlink_error", gpu.index, n, name), 0.0))
                        for name, counter in _NVLINK_ERROR_COUNTERS
                    }
                tx = self._acc.get(("nvlink", gpu.index, n, "tx"), 0.0)
                rx = self._acc.get(("nvlink", gpu.index, n, "rx"), 0.0)
                link.data_tx_kib, link.data_rx_kib = int(tx), int(rx)
                link.raw_tx_kib = int(tx * NVLINK_RAW_OVERHEAD)
                link.raw_rx_kib = int(rx * NVLINK_RAW_OVERHEAD)
            fake.processes = [
                FakeProcess(pid, memory) for pid, memory in self._gpu_processes[gpu.index]
            ]
            fake.fb_used_bytes = min(
                fake.fb_total_bytes,
                sum(memory or 0 for _, memory in self._gpu_processes[gpu.index]),
            )
        self._apply_gpu_health(t, util)
        if self._psi_paths:
            self._psi_avg = self._pressure_averages(t)
        self.nvlink_stall_ratio = {}
        for activity in self._active("nvlink", t):
            gpu = self.hardware.gpus[activity.get("gpu")]
            for number in activity.get("links") or range(gpu.nvlink_count):
                self.nvlink_stall_ratio[(gpu.index, number)] = activity.get("stall_ratio")

        links: dict[str, tuple[float | None, int | None]] = {}
        for dev in self._dump.devices:
            if dev.express_type is not None and dev.express_type not in _NO_LINK:
                links[dev.bdf] = (dev.link_sta_speed_gts, dev.link_sta_width)
        parents = self._parent_of
        for activity in self._active("pcie_link", t):
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
            fake.curr_gen = _GENERATIONS.get(speed or 0.0, 0)
            fake.curr_width = width or 0

        changed: set[int] = set()
        overrides: dict[int, dict[int, tuple[str | None, str | None, float | None]]] = {}
        for activity in self._active("process", t):
            thread = activity.get("thread")
            for proc in self._refs(activity.get("process")):
                for task in proc.tasks:
                    if thread is None or task.comm == thread:
                        overrides.setdefault(proc.pid, {})[task.tid] = (
                            activity.get("state"),
                            activity.get("wchan"),
                            activity.get("cpu_percent"),
                        )
        for pid in self._overridden | set(overrides):
            proc = self._procs[pid]
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
        for proc in self._procs.values():
            if (
                proc.spec is not None
                and proc.pid not in overrides
                and proc.pid not in self._overridden
            ):
                proc.tasks[0].cpu_share = proc.cpu_percent / 100.0
        self._overridden = set(overrides)
        self._dirty_pids |= changed

    def _apply_gpu_health(self, t: float, util: Mapping[int, Sequence[float]]) -> None:
        """Each GPU's health at ``t``: its resting values moved by its load (temperature and
        draw follow utilisation; a busy GPU is not idle), then what the GPU health
        activities active at ``t`` state, a later activity's value over an earlier one's
        (clock-event reasons of overlapping activities add up). Counters are the GPU's own
        plus every count of an activity that started by ``t``: they never go back."""
        counts: dict[int, dict[str, int]] = {}
        held: dict[int, dict[tuple[str, str], Any]] = {}
        for activity in self._health:
            if activity.start > t:
                continue
            get, kind = activity.get, activity.kind
            gpu_counts = counts.setdefault(get("gpu"), {})
            for name, fake_field in _HEALTH_COUNTERS.get(kind, ()):
                gpu_counts[fake_field] = gpu_counts.get(fake_field, 0) + get(name)
            if kind in INSTANT_KINDS or not activity.active_at(t):
                continue
            values = held.setdefault(get("gpu"), {})
            for name, value in activity.params:
                if name == "gpu" or value is None:
                    continue
                key = (kind, name)
                if kind == "gpu_clocks" and name == "reasons":
                    values[key] = values.get(key, 0) | value
                elif kind in ("gpu_row_remap", "gpu_retired_pages") and name in (
                    "pending",
                    "failed",
                ):
                    values[key] = values.get(key, False) or value
                else:
                    values[key] = value
        traffic = self._gpu_traffic(t)
        for gpu in self.hardware.gpus:
            fake = self.nvml.gpus[gpu.index]
            healthy = self._healthy[gpu.index]
            added = counts.get(gpu.index, {})
            for fake_field, base in healthy.counters:
                setattr(fake, fake_field, base + added.get(fake_field, 0))
            values = held.get(gpu.index, {})
            gpu_percent, memory_percent = util[gpu.index][0], util[gpu.index][1]
            load = gpu_percent / 100.0
            fake.remap_pending = values.get(("gpu_row_remap", "pending"), False)
            fake.remap_failed = values.get(("gpu_row_remap", "failed"), False)
            fake.retired_pages_pending = values.get(("gpu_retired_pages", "pending"), False)
            fake.temperature_gpu = values.get(
                ("gpu_temperature", "gpu_celsius"),
                round(
                    healthy.temperature_gpu + (_LOADED_GPU_CELSIUS - healthy.temperature_gpu) * load
                ),
            )
            fake.temperature_memory = values.get(
                ("gpu_temperature", "memory_celsius"),
                round(
                    healthy.temperature_memory
                    + (_LOADED_MEMORY_CELSIUS - healthy.temperature_memory) * load
                ),
            )
            default = values.get(("gpu_power", "default_limit_watts"))
            fake.power_default_limit_mw = (
                healthy.power_default_limit_mw if default is None else round(default * 1000)
            )
            limit = values.get(("gpu_power", "limit_watts"))
            fake.power_limit_mw = healthy.power_limit_mw if limit is None else round(limit * 1000)
            enforced = values.get(("gpu_power", "enforced_limit_watts"))
            fake.power_enforced_limit_mw = (
                min(healthy.power_enforced_limit_mw, fake.power_limit_mw)
                if enforced is None
                else round(enforced * 1000)
            )
            draw = values.get(("gpu_power", "draw_watts"))
            loaded_mw = fake.power_enforced_limit_mw * _LOADED_DRAW_SHARE_OF_LIMIT
            fake.power_draw_mw = (
                round(healthy.power_draw_mw + (loaded_mw - healthy.power_draw_mw) * load)
                if draw is None
                else round(draw * 1000)
            )
            fake.sm_clock_mhz = values.get(("gpu_clocks", "sm_mhz"), healthy.sm_clock_mhz)
            fake.applications_sm_clock_mhz = values.get(
                ("gpu_clocks", "applications_sm_mhz"), healthy.applications_sm_clock_mhz
            )
            fake.memory_clock_mhz = values.get(
                ("gpu_clocks", "memory_mhz"), healthy.memory_clock_mhz
            )
            # A GPU running kernels is not idle: NVML drops the idle reason.
            reasons = healthy.clock_event_reasons
            if gpu_percent > 0:
                reasons &= ~CLOCK_EVENT_GPU_IDLE
            fake.clock_event_reasons = values.get(("gpu_clocks", "reasons"), reasons)
            fake.fabric_state = values.get(("gpu_fabric", "state"), healthy.fabric_state)
            fake.fabric_status = values.get(("gpu_fabric", "status"), healthy.fabric_status)
            degraded = values.get(("gpu_fabric", "bandwidth_degraded"))
            fake.fabric_health_mask = (
                healthy.fabric_health_mask
                if degraded is None
                else _with_degraded_bandwidth(healthy.fabric_health_mask, degraded)
            )
            _apply_gpm(fake, gpu_percent, memory_percent, traffic[gpu.index], values)

    def _gpu_traffic(self, t: float) -> dict[int, list[float]]:
        """Each GPU's NVLink TX and RX and PCIe TX and RX bytes per second at ``t``, as the
        timeline's rates state them (a burst's average over its period), for GPM."""
        rates = {gpu.index: [0.0] * 4 for gpu in self.hardware.gpus}
        for activity in self.scenario.timeline:
            if not activity.active_at(t):
                continue
            get = activity.get
            if activity.kind == "nvlink":
                links = get("links") or range(self.hardware.gpus[get("gpu")].nvlink_count)
                burst = get("burst")
                duty = 1.0 if burst is None else burst.on_seconds / burst.period_seconds
                rates[get("gpu")][0] += get("tx_bytes_per_second") * len(links) * duty
                rates[get("gpu")][1] += get("rx_bytes_per_second") * len(links) * duty
            elif activity.kind == "gpu_pcie":
                rates[get("gpu")][2] += get("d2h_bytes_per_second")
                rates[get("gpu")][3] += get("h2d_bytes_per_second")
            elif activity.kind == "gpu_peer":
                rates[get("gpu")][2] += get("from_gpu_bytes_per_second")
                rates[get("gpu")][3] += get("to_gpu_bytes_per_second")
                if isinstance(get("peer"), int):
                    rates[get("peer")][2] += get("to_gpu_bytes_per_second")
                    rates[get("peer")][3] += get("from_gpu_bytes_per_second")
        return rates

    def _pressure_averages(self, t: float) -> dict[tuple[str, str], tuple[float, ...]]:
        """Each cgroup's PSI averages at ``t``: those of the pressure activities active then,
        added up to at most 100 %; an average not given is the 10 s one."""
        averages: dict[tuple[str, str], list[float]] = {}
        for activity in self._active("pressure", t):
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

    def _write_aer(self) -> None:
        """The AER counters of the functions the timeline gives errors, totals kept equal to
        the sum of the named counters as the kernel keeps them."""
        for bdf in sorted(self._aer_functions):
            if bdf in self._removed:
                continue
            for severity in AER_TOTALS:
                names = (
                    AER_CORRECTABLE_NAMES if severity == "correctable" else AER_UNCORRECTABLE_NAMES
                )
                counts = {n: int(self._acc.get(("aer", bdf, severity, n), 0.0)) for n in names}
                self._files.write(
                    self._dirs[bdf] / f"aer_dev_{severity}", aer_text(severity, counts)
                )

    def _render(self, parts: frozenset[Part]) -> None:
        if Part.PCI_LINKS in parts:
            self._write_pci_links(self._links)
            if self._aer_functions:
                self._write_aer()
        if Part.INFINIBAND in parts:
            self._write_ib_counters()
        if Part.PROCESSES in parts:
            # Processes whose CPU time or state moved since they were last written: the set
            # grows over moves that do not write processes.
            for pid in sorted(self._dirty_pids):
                self._write_process(self._procs[pid], initial=False)
            self._dirty_pids = set()
        if Part.CGROUPS in parts:
            self._write_cgroups()
        if Part.PROC_FILES in parts:
            self._write_proc_files()

    def _write_ib_counters(self) -> None:
        """The traffic counters of every port that is still there."""
        if not self._ib_counter_files:
            # Paths built once: a refresh between two reads writes them several times a second.
            for nic in self.hardware.nics:
                device = self._dirs[nic.pci[0]] / "infiniband" / nic.name
                for port in range(1, nic.ports + 1):
                    counters = device / "ports" / str(port) / "counters"
                    for name in _IB_TRAFFIC_COUNTERS:
                        key = ("ib", nic.name, port, name)
                        self._ib_counter_files.append((nic.pci[0], key, counters / name))
            for nic_name, port, name in sorted(self._ib_errors):
                nic = self.hardware.nic(nic_name)
                device = self._dirs[nic.pci[0]] / "infiniband" / nic.name
                path = device / "ports" / str(port) / "counters" / name
                self._ib_counter_files.append((nic.pci[0], ("ib", nic.name, port, name), path))
            for nic_name, port, name in sorted(self._ib_hw_errors):
                nic = self.hardware.nic(nic_name)
                device = self._dirs[nic.pci[0]] / "infiniband" / nic.name
                path = device / "ports" / str(port) / "hw_counters" / name
                key = ("ib_hw", nic.name, port, name)
                self._ib_counter_files.append((nic.pci[0], key, path))
        files = self._files
        for function, key, path in self._ib_counter_files:
            if function in self._removed:
                continue
            value = self._acc.get(key)
            if value is not None:
                # Driver hw_counters are 64-bit; PMA error counters stop at their maximum
                # rather than wrap (IBA 16.1.3.5).
                bits = ERROR_COUNTER_BITS.get(key[3]) if key[0] == "ib" else None
                count = int(value) if bits is None else min(int(value), (1 << bits) - 1)
                files.write(path, f"{count}\n")


#: The InfiniBand counters that traffic moves.
_IB_TRAFFIC_COUNTERS = (
    "port_xmit_data",
    "port_rcv_data",
    "port_xmit_packets",
    "port_rcv_packets",
    "unicast_xmit_packets",
    "unicast_rcv_packets",
    "port_xmit_wait",
)

#: /proc/net/snmp columns (net/ipv4/proc.c, Linux 6.12), one header line per group.
_SNMP_FIELDS: dict[str, tuple[str, ...]] = {
    "Ip": (
        "Forwarding", "DefaultTTL", "InReceives", "InHdrErrors", "InAddrErrors", "ForwDatagrams",
        "InUnknownProtos", "InDiscards", "InDelivers", "OutRequests", "OutDiscards",
        "OutNoRoutes", "ReasmTimeout", "ReasmReqds", "ReasmOKs", "ReasmFails", "FragOKs",
        "FragFails", "FragCreates", "OutTransmits",
    ),
    "Icmp": (
        "InMsgs", "InErrors", "InCsumErrors", "InDestUnreachs", "InTimeExcds", "InParmProbs",
        "InSrcQuenchs", "InRedirects", "InEchos", "InEchoReps", "InTimestamps",
        "InTimestampReps", "InAddrMasks", "InAddrMaskReps", "OutMsgs", "OutErrors",
        "OutRateLimitGlobal", "OutRateLimitHost", "OutDestUnreachs", "OutTimeExcds",
        "OutParmProbs", "OutSrcQuenchs", "OutRedirects", "OutEchos", "OutEchoReps",
        "OutTimestamps", "OutTimestampReps", "OutAddrMasks", "OutAddrMaskReps",
    ),
    "Tcp": (
        "RtoAlgorithm", "RtoMin", "RtoMax", "MaxConn", "ActiveOpens", "PassiveOpens",
        "AttemptFails", "EstabResets", "CurrEstab", "InSegs", "OutSegs", "RetransSegs",
        "InErrs", "OutRsts", "InCsumErrors",
    ),
    "Udp": (
        "InDatagrams", "NoPorts", "InErrors", "OutDatagrams", "RcvbufErrors", "SndbufErrors",
        "InCsumErrors", "IgnoredMulti", "MemErrors",
    ),
}  # fmt: skip
_SNMP_FIELDS["UdpLite"] = _SNMP_FIELDS["Udp"]

#: ``io.stat`` keys of one device (block/blk-cgroup.c).
_IO_FIELDS = ("rbytes", "wbytes", "rios", "wios", "dbytes", "dios")

#: ``nvmlDeviceGetNvLinkErrorCounter`` counters (``NVML_NVLINK_ERROR_DL_*``) by activity name.
_NVLINK_ERROR_COUNTERS = (
    ("replay", pynvml.NVML_NVLINK_ERROR_DL_REPLAY),
    ("recovery", pynvml.NVML_NVLINK_ERROR_DL_RECOVERY),
    ("crc_flit", pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT),
    ("crc_data", pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA),
)

_CPU_THROTTLE_FIELDS = ("nr_periods", "nr_throttled", "throttled_usec", "nr_bursts", "burst_usec")

_NFS_OP_FIELDS = (
    "ops", "ntrans", "timeouts", "bytes_sent", "bytes_recv", "queue_ms", "rtt_ms",
    "execute_ms", "errors",
)  # fmt: skip


def _apply_gpm(
    fake: FakeGpu,
    gpu_percent: float,
    memory_percent: float,
    traffic: Sequence[float],
    values: Mapping[tuple[str, str], Any],
) -> None:
    """GPM figures: the SMs as busy as the utilisation says (an upper bound: a kernel may run
    on few SMs), DRAM as the memory utilisation, NVLink and PCIe bytes the timeline's rates,
    unless a ``gpu_gpm`` activity states them."""

    def stated(name: str, default: float) -> float:
        value = values.get(("gpu_gpm", name))
        return default if value is None else float(value)

    nvlink_tx, nvlink_rx, pcie_tx, pcie_rx = traffic
    fake.gpm_sm_activity_percent = stated("sm_activity_percent", gpu_percent)
    fake.gpm_tensor_activity_percent = stated("tensor_activity_percent", 0.0)
    fake.gpm_dram_bandwidth_percent = stated("dram_bandwidth_percent", memory_percent)
    fake.gpm_nvlink_tx_mib_per_second = stated("nvlink_tx_bytes_per_second", nvlink_tx) / _MIB
    fake.gpm_nvlink_rx_mib_per_second = stated("nvlink_rx_bytes_per_second", nvlink_rx) / _MIB
    fake.gpm_pcie_tx_mib_per_second = stated("pcie_tx_bytes_per_second", pcie_tx) / _MIB
    fake.gpm_pcie_rx_mib_per_second = stated("pcie_rx_bytes_per_second", pcie_rx) / _MIB


def _with_degraded_bandwidth(mask: int, degraded: bool) -> int:
    """``mask`` with its degraded-bandwidth field saying ``degraded``."""
    field_value = FABRIC_HEALTH_DEGRADED_BW_TRUE if degraded else FABRIC_HEALTH_DEGRADED_BW_FALSE
    cleared = mask & ~(FABRIC_HEALTH_DEGRADED_BW_WIDTH << FABRIC_HEALTH_DEGRADED_BW_SHIFT)
    return cleared | (field_value << FABRIC_HEALTH_DEGRADED_BW_SHIFT)


def _memory_events(events: Mapping[str, float]) -> str:
    names = ("low", "high", "max", "oom", "oom_kill", "oom_group_kill")
    return "".join(f"{name} {int(events.get(name, 0.0))}\n" for name in names)


def _memory_stat(current: int) -> str:
    anon = current * 8 // 10
    file = current - anon
    return (
        f"anon {anon}\nfile {file}\nkernel {current // 50}\nsock 0\nshmem 0\n"
        f"file_dirty 0\nfile_writeback 0\npgfault {current // PAGE}\npgmajfault 0\n"
    )


def _limit(value: int | None) -> str:
    return "max\n" if value is None else f"{value}\n"


def _default_ib_counters() -> dict[str, int]:
    names = (
        "VL15_dropped", "excessive_buffer_overrun_errors", "link_downed", "link_error_recovery",
        "local_link_integrity_errors", "multicast_rcv_packets", "multicast_xmit_packets",
        "port_rcv_constraint_errors", "port_rcv_data", "port_rcv_errors", "port_rcv_packets",
        "port_rcv_remote_physical_errors", "port_rcv_switch_relay_errors",
        "port_xmit_constraint_errors", "port_xmit_data", "port_xmit_discards",
        "port_xmit_packets", "port_xmit_wait", "symbol_error", "unicast_rcv_packets",
        "unicast_xmit_packets",
    )  # fmt: skip
    return dict.fromkeys(names, 0)


def _default_ib_hw_counters() -> dict[str, int]:
    names = (
        "duplicate_request", "implied_nak_seq_err", "lifespan", "local_ack_timeout_err",
        "out_of_buffer", "out_of_sequence", "packet_seq_err", "rnr_nak_retry_err",
    )  # fmt: skip
    return {name: (12 if name == "lifespan" else 0) for name in names}


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
