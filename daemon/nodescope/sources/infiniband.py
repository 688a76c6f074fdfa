"""InfiniBand / RoCE ports and counters from ``/sys/class/infiniband``.

Reads, per RDMA device ``<sysfs>/class/infiniband/<dev>/``: ``node_guid``, ``fw_ver``,
``hca_type``, ``board_id``, device-level ``hw_counters/*``, the PCI function behind the
``device`` link and its netdevs (``device/net/*``); per port ``ports/<n>/``: ``state``,
``phys_state``, ``rate``, ``link_layer``, ``counters/*`` and ``hw_counters/*``.

Formats are defined by the kernel in ``drivers/infiniband/core/sysfs.c`` and documented in
``Documentation/ABI/stable/sysfs-class-infiniband``:

* ``state`` is ``"%d: %s"`` (``4: ACTIVE``); ``phys_state`` likewise (``5: LinkUp``, and
  names with spaces such as ``7: Phy Test``).
* ``rate`` is ``"%d%s Gb/sec (%dX%s)"``: ``400 Gb/sec (4X NDR)``, ``2.5 Gb/sec (1X SDR)``;
  kernels before 4.x printed no speed name for SDR (``10 Gb/sec (4X)``).
* ``counters/*`` come from PerfMgmt MADs (``show_pma_counter``). ``port_xmit_data`` and
  ``port_rcv_data`` count 4-byte words. The data and packet counters are 64 bits wide when
  the HCA advertises extended counters (the kernel then also creates ``unicast_*`` and
  ``multicast_*``), 32 bits otherwise; the error counters are 4, 8 or 16 bits wide. IBA
  counters stop at their maximum rather than wrap, so a counter at all-ones is "saturated":
  its increase since then is unknown.
* ``hw_counters/*`` are driver-defined u64 values (``print_hw_stat``); ``lifespan`` is the
  refresh period in ms, not a counter. Some drivers put gauges there (bnxt_re ``active_*``,
  ``watermark_*``).

A counter file that cannot be read (a failed MAD) or reads ``N/A (no PMA)`` is absent.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from nodescope.errors import ParseError
from nodescope.model.counters import counter_delta
from nodescope.roots import Roots
from nodescope.sources.base import FunctionSource, Source, read_optional

NAME = "infiniband"

T = TypeVar("T")

# Widths from the PORT_PMA_ATTR table of drivers/infiniband/core/sysfs.c.
_ERROR_COUNTER_BITS: dict[str, int] = {
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
ERROR_COUNTERS: tuple[str, ...] = tuple(_ERROR_COUNTER_BITS)

#: Counters that are 64 bits wide with extended PMA counters and 32 bits without.
DATA_COUNTERS: tuple[str, ...] = (
    "port_xmit_data",
    "port_rcv_data",
    "port_xmit_packets",
    "port_rcv_packets",
)
#: Only the IETF extended table has these; their presence proves 64-bit data counters.
EXTENDED_ONLY_COUNTERS: tuple[str, ...] = (
    "unicast_xmit_packets",
    "unicast_rcv_packets",
    "multicast_xmit_packets",
    "multicast_rcv_packets",
)
_FIXED_BITS: dict[str, int] = {
    **_ERROR_COUNTER_BITS,
    "port_xmit_wait": 32,
    **dict.fromkeys(EXTENDED_ONLY_COUNTERS, 64),
}
#: hw_counters entries that are gauges, not counters.
HW_GAUGE_PREFIXES: tuple[str, ...] = ("active_", "watermark_")

PORT_STATES = ("NOP", "DOWN", "INIT", "ARMED", "ACTIVE", "ACTIVE_DEFER")
PORT_STATE_ACTIVE = 4
PHYS_STATE_LINK_UP = 5

#: Data rate per lane in Gb/s for each speed name the kernel prints.
LANE_GBPS: dict[str, float] = {
    "SDR": 2.5,
    "DDR": 5.0,
    "QDR": 10.0,
    "FDR10": 10.0,
    "FDR": 14.0,
    "EDR": 25.0,
    "HDR": 50.0,
    "NDR": 100.0,
    "XDR": 200.0,
}

_STATE_RE = re.compile(r"([0-9]{1,9}): (\S(?:.*\S)?)")
_RATE_RE = re.compile(r"([0-9]{1,9}(?:\.[0-9]{1,9})?) Gb/sec \(([0-9]{1,4})X(?: ([A-Za-z0-9]+))?\)")
_COUNTER_RE = re.compile(r"[0-9]{1,40}")
_GUID_RE = re.compile(r"[0-9a-fA-F]{4}(?::[0-9a-fA-F]{4}){3}")
_BDF_RE = re.compile(r"[0-9a-fA-F]{4,}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")
_NO_PMA = "N/A (no PMA)"
_PORT_RE = re.compile(r"[0-9]{1,5}")


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

    def ports(self) -> Iterable[IbPort]:
        for device in self.devices:
            yield from device.ports


def _find(counters: tuple[Counter, ...], name: str) -> Counter | None:
    for counter in counters:
        if counter.name == name:
            return counter
    return None


# --------------------------------------------------------------------------------------------
# Parsers (pure)


def _one_line(text: str, source: str) -> str:
    """The single value of a sysfs attribute file, without its newline."""
    body = text[:-1] if text.endswith("\n") else text
    if "\n" in body:
        raise ParseError(source, "expected a single line", 2)
    value = body.strip()
    if not value:
        raise ParseError(source, "empty value", 1)
    if not value.isprintable():
        raise ParseError(source, f"unprintable characters in {value!r}", 1)
    return value


def parse_state(text: str, source: str = "state") -> PortState:
    """``state`` / ``phys_state``: ``"4: ACTIVE"`` → ``PortState(4, "ACTIVE")``."""
    value = _one_line(text, source)
    m = _STATE_RE.fullmatch(value)
    if m is None:
        raise ParseError(source, f"expected '<number>: <name>', got {value!r}", 1)
    return PortState(int(m.group(1)), m.group(2))


parse_phys_state = parse_state


def parse_rate(text: str, source: str = "rate") -> LinkRate:
    """``rate``: ``"400 Gb/sec (4X NDR)"`` → ``LinkRate(400.0, 4, "NDR")``."""
    value = _one_line(text, source)
    m = _RATE_RE.fullmatch(value)
    if m is None:
        raise ParseError(source, f"expected '<Gb/s> Gb/sec (<lanes>X[ <speed>])', got {value!r}", 1)
    lanes = int(m.group(2))
    if lanes == 0:
        raise ParseError(source, f"zero lanes in {value!r}", 1)
    return LinkRate(float(m.group(1)), lanes, m.group(3))


def parse_link_layer(text: str, source: str = "link_layer") -> str:
    """``link_layer``: ``InfiniBand``, ``Ethernet`` or ``Unknown`` (kept as printed)."""
    value = _one_line(text, source)
    if any(c.isspace() for c in value):
        raise ParseError(source, f"expected one word, got {value!r}", 1)
    return value


def parse_counter(text: str, source: str = "counter") -> int | None:
    """A counter file: a decimal integer; ``None`` for ``N/A (no PMA)`` (no PerfMgmt agent)."""
    value = _one_line(text, source)
    if value == _NO_PMA:
        return None
    if _COUNTER_RE.fullmatch(value) is None:
        raise ParseError(source, f"expected a non-negative integer, got {value!r}", 1)
    return int(value)


def parse_node_guid(text: str, source: str = "node_guid") -> str:
    """``node_guid``: ``"%04x:%04x:%04x:%04x"``, returned in lower case."""
    value = _one_line(text, source)
    if _GUID_RE.fullmatch(value) is None:
        raise ParseError(source, f"expected xxxx:xxxx:xxxx:xxxx, got {value!r}", 1)
    return value.lower()


def parse_attribute(text: str, source: str = "attribute") -> str:
    """A free-text one-line attribute: ``fw_ver``, ``hca_type``, ``board_id``."""
    return _one_line(text, source)


def counter_bits(name: str, values: dict[str, int]) -> int | None:
    """Width in bits of the ``counters/<name>`` file, given all the port's ``counters/``.

    Data and packet counters are 64-bit when the kernel chose an extended table; the IETF one
    is recognised by its ``unicast_*``/``multicast_*`` files, and any value beyond 32 bits
    proves it too. Otherwise they are taken as 32-bit: a drop is then read as one wrap
    rather than a reset, the right reading for HCAs without extended counters.
    """
    fixed = _FIXED_BITS.get(name)
    if fixed is not None:
        return fixed
    if name in DATA_COUNTERS:
        extended = any(n in values for n in EXTENDED_ONLY_COUNTERS) or any(
            values.get(n, 0) >= 1 << 32 for n in DATA_COUNTERS
        )
        return 64 if extended else 32
    return None


def hw_counter_is_gauge(name: str) -> bool:
    return name.startswith(HW_GAUGE_PREFIXES)


def pci_address_from_path(path: str) -> str | None:
    """The last PCI function (``dddd:bb:dd.f``) among the components of a resolved sysfs
    path, so a virtio or auxiliary child still maps to its PCI function."""
    for part in reversed(path.split("/")):
        if _BDF_RE.fullmatch(part):
            return part.lower()
    return None


# --------------------------------------------------------------------------------------------
# Reader


def _listdir(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []


def _read_values(directory: Path) -> tuple[dict[str, int], int | None]:
    """Integer files of a ``counters``/``hw_counters`` directory, and ``lifespan`` apart."""
    values: dict[str, int] = {}
    lifespan: int | None = None
    for name in _listdir(directory):
        # A string path: a port has dozens of counter files, read every second.
        path = f"{directory}/{name}"
        text = read_optional(path)
        if text is None:
            continue
        value = parse_counter(text, path)
        if value is None:
            continue
        if name == "lifespan":
            lifespan = value
        else:
            values[name] = value
    return values, lifespan


def _hw_counters(values: dict[str, int]) -> tuple[Counter, ...]:
    # print_hw_stat prints a u64.
    return tuple(Counter(name, value, 64) for name, value in values.items())


def _read_parsed(path: Path, parse: Callable[[str, str], T]) -> T | None:
    text = read_optional(path)
    return None if text is None else parse(text, str(path))


def read_port(device: str, port_dir: Path) -> IbPort:
    try:
        port = int(port_dir.name)
    except ValueError as exc:
        raise ParseError(str(port_dir), "port directory name is not a number") from exc

    values, _ = _read_values(port_dir / "counters")
    counters = tuple(Counter(n, v, counter_bits(n, values)) for n, v in values.items())
    hw_values, lifespan = _read_values(port_dir / "hw_counters")
    xmit = values.get("port_xmit_data")
    rcv = values.get("port_rcv_data")
    return IbPort(
        device=device,
        port=port,
        state=_read_parsed(port_dir / "state", parse_state),
        phys_state=_read_parsed(port_dir / "phys_state", parse_state),
        rate=_read_parsed(port_dir / "rate", parse_rate),
        link_layer=_read_parsed(port_dir / "link_layer", parse_link_layer),
        counters=counters,
        hw_counters=_hw_counters(hw_values),
        hw_counters_lifespan_ms=lifespan,
        xmit_bytes=None if xmit is None else xmit * 4,
        rcv_bytes=None if rcv is None else rcv * 4,
    )


def read_device(device_dir: Path) -> IbDevice:
    name = device_dir.name

    link = device_dir / "device"
    pci_address = pci_address_from_path(os.path.realpath(link)) if link.exists() else None
    hw_values, _ = _read_values(device_dir / "hw_counters")
    ports_dir = device_dir / "ports"
    port_names = sorted((p for p in _listdir(ports_dir) if _PORT_RE.fullmatch(p)), key=int)
    return IbDevice(
        name=name,
        node_guid=_read_parsed(device_dir / "node_guid", parse_node_guid),
        fw_ver=_read_parsed(device_dir / "fw_ver", parse_attribute),
        hca_type=_read_parsed(device_dir / "hca_type", parse_attribute),
        board_id=_read_parsed(device_dir / "board_id", parse_attribute),
        pci_address=pci_address,
        netdevs=tuple(_listdir(link / "net")),
        hw_counters=_hw_counters(hw_values),
        ports=tuple(read_port(name, ports_dir / p) for p in port_names),
    )


def read_infiniband(roots: Roots) -> InfinibandData:
    """Every RDMA device under ``<sysfs>/class/infiniband``; none when the class is absent."""
    base = roots.sysfs / "class" / "infiniband"
    return InfinibandData(tuple(read_device(base / name) for name in _listdir(base)))


def make_source() -> Source:
    return FunctionSource(NAME, read_infiniband)


# --------------------------------------------------------------------------------------------
# Rates


@dataclass(frozen=True, slots=True)
class CounterRate:
    name: str
    per_second: float | None


@dataclass(frozen=True, slots=True)
class PortRates:
    """Per-second figures of one port over one interval; ``None`` where not knowable
    (counter absent, reset, or saturated)."""

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
    #: Sum over the error counters that could be measured.
    errors_per_second: float | None
    counters: tuple[CounterRate, ...]
    hw_counters: tuple[CounterRate, ...]


@dataclass(frozen=True, slots=True)
class InfinibandRates:
    seconds: float
    ports: tuple[PortRates, ...]

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


def _port_rates(prev: IbPort, cur: IbPort, seconds: float) -> PortRates:
    def rate(name: str, scale: int = 1) -> float | None:
        return _rate(prev.counter(name), cur.counter(name), seconds, scale)

    xmit_bps = rate("port_xmit_data", 4)
    rcv_bps = rate("port_rcv_data", 4)
    capacity = cur.rate.bytes_per_second if cur.rate is not None else None
    error_deltas = [
        d
        for name in ERROR_COUNTERS
        if (d := _delta(prev.counter(name), cur.counter(name))) is not None
    ]
    return PortRates(
        device=cur.device,
        port=cur.port,
        xmit_bytes_per_second=xmit_bps,
        rcv_bytes_per_second=rcv_bps,
        xmit_packets_per_second=rate("port_xmit_packets"),
        rcv_packets_per_second=rate("port_rcv_packets"),
        xmit_wait_per_second=rate("port_xmit_wait"),
        xmit_utilization=None if xmit_bps is None or not capacity else xmit_bps / capacity,
        rcv_utilization=None if rcv_bps is None or not capacity else rcv_bps / capacity,
        errors_per_second=sum(error_deltas) / seconds if error_deltas else None,
        counters=tuple(
            CounterRate(c.name, _rate(prev.counter(c.name), c, seconds)) for c in cur.counters
        ),
        hw_counters=tuple(
            CounterRate(c.name, _rate(prev.hw_counter(c.name), c, seconds))
            for c in cur.hw_counters
            if not hw_counter_is_gauge(c.name)
        ),
    )


def port_rates(prev: InfinibandData, cur: InfinibandData, seconds: float) -> InfinibandRates:
    """Rates of every port present in both samples (a port that appeared has none yet)."""
    if seconds <= 0:
        return InfinibandRates(seconds, ())
    before = {(p.device, p.port): p for p in prev.ports()}
    return InfinibandRates(
        seconds,
        tuple(
            _port_rates(before[(p.device, p.port)], p, seconds)
            for p in cur.ports()
            if (p.device, p.port) in before
        ),
    )
