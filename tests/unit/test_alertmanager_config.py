"""The shipped Alertmanager and Prometheus configurations: Debian's ``amtool`` and ``promtool``
accept them, the routes send each kind of alert where exporters/alertmanager/alertmanager.yml
says, and every shipped rule carries the labels its routes and inhibit rules match on.

What the inhibit rules do to a real storm of alerts is tests/integration/test_alert_routing.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO

ALERTMANAGER = REPO / "exporters" / "alertmanager" / "alertmanager.yml"
PROMETHEUS = REPO / "exporters" / "prometheus"


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed (scripts/test.sh installs it from Debian)")
    return path


def amtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("amtool"), *args], capture_output=True, text=True, timeout=30, check=False
    )


def test_amtool_accepts_the_shipped_config() -> None:
    done = amtool("check-config", str(ALERTMANAGER))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout
    assert "3 inhibit rules" in done.stdout


def test_amtool_rejects_a_route_to_a_receiver_that_does_not_exist(tmp_path: Path) -> None:
    # The check above can fail: the same file with the pager route's receiver misspelt.
    text = ALERTMANAGER.read_text()
    broken = text.replace("    - receiver: pager\n", "    - receiver: pagr\n")
    assert broken != text
    (tmp_path / "alertmanager.yml").write_text(broken)
    done = amtool("check-config", str(tmp_path / "alertmanager.yml"))
    assert done.returncode != 0
    assert "pagr" in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("labels", "receiver"),
    [
        # A node's critical alert, from either path: the pager.
        (
            {"alertname": "NodescopeGpuFellOffBus", "scope": "node", "severity": "critical"},
            "pager",
        ),
        (
            {"alertname": "NodescopeFinding", "origin": "prometheus", "scope": "node",
             "severity": "critical"},
            "pager",
        ),
        # A job-wide alert, even critical: a ticket.
        ({"alertname": "NodescopeJobStalled", "scope": "job", "severity": "critical"}, "tickets"),
        ({"alertname": "NodescopeJobSlow", "scope": "job", "severity": "warning"}, "tickets"),
        # A warning: a ticket.
        ({"alertname": "NodescopeSourceDown", "scope": "node", "severity": "warning"}, "tickets"),
        # Info: received by nothing.
        ({"alertname": "NodescopeGpuXidApplication", "scope": "node", "severity": "info"}, "none"),
        # Labels no route expects (a rule file of someone else's): a ticket, never dropped.
        ({"alertname": "SomethingElse", "severity": "critical"}, "tickets"),
        ({"alertname": "SomethingElse"}, "tickets"),
    ],
)  # fmt: skip
def test_routes_send_each_alert_to_its_receiver(labels: dict[str, str], receiver: str) -> None:
    pairs = [f"{name}={value}" for name, value in labels.items()]
    done = amtool(
        "config", "routes", "test", f"--config.file={ALERTMANAGER}",
        f"--verify.receivers={receiver}", *pairs,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == [receiver]


def test_a_wrong_receiver_fails_the_route_test() -> None:
    done = amtool(
        "config", "routes", "test", f"--config.file={ALERTMANAGER}", "--verify.receivers=pager",
        "scope=node", "severity=warning",
    )  # fmt: skip
    assert done.returncode != 0


def shipped() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(ALERTMANAGER.read_text())
    return document


def test_the_inhibit_rules_are_the_documented_three() -> None:
    # docs/alerts.md states these rules; the integration test shows what they do.
    rules = [
        (r["source_matchers"], r["target_matchers"], r["equal"]) for r in shipped()["inhibit_rules"]
    ]
    assert rules == [
        (['origin="daemon"'], ['origin="prometheus"'], ["instance", "kind", "subject"]),
        (['kind="gpu_fell_off_bus"'], ['kind!="gpu_fell_off_bus"'], ["instance", "gpu"]),
        (
            ['kind="gpu_fell_off_bus"'],
            ['kind=~"nvlink_counter_device_gone|collective_hang"'],
            ["instance"],
        ),
    ]
    route = shipped()["route"]
    assert route["group_by"] == ["alertname", "instance"]


def test_receivers_are_placeholders_that_reach_nobody() -> None:
    for receiver in shipped()["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            assert ".invalid" in hook["url"], hook  # RFC 2606: never resolves


# -- Prometheus ------------------------------------------------------------------------------


def promtool_check(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("promtool"), "check", "config", "scrape.yml"],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_promtool_accepts_the_scrape_config_with_the_rules_beside_it(tmp_path: Path) -> None:
    # As the packages install them: scrape.yml and the rule files in one folder.
    for name in ("scrape.yml", "alerts.yml", "records.yml", "jobs.yml"):
        shutil.copyfile(PROMETHEUS / name, tmp_path / name)
    done = promtool_check(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 3 rule files found" in done.stdout + done.stderr
    # Without the rule files it names reads as broken: the check above is not vacuous.
    (tmp_path / "alerts.yml").unlink()
    assert promtool_check(tmp_path).returncode != 0


def relabel(address: str) -> str | None:
    """The instance the shipped relabel rule makes of a target address (Prometheus anchors
    the regex at both ends, as fullmatch does), or ``None`` when it leaves it alone."""
    (rule,) = yaml.safe_load((PROMETHEUS / "scrape.yml").read_text())["scrape_configs"][0][
        "relabel_configs"
    ]
    assert (rule["source_labels"], rule["target_label"]) == (["__address__"], "instance")
    match = re.fullmatch(rule["regex"], address)
    if match is None:
        return None
    return str(rule["replacement"]).replace("$1", match.group(1))


@pytest.mark.parametrize(
    ("address", "instance"),
    [
        ("node01:9400", "node01"),
        ("node01.example.com:9400", "node01.example.com"),
        ("10.1.2.3:9400", "10.1.2.3"),
        ("[fd00::7]:9400", "fd00::7"),
        ("localhost:40123", "localhost"),
        ("node01", None),  # no port: Prometheus adds it before relabelling; left alone here
    ],
)
def test_the_relabel_drops_the_port_from_instance(address: str, instance: str | None) -> None:
    assert relabel(address) == instance


def rules(path: Path) -> list[dict[str, Any]]:
    groups = yaml.safe_load(path.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_every_shipped_alert_rule_says_origin_prometheus_and_scope_node() -> None:
    alerts = [r for r in rules(PROMETHEUS / "alerts.yml") if "alert" in r]
    assert len(alerts) >= 20
    unlabelled = [
        r["alert"]
        for r in alerts
        if (r.get("labels") or {}).get("origin") != "prometheus"
        or r["labels"].get("scope") != "node"
    ]
    assert unlabelled == []
