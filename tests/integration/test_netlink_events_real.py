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
from pathlib import Path

import pytest

from nodescope import assembly
from nodescope.collect import Collector
from nodescope.detectors import hotplug
from nodescope.model.link_events import LINK_EVENTS
from nodescope.model.netdev import NETDEV
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.roots import Roots
from nodescope.sources.link_events import LinkEventsData, LinkEventsSource, LinkTransitions
from nodescope.sources.netlink import SKIP_LINK_OVER_LIMIT
from nodescope.sources.registry import SOURCES

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


def test_the_config_file_points_both_netlink_sources_at_a_namespace(
    veth: Namespace, tmp_path: Path
) -> None:
    """A configuration file's ``netns``, ``max_links`` and ``include_virtual``, through the
    collector the daemon builds: the two sources read the namespace's three links (loopback
    and the veth pair), not this machine's, and follow its veth's transitions."""
    others = "".join(
        f"[sources.{name}]\nenabled = false\n"
        for name in SOURCES
        if name not in ("netdev", "link_events")
    )
    path = tmp_path / "nodescope.toml"
    path.write_text(
        f'{others}[sources.netdev]\nnetns = "{veth.name}"\nmax_links = 2\n'
        f'[sources.link_events]\nnetns = "{veth.name}"\ninclude_virtual = true\n'
    )
    collector = Collector.from_config(assembly.load(path))
    try:
        first = collector.run_cycle()
        netdev = first.latest(NETDEV)
        assert netdev is not None
        # lo is ifindex 1 and the pair's ends were made after it: the limit keeps lo and the
        # first end, and counts the other.
        names = [link.name for link in netdev.links]
        assert len(names) == 2 and names[0] == "lo"
        assert netdev.skipped.counts == {SKIP_LINK_OVER_LIMIT: 1}
        assert set(names) < {"lo", veth.a, veth.b}
        _ip("-n", veth.name, "link", "set", veth.a, "down")
        deadline = time.monotonic() + 5.0
        while True:
            events = collector.run_cycle(force=True).latest(LINK_EVENTS)
            assert events is not None and events.monitor is True
            link = events.link(veth.a)
            if link is not None and link.down_total == 1:
                break
            assert time.monotonic() < deadline, f"no transition of {veth.a}: {events}"
            time.sleep(0.05)
    finally:
        collector.close()
