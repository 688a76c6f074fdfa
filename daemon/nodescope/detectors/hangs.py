"""Why a job's GPUs went idle: a storage lock or NFS wait, a starving data loader, or nothing
the node can see.

Input, all from the snapshot:

* the job view (``detectors.common.jobs``: a job's GPUs from its processes' NVML compute
  contexts) and the ``procs`` source's job processes (pid → job, for lock holders in jobs
  without GPUs);
* per GPU: NVML utilisation and the PCIe/NVLink byte rates between NVML's two latest reads;
* ``threads``: threads in ``D`` state and their wait channels (``docs/datasources.md`` §6);
* ``locks``: contended locks of ``/proc/locks`` with holder, waiters, mount and path;
* ``mountstats`` rates: nfsiostat's per-op RTT and execute time on the lock's mount;
* ``cgroups``: the job cgroup's ``io.pressure`` and ``io.stat``.

A job makes no progress when its GPUs move at most ``idle_bytes_per_second`` over PCIe plus
NVLink (both directions) and the job moves no more than that elsewhere either: its cgroup's
block I/O (or, where ``io.stat`` does not show it, a node disk moving that much while the
job's threads wait for block I/O) and its HCAs' InfiniBand traffic (a synchronous checkpoint
leaves the GPUs idle and its writer threads in D state, yet moves data). A job without
progress whose GPUs are all idle (utilisation at most ``idle_utilisation_ratio``) is
*stalled*; one whose GPUs are busy (kernels spinning) is in a collective hang:

``collective_hang`` (critical with a blocker, warning without)
    busy GPUs, nothing moving: NCCL's collectives wait for a rank that does not come; the
    blocker the storage analysis below finds for the job's processes (a lock, D-state
    threads) is named. The job's busy and idle GPUs are counted apart, and a rank that left
    before the hang (a GPU process of the job that NVML and the job lost within
    :data:`DEPARTED_KEEP_SECONDS`, remembered by ``Derived.departed_ranks``) is named with
    its pid, name, GPUs and when; how it ended is named where the kernel log says it (a
    segfault, a fatal trap, the OOM killer: the kernel's own record of that pid *and* name,
    ``sources/process_ends.py``), else "status unknown", as the node is not its parent; the
    OOM kills of the job's cgroup are named beside as a fact.

A stalled job is then, in this order:

``job_stalled_on_storage`` (critical)
    a process of the job waits on a lock in ``/proc/locks`` (named: class, type, mount,
    inode, path when the holder's open files show it; its holder's pid, name and job; the NFS
    operation latency on that mount), or threads of the job sit in ``D`` state on a
    filesystem or NFS wait channel (named, with the slowest NFS operation of each mount);
``data_loader_starving`` (warning)
    the GPUs are mostly idle (mean utilisation below ``loader_utilisation_ratio``; stalled
    included) while the job cgroup's io pressure (``some avg10``) is at least
    ``loader_io_pressure_percent`` and its block I/O plus the node's NFS traffic stays below
    ``loader_max_bytes_per_second``;
``job_stalled_unknown`` (warning)
    stalled with none of those signals.

Each finding needs its job to have made no progress for ``min_stall_seconds`` (default 20 s)
in every cycle: a pause at an epoch boundary or a checkpoint barrier is none. The time is
the derived stage's (``Derived.held_since``), keyed by job and by whether its GPUs are
busy, so a stall first of unknown cause and then on a lock is one stall. The alert rule's
``for`` (set below in ``detectors.registry``) comes on top. A job with a lost GPU is left
to the fell-off-the-bus finding, which already names the cause.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from nodescope.alerts import AlertRule
from nodescope.config import HangsSettings
from nodescope.detectors.common import jobs
from nodescope.detectors.kinds import FindingKind, actions, severities
from nodescope.model.cgroup import CGROUPS, Cgroup, CgroupTree
from nodescope.model.counters import counter_delta
from nodescope.model.finding import Finding, Severity
from nodescope.model.infiniband import INFINIBAND
from nodescope.model.jobs import DepartedRank, JobView
from nodescope.model.locks import LOCKS, ContendedLock, LockParty, LocksData
from nodescope.model.mountstats import MOUNTSTATS, MountstatsData, MountstatsRates, NfsMountRates
from nodescope.model.nvml import NVML
from nodescope.model.pressure import PRESSURE, full_stall_ratio, with_node_stall
from nodescope.model.procs import PROCS, ProcsData
from nodescope.model.snapshot import Snapshot
from nodescope.model.sxid import SXID, ProcessEnd
from nodescope.model.threads import THREADS, BlockedThread

STORAGE = "job_stalled_on_storage"
COLLECTIVE = "collective_hang"
LOADER = "data_loader_starving"
UNKNOWN = "job_stalled_unknown"

_HANG_SIGNAL = (
    "NVML utilisation and byte rates, thread states and wait channels in `/proc`,"
    " `/proc/locks`, NFS `mountstats`, disk counters"
)

# Idle GPUs are a stall only once they stay idle: T is the rule's "for"; the cause unknown
# waits longer, as a job between phases is idle for a while too.
SPECS = (
    FindingKind(
        COLLECTIVE,
        severities(Severity.WARNING, Severity.CRITICAL),
        actions(critical="drain", warning="alert"),
        meaning="a job's kernels spin with nothing moving: a collective waits for a rank"
        " (critical when what blocks it is found)",
        signal=_HANG_SIGNAL,
        hardware="yes",
        # Held as long as a storage stall, so a collective that waits out a slow rank for a
        # few seconds is no alert.
        alert=AlertRule(for_seconds=30.0, resolve_after_seconds=60.0),
    ),
    FindingKind(
        STORAGE,
        severities(Severity.CRITICAL),
        actions(critical="drain"),
        meaning="a job's GPUs sit idle while its threads wait on a storage lock or a filesystem",
        signal=_HANG_SIGNAL,
        hardware="yes",
        alert=AlertRule(for_seconds=30.0, resolve_after_seconds=60.0),
    ),
    FindingKind(
        LOADER,
        severities(Severity.WARNING),
        actions(warning="alert"),
        meaning="a job's GPUs starve while its data loader waits on IO",
        signal=_HANG_SIGNAL,
        hardware="yes",
        alert=AlertRule(for_seconds=60.0, resolve_after_seconds=120.0),
    ),
    FindingKind(
        UNKNOWN,
        severities(Severity.WARNING),
        actions(warning="alert"),
        meaning="a job's GPUs sit idle with no lock, filesystem wait or IO pressure to explain it",
        signal=_HANG_SIGNAL,
        hardware="yes",
        alert=AlertRule(for_seconds=120.0, resolve_after_seconds=60.0),
    ),
)

#: Wait channels (kernel symbols, prefix match) of the NFS client and the RPC layer.
NFS_WCHAN_PREFIXES = ("rpc_", "__rpc_", "nfs", "_nfs", "__nfs")
#: Wait channels of local filesystems, the page cache and the block layer (prefix match).
FS_WCHAN_PREFIXES = (
    "io_schedule",
    "folio_wait",
    "__folio_lock",
    "wait_on_page",
    "__lock_page",
    "wait_on_buffer",
    "__wait_on_buffer",
    "bit_wait_io",
    "__filemap",
    "filemap_",
    "jbd2",
    "ext4",
    "xfs",
    "btrfs",
    "fuse",
    "ceph",
    "cifs",
    "smb",
    "ll_",
    "lov_",
    "osc_",
    "blk_",
    "rq_qos_wait",
    "wbt_wait",
    "balance_dirty_pages",
    "do_fsync",
    "vfs_fsync",
    "fcntl_setlk",
    "locks_lock",
    "flock_lock",
    "posix_lock",
    "__break_lease",
)


def wchan_class(wchan: str | None) -> str | None:
    """``"nfs"``, ``"filesystem"`` or ``None`` (anything else, or unknown)."""
    if not wchan:
        return None
    if wchan.startswith(NFS_WCHAN_PREFIXES):
        return "nfs"
    if wchan.startswith(FS_WCHAN_PREFIXES):
        return "filesystem"
    return None


@dataclass(frozen=True, slots=True)
class JobGpuActivity:
    """A job's GPUs now: utilisation (fractions) and traffic (bytes/s, both directions).

    ``idle_gpus`` are those under the idle thresholds; ``None`` traffic: the NVML source has
    not read twice yet, so nothing can be called idle."""

    job_id: str
    gpus: tuple[int, ...]
    mean_utilisation: float | None
    max_utilisation: float | None
    pcie_bytes_per_second: float | None
    nvlink_bytes_per_second: float | None
    idle_gpus: tuple[int, ...]
    lost_gpus: tuple[int, ...]
    #: GPUs moving at most the idle traffic over PCIe and NVLink, whatever their utilisation
    quiet_gpus: tuple[int, ...] = ()
    #: the HCAs the job may use (``NCCL_IB_HCA``, or all)
    hcas: tuple[str, ...] = ()

    @property
    def stalled(self) -> bool:
        return bool(self.gpus) and len(self.idle_gpus) == len(self.gpus)

    @property
    def spinning(self) -> bool:
        """Every GPU busy while none moves data: kernels (NCCL's collectives waiting for a
        peer) keep utilisation up with no progress."""
        return (
            bool(self.gpus)
            and len(self.quiet_gpus) == len(self.gpus)
            and len(self.idle_gpus) < len(self.gpus)
        )


def job_gpu_activity(
    snapshot: Snapshot,
    idle_utilisation_ratio: float = 0.05,
    idle_bytes_per_second: float = 1e8,
    views: Sequence[JobView] | None = None,
) -> tuple[JobGpuActivity, ...]:
    """Utilisation and traffic of each job's GPUs (NVML × the job view)."""
    nvml = snapshot.latest(NVML)
    if nvml is None:
        return ()
    rates = snapshot.derived.gpu_rates
    by_index = {g.index: g for g in nvml.gpus}
    rate_of = {r.index: r for r in rates.gpus} if rates is not None else {}
    lost = {g.gpu for g in nvml.lost}
    out: list[JobGpuActivity] = []
    for view in jobs(snapshot) if views is None else views:
        utils: list[float] = []
        pcie_total: float | None = 0.0
        nvlink_total: float | None = 0.0
        idle: list[int] = []
        quiet: list[int] = []
        for index in view.gpus:
            gpu = by_index.get(index)
            rate = rate_of.get(index)
            util = (
                None
                if gpu is None or gpu.gpu_util_percent is None
                else gpu.gpu_util_percent / 100.0
            )
            if util is not None:
                utils.append(util)
            pcie = None
            nvlink = None
            if rate is not None:
                if (
                    rate.pcie_tx_bytes_per_second is not None
                    or rate.pcie_rx_bytes_per_second is not None
                ):
                    pcie = (rate.pcie_tx_bytes_per_second or 0.0) + (
                        rate.pcie_rx_bytes_per_second or 0.0
                    )
                nvlink = sum(
                    (link.data_tx_bytes_per_second or 0.0) + (link.data_rx_bytes_per_second or 0.0)
                    for link in rate.nvlinks
                )
            pcie_total = None if pcie is None or pcie_total is None else pcie_total + pcie
            nvlink_total = None if nvlink is None or nvlink_total is None else nvlink_total + nvlink
            if pcie is not None and nvlink is not None and pcie + nvlink <= idle_bytes_per_second:
                quiet.append(index)
                if util is not None and util <= idle_utilisation_ratio:
                    idle.append(index)
        out.append(
            JobGpuActivity(
                job_id=view.job_id,
                gpus=view.gpus,
                mean_utilisation=sum(utils) / len(utils) if utils else None,
                max_utilisation=max(utils) if utils else None,
                pcie_bytes_per_second=pcie_total,
                nvlink_bytes_per_second=nvlink_total,
                idle_gpus=tuple(idle),
                lost_gpus=tuple(i for i in view.gpus if i in lost),
                quiet_gpus=tuple(quiet),
                hcas=view.hcas,
            )
        )
    return tuple(out)


# --- storage --------------------------------------------------------------------------------


def _gpu_list(gpus: Iterable[int]) -> str:
    return ",".join(str(g) for g in gpus)


def _nfs_text(mount: NfsMountRates | None, data: MountstatsData | None, where: str) -> str:
    """Latency of the LOCK operation (NFSv4) or the slowest one on a mount, this interval;
    since the mount when no operation completed in the interval."""
    if mount is not None:
        op = mount.op("LOCK")
        if op is None or op.avg_execute_ms is None:
            op = mount.slowest()
        if op is not None and op.avg_rtt_ms is not None and op.avg_execute_ms is not None:
            errors = f", {op.errors_per_second:.2f} errors/s" if op.errors_per_second else ""
            return (
                f"; NFS {op.name} on {where}: {op.avg_rtt_ms:.1f} ms RTT,"
                f" {op.avg_execute_ms:.1f} ms execute, {op.ops_per_second:.2f} ops/s{errors}"
            )
    if data is not None:
        whole = data.mount(where)
        op_data = whole.op("LOCK") if whole is not None else None
        if op_data is not None and op_data.ops:
            return (
                f"; NFS LOCK on {where} since mount: {op_data.rtt_ms / op_data.ops:.1f} ms RTT,"
                f" {op_data.execute_ms / op_data.ops:.1f} ms execute over {op_data.ops} ops"
            )
    return ""


def _nfs_evidence(mount: NfsMountRates | None) -> dict[str, float]:
    out: dict[str, float] = {}
    if mount is None:
        return out
    lock = mount.op("LOCK")
    if lock is not None:
        out["nfs_lock_ops_per_second"] = lock.ops_per_second
        if lock.avg_rtt_ms is not None:
            out["nfs_lock_avg_rtt_ms"] = lock.avg_rtt_ms
        if lock.avg_execute_ms is not None:
            out["nfs_lock_avg_execute_ms"] = lock.avg_execute_ms
        if lock.errors_per_second is not None:
            out["nfs_lock_errors_per_second"] = lock.errors_per_second
    slowest = mount.slowest()
    if slowest is not None and slowest.avg_execute_ms is not None:
        out["nfs_slowest_avg_execute_ms"] = slowest.avg_execute_ms
        if slowest.avg_rtt_ms is not None:
            out["nfs_slowest_avg_rtt_ms"] = slowest.avg_rtt_ms
    out["nfs_retransmissions_per_second"] = sum(o.retransmissions_per_second for o in mount.ops)
    return out


def _lock_text(lock: ContendedLock, waiter_pids: Sequence[int], job_of: Mapping[int, str]) -> str:
    waiter = next((w for w in lock.waiters if w.pid in waiter_pids), lock.waiters[0])
    where = lock.mountpoint or (f"device {lock.device}" if lock.device else "no inode")
    mount = f" ({lock.fstype} {lock.mount_source})" if lock.fstype and lock.mount_source else ""
    path = f" {lock.path}" if lock.path else ""
    return (
        f"pid {waiter.pid} ({waiter.comm or '?'}) waits on {lock.kind} {waiter.access} lock on"
        f" {where}{mount} inode {lock.inode}{path} held by"
        f" {_holder_text(lock.holder, job_of.get(lock.holder.pid))}"
    )


def _holder_text(holder: LockParty, job: str | None) -> str:
    """Who holds the lock: the job's process, or what a process outside any job is (its
    systemd unit and cgroup: a backup service, a user's shell), as far as the node knows."""
    name = f"pid {holder.pid} ({holder.comm or '?'}"
    if job is not None:
        return f"{name}, job {job})"
    unit = holder.unit
    if unit is not None:
        return f"{name}) of {unit}, not a job (cgroup {holder.cgroup})"
    if holder.cgroup:
        return f"{name}) in cgroup {holder.cgroup}, not a job"
    return f"{name}, not a job)"


def _storage_finding(
    activity: JobGpuActivity,
    pids: frozenset[int],
    blocked: Sequence[BlockedThread],
    locks: LocksData | None,
    job_of: Mapping[int, str],
    nfs: MountstatsRates | None,
    nfs_data: MountstatsData | None,
) -> Finding | None:
    waits = [
        lock
        for lock in (locks.contended if locks is not None else ())
        if any(w.pid in pids for w in lock.waiters)
    ]
    storage_threads = [b for b in blocked if wchan_class(b.wchan) is not None]
    if not waits and not storage_threads:
        return None
    job = activity.job_id
    subjects: dict[str, str] = {"job": job}
    evidence: dict[str, float] = {
        "gpus_idle": float(len(activity.idle_gpus)),
        "threads_blocked": float(len(storage_threads)),
        "lock_waiters": float(sum(1 for lock in waits for w in lock.waiters if w.pid in pids)),
        "gpu_utilisation_ratio": activity.max_utilisation or 0.0,
    }
    traffic = (activity.pcie_bytes_per_second or 0.0) + (activity.nvlink_bytes_per_second or 0.0)
    parts = [
        f"job {job} stalled on storage: GPUs {_gpu_list(activity.gpus)} idle"
        f" ({(activity.max_utilisation or 0.0):.0%} utilisation,"
        f" {traffic / 1e6:.0f} MB/s PCIe+NVLink)"
    ]
    nfs_mounts: list[str] = []
    if waits:
        lock = waits[0]
        subjects["lock_inode"] = str(lock.inode) if lock.inode is not None else "none"
        subjects["lock_mount"] = lock.mountpoint or (lock.device or "none")
        subjects["holder_pid"] = str(lock.holder.pid)
        holder_job = job_of.get(lock.holder.pid)
        if holder_job is not None:
            subjects["holder_job"] = holder_job
        elif lock.holder.unit is not None:
            subjects["holder_unit"] = lock.holder.unit
        parts.append(_lock_text(lock, sorted(pids), job_of))
        if len(waits) > 1:
            parts.append(f"and {len(waits) - 1} more contended lock(s)")
        if lock.is_nfs and lock.mountpoint:
            nfs_mounts.append(lock.mountpoint)
    if storage_threads:
        channels = sorted({b.wchan or "?" for b in storage_threads})
        first = storage_threads[0]
        parts.append(
            f"{len(storage_threads)} thread(s) in D state at {', '.join(channels)}"
            f" (first: pid {first.pid} tid {first.tid} {first.comm})"
        )
        if any(wchan_class(b.wchan) == "nfs" for b in storage_threads) and nfs is not None:
            nfs_mounts.extend(m.mountpoint for m in nfs.mounts if m.mountpoint not in nfs_mounts)
    text = "; ".join(parts)
    for where in nfs_mounts[:3]:
        rates = nfs.mount(where) if nfs is not None else None
        text += _nfs_text(rates, nfs_data, where)
        if where == nfs_mounts[0]:
            evidence.update(_nfs_evidence(rates))
    return Finding(STORAGE, Severity.CRITICAL, subjects, evidence, text)


# --- data loader ----------------------------------------------------------------------------


def job_cgroup(tree: CgroupTree, job_id: str) -> Cgroup | None:
    """The Slurm job cgroup ``…/job_<id>`` (the shallowest, if several match)."""
    name = f"job_{job_id}"
    for cg in tree.cgroups:
        if cg.name == name:
            return cg
    return None


def _io_bytes(cg: Cgroup | None) -> int | None:
    if cg is None or cg.io_stat is None:
        return None
    return sum((d.rbytes or 0) + (d.wbytes or 0) for d in cg.io_stat.devices)


def job_io_bytes_per_second(snapshot: Snapshot, job_id: str) -> float | None:
    """Block I/O of the job cgroup (``io.stat`` read+write bytes) per second."""
    pair = snapshot.pair(CGROUPS)
    if pair is None:
        return None
    prev, cur, seconds = pair
    before = _io_bytes(job_cgroup(prev, job_id))
    now = _io_bytes(job_cgroup(cur, job_id))
    if before is None or now is None:
        return None
    delta = counter_delta(before, now)
    return None if delta is None else delta / seconds


def _nfs_bytes_per_second(nfs: MountstatsRates | None) -> float:
    if nfs is None:
        return 0.0
    return sum(o.kilobytes_per_second * 1024 for m in nfs.mounts for o in m.ops)


def _loader_finding(
    activity: JobGpuActivity,
    snapshot: Snapshot,
    settings: HangsSettings,
    nfs: MountstatsRates | None,
) -> Finding | None:
    mean = activity.mean_utilisation
    if mean is None or mean >= settings.loader_utilisation_ratio:
        return None
    tree = snapshot.latest(CGROUPS)
    cg = job_cgroup(tree, activity.job_id) if tree is not None else None
    if cg is None or cg.io_pressure is None or cg.io_pressure.some is None:
        return None
    pressure = cg.io_pressure.some.avg10
    if pressure < settings.loader_io_pressure_percent:
        return None
    disk = job_io_bytes_per_second(snapshot, activity.job_id)
    if disk is None:
        return None
    nfs_bytes = _nfs_bytes_per_second(nfs)
    limit = settings.loader_max_bytes_per_second
    if disk + nfs_bytes >= limit:
        return None
    message = (
        f"job {activity.job_id}: data loader starving: GPUs {_gpu_list(activity.gpus)} at"
        f" {mean:.0%} mean utilisation while the job's io pressure is {pressure:.0f} %"
        f" (some, avg10) and its reads and writes move only {disk / 1e6:.1f} MB/s from disk"
        f" and {nfs_bytes / 1e6:.1f} MB/s over NFS"
    )
    evidence = {
        "gpu_utilisation_ratio": mean,
        "io_pressure_some_avg10_percent": pressure,
        "disk_bytes_per_second": disk,
        "nfs_bytes_per_second": nfs_bytes,
    }
    return Finding(LOADER, Severity.WARNING, {"job": activity.job_id}, evidence, message)


# --- progress -------------------------------------------------------------------------------


def _ib_bytes_per_second(snapshot: Snapshot, hcas: Iterable[str]) -> float | None:
    """Bytes per second both ways through every port of ``hcas``; ``None`` before the
    ``infiniband`` source has read twice."""
    ib = snapshot.latest(INFINIBAND)
    rates = snapshot.derived.ib_rates
    if ib is None or rates is None:
        return None
    wanted = set(hcas)
    total = 0.0
    for device in ib.devices:
        if device.name not in wanted:
            continue
        for port in device.ports:
            port_rates = rates.port(device.name, port.port)
            if port_rates is not None:
                total += (port_rates.xmit_bytes_per_second or 0.0) + (
                    port_rates.rcv_bytes_per_second or 0.0
                )
    return total


#: Wait channels (prefix match) of a thread waiting for block I/O to complete or to be let
#: through (writeback throttling), not for a lock: a thread here is served by the disks.
BLOCK_IO_WCHAN_PREFIXES = (
    "io_schedule",
    "folio_wait",
    "wait_on_page",
    "bit_wait_io",
    "wait_on_buffer",
    "__wait_on_buffer",
    "blk_",
    "rq_qos_wait",
    "wbt_wait",
    "balance_dirty_pages",
)


def _busiest_disk_bytes_per_second(snapshot: Snapshot) -> float | None:
    """The read plus write bytes per second of the node's busiest block device (the largest
    one, not a sum: a partition's traffic is also its disk's)."""
    rates = snapshot.derived.disk_rates
    if rates is None or not rates.devices:
        return None
    return max(d.rmb_s + d.wmb_s for d in rates.devices) * 2**20


def data_moving(
    snapshot: Snapshot,
    activity: JobGpuActivity,
    limit: float,
    blocked: Sequence[BlockedThread] = (),
) -> dict[str, float]:
    """What a job moves besides its GPUs' PCIe and NVLink traffic, per path, where it is
    above ``limit`` bytes per second: its cgroup's block I/O and its HCAs' InfiniBand
    traffic. A job that moves data this way is making progress, whatever its GPUs and its
    threads show: a synchronous checkpoint leaves the GPUs idle and its writer threads in D
    state. Where the cgroup's ``io.stat`` does not show it (io accounting off, or writeback
    charged elsewhere), threads of the job (``blocked``) waiting for block I/O while a disk of
    the node moves more than ``limit`` count as the job's I/O being served. NFS traffic is not
    counted: mountstats is per mount, not per job, and another job's writes would hide this
    one's stall."""
    moving: dict[str, float] = {}
    disk = job_io_bytes_per_second(snapshot, activity.job_id)
    if disk is not None and disk > limit:
        moving["disk_bytes_per_second"] = disk
    elif any((b.wchan or "").startswith(BLOCK_IO_WCHAN_PREFIXES) for b in blocked):
        busiest = _busiest_disk_bytes_per_second(snapshot)
        if busiest is not None and busiest > limit:
            moving["node_disk_bytes_per_second"] = busiest
    ib = _ib_bytes_per_second(snapshot, activity.hcas)
    if ib is not None and ib > limit:
        moving["infiniband_bytes_per_second"] = ib
    return moving


def _gpus_text(gpus: Sequence[int], state: str) -> str:
    return f"GPU{'s' if len(gpus) > 1 else ''} {_gpu_list(gpus)} {state}"


def _departed_text(
    gone: Sequence[DepartedRank],
    now: float,
    oom_kills: int | None,
    ended: Mapping[int, ProcessEnd] | None = None,
) -> str:
    """The job's ranks that left before the hang: pid, name, GPUs, when, and how each ended
    where the kernel log's own record of the same pid and name says it (``ended``, by pid).
    Otherwise how it ended is not known to the node (it is not their parent and the kernel
    logs only some deaths), so it is said to be unknown; OOM kills the job's cgroup counted
    are named as a fact beside."""
    ranks = []
    for rank in gone[:4]:
        on = f" on {_gpus_text(rank.gpus, '')}".rstrip() if rank.gpus else ""
        end = None if ended is None else ended.get(rank.pid)
        # A pid alone is no proof: the name the kernel gave must be the rank's too.
        if end is not None and rank.comm is not None and end.comm == rank.comm:
            how = f": {end.signal} ({end.cause}, kernel log)"
            verb = "ended"
        else:
            how, verb = " (status unknown)", "exited"
        ranks.append(
            f"pid {rank.pid} ({rank.comm or '?'}){on} {verb} {now - rank.gone_at:.0f} s ago{how}"
        )
    more = f" and {len(gone) - 4} more" if len(gone) > 4 else ""
    text = f"; rank gone: {', '.join(ranks)}{more}"
    if oom_kills:
        text += f" (the job's cgroup counts {oom_kills} OOM kill(s) in memory.events)"
    return text


def _collective_finding(
    activity: JobGpuActivity,
    blocker: Finding | None,
    gone: Sequence[DepartedRank] = (),
    now: float = 0.0,
    oom_kills: int | None = None,
    ended: Mapping[int, ProcessEnd] | None = None,
) -> Finding:
    """Busy GPUs that move nothing: the job's collectives wait for a rank that does not come.
    ``blocker``: what the storage analysis found holding one of its processes; ``gone``: the
    job's GPU processes that left before (a rank that died)."""
    job = activity.job_id
    traffic = (activity.pcie_bytes_per_second or 0.0) + (activity.nvlink_bytes_per_second or 0.0)
    util = activity.mean_utilisation or 0.0
    idle = set(activity.idle_gpus)
    busy = [g for g in activity.gpus if g not in idle]
    evidence: dict[str, float] = {
        "gpu_utilisation_ratio": util,
        "gpu_traffic_bytes_per_second": traffic,
        "gpus": float(len(activity.gpus)),
        "gpus_busy": float(len(busy)),
        "gpus_idle": float(len(idle)),
    }
    subjects = {"job": job}
    # An idle GPU of the job (its rank stopped launching kernels) is no spinning one: the
    # two are counted apart.
    idle_text = f", {_gpus_text(activity.idle_gpus, 'idle')}" if idle else ""
    text = (
        f"job {job} collective hang: {_gpus_text(busy, 'busy')}{idle_text} ({util:.0%} mean"
        f" utilisation) while no data moves on NVLink, PCIe ({traffic / 1e6:.0f} MB/s) or"
        f" InfiniBand: kernels spin waiting for a peer"
    )
    if gone:
        text += _departed_text(gone, now, oom_kills, ended)
        evidence["ranks_gone"] = float(len(gone))
        evidence["gone_pid"] = float(gone[0].pid)
    if blocker is None:
        return Finding(COLLECTIVE, Severity.WARNING, subjects, evidence, text)
    # The storage analysis names what holds the job: the lock, its holder, the D-state
    # threads; its first part restates the GPUs, which this message already says.
    cause = blocker.message.split("; ", 1)[1] if "; " in blocker.message else blocker.message
    for key in ("lock_inode", "lock_mount", "holder_pid", "holder_job", "holder_unit"):
        if key in blocker.subjects:
            subjects[key] = blocker.subjects[key]
    evidence.update(
        {k: v for k, v in blocker.evidence.items() if k not in evidence and k != "gpus_idle"}
    )
    return Finding(COLLECTIVE, Severity.CRITICAL, subjects, evidence, f"{text}; blocked: {cause}")


# --- the detector ---------------------------------------------------------------------------


def _job_process_maps(procs: ProcsData | None) -> tuple[dict[int, str], dict[str, set[int]]]:
    """pid -> job and job -> pids of the ``procs`` source's job processes."""
    job_of = {p.pid: p.job_id for p in procs.processes} if procs is not None else {}
    pids_of: dict[str, set[int]] = {}
    for pid, job in job_of.items():
        pids_of.setdefault(job, set()).add(pid)
    return job_of, pids_of


#: Seconds a job's departed GPU process is remembered: a hang found within this long of a
#: rank's exit names it (the hang needs min_stall_seconds, 20 s by default, to be a finding).
DEPARTED_KEEP_SECONDS = 600.0


def _oom_kills(snapshot: Snapshot, job_id: str) -> int | None:
    """``oom_kill`` of the job cgroup's ``memory.events`` (v1: ``memory.oom_control``)."""
    for job in snapshot.derived.jobs:
        if job.job_id == job_id:
            stats = job.stats
            if stats is not None and stats.memory_events is not None:
                return stats.memory_events.oom_kill
    return None


def _ended(snapshot: Snapshot, gone: Sequence[DepartedRank]) -> dict[int, ProcessEnd]:
    """The kernel log's process ends by pid (the latest of a pid), asked only for a hang
    with a departed rank."""
    kernel_log = snapshot.latest(SXID) if gone else None
    if kernel_log is None:
        return {}
    return {end.pid: end for end in kernel_log.ended}


def evaluate(
    snapshot: Snapshot, settings: HangsSettings, departed: Sequence[DepartedRank] = ()
) -> list[Finding]:
    activities = job_gpu_activity(
        snapshot,
        settings.idle_utilisation_ratio,
        settings.idle_bytes_per_second,
    )
    loader_ratio = settings.loader_utilisation_ratio
    limit = settings.idle_bytes_per_second
    if not any(
        not a.lost_gpus
        and (
            a.stalled
            or a.spinning
            or (a.mean_utilisation is not None and a.mean_utilisation < loader_ratio)
        )
        for a in activities
    ):
        # Every job busy (the usual case): none of the findings below can hold, as
        # _loader_finding wants a mean utilisation under the ratio; skip gathering evidence.
        return []
    job_of, pids_of = _job_process_maps(snapshot.latest(PROCS))
    threads = snapshot.latest(THREADS)
    all_blocked = threads.blocked() if threads is not None else ()
    locks = snapshot.latest(LOCKS)
    nfs = snapshot.derived.nfs_rates
    nfs_data = snapshot.latest(MOUNTSTATS)
    findings: list[Finding] = []
    for activity in activities:
        if activity.lost_gpus:
            continue
        job = activity.job_id
        blocked = tuple(b for b in all_blocked if b.job_id == job)
        silent = (activity.stalled or activity.spinning) and not data_moving(
            snapshot, activity, limit, blocked
        )
        # What holds the job, when it makes no progress: a lock, D-state threads.
        storage = (
            _storage_finding(
                activity, frozenset(pids_of.get(job, ())), blocked, locks, job_of, nfs, nfs_data
            )
            if silent
            else None
        )
        if silent and activity.spinning:
            gone = [d for d in departed if d.job_id == job]
            oom = _oom_kills(snapshot, job) if gone else None
            findings.append(
                _collective_finding(
                    activity, storage, gone, snapshot.monotonic, oom, _ended(snapshot, gone)
                )
            )
            continue
        if storage is not None:
            findings.append(storage)
            continue
        loader = _loader_finding(activity, snapshot, settings, nfs)
        if loader is not None:
            findings.append(loader)
            continue
        if silent:
            d_state = len(blocked)
            extra = (
                f"; {d_state} thread(s) in D state at"
                f" {', '.join(sorted({b.wchan or '?' for b in blocked}))}"
                if d_state
                else ""
            )
            findings.append(
                Finding(
                    UNKNOWN,
                    Severity.WARNING,
                    {"job": job},
                    {
                        "gpus_idle": float(len(activity.idle_gpus)),
                        "threads_blocked": float(d_state),
                    },
                    f"job {job} stalled: GPUs {_gpu_list(activity.gpus)} idle (no utilisation,"
                    f" no PCIe/NVLink traffic) with no storage lock, filesystem wait or io"
                    f" pressure to explain it{extra}",
                )
            )
    return findings


def detect(previous: Snapshot | None, snapshot: Snapshot, settings: HangsSettings) -> list[Finding]:
    if not settings.enabled:
        return []
    # Asked every cycle, so the memory of the ranks that left carries on: cheap while the
    # jobs' GPU processes do not change.
    departed = snapshot.derived.departed_ranks(
        snapshot.monotonic,
        None if previous is None else previous.monotonic,
        DEPARTED_KEEP_SECONDS,
    )
    found = held_long_enough(
        evaluate(snapshot, settings, departed),
        previous,
        snapshot,
        settings.min_stall_seconds,
    )
    # A job stalled on storage while the whole node waits on IO (PSI io full): the storage,
    # not the job, is the likely cause.
    node_stall = full_stall_ratio(snapshot.pair(PRESSURE), "io")
    return with_node_stall(found, STORAGE, "node_io_full_stall_ratio", node_stall)


def held_long_enough(
    findings: list[Finding], previous: Snapshot | None, snapshot: Snapshot, minimum: float
) -> list[Finding]:
    """The findings of jobs that have made no progress for at least ``minimum`` seconds, each
    with ``held_seconds``. A job with idle GPUs is one condition whatever its stall is found
    to be from one cycle to the next (an unknown stall whose lock shows up later is the same
    stall); busy GPUs with nothing moving (a collective hang) are another, so the cycle in
    which a stalled job's GPUs start again before their traffic shows is no hang."""

    def condition(finding: Finding) -> str:
        spinning = "spinning" if finding.kind == COLLECTIVE else "idle"
        return f"{finding.subjects['job']}/{spinning}"

    since = snapshot.derived.held_since(
        "hangs",
        {condition(f) for f in findings},
        snapshot.monotonic,
        None if previous is None else previous.monotonic,
    )
    kept = []
    for finding in findings:
        held = snapshot.monotonic - since[condition(finding)]
        if held >= minimum:
            kept.append(replace(finding, evidence={**finding.evidence, "held_seconds": held}))
    return kept
