"""The shipped alert rules on the real parts: Debian's ``prometheus`` scrapes a real
``nodescope run`` and evaluates exporters/prometheus/alerts.yml, Debian's
``prometheus-alertmanager`` routes to a webhook receiver in this test.

A source loses its input (the test owns the ``--procfs`` root), so ``NodescopeSourceDown``
fires — seen through Prometheus's HTTP API and as a webhook notification — and resolves when
the input comes back. The rule's expression is the shipped one; only its ``for`` is shortened
in the test's copy. Every process is started here, on 127.0.0.1 with its own data
directories, and stopped by its PID even when the test fails.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from nodescope.sources.registry import SOURCE_TABLE
from tests.conftest import REPO
from tests.integration.daemon_harness import Daemon, free_port

pytestmark = pytest.mark.integration

RULES = REPO / "exporters" / "prometheus"
ALERT = "NodescopeSourceDown"


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed (scripts/test.sh installs it from Debian)")
    return path


def with_for(rules: str, alert: str, duration: str) -> str:
    """The rule file with one alert's ``for`` replaced; nothing else changes."""
    start = rules.index(f"- alert: {alert}\n")
    following = rules.find("- alert:", start + 1)
    end = len(rules) if following < 0 else following
    block, count = re.subn(r"(\n\s+for: )\S+", rf"\g<1>{duration}", rules[start:end], count=1)
    assert count == 1, f"{alert} has no for"
    return rules[:start] + block + rules[end:]


class Webhook:
    """Alertmanager's webhook receiver: records every notification."""

    def __init__(self) -> None:
        self.notifications: list[dict[str, Any]] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                hook.notifications.append(json.loads(body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def received(self, status: str, alertname: str, **labels: str) -> bool:
        for note in list(self.notifications):
            for alert in note.get("alerts", []):
                got = alert.get("labels", {})
                if (
                    alert.get("status") == status
                    and got.get("alertname") == alertname
                    and all(got.get(k) == v for k, v in labels.items())
                ):
                    return True
        return False

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Process:
    """A server started by the test; stopped by its PID."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log_path = log
        self._log = log.open("wb")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


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


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def wait_until(
    check: Callable[[], bool], timeout: float, what: str, logs: Callable[[], str]
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass  # not listening yet
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{logs()}")


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[dict[str, Any]]:
    prometheus_bin = binary("prometheus")
    alertmanager_bin = binary("prometheus-alertmanager")
    started: list[Process] = []
    webhook = Webhook()
    daemon: Daemon | None = None
    try:
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
        daemon.wait_message("READY=1", timeout=10)
        # The loop sends WATCHDOG=1 datagrams; a socket nobody reads would fill up.
        threading.Thread(target=drain, args=(daemon,), daemon=True).start()

        # Alertmanager: one route to the webhook, groups flushed within a second.
        am_port = free_port()
        (tmp_path / "alertmanager.yml").write_text(
            f"""
route:
  receiver: webhook
  group_by: [alertname, source]
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: webhook
    webhook_configs:
      - url: http://127.0.0.1:{webhook.port}/hook
        send_resolved: true
"""
        )
        (tmp_path / "am-data").mkdir()
        alertmanager = Process(
            [
                alertmanager_bin,
                f"--config.file={tmp_path / 'alertmanager.yml'}",
                f"--storage.path={tmp_path / 'am-data'}",
                f"--web.listen-address=127.0.0.1:{am_port}",
                "--cluster.listen-address=",
            ],
            tmp_path / "alertmanager.log",
        )
        started.append(alertmanager)

        # Prometheus: the shipped rules, the source-down rule's for shortened.
        shutil.copyfile(RULES / "records.yml", tmp_path / "records.yml")
        (tmp_path / "alerts.yml").write_text(
            with_for((RULES / "alerts.yml").read_text(), ALERT, "1s")
        )
        prom_port = free_port()
        (tmp_path / "prometheus.yml").write_text(
            f"""
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: [alerts.yml, records.yml]
alerting:
  alertmanagers:
    - static_configs:
        - targets: ["127.0.0.1:{am_port}"]
scrape_configs:
  - job_name: nodescope
    static_configs:
      - targets: ["127.0.0.1:{daemon.port}"]
"""
        )
        prometheus = Process(
            [
                prometheus_bin,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'prom-data'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
                "--rules.alert.resend-delay=1s",
            ],
            tmp_path / "prometheus.log",
        )
        started.append(prometheus)

        def logs() -> str:
            return (
                f"--- prometheus\n{prometheus.log()}\n--- alertmanager\n{alertmanager.log()}\n"
                f"--- nodescope\n{daemon.stderr() if daemon else ''}"
            )

        yield {
            "procfs": procfs,
            "daemon": daemon,
            "prometheus": f"http://127.0.0.1:{prom_port}",
            "alertmanager": f"http://127.0.0.1:{am_port}",
            "webhook": webhook,
            "logs": logs,
        }
    finally:
        for process in reversed(started):
            process.stop()
        if daemon is not None:
            daemon.stop()
        webhook.close()


def prometheus_alerts(base: str) -> list[dict[str, Any]]:
    alerts: list[dict[str, Any]] = get_json(f"{base}/api/v1/alerts")["data"]["alerts"]
    return alerts


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
    for base in (prom, stack["alertmanager"]):
        wait_until(
            lambda base=base: urllib.request.urlopen(f"{base}/-/ready", timeout=2).status == 200,
            15,
            f"{base} ready",
            logs,
        )

    # The shipped rule file loaded, and the expression is the shipped one.
    groups = get_json(f"{prom}/api/v1/rules")["data"]["groups"]
    rules = {r["name"]: r for g in groups for r in g["rules"] if r["type"] == "alerting"}
    assert rules[ALERT]["query"] == "nodescope_source_up == 0"
    assert rules[ALERT]["duration"] == 1

    def scraped() -> bool:
        query = urllib.parse.quote('nodescope_source_up{source="disks"}')
        result = get_json(f"{prom}/api/v1/query?query={query}")["data"]["result"]
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
