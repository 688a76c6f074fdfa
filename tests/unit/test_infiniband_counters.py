"""Every InfiniBand error and congestion counter of a port, by name: what each counts
(errors apart from congestion), the bound on counter files, their rates between full reads,
saturation, and the metric families they go to. On real captures (an H100 node, the sysfs
fixtures of prometheus/procfs and prometheus/node_exporter) and on trees built from them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.model.infiniband import (
    COUNTER_KINDS,
    ERROR_COUNTER_BITS,
    HW_CONGESTION_COUNTERS,
    HW_ERROR_COUNTERS,
    HW_TRAFFIC_COUNTERS,
    KIND_CONGESTION,
    KIND_ERROR,
    KIND_OTHER,
    KIND_TRAFFIC,
    counter_kind,
)
from nodescope.roots import Roots
from nodescope.sources import infiniband as ib
from tests.unit.test_infiniband import _metrics

CAPTURES = Path(__file__).resolve().parents[1] / "fixtures" / "captures"
H100 = CAPTURES / "h100-node-infiniband"
PROCFS = CAPTURES / "procfs-sysfs-infiniband"
NODE_EXPORTER = CAPTURES / "node-exporter-sysfs-infiniband"

#: The hw_counters of the H100 node's ConnectX-7 ports and their kinds.
_H100_HW_KINDS = {
    "duplicate_request": KIND_ERROR,
    "implied_nak_seq_err": KIND_ERROR,
    "local_ack_timeout_err": KIND_ERROR,
    "out_of_buffer": KIND_ERROR,
    "out_of_sequence": KIND_ERROR,
    "packet_seq_err": KIND_ERROR,
    "req_cqe_error": KIND_ERROR,
    "req_cqe_flush_error": KIND_ERROR,
    "req_remote_access_errors": KIND_ERROR,
    "req_remote_invalid_request": KIND_ERROR,
    "resp_cqe_error": KIND_ERROR,
    "resp_cqe_flush_error": KIND_ERROR,
    "resp_local_length_error": KIND_ERROR,
    "resp_remote_access_errors": KIND_ERROR,
    "rnr_nak_retry_err": KIND_ERROR,
    "roce_adp_retrans": KIND_ERROR,
    "roce_adp_retrans_to": KIND_ERROR,
    "roce_slow_restart": KIND_ERROR,
    "roce_slow_restart_cnps": KIND_CONGESTION,
    "roce_slow_restart_trans": KIND_ERROR,
    "rx_atomic_requests": KIND_TRAFFIC,
    "rx_dct_connect": KIND_TRAFFIC,
    "rx_icrc_encapsulated": KIND_ERROR,
    "rx_read_requests": KIND_TRAFFIC,
    "rx_write_requests": KIND_TRAFFIC,
}


def _bump(path: Path, by: int) -> None:
    value = int(path.read_text()) if path.exists() else 0
    path.write_text(f"{value + by}\n")


# ------------------------------------------------------------------------------------------
# What each counter counts


def test_every_kernel_counters_file_has_its_kind() -> None:
    for name in ERROR_COUNTER_BITS:
        assert counter_kind(name) == KIND_ERROR, name
    assert counter_kind("port_xmit_wait") == KIND_CONGESTION
    for name in ("port_xmit_data", "port_rcv_data", "port_xmit_packets", "unicast_rcv_packets"):
        assert counter_kind(name) == KIND_TRAFFIC, name


def test_known_driver_counters_keep_their_table_kind() -> None:
    for names, kind in (
        (HW_ERROR_COUNTERS, KIND_ERROR),
        (HW_CONGESTION_COUNTERS, KIND_CONGESTION),
        (HW_TRAFFIC_COUNTERS, KIND_TRAFFIC),
    ):
        for name in names:
            assert counter_kind(name, hw=True) == kind, name
    # The congestion notifications are never errors, whatever else their name says.
    assert not HW_CONGESTION_COUNTERS & HW_ERROR_COUNTERS
    for name in ("np_cnp_sent", "rp_cnp_handled", "np_ecn_marked_roce_packets"):
        assert counter_kind(name, hw=True) == KIND_CONGESTION


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        # real names the tables do not hold
        ("port_rcv_discards", KIND_ERROR),  # mlx4, node_exporter's fixture
        ("rx_roce_discards", KIND_ERROR),
        ("req_transport_retries_exceeded", KIND_ERROR),
        ("cc_rx_cnp_pkts", KIND_CONGESTION),
        ("rx_pause_ctrl_phy", KIND_CONGESTION),
        ("ecn_marked_pkts_err", KIND_CONGESTION),  # congestion words first
        ("rx_vport_rdma_unicast_packets", KIND_OTHER),
        ("lifespan_x", KIND_OTHER),
        ("ERR", KIND_ERROR),
    ],
)
def test_unknown_names_are_judged_by_their_words(name: str, kind: str) -> None:
    assert counter_kind(name, hw=True) == kind
    assert counter_kind(name) == kind


@given(name=st.text(max_size=80))
def test_counter_kind_answers_one_kind_for_any_name(name: str) -> None:
    assert counter_kind(name) in COUNTER_KINDS
    assert counter_kind(name, hw=True) in COUNTER_KINDS


def test_h100_capture_hw_counters_have_the_kinds_of_their_meaning() -> None:
    data = ib.read_infiniband(Roots.under(H100))
    for port in data.ports():
        names = {c.name for c in port.hw_counters}
        assert names == set(_H100_HW_KINDS), port.device
        for name, kind in _H100_HW_KINDS.items():
            assert counter_kind(name, hw=True) == kind, name


# ------------------------------------------------------------------------------------------
# node_exporter's fixture: an iWARP port without PerfMgmt, an unknown counters/ file and a
# saturated 32-bit port_xmit_wait


def test_node_exporter_capture_no_pma_unknown_name_and_saturation() -> None:
    data = ib.read_infiniband(Roots.under(NODE_EXPORTER))
    assert not data.skipped
    assert [d.name for d in data.devices] == ["i40iw0", "mlx4_0"]
    (iwarp,) = data.devices[0].ports
    # Every counters/ file of the i40iw port reads "N/A (no PMA)": all absent, none skipped.
    assert iwarp.counters == ()
    mlx4_1 = data.devices[1].ports[0]
    base = NODE_EXPORTER / "sys/class/infiniband/mlx4_0/ports/1/counters"
    assert [c.name for c in mlx4_1.counters] == sorted(p.name for p in base.iterdir())
    discards = mlx4_1.counter("port_rcv_discards")
    assert discards is not None and discards.bits is None  # not in the kernel's table
    wait = mlx4_1.counter("port_xmit_wait")
    assert wait is not None and wait.value == 2**32 - 1 and wait.saturated
    m = _metrics(data)
    port = (("device", "mlx4_0"), ("port", "1"))
    errors = m["nodescope_infiniband_port_errors_total"]
    # the unknown file whose name says discards is exported with the errors, not dropped
    assert errors[(("counter", "port_rcv_discards"), *port)] == 0
    assert errors[(("counter", "port_xmit_discards"), *port)] == 5
    saturated = m["nodescope_infiniband_port_errors_saturated"]
    assert saturated[(("counter", "port_xmit_discards"), *port)] == 0
    assert not any(dict(k)["counter"] == "port_rcv_discards" for k in saturated)  # width unknown
    assert m["nodescope_infiniband_port_transmit_wait_total"][port] == 2**32 - 1


def test_saturated_counter_has_no_rate(tmp_path: Path) -> None:
    """A 32-bit ``port_xmit_wait`` at all-ones (node_exporter's mlx4 port) and a 16-bit
    ``symbol_error`` reaching its maximum have no rate: the change past the maximum is
    unknown. A 64-bit driver counter beyond 2^32 has its rate as usual."""
    shutil.copytree(NODE_EXPORTER / "sys", tmp_path / "sys")
    port_dir = tmp_path / "sys/class/infiniband/mlx4_0/ports/1"
    (port_dir / "counters" / "symbol_error").write_text("65000\n")
    (port_dir / "hw_counters").mkdir()
    (port_dir / "hw_counters" / "np_ecn_marked_roce_packets").write_text(f"{2**40}\n")
    now = [0.0]
    source = ib.InfinibandSource(slow_every=1, clock=lambda: now[0])
    roots = Roots.under(tmp_path)
    first = source.collect(roots)
    now[0] = 10.0
    (port_dir / "counters" / "symbol_error").write_text("65535\n")
    _bump(port_dir / "counters" / "port_xmit_discards", 20)
    _bump(port_dir / "hw_counters" / "np_ecn_marked_roce_packets", 5000)
    second = source.collect(roots)
    rates = ib.port_rates(first, second, 10.0).port("mlx4_0", 1)
    assert rates is not None
    assert rates.rate("symbol_error") is None
    assert rates.xmit_wait_per_second is None
    assert rates.rate("port_xmit_discards") == 2.0
    assert rates.rate("np_ecn_marked_roce_packets") == 500.0
    assert {r.name for r in rates.congestion} == {"port_xmit_wait", "np_ecn_marked_roce_packets"}
    m = _metrics(second)
    key = (("counter", "symbol_error"), ("device", "mlx4_0"), ("port", "1"))
    assert m["nodescope_infiniband_port_errors_saturated"][key] == 1
    source.close()


# ------------------------------------------------------------------------------------------
# Rates by name between full reads, errors apart from congestion


@pytest.fixture
def h100_copy(tmp_path: Path) -> Path:
    shutil.copytree(H100 / "sys", tmp_path / "sys")
    return tmp_path


def test_every_error_and_congestion_counter_reaches_port_rates_by_name(h100_copy: Path) -> None:
    port_dir = h100_copy / "sys/class/infiniband/mlx5_bond_0/ports/1"
    # A RoCE port with the congestion counters mlx5 adds when congestion control is on.
    for name in ("np_cnp_sent", "rp_cnp_handled", "np_ecn_marked_roce_packets"):
        (port_dir / "hw_counters" / name).write_text("0\n")
    now = [0.0]
    source = ib.InfinibandSource(clock=lambda: now[0])
    roots = Roots.under(h100_copy)
    records = []
    moves = {
        "counters": {name: 1 for name in ERROR_COUNTER_BITS},
        "hw_counters": {name: 2 for name in _H100_HW_KINDS}
        | {"np_cnp_sent": 300, "rp_cnp_handled": 200, "np_ecn_marked_roce_packets": 900},
    }
    for second in range(11):
        now[0] = float(second)
        for directory, names in moves.items():
            for name, by in names.items():
                _bump(port_dir / directory / name, by)
        _bump(port_dir / "counters" / "port_xmit_wait", 50)
        records.append(source.collect(roots))
    rates = ib.port_rates(records[9], records[10], 1.0).port("mlx5_bond_0", 1)
    assert rates is not None
    # Full reads on seconds 0 and 10: the slow counters' rates over those 10 s.
    for name in ERROR_COUNTER_BITS:
        assert rates.rate(name) == 1.0, name
    for name in _H100_HW_KINDS:
        assert rates.rate(name) == 2.0, name
    assert rates.rate("np_cnp_sent") == 300.0
    errors = {r.name: r.per_second for r in rates.errors}
    congestion = {r.name: r.per_second for r in rates.congestion}
    assert set(errors) == set(ERROR_COUNTER_BITS) | {
        n for n, k in _H100_HW_KINDS.items() if k == KIND_ERROR
    }
    assert congestion == {
        "port_xmit_wait": 50.0,  # every run: over the one-second interval
        "roce_slow_restart_cnps": 2.0,
        "np_cnp_sent": 300.0,
        "rp_cnp_handled": 200.0,
        "np_ecn_marked_roce_packets": 900.0,
    }
    assert not errors.keys() & congestion.keys()
    assert rates.xmit_wait_per_second == 50.0
    # errors_per_second stays the link's own: the counters/ error counters.
    assert rates.errors_per_second == float(len(ERROR_COUNTER_BITS))
    # hw_counters keeps every driver counter, lifespan aside
    assert {r.name for r in rates.hw_counters} == set(_H100_HW_KINDS) | {
        "np_cnp_sent",
        "rp_cnp_handled",
        "np_ecn_marked_roce_packets",
    }
    source.close()


def test_hw_counters_are_read_on_full_reads_only(h100_copy: Path) -> None:
    port_dir = h100_copy / "sys/class/infiniband/mlx5_0/ports/1"
    source = ib.InfinibandSource(slow_every=3)
    roots = Roots.under(h100_copy)
    first = source.collect(roots).devices[0].ports[0]
    _bump(port_dir / "hw_counters" / "out_of_buffer", 7)
    (port_dir / "hw_counters" / "np_cnp_sent").write_text("5\n")
    for _ in range(2):
        port = source.collect(roots).devices[0].ports[0]
        assert port.hw_counters is first.hw_counters
    port = source.collect(roots).devices[0].ports[0]
    found = port.hw_counter("out_of_buffer")
    before = first.hw_counter("out_of_buffer")
    assert found is not None and before is not None and found.value == before.value + 7
    assert port.hw_counter("np_cnp_sent") == ib.Counter("np_cnp_sent", 5, 64)
    source.close()


# ------------------------------------------------------------------------------------------
# Bounds and hostile directories


def test_counter_files_are_bounded_per_directory_and_names_checked(h100_copy: Path) -> None:
    hw = h100_copy / "sys/class/infiniband/mlx5_0/ports/1/hw_counters"
    present = len(list(hw.iterdir()))
    extra = ib.MAX_COUNTER_FILES - present + 5
    for i in range(extra):
        (hw / f"zz_extra_{i:04d}").write_text(f"{i}\n")
    # both sort before the extra ones: refused by name, each still counts to the cap
    (hw / "a b").write_text("1\n")
    (hw / ("x" * 65)).write_text("1\n")
    data = ib.read_infiniband(Roots.under(h100_copy))
    port = data.devices[0].ports[0]
    assert port.hw_counters_lifespan_ms == 12
    # lifespan is not a counter; the two bad names are refused; the cap counts files read.
    assert len(port.hw_counters) == ib.MAX_COUNTER_FILES - 2 - 1
    assert data.skipped.counts[ib.SKIP_COUNTER_NAME] == 2
    assert data.skipped.counts[ib.SKIP_COUNTER_OVER_LIMIT] == 5 + 2
    # The other ports are read as usual.
    assert all(len(p.hw_counters) == len(_H100_HW_KINDS) for p in list(data.ports())[1:])
    m = _metrics(data)
    hw_series = sum(
        1
        for family in (
            "nodescope_infiniband_port_hw_errors_total",
            "nodescope_infiniband_port_congestion_total",
            "nodescope_infiniband_port_hw_stats_total",
        )
        for labels in m.get(family, {})
        if ("device", "mlx5_0") in labels
    )
    assert hw_series == len(port.hw_counters)


_NAMES = st.one_of(
    st.sampled_from([*_H100_HW_KINDS, "np_cnp_sent", "lifespan", "active_qps"]),
    st.from_regex(r"[a-z_]{1,20}", fullmatch=True),
    # Any name a file system takes: no "/", no NUL, no lone surrogate (not a file name).
    st.text(
        st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)),
        min_size=1,
        max_size=70,
    ),
)
_VALUES = st.one_of(
    st.integers(0, 2**64 - 1).map(lambda v: f"{v}\n"),
    st.sampled_from(["N/A (no PMA)\n", "", "\n", "-1\n", "1 2\n", "0x10\n", f"{2**64}\n"]),
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=20),
    st.binary(max_size=20).map(lambda b: b.decode("latin-1")),
)


@settings(max_examples=40, deadline=None)
@given(files=st.dictionaries(_NAMES, _VALUES, max_size=12))
def test_any_hw_counters_directory_is_read_or_counted_never_raises(
    tmp_path_factory: pytest.TempPathFactory, files: dict[str, str]
) -> None:
    root = tmp_path_factory.mktemp("ib")
    port_dir = root / "sys/class/infiniband/mlx5_0/ports/1"
    (port_dir / "hw_counters").mkdir(parents=True)
    (port_dir / "counters").mkdir()
    (port_dir / "counters" / "symbol_error").write_text("3\n")
    written: dict[str, str] = {}
    for name, text in files.items():
        if name in (".", "..") or name.isspace():
            continue
        try:
            (port_dir / "hw_counters" / name).write_text(text, newline="")
        except OSError:  # a name the filesystem refuses (too long in bytes)
            continue
        written[name] = text
    data = ib.read_infiniband(Roots.under(root))
    (port,) = data.ports()
    assert port.counter("symbol_error") == ib.Counter("symbol_error", 3, 16)
    read = {c.name: c.value for c in port.hw_counters}
    for name, value in read.items():
        assert ib.COUNTER_NAME_RE.fullmatch(name)
        assert ib.parse_counter(written[name]) == value
    # each written file is a counter, lifespan, absent (no PMA / empty read as such), or counted
    refused = sum(data.skipped.counts.values())
    lifespan = 1 if port.hw_counters_lifespan_ms is not None else 0
    absent = sum(
        1
        for name, text in written.items()
        if ib.COUNTER_NAME_RE.fullmatch(name) and text.strip() == "N/A (no PMA)"
    )
    assert len(read) + lifespan + refused + absent == len(written)
    _metrics(data)  # renders whatever was read
