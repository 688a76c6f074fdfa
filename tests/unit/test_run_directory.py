"""The run directory (``<run>/nodescope``) is made by whichever writer comes first: the
daemon, a prolog, a gate-stop or the health check, often at once on a fresh boot."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from nodescope.hooks import auth
from nodescope.hooks.auth import prepare_directory


def test_a_writer_that_loses_the_race_to_make_the_directory_uses_the_winners(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The interleaving that failed: both writers find the parent missing, both make it, the
    # other writer's mkdir lands first, and ours meets the directory it just made.
    directory = tmp_path / "run" / "nodescope"
    real_mkdir = os.mkdir
    calls: list[Path] = []

    def mkdir_after_the_other_writer(path: Path, mode: int = 0o777) -> None:
        calls.append(Path(path))
        if calls.count(directory) == 2:
            real_mkdir(path, 0o750)  # the other writer, between our makedirs and mkdir
        real_mkdir(path, mode)

    monkeypatch.setattr(auth.os, "mkdir", mkdir_after_the_other_writer)
    assert prepare_directory(directory) is False
    assert calls == [directory, tmp_path / "run", directory]
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
    assert made.count(True) == 1
    assert stat.S_IMODE(directory.stat().st_mode) == 0o750


def test_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "nodescope"
    directory.mkdir()
    directory.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by nobody else"):
        prepare_directory(directory)


def test_a_link_in_place_of_the_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir(mode=0o750)
    (tmp_path / "nodescope").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PermissionError, match="not a directory"):
        prepare_directory(tmp_path / "nodescope")
