"""``replay`` and ``demo`` driven against a small hand-written node.

The node writes a /proc/diskstats whose read counter grows at a known rate and has one
source that fails for a known stretch of simulated time, so the tests know exactly what the
exposition, the rates and the timeline must say.
"""

from __future__ import annotations

import io
import json
import os
import re
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from nodescope.detectors.registry import DetectorInfo
from nodescope.errors import ParseError
from nodescope.model.finding import Finding, Severity
from nodescope.model.snapshot import Snapshot, SourceSample, SourceStatus
from nodescope.roots import Roots
from nodescope.sim.driver import (
    Timeline,
    demo,
    demo_view,
    format_t,
    replay,
    replay_document,
    replay_text,
    tick_times,
)
from nodescope.sim.expect import Expectations, parse_expectations
from nodescope.sources import diskstats
from nodescope.sources.base import Source
from nodescope.sources.nvml import LostGpu, NvmlData, XidCount
from nodescope.sources.registry import SourceInputs

SECTORS_PER_SECOND = 2000
READ_BYTES_PER_SECOND = SECTORS_PER_SECOND * 512
OUTAGE = (3.0, 5.0)  # the flaky source fails for 3 <= t < 5


@dataclass(frozen=True)
class ToyScenario:
    name: str = "toy"
    description: str = "one NVMe drive reading 1 MB/s and a source with an outage"
    tick_seconds: float = 1.0
    duration_seconds: float = 8.0
    expect: Expectations = field(default_factory=Expectations)
    source_path: str | None = "toy.json"


class FlakySource:
    name = "flaky"

    def __init__(self, node: ToyNode) -> None:
        self.node = node
        self.closed = False

    def collect(self, roots: Roots) -> int:
        if OUTAGE[0] <= self.node.t < OUTAGE[1]:
            raise RuntimeError("simulated outage")
        return 1

    def close(self) -> None:
        self.closed = True


@dataclass
class ToyNode:
    scenario: Any
    root: Path
    t: float = 0.0
    advanced: list[float] = field(default_factory=list)
    made: list[Source] = field(default_factory=list)

    @property
    def roots(self) -> Roots:
        return Roots.under(self.root)

    def _write(self, relative: str, text: str) -> None:
        path = self.root / relative
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)  # the daemon never sees half a file

    def _diskstats(self) -> None:
        sectors = int(SECTORS_PER_SECOND * self.t)
        reads = sectors // 8
        self._write(
            "proc/diskstats",
            f" 259       0 nvme0n1 {reads} 0 {sectors} {reads} 10 0 80 5 0 {reads} {reads} "
            "0 0 0 0 0 0\n",
        )
        self._write("proc/uptime", f"{1000 + self.t:.2f} 0.00\n")

    def materialise(self) -> None:
        (self.root / "proc").mkdir(parents=True)
        (self.root / "sys" / "block" / "nvme0n1").mkdir(parents=True)
        self._diskstats()

    def advance_to(self, t: float) -> None:
        self.t = t
        self.advanced.append(t)
        self._diskstats()

    def refresh(self, t: float, reader: str | None = None) -> None:
        self.advance_to(t)

    def sources(self, inputs: SourceInputs | None = None) -> list[Source]:
        self.made = [diskstats.make_source(), FlakySource(self)]
        return self.made


def toy_expect(metrics: list[dict[str, Any]]) -> Expectations:
    return parse_expectations({"metrics": metrics}, "toy.json")


READ_RATE = {
    "name": "nodescope_disk_read_bytes_total",
    "labels": {"device": "nvme0n1"},
    "aggregate": "rate",
    "min": READ_BYTES_PER_SECOND,
    "max": READ_BYTES_PER_SECOND,
    "from": 1,
}
FLAKY_DOWN = {
    "name": "nodescope_source_up",
    "labels": {"source": "flaky"},
    "max": 0,
    "from": OUTAGE[0],
    "to": OUTAGE[1] - 1,
}
FLAKY_UP_AFTER = {
    "name": "nodescope_source_up",
    "labels": {"source": "flaky"},
    "min": 1,
    "from": OUTAGE[1],
}


def run_toy(tmp_path: Path, metrics: list[dict[str, Any]], **scenario: Any) -> Any:
    nodes: list[ToyNode] = []

    def factory(sc: Any, root: Path) -> ToyNode:
        nodes.append(ToyNode(sc, root))
        return nodes[-1]

    sc = ToyScenario(expect=toy_expect(metrics), **scenario)
    return replay(sc, tmp_path / "root", node_factory=factory), nodes


def test_tick_times_do_not_drift() -> None:
    times = tick_times(0.1, 60.0)
    assert len(times) == 601
    assert times[-1] == 60.0
    assert times[3] == 0.3
    assert tick_times(1.0, 0.0) == [0.0]
    assert tick_times(2.0, 5.0) == [0.0, 2.0, 4.0]


def test_format_t() -> None:
    assert format_t(12) == "t=  12s"
    assert format_t(12.5) == "t=  12.5s"


def test_replay_passes_and_reads_rates_in_simulated_time(tmp_path: Path) -> None:
    result, (node,) = run_toy(tmp_path, [READ_RATE, FLAKY_DOWN, FLAKY_UP_AFTER])
    assert result.passed, replay_text(result)
    rate = result.metrics[0]
    # 9 cycles (t=0..8) in a few milliseconds of wall time: the rate can only be 1 MB/s if
    # it was taken over simulated seconds.
    assert result.cycles == 9
    assert rate.cycles_evaluated == 8
    assert rate.observed_min == rate.observed_max == READ_BYTES_PER_SECOND
    assert [m.cycles_evaluated for m in result.metrics[1:]] == [2, 4]
    # Each of the two sources moves the node to the cycle's second before it reads.
    assert node.advanced == [float(t) for t in range(9) for _ in range(2)]
    assert result.sources == ("disks", "flaky")
    assert all(getattr(s, "closed", True) for s in node.made)


def test_the_daemons_cycle_runs_every_second_of_its_tick_whatever_the_scrapes(
    tmp_path: Path,
) -> None:
    seen: list[tuple[float, float, float, int]] = []

    def on_cycle(t: float, snapshot: Snapshot, body: bytes) -> None:
        disks = snapshot.current["disks"]
        seen.append((t, disks.monotonic, snapshot.monotonic, snapshot.status["disks"].runs_total))
        assert b'nodescope_disk_read_bytes_total{device="nvme0n1"}' in body

    sc = ToyScenario(tick_seconds=0.5, duration_seconds=2.0)
    replay(sc, tmp_path / "r", node_factory=ToyNode, on_cycle=on_cycle)
    # Scraped every half second, collected every second (the daemon's tick): a scrape between
    # two cycles shows the last one, as the daemon's /metrics does.
    assert seen == [
        (0.0, 0.0, 0.0, 1),
        (0.5, 0.0, 0.0, 1),
        (1.0, 1.0, 1.0, 2),
        (1.5, 1.0, 1.0, 2),
        (2.0, 2.0, 2.0, 3),
    ]


def test_failing_expectation_names_itself_and_the_observed_values(tmp_path: Path) -> None:
    too_slow = {k: v for k, v in READ_RATE.items() if k != "min"}
    too_slow["max"] = READ_BYTES_PER_SECOND / 2
    result, _ = run_toy(tmp_path, [FLAKY_UP_AFTER, too_slow])
    assert not result.passed
    (failed,) = result.failures
    assert failed.expectation.pointer == "/expect/metrics/1"
    assert failed.violations == 8
    text = replay_text(result)
    assert 'FAIL rate(nodescope_disk_read_bytes_total{device="nvme0n1"}) <= 512000' in text
    assert "observed 1.024e+06..1.024e+06" in text
    assert "[/expect/metrics/1]" in text
    assert text.rstrip().endswith("FAIL: 1 of 2 metric expectation(s) held, 1 failed")

    doc = json.loads(json.dumps(replay_document(result)))
    assert doc["summary"] == {
        "passed": False,
        "metrics_passed": 1,
        "metrics_failed": 1,
        "findings_passed": 0,
        "findings_failed": 0,
        "findings_unchecked": 0,
    }
    entry = doc["expectations"]["metrics"][1]
    assert entry["status"] == "fail"
    assert entry["observed_min"] == entry["observed_max"] == READ_BYTES_PER_SECOND
    assert entry["first_violation"] == {
        "t": 1.0,
        "labels": {"device": "nvme0n1"},
        "value": READ_BYTES_PER_SECOND,
    }
    assert entry["labels"] == {"device": "nvme0n1"}
    assert doc["expectations"]["metrics"][0]["status"] == "pass"


def test_timeline_records_source_down_and_up_once(tmp_path: Path) -> None:
    result, _ = run_toy(tmp_path, [])
    assert [(e.t, e.kind, e.subject) for e in result.timeline] == [
        (3.0, "source_down", "flaky"),
        (5.0, "source_up", "flaky"),
    ]
    assert result.timeline[0].text() == "t=   3s  source flaky DOWN: RuntimeError: simulated outage"
    assert "t=   5s  source flaky up again" in replay_text(result)
    doc = replay_document(result)
    assert doc["timeline"][0]["detail"] == "RuntimeError: simulated outage"


def test_without_detectors_findings_are_reported_unchecked_and_do_not_fail(
    tmp_path: Path,
) -> None:
    sc = ToyScenario(
        expect=parse_expectations(
            {
                "findings": [{"kind": "disk_saturated", "subjects": ["nvme0n1"]}],
                "no_other_findings": True,
            },
            "toy.json",
        )
    )
    result = replay(sc, tmp_path / "r", node_factory=ToyNode, detectors=[])
    assert result.passed
    text = replay_text(result)
    assert "skip finding disk_saturated on nvme0n1 within t>=0s: not checkable yet" in text
    assert "skip no other findings: not checkable yet" in text
    assert replay_document(result)["summary"]["findings_unchecked"] == 2


def outage_detector(previous: Snapshot | None, snapshot: Snapshot, config: Any) -> list[Finding]:
    """A finding while the toy node's flaky source is down."""
    found = []
    status = snapshot.status.get("flaky")
    if status is not None and not status.up:
        found.append(
            Finding("source_outage", Severity.WARNING, {"source": "flaky"}, {}, "flaky is down")
        )
    return found


OUTAGE_DETECTORS = [DetectorInfo("outage", outage_detector)]


def test_findings_are_checked_and_on_the_timeline_when_detectors_run(tmp_path: Path) -> None:
    expect = {
        "findings": [{"kind": "source_outage", "subjects": ["flaky"], "from": 3, "to": 4}],
        "no_other_findings": True,
    }
    sc = ToyScenario(expect=parse_expectations(expect, "toy.json"))
    result = replay(sc, tmp_path / "r", node_factory=ToyNode, detectors=OUTAGE_DETECTORS)
    assert result.passed, replay_text(result)
    found, others = result.findings
    assert (found.status, found.first_seen, found.finding) == (
        "pass",
        3.0,
        "source_outage{source=flaky}",
    )
    assert (others.status, others.reason) == ("pass", "none appeared")
    assert [e.text() for e in result.timeline if e.kind.startswith("finding")] == [
        "t=   3s  finding source_outage{source=flaky}: (warning) flaky is down",
        "t=   5s  finding source_outage{source=flaky} cleared",
    ]
    doc = replay_document(result)
    assert doc["summary"]["findings_passed"] == 2
    assert doc["expectations"]["findings"][0]["first_seen"] == 3.0


def test_a_missing_or_unexpected_finding_fails_the_replay(tmp_path: Path) -> None:
    expect = {
        "findings": [{"kind": "source_outage", "subjects": ["flaky"], "from": 6}],
        "no_other_findings": True,
    }
    sc = ToyScenario(expect=parse_expectations(expect, "toy.json"))
    result = replay(sc, tmp_path / "r", node_factory=ToyNode, detectors=OUTAGE_DETECTORS)
    assert not result.passed
    missing, others = result.findings
    assert (missing.status, missing.reason) == ("fail", "no such finding in the window")
    assert others.status == "fail"
    assert others.reason == "1 unexpected finding(s): source_outage{source=flaky} at t=3s"
    text = replay_text(result)
    assert "FAIL finding source_outage on flaky within t>=6s" in text
    assert text.rstrip().endswith("finding expectations: 2 failed")


def test_unknown_metric_is_rejected_before_the_node_is_built(tmp_path: Path) -> None:
    built: list[Path] = []

    def factory(sc: Any, root: Path) -> ToyNode:
        built.append(root)
        return ToyNode(sc, root)

    sc = ToyScenario(expect=toy_expect([{"name": "nodescope_disk_reads_bytes_total"}]))
    with pytest.raises(ParseError, match=r"toy.json: /expect/metrics/0/name: nodescope exports"):
        replay(sc, tmp_path / "r", node_factory=factory)
    assert built == []


def _nvml(lost: tuple[LostGpu, ...], xids: tuple[XidCount, ...]) -> NvmlData:
    return NvmlData(device_count=8, gpus=(), lost=lost, xids=xids, xid_source="events", events=())


def _snapshot(cycle: int, data: Any) -> Snapshot:
    return Snapshot(
        cycle=cycle,
        monotonic=float(cycle),
        wall_time=0.0,
        current={"nvml": SourceSample("nvml", float(cycle), 0.0, data)},
        status={"nvml": SourceStatus("nvml", True, cycle, 0, 1.0)},
    )


def test_timeline_reports_lost_gpus_and_new_xids_once() -> None:
    timeline = Timeline()
    gone = LostGpu(3, "GPU-3", "0000:9b:00.0")
    xid = XidCount(3, "0000:9b:00.0", 79, 1)
    assert timeline.update(0, _snapshot(1, _nvml((), ()))) == []
    events = timeline.update(30, _snapshot(2, _nvml((gone,), (xid,))))
    assert [e.text() for e in events] == [
        "t=  30s  gpu 3 (0000:9b:00.0): lost by NVML (GPU-3)",
        "t=  30s  gpu 3 (0000:9b:00.0): Xid 79 (GPU has fallen off the bus) x1",
    ]
    assert timeline.update(31, _snapshot(3, _nvml((gone,), (xid,)))) == []
    more = XidCount(3, "0000:9b:00.0", 79, 3)
    (again,) = timeline.update(32, _snapshot(4, _nvml((gone,), (more,))))
    assert again.detail.endswith("x2")


def test_demo_view_shows_disk_rates_and_source_health(tmp_path: Path) -> None:
    snapshots: list[Snapshot] = []
    sc = ToyScenario(duration_seconds=4.0)
    replay(sc, tmp_path / "r", node_factory=ToyNode, on_cycle=lambda t, s, b: snapshots.append(s))
    text = demo_view(sc, 4.0, snapshots[-1], [], "http://127.0.0.1:1/metrics")
    # 1,024,000 B/s is iostat's 1.0 rMB/s (MiB); the toy node has no PCI tree ("?").
    assert re.search(r"^nvme0n1\s+\?\s+1\.0\s+0\.0\s+25%", text, re.MULTILINE), text
    assert "sources: disks up, flaky DOWN" in text  # t=4 is inside the outage
    assert "waiting for the first" in demo_view(sc, 0.0, None, [], "u")


def test_demo_serves_metrics_shows_findings_and_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nodescope.analysis

    # The daemon's analysis step runs the registry's detectors: give it the toy one.
    monkeypatch.setattr(nodescope.analysis, "DETECTORS", tuple(OUTAGE_DETECTORS))
    out = io.StringIO()
    scraped: list[str] = []

    class ScrapingNode(ToyNode):
        def advance_to(self, t: float) -> None:
            super().advance_to(t)
            # In wall time the node moves to any second: scrape once, past t = 2.
            if t >= 2.0 and not scraped:
                url = re.search(r"serving (\S+)", out.getvalue())
                assert url is not None
                with urllib.request.urlopen(url.group(1), timeout=5) as response:
                    scraped.append(response.read().decode())

    sc = ToyScenario(duration_seconds=60.0)
    status = demo(
        sc,
        "127.0.0.1:0",
        duration=OUTAGE[1] + 1.5,
        tty=False,
        out=out,
        node_factory=ScrapingNode,
        install_signal_handlers=False,
    )
    text = out.getvalue()
    assert status == 0, text
    root = re.search(r"node under (\S+), serving", text)
    assert root is not None
    assert not Path(root.group(1)).exists()
    assert f"removed {root.group(1)}" in text
    assert text.count("--- t=") >= 4
    assert "nodescope demo: toy" in text
    assert scraped and 'nodescope_disk_read_bytes_total{device="nvme0n1"}' in scraped[0]
    # The outage (simulated t=3..5) as the daemon saw it: a finding in the view and events.
    assert "  WARNING  flaky is down" in text
    assert "finding source_outage{source=flaky}: (warning) flaky is down" in text
    assert "source flaky DOWN: RuntimeError: simulated outage" in text


def test_demo_reports_a_port_in_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = io.StringIO()
        status = demo(
            ToyScenario(),
            f"127.0.0.1:{port}",
            duration=1,
            tty=False,
            out=out,
            node_factory=ToyNode,
            install_signal_handlers=False,
        )
    assert status == 1
    assert "cannot listen" in capsys.readouterr().err
    removed = re.search(r"removed (\S+)", out.getvalue())
    assert removed is not None and not Path(removed.group(1)).exists()


@pytest.fixture
def sim_root() -> Iterator[Path]:
    """An empty directory for a DGX-class node, on a tmpfs when there is one: the node is
    tens of thousands of small files."""
    import shutil
    import tempfile

    from nodescope.sim.driver import temp_dir

    parent = Path(tempfile.mkdtemp(prefix="nodescope-test-", dir=temp_dir()))
    yield parent / "root"
    shutil.rmtree(parent)


def _scenario_file(tmp_path: Path, expect: dict[str, Any], duration: int = 3) -> Path:
    path = tmp_path / "short.json"
    path.write_text(
        json.dumps(
            {
                "format": "nodescope-scenario/1",
                "name": "short",
                "description": "GPU 0 copies 2 GB/s to the device",
                "tick_seconds": 1,
                "duration_seconds": duration,
                "hardware": {"base": "dgx-h100"},
                "timeline": [
                    {"kind": "gpu_pcie", "from": 0, "gpu": 0, "h2d_bytes_per_second": 2e9}
                ],
                "expect": expect,
            }
        )
    )
    return path


H2D_GPU0 = {"name": "nodescope_gpu_pcie_rx_bytes_total", "labels": {"gpu": "0"}}


@pytest.mark.slow  # a whole scenario replayed
def test_cli_replay_exit_1_names_the_failed_expectation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nodescope.cli.main import main

    wrong = {"metrics": [dict(H2D_GPU0, aggregate="rate", min=3e9, **{"from": 1})]}
    path = _scenario_file(tmp_path, wrong)
    assert main(["replay", str(path)]) == 1
    out = capsys.readouterr().out
    assert 'FAIL rate(nodescope_gpu_pcie_rx_bytes_total{gpu="0"}) >= 3e+09 over t>=1s' in out
    assert "observed 2e+09..2e+09" in out
    assert "[/expect/metrics/0]" in out

    assert main(["replay", "--json", str(path)]) == 1
    doc = json.loads(capsys.readouterr().out)
    (entry,) = doc["expectations"]["metrics"]
    assert (entry["status"], entry["observed_min"], entry["observed_max"]) == ("fail", 2e9, 2e9)
    assert doc["summary"]["passed"] is False
    assert doc["source"] == str(path)


def test_cli_replay_exit_0_when_every_expectation_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nodescope.cli.main import main

    right = {"metrics": [dict(H2D_GPU0, aggregate="rate", min=1.99e9, max=2.01e9)]}
    assert main(["replay", str(_scenario_file(tmp_path, right))]) == 0
    assert "PASS: 1 of 1 metric expectation(s) held" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("expect", "message"),
    [
        (
            {"metrics": [dict(H2D_GPU0, aggregate="avg")]},
            "/expect/metrics/0/aggregate: must be one of value, rate",
        ),
        (
            {"metrics": [{"name": "nodescope_gpu_pcie_rx_byte_total"}]},
            "/expect/metrics/0/name: nodescope exports no nodescope_gpu_pcie_rx_byte_total",
        ),
        (
            {"metrics": [dict(H2D_GPU0, labels={"index": "0"})]},
            "/expect/metrics/0/labels/index: nodescope_gpu_pcie_rx_bytes_total has no label",
        ),
    ],
)
def test_cli_replay_exit_2_on_an_invalid_scenario(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], expect: dict[str, Any], message: str
) -> None:
    from nodescope.cli.main import main

    path = _scenario_file(tmp_path, expect)
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: {message}" in err


def test_cli_replay_exit_2_without_a_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    from nodescope.cli.main import main

    assert main(["replay"]) == 2
    assert "--list shows the bundled ones" in capsys.readouterr().err
    assert main(["replay", "no-such-scenario"]) == 2
    assert "no-such-scenario" in capsys.readouterr().err


def test_default_demo_scenario_shows_contention_within_30_seconds(sim_root: Path) -> None:
    """GPU 0's copies and nvme0n1's reads on one root port are on screen by t=12."""
    from dataclasses import replace

    from nodescope.cli.demo import DEFAULT_SCENARIO
    from nodescope.sim.scenario import load_scenario

    scenario = replace(load_scenario(DEFAULT_SCENARIO), duration_seconds=12.0)
    last: list[Snapshot] = []
    replay(scenario, sim_root, on_cycle=lambda t, s, b: last.append(s))
    text = demo_view(scenario, 12.0, last[-1], [], "url")
    gpu0 = re.search(r"^  0  0000:19:00\.0  (\S+)\s+Gen5 x16\s+([\d.]+)", text, re.MULTILINE)
    nvme = re.search(r"^nvme0n1\s+(\S+)\s+([\d.]+)", text, re.MULTILINE)
    assert gpu0 is not None and nvme is not None, text
    assert gpu0.group(1) == nvme.group(1) == "0000:15:01.0"
    assert float(gpu0.group(2)) == pytest.approx(41.0, abs=0.5)  # GB/s host to device
    assert float(nvme.group(2)) > 6000  # MB/s read


@pytest.mark.slow  # whole scenarios replayed
def test_cli_replay_several_scenarios_reports_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nodescope.cli.main import main

    good_dir, bad_dir = tmp_path / "good", tmp_path / "bad"
    good_dir.mkdir()
    bad_dir.mkdir()
    good = _scenario_file(good_dir, {"metrics": [dict(H2D_GPU0, min=0)]}, duration=1)
    bad = _scenario_file(bad_dir, {"metrics": [dict(H2D_GPU0, max=0)]}, duration=1)
    assert main(["replay", "--json", str(good), str(bad)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [d["source"] for d in doc["scenarios"]] == [str(good), str(bad)]
    assert doc["summary"] == {"passed": False, "scenarios_passed": 1, "scenarios_failed": 1}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--listen", "localhost"], "--listen: 'localhost' is not HOST:PORT"),
        (["--duration", "0"], "--duration must be greater than 0"),
        (["no-such-scenario"], "no bundled scenario 'no-such-scenario'"),
    ],
)
def test_cli_demo_rejects_bad_arguments_before_starting(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from nodescope.cli.main import main

    assert main(["demo", "--no-tty", *args]) == 2
    assert message in capsys.readouterr().err
