"""The path between two devices of a node, in the words of ``nvidia-smi topo -m``, with the
NUMA node at each end: what the probe's asymmetry verdict names for the slow direction of a
GPU pair.

A pair whose two copy directions differ by tens of per cent usually has a path that is not
what the job assumes: a pair without NVLink whose copies cross the SMP interconnect between
sockets (``SYS``) runs each direction through a different socket's root complex and memory
controller, and the two directions then see different loads. The classes are those of
:func:`nodescope.model.topology.affinity` (``docs/datasources.md`` §9): ``NV#`` where NVML
says NVLinks join the pair, else the PCIe relation from the sysfs tree (PIX, PXB, PHB, NODE,
SYS). Pure: a topology, two PCI addresses and optionally NVLink counts in, a record out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from nodescope.model.topology import Relation, Topology, affinity

#: What each PCIe class crosses, for a one-line verdict (the legend of ``nvidia-smi topo -m``
#: shortened; :data:`nodescope.model.topology.RELATION_LEGEND` has it in full).
CROSSES: Mapping[str, str] = {
    Relation.PIX.value: "one PCIe switch",
    Relation.PXB.value: "several PCIe switches, not the host bridge",
    Relation.PHB.value: "a PCIe host bridge (the CPU)",
    Relation.NODE.value: "the interconnect between host bridges of one NUMA node",
    Relation.SYS.value: "the SMP interconnect between NUMA nodes",
}


@dataclass(frozen=True, slots=True)
class PairPath:
    """``path`` between devices ``a`` and ``b`` (PCI addresses): ``NV#`` (``#`` bonded
    NVLinks) or a PCIe class; ``numa_a``/``numa_b`` the NUMA node of each, ``None`` where
    sysfs says none (-1, as in most VMs)."""

    a: str
    b: str
    path: str
    numa_a: int | None
    numa_b: int | None

    @property
    def cross_numa(self) -> bool:
        """Both NUMA nodes known and different."""
        return self.numa_a is not None and self.numa_b is not None and self.numa_a != self.numa_b


def pair_path(
    topology: Topology | None,
    a: str | None,
    b: str | None,
    nvlinks: Mapping[frozenset[str], int] | None = None,
) -> PairPath | None:
    """The path between the functions at ``a`` and ``b``; ``None`` when either address is
    unknown or the tree lacks it (a GPU the probe found that sysfs does not show, a VM whose
    GPUs hang off an emulated bus the reader left out), rather than a guess."""
    if topology is None or a is None or b is None or a == b:
        return None
    da, db = topology.get(a), topology.get(b)
    if da is None or db is None:
        return None
    return PairPath(a, b, affinity(topology, a, b, nvlinks), da.numa_node, db.numa_node)


def nvlink_count(path: str) -> int:
    """``#`` of an ``NV#`` class; 0 for a PCIe class or anything else."""
    digits = path[2:] if path.startswith("NV") else ""
    return int(digits) if digits.isdigit() and len(digits) <= 4 else 0


def describe(path: str) -> str:
    """What a class crosses, in a few words: ``over 18 bonded NVLinks``, ``across the SMP
    interconnect between NUMA nodes``; empty for a class this module does not know."""
    links = nvlink_count(path)
    if links:
        return f"over {links} bonded NVLink{'s' if links > 1 else ''}"
    crosses = CROSSES.get(path)
    return f"across {crosses}" if crosses else ""
