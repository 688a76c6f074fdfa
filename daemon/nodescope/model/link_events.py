"""The records of the ``link_events`` source: per network interface and InfiniBand port,
its latest state and how often it went up and down.

``sources/link_events.py`` follows the links (an rtnetlink monitor for interfaces, the
``state`` file of each InfiniBand port) and counts the transitions since it started and
those within its window, the flap detector's input.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nodescope.model.netdev import netns_option
from nodescope.model.skips import NOTHING_SKIPPED, Skipped
from nodescope.model.source_key import SourceKey
from nodescope.options import option


@dataclass(frozen=True, slots=True)
class LinkEventsOptions:
    """How the ``link_events`` source follows links: the keys of ``[sources.link_events]``
    beyond the common ones, declared here once. The network namespace of its rtnetlink
    monitor, as for :class:`~nodescope.model.netdev.NetdevOptions` (empty: the daemon's own),
    and whether virtual links (veth, bridges, tunnels: what containers and VMs make and drop)
    are followed too."""

    netns: str = netns_option()
    include_virtual: bool = option(
        False,
        "follow virtual links too (veth, bridges, tunnels), whose transitions are mostly"
        " containers and VMs starting and stopping",
    )


@dataclass(frozen=True, slots=True)
class LinkTransitions:
    """One link: its latest state, transitions since start, and those in the window."""

    interface: str
    kind: str
    state: str
    up_total: int
    down_total: int
    recent: int


@dataclass(frozen=True, slots=True)
class LinkEventsData:
    links: tuple[LinkTransitions, ...]
    window_seconds: float
    monitor: bool
    untracked: int
    #: link messages and port states of this run left out as malformed or refused
    skipped: Skipped = field(default=NOTHING_SKIPPED, compare=False)

    def link(self, interface: str) -> LinkTransitions | None:
        for link in self.links:
            if link.interface == interface:
                return link
        return None


#: The ``link_events`` source's records: link transitions and flap counts.
LINK_EVENTS = SourceKey("link_events", LinkEventsData)
