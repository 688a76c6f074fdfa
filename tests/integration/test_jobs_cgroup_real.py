"""Escape detection on this machine's real cgroup2 mount.

A job cgroup ``job_<id>`` is made threaded under a threaded domain, a real process with an
extra thread is moved into it, and then that one thread is moved into a sibling cgroup outside
the job — what an application (or a launcher) pinning its communication threads elsewhere
does. The ``jobs`` source must name the thread, its process and where it went, and the job
detector must report the escape. Needs root and a cgroup2 mount (``/sys/fs/cgroup/unified``
here); every cgroup made is removed in teardown after its tasks are moved back.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodescope.detectors import jobs as job_detectors
from nodescope.model.jobs import build_registry
from nodescope.roots import Roots
from nodescope.sources.base import read_optional
from nodescope.sources.cgroup import find_v2_root
from nodescope.sources.jobs import read_jobs

pytestmark = pytest.mark.integration

_THREADED_CHILD = """
import threading, time
def worker():
    tid = threading.get_native_id()
    with open(f"/proc/self/task/{tid}/comm", "w") as comm:
        comm.write("NCCL Progress")  # what NCCL names its thread
    print(tid, flush=True)
    time.sleep(120)
threading.Thread(target=worker, daemon=True).start()
time.sleep(120)
"""


@pytest.fixture
def base() -> Iterator[tuple[Path, Path]]:
    if os.geteuid() != 0:
        pytest.skip("creating cgroups needs root")
    hierarchy = find_v2_root(Roots().cgroupfs)
    if hierarchy.path is None:
        pytest.skip(f"no cgroup2 mount under {Roots().cgroupfs}")
    root = hierarchy.path
    directory = root / f"nodescope-jobs-test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    directory.mkdir()
    try:
        yield root, directory
    finally:
        for current, _, _ in os.walk(directory, topdown=False):
            for tid in (read_optional(Path(current) / "cgroup.threads") or "").split():
                with contextlib.suppress(OSError):
                    (root / "cgroup.procs").write_text(tid)
        for current, _, _ in os.walk(directory, topdown=False):
            for _ in range(50):
                try:
                    os.rmdir(current)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
        assert not directory.exists(), f"{directory} left behind"


def test_a_thread_moved_out_of_the_job_is_found(base: tuple[Path, Path]) -> None:
    root, directory = base
    job = directory / "job_917"
    other = directory / "pinned"
    job.mkdir()
    other.mkdir()
    (job / "cgroup.type").write_text("threaded")
    (other / "cgroup.type").write_text("threaded")
    child = subprocess.Popen([sys.executable, "-c", _THREADED_CHILD], stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        assert child.stdout is not None
        tid = int(child.stdout.readline())
        (job / "cgroup.procs").write_text(str(child.pid))  # the whole process
        (other / "cgroup.threads").write_text(str(tid))  # one thread leaves the job

        data = read_jobs(Roots())
        assert data.hierarchy == "v2"
        found = [j for j in data.jobs if j.job_id == "917"]
        assert len(found) == 1, [j.path for j in data.jobs]
        (task,) = found[0].tasks
        assert task.pid == child.pid
        rel = "/" + str(other.relative_to(root))
        assert [(e.tid, e.cgroup) for e in task.escaped_threads] == [(tid, rel)]
        assert task.escaped_threads[0].comm == "NCCL Progress"

        (registered,) = [j for j in build_registry(data, []) if j.job_id == "917"]
        findings = job_detectors.evaluate(None, (registered,), 10.0)
        assert [f.kind for f in findings] == [job_detectors.ESCAPE]
        assert f"sit in {rel}" in findings[0].message
        assert findings[0].evidence["escaped_threads"] == 1.0

        # Back in the job: nothing escaped any more.
        (job / "cgroup.threads").write_text(str(tid))
        (again,) = [j for j in read_jobs(Roots()).jobs if j.job_id == "917"]
        assert again.tasks[0].escaped_threads == ()
    finally:
        child.kill()
        child.wait(timeout=10)
        if child.stdout is not None:
            child.stdout.close()
