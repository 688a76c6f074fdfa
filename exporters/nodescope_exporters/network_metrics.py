"""Metrics of the network sources: InfiniBand/RoCE ports (``infiniband``) and network
interfaces (``netdev``).

Names follow node_exporter's infiniband and netdev collectors where they exist, under
``nodescope_infiniband_`` and ``nodescope_network_``. Counters are the raw cumulative values
(data in bytes, i.e. the kernel's 4-byte words × 4); Prometheus computes the rates. Error
counters share one family with a ``counter`` label whose values are file names; driver
``hw_counters`` go to three families by what they count (errors, congestion, the rest, see
:func:`nodescope.model.infiniband.counter_kind`), so congestion never reads as errors. Label
values are the names of files, at most ``MAX_COUNTER_FILES`` per directory and port, each a
short word (the source refuses others).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import cast

from nodescope.model.infiniband import (
    ERROR_COUNTERS,
    INFINIBAND,
    KIND_CONGESTION,
    KIND_ERROR,
    KIND_TRAFFIC,
    PORT_STATES,
    TRAFFIC_COUNTERS,
    Counter,
    IbDevice,
    IbPort,
    InfinibandData,
    LinkRate,
    PortState,
    counter_kind,
    hw_counter_is_gauge,
)
from nodescope.model.netdev import NETDEV, NetdevData
from nodescope.model.snapshot import Snapshot
from nodescope_exporters.catalog import Metric, MetricSpec, metric
from nodescope_exporters.kept import KeptFamilies, kept_or_built

AREA = "network"
_DEV = ("device",)
_PORT = ("device", "port")
_PORT_COUNTER = ("device", "port", "counter")
_PORT_STAT = ("device", "port", "stat")
_IF = ("interface",)

IB_INFO = metric(
    "nodescope_infiniband_info",
    "info",
    "RDMA device identity: 1 per device, with firmware, HCA type, board id, node GUID and PCI "
    "function as labels.",
    ("device", "board_id", "firmware_version", "hca_type", "node_guid", "pci_address"),
    area=AREA,
)
IB_NETDEV_INFO = metric(
    "nodescope_infiniband_netdev_info",
    "info",
    "Network interfaces of the PCI function of an RDMA device (its device/net/ entries).",
    ("device", "netdev"),
    area=AREA,
)
IB_PORT_INFO = metric(
    "nodescope_infiniband_port_info",
    "info",
    "RDMA port: link layer (InfiniBand or Ethernet for RoCE) and lane speed name (NDR, HDR…).",
    ("device", "port", "link_layer", "speed"),
    area=AREA,
)
IB_STATE = metric(
    "nodescope_infiniband_port_state_id",
    "gauge",
    "Logical port state: "
    + ", ".join(f"{code} {name}" for code, name in enumerate(PORT_STATES))
    + " (ACTIVE carries traffic).",
    _PORT,
    area=AREA,
)
IB_PHYS_STATE = metric(
    "nodescope_infiniband_port_physical_state_id",
    "gauge",
    "Physical port state: 1 Sleep, 2 Polling, 3 Disabled, 4 PortConfigurationTraining, "
    "5 LinkUp, 6 LinkErrorRecovery, 7 Phy Test.",
    _PORT,
    area=AREA,
)
IB_RATE = metric(
    "nodescope_infiniband_port_rate_bytes_per_second",
    "gauge",
    "Data rate of the port over all active lanes, per direction, in bytes per second.",
    _PORT,
    area=AREA,
)
IB_LANES = metric(
    "nodescope_infiniband_port_lanes",
    "gauge",
    "Active lanes of the port (the link width, 4 for 4X); fewer than cabled means downtrained.",
    _PORT,
    area=AREA,
)
IB_RX_BYTES = metric(
    "nodescope_infiniband_port_data_received_bytes_total",
    "counter",
    "Data received on the port in bytes (counters/port_rcv_data × 4).",
    _PORT,
    area=AREA,
)
IB_TX_BYTES = metric(
    "nodescope_infiniband_port_data_transmitted_bytes_total",
    "counter",
    "Data transmitted on the port in bytes (counters/port_xmit_data × 4).",
    _PORT,
    area=AREA,
)
_PACKET_COUNTERS: tuple[tuple[str, MetricSpec], ...] = tuple(
    (
        counter,
        metric(
            f"nodescope_infiniband_port_{name}_total",
            "counter",
            f"Packets {direction} on the port (counters/{counter}).",
            _PORT,
            area=AREA,
        ),
    )
    for counter, name, direction in (
        ("port_rcv_packets", "packets_received", "received"),
        ("port_xmit_packets", "packets_transmitted", "transmitted"),
        ("unicast_rcv_packets", "unicast_packets_received", "received unicast"),
        ("unicast_xmit_packets", "unicast_packets_transmitted", "transmitted unicast"),
        ("multicast_rcv_packets", "multicast_packets_received", "received multicast"),
        ("multicast_xmit_packets", "multicast_packets_transmitted", "transmitted multicast"),
    )
)
IB_XMIT_WAIT = metric(
    "nodescope_infiniband_port_transmit_wait_total",
    "counter",
    "Ticks during which the port had data to send but sent none (counters/port_xmit_wait): "
    "congestion or lack of credits.",
    _PORT,
    area=AREA,
)
IB_ERRORS = metric(
    "nodescope_infiniband_port_errors_total",
    "counter",
    "Port error counters by their counters/ file name ("
    + ", ".join(ERROR_COUNTERS)
    + ", and any other file there whose name says error). They are 4 to 16 bits wide and "
    "stop at their maximum (see nodescope_infiniband_port_errors_saturated).",
    _PORT_COUNTER,
    area=AREA,
)
IB_ERRORS_SATURATED = metric(
    "nodescope_infiniband_port_errors_saturated",
    "gauge",
    "1 when a counters/ error counter is at its maximum, where it stops: its rate then reads "
    "0 while errors go on uncounted, until the counters are cleared.",
    _PORT_COUNTER,
    area=AREA,
)
IB_PORT_HW_ERRORS = metric(
    "nodescope_infiniband_port_hw_errors_total",
    "counter",
    "Driver error counters of the port (ports/<n>/hw_counters/): packets dropped, out of "
    "sequence, retransmitted or completed in error (mlx5 out_of_buffer, packet_seq_err, "
    "local_ack_timeout_err, roce_adp_retrans, rx_icrc_encapsulated…), and any driver counter "
    "whose name says error.",
    _PORT_COUNTER,
    area=AREA,
)
IB_CONGESTION = metric(
    "nodescope_infiniband_port_congestion_total",
    "counter",
    "Driver congestion counters of the port (ports/<n>/hw_counters/): ECN-marked packets "
    "and congestion notification packets sent and handled (mlx5 np_ecn_marked_roce_packets, "
    "np_cnp_sent, rp_cnp_handled…). Congestion control at work, not errors; "
    "nodescope_infiniband_port_transmit_wait_total is the link's own.",
    _PORT_COUNTER,
    area=AREA,
)
IB_PORT_HW = metric(
    "nodescope_infiniband_port_hw_stats_total",
    "counter",
    "Driver counters of the port that are neither errors nor congestion "
    "(ports/<n>/hw_counters/, e.g. mlx5 rx_write_requests, rx_dct_connect).",
    _PORT_STAT,
    area=AREA,
)
IB_OTHER_COUNTERS = metric(
    "nodescope_infiniband_port_other_counters_total",
    "counter",
    "counters/ files that the kernel's table does not have and whose name says neither "
    "error nor congestion.",
    _PORT_COUNTER,
    area=AREA,
)
IB_PORT_HW_GAUGE = metric(
    "nodescope_infiniband_port_hw_level",
    "gauge",
    "Driver values of ports/<n>/hw_counters/ that are levels, not counts (active_*, watermark_*).",
    _PORT_STAT,
    area=AREA,
)
IB_DEV_HW = metric(
    "nodescope_infiniband_hw_stats_total",
    "counter",
    "Driver counters of the whole device (<dev>/hw_counters/).",
    ("device", "stat"),
    area=AREA,
)
IB_DEV_HW_GAUGE = metric(
    "nodescope_infiniband_hw_level",
    "gauge",
    "Driver values of <dev>/hw_counters/ that are levels, not counts (active_*, watermark_*).",
    ("device", "stat"),
    area=AREA,
)

NET_INFO = metric(
    "nodescope_network_info",
    "info",
    "Network interface: operational state (RFC 2863, lower case), link kind (veth, bond, "
    "vlan…; empty for plain devices) and PCI function (empty for virtual interfaces).",
    ("interface", "operstate", "kind", "pci_address"),
    area=AREA,
)
NET_UP = metric(
    "nodescope_network_up",
    "gauge",
    "1 when the interface's operational state is up.",
    _IF,
    area=AREA,
)
NET_ADMIN_UP = metric(
    "nodescope_network_admin_up",
    "gauge",
    "1 when the interface is administratively up (IFF_UP).",
    _IF,
    area=AREA,
)
NET_CARRIER = metric(
    "nodescope_network_carrier",
    "gauge",
    "1 when the interface has carrier.",
    _IF,
    area=AREA,
)
NET_MTU = metric(
    "nodescope_network_mtu_bytes",
    "gauge",
    "MTU of the interface in bytes.",
    _IF,
    area=AREA,
)
_NET_COUNTERS: tuple[tuple[str, MetricSpec], ...] = tuple(
    (
        field,
        metric(
            f"nodescope_network_{name}_total",
            "counter",
            f"{text} (rtnetlink IFLA_STATS64 {field}).",
            _IF,
            area=AREA,
        ),
    )
    for field, name, text in (
        ("rx_bytes", "receive_bytes", "Bytes received"),
        ("tx_bytes", "transmit_bytes", "Bytes transmitted"),
        ("rx_packets", "receive_packets", "Packets received"),
        ("tx_packets", "transmit_packets", "Packets transmitted"),
        ("rx_errors", "receive_errors", "Receive errors"),
        ("tx_errors", "transmit_errors", "Transmit errors"),
        ("rx_dropped", "receive_drop", "Received packets dropped"),
        ("tx_dropped", "transmit_drop", "Packets dropped on transmit"),
    )
)


class _Families:
    """The families of one area, filled by spec; only those with samples are yielded."""

    def __init__(self, specs: Iterable[MetricSpec]) -> None:
        self._families: dict[str, Metric] = {spec.name: spec.family() for spec in specs}

    def add(self, spec: MetricSpec, labels: Sequence[str], value: float) -> None:
        self._families[spec.name].add_metric(labels, value)

    def non_empty(self) -> Iterator[Metric]:
        return (family for family in self._families.values() if family.values)

    def all(self) -> tuple[Metric, ...]:
        return tuple(self._families.values())


def _hw(
    counters: Iterable[Counter],
    labels: tuple[str, ...],
    families: _Families,
    total: MetricSpec,
    gauge: MetricSpec,
) -> None:
    for counter in counters:
        target = gauge if hw_counter_is_gauge(counter.name) else total
        families.add(target, [*labels, counter.name], counter.value)


# The infiniband source reads the traffic counters on every run and everything else on full
# reads, carrying the very same objects in between (nodescope.model.slow): the families of
# those are kept from one render to the next while the objects are the same, and only the
# traffic families are built for every render.

_IB_TRAFFIC_SPECS: tuple[MetricSpec, ...] = (
    IB_RX_BYTES,
    IB_TX_BYTES,
    *(spec for counter, spec in _PACKET_COUNTERS if counter in TRAFFIC_COUNTERS),
    IB_XMIT_WAIT,
)
_IB_DEVICE_SPECS: tuple[MetricSpec, ...] = (IB_INFO, IB_NETDEV_INFO, IB_DEV_HW, IB_DEV_HW_GAUGE)
_IB_PORT_SPECS: tuple[MetricSpec, ...] = (
    IB_PORT_INFO,
    IB_STATE,
    IB_PHYS_STATE,
    IB_RATE,
    IB_LANES,
    *(spec for counter, spec in _PACKET_COUNTERS if counter not in TRAFFIC_COUNTERS),
    IB_ERRORS,
    IB_ERRORS_SATURATED,
    IB_PORT_HW_ERRORS,
    IB_CONGESTION,
    IB_PORT_HW,
    IB_PORT_HW_GAUGE,
    IB_OTHER_COUNTERS,
)
_IB_SPECS: tuple[MetricSpec, ...] = (
    IB_INFO,
    IB_NETDEV_INFO,
    IB_PORT_INFO,
    IB_STATE,
    IB_PHYS_STATE,
    IB_RATE,
    IB_LANES,
    IB_RX_BYTES,
    IB_TX_BYTES,
    *(spec for _, spec in _PACKET_COUNTERS),
    IB_XMIT_WAIT,
    IB_ERRORS,
    IB_ERRORS_SATURATED,
    IB_PORT_HW_ERRORS,
    IB_CONGESTION,
    IB_PORT_HW,
    IB_PORT_HW_GAUGE,
    IB_OTHER_COUNTERS,
    IB_DEV_HW,
    IB_DEV_HW_GAUGE,
)
#: One device's values read on full reads: name, board id, firmware, HCA type, node GUID,
#: PCI function, netdevs, hw_counters.
_DevicePart = tuple[
    str,
    str | None,
    str | None,
    str | None,
    str | None,
    str | None,
    tuple[str, ...],
    tuple[Counter, ...],
]
#: One port's values read on full reads: device, port, state, physical state, rate, link
#: layer, hw_counters, then its counters other than the traffic ones.
_PortPart = tuple[object, ...]


def _device_part(device: IbDevice) -> _DevicePart:
    return (
        device.name,
        device.board_id,
        device.fw_ver,
        device.hca_type,
        device.node_guid,
        device.pci_address,
        device.netdevs,
        device.hw_counters,
    )


def _port_part(port: IbPort) -> _PortPart:
    return (
        port.device,
        port.port,
        port.state,
        port.phys_state,
        port.rate,
        port.link_layer,
        port.hw_counters,
        *port.slow_counters(),
    )


def _device_families(parts: Sequence[_DevicePart]) -> tuple[Metric, ...]:
    families = _Families(_IB_DEVICE_SPECS)
    for name, board_id, fw_ver, hca_type, node_guid, pci_address, netdevs, hw in parts:
        families.add(
            IB_INFO,
            [
                name,
                board_id or "",
                fw_ver or "",
                hca_type or "",
                node_guid or "",
                pci_address or "",
            ],
            1,
        )
        for netdev in netdevs:
            families.add(IB_NETDEV_INFO, [name, netdev], 1)
        _hw(hw, (name,), families, IB_DEV_HW, IB_DEV_HW_GAUGE)
    return families.all()


def _port_families(parts: Sequence[_PortPart]) -> tuple[Metric, ...]:
    families = _Families(_IB_PORT_SPECS)
    for part in parts:
        device, number, state, phys_state, rate, link_layer, hw = part[:7]
        # The part's fields as _port_part put them there.
        counters = {c.name: c for c in cast("tuple[Counter, ...]", part[7:])}
        port_state = cast("PortState | None", state)
        port_phys_state = cast("PortState | None", phys_state)
        link_rate = cast("LinkRate | None", rate)
        labels = [cast(str, device), str(number)]
        if link_layer is not None or link_rate is not None:
            speed = link_rate.speed if link_rate is not None and link_rate.speed else ""
            families.add(IB_PORT_INFO, [*labels, cast("str | None", link_layer) or "", speed], 1)
        if port_state is not None:
            families.add(IB_STATE, labels, port_state.code)
        if port_phys_state is not None:
            families.add(IB_PHYS_STATE, labels, port_phys_state.code)
        if link_rate is not None:
            families.add(IB_RATE, labels, link_rate.bytes_per_second)
            families.add(IB_LANES, labels, link_rate.lanes)
        for counter_name, spec in _PACKET_COUNTERS:
            counter = counters.get(counter_name)
            if counter is not None:
                families.add(spec, labels, counter.value)
        # The kernel's error counters in its order, then any other file in the record's.
        known = [counters.pop(name) for name in ERROR_COUNTERS if name in counters]
        for counter in (*known, *counters.values()):
            name = counter.name
            if name in TRAFFIC_COUNTERS or name in _PACKET_NAMES:
                continue  # the traffic families
            kind = counter_kind(name)
            if kind == KIND_ERROR:
                families.add(IB_ERRORS, [*labels, name], counter.value)
                if counter.bits is not None and counter.bits < 64:
                    families.add(IB_ERRORS_SATURATED, [*labels, name], int(counter.saturated))
            elif kind == KIND_CONGESTION:
                families.add(IB_CONGESTION, [*labels, name], counter.value)
            elif kind != KIND_TRAFFIC:
                families.add(IB_OTHER_COUNTERS, [*labels, name], counter.value)
        for counter in cast("tuple[Counter, ...]", hw):
            if hw_counter_is_gauge(counter.name):
                families.add(IB_PORT_HW_GAUGE, [*labels, counter.name], counter.value)
                continue
            kind = counter_kind(counter.name, hw=True)
            spec = _HW_KIND_SPECS.get(kind, IB_PORT_HW)
            families.add(spec, [*labels, counter.name], counter.value)
    return families.all()


#: The families of port hw_counters by kind; the kinds not here go to IB_PORT_HW.
_HW_KIND_SPECS: dict[str, MetricSpec] = {
    KIND_ERROR: IB_PORT_HW_ERRORS,
    KIND_CONGESTION: IB_CONGESTION,
}
_PACKET_NAMES = frozenset(counter for counter, _ in _PACKET_COUNTERS)


def _traffic_families(data: InfinibandData) -> tuple[Metric, ...]:
    families = _Families(_IB_TRAFFIC_SPECS)
    for port in data.ports():
        labels = [port.device, str(port.port)]
        if port.rcv_bytes is not None:
            families.add(IB_RX_BYTES, labels, port.rcv_bytes)
        if port.xmit_bytes is not None:
            families.add(IB_TX_BYTES, labels, port.xmit_bytes)
        for counter_name, spec in _TRAFFIC_AS_READ:
            counter = port.counter(counter_name)
            if counter is not None:
                families.add(spec, labels, counter.value)
    return families.all()


#: The traffic counters exported as they are (the data counters go out as bytes, above).
_TRAFFIC_AS_READ: tuple[tuple[str, MetricSpec], ...] = (
    *((counter, spec) for counter, spec in _PACKET_COUNTERS if counter in TRAFFIC_COUNTERS),
    ("port_xmit_wait", IB_XMIT_WAIT),
)
_NET_SPECS: tuple[MetricSpec, ...] = (
    NET_INFO,
    NET_UP,
    NET_ADMIN_UP,
    NET_CARRIER,
    NET_MTU,
    *(spec for _, spec in _NET_COUNTERS),
)


def infiniband_families(data: InfinibandData, kept: KeptFamilies | None = None) -> Iterator[Metric]:
    # Each build gives one family per spec of its own, in their order.
    built = {
        **dict(
            zip(
                _IB_DEVICE_SPECS,
                kept_or_built(kept, _device_families, [_device_part(d) for d in data.devices]),
                strict=True,
            )
        ),
        **dict(
            zip(
                _IB_PORT_SPECS,
                kept_or_built(kept, _port_families, [_port_part(p) for p in data.ports()]),
                strict=True,
            )
        ),
        **dict(zip(_IB_TRAFFIC_SPECS, _traffic_families(data), strict=True)),
    }
    # In the catalogue's order, whichever build made each family.
    return (built[spec] for spec in _IB_SPECS if built[spec].values)


def netdev_families(data: NetdevData) -> Iterator[Metric]:
    families = _Families(_NET_SPECS)
    for link in data.links:
        labels = [link.name]
        families.add(
            NET_INFO, [link.name, link.operstate or "", link.kind or "", link.pci_address or ""], 1
        )
        if link.operstate is not None:
            families.add(NET_UP, labels, 1 if link.operstate == "up" else 0)
        if link.admin_up is not None:
            families.add(NET_ADMIN_UP, labels, 1 if link.admin_up else 0)
        if link.carrier is not None:
            families.add(NET_CARRIER, labels, 1 if link.carrier else 0)
        if link.mtu is not None:
            families.add(NET_MTU, labels, link.mtu)
        if link.stats is not None:
            for field, spec in _NET_COUNTERS:
                families.add(spec, labels, getattr(link.stats, field))
    return families.non_empty()


#: The families of values the infiniband source reads on full reads are kept between them.
KEEPS_FAMILIES = True


def families(snapshot: Snapshot, kept: KeptFamilies | None = None) -> Iterable[Metric]:
    ib = snapshot.latest(INFINIBAND)
    if ib is not None:
        yield from infiniband_families(ib, kept)
    net = snapshot.latest(NETDEV)
    if net is not None:
        yield from netdev_families(net)
