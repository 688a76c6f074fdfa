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
