"""The daemon's clock rules, derived from ``[daemon] tick_seconds`` in one place.

Every figure that follows from the tick is made here and nowhere else: the loop's sleep, how
late a cycle may be before the watchdog stops being fed and ``/healthz`` answers 503 (the
staleness bound), how recently a request must have come for the documents to be rendered as
each cycle ends, and the interval of a source that has no settings of its own.

The daemon makes one :class:`Timing` at start and one per reload and hands it to every part
that keeps time, the serving process included: the staleness bound travels with each cycle's
documents (:data:`nodescope.serving.PUBLISH`, :data:`nodescope.serving.OUTDATED`), so after a
reload the serving process judges the next cycle by the tick that cycle ran on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nodescope.config import Config, SourceSettings

#: Seconds a cycle may be late beyond its tick before the daemon counts as stalled (the
#: watchdog stops being fed, ``/healthz`` answers 503): a slow source or a loaded machine can
#: hold one cycle for seconds without anything being wrong.
CYCLE_GRACE = 10.0
#: With rendering on demand, documents are rendered as each cycle ends while requests came
#: within this many ticks.
RENDER_EVERY_CYCLE_TICKS = 1.5


@dataclass(frozen=True, slots=True)
class Timing:
    """What follows from one tick. Made by :meth:`of_tick` (or :meth:`of` a configuration);
    the fields are plain values so that a cycle reads them without computing anything."""

    tick_seconds: float
    #: Seconds without a completed cycle after which the daemon is unhealthy: the tick, and
    #: a grace of at least :data:`CYCLE_GRACE`, or a whole tick when that is longer.
    stale_after: float
    #: Seconds within which a request must have come for a cycle's documents to be rendered
    #: as it ends (a scraper every tick then never waits for a render).
    render_window: float

    @classmethod
    def of_tick(cls, tick_seconds: float) -> Timing:
        return cls(
            tick_seconds=tick_seconds,
            stale_after=tick_seconds + max(tick_seconds, CYCLE_GRACE),
            render_window=RENDER_EVERY_CYCLE_TICKS * tick_seconds,
        )

    @classmethod
    def of(cls, config: Config) -> Timing:
        return cls.of_tick(config.tick_seconds)

    def sleep_seconds(self, watchdog_seconds: float | None) -> float:
        """Longest the loop may sleep: a tick, and at most half the watchdog's period so
        that it is fed in time."""
        if watchdog_seconds:
            return min(self.tick_seconds, watchdog_seconds / 2)
        return self.tick_seconds

    def source_interval(self, settings: SourceSettings | None) -> float:
        """Seconds between two runs of a source: its configured interval; a source without
        settings runs every tick."""
        return settings.interval_seconds if settings is not None else self.tick_seconds
