"""Error counters read on a slow cadence give their findings on every cycle.

The NVML and InfiniBand sources read their fault counters every ``slow_every`` runs and carry
them in between. Over simulated seconds at production cadence (``slow_every=10``, a run a
second), counters that move at a steady rate must yield the errors detector's findings on
every cycle once two slow reads exist, at the rate averaged over the span between the reads
(what a read every run would give), and an alert rule with ``for_seconds=30`` must fire and
stay firing: the change between two consecutive records, instead, lands whole on one cycle
in ten.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from nodescope.analysis import Analyzer
from nodescope.assembly import default_config
from nodescope.collect import Collector, ScheduledSource
from nodescope.config import AlertRuleSettings, AlertsSettings
from nodescope.detectors import errors
from nodescope.detectors.registry import ALERT_RULES, DETECTORS
from nodescope.model.alert import AlertState
from nodescope.model.slow import SlowRead, slow_pair
from nodescope.model.snapshot import Snapshot
from nodescope.roots import Roots
from nodescope.sim.fake_nvml import FakeNvml, hgx_h100
from nodescope.sources import infiniband as ib
from nodescope.sources import nvml as nv

EPOCH = 1_750_000_000.0
CRC_FLIT = 2  # NVML_NVLINK_ERROR_DL_CRC_FLIT
KINDS = (errors.NVLINK, errors.REPLAYS, errors.IB_ERRORS)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _hca(sysfs: Path, symbol_errors: int, xmit_words: int) -> None:
    port = sysfs / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    _write(port / "state", "4: ACTIVE\n")
    _write(port / "rate", "400 Gb/sec (4X NDR)\n")
    _write(port / "counters" / "symbol_error", f"{symbol_errors}\n")
    _write(port / "counters" / "link_downed", "0\n")
    _write(port / "counters" / "port_xmit_data", f"{xmit_words}\n")
    _write(port / "counters" / "port_rcv_data", "0\n")


class _Run:
    """Sources over a fake NVML and an HCA tree whose counters grow at steady rates, run a
    second apart in simulated time through the collector and the analysis step."""

    def __init__(self, root: Path, slow_every: int) -> None:
        self.t = 0.0
        self.root = root
        self.fake = FakeNvml(hgx_h100(2, 3), clock_us=lambda: round((EPOCH + self.t) * 1e6))
        nvml = nv.NvmlSource(
            self.fake, watch_xids=False, wall_clock=lambda: EPOCH + self.t, slow_every=slow_every
        )
        infiniband = ib.InfinibandSource(slow_every=slow_every, clock=lambda: self.t)
        self.roots = Roots.under(root)
        self.collector = Collector(
            roots=self.roots,
            scheduled=[ScheduledSource(nvml, 1.0), ScheduledSource(infiniband, 1.0)],
            clock=lambda: self.t,
            wall_clock=lambda: EPOCH + self.t,
        )
        # The detector's kinds with a 30 s "for" and no grace: a cycle without the finding
        # would resolve the alert.
        rule = AlertRuleSettings(for_seconds=30.0, resolve_after_seconds=0.0)
        config = default_config(
            roots=self.roots, alerts=AlertsSettings(rules=dict.fromkeys(KINDS, rule))
        )
        self.analyzer = Analyzer.from_config(config, [d for d in DETECTORS if d.name == "errors"])

    def cycles(self, seconds: int) -> Iterator[tuple[float, Snapshot]]:
        try:
            for second in range(seconds + 1):
                self.t = float(second)
                # Per second: 700 CRC flit errors on GPU 0 link 1, one PCIe replay on GPU 1,
                # 4 symbol errors on the HCA port; 1 GB of traffic.
                self.fake.gpus[0].links[1].errors[CRC_FLIT] = 700 * second
                self.fake.gpus[1].replay_counter = second
                _hca(self.root / "sys", 4 * second, 250_000_000 * second)
                yield self.t, self.analyzer.analyze(self.collector.run_cycle(force=True))
        finally:
            self.collector.close()
            self.analyzer.close()


def _counts(snapshot: Snapshot) -> dict[str, tuple[float, str]]:
    """Each kind's minute count and severity."""
    found = {f.kind: f for f in snapshot.findings}
    names = {
        errors.NVLINK: "crc_flit_errors_1m",
        errors.REPLAYS: "replays_errors_1m",
        errors.IB_ERRORS: "symbol_error_errors_1m",
    }
    return {
        kind: (found[kind].evidence[name], found[kind].severity.name.lower())
        for kind, name in names.items()
        if kind in found
    }


#: Severities of the steady rates: 700 CRC flit errors a second (over DCGM's 100/s: a
#: warning), a PCIe replay a second (60 a minute, over DCGM's 8: a warning), four symbol errors
#: a second on a 400 Gb/s port (a bit error ratio of 1e-11 over a minute: critical).
SEVERITIES = {errors.NVLINK: "warning", errors.REPLAYS: "warning", errors.IB_ERRORS: "critical"}


def _expected(t: float) -> dict[str, tuple[float, str]]:
    """The minute counts at a time the two cadences both read: every increase since the
    first read, once (the minute's first bucket starts at 0 until t = 65)."""
    return {
        errors.NVLINK: (700.0 * t, "warning"),
        errors.REPLAYS: (1.0 * t, "warning"),
        errors.IB_ERRORS: (4.0 * t, "critical"),
    }


def test_windows_count_each_increase_once_at_either_cadence(tmp_path: Path) -> None:
    seen: dict[int, dict[float, dict[str, tuple[float, str]]]] = {}
    for slow_every in (1, 10):
        run = _Run(tmp_path / str(slow_every), slow_every=slow_every)
        seen[slow_every] = {t: _counts(snapshot) for t, snapshot in run.cycles(60)}
    for t in (10.0, 20.0, 30.0, 40.0, 50.0, 60.0):
        # The same counts at every read of the slow cadence, whichever cadence read them.
        assert seen[10][t] == seen[1][t] == _expected(t), t
    # Between slow reads the windows hold the last read's counts: nothing is added twice.
    assert seen[10][19.0] == seen[10][10.0]
    # Before the errors reach a bound there is no finding: 3 replays in 3 s is no rate yet.
    assert errors.REPLAYS not in seen[1][3.0]
    assert seen[1][8.0][errors.REPLAYS] == (8.0, "warning")


def test_production_cadence_finds_steady_errors_every_cycle_and_fires(tmp_path: Path) -> None:
    run = _Run(tmp_path, slow_every=10)
    fired: dict[str, float] = {}
    for t, snapshot in run.cycles(75):
        if t < 10:  # one slow read so far: a baseline, nothing counted
            assert not snapshot.findings, t
            continue
        counts = _counts(snapshot)
        assert {k: severity for k, (_, severity) in counts.items()} == SEVERITIES, t
        states = {a.kind: a.state for a in snapshot.alerts}
        assert set(states) == set(KINDS), t
        assert AlertState.RESOLVED not in states.values(), t
        for kind, state in states.items():
            if state is AlertState.FIRING:
                fired.setdefault(kind, t)
            else:
                assert kind not in fired, (kind, t)  # once firing, it stays firing
        if t == 10:
            message = next(f.message for f in snapshot.findings if f.kind == errors.NVLINK)
            assert "NVLink 1" in message
            assert "crc_flit 7000 in 1 min (warning from 6000)" in message
            ib_message = next(f.message for f in snapshot.findings if f.kind == errors.IB_ERRORS)
            assert ib_message.startswith("mlx5_0 port 1")
            assert "symbol_error 40 in 1 min (bit error ratio 1.7e-12, critical from 1e-12)" in (
                ib_message
            )
    assert fired == dict.fromkeys(KINDS, 40.0)


def test_builtin_rules_of_these_kinds_fire_at_once() -> None:
    # The test above overrides them: a steady rate must fire a rule with a "for" too.
    assert all(ALERT_RULES[kind].for_seconds == 0.0 for kind in KINDS)


# ---- the pair itself ----------------------------------------------------------------------


def test_slow_pair_is_the_sample_pair_when_both_records_read_their_slow_values() -> None:
    older, previous = object(), object()
    fresh = SlowRead(20.0, True, older, 10.0)
    assert slow_pair(previous, SlowRead(10.0, True), fresh, 1.0) == (previous, 1.0)
    # A record that says nothing of slow reads: the sample pair, as for any counter.
    assert slow_pair(previous, None, None, 1.0) == (previous, 1.0)


def test_slow_pair_spans_the_two_latest_slow_reads_otherwise() -> None:
    older, previous = object(), object()
    carried = SlowRead(20.0, False, older, 10.0)
    assert slow_pair(previous, carried, carried, 1.0) == (older, 10.0)
    # The run of a slow read after carried runs: still the read before it.
    assert slow_pair(previous, carried, SlowRead(30.0, True, older, 20.0), 1.0) == (older, 10.0)
    # One read so far, or a clock that went back: no span.
    assert slow_pair(previous, None, SlowRead(5.0, False), 1.0) is None
    assert slow_pair(previous, carried, SlowRead(5.0, False, older, 9.0), 1.0) is None


@pytest.mark.parametrize("slow_every", [1, 10])
def test_records_do_not_chain_slow_reads(tmp_path: Path, slow_every: int) -> None:
    run = _Run(tmp_path, slow_every)
    for _t, snapshot in run.cycles(25):
        for name in ("nvml", "infiniband"):
            data = snapshot.current[name].data
            assert isinstance(data, nv.NvmlData | ib.InfinibandData)
            slow = data.slow
            assert slow is not None
            assert slow.previous is None or slow.previous.slow is None
