"""``nodescope snapshot``: two samples, the derived figures over the measured time."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from nodescope import jsonout
from nodescope.cli import snapshot as snapshot_cli
from nodescope.cli.main import build_parser
from nodescope.collect import Collector, ScheduledSource
from nodescope.roots import Roots
from nodescope.sim.sysfs_tree import cached_hgx_h100_tree
from nodescope.sources import diskstats
from tests.conftest import HOST_FIXTURE, nodescope_command

LATER = """\
 254       0 vda 9000 500 800000 4000 7000 900 600000 9000 0 12000 14000 0 0 0 0 0 0
"""
EARLIER = """\
 254       0 vda 8000 400 700000 3000 6000 800 500000 8000 2 10000 11000 0 0 0 0 0 0
"""


def test_snapshot_disk_figures_are_sysstats_formulas_on_the_two_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    procfs = tmp_path / "proc"
    procfs.mkdir()
    (procfs / "diskstats").write_text(EARLIER)
    (procfs / "uptime").write_text("1000.00 1900.00\n")
    roots = Roots(procfs=procfs, sysfs=HOST_FIXTURE / "sys")

    def second_sample_arrives(seconds: float) -> None:
        (procfs / "diskstats").write_text(LATER)

    monkeypatch.setattr(snapshot_cli.time, "sleep", second_sample_arrives)
    collector = Collector(roots, [ScheduledSource(diskstats.make_source(), 1.0)])
    document = snapshot_cli.snapshot_document(snapshot_cli.take(collector, 1.0))
    entry = document["sources"]["disks"]
    seconds = entry["seconds_between_samples"]
    assert seconds > 0

    earlier = diskstats.DisksData(disks=diskstats.parse_diskstats(EARLIER), uptime_seconds=1000.0)
    later = diskstats.DisksData(disks=diskstats.parse_diskstats(LATER), uptime_seconds=1000.0)
    expected = jsonout.plain(diskstats.iostat_figures(earlier, later, seconds))
    assert entry["derived"] == expected
    vda = entry["derived"]["devices"][0]
    # sysstat: r/s = Δreads/Δt, rMB/s = Δsectors/Δt/2048, r_await = Δms_reading/Δreads.
    assert vda["r_s"] == pytest.approx(1000 / seconds)
    assert vda["rmb_s"] == pytest.approx(100000 / seconds / 2048)
    assert vda["r_await"] == pytest.approx(1000 / 1000)


def test_snapshot_json_on_this_machine() -> None:
    proc = subprocess.run(
        [*nodescope_command(), "snapshot", "--json", "--interval", "0.2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    document = json.loads(proc.stdout)
    disks = document["sources"]["disks"]
    assert disks["ok"]
    assert disks["derived"] is not None
    assert 0.15 < disks["seconds_between_samples"] < 5
    assert document["sources"]["pci"]["ok"]


def _section(text: str, title: str) -> list[str]:
    """The lines of the text's section that starts with ``title`` (up to a blank line)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    end = next((i for i in range(start, len(lines)) if not lines[i]), len(lines))
    return lines[start:end]


def _snapshot(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [*nodescope_command(), "snapshot", *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def _busy_disks() -> set[str]:
    """The whole disks of this machine (/sys/block) that completed a request since boot,
    read from /proc/diskstats: the devices iostat lists."""
    whole = {p.name.replace("!", "/") for p in Path("/sys/block").iterdir()}
    busy = set()
    for line in Path("/proc/diskstats").read_text().splitlines():
        fields = line.split()
        counts = [int(fields[i]) for i in (3, 7, 14, 18) if i < len(fields)]
        if fields[2] in whole and any(counts):
            busy.add(fields[2])
    return busy


def test_snapshot_text_on_this_machine() -> None:
    proc = _snapshot("--interval", "0.2")
    disks = _section(proc.stdout, "Disks")
    header = disks[1].split()
    assert header[:3] == ["Device", "r/s", "rMB/s"] and header[-1] == "%util"
    rows = [line.split() for line in disks[2:]]
    busy = _busy_disks()
    if rows and rows[-1][0] == "...":
        # More disks than a section lists (loop devices of earlier tests count): the rest
        # is said in one line.
        more = int(rows.pop()[2])
        assert {row[0] for row in rows} <= busy and len(rows) + more == len(busy)
    else:
        assert {row[0] for row in rows} == busy
    for row in rows:
        assert len(row) == len(header)
        assert all(float(cell) >= 0 for cell in row[1:])
    assert _section(proc.stdout, "Topology:")
    gpus = _section(proc.stdout, "GPUs:")
    # No GPU here: the line says why NVML gave nothing rather than "0 GPUs".
    if not Path("/dev/nvidiactl").exists():
        assert gpus[0].startswith("GPUs: NVML: ")
    ports = _section(proc.stdout, "Network ports")
    names = {p.name for p in Path("/sys/class/net").iterdir()}
    listed = {line.split()[0] for line in ports[1:] if not line.startswith("  infiniband")}
    assert listed == names
    sources = _section(proc.stdout, "Sources:")
    for name in ("disks", "pci", "netdev", "jobs"):
        assert any(f"{name} ok " in line for line in sources), sources


def test_snapshot_text_on_a_fixture_tree(tmp_path_factory: pytest.TempPathFactory) -> None:
    hgx = cached_hgx_h100_tree(tmp_path_factory.getbasetemp() / "hgx-h100")
    tree = ["--sysfs", str(hgx / "sys"), "--procfs", str(HOST_FIXTURE / "proc")]
    proc = _snapshot("--interval", "0.1", *tree)
    topo = subprocess.run(
        [*nodescope_command(), "topo", "--json", "--sysfs", str(hgx / "sys")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert topo.returncode == 0, topo.stderr
    expected = json.loads(topo.stdout)
    kinds = [d["kind"] for d in expected["devices"]]
    numa = sorted({d["numa_node"] for d in expected["devices"] if d["numa_node"] is not None})
    topology = _section(proc.stdout, "Topology:")
    assert topology[0] == (
        f"Topology: {kinds.count('gpu')} GPUs, {kinds.count('nic')} NICs,"
        f" {kinds.count('nvme')} NVMe drives; NUMA nodes {', '.join(map(str, numa))}"
    )
    assert kinds.count("gpu") == 8
    ports = [line.split() for line in topology[1:] if line.startswith("  root port")]
    assert [(p[2], int(p[4]), p[7:]) for p in ports] == [
        (r["bdf"], r["numa_node"], r["devices"]) for r in expected["root_ports"]
    ]
    for words, port in zip(ports, expected["root_ports"], strict=True):
        assert words[5:7] == [f"Gen{port['generation']}", f"x{port['width']}"]
    # The HGX tree has no block devices of its own.
    assert _section(proc.stdout, "Disks")[1:] == ["  no disk has completed a request since boot"]
    tree = ["--sysfs", str(HOST_FIXTURE / "sys"), "--procfs", str(HOST_FIXTURE / "proc")]
    proc = _snapshot("--interval", "0.1", *tree)
    disks = _section(proc.stdout, "Disks")
    assert [line.split()[0] for line in disks[2:]] == ["vda"]
    # The fixture's counters do not move: every rate over the interval is a number, 0.
    assert {float(cell) for cell in disks[2].split()[1:]} == {0.0}


@pytest.mark.parametrize("bad", ["0", "-1", "0.05", "60.5", "100000", "nan", "inf", "soon"])
def test_snapshot_refuses_an_interval_out_of_bounds(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["snapshot", "--interval", bad])
    assert exit_.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1
    assert errors[0].startswith("nodescope snapshot: error: argument --interval: ")
    assert bad in errors[0]
    if bad != "soon":
        assert "0.1..60 seconds" in errors[0]


def test_snapshot_interval_bounds_are_inclusive() -> None:
    for good in ("0.1", "1", "60"):
        assert build_parser().parse_args(["snapshot", "--interval", good]).interval == float(good)


def _bytes_per_second(text: str) -> float:
    number, unit = text.split()
    return float(number) * {"B/s": 1, "kB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12}[unit]


def test_snapshot_text_of_a_simulated_hgx_node_shows_the_gpus_and_the_job(
    tmp_path: Path,
) -> None:
    """The GPU, port and job sections with NVML up: the simulated HGX H100 node, read twice
    one simulated second apart, its figures printed as the snapshot's rates say."""
    from nodescope.sim.driver import SimClock, default_node_factory
    from nodescope.sim.scenario import load_scenario
    from nodescope.sources.registry import SourceInputs

    node = default_node_factory(load_scenario("nvlink-saturation-nvml"), tmp_path)
    node.materialise()
    clock, inputs = SimClock(), SourceInputs()
    collector = Collector(
        roots=node.roots,
        scheduled=[ScheduledSource(s, 1.0) for s in node.sources(inputs=inputs)],
        clock=clock,
        wall_clock=lambda: 1e9 + clock.now,
        inputs=inputs,
    )
    try:
        for t in (5.0, 6.0):
            node.advance_to(t)
            clock.now = t
            snapshot = collector.run_cycle(force=True)
    finally:
        collector.close()
    text = snapshot_cli.render_text(snapshot, snapshot_cli.snapshot_document(snapshot))
    rates = snapshot.derived.gpu_rates
    assert rates is not None and len(rates.gpus) == 8
    gpus = _section(text, "GPUs:")
    assert gpus[0] == "GPUs: 8"
    for line, gpu in zip(gpus[1:], rates.gpus, strict=True):
        assert line.startswith(f"  GPU{gpu.index} NVIDIA H100")
        assert "util 93%" in line  # the scenario's load
        pcie = line.split("PCIe tx ")[1].split("  NVLink")[0]
        tx, rx = pcie.split(" rx ")
        assert gpu.pcie_tx_bytes_per_second and gpu.pcie_rx_bytes_per_second
        assert _bytes_per_second(tx) == pytest.approx(gpu.pcie_tx_bytes_per_second, rel=0.05)
        assert _bytes_per_second(rx) == pytest.approx(gpu.pcie_rx_bytes_per_second, rel=0.05)
        nvlink_tx = line.split("NVLink tx ")[1].split(" rx ")[0]
        sent = sum(v for v in gpu.nvlinks.data_tx_bytes_per_second if v is not None)
        assert sent > 1e11  # saturated links: hundreds of GB/s
        assert _bytes_per_second(nvlink_tx) == pytest.approx(sent, rel=0.05)
        assert line.endswith(f"over {len(gpu.nvlinks)} links")
    ports = _section(text, "Network ports")
    assert any(line.startswith("  mlx5_0 port 1  tx ") for line in ports)
    jobs = _section(text, "Jobs:")
    assert jobs[0] == "Jobs: 1" and jobs[1].startswith(
        "  job 81840  user zoe  GPUs 0,1,2,3,4,5,6,7"
    )
