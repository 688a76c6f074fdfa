"""Hang diagnosis on the simulated node: the ``allreduce-hang-nfs-lock`` scenario replayed
through the daemon's sources (threads in D on an NFS wait channel, /proc/locks, mountstats)
and detectors, and the detector's other outcomes on that node's snapshots changed one signal
at a time."""

from __future__ import annotations

import dataclasses
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from nodescope.assembly import default_config, from_mapping
from nodescope.detectors import hangs
from nodescope.detectors.registry import DETECTORS
from nodescope.model.finding import Severity
from nodescope.model.locks import LOCKS
from nodescope.model.mountstats import MOUNTSTATS
from nodescope.model.nvml import NVML
from nodescope.model.pressure import NodePressure
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.model.threads import THREADS
from nodescope.sources.cgroup import CgroupTree, IoDeviceStat, IoStat, Pressure, PressureLine
from nodescope.sources.mountstats import MountstatsRates

JOB, HOLDER_JOB = "81760", "81761"

#: The shipped ``[detectors.hangs]`` table.
HANGS = default_config().detectors.hangs


@pytest.fixture(scope="module")
def replayed() -> tuple[Any, dict[float, Snapshot]]:
    """The scenario up to t=45 (the lock and the D state start at 20, the stall is a finding
    once it has held for min_stall_seconds, 20 s), with only this module's detectors: the
    scenario's "no other findings" is theirs to keep."""
    from nodescope.sim.driver import replay, temp_dir
    from nodescope.sim.scenario import load_scenario

    scenario = load_scenario("allreduce-hang-nfs-lock")
    # The metric expectations are test_replay's; rendering no /metrics keeps this one quick.
    scenario = dataclasses.replace(
        scenario,
        duration_seconds=45.0,
        expect=dataclasses.replace(scenario.expect, metrics=()),
    )
    snapshots: dict[float, Snapshot] = {}

    def seen(t: float, snapshot: Snapshot, body: bytes) -> None:
        snapshots[t] = snapshot

    mine = [d for d in DETECTORS if d.name in ("hangs", "hotplug")]
    with tempfile.TemporaryDirectory(prefix="nodescope-test-", dir=temp_dir()) as d:
        result = replay(scenario, Path(d) / "root", detectors=mine, on_cycle=seen, builders=[])
    return result, snapshots


def test_scenario_expectations_hold(replayed: tuple[Any, dict[float, Snapshot]]) -> None:
    result, snapshots = replayed
    failed = [f"{f.expectation}: {f.reason}" for f in result.findings if not f.passed]
    assert not failed, failed
    assert len(result.findings) == 2  # the stall, and "no other findings"
    stalled = [t for t in range(46) if snapshots[float(t)].findings]
    # The job stops at t=20: t=21 is its first cycle without progress (the rates from 20 to
    # 21), and it is a finding 20 s later, in every cycle after that.
    assert stalled == list(range(41, 46)), stalled
    first = snapshots[41.0].findings[0]
    assert first.evidence["held_seconds"] == 20.0


def test_the_finding_names_lock_holder_and_stalled_job(
    replayed: tuple[Any, dict[float, Snapshot]],
) -> None:
    _, snapshots = replayed
    [finding] = snapshots[45.0].findings
    assert finding.kind == hangs.STORAGE
    assert finding.subjects["job"] == JOB
    assert finding.subjects["holder_job"] == HOLDER_JOB
    assert finding.subjects["lock_mount"] == "/mnt/ckpt"
    assert finding.subjects["lock_inode"] == "4721"
    assert finding.evidence["gpus_idle"] == 8
    assert finding.evidence["lock_waiters"] == 1
    assert finding.evidence["threads_blocked"] == 2
    message = finding.message
    for text in (
        f"job {JOB} stalled on storage",
        "POSIX WRITE lock on /mnt/ckpt (nfs4 ckpt-nfs:/export/ckpt) inode 4721",
        f"(rsync, job {HOLDER_JOB})",
        "D state at rpc_wait_bit_killable",
    ):
        assert text in message, message
    assert finding.subjects["holder_pid"] in message


def test_sources_read_the_nodes_trees(replayed: tuple[Any, dict[float, Snapshot]]) -> None:
    _, snapshots = replayed
    # The lock and the D state start at t=20; the threads, locks and NFS sources run every
    # 10 s as the daemon's do (at t=9, 19, 29 …: a tenth of their interval early), so t=30 is
    # the first cycle after t=20 whose reads of them show it.
    before, after = snapshots[19.0], snapshots[30.0]
    threads = after.latest(THREADS)
    assert threads is not None
    job = threads.job(JOB)
    assert job is not None
    assert {b.wchan for b in job.blocked} == {"rpc_wait_bit_killable"}
    assert {b.comm for b in job.blocked} == {"python3"}
    # Before the lock: nothing blocked anywhere on the node, in jobs or in the host walk.
    threads_before = before.latest(THREADS)
    assert threads_before is not None and threads_before.blocked() == ()
    locks = after.latest(LOCKS)
    assert locks is not None
    [lock] = locks.contended
    assert (lock.holder.comm, lock.kind, lock.inode, lock.mountpoint) == (
        "rsync",
        "POSIX",
        4721,
        "/mnt/ckpt",
    )
    assert lock.is_nfs
    locks_before = before.latest(LOCKS)
    assert locks_before is not None and locks_before.contended == ()
    # The checkpoint writes of the first 20 s, as nfsiostat would show them.

    rates = snapshots[10.0].derived.nfs_rates
    assert isinstance(rates, MountstatsRates)
    ckpt = rates.mount("/mnt/ckpt")
    assert ckpt is not None
    write = ckpt.op("WRITE")
    assert write is not None
    assert write.ops_per_second == pytest.approx(40, rel=0.05)
    assert write.avg_rtt_ms == pytest.approx(1.5, rel=0.05)
    assert write.avg_execute_ms == pytest.approx(2.0, rel=0.05)
    assert write.kilobytes_per_op == pytest.approx(1024, rel=0.01)
    data = snapshots[22.0].latest(MOUNTSTATS)
    assert data is not None and data.mount("/mnt/ckpt") is not None


def _with(snapshot: Snapshot, **data: Any) -> Snapshot:
    """The snapshot with some sources' current data replaced."""
    current = dict(snapshot.current)
    for name, value in data.items():
        current[name] = dataclasses.replace(snapshot.current[name], data=value)
    return dataclasses.replace(snapshot, current=current)


def _without_storage_signals(snapshot: Snapshot) -> Snapshot:
    threads = snapshot.latest(THREADS)
    locks = snapshot.latest(LOCKS)
    assert threads is not None and locks is not None
    calm = dataclasses.replace(
        threads,
        jobs=tuple(dataclasses.replace(j, blocked=()) for j in threads.jobs),
        host_blocked=(),
    )
    return _with(snapshot, threads=calm, locks=dataclasses.replace(locks, contended=()))


def test_idle_without_any_signal_is_a_stall_of_unknown_cause(
    replayed: tuple[Any, dict[float, Snapshot]],
) -> None:
    _, snapshots = replayed
    [finding] = hangs.evaluate(_without_storage_signals(snapshots[22.0]), HANGS)
    assert finding.kind == hangs.UNKNOWN and finding.subjects == {"job": JOB}
    assert "no storage lock" in finding.message


def test_d_state_on_nfs_alone_is_storage(replayed: tuple[Any, dict[float, Snapshot]]) -> None:
    _, snapshots = replayed
    snapshot = snapshots[30.0]  # the first cycle whose threads and locks reads show t=20
    locks = snapshot.latest(LOCKS)
    assert locks is not None
    [finding] = hangs.evaluate(
        _with(snapshot, locks=dataclasses.replace(locks, contended=())), HANGS
    )
    assert finding.kind == hangs.STORAGE
    assert "lock_inode" not in finding.subjects
    assert "rpc_wait_bit_killable" in finding.message


def test_busy_gpus_that_move_nothing_are_a_collective_hang(
    replayed: tuple[Any, dict[float, Snapshot]],
) -> None:
    """Spinning NCCL kernels keep utilisation up while no byte moves: not an idle stall, but
    a collective hang, which names the lock that holds the job."""
    _, snapshots = replayed
    snapshot = snapshots[30.0]  # the first cycle whose threads and locks reads show t=20
    nvml = snapshot.latest(NVML)
    assert nvml is not None
    busy = dataclasses.replace(
        nvml, gpus=tuple(dataclasses.replace(g, gpu_util_percent=100) for g in nvml.gpus)
    )
    [finding] = hangs.evaluate(_with(snapshot, nvml=busy), HANGS)
    assert finding.kind == hangs.COLLECTIVE and finding.severity is Severity.CRITICAL
    assert finding.subjects["job"] == JOB and finding.subjects["holder_job"] == HOLDER_JOB
    assert "no data moves" in finding.message and "waits on POSIX" in finding.message
    # Without the lock and the D-state threads: still a hang, with no blocker to name.
    [unknown] = hangs.evaluate(_without_storage_signals(_with(snapshot, nvml=busy)), HANGS)
    assert unknown.kind == hangs.COLLECTIVE and unknown.severity is Severity.WARNING
    assert unknown.subjects == {"job": JOB}
    # One GPU busy, the others idle, nothing moving: the same.
    one = dataclasses.replace(
        nvml,
        gpus=tuple(
            dataclasses.replace(g, gpu_util_percent=90 if g.index == 3 else 0) for g in nvml.gpus
        ),
    )
    activity = hangs.job_gpu_activity(_with(snapshot, nvml=one))
    assert [a.job_id for a in activity] == [JOB]
    assert activity[0].idle_gpus == (0, 1, 2, 4, 5, 6, 7) and not activity[0].stalled
    assert activity[0].spinning and activity[0].max_utilisation == pytest.approx(0.9)
    assert [f.kind for f in hangs.evaluate(_with(snapshot, nvml=one), HANGS)] == [hangs.COLLECTIVE]


def test_busy_gpus_that_move_data_are_no_hang(
    replayed: tuple[Any, dict[float, Snapshot]],
) -> None:
    _, snapshots = replayed
    # Before the lock: busy GPUs and NVLink, PCIe and InfiniBand traffic.
    assert hangs.evaluate(snapshots[10.0], HANGS) == []
    activity = hangs.job_gpu_activity(snapshots[10.0])
    assert activity and not activity[0].spinning and not activity[0].stalled


def _loader_tree(tree: CgroupTree, pressure: float, read_bytes: int) -> CgroupTree:
    cgroups = []
    for cg in tree.cgroups:
        if cg.name == f"job_{JOB}":
            line = PressureLine(pressure, pressure, pressure, 1_000_000)
            cg = dataclasses.replace(
                cg,
                io_pressure=Pressure(line, line),
                io_stat=IoStat((IoDeviceStat(259, 0, rbytes=read_bytes, wbytes=0),)),
            )
        cgroups.append(cg)
    return dataclasses.replace(tree, cgroups=tuple(cgroups))


@pytest.mark.parametrize(
    ("pressure", "read_per_second", "kind"),
    [
        (45.0, 10e6, hangs.LOADER),  # waiting on I/O that barely moves: starving
        (45.0, 2e9, None),  # the job reads 2 GB/s: progress, neither starving nor stalled
        (5.0, 10e6, hangs.UNKNOWN),  # no pressure
    ],
)
def test_data_loader_starving(
    replayed: tuple[Any, dict[float, Snapshot]],
    pressure: float,
    read_per_second: float,
    kind: str | None,
) -> None:
    _, snapshots = replayed
    snapshot = _without_storage_signals(snapshots[22.0])
    prev_sample = snapshot.previous["cgroups"]
    cur_sample = snapshot.current["cgroups"]
    seconds = cur_sample.monotonic - prev_sample.monotonic
    assert isinstance(cur_sample.data, CgroupTree)
    previous: Mapping[str, SourceSample] = {
        **snapshot.previous,
        "cgroups": dataclasses.replace(
            prev_sample, data=_loader_tree(cur_sample.data, pressure, 10**9)
        ),
    }
    current = {
        **snapshot.current,
        "cgroups": dataclasses.replace(
            cur_sample,
            data=_loader_tree(cur_sample.data, pressure, 10**9 + int(read_per_second * seconds)),
        ),
    }
    changed = dataclasses.replace(snapshot, current=current, previous=previous)
    assert hangs.job_io_bytes_per_second(changed, JOB) == pytest.approx(read_per_second)
    found = hangs.evaluate(changed, HANGS)
    assert [f.kind for f in found] == ([] if kind is None else [kind])
    if kind == hangs.LOADER:
        [finding] = found
        assert finding.evidence["io_pressure_some_avg10_percent"] == pressure
        assert "data loader starving" in finding.message


def test_wchan_classes() -> None:
    assert hangs.wchan_class("rpc_wait_bit_killable") == "nfs"
    assert hangs.wchan_class("nfs4_retry_setlk") == "nfs"
    assert hangs.wchan_class("folio_wait_bit_common") == "filesystem"
    assert hangs.wchan_class("jbd2_log_wait_commit") == "filesystem"
    assert hangs.wchan_class("fcntl_setlk") == "filesystem"
    assert hangs.wchan_class("futex_wait_queue") is None
    assert hangs.wchan_class("uvm_wait") is None
    assert hangs.wchan_class(None) is None


def test_registered_with_alert_rules() -> None:
    from nodescope.detectors.registry import ALERT_RULES

    names = [d.name for d in DETECTORS]
    assert "hangs" in names and "hotplug" in names
    # T of "idle for at least T" is the alert's for.
    assert ALERT_RULES[hangs.STORAGE].for_seconds > 0
    assert ALERT_RULES[hangs.UNKNOWN].for_seconds >= ALERT_RULES[hangs.STORAGE].for_seconds
    disabled = default_config()
    values = {k: dict(v) for k, v in disabled.detectors.values.items()}
    values["hangs"]["enabled"] = False
    off = dataclasses.replace(
        disabled, detectors=dataclasses.replace(disabled.detectors, values=values)
    )
    assert hangs.detect(None, Snapshot(0, 0.0, 0.0), off.detectors.hangs) == []


def test_a_lock_holder_outside_any_job_is_named_by_what_it_is() -> None:
    from nodescope.model.locks import LockParty

    service = LockParty(3017, "python3", "WRITE", "/system.slice/ckpt-sync.service")
    assert hangs._holder_text(service, None) == (
        "pid 3017 (python3) of ckpt-sync.service, not a job"
        " (cgroup /system.slice/ckpt-sync.service)"
    )
    plain = LockParty(3017, "python3", "WRITE", "/")
    assert hangs._holder_text(plain, None) == "pid 3017 (python3) in cgroup /, not a job"
    unknown = LockParty(3017, None, "WRITE")
    assert hangs._holder_text(unknown, None) == "pid 3017 (?, not a job)"
    # A job's process is named by its job, whatever its cgroup.
    assert hangs._holder_text(service, "81761") == "pid 3017 (python3, job 81761)"


def test_a_collective_hang_counts_busy_and_idle_gpus_apart_and_names_a_gone_rank() -> None:
    from nodescope.model.jobs import DepartedRank

    activity = hangs.JobGpuActivity(
        job_id="81840",
        gpus=(0, 1, 2, 3),
        mean_utilisation=0.75,
        max_utilisation=1.0,
        pcie_bytes_per_second=0.0,
        nvlink_bytes_per_second=0.0,
        idle_gpus=(3,),
        lost_gpus=(),
        quiet_gpus=(0, 1, 2, 3),
    )
    assert activity.spinning
    finding = hangs._collective_finding(activity, None)
    assert "GPUs 0,1,2 busy, GPU 3 idle (75% mean utilisation)" in finding.message
    assert (finding.evidence["gpus_busy"], finding.evidence["gpus_idle"]) == (3.0, 1.0)
    gone = [DepartedRank("81840", 4242, "python3", (7,), 100.0)]
    with_rank = hangs._collective_finding(activity, None, gone, 125.0, oom_kills=None)
    assert "rank gone: pid 4242 (python3) on GPU 7 exited 25 s ago (status unknown)" in (
        with_rank.message
    )
    assert with_rank.evidence["ranks_gone"] == 1.0 and with_rank.evidence["gone_pid"] == 4242.0
    oom = hangs._collective_finding(activity, None, gone, 125.0, oom_kills=1)
    assert "the job's cgroup counts 1 OOM kill(s) in memory.events" in oom.message


def test_a_gone_rank_is_named_with_how_it_ended_only_where_pid_and_name_match() -> None:
    from nodescope.model.jobs import DepartedRank
    from nodescope.model.sxid import ProcessEnd

    activity = hangs.JobGpuActivity(
        job_id="81840",
        gpus=(0, 1, 2),
        mean_utilisation=1.0,
        max_utilisation=1.0,
        pcie_bytes_per_second=0.0,
        nvlink_bytes_per_second=0.0,
        idle_gpus=(2,),
        lost_gpus=(),
        quiet_gpus=(0, 1, 2),
    )
    gone = [DepartedRank("81840", 4242, "python", (2,), 100.0)]
    segfault = {4242: ProcessEnd(4242, "python", "SIGSEGV", "segfault", 5_000_000)}
    named = hangs._collective_finding(activity, None, gone, 112.0, None, segfault)
    assert (
        "rank gone: pid 4242 (python) on GPU 2 ended 12 s ago: SIGSEGV (segfault, kernel log)"
        in (named.message)
    )
    oom = {4242: ProcessEnd(4242, "python", "SIGKILL", "OOM-killed")}
    assert "ended 12 s ago: SIGKILL (OOM-killed, kernel log)" in (
        hangs._collective_finding(activity, None, gone, 112.0, None, oom).message
    )
    # The same pid under another name (a reused pid, a record of another task) proves nothing.
    other = {4242: ProcessEnd(4242, "bash", "SIGSEGV", "segfault")}
    for ended in (other, {4243: ProcessEnd(4243, "python", "SIGSEGV", "segfault")}, {}):
        text = hangs._collective_finding(activity, None, gone, 112.0, None, ended).message
        assert "pid 4242 (python) on GPU 2 exited 12 s ago (status unknown)" in text
        assert "kernel log" not in text
    # A rank whose name the job registry never saw is never matched on its pid alone.
    nameless = [DepartedRank("81840", 4242, None, (2,), 100.0)]
    text = hangs._collective_finding(activity, None, nameless, 112.0, None, segfault).message
    assert "(status unknown)" in text and "SIGSEGV" not in text


@pytest.mark.slow  # a whole scenario replayed
def test_the_bundled_rank_died_scenario_names_the_signal_from_its_kernel_log(
    tmp_path: Path,
) -> None:
    """The simulated node logs the kernel's segfault record of the rank it kills; the hang's
    message names it from there, through the sxid source's read of ``dev/kmsg``."""
    from nodescope.sim.driver import replay, replay_document
    from nodescope.sim.scenario import load_scenario

    doc = replay_document(replay(load_scenario("collective-hang-rank-died"), tmp_path / "root"))
    hangs_seen = [e["text"] for e in doc["timeline"] if "collective_hang" in e["subject"]]
    assert hangs_seen, doc["timeline"]
    assert re.search(
        r"rank gone: pid [0-9]+ \(python3\) on GPU 7 ended [0-9]+ s ago: SIGSEGV \(segfault,"
        r" kernel log\)",
        hangs_seen[0],
    ), hangs_seen[0]


def test_the_nodes_io_full_stall_is_evidence_of_a_storage_stall(
    replayed: tuple[Any, dict[float, Snapshot]],
) -> None:
    _, snapshots = replayed
    snapshot = snapshots[45.0]

    def node(full_usec: int) -> NodePressure:
        line = PressureLine(0.0, 0.0, 0.0, 0)
        return NodePressure(
            cpu=None,
            memory=None,
            io=Pressure(line, dataclasses.replace(line, total_usec=full_usec)),
        )

    # Read 5 s apart: 4 s of every task on the node waiting on IO.
    with_pressure = dataclasses.replace(
        snapshot,
        current={
            **snapshot.current,
            "pressure": SourceSample("pressure", 45.0, 0.0, node(9_000_000)),
        },
        previous={
            **snapshot.previous,
            "pressure": SourceSample("pressure", 40.0, 0.0, node(5_000_000)),
        },
    )
    # A snapshot rebuilt has no memory of how long the stall held: judged at once here.
    at_once = from_mapping({"detectors": {"hangs": {"min_stall_seconds": 0}}})
    [finding] = hangs.detect(snapshots[44.0], with_pressure, at_once.detectors.hangs)
    assert finding.kind == hangs.STORAGE
    assert finding.evidence["node_io_full_stall_ratio"] == 0.8
    [alone] = hangs.detect(snapshots[44.0], dataclasses.replace(snapshot), at_once.detectors.hangs)
    # The same finding otherwise (how long it held aside, which the rebuilt snapshot forgot).
    extra = {k: v for k, v in finding.evidence.items() if k not in alone.evidence}
    assert extra == {"node_io_full_stall_ratio": 0.8}
    assert (finding.subjects, finding.message) == (alone.subjects, alone.message)
