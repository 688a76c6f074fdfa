"""Shared fixtures: paths of the fixture trees and a helper to run the CLI."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
HOST_FIXTURE = FIXTURES / "hosts" / "kvm-epyc-debian12"


@pytest.fixture
def host_fixture() -> Path:
    return HOST_FIXTURE


def nodescope_command() -> list[str]:
    """The installed console script next to the interpreter running the tests."""
    script = Path(sys.executable).with_name("nodescope")
    return [str(script)] if script.exists() else [sys.executable, "-m", "nodescope.cli.main"]


def is_root() -> bool:
    return os.geteuid() == 0
