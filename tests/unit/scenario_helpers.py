"""Scenarios of the small node of ``test_scenario.small_document`` with one test's timeline
only, for the tests of one activity kind, and the scratch folder their simulated node lives
in."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nodescope.sim.node import make_temp_root
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


def load_timeline(timeline: list[dict[str, Any]], name: str) -> Scenario:
    """The small node with ``timeline`` only, read as the scenario file ``name``."""
    return load_document(timeline_document(timeline), name)


def scratch_root(prefix: str) -> Iterator[Path]:
    """A fixture's folder for a simulated node (a tmpfs when there is one), removed after the
    test."""
    root = make_temp_root(prefix)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def read_in_full(sources: list[Any]) -> list[Any]:
    """``sources`` made to read everything at every run: a test that checks what the simulator
    wrote at given times needs each read to be a full one (the daemon's cadence in a replay
    has its own test, test_replay_cadence.py)."""
    for source in sources:
        if hasattr(source, "slow_every"):
            source.slow_every = 1
    return sources
