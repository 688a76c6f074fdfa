"""The record of what nodescope did about findings, read back by the daemon.

Reads ``<run>/nodescope/remediation.json``, which ``nodescope slurm health`` writes (format and
bounds: :mod:`nodescope.remediation.state`). The health check runs as Slurm's
HealthCheckProgram, outside the daemon; a file both can reach keeps the daemon out of the
path of a drain (a daemon that is down or restarting loses no action) and costs one ``stat``
per run while nothing changes: the file is parsed again only when its inode, size or
modification time moved. No record yet is no action, not an error; a record that cannot be
read says why in ``problem`` and counts nothing.
"""

from __future__ import annotations

import os

from nodescope.model.remediation import (
    REMEDIATION,
    ActionCount,
    RemediationAction,
    RemediationData,
)
from nodescope.remediation.state import Record, read_record, state_path
from nodescope.roots import Roots
from nodescope.sources.spec import SourceSpec

NAME = REMEDIATION.name
#: Actions kept for the alerts document: the latest of the record.
RECENT = 50


def to_data(record: Record) -> RemediationData:
    return RemediationData(
        counts=tuple(ActionCount(a, k, n) for (a, k), n in sorted(record.counts.items())),
        recent=tuple(
            RemediationAction(
                time=e.time,
                node=e.node,
                action=e.action,
                kind=e.kind,
                subject=e.subject,
                key=e.key,
                message=e.message,
                reason=e.reason,
                why=e.why,
                source=e.source,
                ok=e.ok,
                error=e.error,
            )
            for e in record.entries[-RECENT:]
        ),
        problem=record.problem,
    )


class RemediationSource:
    """Reads the record when it changed (``name`` ``remediation``)."""

    name = NAME

    def __init__(self) -> None:
        self._seen: tuple[int, int, int, int] | None = None
        self._data = RemediationData()

    def collect(self, roots: Roots) -> RemediationData:
        path = state_path(roots)
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            self._seen, self._data = None, RemediationData()
            return self._data
        except OSError as exc:
            return RemediationData(problem=f"{path}: {exc.strerror or exc}")
        seen = (info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
        if seen != self._seen:
            self._data = to_data(read_record(roots))
            self._seen = seen
        return self._data

    def close(self) -> None:
        self._seen = None


def make_source() -> RemediationSource:
    return RemediationSource()


SPEC = SourceSpec(
    name="remediation",
    default_interval=5.0,
    help="drains, resumes and held drains nodescope recorded (<run>/nodescope/remediation.json)",
    build=lambda inputs: make_source(),
    rates=None,
    metric_area="nodescope_exporters.remediation_metrics",
    sim_parts=None,
)
