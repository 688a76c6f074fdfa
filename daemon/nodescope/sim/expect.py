"""The ``expect`` object of a scenario file, and its evaluation against /metrics.

A scenario states what the daemon must show while it runs (docs/scenarios.md, "expect"):

``metrics``
    ranges over time windows. One entry names a metric as it appears in the exposition
    (``nodescope_gpu_pcie_rx_bytes_total``), a subset of its labels with exact values, an
    ``aggregate`` (``"value"``: the sample itself; ``"rate"``: its per-second increase
    between two consecutive cycles, in the scenario's simulated seconds), ``min`` and/or
    ``max`` (inclusive; with neither, the series only has to exist) and a window ``from`` /
    ``to`` in simulated seconds (``to`` absent: until the end). It holds when at least one
    cycle in the window had a matching series and every matching series of every such cycle
    was in range. A label subset that matches several series (``{"gpu": "2"}`` on a metric
    that also has ``link``) holds only when every one of them is in range.
``findings``
    findings that must appear: a ``kind``, ``subjects`` (names that must all be among the
    finding's subjects: a BDF, a GPU index, a job id) and a window in which it must be found
    at least once.
``no_other_findings``
    every finding the detectors return must be accounted for by one of ``findings`` (kind,
    subjects and window).

Findings are checked only when the daemon has detectors; with none registered they are
reported as not checkable rather than passed.

Values are read from the rendered exposition of each cycle with prometheus-client's own
parser, so the whole exporter path is what is checked. Validation errors are
:class:`~nodescope.errors.ParseError` naming the file and a JSON pointer into it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from nodescope.errors import ParseError
from nodescope.model.finding import Finding

Aggregate = Literal["value", "rate"]
AGGREGATES: tuple[Aggregate, ...] = ("value", "rate")

#: Exact label values, sorted by label name.
Labels = tuple[tuple[str, str], ...]

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")

NOT_CHECKABLE = "not checkable yet: no detectors"


@dataclass(frozen=True, slots=True)
class MetricExpectation:
    """One metric range. ``start``/``end`` are the JSON ``from``/``to``; ``pointer`` is where
    the entry sits in the scenario file (``/expect/metrics/3``)."""

    name: str
    labels: Labels = ()
    aggregate: Aggregate = "value"
    min: float | None = None
    max: float | None = None
    start: float = 0.0
    end: float | None = None
    description: str | None = None
    pointer: str = ""

    def in_window(self, t: float) -> bool:
        return t >= self.start and (self.end is None or t <= self.end)

    def in_range(self, value: float) -> bool:
        if self.min is not None and value < self.min:
            return False
        return not (self.max is not None and value > self.max)

    def describe(self) -> str:
        """``rate(nodescope_x_total{gpu="2"}) in [1e+09, 2e+09] over t=10..60s``."""
        series = f"{self.name}{format_labels(self.labels)}"
        subject = f"rate({series})" if self.aggregate == "rate" else series
        if self.min is None and self.max is None:
            want = "present"
        elif self.max is None:
            want = f">= {number(self.min)}"
        elif self.min is None:
            want = f"<= {number(self.max)}"
        else:
            want = f"in [{number(self.min)}, {number(self.max)}]"
        return f"{subject} {want} over {window_text(self.start, self.end)}"


@dataclass(frozen=True, slots=True)
class FindingExpectation:
    """A finding that must appear within ``start``..``end`` (the JSON ``from``/``to``).

    ``subjects``: names the finding must have in any role (the JSON array form);
    ``labelled``: (role, name) pairs it must have exactly (the JSON object form, so GPU 7 is
    not link 7 of GPU 2); ``severity``: the severity it must have (``None``: any);
    ``optional``: it may also not appear, and a finding it matches is no "other" finding."""

    kind: str
    subjects: tuple[str, ...] = ()
    start: float = 0.0
    end: float | None = None
    description: str | None = None
    pointer: str = ""
    labelled: tuple[tuple[str, str], ...] = ()
    severity: str | None = None
    optional: bool = False

    def describe(self) -> str:
        names = [*self.subjects, *(f"{role}={name}" for role, name in self.labelled)]
        subjects = f" on {', '.join(names)}" if names else ""
        severity = f" ({self.severity})" if self.severity else ""
        optional = " (optional)" if self.optional else ""
        return (
            f"finding {self.kind}{severity}{subjects} within"
            f" {window_text(self.start, self.end)}{optional}"
        )


@dataclass(frozen=True, slots=True)
class Expectations:
    metrics: tuple[MetricExpectation, ...] = ()
    findings: tuple[FindingExpectation, ...] = ()
    no_other_findings: bool = False


# --------------------------------------------------------------------------------------------
# Formatting shared by the reports


def number(value: float | None) -> str:
    if value is None:
        return "-"
    if float(value).is_integer() and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.4g}"


def format_labels(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{v}"' for k, v in labels)
    return "{" + inner + "}"


def window_text(start: float, end: float | None) -> str:
    if end is None:
        return f"t>={number(start)}s"
    return f"t={number(start)}..{number(end)}s"


# --------------------------------------------------------------------------------------------
# Parsing


def _fail(source: str, pointer: str, message: str) -> ParseError:
    return ParseError(source, f"{pointer}: {message}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(obj: Mapping[str, Any], key: str, source: str, pointer: str) -> float | None:
    if key not in obj:
        return None
    value = obj[key]
    if not _is_number(value) or not math.isfinite(value):
        raise _fail(source, f"{pointer}/{key}", f"must be a finite number, got {value!r}")
    return float(value)


def _window(obj: Mapping[str, Any], source: str, pointer: str) -> tuple[float, float | None]:
    start = _number(obj, "from", source, pointer)
    end = _number(obj, "to", source, pointer)
    start = 0.0 if start is None else start
    if start < 0:
        raise _fail(source, f"{pointer}/from", "must be >= 0 (simulated seconds)")
    if end is not None and end < start:
        raise _fail(source, f"{pointer}/to", f"must be >= from ({number(start)})")
    return start, end


def _object(value: Any, source: str, pointer: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _fail(source, pointer, f"must be an object, got {type(value).__name__}")
    return value


def _array(value: Any, source: str, pointer: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise _fail(source, pointer, f"must be an array, got {type(value).__name__}")
    return list(value)


def _known_keys(obj: Mapping[str, Any], known: Collection[str], source: str, pointer: str) -> None:
    for key in obj:
        if key not in known:
            raise _fail(
                source, f"{pointer}/{key}", f"unknown key (known: {', '.join(sorted(known))})"
            )


def _description(obj: Mapping[str, Any], source: str, pointer: str) -> str | None:
    value = obj.get("description")
    if "description" in obj and not isinstance(value, str):
        raise _fail(source, f"{pointer}/description", "must be a string")
    return value


def _metric(value: Any, source: str, pointer: str) -> MetricExpectation:
    obj = _object(value, source, pointer)
    _known_keys(
        obj,
        ("name", "labels", "aggregate", "min", "max", "from", "to", "description"),
        source,
        pointer,
    )
    name = obj.get("name")
    if not isinstance(name, str) or not _METRIC_NAME.match(name):
        raise _fail(source, f"{pointer}/name", f"must be a metric name, got {name!r}")
    labels_obj = _object(obj.get("labels", {}), source, f"{pointer}/labels")
    labels: list[tuple[str, str]] = []
    for label, label_value in labels_obj.items():
        where = f"{pointer}/labels/{label}"
        if not isinstance(label, str) or not _LABEL_NAME.match(label):
            raise _fail(source, where, f"not a label name: {label!r}")
        if not isinstance(label_value, str):
            raise _fail(
                source,
                where,
                f'label values are strings (write "{label_value}"), got '
                f"{type(label_value).__name__}",
            )
        labels.append((label, label_value))
    aggregate = obj.get("aggregate", "value")
    if aggregate not in AGGREGATES:
        raise _fail(
            source,
            f"{pointer}/aggregate",
            f"must be one of {', '.join(AGGREGATES)}, got {aggregate!r}",
        )
    low = _number(obj, "min", source, pointer)
    high = _number(obj, "max", source, pointer)
    if low is not None and high is not None and low > high:
        raise _fail(source, f"{pointer}/max", f"must be >= min ({number(low)})")
    start, end = _window(obj, source, pointer)
    return MetricExpectation(
        name=name,
        labels=tuple(sorted(labels)),
        aggregate=aggregate,
        min=low,
        max=high,
        start=start,
        end=end,
        description=_description(obj, source, pointer),
        pointer=pointer,
    )


SEVERITIES = ("info", "warning", "critical")


def _finding(value: Any, source: str, pointer: str) -> FindingExpectation:
    obj = _object(value, source, pointer)
    _known_keys(
        obj,
        ("kind", "subjects", "from", "to", "description", "severity", "optional"),
        source,
        pointer,
    )
    kind = obj.get("kind")
    if not isinstance(kind, str) or not kind:
        raise _fail(source, f"{pointer}/kind", f"must be a non-empty string, got {kind!r}")
    subjects: list[str] = []
    labelled: list[tuple[str, str]] = []
    given = obj.get("subjects", [])
    if isinstance(given, dict):
        for role, name in given.items():
            if not role or not isinstance(name, str) or not name:
                raise _fail(source, f"{pointer}/subjects/{role}", "must be a non-empty string")
            labelled.append((role, name))
    else:
        for i, subject in enumerate(_array(given, source, f"{pointer}/subjects")):
            if not isinstance(subject, str) or not subject:
                raise _fail(source, f"{pointer}/subjects/{i}", "must be a non-empty string")
            subjects.append(subject)
    severity = obj.get("severity")
    if severity is not None and severity not in SEVERITIES:
        raise _fail(
            source,
            f"{pointer}/severity",
            f"must be one of {', '.join(SEVERITIES)}, got {severity!r}",
        )
    optional = obj.get("optional", False)
    if not isinstance(optional, bool):
        raise _fail(source, f"{pointer}/optional", f"must be true or false, got {optional!r}")
    start, end = _window(obj, source, pointer)
    return FindingExpectation(
        kind=kind,
        subjects=tuple(subjects),
        start=start,
        end=end,
        description=_description(obj, source, pointer),
        pointer=pointer,
        labelled=tuple(sorted(labelled)),
        severity=severity,
        optional=optional,
    )


def parse_expectations(obj: Any, source: str, pointer: str = "/expect") -> Expectations:
    """The ``expect`` object of a scenario (``None``: nothing expected).

    ``source`` is the scenario file, named in every :class:`ParseError` with the JSON pointer
    of the offending value.
    """
    if obj is None:
        return Expectations()
    expect = _object(obj, source, pointer)
    _known_keys(expect, ("metrics", "findings", "no_other_findings"), source, pointer)
    metrics = tuple(
        _metric(entry, source, f"{pointer}/metrics/{i}")
        for i, entry in enumerate(_array(expect.get("metrics", []), source, f"{pointer}/metrics"))
    )
    findings = tuple(
        _finding(entry, source, f"{pointer}/findings/{i}")
        for i, entry in enumerate(_array(expect.get("findings", []), source, f"{pointer}/findings"))
    )
    no_other = expect.get("no_other_findings", False)
    if not isinstance(no_other, bool):
        raise _fail(source, f"{pointer}/no_other_findings", "must be true or false")
    return Expectations(metrics, findings, no_other)


class CatalogEntry(Protocol):
    @property
    def labels(self) -> tuple[str, ...]: ...


def check_catalog(
    expectations: Expectations, catalog: Mapping[str, CatalogEntry], source: str
) -> None:
    """Reject a metric expectation whose name or label nodescope never exports: a typo would
    otherwise read as "series never appeared" only after a whole replay."""
    for entry in expectations.metrics:
        spec = catalog.get(entry.name)
        if spec is None:
            raise _fail(source, f"{entry.pointer}/name", f"nodescope exports no {entry.name}")
        for label, _ in entry.labels:
            if label not in spec.labels:
                raise _fail(
                    source,
                    f"{entry.pointer}/labels/{label}",
                    f"{entry.name} has no label {label!r} "
                    f"(its labels: {', '.join(spec.labels) or 'none'})",
                )


# --------------------------------------------------------------------------------------------
# Reading the exposition

#: name -> {labels: value} of one cycle
Samples = Mapping[str, Mapping[Labels, float]]

_SUFFIXES = ("_total", "_created", "_info", "_count", "_sum", "_bucket")


def _line_name(line: str) -> str:
    end = len(line)
    for stop in ("{", " "):
        i = line.find(stop)
        if i != -1:
            end = min(end, i)
    return line[:end]


def parse_exposition(text: str, names: Collection[str]) -> dict[str, dict[Labels, float]]:
    """The samples named in ``names`` of a text exposition, parsed by prometheus-client.

    Only the lines of the wanted families go to the parser: a DGX-class node exports
    thousands of NVLink series per cycle, and a replay parses one exposition per tick.
    """
    wanted = set(names)
    families = set(wanted)
    for name in wanted:
        for suffix in _SUFFIXES:
            if name.endswith(suffix):
                families.add(name.removesuffix(suffix))
    kept: list[str] = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and parts[2] in families:
                kept.append(line)
        elif line and _line_name(line) in wanted:
            kept.append(line)
    # Imported here: `nodescope run` loads this module (its parser registers `replay`), and
    # the daemon does not load prometheus_client.
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[Labels, float]] = {name: {} for name in wanted}
    for family in text_string_to_metric_families("\n".join(kept) + "\n"):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name][tuple(sorted(sample.labels.items()))] = float(sample.value)
    return out


# --------------------------------------------------------------------------------------------
# Evaluation


@dataclass(frozen=True, slots=True)
class Violation:
    t: float
    labels: Labels
    value: float


@dataclass(frozen=True, slots=True)
class MetricResult:
    """How one metric expectation fared. ``observed_min``/``observed_max`` span every value
    evaluated in the window (all matching series)."""

    expectation: MetricExpectation
    passed: bool
    reason: str
    cycles_in_window: int
    cycles_evaluated: int
    observed_min: float | None
    observed_max: float | None
    violations: int
    first_violation: Violation | None
    series: tuple[Labels, ...]

    @property
    def status(self) -> str:
        return "pass" if self.passed else "fail"


@dataclass(frozen=True, slots=True)
class FindingResult:
    """A finding expectation (``None``: "no other findings"); ``status`` is ``"pass"``,
    ``"fail"`` or, while no detector is registered, ``"unchecked"``. ``first_seen`` and
    ``finding`` are the first matching finding's time and key."""

    expectation: FindingExpectation | None
    status: str
    reason: str
    first_seen: float | None = None
    finding: str | None = None

    @property
    def passed(self) -> bool:
        return self.status != "fail"

    def describe(self) -> str:
        if self.expectation is None:
            return "no other findings"
        return self.expectation.describe()


@dataclass
class _Tracker:
    expectation: MetricExpectation
    cycles_in_window: int = 0
    cycles_evaluated: int = 0
    seen_outside: bool = False
    seen_in_window: bool = False
    observed_min: float | None = None
    observed_max: float | None = None
    violations: int = 0
    first_violation: Violation | None = None
    series: set[Labels] = field(default_factory=set)
    last_t: float | None = None
    last: dict[Labels, float] = field(default_factory=dict)

    def _matching(self, samples: Mapping[Labels, float]) -> dict[Labels, float]:
        want = self.expectation.labels
        return {
            labels: value
            for labels, value in samples.items()
            if all(pair in labels for pair in want)
        }

    def _values(self, t: float, matched: dict[Labels, float]) -> dict[Labels, float]:
        if self.expectation.aggregate == "value":
            return matched
        rates: dict[Labels, float] = {}
        if self.last_t is not None and t > self.last_t:
            seconds = t - self.last_t
            for labels, value in matched.items():
                before = self.last.get(labels)
                # A decrease is a counter reset: that interval has no rate (as in PromQL).
                if before is not None and value >= before:
                    rates[labels] = (value - before) / seconds
        return rates

    def observe(self, t: float, samples: Mapping[Labels, float]) -> None:
        matched = self._matching(samples)
        values = self._values(t, matched)
        self.last_t, self.last = t, matched
        e = self.expectation
        if not e.in_window(t):
            self.seen_outside = self.seen_outside or bool(matched)
            return
        self.cycles_in_window += 1
        self.seen_in_window = self.seen_in_window or bool(matched)
        if not values:
            return
        self.cycles_evaluated += 1
        for labels in sorted(values):
            value = values[labels]
            self.series.add(labels)
            self.observed_min = (
                value if self.observed_min is None else min(self.observed_min, value)
            )
            self.observed_max = (
                value if self.observed_max is None else max(self.observed_max, value)
            )
            if not e.in_range(value):
                self.violations += 1
                if self.first_violation is None:
                    self.first_violation = Violation(t, labels, value)

    def result(self) -> MetricResult:
        e = self.expectation
        passed = False
        series = f"{e.name}{format_labels(e.labels)}"
        if self.cycles_in_window == 0:
            reason = f"no cycle fell in the window {window_text(e.start, e.end)}"
        elif not self.seen_in_window:
            where = "only outside the window" if self.seen_outside else "never"
            reason = f"no series {series} in the window (it appeared {where})"
        elif self.cycles_evaluated == 0:
            reason = f"{series} present but never in two consecutive cycles: no rate"
        elif self.first_violation is not None:
            v = self.first_violation
            reason = (
                f"{self.violations} value(s) out of range in {self.cycles_evaluated} cycle(s); "
                f"first at t={number(v.t)}s: {number(v.value)} for "
                f"{e.name}{format_labels(v.labels)}"
            )
        else:
            passed = True
            reason = f"{self.cycles_evaluated} cycle(s) in range"
        return MetricResult(
            expectation=e,
            passed=passed,
            reason=reason,
            cycles_in_window=self.cycles_in_window,
            cycles_evaluated=self.cycles_evaluated,
            observed_min=self.observed_min,
            observed_max=self.observed_max,
            violations=self.violations,
            first_violation=self.first_violation,
            series=tuple(sorted(self.series)),
        )


def finding_matches(expectation: FindingExpectation, finding: Finding, t: float) -> bool:
    """Same kind, every expected subject among the finding's subjects (a labelled one in its
    role), the expected severity if one is named, ``t`` in the window."""
    if finding.kind != expectation.kind:
        return False
    if t < expectation.start or (expectation.end is not None and t > expectation.end):
        return False
    if expectation.severity is not None and finding.severity.label != expectation.severity:
        return False
    if any(finding.subjects.get(role) != name for role, name in expectation.labelled):
        return False
    names = set(finding.subjects.values())
    return all(subject in names for subject in expectation.subjects)


class Evaluator:
    """Feeds each cycle's exposition to every metric expectation, and its findings to every
    finding expectation, in simulated time order."""

    def __init__(self, expectations: Expectations) -> None:
        self.expectations = expectations
        self._trackers = [_Tracker(e) for e in expectations.metrics]
        self.names = frozenset(e.name for e in expectations.metrics)
        #: per finding expectation: (t, key) of the first match
        self._found: list[tuple[float, str] | None] = [None] * len(expectations.findings)
        #: findings no expectation accounts for: key -> first t
        self._others: dict[str, float] = {}

    def observe(self, t: float, exposition: str) -> None:
        """One cycle at simulated second ``t``: its rendered /metrics text."""
        if self._trackers:
            self.observe_samples(t, parse_exposition(exposition, self.names))

    def observe_samples(self, t: float, samples: Samples) -> None:
        for tracker in self._trackers:
            tracker.observe(t, samples.get(tracker.expectation.name, {}))

    def metric_results(self) -> tuple[MetricResult, ...]:
        return tuple(t.result() for t in self._trackers)

    def observe_findings(self, t: float, findings: Iterable[Finding]) -> None:
        """The findings the detectors returned for the cycle at simulated second ``t``."""
        expected = self.expectations.findings
        for finding in findings:
            accounted = False
            for i, e in enumerate(expected):
                if finding_matches(e, finding, t):
                    accounted = True
                    if self._found[i] is None:
                        self._found[i] = (t, finding.key)
            if not accounted:
                self._others.setdefault(finding.key, t)

    def finding_results(self, checkable: bool = True) -> tuple[FindingResult, ...]:
        """``checkable``: whether any detector ran; without one nothing can be concluded."""
        results: list[FindingResult] = []
        for e, found in zip(self.expectations.findings, self._found, strict=True):
            if not checkable:
                results.append(FindingResult(e, "unchecked", NOT_CHECKABLE))
            elif found is None and e.optional:
                results.append(FindingResult(e, "pass", "optional: not seen"))
            elif found is None:
                results.append(FindingResult(e, "fail", "no such finding in the window"))
            else:
                results.append(FindingResult(e, "pass", f"first at t={number(found[0])}s", *found))
        if self.expectations.no_other_findings:
            if not checkable:
                results.append(FindingResult(None, "unchecked", NOT_CHECKABLE))
            elif self._others:
                firsts = sorted(self._others.items(), key=lambda item: (item[1], item[0]))
                listed = "; ".join(f"{key} at t={number(t)}s" for key, t in firsts[:5])
                more = f" and {len(firsts) - 5} more" if len(firsts) > 5 else ""
                results.append(
                    FindingResult(
                        None,
                        "fail",
                        f"{len(firsts)} unexpected finding(s): {listed}{more}",
                        firsts[0][1],
                        firsts[0][0],
                    )
                )
            else:
                results.append(FindingResult(None, "pass", "none appeared"))
        return tuple(results)


def evaluate(
    expectations: Expectations, cycles: Iterable[tuple[float, str]]
) -> tuple[MetricResult, ...]:
    """Every metric expectation over ``(t, exposition)`` cycles."""
    evaluator = Evaluator(expectations)
    for t, text in cycles:
        evaluator.observe(t, text)
    return evaluator.metric_results()
