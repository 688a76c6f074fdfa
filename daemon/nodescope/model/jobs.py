"""The Slurm jobs of the node: the job registry and its placement view.

The registry joins three views:

* the ``jobs`` source's record (:mod:`nodescope.model.job_records`): job cgroups, their
  processes and figures, and the cgroups of every other process;
* the prolog's registrations (read by the same source from ``<run>/nodescope/jobs``): id, user,
  partition and ``SLURM_JOB_GPUS``, known before the job's cgroup exists and after it is gone;
* NVML's compute processes (``nvml`` source): which pids use which GPU.

A job's GPUs come from, in order of trust: its registration (``SLURM_JOB_GPUS``, global
indices), ``SLURM_JOB_GPUS``/``SLURM_STEP_GPUS`` in its processes' environment, its v1 device
cgroup (``devices.list``), or — when nothing else says — the GPUs whose compute processes are
in its cgroups. A compute process on a GPU of job J that is not in J's cgroups has escaped J.

The placement view is what the placement detector needs: a job's processes are the pids in
its cgroups (``docs/datasources.md`` §5); its GPUs here are the GPUs whose NVML compute
processes (§1.7) are among those pids; its HCAs are what ``NCCL_IB_HCA`` in its processes'
environment selects among the node's RDMA devices, or all of them when no process sets it
(NCCL's default: every HCA).

``NCCL_IB_HCA`` syntax (NCCL documentation, "Environment Variables"): a comma-separated
list of ``name[:port]``; names are prefixes (``mlx5`` selects every ``mlx5_*``) unless the
list starts with ``=`` (exact names); a leading ``^`` excludes the listed devices instead
(``^=mlx5_1`` excludes exactly ``mlx5_1``). Pure: functions of the records they are given;
each snapshot computes its registry once (:mod:`nodescope.model.derived`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from nodescope.errors import ParseError
from nodescope.model.cgroup import Cgroup
from nodescope.model.infiniband import InfinibandData
from nodescope.model.job_records import (
    JobCgroup,
    JobsData,
    JobStep,
    JobTask,
    Registration,
    parse_gpu_list,
)
from nodescope.model.nvml import NvmlData


@dataclass(frozen=True, slots=True)
class JobProcess:
    """One process of a job: its pid, the job's id, the cgroup it sits in and the
    ``NCCL_IB_HCA`` of its environment (``None``: not set)."""

    pid: int
    job_id: str
    cgroup: str
    nccl_ib_hca: str | None = None


@dataclass(frozen=True, slots=True)
class DepartedRank:
    """A process of a job that ran on GPUs and is gone: NVML stopped listing it as a compute
    process of any GPU and the job lost it. ``gone_at`` is the snapshot time it was first
    missed; ``comm`` is its name while it ran (``None``: the job registry had not seen it).
    How it ended is not known here: the node agent is not its parent, so no exit status."""

    job_id: str
    pid: int
    comm: str | None
    gpus: tuple[int, ...]
    gone_at: float


@dataclass(frozen=True, slots=True)
class GpuUse:
    """A GPU and the pids NVML lists as its compute processes."""

    index: int
    bdf: str
    pids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class HcaFilter:
    """A parsed ``NCCL_IB_HCA``: ``entries`` are (name, port or ``None``)."""

    entries: tuple[tuple[str, int | None], ...]
    exclude: bool = False
    exact: bool = False

    def matches(self, device: str) -> bool:
        for name, _port in self.entries:
            if device == name or (not self.exact and device.startswith(name)):
                return True
        return False

    def select(self, devices: Iterable[str]) -> tuple[str, ...]:
        """The devices the filter lets NCCL use, sorted."""
        chosen = (d for d in devices if self.matches(d) != self.exclude)
        return tuple(sorted(set(chosen)))


def parse_nccl_ib_hca(value: str) -> HcaFilter | None:
    """``NCCL_IB_HCA`` as NCCL reads it; ``None`` for an empty value (NCCL's default).

    Malformed ports are ignored rather than rejected: NCCL itself skips what it cannot use,
    and a typo in a user's environment must not cost the whole job view.
    """
    text = value.strip()
    exclude = text.startswith("^")
    if exclude:
        text = text[1:]
    exact = text.startswith("=")
    if exact:
        text = text[1:]
    entries: list[tuple[str, int | None]] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, port_text = part.partition(":")
        port = int(port_text) if port_text.isdigit() else None
        if name:
            entries.append((name, port))
    if not entries:
        return None
    return HcaFilter(tuple(entries), exclude, exact)


@dataclass(frozen=True, slots=True)
class JobView:
    """A job's GPUs (indices and BDFs), its HCAs and where they came from
    (``hca_source``: ``"NCCL_IB_HCA"`` or ``"all"``)."""

    job_id: str
    pids: tuple[int, ...]
    gpus: tuple[int, ...]
    gpu_bdfs: tuple[str, ...]
    hcas: tuple[str, ...]
    hca_source: str


def job_views(
    processes: Iterable[JobProcess],
    gpus: Iterable[GpuUse],
    hcas: Iterable[str],
) -> tuple[JobView, ...]:
    """Every job that has at least one GPU process, sorted by job id.

    ``hcas`` are the node's RDMA device names. The ``NCCL_IB_HCA`` values of a job's processes
    are applied each on its own and their selections united: ranks of one job may be told to
    use different HCAs.
    """
    available = tuple(sorted(set(hcas)))
    by_job: dict[str, list[JobProcess]] = {}
    job_of: dict[int, str] = {}
    for proc in processes:
        by_job.setdefault(proc.job_id, []).append(proc)
        job_of[proc.pid] = proc.job_id
    gpus_of: dict[str, dict[int, str]] = {}
    for gpu in gpus:
        for pid in gpu.pids:
            job = job_of.get(pid)
            if job is not None:
                gpus_of.setdefault(job, {})[gpu.index] = gpu.bdf
    views: list[JobView] = []
    for job in sorted(gpus_of, key=_job_order):
        procs = by_job[job]
        filters = [
            f
            for f in (parse_nccl_ib_hca(p.nccl_ib_hca) for p in procs if p.nccl_ib_hca)
            if f is not None
        ]
        if filters:
            chosen = sorted({d for f in filters for d in f.select(available)})
            source = "NCCL_IB_HCA"
        else:
            chosen = list(available)
            source = "all"
        used: Mapping[int, str] = gpus_of[job]
        views.append(
            JobView(
                job_id=job,
                pids=tuple(sorted(p.pid for p in procs)),
                gpus=tuple(sorted(used)),
                gpu_bdfs=tuple(used[i] for i in sorted(used)),
                hcas=tuple(chosen),
                hca_source=source,
            )
        )
    return tuple(views)


def _job_order(job: str) -> tuple[int, str]:
    # isascii too: "²" is a digit to str.isdigit but not to int().
    return (int(job), job) if job.isdigit() and job.isascii() else (1 << 62, job)


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


def _own_tasks(job_id: str, tasks: Iterable[JobTask]) -> list[JobTask]:
    """The processes of a job's cgroups that are not another job's. A process whose
    ``SLURM_JOB_ID`` names another job (a rank of that job started inside this job's cgroup)
    says nothing about this job's GPUs: counting it would give this job the other's GPUs and
    accuse it of the other's processes on them."""
    return [t for t in tasks if (owner := t.env("SLURM_JOB_ID")) is None or owner == job_id]


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
    job_id: str,
    registration: Registration | None,
    cgroup: JobCgroup | None,
    gpus: Sequence[GpuUse],
) -> tuple[tuple[int, ...], GpuSource]:
    if registration is not None and registration.gpus:
        return registration.gpus, "registration"
    if cgroup is None:
        return (), "none"
    own = _own_tasks(job_id, cgroup.tasks)
    from_env = _env_gpus(own)
    if from_env:
        return from_env, "environ"
    if cgroup.gpu_minors:
        return cgroup.gpu_minors, "device cgroup"
    pids = {t.pid for t in own}
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
        job_gpus, source = _job_gpus(job_id, registration, cgroup, gpus)
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


def gpu_uses(nvml: NvmlData | None) -> tuple[GpuUse, ...]:
    if nvml is None:
        return ()
    return tuple(
        GpuUse(g.index, g.pci_address, tuple(p.pid for p in g.processes)) for g in nvml.gpus
    )


#: ``NCCL_NET_GDR_LEVEL`` values that turn GPUDirect RDMA off (NCCL documentation,
#: "Environment Variables": ``LOC``, or its number 0): the NIC's bytes go through host memory.
GDR_OFF_LEVELS = frozenset({"LOC", "0"})


def host_staged_gpus(data: JobsData | None, views: Iterable[JobView]) -> frozenset[str]:
    """BDFs of the GPUs of jobs whose processes set ``NCCL_NET_GDR_LEVEL`` to ``LOC``: their
    network traffic is staged in host memory, never peer to peer with a NIC."""
    if data is None:
        return frozenset()
    off = {
        job.job_id or job.key
        for job in data.jobs
        if any(
            (t.env("NCCL_NET_GDR_LEVEL") or "").strip().upper() in GDR_OFF_LEVELS for t in job.tasks
        )
    }
    if not off:
        return frozenset()
    return frozenset(bdf for view in views if view.job_id in off for bdf in view.gpu_bdfs)


def placement_views(
    data: JobsData | None, nvml: NvmlData | None, ib: InfinibandData | None
) -> tuple[JobView, ...]:
    """The job view of the placement detector: jobs with compute processes in their cgroups,
    their GPUs and the HCAs ``NCCL_IB_HCA`` lets them use."""
    if data is None or nvml is None:
        return ()
    hcas = tuple(d.name for d in ib.devices) if ib is not None else ()
    return job_processes_views(data, gpu_uses(nvml), hcas)


def job_processes_views(
    data: JobsData, gpus: tuple[GpuUse, ...], hcas: tuple[str, ...]
) -> tuple[JobView, ...]:
    processes = [
        JobProcess(t.pid, job.job_id or job.key, t.cgroup, t.env("NCCL_IB_HCA"))
        for job in data.jobs
        for t in job.tasks
    ]
    return job_views(processes, gpus, hcas)
