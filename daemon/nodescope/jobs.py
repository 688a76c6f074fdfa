"""The job registry: the Slurm jobs of the node, joined from three views.

* the ``jobs`` source (:mod:`nodescope.sources.jobs`): job cgroups, their processes and
  figures, and the cgroups of every other process;
* the prolog's registrations (read by the same source from ``<run>/nodescope/jobs``): id, user,
  partition and ``SLURM_JOB_GPUS``, known before the job's cgroup exists and after it is gone;
* NVML's compute processes (``nvml`` source): which pids use which GPU.

A job's GPUs come from, in order of trust: its registration (``SLURM_JOB_GPUS``, global
indices), ``SLURM_JOB_GPUS``/``SLURM_STEP_GPUS`` in its processes' environment, its v1 device
cgroup (``devices.list``), or — when nothing else says — the GPUs whose compute processes are
in its cgroups. A compute process on a GPU of job J that is not in J's cgroups has escaped J.

Pure: reads only the records it is given (and the snapshot, in :func:`jobs_of`); the
registry and the placement views of the last records are kept (:mod:`nodescope.memo`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from nodescope.errors import ParseError
from nodescope.memo import Memo
from nodescope.model.jobs import GpuUse, JobProcess, JobView, job_views
from nodescope.model.snapshot import Snapshot
from nodescope.sources.cgroup import Cgroup
from nodescope.sources.infiniband import InfinibandData
from nodescope.sources.jobs import (
    NAME,
    JobCgroup,
    JobsData,
    JobStep,
    JobTask,
    Registration,
    parse_gpu_list,
)
from nodescope.sources.nvml import NvmlData

GpuSource = str  # "registration" | "environ" | "device cgroup" | "processes" | "none"


@dataclass(frozen=True, slots=True)
class EscapedProcess:
    """A compute process on a GPU of the job that is not in the job's cgroups. ``cgroup`` is
    where it is (``None``: not found), ``memory_max_bytes`` the limit that applies to it
    there (``None``: none)."""

    pid: int
    gpu: int
    cgroup: str | None
    memory_max_bytes: int | None


@dataclass(frozen=True, slots=True)
class EscapedThreadOf:
    """A thread of a job process placed in a cgroup outside the job."""

    pid: int
    tid: int
    comm: str | None
    cgroup: str | None


@dataclass(frozen=True, slots=True)
class Job:
    """One job of the node.

    ``cgroup`` is ``None`` for a job known only from its registration (before its cgroup
    appears, after it is gone). ``memory_limit_bytes`` is the tightest ``memory.max`` in its
    subtree (what it asked for, ``None``: nothing); ``unlimited`` are the pids of its processes
    (tasks and escaped GPU processes) that no memory limit applies to.
    """

    job_id: str
    key: str | None
    layout: str | None
    cgroup: str | None
    user: str | None
    uid: int | None
    partition: str | None
    registered: bool
    gpus: tuple[int, ...]
    gpu_source: GpuSource
    stats: Cgroup | None
    steps: tuple[JobStep, ...]
    tasks: tuple[JobTask, ...]
    escaped_processes: tuple[EscapedProcess, ...]
    escaped_threads: tuple[EscapedThreadOf, ...]
    memory_limit_bytes: int | None
    unlimited: tuple[int, ...]

    @property
    def running(self) -> bool:
        return self.cgroup is not None

    def user_tasks(self) -> tuple[JobTask, ...]:
        """The job's own processes, without slurmstepd."""
        return tuple(t for t in self.tasks if not t.slurm_internal)


def _env_gpus(tasks: Iterable[JobTask]) -> tuple[int, ...]:
    found: set[int] = set()
    for task in tasks:
        for name in ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS"):
            value = task.env(name)
            if value:
                try:
                    found.update(parse_gpu_list(value, name))
                except ParseError:
                    continue  # a user may set anything: it names no GPU then
    return tuple(sorted(found))


def _job_gpus(
    registration: Registration | None, cgroup: JobCgroup | None, gpus: Sequence[GpuUse]
) -> tuple[tuple[int, ...], GpuSource]:
    if registration is not None and registration.gpus:
        return registration.gpus, "registration"
    if cgroup is None:
        return (), "none"
    from_env = _env_gpus(cgroup.tasks)
    if from_env:
        return from_env, "environ"
    if cgroup.gpu_minors:
        return cgroup.gpu_minors, "device cgroup"
    pids = {t.pid for t in cgroup.tasks}
    used = tuple(sorted({g.index for g in gpus if pids.intersection(g.pids)}))
    return (used, "processes") if used else ((), "none")


def build_registry(data: JobsData | None, gpus: Sequence[GpuUse]) -> tuple[Job, ...]:
    """Every job the cgroups or the registrations show, sorted by job id."""
    if data is None:
        return ()
    registrations = {r.job_id: r for r in data.registrations}
    cgroups: dict[str, JobCgroup] = {}
    for found in data.jobs:
        cgroups.setdefault(found.job_id or found.key, found)
    pid_job: dict[int, JobCgroup] = {t.pid: c for c in data.jobs for t in c.tasks}
    jobs: list[Job] = []
    for job_id in sorted(set(cgroups) | set(registrations), key=_job_order):
        cgroup = cgroups.get(job_id)
        registration = registrations.get(job_id)
        job_gpus, source = _job_gpus(registration, cgroup, gpus)
        own = {t.pid for t in cgroup.tasks} if cgroup is not None else set()
        escaped: list[EscapedProcess] = []
        if cgroup is not None and source != "processes":
            for gpu in gpus:
                if gpu.index not in job_gpus:
                    continue
                for pid in gpu.pids:
                    if pid in own:
                        continue
                    other = pid_job.get(pid)
                    if other is not None:
                        task = next(t for t in other.tasks if t.pid == pid)
                        escaped.append(
                            EscapedProcess(pid, gpu.index, task.cgroup, task.memory_max_bytes)
                        )
                        continue
                    located = data.cgroup_of(pid)
                    if located is None:
                        escaped.append(EscapedProcess(pid, gpu.index, None, None))
                    else:
                        escaped.append(EscapedProcess(pid, gpu.index, *located))
        threads = tuple(
            EscapedThreadOf(t.pid, e.tid, e.comm, e.cgroup)
            for t in (cgroup.tasks if cgroup is not None else ())
            for e in t.escaped_threads
        )
        tasks = cgroup.tasks if cgroup is not None else ()
        limit = cgroup.memory_limit_bytes if cgroup is not None else None
        unlimited = sorted(
            {t.pid for t in tasks if not t.slurm_internal and t.memory_max_bytes is None}
            | {e.pid for e in escaped if e.memory_max_bytes is None and e.cgroup is not None}
        )
        user = registration.user if registration is not None else None
        uid = registration.uid if registration is not None else None
        if cgroup is not None:
            user = user or next((v for t in tasks if (v := t.env("SLURM_JOB_USER"))), None)
            uid_text = next((v for t in tasks if (v := t.env("SLURM_JOB_UID"))), None)
            if uid is None:
                uid = cgroup.uid if cgroup.uid is not None else _int(uid_text)
        partition = registration.partition if registration is not None else None
        if partition is None:
            partition = next((v for t in tasks if (v := t.env("SLURM_JOB_PARTITION"))), None)
        jobs.append(
            Job(
                job_id=job_id,
                key=cgroup.key if cgroup is not None else None,
                layout=cgroup.layout if cgroup is not None else None,
                cgroup=cgroup.path if cgroup is not None else None,
                user=user,
                uid=uid,
                partition=partition,
                registered=registration is not None,
                gpus=job_gpus,
                gpu_source=source,
                stats=cgroup.stats if cgroup is not None else None,
                steps=cgroup.steps if cgroup is not None else (),
                tasks=tasks,
                escaped_processes=tuple(sorted(escaped, key=lambda e: (e.gpu, e.pid))),
                escaped_threads=threads,
                memory_limit_bytes=limit,
                unlimited=tuple(unlimited),
            )
        )
    return tuple(jobs)


def _int(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() and text.isascii() else None


def _job_order(job: str) -> tuple[int, str]:
    return (int(job), job) if job.isdigit() and job.isascii() else (1 << 62, job)


def gpu_uses(nvml: NvmlData | None) -> tuple[GpuUse, ...]:
    if nvml is None:
        return ()
    return tuple(
        GpuUse(g.index, g.pci_address, tuple(p.pid for p in g.processes)) for g in nvml.gpus
    )


#: The registry of the last ``jobs`` record and GPU list asked for: the jobs detector, the
#: job metrics and the hooks ask for the same one, and the ``jobs`` source runs every 15 s.
_registry = Memo[tuple[Job, ...]]()


def registry(data: JobsData | None, gpus: tuple[GpuUse, ...]) -> tuple[Job, ...]:
    """:func:`build_registry`, computed again only when ``data`` is another object or the
    GPUs' compute processes changed."""
    return _registry.get((data,), gpus, lambda: build_registry(data, gpus))


def jobs_of(snapshot: Snapshot) -> tuple[Job, ...]:
    """The registry of a snapshot (``jobs`` and ``nvml`` sources)."""
    return registry(snapshot.data(NAME, JobsData), gpu_uses(snapshot.data("nvml", NvmlData)))


#: Placement views by the samples they are made of (several detectors ask in one cycle), and
#: by what they are made of: the ``jobs`` record (every 15 s), the GPUs' compute processes and
#: the HCA names, which stay the same while NVML and InfiniBand are read every second.
_views_of_samples = Memo[tuple[JobView, ...]]()
_views_of_content = Memo[tuple[JobView, ...]]()


def placement_views(snapshot: Snapshot) -> tuple[JobView, ...]:
    """The job view of the placement detector: jobs with compute processes in their cgroups,
    their GPUs and the HCAs ``NCCL_IB_HCA`` lets them use."""
    data = snapshot.data(NAME, JobsData)
    nvml = snapshot.data("nvml", NvmlData)
    ib = snapshot.data("infiniband", InfinibandData)
    return _views_of_samples.get((data, nvml, ib), None, lambda: _placement_views(data, nvml, ib))


def _placement_views(
    data: JobsData | None, nvml: NvmlData | None, ib: InfinibandData | None
) -> tuple[JobView, ...]:
    if data is None or nvml is None:
        return ()
    gpus = gpu_uses(nvml)
    hcas = tuple(d.name for d in ib.devices) if ib is not None else ()
    return _views_of_content.get((data,), (gpus, hcas), lambda: _job_views(data, gpus, hcas))


def _job_views(
    data: JobsData, gpus: tuple[GpuUse, ...], hcas: tuple[str, ...]
) -> tuple[JobView, ...]:
    processes = [
        JobProcess(t.pid, job.job_id or job.key, t.cgroup, t.env("NCCL_IB_HCA"))
        for job in data.jobs
        for t in job.tasks
    ]
    return job_views(processes, gpus, hcas)
