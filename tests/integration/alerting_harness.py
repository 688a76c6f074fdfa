"""Debian's Prometheus and Alertmanager started for a test, and a webhook receiver for them.

The alerting tests (test_prometheus_alertmanager.py, test_alert_routing.py,
test_fleet_alerts.py) each run the real servers against their own nodescope targets. What
they share lives here: the processes (on 127.0.0.1, with their own data directories, stopped
by their PIDs), the webhook that records every notification, the shipped rule files with
shortened ``for`` durations and nothing else changed, and the waiting and querying helpers.
A test hands ``Alerting`` the configuration texts it needs (the shipped alertmanager.yml with
its receivers pointed here, say), or has ``Alerting.to_webhook`` write the plain pair: every
alert to one webhook, every rule evaluated each second.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO, nodescope_command
from tests.integration.daemon_harness import free_port

RULES = REPO / "exporters" / "prometheus"


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed (scripts/test.sh installs it from Debian)")
    return path


# --------------------------------------------------------------------------------------------
# The shipped rule files


def with_for(rules: str, alert: str, duration: str) -> str:
    """The rule file with one alert's ``for`` replaced; nothing else changes."""
    start = rules.index(f"- alert: {alert}\n")
    following = rules.find("- alert:", start + 1)
    end = len(rules) if following < 0 else following
    block, count = re.subn(r"(\n\s+for: )\S+", rf"\g<1>{duration}", rules[start:end], count=1)
    assert count == 1, f"{alert} has no for"
    return rules[:start] + block + rules[end:]


_FOR_LINE = re.compile(r"^(\s+for: )\S+$", re.MULTILINE)


def shipped_rules(file: str, shortened: Mapping[str, str]) -> str:
    """The shipped rule file exporters/prometheus/``file`` (alerts.yml, jobs.yml, records.yml)
    with the named alerts' ``for`` replaced, checked to differ from the shipped file in ``for``
    values only: every expression, label and annotation is the shipped one. A named alert
    whose ``for`` is already the given one fails, so that a test cannot believe it shortened
    a rule the shipped file has since changed."""
    # A name, not a path: the copies are of the shipped files and of nothing else.
    assert Path(file).name == file and (RULES / file).is_file(), file
    shipped = (RULES / file).read_text()
    copy = shipped
    for alert, duration in shortened.items():
        before, copy = copy, with_for(copy, alert, duration)
        assert copy != before, f"{alert}'s for in {file} is already {duration}"
    assert _FOR_LINE.sub(r"\g<1>X", copy) == _FOR_LINE.sub(r"\g<1>X", shipped)
    return copy


# --------------------------------------------------------------------------------------------
# Processes, the webhook and waiting


class Process:
    """A server started by the test; stopped by its PID."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log
        self._log = log.open("wb")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env)

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


@contextlib.contextmanager
def stopping() -> Iterator[list[Process]]:
    """A list for every process a fixture starts; each is stopped, the last started first,
    when the block ends, however it ends."""
    started: list[Process] = []
    try:
        yield started
    finally:
        for process in reversed(started):
            process.stop()


def start_demo(
    workdir: Path,
    scenario: Sequence[str],
    listen: str,
    config: str,
    duration: float,
    started: list[Process],
    log: str = "demo.log",
) -> Process:
    """``nodescope demo SCENARIO...`` in real time with ``config`` as its nodescope.toml,
    serving on ``listen`` for ``duration`` seconds; on ``started`` once it exists."""
    (workdir / "nodescope.toml").write_text(config)
    # Unbuffered, so that the log a failing test prints is the demo's latest; and without a
    # NOTIFY_SOCKET the test runner may have inherited: the demo's datagrams are not for it.
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("NOTIFY_SOCKET", None)
    demo = Process(
        [
            *nodescope_command(),
            "demo",
            *scenario,
            "--no-tty",
            "--duration",
            f"{duration:g}",
            "--listen",
            listen,
            "--config",
            str(workdir / "nodescope.toml"),
        ],
        workdir / log,
        env=env,
    )
    started.append(demo)
    return demo


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

    def __enter__(self) -> Webhook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def query(base: str, promql: str) -> list[dict[str, Any]]:
    """The result vector of an instant query to the Prometheus at ``base``."""
    result: list[dict[str, Any]] = get_json(
        f"{base}/api/v1/query?query={urllib.parse.quote(promql)}"
    )["data"]["result"]
    return result


def prometheus_alerts(base: str) -> list[dict[str, Any]]:
    """The pending and firing alerts of the Prometheus at ``base``."""
    alerts: list[dict[str, Any]] = get_json(f"{base}/api/v1/alerts")["data"]["alerts"]
    return alerts


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


# --------------------------------------------------------------------------------------------
# Configuration texts


def webhook_route(webhook: Webhook, group_by: Sequence[str]) -> str:
    """An alertmanager.yml with one route to ``webhook``, groups flushed within a second and
    resolved alerts notified too (a test waits for both)."""
    config = {
        "route": {
            "receiver": "webhook",
            "group_by": list(group_by),
            "group_wait": "1s",
            "group_interval": "1s",
            "repeat_interval": "1h",
        },
        "receivers": [
            {
                "name": "webhook",
                "webhook_configs": [
                    {"url": f"http://127.0.0.1:{webhook.port}/hook", "send_resolved": True}
                ],
            }
        ],
    }
    return yaml.safe_dump(config, sort_keys=False)


def prometheus_config(
    alertmanager_port: int, rule_files: Sequence[str], scrape: Mapping[str, Any]
) -> str:
    """A prometheus.yml that scrapes and evaluates every second (so that an alert's state
    follows its target within seconds), loads ``rule_files`` and sends its alerts to the
    Alertmanager on ``alertmanager_port``; ``scrape`` is the one job's targets (its
    ``static_configs`` or ``file_sd_configs``)."""
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": list(rule_files),
        "alerting": {
            "alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{alertmanager_port}"]}]}]
        },
        "scrape_configs": [{"job_name": "nodescope", **scrape}],
    }
    return yaml.safe_dump(config, sort_keys=False)


# --------------------------------------------------------------------------------------------
# The two servers


class Alerting:
    """Debian's ``prometheus-alertmanager`` and ``prometheus`` in one work directory, each on
    a port of its own on 127.0.0.1. Every process goes on ``started`` as soon as it exists, so
    that the fixture that owns the list stops it even when the next step fails."""

    def __init__(self, workdir: Path, started: list[Process]) -> None:
        # Both looked up first: a missing package fails the test before anything starts.
        self._prometheus_bin = binary("prometheus")
        self._alertmanager_bin = binary("prometheus-alertmanager")
        self.workdir = workdir
        self.started = started
        self.alertmanager_port = free_port()
        self.prometheus_port = free_port()
        self.alertmanager = f"http://127.0.0.1:{self.alertmanager_port}"
        self.prometheus = f"http://127.0.0.1:{self.prometheus_port}"
        self.alertmanager_process: Process | None = None
        self.prometheus_process: Process | None = None

    @classmethod
    def to_webhook(
        cls,
        workdir: Path,
        started: list[Process],
        webhook: Webhook,
        group_by: Sequence[str],
        rules: Mapping[str, str],
        scrape: Mapping[str, Any],
    ) -> Alerting:
        """Alertmanager with one route to ``webhook`` (``webhook_route``), and Prometheus
        evaluating ``rules`` (file name to text, loaded in this order) every second on the
        targets of ``scrape`` (``prometheus_config``)."""
        alerting = cls(workdir, started)
        alerting.start_alertmanager(webhook_route(webhook, group_by))
        alerting.start_prometheus(
            prometheus_config(alerting.alertmanager_port, list(rules), scrape), rules
        )
        return alerting

    def start_alertmanager(self, config: str) -> None:
        """Alertmanager on ``config`` (an alertmanager.yml text), clustering off."""
        assert self.alertmanager_process is None, "Alertmanager started twice"
        (self.workdir / "alertmanager.yml").write_text(config)
        (self.workdir / "am-data").mkdir()
        self.alertmanager_process = Process(
            [
                self._alertmanager_bin,
                f"--config.file={self.workdir / 'alertmanager.yml'}",
                f"--storage.path={self.workdir / 'am-data'}",
                f"--web.listen-address=127.0.0.1:{self.alertmanager_port}",
                "--cluster.listen-address=",
            ],
            self.workdir / "alertmanager.log",
        )
        self.started.append(self.alertmanager_process)

    def start_prometheus(self, config: str, rules: Mapping[str, str]) -> None:
        """Prometheus on ``config`` (a prometheus.yml text) with ``rules``, rule file name to
        text, written beside it. The names must be exactly the config's ``rule_files``: a
        rule file the config names but nobody wrote would be a pattern matching nothing,
        which Prometheus accepts without a word."""
        assert self.prometheus_process is None, "Prometheus started twice"
        named = yaml.safe_load(config).get("rule_files") or []
        assert sorted(named) == sorted(rules), (named, sorted(rules))
        for name, text in rules.items():
            assert Path(name).name == name, name
            (self.workdir / name).write_text(text)
        (self.workdir / "prometheus.yml").write_text(config)
        self.prometheus_process = Process(
            [
                self._prometheus_bin,
                f"--config.file={self.workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.workdir / 'prom-data'}",
                f"--web.listen-address=127.0.0.1:{self.prometheus_port}",
                "--rules.alert.resend-delay=1s",
            ],
            self.workdir / "prometheus.log",
        )
        self.started.append(self.prometheus_process)

    def logs(self) -> str:
        parts = []
        for name, process in (
            ("prometheus", self.prometheus_process),
            ("alertmanager", self.alertmanager_process),
        ):
            if process is not None:
                parts.append(f"--- {name}\n{process.log()}")
        return "\n".join(parts)

    def wait_ready(self, timeout: float, logs: Callable[[], str]) -> None:
        """Until both servers answer ``/-/ready``; a server that exits fails at once."""

        def ready(base: str, process: Process) -> bool:
            if process.proc.poll() is not None:
                raise AssertionError(f"{base} exited ({process.proc.returncode})\n{logs()}")
            with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as response:
                return bool(response.status == 200)

        assert self.prometheus_process is not None and self.alertmanager_process is not None
        for base, process in (
            (self.prometheus, self.prometheus_process),
            (self.alertmanager, self.alertmanager_process),
        ):
            wait_until(functools.partial(ready, base, process), timeout, f"{base} ready", logs)

    def alerting_rules(self) -> dict[str, dict[str, Any]]:
        """The alerting rules Prometheus loaded, by name."""
        groups = get_json(f"{self.prometheus}/api/v1/rules")["data"]["groups"]
        return {r["name"]: r for g in groups for r in g["rules"] if r["type"] == "alerting"}
