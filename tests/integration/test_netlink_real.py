"""The netdev source against real kernel links: two network namespaces joined by a veth pair,
UDP traffic between them, and a link set down. Everything stays inside the two namespaces
this test creates (and deletes, also on failure); addresses are from TEST-NET-1."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from nodescope.roots import Roots
from nodescope.sources import netlink as nl

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


def test_veth_counters_and_link_down(veth_pair: Pair) -> None:
    roots = Roots()
    side_a = nl.make_source(netns=veth_pair.ns_a)
    side_b = nl.make_source(netns=veth_pair.ns_b)
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
        socket = source._ipr
        assert socket is not None
        source.collect(Roots())
        assert source._ipr is socket
    finally:
        source.close()
    assert source._ipr is None
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
