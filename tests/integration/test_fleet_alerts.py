"""The job rules (exporters/prometheus/jobs.yml) on the real parts, across a fleet of nodes.

``nodescope demo --nodes 4 job-straggler`` runs four simulated DGX H100 nodes, each a daemon
process of its own, all running Slurm job 90210 on their 8 GPUs (the timeline is the bundled
fleet's, in seconds from the nodes' start):

* 20-90: node02 straggles (GPU activity 0.4 of its peers'), node03's InfiniBand receives
  0.58 of what it sends, node04's baseboard asserts hardware slowdown (the daemon's critical
  ``gpu_hw_slowdown`` once held 30 s);
* 130-200: the job stalls on every node, no InfiniBand, NVLink or PCIe traffic.

Debian's ``prometheus`` finds the nodes through the file_sd document the demo writes (each
target's ``instance`` is the node's name), scrapes and evaluates every second the shipped
records.yml, alerts.yml and jobs.yml (a copy differing in ``for`` durations only, which the
test checks), and Debian's ``prometheus-alertmanager`` routes to a webhook. The test sees
each job alert fire naming the right job and node (and no other node), resolve when its phase
is over, and reach the webhook firing and resolved.

The records' windows set the length: a straggler's 1 m average crosses 70 % of the median
about 30 s into its phase, and a stall is seen once a whole 1 m rate window is quiet (60 s
into it). The stall alert resolves on the first scrape after t=200: about 4 minutes in all.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.integration.alerting_harness import (
    Alerting,
    Webhook,
    binary,
    prometheus_alerts,
    query,
    shipped_rules,
    start_demo,
    stopping,
    wait_until,
)

pytestmark = pytest.mark.integration

JOB = "90210"
STRAGGLER = "NodescopeJobStragglerNode"
ASYMMETRY = "NodescopeJobInfinibandAsymmetry"
FAULTY = "NodescopeJobNodeFaulty"
STALLED = "NodescopeJobStalled"
JOB_ALERTS = (STRAGGLER, ASYMMETRY, FAULTY, STALLED)
#: The node each per-node alert must name, and only that node.
NODE_OF = {STRAGGLER: "node02", ASYMMETRY: "node03", FAULTY: "node04"}

#: The daemons' settings (every node's, through --config): the hardware slowdown's alert
#: resolves 5 s after its finding instead of 60 s, so that the faulty-node alert ends within
#: the healthy gap before the stall.
NODE_CONFIG = """\
[alerts.rules.gpu_hw_slowdown]
resolve_after_seconds = 5.0
"""

#: Seconds from the fleet's start by which everything must have been seen: the stall ends at
#: t=200; the rest is start-up (four DGX-class nodes built on a shared machine) and slack.
DEADLINE = 300.0


@dataclass
class Seen:
    """What Prometheus showed of one alert over the test: the label sets it was pending or
    firing with, when it first fired, and when it was last active."""

    labels: list[dict[str, str]] = field(default_factory=list)
    first_firing: float | None = None
    last_active: float | None = None

    def instances(self) -> set[str]:
        return {labels.get("instance", "") for labels in self.labels}


@pytest.fixture
def fleet_stack(tmp_path: Path) -> Iterator[dict[str, Any]]:
    binary("prometheus")
    binary("prometheus-alertmanager")
    with Webhook() as webhook, stopping() as started:
        targets = tmp_path / "targets.json"
        fleet = start_demo(
            tmp_path,
            ["--nodes", "4", "job-straggler", "--targets", str(targets)],
            "127.0.0.1:0",
            NODE_CONFIG,
            DEADLINE + 60,
            started,
            log="fleet.log",
        )
        fleet_started = time.monotonic()

        def wait_targets() -> None:
            # Prometheus reads the file when it starts: the nodes must be serving first.
            deadline = time.monotonic() + 120
            while not targets.exists():
                if fleet.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"no targets file\n{fleet.log()}")
                time.sleep(0.2)

        wait_targets()

        # Every label in the group key: each node's alert is a notification of its own.
        alerting = Alerting.to_webhook(
            tmp_path,
            started,
            webhook,
            ["..."],
            {
                "alerts.yml": shipped_rules("alerts.yml", {}),
                "records.yml": shipped_rules("records.yml", {}),
                # Only the for durations, so that each alert fires within its phase of the
                # fleet.
                "jobs.yml": shipped_rules(
                    "jobs.yml", {STRAGGLER: "5s", ASYMMETRY: "5s", STALLED: "2s"}
                ),
            },
            {"file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}]},
        )

        def logs() -> str:
            return f"{alerting.logs()}\n--- fleet\n{fleet.log()}"

        yield {
            "fleet": fleet,
            "started": fleet_started,
            "targets": targets,
            "alerting": alerting,
            "prometheus": alerting.prometheus,
            "webhook": webhook,
            "logs": logs,
        }


def _notified(webhook: Webhook, status: str, alertname: str) -> list[dict[str, str]]:
    """The label sets of every notified alert of ``alertname`` with ``status``."""
    found = []
    for note in list(webhook.notifications):
        for alert in note.get("alerts", []):
            labels = alert.get("labels", {})
            if alert.get("status") == status and labels.get("alertname") == alertname:
                found.append(labels)
    return found


def test_job_alerts_name_the_job_and_node_and_resolve_with_their_phase(
    fleet_stack: dict[str, Any],
) -> None:
    prom, webhook, logs = fleet_stack["prometheus"], fleet_stack["webhook"], fleet_stack["logs"]
    alerting: Alerting = fleet_stack["alerting"]
    started: float = fleet_stack["started"]
    alerting.wait_ready(30, logs)

    # Every node scraped as its own instance, though all four are 127.0.0.1.
    targets = json.loads(fleet_stack["targets"].read_text())
    assert [t["labels"]["instance"] for t in targets] == ["node01", "node02", "node03", "node04"]

    def scraped() -> bool:
        result = query(prom, "nodescope_job_info")
        return {(r["metric"]["instance"], r["metric"]["job_id"]) for r in result} == {
            (f"node0{i}", JOB) for i in range(1, 5)
        }

    wait_until(scraped, 60, "job 90210 on every node in Prometheus", logs)

    # The loaded rules are the shipped ones, for durations aside.
    loaded = alerting.alerting_rules()
    assert set(JOB_ALERTS) <= set(loaded)
    assert (loaded[STRAGGLER]["duration"], loaded[FAULTY]["duration"]) == (5, 0)

    seen = {name: Seen() for name in JOB_ALERTS}
    stall_done = False
    while time.monotonic() - started < DEADLINE and not stall_done:
        now = time.monotonic() - started
        for alert in prometheus_alerts(prom):
            name = alert["labels"].get("alertname")
            if name not in seen:
                continue
            record = seen[name]
            if alert["labels"] not in record.labels:
                record.labels.append(alert["labels"])
            record.last_active = now
            if alert["state"] == "firing" and record.first_firing is None:
                record.first_firing = now
        stalled = seen[STALLED]
        stall_done = (
            stalled.first_firing is not None
            and stalled.last_active is not None
            and now - stalled.last_active > 3
            and bool(_notified(webhook, "resolved", STALLED))
        )
        time.sleep(0.5)
    assert stall_done, f"the stall alert did not fire and resolve: {seen}\n{logs()}"
    elapsed = time.monotonic() - started

    for name, node in NODE_OF.items():
        record = seen[name]
        assert record.first_firing is not None, f"{name} never fired: {seen}\n{logs()}"
        # The node with the fault, and no other: the healthy nodes are the median.
        assert record.instances() == {node}, (name, record.labels)
        assert {labels["job_id"] for labels in record.labels} == {JOB}
        assert {labels["scope"] for labels in record.labels} == {"job"}
        # Fired within its phase (20-90 s, plus the nodes' start), over before the stall's.
        assert 20 < record.first_firing < 130, (name, record.first_firing)
        assert record.last_active is not None and 90 < record.last_active < 190, (
            name,
            record.last_active,
        )
    # The faulty-node alert carries the daemon's critical count, the others their ratio.
    assert seen[FAULTY].labels[0]["severity"] == "critical"
    assert seen[STRAGGLER].labels[0]["severity"] == "warning"

    # The stall: one alert for the job as a whole, no instance named, after t=130 + 1 m.
    stalled = seen[STALLED]
    assert {labels["job_id"] for labels in stalled.labels} == {JOB}
    assert stalled.instances() == {""}
    assert stalled.first_firing is not None and stalled.first_firing > 190
    assert stalled.last_active is not None and stalled.last_active > 200

    # Alertmanager told the webhook of each, firing and then resolved, with the same labels.
    def notified_all() -> bool:
        return all(
            _notified(webhook, status, name)
            for name in JOB_ALERTS
            for status in ("firing", "resolved")
        )

    wait_until(notified_all, 30, "firing and resolved notifications of every job alert", logs)
    for name, node in NODE_OF.items():
        for status in ("firing", "resolved"):
            assert {labels["instance"] for labels in _notified(webhook, status, name)} == {node}
    for status in ("firing", "resolved"):
        assert {labels["job_id"] for labels in _notified(webhook, status, STALLED)} == {JOB}
    print(f"fleet alert test: stall resolved {elapsed:.0f} s after the fleet started")
