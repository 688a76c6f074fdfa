"""What the hook-socket tests share: a directory other users can enter, a child process that
runs as ``nobody``, and a Slurm hook run the way slurmd runs it."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from tests.conftest import nodescope_command

NOBODY = pwd.getpwnam("nobody").pw_uid


@contextlib.contextmanager
def enterable_dir() -> Iterator[Path]:
    """A scratch directory every user can enter (pytest's tmp_path is 0700): a socket in it can
    be reached by ``nobody`` or the SlurmUser wherever its own modes and ACL entries allow."""
    path = Path(tempfile.mkdtemp(prefix="nodescope-hooks-", dir="/tmp"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def as_nobody(action: Callable[[], None]) -> int:
    """Run ``action`` in a forked child as nobody; its exit status."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        status = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            action()
            status = 0
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def hook_env(job: str, **extra: str) -> dict[str, str]:
    """What slurmd gives a hook of job ``job`` run as root: the job's variables, no PATH."""
    env = {"SLURM_JOB_ID": job, "SLURM_JOB_UID": "0", "SLURM_JOB_USER": "root",
           "SLURMD_NODENAME": "nowhere"}  # fmt: skip
    env.update(extra)
    return env


def run_hook(action: str, config: Path, env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    """``nodescope slurm <action>`` as a real process with ``env`` as its whole environment."""
    return subprocess.run(
        [*nodescope_command(), "slurm", action, "--config", str(config)],
        env=dict(env), capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
