"""The kernel-semantics tier really serves files as the kernel does: page-sized reads of
tables, the ``st_size`` sysfs and procfs report, whole attributes in one read. If the mount
ever became a plain passthrough, these fail first, and the reader an undercount used to hide
is shown to undercount through it while nodescope's readers count everything."""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from nodescope.fileio import PROC_TABLE, read_bytes
from nodescope.sources.locks import parse_locks, read_locks
from tests.kernelfs.conftest import MountTree
from tests.kernelfs.server import PAGE, Layout, Serving, chunk, reported_size, table_chunk

LOCK_COUNT = 5_000


def lock_line(i: int) -> str:
    return f"{i + 1}: POSIX  ADVISORY  WRITE {10_000 + i} 00:2a:{500_000 + i} 0 EOF\n"


def write_tree(backing: Path) -> None:
    (backing / "proc" / "1").mkdir(parents=True)
    (backing / "proc" / "locks").write_text("".join(lock_line(i) for i in range(LOCK_COUNT)))
    (backing / "proc" / "1" / "stat").write_text("1 (init) S 0 1 1 0 -1 4194560\n")
    (backing / "proc" / "1" / "environ").write_bytes(b"A=" + b"x" * 10_000 + b"\0B=2\0")
    device = backing / "sys" / "class" / "net" / "eth0"
    device.mkdir(parents=True)
    (device / "mtu").write_text("1500\n")
    cgroup = backing / "sys" / "fs" / "cgroup" / "job"
    cgroup.mkdir(parents=True)
    (cgroup / "cgroup.threads").write_text("".join(f"{t}\n" for t in range(1, 20_001)))
    (cgroup / "memory.stat").write_text("anon 1\nfile 2\n" * 400)
    (backing / "run").mkdir()
    (backing / "run" / "state.json").write_text("{}" + " " * 9000)


def old_read_text(path: Path) -> str:
    """The reading loop nodescope used before reading to EOF: read once more only after a
    full buffer, so a short read — one page of a procfs table — ended the file."""
    read_chunk = 64 * 1024
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while True:
            data = os.read(fd, read_chunk)
            if not data:
                break
            chunks.append(data)
            if len(data) < read_chunk:
                break
        return b"".join(chunks).decode("utf-8", errors="replace")
    finally:
        os.close(fd)


def first_read(path: Path, size: int = 65536) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, size)
    finally:
        os.close(fd)


def test_a_table_comes_a_page_per_read_cut_at_a_line(tmp_path: Path, mount_kernelfs: MountTree):
    backing = tmp_path / "tree"
    write_tree(backing)
    mount = mount_kernelfs(backing)
    locks = mount.mountpoint / "proc" / "locks"
    fd = os.open(locks, os.O_RDONLY)
    try:
        reads = []
        while data := os.read(fd, 65536):
            reads.append(data)
    finally:
        os.close(fd)
    assert 1 < len(reads[0]) <= PAGE
    assert all(len(r) <= PAGE and r.endswith(b"\n") for r in reads)
    assert b"".join(reads) == (backing / "proc" / "locks").read_bytes()
    threads = first_read(mount.mountpoint / "sys" / "fs" / "cgroup" / "job" / "cgroup.threads")
    assert len(threads) <= PAGE and threads.endswith(b"\n")


def test_stat_sizes_are_the_kernels(tmp_path: Path, mount_kernelfs: MountTree):
    backing = tmp_path / "tree"
    write_tree(backing)
    root = mount_kernelfs(backing).mountpoint
    assert os.stat(root / "proc" / "locks").st_size == 0
    assert os.stat(root / "proc" / "1" / "stat").st_size == 0
    assert os.stat(root / "sys" / "fs" / "cgroup" / "job" / "cgroup.threads").st_size == 0
    assert os.stat(root / "sys" / "fs" / "cgroup" / "job" / "memory.stat").st_size == 0
    assert os.stat(root / "sys" / "class" / "net" / "eth0" / "mtu").st_size == 4096
    # Outside the pseudo-filesystems a file is what it is.
    assert os.stat(root / "run" / "state.json").st_size == 9002
    # Directories list what the backing tree holds, with its inode numbers.
    for directory in ("proc", "proc/1", "sys/fs/cgroup/job"):
        served = {(e.name, e.inode()) for e in os.scandir(root / directory)}
        assert served == {(e.name, e.inode()) for e in os.scandir(backing / directory)}


def test_one_record_files_and_attributes_come_whole_in_the_first_read(
    tmp_path: Path, mount_kernelfs: MountTree
):
    backing = tmp_path / "tree"
    write_tree(backing)
    root = mount_kernelfs(backing).mountpoint
    memory_stat = backing / "sys" / "fs" / "cgroup" / "job" / "memory.stat"
    assert len(memory_stat.read_bytes()) > PAGE
    served = first_read(root / "sys" / "fs" / "cgroup" / "job" / "memory.stat")
    assert served == memory_stat.read_bytes()
    assert first_read(root / "sys" / "class" / "net" / "eth0" / "mtu") == b"1500\n"
    # environ is no record: a page at a time, cut anywhere.
    environ = first_read(root / "proc" / "1" / "environ")
    assert len(environ) == PAGE


def test_the_old_reader_undercounts_through_the_tier_and_nodescope_does_not(
    tmp_path: Path, mount_kernelfs: MountTree
):
    backing = tmp_path / "tree"
    write_tree(backing)
    mount = mount_kernelfs(backing)
    locks = mount.mountpoint / "proc" / "locks"
    # Over the plain file the old loop saw everything: that is how the bug went unseen.
    assert len(parse_locks(old_read_text(backing / "proc" / "locks"))) == LOCK_COUNT
    old_count = len(parse_locks(old_read_text(locks)))
    assert old_count < LOCK_COUNT // 50
    assert len(parse_locks(read_bytes(locks, PROC_TABLE).decode())) == LOCK_COUNT
    data = read_locks(mount.roots())
    assert dict(data.counts) == {"POSIX": LOCK_COUNT}


def test_layout_sorts_paths_by_the_filesystem_serving_them():
    layout = Layout()
    assert layout.serving("sys/fs/cgroup/a/cgroup.procs") is Serving.TABLE
    assert layout.serving("sys/fs/cgroup/a/io.stat") is Serving.ONE_RECORD
    assert layout.serving("sys/fs/cgroup/a/memory.pressure") is Serving.ONE_RECORD
    assert layout.serving("proc/12/task/13/stat") is Serving.ONE_RECORD
    assert layout.serving("proc/12/environ") is Serving.PAGED
    assert layout.serving("proc/self/mountstats") is Serving.TABLE
    assert layout.serving("proc/net/dev") is Serving.TABLE
    assert layout.serving("sys/bus/pci/devices/0000:00:01.0/vendor") is Serving.SYSFS_ATTRIBUTE
    assert layout.serving("run/nodescope/jobs/1.json") is Serving.PLAIN
    assert layout.serving("sysfs-like-name") is Serving.PLAIN
    assert reported_size(Serving.TABLE, 99) == 0
    assert reported_size(Serving.PLAIN, 99) == 99


lines = st.lists(st.binary(max_size=6000).map(lambda b: b.replace(b"\n", b"") + b"\n"), max_size=30)


@given(lines, st.sampled_from([1, 17, 4096, 65536]), st.booleans())
def test_table_reads_rebuild_the_file_without_splitting_a_line_that_fits(
    records: list[bytes], size: int, unterminated: bool
):
    data = b"".join(records) + (b"tail without newline" if unterminated else b"")
    offset = 0
    pieces = []
    while piece := table_chunk(data, offset, size):
        assert len(piece) <= max(size, 0)
        if len(piece) > PAGE:
            # Only a line longer than a page comes alone past a page.
            assert piece.count(b"\n") <= 1
        elif offset + len(piece) < len(data) and size >= PAGE:
            assert piece.endswith(b"\n")
        pieces.append(piece)
        offset += len(piece)
    assert b"".join(pieces) == data


@given(st.binary(max_size=20_000), st.sampled_from(list(Serving)), st.integers(1, 70_000))
def test_every_serving_rebuilds_the_file(data: bytes, serving: Serving, size: int):
    offset = 0
    pieces = []
    while piece := chunk(serving, data, offset, size):
        assert len(piece) <= size
        pieces.append(piece)
        offset += len(piece)
    assert b"".join(pieces) == data


def test_the_tree_can_be_written_through_the_mount(tmp_path: Path, mount_kernelfs: MountTree):
    backing = tmp_path / "tree"
    write_tree(backing)
    root = mount_kernelfs(backing).mountpoint
    staging = root / "proc" / "1" / "status.tmp"
    staging.write_text("Name:\tinit\n")
    os.replace(staging, root / "proc" / "1" / "status")
    (root / "proc" / "2").mkdir()
    (root / "proc" / "self").symlink_to("1")
    with open(root / "run" / "state.json", "r+b") as f:
        f.write(b"[]")
    (root / "proc" / "1" / "environ").unlink()
    assert (backing / "proc" / "1" / "status").read_text() == "Name:\tinit\n"
    assert not (backing / "proc" / "1" / "status.tmp").exists()
    assert (backing / "proc" / "2").is_dir()
    assert os.readlink(backing / "proc" / "self") == "1"
    assert (backing / "run" / "state.json").read_bytes().startswith(b"[]  ")
    assert not (backing / "proc" / "1" / "environ").exists()
    # Read back through the mount with procfs semantics.
    assert os.stat(root / "proc" / "self" / "status").st_size == 0
    assert (root / "proc" / "self" / "status").read_text() == "Name:\tinit\n"
