"""The Debian packages, built and installed into a fresh Debian 12 root (test-packages.sh).

The script does the work and fails on its own checks; this test runs it, then reads what it
left in build/pkgtest/out: the installed command's version, its snapshot, DKMS's status and
the unit's ``systemd-analyze security`` exposure, which it prints (the number CI reports).
The first run downloads the root from deb.debian.org (minutes); later runs unpack the cached
copy under build/pkgtest/cache.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "build" / "pkgtest" / "out"
MAX_EXPOSURE = 3.0
TOOLS = ("debootstrap", "dpkg-deb", "unshare", "chroot")


def _project_version() -> str:
    with (REPO / "pyproject.toml").open("rb") as f:
        version: str = tomllib.load(f)["project"]["version"]
    return version


def _exposure(text: str) -> float:
    match = re.search(r"Overall exposure level for nodescoped\.service: ([0-9.]+)", text)
    assert match is not None, text
    return float(match.group(1))


def test_exposure_parsed_from_systemd_analyze_output() -> None:
    text = "…\n→ Overall exposure level for nodescoped.service: 2.5 OK 🙂\n"
    assert _exposure(text) == 2.5


def test_packages_build_install_run_and_purge(capsys: pytest.CaptureFixture[str]) -> None:
    if os.geteuid() != 0:
        pytest.skip("packaging/test-packages.sh needs root (debootstrap, chroot, mounts)")
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (scripts/lib.sh installs them)")

    # build.sh needs a python3 with pip: the one running the tests has it.
    proc = subprocess.run(
        ["bash", "packaging/test-packages.sh"],
        cwd=REPO,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]

    version = _project_version()
    assert (OUT / "version.txt").read_text().strip() == f"nodescope {version}"

    snapshot = json.loads((OUT / "snapshot.json").read_text())
    assert snapshot["nodescope_version"] == version
    sources = snapshot["sources"]
    # Read by the installed tree from the host's /sys, /proc and rtnetlink.
    for name in ("pci", "netdev", "disks", "procs"):
        assert sources[name]["ok"], (name, sources[name]["error"])

    status = (OUT / "dkms-status.txt").read_text()
    assert re.search(r"^nvlink_counter/[0-9.]+, \S+, \S+: installed", status, re.M), status

    exposure = _exposure((OUT / "security.txt").read_text())
    with capsys.disabled():
        print(f"\nnodescoped.service exposure (systemd-analyze security): {exposure}")
    assert exposure <= MAX_EXPOSURE
    assert (OUT / "verify.txt").read_text() == ""

    # The packages test-packages.sh built and installed: what lintian says of them, and that
    # the manual pages and shell completion are in them.
    debs = sorted((REPO / "build" / "pkgtest" / "packages").glob("*.deb"))
    assert len(debs) == 2, debs
    _check_lintian(debs)
    listing = subprocess.run(
        ["dpkg", "-c", str(next(d for d in debs if d.name.startswith("nodescope_")))],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for path in (
        "./usr/share/man/man1/nodescope.1.gz",
        "./usr/share/man/man1/nodescope-check.1.gz",
        "./usr/share/bash-completion/completions/nodescope",
        "./usr/share/zsh/vendor-completions/_nodescope",
        "./usr/share/doc/nodescope/changelog.Debian.gz",
    ):
        assert path in listing, path


def _check_lintian(debs: list[Path]) -> None:
    lintian = shutil.which("lintian")
    if lintian is None:
        pytest.fail("lintian is not installed (scripts/lib.sh installs it)")
    result = subprocess.run(
        [lintian, "--fail-on", "none", *map(str, debs)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    tags = [line for line in result.stdout.splitlines() if re.match(r"^[EWIPX]: ", line)]
    errors = [t for t in tags if t.startswith("E: ")]
    assert not errors, "\n".join(errors)
    assert not [t for t in tags if "no-manual-page" in t], tags
