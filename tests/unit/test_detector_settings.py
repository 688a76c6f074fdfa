"""Each detector receives its own typed settings: the registry picks them out of the whole
configuration, and no detector module reads ``Config``."""

from __future__ import annotations

import ast
import inspect
import typing
from collections.abc import Callable
from pathlib import Path

from nodescope.assembly import default_config, from_mapping
from nodescope.config import Config, HangsSettings
from nodescope.detectors import hangs
from nodescope.detectors.registry import (
    DETECTORS,
    Configured,
    contention_inputs,
    gpu_health_inputs,
    saturation_inputs,
)
from nodescope.model.finding import Finding
from nodescope.model.snapshot import Snapshot
from tests.conftest import REPO

DETECTORS_DIR = REPO / "daemon" / "nodescope" / "detectors"


def _settings_type(detect: Callable[..., object]) -> object:
    """The annotated type of a detector's third parameter (``self`` left out)."""
    target = detect if inspect.isfunction(detect) else type(detect).__call__
    hints = typing.get_type_hints(target)
    names = [p for p in inspect.signature(target).parameters if p != "self"]
    return hints[names[2]]


def test_every_registered_detector_takes_typed_settings_not_the_config() -> None:
    assert len(DETECTORS) >= 12
    for info in DETECTORS:
        assert isinstance(info.detect, Configured), info.name
        settings = _settings_type(info.detect.detect)
        assert settings is not Config, f"{info.name} still takes the whole Config"
        # What the registry picks for it is of that type.
        picked = info.detect.settings(default_config())
        if settings is type(None):
            assert picked is None
        else:
            assert isinstance(settings, type)
            assert isinstance(picked, settings), (info.name, settings, type(picked))


def test_no_detector_module_imports_the_config_class() -> None:
    offenders = []
    for path in sorted(DETECTORS_DIR.glob("*.py")):
        if path.name == "registry.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == "nodescope.config"
                and any(alias.name == "Config" for alias in node.names)
            ):
                offenders.append(path.name)
    assert offenders == []


def test_the_registry_hands_each_call_the_configuration_of_that_call() -> None:
    seen: list[HangsSettings] = []

    def detect(
        previous: Snapshot | None, snapshot: Snapshot, settings: HangsSettings
    ) -> list[Finding]:
        seen.append(settings)
        return []

    bound = Configured(detect, lambda c: c.detectors.hangs)
    reloaded = from_mapping({"detectors": {"hangs": {"min_stall_seconds": 7}}})
    bound(None, Snapshot(0, 0.0, 0.0), default_config())
    bound(None, Snapshot(1, 1.0, 1.0), reloaded)
    assert [s.min_stall_seconds for s in seen] == [20.0, 7.0]
    off = from_mapping({"detectors": {"hangs": {"enabled": False}}})
    registered = next(d for d in DETECTORS if d.name == "hangs").detect
    assert list(registered(None, Snapshot(0, 0.0, 0.0), off)) == []
    assert isinstance(registered, Configured) and registered.detect is hangs.detect


def test_what_a_detector_reads_besides_its_table_follows_the_configuration() -> None:
    # The keep band of the contention and saturation rules, as [alerts.rules] sets it.
    cfg = from_mapping(
        {"alerts": {"rules": {"pcie_contention": {"clear_below": 0.4}, "pcie_saturation": {}}}}
    )
    assert contention_inputs(default_config()).keep_below == 0.5
    assert contention_inputs(cfg).keep_below == 0.4
    assert saturation_inputs(default_config()).keep_below == 0.9
    assert (
        saturation_inputs(default_config()).models == default_config().detectors.saturation_models
    )
    # The nvml source's interval: the held times of the GPU health findings count in it.
    slow = from_mapping({"sources": {"nvml": {"interval_seconds": 5}}})
    assert gpu_health_inputs(default_config()).nvml_interval_seconds == 1.0
    assert gpu_health_inputs(slow).nvml_interval_seconds == 5.0


def test_the_detector_files_are_all_listed() -> None:
    modules = {p.stem for p in Path(DETECTORS_DIR).glob("*.py")} - {
        "__init__",
        "common",
        "kinds",
        "registry",
    }
    bound = [info.detect for info in DETECTORS if isinstance(info.detect, Configured)]
    registered = {b.detect.__module__.rsplit(".", 1)[1] for b in bound}
    assert modules == registered
