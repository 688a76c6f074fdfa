"""The shipped dcgm-exporter names (exporters/prometheus/dcgm-compat.rules.yml): promtool
accepts them, they read only series nodescope exports, and docs/dcgm.md maps every one."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

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


@pytest.mark.parametrize(
    ("shipped", "changed"),
    [
        # Megabytes instead of MiB.
        (
            "floor(nodescope_gpu_framebuffer_used_bytes / 1048576)",
            "floor(nodescope_gpu_framebuffer_used_bytes / 1e6)",
        ),
        # A ratio where dcgm-exporter has percent.
        (
            'round(100 * sum without (engine) (nodescope_gpu_utilization_ratio{engine="gpu"}))',
            'sum without (engine) (nodescope_gpu_utilization_ratio{engine="gpu"})',
        ),
        # A wrong bit for a clock-event reason.
        (
            '64 * nodescope_gpu_clock_event_reason{reason="hw_thermal_slowdown"}',
            '32 * nodescope_gpu_clock_event_reason{reason="hw_thermal_slowdown"}',
        ),
        # The port left in the host name.
        (
            '"Hostname", "$1", "instance", "(.+?)(?::[0-9]+)?"',
            '"Hostname", "$1", "instance", "(.+)"',
        ),
        # The tens digit of an Xid code read as units.
        ('"digit", "t7", "", "") * 0 + 70', '"digit", "t7", "", "") * 0 + 7'),
    ],
)
def test_the_unit_tests_catch_a_changed_rule(tmp_path: Path, shipped: str, changed: str) -> None:
    """exporters/prometheus/tests/dcgm_compat_test.yml fails when a unit, a label or a bit
    of the rules changes."""
    text = RULE_FILE.read_text()
    assert text.count(shipped) == 1, shipped
    (tmp_path / "tests").mkdir()
    (tmp_path / RULE_FILE.name).write_text(text.replace(shipped, changed))
    unit_tests = tmp_path / "tests" / "dcgm_compat_test.yml"
    shutil.copyfile(RULES / "tests" / "dcgm_compat_test.yml", unit_tests)
    proc = subprocess.run(
        [promtool(), "test", "rules", str(unit_tests)], capture_output=True, text=True
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED" in proc.stdout + proc.stderr


def test_both_packages_install_every_rule_file() -> None:
    """The deb and the rpm install each shipped rule file beside the others."""
    shipped = sorted(path.name for path in RULES.glob("*.yml"))
    assert RULE_FILE.name in shipped
    for recipe in ("packaging/deb/build.sh", "packaging/rpm/nodescope.spec"):
        text = (REPO / recipe).read_text()
        for name in shipped:
            assert f"exporters/prometheus/{name}" in text, (recipe, name)
