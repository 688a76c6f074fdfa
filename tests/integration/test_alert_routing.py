"""One GPU falls off the bus, and one page goes out: the shipped routing on the real parts.

``nodescope demo xid79-fell-off-bus`` runs the simulated DGX H100 node in real time: at t=20
GPU 5 falls off the bus (Xid 79, NVML loses it, its PCI function and its 18 NVLinks' counters
go away) and the job that used it hangs in a collective on its other GPUs. Both alert paths
reach one Alertmanager:

* the daemon pushes its own alerts (``[alerts] alertmanager_url``, ``instance = "localhost"``);
* Debian's ``prometheus`` scrapes ``localhost:PORT`` with the shipped scrape.yml relabel (so
  its instance is ``localhost`` too) and evaluates the shipped alerts.yml and records.yml.

Debian's ``prometheus-alertmanager`` runs the shipped exporters/alertmanager/alertmanager.yml
with only the receivers' URLs (to this test's webhooks) and the group timings shortened. Of the
storm (the fell-off-bus alert from both paths, the NVLink module's device-gone alert from both,
the Xid alert, the collective hang from both) the pager hears exactly one alert, the daemon's
``gpu_fell_off_bus`` naming GPU 5, and Alertmanager shows every other one inhibited.
"""

from __future__ import annotations

import copy
import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO
from tests.integration.alerting_harness import (
    RULES,
    Alerting,
    Webhook,
    get_json,
    query,
    shipped_rules,
    start_demo,
    stopping,
    wait_until,
)
from tests.integration.daemon_harness import free_port

pytestmark = pytest.mark.integration

SHIPPED_AM = REPO / "exporters" / "alertmanager" / "alertmanager.yml"
SHIPPED_SCRAPE = REPO / "exporters" / "prometheus" / "scrape.yml"

#: The daemon's settings: push to the test's Alertmanager as the scrape's relabelled instance.
#: The collective hang's 30 s ``for`` is shortened so that it fires within the test.
DEMO_CONFIG = """\
[alerts]
alertmanager_url = "http://127.0.0.1:{am_port}"
instance = "localhost"

[alerts.rules.collective_hang]
for_seconds = 5.0
"""

#: Group timings short enough for a test: the first notification 3 s after a group's first
#: alert (time for the inhibiting alerts of the same event to arrive), later ones 1 s apart.
GROUP_WAIT = "3s"
GROUP_INTERVAL = "1s"


def alertmanager_config(pager: Webhook, tickets: Webhook) -> str:
    """The shipped alertmanager.yml with the receivers' URLs and the group timings replaced;
    checked to be the shipped file otherwise (routes, matchers and inhibit rules)."""
    shipped: dict[str, Any] = yaml.safe_load(SHIPPED_AM.read_text())
    config = copy.deepcopy(shipped)
    hooks = {"pager": pager, "tickets": tickets}
    for receiver in config["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = f"http://127.0.0.1:{hooks[receiver['name']].port}/hook"
    config["route"]["group_wait"] = GROUP_WAIT
    config["route"]["group_interval"] = GROUP_INTERVAL
    # Nothing else differs from the shipped file.
    stripped = []
    for document in (copy.deepcopy(config), shipped):
        for receiver in document["receivers"]:
            for hook in receiver.get("webhook_configs", []):
                hook.pop("url")
        for key in ("group_wait", "group_interval"):
            document["route"].pop(key)
        stripped.append(document)
    assert stripped[0] == stripped[1]
    return yaml.safe_dump(config)


def prometheus_config(target_port: int, am_port: int) -> str:
    """The shipped scrape.yml with this test's target, Alertmanager and 1 s intervals; its
    relabel rule as shipped."""
    config: dict[str, Any] = yaml.safe_load(SHIPPED_SCRAPE.read_text())
    (scrape,) = config["scrape_configs"]
    relabel = scrape["relabel_configs"]
    scrape["static_configs"] = [{"targets": [f"localhost:{target_port}"]}]
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["alerting"]["alertmanagers"] = [
        {"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}
    ]
    # The node's rules; the job rules (jobs.yml) are about jobs across nodes, not this event.
    assert {"alerts.yml", "records.yml"} <= set(config["rule_files"])
    config["rule_files"] = ["alerts.yml", "records.yml"]
    assert yaml.safe_load(SHIPPED_SCRAPE.read_text())["scrape_configs"][0]["relabel_configs"] == (
        relabel
    )
    return yaml.safe_dump(config)


@pytest.fixture
def storm(tmp_path: Path) -> Iterator[dict[str, Any]]:
    with Webhook() as pager, Webhook() as tickets, stopping() as started:
        alerting = Alerting(tmp_path, started)
        am_port, demo_port = alerting.alertmanager_port, free_port()
        alerting.start_alertmanager(alertmanager_config(pager, tickets))
        # The shipped rules as they are: the daemon's alerts are forwarded with for: 0s, and
        # the Xid rule fires at once.
        alerting.start_prometheus(
            prometheus_config(demo_port, am_port),
            {
                "alerts.yml": shipped_rules("alerts.yml", {}),
                "records.yml": shipped_rules("records.yml", {}),
            },
        )

        def logs() -> str:
            text = alerting.logs()
            if len(started) > 2:
                text += f"\n--- nodescope demo\n{started[2].log()}"
            return text

        # Alertmanager must be listening before the daemon's first push (the push retries,
        # but every second lost delays the test).
        alerting.wait_ready(20, logs)

        demo = start_demo(
            tmp_path,
            ["xid79-fell-off-bus"],
            f"127.0.0.1:{demo_port}",
            DEMO_CONFIG.format(am_port=am_port),
            150,
            started,
        )
        yield {
            "alertmanager": alerting.alertmanager,
            "prometheus": alerting.prometheus,
            "pager": pager,
            "tickets": tickets,
            "demo": demo,
            "logs": logs,
        }


def am_alerts(base: str) -> list[dict[str, Any]]:
    """Every alert Alertmanager holds, inhibited or not."""
    alerts: list[dict[str, Any]] = get_json(f"{base}/api/v2/alerts?inhibited=true&silenced=true")
    return alerts


def find(alerts: list[dict[str, Any]], **labels: str) -> list[dict[str, Any]]:
    return [a for a in alerts if all(a["labels"].get(k) == v for k, v in labels.items())]


def shipped_rule_labels(alert: str) -> dict[str, str]:
    """The ``labels`` of one alerting rule of the shipped alerts.yml."""
    groups = yaml.safe_load((RULES / "alerts.yml").read_text())["groups"]
    (rule,) = [r for g in groups for r in g["rules"] if r.get("alert") == alert]
    labels: dict[str, str] = rule["labels"]
    return labels


def post_alert(base: str, labels: dict[str, str]) -> None:
    """One firing alert through Alertmanager's API, as Prometheus posts it."""
    body = json.dumps([{"labels": labels, "annotations": {"summary": "posted by the test"}}])
    request = urllib.request.Request(
        f"{base}/api/v2/alerts",
        data=body.encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.status == 200


def notified(hook: Webhook) -> list[dict[str, str]]:
    """The label sets of every firing alert a receiver was notified of, each once."""
    seen: dict[tuple[tuple[str, str], ...], dict[str, str]] = {}
    for note in list(hook.notifications):
        for alert in note.get("alerts", []):
            if alert.get("status") == "firing":
                labels = alert["labels"]
                seen[tuple(sorted(labels.items()))] = labels
    return list(seen.values())


def test_a_gpu_falling_off_the_bus_pages_once_and_inhibits_the_rest(
    storm: dict[str, Any],
) -> None:
    started = time.monotonic()
    am, pager, tickets = storm["alertmanager"], storm["pager"], storm["tickets"]
    logs: Callable[[], str] = storm["logs"]

    # The daemon's fell-off-bus alert pages (the Xid 79 comes at t=20 of the scenario).
    wait_until(lambda: bool(notified(pager)), 60, "the page", logs)

    # Every copy and consequence reaches Alertmanager, and all but the page are inhibited:
    # both paths' device-gone and collective-hang alerts, the rules path's fell-off-bus
    # copy, the rules path's Xid alert. The collective hang fires last (t=41 plus its for).
    expected: dict[str, dict[str, str]] = {
        "rules path gpu_fell_off_bus": {
            "alertname": "NodescopeFinding", "kind": "gpu_fell_off_bus", "origin": "prometheus",
        },
        "daemon device gone": {
            "alertname": "NodescopeNvlinkCounterDeviceGone", "origin": "daemon",
        },
        "rules path device gone": {
            "alertname": "NodescopeFinding", "kind": "nvlink_counter_device_gone",
            "origin": "prometheus",
        },
        "daemon collective hang": {"alertname": "NodescopeCollectiveHang", "origin": "daemon"},
        "rules path collective hang": {
            "alertname": "NodescopeFinding", "kind": "collective_hang", "origin": "prometheus",
        },
    }  # fmt: skip

    def all_inhibited() -> bool:
        alerts = am_alerts(am)
        return all(
            len(found := find(alerts, **labels)) == 1 and found[0]["status"]["inhibitedBy"]
            for labels in expected.values()
        )

    def report() -> str:
        lines = [
            f"{a['labels']} state={a['status']['state']} by={a['status']['inhibitedBy']}"
            for a in am_alerts(am)
        ]
        return "\n".join(lines) + "\n" + logs()

    wait_until(all_inhibited, 60, "every other alert present and inhibited", report)

    # The rules path's Xid alert: its rule fires on a GPU's first Xid only when the daemon was
    # scraped ten minutes before (a new series has no increase()), longer than this test. It
    # is posted here as Prometheus would send it: the scraped Xid series' labels and the
    # shipped rule's.
    (series,) = query(storm["prometheus"], 'nodescope_gpu_xid_errors_total{xid="79"}')
    xid_labels = {k: v for k, v in series["metric"].items() if k != "__name__"}
    xid_labels |= {"alertname": "NodescopeGpuXid", **shipped_rule_labels("NodescopeGpuXid")}
    assert xid_labels["gpu"] == "5" and xid_labels["instance"] == "localhost", xid_labels
    post_alert(am, xid_labels)
    expected["rules path Xid 79"] = {"alertname": "NodescopeGpuXid", "xid": "79"}
    wait_until(all_inhibited, 10, "the Xid alert inhibited", report)
    alerts = am_alerts(am)
    (page,) = find(alerts, alertname="NodescopeGpuFellOffBus")
    # Both paths carry localhost: the daemon's [alerts] instance, the scrape's relabel.
    assert {a["labels"]["instance"] for a in alerts} == {"localhost"}, report()
    assert page["status"]["state"] == "active" and page["status"]["inhibitedBy"] == []
    # The fall off the bus (either path's copy: Alertmanager names the first source it finds)
    # is what mutes the consequences on its GPU and on the node.
    fell = {a["fingerprint"] for a in find(alerts, kind="gpu_fell_off_bus")}
    assert len(fell) == 2
    for name in ("daemon device gone", "daemon collective hang", "rules path Xid 79"):
        (muted,) = find(alerts, **expected[name])
        assert set(muted["status"]["inhibitedBy"]) <= fell, (name, report())
    # The daemon's copy mutes the rules path's copy of the same finding.
    (daemon_gone,) = find(alerts, **expected["daemon device gone"])
    (rules_gone,) = find(alerts, **expected["rules path device gone"])
    assert daemon_gone["fingerprint"] in rules_gone["status"]["inhibitedBy"], report()

    # One more group interval and the group wait of the last group: still the one page, and
    # nothing reached the tickets queue (every warning of the storm was inhibited too).
    time.sleep(5)
    (paged,) = notified(pager)
    assert paged["alertname"] == "NodescopeGpuFellOffBus"
    assert (paged["origin"], paged["scope"], paged["severity"]) == ("daemon", "node", "critical")
    assert (paged["gpu"], paged["subject"]) == ("5", "bdf=0000:bb:00.0,gpu=5")
    assert paged["instance"] == "localhost"
    assert notified(tickets) == [], notified(tickets)
    # Everything Alertmanager holds other than the page is inhibited by something.
    loose = [
        a["labels"]
        for a in am_alerts(am)
        if a["fingerprint"] != page["fingerprint"] and not a["status"]["inhibitedBy"]
    ]
    assert loose == [], report()
    assert storm["demo"].proc.poll() is None, logs()
    assert time.monotonic() - started < 90
