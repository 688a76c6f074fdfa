"""The torch-free parts of the bandwidth probe: size sweep, formulas, thresholds to exit
status, the report's JSON schema and parser, the daemon's runner, the ``probe`` source and
its metrics. The measuring itself runs in tests/integration/test_probe_cpu.py."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope import progress
from nodescope.assembly import from_mapping
from nodescope.config import PROBE_OPTIONS, ProbeSettings
from nodescope.errors import ConfigError, ParseError
from nodescope.model.probe import (
    EXIT_FAILED,
    EXIT_NOT_MEASURED,
    EXIT_PASSED,
    REPORT_SCHEMA,
    SCHEMA_VERSION,
    AllReducePoint,
    AllReduceResult,
    CopyPoint,
    CopySeries,
    PeerCopy,
    ProbeDevice,
    ProbeReport,
    SweepSizes,
    parse_report,
    report_to_json,
)
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.probe import table, verdict
from nodescope.probe.links import NO_LINK, bdf_of, link_info, normalise_bdf
from nodescope.probe.sweep import (
    FULL,
    KIB,
    MIB,
    QUICK,
    alg_bandwidth,
    asymmetry,
    bus_bandwidth,
    human_bytes,
    size_sweep,
)
from nodescope.probe_runner import (
    ProbeHook,
    ProbeRunner,
    outcome_from_answer,
    parse_probe_output,
    run_process,
)
from nodescope.roots import Roots
from nodescope.sim.sysfs_tree import cached_hgx_h100_tree
from nodescope.sources.pci import read_topology
from nodescope.sources.probe_report import STATE_FILE, make_source, read_last_report, state_path
from nodescope.sources.registry import SOURCES
from nodescope_exporters import probe_metrics
from nodescope_exporters.prometheus import render
from tests.conftest import REPO
from tests.unit.json_strategy import json_values

# --- sweep and formulas -----------------------------------------------------------------------


def test_full_sweep_is_8k_to_256m_doubling() -> None:
    sizes = size_sweep(8 * KIB, 256 * MIB, 2)
    assert sizes == FULL.copy_sizes
    assert len(sizes) == 16
    assert sizes[0] == 8192 and sizes[-1] == 268435456
    assert all(b == 2 * a for a, b in itertools.pairwise(sizes))


def test_sweep_stops_before_passing_the_end_like_nccl_tests() -> None:
    assert size_sweep(8 * KIB, 100 * KIB, 2) == (8192, 16384, 32768, 65536)
    assert size_sweep(1, 1, 2) == (1,)
    assert QUICK.copy_sizes == (64 * KIB, MIB, 16 * MIB, 256 * MIB)


@pytest.mark.parametrize(("begin", "end", "factor"), [(0, 8, 2), (16, 8, 2), (8, 64, 1)])
def test_sweep_rejects_nonsense(begin: int, end: int, factor: int) -> None:
    with pytest.raises(ValueError):
        size_sweep(begin, end, factor)


def test_bus_bandwidth_is_nccl_tests_all_reduce_factor() -> None:
    assert bus_bandwidth(100.0, 8) == pytest.approx(175.0)
    assert bus_bandwidth(100.0, 2) == pytest.approx(100.0)
    assert bus_bandwidth(100.0, 1) == 0.0
    assert alg_bandwidth(1 << 20, 0.001) == pytest.approx(1048576000.0)
    with pytest.raises(ValueError):
        alg_bandwidth(1, 0.0)


def test_asymmetry_index() -> None:
    assert asymmetry(10.0, 10.0) == 0.0
    assert asymmetry(30.0, 10.0) == pytest.approx(1.0)
    assert asymmetry(10.0, 30.0) == pytest.approx(1.0)
    assert asymmetry(5.0, 0.0) == pytest.approx(2.0)
    assert asymmetry(0.0, 0.0) == 0.0
    # A +42 % latency bias in one direction.
    assert asymmetry(1.42, 1.0) == pytest.approx(0.42 / 1.21)


def test_human_bytes() -> None:
    assert [human_bytes(s) for s in (8192, MIB, 256 * MIB, 1 << 30, 1000)] == [
        "8K",
        "1M",
        "256M",
        "1G",
        "1000B",
    ]


# --- a report to judge ------------------------------------------------------------------------

CAP = 63.015e9  # Gen5 x16 per direction after 128b/130b


def _series(device: int, direction: str, peak: float, capacity: float | None) -> CopySeries:
    points = (
        CopyPoint(64 * KIB, 64 * KIB / (peak / 4), peak / 4),
        CopyPoint(256 * MIB, 256 * MIB / peak, peak),
    )
    return CopySeries(device, direction, True, points, peak, peak / capacity if capacity else None)


def _peer(src: int, dst: int, bw: float, lat: float) -> PeerCopy:
    return PeerCopy(src, dst, 32 * MIB, bw, lat, True)


def make_report(
    h2d: Sequence[float] = (52e9, 51e9),
    peers: Sequence[PeerCopy] = (_peer(0, 1, 40e9, 10e-6), _peer(1, 0, 40e9, 10e-6)),
    stand_in: bool = False,
    allreduce: AllReduceResult | None = None,
) -> ProbeReport:
    capacity = None if stand_in else CAP
    devices = tuple(
        ProbeDevice(
            i,
            "NVIDIA H100 80GB HBM3",
            None if stand_in else f"0000:{0x19 + i:02x}:00.0",
            None if stand_in else "Gen5 x16",
            capacity,
            capacity,
        )
        for i in range(len(h2d))
    )
    copies = tuple(
        s
        for i, rate in enumerate(h2d)
        for s in (_series(i, "h2d", rate, capacity), _series(i, "d2h", 53e9, capacity))
    )
    return ProbeReport(
        schema_version=SCHEMA_VERSION,
        hostname="gpu001",
        backend="cpu" if stand_in else "cuda",
        stand_in=stand_in,
        note="stand-in" if stand_in else "",
        torch_version="2.13.0",
        quick=True,
        started=1700000000.0,
        finished=1700000009.5,
        devices=devices,
        copies=copies,
        peers=tuple(peers),
        asymmetry=(),
        allreduce=allreduce,
        skipped=(),
        failures=(),
        sizes=SweepSizes(
            custom=False,
            copy=(64 * KIB, 256 * MIB),
            allreduce=() if allreduce is None else tuple(p.size_bytes for p in allreduce.points),
            allreduce_latency=(),
        ),
    )


def _allreduce(busbw: float) -> AllReduceResult:
    point = AllReducePoint(64 * MIB, 64 * MIB / busbw, busbw, busbw)
    return AllReduceResult("gloo", 2, "float32", (point,), busbw, busbw)


def test_healthy_report_passes_with_defaults() -> None:
    report = verdict.judge(make_report(), ProbeSettings())
    assert report.failures == ()
    assert verdict.exit_status(report) == EXIT_PASSED
    assert len(report.asymmetry) == 1
    assert report.asymmetry[0].flagged is False
    assert verdict.reason(report.failures) == "passed"


def test_h2d_below_the_minimum_fraction_fails_with_one_line_naming_gpu_and_link() -> None:
    # GPU 1 reaches 25 GB/s: 0.40 of Gen5 x16, the figure of a link at half width.
    report = verdict.judge(make_report(h2d=(52e9, 25.2e9)), ProbeSettings())
    assert verdict.exit_status(report) == EXIT_FAILED
    assert [f.check for f in report.failures] == ["min_h2d_fraction"]
    failure = report.failures[0]
    assert failure.subject == "GPU1 0000:1a:00.0"
    assert failure.value == pytest.approx(0.40, abs=0.01)
    line = verdict.reason(report.failures)
    assert "\n" not in line
    assert (
        line == "GPU1 0000:1a:00.0 H2D 25.2 GB/s is 0.40 of its 63.0 GB/s Gen5 x16 link, below 0.70"
    )


def test_several_failures_are_counted_in_the_reason() -> None:
    settings_ = ProbeSettings(min_h2d_bytes_per_second=60e9)
    report = verdict.judge(make_report(), settings_)
    assert [f.subject for f in report.failures] == ["GPU0 0000:19:00.0", "GPU1 0000:1a:00.0"]
    assert verdict.reason(report.failures).endswith("(+1 more)")


def test_asymmetric_pair_is_flagged_with_the_slower_direction() -> None:
    peers = (_peer(0, 1, 40e9, 10e-6), _peer(1, 0, 24e9, 14.2e-6))
    report = verdict.judge(make_report(peers=peers), ProbeSettings())
    (pair,) = report.asymmetry
    assert pair.bandwidth_asymmetry == pytest.approx(0.5)
    assert pair.latency_asymmetry == pytest.approx(4.2 / 12.1)
    assert pair.slower == "GPU1->GPU0"
    assert pair.flagged
    assert [f.check for f in report.failures] == [
        "max_bandwidth_asymmetry",
        "max_latency_asymmetry",
    ]
    assert "slower GPU1->GPU0" in report.failures[0].message
    # Looser limits let the same pair pass.
    loose = ProbeSettings(max_bandwidth_asymmetry=0.6, max_latency_asymmetry=0.4)
    assert verdict.judge(make_report(peers=peers), loose).passed


def test_latency_alone_names_the_slower_direction_when_bandwidth_is_equal() -> None:
    peers = (_peer(0, 1, 40e9, 14.2e-6), _peer(1, 0, 40e9, 10e-6))
    (pair,) = verdict.pair_asymmetries(peers, ProbeSettings())
    assert pair.slower == "GPU0->GPU1"
    assert pair.bandwidth_asymmetry == 0.0 and pair.flagged


def test_stand_in_is_not_gated_on_asymmetry_or_fractions_but_on_absolute_rates() -> None:
    peers = (_peer(0, 1, 40e9, 10e-6), _peer(1, 0, 10e9, 30e-6))
    report = verdict.judge(make_report(peers=peers, stand_in=True), ProbeSettings())
    assert report.asymmetry[0].flagged
    assert report.passed
    assert verdict.STAND_IN_ASYMMETRY in report.skipped
    strict = ProbeSettings(min_d2h_bytes_per_second=1e15)
    failed = verdict.judge(make_report(stand_in=True), strict)
    assert [f.subject for f in failed.failures] == ["cpu0", "cpu1"]


def test_allreduce_minimum() -> None:
    wanted = ProbeSettings(min_allreduce_busbw_bytes_per_second=100e9)
    assert verdict.judge(make_report(allreduce=_allreduce(150e9)), wanted).passed
    slow = verdict.judge(make_report(allreduce=_allreduce(50e9)), wanted)
    assert [f.check for f in slow.failures] == ["min_allreduce_busbw_bytes_per_second"]
    assert "50.0 GB/s over 2 ranks" in slow.failures[0].message
    missing = verdict.judge(make_report(), wanted)
    assert "not measured" in missing.failures[0].message
    assert verdict.judge(make_report(), ProbeSettings()).passed


# --- config -----------------------------------------------------------------------------------


def test_probe_settings_defaults_are_the_schema_defaults() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(ProbeSettings)}
    assert fields == {o.key: o.default for o in PROBE_OPTIONS}


def test_probe_section_is_validated() -> None:
    config = from_mapping({"probe": {"min_h2d_fraction": 0.8, "max_latency_asymmetry": 1}})
    assert config.probe.min_h2d_fraction == 0.8
    assert config.probe.max_latency_asymmetry == 1.0
    assert config.probe.min_d2h_fraction == 0.7
    with pytest.raises(ConfigError, match=r"probe\.min_h2d_fractoin: unknown key"):
        from_mapping({"probe": {"min_h2d_fractoin": 0.8}})
    with pytest.raises(ConfigError, match=r"probe\.max_bandwidth_asymmetry"):
        from_mapping({"probe": {"max_bandwidth_asymmetry": 0}})
    with pytest.raises(ConfigError, match=r"probe\.min_h2d_fraction: expected float"):
        from_mapping({"probe": {"min_h2d_fraction": "high"}})


# --- JSON: schema and parser ------------------------------------------------------------------


def _judged() -> ProbeReport:
    peers = (_peer(0, 1, 40e9, 10e-6), _peer(1, 0, 24e9, 14e-6))
    return verdict.judge(make_report(peers=peers, allreduce=_allreduce(80e9)), ProbeSettings())


def test_report_json_matches_the_schema_and_parses_back() -> None:
    report = _judged()
    document = report_to_json(report)
    jsonschema.validate(document, REPORT_SCHEMA)
    jsonschema.Draft202012Validator.check_schema(REPORT_SCHEMA)
    assert document["passed"] is False
    assert document["duration_seconds"] == pytest.approx(9.5)
    assert parse_report(json.dumps(document)) == report


def test_schema_rejects_what_the_parser_rejects() -> None:
    document = report_to_json(_judged())
    del document["copies"][0]["peak_bytes_per_second"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(document, REPORT_SCHEMA)
    with pytest.raises(ParseError, match=r"copies\[0\]: missing peak_bytes_per_second"):
        parse_report(json.dumps(document), source="x.json")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(schema_version=3), "schema_version: 3 is not 1 or 2"),
        (lambda d: d.update(backend="rocm"), "backend: 'rocm'"),
        (lambda d: d["copies"][1].update(direction="d2d"), r"copies\[1\].direction"),
        (lambda d: d["peers"][0].update(src="0"), r"peers\[0\].src: expected an integer"),
        (lambda d: d.update(stand_in=1), "stand_in: expected true or false"),
        (lambda d: d.update(devices={}), "devices: expected an array"),
        (lambda d: d["allreduce"].update(points=None), "allreduce.points: expected an array"),
    ],
)
def test_parser_names_the_bad_field(mutate: object, message: str) -> None:
    document = report_to_json(_judged())
    mutate(document)  # type: ignore[operator]
    with pytest.raises(ParseError, match=message) as info:
        parse_report(json.dumps(document), source="/run/nodescope/probe-report.json")
    assert str(info.value).startswith("/run/nodescope/probe-report.json")


def test_parser_rejects_non_finite_numbers_and_non_json() -> None:
    text = json.dumps(report_to_json(_judged())).replace("1700000000.0", "NaN", 1)
    with pytest.raises(ParseError, match="started: expected a finite number"):
        parse_report(text)
    with pytest.raises(ParseError, match="not JSON") as info:
        parse_report("{\n  oops")
    assert info.value.line == 2


_JSON = json_values(8, max_key=8)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_parser_fuzz_text_raises_only_parse_error(text: str) -> None:
    with contextlib.suppress(ParseError):
        parse_report(text)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_parser_fuzz_mutated_reports_raise_only_parse_error(data: st.DataObject) -> None:
    document = report_to_json(_judged())
    # Replace one value somewhere in the tree with arbitrary JSON.
    node: object = document
    for _ in range(data.draw(st.integers(0, 3))):
        if isinstance(node, dict) and node:
            key = data.draw(st.sampled_from(sorted(node)))
            if not isinstance(node[key], dict | list) or not node[key]:
                break
            node = node[key]
        elif isinstance(node, list) and node:
            index = data.draw(st.integers(0, len(node) - 1))
            if not isinstance(node[index], dict | list) or not node[index]:
                break
            node = node[index]
    if isinstance(node, dict) and node:
        node[data.draw(st.sampled_from(sorted(node)))] = data.draw(_JSON)
    elif isinstance(node, list) and node:
        node[data.draw(st.integers(0, len(node) - 1))] = data.draw(_JSON)
    with contextlib.suppress(ParseError):
        parse_report(json.dumps(document))


# --- the table and the progress bar -----------------------------------------------------------


def test_table_shows_figures_beside_the_link_and_the_verdict() -> None:
    text = table.render(_judged())
    assert "GPU0 0000:19:00.0  Gen5 x16     63.02  52.00  0.83  53.00  0.84" in text
    assert "GPU1 0000:1a:00.0  Gen5 x16     63.02  51.00  0.81  53.00  0.84" in text
    assert "GPU0<->GPU1      0.500    0.333  GPU1->GPU0     -         -  FLAG" in text
    assert "Avg bus bandwidth: 80.00 GB/s" in text
    assert "FAILED: 2 threshold(s)" in text
    assert "NOTE" not in text


def test_table_says_when_it_measured_the_stand_in() -> None:
    text = table.render(verdict.judge(make_report(stand_in=True), ProbeSettings()))
    assert "CPU stand-in (no GPU)" in text
    assert "NOTE: stand-in" in text
    assert "PASSED" in text


def test_progress_bar_only_on_a_terminal() -> None:
    assert progress.render(12, 40, "h2d 0 16M", width=10) == "[###-------] 12/40  h2d 0 16M"
    assert progress.render(50, 40, "x", width=4) == "[####] 40/40  x"
    quiet = io.StringIO()  # not a tty
    bar = progress.Progress(3, quiet)
    bar.step("a")
    bar.close()
    assert quiet.getvalue() == ""

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    bar = progress.Progress(2, tty)
    bar.step("first")
    bar.step("second")
    bar.close()
    out = tty.getvalue()
    assert out.startswith("\r[###############---------------] 1/2  first")
    assert "\r[##############################] 2/2  second" in out
    assert out.endswith("\r")


# --- links from the topology ------------------------------------------------------------------


def test_bdf_forms() -> None:
    assert bdf_of(0, 0x19, 0) == "0000:19:00.0"
    assert normalise_bdf("00000000:1A:00.0") == "0000:1a:00.0"
    assert normalise_bdf("0000:1a:00.0") == "0000:1a:00.0"


def test_link_of_an_hgx_h100_gpu(tmp_path_factory: pytest.TempPathFactory) -> None:
    root = cached_hgx_h100_tree(tmp_path_factory.getbasetemp() / "hgx-h100")
    topology = read_topology(Roots.under(root))
    info = link_info(topology, "0000:19:00.0")
    assert info.description == "Gen5 x16"
    assert info.capacity_bytes_per_second == pytest.approx(32e9 * 128 / 130 / 8 * 16)
    assert link_info(topology, "0000:ff:00.0") == NO_LINK
    assert link_info(None, "0000:19:00.0") == NO_LINK


# --- the daemon's runner and source -----------------------------------------------------------


def _stdout(report: ProbeReport) -> str:
    return json.dumps(report_to_json(report))


def test_runner_parses_a_passing_probe() -> None:
    report = verdict.judge(make_report(), ProbeSettings())
    outcome = parse_probe_output(0, _stdout(report), "", 4.0)
    assert outcome.passed and outcome.report == report
    assert outcome.reason == "passed" and outcome.seconds == 4.0


def test_runner_parses_a_failing_probe() -> None:
    report = _judged()
    outcome = parse_probe_output(1, _stdout(report), "nodescope probe: FAILED: ...\n")
    assert outcome.status == EXIT_FAILED and not outcome.passed
    assert outcome.report == report
    assert outcome.reason.startswith("pair GPU0<->GPU1: bandwidth asymmetry 0.50")
    assert outcome.reason.endswith("(+1 more)")


@pytest.mark.parametrize(
    ("rc", "stdout", "stderr", "status", "reason"),
    [
        (0, "not json", "", EXIT_NOT_MEASURED, "unreadable report: probe stdout:1: not JSON"),
        (
            3,
            "",
            "warning\nnodescope probe: cannot import torch\n",
            3,
            "nodescope probe: cannot import torch",
        ),
        (2, "", "", 2, "exit status 2"),
        (-9, "", "", EXIT_NOT_MEASURED, "killed by signal 9"),
    ],
)
def test_runner_parses_probes_that_measured_nothing(
    rc: int, stdout: str, stderr: str, status: int, reason: str
) -> None:
    outcome = parse_probe_output(rc, stdout, stderr)
    assert (outcome.status, outcome.report) == (status, None)
    assert outcome.reason.startswith(reason)


def test_runner_refuses_an_exit_status_that_contradicts_the_report() -> None:
    outcome = parse_probe_output(0, _stdout(_judged()), "")
    assert outcome.status == EXIT_NOT_MEASURED and outcome.report is None


def test_runner_runs_the_probe_command_and_keeps_the_last_outcome(tmp_path: Path) -> None:
    roots = Roots.under(tmp_path)
    calls: list[tuple[list[str], float]] = []
    report = verdict.judge(make_report(), ProbeSettings())

    def fake(command: Sequence[str], timeout: float) -> tuple[int, str, str]:
        calls.append((list(command), timeout))
        return 0, _stdout(report), ""

    runner = ProbeRunner(roots, config_path="/etc/nodescope/nodescope.toml", timeout=60, run=fake,
                         python="/usr/bin/python3", extra=["--no-allreduce"])  # fmt: skip
    outcome = runner.request(quick=True)
    assert outcome.passed and runner.last == outcome
    command, timeout = calls[0]
    assert timeout == 60
    assert command == [
        "/usr/bin/python3", "-m", "nodescope.probe", "--json", "--quick",
        "--config", "/etc/nodescope/nodescope.toml",
        "--write-report", str(tmp_path / "run" / STATE_FILE),
        f"--sysfs={tmp_path / 'sys'}", "--no-allreduce",
    ]  # fmt: skip
    runner.request(quick=False)
    assert "--quick" not in calls[1][0]


def test_runner_runs_one_probe_at_a_time(tmp_path: Path) -> None:
    started, release = threading.Event(), threading.Event()

    def slow(command: Sequence[str], timeout: float) -> tuple[int, str, str]:
        started.set()
        release.wait(10)
        return 3, "", "no GPU"

    runner = ProbeRunner(Roots.under(tmp_path), run=slow)
    worker = threading.Thread(target=runner.request)
    worker.start()
    assert started.wait(10)
    assert runner.busy
    second = runner.request()
    assert (second.status, second.reason) == (EXIT_NOT_MEASURED, "a probe is already running")
    release.set()
    worker.join(10)
    assert not runner.busy
    assert runner.last is not None and runner.last.reason == "no GPU"


def test_run_process_kills_the_probe_and_its_children_on_timeout(tmp_path: Path) -> None:
    beats = tmp_path / "beats"
    child = tmp_path / "child.py"
    child.write_text(
        "import time\n"
        "while True:\n"
        f"    open({str(beats)!r}, 'a').write('.')\n"
        "    time.sleep(0.05)\n"
    )
    parent = tmp_path / "parent.py"
    parent.write_text(
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, {str(child)!r}])\n"
        "time.sleep(30)\n"
    )
    rc, _stdout, stderr = run_process([sys.executable, str(parent)], timeout=3.0)
    assert rc == EXIT_NOT_MEASURED
    assert stderr == "probe: no result after 3 s (killed)"
    assert beats.exists()  # the grandchild ran
    time.sleep(0.2)
    count = len(beats.read_text())
    time.sleep(0.5)
    assert len(beats.read_text()) == count  # and died with the session


def test_run_process_passes_output_through() -> None:
    rc, stdout, stderr = run_process(
        [
            sys.executable,
            "-c",
            "import sys; print('out'); print('err', file=sys.stderr); sys.exit(1)",
        ],
        timeout=30,
    )
    assert (rc, stdout, stderr) == (1, "out\n", "err\n")


def test_probe_source_reads_the_recorded_report(tmp_path: Path) -> None:
    roots = Roots.under(tmp_path)
    source = make_source()
    assert source.name == "probe" and SOURCES["probe"].make().name == "probe"
    assert source.collect(roots) is None  # before the first probe: absent, not an error
    report = _judged()
    state_path(roots).parent.mkdir(parents=True)
    state_path(roots).write_text(_stdout(report))
    assert read_last_report(roots) == report
    state_path(roots).write_text("{")
    with pytest.raises(ParseError, match=str(state_path(roots))):
        source.collect(roots)


# --- metrics ----------------------------------------------------------------------------------


def _snapshot(report: ProbeReport | None) -> Snapshot:
    current = {} if report is None else {"probe": SourceSample("probe", 1.0, 0.0, report)}
    return Snapshot(cycle=1, monotonic=1.0, wall_time=1700000100.0, current=current)


def test_metrics_of_the_last_probe() -> None:
    text = render(_snapshot(_judged()), [probe_metrics.families]).decode()
    lines = set(text.splitlines())
    for line in (
        "nodescope_probe_last_run_timestamp_seconds 1.7000000095e+09",
        "nodescope_probe_duration_seconds 9.5",
        "nodescope_probe_passed 0.0",
        'nodescope_probe_threshold_failures{check="max_bandwidth_asymmetry"} 1.0',
        'nodescope_probe_h2d_bytes_per_second{gpu="0"} 5.2e+10',
        'nodescope_probe_d2h_bytes_per_second{gpu="1"} 5.3e+10',
        'nodescope_probe_link_capacity_bytes_per_second{gpu="1"} 6.3015e+10',
        'nodescope_probe_gpu_info{gpu="1",link="Gen5 x16",pci_address="0000:1a:00.0"} 1.0',
        'nodescope_probe_peer_bytes_per_second{dst="0",src="1"} 2.4e+10',
        'nodescope_probe_peer_latency_seconds{dst="1",src="0"} 1e-05',
        'nodescope_probe_peer_asymmetry_ratio{a="0",b="1",figure="bandwidth"} 0.5',
        'nodescope_probe_allreduce_busbw_bytes_per_second{backend="gloo",ranks="2"} 8e+10',
        'nodescope_probe_info{backend="cuda",mode="quick",stand_in="false",'
        'torch_version="2.13.0"} 1.0',
    ):
        assert line in lines, line
    fraction = next(
        x for x in lines if x.startswith('nodescope_probe_h2d_fraction_of_capacity{gpu="0"}')
    )
    assert float(fraction.split()[-1]) == pytest.approx(52e9 / CAP)


def test_no_probe_no_series() -> None:
    text = render(_snapshot(None), [probe_metrics.families]).decode()
    assert "nodescope_probe" not in text


def test_stand_in_exports_no_fraction() -> None:
    report = verdict.judge(make_report(stand_in=True), ProbeSettings())
    text = render(_snapshot(report), [probe_metrics.families]).decode()
    assert 'stand_in="true"' in text
    assert "nodescope_probe_h2d_fraction_of_capacity{" not in text
    assert "nodescope_probe_link_capacity_bytes_per_second{" not in text


# --- torch stays in the probe process ---------------------------------------------------------


def test_daemon_side_of_the_probe_does_not_import_torch() -> None:
    code = """
import sys
import nodescope.probe_runner, nodescope.cli.probe, nodescope_exporters.probe_metrics
import nodescope.probe.verdict, nodescope.probe.table, nodescope.probe.links
import nodescope.probe.__main__
from nodescope.cli.main import build_parser
build_parser().parse_args(["probe", "--quick"])
print(",".join(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""


def test_cli_builds_the_probe_command() -> None:
    from nodescope.cli.main import build_parser
    from nodescope.cli.probe import command

    args = build_parser().parse_args(
        ["probe", "--quick", "--no-allreduce", "--sysfs", "/x/sys", "--run", "/x/run", "--record"]
    )
    assert command(args, python="py") == [
        "py", "-m", "nodescope.probe", "--quick", "--no-allreduce",
        "--sysfs=/x/sys", "--run=/x/run",
        "--write-report", "/x/run/nodescope/probe-report.json",
    ]  # fmt: skip


# --- the daemon's hook socket: probe, probe_result, --via-daemon ------------------------------


def _hook(tmp_path: Path, run: object, timeout: float = 60.0) -> ProbeHook:
    config = from_mapping(
        {"roots": {"run": str(tmp_path / "run")}, "probe": {"timeout_seconds": timeout}},
        path=str(tmp_path / "nodescope.toml"),
    )
    return ProbeHook(lambda: config, run=run)  # type: ignore[arg-type]


def test_probe_hook_runs_in_the_background_and_answers_the_outcome(tmp_path: Path) -> None:
    report = verdict.judge(make_report(), ProbeSettings())
    release = threading.Event()
    commands: list[tuple[list[str], float]] = []

    def fake(command: Sequence[str], timeout: float) -> tuple[int, str, str]:
        commands.append((list(command), timeout))
        release.wait(10)
        return 0, _stdout(report), ""

    hook = _hook(tmp_path, fake, timeout=42.0)
    first = hook.start({"command": "probe", "quick": False, "no_allreduce": True})
    assert first == {"ok": True, "started": True, "running": True, "id": 1}
    assert hook.start({"command": "probe"}) == {
        "ok": True,
        "started": False,
        "running": True,
        "id": 1,
    }
    assert hook.result({}) == {"ok": True, "id": 1, "running": True}
    release.set()
    hook.wait(10)
    answer = hook.result({})
    assert answer["running"] is False and answer["outcome"]["status"] == 0
    json.dumps(answer, allow_nan=False)  # what the socket sends
    outcome = outcome_from_answer(answer)
    assert outcome.report == report and outcome.passed
    command, timeout = commands[0]
    assert timeout == 42.0
    assert "--quick" not in command and command[-1] == "--no-allreduce"
    assert command[command.index("--config") + 1] == str(tmp_path / "nodescope.toml")
    assert hook.start({"command": "probe", "quick": "yes"})["ok"] is False


def test_outcome_from_a_malformed_answer_is_a_parse_error() -> None:
    with pytest.raises(ParseError):
        outcome_from_answer({"ok": True})
    with pytest.raises(ParseError):
        outcome_from_answer({"outcome": {"status": "0", "reason": "", "seconds": 1}})


def test_nodescope_probe_via_daemon_over_the_hook_socket(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nodescope.cli.main import build_parser
    from nodescope.cli.probe import via_daemon
    from nodescope.hooks.transport import HookServer, socket_path

    report = _judged()  # fails two thresholds
    hook = _hook(tmp_path, lambda command, timeout: (1, _stdout(report), "FAILED"))
    server = HookServer(socket_path(Roots(run=tmp_path / "run")), lambda peer: True)
    server.register("probe", hook.start)
    server.register("probe_result", hook.result)
    server.start()
    try:
        args = build_parser().parse_args(
            ["probe", "--via-daemon", "--quick", f"--run={tmp_path / 'run'}"]
        )
        status = via_daemon(args, poll_seconds=0.05)
    finally:
        server.stop()
    out, err = capsys.readouterr()
    assert status == EXIT_FAILED
    assert "FAILED: 2 threshold(s)" in out
    # The command's own message, once; log records may share stderr when an earlier test left
    # the daemon's logging set up in this process.
    (line,) = [text for text in err.splitlines() if text.startswith("nodescope probe:")]
    assert line.startswith("nodescope probe: FAILED: pair GPU0<->GPU1: bandwidth asymmetry")


def test_via_daemon_without_a_daemon_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nodescope.cli.main import build_parser
    from nodescope.cli.probe import via_daemon

    args = build_parser().parse_args(["probe", "--via-daemon", f"--run={tmp_path}"])
    assert via_daemon(args) == EXIT_NOT_MEASURED
    assert "nodescope.sock" in capsys.readouterr().err
