"""The records of the ``netdev`` source: network interfaces with their state and counters,
and the per-second figures of two dumps.

``sources/netlink.py`` reads them over rtnetlink (``RTM_GETLINK``). Operational states are
RFC 2863's in lower case, as ``/sys/class/net/<if>/operstate`` prints them; the counters are
``struct rtnl_link_stats64``'s, or the 32-bit ``IFLA_STATS`` ones that wrap at 2^32 when the
kernel sent no 64-bit block (``LinkStats.bits`` says which).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from nodescope.model.counters import counter_rate
from nodescope.model.skips import NOTHING_SKIPPED, Skipped
from nodescope.model.source_key import SourceKey
from nodescope.options import Range, option

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

#: Interfaces exported at most, the lowest ifindexes first (the machine's own interfaces are
#: made at boot, before the veth or tap of any container or VM started since), so that the
#: ``interface`` label stays bounded whatever is started on the node.
MAX_LINKS = 256


#: An ``ip netns`` name: a file directly in ``/run/netns``.
_NETNS_NAME = re.compile(r"[A-Za-z0-9_.-]{1,255}")


def _netns(value: Any) -> str | None:
    """Empty (the daemon's own namespace) or a name ``ip netns`` could have made: one path
    component, never ``.`` or ``..``, so it names a file in ``/run/netns`` and nothing else."""
    if value == "" or (_NETNS_NAME.fullmatch(value) and value not in (".", "..")):
        return None
    return "must be empty or a name in /run/netns (letters, digits, '_', '.', '-')"


def netns_option() -> Any:
    """The ``netns`` key of both netlink sources (a field of its own in each class)."""
    return option(
        "",
        "network namespace to read, by the name `ip netns` gives it (a file in /run/netns);"
        " empty: the daemon's own. Entering another takes setns(2) with CAP_SYS_ADMIN, which the"
        " shipped unit does not allow (CapabilityBoundingSet=, RestrictNamespaces=yes): there"
        " the source reports down with the error",
        _netns,
    )


@dataclass(frozen=True, slots=True)
class NetdevOptions:
    """How the ``netdev`` source reads: the keys of ``[sources.netdev]`` beyond the common
    ones, declared here once. ``netns``: the network namespace, by the name ``ip netns`` gives
    it (a file in ``/run/netns``; empty: the daemon's own); ``max_links``: the most interfaces
    one read keeps."""

    netns: str = netns_option()
    max_links: int = option(
        MAX_LINKS,
        "interfaces one read keeps, the lowest ifindexes first (the rest are counted as skipped,"
        " reason link_over_limit), so that containers' veths cannot grow the series without"
        " bound",
        Range(1, 65536, integer=True),
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


#: The ``netdev`` source's records: the network interfaces of the namespace it reads.
NETDEV = SourceKey("netdev", NetdevData)
