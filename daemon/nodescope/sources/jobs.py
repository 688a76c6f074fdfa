"""The ``jobs`` source: Slurm jobs as the node's cgroup trees and the prolog show them.

Reads, under the injected roots:

* the cgroup v2 hierarchy (``roots.cgroupfs``, or ``<cgroupfs>/unified`` on a hybrid host;
  ``Documentation/admin-guide/cgroup-v2.rst``) for Slurm's cgroup/v2 layout
  (``docs/datasources.md`` §5; Slurm ``src/plugins/cgroup/v2/cgroup_v2.c``)::

    .../[<node>_]slurmstepd.scope/{job_<id> | <SLUID>}/step_<s>/{slurm, user/task_<n>}

  A ``job_<id>`` directory is a job wherever it sits (sites move the scope with
  ``CgroupSlice``); any other child of a ``slurmstepd.scope`` but ``system`` is a job named by
  its SLUID (the default from Slurm 26.05 unless ``CgroupJobIdPaths=yes``), whose job id comes
  from its processes' ``SLURM_JOB_ID`` or the prolog's registration;
* cgroup v1 hierarchies (Slurm ``src/plugins/cgroup/v1/xcgroup.c``):
  ``<controller>/slurm[_<node>]/uid_<uid>/job_<id>/step_<s>/task_<n>``; ``memory`` (or
  ``freezer``) names the processes, ``memory``, ``cpuacct`` and ``pids`` give the figures
  (``Documentation/admin-guide/cgroup-v1/memory.rst``: ``memory.usage_in_bytes``,
  ``memory.limit_in_bytes``, ``memory.max_usage_in_bytes``, ``memory.oom_control``;
  ``cpuacct.usage`` in nanoseconds) and ``devices.list`` the GPUs a job may open
  (``Documentation/admin-guide/cgroup-v1/devices.rst``: ``c 195:N rwm`` lines);
* of every job process: ``/proc/<pid>/environ`` (only :data:`KEPT_VARIABLES` are kept; the rest
  of an environment — tokens, keys — is dropped at parse time), ``/proc/<pid>/comm``, and
  ``/proc/<pid>/task/`` against the job's ``cgroup.threads`` (``tasks`` in v1): a thread that
  is not in the job's cgroups was placed elsewhere, and ``/proc/<pid>/task/<tid>/cgroup``
  says where; for threads listed only in threaded cgroups, ``/proc/<tid>/status`` (``Tgid:``,
  ``fs/proc/array.c``) names their process;
* ``cgroup.procs`` and ``memory.max`` of every other cgroup of the hierarchy, so a GPU process
  outside its job can be placed, with the memory limit that applies to it;
* the prolog's registrations, ``<run>/nodescope/jobs/<id>.json`` (written by
  :mod:`nodescope.hooks`; JSON, ``format`` ``nodescope-registration/1``).

On a v2 host the job cgroups and the other cgroups come from the walk of the cgroup tree that
the ``cgroups``, ``jobs``, ``procs`` and ``threads`` sources share in a cycle
(:class:`~nodescope.sources.cgroup.CycleWalk`), so no cgroup file is read twice; the jobs are
found in it as :mod:`nodescope.sources.job_cgroups` finds them; the kept environment of a
known process is read again every ``slow_every`` runs (:class:`EnvironMemo`). The records are
declared in :mod:`nodescope.model.job_records`.

Job cgroups do not exist yet while the prolog runs and are gone when the epilog runs: the
registry joins the two views by job id.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from nodescope.errors import ParseError
from nodescope.fileio import CGROUP_LIST, CGROUP_STAT, PROC_PROCESS
from nodescope.model.job_records import (
    DEFAULT_MAX_REGISTRATIONS,
    JOBS,
    NVIDIA_CTL_MINOR,
    NVIDIA_MAJOR,
    REGISTRATION_FORMAT,
    RUN_SUBDIR,
    EscapedThread,
    JobCgroup,
    JobsData,
    JobStep,
    JobTask,
    Layout,
    OtherCgroup,
    Registration,
    parse_gpu_list,
    registrations_dir,
)
from nodescope.model.skips import Skipped, SkipTally
from nodescope.roots import Roots
from nodescope.sources.base import Environ, EnvironMemo, kept_environ, read_optional
from nodescope.sources.cgroup import (
    CGROUP_UNREADABLE,
    SLOW_EVERY,
    Cgroup,
    CgroupTree,
    CpuStat,
    CycleWalk,
    Limit,
    MemoryEvents,
    find_v2_root,
    parse_ids,
    parse_key_values,
    parse_limit,
    parse_proc_cgroup,
    parse_value,
    read_cgroup,
    read_tree,
)
from nodescope.sources.job_cgroups import (
    MAX_SEARCH_DEPTH,
    find_job_directories,
    is_sluid_dir,
    job_dir_id,
    jobs_in_tree,
)
from nodescope.sources.spec import SourceSpec

NAME = JOBS.name

#: Environment variables kept from a job process's environ: the job it claims, the GPUs Slurm
#: gave it (global indices in SLURM_JOB_GPUS/SLURM_STEP_GPUS; CUDA_VISIBLE_DEVICES is
#: renumbered inside a device-constrained job), the HCAs NCCL may use and whether it may reach
#: GPU memory from them (GPUDirect RDMA).
KEPT_VARIABLES = (
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_JOB_GPUS",
    "SLURM_STEP_GPUS",
    "SLURM_JOB_USER",
    "SLURM_JOB_UID",
    "SLURM_JOB_PARTITION",
    "CUDA_VISIBLE_DEVICES",
    "NCCL_IB_HCA",
    "NCCL_NET_GDR_LEVEL",
)

#: Bounds of one run: how many cgroups the search for jobs (within
#: :data:`~nodescope.sources.job_cgroups.MAX_SEARCH_DEPTH` levels) and the index of other
#: processes visit, how many cgroups one job may have.
MAX_CGROUPS = 10_000
MAX_JOB_CGROUPS = 2_000
#: Threads of one process compared with the job's thread lists; beyond it a process is
#: reported as not checked rather than read for ever.
MAX_THREADS_CHECKED = 4_096

#: cgroup v1 reports "no limit" as the largest page-aligned counter value; anything from 2^62
#: up is unlimited in practice.
V1_UNLIMITED = 1 << 62

_STEP_DIR = re.compile(r"step_([A-Za-z0-9_+]+)")
_UID_DIR = re.compile(r"uid_([0-9]+)")
_DEVICE_RULE = re.compile(r"([abc]) (\*|[0-9]+):(\*|[0-9]+) ([rwm]+)")
_V1_JOB_CONTROLLERS = ("memory", "freezer")

#: Why part of a job, or a job, was skipped (the ``reason`` of
#: ``nodescope_source_records_skipped_total``, next to the cgroup walk's own reasons): a
#: thread's ``/proc/<pid>/task/<tid>/cgroup`` or ``/proc/<tid>/status`` that does not parse
#: (the thread is left out); a cgroup file of a job that does not parse (v1 jobs are read
#: file by file: the job is left out, the others go on); a memory limit of another cgroup
#: that does not parse (its limit is not applied); a registration that is not one.
THREAD_UNPARSABLE = "thread_unparsable"
JOB_UNPARSABLE = "job_unparsable"
LIMIT_UNPARSABLE = "limit_unparsable"
REGISTRATION_UNPARSABLE = "registration_unparsable"
#: a registration past ``[slurm] max_registrations`` (the ones of jobs with cgroups and the
#: newest are kept), left unread
REGISTRATION_OVER_CAP = "registration_over_cap"


# ---------------------------------------------------------------------------------------------
# Parsers (pure)


def parse_environ(text: str, source: str = "/proc/self/environ") -> Environ:
    """The :data:`KEPT_VARIABLES` of a NUL-separated environment, in file order
    (:func:`~nodescope.sources.base.kept_environ`)."""
    return kept_environ(text, KEPT_VARIABLES)


def step_of(relative: str) -> str | None:
    """The step of a cgroup path relative to its job directory (``step_0/user/task_1`` → ``0``)."""
    first = relative.strip("/").split("/", 1)[0]
    match = _STEP_DIR.fullmatch(first)
    return match.group(1) if match else None


def parse_status_tgid(text: str, source: str = "/proc/self/status") -> int:
    """The ``Tgid:`` of ``/proc/<tid>/status``: the process a thread belongs to."""
    for number, line in enumerate(text.split("\n"), start=1):
        if line.startswith("Tgid:"):
            value = line[5:].strip()
            if not value.isdigit() or not value.isascii():
                raise ParseError(source, f"Tgid {value!r} is not a number", number)
            return int(value)
    raise ParseError(source, "no Tgid line")


def parse_devices_list(text: str, source: str = "devices.list") -> tuple[int, ...] | None:
    """NVIDIA GPU minors a v1 device cgroup allows (``c 195:N``; nvidiactl excluded).

    ``None`` when the list allows every device (``a *:* rwm``, the unconstrained default) or
    every NVIDIA minor (``c 195:* ...``): the cgroup does not say which GPUs are the job's.
    """
    minors: set[int] = set()
    for number, line in enumerate(text.split("\n"), start=1):
        rule = line.strip()
        if not rule:
            continue
        match = _DEVICE_RULE.fullmatch(rule)
        if match is None:
            raise ParseError(source, f"expected 'TYPE MAJ:MIN ACCESS', found {rule!r}", number)
        kind, major, minor, _access = match.groups()
        if kind == "a":
            return None
        if kind != "c" or major == "*" or int(major) != NVIDIA_MAJOR:
            continue
        if minor == "*":
            return None
        if int(minor) != NVIDIA_CTL_MINOR:
            minors.add(int(minor))
    return tuple(sorted(minors))


def parse_v1_limit(text: str, source: str = "memory.limit_in_bytes") -> int | None:
    """A v1 ``memory.limit_in_bytes``: bytes, ``None`` for the "unlimited" sentinel."""
    value = parse_value(text, source)
    return None if value >= V1_UNLIMITED else value


def _opt_int(value: Any, source: str, what: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ParseError(source, f"{what}: expected a non-negative integer, got {value!r}")
    return value


def _opt_str(value: Any, source: str, what: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ParseError(source, f"{what}: expected a string, got {type(value).__name__}")
    return value


def parse_registration(text: str, source: str = "registration.json") -> Registration:
    """A registration file written by the hooks (``format: nodescope-registration/1``)."""
    try:
        document = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ParseError(source, f"not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise ParseError(source, "expected a JSON object")
    if document.get("format") != REGISTRATION_FORMAT:
        raise ParseError(source, f"format must be {REGISTRATION_FORMAT!r}")
    job_id = document.get("job_id")
    if not isinstance(job_id, str) or not job_id.isdigit() or not job_id.isascii():
        raise ParseError(source, f"job_id: expected a job id string, got {job_id!r}")
    gpus = document.get("gpus", [])
    if not isinstance(gpus, list) or any(
        not isinstance(g, int) or isinstance(g, bool) or g < 0 for g in gpus
    ):
        raise ParseError(source, "gpus: expected a list of GPU indices")
    registered_at = document.get("registered_at", 0.0)
    if not isinstance(registered_at, int | float) or isinstance(registered_at, bool):
        raise ParseError(source, "registered_at: expected a number")
    return Registration(
        job_id=job_id,
        uid=_opt_int(document.get("uid"), source, "uid"),
        user=_opt_str(document.get("user"), source, "user"),
        partition=_opt_str(document.get("partition"), source, "partition"),
        gpus=tuple(sorted(set(gpus))),
        registered_at=float(registered_at),
    )


# ---------------------------------------------------------------------------------------------
# Readers (IO)


def _subdirectories(path: Path) -> list[str]:
    try:
        with os.scandir(path) as entries:
            return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
    except OSError:
        return []


def _files(path: Path, tally: SkipTally) -> frozenset[str] | None:
    """The files of a cgroup directory; ``None`` when it is gone or (counted) refused."""
    try:
        with os.scandir(path) as entries:
            return frozenset(e.name for e in entries if e.is_file(follow_symlinks=False))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:
        tally.skip(CGROUP_UNREADABLE, str(path))
        return None


def _relative(root: Path, directory: Path) -> str:
    rel = directory.relative_to(root).as_posix()
    return "/" if rel == "." else "/" + rel


def find_v2_jobs(root: Path) -> list[tuple[str, str | None, Layout, Path]]:
    """(key, job id, layout, directory) of every job directory within
    :data:`MAX_SEARCH_DEPTH` levels of the v2 root, found by listing at most
    :data:`MAX_CGROUPS` directories."""
    return [
        (job.key, job.job_id, job.layout, Path(directory))
        for job, directory in find_job_directories(str(root), MAX_CGROUPS)
    ]


def _limit_value(cgroup: Cgroup | None) -> int | None:
    if cgroup is None or cgroup.memory_max is None:
        return None
    return cgroup.memory_max.value


def _tightest(*limits: int | None) -> int | None:
    present = [limit for limit in limits if limit is not None]
    return min(present) if present else None


def _parsed_limit(
    text: str, path: str, parse: Callable[[str, str], int | None], tally: SkipTally
) -> int | None:
    """A memory limit; ``None`` (no limit known, counted) when it does not parse."""
    try:
        return parse(text, path)
    except ParseError as exc:
        tally.skip(LIMIT_UNPARSABLE, str(exc))
        return None


def _ancestor_limit_v2(root: Path, directory: Path, tally: SkipTally) -> int | None:
    """The tightest ``memory.max`` strictly above ``directory`` up to the root."""
    limit: int | None = None
    current = directory.parent
    while current != root and root in current.parents:
        text = read_optional(current / "memory.max", CGROUP_STAT)
        if text is not None:
            path = str(current / "memory.max")
            limit = _tightest(limit, _parsed_limit(text, path, parse_limit, tally))
        current = current.parent
    return limit


def _read_comm(roots: Roots, pid: int, tid: int | None = None) -> str | None:
    base = f"{roots.procfs}/{pid}"
    text = read_optional(f"{base}/comm" if tid is None else f"{base}/task/{tid}/comm", PROC_PROCESS)
    # The kernel ends the name with one newline; a name may end in newlines of its own.
    return None if text is None else text.removesuffix("\n")


def _task_ids(roots: Roots, pid: int) -> list[int] | None:
    try:
        with os.scandir(f"{roots.procfs}/{pid}/task") as entries:
            return [int(e.name) for e in entries if e.name.isdigit()]
    except OSError:
        return None


def _thread_cgroup(
    roots: Roots, pid: int, tid: int, v1_controller: str | None, tally: SkipTally
) -> str | None:
    path = f"{roots.procfs}/{pid}/task/{tid}/cgroup"
    text = read_optional(path, PROC_PROCESS)
    if text is None:
        return None
    try:
        parsed = parse_proc_cgroup(text, path)
    except ParseError as exc:
        tally.skip(THREAD_UNPARSABLE, str(exc))
        return None
    return parsed.v2_path if v1_controller is None else parsed.v1_path(v1_controller)


def _read_task(
    roots: Roots,
    pid: int,
    cgroup: str,
    step: str | None,
    job_threads: frozenset[int],
    memory_max: int | None,
    slurm_internal: bool,
    v1_controller: str | None,
    tally: SkipTally,
    environ_memo: EnvironMemo | None = None,
) -> JobTask | None:
    tids = _task_ids(roots, pid)
    memo = (
        environ_memo
        if environ_memo is not None and tids is not None
        else EnvironMemo(parse_environ)
    )
    kept = memo.get(roots, pid)
    if kept is None and tids is None:
        return None  # exited since the listing
    environ = () if kept is None else kept
    escaped: list[EscapedThread] = []
    if tids is not None and job_threads and len(tids) <= MAX_THREADS_CHECKED:
        for tid in sorted(tids):
            if tid in job_threads:
                continue
            where = _thread_cgroup(roots, pid, tid, v1_controller, tally)
            if where is None:
                continue  # gone meanwhile, or skipped
            escaped.append(EscapedThread(tid, _read_comm(roots, pid, tid), where))
    return JobTask(
        pid=pid,
        comm=_read_comm(roots, pid),
        cgroup=cgroup,
        step=step,
        environ=environ,
        threads=None if tids is None else len(tids),
        escaped_threads=tuple(escaped),
        memory_max_bytes=memory_max,
        slurm_internal=slurm_internal,
    )


def _is_slurm_internal(relative: str) -> bool:
    """slurmstepd's own cgroups (``step_<s>/slurm``): Slurm's processes, not the job's."""
    parts = relative.strip("/").split("/")
    return len(parts) >= 2 and parts[1] == "slurm"


def _job_id_from_tasks(tasks: Iterable[JobTask]) -> str | None:
    ids = sorted({v for t in tasks if (v := t.env("SLURM_JOB_ID")) and v.isdigit()})
    return ids[0] if len(ids) == 1 else None


def _tgid(roots: Roots, tid: int, tally: SkipTally) -> int | None:
    path = roots.procfs / str(tid) / "status"
    text = read_optional(path, PROC_PROCESS)
    if text is None:
        return None
    try:
        return parse_status_tgid(text, str(path))
    except ParseError as exc:
        tally.skip(THREAD_UNPARSABLE, str(exc))
        return None


def read_v2_job(
    roots: Roots,
    root: Path,
    key: str,
    job_id: str | None,
    layout: Layout,
    directory: Path,
    tally: SkipTally | None = None,
) -> JobCgroup | None:
    """Read one v2 job directory and every cgroup below it; what cannot be read or parsed
    is left out and counted in ``tally``."""
    tally = SkipTally() if tally is None else tally
    above = _ancestor_limit_v2(root, directory, tally)
    cgroups: list[tuple[str, Cgroup, int | None]] = []  # (below the job, cgroup, limit)
    queue: deque[tuple[Path, int, int | None]] = deque([(directory, 0, above)])
    base_depth = len(directory.relative_to(root).parts)
    while queue and len(cgroups) < MAX_JOB_CGROUPS:
        current, depth, limit_above = queue.popleft()
        files = _files(current, tally)
        if files is None:
            continue
        subdirs = _subdirectories(current)
        cgroup = read_cgroup(
            current, _relative(root, current), base_depth + depth, files, len(subdirs), True, tally
        )
        if cgroup is None:
            continue
        effective = _tightest(limit_above, _limit_value(cgroup))
        cgroups.append((current.relative_to(directory).as_posix(), cgroup, effective))
        queue.extend((current / name, depth + 1, effective) for name in subdirs)
    return _v2_job(roots, key, job_id, layout, cgroups, None, tally)


def _v2_job(
    roots: Roots,
    key: str,
    job_id: str | None,
    layout: Layout,
    cgroups: list[tuple[str, Cgroup, int | None]],
    environ_memo: EnvironMemo | None,
    tally: SkipTally,
) -> JobCgroup | None:
    """A v2 job from its cgroups in walk order, the job's own first: (path below the job
    directory, ``.`` for itself; the record with its id lists; the effective memory limit)."""
    if not cgroups:
        return None
    threads = frozenset(t for _, c, _ in cgroups for t in (c.threads or ()))
    members: dict[int, tuple[str, Cgroup, int | None]] = {}
    for relative, cgroup, effective in cgroups:
        for pid in cgroup.procs or ():
            members.setdefault(pid, (relative, cgroup, effective))
        if cgroup.procs is None and cgroup.type == "threaded":
            # Threaded cgroups list threads only; their processes sit in the threaded domain
            # above, which may be outside the job.
            for tid in cgroup.threads or ():
                tgid = _tgid(roots, tid, tally)
                if tgid is not None:
                    members.setdefault(tgid, (relative, cgroup, effective))
    tasks: list[JobTask] = []
    for pid in sorted(members):
        relative, cgroup, effective = members[pid]
        task = _read_task(
            roots,
            pid,
            cgroup.path,
            step_of(relative),
            threads,
            effective,
            _is_slurm_internal(relative),
            None,
            tally,
            environ_memo,
        )
        if task is not None:
            tasks.append(task)
    steps = tuple(
        JobStep(step, c.path, c)
        for relative, c, _ in cgroups
        if relative != "." and "/" not in relative and (step := step_of(relative)) is not None
    )
    limits = [_limit_value(c) for _, c, _ in cgroups]
    if job_id is None:
        job_id = _job_id_from_tasks(tasks)
    return JobCgroup(
        key=key,
        job_id=job_id,
        layout=layout,
        path=cgroups[0][1].path,
        uid=None,
        stats=cgroups[0][1],
        steps=steps,
        tasks=tuple(tasks),
        memory_limit_bytes=_tightest(*limits),
        gpu_minors=None,
    )


def _v2_from_tree(
    roots: Roots, tree: CgroupTree, environ_memo: EnvironMemo | None, tally: SkipTally
) -> tuple[list[JobCgroup], bool, tuple[OtherCgroup, ...]]:
    """(jobs, whether any job directory was found, the other cgroups) from a whole walk of
    the v2 tree: what :func:`find_v2_jobs`, :func:`read_v2_job` and :func:`read_others_v2`
    find by reading the directories, without reading any cgroup file again."""
    found = jobs_in_tree(tree)
    jobs: list[JobCgroup] = []
    for job, members in found:
        top = members[0]
        above: int | None = None
        parent_path = top.parent_path
        while parent_path is not None and parent_path != "/":
            ancestor = tree.get(parent_path)
            above = _tightest(above, _limit_value(ancestor))
            parent_path = None if ancestor is None else ancestor.parent_path
        # Walk order lists a parent before its children, as read_v2_job reads them.
        cgroups: list[tuple[str, Cgroup, int | None]] = []
        effective_of: dict[str, int | None] = {}
        prefix = len(top.path) + 1
        for cgroup in members[:MAX_JOB_CGROUPS]:
            limit_above = above if cgroup is top else effective_of[cgroup.parent_path or "/"]
            effective = _tightest(limit_above, _limit_value(cgroup))
            effective_of[cgroup.path] = effective
            cgroups.append((cgroup.path[prefix:] or ".", cgroup, effective))
        read = _v2_job(roots, job.key, job.job_id, job.layout, cgroups, environ_memo, tally)
        if read is not None:
            jobs.append(read)
    # The index of read_others_v2: every cgroup outside the job directories.
    skipped = {members[0].path for _, members in found}
    limits: dict[str, int | None] = {"/": None}
    others: list[OtherCgroup] = []
    for cgroup in tree.cgroups:
        if cgroup.path == "/":
            limit = None
        else:
            up = cgroup.parent_path or "/"
            if up not in limits or cgroup.path in skipped:
                continue
            limit = _tightest(limits[up], _limit_value(cgroup))
            limits[cgroup.path] = limit
        pids = tuple(sorted(set(cgroup.procs or ())))
        if pids:
            others.append(OtherCgroup(cgroup.path, pids, limit))
    return jobs, bool(found), tuple(others)


def _v1_value(path: Path) -> int | None:
    text = read_optional(path)
    return None if text is None else parse_value(text, str(path))


def read_v1_stats(cgroupfs: Path, relative: str, depth: int) -> Cgroup:
    """The figures of one v1 job or step cgroup, from the memory, cpuacct and pids
    hierarchies, in the v2 record's terms (``memory.max`` ← ``memory.limit_in_bytes``,
    ``memory.peak`` ← ``memory.max_usage_in_bytes``, ``oom_kill`` ← ``memory.oom_control``,
    ``max`` ← ``memory.failcnt``, ``cpu.stat usage_usec`` ← ``cpuacct.usage`` / 1000)."""
    rel = relative.strip("/")
    memory_dir = cgroupfs / "memory" / rel
    limit_path = memory_dir / "memory.limit_in_bytes"
    limit_text = read_optional(limit_path)
    oom_path = memory_dir / "memory.oom_control"
    oom_text = read_optional(oom_path)
    oom_kill = (
        None if oom_text is None else parse_key_values(oom_text, str(oom_path)).get("oom_kill")
    )
    failcnt = _v1_value(memory_dir / "memory.failcnt")
    events = None
    if oom_kill is not None or failcnt is not None:
        events = MemoryEvents(max=failcnt, oom_kill=oom_kill)
    usage_ns = _v1_value(cgroupfs / "cpuacct" / rel / "cpuacct.usage")
    return Cgroup(
        path=relative,
        depth=depth,
        type=None,
        controllers=None,
        nr_children=0,
        memory_current=_v1_value(memory_dir / "memory.usage_in_bytes"),
        memory_peak=_v1_value(memory_dir / "memory.max_usage_in_bytes"),
        memory_max=None
        if limit_text is None
        else Limit(parse_v1_limit(limit_text, str(limit_path))),
        memory_events=events,
        cpu_stat=None if usage_ns is None else CpuStat(usage_usec=usage_ns // 1000),
        pids_current=_v1_value(cgroupfs / "pids" / rel / "pids.current"),
    )


#: Skip reason of a v1 ``memory.oom_control`` below a job that does not parse.
SKIP_V1_OOM_CONTROL = "v1_oom_control_unparsable"


def v1_oom_kills_below(
    memory_dir: Path, tally: SkipTally, listed: list[Path] | None = None
) -> dict[str, int]:
    """``oom_kill`` of ``memory.oom_control`` of every memory cgroup strictly below
    ``memory_dir`` that has killed, by its path relative to ``memory_dir``; at most
    :data:`MAX_JOB_CGROUPS` cgroups are visited.

    On cgroup v1 the kernel counts an OOM kill only in the memory cgroup of the task it
    killed: ``memcg_memory_event()`` (``include/linux/memcontrol.h``) stops after the first
    level unless the memory controller is on the unified hierarchy. Slurm puts a job's
    processes in ``step_<s>/task_<n>``, so a job's or step's own file says 0 while its task
    was killed; their kills are the sum over everything below. ``listed``: the cgroups below
    ``memory_dir`` already found by a walk of the memory hierarchy, read instead of walking
    it again."""
    found: dict[str, int] = {}
    walk = listed is None
    queue: deque[Path] = deque(
        (memory_dir / name for name in _subdirectories(memory_dir)) if walk else listed or ()
    )
    visited = 0
    while queue and visited < MAX_JOB_CGROUPS:
        current = queue.popleft()
        visited += 1
        path = current / "memory.oom_control"
        text = read_optional(path)
        if text is not None:
            try:
                kills = parse_key_values(text, str(path)).get("oom_kill")
            except ParseError:
                tally.skip(SKIP_V1_OOM_CONTROL, str(path))
                kills = None
            if kills:
                found[current.relative_to(memory_dir).as_posix()] = kills
        if walk:
            queue.extend(current / name for name in _subdirectories(current))
    return found


def _with_oom_kills(stats: Cgroup, below: int) -> Cgroup:
    """``stats`` with the OOM kills of the cgroups below it added to its own."""
    if not below:
        return stats
    events = stats.memory_events or MemoryEvents()
    own = events.oom_kill or 0
    return dataclasses.replace(
        stats, memory_events=dataclasses.replace(events, oom_kill=own + below)
    )


def find_v1_jobs(cgroupfs: Path) -> tuple[str, list[tuple[str, int, Path]]] | None:
    """(controller, [(job id, uid, directory)]) of the first v1 hierarchy among
    :data:`_V1_JOB_CONTROLLERS` that has Slurm's ``slurm[_<node>]`` directory."""
    for controller in _V1_JOB_CONTROLLERS:
        hierarchy = cgroupfs / controller
        if (hierarchy / "cgroup.controllers").exists():
            continue  # a v2 mount that happens to be named like a controller
        tops = [n for n in _subdirectories(hierarchy) if n == "slurm" or n.startswith("slurm_")]
        if not tops:
            continue
        jobs: list[tuple[str, int, Path]] = []
        for top in tops:
            for uid_name in _subdirectories(hierarchy / top):
                uid_match = _UID_DIR.fullmatch(uid_name)
                if uid_match is None:
                    continue
                for job_name in _subdirectories(hierarchy / top / uid_name):
                    job = job_dir_id(job_name)
                    if job is not None:
                        jobs.append(
                            (job, int(uid_match.group(1)), hierarchy / top / uid_name / job_name)
                        )
        return controller, jobs
    return None


def read_v1_job(
    roots: Roots,
    controller: str,
    job_id: str,
    uid: int,
    directory: Path,
    tally: SkipTally | None = None,
) -> JobCgroup:
    """One v1 job; raises :class:`ParseError` when one of its figures does not parse (the
    caller skips the job). Task list lines that are not ids are counted in ``tally``."""
    tally = SkipTally() if tally is None else tally
    hierarchy = roots.cgroupfs / controller
    job_rel = _relative(hierarchy, directory)
    members: dict[int, tuple[str, str]] = {}  # pid -> (cgroup path, path below the job)
    threads: set[int] = set()
    dirs: list[Path] = []
    queue: deque[Path] = deque([directory])
    while queue and len(dirs) < MAX_JOB_CGROUPS:
        current = queue.popleft()
        dirs.append(current)
        procs_path = current / "cgroup.procs"
        text = read_optional(procs_path, CGROUP_LIST)
        relative = current.relative_to(directory).as_posix()
        for pid in () if text is None else parse_ids(text, str(procs_path), tally):
            members.setdefault(pid, (_relative(hierarchy, current), relative))
        tasks_path = current / "tasks"
        tasks_text = read_optional(tasks_path, CGROUP_LIST)
        if tasks_text is not None:
            threads.update(parse_ids(tasks_text, str(tasks_path), tally))
        queue.extend(current / name for name in _subdirectories(current))
    limits: list[int | None] = []
    steps: list[JobStep] = []
    stats = read_v1_stats(roots.cgroupfs, job_rel, len(directory.relative_to(hierarchy).parts))
    limits.append(_limit_value(stats))
    step_limits: dict[str, int | None] = {}
    for name in _subdirectories(directory):
        step = step_of(name)
        if step is None:
            continue
        step_stats = read_v1_stats(roots.cgroupfs, f"{job_rel}/{name}", stats.depth + 1)
        steps.append(JobStep(step, step_stats.path, step_stats))
        step_limits[step] = _limit_value(step_stats)
        limits.append(step_limits[step])
    # OOM kills are counted where the task was (task_<n>): the job's and each step's are
    # the sums over their subtrees.
    # The job's walk above went through the memory hierarchy (the usual one): its cgroups
    # are read, not listed again.
    kills_below = v1_oom_kills_below(
        roots.cgroupfs / "memory" / job_rel.strip("/"),
        tally,
        dirs[1:] if controller == "memory" else None,
    )
    if kills_below:
        stats = _with_oom_kills(stats, sum(kills_below.values()))
        steps = [
            step
            if step.stats is None
            else dataclasses.replace(
                step,
                stats=_with_oom_kills(
                    step.stats,
                    sum(
                        kills
                        for below, kills in kills_below.items()
                        if below.startswith(step.path.rsplit("/", 1)[-1] + "/")
                    ),
                ),
            )
            for step in steps
        ]
    job_limit = _limit_value(stats)
    tasks: list[JobTask] = []
    frozen_threads = frozenset(threads)
    for pid in sorted(members):
        cgroup, relative = members[pid]
        step = step_of(relative)
        effective = _tightest(job_limit, step_limits.get(step) if step is not None else None)
        task = _read_task(
            roots,
            pid,
            cgroup,
            step,
            frozen_threads,
            effective,
            _is_slurm_internal(relative),
            controller,
            tally,
        )
        if task is not None:
            tasks.append(task)
    devices_path = roots.cgroupfs / "devices" / job_rel.strip("/") / "devices.list"
    devices_text = read_optional(devices_path)
    gpu_minors = (
        None if devices_text is None else parse_devices_list(devices_text, str(devices_path))
    )
    return JobCgroup(
        key=directory.name,
        job_id=job_id,
        layout="v1",
        path=job_rel,
        uid=uid,
        stats=stats,
        steps=tuple(steps),
        tasks=tuple(tasks),
        memory_limit_bytes=_tightest(*limits),
        gpu_minors=gpu_minors,
    )


def _read_others(
    root: Path,
    skip: Iterable[Path],
    limit_file: str,
    parse: Callable[[str, str], int | None],
    tally: SkipTally,
) -> tuple[tuple[OtherCgroup, ...], bool]:
    """Every populated cgroup below ``root`` outside the job directories, with its effective
    memory limit (the tightest ``limit_file`` on its path); a limit or id that does not parse
    is counted in ``tally`` and left out."""
    skipped = set(skip)
    others: list[OtherCgroup] = []
    queue: deque[tuple[Path, int | None]] = deque([(root, None)])
    visited = 0
    while queue:
        if visited >= MAX_CGROUPS:
            return tuple(others), True
        current, limit_above = queue.popleft()
        visited += 1
        limit = limit_above
        if current != root:
            text = read_optional(current / limit_file, CGROUP_STAT)
            if text is not None:
                own = _parsed_limit(text, str(current / limit_file), parse, tally)
                limit = _tightest(limit, own)
        procs_path = current / "cgroup.procs"
        text = read_optional(procs_path, CGROUP_LIST)
        pids = () if text is None else tuple(sorted(set(parse_ids(text, str(procs_path), tally))))
        if pids:
            others.append(OtherCgroup(_relative(root, current), pids, limit))
        for name in _subdirectories(current):
            child = current / name
            if child not in skipped:
                queue.append((child, limit))
    return tuple(others), False


def read_others_v2(
    root: Path, skip: Iterable[Path], tally: SkipTally | None = None
) -> tuple[tuple[OtherCgroup, ...], bool]:
    tally = SkipTally() if tally is None else tally
    return _read_others(root, skip, "memory.max", parse_limit, tally)


def read_others_v1(
    hierarchy: Path, skip: Iterable[Path], tally: SkipTally | None = None
) -> tuple[tuple[OtherCgroup, ...], bool]:
    tally = SkipTally() if tally is None else tally
    return _read_others(hierarchy, skip, "memory.limit_in_bytes", parse_v1_limit, tally)


def _registration_rank(name: str, known: frozenset[str]) -> tuple[bool, int, str]:
    """The order in which registrations are kept past the cap: jobs with cgroups on the node
    first, then the newest job ids."""
    job = name[: -len(".json")]
    return (job not in known, -int(job) if job.isdigit() and len(job) < 19 else 0, name)


class RegistrationReader:
    """The prolog's registrations, each file parsed once: a file is read again only when its
    inode, size or modification time changes (the hooks replace a registration by renaming a
    new file over it). At most ``cap`` files are looked at per run, the jobs with cgroups on
    the node first, then the newest job ids; the rest are counted as skipped
    (:data:`REGISTRATION_OVER_CAP`). The kept parses are those of this run's files only."""

    def __init__(self, cap: int = DEFAULT_MAX_REGISTRATIONS) -> None:
        self.cap = cap
        self._parsed: dict[str, tuple[tuple[int, int, int], Registration | str]] = {}

    def read(
        self, roots: Roots, tally: SkipTally, known: frozenset[str] = frozenset()
    ) -> tuple[Registration, ...]:
        directory = str(registrations_dir(roots))
        try:
            with os.scandir(directory) as entries:
                names = [
                    e.name
                    for e in entries
                    if e.name.endswith(".json") and not e.name.startswith(".")
                ]
        except OSError:
            self._parsed = {}
            return ()
        if len(names) > self.cap:
            names.sort(key=lambda n: _registration_rank(n, known))
            left = len(names) - self.cap
            tally.merge(
                Skipped(
                    {REGISTRATION_OVER_CAP: left},
                    {REGISTRATION_OVER_CAP: f"{directory}: {left} past the cap of {self.cap}"},
                )
            )
            del names[self.cap :]
        parsed: dict[str, tuple[tuple[int, int, int], Registration | str]] = {}
        found: list[Registration] = []
        for name in names:
            path = f"{directory}/{name}"
            try:
                st = os.lstat(path)
            except OSError:
                continue  # removed by the epilog meanwhile
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
            cached = self._parsed.get(name)
            if cached is not None and cached[0] == key:
                value = cached[1]
            else:
                text = read_optional(path)
                if text is None:
                    continue
                try:
                    value = parse_registration(text, path)
                except ParseError as exc:
                    value = str(exc)
            parsed[name] = (key, value)
            if isinstance(value, str):
                tally.skip(REGISTRATION_UNPARSABLE, value)
            else:
                found.append(value)
        self._parsed = parsed
        return tuple(sorted(found, key=lambda r: _job_order(r.job_id)))


def read_registrations(
    roots: Roots,
    tally: SkipTally | None = None,
    cap: int = DEFAULT_MAX_REGISTRATIONS,
) -> tuple[Registration, ...]:
    """The prolog's registrations (at most ``cap``); a file that is not one is skipped,
    counted in ``tally``."""
    return RegistrationReader(cap).read(roots, SkipTally() if tally is None else tally)


def _job_order(job: str) -> tuple[int, str]:
    return (int(job), job) if job.isdigit() else (1 << 62, job)


def read_jobs(
    roots: Roots,
    tree: CgroupTree | None = None,
    environ_memo: EnvironMemo | None = None,
    registrations: RegistrationReader | None = None,
) -> JobsData:
    """Every job of the node. ``tree``: a whole walk of the v2 hierarchy with the id lists
    (read here when not given); ``environ_memo``: kept environments of known processes;
    ``registrations``: the reader that keeps the parsed registrations between runs.

    A job, cgroup, thread or registration that cannot be read or parsed is left out and
    counted in the record's ``skipped`` (with what the walk skipped): one job's junk file or
    refused directory never hides the other jobs.
    """
    tally = SkipTally()
    reader = RegistrationReader() if registrations is None else registrations
    if tree is None:
        tree = read_tree(roots, keep_pids=True)
    hierarchy = find_v2_root(roots.cgroupfs)
    jobs: list[JobCgroup] = []

    def data(layout: str, others: tuple[OtherCgroup, ...], truncated: bool) -> JobsData:
        known = frozenset(j.job_id for j in jobs if j.job_id is not None)
        kept = reader.read(roots, tally, known)
        skipped = tally.freeze()
        if layout == "v2" and tree is not None:
            skipped = tree.skipped + skipped
        return JobsData(layout, tuple(_sorted(jobs)), kept, others, truncated, skipped)

    if hierarchy.path is not None and tree.mode != "none" and not tree.truncated:
        jobs, any_found, others = _v2_from_tree(roots, tree, environ_memo, tally)
        if any_found or hierarchy.mode == "unified":
            return data("v2", others, False)
        jobs = []
        tally = SkipTally()  # what the v2 search skipped is not what the v1 read reports
    elif hierarchy.path is not None:
        # A tree too large for one walk: search and read the job directories themselves.
        found = find_v2_jobs(hierarchy.path)
        for key, job_id, layout, directory in found:
            job = read_v2_job(roots, hierarchy.path, key, job_id, layout, directory, tally)
            if job is not None:
                jobs.append(job)
        if found or hierarchy.mode == "unified":
            others, truncated = read_others_v2(hierarchy.path, (d for *_, d in found), tally)
            return data("v2", others, truncated)
    v1 = find_v1_jobs(roots.cgroupfs)
    if v1 is not None:
        controller, v1_jobs = v1
        for job_id, uid, directory in v1_jobs:
            try:
                jobs.append(read_v1_job(roots, controller, job_id, uid, directory, tally))
            except ParseError as exc:
                tally.skip(JOB_UNPARSABLE, str(exc))
        others, truncated = read_others_v1(
            roots.cgroupfs / controller, (d for *_, d in v1_jobs), tally
        )
        return data("v1", others, truncated)
    if hierarchy.path is not None:
        others, truncated = read_others_v2(hierarchy.path, (), tally)
        return data("v2", others, truncated)
    return data("none", (), False)


def _sorted(jobs: list[JobCgroup]) -> list[JobCgroup]:
    return sorted(jobs, key=lambda j: (_job_order(j.job_id or j.key), j.key))


class JobsSource:
    """Jobs from the cgroup walk it shares with the other cgroup sources of its collector
    (:class:`~nodescope.sources.cgroup.CycleWalk`); the static cgroup files and the
    environments of known processes are read every ``slow_every`` runs."""

    name = NAME

    def __init__(
        self,
        slow_every: int = SLOW_EVERY,
        walk: CycleWalk | None = None,
        publish: Callable[[JobsData], None] | None = None,
        max_registrations: int = DEFAULT_MAX_REGISTRATIONS,
    ) -> None:
        self.walk = CycleWalk() if walk is None else walk
        # Where each record also goes: the traces source checks spool directories against
        # the jobs' owners, and is handed the latest record through this.
        self._publish = publish
        self.walk.needed_by(self.name)
        self.slow_every = slow_every
        self._environ = EnvironMemo(parse_environ)
        self._registrations = RegistrationReader(max_registrations)
        self._runs = 0

    @property
    def slow_every(self) -> int:
        """Runs between two reads of a known process's environment, and walks between two
        reads of the static cgroup files (setting it sets the cadence of the walk it shares)."""
        return self._slow_every

    @slow_every.setter
    def slow_every(self, value: int) -> None:
        self._slow_every = value
        self.walk.slow_every = value

    def collect(self, roots: Roots) -> JobsData:
        self._environ.refresh = self._runs % max(1, self.slow_every) == 0
        self._runs += 1
        data = read_jobs(roots, self.walk.tree(roots), self._environ, self._registrations)
        self._environ.end_run()
        if self._publish is not None:
            self._publish(data)
        return data

    def close(self) -> None:
        self._environ = EnvironMemo(parse_environ)
        self._registrations = RegistrationReader(self._registrations.cap)
        self._runs = 0


def make_source(
    walk: CycleWalk | None = None,
    publish: Callable[[JobsData], None] | None = None,
    max_registrations: int = DEFAULT_MAX_REGISTRATIONS,
) -> JobsSource:
    """The source; ``walk``: the cgroup walk it shares with the other cgroup sources;
    ``publish``: called with every record it returns; ``max_registrations``: registrations
    read at most (``[slurm] max_registrations``)."""
    return JobsSource(walk=walk, publish=publish, max_registrations=max_registrations)


SPEC = SourceSpec(
    name="jobs",
    default_interval=15.0,
    help=(
        "Slurm jobs: job cgroups (v2, SLUID, v1), their processes, threads and figures;"
        " prolog registrations"
    ),
    build=lambda inputs: make_source(
        walk=inputs.cgroup_walk,
        publish=inputs.jobs.publish,
        max_registrations=inputs.max_registrations,
    ),
    rates=None,
    metric_area="nodescope_exporters.job_metrics",
    sim_parts=frozenset({"processes", "cgroups"}),
)


__all__ = [
    "JOBS",
    "JOB_UNPARSABLE",
    "KEPT_VARIABLES",
    "LIMIT_UNPARSABLE",
    "MAX_CGROUPS",
    "MAX_JOB_CGROUPS",
    "MAX_SEARCH_DEPTH",
    "MAX_THREADS_CHECKED",
    "NAME",
    "NVIDIA_CTL_MINOR",
    "NVIDIA_MAJOR",
    "REGISTRATION_FORMAT",
    "REGISTRATION_OVER_CAP",
    "REGISTRATION_UNPARSABLE",
    "RUN_SUBDIR",
    "THREAD_UNPARSABLE",
    "V1_UNLIMITED",
    "EscapedThread",
    "JobCgroup",
    "JobStep",
    "JobTask",
    "JobsData",
    "JobsSource",
    "Layout",
    "OtherCgroup",
    "Registration",
    "RegistrationReader",
    "find_v1_jobs",
    "find_v2_jobs",
    "is_sluid_dir",
    "job_dir_id",
    "make_source",
    "parse_devices_list",
    "parse_environ",
    "parse_gpu_list",
    "parse_registration",
    "parse_status_tgid",
    "parse_v1_limit",
    "read_jobs",
    "read_others_v1",
    "read_others_v2",
    "read_registrations",
    "read_v1_job",
    "read_v1_stats",
    "read_v2_job",
    "registrations_dir",
    "step_of",
]
