"""What a source declares about itself, in its own module: :class:`SourceSpec`.

Each source module holds one ``SPEC``; the registry (:mod:`nodescope.sources.registry`) lists
the modules and reads their specs, and the collector, the configuration's
``[sources.<name>]`` tables, the snapshot's rates, the simulated node, the kernel-file tier of
the tests and the bench read the specs instead of keeping lists of their own. Adding a source
touches its model record, its module and its metric area. Specs are read where sources are
built, never per cycle.

:class:`SourceInputs` is what the sources of one collector share, made once where they are
built and handed to each spec's ``build``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nodescope.model.collectives import SpoolSettings
from nodescope.model.job_records import DEFAULT_MAX_REGISTRATIONS, JobsData
from nodescope.model.link_events import LinkEventsOptions
from nodescope.model.netdev import NetdevOptions
from nodescope.options import options_of
from nodescope.sources.base import Source, TopologyGeneration

if TYPE_CHECKING:
    from nodescope.model.derived import Derived
    from nodescope.sources.cgroup import CycleWalk


def _cycle_walk() -> CycleWalk:
    # Imported here: the cgroup parsers load only where a collector is built.
    from nodescope.sources.cgroup import CycleWalk

    return CycleWalk()


class LatestJobs:
    """The ``jobs`` source's latest record, which the ``jobs`` source publishes after each
    run and the ``traces`` source reads (the uid each job's spool directory must have)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: JobsData | None = None

    def publish(self, data: JobsData) -> None:
        with self._lock:
            self._data = data

    def get(self) -> JobsData | None:
        with self._lock:
            return self._data


@dataclass(frozen=True)
class SourceInputs:
    """What the sources of one collector share, made once where they are built and handed to
    each source that needs it, so no source reaches into another:

    * ``topology``: the generation the ``udev`` source's monitor advances on a PCI device
      event and the ``pci`` source watches;
    * ``cgroup_walk``: one walk of the cgroup tree per cycle for the ``cgroups``, ``jobs``,
      ``procs`` and ``threads`` sources; the collector begins each cycle on it.
    * ``jobs``: the ``jobs`` source's latest record, for the ``traces`` source;
    * ``spool``: the ``traces`` source's settings (``[sources.traces]``), None when unset;
    * ``netdev`` and ``link_events``: how those sources read (``[sources.netdev]``,
      ``[sources.link_events]``);
    * ``max_registrations``: the prolog registrations the ``jobs`` source reads at most
      (``[slurm] max_registrations``).
    """

    topology: TopologyGeneration = field(default_factory=TopologyGeneration)
    cgroup_walk: CycleWalk = field(default_factory=_cycle_walk)
    jobs: LatestJobs = field(default_factory=LatestJobs)
    spool: SpoolSettings | None = None
    netdev: NetdevOptions = field(default_factory=NetdevOptions)
    link_events: LinkEventsOptions = field(default_factory=LinkEventsOptions)
    max_registrations: int = DEFAULT_MAX_REGISTRATIONS

    def begin_cycle(self, due: Iterable[str]) -> None:
        """A collection cycle starts in which the sources named ``due`` run."""
        self.cgroup_walk.begin_cycle(due)


#: The parts of the simulated node (``nodescope.sim.node.Part``) a spec may name in
#: ``sim_parts``; the simulator checks that its parts are these.
SIM_PARTS = frozenset(
    {"pci_links", "infiniband", "processes", "cgroups", "proc_files", "nvlink_window"}
)

#: ``reads`` of a source that reads files (of ``/proc``, ``/sys``, ``/dev``, ``/run``): the
#: kernel-file tier of the tests compares such a source over a FUSE mount with the plain tree.
FILES = "files"

#: The package of the metric areas (``nodescope_exporters.prometheus.AREAS``).
METRIC_AREA_PACKAGE = "nodescope_exporters."

_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceSpec:
    """Everything the rest of nodescope needs to know about one source.

    * ``name``: its name in the configuration (``[sources.<name>]``), the metrics' ``source``
      label and the snapshot;
    * ``default_interval``: seconds between two runs unless configured;
    * ``help``: what it reads, one line for the configuration reference;
    * ``build``: makes the source from what the sources of its collector share;
    * ``rates``: its per-second figures as the snapshot's derived figures hold them
      (``None``: it has none);
    * ``metric_area``: the exporter module that renders its records;
    * ``sim_parts``: the parts of the simulated node it reads (``None``: the simulated node
      does not run it; an empty set: what it reads changes at every move);
    * ``settings``: the class that declares the keys of ``[sources.<name>]`` beyond the
      common ones (a frozen dataclass whose fields carry :func:`nodescope.options.option`),
      the one declaration of each key's help, default and check; ``None``: none;
    * ``sim_stand_in``: the simulated node builds its own instance (over the fake NVML, no
      device monitor) instead of calling ``build``;
    * ``reads``: :data:`FILES`, or what it reads instead (a library, a netlink socket);
    * ``due_on_topology_change``: due also in any cycle in which ``SourceInputs.topology``
      moved since its last run (a device event the ``udev`` source reported), not only at
      the end of its interval.

    Every field but the last four must be given: a spec missing one fails when its module
    is imported, not when the daemon first runs the source.
    """

    name: str
    default_interval: float
    help: str
    build: Callable[[SourceInputs], Source]
    rates: Callable[[Derived], object | None] | None
    metric_area: str
    sim_parts: frozenset[str] | None
    settings: type[Any] | None = None
    sim_stand_in: bool = False
    reads: str = FILES
    due_on_topology_change: bool = False

    def __post_init__(self) -> None:
        where = f"source spec {self.name!r}"
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"{where}: the name must be lower-case letters, digits and _")
        if not (math.isfinite(self.default_interval) and self.default_interval > 0):
            raise ValueError(f"{where}: default_interval must be a positive number of seconds")
        if not self.help.strip():
            raise ValueError(f"{where}: help must say what the source reads")
        if not callable(self.build):
            raise TypeError(f"{where}: build must be callable")
        if self.rates is not None and not callable(self.rates):
            raise TypeError(f"{where}: rates must be callable or None")
        area = self.metric_area.removeprefix(METRIC_AREA_PACKAGE)
        if area == self.metric_area or not _NAME.fullmatch(area):
            raise ValueError(f"{where}: metric_area must name a module of {METRIC_AREA_PACKAGE}")
        if self.sim_parts is not None and not self.sim_parts <= SIM_PARTS:
            unknown = ", ".join(sorted(self.sim_parts - SIM_PARTS))
            raise ValueError(f"{where}: sim_parts names no part of the simulated node: {unknown}")
        if self.settings is not None and not (
            dataclasses.is_dataclass(self.settings) and options_of(self.settings)
        ):
            raise TypeError(
                f"{where}: settings must be a dataclass declaring its keys with option()"
            )
        if self.sim_stand_in and self.sim_parts is None:
            raise ValueError(f"{where}: a simulated stand-in must say which parts it reads")
        if not self.reads.strip():
            raise ValueError(f"{where}: reads must say what the source reads")

    def make(self, inputs: SourceInputs | None = None) -> Source:
        """The source, sharing ``inputs`` with the others built with them (its own when not
        given: a source built alone)."""
        source = self.build(SourceInputs() if inputs is None else inputs)
        if source.name != self.name:
            raise RuntimeError(f"the spec {self.name!r} built a source named {source.name!r}")
        return source


__all__ = ["FILES", "SIM_PARTS", "LatestJobs", "SourceInputs", "SourceSpec"]
