"""Directories root writes in, under an ancestor another user can write: real directories
owned by ``nobody`` (chown as root) with links ``nobody`` owns, the way a user who can write
in an ancestor of ``[slurm] reports_dir`` or of the run root would plant them.

Before: ``os.makedirs`` followed the user's link and only the last directory was checked, so
root created and wrote a job's report in a directory the user chose. Now every directory on
the way is opened from ``/`` without following a link another user made, and refused when
another user could change it (sshd's StrictModes rule).
"""

from __future__ import annotations

import json
import os
import pwd
from pathlib import Path

import pytest

from nodescope.hooks.request import JobRequest
from nodescope.hooks.tracker import write_registration
from nodescope.remediation.state import locked
from nodescope.roots import Roots
from nodescope.safedir import UnsafeDirectory, ensure_directory, open_directory
from nodescope_exporters.reports import write_report
from tests.hook_peers import hook_env, run_hook

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def nobody() -> tuple[int, int]:
    entry = pwd.getpwnam("nobody")
    return entry.pw_uid, entry.pw_gid


def report(job: str) -> dict[str, object]:
    return {"format": "nodescope-job-report/1", "job_id": job, "issued_at": 1.0, "daemon": False}


@pytest.fixture
def planted(tmp_path: Path) -> tuple[Path, Path]:
    """``tmp_path/shared``, a directory of nobody's (0755), holding ``reports``, a link of
    nobody's to ``tmp_path/victim``, a directory of root's (0700) the user wants root to
    write in."""
    uid, gid = nobody()
    tmp_path.chmod(0o755)
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chown(shared, uid, gid)
    link = shared / "reports"
    link.symlink_to(victim)
    os.lchown(link, uid, gid)
    return shared, victim


def test_a_report_is_not_written_through_a_users_link(planted: tuple[Path, Path]) -> None:
    shared, victim = planted
    with pytest.raises(UnsafeDirectory):
        write_report(shared / "reports" / "jobs", report("81"))
    assert list(victim.iterdir()) == []  # nothing created in the user's chosen directory


def test_a_users_link_in_a_sticky_world_writable_directory_is_not_followed(
    tmp_path: Path, planted: tuple[Path, Path]
) -> None:
    _shared, victim = planted
    uid, gid = nobody()
    public = tmp_path / "public"  # as /tmp: root's, 1777
    public.mkdir()
    public.chmod(0o1777)
    link = public / "nodescope"
    link.symlink_to(victim)
    os.lchown(link, uid, gid)
    with pytest.raises(UnsafeDirectory, match="symbolic link made by uid"):
        write_report(link / "reports", report("82"))
    assert list(victim.iterdir()) == []
    # The sticky directory itself is a fine ancestor: root's own directory below it works.
    written = write_report(public / "roots-own" / "reports", report("83"))
    assert json.loads(written.read_text())["job_id"] == "83"


def test_a_group_writable_ancestor_without_the_sticky_bit_is_refused(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    group = tmp_path / "group"
    group.mkdir()
    group.chmod(0o775)
    with pytest.raises(UnsafeDirectory, match="without the sticky bit"):
        ensure_directory(group / "run" / "nodescope")
    assert not (group / "run").exists()


def test_an_ancestor_owned_by_another_user_is_refused(planted: tuple[Path, Path]) -> None:
    shared, _victim = planted
    with pytest.raises(UnsafeDirectory, match="owned by uid"):
        ensure_directory(shared / "run")
    assert not (shared / "run").exists()


def test_registrations_and_the_remediation_record_refuse_such_a_run_root(
    planted: tuple[Path, Path],
) -> None:
    shared, victim = planted
    roots = Roots(run=shared / "reports")
    job = JobRequest.from_environ({"SLURM_JOB_ID": "84", "SLURM_JOB_UID": "0"})
    with pytest.raises(PermissionError):
        write_registration(roots, job, {}, 1.0)
    with pytest.raises(PermissionError), locked(roots, timeout=1):
        pass
    assert list(victim.iterdir()) == []


def test_the_epilog_writes_no_report_through_the_link(
    tmp_path: Path, planted: tuple[Path, Path]
) -> None:
    shared, victim = planted
    config = tmp_path / "nodescope.toml"
    config.write_text(
        f'[roots]\nrun = "{tmp_path / "run"}"\n'
        f'[slurm]\nreports_dir = "{shared / "reports" / "jobs"}"\nscontrol = ""\n'
    )
    result = run_hook("epilog", config, hook_env("85", SLURM_JOB_EXIT_CODE="0"))
    assert result.returncode == 0, result.stderr
    assert "cannot write the report of job 85" in result.stderr
    assert list(victim.iterdir()) == []


def test_root_owned_links_are_followed_and_the_descriptor_is_the_checked_directory(
    tmp_path: Path,
) -> None:
    tmp_path.chmod(0o755)
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to("real")  # root's, relative: as /var/run -> /run
    fd = open_directory(tmp_path / "alias" / "nodescope", mode=0o750)
    try:
        info = os.fstat(fd)
        assert (info.st_ino, info.st_dev) == (
            os.stat(real / "nodescope").st_ino,
            os.stat(real / "nodescope").st_dev,
        )
        assert oct(info.st_mode & 0o777) == oct(0o750)
    finally:
        os.close(fd)
    with pytest.raises(FileNotFoundError):
        open_directory(tmp_path / "missing", create=False)
