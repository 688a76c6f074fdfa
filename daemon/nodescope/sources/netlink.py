"""Network interfaces: state and counters over rtnetlink.

Reads ``RTM_GETLINK`` dumps on an ``AF_NETLINK`` socket kept open between runs (the messages
decoded by :mod:`nodescope.sources.rtnetlink`): per interface the ifindex and flags
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
sysfs mount shows the interfaces of the namespace that mounted it. The records and their
rates are declared in :mod:`nodescope.model.netdev`.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from nodescope.errors import ParseError
from nodescope.model.netdev import (
    MAX_LINKS,
    NETDEV,
    OPERSTATES,
    OPTIONAL_STATS,
    REQUIRED_STATS,
    LinkRates,
    LinkStats,
    NetdevData,
    NetdevOptions,
    NetdevRates,
    NetLink,
    link_rates,
)
from nodescope.model.skips import SkipTally
from nodescope.roots import Roots
from nodescope.sources import rtnetlink as rtnl
from nodescope.sources.base import Source
from nodescope.sources.infiniband import pci_address_from_path
from nodescope.sources.spec import SourceSpec

NAME = NETDEV.name
IFF_UP = 0x1


class LinkMessage(Protocol):
    """What :func:`parse_links` needs of a message: a ``get`` that answers both header fields
    (``index``, ``flags``, ``event``) and attributes (``IFLA_*``), as the dicts of
    :func:`nodescope.sources.rtnetlink.decode_link` and pyroute2's ``nlmsg`` do."""

    def get(self, key: Any, default: Any = None) -> Any: ...


#: Reason a link message was skipped (nodescope_source_records_skipped_total{reason}): one
#: without a usable name, index, state or statistics.
SKIP_LINK_UNPARSABLE = "link_unparsable"
#: Reason a link was left out: past :data:`MAX_LINKS`.
SKIP_LINK_OVER_LIMIT = "link_over_limit"


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


_CLONE_NEWNET = 0x40000000
#: ``RTMGRP_LINK`` (``include/uapi/linux/rtnetlink.h``): the multicast group of link changes.
RTMGRP_LINK = 1
#: One datagram of a dump; the kernel fills its dump datagrams to at most 32 KiB.
RECEIVE_BYTES = 1 << 16
#: Times a dump the kernel marks as interrupted (links changed while it was sent) is asked again.
DUMP_ATTEMPTS = 3
#: Seconds a dump may wait for the kernel's next datagram.
DUMP_TIMEOUT = 2.0


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def open_link_socket(
    netns: str | None, groups: int = RTMGRP_LINK, netns_dir: str = "/run/netns"
) -> socket.socket:
    """An rtnetlink socket bound to the multicast ``groups`` (0: none, for dumps), in the
    network namespace ``netns`` (a name under ``netns_dir``, as ``ip netns`` makes them) or the
    daemon's own.

    A socket belongs to the namespace it was created in; the switch happens on a helper
    thread (``setns`` changes only the calling thread) that ends right after."""

    def make() -> socket.socket:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
        try:
            sock.bind((0, groups))
        except OSError:
            sock.close()
            raise
        return sock

    if netns is None:
        return make()
    result: list[socket.socket | BaseException] = []

    def in_namespace() -> None:
        try:
            fd = os.open(os.path.join(netns_dir, netns), os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(fd)
            finally:
                os.close(fd)
            result.append(make())
        except BaseException as exc:
            result.append(exc)

    helper = threading.Thread(target=in_namespace, name="nodescope-setns")
    helper.start()
    helper.join()
    outcome = result[0]
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def kernel_datagram(sock: socket.socket) -> bytes | None:
    """The next datagram on ``sock``; ``None`` for one that did not come from the kernel (port
    id 0): another process may address our socket's port, and only the kernel speaks for links."""
    data, _ancillary, flags, address = sock.recvmsg(RECEIVE_BYTES)
    if flags & socket.MSG_TRUNC:
        raise OSError(f"rtnetlink datagram longer than {RECEIVE_BYTES} bytes")
    return data if address[0] == 0 else None


def dump_links(
    sock: socket.socket, sequence: int, source: str, tally: SkipTally
) -> list[dict[str, Any]]:
    """Every ``RTM_NEWLINK`` message of one ``RTM_GETLINK`` dump on ``sock``, decoded; one that
    does not decode is left out and counted in ``tally``. Raises :class:`OSError` for an error
    the kernel answers, a datagram that does not frame, or a dump that takes longer than
    ``DUMP_TIMEOUT`` (the socket's own timeout bounds each wait)."""
    deadline = time.monotonic() + DUMP_TIMEOUT
    for _attempt in range(DUMP_ATTEMPTS):
        sock.send(rtnl.dump_request(sequence))
        messages: list[dict[str, Any]] = []
        interrupted = False
        done = False
        while not done:
            if time.monotonic() > deadline:
                raise TimeoutError(f"RTM_GETLINK dump unfinished after {DUMP_TIMEOUT} s")
            data = kernel_datagram(sock)
            if data is None:
                continue
            try:
                for kind, flags, seq, payload in rtnl.frames(data, source):
                    if seq != sequence:
                        continue  # an answer to an earlier, abandoned dump
                    interrupted |= bool(flags & rtnl.NLM_F_DUMP_INTR)
                    if kind == rtnl.NLMSG_DONE:
                        done = True
                        break
                    if kind == rtnl.NLMSG_ERROR:
                        errno = rtnl.error_code(payload, source)
                        raise OSError(errno, f"RTM_GETLINK: {os.strerror(errno)}")
                    if kind != rtnl.RTM_NEWLINK:
                        continue
                    try:
                        messages.append(rtnl.decode_link(kind, payload, source))
                    except ParseError as exc:
                        tally.skip(SKIP_LINK_UNPARSABLE, str(exc))
            except ParseError as exc:
                raise OSError(str(exc)) from exc
        if not interrupted:
            return messages
        sequence += 1
    return messages


class NetdevSource:
    """Keeps one rtnetlink socket open between runs; a failed dump closes it so the next
    run opens a fresh one.

    An interface's PCI function is resolved once per interface, by name and ifindex: the
    device under a network interface does not change while the interface exists (a renamed
    one is looked up again under its new name, a re-created one has a new ifindex), and
    resolving it costs a ``stat`` per path component. Only the interfaces of the last dump
    are kept."""

    name = NAME

    def __init__(self, netns: str | None = None, max_links: int = MAX_LINKS) -> None:
        self.netns = netns
        self.max_links = max_links
        self._sock: socket.socket | None = None
        self._sequence = 0
        self._pci: dict[tuple[str, int], str | None] = {}
        self._sysfs: Path | None = None

    def _open(self) -> socket.socket:
        if self._sock is None:
            sock = open_link_socket(self.netns, groups=0)
            sock.settimeout(DUMP_TIMEOUT)
            self._sock = sock
        return self._sock

    def collect(self, roots: Roots) -> NetdevData:
        sock = self._open()
        source = f"rtnetlink (netns {self.netns})" if self.netns else "rtnetlink"
        tally = SkipTally()
        # Sequence numbers tell this dump's answers from a late one of a dump given up on.
        self._sequence = (self._sequence + DUMP_ATTEMPTS) & 0xFFFFFFFF
        try:
            messages = dump_links(sock, self._sequence, source, tally)
        except Exception:
            self.close()
            raise
        links = parse_links(messages, source, tally)
        if len(links) > self.max_links:
            for dropped in links[self.max_links :]:
                tally.skip(SKIP_LINK_OVER_LIMIT, f"{dropped.name} (ifindex {dropped.ifindex})")
            links = links[: self.max_links]
        if self.netns is None:
            known, self._pci = (self._pci if roots.sysfs == self._sysfs else {}), {}
            self._sysfs = roots.sysfs
            resolved: list[NetLink] = []
            for link in links:
                key = (link.name, link.ifindex)
                pci = known[key] if key in known else interface_pci_address(roots, link.name)
                self._pci[key] = pci
                resolved.append(link if pci is None else replace(link, pci_address=pci))
            links = tuple(resolved)
        return NetdevData(links, tally.freeze())

    def close(self) -> None:
        sock, self._sock = self._sock, None
        self._pci = {}
        if sock is not None:
            sock.close()


def make_source(options: NetdevOptions | None = None) -> Source:
    options = NetdevOptions() if options is None else options
    return NetdevSource(options.netns or None, options.max_links)


SPEC = SourceSpec(
    name="netdev",
    default_interval=1.0,
    help="network interface state and counters over rtnetlink",
    build=lambda inputs: make_source(inputs.netdev),
    settings=NetdevOptions,
    rates=lambda derived: derived.netdev_rates,
    metric_area="nodescope_exporters.network_metrics",
    sim_parts=None,
    reads="rtnetlink",
)


__all__ = [
    "IFF_UP",
    "MAX_LINKS",
    "NAME",
    "OPERSTATES",
    "OPTIONAL_STATS",
    "REQUIRED_STATS",
    "SKIP_LINK_OVER_LIMIT",
    "SKIP_LINK_UNPARSABLE",
    "LinkMessage",
    "LinkRates",
    "LinkStats",
    "NetLink",
    "NetdevData",
    "NetdevRates",
    "NetdevSource",
    "dump_links",
    "interface_pci_address",
    "kernel_datagram",
    "link_rates",
    "make_source",
    "open_link_socket",
    "parse_link",
    "parse_links",
]
