"""The labels and the link of the alerts pushed to Alertmanager: the same label names as the
shipped Prometheus rules give their copies (exporters/prometheus/alerts.yml), the ``subject``
that ``nodescope_alert_active`` carries, and a ``generatorURL`` that someone reading the alert
on another machine can open."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import pytest

from nodescope import assembly, config
from nodescope.alerts import AlertEngine, AlertRule, AlertRules
from nodescope.errors import ConfigError
from nodescope.model.alert import Alert
from nodescope.model.finding import Finding, Severity
from nodescope.model.snapshot import Snapshot
from nodescope.service import alertmanager_pusher, generator_url
from nodescope_exporters import alert_metrics
from nodescope_exporters.push import AlertmanagerPusher, alert_document, labels_of
from tests.conftest import nodescope_command

WALL = 1_700_000_000.0
FELL_OFF = {"bdf": "0000:bb:00.0", "gpu": "5"}


def fire(*findings: Finding) -> tuple[Alert, ...]:
    """The firing alerts of ``findings`` (no ``for``: they fire at once)."""
    step = AlertEngine(AlertRules(AlertRule(0.0, 0.0))).step(list(findings), 0.0, WALL)
    return step.active


def one(kind: str, subjects: Mapping[str, str], severity: Severity = Severity.CRITICAL) -> Alert:
    (alert,) = fire(Finding(kind, severity, subjects, {"value": 1.0}, f"{kind} here"))
    return alert


def test_a_gpu_alert_carries_subject_gpu_origin_and_scope() -> None:
    labels = labels_of(one("gpu_fell_off_bus", FELL_OFF), "node01")
    assert labels == {
        "alertname": "NodescopeGpuFellOffBus",
        "severity": "critical",
        "instance": "node01",
        "kind": "gpu_fell_off_bus",
        "subject": "bdf=0000:bb:00.0,gpu=5",
        "gpu": "5",
        "origin": "daemon",
        "scope": "node",
    }


def test_workload_roles_go_to_the_workload_label_not_the_subject() -> None:
    # A collective hang is about a job alone: no hardware subject, no gpu, no empty labels.
    labels = labels_of(one("collective_hang", {"job": "81780"}, Severity.WARNING), "n")
    assert labels["workload"] == "job=81780"
    assert "subject" not in labels and "gpu" not in labels
    assert "" not in labels.values()
    # Hardware and workload together: each role to its own label.
    mixed = labels_of(one("pcie_contention", {"link": "L", "job": "7", "pid": "42"}), "n")
    assert (mixed["subject"], mixed["workload"]) == ("link=L", "job=7,pid=42")


def test_two_findings_differing_only_by_job_stay_two_alerts() -> None:
    sent: list[bytes] = []
    pusher = AlertmanagerPusher(
        "http://am.invalid:9093", instance="n", post=lambda url, body, timeout: sent.append(body)
    )
    try:
        alerts = fire(
            Finding("pcie_contention", Severity.WARNING, {"link": "L", "job": "1"}, {}),
            Finding("pcie_contention", Severity.WARNING, {"link": "L", "job": "2"}, {}),
        )
        assert pusher.submit(alerts, (), 0.0, WALL)
        deadline = time.monotonic() + 5.0
        while not sent and time.monotonic() < deadline:
            time.sleep(0.01)  # the background thread posts the batch
    finally:
        pusher.close()
    (body,) = sent
    docs = json.loads(body)
    assert sorted(d["labels"]["workload"] for d in docs) == ["job=1", "job=2"]
    assert {d["labels"]["subject"] for d in docs} == {"link=L"}


def active_subjects(alerts: tuple[Alert, ...]) -> set[str]:
    """The ``subject`` label values of ``nodescope_alert_active`` for these alerts."""
    snapshot = replace(Snapshot(cycle=1, monotonic=0.0, wall_time=WALL), alerts=alerts)
    family = next(iter(alert_metrics.families(snapshot)))
    assert family.name == "nodescope_alert_active"
    return {sample.labels["subject"] for sample in family.samples}


@pytest.mark.parametrize(
    "subjects",
    [FELL_OFF, {"link": "0000:16:01.0", "job": "81734"}, {"device": "5"}, {"job": "9"}],
)
def test_the_pushed_subject_is_the_exported_one(subjects: dict[str, str]) -> None:
    # One inhibit rule matches the daemon's copy and the rules path's by instance, kind and
    # subject: the two must spell the subject alike, including when it is empty.
    alert = one("gpu_fell_off_bus", subjects)
    assert active_subjects((alert,)) == {labels_of(alert, "n").get("subject", "")}


# -- generatorURL ------------------------------------------------------------------------------


def cfg(listen: str = "127.0.0.1:9400", external_url: str = "") -> config.Config:
    return assembly.from_mapping(
        {
            "daemon": {"listen": listen},
            "alerts": {"alertmanager_url": "http://am:9093", "external_url": external_url},
        },
        "t.toml",
    )


@pytest.mark.parametrize(
    ("listen", "url"),
    [
        # Nobody on another machine can open a loopback or wildcard address: the host name.
        ("127.0.0.1:9400", "http://node01:9400/api/v1/alerts"),
        ("127.8.9.10:9400", "http://node01:9400/api/v1/alerts"),
        ("0.0.0.0:9401", "http://node01:9401/api/v1/alerts"),
        ("[::]:9402", "http://node01:9402/api/v1/alerts"),
        ("[::1]:9403", "http://node01:9403/api/v1/alerts"),
        ("localhost:9404", "http://node01:9404/api/v1/alerts"),
        # A specific address or name is where the daemon is reached: kept.
        ("10.1.2.3:9400", "http://10.1.2.3:9400/api/v1/alerts"),
        ("[fd00::7]:9400", "http://[fd00::7]:9400/api/v1/alerts"),
        ("node01-ib.example:9400", "http://node01-ib.example:9400/api/v1/alerts"),
    ],
)
def test_generator_url_names_the_host_not_the_loopback(listen: str, url: str) -> None:
    assert generator_url(cfg(listen), hostname=lambda: "node01") == url


@pytest.mark.parametrize("name", ["", "bad name", "node/01", "nöde", "a" * 300])
def test_a_host_name_that_is_no_url_host_leaves_the_listen_address(name: str) -> None:
    # Alertmanager refuses a whole batch whose generatorURL is no URI: better the listen
    # address than no alert at all.
    got = generator_url(cfg("0.0.0.0:9400"), hostname=lambda: name)
    assert got == "http://0.0.0.0:9400/api/v1/alerts"


@pytest.mark.parametrize(
    ("external", "url"),
    [
        ("http://node01.example:9400", "http://node01.example:9400/api/v1/alerts"),
        ("https://node01.example:9400/", "https://node01.example:9400/api/v1/alerts"),
        ("https://proxy.example/nodes/node01", "https://proxy.example/nodes/node01/api/v1/alerts"),
    ],
)
def test_external_url_wins_over_the_listen_address(external: str, url: str) -> None:
    assert generator_url(cfg("10.1.2.3:9400", external), hostname=lambda: "x") == url


def test_the_pushed_alert_links_to_the_external_url() -> None:
    pusher = alertmanager_pusher(cfg(external_url="http://node01.example:9400"))
    assert pusher is not None
    try:
        url = pusher.generator_url
    finally:
        pusher.close()
    assert url == "http://node01.example:9400/api/v1/alerts"
    doc = alert_document(one("x", {}), "n", WALL + 60, url)
    assert doc["generatorURL"] == url


@pytest.mark.parametrize(
    "bad",
    [
        "node01:9400",
        "ftp://node01",
        "http://",
        "http://node01:9400/?x=1",
        "http://node 01",
        "http://node01#top",
        "javascript:alert(1)",
        "http://node01\n.example",
    ],
)
def test_a_bad_external_url_is_a_config_error(bad: str) -> None:
    with pytest.raises(ConfigError, match="external_url"):
        cfg(external_url=bad)


@pytest.mark.parametrize("bad", [7, True, ["http://x"]])
def test_an_external_url_that_is_no_string_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="external_url"):
        assembly.from_mapping({"alerts": {"external_url": bad}}, "t.toml")


def test_the_daemon_exits_2_on_a_bad_external_url(tmp_path: Path) -> None:
    path = tmp_path / "nodescope.toml"
    path.write_text('[alerts]\nexternal_url = "node01:9400"\n')
    proc = subprocess.run(
        [*nodescope_command(), "run", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2, proc.stderr
    assert "alerts.external_url" in proc.stderr
