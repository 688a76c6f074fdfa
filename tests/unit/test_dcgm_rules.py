"""The shipped dcgm-exporter names (exporters/prometheus/dcgm-compat.rules.yml): promtool
accepts them, they read only series nodescope exports, and docs/dcgm.md maps every one."""

from __future__ import annotations

import re
import subprocess

from tests.conftest import REPO
from tests.unit.test_prometheus_rules import RULES, known_names, metric_names, promtool, rule_exprs

RULE_FILE = RULES / "dcgm-compat.rules.yml"
DOC = REPO / "docs" / "dcgm.md"


def recorded() -> list[str]:
    return re.findall(r"^\s*- record:\s*(\S+)", RULE_FILE.read_text(), re.M)


def test_promtool_checks_the_dcgm_rules() -> None:
    proc = subprocess.run(
        [promtool(), "check", "rules", str(RULE_FILE)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(recorded())} rules found" in proc.stdout


def test_dcgm_rules_read_only_series_that_exist() -> None:
    known = known_names() | set(recorded())
    exprs = rule_exprs(RULE_FILE)
    assert len(exprs) == len(recorded())
    unknown = {name for expr in exprs for name in metric_names(expr)} - known
    assert not unknown, sorted(unknown)


def test_every_dcgm_name_is_in_the_mapping_table() -> None:
    doc = DOC.read_text()
    for name in recorded():
        if name.startswith("DCGM_"):
            assert re.search(rf"^\| `{name}` \|", doc, re.M), name
