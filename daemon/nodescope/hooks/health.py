"""The health gate: whether the node may take a job, and whether a job left it clean.

The prolog checks the GPU count, uncleared Xids, the GPUs' PCIe links and the required kernel
modules (:func:`gate_checks`), and the daemon's firing alerts under the remediation policy
(:func:`alert_check`); the daemon gives what it has seen, the hook reads what it can
itself when the daemon does not answer (:func:`local_gate_inputs`). The epilog looks for
processes still holding one of the job's GPUs (:func:`gpu_holders`, :func:`nvml_holders`).

Uncleared Xids are recorded in ``<run>/nodescope/gate-state.json`` whenever they change, so
that neither a daemon out of reach nor a restarted one (its NVML counts start from zero) lets a
node pass that failed the gate.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodescope.config import Config, SlurmSettings
from nodescope.fileio import PROC_PROCESS, FileKind
from nodescope.hooks.auth import prepare_directory
from nodescope.hooks.request import MAX_GPU_INDEX, is_int
from nodescope.hooks.transport import run_dir
from nodescope.model.job_records import NVIDIA_MAJOR
from nodescope.model.nvml import NvmlData
from nodescope.remediation.act import problems_from_checks
from nodescope.remediation.policy import REASON_PREFIX, Policy, Problem, drain_reason
from nodescope.roots import Roots
from nodescope.sources.base import read_optional
from nodescope_exporters.reports import write_private

# ---------------------------------------------------------------------------------------------
# The gate: pure checks, and the few reads the hook does itself


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


#: The most firing alerts one gate reason names; the rest are counted.
MAX_ALERTS_NAMED = 3


def draining(policy: Policy, problems: Sequence[Problem]) -> list[Problem]:
    """The problems whose kind and severity the policy drains for (``drain``,
    ``drain_requeue``)."""
    return [p for p in problems if policy.action(p.kind, p.severity).drains]


def alert_check(policy: Policy, problems: Sequence[Problem]) -> Check:
    """The daemon's firing alerts (as :class:`~nodescope.remediation.policy.Problem`) under
    the remediation policy: one whose kind and severity the policy drains for (``drain``,
    ``drain_requeue``) fails the gate, one it only alerts on (or ignores) does not. The gate
    and ``nodescope slurm health`` so agree on which findings keep jobs off the node. In a dry
    run the check passes and says what it would have failed on."""
    drains = draining(policy, problems)
    if not drains:
        return Check(
            "alerts", True, f"no firing alert the policy drains for ({len(problems)} firing)"
        )
    named = "; ".join(
        drain_reason(p).removeprefix(REASON_PREFIX).strip() for p in drains[:MAX_ALERTS_NAMED]
    )
    more = len(drains) - MAX_ALERTS_NAMED
    detail = f"firing {named}" + (f" (+{more} more)" if more > 0 else "")
    if policy.dry_run:
        return Check("alerts", True, f"dry run: the gate would fail: {detail}")
    return Check("alerts", False, detail)


#: The gate's checks that ``nodescope slurm health`` runs too, from what a hook reads itself
#: (:func:`local_gate_inputs`). A drain for these and for firing alerts is one health can see
#: clear, and so resume; link width needs NVML and the probe runs only at the gate.
WATCHED_CHECKS = frozenset({"gpus", "xid", "modules"})


def gate_causes(checks: Iterable[Check], alerts: Sequence[Problem]) -> list[Problem] | None:
    """What a gate that failed on ``checks`` drained the node for, as the problems ``nodescope
    slurm health`` will look for (the failed checks as ``gate_<name>``, the firing ``alerts``
    that failed it); ``None`` when one of them is a check health does not run, so that it
    never resumes a node it cannot see clear."""
    failed = [c for c in checks if not c.ok and c.name != "alerts"]
    if any(c.name not in WATCHED_CHECKS for c in failed):
        return None
    return [*problems_from_checks(failed), *alerts]


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


def missing_modules(roots: Roots, names: Sequence[str]) -> tuple[str, ...]:
    return tuple(n for n in names if not (roots.sysfs / "module" / n).is_dir())


def local_gate_inputs(config: Config) -> GateInputs:
    """What the hook checks itself when the daemon does not answer: the GPU device nodes,
    the kernel modules, and the uncleared Xids the daemon last recorded
    (:func:`read_gate_state`), so that a daemon out of reach never clears the gate."""
    roots = config.roots
    return GateInputs(
        gpu_count=count_dev_gpus(roots),
        gpu_count_source=f"{roots.dev}/nvidia devices",  # in a drain reason: no < >
        xids=read_gate_state(roots),
        links=None,
        missing_modules=missing_modules(roots, config.slurm.required_modules),
    )


# ---------------------------------------------------------------------------------------------
# Processes still holding a job's GPUs


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


def nvml_holders(roots: Roots, nvml: NvmlData | None, gpus: set[int]) -> list[dict[str, Any]]:
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


def merge_holders(*groups: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    seen: dict[tuple[int, int], dict[str, Any]] = {}
    for group in groups:
        for holder in group:
            pid, gpu = holder.get("pid"), holder.get("gpu")
            if isinstance(pid, int) and isinstance(gpu, int):
                seen.setdefault((pid, gpu), dict(holder))
    return [seen[k] for k in sorted(seen)]


# ---------------------------------------------------------------------------------------------
# The gate's memory: uncleared Xids outlive the daemon

GATE_STATE_NAME = "gate-state.json"
GATE_STATE_FORMAT = "nodescope-gate-state/1"


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
            if not (isinstance(gpu, str) and is_int(xid) and is_int(count)):
                raise ValueError("bad entry")
            out.append((gpu[:64], xid, count))
        return tuple(out)
    except (ValueError, KeyError, TypeError):
        return (("?", -1, 1),)
