"""The rpm spec builds with rpmbuild and rpmlint accepts the packages (0 errors)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.conftest import REPO


def test_rpm_builds_and_rpmlint_reports_no_errors() -> None:
    missing = [tool for tool in ("rpmbuild", "rpmlint") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed (scripts/test.sh installs rpm, rpmlint)")
    proc = subprocess.run(
        ["bash", str(REPO / "packaging" / "rpm" / "build.sh")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    summary = re.search(r"(\d+) packages and \d+ specfiles checked; (\d+) errors", output)
    assert summary is not None, output[-4000:]
    assert summary.group(1) == "2"
    assert summary.group(2) == "0"
    print(summary.group(0))
