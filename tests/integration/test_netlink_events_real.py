"""The link_events source against real kernel link events: a veth pair in a network namespace
this test creates (and deletes, also on failure), set down and up; the rtnetlink monitor
counts the transitions, the flap window fills and the link_flapping finding appears."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from nodescope.detectors import hotplug
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.roots import Roots
from nodescope.sources.link_events import LinkEventsData, LinkEventsSource, LinkTransitions

pytestmark = pytest.mark.integration


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@dataclass(frozen=True)
class Namespace:
    name: str
    a: str
    b: str


@pytest.fixture
def veth() -> Iterator[Namespace]:
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces and veth links")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's ip")
    tag = uuid.uuid4().hex[:8]
    ns = Namespace(f"nsle-{tag}", f"le{tag}a", f"le{tag}b")
    try:
        _ip("netns", "add", ns.name)
        _ip("-n", ns.name, "link", "add", ns.a, "type", "veth", "peer", "name", ns.b)
        _ip("-n", ns.name, "link", "set", ns.b, "up")
        _ip("-n", ns.name, "link", "set", ns.a, "up")
        yield ns
    finally:
        # Deleting the namespace destroys both ends of the pair.
        subprocess.run(["ip", "netns", "del", ns.name], capture_output=True, timeout=10)


def _until(
    source: LinkEventsSource, check: Callable[[LinkEventsData], bool], timeout: float = 5.0
) -> LinkEventsData:
    deadline = time.monotonic() + timeout
    while True:
        data = source.collect(Roots())
        if check(data):
            return data
        if time.monotonic() > deadline:
            raise AssertionError(f"condition never held; last: {data}")
        time.sleep(0.02)


def _link(data: LinkEventsData, name: str) -> LinkTransitions:
    link = data.link(name)
    assert link is not None, f"{name} not in {data}"
    return link


def test_down_up_and_flapping(veth: Namespace) -> None:
    source = LinkEventsSource(netns=veth.name, include_virtual=True, window_seconds=60.0)
    try:
        first = _until(source, lambda d: _link(d, veth.a).state == "up")
        # The starting states are no transitions.
        assert (_link(first, veth.a).up_total, _link(first, veth.a).down_total) == (0, 0)
        assert first.monitor is True

        _ip("-n", veth.name, "link", "set", veth.a, "down")
        down = _until(source, lambda d: _link(d, veth.a).down_total == 1)
        assert _link(down, veth.a).state == "down"
        # The peer loses its carrier: down too, without anyone touching it.
        down = _until(source, lambda d: _link(d, veth.b).down_total == 1)
        assert _link(down, veth.b).state == "down"
        assert hotplug.flapping(_snapshot(down), 4.0) == []

        _ip("-n", veth.name, "link", "set", veth.a, "up")
        up = _until(source, lambda d: _link(d, veth.a).up_total == 1)
        assert _link(up, veth.a).state == "up"

        for _ in range(2):
            _ip("-n", veth.name, "link", "set", veth.a, "down")
            _ip("-n", veth.name, "link", "set", veth.a, "up")
        flapped = _until(source, lambda d: _link(d, veth.a).up_total == 3)
        link = _link(flapped, veth.a)
        assert (link.down_total, link.up_total, link.recent, link.state) == (3, 3, 6, "up")

        findings = hotplug.flapping(_snapshot(flapped), 4.0)
        assert {f.subjects["interface"] for f in findings} >= {veth.a}
        finding = next(f for f in findings if f.subjects["interface"] == veth.a)
        assert finding.kind == hotplug.FLAPPING
        assert finding.evidence["value"] == 6
        assert f"link {veth.a} flapping: 6 up/down transitions" in finding.message

        _ip("-n", veth.name, "link", "del", veth.a)
        gone = _until(source, lambda d: _link(d, veth.a).state == "removed")
        assert _link(gone, veth.a).down_total >= 3
    finally:
        source.close()
    assert source._monitor is None


def test_virtual_links_left_out_by_default(veth: Namespace) -> None:
    source = LinkEventsSource(netns=veth.name)
    try:
        data = source.collect(Roots())
        _ip("-n", veth.name, "link", "set", veth.a, "down")
        time.sleep(0.2)
        data = source.collect(Roots())
        assert data.monitor is True
        assert data.link(veth.a) is None and data.link("lo") is None
    finally:
        source.close()


def test_unknown_namespace_leaves_the_source_without_monitor() -> None:
    source = LinkEventsSource(netns=f"nsle-missing-{uuid.uuid4().hex[:8]}")
    try:
        data = source.collect(Roots())
        assert data.monitor is False and data.links == ()
    finally:
        source.close()


def _snapshot(data: LinkEventsData) -> Snapshot:
    return Snapshot(1, 1.0, 1.0, {"link_events": SourceSample("link_events", 1.0, 0.0, data)})
