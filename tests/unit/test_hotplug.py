"""Hot-plug and link events: uevent parsing, the udev source's removed-GPU accounting, the
topology refreshed without a restart (the daemon's and ``nodescope topo``'s) when GPU 5 of the
``xid79-fell-off-bus`` scenario falls off the bus, the fell-off-the-bus finding, link flap
counting and its finding, and the event metrics."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.assembly import default_config
from nodescope.detectors import hotplug
from nodescope.detectors.registry import DETECTORS
from nodescope.errors import ParseError
from nodescope.model.finding import Severity
from nodescope.model.jobs import JobView
from nodescope.model.skips import SkipTally
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.model.topology import PCI, DeviceClass, PciDevice, PciRoot, PortRole, Topology
from nodescope.model.udev import UDEV
from nodescope.roots import Roots
from nodescope.sources import link_events, udev
from nodescope.sources.link_events import (
    FlapCounter,
    LinkEvent,
    LinkEventsData,
    LinkEventsSource,
    LinkTransitions,
    ib_port_state,
    parse_link_event,
)
from nodescope.sources.pci import PciSource
from nodescope.sources.udev import (
    GpuRemovals,
    UdevData,
    UdevEvent,
    UdevSource,
    event_from_properties,
    parse_kernel_message,
    parse_uevent,
)
from nodescope_exporters import event_metrics
from tests.unit.exposition_helpers import SampleValues, exposition, sample_values

HOST = Path(__file__).parent.parent / "fixtures" / "hosts" / "kvm-epyc-debian12"
GPU5 = "0000:bb:00.0"

# --- uevents --------------------------------------------------------------------------------


def test_parse_uevent_of_this_host() -> None:
    text = (HOST / "sys/bus/pci/devices/0000:00:01.0/uevent").read_text()
    props = dict(parse_uevent(text))
    assert props["PCI_SLOT_NAME"] == "0000:00:01.0"
    event = event_from_properties({**props, "ACTION": "add", "DEVPATH": "/devices/pci0000:00/"
                                   "0000:00:01.0", "SUBSYSTEM": "pci"})  # fmt: skip
    assert event.pci_slot == "0000:00:01.0" and event.pci_class == 0xFFFF00
    assert event.under_pci and not event.is_gpu


def test_gpu_remove_event() -> None:
    event = event_from_properties(
        {
            "ACTION": "remove",
            "DEVPATH": "/devices/pci0000:b0/0000:b0:01.0/0000:b1:00.0/0000:bb:00.0",
            "SUBSYSTEM": "pci",
            "PCI_CLASS": "30200",
            "PCI_SLOT_NAME": "0000:BB:00.0",
            "SEQNUM": "4711",
        }
    )
    assert event == UdevEvent("remove", "pci", event.devpath, GPU5, 0x030200, None, 4711)
    assert event.is_gpu and event.under_pci


def test_kernel_message_as_the_kernel_sends_it() -> None:
    """lib/kobject_uevent.c: ``ACTION@DEVPATH`` then NUL-separated properties (a veth added on
    this machine)."""
    data = (
        b"add@/devices/virtual/net/udt0b\0ACTION=add\0DEVPATH=/devices/virtual/net/udt0b\0"
        b"SUBSYSTEM=net\0INTERFACE=udt0b\0IFINDEX=53\0SEQNUM=1488\0"
    )
    event = parse_kernel_message(data)
    assert (event.action, event.subsystem, event.interface, event.seqnum) == (
        "add",
        "net",
        "udt0b",
        1488,
    )
    assert not event.under_pci
    # The header stands in for a missing ACTION/DEVPATH.
    short = parse_kernel_message(b"remove@/devices/pci0000:00/0000:00:05.0\0SUBSYSTEM=pci\0")
    assert (short.action, short.devpath) == ("remove", "/devices/pci0000:00/0000:00:05.0")


@pytest.mark.parametrize(
    "props",
    [
        {"DEVPATH": "/x", "SUBSYSTEM": "pci"},
        {"ACTION": "add", "DEVPATH": "x", "SUBSYSTEM": "pci"},
        {"ACTION": "a b", "DEVPATH": "/x", "SUBSYSTEM": "pci"},
        {"ACTION": "add", "DEVPATH": "/x", "SUBSYSTEM": "pci", "PCI_CLASS": "zz"},
        {"ACTION": "add", "DEVPATH": "/x", "SUBSYSTEM": "pci", "PCI_SLOT_NAME": "00:01.0"},
        {"ACTION": "add", "DEVPATH": "/x", "SUBSYSTEM": "pci", "SEQNUM": "-1"},
    ],
)
def test_event_from_properties_rejects(props: dict[str, str]) -> None:
    with pytest.raises(ParseError):
        event_from_properties(props, "ev")


def test_parse_uevent_rejects() -> None:
    with pytest.raises(ParseError) as err:
        parse_uevent("A=1\nno equals\n", "u")
    assert err.value.line == 2
    with pytest.raises(ParseError):
        parse_kernel_message(b"no header\0A=1\0")


# --- the daemon's topology and nodescope topo across a hot-unplug ---------------------------


@pytest.fixture(scope="module")
def xid79() -> dict[str, Any]:
    """``xid79-fell-off-bus`` up to t=22 with this module's detector; per cycle the analysed
    snapshot and, at t=19 and t=21, ``nodescope topo`` of the node's tree."""
    from nodescope.cli import topo
    from nodescope.sim.driver import default_node_factory, replay, temp_dir
    from nodescope.sim.scenario import load_scenario

    scenario = load_scenario("xid79-fell-off-bus")
    scenario = dataclasses.replace(
        scenario, duration_seconds=22.0, expect=dataclasses.replace(scenario.expect, metrics=())
    )
    nodes: list[Any] = []
    snapshots: dict[float, Snapshot] = {}
    topo_text: dict[tuple[float, bool], str] = {}

    def factory(s: Any, root: Path) -> Any:
        node = default_node_factory(s, root)
        nodes.append(node)
        return node

    def seen(t: float, snapshot: Snapshot, body: bytes) -> None:
        snapshots[t] = snapshot
        if t in (19.0, 21.0):
            for as_json in (False, True):
                out = io.StringIO()
                with contextlib.redirect_stdout(out):
                    args = argparse.Namespace(json=as_json)
                    assert topo.show(args, nodes[0].roots, None) == 0
                topo_text[(t, as_json)] = out.getvalue()

    with tempfile.TemporaryDirectory(prefix="nodescope-test-", dir=temp_dir()) as d:
        result = replay(
            scenario,
            Path(d) / "root",
            node_factory=factory,
            detectors=[d for d in DETECTORS if d.name == "hotplug"],
            builders=[],
            on_cycle=seen,
        )
    return {"result": result, "snapshots": snapshots, "topo": topo_text}


def test_topology_follows_the_removal_without_a_restart(xid79: dict[str, Any]) -> None:
    snapshots = xid79["snapshots"]
    before = snapshots[19.0].latest(PCI)
    after = snapshots[21.0].latest(PCI)
    assert before is not None and after is not None
    assert before.get(GPU5) is not None
    assert after.get(GPU5) is None
    assert len(after.devices) < len(before.devices)
    # The other GPUs are still there.
    assert after.get("0000:9a:00.0") is not None or after.get("0000:1b:00.0") is not None
    topo = xid79["topo"]
    gpus = {
        t: {d["bdf"] for d in json.loads(topo[(t, True)])["devices"] if d["kind"] == "gpu"}
        for t in (19.0, 21.0)
    }
    assert len(gpus[19.0]) == 8 and GPU5 in gpus[19.0]
    assert gpus[21.0] == gpus[19.0] - {GPU5}
    # The table has one GPU column fewer.
    assert "GPU7" in topo[(19.0, False)] and "GPU7" not in topo[(21.0, False)]


def test_udev_source_counts_the_removed_gpu(xid79: dict[str, Any]) -> None:
    snapshots = xid79["snapshots"]
    assert snapshots[19.0].latest(UDEV).gpus_missing == ()
    after = snapshots[22.0].latest(UDEV)
    assert after.gpus_missing == (GPU5,)
    assert after.gpu_removals == (GpuRemovals(GPU5, 1),)
    assert after.monitor is None


def test_fell_off_bus_finding(xid79: dict[str, Any]) -> None:
    result, snapshots = xid79["result"], xid79["snapshots"]
    failed = [f"{f.expectation}: {f.reason}" for f in result.findings if not f.passed]
    assert not failed, failed
    assert snapshots[19.0].findings == ()
    keys = set()
    for t in (20.0, 21.0, 22.0):
        [finding] = snapshots[t].findings
        keys.add(finding.key)
        assert finding.kind == hotplug.FELL_OFF_BUS
        assert finding.subjects == {"bdf": GPU5, "gpu": "5"}
        assert finding.evidence["xid79_events"] == 1
        assert finding.evidence["nvml_lost"] == 1
    assert len(keys) == 1  # one identity while it lasts
    assert snapshots[22.0].findings[0].evidence["pci_removed"] == 1
    assert "GPU 5 (0000:bb:00.0) fell off the bus: Xid 79" in snapshots[20.0].findings[0].message
    assert "job 81780 used it" in snapshots[20.0].findings[0].message


def test_pci_source_walks_again_when_marked_stale() -> None:
    source = PciSource()
    roots = Roots.under(HOST)
    source.collect(roots)
    source.collect(roots)
    assert source.walks == 1
    source.topology.advance()  # what the udev source does on a PCI add or remove
    source.collect(roots)
    assert source.walks == 2


def test_udev_source_events_and_listing(tmp_path: Path) -> None:
    devices = tmp_path / "sys" / "bus" / "pci" / "devices"
    for bdf, cls in (("0000:01:00.0", "0x030200"), ("0000:02:00.0", "0x020000")):
        (devices / bdf).mkdir(parents=True)
        (devices / bdf / "class").write_text(f"{cls}\n")
    roots = Roots.under(tmp_path)
    source = UdevSource(monitor=None)
    first = source.collect(roots)
    assert first.gpus_missing == () and first.gpu_removals == ()
    # A remove event of another GPU, delivered by the monitor thread.
    source._enqueue(
        event_from_properties(
            {
                "ACTION": "remove",
                "DEVPATH": "/devices/pci0000:00/0000:03:00.0",
                "SUBSYSTEM": "pci",
                "PCI_CLASS": "30000",
                "PCI_SLOT_NAME": "0000:03:00.0",
            }
        )
    )
    # And the GPU in the listing goes too; the NIC stays.
    (devices / "0000:01:00.0" / "class").unlink()
    (devices / "0000:01:00.0").rmdir()
    second = source.collect(roots)
    assert second.gpus_missing == ("0000:01:00.0", "0000:03:00.0")
    assert second.gpu_removals == (GpuRemovals("0000:01:00.0", 1), GpuRemovals("0000:03:00.0", 1))
    assert second.events == (("pci", "remove", 1),)
    assert [e.pci_slot for e in second.recent] == ["0000:03:00.0"]
    # Back again: no longer missing, the count stays.
    (devices / "0000:01:00.0").mkdir()
    (devices / "0000:01:00.0" / "class").write_text("0x030200\n")
    third = source.collect(roots)
    assert third.gpus_missing == ("0000:03:00.0",)
    assert third.gpu_removals == second.gpu_removals
    source.close()


def test_udev_source_returns_its_last_record_while_nothing_changed(tmp_path: Path) -> None:
    devices = tmp_path / "sys" / "bus" / "pci" / "devices"
    (devices / "0000:01:00.0").mkdir(parents=True)
    (devices / "0000:01:00.0" / "class").write_text("0x030200\n")
    roots = Roots.under(tmp_path)
    source = UdevSource(monitor=None)
    first = source.collect(roots)
    # Nothing happened: the very same record, so what is built from it is reused.
    assert source.collect(roots) is first
    # A device appears: a new record that knows it.
    (devices / "0000:02:00.0").mkdir()
    (devices / "0000:02:00.0" / "class").write_text("0x030200\n")
    second = source.collect(roots)
    assert second is not first
    assert source.collect(roots) is second
    # An event: a new record carrying it, then the next quiet run drops it from `recent`.
    source._enqueue(
        event_from_properties(
            {
                "ACTION": "change",
                "DEVPATH": "/devices/pci0000:00/0000:02:00.0",
                "SUBSYSTEM": "pci",
                "PCI_CLASS": "30200",
                "PCI_SLOT_NAME": "0000:02:00.0",
            }
        )
    )
    third = source.collect(roots)
    assert third.events == (("pci", "change", 1),) and len(third.recent) == 1
    fourth = source.collect(roots)
    assert fourth is not third and fourth.recent == () and fourth.events == third.events
    assert source.collect(roots) is fourth
    # The topology marked stale (another source's hot-plug path): a new record.
    source.topology.advance()
    assert source.collect(roots) is not fourth
    source.close()


def test_udev_refused_or_malformed_class_is_counted_and_read_again(tmp_path: Path) -> None:
    """A hot-plugged function whose ``class`` is a FIFO (never opened for writing) and one
    whose ``class`` is junk: both counted, neither blocks nor takes the source down, and both
    are read again once they are files with a class in them."""
    devices = tmp_path / "sys" / "bus" / "pci" / "devices"
    for bdf in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0"):
        (devices / bdf).mkdir(parents=True)
    (devices / "0000:01:00.0" / "class").write_text("0x030200\n")
    os.mkfifo(devices / "0000:02:00.0" / "class")
    (devices / "0000:03:00.0" / "class").write_text("a GPU, trust me\n")
    roots = Roots.under(tmp_path)
    source = UdevSource(monitor=None)
    first = source.collect(roots)
    assert first.skipped.counts == {udev.SKIP_FILE_REFUSED: 1, udev.SKIP_CLASS_UNPARSABLE: 1}
    assert first.skipped.examples[udev.SKIP_FILE_REFUSED].endswith("0000:02:00.0/class")
    # Skipped again on the next run (a record that skipped is never handed out twice).
    second = source.collect(roots)
    assert second is not first and second.skipped == first.skipped
    (devices / "0000:02:00.0" / "class").unlink()
    (devices / "0000:02:00.0" / "class").write_text("0x030200\n")
    (devices / "0000:03:00.0" / "class").write_text("0x030000\n")
    third = source.collect(roots)
    assert not third.skipped
    # All three are GPUs now: their going is noticed.
    for bdf in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0"):
        (devices / bdf / "class").unlink()
        (devices / bdf).rmdir()
    gone = source.collect(roots)
    assert gone.gpus_missing == ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0")
    source.close()


class _FakeUdevMonitor:
    """pyudev's ``Monitor.poll`` handing out the given devices, then stopping the thread."""

    def __init__(self, devices: list[Any], stop: Any) -> None:
        self.devices = devices
        self.stop = stop

    def poll(self, timeout: float) -> Any:
        if self.devices:
            return self.devices.pop(0)
        self.stop.set()
        return None


def test_udev_malformed_monitor_events_are_counted() -> None:
    source = UdevSource(monitor=None)
    monitor = udev.UdevMonitor(source._enqueue, on_bad_event=source._bad_event)
    good = {
        "ACTION": "remove",
        "DEVPATH": "/devices/pci0000:00/0000:03:00.0",
        "SUBSYSTEM": "pci",
        "PCI_CLASS": "30000",
        "PCI_SLOT_NAME": "0000:03:00.0",
    }
    bad = dict(good, PCI_SLOT_NAME="not a slot")
    devices = [argparse.Namespace(properties=p) for p in (bad, good, {"ACTION": "add"})]
    monitor._monitor = _FakeUdevMonitor(devices, monitor._stop)
    monitor._run()
    with tempfile.TemporaryDirectory() as root:
        data = source.collect(Roots.under(root))
    assert data.events == (("pci", "remove", 1),)
    assert data.skipped.counts == {udev.SKIP_EVENT_UNPARSABLE: 2}
    assert not source.collect(Roots.under(root)).skipped


# --- link events ----------------------------------------------------------------------------


class Message(dict[str, Any]):
    """A pyroute2 message's ``get``, for what parse_link reads."""


def _message(name: str, oper: str, carrier: int, kind: str | None, event: str) -> Message:
    linkinfo = Message(IFLA_INFO_KIND=kind) if kind else None
    return Message(
        event=event,
        index=3,
        flags=1,
        IFLA_IFNAME=name,
        IFLA_OPERSTATE=oper,
        IFLA_CARRIER=carrier,
        IFLA_LINKINFO=linkinfo,
    )


def test_parse_link_event() -> None:
    up = parse_link_event(_message("ens1f0", "UP", 1, None, "RTM_NEWLINK"), 5.0, False)
    assert up == LinkEvent("ens1f0", "netdev", "up", 5.0)
    down = parse_link_event(
        _message("ens1f0", "LOWERLAYERDOWN", 0, None, "RTM_NEWLINK"), 6.0, False
    )
    assert down is not None and down.state == "down"
    # Carrier on an up link whose driver reports no operstate counts as up.
    unknown = parse_link_event(_message("ib0", "UNKNOWN", 1, None, "RTM_NEWLINK"), 7.0, False)
    assert unknown is not None and unknown.state == "up"
    assert parse_link_event(_message("veth1", "UP", 1, "veth", "RTM_NEWLINK"), 1.0, False) is None
    veth = parse_link_event(_message("veth1", "UP", 1, "veth", "RTM_NEWLINK"), 1.0, True)
    assert veth is not None
    gone = parse_link_event(_message("ens1f0", "DOWN", 0, None, "RTM_DELLINK"), 8.0, False)
    assert gone is not None and gone.state == "removed"


def test_flap_counter() -> None:
    counter = FlapCounter(window_seconds=60.0, max_links=2)
    seq = [
        ("a", "up", 0.0), ("a", "up", 1.0), ("a", "down", 10.0), ("a", "up", 12.0),
        ("a", "down", 80.0), ("a", "up", 81.0), ("b", "down", 5.0), ("c", "up", 6.0),
    ]  # fmt: skip
    for name, state, t in seq:
        counter.observe(LinkEvent(name, "netdev", state, t))
    data = counter.snapshot(now=100.0, monitor=True)
    a = data.link("a")
    assert a is not None
    # The first state is no transition; a repeated state neither.
    assert (a.state, a.up_total, a.down_total) == ("up", 2, 2)
    assert a.recent == 2  # those at 80 and 81 s; 10 and 12 s are out of the window
    b = data.link("b")
    assert b is not None and (b.up_total, b.down_total, b.recent) == (0, 0, 0)
    assert data.link("c") is None and data.untracked == 1
    counter.observe(LinkEvent("a", "netdev", "removed", 101.0))
    a = counter.snapshot(101.0, True).link("a")
    assert a is not None and a.state == "removed" and a.up_total == 2


def test_ib_ports_polled(tmp_path: Path) -> None:
    port = tmp_path / "sys" / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    now = [0.0]
    source = LinkEventsSource(netlink=False, window_seconds=60.0, clock=lambda: now[0])
    roots = Roots.under(tmp_path)
    for t, state in ((0.0, "4: ACTIVE"), (1.0, "1: DOWN"), (2.0, "2: INIT"), (3.0, "4: ACTIVE"),
                     (4.0, "1: DOWN"), (5.0, "4: ACTIVE")):  # fmt: skip
        now[0] = t
        (port / "state").write_text(f"{state}\n")
        data = source.collect(roots)
    link = data.link("mlx5_0/1")
    assert link is not None
    assert (link.kind, link.state, link.up_total, link.down_total, link.recent) == (
        "infiniband",
        "up",
        2,
        2,
        4,
    )
    assert data.monitor is False
    [finding] = hotplug.flapping(_snapshot({"link_events": data}), 4.0)
    assert finding.kind == hotplug.FLAPPING and finding.subjects == {"interface": "mlx5_0/1"}
    assert finding.evidence["value"] == 4 and finding.evidence["threshold"] == 4
    assert "InfiniBand port mlx5_0/1 flapping" in finding.message
    assert hotplug.flapping(_snapshot({"link_events": data}), 5.0) == []
    now[0] = 100.0
    assert source.collect(roots).link("mlx5_0/1").recent == 0  # type: ignore[union-attr]
    assert ib_port_state("4: ACTIVE\n") == "up" and ib_port_state("3: ARMED") == "down"


def test_ib_port_with_a_malformed_or_refused_state_is_skipped_not_the_others(
    tmp_path: Path,
) -> None:
    ports = tmp_path / "sys" / "class" / "infiniband" / "mlx5_0" / "ports"
    for port in ("1", "2", "3"):
        (ports / port).mkdir(parents=True)
    (ports / "1" / "state").write_text("4: ACTIVE\n")
    (ports / "2" / "state").write_text("ACTIVE\n")
    os.mkfifo(ports / "3" / "state")
    now = [0.0]
    source = LinkEventsSource(netlink=False, clock=lambda: now[0])
    roots = Roots.under(tmp_path)
    first = source.collect(roots)
    assert [link.interface for link in first.links] == ["mlx5_0/1"]
    assert first.skipped.counts == {
        link_events.SKIP_IB_STATE_UNPARSABLE: 1,
        link_events.SKIP_FILE_REFUSED: 1,
    }
    now[0] = 1.0
    (ports / "1" / "state").write_text("1: DOWN\n")
    link = source.collect(roots).link("mlx5_0/1")
    assert link is not None and (link.state, link.down_total) == ("down", 1)


def test_malformed_link_messages_are_counted() -> None:
    source = LinkEventsSource(netlink=False, clock=lambda: 5.0)
    monitor = link_events.NetlinkMonitor(
        source._enqueue, clock=lambda: 5.0, on_bad_message=source._bad_message
    )
    nameless = _message("x", "UP", 1, None, "RTM_NEWLINK")
    del nameless["IFLA_IFNAME"]
    monitor._deliver(
        [
            _message("ens1f0", "UP", 1, None, "RTM_NEWLINK"),
            nameless,
            _message("ens1f1", "SIDEWAYS", 1, None, "RTM_NEWLINK"),
        ]
    )
    with tempfile.TemporaryDirectory() as root:
        data = source.collect(Roots.under(root))
    assert [link.interface for link in data.links] == ["ens1f0"]
    assert data.skipped.counts == {link_events.SKIP_MESSAGE_UNPARSABLE: 2}


# --- metrics --------------------------------------------------------------------------------


def _snapshot(data: Mapping[str, Any]) -> Snapshot:
    return Snapshot(
        1, 10.0, 1e9, {name: SourceSample(name, 10.0, 0.01, value) for name, value in data.items()}
    )


def _render(snapshot: Snapshot) -> SampleValues:
    return sample_values(exposition(event_metrics.families(snapshot)))


def test_event_metrics() -> None:
    links = LinkEventsData(
        (LinkTransitions("mlx5_0/1", "infiniband", "down", 3, 4, 5),), 300.0, True, 0
    )
    udev_data = UdevData("kernel", (("pci", "remove", 2), ("net", "weird", 1)),
                         (GpuRemovals(GPU5, 2),), (GPU5,), (), 0, 7)  # fmt: skip
    values = _render(_snapshot({"link_events": links, "udev": udev_data}))
    assert (
        values[("nodescope_link_transitions_total", (("interface", "mlx5_0/1"), ("to", "down")))]
        == 4
    )
    assert (
        values[("nodescope_link_transitions_total", (("interface", "mlx5_0/1"), ("to", "up")))] == 3
    )
    assert values[("nodescope_link_up", (("interface", "mlx5_0/1"),))] == 0
    assert values[("nodescope_link_window_transitions", (("interface", "mlx5_0/1"),))] == 5
    assert values[("nodescope_gpu_fell_off_bus_total", (("bdf", GPU5),))] == 2
    assert (
        values[("nodescope_udev_events_total", (("action", "remove"), ("subsystem", "pci")))] == 2
    )
    # Actions outside the kernel's set are folded into one label value.
    assert values[("nodescope_udev_events_total", (("action", "other"), ("subsystem", "net")))] == 1
    # No data: no series.
    assert _render(_snapshot({})) == {}
    # No monitor: removals seen in the listing are counted, events are not claimed to be 0.
    quiet = _render(_snapshot({"udev": dataclasses.replace(udev_data, monitor=None)}))
    assert not any(name == "nodescope_udev_events_total" for name, _ in quiet)


def test_detector_disabled() -> None:
    config = default_config()
    values = {k: dict(v) for k, v in config.detectors.values.items()}
    values["hotplug"]["enabled"] = False
    off = dataclasses.replace(
        config, detectors=dataclasses.replace(config.detectors, values=values)
    )
    data = UdevData(None, (), (), (GPU5,), (), 0, 0)
    assert hotplug.detect(None, _snapshot({"udev": data}), off.detectors.hotplug) == []
    [finding] = hotplug.detect(None, _snapshot({"udev": data}), config.detectors.hotplug)
    assert finding.subjects == {"bdf": GPU5} and "gone from sysfs" in finding.message


# --- fuzz -----------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_parse_uevent_fuzz(text: str) -> None:
    with contextlib.suppress(ParseError):
        parse_uevent(text)


@settings(max_examples=200, deadline=None)
@given(st.binary())
def test_parse_kernel_message_fuzz(data: bytes) -> None:
    with contextlib.suppress(ParseError):
        parse_kernel_message(data)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            ["ACTION", "DEVPATH", "SUBSYSTEM", "PCI_CLASS", "PCI_SLOT_NAME", "SEQNUM", "INTERFACE"]
        ),
        st.one_of(st.text(), st.sampled_from(["add", "/devices/pci0000:00", "30200", "1"])),
    )
)
def test_event_from_properties_fuzz(props: dict[str, str]) -> None:
    with contextlib.suppress(ParseError):
        event_from_properties(props)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_ib_port_state_fuzz(text: str) -> None:
    with contextlib.suppress(ParseError):
        assert ib_port_state(text) in ("up", "down")


# --- any PCI function that leaves the bus ---------------------------------------------------


_ROOT = "pci0000:b7"
# A root port, a switch (upstream port, two downstream ports), an NVMe controller and a GPU
# below it, and a NIC on a root port of its own: the DGX layout of GPU 5 and nvme5.
_TREE = (
    ("0000:b7:01.0", (), 0x060400, 0x8086, DeviceClass.BRIDGE, PortRole.ROOT_PORT),
    ("0000:b8:00.0", ("0000:b7:01.0",), 0x060400, 0x1000, DeviceClass.BRIDGE,
     PortRole.UPSTREAM_PORT),
    ("0000:b9:00.0", ("0000:b7:01.0", "0000:b8:00.0"), 0x060400, 0x1000, DeviceClass.BRIDGE,
     PortRole.DOWNSTREAM_PORT),
    ("0000:b9:01.0", ("0000:b7:01.0", "0000:b8:00.0"), 0x060400, 0x1000, DeviceClass.BRIDGE,
     PortRole.DOWNSTREAM_PORT),
    ("0000:ba:00.0", ("0000:b7:01.0", "0000:b8:00.0", "0000:b9:00.0"), 0x010802, 0x8086,
     DeviceClass.NVME, PortRole.ENDPOINT),
    ("0000:bb:00.0", ("0000:b7:01.0", "0000:b8:00.0", "0000:b9:01.0"), 0x030200, 0x10DE,
     DeviceClass.GPU, PortRole.ENDPOINT),
    ("0000:b7:02.0", (), 0x060400, 0x8086, DeviceClass.BRIDGE, PortRole.ROOT_PORT),
    ("0000:bc:00.0", ("0000:b7:02.0",), 0x020700, 0x15B3, DeviceClass.INFINIBAND,
     PortRole.ENDPOINT),
)  # fmt: skip
NVME5 = "0000:ba:00.0"
SWITCH = "0000:b8:00.0"
HCA = "0000:bc:00.0"


def _topology(without: tuple[str, ...] = (), skipped: bool = False) -> Topology:
    devices = []
    for bdf, above, class_code, vendor, device_class, role in _TREE:
        chain = (*above, bdf)
        if any(b in without for b in chain):
            continue
        devices.append(
            PciDevice(
                bdf, _ROOT, chain, vendor, 0x1234, class_code, device_class, role, 1, None, None,
                nvme_controllers=("nvme5",) if bdf == NVME5 else (),
                ib_devices=("mlx5_7",) if bdf == HCA else (),
            )
        )  # fmt: skip
    tally = SkipTally()
    if skipped:
        tally.skip("function_unreadable", "a function whose vendor could not be read")
    roots = (PciRoot(_ROOT, 0, 0xB7, ("0000:b7:01.0", "0000:b7:02.0")),)
    return Topology(tuple(sorted(devices, key=lambda d: d.bdf)), roots, skipped=tally.freeze())


def _remove_event(bdf: str, pci_class: int, action: str = "remove") -> UdevEvent:
    return UdevEvent(action, "pci", f"/devices/pci0000:b7/{bdf}", bdf, pci_class, None, 1,
                     (0x8086, 0x0B60))  # fmt: skip


def _pair(before: Topology, now: Topology, events: tuple[UdevEvent, ...] = ()) -> Snapshot:
    udev_data = UdevData(None, (), (), (), events, 0, 1)
    return Snapshot(
        2, 20.0, 1e9,
        {"pci": SourceSample("pci", 20.0, 0.01, now),
         "udev": SourceSample("udev", 20.0, 0.0, udev_data)},
        {"pci": SourceSample("pci", 10.0, 0.01, before)},
    )  # fmt: skip


def test_nvme_removed_between_two_reads() -> None:
    [finding] = hotplug.pci_removed(None, _pair(_topology(), _topology((NVME5,))))
    assert finding.kind == hotplug.REMOVED == "pci_device_removed"
    assert finding.subjects == {"bdf": NVME5}
    assert finding.severity is Severity.WARNING  # no job used it
    assert "nvme nvme5 0000:ba:00.0 (class 010802, 8086:1234) left the bus" in finding.message
    assert finding.evidence["nvme_removed"] == 1 and finding.evidence["functions_below"] == 0


def test_switch_removed_is_one_finding_naming_everything_below() -> None:
    findings = hotplug.pci_removed(None, _pair(_topology(), _topology((SWITCH,))))
    [finding] = findings  # not one per port, and not the GPU's (gpu_fell_off_bus has it)
    assert finding.subjects == {"bdf": SWITCH}
    assert finding.evidence["functions_below"] == 4
    assert finding.evidence["gpus_removed"] == 1 and finding.evidence["nvme_removed"] == 1
    for bdf in ("0000:b9:00.0", "0000:b9:01.0", NVME5, GPU5):
        assert bdf in finding.message


def test_gpu_removed_is_left_to_fell_off_bus() -> None:
    assert hotplug.pci_removed(None, _pair(_topology(), _topology((GPU5,)))) == []


def test_removal_of_a_function_the_jobs_used(monkeypatch: pytest.MonkeyPatch) -> None:
    views = (
        JobView("81780", (1,), (5,), (GPU5,), ("mlx5_7",), "NCCL_IB_HCA"),
        JobView("81781", (2,), (6,), ("0000:cb:00.0",), ("mlx5_8",), "NCCL_IB_HCA"),
    )
    monkeypatch.setattr(hotplug, "jobs", lambda snapshot: views)
    # The switch took the job's GPU with it: critical, the job named.
    [switch] = hotplug.pci_removed(None, _pair(_topology(), _topology((SWITCH,))))
    assert switch.severity is Severity.CRITICAL
    assert "GPU 0000:bb:00.0 of job 81780" in switch.message
    # The HCA the job's NCCL_IB_HCA names: the job, a warning (no GPU or disk of it went).
    [hca] = hotplug.pci_removed(None, _pair(_topology(), _topology((HCA,))))
    assert hca.severity is Severity.WARNING and "HCA mlx5_7 of job 81780" in hca.message
    assert "81781" not in hca.message
    # The NVMe beside the job's GPU under one switch: named as beside, not as used.
    [nvme] = hotplug.pci_removed(None, _pair(_topology(), _topology((NVME5,))))
    assert nvme.severity is Severity.WARNING
    assert "beside the GPUs of job 81780" in nvme.message


def test_unbind_and_rebind_is_no_removal() -> None:
    block = UdevEvent("remove", "block", f"/devices/pci0000:b7/{NVME5}/nvme/nvme5/nvme5n1")
    events = (*(_remove_event(NVME5, 0x010802, a) for a in ("unbind", "bind")), block)
    assert hotplug.pci_removed(None, _pair(_topology(), _topology(), events)) == []


def test_removed_and_back_before_the_next_read_is_no_removal() -> None:
    events = (_remove_event(NVME5, 0x010802), _remove_event(NVME5, 0x010802, "add"))
    assert hotplug.pci_removed(None, _pair(_topology(), _topology(), events)) == []


def test_a_read_that_skipped_a_function_proves_no_removal() -> None:
    skipped = _topology((NVME5,), skipped=True)
    assert hotplug.pci_removed(None, _pair(_topology(), skipped)) == []
    # With the kernel's removal event it is one.
    events = (_remove_event(NVME5, 0x010802),)
    [finding] = hotplug.pci_removed(None, _pair(_topology(), skipped, events))
    assert finding.subjects == {"bdf": NVME5} and finding.evidence["removal_events"] == 1


def test_removal_event_without_an_earlier_read() -> None:
    """The event names what went when the topology before it is not there to."""
    snapshot = Snapshot(
        1, 10.0, 1e9,
        {
            "pci": SourceSample("pci", 10.0, 0.01, _topology((NVME5,))),
            "udev": SourceSample(
                "udev", 10.0, 0.0,
                UdevData(None, (), (), (), (_remove_event(NVME5, 0x010802),), 0, 1),
            ),
        },
    )  # fmt: skip
    [finding] = hotplug.pci_removed(None, snapshot)
    assert "function 0000:ba:00.0 (class 010802, 8086:0b60) left the bus" in finding.message


def test_event_names_its_pci_id() -> None:
    event = event_from_properties(
        {
            "ACTION": "remove",
            "DEVPATH": "/devices/pci0000:b7/0000:b7:01.0/0000:ba:00.0",
            "SUBSYSTEM": "pci",
            "PCI_CLASS": "10802",
            "PCI_ID": "8086:0B60",
            "PCI_SLOT_NAME": "0000:ba:00.0",
        }
    )
    assert event.pci_id == (0x8086, 0x0B60) and event.is_pci_removal
    with pytest.raises(ParseError):
        event_from_properties({"ACTION": "remove", "DEVPATH": "/devices/x", "SUBSYSTEM": "pci",
                               "PCI_ID": "8086"})  # fmt: skip


def test_a_removal_found_critical_stays_critical_while_it_lasts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The job is named from the node as the drive goes; the next cycle's reads no longer
    show that it used the drive, and the removal must not turn into a warning then."""
    views = (JobView("81780", (1,), (5,), (GPU5,), ("mlx5_7",), "NCCL_IB_HCA"),)
    monkeypatch.setattr(hotplug, "jobs", lambda snapshot: views)
    [first] = hotplug.pci_removed(None, _pair(_topology(), _topology((SWITCH,))))
    assert first.severity is Severity.CRITICAL
    # The job view moved on (no job on GPU 5 now): read alone, a warning.
    monkeypatch.setattr(hotplug, "jobs", lambda snapshot: ())
    now = _pair(_topology(), _topology((SWITCH,)))
    [alone] = hotplug.pci_removed(None, now)
    assert alone.severity is Severity.WARNING
    # After the critical cycle: critical still, naming the job as it did.
    before = dataclasses.replace(now, findings=(first,))
    [kept] = hotplug.pci_removed(before, now)
    assert kept.severity is Severity.CRITICAL and kept.key == first.key
    assert kept.message == first.message and "job 81780" in kept.message
    # Another function's critical removal keeps nothing of this one.
    other = dataclasses.replace(first, subjects={"bdf": HCA})
    [judged] = hotplug.pci_removed(dataclasses.replace(now, findings=(other,)), now)
    assert judged.severity is Severity.WARNING
    # Gone from the reads (the tree read again): no finding, and nothing to keep.
    assert hotplug.pci_removed(before, _pair(_topology((SWITCH,)), _topology((SWITCH,)))) == []


@pytest.mark.parametrize(
    ("name", "finding"), [("nvme-hot-removed", "0000:ba:00.0"), ("nvme-driver-rebind", None)]
)
def test_nvme_scenarios(name: str, finding: str | None) -> None:
    """The simulated node's events and trees: the hot-removed controller is one finding with
    its removal events, in the cycle the udev source reports the removal (the pci source
    reads the tree again then, not at the end of its 30 s interval); unbound and bound
    again, it is none."""
    from nodescope.sim.driver import replay, temp_dir
    from nodescope.sim.scenario import load_scenario

    scenario = load_scenario(name)
    scenario = dataclasses.replace(
        scenario, duration_seconds=14.0, expect=dataclasses.replace(scenario.expect, metrics=())
    )
    found: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="nodescope-test-", dir=temp_dir()) as d:
        replay(
            scenario,
            Path(d) / "root",
            detectors=[d for d in DETECTORS if d.name == "hotplug"],
            builders=[],
            on_cycle=lambda t, snapshot, body: found.extend((t, f) for f in snapshot.findings),
        )
    if finding is None:
        assert found == []
        return
    assert {f.key for _, f in found} == {f"pci_device_removed{{bdf={finding}}}"}
    assert found[0][0] == 10.0
    assert found[0][1].evidence["removal_events"] == 1


def _with_vfs(without: tuple[str, ...] = ()) -> Topology:
    """The tree with two SR-IOV virtual functions of the HCA beside it."""
    base = _topology()
    pf = base.device(HCA)
    vfs = tuple(
        dataclasses.replace(pf, bdf=bdf, chain=(*pf.chain[:-1], bdf), physical_function=HCA)
        for bdf in ("0000:bc:00.1", "0000:bc:00.2")
    )
    devices = tuple(
        d for d in (*base.devices, *vfs) if not any(b in without for b in (d.bdf, *d.chain))
    )
    return dataclasses.replace(base, devices=tuple(sorted(devices, key=lambda d: d.bdf)))


def test_virtual_functions_taken_away_by_their_driver_are_no_removal() -> None:
    vfs = ("0000:bc:00.1", "0000:bc:00.2")
    events = tuple(_remove_event(bdf, 0x020700) for bdf in vfs)
    # sriov_numvfs set to 0: both VFs leave, their PF stays.
    assert hotplug.pci_removed(None, _pair(_with_vfs(), _with_vfs(vfs), events)) == []
    assert hotplug.pci_removed(None, _pair(_with_vfs(), _with_vfs(vfs))) == []
    # The PF itself leaves the bus, its VFs with it: one finding, the PF's.
    gone = (HCA, *vfs)
    [finding] = hotplug.pci_removed(None, _pair(_with_vfs(), _with_vfs(gone)))
    assert finding.subjects == {"bdf": HCA}
