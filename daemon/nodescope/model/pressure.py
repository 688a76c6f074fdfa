"""The node's pressure stall information: ``/proc/pressure/{cpu,memory,io}``.

PSI (``Documentation/accounting/psi.rst``) says how much wall time tasks lost waiting for a
resource: ``some`` while at least one runnable task waited, ``full`` while every non-idle task
waited at once (the node did no useful work on that resource). The record keeps each file's
lines as the cgroup source keeps a cgroup's (:class:`~nodescope.model.cgroup.Pressure`), for
the whole node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nodescope.model.cgroup import Pressure
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


PRESSURE = SourceKey("pressure", NodePressure)

__all__ = ["PRESSURE", "RESOURCES", "NodePressure"]
