"""Filesystem roots every source reads through.

Like node_exporter's ``--path.sysfs``/``--path.procfs``: a fixture tree or the simulated node
is just another set of roots, so no source ever names ``/sys`` or ``/proc`` itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from pathlib import Path

ROOT_NAMES = ("sysfs", "procfs", "dev", "cgroupfs", "run")


@dataclass(frozen=True, slots=True)
class Roots:
    sysfs: Path = Path("/sys")
    procfs: Path = Path("/proc")
    dev: Path = Path("/dev")
    cgroupfs: Path = Path("/sys/fs/cgroup")
    run: Path = Path("/run")

    def with_overrides(self, **paths: str | os.PathLike[str] | None) -> Roots:
        """A copy with the given roots replaced; ``None`` values are ignored."""
        changes = {name: Path(value) for name, value in paths.items() if value is not None}
        unknown = set(changes) - set(ROOT_NAMES)
        if unknown:
            raise ValueError(f"unknown filesystem root(s): {', '.join(sorted(unknown))}")
        return replace(self, **changes)

    def as_dict(self) -> dict[str, str]:
        return {f.name: str(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def under(cls, base: str | os.PathLike[str]) -> Roots:
        """Roots of a whole tree laid out like a real host (``base/sys``, ``base/proc``, …)."""
        b = Path(base)
        return cls(
            sysfs=b / "sys",
            procfs=b / "proc",
            dev=b / "dev",
            cgroupfs=b / "sys" / "fs" / "cgroup",
            run=b / "run",
        )
