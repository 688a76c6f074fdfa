"""A job's OOM kills on cgroup v1 are seen wherever below the job the kernel counted them.

Slurm's cgroup/v1 plugin puts a job's processes in
``memory/slurm/uid_<u>/job_<j>/step_<s>/task_<n>`` and its limit on ``job_<j>``. On v1 the
kernel counts an OOM kill only in the memory cgroup of the task it killed
(``memcg_memory_event()`` stops after the first level off the unified hierarchy): the job's
and the step's ``memory.oom_control`` keep saying ``oom_kill 0`` while ``task_0``'s says 1.
Here a real process in a real v1 ``task_0`` is OOM-killed under its job's limit; the ``jobs``
source must count the kill for the step and the job, and ``job_oom_kill`` must fire. Needs
root and a v1 memory hierarchy (``/sys/fs/cgroup/memory`` on a hybrid host); every cgroup
made is removed in teardown.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodescope.detectors import jobs as job_detectors
from nodescope.model.job_records import JobsData
from nodescope.model.jobs import build_registry
from nodescope.roots import Roots
from nodescope.sources.jobs import read_v1_job
from tests.conftest import remove_cgroup_tree

JOB_ID = "918273"
#: The job's limit, and what its one process asks for past it.
LIMIT_BYTES = 64 << 20
ASK_BYTES = 256 << 20


@pytest.fixture
def v1_job() -> Iterator[Path]:
    """``memory/slurm_<unique>/uid_0/job_<id>`` with ``step_0/task_0`` below it."""
    if os.geteuid() != 0:
        pytest.skip("creating cgroups needs root")
    memory = Roots().cgroupfs / "memory"
    if not (memory / "memory.oom_control").exists():
        pytest.skip(f"no v1 memory hierarchy at {memory}")
    top = memory / f"slurm_nodescope-test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    job = top / "uid_0" / f"job_{JOB_ID}"
    (job / "step_0" / "task_0").mkdir(parents=True)
    try:
        (job / "memory.limit_in_bytes").write_text(str(LIMIT_BYTES))
        yield job
    finally:
        remove_cgroup_tree(top)
        assert not top.exists(), f"{top} left behind"


def _oom_killed_in(task_dir: Path) -> None:
    """A real process, moved into ``task_dir`` before it allocates, killed by the OOM
    killer under the job's limit."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import sys; sys.stdin.readline(); b = bytearray({ASK_BYTES}); print(len(b))",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
    )
    assert child.stdin is not None
    (task_dir / "cgroup.procs").write_text(str(child.pid))
    child.stdin.write(b"go\n")
    child.stdin.close()
    assert child.wait(timeout=60) == -9


def _oom_kill(path: Path) -> int:
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    raise AssertionError(f"no oom_kill in {path}")


def test_an_oom_kill_in_task_0_is_the_jobs(v1_job: Path) -> None:
    roots = Roots()
    task = v1_job / "step_0" / "task_0"
    before = read_v1_job(roots, "memory", JOB_ID, 0, v1_job)
    _oom_killed_in(task)
    after = read_v1_job(roots, "memory", JOB_ID, 0, v1_job)

    # What the kernel counted, and where: only in the killed task's own cgroup.
    assert _oom_kill(task / "memory.oom_control") == 1
    assert _oom_kill(v1_job / "memory.oom_control") == 0
    assert _oom_kill(v1_job / "step_0" / "memory.oom_control") == 0

    def kills(stats: object) -> int:
        events = getattr(stats, "memory_events", None)
        return 0 if events is None or events.oom_kill is None else int(events.oom_kill)

    assert kills(before.stats) == 0
    assert kills(after.stats) == 1
    (step,) = after.steps
    assert step.name == "0" and kills(step.stats) == 1

    (previous,) = build_registry(JobsData("v1", (before,), (), ()), [])
    (current,) = build_registry(JobsData("v1", (after,), (), ()), [])
    (finding,) = job_detectors.oom_kills(previous, current)
    assert finding.kind == job_detectors.OOM_KILL
    assert finding.subjects == {"job": JOB_ID, "step": "0"}
    assert finding.evidence["oom_kills"] == 1.0
