"""Thread states and wait channels of the jobs and the host: the ``threads`` source's records.

Built by ``sources/threads.py`` from ``/proc/<pid>/stat`` and ``/proc/<pid>/task/<tid>/stat``
(``fs/proc/array.c`` ``do_task_stat``) of the jobs' processes every run and of every process
of the host now and then, with the ``wchan`` of the threads in ``D`` state
(``docs/datasources.md`` §6).
"""

from __future__ import annotations

from dataclasses import dataclass

from nodescope.model.skips import NOTHING_SKIPPED, Skipped
from nodescope.model.source_key import SourceKey


@dataclass(frozen=True, slots=True)
class TaskStat:
    """The fields of a ``stat`` line this source uses. ``utime``/``stime`` in clock ticks."""

    tid: int
    comm: str
    state: str
    ppid: int
    utime: int
    stime: int


@dataclass(frozen=True, slots=True)
class BlockedThread:
    """A thread in ``D`` state: process and thread id, the thread's name, its wait channel
    (``None``: ``0`` or unreadable) and the job of its process (``None``: not in a job)."""

    pid: int
    tid: int
    comm: str
    wchan: str | None
    job_id: str | None


@dataclass(frozen=True, slots=True)
class JobThreads:
    """One job's threads: how many in each state, and those in ``D``."""

    job_id: str
    processes: int
    threads: int
    states: tuple[tuple[str, int], ...]
    blocked: tuple[BlockedThread, ...]

    def count(self, state: str) -> int:
        return dict(self.states).get(state, 0)


@dataclass(frozen=True, slots=True)
class ThreadsData:
    """``host_blocked``/``host_threads`` are from the latest host walk, ``host_age_runs``
    runs ago (0: this run); ``None`` before the first."""

    jobs: tuple[JobThreads, ...]
    host_threads: int | None
    host_blocked: tuple[BlockedThread, ...]
    host_age_runs: int | None
    #: Threads and processes this run skipped (and those of the host walk, when it ran).
    skipped: Skipped = NOTHING_SKIPPED

    def job(self, job_id: str) -> JobThreads | None:
        for job in self.jobs:
            if job.job_id == job_id:
                return job
        return None

    def blocked(self) -> tuple[BlockedThread, ...]:
        """Every ``D`` thread known: the jobs' of this run, then the host walk's others."""
        seen = {(b.pid, b.tid) for j in self.jobs for b in j.blocked}
        jobs = tuple(b for j in self.jobs for b in j.blocked)
        return jobs + tuple(b for b in self.host_blocked if (b.pid, b.tid) not in seen)


#: The ``threads`` source's records.
THREADS = SourceKey("threads", ThreadsData)
