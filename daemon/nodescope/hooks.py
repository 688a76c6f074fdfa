"""The Slurm hooks' commands on the daemon's socket, and the job bookkeeping behind them.

The socket itself — protocol, who may connect, deadlines, concurrency — is
:mod:`nodescope.hooksocket`; its names are re-exported here. ``ping``, ``prolog``, ``epilog``
and ``clear_xids`` are registered here; ``probe`` and ``probe_result`` come from
:mod:`nodescope.probe_runner`. Every field of a request is bounded
(:meth:`JobRequest.from_request`): a job id of at most ten digits, names of at most
:data:`MAX_NAME_LENGTH` printable characters, GPU indices among the node's GPUs.

The prolog registers a job (``<run>/nodescope/jobs/<id>.json``, read back by the ``jobs``
source), takes the counter baseline and runs the health gate; the epilog writes the job's
report (:mod:`nodescope_exporters.reports`) and removes the registration. When the daemon is
down, :mod:`nodescope.cli.slurm` calls the same functions with what it can read itself.
The registration goes whether or not the report could be written (a full disk must not keep
a finished job in ``nodescope_job_info``). Uncleared Xids are recorded in
``<run>/nodescope/gate-state.json`` whenever they change, so that neither a daemon out of reach
nor a restarted one (its NVML counts start from zero) lets a node pass that failed the gate.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodescope import derive
from nodescope.config import Config, SlurmSettings
from nodescope.fileio import PROC_PROCESS, FileKind
from nodescope.hooksocket import (
    SOCKET_NAME,
    HookServer,
    HookUnavailable,
    Peer,
    Request,
    Response,
    allowed_uids,
    call,
    prepare_directory,
    slurm_uid,
)
from nodescope.jobs import Job, jobs_of
from nodescope.model.alert import AlertState
from nodescope.model.snapshot import Snapshot
from nodescope.probe_runner import ProbeHook
from nodescope.roots import Roots
from nodescope.sources.base import read_optional
from nodescope.sources.diskstats import DisksData, read_disks
from nodescope.sources.infiniband import InfinibandData, read_infiniband
from nodescope.sources.jobs import (
    NVIDIA_MAJOR,
    REGISTRATION_FORMAT,
    RUN_SUBDIR,
    parse_gpu_list,
    registrations_dir,
)
from nodescope.sources.nvml import NvmlData, NvmlRates
from nodescope_exporters.reports import (
    REPORT_FORMAT,
    StaleReport,
    counter_deltas,
    counter_sample,
    remove_orphan_temporaries,
    write_private,
    write_report,
)

__all__ = [
    "SOCKET_NAME",
    "HookServer",
    "HookUnavailable",
    "Peer",
    "allowed_uids",
    "call",
    "socket_path",
]

log = logging.getLogger("nodescope.hooks")

#: Bounds of what the tracker remembers.
MAX_EPISODES = 20_000
MAX_SAMPLES = 720
#: A job window not seen and not registered for this long is forgotten.
FORGET_SECONDS = 3600.0
#: Finding kinds that are node-wide contention: a report lists their episodes whatever they
#: name, since a job shares the PCIe tree and the fabric with everything else on the node.
CONTENTION_KINDS = frozenset(
    {"pcie_contention", "pcie_saturation", "nvlink_bandwidth_saturation", "ib_xmit_wait"}
)

#: Bounds of a request's fields: Slurm job ids are 32-bit numbers; user names are at most
#: LOGIN_NAME_MAX; the GPU list cannot be longer than the node's GPUs, and where the node's
#: GPUs are not known (no NVML, no /dev/nvidia<N>) no index reaches MAX_GPU_INDEX.
MAX_JOB_ID_DIGITS = 10
MAX_NAME_LENGTH = 256
MAX_EXIT_CODE_LENGTH = 32
MAX_GPU_INDEX = 256
MAX_HOLDERS = 1024
GATE_STATE_NAME = "gate-state.json"
GATE_STATE_FORMAT = "nodescope-gate-state/1"



def _printable(name: str) -> str:
    """A process name as one line of text: its user chose it, newlines and escapes included,
    and it lands in Slurm's reason and the job's output."""
    return name.encode("unicode_escape").decode("ascii")

def run_dir(roots: Roots) -> Path:
    return roots.run / RUN_SUBDIR


def socket_path(roots: Roots) -> Path:
    return run_dir(roots) / SOCKET_NAME


# ---------------------------------------------------------------------------------------------
# The health gate (pure checks, and the few reads the hook does itself)


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass(frozen=True, slots=True)
class GateInputs:
    """What the gate looks at. ``None``: not known here (the daemon is down), not checked."""

    gpu_count: int | None
    gpu_count_source: str
    xids: tuple[tuple[str, int, int], ...] | None  # (gpu, code, count since cleared)
    links: tuple[tuple[int, int | None, int | None, int | None], ...] | None
    missing_modules: tuple[str, ...]


def gate_checks(settings: SlurmSettings, inputs: GateInputs) -> list[Check]:
    checks: list[Check] = []
    if settings.expected_gpus:
        count = inputs.gpu_count
        ok = count is not None and count >= settings.expected_gpus
        checks.append(
            Check(
                "gpus",
                ok,
                f"expected {settings.expected_gpus} GPUs, found {count}"
                f" ({inputs.gpu_count_source})",
            )
        )
    if settings.xid_codes and inputs.xids is not None:
        # A negative code stands for a gate record that could not be read: it fails too.
        bad = [x for x in inputs.xids if (x[1] in settings.xid_codes or x[1] < 0) and x[2] > 0]
        detail = ", ".join(
            f"Xid {code} on GPU {gpu} ({n}x)" if code >= 0 else "Xid record unreadable"
            for gpu, code, n in bad
        )
        checks.append(
            Check(
                "xid",
                not bad,
                f"uncleared {detail}; clear with `nodescope slurm clear-xids`"
                if bad
                else "no uncleared Xid",
            )
        )
    if inputs.links is not None and (settings.check_link_width or settings.min_link_gen):
        bad_links: list[str] = []
        for gpu, width, max_width, gen in inputs.links:
            if settings.check_link_width and width and max_width and width < max_width:
                bad_links.append(f"GPU {gpu} link x{width} of x{max_width}")
            if settings.min_link_gen and gen and gen < settings.min_link_gen:
                bad_links.append(f"GPU {gpu} link Gen{gen} below Gen{settings.min_link_gen}")
        checks.append(
            Check("links", not bad_links, "; ".join(bad_links) or "GPU links at expected width")
        )
    if settings.required_modules:
        missing = inputs.missing_modules
        checks.append(
            Check(
                "modules",
                not missing,
                f"kernel module(s) not loaded: {', '.join(missing)}"
                if missing
                else "required modules loaded",
            )
        )
    return checks


def unfit_reason(checks: Iterable[Check]) -> str | None:
    """One line for Slurm's drain reason, or ``None`` when every check passed."""
    failed = [c.detail for c in checks if not c.ok]
    if not failed:
        return None
    return ("nodescope: " + "; ".join(failed)).replace("\n", " ")[:200]


def count_dev_gpus(roots: Roots) -> int:
    """``/dev/nvidia<N>`` character devices (not nvidiactl, nvidia-uvm, …)."""
    count = 0
    try:
        with os.scandir(roots.dev) as entries:
            for entry in entries:
                name = entry.name
                if name.startswith("nvidia") and name[6:].isdigit():
                    with contextlib.suppress(OSError):
                        if stat.S_ISCHR(entry.stat(follow_symlinks=True).st_mode):
                            count += 1
    except OSError:
        return 0
    return count


def dev_gpu_minors(roots: Roots) -> frozenset[int]:
    """Minors of the ``/dev/nvidia<N>`` character devices: the node's GPU indices when NVML
    has not been read."""
    minors: set[int] = set()
    try:
        with os.scandir(roots.dev) as entries:
            for entry in entries:
                name = entry.name
                if name.startswith("nvidia") and name[6:].isdigit() and len(name) < 12:
                    with contextlib.suppress(OSError):
                        if stat.S_ISCHR(entry.stat(follow_symlinks=True).st_mode):
                            minors.add(int(name[6:]))
    except OSError:
        return frozenset()
    return frozenset(minors)


def _holders_of(value: Any) -> list[dict[str, Any]]:
    """The epilog's own finding of GPU holders, bounded and typed."""
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_HOLDERS:
        raise ValueError(f"gpu_holders: expected a list of at most {MAX_HOLDERS}")
    out = []
    for holder in value:
        if not isinstance(holder, dict):
            raise ValueError("gpu_holders: expected objects")
        pid, gpu, comm = holder.get("pid"), holder.get("gpu"), holder.get("comm")
        if not (isinstance(pid, int) and isinstance(gpu, int)) or not (
            _is_int(pid) and 0 < pid < 1 << 32 and _is_int(gpu) and 0 <= gpu < MAX_GPU_INDEX
        ):
            raise ValueError("gpu_holders: pid and gpu must be numbers in range")
        if comm is not None and not (isinstance(comm, str) and len(comm) <= MAX_NAME_LENGTH):
            raise ValueError("gpu_holders: comm must be short text")
        out.append({"pid": pid, "gpu": gpu, "comm": comm})
    return out


def missing_modules(roots: Roots, names: Sequence[str]) -> tuple[str, ...]:
    return tuple(n for n in names if not (roots.sysfs / "module" / n).is_dir())


def local_gate_inputs(config: Config) -> GateInputs:
    """What the hook checks itself when the daemon does not answer: the GPU device nodes,
    the kernel modules, and the uncleared Xids the daemon last recorded
    (:func:`read_gate_state`), so that a daemon out of reach never clears the gate."""
    roots = config.roots
    return GateInputs(
        gpu_count=count_dev_gpus(roots),
        gpu_count_source=f"{roots.dev}/nvidia<N>",
        xids=read_gate_state(roots),
        links=None,
        missing_modules=missing_modules(roots, config.slurm.required_modules),
    )


def gpu_holders(
    roots: Roots, minors: Iterable[int], major: int = NVIDIA_MAJOR
) -> list[dict[str, Any]]:
    """Processes with an open file on an NVIDIA GPU of ``minors`` (character device
    ``major``:N, 195 for ``/dev/nvidia<N>``), found through ``/proc/<pid>/fd``. Sockets, pipes
    and anonymous inodes are skipped without a ``stat``: this costs one ``readlink`` per open
    file of the node."""
    wanted = {os.makedev(major, m) for m in minors}
    if not wanted:
        return []
    holders: list[dict[str, Any]] = []
    me = os.getpid()
    try:
        pids = [int(n) for n in os.listdir(roots.procfs) if n.isdigit()]
    except OSError:
        return []
    for pid in sorted(pids):
        if pid == me:
            continue
        fd_dir = roots.procfs / str(pid) / "fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        found: set[int] = set()
        for fd in fds:
            try:
                target = os.readlink(fd_dir / fd)
                if target.startswith(("socket:", "pipe:", "anon_inode:")):
                    continue
                st = os.stat(fd_dir / fd)
            except OSError:
                continue
            if stat.S_ISCHR(st.st_mode) and st.st_rdev in wanted:
                found.add(os.minor(st.st_rdev))
        if found:
            comm = read_optional(roots.procfs / str(pid) / "comm", PROC_PROCESS)
            for minor in sorted(found):
                holders.append(
                    {
                        "pid": pid,
                        "gpu": minor,
                        # The kernel's one newline goes; the name's own characters stay.
                        "comm": None if comm is None else comm.removesuffix("\n"),
                    }
                )
    return holders


# ---------------------------------------------------------------------------------------------
# Registrations


@dataclass(frozen=True, slots=True)
class JobRequest:
    """A job as the hook environment describes it (``SLURM_JOB_ID``, ``SLURM_JOB_UID``, …)."""

    job_id: str
    uid: int | None = None
    user: str | None = None
    partition: str | None = None
    gpus: tuple[int, ...] = ()
    exit_code: str | None = None

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> JobRequest:
        job_id = env.get("SLURM_JOB_ID", "")
        if not _is_job_id(job_id):
            raise ValueError(f"SLURM_JOB_ID is not a job id: {job_id!r}")
        uid_text = env.get("SLURM_JOB_UID", "")
        try:
            gpus = parse_gpu_list(env.get("SLURM_JOB_GPUS", ""))
        except ValueError:
            gpus = ()
        return cls(
            job_id=job_id,
            uid=int(uid_text) if uid_text.isdigit() and uid_text.isascii() else None,
            user=env.get("SLURM_JOB_USER") or None,
            partition=env.get("SLURM_JOB_PARTITION") or None,
            gpus=gpus,
            exit_code=env.get("SLURM_JOB_EXIT_CODE") or None,
        )

    @classmethod
    def from_request(
        cls, request: Mapping[str, Any], node_gpus: frozenset[int] | None = None
    ) -> JobRequest:
        """The job a hook request names, every field bounded; ``ValueError`` names the
        field. ``node_gpus``: the node's GPU indices, when known; ``gpus`` must be among
        them (otherwise below :data:`MAX_GPU_INDEX`)."""
        job_id = request.get("job_id")
        if not _is_job_id(job_id):
            raise ValueError(f"job_id: not a job id: {_shown(job_id)}")
        assert isinstance(job_id, str)
        uid = request.get("uid")
        if uid is not None and not (_is_int(uid) and 0 <= uid < 1 << 32):
            raise ValueError(f"uid: not a user id: {_shown(uid)}")
        gpus = request.get("gpus") or []
        limit = len(node_gpus) if node_gpus is not None else MAX_GPU_INDEX
        if not isinstance(gpus, list) or len(gpus) > limit:
            raise ValueError(f"gpus: expected a list of at most {limit} GPU indices")
        for gpu in gpus:
            if not (_is_int(gpu) and 0 <= gpu < MAX_GPU_INDEX):
                raise ValueError(f"gpus: not a GPU index: {_shown(gpu)}")
            if node_gpus is not None and gpu not in node_gpus:
                known = ",".join(str(g) for g in sorted(node_gpus)) or "none"
                raise ValueError(f"gpus: {gpu} is not a GPU of this node (GPUs: {known})")

        def text(key: str, longest: int) -> str | None:
            value = request.get(key)
            if value is None or value == "":
                return None
            if not isinstance(value, str) or len(value) > longest or not value.isprintable():
                raise ValueError(f"{key}: expected printable text of at most {longest} characters")
            return value

        return cls(
            job_id=job_id,
            uid=uid,
            user=text("user", MAX_NAME_LENGTH),
            partition=text("partition", MAX_NAME_LENGTH),
            gpus=tuple(sorted(set(gpus))),
            exit_code=text("exit_code", MAX_EXIT_CODE_LENGTH),
        )

    def as_request(self) -> Request:
        return {
            "job_id": self.job_id,
            "uid": self.uid,
            "user": self.user,
            "partition": self.partition,
            "gpus": list(self.gpus),
            "exit_code": self.exit_code,
        }


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_job_id(value: Any) -> bool:
    return (
        isinstance(value, str)
        and 0 < len(value) <= MAX_JOB_ID_DIGITS
        and value.isascii()
        and value.isdigit()
    )


def _shown(value: Any) -> str:
    """A value for an error message, cut short: the request may be hostile."""
    return repr(value)[:40]


def write_registration(
    roots: Roots, job: JobRequest, baseline: Mapping[str, Any], wall_time: float
) -> Path:
    document = {
        "format": REGISTRATION_FORMAT,
        "job_id": job.job_id,
        "uid": job.uid,
        "user": job.user,
        "partition": job.partition,
        "gpus": list(job.gpus),
        "registered_at": wall_time,
        "baseline": dict(baseline),
    }
    prepare_directory(run_dir(roots))
    return write_private(
        registrations_dir(roots),
        f"{job.job_id}.json",
        (json.dumps(document, allow_nan=False) + "\n").encode(),
        0o640,
    )


def read_registration(roots: Roots, job_id: str) -> dict[str, Any] | None:
    text = read_optional(registrations_dir(roots) / f"{job_id}.json")
    if text is None:
        return None
    try:
        document = json.loads(text)
    except ValueError:
        return None
    return document if isinstance(document, dict) else None


def remove_registration(roots: Roots, job_id: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(registrations_dir(roots) / f"{job_id}.json")


def local_sample(roots: Roots, wall_time: float) -> dict[str, Any]:
    """The counters the hook can read without the daemon: InfiniBand ports and disks."""
    infiniband: InfinibandData | None
    disks: DisksData | None
    try:
        infiniband = read_infiniband(roots)
    except Exception:  # a counter file that cannot be parsed costs those figures only
        infiniband = None
    try:
        disks = read_disks(roots)
    except Exception:
        disks = None
    return counter_sample(None, infiniband, disks, wall_time)


# ---------------------------------------------------------------------------------------------
# The gate's memory: uncleared Xids outlive the daemon


def gate_state_path(roots: Roots) -> Path:
    return run_dir(roots) / GATE_STATE_NAME


def write_gate_state(roots: Roots, xids: Sequence[tuple[str, int, int]], wall_time: float) -> None:
    """Record the uncleared Xids where the hooks and the next daemon find them: a daemon
    that cannot be reached, or restarted (its Xid counts start again from zero), must not
    turn a node that failed the gate into one that passes."""
    document = {
        "format": GATE_STATE_FORMAT,
        "written_at": wall_time,
        "uncleared_xids": [{"gpu": g, "xid": x, "count": n} for g, x, n in xids],
    }
    prepare_directory(run_dir(roots))
    write_private(run_dir(roots), GATE_STATE_NAME, (json.dumps(document) + "\n").encode(), 0o640)


#: The record of uncleared Xids is a few hundred bytes; anything of 1 MiB or more is not one.
GATE_STATE_FILE = FileKind("uncleared-Xid record", (1 << 20) - 1)


def read_gate_state(roots: Roots) -> tuple[tuple[str, int, int], ...] | None:
    """The uncleared Xids last recorded; ``None`` when there is no record. A record that
    cannot be read is not "no Xids": it counts as one uncleared Xid of unknown kind, so that
    spoiling the file cannot clear the gate."""
    path = gate_state_path(roots)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError:
        return (("?", -1, 1),)
    # lstat: a symlink in its place is refused; the file layer refuses the rest (a FIFO, a
    # device, anything of 1 MiB or more).
    text = None if stat.S_ISLNK(info.st_mode) else read_optional(path, GATE_STATE_FILE)
    try:
        document = json.loads(text or "")
        xids = document["uncleared_xids"]
        if document.get("format") != GATE_STATE_FORMAT or not isinstance(xids, list):
            raise ValueError("not a gate state")
        out = []
        for entry in xids[: MAX_GPU_INDEX * 8]:
            gpu, xid, count = entry["gpu"], entry["xid"], entry["count"]
            if not (isinstance(gpu, str) and _is_int(xid) and _is_int(count)):
                raise ValueError("bad entry")
            out.append((gpu[:64], xid, count))
        return tuple(out)
    except (ValueError, KeyError, TypeError):
        return (("?", -1, 1),)


# ---------------------------------------------------------------------------------------------
# Reports


def build_report(
    job: JobRequest,
    registration: Mapping[str, Any] | None,
    end_sample: Mapping[str, Any],
    end_wall: float,
    *,
    daemon: bool,
    window: JobWindow | None = None,
    findings: Sequence[Mapping[str, Any]] = (),
    alerts: Sequence[Mapping[str, Any]] = (),
    contention: Sequence[Mapping[str, Any]] = (),
    holders: Sequence[Mapping[str, Any]] = (),
    issued_at: float | None = None,
) -> dict[str, Any]:
    """A job's report. ``issued_at``: when the epilog call began (wall clock), which orders
    two reports of one job (:func:`nodescope_exporters.reports.write_report`)."""
    registration = registration or {}
    gpus = list(job.gpus) or list(registration.get("gpus", []))
    start = registration.get("registered_at")
    if not isinstance(start, int | float):
        start = window.first_seen if window is not None else None
    baseline = registration.get("baseline")
    deltas = (
        counter_deltas(baseline, end_sample, gpus if gpus else None)
        if isinstance(baseline, Mapping)
        else None
    )
    reason = None
    if holders:
        shown = ", ".join(
            f"pid {h['pid']} ({_printable(h.get('comm') or '?')}) on GPU {h['gpu']}"
            for h in holders
        )
        reason = f"nodescope: job {job.job_id} GPU(s) still held after the job: {shown}"[:200]
    memory: dict[str, Any] = {}
    if window is not None:
        memory = {
            "peak_bytes": window.peak_memory,
            "limit_bytes": window.memory_limit,
            "oom_kills": window.oom_kills,
        }
    return {
        "format": REPORT_FORMAT,
        "job_id": job.job_id,
        "user": job.user or registration.get("user"),
        "uid": job.uid if job.uid is not None else registration.get("uid"),
        "partition": job.partition or registration.get("partition"),
        "gpus": gpus,
        "gpu_source": "SLURM_JOB_GPUS"
        if gpus
        else (window.gpu_source if window is not None else "none"),
        "exit_code": job.exit_code,
        "start": start,
        "end": end_wall,
        "duration_seconds": None if start is None else end_wall - start,
        "daemon": daemon,
        "registered": bool(registration),
        "deltas": deltas,
        "memory": memory,
        "findings": list(findings),
        "alerts": list(alerts),
        "contention": list(contention),
        "gpu_holders": list(holders),
        "timeline": window.timeline() if window is not None else {"t": [], "series": {}},
        "verdict": {"ok": reason is None, "reason": reason},
        "issued_at": end_wall if issued_at is None else issued_at,
    }


# ---------------------------------------------------------------------------------------------
# The tracker: what the daemon remembers between prolog and epilog


@dataclass
class Episode:
    """A finding (or alert) over consecutive cycles: first and last wall time seen."""

    key: str
    kind: str
    severity: str
    subjects: dict[str, str]
    message: str
    first: float
    last: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "kind": self.kind,
            "severity": self.severity,
            "subjects": dict(self.subjects),
            "message": self.message,
            "first": self.first,
            "last": self.last,
            "start": self.first,
            "end": self.last,
            "seconds": self.last - self.first,
        }


@dataclass
class JobWindow:
    """What the daemon saw of one job while it ran."""

    job_id: str
    first_seen: float
    last_seen: float
    gpus: tuple[int, ...] = ()
    gpu_source: str = "none"
    peak_memory: int | None = None
    memory_limit: int | None = None
    oom_kills: int = 0
    times: list[float] = field(default_factory=list)
    series: dict[str, list[float | None]] = field(default_factory=dict)

    def add_sample(self, t: float, values: Mapping[str, float | None]) -> None:
        self.times.append(t)
        for name in set(self.series) | set(values):
            column = self.series.setdefault(name, [None] * (len(self.times) - 1))
            column.append(values.get(name))
        if len(self.times) > MAX_SAMPLES:
            # Halve the resolution rather than forget the start of a long job.
            self.times = self.times[::2]
            self.series = {k: v[::2] for k, v in self.series.items()}

    def timeline(self) -> dict[str, Any]:
        return {"t": list(self.times), "series": {k: list(v) for k, v in self.series.items()}}


def _relevant(subjects: Mapping[str, str], job: str, gpus: set[str], bdfs: set[str]) -> bool:
    for role, name in subjects.items():
        if role == "job" and name == job:
            return True
        if role == "gpu" and name in gpus:
            return True
        if name in bdfs:
            return True
    return False


class JobTracker:
    """Fed every analysed snapshot by the service; answers the prolog and the epilog."""

    def __init__(self, config: Callable[[], Config]) -> None:
        self._config = config
        self._lock = threading.Lock()
        self.latest: Snapshot | None = None
        self._xid_cleared: dict[str, int] | None = None
        self._open: dict[str, Episode] = {}
        self._closed: deque[Episode] = deque(maxlen=MAX_EPISODES)
        self._alerts_open: dict[str, Episode] = {}
        self._alerts_closed: deque[Episode] = deque(maxlen=MAX_EPISODES)
        self.windows: dict[str, JobWindow] = {}
        # Uncleared Xids recorded before this daemon started (NVML counts restart at zero).
        self._carried_xids: tuple[tuple[str, int, int], ...] = read_gate_state(config().roots) or ()
        self._recorded_xids: tuple[tuple[str, int, int], ...] | None = None

    # -- observation ---------------------------------------------------------------------
    def observe(self, snapshot: Snapshot) -> None:
        with self._lock:
            self.latest = snapshot
            now = snapshot.wall_time
            nvml = snapshot.data("nvml", NvmlData)
            if self._xid_cleared is None and nvml is not None:
                self._xid_cleared = _xid_counts(nvml)
            self._track(
                self._open,
                self._closed,
                (
                    (f.key, f.kind, f.severity.label, dict(f.subjects), f.message)
                    for f in snapshot.findings
                ),
                now,
            )
            self._track(
                self._alerts_open,
                self._alerts_closed,
                (
                    (a.key, a.kind, a.severity.label, dict(a.subjects), a.message)
                    for a in snapshot.alerts
                    if a.state is AlertState.FIRING
                ),
                now,
            )
            self._observe_jobs(snapshot, now)
            # Under the lock: a clear-xids in between must not be overwritten by older Xids.
            self._record_xids(self.xid_inputs(), now)

    def _record_xids(self, xids: tuple[tuple[str, int, int], ...] | None, now: float) -> None:
        """Write the gate record when the uncleared Xids change (not every cycle)."""
        if xids is None or xids == self._recorded_xids:
            return
        try:
            write_gate_state(self._config().roots, xids, now)
        except OSError as exc:
            log.error("event=gate_state_not_written error=%r", str(exc))
            return
        self._recorded_xids = xids

    @staticmethod
    def _track(
        open_: dict[str, Episode],
        closed: deque[Episode],
        items: Iterable[tuple[str, str, str, dict[str, str], str]],
        now: float,
    ) -> None:
        seen: set[str] = set()
        for key, kind, severity, subjects, message in items:
            seen.add(key)
            episode = open_.get(key)
            if episode is None:
                open_[key] = Episode(key, kind, severity, subjects, message, now, now)
            else:
                episode.last = now
                episode.message = message
                if severity == "critical" or (severity == "warning" and episode.severity == "info"):
                    episode.severity = severity
        for key in [k for k in open_ if k not in seen]:
            closed.append(open_.pop(key))

    def _observe_jobs(self, snapshot: Snapshot, now: float) -> None:
        rates = derive.derived(snapshot, "nvml")
        pcie: dict[int, float] = {}
        if isinstance(rates, NvmlRates):
            for gpu in rates.gpus:
                tx, rx = gpu.pcie_tx_bytes_per_second, gpu.pcie_rx_bytes_per_second
                if tx is not None or rx is not None:
                    pcie[gpu.index] = (tx or 0.0) + (rx or 0.0)
        for job in jobs_of(snapshot):
            window = self.windows.get(job.job_id)
            if window is None:
                window = JobWindow(job.job_id, now, now)
                self.windows[job.job_id] = window
            window.last_seen = now
            window.gpus, window.gpu_source = job.gpus, job.gpu_source
            if not job.running:
                continue
            self._sample(window, job, pcie, now)
        for job_id in [j for j, w in self.windows.items() if now - w.last_seen > FORGET_SECONDS]:
            del self.windows[job_id]

    @staticmethod
    def _sample(window: JobWindow, job: Job, pcie: Mapping[int, float], now: float) -> None:
        stats = job.stats
        memory = stats.memory_current if stats is not None else None
        peaks = [
            v
            for v in (memory, stats.memory_peak if stats is not None else None, window.peak_memory)
            if v is not None
        ]
        window.peak_memory = max(peaks) if peaks else None
        window.memory_limit = job.memory_limit_bytes
        if stats is not None and stats.memory_events is not None:
            window.oom_kills = max(window.oom_kills, stats.memory_events.oom_kill or 0)
        gpu_rates = [pcie[g] for g in job.gpus if g in pcie]
        window.add_sample(
            now,
            {
                "memory_bytes": float(memory) if memory is not None else None,
                "gpu_pcie_bytes_per_second": sum(gpu_rates) if gpu_rates else None,
            },
        )

    # -- what the reports take -----------------------------------------------------------
    def _episodes(
        self, open_: Mapping[str, Episode], closed: Iterable[Episode], start: float, end: float
    ) -> list[Episode]:
        return [e for e in [*closed, *open_.values()] if e.last >= start and e.first <= end]

    def xid_inputs(self) -> tuple[tuple[str, int, int], ...] | None:
        snapshot = self.latest
        nvml = snapshot.data("nvml", NvmlData) if snapshot is not None else None
        if nvml is None:
            return self._carried_xids or None
        cleared = self._xid_cleared or {}
        merged: dict[tuple[str, int], int] = {}
        for gpu, code, count in self._carried_xids:
            merged[(gpu, code)] = merged.get((gpu, code), 0) + count
        for key, count in _xid_counts(nvml).items():
            name, _, code_text = key.rpartition(":")
            moved = count - cleared.get(key, 0)
            if moved > 0:
                merged[(name, int(code_text))] = merged.get((name, int(code_text)), 0) + moved
        return tuple((gpu, code, n) for (gpu, code), n in sorted(merged.items()))

    def gate_inputs(self, config: Config) -> GateInputs:
        with self._lock:
            snapshot = self.latest
            nvml = snapshot.data("nvml", NvmlData) if snapshot is not None else None
            if nvml is not None:
                count, source = nvml.device_count, "NVML"
                links: tuple[tuple[int, int | None, int | None, int | None], ...] | None = tuple(
                    (g.index, g.pcie_width_current, g.pcie_width_max, g.pcie_gen_current)
                    for g in nvml.gpus
                )
            else:
                count, source = count_dev_gpus(config.roots), f"{config.roots.dev}/nvidia<N>"
                links = None
            return GateInputs(
                gpu_count=count,
                gpu_count_source=source,
                xids=self.xid_inputs(),
                links=links,
                missing_modules=missing_modules(config.roots, config.slurm.required_modules),
            )

    # -- commands ------------------------------------------------------------------------
    def node_gpus(self, config: Config) -> frozenset[int] | None:
        """The node's GPU indices: NVML's, else the minors of ``/dev/nvidia<N>``; ``None``
        when neither is known."""
        with self._lock:
            snapshot = self.latest
        nvml = snapshot.data("nvml", NvmlData) if snapshot is not None else None
        if nvml is not None and nvml.gpus:
            return frozenset(g.index for g in nvml.gpus)
        minors = dev_gpu_minors(config.roots)
        return minors or None

    def prolog(self, request: Request, peer: Peer) -> Response:
        config = self._config()
        try:
            job = JobRequest.from_request(request, self.node_gpus(config))
        except ValueError as exc:
            return {"ok": False, "invalid": True, "error": str(exc)}
        with self._lock:
            snapshot = self.latest
        now = time.time()
        sample = self._sample_counters(snapshot, config, now)
        write_registration(config.roots, job, sample, now)
        checks = gate_checks(config.slurm, self.gate_inputs(config))
        reason = unfit_reason(checks)
        if reason is not None:
            # The job will not run here (Slurm requeues it): nothing to report on.
            remove_registration(config.roots, job.job_id)
        log.info(
            "event=prolog job=%s uid=%s gpus=%s fit=%s%s",
            job.job_id,
            job.uid,
            ",".join(str(g) for g in job.gpus),
            reason is None,
            f" reason={reason!r}" if reason else "",
        )
        return {
            "ok": True,
            "fit": reason is None,
            "reason": reason,
            "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in checks],
        }

    def _sample_counters(
        self, snapshot: Snapshot | None, config: Config, now: float
    ) -> dict[str, Any]:
        if snapshot is None:
            return local_sample(config.roots, now)
        return counter_sample(
            snapshot.data("nvml", NvmlData),
            snapshot.data("infiniband", InfinibandData),
            snapshot.data("disks", DisksData),
            now,
        )

    def epilog(self, request: Request, peer: Peer) -> Response:
        config = self._config()
        try:
            job = JobRequest.from_request(request, self.node_gpus(config))
            local_holders = _holders_of(request.get("gpu_holders"))
        except ValueError as exc:
            return {"ok": False, "invalid": True, "error": str(exc)}
        deadline = request.get("deadline")
        issued_at = request.get("issued_at")
        registration = read_registration(config.roots, job.job_id)
        now = time.time()
        with self._lock:
            snapshot = self.latest
            # Taken out: observe() must not change what the report is being built from.
            window = self.windows.pop(job.job_id, None)
            start = registration.get("registered_at") if registration else None
            if not isinstance(start, int | float):
                start = window.first_seen if window is not None else now
            gpus = set(job.gpus) or set(window.gpus if window is not None else ())
            nvml = snapshot.data("nvml", NvmlData) if snapshot is not None else None
            bdfs = {g.pci_address for g in nvml.gpus if g.index in gpus} if nvml else set()
            names = {str(g) for g in gpus}
            findings = [
                e.as_dict()
                for e in self._episodes(self._open, self._closed, start, now)
                if _relevant(e.subjects, job.job_id, names, bdfs)
            ]
            alerts = [
                e.as_dict()
                for e in self._episodes(self._alerts_open, self._alerts_closed, start, now)
                if _relevant(e.subjects, job.job_id, names, bdfs)
            ]
            contention = [
                e.as_dict()
                for e in self._episodes(self._open, self._closed, start, now)
                if e.kind in CONTENTION_KINDS
            ]
        holders = _merge_holders(local_holders, _nvml_holders(config.roots, nvml, gpus))
        sample = self._sample_counters(snapshot, config, now)
        report = build_report(
            job,
            registration,
            sample,
            now,
            daemon=True,
            window=window,
            findings=findings,
            alerts=alerts,
            contention=contention,
            holders=holders,
            issued_at=issued_at if isinstance(issued_at, int | float) else now,
        )
        path: Path | None = None
        problem = None
        try:
            path = write_report(
                Path(config.slurm.reports_dir),
                report,
                deadline if isinstance(deadline, int | float) else None,
            )
        except StaleReport as exc:
            # The hook has given up on us and done the epilog itself: change nothing.
            log.info("event=epilog_stale job=%s reason=%r", job.job_id, str(exc))
            return {"ok": False, "stale": True, "error": str(exc)}
        except OSError as exc:
            problem = f"report not written: {exc}"
            log.error("event=report_failed job=%s error=%r", job.job_id, str(exc))
        # The job has ended whether or not its report could be written: a registration left
        # behind would keep it in nodescope_job_info for good.
        remove_registration(config.roots, job.job_id)
        with self._lock:
            self.windows.pop(job.job_id, None)  # observe() may have seen the job meanwhile
        verdict = report["verdict"]
        log.info(
            "event=epilog job=%s report=%s ok=%s%s",
            job.job_id,
            path,
            verdict["ok"],
            f" reason={verdict['reason']!r}" if verdict["reason"] else "",
        )
        return {
            "ok": True,
            "report": None if path is None else str(path),
            "report_error": problem,
            "verdict": verdict,
            "gpu_holders": holders,
        }

    def clear_xids(self, request: Request, peer: Peer) -> Response:
        with self._lock:
            snapshot = self.latest
            nvml = snapshot.data("nvml", NvmlData) if snapshot is not None else None
            self._xid_cleared = _xid_counts(nvml) if nvml is not None else None
            self._carried_xids = ()
            self._recorded_xids = None
            self._record_xids(self.xid_inputs() or (), time.time())
        log.info("event=xids_cleared uid=%d pid=%d", peer.uid, peer.pid)
        return {"ok": True}


def _xid_counts(nvml: NvmlData) -> dict[str, int]:
    counts: dict[str, int] = {}
    for xid in nvml.xids:
        key = f"{xid.gpu if xid.gpu is not None else xid.pci_address}:{xid.xid}"
        counts[key] = counts.get(key, 0) + xid.count
    return counts


def _nvml_holders(roots: Roots, nvml: NvmlData | None, gpus: set[int]) -> list[dict[str, Any]]:
    """NVML compute processes on the job's GPUs that still exist."""
    if nvml is None:
        return []
    out = []
    for gpu in nvml.gpus:
        if gpu.index not in gpus:
            continue
        for process in gpu.processes:
            if (roots.procfs / str(process.pid)).exists():
                comm = read_optional(roots.procfs / str(process.pid) / "comm", PROC_PROCESS)
                out.append(
                    {
                        "pid": process.pid,
                        "gpu": gpu.index,
                        "comm": None if comm is None else comm.removesuffix("\n"),
                    }
                )
    return out


def _merge_holders(*groups: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    seen: dict[tuple[int, int], dict[str, Any]] = {}
    for group in groups:
        for holder in group:
            pid, gpu = holder.get("pid"), holder.get("gpu")
            if isinstance(pid, int) and isinstance(gpu, int):
                seen.setdefault((pid, gpu), dict(holder))
    return [seen[k] for k in sorted(seen)]


# ---------------------------------------------------------------------------------------------
# Wiring into the service


class Hooks:
    """The socket server and the tracker, as the service starts and feeds them."""

    def __init__(self, config: Callable[[], Config]) -> None:
        self.tracker = JobTracker(config)
        self._config = config
        self.server = HookServer(
            socket_path(config().roots),
            lambda peer: peer.uid in allowed_uids(self._config().slurm),
            lambda: self._config().slurm.timeout_seconds,
            grant_uid=lambda: slurm_uid(self._config().slurm.slurm_user),
        )
        self.server.register("prolog", self.tracker.prolog)
        self.server.register("epilog", self.tracker.epilog)
        self.server.register("clear_xids", self.tracker.clear_xids)
        self.probe = ProbeHook(config)
        self.server.register("probe", self.probe.start)
        self.server.register("probe_result", self.probe.result)

    @classmethod
    def start(cls, config: Callable[[], Config]) -> Hooks | None:
        """Start the socket; a daemon that cannot bind it still collects (and says why)."""
        hooks = cls(config)
        hooks.sweep()
        try:
            hooks.server.start()
        except OSError as exc:
            log.error("event=hooks_unavailable socket=%s error=%r", hooks.server.path, str(exc))
            return None
        log.info("event=hooks_listening socket=%s", hooks.server.path)
        return hooks

    def sweep(self) -> None:
        """Remove temporary files of writers that died (``kill -9``, power loss) and say
        now, not at the first epilog, when the reports directory is unsafe."""
        config = self._config()
        for directory in (
            registrations_dir(config.roots),
            run_dir(config.roots),
            Path(config.slurm.reports_dir),
        ):
            try:
                removed = remove_orphan_temporaries(directory)
            except OSError as exc:
                log.error("event=directory_unsafe path=%s error=%r", directory, str(exc))
                continue
            if removed:
                log.info("event=orphans_removed path=%s count=%d", directory, len(removed))

    def observe(self, snapshot: Snapshot) -> None:
        self.tracker.observe(snapshot)

    def stop(self) -> None:
        self.server.stop()
