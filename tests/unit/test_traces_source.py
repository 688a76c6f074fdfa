"""The ``traces`` source: the spool checks on real files (links, FIFOs, devices, other
owners, sizes, directories that are not what they seem), fuzzed over modes and owners; the
worker on the real torch fixtures (figures, re-analysis of changed files only, a file that
makes the parser raise, a full queue, jobs that leave); the fixed kind set."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodescope import collectives
from nodescope.assembly import default_config, from_mapping
from nodescope.collect import Collector
from nodescope.collectives import Limits, ParsedFile
from nodescope.collectives.model import KIND_NAMES
from nodescope.config import spool_settings
from nodescope.errors import ConfigError
from nodescope.model.collectives import KINDS, SpoolSettings
from nodescope.model.job_records import JobsData, Registration
from nodescope.model.skips import SkipTally
from nodescope.roots import Roots
from nodescope.sources import trace_refusals, traces
from nodescope.sources.traces import (
    Budget,
    FileEntry,
    JobAnswer,
    ParserDied,
    TracesSource,
    TraceWorker,
    Unreadable,
    read_checked,
    scan_job,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "torch-traces"
#: A uid nobody on the test machine has: files are chowned to it (the tests run as root).
JOB_UID = 4242
OTHER_UID = 4343

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def _jobs(*jobs: tuple[str, int]) -> JobsData:
    return JobsData(
        "none",
        (),
        tuple(Registration(j, uid, "u", None, (), 0.0) for j, uid in jobs),
        (),
    )


def _job_dir(spool: Path, job: str, uid: int = JOB_UID) -> Path:
    path = spool / job
    path.mkdir(parents=True)
    os.chown(path, uid, uid)
    return path


def _put(directory: Path, name: str, data: bytes, uid: int = JOB_UID) -> Path:
    path = directory / name
    path.write_bytes(data)
    os.chown(path, uid, uid)
    return path


def _copy_fixtures(directory: Path, uid: int = JOB_UID) -> None:
    for rank in range(4):
        _put(directory, f"rank{rank}.json", (FIXTURES / f"rank{rank}.json").read_bytes(), uid)


def _settings(spool: Path, **changes: int) -> SpoolSettings:
    return SpoolSettings(str(spool), **changes)


def _roots(tmp_path: Path) -> Roots:
    """Roots whose run root (where the record of refused files lives) is the test's own."""
    (tmp_path / "run").mkdir(exist_ok=True)
    return Roots(run=tmp_path / "run")


def parse_here(
    job_id: str, dir_fd: int, uid: int, files: tuple[FileEntry, ...], budget: Budget
) -> JobAnswer:
    """The parser's work in the test's process, so that a patched parser is the one that
    runs."""
    return traces.parse_job_here(job_id, dir_fd, uid, files, budget)


@needs_root
def test_scan_accepts_the_jobs_own_regular_files_and_counts_every_other_entry(
    tmp_path: Path,
) -> None:
    job = _job_dir(tmp_path, "17")
    good = _put(job, "rank0.json", b"{}")
    _put(job, "foreign.json", b"{}", uid=OTHER_UID)
    (job / "link.json").symlink_to(good)
    os.mkfifo(job / "fifo.json")
    os.chown(job / "fifo.json", JOB_UID, JOB_UID)
    (job / "sub").mkdir()
    os.chown(job / "sub", JOB_UID, JOB_UID)
    _put(job, "big.json", b"x" * 2048)
    _put(job, ".rank1.json.tmp", b"{}")  # being written: not counted, not read
    tally = SkipTally()
    found = scan_job(tmp_path, "17", JOB_UID, _settings(tmp_path, max_file_bytes=1024), tally)
    assert found is not None
    assert [f.name for f in found.files] == ["rank0.json"]
    assert found.files[0].inode == good.stat().st_ino
    counts = tally.freeze().counts
    assert counts == {
        traces.WRONG_OWNER: 1,
        traces.SYMLINK: 1,
        traces.NOT_REGULAR: 2,  # the FIFO and the directory
        traces.TOO_LARGE: 1,
    }


@needs_root
def test_scan_refuses_job_directories_that_are_links_files_or_someone_elses(
    tmp_path: Path,
) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    elsewhere = _job_dir(tmp_path, "elsewhere")
    _copy_fixtures(elsewhere)
    (spool / "1").symlink_to(elsewhere)  # a link to a directory of the right owner
    _put(spool, "2", b"not a directory")
    _job_dir(spool, "3", uid=OTHER_UID)
    settings_ = _settings(spool)
    tally = SkipTally()
    assert scan_job(spool, "1", JOB_UID, settings_, tally) is None
    assert scan_job(spool, "2", JOB_UID, settings_, tally) is None
    assert scan_job(spool, "3", JOB_UID, settings_, tally) is None
    assert scan_job(spool, "../spool/3", JOB_UID, settings_, tally) is None
    assert scan_job(spool, "4", JOB_UID, settings_, tally) is None  # none: nothing counted
    assert tally.freeze().counts == {
        traces.DIR_NOT_DIRECTORY: 2,
        traces.DIR_WRONG_OWNER: 1,
        traces.BAD_JOB_ID: 1,
    }


@needs_root
def test_scan_caps_the_files_of_a_job(tmp_path: Path) -> None:
    job = _job_dir(tmp_path, "5")
    for i in range(10):
        _put(job, f"r{i:02}.json", b"{}")
    tally = SkipTally()
    found = scan_job(tmp_path, "5", JOB_UID, _settings(tmp_path, max_files_per_job=3), tally)
    assert found is not None and [f.name for f in found.files] == [
        "r00.json",
        "r01.json",
        "r02.json",
    ]
    assert tally.freeze().counts == {traces.TOO_MANY_FILES: 1}


_KINDS = st.sampled_from(["file", "symlink", "fifo", "dir", "socket"])


@needs_root
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    entries=st.lists(
        st.tuples(
            _KINDS,
            st.sampled_from([JOB_UID, OTHER_UID, 0]),
            st.integers(0, 3000),
            st.integers(0, 0o7777),
        ),
        max_size=12,
    ),
    name_salt=st.text(
        alphabet=st.characters(blacklist_characters="/\0", blacklist_categories=("Cs",)),
        min_size=1,
        max_size=20,
    ),
)
def test_scan_fuzzed_accepts_exactly_the_regular_files_of_the_job_within_the_cap(
    tmp_path_factory: pytest.TempPathFactory,
    entries: list[tuple[str, int, int, int]],
    name_salt: str,
) -> None:
    import socket

    spool = tmp_path_factory.mktemp("spool")
    job = _job_dir(spool, "99")
    expected: set[str] = set()
    skipped = 0
    for index, (kind, uid, size, mode) in enumerate(entries):
        name = f"{index}-{name_salt}"
        if name.startswith(".") or len(name.encode()) > 200:
            name = f"{index}"
        path = job / name
        if kind == "file":
            path.write_bytes(b"x" * size)
            os.chmod(path, mode)
            os.chown(path, uid, uid)
            if uid == JOB_UID and size <= 1024:
                expected.add(name)
                continue
        elif kind == "symlink":
            path.symlink_to("/etc/passwd")
        elif kind == "fifo":
            os.mkfifo(path)
            os.chown(path, uid, uid)
        elif kind == "dir":
            path.mkdir()
            os.chown(path, uid, uid)
        else:
            with socket.socket(socket.AF_UNIX) as s:
                try:
                    s.bind(str(path))
                except OSError:  # a path too long for sun_path: nothing made
                    continue
        skipped += 1
    tally = SkipTally()
    found = scan_job(spool, "99", JOB_UID, _settings(spool, max_file_bytes=1024), tally)
    assert found is not None
    assert {f.name for f in found.files} == expected
    assert sum(tally.freeze().counts.values()) == skipped
    shutil.rmtree(spool)


@needs_root
def test_read_checked_refuses_what_replaced_the_scanned_file(tmp_path: Path) -> None:
    job = _job_dir(tmp_path, "8")
    _put(job, "a.json", b"{}")
    found = scan_job(tmp_path, "8", JOB_UID, _settings(tmp_path), SkipTally())
    assert found is not None
    (entry,) = found.files
    # A second link keeps the scanned inode allocated, so no replacement can reuse its number.
    os.link(job / "a.json", tmp_path / "kept")
    fd = os.open(job, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert read_checked(fd, entry, JOB_UID, 1024) == b"{}"
        replacements = {
            traces.SYMLINK: lambda p: p.symlink_to("/etc/passwd"),
            traces.NOT_REGULAR: lambda p: os.mkfifo(p),  # O_NONBLOCK: the open does not hang
        }
        for reason, make in replacements.items():
            (job / "a.json").unlink()
            make(job / "a.json")
            with pytest.raises(Unreadable) as caught:
                read_checked(fd, entry, JOB_UID, 1024)
            assert caught.value.reason == reason
        (job / "a.json").unlink()
        _put(job, "a.json", b"{}")  # the same name, another inode
        with pytest.raises(Unreadable) as caught:
            read_checked(fd, entry, JOB_UID, 1024)
        assert caught.value.reason == traces.CHANGED
        grown = FileEntry("a.json", 2, 0, (job / "a.json").stat().st_ino)
        _put(job, "a.json", b"x" * 4096)
        with pytest.raises(Unreadable) as caught:
            read_checked(fd, grown, JOB_UID, 1024)
        assert caught.value.reason == traces.TOO_LARGE
    finally:
        os.close(fd)


def _collect_settled(source: TracesSource, roots: Roots) -> traces.TracesData:
    source.collect(roots)
    assert source.worker.wait_idle(60)
    return source.collect(roots)


@needs_root
def test_source_analyses_the_fixture_traces_of_a_job_on_the_node(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    job = _job_dir(spool, "123")
    _copy_fixtures(job)
    on_node = [_jobs(("123", JOB_UID))]
    source = TracesSource(_settings(spool), lambda: on_node[0])
    roots = _roots(tmp_path)
    try:
        data = _collect_settled(source, roots)
        figures = data.job("123")
        assert figures is not None
        assert figures.ranks == (0, 1, 2, 3) and figures.files == 4 and figures.failed == 0
        # The fixture's splits: rows sent 16, 32, 18, 52 -> δ = 0.4874 (tests/fixtures README).
        a2a = figures.kind("all_to_all")
        assert a2a is not None and a2a.skew == pytest.approx(0.4874, abs=1e-3)
        # Rank 3 slept 0.2 s before one all-reduce: the others waited about that long for it.
        reduce = figures.kind("all_reduce")
        assert reduce is not None and reduce.straggler == 3
        assert 0.15 < reduce.max_wait_seconds < 1.0
        assert data.files_analysed_total == 4

        # Unchanged files are not read again. One changed file: the job is analysed again
        # as a whole (the daemon keeps figures, not the records they came from).
        again = _collect_settled(source, roots)
        assert again.files_analysed_total == 4
        os.utime(job / "rank2.json", ns=(1, 1))
        changed = _collect_settled(source, roots)
        assert changed.files_analysed_total == 8
        assert changed.job("123") == dataclasses.replace(
            figures,
            analysed_at=changed.job("123").analysed_at,  # type: ignore[union-attr]
        )

        # The job left the node: its figures go.
        on_node[0] = _jobs()
        gone = source.collect(roots)
        assert gone.jobs == () and source.worker.results()[0] == ()
        # Nothing was refused: the record of refused files holds nothing.
        record = json.loads((tmp_path / "run" / "nodescope" / "trace-refusals.json").read_text())
        assert record["refused"] == [] and record["pending"] == []
    finally:
        source.close()


@needs_root
def test_a_directory_of_another_uid_or_a_job_not_on_the_node_is_not_read(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    _copy_fixtures(_job_dir(spool, "1", uid=OTHER_UID))
    _copy_fixtures(_job_dir(spool, "2"))  # no such job on the node
    source = TracesSource(_settings(spool), lambda: _jobs(("1", JOB_UID)))
    try:
        data = _collect_settled(source, _roots(tmp_path))
        assert data.jobs == () and data.files_analysed_total == 0
        assert data.skipped.counts == {traces.DIR_WRONG_OWNER: 1}
    finally:
        source.close()


@needs_root
def test_a_file_that_makes_the_parser_raise_is_counted_and_the_others_still_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = tmp_path / "spool"
    job = _job_dir(spool, "7")
    _copy_fixtures(job)
    _put(job, "poison.json", b'{"poison": true}')
    real = collectives.parse_bytes

    def parse(data: bytes, path: str, limits: Limits) -> ParsedFile:
        if b"poison" in data:
            raise RecursionError("a parser bug")
        return real(data, path, limits)

    # In this process, so the patched parser is the one that runs (the parser process's
    # work imports it when it runs).
    monkeypatch.setattr(collectives, "parse_bytes", parse)
    source = TracesSource(_settings(spool), lambda: _jobs(("7", JOB_UID)))
    source.worker = TraceWorker(source.settings, parse=parse_here)
    try:
        data = _collect_settled(source, _roots(tmp_path))
        figures = data.job("7")
        assert figures is not None and figures.ranks == (0, 1, 2, 3) and figures.failed == 1
        assert data.files_failed_total == 1 and data.files_analysed_total == 4
        assert data.skipped.counts == {traces.ANALYSIS_ERROR: 1}
        # Recorded once: the file is not read again until it changes.
        assert _collect_settled(source, _roots(tmp_path)).files_failed_total == 1
    finally:
        source.close()


@needs_root
def test_a_parser_process_that_fails_fails_its_files_and_the_worker_goes_on(
    tmp_path: Path,
) -> None:
    spool = tmp_path / "spool"
    job = _job_dir(spool, "6")
    _copy_fixtures(job)
    calls: list[int] = []

    def parse(
        job_id: str, dir_fd: int, uid: int, files: tuple[FileEntry, ...], budget: Budget
    ) -> JobAnswer:
        calls.append(len(files))
        if len(calls) == 1:
            raise ValueError("an answer that is not one")
        return parse_here(job_id, dir_fd, uid, files, budget)

    source = TracesSource(_settings(spool), lambda: _jobs(("6", JOB_UID)))
    source.worker = TraceWorker(source.settings, parse=parse)
    try:
        data = _collect_settled(source, _roots(tmp_path))
        assert data.files_failed_total == 4 and data.skipped.counts == {traces.ANALYSIS_ERROR: 4}
        assert data.job("6") is None
        os.utime(job / "rank1.json", ns=(5, 5))  # the job changed: it is parsed again
        data = _collect_settled(source, _roots(tmp_path))
        assert calls == [4, 4] and data.files_analysed_total == 4
        assert data.job("6") is not None
    finally:
        source.close()


@needs_root
def test_a_file_the_parser_died_on_is_refused_for_good_and_the_others_still_count(
    tmp_path: Path,
) -> None:
    spool = tmp_path / "spool"
    job = _job_dir(spool, "5")
    _copy_fixtures(job)
    calls: list[tuple[str, ...]] = []

    def parse(
        job_id: str, dir_fd: int, uid: int, files: tuple[FileEntry, ...], budget: Budget
    ) -> JobAnswer:
        calls.append(tuple(f.name for f in files))
        if "rank2.json" in calls[-1]:
            raise ParserDied("parser killed by signal 9", "rank2.json")
        return parse_here(job_id, dir_fd, uid, files, budget)

    settings_ = _settings(spool)
    source = TracesSource(settings_, lambda: _jobs(("5", JOB_UID)))
    source.worker = TraceWorker(settings_, parse=parse)
    try:
        data = _collect_settled(source, _roots(tmp_path))
        figures = data.job("5")
        assert figures is not None and figures.ranks == (0, 1, 3)
        assert data.skipped.counts == {trace_refusals.PARSER_KILLED: 1}
        assert calls == [
            tuple(f"rank{r}.json" for r in range(4)),
            ("rank0.json", "rank1.json", "rank3.json"),
        ]
    finally:
        source.close()
    # A new daemon (a new source) finds the record and never hands the file to a parser.
    again = TracesSource(settings_, lambda: _jobs(("5", JOB_UID)))
    again.worker = TraceWorker(settings_, parse=parse)
    try:
        data = _collect_settled(again, _roots(tmp_path))
        assert data.job("5") is not None and data.skipped.counts == {}
        assert calls[-1] == ("rank0.json", "rank1.json", "rank3.json")
    finally:
        again.close()


@needs_root
def test_a_parser_stopped_from_outside_refuses_nothing_and_leaves_nothing_pending(
    tmp_path: Path,
) -> None:
    spool = tmp_path / "spool"
    _copy_fixtures(_job_dir(spool, "4"))

    def parse(
        job_id: str, dir_fd: int, uid: int, files: tuple[FileEntry, ...], budget: Budget
    ) -> JobAnswer:
        raise ParserDied("parser killed by signal 15", "rank1.json", 15)

    settings_ = _settings(spool)
    source = TracesSource(settings_, lambda: _jobs(("4", JOB_UID)))
    source.worker = TraceWorker(settings_, parse=parse)
    try:
        data = _collect_settled(source, _roots(tmp_path))
        assert data.job("4") is None and data.files_failed_total == 0
        assert data.skipped.counts == {}
    finally:
        source.close()
    record = json.loads((tmp_path / "run" / "nodescope" / "trace-refusals.json").read_text())
    assert record == {"format": trace_refusals.FORMAT, "refused": [], "pending": []}


def test_the_parser_process_answers_with_figures_only(tmp_path: Path) -> None:
    """The real parser process on the fixtures gives what the same work in this process
    gives; its answer carries per file a count and per job the figures, never records."""
    for rank in range(2):
        shutil.copy(FIXTURES / f"rank{rank}.json", tmp_path / f"rank{rank}.json")
    (tmp_path / "bad.json").write_bytes(b"\x00not json")
    entries = []
    for name in ("bad.json", "rank0.json", "rank1.json"):
        st = os.stat(tmp_path / name)
        entries.append(FileEntry(name, st.st_size, st.st_mtime_ns, st.st_ino))
    budget = Budget.of(SpoolSettings(str(tmp_path)))
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        child = traces.parse_job("9", fd, os.geteuid(), tuple(entries), budget)
        here = traces.parse_job_here("9", fd, os.geteuid(), tuple(entries), budget)
    finally:
        os.close(fd)
    assert child.rlimits and child.files == here.files
    assert [o.records > 0 for o in child.files] == [False, True, True]
    assert child.figures is not None and here.figures is not None
    assert child.figures.ranks == (0, 1) and child.figures.failed == 1
    assert dataclasses.replace(child.figures, analysed_at=0) == dataclasses.replace(
        here.figures, analysed_at=0
    )


@pytest.mark.parametrize(
    "answer",
    [
        {"files": [{"name": "other.json", "records": 1}], "figures": None},
        {"files": [], "figures": {"kinds": [["rm -rf", None, None, 0]]}},
        {"files": [{"name": "a.json", "records": -1}], "figures": None},
        {"files": [], "figures": {"kinds": [], "ranks": [], "max_wait_seconds": float("nan")}},
        {"files": [{"name": "a.json", "records": 1}] * 2, "figures": None},
        [],
    ],
)
def test_an_answer_of_the_wrong_shape_is_refused(answer: object) -> None:
    with pytest.raises(ValueError):
        traces.decode_answer(answer, {"a.json"})


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=40,
)
_ANSWER_KEYS = ("files", "figures", "rlimits", "name", "records", "skip", "error", "kinds")


@settings(max_examples=300, deadline=None)
@given(
    _JSON,
    st.dictionaries(st.sampled_from(_ANSWER_KEYS), _JSON, max_size=4),
    st.lists(st.dictionaries(st.sampled_from(_ANSWER_KEYS), _JSON, max_size=5), max_size=3),
)
def test_a_fuzzed_answer_is_decoded_or_refused_never_anything_else(
    anything: object, figures: dict[str, object], files: list[dict[str, object]]
) -> None:
    for answer in (anything, {"files": files, "figures": figures}, {"files": anything}):
        try:
            decoded = traces.decode_answer(answer, {"a.json", "b.json"})
        except ValueError:
            continue
        assert {o.name for o in decoded.files} <= {"a.json", "b.json"}
        if decoded.figures is not None:
            assert {k.kind for k in decoded.figures.kinds} <= KINDS


@needs_root
def test_a_full_queue_refuses_without_blocking_and_the_job_is_offered_again(
    tmp_path: Path,
) -> None:
    spool = tmp_path / "spool"
    for job_id in ("1", "2", "3"):
        _copy_fixtures(_job_dir(spool, job_id))
    release = threading.Event()

    def parse(
        job_id: str, dir_fd: int, uid: int, files: tuple[FileEntry, ...], budget: Budget
    ) -> JobAnswer:
        release.wait(30)
        return parse_here(job_id, dir_fd, uid, files, budget)

    settings_ = _settings(spool, queue_size=1)
    source = TracesSource(settings_, lambda: _jobs(("1", JOB_UID), ("2", JOB_UID), ("3", JOB_UID)))
    source.worker = TraceWorker(settings_, parse=parse)
    roots = _roots(tmp_path)
    try:
        first = source.collect(roots)
        # One job in the worker, one queued, the third refused (the worker may not have taken
        # the first yet: then two are refused).
        assert first.skipped.counts.get(traces.QUEUE_FULL, 0) in (1, 2)
        release.set()
        for _ in range(4):
            data = _collect_settled(source, roots)
        assert [j.job_id for j in data.jobs] == ["1", "2", "3"]
    finally:
        release.set()
        source.close()


def test_the_model_names_every_kind_the_analysis_names() -> None:
    assert frozenset(KIND_NAMES.values()) == KINDS


def test_too_many_jobs_are_bounded(tmp_path: Path) -> None:
    jobs = _jobs(*((str(i), JOB_UID) for i in range(5)))
    source = TracesSource(_settings(tmp_path, max_jobs=2), lambda: jobs)
    try:
        data = source.collect(_roots(tmp_path))
        assert data.skipped.counts == {traces.TOO_MANY_JOBS: 1}
    finally:
        source.close()


def test_without_a_spool_the_source_reads_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A job directory where a relative spool would find it: it must not be read.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "1").write_bytes(b"")
    for source in (traces.make_source(), traces.make_source(None, lambda: _jobs(("1", 0)))):
        try:
            data = source.collect(Roots())
            assert data.jobs == () and not data.skipped and data.pending_jobs == 0
        finally:
            source.close()


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ({"spool_dir": "spool"}, "spool_dir"),
        ({"spool_dir": "/var/spool/../etc"}, "spool_dir"),
        ({"spool_dir": "/var/./spool"}, "spool_dir"),
        ({"spool_dir": "/s\nx"}, "spool_dir"),
        ({"spool_dir": "/s", "max_file_bytes": 10}, "max_file_bytes"),
        ({"spool_dir": "/s", "max_files_per_job": 0}, "max_files_per_job"),
        ({"spool_dir": "/s", "max_jobs": 1.5}, "max_jobs"),
        ({"spool_dir": "/s", "queue_size": True}, "queue_size"),
        ({"spool_dir": "/s", "max_objects_per_job": 10}, "max_objects_per_job"),
        ({"spool_dir": "/s", "max_records_per_job": -1}, "max_records_per_job"),
        ({"spool_dir": "/s", "parser_memory_bytes": 1 << 20}, "parser_memory_bytes"),
        ({"spool_dir": "/s", "parser_cpu_seconds": 0}, "parser_cpu_seconds"),
        ({"spool_dir": "/s", "max_refused_files": "many"}, "max_refused_files"),
        ({"spool_dir": "/s", "spool": "/t"}, "spool"),
    ],
)
def test_bad_spool_options_are_refused_with_their_key(table: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        from_mapping({"sources": {"traces": table}})
    assert f"sources.traces.{key}" in str(caught.value)


def test_the_source_runs_only_with_a_spool_and_gets_its_settings() -> None:
    assert not default_config().sources["traces"].enabled
    assert not from_mapping({"sources": {"traces": {"enabled": True}}}).sources["traces"].enabled
    config = from_mapping({"sources": {"traces": {"spool_dir": "/s", "max_jobs": 3}}})
    assert config.sources["traces"].enabled
    assert spool_settings(config) == SpoolSettings("/s", max_jobs=3)
    budget = {"max_objects_per_job": 5000, "max_records_per_job": 2000}
    budget |= {"parser_memory_bytes": 100 << 20, "parser_cpu_seconds": 9, "max_refused_files": 7}
    tight = from_mapping({"sources": {"traces": {"spool_dir": "/s", **budget}}})
    assert spool_settings(tight) == SpoolSettings("/s", **budget)
    collector = Collector.from_config(config)
    try:
        (source,) = [s.source for s in collector.scheduled if s.source.name == "traces"]
        assert isinstance(source, TracesSource) and source.settings.max_jobs == 3
    finally:
        collector.close()
    # Another source's table does not take the spool's keys.
    with pytest.raises(ConfigError):
        from_mapping({"sources": {"jobs": {"spool_dir": "/s"}}})


@pytest.mark.slow  # parser processes under their limits
def test_the_parser_processs_own_limits_refuse_what_the_budget_let_through(
    tmp_path: Path,
) -> None:
    """The last line, in a real parser process: with the budgets opened wide, a pickle of a
    million references runs the process into its CPU limit (it is killed; the daemon names
    the file it was reading), a 16 MB dump into its address space (the allocation fails; the
    file is refused), and the fixtures beside them still give their figures."""
    from tests.adversarial.hostile_traces import flight_json_dump, flight_pickle_bomb

    for rank in range(2):
        shutil.copy(FIXTURES / f"rank{rank}.json", tmp_path / f"rank{rank}.json")
    (tmp_path / "fr_trace_rank_4").write_bytes(flight_pickle_bomb(1_000_000))
    (tmp_path / "fr_trace_rank_5.json").write_bytes(flight_json_dump(5, (16 << 20) - 1))
    entries = {}
    for name in ("fr_trace_rank_4", "fr_trace_rank_5.json", "rank0.json", "rank1.json"):
        st = os.stat(tmp_path / name)
        entries[name] = FileEntry(name, st.st_size, st.st_mtime_ns, st.st_ino)
    fixtures = (entries["rank0.json"], entries["rank1.json"])
    wide = SpoolSettings(
        str(tmp_path), max_objects_per_job=50_000_000, max_records_per_job=50_000_000
    )
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        cpu = dataclasses.replace(Budget.of(wide), cpu_seconds=1, memory_bytes=2 << 30)
        with pytest.raises(ParserDied) as died:
            traces.parse_job("1", fd, os.geteuid(), (entries["fr_trace_rank_4"], *fixtures), cpu)
        assert died.value.culprit == "fr_trace_rank_4" and "signal" in str(died.value)
        memory = dataclasses.replace(Budget.of(wide), memory_bytes=96 << 20)
        job = (entries["fr_trace_rank_5.json"], *fixtures)
        answer = traces.parse_job("1", fd, os.geteuid(), job, memory)
    finally:
        os.close(fd)
    assert answer.rlimits
    first = answer.files[0]
    assert first.skip == trace_refusals.OVER_BUDGET and "memory" in (first.error or "")
    assert answer.figures is not None and answer.figures.ranks == (0, 1)
