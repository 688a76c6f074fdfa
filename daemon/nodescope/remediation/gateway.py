"""The one way nodescope changes Slurm: every drain, resume and requeue goes through
:func:`apply`, whoever asks (the remediation pass of ``nodescope slurm health``, the daemon
during a job, the prolog gate, the epilog's verdict).

:func:`apply` applies the operator's switches before anything runs:

* ``[remediation] dry_run``: nothing is changed; the caller says what it would have done;
* the cool-down and, for a drain, the partition guard (:func:`.policy.held_back`, the rule the
  policy's :func:`.policy.decide` applies too), from the node as Slurm shows it and what the
  remediation record remembers of it — given by a caller that has read them already (a
  remediation pass, under the record's lock), read here otherwise;
* the drain reason through the one sanitiser (:func:`nodescope.text.sanitize`, its ASCII
  form) with nodescope's prefix, so that a process name in it cannot reach scontrol or a
  terminal as anything but text.

Only then does it run :class:`.slurm.Scontrol`. A test lists every place in ``daemon/`` that
runs a program or names scontrol, and fails on one outside this module and the
:class:`~.slurm.Scontrol` class.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nodescope.remediation.policy import (
    MAX_REASON,
    REASON_PREFIX,
    Memory,
    NodeView,
    Policy,
    held_back,
    sanitize,
)
from nodescope.remediation.slurm import Scontrol, SlurmError
from nodescope.remediation.state import read_record

if TYPE_CHECKING:
    # Only the settings' shape: the configuration module loads the source registry.
    from nodescope.config import Config


class Verb(enum.StrEnum):
    DRAIN = "drain"
    RESUME = "resume"
    REQUEUE = "requeue"


@dataclass(frozen=True, slots=True)
class Applied:
    """What :func:`apply` did: ``done`` when scontrol made the change; otherwise ``dry_run``,
    ``held`` (why the guards held it back) or ``error`` (scontrol failed or Slurm could not be
    read) says why not. ``reason`` is the drain reason as sent (sanitised)."""

    verb: Verb
    target: str
    reason: str = ""
    done: bool = False
    dry_run: bool = False
    held: str = ""
    error: str = ""

    def describe(self) -> str:
        """One line for people: what was done, or would have been, and why not."""
        what = f"{self.verb.value} {self.target}" + (
            f': reason "{self.reason}"' if self.reason else ""
        )
        if self.done:
            return f"{_PAST[self.verb]} {what.split(' ', 1)[1]}"
        if self.dry_run:
            return f"dry run: would {what}"
        if self.held:
            return f"held: would {what}: {self.held}"
        return f"not done: {what}: {self.error}"


_PAST = {Verb.DRAIN: "drained", Verb.RESUME: "resumed", Verb.REQUEUE: "requeued job"}


def drain_text(reason: str) -> str:
    """``reason`` as nodescope sets it: sanitised, with its prefix, bounded."""
    cleaned = sanitize(reason, MAX_REASON)
    if not cleaned.startswith(REASON_PREFIX):
        cleaned = sanitize(f"{REASON_PREFIX} {cleaned}", MAX_REASON)
    return cleaned


def apply(
    config: Config,
    verb: Verb,
    target: str,
    reason: str = "",
    *,
    tool: Scontrol | None = None,
    view: NodeView | None = None,
    memory: Memory | None = None,
    now: float | None = None,
    dry_run: bool | None = None,
) -> Applied:
    """Drain or resume node ``target``, or requeue job ``target``, unless a switch or guard
    says no (see the module docstring). ``view`` and ``memory``: the node as the caller read
    it, to be read here when not given. Never raises for Slurm's sake: an error is in the
    answer."""
    policy = Policy.from_settings(config.remediation)
    dry = policy.dry_run if dry_run is None else dry_run
    text = drain_text(reason) if verb is Verb.DRAIN else ""
    if dry:
        return Applied(verb, target, text, dry_run=True)
    scontrol = tool or Scontrol(config.slurm.scontrol, config.remediation.scontrol_timeout_seconds)
    wall = time.time() if now is None else now
    try:
        if verb is not Verb.REQUEUE:
            if view is None:
                view, _skipped = scontrol.view(target)
                if view is None:
                    return Applied(verb, target, text, error=f"Slurm does not know {target!r}")
            if memory is None:
                memory = read_record(config.roots).memory(target)
            held = held_back(policy, view, memory, wall, drain=verb is Verb.DRAIN)
            if held is not None:
                return Applied(verb, target, text, held=held)
        if verb is Verb.DRAIN:
            scontrol.drain(target, text)
        elif verb is Verb.RESUME:
            scontrol.resume(target)
        else:
            scontrol.requeue(target)
    except SlurmError as exc:
        return Applied(verb, target, text, error=str(exc))
    return Applied(verb, target, text, done=True)
