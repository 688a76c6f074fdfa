"""The daemon never imports torch: its RSS budget is tens of MiB."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_importing_every_daemon_module_does_not_import_torch() -> None:
    code = """
import importlib, pkgutil, sys
import nodescope, nodescope_exporters
for pkg in (nodescope, nodescope_exporters):
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        if ".probe" in info.name:
            continue
        importlib.import_module(info.name)
from nodescope.cli.main import build_parser
build_parser()
bad = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print(",".join(bad))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""
