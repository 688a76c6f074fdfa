"""The cgroup source on this machine's real cgroup2 mount.

Creates cgroups under the v2 root (``/sys/fs/cgroup/unified`` on a hybrid host), moves a real
process and a single thread into them, and checks what the walk and ``/proc/<pid>/cgroup``
report. Needs root and a cgroup2 mount; skips with the reason otherwise. Every cgroup made here
is removed in teardown, after its processes are moved back to the v2 root, even when a test
fails.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nodescope.roots import Roots
from nodescope.sources.base import read_optional
from nodescope.sources.cgroup import make_source, read_proc_cgroup
from tests.conftest import new_v2_cgroup, remove_cgroup_tree

pytestmark = pytest.mark.integration

# A process with one extra thread that reports the thread's id and then waits.
_THREADED_CHILD = """
import threading, time
def worker():
    print(threading.get_native_id(), flush=True)
    time.sleep(120)
threading.Thread(target=worker, daemon=True).start()
time.sleep(120)
"""


@dataclass
class Scratch:
    """Cgroups and processes made by one test."""

    v2_root: Path
    base: Path
    processes: list[subprocess.Popen[str]] = field(default_factory=list)
    #: cgroup v1 directories made beside the v2 ones (a hybrid host's memory controller)
    v1_dirs: list[Path] = field(default_factory=list)

    def rel(self, directory: Path) -> str:
        return "/" + str(directory.relative_to(self.v2_root))

    def spawn(self, argv: list[str]) -> subprocess.Popen[str]:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        self.processes.append(proc)
        return proc


def _evacuate(scratch: Scratch) -> None:
    """Move every task found under ``base`` back to the v2 root. Writing any id of a process
    to ``cgroup.procs`` moves the whole process, so the thread lists (readable in threaded
    cgroups too) name everything that has to go."""
    for directory, _, _ in os.walk(scratch.base, topdown=False):
        text = read_optional(Path(directory) / "cgroup.threads") or ""
        for tid in text.split():
            with contextlib.suppress(OSError):  # the task may have exited meanwhile
                (scratch.v2_root / "cgroup.procs").write_text(tid)


@pytest.fixture
def scratch() -> Iterator[Scratch]:
    v2_root, base = new_v2_cgroup("nodescope-test")
    s = Scratch(v2_root, base)
    try:
        yield s
    finally:
        _evacuate(s)
        for proc in s.processes:
            proc.kill()
            proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()
        remove_cgroup_tree(base)
        for directory in s.v1_dirs:
            remove_cgroup_tree(directory)
        assert not base.exists(), f"{base} left behind"


def test_walk_sees_a_process_moved_into_a_new_cgroup(scratch: Scratch) -> None:
    leaf = scratch.base / "leaf"
    leaf.mkdir()
    proc = scratch.spawn(["sleep", "120"])
    (leaf / "cgroup.procs").write_text(str(proc.pid))

    tree = make_source(keep_pids=True).collect(Roots())
    assert tree.mode in ("unified", "hybrid")
    node = tree.get(scratch.rel(leaf))
    assert node is not None, f"{leaf} not found by the walk"
    assert node.depth == 2
    assert node.type == "domain"
    assert node.nr_procs == 1
    assert node.procs == (proc.pid,)
    assert node.nr_threads == 1
    assert node.events is not None and node.events.populated is True
    assert node.cpu_stat is not None and node.cpu_stat.usage_usec is not None

    parent = tree.get(scratch.rel(scratch.base))
    assert parent is not None
    assert parent.nr_procs == 0  # members of a child are not members of the parent
    assert parent.nr_children == 1

    seen = read_proc_cgroup(Roots(), proc.pid)
    assert seen is not None and seen.v2_path == scratch.rel(leaf)

    # Without keep_pids only the counts are kept.
    counted = make_source().collect(Roots()).get(scratch.rel(leaf))
    assert counted is not None and counted.nr_procs == 1 and counted.procs is None


def test_walk_sees_one_thread_in_a_threaded_cgroup(scratch: Scratch) -> None:
    domain = scratch.base / "domain"
    workers = domain / "workers"
    domain.mkdir()
    workers.mkdir()
    # cgroup-v2.rst "Threads": a child turned threaded makes its parent the threaded domain
    # whose subtree threads may move within.
    (workers / "cgroup.type").write_text("threaded")

    proc = scratch.spawn([sys.executable, "-c", _THREADED_CHILD])
    assert proc.stdout is not None
    tid = int(proc.stdout.readline())
    (domain / "cgroup.procs").write_text(str(proc.pid))
    (workers / "cgroup.threads").write_text(str(tid))
    all_tids = {int(t) for t in os.listdir(f"/proc/{proc.pid}/task")}
    assert tid in all_tids and len(all_tids) >= 2

    tree = make_source(keep_pids=True).collect(Roots())
    dom = tree.get(scratch.rel(domain))
    thr = tree.get(scratch.rel(workers))
    assert dom is not None and thr is not None
    assert dom.type == "domain threaded"
    assert thr.type == "threaded"

    # The kernel refuses to list processes in a threaded cgroup: absent, not 0.
    assert read_optional(workers / "cgroup.procs") is None
    assert thr.nr_procs is None and thr.procs is None
    assert thr.nr_threads == 1
    assert thr.threads == (tid,)

    # The process belongs to the threaded domain; its other threads stayed there.
    assert dom.nr_procs == 1
    assert dom.procs == (proc.pid,)
    assert dom.threads is not None and set(dom.threads) == all_tids - {tid}
    assert dom.nr_threads == len(all_tids) - 1

    thread_view = read_proc_cgroup(Roots(), tid)
    process_view = read_proc_cgroup(Roots(), proc.pid)
    assert thread_view is not None and thread_view.v2_path == scratch.rel(workers)
    assert process_view is not None and process_view.v2_path == scratch.rel(domain)


# A process that moves itself into the cgroups named on its command line, then touches
# three times its memory limit page by page: reclaim at the limit stalls it, then (no swap
# on a test host, or swap used up) the OOM killer ends it.
_MEMORY_HOG = """
import sys
for path in sys.argv[1:]:
    with open(path, "w") as f:
        f.write("0")
size = 96 << 20
block = bytearray(size)
for i in range(0, size, 4096):
    block[i] = 1
"""
_LIMIT = 32 << 20


def _memory_limited(scratch: Scratch, leaf: Path) -> list[Path]:
    """The ``cgroup.procs`` files a task writes to land in ``leaf`` with a 32 MiB memory
    limit: ``memory.max`` where cgroup v2 has the memory controller, else (the hybrid
    hierarchy) a v1 memory cgroup beside it, whose reclaim the task's v2 cgroup counts in
    its ``memory.pressure`` all the same. Skips where neither can be set."""
    root_subtree = (scratch.v2_root / "cgroup.subtree_control").read_text().split()
    if "memory" in root_subtree:
        (scratch.base / "cgroup.subtree_control").write_text("+memory")
        (leaf / "memory.max").write_text(str(_LIMIT))
        return [leaf / "cgroup.procs"]
    v1 = scratch.v2_root.parent / "memory"
    if not (v1 / "memory.limit_in_bytes").exists():
        pytest.skip("no memory controller on cgroup v2 nor a v1 memory hierarchy")
    memcg = v1 / scratch.base.name
    memcg.mkdir()
    scratch.v1_dirs.append(memcg)
    (memcg / "memory.limit_in_bytes").write_text(str(_LIMIT))
    return [leaf / "cgroup.procs", memcg / "cgroup.procs"]


def test_memory_pressure_of_a_task_reclaiming_at_its_limit(scratch: Scratch) -> None:
    from nodescope.detectors.jobs import _cost
    from nodescope.sources.cgroup import parse_pressure

    leaf = scratch.base / "hog"
    leaf.mkdir()
    procs_files = _memory_limited(scratch, leaf)
    source = make_source()
    before = source.collect(Roots()).get(scratch.rel(leaf))
    assert before is not None and before.memory_pressure is not None
    assert before.memory_pressure.some is not None and before.memory_pressure.full is not None

    started = time.monotonic()
    hog = subprocess.run(
        [sys.executable, "-c", _MEMORY_HOG, *map(str, procs_files)], timeout=120, check=False
    )
    seconds = time.monotonic() - started
    # Killed by the OOM killer, or done after reclaiming its way through.
    assert hog.returncode in (0, -9), hog.returncode

    raw = (leaf / "memory.pressure").read_text()
    after = source.collect(Roots()).get(scratch.rel(leaf))
    assert after is not None and after.memory_pressure is not None
    # The walk's record is the file as the parser reads it (averages move between reads:
    # the totals of a cgroup with no task left do not).
    assert after.memory_pressure == parse_pressure(raw, "memory.pressure")
    some, full = after.memory_pressure.some, after.memory_pressure.full
    assert some is not None and full is not None
    assert before.memory_pressure.some.total_usec <= some.total_usec
    assert some.total_usec > 0, raw  # the task stalled in reclaim at its limit
    assert full.total_usec <= some.total_usec  # one task: all stalled is some stalled
    # What the thrash detector makes of the two reads: a stall share of the interval.
    cost = _cost(before, after, seconds)
    assert cost.some_percent is not None and 0 < cost.some_percent <= 100
