"""Data flows one way in the imports (docs/architecture.md): sources, model, detectors and
exporters import only in the direction of the flow.

Two checks, each seeing what the other cannot:

* the direct imports are read from the source text with :mod:`ast`, never by importing the
  modules, so an import inside a function or under ``TYPE_CHECKING`` counts as much as one at
  the top, and a module that would fail to import is still checked;
* what each module loads transitively is seen by importing it alone, in an interpreter that
  has loaded nothing of the packages (:data:`LOAD_RULES`): a rule broken two or three imports
  away, through a package's ``__init__`` or a hub such as the configuration, shows there.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO

#: Where each top-level package's source lives (``daemon/`` and ``exporters/`` are source
#: roots, not import names).
PACKAGE_ROOTS = {
    "nodescope": REPO / "daemon" / "nodescope",
    "nodescope_exporters": REPO / "exporters" / "nodescope_exporters",
}


@dataclass(frozen=True)
class Rule:
    """No module in ``importers`` may import ``forbidden`` or anything below it."""

    importers: tuple[str, ...]
    forbidden: str

    def breaks(self, importer: str, imported: str) -> bool:
        return _within(importer, self.importers) and _within(imported, (self.forbidden,))


RULES = (
    Rule(("nodescope.detectors", "nodescope.model", "nodescope_exporters"), "nodescope.sources"),
    Rule(("nodescope_exporters", "nodescope.model", "nodescope.sources"), "nodescope.detectors"),
    Rule(
        ("nodescope.detectors", "nodescope.sources", "nodescope.model", "nodescope.analysis"),
        "nodescope_exporters",
    ),
    # Every stage reads the configuration; it is handed the sources' specs where the program
    # is put together (nodescope.assembly), and imports no stage, not even inside a function.
    Rule(("nodescope.config",), "nodescope.sources"),
    Rule(("nodescope.config",), "nodescope.detectors"),
    # Records and figures are read without the libraries the sources read them with.
    Rule(("nodescope.model", "nodescope.detectors", "nodescope_exporters"), "pynvml"),
    Rule(("nodescope.model", "nodescope.detectors", "nodescope_exporters"), "nodescope.kmod_abi"),
    # The model is the bottom of the flow: nothing above it, not even the stage that derives.
    Rule(("nodescope.model",), "nodescope.derive"),
    Rule(("nodescope.model",), "nodescope.analysis"),
    # The trace analysis is a pure library under a source and a command: no stage below it.
    *(
        Rule(("nodescope.collectives",), stage)
        for stage in (
            "nodescope.sources",
            "nodescope.detectors",
            "nodescope.analysis",
            "nodescope.service",
            "nodescope.cli",
            "nodescope_exporters",
            "torch",
        )
    ),
)

#: Imports against the flow the code may keep: none. A new backward import means a type to
#: move into ``nodescope.model`` or a value to pass in from the composition root instead.
ALLOWED_VIOLATIONS: frozenset[tuple[str, str]] = frozenset()


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def module_files(roots: dict[str, Path]) -> Iterator[tuple[str, Path]]:
    """Every module of the packages: dotted name and file."""
    for package, root in roots.items():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join((package, *parts)), path


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of ``from <level dots><name> import ...`` written in ``module``."""
    base = module.split(".")
    # A package's own __init__ counts as one level already: ``.`` is the package itself.
    keep = len(base) - level + (1 if is_package else 0)
    anchor = base[:keep]
    return ".".join([*anchor, name] if name else anchor)


def imports_of(module: str, path: Path, known: frozenset[str]) -> set[str]:
    """The modules ``module`` imports, wherever in the file the import stands.

    ``from a import b`` names ``a.b`` when that is a module of the packages and ``a``
    otherwise; ``importlib.import_module("a.b")`` with a literal name counts as ``import a.b``.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = (
                _resolve_relative(module, is_package, node.level, node.module)
                if node.level
                else node.module or ""
            )
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in known else base)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
    return found


def violations(roots: dict[str, Path]) -> set[tuple[str, str]]:
    """Every (importer, imported) pair that breaks one of :data:`RULES`."""
    modules = dict(module_files(roots))
    known = frozenset(modules)
    broken: set[tuple[str, str]] = set()
    for module, path in modules.items():
        for imported in imports_of(module, path, known):
            if any(rule.breaks(module, imported) for rule in RULES):
                broken.add((module, imported))
    return broken


def _listing(pairs: set[tuple[str, str]]) -> str:
    return "\n".join(f"  {importer} -> {imported}" for importer, imported in sorted(pairs))


def test_no_import_runs_against_the_flow_beyond_the_listed_ones() -> None:
    new = violations(PACKAGE_ROOTS) - ALLOWED_VIOLATIONS
    assert not new, "imports against the one-way flow (docs/architecture.md):\n" + _listing(new)


def test_every_listed_backward_import_still_exists() -> None:
    gone = ALLOWED_VIOLATIONS - violations(PACKAGE_ROOTS)
    assert not gone, "fixed, remove from ALLOWED_VIOLATIONS:\n" + _listing(gone)


def _write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_every_form_of_import_is_seen(tmp_path: Path) -> None:
    daemon = tmp_path / "nodescope"
    exporters = tmp_path / "nodescope_exporters"
    for package in ("", "sources/", "model/", "detectors/"):
        _write(daemon, package + "__init__.py", "")
    _write(exporters, "__init__.py", "")
    _write(daemon, "sources/pci.py", "")
    _write(daemon, "detectors/links.py", "")
    _write(daemon, "analysis.py", "import nodescope_exporters.push\n")
    _write(exporters, "push.py", "")
    # A backward import in each form the scanner must read, one per module.
    _write(daemon, "model/top.py", "import nodescope.sources.pci\n")
    _write(daemon, "model/names.py", "from nodescope.sources import pci\n")
    _write(daemon, "model/relative.py", "from ..detectors.links import Finding\n")
    _write(daemon, "model/__init__.py", "from ..sources import pci\n")
    _write(
        daemon,
        "detectors/late.py",
        "def render():\n    from nodescope_exporters import push\n    return push\n",
    )
    _write(
        exporters,
        "dynamic.py",
        "import importlib\nSOURCE = importlib.import_module('nodescope.sources.pci')\n",
    )
    # The configuration: a stage imported for type checking only, or inside a function.
    _write(
        daemon,
        "config.py",
        "import typing\nif typing.TYPE_CHECKING:\n    from nodescope.sources.spec import Spec\n"
        "def specs():\n    from nodescope.detectors import links\n    return links\n",
    )
    # Imports along the flow are fine.
    _write(daemon, "detectors/fine.py", "from nodescope.model import top\n")
    _write(exporters, "fine.py", "from nodescope.model.names import pci\n")

    roots = {"nodescope": daemon, "nodescope_exporters": exporters}
    assert violations(roots) == {
        ("nodescope.analysis", "nodescope_exporters.push"),
        ("nodescope.model.top", "nodescope.sources.pci"),
        ("nodescope.model.names", "nodescope.sources.pci"),
        ("nodescope.model.relative", "nodescope.detectors.links"),
        ("nodescope.model", "nodescope.sources.pci"),
        ("nodescope.detectors.late", "nodescope_exporters.push"),
        ("nodescope_exporters.dynamic", "nodescope.sources.pci"),
        ("nodescope.config", "nodescope.sources.spec"),
        ("nodescope.config", "nodescope.detectors.links"),
    }


# --- state ----------------------------------------------------------------------------------

#: Calls that make mutable state when a module is imported: a cache, a lock guarding one, a
#: queue. Such state belongs to an object the composition root makes (its lifetime is the
#: daemon's, a replay's or a test's), never to the module.
STATEFUL_CALLS = frozenset(
    {"Memo", "Lock", "RLock", "Condition", "Event", "defaultdict", "deque", "dict", "list", "set"}
)
#: Decorators that keep a function's results in the function object, so in the module (or
#: the class) for the life of the process.
CACHING_DECORATORS = frozenset({"lru_cache", "cache"})


#: Methods that change a container in place.
MUTATING_METHODS = frozenset(
    {"append", "add", "clear", "discard", "extend", "insert", "pop", "popitem", "remove"}
    | {"setdefault", "update"}
)

#: Module-level containers that a function changes, by design: (module, name, why).
MUTATED_BY_DESIGN = {
    (
        "nodescope_exporters.catalog",
        "CATALOG",
    ): "metric() registers each spec as the module that declares it is imported",
}


def _containers(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level to a dict, list or set display."""
    displays = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, displays):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.value, displays)
            and isinstance(node.target, ast.Name)
        ):
            names.add(node.target.id)
    return names


def _mutated_containers(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, name) of each change a function makes to a module-level container: an item
    assigned or deleted, or a mutating method called."""
    names = _containers(tree)
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign | ast.Delete):
                targets = node.targets
            elif isinstance(node, ast.AugAssign):
                targets = [node.target]
            for target in targets:
                if (
                    isinstance(target, ast.Subscript)
                    and isinstance(target.value, ast.Name)
                    and target.value.id in names
                ):
                    found.append((node.lineno, target.value.id))
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id in names
                and node.func.attr in MUTATING_METHODS
            ):
                found.append((node.lineno, node.func.value.id))
    return found


def _called_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else None


def module_state(path: Path, module: str = "") -> list[str]:
    """The module-level state ``path`` (the module ``module``) makes or rebinds: ``global``
    statements anywhere, module-level names bound to a stateful call, functions cached by a
    decorator, and module-level containers that a function changes (but those of
    :data:`MUTATED_BY_DESIGN`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = [
        f"line {node.lineno}: global {', '.join(node.names)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Global)
    ]
    found += [
        f"line {node.lineno}: {node.name} cached by @{_called_name(decorator)}"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for decorator in node.decorator_list
        if _called_name(decorator) in CACHING_DECORATORS
    ]
    found += [
        f"line {line}: {name} changed in a function"
        for line, name in _mutated_containers(tree)
        if (module, name) not in MUTATED_BY_DESIGN
    ]
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        value = node.value
        called = value.func if isinstance(value, ast.Call) else None
        if isinstance(called, ast.Subscript):  # Memo[int]()
            called = called.value
        name = (
            called.attr
            if isinstance(called, ast.Attribute)
            else called.id
            if isinstance(called, ast.Name)
            else None
        )
        if name in STATEFUL_CALLS or (name is not None and name.endswith(("Walk", "Cache"))):
            found.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_no_module_keeps_state_of_its_own() -> None:
    stateful = {
        module: found
        for module, path in module_files(PACKAGE_ROOTS)
        if (found := module_state(path, module))
    }
    assert not stateful, "module-level state:\n" + "\n".join(
        f"  {module}: {'; '.join(found)}" for module, found in sorted(stateful.items())
    )


def test_every_container_changed_by_design_is_still_changed() -> None:
    paths = dict(module_files(PACKAGE_ROOTS))
    still = {
        (module, name)
        for module, name in MUTATED_BY_DESIGN
        if module in paths
        and name in {n for _line, n in _mutated_containers(ast.parse(paths[module].read_text()))}
    }
    assert still == set(MUTATED_BY_DESIGN)


def test_module_state_is_seen_in_every_form(tmp_path: Path) -> None:
    cases = {
        "memo.py": "from nodescope.memo import Memo\n_last = Memo[int]()\n",
        "lock.py": "import threading\n_lock = threading.Lock()\n",
        "walk.py": "SHARED = SharedWalk()\n",
        "rebind.py": "_n = 0\ndef bump() -> None:\n    global _n\n    _n += 1\n",
        "lru.py": "import functools\n@functools.lru_cache(maxsize=4)\ndef f(n: int) -> int:\n"
        "    return n\n",
        "cached_method.py": "from functools import cache\nclass A:\n    @cache\n"
        "    def f(self) -> int:\n        return 1\n",
        "registry.py": "SEEN: dict[str, int] = {}\ndef note(k: str) -> None:\n"
        "    SEEN[k] = SEEN.get(k, 0) + 1\n",
        "appended.py": "_log = []\ndef note(k: str) -> None:\n    _log.append(k)\n",
        "fine.py": "import re\nPATTERN = re.compile('x')\nTABLE = {'a': 1}\n"
        "import functools\n@functools.wraps(print)\ndef g() -> None:\n"
        "    local = dict(TABLE)\n    local['b'] = 2\n",
    }
    for name, text in cases.items():
        _write(tmp_path, name, text)
    assert {name: bool(module_state(tmp_path / name)) for name in cases} == {
        "memo.py": True,
        "lock.py": True,
        "walk.py": True,
        "rebind.py": True,
        "lru.py": True,
        "cached_method.py": True,
        "registry.py": True,
        "appended.py": True,
        "fine.py": False,
    }


# --- what each module loads ------------------------------------------------------------------

#: The remediation's parts that act on Slurm (run scontrol, change nodes): a source may read
#: the remediation's record, never load what drains.
REMEDIATION_ACTING = (
    "nodescope.remediation.act",
    "nodescope.remediation.gateway",
    "nodescope.remediation.slurm",
)


@dataclass(frozen=True)
class LoadRule:
    """Importing any module of ``layer`` must not load any module of ``must_not_load``."""

    layer: tuple[str, ...]
    must_not_load: tuple[str, ...]
    why: str
    #: Modules of ``layer`` the rule does not cover.
    exempt: tuple[str, ...] = ()

    def covers(self, module: str) -> bool:
        return _within(module, self.layer) and not _within(module, self.exempt)


#: The probe's modules that measure with torch: run in the probe's own process, and not
#: imported by the check (torch alone takes seconds to load).
PROBE_MEASURING = ("nodescope.probe.measure", "nodescope.probe.allreduce")

#: Layer -> what importing it may not load, and why. Checked on every module of the two
#: packages (but :data:`PROBE_MEASURING`) imported alone.
LOAD_RULES = (
    LoadRule(
        ("nodescope.detectors",),
        ("nodescope.sources",),
        "a detector judges the records it is handed; how they were read is not its business",
    ),
    LoadRule(
        ("nodescope.model",),
        (
            "nodescope.sources",
            "nodescope.detectors",
            "nodescope.hooks",
            "nodescope.remediation",
            "nodescope_exporters",
        ),
        "the model is the bottom of the flow: every stage reads its records, it reads none",
    ),
    LoadRule(
        ("nodescope.sources",),
        (
            "nodescope.hooks",
            "nodescope.detectors",
            *REMEDIATION_ACTING,
            "nodescope_exporters",
        ),
        "a source reads the node (the remediation's record among it) and makes records; "
        "judging, acting and exporting come after it",
    ),
    LoadRule(
        ("nodescope.remediation",),
        ("nodescope.hooks",),
        "the hooks call the remediation, never the other way: a cycle would make every part "
        "of either load the whole of both",
    ),
    LoadRule(
        ("nodescope.hooks.transport", "nodescope.hooks.auth", "nodescope.hooks.request"),
        (
            "nodescope.remediation",
            "nodescope.hooks.tracker",
            "nodescope.hooks.daemon",
            "nodescope.analysis",
            "nodescope.detectors",
            "nodescope_exporters",
        ),
        "the socket, who may reach it and the job a request names are what every client of "
        "the socket imports (a hook, the probe command): not what the daemon does with a call",
    ),
    LoadRule(
        ("nodescope.config",),
        ("nodescope.sources", "nodescope.detectors"),
        "every stage reads the configuration: if it loaded a stage, every detector would "
        "load the sources through it",
    ),
    LoadRule(
        ("nodescope_exporters",),
        ("nodescope.sources",),
        "the exporters render records and findings, whoever read them",
    ),
    LoadRule(
        ("nodescope", "nodescope_exporters"),
        ("torch",),
        "the daemon's RSS budget is tens of MiB; the probe measures with torch in a process "
        "of its own",
        exempt=PROBE_MEASURING,
    ),
)

#: Run in a fresh interpreter: fork, once per module named on the command line, a process that
#: imports that module and nothing else of the packages, and print one JSON line: the module,
#: the modules of the watched top-level names loaded after its import, and its import error.
#: A forked child of an interpreter that holds only the standard library starts as a fresh
#: interpreter does, without paying for a start per module.
_LOADER = """
import json, os, sys
watched = set(sys.argv[1].split(","))
for name in sys.argv[2:]:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        # Whatever a module prints as it is imported must not mix with the results.
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        error = ""
        try:
            __import__(name)
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
        loaded = sorted(m for m in sys.modules if m.partition(".")[0] in watched)
        line = json.dumps({"module": name, "loaded": loaded, "error": error}) + "\\n"
        with os.fdopen(write_end, "w") as out:
            out.write(line)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as result:
        sys.stdout.write(result.read())
    os.waitpid(pid, 0)
"""


@dataclass(frozen=True)
class Loaded:
    """What importing one module alone loads of the watched names, or why it failed."""

    modules: frozenset[str]
    error: str


def load_each(
    modules: Sequence[str],
    watched: Sequence[str],
    path: Sequence[Path] = (),
    workers: int = 0,
) -> dict[str, Loaded]:
    """Import each of ``modules`` alone in a fresh interpreter; ``path`` goes before the
    interpreter's own. The modules are shared among ``workers`` interpreters (one per CPU by
    default) run at once, each forking one child per module."""
    workers = workers or max(2, os.cpu_count() or 2)
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = os.pathsep.join(
            [*map(str, path), *filter(None, [env.get("PYTHONPATH")])]
        )
    # Slow modules are spread over the interpreters: every worker takes every n-th module.
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", _LOADER, ",".join(watched), *modules[i::workers]],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )
        for i in range(workers)
        if modules[i::workers]
    ]
    results: dict[str, Loaded] = {}
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err
        for line in out.splitlines():
            row = json.loads(line)
            results[row["module"]] = Loaded(frozenset(row["loaded"]), row["error"])
    assert set(results) == set(modules), err
    return results


def load_breaches(
    loads: Mapping[str, Loaded], rules: Sequence[LoadRule]
) -> dict[LoadRule, dict[str, list[str]]]:
    """Per rule, each module it covers that loads what it must not: module -> those loaded."""
    found: dict[LoadRule, dict[str, list[str]]] = {}
    for rule in rules:
        for module, loaded in sorted(loads.items()):
            if not rule.covers(module):
                continue
            bad = sorted(m for m in loaded.modules if _within(m, rule.must_not_load))
            if bad:
                found.setdefault(rule, {})[module] = bad
    return found


#: Packages that are one part as a whole (the others' parts are their subpackages and modules).
WHOLE_PARTS = frozenset({"nodescope_exporters", "torch"})


def area(module: str) -> str:
    """The part of a package a module belongs to: ``nodescope.hooks`` for
    ``nodescope.hooks.auth``, ``nodescope.config`` for itself, the exporters as one."""
    parts = module.split(".")
    return parts[0] if parts[0] in WHOLE_PARTS else ".".join(parts[:2])


def mutual_loads(loads: Mapping[str, Loaded]) -> dict[tuple[str, str], tuple[str, str]]:
    """Pairs of areas each of which loads the other: (area, area) -> a module of each that
    loads the other area."""
    witness: dict[tuple[str, str], str] = {}
    for module, loaded in sorted(loads.items()):
        for other in sorted({area(m) for m in loaded.modules} - {area(module)}):
            witness.setdefault((area(module), other), module)
    return {
        (a, b): (witness[a, b], witness[b, a])
        for a, b in sorted(witness)
        if a < b and (b, a) in witness
    }


@pytest.fixture(scope="module")
def loads() -> dict[str, Loaded]:
    modules = [m for m, _path in module_files(PACKAGE_ROOTS) if not _within(m, PROBE_MEASURING)]
    return load_each(modules, ("nodescope", "nodescope_exporters", "torch"))


def test_every_module_imports_alone(loads: dict[str, Loaded]) -> None:
    # A module that imports only after another one was imported first hides a cycle.
    failed = {module: loaded.error for module, loaded in loads.items() if loaded.error}
    assert not failed, "modules that fail to import alone:\n" + "\n".join(
        f"  {module}: {error}" for module, error in sorted(failed.items())
    )


@pytest.mark.parametrize("rule", LOAD_RULES, ids=lambda rule: rule.layer[0])
def test_no_layer_loads_what_its_rule_forbids(loads: dict[str, Loaded], rule: LoadRule) -> None:
    broken = load_breaches(loads, [rule]).get(rule, {})
    assert not broken, (
        f"{', '.join(rule.layer)} must not load {', '.join(rule.must_not_load)}: {rule.why}\n"
        + "\n".join(f"  {module} loads {', '.join(bad)}" for module, bad in broken.items())
    )


def test_no_two_parts_load_each_other(loads: dict[str, Loaded]) -> None:
    cycles = mutual_loads(loads)
    assert not cycles, "parts that load each other:\n" + "\n".join(
        f"  {a} <-> {b} ({via_a} loads {b}; {via_b} loads {a})"
        for (a, b), (via_a, via_b) in cycles.items()
    )


def test_what_loads_is_seen_through_packages_and_hubs(tmp_path: Path) -> None:
    # A toy of the tangles the rules are for: the detector imports only the configuration,
    # the configuration a source; the source the hooks' socket, whose package imports the
    # remediation, which imports the socket again.
    toy = tmp_path / "toyscope"
    for package in ("", "sources/", "detectors/", "hooks/", "remediation/"):
        _write(toy, package + "__init__.py", "")
    _write(toy, "hooks/__init__.py", "from toyscope.hooks import gate\n")
    _write(toy, "hooks/gate.py", "import toyscope.remediation.act\n")
    _write(toy, "hooks/auth.py", "")
    _write(toy, "remediation/act.py", "from toyscope.hooks import auth\n")
    _write(toy, "sources/pci.py", "import toyscope.hooks.auth\n")
    _write(toy, "config.py", "from toyscope.sources import pci\n")
    _write(toy, "detectors/links.py", "import toyscope.config\n")
    _write(toy, "detectors/late.py", "def f():\n    import toyscope.sources.pci\n")
    _write(toy, "broken.py", "print('{}')\nimport toyscope.nowhere\n")
    modules = [
        "toyscope.detectors.links",
        "toyscope.detectors.late",
        "toyscope.sources.pci",
        "toyscope.remediation.act",
        "toyscope.hooks.gate",
        "toyscope.broken",
    ]
    loads = load_each(modules, ("toyscope",), path=[tmp_path], workers=2)
    rules = [
        LoadRule(("toyscope.detectors",), ("toyscope.sources",), ""),
        LoadRule(("toyscope.sources",), ("toyscope.remediation",), ""),
        LoadRule(("toyscope.remediation",), ("toyscope.hooks",), ""),
    ]
    assert {rule.layer[0]: broken for rule, broken in load_breaches(loads, rules).items()} == {
        "toyscope.detectors": {
            "toyscope.detectors.links": ["toyscope.sources", "toyscope.sources.pci"]
        },
        "toyscope.sources": {
            "toyscope.sources.pci": ["toyscope.remediation", "toyscope.remediation.act"]
        },
        "toyscope.remediation": {
            "toyscope.remediation.act": [
                "toyscope.hooks",
                "toyscope.hooks.auth",
                "toyscope.hooks.gate",
            ]
        },
    }
    assert mutual_loads(loads) == {
        ("toyscope.hooks", "toyscope.remediation"): (
            "toyscope.hooks.gate",
            "toyscope.remediation.act",
        )
    }
    assert loads["toyscope.broken"].error.startswith("ModuleNotFoundError")
