"""Per-job reports: the counters a job moved, what was found while it ran, how it used memory.

A report is one JSON document (``format`` :data:`REPORT_FORMAT`) written by the epilog to
``<reports_dir>/<job id>.json``. This module builds its parts from source records (pure),
writes it atomically (a temporary file in the same directory, ``fsync``, ``rename``, ``fsync``
of the directory: a reader, or a daemon killed mid-write, sees the old report or the new one,
never a part), and renders it for people: text with a timeline drawn in block characters, and
an SVG drawn by hand (no plotting library).

The directory is checked first (owned by the writer, writable by nobody else, not a link)
and used through one descriptor; the temporary file has an unguessable name and is created
with ``O_EXCL|O_NOFOLLOW``, so nothing planted in advance is followed. Temporary files of
writers that died are removed when the daemon starts. A report is replaced only by one from a
later hook call (``issued_at``), under a lock of the directory that the daemon and the hooks
both take.

Counter deltas go through :func:`nodescope.model.counters.counter_delta`: a counter that went
backwards (a driver reload) gives no delta rather than a guess.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from nodescope.model.counters import counter_delta
from nodescope.model.disks import DisksData
from nodescope.model.infiniband import ERROR_COUNTERS, InfinibandData
from nodescope.model.nvml import NvmlData
from nodescope.safedir import UnsafeDirectory as UnsafeDirectory  # callers catch it from here
from nodescope.safedir import open_directory

REPORT_FORMAT = "nodescope-job-report/1"
SECTOR = 512
#: The most of an existing report read back to compare it with a new one.
MAX_REPORT_BYTES = 64 << 20

Document = dict[str, Any]


# ---------------------------------------------------------------------------------------------
# Atomic files in directories the daemon checks

#: Temporary files are ``.<final name>.<writer pid>.<random>.tmp``: the random part makes the
#: name unguessable (it is created with O_EXCL|O_NOFOLLOW besides), the pid lets a later
#: start tell a writer that died (kill -9, power loss) from one still writing.
TEMPORARY_SUFFIX = ".tmp"
#: A temporary file older than this is an orphan even when its pid is alive again (reused).
ORPHAN_SECONDS = 3600.0


class StaleReport(Exception):
    """The report on disk comes from a later hook call than this one, or the caller's
    deadline passed before the report could be put in place."""


def open_private_directory(directory: Path, create: bool = True) -> int:
    """A descriptor of ``directory``, reached from ``/`` without following a link another
    user made and through directories only root or this user can change, the directory
    itself this user's alone (:func:`nodescope.safedir.open_directory`). Every later step
    works relative to this descriptor, so that no component can be swapped for a link between
    the check and the write."""
    return open_directory(directory, create=create)


def _write_temporary(dir_fd: int, name: str, data: bytes, mode: int) -> str:
    # os.urandom, what secrets.token_hex reads, without the secrets module: it imports hmac and
    # hashlib, which loads OpenSSL's libcrypto (3.6 MiB of the daemon's resident memory).
    temporary = f".{name}.{os.getpid()}.{os.urandom(6).hex()}{TEMPORARY_SUFFIX}"
    # O_EXCL|O_NOFOLLOW: a name planted in advance (a symbolic link to a file of root's, say)
    # makes the open fail instead of being followed and truncated.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temporary, flags, mode, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=dir_fd)
        raise
    os.close(fd)
    return temporary


def _commit(dir_fd: int, temporary: str, name: str) -> None:
    try:
        os.replace(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=dir_fd)
        raise
    os.fsync(dir_fd)


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o640) -> None:
    """Replace ``path`` with ``data`` so that no reader ever sees a partial file. For files a
    user asks for (``nodescope report --svg``): the directory must exist (a mistyped path is
    an error, not a new tree of directories) and is not checked; the temporary file is still
    created exclusively and never through a link. Raises ``OSError``."""
    directory = path.parent
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _commit(dir_fd, _write_temporary(dir_fd, path.name, data, mode), path.name)
    finally:
        os.close(dir_fd)


def write_private(directory: Path, name: str, data: bytes, mode: int = 0o640) -> Path:
    """Replace ``directory/name`` with ``data`` atomically, in a directory checked with
    :func:`open_private_directory` (root's registrations and reports)."""
    dir_fd = open_private_directory(directory)
    try:
        _commit(dir_fd, _write_temporary(dir_fd, name, data, mode), name)
    finally:
        os.close(dir_fd)
    return directory / name


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_orphan_temporaries(directory: Path, now: float | None = None) -> list[str]:
    """Remove the temporary files of writers that died before renaming them. A file whose
    writer still runs is left alone unless it is older than :data:`ORPHAN_SECONDS`."""
    removed: list[str] = []
    now = time.time() if now is None else now
    try:
        dir_fd = open_private_directory(directory, create=False)
    except FileNotFoundError:
        return removed
    try:
        for name in os.listdir(dir_fd):
            if not (name.startswith(".") and name.endswith(TEMPORARY_SUFFIX)):
                continue
            parts = name[: -len(TEMPORARY_SUFFIX)].split(".")
            pid_text = parts[-2] if len(parts) >= 3 else ""
            try:
                info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            writer_gone = not (pid_text.isdigit() and _pid_alive(int(pid_text)))
            if writer_gone or now - info.st_mtime > ORPHAN_SECONDS:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=dir_fd)
                    removed.append(name)
    finally:
        os.close(dir_fd)
    return removed


def report_path(directory: Path, job_id: str) -> Path:
    if not job_id.isdigit() or not job_id.isascii():
        raise ValueError(f"not a job id: {job_id!r}")
    return directory / f"{job_id}.json"


def _order(document: Mapping[str, Any] | None) -> tuple[float, bool]:
    """Which of two reports of one job is the later: the hook call's ``issued_at``, then a
    daemon's report over the hook's own (the hook writes its own only once it has given the
    daemon up)."""
    if not isinstance(document, Mapping):
        return (-math.inf, False)
    issued = document.get("issued_at")
    if not isinstance(issued, int | float) or isinstance(issued, bool) or not math.isfinite(issued):
        issued = -math.inf
    return (float(issued), document.get("daemon") is True)


def write_report(directory: Path, document: Document, deadline: float | None = None) -> Path:
    """Write a job's report unless the one already there is from a later hook call
    (:class:`StaleReport`), or ``deadline`` (wall clock) passed: a client that gave up on
    the daemon writes its own report, and a daemon that resumes late must not replace it.

    The comparison and the rename happen under an exclusive lock of the directory, which the
    daemon and the hooks (separate processes) both take."""
    path = report_path(directory, str(document["job_id"]))
    text = json.dumps(document, indent=2, sort_keys=True, allow_nan=False) + "\n"
    dir_fd = open_private_directory(directory)
    try:
        temporary = _write_temporary(dir_fd, path.name, text.encode(), 0o640)
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX)
            existing = _read_existing(dir_fd, path.name)
            if _order(existing) > _order(document):
                raise StaleReport(f"{path}: a later hook call already wrote this job's report")
            if deadline is not None and time.time() >= deadline:
                raise StaleReport(f"{path}: the caller's deadline passed; report not written")
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=dir_fd)
            raise
        _commit(dir_fd, temporary, path.name)
    finally:
        os.close(dir_fd)  # releases the lock
    return path


def _read_existing(dir_fd: int, name: str) -> Any:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as handle:
            return json.loads(handle.read(MAX_REPORT_BYTES))
    except ValueError:
        return None


def read_report(directory: Path, job_id: str) -> Document:
    """The report of ``job_id``; ``ValueError`` when the file is not a report."""
    path = report_path(directory, job_id)
    document = json.loads(path.read_text())
    if not isinstance(document, dict) or document.get("format") != REPORT_FORMAT:
        raise ValueError(f"{path}: not a {REPORT_FORMAT} document")
    return document


# ---------------------------------------------------------------------------------------------
# Counters and deltas


def counter_sample(
    nvml: NvmlData | None,
    infiniband: InfinibandData | None,
    disks: DisksData | None,
    wall_time: float,
) -> Document:
    """The cumulative counters a report takes deltas of, as plain JSON.

    Per GPU (NVML index): PCIe bytes (with the width they wrap at), replays, NVLink data
    bytes and error counts summed over links; Xid counts per GPU and code; per InfiniBand port
    (``device/port``) bytes and the IBA error counters summed; per disk bytes read and written.
    """
    gpus: dict[str, dict[str, int | None]] = {}
    xids: dict[str, int] = {}
    if nvml is not None:
        for gpu in nvml.gpus:
            entry: dict[str, int | None] = {}
            if gpu.pcie_tx is not None:
                entry["pcie_tx_bytes"] = gpu.pcie_tx.value
                entry["pcie_tx_bits"] = gpu.pcie_tx.bits
            if gpu.pcie_rx is not None:
                entry["pcie_rx_bytes"] = gpu.pcie_rx.value
                entry["pcie_rx_bits"] = gpu.pcie_rx.bits
            if gpu.pcie_replays is not None:
                entry["pcie_replays"] = gpu.pcie_replays
            tx = [link.data_tx.value for link in gpu.nvlinks if link.data_tx is not None]
            rx = [link.data_rx.value for link in gpu.nvlinks if link.data_rx is not None]
            if tx:
                entry["nvlink_tx_bytes"] = sum(tx)
            if rx:
                entry["nvlink_rx_bytes"] = sum(rx)
            if gpu.nvlinks:
                entry["nvlink_errors"] = sum(v for link in gpu.nvlinks for _, v in link.errors)
            gpus[str(gpu.index)] = entry
        for xid in nvml.xids:
            key = f"{xid.gpu if xid.gpu is not None else xid.pci_address}:{xid.xid}"
            xids[key] = xids.get(key, 0) + xid.count
    ports: dict[str, dict[str, int]] = {}
    if infiniband is not None:
        for port in infiniband.ports():
            values: dict[str, int] = {}
            if port.xmit_bytes is not None:
                values["tx_bytes"] = port.xmit_bytes
            if port.rcv_bytes is not None:
                values["rx_bytes"] = port.rcv_bytes
            errors = [c.value for name in ERROR_COUNTERS if (c := port.counter(name)) is not None]
            if errors:
                values["errors"] = sum(errors)
            ports[f"{port.device}/{port.port}"] = values
    disk_counters: dict[str, dict[str, int]] = {}
    if disks is not None:
        for disk in disks.disks:
            disk_counters[disk.name] = {
                "read_bytes": disk.sectors_read * SECTOR,
                "written_bytes": disk.sectors_written * SECTOR,
            }
    return {
        "wall_time": wall_time,
        "gpus": gpus,
        "xids": xids,
        "infiniband": ports,
        "disks": disk_counters,
    }


def _deltas(
    before: Mapping[str, Any], after: Mapping[str, Any], keys: Iterable[str] | None = None
) -> dict[str, int]:
    out: dict[str, int] = {}
    for key, value in after.items():
        if key.endswith("_bits") or (keys is not None and key not in keys):
            continue
        prev = before.get(key)
        if not isinstance(value, int) or not isinstance(prev, int):
            continue
        bits = after.get(key.removesuffix("_bytes") + "_bits", 64)
        delta = counter_delta(prev, value, bits if isinstance(bits, int) else None)
        if delta is not None:
            out[key] = delta
    return out


def counter_deltas(
    baseline: Mapping[str, Any], end: Mapping[str, Any], gpus: Sequence[int] | None = None
) -> Document:
    """What moved between two :func:`counter_sample` documents. ``gpus`` limits the GPU
    figures to the job's (``None``: every GPU); ports and disks are node-wide."""
    wanted = None if gpus is None else {str(g) for g in gpus}
    gpu_deltas: dict[str, dict[str, int]] = {}
    for index, values in end.get("gpus", {}).items():
        if wanted is not None and index not in wanted:
            continue
        before = baseline.get("gpus", {}).get(index)
        if isinstance(before, Mapping) and isinstance(values, Mapping):
            gpu_deltas[index] = _deltas(before, values)
    xids: list[dict[str, Any]] = []
    before_xids = baseline.get("xids", {})
    for key, count in sorted(end.get("xids", {}).items()):
        gpu, _, code = key.rpartition(":")
        if wanted is not None and gpu not in wanted:
            continue
        moved = count - before_xids.get(key, 0)
        if moved > 0:
            xids.append({"gpu": gpu, "xid": int(code), "count": moved})
    ports = {
        name: _deltas(baseline.get("infiniband", {}).get(name, {}), values)
        for name, values in end.get("infiniband", {}).items()
        if name in baseline.get("infiniband", {})
    }
    disks = {
        name: _deltas(baseline.get("disks", {}).get(name, {}), values)
        for name, values in end.get("disks", {}).items()
        if name in baseline.get("disks", {})
    }
    seconds = None
    if isinstance(end.get("wall_time"), int | float) and isinstance(
        baseline.get("wall_time"), int | float
    ):
        seconds = end["wall_time"] - baseline["wall_time"]
    return {
        "seconds": seconds,
        "gpus": gpu_deltas,
        "xids": xids,
        "infiniband": ports,
        "disks": disks,
    }


# ---------------------------------------------------------------------------------------------
# Text


def _bytes(value: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def _number(value: Any) -> float | None:
    """A time or duration of a report as a number, ``None`` when it is not one (a report is
    a file anyone may hand to ``nodescope report``)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _clock(wall: float | None) -> str:
    if wall is None:
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall))


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


BLOCKS = " ▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float | None], width: int) -> str:
    """``values`` resampled to ``width`` columns (the maximum of each bucket) in block
    characters scaled to the largest value; gaps (``None``) stay blank."""
    if not values or width <= 0:
        return ""
    buckets: list[float | None] = []
    for column in range(width):
        lo = column * len(values) // width
        hi = max(lo + 1, (column + 1) * len(values) // width)
        present = [v for v in values[lo:hi] if v is not None]
        buckets.append(max(present) if present else None)
    top = max((b for b in buckets if b is not None), default=0.0)
    out = []
    for bucket in buckets:
        if bucket is None:
            out.append(" ")
        elif top <= 0:
            out.append(BLOCKS[1])
        else:
            out.append(BLOCKS[max(1, min(8, math.ceil(bucket / top * 8)))])
    return "".join(out)


def on_axis(
    times: Sequence[float], values: Sequence[float | None], t0: float, t1: float, width: int
) -> list[float | None]:
    """``values`` sampled at ``times`` placed on ``width`` columns of the axis t0..t1: the
    maximum of the samples in each column, the last value in columns between two samples,
    ``None`` before the first and after the last."""
    columns: list[float | None] = [None] * width
    if width <= 0 or t1 <= t0:
        return columns
    for t, v in zip(times, values, strict=False):
        if v is None or t < t0 or t > t1:
            continue
        column = min(width - 1, int((t - t0) / (t1 - t0) * width))
        current = columns[column]
        columns[column] = v if current is None else max(current, v)
    # Between two samples the value holds: fill the columns a sparse series leaves empty.
    filled = [i for i, v in enumerate(columns) if v is not None]
    for i in range(filled[0] + 1 if filled else width, filled[-1] if filled else 0):
        if columns[i] is None:
            columns[i] = columns[i - 1]
    return columns


def _span(start: float, end: float, t0: float, t1: float, width: int) -> str:
    """A bar ``━`` over the columns of [start, end] on a time axis t0..t1."""
    if t1 <= t0:
        return "━" * width
    first = int((max(start, t0) - t0) / (t1 - t0) * (width - 1))
    last = int((min(end, t1) - t0) / (t1 - t0) * (width - 1))
    return " " * first + "━" * max(1, last - first + 1) + " " * max(0, width - last - 1)


def render_text(document: Document, width: int = 60) -> str:
    """The report for a terminal: header, counter deltas, memory, findings, what nodescope
    did to the node during the job, contention and a timeline picture."""
    lines: list[str] = []
    job = document.get("job_id", "?")
    gpus = ",".join(str(g) for g in document.get("gpus", [])) or "none"
    lines.append(
        f"job {job}  user {document.get('user') or '?'}  partition"
        f" {document.get('partition') or '?'}  GPUs {gpus}"
        f" (from {document.get('gpu_source', '?')})"
    )
    start, end = document.get("start"), document.get("end")
    down = "" if document.get("daemon", True) else "  [daemon was down: local figures only]"
    gate = document.get("gate")
    if isinstance(gate, Mapping) and gate.get("stopped"):
        # The job never ran: "ran .." would claim a run, and its epilog's time is not an end.
        lines.append(
            f"not run: stopped by the prolog gate at {_clock(_number(gate.get('stopped_at')))}"
            f"  (epilog {_clock(_number(end))}){down}"
        )
        lines.append(f"gate: {gate.get('reason') or '?'}")
        for check in gate.get("checks") or []:
            if isinstance(check, Mapping) and check.get("ok") is False:
                lines.append(f"  failed check {check.get('name')}: {check.get('detail')}")
    else:
        lines.append(
            f"ran {_clock(_number(start))} .. {_clock(_number(end))}"
            f"  ({_duration(_number(document.get('duration_seconds')))})"
            f"  exit {document.get('exit_code') or '?'}{down}"
        )
    verdict = document.get("verdict") or {}
    lines.append(
        "verdict: ok" if verdict.get("ok", True) else f"verdict: FAILED: {verdict.get('reason')}"
    )
    deltas = document.get("deltas") or {}
    gpu_deltas = deltas.get("gpus", {})
    if gpu_deltas:
        lines.append("")
        lines.append(
            "GPU  PCIe tx      PCIe rx      replays  NVLink tx    NVLink rx    NVLink errors"
        )
        for index in sorted(gpu_deltas, key=lambda i: int(i) if i.isdigit() else 1 << 30):
            d = gpu_deltas[index]
            lines.append(
                f"{index:<4} {_bytes(d.get('pcie_tx_bytes', 0)):<12} "
                f"{_bytes(d.get('pcie_rx_bytes', 0)):<12} {d.get('pcie_replays', 0):<8} "
                f"{_bytes(d.get('nvlink_tx_bytes', 0)):<12} "
                f"{_bytes(d.get('nvlink_rx_bytes', 0)):<12} {d.get('nvlink_errors', 0)}"
            )
    for xid in deltas.get("xids", []):
        lines.append(f"Xid {xid['xid']} on GPU {xid['gpu']}: {xid['count']} time(s)")
    ports = deltas.get("infiniband", {})
    if ports:
        lines.append("")
        lines.append("InfiniBand (node-wide)  tx           rx           errors")
        for name in sorted(ports):
            d = ports[name]
            lines.append(
                f"{name:<24}{_bytes(d.get('tx_bytes', 0)):<13}{_bytes(d.get('rx_bytes', 0)):<13}"
                f"{d.get('errors', 0)}"
            )
    disks = {n: d for n, d in deltas.get("disks", {}).items() if any(d.values())}
    if disks:
        lines.append("")
        lines.append("disk (node-wide)        read         written")
        for name in sorted(disks):
            d = disks[name]
            lines.append(
                f"{name:<24}{_bytes(d.get('read_bytes', 0)):<13}{_bytes(d.get('written_bytes', 0))}"
            )
    memory = document.get("memory") or {}
    if memory:
        lines.append("")
        peak = memory.get("peak_bytes")
        limit = memory.get("limit_bytes")
        lines.append(
            f"memory: peak {_bytes(peak) if peak is not None else '?'}"
            f"  limit {_bytes(limit) if limit is not None else 'none'}"
            f"  OOM kills {memory.get('oom_kills', 0)}"
        )
    collectives = document.get("collectives")
    if isinstance(collectives, Mapping):
        lines.append("")
        lines.append(
            f"collectives (traces in the spool, {collectives.get('files', 0)} files,"
            f" ranks {len(collectives.get('ranks') or [])}):"
        )
        lines.append("  kind            skew δ  straggler  max wait")
        for k in collectives.get("kinds") or []:
            if not isinstance(k, Mapping):
                continue
            skew = _number(k.get("skew"))
            wait = _number(k.get("max_wait_seconds"))
            straggler = k.get("straggler")
            lines.append(
                f"  {str(k.get('kind'))[:15]:<15} {'-' if skew is None else f'{skew:.2f}':>6}"
                f"  {'-' if straggler is None else f'rank {straggler}':<9}"
                f"  {'-' if wait is None else f'{wait:.3g} s'}"
            )
    holders = document.get("gpu_holders", [])
    for holder in holders:
        lines.append(
            f"still holding GPU {holder.get('gpu')} after the job: pid {holder.get('pid')}"
            f" ({holder.get('comm') or '?'})"
        )
    findings = document.get("findings", [])
    if findings:
        lines.append("")
        lines.append("findings during the job:")
        for f in findings:
            lines.append(
                f"  {f.get('severity', '?'):<8} {f.get('kind')}  {_duration(f.get('seconds'))}:"
                f" {f.get('message', '')}"
            )
    actions = [a for a in document.get("actions") or [] if isinstance(a, Mapping)]
    if actions:
        lines.append("")
        lines.append("nodescope acted on the node during the job (the job went on):")
        for a in actions:
            subject = f" {a.get('subject')}" if a.get("subject") else ""
            by = f" ({a.get('source')})" if a.get("source") else ""
            lines.append(
                f"  {_clock(_number(a.get('time')))}  {a.get('action')}{by}:"
                f" {a.get('kind')}{subject}: {a.get('message') or ''}".rstrip()
            )
            if a.get("reason"):
                lines.append(f"    reason: {a.get('reason')}")
            if a.get("why"):
                lines.append(f"    held: {a.get('why')}")
            if a.get("ok") is False:
                lines.append(f"    failed: {a.get('error') or '?'}")
    episodes = document.get("contention", [])
    if episodes:
        lines.append("")
        lines.append("contention episodes:")
        for e in episodes:
            lines.append(
                f"  {_clock(e.get('start'))}  {_duration(e.get('seconds'))}  {e.get('key')}"
            )
    timeline = document.get("timeline") or {}
    times = timeline.get("t", [])
    if times and start is not None and end is not None:
        lines.append("")
        lines.append(f"timeline {_clock(start)} .. {_clock(end)}")
        for name, values in sorted(timeline.get("series", {}).items()):
            present = [v for v in values if v is not None]
            top = max(present) if present else 0.0
            label = name.replace("_", " ")
            scale = _bytes(top) + ("/s" if name.endswith("per_second") else "")
            placed = on_axis(times, values, start, end, width)
            lines.append(f"  {label[:22]:<22} |{sparkline(placed, width)}| max {scale}")
        for e in [*findings, *episodes]:
            first = e.get("first", e.get("start"))
            last = e.get("last", e.get("end"))
            if first is None or last is None:
                continue
            label = str(e.get("kind") or e.get("key"))
            lines.append(f"  {label[:22]:<22} |{_span(first, last, start, end, width)}|")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# SVG


_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#17becf")

#: A series' unit by the suffix of its name (the timeline's names end in their unit, as the
#: metrics' do); the name without the suffix is the panel's title.
_SERIES_UNITS = (("_bytes_per_second", "B/s"), ("_bytes", "B"), ("_seconds", "s"))

#: Steps of the time axis: seconds, minutes and hours a reader counts in.
_TIME_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600)


def series_unit(name: str) -> tuple[str, str]:
    """(title, unit) of a timeline series from its name: ``gpu_pcie_bytes_per_second`` is
    ``("gpu pcie", "B/s")``."""
    for suffix, unit in _SERIES_UNITS:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name.removesuffix(suffix).replace("_", " "), unit
    return name.replace("_", " "), ""


def time_ticks(span: float, most: int = 8) -> list[float]:
    """Seconds since the start at a round step (10 s, 5 min, 1 h...), at most ``most`` + 1."""
    step = next((s for s in _TIME_STEPS if span / s <= most), None)
    if step is None:
        step = math.ceil(span / most / 3600) * 3600
    return [i * float(step) for i in range(int(span // step) + 1)]


def tick_duration(seconds: float) -> str:
    """A time-axis step as people say it: ``30 s``, ``5 min``, ``1 h 30 min``."""
    whole = int(seconds)
    if whole < 60 or whole % 60:
        return _duration(seconds)
    minutes = whole // 60
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


def render_svg(document: Document, width: int = 900) -> str:
    """The timeline as an SVG document: one panel per series (a polyline on a value axis
    with round ticks in the series' unit) and one bar per finding or contention episode,
    over the job's time axis (ticks in time since the start, the clock at both ends)."""
    # Imported here: only ``nodescope report --svg`` renders, while the daemon imports this
    # module to write reports; html loads its table of entities (0.5 MiB) on import.
    import html

    from nodescope.svgaxis import nice_ticks, scale, si, value_axis

    start = float(document.get("start") or 0.0)
    end = float(document.get("end") or start)
    span = max(end - start, 1e-9)
    timeline = document.get("timeline") or {}
    times = [float(t) for t in timeline.get("t", [])]
    series = sorted(timeline.get("series", {}).items())
    bars = [
        (
            str(e.get("kind") or e.get("key")),
            e.get("first", e.get("start")),
            e.get("last", e.get("end")),
            e.get("severity"),
        )
        for e in [*document.get("findings", []), *document.get("contention", [])]
    ]
    left, right, panel, gap, bar = 210, 20, 80, 18, 16
    plot = width - left - right
    height = 60 + len(series) * (panel + gap) + len(bars) * (bar + 6) + 56

    def x(t: float) -> float:
        return left + (min(max(t, start), end) - start) / span * plot

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}"'
        f' viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="10" y="22" font-size="15" font-weight="bold">'
        f"job {html.escape(str(document.get('job_id')))}"
        f" — {html.escape(_clock(start))} .. {html.escape(_clock(end))}"
        f" ({html.escape(_duration(document.get('duration_seconds')))})</text>",
    ]
    y = 45
    for number, (name, raw) in enumerate(series):
        # A report is a file anyone may hand over: what is not a finite number is a gap.
        values = [_number(v) for v in raw] if isinstance(raw, list) else []
        present = [v for v in values if v is not None]
        top = max(present) if present else 0.0
        title, unit = series_unit(name)
        ticks = nice_ticks(top, 3)
        colour = _COLOURS[number % len(_COLOURS)]
        out.append(
            f'<rect x="{left}" y="{y}" width="{plot}" height="{panel}" fill="#f7f7f7"'
            ' stroke="#ccc"/>'
        )
        out.extend(value_axis(ticks, unit, left, y, plot, panel))
        out.append(
            f'<text x="10" y="{y + 16}">{html.escape(title)}'
            f"{html.escape(f' ({unit})' if unit else '')}</text>"
            f'<text x="10" y="{y + 32}" fill="#666">max {html.escape(si(top, unit))}</text>'
        )
        points = []
        for t, v in zip(times, values, strict=False):
            if v is None:
                continue
            points.append(f"{x(t):.1f},{y + panel - scale(v, ticks, panel):.1f}")
        if points:
            out.append(
                f'<polyline fill="none" stroke="{colour}" stroke-width="1.5"'
                f' points="{" ".join(points)}"/>'
            )
        y += panel + gap
    for label, first, last, severity in bars:
        if first is None or last is None:
            continue
        colour = {"critical": "#d62728", "warning": "#ff7f0e"}.get(str(severity), "#7f7f7f")
        x0, x1 = x(float(first)), x(float(last))
        out.append(f'<text x="10" y="{y + 12}">{html.escape(label[:28])}</text>')
        out.append(
            f'<rect x="{x0:.1f}" y="{y}" width="{max(2.0, x1 - x0):.1f}" height="{bar}"'
            f' fill="{colour}"/>'
        )
        y += bar + 6
    out.append(f'<line x1="{left}" y1="{y + 4}" x2="{left + plot}" y2="{y + 4}" stroke="#333"/>')
    for tick in time_ticks(span):
        at = x(start + tick)
        # A label at the right edge ends there rather than running off the picture.
        anchor = "end" if at > left + plot - 30 else "middle"
        out.append(
            f'<line x1="{at:.1f}" y1="{y + 4}" x2="{at:.1f}" y2="{y + 9}" stroke="#333"/>'
            f'<text class="tick" x="{at:.1f}" y="{y + 21}" text-anchor="{anchor}"'
            f' font-size="10">+{html.escape(tick_duration(tick))}</text>'
        )
    out.append(
        f'<text x="{left}" y="{y + 38}">{html.escape(_clock(start))}</text>'
        f'<text x="{left + plot}" y="{y + 38}" text-anchor="end">'
        f"{html.escape(_clock(end))}</text>"
        f'<text x="10" y="{y + 21}" fill="#666">time since start</text>'
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"
