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

Every file of ``counters/`` and ``hw_counters/`` is read, whatever its name: names vary by
driver and firmware, and what each counts (error, congestion, traffic) is judged in the model
(:func:`nodescope.model.infiniband.counter_kind`), never by dropping names the source does not
know. What bounds a port is :data:`MAX_COUNTER_FILES` per directory, the first by name, and
the names themselves (:data:`COUNTER_NAME_RE`); the files beyond or misnamed are counted in
``skipped``.

A counter file that cannot be read (a failed MAD) or reads ``N/A (no PMA)`` is absent.
Attributes are read as drivers write them: whitespace around the value (``InfiniBand\n\n``
from mlx4) is not part of it. A value that does not parse, or a file that is refused (a
FIFO, a device, over the size cap), makes that one attribute or counter absent and is
counted in the record's ``skipped``; the other ports and devices are read as usual.

The source (:class:`InfinibandSource`) reads the traffic counters of every port on every run
and the rest of the tree every ``slow_every`` runs (:data:`SLOW_EVERY` by default), carrying
the last values in between; a device that appears makes that run a full read. Each record
says when its other values were read and holds the record of the full read before
(``InfinibandData.slow``): :func:`port_rates` takes the rates of every counter but the
traffic ones over the span between the two full reads. The records and their rates are
declared in :mod:`nodescope.model.infiniband`.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from nodescope.errors import ParseError
from nodescope.fileio import SYSFS_ATTRIBUTE, FileTooLarge, NotARegularFile, read_bytes
from nodescope.model.infiniband import (
    DATA_COUNTERS,
    ERROR_COUNTER_BITS,
    ERROR_COUNTERS,
    HW_GAUGE_PREFIXES,
    INFINIBAND,
    PHYS_STATE_LINK_UP,
    PORT_STATE_ACTIVE,
    PORT_STATES,
    TRAFFIC_COUNTERS,
    Counter,
    CounterRate,
    IbDevice,
    IbPort,
    InfinibandData,
    InfinibandRates,
    LinkRate,
    PortRates,
    PortState,
    hw_counter_is_gauge,
    port_rates,
    slow_pair,
)
from nodescope.model.skips import SkipTally
from nodescope.model.slow import SlowReads
from nodescope.roots import Roots
from nodescope.sources.base import Source
from nodescope.sources.spec import SourceSpec

NAME = INFINIBAND.name

T = TypeVar("T")

#: Only the IETF extended table has these; their presence proves 64-bit data counters.
EXTENDED_ONLY_COUNTERS: tuple[str, ...] = (
    "unicast_xmit_packets",
    "unicast_rcv_packets",
    "multicast_xmit_packets",
    "multicast_rcv_packets",
)
_FIXED_BITS: dict[str, int] = {
    **ERROR_COUNTER_BITS,
    "port_xmit_wait": 32,
    **dict.fromkeys(EXTENDED_ONLY_COUNTERS, 64),
}
_EXTENDED_ONLY = frozenset(EXTENDED_ONLY_COUNTERS)

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

# Reasons a record was skipped (nodescope_source_records_skipped_total{reason}).
#: ``state``, ``rate``, ``link_layer``, ``node_guid``... whose text does not parse.
SKIP_ATTRIBUTE_UNPARSABLE = "attribute_unparsable"
#: a ``counters/`` or ``hw_counters/`` file whose text is not a number.
SKIP_COUNTER_UNPARSABLE = "counter_unparsable"
#: an attribute that is not a regular file or is over its size cap, refused unread.
SKIP_FILE_REFUSED = "file_refused"
#: a ``counters/`` or ``hw_counters/`` file beyond :data:`MAX_COUNTER_FILES` of its directory.
SKIP_COUNTER_OVER_LIMIT = "counter_over_limit"
#: a ``counters/`` or ``hw_counters/`` file whose name is not a counter name
#: (:data:`COUNTER_NAME_RE`): it would become a metric label.
SKIP_COUNTER_NAME = "counter_name_refused"

#: Files read from one ``counters/`` or ``hw_counters/`` directory, the first by name: the
#: kernel's ``counters/`` table has 21, mlx5's ``hw_counters/`` about 40 with every optional
#: group. Names vary by driver and firmware and none is dropped for being unknown, so this
#: is what bounds the model's and the metrics' counters of a port.
MAX_COUNTER_FILES = 128
#: A counter file name: what drivers name them, and short enough to be a metric label.
COUNTER_NAME_RE = re.compile(r"[A-Za-z0-9_]{1,64}")
#: A directory listing of counter names joined by "/".
_COUNTER_NAMES_RE = re.compile(r"[A-Za-z0-9_]{1,64}(?:/[A-Za-z0-9_]{1,64})*")


# --------------------------------------------------------------------------------------------
# Parsers (pure)


def _one_line(text: str, source: str) -> str:
    """The single value of a sysfs attribute file, without the whitespace around it: drivers
    end a value with one newline, some with more (mlx4's ``link_layer`` is
    ``InfiniBand\\n\\n``)."""
    value = text.strip()
    if "\n" in value:
        raise ParseError(source, "expected a single line", 2)
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
        return _data_counter_bits(values)
    return None


def _data_counter_bits(values: dict[str, int]) -> int:
    """The width of the port's data and packet counters (see :func:`counter_bits`)."""
    extended = any(n in values for n in EXTENDED_ONLY_COUNTERS) or any(
        values.get(n, 0) >= 1 << 32 for n in DATA_COUNTERS
    )
    return 64 if extended else 32


def _counters(values: dict[str, int]) -> tuple[Counter, ...]:
    """The ``counters/`` files of a port with their widths, in the order of ``values``."""
    return tuple(Counter(n, v, counter_bits(n, values)) for n, v in values.items())


def pci_address_from_path(path: str) -> str | None:
    """The last PCI function (``dddd:bb:dd.f``) among the components of a resolved sysfs
    path, so a virtio or auxiliary child still maps to its PCI function."""
    for part in reversed(path.split("/")):
        if _BDF_RE.fullmatch(part):
            return part.lower()
    return None


# --------------------------------------------------------------------------------------------
# Reader
#
# A full read opens about 55 files per HCA port. Paths are strings (pathlib's joins cost
# more than the reads), and files are opened relative to their directory's descriptor, so
# the kernel resolves the long /sys/class/infiniband/<dev> -> /sys/devices/... path once per
# directory. No descriptor is kept between runs: files are replaced, devices come and go.

_O_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def _listdir(path: Path | str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []


def _open_dir(path: str, dir_fd: int | None = None) -> int | None:
    try:
        return os.open(path, _O_DIRECTORY, dir_fd=dir_fd)
    except OSError:
        return None


def _read_bytes_at(dir_fd: int, name: str, tally: SkipTally, directory: str) -> bytes | None:
    """The bytes of ``name`` in the directory ``dir_fd`` (``directory`` names it); ``None``
    when it cannot be opened or read (a failed MAD is a read error) or is refused — a FIFO
    or device planted where an attribute should be, counted in ``tally``."""
    try:
        return read_bytes(name, SYSFS_ATTRIBUTE, dir_fd=dir_fd)
    except (NotARegularFile, FileTooLarge):
        tally.skip(SKIP_FILE_REFUSED, f"{directory}/{name}")
        return None
    except OSError:
        return None


def _read_at(dir_fd: int, name: str, tally: SkipTally, directory: str) -> str | None:
    data = _read_bytes_at(dir_fd, name, tally, directory)
    return None if data is None else data.decode("utf-8", errors="replace")


def _counter_value(data: bytes, directory: str, name: str, tally: SkipTally) -> int | None:
    """:func:`parse_counter` of a file's bytes, with a short way for the common text:
    ASCII digits and a newline; ``None`` (and counted) when the text is not a counter."""
    body = data[:-1] if data.endswith(b"\n") else data
    if 0 < len(body) <= 40 and body.isdigit():  # bytes.isdigit: ASCII digits only
        return int(body)
    path = f"{directory}/{name}"
    try:
        return parse_counter(data.decode("utf-8", errors="replace"), path)
    except ParseError:
        tally.skip(SKIP_COUNTER_UNPARSABLE, path)
        return None


def _read_values_at(
    dir_fd: int, sub: str, path: str, tally: SkipTally
) -> tuple[dict[str, int], int | None]:
    """Integer files of the ``counters``/``hw_counters`` directory ``sub`` of ``dir_fd``
    (``path`` names it), and ``lifespan`` apart; a file that does not parse is left out."""
    values: dict[str, int] = {}
    lifespan: int | None = None
    fd = _open_dir(sub, dir_fd)
    if fd is None:
        return values, lifespan
    try:
        names = sorted(os.listdir(fd))
        for name in names[MAX_COUNTER_FILES:]:
            tally.skip(SKIP_COUNTER_OVER_LIMIT, f"{path}/{name}")
        names = names[:MAX_COUNTER_FILES]
        # One match over the whole listing in the usual case that every name is good; "/" is
        # the one character no file name holds.
        all_good = _COUNTER_NAMES_RE.fullmatch("/".join(names)) is not None
        for name in names:
            if not all_good and COUNTER_NAME_RE.fullmatch(name) is None:
                tally.skip(SKIP_COUNTER_NAME, f"{path}/{name}")
                continue
            data = _read_bytes_at(fd, name, tally, path)
            if data is None:
                continue
            value = _counter_value(data, path, name, tally)
            if value is None:
                continue
            if name == "lifespan":
                lifespan = value
            else:
                values[name] = value
    finally:
        os.close(fd)
    return values, lifespan


def _hw_counters(values: dict[str, int]) -> tuple[Counter, ...]:
    # print_hw_stat prints a u64.
    return tuple(Counter(name, value, 64) for name, value in values.items())


def _parsed_at(
    dir_fd: int | None,
    directory: str,
    name: str,
    parse: Callable[[str, str], T],
    tally: SkipTally,
) -> T | None:
    """The attribute ``name`` parsed; ``None`` when absent, refused or malformed (the last two
    counted): one odd attribute leaves the rest of its port and device readable."""
    text = None if dir_fd is None else _read_at(dir_fd, name, tally, directory)
    if text is None:
        return None
    path = f"{directory}/{name}"
    try:
        return parse(text, path)
    except ParseError:
        tally.skip(SKIP_ATTRIBUTE_UNPARSABLE, path)
        return None


def read_port(device: str, port_dir: Path | str, tally: SkipTally | None = None) -> IbPort:
    """One port; what could not be read or parsed is absent and counted in ``tally``."""
    tally = SkipTally() if tally is None else tally
    port_dir = str(port_dir)
    try:
        port = int(port_dir.rpartition("/")[2])
    except ValueError as exc:
        raise ParseError(port_dir, "port directory name is not a number") from exc
    fd = _open_dir(port_dir)
    try:
        values: dict[str, int] = {}
        hw_values: dict[str, int] = {}
        lifespan: int | None = None
        if fd is not None:
            values, _ = _read_values_at(fd, "counters", f"{port_dir}/counters", tally)
            hw_values, lifespan = _read_values_at(
                fd, "hw_counters", f"{port_dir}/hw_counters", tally
            )
        state = _parsed_at(fd, port_dir, "state", parse_state, tally)
        phys_state = _parsed_at(fd, port_dir, "phys_state", parse_state, tally)
        rate = _parsed_at(fd, port_dir, "rate", parse_rate, tally)
        link_layer = _parsed_at(fd, port_dir, "link_layer", parse_link_layer, tally)
    finally:
        if fd is not None:
            os.close(fd)
    xmit = values.get("port_xmit_data")
    rcv = values.get("port_rcv_data")
    return IbPort(
        device=device,
        port=port,
        state=state,
        phys_state=phys_state,
        rate=rate,
        link_layer=link_layer,
        counters=_counters(values),
        hw_counters=_hw_counters(hw_values),
        hw_counters_lifespan_ms=lifespan,
        xmit_bytes=None if xmit is None else xmit * 4,
        rcv_bytes=None if rcv is None else rcv * 4,
    )


def _pci_address(device_dir: str) -> str | None:
    link = f"{device_dir}/device"
    return pci_address_from_path(os.path.realpath(link)) if os.path.exists(link) else None


def read_device(
    device_dir: Path | str,
    pci_address: Callable[[str], str | None] = _pci_address,
    tally: SkipTally | None = None,
) -> IbDevice:
    """One RDMA device; ``pci_address`` resolves the PCI function behind ``<dev>/device``;
    what could not be read or parsed is absent and counted in ``tally``."""
    tally = SkipTally() if tally is None else tally
    device_dir = str(device_dir)
    name = device_dir.rpartition("/")[2]
    fd = _open_dir(device_dir)
    try:
        hw_values: dict[str, int] = {}
        if fd is not None:
            hw_values, _ = _read_values_at(fd, "hw_counters", f"{device_dir}/hw_counters", tally)
        node_guid = _parsed_at(fd, device_dir, "node_guid", parse_node_guid, tally)
        fw_ver = _parsed_at(fd, device_dir, "fw_ver", parse_attribute, tally)
        hca_type = _parsed_at(fd, device_dir, "hca_type", parse_attribute, tally)
        board_id = _parsed_at(fd, device_dir, "board_id", parse_attribute, tally)
    finally:
        if fd is not None:
            os.close(fd)
    ports_dir = f"{device_dir}/ports"
    port_names = sorted((p for p in _listdir(ports_dir) if _PORT_RE.fullmatch(p)), key=int)
    return IbDevice(
        name=name,
        node_guid=node_guid,
        fw_ver=fw_ver,
        hca_type=hca_type,
        board_id=board_id,
        pci_address=pci_address(device_dir),
        netdevs=tuple(_listdir(f"{device_dir}/device/net")),
        hw_counters=_hw_counters(hw_values),
        ports=tuple(read_port(name, f"{ports_dir}/{p}", tally) for p in port_names),
    )


def read_infiniband(roots: Roots) -> InfinibandData:
    """Every RDMA device under ``<sysfs>/class/infiniband``; none when the class is absent."""
    base = f"{roots.sysfs}/class/infiniband"
    tally = SkipTally()
    devices = tuple(read_device(f"{base}/{name}", tally=tally) for name in _listdir(base))
    return InfinibandData(devices, skipped=tally.freeze())


#: Runs between two full reads of a device at production cadence (see InfinibandSource).
SLOW_EVERY = 10


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


class InfinibandSource:
    """The ``infiniband`` source: every run reads each port's traffic counters
    (:data:`TRAFFIC_COUNTERS`); every ``slow_every`` runs it reads the whole tree: error
    counters, ``hw_counters``, the port's ``state``, ``phys_state``, ``rate`` and
    ``link_layer`` (which change when the link goes down or retrains, as the error counters
    say too), identities, netdevs, the port list. A device that appeared makes the run a
    full read, so all carried values come from one read at one time; one that went is
    dropped. Between full reads a port's other values are those of the last full read, and
    the record says when that was on ``clock`` (see :func:`port_rates`).

    The PCI function behind ``<dev>/device`` is resolved again only when the texts of the
    two links that lead to it (``class/infiniband/<dev>`` and ``<dev>/device``) changed:
    the resolved path is a function of them, and resolving costs a ``stat`` per component.
    """

    name = NAME

    def __init__(
        self, slow_every: int = SLOW_EVERY, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.slow_every = slow_every
        self.clock = clock
        # Runs left until the next full read; 0 makes the next run read everything.
        self._slow_left = 0
        self._slow_reads = SlowReads[InfinibandData]()
        self._base = ""
        self._devices: dict[str, IbDevice] = {}
        self._links: dict[str, tuple[tuple[str | None, str | None], str | None]] = {}

    def collect(self, roots: Roots) -> InfinibandData:
        base = f"{roots.sysfs}/class/infiniband"
        if base != self._base:
            self._base, self._devices, self._slow_left = base, {}, 0
            self._slow_reads.clear()
        names = _listdir(base)
        full = self._slow_left <= 0 or not self._devices.keys() >= set(names)
        self._slow_left = max(self.slow_every, 1) - 1 if full else self._slow_left - 1
        devices: dict[str, IbDevice] = {}
        tally = SkipTally()
        if full:
            at = self.clock()
            for name in names:
                devices[name] = read_device(f"{base}/{name}", self._pci_address, tally)
        else:
            for name in names:
                devices[name] = _refresh_device(f"{base}/{name}", self._devices[name], tally)
        self._devices = devices
        for gone in self._links.keys() - devices.keys():
            del self._links[gone]
        record = InfinibandData(tuple(devices.values()), skipped=tally.freeze())
        if full:
            return replace(record, slow=self._slow_reads.read(record, at))
        return replace(record, slow=self._slow_reads.carried())

    def _pci_address(self, device_dir: str) -> str | None:
        name = device_dir.rpartition("/")[2]
        texts = (_readlink(device_dir), _readlink(f"{device_dir}/device"))
        cached = self._links.get(name)
        if cached is not None and cached[0] == texts and None not in texts:
            return cached[1]
        address = _pci_address(device_dir)
        self._links[name] = (texts, address)
        return address

    def close(self) -> None:
        self._devices, self._links = {}, {}


def _refresh_device(device_dir: str, device: IbDevice, tally: SkipTally) -> IbDevice:
    """``device`` with the values read on every run taken again."""
    ports = tuple(_refresh_port(f"{device_dir}/ports/{p.port}", p, tally) for p in device.ports)
    return IbDevice(
        device.name,
        device.node_guid,
        device.fw_ver,
        device.hca_type,
        device.board_id,
        device.pci_address,
        device.netdevs,
        device.hw_counters,
        ports,
    )


def _refresh_port(port_dir: str, port: IbPort, tally: SkipTally) -> IbPort:
    """``port`` with its traffic counters read again."""
    fresh: dict[str, int | None] = {}
    fd = _open_dir(port_dir)
    try:
        counters_dir = f"{port_dir}/counters"
        for counter in port.counters:
            name = counter.name
            if name in TRAFFIC_COUNTERS:
                data = (
                    None if fd is None else _read_bytes_at(fd, f"counters/{name}", tally, port_dir)
                )
                fresh[name] = (
                    None if data is None else _counter_value(data, counters_dir, name, tally)
                )
    finally:
        if fd is not None:
            os.close(fd)
    # counter_bits over the values a full read would have: the carried ones and these.
    extended = any(c.name in _EXTENDED_ONLY for c in port.counters) or any(
        (fresh.get(n) or 0) >= 1 << 32 for n in DATA_COUNTERS
    )
    data_bits = 64 if extended else 32
    counters: list[Counter] = []
    for counter in port.counters:
        name = counter.name
        if name not in fresh:
            counters.append(counter)  # not traffic: its width does not depend on values
        elif (value := fresh[name]) is not None:  # None: gone or no PMA, absent
            counters.append(Counter(name, value, _FIXED_BITS.get(name, data_bits)))
    xmit = fresh.get("port_xmit_data")
    rcv = fresh.get("port_rcv_data")
    return IbPort(
        port.device,
        port.port,
        port.state,
        port.phys_state,
        port.rate,
        port.link_layer,
        tuple(counters),
        port.hw_counters,
        port.hw_counters_lifespan_ms,
        None if xmit is None else xmit * 4,
        None if rcv is None else rcv * 4,
    )


def make_source() -> Source:
    return InfinibandSource()


SPEC = SourceSpec(
    name="infiniband",
    default_interval=1.0,
    help="InfiniBand/RoCE ports and counters from /sys/class/infiniband",
    build=lambda inputs: make_source(),
    rates=lambda derived: derived.ib_rates,
    metric_area="nodescope_exporters.network_metrics",
    sim_parts=frozenset({"infiniband"}),
)


__all__ = [
    "COUNTER_NAME_RE",
    "DATA_COUNTERS",
    "ERROR_COUNTERS",
    "ERROR_COUNTER_BITS",
    "EXTENDED_ONLY_COUNTERS",
    "HW_GAUGE_PREFIXES",
    "LANE_GBPS",
    "MAX_COUNTER_FILES",
    "NAME",
    "PHYS_STATE_LINK_UP",
    "PORT_STATES",
    "PORT_STATE_ACTIVE",
    "SKIP_ATTRIBUTE_UNPARSABLE",
    "SKIP_COUNTER_NAME",
    "SKIP_COUNTER_OVER_LIMIT",
    "SKIP_COUNTER_UNPARSABLE",
    "SKIP_FILE_REFUSED",
    "SLOW_EVERY",
    "TRAFFIC_COUNTERS",
    "Counter",
    "CounterRate",
    "IbDevice",
    "IbPort",
    "InfinibandData",
    "InfinibandRates",
    "InfinibandSource",
    "LinkRate",
    "PortRates",
    "PortState",
    "counter_bits",
    "hw_counter_is_gauge",
    "make_source",
    "parse_attribute",
    "parse_counter",
    "parse_link_layer",
    "parse_node_guid",
    "parse_phys_state",
    "parse_rate",
    "parse_state",
    "pci_address_from_path",
    "port_rates",
    "read_device",
    "read_infiniband",
    "read_port",
    "slow_pair",
]
