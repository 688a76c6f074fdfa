"""The node's pressure stall information: ``/proc/pressure/{cpu,memory,io}``.

PSI (``Documentation/accounting/psi.rst``) says how much wall time tasks lost waiting for a
resource: ``some`` while at least one runnable task waited, ``full`` while every non-idle task
waited at once (the node did no useful work on that resource). The record keeps each file's
lines as the cgroup source keeps a cgroup's (:class:`~nodescope.model.cgroup.Pressure`), for
the whole node.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from nodescope.model.cgroup import Pressure
from nodescope.model.finding import Finding
from nodescope.model.skips import NOTHING_SKIPPED, Skipped
from nodescope.model.source_key import SourceKey

#: The resources the kernel reports at ``/proc/pressure/<resource>``, in the order read.
RESOURCES = ("cpu", "memory", "io")


@dataclass(frozen=True, slots=True)
class NodePressure:
    """One read of ``/proc/pressure``. A resource is ``None`` when its file is absent: a
    kernel built without ``CONFIG_PSI`` or booted with ``psi=0`` has no ``/proc/pressure``,
    which is a fact about the node, not a failed read. ``cpu.full`` is all zero at the node
    level (the kernel defines it only for cgroups)."""

    cpu: Pressure | None
    memory: Pressure | None
    io: Pressure | None
    skipped: Skipped = field(default=NOTHING_SKIPPED, compare=False)

    @property
    def available(self) -> bool:
        """Whether the kernel reports pressure at all (any of the files was there)."""
        return self.cpu is not None or self.memory is not None or self.io is not None

    def of(self, resource: str) -> Pressure | None:
        """The pressure of ``resource`` (one of :data:`RESOURCES`)."""
        if resource == "cpu":
            return self.cpu
        if resource == "memory":
            return self.memory
        if resource == "io":
            return self.io
        raise ValueError(f"no pressure file for {resource!r}")


def full_stall_ratio(
    pair: tuple[NodePressure, NodePressure, float] | None, resource: str
) -> float | None:
    """The share of the seconds between two reads in which every non-idle task of the node
    stalled on ``resource`` at once (``full``), from the cumulative totals; ``None`` without
    two reads of a ``full`` line, or when the total went back (a counter does not)."""
    if pair is None:
        return None
    before, now, seconds = pair
    old, new = before.of(resource), now.of(resource)
    if old is None or new is None or old.full is None or new.full is None or seconds <= 0:
        return None
    stalled = new.full.total_usec - old.full.total_usec
    if stalled < 0:
        return None
    return min(1.0, stalled / 1e6 / seconds)


def with_node_stall(
    findings: list[Finding], kind: str, key: str, ratio: float | None
) -> list[Finding]:
    """``findings``, those of ``kind`` with the node's stall ``ratio`` added to their evidence
    as ``key``: what the whole node lost to the same resource while the finding held. The
    list itself when there is nothing to add (the usual cycle: no finding)."""
    if ratio is None or not any(f.kind == kind for f in findings):
        return findings
    return [
        replace(f, evidence={**f.evidence, key: ratio}) if f.kind == kind else f for f in findings
    ]


PRESSURE = SourceKey("pressure", NodePressure)

__all__ = ["PRESSURE", "RESOURCES", "NodePressure", "full_stall_ratio", "with_node_stall"]
