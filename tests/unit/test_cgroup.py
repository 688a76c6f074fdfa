"""cgroup v2 source: parsers on inline text, a Slurm node's tree made in tmp_path, the capture
of this machine (hybrid), the exporter, and fuzzing of every parser."""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from nodescope import jsonout
from nodescope.collect import Collector, ScheduledSource
from nodescope.errors import ParseError
from nodescope.model.skips import SkipTally
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.roots import Roots
from nodescope.sources import cgroup
from nodescope.sources.base import Source
from nodescope.sources.cgroup import (
    Cgroup,
    CgroupTree,
    Limit,
    find_v2_root,
    make_source,
    parse_cgroup_events,
    parse_cgroup_type,
    parse_controllers,
    parse_cpu_stat,
    parse_ids,
    parse_io_stat,
    parse_key_values,
    parse_limit,
    parse_memory_events,
    parse_pressure,
    parse_proc_cgroup,
    parse_value,
    read_proc_cgroup,
    read_tree,
)
from nodescope.sources.registry import SOURCES, SourceInputs
from nodescope.sources.threads import ThreadsSource
from nodescope_exporters import cgroup_metrics
from nodescope_exporters.prometheus import render

HOST = Path(__file__).resolve().parent.parent / "fixtures" / "hosts" / "kvm-epyc-debian12"

# ---------------------------------------------------------------------------------------------
# Single values and limits


def test_value_files() -> None:
    assert parse_value("8589934592\n") == 8589934592
    assert parse_value("0") == 0


def test_limit_max_means_unlimited() -> None:
    assert parse_limit("max\n") is None
    assert parse_limit("68719476736\n") == 68719476736
    assert parse_limit("0\n") == 0


@pytest.mark.parametrize(
    "text",
    ["", "\n", "12 13\n", "1\n2\n", "-5\n", "+5\n", "1_000\n", "MAX\n", "٣\n", "1.5\n"],
)
def test_bad_single_values_are_parse_errors(text: str) -> None:
    with pytest.raises(ParseError) as info:
        parse_limit(text, "/x/memory.max")
    assert info.value.source == "/x/memory.max"
    assert info.value.line == 1


def test_huge_number_is_a_parse_error_not_a_value_error_of_another_kind() -> None:
    # int() refuses strings over 4300 digits with a plain ValueError.
    with pytest.raises(ParseError):
        parse_value("9" * 5000)


# ---------------------------------------------------------------------------------------------
# Key-value files

MEMORY_EVENTS = """low 0
high 1204
max 17
oom 2
oom_kill 2
oom_group_kill 0
sock_throttled 3
"""


def test_memory_events_named_and_unknown_keys() -> None:
    events = parse_memory_events(MEMORY_EVENTS)
    assert (events.low, events.high, events.max, events.oom, events.oom_kill) == (
        0,
        1204,
        17,
        2,
        2,
    )
    assert events.oom_group_kill == 0
    assert events.other == (("sock_throttled", 3),)
    assert dict(events.items())["sock_throttled"] == 3
    assert [name for name, _ in events.items()][:6] == [
        "low",
        "high",
        "max",
        "oom",
        "oom_kill",
        "oom_group_kill",
    ]


def test_memory_events_of_an_older_kernel_leave_missing_keys_absent() -> None:
    events = parse_memory_events("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
    assert events.oom_group_kill is None
    assert "oom_group_kill" not in dict(events.items())


MEMORY_STAT = """anon 1048576
file 2097152
kernel 65536
kernel_stack 16384
sock 0
shmem 0
file_dirty 4096
file_writeback 0
slab 32768
pgfault 12345
pgmajfault 7
workingset_refault_anon 0
"""


def test_memory_stat_by_key_in_any_order() -> None:
    stat = parse_key_values(MEMORY_STAT, "memory.stat")
    assert stat.get("anon") == 1048576
    assert stat.get("pgmajfault") == 7
    assert stat.get("no_such_key") is None
    # New keys show up in the middle: reading by key does not care.
    shuffled = "pgmajfault 7\nzswap 5\nanon 1048576\n"
    assert parse_key_values(shuffled).get("anon") == 1048576
    assert parse_key_values(shuffled).keys() == ("pgmajfault", "zswap", "anon")


@pytest.mark.parametrize(
    ("text", "line"),
    [("anon 1\nfile\n", 2), ("anon 1\nanon 2\n", 2), ("anon x\n", 1), ("a b c\n", 1)],
)
def test_bad_key_value_lines_name_the_line(text: str, line: int) -> None:
    with pytest.raises(ParseError) as info:
        parse_key_values(text, "memory.stat")
    assert info.value.line == line


CPU_STAT_FULL = """usage_usec 123456789
user_usec 100000000
system_usec 23456789
nice_usec 0
nr_periods 5000
nr_throttled 12
throttled_usec 340000
nr_bursts 0
burst_usec 0
core_sched.force_idle_usec 0
"""


def test_cpu_stat_with_and_without_cpu_controller() -> None:
    full = parse_cpu_stat(CPU_STAT_FULL)
    assert full.usage_usec == 123456789
    assert full.nr_throttled == 12
    assert full.throttled_usec == 340000
    assert full.other == (("core_sched.force_idle_usec", 0),)
    # Without the cpu controller only the usage fields exist (as on this machine).
    bare = parse_cpu_stat("usage_usec 10\nuser_usec 6\nsystem_usec 4\n")
    assert (bare.usage_usec, bare.user_usec, bare.system_usec) == (10, 6, 4)
    assert bare.nr_throttled is None


def test_cgroup_events() -> None:
    events = parse_cgroup_events("populated 1\nfrozen 0\n")
    assert events.populated is True
    assert events.frozen is False
    with pytest.raises(ParseError) as info:
        parse_cgroup_events("frozen 0\npopulated 2\n", "cgroup.events")
    assert info.value.line == 2


def test_pids_events_and_cgroup_stat_are_generic_key_values() -> None:
    assert parse_key_values("max 3\n").get("max") == 3
    stat = parse_key_values("nr_descendants 5\nnr_dying_descendants 1\n")
    assert stat.get("nr_dying_descendants") == 1


# ---------------------------------------------------------------------------------------------
# PSI


def test_pressure_some_and_full() -> None:
    p = parse_pressure(
        "some avg10=1.52 avg60=0.48 avg300=0.10 total=2475904\n"
        "full avg10=0.00 avg60=0.11 avg300=0.30 total=2293579\n",
        "io.pressure",
    )
    assert p.some is not None and p.full is not None
    assert p.some.avg10 == pytest.approx(1.52)
    assert p.some.total_usec == 2475904
    assert p.full.avg300 == pytest.approx(0.30)
    assert p.full.total_usec == 2293579


def test_cpu_pressure_of_an_old_kernel_has_only_some() -> None:
    p = parse_pressure("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    assert p.some is not None
    assert p.full is None


def test_irq_pressure_has_only_full() -> None:
    p = parse_pressure("full avg10=0.00 avg60=0.00 avg300=0.00 total=12\n", "irq.pressure")
    assert p.some is None
    assert p.full is not None and p.full.total_usec == 12


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("", 1),
        ("some avg10=0.00 avg60=0.00 avg300=0.00\n", 1),
        ("some avg10=0.00 avg60=0.00 avg300=0.00 total=x\n", 1),
        ("some avg10=nan avg60=0.00 avg300=0.00 total=1\n", 1),
        (
            "some avg10=0.00 avg60=0.00 avg300=0.00 total=1\nhalf avg10=0 avg60=0 avg300=0 total=0",
            2,
        ),
        (
            "some avg10=0.00 avg60=0.00 avg300=0.00 total=1\n"
            "some avg10=0.00 avg60=0.00 avg300=0.00 total=1\n",
            2,
        ),
        ("some avg10 avg60=0 avg300=0 total=1\n", 1),
        # Only the kernel's own layout: two decimals, this order, one space, a u64 total.
        ("some avg10=1.5 avg60=0.00 avg300=0.00 total=1\n", 1),
        ("some avg60=0.00 avg10=0.00 avg300=0.00 total=1\n", 1),
        ("some avg10=0.00  avg60=0.00 avg300=0.00 total=1\n", 1),
        ("some avg10=0.00 avg60=0.00 avg300=0.00 total=1 more=2\n", 1),
        (f"some avg10=0.00 avg60=0.00 avg300=0.00 total={2**64}\n", 1),
    ],
)
def test_bad_pressure(text: str, line: int) -> None:
    with pytest.raises(ParseError) as info:
        parse_pressure(text, "cpu.pressure")
    assert info.value.line == line


# ---------------------------------------------------------------------------------------------
# io.stat

IO_STAT = (
    "259:0 rbytes=1459200 wbytes=314773504 rios=192 wios=353 dbytes=0 dios=0\n"
    # io.latency and io.cost append their own keys to a device's line.
    "8:16 rbytes=90112 wbytes=0 rios=22 wios=0 dbytes=0 dios=0"
    " depth=max avg_lat=1234 win=100 cost.vrate=100.00\n"
)


def test_io_stat_devices_and_extra_keys() -> None:
    io = parse_io_stat(IO_STAT)
    assert [d.device for d in io.devices] == ["259:0", "8:16"]
    nvme = io.get("259:0")
    assert nvme is not None
    assert (nvme.rbytes, nvme.wbytes, nvme.rios, nvme.wios) == (1459200, 314773504, 192, 353)
    sd = io.get("8:16")
    assert sd is not None
    assert dict(sd.other) == {
        "depth": "max",
        "avg_lat": "1234",
        "win": "100",
        "cost.vrate": "100.00",
    }
    assert io.get("1:1") is None


def test_io_stat_without_discard_keys_leaves_them_absent() -> None:
    io = parse_io_stat("8:0 rbytes=1 wbytes=2 rios=3 wios=4\n")
    assert io.devices[0].dbytes is None


def test_io_stat_empty_file_has_no_devices() -> None:
    assert parse_io_stat("").devices == ()


@pytest.mark.parametrize(
    "text",
    [
        "8-16 rbytes=1\n",
        "8:16 rbytes\n",
        "8:16 rbytes=x\n",
        "8:16 rbytes=1 rbytes=2\n",
        "8:0 rbytes=1\n8:0 rbytes=2\n",
        "8:16 =1\n",
    ],
)
def test_bad_io_stat(text: str) -> None:
    with pytest.raises(ParseError):
        parse_io_stat(text, "io.stat")


# ---------------------------------------------------------------------------------------------
# cgroup.procs, cgroup.type, cgroup.controllers


def test_ids_keep_duplicates_and_order() -> None:
    assert parse_ids("4711\n4712\n4711\n") == (4711, 4712, 4711)
    assert parse_ids("") == ()
    # A line that is not an id is skipped and counted; the ids around it stand.
    tally = SkipTally()
    assert parse_ids("1\n2\nthree\n12345678901\n4\n", "cgroup.procs", tally) == (1, 2, 4)
    skipped = tally.freeze()
    assert dict(skipped.counts) == {"id_unparsable": 2}
    assert skipped.examples["id_unparsable"] == "cgroup.procs: three"


@pytest.mark.parametrize("value", ["domain", "domain threaded", "domain invalid", "threaded"])
def test_cgroup_types(value: str) -> None:
    assert parse_cgroup_type(value + "\n") == value


@pytest.mark.parametrize("text", ["", "Domain\n", "domain\nthreaded\n", "domain  threaded\n"])
def test_bad_cgroup_types(text: str) -> None:
    with pytest.raises(ParseError):
        parse_cgroup_type(text)


def test_controllers() -> None:
    assert parse_controllers("cpuset cpu io memory hugetlb pids rdma misc\n") == (
        "cpuset",
        "cpu",
        "io",
        "memory",
        "hugetlb",
        "pids",
        "rdma",
        "misc",
    )
    assert parse_controllers("\n") == ()
    with pytest.raises(ParseError):
        parse_controllers("cpu\nmemory\n")


# ---------------------------------------------------------------------------------------------
# /proc/<pid>/cgroup

HYBRID_PROC_CGROUP = """12:memory:/slurm/uid_1000/job_42/step_0/task_0
4:cpu,cpuacct:/slurm/uid_1000/job_42/step_0
1:name=systemd:/system.slice/slurmd.service
0::/system.slice/slurmd.service
"""


def test_proc_cgroup_hybrid() -> None:
    pc = parse_proc_cgroup(HYBRID_PROC_CGROUP)
    assert pc.v2_path == "/system.slice/slurmd.service"
    assert pc.v1_path("memory") == "/slurm/uid_1000/job_42/step_0/task_0"
    assert pc.v1_path("cpuacct") == "/slurm/uid_1000/job_42/step_0"
    assert pc.v1_path("name=systemd") == "/system.slice/slurmd.service"
    assert pc.entries[1].controllers == ("cpu", "cpuacct")
    assert pc.v1_path("pids") is None


def test_proc_cgroup_pure_v2_deleted_and_namespaced() -> None:
    pc = parse_proc_cgroup(
        "0::/system.slice/slurmstepd.scope/job_81734/step_0/user/task_0 (deleted)\n"
    )
    assert pc.v2_path == "/system.slice/slurmstepd.scope/job_81734/step_0/user/task_0"
    assert pc.entries[0].deleted is True
    # Inside a cgroup namespace a path outside it starts with /.. ; a colon is allowed in paths.
    pc = parse_proc_cgroup("0::/../sibling:odd\n")
    assert pc.v2_path == "/../sibling:odd"
    assert pc.entries[0].deleted is False


def test_proc_cgroup_pure_v1_has_no_v2_path() -> None:
    assert parse_proc_cgroup("4:memory:/\n").v2_path is None


@pytest.mark.parametrize(
    ("text", "line"),
    [("", 1), ("0:/\n", 1), ("0::/\nx::/\n", 2), ("0::relative\n", 1), ("1:cpu,,x:/\n", 1)],
)
def test_bad_proc_cgroup(text: str, line: int) -> None:
    with pytest.raises(ParseError) as info:
        parse_proc_cgroup(text, "/proc/1/cgroup")
    assert info.value.line == line
    assert "/proc/1/cgroup" in str(info.value)


# ---------------------------------------------------------------------------------------------
# Fuzzing: malformed input raises ParseError and nothing else.

PARSERS: list[Callable[[str, str], object]] = [
    parse_value,
    parse_limit,
    parse_key_values,
    parse_memory_events,
    parse_cpu_stat,
    parse_cgroup_events,
    parse_pressure,
    parse_io_stat,
    parse_ids,
    parse_cgroup_type,
    parse_controllers,
    parse_proc_cgroup,
]

# Text built from the characters these formats use, so fuzzing reaches past the first check.
_FORMAT_ALPHABET = "0123456789 \n\t=:.,-/_()avgsomefulltxdinpbrwq"
_FORMAT_TOKENS = st.sampled_from(
    [
        "some",
        "full",
        "avg10=",
        "avg60=",
        "avg300=",
        "total=",
        "rbytes=",
        "wbytes=",
        "8:16",
        "max",
        "0::",
        " (deleted)",
        "populated",
        "domain",
        " threaded",
        "usage_usec",
        "1.50",
        "123",
        " ",
        "\n",
        "/",
    ]
)
FUZZ_TEXT = st.one_of(
    st.text(),
    st.text(alphabet=_FORMAT_ALPHABET),
    st.lists(_FORMAT_TOKENS, max_size=30).map("".join),
)


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.__name__)
@settings(max_examples=200, deadline=None)
@given(text=FUZZ_TEXT)
def test_parsers_raise_only_parse_error(parser: Callable[[str, str], object], text: str) -> None:
    try:
        parser(text, "fuzz")
    except ParseError as exc:
        assert exc.source == "fuzz"


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["some", "full"]),
            st.lists(st.integers(0, 10**4), min_size=3, max_size=3),
            st.integers(0, 2**64 - 1),
        ),
        min_size=1,
        max_size=2,
        unique_by=lambda t: t[0],
    )
)
def test_pressure_round_trip(lines: list[tuple[str, list[int], int]]) -> None:
    text = "".join(
        f"{kind} avg10={a // 100}.{a % 100:02d} avg60={b // 100}.{b % 100:02d} "
        f"avg300={c // 100}.{c % 100:02d} total={total}\n"
        for kind, (a, b, c), total in lines
    )
    p = parse_pressure(text)
    for kind, (a, _, c), total in lines:
        line = getattr(p, kind)
        assert line.total_usec == total
        assert line.avg10 == pytest.approx(a / 100)
        assert line.avg300 == pytest.approx(c / 100)


# ---------------------------------------------------------------------------------------------
# A Slurm cgroup v2 node, made in tmp_path

PSI = (
    "some avg10={a} avg60=0.00 avg300=0.00 total={t}\n"
    "full avg10=0.00 avg60=0.00 avg300=0.00 total={f}\n"
)


def _write(directory: Path, files: Mapping[str, str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)


def _child(
    memory_current: int,
    procs: str = "",
    populated: int = 1,
    memory_max: str = "max",
    kind: str = "domain",
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    files = {
        "cgroup.controllers": "cpuset cpu io memory pids\n",
        "cgroup.subtree_control": "cpuset cpu io memory pids\n",
        "cgroup.type": kind + "\n",
        "cgroup.events": f"populated {populated}\nfrozen 0\n",
        "cgroup.procs": procs,
        "cgroup.threads": procs,
        "memory.current": f"{memory_current}\n",
        "memory.max": memory_max + "\n",
        "memory.high": "max\n",
        "memory.peak": f"{memory_current * 2}\n",
        "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
        "memory.events.local": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
        "memory.stat": "anon 4096\nfile 8192\npgmajfault 1\n",
        "cpu.stat": "usage_usec 1000\nuser_usec 600\nsystem_usec 400\n"
        "nr_periods 0\nnr_throttled 0\nthrottled_usec 0\nnr_bursts 0\nburst_usec 0\n",
        "io.stat": "",
        "pids.current": "0\n",
        "pids.max": "max\n",
        "pids.events": "max 0\n",
        "cpu.pressure": PSI.format(a="0.00", t=0, f=0),
        "memory.pressure": PSI.format(a="0.00", t=0, f=0),
        "io.pressure": PSI.format(a="0.00", t=0, f=0),
    }
    files.update(extra or {})
    return files


SCOPE = "system.slice/slurmstepd.scope"
JOB = f"{SCOPE}/job_81734"
TASK = f"{JOB}/step_0/user/task_0"


def make_slurm_node(base: Path) -> Roots:
    """A pure cgroup v2 node with slurmd's scope, one job with a batch-less step 0, a task
    with two processes (one listed twice), and a user session."""
    cg = base / "sys" / "fs" / "cgroup"
    _write(
        cg,
        {
            "cgroup.controllers": "cpuset cpu io memory hugetlb pids rdma misc\n",
            "cgroup.subtree_control": "cpuset cpu io memory pids\n",
            "cgroup.procs": "1\n2\n",
            "cgroup.threads": "1\n2\n",
            "cgroup.stat": "nr_descendants 9\nnr_dying_descendants 0\n",
            "cpu.stat": "usage_usec 9000000\nuser_usec 6000000\nsystem_usec 3000000\n",
            "cpu.pressure": PSI.format(a="0.50", t=1_500_000, f=0),
            "memory.pressure": PSI.format(a="0.00", t=250_000, f=125_000),
            "io.pressure": PSI.format(a="0.00", t=2_000_000, f=1_000_000),
            "io.stat": "259:0 rbytes=1000 wbytes=2000 rios=1 wios=2 dbytes=0 dios=0\n",
            "memory.stat": "anon 1\n",
        },
    )
    _write(
        cg / "system.slice",
        _child(
            50 << 30,
            extra={
                "io.stat": "259:0 rbytes=900 wbytes=1800 rios=1 wios=2 dbytes=0 dios=0\n"
                "8:0 rbytes=10 wbytes=20 rios=1 wios=1 dbytes=0 dios=0\n",
                "memory.events": "low 0\nhigh 5\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n",
                "pids.current": "40\n",
                "cpu.stat": "usage_usec 7500000\nuser_usec 5000000\nsystem_usec 2500000\n",
            },
        ),
    )
    _write(cg / "user.slice", _child(1 << 30, memory_max=str(4 << 30)))
    _write(cg / "user.slice" / "user-1000.slice", _child(1 << 29))
    _write(
        cg / SCOPE,
        _child(
            48 << 30,
            extra={
                "memory.high": f"{60 << 30}\n",
                "memory.events": "low 0\nhigh 5\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n",
            },
        ),
    )
    _write(cg / SCOPE / "system", _child(8 << 20, procs="4242\n"))
    _write(
        cg / JOB,
        _child(
            47 << 30,
            memory_max=str(64 << 30),
            extra={
                "memory.events": "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n",
                "memory.events.local": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n"
                "oom_group_kill 0\n",
                "io.stat": "259:0 rbytes=800 wbytes=1600 rios=1 wios=2 dbytes=0 dios=0\n",
            },
        ),
    )
    _write(cg / JOB / "step_0", _child(47 << 30))
    _write(cg / JOB / "step_0" / "slurm", _child(4 << 20, procs="5000\n"))
    _write(cg / JOB / "step_0" / "user", _child(47 << 30))
    _write(
        cg / TASK,
        _child(
            47 << 30,
            procs="5001\n5002\n5001\n",
            extra={"cgroup.threads": "5001\n5002\n5003\n5004\n5005\n", "pids.current": "5\n"},
        ),
    )
    # A step that has ended: unpopulated. Its cgroup.procs would be wrong if read, which
    # proves the walk trusts cgroup.events and skips the read.
    _write(
        cg / JOB / "step_extern",
        _child(0, procs="999\n", populated=0),
    )
    # cgroupfs has no symlinks; a fixture tree might. The walk must not follow one.
    (cg / JOB / "link_to_scope").symlink_to(cg / SCOPE, target_is_directory=True)
    return Roots.under(base)


@pytest.fixture
def slurm_node(tmp_path: Path) -> Roots:
    return make_slurm_node(tmp_path)


def test_find_v2_root_pure_hybrid_none(tmp_path: Path, slurm_node: Roots) -> None:
    pure = find_v2_root(slurm_node.cgroupfs)
    assert pure.mode == "unified"
    assert pure.path == slurm_node.cgroupfs
    hybrid = tmp_path / "hybrid"
    _write(hybrid / "memory", {"memory.usage_in_bytes": "1\n"})
    _write(hybrid / "unified", {"cgroup.controllers": "hugetlb\n"})
    found = find_v2_root(hybrid)
    assert (found.mode, found.path) == ("hybrid", hybrid / "unified")
    _write(tmp_path / "v1only" / "memory", {"memory.usage_in_bytes": "1\n"})
    (tmp_path / "v1only" / "unified").mkdir()  # an empty mount point is not a hierarchy
    assert find_v2_root(tmp_path / "v1only").mode == "none"


def test_walk_of_a_slurm_node(slurm_node: Roots) -> None:
    tree = make_source(keep_pids=True).collect(slurm_node)
    assert tree.mode == "unified"
    assert not tree.truncated and not tree.depth_limited
    paths = [c.path for c in tree.cgroups]
    assert paths[0] == "/"
    assert "/" + TASK in paths
    assert not any("link_to_scope" in p for p in paths)
    # Breadth first: depths never decrease along the tuple.
    depths = [c.depth for c in tree.cgroups]
    assert depths == sorted(depths)
    assert len(tree.cgroups) == 12

    task = tree.get(TASK)
    assert task is not None
    assert task.depth == 6
    assert task.name == "task_0"
    assert task.parent_path == f"/{JOB}/step_0/user"
    assert task.nr_procs == 2  # 5001 was listed twice
    assert task.procs == (5001, 5002, 5001)
    assert task.nr_threads == 5
    assert task.pids_current == 5
    assert task.type == "domain"
    assert task.controllers == ("cpuset", "cpu", "io", "memory", "pids")

    job = tree.get("/" + JOB)
    assert job is not None
    assert job.memory_max == Limit(64 << 30)
    assert job.memory_high == Limit(None) and job.memory_high.unlimited
    assert job.memory_events is not None and job.memory_events.oom_kill == 1
    assert job.memory_events_local is not None and job.memory_events_local.oom_kill == 0
    assert job.io_stat is not None and job.io_stat.devices[0].rbytes == 800
    assert job.nr_procs == 0
    assert job.nr_children == 2  # step_0 and step_extern; the symlink is no child
    assert job.memory_stat is not None and job.memory_stat.get("file") == 8192
    assert job.cpu_stat is not None and job.cpu_stat.nr_throttled == 0

    ended = tree.get(f"{JOB}/step_extern")
    assert ended is not None
    assert ended.events is not None and ended.events.populated is False
    assert ended.nr_procs == 0
    assert ended.procs == ()

    root = tree.get("/")
    assert root is not None
    assert root.type is None  # the root has no cgroup.type
    assert root.memory_current is None  # nor memory.current: absent, not 0
    assert root.memory_max is None
    assert root.nr_procs == 2
    assert root.cpu_pressure is not None and root.cpu_pressure.some is not None
    assert root.cpu_pressure.some.avg10 == pytest.approx(0.5)
    assert root.irq_pressure is None


def test_pids_are_dropped_unless_asked_for(slurm_node: Roots) -> None:
    task = make_source().collect(slurm_node).get(TASK)
    assert task is not None
    assert task.nr_procs == 2
    assert task.procs is None and task.threads is None


def test_tree_navigation(slurm_node: Roots) -> None:
    tree = read_tree(slurm_node)
    assert [c.name for c in tree.children("/")] == ["system.slice", "user.slice"]
    assert [c.name for c in tree.children("/" + JOB)] == ["step_0", "step_extern"]
    sub = [c.path for c in tree.subtree(f"/{JOB}/step_0")]
    assert sub == [
        f"/{JOB}/step_0",
        f"/{JOB}/step_0/slurm",
        f"/{JOB}/step_0/user",
        "/" + TASK,
    ]
    assert tree.subtree("/") == tree.cgroups
    assert tree.get("/nope") is None
    assert tree.get(JOB + "/") is tree.get("/" + JOB)


def test_max_cgroups_truncates_deepest_first(slurm_node: Roots) -> None:
    tree = make_source(max_cgroups=4).collect(slurm_node)
    assert tree.truncated
    assert [c.path for c in tree.cgroups] == [
        "/",
        "/system.slice",
        "/user.slice",
        "/" + SCOPE,
    ]
    assert not make_source(max_cgroups=12).collect(slurm_node).truncated


def test_max_depth_limits_the_walk(slurm_node: Roots) -> None:
    tree = make_source(max_depth=2).collect(slurm_node)
    assert tree.depth_limited and not tree.truncated
    assert max(c.depth for c in tree.cgroups) == 2
    assert {c.path for c in tree.cgroups} == {
        "/",
        "/system.slice",
        "/user.slice",
        "/" + SCOPE,
        "/user.slice/user-1000.slice",
    }
    assert not make_source(max_depth=6).collect(slurm_node).depth_limited


def test_make_source_checks_its_limits() -> None:
    with pytest.raises(ValueError):
        make_source(max_cgroups=0)
    with pytest.raises(ValueError):
        make_source(max_depth=-1)
    source = SOURCES["cgroups"].make()
    assert source.name == "cgroups"
    assert isinstance(source, cgroup.CgroupSource)
    assert source.max_cgroups == cgroup.DEFAULT_MAX_CGROUPS and source.max_depth is None


def test_threaded_cgroup_has_no_process_count(tmp_path: Path) -> None:
    roots = make_slurm_node(tmp_path)
    pool = roots.cgroupfs / "system.slice" / "pool"
    _write(pool, _child(0, procs="7000\n", kind="domain threaded"))
    # A threaded cgroup whose cgroup.procs is unreadable on a host; in a fixture the file
    # may hold text, which must not be taken as the process list.
    _write(pool / "workers", _child(0, procs="7000\n", kind="threaded"))
    (pool / "workers" / "cgroup.threads").write_text("7001\n7002\n")
    tree = read_tree(roots)
    workers = tree.get("/system.slice/pool/workers")
    assert workers is not None
    assert workers.type == "threaded"
    assert workers.nr_procs is None
    assert workers.nr_threads == 2
    pool_cg = tree.get("/system.slice/pool")
    assert pool_cg is not None and pool_cg.type == "domain threaded" and pool_cg.nr_procs == 1


def test_a_bad_file_costs_its_figure_not_the_walk(slurm_node: Roots) -> None:
    """A junk ``memory.max`` in one cgroup: that limit is absent, the skip is counted with
    the file named, and every other figure and cgroup is read as before."""
    before = read_tree(slurm_node)
    bad = slurm_node.cgroupfs / TASK / "memory.max"
    bad.write_text("lots\n")
    tree = read_tree(slurm_node)
    assert dict(tree.skipped.counts) == {"cgroup_file_unparsable": 1}
    assert str(bad) in tree.skipped.examples["cgroup_file_unparsable"]
    task = tree.get(TASK)
    assert task is not None and task.memory_max is None
    assert task == dataclasses.replace(before.get(TASK), memory_max=None)  # type: ignore[arg-type]
    assert [c for c in tree.cgroups if c.path != "/" + TASK] == [
        c for c in before.cgroups if c.path != "/" + TASK
    ]
    assert not before.skipped


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(
        [
            "cgroup.controllers",
            "cgroup.type",
            "cgroup.events",
            "cgroup.procs",
            "cgroup.threads",
            "memory.max",
            "memory.events",
            "memory.stat",
            "cpu.stat",
            "io.stat",
            "memory.pressure",
            "pids.current",
        ]
    ),
    text=FUZZ_TEXT,
)
def test_any_text_in_a_cgroup_file_costs_at_most_that_cgroup_figure(
    tmp_path_factory: pytest.TempPathFactory, name: str, text: str
) -> None:
    """Whatever one file of one cgroup holds, the walk reads every cgroup, and every other
    cgroup exactly as before; what did not parse is counted."""
    roots = make_slurm_node(tmp_path_factory.mktemp("fuzz"))
    before = read_tree(roots, keep_pids=True)
    (roots.cgroupfs / TASK / name).write_text(text)
    tree = read_tree(roots, keep_pids=True)
    assert [c.path for c in tree.cgroups] == [c.path for c in before.cgroups]
    others = [c for c in tree.cgroups if c.path != "/" + TASK]
    assert others == [c for c in before.cgroups if c.path != "/" + TASK]
    assert set(tree.skipped.counts) <= {"cgroup_file_unparsable", "id_unparsable"}


def test_a_refused_cgroup_file_is_counted_not_waited_on(slurm_node: Roots) -> None:
    """A file too large for its kind, in place of ``memory.stat``: refused, counted as
    unreadable, the cgroup kept without it."""
    big = slurm_node.cgroupfs / TASK / "memory.stat"
    big.write_bytes(b"anon 1\n" * (700 * 1024))  # 4.9 MB, over the 4 MiB cap
    tree = read_tree(slurm_node)
    task = tree.get(TASK)
    assert task is not None and task.memory_stat is None
    assert dict(tree.skipped.counts) == {"cgroup_file_unreadable": 1}
    assert tree.skipped.examples["cgroup_file_unreadable"] == str(big)


def test_no_v2_hierarchy_is_reported_not_raised(tmp_path: Path) -> None:
    _write(tmp_path / "sys" / "fs" / "cgroup" / "memory", {"memory.usage_in_bytes": "1\n"})
    tree = make_source().collect(Roots.under(tmp_path))
    assert tree.mode == "none"
    assert tree.root is None
    assert tree.cgroups == ()
    body = _render(tree)
    assert 'nodescope_cgroup_hierarchy_info{mode="none"} 1.0' in body
    assert "nodescope_cgroup_walk_cgroups" not in body


def test_tree_is_json_serialisable_and_immutable(slurm_node: Roots) -> None:
    tree = make_source(keep_pids=True).collect(slurm_node)
    tree.get("/")  # fills the lookup cache, which must not leak into the record
    data = json.loads(jsonout.dumps(tree))
    assert data["mode"] == "unified"
    assert "_index" not in data
    task = next(c for c in data["cgroups"] if c["path"] == "/" + TASK)
    assert task["memory_max"] == {"value": None}
    assert task["procs"] == [5001, 5002, 5001]
    with pytest.raises(dataclasses.FrozenInstanceError):
        tree.cgroups[0].depth = 3  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# The capture of this machine: hybrid, only hugetlb in v2


def test_capture_of_this_machine_is_hybrid() -> None:
    roots = Roots.under(HOST)
    hierarchy = find_v2_root(roots.cgroupfs)
    assert hierarchy.mode == "hybrid"
    assert hierarchy.path == roots.cgroupfs / "unified"
    tree = read_tree(roots)
    assert tree.mode == "hybrid"
    root = tree.cgroups[0]
    assert root.path == "/"
    assert root.controllers == ("hugetlb",)
    assert root.memory_current is None and root.memory_max is None
    assert root.nr_procs is not None and root.nr_procs > 0
    assert root.cpu_stat is not None and root.cpu_stat.usage_usec is not None
    assert root.cpu_pressure is not None and root.cpu_pressure.some is not None
    assert root.io_pressure is not None and root.io_pressure.full is not None


def test_capture_of_proc_self_cgroup() -> None:
    pc = read_proc_cgroup(Roots.under(HOST))
    assert pc is not None
    assert pc.v2_path == "/"
    assert pc.v1_path("memory") is not None
    assert pc.v1_path("name=systemd") is not None
    assert len(pc.entries) > 2
    assert read_proc_cgroup(Roots.under(HOST), 999999) is None


# ---------------------------------------------------------------------------------------------
# Exporter


def _render(tree: CgroupTree) -> str:
    sample = SourceSample("cgroups", monotonic=10.0, duration=0.01, data=tree)
    snapshot = Snapshot(cycle=1, monotonic=10.0, wall_time=1.7e9, current={"cgroups": sample})
    return render(snapshot, [cgroup_metrics.families]).decode()


def _samples(body: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples: Mapping[Any, float], name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def test_exporter_on_the_slurm_node(slurm_node: Roots) -> None:
    body = _render(read_tree(slurm_node))
    s = _samples(body)
    assert _value(s, "nodescope_cgroup_walk_cgroups") == 12
    assert _value(s, "nodescope_cgroup_walk_truncated", reason="count") == 0
    assert _value(s, "nodescope_cgroup_walk_truncated", reason="depth") == 0
    assert _value(s, "nodescope_cgroup_hierarchy_info", mode="unified") == 1
    sys_slice = "/system.slice"
    assert _value(s, "nodescope_cgroup_memory_current_bytes", cgroup=sys_slice) == 50 << 30
    # Unlimited limits: no series.
    assert _value(s, "nodescope_cgroup_memory_max_bytes", cgroup=sys_slice) is None
    assert _value(s, "nodescope_cgroup_memory_max_bytes", cgroup="/user.slice") == 4 << 30
    assert _value(s, "nodescope_cgroup_memory_high_bytes", cgroup="/" + SCOPE) == 60 << 30
    assert (
        _value(s, "nodescope_cgroup_memory_events_total", cgroup=sys_slice, event="oom_kill") == 1
    )
    assert (
        _value(
            s,
            "nodescope_cgroup_pressure_stall_seconds_total",
            cgroup="/",
            resource="cpu",
            kind="some",
        )
        == 1.5
    )
    assert (
        _value(
            s,
            "nodescope_cgroup_pressure_stall_seconds_total",
            cgroup="/",
            resource="io",
            kind="full",
        )
        == 1.0
    )
    assert _value(s, "nodescope_cgroup_cpu_usage_seconds_total", cgroup=sys_slice) == 7.5
    assert (
        _value(
            s,
            "nodescope_cgroup_io_bytes_total",
            cgroup=sys_slice,
            device="8:0",
            direction="write",
        )
        == 20
    )
    assert _value(s, "nodescope_cgroup_pids_current", cgroup=sys_slice) == 40
    # Nothing below depth 2: the job, steps and tasks have no per-cgroup series.
    cgroups = {dict(labels).get("cgroup") for (_, labels) in s}
    assert "/" + SCOPE in cgroups
    assert not any(c and c.startswith(f"/{JOB}") for c in cgroups)
    # The root has no memory files: no series for it, not zeros.
    assert _value(s, "nodescope_cgroup_memory_current_bytes", cgroup="/") is None


def test_exporter_reports_truncation(slurm_node: Roots) -> None:
    s = _samples(_render(make_source(max_cgroups=3, max_depth=1).collect(slurm_node)))
    assert _value(s, "nodescope_cgroup_walk_cgroups") == 3
    assert _value(s, "nodescope_cgroup_walk_truncated", reason="count") == 0
    assert _value(s, "nodescope_cgroup_walk_truncated", reason="depth") == 1
    s = _samples(_render(make_source(max_cgroups=2).collect(slurm_node)))
    assert _value(s, "nodescope_cgroup_walk_truncated", reason="count") == 1


def test_exporter_without_cgroup_data_is_silent() -> None:
    snapshot = Snapshot(cycle=1, monotonic=1.0, wall_time=1.7e9)
    assert list(cgroup_metrics.families(snapshot)) == []


def test_exporter_on_the_capture_has_no_memory_series() -> None:
    s = _samples(_render(read_tree(Roots.under(HOST))))
    assert _value(s, "nodescope_cgroup_hierarchy_info", mode="hybrid") == 1
    names = {name for name, _ in s}
    assert "nodescope_cgroup_memory_current_bytes" not in names
    assert "nodescope_cgroup_cpu_usage_seconds_total" in names


def test_every_cgroup_metric_is_in_the_catalog() -> None:
    from nodescope_exporters.catalog import CATALOG

    declared = {n for n, spec in CATALOG.items() if spec.area == cgroup_metrics.AREA}
    assert "nodescope_cgroup_walk_cgroups" in declared
    assert all(n.startswith("nodescope_cgroup_") for n in declared)


def test_cgroup_record_defaults_are_absent() -> None:
    c = Cgroup(path="/x", depth=1, type="domain", controllers=(), nr_children=0)
    assert c.memory_current is None and c.nr_procs is None


def test_exposition_passes_promtool_lint(slurm_node: Roots) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian package prometheus) is not installed")
    body = _render(read_tree(slurm_node))
    result = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------------------------------------
# Cadence: static files every slow_every walks, new cgroups at once, the shared walk


def _source(slow_every: int) -> cgroup.CgroupSource:
    source = make_source()
    source.slow_every = slow_every
    return source


def _memory_max(tree: CgroupTree, path: str) -> int | None:
    found = tree.get(path)
    assert found is not None and found.memory_max is not None
    return found.memory_max.value


def test_static_files_are_read_on_the_slow_walks(slurm_node: Roots) -> None:
    source = _source(slow_every=3)
    first = source.collect(slurm_node)
    assert first == read_tree(slurm_node)
    (slurm_node.cgroupfs / JOB / "memory.max").write_text(f"{32 << 30}\n")
    (slurm_node.cgroupfs / JOB / "memory.current").write_text(f"{20 << 30}\n")
    second = source.collect(slurm_node)
    # The dynamic file shows at once, the limit only on the next slow walk (the 4th).
    job = second.get("/" + JOB)
    assert job is not None and job.memory_current == 20 << 30
    assert _memory_max(second, "/" + JOB) == 64 << 30
    assert _memory_max(source.collect(slurm_node), "/" + JOB) == 64 << 30
    fourth = source.collect(slurm_node)
    assert _memory_max(fourth, "/" + JOB) == 32 << 30
    # Everything read again: the same records as a walk that reads every file.
    assert fourth == read_tree(slurm_node)


def test_slow_every_one_reads_every_file_on_every_walk(slurm_node: Roots) -> None:
    source = _source(slow_every=1)
    source.collect(slurm_node)
    (slurm_node.cgroupfs / JOB / "memory.max").write_text("max\n")
    (slurm_node.cgroupfs / JOB / "memory.events.local").write_text("oom_kill 2\n")
    tree = source.collect(slurm_node)
    assert _memory_max(tree, "/" + JOB) is None
    assert tree == read_tree(slurm_node)


def test_a_new_or_remade_cgroup_is_read_in_full_at_once(slurm_node: Roots) -> None:
    source = _source(slow_every=100)
    source.collect(slurm_node)
    step = slurm_node.cgroupfs / JOB / "step_1"
    _write(step, _child(1 << 20, procs="6000\n", memory_max=str(2 << 30)))
    tree = source.collect(slurm_node)
    assert _memory_max(tree, f"/{JOB}/step_1") == 2 << 30
    # Removed and made again under the same name (a new inode: made while the old one
    # still exists): no stale limit.
    _write(step.with_name("new"), _child(1 << 20, procs="6001\n", memory_max=str(3 << 30)))
    shutil.rmtree(step)
    step.with_name("new").rename(step)
    tree = source.collect(slurm_node)
    assert _memory_max(tree, f"/{JOB}/step_1") == 3 << 30
    assert tree == read_tree(slurm_node)


def test_events_local_is_read_when_the_hierarchical_events_change(slurm_node: Roots) -> None:
    source = _source(slow_every=100)
    source.collect(slurm_node)
    task = slurm_node.cgroupfs / TASK
    oom = "low 0\nhigh 0\nmax 1\noom 1\noom_kill 1\noom_group_kill 0\n"
    (task / "memory.events.local").write_text(oom)
    tree = source.collect(slurm_node)
    # A local event without its hierarchical count cannot happen; the file is not read.
    found = tree.get("/" + TASK)
    assert found is not None and found.memory_events_local is not None
    assert found.memory_events_local.oom_kill == 0
    (task / "memory.events").write_text(oom)
    found = source.collect(slurm_node).get("/" + TASK)
    assert found is not None and found.memory_events is not None
    assert found.memory_events.oom_kill == 1
    assert found.memory_events_local is not None and found.memory_events_local.oom_kill == 1


def test_unchanged_cgroups_keep_their_records(slurm_node: Roots) -> None:
    source = _source(slow_every=100)
    first = source.collect(slurm_node)
    (slurm_node.cgroupfs / TASK / "cpu.stat").write_text("usage_usec 5000\n")
    second = source.collect(slurm_node)
    before, after = first.get("/" + TASK), second.get("/" + TASK)
    assert before is not None and after is not None and after.cpu_stat is not None
    assert after.cpu_stat.usage_usec == 5000 and before != after
    assert second.get("/" + JOB) is first.get("/" + JOB)
    assert second == read_tree(slurm_node)


def test_no_thread_is_read_where_no_process_is(slurm_node: Roots) -> None:
    source = _source(slow_every=100)
    source.collect(slurm_node)
    step = slurm_node.cgroupfs / JOB / "step_0"
    (step / "cgroup.threads").write_text("77\n")  # not a state the kernel allows
    found = source.collect(slurm_node).get(f"/{JOB}/step_0")
    assert found is not None and found.nr_threads == 0
    assert read_tree(slurm_node).get(f"/{JOB}/step_0") != found


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _cgroup_sources(inputs: SourceInputs) -> list[Source]:
    sources = [SOURCES[name].make(inputs) for name in ("cgroups", "jobs", "procs", "threads")]
    assert isinstance(sources[3], ThreadsSource)
    sources[3].host_every = 1  # the host walk on every run, as a source built alone makes it
    return sources


def _alone(roots: Roots) -> dict[str, object]:
    """What each cgroup source reads built on its own, walking or listing for itself."""
    return {s.name: s.collect(roots) for s in _cgroup_sources(SourceInputs())}


@pytest.mark.parametrize("order", list(itertools.permutations(range(4))))
def test_one_walk_per_cycle_whatever_order_the_sources_run_in(
    slurm_node: Roots, order: tuple[int, ...]
) -> None:
    inputs = SourceInputs()
    made = _cgroup_sources(inputs)
    sources = [made[i] for i in order]
    collector = Collector(slurm_node, [ScheduledSource(s, 1.0) for s in sources], inputs=inputs)
    walker = inputs.cgroup_walk.walker
    for cycle in range(1, 4):
        (slurm_node.cgroupfs / TASK / "memory.current").write_text(f"{cycle << 20}\n")
        snapshot = collector.run_cycle(force=True)
        assert walker.walks == cycle
        assert {name: sample.data for name, sample in snapshot.current.items()} == _alone(
            slurm_node
        )
        # Asked again in the same cycle, the walk is handed out, not made again.
        assert inputs.cgroup_walk.tree(slurm_node) == read_tree(slurm_node, keep_pids=True)
        assert walker.walks == cycle


def test_the_walk_keeps_the_id_lists_for_the_sources_that_read_them(slurm_node: Roots) -> None:
    walk = cgroup.CycleWalk()
    source = make_source(walk=walk)
    walk.begin_cycle({"cgroups"})
    bare = source.collect(slurm_node)
    full = walk.tree(slurm_node)
    assert walk.walker.walks == 1
    task_bare, task_full = bare.get("/" + TASK), full.get("/" + TASK)
    assert task_bare is not None and task_bare.procs is None
    assert task_full is not None and task_full.procs == (5001, 5002, 5001)
    assert full == read_tree(slurm_node, keep_pids=True)
    assert bare == read_tree(slurm_node)


def test_sources_that_can_list_for_themselves_walk_only_with_one_that_needs_the_walk(
    slurm_node: Roots,
) -> None:
    """``procs`` and ``threads`` every cycle, ``cgroups`` and ``jobs`` every third: the
    cycles without them make no walk, and the records are the same."""
    inputs = SourceInputs()
    cgroups, jobs, procs, threads = _cgroup_sources(inputs)
    clock = _Clock()
    every = {procs: 1.0, threads: 1.0, cgroups: 3.0, jobs: 3.0}
    scheduled = [ScheduledSource(source, interval) for source, interval in every.items()]
    collector = Collector(slurm_node, scheduled, clock=clock, inputs=inputs)
    walks = []
    for _ in range(6):
        snapshot = collector.run_cycle()
        walks.append(inputs.cgroup_walk.walker.walks)
        alone = _alone(slurm_node)
        assert snapshot.current["procs"].data == alone["procs"]
        assert snapshot.current["threads"].data == alone["threads"]
        clock.now += 1.0
    assert walks == [1, 1, 1, 2, 2, 2]


def test_until_a_collector_begins_a_cycle_every_request_walks(slurm_node: Roots) -> None:
    walk = cgroup.CycleWalk()
    first = walk.tree(slurm_node)
    (slurm_node.cgroupfs / TASK / "memory.current").write_text("4096\n")
    second = walk.tree(slurm_node)
    assert walk.walker.walks == 2 and second != first
    assert walk.if_shared(slurm_node) is None
    walk.needed_by("cgroups")
    walk.begin_cycle({"procs"})
    assert walk.if_shared(slurm_node) is None  # no source that needs the walk runs
    walk.begin_cycle({"procs", "cgroups"})
    assert walk.if_shared(slurm_node) == second
    assert walk.walker.walks == 3


class _BlockingWalker(cgroup.CgroupWalker):
    """A walker whose first walk blocks until released, as a read blocked in the kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()

    def walk(self, roots: Roots, slow_every: int = 1) -> CgroupTree:
        if not self.entered.is_set():
            self.entered.set()
            self.release.wait(30)
        return super().walk(roots, slow_every)


@pytest.mark.alone  # a bound on wall-clock time
def test_a_walk_that_overruns_its_deadline_holds_no_other_source(slurm_node: Roots) -> None:
    """The ``cgroups`` source's walk blocks past its deadline: ``jobs`` waits for it no longer
    than the walk's bound and goes down with the reason, ``procs`` lists for itself; in the
    next cycle nothing waits for the blocked walk; once it returns, one walk serves the
    cycle again."""
    inputs = SourceInputs()
    walk = inputs.cgroup_walk
    walker = _BlockingWalker()
    walk.walker = walker
    walk.wait_seconds = 0.2
    cgroups, jobs, procs, _ = _cgroup_sources(inputs)
    deadlines = {cgroups: 0.3, jobs: 10.0, procs: 10.0}
    scheduled = [ScheduledSource(source, 1.0, timeout) for source, timeout in deadlines.items()]
    collector = Collector(slurm_node, scheduled, inputs=inputs)
    try:
        first = collector.run_cycle(force=True)
        assert (first.current["cgroups"].error or "").startswith("timeout")
        assert "did not return within 0.2 s" in (first.current["jobs"].error or "")
        assert first.current["procs"].data == _alone(slurm_node)["procs"]
        started = time.monotonic()
        second = collector.run_cycle(force=True)
        assert time.monotonic() - started < 0.2  # nothing waited for the blocked walk
        assert (second.current["cgroups"].error or "").startswith("timeout")
        assert "earlier cycle has not returned" in (second.current["jobs"].error or "")
        assert second.current["procs"].error is None
        walker.release.set()
        deadline = time.monotonic() + 10
        while collector.scheduled[0].stuck_since is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        third = collector.run_cycle(force=True)
        alone = _alone(slurm_node)
        assert third.current["cgroups"].data == alone["cgroups"]
        assert third.current["jobs"].data == alone["jobs"]
        assert walker.walks == 2  # the blocked walk, then one for the third cycle
    finally:
        walker.release.set()
        collector.close()
