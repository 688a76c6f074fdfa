"""Acting on a finding during a job: the daemon drains the node, and the job goes on.

The prolog gate keeps new jobs off a node with a finding the remediation policy drains for, and
``nodescope slurm health`` drains a node at Slurm's ``HealthCheckInterval``; while a job holds
the node, no prolog runs. So each cycle :class:`JobDrain` looks at the firing alerts, and when
one whose kind and severity the policy drains for (``drain``, ``drain_requeue``) fires while a
job the prolog registered is on the node, it runs one remediation pass
(:func:`nodescope.remediation.act.remediate`, source ``daemon``): Slurm is read, the policy
decides (who owns a drain, cool-down, partition guard, dry run), scontrol drains the node with
``state=drain`` — running jobs finish, new ones go elsewhere — and, for ``drain_requeue``,
requeues the jobs the finding names or whose GPUs it names; the remediation record keeps the
action once, and the job's report lists it.

* The pass runs in a worker thread, at most one at a time, each scontrol call bounded by
  ``[remediation] scontrol_timeout_seconds``: a Slurm that does not answer never holds the
  daemon's cycle. While a pass runs, later cycles start none.
* A firing problem is passed once. One the policy held back (cool-down, partition guard) or
  whose pass failed (Slurm unreachable, the record busy) is tried again after
  :data:`RETRY_SECONDS` while it still fires and a job is on the node; one that stops firing is
  forgotten, so that firing again is a new problem (which the cool-down then guards).
* The node is the one Slurm named to the prolog (``SLURMD_NODENAME``, kept in the job's
  registration): only a job that Slurm started through nodescope's prolog lets the daemon touch
  Slurm, so a daemon on a machine that is no Slurm node (a demo, a test) never runs scontrol.
* The daemon never resumes a node (the pass says its problems are incomplete): resuming is
  ``nodescope slurm health``'s, once everything the node was drained for has cleared.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace

from nodescope.analysis import alert_json
from nodescope.config import Config
from nodescope.hooks.health import Check, gate_checks, local_gate_inputs
from nodescope.hooks.tracker import read_registration
from nodescope.model.alert import Alert, AlertState
from nodescope.model.jobs import Job
from nodescope.model.snapshot import Snapshot
from nodescope.remediation.act import Outcome, problems_from_alerts, problems_from_checks, remediate
from nodescope.remediation.policy import Policy, Problem, StepKind
from nodescope.slurm_names import NODE_NAME

log = logging.getLogger("nodescope.remediation")

#: Seconds before a held or failed problem is passed again while it fires.
RETRY_SECONDS = 60.0
#: How long :meth:`JobDrain.stop` waits for a pass in flight to finish.
STOP_WAIT_SECONDS = 2.0


#: A remediation pass (:func:`nodescope.remediation.act.remediate`); tests hand in their own.
Remediate = Callable[..., Outcome]


def firing_problems(alerts: Iterable[Alert], jobs: Sequence[Job]) -> list[tuple[str, Problem]]:
    """The firing alerts as the policy takes them (the conversion ``nodescope slurm health``
    applies), each with the jobs it affects: those its subjects name, else those running on
    the GPUs it names (what ``drain_requeue`` requeues); paired with the alert's key, which
    the problem's identity may shorten."""
    out = []
    for alert in alerts:
        if alert.state is not AlertState.FIRING:
            continue
        for problem in problems_from_alerts([alert_json(alert)]):
            if not problem.jobs:
                problem = replace(problem, jobs=jobs_on_gpus(alert.subjects, jobs))
            out.append((alert.key, problem))
    return out


def jobs_on_gpus(subjects: Mapping[str, str], jobs: Sequence[Job]) -> tuple[str, ...]:
    """The jobs whose GPUs a finding's ``gpu`` subjects name."""
    gpus = {name for role, name in subjects.items() if role == "gpu"}
    return tuple(j.job_id for j in jobs if gpus & {str(g) for g in j.gpus})


def due(
    policy: Policy,
    alerts: Iterable[Alert],
    done: set[str],
    retry_at: Mapping[str, float],
    now: float,
) -> list[Alert]:
    """The firing alerts that call for a pass now: the policy drains for them, and they have
    not been passed yet, or were held or failed and their retry time has come."""
    return [
        a
        for a in alerts
        if a.state is AlertState.FIRING
        and policy.action(a.kind, a.severity).drains
        and a.key not in done
        and retry_at.get(a.key, now) <= now
    ]


def settled(outcome: Outcome, passed: Mapping[str, str]) -> tuple[set[str], set[str]]:
    """Of the alerts a pass was started for (their keys, each to its problem's identity),
    those it settled (drained for, joined to a drain, left to a drain that is not
    nodescope's, or said in a dry run) and those to try again (held by the policy, or the
    pass's action failed)."""
    keys = set(passed)
    if not outcome.dry_run and any(not e.ok for e in outcome.entries):
        return set(), keys
    held = {s.key for s in outcome.decision.steps if s.action is StepKind.HELD}
    if outcome.dry_run:
        held = set()
    again = {k for k, identity in passed.items() if identity in held}
    return keys - again, again


class JobDrain:
    """Fed every analysed snapshot by the service; drains the node in a worker thread."""

    def __init__(
        self,
        config: Callable[[], Config],
        *,
        act: Remediate | None = None,
        checks: Callable[[Config], Sequence[Check]] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._config = config
        self._act: Remediate = act if act is not None else remediate
        #: The prolog gate's checks now, as ``nodescope slurm health`` runs them: a pass
        #: decides on everything a health run would, so that the record's memory of each
        #: problem stays whole whichever of the two wrote it last.
        self._checks = checks if checks is not None else local_checks
        self._clock = clock
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._done: set[str] = set()
        self._retry_at: dict[str, float] = {}
        self._no_node_said = False
        #: Passes started and passes that raised, for tests and logs.
        self.passes = 0
        self.failures = 0

    def observe(self, snapshot: Snapshot) -> threading.Thread | None:
        """Start a pass when one is due; returns its thread (``None``: none started)."""
        firing = [a for a in snapshot.alerts if a.state is AlertState.FIRING]
        firing_keys = {a.key for a in firing}
        with self._lock:
            # A problem that stopped firing is forgotten: firing again is a new problem.
            self._done &= firing_keys
            self._retry_at = {k: v for k, v in self._retry_at.items() if k in firing_keys}
            busy = self._worker is not None and self._worker.is_alive()
        if busy or not firing:
            return None
        config = self._config()
        if not config.slurm.scontrol:
            return None
        policy = Policy.from_settings(config.remediation)
        now = self._clock()
        # Most cycles end here, before any conversion: nothing firing calls for a pass.
        with self._lock:
            waiting = {a.key for a in due(policy, firing, self._done, self._retry_at, now)}
        if not waiting:
            return None
        jobs = [j for j in snapshot.derived.jobs if j.registered]
        if not jobs:
            return None
        pairs = firing_problems(firing, jobs)
        todo = {key: problem.identity for key, problem in pairs if key in waiting}
        with self._lock:
            # An alert the conversion cannot read is no problem to pass, now or later.
            self._done |= waiting - set(todo)
        if not todo:
            return None
        node = node_of(config, jobs)
        if node is None:
            if not self._no_node_said:
                log.warning(
                    "event=job_drain_skipped reason=%r",
                    "no Slurm node name in the registrations of the jobs on this node",
                )
                self._no_node_said = True
            return None
        worker = threading.Thread(
            target=self._pass,
            args=(config, [p for _, p in pairs], todo, node),
            name="nodescope-job-drain",
            daemon=True,
        )
        with self._lock:
            self._worker = worker
            self.passes += 1
        worker.start()
        return worker

    def _pass(
        self, config: Config, problems: list[Problem], todo: Mapping[str, str], node: str
    ) -> None:
        try:
            checks = list(self._checks(config))
            outcome = self._act(
                config,
                [*problems, *problems_from_checks(checks)],
                node,
                complete=False,
                source="daemon",
            )
        except Exception as exc:  # Slurm unreachable, the record busy, or a bug: try later
            with self._lock:
                self.failures += 1
                retry = self._clock() + RETRY_SECONDS
                self._retry_at.update(dict.fromkeys(todo, retry))
            log.error(
                "event=job_drain_failed node=%s problems=%r error=%r",
                node,
                ",".join(todo),
                f"{type(exc).__name__}: {exc}",
            )
            return
        done, again = settled(outcome, todo)
        with self._lock:
            self._done |= done
            retry = self._clock() + RETRY_SECONDS
            self._retry_at.update(dict.fromkeys(again, retry))
            for key in done:
                self._retry_at.pop(key, None)
        for line in outcome.lines:
            log.info(
                "event=job_drain node=%s dry_run=%s says=%r", node, outcome.dry_run, line.strip()
            )

    def wait(self, timeout: float) -> bool:
        """Wait for a pass in flight; whether none is left running."""
        with self._lock:
            worker = self._worker
        if worker is not None:
            worker.join(timeout)
            return not worker.is_alive()
        return True

    def stop(self) -> None:
        """Give a pass in flight a moment to finish its record; a daemon thread does not hold
        the process past that."""
        self.wait(STOP_WAIT_SECONDS)


def local_checks(config: Config) -> list[Check]:
    """The gate's checks from what the hook itself reads (``nodescope slurm health``'s)."""
    return gate_checks(config.slurm, local_gate_inputs(config))


def node_of(config: Config, jobs: Iterable[Job]) -> str | None:
    """The Slurm node name the prolog was given for one of ``jobs``, from its registration."""
    for job in jobs:
        registration = read_registration(config.roots, job.job_id) or {}
        node = registration.get("node")
        if isinstance(node, str) and NODE_NAME.fullmatch(node):
            return node
    return None
