"""Network interfaces: state and counters over rtnetlink, with pyroute2.

Reads ``RTM_GETLINK`` dumps (``IPRoute().get_links()``): per interface the ifindex and flags
of ``struct ifinfomsg`` and the attributes ``IFLA_IFNAME``, ``IFLA_OPERSTATE``,
``IFLA_CARRIER``, ``IFLA_MTU``, ``IFLA_LINKINFO``/``IFLA_INFO_KIND`` and ``IFLA_STATS64``
(``struct rtnl_link_stats64``; ``IFLA_STATS``, 32-bit, when the 64-bit block is missing).
The formats are defined in ``include/uapi/linux/if_link.h`` and ``include/uapi/linux/rtnetlink.h``;
operational states are RFC 2863's (``Documentation/networking/operstates.rst``), given here in
lower case as ``/sys/class/net/<if>/operstate`` prints them.

Netlink sees the network namespace of the socket, not a filesystem root: the source reads the
namespace the daemon runs in, or the named one (``ip netns`` name) given to
:func:`make_source`. The PCI function of an interface comes from the realpath of
``<sysfs>/class/net/<if>/device``, looked up only for the daemon's own namespace because a
sysfs mount shows the interfaces of the namespace that mounted it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from nodescope.errors import ParseError
from nodescope.model.counters import counter_rate
from nodescope.model.skips import NOTHING_SKIPPED, Skipped, SkipTally
from nodescope.roots import Roots
from nodescope.sources.base import Source
from nodescope.sources.infiniband import pci_address_from_path

NAME = "netdev"
IFF_UP = 0x1

#: RFC 2863 operational states by their IF_OPER_* number.
OPERSTATES: tuple[str, ...] = (
    "unknown",
    "notpresent",
    "down",
    "lowerlayerdown",
    "testing",
    "dormant",
    "up",
)

#: ``rtnl_link_stats64`` fields every kernel sends; a link without them is malformed.
REQUIRED_STATS: tuple[str, ...] = (
    "rx_packets",
    "tx_packets",
    "rx_bytes",
    "tx_bytes",
    "rx_errors",
    "tx_errors",
    "rx_dropped",
    "tx_dropped",
)
#: The detailed error fields, kept when present.
OPTIONAL_STATS: tuple[str, ...] = (
    "multicast",
    "collisions",
    "rx_length_errors",
    "rx_over_errors",
    "rx_crc_errors",
    "rx_frame_errors",
    "rx_fifo_errors",
    "rx_missed_errors",
    "tx_aborted_errors",
    "tx_carrier_errors",
    "tx_fifo_errors",
    "tx_heartbeat_errors",
    "tx_window_errors",
)


class LinkMessage(Protocol):
    """What :func:`parse_links` needs of a message: pyroute2's ``nlmsg.get``, which answers
    both header fields (``index``, ``flags``) and attributes (``IFLA_*``)."""

    def get(self, key: Any, default: Any = None) -> Any: ...


@dataclass(frozen=True, slots=True)
class LinkStats:
    rx_packets: int
    tx_packets: int
    rx_bytes: int
    tx_bytes: int
    rx_errors: int
    tx_errors: int
    rx_dropped: int
    tx_dropped: int
    multicast: int | None = None
    collisions: int | None = None
    rx_length_errors: int | None = None
    rx_over_errors: int | None = None
    rx_crc_errors: int | None = None
    rx_frame_errors: int | None = None
    rx_fifo_errors: int | None = None
    rx_missed_errors: int | None = None
    tx_aborted_errors: int | None = None
    tx_carrier_errors: int | None = None
    tx_fifo_errors: int | None = None
    tx_heartbeat_errors: int | None = None
    tx_window_errors: int | None = None
    #: 64 for ``IFLA_STATS64``, 32 for ``IFLA_STATS`` (whose fields wrap at 2^32).
    bits: int = 64


@dataclass(frozen=True, slots=True)
class NetLink:
    name: str
    ifindex: int
    #: RFC 2863 state in lower case (``up``, ``down``, ``lowerlayerdown``…), ``None`` if unsent.
    operstate: str | None
    #: ``IFF_UP``: administratively up.
    admin_up: bool | None
    carrier: bool | None
    mtu: int | None
    #: ``IFLA_INFO_KIND`` (``veth``, ``bond``, ``vlan``…); ``None`` for plain devices.
    kind: str | None
    stats: LinkStats | None
    pci_address: str | None = None


#: Reason a link message was skipped (nodescope_source_records_skipped_total{reason}): one
#: without a usable name, index, state or statistics.
SKIP_LINK_UNPARSABLE = "link_unparsable"


@dataclass(frozen=True, slots=True)
class NetdevData:
    links: tuple[NetLink, ...]
    #: link messages of this dump left out as malformed
    skipped: Skipped = field(default=NOTHING_SKIPPED, compare=False)

    def link(self, name: str) -> NetLink | None:
        for link in self.links:
            if link.name == name:
                return link
        return None


# --------------------------------------------------------------------------------------------
# Parser (pure)


def _uint(value: Any, what: str, source: str, position: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ParseError(
            source, f"{what}: expected a non-negative integer, got {value!r}", position
        )
    return value


def _optional_uint(value: Any, what: str, source: str, position: int) -> int | None:
    return None if value is None else _uint(value, what, source, position)


def _operstate(value: Any, source: str, position: int) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        state = value.lower()
        if state in OPERSTATES:
            return state
    elif isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(OPERSTATES):
        return OPERSTATES[value]
    raise ParseError(source, f"IFLA_OPERSTATE: unknown state {value!r}", position)


def _stats(block: Any, bits: int, source: str, position: int) -> LinkStats:
    get = getattr(block, "get", None)
    if not callable(get):
        raise ParseError(source, f"link statistics: not a record: {block!r}", position)
    fields: dict[str, Any] = {"bits": bits}
    for name in REQUIRED_STATS:
        value = get(name)
        if value is None:
            raise ParseError(source, f"link statistics: {name} missing", position)
        fields[name] = _uint(value, name, source, position)
    for name in OPTIONAL_STATS:
        fields[name] = _optional_uint(get(name), name, source, position)
    return LinkStats(**fields)


def _kind(linkinfo: Any, source: str, position: int) -> str | None:
    get = getattr(linkinfo, "get", None)
    if linkinfo is None or not callable(get):
        return None
    kind = get("IFLA_INFO_KIND")
    if kind is None:
        return None
    if not isinstance(kind, str) or not kind.isprintable():
        raise ParseError(source, f"IFLA_INFO_KIND: expected a name, got {kind!r}", position)
    return kind


def parse_link(message: LinkMessage, source: str = "rtnetlink", position: int = 1) -> NetLink:
    """One ``RTM_NEWLINK`` message. ``position`` is its 1-based place in the dump, reported as
    the line of a :class:`ParseError`."""
    name = message.get("IFLA_IFNAME")
    if not isinstance(name, str) or not name or not name.isprintable() or "/" in name:
        raise ParseError(source, f"IFLA_IFNAME: expected an interface name, got {name!r}", position)
    ifindex = _uint(message.get("index"), f"{name}: ifindex", source, position)
    flags = _optional_uint(message.get("flags"), f"{name}: flags", source, position)
    carrier = _optional_uint(message.get("IFLA_CARRIER"), f"{name}: IFLA_CARRIER", source, position)
    if carrier is not None and carrier > 1:
        raise ParseError(source, f"{name}: IFLA_CARRIER: expected 0 or 1, got {carrier}", position)
    stats64 = message.get("IFLA_STATS64")
    stats32 = message.get("IFLA_STATS") if stats64 is None else None
    if stats64 is not None:
        stats: LinkStats | None = _stats(stats64, 64, source, position)
    elif stats32 is not None:
        stats = _stats(stats32, 32, source, position)
    else:
        stats = None
    return NetLink(
        name=name,
        ifindex=ifindex,
        operstate=_operstate(message.get("IFLA_OPERSTATE"), source, position),
        admin_up=None if flags is None else bool(flags & IFF_UP),
        carrier=None if carrier is None else carrier == 1,
        mtu=_optional_uint(message.get("IFLA_MTU"), f"{name}: IFLA_MTU", source, position),
        kind=_kind(message.get("IFLA_LINKINFO"), source, position),
        stats=stats,
    )


def parse_links(
    messages: Iterable[LinkMessage], source: str = "rtnetlink", tally: SkipTally | None = None
) -> tuple[NetLink, ...]:
    """Every well-formed link of an ``RTM_GETLINK`` dump, sorted by ifindex; a message that
    does not parse is left out and counted in ``tally``, the other links are kept."""
    links: list[NetLink] = []
    for position, message in enumerate(messages, start=1):
        try:
            links.append(parse_link(message, source, position))
        except ParseError as exc:
            if tally is not None:
                tally.skip(SKIP_LINK_UNPARSABLE, str(exc))
    return tuple(sorted(links, key=lambda link: link.ifindex))


# --------------------------------------------------------------------------------------------
# Reader


def interface_pci_address(roots: Roots, name: str) -> str | None:
    """The PCI function of interface ``name`` from ``<sysfs>/class/net/<name>/device``;
    ``None`` for virtual interfaces. The nearest PCI function up the path counts, so a
    virtio-net interface maps to its virtio PCI device."""
    link = roots.sysfs / "class" / "net" / name / "device"
    if not os.path.lexists(link):
        return None
    return pci_address_from_path(os.path.realpath(link))


class NetdevSource:
    """Keeps one rtnetlink socket open between runs; a failed dump closes it so the next
    run opens a fresh one."""

    name = NAME

    def __init__(self, netns: str | None = None) -> None:
        self.netns = netns
        self._ipr: Any = None

    def _open(self) -> Any:
        if self._ipr is None:
            from pyroute2 import IPRoute

            self._ipr = IPRoute(netns=self.netns) if self.netns else IPRoute()
        return self._ipr

    def collect(self, roots: Roots) -> NetdevData:
        ipr = self._open()
        source = f"rtnetlink (netns {self.netns})" if self.netns else "rtnetlink"
        try:
            messages = ipr.get_links()
        except Exception:
            self.close()
            raise
        tally = SkipTally()
        links = parse_links(messages, source, tally)
        if self.netns is None:
            links = tuple(
                replace(x, pci_address=interface_pci_address(roots, x.name)) for x in links
            )
        return NetdevData(links, tally.freeze())

    def close(self) -> None:
        ipr, self._ipr = self._ipr, None
        if ipr is not None:
            ipr.close()


def make_source(netns: str | None = None) -> Source:
    return NetdevSource(netns)


# --------------------------------------------------------------------------------------------
# Rates


@dataclass(frozen=True, slots=True)
class LinkRates:
    name: str
    ifindex: int
    rx_bytes_per_second: float | None
    tx_bytes_per_second: float | None
    rx_packets_per_second: float | None
    tx_packets_per_second: float | None
    rx_errors_per_second: float | None
    tx_errors_per_second: float | None
    rx_dropped_per_second: float | None
    tx_dropped_per_second: float | None


@dataclass(frozen=True, slots=True)
class NetdevRates:
    seconds: float
    links: tuple[LinkRates, ...]

    def link(self, name: str) -> LinkRates | None:
        for link in self.links:
            if link.name == name:
                return link
        return None


def _link_rates(
    prev: LinkStats | None, cur: LinkStats | None, seconds: float
) -> list[float | None]:
    if prev is None or cur is None or prev.bits != cur.bits:
        return [None] * len(REQUIRED_STATS)
    # Order of REQUIRED_STATS: rx/tx packets, bytes, errors, dropped.
    return [
        counter_rate(getattr(prev, n), getattr(cur, n), seconds, cur.bits) for n in REQUIRED_STATS
    ]


def link_rates(prev: NetdevData, cur: NetdevData, seconds: float) -> NetdevRates:
    """Per-second counters of links present in both samples. A link is the same link when
    both its ifindex and its name match: a deleted and recreated interface starts afresh."""
    if seconds <= 0:
        return NetdevRates(seconds, ())
    before = {(link.ifindex, link.name): link for link in prev.links}
    out = []
    for link in cur.links:
        old = before.get((link.ifindex, link.name))
        if old is None:
            continue
        rxp, txp, rxb, txb, rxe, txe, rxd, txd = _link_rates(old.stats, link.stats, seconds)
        out.append(LinkRates(link.name, link.ifindex, rxb, txb, rxp, txp, rxe, txe, rxd, txd))
    return NetdevRates(seconds, tuple(out))
