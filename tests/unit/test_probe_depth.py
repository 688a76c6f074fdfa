"""The probe's depth, torch-free: ``--sizes`` (parsing, bounds, the plan, the command lines
that carry it), the small-message latency figure, the path class of a GPU pair on the PCI
tree of a real HGX H100 capture, the asymmetry verdict that names it, and the report's
version 2 fields through the strict reader (fuzzed). The measuring itself runs in
tests/integration/test_probe_cpu.py."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.assembly import from_mapping
from nodescope.config import ProbeSettings
from nodescope.errors import ParseError
from nodescope.model.paths import PairPath, describe, nvlink_count, pair_path
from nodescope.model.probe import (
    EXIT_USAGE,
    REPORT_SCHEMA,
    AllReduceLatency,
    AllReducePoint,
    AllReduceResult,
    PeerCopy,
    ProbeReport,
    parse_report,
    report_to_json,
)
from nodescope.model.topology import Topology
from nodescope.probe import table, verdict
from nodescope.probe.sweep import (
    FULL,
    GIB,
    KIB,
    LATENCY_MAX_SIZE,
    MAX_SIZES,
    MIB,
    QUICK,
    format_sizes,
    latency_figure,
    parse_sizes,
    percentile,
    with_sizes,
)
from nodescope.probe_runner import ProbeHook
from nodescope.roots import Roots
from nodescope.sim.sysfs_tree import cached_hgx_h100_tree
from nodescope.sources.pci import read_topology
from tests.conftest import REPO, nodescope_command
from tests.unit.json_strategy import json_values
from tests.unit.test_probe_logic import make_report

# --- --sizes ----------------------------------------------------------------------------------


def test_sizes_read_units_as_powers_of_1024_and_come_back_ascending() -> None:
    assert parse_sizes("4K,64K,1M,256M") == (4096, 65536, 1048576, 268435456)
    assert parse_sizes(" 1g , 8 ,16b,2m") == (8, 16, 2 * MIB, GIB)
    assert parse_sizes("1M,4K") == (4 * KIB, MIB)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", r"'' is not a size"),
        ("4K,,1M", r"'' is not a size"),
        ("4K,", r"'' is not a size"),
        ("4X", r"'4X' is not a size"),
        ("-4K", r"'-4K' is not a size"),
        ("4.5K", r"'4.5K' is not a size"),
        ("1e6", r"'1e6' is not a size"),
        ("4KB", r"'4KB' is not a size"),
        ("\u0664K", r"is not a size"),  # an Arabic-Indic four: a digit to str.isdigit, not here
        ("0", r"0 is outside 4B\.\.1G"),
        ("2", r"2B is outside 4B\.\.1G"),
        ("2G", r"2G is outside 4B\.\.1G"),
        ("99999999999G", r"is not a size"),  # more than ten digits
        ("6", r"6 bytes is not a multiple of 4"),
        ("1M,1024K", r"1M is given twice"),
        (",".join(f"{4 * (i + 1)}" for i in range(MAX_SIZES + 1)), r"33 sizes; at most 32"),
        ("4K," * 400 + "4K", r"longer than 1024 characters"),
    ],
)
def test_bad_size_lists_are_refused_with_the_reason(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_sizes(text)


def test_an_unprintable_item_is_shown_escaped() -> None:
    with pytest.raises(ValueError) as info:
        parse_sizes("4K\x1b[2J")
    assert "\x1b" not in str(info.value) and "\\x1b" in str(info.value)


_SIZE = st.integers(1, GIB // 4).map(lambda n: 4 * n)


@settings(max_examples=200, deadline=None)
@given(st.lists(_SIZE, min_size=1, max_size=MAX_SIZES, unique=True))
def test_format_sizes_reads_back_as_the_same_sizes(sizes: list[int]) -> None:
    assert parse_sizes(format_sizes(sizes)) == tuple(sorted(sizes))


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_size_lists_fuzz_only_value_error_and_every_size_in_bounds(text: str) -> None:
    with contextlib.suppress(ValueError):
        sizes = parse_sizes(text)
        assert 1 <= len(sizes) <= MAX_SIZES
        assert list(sizes) == sorted(set(sizes))
        assert all(4 <= s <= GIB and s % 4 == 0 for s in sizes)


def test_sizes_replace_the_copy_and_allreduce_sweeps() -> None:
    plan = with_sizes(QUICK, (4 * KIB, 64 * KIB, MIB, 256 * MIB))
    assert plan.copy_sizes == plan.allreduce_sizes == (4 * KIB, 64 * KIB, MIB, 256 * MIB)
    # 4K is a small message: the latency figure is taken there alone.
    assert plan.allreduce_latency_sizes == (4 * KIB,)
    # Only large sizes: the latency keeps the plan's own small sizes.
    large = with_sizes(FULL, (MIB, 16 * MIB))
    assert large.allreduce_latency_sizes == FULL.allreduce_latency_sizes
    assert FULL.allreduce_latency_sizes[0] == 8
    assert FULL.allreduce_latency_sizes[-1] == LATENCY_MAX_SIZE
    # What is not a size sweep stays as the plan had it.
    assert (plan.peer_size, plan.copy_iters) == (QUICK.peer_size, QUICK.copy_iters)
    with pytest.raises(ValueError):
        with_sizes(QUICK, ())


@pytest.mark.parametrize("sizes", ["4K,,1M", "3", "4G"])
@pytest.mark.parametrize("entry", ["nodescope probe", "python -m nodescope.probe"])
def test_a_bad_size_list_is_a_usage_error_before_anything_runs(sizes: str, entry: str) -> None:
    if entry == "nodescope probe":
        command = [*nodescope_command(), "probe"]
    else:
        command = [sys.executable, "-m", "nodescope.probe"]
    proc = subprocess.run(
        [*command, "--sizes", sizes], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert proc.stdout == ""
    assert "argument --sizes:" in proc.stderr.splitlines()[-1]


def test_the_cli_hands_the_sizes_to_the_probe_process() -> None:
    from nodescope.cli.main import build_parser
    from nodescope.cli.probe import command

    args = build_parser().parse_args(["probe", "--sizes", "256M,4k,1048576,64K", "--cpu"])
    assert command(args, python="py") == [
        "py", "-m", "nodescope.probe", "--cpu", "--sizes=4K,64K,1M,256M",
    ]  # fmt: skip


# --- the small-message latency figure ---------------------------------------------------------


def test_percentile_is_nearest_rank_on_measured_values() -> None:
    assert percentile([float(v) for v in range(1, 101)], 99) == 99.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([5.0], 99) == 5.0
    for bad in (0, 101, -1):
        with pytest.raises(ValueError):
            percentile([1.0], bad)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_the_p99_of_a_thousand_all_reduces_turns_on_the_eleventh_slow_one() -> None:
    # 1000 timings: a 10 us floor and a few stalls of 1 ms (a barrier that times out and
    # retries). Ten stalls are the slowest 1 %: the p99 stays on the floor; an eleventh
    # moves it.
    ten = [10e-6] * 990 + [1e-3] * 10
    eleven = [10e-6] * 989 + [1e-3] * 11
    assert latency_figure(8, ten).p99_seconds == 10e-6
    assert latency_figure(8, eleven).p99_seconds == 1e-3
    figure = latency_figure(8, [12e-6, 10e-6, 11e-6, 40e-6])
    assert figure == AllReduceLatency(8, 4, 10e-6, 11.5e-6, 40e-6)
    for bad in ([], [1e-6, float("nan")], [-1e-6]):
        with pytest.raises(ValueError):
            latency_figure(8, bad)


# --- the path class of a pair, on the capture of an 8x H100 HGX -------------------------------


@pytest.fixture(scope="module")
def hgx(tmp_path_factory: pytest.TempPathFactory) -> Topology:
    root = cached_hgx_h100_tree(tmp_path_factory.getbasetemp() / "hgx-h100")
    return read_topology(Roots.under(root))


#: The capture's GPUs by bus number (tests/fixtures/captures/hgx-h100/README.md): each below
#: its own PEX890xx switch on its own root port and host bridge, 19..5d on socket 0 (NUMA 0),
#: 9b..db on socket 1.
GPU = {
    n: f"0000:{bus}:00.0" for n, bus in enumerate(["19", "3b", "4c", "5d", "9b", "bb", "cb", "db"])
}


def test_gpu_pairs_of_one_socket_are_node_and_across_sockets_sys(hgx: Topology) -> None:
    for a in range(8):
        for b in range(8):
            if a == b:
                continue
            path = pair_path(hgx, GPU[a], GPU[b])
            assert path is not None
            same_socket = (a < 4) == (b < 4)
            # Different host bridges on one NUMA node: NODE; on two: SYS.
            assert path.path == ("NODE" if same_socket else "SYS"), (a, b)
            assert (path.numa_a, path.numa_b) == (a // 4, b // 4)
            assert path.cross_numa is not same_socket


def test_pcie_classes_within_a_host_bridge_on_the_capture(hgx: Topology) -> None:
    # GPU0 and the ConnectX-7 and NVMe drive below the same PEX890xx switch: PIX.
    assert pair_path(hgx, GPU[0], "0000:1a:00.0") == PairPath(GPU[0], "0000:1a:00.0", "PIX", 0, 0)
    assert pair_path(hgx, "0000:18:00.0", GPU[0]).path == "PIX"  # type: ignore[union-attr]
    # Two NVSwitches on downstream ports of the one PMC-Sierra switch: PIX.
    assert pair_path(hgx, "0000:83:00.0", "0000:84:00.0").path == "PIX"  # type: ignore[union-attr]
    # The switch's own function beside its upstream port (on root port 80:01.0) and an
    # NVSwitch below that switch: the path turns at the root port and crosses the switch.
    assert pair_path(hgx, "0000:81:00.1", "0000:83:00.0").path == "PXB"  # type: ignore[union-attr]
    # The BMC's NIC (root port 00:0c.0) and its VGA (behind a bridge on root port 00:0e.0),
    # both on host bridge pci0000:00: PHB.
    assert pair_path(hgx, "0000:01:00.0", "0000:03:00.0").path == "PHB"  # type: ignore[union-attr]


def test_nvlink_counts_take_precedence_and_unknown_devices_give_no_path(hgx: Topology) -> None:
    nvlinks = {frozenset((GPU[0], GPU[4])): 18}
    path = pair_path(hgx, GPU[4], GPU[0], nvlinks)
    assert path == PairPath(GPU[4], GPU[0], "NV18", 1, 0)
    assert pair_path(hgx, GPU[0], GPU[5], nvlinks).path == "SYS"  # type: ignore[union-attr]
    assert pair_path(hgx, GPU[0], "0000:ee:00.0") is None
    assert pair_path(hgx, None, GPU[0]) is None
    assert pair_path(None, GPU[0], GPU[1]) is None
    assert pair_path(hgx, GPU[0], GPU[0]) is None


def test_path_words() -> None:
    assert describe("NV18") == "over 18 bonded NVLinks"
    assert describe("NV1") == "over 1 bonded NVLink"
    assert describe("SYS") == "across the SMP interconnect between NUMA nodes"
    assert describe("PIX") == "across one PCIe switch"
    assert describe("NVx") == "" and describe("") == "" and describe("NV99999") == ""
    assert nvlink_count("NV12") == 12 and nvlink_count("SYS") == 0


# --- the verdict names the path ---------------------------------------------------------------


def _hgx_report(hgx: Topology, a: int, b: int, forward: tuple[float, float],
                backward: tuple[float, float],
                nvlinks: dict[frozenset[str], int] | None = None) -> ProbeReport:  # fmt: skip
    """A two-GPU report of GPUs ``a`` and ``b`` of the capture, with the paths and NUMA
    nodes the probe records for them (``measure`` does the same with torch)."""
    base = make_report()
    path = pair_path(hgx, GPU[a], GPU[b], nvlinks)
    assert path is not None
    devices = (
        replace(base.devices[0], index=a, pci_address=GPU[a], numa_node=path.numa_a),
        replace(base.devices[1], index=b, pci_address=GPU[b], numa_node=path.numa_b),
    )
    peers = (
        PeerCopy(a, b, 32 * MIB, forward[0], forward[1], True, path.path),
        PeerCopy(b, a, 32 * MIB, backward[0], backward[1], True, path.path),
    )
    copies = tuple(replace(s, device=a if s.device == 0 else b) for s in base.copies)
    return replace(base, devices=devices, peers=peers, copies=copies)


def test_a_42_percent_bias_across_sockets_is_named_sys_with_both_numa_nodes(
    hgx: Topology,
) -> None:
    # GPU4 -> GPU0 takes 1.42 times as long for a small copy as GPU0 -> GPU4.
    report = _hgx_report(hgx, 0, 4, (40e9, 10e-6), (40e9, 14.2e-6))
    judged = verdict.judge(report, ProbeSettings())
    (pair,) = judged.asymmetry
    assert (pair.slower, pair.path, pair.numa_a, pair.numa_b) == ("GPU4->GPU0", "SYS", 0, 1)
    (failure,) = judged.failures
    assert failure.message == (
        "pair GPU0<->GPU4: latency asymmetry 0.35 (slower GPU4->GPU0, path SYS from NUMA"
        " node 1 to 0, across the SMP interconnect between NUMA nodes) reaches the maximum 0.30"
    )
    assert "\n" not in verdict.reason(judged.failures)
    text = table.render(judged)
    assert "GPU0<->GPU4      0.000    0.347  GPU4->GPU0   SYS       0/1  FLAG" in text
    assert "  GPU4->GPU0: path SYS from NUMA node 1 to 0, across the SMP" in text


def test_the_slower_direction_decides_the_order_of_the_numa_nodes(hgx: Topology) -> None:
    report = _hgx_report(hgx, 1, 5, (20e9, 10e-6), (40e9, 10e-6))
    (failure,) = verdict.judge(report, ProbeSettings()).failures
    assert "(slower GPU1->GPU5, path SYS from NUMA node 0 to 1," in failure.message


def test_a_pair_within_one_numa_node_and_an_nvlink_pair(hgx: Topology) -> None:
    same = verdict.judge(_hgx_report(hgx, 0, 1, (40e9, 10e-6), (40e9, 15e-6)), ProbeSettings())
    assert "path NODE within NUMA node 0, across the interconnect between host bridges" in (
        same.failures[0].message
    )
    nvlinks = {frozenset((GPU[0], GPU[4])): 18}
    nv = _hgx_report(hgx, 0, 4, (300e9, 3e-6), (150e9, 3e-6), nvlinks)
    (failure,) = verdict.judge(nv, ProbeSettings()).failures
    assert failure.message == (
        "pair GPU0<->GPU4: bandwidth asymmetry 0.67 (slower GPU4->GPU0, path NV18 from NUMA"
        " node 1 to 0, over 18 bonded NVLinks) reaches the maximum 0.25"
    )


def test_without_a_path_the_verdict_keeps_its_plain_words() -> None:
    peers = (
        PeerCopy(0, 1, 32 * MIB, 40e9, 10e-6, True),
        PeerCopy(1, 0, 32 * MIB, 24e9, 10e-6, True),
    )
    (failure,) = verdict.judge(make_report(peers=peers), ProbeSettings()).failures
    assert failure.message == (
        "pair GPU0<->GPU1: bandwidth asymmetry 0.50 (slower GPU1->GPU0) reaches the maximum 0.25"
    )


# --- the report: version 2 fields through the strict reader -----------------------------------


def _latency() -> tuple[AllReduceLatency, ...]:
    return (
        AllReduceLatency(8, 1000, 9e-6, 11e-6, 30e-6),
        AllReduceLatency(4 * KIB, 1000, 12e-6, 14e-6, 41e-6),
    )


def _deep(hgx: Topology) -> ProbeReport:
    """A judged report with every version 2 field filled: custom sizes, latency, paths."""
    base = _hgx_report(hgx, 0, 4, (40e9, 10e-6), (40e9, 14.2e-6))
    point = AllReducePoint(4 * KIB, 30e-6, 4 * KIB / 30e-6, 4 * KIB / 30e-6)
    allreduce = AllReduceResult("nccl", 2, "float32", (point,), point.busbw_bytes_per_second,
                                point.busbw_bytes_per_second, _latency())  # fmt: skip
    sizes = replace(base.sizes, custom=True, allreduce=(4 * KIB,), allreduce_latency=(8, 4 * KIB))  # type: ignore[type-var]
    return verdict.judge(replace(base, allreduce=allreduce, sizes=sizes), ProbeSettings())


def test_version_2_report_matches_the_schema_and_reads_back(hgx: Topology) -> None:
    report = _deep(hgx)
    document = report_to_json(report)
    jsonschema.validate(document, REPORT_SCHEMA)
    assert document["schema_version"] == 2
    assert document["sizes"] == {
        "custom": True,
        "copy": [64 * KIB, 256 * MIB],
        "allreduce": [4096],
        "allreduce_latency": [8, 4096],
    }
    assert document["allreduce"]["latency"][0] == {
        "size_bytes": 8,
        "iterations": 1000,
        "min_seconds": 9e-6,
        "median_seconds": 11e-6,
        "p99_seconds": 30e-6,
    }
    assert document["asymmetry"][0]["path"] == "SYS"
    assert [d["numa_node"] for d in document["devices"]] == [0, 1]
    assert parse_report(json.dumps(document)) == report
    text = table.render(report)
    assert "sizes (--sizes): 64K,256M" in text
    assert "Small-message latency: 11.0 us median, 30.0 us p99 (8B, 1000 all-reduces)" in text
    assert "4K     1000  12.0    14.0  41.0" in text


def test_a_version_1_report_still_reads_with_the_new_fields_empty(hgx: Topology) -> None:
    # What the probe wrote before version 2, left under the run root across an upgrade.
    document = report_to_json(_deep(hgx))
    document["schema_version"] = 1
    del document["sizes"]
    del document["allreduce"]["latency"]
    for device in document["devices"]:
        del device["numa_node"]
    for peer in document["peers"]:
        del peer["path"]
    for pair in document["asymmetry"]:
        del pair["path"], pair["numa_a"], pair["numa_b"]
    report = parse_report(json.dumps(document))
    assert report.schema_version == 1 and report.sizes is None
    assert report.allreduce is not None and report.allreduce.latency == ()
    assert report.allreduce.latency_floor is None
    assert {p.path for p in report.peers} == {None}
    assert report.asymmetry[0].path is None and report.asymmetry[0].numa_a is None
    assert "Small-message latency" not in table.render(report)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("sizes"), r"report: missing sizes"),
        (lambda d: d["allreduce"].pop("latency"), r"allreduce: missing latency"),
        (lambda d: d["devices"][1].pop("numa_node"), r"devices\[1\]: missing numa_node"),
        (lambda d: d["peers"][0].pop("path"), r"peers\[0\]: missing path"),
        (lambda d: d["asymmetry"][0].update(numa_b="1"), r"asymmetry\[0\].numa_b: expected an"),
        (lambda d: d["sizes"]["copy"].append(0), r"sizes.copy\[2\]: size 0 is not above 0"),
        (lambda d: d["sizes"].update(custom=None), r"sizes.custom: expected true or false"),
        (
            lambda d: d["allreduce"]["latency"][1].update(median_seconds=1.0),
            r"allreduce.latency\[1\]: expected 0 <= min_seconds <= median_seconds <= p99",
        ),
        (
            lambda d: d["allreduce"]["latency"][0].update(iterations=0),
            r"allreduce.latency\[0\].iterations: 0 is not above 0",
        ),
        (lambda d: d.update(schema_version=True), r"schema_version: expected an integer"),
        (lambda d: d.clear(), r"report: missing schema_version"),
    ],
)
def test_the_reader_names_the_bad_version_2_field(hgx: Topology, mutate: Any, message: str) -> None:
    document = report_to_json(_deep(hgx))
    mutate(document)
    with pytest.raises(ParseError, match=message):
        parse_report(json.dumps(document), source="probe-report.json")


_JSON = json_values(8, max_key=8)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_reader_fuzz_on_a_version_2_report_raises_only_parse_error(
    hgx: Topology, data: st.DataObject
) -> None:
    document: Any = report_to_json(_deep(hgx))
    if data.draw(st.booleans()):
        document["schema_version"] = 1  # the same mutations, read as a version 1 report
    # Replace or drop one value anywhere in the tree.
    node = document
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            break
        key = data.draw(st.sampled_from(keys))
        child = node[key]
        if isinstance(child, dict | list) and child and data.draw(st.booleans()):
            node = child
            continue
        if isinstance(node, dict) and data.draw(st.booleans()):
            del node[key]
        else:
            node[key] = data.draw(_JSON)
        break
    with contextlib.suppress(ParseError):
        report = parse_report(json.dumps(document))
        # Whatever reads back renders: the table never meets a type it does not expect.
        table.render(report)


# --- the daemon's hook carries --sizes, bounded -----------------------------------------------


def test_probe_hook_passes_checked_sizes_and_refuses_others(tmp_path: Path) -> None:
    config = from_mapping({"roots": {"run": str(tmp_path / "run")}})
    commands: list[list[str]] = []
    done = threading.Event()

    def fake(command: Sequence[str], timeout: float) -> tuple[int, str, str]:
        commands.append(list(command))
        done.set()
        return 3, "", "nothing measured"

    hook = ProbeHook(lambda: config, run=fake)
    for bad, why in [
        ("4K", "sizes must be a list"),
        ([4096, "1M"], "sizes: '1M' is not a whole number"),
        ([4096, True], "sizes: True is not a whole number"),
        ([2], "sizes: 2B is outside"),
        ([1 << 40], "sizes: 1024G is outside"),
        ([4096] * 65, "sizes must be a list"),
        ([4096, 4096], "sizes: 4K is given twice"),
    ]:
        answer = hook.start({"command": "probe", "sizes": bad})
        assert answer["ok"] is False and answer["error"].startswith(why), (bad, answer)
    assert commands == []
    assert hook.start({"command": "probe", "sizes": [1 << 20, 8]})["started"] is True
    hook.wait(10)
    assert done.is_set()
    assert commands[0][-1] == "--sizes=8,1M"


# --- NV# from NVML: the probe's seam ----------------------------------------------------------


def test_the_probe_reads_nvlink_counts_through_the_nvml_source(
    hgx: Topology, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from nodescope.probe.__main__ import nvlink_counts
    from nodescope.sim.fake_nvml import FakeNvml, hgx_h100

    roots = Roots.under(cached_hgx_h100_tree(tmp_path_factory.getbasetemp() / "hgx-h100"))
    counts = nvlink_counts(roots, hgx, FakeNvml(hgx_h100(links=12)))
    gpus = sorted(GPU.values())
    assert counts == {frozenset((a, b)): 12 for a in gpus for b in gpus if a < b}
    # The same counts make every GPU pair's path NV12, whatever its PCIe class.
    assert pair_path(hgx, GPU[0], GPU[7], counts).path == "NV12"  # type: ignore[union-attr]
    # No topology, an NVML that is not one, another host's tree without NVML: no counts,
    # and the pairs keep their PCIe classes.
    assert nvlink_counts(roots, None, FakeNvml(hgx_h100())) == {}
    assert nvlink_counts(roots, hgx, object()) == {}  # type: ignore[arg-type]
    assert nvlink_counts(roots, hgx) == {}


def test_via_daemon_carries_the_sizes_over_the_hook_socket(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nodescope.cli.main import build_parser
    from nodescope.cli.probe import via_daemon
    from nodescope.hooks.transport import HookServer, socket_path

    config = from_mapping({"roots": {"run": str(tmp_path / "run")}})
    commands: list[list[str]] = []
    report = verdict.judge(make_report(), ProbeSettings())

    def fake(command: Sequence[str], timeout: float) -> tuple[int, str, str]:
        commands.append(list(command))
        return 0, json.dumps(report_to_json(report)), ""

    hook = ProbeHook(lambda: config, run=fake)
    server = HookServer(socket_path(Roots(run=tmp_path / "run")), lambda peer: True)
    server.register("probe", hook.start)
    server.register("probe_result", hook.result)
    server.start()
    try:
        args = build_parser().parse_args(
            ["probe", "--via-daemon", "--sizes", "1M,4K", f"--run={tmp_path / 'run'}"]
        )
        status = via_daemon(args, poll_seconds=0.05)
    finally:
        server.stop()
    assert status == 0, capsys.readouterr().err
    (command,) = commands
    assert command[-1] == "--sizes=4K,1M"
