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

The scan in the cycle only ``lstat``\\ s. Reading and analysing happen in one worker thread
that the source object owns, fed through a bounded queue with the jobs whose files are new or
changed (path, size, mtime, inode); each run hands the cycle the worker's latest results. The
worker reads the files and hands their bytes to a parser process of its own
(``python -m nodescope.sources.traces``, :func:`parse_in_child`): ``json.loads`` of a large
file holds the interpreter lock for its whole run (seconds for tens of MB), which in the
daemon's process would hold up its cycle. A file that makes the parser raise, or a parser
process that fails, is counted as failed and skipped until the file changes; a job that left
the node loses its results and the worker's cache of its files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import logging
import os
import pickle
import queue
import re
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodescope.collectives import Analysis, Limits, ParsedFile, analyze, parse_bytes
from nodescope.collectives.model import FileReport
from nodescope.model.collectives import (
    KINDS,
    TRACES,
    JobCollectives,
    KindFigures,
    SpoolSettings,
    TracesData,
)
from nodescope.model.job_records import JobsData
from nodescope.model.jobs import build_registry
from nodescope.model.skips import SkipTally
from nodescope.roots import Roots

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

#: Seconds one parser process may run (a batch of at most ``max_file_bytes``).
PARSE_TIMEOUT = 300.0

#: Parses ``(path, bytes)`` pairs into one :class:`ParsedFile` each, in order.
Parse = Callable[[list[tuple[str, bytes]], Limits], list[ParsedFile]]


def parse_files(files: list[tuple[str, bytes]], limits: Limits) -> list[ParsedFile]:
    """Each file's records; a file whose parsing raises gives a report with the error, and
    the other files still count."""
    results: list[ParsedFile] = []
    for path, data in files:
        try:
            results.append(parse_bytes(data, path, limits))
        except Exception as exc:
            error = f"{RAISED}{exc!r}"[:200]
            results.append(ParsedFile(FileReport(path, None, None, 0, 0, False, error), ()))
    return results


#: The classes a parser process's answer may hold: the records of the collective layer.
_ANSWER_CLASSES = frozenset({"ParsedFile", "FileReport", "CallRecord"})


class _AnswerUnpickler(pickle.Unpickler):
    """Reads a parser process's answer: built-in values and the three record classes, no
    other global (the process read hostile files; its answer is not trusted to name code)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "nodescope.collectives.model" and name in _ANSWER_CLASSES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a record")


def parse_in_child(
    files: list[tuple[str, bytes]], limits: Limits, timeout: float = PARSE_TIMEOUT
) -> list[ParsedFile]:
    """:func:`parse_files` in a process of its own (``python -m nodescope.sources.traces``):
    ``json.loads`` of a large file holds the interpreter lock for its whole run, which in a
    thread would hold up the daemon's cycle; in a process it holds up nothing, and a parser
    that runs away is killed at ``timeout``."""
    request = pickle.dumps((dataclasses.astuple(limits), files), protocol=pickle.HIGHEST_PROTOCOL)
    done = subprocess.run(
        [sys.executable, "-m", "nodescope.sources.traces"],
        input=request,
        capture_output=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
        raise RuntimeError(f"parser exit status {done.returncode}: {tail[0][:160]}")
    answer = _AnswerUnpickler(io.BytesIO(done.stdout)).load()
    if not isinstance(answer, list) or not all(isinstance(a, ParsedFile) for a in answer):
        raise ValueError("parser answer is not a list of parsed files")
    return answer


def _child_main() -> int:
    """The parser process: a request from the daemon on stdin, the parsed files on stdout."""
    raw_limits, files = pickle.loads(sys.stdin.buffer.read())
    results = parse_files(files, Limits(*raw_limits))
    sys.stdout.buffer.write(pickle.dumps(results, protocol=pickle.HIGHEST_PROTOCOL))
    return 0


#: What the worker's queue carries: a job's files to analyse, or None to stop.
_Work = JobFiles | None

#: One file as last parsed: the entry it was parsed from and what it gave.
_Parsed = tuple[FileEntry, ParsedFile]


@dataclass
class _Counts:
    analysed: int = 0
    failed: int = 0


class TraceWorker:
    """The thread that reads and analyses jobs' files, owned by the ``traces`` source.

    ``submit`` never blocks: a full queue refuses the job, and the source offers it again on
    its next run. Results and the per-file cache are kept only for the jobs the source last
    said are wanted (:meth:`retain`). ``analyze_job`` is injected by tests (one that raises,
    one that blocks)."""

    def __init__(
        self,
        settings: SpoolSettings,
        clock: Callable[[], float] = time.time,
        analyse: Callable[[list[ParsedFile], Limits], Analysis] | None = None,
        parse: Parse = parse_in_child,
    ) -> None:
        self.settings = settings
        self.limits = Limits(
            max_file_bytes=settings.max_file_bytes, max_files=settings.max_files_per_job
        )
        self._clock = clock
        self._analyse = analyse or (lambda parsed, limits: analyze(parsed, limits))
        self._parse = parse
        self._queue: queue.Queue[_Work] = queue.Queue(maxsize=settings.queue_size)
        self._lock = threading.Lock()
        self._results: dict[str, JobCollectives] = {}
        self._parsed: dict[str, dict[str, _Parsed]] = {}
        self._wanted: set[str] = set()
        self._tally = SkipTally()
        self._counts = _Counts()
        self._busy = 0
        self._thread: threading.Thread | None = None
        self._stopped = False

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
            for job_id in [j for j in self._parsed if j not in wanted]:
                del self._parsed[job_id]

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
            cache = dict(self._parsed.get(work.job_id, {}))
        tally = SkipTally()
        counts = _Counts()
        try:
            dir_fd = os.open(work.directory, _DIR_FLAGS)
        except OSError as exc:
            tally.skip(DIR_UNREADABLE, f"{work.directory}: {exc.strerror}")
            self._merge(work.job_id, tally, counts, None, {})
            return
        parsed: dict[str, _Parsed] = {}
        try:
            st = os.fstat(dir_fd)
            if st.st_ino != work.dir_inode or st.st_uid != work.uid:
                tally.skip(CHANGED, work.directory)
                self._merge(work.job_id, tally, counts, None, {})
                return
            batch: list[tuple[FileEntry, bytes]] = []
            size = 0
            for entry in work.files:
                before = cache.get(entry.name)
                if before is not None and before[0] == entry:
                    parsed[entry.name] = before
                    continue
                try:
                    data = read_checked(dir_fd, entry, work.uid, self.settings.max_file_bytes)
                except Unreadable as exc:
                    tally.skip(exc.reason, f"{work.directory}/{exc}")
                    continue
                # Files go to the parser in batches of at most one file cap: what the worker
                # holds in memory at once stays bounded by the cap, not by the job's files.
                if batch and size + len(data) > self.settings.max_file_bytes:
                    self._parse_batch(work, batch, parsed, tally, counts)
                    batch, size = [], 0
                batch.append((entry, data))
                size += len(data)
            if batch:
                self._parse_batch(work, batch, parsed, tally, counts)
        finally:
            os.close(dir_fd)
        files = [p for _, p in parsed.values()]
        figures: JobCollectives | None = None
        if files:
            try:
                analysis = self._analyse(files, self.limits)
            except Exception as exc:
                log.warning("event=trace_analysis_failed job=%s error=%r", work.job_id, exc)
                tally.skip(ANALYSIS_ERROR, f"job {work.job_id}: {exc!r}")
            else:
                failed = sum(1 for r in analysis.files if r.error is not None)
                figures = job_figures(work.job_id, analysis, failed, self._clock())
        self._merge(work.job_id, tally, counts, figures, parsed)

    def _parse_batch(
        self,
        work: JobFiles,
        batch: list[tuple[FileEntry, bytes]],
        parsed: dict[str, _Parsed],
        tally: SkipTally,
        counts: _Counts,
    ) -> None:
        named = [(f"{work.directory}/{entry.name}", data) for entry, data in batch]
        try:
            results = self._parse(named, self.limits)
            if len(results) != len(named):
                raise ValueError(f"{len(results)} results for {len(named)} files")
        except Exception as exc:
            # The parser process died, overran or answered nonsense: every file of the batch
            # is recorded as failed, and tried again only once it changes.
            log.warning("event=trace_parser_failed job=%s error=%r", work.job_id, exc)
            results = [
                ParsedFile(FileReport(path, None, None, 0, 0, False, f"{RAISED}{exc!r}"[:200]), ())
                for path, _ in named
            ]
        for (entry, _), result in zip(batch, results, strict=True):
            error = result.report.error
            if error is None:
                counts.analysed += 1
            else:
                counts.failed += 1
                if error.startswith(RAISED):
                    tally.skip(ANALYSIS_ERROR, f"{result.report.path}: {error}")
            parsed[entry.name] = (entry, result)

    def _merge(
        self,
        job_id: str,
        tally: SkipTally,
        counts: _Counts,
        figures: JobCollectives | None,
        parsed: Mapping[str, _Parsed],
    ) -> None:
        with self._lock:
            self._tally.merge(tally.freeze())
            self._counts.analysed += counts.analysed
            self._counts.failed += counts.failed
            if job_id not in self._wanted:
                return  # the job left the node while its files were read
            self._parsed[job_id] = dict(parsed)
            if figures is not None:
                self._results[job_id] = figures


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


if __name__ == "__main__":
    sys.exit(_child_main())
