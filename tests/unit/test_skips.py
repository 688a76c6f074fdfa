"""Skipped records: counted per reason, one escaped example each, records stay copyable."""

from __future__ import annotations

import copy
import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from nodescope.model.skips import EXAMPLE_CHARS, NOTHING_SKIPPED, Skipped, SkipTally


def test_counts_per_reason_and_the_first_example() -> None:
    tally = SkipTally()
    assert not tally and tally.freeze() is NOTHING_SKIPPED
    tally.skip("stat_unparsable", "/proc/7/stat")
    tally.skip("stat_unparsable", "/proc/8/stat")
    tally.skip("wchan_unparsable", "/proc/9/wchan")
    skipped = tally.freeze()
    assert skipped.counts == {"stat_unparsable": 2, "wchan_unparsable": 1}
    assert skipped.examples["stat_unparsable"] == "/proc/7/stat"
    assert (skipped + skipped).counts == {"stat_unparsable": 4, "wchan_unparsable": 2}
    assert skipped + NOTHING_SKIPPED is skipped


@given(st.text(max_size=2000))
def test_an_example_is_one_short_printable_line(example: str) -> None:
    tally = SkipTally()
    tally.skip("reason", example)
    shown = tally.freeze().examples["reason"]
    assert "\n" not in shown and "\r" not in shown
    assert len(shown) <= EXAMPLE_CHARS + 1


def test_a_record_holding_skips_can_be_copied_and_turned_into_a_dict() -> None:
    @dataclasses.dataclass(frozen=True)
    class Record:
        value: int
        skipped: Skipped = NOTHING_SKIPPED

    tally = SkipTally()
    tally.skip("line_unparsable", "x\ny) R 1")
    record = Record(1, tally.freeze())
    assert dataclasses.asdict(record)["skipped"]["counts"] == {"line_unparsable": 1}
    assert copy.deepcopy(record) == record
