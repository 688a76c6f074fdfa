"""The benchmark's floor (bench/floor.py): the file list the recording run writes must come
back as written and refuse a damaged one; the recorder must list what a cycle read under the
root, resolved to paths, and nothing else; the floor reader must read what the list names and
skip, without waiting, what it must not read."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
floor = importlib.import_module("floor")  # bench/floor.py: a script, not a package


def _list(**overrides: Any) -> Any:
    entries = (
        floor.Entry("sys/class/infiniband/mlx5_0/ports/1/state", "file", (1, 0, 2), ("src",)),
        floor.Entry("proc", "dir", (0, 1, 0), ("src", "main")),
        floor.Entry("sys/bus/pci/devices/0000:01:00.0/driver", "link", (1, 1, 1)),
        floor.Entry("sys/class/infiniband/mlx5_0/ports/1", "diropen", (1, 0, 0)),
    )
    per_cycle = tuple(dict.fromkeys(floor.CYCLE_KEYS, n) for n in (1, 2, 3))
    fields: dict[str, Any] = {"cycles": 3, "entries": entries, "per_cycle": per_cycle,
                              "skipped_cycles": 2, **overrides}  # fmt: skip
    return floor.FileList(**fields)


def test_a_file_list_comes_back_as_written(tmp_path: Path) -> None:
    written = _list()
    written.write(tmp_path / "files.json")
    assert floor.FileList.read(tmp_path / "files.json") == written
    summary = written.summary()
    assert summary["file_reads_per_cycle"] == 1.0  # 3 reads in 3 cycles
    assert summary["dir_paths"] == 1 and summary["link_reads_per_cycle"] == 1.0
    assert summary["opens_per_cycle"] == 2.0
    assert summary["threads"] == ["main", "src"]


def _damaged(change: Any) -> str:
    doc = json.loads(_list().dumps())
    change(doc)
    return json.dumps(doc)


def _entry(**fields: Any) -> Any:
    def change(doc: dict[str, Any]) -> None:
        doc["entries"][0].update(fields)

    return change


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda d: d.update(format="nodescope-file-list/0"), id="other format"),
        pytest.param(lambda d: d.update(cycles=0), id="no cycles"),
        pytest.param(lambda d: d.update(cycles=True), id="bool cycles"),
        pytest.param(lambda d: d.update(entries={}), id="entries not a list"),
        pytest.param(_entry(path="../../etc/shadow"), id="path climbs out"),
        pytest.param(_entry(path="/etc/shadow"), id="absolute path"),
        pytest.param(_entry(path="sys/./class"), id="dot component"),
        pytest.param(_entry(path="sys//class"), id="empty component"),
        pytest.param(_entry(path="sys/\0"), id="NUL"),
        pytest.param(_entry(path=7), id="path not a string"),
        pytest.param(_entry(kind="fifo"), id="unknown kind"),
        pytest.param(_entry(counts=[1, 0]), id="counts for fewer cycles"),
        pytest.param(_entry(counts=[1, -1, 0]), id="negative count"),
        pytest.param(_entry(counts=[1, 0.5, 0]), id="fractional count"),
        pytest.param(_entry(threads="src"), id="threads not a list"),
        pytest.param(lambda d: d["entries"].append(d["entries"][0]), id="listed twice"),
        pytest.param(lambda d: d["per_cycle"].pop(), id="per_cycle too short"),
        pytest.param(lambda d: d["per_cycle"][0].update(opens="7"), id="per_cycle not a count"),
    ],
)
def test_a_damaged_or_planted_file_list_is_refused(change: Any) -> None:
    with pytest.raises(ValueError):
        floor.FileList.loads(_damaged(change))


def test_a_file_list_that_is_not_json_is_refused() -> None:
    with pytest.raises(ValueError):
        floor.FileList.loads("sys/class/net\n")


def _run_in_time(reader: Any, index: int) -> Any:
    """``reader.run(index)`` in a thread: a reader that blocks fails the test instead of
    hanging it."""
    out: list[Any] = []
    worker = threading.Thread(target=lambda: out.append(reader.run(index)), daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "the floor reader blocked"
    return out[0]


def test_the_floor_reads_what_the_list_names_and_skips_what_it_must_not(tmp_path: Path) -> None:
    root = tmp_path / "node"
    (root / "d").mkdir(parents=True)
    for name in ("x", "y", "z"):
        (root / "d" / name).write_text(name)
    (root / "a").write_bytes(b"a" * 100)
    # Larger than one read (64 KiB): the reader goes on to EOF.
    (root / "big").write_bytes(b"b" * 200_000)
    (root / "l").symlink_to("a")
    os.mkfifo(root / "fifo")  # opened without O_NONBLOCK, it would wait for a writer
    (root / "vanishing").write_text("v")
    (root / "replaced").write_text("r")
    listed = floor.FileList(
        cycles=2,
        entries=(
            floor.Entry("a", "file", (2, 1)),
            floor.Entry("big", "file", (1, 0)),
            floor.Entry("fifo", "file", (1, 1)),
            floor.Entry("vanishing", "file", (1, 0)),
            floor.Entry("replaced", "file", (0, 1)),
            floor.Entry("d", "dir", (1, 0)),
            floor.Entry("l", "link", (1, 0)),
            floor.Entry("d", "diropen", (1, 1)),
        ),
        per_cycle=(),
    )
    reader = floor.Floor(floor.FileList.loads(listed.dumps()), root)
    assert reader.skipped == ["fifo"]

    (root / "vanishing").unlink()
    first = _run_in_time(reader, 0)
    assert (first.files, first.bytes) == (4, 2 * 100 + 200_000)
    assert (first.dirs, first.names, first.links) == (1, 3, 1)
    assert (first.missing, first.refused) == (1, 0)

    # A FIFO put where a file was, with a writer that writes nothing: a blocking read would
    # wait for ever.
    (root / "replaced").unlink()
    os.mkfifo(root / "replaced")
    writer = os.open(root / "replaced", os.O_RDWR | os.O_NONBLOCK)
    try:
        second = _run_in_time(reader, 3)  # cycle 3 of a 2-cycle list is its second
    finally:
        os.close(writer)
    assert (second.files, second.bytes, second.dirs, second.links) == (2, 100, 0, 0)
    assert (second.missing, second.refused) == (0, 1)


RECORDING = """
import os, sys, threading
sys.path.insert(0, {bench!r})
import floor

root = {root!r}
recorder = floor.FileRecorder(root, skip=1, cycles=2, exclude=["state.json"])
recorder.install()


def read_at(name, dir_fd):
    fd = os.open(name, os.O_RDONLY, dir_fd=dir_fd)
    os.close(fd)


def cycle():
    with open(os.path.join(root, "sub", "x")) as f:
        f.read()
    fd = os.open(os.path.join(root, "sub"), os.O_RDONLY | os.O_DIRECTORY)
    read_at("y", fd)
    os.listdir(fd)
    os.close(fd)
    with os.scandir(os.path.join(root, "sub")) as entries:
        list(entries)
    os.readlink(os.path.join(root, "link"))
    open(os.path.join(root, "state.json")).close()
    open("/proc/self/stat").close()


recorder.begin(0)  # warm-up: not recorded
open(os.path.join(root, "warm-up only")).close()
recorder.end()
recorder.begin(1)
worker = threading.Thread(target=cycle, name="sources")
worker.start()
worker.join()
recorder.end()
recorder.begin(2)
open(os.path.join(root, "sub", "x")).close()
recorder.end()
recorder.begin(3)  # after the recorded stretch
open(os.path.join(root, "after")).close()
recorder.end()
assert recorder.done
recorder.file_list().write(__import__("pathlib").Path({out!r}))
"""


def test_the_recorder_lists_what_each_cycle_read_under_the_root(tmp_path: Path) -> None:
    root = tmp_path / "node"
    (root / "sub").mkdir(parents=True)
    for name in ("sub/x", "sub/y", "state.json", "warm-up only", "after"):
        (root / name).write_text(name)
    (root / "link").symlink_to("sub/x")
    out = tmp_path / "files.json"
    # A process of its own: an audit hook cannot be removed once added.
    script = RECORDING.format(bench=str(BENCH), root=str(root), out=str(out))
    subprocess.run([sys.executable, "-c", textwrap.dedent(script)], check=True, timeout=60)
    recorded = floor.FileList.read(out)
    assert recorded.cycles == 2 and recorded.skipped_cycles == 1
    entries = {(e.kind, e.path): e for e in recorded.entries}
    assert {key: e.counts for key, e in entries.items()} == {
        ("file", "sub/x"): (1, 1),
        # Opened by name against a directory descriptor, resolved to its path.
        ("file", "sub/y"): (1, 0),
        ("diropen", "sub"): (1, 0),
        ("dir", "sub"): (2, 0),  # os.listdir of the descriptor and os.scandir of the path
        ("link", "link"): (1, 0),
    }
    assert entries[("file", "sub/y")].threads == ("sources",)
    first, second = recorded.per_cycle
    assert (first["opens"], first["dir_opens"], first["listings"], first["readlinks"]) == (
        4, 1, 2, 1,
    )  # fmt: skip
    assert (first["excluded"], first["outside"], first["unresolved"]) == (1, 1, 0)
    assert (second["opens"], second["outside"], second["excluded"]) == (1, 0, 0)


def test_the_report_states_each_interval_against_node_exporter_and_the_floor() -> None:
    bench = importlib.import_module("run")  # bench/run.py

    def window(every: int, ours: float, theirs: float, least: float) -> dict[str, Any]:
        return {
            "window_seconds": 60, "scrape_every_seconds": every,
            "nodescope": {"cpu_ms_per_cycle_without_mirror": ours},
            "node_exporter": {"cpu_ms_per_scrape": theirs},
            "floor": {"cycles": 60, "cpu_ms_per_cycle": least, "loop_cpu_ms_mean": 1.0,
                      "loop_cpu_ms_p50": 0.8, "files_per_cycle": 300.0, "bytes_per_cycle": 2048,
                      "dirs_per_cycle": 45.0, "names_per_cycle": 1000.0, "links_per_cycle": 3.0,
                      "missing_per_cycle": 0.0, "refused_per_cycle": 0.0, "skipped_at_load": 0},
        }  # fmt: skip

    overhead = {
        "overhead": window(1, 20.0, 80.0, 2.5),
        "slower_scrapes": [window(15, 12.0, 90.0, 2.0)],
        "files": {**_list().summary(), "cycles": 30},
    }
    text = "\n".join(bench._intervals_and_floor(overhead))
    assert "| one per second | 60 | 20.0 | 80.0 | 2.5 | 0.25 | 8.00 |" in text
    assert "| one every 15 s | 60 | 12.0 | 90.0 | 2.0 | 0.13 | 6.00 |" in text
    assert "per cycle 300.0 files opened, read to EOF and closed (2.0 KiB)" in text
    assert "45.0 directories listed (1000.0 names), 3.0 links read" in text
    # A results file from before the floor and the second window: no such section.
    assert bench._intervals_and_floor({"overhead": {"window_seconds": 60}}) == []
