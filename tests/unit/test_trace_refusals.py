"""The record of refused trace files on a real directory: what is refused stays refused in a
new instance (a restarted daemon), pending files become ``parser_interrupted``, the record is
bounded (oldest forgotten), and a record that is damaged, too large, a link or someone else's
is not believed (fuzzed over its JSON)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.sources import trace_refusals
from nodescope.sources.trace_refusals import FileKey, Refusals


def _key(n: int, job: str = "7") -> FileKey:
    return FileKey(job, f"rank{n}.json", 1000 + n, 10 * n, 5 * n)


def test_refused_files_stay_refused_and_pending_ones_are_interrupted(tmp_path: Path) -> None:
    directory = tmp_path / "nodescope"
    first = Refusals(directory, 10)
    first.begin([_key(1), _key(2)])
    assert first.end({_key(1): trace_refusals.OVER_BUDGET}) == [_key(1)]
    assert oct(os.stat(directory).st_mode & 0o777) == "0o750"
    first.begin([_key(3), _key(4)])  # the daemon dies here: nothing ends the parse
    again = Refusals(directory, 10)
    assert again.refused() == {
        _key(1): trace_refusals.OVER_BUDGET,
        _key(3): trace_refusals.PARSER_INTERRUPTED,
        _key(4): trace_refusals.PARSER_INTERRUPTED,
    }
    assert again.reason(_key(2)) is None
    # A file rewritten in place is another version: not refused.
    assert again.reason(FileKey("7", "rank1.json", 1001, 11, 5)) is None
    record = json.loads((directory / trace_refusals.FILE_NAME).read_text())
    assert record["pending"] == []


def test_the_record_is_bounded_oldest_first(tmp_path: Path) -> None:
    record = Refusals(tmp_path, 3)
    for n in range(5):
        record.begin([_key(n)])
        record.end({_key(n): trace_refusals.PARSER_KILLED})
    assert list(Refusals(tmp_path, 3).refused()) == [_key(2), _key(3), _key(4)]


def test_a_record_that_is_not_ours_is_not_believed(tmp_path: Path) -> None:
    path = tmp_path / trace_refusals.FILE_NAME
    for planted in (b"\x00not json", b"[" * 100_000, b" " * (5 << 20)):
        path.write_bytes(planted)
        assert Refusals(tmp_path, 10).refused() == {}
    path.unlink()
    target = tmp_path / "elsewhere.json"
    good = Refusals(tmp_path / "real", 10)
    good.begin([])
    good.end({_key(1): trace_refusals.OVER_BUDGET})
    target.write_bytes((tmp_path / "real" / trace_refusals.FILE_NAME).read_bytes())
    path.symlink_to(target)
    assert Refusals(tmp_path, 10).refused() == {}


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=6),
        lambda inner: st.lists(inner, max_size=7) | st.dictionaries(st.text(max_size=6), inner),
        max_leaves=30,
    )
)
def test_a_fuzzed_record_gives_well_formed_keys_or_nothing(entries: object) -> None:
    document = {"format": trace_refusals.FORMAT, "refused": entries, "pending": entries}
    for field in ("refused", "pending"):
        for key, reason in trace_refusals._entries(document, field):
            assert isinstance(key.job_id, str) and isinstance(key.name, str)
            assert all(type(v) is int for v in (key.inode, key.size, key.mtime_ns))
            assert isinstance(reason, str) and reason
