"""Thread states and wait channels: the jobs' threads every run, the whole host now and then.

Reads, under the injected roots (``docs/datasources.md`` §6):

* the Slurm job cgroups (``.../job_<id>/``, found as :mod:`nodescope.sources.job_cgroups`
  finds them) and
  their ``cgroup.procs``: which processes belong to which job;
* ``<procfs>/<pid>/stat`` of those processes (the same line for the whole process: the
  leader's state and, in field 20, ``num_threads``): a process with one thread needs nothing
  more, as its one thread is the leader;
* ``<procfs>/<pid>/task/<tid>/stat`` of every thread of the processes with several
  (``fs/proc/array.c`` ``do_task_stat``): ``tid (comm) state ppid …`` — split at the **last**
  ``)``, as the name may hold spaces and parentheses. ``/proc/<pid>/stat`` shows only the
  thread-group leader, so a rank whose main thread runs while its checkpoint thread sleeps
  in ``D`` looks healthy there;
* ``<procfs>/<pid>/task/<tid>/wchan`` (``fs/proc/base.c`` ``proc_pid_wchan``: the kernel
  symbol the thread sleeps in, or ``0``) only for threads in ``D`` state: a sleeping ``S``
  thread's wait channel says nothing a hang diagnosis needs, and each read costs a symbol
  lookup in the kernel.

The job cgroups' ``cgroup.procs`` come from the walk of the cgroup tree when the cycle has one
(:class:`~nodescope.sources.cgroup.CycleWalk`). Every
:attr:`ThreadsSource.host_every` runs (and on the first) it also walks every process
of the host, to find ``D`` threads outside jobs (a stuck ``rsync``, a kernel flusher); in
between, the last host walk's result is carried along with its age in runs.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from nodescope.errors import ParseError
from nodescope.fileio import CGROUP_LIST, PROC_PROCESS, FileKind
from nodescope.model.skips import SkipTally
from nodescope.model.threads import THREADS, BlockedThread, JobThreads, TaskStat, ThreadsData
from nodescope.roots import Roots
from nodescope.sources.base import read_text
from nodescope.sources.cgroup import CgroupTree, CycleWalk, find_v2_root
from nodescope.sources.job_cgroups import find_job_dirs, job_members, parse_pids
from nodescope.sources.spec import SourceSpec

NAME = THREADS.name

#: Task states of ``fs/proc/array.c`` ``task_state_array`` (and ``W``/``x``/``K``/``w`` of
#: older kernels).
STATES = frozenset("RSDTtXZPIWxKw")
#: Blocked threads kept per job and for the host, so a node-wide hang cannot bloat the record.
MAX_BLOCKED = 256
#: Default: the whole host is walked every this many runs.
HOST_EVERY = 10
#: Longest name a ``stat`` line can hold: ``proc_task_name`` prints a task's name from a
#: 64-byte buffer (15 bytes for a name a process sets itself, ``TASK_COMM_LEN``; more for a
#: kernel thread or a workqueue worker), decoded to at most as many characters.
MAX_COMM = 63

_PID = re.compile(r"[0-9]{1,10}")
_NUMBER = re.compile(r"-?[0-9]{1,20}")

#: Why a thread or process was skipped (the ``reason`` of
#: ``nodescope_source_records_skipped_total``): its ``stat`` did not parse, or could not be
#: read for another reason than its exit; its ``wchan`` was not a symbol; a job's
#: ``cgroup.procs`` could not be read.
STAT_UNPARSABLE = "stat_unparsable"
STAT_UNREADABLE = "stat_unreadable"
WCHAN_UNPARSABLE = "wchan_unparsable"
CGROUP_UNREADABLE = "cgroup_unreadable"


# --- parsers (pure) -------------------------------------------------------------------------


def _split_comm(text: str, source: str) -> tuple[str, str, str]:
    """(pid, comm, the fields after comm) of a ``stat`` line as ``do_task_stat`` prints it:
    ``pid (comm) state ...``. The name is any bytes but NUL a process chose
    (``prctl(PR_SET_NAME)``, ``/proc/<pid>/comm``): spaces, parentheses, newlines. It runs
    from the first ``(`` to the **last** ``)``, as the fields after it are numbers and one
    state letter, never a ``)``."""
    line = text[:-1] if text.endswith("\n") else text
    open_paren = line.find(" (")
    close_paren = line.rfind(")")
    if open_paren < 0 or close_paren < open_paren:
        raise ParseError(source, "no '(comm)' field", 1)
    if close_paren - open_paren - 2 > MAX_COMM:
        # Longer than any name the kernel prints: not one stat line (two run together).
        raise ParseError(source, f"a name of more than {MAX_COMM} characters", 1)
    pid_text = line[:open_paren]
    if not _PID.fullmatch(pid_text):
        raise ParseError(source, f"not a pid: {pid_text!r}", 1)
    tail = line[close_paren + 1 :]
    if "\n" in tail:
        raise ParseError(source, "more than one line after the name", 2)
    return pid_text, line[open_paren + 2 : close_paren], tail


def _state(token: str, source: str) -> str:
    if len(token) != 1 or token not in STATES:
        raise ParseError(source, f"unknown task state {token!r}", 1)
    return token


def parse_stat(text: str, source: str = "/proc/self/stat") -> TaskStat:
    """One ``/proc/<pid>[/task/<tid>]/stat`` line."""
    tid_text, comm, tail = _split_comm(text, source)
    rest = tail.split(maxsplit=13)
    # state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt utime stime
    if len(rest) < 13:
        raise ParseError(source, f"{len(rest)} fields after the name, expected at least 13", 1)
    state = _state(rest[0], source)
    numbers = []
    for position in (1, 11, 12):
        token = rest[position]
        if not _NUMBER.fullmatch(token):
            raise ParseError(source, f"field {position + 3}: not an integer: {token!r}", 1)
        numbers.append(int(token))
    ppid, utime, stime = numbers
    return TaskStat(int(tid_text), comm, state, ppid, utime, stime)


def parse_wchan(text: str, source: str = "wchan") -> str | None:
    """``/proc/<pid>/wchan``: a kernel symbol, or ``0`` (not sleeping, no KALLSYMS, or no
    ptrace-read access) → ``None``. No newline is printed."""
    symbol = text.strip()
    if not symbol or symbol == "0":
        return None
    if any(c.isspace() for c in symbol) or not symbol.isprintable():
        raise ParseError(source, f"not a kernel symbol: {symbol!r}", 1)
    return symbol


def parse_stat_summary(text: str, source: str = "/proc/self/stat") -> tuple[str, str, int]:
    """(comm, state, num_threads) of a ``/proc/<pid>/stat`` line: the process's name, the
    state of its leader thread and how many threads it has (field 20)."""
    _, comm, tail = _split_comm(text, source)
    # Only up to field 20 is split: the 32 fields after it are not needed.
    rest = tail.split(maxsplit=18)
    if len(rest) < 18:
        raise ParseError(source, f"{len(rest)} fields after the name, expected at least 18", 1)
    state = _state(rest[0], source)
    threads = rest[17]
    if not threads.isdigit() or not threads.isascii():
        raise ParseError(source, f"field 20: not a thread count: {threads!r}", 1)
    return comm, state, int(threads)


# --- readers (IO) ---------------------------------------------------------------------------


def _numeric_entries(path: Path | str) -> list[int]:
    try:
        with os.scandir(path) as it:
            return sorted(int(e.name) for e in it if _PID.fullmatch(e.name))
    except OSError:
        return []


def _read_task_file(path: str, kind: FileKind, tally: SkipTally, unreadable: str) -> str | None:
    """The text of a ``/proc`` file of one task; ``None`` when the task has exited (``ENOENT``
    at the open, ``ESRCH`` at the read) or, counted as ``unreadable``, when it cannot be read
    for another reason (refused, over its cap)."""
    try:
        return read_text(path, kind)
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        tally.skip(unreadable, path)
        return None


def _parsed_stat(text: str, path: str, tally: SkipTally) -> TaskStat | None:
    try:
        return parse_stat(text, path)
    except ParseError:
        tally.skip(STAT_UNPARSABLE, text)
        return None


def _wchan(path: str, tally: SkipTally) -> str | None:
    """The wait channel at ``path``; ``None`` (and counted) when it is not a symbol: the
    thread is still reported, without it."""
    text = _read_task_file(path, PROC_PROCESS, tally, STAT_UNREADABLE)
    if text is None:
        return None
    try:
        return parse_wchan(text, path)
    except ParseError:
        tally.skip(WCHAN_UNPARSABLE, text)
        return None


def read_process_threads(
    roots: Roots, pid: int, job_id: str | None, tally: SkipTally | None = None
) -> tuple[list[TaskStat], list[BlockedThread]]:
    """Every thread of ``pid`` (none if it exited), and those in ``D`` with their wchan; a
    thread whose ``stat`` cannot be read or parsed is counted in ``tally`` and left out."""
    tally = SkipTally() if tally is None else tally
    # String paths: a host walk reads one stat file per thread of the node, and a Path per
    # file costs more than reading it.
    task_dir = f"{roots.procfs}/{pid}/task"
    stats: list[TaskStat] = []
    blocked: list[BlockedThread] = []
    for tid in _numeric_entries(task_dir):
        stat_path = f"{task_dir}/{tid}/stat"
        text = _read_task_file(stat_path, PROC_PROCESS, tally, STAT_UNREADABLE)
        stat = None if text is None else _parsed_stat(text, stat_path, tally)
        if stat is None:
            continue
        stats.append(stat)
        if stat.state == "D":
            wchan = _wchan(f"{task_dir}/{tid}/wchan", tally)
            blocked.append(BlockedThread(pid, tid, stat.comm, wchan, job_id))
    return stats, blocked


def count_process_threads(
    procfs: str,
    pid: int,
    job_id: str | None,
    states: Counter[str],
    blocked: list[BlockedThread],
    tally: SkipTally,
) -> int:
    """Count the states of ``pid``'s threads into ``states`` and add its ``D`` threads to
    ``blocked``; the number of threads (0: the process is gone or was skipped).

    ``/proc/<pid>/stat`` comes first: for a process with one thread its state is that
    thread's, so only the processes with several threads cost a ``task/`` listing and a read
    per thread (most processes of a node have one). A ``stat`` that cannot be read or parsed
    skips that process or thread, counted in ``tally``: any user names their own processes.
    """
    stat_path = f"{procfs}/{pid}/stat"
    text = _read_task_file(stat_path, PROC_PROCESS, tally, STAT_UNREADABLE)
    if text is not None:
        try:
            comm, state, count = parse_stat_summary(text, stat_path)
        except ParseError:
            tally.skip(STAT_UNPARSABLE, text)
            return 0
        if count == 1:
            states[state] += 1
            if state == "D":
                wchan = _wchan(f"{procfs}/{pid}/task/{pid}/wchan", tally)
                blocked.append(BlockedThread(pid, pid, comm, wchan, job_id))
            return 1
    task_dir = f"{procfs}/{pid}/task"
    threads = 0
    for tid in _numeric_entries(task_dir):
        path = f"{task_dir}/{tid}/stat"
        thread_text = _read_task_file(path, PROC_PROCESS, tally, STAT_UNREADABLE)
        stat = None if thread_text is None else _parsed_stat(thread_text, path, tally)
        if stat is None:
            continue
        threads += 1
        states[stat.state] += 1
        if stat.state == "D":
            wchan = _wchan(f"{task_dir}/{tid}/wchan", tally)
            blocked.append(BlockedThread(pid, tid, stat.comm, wchan, job_id))
    return threads


def _job_procs_files(root: str, tally: SkipTally) -> list[tuple[str, list[str]]]:
    """(job id, the ``cgroup.procs`` paths of its cgroups) of every ``job_<id>`` cgroup, as
    :func:`~nodescope.sources.job_cgroups.find_job_dirs` finds them; a cgroup that cannot be
    listed is counted in ``tally`` (its own ``cgroup.procs`` is still tried)."""
    found: list[tuple[str, list[str]]] = []
    for job, job_dir in find_job_dirs(root):
        files: list[str] = []
        queue = [job_dir]
        while queue:
            directory = queue.pop()
            files.append(f"{directory}/cgroup.procs")
            try:
                with os.scandir(directory) as entries:
                    queue.extend(e.path for e in entries if e.is_dir(follow_symlinks=False))
            except FileNotFoundError:
                continue  # removed since its parent was listed
            except OSError:
                tally.skip(CGROUP_UNREADABLE, directory)
        found.append((job, files))
    return found


def job_pids(
    roots: Roots, tree: CgroupTree | None = None, tally: SkipTally | None = None
) -> dict[str, tuple[int, ...]]:
    """job id → the pids of every cgroup below the job's cgroup; from ``tree`` (a whole walk
    with the id lists) when given. A ``cgroup.procs`` that cannot be read, or a line of it
    that is not a pid, is counted in ``tally``; the job keeps the pids that were read."""
    if tree is not None:
        return {job: pids for job, _, pids in job_members(tree)}
    tally = SkipTally() if tally is None else tally
    hierarchy = find_v2_root(roots.cgroupfs)
    if hierarchy.path is None:
        return {}
    out: dict[str, set[int]] = {}
    for job, files in _job_procs_files(str(hierarchy.path), tally):
        pids = out.setdefault(job, set())
        for path in files:
            text = _read_task_file(path, CGROUP_LIST, tally, CGROUP_UNREADABLE)
            if text is not None:
                pids.update(parse_pids(text, path, tally))
    return {job: tuple(sorted(pids)) for job, pids in out.items()}


def _job_threads(roots: Roots, job: str, pids: Iterable[int], tally: SkipTally) -> JobThreads:
    states: Counter[str] = Counter()
    blocked: list[BlockedThread] = []
    processes = 0
    procfs = str(roots.procfs)
    for pid in pids:
        if count_process_threads(procfs, pid, job, states, blocked, tally):
            processes += 1
    return JobThreads(
        job_id=job,
        processes=processes,
        threads=sum(states.values()),
        states=tuple(sorted(states.items())),
        blocked=tuple(blocked[:MAX_BLOCKED]),
    )


def read_host_blocked(
    roots: Roots, job_of: dict[int, str], tally: SkipTally | None = None
) -> tuple[int, tuple[BlockedThread, ...]]:
    """(threads on the host, its ``D`` threads) from a walk of every process; processes and
    threads skipped are counted in ``tally``."""
    tally = SkipTally() if tally is None else tally
    threads = 0
    blocked: list[BlockedThread] = []
    states: Counter[str] = Counter()
    procfs = str(roots.procfs)
    for pid in _numeric_entries(procfs):
        stuck: list[BlockedThread] = []
        threads += count_process_threads(procfs, pid, job_of.get(pid), states, stuck, tally)
        if len(blocked) < MAX_BLOCKED:
            blocked.extend(stuck[: MAX_BLOCKED - len(blocked)])
    return threads, tuple(blocked)


def _job_order(job: str) -> tuple[int, str]:
    return (int(job), job) if job.isdigit() else (1 << 62, job)


class ThreadsSource:
    """Jobs every run; the whole host on the first run and every ``host_every`` runs (also
    settable as ``slow_every``). The job pids come from the cgroup walk of the cycle when a
    source that needs the whole tree runs in it
    (:meth:`~nodescope.sources.cgroup.CycleWalk.if_shared`), else from the jobs'
    ``cgroup.procs``."""

    name = NAME

    def __init__(self, host_every: int = HOST_EVERY, walk: CycleWalk | None = None) -> None:
        if host_every < 1:
            raise ValueError("host_every must be at least 1")
        self.host_every = host_every
        self.walk = CycleWalk() if walk is None else walk
        self._runs = 0
        self._host: tuple[int, tuple[BlockedThread, ...]] | None = None
        self._host_run = 0

    @property
    def slow_every(self) -> int:
        return self.host_every

    @slow_every.setter
    def slow_every(self, value: int) -> None:
        if value < 1:
            raise ValueError("slow_every must be at least 1")
        self.host_every = value

    def collect(self, roots: Roots) -> ThreadsData:
        # One tally per run: a host walk's skips count in the run that walked, not again in
        # the runs that carry its result along.
        tally = SkipTally()
        pids = job_pids(roots, self.walk.if_shared(roots), tally)
        jobs = tuple(
            _job_threads(roots, job, pids[job], tally) for job in sorted(pids, key=_job_order)
        )
        if self._host is None or self._runs - self._host_run >= self.host_every:
            job_of = {pid: job for job, members in pids.items() for pid in members}
            self._host = read_host_blocked(roots, job_of, tally)
            self._host_run = self._runs
        age = self._runs - self._host_run
        self._runs += 1
        return ThreadsData(jobs, self._host[0], self._host[1], age, tally.freeze())

    def close(self) -> None:
        self._host = None
        self._runs = 0


def make_source(walk: CycleWalk | None = None) -> ThreadsSource:
    """The source; ``walk``: the cgroup walk it shares with the other cgroup sources."""
    return ThreadsSource(walk=walk)


SPEC = SourceSpec(
    name="threads",
    default_interval=10.0,
    help="job threads (task/*/stat) every run, all threads every 10th; wchan of D threads",
    build=lambda inputs: make_source(inputs.cgroup_walk),
    rates=None,
    metric_area="nodescope_exporters.event_metrics",
    sim_parts=frozenset({"processes", "cgroups"}),
)


__all__ = [
    "CGROUP_UNREADABLE",
    "HOST_EVERY",
    "MAX_BLOCKED",
    "MAX_COMM",
    "NAME",
    "STATES",
    "STAT_UNPARSABLE",
    "STAT_UNREADABLE",
    "THREADS",
    "WCHAN_UNPARSABLE",
    "BlockedThread",
    "JobThreads",
    "TaskStat",
    "ThreadsData",
    "ThreadsSource",
    "count_process_threads",
    "job_pids",
    "make_source",
    "parse_stat",
    "parse_stat_summary",
    "parse_wchan",
    "read_host_blocked",
    "read_process_threads",
]
