"""The udev source's monitor against real kernel uevents (``source="kernel"``: no udevd runs
on our machines): a veth pair added and deleted in the daemon's own network namespace, with
names unique to this test, deleted also on failure."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable

import pytest

from nodescope.roots import Roots
from nodescope.sources.base import TopologyGeneration
from nodescope.sources.udev import UdevData, UdevEvent, UdevMonitor, UdevSource

pytestmark = pytest.mark.integration


@pytest.fixture
def names() -> tuple[str, str]:
    if os.geteuid() != 0:
        pytest.skip("needs root to create veth links")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's ip")
    tag = uuid.uuid4().hex[:8]
    return f"ud{tag}a", f"ud{tag}b"


def _veth_add_and_delete(a: str, b: str) -> None:
    try:
        subprocess.run(
            ["ip", "link", "add", a, "type", "veth", "peer", "name", b],
            check=True,
            capture_output=True,
            timeout=10,
        )
    finally:
        # Deleting one end deletes the pair.
        subprocess.run(["ip", "link", "del", a], capture_output=True, timeout=10)


def _until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition never held")
        time.sleep(0.02)


def test_kernel_events_on_veth_add_and_remove(names: tuple[str, str]) -> None:
    a, b = names
    seen: list[UdevEvent] = []
    topology = TopologyGeneration()
    monitor = UdevMonitor(seen.append, source="kernel", subsystems=("net",), topology=topology)
    monitor.start()
    try:
        _veth_add_and_delete(a, b)

        def ours() -> set[tuple[str | None, str]]:
            return {(e.interface, e.action) for e in list(seen) if e.interface in (a, b)}

        expected = {(a, "add"), (b, "add"), (a, "remove"), (b, "remove")}
        _until(lambda: ours() >= expected)
        event = next(e for e in seen if e.interface == a and e.action == "add")
        assert event.subsystem == "net"
        assert event.devpath == f"/devices/virtual/net/{a}"
        assert event.seqnum is not None and event.seqnum > 0
        # Virtual devices are no part of the PCI topology: the generation does not move.
        assert not event.under_pci
        assert topology.value == 0
    finally:
        monitor.stop()


def test_source_counts_events_from_its_monitor(names: tuple[str, str]) -> None:
    a, b = names
    source = UdevSource(monitor="kernel")
    try:
        first = source.collect(Roots())
        assert first.monitor == "kernel"
        before = dict(((s, act), n) for s, act, n in first.events)
        _veth_add_and_delete(a, b)
        data: list[UdevData] = []

        def counted() -> bool:
            data.append(source.collect(Roots()))
            now = {(s, act): n for d in data for s, act, n in d.events}
            return (
                now.get(("net", "add"), 0) - before.get(("net", "add"), 0) >= 2
                and now.get(("net", "remove"), 0) - before.get(("net", "remove"), 0) >= 2
            )

        _until(counted)
        recent = [e for d in data for e in d.recent if e.interface in (a, b)]
        assert {(e.interface, e.action) for e in recent} >= {(a, "add"), (a, "remove")}
        assert data[-1].gpu_removals == () and data[-1].gpus_missing == ()
    finally:
        source.close()
    assert source._monitor is None
