"""The record of actions and its readers: a pass of :func:`remediate` against a stand-in
scontrol, the record's bounds and refusals, the daemon's source, counter, alerts document,
``nodescope alerts`` and the Alertmanager annotation."""

from __future__ import annotations

import io
import json
import os
import stat
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope import assembly
from nodescope import config as config_mod
from nodescope.analysis import action_texts, alerts_document
from nodescope.cli import alerts as alerts_cli
from nodescope.model.alert import Alert, AlertState
from nodescope.model.finding import Severity
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.remediation.act import problems_from_alerts, remediate
from nodescope.remediation.policy import Memory, Problem
from nodescope.remediation.slurm import Scontrol
from nodescope.remediation.state import (
    MAX_ENTRIES,
    Entry,
    Record,
    RecordBusy,
    locked,
    parse_record,
    read_record,
    state_path,
    write_record,
)
from nodescope.roots import Roots
from nodescope.sources.remediation import RemediationSource
from nodescope_exporters.push import AlertmanagerPusher
from nodescope_exporters.remediation_metrics import families
from tests.unit.json_strategy import json_values

NODE_LINE = (
    "NodeName={name} Arch=x86_64 State={state} Partitions=gpu{reason}\n"
    "NodeName=other State=IDLE Partitions=gpu\n"
)
PARTITION_LINE = "PartitionName=gpu Nodes=n1,other State=UP TotalNodes=2\n"


class FakeSlurm:
    """A stand-in scontrol: a shell script that prints the node and partition from files and
    appends every other call to a log, so a test sees each argument scontrol got."""

    def __init__(self, tmp: Path) -> None:
        self.dir = tmp / "slurm"
        self.dir.mkdir()
        self.calls = self.dir / "calls"
        self.set_node("IDLE", None)
        (self.dir / "partitions").write_text(PARTITION_LINE)
        script = self.dir / "scontrol"
        script.write_text(
            "#!/bin/sh\n"
            f'if [ "$1 $2" = "show node" ]; then cat {self.dir}/nodes; exit 0; fi\n'
            f'if [ "$1 $2" = "show partition" ]; then cat {self.dir}/partitions; exit 0; fi\n'
            f'for a in "$@"; do printf "[%s]" "$a"; done >> {self.calls}; echo >> {self.calls}\n'
        )
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
        self.scontrol = Scontrol(str(script), timeout=5)

    def set_node(self, state: str, reason: str | None) -> None:
        text = NODE_LINE.format(
            name="n1",
            state=state,
            reason=f" Reason={reason} [root@2026-12-03T18:52:12]" if reason else "",
        )
        (self.dir / "nodes").write_text(text)

    def log(self) -> list[str]:
        return self.calls.read_text().splitlines() if self.calls.exists() else []


def _config(tmp: Path, remediation: str = "cooldown_seconds = 0\n") -> config_mod.Config:
    path = tmp / "n.toml"
    path.write_text(f'[roots]\nrun = "{tmp / "run"}"\n[remediation]\n{remediation}')
    return assembly.load(path)


def _critical(gpu: str = "0") -> Problem:
    return Problem(
        "gpu_xid_memory", Severity.CRITICAL, f"gpu={gpu}", f"Xid 48 on GPU {gpu}",
        key=f"gpu_xid_memory{{gpu={gpu}}}",
    )  # fmt: skip


def test_a_pass_drains_records_once_then_resumes(tmp_path: Path) -> None:
    slurm = FakeSlurm(tmp_path)
    config = _config(tmp_path)
    first = remediate(config, [_critical()], "n1", scontrol=slurm.scontrol, now=100.0)
    reason = "nodescope: gpu_xid_memory gpu=0: Xid 48 on GPU 0"
    assert slurm.log() == ["[update][nodename=n1][state=drain][reason=" + reason + "]"]
    assert first.lines[0] == f'drained n1: reason "{reason}"'
    slurm.set_node("IDLE+DRAIN", reason)
    again = remediate(config, [_critical()], "n1", scontrol=slurm.scontrol, now=110.0)
    assert again.entries == () and len(slurm.log()) == 1
    done = remediate(config, [], "n1", scontrol=slurm.scontrol, now=120.0)
    assert slurm.log()[-1] == "[update][nodename=n1][state=resume]"
    assert done.lines[0].startswith("resumed n1")
    record = read_record(config.roots)
    assert [e.action for e in record.entries] == ["drain", "resume"]
    assert record.counts == {("drain", "gpu_xid_memory"): 1, ("resume", "gpu_xid_memory"): 1}
    assert record.memory("n1").drained_reason is None


def test_a_failed_drain_is_recorded_and_tried_again(tmp_path: Path) -> None:
    slurm = FakeSlurm(tmp_path)
    config = _config(tmp_path)
    broken = Scontrol(str(tmp_path / "absent"), timeout=1)
    # Slurm must be readable for anything to happen: an absent scontrol changes nothing.
    with pytest.raises(Exception, match="cannot run"):
        remediate(config, [_critical()], "n1", scontrol=broken, now=1.0)
    script = Path(slurm.scontrol.path)
    script.write_text(script.read_text().replace("for a in", "echo refused >&2; exit 1; for a in"))
    out = remediate(config, [_critical()], "n1", scontrol=slurm.scontrol, now=2.0)
    assert any("failed: scontrol update" in line and "refused" in line for line in out.lines)
    record = read_record(config.roots)
    assert [(e.action, e.ok) for e in record.entries] == [("drain", False)]
    assert record.memory("n1") == Memory()  # not drained: the next pass tries again


def test_dry_run_writes_nothing_and_calls_no_update(tmp_path: Path) -> None:
    slurm = FakeSlurm(tmp_path)
    config = _config(tmp_path, "dry_run = true\n")
    out = remediate(config, [_critical()], "n1", scontrol=slurm.scontrol, now=1.0)
    assert out.dry_run and out.lines[0].startswith('would drain n1: reason "nodescope:')
    assert slurm.log() == [] and not state_path(config.roots).exists()


def test_drain_requeue_requeues_the_job_the_alert_names(tmp_path: Path) -> None:
    slurm = FakeSlurm(tmp_path)
    config = _config(
        tmp_path,
        'cooldown_seconds = 0\n[remediation.rules.nvme_gone]\ncritical = "drain_requeue"\n',
    )
    alerts = [
        {"state": "firing", "kind": "nvme_gone", "severity": "critical", "key": "k",
         "subject": "job=42", "subjects": {"job": "42"}, "message": "drive gone"},
        {"state": "pending", "kind": "x", "severity": "critical"},
        {"state": "firing", "kind": "y", "severity": "catastrophic"},
        "junk",
    ]  # fmt: skip
    problems = problems_from_alerts(alerts)
    assert [p.kind for p in problems] == ["nvme_gone"] and problems[0].jobs == ("42",)
    remediate(config, problems, "n1", scontrol=slurm.scontrol, now=1.0)
    assert slurm.log()[-1] == "[requeue][42]"


@pytest.mark.alone  # a bound on wall-clock time
def test_the_lock_is_never_waited_on_past_its_timeout(tmp_path: Path) -> None:
    roots = Roots(run=tmp_path / "run")
    held = threading.Event()
    release = threading.Event()

    def holder() -> None:
        with locked(roots, 1.0):
            held.set()
            release.wait(5)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(5)
        started = time.monotonic()
        with pytest.raises(RecordBusy), locked(roots, 0.2):
            pass
        assert time.monotonic() - started < 2
    finally:
        release.set()
        thread.join()


def _entry(i: int) -> Entry:
    return Entry(time=float(i), node="n1", action="held", kind=f"k{i % 3}", key=f"k{i}")


def test_entries_are_bounded_and_counts_outlive_them(tmp_path: Path) -> None:
    roots = Roots(run=tmp_path / "run")
    record = Record()
    for i in range(MAX_ENTRIES + 50):
        record = record.with_actions("n1", Memory(), [_entry(i)])
    write_record(roots, record, 1.0)
    back = read_record(roots)
    assert back.problem is None and len(back.entries) == MAX_ENTRIES
    assert back.entries[-1].key == f"k{MAX_ENTRIES + 49}"
    assert sum(back.counts.values()) == MAX_ENTRIES + 50
    assert stat.S_IMODE(os.stat(state_path(roots)).st_mode) == 0o640


HEAD = b'{"format": "nodescope-remediation/1", "nodes": {}, '


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{",
        b"[]",
        b'{"format": "other"}',
        b"\xff\xfe",
        HEAD + b'"entries": [{"time": "x"}], "counts": []}',
        HEAD + b'"entries": [], "counts": [{"action": "a", "kind": "k", "count": -1}]}',
        HEAD + b'"entries": [], "counts": [{"action": "a", "kind": "k", "count": true}]}',
        b"[" * 100000,
    ],
)
def test_a_record_that_cannot_be_read_is_empty_and_says_why(tmp_path: Path, content: bytes) -> None:
    roots = Roots(run=tmp_path / "run")
    state_path(roots).parent.mkdir(parents=True)
    state_path(roots).write_bytes(content)
    record = read_record(roots)
    assert record.problem and record.entries == () and record.nodes == {}


def test_a_link_in_place_of_the_record_is_refused(tmp_path: Path) -> None:
    roots = Roots(run=tmp_path / "run")
    state_path(roots).parent.mkdir(parents=True)
    target = tmp_path / "elsewhere.json"
    write_record(Roots(run=tmp_path / "other"), Record(), 1.0)
    target.write_text((tmp_path / "other" / "nodescope" / "remediation.json").read_text())
    state_path(roots).symlink_to(target)
    assert "symbolic link" in str(read_record(roots).problem)


def _written(tmp_path: Path) -> Roots:
    roots = Roots(run=tmp_path / "run")
    reason = "nodescope: gpu_xid_memory gpu=0: Xid 48"
    drain = Entry(1_700_000_000.0, "n1", "drain", "gpu_xid_memory", "gpu=0", "Xid 48", reason,
                  key="gpu_xid_memory{gpu=0}")  # fmt: skip
    write_record(roots, Record().with_actions("n1", Memory(), [drain, _entry(7)]), 1.0)
    return roots


def test_the_daemon_reads_the_record_only_when_it_changed(tmp_path: Path) -> None:
    roots = _written(tmp_path)
    source = RemediationSource()
    first = source.collect(roots)
    assert [(c.action, c.kind, c.count) for c in first.counts] == [
        ("drain", "gpu_xid_memory", 1), ("held", "k1", 1)
    ]  # fmt: skip
    assert source.collect(roots) is first
    state_path(roots).unlink()
    assert source.collect(roots).counts == ()


def _snapshot(tmp_path: Path) -> Snapshot:
    data = RemediationSource().collect(_written(tmp_path))
    alert = Alert(
        key="gpu_xid_memory{gpu=0}", kind="gpu_xid_memory", severity=Severity.CRITICAL,
        state=AlertState.FIRING, subjects={"gpu": "0"}, message="Xid 48",
        started_wall=1_700_000_000.0, fired_wall=1_700_000_000.0,
    )  # fmt: skip
    snapshot = Snapshot(
        cycle=1, monotonic=1.0, wall_time=1_700_000_010.0,
        current={"remediation": SourceSample("remediation", 1.0, 0.0, data)},
    )  # fmt: skip
    return replace(snapshot, alerts=(alert,))


def test_counter_alerts_document_and_cli_name_the_action_with_its_finding(tmp_path: Path) -> None:
    snapshot = _snapshot(tmp_path)
    (actions, readable) = list(families(snapshot))
    assert actions.name.startswith("nodescope_remediation_actions")
    assert sorted(zip(actions.label_values, actions.values, strict=True)) == [
        (("drain", "gpu_xid_memory"), 1), (("held", "k1"), 1)
    ]  # fmt: skip
    assert readable.values == [1]
    document = json.loads(json.dumps(alerts_document(snapshot)))
    assert [a["action"] for a in document["actions"]] == ["drain", "held"]
    out = io.StringIO()
    alerts_cli.format_alerts(document, out)
    text = out.getvalue()
    assert (
        "  action: 2023-11-14 22:13:20 UTC drained n1 by health: nodescope: gpu_xid_memory" in text
    )
    assert "recent actions:" in text and "drain held back on n1 by health [finding: k1]" in text


def test_alertmanager_gets_the_action_as_an_annotation(tmp_path: Path) -> None:
    snapshot = _snapshot(tmp_path)
    sent: list[bytes] = []
    pusher = AlertmanagerPusher(
        "http://am:9093", instance="n1", post=lambda u, b, t: sent.append(b)
    )
    try:
        assert pusher.submit(snapshot.alerts, (), 1.0, 1_700_000_010.0)
        deadline = time.monotonic() + 5
        while not sent and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pusher.submit(
            snapshot.alerts, (), 2.0, 1_700_000_011.0, actions=action_texts(snapshot)
        )  # a new action is a change: sent at once
        deadline = time.monotonic() + 5
        while len(sent) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        pusher.close()
    last = json.loads(sent[-1])
    assert last[0]["annotations"]["nodescope_action"].startswith("drained n1 by health: nodescope:")
    assert "nodescope_action" not in json.loads(sent[0])[0]["annotations"]


_JSON = json_values(20)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["format", "nodes", "entries", "counts", "written_at"]), _JSON, max_size=5
    ),
    st.booleans(),
)
def test_any_json_is_a_record_or_a_value_error(document: dict[str, object], real: bool) -> None:
    if real:
        document["format"] = "nodescope-remediation/1"
    try:
        record = parse_record(json.dumps(document))
    except ValueError:
        return
    for entry in record.entries:
        assert isinstance(entry.time, float) and isinstance(entry.action, str)
    assert all(isinstance(n, int) and n >= 0 for n in record.counts.values())


def test_lines_scontrol_prints_that_are_not_understood_are_said(tmp_path: Path) -> None:
    slurm = FakeSlurm(tmp_path)
    nodes = slurm.dir / "nodes"
    nodes.write_text(nodes.read_text() + "garbage line\n")
    out = remediate(_config(tmp_path), [], "n1", scontrol=slurm.scontrol, now=1.0)
    assert "1 line(s) of scontrol's output not understood: skipped" in out.lines


def test_two_passes_at_once_drain_once(tmp_path: Path) -> None:
    """slurmd may start a health check while the last one still runs: the second pass waits
    for the first and sees its drain."""
    slurm = FakeSlurm(tmp_path)
    script = Path(slurm.scontrol.path)
    nodes = slurm.dir / "nodes"
    # This scontrol takes its time to drain, then shows the node drained with the reason.
    script.write_text(
        script.read_text()
        + 'case "$4" in reason=*) sleep 0.5; r=${4#reason=}; printf "NodeName=n1 State=IDLE+DRAIN'
        + f' Partitions=gpu Reason=%s [root@2026-12-03T18:52:12]\\n" "$r" > {nodes};; esac\n'
    )
    config = _config(tmp_path)
    outcomes: list[object] = []

    def one() -> None:
        outcomes.append(remediate(config, [_critical()], "n1", scontrol=slurm.scontrol, now=5.0))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(outcomes) == 2
    reason = "nodescope: gpu_xid_memory gpu=0: Xid 48 on GPU 0"
    drains = [line for line in slurm.log() if "state=drain" in line]
    assert drains == [f"[update][nodename=n1][state=drain][reason={reason}]"]
    assert [e.action for e in read_record(config.roots).entries] == ["drain"]
