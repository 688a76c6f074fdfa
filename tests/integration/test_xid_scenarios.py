"""The bundled Xid scenarios replayed on the simulated DGX-class node: a double-bit ECC Xid is
a critical memory finding naming the job on the GPU, an application Xid an info one only."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from nodescope.model.finding import Severity
from nodescope.sim.driver import replay, temp_dir
from nodescope.sim.scenario import load_scenario

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("name", "kind", "severity"),
    [
        ("xid48-double-bit-ecc", "gpu_xid_memory", Severity.CRITICAL),
        ("xid13-application-fault", "gpu_xid_application", Severity.INFO),
    ],
)
def test_bundled_xid_scenarios_replay(name: str, kind: str, severity: Severity) -> None:
    with tempfile.TemporaryDirectory(prefix="nodescope-test-", dir=temp_dir()) as d:
        result = replay(load_scenario(name), Path(d) / "root")
    assert result.passed, [m.reason for m in result.failures]
    found = [e for e in result.timeline if e.kind == "finding" and e.subject.startswith(kind)]
    assert found and f"({severity.label})" in found[0].detail
    if severity is Severity.CRITICAL:
        assert "used by job 81790" in found[0].detail
