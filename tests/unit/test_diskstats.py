"""The disks source: /proc/diskstats parsing, whole-disk selection, the NVMe → PCI mapping, the
iostat -dxm figures and the disk metrics."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope import jsonout
from nodescope.errors import ParseError
from nodescope.model.skips import SkipTally
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.roots import Roots
from nodescope.sources.diskstats import (
    COUNTER_FIELDS,
    SKIP_LINE_UNPARSABLE,
    SKIP_UPTIME_UNPARSABLE,
    DisksData,
    DisksSource,
    DiskStat,
    NvmePath,
    disk_figures,
    iostat_figures,
    make_source,
    parse_diskstat_line,
    parse_diskstats,
    parse_uptime,
    read_disks,
    read_nvme_namespace,
    select_whole_disks,
    since_boot,
)
from nodescope.sources.registry import SOURCES
from nodescope_exporters import disk_metrics
from nodescope_exporters.prometheus import render
from tests.conftest import HOST_FIXTURE

LINE_20 = "259       0 nvme0n1 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27"
LINE_18 = "8 0 sda 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15"
LINE_14 = "8 16 sdb 1 2 3 4 5 6 7 8 9 10 11"


# ---------------------------------------------------------------------------------------------
# parse_diskstats


def test_twenty_token_line_names_every_field() -> None:
    (s,) = parse_diskstats(LINE_20)
    assert (s.major, s.minor, s.name) == (259, 0, "nvme0n1")
    assert [getattr(s, f) for f in COUNTER_FIELDS] == list(range(11, 28))
    assert s.reads_completed == 11 and s.reads_merged == 12 and s.sectors_read == 13
    assert s.read_ms == 14 and s.writes_completed == 15 and s.writes_merged == 16
    assert s.sectors_written == 17 and s.write_ms == 18 and s.in_flight == 19
    assert s.io_ms == 20 and s.weighted_io_ms == 21
    assert (s.discards_completed, s.discards_merged, s.sectors_discarded, s.discard_ms) == (
        22,
        23,
        24,
        25,
    )
    assert (s.flushes_completed, s.flush_ms) == (26, 27)
    # 512-byte sectors whatever the device's block size.
    assert s.bytes_read == 13 * 512 and s.bytes_written == 17 * 512
    assert s.bytes_discarded == 24 * 512


def test_eighteen_token_line_has_no_flushes() -> None:
    (s,) = parse_diskstats(LINE_18)
    assert s.sectors_discarded == 14 and s.discard_ms == 15
    assert s.flushes_completed is None and s.flush_ms is None


def test_fourteen_token_line_has_no_discards_or_flushes() -> None:
    (s,) = parse_diskstats(LINE_14)
    assert s.weighted_io_ms == 11
    assert s.discards_completed is None and s.sectors_discarded is None
    assert s.bytes_discarded is None
    assert s.flushes_completed is None


def test_longer_lines_from_newer_kernels_keep_the_known_fields() -> None:
    (s,) = parse_diskstats(LINE_20 + " 99 98")
    assert s.flush_ms == 27


def test_blank_lines_are_skipped_and_order_is_kept() -> None:
    stats = parse_diskstats(f"\n{LINE_20}\n\n{LINE_14}\n")
    assert [s.name for s in stats] == ["nvme0n1", "sdb"]


def test_device_names_with_a_slash() -> None:
    (s,) = parse_diskstats("104 0 cciss/c0d0 1 2 3 4 5 6 7 8 9 10 11")
    assert s.name == "cciss/c0d0"


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        ("8 0 sda 1 2 3", 1, "expected 14, 18 or 20 fields, got 6"),
        (f"{LINE_14}\n8 0 sda 1 2 3 4 5 6 7 8 9 10 11 12", 2, "got 15"),
        (f"{LINE_14}\n\n8 0 sda {' '.join(['1'] * 16)}", 3, "got 19"),
        ("8 0 sda 1 2 3 4 5 6 7 8 9 10 x1", 1, "weighted_io_ms"),
        ("8 0 sda 1 2 3 -4 5 6 7 8 9 10 11", 1, "read_ms"),
        ("x 0 sda 1 2 3 4 5 6 7 8 9 10 11", 1, "major"),
        ("8 0.5 sda 1 2 3 4 5 6 7 8 9 10 11", 1, "minor"),
        (f"8 0 sda {2**64} 2 3 4 5 6 7 8 9 10 11", 1, "64 bits"),
        (f"8 0 sda {'9' * 5000} 2 3 4 5 6 7 8 9 10 11", 1, "64 bits"),
    ],
)
def test_bad_lines_are_skipped_and_counted_naming_file_and_line(
    text: str, line: int, reason: str
) -> None:
    tally = SkipTally()
    stats = parse_diskstats(f"{text}\n{LINE_20}", source="/x/diskstats", tally=tally)
    # The good line after the bad one is still read.
    assert [s.name for s in stats][-1] == "nvme0n1"
    skipped = tally.freeze()
    assert skipped.counts == {SKIP_LINE_UNPARSABLE: 1}
    example = skipped.examples[SKIP_LINE_UNPARSABLE]
    assert example.startswith(f"/x/diskstats:{line}: ") and reason in example
    raw = text.splitlines()[line - 1]
    with pytest.raises(ParseError) as err:
        parse_diskstat_line(raw, "/x/diskstats", line)
    assert err.value.line == line and err.value.source == "/x/diskstats"


def test_capture_of_this_machine_parses() -> None:
    text = (HOST_FIXTURE / "proc" / "diskstats").read_text()
    stats = parse_diskstats(text, "fixture")
    assert len(stats) == len([ln for ln in text.splitlines() if ln.strip()])
    vda = next(s for s in stats if s.name == "vda")
    assert vda.major == 254
    assert vda.reads_completed > 0 and vda.flushes_completed is not None


# Fuzzing: whatever the text, the parser answers with records and skips, nothing else: each
# non-blank line is either a record or one skip.

_token = st.one_of(
    st.integers(min_value=0, max_value=2**70).map(str),
    st.integers(min_value=-(2**40), max_value=-1).map(str),
    st.text(alphabet="0123456789abcxyz.-/!+ \t", min_size=0, max_size=6),
)
_line = st.lists(_token, min_size=0, max_size=24).map(" ".join)


@settings(max_examples=200, deadline=None)
@given(st.lists(_line, max_size=6).map("\n".join))
def test_fuzz_structured_lines_give_records_and_skips(text: str) -> None:
    tally = SkipTally()
    stats = parse_diskstats(text, tally=tally)
    for s in stats:
        assert all(isinstance(getattr(s, f), int | None) for f in COUNTER_FIELDS)
    lines = [ln for ln in text.splitlines() if ln and not ln.isspace()]
    assert len(stats) + sum(tally.freeze().counts.values()) == len(lines)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_fuzz_any_text_gives_records_and_skips(text: str) -> None:
    tally = SkipTally()
    stats = parse_diskstats(text, tally=tally)
    lines = [ln for ln in text.splitlines() if ln and not ln.isspace()]
    assert len(stats) + sum(tally.freeze().counts.values()) == len(lines)


def test_read_disks_skips_a_malformed_line_and_a_malformed_uptime(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "diskstats").write_text(f"{LINE_14}\n8 16 sdc 1 2 x\n{LINE_20}\n")
    (tmp_path / "proc" / "uptime").write_text("soon\n")
    for disk in ("sdb", "sdc", "nvme0n1"):
        (tmp_path / "sys" / "block" / disk).mkdir(parents=True)
    data = read_disks(Roots.under(tmp_path))
    assert [d.name for d in data.disks] == ["nvme0n1", "sdb"]
    assert data.uptime_seconds is None
    assert data.skipped.counts == {SKIP_LINE_UNPARSABLE: 1, SKIP_UPTIME_UNPARSABLE: 1}
    assert "diskstats:2:" in data.skipped.examples[SKIP_LINE_UNPARSABLE]


# ---------------------------------------------------------------------------------------------
# parse_uptime


def test_uptime() -> None:
    up = parse_uptime("469.71 827.11\n")
    assert up.seconds == pytest.approx(469.71) and up.idle_seconds == pytest.approx(827.11)


@pytest.mark.parametrize("text", ["", "12.5", "1 2 3", "nan 1.0", "-1.00 2.00", "1e5 2"])
def test_bad_uptime(text: str) -> None:
    with pytest.raises(ParseError) as err:
        parse_uptime(text, "/p/uptime")
    assert err.value.source == "/p/uptime" and err.value.line == 1


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_fuzz_uptime_raises_only_parse_error(text: str) -> None:
    try:
        up = parse_uptime(text)
    except ParseError:
        return
    assert up.seconds >= 0


# ---------------------------------------------------------------------------------------------
# whole disks


def _stat(name: str, reads: int = 0, **fields: int) -> DiskStat:
    base = dict.fromkeys(COUNTER_FIELDS[:11], 0)
    base["reads_completed"] = reads
    base.update(fields)
    return DiskStat(8, 0, name, **base)


def test_partitions_are_not_whole_disks() -> None:
    stats = [_stat("sda", 5), _stat("sda1", 5), _stat("nvme0n1", 3), _stat("nvme0n1p1", 3)]
    chosen = select_whole_disks(stats, {"sda", "nvme0n1"})
    assert [s.name for s in chosen] == ["nvme0n1", "sda"]


def test_slash_in_name_matches_bang_in_sysfs() -> None:
    chosen = select_whole_disks([_stat("cciss/c0d0", 1)], {"cciss!c0d0"})
    assert [s.name for s in chosen] == ["cciss/c0d0"]


def test_idle_loop_ram_zram_are_dropped_busy_ones_and_idle_disks_kept() -> None:
    stats = [
        _stat("loop0"),
        _stat("loop1", 4),
        _stat("zram0"),
        _stat("ram0"),
        _stat("sdb"),
        _stat("loopy"),
    ]
    names = {s.name for s in stats}
    chosen = select_whole_disks(stats, names)
    assert [s.name for s in chosen] == ["loop1", "loopy", "sdb"]


def test_zram_used_only_by_writes_is_kept() -> None:
    chosen = select_whole_disks([_stat("zram0", writes_completed=9)], {"zram0"})
    assert [s.name for s in chosen] == ["zram0"]


def test_read_disks_on_this_machine_capture() -> None:
    data = read_disks(Roots.under(HOST_FIXTURE))
    # The capture has vda plus unused loop0-7 and zram0.
    assert [d.name for d in data.disks] == ["vda"]
    assert data.nvme == ()
    up = (HOST_FIXTURE / "proc" / "uptime").read_text().split()[0]
    assert data.uptime_seconds == pytest.approx(float(up))


def test_missing_uptime_is_absent_not_zero(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "diskstats").write_text(LINE_14 + "\n")
    (tmp_path / "sys" / "block" / "sdb").mkdir(parents=True)
    data = read_disks(Roots.under(tmp_path))
    assert data.uptime_seconds is None
    assert [d.name for d in data.disks] == ["sdb"]


def test_missing_diskstats_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_disks(Roots.under(tmp_path))


def test_the_record_serialises_to_plain_values() -> None:
    import dataclasses
    import json

    data = read_disks(Roots.under(HOST_FIXTURE))
    assert json.loads(jsonout.dumps(data))["skipped"] == {"counts": {}, "examples": {}}
    # The disks themselves are plain dataclasses.
    json.dumps([dataclasses.asdict(disk) for disk in data.disks])


# ---------------------------------------------------------------------------------------------
# NVMe mapping on hand-made sysfs trees


def _link(root: Path, path: str, target: str) -> None:
    p = root / path
    p.parent.mkdir(parents=True, exist_ok=True)
    p.symlink_to(target)
    (p.parent / target).resolve().mkdir(parents=True, exist_ok=True)


def _write(root: Path, path: str, text: str) -> None:
    p = root / path
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def _controller(root: Path, port: str, bdf: str, ctrl: str, transport: str = "pcie") -> str:
    """A PCIe NVMe controller under ``port``; returns its sysfs directory (relative)."""
    d = f"sys/devices/pci0000:40/{port}/{bdf}/nvme/{ctrl}"
    (root / d).mkdir(parents=True)
    _link(root, f"{d}/device", f"../../../{bdf}")
    _write(root, f"{d}/address", f"{bdf}\n")
    _write(root, f"{d}/transport", f"{transport}\n")
    return d


def direct_tree(root: Path) -> None:
    """Two drives without native multipath: nvme0 with one namespace, nvme1 with two."""
    for ctrl, bdf, namespaces in (
        ("nvme0", "0000:41:00.0", ["nvme0n1"]),
        ("nvme1", "0000:42:00.0", ["nvme1n1", "nvme1n2"]),
    ):
        d = _controller(root, "0000:40:01.1", bdf, ctrl)
        for ns in namespaces:
            (root / d / ns).mkdir()
            _link(root, f"{d}/{ns}/device", f"../../{ctrl}")
            _link(root, f"sys/block/{ns}", f"../{d.removeprefix('sys/')}/{ns}")


def multipath_tree(root: Path) -> None:
    """Native multipath: subsystem 0 reached through controllers nvme3 and nvme5 (a third,
    nvme6, does not carry the namespace), and a fabrics subsystem 1 over TCP."""
    sub = "sys/devices/virtual/nvme-subsystem/nvme-subsys0"
    (root / sub / "nvme0n1").mkdir(parents=True)
    _link(root, f"{sub}/nvme0n1/device", "../../nvme-subsys0")
    _link(root, "sys/block/nvme0n1", "../devices/virtual/nvme-subsystem/nvme-subsys0/nvme0n1")
    _link(
        root,
        "sys/class/nvme-subsystem/nvme-subsys0",
        "../../devices/virtual/nvme-subsystem/nvme-subsys0",
    )
    for ctrl, bdf, carries in (
        ("nvme3", "0000:81:00.0", True),
        ("nvme5", "0000:c1:00.0", True),
        ("nvme6", "0000:c2:00.0", False),
    ):
        d = _controller(root, "0000:80:01.1", bdf, ctrl)
        if carries:
            (root / d / f"nvme0c{ctrl[4:]}n1").mkdir()
        _link(root, f"{sub}/{ctrl}", "../../../" + d.removeprefix("sys/devices/"))

    fab = "sys/devices/virtual/nvme-subsystem/nvme-subsys1"
    (root / fab / "nvme1n1").mkdir(parents=True)
    _link(root, f"{fab}/nvme1n1/device", "../../nvme-subsys1")
    _link(root, "sys/block/nvme1n1", "../devices/virtual/nvme-subsystem/nvme-subsys1/nvme1n1")
    ctrl_dir = "sys/devices/virtual/nvme-fabrics/ctl/nvme7"
    _write(root, f"{ctrl_dir}/address", "traddr=10.0.0.5,trsvcid=4420\n")
    _write(root, f"{ctrl_dir}/transport", "tcp\n")
    (root / ctrl_dir / "nvme1c7n1").mkdir()
    # No /sys/class/nvme-subsystem link for this one: the subsystem directory itself is listed.
    _link(root, f"{fab}/nvme7", "../../nvme-fabrics/ctl/nvme7")


def test_nvme_without_multipath_maps_disk_to_controller_and_pci_function(
    tmp_path: Path,
) -> None:
    direct_tree(tmp_path)
    roots = Roots.under(tmp_path)
    ns = read_nvme_namespace(roots, "nvme1n2")
    assert ns is not None
    assert ns.subsystem is None
    assert ns.paths == (NvmePath("nvme1", "pcie", "0000:42:00.0", "0000:42:00.0"),)
    ns0 = read_nvme_namespace(roots, "nvme0n1")
    assert ns0 is not None and ns0.paths[0].pci_address == "0000:41:00.0"


def test_pci_address_comes_from_the_device_link_not_only_address(tmp_path: Path) -> None:
    direct_tree(tmp_path)
    # An older kernel without `address`: the realpath of `device` still names the function.
    for p in tmp_path.rglob("address"):
        p.unlink()
    ns = read_nvme_namespace(Roots.under(tmp_path), "nvme0n1")
    assert ns is not None
    assert ns.paths == (NvmePath("nvme0", "pcie", None, "0000:41:00.0"),)


def test_native_multipath_lists_the_subsystem_controllers_carrying_the_namespace(
    tmp_path: Path,
) -> None:
    multipath_tree(tmp_path)
    ns = read_nvme_namespace(Roots.under(tmp_path), "nvme0n1")
    assert ns is not None
    assert ns.subsystem == "nvme-subsys0"
    # The 0 in nvme0n1 is the subsystem: the controllers are nvme3 and nvme5.
    assert [(p.controller, p.pci_address) for p in ns.paths] == [
        ("nvme3", "0000:81:00.0"),
        ("nvme5", "0000:c1:00.0"),
    ]


def test_fabrics_controller_has_an_address_but_no_pci_function(tmp_path: Path) -> None:
    multipath_tree(tmp_path)
    ns = read_nvme_namespace(Roots.under(tmp_path), "nvme1n1")
    assert ns is not None
    assert ns.paths == (NvmePath("nvme7", "tcp", "traddr=10.0.0.5,trsvcid=4420", None),)


def test_non_nvme_disks_have_no_mapping(tmp_path: Path) -> None:
    direct_tree(tmp_path)
    roots = Roots.under(tmp_path)
    assert read_nvme_namespace(roots, "sda") is None
    assert read_nvme_namespace(roots, "nvme9n1") is None
    assert read_nvme_namespace(Roots.under(HOST_FIXTURE), "vda") is None


def _diskstats(root: Path, names: list[str]) -> None:
    lines = [f"259 {i} {n} {i + 1} 0 8 1 0 0 0 0 0 1 1" for i, n in enumerate(names)]
    _write(root, "proc/diskstats", "\n".join(lines) + "\n")
    _write(root, "proc/uptime", "100.00 150.00\n")


def test_source_reads_the_mapping_again_only_when_the_disk_set_changes(tmp_path: Path) -> None:
    multipath_tree(tmp_path)
    direct_tree(tmp_path / "other")
    _diskstats(tmp_path, ["nvme0n1", "nvme0n1p1"])
    roots = Roots.under(tmp_path)
    source = make_source()
    assert isinstance(source, DisksSource)

    first = source.collect(roots)
    second = source.collect(roots)
    assert source.mapping_reads == 1
    assert [n.disk for n in first.nvme] == ["nvme0n1"]
    assert second.nvme == first.nvme

    # Hot-plug: the fabrics disk nvme1n1 appears in diskstats.
    _diskstats(tmp_path, ["nvme0n1", "nvme0n1p1", "nvme1n1"])
    third = source.collect(roots)
    assert source.mapping_reads == 2
    assert [n.disk for n in third.nvme] == ["nvme0n1", "nvme1n1"]

    source.close()
    source.collect(roots)
    assert source.mapping_reads == 3


def test_registry_makes_the_disks_source() -> None:
    source = SOURCES["disks"].make()
    assert source.name == "disks"
    data = source.collect(Roots.under(HOST_FIXTURE))
    assert isinstance(data, DisksData)


# ---------------------------------------------------------------------------------------------
# iostat -dxm figures

PREV = DiskStat(
    259, 0, "nvme0n1",
    reads_completed=1000, reads_merged=100, sectors_read=80_000, read_ms=2000,
    writes_completed=500, writes_merged=500, sectors_written=40_960, write_ms=5000,
    in_flight=2, io_ms=10_000, weighted_io_ms=30_000,
    discards_completed=10, discards_merged=1, sectors_discarded=2048, discard_ms=20,
    flushes_completed=50, flush_ms=25,
)  # fmt: skip
CUR = replace(
    PREV,
    reads_completed=3000, reads_merged=600, sectors_read=80_000 + 409_600, read_ms=5000,
    writes_completed=1500, sectors_written=40_960 + 204_800, write_ms=13_000,
    in_flight=7, io_ms=11_500, weighted_io_ms=34_000,
    discards_completed=20, discards_merged=11, sectors_discarded=2048 + 20_480, discard_ms=50,
    flushes_completed=150, flush_ms=75,
)  # fmt: skip


def test_two_samples_against_a_hand_calculation() -> None:
    f = disk_figures(PREV, CUR, 2.0)
    # Reads: 2000 requests, 500 merges, 409600 sectors (200 MiB), 3000 ms, over 2 s.
    assert f.r_s == 1000.0
    assert f.rmb_s == 100.0
    assert f.rrqm_s == 250.0
    assert f.rrqm_pct == 20.0  # 500 / (500 + 2000)
    assert f.r_await == 1.5  # 3000 ms / 2000
    assert f.rareq_sz == 102.4  # 409600 sectors / 2000 / 2 kB
    # Writes: 1000 requests, no merges, 204800 sectors, 8000 ms.
    assert (f.w_s, f.wmb_s, f.wrqm_s, f.wrqm_pct) == (500.0, 50.0, 0.0, 0.0)
    assert (f.w_await, f.wareq_sz) == (8.0, 102.4)
    # Discards: 10 requests, 10 merges, 20480 sectors, 30 ms.
    assert (f.d_s, f.dmb_s, f.drqm_s, f.drqm_pct) == (5.0, 5.0, 5.0, 50.0)
    assert (f.d_await, f.dareq_sz) == (3.0, 1024.0)
    # Flushes: 100 requests, 50 ms.
    assert (f.f_s, f.f_await) == (50.0, 0.5)
    # 4000 weighted ms and 1500 busy ms over 2000 ms.
    assert f.aqu_sz == 2.0
    assert f.util_pct == 75.0


def test_no_requests_give_zero_ratios_not_errors() -> None:
    f = disk_figures(PREV, PREV, 1.0)
    assert f.r_await == 0.0 and f.rareq_sz == 0.0 and f.rrqm_pct == 0.0
    assert f.d_await == 0.0 and f.f_await == 0.0 and f.util_pct == 0.0


def test_millisecond_fields_wrap_at_2_32() -> None:
    prev = replace(PREV, read_ms=2**32 - 1000, io_ms=2**32 - 500, weighted_io_ms=2**32 - 1)
    cur = replace(CUR, read_ms=2000, io_ms=1000, weighted_io_ms=3999)
    f = disk_figures(prev, cur, 2.0)
    assert f.r_await == 1.5  # 3000 ms over the wrap
    assert f.util_pct == 75.0
    assert f.aqu_sz == 2.0


def test_a_millisecond_field_going_back_without_wrapping_counts_as_no_time() -> None:
    f = disk_figures(replace(PREV, read_ms=5000), replace(CUR, read_ms=100), 2.0)
    assert f.r_await == 0.0
    assert f.r_s == 1000.0


def test_a_reinserted_device_is_measured_from_zero() -> None:
    # The drive went away and came back: every count is lower than before.
    cur = DiskStat(259, 0, "nvme0n1", 10, 0, 80, 5, 4, 0, 16, 2, 0, 20, 30, 0, 0, 0, 0, 2, 1)
    f = disk_figures(CUR, cur, 10.0)
    assert f.r_s == 1.0 and f.w_s == 0.4 and f.f_s == 0.2
    assert f.r_await == 0.5 and f.util_pct == 0.2


def test_fourteen_token_disks_have_no_discard_or_flush_figures() -> None:
    (prev,) = parse_diskstats(LINE_14)
    cur = replace(prev, reads_completed=11)
    f = disk_figures(prev, cur, 1.0)
    assert f.r_s == 10.0
    assert f.d_s is None and f.dmb_s is None and f.d_await is None and f.dareq_sz is None
    assert f.f_s is None and f.f_await is None


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError):
        disk_figures(PREV, CUR, 0.0)


def test_report_covers_disks_present_in_both_samples() -> None:
    sdb = _stat("sdb", 4)
    prev = DisksData(disks=(PREV, _stat("gone", 1)))
    cur = DisksData(disks=(CUR, sdb))
    report = iostat_figures(prev, cur, 2.0)
    assert [f.device for f in report.devices] == ["nvme0n1"]
    assert report.seconds == 2.0


def test_since_boot_is_the_average_over_uptime() -> None:
    cur = DisksData(disks=(CUR,), uptime_seconds=500.0)
    zero = since_boot(cur)
    assert all(getattr(zero.disks[0], f) == 0 for f in COUNTER_FIELDS)
    (f,) = iostat_figures(zero, cur, 500.0).devices
    assert f.r_s == 6.0  # 3000 reads in 500 s
    assert f.util_pct == 2.3  # 11.5 s busy in 500 s
    # Absent fields stay absent in the zero sample.
    (old,) = parse_diskstats(LINE_14)
    assert since_boot(DisksData(disks=(old,))).disks[0].discards_completed is None


_counts = st.integers(min_value=0, max_value=2**64 - 1)
_ms = st.integers(min_value=0, max_value=2**32 - 1)


@st.composite
def _disk(draw: st.DrawFn) -> DiskStat:
    values = {f: draw(_ms if f.endswith("_ms") else _counts) for f in COUNTER_FIELDS}
    return DiskStat(8, 0, "sda", **values)


@settings(max_examples=200, deadline=None)
@given(_disk(), _disk(), st.floats(min_value=0.001, max_value=1e6))
def test_figures_of_any_two_samples_are_finite_and_not_negative(
    prev: DiskStat, cur: DiskStat, seconds: float
) -> None:
    f = disk_figures(prev, cur, seconds)
    for name in f.__dataclass_fields__:
        value = getattr(f, name)
        if isinstance(value, float):
            assert value >= 0.0 and value == value and value != float("inf")


def test_a_snapshot_derives_iostat_figures_from_its_two_reads() -> None:
    snap = Snapshot(
        cycle=2,
        monotonic=12.0,
        wall_time=0.0,
        current={"disks": SourceSample("disks", 12.0, 0.0, DisksData(disks=(CUR,)))},
        previous={"disks": SourceSample("disks", 10.0, 0.0, DisksData(disks=(PREV,)))},
    )
    report = snap.derived.disk_rates
    assert report is not None
    assert report.devices[0].r_s == 1000.0


# ---------------------------------------------------------------------------------------------
# metrics


def _snapshot(data: DisksData | None) -> Snapshot:
    current = {} if data is None else {"disks": SourceSample("disks", 1.0, 0.0, data)}
    return Snapshot(cycle=1, monotonic=1.0, wall_time=0.0, current=current)


def _series(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_export_raw_counters_in_bytes_and_seconds(tmp_path: Path) -> None:
    multipath_tree(tmp_path)
    (old,) = parse_diskstats(LINE_14)
    nvme = read_nvme_namespace(Roots.under(tmp_path), "nvme0n1")
    assert nvme is not None
    data = DisksData(disks=(replace(CUR, name="nvme0n1"), old), nvme=(nvme,))
    text = render(_snapshot(data), [disk_metrics.families]).decode()
    s = _series(text)
    assert s['nodescope_disk_reads_completed_total{device="nvme0n1"}'] == 3000
    assert s['nodescope_disk_read_bytes_total{device="nvme0n1"}'] == 489_600 * 512
    assert s['nodescope_disk_written_bytes_total{device="sdb"}'] == 7 * 512
    assert s['nodescope_disk_read_time_seconds_total{device="nvme0n1"}'] == 5.0
    assert s['nodescope_disk_io_time_seconds_total{device="nvme0n1"}'] == 11.5
    assert s['nodescope_disk_io_time_weighted_seconds_total{device="nvme0n1"}'] == 34.0
    assert s['nodescope_disk_io_in_flight_requests{device="nvme0n1"}'] == 7
    assert s['nodescope_disk_discarded_bytes_total{device="nvme0n1"}'] == 22_528 * 512
    assert s['nodescope_disk_flush_requests_total{device="nvme0n1"}'] == 150
    assert s['nodescope_disk_flush_requests_time_seconds_total{device="nvme0n1"}'] == 0.075
    # sdb's kernel reports no discards or flushes: no series rather than zeros.
    assert 'nodescope_disk_discards_completed_total{device="sdb"}' not in s
    assert 'nodescope_disk_flush_requests_total{device="sdb"}' not in s
    assert "# TYPE nodescope_disk_reads_completed_total counter" in text
    assert "# TYPE nodescope_disk_io_in_flight_requests gauge" in text
    # One info series per path of the multipath namespace.
    info = {k: v for k, v in s.items() if k.startswith("nodescope_disk_info")}
    assert info == {
        'nodescope_disk_info{controller="nvme3",device="nvme0n1",pci_address="0000:81:00.0"}': 1,
        'nodescope_disk_info{controller="nvme5",device="nvme0n1",pci_address="0000:c1:00.0"}': 1,
    }
    promtool = shutil.which("promtool")
    if promtool is not None:
        check = subprocess.run(
            [promtool, "check", "metrics"], input=text, capture_output=True, text=True
        )
        assert check.returncode == 0, check.stdout + check.stderr


def test_metrics_on_this_machine_capture() -> None:
    data = read_disks(Roots.under(HOST_FIXTURE))
    s = _series(render(_snapshot(data), [disk_metrics.families]).decode())
    vda = data.disks[0]
    assert s['nodescope_disk_read_bytes_total{device="vda"}'] == vda.sectors_read * 512
    assert not any(k.startswith("nodescope_disk_info") for k in s)
    assert not any('device="loop0"' in k for k in s)


def test_no_disk_data_means_no_families() -> None:
    assert list(disk_metrics.families(_snapshot(None))) == []
    empty = list(disk_metrics.families(_snapshot(DisksData(disks=()))))
    assert empty == []


def test_metric_names_follow_the_conventions() -> None:
    from nodescope_exporters.catalog import CATALOG

    mine = [spec for spec in CATALOG.values() if spec.area == "disks"]
    assert len(mine) == 18
    for spec in mine:
        assert spec.name.startswith("nodescope_disk_")
        assert spec.kind != "counter" or spec.name.endswith("_total")
