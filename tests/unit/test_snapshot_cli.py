"""``nodescope snapshot``: two samples, the derived figures over the measured time."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from nodescope import jsonout
from nodescope.cli import snapshot as snapshot_cli
from nodescope.collect import Collector, ScheduledSource
from nodescope.roots import Roots
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
