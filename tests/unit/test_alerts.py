"""The alert engine, the analysis step, the Alertmanager push, the alert metrics, the
``[alerts]`` configuration, ``/api/v1/alerts`` and ``nodescope alerts``."""

from __future__ import annotations

import argparse
import io
import json
import logging
import math
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope import assembly, config
from nodescope.alerts import (
    PENDING_GAP_SECONDS,
    AlertEngine,
    AlertRule,
    AlertRules,
    AlertStep,
    keep_floor,
)
from nodescope.analysis import Analyzer, alerts_document
from nodescope.cli import alerts as alerts_cli
from nodescope.cli.main import main
from nodescope.collect import Collector
from nodescope.detectors.kinds import FindingKind, actions, severities
from nodescope.detectors.registry import ALERT_RULES, DetectorInfo, alert_rules_of
from nodescope.errors import ConfigError
from nodescope.httpserver import JsonCache, MetricsHTTPServer
from nodescope.model.alert import Alert, AlertState, Transition, TransitionKind, fingerprint
from nodescope.model.finding import Finding, Severity
from nodescope.model.snapshot import Snapshot
from nodescope.roots import Roots
from nodescope.sdnotify import Notifier
from nodescope.service import Service, alertmanager_pusher
from nodescope_exporters import alert_metrics
from nodescope_exporters.prometheus import MetricsCache, render
from nodescope_exporters.push import AlertmanagerPusher, PushCounts, alertname
from tests.conftest import free_port

LINK = {"link": "0000:16:01.0"}


def finding(
    severity: Severity = Severity.WARNING,
    subjects: dict[str, str] | None = None,
    kind: str = "pcie_contention",
    **evidence: float,
) -> Finding:
    return Finding(
        kind,
        severity,
        subjects if subjects is not None else dict(LINK),
        evidence,
        f"{kind} on {subjects or LINK}",
    )


def engine(
    for_seconds: float = 0.0,
    resolve_after: float = 0.0,
    clear_below: float | None = None,
    pending_gap: float = PENDING_GAP_SECONDS,
) -> AlertEngine:
    return AlertEngine(
        AlertRules(
            AlertRule(for_seconds, resolve_after, clear_below, pending_gap_seconds=pending_gap)
        )
    )


def kinds(step: AlertStep) -> list[TransitionKind]:
    return [t.kind for t in step.transitions]


# -- the engine: for ---------------------------------------------------------------------------


def test_pending_until_for_has_elapsed_then_firing() -> None:
    e = engine(for_seconds=10)
    first = e.step([finding()], 100.0, 1_700_000_000.0)
    assert kinds(first) == [TransitionKind.PENDING]
    assert [a.state for a in first.active] == [AlertState.PENDING]
    for t in range(1, 10):
        step = e.step([finding()], 100.0 + t, 1_700_000_000.0 + t)
        assert step.transitions == ()
        assert step.active[0].state is AlertState.PENDING
    fired = e.step([finding()], 110.0, 1_700_000_010.0)
    assert kinds(fired) == [TransitionKind.FIRING]
    alert = fired.active[0]
    assert alert.state is AlertState.FIRING
    assert (alert.started_monotonic, alert.fired_monotonic) == (100.0, 110.0)
    assert (alert.started_wall, alert.fired_wall) == (1_700_000_000.0, 1_700_000_010.0)


@pytest.mark.parametrize("tick", [0.1, 0.25, 0.3, 0.7, 1.0, 3.0, 7.0])
@pytest.mark.parametrize("for_seconds", [0.0, 1.0, 5.0, 10.0, 45.0])
def test_fires_in_the_first_cycle_after_for_elapsed(tick: float, for_seconds: float) -> None:
    e = engine(for_seconds=for_seconds)
    start = 12_345.678
    expected_cycle = math.ceil(for_seconds / tick - 1e-9)
    now = start
    fired_at = None
    for cycle in range(expected_cycle + 3):
        step = e.step([finding()], now, now)
        if TransitionKind.FIRING in kinds(step):
            fired_at = cycle
            break
        now += tick  # accumulated, as a loop's clock is: float error included
    assert fired_at == expected_cycle
    assert fired_at * tick >= for_seconds - 1e-6
    assert (fired_at - 1) * tick < for_seconds


def test_for_zero_fires_in_the_first_cycle_without_pending() -> None:
    step = engine(for_seconds=0).step([finding()], 1.0, 1.0)
    assert kinds(step) == [TransitionKind.FIRING]
    assert step.active[0].state is AlertState.FIRING


def test_without_a_gap_a_pending_alert_that_goes_away_is_cancelled_not_resolved() -> None:
    # pending_gap 0 is Prometheus's `for`: the first evaluation without the series resets it.
    e = engine(for_seconds=10, resolve_after=30, pending_gap=0.0)
    e.step([finding()], 0.0, 0.0)
    step = e.step([], 5.0, 5.0)
    assert kinds(step) == [TransitionKind.CANCELLED]
    assert step.transitions[0].alert.fired_monotonic is None
    assert step.active == ()
    # Coming back starts the for-timer again.
    again = e.step([finding()], 6.0, 6.0)
    assert kinds(again) == [TransitionKind.PENDING]
    assert again.active[0].started_monotonic == 6.0
    assert e.step([finding()], 15.0, 15.0).transitions == ()
    assert kinds(e.step([finding()], 16.0, 16.0)) == [TransitionKind.FIRING]


# -- the engine: a pending alert across a missing cycle ----------------------------------------


def test_one_missing_cycle_does_not_reset_the_pending_timer() -> None:
    # The default rule: a rate read a little early or late drops a finding for one cycle
    # while the condition never stopped; the alert fires when `for` has elapsed since the
    # finding first appeared, as if the cycle had not been missed.
    e = AlertEngine(AlertRules(AlertRule(for_seconds=10, resolve_after_seconds=30)))
    assert kinds(e.step([finding()], 0.0, 0.0)) == [TransitionKind.PENDING]
    for t in (1.0, 2.0, 3.0, 4.0):
        assert e.step([finding()], t, t).transitions == ()
    gap = e.step([], 5.0, 5.0)
    assert gap.transitions == ()
    assert [(a.state, a.started_monotonic) for a in gap.active] == [(AlertState.PENDING, 0.0)]
    for t in (6.0, 7.0, 8.0, 9.0):
        assert e.step([finding()], t, t).transitions == ()
    fired = e.step([finding()], 10.0, 10.0)
    assert kinds(fired) == [TransitionKind.FIRING]
    assert (fired.active[0].started_monotonic, fired.active[0].fired_monotonic) == (0.0, 10.0)


def test_a_pending_alert_fires_only_in_a_cycle_where_its_finding_is_present() -> None:
    e = engine(for_seconds=3, resolve_after=30)
    for t in (0.0, 1.0, 2.0):
        e.step([finding()], t, t)
    # `for` has elapsed at t=3, but the finding is missing: no alert fires on no evidence.
    missing = e.step([], 3.0, 3.0)
    assert missing.transitions == () and missing.active[0].state is AlertState.PENDING
    back = e.step([finding()], 4.0, 4.0)
    assert kinds(back) == [TransitionKind.FIRING]
    assert back.active[0].started_monotonic == 0.0


def test_two_missing_cycles_at_the_default_tick_cancel() -> None:
    e = AlertEngine(AlertRules(AlertRule(for_seconds=10, resolve_after_seconds=30)))
    e.step([finding()], 0.0, 0.0)
    e.step([finding()], 1.0, 1.0)
    assert e.step([], 2.0, 2.0).transitions == ()
    cancelled = e.step([], 3.0, 3.0)
    assert kinds(cancelled) == [TransitionKind.CANCELLED]
    assert cancelled.active == ()
    # Back after a real clearing: a new alert with a new start.
    again = e.step([finding()], 4.0, 4.0)
    assert kinds(again) == [TransitionKind.PENDING]
    assert again.active[0].started_monotonic == 4.0


@pytest.mark.parametrize("tick", [0.1, 0.25, 1.0, 1.3, 5.0, 15.0])
@pytest.mark.parametrize("gap", [0.0, 0.5, 1.0, 2.5, 30.0])
def test_a_condition_that_clears_cancels_within_the_gap_and_one_cycle(
    tick: float, gap: float
) -> None:
    e = engine(for_seconds=10_000, pending_gap=gap)
    now = 0.0
    e.step([finding()], now, now)
    first_missing: float | None = None
    cancelled_at: float | None = None
    for _cycle in range(10_000):
        now += tick  # accumulated, as a loop's clock is
        first_missing = now if first_missing is None else first_missing
        if TransitionKind.CANCELLED in kinds(e.step([], now, now)):
            cancelled_at = now
            break
    assert cancelled_at is not None and first_missing is not None
    assert cancelled_at - first_missing <= gap + tick + 1e-6
    if gap > 0:
        # Any gap at all tolerates one missing cycle, whatever the tick.
        assert cancelled_at > first_missing
        assert cancelled_at - first_missing >= gap - 1e-6
    else:
        assert cancelled_at == first_missing


def test_a_keep_band_finding_counts_as_missing_for_a_pending_alert() -> None:
    e = engine(for_seconds=5, resolve_after=0, clear_below=0.6)
    e.step([finding(value=0.85, threshold=0.8)], 0.0, 0.0)
    assert e.step([finding(value=0.7, threshold=0.8)], 1.0, 1.0).transitions == ()
    step = e.step([finding(value=0.7, threshold=0.8)], 2.0, 2.0)
    assert kinds(step) == [TransitionKind.CANCELLED]


def test_the_pending_gap_is_configured_for_every_kind_and_per_kind() -> None:
    builtin = {"pcie_contention": AlertRule(30.0, 60.0, clear_below=0.5)}
    default = AlertRules.from_settings(assembly.default_config().alerts, builtin)
    assert default.for_kind("pcie_contention").pending_gap_seconds == PENDING_GAP_SECONDS == 1.0
    assert default.for_kind("anything").pending_gap_seconds == 1.0
    cfg = assembly.from_mapping(
        {
            "alerts": {
                "pending_gap_seconds": 0.0,
                "rules": {"nvlink_stall": {"pending_gap_seconds": 5.0}},
            }
        },
        "t.toml",
    )
    rules = AlertRules.from_settings(cfg.alerts, builtin)
    # The [alerts] gap reaches the kinds with built-in rules, whose other keys stay.
    contention = rules.for_kind("pcie_contention")
    assert (contention.pending_gap_seconds, contention.clear_below) == (0.0, 0.5)
    assert rules.for_kind("nvlink_stall").pending_gap_seconds == 5.0
    assert rules.for_kind("anything").pending_gap_seconds == 0.0


# -- the engine: resolution (hysteresis in time) -----------------------------------------------


def test_resolves_only_after_absent_for_resolve_after() -> None:
    e = engine(for_seconds=0, resolve_after=3)
    e.step([finding()], 0.0, 1000.0)
    for t in (1.0, 2.0, 3.0):
        step = e.step([], t, 1000.0 + t)
        assert step.transitions == ()
        assert step.active[0].state is AlertState.FIRING
    resolved = e.step([], 4.0, 1004.0)
    assert kinds(resolved) == [TransitionKind.RESOLVED]
    alert = resolved.transitions[0].alert
    assert alert.state is AlertState.RESOLVED
    assert (alert.resolved_monotonic, alert.resolved_wall) == (4.0, 1004.0)
    assert alert.last_seen_monotonic == 0.0
    assert resolved.active == ()
    assert e.step([], 5.0, 1005.0).transitions == ()


def test_a_finding_back_within_resolve_after_keeps_the_same_alert() -> None:
    e = engine(for_seconds=0, resolve_after=5)
    e.step([finding()], 0.0, 0.0)
    e.step([], 1.0, 1.0)
    e.step([], 2.0, 2.0)
    back = e.step([finding()], 3.0, 3.0)
    assert back.transitions == ()
    assert back.active[0].started_monotonic == 0.0
    # The absence clock starts again from the next gap.
    for t in (4.0, 5.0, 6.0, 7.0, 8.0):
        assert e.step([], t, t).transitions == ()
    assert kinds(e.step([], 9.0, 9.0)) == [TransitionKind.RESOLVED]


def test_resolve_after_zero_resolves_in_the_first_absent_cycle() -> None:
    e = engine(for_seconds=0, resolve_after=0)
    e.step([finding()], 0.0, 0.0)
    assert kinds(e.step([], 1.0, 1.0)) == [TransitionKind.RESOLVED]


# -- the engine: hysteresis in value -----------------------------------------------------------


def test_a_firing_alert_stays_firing_in_the_keep_band_and_clears_below() -> None:
    e = engine(for_seconds=0, resolve_after=0, clear_below=0.6)
    raised = e.step([finding(value=0.9, threshold=0.8)], 0.0, 0.0)
    assert kinds(raised) == [TransitionKind.FIRING]
    kept = e.step([finding(value=0.7, threshold=0.8)], 1.0, 1.0)
    assert kept.transitions == ()
    assert kept.active[0].state is AlertState.FIRING
    assert kept.active[0].evidence_last["value"] == 0.7
    assert [f.evidence["value"] for f in kept.findings] == [0.7]
    at_floor = e.step([finding(value=0.6, threshold=0.8)], 2.0, 2.0)
    assert at_floor.transitions == ()
    cleared = e.step([finding(value=0.59, threshold=0.8)], 3.0, 3.0)
    assert kinds(cleared) == [TransitionKind.RESOLVED]
    assert cleared.findings == ()


def test_the_keep_band_neither_starts_nor_keeps_a_pending_alert() -> None:
    e = engine(for_seconds=5, resolve_after=0, clear_below=0.6, pending_gap=0.0)
    idle = e.step([finding(value=0.7, threshold=0.8)], 0.0, 0.0)
    assert idle.active == () and idle.transitions == () and idle.findings == ()
    e.step([finding(value=0.85, threshold=0.8)], 1.0, 1.0)
    step = e.step([finding(value=0.7, threshold=0.8)], 2.0, 2.0)
    assert kinds(step) == [TransitionKind.CANCELLED]


def test_without_clear_below_a_value_under_its_threshold_is_absent() -> None:
    e = engine(for_seconds=0, resolve_after=0)
    e.step([finding(value=0.9, threshold=0.8)], 0.0, 0.0)
    assert kinds(e.step([finding(value=0.79, threshold=0.8)], 1.0, 1.0)) == [
        TransitionKind.RESOLVED
    ]


def test_keep_floor_is_the_configured_clear_below() -> None:
    cfg = assembly.from_mapping(
        {"alerts": {"rules": {"pcie_contention": {"clear_below": 0.65}}}}, "t.toml"
    )
    assert keep_floor(cfg, "pcie_contention", ALERT_RULES.get("pcie_contention")) == 0.65
    assert keep_floor(cfg, "nvlink_errors", ALERT_RULES.get("nvlink_errors")) is None


# -- the engine: severity, identity, deduplication ---------------------------------------------


def test_severity_escalates_and_deescalates_on_the_same_alert() -> None:
    e = engine(for_seconds=0, resolve_after=10)
    e.step([finding(Severity.WARNING, value=1.0)], 0.0, 0.0)
    up = e.step([finding(Severity.CRITICAL, value=3.0)], 1.0, 1.0)
    assert kinds(up) == [TransitionKind.ESCALATED]
    assert up.transitions[0].previous_severity is Severity.WARNING
    assert len(up.active) == 1 and up.active[0].severity is Severity.CRITICAL
    down = e.step([finding(Severity.WARNING, value=2.0)], 2.0, 2.0)
    assert kinds(down) == [TransitionKind.DEESCALATED]
    alert = down.active[0]
    assert alert.severity is Severity.WARNING
    assert alert.peak_severity is Severity.CRITICAL
    assert dict(alert.evidence_start) == {"value": 1.0}
    assert dict(alert.evidence_last) == {"value": 2.0}
    assert dict(alert.evidence_peak) == {"value": 3.0}
    assert alert.started_monotonic == 0.0 and alert.fired_monotonic == 0.0


def test_one_alert_per_identity_the_most_severe_finding_wins() -> None:
    e = engine(for_seconds=0)
    step = e.step(
        [
            finding(Severity.WARNING, value=1.0),
            finding(Severity.CRITICAL, value=2.0),
            finding(Severity.INFO, value=3.0),
            finding(Severity.WARNING, {"link": "0000:17:01.0"}),
        ],
        0.0,
        0.0,
    )
    assert [a.key for a in step.active] == [
        "pcie_contention{link=0000:16:01.0}",
        "pcie_contention{link=0000:17:01.0}",
    ]
    assert step.active[0].severity is Severity.CRITICAL
    assert len(step.findings) == 2
    assert kinds(step) == [TransitionKind.FIRING, TransitionKind.FIRING]


def test_identity_is_kind_and_subjects_whatever_their_order_and_numbers() -> None:
    a = finding(Severity.WARNING, {"link": "L", "gpu": "2", "job": "81734"}, value=1.0)
    b = finding(Severity.CRITICAL, {"job": "81734", "gpu": "2", "link": "L"}, value=9.0)
    c = finding(Severity.WARNING, {"link": "L", "gpu": "3", "job": "81734"})
    assert a.key == b.key != c.key
    e = engine(for_seconds=0)
    first = e.step([a], 0.0, 0.0).active[0]
    second = e.step([b], 1.0, 1.0).active[0]
    assert first.key == second.key == "pcie_contention{gpu=2,job=81734,link=L}"
    assert first.fingerprint == second.fingerprint == fingerprint(a.key)
    assert len(first.fingerprint) == 16 and int(first.fingerprint, 16) >= 0
    assert fingerprint(c.key) != first.fingerprint
    assert second.subject == "gpu=2,job=81734,link=L"


def test_a_fingerprint_is_the_keys_64_bit_fnv_1a() -> None:
    # The published FNV-1a test vectors: the id is the same in every process and release.
    assert fingerprint("") == "cbf29ce484222325"
    assert fingerprint("a") == "af63dc4c8601ec8c"
    assert fingerprint("foobar") == "85944171f73967e8"
    # Any subject, of any length, is 16 hex digits.
    ids = {fingerprint(k) for k in ("\u00e9", "e", "\u00e9" * 10_000, "\x00")}
    assert len(ids) == 4 and all(len(i) == 16 and int(i, 16) >= 0 for i in ids)


def test_rules_per_kind_and_disabled_kinds() -> None:
    rules = AlertRules(
        AlertRule(for_seconds=100.0),
        {"nvlink_errors": AlertRule(for_seconds=0.0), "noise": AlertRule(enabled=False)},
    )
    e = AlertEngine(rules)
    step = e.step(
        [finding(kind="pcie_contention"), finding(kind="nvlink_errors"), finding(kind="noise")],
        0.0,
        0.0,
    )
    assert {(t.alert.kind, t.kind) for t in step.transitions} == {
        ("pcie_contention", TransitionKind.PENDING),
        ("nvlink_errors", TransitionKind.FIRING),
    }
    assert {f.kind for f in step.findings} == {"pcie_contention", "nvlink_errors", "noise"}
    # Disabling a kind on reload: its firing alert resolves, its pending one is cancelled.
    e.set_rules(AlertRules(AlertRule(enabled=False)))
    off = e.step([finding(kind="pcie_contention"), finding(kind="nvlink_errors")], 1.0, 1.0)
    assert {(t.alert.kind, t.kind) for t in off.transitions} == {
        ("pcie_contention", TransitionKind.CANCELLED),
        ("nvlink_errors", TransitionKind.RESOLVED),
    }
    assert off.active == ()
    assert e.transition_counts == {
        ("pcie_contention", "pending"): 1,
        ("pcie_contention", "cancelled"): 1,
        ("nvlink_errors", "firing"): 1,
        ("nvlink_errors", "resolved"): 1,
    }


def test_rules_from_settings_override_builtins_key_by_key() -> None:
    cfg = assembly.from_mapping(
        {
            "alerts": {
                "for_seconds": 20,
                "resolve_after_seconds": 40,
                "rules": {
                    "pcie_aer": {"resolve_after_seconds": 600},
                    "pcie_contention": {"clear_below": 0.7, "enabled": False},
                },
            }
        },
        "t.toml",
    )
    builtin = {"pcie_aer": AlertRule(0.0, 300.0), "nvlink_errors": AlertRule(5.0, 50.0)}
    rules = AlertRules.from_settings(cfg.alerts, builtin)
    assert rules.for_kind("pcie_aer") == AlertRule(0.0, 600.0)
    assert rules.for_kind("nvlink_errors") == AlertRule(5.0, 50.0)
    assert rules.for_kind("pcie_contention") == AlertRule(20.0, 40.0, 0.7, enabled=False)
    assert rules.for_kind("other") == AlertRule(20.0, 40.0)


# Prints the rules an engine gets from the registry's table, as JSON. ``{first}`` is what the
# process imports before it: nothing but the alert engine, or the whole daemon.
_RULES_PROGRAM = """
import json
from dataclasses import asdict
{first}
from nodescope.assembly import default_config
from nodescope.config import Config
from nodescope.detectors.registry import ALERT_RULES
{build}
print(json.dumps({{
    "default": asdict(rules.default),
    "per_kind": {{kind: asdict(rule) for kind, rule in sorted(rules.per_kind.items())}},
}}))
"""


def _rules_in_a_fresh_process(first: str, build: str) -> dict[str, Any]:
    program = _RULES_PROGRAM.format(first=first, build=build)
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=True
    )
    document: dict[str, Any] = json.loads(done.stdout)
    return document


def test_the_engines_rules_do_not_depend_on_import_order() -> None:
    alone = _rules_in_a_fresh_process(
        "from nodescope.alerts import AlertRules",
        "rules = AlertRules.from_settings(default_config().alerts, ALERT_RULES)",
    )
    everything = _rules_in_a_fresh_process(
        "import nodescope.cli.main, nodescope.service, nodescope.sim.driver\n"
        "from nodescope.analysis import Analyzer",
        "rules = Analyzer.from_config(default_config(), detectors=()).engine.rules",
    )
    assert alone == everything
    # The registry's rules reach the engine: an error counter that moved fires at once.
    assert alone["per_kind"]["pcie_aer_errors"]["for_seconds"] == 0.0
    assert alone["per_kind"]["pcie_contention"]["clear_below"] == 0.5


def test_no_module_level_table_of_rules_to_fill() -> None:
    import nodescope.alerts as alerts_module

    mutable = [
        name
        for name, value in vars(alerts_module).items()
        if isinstance(value, dict | list | set | bytearray) and not name.startswith("__")
    ]
    assert mutable == []
    assert isinstance(ALERT_RULES, MappingProxyType)


def test_a_kind_has_one_built_in_rule() -> None:
    def detect(prev: Snapshot | None, cur: Snapshot, cfg: config.Config) -> list[Finding]:
        return []

    rule = AlertRule(for_seconds=0.0)
    spec = FindingKind(
        "xid",
        severities(Severity.WARNING),
        actions(warning="alert"),
        meaning="an Xid",
        signal="NVML",
        hardware="yes",
        alert=rule,
    )
    one = DetectorInfo("one", detect, (spec,))
    other = DetectorInfo("other", detect, (spec,))
    assert alert_rules_of([one]) == {"xid": rule}
    with pytest.raises(ValueError, match="'xid' declared twice"):
        alert_rules_of([one, other])


# -- the engine: properties --------------------------------------------------------------------

KEYS = ("a", "b", "c")


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[AlertRule, list[tuple[float, list[Finding]]]]:
    rule = AlertRule(
        for_seconds=draw(st.sampled_from([0.0, 0.5, 1.0, 2.5, 5.0])),
        resolve_after_seconds=draw(st.sampled_from([0.0, 1.0, 3.0])),
        clear_below=draw(st.sampled_from([None, 0.3, 0.6])),
        pending_gap_seconds=draw(st.sampled_from([0.0, 0.5, 1.0, 3.0])),
    )
    cycles = []
    for _ in range(draw(st.integers(1, 30))):
        dt = draw(st.sampled_from([0.1, 0.5, 1.0, 2.0]))
        present = []
        for key in KEYS:
            for _copy in range(draw(st.integers(0, 2))):
                present.append(
                    finding(
                        draw(st.sampled_from(list(Severity))),
                        {"link": key},
                        value=draw(st.sampled_from([0.2, 0.5, 0.7, 0.9])),
                        threshold=0.8,
                    )
                )
        cycles.append((dt, present))
    return rule, cycles


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_any_sequence_keeps_one_alert_per_identity_and_honest_transitions(
    scenario: tuple[AlertRule, list[tuple[float, list[Finding]]]],
) -> None:
    rule, cycles = scenario
    e = AlertEngine(AlertRules(rule))
    state: dict[str, AlertState] = {}
    now = 0.0
    for dt, present in cycles:
        now += dt
        step = e.step(present, now, now + 1e9)
        keys = [a.key for a in step.active]
        assert len(keys) == len(set(keys))
        assert len({f.key for f in step.findings}) == len(step.findings)
        for t in step.transitions:
            before = state.get(t.key)
            if t.kind is TransitionKind.RESOLVED:
                # Only an alert that fired can resolve.
                assert before is AlertState.FIRING
                assert t.alert.fired_monotonic is not None
                del state[t.key]
            elif t.kind is TransitionKind.CANCELLED:
                assert before is AlertState.PENDING
                assert t.alert.fired_monotonic is None
                del state[t.key]
            elif t.kind is TransitionKind.PENDING:
                assert before is None
                state[t.key] = AlertState.PENDING
            elif t.kind is TransitionKind.FIRING:
                assert before in (None, AlertState.PENDING)
                state[t.key] = AlertState.FIRING
            else:
                assert before is AlertState.FIRING
        assert {a.key: a.state for a in step.active} == state
        for alert in step.active:
            if alert.state is AlertState.PENDING:
                # Never later than the first cycle after for elapsed in which the finding
                # held; between such cycles, missing for less than the gap (the cycle that
                # reached the gap cancelled it).
                assert alert.last_seen_monotonic - alert.started_monotonic < rule.for_seconds
                if alert.last_seen_monotonic < now:
                    assert rule.pending_gap_seconds > 0
                    assert now - alert.last_seen_monotonic < rule.pending_gap_seconds + 2.0
            else:
                assert alert.fired_monotonic is not None
                assert alert.fired_monotonic - alert.started_monotonic >= rule.for_seconds - 1e-6


# -- the analysis step -------------------------------------------------------------------------


def snap(cycle: int, monotonic: float | None = None) -> Snapshot:
    t = float(cycle) if monotonic is None else monotonic
    return Snapshot(cycle=cycle, monotonic=t, wall_time=1_700_000_000.0 + t)


def test_the_daemon_analyses_with_no_detectors() -> None:
    analyzer = Analyzer.from_config(assembly.default_config(), detectors=())
    out = analyzer.analyze(snap(1))
    assert out.findings == () and out.alerts == ()
    assert out.alert_counters is not None
    assert dict(out.alert_counters.transitions) == {}
    assert out.alert_counters.push_sent is None
    assert analyzer.pusher is None


def test_a_failing_detector_is_isolated_counted_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[tuple[int | None, int]] = []
    broken = {"on": True}

    def good(prev: Snapshot | None, cur: Snapshot, cfg: config.Config) -> Iterable[Finding]:
        calls.append((prev.cycle if prev else None, cur.cycle))
        return [finding()]

    def bad(prev: Snapshot | None, cur: Snapshot, cfg: config.Config) -> Iterator[Finding]:
        yield finding(kind="half")
        if broken["on"]:
            raise ZeroDivisionError("no traffic")

    def wrong(prev: Snapshot | None, cur: Snapshot, cfg: config.Config) -> Iterable[Finding]:
        return ["not a finding"]  # type: ignore[list-item]

    analyzer = Analyzer(
        [DetectorInfo("bad", bad), DetectorInfo("good", good), DetectorInfo("wrong", wrong)],
        engine(for_seconds=0, resolve_after=60),
    )
    caplog.set_level(logging.INFO, logger="nodescope")
    for cycle in (1, 2, 3):
        out = analyzer.analyze(snap(cycle))
        assert [f.kind for f in out.findings] == ["pcie_contention"]
        assert [a.kind for a in out.alerts] == ["pcie_contention"]
    assert calls == [(None, 1), (1, 2), (2, 3)]
    assert out.alert_counters is not None
    assert dict(out.alert_counters.detector_errors) == {"bad": 3, "good": 0, "wrong": 3}
    assert caplog.text.count("detector=bad state=failing") == 1
    assert "ZeroDivisionError: no traffic" in caplog.text
    assert caplog.text.count("detector=wrong state=failing") == 1
    assert caplog.text.count("event=alert_firing") == 1
    assert "key=pcie_contention{link=0000:16:01.0}" in caplog.text
    broken["on"] = False
    out = analyzer.analyze(snap(4))
    assert "detector=bad state=ok" in caplog.text
    assert {f.kind for f in out.findings} == {"pcie_contention", "half"}


def test_analyze_counts_transitions_in_the_snapshot() -> None:
    present = {"on": True}

    def detect(prev: Snapshot | None, cur: Snapshot, cfg: config.Config) -> list[Finding]:
        return [finding()] if present["on"] else []

    analyzer = Analyzer([DetectorInfo("d", detect)], engine(for_seconds=1, resolve_after=0))
    analyzer.analyze(snap(1))
    out = analyzer.analyze(snap(2))
    assert [a.state for a in out.alerts] == [AlertState.FIRING]
    present["on"] = False
    out = analyzer.analyze(snap(3))
    assert out.alert_counters is not None
    assert dict(out.alert_counters.transitions) == {
        ("pcie_contention", "pending"): 1,
        ("pcie_contention", "firing"): 1,
        ("pcie_contention", "resolved"): 1,
    }
    document = alerts_document(out)
    assert document["alerts"] == [] and document["cycle"] == 3


# -- metrics -----------------------------------------------------------------------------------


def alert(kind: str, subjects: dict[str, str], severity: Severity, state: AlertState) -> Alert:
    return Alert(
        key=Finding(kind, severity, subjects).key,
        kind=kind,
        severity=severity,
        state=state,
        subjects=subjects,
    )


def test_alert_metrics_have_bounded_labels() -> None:
    from nodescope.model.alert import AlertCounters

    s = replace(
        snap(1),
        alerts=(
            alert(
                "pcie_contention", {"link": "L1", "job": "1"}, Severity.CRITICAL, AlertState.FIRING
            ),
            alert(
                "pcie_contention", {"link": "L1", "job": "2"}, Severity.CRITICAL, AlertState.FIRING
            ),
            alert(
                "pcie_contention", {"link": "L2", "pid": "7"}, Severity.WARNING, AlertState.PENDING
            ),
        ),
        findings=(finding(Severity.CRITICAL), finding(Severity.CRITICAL, {"link": "L9"})),
        alert_counters=AlertCounters(
            {("pcie_contention", "firing"): 2}, {"contention": 0}, 3, 1, 0
        ),
    )
    text = render(s, [alert_metrics.families]).decode()
    assert (
        'nodescope_alert_active{kind="pcie_contention",severity="critical",state="firing",'
        'subject="link=L1"} 2.0'
    ) in text
    assert (
        'nodescope_alert_active{kind="pcie_contention",severity="warning",state="pending",'
        'subject="link=L2"} 1.0'
    ) in text
    assert "job=" not in text and "pid=" not in text
    assert 'nodescope_findings{kind="pcie_contention",severity="critical"} 2.0' in text
    assert 'nodescope_alert_transitions_total{kind="pcie_contention",to="firing"} 2.0' in text
    assert 'nodescope_detector_errors_total{detector="contention"} 0.0' in text
    assert "nodescope_alert_push_sent_total 3.0" in text
    assert "nodescope_alert_push_errors_total 1.0" in text


def test_no_alerts_no_series() -> None:
    text = render(snap(1), [alert_metrics.families]).decode()
    assert not [line for line in text.splitlines() if line and not line.startswith("#")]


def test_the_exporter_loads_the_alert_area() -> None:
    text = MetricsCache().update(snap(1)).decode()
    assert "# TYPE nodescope_alert_active gauge" in text


# -- configuration -----------------------------------------------------------------------------


def test_alerts_section_is_read(tmp_path: Path) -> None:
    path = tmp_path / "n.toml"
    path.write_text(
        """
[alerts]
alertmanager_url = "http://127.0.0.1:9093"
instance = "node-17"
resend_seconds = 30
for_seconds = 10
[alerts.rules.pcie_contention]
for_seconds = 45
clear_below = 0.7
"""
    )
    cfg = assembly.load(path)
    assert cfg.alerts.alertmanager_url == "http://127.0.0.1:9093"
    assert cfg.alerts.instance == "node-17"
    assert cfg.alerts.resend_seconds == 30.0
    assert cfg.alerts.for_seconds == 10.0
    assert cfg.alerts.resolve_after_seconds == 60.0
    rule = cfg.alerts.rules["pcie_contention"]
    assert (rule.for_seconds, rule.clear_below, rule.resolve_after_seconds) == (45.0, 0.7, None)
    assert assembly.default_config().alerts == config.AlertsSettings()


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[alerts]\nalertmanager = 'x'\n", "alerts.alertmanager"),
        ("[alerts]\nalertmanager_url = 'ftp://host'\n", "alerts.alertmanager_url"),
        ("[alerts]\nalertmanager_url = 'http://h:1/?q=1'\n", "alerts.alertmanager_url"),
        ("[alerts]\nfor_seconds = -1\n", "alerts.for_seconds"),
        ("[alerts]\nresend_seconds = 0\n", "alerts.resend_seconds"),
        ("[alerts]\nresend_seconds = inf\n", "alerts.resend_seconds"),
        ("[alerts]\nrules = 3\n", "alerts.rules"),
        ("[alerts.rules.Contention]\n", "alerts.rules.Contention"),
        ("[alerts.rules.x]\nfor = 3\n", "alerts.rules.x.for"),
        ("[alerts.rules.x]\nclear_below = nan\n", "alerts.rules.x.clear_below"),
        ("[alerts.rules.x]\nenabled = 1\n", "alerts.rules.x.enabled"),
        ("[alerts]\npending_gap_seconds = -1\n", "alerts.pending_gap_seconds"),
        ("[alerts]\npending_gap_seconds = inf\n", "alerts.pending_gap_seconds"),
        ("[alerts.rules.x]\npending_gap_seconds = nan\n", "alerts.rules.x.pending_gap_seconds"),
        ("alerts = 1\n", "alerts"),
    ],
)
def test_bad_alerts_config_names_file_and_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "n.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        assembly.load(path)
    assert info.value.key == key
    assert str(path) in str(info.value)


def test_reference_lists_the_alert_keys() -> None:
    text = assembly.reference_markdown()
    for key in (
        "alerts.alertmanager_url",
        "alerts.for_seconds",
        "alerts.rules.<kind>.clear_below",
        "alerts.rules.<kind>.resolve_after_seconds",
    ):
        assert f"| `{key}` |" in text


# -- the Alertmanager push ---------------------------------------------------------------------


class Receiver:
    """A stand-in Alertmanager on 127.0.0.1 that records what is posted."""

    def __init__(self, status: int = 200, delay: float = 0.0) -> None:
        self.batches: list[tuple[str, list[dict[str, Any]]]] = []
        self.status = status
        self.delay = delay
        self.arrived = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                time.sleep(receiver.delay)
                receiver.batches.append((self.path, json.loads(body)))
                self.send_response(receiver.status)
                self.send_header("Content-Length", "0")
                self.end_headers()
                receiver.arrived.set()

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def wait(self, count: int, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.batches) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(self.batches) >= count, self.batches

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def firing(e: AlertEngine, f: Finding, t: float) -> AlertStep:
    return e.step([f], t, 1_700_000_000.0 + t)


def test_push_sends_firing_resends_and_resolves(receiver: Receiver) -> None:
    pusher = AlertmanagerPusher(receiver.url, instance="node-1", resend_seconds=60)
    try:
        e = engine(for_seconds=0, resolve_after=0)
        step = firing(e, finding(Severity.CRITICAL, value=0.9, threshold=0.8), 0.0)
        assert pusher.submit(step.active, step.transitions, 0.0, 1_700_000_000.0)
        receiver.wait(1)
        path, batch = receiver.batches[0]
        assert path == "/api/v2/alerts"
        (doc,) = batch
        assert doc["labels"] == {
            "alertname": "NodescopePcieContention",
            "severity": "critical",
            "instance": "node-1",
            "kind": "pcie_contention",
            "subject": "link=0000:16:01.0",
            "origin": "daemon",
            "scope": "node",
        }
        assert doc["annotations"]["summary"].startswith("pcie_contention on")
        assert doc["annotations"]["evidence"] == "threshold=0.8 value=0.9"
        assert doc["startsAt"] == "2023-11-14T22:13:20.000Z"
        assert doc["endsAt"] == "2023-11-14T22:17:20.000Z"  # now + 4 × resend

        # Nothing changed, resend interval not over: nothing sent.
        step = firing(e, finding(Severity.CRITICAL, value=0.9, threshold=0.8), 30.0)
        assert not pusher.submit(step.active, step.transitions, 30.0, 1_700_000_030.0)
        # The interval is over: the firing alert is sent again.
        step = firing(e, finding(Severity.CRITICAL, value=0.95, threshold=0.8), 61.0)
        assert pusher.submit(step.active, step.transitions, 61.0, 1_700_000_061.0)
        receiver.wait(2)
        assert receiver.batches[1][1][0]["annotations"]["evidence"] == "threshold=0.8 value=0.95"

        step = e.step([], 62.0, 1_700_000_062.0)
        assert kinds(step) == [TransitionKind.RESOLVED]
        assert pusher.submit(step.active, step.transitions, 62.0, 1_700_000_062.0)
        receiver.wait(3)
        (resolved,) = receiver.batches[2][1]
        assert resolved["labels"]["alertname"] == "NodescopePcieContention"
        assert resolved["endsAt"] == "2023-11-14T22:14:22.000Z"
        # The receiver holds the batch before it answers; the pusher counts it on the answer.
        deadline = time.monotonic() + 10
        while pusher.counts().sent < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pusher.counts().sent == 3 and pusher.counts().errors == 0
    finally:
        pusher.close()


def test_push_escalation_resolves_the_old_label_set(receiver: Receiver) -> None:
    pusher = AlertmanagerPusher(receiver.url, instance="n", resend_seconds=60)
    try:
        e = engine(for_seconds=0, resolve_after=10)
        step = firing(e, finding(Severity.WARNING), 0.0)
        pusher.submit(step.active, step.transitions, 0.0, 1_700_000_000.0)
        receiver.wait(1)
        step = firing(e, finding(Severity.CRITICAL), 1.0)
        assert kinds(step) == [TransitionKind.ESCALATED]
        assert pusher.submit(step.active, step.transitions, 1.0, 1_700_000_001.0)
        receiver.wait(2)
        batch = receiver.batches[1][1]
        by_severity = {d["labels"]["severity"]: d for d in batch}
        assert set(by_severity) == {"warning", "critical"}
        assert by_severity["warning"]["endsAt"] == "2023-11-14T22:13:21.000Z"
        assert by_severity["critical"]["endsAt"] > by_severity["warning"]["endsAt"]
    finally:
        pusher.close()


def test_push_never_blocks_and_counts_failures_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A server that accepts connections and never answers.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    caplog.set_level(logging.INFO, logger="nodescope")
    pusher = AlertmanagerPusher(url, resend_seconds=0.01, timeout_seconds=0.2, retry_seconds=0.05)
    try:
        e = engine(for_seconds=0)
        worst = 0.0
        for i in range(20):
            step = firing(e, finding(), float(i))
            start = time.monotonic()
            pusher.submit(step.active, step.transitions, float(i), 1_700_000_000.0 + i)
            worst = max(worst, time.monotonic() - start)
            time.sleep(0.02)
        assert worst < 0.05
        deadline = time.monotonic() + 5
        while pusher.counts().errors < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        counts = pusher.counts()
        assert counts.errors >= 2 and counts.sent == 0
        assert counts.dropped >= 1  # newer batches replaced the ones still waiting
        assert caplog.text.count("push=alertmanager state=failing") == 1
    finally:
        pusher.close()
        silent.close()


def test_push_recovers_after_an_error_status(caplog: pytest.LogCaptureFixture) -> None:
    r = Receiver(status=500)
    caplog.set_level(logging.INFO, logger="nodescope")
    pusher = AlertmanagerPusher(r.url, resend_seconds=60, retry_seconds=0.05)
    try:
        e = engine(for_seconds=0)
        step = firing(e, finding(), 0.0)
        pusher.submit(step.active, step.transitions, 0.0, 1_700_000_000.0)
        r.wait(2)  # the batch is retried while it fails
        assert "HTTP 500" in caplog.text
        r.status = 200
        deadline = time.monotonic() + 5
        while pusher.counts().sent < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pusher.counts().sent == 1
        assert caplog.text.count("state=failing") == 1
        assert caplog.text.count("push=alertmanager state=ok") == 1
    finally:
        pusher.close()
        r.close()


def test_alertname_is_camel_case_of_the_kind() -> None:
    assert alertname("pcie_contention") == "NodescopePcieContention"
    assert alertname("ib_link_downed") == "NodescopeIbLinkDowned"


def test_analyzer_pushes_when_configured(receiver: Receiver) -> None:
    cfg = assembly.from_mapping({"alerts": {"alertmanager_url": receiver.url}}, "t.toml")

    def detect(prev: Snapshot | None, cur: Snapshot, c: config.Config) -> list[Finding]:
        return [finding(kind="xid")]

    analyzer = Analyzer.from_config(
        cfg, detectors=[DetectorInfo("x", detect)], make_pusher=alertmanager_pusher
    )
    analyzer.engine.set_rules(AlertRules(AlertRule(for_seconds=0)))
    try:
        analyzer.analyze(snap(1))
        receiver.wait(1)
        assert receiver.batches[0][1][0]["labels"]["alertname"] == "NodescopeXid"
        out = analyzer.analyze(snap(2))
        assert out.alert_counters is not None and out.alert_counters.push_errors == 0
        # A reload without a URL stops the push.
        analyzer.configure(assembly.default_config())
        assert analyzer.pusher is None
    finally:
        analyzer.close()


class RecordingPush:
    """An alert push that records what the analysis hands it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.batches: list[tuple[list[str], list[str], float]] = []
        self.closed = False

    def submit(
        self,
        active: Iterable[Alert],
        transitions: Iterable[Transition],
        now_monotonic: float,
        now_wall: float,
        actions: Mapping[str, str] | None = None,
    ) -> bool:
        self.batches.append(
            ([a.key for a in active], [t.kind.value for t in transitions], now_monotonic)
        )
        return True

    def counts(self) -> PushCounts:
        return PushCounts(sent=len(self.batches), errors=1, dropped=2)

    def close(self) -> None:
        self.closed = True


def test_the_analyzer_calls_the_push_its_factory_built() -> None:
    built: list[RecordingPush] = []

    def make_push(cfg: config.Config) -> RecordingPush | None:
        url = cfg.alerts.alertmanager_url
        if not url:
            return None
        built.append(RecordingPush(url))
        return built[-1]

    def detect(prev: Snapshot | None, cur: Snapshot, c: config.Config) -> list[Finding]:
        return [finding(kind="xid")]

    first = assembly.from_mapping({"alerts": {"alertmanager_url": "http://am:9093"}}, "t.toml")
    analyzer = Analyzer.from_config(
        first, detectors=[DetectorInfo("x", detect)], make_pusher=make_push
    )
    analyzer.engine.set_rules(AlertRules(AlertRule(for_seconds=0)))
    out = analyzer.analyze(snap(1))
    assert built[0].batches == [(["xid{link=0000:16:01.0}"], ["firing"], 1.0)]
    assert out.alert_counters is not None
    assert (out.alert_counters.push_sent, out.alert_counters.push_errors) == (1, 1)
    assert out.alert_counters.push_dropped == 2
    # Settings that do not touch the push keep it; a new URL closes it and builds another.
    analyzer.configure(replace(first, tick_seconds=2.0))
    assert len(built) == 1 and not built[0].closed
    second = assembly.from_mapping({"alerts": {"alertmanager_url": "http://am2:9093"}}, "t.toml")
    analyzer.configure(second)
    assert built[0].closed and [p.url for p in built] == ["http://am:9093", "http://am2:9093"]
    analyzer.close()
    assert built[1].closed and analyzer.pusher is None


def test_the_daemon_hands_its_analysis_the_configured_push(
    receiver: Receiver, tmp_path: Path
) -> None:
    cfg = assembly.from_mapping(
        {
            "daemon": {"listen": "[::1]:9839"},
            "alerts": {"alertmanager_url": receiver.url, "instance": "node-1"},
        },
        "t.toml",
    )
    service = Service(
        lambda: replace(cfg, roots=Roots.under(tmp_path)),
        notifier=Notifier(address=""),
        make_collector=lambda c: Collector.from_config(c, []),
    )
    try:
        pusher = service.analyzer.pusher
        assert isinstance(pusher, AlertmanagerPusher)
        assert (pusher.endpoint, pusher.instance) == (receiver.url + "/api/v2/alerts", "node-1")
        # Loopback is no address for whoever reads the alert: the host name instead.
        assert pusher.generator_url == f"http://{socket.gethostname()}:9839/api/v1/alerts"
        # A reload that drops the URL stops the push; one that sets it again starts one.
        service.analyzer.configure(assembly.default_config())
        assert service.analyzer.pusher is None
        service.analyzer.configure(cfg)
        assert isinstance(service.analyzer.pusher, AlertmanagerPusher)
    finally:
        service.shutdown()
    assert alertmanager_pusher(assembly.default_config()) is None


# -- /api/v1/alerts and `nodescope alerts` -----------------------------------------------------


@pytest.fixture
def daemon_http() -> Iterator[tuple[str, JsonCache]]:
    cache = JsonCache()
    server = MetricsHTTPServer(("127.0.0.1", 0), MetricsCache(), cache)
    server.start()
    try:
        yield f"http://{server.bound}", cache
    finally:
        server.stop()


def analysed_snapshot() -> Snapshot:
    e = engine(for_seconds=0)
    subjects = {"link": "L", "job": "81734"}
    e.step([finding(Severity.WARNING, subjects, value=0.84)], 0.0, 1_700_000_000.0)
    step = e.step([finding(Severity.CRITICAL, subjects, value=0.91)], 65.0, 1_700_000_065.0)
    return replace(
        Snapshot(cycle=7, monotonic=65.0, wall_time=1_700_000_065.0),
        alerts=step.active,
        findings=step.findings,
    )


def test_alerts_endpoint_serves_the_cycle_document(daemon_http: tuple[str, JsonCache]) -> None:
    url, cache = daemon_http
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{url}/api/v1/alerts", timeout=5)
    assert info.value.code == 503
    cache.update(alerts_document(analysed_snapshot()))
    with urllib.request.urlopen(f"{url}/api/v1/alerts", timeout=5) as response:
        assert response.headers["Content-Type"] == "application/json"
        document = json.loads(response.read())
    (alert_doc,) = document["alerts"]
    assert alert_doc["key"] == "pcie_contention{job=81734,link=L}"
    assert alert_doc["state"] == "firing" and alert_doc["severity"] == "critical"
    assert alert_doc["evidence_start"] == {"value": 0.84}
    assert alert_doc["evidence_last"] == {"value": 0.91}
    assert alert_doc["fingerprint"] == fingerprint(alert_doc["key"])
    assert document["findings"][0]["key"] == alert_doc["key"]


def test_nodescope_alerts_prints_alerts_with_evidence(
    daemon_http: tuple[str, JsonCache], capsys: pytest.CaptureFixture[str]
) -> None:
    url, cache = daemon_http
    cache.update(alerts_document(analysed_snapshot()))
    assert main(["alerts", "--url", url]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (
        "FIRING critical pcie_contention job=81734,link=L for 1m05s (since 2023-11-14 22:13:20 UTC)"
    )
    assert "    value = 0.91 (at start 0.84)" in out
    assert "key: pcie_contention{job=81734,link=L}" in out
    assert main(["alerts", "--url", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["alerts"][0]["severity"] == "critical"
    cache.update(alerts_document(Snapshot(cycle=1, monotonic=1.0, wall_time=1.0)))
    assert main(["alerts", "--url", url]) == 0
    assert capsys.readouterr().out == "no active alerts\n"


def test_nodescope_alerts_exit_status_when_the_daemon_is_away(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()  # nothing listens there
    cfg = tmp_path / "n.toml"
    cfg.write_text(f'[daemon]\nlisten = "127.0.0.1:{port}"\n')
    assert main(["alerts", "--config", str(cfg), "--timeout", "1"]) == 1
    assert f"127.0.0.1:{port}" in capsys.readouterr().err
    cfg.write_text("[daemon]\nlisten = 3\n")
    assert main(["alerts", "--config", str(cfg)]) == 2


def test_wildcard_listen_is_asked_on_loopback(tmp_path: Path) -> None:
    cfg = tmp_path / "n.toml"
    cfg.write_text('[daemon]\nlisten = "0.0.0.0:9100"\n')
    ns = argparse.Namespace(url=None, config=str(cfg))
    assert alerts_cli.base_url(ns) == "http://127.0.0.1:9100"
    cfg.write_text('[daemon]\nlisten = "[::]:9100"\n')
    assert alerts_cli.base_url(ns) == "http://[::1]:9100"
    assert alerts_cli.base_url(argparse.Namespace(url="http://h:1/", config=None)) == "http://h:1"


def test_format_alerts_shows_pending_since_start() -> None:
    e = engine(for_seconds=60)
    step = e.step([finding(Severity.WARNING, value=1.0)], 0.0, 1_700_000_000.0)
    s = replace(Snapshot(cycle=1, monotonic=5.0, wall_time=1_700_000_005.0), alerts=step.active)
    out = io.StringIO()
    alerts_cli.format_alerts(alerts_document(s), out)
    assert out.getvalue().startswith("PENDING warning pcie_contention link=0000:16:01.0 for 5s")
