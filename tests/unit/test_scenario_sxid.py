"""NVSwitch SXids in the scenario format: the ``sxid`` activity, how the loader reads and
rejects it, the kernel log (``dev/kmsg``) the simulated node keeps, and the ``sxid`` source
reading that regular file.

Each node test builds the small node of ``test_scenario.small_document`` (one GPU with four
NVLinks to NVSwitch 0000:06:00.0) with only its own activities, on a tmpfs when there is one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodescope.errors import ParseError
from nodescope.sim.node import SimulatedNode
from nodescope.sim.scenario import INSTANT_KINDS, Scenario
from nodescope.sources.registry import SOURCES
from nodescope.sources.sxid import SKIP_NOT_KERNEL, SxidSource
from tests.unit.scenario_helpers import (
    load_document,
    load_timeline,
    scratch_root,
    timeline_document,
)

SWITCH = "0000:06:00.0"
UPTIME_USEC = 864_000 * 1_000_000  # the small node's default uptime, in µs
FATAL = {
    "kind": "sxid",
    "from": 3,
    "nvswitch": 0,
    "sxid": 24007,
    "fatal": True,
    "link": 30,
    "message": "sourcetrack timeout error",
}


def load(timeline: list[dict[str, Any]]) -> Scenario:
    return load_timeline(timeline, "sxid.json")


@pytest.fixture
def scratch() -> Iterator[Path]:
    yield from scratch_root("nodescope-test-sxid-")


def node_of(root: Path, timeline: list[dict[str, Any]]) -> SimulatedNode:
    node = SimulatedNode(load(timeline), root / "node")
    node.materialise()
    return node


# --------------------------------------------------------------------------------------------
# The loader


def test_an_sxid_loads_with_its_values_and_defaults() -> None:
    fatal, nonfatal = load(
        [
            FATAL,
            {"kind": "sxid", "nvswitch": 0, "sxid": 20009, "fatal": False,
             "message": "RX Short Error Rate", "count": 4, "forged": True},
        ]
    ).timeline  # fmt: skip
    assert fatal.kind == "sxid" and "sxid" in INSTANT_KINDS
    assert (fatal.start, fatal.end) == (3.0, None)
    assert [fatal.get(n) for n in ("nvswitch", "sxid", "fatal", "link", "count", "forged")] == [
        0,
        24007,
        True,
        30,
        1,
        False,
    ]
    assert fatal.get("message") == "sourcetrack timeout error"
    # A line that names no port, four SXids at once, written from user space.
    assert [nonfatal.get(n) for n in ("fatal", "link", "count", "forged")] == [False, None, 4, True]


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("switch index", {"nvswitch": 1}, "/timeline/0/nvswitch: no NVSwitch 1 (NVSwitches: 0-0)"),
    ("negative switch", {"nvswitch": -1}, "/timeline/0/nvswitch: must be >= 0, got -1"),
    ("no severity", {"fatal": None}, "/timeline/0/fatal: must be true or false"),
    ("no message", {"message": None}, "/timeline/0/message:"),
    ("empty message", {"message": ""}, "/timeline/0/message: must be at least 1 character"),
    (
        "two lines",
        {"message": "error\n2,9,0,-;nvidia-nvswitch0: SXid (PCI:0000:06:00.0): 1, Fatal, x"},
        "/timeline/0/message: must be printable ASCII on one line",
    ),
    ("with to", {"to": 5}, "/timeline/0/to: sxid happens once, at 'from'"),
    ("no SXid", {"count": 0}, "/timeline/0/count: must be >= 1, got 0"),
    ("code zero", {"sxid": 0}, "/timeline/0/sxid: must be >= 1, got 0"),
    ("code of six digits", {"sxid": 100000}, "/timeline/0/sxid: must be <= 99999, got 100000"),
    ("port", {"link": 64}, "/timeline/0/link: must be <= 63, got 64"),
    ("forged type", {"forged": "yes"}, "/timeline/0/forged: must be true or false"),
    ("a GPU's key", {"gpu": 0}, "/timeline/0/gpu: unknown key"),
    ("after the end", {"from": 11}, "/timeline/0/from: after the end of the scenario (10 s)"),
]


@pytest.mark.parametrize(("change", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_sxid_is_rejected_with_its_pointer(change: dict[str, Any], message: str) -> None:
    activity = {k: v for k, v in {**FATAL, **change}.items() if v is not None}
    with pytest.raises(ParseError) as caught:
        load([activity])
    assert str(caught.value).startswith(f"sxid.json: {message}"), str(caught.value)


def test_a_node_without_nvswitches_has_none_to_name() -> None:
    doc = timeline_document([FATAL])
    doc["hardware"]["nvswitches"] = []
    doc["hardware"]["gpus"]["0"].pop("nvlinks")
    with pytest.raises(ParseError) as caught:
        load_document(doc, "sxid.json")
    assert "/timeline/0/nvswitch: no NVSwitch 0 (NVSwitches: none)" in str(caught.value)


# --------------------------------------------------------------------------------------------
# The node's kernel log


def test_a_healthy_node_has_an_empty_kernel_log_its_source_reads(scratch: Path) -> None:
    node = node_of(scratch, [])
    assert node.kmsg_path == node.roots.dev / "kmsg"
    assert node.kmsg_path.is_file() and node.kmsg_path.read_bytes() == b""
    source = SxidSource()
    data = source.collect(node.roots)
    assert (data.counts, data.dropped, data.lost, data.behind) == ((), 0, 0, False)
    assert not data.skipped
    # The node builds the source with its others, and runs them in the daemon's order.
    names = [s.name for s in node.sources()]
    assert "sxid" in names and names == [name for name in SOURCES if name in names]


def test_an_sxid_is_the_drivers_three_records_at_its_time(scratch: Path) -> None:
    node = node_of(scratch, [{**FATAL, "count": 2}])
    node.advance_to(2.0)
    assert node.kmsg_path.read_bytes() == b""  # nothing before ``from``
    node.advance_to(4.0)
    usec = UPTIME_USEC + 3_000_000
    prefix = f"nvidia-nvswitch0: SXid (PCI:{SWITCH}): 24007, "
    data = ", ".join(["0x00000000"] * 8)
    lines = [
        "Fatal, Link 30 sourcetrack timeout error",
        "Severity 1 Engine instance 30 Sub-engine instance 00",
        f"Data {{{data}}}",
    ]
    expected = "".join(
        f"3,{seq},{usec},-;{prefix}{lines[seq % 3]}\n" for seq in range(6)
    )  # two SXids, sequence numbers 0 to 5
    assert node.kmsg_path.read_text() == expected
    node.advance_to(8.0)
    assert node.kmsg_path.read_text() == expected  # it happened once


def test_a_nonfatal_sxid_without_a_port_and_a_forged_one(scratch: Path) -> None:
    node = node_of(
        scratch,
        [
            {"kind": "sxid", "from": 1, "nvswitch": 0, "sxid": 20009, "fatal": False,
             "message": "RX Short Error Rate"},
            {**FATAL, "from": 2, "forged": True},
        ],
    )  # fmt: skip
    node.advance_to(3.0)
    records = node.kmsg_path.read_text().splitlines()
    assert records[0] == (
        f"3,0,{UPTIME_USEC + 1_000_000},-;nvidia-nvswitch0: SXid (PCI:{SWITCH}): 20009, "
        "Non-fatal, RX Short Error Rate"
    )
    assert records[1].endswith(": 20009, Severity 0 Engine instance 00 Sub-engine instance 00")
    # Written from user space: facility 1 (LOG_USER), level 4, the same text, the next
    # sequence numbers.
    assert [r.split(";", 1)[0] for r in records[3:]] == [
        f"12,{seq},{UPTIME_USEC + 2_000_000},-" for seq in (3, 4, 5)
    ]
    assert records[3].endswith(": 24007, Fatal, Link 30 sourcetrack timeout error")


def test_the_source_follows_the_file_and_counts_only_the_kernels(scratch: Path) -> None:
    node = node_of(
        scratch,
        [
            {**FATAL, "count": 2},
            {**FATAL, "from": 5, "forged": True, "count": 3},
            {**FATAL, "from": 7},
        ],
    )
    inode = os.stat(node.kmsg_path).st_ino
    source = SxidSource()
    assert source.collect(node.roots).counts == ()
    node.advance_to(4.0)
    (count,) = source.collect(node.roots).counts
    assert (count.nvswitch, count.device, count.sxid, count.fatal, count.link, count.count) == (
        SWITCH,
        "nvswitch0",
        24007,
        True,
        30,
        2,
    )
    assert count.message == "sourcetrack timeout error"
    # The forged records are read and skipped: each line of the three forged SXids (their
    # continuation lines too) is counted as not the kernel's.
    node.advance_to(6.0)
    data = source.collect(node.roots)
    assert [c.count for c in data.counts] == [2]
    assert data.skipped.counts == {SKIP_NOT_KERNEL: 9}
    # At the end of the file the read stops and waits for the next records.
    assert not data.behind
    node.advance_to(8.0)
    assert [c.count for c in source.collect(node.roots).counts] == [3]
    # Appended to, never replaced: the open file is the node's file.
    assert os.stat(node.kmsg_path).st_ino == inode
    # Opened again (a failed read closes it), the file is read from its start and the
    # records counted before are passed over by their sequence numbers.
    source.close()
    again = source.collect(node.roots)
    assert [c.count for c in again.counts] == [3]
    source.close()


def test_a_switch_off_the_bus_logs_nothing_but_a_user_still_can(scratch: Path) -> None:
    node = node_of(
        scratch,
        [
            {"kind": "hot_unplug", "from": 1, "pci": SWITCH},
            {**FATAL, "from": 2},
            {**FATAL, "from": 2, "forged": True},
        ],
    )
    node.advance_to(3.0)
    records = node.kmsg_path.read_text().splitlines()
    assert [r.split(",", 1)[0] for r in records] == ["12", "12", "12"]


def test_forged_lines_as_the_kernel_writes_them_and_the_drivers_xid(scratch: Path) -> None:
    """``forged_as: "segfault"``: the kernel's own report of a binary named after the line
    (facility 0, KERN_INFO, the name's first 15 characters first); an ``xid`` writes the
    driver's record beside its NVML event, and a forged one only the line. The real parsers
    count the driver's records and skip the rest, each with its reason."""
    from nodescope.model.skips import SkipTally
    from nodescope.sources import nvml as nv
    from nodescope.sources import sxid as sx

    node = node_of(
        scratch,
        [
            {**FATAL, "from": 1, "forged": True, "forged_as": "segfault"},
            {"kind": "xid", "from": 2, "gpu": 0, "xid": 48},
            {"kind": "xid", "from": 3, "gpu": 0, "xid": 79, "forged": True,
             "forged_as": "segfault"},
            {"kind": "xid", "from": 3, "gpu": 0, "xid": 94, "forged": True},
        ],
    )  # fmt: skip
    node.advance_to(4.0)
    text = node.kmsg_path.read_text()
    segfault, driver, forged_79, forged_94 = text.splitlines()
    assert segfault.startswith(f"6,0,{UPTIME_USEC + 1_000_000},-;nvidia-nvswitch[")
    assert (
        "segfault at 0 ip 000055d0c0de1139 sp 00007ffd5e1f2a40 error 4 in "
        f"nvidia-nvswitch0: SXid (PCI:{SWITCH}): 24007, Fatal, Link 30 sourcetrack timeout error["
    ) in segfault
    gpu = node.hardware.gpus[0].pci.rsplit(".", 1)[0]
    assert driver.startswith(f"3,1,{UPTIME_USEC + 2_000_000},-;NVRM: Xid (PCI:{gpu}): 48, ")
    assert forged_79.startswith("6,2,") and f"in NVRM: Xid (PCI:{gpu}): 79, " in forged_79
    assert forged_94.startswith(f"12,3,{UPTIME_USEC + 3_000_000},-;NVRM: Xid (PCI:{gpu}): 94, ")
    sxid_skips, xid_skips = SkipTally(), SkipTally()
    assert sx.parse_kmsg_sxid(text, sxid_skips) == ()
    assert dict(sxid_skips.freeze().counts) == {sx.SKIP_LEVEL: 1}
    assert [r.xid for r in nv.parse_kmsg_xid(text, xid_skips)] == [48]
    assert dict(xid_skips.freeze().counts) == {nv.SKIP_XID_LEVEL: 1, nv.SKIP_XID_NOT_KERNEL: 1}


@pytest.mark.parametrize("kind", ["sxid", "xid"])
def test_forged_as_names_one_of_two_ways(kind: str) -> None:
    activity = {**FATAL, "forged": True} if kind == "sxid" else {"kind": "xid", "gpu": 0, "xid": 1}
    with pytest.raises(ParseError, match="forged_as"):
        load([{**activity, "from": 1, "forged_as": "carrier pigeon"}])
