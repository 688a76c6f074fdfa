"""Containers making and deleting links cannot grow the link series nor push a NIC out.

The ``link_events`` source follows a real network namespace this test makes (and deletes, also
on failure) while hundreds of veth pairs are made and deleted in it, as a container runtime
does: the links it reports stay bounded by the links that exist, a removed link is forgotten
one flap window after its removal, a long-lived link (a ``bridge`` made before the churn:
the namespace cannot hold a real NIC) stays followed throughout, and a link made after the
churn is followed, not counted as untracked. Physical links (no software link kind, as
hardware NICs report) take the place of virtual ones when the table is full: a namespace
cannot hold one, so that part is driven with the events the monitor would deliver.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest

from nodescope.roots import Roots
from nodescope.sources.link_events import (
    MAX_LINKS,
    FlapCounter,
    LinkEvent,
    LinkEventsData,
    LinkEventsSource,
)

pytestmark = pytest.mark.integration

#: veth pairs made and deleted: 600 names, over twice what the source follows.
PAIRS = 300
BATCH = 25
WINDOW = 1.0


def _ip(*args: str, stdin: str | None = None) -> str:
    result = subprocess.run(
        ["ip", *args], check=True, capture_output=True, timeout=60, input=stdin, text=True
    )
    return result.stdout


@pytest.fixture
def namespace() -> Iterator[str]:
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces and veth links")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's ip")
    name = f"nschurn-{uuid.uuid4().hex[:8]}"
    try:
        _ip("netns", "add", name)
        _ip("-n", name, "link", "add", "keep0", "type", "bridge")
        _ip("-n", name, "link", "set", "keep0", "up")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def _existing(namespace: str) -> set[str]:
    out = _ip("-n", namespace, "-o", "link", "show")
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def _churn(namespace: str, first: int, count: int) -> None:
    lines = []
    for i in range(first, first + count):
        lines += [f"link add c{i}a type veth peer name c{i}b", f"link set c{i}a up"]
    lines += [f"link del c{i}a" for i in range(first, first + count)]
    _ip("-n", namespace, "-batch", "-", stdin="\n".join(lines) + "\n")


def _settle(source: LinkEventsSource) -> LinkEventsData:
    """Collect until the monitor has delivered what the kernel sent (two quiet runs)."""
    data = source.collect(Roots())
    for _ in range(100):
        time.sleep(0.05)
        again = source.collect(Roots())
        if again == data:
            return again
        data = again
    return data


def test_veth_churn_leaves_no_series_and_keeps_long_lived_links(namespace: str) -> None:
    source = LinkEventsSource(netns=namespace, include_virtual=True, window_seconds=WINDOW)
    try:
        first = _settle(source)
        assert first.monitor is True and first.link("keep0") is not None
        peak = 0
        for start in range(0, PAIRS, BATCH):
            _churn(namespace, start, BATCH)
            data = source.collect(Roots())
            peak = max(peak, len(data.links))
            assert data.link("keep0") is not None, "a long-lived link was pushed out by churn"
            assert len(data.links) <= MAX_LINKS
        time.sleep(WINDOW + 0.2)
        after = _settle(source)
        names = {link.interface for link in after.links}
        # Removed links are forgotten one window after their removal: only links that exist.
        assert names <= _existing(namespace), names - _existing(namespace)
        assert "keep0" in names
        assert peak <= MAX_LINKS

        # A link made after the churn is followed, not counted as untracked.
        untracked = after.untracked
        _ip("-n", namespace, "link", "add", "late0", "type", "bridge")
        _ip("-n", namespace, "link", "set", "late0", "up")
        deadline = time.monotonic() + 5.0
        while (late := source.collect(Roots())).link("late0") is None:
            assert time.monotonic() < deadline, f"late0 never followed: {late.untracked}"
            time.sleep(0.05)
        assert late.untracked == untracked
    finally:
        source.close()


def test_a_physical_link_takes_the_place_of_a_virtual_one_when_full() -> None:
    counter = FlapCounter(window_seconds=WINDOW, max_links=8)
    for i in range(8):
        counter.observe(LinkEvent(f"veth{i}", "netdev", "up", 1.0, physical=False))
    counter.observe(LinkEvent("veth-extra", "netdev", "up", 2.0, physical=False))
    counter.observe(LinkEvent("ens1f0", "netdev", "up", 2.0, physical=True))
    counter.observe(LinkEvent("mlx5_0/1", "infiniband", "up", 2.0))
    data = counter.snapshot(3.0, True)
    names = {link.interface for link in data.links}
    assert len(names) == 8
    assert {"ens1f0", "mlx5_0/1"} <= names and "veth-extra" not in names
    # The virtual links followed longest made the room; the extra veth is counted.
    assert "veth0" not in names and "veth1" not in names
    assert data.untracked == 1
    # A physical link is never pushed out by a virtual one, whatever comes next.
    for i in range(20):
        counter.observe(LinkEvent(f"vx{i}", "netdev", "up", 4.0, physical=False))
    names = {link.interface for link in counter.snapshot(5.0, True).links}
    assert {"ens1f0", "mlx5_0/1"} <= names


def test_a_removed_link_counts_for_one_window_then_is_forgotten() -> None:
    counter = FlapCounter(window_seconds=10.0)
    counter.observe(LinkEvent("ens2", "netdev", "up", 0.0))
    counter.observe(LinkEvent("ens2", "netdev", "down", 1.0))
    counter.observe(LinkEvent("ens2", "netdev", "removed", 2.0))
    held = counter.snapshot(5.0, True).link("ens2")
    assert held is not None and (held.state, held.down_total, held.recent) == ("removed", 1, 1)
    assert counter.snapshot(12.5, True).link("ens2") is None
