"""NVIDIA's dcgm-exporter dashboard on nodescope's series: every query of
tests/fixtures/dcgm-exporter/dcgm-exporter-dashboard.json finds data.

A simulated node (``nodescope demo dgx-h100``) serves /metrics; Debian's Prometheus scrapes it
every second and evaluates the shipped exporters/prometheus/dcgm-compat.rules.yml. The
dashboard's template variables are resolved as Grafana resolves them (``label_values`` of a
metric), their values put into the panels' expressions, and each expression is asked of the
server with ``promtool query instant``: every one returns samples, with dcgm-exporter's labels.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO
from tests.integration.alerting_harness import (
    RULES,
    Alerting,
    Process,
    binary,
    query,
    start_demo,
    stopping,
    wait_until,
)
from tests.integration.daemon_harness import free_port

pytestmark = pytest.mark.integration

DASHBOARD = REPO / "tests" / "fixtures" / "dcgm-exporter" / "dcgm-exporter-dashboard.json"
RULE_FILE = "dcgm-compat.rules.yml"
#: The labels dcgm-exporter puts on every GPU series, which its dashboards and alerts select
#: and group by.
DCGM_LABELS = ("gpu", "UUID", "device", "modelName", "pci_bus_id", "Hostname", "instance")
#: Grafana's template variables that are not the dashboard's own.
RATE_INTERVAL = "1m"


def panels(document: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside rows included."""
    stack = list(document["panels"])
    while stack:
        panel = stack.pop(0)
        yield panel
        stack[:0] = panel.get("panels", [])


def panel_queries(document: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expression) of every target of every panel."""
    return [
        (str(panel["title"]), str(target["expr"]))
        for panel in panels(document)
        for target in panel.get("targets", [])
        if target.get("expr")
    ]


def variable_queries(document: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(variable, metric, label) of each ``label_values(metric, label)`` query variable."""
    out = []
    for variable in document["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query_text = variable["query"]
        if isinstance(query_text, dict):
            query_text = query_text["query"]
        match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query_text.strip())
        assert match, f"a variable query this test cannot resolve: {query_text}"
        out.append((str(variable["name"]), match.group(1), match.group(2)))
    return out


def fill(expr: str, values: dict[str, list[str]]) -> str:
    """The expression with Grafana's variables replaced: a multi-value variable by the
    alternation of all its values (as Grafana does for "All" in a regex matcher), each
    value's regex metacharacters escaped with a backslash that is itself escaped in the
    PromQL string."""
    for name, got in sorted(values.items(), key=lambda item: -len(item[0])):
        alternation = "|".join(re.escape(v).replace("\\", "\\\\") for v in got)
        expr = expr.replace(f"${{{name}}}", alternation).replace(f"${name}", alternation)
    expr = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$__interval", "15s")
    assert "$" not in expr, f"a Grafana variable left in {expr}"
    return expr


def promtool_query(base: str, expr: str) -> list[dict[str, Any]]:
    """The instant result of ``expr`` from the server at ``base``, through promtool."""
    done = subprocess.run(
        [binary("promtool"), "query", "instant", "-o", "json", base, expr],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, f"{expr}\n{done.stdout}{done.stderr}"
    result: list[dict[str, Any]] = json.loads(done.stdout)
    return result


def test_the_fixture_is_nvidias_dashboard() -> None:
    """The kept dashboard's queries are the ones this test was written for, all read through
    the recording rules (a query of a name the rules do not record would find nothing)."""
    document = json.loads(DASHBOARD.read_text())
    assert document["title"] == "NVIDIA DCGM Exporter Dashboard"
    queries = panel_queries(document)
    assert len(queries) == 8
    recorded = set(re.findall(r"^\s*- record:\s*(DCGM_\w+)", (RULES / RULE_FILE).read_text(), re.M))
    for title, expr in queries:
        names = set(re.findall(r"\bDCGM_\w+", expr))
        assert names and names <= recorded, (title, expr)
    assert [(v, m, label) for v, m, label in variable_queries(document)] == [
        ("instance", "DCGM_FI_DEV_GPU_TEMP", "instance"),
        ("gpu", "DCGM_FI_DEV_GPU_TEMP", "gpu"),
    ]


@pytest.fixture
def demo_prometheus(tmp_path: Path) -> Iterator[tuple[str, str, Process, Alerting]]:
    binary("prometheus")
    binary("promtool")
    with stopping() as started:
        demo_port = free_port()
        demo = start_demo(tmp_path, ["dgx-h100"], f"127.0.0.1:{demo_port}", "", 300, started)
        prometheus = Alerting(tmp_path, started)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [RULE_FILE],
            "scrape_configs": [
                {
                    "job_name": "nodescope",
                    "static_configs": [{"targets": [f"127.0.0.1:{demo_port}"]}],
                }
            ],
        }
        prometheus.start_prometheus(
            yaml.safe_dump(config, sort_keys=False), {RULE_FILE: (RULES / RULE_FILE).read_text()}
        )
        yield prometheus.prometheus, f"127.0.0.1:{demo_port}", demo, prometheus


def test_every_dashboard_query_finds_data(
    demo_prometheus: tuple[str, str, Process, Alerting],
) -> None:
    base, target, demo, prometheus = demo_prometheus
    document = json.loads(DASHBOARD.read_text())
    queries = panel_queries(document)

    def logs() -> str:
        return f"{prometheus.logs()}\n--- nodescope demo\n{demo.log()}"

    # The demo's first cycles take a while on a loaded machine; the GPM figures need two
    # samples and the rates two scrapes. Wait until the last of them has samples.
    def every_name_has_data() -> bool:
        if demo.proc.poll() is not None:
            raise AssertionError(f"the demo exited\n{logs()}")
        names = {n for _, expr in queries for n in re.findall(r"\bDCGM_\w+", expr)}
        return all(query(base, name) for name in names)

    wait_until(every_name_has_data, 150, "every DCGM name the dashboard reads", logs)

    values: dict[str, list[str]] = {}
    for variable, metric, label in variable_queries(document):
        found = promtool_query(base, f"group by ({label}) ({metric})")
        values[variable] = sorted({sample["metric"][label] for sample in found})
        assert values[variable], variable
    assert values["gpu"] == [str(i) for i in range(8)]
    assert values["instance"] == [target]

    for title, expr in queries:
        filled = fill(expr, values)
        result = promtool_query(base, filled)
        assert result, f"{title}: {filled} found no data"
        for sample in result:
            float(sample["value"][1])
        if not re.match(r"^\s*(avg|sum)\(", filled):
            # A per-GPU panel: one series per GPU, with dcgm-exporter's labels.
            assert len(result) == 8, (title, result)
            for sample in result:
                missing = [label for label in DCGM_LABELS if not sample["metric"].get(label)]
                assert not missing, (title, sample["metric"])
                assert sample["metric"]["device"] == f"nvidia{sample['metric']['gpu']}"
