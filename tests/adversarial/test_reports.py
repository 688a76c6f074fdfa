"""Per-job reports and registrations against a hostile filesystem: planted links, directories
others can write, a full disk (a real, small tmpfs), writers killed mid-write, stale calls."""

from __future__ import annotations

import configparser
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from nodescope.assembly import default_config
from nodescope.config import Config
from nodescope.hooks.auth import Peer
from nodescope.hooks.daemon import Hooks
from nodescope.hooks.tracker import JobTracker
from nodescope.roots import Roots
from nodescope_exporters.reports import (
    StaleReport,
    UnsafeDirectory,
    remove_orphan_temporaries,
    write_report,
)
from tests.hook_peers import NOBODY, as_nobody, hook_env, run_hook

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (nobody, mount)")

REPO = Path(__file__).resolve().parents[2]


def _report(job: str, issued_at: float, daemon: bool = True, note: str = "") -> dict[str, object]:
    return {"format": "nodescope-job-report/1", "job_id": job, "issued_at": issued_at,
            "daemon": daemon, "note": note}  # fmt: skip


def test_a_link_planted_in_a_world_writable_reports_dir_is_never_followed(
    tmp_path: Path,
) -> None:
    """Finding: with reports_dir in a world-writable directory, a symbolic link planted at the
    temporary file's name made the daemon overwrite a root-owned file."""
    victim = tmp_path / "victim"
    victim.write_text("root's file\n")
    shared = Path(tempfile.mkdtemp(prefix="nodescope-reports-", dir="/tmp"))
    try:
        os.chmod(shared, 0o1777)
        # The names the old writer used: .<name>.<pid>.tmp
        planted = shared / f".42.json.{os.getpid()}.tmp"
        assert as_nobody(lambda: os.symlink(victim, planted)) == 0
        with pytest.raises(UnsafeDirectory, match="writable by group or others"):
            write_report(shared, _report("42", time.time()))
        assert victim.read_text() == "root's file\n"
        assert not (shared / "42.json").exists()
    finally:
        for entry in shared.iterdir():
            entry.unlink()
        shared.rmdir()


def test_a_reports_dir_that_is_a_link_or_someone_elses_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o750)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(UnsafeDirectory, match="symbolic link"):
        write_report(link, _report("1", time.time()))
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o750)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(UnsafeDirectory, match="owned by uid"):
        write_report(theirs, _report("1", time.time()))
    assert list(real.iterdir()) == [] and list(theirs.iterdir()) == []


def test_a_stale_call_never_replaces_a_later_report(tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    now = time.time()
    write_report(reports, _report("9", now, daemon=False, note="the hook's own, later call"))
    with pytest.raises(StaleReport):
        write_report(reports, _report("9", now - 5, daemon=True, note="stale"))
    with pytest.raises(StaleReport):  # the same call, but the hook wrote its own first
        write_report(reports, _report("9", now, daemon=True), deadline=now - 1)
    assert json.loads((reports / "9.json").read_text())["note"] == "the hook's own, later call"
    # A requeued job's next epilog is a later call: it replaces the report.
    write_report(reports, _report("9", now + 60, note="requeued"))
    assert json.loads((reports / "9.json").read_text())["note"] == "requeued"
    assert [p.name for p in reports.iterdir()] == ["9.json"]  # no temporary left


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 64 KiB tmpfs, filled up."""
    mount = tmp_path / "small"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0750", "tmpfs", str(mount)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {result.stderr.strip()}")
    try:
        (mount / "reports").mkdir(mode=0o750)
        filler = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while os.write(filler, b"\0" * 4096):
                pass
        except OSError:
            pass  # ENOSPC: full
        finally:
            os.close(filler)
        yield mount / "reports"
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def _config(tmp_path: Path, reports: Path) -> tuple[Config, Path]:
    config = default_config()
    config = replace(
        config,
        roots=Roots(run=tmp_path / "run", dev=tmp_path / "dev"),
        slurm=replace(config.slurm, reports_dir=str(reports), scontrol=""),
    )
    path = tmp_path / "nodescope.toml"
    path.write_text(
        f'[roots]\nrun = "{tmp_path / "run"}"\ndev = "{tmp_path / "dev"}"\n'
        f'[slurm]\nreports_dir = "{reports}"\nscontrol = ""\n'
    )
    return config, path


def test_registrations_go_even_when_the_disk_is_full(tmp_path: Path, full_disk: Path) -> None:
    """Finding: after ENOSPC, finished jobs stayed in nodescope_job_info for good: their
    registrations were never removed. Both writers: the daemon's epilog and the hook's own."""
    config, config_path = _config(tmp_path, full_disk)
    registrations = tmp_path / "run" / "nodescope" / "jobs"
    tracker = JobTracker(lambda: config)
    root = Peer(os.getpid(), 0, 0)
    for job in ("61", "62"):
        now = time.time()
        answer = tracker.prolog({"job_id": job, "issued_at": now, "deadline": now + 2}, root)
        assert answer["ok"] is True and (registrations / f"{job}.json").exists()
    now = time.time()
    answer = tracker.epilog({"job_id": "61", "issued_at": now, "deadline": now + 2}, root)
    assert answer["ok"] is True and answer["report"] is None
    assert "No space left" in answer["report_error"]
    assert not (registrations / "61.json").exists()
    hook = run_hook("epilog", config_path, hook_env("62", SLURM_JOB_EXIT_CODE="0"))
    assert hook.returncode == 0, hook.stderr
    assert "cannot write the report" in hook.stderr and "No space left" in hook.stderr
    assert not (registrations / "62.json").exists()
    assert [p.name for p in full_disk.iterdir()] == []  # no temporary left behind either


_WRITER = """
import sys
from pathlib import Path
from nodescope_exporters.reports import write_private
payload = b"x" * (8 << 20)
print("start", flush=True)
while True:
    write_private(Path(sys.argv[1]), "42.json", payload)
"""


def test_orphan_temporaries_are_removed_at_start(tmp_path: Path) -> None:
    """Finding: temporary files left by a writer killed with SIGKILL were never cleaned."""
    reports = tmp_path / "reports"
    reports.mkdir(mode=0o750)
    orphans: set[str] = set()
    for _ in range(20):
        writer = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(reports)], stdout=subprocess.PIPE, text=True
        )
        assert writer.stdout is not None and writer.stdout.readline() == "start\n"
        time.sleep(0.05)
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=10)
        writer.stdout.close()
        orphans |= {p.name for p in reports.iterdir() if p.name.endswith(".tmp")}
        if orphans:
            break
    assert orphans, "no kill landed inside a write"
    # A writer that still runs (this process) keeps its temporary file.
    alive = reports / f".43.json.{os.getpid()}.abcdef.tmp"
    alive.write_bytes(b"being written")
    config, _ = _config(tmp_path, reports)
    Hooks(lambda: config).sweep()
    left = {p.name for p in reports.iterdir() if p.name.endswith(".tmp")}
    assert left == {alive.name}
    # Long abandoned, it goes too, whoever has the pid now.
    old = time.time() - 7200
    os.utime(alive, (old, old))
    assert remove_orphan_temporaries(reports) == [alive.name]


def test_the_unit_keeps_the_runtime_directory_across_restarts() -> None:
    """systemd removes a RuntimeDirectory= whenever the service stops unless
    RuntimeDirectoryPreserve= says otherwise: every restart would drop the registrations of
    running jobs and the record of uncleared Xids."""
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(REPO / "systemd" / "nodescoped.service")
    service = unit["Service"]
    assert service["RuntimeDirectory"] == "nodescope"
    assert service["RuntimeDirectoryPreserve"] == "yes"
    assert service["RuntimeDirectoryMode"] == "0750"
    tmpfiles = (REPO / "systemd" / "nodescope.tmpfiles.conf").read_text().splitlines()
    assert "d /run/nodescope 0750 root root -" in tmpfiles
