"""NVSwitch SXids: the kernel-log parser (the driver's line forms, continuation lines,
``/dev/kmsg`` records and their dictionary lines, forged records, garbage, over-long lines,
bytes that are not UTF-8, fuzzing), the bounded reader on a regular file and a FIFO, the
source's counts and bounds, and the detector on hand-made records."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.assembly import default_config
from nodescope.detectors import sxids
from nodescope.model.finding import Severity
from nodescope.model.skips import SkipTally
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.model.sxid import MESSAGE_CHARS, SXID, SxidCount, SxidData
from nodescope.roots import Roots
from nodescope.sources import sxid as sx
from tests.conftest import FIXTURES

CAPTURES = FIXTURES / "captures" / "hgx-h100"

#: Lines in the driver's form (``NVSWITCH_PRINT_SXID``), as dmesg and the journal show them.
NONFATAL_LINE = (
    "nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 20009, Non-fatal, Link 28 RX Short Error Rate"
)
FATAL_LINE = (
    "nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 24007, Fatal, Link 30 sourcetrack timeout error"
)
SEVERITY_LINE = (
    "nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 20009, Severity 0 Engine instance 28"
    " Sub-engine instance 00"
)
DATA_LINE = (
    "nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 20009, Data {0x00000000, 0x00000001,"
    " 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000}"
)


def _kmsg(seq: int, text: str, prio: int = 3) -> str:
    return f"{prio},{seq},{1000 + seq},-;{text}\n"


def _skips(tally: SkipTally) -> dict[str, int]:
    return dict(tally.freeze().counts)


# --- the parser -------------------------------------------------------------------------------


def test_kmsg_records_with_their_continuations_and_dictionary_lines() -> None:
    text = "".join(
        [
            _kmsg(4100, NONFATAL_LINE) + " SUBSYSTEM=pci\n DEVICE=+pci:0000:c3:00.0\n",
            _kmsg(4101, SEVERITY_LINE),
            _kmsg(4102, DATA_LINE),
            _kmsg(4103, "nvidia-nvswitch2: open (major=510)", prio=6),
            _kmsg(4104, FATAL_LINE),
        ]
    )
    tally = SkipTally()
    a, b = sx.parse_kmsg_sxid(text, tally)
    assert (a.device, a.nvswitch, a.sxid, a.fatal, a.link) == (
        "nvswitch0",
        "0000:c3:00.0",
        20009,
        False,
        28,
    )
    assert a.message == "RX Short Error Rate"
    assert (a.sequence, a.kernel_usec, a.line) == (4100, 5100, 1)
    assert (b.device, b.nvswitch, b.sxid, b.fatal, b.link) == (
        "nvswitch3",
        "0000:05:00.0",
        24007,
        True,
        30,
    )
    assert b.message == "sourcetrack timeout error"
    assert not tally  # continuation and dictionary lines are no malformed records


def test_dmesg_and_journal_forms() -> None:
    text = "\n".join(
        [
            f"[38889.018130] {FATAL_LINE}",
            f"[Sun Feb 23 16:24:18 2025] {NONFATAL_LINE}",
            f"Jan 18 11:38:05 host kernel: {NONFATAL_LINE}",
            f"<3>[  12.000000] {FATAL_LINE}",
            "nvidia-nvswitch0: SXid (PCI:0004:00:00.0): 26007, SOE EXTERR",
            "nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20009, Non-fatal, Link 04",
            "nvidia-nvswitch1: SXid (PCI:10000:06:00.0): 12028, Non-fatal, Link 32 egress"
            " non-posted PRIV error (First)",
        ]
    )
    records = sx.parse_kmsg_sxid(text)
    assert [(r.sxid, r.fatal, r.link) for r in records] == [
        (24007, True, 30),
        (20009, False, 28),
        (20009, False, 28),
        (24007, True, 30),
        (26007, None, None),  # the driver's line states no severity and no link
        (20009, False, 4),
        (12028, False, 32),
    ]
    assert all(r.sequence is None for r in records)
    assert records[4].message == "SOE EXTERR" and records[4].nvswitch == "0004:00:00.0"
    assert records[5].message == ""
    assert records[6].nvswitch == "10000:06:00.0"  # a wide domain keeps its digits
    assert records[6].message == "egress non-posted PRIV error (First)"


def test_real_kmsg_captures_hold_no_sxid() -> None:
    for name in ("kmsg.1.log", "kmsg.2.peermem.log"):
        tally = SkipTally()
        text = (CAPTURES / name).read_text()
        assert "nvidia-nvswitch" in text or name != "kmsg.1.log"
        assert sx.parse_kmsg_sxid(text, tally) == ()
        assert not tally


def test_records_written_from_user_space_are_skipped() -> None:
    # The kernel gives every record written to /dev/kmsg from user space a facility.
    text = _kmsg(7, FATAL_LINE, prio=(1 << 3) | 3) + f"<14>{FATAL_LINE}\n" + _kmsg(8, FATAL_LINE)
    tally = SkipTally()
    [record] = sx.parse_kmsg_sxid(text, tally)
    assert record.sequence == 8
    assert _skips(tally) == {sx.SKIP_NOT_KERNEL: 2}


@pytest.mark.parametrize(
    "line",
    [
        "nvidia-nvswitch1: SXid (PCI:0000:06:00.0): garbled, Fatal",
        "nvidia-nvswitch1: SXid (PCI:0000:zz:00.0): 20009, Fatal, Link 1 x",
        "nvidia-nvswitch1: SXid (PCI:0000:06:3f.0): 20009, Fatal, device number past 31",
        "nvidia-nvswitch1: SXid (PCI:0000:06:00): 20009, Fatal, no function",
        "someone: SXid (broken",
    ],
)
def test_malformed_sxid_lines_are_skipped_and_counted(line: str) -> None:
    tally = SkipTally()
    text = f"{_kmsg(1, FATAL_LINE)}{line}\n{_kmsg(2, NONFATAL_LINE)}"
    records = sx.parse_kmsg_sxid(text, tally)
    assert [r.sxid for r in records] == [24007, 20009]
    assert _skips(tally) == {sx.SKIP_UNPARSABLE: 1}
    assert "SXid" in tally.freeze().examples[sx.SKIP_UNPARSABLE]


def test_a_dictionary_line_that_mentions_an_sxid_is_no_record() -> None:
    text = _kmsg(1, "usb 1-1: new device") + " DEVICE=nvidia-nvswitch0: SXid (PCI:0000:c3:00.0)\n"
    tally = SkipTally()
    assert sx.parse_kmsg_sxid(text, tally) == ()
    assert not tally


def test_huge_lines() -> None:
    huge_sxid = FATAL_LINE + "x" * (1 << 20)
    huge_other = "y" * (1 << 20)
    tally = SkipTally()
    [record] = sx.parse_kmsg_sxid(f"{huge_sxid}\n{huge_other}\n{NONFATAL_LINE}\n", tally)
    assert record.sxid == 20009
    assert _skips(tally) == {sx.SKIP_TOO_LONG: 1}
    # A long message within a record's size is kept, cut to the bound.
    [long] = sx.parse_kmsg_sxid(FATAL_LINE + " z" * 1000)
    assert len(long.message) == MESSAGE_CHARS


def test_control_characters_never_reach_the_message() -> None:
    [record] = sx.parse_kmsg_sxid(FATAL_LINE + " \x1b[31mred\x07")
    assert record.message.isprintable() and "red" in record.message


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_fuzz_any_text_never_raises(text: str) -> None:
    tally = SkipTally()
    records = sx.parse_kmsg_sxid(text, tally)
    lines = [line for line in text.split("\n") if "SXid (" in line]
    assert len(records) + sum(tally.freeze().counts.values()) <= len(lines)
    for record in records:
        assert len(record.message) <= MESSAGE_CHARS and record.message.isprintable()


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["", "3,1,2,-;", "11,1,2,-;", "[  1.0] ", "<3>", "<30>"]),
            # No 'S' or 'D': no tail can spell a continuation line, so every line is either
            # a record or a counted skip.
            st.text(alphabet="0123456789abcdefPCI:.,() \tFatlNon-kx\x00\u2028", max_size=60),
        ),
        max_size=8,
    )
)
def test_fuzz_every_sxid_line_is_a_record_or_a_counted_skip(
    lines: list[tuple[str, str]],
) -> None:
    text = "\n".join(f"{prefix}nvidia-nvswitch0: SXid ({tail}" for prefix, tail in lines)
    tally = SkipTally()
    records = sx.parse_kmsg_sxid(text, tally)
    assert len(records) + sum(tally.freeze().counts.values()) == len(lines)


# --- the reader -------------------------------------------------------------------------------


def test_reader_keeps_a_partial_last_line_of_a_regular_file(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_text(_kmsg(1, FATAL_LINE) + "3,2,3,-;nvidia-nvswitch0: SXid (PCI:0000:c3")
    reader = sx.BoundedKmsgReader(path)
    try:
        first = reader.read_new()
        assert first.splitlines() == [_kmsg(1, FATAL_LINE).rstrip("\n")]
        assert not reader.behind
        with path.open("a") as f:
            f.write(":00.0): 20009, Non-fatal, Link 28 RX Short Error Rate\n")
        [record] = sx.parse_kmsg_sxid(reader.read_new())
        assert (record.sequence, record.sxid, record.link) == (2, 20009, 28)
        assert reader.read_new() == ""
    finally:
        reader.close()


def test_reader_on_a_fifo(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    os.mkfifo(path)
    reader = sx.BoundedKmsgReader(path)
    try:
        assert reader.read_new() == ""  # no writer yet: end of file, nothing kept
        writer = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(writer, _kmsg(1, NONFATAL_LINE).encode()[:40])
            assert reader.read_new() == ""  # the partial line waits
            assert not reader.behind  # EAGAIN: nothing more was waiting
            os.write(writer, _kmsg(1, NONFATAL_LINE).encode()[40:])
            [record] = sx.parse_kmsg_sxid(reader.read_new())
            assert record.sxid == 20009 and record.sequence == 1
        finally:
            os.close(writer)
    finally:
        reader.close()


def test_reader_reads_a_flood_in_bounded_steps(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    lines = [_kmsg(n, FATAL_LINE) for n in range(1, 30001)]
    path.write_text("".join(lines))
    assert path.stat().st_size > 3 << 20
    reader = sx.BoundedKmsgReader(path, max_bytes=64 << 10)
    seen: list[int] = []
    try:
        for _ in range(1000):
            text = reader.read_new()
            assert len(text) <= (64 << 10) + sx.READ_CHUNK
            seen.extend(r.sequence or 0 for r in sx.parse_kmsg_sxid(text))
            if not reader.behind:
                break
    finally:
        reader.close()
    assert seen == list(range(1, 30001))  # nothing lost, nothing twice, in order


def test_reader_drops_a_partial_line_longer_than_any_record(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_bytes(b"3,1,2,-;" + b"x" * 500)
    reader = sx.BoundedKmsgReader(path, max_line=100)
    try:
        assert reader.read_new() == ""
        assert reader.long_lines == 1
        with path.open("ab") as f:
            f.write(b"still the long line\n" + _kmsg(2, FATAL_LINE).encode())
        [record] = sx.parse_kmsg_sxid(reader.read_new())
        assert record.sequence == 2
    finally:
        reader.close()


def test_reader_replaces_bytes_that_are_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_bytes(_kmsg(1, FATAL_LINE).encode().replace(b"timeout", b"time\xff\xfeout"))
    reader = sx.BoundedKmsgReader(path)
    try:
        [record] = sx.parse_kmsg_sxid(reader.read_new())
    finally:
        reader.close()
    assert record.sxid == 24007 and "time\ufffd\ufffdout" in record.message


# --- the source -------------------------------------------------------------------------------


#: The NVSwitches of the source tests' node, as sysfs shows them.
NVSWITCHES = ("0000:05:00.0", "0000:c3:00.0")


def _pci_function(root: Path, bdf: str, vendor: str = "0x10de", klass: str = "0x068000") -> None:
    device = root / "sys" / "bus" / "pci" / "devices" / bdf
    device.mkdir(parents=True)
    (device / "vendor").write_text(vendor + "\n")
    (device / "class").write_text(klass + "\n")


@pytest.fixture
def kmsg_root(tmp_path: Path) -> Iterator[tuple[Path, Roots]]:
    (tmp_path / "dev").mkdir()
    path = tmp_path / "dev" / "kmsg"
    path.write_text("")
    for bdf in NVSWITCHES:
        _pci_function(tmp_path, bdf)
    yield path, Roots.under(tmp_path)


def _append(path: Path, text: str) -> None:
    with path.open("a") as f:
        f.write(text)


def test_source_counts_per_switch_code_and_link(kmsg_root: tuple[Path, Roots]) -> None:
    path, roots = kmsg_root
    _append(path, _kmsg(1, FATAL_LINE) + _kmsg(2, SEVERITY_LINE) + _kmsg(3, DATA_LINE))
    _append(path, _kmsg(4, NONFATAL_LINE) + _kmsg(5, NONFATAL_LINE) + _kmsg(6, "garbage SXid ("))
    src = sx.make_source()
    try:
        assert src.name == SXID.name == "sxid"
        data = src.collect(roots)
        assert data.counts == (
            SxidCount("0000:05:00.0", "nvswitch3", 24007, True, 30, 1, "sourcetrack timeout error"),
            SxidCount("0000:c3:00.0", "nvswitch0", 20009, False, 28, 2, "RX Short Error Rate"),
        )
        assert dict(data.skipped.counts) == {sx.SKIP_UNPARSABLE: 1}
        assert (data.dropped, data.lost, data.behind) == (0, 0, False)
        _append(path, _kmsg(7, FATAL_LINE.replace("Link 30", "Link 31")))
        again = src.collect(roots)
        assert [(c.link, c.count) for c in again.counts] == [(30, 1), (31, 1), (28, 2)]
        assert not again.skipped  # skips are per run
    finally:
        src.close()


def test_source_bounds_its_keys_and_counts_what_it_dropped(
    kmsg_root: tuple[Path, Roots],
) -> None:
    path, roots = kmsg_root
    text = "".join(_kmsg(n, NONFATAL_LINE.replace("Link 28", f"Link {n}")) for n in range(1, 11))
    _append(path, text + _kmsg(11, NONFATAL_LINE.replace("Link 28", "Link 1")))
    src = sx.SxidSource(max_keys=4)
    try:
        data = src.collect(roots)
    finally:
        src.close()
    assert [(c.link, c.count) for c in data.counts] == [(1, 2), (2, 1), (3, 1), (4, 1)]
    assert data.dropped == 6  # a key already held still counts


def test_source_reads_a_flood_over_several_runs(kmsg_root: tuple[Path, Roots]) -> None:
    path, roots = kmsg_root
    _append(path, "".join(_kmsg(n, FATAL_LINE) for n in range(1, 5001)))
    src = sx.SxidSource(max_read_bytes=32 << 10)
    try:
        first = src.collect(roots)
        assert first.behind and 0 < first.counts[0].count < 5000
        for _ in range(100):
            data = src.collect(roots)
            if not data.behind:
                break
    finally:
        src.close()
    assert data.counts[0].count == 5000


def test_source_reopened_counts_no_record_twice(kmsg_root: tuple[Path, Roots]) -> None:
    path, roots = kmsg_root
    _append(path, _kmsg(10, FATAL_LINE) + _kmsg(11, FATAL_LINE))
    src = sx.make_source()
    try:
        assert src.collect(roots).counts[0].count == 2
        src.close()
        # Opened again, /dev/kmsg hands out its ring buffer from the start.
        _append(path, _kmsg(12, FATAL_LINE))
        assert src.collect(roots).counts[0].count == 3
    finally:
        src.close()


def test_a_read_error_takes_the_source_down_until_the_log_reads_again(
    tmp_path: Path,
) -> None:
    kmsg = tmp_path / "dev" / "kmsg"
    kmsg.mkdir(parents=True)  # opens, and every read fails (EISDIR)
    _pci_function(tmp_path, "0000:05:00.0")
    roots = Roots.under(tmp_path)
    src = sx.make_source()
    try:
        with pytest.raises(IsADirectoryError):
            src.collect(roots)
        kmsg.rmdir()
        kmsg.write_text(_kmsg(1, FATAL_LINE))
        assert src.collect(roots).counts[0].count == 1
    finally:
        src.close()


def test_source_without_a_kernel_log_raises(tmp_path: Path) -> None:
    src = sx.make_source()
    try:
        with pytest.raises(FileNotFoundError):
            src.collect(Roots.under(tmp_path))
    finally:
        src.close()


# --- the detector -----------------------------------------------------------------------------

SW0 = "0000:c3:00.0"
SW3 = "0000:05:00.0"
CONFIG = default_config()


def _data(*counts: SxidCount) -> SxidData:
    return SxidData(counts=counts)


def _fatal(count: int, link: int | None = 30) -> SxidCount:
    return SxidCount(SW3, "nvswitch3", 24007, True, link, count, "sourcetrack timeout error")


def _nonfatal(count: int, link: int | None = 28, fatal: bool | None = False) -> SxidCount:
    return SxidCount(SW0, "nvswitch0", 20009, fatal, link, count, "RX Short Error Rate")


def _snapshot(
    now: SxidData | None, before: SxidData | None = None, failed: bool = False
) -> Snapshot:
    previous = {}
    if before is not None or failed:
        previous = {"sxid": SourceSample("sxid", 10.0, 0.01, before, None if before else "down")}
    current = {"sxid": SourceSample("sxid", 20.0, 0.01, now)}
    return Snapshot(2, 20.0, 1e9, current, previous)


def test_a_new_fatal_sxid_is_critical_and_says_drain() -> None:
    [finding] = sxids.detect(None, _snapshot(_data(_fatal(3)), _data(_fatal(1))))
    assert finding.kind == sxids.FATAL and finding.severity is Severity.CRITICAL
    assert finding.subjects == {"nvswitch": SW3, "sxid": "24007"}
    assert finding.evidence == {"sxid": 24007.0, "new_sxids": 2.0, "sxids_since_start": 3.0}
    assert finding.message.startswith(
        "SXid 24007 ×2 (fatal) on NVSwitch 0000:05:00.0 (nvswitch3) link 30:"
        " sourcetrack timeout error; action: drain the node"
    )
    assert "fabric manager restart or node reboot" in finding.message


def test_a_new_nonfatal_sxid_is_a_warning() -> None:
    [finding] = sxids.detect(None, _snapshot(_data(_nonfatal(1)), _data()))
    assert finding.kind == sxids.NONFATAL and finding.severity is Severity.WARNING
    assert finding.subjects == {"nvswitch": SW0, "sxid": "20009"}
    assert "(non-fatal)" in finding.message and "link 28: RX Short Error Rate" in finding.message


def test_an_sxid_without_a_stated_severity_is_a_warning_that_says_so() -> None:
    count = SxidCount("0004:00:00.0", "nvswitch0", 26007, None, None, 1, "SOE EXTERR")
    [finding] = sxids.detect(None, _snapshot(_data(count), _data()))
    assert finding.kind == sxids.NONFATAL and finding.severity is Severity.WARNING
    assert "(severity not stated) on NVSwitch 0004:00:00.0 (nvswitch0): SOE EXTERR" in (
        finding.message
    )


def test_links_of_one_switch_and_code_make_one_finding() -> None:
    before = _data(_fatal(1, link=30))
    now = _data(_fatal(2, link=30), _fatal(4, link=12), _nonfatal(5))
    found = sxids.detect(None, _snapshot(now, before))
    assert [(f.kind, f.subjects["nvswitch"]) for f in found] == [
        (sxids.FATAL, SW3),
        (sxids.NONFATAL, SW0),
    ]
    fatal = found[0]
    assert fatal.evidence["new_sxids"] == 5 and fatal.evidence["sxids_since_start"] == 6
    assert " links 12, 30:" in fatal.message


def test_a_count_that_did_not_grow_is_no_finding() -> None:
    same = _data(_fatal(2), _nonfatal(7))
    assert sxids.detect(None, _snapshot(same, same)) == []


def test_first_read_counts_everything_it_holds() -> None:
    found = sxids.detect(None, _snapshot(_data(_fatal(1), _nonfatal(2))))
    assert {f.kind for f in found} == {sxids.FATAL, sxids.NONFATAL}


def test_a_read_after_a_failed_one_proves_nothing_new() -> None:
    assert sxids.detect(None, _snapshot(_data(_fatal(1)), failed=True)) == []
    assert sxids.detect(None, _snapshot(None, _data(_fatal(1)))) == []


def test_a_restarted_source_counts_from_zero() -> None:
    [finding] = sxids.detect(None, _snapshot(_data(_fatal(1)), _data(_fatal(9))))
    assert finding.evidence["new_sxids"] == 1


def test_alert_rules_fire_at_once_and_hold() -> None:
    assert set(sxids.RULES) == set(sxids.KINDS)
    fatal, nonfatal = sxids.RULES[sxids.FATAL], sxids.RULES[sxids.NONFATAL]
    assert fatal.for_seconds == 0.0 and nonfatal.for_seconds == 0.0
    assert fatal.resolve_after_seconds == sxids.FATAL_HOLD_SECONDS
    assert nonfatal.resolve_after_seconds == sxids.HOLD_SECONDS
    assert sxids.FATAL_HOLD_SECONDS > sxids.HOLD_SECONDS


def test_source_to_detector(kmsg_root: tuple[Path, Roots]) -> None:
    """Two reads of the source over a kernel log: the second read's new SXids are the
    finding, and the driver's continuation lines add nothing."""
    path, roots = kmsg_root
    _append(path, _kmsg(1, FATAL_LINE) + _kmsg(2, SEVERITY_LINE) + _kmsg(3, DATA_LINE))
    src = sx.make_source()
    try:
        before = src.collect(roots)
        _append(path, _kmsg(4, FATAL_LINE) + _kmsg(5, SEVERITY_LINE) + _kmsg(6, DATA_LINE))
        now = src.collect(roots)
    finally:
        src.close()
    [finding] = sxids.detect(None, _snapshot(now, before))
    assert finding.kind == sxids.FATAL
    assert finding.evidence["new_sxids"] == 1 and finding.evidence["sxids_since_start"] == 2


# --- metrics --------------------------------------------------------------------------------


def test_sxid_metrics_render_every_key_and_pass_promtool() -> None:
    import shutil
    import subprocess

    from nodescope_exporters import event_metrics
    from tests.unit.exposition_helpers import exposition, sample_values

    data = SxidData(
        (
            SxidCount("0000:05:00.0", "nvswitch3", 24007, True, 30, 2, "Fatal, Link 30"),
            SxidCount("0000:05:00.0", "nvswitch3", 20009, False, None, 5, "Non-fatal"),
            SxidCount("0000:06:00.0", "nvswitch4", 26007, None, None, 1, "SOE EXTERR"),
        ),
        dropped=3,
        lost=1,
    )
    snapshot = Snapshot(1, 10.0, 1e9, {"sxid": SourceSample("sxid", 10.0, 0.01, data)})

    text = exposition(event_metrics.families(snapshot))
    values = sample_values(text)
    name = "nodescope_nvswitch_sxid_errors_total"
    assert values[(name, (("link", "30"), ("nvswitch", "0000:05:00.0"), ("severity", "fatal"),
                          ("sxid", "24007")))] == 2  # fmt: skip
    assert values[(name, (("link", ""), ("nvswitch", "0000:05:00.0"), ("severity", "nonfatal"),
                          ("sxid", "20009")))] == 5  # fmt: skip
    assert values[(name, (("link", ""), ("nvswitch", "0000:06:00.0"), ("severity", "unstated"),
                          ("sxid", "26007")))] == 1  # fmt: skip
    assert values[("nodescope_nvswitch_sxid_dropped_total", ())] == 3
    assert values[("nodescope_kmsg_records_lost_total", ())] == 1
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed (scripts/test.sh installs Debian's prometheus)")
    lint = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_no_sxid_record_no_sxid_series() -> None:
    from nodescope_exporters import event_metrics

    snapshot = Snapshot(1, 10.0, 1e9, {})
    names = {family.name for family in event_metrics.families(snapshot)}
    assert not any("sxid" in name or "kmsg" in name for name in names)


def test_an_sxid_of_an_address_that_is_no_nvswitch_of_the_node_is_skipped(
    kmsg_root: tuple[Path, Roots],
) -> None:
    """Only an NVSwitch in sysfs makes a count: an address no device has, or a function that
    is not an NVIDIA bridge, is skipped and counted, and adds no key (so no series)."""
    path, roots = kmsg_root
    _pci_function(roots.sysfs.parent, "0000:9b:00.0", klass="0x030200")  # a GPU
    _pci_function(roots.sysfs.parent, "0000:a0:00.0", vendor="0x15b3", klass="0x068000")
    lines = [FATAL_LINE.replace("0000:05:00.0", bdf) for bdf in ("0000:9b:00.0", "0000:a0:00.0")]
    invented = [f"0000:{bus:02x}:00.0" for bus in range(0x20, 0x40)]
    lines += [FATAL_LINE.replace("0000:05:00.0", bdf) for bdf in invented]
    _append(path, "".join(_kmsg(n, line) for n, line in enumerate(lines, start=1)))
    _append(path, _kmsg(100, FATAL_LINE))
    src = sx.make_source()
    try:
        data = src.collect(roots)
    finally:
        src.close()
    assert [(c.nvswitch, c.count) for c in data.counts] == [("0000:05:00.0", 1)]
    assert dict(data.skipped.counts) == {sx.SKIP_UNKNOWN_NVSWITCH: len(lines)}


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        # The kernel's segfault report of a binary named after the driver's line.
        (
            f"6,9,9,-;nvidia-nvswitch[77]: segfault at 0 ip 1 sp 2 error 4 in {FATAL_LINE}[5+1]",
            sx.SKIP_LEVEL,
        ),
        (f"3,9,9,-;tmpfs: Unknown parameter '{FATAL_LINE.split(',')[0]}'", sx.SKIP_UNPARSABLE),
        (f"3,9,9,-;x {FATAL_LINE}", sx.SKIP_UNPARSABLE),
        (f"[  1.5] someone: {FATAL_LINE}", sx.SKIP_UNPARSABLE),
        (f"6,9,9,-;{FATAL_LINE}", sx.SKIP_LEVEL),
        (f"12,9,9,-;{FATAL_LINE}", sx.SKIP_NOT_KERNEL),
        # Not the driver's exact form: capitals in the address, a code of four digits.
        (FATAL_LINE.replace("0000:05:00.0", "0000:0A:00.0"), sx.SKIP_UNPARSABLE),
        (FATAL_LINE.replace("24007", "2400"), sx.SKIP_UNPARSABLE),
    ],
)
def test_an_sxid_line_not_at_the_start_of_a_driver_record_is_skipped(
    line: str, reason: str
) -> None:
    tally = SkipTally()
    [record] = sx.parse_kmsg_sxid(f"{line}\n{_kmsg(10, NONFATAL_LINE)}", tally)
    assert record.sequence == 10
    assert _skips(tally) == {reason: 1}


@settings(max_examples=300, deadline=None)
@given(
    # Never a leading space: a line that starts " KEY=" is a /dev/kmsg dictionary line.
    st.text(alphabet="abcxyz0123456789 :[]()=,'.-_\t", max_size=40).map(lambda t: "x" + t),
    st.sampled_from(["3,7,9,-;", "<3>", "", "[  1.0] "]),
)
def test_fuzz_a_driver_line_inside_a_message_is_never_an_sxid(before: str, prefix: str) -> None:
    """The driver's exact line after any other text of the record (a file name, a mount
    option): never an SXid, always one counted skip."""
    tally = SkipTally()
    assert sx.parse_kmsg_sxid(f"{prefix}{before}{FATAL_LINE}", tally) == ()
    assert sum(tally.freeze().counts.values()) == 1


def _segfault(seq: int, pid: int, comm: str = "python3", prio: int = 6) -> str:
    return (
        f"{prio},{seq},{seq * 1000},-;{comm}[{pid}]: segfault at 0 ip 00007f3a1c2b4d10"
        " sp 00007ffd5e1f2a40 error 4 in libc.so.6[7f3a1c200000+195000]\n"
    )


def test_source_keeps_the_latest_process_ends_bounded_and_once(
    kmsg_root: tuple[Path, Roots],
) -> None:
    path, roots = kmsg_root
    # A forged record (facility 1) beside the kernel's own and an SXid: one read for both.
    _append(path, _segfault(1, 4242) + _segfault(2, 4243, prio=14) + _kmsg(3, FATAL_LINE))
    src = sx.SxidSource(max_ends=3)
    try:
        data = src.collect(roots)
        assert [(e.pid, e.comm, e.signal, e.cause) for e in data.ended] == [
            (4242, "python3", "SIGSEGV", "segfault")
        ]
        assert data.counts[0].count == 1 and data.ended_dropped == 0
        assert data.skipped.counts.get("process_end_not_from_kernel") == 1
        _append(path, "".join(_segfault(seq, 5000 + seq) for seq in range(4, 8)))
        data = src.collect(roots)
        # The latest three, oldest first; the two older ones dropped and counted.
        assert [e.pid for e in data.ended] == [5005, 5006, 5007]
        assert data.ended_dropped == 2
        # Opened again, /dev/kmsg hands out its ring buffer from the start: nothing twice.
        src.close()
        _append(path, _segfault(8, 6000))
        data = src.collect(roots)
        assert [e.pid for e in data.ended] == [5006, 5007, 6000]
        assert data.ended_dropped == 3
    finally:
        src.close()
