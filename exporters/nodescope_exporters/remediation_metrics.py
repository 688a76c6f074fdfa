"""Metrics of what nodescope did about findings (source ``remediation``).

The counts are those of the record ``nodescope slurm health`` keeps
(``<run>/nodescope/remediation.json``, :mod:`nodescope.model.remediation`): each action once,
counted per action and finding kind since the record was made, so the counter survives
restarts of the daemon and of the health check. Labels stay bounded: ``action`` is one of
drain, drain_requeue, resume, held and alert, ``kind`` a finding kind (or ``gate_<check>``),
and the record keeps at most 512 pairs.
"""

from __future__ import annotations

from collections.abc import Iterator

from nodescope.model.remediation import REMEDIATION
from nodescope.model.snapshot import Snapshot
from nodescope_exporters.catalog import Metric, metric

AREA = "remediation"
INPUTS = (REMEDIATION,)

ACTIONS = metric(
    "nodescope_remediation_actions_total",
    "counter",
    "actions nodescope took on this node about a finding, by action (drain, drain_requeue,"
    " resume, held: a drain the cool-down or the partition guard kept back, alert: left to"
    " people) and finding kind; each action counted once",
    ("action", "kind"),
    area=AREA,
)
RECORD_OK = metric(
    "nodescope_remediation_record_readable",
    "gauge",
    "1 when the record of remediation actions could be read (or does not exist yet), 0 when"
    " it could not (the counts then restart when it is written again)",
    area=AREA,
)


def families(snapshot: Snapshot) -> Iterator[Metric]:
    data = snapshot.latest(REMEDIATION)
    if data is None:
        return
    actions = ACTIONS.family()
    for count in data.counts:
        actions.add_metric([count.action, count.kind], count.count)
    readable = RECORD_OK.family()
    readable.add_metric([], 0 if data.problem else 1)
    yield from (actions, readable)
