"""Each source declares itself once, in its own module (``SPEC``): a spec missing a part, or
a listed module without a spec, fails when the module is imported, not when the daemon first
runs the source; and every reader of the specs finds what it needs in them."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nodescope.sources.registry import SOURCE_MODULES, SOURCE_TABLE, SOURCES, load_specs
from nodescope.sources.spec import SIM_PARTS, SourceInputs, SourceSpec
from nodescope_exporters.prometheus import AREAS, ORDER, area_modules

_COMPLETE = """
    name="demo",
    default_interval=1.0,
    help="what the demo reads",
    build=lambda inputs: FunctionSource("demo", lambda roots: None),
    rates=None,
    metric_area="nodescope_exporters.disk_metrics",
    sim_parts=None,
"""


def _import_source_module(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    """Import a source module whose ``SPEC`` is ``SourceSpec(<body>)``, in a fresh
    interpreter, through the registry's loader: what the daemon does when it starts."""
    package = tmp_path / "demo_sources"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "demo.py").write_text(
        "from nodescope.sources.base import FunctionSource\n"
        "from nodescope.sources.spec import SourceSpec\n"
        f"SPEC = SourceSpec({body})\n"
    )
    script = textwrap.dedent(
        """
        from nodescope.sources.registry import load_specs
        print([spec.name for spec in load_specs(["demo_sources.demo"])])
        """
    )
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": f"{tmp_path}:{':'.join(sys.path)}"},
        check=False,
        timeout=60,
    )


def test_a_complete_spec_loads(tmp_path: Path) -> None:
    done = _import_source_module(tmp_path, _COMPLETE)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['demo']"


@pytest.mark.parametrize(
    "part", ["name", "default_interval", "help", "build", "rates", "metric_area", "sim_parts"]
)
def test_a_spec_missing_a_part_fails_at_import(tmp_path: Path, part: str) -> None:
    body = "".join(
        line + "\n" for line in _COMPLETE.splitlines() if not line.strip().startswith(f"{part}=")
    )
    done = _import_source_module(tmp_path, body)
    assert done.returncode != 0
    assert "TypeError" in done.stderr and f"'{part}'" in done.stderr, done.stderr
    assert "demo_sources/demo.py" in done.stderr  # raised by the import of the module


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("default_interval=0.0,", "default_interval"),
        ('help=" ",', "help"),
        ('metric_area="disk_metrics",', "metric_area"),
        ('sim_parts=frozenset({"gpus"}),', "sim_parts"),
        ('name="Demo Source",', "name"),
    ],
)
def test_a_spec_with_a_bad_part_fails_at_import(tmp_path: Path, change: str, message: str) -> None:
    key = change.split("=", 1)[0]
    body = "".join(
        (f"    {change}" if line.strip().startswith(f"{key}=") else line) + "\n"
        for line in _COMPLETE.splitlines()
    )
    done = _import_source_module(tmp_path, body)
    assert done.returncode != 0
    assert "ValueError" in done.stderr and message in done.stderr, done.stderr


def test_a_listed_module_without_a_spec_fails_where_the_registry_loads() -> None:
    with pytest.raises(TypeError, match=r"nodescope\.sources\.base declares no source"):
        load_specs(["nodescope.sources.pci", "nodescope.sources.base"])


def test_two_modules_declaring_one_name_fail_where_the_registry_loads() -> None:
    with pytest.raises(ValueError, match="both declare source 'pci'"):
        load_specs(["nodescope.sources.pci", "nodescope.sources.pci"])


def test_every_listed_module_declares_the_source_it_is_listed_for() -> None:
    assert [spec.name for spec in SOURCE_TABLE] == list(SOURCES)
    for module, spec in zip(SOURCE_MODULES, SOURCE_TABLE, strict=True):
        assert importlib.import_module(module).SPEC is spec


def test_an_area_module_is_exported_without_a_line_in_the_exporters_order() -> None:
    """A new source's metric area is loaded by its name alone; the order only places it."""
    area = "nodescope_exporters.pressure_metrics"
    without = area_modules([name for name in ORDER if f"nodescope_exporters.{name}" != area])
    assert set(without) == set(AREAS) and without[-1] == area
    # The order names no module that is not there.
    assert {f"nodescope_exporters.{name}" for name in ORDER} <= set(AREAS)


def test_every_spec_builds_its_own_source_and_names_a_metric_area_that_renders() -> None:
    for spec in SOURCE_TABLE:
        assert spec.metric_area in AREAS, spec.name
        assert not spec.sim_parts or spec.sim_parts <= SIM_PARTS
        if spec.name in ("nvml", "udev", "link_events", "netdev"):
            continue  # a library or a monitor thread this machine may not have
        source = spec.make(SourceInputs())
        try:
            assert source.name == spec.name
        finally:
            source.close()


def test_a_spec_whose_build_makes_another_source_is_refused_when_built() -> None:
    other = SourceSpec(
        name="other",
        default_interval=1.0,
        help="what it reads",
        build=SOURCES["mountstats"].build,
        rates=None,
        metric_area="nodescope_exporters.event_metrics",
        sim_parts=None,
    )
    with pytest.raises(RuntimeError, match="built a source named 'mountstats'"):
        other.make()


def test_a_sources_own_keys_are_the_ones_its_spec_declares_and_reach_the_source(
    tmp_path: Path,
) -> None:
    from nodescope import assembly, config
    from nodescope.options import options_of

    with_keys = {spec.name: spec.settings for spec in SOURCE_TABLE if spec.settings is not None}
    assert set(with_keys) == {"netdev", "link_events", "traces"}
    reference = assembly.reference_markdown()
    for name, settings in with_keys.items():
        for option in options_of(settings):
            assert f"| `sources.{name}.{option.key}` |" in reference, (name, option.key)
    # One declaration: the object the file's keys make is what the source is built from.
    cfg = assembly.from_mapping({"sources": {"netdev": {"max_links": 3}}}, "t.toml")
    options = config.netdev_options(cfg)
    assert isinstance(options, SOURCES["netdev"].settings) and options.max_links == 3


def test_a_spec_whose_settings_declare_no_key_fails_at_import(tmp_path: Path) -> None:
    body = _COMPLETE + "    settings=int,\n"
    done = _import_source_module(tmp_path, body)
    assert done.returncode != 0
    assert "settings must be a dataclass declaring its keys with option()" in done.stderr
