"""Error counters counted over windows (nodescope.model.error_windows) and judged by the
thresholds table (nodescope.model.error_thresholds) in the errors detector.

The windows are fed through the derived stage as the daemon feeds them, snapshot after
snapshot; the InfiniBand sequences start from the sysfs tree of a real H100 node
(tests/fixtures/captures/h100-node-infiniband) read by the real source, and the AER ones from
``aer_dev_*`` files in the kernel's format (tests/fixtures/captures/procfs-sysfs-aer) parsed by
the real parser.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.assembly import default_config, from_mapping
from nodescope.derive import DerivedStage
from nodescope.detectors import errors
from nodescope.errors import ConfigError, ParseError
from nodescope.model import error_windows as ew
from nodescope.model.error_thresholds import BY_COUNTER, THRESHOLDS, default_of, markdown_table
from nodescope.model.finding import Finding, Severity
from nodescope.model.gpu_health import EccErrors
from nodescope.model.infiniband import ERROR_COUNTERS, InfinibandData
from nodescope.model.nvml import NvLinkSample, NvmlData
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.model.topology import AerRecord, Topology
from nodescope.roots import Roots
from nodescope.sources import infiniband as ib
from nodescope.sources.pci import parse_aer
from tests.conftest import REPO
from tests.unit.fabric_helpers import GPU_A, HCA, NVME, RP_SHARED, topology
from tests.unit.gpu_helpers import gpu_health, gpu_sample

IB_CAPTURE = REPO / "tests/fixtures/captures/h100-node-infiniband"
AER_CAPTURE = REPO / "tests/fixtures/captures/procfs-sysfs-aer"
CONFIG = default_config()
SETTINGS = CONFIG.detectors.errors


class Stream:
    """Snapshots of one node through the derived stage, as the daemon makes them: each source
    sample is kept until the source reads again."""

    def __init__(self) -> None:
        self.stage = DerivedStage()
        self.current: dict[str, SourceSample] = {}
        self.previous: dict[str, SourceSample] = {}
        self.cycle = 0

    def step(self, t: float, **records: object) -> Snapshot:
        for name, data in records.items():
            if name in self.current:
                self.previous[name] = self.current[name]
            self.current[name] = SourceSample(name, t, 0.0, data)
        self.cycle += 1
        snapshot = Snapshot(
            self.cycle, t, t, current=dict(self.current), previous=dict(self.previous)
        )
        derived = self.stage.derive(snapshot)
        derived.derived.error_windows  # noqa: B018 -- asked every cycle, as the detector does
        return derived

    def findings(self, t: float, **records: object) -> list[Finding]:
        return errors.detect(None, self.step(t, **records), SETTINGS)


def _nvml(
    replays: int = 0, links: Iterable[NvLinkSample] = (), ecc: int | None = None, at: float = 0.0
) -> NvmlData:
    gpu = gpu_sample(2, GPU_A, pcie_replays=replays, nvlinks=tuple(links))
    healths = () if ecc is None else (gpu_health(2, GPU_A, at, ecc=EccErrors(ecc, 0, None, None)),)
    return NvmlData(1, (gpu,), (), (), None, (), health=healths)


def _link(**counts: int) -> NvLinkSample:
    return NvLinkSample(3, True, "gpu", "0000:83:00.0", None, None, None, None,
                        tuple(counts.items()))  # fmt: skip


def _severities(found: list[Finding], kind: str) -> list[Severity]:
    return [f.severity for f in found if f.kind == kind]


# --- the windows ------------------------------------------------------------------------------


def test_a_window_counts_the_last_minute_and_hour() -> None:
    w = ew.Window().add(10.0, 3).add(50.0, 2)
    assert w.count(ew.MINUTE, 60.0) == 5
    assert w.count(ew.MINUTE, 112.0) == 2  # the bucket of t=10 has left the minute
    assert w.count(ew.MINUTE, 200.0) == 0
    assert w.count(ew.HOUR, 3000.0) == 5
    assert w.count(ew.HOUR, 3700.0) == 0
    assert w.last_at == 50.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 400), st.integers(1, 1000)), min_size=1, max_size=80))
def test_window_counts_are_never_short_and_stay_bounded(events: list[tuple[float, int]]) -> None:
    w = ew.Window()
    t = 0.0
    seen: list[tuple[float, int]] = []
    for step, n in events:
        t += step
        w = w.add(t, n)
        seen.append((t, n))
        assert len(w.minute) <= ew.MINUTE_BUCKETS and len(w.hour) <= ew.HOUR_BUCKETS
        for window, width in ((ew.MINUTE, ew.MINUTE_BUCKET), (ew.HOUR, ew.HOUR_BUCKET)):
            inside = sum(k for at, k in seen if at > t - window)
            at_most = sum(k for at, k in seen if at >= t - window - width)
            assert inside <= w.count(window, t) <= at_most


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.lists(st.integers(0, 5000), min_size=1, max_size=40),
)
def test_replay_counts_sum_the_increases_across_a_32_bit_wrap(start: int, steps: list[int]) -> None:
    stream = Stream()
    value = start
    stream.step(0.0, nvml=_nvml(value))
    for i, step in enumerate(steps, 1):
        value = (value + step) % 2**32
        snapshot = stream.step(float(i), nvml=_nvml(value))
    windows = snapshot.derived.error_windows
    key = ew.CounterKey(ew.PCIE_REPLAY, ("GPU-2",), "replays")
    assert windows.count(key, ew.MINUTE, float(len(steps))) == sum(steps)


def test_a_reset_counts_nothing_and_is_the_next_baseline() -> None:
    stream = Stream()
    stream.step(0.0, nvml=_nvml(500))
    stream.step(10.0, nvml=_nvml(503))
    snapshot = stream.step(20.0, nvml=_nvml(2))  # the driver reloaded: the counter restarted
    key = ew.CounterKey(ew.PCIE_REPLAY, ("GPU-2",), "replays")
    assert snapshot.derived.error_windows.count(key, ew.MINUTE, 20.0) == 3
    snapshot = stream.step(30.0, nvml=_nvml(6))
    assert snapshot.derived.error_windows.count(key, ew.MINUTE, 30.0) == 7


def test_a_counter_quiet_for_an_hour_is_dropped() -> None:
    stream = Stream()
    stream.step(0.0, nvml=_nvml(0))
    assert stream.step(10.0, nvml=_nvml(1)).derived.error_windows.windows
    quiet = stream.step(10.0 + ew.HOUR + 2 * ew.HOUR_BUCKET, nvml=_nvml(1))
    assert dict(quiet.derived.error_windows.windows) == {}


def test_a_sample_carried_between_reads_is_not_counted_again() -> None:
    stream = Stream()
    stream.step(0.0, nvml=_nvml(0))
    first = stream.step(10.0, nvml=_nvml(4))
    windows = first.derived.error_windows
    # The next cycles carry the same sample: the very same windows, counted once.
    for t in (11.0, 12.0, 13.0):
        later = stream.step(t)
        assert later.derived.error_windows is windows


# --- PCIe replays: DCGM's 8 a minute --------------------------------------------------------


def _replays_per_minute(per_minute: int, minutes: int, read_every: float = 10.0) -> list[Severity]:
    """The worst replay severity of each read, at a steady rate read every ``read_every``."""
    stream = Stream()
    worst: list[Severity] = []
    t, total = 0.0, 0.0
    stream.step(t, nvml=_nvml(0))
    while t < minutes * 60:
        t += read_every
        total += per_minute * read_every / 60
        found = stream.findings(t, nvml=_nvml(int(total)))
        worst.append(max(_severities(found, errors.REPLAYS), default=Severity.INFO))
    return worst


def test_one_replay_never_warns() -> None:
    stream = Stream()
    stream.step(0.0, nvml=_nvml(7))
    assert stream.findings(1.0, nvml=_nvml(8)) == []
    assert stream.findings(2.0) == []


def test_three_replays_a_minute_are_no_warning() -> None:
    assert set(_replays_per_minute(3, 30)) == {Severity.INFO}


def test_ten_replays_a_minute_warn() -> None:
    worst = _replays_per_minute(10, 5)
    assert Severity.CRITICAL not in worst
    assert worst[6:] == [Severity.WARNING] * len(worst[6:])  # from the first full minute


def test_a_replay_storm_is_critical() -> None:
    assert _replays_per_minute(600, 3)[-1] is Severity.CRITICAL


def test_a_replay_finding_names_the_gpu_its_link_and_the_window() -> None:
    stream = Stream()
    stream.step(0.0, nvml=_nvml(0))
    (found,) = stream.findings(10.0, nvml=_nvml(20))
    assert found.key == f"gpu_pcie_replays{{device={GPU_A},gpu=2}}"
    assert found.severity is Severity.WARNING
    assert found.evidence["replays_errors_1m"] == 20.0
    assert f"GPU 2 ({GPU_A}) PCIe link" in found.message
    assert "replays 20 in 1 min (warning from 8)" in found.message


# --- NVLink ------------------------------------------------------------------------------------


def test_nvlink_crc_at_a_fifth_a_second_is_healthy_and_a_storm_is_not() -> None:
    stream = Stream()
    stream.step(0.0, nvml=_nvml(links=[_link(crc_flit=0, recovery=0)]))
    for i in range(1, 60):  # 0.2/s for ten minutes, read every 10 s
        assert stream.findings(i * 10.0, nvml=_nvml(links=[_link(crc_flit=2 * i, recovery=0)]))\
            == []  # fmt: skip
    # A storm: 500 a second.
    t, crc = 600.0, 118
    for _ in range(7):
        t, crc = t + 10, crc + 5000
        found = stream.findings(t, nvml=_nvml(links=[_link(crc_flit=crc, recovery=0)]))
    (link,) = found
    assert link.key == "nvlink_errors{gpu=2,nvlink=3}"
    assert link.severity is Severity.WARNING
    assert "NVLink 3 to gpu 0000:83:00.0" in link.message
    assert "crc_flit 30000 in 1 min" in link.message or "crc_flit 35000 in 1 min" in link.message


def test_one_nvlink_recovery_warns_and_repeated_ones_are_critical() -> None:
    stream = Stream()
    stream.step(0.0, nvml=_nvml(links=[_link(recovery=0)]))
    assert _severities(stream.findings(10.0, nvml=_nvml(links=[_link(recovery=1)])),
                       errors.NVLINK) == [Severity.WARNING]  # fmt: skip
    found = stream.findings(600.0, nvml=_nvml(links=[_link(recovery=3)]))
    assert _severities(found, errors.NVLINK) == [Severity.CRITICAL]
    assert "recovery 3 in 1 h" in found[0].message


# --- ECC -----------------------------------------------------------------------------------------


def test_corrected_ecc_errors_over_an_hour() -> None:
    stream = Stream()
    stream.step(0.0, nvml=_nvml(ecc=1000, at=0.0))
    assert stream.findings(60.0, nvml=_nvml(ecc=1013, at=60.0)) == []  # a few: healthy
    found = stream.findings(600.0, nvml=_nvml(ecc=1200, at=600.0))
    assert [(f.kind, f.severity) for f in found] == [(errors.ECC_CORRECTED, Severity.WARNING)]
    assert found[0].evidence["corrected_errors_1h"] == 200.0


# --- AER, from files in the kernel's format ----------------------------------------------------


def _aer_text(severity: str) -> str:
    return (AER_CAPTURE / f"aer_dev_{severity}").read_text()


def _scaled(text: str, add: int) -> str:
    """The file with ``add`` more errors of its first kind (and in its total)."""
    lines = text.splitlines()
    name, value = lines[0].split()
    lines[0] = f"{name} {int(value) + add}"
    total, count = lines[-1].split()
    lines[-1] = f"{total} {int(count) + add}"
    return "\n".join(lines) + "\n"


def _nonfatal_text() -> str:
    # The fixture's total line names the wrong class (see its README): renamed here.
    return _aer_text("nonfatal").replace("TOTAL_ERR_FATAL", "TOTAL_ERR_NONFATAL")


def test_the_fixtures_misnamed_total_is_refused() -> None:
    with pytest.raises(ParseError, match="TOTAL_ERR_FATAL in a nonfatal file"):
        parse_aer(_aer_text("nonfatal"), "nonfatal")
    assert parse_aer(_aer_text("correctable"), "correctable").total == 9


def _aer_topology(bdf: str, correctable: int = 0, nonfatal: int = 0, fatal: int = 0) -> Topology:
    records: tuple[AerRecord, ...] = (
        parse_aer(_scaled(_aer_text("correctable"), correctable), "correctable"),
        parse_aer(_scaled(_nonfatal_text(), nonfatal), "nonfatal"),
        parse_aer(_scaled(_aer_text("fatal"), fatal), "fatal"),
    )
    return topology(aer={bdf: records})


def test_the_captured_counts_are_a_baseline() -> None:
    # A function that counted errors before nodescope started: of unknown age, no finding.
    stream = Stream()
    stream.step(0.0, pci=_aer_topology(NVME))
    assert stream.findings(30.0, pci=_aer_topology(NVME)) == []


@pytest.mark.parametrize("bdf", [RP_SHARED, NVME, HCA, GPU_A])
def test_a_correctable_flood_warns_then_goes_critical_on_any_function(bdf: str) -> None:
    stream = Stream()
    stream.step(0.0, pci=_aer_topology(bdf))
    # An isolated correctable error: nothing.
    assert stream.findings(30.0, pci=_aer_topology(bdf, correctable=1)) == []
    # 12 in the next 30 s: a warning; 77 a second: critical.
    found = stream.findings(60.0, pci=_aer_topology(bdf, correctable=13))
    assert _severities(found, errors.AER) == [Severity.WARNING]
    found = stream.findings(90.0, pci=_aer_topology(bdf, correctable=13 + 77 * 30))
    assert _severities(found, errors.AER) == [Severity.CRITICAL]
    (finding,) = found
    assert finding.subjects == {"device": bdf, "severity": "correctable"}
    assert "in 1 min" in finding.message and bdf in finding.message
    assert "RxErr +2310" in finding.message
    if bdf == RP_SHARED:
        assert "a root port" in finding.message
    else:
        assert f"root port {RP_SHARED}" in finding.message


def test_uncorrectable_errors_keep_their_severities_from_the_first() -> None:
    stream = Stream()
    stream.step(0.0, pci=_aer_topology(GPU_A))
    found = stream.findings(30.0, pci=_aer_topology(GPU_A, nonfatal=1, fatal=1))
    by_class = {f.subjects["severity"]: f.severity for f in found}
    assert by_class == {"nonfatal": Severity.WARNING, "fatal": Severity.CRITICAL}
    # Held while they are in the minute (the alert rule holds them longer), then gone.
    assert len(stream.findings(60.0, pci=_aer_topology(GPU_A, nonfatal=1, fatal=1))) == 2
    assert stream.findings(100.0, pci=_aer_topology(GPU_A, nonfatal=1, fatal=1)) == []


# --- InfiniBand, from a real H100 node's sysfs ---------------------------------------------------


def _ib_tree(tmp_path: Path) -> Path:
    root = tmp_path / "ib"
    shutil.copytree(IB_CAPTURE / "sys", root / "sys")
    return root


def _bump(root: Path, device: str, name: str, add: int, hw: bool = False) -> None:
    path = (
        root / "sys/class/infiniband" / device / "ports/1" / ("hw_counters" if hw else "counters")
    )
    path = path / name
    path.write_text(str(int(path.read_text()) + add))


def _read(root: Path) -> InfinibandData:
    return ib.read_infiniband(Roots.under(root))


def test_the_real_node_is_healthy_and_its_saturated_counter_counts_nothing(tmp_path: Path) -> None:
    root = _ib_tree(tmp_path)
    stream = Stream()
    stream.step(0.0, infiniband=_read(root))
    assert stream.findings(10.0, infiniband=_read(root)) == []
    # mlx5_0's excessive_buffer_overrun_errors sits at 15, all ones of its 4 bits: it reads
    # no value, so no increase of it is ever counted.
    keys = {key for key, _, _ in ew.ib_readings(_read(root))}
    assert ew.CounterKey(ew.IB, ("mlx5_0", "1"), "excessive_buffer_overrun_errors") not in keys
    assert ew.CounterKey(ew.IB, ("mlx5_0", "1"), "port_rcv_errors") in keys
    assert ew.CounterKey(ew.IB_HW, ("mlx5_0", "1"), "roce_adp_retrans") in keys
    assert not any(k.counter in ("port_xmit_data", "port_xmit_wait") for k in keys)


def test_symbol_errors_at_a_healthy_bit_error_ratio_are_no_finding(tmp_path: Path) -> None:
    # One symbol error every two minutes at 400 Gb/s: a ratio of about 2e-14 over the hour.
    root = _ib_tree(tmp_path)
    stream = Stream()
    stream.step(0.0, infiniband=_read(root))
    for minute in range(2, 121, 2):
        _bump(root, "mlx5_4", "symbol_error", 1)
        assert stream.findings(minute * 60.0, infiniband=_read(root)) == [], minute


def test_symbol_errors_of_a_failing_link_warn_then_are_critical(tmp_path: Path) -> None:
    root = _ib_tree(tmp_path)
    stream = Stream()
    stream.step(0.0, infiniband=_read(root))
    # 3 a minute for an hour: 180 in the hour, over 1e-13 of 400 Gb/s (144): a warning.
    for minute in range(1, 61):
        _bump(root, "mlx5_4", "symbol_error", 3)
        found = stream.findings(minute * 60.0, infiniband=_read(root))
    assert _severities(found, errors.IB_ERRORS) == [Severity.WARNING]
    assert "bit error ratio 1.2e-13" in found[0].message
    # 40 in ten seconds: over 1e-12 of the minute's bits (24).
    _bump(root, "mlx5_4", "symbol_error", 40)
    found = stream.findings(3610.0, infiniband=_read(root))
    assert _severities(found, errors.IB_ERRORS) == [Severity.CRITICAL]


@pytest.mark.parametrize(
    ("name", "hw", "isolated", "flood", "severity"),
    [
        ("port_xmit_discards", False, 1, 300 * 10, Severity.WARNING),
        ("port_xmit_discards", False, 1, 700 * 10, Severity.CRITICAL),
        ("port_rcv_errors", False, 1, 700, Severity.CRITICAL),
        ("link_error_recovery", False, 1, 5, Severity.WARNING),
        ("port_rcv_remote_physical_errors", False, 1, 20, Severity.WARNING),
        ("local_link_integrity_errors", False, 1, 12, Severity.CRITICAL),
        ("VL15_dropped", False, 1, 700, Severity.WARNING),
        ("port_rcv_constraint_errors", False, 1, 11, Severity.WARNING),
        ("out_of_sequence", True, 1, 70000, Severity.CRITICAL),
        ("local_ack_timeout_err", True, 1, 15, Severity.WARNING),
        ("roce_adp_retrans", True, 1, 100, Severity.WARNING),
        ("out_of_buffer", True, 1, 1000, Severity.WARNING),
    ],
)
def test_every_error_counter_is_judged_by_name(
    tmp_path: Path, name: str, hw: bool, isolated: int, flood: int, severity: Severity
) -> None:
    root = _ib_tree(tmp_path)
    stream = Stream()
    stream.step(0.0, infiniband=_read(root))
    _bump(root, "mlx5_5", name, isolated, hw)
    assert stream.findings(10.0, infiniband=_read(root)) == []
    _bump(root, "mlx5_5", name, flood, hw)
    (found,) = stream.findings(20.0, infiniband=_read(root))
    assert found.key == "ib_port_errors{hca=mlx5_5,port=1}"
    assert found.severity is severity
    assert found.message.startswith("mlx5_5 port 1")
    assert f"{name} {isolated + flood} in" in found.message


def test_one_link_down_warns_and_a_flapping_link_is_critical(tmp_path: Path) -> None:
    root = _ib_tree(tmp_path)
    stream = Stream()
    stream.step(0.0, infiniband=_read(root))
    _bump(root, "mlx5_6", "link_downed", 1)
    assert _severities(stream.findings(10.0, infiniband=_read(root)), errors.IB_ERRORS) == [
        Severity.WARNING
    ]
    _bump(root, "mlx5_6", "link_downed", 2)
    assert _severities(stream.findings(900.0, infiniband=_read(root)), errors.IB_ERRORS) == [
        Severity.CRITICAL
    ]


def test_xmit_wait_is_never_an_error(tmp_path: Path) -> None:
    root = _ib_tree(tmp_path)
    stream = Stream()
    stream.step(0.0, infiniband=_read(root))
    _bump(root, "mlx5_0", "port_xmit_wait", 10**9)
    found = stream.findings(10.0, infiniband=_read(root))
    assert [f.kind for f in found] == [errors.IB_XMIT_WAIT]


def test_every_error_counter_of_the_kernel_has_a_row() -> None:
    for name in ERROR_COUNTERS:
        assert (ew.IB, name) in BY_COUNTER, name


# --- the table and its keys ----------------------------------------------------------------------


def test_rows_of_error_counters_never_judge_one_error_alone() -> None:
    events = {("aer", "nonfatal"), ("aer", "fatal"), ("nvlink", "recovery"), ("ib", "link_downed")}
    for row in THRESHOLDS:
        if (row.family, row.counter) in events or row.per_bit:
            continue
        for bound in (row.warning, row.critical):
            assert bound is None or bound >= 2, row
        assert row.reference and row.why, row


def test_the_configured_bounds_are_the_tables() -> None:
    assert SETTINGS.pcie_replays_warning_per_minute == default_of(
        "pcie_replays_warning_per_minute"
    ) == 8.0  # fmt: skip
    raised = from_mapping({"detectors": {"errors": {"pcie_replays_warning_per_minute": 30}}})
    stream = Stream()
    stream.step(0.0, nvml=_nvml(0))
    snapshot = stream.step(10.0, nvml=_nvml(20))
    assert errors.detect(None, snapshot, raised.detectors.errors) == []
    with pytest.raises(ConfigError, match="pcie_replays_warning_per_minute"):
        from_mapping({"detectors": {"errors": {"pcie_replays_warning_per_minute": 500}}})
    with pytest.raises(ConfigError, match="ib_symbol_ber_warning"):
        from_mapping({"detectors": {"errors": {"ib_symbol_ber_warning": 0}}})


def test_docs_table_is_the_codes() -> None:
    text = (REPO / "docs/thresholds.md").read_text()
    begin, end = "<!-- BEGIN thresholds -->\n", "<!-- END thresholds -->"
    shown = text[text.index(begin) + len(begin) : text.index(end)]
    assert shown == markdown_table()


def test_the_shipped_rules_use_the_tables_bounds() -> None:
    rules = (REPO / "exporters/prometheus/alerts.yml").read_text()

    def bounds(family: str, counter: str) -> tuple[str, str]:
        (row,) = (r for r in BY_COUNTER[(family, counter)] if r.window_seconds == ew.MINUTE)
        return f"{row.warning:g}", f"{row.critical:g}"

    warn, crit = bounds(ew.AER, "correctable")
    assert f'rate5m{{severity="correctable"}} * 60 >= {warn} < {crit}' in rules
    assert f'rate5m{{severity="correctable"}} * 60 >= {crit}\n' in rules
    warn, crit = bounds(ew.PCIE_REPLAY, "replays")
    assert f"nodescope:gpu_pcie_replays:rate5m * 60 >= {warn} < {crit}" in rules
    warn, crit = bounds(ew.NVLINK, "crc_flit")
    assert f'counter=~"crc_flit|crc_data"}} * 60 >= {warn} < {crit})' in rules
    warn, crit = bounds(ew.IB, "port_xmit_discards")
    assert f'counter="port_xmit_discards"}} * 60 >= {warn} < {crit})' in rules
    for row in BY_COUNTER[(ew.IB, "symbol_error")]:
        bound = row.warning if row.warning is not None else row.critical
        assert f">= {bound:.0e}" in rules
