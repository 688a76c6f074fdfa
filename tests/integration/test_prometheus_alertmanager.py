"""The shipped alert rules on the real parts: Debian's ``prometheus`` scrapes nodescope and
evaluates exporters/prometheus/alerts.yml, Debian's ``prometheus-alertmanager`` routes to a
webhook receiver in this test.

* A real ``nodescope run`` whose source loses its input (the test owns the ``--procfs`` root):
  ``NodescopeSourceDown`` fires and resolves when the input comes back.
* ``nodescope demo root-port-contention``, the simulated node in real time: GPU 0's
  host-to-device copies and nvme0n1's reads fill root port 0000:15:01.0 from t=10 to t=50, so
  the daemon's alert engine fires its ``pcie_contention`` alert and resolves it afterwards, and
  ``NodescopePcieContention`` follows it through Prometheus and Alertmanager.

Each is seen through Prometheus's HTTP API and as webhook notifications. The rule files are the
shipped ones; a test's copy may shorten ``for`` durations and nothing else, which the test
checks. Every process is started by the test (through alerting_harness.py), on 127.0.0.1 with
its own data directories, and stopped by its PID even when the test fails.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodescope.sources.registry import SOURCE_TABLE
from tests.conftest import nodescope_command
from tests.integration.alerting_harness import (
    RULES,
    Alerting,
    Process,
    Webhook,
    binary,
    prometheus_alerts,
    query,
    shipped_rules,
    start_demo,
    stopping,
    wait_until,
)
from tests.integration.daemon_harness import READY_S, Daemon, free_port

pytestmark = pytest.mark.integration

ALERT = "NodescopeSourceDown"
CONTENTION = "NodescopePcieContention"
#: The root port of root-port-contention that GPU 0 and nvme0n1 share.
ROOT_PORT = "0000:15:01.0"


def shipped_expr(alert: str) -> str:
    """The one-line ``expr`` of an alert in the shipped alerts.yml."""
    rules = (RULES / "alerts.yml").read_text()
    start = rules.index(f"- alert: {alert}\n")
    match = re.compile(r"\n\s+expr: (.+)").search(rules, start)
    assert match is not None and match.group(1).strip() not in ("|", ">", "|-", ">-")
    return match.group(1).strip()


def same_expr(a: str, b: str) -> bool:
    """PromQL equal up to whitespace (Prometheus re-prints the expressions it loaded)."""
    return re.sub(r"\s+", "", a) == re.sub(r"\s+", "", b)


def drain(daemon: Daemon) -> None:
    """Read the daemon's sd_notify datagrams, as systemd does, until the socket closes."""
    daemon.notify.settimeout(0.2)
    while True:
        try:
            daemon.notify.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            return


def start_alerting(
    workdir: Path, target_port: int, alert_rules: str, webhook: Webhook, started: list[Process]
) -> Alerting:
    """Alertmanager routing to the webhook, and Prometheus scraping one nodescope target every
    second with the given alert rules and the shipped recording rules."""
    return Alerting.to_webhook(
        workdir,
        started,
        webhook,
        ["alertname", "source", "subject"],
        {"alerts.yml": alert_rules, "records.yml": shipped_rules("records.yml", {})},
        {"static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}]},
    )


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[dict[str, Any]]:
    binary("prometheus")
    binary("prometheus-alertmanager")
    # Undone last first: Prometheus and Alertmanager, then the daemon, then the webhook.
    with contextlib.ExitStack() as cleanup:
        webhook = cleanup.enter_context(Webhook())
        # nodescope: only the disks source, its /proc root under the test's control.
        procfs = tmp_path / "proc"
        procfs.mkdir()
        for name in ("diskstats", "uptime"):
            shutil.copyfile(f"/proc/{name}", procfs / name)
        config = ["[daemon]", "tick_seconds = 0.25", "log_level = 'info'"]
        for info in SOURCE_TABLE:
            config.append(f"[sources.{info.name}]")
            config.append(
                "enabled = true\ninterval_seconds = 0.25"
                if info.name == "disks"
                else "enabled = false"
            )
        (tmp_path / "nodescope.toml").write_text("\n".join(config) + "\n")
        daemon_dir = tmp_path / "daemon"
        daemon_dir.mkdir()
        daemon = Daemon(
            daemon_dir,
            ["--config", str(tmp_path / "nodescope.toml"), "--procfs", str(procfs)],
        )
        cleanup.callback(daemon.stop)
        daemon.wait_message("READY=1", timeout=READY_S)
        # The loop sends WATCHDOG=1 datagrams; a socket nobody reads would fill up.
        threading.Thread(target=drain, args=(daemon,), daemon=True).start()

        # The shipped rules, the source-down rule's for shortened.
        started = cleanup.enter_context(stopping())
        alerting = start_alerting(
            tmp_path, daemon.port, shipped_rules("alerts.yml", {ALERT: "1s"}), webhook, started
        )

        def logs() -> str:
            return f"{alerting.logs()}\n--- nodescope\n{daemon.stderr()}"

        yield {
            "procfs": procfs,
            "daemon": daemon,
            "alerting": alerting,
            "prometheus": alerting.prometheus,
            "alertmanager": alerting.alertmanager,
            "webhook": webhook,
            "logs": logs,
        }


def source_down(base: str, state: str) -> bool:
    return any(
        a["labels"].get("alertname") == ALERT
        and a["labels"].get("source") == "disks"
        and a["state"] == state
        for a in prometheus_alerts(base)
    )


def test_source_down_fires_and_resolves_through_prometheus_and_alertmanager(
    stack: dict[str, Any],
) -> None:
    started = time.monotonic()
    prom, logs, webhook = stack["prometheus"], stack["logs"], stack["webhook"]
    procfs: Path = stack["procfs"]
    stack["alerting"].wait_ready(15, logs)

    # The shipped rule file loaded, and the expression is the shipped one.
    rules = stack["alerting"].alerting_rules()
    assert rules[ALERT]["query"] == "nodescope_source_up == 0"
    assert same_expr(rules[ALERT]["query"], shipped_expr(ALERT))
    assert rules[ALERT]["duration"] == 1

    def scraped() -> bool:
        result = query(prom, 'nodescope_source_up{source="disks"}')
        return bool(result) and result[0]["value"][1] == "1"

    wait_until(scraped, 20, "the first scrape of nodescope", logs)
    assert not source_down(prom, "firing") and not source_down(prom, "pending")

    # The disks source loses its input: the alert fires.
    (procfs / "diskstats").unlink()
    wait_until(lambda: source_down(prom, "firing"), 15, f"{ALERT} firing", logs)
    firing = next(a for a in prometheus_alerts(prom) if a["labels"].get("alertname") == ALERT)
    assert firing["labels"]["severity"] == "warning"
    assert firing["labels"]["job"] == "nodescope"
    assert firing["annotations"]["summary"] == (
        f"nodescope source disks failing on {firing['labels']['instance']}"
    )
    wait_until(
        lambda: webhook.received("firing", ALERT, source="disks", job="nodescope"),
        15,
        "the firing notification",
        logs,
    )

    # The input comes back: the alert resolves.
    shutil.copyfile("/proc/diskstats", procfs / "diskstats")
    wait_until(
        lambda: not source_down(prom, "firing") and not source_down(prom, "pending"),
        15,
        f"{ALERT} resolved",
        logs,
    )
    wait_until(
        lambda: webhook.received("resolved", ALERT, source="disks"),
        15,
        "the resolved notification",
        logs,
    )
    # Nothing else of the shipped rules fired against a healthy daemon.
    others = {
        a["labels"]["alertname"]
        for note in webhook.notifications
        for a in note["alerts"]
        if a["labels"]["alertname"] != ALERT
    }
    assert others == set()
    assert time.monotonic() - started < 60


# --------------------------------------------------------------------------------------------
# The contention scenario on the simulated node


#: The demo's alert settings: the shipped contention rule's 30 s ``for`` and 60 s resolve time
#: shortened so the scenario's 40 s of contention fire and resolve within the test.
DEMO_CONFIG = """\
[alerts.rules.pcie_contention]
for_seconds = 5.0
resolve_after_seconds = 5.0
"""


@pytest.fixture
def contention_stack(tmp_path: Path) -> Iterator[dict[str, Any]]:
    binary("prometheus")
    binary("prometheus-alertmanager")
    with Webhook() as webhook, stopping() as started:
        # The scenario's clock starts with the demo: it goes first, Prometheus catches up in
        # the ten quiet seconds before the contention.
        demo_port = free_port()
        demo = start_demo(
            tmp_path,
            ["root-port-contention"],
            f"127.0.0.1:{demo_port}",
            DEMO_CONFIG,
            150,
            started,
        )
        # The shipped rules as they are: the contention rule's for is already 0s (the daemon
        # applied its own).
        alerting = start_alerting(
            tmp_path, demo_port, shipped_rules("alerts.yml", {}), webhook, started
        )

        def logs() -> str:
            return f"{alerting.logs()}\n--- nodescope demo\n{demo.log()}"

        yield {
            "demo": f"http://127.0.0.1:{demo_port}",
            "demo_process": demo,
            "alerting": alerting,
            "webhook": webhook,
            "logs": logs,
        }


def daemon_alerts(url: str) -> list[dict[str, Any]]:
    """The daemon's pending and firing alerts, as ``nodescope alerts --json`` prints them."""
    done = subprocess.run(
        [*nodescope_command(), "alerts", "--json", "--url", url],
        capture_output=True,
        text=True,
        timeout=10,
    )
    if done.returncode == 1:
        raise ConnectionError(done.stderr)  # not serving yet
    assert done.returncode == 0, done.stderr
    alerts: list[dict[str, Any]] = json.loads(done.stdout)["alerts"]
    return [a for a in alerts if a["kind"] == "pcie_contention"]


def contention_alerts(base: str) -> list[dict[str, Any]]:
    return [a for a in prometheus_alerts(base) if a["labels"].get("alertname") == CONTENTION]


def test_contention_scenario_alert_fires_and_resolves_through_prometheus_and_alertmanager(
    contention_stack: dict[str, Any],
) -> None:
    started = time.monotonic()
    demo, logs, webhook = (
        contention_stack["demo"],
        contention_stack["logs"],
        contention_stack["webhook"],
    )
    alerting: Alerting = contention_stack["alerting"]
    prom = alerting.prometheus
    alerting.wait_ready(15, logs)

    # The shipped contention rule, loaded with its shipped expression.
    rules = alerting.alerting_rules()
    assert same_expr(rules[CONTENTION]["query"], shipped_expr(CONTENTION))
    assert "pcie_contention" in rules[CONTENTION]["query"]
    assert rules[CONTENTION]["duration"] == 0

    # Before the contention (t < 10): scraped, the root port below the 60 % threshold.
    def scraped() -> bool:
        result = query(prom, f'nodescope_pcie_link_utilization_ratio{{link="{ROOT_PORT}"}}')
        return len(result) == 2

    wait_until(scraped, 30, "the first scrape of the demo", logs)
    assert contention_alerts(prom) == []

    # The daemon's alert engine fires once the contention has held for its 5 s ``for``.
    def daemon_firing() -> bool:
        return any(a["state"] == "firing" for a in daemon_alerts(demo))

    wait_until(daemon_firing, 45, "the daemon's pcie_contention alert firing", logs)
    (alert,) = daemon_alerts(demo)
    assert alert["subjects"] == {"link": ROOT_PORT}
    assert alert["severity"] == "warning"
    # Its evidence names the two endpoints of different classes that share the root port.
    assert "gpu0 H2D 41.0 GB/s (job 81740)" in alert["message"]
    assert "nvme0n1 reads 6.5 GB/s" in alert["message"]
    assert alert["evidence_last"]["value"] >= alert["evidence_last"]["threshold"]

    # Prometheus's shipped rule follows it, and Alertmanager notifies the webhook.
    wait_until(
        lambda: any(a["state"] == "firing" for a in contention_alerts(prom)),
        15,
        f"{CONTENTION} firing",
        logs,
    )
    (firing,) = contention_alerts(prom)
    assert firing["labels"]["subject"] == f"link={ROOT_PORT}"
    assert firing["labels"]["kind"] == "pcie_contention"
    assert firing["labels"]["severity"] == "warning"
    assert firing["labels"]["job"] == "nodescope"
    assert firing["annotations"]["summary"] == (
        f"PCIe contention on link={ROOT_PORT} ({firing['labels']['instance']})"
    )
    (utilisation,) = query(
        prom,
        f'nodescope_pcie_link_utilization_ratio{{link="{ROOT_PORT}",direction="downstream"}}',
    )
    assert float(utilisation["value"][1]) >= 0.6
    wait_until(
        lambda: webhook.received("firing", CONTENTION, subject=f"link={ROOT_PORT}"),
        15,
        "the firing notification",
        logs,
    )

    # The loader stops at t=50: the daemon resolves its alert 5 s later, Prometheus's alert
    # goes with it, and the webhook hears of it.
    wait_until(lambda: daemon_alerts(demo) == [], 50, "the daemon's alert resolved", logs)
    wait_until(lambda: contention_alerts(prom) == [], 15, f"{CONTENTION} resolved", logs)
    wait_until(
        lambda: webhook.received("resolved", CONTENTION, subject=f"link={ROOT_PORT}"),
        15,
        "the resolved notification",
        logs,
    )
    # Resolved, not cancelled: pending, firing and resolved once each.
    transitions = {
        s["metric"]["to"]: float(s["value"][1])
        for s in query(prom, 'nodescope_alert_transitions_total{kind="pcie_contention"}')
    }
    assert transitions == {"pending": 1.0, "firing": 1.0, "resolved": 1.0}, transitions
    (utilisation,) = query(
        prom,
        f'nodescope_pcie_link_utilization_ratio{{link="{ROOT_PORT}",direction="downstream"}}',
    )
    assert float(utilisation["value"][1]) < 0.5

    # Nothing else of the shipped rules fired on the simulated node.
    others = {
        a["labels"]["alertname"]
        for note in webhook.notifications
        for a in note["alerts"]
        if a["labels"]["alertname"] != CONTENTION
    }
    assert others == set()
    assert contention_stack["demo_process"].proc.poll() is None, logs()
    assert time.monotonic() - started < 90
