"""Findings: what a detector concluded from one snapshot, with the numbers that show it.

A finding is a value, not an event: detectors are pure functions that return the findings that
hold *now*; the alert engine turns their presence over time into alerts (``for`` durations,
hysteresis, resolution). A finding's ``key`` is its stable identity across cycles — the same
condition on the same subjects yields the same key — so the engine can follow it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

#: Evidence names of the value-hysteresis convention: a detector that reports a level puts the
#: measured ``value`` and the raise ``threshold`` in the evidence; the alert engine raises at
#: ``value >= threshold`` and keeps a firing alert while ``value`` stays above the rule's
#: ``clear_below`` (see nodescope.alerts).
VALUE = "value"
THRESHOLD = "threshold"


class Severity(enum.IntEnum):
    """Ordered: a higher value is worse."""

    INFO = 0
    WARNING = 1
    CRITICAL = 2

    @property
    def label(self) -> str:
        return self.name.lower()


def _frozen_mapping(m: Mapping[str, object]) -> Mapping[str, object]:
    return MappingProxyType(dict(sorted(m.items())))


@dataclass(frozen=True, slots=True)
class Finding:
    """One condition a detector found.

    ``kind``: a short snake_case name (``pcie_contention``, ``nvlink_stall``, …).
    ``subjects``: role → name of what the finding is about (``link`` → a BDF, ``gpu`` → an
    index, ``job`` → a job id); these make the identity.
    ``evidence``: name → number (units in the name: ``utilisation_ratio``, ``rx_bytes_per_second``).
    ``message``: one line an operator can act on, naming devices, links and jobs.
    """

    kind: str
    severity: Severity
    subjects: Mapping[str, str] = field(default_factory=dict)
    evidence: Mapping[str, float] = field(default_factory=dict)
    message: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "subjects", _frozen_mapping(self.subjects))
        object.__setattr__(self, "evidence", _frozen_mapping(self.evidence))

    @property
    def key(self) -> str:
        """Stable identity: the kind and the subjects, never the numbers or the severity."""
        parts = ",".join(f"{role}={name}" for role, name in self.subjects.items())
        return f"{self.kind}{{{parts}}}"
