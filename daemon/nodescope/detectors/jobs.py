"""Jobs whose cgroups do not hold them, whose memory limit does not apply, that lose processes
to the OOM killer or stall on memory.

Input: the job registry (:mod:`nodescope.model.jobs`: job cgroups, processes and their threads,
prolog registrations, NVML compute processes) of the ``jobs`` source's latest sample and, for
OOM kills and memory-limit thrash, of the sample before it and the seconds between the two.

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
* ``job_memory_limit_thrash``: the job cgroup or a step hits its own ``memory.max`` at
  ``memory_limit_thrash_events_per_second`` or more (``memory.events`` ``max``: a charge that
  found the cgroup at its limit and had to reclaim first) AND the reclaim costs its tasks
  time: they stalled on memory for at least ``memory_limit_thrash_stall_percent`` of the
  interval (the growth of ``memory.pressure`` ``some total``), or the OOM killer struck at
  that level in the interval. Page cache filling a limit is how Linux uses memory: it hits
  ``max`` as often and makes nobody wait. Where the cgroup has no ``memory.pressure`` (cgroup
  v1, a kernel without PSI) the cost is judged by pages refaulted after reclaim
  (``memory.stat`` ``workingset_refault*``), and without either nothing shows a cost: no
  finding. Named at the level whose limit is hit, with that cgroup's ``memory.max`` and
  ``memory.current``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from nodescope.alerts import AlertRule
from nodescope.config import JobsSettings
from nodescope.detectors.kinds import FindingKind, actions, severities
from nodescope.model.cgroup import Cgroup, Pressure, PressureLine
from nodescope.model.counters import counter_delta
from nodescope.model.finding import Finding, Severity
from nodescope.model.job_records import JOBS
from nodescope.model.jobs import Job
from nodescope.model.pressure import PRESSURE, full_stall_ratio, with_node_stall
from nodescope.model.snapshot import Snapshot

ESCAPE = "job_cgroup_escape"
MEMORY_LIMIT = "job_memory_limit_not_applied"
OOM_KILL = "job_oom_kill"
MEMORY_PRESSURE = "job_memory_pressure"
THRASH = "job_memory_limit_thrash"

_CGROUPS = (
    "the job cgroups of Slurm's cgroup/v2 plugin (`cgroup.procs`, `cgroup.threads`,"
    " `memory.max`, `memory.events`, `memory.pressure`) or its cgroup/v1 plugin"
    " (`cgroup.procs`, `tasks`, `memory.limit_in_bytes`, `memory.oom_control`,"
    " `memory.failcnt`; no pressure, so no `job_memory_pressure`), `/proc/<pid>/task`, NVML"
    " compute processes, Slurm's prolog registrations"
)
_CGROUPS_HARDWARE = "yes, with either plugin (docs/jobs.md)"


def _warning(name: str, meaning: str) -> FindingKind:
    return FindingKind(
        name,
        severities(Severity.WARNING),
        actions(warning="alert"),
        meaning=meaning,
        signal=_CGROUPS,
        hardware=_CGROUPS_HARDWARE,
    )


SPECS = (
    _warning(
        ESCAPE,
        "a compute process on the job's GPUs, or a thread of a job process, sits outside the"
        " job's cgroups: Slurm neither limits, accounts nor kills it",
    ),
    _warning(
        MEMORY_LIMIT,
        "the job asked for memory but a cgroup that holds its processes has no limit up to the"
        " root",
    ),
    FindingKind(
        OOM_KILL,
        severities(Severity.CRITICAL),
        actions(critical="drain"),
        meaning="the kernel killed a process of the job for its cgroup's memory",
        signal=_CGROUPS,
        hardware=_CGROUPS_HARDWARE,
        alert=AlertRule(for_seconds=0.0, resolve_after_seconds=600.0),
    ),
    _warning(
        MEMORY_PRESSURE,
        "all the job's tasks stalled on memory for a share of the last minute",
    ),
    _warning(
        THRASH,
        "the job or a step hits its own memory limit at a rate and the reclaim costs its tasks"
        " time",
    ),
)

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


def _own_max_events(job: Job, stats: Cgroup | None) -> int | None:
    """The ``max`` events of the limit of this very cgroup: ``memory.events.local`` (the kernel
    counts a ``max`` event on the cgroup whose limit the charge hit, and on its ancestors in
    ``memory.events``), v1's ``memory.failcnt`` (already the cgroup's own limit). ``None``:
    only the hierarchical count is known (kernels before 5.2)."""
    if stats is None:
        return None
    if stats.memory_events_local is not None and stats.memory_events_local.max is not None:
        return stats.memory_events_local.max
    if job.layout == "v1" and stats.memory_events is not None:
        return stats.memory_events.max
    return None


def _all_max_events(stats: Cgroup | None) -> int | None:
    if stats is None or stats.memory_events is None:
        return None
    return stats.memory_events.max


def _recreated(before: Cgroup, now: Cgroup) -> bool:
    """A cgroup removed and made again under the same name between two reads: its counters
    start again from 0, and one that rose past its old value would read as a rise. CPU time
    used in a cgroup never goes down while it exists."""
    old, new = before.cpu_stat, now.cpu_stat
    if old is None or new is None or old.usage_usec is None or new.usage_usec is None:
        return False
    return new.usage_usec < old.usage_usec


def _delta(before: int | None, now: int | None) -> int | None:
    return None if before is None or now is None else counter_delta(before, now)


#: A cgroup without ``memory.pressure``: neither line read.
_NO_PRESSURE = Pressure(None, None)

_REFAULTS = ("workingset_refault_anon", "workingset_refault_file", "workingset_refault")


def _refaults(stats: Cgroup) -> int | None:
    """Pages brought back soon after reclaim took them (``memory.stat``; one key before 5.9,
    anon and file since)."""
    if stats.memory_stat is None:
        return None
    values = [v for name in _REFAULTS if (v := stats.memory_stat.get(name)) is not None]
    return sum(values) if values else None


@dataclass(frozen=True, slots=True)
class _Cost:
    """What reclaim at a limit cost a cgroup's tasks over one interval: the share of it they
    stalled on memory (``some``: at least one task, ``full``: all at once; ``None`` without
    ``memory.pressure``), OOM kills, and pages refaulted after reclaim (``None``: unknown)."""

    some_percent: float | None
    full_percent: float | None
    oom_kills: int
    refaulted: int | None

    def shown(self, stall_percent: float) -> bool:
        """Whether the interval shows a cost worth a finding."""
        if self.oom_kills:
            return True
        if self.some_percent is not None:
            return self.some_percent >= stall_percent
        # No pressure file: only pages brought back right after reclaim show tasks waited.
        return bool(self.refaulted)


def _stall_percent(
    old: PressureLine | None, new: PressureLine | None, seconds: float
) -> float | None:
    """Share of ``seconds`` (%) a ``memory.pressure`` line counted as stalled: the growth of
    its ``total`` (µs), exact over the interval where the averages decay over fixed windows.
    ``None`` when either read lacks the line or the total went back (a cgroup made again)."""
    if old is None or new is None or seconds <= 0 or new.total_usec < old.total_usec:
        return None
    return min(100.0, (new.total_usec - old.total_usec) / (seconds * 1e6) * 100.0)


def _cost(old: Cgroup, new: Cgroup, seconds: float) -> _Cost:
    before = old.memory_pressure or _NO_PRESSURE
    now = new.memory_pressure or _NO_PRESSURE
    return _Cost(
        _stall_percent(before.some, now.some, seconds),
        _stall_percent(before.full, now.full, seconds),
        _delta(_oom_kills(old), _oom_kills(new)) or 0,
        _delta(_refaults(old), _refaults(new)),
    )


def memory_limit_thrash(
    previous: Job, current: Job, seconds: float, per_second: float, stall_percent: float
) -> list[Finding]:
    """Each level of the job (the job cgroup, each step) whose own ``memory.max`` was hit at
    ``per_second`` or more between two reads ``seconds`` apart, with a cost to its tasks
    (:class:`_Cost`, ``stall_percent`` of the interval stalled on memory)."""
    levels: list[tuple[str | None, Cgroup, int]] = []
    before_steps = {s.name: s for s in previous.steps}
    stepped = 0  # hierarchical max events of the steps, for a job without local counts
    for step in current.steps:
        old = before_steps.get(step.name)
        if old is None or old.stats is None or step.stats is None or old.path != step.path:
            continue
        if _recreated(old.stats, step.stats):
            continue
        stepped += _delta(_all_max_events(old.stats), _all_max_events(step.stats)) or 0
        own = _delta(_own_max_events(previous, old.stats), _own_max_events(current, step.stats))
        if own is None:  # the step's count holds its task cgroups, which Slurm sets no limit on
            own = _delta(_all_max_events(old.stats), _all_max_events(step.stats))
        if own:
            levels.append((step.name, step.stats, own))
    old_job, job = previous.stats, current.stats
    if old_job is not None and job is not None and not _recreated(old_job, job):
        own = _delta(_own_max_events(previous, old_job), _own_max_events(current, job))
        if own is None:  # the job's count holds its steps': what they hit is theirs
            total = _delta(_all_max_events(old_job), _all_max_events(job))
            own = None if total is None else max(0, total - stepped)
        if own:
            levels.append((None, job, own))
    findings: list[Finding] = []
    for name, stats, events in levels:
        rate = events / seconds
        if rate < per_second:
            continue
        old_stats = previous.stats if name is None else before_steps[name].stats
        if old_stats is None:
            continue
        cost = _cost(old_stats, stats, seconds)
        if not cost.shown(stall_percent):
            # Reclaim that made nobody wait (page cache of data read once, streaming
            # through the limit): memory.max is hit as often and nothing is lost.
            continue
        findings.append(_thrash_finding(current, name, stats, rate, events, seconds, cost))
    return findings


def _thrash_finding(
    job: Job,
    step: str | None,
    stats: Cgroup,
    rate: float,
    events: int,
    seconds: float,
    cost: _Cost,
) -> Finding:
    where = f"step {step} ({stats.path})" if step is not None else f"the job cgroup ({stats.path})"
    limit = stats.memory_max.value if stats.memory_max is not None else None
    evidence = {"value": rate, "max_events_per_second": rate, "max_events": float(events)}
    if limit is not None:
        at = f"memory.max {_size(limit)}"
        evidence["memory_max_bytes"] = float(limit)
    elif job.memory_limit_bytes is not None:
        # Counted here without a limit of its own (memory.events without .local sums the
        # cgroups below): the job's tightest limit is the one that applies.
        at = f"memory.max max (the job's tightest limit is {_size(job.memory_limit_bytes)})"
    else:
        at = "memory.max max"
    if stats.memory_current is not None:
        at += f", memory.current {_size(stats.memory_current)}"
        evidence["memory_current_bytes"] = float(stats.memory_current)
    message = (
        f"job {job.job_id}: {where} hit its memory limit {rate:.0f} times/s over {seconds:.0f} s"
        f" ({at}; memory.events max): reclaim thrash at the limit"
    )
    if cost.some_percent is not None:
        message += (
            f"; its tasks stalled on memory {cost.some_percent:.1f} % of those {seconds:.0f} s"
            " (memory.pressure some"
        )
        evidence["memory_some_stall_percent"] = cost.some_percent
        if cost.full_percent is not None:
            message += f"; all of them at once {cost.full_percent:.1f} %, full"
            evidence["memory_full_stall_percent"] = cost.full_percent
        message += ")"
    if cost.refaulted is not None:
        message += f", {cost.refaulted / seconds:.0f} pages/s refaulted after reclaim"
        evidence["refaults_per_second"] = cost.refaulted / seconds
    if cost.oom_kills:
        message += f"; the OOM killer killed {cost.oom_kills} process(es) there"
        evidence["oom_kills"] = float(cost.oom_kills)
    subjects = {"job": job.job_id, "step": step if step is not None else "job"}
    return Finding(THRASH, Severity.WARNING, subjects, evidence, message)


def evaluate(
    previous: tuple[Job, ...] | None,
    current: tuple[Job, ...],
    pressure_percent: float,
    seconds: float | None = None,
    thrash_per_second: float | None = None,
    thrash_stall_percent: float = 10.0,
) -> list[Finding]:
    """The findings of the registries of two reads ``seconds`` apart; without ``seconds`` or
    ``thrash_per_second``, no thrash is looked for."""
    findings: list[Finding] = []
    before = {j.job_id: j for j in previous or ()}
    for job in current:
        for found in (escapes(job), memory_limit(job), memory_pressure(job, pressure_percent)):
            if found is not None:
                findings.append(found)
        old = before.get(job.job_id)
        if old is not None and old.running and job.running:
            findings.extend(oom_kills(old, job))
            if seconds is not None and thrash_per_second is not None and old.cgroup == job.cgroup:
                findings.extend(
                    memory_limit_thrash(old, job, seconds, thrash_per_second, thrash_stall_percent)
                )
    return findings


def _interval(snapshot: Snapshot) -> float | None:
    """Seconds between the ``jobs`` source's two latest reads."""
    cur = snapshot.current.get(JOBS.name)
    prev = snapshot.previous.get(JOBS.name)
    if cur is None or prev is None or cur.monotonic <= prev.monotonic:
        return None
    return cur.monotonic - prev.monotonic


def detect(previous: Snapshot | None, snapshot: Snapshot, settings: JobsSettings) -> list[Finding]:
    """The registry's form: the registry of the ``jobs`` source's latest record and of the
    one before it, both joined with the GPUs' compute processes of now."""
    if not settings.enabled:
        return []
    percent = settings.memory_pressure_percent
    thrash = settings.memory_limit_thrash_events_per_second
    stall = settings.memory_limit_thrash_stall_percent
    derived = snapshot.derived
    before, current = derived.jobs_before, derived.jobs
    seconds = _interval(snapshot) if before is not None else None
    # Both registries stay the same objects while the jobs record and the compute processes
    # do: so do the findings.
    found = derived.reuse(
        "jobs",
        (before, current),
        (percent, thrash, stall, seconds),
        lambda: evaluate(before, current, percent, seconds, thrash, stall),
    )
    # Reclaim at a job's limit that also stalls the whole node (PSI memory full) is the
    # node's problem too, not only the job's.
    node_stall = full_stall_ratio(snapshot.pair(PRESSURE), "memory")
    return with_node_stall(found, THRASH, "node_memory_full_stall_ratio", node_stall)
