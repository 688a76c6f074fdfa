"""What the install and jobs docs say about the hook socket's directory and Slurm's cgroup
plugin is what the packages make and what the code reads."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from nodescope.hooks.auth import prepare_directory
from nodescope.roots import Roots
from nodescope.sources.jobs import find_v1_jobs, read_jobs
from tests.conftest import REPO

INSTALL = (REPO / "docs" / "install.md").read_text()
JOBS = (REPO / "docs" / "jobs.md").read_text()


def _packaged_mode() -> str:
    """The mode of /run/nodescope as the tmpfiles entry and the unit both give it."""
    tmpfiles = (REPO / "systemd" / "nodescope.tmpfiles.conf").read_text()
    entries = re.findall(r"^d /run/nodescope (\d{4}) root root", tmpfiles, re.MULTILINE)
    unit = (REPO / "systemd" / "nodescoped.service").read_text()
    runtime = re.findall(r"^RuntimeDirectoryMode=(\d{4})$", unit, re.MULTILINE)
    assert len(entries) == 1 and runtime == entries, (entries, runtime)
    assert "RuntimeDirectory=nodescope\n" in unit
    return str(entries[0])


def test_the_docs_give_the_socket_directory_the_mode_the_packages_make(tmp_path: Path) -> None:
    mode = _packaged_mode()
    # Every mode either document gives /run/nodescope is that one.
    for text in (INSTALL, JOBS):
        stated = re.findall(r"/run/nodescope`? is root's, mode (\d{4})", text) + re.findall(
            r"make `/run/nodescope` root's, mode (\d{4})", text
        )
        assert stated and set(stated) == {mode}, stated
    assert f"RuntimeDirectoryMode={mode}" in INSTALL
    # The daemon makes the same mode when it creates the directory itself.
    directory = tmp_path / "nodescope"
    old = os.umask(0)
    try:
        prepare_directory(directory)
    finally:
        os.umask(old)
    assert f"{stat.S_IMODE(os.stat(directory).st_mode):04o}" == mode


def test_the_cgroup_plugin_is_stated_once_and_both_layouts_are_read(tmp_path: Path) -> None:
    # install.md sends the reader to jobs.md instead of naming a version of its own.
    assert "CgroupPlugin=cgroup/v" not in INSTALL and "cgroup v2 plugin" not in INSTALL
    assert '"The job registry"' in INSTALL
    assert "`CgroupPlugin=cgroup/v2` or `CgroupPlugin=cgroup/v1`" in JOBS
    # And the code reads the v1 layout the docs promise (test_slurm.py runs a real Slurm with
    # cgroup/v1): a job under the memory controller.
    cgroupfs = tmp_path / "cgroup"
    job = cgroupfs / "memory" / "slurm_node1" / "uid_1000" / "job_42" / "step_0" / "task_0"
    job.mkdir(parents=True)
    (job / "cgroup.procs").write_text("")
    found = find_v1_jobs(cgroupfs)
    assert found is not None and [j[0] for j in found[1]] == ["42"]
    roots = Roots(cgroupfs=cgroupfs, run=tmp_path / "run", procfs=tmp_path / "proc")
    data = read_jobs(roots)
    assert data.hierarchy == "v1" and [j.job_id for j in data.jobs] == ["42"]
