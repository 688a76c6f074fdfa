"""What the adversarial tests share: one collection cycle over given sources, and the
skipped-records counter as /metrics renders it."""

from __future__ import annotations

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
