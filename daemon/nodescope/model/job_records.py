"""Slurm jobs as the node's cgroup trees and the prolog show them: the ``jobs`` source's records.

Built by ``sources/jobs.py`` from the job cgroups (Slurm's cgroup/v2 and v1 layouts,
``docs/datasources.md`` §5), the processes in them and the prolog's registrations. The
registration format is declared here because two sides use it: the hooks write a
registration when the prolog runs, the ``jobs`` source reads them back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from nodescope.errors import ParseError
from nodescope.model.cgroup import Cgroup
from nodescope.model.skips import NOTHING_SKIPPED, Skipped
from nodescope.model.source_key import SourceKey

#: Where the hooks keep what the prolog registered, below the ``run`` root, and the format
#: they write (JSON, ``format`` ``nodescope-registration/1``).
RUN_SUBDIR = "nodescope"
REGISTRATION_FORMAT = "nodescope-registration/1"
#: Registrations a node keeps at most (``[slurm] max_registrations``): the prolog refuses to
#: register past it and the ``jobs`` source reads no more, so neither the daemon's work per
#: run nor the job series grow with registrations an epilog never removed. A GPU node runs a
#: handful of jobs at a time (Slurm starts at most one per allocatable CPU): the default
#: leaves room for shared nodes and for leaked registrations until they expire.
DEFAULT_MAX_REGISTRATIONS = 256

#: The character major of NVIDIA GPUs (``/dev/nvidia<N>`` is 195:N; 255 is nvidiactl).
NVIDIA_MAJOR = 195
NVIDIA_CTL_MINOR = 255

_GPU_LIST = re.compile(r"[0-9]+(?:,[0-9]+)*")

#: How a job's cgroups are laid out: Slurm's cgroup/v2 plugin with ``job_<id>`` directories,
#: the same named by SLUID, or its v1 plugin.
Layout = Literal["v2", "v2-sluid", "v1"]


class HasRunRoot(Protocol):
    """Roots that name the runtime directory (:class:`nodescope.roots.Roots`)."""

    @property
    def run(self) -> Path: ...


def registrations_dir(roots: HasRunRoot) -> Path:
    """Where the registrations are: one ``<job id>.json`` per job the prolog announced."""
    return roots.run / RUN_SUBDIR / "jobs"


def parse_gpu_list(value: str, source: str = "SLURM_JOB_GPUS") -> tuple[int, ...]:
    """``SLURM_JOB_GPUS``-style global GPU indices, ``0,1,3``; an empty value is none."""
    text = value.strip()
    if not text:
        return ()
    if not _GPU_LIST.fullmatch(text):
        raise ParseError(source, f"not a list of GPU indices: {value!r}")
    return tuple(sorted({int(part) for part in text.split(",")}))


@dataclass(frozen=True, slots=True)
class EscapedThread:
    """A thread of a job process that is not in the job's cgroups; ``cgroup`` is where it is
    (``None``: it exited before it could be read)."""

    tid: int
    comm: str | None
    cgroup: str | None


@dataclass(frozen=True, slots=True)
class JobTask:
    """A process in a job's cgroups: where it sits, its kept environment, its thread count and
    the threads that sit outside the job. ``memory_max_bytes`` is the tightest ``memory.max``
    on the path from its cgroup to the root (``None``: no limit applies)."""

    pid: int
    comm: str | None
    cgroup: str
    step: str | None
    environ: tuple[tuple[str, str], ...]
    threads: int | None
    escaped_threads: tuple[EscapedThread, ...]
    memory_max_bytes: int | None
    slurm_internal: bool = False

    def env(self, name: str) -> str | None:
        for key, value in self.environ:
            if key == name:
                return value
        return None


@dataclass(frozen=True, slots=True)
class JobStep:
    """``step_<name>`` of a job: ``batch``, ``extern``, ``interactive`` or a number."""

    name: str
    path: str
    stats: Cgroup | None


@dataclass(frozen=True, slots=True)
class JobCgroup:
    """One job as its cgroup shows it.

    ``key`` is the directory name (``job_42`` or a SLUID), ``job_id`` the Slurm job id when it
    is known (from the name, or the processes' ``SLURM_JOB_ID``), ``path`` the directory below
    its hierarchy's root in ``/proc/<pid>/cgroup`` form. ``stats`` are the job cgroup's own
    figures (v1: memory, cpuacct and pids put together). ``memory_limit_bytes`` is the tightest
    ``memory.max`` anywhere in the job's subtree: the memory the job asked for.
    ``gpu_minors`` are the NVIDIA minors its device cgroup allows (v1 only; ``None``: unknown
    or unconstrained).
    """

    key: str
    job_id: str | None
    layout: Layout
    path: str
    uid: int | None
    stats: Cgroup | None
    steps: tuple[JobStep, ...]
    tasks: tuple[JobTask, ...]
    memory_limit_bytes: int | None
    gpu_minors: tuple[int, ...] | None


@dataclass(frozen=True, slots=True)
class Registration:
    """What the prolog told the daemon about a job (``registered_at``: Unix time)."""

    job_id: str
    uid: int | None
    user: str | None
    partition: str | None
    gpus: tuple[int, ...]
    registered_at: float


@dataclass(frozen=True, slots=True)
class OtherCgroup:
    """A populated cgroup outside every job: its processes and the tightest ``memory.max``
    from it up to the root (``None``: unlimited)."""

    path: str
    pids: tuple[int, ...]
    memory_max_bytes: int | None


@dataclass(frozen=True, slots=True)
class JobsData:
    """``hierarchy``: where jobs were looked for (``v2``, ``v1`` or ``none``)."""

    hierarchy: str
    jobs: tuple[JobCgroup, ...]
    registrations: tuple[Registration, ...]
    others: tuple[OtherCgroup, ...]
    truncated: bool = False
    #: What this run skipped: unreadable or malformed cgroups, threads, registrations.
    skipped: Skipped = NOTHING_SKIPPED

    def cgroup_of(self, pid: int) -> tuple[str, int | None] | None:
        """(cgroup, memory limit) of a pid outside every job, when the index has it."""
        for other in self.others:
            if pid in other.pids:
                return other.path, other.memory_max_bytes
        return None


#: The ``jobs`` source's records.
JOBS = SourceKey("jobs", JobsData)
