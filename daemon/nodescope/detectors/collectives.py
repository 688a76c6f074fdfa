"""Jobs whose own PyTorch traces show a collective out of balance.

Input: the ``traces`` source's latest record (:mod:`nodescope.model.collectives`): per job
on the node and per collective kind, the send skew δ, the straggler rank and the longest wait
that the analysis of the files the job dropped in the spool gave (``docs/collectives.md``).

* ``collective_skew``: δ of a kind (std/mean of the ranks' total send bytes; all-to-all only)
  above ``max_skew``: the router sends far more through some ranks than others, and every
  step waits for the busiest.
* ``collective_straggler``: the longest time a rank waited in one collective of a kind for
  the last rank to arrive is above ``max_wait_seconds``; the message names that rank.

The figures hold until the job drops new files or leaves the node, so a finding holds as long
as the job's latest traces show it.
"""

from __future__ import annotations

from nodescope.alerts import AlertRule
from nodescope.config import CollectivesSettings
from nodescope.detectors.kinds import FindingKind, actions, severities
from nodescope.model.collectives import TRACES, JobCollectives, KindFigures
from nodescope.model.finding import THRESHOLD, VALUE, Finding, Severity
from nodescope.model.snapshot import Snapshot

SKEW = "collective_skew"
STRAGGLER = "collective_straggler"

_TRACES = (
    "the job's own PyTorch profiler traces dropped in the spool (`traces` source): the"
    " ranks' send bytes and arrival times per collective kind"
)
_TRACES_HARDWARE = "yes, for jobs that write profiler traces (docs/collectives.md)"
# Trace figures are already a summary over the profiler's window: they fire at once and hold
# until the job's next files (or its end) change them.
_RULE = AlertRule(for_seconds=0.0, resolve_after_seconds=60.0)

SPECS = (
    FindingKind(
        SKEW,
        severities(Severity.WARNING),
        actions(warning="alert"),
        meaning="a collective kind's send bytes are spread unevenly over the job's ranks:"
        " every step waits for the busiest",
        signal=_TRACES,
        hardware=_TRACES_HARDWARE,
        alert=_RULE,
    ),
    FindingKind(
        STRAGGLER,
        severities(Severity.WARNING),
        actions(warning="alert"),
        meaning="one rank kept the others waiting in a collective longer than `max_wait_seconds`",
        signal=_TRACES,
        hardware=_TRACES_HARDWARE,
        alert=_RULE,
    ),
)


def _ranks(job: JobCollectives) -> str:
    return f"{len(job.ranks)} rank{'s' if len(job.ranks) != 1 else ''}"


def skew_finding(job: JobCollectives, kind: KindFigures, bound: float) -> Finding | None:
    if kind.skew is None or kind.skew <= bound:
        return None
    message = (
        f"job {job.job_id}: {kind.kind} send skew δ = {kind.skew:.2f} over {_ranks(job)}"
        f" (bound {bound:g}): some ranks send far more than others and every step waits for"
        " the busiest; see nodescope analyze on the job's traces for the hot destination"
    )
    evidence = {VALUE: kind.skew, THRESHOLD: bound}
    return Finding(
        SKEW, Severity.WARNING, {"job": job.job_id, "kind": kind.kind}, evidence, message
    )


def straggler_finding(job: JobCollectives, kind: KindFigures, bound: float) -> Finding | None:
    if kind.max_wait_seconds <= bound:
        return None
    who = f"rank {kind.straggler}" if kind.straggler is not None else "an unknown rank"
    message = (
        f"job {job.job_id}: {kind.kind} straggler {who}: the other ranks waited up to"
        f" {kind.max_wait_seconds:.3g} s for it in one collective (bound {bound:g} s);"
        " look at what that rank does before the collective (data loading, host, GPU)"
    )
    evidence: dict[str, float] = {VALUE: kind.max_wait_seconds, THRESHOLD: bound}
    if kind.straggler is not None:
        evidence["straggler_rank"] = float(kind.straggler)
    return Finding(
        STRAGGLER, Severity.WARNING, {"job": job.job_id, "kind": kind.kind}, evidence, message
    )


def detect(
    previous: Snapshot | None, snapshot: Snapshot, settings: CollectivesSettings
) -> list[Finding]:
    if not settings.enabled:
        return []
    data = snapshot.latest(TRACES)
    if data is None:
        return []
    findings: list[Finding] = []
    for job in data.jobs:
        for kind in job.kinds:
            for found in (
                skew_finding(job, kind, settings.max_skew),
                straggler_finding(job, kind, settings.max_wait_seconds),
            ):
                if found is not None:
                    findings.append(found)
    return findings
