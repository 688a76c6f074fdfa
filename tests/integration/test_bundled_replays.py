"""Every bundled scenario replayed on the simulated node, each a DGX-class node with
thousands of files and series (a minute of one core for them all): each passes the
expectations it states, every source stays up, and the Xid 79 scenario's timeline shows the
GPU falling off the bus when it does.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from nodescope.sim.driver import replay, replay_document

# The scenarios bundled, which tests/unit/test_scenario.py holds to what the package ships.
from tests.unit.test_scenario import BUNDLED

pytestmark = pytest.mark.integration


def _replay_bundled(name: str) -> dict[str, Any]:
    """One bundled scenario through ``replay`` (runs in a worker process); an exception comes
    back as ``{"error": traceback}`` so one broken scenario does not hide the others."""
    import tempfile
    import traceback

    from nodescope.sim.driver import temp_dir
    from nodescope.sim.scenario import load_scenario

    try:
        with tempfile.TemporaryDirectory(prefix="nodescope-test-", dir=temp_dir()) as d:
            return replay_document(replay(load_scenario(name), Path(d) / "root"))
    except Exception:
        return {"error": traceback.format_exc()}


@pytest.fixture(scope="module")
def bundled_results() -> dict[str, dict[str, Any]]:
    """Every bundled scenario replayed once, in parallel: each is a DGX-class node with
    thousands of series per cycle, a few seconds apiece."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    workers = max(1, min(len(BUNDLED), os.cpu_count() or 1))
    # spawn: the workers must not inherit the threads (NVML Xid watchers) of earlier tests.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        return dict(zip(BUNDLED, pool.map(_replay_bundled, BUNDLED), strict=True))


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_scenario_passes_replay(name: str, bundled_results: dict[str, Any]) -> None:
    doc = bundled_results[name]
    assert "error" not in doc, doc.get("error")
    metrics = doc["expectations"]["metrics"]
    failed = [
        f"{m['pointer']} {m['expectation']}: {m['reason']}"
        for m in metrics
        if m["status"] != "pass"
    ]
    assert doc["summary"]["passed"], "\n".join(failed)
    assert metrics, "a bundled scenario must state what the daemon shows"
    assert all(m["cycles_evaluated"] > 0 for m in metrics)
    # The daemon's cycle every second of its own tick, whatever the scenario's scrapes.
    assert doc["cycles"] == int(doc["duration_seconds"] / doc["daemon_tick_seconds"]) + 1
    # Every source of the node stays up on a healthy run of the simulator.
    assert not [e for e in doc["timeline"] if e["kind"] == "source_down"], doc["timeline"]


def test_xid79_timeline_shows_the_gpu_falling_off_the_bus(
    bundled_results: dict[str, Any],
) -> None:
    timeline = bundled_results["xid79-fell-off-bus"]["timeline"]
    events = [e for e in timeline if e["kind"] in ("gpu_lost", "xid")]
    # The nvlink_counter module stops reading the 18 links of the GPU that went away: one
    # finding for the device, not one per link (18 alerts for one GPU is a storm).
    gone = [e for e in timeline if e["subject"].startswith("nvlink_counter_device_gone")]
    assert {e["subject"] for e in gone} == {"nvlink_counter_device_gone{device=5}"}
    assert [(e["kind"], e["subject"]) for e in events] == [
        ("gpu_lost", "gpu 5 (0000:bb:00.0)"),
        ("xid", "gpu 5 (0000:bb:00.0)"),
    ]
    lost, xid = events
    assert lost["t"] == 20  # the next NVML call on the GPU says so
    # Xid events reach the NVML source on its own thread, as on a real node: the count can
    # land in the cycle after the one that injected it.
    assert 20 <= xid["t"] <= 21
    assert xid["detail"] == "Xid 79 (GPU has fallen off the bus) x1"


def test_every_finding_of_the_bundled_replays_has_a_spec(bundled_results: dict[str, Any]) -> None:
    """What the detectors made on the whole bundled corpus, against the kinds' specs: a kind
    no spec declares, or a severity its spec does not list, fails here."""
    from nodescope.detectors.registry import KINDS
    from nodescope.model.finding import Severity

    seen = 0
    for name, doc in bundled_results.items():
        for event in doc.get("timeline", ()):
            if event["kind"] != "finding":
                continue
            kind = event["subject"].split("{", 1)[0]
            severity = event["detail"][1:].split(")", 1)[0]
            spec = KINDS.get(kind)
            assert spec is not None, f"{name}: {kind} has no spec"
            assert Severity[severity.upper()] in spec.severities, f"{name}: {kind} {severity}"
            seen += 1
    assert seen > 50
