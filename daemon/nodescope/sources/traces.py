"""The ``traces`` source: PyTorch traces that jobs drop in a spool directory, analysed off
the cycle thread into per-job collective figures (δ, straggler rank, longest wait).

Layout (``docs/collectives.md`` "Daemon"): ``<spool_dir>/<job id>/<file>``, one file per rank
(Kineto JSON, gzip or not, flight recorder dumps). The spool is mode 1733 and owned by root, so
any user may make a directory in it and nobody may list it or remove another's; the job (or
the prolog, as the job's user) makes ``<job id>/``.

Everything in the spool is hostile: any local user can write there. So

* only jobs on the node count, with the uid the job registry gives them (the ``jobs`` source's
  record, handed over through :class:`nodescope.sources.registry.LatestJobs`); the spool is
  never listed, each job's directory is looked up by its id;
* a job directory counts when it is a real directory (``lstat``: no symbolic link) owned by
  that uid; it is opened ``O_NOFOLLOW|O_DIRECTORY`` and its files opened relative to it, so a
  directory swapped for a link after the check is not followed;
* a file counts when it is a regular file owned by that uid and under the size cap; it is
  opened ``O_NOFOLLOW|O_NONBLOCK`` (a FIFO put in its place cannot block the read) and checked
  again with ``fstat`` (type, owner, inode, size) before a byte is read;
* files and jobs per scan are bounded, and every skip is counted by reason (the collector turns
  them into ``nodescope_source_records_skipped_total{source="traces",reason}``).

The scan in the cycle only ``lstat``\\ s. Reading and analysing happen off the cycle: one
worker thread that the source object owns, fed through a bounded queue with the jobs whose
files are new or changed (path, size, mtime, inode), hands each job's directory and file list
to a parser process of its own (``python -m nodescope.sources.traces``, :func:`parse_job`).
That process reads, decodes and analyses the files within the job's object and record budget
and its own ``RLIMIT_AS``/``RLIMIT_CPU``, and answers with the job's figures only: the daemon
never holds a file's bytes or records. A file that makes the parser raise is counted as
failed until it changes; a file over the budget, or one the parser process died on, is
recorded under the run root (:mod:`nodescope.sources.trace_refusals`) and never parsed again,
across restarts. A job that left the node loses its results.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import math
import os
import queue
import re
import resource
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nodescope.model.collectives import (
    KINDS,
    TRACES,
    JobCollectives,
    KindFigures,
    SpoolSettings,
    TracesData,
)
from nodescope.model.job_records import RUN_SUBDIR, JobsData
from nodescope.model.jobs import build_registry
from nodescope.model.skips import SkipTally
from nodescope.roots import Roots
from nodescope.sources import trace_refusals
from nodescope.sources.spec import SourceSpec

if TYPE_CHECKING:
    from nodescope.collectives import Analysis

log = logging.getLogger("nodescope.sources.traces")

NAME = TRACES.name

#: Skip reasons: constants, so the label set stays bounded whatever the spool holds.
DIR_MISSING = "job_dir_missing"
DIR_NOT_DIRECTORY = "job_dir_not_directory"
DIR_WRONG_OWNER = "job_dir_wrong_owner"
DIR_UNREADABLE = "job_dir_unreadable"
BAD_JOB_ID = "job_id_unsafe"
TOO_MANY_JOBS = "too_many_jobs"
SYMLINK = "symlink"
NOT_REGULAR = "not_regular_file"
WRONG_OWNER = "wrong_owner"
TOO_LARGE = "too_large"
TOO_MANY_FILES = "too_many_files"
CHANGED = "changed_while_read"
UNREADABLE = "unreadable"
ANALYSIS_ERROR = "analysis_error"
QUEUE_FULL = "queue_full"

#: A job id as the registry gives it, safe as one path component (Slurm ids are digits,
#: array and het jobs add ``_`` and ``+``; a SLUID is letters and digits).
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_+.-]{0,63}")

#: Directory entries looked at per job beyond its file cap: hidden files and skipped ones
#: cost a look each, and a directory of a million entries must not cost a million.
EXTRA_ENTRIES = 64

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class FileEntry:
    """A file of a job directory as ``lstat`` saw it: what tells a changed file from the
    one analysed before."""

    name: str
    size: int
    mtime_ns: int
    inode: int


@dataclass(frozen=True, slots=True)
class JobFiles:
    """One job's directory as a scan found it: the uid its files must have, the directory's
    inode (a directory replaced after the scan is not read) and its accepted files."""

    job_id: str
    uid: int
    directory: str
    dir_inode: int
    files: tuple[FileEntry, ...]


def owners_of(data: JobsData | None) -> dict[str, int]:
    """Job id -> uid of every job on the node whose uid the registry knows."""
    return {job.job_id: job.uid for job in build_registry(data, ()) if job.uid is not None}


def scan_job(
    spool: Path, job_id: str, uid: int, settings: SpoolSettings, tally: SkipTally
) -> JobFiles | None:
    """The accepted files of one job's directory, or None when the directory does not count.
    Only ``lstat``: nothing is opened but the directory, with ``O_NOFOLLOW``."""
    if not _JOB_ID.fullmatch(job_id):
        tally.skip(BAD_JOB_ID, job_id)
        return None
    path = spool / job_id
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None  # the job drops no traces: nothing to count
    except OSError as exc:
        tally.skip(DIR_UNREADABLE, f"{path}: {exc.strerror}")
        return None
    if not stat.S_ISDIR(st.st_mode):
        tally.skip(DIR_NOT_DIRECTORY, str(path))
        return None
    if st.st_uid != uid:
        tally.skip(DIR_WRONG_OWNER, f"{path}: uid {st.st_uid}, job's {uid}")
        return None
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        tally.skip(DIR_UNREADABLE, f"{path}: {exc.strerror}")
        return None
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino) or opened.st_uid != uid:
            tally.skip(CHANGED, str(path))
            return None
        files = _scan_files(fd, path, uid, settings, tally)
    except OSError as exc:
        tally.skip(DIR_UNREADABLE, f"{path}: {exc.strerror}")
        return None
    finally:
        os.close(fd)
    return JobFiles(job_id, uid, str(path), st.st_ino, files)


def _scan_files(
    fd: int, path: Path, uid: int, settings: SpoolSettings, tally: SkipTally
) -> tuple[FileEntry, ...]:
    found: list[FileEntry] = []
    looked = 0
    budget = settings.max_files_per_job + EXTRA_ENTRIES
    with os.scandir(fd) as entries:
        for entry in entries:
            looked += 1
            if looked > budget:
                tally.skip(TOO_MANY_FILES, f"{path}: more than {budget} entries")
                break
            # A name starting with a dot is a file being written (write, then rename): it is
            # read once it has its final name.
            if entry.name.startswith("."):
                continue
            st = entry.stat(follow_symlinks=False)
            where = f"{path}/{entry.name}"
            if stat.S_ISLNK(st.st_mode):
                tally.skip(SYMLINK, where)
            elif not stat.S_ISREG(st.st_mode):
                tally.skip(NOT_REGULAR, where)
            elif st.st_uid != uid:
                tally.skip(WRONG_OWNER, f"{where}: uid {st.st_uid}, job's {uid}")
            elif st.st_size > settings.max_file_bytes:
                tally.skip(TOO_LARGE, f"{where}: {st.st_size} bytes")
            else:
                found.append(FileEntry(entry.name, st.st_size, st.st_mtime_ns, st.st_ino))
    found.sort(key=lambda f: f.name)
    if len(found) > settings.max_files_per_job:
        tally.skip(TOO_MANY_FILES, f"{path}: {len(found)} files")
        found = found[: settings.max_files_per_job]
    return tuple(found)


class Unreadable(Exception):
    """A file that the checks after opening refused; ``reason`` is a skip reason."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def read_checked(dir_fd: int, entry: FileEntry, uid: int, cap: int) -> bytes:
    """The bytes of ``entry`` in the directory ``dir_fd``, opened without following a link or
    blocking on a FIFO, after ``fstat`` says it is still the regular file of ``uid`` the scan
    saw and within ``cap``. Raises :class:`Unreadable`."""
    try:
        fd = os.open(entry.name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        reason = SYMLINK if exc.errno == errno.ELOOP else UNREADABLE
        raise Unreadable(reason, f"{entry.name}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable(NOT_REGULAR, entry.name)
        if st.st_uid != uid:
            raise Unreadable(WRONG_OWNER, f"{entry.name}: uid {st.st_uid}")
        if st.st_ino != entry.inode:
            raise Unreadable(CHANGED, entry.name)
        if st.st_size > cap:
            raise Unreadable(TOO_LARGE, f"{entry.name}: {st.st_size} bytes")
        chunks: list[bytes] = []
        total = 0
        while total <= cap:
            chunk = os.read(fd, min(1 << 20, cap + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > cap:
            raise Unreadable(TOO_LARGE, f"{entry.name}: grew past {cap} bytes")
        return b"".join(chunks)
    except OSError as exc:
        raise Unreadable(UNREADABLE, f"{entry.name}: {exc.strerror}") from None
    finally:
        os.close(fd)


def job_figures(job_id: str, analysis: Analysis, failed: int, now: float) -> JobCollectives:
    """The record of one job from its analysis; kinds outside :data:`KINDS` are left out
    (the label set stays the one the analysis knows)."""
    summary = analysis.summary()
    kinds = tuple(
        KindFigures(k.kind, k.skew, k.straggler, k.max_wait_ns / 1e9)
        for k in summary.kinds
        if k.kind in KINDS
    )
    return JobCollectives(
        job_id=job_id,
        files=len(analysis.files),
        failed=failed,
        ranks=analysis.ranks,
        kinds=kinds,
        max_skew=summary.max_skew,
        straggler=summary.straggler,
        max_wait_seconds=summary.max_wait_ns / 1e9,
        analysed_at=now,
    )


#: How the error of a file whose parsing raised (or whose parser process failed) begins: told
#: apart from a file the parser refused, it is counted as skip reason ``analysis_error``.
RAISED = "parser raised: "

#: Seconds one parser process may run (one job's files) before it is killed.
PARSE_TIMEOUT = 300.0

#: The answer of a parser process is a few hundred bytes per file; more is not an answer.
MAX_ANSWER_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Budget:
    """What the parser process may spend on one job: decoded objects and call records over
    all its files (each file gets what the files before it left), and as a last line the
    process's address space and CPU time (``setrlimit``)."""

    max_file_bytes: int
    max_files: int
    max_objects: int
    max_records: int
    memory_bytes: int
    cpu_seconds: int

    @classmethod
    def of(cls, settings: SpoolSettings) -> Budget:
        return cls(
            settings.max_file_bytes,
            settings.max_files_per_job,
            settings.max_objects_per_job,
            settings.max_records_per_job,
            settings.parser_memory_bytes,
            settings.parser_cpu_seconds,
        )


@dataclass(frozen=True, slots=True)
class FileOutcome:
    """What the parser process did with one file: ``skip`` is a skip reason when the file
    was not read or was refused (:data:`trace_refusals.OVER_BUDGET`), ``error`` why the file
    gave nothing."""

    name: str
    records: int
    error: str | None
    skip: str | None


@dataclass(frozen=True, slots=True)
class JobAnswer:
    """The parser process's whole answer for one job: per file what happened, the job's
    figures (None when no file gave records) and whether the process's limits were set."""

    files: tuple[FileOutcome, ...]
    figures: JobCollectives | None
    rlimits: bool


class ParserDied(Exception):
    """The parser process ended without an answer; ``culprit`` is the file it was reading,
    ``signal`` the signal that ended it (None: it exited)."""

    def __init__(self, detail: str, culprit: str | None, signal: int | None = None) -> None:
        super().__init__(detail)
        self.culprit = culprit
        self.signal = signal


#: Signals that end a parser from outside (the service stopping: systemd signals every
#: process of the unit): not the file's doing, so nothing is refused for them. The parser's
#: own limits end it with SIGXCPU or SIGKILL, the kernel's OOM killer with SIGKILL.
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


#: Runs the parser process over one job's files: (job id, directory fd, uid, files, budget).
Parse = Callable[[str, int, int, tuple[FileEntry, ...], Budget], JobAnswer]


def parse_job(
    job_id: str, dir_fd: int, uid: int, files: tuple[FileEntry, ...], budget: Budget
) -> JobAnswer:
    """Everything one job's files cost, in a process of its own
    (``python -m nodescope.sources.traces``): it opens the files relative to ``dir_fd`` with
    the same checks as the scan, decodes them within the job's object and record budgets,
    analyses them, and answers with the figures only, never the records. ``json.loads`` of
    a large file holds the interpreter lock for its whole run, and the records of a large job
    fill hundreds of MB: in the daemon's process either would hold up or kill it. The process
    runs under ``RLIMIT_AS`` and ``RLIMIT_CPU``, and is killed at :data:`PARSE_TIMEOUT`;
    when it dies, the file it announced last is the culprit."""
    request = {
        "job_id": job_id,
        "dir_fd": dir_fd,
        "uid": uid,
        "files": [[f.name, f.size, f.mtime_ns, f.inode] for f in files],
        "budget": dataclasses.asdict(budget),
    }
    child = subprocess.Popen(
        [sys.executable, "-m", "nodescope.sources.traces"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=(dir_fd,),
    )
    try:
        out, err = child.communicate(json.dumps(request).encode(), timeout=PARSE_TIMEOUT)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        return _answer(out, f"parser overran {PARSE_TIMEOUT:g} s", files)
    if child.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
        signum = -child.returncode if child.returncode < 0 else None
        how = f"killed by signal {signum}" if signum else f"exit status {child.returncode}"
        return _answer(out, f"parser {how}: {tail[0][:120]}", files, signum)
    return _answer(out, None, files)


def _answer(
    out: bytes, died: str | None, files: tuple[FileEntry, ...], signum: int | None = None
) -> JobAnswer:
    """Decode a parser process's lines: ``{"reading": name}`` before each file, then one
    ``{"answer": ...}``. Nothing in it is trusted beyond its shape: the process read
    hostile files."""
    culprit: str | None = None
    names = {f.name for f in files}
    for line in out[:MAX_ANSWER_BYTES].splitlines():
        try:
            message = json.loads(line)
        except ValueError:
            break
        if not isinstance(message, dict):
            break
        reading = message.get("reading")
        if isinstance(reading, str) and reading in names:
            culprit = reading
        elif "analysing" in message:
            culprit = None
        elif died is None and "answer" in message:
            return decode_answer(message["answer"], names)
    raise ParserDied(died or "parser gave no answer", culprit, signum)


def decode_answer(raw: object, names: set[str]) -> JobAnswer:
    """A :class:`JobAnswer` from its JSON form; :class:`ValueError` on anything else."""
    if not isinstance(raw, dict):
        raise ValueError("answer is not an object")
    outcomes = []
    for item in _list(raw.get("files"), len(names)):
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(item, dict) or not isinstance(name, str) or name not in names:
            raise ValueError("a file the job does not have")
        skip = item.get("skip")
        error = item.get("error")
        outcomes.append(
            FileOutcome(
                name,
                _int(item.get("records"), 1 << 40),
                error[:200] if isinstance(error, str) else None,
                skip if isinstance(skip, str) and skip in _ANSWER_SKIPS else None,
            )
        )
    if len({o.name for o in outcomes}) != len(outcomes):
        raise ValueError("a file answered twice")
    figures = raw.get("figures")
    return JobAnswer(
        tuple(outcomes),
        _figures(figures) if figures is not None else None,
        raw.get("rlimits") is True,
    )


def _list(value: object, most: int) -> list[object]:
    if not isinstance(value, list) or len(value) > most:
        raise ValueError("not a list of the expected length")
    return value


def _int(value: object, high: int, *, low: int = 0) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ValueError("not an integer in range")
    return value


def _real(value: object) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):  # type: ignore[arg-type]
        raise ValueError("not a finite number")
    return float(value)  # type: ignore[arg-type]


def _optional(value: object, read: Callable[[object], Any]) -> Any:
    return None if value is None else read(value)


def _rank(value: object) -> int:
    return _int(value, 1 << 31)


def _figures(raw: object) -> JobCollectives:
    if not isinstance(raw, dict):
        raise ValueError("figures are not an object")
    kinds = []
    for item in _list(raw.get("kinds"), len(KINDS)):
        if not isinstance(item, list) or len(item) != 4 or not isinstance(item[0], str):
            raise ValueError("a kind the analysis does not name")
        if item[0] not in KINDS:
            raise ValueError("a kind the analysis does not name")
        kinds.append(
            KindFigures(
                str(item[0]), _optional(item[1], _real), _optional(item[2], _rank), _real(item[3])
            )
        )
    return JobCollectives(
        job_id=str(raw.get("job_id"))[:64],
        files=_int(raw.get("files"), 1 << 20),
        failed=_int(raw.get("failed"), 1 << 20),
        ranks=tuple(_rank(r) for r in _list(raw.get("ranks"), 1 << 16)),
        kinds=tuple(kinds),
        max_skew=_optional(raw.get("max_skew"), _real),
        straggler=_optional(raw.get("straggler"), _rank),
        max_wait_seconds=_real(raw.get("max_wait_seconds")),
        analysed_at=_real(raw.get("analysed_at")),
    )


def _encode_figures(job: JobCollectives) -> dict[str, object]:
    return {
        "job_id": job.job_id,
        "files": job.files,
        "failed": job.failed,
        "ranks": list(job.ranks),
        "kinds": [[k.kind, k.skew, k.straggler, k.max_wait_seconds] for k in job.kinds],
        "max_skew": job.max_skew,
        "straggler": job.straggler,
        "max_wait_seconds": job.max_wait_seconds,
        "analysed_at": job.analysed_at,
    }


def _set_rlimits(budget: Budget) -> bool:
    """The parser's last line: an address space and a CPU time it cannot pass (an
    allocation past the first raises MemoryError; the second ends the process), and the
    lowest CPU priority. False where the system refuses the calls."""
    try:
        # Below the daemon in the unit's CPU quota: a parse slows, the cycle does not.
        os.nice(19)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_AS, (budget.memory_bytes, budget.memory_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (budget.cpu_seconds, budget.cpu_seconds + 1))
    except (OSError, ValueError):
        return False
    return True


def parse_job_here(
    job_id: str,
    dir_fd: int,
    uid: int,
    files: tuple[FileEntry, ...],
    budget: Budget,
    emit: Callable[[dict[str, object]], None] = lambda _: None,
    *,
    rlimits: bool = False,
    clock: Callable[[], float] = time.time,
) -> JobAnswer:
    """The parser process's work (:func:`parse_job`), callable in a test's own process.
    Each file gets what the job's budget has left; a file over it, or one whose decoding runs
    out of the process's memory, is refused (:data:`trace_refusals.OVER_BUDGET`)."""
    # The parsers are the parser process's: the daemon, which only reads its answers, and a
    # command that lists the sources never load them.
    from nodescope.collectives import Limits, ParsedFile, analyze, parse_bytes
    from nodescope.collectives.budget import OVER_BUDGET as OVER_BUDGET_TEXT
    from nodescope.collectives.model import FileReport

    base = Limits(max_file_bytes=budget.max_file_bytes, max_files=budget.max_files)
    objects_left, records_left = budget.max_objects, budget.max_records
    parsed: list[ParsedFile] = []
    outcomes: list[FileOutcome] = []
    for entry in files[: budget.max_files]:
        emit({"reading": entry.name})
        path = f"{job_id}/{entry.name}"
        try:
            data = read_checked(dir_fd, entry, uid, budget.max_file_bytes)
        except Unreadable as exc:
            outcomes.append(FileOutcome(entry.name, 0, str(exc)[:200], exc.reason))
            continue
        limits = dataclasses.replace(
            base, max_objects=max(0, objects_left), max_records=max(0, records_left)
        )
        try:
            result = parse_bytes(data, path, limits)
        except MemoryError:
            error = f"{OVER_BUDGET_TEXT}the parser's {budget.memory_bytes} bytes of memory"
            result = ParsedFile(FileReport(path, None, None, 0, 0, False, error), ())
        except Exception as exc:
            result = ParsedFile(
                FileReport(path, None, None, 0, 0, False, f"{RAISED}{exc!r}"[:200]), ()
            )
        del data
        report = result.report
        objects_left -= report.objects
        records_left -= len(result.calls)
        refused = report.error is not None and report.error.startswith(OVER_BUDGET_TEXT)
        outcomes.append(
            FileOutcome(
                entry.name,
                report.records,
                report.error,
                trace_refusals.OVER_BUDGET if refused else None,
            )
        )
        if report.error is None:
            parsed.append(result)
    figures = None
    if parsed:
        # A death from here on is the job's, not one file's: no file is named.
        emit({"analysing": len(parsed)})
        analysis = analyze(parsed, base)
        read = [o for o in outcomes if o.skip is None or o.skip == trace_refusals.OVER_BUDGET]
        failed = sum(1 for o in read if o.error is not None)
        figures = dataclasses.replace(
            job_figures(job_id, analysis, failed, clock()), files=len(read)
        )
    return JobAnswer(tuple(outcomes), figures, rlimits)


def _child_main() -> int:
    """The parser process: a request on stdin, one line per file begun and the answer on
    stdout (``{"reading": name}`` lines, then ``{"answer": ...}``)."""
    request = json.loads(sys.stdin.buffer.read(MAX_ANSWER_BYTES))
    raw = request["budget"]
    budget = Budget(**{f.name: int(raw[f.name]) for f in dataclasses.fields(Budget)})
    rlimits = _set_rlimits(budget)
    out = sys.stdout

    def emit(message: dict[str, object]) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    files = tuple(FileEntry(str(n), int(s), int(m), int(i)) for n, s, m, i in request["files"])
    answer = parse_job_here(
        str(request["job_id"]),
        int(request["dir_fd"]),
        int(request["uid"]),
        files,
        budget,
        emit,
        rlimits=rlimits,
    )
    emit(
        {
            "answer": {
                "files": [dataclasses.asdict(o) for o in answer.files],
                "figures": _encode_figures(answer.figures) if answer.figures else None,
                "rlimits": answer.rlimits,
            }
        }
    )
    return 0


#: Skip reasons a parser's answer may give a file: those of :func:`read_checked`, and the
#: refusal for the budget.
_ANSWER_SKIPS = frozenset(
    {SYMLINK, NOT_REGULAR, WRONG_OWNER, CHANGED, TOO_LARGE, UNREADABLE, trace_refusals.OVER_BUDGET}
)

#: What the worker's queue carries: a job's files to analyse, or None to stop.
_Work = JobFiles | None


@dataclass
class _Counts:
    analysed: int = 0
    failed: int = 0


class TraceWorker:
    """The thread that hands jobs' files to the parser process, owned by the ``traces``
    source.

    ``submit`` never blocks: a full queue refuses the job, and the source offers it again on
    its next run. Results are kept only for the jobs the source last said are wanted
    (:meth:`retain`): one bounded record per job, never the files' records. Files the parser
    refused are written down (:class:`trace_refusals.Refusals`, under the run root once
    :meth:`use_run_dir` names it) and left out of every later parse. ``parse`` is injected by
    tests (one that raises, one that blocks)."""

    def __init__(
        self,
        settings: SpoolSettings,
        clock: Callable[[], float] = time.time,
        parse: Parse = parse_job,
    ) -> None:
        self.settings = settings
        self.budget = Budget.of(settings)
        self._clock = clock
        self._parse = parse
        self._queue: queue.Queue[_Work] = queue.Queue(maxsize=settings.queue_size)
        self._lock = threading.Lock()
        self._results: dict[str, JobCollectives] = {}
        self._wanted: set[str] = set()
        self._tally = SkipTally()
        self._counts = _Counts()
        self._busy = 0
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.refusals = trace_refusals.Refusals(None, settings.max_refused_files)
        self._rlimits_warned = False

    def use_run_dir(self, directory: Path) -> None:
        """Keep the record of refused files in ``directory`` (before the first job)."""
        if self._thread is None and self.refusals.directory != directory:
            self.refusals = trace_refusals.Refusals(directory, self.settings.max_refused_files)

    def submit(self, work: JobFiles) -> bool:
        """Queue ``work``; False when the queue is full (or the worker stopped)."""
        if self._stopped:
            return False
        self._start()
        try:
            self._queue.put_nowait(work)
        except queue.Full:
            return False
        with self._lock:
            self._busy += 1
        return True

    def retain(self, job_ids: Iterable[str]) -> None:
        """Keep results of ``job_ids`` only: the others left the node."""
        wanted = set(job_ids)
        with self._lock:
            self._wanted = wanted
            for job_id in [j for j in self._results if j not in wanted]:
                del self._results[job_id]

    def results(self) -> tuple[tuple[JobCollectives, ...], int, int, int]:
        """The latest results, files analysed and failed in total, jobs queued or running."""
        with self._lock:
            jobs = tuple(self._results[j] for j in sorted(self._results))
            return jobs, self._counts.analysed, self._counts.failed, self._busy

    def take_skips(self, tally: SkipTally) -> None:
        """Move what the worker skipped since the last call into ``tally``."""
        with self._lock:
            skipped, self._tally = self._tally.freeze(), SkipTally()
        tally.merge(skipped)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is queued or running (for tests and replays)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._busy == 0:
                    return True
            time.sleep(0.01)
        return False

    def stop(self) -> None:
        self._stopped = True
        thread = self._thread
        if thread is None:
            return
        # A full queue: the worker is busy with an item, and the stop flag ends it after.
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        thread.join(timeout=5.0)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="nodescope-traces", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stopped:
            work = self._queue.get()
            if work is None:
                return
            try:
                self._run(work)
            except Exception as exc:  # a bug must not end the worker: that job waits
                log.warning("event=trace_analysis_failed job=%s error=%r", work.job_id, exc)
                with self._lock:
                    self._tally.skip(ANALYSIS_ERROR, f"job {work.job_id}: {exc!r}")
            finally:
                with self._lock:
                    self._busy -= 1

    def _run(self, work: JobFiles) -> None:
        with self._lock:
            if work.job_id not in self._wanted:
                return
        tally = SkipTally()
        counts = _Counts()
        files = tuple(f for f in work.files if self.refusals.reason(_key(work, f)) is None)
        if not files:
            self._merge(work.job_id, tally, counts, None)
            return
        try:
            dir_fd = os.open(work.directory, _DIR_FLAGS)
        except OSError as exc:
            tally.skip(DIR_UNREADABLE, f"{work.directory}: {exc.strerror}")
            self._merge(work.job_id, tally, counts, None)
            return
        try:
            st = os.fstat(dir_fd)
            if st.st_ino != work.dir_inode or st.st_uid != work.uid:
                tally.skip(CHANGED, work.directory)
                self._merge(work.job_id, tally, counts, None)
                return
            figures = self._parse_job(work, dir_fd, files, tally, counts)
        finally:
            os.close(dir_fd)
        self._merge(work.job_id, tally, counts, figures)

    def _parse_job(
        self,
        work: JobFiles,
        dir_fd: int,
        files: tuple[FileEntry, ...],
        tally: SkipTally,
        counts: _Counts,
    ) -> JobCollectives | None:
        """One parser process over ``files``; when it dies, the file it was reading is
        refused and the others are parsed again without it (at most once per file)."""
        refused: dict[trace_refusals.FileKey, str] = {}
        answer: JobAnswer | None = None
        for _ in range(len(files)):
            self.refusals.begin([_key(work, f) for f in files])
            try:
                answer = self._parse(work.job_id, dir_fd, work.uid, files, self.budget)
                break
            except ParserDied as exc:
                if self._stopped or exc.signal in STOP_SIGNALS:
                    # Stopped from outside (the daemon is stopping): no file is to blame,
                    # and nothing is left pending for the next daemon to refuse.
                    log.info("event=trace_parser_stopped job=%s", work.job_id)
                    break
                log.warning(
                    "event=trace_parser_failed job=%s file=%s error=%s",
                    work.job_id,
                    exc.culprit,
                    exc,
                )
                blamed = [f for f in files if f.name == exc.culprit] or list(files)
                for entry in blamed:
                    refused[_key(work, entry)] = trace_refusals.PARSER_KILLED
                    counts.failed += 1
                    tally.skip(trace_refusals.PARSER_KILLED, f"{work.directory}/{entry.name}")
                files = tuple(f for f in files if f not in blamed)
                if not files:
                    break
            except Exception as exc:
                # Anything else (a bad answer, a parser that could not start): the files are
                # failed this time, and tried again once they change.
                log.warning("event=trace_parser_failed job=%s error=%r", work.job_id, exc)
                counts.failed += len(files)
                for entry in files:
                    tally.skip(ANALYSIS_ERROR, f"{work.directory}/{entry.name}: {exc!r}"[:200])
                break
        if answer is not None:
            if not answer.rlimits and not self._rlimits_warned:
                self._rlimits_warned = True
                log.warning("event=trace_parser_no_rlimits bounded_by=object_budgets")
            for outcome in answer.files:
                where = f"{work.directory}/{outcome.name}"
                if outcome.skip == trace_refusals.OVER_BUDGET:
                    entry = next(f for f in files if f.name == outcome.name)
                    refused[_key(work, entry)] = trace_refusals.OVER_BUDGET
                if outcome.skip is not None:
                    tally.skip(outcome.skip, f"{where}: {outcome.error}")
                if outcome.error is None:
                    counts.analysed += 1
                elif outcome.skip is None or outcome.skip == trace_refusals.OVER_BUDGET:
                    counts.failed += 1
                    if outcome.error.startswith(RAISED):
                        tally.skip(ANALYSIS_ERROR, f"{where}: {outcome.error}")
        added = self.refusals.end(refused)
        for key in added:
            log.warning(
                "event=trace_file_refused job=%s file=%s reason=%s retried=false",
                key.job_id,
                key.name,
                refused[key],
            )
        if answer is None or answer.figures is None:
            return None
        return dataclasses.replace(answer.figures, job_id=work.job_id)

    def _merge(
        self,
        job_id: str,
        tally: SkipTally,
        counts: _Counts,
        figures: JobCollectives | None,
    ) -> None:
        with self._lock:
            self._tally.merge(tally.freeze())
            self._counts.analysed += counts.analysed
            self._counts.failed += counts.failed
            if job_id not in self._wanted:
                return  # the job left the node while its files were read
            if figures is not None:
                self._results[job_id] = figures
            else:
                self._results.pop(job_id, None)


def _key(work: JobFiles, entry: FileEntry) -> trace_refusals.FileKey:
    return trace_refusals.FileKey(work.job_id, entry.name, entry.inode, entry.size, entry.mtime_ns)


@dataclass
class TracesSource:
    """Scans the spool for the jobs on the node and hands the worker what changed.

    ``jobs`` returns the latest ``jobs`` record (the registry the jobs source builds);
    ``None`` before the jobs source's first run."""

    settings: SpoolSettings
    jobs: Callable[[], JobsData | None]
    name: str = NAME
    worker: TraceWorker = field(init=False)
    _submitted: dict[str, JobFiles] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.worker = TraceWorker(self.settings)

    def collect(self, roots: Roots) -> TracesData:
        tally = SkipTally()
        # No spool, nothing to read: a relative path would name a directory of the cwd.
        owners = owners_of(self.jobs()) if self.settings.spool_dir else {}
        wanted = sorted(owners)
        if len(wanted) > self.settings.max_jobs:
            tally.skip(TOO_MANY_JOBS, f"{len(wanted)} jobs, {self.settings.max_jobs} scanned")
            wanted = wanted[: self.settings.max_jobs]
        self.worker.use_run_dir(roots.run / RUN_SUBDIR)
        self.worker.retain(wanted)
        for job_id in [j for j in self._submitted if j not in owners]:
            del self._submitted[job_id]
        spool = Path(self.settings.spool_dir)
        for job_id in wanted:
            found = scan_job(spool, job_id, owners[job_id], self.settings, tally)
            if found is None or not found.files:
                continue
            if self._submitted.get(job_id) == found:
                continue
            if self.worker.submit(found):
                self._submitted[job_id] = found
            else:
                tally.skip(QUEUE_FULL, f"job {job_id}")
        self.worker.take_skips(tally)
        jobs, analysed, failed, pending = self.worker.results()
        return TracesData(
            spool_dir=self.settings.spool_dir,
            jobs=tuple(j for j in jobs if j.job_id in owners),
            files_analysed_total=analysed,
            files_failed_total=failed,
            pending_jobs=pending,
            skipped=tally.freeze(),
        )

    def close(self) -> None:
        self.worker.stop()


def make_source(
    settings: SpoolSettings | None = None, jobs: Callable[[], JobsData | None] = lambda: None
) -> TracesSource:
    """The source over ``settings``' spool; ``jobs``: the latest ``jobs`` record. Without a
    spool (the configuration leaves the source off then) it reads nothing and reports no
    jobs."""
    return TracesSource(settings or SpoolSettings(""), jobs)


SPEC = SourceSpec(
    name="traces",
    default_interval=15.0,
    help=(
        "PyTorch traces jobs drop in <spool_dir>/<job id>/, analysed off the cycle: per-job"
        " collective skew, straggler rank and longest wait (runs only with spool_dir set)"
    ),
    build=lambda inputs: make_source(inputs.spool, inputs.jobs.get),
    settings=SpoolSettings,
    rates=None,
    metric_area="nodescope_exporters.collective_metrics",
    # The spool's files are dropped when the timeline's events fire, at every move.
    sim_parts=frozenset(),
)


if __name__ == "__main__":
    sys.exit(_child_main())
