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


def new_v2_cgroup(prefix: str) -> tuple[Path, Path]:
    """(the cgroup2 root, a new empty cgroup below it named after ``prefix``) for a test that
    moves real processes; skipped where that cannot be done."""
    import uuid

    from nodescope.roots import Roots
    from nodescope.sources.cgroup import find_v2_root

    if not is_root():
        pytest.skip("creating cgroups needs root")
    hierarchy = find_v2_root(Roots().cgroupfs)
    if hierarchy.path is None:
        pytest.skip(f"no cgroup2 mount under {Roots().cgroupfs}")
    base = hierarchy.path / f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    base.mkdir()
    return hierarchy.path, base


def remove_cgroup_tree(base: Path) -> None:
    """Remove the cgroups under ``base``, deepest first, once their tasks have left."""
    import time

    for directory, _, _ in os.walk(base, topdown=False):
        for _ in range(100):
            try:
                os.rmdir(directory)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.02)  # "populated" drops just after the last task leaves
