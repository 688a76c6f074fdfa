"""The placement view of the Slurm jobs on the node: which GPUs and which HCAs each job uses.

What the placement detector needs, built by the job registry (:mod:`nodescope.jobs`) from the
``jobs`` source: a job's processes are the pids in its cgroups (``docs/datasources.md`` §5);
its GPUs here are the GPUs whose NVML compute processes (§1.7) are among those pids; its HCAs
are what ``NCCL_IB_HCA`` in its processes' environment selects among the node's RDMA devices,
or all of them when no process sets it (NCCL's default: every HCA). Steps, escaped processes
and threads, memory and registrations live in the registry.

``NCCL_IB_HCA`` syntax (NCCL documentation, "Environment Variables"): a comma-separated
list of ``name[:port]``; names are prefixes (``mlx5`` selects every ``mlx5_*``) unless the
list starts with ``=`` (exact names); a leading ``^`` excludes the listed devices instead
(``^=mlx5_1`` excludes exactly ``mlx5_1``). Pure: imports nothing of nodescope.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class JobProcess:
    """One process of a job: its pid, the job's id, the cgroup it sits in and the
    ``NCCL_IB_HCA`` of its environment (``None``: not set)."""

    pid: int
    job_id: str
    cgroup: str
    nccl_ib_hca: str | None = None


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
    return (int(job), job) if job.isdigit() else (1 << 62, job)
