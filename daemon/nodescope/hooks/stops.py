"""The record of a job the prolog gate stopped, kept until that job's epilog.

A job the gate stops never runs here, yet Slurm still runs its epilog (and the job's report is
written then). The prolog removes the job's registration, so the epilog would otherwise know
nothing of the job but its id: the report would read as an empty run that went well. The
prolog therefore writes ``<run>/nodescope/gate-stops/<job id>.json`` — when the gate stopped
the job, its reason and its checks — and the epilog, the daemon's or the hook's own, reads it
into the report and removes it. A file rather than the daemon's memory, since either side may
be the one that answers each hook.

When the gate drains the node for what ``nodescope slurm health`` watches too (its firing
alerts, the checks health runs), the hook also records the drain in the remediation record
(:func:`record_gate_drain`), so that health resumes the node once those have cleared.

The directory is root's (checked like the registrations'); a record is parsed as hostile
input all the same: bounded in size, every field typed and cut to length. A record that exists
but cannot be read still says that the gate stopped the job, with its reason unknown.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodescope.fileio import FileKind
from nodescope.hooks.auth import prepare_directory
from nodescope.hooks.health import Check
from nodescope.hooks.transport import run_dir
from nodescope.model.finding import Severity
from nodescope.remediation.policy import Memory, Problem, StepKind
from nodescope.remediation.state import Entry, locked, read_record, write_record
from nodescope.roots import Roots
from nodescope.sources.base import read_optional
from nodescope_exporters.reports import open_private_directory, write_private

GATE_STOP_FORMAT = "nodescope-gate-stop/1"
#: A record is a few hundred bytes: 64 KiB or more is not one.
GATE_STOP_FILE = FileKind("gate-stop record", 64 * 1024 - 1)
#: Slurm keeps a drain reason of about this length; the gate's reason is cut to it.
MAX_REASON = 200
MAX_CHECKS = 32
MAX_DETAIL = 400
#: A record whose epilog never came (the node was rebooted mid-job, say) is removed after this
#: long when the daemon starts.
STALE_SECONDS = 7 * 24 * 3600.0


@dataclass(frozen=True, slots=True)
class GateStop:
    """When (wall clock; ``None``: unknown) and why the prolog gate stopped a job."""

    job_id: str
    stopped_at: float | None
    reason: str
    checks: tuple[Check, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "stopped": True,
            "stopped_at": self.stopped_at,
            "reason": self.reason,
            "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks],
        }


def problem_json(problem: Problem) -> dict[str, Any]:
    """A problem as the daemon's prolog answer carries it to the hook."""
    return {
        "kind": problem.kind,
        "severity": problem.severity.label,
        "subject": problem.subject,
        "message": problem.message,
        "source": problem.source,
        "key": problem.identity,
    }


_SEVERITIES = {s.label: s for s in Severity}


def problems_of(value: Any) -> list[Problem] | None:
    """The problems of a prolog answer (:func:`problem_json`), bounded; ``None`` when the
    answer has none or anything in it is not one (then nothing is recorded)."""
    if not isinstance(value, list) or not 0 < len(value) <= MAX_CHECKS:
        return None
    out = []
    for item in value:
        if not isinstance(item, Mapping):
            return None
        fields = [item.get(k) for k in ("kind", "severity", "subject", "message", "source", "key")]
        if not all(isinstance(f, str) for f in fields) or fields[1] not in _SEVERITIES:
            return None
        kind, severity, subject, message, source, key = (str(f) for f in fields)
        out.append(
            Problem(
                _line(kind, 64),
                _SEVERITIES[severity],
                _line(subject, MAX_DETAIL),
                _line(message, MAX_DETAIL),
                _line(source, 16),
                _line(key, MAX_DETAIL),
            )
        )
    return out


def record_gate_drain(
    roots: Roots, node: str, reason: str, causes: Sequence[Problem], now: float, timeout: float
) -> None:
    """Record that the gate drained ``node`` with ``reason`` for ``causes``, as a remediation
    pass records its drains: the action once per cause (source ``prolog``), and the node as
    nodescope's, drained for those causes, so that ``nodescope slurm health`` resumes it once
    they have cleared (and the partition guard and cool-down count it). Raises ``OSError``
    (:class:`~nodescope.remediation.state.RecordBusy` when another writer holds the record
    past ``timeout``)."""
    identities = tuple(dict.fromkeys(p.identity for p in causes))
    memory = Memory(
        drained_reason=reason,
        causes=identities,
        last_change=now,
        last_steps=dict.fromkeys(identities, StepKind.DRAIN.value),
    )
    entries = [
        Entry(now, node, StepKind.DRAIN.value, p.kind, p.subject, p.message, reason,
              source="prolog")
        for p in causes
    ]  # fmt: skip
    with locked(roots, timeout):
        record = read_record(roots)
        write_record(roots, record.with_actions(node, memory, entries), now)


def gate_stops_dir(roots: Roots) -> Path:
    return run_dir(roots) / "gate-stops"


def _line(text: str, longest: int) -> str:
    """One printable line of at most ``longest`` characters (a reason lands in Slurm)."""
    return "".join(c if c.isprintable() else " " for c in text)[:longest]


def checks_of(value: Any) -> tuple[Check, ...]:
    """The gate's checks as a hook response or a record carries them, bounded and typed;
    entries that are not checks are left out."""
    if not isinstance(value, list):
        return ()
    out = []
    for entry in value[:MAX_CHECKS]:
        if not isinstance(entry, Mapping):
            continue
        name, ok, detail = entry.get("name"), entry.get("ok"), entry.get("detail")
        if isinstance(name, str) and isinstance(ok, bool) and isinstance(detail, str):
            out.append(Check(_line(name, 64), ok, _line(detail, MAX_DETAIL)))
    return tuple(out)


def write_gate_stop(roots: Roots, stop: GateStop) -> Path:
    document = {
        "format": GATE_STOP_FORMAT,
        "job_id": stop.job_id,
        "stopped_at": stop.stopped_at,
        "reason": _line(stop.reason, MAX_REASON),
        "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in stop.checks],
    }
    prepare_directory(run_dir(roots))
    return write_private(
        gate_stops_dir(roots),
        f"{stop.job_id}.json",
        (json.dumps(document, allow_nan=False) + "\n").encode(),
        0o640,
    )


def parse_gate_stop(job_id: str, text: str | None) -> GateStop:
    """The record's content; one that is not a record still says the gate stopped the job."""
    unreadable = GateStop(
        job_id, None, "nodescope: prolog gate stopped the job (record unreadable)"
    )
    try:
        document = json.loads(text or "")
    except ValueError:
        return unreadable
    if not isinstance(document, dict) or document.get("format") != GATE_STOP_FORMAT:
        return unreadable
    reason = document.get("reason")
    at = document.get("stopped_at")
    if not isinstance(reason, str) or document.get("job_id") != job_id:
        return unreadable
    stopped_at = None
    if isinstance(at, int | float) and not isinstance(at, bool) and math.isfinite(at):
        stopped_at = float(at)
    # A record with an empty reason still stands for a stop: the report must say one.
    text_reason = _line(reason, MAX_REASON) or "nodescope: prolog gate stopped the job (no reason)"
    return GateStop(job_id, stopped_at, text_reason, checks_of(document.get("checks")))


def read_gate_stop(roots: Roots, job_id: str) -> GateStop | None:
    """The record of ``job_id``, or ``None`` when the gate did not stop it."""
    path = gate_stops_dir(roots) / f"{job_id}.json"
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError:
        return parse_gate_stop(job_id, None)
    # lstat: a link in its place is not followed; the file layer refuses the rest.
    text = None if stat.S_ISLNK(info.st_mode) else read_optional(path, GATE_STOP_FILE)
    return parse_gate_stop(job_id, text)


def remove_gate_stop(roots: Roots, job_id: str) -> None:
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        os.unlink(gate_stops_dir(roots) / f"{job_id}.json")


def remove_stale_gate_stops(roots: Roots, now: float | None = None) -> list[str]:
    """Remove records older than :data:`STALE_SECONDS` (their epilog never came), so that
    the directory stays bounded. A directory others could change is refused (``OSError``)."""
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        dir_fd = open_private_directory(gate_stops_dir(roots), create=False)
    except FileNotFoundError:
        return removed
    try:
        names: Iterable[str] = os.listdir(dir_fd)
        for name in names:
            if not name.endswith(".json"):
                continue
            with contextlib.suppress(FileNotFoundError):
                info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if now - info.st_mtime > STALE_SECONDS:
                    os.unlink(name, dir_fd=dir_fd)
                    removed.append(name)
    finally:
        os.close(dir_fd)
    return removed
