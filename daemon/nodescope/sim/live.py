"""The simulated node in wall time, read the way a real node is: counters hold the value of
the moment they are read.

A real counter moves continuously; a reader that reads it twice, ``s`` seconds apart, sees
rate × ``s`` whenever it reads. A node advanced once per tick would instead hold a step
function: a daemon whose reads drift against the ticks (a loaded machine delays a cycle by a
fraction of a second) would see 0, 1 or 2 ticks' worth of traffic between two reads one
second apart, half or twice the true rate, and a finding would come and go with the jitter.

:class:`WallClockNode` makes simulated time the wall time since it was created and moves the
node to the present just before each of the daemon's sources reads
(:class:`ReadTimeSource`): only the parts of the trees that source reads are written
(:data:`nodescope.sim.node.PARTS_READ_BY`), so a read costs what it reads, and the
nvlink_counter module's window is taken only by its own reader, as the module keeps one
window per open file. The present is taken when the source is called, right after the
collector stamped the sample, so the value and the sample's time agree to within the call.
A background refresh (:meth:`WallClockNode.refresh` with no reader, once per scenario tick)
keeps the files fresh for anyone else looking at the tree and fires the timeline's events.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from nodescope.roots import Roots
from nodescope.sources.base import Source
from nodescope.sources.registry import SourceInputs


class RefreshableNode(Protocol):
    """What :class:`WallClockNode` needs of a simulated node."""

    def refresh(self, t: float, reader: str | None = None) -> None: ...

    def sources(self, inputs: SourceInputs | None = None) -> list[Source]: ...


class WallClockNode:
    """A simulated node whose second ``t`` is the wall time since this object was made.

    Thread-safe: the collector thread (through :class:`ReadTimeSource`) and a background
    thread refresh it; one refresh at a time, and time never goes backwards.
    """

    def __init__(self, node: RefreshableNode, clock: Callable[[], float] = time.monotonic) -> None:
        self.node = node
        self._clock = clock
        self._origin = clock()
        self._lock = threading.Lock()
        #: the simulated second the node was last moved to
        self.t = 0.0

    def present(self) -> float:
        """The simulated second of this moment."""
        return max(0.0, self._clock() - self._origin)

    def refresh(self, reader: str | None = None) -> float:
        """Move the node to the present and write what ``reader`` reads (``None``: every
        file); returns the second moved to.

        The present is taken before waiting for a refresh in progress on another thread; if
        that one moved further, this one moves to its second: the node never goes back, and
        the value read is at most that wait late.
        """
        wanted = self.present()
        with self._lock:
            t = max(self.t, wanted)
            self.node.refresh(t, reader)
            self.t = t
            return t

    def sources(self, inputs: SourceInputs | None = None) -> list[Source]:
        """The node's sources at their production cadence, each refreshing what it reads
        just before it reads it; ``inputs``: what they share, for their collector."""
        return [ReadTimeSource(source, self.refresh) for source in self.node.sources(inputs=inputs)]


class ReadTimeSource:
    """A source of the simulated node that moves the node to the present before it reads:
    ``refresh(name)`` writes what the source named ``name`` reads, at the present of whoever
    drives the node (the wall clock's in a demo, the simulated cycle's in a replay)."""

    def __init__(self, source: Source, refresh: Callable[[str], object]) -> None:
        self.source = source
        self.name = source.name
        self._refresh = refresh

    def collect(self, roots: Roots) -> Any:
        self._refresh(self.name)
        return self.source.collect(roots)

    def close(self) -> None:
        self.source.close()


__all__ = ["ReadTimeSource", "RefreshableNode", "WallClockNode"]
