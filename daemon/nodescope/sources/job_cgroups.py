"""Where Slurm's jobs are in the cgroup v2 hierarchy: one search that the ``jobs``, ``procs``
and ``threads`` sources use, over a walk of the tree or over the directories themselves.

Slurm's cgroup/v2 plugin (``src/plugins/cgroup/v2/cgroup_v2.c``, ``docs/datasources.md`` §5)
makes::

    .../[<node>_]slurmstepd.scope/{job_<id> | <SLUID>}/step_<s>/{slurm, user/task_<n>}

A ``job_<id>`` directory is a job wherever it sits within :data:`MAX_SEARCH_DEPTH` levels of
the root (sites move the scope with ``CgroupSlice``); any other child of a
``slurmstepd.scope`` but ``system`` is a job named by its SLUID (the default from Slurm 26.05
unless ``CgroupJobIdPaths=yes``). The search does not look inside a job for other jobs.

``cgroup.procs`` (``Documentation/admin-guide/cgroup-v2.rst``): one pid per line, unordered,
a pid listed twice when processes move during the read.
"""

from __future__ import annotations

import os
import re
from collections import deque
from dataclasses import dataclass

from nodescope.model.cgroup import Cgroup, CgroupTree
from nodescope.model.job_records import Layout
from nodescope.model.skips import SkipTally

#: How deep below the v2 root job directories are searched for:
#: ``system.slice/slurmstepd.scope/job_<id>`` sits at depth 3.
MAX_SEARCH_DEPTH = 4

#: Directories a search by listing visits at most, unless its caller bounds it otherwise.
MAX_SEARCHED = 20_000

#: Why a line of a ``cgroup.procs`` was skipped (the ``reason`` of
#: ``nodescope_source_records_skipped_total``): it is not a pid.
PID_UNPARSABLE = "pid_unparsable"

_JOB_DIR = re.compile(r"job_([0-9]+)")
_SLUID = re.compile(r"[A-Za-z0-9]{4,40}")
_PID = re.compile(r"[0-9]{1,10}")

_SCOPE_SUFFIX = "slurmstepd.scope"


@dataclass(frozen=True, slots=True)
class JobDirectory:
    """A job's directory: ``key`` its name (``job_42`` or a SLUID), ``job_id`` the id the name
    gives (``None`` for a SLUID), ``layout`` which of the two it is."""

    key: str
    job_id: str | None
    layout: Layout


def job_dir_id(name: str) -> str | None:
    """The job id of a ``job_<id>`` directory."""
    match = _JOB_DIR.fullmatch(name)
    return match.group(1) if match else None


def is_sluid_dir(name: str) -> bool:
    """Whether a child of ``slurmstepd.scope`` can be a SLUID-named job (not ``system``)."""
    return name != "system" and job_dir_id(name) is None and bool(_SLUID.fullmatch(name))


def _job_directory(name: str, in_scope: bool) -> JobDirectory | None:
    """The job a directory named ``name`` is; ``in_scope``: its parent is a
    ``slurmstepd.scope``."""
    number = job_dir_id(name)
    if number is not None:
        return JobDirectory(name, number, "v2")
    if in_scope and is_sluid_dir(name):
        return JobDirectory(name, None, "v2-sluid")
    return None


def jobs_in_tree(tree: CgroupTree) -> list[tuple[JobDirectory, list[Cgroup]]]:
    """Every job of a whole walk of the v2 tree with its cgroups in walk order, the job's own
    first, in one pass over the walk (breadth first: a parent comes before its children)."""
    root_name = "" if tree.root is None else os.path.basename(tree.root)
    found: list[tuple[JobDirectory, list[Cgroup]]] = []
    searched: dict[str, int] = {"/": 0}  # cgroup path → its depth in the search
    within: dict[str, list[Cgroup]] = {}  # cgroup path → the cgroups of its job
    for cgroup in tree.cgroups[1:]:
        parent = cgroup.parent_path or "/"
        members = within.get(parent)
        if members is not None:
            members.append(cgroup)
            within[cgroup.path] = members
            continue
        depth = searched.get(parent)
        if depth is None:
            continue
        parent_name = root_name if parent == "/" else parent.rsplit("/", 1)[-1]
        job = _job_directory(cgroup.name, parent_name.endswith(_SCOPE_SUFFIX))
        if job is not None:
            members = [cgroup]
            within[cgroup.path] = members
            found.append((job, members))
        elif depth + 1 < MAX_SEARCH_DEPTH:
            searched[cgroup.path] = depth + 1
    return found


def find_job_directories(root: str, max_visited: int) -> list[tuple[JobDirectory, str]]:
    """Every job directory within :data:`MAX_SEARCH_DEPTH` levels of the v2 root ``root``,
    found by listing directories (at most ``max_visited``), in the order of a walk; string
    paths, as a search lists thousands of directories."""
    found: list[tuple[JobDirectory, str]] = []
    queue: deque[tuple[str, int]] = deque([(root, 0)])
    visited = 0
    while queue and visited < max_visited:
        directory, depth = queue.popleft()
        visited += 1
        in_scope = directory.endswith(_SCOPE_SUFFIX)
        for name in _subdirectories(directory):
            job = _job_directory(name, in_scope)
            if job is not None:
                found.append((job, f"{directory}/{name}"))
            elif depth + 1 < MAX_SEARCH_DEPTH:
                queue.append((f"{directory}/{name}", depth + 1))
    return found


def find_job_dirs(root: str, max_visited: int = MAX_SEARCHED) -> list[tuple[str, str]]:
    """(job id, directory) of every ``job_<id>`` directory below the v2 root ``root``: the
    jobs whose id their name gives (a SLUID-named job's id comes from its processes, which
    the ``jobs`` source reads)."""
    return [
        (job.job_id, directory)
        for job, directory in find_job_directories(root, max_visited)
        if job.job_id is not None
    ]


def _subdirectories(path: str) -> list[str]:
    try:
        with os.scandir(path) as entries:
            return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
    except OSError:
        return []


def job_members(tree: CgroupTree) -> list[tuple[str, str, tuple[int, ...]]]:
    """(job id, cgroup path, sorted pids of every cgroup below it) of the ``job_<id>``
    cgroups of a whole walk with the id lists."""
    return [
        (job.job_id, cgroups[0].path, tuple(sorted({p for c in cgroups for p in c.procs or ()})))
        for job, cgroups in jobs_in_tree(tree)
        if job.job_id is not None
    ]


def parse_pids(
    text: str, source: str = "cgroup.procs", tally: SkipTally | None = None
) -> tuple[int, ...]:
    """``cgroup.procs``: one pid per line, unordered, duplicates possible; sorted unique. A
    line that is not a pid is skipped, counted in ``tally`` as :data:`PID_UNPARSABLE`."""
    pids: set[int] = set()
    for line in text.split("\n"):
        token = line.strip()
        if not token:
            continue
        if not _PID.fullmatch(token):
            if tally is not None:
                tally.skip(PID_UNPARSABLE, f"{source}: {token}")
            continue
        pids.add(int(token))
    return tuple(sorted(pids))
