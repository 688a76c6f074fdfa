"""Hot-plug, link events, NVSwitch SXids and hang signals: the ``udev``, ``link_events``,
``sxid``, ``locks``, ``threads`` and ``mountstats`` sources.

Counters are the sources' own cumulative counts since the daemon started (Prometheus computes
rates and increases). Labels stay bounded: interfaces are the node's hardware links and IB
ports (the source leaves virtual links out), ``action`` is one of the kernel's uevent actions
or ``other``, jobs are the node's running jobs, NFS operations are the RPC procedures the
kernel lists per mount, SXid keys are (switch, code, link) under the source's own cap.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from nodescope.model.link_events import LINK_EVENTS
from nodescope.model.locks import LOCKS as LOCKS_SOURCE
from nodescope.model.mountstats import MOUNTSTATS, MountstatsData
from nodescope.model.snapshot import Snapshot
from nodescope.model.sxid import SXID
from nodescope.model.threads import THREADS
from nodescope.model.udev import ACTIONS, UDEV
from nodescope_exporters.catalog import Metric, metric
from nodescope_exporters.kept import KeptFamilies, kept_or_built

AREA = "events"

LINK_TRANSITIONS = metric(
    "nodescope_link_transitions_total",
    "counter",
    "transitions of a network interface or InfiniBand port (device/port) to up or down"
    " since the daemon started",
    ("interface", "to"),
    area=AREA,
)
LINK_UP = metric(
    "nodescope_link_up",
    "gauge",
    "1 if the link is up (operstate up; IB port ACTIVE), 0 if down",
    ("interface",),
    area=AREA,
)
LINK_RECENT = metric(
    "nodescope_link_window_transitions",
    "gauge",
    "up/down transitions of the link within the flap window (nodescope_link_flap_window_seconds)",
    ("interface",),
    area=AREA,
)
FLAP_WINDOW = metric(
    "nodescope_link_flap_window_seconds",
    "gauge",
    "the window over which link transitions are counted for flap detection",
    area=AREA,
)
GPU_FELL_OFF = metric(
    "nodescope_gpu_fell_off_bus_total",
    "counter",
    "times a GPU's PCI function was removed (udev remove event or gone from the PCI listing)",
    ("bdf",),
    area=AREA,
)
SXIDS = metric(
    "nodescope_nvswitch_sxid_errors_total",
    "counter",
    "NVSwitch SXids in the kernel log since the daemon started, by switch (PCI address), code,"
    " link (empty: the line names none) and the driver's severity word (fatal, nonfatal,"
    " unstated)",
    ("nvswitch", "sxid", "link", "severity"),
    area=AREA,
)
SXIDS_DROPPED = metric(
    "nodescope_nvswitch_sxid_dropped_total",
    "counter",
    "SXids not counted per key because the table of (switch, code, link) keys was full",
    area=AREA,
)
KMSG_LOST = metric(
    "nodescope_kmsg_records_lost_total",
    "counter",
    "times the kernel said log records were overwritten before the sxid source read them",
    area=AREA,
)
UDEV_EVENTS = metric(
    "nodescope_udev_events_total",
    "counter",
    "device events of the pci, block and net subsystems seen by the monitor",
    ("subsystem", "action"),
    area=AREA,
)
LOCKS = metric(
    "nodescope_locks",
    "gauge",
    "granted file locks in /proc/locks by class (POSIX, FLOCK, OFDLCK, LEASE, DELEG, …)",
    ("kind",),
    area=AREA,
)
LOCKS_BLOCKED = metric(
    "nodescope_locks_blocked_requests",
    "gauge",
    "lock requests waiting behind a granted lock in /proc/locks",
    area=AREA,
)
LOCK_HOLDER_LOCKS = metric(
    "nodescope_lock_holder_locks",
    "gauge",
    "granted file locks a user holds when they flood /proc/locks (4,096 or more, or an eighth"
    " of the part read when the table was read only in part): at least this many; at most 8"
    " users",
    ("uid",),
    area=AREA,
)
JOB_THREADS = metric(
    "nodescope_job_threads",
    "gauge",
    "threads of a job's processes by task state (R running, S sleeping, D uninterruptible, …)",
    ("job_id", "state"),
    area=AREA,
)
HOST_BLOCKED = metric(
    "nodescope_threads_uninterruptible",
    "gauge",
    "threads of the host in D state at the latest walk of every process",
    area=AREA,
)
NFS_OPS = metric(
    "nodescope_nfs_rpc_operations_total",
    "counter",
    "NFS RPC operations completed per mount and procedure (/proc/self/mountstats)",
    ("mountpoint", "op"),
    area=AREA,
)
NFS_TRANSMISSIONS = metric(
    "nodescope_nfs_rpc_transmissions_total",
    "counter",
    "RPC transmissions, retransmissions included (retransmissions = this - operations)",
    ("mountpoint", "op"),
    area=AREA,
)
NFS_RTT = metric(
    "nodescope_nfs_rpc_rtt_seconds_total",
    "counter",
    "summed round-trip time of the operations (average = Δthis / Δoperations)",
    ("mountpoint", "op"),
    area=AREA,
)
NFS_EXECUTE = metric(
    "nodescope_nfs_rpc_execute_seconds_total",
    "counter",
    "summed time from start to completion of the operations, queueing included",
    ("mountpoint", "op"),
    area=AREA,
)
NFS_ERRORS = metric(
    "nodescope_nfs_rpc_errors_total",
    "counter",
    "operations that ended in an error (Linux 5.3 and later)",
    ("mountpoint", "op"),
    area=AREA,
)


def _links(snapshot: Snapshot) -> Iterator[Metric]:
    data = snapshot.latest(LINK_EVENTS)
    if data is None:
        return
    transitions = LINK_TRANSITIONS.family()
    up = LINK_UP.family()
    recent = LINK_RECENT.family()
    for link in data.links:
        transitions.add_metric([link.interface, "up"], link.up_total)
        transitions.add_metric([link.interface, "down"], link.down_total)
        if link.state in ("up", "down"):
            up.add_metric([link.interface], 1.0 if link.state == "up" else 0.0)
        recent.add_metric([link.interface], link.recent)
    window = FLAP_WINDOW.family()
    window.add_metric([], data.window_seconds)
    yield from (transitions, up, recent, window)


def _udev(snapshot: Snapshot) -> Iterator[Metric]:
    data = snapshot.latest(UDEV)
    if data is None:
        return
    fell = GPU_FELL_OFF.family()
    for removal in data.gpu_removals:
        fell.add_metric([removal.bdf], removal.count)
    yield fell
    if data.monitor is None:
        return  # no monitor: no events were watched, which is not "zero events"
    counts: dict[tuple[str, str], int] = {}
    for subsystem, action, count in data.events:
        key = (subsystem, action if action in ACTIONS else "other")
        counts[key] = counts.get(key, 0) + count
    events = UDEV_EVENTS.family()
    for (subsystem, action), count in sorted(counts.items()):
        events.add_metric([subsystem, action], count)
    yield events


def _sxids(snapshot: Snapshot) -> Iterator[Metric]:
    data = snapshot.latest(SXID)
    if data is None:
        return
    errors = SXIDS.family()
    for c in data.counts:
        severity = "unstated" if c.fatal is None else "fatal" if c.fatal else "nonfatal"
        link = "" if c.link is None else str(c.link)
        errors.add_metric([c.nvswitch, str(c.sxid), link, severity], c.count)
    dropped = SXIDS_DROPPED.family()
    dropped.add_metric([], data.dropped)
    lost = KMSG_LOST.family()
    lost.add_metric([], data.lost)
    yield from (errors, dropped, lost)


def _hangs(snapshot: Snapshot) -> Iterator[Metric]:
    locks = snapshot.latest(LOCKS_SOURCE)
    if locks is not None:
        family = LOCKS.family()
        for kind, count in locks.counts:
            family.add_metric([kind], count)
        blocked = LOCKS_BLOCKED.family()
        blocked.add_metric([], locks.blocked)
        yield from (family, blocked)
        if locks.flood_holders:
            holders = LOCK_HOLDER_LOCKS.family()
            for holder in locks.flood_holders:
                holders.add_metric([str(holder.uid)], holder.locks)
            yield holders
    threads = snapshot.latest(THREADS)
    if threads is not None:
        family = JOB_THREADS.family()
        for job in threads.jobs:
            for state, count in job.states:
                family.add_metric([job.job_id, state], count)
        yield family
        if threads.host_threads is not None:
            host = HOST_BLOCKED.family()
            host.add_metric([], len(threads.host_blocked))
            yield host


def _nfs(snapshot: Snapshot, kept: KeptFamilies | None) -> Iterator[Metric]:
    data = snapshot.latest(MOUNTSTATS)
    if data is None:
        return
    # Read every 10 s: the families are kept while the record is the same.
    yield from kept_or_built(kept, _nfs_families, [(data,)])


def _nfs_families(parts: Sequence[tuple[MountstatsData]]) -> Iterator[Metric]:
    [(data,)] = parts
    ops, trans, rtt, execute, errors = (
        NFS_OPS.family(),
        NFS_TRANSMISSIONS.family(),
        NFS_RTT.family(),
        NFS_EXECUTE.family(),
        NFS_ERRORS.family(),
    )
    for mount in data.mounts:
        for op in mount.ops:
            labels = [mount.mountpoint, op.name]
            ops.add_metric(labels, op.ops)
            trans.add_metric(labels, op.transmissions)
            rtt.add_metric(labels, op.rtt_ms / 1000)
            execute.add_metric(labels, op.execute_ms / 1000)
            if op.errors is not None:
                errors.add_metric(labels, op.errors)
    yield from (ops, trans, rtt, execute, errors)


#: The NFS families are kept while the mountstats record is the same.
KEEPS_FAMILIES = True


def families(snapshot: Snapshot, kept: KeptFamilies | None = None) -> Iterator[Metric]:
    yield from _links(snapshot)
    yield from _udev(snapshot)
    yield from _sxids(snapshot)
    yield from _hangs(snapshot)
    yield from _nfs(snapshot, kept)
