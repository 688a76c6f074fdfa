"""Every finding kind has one spec beside its detector, and everything that names kinds agrees
with the specs: the detectors' emissions, the bundled scenarios' expectations, the generated
README tables and code blocks, the shipped Prometheus and Alertmanager matchers, and no kind
spelled out by hand anywhere else."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from nodescope import docgen
from nodescope.alerts import AlertRule
from nodescope.assembly import default_config
from nodescope.config import Config
from nodescope.detectors.kinds import (
    SEVERITY_DEFAULTS,
    FindingKind,
    actions,
    catalogue,
    contention_block,
    policy_block,
    severities,
)
from nodescope.detectors.registry import (
    ALERT_RULES,
    DETECTORS,
    KINDS,
    Configured,
    DetectorInfo,
    kinds_of,
)
from nodescope.hooks.tracker import CONTENTION_KINDS
from nodescope.model.finding import Finding, Severity
from nodescope.model.snapshot import Snapshot
from nodescope.model.xid_catalog import APPLICATION, CLASSES, UNKNOWN, kind_of, load_catalog
from nodescope.remediation.policy import BUILTIN_RULES, Action, Policy
from nodescope.sim.scenario import SCENARIO_DIR
from tests.conftest import REPO

DAEMON = REPO / "daemon" / "nodescope"
EXPORTERS = REPO / "exporters"

#: Findings made with a kind the code computes, each with the reason its kinds are the specs'.
DYNAMIC_KINDS = {
    ("nodescope.detectors.errors", "finding.kind"): "adds evidence to a finding it made",
    ("nodescope.detectors.sxids", "kind"): "FATAL or NONFATAL by the record's fatal flag",
    ("nodescope.detectors.xids", "info.kind"): "gpu_xid_<class> of the catalog's class",
}

#: String literals outside the detectors that equal a kind's name and are not a kind set.
KIND_LITERALS_ALLOWED = {
    ("daemon/nodescope/config.py", "pcie_contention"): "the sample's [alerts.rules.X] table",
    ("exporters/nodescope_exporters/reports.py", "nvlink_errors"): "a report's column name",
}


def _module_of(info: DetectorInfo) -> ModuleType:
    assert isinstance(info.detect, Configured), info.name
    return sys.modules[info.detect.detect.__module__]


def _by_module() -> dict[ModuleType, list[FindingKind]]:
    out: dict[ModuleType, list[FindingKind]] = {}
    for info in DETECTORS:
        out.setdefault(_module_of(info), []).extend(info.kinds)
    return out


def _finding_calls(module: ModuleType) -> Iterator[tuple[ast.Call, str, str | None]]:
    """Every ``Finding(...)`` of the module: the call, its kind argument's text, and the
    kind's name where the argument is a module-level constant."""
    assert module.__file__ is not None
    tree = ast.parse(Path(module.__file__).read_text())
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Finding"):
            continue
        arg = node.args[0]
        value = getattr(module, arg.id, None) if isinstance(arg, ast.Name) else None
        yield node, ast.unparse(arg), value if isinstance(value, str) else None


def test_every_detector_declares_the_kinds_it_emits() -> None:
    assert all(info.kinds for info in DETECTORS)
    assert len(KINDS) == sum(len(info.kinds) for info in DETECTORS)


def test_every_finding_a_detector_makes_has_a_spec_of_that_detector() -> None:
    for module, specs in _by_module().items():
        names = {s.name: s for s in specs}
        for call, text, kind in _finding_calls(module):
            where = f"{module.__name__}:{call.lineno}"
            if kind is None:
                assert (module.__name__, text) in DYNAMIC_KINDS, (
                    f"{where}: Finding({text}, ...) names no constant kind of its module"
                )
                continue
            assert kind in names, f"{where}: kind {kind!r} has no spec in its detector's entry"
            severity = call.args[1]
            if isinstance(severity, ast.Attribute) and ast.unparse(severity.value) == "Severity":
                assert Severity[severity.attr] in names[kind].severities, (
                    f"{where}: {kind} raised at {severity.attr.lower()}, not in its spec"
                )


def test_every_spec_has_a_path_that_emits_it() -> None:
    catalog = load_catalog()
    xid_classes = {info.xid_class for info in catalog.entries.values()} | {UNKNOWN}
    for module, specs in _by_module().items():
        emitted = {kind for _, _, kind in _finding_calls(module) if kind is not None}
        assert module.__file__ is not None
        source = Path(module.__file__).read_text()
        for spec in specs:
            if spec.name in emitted:
                continue
            if module.__name__ == "nodescope.detectors.xids":
                assert spec.name in {kind_of(c) for c in xid_classes}, spec.name
            elif module.__name__ == "nodescope.detectors.sxids":
                # ``kind = FATAL if count.fatal else NONFATAL``, then Finding(kind, ...).
                assert re.search(r"kind = FATAL if \w+\.fatal else NONFATAL", source)
            else:
                pytest.fail(f"{spec.name}: declared by {module.__name__}, which never emits it")


def test_xid_specs_take_the_catalogs_severities_and_application_never_drains() -> None:
    catalog = load_catalog()
    for xid_class in CLASSES:
        spec = KINDS[kind_of(xid_class)]
        given = {i.severity for i in catalog.entries.values() if i.xid_class == xid_class}
        if xid_class == UNKNOWN:
            given.add(catalog.unknown_severity)
        assert spec.severities == given
    application = KINDS[kind_of(APPLICATION)]
    assert not any(a.startswith("drain") for a in application.remediation.values())
    assert set(application.remediation) == set(Severity)


def test_bundled_scenarios_expect_only_kinds_and_severities_of_the_specs() -> None:
    seen = 0
    for path in sorted(SCENARIO_DIR.glob("*.json")):
        for expected in json.loads(path.read_text()).get("expect", {}).get("findings", ()):
            spec = KINDS.get(expected["kind"])
            assert spec is not None, f"{path.name}: unknown kind {expected['kind']!r}"
            if "severity" in expected:
                assert Severity[expected["severity"].upper()] in spec.severities, (
                    f"{path.name}: {spec.name} at {expected['severity']}"
                )
            seen += 1
    assert seen > 40


def test_a_spec_states_the_action_of_every_severity_it_raises() -> None:
    # A new critical kind's drain is written in its spec, never a silent default.
    with pytest.raises(ValueError, match="no remediation action for critical"):
        FindingKind(
            "gpu_new_fault",
            severities(Severity.CRITICAL, Severity.WARNING),
            actions(warning="alert"),
            meaning="m",
            signal="s",
            hardware="yes",
        )
    with pytest.raises(ValueError, match="is not one of"):
        FindingKind("x", severities(Severity.INFO), actions(info="page"), "m", "s", "yes")
    with pytest.raises(ValueError, match="declared twice"):
        kinds_of(
            [DetectorInfo("a", _nothing, (_spec("x"),)), DetectorInfo("b", _nothing, (_spec("x"),))]
        )
    # The severity defaults are the shipped [remediation] table's.
    shipped = default_config().remediation
    assert dict(SEVERITY_DEFAULTS) == {
        Severity.CRITICAL: shipped.critical,
        Severity.WARNING: shipped.warning,
        Severity.INFO: shipped.info,
    }


def _nothing(previous: Snapshot | None, snapshot: Snapshot, config: Config) -> list[Finding]:
    return []


def _spec(name: str, **extra: object) -> FindingKind:
    return FindingKind(
        name,
        severities(Severity.CRITICAL),
        actions(critical="alert"),
        "m",
        "s",
        "yes",
        **extra,  # type: ignore[arg-type]
    )


def test_alert_rules_are_the_specs() -> None:
    assert {n: k.alert for n, k in KINDS.items() if k.alert is not None} == ALERT_RULES
    rule = AlertRule(for_seconds=0.0, resolve_after_seconds=5.0)
    table = catalogue([_spec("a", alert=rule), _spec("b")])
    info = DetectorInfo("d", _nothing, tuple(table.values()))
    from nodescope.detectors.registry import alert_rules_of

    assert alert_rules_of([info]) == {"a": rule}


def test_policy_and_tracker_tables_are_the_specs() -> None:
    assert docgen.stale_code() == [], (
        "generated code is stale: run .venv/bin/python -m nodescope.docgen --write-code"
    )
    wanted = {
        name: {s: Action(a) for s, a in spec.exceptions.items()}
        for name, spec in KINDS.items()
        if spec.exceptions
    }
    assert {k: dict(v) for k, v in BUILTIN_RULES.items()} == wanted
    assert {n for n, k in KINDS.items() if k.contention} == CONTENTION_KINDS
    # Every kind's action with the shipped [remediation] defaults is its spec's.
    policy = Policy.from_settings(default_config().remediation)
    for name, spec in KINDS.items():
        for severity, action in spec.remediation.items():
            assert policy.action(name, severity) is Action(action), (name, severity)


def test_generated_blocks_follow_a_changed_spec(tmp_path: Path) -> None:
    """A new spec changes the blocks, so a stale module fails the check above."""
    new = _spec("gpu_new_fault", contention=True)
    assert '"gpu_new_fault": MappingProxyType(' in policy_block([new])
    assert '"gpu_new_fault",' in contention_block([new])
    text = (DAEMON / "hooks" / "tracker.py").read_text()
    changed = docgen.refresh_code(text, {"contention-kinds": lambda: contention_block([new])})
    assert changed != text and '"gpu_new_fault",' in changed
    for module, sections in docgen.CODE_SECTIONS.items():
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        fresh = docgen.refresh_code((DAEMON / module).read_text(), sections)
        (tmp_path / module).write_text(fresh)
    assert docgen.stale_code(tmp_path) == []
    (tmp_path / "hooks" / "tracker.py").write_text(changed)
    assert docgen.stale_code(tmp_path) == ["hooks/tracker.py"]
    with pytest.raises(ValueError, match="no generated"):
        docgen.refresh_code("x = 1\n", {"contention-kinds": lambda: ""})


def test_readme_tables_list_every_kind() -> None:
    text = (REPO / "README.md").read_text()
    for section in ("finding-signals", "finding-kinds"):
        body = text.split(f"<!-- BEGIN {section} -->")[1].split(f"<!-- END {section} -->")[0]
        rows = body.strip().splitlines()[2:]
        listed = {n for row in rows for n in re.findall(r"`([a-z0-9_]+)`", row.split(" | ")[0])}
        assert set(KINDS) <= listed, set(KINDS) - listed


# ---------------------------------------------------------------------------------------------
# No kind spelled out by hand outside the detectors


def _literals(path: Path) -> Iterator[tuple[int, str]]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def _generated_lines(path: Path) -> set[int]:
    lines: set[int] = set()
    inside = False
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.startswith("# BEGIN generated "):
            inside = True
        elif line.startswith("# END generated "):
            inside = False
        elif inside:
            lines.add(number)
    return lines


def test_no_kind_is_written_out_outside_the_detectors() -> None:
    files = [
        p
        for p in [*DAEMON.rglob("*.py"), *(EXPORTERS / "nodescope_exporters").rglob("*.py")]
        if "detectors" not in p.relative_to(REPO).parts
    ]
    assert len(files) > 50
    found = []
    for path in files:
        generated = _generated_lines(path)
        relative = str(path.relative_to(REPO))
        for line, value in _literals(path):
            if (
                value in KINDS
                and line not in generated
                and (relative, value) not in KIND_LITERALS_ALLOWED
            ):
                found.append(f"{relative}:{line}: {value!r}")
    assert found == [], "kinds by name outside their specs: " + ", ".join(found)


# ---------------------------------------------------------------------------------------------
# The shipped Prometheus and Alertmanager matchers

_SELECTOR = re.compile(r"nodescope_alert_active\s*\{([^}]*)\}")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def _matchers(text: str) -> list[tuple[str, str, str]]:
    return [(m.group(1), m.group(2), m.group(3)) for m in _MATCHER.finditer(text)]


def _matches(op: str, pattern: str, value: str) -> bool:
    if op == "=":
        return value == pattern
    if op == "!=":
        return value != pattern
    hit = re.fullmatch(pattern, value) is not None
    return hit if op == "=~" else not hit


def _alert_selectors(text: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """(alert name, matchers) of every selector of the daemon's alerts in a rule file."""
    out = []
    for group in yaml.safe_load(text)["groups"]:
        for rule in group["rules"]:
            for selector in _SELECTOR.findall(str(rule.get("expr", ""))):
                out.append((rule.get("alert", rule.get("record", "")), _matchers(selector)))
    return out


def _reaches(matchers: list[tuple[str, str, str]], kind: str, severity: Severity) -> bool:
    labels = {"kind": kind, "severity": severity.label, "state": "firing"}
    return all(
        _matches(op, pattern, labels[label]) for label, op, pattern in matchers if label in labels
    )


def _named_kinds(op: str, pattern: str) -> set[str]:
    """The kinds a matcher spells out: its value, or a regex's plain alternatives."""
    if op in ("=", "!="):
        return {pattern}
    return {p for p in pattern.split("|") if re.fullmatch(r"[a-z0-9_]+", p)}


def _unalerted(text: str, kinds: Iterable[FindingKind]) -> list[str]:
    """What a rule file gets wrong: a warning or critical kind no rule fires on (unless its
    spec says why), or one whose spec says it is not alerted that a rule fires on."""
    selectors = _alert_selectors(text)
    wrong = []
    for spec in kinds:
        for severity in sorted(spec.severities - {Severity.INFO}):
            reached = [alert for alert, m in selectors if _reaches(m, spec.name, severity)]
            if spec.not_alerted and reached:
                wrong.append(f"{spec.name} says it is not alerted, but {reached} fire")
            elif not spec.not_alerted and not reached:
                wrong.append(f"no rule fires on {spec.name} at {severity.label}")
    return wrong


def test_every_warning_and_critical_kind_reaches_an_alert_rule() -> None:
    text = (EXPORTERS / "prometheus" / "alerts.yml").read_text()
    assert len(_alert_selectors(text)) >= 2
    assert _unalerted(text, KINDS.values()) == []
    # Info never pages.
    assert not any(
        _reaches(m, "gpu_xid_application", Severity.INFO) for _, m in _alert_selectors(text)
    )


def _shipped_matchers() -> Iterator[tuple[Path, str, str]]:
    """The kind matchers of the shipped rules and routes (the promtool tests' input series
    are left out: they feed a kind no detector has on purpose, to show that the catch-all
    rule forwards a kind added later)."""
    for path in [
        *sorted((EXPORTERS / "prometheus").glob("*.yml")),
        *sorted((EXPORTERS / "alertmanager").glob("*.yml")),
    ]:
        for label, op, pattern in _matchers(path.read_text()):
            if label == "kind":
                yield path, op, pattern


def _unknown_kinds(text: str) -> set[str]:
    return {
        name
        for label, op, pattern in _matchers(text)
        if label == "kind"
        for name in _named_kinds(op, pattern)
        if name not in KINDS
    }


def test_no_matcher_names_an_unknown_kind() -> None:
    seen = 0
    for path, op, pattern in _shipped_matchers():
        for name in _named_kinds(op, pattern):
            assert name in KINDS, f"{path.relative_to(REPO)}: kind {name!r} has no spec"
            seen += 1
    assert seen >= 5


def test_the_matcher_checks_catch_an_unknown_or_unalerted_kind() -> None:
    """The two checks above against rule files they must refuse."""
    narrow = """
groups:
  - name: g
    rules:
      - alert: OnlyContention
        expr: nodescope_alert_active{kind="pcie_contention", state="firing"} > 0
"""
    fell = KINDS["gpu_fell_off_bus"]
    assert _unalerted(narrow, [KINDS["pcie_contention"]]) == []
    assert _unalerted(narrow, [fell]) == ["no rule fires on gpu_fell_off_bus at critical"]
    explained = dataclasses.replace(fell, not_alerted="drained by the gate instead")
    assert _unalerted(narrow, [explained]) == []
    catch_all = narrow.replace('kind="pcie_contention"', 'severity!="info"')
    assert _unalerted(catch_all, [explained]) == [
        "gpu_fell_off_bus says it is not alerted, but ['OnlyContention'] fire"
    ]
    assert _unknown_kinds('kind=~"nvlink_counter_device_gone|collective_hang"') == set()
    assert _unknown_kinds("['kind=\"gpu_fell_of_bus\"', 'kind!~\"x_y|collective_hang\"']") == {
        "gpu_fell_of_bus",
        "x_y",
    }
