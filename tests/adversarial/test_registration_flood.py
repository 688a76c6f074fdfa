"""Prolog registrations cannot grow the jobs source's work or the job series, and leaked ones
expire.

Finding: 20,000 registrations (``<run>/nodescope/jobs/<id>.json``) made the ``jobs`` source
parse every one on each run until it timed out for good, 2,000 gave 2,000 ``job_info``
series, and a registration whose epilog never came stayed forever. Now the source reads at
most ``[slurm] max_registrations`` (the rest counted), parses a file only when it changed,
the prolog refuses to register past the cap with a message that says so (the job runs), and a
registration expires once the job has no cgroup and Slurm no longer knows it: asked of a real
single-node Slurm cluster where Debian's slurm-wlm is installed.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from nodescope.assembly import default_config
from nodescope.config import Config
from nodescope.hooks.auth import Peer
from nodescope.hooks.registrations import (
    GRACE_SECONDS,
    RegistrationExpiry,
    expire_registrations,
)
from nodescope.hooks.tracker import JobTracker
from nodescope.model.job_records import (
    DEFAULT_MAX_REGISTRATIONS,
    JOBS,
    REGISTRATION_FORMAT,
    JobsData,
    registrations_dir,
)
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.remediation.slurm import Scontrol, SlurmError
from nodescope.roots import Roots
from nodescope.sources import jobs
from nodescope_exporters import job_metrics
from nodescope_exporters.prometheus import render
from tests.adversarial.common import one_cycle, skipped_metric
from tests.hook_peers import hook_env, run_hook
from tests.integration.slurm_harness import SlurmCluster, skip_reason

FLOOD = 20_000
ROOT = Peer(os.getpid(), 0, 0)


def _registration(job: str, registered_at: float) -> str:
    # As the prolog writes one (hooks.tracker.write_registration).
    document = {
        "format": REGISTRATION_FORMAT,
        "job_id": job,
        "uid": 1000,
        "user": "alice",
        "partition": "gpu",
        "gpus": [0],
        "node": "n1",
        "registered_at": registered_at,
        "baseline": {},
    }
    return json.dumps(document) + "\n"


def _flood(directory: Path, jobs_ids: range, age: float = 0.0) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    when = time.time() - age
    for job in jobs_ids:
        path = directory / f"{job}.json"
        path.write_text(_registration(str(job), when))
        if age:
            os.utime(path, (when, when))


def _roots(tmp_path: Path) -> Roots:
    (tmp_path / "cgroup").mkdir(exist_ok=True)
    return Roots(run=tmp_path / "run", cgroupfs=tmp_path / "cgroup", dev=tmp_path / "dev")


def _job_info_series(snapshot: Snapshot) -> int:
    text = render(snapshot, [job_metrics.families]).decode()
    return sum(1 for line in text.splitlines() if line.startswith("nodescope_job_info{"))


def test_a_flood_of_registrations_is_capped_counted_and_parsed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    roots = _roots(tmp_path)
    _flood(registrations_dir(roots), range(1, FLOOD + 1))
    parsed: list[str] = []
    real_parse = jobs.parse_registration

    def counting(text: str, source: str = "registration.json") -> jobs.Registration:
        parsed.append(source)
        return real_parse(text, source)

    monkeypatch.setattr(jobs, "parse_registration", counting)
    source = jobs.make_source()
    start = time.monotonic()
    snapshot = one_cycle(roots, source, timeout=10.0)
    first = time.monotonic() - start
    data = snapshot.latest(JOBS)
    assert data is not None, snapshot.current[jobs.NAME].error
    assert len(data.registrations) == DEFAULT_MAX_REGISTRATIONS
    # The newest job ids are kept; every one left out is counted.
    assert data.registrations[-1].job_id == str(FLOOD)
    assert skipped_metric(snapshot)[(jobs.NAME, jobs.REGISTRATION_OVER_CAP)] == (
        FLOOD - DEFAULT_MAX_REGISTRATIONS
    )
    assert _job_info_series(snapshot) == DEFAULT_MAX_REGISTRATIONS
    assert len(parsed) == DEFAULT_MAX_REGISTRATIONS

    # The collector closed the source: its next run parses again, the one after that
    # parses nothing unchanged; a replaced file is parsed again.
    source.collect(roots)
    parsed.clear()
    again = source.collect(roots)
    assert parsed == [] and again.registrations == data.registrations
    replaced = registrations_dir(roots) / f"{FLOOD}.json"
    temporary = replaced.with_name(".tmp")
    temporary.write_text(_registration(str(FLOOD), 5.0))
    temporary.rename(replaced)
    later = source.collect(roots)
    assert parsed == [str(replaced)]
    assert later.registrations[-1].registered_at == 5.0
    source.close()
    assert first < 10.0


def _config(tmp_path: Path, cap: int) -> tuple[Config, Path]:
    config = default_config()
    roots = _roots(tmp_path)
    config = replace(
        config,
        roots=roots,
        slurm=replace(
            config.slurm, reports_dir=str(tmp_path / "reports"), scontrol="",
            max_registrations=cap,
        ),
    )  # fmt: skip
    path = tmp_path / "nodescope.toml"
    path.write_text(
        f'[roots]\nrun = "{roots.run}"\ndev = "{roots.dev}"\ncgroupfs = "{roots.cgroupfs}"\n'
        f'[slurm]\nreports_dir = "{tmp_path / "reports"}"\nscontrol = ""\n'
        f"max_registrations = {cap}\n"
    )
    return config, path


def _jobs_snapshot(job_ids: tuple[str, ...]) -> Snapshot:
    data = JobsData("v2", (), (), (), False)
    cgroups = tuple(
        jobs.JobCgroup(
            key=f"job_{j}", job_id=j, layout="v2", path=f"/system.slice/job_{j}", uid=1000,
            stats=None, steps=(), tasks=(), memory_limit_bytes=None, gpu_minors=None,
        )
        for j in job_ids
    )  # fmt: skip
    data = replace(data, jobs=cgroups)
    return Snapshot(1, time.time(), 1.0, {"jobs": SourceSample("jobs", 1.0, 0.0, data)})


def test_the_prolog_expires_leaked_registrations_then_refuses_past_the_cap(
    tmp_path: Path,
) -> None:
    config, config_path = _config(tmp_path, cap=3)
    directory = registrations_dir(config.roots)
    # Three leaked registrations, two days old: job 2 still has its cgroup.
    _flood(directory, range(1, 4), age=2 * 86400)
    tracker = JobTracker(lambda: config)
    tracker.latest = _jobs_snapshot(("2",))
    now = time.time()
    answer = tracker.prolog({"job_id": "10", "issued_at": now, "deadline": now + 2}, ROOT)
    assert answer["ok"] and answer["fit"] and answer["registration_refused"] is None
    assert sorted(p.name for p in directory.iterdir()) == ["10.json", "2.json"]

    _flood(directory, range(11, 12))  # a young one: within the grace, never expired
    now = time.time()
    answer = tracker.prolog({"job_id": "12", "issued_at": now, "deadline": now + 2}, ROOT)
    assert answer["ok"] and answer["fit"], answer
    refused = answer["registration_refused"]
    assert "job 12 not registered" in refused and "max_registrations" in refused
    assert not (directory / "12.json").exists()
    # A job already registered is registered again (its prolog retried), cap or not.
    answer = tracker.prolog({"job_id": "11", "issued_at": now, "deadline": now + 2}, ROOT)
    assert answer["registration_refused"] is None

    # The hook on its own (no daemon answering) says the same and lets the job run.
    hook = run_hook("prolog", config_path, hook_env("13"))
    assert hook.returncode == 0, hook.stderr
    assert "job 13 not registered" in hook.stderr and "max_registrations" in hook.stderr
    assert not (directory / "13.json").exists()


def test_without_slurm_a_registration_without_cgroup_expires_at_its_age_limit(
    tmp_path: Path,
) -> None:
    config, _ = _config(tmp_path, cap=8)
    directory = registrations_dir(config.roots)
    _flood(directory, range(1, 3), age=2 * 86400)  # older than the age limit
    _flood(directory, range(3, 5), age=2 * GRACE_SECONDS)  # past the grace only
    config = replace(config, slurm=replace(config.slurm, scontrol="/nonexistent/scontrol"))
    removed = RegistrationExpiry.run_pass(config, frozenset({"1"}))
    # Slurm cannot answer: job 1 keeps its cgroup, job 2 is past the age limit.
    assert removed == ["2"]
    assert sorted(p.name for p in directory.iterdir()) == ["1.json", "3.json", "4.json"]


@pytest.fixture
def cluster() -> Iterator[SlurmCluster]:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    work = Path(tempfile.mkdtemp(prefix="nodescope-regs-", dir="/tmp"))
    os.chmod(work, 0o755)
    slurm = SlurmCluster(work / "slurm", gpus=1)
    try:
        slurm.write_config()
        slurm.start()
        yield slurm
    finally:
        slurm.stop()
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.integration
def test_registrations_expire_when_slurm_and_the_cgroups_no_longer_know_the_job(
    tmp_path: Path, cluster: SlurmCluster
) -> None:
    # One after the other: the test node may have room for one job only.
    ended = cluster.sbatch(["--output=/dev/null"], "true")
    assert cluster.wait_job_done(ended, 30) == "COMPLETED"
    running = cluster.sbatch(["--output=/dev/null"], "sleep 120")
    deadline = time.monotonic() + 30
    while cluster.job_state(running) != "RUNNING":
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.2)
    roots = _roots(tmp_path)
    directory = registrations_dir(roots)
    purged = "987654"  # never a job of this cluster: Slurm answers "Invalid job id"
    for job in (running, ended, purged):
        _flood(directory, range(int(job), int(job) + 1), age=2 * GRACE_SECONDS)
    scontrol = Scontrol("/usr/bin/scontrol", 10.0, cluster.env)

    def active(job: str) -> bool | None:
        try:
            return scontrol.job_active(job)
        except SlurmError:
            return None

    assert active(running) is True and active(ended) is False and active(purged) is False
    removed = expire_registrations(roots, frozenset(), time.time(), 86400.0, active)
    assert sorted(removed) == sorted([ended, purged])
    assert [p.name for p in directory.iterdir()] == [f"{running}.json"]
    cluster.client(["scancel", running])
