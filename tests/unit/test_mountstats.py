"""The mountstats source: NFS per-op statistics and nfsiostat's interval figures."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.roots import Roots
from nodescope.sources.mountstats import (
    SKIP_LINE_OUTSIDE_MOUNT,
    SKIP_MOUNT_HEADING_UNPARSABLE,
    SKIP_NFS_MOUNT_MALFORMED,
    MountstatsData,
    NfsOp,
    make_source,
    nfs_rates,
    parse_mountstats,
)

HOST = Path(__file__).parent.parent / "fixtures" / "hosts" / "kvm-epyc-debian12"


def nfs_mount(age: int, read: tuple[int, ...], write: tuple[int, ...], lock: str) -> str:
    """An NFSv4.2 mount as fs/nfs/super.c and net/sunrpc/stats.c print it (Linux 6.x)."""
    return (
        "device ckpt-nfs:/export/ckpt mounted on /mnt/ckpt with fstype nfs4 statvers=1.1\n"
        "\topts:\trw,vers=4.2,rsize=1048576,wsize=1048576,namlen=255,acregmin=3,hard,proto=tcp\n"
        f"\tage:\t{age}\n"
        "\timpl_id:\tname='',domain='',date='0,0'\n"
        "\tcaps:\tcaps=0x3ffbffff,wtmult=512,dtsize=1048576,bsize=0,namlen=255\n"
        "\tnfsv4:\tbm0=0xfdffbfff,bm1=0x40fdbe3e,bm2=0x60803,acl=0x3,sessions,pnfs=not"
        " configured,lease_time=90,lease_expired=0\n"
        "\tsec:\tflavor=1,pseudoflavor=1\n"
        "\tevents:\t" + " ".join(["0"] * 27) + "\n"
        "\tbytes:\t0 0 0 0 0 0 0 0\n"
        "\tRPC iostats version: 1.1  p/v: 100003/4 (nfs)\n"
        "\txprt:\ttcp 718 1 1 0 0 40 40 0 40 0 64 0 0\n"
        "\tper-op statistics\n"
        "\t        NULL: 1 1 0 44 24 0 0 0 0\n"
        f"\t        READ: {' '.join(map(str, read))}\n"
        f"\t       WRITE: {' '.join(map(str, write))}\n"
        f"\t        LOCK: {lock}\n"
        "\n"
    )


LOCAL = (
    "device proc mounted on /proc with fstype proc\ndevice /dev/vda mounted on / with fstype ext4\n"
)
#                 ops ntrans timeouts sent recv queue rtt execute errors
READ0 = (100, 100, 0, 14000, 104_900_000, 5, 150, 200, 0)
WRITE0 = (40, 40, 0, 41_950_000, 6400, 2, 60, 80, 1)
READ1 = (300, 310, 1, 42000, 314_700_000, 25, 650, 900, 2)
WRITE1 = (40, 40, 0, 41_950_000, 6400, 2, 60, 80, 1)


def test_parse_nfs_and_skip_local_mounts() -> None:
    data = parse_mountstats(LOCAL + nfs_mount(3600, READ0, WRITE0, "3 3 0 600 300 0 3 4 3"))
    [mount] = data.mounts
    assert (mount.device, mount.mountpoint, mount.fstype, mount.statvers, mount.age_seconds) == (
        "ckpt-nfs:/export/ckpt",
        "/mnt/ckpt",
        "nfs4",
        "1.1",
        3600,
    )
    assert [op.name for op in mount.ops] == ["NULL", "READ", "WRITE", "LOCK"]
    assert mount.op("READ") == NfsOp("READ", 100, 100, 0, 14000, 104_900_000, 5, 150, 200, 0)
    assert data.mount("/mnt/ckpt") is mount and data.mount("/") is None


def test_eight_field_ops_of_older_kernels() -> None:
    text = nfs_mount(10, READ0[:8], WRITE0[:8], "3 3 0 600 300 0 3 4")
    op = parse_mountstats(text).mounts[0].op("LOCK")
    assert op is not None and op.errors is None and op.execute_ms == 4


def test_nfsiostat_interval_figures() -> None:
    """nfs-iostat.py: ops/s = Δops/Δt; retrans = Δntrans-Δops; kB/op = (Δsent+Δrecv)/1024/Δops;
    avg RTT = Δrtt/Δops; avg exe = Δexecute/Δops; avg queue = Δqueue/Δops."""
    before = parse_mountstats(nfs_mount(3600, READ0, WRITE0, "3 3 0 600 300 0 3 4 3"))
    after = parse_mountstats(nfs_mount(3610, READ1, WRITE1, "3 3 0 600 300 0 3 4 3"))
    rates = nfs_rates(before, after, 10.0)
    [mount] = rates.mounts
    read = mount.op("READ")
    assert read is not None
    assert read.ops == 200 and read.ops_per_second == pytest.approx(20.0)
    assert read.retransmissions == 10 and read.retransmissions_per_second == pytest.approx(1.0)
    kilobytes = (28000 + 209_800_000) / 1024
    assert read.kilobytes_per_second == pytest.approx(kilobytes / 10)
    assert read.kilobytes_per_op == pytest.approx(kilobytes / 200)
    assert read.avg_rtt_ms == pytest.approx(500 / 200)
    assert read.avg_execute_ms == pytest.approx(700 / 200)
    assert read.avg_queue_ms == pytest.approx(20 / 200)
    assert read.errors == 2 and read.errors_per_second == pytest.approx(0.2)
    # No WRITE completed: no average, rather than an average of 0 ms.
    write = mount.op("WRITE")
    assert write is not None and write.ops == 0
    assert write.avg_rtt_ms is None and write.kilobytes_per_op is None
    assert mount.slowest() == read


def test_remount_and_reset_give_no_figures() -> None:
    before = parse_mountstats(nfs_mount(3600, READ1, WRITE1, "3 3 0 600 300 0 3 4 3"))
    remounted = parse_mountstats(nfs_mount(5, READ0, WRITE0, "3 3 0 600 300 0 3 4 3"))
    assert nfs_rates(before, remounted, 10.0).mounts == ()
    # A counter going down without the age doing so is a reset of that op alone.
    reset = parse_mountstats(nfs_mount(3610, READ0, WRITE1, "3 3 0 600 300 0 3 4 3"))
    [mount] = nfs_rates(before, reset, 10.0).mounts
    assert mount.op("READ") is None and mount.op("WRITE") is not None
    assert nfs_rates(before, before, 0).mounts == ()


GOOD_MOUNT = nfs_mount(7, READ0, WRITE0, "3 3 0 600 300 0 3 4 3").replace("/mnt/ckpt", "/mnt/good")


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        ("device x mounted somewhere\n", 1, SKIP_MOUNT_HEADING_UNPARSABLE),
        ("\tage:\t1\n", 1, SKIP_LINE_OUTSIDE_MOUNT),
        (nfs_mount(1, READ0, WRITE0, "1 2 3"), 16, SKIP_NFS_MOUNT_MALFORMED),
        (nfs_mount(1, READ0, WRITE0, "a 2 3 4 5 6 7 8"), 16, SKIP_NFS_MOUNT_MALFORMED),
        (
            nfs_mount(1, READ0, WRITE0, "1 1 0 1 1 0 1 1 0").replace("LOCK", "READ"),
            16,
            SKIP_NFS_MOUNT_MALFORMED,
        ),
        (
            nfs_mount(1, READ0, WRITE0, "1 1 0 1 1 0 1 1 0").replace("age:\t1", "age:\tx"),
            3,
            SKIP_NFS_MOUNT_MALFORMED,
        ),
    ],
)
def test_malformed_mount_block_is_skipped_and_counted(text: str, line: int, reason: str) -> None:
    """The bad block is left out whole, named with its line; the good mount after it is read."""
    data = parse_mountstats(text + GOOD_MOUNT, "ms")
    assert [m.mountpoint for m in data.mounts] == ["/mnt/good"]
    assert data.mounts[0] == parse_mountstats(GOOD_MOUNT).mounts[0]
    assert data.skipped.counts == {reason: 1}
    assert data.skipped.examples[reason].startswith(f"ms:{line}: ")


def test_skipped_block_lines_are_not_taken_for_the_next_mount() -> None:
    """After a malformed per-op line, the rest of that block (more per-op lines) is passed
    over, not counted again nor added to another mount."""
    bad = nfs_mount(1, READ0, WRITE0, "1 2 3") + "\t      COMMIT: 1 1 0 1 1 0 1 1 0\n"
    data = parse_mountstats(LOCAL + bad + GOOD_MOUNT, "ms")
    assert [m.mountpoint for m in data.mounts] == ["/mnt/good"]
    assert data.mounts[0].op("COMMIT") is None
    assert data.skipped.counts == {SKIP_NFS_MOUNT_MALFORMED: 1}


def test_capture_of_this_host_has_no_nfs() -> None:
    source = make_source()
    assert source.name == "mountstats"
    assert source.collect(Roots.under(HOST)) == MountstatsData(())


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_parse_mountstats_fuzz(text: str) -> None:
    data = parse_mountstats(text)
    headings = sum(1 for line in text.split("\n") if line.startswith("device "))
    assert len(data.mounts) <= headings


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                "device s:/e mounted on /m with fstype nfs statvers=1.1",
                "device /dev/x mounted on / with fstype ext4",
                "\tage:\t7",
                "\tper-op statistics",
                "\t        READ: 1 2 3 4 5 6 7 8 9",
                "\t       WRITE: 1 2 3 4 5 6 7 8",
                "\t     GETATTR: 1 2",
                "\tbytes:\t0 0",
                "garbage",
                "",
            ]
        ),
        max_size=12,
    )
)
def test_parse_mountstats_fuzz_structured(lines: list[str]) -> None:
    data = parse_mountstats("\n".join(lines))
    for mount in data.mounts:
        assert len({op.name for op in mount.ops}) == len(mount.ops)
    # Every NFS heading is a mount or one skip; nothing else is skipped but stray lines.
    nfs = sum(1 for line in lines if line.endswith("fstype nfs statvers=1.1"))
    skipped = data.skipped.counts
    assert len(data.mounts) + skipped.get(SKIP_NFS_MOUNT_MALFORMED, 0) == nfs
