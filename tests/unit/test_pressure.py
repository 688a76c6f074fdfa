"""The node-level pressure source (``/proc/pressure``): its parser against this machine's
files, a captured file and hostile text; its record when PSI is off; its metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nodescope.collect import Collector, ScheduledSource
from nodescope.model.cgroup import Pressure, PressureLine
from nodescope.model.finding import Finding, Severity
from nodescope.model.pressure import (
    PRESSURE,
    RESOURCES,
    NodePressure,
    full_stall_ratio,
    with_node_stall,
)
from nodescope.model.skips import SkipTally
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.roots import Roots
from nodescope.sources.cgroup import parse_pressure
from nodescope.sources.pressure import (
    SKIP_LINE_MALFORMED,
    SKIP_LINE_REPEATED,
    parse_pressure_file,
    read_node_pressure,
)
from nodescope.sources.registry import SOURCES
from nodescope_exporters.prometheus import render
from tests.conftest import HOST_FIXTURE

REAL = Path("/proc/pressure")


def _parse(text: str) -> tuple[Pressure, dict[str, int]]:
    tally = SkipTally()
    pressure = parse_pressure_file(text, "/proc/pressure/io", tally)
    return pressure, dict(tally.freeze().counts)


@pytest.mark.skipif(not (REAL / "cpu").exists(), reason="this kernel has PSI off")
@pytest.mark.parametrize("resource", RESOURCES)
def test_this_machines_files_read_as_the_cgroup_parser_reads_the_same_format(
    resource: str,
) -> None:
    # The cgroup source's parser reads the same kernel format (psi_show) for cgroups and
    # refuses any file it cannot read whole: the two must agree on a real file.
    text = (REAL / resource).read_text()
    pressure, skipped = _parse(text)
    assert skipped == {}
    assert pressure == parse_pressure(text, resource)
    assert pressure.some is not None and pressure.full is not None


@pytest.mark.skipif(not (REAL / "cpu").exists(), reason="this kernel has PSI off")
def test_this_machines_node_pressure_counts_forward() -> None:
    first = read_node_pressure(Roots())
    second = read_node_pressure(Roots())
    assert first.available and second.available
    for resource in RESOURCES:
        before, after = first.of(resource), second.of(resource)
        assert before is not None and after is not None
        assert before.some is not None and after.some is not None
        assert after.some.total_usec >= before.some.total_usec


def test_the_captured_host_files_give_their_totals() -> None:
    data = read_node_pressure(Roots.under(HOST_FIXTURE))
    assert data.skipped.counts == {}
    assert data.cpu == Pressure(
        some=PressureLine(97.68, 96.71, 73.92, 9087926176), full=PressureLine(0.0, 0.0, 0.0, 0)
    )
    assert data.memory is not None and data.memory.full == PressureLine(0.0, 0.0, 0.0, 8052945)
    assert data.io is not None and data.io.full == PressureLine(0.0, 0.0, 3.75, 634246981)


def test_psi_off_is_absent_not_an_error(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    collector = Collector(
        roots=Roots.under(tmp_path),
        scheduled=[ScheduledSource(SOURCES["pressure"].make(), 5.0)],
        clock=lambda: 0.0,
    )
    try:
        snapshot = collector.run_cycle(force=True)
    finally:
        collector.close()
    data = snapshot.latest(PRESSURE)
    assert data == NodePressure(cpu=None, memory=None, io=None)
    assert not data.available and data.skipped.counts == {}
    assert snapshot.current["pressure"].ok
    assert b"nodescope_pressure_" not in render(snapshot).replace(b"nodescope_pressure_stall", b"")


def test_a_bad_line_is_skipped_and_counted_and_the_other_kept() -> None:
    text = (
        "some avg10=1.00 avg60=2.00 avg300=3.00 total=12345\n"
        "full avg10=1.00 avg60=2.00 avg300=3.00 total=-5\n"
    )
    pressure, skipped = _parse(text)
    assert pressure == Pressure(some=PressureLine(1.0, 2.0, 3.0, 12345), full=None)
    assert skipped == {SKIP_LINE_MALFORMED: 1}


@pytest.mark.parametrize(
    "line",
    [
        "some avg10=1.00 avg60=2.00 avg300=3.00",  # no total
        "some avg10=1.0 avg60=2.00 avg300=3.00 total=1",  # not the kernel's two decimals
        "some total=1 avg10=1.00 avg60=2.00 avg300=3.00",  # not the kernel's order
        "some avg10=1.00 avg60=2.00 avg300=3.00 total=18446744073709551616",  # past a u64
        "Some avg10=1.00 avg60=2.00 avg300=3.00 total=1",
        "some  avg10=1.00 avg60=2.00 avg300=3.00 total=1",
        "some avg10=nan avg60=2.00 avg300=3.00 total=1",
        "total=1",
    ],
)
def test_lines_not_in_the_kernels_format_are_skipped(line: str) -> None:
    pressure, skipped = _parse(line + "\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=7\n")
    assert pressure == Pressure(some=None, full=PressureLine(0.0, 0.0, 0.0, 7))
    assert skipped == {SKIP_LINE_MALFORMED: 1}


def test_a_second_line_of_one_kind_is_counted_and_the_first_kept() -> None:
    text = (
        "some avg10=0.00 avg60=0.00 avg300=0.00 total=1\n"
        "some avg10=0.00 avg60=0.00 avg300=0.00 total=2\n"
    )
    pressure, skipped = _parse(text)
    assert pressure.some == PressureLine(0.0, 0.0, 0.0, 1)
    assert skipped == {SKIP_LINE_REPEATED: 1}


_AVG = st.builds(
    lambda whole, cents: f"{whole}.{cents:02d}", st.integers(0, 100), st.integers(0, 99)
)
_GOOD = st.builds(
    lambda kind, a, b, c, total: f"{kind} avg10={a} avg60={b} avg300={c} total={total}",
    st.sampled_from(["some", "full"]),
    _AVG,
    _AVG,
    _AVG,
    st.integers(0, 2**64 - 1),
)


@given(st.lists(st.one_of(_GOOD, st.text(max_size=80)), max_size=6))
def test_any_text_parses_without_raising_and_every_line_is_kept_or_counted(
    lines: list[str],
) -> None:
    text = "\n".join(lines)
    pressure, skipped = _parse(text)
    kept = (pressure.some is not None) + (pressure.full is not None)
    nonempty = sum(1 for line in text.splitlines() if line)
    assert kept + sum(skipped.values()) == nonempty
    for line in (pressure.some, pressure.full):
        if line is not None:
            assert 0 <= line.total_usec < 2**64
            assert all(0.0 <= avg <= 999.99 for avg in (line.avg10, line.avg60, line.avg300))


@given(_GOOD, _GOOD)
def test_kernel_lines_read_back_their_values(first: str, second: str) -> None:
    pressure, skipped = _parse(f"{first}\n{second}\n")
    kind = first.split()[0]
    line = pressure.some if kind == "some" else pressure.full
    assert line is not None
    assert line.total_usec == int(first.rsplit("=", 1)[1])
    assert skipped == ({SKIP_LINE_REPEATED: 1} if second.split()[0] == kind else {})


def test_metrics_are_node_exporters_totals_in_seconds() -> None:
    data = read_node_pressure(Roots.under(HOST_FIXTURE))
    snapshot = Snapshot(
        cycle=1,
        monotonic=1.0,
        wall_time=1_796_000_000.0,
        current={"pressure": SourceSample("pressure", 1.0, 0.001, data)},
    )
    text = render(snapshot).decode()
    expected = {
        "nodescope_pressure_cpu_waiting_seconds_total": 9087.926176,
        "nodescope_pressure_memory_waiting_seconds_total": 14.800063,
        "nodescope_pressure_memory_stalled_seconds_total": 8.052945,
        "nodescope_pressure_io_waiting_seconds_total": 1096.364882,
        "nodescope_pressure_io_stalled_seconds_total": 634.246981,
    }
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("nodescope_pressure_")
    }
    assert values.keys() == expected.keys()  # no CPU "stalled": zero at the node level
    for name, value in expected.items():
        assert values[name] == pytest.approx(value, rel=1e-12)


def _node(io_full_usec: int | None, memory_full_usec: int = 0) -> NodePressure:
    def pressure(full: int | None) -> Pressure:
        return Pressure(
            some=PressureLine(0.0, 0.0, 0.0, 0),
            full=None if full is None else PressureLine(0.0, 0.0, 0.0, full),
        )

    return NodePressure(
        cpu=pressure(0), memory=pressure(memory_full_usec), io=pressure(io_full_usec)
    )


def test_full_stall_ratio_is_the_share_of_the_interval_stalled() -> None:
    # 1.5 s of every task waiting on IO in 5 s between the reads: 30 %.
    assert full_stall_ratio((_node(1_000_000), _node(2_500_000), 5.0), "io") == 0.3
    assert full_stall_ratio((_node(0, 0), _node(0, 400_000), 2.0), "memory") == 0.2
    assert full_stall_ratio(None, "io") is None  # one read only
    assert full_stall_ratio((_node(None), _node(5), 1.0), "io") is None  # no full line
    assert full_stall_ratio((_node(9), _node(5), 1.0), "io") is None  # went back: no counter
    # Rounding of the kernel's clock never makes it more than the whole interval.
    assert full_stall_ratio((_node(0), _node(1_000_001), 1.0), "io") == 1.0


def test_node_stall_is_evidence_of_the_findings_of_its_kind_only() -> None:
    storage = Finding("job_stalled_on_storage", Severity.CRITICAL, {"job": "7"}, {"gpus_idle": 8.0})
    other = Finding("job_stalled_unknown", Severity.WARNING, {"job": "8"}, {})
    found = with_node_stall([storage, other], storage.kind, "node_io_full_stall_ratio", 0.3)
    assert found[0].evidence == {"gpus_idle": 8.0, "node_io_full_stall_ratio": 0.3}
    assert found[1] is other
    unchanged = [other]
    assert with_node_stall(unchanged, storage.kind, "k", 0.3) is unchanged
    assert with_node_stall([storage], storage.kind, "k", None)[0] is storage
