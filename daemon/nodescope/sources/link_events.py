"""Link up/down transitions of network interfaces and InfiniBand ports, and flap counting.

Two inputs:

* an rtnetlink monitor on its own thread (an ``AF_NETLINK`` socket bound to the
  ``RTNLGRP_LINK`` multicast group, ``include/uapi/linux/rtnetlink.h``): every
  ``RTM_NEWLINK`` message the kernel sends when a link changes, decoded by
  :mod:`nodescope.sources.rtnetlink` and parsed like the ``netdev`` source's dump
  (:func:`nodescope.sources.netlink.parse_link`). A link is *up* when its RFC 2863
  operational state is ``up`` (or ``unknown`` with carrier on an administratively up link,
  as loopback-like drivers report), *down* otherwise; ``RTM_DELLINK`` forgets it. A dump at
  start gives each link's state without counting a transition;
* the state of every InfiniBand port, ``<sysfs>/class/infiniband/<dev>/ports/<n>/state``
  (``"4: ACTIVE"``, ``docs/datasources.md`` §7), read on every run: ``ACTIVE`` is up, every
  other state down. IB ports send no netlink events.

Per link the record counts transitions to up and to down since the source started, and the
transitions within the last :data:`WINDOW_SECONDS` (the flap detector's input). Virtual
links (veth, bridges, tunnels: containers make them by the thousand) are left out unless the
source is told to include them, so the ``interface`` label stays bounded; a removed link is
forgotten one window after its removal, and at most :data:`MAX_LINKS` are followed, physical
ones first (:class:`FlapCounter`). The records the
source hands on are declared in :mod:`nodescope.model.link_events`.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from nodescope.errors import ParseError
from nodescope.fileio import SYSFS_ATTRIBUTE, FileTooLarge, NotARegularFile, read_bytes
from nodescope.model.link_events import (
    LINK_EVENTS,
    LinkEventsData,
    LinkEventsOptions,
    LinkTransitions,
)
from nodescope.model.skips import SkipTally
from nodescope.roots import Roots
from nodescope.sources import rtnetlink as rtnl
from nodescope.sources.infiniband import parse_state
from nodescope.sources.netlink import (
    DUMP_TIMEOUT,
    LinkMessage,
    NetLink,
    dump_links,
    kernel_datagram,
    open_link_socket,
    parse_link,
)
from nodescope.sources.spec import SourceSpec

NAME = LINK_EVENTS.name
WINDOW_SECONDS = 300.0
#: Links followed at most; more are ignored (and counted as ``untracked``).
MAX_LINKS = 256
#: Transition times kept per link (the window needs no more to count a flap).
MAX_RECENT = 64
#: ``IFLA_INFO_KIND`` of links that are no hardware.
VIRTUAL_KINDS = frozenset(
    {
        "veth", "bridge", "bond", "team", "vlan", "vxlan", "geneve", "macvlan", "macvtap",
        "ipvlan", "ipvtap", "tun", "tap", "dummy", "ifb", "gre", "gretap", "ip6gre", "ipip",
        "sit", "ip6tnl", "vti", "wireguard", "nlmon", "vrf", "netdevsim",
    }
)  # fmt: skip

log = logging.getLogger("nodescope.link_events")


def link_state(link: NetLink) -> str:
    """``"up"`` or ``"down"`` as above."""
    if link.operstate == "up":
        return "up"
    if link.operstate in (None, "unknown") and link.carrier and link.admin_up:
        return "up"
    return "down"


def ib_port_state(text: str, source: str = "state") -> str:
    """``"up"`` for an ``ACTIVE`` InfiniBand port, ``"down"`` for any other state."""
    return "up" if parse_state(text, source).name == "ACTIVE" else "down"


@dataclass(frozen=True, slots=True)
class LinkEvent:
    """A state a link was seen in: ``kind`` ``"netdev"`` or ``"infiniband"``; ``state``
    ``"up"``/``"down"``/``"removed"``; ``monotonic`` when it was seen."""

    interface: str
    kind: str
    state: str
    monotonic: float
    #: a network device without a software link kind (``IFLA_INFO_KIND``: hardware NICs have
    #: none) or an InfiniBand port: followed before virtual links when the table is full
    physical: bool = True


def parse_link_event(
    message: LinkMessage, monotonic: float, include_virtual: bool, source: str = "rtnetlink"
) -> LinkEvent | None:
    """A link message as a :class:`LinkEvent`; ``None`` for a virtual link left out."""
    link = parse_link(message, source)
    if link.name == "lo" or (not include_virtual and link.kind in VIRTUAL_KINDS):
        return None
    physical = link.kind is None
    if message.get("event") == "RTM_DELLINK":
        return LinkEvent(link.name, "netdev", "removed", monotonic, physical)
    return LinkEvent(link.name, "netdev", link_state(link), monotonic, physical)


# Reasons a record was skipped (nodescope_source_records_skipped_total{reason}).
#: an rtnetlink link message without a usable name, state or carrier
SKIP_MESSAGE_UNPARSABLE = "link_message_unparsable"
#: an InfiniBand port ``state`` that is not ``<number>: <name>``
SKIP_IB_STATE_UNPARSABLE = "ib_state_unparsable"
#: a port ``state`` that is not a regular file or is over its size cap, refused unread
SKIP_FILE_REFUSED = "file_refused"


@dataclass(slots=True)
class _Tracked:
    """What the counter keeps of one link; ``removed_at``: when it was deleted (``None``
    while it exists)."""

    kind: str
    state: str
    physical: bool
    times: deque[float]
    up: int = 0
    down: int = 0
    removed_at: float | None = None


class FlapCounter:
    """Link states over time: counts a transition when a link's state differs from the last
    one seen; the first state seen of a link is no transition.

    At most ``max_links`` links are followed. A removed link keeps its counts for one window
    (its flaps still count, and a link deleted and made again under its name carries on) and
    is then forgotten, so containers making and deleting links leave no series behind. When
    the table is full, a new link takes the place of a removed one; a physical link (a
    network device without a software link kind, an InfiniBand port) takes the place of a
    virtual one, so churn of veths never pushes a NIC out; otherwise the new link is counted
    as ``untracked``.
    """

    def __init__(self, window_seconds: float = WINDOW_SECONDS, max_links: int = MAX_LINKS) -> None:
        self.window_seconds = window_seconds
        self.max_links = max_links
        self._links: dict[str, _Tracked] = {}
        self.untracked = 0

    def _forget_removed(self, now: float) -> None:
        gone = [
            name
            for name, link in self._links.items()
            if link.removed_at is not None and now - link.removed_at > self.window_seconds
        ]
        for name in gone:
            del self._links[name]

    def _make_room(self, physical: bool, now: float) -> bool:
        """Room for one more link: the expired removed links forgotten, else the one removed
        longest ago, else (for a physical link) the virtual link followed longest."""
        self._forget_removed(now)
        if len(self._links) < self.max_links:
            return True
        removed = [(link.removed_at, name) for name, link in self._links.items()
                   if link.removed_at is not None]  # fmt: skip
        if removed:
            del self._links[min(removed)[1]]
            return True
        if physical:
            # Dicts keep insertion order: the first virtual one is the one followed longest.
            victim = next((n for n, link in self._links.items() if not link.physical), None)
            if victim is not None:
                del self._links[victim]
                return True
        return False

    def observe(self, event: LinkEvent) -> None:
        name = event.interface
        link = self._links.get(name)
        if event.state == "removed":
            if link is not None and link.removed_at is None:
                link.state = "removed"
                link.removed_at = event.monotonic
            return
        if link is None:
            if len(self._links) >= self.max_links and not self._make_room(
                event.physical, event.monotonic
            ):
                self.untracked += 1
                return
            self._links[name] = _Tracked(
                event.kind, event.state, event.physical, deque(maxlen=MAX_RECENT)
            )
            return
        if link.removed_at is not None:
            # Made again under the same name: its first state is no transition.
            link.removed_at = None
            link.kind, link.state, link.physical = event.kind, event.state, event.physical
            return
        if link.state != event.state:
            if event.state == "up":
                link.up += 1
            else:
                link.down += 1
            link.times.append(event.monotonic)
        link.state = event.state

    def snapshot(self, now: float, monitor: bool) -> LinkEventsData:
        self._forget_removed(now)
        links = []
        for name in sorted(self._links):
            link = self._links[name]
            recent = sum(1 for t in link.times if now - t <= self.window_seconds)
            links.append(LinkTransitions(name, link.kind, link.state, link.up, link.down, recent))
        return LinkEventsData(tuple(links), self.window_seconds, monitor, self.untracked)


class NetlinkMonitor:
    """``RTM_NEWLINK``/``RTM_DELLINK`` messages of a network namespace (``netns``: an ``ip
    netns`` name, or ``None`` for the daemon's own) on a daemon thread. :meth:`start` opens
    the socket and dumps the links (their starting states) before it returns."""

    def __init__(
        self,
        on_event: Callable[[LinkEvent], None],
        netns: str | None = None,
        include_virtual: bool = False,
        clock: Callable[[], float] = time.monotonic,
        on_bad_message: Callable[[str], None] | None = None,
    ) -> None:
        self.on_event = on_event
        self.netns = netns
        self.include_virtual = include_virtual
        self.clock = clock
        #: told what was wrong with each link message that did not parse
        self.on_bad_message = on_bad_message
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    def _bad(self, fault: str) -> None:
        if self.on_bad_message is not None:
            self.on_bad_message(fault)

    def _decode(self, data: bytes) -> list[dict[str, Any]]:
        """The link messages of one multicast datagram; each one that does not decode is
        reported and left out, and a frame that does not fit ends the datagram."""
        messages: list[dict[str, Any]] = []
        try:
            for kind, _flags, _seq, payload in rtnl.frames(data):
                if kind not in rtnl.EVENTS:
                    continue
                try:
                    messages.append(rtnl.decode_link(kind, payload))
                except ParseError as exc:
                    self._bad(str(exc))
        except ParseError as exc:
            self._bad(str(exc))
        return messages

    def _deliver(self, messages: list[dict[str, Any]]) -> None:
        for message in messages:
            try:
                event = parse_link_event(message, self.clock(), self.include_virtual)
            except ParseError as exc:
                self._bad(str(exc))
                continue
            if event is not None:
                self.on_event(event)

    def start(self) -> None:
        # The multicast socket is bound before the dump (on a socket of its own), so no change
        # falls between the starting states and the first event.
        sock = open_link_socket(self.netns)
        try:
            dumper = open_link_socket(self.netns, groups=0)
            try:
                dumper.settimeout(DUMP_TIMEOUT)
                tally = SkipTally()
                messages = dump_links(dumper, 1, "rtnetlink", tally)
            finally:
                dumper.close()
        except Exception:
            sock.close()
            raise
        skipped = tally.freeze()
        for reason, count in skipped.counts.items():
            for _ in range(count):
                self._bad(skipped.examples[reason])
        self._deliver(messages)
        self._sock = sock
        self._thread = threading.Thread(target=self._run, name="nodescope-netlink", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            while not self._stop.is_set():
                readable, _, _ = select.select([sock], [], [], 0.25)
                if readable and not self._stop.is_set():
                    data = kernel_datagram(sock)
                    if data is not None:
                        self._deliver(self._decode(data))
        except Exception as exc:  # a broken socket ends the monitor; the source says so
            if not self._stop.is_set():
                log.warning("netns=%s state=stopped error=%r", self.netns, str(exc))
        finally:
            sock.close()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None


class LinkEventsSource:
    """``netlink``: run the rtnetlink monitor (``netns`` as for the ``netdev`` source);
    ``include_virtual``: follow veth and other virtual links too. ``clock`` stamps the
    transitions (monotonic seconds); ``max_links``: links followed at most."""

    name = NAME

    def __init__(
        self,
        netns: str | None = None,
        netlink: bool = True,
        include_virtual: bool = False,
        window_seconds: float = WINDOW_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        max_links: int = MAX_LINKS,
    ) -> None:
        self.netns = netns
        self.netlink = netlink
        self.include_virtual = include_virtual
        self.clock = clock
        self.counter = FlapCounter(window_seconds, max_links)
        self._lock = threading.Lock()
        self._queue: deque[LinkEvent] = deque(maxlen=65536)
        #: link messages the monitor could not parse since the last run, and the latest fault
        self._bad_messages = 0
        self._bad_message_example = ""
        self._monitor: NetlinkMonitor | None = None
        self._failed = False

    def _enqueue(self, event: LinkEvent) -> None:
        with self._lock:
            self._queue.append(event)

    def _bad_message(self, fault: str) -> None:
        with self._lock:
            self._bad_messages += 1
            self._bad_message_example = fault

    def _ensure_monitor(self) -> None:
        if not self.netlink or self._failed:
            return
        if self._monitor is not None and self._monitor.running:
            return
        if self._monitor is not None:
            # It stopped on an error: start afresh (states re-seeded, not counted).
            self._monitor = None
        monitor = NetlinkMonitor(
            self._enqueue,
            self.netns,
            self.include_virtual,
            self.clock,
            on_bad_message=self._bad_message,
        )
        try:
            monitor.start()
        except Exception as exc:
            self._failed = True
            log.warning("netns=%s state=unavailable error=%r", self.netns, str(exc))
            return
        self._monitor = monitor

    def _read_ib(self, roots: Roots, tally: SkipTally) -> None:
        # Plain string paths: a pathlib join per port costs as much as reading the file.
        base = f"{roots.sysfs}/class/infiniband"
        try:
            devices = sorted(os.listdir(base))
        except OSError:
            return
        now = self.clock()
        for device in devices:
            ports_dir = f"{base}/{device}/ports"
            try:
                ports = sorted(os.listdir(ports_dir), key=lambda p: (len(p), p))
            except OSError:
                continue
            for port in ports:
                path = f"{ports_dir}/{port}/state"
                try:
                    data = read_bytes(path, SYSFS_ATTRIBUTE)
                except (NotARegularFile, FileTooLarge):
                    tally.skip(SKIP_FILE_REFUSED, path)
                    continue
                except OSError:
                    continue
                try:
                    state = ib_port_state(data.decode("utf-8", errors="replace"), path)
                except ParseError as exc:
                    # That port keeps its last state; the other ports are followed as usual.
                    tally.skip(SKIP_IB_STATE_UNPARSABLE, str(exc))
                    continue
                self.counter.observe(LinkEvent(f"{device}/{port}", "infiniband", state, now))

    def collect(self, roots: Roots) -> LinkEventsData:
        self._ensure_monitor()
        tally = SkipTally()
        with self._lock:
            events = list(self._queue)
            self._queue.clear()
            for _ in range(self._bad_messages):
                tally.skip(SKIP_MESSAGE_UNPARSABLE, self._bad_message_example)
            self._bad_messages = 0
        for event in events:
            self.counter.observe(event)
        self._read_ib(roots, tally)
        data = self.counter.snapshot(self.clock(), self._monitor is not None)
        return replace(data, skipped=tally.freeze()) if tally else data

    def close(self) -> None:
        monitor, self._monitor = self._monitor, None
        if monitor is not None:
            monitor.stop()


def make_source(options: LinkEventsOptions | None = None) -> LinkEventsSource:
    options = LinkEventsOptions() if options is None else options
    return LinkEventsSource(netns=options.netns or None, include_virtual=options.include_virtual)


SPEC = SourceSpec(
    name="link_events",
    default_interval=1.0,
    help="link up/down transitions from an rtnetlink monitor thread and IB port states; flaps",
    build=lambda inputs: make_source(inputs.link_events),
    settings=LinkEventsOptions,
    rates=None,
    metric_area="nodescope_exporters.event_metrics",
    sim_parts=frozenset({"infiniband"}),
    # The simulated node has no network namespace: its stand-in reads only the IB ports.
    sim_stand_in=True,
)


__all__ = [
    "MAX_LINKS",
    "MAX_RECENT",
    "NAME",
    "SKIP_FILE_REFUSED",
    "SKIP_IB_STATE_UNPARSABLE",
    "SKIP_MESSAGE_UNPARSABLE",
    "VIRTUAL_KINDS",
    "WINDOW_SECONDS",
    "FlapCounter",
    "LinkEvent",
    "LinkEventsData",
    "LinkEventsSource",
    "LinkTransitions",
    "NetlinkMonitor",
    "ib_port_state",
    "link_state",
    "make_source",
    "open_link_socket",
    "parse_link_event",
]
