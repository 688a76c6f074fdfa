"""``nodescope demo --config FILE``: the demo takes the file's ``[alerts]`` and ``[detectors]``
settings and keeps its own node, listen address and tick."""

from __future__ import annotations

import dataclasses
import io
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

import nodescope.cli.demo
import nodescope.sim.driver
from nodescope.assembly import load
from nodescope.config import Config
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


#: A host's configuration: every path a daemon may write, set to the host's own.
HOST_PATHS = """\
[roots]
run = "/run"
sysfs = "/sys"
procfs = "/proc"
dev = "/dev"
cgroupfs = "/sys/fs/cgroup"

[slurm]
reports_dir = "/var/lib/nodescope/jobs"
scontrol = "/usr/bin/scontrol"

[sources.traces]
spool_dir = "/var/spool/nodescope/traces"

[alerts]
for_seconds = 3.0
"""


def absolute_paths(value: Any, where: str = "config") -> Iterator[tuple[str, str]]:
    """Every absolute path in a configuration object, with where it is."""
    if isinstance(value, Path | str):
        if str(value).startswith("/"):
            yield where, str(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from absolute_paths(getattr(value, f.name), f"{where}.{f.name}")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from absolute_paths(item, f"{where}[{key!r}]")
    elif isinstance(value, tuple | list):
        for i, item in enumerate(value):
            yield from absolute_paths(item, f"{where}[{i}]")


def test_every_path_of_the_demo_is_under_its_directory_whatever_the_file_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Config] = []
    hook_files: list[str] = []

    class RecordingService(Service):
        def __init__(self, load_config: Any, **kwargs: Any) -> None:
            config = load_config()
            seen.append(config)
            # The hooks' file is written before the daemon starts: read it while it exists.
            hook_files.append(
                (Path(config.roots.run).parent / "etc/nodescope/nodescope.toml").read_text()
            )
            super().__init__(load_config, **kwargs)

    monkeypatch.setattr(nodescope.sim.driver, "Service", RecordingService)
    path = tmp_path / "nodescope.toml"
    path.write_text(HOST_PATHS)
    out = io.StringIO()
    status = demo(
        ToyScenario(), "127.0.0.1:0", duration=1.0, tty=False, out=out, node_factory=ToyNode,
        install_signal_handlers=False, settings=load(path),
    )  # fmt: skip
    assert status == 0
    match = re.search(r"node under (\S+), serving", out.getvalue())
    assert match, out.getvalue()
    root = match[1]
    (config,) = seen
    assert config.alerts.for_seconds == 3.0  # the file's [alerts] is taken
    paths = dict(absolute_paths(config))
    assert "config.slurm.reports_dir" in paths and "config.roots.run" in paths
    outside = {k: v for k, v in paths.items() if not v.startswith(f"{root}/")}
    assert not outside, outside
    assert config.slurm.reports_dir == f"{root}/var/lib/nodescope/jobs"
    # Neither the daemon nor a hook asking it drains the host's node.
    assert config.slurm.scontrol == ""
    # The hooks' file is the demo's roots, reports directory and no scontrol, as
    # config.load reads it.
    hook_config = tmp_path / "hooks.toml"
    hook_config.write_text(hook_files[0])
    hooks = load(hook_config)
    assert (hooks.roots, hooks.slurm) == (config.roots, config.slurm)
    assert f"--config {root}/etc/nodescope/nodescope.toml" in out.getvalue()
    assert not Path(root).exists()  # removed on the way out
