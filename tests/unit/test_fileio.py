"""The file-reading layer on real kernel files and on what a hostile user could plant."""

from __future__ import annotations

import fcntl
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from nodescope import fileio
from nodescope.fileio import (
    FileKind,
    FileTooLarge,
    NotARegularFile,
    read_bytes,
    read_optional,
    read_text,
)


@pytest.mark.parametrize(
    "size", [0, 1, fileio.READ_CHUNK - 1, fileio.READ_CHUNK, 3 * fileio.READ_CHUNK + 5]
)
def test_regular_files_of_any_size_are_read_whole(tmp_path: Path, size: int) -> None:
    path = tmp_path / "f"
    data = bytes((i * 7) % 95 + 32 for i in range(size))
    path.write_bytes(data)
    assert read_text(path) == data.decode()
    assert read_text(str(path)) == data.decode()
    assert read_optional(str(tmp_path / "absent")) is None


def test_a_procfs_file_larger_than_a_page_is_read_to_its_end() -> None:
    # /proc/self/smaps is a seq_file of size 0 handed out about a page per read; a reader
    # that stops at the first short read gets the first few KiB only.
    text = read_text("/proc/self/smaps", fileio.PROC_TABLE)
    assert len(text) > 3 * 4096
    assert text.count("VmFlags:") == text.count("\nSize:") + (1 if text.startswith("Size:") else 0)
    # The last mapping is whole: the file ends with its VmFlags line.
    assert text.rstrip("\n").rsplit("\n", 1)[-1].startswith("VmFlags:")


def test_every_lock_of_a_long_proc_locks_is_read(tmp_path: Path) -> None:
    # 800 POSIX locks make /proc/locks about 45 KB, eleven pages.
    path = tmp_path / "locked"
    count = 800
    with open(path, "wb") as handle:
        handle.truncate(count * 2)
        for i in range(count):
            fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, i * 2)
        text = read_text("/proc/locks", fileio.PROC_TABLE)
        inode = os.stat(path).st_ino
        ours = [line for line in text.splitlines() if f":{inode} " in line]
    assert len(text) > 10 * 4096
    assert len(ours) == count


@pytest.mark.alone  # a bound on wall-clock time
def test_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "diskstats"
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(NotARegularFile, match="FIFO"):
        read_bytes(fifo)
    assert read_optional(fifo) is None
    # Even with a writer holding it open (a read would wait for data), nothing blocks.
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    try:
        with pytest.raises(NotARegularFile):
            read_bytes(fifo)
    finally:
        os.close(writer)
    assert time.monotonic() - started < 1.0


def test_devices_sockets_and_directories_are_refused(tmp_path: Path) -> None:
    link = tmp_path / "nodescope.toml"
    link.symlink_to("/dev/zero")
    with pytest.raises(NotARegularFile, match="character device"):
        read_bytes(link, fileio.CONFIG)
    with pytest.raises(NotARegularFile, match="directory"):
        read_bytes(tmp_path)
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind(str(tmp_path / "sock"))
        # Opening a socket file fails in the kernel (ENXIO), said as what it is.
        with pytest.raises(NotARegularFile, match="socket"):
            read_bytes(tmp_path / "sock")
    finally:
        listener.close()


def test_a_huge_regular_file_is_refused_by_its_size_unread(tmp_path: Path) -> None:
    path = tmp_path / "huge"
    with open(path, "wb") as handle:
        handle.truncate(100 * fileio.MIB)  # sparse: nothing to read, but 100 MB long
    with pytest.raises(FileTooLarge, match="1024 KiB cap for a config file"):
        read_bytes(path, fileio.CONFIG)


def test_a_pseudo_file_over_its_cap_is_refused_while_reading() -> None:
    # smaps reports size 0, so only the bytes read can show it is too long.
    tiny = FileKind("test table", 8 * fileio.KIB)
    with pytest.raises(FileTooLarge, match="8 KiB cap for a test table"):
        read_bytes("/proc/self/smaps", tiny)


def test_a_file_growing_while_read_stops_at_the_cap(tmp_path: Path) -> None:
    path = tmp_path / "growing"
    path.write_bytes(b"")
    stop = threading.Event()

    def grow() -> None:
        with open(path, "ab") as handle:
            while not stop.is_set():
                handle.write(b"x" * 65536)
                handle.flush()

    writer = threading.Thread(target=grow)
    writer.start()
    try:
        time.sleep(0.05)
        kind = FileKind("growing file", 256 * fileio.KIB)
        try:
            data = read_bytes(path, kind)
        except FileTooLarge:
            pass
        else:
            assert len(data) <= kind.max_bytes
    finally:
        stop.set()
        writer.join()


def test_single_record_files_cost_one_read(tmp_path: Path) -> None:
    # /proc/self/stat is made in one go: the first read is the whole line.
    text = read_text("/proc/self/stat", fileio.PROC_PROCESS)
    assert text.endswith("\n") and text.count("\n") == 1
    assert int(text.split()[0]) == os.getpid()
