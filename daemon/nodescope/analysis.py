"""The analysis step of a cycle: detectors, then the alert engine, then the alert sinks.

``Analyzer.analyze(snapshot)`` runs every detector of ``detectors.registry`` on the previous
and the current snapshot, each isolated like the sources are (a detector that raises, or
returns something that is not a :class:`Finding`, loses its findings for this cycle, is
counted and logged once per change between working and failing; the others go on), steps the
alert engine, logs each transition once as a ``key=value`` line, hands the alerts to the
alert push it was given (the composition root builds the Alertmanager push when one is
configured), and returns the snapshot with ``findings``, ``alerts`` and ``alert_counters``
filled in. Nothing here reads a clock: times are the snapshot's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from nodescope import jsonout
from nodescope.alerts import AlertEngine, AlertRule, AlertRules, AlertStep
from nodescope.config import Config
from nodescope.derive import DerivedStage
from nodescope.detectors.registry import ALERT_RULES, DETECTORS, DetectorInfo
from nodescope.model.alert import Alert, AlertCounters, Transition
from nodescope.model.finding import Finding
from nodescope.model.remediation import REMEDIATION, describe, latest_by_key
from nodescope.model.snapshot import Snapshot

log = logging.getLogger("nodescope.alerts")


class PushTally(Protocol):
    """Batches an alert push has sent, failed to send and replaced before sending."""

    @property
    def sent(self) -> int: ...
    @property
    def errors(self) -> int: ...
    @property
    def dropped(self) -> int: ...


class AlertPush(Protocol):
    """Where each cycle's alerts go (Alertmanager's push in the daemon)."""

    def submit(
        self,
        active: Iterable[Alert],
        transitions: Iterable[Transition],
        now_monotonic: float,
        now_wall: float,
        actions: Mapping[str, str] | None = None,
    ) -> object: ...
    def counts(self) -> PushTally: ...
    def close(self) -> None: ...


#: Builds the alert push a configuration asks for; ``None`` when it asks for none.
PushFactory = Callable[[Config], AlertPush | None]


def no_push(config: Config) -> None:
    """The push factory of an analysis that tells no one (tests, replays, one-shot commands)."""
    return None


def _log_transition(transition: Transition) -> None:
    alert = transition.alert
    extra = ""
    if transition.previous_severity is not None:
        extra = f" from_severity={transition.previous_severity.label}"
    log.info(
        "event=alert_%s key=%s kind=%s severity=%s%s evidence=%r message=%r",
        transition.kind.value,
        alert.key,
        alert.kind,
        alert.severity.label,
        extra,
        " ".join(f"{k}={v:g}" for k, v in alert.evidence_last.items()),
        alert.message,
    )


class Analyzer:
    """Runs the detectors and the alert engine on each snapshot; keeps the previous one."""

    def __init__(
        self,
        detectors: Sequence[DetectorInfo],
        engine: AlertEngine,
        config: Config | None = None,
        pusher: AlertPush | None = None,
        *,
        builtin_rules: Mapping[str, AlertRule] = ALERT_RULES,
        make_pusher: PushFactory = no_push,
    ) -> None:
        """``builtin_rules`` and ``make_pusher`` serve :meth:`configure`: the per-kind rules
        a reloaded configuration overrides, and the push it asks for."""
        self.detectors = tuple(detectors)
        self.engine = engine
        self.config = config or Config()
        self.pusher = pusher
        self.builtin_rules = builtin_rules
        self._make_pusher = make_pusher
        self._previous: Snapshot | None = None
        # The one memory of figures across cycles: rates, attribution and the job registry
        # are made again only from inputs that changed.
        self.derived_stage = DerivedStage()
        # Zero from the start, so increase() sees a detector's first error.
        self._errors: dict[str, int] = {d.name: 0 for d in self.detectors}
        self._failing: set[str] = set()

    @classmethod
    def from_config(
        cls,
        config: Config,
        detectors: Sequence[DetectorInfo] | None = None,
        *,
        builtin_rules: Mapping[str, AlertRule] = ALERT_RULES,
        make_pusher: PushFactory = no_push,
    ) -> Analyzer:
        """The registry's detectors, its alert rules overridden by ``config``, and the push
        ``make_pusher`` builds for ``config``."""
        return cls(
            DETECTORS if detectors is None else detectors,
            AlertEngine(AlertRules.from_settings(config.alerts, builtin_rules)),
            config,
            make_pusher(config),
            builtin_rules=builtin_rules,
            make_pusher=make_pusher,
        )

    def configure(self, config: Config) -> None:
        """Apply a reloaded config: new rules keep the alerts' state; the push is rebuilt
        only when its settings changed."""
        old = self.config.alerts
        new = config.alerts
        self.engine.set_rules(AlertRules.from_settings(new, self.builtin_rules))
        if (
            old.alertmanager_url,
            old.instance,
            old.resend_seconds,
            old.push_timeout_seconds,
            self.config.listen,
        ) != (
            new.alertmanager_url,
            new.instance,
            new.resend_seconds,
            new.push_timeout_seconds,
            config.listen,
        ):
            if self.pusher is not None:
                self.pusher.close()
            self.pusher = self._make_pusher(config)
        self.config = config

    def detect(self, snapshot: Snapshot) -> list[Finding]:
        findings: list[Finding] = []
        for info in self.detectors:
            try:
                found = list(info.detect(self._previous, snapshot, self.config))
                bad = next((f for f in found if not isinstance(f, Finding)), None)
                if bad is not None:
                    raise TypeError(f"returned {type(bad).__name__}, not a Finding")
            except Exception as exc:  # isolation: a failing detector is that detector's alone
                self._errors[info.name] = self._errors.get(info.name, 0) + 1
                if info.name not in self._failing:
                    log.error(
                        "detector=%s state=failing error=%r",
                        info.name,
                        f"{type(exc).__name__}: {exc}",
                    )
                    self._failing.add(info.name)
                continue
            if info.name in self._failing:
                log.info("detector=%s state=ok", info.name)
                self._failing.discard(info.name)
            findings.extend(found)
        return findings

    def analyze(self, snapshot: Snapshot) -> Snapshot:
        """The snapshot with its figures carried over from the last cycle's where their
        inputs are the same (:class:`~nodescope.derive.DerivedStage`), its findings, alerts
        and alert counters."""
        snapshot = self.derived_stage.derive(snapshot)
        findings = self.detect(snapshot)
        step: AlertStep = self.engine.step(findings, snapshot.monotonic, snapshot.wall_time)
        for transition in step.transitions:
            _log_transition(transition)
        push_counts = None
        if self.pusher is not None:
            self.pusher.submit(
                step.active,
                step.transitions,
                snapshot.monotonic,
                snapshot.wall_time,
                actions=action_texts(snapshot),
            )
            push_counts = self.pusher.counts()
        counters = AlertCounters(
            transitions=self.engine.transition_counts,
            detector_errors=self._errors,
            push_sent=push_counts.sent if push_counts else None,
            push_errors=push_counts.errors if push_counts else None,
            push_dropped=push_counts.dropped if push_counts else None,
        )
        analysed = replace(
            snapshot, findings=step.findings, alerts=step.active, alert_counters=counters
        )
        # The detectors see the last cycle's findings too (a removal found critical stays so).
        self._previous = analysed
        return analysed

    def close(self) -> None:
        if self.pusher is not None:
            self.pusher.close()
            self.pusher = None


def alert_json(alert: Alert) -> dict[str, Any]:
    document: dict[str, Any] = jsonout.plain(alert)
    # Severity is an IntEnum (ordered); people and scripts read its name.
    document["severity"] = alert.severity.label
    document["peak_severity"] = alert.peak_severity.label
    document["fingerprint"] = alert.fingerprint
    document["subject"] = alert.subject
    return document


def action_texts(snapshot: Snapshot) -> dict[str, str]:
    """Alert key -> what nodescope last did about it, in words (the ``remediation`` source's
    record): the annotation its Alertmanager alert carries."""
    data = snapshot.latest(REMEDIATION)
    if data is None:
        return {}
    return {key: describe(action) for key, action in latest_by_key(data).items()}


def alerts_document(snapshot: Snapshot) -> dict[str, Any]:
    """The body of ``/api/v1/alerts``: the cycle's active alerts and findings, and the latest
    actions nodescope recorded (``remediation`` source), each with the finding it was about."""
    remediation = snapshot.latest(REMEDIATION)
    return {
        "cycle": snapshot.cycle,
        "wall_time": snapshot.wall_time,
        "alerts": [alert_json(a) for a in snapshot.alerts],
        "actions": [
            {**jsonout.plain(a), "text": describe(a)}
            for a in (remediation.recent if remediation is not None else ())
        ],
        "findings": [
            {**jsonout.plain(f), "severity": f.severity.label, "key": f.key}
            for f in _sorted_findings(snapshot.findings)
        ],
    }


def _sorted_findings(findings: Iterable[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: f.key)
