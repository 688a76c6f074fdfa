"""The alert engine: findings over time become alerts, as a pure state machine.

``AlertEngine(rules).step(findings, now_monotonic, now_wall)`` takes the findings of one cycle
and returns the alerts that are pending or firing afterwards and the transitions of this cycle.
It does no IO, reads no clock and logs nothing; the caller (``nodescope.analysis``) logs and
counts the transitions. It is the only place in the daemon that remembers findings between
cycles: detectors stay pure functions of the snapshots.

Per finding kind an :class:`AlertRule` says

``for_seconds``
    how long the finding must hold before the alert fires. A finding first seen at *t0* fires
    in the first cycle at or after *t0 + for* in which it is present — never later than one
    cycle after ``for`` has elapsed, unless that cycle falls in a gap (below). ``0`` fires in
    the cycle the finding first appears. A pending alert whose finding goes away is
    *cancelled*: it never fired, so it is never reported as resolved.
``pending_gap_seconds``
    how long a pending alert's finding may be missing before the alert is cancelled,
    measured from the first cycle it was missing; the gap counts towards ``for`` but the
    alert fires only in a cycle where the finding is present. Prometheus resets a pending
    alert at the first evaluation that does not return its series (``0`` here); that suits
    an expression evaluated over a range, not a finding computed from the two latest reads
    of a counter, which one late or early read can drop for a single cycle while the
    condition itself never stopped. Any positive gap tolerates one missing cycle at any
    tick; the default, one second, is exactly that at the default 1 s tick. A condition that
    really clears cancels within the gap plus one cycle.
``resolve_after_seconds``
    hysteresis in time: a firing alert resolves only once its finding has been absent for this
    long (measured from the first cycle it was missing); a finding that comes back earlier
    keeps the alert firing as if it had never left. This is Prometheus's ``keep_firing_for``.
``clear_below``
    hysteresis in value. A detector reports the measured quantity as the evidence ``value`` and
    the raise threshold it applied as ``threshold``. A finding *raises* when it has no such pair
    or ``value >= threshold``; it may only start (and keep pending) an alert. A finding below
    its threshold is a *keep* finding: it keeps an already firing alert firing while
    ``value >= clear_below``, and is otherwise treated as absent. So a detector emits a finding
    when its raise condition holds **or** when its keep condition holds — the latter only needs
    the floor :func:`keep_floor` from the configuration, so the detector stays pure and needs
    no knowledge of what is firing.

Severity follows the latest finding on the same identity: a change while firing is an
``escalated`` or ``deescalated`` transition, never a second alert. Several findings with one
key in one cycle are one finding (the most severe). Rules are the built-in rules the caller
hands in (per kind, declared beside the detectors that emit the kind, in
``nodescope.detectors.registry``) overridden key by key by the ``[alerts.rules.<kind>]`` tables
of the configuration, falling back to the ``[alerts]`` defaults. This module keeps no table of
its own: the rules an engine applies are what its builder gave it, whatever was imported first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from nodescope.config import AlertRuleSettings, AlertsSettings, Config
from nodescope.model.alert import Alert, AlertState, Transition, TransitionKind
from nodescope.model.finding import THRESHOLD, VALUE, Finding, Severity

#: Tolerance for comparing elapsed monotonic seconds with ``for``/``resolve_after``: ticks of
#: 0.1 s summed a hundred times are 9.999999999999998 s, and must count as 10 s.
_EPSILON = 1e-6

# VALUE and THRESHOLD, the evidence names of the value-hysteresis convention, live with the
# Finding they describe.


#: Seconds a pending alert's finding may be missing (the ``[alerts]`` default): one missed
#: cycle at the default 1 s tick.
PENDING_GAP_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class AlertRule:
    for_seconds: float = 30.0
    resolve_after_seconds: float = 60.0
    clear_below: float | None = None
    enabled: bool = True
    pending_gap_seconds: float = PENDING_GAP_SECONDS

    def raises(self, finding: Finding) -> bool:
        """Whether the finding meets its detector's raise condition."""
        value = finding.evidence.get(VALUE)
        threshold = finding.evidence.get(THRESHOLD)
        if value is None or threshold is None or math.isnan(threshold):
            return True
        return value >= threshold

    def keeps(self, finding: Finding) -> bool:
        """Whether the finding keeps a firing alert firing: it raises, or its ``value`` is at
        least ``clear_below``."""
        if self.raises(finding):
            return True
        value = finding.evidence.get(VALUE)
        return self.clear_below is not None and value is not None and value >= self.clear_below


@dataclass(frozen=True, slots=True)
class AlertRules:
    """The rule of every kind: ``per_kind`` where given, else ``default``."""

    default: AlertRule = field(default_factory=AlertRule)
    per_kind: Mapping[str, AlertRule] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "per_kind", MappingProxyType(dict(self.per_kind)))

    def for_kind(self, kind: str) -> AlertRule:
        return self.per_kind.get(kind, self.default)

    @classmethod
    def from_settings(
        cls, settings: AlertsSettings, builtin: Mapping[str, AlertRule]
    ) -> AlertRules:
        """``builtin``, the per-kind rules that differ from the ``[alerts]`` defaults,
        overridden key by key by the configuration."""
        gap = settings.pending_gap_seconds
        default = AlertRule(
            settings.for_seconds, settings.resolve_after_seconds, pending_gap_seconds=gap
        )
        # The built-in rules say how long each kind's findings last, not how reads jitter:
        # the configured gap applies to every kind unless its own table sets one.
        per_kind = {kind: replace(rule, pending_gap_seconds=gap) for kind, rule in builtin.items()}
        for kind, over in settings.rules.items():
            per_kind[kind] = _overridden(per_kind.get(kind, default), over)
        return cls(default, per_kind)


def _overridden(base: AlertRule, over: AlertRuleSettings) -> AlertRule:
    """``base`` with the keys an ``[alerts.rules.<kind>]`` table sets."""
    return AlertRule(
        for_seconds=base.for_seconds if over.for_seconds is None else over.for_seconds,
        resolve_after_seconds=(
            base.resolve_after_seconds
            if over.resolve_after_seconds is None
            else over.resolve_after_seconds
        ),
        clear_below=base.clear_below if over.clear_below is None else over.clear_below,
        enabled=base.enabled if over.enabled is None else over.enabled,
        pending_gap_seconds=(
            base.pending_gap_seconds
            if over.pending_gap_seconds is None
            else over.pending_gap_seconds
        ),
    )


def keep_floor(config: Config, kind: str, builtin: AlertRule | None) -> float | None:
    """The lowest ``value`` at which a finding of ``kind`` still matters (the rule's
    ``clear_below``), for detectors that report values in the keep band; ``None``: emit only
    when the raise condition holds. ``builtin`` is the kind's built-in rule, which the
    detector declares (``None`` where the kind takes the ``[alerts]`` defaults)."""
    # The one kind's rule as AlertRules.from_settings makes it, without building every rule:
    # detectors ask each cycle.
    settings = config.alerts
    base = builtin or AlertRule(settings.for_seconds, settings.resolve_after_seconds)
    over = settings.rules.get(kind)
    return (base if over is None else _overridden(base, over)).clear_below


@dataclass(frozen=True, slots=True)
class AlertStep:
    """The outcome of one cycle.

    ``active``: pending and firing alerts, one per identity, sorted by key. ``transitions``:
    what changed in this cycle. ``findings``: the findings that counted — those that raise
    plus the keep findings that held a firing alert, one per key, sorted by key.
    """

    active: tuple[Alert, ...]
    transitions: tuple[Transition, ...]
    findings: tuple[Finding, ...]


def _peak(old: Mapping[str, float], new: Mapping[str, float]) -> dict[str, float]:
    peak = dict(old)
    for name, value in new.items():
        if name not in peak or (not math.isnan(value) and not value <= peak[name]):
            peak[name] = value
    return peak


def _dedupe(findings: Iterable[Finding], rules: AlertRules) -> dict[str, Finding]:
    """One finding per key: the most severe; among equals a raising one, then the first."""
    chosen: dict[str, Finding] = {}
    for finding in findings:
        old = chosen.get(finding.key)
        if old is None:
            chosen[finding.key] = finding
            continue
        rule = rules.for_kind(finding.kind)
        if (finding.severity, rule.raises(finding)) > (old.severity, rule.raises(old)):
            chosen[finding.key] = finding
    return chosen


@dataclass
class _Track:
    """What the engine remembers of one identity."""

    alert: Alert
    absent_since: float | None = None


class AlertEngine:
    """Follows findings across cycles. Not thread-safe: one caller, the collection loop."""

    def __init__(self, rules: AlertRules | None = None) -> None:
        self.rules = rules or AlertRules()
        self._tracks: dict[str, _Track] = {}
        self._counts: dict[tuple[str, str], int] = {}

    def set_rules(self, rules: AlertRules) -> None:
        """New rules (a reload) apply from the next step; alerts keep their state and times.
        Alerts of a kind that is now disabled are dropped at the next step."""
        self.rules = rules

    @property
    def transition_counts(self) -> Mapping[tuple[str, str], int]:
        """(kind, transition) → transitions since the engine started."""
        return MappingProxyType(dict(self._counts))

    def active(self) -> tuple[Alert, ...]:
        return tuple(self._tracks[k].alert for k in sorted(self._tracks))

    def step(self, findings: Iterable[Finding], now_monotonic: float, now_wall: float) -> AlertStep:
        present = _dedupe(findings, self.rules)
        transitions: list[Transition] = []
        counted: dict[str, Finding] = {}

        def emit(
            kind: TransitionKind, alert: Alert, previous_severity: Severity | None = None
        ) -> None:
            transitions.append(Transition(kind, alert, now_monotonic, now_wall, previous_severity))
            count_key = (alert.kind, kind.value)
            self._counts[count_key] = self._counts.get(count_key, 0) + 1

        # Identities already followed: keep, fire, change severity, resolve or cancel.
        for key in sorted(self._tracks):
            track = self._tracks[key]
            alert = track.alert
            rule = self.rules.for_kind(alert.kind)
            finding = present.get(key)
            if not rule.enabled:
                # A reload disabled the kind: the alert goes without notice of resolution
                # only if it never fired.
                del self._tracks[key]
                if alert.state is AlertState.FIRING:
                    emit(TransitionKind.RESOLVED, self._resolved(alert, now_monotonic, now_wall))
                else:
                    emit(TransitionKind.CANCELLED, alert)
                continue
            holds = finding is not None and (
                rule.raises(finding) if alert.state is AlertState.PENDING else rule.keeps(finding)
            )
            if not holds or finding is None:
                if track.absent_since is None:
                    track.absent_since = now_monotonic
                absent = now_monotonic - track.absent_since + _EPSILON
                if alert.state is AlertState.PENDING:
                    if absent >= rule.pending_gap_seconds:
                        del self._tracks[key]
                        emit(TransitionKind.CANCELLED, alert)
                    continue
                if absent >= rule.resolve_after_seconds:
                    del self._tracks[key]
                    emit(TransitionKind.RESOLVED, self._resolved(alert, now_monotonic, now_wall))
                continue
            track.absent_since = None
            counted[key] = finding
            updated = replace(
                alert,
                severity=finding.severity,
                peak_severity=max(alert.peak_severity, finding.severity),
                message=finding.message,
                evidence_last=finding.evidence,
                evidence_peak=_peak(alert.evidence_peak, finding.evidence),
                last_seen_monotonic=now_monotonic,
                last_seen_wall=now_wall,
            )
            if alert.state is AlertState.PENDING:
                if now_monotonic - alert.started_monotonic + _EPSILON >= rule.for_seconds:
                    updated = replace(
                        updated,
                        state=AlertState.FIRING,
                        fired_monotonic=now_monotonic,
                        fired_wall=now_wall,
                    )
                    emit(TransitionKind.FIRING, updated)
            elif finding.severity != alert.severity:
                emit(
                    TransitionKind.ESCALATED
                    if finding.severity > alert.severity
                    else TransitionKind.DEESCALATED,
                    updated,
                    alert.severity,
                )
            track.alert = updated

        # New identities: only a raising finding starts an alert.
        for key in sorted(present.keys() - self._tracks.keys()):
            finding = present[key]
            if any(t.key == key for t in transitions):
                # Resolved or cancelled in this very cycle by a rule change: start afresh
                # next cycle, so one cycle never holds two transitions that contradict.
                continue
            rule = self.rules.for_kind(finding.kind)
            if not rule.enabled or not rule.raises(finding):
                continue
            counted[key] = finding
            alert = Alert(
                key=key,
                kind=finding.kind,
                severity=finding.severity,
                state=AlertState.PENDING,
                subjects=finding.subjects,
                message=finding.message,
                evidence_start=finding.evidence,
                evidence_last=finding.evidence,
                evidence_peak=finding.evidence,
                peak_severity=finding.severity,
                started_monotonic=now_monotonic,
                started_wall=now_wall,
                last_seen_monotonic=now_monotonic,
                last_seen_wall=now_wall,
            )
            if rule.for_seconds <= 0:
                alert = replace(
                    alert,
                    state=AlertState.FIRING,
                    fired_monotonic=now_monotonic,
                    fired_wall=now_wall,
                )
                emit(TransitionKind.FIRING, alert)
            else:
                emit(TransitionKind.PENDING, alert)
            self._tracks[key] = _Track(alert)

        # Findings of disabled kinds are still findings, they just never become alerts.
        for key, finding in present.items():
            rule = self.rules.for_kind(finding.kind)
            if key not in counted and not rule.enabled and rule.raises(finding):
                counted[key] = finding
        return AlertStep(
            active=self.active(),
            transitions=tuple(transitions),
            findings=tuple(counted[k] for k in sorted(counted)),
        )

    @staticmethod
    def _resolved(alert: Alert, now_monotonic: float, now_wall: float) -> Alert:
        return replace(
            alert,
            state=AlertState.RESOLVED,
            resolved_monotonic=now_monotonic,
            resolved_wall=now_wall,
        )
