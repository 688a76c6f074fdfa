"""The remediation policy: from the node's problems and what Slurm says of it, what to do.

Pure: no IO, no clock. :func:`decide` takes

* the problems of now (:class:`Problem`: a firing alert of the daemon or a failed gate check),
* the node as Slurm shows it (:class:`NodeView`, from :mod:`nodescope.remediation.slurm`),
* what nodescope remembers of the node (:class:`Memory`, from
  :mod:`nodescope.remediation.state`),

and returns a :class:`Decision`: the steps (drain, drain_requeue, resume, held, alert) and the
memory to keep. The rules:

* the action of a problem is its kind's rule for its severity, else the ``[remediation]``
  default of the severity (critical → drain, warning → alert, info → none); built-in rules
  (:data:`BUILTIN_RULES`) sit between the two;
* a node drained by anyone else (a drain whose reason nodescope did not set and record) is
  never touched, neither drained again nor resumed;
* a new drain is held while the node's last drain or resume by nodescope is more recent than
  ``cooldown_seconds``, or while the nodes nodescope has drained in one of the node's
  partitions make up ``max_drained_share`` of it or more;
* a node nodescope drained is resumed once none of the problems it was drained for is present
  any more (whatever their severity now), unless it was drained within ``cooldown_seconds``.

A step that repeats the previous run's step for the same problem is marked ``repeat``: the
caller logs and counts each action once, not at every health check.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from nodescope.model.finding import Severity
from nodescope.text import sanitize as text_sanitize

if TYPE_CHECKING:
    # Only the settings' shape: the record reader (the remediation source) loads this module,
    # and the configuration module loads the source registry.
    from nodescope.config import RemediationRuleSettings, RemediationSettings

#: The prefix of every drain reason nodescope sets; the partition guard counts the drains that
#: carry it, whoever in nodescope set them (the prolog gate too).
REASON_PREFIX = "nodescope:"
#: Slurm keeps a reason of any length; ``sinfo -R`` shows the first 20 characters by default
#: and operators read the rest in ``scontrol show node``. 200 keeps the reason one screen line.
MAX_REASON = 200


class Action(enum.StrEnum):
    """What the policy does about a problem, as the configuration spells it."""

    NONE = "none"
    ALERT = "alert"
    DRAIN = "drain"
    DRAIN_REQUEUE = "drain_requeue"

    @property
    def drains(self) -> bool:
        return self in (Action.DRAIN, Action.DRAIN_REQUEUE)


class StepKind(enum.StrEnum):
    """What was done (or, in a dry run, would be): the ``action`` label of the counter."""

    ALERT = "alert"
    DRAIN = "drain"
    DRAIN_REQUEUE = "drain_requeue"
    RESUME = "resume"
    HELD = "held"


#: Kinds whose defaults differ from the severity defaults, as their specs state them
#: (``nodescope.detectors.kinds``; e.g. an application's own Xid never drains). Written by
#: ``python -m nodescope.docgen --write-code``, checked by the test suite: edit the spec.
# BEGIN generated kind-actions
BUILTIN_RULES: Mapping[str, Mapping[Severity, Action]] = MappingProxyType(
    {
        "gpu_xid_application": MappingProxyType({Severity.CRITICAL: Action.ALERT}),
    }
)
# END generated kind-actions


@dataclass(frozen=True, slots=True)
class Problem:
    """One reason to act: a firing alert of the daemon (``source`` "alert") or a failed check
    of the prolog gate (``source`` "gate"). ``key`` is its identity across runs (the alert's
    key); ``jobs`` are the Slurm job ids its subjects name (requeued by ``drain_requeue``)."""

    kind: str
    severity: Severity
    subject: str = ""
    message: str = ""
    source: str = "alert"
    key: str = ""
    jobs: tuple[str, ...] = ()

    @property
    def identity(self) -> str:
        return self.key or f"{self.kind}{{{self.subject}}}"


@dataclass(frozen=True, slots=True)
class PartitionLoad:
    """One partition of the node: its node count, and how many of its *other* nodes are
    drained with a nodescope reason."""

    name: str
    members: int
    drained_by_nodescope: int


@dataclass(frozen=True, slots=True)
class NodeView:
    """The node as Slurm shows it now. ``reason`` without Slurm's ``[user@time]`` suffix."""

    name: str
    drained: bool
    reason: str | None
    partitions: tuple[PartitionLoad, ...] = ()


@dataclass(frozen=True, slots=True)
class Memory:
    """What nodescope recorded of the node: the drain reason it set and still stands by
    (``None``: it has not drained the node), the problems it drained for, when it last
    drained or resumed the node (wall clock), and the step it took last per problem."""

    drained_reason: str | None = None
    causes: tuple[str, ...] = ()
    last_change: float | None = None
    last_steps: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "last_steps", MappingProxyType(dict(self.last_steps)))


@dataclass(frozen=True, slots=True)
class Step:
    """One action. ``reason`` is the drain reason for a drain; ``why`` says why a drain or a
    resume was held, or why nothing was done; ``repeat`` marks the same step as last run's
    for the same problem (said, not logged again)."""

    action: StepKind
    kind: str
    subject: str
    message: str
    key: str
    reason: str = ""
    why: str = ""
    jobs: tuple[str, ...] = ()
    repeat: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    """The steps in order, what nodescope will remember, and notes for the operator
    (a drain it does not own, a drain it cannot account for)."""

    steps: tuple[Step, ...]
    memory: Memory
    notes: tuple[str, ...] = ()

    @property
    def drain(self) -> Step | None:
        for step in self.steps:
            if step.action in (StepKind.DRAIN, StepKind.DRAIN_REQUEUE) and not step.repeat:
                return step
        return None

    @property
    def resume(self) -> Step | None:
        for step in self.steps:
            if step.action is StepKind.RESUME:
                return step
        return None


@dataclass(frozen=True, slots=True)
class Policy:
    """The ``[remediation]`` settings as decisions need them."""

    defaults: Mapping[Severity, Action]
    rules: Mapping[str, Mapping[Severity, Action]]
    dry_run: bool = False
    cooldown_seconds: float = 600.0
    max_drained_share: float = 0.1

    @classmethod
    def from_settings(cls, settings: RemediationSettings) -> Policy:
        rules: dict[str, Mapping[Severity, Action]] = {k: dict(v) for k, v in BUILTIN_RULES.items()}
        for kind, rule in settings.rules.items():
            merged = dict(rules.get(kind, {}))
            merged.update(_rule_actions(rule))
            rules[kind] = MappingProxyType(merged)
        return cls(
            defaults=MappingProxyType(
                {
                    Severity.CRITICAL: Action(settings.critical),
                    Severity.WARNING: Action(settings.warning),
                    Severity.INFO: Action(settings.info),
                }
            ),
            rules=MappingProxyType(rules),
            dry_run=settings.dry_run,
            cooldown_seconds=settings.cooldown_seconds,
            max_drained_share=settings.max_drained_share,
        )

    def action(self, kind: str, severity: Severity) -> Action:
        rule = self.rules.get(kind)
        if rule is not None and severity in rule:
            return rule[severity]
        return self.defaults.get(severity, Action.NONE)


def _rule_actions(rule: RemediationRuleSettings) -> dict[Severity, Action]:
    out: dict[Severity, Action] = {}
    for severity in Severity:
        value = getattr(rule, severity.label)
        if value is not None:
            out[severity] = Action(value)
    return out


# ---------------------------------------------------------------------------------------------
# The drain reason


def sanitize(text: str, limit: int = MAX_REASON) -> str:
    """``text`` as a drain reason may hold it: :func:`nodescope.text.sanitize`'s ASCII form
    (the reason travels as one argument of scontrol and is shown by ``sinfo``), at most
    ``limit`` characters."""
    return text_sanitize(text, limit, ascii_only=True)


def drain_reason(problem: Problem, more: int = 0) -> str:
    """``nodescope: <kind> <subject>: <message>``, with ``(+N more)`` when the drain has
    further causes, sanitised and bounded (:data:`MAX_REASON`)."""
    tail = f" (+{more} more)" if more else ""
    head = f"{REASON_PREFIX} {problem.kind}" + (f" {problem.subject}" if problem.subject else "")
    body = sanitize(f"{head}: {problem.message}" if problem.message else head)
    return body[: MAX_REASON - len(tail)].rstrip() + tail


def is_nodescope_reason(reason: str | None) -> bool:
    return reason is not None and reason.startswith(REASON_PREFIX)


# ---------------------------------------------------------------------------------------------
# The decision


def _step(action: StepKind, problem: Problem, memory: Memory, **extra: object) -> Step:
    repeat = memory.last_steps.get(problem.identity) == action.value
    return Step(
        action=action,
        kind=problem.kind,
        subject=problem.subject,
        message=problem.message,
        key=problem.identity,
        repeat=repeat,
        **extra,  # type: ignore[arg-type]
    )


def held_back(
    policy: Policy, node: NodeView, memory: Memory, now: float, *, drain: bool
) -> str | None:
    """Why a new drain (``drain``) or a resume must wait now, or ``None``: the cool-down
    after nodescope's last change of the node, and for a drain the partition guard. The one
    rule :func:`decide` and :func:`nodescope.remediation.gateway.apply` both apply."""
    last = memory.last_change
    if last is not None and now - last < policy.cooldown_seconds:
        if drain:
            return (
                f"cool-down: nodescope resumed the node {now - last:.0f} s ago,"
                f" a new drain waits {policy.cooldown_seconds:.0f} s"
            )
        return (
            f"cool-down: drained {now - last:.0f} s ago,"
            f" resume waits {policy.cooldown_seconds:.0f} s"
        )
    return _guard(policy, node) if drain else None


def _guard(policy: Policy, node: NodeView) -> str | None:
    """Why a new drain must wait for the partition guard, or ``None``."""
    for part in node.partitions:
        if part.members <= 0:
            continue
        if part.drained_by_nodescope >= policy.max_drained_share * part.members:
            share = part.drained_by_nodescope / part.members
            return (
                f"partition {part.name}: {part.drained_by_nodescope} of {part.members} nodes"
                f" already drained by nodescope ({share:.0%} >= {policy.max_drained_share:.0%})"
            )
    return None


def _severity_order(problem: Problem) -> tuple[int, str]:
    return (-int(problem.severity), problem.identity)


def decide(
    policy: Policy,
    problems: Iterable[Problem],
    node: NodeView,
    memory: Memory,
    now: float,
    complete: bool = True,
) -> Decision:
    """What to do now; see the module docstring for the rules. ``complete`` is false when
    some problems could not be known (the daemon did not answer): nothing is resumed then,
    since a cause that cannot be seen has not been seen to clear."""
    ordered = sorted({p.identity: p for p in problems}.values(), key=_severity_order)
    present = {p.identity for p in ordered}
    steps: list[Step] = []
    notes: list[str] = []
    actions = {p.identity: policy.action(p.kind, p.severity) for p in ordered}
    drainers = [p for p in ordered if actions[p.identity].drains]

    owned = (
        node.drained
        and memory.drained_reason is not None
        and node.reason == memory.drained_reason
        and is_nodescope_reason(node.reason)
    )
    # A drain nodescope recorded but Slurm no longer shows (a person resumed the node, or
    # changed the reason) is given up: the node is the person's from now on.
    drained_reason = memory.drained_reason if owned else None
    causes = memory.causes if owned else ()
    last_change = memory.last_change
    cooling = last_change is not None and now - last_change < policy.cooldown_seconds

    for problem in ordered:
        if actions[problem.identity] is Action.ALERT:
            steps.append(_step(StepKind.ALERT, problem, memory))

    if node.drained and not owned:
        if drainers:
            who = "nodescope, not recorded" if is_nodescope_reason(node.reason) else "someone else"
            notes.append(
                f"node {node.name} already drained by {who} (reason {node.reason!r}): left as is"
            )
    elif owned:
        # Already drained by nodescope: further causes join the drain, which stays until all
        # of them have cleared.
        new_causes = [p.identity for p in drainers if p.identity not in causes]
        causes = (*causes, *new_causes)
        if not drainers and not any(c in present for c in causes):
            first = causes[0] if causes else ""
            if not complete:
                notes.append(
                    f"node {node.name} stays drained: its problems are not all known now"
                    " (the daemon did not answer)"
                )
            elif cooling:
                steps.append(
                    Step(
                        StepKind.HELD,
                        kind=first.split("{", 1)[0],
                        subject="",
                        message="every finding it was drained for has cleared",
                        key=f"resume:{first}",
                        why=f"cool-down: drained {now - (last_change or now):.0f} s ago,"
                        f" resume waits {policy.cooldown_seconds:.0f} s",
                        repeat=memory.last_steps.get(f"resume:{first}") == StepKind.HELD.value,
                    )
                )
            else:
                steps.append(
                    Step(
                        StepKind.RESUME,
                        kind=first.split("{", 1)[0],
                        subject="",
                        message="every finding it was drained for has cleared: "
                        + ", ".join(causes),
                        key=f"resume:{first}",
                        reason=drained_reason or "",
                    )
                )
                drained_reason, causes, last_change = None, (), now
    elif drainers:
        worst = drainers[0]
        held = held_back(policy, node, memory, now, drain=True)
        if held is not None:
            steps.extend(_step(StepKind.HELD, p, memory, why=held) for p in drainers)
        else:
            reason = drain_reason(worst, len(drainers) - 1)
            for problem in drainers:
                action = actions[problem.identity]
                kind = StepKind.DRAIN_REQUEUE if action is Action.DRAIN_REQUEUE else StepKind.DRAIN
                jobs = problem.jobs if kind is StepKind.DRAIN_REQUEUE else ()
                steps.append(
                    Step(
                        kind,
                        kind=problem.kind,
                        subject=problem.subject,
                        message=problem.message,
                        key=problem.identity,
                        reason=reason,
                        jobs=jobs,
                    )
                )
            drained_reason, causes, last_change = reason, tuple(p.identity for p in drainers), now

    last_steps = {s.key: s.action.value for s in steps}
    return Decision(
        steps=tuple(steps),
        memory=Memory(drained_reason, causes, last_change, last_steps),
        notes=tuple(notes),
    )
