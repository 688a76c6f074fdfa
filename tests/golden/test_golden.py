"""Golden /metrics: the full exposition for fixture roots, diffed against a committed file and
linted by ``promtool check metrics``.

The collector runs on a fake clock (two cycles one second apart, every read taking no time), so
the output is byte-for-byte repeatable. ``NODESCOPE_UPDATE_GOLDEN=1`` rewrites the files after an
intended change; review the diff before committing it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from nodescope.collect import Collector, ScheduledSource
from nodescope.roots import Roots
from nodescope.sources.registry import SOURCES
from nodescope_exporters.prometheus import render
from tests.conftest import FIXTURES, HOST_FIXTURE

GOLDEN = Path(__file__).parent

# Sources whose input is a file tree; netlink and NVML are not roots-based and are covered by
# their own tests.
TREE_SOURCES = ("pci", "disks", "infiniband", "cgroups", "pressure")


class SteppingClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def exposition_for(roots: Roots, sources: tuple[str, ...]) -> str:
    clock = SteppingClock()
    collector = Collector(
        roots=roots,
        scheduled=[ScheduledSource(SOURCES[name].make(), 1.0) for name in sources],
        clock=clock,
        wall_clock=lambda: 1_796_000_000.0 + clock.now,
    )
    try:
        collector.run_cycle(force=True)
        clock.now += 1.0
        text = render(collector.run_cycle(force=True)).decode()
    finally:
        collector.close()
    # The Python version is the only machine-dependent value.
    return re.sub(r'python="[^"]*"', 'python="X"', text)


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / f"{name}.prom"
    if os.environ.get("NODESCOPE_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with NODESCOPE_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"/metrics differs from {path.name}"
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed (scripts/test.sh installs Debian's prometheus)")
    lint = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr


def host_roots() -> Roots:
    return Roots.under(HOST_FIXTURE)


def hgx_roots(tmp: Path) -> Roots:
    from nodescope.sim.sysfs_tree import cached_hgx_h100_tree

    return Roots.under(cached_hgx_h100_tree(tmp / "hgx-h100"))


def h100_infiniband_roots(tmp: Path) -> Roots:
    return Roots.under(FIXTURES / "captures" / "h100-node-infiniband")


#: name -> (roots of the fixture, the sources that read it)
CASES: dict[str, tuple[Callable[[Path], Roots], tuple[str, ...]]] = {
    # This machine, every tree source.
    "kvm-epyc-debian12": (lambda tmp: host_roots(), TREE_SOURCES),
    # The sysfs tree built from the real 8x H100 server's lspci -vvv.
    "hgx-h100-pci": (hgx_roots, ("pci",)),
    # The real /sys/class/infiniband of an H100 node.
    "h100-node-infiniband": (h100_infiniband_roots, ("infiniband",)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_metrics(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    make_roots, sources = CASES[name]
    text = exposition_for(make_roots(tmp_path_factory.getbasetemp()), sources)
    # Every source must have worked on its fixture: a golden of failures proves nothing.
    for source in sources:
        assert f'nodescope_source_up{{source="{source}"}} 1.0' in text, source
    check_golden(name, text)
