"""The simulated ``nvlink_counter`` module: window statistics computed from the burst shape
equal those of sampling every 100 µs one sample at a time; the simulated node's snapshot file
parsed by ``kmod_abi.parse_snapshot`` and read by the daemon's ``nvlink_kmod`` source.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.detectors import nvlink as det
from nodescope.kmod_abi import HIST_BUCKETS, UTIL_ONE, NvlcSnapshot, parse_snapshot, record_key
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.sim import kmod
from nodescope.sim.kmod import PERIOD_NS, LinkLoad, SimulatedModule, window_stats
from nodescope.sim.node import SimulatedNode, make_temp_root
from nodescope.sim.scenario import Burst, load_scenario
from nodescope.sources.nvlink_kmod import NvlinkKmodData, NvlinkKmodRates
from nodescope.sources.nvml import NvmlRates

GB = 10**9
CAP = 25 * GB
MS = 1_000_000  # ns


# --------------------------------------------------------------------------------------------
# A reference: the module's arithmetic, one sample at a time


def _on_time(load: LinkLoad, a: int, b: int) -> int:
    """ns of [a, b) during which ``load`` is on, from the closed form of a periodic burst."""
    lo = max(a, load.start_ns)
    hi = b if load.end_ns is None else min(b, load.end_ns)
    if hi <= lo:
        return 0
    if load.period_ns is None or load.on_ns is None:
        return hi - lo

    def until(t: int) -> int:
        periods, rest = divmod(t - load.start_ns, load.period_ns)
        return periods * load.on_ns + min(rest, load.on_ns)

    return until(hi) - until(lo)


def _sample_by_sample(
    loads: list[LinkLoad], first: int, last: int, capacity: int
) -> kmod.WindowStats:
    util_hist = [0] * HIST_BUCKETS
    stall_hist = [0] * HIST_BUCKETS
    max_delta = [0, 0, 0]
    max_util = max_stall = over_stall = over_util = 0
    totals = [0.0, 0.0, 0.0]
    over = (False, False)
    for k in range(first, last + 1):
        a, b = (k - 1) * PERIOD_NS, k * PERIOD_NS
        on = [_on_time(load, a, b) for load in loads]
        deltas = [
            sum(t * load.tx_bytes_per_second for t, load in zip(on, loads, strict=True)) / 1e9,
            sum(t * load.rx_bytes_per_second for t, load in zip(on, loads, strict=True)) / 1e9,
            sum(t * load.stall_cycles_per_second for t, load in zip(on, loads, strict=True)) / 1e9,
        ]
        for c in range(3):
            totals[c] += deltas[c]
        dtx, drx, dstall = (round(d) for d in deltas)
        util = max(dtx * 10**9 // PERIOD_NS, drx * 10**9 // PERIOD_NS) * UTIL_ONE // capacity
        stall = dstall * 1000 // PERIOD_NS
        util_hist[min(util.bit_length(), HIST_BUCKETS - 1)] += 1
        stall_hist[min(stall.bit_length(), HIST_BUCKETS - 1)] += 1
        max_delta = [max(m, d) for m, d in zip(max_delta, (dtx, drx, dstall), strict=True)]
        max_util, max_stall = max(max_util, util), max(max_stall, stall)
        over = (stall > kmod.STALL_THRESHOLD, util > kmod.UTIL_THRESHOLD)
        over_stall += over[0]
        over_util += over[1]
    return kmod.WindowStats(
        samples=last - first + 1,
        increase=(totals[0], totals[1], totals[2]),
        max_delta=(max_delta[0], max_delta[1], max_delta[2]),
        max_util=max_util,
        max_stall=max_stall,
        over_stall=over_stall,
        over_util=over_util,
        util_hist=tuple(util_hist),
        stall_hist=tuple(stall_hist),
        last_over_stall=over[0],
        last_over_util=over[1],
    )


def _same(a: kmod.WindowStats, b: kmod.WindowStats) -> None:
    assert a.increase == pytest.approx(b.increase, rel=1e-9, abs=1e-3)
    assert (a.samples, a.max_delta, a.max_util, a.max_stall) == (
        b.samples,
        b.max_delta,
        b.max_util,
        b.max_stall,
    )
    assert (a.over_stall, a.over_util, a.util_hist, a.stall_hist) == (
        b.over_stall,
        b.over_util,
        b.util_hist,
        b.stall_hist,
    )
    assert (a.last_over_stall, a.last_over_util) == (b.last_over_stall, b.last_over_util)


# Rates in whole GB/s and Gcycles/s keep every per-sample delta an exact integer, so the
# reference and the segment computation round alike.
_loads = st.builds(
    LinkLoad,
    tx_bytes_per_second=st.integers(0, 30).map(lambda g: float(g * GB)),
    rx_bytes_per_second=st.integers(0, 30).map(lambda g: float(g * GB)),
    # at most 3 x 1 Gcycles/s together: under the clock, whose cap is tested on its own
    stall_cycles_per_second=st.integers(0, 1).map(lambda g: float(g * GB)),
    start_ns=st.integers(0, 40 * MS),
    end_ns=st.none() | st.integers(20 * MS, 200 * MS),
    period_ns=st.none() | st.integers(2 * PERIOD_NS, 30 * MS),
    on_ns=st.integers(1, 30 * MS),
).map(
    lambda load: load
    if load.period_ns is None or load.on_ns is None or load.on_ns < load.period_ns
    else LinkLoad(load.tx_bytes_per_second, load.rx_bytes_per_second,
                  load.stall_cycles_per_second, load.start_ns, load.end_ns)
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    loads=st.lists(_loads, max_size=3),
    first=st.integers(1, 400),
    length=st.integers(0, 1200),
)
def test_segments_equal_sampling_one_sample_at_a_time(
    loads: list[LinkLoad], first: int, length: int
) -> None:
    last = first + length - 1
    got = window_stats(loads, first, last, CAP)
    if length == 0:
        assert got.samples == 0 and got.increase == (0.0, 0.0, 0.0)
        return
    _same(got, _sample_by_sample(loads, first, last, CAP))


def test_burst_edges_between_samples() -> None:
    # On for 200 µs from 50 µs: half, whole, half samples.
    load = LinkLoad(10.0 * GB, 0.0, 0.0, 50_000, 250_000)
    w = window_stats([load], 1, 5, CAP)
    assert w.samples == 5
    assert w.increase[0] == pytest.approx(2_000_000)
    assert w.max_delta[0] == 1_000_000  # 10 GB/s for 100 µs
    half, whole = 5 * GB * UTIL_ONE // CAP, 10 * GB * UTIL_ONE // CAP
    assert w.max_util == whole
    expected = [0] * HIST_BUCKETS
    expected[0] = 2
    expected[half.bit_length()] += 2
    expected[whole.bit_length()] += 1
    assert list(w.util_hist) == expected


def test_stalls_are_capped_at_the_clock_and_short_bursts_average() -> None:
    heavy = LinkLoad(0.0, 0.0, 0.8 * kmod.STALL_CLOCK_HZ, 0)
    w = window_stats([heavy, heavy], 1, 10, CAP)
    assert w.max_stall == int(kmod.STALL_CLOCK_HZ / 1e6)  # all cycles, not 160 % of them
    # A 150 µs burst period (shorter than two samples) counts at its average rate.
    scenario = load_scenario("nvlink-stall-bursts")
    activity = next(a for a in scenario.timeline if a.kind == "nvlink")
    params = tuple((k, Burst(0.00015, 0.00005) if k == "burst" else v) for k, v in activity.params)
    fast = LinkLoad.of_activity(dataclasses.replace(activity, params=params))
    assert fast.period_ns is None
    assert fast.tx_bytes_per_second == pytest.approx(20 * GB / 3)


# --------------------------------------------------------------------------------------------
# The scenario's module, without the node: cheap


def _module(name: str) -> SimulatedModule:
    scenario = load_scenario(name)
    return SimulatedModule(scenario.hardware, scenario.timeline)


def test_bursts_show_in_the_window_and_not_in_the_average() -> None:
    module = _module("nvlink-stall-bursts")
    snaps = {t: parse_snapshot(module.snapshot(t), f"t={t}") for t in (0.0, 1.0, 10.0, 11.0)}
    head = snaps[1.0].header
    assert (head.record_count, head.period_ns, head.window_samples) == (144, PERIOD_NS, 10_000)
    assert snaps[11.0].header.sequence == 110_000
    assert snaps[11.0].header.timestamp_ns - snaps[10.0].header.timestamp_ns == 10**9
    assert head.window_ns == 10**9 and head.source_name == "mmio"
    one = record_key(snaps[1.0].records)
    r = one[(0, 0)]
    # 100 ms of every 500 ms at 20 GB/s each way: 4 GB in a second, 2 MB in a burst sample.
    assert r.counters[:3] == (4 * GB, 4 * GB, 0)
    assert r.window_max_delta == (2_000_000, 2_000_000, 0, 0, 0)
    assert r.window_max_util == 20 * GB * UTIL_ONE // CAP  # 80 % of the link
    assert r.window_util_hist[0] == 8000
    assert r.window_util_hist[(20 * GB * UTIL_ONE // CAP).bit_length()] == 2000
    assert r.window_max_stall == 0 and r.window_over_stall == 0
    assert all(rec.has_counter("crc_errors") for rec in snaps[1.0].records)
    # GPU 5's links to the first NVSwitch stall 45 % of each burst from t=10.
    before, during = record_key(snaps[10.0].records), record_key(snaps[11.0].records)
    assert before[(5, 0)].window_max_stall == 0
    for link in range(5):
        s = during[(5, link)]
        assert s.window_max_stall == 2250  # 0.45 x 5,000 cycles/µs
        assert s.window_over_stall == 2000
        assert s.window_stall_hist[12] == 2000 and s.window_stall_hist[0] == 8000
        assert s.counter("stall_cycles") == 450 * 10**6  # 450 cycles/µs over 1 s
    assert during[(5, 5)].window_max_stall == 0
    assert snaps[11.0].header.threshold_event
    # Cumulative histograms count every sample since configuration.
    assert sum(during[(5, 0)].stall_hist) == during[(5, 0)].samples == 110_000


def test_the_detector_finds_the_bursts_on_the_right_links() -> None:
    module = _module("nvlink-stall-bursts")
    snaps = {t: parse_snapshot(module.snapshot(t)) for t in (9.0, 10.0, 11.0, 30.0, 31.0)}
    assert det.evaluate(snaps[9.0], snaps[10.0]) == []
    found = det.evaluate(snaps[10.0], snaps[11.0])
    assert {f.kind for f in found} == {det.STALL_BURST}
    assert sorted((f.subjects["device"], f.subjects["link"]) for f in found) == [
        ("5", str(link)) for link in range(5)
    ]
    assert found[0].evidence["stall_cycles_per_microsecond"] == pytest.approx(450)
    assert found[0].evidence["window_max_stall_cycles_per_microsecond"] == 2250
    assert det.evaluate(snaps[30.0], snaps[31.0]) == []


def test_a_gpu_that_falls_off_the_bus_is_a_device_gone() -> None:
    scenario = load_scenario("xid79-fell-off-bus")
    module = SimulatedModule(scenario.hardware, scenario.timeline)
    gpu = scenario.hardware.gpus[4]
    first = parse_snapshot(module.snapshot(1.0))
    gone = parse_snapshot(module.snapshot(2.0, {gpu.pci}))
    later = parse_snapshot(module.snapshot(3.0, {gpu.pci}))
    assert gone.header.device_gone
    a, b, c = (record_key(s.records) for s in (first, gone, later))
    assert b[(4, 0)].device_gone and not b[(3, 0)].device_gone
    assert b[(4, 0)].counters == c[(4, 0)].counters == a[(4, 0)].counters
    assert c[(4, 0)].window_samples == 0 and c[(3, 0)].window_samples == 10_000
    found = [f for f in det.evaluate(gone, later) if f.subjects["device"] == "4"]
    # One finding for the device that went away, however many links it carried.
    assert [(f.kind, f.subjects) for f in found] == [(det.GONE, {"device": "4"})]
    assert found[0].evidence["links_gone"] == 18
    assert "18 links" in found[0].message


def test_a_node_without_nvlinks_has_no_module() -> None:
    scenario = load_scenario("dgx-h100")
    hardware = scenario.hardware
    bare = dataclasses.replace(
        hardware, gpus=tuple(dataclasses.replace(g, nvlinks=()) for g in hardware.gpus)
    )
    assert SimulatedModule(bare, scenario.timeline).links == []


# --------------------------------------------------------------------------------------------
# The node's file, read by the daemon's source


@dataclass
class NodeRun:
    node: SimulatedNode
    files: dict[float, bytes]
    data: dict[float, NvlinkKmodData]
    nvml: dict[float, Any]


@pytest.fixture(scope="module")
def bursts() -> Iterator[NodeRun]:
    root = make_temp_root("nodescope-test-kmod-")
    try:
        node = SimulatedNode(load_scenario("nvlink-stall-bursts"), root / "node")
        node.materialise()
        names = {s.name: s for s in node.sources()}
        source, nvml = names["nvlink_kmod"], names["nvml"]
        run = NodeRun(node, {}, {}, {})
        try:
            for t in (0.0, 1.0, 2.0, 10.0, 11.0):
                node.advance_to(t)
                run.files[t] = node.nvlink_snapshot_path.read_bytes()
                data = source.collect(node.roots)
                assert isinstance(data, NvlinkKmodData)
                run.data[t] = data
                run.nvml[t] = nvml.collect(node.roots)
        finally:
            for s in names.values():
                s.close()
        yield run
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _pair(run: NodeRun, name: str, t0: float, t1: float, data: dict[float, Any]) -> Snapshot:
    return Snapshot(
        1,
        t1,
        t1,
        current={name: SourceSample(name, t1, 0.0, data[t1])},
        previous={name: SourceSample(name, t0, 0.0, data[t0])},
    )


def test_the_node_writes_the_module_abi_under_dev(bursts: NodeRun) -> None:
    node = bursts.node
    assert node.nvlink_snapshot_path == node.roots.dev / "nvlink_stats"
    assert "nvlink_kmod" in [s.name for s in node.sources()]
    zero = parse_snapshot(bursts.files[0.0])
    assert zero.header.window_samples == 0 and zero.header.record_count == 144
    assert all(r.counters == (0, 0, 0, 0, 0) for r in zero.records)
    one, two = (parse_snapshot(bursts.files[t]) for t in (1.0, 2.0))
    # Cumulative counters advance by rate x elapsed time.
    for a, b in zip(one.records, two.records, strict=True):
        assert b.counter("tx_bytes") - a.counter("tx_bytes") == 4 * GB
        assert b.counter("rx_bytes") - a.counter("rx_bytes") == 4 * GB
        assert b.samples - a.samples == 10_000


def test_the_source_reads_the_file_and_rates_follow(bursts: NodeRun) -> None:
    data = bursts.data[11.0]
    assert data.kind == "file" and data.serving
    assert isinstance(data.snapshot, NvlcSnapshot)
    assert data.snapshot == parse_snapshot(bursts.files[11.0])
    rates = _pair(bursts, "nvlink_kmod", 10.0, 11.0, bursts.data).derived.nvlink_rates
    assert isinstance(rates, NvlinkKmodRates)
    assert rates.seconds == 1.0 and rates.samples_per_second == 10_000
    links = {(lr.device, lr.link): lr for lr in rates.links}
    assert links[(0, 0)].tx_bytes_per_second == 4 * GB
    assert links[(0, 0)].utilisation == pytest.approx(0.16)
    assert links[(0, 0)].window_max_utilisation == pytest.approx(0.8, abs=1e-4)
    assert links[(5, 0)].stall_cycles_per_microsecond == pytest.approx(450)
    assert links[(5, 0)].window_max_stall_cycles_per_microsecond == 2250
    assert links[(5, 0)].window_stall_over_threshold_ratio == 0.2
    # NVML's poll over the same second: the same bytes, the bursts averaged away.
    nvml = _pair(bursts, "nvml", 10.0, 11.0, bursts.nvml).derived.gpu_rates
    assert isinstance(nvml, NvmlRates)
    assert nvml.gpus[0].nvlinks[0].data_tx_bytes_per_second == pytest.approx(4 * GB, rel=1e-3)


def test_a_file_read_twice_gives_no_rates(bursts: NodeRun) -> None:
    twice = {1.0: bursts.data[11.0], 2.0: bursts.data[11.0]}
    assert _pair(bursts, "nvlink_kmod", 1.0, 2.0, twice).derived.nvlink_rates is None


@pytest.mark.alone  # a bound on wall-clock time
def test_a_tick_stays_cheap() -> None:
    module = _module("nvlink-stall-bursts")
    start = time.perf_counter()
    for t in range(1, 11):
        module.snapshot(float(t))
    assert (time.perf_counter() - start) / 10 < 0.05  # 144 records
