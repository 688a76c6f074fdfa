"""The simulated node in a process of its own (``python -m nodescope.sim.run_node``): the
NVML state file and its mirror, job churn, the stepped and real-time modes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest

from nodescope.roots import Roots
from nodescope.sim.churn import FIRST_JOB_ID, JobChurn
from nodescope.sim.fake_nvml import FakeNvml, FakeProcess, hgx_h100
from nodescope.sim.node import SimulatedNode, make_temp_root
from nodescope.sim.nvml_mirror import MirroredNvml, XidRecorder, state_document, write_state
from nodescope.sim.run_node import STATE_FILE
from nodescope.sim.scenario import load_scenario
from nodescope.sources.jobs import read_jobs
from nodescope.sources.nvml import NvmlSource

SMALL = (
    '{"format": "nodescope-scenario/1", "name": "small", "duration_seconds": 10,'
    ' "hardware": {"base": "dgx-h100", "os": {"background_processes": 30},'
    ' "gpus": {"2": null, "3": null, "4": null, "5": null, "6": null, "7": null}},'
    ' "jobs": [{"id": 7, "user": "u", "uid": 1000, "gpus": [0],'
    ' "processes": [{"key": "r", "comm": "python3", "gpu": "each", "count": 1}]}],'
    ' "timeline": [{"kind": "gpu_pcie", "gpu": 1, "h2d_bytes_per_second": 1e9,'
    ' "d2h_bytes_per_second": 1e8}]}'
)


@pytest.fixture
def scenario_file(tmp_path: Path) -> Path:
    path = tmp_path / "small.json"
    path.write_text(SMALL)
    return path


@pytest.fixture
def root() -> Iterator[Path]:
    base = make_temp_root("nodescope-test-")
    try:
        yield base / "node"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _fake() -> FakeNvml:
    gpus = hgx_h100(2, links=4)
    gpus[0].processes = [FakeProcess(4242, 2**30), FakeProcess(4243, None)]
    gpus[1].links[2].errors = {1: 7}
    gpus[1].unsupported = {"nvmlDeviceGetJpgUtilization"}
    return FakeNvml(gpus, clock_us=lambda: 1_750_000_000_000_000)


def test_the_mirror_holds_the_gpus_the_state_file_describes(tmp_path: Path) -> None:
    fake = _fake()
    path = tmp_path / STATE_FILE
    write_state(path, state_document(fake, 0.0, 1.75e9, []))
    mirror = MirroredNvml(path)
    assert [asdict(g) for g in mirror.gpus] == [asdict(g) for g in fake.gpus]
    assert not mirror.refresh()  # nothing new

    recorder = XidRecorder(fake)
    fake.gpus[0].pcie_rx_bytes += 123
    fake.gpus[1].links[3].data_tx_kib = 99
    fake.gpus[0].processes = [FakeProcess(5000, 1)]
    fake.gpus[1].lost = True
    fake.inject_xid(1, 79)
    write_state(path, state_document(fake, 2.0, 1.75e9, recorder.drain()))
    mirror.nvmlInit()
    event_set = mirror.nvmlEventSetCreate()
    mirror.nvmlDeviceRegisterEvents(mirror.handle(0), mirror.gpus[0].supported_events, event_set)
    mirror.nvmlDeviceRegisterEvents(mirror.handle(1), mirror.gpus[1].supported_events, event_set)
    assert mirror.refresh()
    assert [asdict(g) for g in mirror.gpus] == [asdict(g) for g in fake.gpus]
    assert mirror.wall_clock() == 1.75e9 + 2.0
    event = mirror.nvmlEventSetWait(event_set, 0)
    assert (event.eventData, mirror.gpus[1].lost) == (79, True)
    assert mirror.refreshes == 1 and mirror.refresh_cpu_seconds > 0


def test_the_nvml_source_reads_the_same_through_the_mirror(tmp_path: Path) -> None:
    fake = _fake()
    path = tmp_path / STATE_FILE
    # The fake's clock reads the epoch; the mirror's is the state's t (0) past it.
    write_state(path, state_document(fake, 0.0, 1.75e9, []))
    mirror = MirroredNvml(path)
    clock = lambda: 1.75e9  # noqa: E731
    direct = NvmlSource(fake, watch_xids=False, wall_clock=clock)
    mirrored = NvmlSource(mirror, watch_xids=False, wall_clock=clock)
    try:
        assert mirrored.collect(Roots()) == direct.collect(Roots())
    finally:
        direct.close()
        mirrored.close()


def test_a_torn_or_foreign_state_file_is_refused(tmp_path: Path) -> None:
    from nodescope.errors import ParseError

    path = tmp_path / STATE_FILE
    path.write_text('{"format": "nodescope-nvml-state/1", "gpus": [')
    with pytest.raises(ParseError, match=STATE_FILE):
        MirroredNvml(path)
    path.write_text('{"format": "something-else"}')
    with pytest.raises(ParseError, match="not a nodescope-nvml-state/1 document"):
        MirroredNvml(path)


def test_churn_jobs_come_and_go_through_the_jobs_source(scenario_file: Path, root: Path) -> None:
    node = SimulatedNode(load_scenario(str(scenario_file)), root)
    node.materialise()
    churn = JobChurn(node.roots, node.nvml, slots=2, every=3)
    seen: list[set[str]] = []
    for tick in range(1, 8):
        node.advance_to(float(tick))
        churn.apply(float(tick))
        jobs = read_jobs(node.roots)
        ids = {j.job_id for j in jobs.jobs if j.job_id is not None}
        assert churn.active_ids() <= ids
        assert not ids & {str(j) for j in churn.ended}
        assert "7" in ids  # the scenario's own job is left alone
        seen.append(churn.active_ids())
        for job in jobs.jobs:
            if job.job_id in churn.active_ids():
                assert len(job.tasks) == 4
                assert job.stats is not None and job.stats.memory_current == 4 * 512 * 2**20
    # A job ended and one started at ticks 3 and 6; pids of ended jobs are gone.
    assert churn.ended == [FIRST_JOB_ID, FIRST_JOB_ID + 1]
    assert seen[0] == {str(FIRST_JOB_ID), str(FIRST_JOB_ID + 1)}
    assert seen[-1] == {str(FIRST_JOB_ID + 2), str(FIRST_JOB_ID + 3)}
    gone = [p for p in os.listdir(node.roots.procfs) if p.isdigit() and int(p) < 3_000_024]
    assert not [p for p in gone if int(p) >= 3_000_000]
    # Their ranks are compute processes of their GPUs in the fake NVML.
    ranks = {p.pid for g in node.nvml.gpus for p in g.processes}
    assert {job.pids[0] for job in churn.jobs} <= ranks


def _start(scenario: Path, root: Path, *extra: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "nodescope.sim.run_node", str(scenario), str(root), *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready"
    return process


def test_stepped_mode_answers_each_step(scenario_file: Path, root: Path) -> None:
    process = _start(scenario_file, root, "--stepped", "--churn-slots", "1", "--churn-every", "2")
    assert process.stdin is not None and process.stdout is not None
    try:
        replies = []
        for t in (1, 2, 3):
            process.stdin.write(f"{t}\n")
            process.stdin.flush()
            replies.append(json.loads(process.stdout.readline()))
        state = json.loads((root / STATE_FILE).read_text())
        assert state["t"] == 3.0 and len(state["gpus"]) == 2
        assert [r["t"] for r in replies] == [1.0, 2.0, 3.0]
        assert replies[1]["ended"] == [str(FIRST_JOB_ID)]
        assert replies[1]["active"] == [str(FIRST_JOB_ID + 1)]
        process.stdin.close()
        assert process.wait(30) == 0
    finally:
        process.kill()
        process.wait()


def test_real_time_mode_ticks_until_sigterm(scenario_file: Path, root: Path) -> None:
    process = _start(scenario_file, root, "--tick", "0.2")
    try:
        deadline = time.monotonic() + 20
        t = 0.0
        while time.monotonic() < deadline and t < 0.6:
            time.sleep(0.1)
            t = json.loads((root / STATE_FILE).read_text())["t"]
        assert t >= 0.6
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0
    finally:
        process.kill()
        process.wait()
