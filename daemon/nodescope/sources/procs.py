"""The processes of Slurm jobs with the environment NCCL reads, and the TCP counters.

Reads, under the injected roots:

* the cgroup v2 hierarchy (``roots.cgroupfs``; ``Documentation/admin-guide/cgroup-v2.rst``):
  the job cgroups Slurm's cgroup/v2 plugin makes (``.../slurmstepd.scope/job_<id>/``,
  ``docs/datasources.md`` §5, found as :mod:`nodescope.sources.job_cgroups` finds them) and
  ``cgroup.procs`` of every cgroup below them, taken from the walk of the cgroup tree when
  the cycle has one (:class:`~nodescope.sources.cgroup.CycleWalk`). Which pids a
  job has comes from there: the relation ``/proc/<pid>/cgroup`` states from the process's
  side, read once per cgroup instead of once per process of the node;
* ``/proc/<pid>/environ`` of those processes only (``fs/proc/base.c`` ``environ_read``:
  ``NAME=value`` entries separated by NUL bytes, as the process's initial environment).
  Only :data:`KEPT_VARIABLES` are kept; the rest of an environment (tokens, keys) is dropped
  at parse time and never stored. The block is set at ``execve``: it is read for a new pid
  and every ``slow_every`` runs (:class:`EnvironMemo`);
* ``/proc/net/snmp`` (``net/ipv4/proc.c`` ``snmp_seq_show``): per protocol group a header
  line of field names and a line of values, ``Tcp: RtoAlgorithm ... RetransSegs ...``. The
  TCP segment counters are the evidence that a stall lies in the PCIe domain and not on the
  network.
"""

from __future__ import annotations

import os
import re
from collections import deque
from pathlib import Path

from nodescope.errors import ParseError
from nodescope.fileio import CGROUP_LIST, PROC_TABLE
from nodescope.model.jobs import JobProcess
from nodescope.model.procs import (
    PROCS,
    ProcsData,
    ProcsRates,
    TcpCounters,
    TcpRates,
    procs_rates,
)
from nodescope.model.skips import SkipTally
from nodescope.roots import Roots
from nodescope.sources.base import Environ, EnvironMemo, kept_environ, read_text
from nodescope.sources.cgroup import SLOW_EVERY, CgroupTree, CycleWalk, find_v2_root
from nodescope.sources.job_cgroups import (
    MAX_SEARCH_DEPTH,
    MAX_SEARCHED,
    PID_UNPARSABLE,
    find_job_dirs,
    job_dir_id,
    job_members,
    jobs_in_tree,
    parse_pids,
)
from nodescope.sources.spec import SourceSpec

NAME = PROCS.name

#: Environment variables kept from a job process's environ.
KEPT_VARIABLES = ("NCCL_IB_HCA", "SLURM_JOB_ID", "CUDA_VISIBLE_DEVICES")

#: How many directories a run may visit, in the search for job cgroups (within
#: :data:`~nodescope.sources.job_cgroups.MAX_SEARCH_DEPTH` levels) and below each job.
MAX_DIRECTORIES = MAX_SEARCHED

#: The job id of a Slurm job cgroup named ``job_<id>``.
job_id_of = job_dir_id

#: Why a record was skipped (the ``reason`` of ``nodescope_source_records_skipped_total``,
#: next to :data:`~nodescope.sources.job_cgroups.PID_UNPARSABLE`): a job cgroup whose
#: ``cgroup.procs`` cannot be read; a ``/proc/net/snmp`` that cannot be read or holds no
#: usable Tcp group (the job processes are reported all the same).
CGROUP_UNREADABLE = "cgroup_unreadable"
SNMP_UNREADABLE = "snmp_unreadable"
SNMP_UNPARSABLE = "snmp_unparsable"


# --- parsers (pure) -------------------------------------------------------------------------


def parse_environ(text: str, source: str = "/proc/self/environ") -> Environ:
    """The :data:`KEPT_VARIABLES` of a NUL-separated environment, in file order
    (:func:`~nodescope.sources.base.kept_environ`)."""
    return kept_environ(text, KEPT_VARIABLES)


def parse_snmp(text: str, source: str = "/proc/net/snmp") -> TcpCounters:
    """The TCP segment counters of ``/proc/net/snmp``."""
    lines = text.split("\n")
    for number, line in enumerate(lines, start=1):
        if not line.startswith("Tcp:"):
            continue
        if number >= len(lines) or not lines[number].startswith("Tcp:"):
            raise ParseError(source, "Tcp header line without a value line", number)
        names = line.split()[1:]
        values = lines[number].split()[1:]
        if len(names) != len(values):
            raise ParseError(
                source, f"{len(names)} Tcp field names but {len(values)} values", number + 1
            )
        fields: dict[str, int] = {}
        for name, value in zip(names, values, strict=True):
            if not re.fullmatch(r"-?[0-9]+", value):
                raise ParseError(source, f"Tcp {name}: not an integer: {value!r}", number + 1)
            fields[name] = int(value)
        try:
            return TcpCounters(fields["InSegs"], fields["OutSegs"], fields["RetransSegs"])
        except KeyError as exc:
            raise ParseError(source, f"Tcp group lacks {exc.args[0]}", number) from None
    raise ParseError(source, "no Tcp group")


# --- readers (IO) ---------------------------------------------------------------------------


def _subdirectories(path: Path) -> list[str]:
    try:
        with os.scandir(path) as entries:
            return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
    except OSError:
        return []


def find_job_cgroups(root: Path) -> list[tuple[str, Path]]:
    """(job id, directory) of every ``job_<id>`` cgroup within :data:`MAX_SEARCH_DEPTH`."""
    return [(job, Path(directory)) for job, directory in find_job_dirs(str(root), MAX_DIRECTORIES)]


def _read_procs_file(path: str, tally: SkipTally) -> str | None:
    """A ``cgroup.procs``; ``None`` when its cgroup is gone, or (counted) cannot be read."""
    try:
        return read_text(path, CGROUP_LIST)
    except FileNotFoundError:
        return None
    except OSError:
        tally.skip(CGROUP_UNREADABLE, path)
        return None


def _job_processes(
    roots: Roots, job: str, job_dir: Path, root: Path, memo: EnvironMemo, tally: SkipTally
) -> list[JobProcess]:
    processes: list[JobProcess] = []
    queue: deque[str] = deque([str(job_dir)])
    prefix = len(str(root))
    visited = 0
    while queue and visited < MAX_DIRECTORIES:
        directory = queue.popleft()
        visited += 1
        procs_path = f"{directory}/cgroup.procs"
        text = _read_procs_file(procs_path, tally)
        if text is not None:
            cgroup = directory[prefix:] or "/"
            pids = parse_pids(text, procs_path, tally)
            processes.extend(_processes(roots, job, cgroup, pids, memo))
        queue.extend(f"{directory}/{name}" for name in _subdirectories(Path(directory)))
    return processes


def _processes(
    roots: Roots, job: str, cgroup: str, pids: tuple[int, ...], memo: EnvironMemo
) -> list[JobProcess]:
    processes: list[JobProcess] = []
    for pid in pids:
        environ = memo.get(roots, pid)
        if environ is not None:  # else it exited since the listing
            processes.append(JobProcess(pid, job, cgroup, dict(environ).get("NCCL_IB_HCA")))
    return processes


def read_procs(
    roots: Roots, tree: CgroupTree | None = None, memo: EnvironMemo | None = None
) -> ProcsData:
    """The job processes and the TCP counters; the job cgroups from ``tree`` (a whole walk
    with the id lists) when given, else from the directories."""
    memo = EnvironMemo(parse_environ) if memo is None else memo
    tally = SkipTally()
    processes: list[JobProcess] = []
    if tree is not None and tree.mode != "none" and not tree.truncated:
        for found, cgroups in jobs_in_tree(tree):
            if found.job_id is None:
                continue  # named by its SLUID: its processes say which job it is
            for cgroup in cgroups:
                if cgroup.procs:
                    pids = tuple(sorted(set(cgroup.procs)))
                    processes.extend(_processes(roots, found.job_id, cgroup.path, pids, memo))
    else:
        hierarchy = find_v2_root(roots.cgroupfs)
        if hierarchy.path is not None:
            for job, job_dir in find_job_cgroups(hierarchy.path):
                processes.extend(_job_processes(roots, job, job_dir, hierarchy.path, memo, tally))
    return ProcsData(
        tuple(sorted(processes, key=lambda p: p.pid)), _tcp_counters(roots, tally), tally.freeze()
    )


def _tcp_counters(roots: Roots, tally: SkipTally) -> TcpCounters | None:
    """The TCP counters; ``None`` without ``/proc/net/snmp`` (no IPv4), and — counted — when
    it holds no usable Tcp group: the job processes do not depend on it."""
    snmp_path = roots.procfs / "net" / "snmp"
    try:
        snmp = read_text(snmp_path, PROC_TABLE)
    except FileNotFoundError:
        return None
    except OSError:
        tally.skip(SNMP_UNREADABLE, str(snmp_path))
        return None
    try:
        return parse_snmp(snmp, str(snmp_path))
    except ParseError as exc:
        tally.skip(SNMP_UNPARSABLE, str(exc))
        return None


class ProcsSource:
    """Job processes from the cgroup walk of the cycle when a source that needs the whole
    tree runs in it (:meth:`~nodescope.sources.cgroup.CycleWalk.if_shared`), else from the
    jobs' ``cgroup.procs``; ``environ`` of known processes every ``slow_every`` runs."""

    name = NAME

    def __init__(self, slow_every: int = SLOW_EVERY, walk: CycleWalk | None = None) -> None:
        self.slow_every = slow_every
        self.walk = CycleWalk() if walk is None else walk
        self._memo = EnvironMemo(parse_environ)
        self._runs = 0

    def collect(self, roots: Roots) -> ProcsData:
        self._memo.refresh = self._runs % max(1, self.slow_every) == 0
        self._runs += 1
        data = read_procs(roots, self.walk.if_shared(roots), self._memo)
        self._memo.end_run()
        return data

    def close(self) -> None:
        self._memo = EnvironMemo(parse_environ)
        self._runs = 0


def make_source(walk: CycleWalk | None = None) -> ProcsSource:
    """The source; ``walk``: the cgroup walk it shares with the other cgroup sources."""
    return ProcsSource(walk=walk)


SPEC = SourceSpec(
    name="procs",
    default_interval=15.0,
    help="Slurm job processes (cgroup.procs) with NCCL_IB_HCA from their environ; TCP counters",
    build=lambda inputs: make_source(walk=inputs.cgroup_walk),
    rates=lambda derived: derived.procs_rates,
    metric_area="nodescope_exporters.job_metrics",
    sim_parts=frozenset({"processes", "cgroups", "proc_files"}),
)


__all__ = [
    "CGROUP_UNREADABLE",
    "KEPT_VARIABLES",
    "MAX_DIRECTORIES",
    "MAX_SEARCH_DEPTH",
    "NAME",
    "PID_UNPARSABLE",
    "PROCS",
    "SNMP_UNPARSABLE",
    "SNMP_UNREADABLE",
    "ProcsData",
    "ProcsRates",
    "ProcsSource",
    "TcpCounters",
    "TcpRates",
    "find_job_cgroups",
    "find_job_dirs",
    "job_id_of",
    "job_members",
    "make_source",
    "parse_environ",
    "parse_pids",
    "parse_snmp",
    "procs_rates",
    "read_procs",
]
