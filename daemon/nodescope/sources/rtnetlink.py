"""rtnetlink link messages on a plain ``AF_NETLINK`` socket: the dump request, the framing of
what the kernel sends, and the decoding of ``RTM_NEWLINK``/``RTM_DELLINK`` (pure).

The formats are the kernel's UAPI: ``struct nlmsghdr`` (``include/uapi/linux/netlink.h``:
length, type, flags, sequence, port id; every message 4-byte aligned), ``struct ifinfomsg``
and the ``IFLA_*`` attributes (``include/uapi/linux/rtnetlink.h``, ``if_link.h``: each a
``struct rtattr`` of length and type, then its value, 4-byte aligned), ``struct
rtnl_link_stats64`` and ``struct rtnl_link_stats``. Only what :mod:`nodescope.sources.netlink`
reads is decoded; every other attribute is stepped over by its length.

A decoded message is a plain dict answering ``get`` with the keys :func:`parse_link
<nodescope.sources.netlink.parse_link>` reads — ``event``, ``index``, ``flags`` and the
attribute names — so the same parser reads it and, in the tests, pyroute2's decoding of the
same bytes (the oracle). The daemon does not import pyroute2: importing any part of it imports
the whole library (about 300 modules, asyncio and ssl among them: 22.7 MiB of RSS measured on
pyroute2 0.9.7) for the one message type read here.

Every length comes from the sender and is checked against what is there: a frame that does not
fit its datagram ends the datagram (nothing after it can be framed), an attribute that does not
fit its message makes that message a :class:`ParseError`.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

from nodescope.errors import ParseError

#: ``struct nlmsghdr``: length, type, flags, sequence number, sender's port id.
NLMSGHDR = struct.Struct("=IHHII")
#: ``struct ifinfomsg``: family, padding, device type, ifindex, flags, change mask.
IFINFOMSG = struct.Struct("=BxHiII")
#: ``struct rtattr``: length (header included), type.
RTATTR = struct.Struct("=HH")
#: ``struct nlmsgerr``'s first field: the negative errno, 0 for an acknowledgement.
NLMSGERR_ERRNO = struct.Struct("=i")
U32 = struct.Struct("=I")

NLMSG_NOOP = 1
NLMSG_ERROR = 2
NLMSG_DONE = 3
RTM_NEWLINK = 16
RTM_DELLINK = 17
RTM_GETLINK = 18
EVENTS = {RTM_NEWLINK: "RTM_NEWLINK", RTM_DELLINK: "RTM_DELLINK"}

NLM_F_REQUEST = 0x1
NLM_F_MULTI = 0x2
#: The dump changed while it was being sent (``NLM_F_DUMP_INTR``); read it again.
NLM_F_DUMP_INTR = 0x10
NLM_F_DUMP = 0x300

IFLA_IFNAME = 3
IFLA_MTU = 4
IFLA_STATS = 7
IFLA_OPERSTATE = 16
IFLA_LINKINFO = 18
IFLA_STATS64 = 23
IFLA_CARRIER = 33
IFLA_INFO_KIND = 1
#: The attribute type without ``NLA_F_NESTED`` and ``NLA_F_NET_BYTEORDER``.
NLA_TYPE_MASK = 0x3FFF

#: The fields of ``struct rtnl_link_stats64`` (u64) and ``struct rtnl_link_stats`` (u32), in
#: their order; kernels append fields (``rx_nohandler``, ``rx_otherhost_dropped``), so a block
#: is read as far as it goes and must hold at least the first eight.
LINK_STATS_FIELDS: tuple[str, ...] = (
    "rx_packets", "tx_packets", "rx_bytes", "tx_bytes", "rx_errors", "tx_errors",
    "rx_dropped", "tx_dropped", "multicast", "collisions", "rx_length_errors",
    "rx_over_errors", "rx_crc_errors", "rx_frame_errors", "rx_fifo_errors",
    "rx_missed_errors", "tx_aborted_errors", "tx_carrier_errors", "tx_fifo_errors",
    "tx_heartbeat_errors", "tx_window_errors", "rx_compressed", "tx_compressed",
    "rx_nohandler", "rx_otherhost_dropped",
)  # fmt: skip
_STATS_MIN_FIELDS = 8


def _align(length: int) -> int:
    return (length + 3) & ~3


def dump_request(sequence: int) -> bytes:
    """``RTM_GETLINK`` with ``NLM_F_DUMP``: every link of the socket's network namespace."""
    body = IFINFOMSG.pack(0, 0, 0, 0, 0)
    header = NLMSGHDR.pack(
        NLMSGHDR.size + len(body), RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, sequence, 0
    )
    return header + body


def frames(data: bytes, source: str = "rtnetlink") -> Iterator[tuple[int, int, int, bytes]]:
    """``(type, flags, sequence, payload)`` of each message of one datagram. A header whose
    length is shorter than a header or runs past the datagram raises :class:`ParseError` after
    the messages before it: the rest cannot be framed."""
    offset = 0
    end = len(data)
    position = 0
    while end - offset >= NLMSGHDR.size:
        position += 1
        length, kind, flags, sequence, _port = NLMSGHDR.unpack_from(data, offset)
        if length < NLMSGHDR.size or length > end - offset:
            raise ParseError(source, f"message length {length} at byte {offset} of {end}", position)
        yield kind, flags, sequence, data[offset + NLMSGHDR.size : offset + length]
        offset += _align(length)


def error_code(payload: bytes, source: str = "rtnetlink") -> int:
    """The errno of an ``NLMSG_ERROR`` message (positive; 0 is an acknowledgement)."""
    if len(payload) < NLMSGERR_ERRNO.size:
        raise ParseError(source, f"NLMSG_ERROR of {len(payload)} bytes")
    return -int(NLMSGERR_ERRNO.unpack_from(payload)[0])


def _attribute_spans(payload: bytes, offset: int, source: str) -> Iterator[tuple[int, int, int]]:
    """``(type, start, end)`` of each attribute from ``offset`` on: where its value lies in
    ``payload``, so a caller copies out only the values it reads (a kernel sends about forty
    attributes per link)."""
    end = len(payload)
    unpack = RTATTR.unpack_from
    while end - offset >= RTATTR.size:
        length, kind = unpack(payload, offset)
        if length < RTATTR.size or length > end - offset:
            raise ParseError(source, f"attribute {kind} of length {length} at byte {offset}")
        yield kind & NLA_TYPE_MASK, offset + RTATTR.size, offset + length
        offset += _align(length)


def _string(value: bytes, what: str, source: str) -> str:
    text, _, _ = value.partition(b"\0")
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError:
        raise ParseError(source, f"{what}: not UTF-8: {text[:32]!r}") from None


def _u32(value: bytes, what: str, source: str) -> int:
    if len(value) < 4:
        raise ParseError(source, f"{what}: {len(value)} bytes, expected 4")
    return int(U32.unpack_from(value)[0])


def _u8(value: bytes, what: str, source: str) -> int:
    if not value:
        raise ParseError(source, f"{what}: empty")
    return value[0]


def _stats(value: bytes, width: int, what: str, source: str) -> dict[str, int]:
    count = min(len(value) // width, len(LINK_STATS_FIELDS))
    if count < _STATS_MIN_FIELDS:
        raise ParseError(source, f"{what}: {len(value)} bytes, too short for its counters")
    numbers = struct.unpack_from(f"={count}{'Q' if width == 8 else 'I'}", value)
    return dict(zip(LINK_STATS_FIELDS, numbers, strict=False))


def _linkinfo(value: bytes, source: str) -> dict[str, Any]:
    info: dict[str, Any] = {}
    for kind, start, end in _attribute_spans(value, 0, source):
        if kind == IFLA_INFO_KIND:
            info["IFLA_INFO_KIND"] = _string(value[start:end], "IFLA_INFO_KIND", source)
    return info


#: The attributes :func:`decode_link` reads; the others are stepped over without being copied.
_WANTED = frozenset(
    (IFLA_IFNAME, IFLA_MTU, IFLA_OPERSTATE, IFLA_CARRIER, IFLA_STATS64, IFLA_STATS, IFLA_LINKINFO)
)


def decode_link(kind: int, payload: bytes, source: str = "rtnetlink") -> dict[str, Any]:
    """One ``RTM_NEWLINK``/``RTM_DELLINK`` message (``kind``) from its payload."""
    if len(payload) < IFINFOMSG.size:
        raise ParseError(source, f"ifinfomsg of {len(payload)} bytes")
    _family, _type, index, flags, _change = IFINFOMSG.unpack_from(payload)
    message: dict[str, Any] = {"event": EVENTS.get(kind), "index": index, "flags": flags}
    stats32: bytes | None = None
    for attribute, start, end in _attribute_spans(payload, IFINFOMSG.size, source):
        if attribute not in _WANTED:
            continue
        value = payload[start:end]
        if attribute == IFLA_STATS64:
            message["IFLA_STATS64"] = _stats(value, 8, "IFLA_STATS64", source)
        elif attribute == IFLA_IFNAME:
            message["IFLA_IFNAME"] = _string(value, "IFLA_IFNAME", source)
        elif attribute == IFLA_MTU:
            message["IFLA_MTU"] = _u32(value, "IFLA_MTU", source)
        elif attribute == IFLA_OPERSTATE:
            message["IFLA_OPERSTATE"] = _u8(value, "IFLA_OPERSTATE", source)
        elif attribute == IFLA_CARRIER:
            message["IFLA_CARRIER"] = _u8(value, "IFLA_CARRIER", source)
        elif attribute == IFLA_STATS:
            stats32 = value
        elif attribute == IFLA_LINKINFO:
            message["IFLA_LINKINFO"] = _linkinfo(value, source)
    # The kernel sends both blocks; the 32-bit one is read only where the 64-bit one is missing.
    if stats32 is not None and "IFLA_STATS64" not in message:
        message["IFLA_STATS"] = _stats(stats32, 4, "IFLA_STATS", source)
    return message


__all__ = [
    "EVENTS",
    "LINK_STATS_FIELDS",
    "NLMSG_DONE",
    "NLMSG_ERROR",
    "NLMSG_NOOP",
    "NLM_F_DUMP_INTR",
    "NLM_F_MULTI",
    "RTM_DELLINK",
    "RTM_GETLINK",
    "RTM_NEWLINK",
    "decode_link",
    "dump_request",
    "error_code",
    "frames",
]
