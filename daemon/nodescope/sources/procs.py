"""The processes of Slurm jobs with the environment NCCL reads, and the TCP counters.

Reads, under the injected roots:

* the cgroup v2 hierarchy (``roots.cgroupfs``; ``Documentation/admin-guide/cgroup-v2.rst``):
  the job cgroups Slurm's cgroup/v2 plugin makes (``.../slurmstepd.scope/job_<id>/``,
  ``docs/datasources.md`` §5) and ``cgroup.procs`` of every cgroup below them. Which pids a
  job has comes from there: the relation ``/proc/<pid>/cgroup`` states from the process's
  side, read once per cgroup instead of once per process of the node;
* ``/proc/<pid>/environ`` of those processes only (``fs/proc/base.c`` ``environ_read``:
  ``NAME=value`` entries separated by NUL bytes, as the process's initial environment).
  Only :data:`KEPT_VARIABLES` are kept; the rest of an environment (tokens, keys) is dropped
  at parse time and never stored;
* ``/proc/net/snmp`` (``net/ipv4/proc.c`` ``snmp_seq_show``): per protocol group a header
  line of field names and a line of values, ``Tcp: RtoAlgorithm ... RetransSegs ...``. The
  TCP segment counters are the evidence that a stall lies in the PCIe domain and not on the
  network.
"""

from __future__ import annotations

import os
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from nodescope.errors import ParseError
from nodescope.model.counters import counter_rate
from nodescope.model.jobs import JobProcess
from nodescope.roots import Roots
from nodescope.sources.base import read_optional
from nodescope.sources.cgroup import find_v2_root

NAME = "procs"

#: Environment variables kept from a job process's environ.
KEPT_VARIABLES = ("NCCL_IB_HCA", "SLURM_JOB_ID", "CUDA_VISIBLE_DEVICES")

#: How deep below the cgroup root job cgroups are searched for, and how many directories a
#: run may visit: ``system.slice/slurmstepd.scope/job_<id>`` sits at depth 3.
MAX_SEARCH_DEPTH = 4
MAX_DIRECTORIES = 20_000

_JOB_DIR = re.compile(r"job_([0-9]+)")
_PID = re.compile(r"[0-9]+")


@dataclass(frozen=True, slots=True)
class TcpCounters:
    """The ``Tcp:`` group of ``/proc/net/snmp`` (cumulative segment counts)."""

    in_segs: int
    out_segs: int
    retrans_segs: int


@dataclass(frozen=True, slots=True)
class ProcsData:
    processes: tuple[JobProcess, ...]
    tcp: TcpCounters | None


@dataclass(frozen=True, slots=True)
class TcpRates:
    out_segs_per_second: float | None
    retrans_segs_per_second: float | None

    @property
    def retransmit_ratio(self) -> float | None:
        """Retransmitted over sent segments in the interval (``None`` when nothing was sent)."""
        if not self.out_segs_per_second or self.retrans_segs_per_second is None:
            return None
        return self.retrans_segs_per_second / self.out_segs_per_second


@dataclass(frozen=True, slots=True)
class ProcsRates:
    tcp: TcpRates | None


# --- parsers (pure) -------------------------------------------------------------------------


def parse_environ(text: str, source: str = "/proc/self/environ") -> tuple[tuple[str, str], ...]:
    """The :data:`KEPT_VARIABLES` of a NUL-separated environment, in file order.

    An entry without ``=`` (a process may overwrite its environment block) is skipped: it
    cannot name a variable.
    """
    kept: list[tuple[str, str]] = []
    for entry in text.split("\0"):
        name, sep, value = entry.partition("=")
        if sep and name in KEPT_VARIABLES:
            kept.append((name, value))
    return tuple(kept)


def parse_pids(text: str, source: str = "cgroup.procs") -> tuple[int, ...]:
    """``cgroup.procs``: one pid per line, unordered, duplicates possible; sorted unique."""
    pids: set[int] = set()
    for number, line in enumerate(text.split("\n"), start=1):
        token = line.strip()
        if not token:
            continue
        if not _PID.fullmatch(token):
            raise ParseError(source, f"not a pid: {token!r}", number)
        pids.add(int(token))
    return tuple(sorted(pids))


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


def job_id_of(directory_name: str) -> str | None:
    """The job id of a Slurm job cgroup named ``job_<id>``."""
    match = _JOB_DIR.fullmatch(directory_name)
    return match.group(1) if match else None


# --- readers (IO) ---------------------------------------------------------------------------


def _subdirectories(path: Path) -> list[str]:
    try:
        with os.scandir(path) as entries:
            return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
    except OSError:
        return []


def find_job_cgroups(root: Path) -> list[tuple[str, Path]]:
    """(job id, directory) of every ``job_<id>`` cgroup within :data:`MAX_SEARCH_DEPTH`."""
    found: list[tuple[str, Path]] = []
    queue: deque[tuple[Path, int]] = deque([(root, 0)])
    visited = 0
    while queue and visited < MAX_DIRECTORIES:
        directory, depth = queue.popleft()
        visited += 1
        for name in _subdirectories(directory):
            job = job_id_of(name)
            if job is not None:
                found.append((job, directory / name))
            elif depth + 1 < MAX_SEARCH_DEPTH:
                queue.append((directory / name, depth + 1))
    return found


def _job_processes(roots: Roots, job: str, job_dir: Path, root: Path) -> list[JobProcess]:
    processes: list[JobProcess] = []
    queue: deque[Path] = deque([job_dir])
    visited = 0
    while queue and visited < MAX_DIRECTORIES:
        directory = queue.popleft()
        visited += 1
        procs_path = directory / "cgroup.procs"
        text = read_optional(procs_path)
        if text is not None:
            cgroup = "/" + directory.relative_to(root).as_posix()
            for pid in parse_pids(text, str(procs_path)):
                environ_path = roots.procfs / str(pid) / "environ"
                environ = read_optional(environ_path)
                if environ is None:
                    continue  # exited since the listing
                env = dict(parse_environ(environ, str(environ_path)))
                processes.append(JobProcess(pid, job, cgroup, env.get("NCCL_IB_HCA")))
        queue.extend(directory / name for name in _subdirectories(directory))
    return processes


def read_procs(roots: Roots) -> ProcsData:
    hierarchy = find_v2_root(roots.cgroupfs)
    processes: list[JobProcess] = []
    if hierarchy.path is not None:
        for job, job_dir in find_job_cgroups(hierarchy.path):
            processes.extend(_job_processes(roots, job, job_dir, hierarchy.path))
    snmp_path = roots.procfs / "net" / "snmp"
    snmp = read_optional(snmp_path)
    tcp = None if snmp is None else parse_snmp(snmp, str(snmp_path))
    return ProcsData(tuple(sorted(processes, key=lambda p: p.pid)), tcp)


class ProcsSource:
    name = NAME

    def collect(self, roots: Roots) -> ProcsData:
        return read_procs(roots)

    def close(self) -> None:
        return None


def make_source() -> ProcsSource:
    return ProcsSource()


# --- rates ----------------------------------------------------------------------------------


def procs_rates(previous: ProcsData, current: ProcsData, seconds: float) -> ProcsRates:
    """TCP segments sent and retransmitted per second between two reads."""
    if previous.tcp is None or current.tcp is None:
        return ProcsRates(None)
    # The MIB counters are unsigned long: 64 bits on the 64-bit hosts nodescope runs on.
    return ProcsRates(
        TcpRates(
            counter_rate(previous.tcp.out_segs, current.tcp.out_segs, seconds),
            counter_rate(previous.tcp.retrans_segs, current.tcp.retrans_segs, seconds),
        )
    )
