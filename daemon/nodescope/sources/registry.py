"""The sources the daemon runs: the modules that declare them, in the order a cycle runs
them, and their specs (:class:`~nodescope.sources.spec.SourceSpec`) read from those modules.

Each module named here holds a ``SPEC``; nothing else about a source is listed here. A module
without one, or two modules declaring one name, fail when this module is imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from nodescope.sources.spec import LatestJobs, SourceInputs, SourceSpec

#: The modules that declare a source, in the order a cycle runs their sources.
SOURCE_MODULES: tuple[str, ...] = (
    "nodescope.sources.pci",
    "nodescope.sources.diskstats",
    "nodescope.sources.infiniband",
    "nodescope.sources.netlink",
    "nodescope.sources.cgroup",
    "nodescope.sources.procs",
    "nodescope.sources.jobs",
    "nodescope.sources.nvml",
    "nodescope.sources.sxid",
    "nodescope.sources.nvlink_kmod",
    "nodescope.sources.probe_report",
    "nodescope.sources.locks",
    "nodescope.sources.threads",
    "nodescope.sources.mountstats",
    "nodescope.sources.pressure",
    "nodescope.sources.udev",
    "nodescope.sources.link_events",
    "nodescope.sources.remediation",
    # After ``jobs``: a cycle that runs both reads the jobs of this cycle.
    "nodescope.sources.traces",
)


def load_specs(modules: Iterable[str]) -> tuple[SourceSpec, ...]:
    """The ``SPEC`` of each module, in order; a module without one, or a name declared twice,
    is an error here, where the daemon starts."""
    specs: list[SourceSpec] = []
    seen: dict[str, str] = {}
    for name in modules:
        spec = getattr(importlib.import_module(name), "SPEC", None)
        if not isinstance(spec, SourceSpec):
            raise TypeError(f"{name} declares no source: it has no SPEC = SourceSpec(...)")
        if spec.name in seen:
            raise ValueError(f"{name} and {seen[spec.name]} both declare source {spec.name!r}")
        seen[spec.name] = name
        specs.append(spec)
    return tuple(specs)


SOURCE_TABLE: tuple[SourceSpec, ...] = load_specs(SOURCE_MODULES)

SOURCES: dict[str, SourceSpec] = {spec.name: spec for spec in SOURCE_TABLE}


def simulated_specs() -> tuple[SourceSpec, ...]:
    """The specs of the sources the simulated node runs (``sim_parts`` declared), in the
    registry's order; those declared ``sim_stand_in`` the simulator builds itself."""
    return tuple(spec for spec in SOURCE_TABLE if spec.sim_parts is not None)


__all__ = [
    "SOURCES",
    "SOURCE_MODULES",
    "SOURCE_TABLE",
    "LatestJobs",
    "SourceInputs",
    "load_specs",
    "simulated_specs",
]
