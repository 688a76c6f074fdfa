"""One hostile process or cgroup never blinds the ``threads``, ``procs``, ``cgroups`` or
``jobs`` source.

Any user of a node names their own processes and threads (``prctl(PR_SET_NAME)``, writing
``/proc/self/task/<tid>/comm``), and a cgroup below a job can be refused to the reader or hold
a file that does not parse. Each test drives the sources as the daemon does — through the
collector — over real processes and real cgroups where the machine allows (root and a cgroup2
mount; skipped with the reason otherwise), and checks that the sources stay up, that the other
records are all there, and that what was skipped is counted in
``nodescope_source_records_skipped_total{source,reason}``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nodescope.collect import Collector, ScheduledSource
from nodescope.model.snapshot import Snapshot
from nodescope.roots import Roots
from nodescope.sources import cgroup as cgroups
from nodescope.sources import jobs, procs, threads
from nodescope.sources.base import read_optional
from nodescope.sources.registry import SourceInputs
from tests.adversarial.common import one_cycle, skipped_metric
from tests.conftest import new_v2_cgroup, remove_cgroup_tree

#: A name any user can give a process: a newline, a parenthesis and what looks like the
#: fields of a stat line.
HOSTILE_NAME = "x\ny) R 1"
#: A thread's name ending in a newline of its own, with a parenthesis and a state letter.
HOSTILE_THREAD_NAME = "a) D 1 2\n"


def _assert_up(snapshot: Snapshot, *names: str) -> None:
    for name in names:
        assert snapshot.status[name].up, (name, snapshot.current[name].error)


# --------------------------------------------------------------------------------------------
# Real cgroups and processes


@dataclass
class Scratch:
    """A cgroup made for one test below the v2 root, and the processes it started."""

    v2_root: Path
    base: Path
    children: list[subprocess.Popen[str]] = field(default_factory=list)

    def job(self, job_id: int) -> Path:
        directory = self.base / f"job_{job_id}"
        directory.mkdir()
        return directory

    def start(self, script: str, cgroup: Path) -> tuple[subprocess.Popen[str], str]:
        """A Python child that prints one line when ready, moved into ``cgroup``."""
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        self.children.append(child)
        assert child.stdout is not None
        line = child.stdout.readline().strip()
        (cgroup / "cgroup.procs").write_text(str(child.pid))
        return child, line


def _unique_job_id() -> int:
    return 900_000_000 + int(uuid.uuid4().int % 90_000_000)


@pytest.fixture
def scratch() -> Iterator[Scratch]:
    v2_root, base = new_v2_cgroup("nodescope-records")
    made = Scratch(v2_root, base)
    try:
        yield made
    finally:
        for directory, _, _ in os.walk(base):
            with contextlib.suppress(OSError):
                os.chmod(directory, 0o755)
        for child in made.children:
            child.kill()
            child.wait(timeout=30)
            if child.stdout is not None:
                child.stdout.close()
        remove_cgroup_tree(base)
        assert not base.exists(), f"{base} left behind"


# A process named HOSTILE_NAME with a second thread named HOSTILE_THREAD_NAME; it prints that
# thread's id and sleeps (at most two minutes, whatever happens to the test).
_HOSTILE_CHILD = f"""
import ctypes, threading, time
ctypes.CDLL(None).prctl(15, {HOSTILE_NAME.encode()!r}, 0, 0, 0)  # PR_SET_NAME
ready = threading.Event()
def worker():
    with open(f"/proc/self/task/{{threading.get_native_id()}}/comm", "w") as comm:
        comm.write({HOSTILE_THREAD_NAME!r})
    ready.set()
    time.sleep(120)
thread = threading.Thread(target=worker, daemon=True)
thread.start()
ready.wait()
print(thread.native_id, flush=True)
time.sleep(120)
"""


def test_a_process_named_like_a_stat_line_is_counted_not_fatal(scratch: Scratch) -> None:
    """``x\\ny) R 1`` took the node-wide ``threads`` source down until the process exited."""
    job_id = _unique_job_id()
    child, line = scratch.start(_HOSTILE_CHILD, scratch.job(job_id))
    tid = int(line)
    assert read_optional(f"/proc/{child.pid}/comm") == HOSTILE_NAME + "\n"

    snapshot = one_cycle(Roots(), threads.ThreadsSource(host_every=1))
    _assert_up(snapshot, "threads")
    data = snapshot.current["threads"].data
    assert isinstance(data, threads.ThreadsData)
    job = data.job(str(job_id))
    assert job is not None and (job.processes, job.threads) == (1, 2)
    assert job.count("S") == 2
    assert data.host_threads is not None and data.host_threads >= 2

    stats, _ = threads.read_process_threads(Roots(), child.pid, None)
    assert {(s.tid, s.comm) for s in stats} == {
        (child.pid, HOSTILE_NAME),
        (tid, HOSTILE_THREAD_NAME),
    }
    # The jobs source names the process and the thread as the kernel does.
    found = jobs.read_jobs(Roots())
    (task,) = next(j for j in found.jobs if j.job_id == str(job_id)).tasks
    assert (task.pid, task.comm, task.threads) == (child.pid, HOSTILE_NAME, 2)


# A process with THREADS sleeping threads (small stacks); it prints "ready" once all run.
_MANY_THREADS = """
import threading, time
threading.stack_size(256 * 1024)
stop = threading.Event()
threads = [threading.Thread(target=stop.wait, args=(120,), daemon=True) for _ in range({n})]
for thread in threads:
    thread.start()
print("ready", flush=True)
stop.wait(120)
"""


def test_a_job_with_thousands_of_threads_is_counted_whole(scratch: Scratch) -> None:
    """``cgroup.threads`` of a job with 5,000 threads is over four pages of a ``seq_file``
    whatever the machine's pid numbers (at least 4,000 of the ids have four digits or more):
    every source counts every thread."""
    count = 5_000
    job_id = _unique_job_id()
    job_dir = scratch.job(job_id)
    child, line = scratch.start(_MANY_THREADS.format(n=count), job_dir)
    assert line == "ready"
    listed = (job_dir / "cgroup.threads").read_bytes()
    assert len(listed) > 4 * 4096 and len(listed.split()) == count + 1

    shared = cgroups.CycleWalk()
    snapshot = one_cycle(
        Roots(),
        cgroups.CgroupSource(walk=shared),
        jobs.JobsSource(walk=shared),
        threads.ThreadsSource(walk=shared),
    )
    _assert_up(snapshot, "cgroups", "jobs", "threads")
    tree = snapshot.current["cgroups"].data
    assert isinstance(tree, cgroups.CgroupTree)
    record = tree.get("/" + str(job_dir.relative_to(scratch.v2_root)))
    assert record is not None and (record.nr_procs, record.nr_threads) == (1, count + 1)
    found = snapshot.current["jobs"].data
    assert isinstance(found, jobs.JobsData)
    (task,) = next(j for j in found.jobs if j.job_id == str(job_id)).tasks
    assert (task.pid, task.threads, task.escaped_threads) == (child.pid, count + 1, ())
    counted = snapshot.current["threads"].data
    assert isinstance(counted, threads.ThreadsData)
    job = counted.job(str(job_id))
    assert job is not None and (job.processes, job.threads) == (1, count + 1)


# Runs in a child that lost CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, so file modes bind it as
# they bind any user: one collector cycle of the cgroup sources, as JSON.
_WITHOUT_DAC = """
import json, sys
from nodescope.collect import Collector, ScheduledSource
from nodescope.roots import Roots
from nodescope.sources import cgroup, jobs, procs, threads
from nodescope_exporters import self_metrics
from nodescope_exporters.prometheus import render
from prometheus_client.parser import text_string_to_metric_families

from nodescope.sources.registry import SourceInputs
inputs = SourceInputs()
shared = inputs.cgroup_walk
sources = [
    cgroup.CgroupSource(walk=shared),
    jobs.JobsSource(walk=shared),
    procs.ProcsSource(walk=shared),
    threads.ThreadsSource(walk=shared),
]
collector = Collector(Roots(), [ScheduledSource(s, 1.0, 30.0) for s in sources], inputs=inputs)
snapshot = collector.run_cycle()
skipped = {}
for family in text_string_to_metric_families(render(snapshot, [self_metrics.families]).decode()):
    for sample in family.samples:
        if sample.name == "nodescope_source_records_skipped_total":
            skipped[sample.labels["source"] + "/" + sample.labels["reason"]] = sample.value
data = snapshot.current["jobs"].data
print(json.dumps({
    "up": {name: bool(status.up) for name, status in snapshot.status.items()},
    "errors": {name: sample.error for name, sample in snapshot.current.items()},
    "jobs": {} if data is None else {j.job_id: [t.pid for t in j.tasks] for j in data.jobs},
    "skipped": skipped,
}))
collector.close()
"""

_PR_CAPBSET_DROP = 24
_CAP_DAC_OVERRIDE = 1
_CAP_DAC_READ_SEARCH = 2


def _drop_dac_capabilities() -> None:
    """In the child before ``exec``: out of the bounding set, root keeps neither capability
    across ``exec`` (its inheritable set is empty)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
        if libc.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP")


def test_a_refused_job_cgroup_costs_only_that_job(scratch: Scratch) -> None:
    """EACCES on one job's cgroup directory took ``cgroups``, ``jobs``, ``procs`` and
    ``threads`` down for every job; EACCES on one file of another job costs that figure."""
    refused_id, readable_id = _unique_job_id(), _unique_job_id()
    refused, readable = scratch.job(refused_id), scratch.job(readable_id)
    sleeper = "print('ready', flush=True); import time; time.sleep(120)"
    scratch.start(sleeper, refused)
    child, _ = scratch.start(sleeper, readable)
    os.chmod(refused, 0)
    os.chmod(readable / "cpu.stat", 0)

    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_DAC],
        preexec_fn=_drop_dac_capabilities,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["up"] == dict.fromkeys(("cgroups", "jobs", "procs", "threads"), True), seen[
        "errors"
    ]
    assert seen["jobs"][str(readable_id)] == [child.pid]
    assert str(refused_id) not in seen["jobs"]
    skipped = seen["skipped"]
    assert skipped.get("cgroups/cgroup_unreadable", 0) >= 1, skipped
    assert skipped.get("jobs/cgroup_unreadable", 0) >= 1, skipped
    assert skipped.get("cgroups/cgroup_file_unreadable", 0) >= 1, skipped


# --------------------------------------------------------------------------------------------
# Fixture trees: what the kernel never writes, a node's own files may still hold


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _stat(pid: int, comm: str, threads_count: int = 1) -> str:
    fields = ["S", "1", str(pid), str(pid), "0", "-1", "0", "0", "0", "0", "0", "10", "20"]
    fields += ["0", "0", "20", "0", str(threads_count), "0", "5", "0", "0"]
    return f"{pid} ({comm}) {' '.join(fields)}\n"


def _node(base: Path) -> Roots:
    """Two jobs, job_1 (pid 100) and job_2 (pid 200), on a unified hierarchy."""
    roots = Roots.under(base)
    cg = roots.cgroupfs
    _write(cg / "cgroup.controllers", "cpu io memory pids\n")
    for job, pid in ((1, 100), (2, 200)):
        directory = cg / "system.slice" / "slurmstepd.scope" / f"job_{job}"
        _write(directory / "cgroup.procs", f"{pid}\n")
        _write(directory / "cgroup.threads", f"{pid}\n")
        _write(directory / "memory.max", "max\n")
        _write(directory / "memory.stat", "anon 4096\nfile 8192\n")
        _write(roots.procfs / str(pid) / "stat", _stat(pid, "python3"))
        _write(roots.procfs / str(pid) / "task" / str(pid) / "stat", _stat(pid, "python3"))
        _write(roots.procfs / str(pid) / "environ", f"SLURM_JOB_ID={job}\0")
    return roots


def test_junk_in_one_job_cgroup_is_counted_not_fatal(tmp_path: Path) -> None:
    """A ``memory.stat`` that does not parse and a ``cgroup.procs`` line that is not a pid in
    job_1 took ``cgroups`` and ``jobs`` down for both jobs."""
    roots = _node(tmp_path)
    job_1 = roots.cgroupfs / "system.slice" / "slurmstepd.scope" / "job_1"
    (job_1 / "memory.stat").write_text("anon 4096\nthis is not a key value line\n")
    (job_1 / "cgroup.procs").write_text("100\n\u202enot-a-pid\n")
    # The four sources share one walk per cycle, as the daemon builds them.
    inputs = SourceInputs()
    shared = inputs.cgroup_walk
    collector = Collector(
        roots,
        [
            ScheduledSource(source, 1.0, 30.0)
            for source in (
                cgroups.CgroupSource(walk=shared),
                jobs.JobsSource(walk=shared),
                procs.ProcsSource(walk=shared),
                threads.ThreadsSource(walk=shared),
            )
        ],
        inputs=inputs,
    )
    try:
        snapshot = collector.run_cycle()
    finally:
        collector.close()
    _assert_up(snapshot, "cgroups", "jobs", "procs", "threads")
    found = snapshot.current["jobs"].data
    assert isinstance(found, jobs.JobsData)
    assert [(j.job_id, [t.pid for t in j.tasks]) for j in found.jobs] == [
        ("1", [100]),
        ("2", [200]),
    ]
    stats = {j.job_id: j.stats for j in found.jobs}
    assert stats["1"] is not None and stats["1"].memory_stat is None
    assert stats["2"] is not None and stats["2"].memory_stat is not None
    assert skipped_metric(snapshot) == {
        ("cgroups", "cgroup_file_unparsable"): 1.0,
        ("cgroups", "id_unparsable"): 1.0,
        ("jobs", "cgroup_file_unparsable"): 1.0,
        ("jobs", "id_unparsable"): 1.0,
    }


def test_an_unparsable_task_stat_is_counted_not_fatal(tmp_path: Path) -> None:
    """One ``stat`` that is not a stat line (a process of job_1, a thread outside any job):
    the threads source goes on with every other process."""
    roots = _node(tmp_path)
    _write(roots.procfs / "100" / "stat", "100 (python3) ? garbage\n")
    _write(roots.procfs / "300" / "stat", _stat(300, "rsync", threads_count=2))
    _write(roots.procfs / "300" / "task" / "300" / "stat", _stat(300, "rsync"))
    _write(roots.procfs / "300" / "task" / "301" / "stat", "301 (rsync\n")
    snapshot = one_cycle(roots, threads.ThreadsSource())
    _assert_up(snapshot, "threads")
    data = snapshot.current["threads"].data
    assert isinstance(data, threads.ThreadsData)
    assert [(j.job_id, j.processes, j.threads) for j in data.jobs] == [("1", 0, 0), ("2", 1, 1)]
    assert data.host_threads == 2  # pid 200 and rsync's leader
    assert skipped_metric(snapshot) == {("threads", "stat_unparsable"): 3.0}
    assert snapshot.status["threads"].skipped_total == {"stat_unparsable": 3}
