from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope import assembly, config
from nodescope import options as options_module
from nodescope.errors import ConfigError
from nodescope.sources.registry import SOURCES
from tests.conftest import nodescope_command


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "nodescope.toml"
    path.write_text(text)
    return path


def test_defaults_without_a_file() -> None:
    cfg = assembly.default_config()
    assert cfg.listen_address == ("127.0.0.1", config.DEFAULT_PORT)
    assert cfg.sources["disks"].enabled
    assert str(cfg.roots.sysfs) == "/sys"


def test_full_file_is_applied(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[daemon]
listen = "[::1]:9100"
tick_seconds = 2
log_level = "debug"
[roots]
sysfs = "/srv/fixture/sys"
[sources.disks]
interval_seconds = 0.5
[sources.pci]
enabled = false
""",
    )
    cfg = assembly.load(path)
    assert cfg.listen_address == ("::1", 9100)
    assert cfg.tick_seconds == 2.0
    assert str(cfg.roots.sysfs) == "/srv/fixture/sys"
    assert str(cfg.roots.procfs) == "/proc"
    assert cfg.sources["disks"].interval_seconds == 0.5
    assert not cfg.sources["pci"].enabled
    assert cfg.path == str(path)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[daemon]\nlisten_addr = '1'\n", "daemon.listen_addr"),
        ("[daemon]\ntick_seconds = 0\n", "daemon.tick_seconds"),
        ("[daemon]\ntick_seconds = 'fast'\n", "daemon.tick_seconds"),
        ("[daemon]\nlisten = 'nohost'\n", "daemon.listen"),
        ("[daemon]\nlisten = '127.0.0.1:99999'\n", "daemon.listen"),
        ("[daemon]\nlog_level = 'loud'\n", "daemon.log_level"),
        ("[roots]\nsysfs = 'relative'\n", "roots.sysfs"),
        ("[roots]\nbogus = '/x'\n", "roots.bogus"),
        ("[sources.gpu_magic]\nenabled = true\n", "sources.gpu_magic"),
        ("[sources.disks]\nenabled = 1\n", "sources.disks.enabled"),
        ("[sources.disks]\ninterval_seconds = -1\n", "sources.disks.interval_seconds"),
        ("[extras]\n", "extras"),
    ],
)
def test_bad_key_or_value_names_key_and_file(tmp_path: Path, text: str, key: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        assembly.load(path)
    assert info.value.key == key
    assert str(path) in str(info.value)
    assert key in str(info.value)


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[daemon\n")
    with pytest.raises(ConfigError, match="not valid TOML") as info:
        assembly.load(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        assembly.load(tmp_path / "absent.toml")


@pytest.mark.parametrize("command", ["run", "snapshot"])
def test_cli_exits_2_on_a_bad_config(tmp_path: Path, command: str) -> None:
    path = write(tmp_path, "[daemon]\nunknown = 1\n")
    proc = subprocess.run(
        [*nodescope_command(), command, "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "daemon.unknown" in proc.stderr
    assert str(path) in proc.stderr


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["daemon", "roots", "sources", "other"]),
        st.dictionaries(
            st.text(max_size=12),
            st.one_of(st.integers(), st.floats(), st.text(max_size=8), st.booleans(), st.none()),
            max_size=4,
        ),
        max_size=3,
    )
)
def test_arbitrary_documents_are_either_valid_or_config_errors(doc: dict[str, object]) -> None:
    try:
        cfg = assembly.from_mapping(doc, "fuzz.toml")
    except ConfigError as exc:
        assert "fuzz.toml" in str(exc)
    else:
        assert cfg.tick_seconds > 0


def test_reference_lists_every_option() -> None:
    ref = assembly.reference_markdown()
    for option in config.DAEMON_OPTIONS:
        assert f"`daemon.{option.key}`" in ref
    assert "`sources.disks.interval_seconds`" in ref


# -- bounds, the nesting scan and the listen address -----------------------------------------


@pytest.mark.parametrize(
    ("bounds", "value", "problem"),
    [
        (config.Range(0.1, 60), 0.1, None),
        (config.Range(0.1, 60), 60, None),
        (config.Range(0.1, 60), 60.000001, "must be a finite number between 0.1 and 60, not"),
        (config.Range(0.1, 3600), math.inf, "between 0.1 and 3600, not inf"),
        (config.Range(0.1, 3600), math.nan, "not nan"),
        (config.Range(0, 1, low_open=True), 0, "above 0 and at most 1, not 0"),
        (config.Range(0, 1e13), 10**400, "between 0 and 1e13, not an integer of 1329 bits"),
        (config.Range(0, 1024, integer=True), 1025, "must be an integer between 0 and 1024"),
    ],
)
def test_range_names_its_bounds(bounds: config.Range, value: float, problem: str | None) -> None:
    found = bounds(value)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


@pytest.mark.parametrize(
    "text",
    [
        "a = [[1, 2], [3]]\n[[t]]\n[x.y.z]\nk = {a = {b = [1]}}\n",
        'a = "[[[[[[[[[[[[[["\n',
        "a = '{{{{{{{{{{{{{{{{'\n",
        'a = """\n[[[[[[[[[[[[\n"""\n',
        'a = """x""""\nb = [1]\n',  # a multi-line string may end in two more quotes
        "a = '''\n{{{{{{{{{{{\n'''''\n",
        "# [[[[[[[[[[[[[[[[[[[[\na = 1\n",
        'a = "\\"[[[[[[[[[[[[[[[[["\n',
        '"a.b.c.d.e.f.g.h.i.j" = 1\n',  # one quoted key part, dots inside it
        "a.b.c.d.e.f.g.h = 1\n",  # 8 parts: the most allowed
        "a = [1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5, 8.5, 9.5, 10.5]\n",
    ],
)
def test_the_scan_lets_the_schema_through(text: str) -> None:
    tomllib.loads(text)
    assert config.structure_problem(text) is None


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("a = " + "[" * 9 + "]" * 9 + "\n", "line 1: arrays and tables nested more than 8 deep"),
        ("x = 1\na = " + "{b = " * 9 + "1" + "}" * 9, "line 2: arrays and tables nested"),
        ("a.b.c.d.e.f.g.h.i = 1\n", "line 1: a dotted key of more than 8 parts"),
        ('[a . "b" . c.d.e.f.g.h.i]\n', "dotted key of more than 8 parts"),
        ('a = "]]]"\nb = ' + "[" * 9 + "]" * 9, "line 2: arrays and tables nested"),
    ],
)
def test_the_scan_refuses_what_the_schema_cannot_use(text: str, problem: str) -> None:
    found = config.structure_problem(text)
    assert found is not None and problem in found


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("127.0.0.1:9839", ("127.0.0.1", 9839)),
        ("[::1]:9100", ("::1", 9100)),
        ("[::]:0", ("::", 0)),
        ("0.0.0.0:9839", ("0.0.0.0", 9839)),
        ("node17.mgmt.example:9839", ("node17.mgmt.example", 9839)),
        ("localhost:9839", ("localhost", 9839)),
    ],
)
def test_listen_addresses_an_operator_writes(value: str, parsed: tuple[str, int]) -> None:
    assert config.parse_listen(value) == parsed


@pytest.mark.parametrize(
    "value",
    ["127.0.0.1: 80", "127.0.0.1:+80", "127.0.0.1:8_0", "*:80", "[]:80", "a b:80", "x" * 64 + ":1"],
)
def test_listen_addresses_getaddrinfo_would_choke_on(value: str) -> None:
    with pytest.raises(ValueError):
        config.parse_listen(value)


def _sample_tables() -> dict[str, dict[str, config.Option]]:
    """Table header as the sample writes it -> the options the code declares for it."""
    tables = {table: {o.key: o for o in options} for table, options in config._tables(SOURCES)}
    tables[f"alerts.rules.{config.SAMPLE_RULE_KIND}"] = tables.pop("alerts.rules.<kind>")
    return tables


def test_bounds_in_the_sample_comments_are_the_codes() -> None:
    """``tick_seconds = 1.0  # a finite number between 0.1 and 60`` in systemd/nodescope.toml
    says what the code holds, in every table."""
    from tests.conftest import REPO

    tables = _sample_tables()
    table = ""
    header = re.compile(r"^(?:# )?\[([a-z_.]+)\]$")
    value = re.compile(r"^# ([a-z0-9_]+) = (.+?)(?:\s+# (.+))?$")
    checked = 0
    for line in (REPO / "systemd" / "nodescope.toml").read_text().splitlines():
        if found := header.match(line):
            table = found.group(1)
        elif (found := value.match(line)) and table in tables:
            key, _, allowed = found.groups()
            option = tables[table][key]
            if allowed is not None:
                assert isinstance(
                    option.check, config.Range | config.IntList | config.NameList | config.OneOf
                )
                assert allowed == option.check.allowed, line
                checked += 1
    bounded = [o for options in tables.values() for o in options.values() if o.default is not None]
    bounded = [o for o in bounded if isinstance(o.check, config.Range)]
    assert checked >= len(bounded) > 40


def test_the_shipped_sample_is_the_generated_one() -> None:
    """systemd/nodescope.toml is what the declarations generate: run
    ``python -m nodescope.docgen --sample systemd/nodescope.toml`` after changing an option."""
    from tests.conftest import REPO

    assert (REPO / "systemd" / "nodescope.toml").read_text() == assembly.sample_toml()


def test_the_sample_shows_every_default(tmp_path: Path) -> None:
    """Every ``# key = value`` of the sample, uncommented, is the code's default: the file
    then loads to the configuration of no file at all (plus the example alert rule)."""
    lines = [
        line[2:] if re.match(r"^# (\[|[a-z0-9_]+ = |\"[A-Za-z0-9]+\" = )", line) else line
        for line in assembly.sample_toml().splitlines()
    ]
    cfg = assembly.load(write(tmp_path, "\n".join(lines) + "\n"))
    defaults = assembly.default_config()
    assert cfg.alerts.rules == {config.SAMPLE_RULE_KIND: config.AlertRuleSettings(enabled=True)}
    assert dataclasses.replace(cfg.alerts, rules={}) == dataclasses.replace(
        defaults.alerts, rules={}
    )
    for name in ("listen", "tick_seconds", "log_level", "roots", "detectors", "probe", "slurm"):
        assert getattr(cfg, name) == getattr(defaults, name), name
    assert dict(cfg.sources) == dict(defaults.sources)
    assert dict(cfg.detectors.saturation_models) == {"A100": 0.57}
    uncommented = sum(1 for line in lines if re.match(r"^[a-z0-9_]+ = ", line))
    declared = sum(
        1 for _, options in config._tables(SOURCES) for o in options if o.default is not None
    )
    assert uncommented == declared


# -- one declaration per option, typed reads ---------------------------------------------------


def test_each_option_is_its_fields_default_type_and_check() -> None:
    """The validator's options are read off the declaring classes: key, default and TOML type
    are the field's, so a default cannot differ between the code and the documents."""
    pairs = [
        (config.Config, config.DAEMON_OPTIONS),
        (config.AlertsSettings, config.ALERT_OPTIONS),
        (config.ProbeSettings, config.PROBE_OPTIONS),
        (config.SlurmSettings, config.SLURM_OPTIONS),
        *((config.DETECTOR_SECTIONS[n], o) for n, o in config.DETECTOR_OPTIONS.items()),
    ]
    for declaring, options in pairs:
        instance = declaring()
        assert [o.key for o in options] == [
            f.name for f in dataclasses.fields(declaring) if options_module._ABOUT in f.metadata
        ]
        for option in options:
            assert getattr(instance, option.key) == option.default, (declaring, option.key)
            kind = list if isinstance(option.default, tuple) else type(option.default)
            assert option.kind is kind, (declaring, option.key)
    kinds = {o.key: o.kind for o in config.ALERT_RULE_OPTIONS}
    assert kinds["enabled"] is bool and kinds["for_seconds"] is float
    assert config.AlertRuleSettings().enabled is None  # unset: the built-in rule decides


def test_detector_settings_are_typed_attributes() -> None:
    cfg = assembly.from_mapping(
        {
            "detectors": {
                "contention": {"utilisation_ratio": 0.75},
                "hangs": {"enabled": False, "idle_bytes_per_second": 5},
                "saturation": {"models": {"H100": 0.5}},
            }
        }
    )
    detectors = cfg.detectors
    assert detectors.contention.utilisation_ratio == 0.75
    assert detectors.contention.min_share == 0.1
    assert detectors.hangs.enabled is False
    assert detectors.hangs.idle_bytes_per_second == 5.0
    assert isinstance(detectors.hangs.idle_bytes_per_second, float)
    assert dict(detectors.saturation_models) == {"A100": 0.57, "H100": 0.5}
    # The tables by name hold the same values.
    for name, options in config.DETECTOR_OPTIONS.items():
        typed = getattr(detectors, name)
        assert isinstance(typed, config.DETECTOR_SECTIONS[name])
        for option in options:
            assert detectors.values[name][option.key] == getattr(typed, option.key)


def test_detector_tables_replaced_by_name_keep_the_typed_attributes_in_step() -> None:
    """A copy with other ``values`` (how tests turn one detector off) rebuilds the typed
    attributes, and a partial table takes the defaults of the keys it leaves out."""
    base = assembly.default_config().detectors
    values = {name: dict(table) for name, table in base.values.items()}
    values["hangs"]["enabled"] = False
    off = dataclasses.replace(base, values=values)
    assert off.hangs.enabled is False and off.values["hangs"]["enabled"] is False
    assert off.contention == base.contention
    partial = config.DetectorsSettings({"nvlink": {"utilisation_warning_ratio": 0.5}})
    assert partial.nvlink.utilisation_warning_ratio == 0.5
    assert partial.values["nvlink"]["utilisation_critical_ratio"] == 0.9
    assert partial.errors.pcie_replays_warning_per_minute == 8.0


def test_source_settings_take_their_sources_interval() -> None:
    from nodescope.sources.registry import SOURCE_TABLE

    cfg = assembly.from_mapping({"sources": {"pci": {"timeout_seconds": 2}}})
    for info in SOURCE_TABLE:
        assert cfg.sources[info.name].interval_seconds == info.default_interval
        assert (
            assembly.default_config().sources[info.name] == cfg.sources[info.name]
            or info.name == "pci"
        )
    assert cfg.sources["pci"].timeout_seconds == 2.0


@dataclasses.dataclass(frozen=True)
class _Declared:
    """A source as the configuration sees one (``config.SourceDeclaration``)."""

    name: str
    default_interval: float
    help: str
    settings: type[object] | None = None


def test_the_sources_configured_are_the_ones_handed_in_not_a_list_of_its_own(
    tmp_path: Path,
) -> None:
    """The configuration knows no source itself: a file's ``[sources.<name>]`` tables, the
    defaults and both documents follow the catalogue it is handed."""
    from nodescope.model.netdev import NetdevOptions

    lab = _Declared("lab", 7.0, "reads the lab's bench", NetdevOptions)
    catalogue = {"lab": lab}
    cfg = config.from_mapping({"sources": {"lab": {"max_links": 3}}}, "t.toml", catalogue=catalogue)
    assert list(cfg.sources) == ["lab"]
    assert cfg.sources["lab"].interval_seconds == 7.0
    assert cfg.sources["lab"].extra == NetdevOptions(max_links=3)
    path = write(tmp_path, "[sources.lab]\ninterval_seconds = 2\n")
    assert config.load(path, catalogue=catalogue).sources["lab"].interval_seconds == 2.0
    # A source of the registry is unknown to a catalogue without it.
    with pytest.raises(ConfigError, match=r"sources\.pci.*unknown source"):
        config.from_mapping({"sources": {"pci": {}}}, "t.toml", catalogue=catalogue)
    with pytest.raises(ConfigError, match=r"sources\.lab\.netns"):
        config.from_mapping({"sources": {"lab": {"netns": "../x"}}}, "t.toml", catalogue=catalogue)
    reference = config.reference_markdown(catalogue)
    assert "| `sources.lab.interval_seconds` | float | `7.0` |" in reference
    assert "| `sources.lab.max_links` |" in reference
    assert "sources.pci" not in reference
    sample = config.sample_toml(catalogue)
    assert "[sources.lab]\n## reads the lab's bench\n" in sample and "sources.pci" not in sample
    assert dict(config.default_sources(catalogue)) == {
        "lab": config.SourceSettings(interval_seconds=7.0, extra=NetdevOptions())
    }


def test_a_bare_config_configures_no_source_and_the_default_one_every_source() -> None:
    """``Config()`` holds the stages after the sources; the daemon's default configuration
    is the composition root's, each source of the registry at its spec's defaults."""
    assert dict(config.Config().sources) == {}
    default = assembly.default_config()
    assert list(default.sources) == list(SOURCES)
    assert default.sources == assembly.from_mapping({}).sources
    assert dataclasses.replace(default, sources={}) == config.Config()


# -- the netlink sources' own keys ----------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "table", "key"),
    [
        ("netdev", {"netns": "../../proc/1/ns/net"}, "netns"),
        ("netdev", {"netns": "a/b"}, "netns"),
        ("netdev", {"netns": ".."}, "netns"),
        ("netdev", {"netns": "."}, "netns"),
        ("netdev", {"netns": "ns\n1"}, "netns"),
        ("netdev", {"netns": "x" * 256}, "netns"),
        ("netdev", {"netns": 3}, "netns"),
        ("netdev", {"max_links": 0}, "max_links"),
        ("netdev", {"max_links": 65537}, "max_links"),
        ("netdev", {"max_links": 1.5}, "max_links"),
        ("netdev", {"max_links": True}, "max_links"),
        ("netdev", {"include_virtual": True}, "include_virtual"),
        ("link_events", {"netns": "/run/netns/a"}, "netns"),
        ("link_events", {"include_virtual": "yes"}, "include_virtual"),
        ("link_events", {"max_links": 4}, "max_links"),
    ],
)
def test_bad_netlink_source_keys_are_refused_with_their_key(
    source: str, table: dict[str, object], key: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        assembly.from_mapping({"sources": {source: table}}, "net.toml")
    assert f"sources.{source}.{key}" in str(caught.value)


def test_the_netlink_sources_are_built_with_their_keys() -> None:
    from nodescope.collect import Collector
    from nodescope.model.link_events import LinkEventsOptions
    from nodescope.model.netdev import MAX_LINKS, NetdevOptions
    from nodescope.sources.link_events import LinkEventsSource
    from nodescope.sources.netlink import NetdevSource

    # Empty: the daemon's own namespace, which the sources open as None.
    assert config.netdev_options(assembly.default_config()) == NetdevOptions("", MAX_LINKS)
    assert config.link_events_options(assembly.default_config()) == LinkEventsOptions("", False)
    cfg = assembly.from_mapping(
        {
            "sources": {
                "netdev": {"netns": "pods-1.a_b", "max_links": 8},
                "link_events": {"netns": "pods-1.a_b", "include_virtual": True},
            }
        },
        "net.toml",
    )
    assert config.netdev_options(cfg) == NetdevOptions("pods-1.a_b", 8)
    assert config.link_events_options(cfg) == LinkEventsOptions("pods-1.a_b", True)
    collector = Collector.from_config(cfg)
    try:
        built = {s.source.name: s.source for s in collector.scheduled}
        netdev, events = built["netdev"], built["link_events"]
        assert isinstance(netdev, NetdevSource) and isinstance(events, LinkEventsSource)
        assert (netdev.netns, netdev.max_links) == ("pods-1.a_b", 8)
        assert (events.netns, events.include_virtual) == ("pods-1.a_b", True)
    finally:
        collector.close()


def test_a_bad_netns_in_the_file_stops_the_daemon_with_status_2(tmp_path: Path) -> None:
    path = write(tmp_path, '[sources.netdev]\nnetns = "../../proc/1/ns/net"\n')
    done = subprocess.run(
        [*nodescope_command(), "run", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "sources.netdev.netns" in done.stderr
