"""Metrics of the analysis step: findings, alerts, their transitions, detectors and the push.

Read from the snapshot's ``findings``, ``alerts`` and ``alert_counters`` (filled by
``nodescope.analysis``). Labels stay bounded: ``kind`` is the detectors' fixed set,
``severity`` and ``state`` are enums, and ``subject`` is the finding key's subject part with
the hardware roles only (links, devices, GPUs, ports: bounded by the node). Workload roles
(job, pid, …) churn with every job, so they are left out of the label; the alerts with the
same labels are counted in one series, and the full identity is in ``nodescope alerts``, the
log and the Alertmanager push. Jobs join through the job info metrics.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping

from nodescope.model.snapshot import Snapshot
from nodescope_exporters.catalog import Metric, metric

AREA = "alerts"

#: Subject roles that name workloads, not hardware: left out of the ``subject`` label.
WORKLOAD_ROLES = frozenset({"job", "step", "pid", "tid", "process", "cgroup", "uid", "user"})

ALERT_ACTIVE = metric(
    "nodescope_alert_active",
    "gauge",
    "Alerts of the daemon's alert engine that are pending or firing, by finding kind, severity,"
    " state and hardware subject (role=name,... of the finding key, workload roles left out).",
    ("kind", "severity", "state", "subject"),
    area=AREA,
)
ALERT_TRANSITIONS = metric(
    "nodescope_alert_transitions_total",
    "counter",
    "Alert transitions since the daemon started, by finding kind and the state or change it"
    " went to (pending, firing, resolved, cancelled, escalated, deescalated).",
    ("kind", "to"),
    area=AREA,
)
FINDINGS = metric(
    "nodescope_findings",
    "gauge",
    "Findings of the last cycle by kind and severity (those that raise, and those that keep a"
    " firing alert firing).",
    ("kind", "severity"),
    area=AREA,
)
DETECTOR_ERRORS = metric(
    "nodescope_detector_errors_total",
    "counter",
    "Runs of the detector that raised; its findings were lost for those cycles.",
    ("detector",),
    area=AREA,
)
PUSH_SENT = metric(
    "nodescope_alert_push_sent_total",
    "counter",
    "Batches of alerts Alertmanager accepted (only when alerts.alertmanager_url is set).",
    area=AREA,
)
PUSH_ERRORS = metric(
    "nodescope_alert_push_errors_total",
    "counter",
    "Pushes to Alertmanager that failed (connection, timeout or an HTTP error status).",
    area=AREA,
)
PUSH_DROPPED = metric(
    "nodescope_alert_push_superseded_total",
    "counter",
    "Batches replaced by a newer one before they were sent (the newer holds all they did).",
    area=AREA,
)


def bounded_subject(subjects: Mapping[str, str]) -> str:
    """The hardware part of a finding's subjects, ``role=name,...`` sorted by role: the
    ``subject`` label of ``nodescope_alert_active`` and of the alerts pushed to Alertmanager,
    so an inhibit rule can match the two paths' copies of one alert by it."""
    return ",".join(
        f"{role}={name}" for role, name in sorted(subjects.items()) if role not in WORKLOAD_ROLES
    )


def workload_subject(subjects: Mapping[str, str]) -> str:
    """The workload part of a finding's subjects (``job=81780``), the complement of
    :func:`bounded_subject`: empty for a finding about hardware alone."""
    return ",".join(
        f"{role}={name}" for role, name in sorted(subjects.items()) if role in WORKLOAD_ROLES
    )


def families(snapshot: Snapshot) -> Iterator[Metric]:
    active: Counter[tuple[str, str, str, str]] = Counter(
        (a.kind, a.severity.label, a.state.value, bounded_subject(a.subjects))
        for a in snapshot.alerts
    )
    family = ALERT_ACTIVE.family()
    for labels in sorted(active):
        family.add_metric(list(labels), active[labels])
    yield family

    found: Counter[tuple[str, str]] = Counter((f.kind, f.severity.label) for f in snapshot.findings)
    family = FINDINGS.family()
    for kind_severity in sorted(found):
        family.add_metric(list(kind_severity), found[kind_severity])
    yield family

    counters = snapshot.alert_counters
    if counters is None:
        return
    family = ALERT_TRANSITIONS.family()
    for (kind, to), count in sorted(counters.transitions.items()):
        family.add_metric([kind, to], count)
    yield family
    family = DETECTOR_ERRORS.family()
    for name, count in sorted(counters.detector_errors.items()):
        family.add_metric([name], count)
    yield family
    for spec, value in (
        (PUSH_SENT, counters.push_sent),
        (PUSH_ERRORS, counters.push_errors),
        (PUSH_DROPPED, counters.push_dropped),
    ):
        if value is not None:
            family = spec.family()
            family.add_metric([], value)
            yield family
