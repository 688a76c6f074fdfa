"""Every bundled scenario replayed with the daemon's sources reading the simulated node through
the kernel-semantics mount: the node writes its tree as plain files into a backing directory,
the collector reads it where procfs tables come a page per read and report size 0 and sysfs
attributes report 4096, and every expectation of the scenario must still hold.

A replay through the mount is bound by the round trip of each read to the FUSE server, not by
either process's work: each scenario is a test of its own, with its own mount and server, so
that parallel test workers (scripts/test.sh) replay several at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from nodescope.model.cgroup import CGROUPS
from nodescope.model.snapshot import Snapshot
from nodescope.roots import Roots
from nodescope.sim.driver import NodeLike, replay, replay_text
from nodescope.sim.node import SimulatedNode
from nodescope.sim.scenario import bundled_scenarios, load_scenario
from tests.kernelfs.mount import fuse_unavailable_reason, kernelfs

pytestmark = pytest.mark.integration

#: How long the kernel may keep names and attributes it looked up. Uncached, every step of
#: every path walk and every fstat is a request to the server, and a replay walks the same
#: paths every cycle: several times slower. Reads are never cached (direct_io) and
#: directories are listed afresh each time, so the content the sources parse and the files
#: they find are always the node's present ones.
CACHE_S = 600.0


class ReadThroughMount:
    """A simulated node that writes under its own root and hands the daemon ``roots``
    through the mount; everything else is the node's."""

    def __init__(self, node: SimulatedNode, roots: Roots) -> None:
        self._node = node
        self.roots = roots

    def __getattr__(self, name: str) -> Any:
        return getattr(self._node, name)


@dataclass(frozen=True)
class Outcome:
    name: str
    passed: bool
    report: str
    cycles: int
    elapsed_s: float
    #: The cgroup roots the sources reported: under the mount, or the replay read beside it.
    cgroup_roots: frozenset[str]
    mountpoint: str


def replay_over_kernelfs(name: str, workdir: str) -> Outcome:
    """Replay the bundled scenario ``name`` on a node under ``workdir`` read through a
    kernel-semantics mount."""
    backing = Path(workdir) / name / "node"
    backing.mkdir(parents=True)
    with kernelfs(
        backing, backing.parent / "mnt", entry_timeout=CACHE_S, attr_timeout=CACHE_S
    ) as mount:

        def node_factory(scenario: Any, root: Path) -> NodeLike:
            node: NodeLike = ReadThroughMount(SimulatedNode(scenario, root), mount.roots())
            return node

        cgroup_roots: set[str] = set()

        def on_cycle(t: float, snapshot: Snapshot, body: bytes) -> None:
            tree = snapshot.latest(CGROUPS)
            if tree is not None and tree.root is not None:
                cgroup_roots.add(tree.root)

        started = time.monotonic()
        result = replay(load_scenario(name), backing, node_factory=node_factory, on_cycle=on_cycle)
        return Outcome(
            name=name,
            passed=result.passed,
            report=replay_text(result),
            cycles=result.cycles,
            elapsed_s=time.monotonic() - started,
            cgroup_roots=frozenset(cgroup_roots),
            mountpoint=str(mount.mountpoint),
        )


@pytest.mark.parametrize("name", bundled_scenarios())  # shared out one by one: ONE_BY_ONE
def test_bundled_scenario_passes_over_kernel_semantics(name: str, tmp_path: Path) -> None:
    reason = fuse_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    outcome = replay_over_kernelfs(name, str(tmp_path))
    print(f"{outcome.name}: {outcome.cycles} cycles over kernelfs in {outcome.elapsed_s:.1f} s")
    assert outcome.passed, outcome.report
    # The sources read the mount, not the backing directory beside it.
    assert outcome.cgroup_roots, outcome.name
    assert all(r.startswith(outcome.mountpoint) for r in outcome.cgroup_roots), outcome
