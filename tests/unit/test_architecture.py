"""Data flows one way in the imports (docs/architecture.md): sources, model, detectors and
exporters import only in the direction of the flow.

The imports are read from the source text with :mod:`ast`, never by importing the modules,
so an import inside a function or under ``TYPE_CHECKING`` counts as much as one at the top,
and a module that would fail to import is still checked.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

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
)

#: The imports against the flow that the code still has: importer -> imported module.
#: This list may only shrink. A new entry means a new backward import: move the shared type
#: into ``nodescope.model`` (or pass the value in from the composition root) instead. An entry
#: whose import is gone fails the test until it is removed, so the list stays the exact debt.
ALLOWED_VIOLATIONS: frozenset[tuple[str, str]] = frozenset(
    {
        ("nodescope.detectors.common", "nodescope.sources.procs"),
        ("nodescope.detectors.errors", "nodescope.sources.infiniband"),
        ("nodescope.detectors.errors", "nodescope.sources.nvml"),
        ("nodescope.detectors.hangs", "nodescope.sources.cgroup"),
        ("nodescope.detectors.hangs", "nodescope.sources.locks"),
        ("nodescope.detectors.hangs", "nodescope.sources.mountstats"),
        ("nodescope.detectors.hangs", "nodescope.sources.nvml"),
        ("nodescope.detectors.hangs", "nodescope.sources.procs"),
        ("nodescope.detectors.hangs", "nodescope.sources.threads"),
        ("nodescope.detectors.hotplug", "nodescope.sources.link_events"),
        ("nodescope.detectors.hotplug", "nodescope.sources.nvml"),
        ("nodescope.detectors.hotplug", "nodescope.sources.udev"),
        ("nodescope.detectors.jobs", "nodescope.sources.cgroup"),
        ("nodescope.detectors.jobs", "nodescope.sources.jobs"),
        ("nodescope.detectors.jobs", "nodescope.sources.nvml"),
        ("nodescope.detectors.links", "nodescope.sources.nvml"),
        ("nodescope.detectors.nvlink", "nodescope.sources.nvlink_kmod"),
        ("nodescope.detectors.placement", "nodescope.sources.infiniband"),
        ("nodescope.detectors.traffic", "nodescope.sources.diskstats"),
        ("nodescope.detectors.traffic", "nodescope.sources.infiniband"),
        ("nodescope.detectors.traffic", "nodescope.sources.netlink"),
        ("nodescope.detectors.traffic", "nodescope.sources.nvml"),
        ("nodescope_exporters.cgroup_metrics", "nodescope.sources.cgroup"),
        ("nodescope_exporters.disk_metrics", "nodescope.sources.diskstats"),
        ("nodescope_exporters.event_metrics", "nodescope.sources.link_events"),
        ("nodescope_exporters.event_metrics", "nodescope.sources.locks"),
        ("nodescope_exporters.event_metrics", "nodescope.sources.mountstats"),
        ("nodescope_exporters.event_metrics", "nodescope.sources.threads"),
        ("nodescope_exporters.event_metrics", "nodescope.sources.udev"),
        ("nodescope_exporters.fabric_metrics", "nodescope.detectors.traffic"),
        ("nodescope_exporters.gpu_metrics", "nodescope.sources.nvlink_kmod"),
        ("nodescope_exporters.gpu_metrics", "nodescope.sources.nvml"),
        ("nodescope_exporters.network_metrics", "nodescope.sources.infiniband"),
        ("nodescope_exporters.network_metrics", "nodescope.sources.netlink"),
        ("nodescope_exporters.nvlink_metrics", "nodescope.sources.nvlink_kmod"),
        ("nodescope_exporters.reports", "nodescope.sources.diskstats"),
        ("nodescope_exporters.reports", "nodescope.sources.infiniband"),
        ("nodescope_exporters.reports", "nodescope.sources.nvml"),
    }
)


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
    }
