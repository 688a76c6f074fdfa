"""The record of what nodescope did to the node: ``<run>/nodescope/remediation.json``.

One JSON document, replaced atomically (a temporary file renamed over it) under an exclusive
``flock`` of ``remediation.lock`` beside it, so that the health check, the prolog and the
daemon never lose each other's entries. It holds

``nodes``
    per Slurm node name (at most :data:`MAX_NODES`), the :class:`~.policy.Memory` the policy
    needs: the drain reason nodescope set and stands by, the problems it drained for, when it
    last drained or resumed the node, and the step it took last per problem;
``entries``
    the latest :data:`MAX_ENTRIES` actions, oldest first, each once: time, node, action,
    finding kind, subject, key and message, the drain reason, why it was held, the jobs
    requeued, who acted (``source``: health, prolog, daemon), whether scontrol did it (``ok``)
    and its error;
``counts``
    the number of actions per (action, kind) since the record was created, at most
    :data:`MAX_COUNTS` pairs: the daemon's ``nodescope_remediation_actions_total`` counter,
    which must not go down when old entries leave the list.

A record that cannot be read is treated as empty, which is safe: nodescope then resumes no
node (it only resumes drains it recorded) and its counts start again (a counter reset, which
Prometheus handles). Reading never fails the caller.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import stat
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from nodescope.fileio import FileKind, read_bytes
from nodescope.model.job_records import RUN_SUBDIR
from nodescope.remediation.policy import Memory, Step
from nodescope.roots import Roots
from nodescope.safedir import ensure_directory as prepare_directory

STATE_NAME = "remediation.json"
LOCK_NAME = "remediation.lock"
#: Held by ``nodescope slurm health`` for its whole run: slurmd starts the next run on its
#: interval whether or not the last has ended, and runs that stack up on a loaded node (each a
#: Python start, a daemon call and scontrol calls) only load it more.
HEALTH_LOCK_NAME = "health.lock"
STATE_FORMAT = "nodescope-remediation/1"
MAX_ENTRIES = 200
MAX_NODES = 16
MAX_COUNTS = 512
#: Each text field of an entry is cut to this many characters.
MAX_FIELD = 400
#: 200 entries of at most ~3 KB each, with the counts and nodes: well under 1 MiB.
STATE_FILE = FileKind("remediation record", (1 << 20) - 1)


def state_path(roots: Roots) -> Path:
    return roots.run / RUN_SUBDIR / STATE_NAME


@dataclass(frozen=True, slots=True)
class Entry:
    """One action as the record keeps it."""

    time: float
    node: str
    action: str
    kind: str
    subject: str = ""
    message: str = ""
    reason: str = ""
    why: str = ""
    jobs: tuple[str, ...] = ()
    source: str = "health"
    ok: bool = True
    error: str = ""
    #: the identity of the problem acted on: an alert's key, so the daemon can name the
    #: action beside its alert
    key: str = ""

    @classmethod
    def of(cls, step: Step, node: str, now: float, source: str, error: str = "") -> Entry:
        return cls(
            time=now,
            node=node,
            action=step.action.value,
            kind=step.kind,
            subject=step.subject,
            message=step.message,
            reason=step.reason,
            why=step.why,
            jobs=step.jobs,
            source=source,
            ok=not error,
            error=error,
            key=step.key,
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "node": self.node,
            "action": self.action,
            "kind": self.kind,
            "subject": self.subject,
            "message": self.message,
            "reason": self.reason,
            "why": self.why,
            "jobs": list(self.jobs),
            "source": self.source,
            "ok": self.ok,
            "error": self.error,
            "key": self.key,
        }


@dataclass(frozen=True, slots=True)
class Record:
    """The whole record; ``problem`` says why a record on disk was not read (then empty)."""

    nodes: Mapping[str, Memory] = field(default_factory=dict)
    entries: tuple[Entry, ...] = ()
    counts: Mapping[tuple[str, str], int] = field(default_factory=dict)
    problem: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", MappingProxyType(dict(self.nodes)))
        object.__setattr__(self, "counts", MappingProxyType(dict(self.counts)))

    def memory(self, node: str) -> Memory:
        return self.nodes.get(node, Memory())

    def with_actions(self, node: str, memory: Memory, entries: Sequence[Entry]) -> Record:
        """The record after ``entries`` were taken on ``node``, which now stands at
        ``memory``."""
        nodes = {k: v for k, v in self.nodes.items() if k != node}
        nodes[node] = memory
        # The nodes changed longest ago go first when there are too many.
        kept = sorted(nodes.items(), key=lambda kv: -(kv[1].last_change or 0.0))[:MAX_NODES]
        counts = dict(self.counts)
        for entry in entries:
            pair = (entry.action, entry.kind)
            if pair in counts or len(counts) < MAX_COUNTS:
                counts[pair] = counts.get(pair, 0) + 1
        return Record(
            nodes=dict(kept),
            entries=(*self.entries, *entries)[-MAX_ENTRIES:],
            counts=counts,
        )

    def as_json(self, now: float) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "written_at": now,
            "nodes": {
                name: {
                    "drained_reason": m.drained_reason,
                    "causes": list(m.causes),
                    "last_change": m.last_change,
                    "last_steps": dict(m.last_steps),
                }
                for name, m in self.nodes.items()
            },
            "entries": [e.as_json() for e in self.entries],
            "counts": [
                {"action": action, "kind": kind, "count": n}
                for (action, kind), n in sorted(self.counts.items())
            ],
        }


# ---------------------------------------------------------------------------------------------
# Reading: every field checked, the file bounded


def _text(value: object, limit: int = MAX_FIELD) -> str:
    if not isinstance(value, str):
        raise ValueError("not a string")
    return value[:limit]


def _number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("not a number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError("not finite")
    return number


def _memory(document: object) -> Memory:
    if not isinstance(document, dict):
        raise ValueError("not a node")
    reason = document.get("drained_reason")
    causes = document.get("causes", [])
    last = document.get("last_change")
    steps = document.get("last_steps", {})
    if not isinstance(causes, list) or not isinstance(steps, dict):
        raise ValueError("bad node")
    return Memory(
        drained_reason=None if reason is None else _text(reason),
        causes=tuple(_text(c) for c in causes[:MAX_ENTRIES]),
        last_change=None if last is None else _number(last),
        last_steps={_text(k): _text(v, 32) for k, v in list(steps.items())[:MAX_ENTRIES]},
    )


def _entry(document: object) -> Entry:
    if not isinstance(document, dict):
        raise ValueError("not an entry")
    jobs = document.get("jobs", [])
    if not isinstance(jobs, list):
        raise ValueError("bad jobs")
    ok = document.get("ok", True)
    return Entry(
        time=_number(document["time"]),
        node=_text(document["node"], 128),
        action=_text(document["action"], 32),
        kind=_text(document["kind"], 64),
        subject=_text(document.get("subject", "")),
        message=_text(document.get("message", "")),
        reason=_text(document.get("reason", "")),
        why=_text(document.get("why", "")),
        jobs=tuple(_text(j, 32) for j in jobs[:64]),
        source=_text(document.get("source", "health"), 32),
        ok=ok if isinstance(ok, bool) else False,
        error=_text(document.get("error", "")),
        key=_text(document.get("key", "")),
    )


def parse_record(text: str) -> Record:
    """A record from its JSON text; :class:`ValueError` when it is not one."""
    try:
        document = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(document, dict) or document.get("format") != STATE_FORMAT:
        raise ValueError("not a remediation record")
    try:
        nodes, entries, counts = document["nodes"], document["entries"], document["counts"]
        if not (isinstance(nodes, dict) and isinstance(entries, list) and isinstance(counts, list)):
            raise ValueError("bad layout")
        parsed_counts: dict[tuple[str, str], int] = {}
        for item in counts[:MAX_COUNTS]:
            n = item["count"]
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError("bad count")
            parsed_counts[(_text(item["action"], 32), _text(item["kind"], 64))] = n
        return Record(
            nodes={_text(k, 128): _memory(v) for k, v in list(nodes.items())[:MAX_NODES]},
            entries=tuple(_entry(e) for e in entries[-MAX_ENTRIES:]),
            counts=parsed_counts,
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"bad record: {exc!r}") from None


def read_record(roots: Roots) -> Record:
    """The record on disk; an empty one (with ``problem`` set) when it cannot be read, and
    with no problem when there is none yet."""
    path = state_path(roots)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return Record()
    except OSError as exc:
        return Record(problem=f"{path}: {exc.strerror or exc}")
    if stat.S_ISLNK(info.st_mode):
        return Record(problem=f"{path}: a symbolic link; refused")
    try:
        text = read_bytes(path, STATE_FILE).decode("utf-8")
        return parse_record(text)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return Record(problem=f"{path}: {exc}")


# ---------------------------------------------------------------------------------------------
# Writing: locked, atomic


class RecordBusy(OSError):
    """Another writer held the lock past the deadline."""


@contextlib.contextmanager
def locked(roots: Roots, timeout: float, name: str = LOCK_NAME) -> Iterator[None]:
    """Hold the record's lock (or the lock file ``name`` beside it); :class:`RecordBusy` when
    it is not free within ``timeout`` seconds (a hook has a deadline: it never waits on
    another writer past it). A ``timeout`` of 0 tries once."""
    directory = roots.run / RUN_SUBDIR
    prepare_directory(directory)
    fd = os.open(directory / name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    raise RecordBusy(errno.EAGAIN, f"{directory / name}: busy") from None
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)


def write_record(roots: Roots, record: Record, now: float) -> None:
    """Replace the record atomically (0640, root's directory); call under :func:`locked`."""
    directory = roots.run / RUN_SUBDIR
    prepare_directory(directory)
    data = (json.dumps(record.as_json(now), sort_keys=True) + "\n").encode()
    fd, temporary = tempfile.mkstemp(prefix=f".{STATE_NAME}.", dir=directory)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, 0o640)
        os.replace(temporary, directory / STATE_NAME)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
