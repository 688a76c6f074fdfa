"""The ``probe`` source: the last bandwidth probe's report, as ``nodescope probe --record`` or
the daemon's probe hook (:mod:`nodescope.probe_runner`) left it under the run root. Reading
it is all a source does; running a probe is the hook's.
"""

from __future__ import annotations

from pathlib import Path

from nodescope.model.probe import PROBE, ProbeReport, parse_report
from nodescope.roots import Roots
from nodescope.sources.base import FunctionSource, read_optional
from nodescope.sources.spec import SourceSpec

#: The report file, relative to the run root.
STATE_FILE = Path("nodescope") / "probe-report.json"


def state_path(roots: Roots) -> Path:
    return roots.run / STATE_FILE


def read_last_report(roots: Roots) -> ProbeReport | None:
    """The report of the last probe recorded under the run root; ``None`` before the first."""
    path = state_path(roots)
    text = read_optional(path)
    return None if text is None else parse_report(text, source=str(path))


def make_source() -> FunctionSource:
    return FunctionSource(PROBE.name, read_last_report)


SPEC = SourceSpec(
    name="probe",
    default_interval=30.0,
    help=(
        "the last bandwidth probe's report (nodescope probe --record, or one the daemon ran)"
        " from /run/nodescope/probe-report.json"
    ),
    build=lambda inputs: make_source(),
    rates=None,
    metric_area="nodescope_exporters.probe_metrics",
    sim_parts=None,
)
