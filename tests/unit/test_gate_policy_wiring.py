"""How the prolog gate and the daemon's drain during a job take the remediation policy: which
firing alerts fail the gate, when the daemon starts a pass (and never in the cycle itself), what
it hands the pass, what it tries again, and how the job's report notes what was done."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from nodescope import assembly
from nodescope.assembly import default_config
from nodescope.config import Config
from nodescope.hooks.auth import Peer
from nodescope.hooks.health import Check, alert_check, gate_causes
from nodescope.hooks.jobdrain import RETRY_SECONDS, JobDrain, due, settled
from nodescope.hooks.reports import build_report
from nodescope.hooks.request import JobRequest
from nodescope.hooks.stops import problem_json, problems_of, record_gate_drain
from nodescope.hooks.tracker import JobTracker, actions_during, write_registration
from nodescope.model.alert import Alert, AlertState
from nodescope.model.finding import Severity
from nodescope.model.job_records import JobsData, Registration
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.remediation.act import Outcome
from nodescope.remediation.policy import (
    Decision,
    Memory,
    NodeView,
    Policy,
    Problem,
    Step,
    StepKind,
    decide,
)
from nodescope.remediation.state import Entry, Record, locked, read_record, write_record
from nodescope_exporters.reports import render_text

ROOT = Peer(pid=1, uid=0, gid=0)
AER = Alert(
    "pcie_aer_errors{device=0000:1b:00.0}",
    "pcie_aer_errors",
    Severity.CRITICAL,
    AlertState.FIRING,
    {"device": "0000:1b:00.0"},
    "1 fatal AER error(s) on 0000:1b:00.0",
)
SLOW = Alert(
    "pcie_link_downtrained{device=0000:1b:00.0}",
    "pcie_link_downtrained",
    Severity.WARNING,
    AlertState.FIRING,
    {"device": "0000:1b:00.0"},
    "x8 of x16",
)


def _config(tmp: Path, remediation: str = "") -> Config:
    path = tmp / "n.toml"
    run = tmp / "run"
    run.mkdir(mode=0o755, exist_ok=True)
    path.write_text(
        f'[roots]\nrun = "{run}"\ndev = "{tmp / "dev"}"\nsysfs = "{tmp / "sys"}"\n'
        f'[slurm]\nreports_dir = "{tmp / "reports"}"\n[remediation]\n{remediation}'
    )
    return assembly.load(path)


def _problem(kind: str, severity: Severity, key: str = "") -> Problem:
    return Problem(kind, severity, "gpu=0", "broken", key=key or f"{kind}{{gpu=0}}")


# ---------------------------------------------------------------------------------------------
# The gate


def test_an_alert_fails_the_gate_only_when_its_action_drains() -> None:
    policy = Policy.from_settings(
        assembly.from_mapping(
            {
                "remediation": {
                    "rules": {
                        "pcie_aer_errors": {"critical": "alert"},
                        "gpu_xid_memory": {"critical": "drain_requeue"},
                        "ib_port_flapping": {"warning": "none"},
                    }
                }
            }
        ).remediation
    )
    alert_only = _problem("pcie_aer_errors", Severity.CRITICAL)
    requeue = _problem("gpu_xid_memory", Severity.CRITICAL)
    ignored = _problem("ib_port_flapping", Severity.WARNING)
    default_drain = _problem("pcie_link_down", Severity.CRITICAL)
    default_alert = _problem("pcie_link_downtrained", Severity.WARNING)
    passing = alert_check(policy, [alert_only, ignored, default_alert])
    assert passing == Check("alerts", True, "no firing alert the policy drains for (3 firing)")
    assert alert_check(policy, []).ok
    failing = alert_check(policy, [alert_only, requeue, default_drain])
    assert not failing.ok
    assert failing.detail == "firing gpu_xid_memory gpu=0: broken; pcie_link_down gpu=0: broken"


def test_the_gate_names_three_alerts_and_counts_the_rest_in_one_safe_line() -> None:
    policy = Policy.from_settings(default_config().remediation)
    problems = [
        Problem(f"kind{i}", Severity.CRITICAL, "job=1", 'pid 7 ("evil\nname") gone', key=str(i))
        for i in range(5)
    ]
    check = alert_check(policy, problems)
    assert not check.ok and check.detail.endswith(" (+2 more)")
    assert check.detail.count("kind") == 3
    assert "\n" not in check.detail and '"' not in check.detail


def _snapshot(
    alerts: Sequence[Alert], registered: Iterable[str] = (), t: float = 1_764_790_000.0
) -> Snapshot:
    registrations = tuple(Registration(j, 0, "root", "test", (0,), t - 10) for j in registered)
    jobs = SourceSample("jobs", t, 0.0, JobsData("v1", (), registrations, ()))
    return Snapshot(cycle=1, monotonic=t, wall_time=t, current={"jobs": jobs}, alerts=tuple(alerts))


def test_the_daemons_gate_takes_its_firing_alerts_and_registers_only_a_fit_job(
    tmp_path: Path,
) -> None:
    rules = '[remediation.rules.pcie_aer_errors]\ncritical = "alert"\n'
    config = _config(tmp_path)
    tracker = JobTracker(lambda: config)
    request = {**JobRequest("5", 0, "root", "test", (), node="n1").as_request()}
    registration = config.roots.run / "nodescope" / "jobs" / "5.json"

    tracker.observe(_snapshot([AER, SLOW]))
    answer = tracker.prolog(request, ROOT)
    assert answer["ok"] and not answer["fit"]
    assert answer["reason"].startswith("nodescope: firing pcie_aer_errors device=0000:1b:00.0:")
    assert {c["name"]: c["ok"] for c in answer["checks"]}["alerts"] is False
    assert not registration.exists()

    # The same alert under a policy that only alerts on it: the job is fit and registered.
    config = _config(tmp_path, rules)
    answer = tracker.prolog(request, ROOT)
    assert answer["fit"] and registration.exists()
    assert '"node": "n1"' in registration.read_text()

    # A pending alert is not a firing one.
    config = _config(tmp_path)
    pending = Alert(AER.key, AER.kind, AER.severity, AlertState.PENDING, AER.subjects, "")
    tracker.observe(_snapshot([pending]))
    assert tracker.prolog(request, ROOT)["fit"]


def test_a_node_name_from_a_hook_is_bounded() -> None:
    env = {"SLURM_JOB_ID": "5", "SLURMD_NODENAME": "gpu-001"}
    assert JobRequest.from_environ(env).node == "gpu-001"
    for hostile in ("", "a b", "n1;reboot", "x" * 200, "[n1]"):
        assert JobRequest.from_environ({**env, "SLURMD_NODENAME": hostile}).node is None
        with pytest.raises(ValueError, match="node"):
            JobRequest.from_request({"job_id": "5", "node": hostile or 7})


# ---------------------------------------------------------------------------------------------
# The daemon during a job


class FakeAct:
    """A remediation pass that records what it was given and answers ``outcome``."""

    def __init__(self, outcome: Outcome | Exception | None = None) -> None:
        self.calls: list[tuple[list[Problem], str, bool, str]] = []
        self.outcome = outcome
        self.release = threading.Event()
        self.release.set()

    def __call__(
        self, config: Config, problems: Iterable[Problem], node: str, *, complete: bool,
        source: str,
    ) -> Outcome:  # fmt: skip
        given = list(problems)
        self.calls.append((given, node, complete, source))
        self.release.wait(10)
        if isinstance(self.outcome, Exception):
            raise self.outcome
        if self.outcome is not None:
            return self.outcome
        steps = tuple(
            Step(StepKind.DRAIN, p.kind, p.subject, p.message, p.identity, reason="r")
            for p in given
            if p.source == "alert"
        )
        return Outcome(node, Decision(steps, Memory()), (), ("drained n1",), False)


class Clock:
    def __init__(self) -> None:
        self.now = 1_764_790_000.0

    def __call__(self) -> float:
        return self.now


def _drain(
    tmp_path: Path, act: FakeAct, remediation: str = "", checks: Sequence[Check] = ()
) -> tuple[JobDrain, Config, Clock]:
    config = _config(tmp_path, remediation)
    clock = Clock()
    for job in ("5", "6"):
        write_registration(config.roots, JobRequest(job, node="n1"), {}, clock.now)
    return JobDrain(lambda: config, act=act, checks=lambda c: checks, clock=clock), config, clock


def _run(drain: JobDrain, snapshot: Snapshot) -> threading.Thread | None:
    worker = drain.observe(snapshot)
    if worker is not None:
        worker.join(10)
    return worker


def test_a_drain_alert_during_a_registered_job_starts_one_pass(tmp_path: Path) -> None:
    act = FakeAct()
    gate = [Check("gpus", False, "expected 8 GPUs, found 7")]
    drain, _, _ = _drain(tmp_path, act, checks=gate)
    # No job on the node: the gate keeps the next one off, the daemon does nothing.
    assert _run(drain, _snapshot([AER])) is None
    # A warning (alert only by default) during a job: nothing either.
    assert _run(drain, _snapshot([SLOW], ["5"])) is None
    assert act.calls == []
    assert _run(drain, _snapshot([AER, SLOW], ["5"])) is not None
    [(problems, node, complete, source)] = act.calls
    assert node == "n1" and source == "daemon" and complete is False  # never resumes
    # Every firing alert and the gate's failed checks: what a health run would decide on.
    assert [p.kind for p in problems] == ["pcie_aer_errors", "pcie_link_downtrained", "gate_gpus"]
    # Settled: the alert firing on and on is not passed again.
    for _ in range(3):
        assert _run(drain, _snapshot([AER], ["5"])) is None
    assert len(act.calls) == 1
    # It stops firing, then fires again: a new problem, a new pass (the policy's cool-down
    # decides what that pass does).
    assert _run(drain, _snapshot([], ["5"])) is None
    assert _run(drain, _snapshot([AER], ["5"])) is not None
    assert len(act.calls) == 2


@pytest.mark.alone  # a bound on wall-clock time
def test_a_pass_never_runs_in_the_cycle_and_at_most_one_is_in_flight(tmp_path: Path) -> None:
    act = FakeAct()
    act.release.clear()  # scontrol hangs
    drain, _, _ = _drain(tmp_path, act)
    started = time.monotonic()
    worker = drain.observe(_snapshot([AER], ["5"]))
    assert worker is not None and time.monotonic() - started < 1.0
    other = Alert("gpu_xid_memory{gpu=0}", "gpu_xid_memory", Severity.CRITICAL,
                  AlertState.FIRING, {"gpu": "0"}, "Xid 48")  # fmt: skip
    for _ in range(3):
        assert drain.observe(_snapshot([AER, other], ["5"])) is None
    assert drain.passes == 1
    act.release.set()
    worker.join(10)
    assert drain.wait(1.0)
    # The alert that came while the pass ran gets its own pass now.
    assert _run(drain, _snapshot([AER, other], ["5"])) is not None
    assert drain.passes == 2


def test_a_failed_or_held_pass_is_tried_again_after_a_while(tmp_path: Path) -> None:
    act = FakeAct(RuntimeError("scontrol show node did not answer in 10 s"))
    drain, _, clock = _drain(tmp_path, act)
    assert _run(drain, _snapshot([AER], ["5"])) is not None
    assert drain.failures == 1
    assert _run(drain, _snapshot([AER], ["5"])) is None
    clock.now += RETRY_SECONDS
    held = Step(StepKind.HELD, AER.kind, "", "", AER.key, why="cool-down")
    act.outcome = Outcome("n1", Decision((held,), Memory()), (), ("held",), False)
    assert _run(drain, _snapshot([AER], ["5"])) is not None
    assert _run(drain, _snapshot([AER], ["5"])) is None
    clock.now += RETRY_SECONDS
    act.outcome = None
    assert _run(drain, _snapshot([AER], ["5"])) is not None
    clock.now += RETRY_SECONDS
    assert _run(drain, _snapshot([AER], ["5"])) is None
    assert len(act.calls) == 3


def test_no_node_name_no_scontrol_or_an_alert_only_policy_starts_nothing(tmp_path: Path) -> None:
    act = FakeAct()
    drain, config, _ = _drain(tmp_path, act)
    assert _run(drain, _snapshot([AER], ["7"])) is None  # 7 has no registration: no node name
    drain, config, _ = _drain(
        tmp_path, act, '[remediation.rules.pcie_aer_errors]\ncritical = "alert"\n'
    )
    assert _run(drain, _snapshot([AER], ["5"])) is None
    drain = JobDrain(
        lambda: assembly.from_mapping(
            {"roots": {"run": str(config.roots.run)}, "slurm": {"scontrol": ""}}
        ),
        act=act,
    )
    assert _run(drain, _snapshot([AER], ["5"])) is None
    assert act.calls == []


def test_due_and_settled() -> None:
    policy = Policy.from_settings(default_config().remediation)
    pending = Alert(AER.key, AER.kind, AER.severity, AlertState.PENDING, AER.subjects, "")
    assert due(policy, [AER, SLOW, pending], set(), {}, 10.0) == [AER]
    assert due(policy, [AER], {AER.key}, {}, 10.0) == []
    assert due(policy, [AER], set(), {AER.key: 11.0}, 10.0) == []
    assert due(policy, [AER], set(), {AER.key: 10.0}, 10.0) == [AER]
    drained = Step(StepKind.DRAIN, AER.kind, "", "", "short", reason="r")
    held = Step(StepKind.HELD, AER.kind, "", "", "short", why="guard")
    ok = Entry(1.0, "n1", "drain", AER.kind)
    bad = Entry(1.0, "n1", "drain", AER.kind, ok=False, error="refused")

    def outcome(steps: tuple[Step, ...], entries: tuple[Entry, ...], dry: bool = False) -> Outcome:
        return Outcome("n1", Decision(steps, Memory()), entries, (), dry)

    # Alert keys in, each with its problem's identity (which a long key is cut to).
    passed = {"k": "k", AER.key: "short"}
    assert settled(outcome((drained,), (ok,)), passed) == ({"k", AER.key}, set())
    assert settled(outcome((drained,), (bad,)), passed) == (set(), {"k", AER.key})
    assert settled(outcome((held,), ()), passed) == ({"k"}, {AER.key})
    assert settled(outcome((held,), (), dry=True), passed) == ({"k", AER.key}, set())


def test_an_alert_with_a_key_longer_than_a_problem_keeps_is_passed_once(tmp_path: Path) -> None:
    act = FakeAct()
    drain, _, _ = _drain(tmp_path, act)
    subjects = {"device": "0000:1b:00.0", "note": "x" * 600}
    key = "pcie_aer_errors{" + ",".join(f"{k}={v}" for k, v in subjects.items()) + "}"
    long = Alert(key, AER.kind, AER.severity, AlertState.FIRING, subjects, "fatal")
    assert _run(drain, _snapshot([long], ["5"])) is not None
    for _ in range(3):
        assert _run(drain, _snapshot([long], ["5"])) is None
    assert len(act.calls) == 1


# ---------------------------------------------------------------------------------------------
# The report


def test_the_report_notes_what_was_done_to_the_node_during_the_job(tmp_path: Path) -> None:
    config = _config(tmp_path)
    entries = [
        Entry(60.0, "n1", "drain", "gpu_xid_memory", reason="before the job", source="health"),
        Entry(90.0, "n1", "held", "pcie_aer_errors", why="partition guard", source="prolog"),
        Entry(110.0, "n1", "alert", "pcie_link_downtrained", message="x8 of x16"),
        Entry(
            120.0,
            "n1",
            "drain",
            "pcie_aer_errors",
            "device=0000:1b:00.0",
            "1 fatal AER error",
            reason="nodescope: pcie_aer_errors device=0000:1b:00.0: 1 fatal",
            source="daemon",
        ),
        Entry(125.0, "n2", "drain", "gpu_xid_memory", reason="another node"),
        Entry(130.0, "n1", "held", "gpu_xid_memory", why="cool-down", source="daemon"),
        Entry(135.0, "n1", "drain", "ib_port_down", ok=False, error="scontrol: exit 1"),
        Entry(170.0, "n1", "resume", "pcie_aer_errors", reason="after the job"),
    ]
    with locked(config.roots, 1.0):
        write_record(config.roots, Record().with_actions("n1", Memory(), entries), 1.0)
    actions = actions_during(config.roots, "n1", 100.0, 160.0)
    assert [(a["time"], a["action"]) for a in actions] == [
        (90.0, "held"),  # at the job's prolog, just before its registration
        (120.0, "drain"),
        (130.0, "held"),
        (135.0, "drain"),
    ]
    assert len(actions_during(config.roots, None, 100.0, 160.0)) == 5
    (tmp_path / "empty").mkdir()
    assert actions_during(_config(tmp_path / "empty").roots, "n1", 0.0, 1e12) == []
    report = build_report(JobRequest("5", node="n1"), {"registered_at": 100.0}, {}, 160.0,
                          daemon=True, actions=actions)  # fmt: skip
    assert report["verdict"] == {"ok": True, "reason": None}  # the job went on
    text = render_text(report)
    assert "nodescope acted on the node during the job (the job went on):" in text
    assert "drain (daemon): pcie_aer_errors device=0000:1b:00.0: 1 fatal AER error" in text, text
    assert "reason: nodescope: pcie_aer_errors device=0000:1b:00.0: 1 fatal" in text
    assert "held: cool-down" in text and "failed: scontrol: exit 1" in text
    # A report from elsewhere with junk in its actions still renders.
    render_text({**report, "actions": [1, None, {"time": "x"}, {}]})


# ---------------------------------------------------------------------------------------------
# The gate's drain, recorded as nodescope's


def test_in_a_dry_run_the_gate_says_what_it_would_fail_on_and_passes() -> None:
    policy = Policy.from_settings(
        assembly.from_mapping({"remediation": {"dry_run": True}}).remediation
    )
    check = alert_check(policy, [_problem("pcie_link_down", Severity.CRITICAL)])
    assert (
        check.ok
        and check.detail == "dry run: the gate would fail: firing pcie_link_down gpu=0: broken"
    )


def test_a_gate_drain_is_recorded_only_for_what_health_can_see_clear() -> None:
    alert = _problem("pcie_aer_errors", Severity.CRITICAL)
    gpus = Check("gpus", False, "expected 8 GPUs, found 7")
    xid = Check("xid", False, "uncleared Xid 79")
    passed = Check("modules", True, "loaded")
    failed_alerts = Check("alerts", False, "firing ...")
    causes = gate_causes([gpus, xid, passed, failed_alerts], [alert])
    assert causes is not None
    assert [p.identity for p in causes] == ["gate_gpus{}", "gate_xid{}", alert.identity]
    # A link check (NVML's, which health does not read) or the probe: a person resumes.
    assert gate_causes([gpus, Check("links", False, "x8 of x16")], []) is None


def test_problems_travel_from_the_daemon_to_the_hook_bounded() -> None:
    problems = [
        _problem("pcie_aer_errors", Severity.CRITICAL),
        _problem("gate_gpus", Severity.CRITICAL),
    ]
    assert problems_of([problem_json(p) for p in problems]) == problems
    good = problem_json(problems[0])
    for junk in (None, [], "x", [1], [{**good, "severity": "fatal"}], [{**good, "kind": 3}],
                 [good] * 100):  # fmt: skip
        assert problems_of(junk) is None
    [long] = problems_of([{**good, "message": "m\n" * 5000}]) or []
    assert len(long.message) <= 400 and "\n" not in long.message


def test_a_recorded_gate_drain_is_owned_and_resumed_once_its_causes_clear(tmp_path: Path) -> None:
    config = _config(tmp_path, "cooldown_seconds = 0\n")
    alert = _problem("pcie_aer_errors", Severity.CRITICAL)
    reason = "nodescope: firing pcie_aer_errors gpu=0: broken"
    with locked(config.roots, 1.0):
        write_record(config.roots, Record(), 1.0)  # an earlier record is kept, not replaced
    record_gate_drain(config.roots, "n1", reason, [alert], 100.0, 1.0)
    record = read_record(config.roots)
    assert [(e.action, e.kind, e.source, e.reason) for e in record.entries] == [
        ("drain", "pcie_aer_errors", "prolog", reason)
    ]
    assert record.counts == {("drain", "pcie_aer_errors"): 1}
    policy = Policy.from_settings(config.remediation)
    node = NodeView("n1", True, reason)
    # While the alert fires nothing changes; once it has cleared the node is resumed.
    assert decide(policy, [alert], node, record.memory("n1"), 110.0).steps == ()
    resumed = decide(policy, [], node, record.memory("n1"), 120.0)
    assert resumed.resume is not None
    # A person who changed the reason meanwhile owns the node: nothing is resumed.
    other = NodeView("n1", True, "maintenance")
    assert decide(policy, [], other, record.memory("n1"), 120.0).resume is None


def test_the_daemons_prolog_answer_carries_what_the_drain_is_for(tmp_path: Path) -> None:
    config = _config(tmp_path, "")
    tracker = JobTracker(lambda: config)
    tracker.observe(_snapshot([AER]))
    answer = tracker.prolog(JobRequest("5", node="n1").as_request(), ROOT)
    assert not answer["fit"]
    assert [c["kind"] for c in answer["causes"]] == ["pcie_aer_errors"]
    assert answer["causes"][0]["key"] == AER.key
    tracker.observe(_snapshot([]))
    assert tracker.prolog(JobRequest("6", node="n1").as_request(), ROOT)["causes"] is None


def test_alerts_the_policy_held_back_keep_no_job_off_the_node(tmp_path: Path) -> None:
    config = _config(tmp_path)
    tracker = JobTracker(lambda: config)
    tracker.observe(_snapshot([AER]))
    request = JobRequest("5", node="n1").as_request()
    assert not tracker.prolog(request, ROOT)["fit"]
    held = tracker.prolog({**request, "hold_alerts": True}, ROOT)
    assert held["fit"] and held["causes"] is None
    [alerts] = [c for c in held["checks"] if c["name"] == "alerts"]
    assert alerts["ok"] and alerts["detail"].startswith("held back by the policy: firing")
    # Only the alerts are held: a failed check of the gate's own still fails it.
    config = replace(config, slurm=replace(config.slurm, expected_gpus=8))
    assert not tracker.prolog({**request, "hold_alerts": True}, ROOT)["fit"]
