"""The ``traces`` source: the spool checks on real files (links, FIFOs, devices, other
owners, sizes, directories that are not what they seem), fuzzed over modes and owners; the
worker on the real torch fixtures (figures, re-analysis of changed files only, a file that
makes the parser raise, a full queue, jobs that leave); the fixed kind set."""

from __future__ import annotations

import io
import os
import pickle
import shutil
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodescope.collect import Collector
from nodescope.collectives import Analysis, Limits, ParsedFile, analyze
from nodescope.collectives.model import KIND_NAMES
from nodescope.config import Config, from_mapping, spool_settings
from nodescope.errors import ConfigError
from nodescope.model.collectives import KINDS, SpoolSettings
from nodescope.model.job_records import JobsData, Registration
from nodescope.model.skips import SkipTally
from nodescope.roots import Roots
from nodescope.sources import traces
from nodescope.sources.traces import (
    FileEntry,
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
    assert source.worker.wait_idle(30)
    return source.collect(roots)


@needs_root
def test_source_analyses_the_fixture_traces_of_a_job_on_the_node(tmp_path: Path) -> None:
    job = _job_dir(tmp_path, "123")
    _copy_fixtures(job)
    on_node = [_jobs(("123", JOB_UID))]
    source = TracesSource(_settings(tmp_path), lambda: on_node[0])
    roots = Roots()
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

        # Unchanged files are not read again; one changed file is the only one read.
        again = _collect_settled(source, roots)
        assert again.files_analysed_total == 4
        os.utime(job / "rank2.json", ns=(1, 1))
        changed = _collect_settled(source, roots)
        assert changed.files_analysed_total == 5

        # The job left the node: its figures go, and the worker forgets its files.
        on_node[0] = _jobs()
        gone = source.collect(roots)
        assert gone.jobs == () and source.worker.results()[0] == ()
    finally:
        source.close()


@needs_root
def test_a_directory_of_another_uid_or_a_job_not_on_the_node_is_not_read(tmp_path: Path) -> None:
    _copy_fixtures(_job_dir(tmp_path, "1", uid=OTHER_UID))
    _copy_fixtures(_job_dir(tmp_path, "2"))  # no such job on the node
    source = TracesSource(_settings(tmp_path), lambda: _jobs(("1", JOB_UID)))
    try:
        data = _collect_settled(source, Roots())
        assert data.jobs == () and data.files_analysed_total == 0
        assert data.skipped.counts == {traces.DIR_WRONG_OWNER: 1}
    finally:
        source.close()


@needs_root
def test_a_file_that_makes_the_parser_raise_is_counted_and_the_others_still_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _job_dir(tmp_path, "7")
    _copy_fixtures(job)
    _put(job, "poison.json", b'{"poison": true}')
    real = traces.parse_bytes

    def parse(data: bytes, path: str, limits: Limits) -> ParsedFile:
        if b"poison" in data:
            raise RecursionError("a parser bug")
        return real(data, path, limits)

    # In this process, so the patched parser is the one that runs.
    monkeypatch.setattr(traces, "parse_bytes", parse)
    source = TracesSource(_settings(tmp_path), lambda: _jobs(("7", JOB_UID)))
    source.worker = TraceWorker(source.settings, parse=traces.parse_files)
    try:
        data = _collect_settled(source, Roots())
        figures = data.job("7")
        assert figures is not None and figures.ranks == (0, 1, 2, 3) and figures.failed == 1
        assert data.files_failed_total == 1 and data.files_analysed_total == 4
        assert data.skipped.counts == {traces.ANALYSIS_ERROR: 1}
        # Recorded once: the file is not read again until it changes.
        assert _collect_settled(source, Roots()).files_failed_total == 1
    finally:
        source.close()


@needs_root
def test_a_parser_process_that_fails_fails_its_files_and_the_worker_goes_on(
    tmp_path: Path,
) -> None:
    job = _job_dir(tmp_path, "6")
    _copy_fixtures(job)
    calls: list[int] = []

    def parse(files: list[tuple[str, bytes]], limits: Limits) -> list[ParsedFile]:
        calls.append(len(files))
        if len(calls) == 1:
            raise TimeoutError("parser overran")
        return traces.parse_files(files, limits)

    source = TracesSource(_settings(tmp_path), lambda: _jobs(("6", JOB_UID)))
    source.worker = TraceWorker(source.settings, parse=parse)
    try:
        data = _collect_settled(source, Roots())
        assert data.files_failed_total == 4 and data.skipped.counts == {traces.ANALYSIS_ERROR: 4}
        figures = data.job("6")
        assert figures is not None and figures.ranks == () and figures.failed == 4
        os.utime(job / "rank1.json", ns=(5, 5))  # one file changed: only it is parsed again
        data = _collect_settled(source, Roots())
        assert calls == [4, 1] and data.files_analysed_total == 1
    finally:
        source.close()


def test_the_parser_process_parses_the_fixtures_and_its_answer_names_no_other_code() -> None:
    files = [(f"rank{r}.json", (FIXTURES / f"rank{r}.json").read_bytes()) for r in range(2)]
    files.append(("bad.json", b"\x00not json"))
    parsed = traces.parse_in_child(files, Limits())
    assert parsed == traces.parse_files(files, Limits())
    assert [p.report.rank for p in parsed] == [0, 1, None]
    assert parsed[2].report.error is not None and parsed[0].calls
    hostile = pickle.dumps(os.system)  # a global outside the records
    with pytest.raises(pickle.UnpicklingError):
        traces._AnswerUnpickler(io.BytesIO(hostile)).load()


@needs_root
def test_an_analysis_that_raises_leaves_the_worker_running(tmp_path: Path) -> None:
    job = _job_dir(tmp_path, "9")
    _copy_fixtures(job)
    calls: list[int] = []

    def analyse(parsed: list[ParsedFile], limits: Limits) -> Analysis:
        calls.append(len(parsed))
        if len(calls) == 1:
            raise ValueError("boom")
        return analyze(parsed, limits)

    source = TracesSource(_settings(tmp_path), lambda: _jobs(("9", JOB_UID)))
    source.worker = TraceWorker(source.settings, analyse=analyse)
    try:
        data = _collect_settled(source, Roots())
        assert data.job("9") is None and data.skipped.counts == {traces.ANALYSIS_ERROR: 1}
        _put(job, "rank3.json", (FIXTURES / "rank3.json").read_bytes())  # a new inode
        data = _collect_settled(source, Roots())
        assert data.job("9") is not None and calls == [4, 4]
    finally:
        source.close()


@needs_root
def test_a_full_queue_refuses_without_blocking_and_the_job_is_offered_again(
    tmp_path: Path,
) -> None:
    for job_id in ("1", "2", "3"):
        _copy_fixtures(_job_dir(tmp_path, job_id))
    release = threading.Event()

    def analyse(parsed: list[ParsedFile], limits: Limits) -> Analysis:
        release.wait(30)
        return analyze(parsed, limits)

    settings_ = _settings(tmp_path, queue_size=1)
    source = TracesSource(settings_, lambda: _jobs(("1", JOB_UID), ("2", JOB_UID), ("3", JOB_UID)))
    source.worker = TraceWorker(settings_, analyse=analyse)
    try:
        first = source.collect(Roots())
        # One job in the worker, one queued, the third refused (the worker may not have taken
        # the first yet: then two are refused).
        assert first.skipped.counts.get(traces.QUEUE_FULL, 0) in (1, 2)
        release.set()
        for _ in range(4):
            data = _collect_settled(source, Roots())
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
        data = source.collect(Roots())
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
        ({"spool_dir": "/s", "spool": "/t"}, "spool"),
    ],
)
def test_bad_spool_options_are_refused_with_their_key(table: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        from_mapping({"sources": {"traces": table}})
    assert f"sources.traces.{key}" in str(caught.value)


def test_the_source_runs_only_with_a_spool_and_gets_its_settings() -> None:
    assert not Config().sources["traces"].enabled
    assert not from_mapping({"sources": {"traces": {"enabled": True}}}).sources["traces"].enabled
    config = from_mapping({"sources": {"traces": {"spool_dir": "/s", "max_jobs": 3}}})
    assert config.sources["traces"].enabled
    assert spool_settings(config) == SpoolSettings("/s", max_jobs=3)
    collector = Collector.from_config(config)
    try:
        (source,) = [s.source for s in collector.scheduled if s.source.name == "traces"]
        assert isinstance(source, TracesSource) and source.settings.max_jobs == 3
    finally:
        collector.close()
    # Another source's table does not take the spool's keys.
    with pytest.raises(ConfigError):
        from_mapping({"sources": {"jobs": {"spool_dir": "/s"}}})
