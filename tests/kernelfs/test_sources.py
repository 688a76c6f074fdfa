"""Every source that reads files, over the bundled fixture trees and a simulated node's tree
with inputs many pages long, served once as plain files and once with kernel read semantics:
the records must be identical.

A source that stops after the first page of a table, trusts ``st_size``, or reads a sysfs
attribute past its first read would read something else through the mount than from the
plain files, and the records would differ.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from nodescope.roots import Roots
from nodescope.sources.base import Source
from nodescope.sources.cgroup import CgroupTree
from nodescope.sources.link_events import LinkEventsSource
from nodescope.sources.locks import LocksData
from nodescope.sources.mountstats import MountstatsData
from nodescope.sources.registry import SOURCE_TABLE, SOURCES
from nodescope.sources.spec import FILES
from nodescope.sources.udev import UdevSource
from tests.conftest import FIXTURES
from tests.kernelfs.conftest import MountTree
from tests.kernelfs.server import PAGE

#: Sources that read no file tree, and what they read instead (their specs' ``reads``).
NOT_FROM_FILES = {spec.name: spec.reads for spec in SOURCE_TABLE if spec.reads != FILES}
#: How many runs each source gets: the second goes through the memos the first filled.
RUNS = 2


def file_sources() -> list[Source]:
    """A fresh instance of every source that reads files; the event sources without their
    monitors (as the simulated node runs them), so they read only the trees."""
    sources: list[Source] = []
    for name in SOURCES:
        if name in NOT_FROM_FILES:
            continue
        if name == "udev":
            sources.append(UdevSource(monitor=None))
        elif name == "link_events":
            sources.append(LinkEventsSource(netlink=False))
        else:
            sources.append(SOURCES[name].make())
    return sources


def test_every_source_of_the_registry_is_compared_or_named_as_not_reading_files():
    compared = {s.name for s in file_sources()}
    assert compared | set(NOT_FROM_FILES) == set(SOURCES)
    assert not compared & set(NOT_FROM_FILES)


def collect_all(roots: Roots, mountpoint: Path, backing: Path) -> dict[str, list[str]]:
    """Each source's records (or its error) per run, as text with the root's path replaced
    by ``backing``'s so that both sides read alike."""
    seen: dict[str, list[str]] = {}
    for source in file_sources():
        runs = []
        try:
            for _ in range(RUNS):
                try:
                    record: Any = source.collect(roots)
                    runs.append(repr(record))
                except Exception as exc:
                    runs.append(f"{type(exc).__name__}: {exc}")
        finally:
            source.close()
        seen[source.name] = [r.replace(str(mountpoint), str(backing)) for r in runs]
    return seen


def compare(backing: Path, mount_kernelfs: MountTree) -> dict[str, list[str]]:
    """The records over the plain tree, after checking that the mount gives the same."""
    mount = mount_kernelfs(backing)
    plain = collect_all(Roots.under(backing), backing, backing)
    served = collect_all(mount.roots(), mount.mountpoint, backing)
    differing = [name for name in plain if plain[name] != served[name]]
    assert not differing, "\n".join(
        f"{name}:\n  plain: {plain[name][0][:600]}\n  kernel: {served[name][0][:600]}"
        for name in differing
    )
    return plain


FIXTURE_TREES = sorted(
    path
    for group in ("hosts", "captures")
    for path in (FIXTURES / group).iterdir()
    if (path / "sys").is_dir() or (path / "proc").is_dir()
)


@pytest.mark.parametrize("tree", FIXTURE_TREES, ids=lambda p: p.name)
def test_fixture_trees_read_the_same_with_kernel_semantics(tree: Path, mount_kernelfs: MountTree):
    plain = compare(tree, mount_kernelfs)
    # Not a comparison of two failures: some source read records from this tree.
    assert any(not re.match(r"\w+(Error|Exception): ", runs[0]) for runs in plain.values())


# --- a simulated node with inputs many pages long ---------------------------------------------

LOCKS = 5_000
THREADS = 20_000
NFS_MOUNTS = 50


def simulated_tree(root: Path) -> Path:
    from nodescope.sim.node import SimulatedNode
    from nodescope.sim.scenario import load_scenario

    node = SimulatedNode(load_scenario("allreduce-hang-nfs-lock"), root)
    node.materialise()
    node.advance_to(20.0)
    close = getattr(node, "close", None)
    if callable(close):
        close()
    return root


def add_locks(procfs: Path) -> None:
    locks = procfs / "locks"
    text = locks.read_text()
    first = 1 + max((int(line.split(":", 1)[0]) for line in text.splitlines()), default=0)
    locks.write_text(
        text
        + "".join(
            f"{first + i}: POSIX  ADVISORY  READ {200_000 + i} 08:02:{3_000_000 + i} 0 EOF\n"
            for i in range(LOCKS)
        )
    )


def add_nfs_mounts(procfs: Path) -> None:
    """Copies of the node's first NFS mount under other mount points in the daemon's
    ``mountstats``: each is a few KiB, most of a page."""
    mountstats = (procfs / "self" / "mountstats").resolve()
    text = mountstats.read_text()
    blocks = re.split(r"(?m)^(?=device )", text)
    nfs = next(b for b in blocks if " with fstype nfs" in b and "\n\t" in b)
    heading = re.match(r"device (\S+) mounted on (\S+) ", nfs)
    assert heading is not None
    copies = [
        nfs.replace(f" mounted on {heading[2]} ", f" mounted on {heading[2]}-copy{i} ", 1)
        for i in range(NFS_MOUNTS)
    ]
    mountstats.write_text(text + "".join(copies))


def add_threads(cgroupfs: Path) -> Path:
    """Tids in the cgroup of a Slurm job with the most threads; returns that cgroup."""
    lists = [
        p
        for p in cgroupfs.rglob("cgroup.threads")
        if "job_" in str(p.relative_to(cgroupfs)) and p.read_text().strip()
    ]
    job = max(lists, key=lambda p: len(p.read_text().split()))
    job.write_text(job.read_text() + "".join(f"{4_000_000 - i}\n" for i in range(THREADS)))
    return job.parent


def test_a_simulated_node_with_many_page_inputs_reads_the_same(
    tmp_path: Path, mount_kernelfs: MountTree
):
    backing = simulated_tree(tmp_path / "node")
    roots = Roots.under(backing)
    add_locks(roots.procfs)
    add_nfs_mounts(roots.procfs)
    job = add_threads(roots.cgroupfs)
    assert (roots.procfs / "locks").stat().st_size > 50 * PAGE

    plain = compare(backing, mount_kernelfs)

    # The large inputs were read whole (on both sides, since they are equal).
    for name in ("locks", "mountstats", "cgroups"):
        assert not re.match(r"\w+(Error|Exception): ", plain[name][0]), plain[name][0][:300]
    locks = SOURCES["locks"].make().collect(roots)
    assert isinstance(locks, LocksData)
    assert sum(count for _, count in locks.counts) >= LOCKS
    mountstats = SOURCES["mountstats"].make().collect(roots)
    assert isinstance(mountstats, MountstatsData)
    assert len(mountstats.mounts) >= NFS_MOUNTS
    tree = SOURCES["cgroups"].make().collect(roots)
    assert isinstance(tree, CgroupTree)
    path = "/" + str(job.relative_to(roots.cgroupfs))
    counted = next(c for c in tree.cgroups if c.path == path)
    assert counted.nr_threads is not None and counted.nr_threads >= THREADS
