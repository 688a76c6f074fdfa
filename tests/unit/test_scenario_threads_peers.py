"""The scenario format's thread placement (``thread_cgroups``) and GPU peers (``gpu_peer`` with
a GPU): what the validator refuses, the files the simulated node writes, and what the daemon's
own ``jobs`` source reads of them (a thread outside its job's cgroups is escaped, one in a
threaded cgroup inside the job is not)."""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodescope.errors import ParseError
from nodescope.sim.node import SimulatedNode, make_temp_root
from nodescope.sim.scenario import load_scenario
from nodescope.sources.registry import SOURCES, SourceInputs

ESCAPED = "/system.slice/nccl-pin.service/nccl"


def _document(thread_cgroups: dict[str, str], timeline: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "format": "nodescope-scenario/1",
        "name": "placed",
        "duration_seconds": 5,
        "hardware": {"base": "dgx-h100", "os": {"background_processes": 5}},
        "jobs": [
            {
                "id": 900,
                "user": "ana",
                "uid": 1200,
                "gpus": [0, 1],
                "memory_current_bytes": 1 << 30,
                "processes": [
                    {
                        "key": "rank",
                        "comm": "python3",
                        "count": 2,
                        "gpu": "each",
                        "threads": {"python3": 2, "NCCL Progress 0": 1},
                        "thread_cgroups": thread_cgroups,
                    }
                ],
            }
        ],
        "timeline": timeline,
    }


def _load(tmp_path: Path, doc: dict[str, Any]) -> Any:
    path = tmp_path / "placed.json"
    path.write_text(json.dumps(doc))
    return load_scenario(str(path))


@pytest.mark.parametrize(
    ("placed", "where", "reason"),
    [
        ({"NCCL Proxy": ESCAPED}, "thread_cgroups", "no such thread"),
        ({"NCCL Progress 0": "../x"}, "thread_cgroups", "cgroup path"),
        ({"NCCL Progress 0": "a/./b"}, "thread_cgroups", ". or .."),
    ],
)
def test_thread_cgroups_must_name_a_thread_and_a_path(
    tmp_path: Path, placed: dict[str, str], where: str, reason: str
) -> None:
    with pytest.raises(ParseError) as raised:
        _load(tmp_path, _document(placed, []))
    assert where in str(raised.value) and reason in str(raised.value)


@pytest.mark.parametrize(
    ("peer", "reason"),
    [(0, "not its own peer"), (8, "no GPU 8"), ("nvme99n1", "no NIC or disk")],
)
def test_a_gpu_peer_is_another_existing_gpu(tmp_path: Path, peer: Any, reason: str) -> None:
    activity = {"kind": "gpu_peer", "gpu": 0, "peer": peer, "to_gpu_bytes_per_second": 1e9}
    with pytest.raises(ParseError, match=reason):
        _load(tmp_path, _document({}, [activity]))


@pytest.fixture
def base() -> Iterator[Path]:
    path = make_temp_root("nodescope-test-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _escaped(node: SimulatedNode) -> dict[int, list[tuple[str | None, str | None]]]:
    """What the daemon's jobs source makes of the node: escaped threads per job process."""
    source = SOURCES["jobs"].make(SourceInputs())
    try:
        data = source.collect(node.roots)
    finally:
        source.close()
    return {
        task.pid: [(e.comm, e.cgroup) for e in task.escaped_threads]
        for job in data.jobs
        for task in job.tasks
        if task.comm == "python3"
    }


def test_threads_placed_outside_the_job_are_escaped(tmp_path: Path, base: Path) -> None:
    node = SimulatedNode(_load(tmp_path, _document({"NCCL Progress 0": ESCAPED}, [])), base / "n")
    node.materialise()
    ranks = [node.pid_of("rank", i) for i in range(2)]
    cgroupfs = node.roots.cgroupfs
    target = cgroupfs / ESCAPED.lstrip("/")
    assert (target / "cgroup.type").read_text() == "threaded\n"
    assert not (target / "cgroup.procs").exists()  # a threaded cgroup lists no process
    listed = {int(x) for x in (target / "cgroup.threads").read_text().split()}
    progress = {
        int(d.name)
        for pid in ranks
        for d in (node.roots.procfs / str(pid) / "task").iterdir()
        if (d / "comm").read_text() == "NCCL Progress 0\n"
    }
    assert listed == progress and len(progress) == 2
    for tid in progress:
        pid = next(p for p in ranks if (node.roots.procfs / str(p) / "task" / str(tid)).exists())
        task = node.roots.procfs / str(pid) / "task" / str(tid) / "cgroup"
        assert task.read_text() == f"0::{ESCAPED}\n"
    assert _escaped(node) == {pid: [("NCCL Progress 0", ESCAPED)] for pid in ranks}


def test_threads_in_a_threaded_cgroup_inside_the_job_are_not(tmp_path: Path, base: Path) -> None:
    node = SimulatedNode(_load(tmp_path, _document({"NCCL Progress 0": "nccl"}, [])), base / "n")
    node.materialise()
    task_cgroup = next(
        p for p in node.roots.cgroupfs.rglob("task_0") if "job_900" in str(p) and "step_0" in str(p)
    )
    assert (task_cgroup / "cgroup.type").read_text() == "domain threaded\n"
    assert (task_cgroup / "nccl" / "cgroup.type").read_text() == "threaded\n"
    assert len((task_cgroup / "nccl" / "cgroup.threads").read_text().split()) == 1
    assert _escaped(node) == {node.pid_of("rank", i): [] for i in range(2)}


def test_peer_copies_count_on_both_gpus(tmp_path: Path, base: Path) -> None:
    activity = {
        "kind": "gpu_peer",
        "gpu": 0,
        "peer": 1,
        "to_gpu_bytes_per_second": 4e9,
        "from_gpu_bytes_per_second": 1e9,
    }
    node = SimulatedNode(_load(tmp_path, _document({}, [activity])), base / "n")
    node.materialise()
    node.advance_to(0.0)
    before = [(g.pcie_rx_bytes, g.pcie_tx_bytes) for g in node.nvml.gpus[:2]]
    node.advance_to(2.0)
    after = [(g.pcie_rx_bytes, g.pcie_tx_bytes) for g in node.nvml.gpus[:2]]
    moved = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)]
    # GPU 0 receives 4 GB/s from GPU 1 and sends it 1 GB/s, for two seconds.
    assert moved == [pytest.approx((8e9, 2e9), abs=2), pytest.approx((2e9, 8e9), abs=2)]


# --------------------------------------------------------------------------------------------
# Collective traces dropped in the spool


FIXTURE_TRACES = Path(__file__).resolve().parent.parent / "fixtures" / "torch-traces"
SIM_DATA = Path(load_scenario.__code__.co_filename).parent / "data"


def _trace(tmp_path: Path, path: str, file: str = "rank0.json") -> dict[str, Any]:
    (tmp_path / "t.json").write_text("{}")
    return {"kind": "trace", "from": 2, "job": 900, "file": file, "path": path}


@pytest.mark.parametrize(
    ("path", "file", "reason"),
    [
        ("missing.json", "rank0.json", "no file 'missing.json'"),
        ("t.json", "../rank0.json", "file"),
        ("t.json", ".hidden", "file"),
    ],
)
def test_a_trace_names_an_existing_file_and_a_plain_name(
    tmp_path: Path, path: str, file: str, reason: str
) -> None:
    with pytest.raises(ParseError, match=reason):
        _load(tmp_path, _document({}, [_trace(tmp_path, path, file)]))


def test_the_packaged_traces_are_the_fixtures(tmp_path: Path) -> None:
    for rank in range(4):
        packaged = SIM_DATA / f"torch-trace-late-rank3-0.2s-rank{rank}.json"
        assert packaged.read_bytes() == (FIXTURE_TRACES / f"rank{rank}.json").read_bytes()


@pytest.mark.skipif(os.geteuid() != 0, reason="the job's files are chowned to its uid")
def test_a_trace_appears_in_the_jobs_spool_directory_at_its_time(
    tmp_path: Path, base: Path
) -> None:
    source = FIXTURE_TRACES / "rank3.json"
    doc = _document({}, [_trace(tmp_path, str(source), "rank3.json")])
    node = SimulatedNode(_load(tmp_path, doc), base / "n")
    node.materialise()
    assert node.spool_dir is not None
    assert stat.S_IMODE(node.spool_dir.stat().st_mode) == 0o1733
    node.advance_to(1.0)
    assert not (node.spool_dir / "900").exists()
    node.advance_to(2.0)
    dropped = node.spool_dir / "900" / "rank3.json"
    assert dropped.read_bytes() == source.read_bytes()
    assert dropped.stat().st_uid == dropped.parent.stat().st_uid == 1200
    assert sorted(p.name for p in dropped.parent.iterdir()) == ["rank3.json"]
    # The daemon's traces source runs on the node only when its spool is configured.
    names = [s.name for s in node.sources(SourceInputs())]
    assert "traces" not in names


def test_a_node_without_traces_has_no_spool(tmp_path: Path, base: Path) -> None:
    node = SimulatedNode(_load(tmp_path, _document({}, [])), base / "n")
    assert node.spool_dir is None
