"""The run directory (``<run>/nodescope``) is made by whichever writer comes first: the
daemon, a prolog, a gate-stop or the health check, often at once on a fresh boot."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from nodescope.hooks.auth import prepare_directory


def test_a_writer_that_loses_the_race_to_make_the_directory_uses_the_winners(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The interleaving that failed: both writers find the directory missing, the other
    # writer's mkdir lands first, and ours meets the directory just made.
    from nodescope import safedir

    directory = tmp_path / "run" / "nodescope"
    real_mkdir = os.mkdir
    calls: list[str] = []

    def mkdir_after_the_other_writer(name: str, mode: int = 0o777, *, dir_fd: int) -> None:
        calls.append(name)
        if name == "nodescope":
            real_mkdir(name, 0o750, dir_fd=dir_fd)  # the other writer, just before ours
        real_mkdir(name, mode, dir_fd=dir_fd)

    monkeypatch.setattr(safedir.os, "mkdir", mkdir_after_the_other_writer)
    prepare_directory(directory)
    assert calls[-1] == "nodescope"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o750


def test_many_writers_at_once_all_get_the_directory_and_one_made_it(tmp_path: Path) -> None:
    directory = tmp_path / "a" / "b" / "nodescope"
    start = threading.Barrier(8)
    made: list[bool] = []
    errors: list[BaseException] = []

    def writer() -> None:
        start.wait()
        try:
            made.append(prepare_directory(directory))
        except BaseException as exc:  # the test reports any failure, not the thread
            errors.append(exc)

    threads = [threading.Thread(target=writer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    # "Made" is whether the directory was missing when a writer began: at least the one that
    # made it says so.
    assert made.count(True) >= 1
    assert stat.S_IMODE(directory.stat().st_mode) == 0o750


def test_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "nodescope"
    directory.mkdir()
    directory.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by group or others"):
        prepare_directory(directory)


def test_a_link_in_place_of_the_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir(mode=0o750)
    (tmp_path / "nodescope").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PermissionError, match="symbolic link"):
        prepare_directory(tmp_path / "nodescope")
