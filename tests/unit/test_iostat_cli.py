"""`nodescope iostat`: sysstat 12.6's `iostat -dxm` columns, the since-boot first report, the
interval reports, COUNT, -y and -z."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from nodescope.cli.iostat import header_line, run_iostat
from nodescope.cli.main import main
from nodescope.roots import Roots
from tests.conftest import HOST_FIXTURE

# What `iostat -dxm` of sysstat 12.6.1 (Debian 12) prints as its column header.
SYSSTAT_HEADER = (
    "Device            r/s     rMB/s   rrqm/s  %rrqm r_await rareq-sz     w/s     wMB/s   wrqm/s"
    "  %wrqm w_await wareq-sz     d/s     dMB/s   drqm/s  %drqm d_await dareq-sz     f/s f_await"
    "  aqu-sz  %util"
)

# `iostat -dxm -p ALL` of sysstat 12.6.1 with /proc/diskstats and /proc/uptime bound to this
# machine's capture (tests/integration/test_iostat_oracle.py recomputes it against iostat when the
# capture is redone).
SYSSTAT_VDA_ROW = (
    "vda             99.71      1.44    25.83  20.57    0.26    14.79   29.56      1.81   253.55  "
    "89.56    1.48    62.64  141.07      0.60     0.08   0.06    0.09     4.36    1.23    0.05    "
    "0.08   2.88"
)


def test_header_is_sysstats() -> None:
    assert header_line() == SYSSTAT_HEADER


def test_first_report_of_this_machine_capture_is_iostats(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = main(
        ["iostat", "--procfs", str(HOST_FIXTURE / "proc"), "--sysfs", str(HOST_FIXTURE / "sys")]
    )
    assert status == 0
    lines = capsys.readouterr().out.split("\n")
    u = os.uname()
    assert lines[0].startswith(f"{u.sysname} {u.release} ({u.nodename}) \t")
    assert lines[0].endswith(f"_{u.machine}_\t({os.cpu_count()} CPU)")
    # Idle loop and zram devices are not shown, as iostat does not show them.
    assert lines[1:] == ["", SYSSTAT_HEADER, SYSSTAT_VDA_ROW, "", "", ""]


# A hand-made host: nvme0n1 (20 fields) with a partition, and an idle sdb (14 fields).
SAMPLE_1 = """\
 259 0 nvme0n1 1000 0 204800 500 0 0 0 0 0 1000 1000 0 0 0 0 0 0
 259 1 nvme0n1p1 1000 0 204800 500 0 0 0 0 0 1000 1000 0 0 0 0 0 0
   8 16 sdb 0 0 0 0 0 0 0 0 0 0 0
"""
# Two seconds later: +2000 reads (409600 sectors, 3000 ms), +1000 writes (204800 sectors,
# 8000 ms), +1500 ms busy, +4000 weighted ms.
SAMPLE_2 = """\
 259 0 nvme0n1 3000 0 614400 3500 1000 0 204800 8000 0 2500 5000 0 0 0 0 0 0
 259 1 nvme0n1p1 3000 0 614400 3500 1000 0 204800 8000 0 2500 5000 0 0 0 0 0 0
   8 16 sdb 0 0 0 0 0 0 0 0 0 0 0
"""
# Since boot (uptime 100 s): 10 r/s, 1 MB/s, 0.5 ms, 102.4 kB, 0.01 queue, 1 % busy.
ROW_SINCE_BOOT = (
    "nvme0n1         10.00      1.00     0.00   0.00    0.50   102.40    0.00      0.00     0.00"
    "   0.00    0.00     0.00    0.00      0.00     0.00   0.00    0.00     0.00    0.00    0.00"
    "    0.01   1.00"
)
# Over the 2 s: 1000 r/s, 100 MB/s, 1.5 ms; 500 w/s, 50 MB/s, 8 ms; queue 2; 75 % busy.
ROW_INTERVAL = (
    "nvme0n1       1000.00    100.00     0.00   0.00    1.50   102.40  500.00     50.00     0.00"
    "   0.00    8.00   102.40    0.00      0.00     0.00   0.00    0.00     0.00    0.00    0.00"
    "    2.00  75.00"
)
ROW_QUIET = (
    "nvme0n1          0.00      0.00     0.00   0.00    0.00     0.00    0.00      0.00     0.00"
    "   0.00    0.00     0.00    0.00      0.00     0.00   0.00    0.00     0.00    0.00    0.00"
    "    0.00   0.00"
)


class Host:
    """A fixture root whose diskstats moves on to the next sample each time the CLI sleeps."""

    def __init__(self, root: Path, samples: list[str]) -> None:
        self.root = root
        self.samples = list(samples)
        self.now = 50.0
        self.sleeps: list[float] = []
        (root / "proc").mkdir()
        for disk in ("nvme0n1", "sdb"):
            (root / "sys" / "block" / disk).mkdir(parents=True)
        (root / "proc" / "uptime").write_text("100.00 180.00\n")
        self._next()

    def _next(self) -> None:
        (self.root / "proc" / "diskstats").write_text(self.samples.pop(0))

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        if self.samples:
            self._next()

    def run(self, interval: float | None, count: int | None, **kw: bool) -> tuple[int, str]:
        out = io.StringIO()
        status = run_iostat(
            Roots.under(self.root),
            interval,
            count,
            out=out,
            clock=self.clock,
            sleep=self.sleep,
            show_banner=False,
            **kw,
        )
        return status, out.getvalue()


def reports(text: str) -> list[list[str]]:
    """Each report as its lines, without the blank lines that end it."""
    return [block.split("\n") for block in text.split("\n\n\n") if block]


def test_since_boot_then_one_interval(tmp_path: Path) -> None:
    host = Host(tmp_path, [SAMPLE_1, SAMPLE_2])
    status, text = host.run(2.0, 2)
    assert status == 0
    assert text.endswith("\n\n\n")
    assert reports(text) == [
        [SYSSTAT_HEADER, ROW_SINCE_BOOT],
        [SYSSTAT_HEADER, ROW_INTERVAL],
    ]
    assert host.sleeps == [2.0]


def test_no_interval_prints_one_report_and_never_sleeps(tmp_path: Path) -> None:
    host = Host(tmp_path, [SAMPLE_1, SAMPLE_2])
    status, text = host.run(None, None)
    assert status == 0
    assert reports(text) == [[SYSSTAT_HEADER, ROW_SINCE_BOOT]]
    assert host.sleeps == []


def test_omit_first_skips_the_since_boot_report_count_counts_printed_reports(
    tmp_path: Path,
) -> None:
    host = Host(tmp_path, [SAMPLE_1, SAMPLE_2])
    status, text = host.run(2.0, 1, omit_first=True)
    assert status == 0
    assert reports(text) == [[SYSSTAT_HEADER, ROW_INTERVAL]]


def test_omit_idle_drops_devices_without_requests_in_the_interval(tmp_path: Path) -> None:
    host = Host(tmp_path, [SAMPLE_1, SAMPLE_2, SAMPLE_2])
    _, text = host.run(2.0, 3)
    assert reports(text)[2] == [SYSSTAT_HEADER, ROW_QUIET]

    (tmp_path / "z").mkdir()
    quiet = Host(tmp_path / "z", [SAMPLE_1, SAMPLE_2, SAMPLE_2])
    _, text = quiet.run(2.0, 3, omit_idle=True)
    assert reports(text)[2] == [SYSSTAT_HEADER]
    assert reports(text)[1] == [SYSSTAT_HEADER, ROW_INTERVAL]


def test_ticks_do_not_drift(tmp_path: Path) -> None:
    host = Host(tmp_path, [SAMPLE_1, SAMPLE_2, SAMPLE_2, SAMPLE_2])

    def slow_sleep(seconds: float) -> None:
        Host.sleep(host, seconds)
        host.now += 0.25  # the host was slow to wake up

    host.sleep = slow_sleep  # type: ignore[method-assign]
    host.run(2.0, 4)
    assert host.sleeps == [2.0, 1.75, 1.75]


def test_missing_uptime_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host = Host(tmp_path, [SAMPLE_1])
    (tmp_path / "proc" / "uptime").unlink()
    status, _ = host.run(None, None)
    assert status == 2
    assert "uptime" in capsys.readouterr().err


def test_interval_and_count_must_be_positive(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # `nodescope iostat 0`: an interval must be positive (argparse exits with 2).
    with pytest.raises(SystemExit) as err:
        main(["iostat", "0"])
    assert err.value.code == 2
    with pytest.raises(SystemExit):
        main(["iostat", "1", "0"])
    assert "positive" in capsys.readouterr().err


def test_unreadable_or_malformed_input_is_reported_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host = Host(tmp_path, ["8 0 sda 1 2 3\n"])
    status, _ = host.run(None, None)
    assert status == 1
    err = capsys.readouterr().err
    assert "skipped 1 record(s): diskstats_line_unparsable" in err
    assert "no readable line" in err and "Traceback" not in err
    (tmp_path / "proc" / "diskstats").unlink()
    status, _ = host.run(None, None)
    assert status == 1
    assert "No such file" in capsys.readouterr().err


def test_a_malformed_line_is_skipped_said_once_and_the_other_disks_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = "   8 0 sda 1 2 3\n"
    host = Host(tmp_path, [SAMPLE_1 + bad, SAMPLE_2 + bad])
    status, out = host.run(2.0, 2)
    assert status == 0
    err = capsys.readouterr().err
    assert err.count("skipped 1 record(s): diskstats_line_unparsable") == 1
    assert ROW_INTERVAL in out
