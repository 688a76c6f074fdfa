"""Scenarios of the small node of ``test_scenario.small_document`` with one test's timeline
only, for the tests of one activity kind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nodescope.sim.scenario import Scenario, ScenarioLoader
from tests.unit.test_scenario import small_document

_LOADER = ScenarioLoader()


def timeline_document(timeline: list[dict[str, Any]]) -> dict[str, Any]:
    """The small node with ``timeline`` only, idle but where the timeline says otherwise."""
    doc = small_document()
    doc.pop("expect")
    doc["timeline"] = timeline
    return doc


def load_document(document: dict[str, Any], name: str) -> Scenario:
    """``document`` read as the scenario file ``name`` would be."""
    return _LOADER.parse(document, Path(name))
