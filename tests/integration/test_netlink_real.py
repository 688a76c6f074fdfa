"""The netdev source against real kernel links: two network namespaces joined by a veth pair,
UDP traffic between them, and a link set down; the kernel's dump decoded as pyroute2 decodes
it (the oracle) and counted as iproute2's ``ip -s`` counts it. Everything stays inside the two
namespaces this test creates (and deletes, also on failure); addresses are from TEST-NET-1."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from pyroute2.netlink.rtnl.marshal import MarshalRtnl

from nodescope.model.netdev import NetdevOptions
from nodescope.roots import Roots
from nodescope.sources import netlink as nl
from nodescope.sources import rtnetlink as rtnl

pytestmark = pytest.mark.integration

PAYLOAD = 1000
DATAGRAMS = 50
ADDR_A = "192.0.2.1"
ADDR_B = "192.0.2.2"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@dataclass(frozen=True)
class Pair:
    ns_a: str
    ns_b: str
    if_a: str
    if_b: str


@pytest.fixture
def veth_pair() -> Iterator[Pair]:
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces and veth links")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's ip")
    tag = uuid.uuid4().hex[:8]
    pair = Pair(f"nsc-{tag}-a", f"nsc-{tag}-b", f"nsc{tag}a", f"nsc{tag}b")
    try:
        _ip("netns", "add", pair.ns_a)
        _ip("netns", "add", pair.ns_b)
        _ip("link", "add", pair.if_a, "type", "veth", "peer", "name", pair.if_b)
        _ip("link", "set", pair.if_a, "netns", pair.ns_a)
        _ip("link", "set", pair.if_b, "netns", pair.ns_b)
        for ns, ifname, addr in ((pair.ns_a, pair.if_a, ADDR_A), (pair.ns_b, pair.if_b, ADDR_B)):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", ifname)
            _ip("-n", ns, "link", "set", ifname, "up")
        yield pair
    finally:
        # Deleting a namespace destroys its veth end, and with it the peer.
        for ns in (pair.ns_a, pair.ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", pair.if_a], capture_output=True, timeout=10)


def _send_udp(ns: str, to: str) -> None:
    """DATAGRAMS datagrams of PAYLOAD bytes from inside namespace ``ns``."""
    code = (
        "import socket\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        f"for _ in range({DATAGRAMS}): s.sendto(b'x' * {PAYLOAD}, ({to!r}, 9))\n"
    )
    subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", code],
        check=True,
        capture_output=True,
        timeout=30,
    )


def _stats(data: nl.NetdevData, name: str) -> nl.LinkStats:
    link = data.link(name)
    assert link is not None, f"{name} not in {[x.name for x in data.links]}"
    assert link.stats is not None
    return link.stats


@pytest.mark.alone  # a rate over half a second
def test_veth_counters_and_link_down(veth_pair: Pair) -> None:
    roots = Roots()
    side_a = nl.make_source(NetdevOptions(netns=veth_pair.ns_a))
    side_b = nl.make_source(NetdevOptions(netns=veth_pair.ns_b))
    try:
        a0 = side_a.collect(roots)
        b0 = side_b.collect(roots)
        assert isinstance(a0, nl.NetdevData) and isinstance(b0, nl.NetdevData)
        # Only the namespace's own links: its loopback and its end of the pair.
        assert {x.name for x in a0.links} == {"lo", veth_pair.if_a}
        link_a = a0.link(veth_pair.if_a)
        assert link_a is not None
        assert link_a.kind == "veth"
        assert link_a.admin_up is True
        assert link_a.mtu == 1500
        assert link_a.pci_address is None

        _send_udp(veth_pair.ns_a, ADDR_B)

        a1 = side_a.collect(roots)
        b1 = side_b.collect(roots)
        sent = _stats(a1, veth_pair.if_a)
        before = _stats(a0, veth_pair.if_a)
        received = _stats(b1, veth_pair.if_b)
        received_before = _stats(b0, veth_pair.if_b)
        assert sent.tx_packets - before.tx_packets >= DATAGRAMS
        assert sent.tx_bytes - before.tx_bytes >= DATAGRAMS * PAYLOAD
        assert received.rx_packets - received_before.rx_packets >= DATAGRAMS
        assert received.rx_bytes - received_before.rx_bytes >= DATAGRAMS * PAYLOAD

        rates = nl.link_rates(a0, a1, 0.5).link(veth_pair.if_a)
        assert rates is not None and rates.tx_bytes_per_second is not None
        assert rates.tx_bytes_per_second >= DATAGRAMS * PAYLOAD / 0.5

        _ip("-n", veth_pair.ns_a, "link", "set", veth_pair.if_a, "down")
        down = side_a.collect(roots).link(veth_pair.if_a)
        peer = side_b.collect(roots).link(veth_pair.if_b)
        assert down is not None and peer is not None
        assert down.operstate == "down"
        assert down.admin_up is False
        # The peer is still administratively up but has lost its carrier, which the kernel
        # reports as operstate down (veth is not stacked, so not lowerlayerdown).
        assert peer.admin_up is True
        assert peer.carrier is False
        assert peer.operstate == "down"
    finally:
        side_a.close()
        side_b.close()


def test_socket_kept_between_runs_and_closed(veth_pair: Pair) -> None:
    source = nl.NetdevSource(netns=veth_pair.ns_a)
    try:
        source.collect(Roots())
        socket = source._sock
        assert socket is not None
        source.collect(Roots())
        assert source._sock is socket
    finally:
        source.close()
    assert source._sock is None
    # Reopens after close.
    try:
        assert source.collect(Roots()).link("lo") is not None
    finally:
        source.close()


def test_reads_the_daemons_namespace() -> None:
    source = nl.make_source()
    try:
        data = source.collect(Roots())
    finally:
        source.close()
    assert isinstance(data, nl.NetdevData)
    lo = data.link("lo")
    assert lo is not None
    assert lo.ifindex == 1
    assert lo.kind is None
    assert lo.pci_address is None
    assert lo.stats is not None and lo.stats.bits == 64


def _raw_dump(netns: str) -> list[bytes]:
    """The datagrams of one RTM_GETLINK dump in ``netns``, as the kernel sent them."""
    sock = nl.open_link_socket(netns, groups=0)
    sock.settimeout(5.0)
    datagrams: list[bytes] = []
    try:
        sock.send(rtnl.dump_request(5))
        while True:
            data = nl.kernel_datagram(sock)
            assert data is not None
            datagrams.append(data)
            if any(kind == rtnl.NLMSG_DONE for kind, *_ in rtnl.frames(data)):
                return datagrams
    finally:
        sock.close()


def _iproute2_counters(netns: str, ifname: str) -> dict[str, int]:
    out = subprocess.run(
        ["ip", "-n", netns, "-s", "-j", "link", "show", ifname],
        check=True,
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout
    (link,) = json.loads(out)
    stats = link["stats64"]
    return {
        f"{side}_{name}": stats[side][name]
        for side in ("rx", "tx")
        for name in ("bytes", "packets", "errors", "dropped")
    }


def test_kernel_dump_decoded_as_pyroute2_and_counted_as_iproute2(veth_pair: Pair) -> None:
    """The kernel's own dump of a namespace with traffic: every message our decoder reads
    parses to the same link as pyroute2's decoding of the same bytes, and each counter lies
    between iproute2's readings taken before and after ours."""
    _send_udp(veth_pair.ns_a, ADDR_B)
    before = _iproute2_counters(veth_pair.ns_a, veth_pair.if_a)
    datagrams = _raw_dump(veth_pair.ns_a)
    after = _iproute2_counters(veth_pair.ns_a, veth_pair.if_a)

    mine = [
        nl.parse_link(rtnl.decode_link(kind, payload))
        for data in datagrams
        for kind, _flags, _seq, payload in rtnl.frames(data)
        if kind == rtnl.RTM_NEWLINK
    ]
    theirs = [
        nl.parse_link(message)
        for data in datagrams
        for message in MarshalRtnl().parse(data)
        if message.get("event") == "RTM_NEWLINK"
    ]
    assert mine == theirs
    assert {x.name for x in mine} == {"lo", veth_pair.if_a}

    (link,) = (x for x in mine if x.name == veth_pair.if_a)
    assert link.kind == "veth" and link.stats is not None and link.stats.bits == 64
    assert link.stats.tx_packets >= DATAGRAMS
    for name, low in before.items():
        assert low <= getattr(link.stats, name) <= after[name], name


def test_daemon_does_not_import_pyroute2() -> None:
    """The netdev and link_events sources read rtnetlink without pyroute2, whose import
    costs about 22 MiB of RSS in a process that runs on every node."""
    code = (
        "import sys\n"
        "from nodescope.roots import Roots\n"
        "from nodescope.sources import netlink, link_events\n"
        "s = netlink.make_source(); d = s.collect(Roots()); s.close()\n"
        "e = link_events.LinkEventsSource(); e.collect(Roots()); e.close()\n"
        "assert d.link('lo') is not None, d\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pyroute2', 'asyncio')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60
    ).stdout
    assert out.strip() == "[]"


def test_links_past_the_limit_left_out_and_counted(veth_pair: Pair) -> None:
    """The kernel's dump of a namespace with its loopback and one veth end, under a limit of
    one interface: the lower ifindex (loopback) is kept, the other counted."""
    source = nl.NetdevSource(netns=veth_pair.ns_a, max_links=1)
    try:
        data = source.collect(Roots())
    finally:
        source.close()
    assert [x.name for x in data.links] == ["lo"]
    assert data.skipped.counts == {nl.SKIP_LINK_OVER_LIMIT: 1}
    assert veth_pair.if_a in data.skipped.examples[nl.SKIP_LINK_OVER_LIMIT]
