"""The nvlink_counter ABI on the host: header <-> cffi layout (checked with gcc), the snapshot
parser and writer, the nvlink_kmod source on snapshot files, its rates, metrics and the NVLink
detector. The module itself is tested in a real kernel by tests/integration/test_kmod_qemu.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope import jsonout
from nodescope import kmod_abi as abi
from nodescope import kmod_abi_build as build
from nodescope.assembly import default_config, from_mapping
from nodescope.collect import Collector
from nodescope.detectors import nvlink as det
from nodescope.errors import ConfigError, ParseError
from nodescope.kmod_abi import NvlcHeader, NvlcRecord, NvlcSnapshot
from nodescope.model.finding import Severity
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.roots import Roots
from nodescope.sources import nvlink_kmod as src
from nodescope_exporters.prometheus import render

REPO = Path(__file__).resolve().parents[2]
HEADER = REPO / "kmod" / "include" / "uapi" / "linux" / "nvlink_counter.h"
U64 = st.integers(0, 2**64 - 1)
U32 = st.integers(0, 2**32 - 1)
GB = 10**9
ALL_COUNTERS = 0x1F << 8


def test_packaged_header_is_the_module_header() -> None:
    assert abi.HEADER_PATH.resolve() == HEADER.resolve()
    assert HEADER.read_text() == abi.HEADER_TEXT


# --------------------------------------------------------------------------------------------
# Layout: what gcc says about the header equals what cffi made of it


def _c_program() -> tuple[str, list[str]]:
    structs = re.findall(r"^struct (\w+) \{", abi.HEADER_TEXT, re.M)
    defines = re.findall(r"^#define (NVLC_\w+) (?:0x[0-9a-fA-F]+|\d+)$", abi.HEADER_TEXT, re.M)
    lines = [
        "#include <stdio.h>",
        "#include <stddef.h>",
        "#include <linux/nvlink_counter.h>",
        "int main(void) {",
    ]
    for s in structs:
        lines.append(f'printf("sizeof {s} %zu\\n", sizeof(struct {s}));')
        for name, _, _ in abi.struct_fields(s):
            lines.append(
                f'printf("field {s}.{name} %zu %zu\\n", offsetof(struct {s}, {name}), '
                f"sizeof(((struct {s} *)0)->{name}));"
            )
    for name in abi.IOCTLS:
        lines.append(f'printf("ioctl {name} %lu\\n", (unsigned long){name});')
    for name in defines:
        lines.append(f'printf("define {name} %llu\\n", (unsigned long long){name});')
    lines += ["return 0;", "}"]
    return "\n".join(lines), structs


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
def test_cffi_layout_equals_the_c_compilers(tmp_path: Path) -> None:
    program, structs = _c_program()
    (tmp_path / "layout.c").write_text(program)
    subprocess.run(
        ["gcc", "-std=c11", "-Wall", "-Werror", f"-I{REPO / 'kmod/include/uapi'}", "-o",
         str(tmp_path / "layout"), str(tmp_path / "layout.c")],
        check=True,
    )  # fmt: skip
    out = subprocess.run([str(tmp_path / "layout")], check=True, capture_output=True, text=True)
    c: dict[str, tuple[int, ...]] = {}
    for line in out.stdout.splitlines():
        kind, name, *values = line.split()
        c[f"{kind} {name}"] = tuple(int(v) for v in values)
    py: dict[str, tuple[int, ...]] = {}
    for s in structs:
        py[f"sizeof {s}"] = (abi.ffi.sizeof(f"struct {s}"),)
        for name, offset, size in abi.struct_fields(s):
            py[f"field {s}.{name}"] = (offset, size)
    for name, number in abi.IOCTLS.items():
        py[f"ioctl {name}"] = (number,)
    for key in c:
        if key.startswith("define "):
            py[key] = (getattr(abi.lib, key.split()[1]),)
    assert len(structs) == 9 and len(abi.IOCTLS) == 6
    assert py == c
    # Every field the C compiler sees is declared to cffi (nothing dropped by the cdef).
    for s in structs:
        body = abi.HEADER_TEXT.split(f"struct {s} {{", 1)[1].split("};", 1)[0]
        c_fields = re.findall(r"__u\d+ (\w+)", body)
        assert c_fields == [n for n, _, _ in abi.struct_fields(s)]


def _without_cffi_version(text: str) -> str:
    # The backend's version number, not the header, decides this line: another cffi release
    # writes another number for the same declarations.
    return re.sub(r"(?m)^    _version = 0x[0-9a-fA-F]+,$", "    _version = ?,", text)


def test_generated_module_matches_the_header() -> None:
    expected = build.generate(HEADER.read_text())
    current = build.MODULE_PATH.read_text()
    assert _without_cffi_version(current) == _without_cffi_version(expected), (
        f"{build.MODULE_PATH.name} is stale: run `{build.REGENERATE}`"
    )
    # A changed header changes the generated text (so the comparison above can fail).
    changed = build.generate(
        HEADER.read_text().replace("__u64 window_ticks;", "__u32 window_ticks;")
    )
    assert _without_cffi_version(changed) != _without_cffi_version(expected)


def test_generated_module_holds_every_define() -> None:
    for name, value in re.findall(
        r"^#define (NVLC_\w+) (0x[0-9a-fA-F]+|\d+)$", abi.HEADER_TEXT, re.M
    ):
        assert getattr(abi.lib, name) == int(value, 0)


def test_import_loads_no_c_parser() -> None:
    code = (
        "import sys, nodescope.sources.nvlink_kmod\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pycparser', 'cffi')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=REPO
    )
    assert out.stdout.strip() == "[]"


def _cffi_bytes(struct: str, record: object) -> bytes:
    """The struct as cffi fills it, field by field: the reference for the struct formats."""
    cdata = abi.ffi.new(f"struct {struct} *")
    for f in dataclasses.fields(record):  # type: ignore[arg-type]
        value = getattr(record, f.name)
        if isinstance(value, tuple):
            target = getattr(cdata, f.name)
            for i, v in enumerate(value):
                target[i] = v
        else:
            setattr(cdata, f.name, value)
    return bytes(abi.ffi.buffer(cdata))


def test_struct_formats_cover_every_byte_cffi_lays_out() -> None:
    for codec, name in ((abi._HEADER, "nvlc_header"), (abi._RECORD, "nvlc_record")):
        assert codec.struct.size == abi.ffi.sizeof(f"struct {name}")
        # A distinct value in every field, to catch a field at the wrong offset.
        fields = abi.struct_fields(name)
        values = {n: (i + 1) * 0x01010101 for i, (n, _, _) in enumerate(fields)}
        kwargs: dict[str, object] = {}
        for f in dataclasses.fields(codec.cls):
            count = codec.counts[f.name]
            base = values[f.name]
            kwargs[f.name] = tuple(base + j for j in range(count)) if count else base
        record = codec.cls(**kwargs)
        data = _cffi_bytes(name, record)
        assert codec.pack(record) == data
        assert codec.unpack_from(data) == record


def test_parsed_records_are_ordinary_frozen_records() -> None:
    record = NvlcRecord(device=2, link=7, counters=(1, 2, 3, 4, 5), util_hist=tuple(range(20)))
    snap = abi.parse_snapshot(abi.encode_snapshot(NvlcHeader(sequence=4), [record]))
    parsed = snap.records[0]
    assert type(parsed) is NvlcRecord and type(snap.header) is NvlcHeader
    assert parsed == record and hash(parsed) == hash(record) and repr(parsed) == repr(record)
    with pytest.raises(dataclasses.FrozenInstanceError):
        parsed.link = 1  # type: ignore[misc]
    assert dataclasses.replace(parsed, link=8).link == 8


def test_out_of_range_values_are_refused() -> None:
    with pytest.raises(OverflowError):
        abi.encode_snapshot(NvlcHeader(), [NvlcRecord(device=2**32)])


def test_ioctl_encoding_is_the_kernels() -> None:
    # _IOR(0xB7, 0, struct nvlc_version) with the 40-byte struct; _IO(0xB7, 5).
    assert abi.IOCTLS["NVLC_IOC_GET_VERSION"] == (2 << 30) | (40 << 16) | (0xB7 << 8)
    assert abi.IOCTLS["NVLC_IOC_CLEAR_SOURCE"] == (0xB7 << 8) | 5
    with pytest.raises(ValueError):
        abi.ioc(1, 0xB7, 0, 1 << 14)


def test_split_header_refuses_what_cffi_cannot_take() -> None:
    with pytest.raises(ValueError, match="cffi cannot take"):
        abi.split_header("#define NVLC_X (1U << 3)\n")
    cdef, ioctls = abi.split_header(
        "#ifndef G\n#define G\n#include <linux/types.h>\nstruct a { __u64 x; };\n"
        "#define A_IOC _IOWR(0xB7, 0x09, struct a)\n#endif\n"
    )
    assert "uint64_t x" in cdef and "#" not in cdef
    assert ioctls == (abi.IoctlDef("A_IOC", "WR", 9, "a"),)


# --------------------------------------------------------------------------------------------
# Parser and writer

records_st = st.builds(
    NvlcRecord,
    device=U32,
    link=U32,
    flags=U32,
    capacity_bps=U64,
    counters=st.tuples(*[U64] * 5),
    samples=U64,
    window_samples=U64,
    window_max_delta=st.tuples(*[U64] * 5),
    window_max_util=U64,
    window_max_stall=U64,
    window_over_stall=U64,
    window_over_util=U64,
    window_util_hist=st.tuples(*[U64] * 20),
    window_stall_hist=st.tuples(*[U64] * 20),
    util_hist=st.tuples(*[U64] * 20),
    stall_hist=st.tuples(*[U64] * 20),
)
header_st = st.builds(
    NvlcHeader,
    flags=U32,
    source=U32,
    sequence=U64,
    ticks=U64,
    timestamp_ns=U64,
    period_ns=U64,
    window_ns=U64,
    window_samples=U64,
    window_ticks=U64,
    stall_threshold=U64,
    util_threshold=U64,
)


@settings(max_examples=100, deadline=None)
@given(header_st, st.lists(records_st, max_size=4))
def test_round_trip(header: NvlcHeader, records: list[NvlcRecord]) -> None:
    data = abi.encode_snapshot(header, records)
    assert len(data) == abi.HEADER_SIZE + len(records) * abi.RECORD_SIZE
    snap = abi.parse_snapshot(data, "x")
    assert snap.header == dataclasses.replace(header, record_count=len(records))
    assert list(snap.records) == records
    assert snap.records == abi.NvlcRecords.of(records)


@settings(max_examples=50, deadline=None)
@given(header_st, st.lists(records_st, max_size=3))
def test_encoding_equals_cffis(header: NvlcHeader, records: list[NvlcRecord]) -> None:
    data = abi.encode_snapshot(header, records)
    full = dataclasses.replace(
        header,
        magic=abi.MAGIC,
        abi_version=abi.ABI_VERSION,
        header_size=abi.HEADER_SIZE,
        record_size=abi.RECORD_SIZE,
        record_count=len(records),
    )
    expected = _cffi_bytes("nvlc_header", full) + b"".join(
        _cffi_bytes("nvlc_record", r) for r in records
    )
    assert data == expected


def test_encode_refuses_wrong_array_lengths() -> None:
    with pytest.raises(ValueError, match="counters takes 5"):
        abi.encode_snapshot(NvlcHeader(), [NvlcRecord(counters=(1, 2))])


def _raw(header: NvlcHeader, records: list[NvlcRecord]) -> bytearray:
    return bytearray(abi.encode_snapshot(header, records))


@pytest.mark.parametrize(
    ("head_tail", "record_tail"),
    [
        # Whole words: every value is a strided slice of the bytes.
        (16, 24),
        # Sizes off the 8-byte grid: each record is unpacked on its own.
        (12, 20),
        (16, 20),
    ],
)
def test_newer_minor_tails_are_skipped(head_tail: int, record_tail: int) -> None:
    """A newer module with a longer header and longer records."""
    recs = [
        NvlcRecord(
            device=1,
            link=i,
            flags=i * 3,
            counters=(i, 2, 3, 4, 5),
            util_hist=tuple(range(i, i + 20)),
            stall_hist=(2**64 - 1,) * 20,
        )
        for i in range(3)
    ]
    base = abi.encode_snapshot(NvlcHeader(sequence=9), recs)
    head = bytearray(base[: abi.HEADER_SIZE]) + b"\xaa" * head_tail
    head[8:20] = (
        (abi.HEADER_SIZE + head_tail).to_bytes(4, "little")
        + (abi.RECORD_SIZE + record_tail).to_bytes(4, "little")
        + (3).to_bytes(4, "little")
    )
    head[4:8] = (abi.ABI_VERSION + 1).to_bytes(4, "little")
    body = b"".join(
        base[abi.HEADER_SIZE + i * abi.RECORD_SIZE : abi.HEADER_SIZE + (i + 1) * abi.RECORD_SIZE]
        + b"\xbb" * record_tail
        for i in range(3)
    )
    snap = abi.parse_snapshot(bytes(head) + body, "newer")
    assert list(snap.records) == recs
    assert snap.records.util_hist[5] == (5, 6, 7)
    assert snap.header.sequence == 9 and snap.header.header_size == abi.HEADER_SIZE + head_tail


@pytest.mark.parametrize(
    ("offset", "value", "message"),
    [
        (0, 0x12345678, "bad magic"),
        (4, 0x00020000, "major 1 only"),
        (8, 64, "header_size 64"),
        (12, 100, "record_size 100"),
        (16, 3, "header says 3 records"),
    ],
)
def test_bad_snapshots_raise_parse_error(offset: int, value: int, message: str) -> None:
    data = _raw(NvlcHeader(), [NvlcRecord()])
    data[offset : offset + 4] = value.to_bytes(4, "little")
    with pytest.raises(ParseError, match=message) as e:
        abi.parse_snapshot(bytes(data), "/dev/nvlink_stats")
    assert e.value.source == "/dev/nvlink_stats"


def test_short_data_raises_parse_error() -> None:
    with pytest.raises(ParseError, match="shorter than a header"):
        abi.parse_snapshot(b"NVLC", "f")
    data = abi.encode_snapshot(NvlcHeader(), [NvlcRecord()])
    with pytest.raises(ParseError, match="records"):
        abi.parse_snapshot(data[:-1], "f")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=3000))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    with contextlib.suppress(ParseError):
        abi.parse_snapshot(data, "fuzz")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 127 + 2 * 824), st.integers(0, 255)), max_size=8),
    st.integers(0, 2 * abi.RECORD_SIZE + abi.HEADER_SIZE),
)
def test_fuzz_mutated_snapshots(flips: list[tuple[int, int]], cut: int) -> None:
    data = _raw(NvlcHeader(sequence=3), [NvlcRecord(), NvlcRecord(link=1)])
    for pos, byte in flips:
        data[pos] = byte
    try:
        snap = abi.parse_snapshot(bytes(data[:cut] if cut else data), "fuzz")
    except ParseError:
        return
    assert len(snap.records) == snap.header.record_count


def test_write_snapshot_is_atomic_and_readable(tmp_path: Path) -> None:
    path = tmp_path / "nvlink_stats"
    abi.write_snapshot(path, NvlcHeader(sequence=1), [NvlcRecord(link=3)])
    abi.write_snapshot(path, NvlcHeader(sequence=2), [NvlcRecord(link=4)])
    assert [p.name for p in tmp_path.iterdir()] == ["nvlink_stats"]
    snap = src.read_snapshot_file(path)
    assert snap.header.sequence == 2 and snap.records[0].link == 4


# --------------------------------------------------------------------------------------------
# The source on snapshot files (the simulated node's path), rates, metrics


def _record(device: int, link: int, tx: int, stall: int, **kw: object) -> NvlcRecord:
    return NvlcRecord(
        device=device,
        link=link,
        flags=ALL_COUNTERS,
        capacity_bps=25 * GB,
        counters=(tx, tx // 2, stall, 7, 0),
        **kw,  # type: ignore[arg-type]
    )


def _snap(ts: float, seq: int, records: list[NvlcRecord], **kw: int) -> NvlcSnapshot:
    header = NvlcHeader(
        record_count=len(records), source=1, sequence=seq, timestamp_ns=int(ts * 1e9),
        period_ns=100_000, **kw,
    )  # fmt: skip
    return NvlcSnapshot(header, abi.NvlcRecords.of(records))


def test_source_reads_a_snapshot_file_and_reports_absence(tmp_path: Path) -> None:
    source = src.make_source()
    roots = Roots.under(tmp_path)
    absent = source.collect(roots)
    assert absent.kind == "absent" and absent.snapshot is None and not absent.serving
    (tmp_path / "dev").mkdir()
    abi.write_snapshot(tmp_path / "dev" / "nvlink_stats", NvlcHeader(), [_record(0, 1, 5, 6)])
    data = source.collect(roots)
    assert data.kind == "file" and data.serving
    assert data.snapshot is not None and data.snapshot.records[0].counter("stall_cycles") == 6
    (tmp_path / "dev" / "nvlink_stats").write_bytes(b"garbage")
    with pytest.raises(ParseError):
        source.collect(roots)
    source.close()


def test_rates_use_the_module_timestamps() -> None:
    prev = _snap(10.0, 1000, [_record(0, 0, 0, 0)])
    cur = _snap(
        12.0, 21000,
        [_record(0, 0, 20 * GB, 3000 * 2_000_000, window_samples=20000, window_max_util=65536,
                 window_max_stall=9000, window_over_stall=5000)],
        window_ticks=20010, window_samples=20000,
    )  # fmt: skip
    rates = src.snapshot_rates(prev, cur, seconds=5.0)  # the reader's clock is ignored
    assert rates.seconds == 2.0
    assert rates.samples_per_second == 10000.0
    assert rates.missed_ticks == 10
    (lr,) = rates.links
    assert lr.tx_bytes_per_second == 10 * GB
    assert lr.rx_bytes_per_second == 5 * GB
    assert lr.utilisation == pytest.approx(0.4)
    assert lr.stall_cycles_per_microsecond == pytest.approx(3000)
    assert lr.replay_errors_per_second == 0
    assert lr.window_max_utilisation == 1.0
    assert lr.window_stall_over_threshold_ratio == 0.25
    # A counter that went down (module reloaded) gives no rate, not a negative one.
    reset = src.snapshot_rates(cur, _snap(13.0, 5, [_record(0, 0, 1, 1)]), 1.0)
    assert reset.links[0].tx_bytes_per_second is None
    # A link that was not in the previous snapshot has no rates yet.
    new = src.snapshot_rates(prev, _snap(11.0, 2, [_record(0, 9, 1, 1)]), 1.0)
    assert new.links[0].utilisation is None


def test_rates_follow_each_link_when_the_order_or_the_links_change() -> None:
    """Links are matched by (device, link), not by position: a module reloaded with another
    map may list them in another order, add some and drop others."""
    before = [_record(d, n, (d * 10 + n) * GB, n) for d in (0, 1) for n in range(3)]
    after = [
        _record(d, n, (d * 10 + n) * GB + GB * (n + 1), n + 4) for d in (0, 1) for n in range(3)
    ]
    aligned = src.snapshot_rates(_snap(1.0, 1, before), _snap(2.0, 2, after), 1.0)
    assert [lr.tx_bytes_per_second for lr in aligned.links] == [GB * (n + 1) for n in range(3)] * 2
    shuffled = [*reversed(after[1:]), _record(7, 7, 1, 1)]
    moved = src.snapshot_rates(_snap(1.0, 1, before), _snap(2.0, 2, shuffled), 1.0)
    by_link = {(lr.device, lr.link): lr for lr in moved.links}
    for lr in aligned.links[1:]:
        assert by_link[(lr.device, lr.link)] == lr
    assert by_link[(7, 7)].tx_bytes_per_second is None
    assert (0, 0) not in by_link


def test_records_as_columns_give_rows_and_refuse_ragged_columns() -> None:
    recs = [_record(0, n, n * GB, n, window_samples=n) for n in range(4)]
    recs[3] = dataclasses.replace(recs[3], flags=abi.records.LINK_DEVICE_GONE)
    records = abi.NvlcRecords.of(recs)
    assert len(records) == 4 and list(records) == recs
    assert records[-1] == recs[-1] and records[1:3] == recs[1:3]
    assert records.counters[0] == tuple(n * GB for n in range(4))
    assert records.has_counter(0) == (True, True, True, False)
    assert records.device_gone == (False, False, False, True)
    assert abi.NvlcRecords.of([]) == abi.NvlcRecords() and len(abi.NvlcRecords()) == 0
    with pytest.raises(ValueError, match="columns of"):
        dataclasses.replace(records, link=(0, 1, 2))
    with pytest.raises(ValueError, match="util_hist: 19 columns"):
        dataclasses.replace(records, util_hist=records.util_hist[:19])
    # Snapshot JSON writes the records as rows, as it writes every other record.
    written = jsonout.plain(_snap(1.0, 1, recs))["records"]
    assert written == [jsonout.plain(r) for r in recs]
    assert written[2]["counters"] == [2 * GB, GB, 2, 7, 0]


def _collect_twice(tmp_path: Path, first: NvlcSnapshot, second: NvlcSnapshot) -> Snapshot:
    (tmp_path / "dev").mkdir(exist_ok=True)
    path = tmp_path / "dev" / "nvlink_stats"
    now = [100.0]
    config = dataclasses.replace(default_config(), roots=Roots.under(tmp_path))
    collector = Collector.from_config(config, [src.make_source()])
    collector.clock = lambda: now[0]
    abi.write_snapshot(path, first.header, first.records)
    collector.run_cycle(force=True)
    now[0] = 101.0
    abi.write_snapshot(path, second.header, second.records)
    return collector.run_cycle(force=True)


def test_metrics_of_module_served_links(tmp_path: Path) -> None:
    hist = tuple(1 if b in (9, 12, 19) else 0 for b in range(20))
    gone_hist = tuple(1 if b in (3, 12) else 0 for b in range(20))
    first = _snap(1.0, 10, [_record(0, 0, 0, 0), _record(0, 1, 0, 0), _record(1, 0, 0, 0)])
    second = _snap(
        2.0, 10010,
        [_record(0, 0, 5 * GB, 700 * 10**6, window_samples=10000, window_max_util=32768,
                 window_over_stall=2500, stall_hist=hist, samples=10000),
         dataclasses.replace(_record(0, 1, 0, 0, samples=4000, stall_hist=gone_hist),
                             flags=1 | (1 << 8)),
         _record(1, 0, 1 * GB, 0, samples=10000)],
    )  # fmt: skip
    text = render(_collect_twice(tmp_path, first, second)).decode()
    assert 'nodescope_nvlink_data_source_info{source="kmod"} 1.0' in text
    assert "nodescope_nvlink_kmod_serving 1.0" in text
    # Byte and error counters are per device, summed over the links that have the counter:
    # link 1 only has its TX register mapped, so its replay count (7) is not added.
    assert 'nodescope_nvlink_kmod_transmit_bytes_total{device="0"} 5e+09' in text
    assert 'nodescope_nvlink_kmod_receive_bytes_total{device="0"} 2.5e+09' in text
    assert 'nodescope_nvlink_kmod_replay_errors_total{device="0"} 7.0' in text
    assert 'nodescope_nvlink_kmod_transmit_bytes_total{device="1"} 1e+09' in text
    assert 'nodescope_nvlink_kmod_capacity_bytes_per_second{device="0"} 5e+10' in text
    assert 'nodescope_nvlink_kmod_links{device="0"} 2.0' in text
    assert 'nodescope_nvlink_kmod_links{device="1"} 1.0' in text
    assert 'nodescope_nvlink_kmod_link_samples_total{device="0"} 14000.0' in text
    # One gone link marks its device; the other device is not.
    assert 'nodescope_nvlink_kmod_device_gone{device="0"} 1.0' in text
    assert 'nodescope_nvlink_kmod_device_gone{device="1"} 0.0' in text
    # Per link: what only the module knows (stall cycles, the window's peaks).
    assert 'nodescope_nvlink_kmod_stall_cycles_total{device="0",link="0"} 7e+08' in text
    assert 'nodescope_nvlink_kmod_stall_cycles_total{device="0",link="1"}' not in text
    assert 'nodescope_nvlink_kmod_window_max_utilisation_ratio{device="0",link="0"} 0.5' in text
    # Cumulative buckets summed over the device's links: link 0's values below 2^9 are
    # <= 512, 2^12 adds at 4096, 2^19 only at +Inf; link 1 adds one below 8 and one at 4096.
    for le, count in (("256", 1), ("512", 2), ("2048", 2), ("4096", 4), ("16384", 4), ("+Inf", 5)):
        line = f'nodescope_nvlink_kmod_stall_samples_total{{below="{le}",device="0"}}'
        assert f"{line} {float(count)}" in text
    assert "nodescope_nvlink_kmod_sampling_period_seconds 0.0001" in text
    # Rates of exported counters and last-window shares are left to Prometheus and the
    # bucket counters.
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    dropped = {
        "nodescope_nvlink_kmod_utilisation_ratio",
        "nodescope_nvlink_kmod_stall_cycles_per_microsecond",
        "nodescope_nvlink_kmod_window_stall_over_threshold_ratio",
        "nodescope_nvlink_kmod_window_utilisation_over_threshold_ratio",
    }
    assert not dropped & names
    assert "nodescope_nvlink_kmod_window_max_stall_cycles_per_microsecond" in names


def test_no_module_no_series(tmp_path: Path) -> None:
    config = dataclasses.replace(default_config(), roots=Roots.under(tmp_path))
    collector = Collector.from_config(config, [src.make_source()])
    text = render(collector.run_cycle(force=True)).decode()
    assert "nodescope_nvlink_kmod_serving 0.0" in text
    assert "nodescope_nvlink_data_source_info" not in text
    assert "nodescope_nvlink_kmod_transmit_bytes_total" not in text


# --------------------------------------------------------------------------------------------
# The detector


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0.0, None),
        (499.9, None),
        (500.0, Severity.WARNING),
        (2000.0, Severity.WARNING),
        (2000.5, Severity.CRITICAL),
    ],
)
def test_stall_bands(value: float, expected: Severity | None) -> None:
    assert det.band(value, 500, 2000) is expected


def _stall_pair(stall_per_us: float, util: float, peak: int = 0) -> tuple[NvlcSnapshot, ...]:
    prev = _snap(1.0, 0, [_record(2, 5, 0, 0)])
    tx = int(util * 25 * GB)
    cur = _snap(
        2.0, 10000,
        [_record(2, 5, tx, int(stall_per_us * 1e6), window_samples=10000, window_max_stall=peak)],
    )  # fmt: skip
    return prev, cur


@pytest.mark.parametrize(
    ("stall", "util", "kinds"),
    [
        (100, 0.5, []),
        (600, 0.5, [(det.STALL, Severity.WARNING)]),
        (2500, 0.5, [(det.STALL, Severity.CRITICAL)]),
        (100, 0.75, [(det.SATURATION, Severity.WARNING)]),
        (100, 0.95, [(det.SATURATION, Severity.CRITICAL)]),
        (3000, 0.95, [(det.STALL, Severity.CRITICAL), (det.SATURATION, Severity.CRITICAL)]),
    ],
)
def test_detector_findings(stall: float, util: float, kinds: list[tuple[str, Severity]]) -> None:
    findings = det.evaluate(*_stall_pair(stall, util))
    assert [(f.kind, f.severity) for f in findings] == kinds
    for f in findings:
        assert dict(f.subjects) == {"device": "2", "link": "5"}
        assert "device 2 link 5" in f.message
    if kinds and kinds[0][0] == det.STALL:
        assert findings[0].evidence["stall_cycles_per_microsecond"] == pytest.approx(stall)


def test_bursts_a_poll_averages_away() -> None:
    findings = det.evaluate(*_stall_pair(100, 0.1, peak=5000))
    assert [(f.kind, f.severity) for f in findings] == [(det.STALL_BURST, Severity.WARNING)]
    assert findings[0].evidence["window_max_stall_cycles_per_microsecond"] == 5000
    quiet = dataclasses.replace(det.DEFAULT_THRESHOLDS, burst_findings=False)
    assert det.evaluate(*_stall_pair(100, 0.1, peak=5000), quiet) == []


def test_thresholds_are_configurable() -> None:
    def bands(table: dict[str, object]) -> det.NvlinkThresholds:
        return det.thresholds(from_mapping({"detectors": {"nvlink": table}}).detectors.nvlink)

    t = bands({"stall_warning_cycles_per_us": 50, "stall_critical_cycles_per_us": 80.5})
    findings = det.evaluate(*_stall_pair(100, 0.1), t)
    assert [(f.kind, f.severity) for f in findings] == [(det.STALL, Severity.CRITICAL)]
    with pytest.raises(ConfigError, match=r"detectors\.nvlink\.bogus"):
        bands({"bogus": 1})
    with pytest.raises(ConfigError, match="at most utilisation_critical_ratio"):
        bands({"utilisation_warning_ratio": 0.95})
    with pytest.raises(ConfigError, match="expected float, got bool"):
        bands({"utilisation_warning_ratio": True})


def test_device_gone_and_unusable_timestamps() -> None:
    prev = _snap(1.0, 0, [_record(0, 0, 0, 0)])
    gone = _snap(2.0, 10, [dataclasses.replace(_record(0, 0, 0, 0), flags=1)])
    assert [f.kind for f in det.evaluate(prev, gone)] == [det.GONE]
    # Two gone devices with three links between them, beside one that still answers: one
    # finding per gone device, counting its links, and nothing for the live one.
    records = [
        dataclasses.replace(_record(d, link, 0, 0), flags=1 if d != 2 else 0)
        for d, link in ((0, 0), (0, 1), (1, 0), (2, 0))
    ]
    found = det.evaluate(prev, _snap(2.0, 10, records))
    assert [(f.kind, f.subjects, f.evidence["links_gone"]) for f in found] == [
        (det.GONE, {"device": "0"}, 2.0),
        (det.GONE, {"device": "1"}, 1.0),
    ]
    same_time = _snap(1.0, 10, [_record(0, 0, 10**15, 10**15)])
    assert det.evaluate(prev, same_time) == []


def test_detect_takes_the_source_pair_from_the_snapshot() -> None:
    prev, cur = _stall_pair(2500, 0.1)
    sample = SourceSample("nvlink_kmod", 2.0, 0.0, src.NvlinkKmodData("/dev/x", "device", cur))
    before = SourceSample("nvlink_kmod", 1.0, 0.0, src.NvlinkKmodData("/dev/x", "device", prev))
    snap = Snapshot(1, 2.0, 0.0, current={"nvlink_kmod": sample}, previous={"nvlink_kmod": before})
    # At once: this test is about where the pair comes from, not how long a stall lasts.
    at_once = from_mapping({"detectors": {"nvlink": {"min_stall_seconds": 0}}})
    assert [f.kind for f in det.detect(None, snap, at_once.detectors.nvlink)] == [det.STALL]
    # With the default minimum duration a stall seen in one snapshot is not yet a finding.
    assert det.detect(None, snap, default_config().detectors.nvlink) == []
    assert det.detect(None, Snapshot(0, 0.0, 0.0), at_once.detectors.nvlink) == []


def test_rows_of_columns_index_like_a_tuple() -> None:
    """Rows made on demand behave as the tuple of rows would: negative indices, slices with
    steps, IndexError past the end (which ends an iteration that indexes)."""
    recs = [_record(0, n, n, n) for n in range(5)]
    records = abi.NvlcRecords.of(recs)
    assert records[-2] == recs[-2]
    assert records[::2] == recs[::2] and records[4:1:-1] == recs[4:1:-1]
    with pytest.raises(IndexError):
        records[5]
    assert list(reversed(records)) == recs[::-1]
    assert records.index(recs[3]) == 3 and recs[1] in records
