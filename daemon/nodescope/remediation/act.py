"""One remediation pass on this node: problems in, Slurm read, the policy decides, scontrol
acts, the record keeps what was done.

:func:`remediate` is what ``nodescope slurm health`` runs, and what any other caller (the prolog
gate, the daemon on a critical finding during a job) runs with its own problems and ``source``:
one decision under the record's lock, so two callers never drain or resume twice. In a dry run
nothing is changed: Slurm is read, the decision is said, the record is not written.

The problems come from the daemon's firing alerts (:func:`problems_from_alerts`, the
``alerts`` command of the hook socket or ``/api/v1/alerts``) and from the prolog gate's checks
(:func:`problems_from_checks`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from nodescope.model.finding import Finding, Severity
from nodescope.remediation.gateway import Verb, apply
from nodescope.remediation.policy import Decision, Policy, Problem, StepKind, decide
from nodescope.remediation.slurm import Scontrol, SlurmError
from nodescope.remediation.state import Entry, locked, read_record, write_record
from nodescope.slurm_names import JOB_ID

if TYPE_CHECKING:
    # Only the settings' shape: the configuration module loads the source registry.
    from nodescope.config import Config

_SEVERITIES = {s.label: s for s in Severity}


class Check(Protocol):
    """A gate check as :func:`problems_from_checks` reads it (``nodescope.hooks.health.Check``;
    named by its shape, so that the remediation does not import the hooks)."""

    @property
    def name(self) -> str: ...
    @property
    def ok(self) -> bool: ...
    @property
    def detail(self) -> str: ...


def problems_from_alerts(alerts: Iterable[Any]) -> list[Problem]:
    """The firing alerts of an alerts document (``alert_json`` objects) as problems; pending
    alerts and anything malformed are left out."""
    problems: list[Problem] = []
    for alert in alerts:
        if not isinstance(alert, Mapping) or alert.get("state") != "firing":
            continue
        kind, severity = alert.get("kind"), _SEVERITIES.get(str(alert.get("severity")))
        if not isinstance(kind, str) or not kind or severity is None:
            continue
        subjects = alert.get("subjects")
        subjects = subjects if isinstance(subjects, Mapping) else {}
        jobs = tuple(str(v) for k, v in subjects.items() if k == "job" and JOB_ID.fullmatch(str(v)))
        subject = alert.get("subject")
        message = alert.get("message")
        key = alert.get("key")
        problems.append(
            Problem(
                kind=kind[:64],
                severity=severity,
                subject=subject[:200] if isinstance(subject, str) else "",
                message=message[:400] if isinstance(message, str) else "",
                source="alert",
                key=key[:400] if isinstance(key, str) else "",
                jobs=jobs,
            )
        )
    return problems


def problems_from_findings(findings: Iterable[Finding]) -> list[Problem]:
    """Findings of a local check (``nodescope check``'s cycle, run when the daemon is away) as
    problems: a warning or worse, each with its key as its identity, so that the next run with
    the daemon back sees the same problem under the same name."""
    problems: list[Problem] = []
    for finding in findings:
        if finding.severity < Severity.WARNING:
            continue
        jobs = tuple(
            str(v) for k, v in finding.subjects.items() if k == "job" and JOB_ID.fullmatch(str(v))
        )
        subject = ",".join(f"{role}={name}" for role, name in finding.subjects.items())
        problems.append(
            Problem(
                kind=finding.kind[:64],
                severity=finding.severity,
                subject=subject[:200],
                message=finding.message[:400],
                source="check",
                key=finding.key[:400],
                jobs=jobs,
            )
        )
    return problems


def problems_from_checks(checks: Iterable[Check]) -> list[Problem]:
    """The prolog gate's failed checks, each a critical ``gate_<check>`` problem: a node the
    gate would refuse a job is one the policy may drain."""
    return [
        Problem(f"gate_{c.name}", Severity.CRITICAL, "", c.detail, source="gate")
        for c in checks
        if not c.ok
    ]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one pass decided, did, and says. ``lines`` are for people (stdout)."""

    node: str
    decision: Decision
    entries: tuple[Entry, ...]
    lines: tuple[str, ...]
    dry_run: bool


def _describe(step_kind: StepKind, node: str, reason: str, dry_run: bool) -> str:
    verb = {
        StepKind.DRAIN: ("would drain", "drained"),
        StepKind.DRAIN_REQUEUE: ("would drain", "drained"),
        StepKind.RESUME: ("would resume", "resumed"),
    }[step_kind][0 if dry_run else 1]
    return f"{verb} {node}" + (f': reason "{reason}"' if reason else "")


def remediate(
    config: Config,
    problems: Iterable[Problem],
    node: str,
    *,
    complete: bool = True,
    source: str = "health",
    now: float | None = None,
    scontrol: Scontrol | None = None,
    dry_run: bool | None = None,
) -> Outcome:
    """Decide and act for ``node``; :class:`~.slurm.SlurmError` when Slurm cannot be read
    (nothing was done), :class:`~.state.RecordBusy` when another pass held the record."""
    settings = config.remediation
    policy = Policy.from_settings(settings)
    dry = policy.dry_run if dry_run is None else dry_run
    tool = scontrol or Scontrol(config.slurm.scontrol, settings.scontrol_timeout_seconds)
    wall = time.time() if now is None else now
    problems = list(problems)
    with locked(config.roots, timeout=2 * settings.scontrol_timeout_seconds):
        # Slurm is read under the lock: a pass that ran meanwhile (slurmd starts the next
        # health check while a slow one still runs; the daemon acts during a job) has drained
        # already, and this one must see that drain, not the node as it was before it.
        view, skipped = tool.view(node)
        if view is None:
            raise SlurmError(f"Slurm does not know node {node!r}")
        record = read_record(config.roots)
        memory = record.memory(node)
        decision = decide(policy, problems, view, memory, wall, complete=complete)
        lines: list[str] = []
        if skipped:
            # Said, not fatal: a line scontrol prints that this version does not understand
            # costs that node's or partition's share in the guard, never the whole pass.
            lines.append(f"{skipped} line(s) of scontrol's output not understood: skipped")
        if record.problem:
            lines.append(f"record not read ({record.problem}): nodescope resumes no node")
        entries: list[Entry] = []
        failed = False
        drained = False
        for step in decision.steps:
            error = ""
            if step.action in (StepKind.DRAIN, StepKind.DRAIN_REQUEUE) and not step.repeat:
                if not drained:
                    lines.append(_describe(step.action, node, step.reason, dry))
                    applied = apply(
                        config, Verb.DRAIN, node, step.reason,
                        tool=tool, view=view, memory=memory, now=wall, dry_run=dry,
                    )  # fmt: skip
                    if not (applied.done or applied.dry_run):
                        error, failed = applied.error or applied.held, True
                    drained = True
                lines.append(f"  for {step.kind} {step.subject}: {step.message}".rstrip())
                for job in step.jobs:
                    if error:
                        continue
                    requeued = apply(config, Verb.REQUEUE, job, tool=tool, dry_run=dry)
                    if requeued.dry_run:
                        lines.append(f"  would requeue job {job}")
                    elif requeued.done:
                        lines.append(f"  requeued job {job}")
                    else:
                        lines.append(f"  job {job} not requeued: {requeued.error}")
                        error = f"requeue {job}: {requeued.error}"
                if step.action is StepKind.DRAIN_REQUEUE and not step.jobs:
                    lines.append("  no job named by the finding: nothing to requeue")
            elif step.action is StepKind.RESUME:
                lines.append(_describe(step.action, node, "", dry) + f" ({step.message})")
                applied = apply(
                    config, Verb.RESUME, node,
                    tool=tool, view=view, memory=memory, now=wall, dry_run=dry,
                )  # fmt: skip
                if not (applied.done or applied.dry_run):
                    error, failed = applied.error or applied.held, True
            elif step.action is StepKind.HELD:
                lines.append(
                    f"held{' (already said)' if step.repeat else ''}: {step.kind}"
                    f" {step.subject}: {step.why}".replace("  ", " ")
                )
            elif step.action is StepKind.ALERT:
                lines.append(
                    f"alert{' (already said)' if step.repeat else ''}: {step.kind}"
                    f" {step.subject}: {step.message} (policy: no drain)".replace("  ", " ")
                )
            if error:
                lines.append(f"  failed: {error}")
            if not step.repeat:
                entries.append(Entry.of(step, node, wall, source, error))
        lines.extend(decision.notes)
        if not decision.steps and not decision.notes:
            lines.append(f"{node}: nothing to do ({len(problems)} problem(s) known)")
        if dry:
            return Outcome(node, decision, (), tuple(lines), True)
        # A failed drain or resume leaves the memory as it was, so the next pass tries again;
        # the failure itself is recorded.
        new_memory = memory if failed else decision.memory
        if entries or new_memory != memory:
            write_record(config.roots, record.with_actions(node, new_memory, entries), wall)
    return Outcome(node, decision, tuple(entries), tuple(lines), False)
