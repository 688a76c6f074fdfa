"""The procs source: job processes from Slurm's cgroups, NCCL_IB_HCA from their environ, the
TCP counters of /proc/net/snmp."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.errors import ParseError
from nodescope.model.skips import SkipTally
from nodescope.roots import Roots
from nodescope.sources.cgroup import read_tree
from nodescope.sources.procs import (
    ProcsData,
    ProcsSource,
    TcpCounters,
    job_id_of,
    job_members,
    make_source,
    parse_environ,
    parse_pids,
    parse_snmp,
    procs_rates,
    read_procs,
)

# The TCP lines of /proc/net/snmp as Linux 6.12 prints them (net/ipv4/proc.c).
SNMP = (
    "Ip: Forwarding DefaultTTL InReceives\n"
    "Ip: 1 64 123\n"
    "Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens AttemptFails EstabResets"
    " CurrEstab InSegs OutSegs RetransSegs InErrs OutRsts InCsumErrors\n"
    "Tcp: 1 200 120000 -1 3120 1850 12 40 42 46000000 48000000 1200 0 310 0\n"
    "Udp: InDatagrams NoPorts\n"
    "Udp: 1 2\n"
)


def test_parse_snmp() -> None:
    assert parse_snmp(SNMP) == TcpCounters(46_000_000, 48_000_000, 1200)


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("Ip: a\nIp: 1\n", None),
        ("Tcp: InSegs OutSegs RetransSegs\n", 1),
        ("Tcp: InSegs OutSegs RetransSegs\nTcp: 1 2\n", 2),
        ("Tcp: InSegs OutSegs RetransSegs\nTcp: 1 2 x\n", 2),
        ("Tcp: InSegs OutSegs\nTcp: 1 2\n", 1),
    ],
)
def test_parse_snmp_rejects(text: str, line: int | None) -> None:
    with pytest.raises(ParseError) as err:
        parse_snmp(text, "snmp")
    assert err.value.line == line and err.value.source == "snmp"


def test_parse_environ_keeps_only_what_nccl_placement_needs() -> None:
    text = "PATH=/bin\0NCCL_IB_HCA=mlx5_6,mlx5_7\0AWS_SECRET=x\0garbage\0SLURM_JOB_ID=81770\0"
    assert parse_environ(text) == (("NCCL_IB_HCA", "mlx5_6,mlx5_7"), ("SLURM_JOB_ID", "81770"))


def test_parse_pids_and_job_dirs() -> None:
    assert parse_pids("12\n7\n12\n\n") == (7, 12)
    # A line that is not a pid is skipped and counted; the others stand.
    tally = SkipTally()
    assert parse_pids("12\nx\n99999999999\n7\n", "cgroup.procs", tally) == (7, 12)
    skipped = tally.freeze()
    assert dict(skipped.counts) == {"pid_unparsable": 2}
    assert skipped.examples["pid_unparsable"] == "cgroup.procs: x"
    assert job_id_of("job_81770") == "81770"
    assert job_id_of("job_") is None and job_id_of("step_0") is None


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_parsers_raise_only_parse_errors(text: str) -> None:
    for parse in (parse_snmp, parse_environ):
        with contextlib.suppress(ParseError):
            parse(text, "fuzz")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 4_194_304).map(str), st.text(max_size=12))))
def test_parse_pids_never_raises_and_counts_every_bad_line(lines: list[str]) -> None:
    text = "\n".join(lines)
    tally = SkipTally()
    pids = parse_pids(text, "fuzz", tally)
    tokens = [t.strip() for t in text.split("\n") if t.strip()]
    good = [t for t in tokens if t.isascii() and t.isdigit() and len(t) <= 10]
    assert pids == tuple(sorted({int(t) for t in good}))
    assert sum(tally.freeze().counts.values()) == len(tokens) - len(good)


def test_rates() -> None:
    a = ProcsData((), TcpCounters(0, 1_000, 10))
    b = ProcsData((), TcpCounters(0, 21_000, 14))
    rates = procs_rates(a, b, 2.0).tcp
    assert rates is not None
    assert rates.out_segs_per_second == 10_000 and rates.retrans_segs_per_second == 2
    assert rates.retransmit_ratio == pytest.approx(2 / 10_000)
    assert procs_rates(ProcsData((), None), b, 2.0).tcp is None


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_read_procs_on_a_tree(tmp_path: Path) -> None:
    roots = Roots.under(tmp_path)
    cg = roots.cgroupfs
    _write(cg / "cgroup.controllers", "cpu memory\n")
    job = cg / "system.slice" / "slurmstepd.scope" / "job_81770"
    _write(job / "step_0" / "user" / "task_0" / "cgroup.procs", "4242\n")
    _write(job / "step_0" / "slurm" / "cgroup.procs", "4200\n4299\n")  # 4299 has exited
    _write(cg / "user.slice" / "cgroup.procs", "1000\n")  # not a job
    _write(roots.procfs / "4242" / "environ", "NCCL_IB_HCA=mlx5_6\0PATH=/bin\0")
    _write(roots.procfs / "4200" / "environ", "PATH=/bin\0")
    _write(roots.procfs / "1000" / "environ", "NCCL_IB_HCA=mlx5_0\0")
    _write(roots.procfs / "net" / "snmp", SNMP)
    data = make_source().collect(roots)
    assert data == read_procs(roots)
    assert [(p.pid, p.job_id, p.nccl_ib_hca) for p in data.processes] == [
        (4200, "81770", None),
        (4242, "81770", "mlx5_6"),
    ]
    assert data.processes[1].cgroup == (
        "/system.slice/slurmstepd.scope/job_81770/step_0/user/task_0"
    )
    assert data.tcp == TcpCounters(46_000_000, 48_000_000, 1200)


def test_read_procs_without_cgroup_v2_or_snmp(tmp_path: Path) -> None:
    assert read_procs(Roots.under(tmp_path)) == ProcsData((), None)


def test_a_bad_snmp_or_cgroup_list_skips_only_itself(tmp_path: Path) -> None:
    """A junk ``/proc/net/snmp`` and a junk line in one job's ``cgroup.procs`` cost the TCP
    counters and that line, counted; every job process is still reported."""
    roots = Roots.under(tmp_path)
    cg = roots.cgroupfs
    _write(cg / "cgroup.controllers", "cpu memory\n")
    _write(cg / "job_1" / "cgroup.procs", "10\nnot-a-pid\n")
    _write(cg / "job_2" / "cgroup.procs", "20\n")
    for pid in (10, 20):
        _write(roots.procfs / str(pid) / "environ", "PATH=/bin\0")
    _write(roots.procfs / "net" / "snmp", "Tcp: InSegs OutSegs RetransSegs\nTcp: 1 2\n")
    for data in (read_procs(roots), read_procs(roots, read_tree(roots, keep_pids=True))):
        assert [(p.pid, p.job_id) for p in data.processes] == [(10, "1"), (20, "2")]
        assert data.tcp is None
        assert data.skipped.counts["snmp_unparsable"] == 1
    assert dict(read_procs(roots).skipped.counts) == {"snmp_unparsable": 1, "pid_unparsable": 1}


def test_job_processes_from_the_cgroups_walk(tmp_path: Path) -> None:
    roots = Roots.under(tmp_path)
    cg = roots.cgroupfs
    _write(cg / "cgroup.controllers", "cpu memory\n")
    job = cg / "system.slice" / "slurmstepd.scope" / "job_81770"
    _write(job / "step_0" / "user" / "task_0" / "cgroup.procs", "4242\n4243\n4242\n")
    _write(job / "step_0" / "slurm" / "cgroup.procs", "4200\n4299\n")
    _write(cg / "user.slice" / "job_1" / "cgroup.procs", "1000\n")  # a job, elsewhere
    for pid, hca in ((4242, "mlx5_6"), (4243, "mlx5_7"), (4200, ""), (1000, "mlx5_0")):
        _write(roots.procfs / str(pid) / "environ", f"NCCL_IB_HCA={hca}\0PATH=/bin\0")
    tree = read_tree(roots, keep_pids=True)
    assert [(job, path) for job, path, _ in job_members(tree)] == [
        ("1", "/user.slice/job_1"),
        ("81770", "/system.slice/slurmstepd.scope/job_81770"),
    ]
    assert read_procs(roots, tree) == read_procs(roots)
    assert len(read_procs(roots).processes) == 4


def test_environments_are_read_for_new_processes_and_on_slow_runs(tmp_path: Path) -> None:
    roots = Roots.under(tmp_path)
    _write(roots.cgroupfs / "cgroup.controllers", "cpu memory\n")
    procs = roots.cgroupfs / "job_5" / "cgroup.procs"
    _write(procs, "10\n")
    _write(roots.procfs / "10" / "environ", "NCCL_IB_HCA=mlx5_0\0")
    source = ProcsSource(slow_every=2)

    def hcas() -> list[str | None]:
        return [p.nccl_ib_hca for p in source.collect(roots).processes]

    assert hcas() == ["mlx5_0"]
    _write(roots.procfs / "10" / "environ", "NCCL_IB_HCA=mlx5_1\0")
    _write(roots.procfs / "11" / "environ", "NCCL_IB_HCA=mlx5_2\0")
    _write(procs, "10\n11\n")
    assert hcas() == ["mlx5_0", "mlx5_2"]  # the new process at once, the known one later
    assert hcas() == ["mlx5_1", "mlx5_2"]
    (roots.procfs / "11" / "environ").unlink()  # exited: gone from cgroup.procs too
    _write(procs, "10\n")
    assert hcas() == ["mlx5_1"]
