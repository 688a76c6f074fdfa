"""``nodescope demo --config FILE``: the demo takes the file's ``[alerts]`` and ``[detectors]``
settings and keeps its own node, listen address and tick."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

import nodescope.cli.demo
import nodescope.sim.driver
from nodescope.config import Config, load
from nodescope.roots import Roots
from nodescope.service import Service
from nodescope.sim.driver import demo
from tests.unit.test_replay import ToyNode, ToyScenario

SETTINGS = """\
[daemon]
listen = "0.0.0.0:1"
tick_seconds = 7.0

[alerts]
for_seconds = 11.0

[alerts.rules.pcie_contention]
for_seconds = 5.0
resolve_after_seconds = 4.0

[detectors.contention]
utilisation_ratio = 0.75
"""


def test_the_demo_runs_with_the_alerts_and_detectors_of_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Config] = []

    class RecordingService(Service):
        def __init__(self, load_config: Any, **kwargs: Any) -> None:
            seen.append(load_config())
            super().__init__(load_config, **kwargs)

    monkeypatch.setattr(nodescope.sim.driver, "Service", RecordingService)
    path = tmp_path / "nodescope.toml"
    path.write_text(SETTINGS)
    status = demo(
        ToyScenario(),
        "127.0.0.1:0",
        duration=1.0,
        tty=False,
        out=io.StringIO(),
        node_factory=ToyNode,
        install_signal_handlers=False,
        settings=load(path),
    )
    assert status == 0
    (config,) = seen
    assert config.alerts.for_seconds == 11.0
    rule = config.alerts.rules["pcie_contention"]
    assert (rule.for_seconds, rule.resolve_after_seconds) == (5.0, 4.0)
    assert config.detectors.contention.utilisation_ratio == 0.75
    # The demo's own: the file's [daemon] table does not move the server or the tick.
    assert (config.listen, config.tick_seconds) == ("127.0.0.1:0", 1.0)
    assert config.roots != Roots()  # the simulated node's


def test_the_cli_hands_the_file_to_the_demo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nodescope.cli.main import main

    calls: list[dict[str, Any]] = []

    def fake_demo(*args: Any, **kwargs: Any) -> int:
        calls.append(kwargs)
        return 0

    import nodescope.sim.driver

    monkeypatch.setattr(nodescope.sim.driver, "demo", fake_demo)
    path = tmp_path / "nodescope.toml"
    path.write_text(SETTINGS)
    assert main(["demo", "--no-tty", "--config", str(path)]) == 0
    assert calls[0]["settings"].alerts.rules["pcie_contention"].for_seconds == 5.0
    assert main(["demo", "--no-tty"]) == 0
    assert calls[1]["settings"] is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[alerts]\nfor_seconds = -1.0\n", "alerts.for_seconds"),
        ("[alerts.rules.pcie_contention]\nfor = 5\n", "alerts.rules.pcie_contention.for"),
        ("not toml [", "not valid TOML"),
    ],
)
def test_a_bad_config_is_refused_before_starting(
    tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from nodescope.cli.main import main

    path = tmp_path / "nodescope.toml"
    path.write_text(text)
    assert main(["demo", "--no-tty", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nodescope demo: ") and message in err
    assert main(["demo", "--no-tty", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "cannot read" in capsys.readouterr().err
