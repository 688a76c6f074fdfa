"""The records of the ``remediation`` source: what nodescope did to the node about findings.

``nodescope slurm health`` (and any other caller of ``nodescope.remediation.act``) records
each action once in ``<run>/nodescope/remediation.json``; the daemon reads that record back
(``sources/remediation.py``) to count the actions
(``nodescope_remediation_actions_total{action,kind}``), to list them in ``/api/v1/alerts``
beside the alerts that caused them, and to annotate those alerts in Alertmanager.
docs/remediation.md describes the policy and the record.
"""

from __future__ import annotations

from dataclasses import dataclass

from nodescope.model.source_key import SourceKey


@dataclass(frozen=True, slots=True)
class RemediationAction:
    """One recorded action: ``action`` is drain, drain_requeue, resume, held or alert; ``key``
    the alert key (or gate check) it was about; ``ok`` whether scontrol did it."""

    time: float
    node: str
    action: str
    kind: str
    subject: str
    key: str
    message: str
    reason: str
    why: str
    source: str
    ok: bool
    error: str


@dataclass(frozen=True, slots=True)
class ActionCount:
    action: str
    kind: str
    count: int


@dataclass(frozen=True, slots=True)
class RemediationData:
    """The record as last read: every action counted per (action, kind) since the record was
    made, the latest actions (oldest first), and why the record could not be read, if so."""

    counts: tuple[ActionCount, ...] = ()
    recent: tuple[RemediationAction, ...] = ()
    problem: str | None = None


#: The ``remediation`` source's records: the actions nodescope took on the node.
REMEDIATION = SourceKey("remediation", RemediationData)


#: What an action did, in the words an annotation and ``nodescope alerts`` use.
_DONE = {
    "drain": "drained",
    "drain_requeue": "drained (job requeued)",
    "resume": "resumed",
    "held": "drain held back",
    "alert": "left to people (alert only)",
}


def describe(action: RemediationAction) -> str:
    """One line: ``drained node07 by health: <reason>``, ``drain held back on node07 by
    health: <why>``, with ``FAILED: <error>`` when scontrol refused."""
    done = _DONE.get(action.action, action.action)
    where = "on " if action.action in ("held", "alert") else ""
    detail = action.reason or action.why or action.message
    text = f"{done} {where}{action.node} by {action.source}" + (f": {detail}" if detail else "")
    return text + (f" FAILED: {action.error}" if not action.ok else "")


def latest_by_key(data: RemediationData) -> dict[str, RemediationAction]:
    """The latest action per alert key (actions without a key left out)."""
    out: dict[str, RemediationAction] = {}
    for action in data.recent:
        if action.key:
            out[action.key] = action
    return out
