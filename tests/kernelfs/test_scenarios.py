"""Every bundled scenario replayed with the daemon's sources reading the simulated node through
the kernel-semantics mount: the node writes its tree as plain files into a backing directory,
the collector reads it where procfs tables come a page per read and report size 0 and sysfs
attributes report 4096, and every expectation of the scenario must still hold."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from nodescope.model.snapshot import Snapshot
from nodescope.roots import Roots
from nodescope.sim.driver import NodeLike, replay, replay_text
from nodescope.sim.node import SimulatedNode
from nodescope.sim.scenario import bundled_scenarios, load_scenario
from nodescope.sources.cgroup import CgroupTree
from tests.kernelfs.conftest import MountTree

pytestmark = pytest.mark.integration

#: How long the kernel may keep names and attributes it looked up. Uncached, every step of
#: every path walk and every fstat is a request to the server, and a replay walks the same
#: paths every cycle: about 4 s a cycle instead of 0.8 s on a 2-core machine. Reads are
#: never cached (direct_io) and directories are listed afresh each time, so the content the
#: sources parse and the files they find are always the node's present ones.
CACHE_S = 600.0


class ReadThroughMount:
    """A simulated node that writes under its own root and hands the daemon ``roots``
    through the mount; everything else is the node's."""

    def __init__(self, node: SimulatedNode, roots: Roots) -> None:
        self._node = node
        self.roots = roots

    def __getattr__(self, name: str) -> Any:
        return getattr(self._node, name)


@pytest.mark.parametrize("name", bundled_scenarios())
def test_scenario_passes_over_kernel_semantics(
    name: str, tmp_path: Path, mount_kernelfs: MountTree
):
    backing = tmp_path / "node"
    backing.mkdir()
    mount = mount_kernelfs(backing, entry_timeout=CACHE_S, attr_timeout=CACHE_S)

    def node_factory(scenario: Any, root: Path) -> NodeLike:
        node: NodeLike = ReadThroughMount(SimulatedNode(scenario, root), mount.roots())
        return node

    cgroup_roots: list[str | None] = []

    def on_cycle(t: float, snapshot: Snapshot, body: bytes) -> None:
        tree = snapshot.data("cgroups", CgroupTree)
        cgroup_roots.append(None if tree is None else tree.root)

    started = time.monotonic()
    result = replay(load_scenario(name), backing, node_factory=node_factory, on_cycle=on_cycle)
    elapsed = time.monotonic() - started

    assert result.passed, replay_text(result)
    # The sources read the mount, not the backing directory beside it.
    seen = {root for root in cgroup_roots if root is not None}
    assert seen and all(root.startswith(str(mount.mountpoint)) for root in seen), seen
    print(f"{name}: {result.cycles} cycles over kernelfs in {elapsed:.1f} s")
