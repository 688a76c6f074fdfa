"""What the adversarial tests share: one collection cycle over given sources, the
skipped-records counter as /metrics renders it, and the shipped unit's resource limits applied
to a process through cgroups."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from nodescope.collect import Collector, ScheduledSource
from nodescope.model.snapshot import Snapshot
from nodescope.roots import Roots
from nodescope.sources.base import Source
from nodescope_exporters import self_metrics
from nodescope_exporters.prometheus import render


def one_cycle(roots: Roots, *sources: Source, timeout: float | None = 30.0) -> Snapshot:
    """One cycle of ``sources`` over ``roots``, each under a deadline as the daemon runs them
    (a generous one: a loaded test machine is slow, not stuck)."""
    collector = Collector(
        roots=roots, scheduled=[ScheduledSource(s, 1.0, timeout) for s in sources]
    )
    try:
        return collector.run_cycle()
    finally:
        collector.close()


def skipped_metric(snapshot: Snapshot) -> dict[tuple[str, str], float]:
    """``nodescope_source_records_skipped_total`` as rendered on /metrics, by (source, reason)."""
    text = render(snapshot, [self_metrics.families]).decode()
    found: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "nodescope_source_records_skipped_total":
                found[(sample.labels["source"], sample.labels["reason"])] = sample.value
    return found


UNIT = Path(__file__).resolve().parents[2] / "systemd" / "nodescoped.service"


def unit_limits() -> dict[str, str]:
    """The resource settings of the shipped unit (MemoryMax=, CPUQuota=, LimitNOFILE=)."""
    found = {}
    for line in UNIT.read_text().splitlines():
        name, _, value = line.partition("=")
        if name in ("MemoryMax", "CPUQuota", "LimitNOFILE", "TasksMax"):
            found[name] = value.strip()
    return found


def _bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


@contextlib.contextmanager
def cgroup_v1_limits(pid: int, limits: dict[str, str]) -> Iterator[list[str]]:
    """Put ``pid`` into memory and cpu cgroups (v1, beside this process's own) with the unit's
    MemoryMax= and CPUQuota=; yields what was applied (nothing where it cannot be)."""
    made: list[Path] = []
    applied: list[str] = []
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, where = line.split(":", 2)
        for controller in controllers.split(","):
            own[controller] = where
    wanted = []
    if "MemoryMax" in limits:
        wanted.append(("memory", "memory.limit_in_bytes", str(_bytes(limits["MemoryMax"]))))
    if "CPUQuota" in limits:
        quota = int(float(limits["CPUQuota"].rstrip("%")) * 1000)  # of a 100 ms period
        wanted.append(("cpu", "cpu.cfs_quota_us", str(quota)))
    try:
        for controller, knob, value in wanted:
            base = Path("/sys/fs/cgroup") / controller
            if controller not in own or not (base / "cgroup.procs").exists():
                continue
            group = base / own[controller].lstrip("/") / f"nodescope-limits-{os.getpid()}-{pid}"
            try:
                group.mkdir()
                made.append(group)
                if controller == "cpu":
                    (group / "cpu.cfs_period_us").write_text("100000")
                (group / knob).write_text(value)
                (group / "cgroup.procs").write_text(str(pid))
            except OSError as exc:
                applied.append(f"{knob} not applied: {exc}")
                continue
            applied.append(f"{knob}={value}")
        yield applied
    finally:
        for group in made:
            remove_v1_group(group)


def remove_v1_group(group: Path) -> None:
    """Move what is left in a v1 cgroup back to its parent (or the directory cannot go), then
    remove it, waiting a few seconds for the kernel to let go of it."""
    with contextlib.suppress(OSError):
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (group.parent / "cgroup.procs").write_text(pid)
    for _ in range(50):
        try:
            group.rmdir()
            break
        except OSError:
            time.sleep(0.1)
