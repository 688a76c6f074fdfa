"""The shipped Prometheus rules and Grafana dashboard: promtool accepts the rules and passes
their unit tests, every alert is tested, and every metric they read exists."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from nodescope_exporters.catalog import CATALOG
from nodescope_exporters.prometheus import load_areas
from tests.conftest import REPO

RULES = REPO / "exporters" / "prometheus"
DASHBOARD = REPO / "exporters" / "grafana" / "nodescope.json"

#: Metrics the attribution (issue 5, detectors) will export; the rules and the dashboard
#: already read them. Remove a name from here once it is in the catalogue.
PENDING: frozenset[str] = frozenset()
#: Series Prometheus makes itself.
PROMETHEUS_SERIES = frozenset({"up"})


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed (scripts/test.sh installs Debian's prometheus)")
    return path


def metric_names(expr: str) -> set[str]:
    """Metric and recording-rule names an expression reads (quoted strings removed first, so
    label values are not taken for names)."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    bare = re.sub(r"\[[^\]]*\]", "", bare)
    names = set(re.findall(r"(?<![\w:$])(nodescope[a-z0-9_:]*|up)\b(?!\s*\()", bare))
    return names


def rule_exprs(path: Path) -> list[str]:
    """The ``expr:`` of every rule: one line, or an indented ``|`` block."""
    exprs: list[str] = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)expr:\s*(.*)$", line)
        if not m:
            continue
        if m.group(2).strip() != "|":
            exprs.append(m.group(2))
            continue
        indent = len(m.group(1))
        block = []
        for follow in lines[i + 1 :]:
            if follow.strip() and len(follow) - len(follow.lstrip()) <= indent:
                break
            block.append(follow.strip())
        exprs.append("\n".join(block))
    return exprs


def recorded_names() -> set[str]:
    return set(re.findall(r"^\s*- record:\s*(\S+)", (RULES / "records.yml").read_text(), re.M))


def known_names() -> set[str]:
    load_areas()
    return set(CATALOG) | PENDING | PROMETHEUS_SERIES | recorded_names()


def test_promtool_checks_the_rules() -> None:
    proc = subprocess.run(
        [promtool(), "check", "rules", str(RULES / "alerts.yml"), str(RULES / "records.yml")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_promtool_rule_unit_tests_pass() -> None:
    tests = sorted((RULES / "tests").glob("*.yml"))
    assert len(tests) >= 2
    proc = subprocess.run(
        [promtool(), "test", "rules", *map(str, tests)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_wrong_expectation_fails(tmp_path: Path) -> None:
    """The unit tests can fail: the source-down alert expected a minute early."""
    text = (RULES / "tests" / "alerts_test.yml").read_text()
    early = text.replace(
        "      - eval_time: 6m\n        alertname: NodescopeSourceDown\n        exp_alerts: []",
        "      - eval_time: 6m\n        alertname: NodescopeSourceDown\n        exp_alerts:\n"
        "          - exp_labels: {instance: n1, job: nodescope, source: disks,"
        " severity: warning}",
    )
    assert early != text
    (tmp_path / "tests").mkdir()
    for name in ("alerts.yml", "records.yml"):
        shutil.copyfile(RULES / name, tmp_path / name)
    (tmp_path / "tests" / "alerts_test.yml").write_text(early)
    proc = subprocess.run(
        [promtool(), "test", "rules", str(tmp_path / "tests" / "alerts_test.yml")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "NodescopeSourceDown" in proc.stdout + proc.stderr


def test_every_alert_has_a_unit_test() -> None:
    alerts = set(re.findall(r"^\s*- alert:\s*(\S+)", (RULES / "alerts.yml").read_text(), re.M))
    tested: set[str] = set()
    for path in (RULES / "tests").glob("*.yml"):
        tested |= set(re.findall(r"^\s*alertname:\s*(\S+)", path.read_text(), re.M))
    assert len(alerts) >= 15
    assert alerts - tested == set()


def test_rules_read_only_metrics_that_exist() -> None:
    known = known_names()
    for path in (RULES / "alerts.yml", RULES / "records.yml"):
        exprs = rule_exprs(path)
        assert exprs
        unknown = {name for expr in exprs for name in metric_names(expr)} - known
        assert not unknown, f"{path.name} reads unknown metrics {sorted(unknown)}"


def test_metric_name_extraction() -> None:
    expr = (
        'rate(nodescope_gpu_xid_errors_total{kind="nodescope_fake"}[5m]) or up == 0 '
        "and on (instance) nodescope:gpu_pcie_bytes_per_second:rate1m > 1e9"
    )
    assert metric_names(expr) == {
        "nodescope_gpu_xid_errors_total",
        "up",
        "nodescope:gpu_pcie_bytes_per_second:rate1m",
    }


def test_pending_names_are_not_yet_exported() -> None:
    load_areas()
    assert not PENDING & set(CATALOG), "exported now: remove from PENDING"


# -- the Grafana dashboard ---------------------------------------------------------------------


def dashboard() -> dict[str, object]:
    document = json.loads(DASHBOARD.read_text())
    assert isinstance(document, dict)
    return document


def all_panels(document: dict[str, object]) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for panel in document["panels"]:  # type: ignore[attr-defined]
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def dashboard_exprs(document: dict[str, object]) -> list[str]:
    return [
        str(target["expr"])
        for panel in all_panels(document)
        for target in panel.get("targets", [])  # type: ignore[attr-defined]
    ]


def test_dashboard_shape() -> None:
    document = dashboard()
    assert 36 <= int(document["schemaVersion"]) <= 41  # type: ignore[call-overload]
    inputs = document["__inputs"]
    assert [i["name"] for i in inputs] == ["DS_PROMETHEUS"]  # type: ignore[attr-defined]
    panels = all_panels(document)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])  # type: ignore[arg-type]
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
            for target in panel["targets"]:  # type: ignore[attr-defined]
                assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"
    titles = {str(p["title"]) for p in panels}
    for wanted in (
        "Utilisation per shared link",
        "Top contributors",
        "PCIe traffic per GPU",
        "NVLink traffic per GPU",
        "Port traffic",
        "Disk traffic",
        "Active alerts",
        "Sources up",
    ):
        assert wanted in titles


def test_dashboard_reads_only_metrics_that_exist() -> None:
    exprs = dashboard_exprs(dashboard())
    assert len(exprs) >= 30
    unknown = {name for expr in exprs for name in metric_names(expr)} - known_names()
    assert not unknown, f"the dashboard reads unknown metrics {sorted(unknown)}"


def test_dashboard_expressions_parse(tmp_path: Path) -> None:
    """promtool parses each expression (as a recording rule, Grafana's variables filled)."""
    lines = ["groups:", "  - name: dashboard", "    rules:"]
    for i, expr in enumerate(dashboard_exprs(dashboard())):
        filled = expr.replace("$instance", "n1").replace("$__rate_interval", "1m")
        lines.append(f"      - record: dashboard:expr_{i}")
        lines.append(f"        expr: {json.dumps(filled)}")
    path = tmp_path / "dashboard.yml"
    path.write_text("\n".join(lines) + "\n")
    proc = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
