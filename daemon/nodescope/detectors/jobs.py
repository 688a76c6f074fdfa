"""Jobs whose cgroups do not hold them, whose memory limit does not apply, that lose processes
to the OOM killer or stall on memory.

Input: the job registry (:mod:`nodescope.model.jobs`: job cgroups, processes and their threads,
prolog registrations, NVML compute processes) of the ``jobs`` source's latest sample and, for
OOM kills, of the sample before it.

* ``job_cgroup_escape``: a compute process on a GPU of job J that is not in J's cgroups (a rank
  started over ssh by ``mpirun`` lands in the user's session scope), or threads of a job process
  placed in a cgroup outside the job (``cgroup.threads`` of the job against the process's
  ``task/`` list, threaded subtrees). Slurm neither limits nor accounts nor kills them.
* ``job_memory_limit_not_applied``: the job asked for memory (a ``memory.max`` somewhere in its
  subtree) but a cgroup that holds its processes has no limit up to the root: the limit set on
  one step (Slurm cgroup/v2 sets ``memory.max`` on steps, the job level may say ``max``) does
  not cover processes in other steps or outside the job.
* ``job_oom_kill``: ``oom_kill`` of ``memory.events`` (v1: ``memory.oom_control``) rose for a
  job or step; names the processes of that step that vanished in the same interval.
* ``job_memory_pressure``: all the job's tasks stalled on memory for at least
  ``memory_pressure_percent`` of the last minute (``memory.pressure`` ``full avg60``).
"""

from __future__ import annotations

from collections.abc import Iterable

from nodescope.config import Config
from nodescope.model.cgroup import Cgroup
from nodescope.model.counters import counter_delta
from nodescope.model.finding import Finding, Severity
from nodescope.model.jobs import Job
from nodescope.model.snapshot import Snapshot

ESCAPE = "job_cgroup_escape"
MEMORY_LIMIT = "job_memory_limit_not_applied"
OOM_KILL = "job_oom_kill"
MEMORY_PRESSURE = "job_memory_pressure"

_GIB = 1 << 30


def _list(items: Iterable[object], limit: int = 6) -> str:
    shown = [str(i) for i in items]
    extra = len(shown) - limit
    text = ", ".join(shown[:limit])
    return f"{text} and {extra} more" if extra > 0 else text


def _size(value: int) -> str:
    return f"{value / _GIB:.1f} GiB" if value >= _GIB else f"{value / (1 << 20):.0f} MiB"


def escapes(job: Job) -> Finding | None:
    if not job.escaped_processes and not job.escaped_threads:
        return None
    parts: list[str] = []
    if job.escaped_processes:
        where = sorted({e.cgroup or "an unknown cgroup" for e in job.escaped_processes})
        gpus = sorted({e.gpu for e in job.escaped_processes})
        parts.append(
            f"{len(job.escaped_processes)} compute process(es) on its GPU(s) {_list(gpus)}"
            f" (pid {_list(e.pid for e in job.escaped_processes)}) run outside the job's"
            f" cgroup, in {_list(where, 3)}"
        )
    if job.escaped_threads:
        where = sorted({e.cgroup or "an unknown cgroup" for e in job.escaped_threads})
        names = sorted({e.comm for e in job.escaped_threads if e.comm})
        named = f" ({_list(names, 4)})" if names else ""
        parts.append(
            f"{len(job.escaped_threads)} thread(s){named} of job processes"
            f" {_list(sorted({e.pid for e in job.escaped_threads}))} sit in {_list(where, 3)}"
        )
    message = f"job {job.job_id}: {'; '.join(parts)}: Slurm neither limits, accounts nor kills them"
    evidence = {
        "escaped_processes": float(len(job.escaped_processes)),
        "escaped_threads": float(len(job.escaped_threads)),
    }
    return Finding(ESCAPE, Severity.WARNING, {"job": job.job_id}, evidence, message)


def memory_limit(job: Job) -> Finding | None:
    if job.memory_limit_bytes is None or not job.unlimited:
        return None
    cgroups = {t.cgroup for t in job.tasks if t.pid in job.unlimited}
    cgroups |= {e.cgroup for e in job.escaped_processes if e.pid in job.unlimited and e.cgroup}
    limited = [s.name for s in job.steps if s.stats is not None and _limited(s.stats)]
    on = f" on step {_list(limited)}" if limited else ""
    message = (
        f"job {job.job_id} asked for memory (memory.max {_size(job.memory_limit_bytes)}{on})"
        f" but {len(job.unlimited)} of its processes (pid {_list(job.unlimited)}) sit in"
        f" cgroups with memory.max = max up to the root: {_list(sorted(cgroups), 3)}"
    )
    evidence = {
        "requested_bytes": float(job.memory_limit_bytes),
        "unlimited_processes": float(len(job.unlimited)),
    }
    return Finding(MEMORY_LIMIT, Severity.WARNING, {"job": job.job_id}, evidence, message)


def _limited(stats: Cgroup) -> bool:
    return stats.memory_max is not None and stats.memory_max.value is not None


def _oom_kills(stats: Cgroup | None) -> int | None:
    if stats is None or stats.memory_events is None:
        return None
    return stats.memory_events.oom_kill


def oom_kills(previous: Job, current: Job) -> list[Finding]:
    """OOM kills between two samples of one job, per step (the job level when no step
    accounts for them)."""
    findings: list[Finding] = []
    before_steps = {s.name: s for s in previous.steps}
    stepped = 0
    for step in current.steps:
        before = before_steps.get(step.name)
        if before is None:
            continue
        prev_kills, cur_kills = _oom_kills(before.stats), _oom_kills(step.stats)
        if prev_kills is None or cur_kills is None:
            continue
        delta = counter_delta(prev_kills, cur_kills)
        if not delta:
            continue
        stepped += delta
        findings.append(_oom_finding(previous, current, step.name, delta))
    prev_job, cur_job = _oom_kills(previous.stats), _oom_kills(current.stats)
    if prev_job is not None and cur_job is not None:
        delta = counter_delta(prev_job, cur_job)
        if delta and delta > stepped:
            findings.append(_oom_finding(previous, current, None, delta - stepped))
    return findings


def _oom_finding(previous: Job, current: Job, step: str | None, kills: int) -> Finding:
    alive = {t.pid for t in current.tasks}
    gone = [
        t for t in previous.user_tasks() if t.pid not in alive and (step is None or t.step == step)
    ]
    named = (f"pid {t.pid} ({t.comm or '?'})" for t in gone)
    victims = f": {_list(named)} gone" if gone else ""
    where = f"step {step}" if step is not None else "the job cgroup"
    stats = next((s.stats for s in current.steps if s.name == step), current.stats)
    limit = ""
    if stats is not None and stats.memory_max is not None and stats.memory_max.value is not None:
        limit = f" at memory.max {_size(stats.memory_max.value)}"
    message = (
        f"job {current.job_id}: the OOM killer killed {kills} process(es) in {where}{limit}"
        f"{victims}"
    )
    subjects = {"job": current.job_id, "step": step if step is not None else "job"}
    evidence = {"oom_kills": float(kills), "processes_gone": float(len(gone))}
    return Finding(OOM_KILL, Severity.CRITICAL, subjects, evidence, message)


def memory_pressure(job: Job, percent: float) -> Finding | None:
    stats = job.stats
    if stats is None or stats.memory_pressure is None or stats.memory_pressure.full is None:
        return None
    full = stats.memory_pressure.full
    if full.avg60 < percent:
        return None
    message = (
        f"job {job.job_id}: all its tasks stalled on memory {full.avg60:.1f} % of the last"
        f" minute (memory.pressure full avg60; avg10 {full.avg10:.1f} %)"
    )
    limit = stats.memory_max.value if stats.memory_max is not None else None
    if stats.memory_current is not None and limit is not None:
        message += f"; using {_size(stats.memory_current)} of {_size(limit)}"
    evidence = {
        "value": full.avg60,
        "memory_full_avg60_percent": full.avg60,
        "memory_full_avg10_percent": full.avg10,
    }
    return Finding(MEMORY_PRESSURE, Severity.WARNING, {"job": job.job_id}, evidence, message)


def evaluate(
    previous: tuple[Job, ...] | None, current: tuple[Job, ...], pressure_percent: float
) -> list[Finding]:
    findings: list[Finding] = []
    before = {j.job_id: j for j in previous or ()}
    for job in current:
        for found in (escapes(job), memory_limit(job), memory_pressure(job, pressure_percent)):
            if found is not None:
                findings.append(found)
        old = before.get(job.job_id)
        if old is not None and old.running and job.running:
            findings.extend(oom_kills(old, job))
    return findings


def detect(previous: Snapshot | None, snapshot: Snapshot, config: Config) -> list[Finding]:
    """The registry's form: the registry of the ``jobs`` source's latest record and of the
    one before it, both joined with the GPUs' compute processes of now."""
    if not config.detectors.jobs.enabled:
        return []
    percent = config.detectors.jobs.memory_pressure_percent
    derived = snapshot.derived
    before, current = derived.jobs_before, derived.jobs
    # Both registries stay the same objects while the jobs record and the compute processes
    # do: so do the findings.
    return derived.reuse(
        "jobs", (before, current), percent, lambda: evaluate(before, current, percent)
    )
