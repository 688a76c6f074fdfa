"""The threads source: task stat and wchan parsers, job threads every run, the host walk every
N runs, the capture of this host."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.errors import ParseError
from nodescope.roots import Roots
from nodescope.sources.cgroup import read_tree
from nodescope.sources.threads import (
    BlockedThread,
    TaskStat,
    ThreadsSource,
    job_pids,
    make_source,
    parse_stat,
    parse_stat_summary,
    parse_wchan,
    read_process_threads,
)

HOST = Path(__file__).parent.parent / "fixtures" / "hosts" / "kvm-epyc-debian12"

# fs/proc/array.c do_task_stat: 52 fields; a name with a space and a parenthesis.
STAT = (
    "2147 (NCCL (Progress) 0) D 2146 2146 1 0 -1 4194624 10 0 0 0 1234 56 0 0 20 0 15 0"
    " 8640000 1000000 200 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 3 0 0 0 0 0 0 0 0 0"
    " 0 0 0 0\n"
)


def test_parse_stat_splits_at_the_last_parenthesis() -> None:
    assert parse_stat(STAT) == TaskStat(2147, "NCCL (Progress) 0", "D", 2146, 1234, 56)


@pytest.mark.parametrize(
    "text",
    [
        "2147 NCCL D 1 1 1 0 -1 0 0 0 0 0 1 2\n",  # no parentheses
        "x (a) D 1 1 1 0 -1 0 0 0 0 0 1 2\n",
        "1 (a) Q 1 1 1 0 -1 0 0 0 0 0 1 2\n",  # no such state
        "1 (a) DD 1 1 1 0 -1 0 0 0 0 0 1 2\n",
        "1 (a) D 1 1 1 0 -1 0 0 0 0 0 1\n",  # too short
        "1 (a) D 1 1 1 0 -1 0 0 0 0 0 x 2\n",
        STAT * 2,  # two lines run together: a "name" longer than the kernel prints
        "1 (a) D 1 1 1 0 -1 0 0 0 0 0 1 2\n2 S 1 1 1 0 -1 0 0 0 0 0 1 2\n",
    ],
)
def test_parse_stat_rejects(text: str) -> None:
    with pytest.raises(ParseError) as err:
        parse_stat(text, "stat")
    assert err.value.source == "stat"


@pytest.mark.parametrize(
    "comm",
    [
        "x\ny) R 1",  # prctl(PR_SET_NAME): any user can name a process this
        "a) D 1 1 1 0 -1",
        ") (",
        "\n",
        "",
        " (x) ",
        "\ufffd\ufffd",  # bytes that are not UTF-8, replaced
    ],
)
def test_parse_stat_takes_any_name_the_kernel_prints(comm: str) -> None:
    """The kernel prints a task's name raw in ``stat`` (``proc_task_name(m, task, false)``):
    the name runs to the last ``)``, whatever it holds."""
    text = _stat(4242, comm, "S")
    assert parse_stat(text) == TaskStat(4242, comm, "S", 1, 10, 20)
    assert parse_stat_summary(_process_stat(4242, comm, "D", 7)) == (comm, "D", 7)


def test_parse_wchan() -> None:
    assert parse_wchan("rpc_wait_bit_killable") == "rpc_wait_bit_killable"
    assert parse_wchan("0") is None
    assert parse_wchan("") is None
    with pytest.raises(ParseError):
        parse_wchan("two words")


def _stat(tid: int, comm: str, state: str) -> str:
    return f"{tid} ({comm}) {state} 1 {tid} {tid} 0 -1 0 0 0 0 0 10 20 0 0 20 0 1 0 5 0 0\n"


def _tree(base: Path) -> Roots:
    """A job (job_7: pids 100, 101) with a thread in D, a D thread outside any job (pid 200),
    and a job pid that exited between the cgroup listing and the read (pid 102)."""
    cg = base / "sys" / "fs" / "cgroup"
    step = cg / "system.slice" / "slurmstepd.scope" / "job_7" / "step_0" / "user" / "task_0"
    step.mkdir(parents=True)
    (cg / "cgroup.controllers").write_text("cpu io memory pids\n")
    (step / "cgroup.procs").write_text("100\n101\n102\n")
    proc = base / "proc"
    threads = {
        100: [(100, "python3", "R"), (103, "pt_autograd_0", "S"), (104, "ckpt", "D")],
        101: [(101, "python3", "S")],
        200: [(200, "rsync", "D")],
        1: [(1, "systemd", "S")],
    }
    for pid, tasks in threads.items():
        for tid, comm, state in tasks:
            task = proc / str(pid) / "task" / str(tid)
            task.mkdir(parents=True)
            (task / "stat").write_text(_stat(tid, comm, state))
            (task / "wchan").write_text("nfs_wait_bit_killable" if state == "D" else "0")
    return Roots.under(base)


def test_job_threads_and_host_walk(tmp_path: Path) -> None:
    roots = _tree(tmp_path)
    source = ThreadsSource(host_every=3)
    first = source.collect(roots)
    [job] = first.jobs
    assert (job.job_id, job.processes, job.threads) == ("7", 2, 4)
    assert job.states == (("D", 1), ("R", 1), ("S", 2))
    assert job.count("D") == 1 and job.count("Z") == 0
    assert job.blocked == (BlockedThread(100, 104, "ckpt", "nfs_wait_bit_killable", "7"),)
    # The first run walks the host too; the job's D thread is tagged with its job there.
    assert first.host_age_runs == 0 and first.host_threads == 6
    assert {(b.pid, b.job_id) for b in first.host_blocked} == {(100, "7"), (200, None)}
    assert [b.tid for b in first.blocked()] == [104, 200]

    # The rsync leaves D; the jobs see it at once, the host walk only every third run.
    (roots.procfs / "200" / "task" / "200" / "stat").write_text(_stat(200, "rsync", "S"))
    second = source.collect(roots)
    assert second.host_age_runs == 1
    assert [b.pid for b in second.host_blocked] == [100, 200]
    third = source.collect(roots)
    assert third.host_age_runs == 2
    fourth = source.collect(roots)
    assert fourth.host_age_runs == 0
    assert [b.pid for b in fourth.host_blocked] == [100]
    source.close()
    assert make_source().name == "threads"


def test_wchan_read_only_for_d_threads(tmp_path: Path) -> None:
    roots = _tree(tmp_path)
    # An unreadable wchan of a sleeping thread costs nothing, as it is never read.
    (roots.procfs / "100" / "task" / "103" / "wchan").unlink()
    stats, blocked = read_process_threads(roots, 100, "7")
    assert [s.tid for s in stats] == [100, 103, 104]
    assert [b.tid for b in blocked] == [104]
    assert read_process_threads(roots, 999, None) == ([], [])


def test_no_cgroup_hierarchy_means_no_jobs(tmp_path: Path) -> None:
    roots = _tree(tmp_path)
    (roots.cgroupfs / "cgroup.controllers").unlink()
    data = ThreadsSource().collect(roots)
    assert data.jobs == () and data.host_threads == 6


def test_capture_of_this_host() -> None:
    """scripts/capture/hangs.sh: flock(1) waiting for a lock sleeps interruptibly (S)."""
    flock = [p for p in (HOST / "proc").iterdir() if (p / "comm").is_file()
             and (p / "comm").read_text() == "flock\n"]  # fmt: skip
    assert flock
    stats, blocked = read_process_threads(Roots.under(HOST), int(flock[0].name), None)
    assert [(s.comm, s.state) for s in stats] == [("flock", "S")]
    assert blocked == []
    wchan = (flock[0] / "task" / flock[0].name / "wchan").read_text()
    assert parse_wchan(wchan) == "locks_lock_inode_wait"


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_parse_stat_fuzz(text: str) -> None:
    with contextlib.suppress(ParseError):
        parse_stat(text)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 2**40),
    st.text(max_size=20),
    st.sampled_from([*"RSDTtZIXQ", "", "DD"]),
    st.lists(st.sampled_from(["0", "-1", "12", "x", "18446744073709551615"]), max_size=20),
)
def test_parse_stat_fuzz_structured(tid: int, comm: str, state: str, rest: list[str]) -> None:
    text = f"{tid} ({comm}) {state} {' '.join(rest)}\n"
    try:
        stat = parse_stat(text)
    except ParseError:
        return
    assert stat.tid == tid
    # An empty state lets the next field stand in for it; else it is the one given.
    assert stat.state == (state or rest[0])


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_parse_wchan_fuzz(text: str) -> None:
    with contextlib.suppress(ParseError):
        parse_wchan(text)


# ---------------------------------------------------------------------------------------------
# /proc/<pid>/stat first: one read for a process with one thread


def test_parse_stat_summary() -> None:
    assert parse_stat_summary(STAT) == ("NCCL (Progress) 0", "D", 15)
    for bad in ("", "1 (a) S 1 2\n", "1 (a) Y" + " 0" * 20, "x (a) S" + " 0" * 20, STAT * 2):
        with pytest.raises(ParseError):
            parse_stat_summary(bad)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_parse_stat_summary_fuzz(text: str) -> None:
    with contextlib.suppress(ParseError):
        parse_stat_summary(text)


def _process_stat(pid: int, comm: str, state: str, threads: int) -> str:
    fields = _stat(pid, "", state).split()
    fields[1] = f"({comm})"
    fields[19] = str(threads)  # num_threads, field 20
    return " ".join(fields) + "\n"


def test_a_process_with_one_thread_costs_one_read(tmp_path: Path) -> None:
    roots = _tree(tmp_path)
    expected = ThreadsSource().collect(roots)
    (roots.procfs / "200" / "stat").write_text(_process_stat(200, "rsync", "D", 1))
    (roots.procfs / "101" / "stat").write_text(_process_stat(101, "python3", "S", 1))
    # Several threads: each thread's own line counts, not the leader's state.
    (roots.procfs / "100" / "stat").write_text(_process_stat(100, "python3", "S", 3))
    (roots.procfs / "1" / "stat").write_text(_process_stat(1, "systemd", "S", 1))
    assert ThreadsSource().collect(roots) == expected
    # The one-thread processes' task/ directories are not read any more.
    for pid in (200, 101, 1):
        (roots.procfs / str(pid) / "task" / str(pid) / "stat").unlink()
    assert ThreadsSource().collect(roots) == expected


def test_slow_every_sets_the_host_walk_cadence(tmp_path: Path) -> None:
    roots = _tree(tmp_path)
    source = make_source()
    assert source.slow_every == source.host_every == 10
    source.slow_every = 1
    assert [source.collect(roots).host_age_runs for _ in range(3)] == [0, 0, 0]
    with pytest.raises(ValueError):
        source.slow_every = 0


def test_job_pids_from_the_cgroups_walk(tmp_path: Path) -> None:
    roots = _tree(tmp_path)
    tree = read_tree(roots, keep_pids=True)
    assert job_pids(roots, tree) == job_pids(roots) == {"7": (100, 101, 102)}


# ---------------------------------------------------------------------------------------------
# One bad process or thread is skipped and counted, never fatal


def test_unreadable_and_unparsable_tasks_are_counted(tmp_path: Path) -> None:
    """A FIFO where a thread's ``stat`` should be (refused, never waited on), a directory in
    place of a process's ``stat``, a junk line and a ``wchan`` that is not a symbol: each
    costs its own thread or field, counted by reason."""
    roots = _tree(tmp_path)
    task = roots.procfs / "100" / "task"
    (task / "103" / "stat").unlink()
    os.mkfifo(task / "103" / "stat")
    (task / "104" / "wchan").write_text("two words")
    (roots.procfs / "101" / "stat").mkdir()
    (roots.procfs / "101" / "task" / "101" / "stat").write_text("101 (python3) S\n")
    data = ThreadsSource().collect(roots)
    [job] = data.jobs
    assert (job.processes, job.threads) == (1, 2)
    assert job.blocked == (BlockedThread(100, 104, "ckpt", None, "7"),)
    # Each record is counted where it was read: in the job, and again by the host walk.
    assert dict(data.skipped.counts) == {
        "stat_unreadable": 4,
        "stat_unparsable": 2,
        "wchan_unparsable": 2,
    }
    assert data.skipped.examples["stat_unparsable"] == "101 (python3) S\\n"


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_a_stat_that_parses_holds_what_the_kernel_prints(text: str) -> None:
    try:
        comm, state, threads = parse_stat_summary(text)
    except ParseError:
        return
    assert len(comm) <= 63 and len(state) == 1 and state in "RSDTtXZPIWxKw" and threads >= 0


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=200))
def test_any_stat_file_never_takes_the_source_down(
    tmp_path_factory: pytest.TempPathFactory, text: str
) -> None:
    roots = _tree(tmp_path_factory.mktemp("fuzz"))
    (roots.procfs / "100" / "task" / "103" / "stat").write_text(text)
    data = ThreadsSource().collect(roots)
    [job] = data.jobs
    counted = sum(data.skipped.counts.values())
    assert job.threads + counted // 2 == 4  # the job and the host walk each read it once
