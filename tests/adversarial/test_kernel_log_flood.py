"""A flood of kernel messages that hides Xids and SXids reaches a pager.

A flood of kernel-log records (one a user can cause) wraps the kernel's ring buffer before the
``sxid`` source reads it; the records lost may hold the driver's Xids and SXids. The source
counts the losses (``nodescope_kmsg_records_lost_total``), and a shipped rule must turn them
into an alert. Here the real kernel's ring buffer is wrapped (records written to
``/dev/kmsg``, each through its own open so the kernel's per-open rate limit lets them all
in), the real source reads it, the counter is rendered as /metrics shows it, and
``promtool test rules`` runs the shipped rules over that counter: the rule fires. Needs root
for ``/dev/kmsg``; skipped with the reason otherwise.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.roots import Roots
from nodescope.sources import sxid as sx
from nodescope_exporters import event_metrics
from tests.unit.exposition_helpers import exposition, sample_values

RULES = Path(__file__).resolve().parents[2] / "exporters" / "prometheus"
METRIC = "nodescope_kmsg_records_lost_total"
#: ``klogctl`` action that answers the size of the kernel's log buffer.
SYSLOG_ACTION_SIZE_BUFFER = 10


def _ring_bytes() -> int:
    size = int(ctypes.CDLL(None).klogctl(SYSLOG_ACTION_SIZE_BUFFER, None, 0))
    return size if size > 0 else 1 << 20


def _flood(total_bytes: int) -> None:
    """Records of user text written to ``/dev/kmsg`` until ``total_bytes`` were written."""
    line = ("nodescope kernel-log flood " + "x" * 900 + "\n").encode()
    for _ in range(total_bytes // len(line) + 1):
        fd = os.open("/dev/kmsg", os.O_WRONLY)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def _rule_on(metric: str) -> str:
    """The name of the shipped alerting rule whose expression reads ``metric``."""
    document = yaml.safe_load((RULES / "alerts.yml").read_text())
    names = [
        rule["alert"]
        for group in document["groups"]
        for rule in group["rules"]
        if "alert" in rule and metric in rule["expr"]
    ]
    assert names, f"no shipped alerting rule reads {metric}"
    return str(names[0])


def test_a_flood_that_wraps_the_kernel_log_fires_a_shipped_alert(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: writing /dev/kmsg")
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed (scripts/test.sh installs Debian's prometheus)")
    rule = _rule_on(METRIC)

    source = sx.SxidSource()
    roots = Roots(dev=Path("/dev"), sysfs=tmp_path / "sys")
    try:
        first = source.collect(roots)
        while first.behind:
            first = source.collect(roots)
        # Three times the ring buffer between two reads: the oldest records are overwritten
        # before the source reads them.
        _flood(3 * _ring_bytes())
        flooded = source.collect(roots)
    finally:
        source.close()
    assert flooded.lost > first.lost

    snapshot = Snapshot(1, 10.0, 1e9, {"sxid": SourceSample("sxid", 10.0, 0.01, flooded)})
    lost = sample_values(exposition(event_metrics.families(snapshot)))[(METRIC, ())]
    assert lost == flooded.lost >= 1

    # The counter as Prometheus scraped it: its value before the flood, then after.
    before = int(first.lost)
    test = {
        "rule_files": [str(RULES / "records.yml"), str(RULES / "alerts.yml")],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": f'{METRIC}{{instance="n1",job="nodescope"}}',
                        "values": f"{before}x4 {int(lost)}x10",
                    }
                ],
                # ALERTS: which alerts fire, by their labels (the annotations are the
                # shipped test's business, exporters/prometheus/tests/alerts_test.yml).
                "promql_expr_test": [
                    {"eval_time": "4m", "expr": f'ALERTS{{alertname="{rule}"}}', "exp_samples": []},
                    {
                        "eval_time": "6m",
                        "expr": f'ALERTS{{alertname="{rule}"}}',
                        "exp_samples": [
                            {
                                "labels": (
                                    f'ALERTS{{alertname="{rule}",alertstate="firing",'
                                    'instance="n1",job="nodescope",origin="prometheus",'
                                    'scope="node",severity="warning"}'
                                ),
                                "value": 1,
                            }
                        ],
                    },
                ],
            }
        ],
    }
    path = tmp_path / "flood_test.yml"
    path.write_text(yaml.safe_dump(test))
    done = subprocess.run(
        [promtool, "test", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
