"""Alerts: a finding followed over time by the alert engine (``nodescope.alerts``).

An alert's identity is its finding's ``key`` (kind and subjects), so the same condition on the
same devices is one alert however many cycles it lasts and whatever its numbers or severity
do meanwhile. Times are kept twice: CLOCK_MONOTONIC seconds for durations (``for``,
resolution) and Unix seconds for people and for Alertmanager.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from nodescope.model.finding import Severity


class AlertState(enum.Enum):
    """``pending``: the finding holds but not yet for ``for`` seconds. ``firing``: it has.
    ``resolved``: a firing alert whose finding has been gone for ``resolve_after`` seconds."""

    PENDING = "pending"
    FIRING = "firing"
    RESOLVED = "resolved"


class TransitionKind(enum.Enum):
    """What happened to an alert in one cycle; the ``to`` label of the transition counter.

    ``cancelled`` ends a pending alert whose finding went away before ``for`` elapsed: it
    never fired, so it is never reported as resolved.
    """

    PENDING = "pending"
    FIRING = "firing"
    RESOLVED = "resolved"
    CANCELLED = "cancelled"
    ESCALATED = "escalated"
    DEESCALATED = "deescalated"


def _frozen(m: Mapping[str, float]) -> Mapping[str, float]:
    return MappingProxyType(dict(sorted(m.items())))


#: 64-bit FNV-1a (Fowler, Noll, Vo): offset basis and prime.
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_U64 = (1 << 64) - 1


def fingerprint(key: str) -> str:
    """A short stable id of an identity, the same in every process and across restarts: the
    64-bit FNV-1a hash of the key's UTF-8 bytes as 16 hex digits.

    An id for people and documents, not the alert's identity (its key is): two keys made to
    share an id stay two alerts. Not hashlib, which loads OpenSSL's libcrypto (3.6 MiB of the
    daemon's resident memory) for this one use.
    """
    h = _FNV_OFFSET
    for byte in key.encode():
        h = ((h ^ byte) * _FNV_PRIME) & _U64
    return f"{h:016x}"


@dataclass(frozen=True, slots=True)
class Alert:
    """One alert as it stands after a cycle.

    ``evidence_start`` is the evidence of the cycle the alert started in, ``evidence_last``
    that of the last cycle its finding held, ``evidence_peak`` the largest value of each
    evidence number over the alert's life. ``severity`` is the current severity and
    ``peak_severity`` the worst one seen.
    """

    key: str
    kind: str
    severity: Severity
    state: AlertState
    subjects: Mapping[str, str] = field(default_factory=dict)
    message: str = ""
    evidence_start: Mapping[str, float] = field(default_factory=dict)
    evidence_last: Mapping[str, float] = field(default_factory=dict)
    evidence_peak: Mapping[str, float] = field(default_factory=dict)
    peak_severity: Severity = Severity.INFO
    started_monotonic: float = 0.0
    started_wall: float = 0.0
    last_seen_monotonic: float = 0.0
    last_seen_wall: float = 0.0
    fired_monotonic: float | None = None
    fired_wall: float | None = None
    resolved_monotonic: float | None = None
    resolved_wall: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "subjects", MappingProxyType(dict(sorted(self.subjects.items()))))
        for name in ("evidence_start", "evidence_last", "evidence_peak"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.key)

    @property
    def subject(self) -> str:
        """The subject part of the key: ``role=name,…`` (empty for a node-wide finding)."""
        return ",".join(f"{role}={name}" for role, name in self.subjects.items())


@dataclass(frozen=True, slots=True)
class Transition:
    """One change of one alert, reported once, in the cycle it happened.

    ``alert`` is the alert after the change (for ``resolved`` and ``cancelled``, its last
    state, with ``state`` resolved and the resolution times set for ``resolved``).
    """

    kind: TransitionKind
    alert: Alert
    monotonic: float
    wall: float
    previous_severity: Severity | None = None

    @property
    def key(self) -> str:
        return self.alert.key


@dataclass(frozen=True, slots=True)
class AlertCounters:
    """Cumulative counts for self-metrics, carried by the snapshot to the exporter.

    ``transitions``: (finding kind, transition) → count. ``detector_errors``: detector →
    runs that raised. The push figures are ``None`` when no Alertmanager is configured.
    """

    transitions: Mapping[tuple[str, str], int] = field(default_factory=dict)
    detector_errors: Mapping[str, int] = field(default_factory=dict)
    push_sent: int | None = None
    push_errors: int | None = None
    push_dropped: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "transitions", MappingProxyType(dict(sorted(self.transitions.items())))
        )
        object.__setattr__(
            self, "detector_errors", MappingProxyType(dict(sorted(self.detector_errors.items())))
        )
