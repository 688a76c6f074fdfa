"""The records of the ``infiniband`` source: RDMA devices, their ports and counters, and
the per-second figures of two of them.

``sources/infiniband.py`` reads them from ``/sys/class/infiniband``. A port's bytes are bytes
here (the kernel's ``port_xmit_data`` and ``port_rcv_data`` count 4-byte words), each counter
carries its width, and a counter at all-ones is saturated: IBA counters stop there rather than
wrap, so its increase since is unknown.

Each counter has a kind (:func:`counter_kind`): errors (packets lost, corrupted, retransmitted,
a link that failed) are kept apart from congestion (transmit waits, ECN marks, congestion
notifications), which a busy lossless fabric shows at its normal operating point.
:class:`PortRates` carries every counter's rate by file name, and the error and congestion
ones again by kind.

The source reads the traffic counters (:data:`TRAFFIC_COUNTERS`) on every run and the rest
every few runs, carrying the last values in between: :func:`port_rates` takes the traffic
rates over the interval between two records and the others over the span between the two
full reads (:mod:`nodescope.model.slow`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from nodescope.model.counters import counter_delta
from nodescope.model.skips import NOTHING_SKIPPED, Skipped
from nodescope.model.slow import SlowRead
from nodescope.model.slow import slow_pair as _slow_pair
from nodescope.model.source_key import SourceKey

# Widths from the PORT_PMA_ATTR table of drivers/infiniband/core/sysfs.c.
ERROR_COUNTER_BITS: dict[str, int] = {
    "symbol_error": 16,
    "link_error_recovery": 8,
    "link_downed": 8,
    "port_rcv_errors": 16,
    "port_rcv_remote_physical_errors": 16,
    "port_rcv_switch_relay_errors": 16,
    "port_xmit_discards": 16,
    "port_xmit_constraint_errors": 8,
    "port_rcv_constraint_errors": 8,
    "local_link_integrity_errors": 4,
    "excessive_buffer_overrun_errors": 4,
    "VL15_dropped": 16,
}
#: Error counters of ``counters/``, in the kernel's order.
ERROR_COUNTERS: tuple[str, ...] = tuple(ERROR_COUNTER_BITS)

#: Counters that are 64 bits wide with extended PMA counters and 32 bits without.
DATA_COUNTERS: tuple[str, ...] = (
    "port_xmit_data",
    "port_rcv_data",
    "port_xmit_packets",
    "port_rcv_packets",
)
#: ``counters/`` files the source reads on every run: the port's bytes, packets and transmit
#: waits. The error counters and the unicast/multicast split of the packets are read every
#: few runs: a counters/ file is a PerfMgmt MAD to the HCA on every read.
TRAFFIC_COUNTERS: frozenset[str] = frozenset((*DATA_COUNTERS, "port_xmit_wait"))
#: hw_counters entries that are gauges, not counters.
HW_GAUGE_PREFIXES: tuple[str, ...] = ("active_", "watermark_")

# What a counter counts. Errors and congestion are kept apart: congestion (transmit waits,
# ECN marks, CNPs) is how a busy lossless fabric slows senders down and is normal under
# load, while an error counter counts packets lost, corrupted, retransmitted or refused.
#: packets lost, corrupted, retransmitted, refused, or a link that failed or retrained
KIND_ERROR = "error"
#: a sender held back or told to slow down: transmit waits, ECN marks, CNPs
KIND_CONGESTION = "congestion"
#: work done: data, packets, requests received
KIND_TRAFFIC = "traffic"
#: a driver counter whose name says neither (see :func:`counter_kind`)
KIND_OTHER = "other"
COUNTER_KINDS: tuple[str, ...] = (KIND_ERROR, KIND_CONGESTION, KIND_TRAFFIC, KIND_OTHER)

#: The kind of every file of the kernel's ``counters/`` tables.
_PMA_KINDS: dict[str, str] = {
    **dict.fromkeys(ERROR_COUNTER_BITS, KIND_ERROR),
    **dict.fromkeys(DATA_COUNTERS, KIND_TRAFFIC),
    "unicast_xmit_packets": KIND_TRAFFIC,
    "unicast_rcv_packets": KIND_TRAFFIC,
    "multicast_xmit_packets": KIND_TRAFFIC,
    "multicast_rcv_packets": KIND_TRAFFIC,
    "port_xmit_wait": KIND_CONGESTION,
}
# The port hw_counters of the drivers met on GPU nodes, by kind (mlx5 counters.c: the Q,
# retransmission, extended-error, RoCE-accelerator, congestion and PPCNT tables; rxe, whose
# names a soft-RoCE test port shows). A name in none of them is judged by its words.
HW_ERROR_COUNTERS: frozenset[str] = frozenset(
    {
        # mlx5
        "out_of_buffer",
        "out_of_sequence",
        "duplicate_request",
        "rnr_nak_retry_err",
        "packet_seq_err",
        "implied_nak_seq_err",
        "local_ack_timeout_err",
        "resp_local_length_error",
        "resp_cqe_error",
        "req_cqe_error",
        "req_remote_invalid_request",
        "req_remote_access_errors",
        "resp_remote_access_errors",
        "resp_cqe_flush_error",
        "req_cqe_flush_error",
        "req_rnr_retries_exceeded",
        "req_transport_retries_exceeded",
        "roce_adp_retrans",
        "roce_adp_retrans_to",
        "roce_slow_restart",
        "roce_slow_restart_trans",
        "rx_icrc_encapsulated",
        # rxe
        "out_of_seq_request",
        "rcvd_rnr_err",
        "send_rnr_err",
        "rcvd_seq_err",
        "retry_exceeded_err",
        "retry_rnr_exceeded_err",
        "completer_retry_err",
        "send_err",
        "link_downed",
    }
)
HW_CONGESTION_COUNTERS: frozenset[str] = frozenset(
    {
        "np_cnp_sent",
        "np_ecn_marked_roce_packets",
        "rp_cnp_handled",
        "rp_cnp_ignored",
        "roce_slow_restart_cnps",
    }
)
HW_TRAFFIC_COUNTERS: frozenset[str] = frozenset(
    {
        "rx_write_requests",
        "rx_read_requests",
        "rx_atomic_requests",
        "rx_dct_connect",
        "sent_pkts",
        "rcvd_pkts",
        "rdma_sends",
        "rdma_recvs",
    }
)
_HW_KINDS: dict[str, str] = {
    **dict.fromkeys(HW_ERROR_COUNTERS, KIND_ERROR),
    **dict.fromkeys(HW_CONGESTION_COUNTERS, KIND_CONGESTION),
    **dict.fromkeys(HW_TRAFFIC_COUNTERS, KIND_TRAFFIC),
}
#: Words (between underscores) that make an unknown counter name congestion, then error.
CONGESTION_WORDS: frozenset[str] = frozenset(
    {"cnp", "cnps", "ecn", "cong", "congestion", "pause", "xoff", "wait"}
)
ERROR_WORDS: frozenset[str] = frozenset(
    {
        "err",
        "error",
        "errors",
        "discard",
        "discards",
        "drop",
        "drops",
        "dropped",
        "timeout",
        "retrans",
        "retry",
        "retries",
        "exceeded",
        "invalid",
        "corrupt",
        "bad",
        "lost",
        "overrun",
        "overflow",
        "nak",
    }
)


def counter_kind(name: str, hw: bool = False) -> str:
    """What the counter ``name`` of ``counters/`` (or of ``hw_counters/`` with ``hw``)
    counts: one of :data:`COUNTER_KINDS`.

    Known names have their kind from the kernel's tables. Names differ by driver and
    firmware, so an unknown one is judged by its words rather than dropped: any of
    :data:`CONGESTION_WORDS` makes it congestion, else any of :data:`ERROR_WORDS` an error,
    else it is ``other``. Gauges (:func:`hw_counter_is_gauge`) are not counters at all.
    """
    kind = (_HW_KINDS if hw else _PMA_KINDS).get(name)
    if kind is not None:
        return kind
    words = set(name.lower().split("_"))
    if not words.isdisjoint(CONGESTION_WORDS):
        return KIND_CONGESTION
    if not words.isdisjoint(ERROR_WORDS):
        return KIND_ERROR
    return KIND_OTHER


PORT_STATES = ("NOP", "DOWN", "INIT", "ARMED", "ACTIVE", "ACTIVE_DEFER")
PORT_STATE_ACTIVE = 4
PHYS_STATE_LINK_UP = 5


# --------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True, slots=True)
class PortState:
    """A numbered state as the kernel prints it: ``code`` 4, ``name`` ``"ACTIVE"``."""

    code: int
    name: str


@dataclass(frozen=True, slots=True)
class LinkRate:
    """``rate``: total data rate over all lanes, lane count and speed name (``None`` when the
    kernel printed none, which old kernels did for SDR)."""

    gbps: float
    lanes: int
    speed: str | None

    @property
    def bytes_per_second(self) -> float:
        return self.gbps * 1e9 / 8


@dataclass(frozen=True, slots=True)
class Counter:
    """One counter file: its value and its width in bits (``None``: unknown width)."""

    name: str
    value: int
    bits: int | None

    @property
    def saturated(self) -> bool:
        """At all-ones: IBA counters stop there, so later increases are invisible."""
        return self.bits is not None and self.bits < 64 and self.value == (1 << self.bits) - 1


@dataclass(frozen=True, slots=True)
class IbPort:
    device: str
    port: int
    state: PortState | None
    phys_state: PortState | None
    rate: LinkRate | None
    link_layer: str | None
    counters: tuple[Counter, ...]
    hw_counters: tuple[Counter, ...]
    hw_counters_lifespan_ms: int | None
    #: ``port_xmit_data``/``port_rcv_data`` × 4: bytes, not words.
    xmit_bytes: int | None
    rcv_bytes: int | None

    def counter(self, name: str) -> Counter | None:
        return _find(self.counters, name)

    def slow_counters(self) -> Iterator[Counter]:
        """Its counters other than the traffic ones: those the source reads on full reads
        only, carrying the same objects in between."""
        return (c for c in self.counters if c.name not in TRAFFIC_COUNTERS)

    def hw_counter(self, name: str) -> Counter | None:
        return _find(self.hw_counters, name)


@dataclass(frozen=True, slots=True)
class IbDevice:
    name: str
    node_guid: str | None
    fw_ver: str | None
    hca_type: str | None
    board_id: str | None
    #: The PCI function behind ``<dev>/device``; ``None`` for soft devices and captures.
    pci_address: str | None
    netdevs: tuple[str, ...]
    hw_counters: tuple[Counter, ...]
    ports: tuple[IbPort, ...]


@dataclass(frozen=True, slots=True)
class InfinibandData:
    devices: tuple[IbDevice, ...]
    #: when the values other than the traffic counters were read (the source's clock), and
    #: the record of the full read before; ``None`` in a record that does not say
    slow: SlowRead[InfinibandData] | None = field(default=None, compare=False, repr=False)
    #: attributes and counters of this run left absent because they were malformed or refused
    skipped: Skipped = field(default=NOTHING_SKIPPED, compare=False)

    def ports(self) -> Iterable[IbPort]:
        for device in self.devices:
            yield from device.ports


def _find(counters: tuple[Counter, ...], name: str) -> Counter | None:
    for counter in counters:
        if counter.name == name:
            return counter
    return None


def hw_counter_is_gauge(name: str) -> bool:
    return name.startswith(HW_GAUGE_PREFIXES)


# --------------------------------------------------------------------------------------------
# Rates


@dataclass(frozen=True, slots=True)
class CounterRate:
    name: str
    per_second: float | None


@dataclass(frozen=True, slots=True)
class PortRates:
    """Per-second figures of one port; ``None`` where not knowable (counter absent, reset,
    or saturated, or no two full reads yet). The traffic figures (:data:`TRAFFIC_COUNTERS`)
    are over the interval between the two records, the others (``errors_per_second``, the
    other ``counters`` and the ``hw_counters``) over the span between the two full reads
    (``InfinibandRates.slow_seconds``)."""

    device: str
    port: int
    xmit_bytes_per_second: float | None
    rcv_bytes_per_second: float | None
    xmit_packets_per_second: float | None
    rcv_packets_per_second: float | None
    xmit_wait_per_second: float | None
    #: Share of the link's data rate in use, 0..1 (can exceed 1 slightly through timing).
    xmit_utilization: float | None
    rcv_utilization: float | None
    #: Sum over the link's error counters (those of ``counters/``) that could be measured.
    errors_per_second: float | None
    #: Every counter of the port by its file name: the ``counters/`` files in the record's
    #: order, then the ``hw_counters/`` ones other than gauges (a driver counter named like a
    #: ``counters/`` file is left to ``hw_counters``).
    counters: tuple[CounterRate, ...]
    #: The ``hw_counters/`` files other than gauges.
    hw_counters: tuple[CounterRate, ...]
    #: The counters of ``counters`` that count errors (:data:`KIND_ERROR`), both directories.
    errors: tuple[CounterRate, ...] = ()
    #: The counters of ``counters`` that count congestion (:data:`KIND_CONGESTION`):
    #: ``port_xmit_wait`` (over the interval, as ``xmit_wait_per_second``) and the driver's
    #: ECN and CNP counters (over the span between full reads). Never among the errors.
    congestion: tuple[CounterRate, ...] = ()

    def rate(self, name: str) -> float | None:
        """The per-second rate of the counter ``name`` (either directory); ``None`` when the
        port has no such counter or its rate is not knowable."""
        for counter in self.counters:
            if counter.name == name:
                return counter.per_second
        return None


@dataclass(frozen=True, slots=True)
class InfinibandRates:
    seconds: float
    ports: tuple[PortRates, ...]
    #: the span the rates of all but the traffic counters are over: ``seconds`` when both
    #: records read everything; ``None`` before two full reads
    slow_seconds: float | None = None

    def port(self, device: str, port: int) -> PortRates | None:
        for rates in self.ports:
            if rates.device == device and rates.port == port:
                return rates
        return None


def _delta(prev: Counter | None, cur: Counter | None) -> int | None:
    if prev is None or cur is None or cur.saturated:
        return None
    return counter_delta(prev.value, cur.value, cur.bits)


def _rate(
    prev: Counter | None, cur: Counter | None, seconds: float, scale: int = 1
) -> float | None:
    delta = _delta(prev, cur)
    return None if delta is None else delta * scale / seconds


@dataclass(frozen=True, slots=True)
class SlowPortRates:
    """The figures of one port that change only with a full read: the rates of its counters
    other than the traffic ones (by name) and of its ``hw_counters``, and the sum of its error
    counters' rates, over the span between the two full reads (``None`` where unknowable)."""

    counters: Mapping[str, CounterRate]
    hw_counters: tuple[CounterRate, ...]
    errors_per_second: float | None
    #: The ``hw_counters`` whose names no ``counters/`` file has: they follow the
    #: ``counters/`` ones in :attr:`PortRates.counters`.
    hw_named: tuple[CounterRate, ...] = ()
    #: The error and congestion counters among ``counters`` and ``hw_named`` (those of the
    #: congestion kind that are read every run, ``port_xmit_wait``, are left out: their rate
    #: is taken for every record).
    errors: tuple[CounterRate, ...] = ()
    congestion: tuple[CounterRate, ...] = ()


PortKey = tuple[str, int]


def _slow_port_rates(cur: IbPort, slow_prev: IbPort | None, slow_seconds: float) -> SlowPortRates:
    """``slow_prev`` is the port at the full read before the one ``cur`` carries, taken
    ``slow_seconds`` before it (``None``: not in that read, or none yet)."""
    # An HCA port carries dozens of counters and hw_counters: each earlier read is looked up
    # by name once here rather than scanned for every counter of the current one. Without a
    # full read to compare with, no counter has an earlier value and every rate is None.
    before = {} if slow_prev is None else {c.name: c for c in slow_prev.counters}
    hw_before = {} if slow_prev is None else {c.name: c for c in slow_prev.hw_counters}
    counters: dict[str, CounterRate] = {}
    errors: list[CounterRate] = []
    congestion: list[CounterRate] = []
    error_total = 0
    measured = False
    for c in cur.slow_counters():
        delta = _delta(before.get(c.name), c)
        rate = CounterRate(c.name, None if delta is None else delta / slow_seconds)
        counters[c.name] = rate
        kind = counter_kind(c.name)
        if kind == KIND_ERROR:
            errors.append(rate)
            if delta is not None:
                error_total += delta
                measured = True
        elif kind == KIND_CONGESTION:
            congestion.append(rate)
    names = {c.name for c in cur.counters}
    hw: list[CounterRate] = []
    hw_named: list[CounterRate] = []
    for c in cur.hw_counters:
        if hw_counter_is_gauge(c.name):
            continue
        rate = CounterRate(c.name, _rate(hw_before.get(c.name), c, slow_seconds))
        hw.append(rate)
        if c.name in names:
            continue
        hw_named.append(rate)
        kind = counter_kind(c.name, hw=True)
        if kind == KIND_ERROR:
            errors.append(rate)
        elif kind == KIND_CONGESTION:
            congestion.append(rate)
    return SlowPortRates(
        counters,
        tuple(hw),
        error_total / slow_seconds if measured else None,
        tuple(hw_named),
        tuple(errors),
        tuple(congestion),
    )


def slow_rates(
    slow: tuple[InfinibandData, float] | None, cur: InfinibandData
) -> dict[PortKey, SlowPortRates]:
    """:class:`SlowPortRates` of every port of ``cur``, against ``slow`` (what
    :func:`slow_pair` gives: the record of the full read to compare with and the seconds
    between; ``None`` before two full reads, when every one is ``None``)."""
    if slow is None:
        return {(p.device, p.port): _slow_port_rates(p, None, 0.0) for p in cur.ports()}
    record, seconds = slow
    before = {(p.device, p.port): p for p in record.ports()}
    rates: dict[PortKey, SlowPortRates] = {}
    for port in cur.ports():
        key = (port.device, port.port)
        rates[key] = _slow_port_rates(port, before.get(key), seconds)
    return rates


def slow_values(data: InfinibandData) -> tuple[object, ...]:
    """The objects :func:`slow_rates` reads of ``data``, for telling by identity that its
    slow values are those of the last call: a source carries the very same objects between
    two full reads (:class:`nodescope.model.slow.SlowReads`)."""
    parts: list[object] = []
    for port in data.ports():
        parts += (port.device, port.port, port.hw_counters, *port.slow_counters())
    return tuple(parts)


def _port_rates(prev: IbPort, cur: IbPort, seconds: float, slow: SlowPortRates) -> PortRates:
    before = {c.name: c for c in prev.counters if c.name in TRAFFIC_COUNTERS}
    now = {c.name: c for c in cur.counters if c.name in TRAFFIC_COUNTERS}

    def rate(name: str, scale: int = 1) -> float | None:
        return _rate(before.get(name), now.get(name), seconds, scale)

    xmit_bps = rate("port_xmit_data", 4)
    rcv_bps = rate("port_rcv_data", 4)
    capacity = cur.rate.bytes_per_second if cur.rate is not None else None
    # In the record's order; the slow ones are the objects made at the full read, then the
    # driver's counters as made there.
    counters: list[CounterRate] = []
    wait: CounterRate | None = None
    for c in cur.counters:
        name = c.name
        if name in TRAFFIC_COUNTERS:
            counter_rate = CounterRate(name, rate(name))
            if name == "port_xmit_wait":
                wait = counter_rate
        else:
            counter_rate = slow.counters.get(name) or CounterRate(name, None)
        counters.append(counter_rate)
    counters += slow.hw_named
    return PortRates(
        device=cur.device,
        port=cur.port,
        xmit_bytes_per_second=xmit_bps,
        rcv_bytes_per_second=rcv_bps,
        xmit_packets_per_second=rate("port_xmit_packets"),
        rcv_packets_per_second=rate("port_rcv_packets"),
        xmit_wait_per_second=None if wait is None else wait.per_second,
        xmit_utilization=None if xmit_bps is None or not capacity else xmit_bps / capacity,
        rcv_utilization=None if rcv_bps is None or not capacity else rcv_bps / capacity,
        errors_per_second=slow.errors_per_second,
        counters=tuple(counters),
        hw_counters=slow.hw_counters,
        errors=slow.errors,
        congestion=slow.congestion if wait is None else (wait, *slow.congestion),
    )


def slow_pair(
    previous: InfinibandData, current: InfinibandData, seconds: float
) -> tuple[InfinibandData, float] | None:
    """The record to take the change of ``current``'s counters other than the traffic ones
    against, and the seconds between them: ``previous`` (read ``seconds`` before) when both
    were full reads, else the record of the full read before the one ``current`` carries
    (see :mod:`nodescope.model.slow`)."""
    return _slow_pair(previous, previous.slow, current.slow, seconds)


def port_rates(
    prev: InfinibandData,
    cur: InfinibandData,
    seconds: float,
    slow: Mapping[PortKey, SlowPortRates] | None = None,
) -> InfinibandRates:
    """Rates of every port present in both samples (a port that appeared has none yet);
    the counters read only on full reads over the span between the two latest.

    ``slow``: :func:`slow_rates` of ``cur`` against ``slow_pair(prev, cur, seconds)``, when
    the caller has them from an earlier call whose :func:`slow_values` were the same
    objects; made here otherwise."""
    if seconds <= 0:
        return InfinibandRates(seconds, ())
    pair = slow_pair(prev, cur, seconds)
    if slow is None:
        slow = slow_rates(pair, cur)
    before = {(p.device, p.port): p for p in prev.ports()}
    return InfinibandRates(
        seconds,
        tuple(
            _port_rates(before[key], p, seconds, slow[key])
            for p in cur.ports()
            if (key := (p.device, p.port)) in before
        ),
        None if pair is None else pair[1],
    )


#: The ``infiniband`` source's records: the node's RDMA devices and ports.
INFINIBAND = SourceKey("infiniband", InfinibandData)
