"""The rtnetlink decoder against pyroute2 as the oracle (messages pyroute2 encodes, decoded by
both and parsed alike), its framing of hostile datagrams (any bytes: a ParseError or records,
never another exception, nothing read past a length), and the dump's conversation with the
kernel (sequence numbers, interrupted dumps, errors, datagrams from other senders) on a
scripted socket. The real kernel's dumps are compared in
tests/integration/test_netlink_real.py."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import struct
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg
from pyroute2.netlink.rtnl.marshal import MarshalRtnl

from nodescope.errors import ParseError
from nodescope.model.netdev import OPTIONAL_STATS, REQUIRED_STATS, LinkStats
from nodescope.model.skips import SkipTally
from nodescope.sources import netlink as nl
from nodescope.sources import rtnetlink as rtnl


def encoded(index: int, flags: int = 0, event: int = rtnl.RTM_NEWLINK, **attrs: Any) -> bytes:
    """An RTM_NEWLINK (or DELLINK) message as the kernel sends it, encoded by pyroute2."""
    msg = ifinfmsg()
    msg["header"]["type"] = event
    msg["index"] = index
    msg["flags"] = flags
    msg["attrs"] = [(name, value) for name, value in attrs.items()]
    msg.encode()
    return bytes(msg.data)


def ours(data: bytes) -> list[dict[str, Any]]:
    return [rtnl.decode_link(kind, payload) for kind, _f, _s, payload in rtnl.frames(data)]


ETH = {
    "IFLA_IFNAME": "ens1f0np0",
    "IFLA_MTU": 9000,
    "IFLA_OPERSTATE": "UP",
    "IFLA_CARRIER": 1,
    "IFLA_STATS64": {"rx_bytes": 2**40 + 5, "tx_bytes": 7, "rx_packets": 3, "tx_dropped": 9},
}


def test_decodes_what_pyroute2_decodes() -> None:
    data = encoded(4, 0x1043, **ETH) + encoded(
        9,
        0x1003,
        IFLA_IFNAME="veth7",
        IFLA_OPERSTATE="LOWERLAYERDOWN",
        IFLA_CARRIER=0,
        IFLA_LINKINFO={"attrs": [("IFLA_INFO_KIND", "veth")]},
        IFLA_STATS={"rx_bytes": 2**32 - 1, "collisions": 4},
    )
    mine = ours(data)
    theirs = MarshalRtnl().parse(data)
    assert len(mine) == len(list(theirs)) == 2
    theirs = MarshalRtnl().parse(data)
    for a, b in zip(mine, theirs, strict=True):
        assert nl.parse_link(a) == nl.parse_link(b)
    eth, veth = (nl.parse_link(m) for m in mine)
    assert (eth.name, eth.ifindex, eth.mtu, eth.operstate, eth.carrier) == (
        "ens1f0np0",
        4,
        9000,
        "up",
        True,
    )
    assert eth.stats is not None and eth.stats.bits == 64
    assert (eth.stats.rx_bytes, eth.stats.tx_dropped) == (2**40 + 5, 9)
    assert (veth.kind, veth.operstate, veth.carrier, veth.admin_up) == (
        "veth",
        "lowerlayerdown",
        False,
        True,
    )
    assert veth.stats is not None and veth.stats.bits == 32
    assert (veth.stats.rx_bytes, veth.stats.collisions) == (2**32 - 1, 4)
    assert mine[0]["event"] == "RTM_NEWLINK"


def test_dellink_and_unknown_attributes() -> None:
    data = encoded(5, 0, event=rtnl.RTM_DELLINK, IFLA_IFNAME="ib0", IFLA_TXQLEN=1000)
    (message,) = ours(data)
    assert message["event"] == "RTM_DELLINK"
    assert message["IFLA_IFNAME"] == "ib0"
    assert "IFLA_TXQLEN" not in message


def _frame(kind: int, payload: bytes, seq: int = 1, flags: int = 0, length: int = 0) -> bytes:
    size = length or rtnl.NLMSGHDR.size + len(payload)
    raw = rtnl.NLMSGHDR.pack(size, kind, flags, seq, 0) + payload
    return raw + b"\0" * (-len(raw) % 4)


@pytest.mark.parametrize("length", [0, 8, 15, 10_000])
def test_a_frame_that_does_not_fit_ends_the_datagram(length: int) -> None:
    good = encoded(2, **ETH)
    bad = rtnl.NLMSGHDR.pack(length, rtnl.RTM_NEWLINK, 0, 1, 0) + b"\0" * 16
    got: list[int] = []
    with pytest.raises(ParseError, match="message length"):
        for kind, _f, _s, _p in rtnl.frames(good + bad + good):
            got.append(kind)
    assert got == [rtnl.RTM_NEWLINK]


@pytest.mark.parametrize(
    ("attribute", "fragment"),
    [
        (struct.pack("=HH", 3, 3), "attribute 3 of length 3"),
        (struct.pack("=HH", 200, 3) + b"eth0", "attribute 3 of length 200"),
        (struct.pack("=HH", 5, 4) + b"\1", "IFLA_MTU: 1 bytes"),
        (struct.pack("=HH", 4, 16), "IFLA_OPERSTATE: empty"),
        (struct.pack("=HH", 8, 3) + b"\xff\xfe\0\0", "not UTF-8"),
        (struct.pack("=HH", 12, 23) + b"\0" * 8, "too short"),
    ],
)
def test_bad_attributes_are_a_parse_error(attribute: bytes, fragment: str) -> None:
    payload = rtnl.IFINFOMSG.pack(0, 0, 3, 0, 0) + attribute
    with pytest.raises(ParseError, match=fragment):
        rtnl.decode_link(rtnl.RTM_NEWLINK, payload)
    with pytest.raises(ParseError, match="ifinfomsg of 8 bytes"):
        rtnl.decode_link(rtnl.RTM_NEWLINK, b"\0" * 8)


def test_newer_kernels_longer_stats_and_nested_flag() -> None:
    stats = struct.pack("=26Q", *range(1, 27))  # two fields more than this decoder names
    nested = struct.pack("=HH", 9, rtnl.IFLA_INFO_KIND) + b"bond\0" + b"\0" * 3
    payload = (
        rtnl.IFINFOMSG.pack(0, 1, 6, 1, 0)
        + struct.pack("=HH", 4 + len(stats), rtnl.IFLA_STATS64)
        + stats
        + struct.pack("=HH", 4 + len(nested), rtnl.IFLA_LINKINFO | 0x8000)  # NLA_F_NESTED
        + nested
        + struct.pack("=HH", 8, rtnl.IFLA_IFNAME)
        + b"bd0\0"
    )
    message = rtnl.decode_link(rtnl.RTM_NEWLINK, payload)
    assert message["IFLA_STATS64"]["rx_otherhost_dropped"] == 25
    assert message["IFLA_LINKINFO"] == {"IFLA_INFO_KIND": "bond"}
    link = nl.parse_link(message)
    assert (link.name, link.kind) == ("bd0", "bond")
    assert link.stats is not None and link.stats.rx_packets == 1


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=600))
def test_any_bytes_frame_and_decode_or_fail_cleanly(data: bytes) -> None:
    with contextlib.suppress(ParseError):
        for kind, _f, _s, payload in rtnl.frames(data):
            with contextlib.suppress(ParseError):
                nl.parse_link(rtnl.decode_link(kind, payload))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 400), st.binary(min_size=1, max_size=4))
def test_a_valid_message_cut_or_damaged_anywhere(cut: int, junk: bytes) -> None:
    good = encoded(4, 0x1043, IFLA_LINKINFO={"attrs": [("IFLA_INFO_KIND", "vlan")]}, **ETH)
    at = min(cut, len(good))
    for data in (good[:at], good[:at] + junk + good[at + len(junk) :]):
        with contextlib.suppress(ParseError):
            for kind, _f, _s, payload in rtnl.frames(data):
                nl.parse_link(rtnl.decode_link(kind, payload))


# ------------------------------------------------------------------------------------------
# The dump's conversation, on a scripted socket


class ScriptedSocket:
    """Answers each dump request with the datagrams a function makes of its sequence number;
    ``(bytes, port)`` pairs, port 0 being the kernel."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.requests: list[int] = []
        self._queue: Iterator[tuple[bytes, int]] = iter(())

    def send(self, data: bytes) -> int:
        _length, kind, flags, seq, _port = rtnl.NLMSGHDR.unpack_from(data)
        assert kind == rtnl.RTM_GETLINK and flags & 0x300 == 0x300
        self.requests.append(seq)
        self._queue = iter(self.answer(seq, len(self.requests)))
        return len(data)

    def recvmsg(self, size: int) -> tuple[bytes, list[Any], int, tuple[int, int]]:
        try:
            data, port = next(self._queue)
        except StopIteration:
            raise TimeoutError("timed out") from None
        return data, [], 0, (port, 0)


def _link_frame(index: int, seq: int, name: str, flags: int = rtnl.NLM_F_MULTI) -> bytes:
    payload = rtnl.IFINFOMSG.pack(0, 0, index, 1, 0) + struct.pack("=HH", 8, 3) + name.encode()
    return _frame(rtnl.RTM_NEWLINK, payload + b"\0" * (4 - len(name)), seq, flags)


def test_dump_keeps_its_own_answers_from_the_kernel_only() -> None:
    def answer(seq: int, _n: int) -> list[tuple[bytes, int]]:
        return [
            (_link_frame(1, seq - 1, "old"), 0),  # a late answer to an abandoned dump
            (_link_frame(2, seq, "fake"), 4242),  # another process addressing our port
            (_link_frame(3, seq, "eth0") + _link_frame(4, seq, "eth1"), 0),
            (_frame(rtnl.NLMSG_DONE, b"\0" * 4, seq), 0),
        ]

    sock = ScriptedSocket(answer)
    tally = SkipTally()
    messages = nl.dump_links(sock, 10, "test", tally)  # type: ignore[arg-type]
    assert [m["IFLA_IFNAME"] for m in messages] == ["eth0", "eth1"]
    assert sock.requests == [10]
    assert not tally


def test_dump_asked_again_when_interrupted_and_bad_messages_counted() -> None:
    def answer(seq: int, n: int) -> list[tuple[bytes, int]]:
        flags = rtnl.NLM_F_MULTI | (rtnl.NLM_F_DUMP_INTR if n == 1 else 0)
        broken = _frame(rtnl.RTM_NEWLINK, b"\0" * 4, seq, rtnl.NLM_F_MULTI)
        return [
            (_link_frame(3, seq, "eth0", flags) + broken, 0),
            (_frame(rtnl.NLMSG_DONE, b"\0" * 4, seq, flags), 0),
        ]

    sock = ScriptedSocket(answer)
    tally = SkipTally()
    messages = nl.dump_links(sock, 20, "test", tally)  # type: ignore[arg-type]
    assert sock.requests == [20, 21]
    assert [m["IFLA_IFNAME"] for m in messages] == ["eth0"]
    # Counted once per dump read: the interrupted one and the one kept.
    assert tally.freeze().counts == {nl.SKIP_LINK_UNPARSABLE: 2}


def test_dump_errors() -> None:
    def refused(seq: int, _n: int) -> list[tuple[bytes, int]]:
        return [(_frame(rtnl.NLMSG_ERROR, struct.pack("=i", -errno.EPERM) + b"\0" * 16, seq), 0)]

    with pytest.raises(PermissionError):
        nl.dump_links(ScriptedSocket(refused), 1, "test", SkipTally())  # type: ignore[arg-type]

    def unframed(seq: int, _n: int) -> list[tuple[bytes, int]]:
        return [(rtnl.NLMSGHDR.pack(999, rtnl.RTM_NEWLINK, 0, seq, 0), 0)]

    with pytest.raises(OSError, match="message length 999"):
        nl.dump_links(ScriptedSocket(unframed), 1, "test", SkipTally())  # type: ignore[arg-type]

    def silent(seq: int, _n: int) -> list[tuple[bytes, int]]:
        return [(_link_frame(3, seq, "eth0"), 0)]

    with pytest.raises(TimeoutError):
        nl.dump_links(ScriptedSocket(silent), 1, "test", SkipTally())  # type: ignore[arg-type]


def test_request_is_what_pyroute2_would_send() -> None:
    request = rtnl.dump_request(77)
    msg = ifinfmsg(request)
    msg.decode()
    assert msg["header"]["type"] == rtnl.RTM_GETLINK
    assert msg["header"]["sequence_number"] == 77
    assert msg["header"]["flags"] == 0x301  # NLM_F_REQUEST | NLM_F_DUMP
    assert msg["header"]["length"] == len(request) == 32


def test_pci_function_resolved_once_per_interface(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The PCI function behind an interface is resolved when the interface is first seen, again
    under a new name or a new ifindex (renamed, re-created), and not on the runs between; only
    the interfaces of the last dump are remembered."""
    from nodescope.roots import Roots

    links: list[tuple[int, str]] = [(1, "lo"), (4, "eth0")]

    def answer(seq: int, _n: int) -> list[tuple[bytes, int]]:
        frames = b"".join(_link_frame(i, seq, name) for i, name in links)
        return [(frames + _frame(rtnl.NLMSG_DONE, b"\0" * 4, seq), 0)]

    resolved: list[str] = []

    def lookup(roots: Roots, name: str) -> str | None:
        resolved.append(name)
        return None if name == "lo" else f"0000:00:0{len(resolved)}.0"

    monkeypatch.setattr(nl, "interface_pci_address", lookup)
    source = nl.NetdevSource()
    source._sock = ScriptedSocket(answer)  # type: ignore[assignment]
    roots = Roots.under(tmp_path)

    def addresses() -> dict[str, str | None]:
        return {x.name: x.pci_address for x in source.collect(roots).links}

    first = addresses()
    assert first == {"lo": None, "eth0": "0000:00:02.0"}
    for _ in range(3):
        assert addresses() == first
    assert resolved == ["lo", "eth0"]

    links[1] = (4, "ens3")  # renamed: the same ifindex under another name
    assert addresses()["ens3"] == "0000:00:03.0"
    links[1] = (9, "ens3")  # deleted and made again: a new ifindex
    assert addresses()["ens3"] == "0000:00:04.0"
    assert resolved == ["lo", "eth0", "ens3", "ens3"]
    assert set(source._pci) == {("lo", 1), ("ens3", 9)}

    other = Roots.under(tmp_path / "elsewhere")  # another sysfs: everything resolved again
    source.collect(other)
    assert resolved[-2:] == ["lo", "ens3"]


def test_links_past_the_limit_left_out_and_counted(tmp_path: Any) -> None:
    from nodescope.roots import Roots

    def answer(seq: int, _n: int) -> list[tuple[bytes, int]]:
        # Ten interfaces, in no particular order, in two datagrams.
        frames = [_link_frame(i, seq, f"e{i:03d}") for i in (7, 3, 9, 1, 5, 2, 8, 4, 10, 6)]
        return [
            (b"".join(frames[:5]), 0),
            (b"".join(frames[5:]) + _frame(rtnl.NLMSG_DONE, b"\0" * 4, seq), 0),
        ]

    source = nl.NetdevSource(netns="test", max_links=4)  # a netns: no sysfs lookups
    source._sock = ScriptedSocket(answer)  # type: ignore[assignment]
    data = source.collect(Roots.under(tmp_path))
    assert [x.ifindex for x in data.links] == [1, 2, 3, 4]
    assert data.skipped.counts == {nl.SKIP_LINK_OVER_LIMIT: 6}
    assert data.skipped.examples[nl.SKIP_LINK_OVER_LIMIT] == "e005 (ifindex 5)"


def test_the_models_statistics_are_the_kernels_first_fields_in_order() -> None:
    """The decoder names the numbers of a statistics block by the kernel's layout, the model
    keeps a selection of them: the selection must be the layout's first fields, in its order
    (pyroute2's description of the same struct as the oracle of the layout)."""
    kernel = [name for name, _ in ifinfmsg.ifstats64.fields]
    assert list(rtnl.LINK_STATS_FIELDS[: len(kernel)]) == kernel
    assert [name for name, _ in ifinfmsg.ifstats.fields] == kernel
    selected = (*REQUIRED_STATS, *OPTIONAL_STATS)
    assert rtnl.LINK_STATS_FIELDS[: len(selected)] == selected
    assert {f.name for f in dataclasses.fields(LinkStats)} >= set(selected)
