"""``[remediation]`` in the configuration file: defaults, rules per kind, and refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodescope import assembly
from nodescope.errors import ConfigError


def test_defaults() -> None:
    settings = assembly.default_config().remediation
    assert (settings.critical, settings.warning, settings.info) == ("drain", "alert", "none")
    assert not settings.dry_run and settings.rules == {}


def test_a_file_with_rules(tmp_path: Path) -> None:
    path = tmp_path / "n.toml"
    path.write_text(
        "[remediation]\ndry_run = true\ncooldown_seconds = 0\nmax_drained_share = 0.5\n"
        '[remediation.rules.ib_port_flapping]\nwarning = "drain_requeue"\n'
    )
    settings = assembly.load(path).remediation
    assert settings.dry_run and settings.cooldown_seconds == 0.0
    assert settings.max_drained_share == 0.5
    rule = settings.rules["ib_port_flapping"]
    assert rule.warning == "drain_requeue" and rule.critical is None


@pytest.mark.parametrize(
    ("table", "where"),
    [
        ({"critical": "reboot"}, "remediation.critical"),
        ({"max_drained_share": 0}, "remediation.max_drained_share"),
        ({"max_drained_share": 1.5}, "remediation.max_drained_share"),
        ({"cooldown_seconds": -1}, "remediation.cooldown_seconds"),
        ({"dry_run": "yes"}, "remediation.dry_run"),
        ({"rules": {"Bad-Kind": {}}}, "remediation.rules.Bad-Kind"),
        ({"rules": {"k": {"warning": "drian"}}}, "remediation.rules.k.warning"),
        ({"rules": {"k": {"severe": "drain"}}}, "remediation.rules.k.severe"),
        ({"rules": "drain"}, "remediation.rules"),
        ({"surprise": 1}, "remediation.surprise"),
    ],
)
def test_refusals_name_the_key(table: dict[str, object], where: str) -> None:
    with pytest.raises(ConfigError, match=where.replace(".", r"\.")):
        assembly.from_mapping({"remediation": table})
