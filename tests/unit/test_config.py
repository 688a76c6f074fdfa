from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope import config
from nodescope.errors import ConfigError
from tests.conftest import nodescope_command


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "nodescope.toml"
    path.write_text(text)
    return path


def test_defaults_without_a_file() -> None:
    cfg = config.Config()
    assert cfg.listen_address == ("127.0.0.1", config.DEFAULT_PORT)
    assert cfg.sources["disks"].enabled
    assert str(cfg.roots.sysfs) == "/sys"


def test_full_file_is_applied(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[daemon]
listen = "[::1]:9100"
tick_seconds = 2
log_level = "debug"
[roots]
sysfs = "/srv/fixture/sys"
[sources.disks]
interval_seconds = 0.5
[sources.pci]
enabled = false
""",
    )
    cfg = config.load(path)
    assert cfg.listen_address == ("::1", 9100)
    assert cfg.tick_seconds == 2.0
    assert str(cfg.roots.sysfs) == "/srv/fixture/sys"
    assert str(cfg.roots.procfs) == "/proc"
    assert cfg.sources["disks"].interval_seconds == 0.5
    assert not cfg.sources["pci"].enabled
    assert cfg.path == str(path)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[daemon]\nlisten_addr = '1'\n", "daemon.listen_addr"),
        ("[daemon]\ntick_seconds = 0\n", "daemon.tick_seconds"),
        ("[daemon]\ntick_seconds = 'fast'\n", "daemon.tick_seconds"),
        ("[daemon]\nlisten = 'nohost'\n", "daemon.listen"),
        ("[daemon]\nlisten = '127.0.0.1:99999'\n", "daemon.listen"),
        ("[daemon]\nlog_level = 'loud'\n", "daemon.log_level"),
        ("[roots]\nsysfs = 'relative'\n", "roots.sysfs"),
        ("[roots]\nbogus = '/x'\n", "roots.bogus"),
        ("[sources.gpu_magic]\nenabled = true\n", "sources.gpu_magic"),
        ("[sources.disks]\nenabled = 1\n", "sources.disks.enabled"),
        ("[sources.disks]\ninterval_seconds = -1\n", "sources.disks.interval_seconds"),
        ("[extras]\n", "extras"),
    ],
)
def test_bad_key_or_value_names_key_and_file(tmp_path: Path, text: str, key: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        config.load(path)
    assert info.value.key == key
    assert str(path) in str(info.value)
    assert key in str(info.value)


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[daemon\n")
    with pytest.raises(ConfigError, match="not valid TOML") as info:
        config.load(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        config.load(tmp_path / "absent.toml")


@pytest.mark.parametrize("command", ["run", "snapshot"])
def test_cli_exits_2_on_a_bad_config(tmp_path: Path, command: str) -> None:
    path = write(tmp_path, "[daemon]\nunknown = 1\n")
    proc = subprocess.run(
        [*nodescope_command(), command, "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "daemon.unknown" in proc.stderr
    assert str(path) in proc.stderr


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["daemon", "roots", "sources", "other"]),
        st.dictionaries(
            st.text(max_size=12),
            st.one_of(st.integers(), st.floats(), st.text(max_size=8), st.booleans(), st.none()),
            max_size=4,
        ),
        max_size=3,
    )
)
def test_arbitrary_documents_are_either_valid_or_config_errors(doc: dict[str, object]) -> None:
    try:
        cfg = config.from_mapping(doc, "fuzz.toml")
    except ConfigError as exc:
        assert "fuzz.toml" in str(exc)
    else:
        assert cfg.tick_seconds > 0


def test_reference_lists_every_option() -> None:
    ref = config.reference_markdown()
    for option in config.DAEMON_OPTIONS:
        assert f"`daemon.{option.key}`" in ref
    assert "`sources.disks.interval_seconds`" in ref
