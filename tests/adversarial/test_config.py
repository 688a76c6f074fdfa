"""The config file as an operator's mistake or a planted file makes it: numbers out of any
sensible range, nesting that would exhaust the parser, files that are not files.

Every case is refused with one line naming the file (and the key), exit status 2 at start; on
SIGHUP the running daemon keeps its config, goes on collecting and serving, and counts the
failure. Subprocesses run under an address-space limit so that a regression (reading
``/dev/zero`` to the end) fails the test instead of the machine.
"""

from __future__ import annotations

import math
import os
import resource
import signal
import socket
import subprocess
import time
import tomllib
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodescope import assembly, config
from nodescope.collect import Collector
from nodescope.errors import ConfigError
from nodescope.service import Service
from nodescope.sources.registry import SOURCE_TABLE
from tests.conftest import nodescope_command
from tests.integration.daemon_harness import READY_S, Daemon, sample_value, wait_for

#: Address space of a nodescope subprocess: far above what it needs, far below what reading
#: /dev/zero to its end would take.
ADDRESS_SPACE = 2 << 30

#: How long a refused config may take to be reported, start of the interpreter included.
PROMPT_SECONDS = 15

#: 100,000 levels of arrays: a RecursionError inside tomllib, and over the size cap.
DEEP_ARRAYS = "a = " + "[" * 100_000 + "]" * 100_000 + "\n"
#: 30,000 levels fit under the size cap: refused by the nesting scan.
DEEP_ARRAYS_UNDER_CAP = "a = " + "[" * 30_000 + "]" * 30_000 + "\n"
DEEP_INLINE_TABLES = "a = " + "{b = " * 10_000 + "1" + "}" * 10_000 + "\n"
#: tomllib keeps every prefix of a dotted key: 30,000 parts are about 450 million tuple items.
LONG_DOTTED_KEY = "a" + ".b" * 30_000 + " = 1\n"


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def run_nodescope(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    proc = subprocess.run(
        [*nodescope_command(), *args],
        capture_output=True,
        text=True,
        timeout=PROMPT_SECONDS,
        preexec_fn=_limit_address_space,
        stdin=subprocess.DEVNULL,
    )
    return proc, time.monotonic() - started


# -- the files a config path can name ------------------------------------------------------


def _text(content: str) -> Callable[[Path], Path]:
    def make(directory: Path) -> Path:
        path = directory / "nodescope.toml"
        path.write_text(content)
        return path

    return make


def _fifo(directory: Path) -> Path:
    path = directory / "nodescope.toml"
    os.mkfifo(path)
    return path


def _dev_zero(directory: Path) -> Path:
    path = directory / "nodescope.toml"
    path.symlink_to("/dev/zero")
    return path


def _directory(directory: Path) -> Path:
    path = directory / "nodescope.toml"
    path.mkdir()
    return path


def _huge(directory: Path) -> Path:
    path = directory / "nodescope.toml"
    with path.open("w") as handle:
        handle.write("# " + "x" * (1 << 20) + "\n")  # a comment: valid TOML, 1 MiB of it
        handle.write("[daemon]\ntick_seconds = 1.0\n")
    return path


def _unix_socket(directory: Path) -> Iterator[Path]:
    path = directory / "nodescope.toml"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        yield path


#: name -> (make the file, what the one-line message must say)
BAD_FILES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "tick-inf": (_text("[daemon]\ntick_seconds = inf\n"), "daemon.tick_seconds"),
    "tick-1e12": (_text("[daemon]\ntick_seconds = 1e12\n"), "between 0.1 and 60"),
    "tick-nan": (_text("[daemon]\ntick_seconds = nan\n"), "daemon.tick_seconds"),
    "tick-negative": (_text("[daemon]\ntick_seconds = -1.0\n"), "daemon.tick_seconds"),
    "tick-bool": (_text("[daemon]\ntick_seconds = true\n"), "expected float, got bool"),
    "interval-inf": (
        _text("[sources.pci]\ninterval_seconds = inf\n"),
        "sources.pci.interval_seconds: must be a finite number between 0.1 and 3600, not inf",
    ),
    "integer-600-digits": (
        _text("[daemon]\ntick_seconds = 1" + "0" * 600 + "\n"),
        "daemon.tick_seconds",
    ),
    "deep-arrays": (_text(DEEP_ARRAYS), "64 KiB cap"),
    "deep-arrays-under-cap": (_text(DEEP_ARRAYS_UNDER_CAP), "nested more than 8 deep"),
    "deep-inline-tables": (_text(DEEP_INLINE_TABLES), "nested more than 8 deep"),
    "long-dotted-key": (_text(LONG_DOTTED_KEY), "dotted key of more than 8 parts"),
    "huge": (_huge, "64 KiB cap"),
    "fifo": (_fifo, "a FIFO"),
    "dev-zero": (_dev_zero, "a character device"),
    "directory": (_directory, "a directory"),
    "listen-label-too-long": (
        _text(f'[daemon]\nlisten = "{"a" * 100}.example:9839"\n'),
        "neither an IP address nor a host name",
    ),
}


def assert_one_line_refusal(proc: subprocess.CompletedProcess[str], path: Path, says: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert str(path) in lines[0]
    assert says in lines[0]


# -- validation, in process ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BAD_FILES))
@pytest.mark.alone  # refused within 2 s
def test_each_bad_file_is_a_config_error(tmp_path: Path, name: str) -> None:
    make, says = BAD_FILES[name]
    path = make(tmp_path)
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        assembly.load(path)
    assert time.monotonic() - started < 2
    message = str(info.value)
    assert str(path) in message and says in message
    assert "\n" not in message


def test_a_unix_socket_is_refused(tmp_path: Path) -> None:
    # open(2) of a socket fails with ENXIO before fstat could name it: refused either way.
    for path in _unix_socket(tmp_path):
        with pytest.raises(ConfigError, match=r"a socket|No such device or address") as info:
            assembly.load(path)
        assert str(path) in str(info.value)


def _range_options() -> Iterator[tuple[str, str, config.Option]]:
    """(table, key, option) of every option whose value is a bounded number."""
    sections: list[tuple[str, tuple[config.Option, ...]]] = [
        ("daemon", config.DAEMON_OPTIONS),
        ("sources.pci", config.SOURCE_OPTIONS),
        ("alerts", tuple(o for o in config.ALERT_OPTIONS)),
        ("alerts.rules.pcie_contention", config.ALERT_RULE_OPTIONS),
        ("probe", config.PROBE_OPTIONS),
        ("slurm", config.SLURM_OPTIONS),
        *((f"detectors.{name}", options) for name, options in config.DETECTOR_OPTIONS.items()),
    ]
    for table, options in sections:
        for option in options:
            if isinstance(option.check, config.Range):
                yield table, option.key, option


RANGE_OPTIONS = list(_range_options())


def test_every_number_option_has_bounds() -> None:
    """No number escapes the range checks: every float or int option carries a Range."""
    unbounded = [
        f"{table}.{o.key}"
        for table, options in [
            ("daemon", config.DAEMON_OPTIONS),
            ("sources.*", config.SOURCE_OPTIONS),
            ("alerts", config.ALERT_OPTIONS),
            ("alerts.rules.*", config.ALERT_RULE_OPTIONS),
            ("probe", config.PROBE_OPTIONS),
            ("slurm", config.SLURM_OPTIONS),
            *((f"detectors.{n}", opts) for n, opts in config.DETECTOR_OPTIONS.items()),
        ]
        for o in options
        if o.kind in (int, float) and not isinstance(o.check, config.Range)
    ]
    assert unbounded == []
    assert len(RANGE_OPTIONS) > 40


def _literal(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(value)


@pytest.mark.parametrize(("table", "key", "option"), RANGE_OPTIONS, ids=lambda v: str(v)[:40])
def test_every_number_option_refuses_what_is_out_of_bounds(
    tmp_path: Path, table: str, key: str, option: config.Option
) -> None:
    bounds = option.check
    assert isinstance(bounds, config.Range)
    outside = [math.inf, -math.inf, math.nan, bounds.high * 2 + 1, bounds.low - 1]
    if bounds.low_open:
        outside.append(bounds.low)
    path = tmp_path / "nodescope.toml"
    for value in outside:
        literal = _literal(value)
        if option.kind is int and math.isfinite(value):
            literal = str(int(value))
        path.write_text(f"[{table}]\n{key} = {literal}\n")
        with pytest.raises(ConfigError) as info:
            assembly.load(path)
        assert info.value.key == f"{table}.{key}", literal
        if option.kind is float or math.isfinite(value):
            assert bounds.allowed in str(info.value), literal


@pytest.mark.parametrize(("table", "key", "option"), RANGE_OPTIONS, ids=lambda v: str(v)[:40])
def test_every_number_option_takes_its_bounds(
    tmp_path: Path, table: str, key: str, option: config.Option
) -> None:
    bounds = option.check
    assert isinstance(bounds, config.Range)
    edges = [bounds.high] if bounds.low_open else [bounds.low, bounds.high]
    path = tmp_path / "nodescope.toml"
    for edge in edges:
        literal = str(int(edge)) if option.kind is int else repr(float(edge))
        extra = ""
        if table == "detectors.nvlink" and key.endswith("_warning_cycles_per_us"):
            extra = f"stall_critical_cycles_per_us = {literal}\n"
        if table == "detectors.nvlink" and key == "utilisation_warning_ratio":
            extra = f"utilisation_critical_ratio = {literal}\n"
        # A warning bound may not pass its critical one (nor the other way round): the
        # partner takes the same edge.
        if table == "detectors.errors" and ("warning" in key or "critical" in key):
            partner = (
                key.replace("warning", "critical")
                if "warning" in key
                else key.replace("critical", "warning")
            )
            extra = f"{partner} = {literal}\n"
        path.write_text(f"[{table}]\n{key} = {literal}\n{extra}")
        assembly.load(path)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[slurm]\nexpected_gpus = 2.0\n", "slurm.expected_gpus"),
        ("[slurm]\nexpected_gpus = true\n", "slurm.expected_gpus"),
        ("[slurm]\nmin_link_gen = 99\n", "slurm.min_link_gen"),
        ("[slurm]\ncheck_link_width = 1\n", "slurm.check_link_width"),
        ("[slurm]\nxid_codes = [79, true]\n", "slurm.xid_codes"),
        ("[slurm]\nxid_codes = [79, 1e3]\n", "slurm.xid_codes"),
        ("[slurm]\nxid_codes = [" + "79, " * 300 + "]\n", "slurm.xid_codes"),
        ("[slurm]\nrequired_modules = ['" + "m" * 65 + "']\n", "slurm.required_modules"),
        ('[slurm]\nreports_dir = "/var/lib/\\u0000x"\n', "slurm.reports_dir"),
        ("[slurm]\nreports_dir = '/" + "d" * 5000 + "'\n", "slurm.reports_dir"),
        ('[alerts]\ninstance = "node\\nfake_line"\n', "alerts.instance"),
        ("[daemon]\nlisten = '127.0.0.1: 80'\n", "daemon.listen"),
        ("[daemon]\nlisten = '127.0.0.1:8_0'\n", "daemon.listen"),
        ("[daemon]\nlisten = '127.0.0.1:\u0668\u0660'\n", "daemon.listen"),
        ("[daemon]\nlisten = 'no host:80'\n", "daemon.listen"),
        ("[detectors.saturation.models]\n'H100' = 1.5\n", "detectors.saturation.models.H100"),
    ],
)
def test_types_are_kept_and_lists_and_strings_bounded(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "nodescope.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        assembly.load(path)
    assert info.value.key == key
    assert "\n" not in str(info.value)


def test_an_integer_is_taken_where_a_float_is_expected(tmp_path: Path) -> None:
    path = tmp_path / "nodescope.toml"
    path.write_text("[daemon]\ntick_seconds = 2\n[slurm]\nexpected_gpus = 8\nxid_codes = [79]\n")
    cfg = assembly.load(path)
    assert cfg.tick_seconds == 2.0 and isinstance(cfg.tick_seconds, float)
    assert cfg.slurm.expected_gpus == 8
    assert cfg.slurm.xid_codes == (79,)


def test_a_key_with_a_newline_is_named_on_one_line(tmp_path: Path) -> None:
    path = tmp_path / "nodescope.toml"
    path.write_text('[daemon]\n"tick\\nseconds = 1 # forged" = 1\n')
    with pytest.raises(ConfigError, match="unknown key") as info:
        assembly.load(path)
    assert "\n" not in str(info.value)
    assert "tick\\nseconds" in str(info.value)


def test_a_very_long_key_is_cut_in_the_message(tmp_path: Path) -> None:
    path = tmp_path / "nodescope.toml"
    path.write_text(f"[daemon]\n{'k' * 50_000} = 1\n")
    with pytest.raises(ConfigError, match="unknown key") as info:
        assembly.load(path)
    assert len(str(info.value)) < 400


def test_the_shipped_sample_loads_with_its_documented_bounds() -> None:
    """The sample config and the reference agree with the code (tick within its bounds)."""
    from tests.conftest import REPO

    cfg = assembly.load(REPO / "systemd" / "nodescope.toml")
    assert config.SECONDS_TICK(cfg.tick_seconds) is None
    reference = assembly.reference_markdown()
    assert config.SECONDS_TICK.allowed in reference
    assert "between 0.1 and 3600" in reference


# -- the nesting scan: a pure function, fuzzed ----------------------------------------------

_SCALARS = st.sampled_from(
    [
        "1",
        "1.5",
        "-0.0",
        "inf",
        "true",
        "1979-05-27T07:32:00.5Z",
        '"a[b{c"',
        "'x]]}}'",
        '"q\\"[["',
        '"""m\n[[["""',
        '"""e""""',
        "'''l\n{{{'''",
        "''''x'''",
        '"#[["',
    ]
)


def _nested(depth: int) -> st.SearchStrategy[tuple[str, int]]:
    """TOML values as source text, with how deep their arrays and inline tables nest."""
    if depth == 0:
        return _SCALARS.map(lambda s: (s, 0))
    inner = _nested(depth - 1)
    arrays = st.lists(inner, min_size=1, max_size=3).map(
        lambda items: (
            "[" + ", ".join(t for t, _ in items) + ", # [ in a comment\n]",
            1 + max(d for _, d in items),
        )
    )
    tables = st.lists(inner, min_size=1, max_size=3).map(
        lambda items: (
            "{" + ", ".join(f'"k{i}[".x = {t}' for i, (t, _) in enumerate(items)) + "}",
            1 + max(d for _, d in items),
        )
    )
    return st.one_of(_SCALARS.map(lambda s: (s, 0)), arrays, tables)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_nested(11))
def test_the_scan_measures_nesting_as_tomllib_parses_it(value: tuple[str, int]) -> None:
    text, depth = value
    document = f"# a [[ comment\n[table]\nkey = {text}\n"
    tomllib.loads(document)  # the generated text is valid TOML
    problem = config.structure_problem(document)
    if depth <= config.MAX_NESTING:
        assert problem is None, (problem, document)
    else:
        assert problem is not None and "nested more than" in problem


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="[]{}\"'#.\n= ab1\\", max_size=300))
def test_any_text_loads_or_is_a_config_error(tmp_path_factory: Any, text: str) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "nodescope.toml"
    path.write_text(text)
    try:
        assembly.load(path)
    except ConfigError as exc:
        assert "\n" not in str(exc)


_KEYS = st.sampled_from(
    [
        "daemon", "sources", "alerts", "detectors", "probe", "slurm", "roots", "rules",
        "models", "pci", "disks", "nvlink", "saturation", "contention", "pcie_contention",
        "listen", "tick_seconds", "log_level", "interval_seconds", "enabled", "sysfs",
        "for_seconds", "clear_below", "xid_codes", "required_modules", "expected_gpus",
        "timeout_seconds", "A100", "stall_warning_cycles_per_us", "k\n", "",
    ]
)  # fmt: skip
_LEAVES = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(),
    st.booleans(),
    st.text(max_size=12),
    st.datetimes(),
    # Past float's range, and past the 4300 digits int() and repr() take from text.
    st.integers(min_value=309, max_value=5000).map(lambda digits: 10**digits),
)
_DOCUMENTS = st.recursive(
    _LEAVES,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_KEYS, inner, max_size=4)),
    max_leaves=30,
)


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(_KEYS, _DOCUMENTS, max_size=5))
def test_any_document_is_a_config_or_a_config_error(document: dict[str, Any]) -> None:
    try:
        cfg = assembly.from_mapping(document, "fuzz.toml")
    except ConfigError as exc:
        assert "fuzz.toml" in str(exc)
        assert "\n" not in str(exc)
    else:
        assert config.SECONDS_TICK(cfg.tick_seconds) is None
        for settings_ in cfg.sources.values():
            assert config.SECONDS_SOURCE_INTERVAL(settings_.interval_seconds) is None


# -- a reload that fails for a reason other than the file ----------------------------------


def test_a_reload_whose_collector_cannot_be_built_keeps_everything(tmp_path: Path) -> None:
    configs = iter(
        [assembly.default_config(), assembly.default_config(tick_seconds=2.0, sources={})]
    )
    built: list[Collector] = []

    def make_collector(cfg: config.Config) -> Collector:
        if built:
            raise RuntimeError("no collector for you")
        built.append(Collector(roots=cfg.roots, scheduled=[]))
        return built[0]

    service = Service(lambda: next(configs), make_collector=make_collector)
    try:
        before = service.config
        assert service.reload() is False
        assert service.config is before
        assert service.collector is built[0]
        assert service.config_reloads == {"success": 0, "failure": 1}
    finally:
        service.shutdown()


# -- nodescope as a process ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_run_refuses_a_bad_config_at_start_with_one_line(tmp_path: Path, name: str) -> None:
    make, says = BAD_FILES[name]
    path = make(tmp_path)
    proc, seconds = run_nodescope("run", "--config", str(path), "--listen", "127.0.0.1:0")
    assert_one_line_refusal(proc, path, says)
    assert seconds < PROMPT_SECONDS


@pytest.mark.parametrize(
    "command",
    [
        ["snapshot"],
        ["alerts"],
        ["report", "1"],
        ["demo", "--no-tty", "--duration", "1"],
        ["probe", "--cpu", "--quick", "--no-allreduce"],
    ],
    ids=lambda c: c[0],
)
@pytest.mark.parametrize("name", ["fifo", "tick-inf", "deep-arrays-under-cap"])
def test_other_commands_refuse_a_bad_config(tmp_path: Path, command: list[str], name: str) -> None:
    make, says = BAD_FILES[name]
    path = make(tmp_path)
    proc, _ = run_nodescope(command[0], "--config", str(path), *command[1:])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert says in proc.stderr and str(path) in proc.stderr


@pytest.mark.parametrize("action", ["prolog", "epilog"])
@pytest.mark.parametrize("name", ["fifo", "dev-zero", "tick-inf"])
def test_a_slurm_hook_never_hangs_on_a_bad_config(tmp_path: Path, action: str, name: str) -> None:
    """A hook that blocked on its config would hold up every job launch on the node; it skips
    itself with one line and lets the job run (Slurm drains on a non-zero status)."""
    make, says = BAD_FILES[name]
    path = make(tmp_path)
    proc, _ = run_nodescope("slurm", action, "--config", str(path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and lines[0].endswith("hook skipped")


GOOD = """
[daemon]
tick_seconds = 0.2
log_level = "info"
[sources.disks]
interval_seconds = 0.2
"""

#: What SIGHUP meets, in order; the good config is written back between two of them.
RELOADS = (
    "tick-inf",
    "tick-1e12",
    "tick-bool",
    "integer-600-digits",
    "deep-arrays",
    "deep-arrays-under-cap",
    "long-dotted-key",
    "huge",
    "fifo",
    "dev-zero",
    "directory",
    "listen-label-too-long",
)


def _replace_config(path: Path, make: Callable[[Path], Path], workdir: Path) -> None:
    """Put what ``make`` creates at ``path``, the config the daemon was started with."""
    staging = workdir / "staging"
    staging.mkdir()
    made = make(staging)
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    else:
        path.unlink()
    made.rename(path)
    staging.rmdir()


def _reloads_counted(daemon: Daemon, result: str, count: int) -> bool:
    series = f'nodescope_config_reloads_total{{result="{result}"}}'
    return sample_value(daemon.scrape(), series) == count


def _cycles_past(daemon: Daemon, count: float) -> bool:
    return (sample_value(daemon.scrape(), "nodescope_cycles_total") or 0) >= count


def test_sighup_with_a_bad_config_keeps_the_daemon_and_its_config(tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    path = tmp_path / "nodescope.toml"
    path.write_text(GOOD)
    daemon = Daemon(tmp_path, ["--config", str(path)])
    try:
        daemon.wait_message("READY=1", timeout=READY_S)
        # Reading /dev/zero to its end must fail this test, not exhaust the machine.
        resource.prlimit(daemon.proc.pid, resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
        body = daemon.scrape()
        assert sample_value(body, 'nodescope_config_reloads_total{result="failure"}') == 0
        assert sample_value(body, 'nodescope_config_reloads_total{result="success"}') == 0

        for failures, name in enumerate(RELOADS, start=1):
            make, says = BAD_FILES[name]
            _replace_config(path, make, workdir)
            daemon.signal(signal.SIGHUP)
            daemon.wait_message("RELOADING=1", timeout=READY_S)
            daemon.wait_message("READY=1", timeout=READY_S)
            assert daemon.proc.poll() is None, f"{name}: {daemon.stderr()[-3000:]}"
            wait_for(
                partial(_reloads_counted, daemon, "failure", failures),
                5,
                f"{name}: the failed reload counted",
            )
            failed = [line for line in daemon.stderr().splitlines() if "reload_failed" in line]
            assert len(failed) == failures and says in failed[-1], failed[-1:]
            # Still collecting at the old 0.2 s tick, still serving.
            cycles = sample_value(daemon.scrape(), "nodescope_cycles_total") or 0
            wait_for(partial(_cycles_past, daemon, cycles + 3), 5, f"{name}: old tick")
            _replace_config(path, _text(GOOD), workdir)

        assert "Traceback" not in daemon.stderr()
        # A good config still takes effect after all of it.
        path.write_text(GOOD + "[sources.cgroups]\nenabled = false\n")
        daemon.signal(signal.SIGHUP)
        wait_for(partial(_reloads_counted, daemon, "success", 1), 5, "the good reload counted")
        assert 'nodescope_source_up{source="cgroups"}' not in daemon.scrape()
        assert daemon.proc.poll() is None
    finally:
        daemon.stop()
    assert daemon.proc.returncode == 0


def test_source_table_intervals_are_within_their_bounds() -> None:
    """The built-in per-source defaults obey the bounds the file is held to."""
    for info in SOURCE_TABLE:
        assert config.SECONDS_SOURCE_INTERVAL(info.default_interval) is None, info.name
