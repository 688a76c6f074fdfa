"""Job churn on a simulated node: short Slurm jobs that start and end while it runs.

A scenario's jobs live for the whole run; a soak needs jobs that come and go, so that state
kept per job, per process or per series would show if it is never released. :class:`JobChurn`
keeps ``slots`` extra jobs on a :class:`~nodescope.sim.node.SimulatedNode`, each with a GPU
of the node: every ``every`` ticks the oldest ends and a new one, with a new job id and new
pids, starts. It writes what Slurm's cgroup/v2 plugin and the kernel would show for it, in
the formats the node uses (docs/datasources.md §5, Documentation/admin-guide/cgroup-v2.rst,
fs/proc/array.c):

* ``<cgroupfs>/system.slice/slurmstepd.scope/job_<id>/step_0/user/task_0`` with the job's
  processes in ``cgroup.procs``/``cgroup.threads`` and, at every level, ``memory.*``,
  ``cpu.stat`` (advancing with the processes' CPU time), ``pids.*``, ``io.stat``, PSI files;
* ``<procfs>/<pid>/{stat,comm,cmdline,environ,cgroup,wchan}`` and
  ``task/<tid>/{stat,comm,wchan}`` (``SLURM_JOB_ID``, ``CUDA_VISIBLE_DEVICES`` in environ);
* the job's rank as a compute process on its GPU in the fake NVML.

A job ends as on a real node: its processes exit (``/proc/<pid>`` goes), then its cgroup
directory is removed. :meth:`JobChurn.apply` runs after each
:meth:`~nodescope.sim.node.SimulatedNode.advance_to` (which resets the fake NVML's process
lists to the scenario's).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from nodescope.roots import Roots
from nodescope.sim.fake_nvml import FakeNvml, FakeProcess

CLK_TCK = 100
FIRST_JOB_ID = 900_001
#: Far above the scenario's pids (the node numbers them from 1; jobs from the next 1000).
FIRST_PID = 3_000_000
PROCESSES = 4
THREADS = 3
RSS = 512 * 2**20
SCOPE = "system.slice/slurmstepd.scope"
_PSI = "".join(f"{k} avg10=0.00 avg60=0.00 avg300=0.00 total=0\n" for k in ("some", "full"))
_EVENTS = "".join(f"{k} 0\n" for k in ("low", "high", "max", "oom", "oom_kill", "oom_group_kill"))


@dataclass
class _ChurnJob:
    job_id: int
    gpu: int
    pids: tuple[int, ...]
    started: float
    cpu_ticks: float = 0.0

    def tids(self, pid: int) -> tuple[int, ...]:
        return tuple(range(pid, pid + THREADS))


class JobChurn:
    """``slots`` jobs that take turns: one ends and one starts every ``every`` ticks."""

    def __init__(self, roots: Roots, nvml: FakeNvml, slots: int = 4, every: int = 50) -> None:
        if slots < 1 or every < 1:
            raise ValueError("slots and every must be at least 1")
        self.roots = roots
        self.nvml = nvml
        self.slots = slots
        self.every = every
        self.jobs: list[_ChurnJob] = []
        self.ended: list[int] = []
        self._next_job = FIRST_JOB_ID
        self._next_pid = FIRST_PID
        self._ticks = 0
        self._t = 0.0
        self._staging = roots.procfs.parent / ".churn-staging"
        self._staging.mkdir(parents=True, exist_ok=True)

    # ---- lifecycle ----------------------------------------------------------------------

    def apply(self, t: float) -> None:
        """Advance the churn jobs to ``t``: fill free slots, rotate every ``every`` ticks,
        advance CPU time, and put the ranks into the fake NVML's process lists."""
        seconds = max(0.0, t - self._t)
        self._t = t
        self._ticks += 1
        if self.jobs and self._ticks % self.every == 0:
            self._end(self.jobs.pop(0))
        while len(self.jobs) < self.slots:
            self.jobs.append(self._start(t))
        for job in self.jobs:
            job.cpu_ticks += seconds * CLK_TCK
            self._write_counters(job)
        self.add_gpu_processes()

    def add_gpu_processes(self) -> None:
        """Put the ranks into the fake NVML's process lists, which every move of the node
        sets afresh."""
        gpus = self.nvml.gpus
        for job in self.jobs:
            if job.gpu < len(gpus) and not gpus[job.gpu].lost:
                gpus[job.gpu].processes.append(FakeProcess(job.pids[0], 8 * 2**30))

    def active_ids(self) -> set[str]:
        return {str(job.job_id) for job in self.jobs}

    def _start(self, t: float) -> _ChurnJob:
        job_id = self._next_job
        self._next_job += 1
        pids = tuple(self._next_pid + i * THREADS for i in range(PROCESSES))
        self._next_pid += PROCESSES * THREADS
        gpus = max(1, len(self.nvml.gpus))
        job = _ChurnJob(job_id, (job_id - FIRST_JOB_ID) % gpus, pids, t)
        self._write_job(job)
        return job

    def _end(self, job: _ChurnJob) -> None:
        for pid in job.pids:
            shutil.rmtree(self.roots.procfs / str(pid), ignore_errors=True)
        shutil.rmtree(self._job_dir(job), ignore_errors=True)
        self.ended.append(job.job_id)

    def close(self) -> None:
        for job in self.jobs:
            self._end(job)
        self.jobs = []

    # ---- files --------------------------------------------------------------------------

    def _job_dir(self, job: _ChurnJob) -> Path:
        return self.roots.cgroupfs / SCOPE / f"job_{job.job_id}"

    def _levels(self, job: _ChurnJob) -> list[Path]:
        top = self._job_dir(job)
        return [top, top / "step_0", top / "step_0" / "user", top / "step_0" / "user" / "task_0"]

    def _write(self, path: Path, content: str | bytes) -> None:
        data = content.encode() if isinstance(content, str) else content
        # Write and rename, so a reader sees the old or the new content, never half.
        tmp = self._staging / "tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def _write_job(self, job: _ChurnJob) -> None:
        levels = self._levels(job)
        leaf = levels[-1]
        for level in levels:
            level.mkdir(parents=True, exist_ok=True)
            inner = level != leaf
            controllers = "cpuset cpu io memory pids\n"
            self._write(level / "cgroup.controllers", controllers)
            self._write(level / "cgroup.subtree_control", controllers if inner else "\n")
            self._write(level / "cgroup.type", "domain\n")
            self._write(level / "cgroup.events", "populated 1\nfrozen 0\n")
            self._write(level / "cgroup.procs", "" if inner else _lines(job.pids))
            tids = [tid for pid in job.pids for tid in job.tids(pid)]
            self._write(level / "cgroup.threads", "" if inner else _lines(tids))
            self._write(level / "memory.max", f"{64 * 2**30}\n" if level == levels[0] else "max\n")
            self._write(level / "memory.high", "max\n")
            self._write(level / "pids.max", "max\n")
            self._write(level / "pids.current", f"{len(tids)}\n")
            self._write(level / "io.stat", "")
            for kind in ("cpu", "memory", "io"):
                self._write(level / f"{kind}.pressure", _PSI)
            self._write(level / "memory.events", _EVENTS)
            self._write(level / "memory.events.local", _EVENTS)
        cgroup = "/" + str(leaf.relative_to(self.roots.cgroupfs))
        env = (
            f"PATH=/usr/bin:/bin\0USER=churn\0SLURM_JOB_ID={job.job_id}\0SLURM_JOB_USER=churn\0"
            f"SLURM_JOB_UID=1900\0SLURM_STEP_ID=0\0SLURM_PROCID=0\0"
            f"CUDA_VISIBLE_DEVICES={job.gpu}\0"
        )
        for rank, pid in enumerate(job.pids):
            base = self.roots.procfs / str(pid)
            for tid in job.tids(pid):
                (base / "task" / str(tid)).mkdir(parents=True, exist_ok=True)
                self._write(base / "task" / str(tid) / "comm", "python3\n")
                self._write(base / "task" / str(tid) / "wchan", "0")
            self._write(base / "comm", "python3\n")
            self._write(base / "cmdline", b"python3\0train.py\0")
            self._write(base / "environ", env.replace("PROCID=0", f"PROCID={rank}"))
            self._write(base / "cgroup", f"0::{cgroup}\n")
            self._write(base / "wchan", "0")
        self._write_counters(job)

    def _write_counters(self, job: _ChurnJob) -> None:
        used_usec = int(job.cpu_ticks * len(job.pids) * 1_000_000 / CLK_TCK)
        memory = RSS * len(job.pids)
        for level in self._levels(job):
            user = used_usec * 9 // 10
            self._write(
                level / "cpu.stat",
                f"usage_usec {used_usec}\nuser_usec {user}\nsystem_usec {used_usec - user}\n"
                "nr_periods 0\nnr_throttled 0\nthrottled_usec 0\nnr_bursts 0\nburst_usec 0\n",
            )
            self._write(level / "memory.current", f"{memory}\n")
            self._write(level / "memory.peak", f"{memory}\n")
            self._write(
                level / "memory.stat",
                f"anon {memory}\nfile 0\nkernel 0\nsock 0\nshmem 0\nfile_dirty 0\n"
                f"file_writeback 0\npgfault 0\npgmajfault 0\n",
            )
        for pid in job.pids:
            base = self.roots.procfs / str(pid)
            ticks = int(job.cpu_ticks)
            self._write(base / "stat", _stat(pid, pid, THREADS, ticks))
            for tid in job.tids(pid):
                share = ticks if tid == pid else 0
                self._write(base / "task" / str(tid) / "stat", _stat(tid, pid, THREADS, share))


def _lines(numbers: list[int] | tuple[int, ...]) -> str:
    return "".join(f"{n}\n" for n in numbers)


def _stat(tid: int, pid: int, threads: int, ticks: int) -> str:
    """A ``/proc/<pid>/stat`` line: 52 fields (fs/proc/array.c ``do_task_stat``)."""
    utime, stime = ticks * 9 // 10, ticks - ticks * 9 // 10
    fields: list[int | str] = [
        tid, "(python3)", "R", 1, pid, pid, 0, -1, 0x00400100, 0, 0, 0, 0, utime, stime, 0, 0,
        20, 0, threads, 0, 100, RSS * 4, RSS // 4096, 18446744073709551615, 1, 1, 0, 0, 0, 0,
        0, 0, 0, 0, 0, 0, 17, tid % 224, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ]  # fmt: skip
    return " ".join(str(f) for f in fields) + "\n"


__all__ = ["FIRST_JOB_ID", "JobChurn"]
