"""Hot-plug: PCI, block and network devices that come and go, and GPUs that fall off the bus.

Two inputs:

* a device monitor on its own thread (pyudev, ``Monitor.from_netlink``): the kernel's
  uevents (``source="kernel"``, ``NETLINK_KOBJECT_UEVENT`` group 1: ``ACTION@DEVPATH`` then
  ``KEY=VALUE`` entries, ``lib/kobject_uevent.c``) or udevd's re-broadcast of them after its
  rules ran (``source="udev"``), filtered to the ``pci``, ``block`` and ``net`` subsystems.
  Every event on a device below a PCI function advances the topology generation
  (:class:`~nodescope.sources.base.TopologyGeneration`, shared with the ``pci`` source), so
  the ``pci`` source walks the tree again on its next run instead of after a restart. PCI
  events carry ``PCI_CLASS`` and ``PCI_SLOT_NAME`` (``drivers/pci/pci-driver.c``
  ``pci_uevent``), so a removed GPU is known as one even though its sysfs directory is gone;
* a listing of ``<sysfs>/bus/pci/devices`` on every run: a GPU (class ``0x03xxxx``, read
  once from ``<sysfs>/bus/pci/devices/<bdf>/class`` when it first appears) that disappears
  between two runs was removed even when no monitor runs (the simulated node, a daemon
  without netlink access).

The record counts events per subsystem and action and removals per GPU since the source
started, and lists the GPUs that were seen and are gone now. Formats: ``/sys/.../uevent`` is
``KEY=VALUE`` per line (``drivers/base/core.c`` ``uevent_show``). The records are declared in
:mod:`nodescope.model.udev`.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import Counter, deque
from collections.abc import Callable, Mapping
from typing import Any

from nodescope.errors import ParseError
from nodescope.fileio import SYSFS_ATTRIBUTE, FileTooLarge, NotARegularFile, read_bytes
from nodescope.model.skips import SkipTally
from nodescope.model.udev import (
    ACTIONS,
    UDEV,
    GpuRemovals,
    UdevData,
    UdevEvent,
    is_gpu_class,
)
from nodescope.roots import Roots
from nodescope.sources.base import TopologyGeneration
from nodescope.sources.spec import SourceSpec

NAME = UDEV.name
SUBSYSTEMS = ("pci", "block", "net")
#: Events kept between two runs; the oldest are dropped first (counted as ``dropped``).
MAX_QUEUED = 4096
#: Events of the latest run kept in the record.
MAX_RECENT = 32

log = logging.getLogger("nodescope.udev")

_BDF = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_KEY = re.compile(r"[A-Z0-9_]{1,64}")
_PCI_ID = re.compile(r"([0-9a-fA-F]{4}):([0-9a-fA-F]{4})")

# Reasons a record was skipped (nodescope_source_records_skipped_total{reason}).
#: a monitor event without the properties of a device event, or with malformed ones
SKIP_EVENT_UNPARSABLE = "event_unparsable"
#: a function's ``class`` attribute that is not ``0x`` and six hex digits
SKIP_CLASS_UNPARSABLE = "class_unparsable"
#: a ``class`` attribute that is not a regular file or is over its size cap, refused unread
SKIP_FILE_REFUSED = "file_refused"


# --- parsers (pure) -------------------------------------------------------------------------


def parse_uevent(text: str, source: str = "uevent") -> tuple[tuple[str, str], ...]:
    """A ``uevent`` file: ``KEY=VALUE`` per line, in file order."""
    out: list[tuple[str, str]] = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line:
            continue
        key, sep, value = line.partition("=")
        if not sep or not _KEY.fullmatch(key):
            raise ParseError(source, f"not KEY=VALUE: {line!r}", number)
        out.append((key, value))
    return tuple(out)


def _pci_class(text: str, source: str) -> int:
    if not re.fullmatch(r"(0x)?[0-9a-fA-F]{1,6}", text):
        raise ParseError(source, f"PCI_CLASS: not a hex class code: {text!r}")
    return int(text, 16)


def event_from_properties(properties: Mapping[str, str], source: str = "uevent") -> UdevEvent:
    """An event from its properties (``ACTION``, ``DEVPATH``, ``SUBSYSTEM`` required)."""
    try:
        action = properties["ACTION"]
        devpath = properties["DEVPATH"]
        subsystem = properties["SUBSYSTEM"]
    except KeyError as exc:
        raise ParseError(source, f"event without {exc.args[0]}") from None
    if not action or not action.isidentifier():
        raise ParseError(source, f"ACTION: not an action: {action!r}")
    if not devpath.startswith("/") or not devpath.isprintable():
        raise ParseError(source, f"DEVPATH: not a device path: {devpath!r}")
    if not subsystem or not subsystem.isprintable() or "/" in subsystem:
        raise ParseError(source, f"SUBSYSTEM: not a subsystem: {subsystem!r}")
    slot = properties.get("PCI_SLOT_NAME")
    if slot is not None:
        slot = slot.lower()
        if not _BDF.fullmatch(slot):
            raise ParseError(source, f"PCI_SLOT_NAME: not a PCI address: {slot!r}")
    class_text = properties.get("PCI_CLASS")
    pci_class = None if class_text is None else _pci_class(class_text, source)
    seqnum_text = properties.get("SEQNUM")
    seqnum = None
    if seqnum_text is not None:
        if not re.fullmatch(r"[0-9]{1,20}", seqnum_text):
            raise ParseError(source, f"SEQNUM: not a number: {seqnum_text!r}")
        seqnum = int(seqnum_text)
    interface = properties.get("INTERFACE")
    pci_id = None
    id_text = properties.get("PCI_ID")
    if id_text is not None:
        # ``PCI_ID=%04X:%04X`` (vendor:device, drivers/pci/pci-driver.c pci_uevent)
        match = _PCI_ID.fullmatch(id_text)
        if match is None:
            raise ParseError(source, f"PCI_ID: not VENDOR:DEVICE: {id_text!r}")
        pci_id = (int(match.group(1), 16), int(match.group(2), 16))
    return UdevEvent(action, subsystem, devpath, slot, pci_class, interface, seqnum, pci_id)


def parse_kernel_message(data: bytes, source: str = "kobject_uevent") -> UdevEvent:
    """A raw kernel uevent datagram: ``ACTION@DEVPATH`` then NUL-separated ``KEY=VALUE``."""
    parts = data.split(b"\0")
    head = parts[0].decode("utf-8", errors="replace")
    action, sep, devpath = head.partition("@")
    if not sep:
        raise ParseError(source, f"no ACTION@DEVPATH header: {head!r}", 1)
    properties: dict[str, str] = {}
    for number, raw in enumerate(parts[1:], start=2):
        if not raw:
            continue
        key, eq, value = raw.decode("utf-8", errors="replace").partition("=")
        if not eq or not _KEY.fullmatch(key):
            raise ParseError(source, f"not KEY=VALUE: {raw!r}", number)
        properties[key] = value
    # The header says the same as ACTION and DEVPATH; it stands in when they are missing.
    properties.setdefault("ACTION", action)
    properties.setdefault("DEVPATH", devpath)
    return event_from_properties(properties, source)


# --- the monitor thread ---------------------------------------------------------------------


class UdevMonitor:
    """pyudev's netlink monitor on a daemon thread; events go to ``on_event``, and an event on
    a device below a PCI function advances ``topology``. The socket is opened in :meth:`start`
    (which raises if it cannot be), so a caller knows at once."""

    def __init__(
        self,
        on_event: Callable[[UdevEvent], None],
        source: str = "kernel",
        subsystems: tuple[str, ...] = SUBSYSTEMS,
        on_bad_event: Callable[[str], None] | None = None,
        topology: TopologyGeneration | None = None,
    ) -> None:
        self.source = source
        self.subsystems = subsystems
        self.on_event = on_event
        #: told what was wrong with each event that did not parse
        self.on_bad_event = on_bad_event
        self.topology = TopologyGeneration() if topology is None else topology
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._monitor: Any = None

    def start(self) -> None:
        import pyudev

        context = pyudev.Context()
        monitor = pyudev.Monitor.from_netlink(context, source=self.source)
        for subsystem in self.subsystems:
            monitor.filter_by(subsystem)
        monitor.start()
        self._monitor = monitor
        self._thread = threading.Thread(target=self._run, name="nodescope-udev", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        monitor = self._monitor
        while not self._stop.is_set():
            try:
                device = monitor.poll(timeout=0.25)
            except Exception as exc:  # a closed or broken socket ends the monitor
                if not self._stop.is_set():
                    log.warning("monitor=%s state=stopped error=%r", self.source, str(exc))
                return
            if device is None:
                continue
            try:
                event = event_from_properties(dict(device.properties), f"udev {self.source}")
            except ParseError as exc:
                if self.on_bad_event is not None:
                    self.on_bad_event(str(exc))
                continue
            if event.under_pci and event.action in ACTIONS:
                self.topology.advance()
            self.on_event(event)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None
        self._monitor = None


# --- the source -----------------------------------------------------------------------------


def _read_class(roots: Roots, bdf: str, tally: SkipTally) -> tuple[int | None, bool]:
    """The function's class code, and whether that answer is final: a refused or malformed
    ``class`` (counted in ``tally``) is read again on a later run; an absent one (the
    function went) is not."""
    path = f"{roots.sysfs}/bus/pci/devices/{bdf}/class"
    try:
        data = read_bytes(path, SYSFS_ATTRIBUTE)
    except (NotARegularFile, FileTooLarge):
        tally.skip(SKIP_FILE_REFUSED, path)
        return None, False
    except OSError:
        return None, True
    try:
        return _pci_class(data.decode("utf-8", errors="replace").strip(), path), True
    except ParseError as exc:
        tally.skip(SKIP_CLASS_UNPARSABLE, str(exc))
        return None, False


def _pci_names(roots: Roots) -> list[str] | None:
    try:
        return os.listdir(f"{roots.sysfs}/bus/pci/devices")
    except OSError:
        return None


class UdevSource:
    """``monitor``: ``"kernel"``, ``"udev"`` or ``None`` (listing only). A monitor that cannot
    start (no netlink access, pyudev missing) is logged once and the listing goes on.
    ``topology``: the generation its monitor advances on a PCI device event, shared with the
    ``pci`` source (its own when not given)."""

    name = NAME

    def __init__(
        self, monitor: str | None = "kernel", topology: TopologyGeneration | None = None
    ) -> None:
        self.monitor_source = monitor
        self.topology = TopologyGeneration() if topology is None else topology
        self._monitor: UdevMonitor | None = None
        self._monitor_failed = False
        self._lock = threading.Lock()
        self._queue: deque[UdevEvent] = deque()
        self._dropped = 0
        #: events the monitor could not parse since the last run, and the latest's fault
        self._bad_events = 0
        self._bad_event_example = ""
        self._counts: Counter[tuple[str, str]] = Counter()
        self._removals: Counter[str] = Counter()
        self._gpus: set[str] = set()
        self._present: set[str] | None = None
        self._classes: dict[str, int | None] = {}
        # The raw listing and the record of the last run: a run that saw no event, the same
        # listing and the same topology generation returns that record again, so what is
        # built from it downstream is reused.
        self._last_names: list[str] | None = None
        self._last: UdevData | None = None

    def _enqueue(self, event: UdevEvent) -> None:
        with self._lock:
            if len(self._queue) >= MAX_QUEUED:
                self._queue.popleft()
                self._dropped += 1
            self._queue.append(event)

    def receive(self, event: UdevEvent) -> None:
        """An event as the monitor thread hands it on: queued for the next run, and the
        topology marked stale when it concerns a device below a PCI function. For a node
        whose events come from elsewhere than netlink (the simulated node)."""
        if event.under_pci and event.action in ACTIONS:
            self.topology.advance()
        self._enqueue(event)

    def _bad_event(self, fault: str) -> None:
        with self._lock:
            self._bad_events += 1
            self._bad_event_example = fault

    def _ensure_monitor(self) -> None:
        if self._monitor is not None or self._monitor_failed or self.monitor_source is None:
            return
        monitor = UdevMonitor(
            self._enqueue,
            self.monitor_source,
            on_bad_event=self._bad_event,
            topology=self.topology,
        )
        try:
            monitor.start()
        except Exception as exc:
            self._monitor_failed = True
            log.warning("monitor=%s state=unavailable error=%r", self.monitor_source, str(exc))
            return
        self._monitor = monitor

    def collect(self, roots: Roots) -> UdevData:
        self._ensure_monitor()
        tally = SkipTally()
        with self._lock:
            events = list(self._queue)
            self._queue.clear()
            dropped = self._dropped
            for _ in range(self._bad_events):
                tally.skip(SKIP_EVENT_UNPARSABLE, self._bad_event_example)
            self._bad_events = 0
        removed_by_event: set[str] = set()
        for event in events:
            self._counts[(event.subsystem, event.action)] += 1
            if event.pci_slot is not None and event.is_gpu:
                self._gpus.add(event.pci_slot)
                self._classes[event.pci_slot] = event.pci_class
                if event.action == "remove":
                    self._removals[event.pci_slot] += 1
                    removed_by_event.add(event.pci_slot)
        names = _pci_names(roots)
        generation = self.topology.value
        last = self._last
        if (
            not events
            and not tally
            and last is not None
            and not last.skipped
            and not last.recent
            and last.dropped == dropped
            and last.topology_generation == generation
            and last.monitor == (self.monitor_source if self._monitor is not None else None)
            and names is not None
            and names == self._last_names
        ):
            return last
        self._last_names = names
        listing = None if names is None else {n for n in names if _BDF.fullmatch(n)}
        if listing is not None:
            for bdf in listing - set(self._classes):
                pci_class, final = _read_class(roots, bdf, tally)
                if final:
                    self._classes[bdf] = pci_class
                if is_gpu_class(pci_class):
                    self._gpus.add(bdf)
            if self._present is not None:
                for bdf in (self._present - listing) & self._gpus:
                    if bdf not in removed_by_event:
                        self._removals[bdf] += 1
            for bdf in set(self._classes) - listing:
                # Forget the class of what is gone: a device plugged in there later may differ.
                if bdf not in self._gpus:
                    del self._classes[bdf]
            self._present = listing
        missing = sorted(self._gpus - (listing or set())) if listing is not None else []
        data = UdevData(
            monitor=self.monitor_source if self._monitor is not None else None,
            events=tuple((s, a, n) for (s, a), n in sorted(self._counts.items())),
            gpu_removals=tuple(GpuRemovals(b, n) for b, n in sorted(self._removals.items())),
            gpus_missing=tuple(missing),
            recent=tuple(events[-MAX_RECENT:]),
            dropped=dropped,
            topology_generation=generation,
            skipped=tally.freeze(),
        )
        self._last = data
        return data

    def close(self) -> None:
        monitor, self._monitor = self._monitor, None
        if monitor is not None:
            monitor.stop()


def make_source(topology: TopologyGeneration | None = None) -> UdevSource:
    """The source with a kernel monitor; ``topology``: the generation shared with the ``pci``
    source."""
    return UdevSource(topology=topology)


SPEC = SourceSpec(
    name="udev",
    default_interval=1.0,
    help="PCI/block/net device events (pyudev monitor thread) and removed GPUs; refreshes topology",
    build=lambda inputs: make_source(topology=inputs.topology),
    rates=None,
    metric_area="nodescope_exporters.event_metrics",
    sim_parts=frozenset({"pci_links"}),
    # The simulated node's has no monitor: its device events reach it as the thread's would.
    sim_stand_in=True,
)


__all__ = [
    "ACTIONS",
    "MAX_QUEUED",
    "MAX_RECENT",
    "NAME",
    "SKIP_CLASS_UNPARSABLE",
    "SKIP_EVENT_UNPARSABLE",
    "SKIP_FILE_REFUSED",
    "SUBSYSTEMS",
    "UDEV",
    "GpuRemovals",
    "UdevData",
    "UdevEvent",
    "UdevMonitor",
    "UdevSource",
    "event_from_properties",
    "is_gpu_class",
    "make_source",
    "parse_kernel_message",
    "parse_uevent",
]
