"""The derived stage of the cycle: each snapshot's figures, reusing the last cycle's.

Every snapshot carries its :class:`~nodescope.model.derived.Derived` figures (rates, the PCIe
attribution, the job registry), computed on first use. The composition root owns one
:class:`DerivedStage` per stream of snapshots (the daemon's cycles, one replay) and passes
each new snapshot through it before the detectors run; the stage hands the new snapshot's
figures those of the snapshot before, so a figure whose inputs did not change is not
computed again. That is the only memory across cycles, and it is this object's.
"""

from __future__ import annotations

from dataclasses import replace

from nodescope.model.derived import Derived
from nodescope.model.snapshot import Snapshot


class DerivedStage:
    """Makes each snapshot's figures, carrying over those of the snapshot before."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: Derived | None = None

    def derive(self, snapshot: Snapshot) -> Snapshot:
        """``snapshot`` with figures that reuse the last snapshot's where their inputs are the
        same objects. Call it once per cycle, after the readers of the last cycle are done."""
        carried = self._last.hand_on() if self._last is not None else {}
        figures = Derived(snapshot.current, snapshot.previous, carried)
        self._last = figures
        return replace(snapshot, figures=figures)
