"""The job registry: parsers, the cgroup v2 (``job_<id>`` and SLUID) and v1 layouts on fixture
trees, GPUs from registration / environ / device cgroup / processes, the job detectors, the
job metrics, the health gate and the report documents."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from nodescope.assembly import default_config, from_mapping
from nodescope.config import SlurmSettings
from nodescope.detectors import jobs as job_detectors
from nodescope.errors import ConfigError, ParseError
from nodescope.hooks.health import (
    Check,
    GateInputs,
    count_dev_gpus,
    gate_checks,
    missing_modules,
    unfit_reason,
)
from nodescope.hooks.reports import JobWindow, build_report
from nodescope.hooks.request import JobRequest
from nodescope.model.jobs import GpuUse, build_registry
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.roots import Roots
from nodescope.sources import jobs as source
from nodescope.sources.cgroup import (
    Cgroup,
    CycleWalk,
    Limit,
    MemoryEvents,
    Pressure,
    PressureLine,
)
from nodescope.sources.jobs import (
    JobCgroup,
    JobsData,
    JobStep,
    JobTask,
    parse_devices_list,
    parse_environ,
    parse_gpu_list,
    parse_registration,
    parse_status_tgid,
    parse_v1_limit,
    read_jobs,
)
from nodescope_exporters import job_metrics
from nodescope_exporters.prometheus import SnapshotCollector
from nodescope_exporters.reports import (
    counter_deltas,
    on_axis,
    render_svg,
    render_text,
    sparkline,
)

GIB = 1 << 30


# ---------------------------------------------------------------------------------------------
# Parsers


def test_parse_environ_keeps_only_the_job_variables() -> None:
    text = "PATH=/bin\0SLURM_JOB_ID=42\0AWS_SECRET_ACCESS_KEY=x\0SLURM_JOB_GPUS=0,3\0junk\0"
    assert parse_environ(text) == (("SLURM_JOB_ID", "42"), ("SLURM_JOB_GPUS", "0,3"))


def test_parse_gpu_list() -> None:
    assert parse_gpu_list("3,0,1") == (0, 1, 3)
    assert parse_gpu_list("") == ()
    for bad in ("0,,1", "a", "0-3", "1,"):
        with pytest.raises(ParseError):
            parse_gpu_list(bad)


def test_job_and_step_directories() -> None:
    assert source.job_dir_id("job_81750") == "81750"
    assert source.job_dir_id("job_x") is None
    assert source.is_sluid_dir("sEKNKTV3WPV500")
    assert not source.is_sluid_dir("system")
    assert not source.is_sluid_dir("job_42")
    assert source.step_of("step_0/user/task_1") == "0"
    assert source.step_of("step_batch") == "batch"
    assert source.step_of("step_1+0/user") == "1+0"
    assert source.step_of("user/task_0") is None


def test_parse_status_tgid() -> None:
    assert parse_status_tgid("Name:\tpython3\nUmask:\t0022\nState:\tS\nTgid:\t4242\n") == 4242
    with pytest.raises(ParseError, match="no Tgid"):
        parse_status_tgid("Name:\tx\n")
    with pytest.raises(ParseError) as info:
        parse_status_tgid("Name:\tx\nTgid:\tz\n", "/proc/9/status")
    assert info.value.line == 2 and info.value.source == "/proc/9/status"


def test_parse_devices_list() -> None:
    # What Slurm's task/cgroup writes for a job with GPUs 0 and 2 (nvidiactl allowed too).
    text = "c 195:0 rwm\nc 195:2 rwm\nc 195:255 rwm\nc 1:3 rwm\nb 8:0 r\n"
    assert parse_devices_list(text) == (0, 2)
    assert parse_devices_list("a *:* rwm\n") is None
    assert parse_devices_list("c 195:* rwm\n") is None
    assert parse_devices_list("c 1:3 rwm\n") == ()
    with pytest.raises(ParseError) as info:
        parse_devices_list("c 195:0 rwm\nnonsense\n")
    assert info.value.line == 2


def test_parse_v1_limit() -> None:
    assert parse_v1_limit("9223372036854771712\n") is None
    assert parse_v1_limit("1073741824\n") == GIB


def _registration(**overrides: Any) -> str:
    doc: dict[str, Any] = {
        "format": "nodescope-registration/1",
        "job_id": "42",
        "uid": 1000,
        "user": "alice",
        "partition": "gpu",
        "gpus": [1, 0],
        "registered_at": 1700000000.5,
    }
    doc.update(overrides)
    return json.dumps(doc)


def test_parse_registration() -> None:
    reg = parse_registration(_registration())
    assert (reg.job_id, reg.uid, reg.user, reg.gpus) == ("42", 1000, "alice", (0, 1))
    for bad in (
        "{",
        "[]",
        _registration(format="other"),
        _registration(job_id=42),
        _registration(gpus=["0"]),
        _registration(uid=-1),
        _registration(registered_at="now"),
    ):
        with pytest.raises(ParseError):
            parse_registration(bad, "r.json")


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_parsers_raise_only_parse_errors(text: str) -> None:
    for parse in (
        parse_gpu_list,
        parse_status_tgid,
        parse_devices_list,
        parse_v1_limit,
        parse_registration,
    ):
        with contextlib.suppress(ParseError):
            parse(text)
    parse_environ(text)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet="abcm0123456789:*, \n", max_size=20), max_size=5))
def test_devices_list_fuzz(lines: list[str]) -> None:
    with contextlib.suppress(ParseError):
        parse_devices_list("\n".join(lines))


# ---------------------------------------------------------------------------------------------
# Fixture trees


def _write(path: Path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)


def _cgroup(
    directory: Path,
    procs: list[int] = (),
    threads: list[int] | None = None,  # type: ignore[assignment]
    memory_max: str = "max",
    **files: str,
) -> None:
    _write(directory / "cgroup.controllers", "cpu io memory pids\n")
    _write(directory / "cgroup.type", files.pop("type", "domain") + "\n")
    _write(directory / "cgroup.procs", "".join(f"{p}\n" for p in procs))
    _write(
        directory / "cgroup.threads",
        "".join(f"{t}\n" for t in (procs if threads is None else threads)),
    )
    _write(directory / "memory.max", memory_max + "\n")
    for name, text in files.items():
        _write(directory / name.replace("__", "."), text)


def _process(
    proc: Path,
    pid: int,
    comm: str,
    environ: dict[str, str],
    cgroup: str,
    tids: list[int] = (),  # type: ignore[assignment]
) -> None:
    _write(proc / str(pid) / "comm", comm + "\n")
    _write(proc / str(pid) / "environ", b"".join(f"{k}={v}\0".encode() for k, v in environ.items()))
    _write(proc / str(pid) / "cgroup", f"0::{cgroup}\n")
    for tid in [pid, *tids]:
        _write(proc / str(pid) / "task" / str(tid) / "comm", comm + "\n")
        _write(proc / str(pid) / "task" / str(tid) / "cgroup", f"0::{cgroup}\n")


SCOPE = "system.slice/slurmstepd.scope"


def v2_tree(root: Path) -> Roots:
    """A pure cgroup v2 host with job 42 (``job_42``: GPUs 0,1 in SLURM_JOB_GPUS, memory.max
    only on step_0, a thread moved elsewhere, a rank in the login session) and job 77 in a
    SLUID-named directory."""
    roots = Roots.under(root)
    cg = roots.cgroupfs
    proc = roots.procfs
    _write(cg / "cgroup.controllers", "cpuset cpu io memory pids\n")
    _write(cg / "cgroup.procs", "1\n")
    _cgroup(cg / "init.scope", [1])
    _cgroup(cg / "system.slice", memory_max="max")
    _cgroup(cg / SCOPE)
    _cgroup(cg / SCOPE / "system", [90])
    job = cg / SCOPE / "job_42"
    _cgroup(
        job,
        memory__current=f"{3 * GIB}\n",
        memory__peak=f"{4 * GIB}\n",
        memory__high="max\n",
        memory__events="low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n",
        memory__pressure="some avg10=1.00 avg60=2.00 avg300=0.50 total=1500000\n"
        "full avg10=0.50 avg60=1.00 avg300=0.20 total=700000\n",
        io__stat="259:0 rbytes=4096 wbytes=8192 rios=1 wios=2 dbytes=0 dios=0\n",
        cpu__stat="usage_usec 5000000\nuser_usec 4000000\nsystem_usec 1000000\n",
        pids__current="9\n",
    )
    _cgroup(job / "step_0", memory_max=str(GIB), memory__events="oom_kill 1\n")
    _cgroup(job / "step_0" / "slurm", [100], [100, 110])
    _cgroup(job / "step_0" / "user")
    _cgroup(job / "step_0" / "user" / "task_0", [101], [101, 102])
    _cgroup(job / "step_batch", memory__events="oom_kill 0\n")
    _cgroup(job / "step_batch" / "user" / "task_0", [103])
    env42 = {
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_GPUS": "0,1",
        "SLURM_JOB_USER": "alice",
        "SLURM_JOB_UID": "1000",
        "NCCL_IB_HCA": "mlx5_0",
        "SECRET": "x",
    }
    _process(proc, 100, "slurmstepd", {}, f"/{SCOPE}/job_42/step_0/slurm", [110])
    _process(proc, 101, "python3", env42, f"/{SCOPE}/job_42/step_0/user/task_0", [102, 105])
    _write(proc / "101" / "task" / "105" / "comm", "NCCL Progress 0\n")
    _write(proc / "101" / "task" / "105" / "cgroup", "0::/user.slice/elsewhere\n")
    _process(proc, 103, "bash", env42, f"/{SCOPE}/job_42/step_batch/user/task_0")
    sluid = cg / SCOPE / "sEKNKTV3WPV500"
    _cgroup(sluid, memory_max=str(8 * GIB))
    _cgroup(sluid / "step_0" / "user" / "task_0", [201])
    _process(proc, 201, "train", {"SLURM_JOB_ID": "77"}, f"/{SCOPE}/sEKNKTV3WPV500/step_0")
    _cgroup(cg / "user.slice")
    _cgroup(cg / "user.slice" / "elsewhere")
    _cgroup(cg / "user.slice" / "user-1000.slice" / "session-3.scope", [300])
    _process(proc, 300, "python3", env42, "/user.slice/user-1000.slice/session-3.scope")
    return roots


def test_v2_layout_and_sluid(tmp_path: Path) -> None:
    data = read_jobs(v2_tree(tmp_path))
    assert data.hierarchy == "v2"
    assert [(j.key, j.job_id, j.layout) for j in data.jobs] == [
        ("job_42", "42", "v2"),
        ("sEKNKTV3WPV500", "77", "v2-sluid"),
    ]
    job = data.jobs[0]
    assert job.path == f"/{SCOPE}/job_42"
    assert job.memory_limit_bytes == GIB
    assert sorted(s.name for s in job.steps) == ["0", "batch"]
    tasks = {t.pid: t for t in job.tasks}
    assert sorted(tasks) == [100, 101, 103]
    assert tasks[100].slurm_internal and not tasks[101].slurm_internal
    assert tasks[101].step == "0" and tasks[103].step == "batch"
    assert tasks[101].memory_max_bytes == GIB and tasks[103].memory_max_bytes is None
    assert tasks[101].env("SECRET") is None and tasks[101].env("NCCL_IB_HCA") == "mlx5_0"
    # 102 is listed in task_0's cgroup.threads; 105 is not: it was placed elsewhere.
    assert [(e.tid, e.comm, e.cgroup) for e in tasks[101].escaped_threads] == [
        (105, "NCCL Progress 0", "/user.slice/elsewhere")
    ]
    assert tasks[100].escaped_threads == ()
    assert job.stats is not None and job.stats.memory_current == 3 * GIB
    assert data.cgroup_of(300) == ("/user.slice/user-1000.slice/session-3.scope", None)
    assert data.cgroup_of(101) is None  # job processes are not in the index of the others


def test_registry_escapes_and_memory_limit(tmp_path: Path) -> None:
    data = read_jobs(v2_tree(tmp_path))
    gpus = [GpuUse(0, "0000:1b:00.0", (101,)), GpuUse(1, "0000:43:00.0", (300,))]
    jobs = {j.job_id: j for j in build_registry(data, gpus)}
    job = jobs["42"]
    assert (job.gpus, job.gpu_source, job.user, job.uid) == ((0, 1), "environ", "alice", 1000)
    assert [(e.pid, e.gpu, e.cgroup) for e in job.escaped_processes] == [
        (300, 1, "/user.slice/user-1000.slice/session-3.scope")
    ]
    assert job.unlimited == (103, 300)
    found = {f.kind: f for f in job_detectors.evaluate(None, (job,), 10.0)}
    assert set(found) == {job_detectors.ESCAPE, job_detectors.MEMORY_LIMIT}
    escape = found[job_detectors.ESCAPE]
    assert escape.subjects == {"job": "42"}
    assert escape.evidence == {"escaped_processes": 1.0, "escaped_threads": 1.0}
    assert "session-3.scope" in escape.message and "NCCL Progress 0" in escape.message
    limit = found[job_detectors.MEMORY_LIMIT]
    assert "1.0 GiB on step 0" in limit.message and "pid 103, 300" in limit.message
    assert jobs["77"].memory_limit_bytes == 8 * GIB and jobs["77"].unlimited == ()


def test_gpu_sources_in_order_of_trust(tmp_path: Path) -> None:
    roots = v2_tree(tmp_path)
    registration = source.registrations_dir(roots) / "42.json"
    _write(registration, _registration(gpus=[5]))
    _write(source.registrations_dir(roots) / "99.json", _registration(job_id="99", gpus=[7]))
    data = read_jobs(roots)
    jobs = {j.job_id: j for j in build_registry(data, [GpuUse(5, "b", (101,))])}
    assert (jobs["42"].gpus, jobs["42"].gpu_source, jobs["42"].registered) == (
        (5,),
        "registration",
        True,
    )
    # Known from its registration only: the prolog ran, the cgroup is not there (yet).
    assert (jobs["99"].running, jobs["99"].gpus, jobs["99"].user) == (False, (7,), "alice")
    # No registration, no variables: the GPUs its processes use.
    bare = JobCgroup(
        "job_5",
        "5",
        "v2",
        "/job_5",
        None,
        None,
        (),
        (JobTask(11, "x", "/job_5", None, (), 1, (), None),),
        None,
        None,
    )
    jobs_bare = build_registry(JobsData("v2", (bare,), (), ()), [GpuUse(3, "c", (11,))])
    assert (jobs_bare[0].gpus, jobs_bare[0].gpu_source, jobs_bare[0].escaped_processes) == (
        (3,),
        "processes",
        (),
    )


def v1_tree(root: Path) -> Roots:
    """Slurm cgroup/v1 (hybrid host without a v2 job): job 43 of uid 1000 with GPU 0 in its
    device cgroup and 2 OOM kills."""
    roots = Roots.under(root)
    cg, proc = roots.cgroupfs, roots.procfs
    rel = "slurm_node1/uid_1000/job_43"
    for controller in ("memory", "freezer", "devices", "cpuacct", "pids"):
        _write(cg / controller / "cgroup.procs", "1\n")
    memory = cg / "memory" / rel
    _write(memory / "memory.limit_in_bytes", f"{2 * GIB}\n")
    _write(memory / "memory.usage_in_bytes", f"{GIB}\n")
    _write(memory / "memory.max_usage_in_bytes", f"{GIB + 5}\n")
    _write(memory / "memory.failcnt", "7\n")
    _write(memory / "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    _write(memory / "step_batch" / "memory.limit_in_bytes", "9223372036854771712\n")
    _write(memory / "step_batch" / "task_0" / "cgroup.procs", "500\n")
    _write(memory / "step_batch" / "task_0" / "tasks", "500\n501\n")
    _write(memory / "step_batch" / "cgroup.procs", "")
    _write(memory / "cgroup.procs", "")
    _write(cg / "devices" / rel / "devices.list", "c 195:0 rwm\nc 195:255 rwm\n")
    _write(cg / "cpuacct" / rel / "cpuacct.usage", "2500000000\n")
    _write(cg / "pids" / rel / "pids.current", "2\n")
    _write(cg / "memory" / "user.slice" / "cgroup.procs", "600\n")
    _process(proc, 500, "python3", {"SLURM_JOB_ID": "43"}, "/", [501])
    return roots


def test_v1_layout(tmp_path: Path) -> None:
    data = read_jobs(v1_tree(tmp_path))
    assert data.hierarchy == "v1"
    (job,) = data.jobs
    assert (job.job_id, job.uid, job.layout, job.path) == (
        "43",
        1000,
        "v1",
        "/" + "slurm_node1/uid_1000/job_43",
    )
    assert job.gpu_minors == (0,)
    assert job.memory_limit_bytes == 2 * GIB
    stats = job.stats
    assert stats is not None and stats.memory_current == GIB and stats.memory_peak == GIB + 5
    assert stats.memory_events == MemoryEvents(max=7, oom_kill=2)
    assert stats.cpu_stat is not None and stats.cpu_stat.usage_usec == 2_500_000
    assert stats.pids_current == 2
    (task,) = job.tasks
    assert (task.pid, task.step, task.memory_max_bytes, task.escaped_threads) == (
        500,
        "batch",
        2 * GIB,
        (),
    )
    (registered,) = build_registry(data, [])
    assert (registered.gpus, registered.gpu_source, registered.uid) == ((0,), "device cgroup", 1000)
    assert data.others[0].pids == (1,) or any(o.pids == (600,) for o in data.others)


def test_v1_oom_kills_below_the_step_are_the_steps_and_the_jobs(tmp_path: Path) -> None:
    """v1 counts an OOM kill only in the killed task's own memory cgroup: the kills in
    ``task_<n>`` (and deeper) add to their step's and their job's, and a file below the job
    that does not parse is counted and costs only itself."""
    roots = v1_tree(tmp_path)
    batch = roots.cgroupfs / "memory" / "slurm_node1/uid_1000/job_43/step_batch"
    _write(batch / "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    _write(batch / "task_0" / "memory.oom_control", "oom_kill_disable 0\noom_kill 3\n")
    _write(batch / "task_1" / "x" / "memory.oom_control", "oom_kill 1\n")
    _write(batch / "task_2" / "memory.oom_control", "oom_kill lots\n")
    _write(
        roots.cgroupfs / "memory" / "slurm_node1/uid_1000/job_43/step_0" / "memory.oom_control",
        "oom_kill 0\n",
    )
    data = read_jobs(roots)
    (job,) = data.jobs
    assert job.stats is not None and job.stats.memory_events is not None
    assert job.stats.memory_events.oom_kill == 2 + 3 + 1
    assert job.stats.memory_events.max == 7  # the job's own failcnt is kept
    steps = {s.name: s.stats for s in job.steps}
    assert steps["batch"] is not None and steps["batch"].memory_events is not None
    assert steps["batch"].memory_events.oom_kill == 3 + 1
    assert steps["0"] is not None and steps["0"].memory_events is not None
    assert steps["0"].memory_events.oom_kill == 0
    assert dict(data.skipped.counts) == {source.SKIP_V1_OOM_CONTROL: 1}


def test_v1_oom_kills_below_walks_the_memory_hierarchy_itself(tmp_path: Path) -> None:
    """Where the job was found in another hierarchy (``freezer``), the memory cgroups below
    it are walked: the same sums as from the job's own walk."""
    from nodescope.model.skips import SkipTally

    roots = v1_tree(tmp_path)
    job = roots.cgroupfs / "memory" / "slurm_node1/uid_1000/job_43"
    _write(job / "step_batch" / "task_0" / "memory.oom_control", "oom_kill 3\n")
    _write(job / "step_batch" / "task_0" / "deeper" / "memory.oom_control", "oom_kill 2\n")
    _write(job / "step_0" / "memory.oom_control", "oom_kill 0\n")
    assert source.v1_oom_kills_below(job, SkipTally()) == {
        "step_batch/task_0": 3,
        "step_batch/task_0/deeper": 2,
    }


def test_v1_a_job_with_a_junk_file_is_skipped_alone(tmp_path: Path) -> None:
    """A v1 job whose ``devices.list`` does not parse is left out and counted; the job next
    to it, a bad line of its task list and a junk limit of another cgroup cost only
    themselves."""
    roots = v1_tree(tmp_path)
    cg = roots.cgroupfs
    bad = "slurm_node1/uid_1000/job_44"
    _write(cg / "memory" / bad / "cgroup.procs", "700\n")
    _write(cg / "devices" / bad / "devices.list", "everything, please\n")
    _write(cg / "memory" / "slurm_node1/uid_1000/job_43/step_batch/task_0/tasks", "500\nx\n501\n")
    _write(cg / "memory" / "user.slice" / "memory.limit_in_bytes", "lots\n")
    data = read_jobs(roots)
    assert [j.job_id for j in data.jobs] == ["43"]
    assert data.jobs[0].tasks[0].escaped_threads == ()  # 501 still counted as the job's
    assert dict(data.skipped.counts) == {
        "job_unparsable": 1,
        "id_unparsable": 1,
        "limit_unparsable": 1,
    }
    assert "job_44/devices.list" in data.skipped.examples["job_unparsable"]
    assert any(o.pids == (600,) and o.memory_max_bytes is None for o in data.others)


def test_v2_bad_thread_files_and_registrations_are_skipped(tmp_path: Path) -> None:
    """A thread whose ``cgroup`` does not parse, a threaded cgroup's thread whose ``status``
    does not parse, a registration that is not one: each is left out and counted, job 42 is
    read otherwise whole."""
    roots = v2_tree(tmp_path)
    expected = read_jobs(roots)
    assert not expected.skipped
    proc = roots.procfs
    _write(proc / "101" / "task" / "105" / "cgroup", "no colons here\n")
    _write(source.registrations_dir(roots) / "42.json", '{"format": "something else"}')
    _write(source.registrations_dir(roots) / "43.json", _registration(job_id="43"))
    threaded = roots.cgroupfs / SCOPE / "job_42" / "step_0" / "threads"
    _cgroup(threaded, [], [120], type="threaded")
    (threaded / "cgroup.procs").unlink()  # a threaded cgroup does not list processes
    _write(proc / "120" / "status", "Name:\tx\nTgid:\tmany\n")
    data = read_jobs(roots)
    assert dict(data.skipped.counts) == {"thread_unparsable": 2, "registration_unparsable": 1}
    assert [r.job_id for r in data.registrations] == ["43"]
    job, other = data.jobs
    tasks = {t.pid: t for t in job.tasks}
    assert sorted(tasks) == [100, 101, 103]
    assert tasks[101].escaped_threads == ()  # 105's whereabouts are unknown, not invented
    assert other == expected.jobs[1]


def test_v2_a_junk_cgroup_file_of_one_job_keeps_both_jobs(tmp_path: Path) -> None:
    """Junk ``memory.max`` and ``cgroup.threads`` in job 42's cgroups: the walk keeps the
    cgroups without those figures, counted in the jobs record; job 77 is as before."""
    roots = v2_tree(tmp_path)
    expected = read_jobs(roots)
    step = roots.cgroupfs / SCOPE / "job_42" / "step_0"
    _write(step / "memory.max", "a gigabyte\n")
    _write(step / "user" / "task_0" / "cgroup.threads", "101\n102\n-\n")
    for data in (read_jobs(roots), _from_walk_of_its_own(roots)):
        assert dict(data.skipped.counts) == {"cgroup_file_unparsable": 1, "id_unparsable": 1}
        assert [j.job_id for j in data.jobs] == ["42", "77"]
        assert data.jobs[0].memory_limit_bytes is None  # the only limit did not parse
        assert data.jobs[0].tasks == tuple(
            dataclasses.replace(t, memory_max_bytes=None) for t in expected.jobs[0].tasks
        )
        assert data.jobs[1] == expected.jobs[1]


def _from_walk_of_its_own(roots: Roots) -> JobsData:
    return source.JobsSource(slow_every=1).collect(roots)


@settings(max_examples=100, deadline=None)
@given(
    name=st.sampled_from(
        ["memory.max", "memory.stat", "cgroup.procs", "cgroup.threads", "cgroup.type", "io.stat"]
    ),
    text=st.text(max_size=200),
)
def test_any_text_in_a_job_cgroup_file_never_takes_jobs_down(
    tmp_path_factory: pytest.TempPathFactory, name: str, text: str
) -> None:
    roots = v2_tree(tmp_path_factory.mktemp("fuzz"))
    _write(roots.cgroupfs / SCOPE / "job_42" / "step_0" / name, text)
    data = read_jobs(roots)
    assert [j.job_id for j in data.jobs] == ["42", "77"]


def test_no_cgroups_at_all(tmp_path: Path) -> None:
    data = read_jobs(Roots.under(tmp_path))
    assert (data.hierarchy, data.jobs, data.registrations) == ("none", (), ())


# ---------------------------------------------------------------------------------------------
# Detectors on records


def _job(
    job_id: str = "42",
    *,
    steps: tuple[JobStep, ...] = (),
    tasks: tuple[JobTask, ...] = (),
    stats: Cgroup | None = None,
) -> JobCgroup:
    return JobCgroup(
        f"job_{job_id}", job_id, "v2", f"/job_{job_id}", None, stats, steps, tasks, GIB, None
    )


def _stats(oom_kill: int, limit: int | None = GIB) -> Cgroup:
    return Cgroup(
        path="/x",
        depth=3,
        type="domain",
        controllers=None,
        nr_children=0,
        memory_max=Limit(limit),
        memory_events=MemoryEvents(oom_kill=oom_kill),
    )


def _task(pid: int, comm: str, step: str) -> JobTask:
    return JobTask(pid, comm, f"/job_42/step_{step}/user/task_0", step, (), 1, (), GIB)


def test_oom_kill_names_job_step_and_process() -> None:
    before = _job(
        steps=(JobStep("0", "/job_42/step_0", _stats(0)),),
        tasks=(_task(10, "python3", "0"), _task(11, "python3", "0"), _task(12, "bash", "batch")),
        stats=_stats(0, None),
    )
    after = _job(
        steps=(JobStep("0", "/job_42/step_0", _stats(1)),),
        tasks=(_task(10, "python3", "0"), _task(12, "bash", "batch")),
        stats=_stats(1, None),
    )
    registry_before = build_registry(JobsData("v2", (before,), (), ()), [])
    registry_after = build_registry(JobsData("v2", (after,), (), ()), [])
    found = job_detectors.evaluate(registry_before, registry_after, 10.0)
    (oom,) = [f for f in found if f.kind == job_detectors.OOM_KILL]
    assert oom.subjects == {"job": "42", "step": "0"}
    assert oom.evidence["oom_kills"] == 1.0
    assert "step 0" in oom.message and "pid 11 (python3)" in oom.message
    assert "1.0 GiB" in oom.message
    # No change, no finding; a counter reset (a new cgroup) is no kill either.
    assert not [
        f
        for f in job_detectors.evaluate(registry_after, registry_after, 10.0)
        if f.kind == job_detectors.OOM_KILL
    ]
    assert not [
        f
        for f in job_detectors.evaluate(registry_after, registry_before, 10.0)
        if f.kind == job_detectors.OOM_KILL
    ]


def test_oom_kill_at_the_job_level() -> None:
    before = build_registry(JobsData("v2", (_job(stats=_stats(0)),), (), ()), [])
    after = build_registry(JobsData("v2", (_job(stats=_stats(3)),), (), ()), [])
    (oom,) = [
        f for f in job_detectors.evaluate(before, after, 10.0) if f.kind == job_detectors.OOM_KILL
    ]
    assert oom.subjects == {"job": "42", "step": "job"} and oom.evidence["oom_kills"] == 3.0


def _pressure(avg60: float) -> Cgroup:
    line = PressureLine(avg60 + 5, avg60, avg60 / 2, 1000)
    return Cgroup(
        path="/x",
        depth=3,
        type="domain",
        controllers=None,
        nr_children=0,
        memory_current=3 * GIB,
        memory_max=Limit(4 * GIB),
        memory_pressure=Pressure(some=line, full=line),
    )


def test_memory_pressure_threshold() -> None:
    def kinds(avg60: float) -> list[str]:
        reg = build_registry(JobsData("v2", (_job(stats=_pressure(avg60)),), (), ()), [])
        return [f.kind for f in job_detectors.evaluate(None, reg, 10.0)]

    assert kinds(10.0) == [job_detectors.MEMORY_PRESSURE]
    assert kinds(9.99) == []
    reg = build_registry(JobsData("v2", (_job(stats=_pressure(25.0)),), (), ()), [])
    (f,) = job_detectors.evaluate(None, reg, 10.0)
    assert f.evidence["value"] == 25.0 and "3.0 GiB of 4.0 GiB" in f.message


def _snapshot(data: JobsData, wall: float = 1000.0, previous: JobsData | None = None) -> Snapshot:
    current = {"jobs": SourceSample("jobs", wall, 0.0, data)}
    prev = {"jobs": SourceSample("jobs", wall - 5, 0.0, previous)} if previous else {}
    return Snapshot(cycle=1, monotonic=wall, wall_time=wall, current=current, previous=prev)


def test_detect_uses_the_source_pair_and_config(tmp_path: Path) -> None:
    before = JobsData("v2", (_job(stats=_stats(0)),), (), ())
    after = JobsData("v2", (_job(stats=_stats(2)),), (), ())
    snap = _snapshot(after, previous=before)
    assert [f.kind for f in job_detectors.detect(None, snap, default_config().detectors.jobs)] == [
        job_detectors.OOM_KILL
    ]
    off = from_mapping({"detectors": {"jobs": {"enabled": False}}})
    assert job_detectors.detect(None, snap, off.detectors.jobs) == []
    with pytest.raises(ConfigError):
        from_mapping({"detectors": {"jobs": {"memory_pressure_percent": 0}}})


def test_placement_views_come_from_the_registry(tmp_path: Path) -> None:
    from nodescope.sources.nvml import GpuProcess, GpuSample, NvmlData

    gpu = GpuSample(
        0,
        "GPU-0",
        "H100",
        "0000:1b:00.0",
        None,
        None,
        None,
        None,
        5,
        16,
        5,
        16,
        0,
        90,
        50,
        0,
        0,
        0,
        (GpuProcess(101, None),),
        (),
        (),
    )
    data = read_jobs(v2_tree(tmp_path))
    snap = Snapshot(
        cycle=1,
        monotonic=1.0,
        wall_time=1.0,
        current={
            "jobs": SourceSample("jobs", 1.0, 0.0, data),
            "nvml": SourceSample("nvml", 1.0, 0.0, NvmlData(1, (gpu,), (), (), None, ())),
        },
    )
    (view,) = snap.derived.job_views
    assert (view.job_id, view.gpus, view.hcas, view.hca_source) == ("42", (0,), (), "NCCL_IB_HCA")
    assert [j.job_id for j in snap.derived.jobs] == ["42", "77"]


# ---------------------------------------------------------------------------------------------
# Metrics


def _exposition(snapshot: Snapshot) -> dict[str, list[tuple[dict[str, str], float]]]:
    registry = CollectorRegistry()
    collector = SnapshotCollector([job_metrics.families])
    collector.set_snapshot(snapshot)
    registry.register(collector)
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def test_job_metrics_and_finished_jobs_disappear(tmp_path: Path) -> None:
    data = read_jobs(v2_tree(tmp_path))
    series = _exposition(_snapshot(data))
    info = {labels["job_id"]: labels for labels, _ in series["nodescope_job_info"]}
    assert info["42"] == {
        "job_id": "42",
        "user": "alice",
        "partition": "",
        "layout": "v2",
        "registered": "false",
        "gpu_source": "environ",
    }
    assert info["77"]["layout"] == "v2-sluid"
    assert sorted((lab["job_id"], lab["gpu"]) for lab, _ in series["nodescope_job_gpu_info"]) == [
        ("42", "0"),
        ("42", "1"),
    ]
    value = {
        (name, tuple(sorted(lab.items()))): v for name, rows in series.items() for lab, v in rows
    }
    assert value[("nodescope_job_memory_current_bytes", (("job_id", "42"),))] == 3 * GIB
    assert value[("nodescope_job_memory_peak_bytes", (("job_id", "42"),))] == 4 * GIB
    assert value[("nodescope_job_memory_requested_bytes", (("job_id", "42"),))] == GIB
    assert ("nodescope_job_memory_max_bytes", (("job_id", "42"),)) not in value  # max
    assert value[("nodescope_job_memory_max_bytes", (("job_id", "77"),))] == 8 * GIB
    assert (
        value[("nodescope_job_memory_events_total", (("event", "oom_kill"), ("job_id", "42")))] == 1
    )
    assert value[
        (
            "nodescope_job_pressure_stall_seconds_total",
            (("job_id", "42"), ("kind", "full"), ("resource", "memory")),
        )
    ] == pytest.approx(0.7)
    assert (
        value[
            (
                "nodescope_job_io_bytes_total",
                (("device", "259:0"), ("direction", "write"), ("job_id", "42")),
            )
        ]
        == 8192
    )
    assert value[("nodescope_job_cpu_usage_seconds_total", (("job_id", "42"),))] == 5.0
    assert value[("nodescope_job_pids_current", (("job_id", "42"),))] == 9
    assert value[("nodescope_job_escaped_threads", (("job_id", "42"),))] == 1
    # Only job_id (and one bounded label) on per-job series.
    for name, rows in series.items():
        if name not in ("nodescope_job_info", "nodescope_job_gpu_info"):
            for labels, _ in rows:
                assert (
                    set(labels) - {"job_id", "event", "resource", "kind", "device", "direction"}
                    == set()
                )
    # Job 42 finishes: its cgroup is gone, and so are its series.
    finished = JobsData("v2", tuple(j for j in data.jobs if j.job_id != "42"), (), data.others)
    after = _exposition(_snapshot(finished))
    assert all(lab.get("job_id") != "42" for rows in after.values() for lab, _ in rows)
    assert _exposition(_snapshot(JobsData("v2", (), (), ()))) == {}


# ---------------------------------------------------------------------------------------------
# The health gate


def test_gate_checks() -> None:
    settings = SlurmSettings(expected_gpus=8, min_link_gen=4, required_modules=("nvidia",))
    healthy = GateInputs(8, "NVML", (), ((0, 16, 16, 5),), ())
    assert all(c.ok for c in gate_checks(settings, healthy))
    assert unfit_reason(gate_checks(settings, healthy)) is None
    sick = GateInputs(
        2,
        "/dev/nvidia<N>",
        (("3", 79, 1), ("1", 13, 4)),
        ((0, 8, 16, 5), (1, 16, 16, 3)),
        ("nvidia",),
    )
    checks = {c.name: c for c in gate_checks(settings, sick)}
    assert not any(c.ok for c in checks.values())
    assert checks["gpus"].detail == "expected 8 GPUs, found 2 (/dev/nvidia<N>)"
    assert "Xid 79 on GPU 3" in checks["xid"].detail and "Xid 13" not in checks["xid"].detail
    assert "GPU 0 link x8 of x16" in checks["links"].detail
    assert "GPU 1 link Gen3 below Gen4" in checks["links"].detail
    reason = unfit_reason(checks.values())
    assert reason is not None and reason.startswith("nodescope: expected 8 GPUs")
    assert "\n" not in reason and len(reason) <= 200
    # What the daemon does not know (it is down) is not checked; off switches are honoured.
    assert [c.name for c in gate_checks(settings, GateInputs(8, "x", None, None, ()))] == [
        "gpus",
        "modules",
    ]
    assert gate_checks(SlurmSettings(xid_codes=(), check_link_width=False), sick) == []
    assert unfit_reason([Check("a", True, "fine")]) is None


def test_local_gate_reads(tmp_path: Path) -> None:
    roots = Roots.under(tmp_path)
    (roots.dev).mkdir(parents=True)
    (roots.dev / "nvidia0").write_text("a regular file is no GPU")
    if os.geteuid() == 0:
        os.mknod(roots.dev / "nvidia1", 0o600 | 0o020000, os.makedev(195, 1))
        os.mknod(roots.dev / "nvidiactl", 0o600 | 0o020000, os.makedev(195, 255))
    assert count_dev_gpus(roots) == (1 if os.geteuid() == 0 else 0)
    (roots.sysfs / "module" / "nvidia").mkdir(parents=True)
    assert missing_modules(roots, ("nvidia", "nvlink_counter")) == ("nvlink_counter",)


def test_config_slurm_section() -> None:
    cfg = from_mapping({"slurm": {"expected_gpus": 8, "xid_codes": [79], "slurm_user": "slurm"}})
    assert cfg.slurm.expected_gpus == 8 and cfg.slurm.xid_codes == (79,)
    for bad in (
        {"slurm": {"timeout_seconds": 5.0}},
        {"slurm": {"xid_codes": ["79"]}},
        {"slurm": {"reports_dir": "relative"}},
        {"slurm": {"expected_gpus": -1}},
        {"slurm": {"unknown": 1}},
    ):
        with pytest.raises(ConfigError):
            from_mapping(bad)


def test_job_request_from_the_hook_environment() -> None:
    env = {
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_UID": "1000",
        "SLURM_JOB_USER": "alice",
        "SLURM_JOB_GPUS": "1,0",
        "SLURM_JOB_PARTITION": "gpu",
        "SLURM_JOB_EXIT_CODE": "0",
    }
    job = JobRequest.from_environ(env)
    assert job == JobRequest("7", 1000, "alice", "gpu", (0, 1), "0")
    assert JobRequest.from_request(job.as_request()) == job
    with pytest.raises(ValueError):
        JobRequest.from_environ({})
    with pytest.raises(ValueError):
        JobRequest.from_request({"job_id": "../x"})


# ---------------------------------------------------------------------------------------------
# Reports


def _sample(t: float, pcie: int, disk: int, xid: int = 0) -> dict[str, Any]:
    return {
        "wall_time": t,
        "gpus": {
            "0": {
                "pcie_tx_bytes": pcie,
                "pcie_tx_bits": 64,
                "pcie_rx_bytes": 2 * pcie,
                "nvlink_tx_bytes": 10 * pcie,
                "nvlink_errors": 0,
            },
            "1": {"pcie_tx_bytes": 5 * pcie},
        },
        "xids": {"0:79": xid} if xid else {},
        "infiniband": {"mlx5_0/1": {"tx_bytes": pcie, "rx_bytes": pcie, "errors": 0}},
        "disks": {"nvme0n1": {"read_bytes": disk, "written_bytes": disk}},
    }


def test_counter_deltas() -> None:
    deltas = counter_deltas(_sample(100.0, 1000, 0), _sample(160.0, 6000, 512, xid=1), gpus=[0])
    assert deltas["seconds"] == 60.0
    assert deltas["gpus"] == {
        "0": {
            "pcie_tx_bytes": 5000,
            "pcie_rx_bytes": 10000,
            "nvlink_tx_bytes": 50000,
            "nvlink_errors": 0,
        }
    }
    assert deltas["xids"] == [{"gpu": "0", "xid": 79, "count": 1}]
    assert deltas["infiniband"]["mlx5_0/1"]["tx_bytes"] == 5000
    assert deltas["disks"]["nvme0n1"] == {"read_bytes": 512, "written_bytes": 512}
    # A counter that went backwards (driver reload) gives no delta rather than a guess.
    assert (
        "pcie_tx_bytes" not in counter_deltas(_sample(0, 9000, 0), _sample(1, 10, 0))["gpus"]["0"]
    )


def _report() -> dict[str, Any]:
    window = JobWindow("42", 100.0, 160.0, peak_memory=3 * GIB, memory_limit=4 * GIB, oom_kills=1)
    for i in range(10):
        window.add_sample(
            100.0 + 6 * i,
            {"memory_bytes": float(i * GIB / 3), "gpu_pcie_bytes_per_second": float(i % 3) * 1e9},
        )
    registration = {
        "registered_at": 100.0,
        "user": "alice",
        "gpus": [0],
        "baseline": _sample(100.0, 1000, 0),
    }
    finding = {
        "key": "job_cgroup_escape{job=42}",
        "kind": "job_cgroup_escape",
        "severity": "warning",
        "message": "job 42: escaped",
        "first": 110.0,
        "last": 150.0,
        "seconds": 40.0,
    }
    contention = {
        "key": "pcie_contention{link=0000:16:01.0}",
        "kind": "pcie_contention",
        "severity": "warning",
        "start": 120.0,
        "end": 125.0,
        "seconds": 5.0,
    }
    return build_report(
        JobRequest("42", 1000, "alice", "gpu", (0,), "0:0"),
        registration,
        _sample(160.0, 6000, 4096),
        160.0,
        daemon=True,
        window=window,
        findings=[finding],
        contention=[contention],
    )


def test_report_document_and_rendering() -> None:
    report = _report()
    assert report["format"] == "nodescope-job-report/1"
    assert report["duration_seconds"] == 60.0
    assert report["deltas"]["gpus"]["0"]["pcie_tx_bytes"] == 5000
    assert report["memory"] == {"peak_bytes": 3 * GIB, "limit_bytes": 4 * GIB, "oom_kills": 1}
    assert report["verdict"] == {"ok": True, "reason": None}
    json.dumps(report, allow_nan=False)
    text = render_text(report, width=30)
    assert "job 42  user alice  partition gpu  GPUs 0" in text
    assert "memory: peak 3.2 GB  limit 4.3 GB  OOM kills 1" in text
    assert "job_cgroup_escape" in text and "40 s" in text
    timeline = [line for line in text.splitlines() if line.startswith("  memory bytes")]
    assert len(timeline) == 1 and "█" in timeline[0]
    bar = next(line for line in text.splitlines() if line.startswith("  job_cgroup_escape"))
    # 110..150 of 100..160 on 30 columns: the bar starts after a sixth and ends before the end.
    inner = bar.split("|")[1]
    assert inner.startswith(" " * 4) and inner.rstrip().endswith("━") and inner.endswith(" ")
    svg = render_svg(report)
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    assert svg.count("<polyline") == 2 and "job_cgroup_escape" in svg and "#ff7f0e" in svg


def test_report_fails_when_a_gpu_is_still_held() -> None:
    report = build_report(
        JobRequest("42", gpus=(1,)),
        None,
        _sample(1.0, 0, 0),
        1.0,
        daemon=False,
        holders=[{"pid": 999, "gpu": 1, "comm": "python3"}],
    )
    assert report["verdict"]["ok"] is False
    assert report["verdict"]["reason"] == (
        "nodescope: job 42 GPU(s) still held after the job: pid 999 (python3) on GPU 1"
    )
    assert report["deltas"] is None and report["daemon"] is False
    assert "still holding GPU 1 after the job: pid 999 (python3)" in render_text(report)


def test_sparkline() -> None:
    assert sparkline([0.0, 4.0, 8.0], 3) == "▁▄█"
    assert sparkline([None, 1.0], 2) == " █"
    assert sparkline([], 5) == ""
    assert len(sparkline([float(i) for i in range(1000)], 40)) == 40


def test_window_keeps_long_jobs_bounded() -> None:
    window = JobWindow("1", 0.0, 0.0)
    for i in range(2000):
        window.add_sample(float(i), {"memory_bytes": float(i)})
    timeline = window.timeline()
    assert len(timeline["t"]) <= 720 and timeline["t"][0] == 0.0
    assert len(timeline["series"]["memory_bytes"]) == len(timeline["t"])


def test_on_axis_holds_values_between_samples() -> None:
    assert on_axis([0.0, 5.0], [1.0, 2.0], 0.0, 10.0, 10) == [1.0] * 5 + [2.0] + [None] * 4
    assert on_axis([], [], 0.0, 10.0, 3) == [None, None, None]


@pytest.mark.slow  # a whole scenario replayed
def test_escaped_nccl_threads_scenario(tmp_path: Path) -> None:
    """The bundled scenario: the ranks outside the job and the step-only memory.max are found,
    and nothing else is (a few simulated seconds suffice: the condition holds from t=0)."""
    import dataclasses

    from nodescope.sim.driver import replay
    from nodescope.sim.scenario import load_scenario

    scenario = dataclasses.replace(load_scenario("escaped-nccl-threads"), duration_seconds=1.0)
    result = replay(scenario, tmp_path / "root")
    assert result.passed, [(f.expectation, f.status, f.reason) for f in result.findings] + [
        m.expectation for m in result.failures
    ]
    assert len(result.findings) == 3  # two expected findings and "no other findings"
    found = sorted(e.subject for e in result.timeline if e.kind == "finding")
    assert found == [
        "job_cgroup_escape{job=81750}",
        "job_memory_limit_not_applied{job=81750}",
    ]


# ---------------------------------------------------------------------------------------------
# The jobs from the shared cgroup walk


def _from_directories(roots: Roots) -> tuple[list[JobCgroup], tuple[Any, ...]]:
    """Jobs and other cgroups as the directory readers find them, one file at a time."""
    root = roots.cgroupfs
    found = source.find_v2_jobs(root)
    jobs = [source.read_v2_job(roots, root, *entry) for entry in found]
    others, truncated = source.read_others_v2(root, (d for *_, d in found))
    assert not truncated
    return [j for j in jobs if j is not None], others


def test_the_walk_gives_what_the_directories_give(tmp_path: Path) -> None:
    roots = v2_tree(tmp_path)
    # A limit above the job directories: the walk finds it on the way up.
    _write(roots.cgroupfs / SCOPE / "memory.max", f"{16 * GIB}\n")
    data = read_jobs(roots)
    jobs, others = _from_directories(roots)
    assert sorted(data.jobs, key=lambda j: j.key) == sorted(jobs, key=lambda j: j.key)
    assert data.others == others
    assert data.jobs[0].memory_limit_bytes == GIB
    assert data.jobs[1].memory_limit_bytes == 8 * GIB
    assert data.jobs[1].tasks[0].memory_max_bytes == 8 * GIB


def test_the_jobs_source_takes_the_cgroups_walk_of_its_cycle(tmp_path: Path) -> None:
    from nodescope.sources import cgroup

    roots = v2_tree(tmp_path)
    shared = CycleWalk()
    cgroups = cgroup.CgroupSource(walk=shared)
    jobs = source.JobsSource(slow_every=10, walk=shared)
    shared.begin_cycle({"cgroups", "jobs"})
    cgroups.collect(roots)
    walks = shared.walker.walks
    assert jobs.collect(roots) == read_jobs(roots)
    assert shared.walker.walks == walks  # no walk of its own in the same cycle
    shared.begin_cycle({"jobs"})
    assert jobs.collect(roots) == read_jobs(roots)
    assert shared.walker.walks == walks + 1  # the next cycle walks again


def test_environments_are_read_for_new_processes_and_on_slow_runs(tmp_path: Path) -> None:

    roots = v2_tree(tmp_path)
    jobs = source.JobsSource(slow_every=3)

    def task(data: JobsData, pid: int) -> JobTask:
        return next(t for j in data.jobs for t in j.tasks if t.pid == pid)

    assert task(jobs.collect(roots), 101).env("NCCL_IB_HCA") == "mlx5_0"
    environ = roots.procfs / "101" / "environ"
    environ.write_bytes(environ.read_bytes().replace(b"mlx5_0", b"mlx5_1"))
    # A new process of the job is read at once.
    _write(
        roots.cgroupfs / SCOPE / "job_42" / "step_0" / "user" / "task_0" / "cgroup.procs",
        "101\n104\n",
    )
    _process(roots.procfs, 104, "python3", {"NCCL_IB_HCA": "mlx5_4"}, f"/{SCOPE}/job_42")
    second = jobs.collect(roots)
    assert task(second, 104).env("NCCL_IB_HCA") == "mlx5_4"
    assert task(second, 101).env("NCCL_IB_HCA") == "mlx5_0"
    assert task(jobs.collect(roots), 101).env("NCCL_IB_HCA") == "mlx5_0"
    fourth = jobs.collect(roots)
    assert task(fourth, 101).env("NCCL_IB_HCA") == "mlx5_1"
    assert fourth == read_jobs(roots)
    # Every run reads them when told to read everything.
    jobs.slow_every = 1
    environ.write_bytes(environ.read_bytes().replace(b"mlx5_1", b"mlx5_2"))
    assert task(jobs.collect(roots), 101).env("NCCL_IB_HCA") == "mlx5_2"


@pytest.mark.slow  # two scenarios replayed twice
@pytest.mark.parametrize("name", ["escaped-nccl-threads", "allreduce-hang-nfs-lock"])
def test_production_cadence_reads_what_reading_everything_reads(tmp_path: Path, name: str) -> None:
    """On a simulated node whose limits and environments do not change, the sources at their
    production cadence (shared walk, static files and environments every tenth run) give the
    records that reading every file gives, run after run, while the counters move."""
    from nodescope.sim.node import SimulatedNode
    from nodescope.sim.scenario import load_scenario
    from nodescope.sources import cgroup, procs, threads
    from nodescope.sources.base import Source

    node = SimulatedNode(load_scenario(name), tmp_path / "root")
    node.materialise()
    shared = CycleWalk()
    production: list[Source] = [
        cgroup.CgroupSource(walk=shared),
        procs.ProcsSource(walk=shared),
        threads.ThreadsSource(walk=shared),
        source.JobsSource(walk=shared),
    ]
    reference: list[Source] = [
        cgroup.CgroupSource(slow_every=1, walk=CycleWalk(slow_every=1)),
        procs.ProcsSource(slow_every=1, walk=CycleWalk(slow_every=1)),
        threads.ThreadsSource(walk=CycleWalk(slow_every=1)),
        source.JobsSource(slow_every=1, walk=CycleWalk(slow_every=1)),
    ]
    walks = []
    for t in range(0, 26, 5):
        node.advance_to(float(t))
        shared.begin_cycle({s.name for s in production})
        before = shared.walker.walks
        for fast, full in zip(production, reference, strict=True):
            assert fast.collect(node.roots) == full.collect(node.roots), (fast.name, t)
        walks.append(shared.walker.walks - before)
    assert walks == [1] * len(walks)  # one walk per cycle for cgroups, procs, threads, jobs
