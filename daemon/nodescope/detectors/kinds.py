"""The finding-kind spec: everything about a kind that is not its detector's code.

Each detector module declares a :class:`FindingKind` for every kind it emits, beside the code
that emits it: its name, the severities it raises, the remediation action of each severity,
its built-in alert rule, whether a job report lists it as node-wide contention, and the words
the README's finding tables show. The registry (:mod:`nodescope.detectors.registry`) gathers
them; everything else that names kinds is made from them:

* the alert engine's built-in rules (:data:`nodescope.detectors.registry.ALERT_RULES`);
* the README's finding tables and the generated blocks of
  :mod:`nodescope.remediation.policy` (the kinds whose action differs from the severity
  defaults) and :mod:`nodescope.hooks.tracker` (the contention kinds), written by
  ``python -m nodescope.docgen`` (:func:`render_tables`, :func:`code_sections`) and checked by
  the test suite, so those modules need not import the detectors;
* the check that ``exporters/prometheus/alerts.yml`` turns every warning and critical kind
  into an alert (or the spec says why not).

Specs are read when the registry is built, never per cycle.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from nodescope.alerts import AlertRule
from nodescope.model.finding import Severity

#: The remediation actions a spec may name (``[remediation]``'s values).
ACTIONS = ("none", "alert", "drain", "drain_requeue")

#: The action of each severity when neither a kind's spec nor the configuration says other
#: (the ``[remediation]`` defaults as shipped). A spec states its action for every severity
#: anyway: an action equal to this one follows the operator's ``[remediation]`` setting of the
#: severity, any other is the kind's own built-in rule.
SEVERITY_DEFAULTS: Mapping[Severity, str] = MappingProxyType(
    {Severity.CRITICAL: "drain", Severity.WARNING: "alert", Severity.INFO: "none"}
)

_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")


@dataclass(frozen=True, slots=True)
class FindingKind:
    """One finding kind.

    ``severities``: every severity the detector can give it. ``remediation``: the action for
    each of them (one of :data:`ACTIONS`), stated explicitly so that a critical kind's drain
    is a choice its author saw. ``alert``: its built-in alert rule (``None``: the ``[alerts]``
    defaults). ``contention``: node-wide contention of a shared path, which a job report lists
    whatever subjects it names. ``not_alerted``: why ``alerts.yml`` turns no warning or
    critical finding of it into an alert (empty: it does). ``meaning``: what the finding says,
    in one line. ``signal`` and ``hardware``: what it reads and whether that exists on real
    hardware today (kinds with the same two share a README row)."""

    name: str
    severities: frozenset[Severity]
    remediation: Mapping[Severity, str]
    meaning: str
    signal: str
    hardware: str
    alert: AlertRule | None = None
    contention: bool = False
    not_alerted: str = ""
    #: the action of each severity as the policy needs it: only those that differ from
    #: :data:`SEVERITY_DEFAULTS`
    exceptions: Mapping[Severity, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"finding kind {self.name!r}: a snake_case name")
        if not self.severities:
            raise ValueError(f"finding kind {self.name!r}: raises no severity")
        missing = sorted(s.label for s in self.severities if s not in self.remediation)
        if missing:
            raise ValueError(
                f"finding kind {self.name!r}: no remediation action for {', '.join(missing)}"
            )
        for severity, action in self.remediation.items():
            if action not in ACTIONS:
                raise ValueError(
                    f"finding kind {self.name!r}: {severity.label} action {action!r}"
                    f" is not one of {', '.join(ACTIONS)}"
                )
        for text, what in (
            (self.meaning, "meaning"),
            (self.signal, "signal"),
            (self.hardware, "hardware"),
        ):
            if not text.strip():
                raise ValueError(f"finding kind {self.name!r}: no {what}")
        object.__setattr__(self, "severities", frozenset(self.severities))
        object.__setattr__(self, "remediation", MappingProxyType(dict(self.remediation)))
        object.__setattr__(
            self,
            "exceptions",
            MappingProxyType(
                {s: a for s, a in self.remediation.items() if a != SEVERITY_DEFAULTS[s]}
            ),
        )


def actions(
    *, critical: str | None = None, warning: str | None = None, info: str | None = None
) -> Mapping[Severity, str]:
    """A spec's ``remediation`` written with the severities' names."""
    given = {Severity.CRITICAL: critical, Severity.WARNING: warning, Severity.INFO: info}
    return {s: a for s, a in given.items() if a is not None}


def severities(*given: Severity) -> frozenset[Severity]:
    return frozenset(given)


def catalogue(kinds: Iterable[FindingKind]) -> Mapping[str, FindingKind]:
    """Name -> spec, refusing a name declared twice (one would silently win)."""
    table: dict[str, FindingKind] = {}
    for kind in kinds:
        if kind.name in table:
            raise ValueError(f"finding kind {kind.name!r} declared twice")
        table[kind.name] = kind
    return MappingProxyType(table)


# ---------------------------------------------------------------------------------------------
# What is generated from the specs


def _kind_list(names: Iterable[str]) -> str:
    return ", ".join(f"`{n}`" for n in names)


def _seconds(value: float) -> str:
    return f"{value:g} s"


def signal_table(kinds: Iterable[FindingKind]) -> str:
    """The README's table of signals: kinds that read the same signal share a row, in the
    order the registry declares them."""
    rows: dict[tuple[str, str], list[str]] = {}
    for kind in kinds:
        rows.setdefault((kind.signal, kind.hardware), []).append(kind.name)
    lines = ["| finding | signal | on real hardware today |", "|---|---|---|"]
    for (signal, hardware), names in rows.items():
        lines.append(f"| {_kind_list(names)} | {signal} | {hardware} |")
    return "\n".join(lines) + "\n"


def kind_table(kinds: Iterable[FindingKind]) -> str:
    """The README's table of kinds: severities, default remediation, built-in alert timing and
    meaning of each."""
    lines = [
        "| finding | severities | default action | alert for / resolve after | meaning |",
        "|---|---|---|---|---|",
    ]
    for kind in kinds:
        ordered = sorted(kind.severities, reverse=True)
        sev = ", ".join(s.label for s in ordered)
        act = ", ".join(f"{s.label}: {kind.remediation[s]}" for s in ordered)
        if kind.alert is None:
            timing = "`[alerts]` defaults"
        else:
            rule = kind.alert
            timing = f"{_seconds(rule.for_seconds)} / {_seconds(rule.resolve_after_seconds)}"
            if kind.alert.clear_below is not None:
                timing += f", kept from {kind.alert.clear_below:g}"
        lines.append(f"| `{kind.name}` | {sev} | {act} | {timing} | {kind.meaning} |")
    return "\n".join(lines) + "\n"


def policy_block(kinds: Iterable[FindingKind]) -> str:
    """The body of :mod:`nodescope.remediation.policy`'s generated table: the kinds whose
    action differs from the severity defaults."""
    out = ["BUILTIN_RULES: Mapping[str, Mapping[Severity, Action]] = MappingProxyType("]
    entries = [k for k in kinds if k.exceptions]
    if not entries:
        out.append("    {}")
    else:
        out.append("    {")
        for kind in entries:
            pairs = ", ".join(
                f"Severity.{s.name}: Action.{kind.exceptions[s].upper()}"
                for s in sorted(kind.exceptions, reverse=True)
            )
            out.append(f'        "{kind.name}": MappingProxyType({{{pairs}}}),')
        out.append("    }")
    out.append(")")
    return "\n".join(out) + "\n"


def contention_block(kinds: Iterable[FindingKind]) -> str:
    """The body of :mod:`nodescope.hooks.tracker`'s generated set of contention kinds."""
    names = sorted(k.name for k in kinds if k.contention)
    out = ["CONTENTION_KINDS = frozenset(", "    {"]
    out.extend(f'        "{name}",' for name in names)
    out.extend(["    }", ")"])
    return "\n".join(out) + "\n"
