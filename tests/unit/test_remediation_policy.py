"""The remediation policy as a pure function: actions per severity and kind, the drain reason,
who owns a drain, the cool-down and the partition guard."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope import assembly
from nodescope.model.finding import Severity
from nodescope.remediation.policy import (
    MAX_REASON,
    Action,
    Memory,
    NodeView,
    PartitionLoad,
    Policy,
    Problem,
    StepKind,
    decide,
    drain_reason,
    sanitize,
)

NOW = 1_000_000.0


def policy(**remediation: object) -> Policy:
    cfg = assembly.from_mapping({"remediation": remediation})
    return Policy.from_settings(cfg.remediation)


def xid(
    severity: Severity = Severity.CRITICAL, gpu: str = "0", kind: str = "gpu_xid_memory"
) -> Problem:
    return Problem(kind, severity, f"gpu={gpu}", f"Xid 48 on GPU {gpu}", key=f"{kind}{{gpu={gpu}}}")


def free(partitions: tuple[PartitionLoad, ...] = ()) -> NodeView:
    return NodeView("n1", drained=False, reason=None, partitions=partitions)


def test_defaults_by_severity_and_overrides_by_kind() -> None:
    p = policy(rules={"ib_port_flapping": {"warning": "drain"}})
    assert p.action("anything", Severity.CRITICAL) is Action.DRAIN
    assert p.action("anything", Severity.WARNING) is Action.ALERT
    assert p.action("anything", Severity.INFO) is Action.NONE
    assert p.action("ib_port_flapping", Severity.WARNING) is Action.DRAIN
    assert p.action("ib_port_flapping", Severity.CRITICAL) is Action.DRAIN
    # An application's own Xid never drains, unless the file says so.
    assert p.action("gpu_xid_application", Severity.CRITICAL) is Action.ALERT
    again = policy(rules={"gpu_xid_application": {"critical": "drain_requeue"}})
    assert again.action("gpu_xid_application", Severity.CRITICAL) is Action.DRAIN_REQUEUE
    assert again.action("gpu_xid_application", Severity.WARNING) is Action.ALERT


def test_a_critical_finding_drains_with_a_reason_that_names_it() -> None:
    decision = decide(policy(), [xid()], free(), Memory(), NOW)
    step = decision.drain
    assert step is not None and step.action is StepKind.DRAIN
    assert step.reason == "nodescope: gpu_xid_memory gpu=0: Xid 48 on GPU 0"
    assert decision.memory.drained_reason == step.reason
    assert decision.memory.causes == ("gpu_xid_memory{gpu=0}",)
    assert decision.memory.last_change == NOW


def test_warning_is_an_alert_and_info_nothing() -> None:
    decision = decide(
        policy(), [xid(Severity.WARNING), xid(Severity.INFO, "1")], free(), Memory(), NOW
    )
    assert [s.action for s in decision.steps] == [StepKind.ALERT]
    assert decision.drain is None and decision.memory.drained_reason is None


def test_several_causes_are_one_drain_and_all_must_clear_before_resume() -> None:
    p = policy(cooldown_seconds=0)
    first = decide(p, [xid(gpu="0"), xid(gpu="1")], free(), Memory(), NOW)
    assert first.drain is not None and first.drain.reason.endswith("(+1 more)")
    drained = NodeView("n1", drained=True, reason=first.memory.drained_reason)
    half = decide(p, [xid(gpu="1", severity=Severity.WARNING)], drained, first.memory, NOW + 1)
    # Still present (now a warning): the node stays drained.
    assert half.resume is None and half.memory.drained_reason == first.memory.drained_reason
    cleared = decide(p, [], drained, half.memory, NOW + 2)
    assert cleared.resume is not None
    assert cleared.memory.drained_reason is None and cleared.memory.causes == ()


def test_a_drain_set_by_a_person_is_never_touched() -> None:
    person = NodeView("n1", drained=True, reason="maintenance by bob")
    for problems in ([xid()], []):
        decision = decide(policy(), problems, person, Memory(), NOW)
        assert decision.drain is None and decision.resume is None
    # Even when nodescope had drained it before and a person then set a reason of their own.
    mine = Memory("nodescope: gpu_xid_memory gpu=0: Xid 48 on GPU 0", ("gpu_xid_memory{gpu=0}",), 0)
    decision = decide(policy(cooldown_seconds=0), [], person, mine, NOW)
    assert decision.resume is None and decision.memory.drained_reason is None


def test_a_nodescope_looking_drain_not_in_the_record_is_not_resumed() -> None:
    unknown = NodeView("n1", drained=True, reason="nodescope: gpu_xid_memory gpu=0: Xid 48")
    decision = decide(policy(cooldown_seconds=0), [], unknown, Memory(), NOW)
    assert decision.resume is None and decision.steps == ()


def test_cooldown_holds_a_resume_and_a_new_drain() -> None:
    p = policy(cooldown_seconds=300)
    first = decide(p, [xid()], free(), Memory(), NOW)
    drained = NodeView("n1", drained=True, reason=first.memory.drained_reason)
    early = decide(p, [], drained, first.memory, NOW + 60)
    assert early.resume is None and [s.action for s in early.steps] == [StepKind.HELD]
    assert "cool-down" in early.steps[0].why
    later = decide(p, [], drained, early.memory, NOW + 301)
    assert later.resume is not None
    flip = decide(p, [xid()], free(), later.memory, NOW + 320)
    assert flip.drain is None and flip.steps[0].action is StepKind.HELD


def test_partition_guard_holds_a_drain_and_says_why() -> None:
    p = policy(max_drained_share=0.5)
    full = free((PartitionLoad("gpu", 2, 1),))
    decision = decide(p, [xid()], full, Memory(), NOW)
    assert decision.drain is None
    assert [s.action for s in decision.steps] == [StepKind.HELD]
    assert "partition gpu: 1 of 2 nodes" in decision.steps[0].why
    assert decision.memory.drained_reason is None
    # The first drain of a partition always goes ahead, whatever its size.
    assert decide(p, [xid()], free((PartitionLoad("one", 1, 0),)), Memory(), NOW).drain
    assert decide(p, [xid()], free((PartitionLoad("big", 10, 4),)), Memory(), NOW).drain


def test_a_step_taken_last_run_is_a_repeat() -> None:
    p = policy(max_drained_share=0.5)
    full = free((PartitionLoad("gpu", 2, 1),))
    first = decide(p, [xid(), xid(Severity.WARNING, "1")], full, Memory(), NOW)
    assert not any(s.repeat for s in first.steps)
    second = decide(p, [xid(), xid(Severity.WARNING, "1")], full, first.memory, NOW + 10)
    assert all(s.repeat for s in second.steps) and len(second.steps) == 2


def test_drain_requeue_names_the_jobs_of_the_finding() -> None:
    p = policy(rules={"nvme_removed": {"critical": "drain_requeue"}})
    problem = Problem("nvme_removed", Severity.CRITICAL, "job=42", "drive gone", jobs=("42",))
    step = decide(p, [problem], free(), Memory(), NOW).drain
    assert step is not None and step.action is StepKind.DRAIN_REQUEUE and step.jobs == ("42",)


def test_the_reason_is_safe_for_scontrol_whatever_the_message() -> None:
    evil = Problem("k", Severity.CRITICAL, "proc=x", "comm \"a\nb';$(reboot)`\x00é" + "z" * 500)
    reason = drain_reason(evil)
    assert reason.startswith("nodescope: k proc=x: comm ?a b?(reboot)?")
    assert len(reason) <= MAX_REASON and reason.isprintable() and reason.isascii()
    assert "\n" not in reason and '"' not in reason and "'" not in reason


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=600), st.text(max_size=50), st.integers(0, 50))
def test_any_message_makes_a_bounded_safe_reason(message: str, subject: str, more: int) -> None:
    reason = drain_reason(Problem("kind", Severity.CRITICAL, subject, message), more)
    assert reason.startswith("nodescope: kind")
    assert len(reason) <= MAX_REASON
    assert sanitize(reason) == reason
    assert not more or reason.endswith(f"(+{more} more)")
