"""The infiniband source: parsers on inline strings, the reader on a real H100 node's capture
and on built trees, counter widths and wraps in port_rates, and the exported metrics."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from nodescope import jsonout
from nodescope.errors import ParseError
from nodescope.model.derived import Derived, Figure
from nodescope.model.skips import SkipTally
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.roots import Roots
from nodescope.sources import infiniband as ib
from nodescope.sources.registry import SOURCES
from nodescope_exporters import network_metrics
from nodescope_exporters.prometheus import render

CAPTURE = Path(__file__).resolve().parents[1] / "fixtures" / "captures" / "h100-node-infiniband"
CAPTURE_CLASS = CAPTURE / "sys" / "class" / "infiniband"
HCAS = ("mlx5_0", "mlx5_1", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_9")


# ------------------------------------------------------------------------------------------
# Parsers on inline strings


@pytest.mark.parametrize(
    ("text", "code", "name"),
    [
        ("4: ACTIVE\n", 4, "ACTIVE"),
        ("1: DOWN\n", 1, "DOWN"),
        ("5: LinkUp\n", 5, "LinkUp"),
        ("3: Disabled", 3, "Disabled"),
        ("7: Phy Test\n", 7, "Phy Test"),
        ("0: <unknown>\n", 0, "<unknown>"),
    ],
)
def test_parse_state(text: str, code: int, name: str) -> None:
    assert ib.parse_state(text, "state") == ib.PortState(code, name)


@pytest.mark.parametrize(
    "text", ["ACTIVE\n", "4:ACTIVE\n", "4: \n", "", "\n", "x: ACTIVE", "-1: X"]
)
def test_parse_state_rejects(text: str) -> None:
    with pytest.raises(ParseError) as err:
        ib.parse_state(text, "/sys/class/infiniband/mlx5_0/ports/1/state")
    assert err.value.source == "/sys/class/infiniband/mlx5_0/ports/1/state"
    assert err.value.line == 1


def test_parse_state_two_lines_names_line_2() -> None:
    with pytest.raises(ParseError) as err:
        ib.parse_state("4: ACTIVE\n4: ACTIVE\n", "state")
    assert err.value.line == 2
    assert "state:2" in str(err.value)


@pytest.mark.parametrize(
    ("text", "gbps", "lanes", "speed"),
    [
        ("400 Gb/sec (4X NDR)\n", 400.0, 4, "NDR"),
        ("200 Gb/sec (2X NDR)\n", 200.0, 2, "NDR"),
        ("2.5 Gb/sec (1X SDR)\n", 2.5, 1, "SDR"),
        ("56 Gb/sec (4X FDR)\n", 56.0, 4, "FDR"),
        ("40 Gb/sec (4X FDR10)\n", 40.0, 4, "FDR10"),
        ("800 Gb/sec (4X XDR)\n", 800.0, 4, "XDR"),
        ("10 Gb/sec (4X)\n", 10.0, 4, None),
        ("30 Gb/sec (12X)", 30.0, 12, None),
    ],
)
def test_parse_rate(text: str, gbps: float, lanes: int, speed: str | None) -> None:
    rate = ib.parse_rate(text, "rate")
    assert rate == ib.LinkRate(gbps, lanes, speed)
    assert rate.bytes_per_second == gbps * 1e9 / 8


def test_rate_names_agree_with_lane_table() -> None:
    # The kernel prints lanes × per-lane rate: check our table against real-world strings.
    for text in ("400 Gb/sec (4X NDR)", "200 Gb/sec (4X HDR)", "100 Gb/sec (4X EDR)"):
        rate = ib.parse_rate(text, "rate")
        assert rate.speed is not None
        assert ib.LANE_GBPS[rate.speed] * rate.lanes == rate.gbps


@pytest.mark.parametrize(
    "text",
    ["400 Gb/s (4X NDR)", "400 Gb/sec", "Gb/sec (4X NDR)", "400 Gb/sec (0X NDR)", "400 Gb/sec (X)"],
)
def test_parse_rate_rejects(text: str) -> None:
    with pytest.raises(ParseError):
        ib.parse_rate(text, "rate")


def test_parse_counter() -> None:
    assert ib.parse_counter("230539874932483\n", "c") == 230539874932483
    assert ib.parse_counter("0", "c") == 0
    assert ib.parse_counter(f"{2**64 - 1}\n", "c") == 2**64 - 1
    # Old kernels print this when the HCA has no PerfMgmt agent: absent, not zero.
    assert ib.parse_counter("N/A (no PMA)\n", "c") is None


@pytest.mark.parametrize("text", ["-1\n", "1 2\n", "0x10\n", "\n", "12abc", "٣\n", "1\n2\n"])
def test_parse_counter_rejects(text: str) -> None:
    with pytest.raises(ParseError):
        ib.parse_counter(text, "c")


def test_parse_node_guid_and_attributes() -> None:
    assert ib.parse_node_guid("0C42:A103:0012:3456\n", "g") == "0c42:a103:0012:3456"
    with pytest.raises(ParseError):
        ib.parse_node_guid("0c42a10300123456\n", "g")
    assert ib.parse_attribute("28.41.1000\n", "fw_ver") == "28.41.1000"
    assert ib.parse_link_layer("Ethernet\n", "link_layer") == "Ethernet"
    with pytest.raises(ParseError):
        ib.parse_link_layer("Infini Band\n", "link_layer")


@pytest.mark.parametrize(
    ("parse", "text", "value"),
    [
        # mlx4's link_layer as a real capture holds it: the value, then two newlines.
        (ib.parse_link_layer, "InfiniBand\n\n", "InfiniBand"),
        (ib.parse_link_layer, "Ethernet \n", "Ethernet"),
        (ib.parse_state, "4: ACTIVE\n\n", ib.PortState(4, "ACTIVE")),
        (ib.parse_state, "5: LinkUp\t\n \n", ib.PortState(5, "LinkUp")),
        (ib.parse_rate, "40 Gb/sec (4X QDR)\n\n", ib.LinkRate(40.0, 4, "QDR")),
        (ib.parse_counter, "17\n\n", 17),
        (ib.parse_counter, "17 \n", 17),
        (ib.parse_node_guid, "0002:c903:0031:7f40\r\n", "0002:c903:0031:7f40"),
        (ib.parse_attribute, "2.42.5000\n\n\n", "2.42.5000"),
    ],
)
def test_parsers_take_trailing_whitespace(parse: object, text: str, value: object) -> None:
    assert callable(parse)
    assert parse(text, "attr") == value


@pytest.mark.parametrize("text", ["4: ACTIVE\n\n4: ACTIVE\n", "InfiniBand\n\nEthernet\n"])
def test_parsers_still_refuse_a_second_value_after_blank_lines(text: str) -> None:
    with pytest.raises(ParseError):
        ib.parse_link_layer(text, "attr") if "Ethernet" in text else ib.parse_state(text, "s")


def test_counter_bits_follow_the_kernel_tables() -> None:
    extended = {"port_xmit_data": 5, "unicast_xmit_packets": 1}
    legacy = {"port_xmit_data": 5, "port_rcv_data": 7}
    big = {"port_xmit_data": 1 << 33}
    assert ib.counter_bits("port_xmit_data", extended) == 64
    assert ib.counter_bits("port_rcv_packets", extended) == 64
    assert ib.counter_bits("port_xmit_data", legacy) == 32
    assert ib.counter_bits("port_rcv_packets", big) == 64
    assert ib.counter_bits("port_xmit_wait", legacy) == 32
    assert ib.counter_bits("symbol_error", legacy) == 16
    assert ib.counter_bits("link_downed", legacy) == 8
    assert ib.counter_bits("local_link_integrity_errors", legacy) == 4
    assert ib.counter_bits("unicast_rcv_packets", extended) == 64
    assert ib.counter_bits("some_vendor_counter", legacy) is None


def test_pci_address_from_path() -> None:
    assert (
        ib.pci_address_from_path("/sys/devices/pci0000:00/0000:00:01.0/0000:17:00.1")
        == "0000:17:00.1"
    )
    assert ib.pci_address_from_path("/sys/devices/pci0000:00/0000:00:03.0/virtio2") == (
        "0000:00:03.0"
    )
    assert ib.pci_address_from_path("/sys/devices/virtual/net/lo") is None


# ------------------------------------------------------------------------------------------
# The real capture of an H100 node


@pytest.fixture(scope="module")
def capture() -> ib.InfinibandData:
    return ib.read_infiniband(Roots.under(CAPTURE))


def test_capture_devices(capture: ib.InfinibandData) -> None:
    assert tuple(d.name for d in capture.devices) == (*HCAS, "mlx5_bond_0")
    for device in capture.devices[:8]:
        assert (device.hca_type, device.fw_ver, device.board_id) == (
            "MT4129",
            "28.41.1000",
            "MT_0000000838",
        )
        # The capture has no node_guid file and no device link.
        assert device.node_guid is None
        assert device.pci_address is None
        assert device.netdevs == ()
        assert device.hw_counters == ()
        assert [p.port for p in device.ports] == [1]
    bond = capture.devices[-1]
    assert (bond.hca_type, bond.fw_ver, bond.board_id) == ("MT41692", "32.38.3056", "MT_0000000884")


def test_capture_port_state_and_rate(capture: ib.InfinibandData) -> None:
    port = capture.devices[0].ports[0]
    assert (port.device, port.port) == ("mlx5_0", 1)
    assert port.state == ib.PortState(4, "ACTIVE")
    assert port.phys_state == ib.PortState(5, "LinkUp")
    assert port.rate == ib.LinkRate(400.0, 4, "NDR")
    assert port.rate.bytes_per_second == 50e9
    assert port.link_layer == "InfiniBand"
    bond = capture.devices[-1].ports[0]
    assert bond.rate == ib.LinkRate(200.0, 2, "NDR")
    assert bond.link_layer == "Ethernet"


def test_capture_counters(capture: ib.InfinibandData) -> None:
    port = capture.devices[0].ports[0]
    assert port.counter("port_rcv_data") == ib.Counter("port_rcv_data", 230539874932483, 64)
    assert port.counter("port_xmit_data") == ib.Counter("port_xmit_data", 230442669431839, 64)
    assert port.rcv_bytes == 230539874932483 * 4 == 922159499729932
    assert port.xmit_bytes == 230442669431839 * 4
    assert port.counter("port_rcv_packets") == ib.Counter("port_rcv_packets", 317548853677, 64)
    assert port.counter("port_xmit_wait") == ib.Counter("port_xmit_wait", 2489603687, 32)
    assert port.counter("port_rcv_errors") == ib.Counter("port_rcv_errors", 14, 16)
    assert port.counter("port_rcv_switch_relay_errors") == ib.Counter(
        "port_rcv_switch_relay_errors", 1, 16
    )
    # A 4-bit counter stuck at 15: saturated, its later increases unknown.
    overrun = port.counter("excessive_buffer_overrun_errors")
    assert overrun == ib.Counter("excessive_buffer_overrun_errors", 15, 4)
    assert overrun is not None and overrun.saturated
    assert not port.counter("port_rcv_errors").saturated  # type: ignore[union-attr]
    assert port.hw_counter("rx_write_requests") == ib.Counter("rx_write_requests", 3809045607, 64)
    assert port.hw_counter("roce_adp_retrans") == ib.Counter("roce_adp_retrans", 3, 64)
    assert port.hw_counters_lifespan_ms == 12
    assert port.hw_counter("lifespan") is None


def test_capture_every_value_matches_its_file(capture: ib.InfinibandData) -> None:
    for port in capture.ports():
        port_dir = CAPTURE_CLASS / port.device / "ports" / str(port.port)
        files = sorted(p.name for p in (port_dir / "counters").iterdir())
        assert [c.name for c in port.counters] == files
        for counter in port.counters:
            assert counter.value == int((port_dir / "counters" / counter.name).read_text())
        hw_files = sorted(p.name for p in (port_dir / "hw_counters").iterdir())
        assert [c.name for c in port.hw_counters] == [n for n in hw_files if n != "lifespan"]
        for counter in port.hw_counters:
            assert counter.value == int((port_dir / "hw_counters" / counter.name).read_text())


PROCFS_CAPTURE = CAPTURE.parent / "procfs-sysfs-infiniband"


def test_procfs_capture_every_attribute_and_counter_matches_its_file() -> None:
    """prometheus/procfs's fixture: three vendors' HCAs, attributes with one newline, two
    newlines (mlx4_0 port 2's ``link_layer``) and none (mlx5_0's ``node_guid``)."""
    data = ib.read_infiniband(Roots.under(PROCFS_CAPTURE))
    assert not data.skipped
    base = PROCFS_CAPTURE / "sys" / "class" / "infiniband"
    assert [d.name for d in data.devices] == ["hfi1_0", "mlx4_0", "mlx5_0"]
    for device in data.devices:
        for name in ("fw_ver", "hca_type", "board_id", "node_guid"):
            path = base / device.name / name
            expected = path.read_text().strip() if path.exists() else None
            assert getattr(device, name) == expected
        for port in device.ports:
            port_dir = base / device.name / "ports" / str(port.port)
            assert port.link_layer == (port_dir / "link_layer").read_text().strip()
            assert port.state == ib.parse_state((port_dir / "state").read_text().strip())
            assert port.rate is not None and port.rate.lanes in (1, 4)
            files = sorted(p.name for p in (port_dir / "counters").iterdir())
            assert [c.name for c in port.counters] == files
            for counter in port.counters:
                assert counter.value == int((port_dir / "counters" / counter.name).read_text())
    assert (base / "mlx4_0" / "ports" / "2" / "link_layer").read_bytes() == b"InfiniBand\n\n"


_ATTRIBUTE_TEXT = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["4: ACTIVE", "40 Gb/sec (4X QDR)", "InfiniBand", "17"]).flatmap(
        lambda v: st.tuples(st.text(" \t\n\r", max_size=4), st.just(v)).map(
            lambda pair: v + pair[0]
        )
    ),
)


@settings(max_examples=60, deadline=None)
@given(
    state=_ATTRIBUTE_TEXT,
    rate=_ATTRIBUTE_TEXT,
    link_layer=_ATTRIBUTE_TEXT,
    counter=_ATTRIBUTE_TEXT,
)
def test_reader_over_any_attribute_text_skips_and_counts_never_raises(
    tmp_path_factory: pytest.TempPathFactory, state: str, rate: str, link_layer: str, counter: str
) -> None:
    root = tmp_path_factory.mktemp("ib")
    roots = _legacy_tree(root, 5)
    port_dir = root / "sys/devices/pci0000:00/0000:00:01.0/0000:17:00.0/infiniband/mlx4_0"
    port_dir = port_dir / "ports" / "2"
    texts = {"state": state, "rate": rate, "link_layer": link_layer}
    for name, text in texts.items():
        (port_dir / name).write_text(text, newline="")
    (port_dir / "counters" / "symbol_error").write_text(counter, newline="")
    data = ib.read_infiniband(roots)
    (device,) = data.devices
    assert [p.port for p in device.ports] == [1, 2, 10]
    port = device.ports[1]
    parsers = {"state": ib.parse_state, "rate": ib.parse_rate, "link_layer": ib.parse_link_layer}
    bad = 0
    for name, text in texts.items():
        expected = _parsed_or_error(parsers[name], text, "x")
        if isinstance(expected, tuple):
            bad += 1
            assert getattr(port, name) is None
        else:
            assert getattr(port, name) == expected
    assert data.skipped.counts.get(ib.SKIP_ATTRIBUTE_UNPARSABLE, 0) == bad
    counter_value = _parsed_or_error(ib.parse_counter, counter, "x")
    if isinstance(counter_value, tuple):
        assert data.skipped.counts[ib.SKIP_COUNTER_UNPARSABLE] == 1
    found = port.counter("symbol_error")
    assert (found.value if found else None) == (
        None if isinstance(counter_value, tuple) else counter_value
    )


def test_capture_record_serialises_to_json(capture: ib.InfinibandData) -> None:
    data = json.loads(jsonout.dumps(capture))
    assert data["skipped"] == {"counts": {}, "examples": {}}
    assert data["devices"][0]["ports"][0]["rate"] == {"gbps": 400.0, "lanes": 4, "speed": "NDR"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        capture.devices[0].name = "x"  # type: ignore[misc]


def test_source_is_registered_and_reads_capture() -> None:
    source = SOURCES["infiniband"].make()
    try:
        data = source.collect(Roots.under(CAPTURE))
    finally:
        source.close()
    assert isinstance(data, ib.InfinibandData)
    assert len(data.devices) == 9


def test_missing_class_reads_as_no_devices(tmp_path: Path) -> None:
    assert ib.read_infiniband(Roots.under(tmp_path)) == ib.InfinibandData(())


# ------------------------------------------------------------------------------------------
# Built trees: PCI link, netdevs, legacy 32-bit counters, device-level hw_counters


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _legacy_tree(root: Path, xmit_words: int, symbol_errors: int = 0) -> Roots:
    """An HCA without extended counters, linked to a PCI function with one netdev."""
    sysfs = root / "sys"
    pci = sysfs / "devices" / "pci0000:00" / "0000:00:01.0" / "0000:17:00.0"
    dev = pci / "infiniband" / "mlx4_0"
    (pci / "net" / "ib0").mkdir(parents=True, exist_ok=True)
    link = sysfs / "class" / "infiniband" / "mlx4_0"
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink():
        link.symlink_to("../../devices/pci0000:00/0000:00:01.0/0000:17:00.0/infiniband/mlx4_0")
    if not (dev / "device").is_symlink():
        dev.mkdir(parents=True, exist_ok=True)
        (dev / "device").symlink_to("../../../0000:17:00.0")
    _write(dev / "node_guid", "0002:c903:0031:7f40\n")
    _write(dev / "hw_counters" / "active_qps", "7\n")
    _write(dev / "hw_counters" / "rx_pkts", "99\n")
    _write(dev / "hw_counters" / "lifespan", "10\n")
    for n in ("1", "2", "10"):
        port = dev / "ports" / n
        _write(port / "state", "4: ACTIVE\n" if n == "1" else "1: DOWN\n")
        _write(port / "phys_state", "5: LinkUp\n" if n == "1" else "3: Disabled\n")
        _write(port / "rate", "40 Gb/sec (4X QDR)\n" if n == "1" else "10 Gb/sec (4X)\n")
        _write(port / "link_layer", "InfiniBand\n")
        _write(port / "counters" / "port_xmit_data", f"{xmit_words}\n")
        _write(port / "counters" / "port_rcv_data", "1000\n")
        _write(port / "counters" / "symbol_error", f"{symbol_errors}\n")
        _write(port / "counters" / "port_xmit_wait", "N/A (no PMA)\n")
    return Roots.under(root)


def test_built_tree_pci_netdevs_ports(tmp_path: Path) -> None:
    data = ib.read_infiniband(_legacy_tree(tmp_path, 5))
    (device,) = data.devices
    assert device.pci_address == "0000:17:00.0"
    assert device.netdevs == ("ib0",)
    assert device.node_guid == "0002:c903:0031:7f40"
    assert device.hw_counters == (
        ib.Counter("active_qps", 7, 64),
        ib.Counter("rx_pkts", 99, 64),
    )
    # Ports in numeric order, not string order.
    assert [p.port for p in device.ports] == [1, 2, 10]
    port = device.ports[0]
    assert port.counter("port_xmit_data") == ib.Counter("port_xmit_data", 5, 32)
    assert port.counter("port_xmit_wait") is None  # "N/A (no PMA)": absent
    assert port.xmit_bytes == 20
    assert device.ports[1].rate == ib.LinkRate(10.0, 4, None)
    assert device.ports[1].state == ib.PortState(1, "DOWN")


def test_built_tree_bad_attribute_is_absent_counted_and_named(tmp_path: Path) -> None:
    roots = _legacy_tree(tmp_path, 5)
    good = ib.read_infiniband(roots)
    bad = tmp_path / "sys/devices/pci0000:00/0000:00:01.0/0000:17:00.0/infiniband/mlx4_0"
    _write(bad / "ports" / "2" / "rate", "fast\n")
    data = ib.read_infiniband(roots)
    assert data.skipped.counts == {ib.SKIP_ATTRIBUTE_UNPARSABLE: 1}
    assert data.skipped.examples[ib.SKIP_ATTRIBUTE_UNPARSABLE].endswith("mlx4_0/ports/2/rate")
    # Only that attribute is gone: the port's other values and the other ports are as before.
    (device,) = data.devices
    assert device.ports[1] == dataclasses.replace(good.devices[0].ports[1], rate=None)
    assert device.ports[0] == good.devices[0].ports[0]
    assert device.ports[2] == good.devices[0].ports[2]


# ------------------------------------------------------------------------------------------
# The source: traffic every run, the rest every slow_every runs


def _bump(path: Path, add: int) -> None:
    path.write_text(f"{int(path.read_text()) + add}\n")


@pytest.fixture
def capture_copy(tmp_path: Path) -> Path:
    shutil.copytree(CAPTURE / "sys", tmp_path / "sys")
    return tmp_path / "sys" / "class" / "infiniband"


def test_source_reads_fault_counters_and_port_state_every_slow_every_runs(
    capture_copy: Path,
) -> None:
    roots = Roots.under(capture_copy.parents[2])
    source = ib.InfinibandSource()
    assert source.slow_every == ib.SLOW_EVERY == 10
    first = source.collect(roots)
    port_dir = capture_copy / "mlx5_0" / "ports" / "1"
    _bump(port_dir / "counters" / "port_xmit_data", 1000)
    _bump(port_dir / "counters" / "symbol_error", 2)
    _bump(port_dir / "counters" / "unicast_xmit_packets", 5)
    _bump(port_dir / "hw_counters" / "out_of_buffer", 3)
    (port_dir / "state").write_text("1: DOWN\n")
    before = first.devices[0].ports[0]
    xmit_words = (before.xmit_bytes or 0) // 4
    for run in range(2, 11):
        port = source.collect(roots).devices[0].ports[0]
        counter = port.counter("port_xmit_data")
        assert counter is not None and counter.value == xmit_words + 1000, run
        assert port.counter("symbol_error") == before.counter("symbol_error")
        assert port.counter("unicast_xmit_packets") == before.counter("unicast_xmit_packets")
        assert port.hw_counters == before.hw_counters
        assert port.state == ib.PortState(4, "ACTIVE")
    eleventh = source.collect(roots)
    assert eleventh == ib.read_infiniband(roots)
    port = eleventh.devices[0].ports[0]
    symbol, old_symbol = port.counter("symbol_error"), before.counter("symbol_error")
    assert symbol is not None and old_symbol is not None
    assert symbol.value == old_symbol.value + 2
    assert port.state == ib.PortState(1, "DOWN")
    source.close()


def test_port_rates_take_fault_counters_over_the_span_between_full_reads(
    capture_copy: Path,
) -> None:
    roots = Roots.under(capture_copy.parents[2])
    now = [0.0]
    source = ib.InfinibandSource(clock=lambda: now[0])
    port_dir = capture_copy / "mlx5_0" / "ports" / "1"
    records = []
    for second in range(21):
        now[0] = float(second)
        _bump(port_dir / "counters" / "port_xmit_data", 1000)
        _bump(port_dir / "counters" / "symbol_error", 2)
        _bump(port_dir / "hw_counters" / "out_of_buffer", 3)
        records.append(source.collect(roots))
    assert [r.slow is not None and r.slow.fresh for r in records] == [
        s % 10 == 0 for s in range(21)
    ]

    def rates(second: int) -> ib.PortRates:
        found = ib.port_rates(records[second - 1], records[second], 1.0).port("mlx5_0", 1)
        assert found is not None
        return found

    def counter(port: ib.PortRates, name: str) -> float | None:
        return next(c.per_second for c in (*port.counters, *port.hw_counters) if c.name == name)

    for second in range(1, 10):  # one full read so far: the fault counters have no rate
        assert counter(rates(second), "symbol_error") is None
        assert rates(second).errors_per_second is None
        assert counter(rates(second), "port_xmit_data") == 1000.0
    for second in range(10, 21):  # every cycle: the change between the two reads, per second
        port = rates(second)
        assert counter(port, "symbol_error") == 2.0, second
        assert counter(port, "out_of_buffer") == 3.0, second
        assert port.errors_per_second == 2.0, second
        assert counter(port, "port_xmit_data") == 1000.0, second
        assert ib.port_rates(records[second - 1], records[second], 1.0).slow_seconds == 10.0
    source.close()


def test_cycle_rates_make_the_slow_rates_once_per_full_read(capture_copy: Path) -> None:
    """In the daemon's cycles (a Derived handed on from one snapshot to the next) the rates of
    the counters read only on full reads are made when a full read brings new values and
    carried in between; every cycle's rates equal port_rates made from scratch."""
    roots = Roots.under(capture_copy.parents[2])
    now = [0.0]
    source = ib.InfinibandSource(slow_every=5, clock=lambda: now[0])
    port_dir = capture_copy / "mlx5_0" / "ports" / "1"
    previous: dict[str, SourceSample] = {}
    carried: Mapping[str, Figure] = {}
    records: list[ib.InfinibandData] = []
    hw_rates: list[object] = []
    for second in range(16):
        now[0] = float(second)
        _bump(port_dir / "counters" / "port_xmit_data", 1000 + second)
        _bump(port_dir / "counters" / "symbol_error", 1 + second % 3)
        _bump(port_dir / "hw_counters" / "out_of_buffer", 3)
        records.append(source.collect(roots))
        current = {"infiniband": SourceSample("infiniband", float(second), 0.0, records[-1])}
        derived = Derived(current, previous, carried)
        rates = derived.ib_rates
        if second == 0:
            assert rates is None
        else:
            assert rates == ib.port_rates(records[-2], records[-1], 1.0), second
            port = rates.port("mlx5_0", 1)
            assert port is not None
            hw_rates.append(port.hw_counters)
            assert port.xmit_bytes_per_second == 4 * (1000 + second)
        previous, carried = current, derived.hand_on()
    source.close()
    # Full reads on seconds 0, 5, 10, 15 (hw_rates[i] is second i + 1's): the slow rates are
    # made on the cycle of each, and kept until the next.
    made = [i + 1 for i in range(1, len(hw_rates)) if hw_rates[i] is not hw_rates[i - 1]]
    assert made == [5, 10, 15], made
    assert [r.per_second for r in hw_rates[-1] if r.name == "out_of_buffer"] == [3.0]


def test_source_with_slow_every_1_reads_everything_every_run(capture_copy: Path) -> None:
    roots = Roots.under(capture_copy.parents[2])
    source = ib.InfinibandSource(slow_every=1)
    source.collect(roots)
    _bump(capture_copy / "mlx5_1" / "ports" / "1" / "counters" / "link_downed", 1)
    _bump(capture_copy / "mlx5_1" / "ports" / "1" / "hw_counters" / "out_of_sequence", 4)
    (capture_copy / "mlx5_1" / "ports" / "1" / "rate").write_text("200 Gb/sec (4X HDR)\n")
    assert source.collect(roots) == ib.read_infiniband(roots)


def test_source_between_full_reads_equals_a_full_read_while_only_traffic_moves(
    capture_copy: Path,
) -> None:
    roots = Roots.under(capture_copy.parents[2])
    source = ib.InfinibandSource(slow_every=1000)
    source.collect(roots)
    for run in range(4):
        for dev in ("mlx5_0", "mlx5_4", "mlx5_bond_0"):
            counters = capture_copy / dev / "ports" / "1" / "counters"
            for name in ib.TRAFFIC_COUNTERS:
                _bump(counters / name, 10**run + len(name))
        assert source.collect(roots) == ib.read_infiniband(roots), run


def test_source_fast_run_recomputes_widths_and_drops_vanished_counters(tmp_path: Path) -> None:
    roots = _legacy_tree(tmp_path, 5)
    source = ib.InfinibandSource()
    source.collect(roots)
    port_dir = tmp_path / "sys/devices/pci0000:00/0000:00:01.0/0000:17:00.0/infiniband/mlx4_0"
    counters = port_dir / "ports" / "1" / "counters"
    # Beyond 32 bits: the data counters are proven 64-bit, as a full read finds.
    (counters / "port_xmit_data").write_text(f"{1 << 33}\n")
    (counters / "port_rcv_data").write_text("N/A (no PMA)\n")
    port = source.collect(roots).devices[0].ports[0]
    assert port.counter("port_xmit_data") == ib.Counter("port_xmit_data", 1 << 33, 64)
    assert port.counter("port_rcv_data") is None and port.rcv_bytes is None
    assert port == ib.read_infiniband(roots).devices[0].ports[0]
    # A counter that stops parsing between full reads is absent and counted, not fatal.
    (counters / "port_xmit_data").write_text("12 words\n")
    data = source.collect(roots)
    assert data.devices[0].ports[0].counter("port_xmit_data") is None
    assert data.devices[0].ports[0].xmit_bytes is None
    assert data.devices[0].ports[1].counter("port_xmit_data") is not None
    assert data.skipped.counts == {ib.SKIP_COUNTER_UNPARSABLE: 1}
    assert data.skipped.examples[ib.SKIP_COUNTER_UNPARSABLE].endswith(
        "mlx4_0/ports/1/counters/port_xmit_data"
    )


def test_source_reads_a_new_device_in_full_at_once_and_drops_a_gone_one(
    capture_copy: Path,
) -> None:
    roots = Roots.under(capture_copy.parents[2])
    moved = capture_copy.parent / "mlx5_9.away"
    (capture_copy / "mlx5_9").rename(moved)
    source = ib.InfinibandSource()
    first = source.collect(roots)
    assert "mlx5_9" not in [d.name for d in first.devices]
    _bump(moved / "ports" / "1" / "counters" / "symbol_error", 7)
    moved.rename(capture_copy / "mlx5_9")
    (capture_copy / "mlx5_1").rename(capture_copy.parent / "mlx5_1.away")
    second = source.collect(roots)  # a run between full reads
    assert [d.name for d in second.devices] == [d.name for d in ib.read_infiniband(roots).devices]
    assert "mlx5_1" not in [d.name for d in second.devices]
    (new,) = [d for d in second.devices if d.name == "mlx5_9"]
    assert new == ib.read_device(capture_copy / "mlx5_9")


def test_source_resolves_the_pci_function_again_when_a_link_changes(tmp_path: Path) -> None:
    roots = _legacy_tree(tmp_path, 5)
    source = ib.InfinibandSource(slow_every=1)
    assert source.collect(roots).devices[0].pci_address == "0000:17:00.0"
    pci = tmp_path / "sys" / "devices" / "pci0000:00" / "0000:00:01.0"
    (pci / "0000:18:00.0").mkdir()
    dev = pci / "0000:17:00.0" / "infiniband" / "mlx4_0"
    (dev / "device").unlink()
    (dev / "device").symlink_to("../../../0000:18:00.0")
    assert source.collect(roots).devices[0].pci_address == "0000:18:00.0"
    assert source.collect(roots) == ib.read_infiniband(roots)


def test_registry_and_simulated_node_make_the_source_with_their_cadence() -> None:
    from nodescope.sim.node import SimulatedNode
    from nodescope.sim.scenario import load_scenario

    assert isinstance(SOURCES["infiniband"].make(), ib.InfinibandSource)
    node = SimulatedNode(load_scenario("dgx-h100"), Path("/nonexistent-nodescope-sim"))
    # The daemon's cadence: a replay reads the error counters as seldom as it does.
    (source,) = [s for s in node.sources() if isinstance(s, ib.InfinibandSource)]
    assert source.slow_every == ib.SLOW_EVERY


# ------------------------------------------------------------------------------------------
# Rates


def test_port_rates_on_capture_copy(tmp_path: Path) -> None:
    shutil.copytree(CAPTURE / "sys", tmp_path / "sys")
    roots = Roots.under(tmp_path)
    prev = ib.read_infiniband(roots)
    counters = tmp_path / "sys/class/infiniband/mlx5_0/ports/1/counters"
    for name, add in (
        ("port_xmit_data", 25_000_000_000),
        ("port_rcv_data", 1_000),
        ("port_xmit_wait", 500),
        ("port_rcv_errors", 3),
        ("symbol_error", 1),
    ):
        path = counters / name
        path.write_text(str(int(path.read_text()) + add))
    cur = ib.read_infiniband(roots)
    rates = ib.port_rates(prev, cur, 2.0)
    assert len(rates.ports) == 9
    r = rates.port("mlx5_0", 1)
    assert r is not None
    assert r.xmit_bytes_per_second == 25_000_000_000 * 4 / 2
    assert r.xmit_utilization == 1.0  # 50 GB/s on a 400 Gb/s port
    assert r.rcv_bytes_per_second == 2_000.0
    assert r.xmit_wait_per_second == 250.0
    assert r.xmit_packets_per_second == 0.0
    assert r.errors_per_second == 2.0
    by_name = {c.name: c.per_second for c in r.counters}
    assert by_name["port_rcv_errors"] == 1.5
    # Saturated at 15 in both samples: unknown, not zero.
    assert by_name["excessive_buffer_overrun_errors"] is None
    other = rates.port("mlx5_1", 1)
    assert other is not None and other.xmit_bytes_per_second == 0.0


def test_port_rates_32bit_wrap(tmp_path: Path) -> None:
    prev = ib.read_infiniband(_legacy_tree(tmp_path, 2**32 - 100, symbol_errors=65530))
    cur = ib.read_infiniband(_legacy_tree(tmp_path, 50, symbol_errors=4))
    r = ib.port_rates(prev, cur, 1.0).port("mlx4_0", 1)
    assert r is not None
    # 150 words across the 32-bit wrap, 4 bytes each.
    assert r.xmit_bytes_per_second == 600.0
    # 16-bit symbol_error wraps too: 65530 -> 4 is 10 errors.
    assert r.errors_per_second == 10.0
    # 40 Gb/s = 5e9 bytes/s.
    assert r.xmit_utilization == 600.0 / 5e9


def test_port_rates_64bit_drop_is_a_reset(capture: ib.InfinibandData) -> None:
    port = capture.devices[0].ports[0]
    lower = dataclasses.replace(
        port,
        counters=tuple(
            dataclasses.replace(c, value=c.value // 2) if c.name == "port_xmit_data" else c
            for c in port.counters
        ),
    )
    dev = dataclasses.replace(capture.devices[0], ports=(lower,))
    cur = ib.InfinibandData((dev,))
    r = ib.port_rates(ib.InfinibandData((capture.devices[0],)), cur, 1.0).port("mlx5_0", 1)
    assert r is not None
    assert r.xmit_bytes_per_second is None
    assert r.xmit_utilization is None
    assert r.rcv_bytes_per_second == 0.0


def test_port_rates_skip_new_ports_and_bad_intervals(capture: ib.InfinibandData) -> None:
    prev = ib.InfinibandData(capture.devices[:2])
    assert [p.device for p in ib.port_rates(prev, capture, 1.0).ports] == ["mlx5_0", "mlx5_1"]
    assert ib.port_rates(capture, capture, 0.0).ports == ()


@settings(max_examples=200, deadline=None)
@example(prev=2**31, increase=2**31 - 1, seconds=1.0)
@given(
    prev=st.integers(min_value=2**31, max_value=2**32 - 1),
    increase=st.integers(min_value=0, max_value=2**31 - 1),
    seconds=st.floats(min_value=0.001, max_value=3600),
)
def test_32bit_data_counter_wraps_fuzz(prev: int, increase: int, seconds: float) -> None:
    def data(words: int) -> ib.InfinibandData:
        port = ib.IbPort(
            "hca",
            1,
            None,
            None,
            ib.LinkRate(100.0, 4, "EDR"),
            None,
            (ib.Counter("port_xmit_data", words, 32),),
            (),
            None,
            words * 4,
            None,
        )
        return ib.InfinibandData(
            (ib.IbDevice("hca", None, None, None, None, None, (), (), (port,)),)
        )

    cur = (prev + increase) % 2**32
    r = ib.port_rates(data(prev), data(cur), seconds).port("hca", 1)
    assert r is not None
    if cur == 2**32 - 1:
        # All ones: the counter has stopped, the increase is unknown.
        assert r.xmit_bytes_per_second is None
    else:
        assert r.xmit_bytes_per_second == pytest.approx(increase * 4 / seconds)


# ------------------------------------------------------------------------------------------
# Fuzz: malformed input raises ParseError and nothing else


PARSERS = (
    ib.parse_state,
    ib.parse_rate,
    ib.parse_link_layer,
    ib.parse_counter,
    ib.parse_node_guid,
    ib.parse_attribute,
)

_near = st.one_of(
    st.text(),
    st.text(alphabet="0123456789: .()XGb/secNDRSHFQ\n\t -", max_size=40),
    st.builds(
        lambda a, b, c: f"{a} Gb/sec ({b}X {c})",
        st.text(max_size=6),
        st.text(max_size=4),
        st.text(max_size=6),
    ),
    st.builds(lambda a, b: f"{a}: {b}", st.text(max_size=5), st.text(max_size=10)),
)


@settings(max_examples=200, deadline=None)
@given(text=_near)
@pytest.mark.parametrize("parse", PARSERS, ids=lambda f: f.__name__)
def test_parsers_raise_only_parse_error(parse: object, text: str) -> None:
    assert callable(parse)
    try:
        parse(text, "fuzz")
    except ParseError as err:
        assert err.source == "fuzz"


@settings(max_examples=200, deadline=None)
@given(code=st.integers(0, 10**9 - 1), name=st.sampled_from(["ACTIVE", "Phy Test", "<unknown>"]))
def test_parse_state_round_trip(code: int, name: str) -> None:
    assert ib.parse_state(f"{code}: {name}\n", "s") == ib.PortState(code, name)


@settings(max_examples=200, deadline=None)
@given(
    rate10=st.integers(1, 10**6),
    lanes=st.sampled_from([1, 2, 4, 8, 12]),
    speed=st.one_of(st.none(), st.sampled_from(sorted(ib.LANE_GBPS))),
)
def test_parse_rate_round_trip(rate10: int, lanes: int, speed: str | None) -> None:
    # Formatted as rate_show() does: whole Gb/s and ".5" for the half.
    name = f" {speed}" if speed else ""
    text = f"{rate10 // 10}{'.5' if rate10 % 10 else ''} Gb/sec ({lanes}X{name})\n"
    rate = ib.parse_rate(text, "rate")
    assert rate.lanes == lanes and rate.speed == speed
    assert rate.gbps == rate10 // 10 + (0.5 if rate10 % 10 else 0)


@settings(max_examples=200, deadline=None)
@given(value=st.integers(0, 2**64 - 1))
def test_parse_counter_round_trip(value: int) -> None:
    assert ib.parse_counter(f"{value}\n", "c") == value


def _parsed_or_error(parse: object, *args: str) -> object:
    assert callable(parse)
    try:
        return parse(*args)
    except ParseError as exc:
        return ("ParseError", exc.source, exc.line)


@settings(max_examples=300, deadline=None)
@example(data="٣\n".encode())
@example(data=b"1_000\n")
@example(data=b" 7 \n")
@example(data=b"0" * 41)
@example(data=b"\xff12\n")
@given(
    data=st.one_of(
        st.binary(max_size=45),
        st.text(max_size=45).map(str.encode),
        st.integers(0, 2**70).map(lambda v: f"{v}\n".encode()),
    )
)
def test_counter_value_short_way_answers_as_parse_counter(data: bytes) -> None:
    text = data.decode("utf-8", errors="replace")
    tally = SkipTally()
    value = ib._counter_value(data, "/d", "n", tally)
    expected = _parsed_or_error(ib.parse_counter, text, "/d/n")
    if isinstance(expected, tuple):
        # What parse_counter rejects is absent and counted under the file's path.
        assert value is None
        assert tally.freeze().counts == {ib.SKIP_COUNTER_UNPARSABLE: 1}
        assert tally.freeze().examples[ib.SKIP_COUNTER_UNPARSABLE] == "/d/n"
    else:
        assert value == expected and not tally


# ------------------------------------------------------------------------------------------
# Metrics


def _metrics(data: ib.InfinibandData) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    snap = Snapshot(1, 1.0, 1.0, current={"infiniband": SourceSample("infiniband", 1.0, 0.0, data)})
    text = render(snap, [network_metrics.families]).decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_metrics_from_capture(capture: ib.InfinibandData) -> None:
    m = _metrics(capture)
    port = (("device", "mlx5_0"), ("port", "1"))
    assert m["nodescope_infiniband_port_state_id"][port] == 4
    assert m["nodescope_infiniband_port_physical_state_id"][port] == 5
    assert m["nodescope_infiniband_port_rate_bytes_per_second"][port] == 50e9
    assert m["nodescope_infiniband_port_lanes"][port] == 4
    assert m["nodescope_infiniband_port_data_received_bytes_total"][port] == 922159499729932
    assert m["nodescope_infiniband_port_data_transmitted_bytes_total"][port] == 230442669431839 * 4
    assert m["nodescope_infiniband_port_packets_received_total"][port] == 317548853677
    assert m["nodescope_infiniband_port_transmit_wait_total"][port] == 2489603687
    errors = m["nodescope_infiniband_port_errors_total"]
    assert errors[(("counter", "port_rcv_errors"), *port)] == 14
    assert errors[(("counter", "excessive_buffer_overrun_errors"), *port)] == 15
    assert {dict(k)["counter"] for k in errors} == set(ib.ERROR_COUNTERS)
    hw = m["nodescope_infiniband_port_hw_stats_total"]
    assert hw[(*port, ("stat", "rx_write_requests"))] == 3809045607
    assert not any(dict(k)["stat"] == "lifespan" for k in hw)
    info = m["nodescope_infiniband_port_info"]
    assert info[(*port[:1], ("link_layer", "InfiniBand"), port[1], ("speed", "NDR"))] == 1
    bond = (("device", "mlx5_bond_0"), ("link_layer", "Ethernet"), ("port", "1"), ("speed", "NDR"))
    assert info[bond] == 1
    dev_info = m["nodescope_infiniband_info"]
    assert (
        dev_info[
            (
                ("board_id", "MT_0000000838"),
                ("device", "mlx5_0"),
                ("firmware_version", "28.41.1000"),
                ("hca_type", "MT4129"),
                ("node_guid", ""),
                ("pci_address", ""),
            )
        ]
        == 1
    )
    # No netdevs and no device-level hw_counters in the capture: no series at all.
    assert "nodescope_infiniband_netdev_info" not in m
    assert "nodescope_infiniband_hw_stats_total" not in m


def test_metrics_from_built_tree(tmp_path: Path) -> None:
    m = _metrics(ib.read_infiniband(_legacy_tree(tmp_path, 5)))
    assert m["nodescope_infiniband_netdev_info"] == {(("device", "mlx4_0"), ("netdev", "ib0")): 1}
    assert m["nodescope_infiniband_hw_level"] == {(("device", "mlx4_0"), ("stat", "active_qps")): 7}
    assert m["nodescope_infiniband_hw_stats_total"] == {
        (("device", "mlx4_0"), ("stat", "rx_pkts")): 99
    }
    # port_xmit_wait read "N/A (no PMA)": absent, so no series rather than 0.
    assert "nodescope_infiniband_port_transmit_wait_total" not in m
    info = m["nodescope_infiniband_port_info"]
    assert (
        info[(("device", "mlx4_0"), ("link_layer", "InfiniBand"), ("port", "2"), ("speed", ""))]
        == 1
    )
