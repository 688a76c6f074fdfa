"""The NVML source against the fake NVML (an 8× H100 HGX node), the kernel-log Xid parser on
real captures, the derived rates and NV# link counting."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope import jsonout
from nodescope.collect import Collector, ScheduledSource
from nodescope.errors import ParseError
from nodescope.model import nvml as model
from nodescope.model.nvlink_graph import BondedPair
from nodescope.model.skips import SkipTally
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.roots import Roots
from nodescope.sim.fake_nvml import FakeGpu, FakeLink, FakeNvml, FakeProcess, hgx_h100
from nodescope.sources import nvml as nv
from nodescope.sources.registry import SOURCES
from tests.conftest import FIXTURES

CAPTURES = FIXTURES / "captures" / "hgx-h100"
NO_FILES = Roots.under("/nonexistent-nodescope-root")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def node() -> FakeNvml:
    return FakeNvml(hgx_h100())


@pytest.fixture
def source(node: FakeNvml) -> Iterator[nv.NvmlSource]:
    src = nv.NvmlSource(node, event_wait_ms=50)
    yield src
    src.close()


def by_index(data: nv.NvmlData) -> dict[int, nv.GpuSample]:
    return {g.index: g for g in data.gpus}


def wait_for(predicate: object, timeout: float = 2.0) -> bool:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


# ---- identity, topology, fields ---------------------------------------------------------


def test_eight_h100s_with_18_switch_links_each(source: nv.NvmlSource) -> None:
    data = source.collect(NO_FILES)
    assert data.device_count == 8
    assert [g.pci_address for g in data.gpus] == [
        "0000:19:00.0",
        "0000:3b:00.0",
        "0000:4c:00.0",
        "0000:5d:00.0",
        "0000:9b:00.0",
        "0000:bb:00.0",
        "0000:cb:00.0",
        "0000:db:00.0",
    ]
    gpu = data.gpus[0]
    assert gpu.name == "NVIDIA H100 80GB HBM3" and gpu.uuid.startswith("GPU-")
    assert (gpu.pcie_gen_current, gpu.pcie_width_current) == (5, 16)
    assert (gpu.pcie_gen_max, gpu.pcie_width_max) == (5, 16)
    assert len(gpu.nvlinks) == 18
    assert {link.remote_type for link in gpu.nvlinks} == {"switch"}
    assert {link.remote_pci_address for link in gpu.nvlinks} == {
        "0000:83:00.0",
        "0000:84:00.0",
        "0000:85:00.0",
        "0000:86:00.0",
    }
    assert all(link.active for link in gpu.nvlinks)
    assert dict(gpu.nvlinks[0].errors) == {"replay": 0, "recovery": 0, "crc_flit": 0, "crc_data": 0}
    json.dumps(dataclasses.asdict(data))  # the record serialises as it is


def test_all_fields_of_a_gpu_are_read_in_one_call_per_cycle(
    node: FakeNvml, source: nv.NvmlSource
) -> None:
    for _ in range(3):
        source.collect(NO_FILES)
    # One call per GPU and run for the counters, and one on the health run (the second)
    # for the memory temperature alone.
    assert node.calls["nvmlDeviceGetFieldValues"] == 8 * 3 + 8
    per_gpu = [ids for gpu, ids in node.field_requests if gpu == 2]
    assert per_gpu[2] == [(nv.FI_MEMORY_TEMP, 0)]
    per_gpu = [ids for ids in per_gpu if ids != [(nv.FI_MEMORY_TEMP, 0)]]
    assert len(per_gpu) == 3
    assert len(per_gpu[0]) == 2 + 18 * 4
    assert (197, 0) in per_gpu[0] and (198, 0) in per_gpu[0]
    assert {(fid, 17) for fid in (138, 139, 140, 141)} <= set(per_gpu[0])


def test_counters_are_bytes_with_the_fields_timestamps(node: FakeNvml) -> None:
    stamps = iter(range(1_700_000_000_000_000, 1_800_000_000_000_000, 500_000))
    fake = FakeNvml(node.gpus, clock_us=lambda: next(stamps))
    src = nv.NvmlSource(fake, watch_xids=False)
    node.gpus[1].pcie_tx_bytes = 4096
    node.gpus[1].links[7].data_tx_kib = 5
    node.gpus[1].links[7].raw_rx_kib = 9
    gpu = by_index(src.collect(NO_FILES))[1]
    assert gpu.pcie_bytes_source == "fields"
    assert gpu.pcie_tx == nv.CounterValue(4096, 1_700_000_000_500_000, 64)  # 2nd GPU read
    link = gpu.nvlinks[7]
    assert link.data_tx is not None and link.raw_rx is not None
    assert (link.data_tx.value, link.raw_rx.value) == (5 * 1024, 9 * 1024)
    assert link.data_tx.bits == 74  # a 64-bit count of KiB, in bytes


def test_unsupported_pcie_fields_fall_back_to_the_20ms_snapshot(node: FakeNvml) -> None:
    node.gpus[3].unsupported |= {197, 198}
    node.gpus[3].pcie_throughput_tx_kbps = 1000
    node.gpus[3].pcie_throughput_rx_kbps = 2000
    src = nv.NvmlSource(node, watch_xids=False)
    first = src.collect(NO_FILES)
    second = src.collect(NO_FILES)
    gpu = by_index(second)[3]
    assert gpu.pcie_tx is None and gpu.pcie_rx is None
    assert gpu.pcie_bytes_source == "throughput-20ms"
    assert gpu.pcie_snapshot == nv.PcieSnapshot(1000 * 1024, 2000 * 1024, 0.02)
    assert "field:197:0" in gpu.unsupported
    assert by_index(second)[2].pcie_bytes_source == "fields"
    # Not asked again: the second request of GPU 3 has no PCIe fields.
    requests = [ids for index, ids in node.field_requests if index == 3]
    assert (197, 0) in requests[0] and (197, 0) not in requests[1]
    rates = {g.index: g for g in nv.gpu_rates(first, second, 1.0).gpus}
    assert rates[3].pcie_rate_basis == "throughput-20ms"
    assert rates[3].pcie_tx_bytes_per_second == 1000 * 1024
    assert rates[2].pcie_rate_basis == "counter"


def test_not_supported_is_remembered_per_gpu_and_call(node: FakeNvml) -> None:
    node.gpus[5].unsupported |= {
        "nvmlDeviceGetJpgUtilization",
        "nvmlDeviceGetNvLinkErrorCounter:3",
        140,
    }
    src = nv.NvmlSource(node, watch_xids=False)
    for _ in range(4):
        data = src.collect(NO_FILES)
    # Asked once on GPU 5, every cycle on the 7 others.
    assert node.calls["nvmlDeviceGetJpgUtilization"] == 7 * 4 + 1
    gpu = by_index(data)[5]
    assert gpu.jpeg_util_percent is None
    assert by_index(data)[4].jpeg_util_percent == 0
    # crc_data (counter 3) is gone from every link after the first NOT_SUPPORTED.
    assert "crc_data" not in dict(gpu.nvlinks[0].errors)
    assert "replay" in dict(gpu.nvlinks[0].errors)
    assert gpu.nvlinks[4].raw_tx is None and gpu.nvlinks[4].data_tx is not None
    last = [ids for index, ids in node.field_requests if index == 5][-1]
    assert not any(fid == 140 for fid, _ in last)
    assert "nvmlDeviceGetJpgUtilization" in gpu.unsupported


def test_not_supported_error_counter_is_asked_once_per_gpu(node: FakeNvml) -> None:
    node.gpus = node.gpus[:1]
    node.gpus[0].unsupported.add("nvmlDeviceGetNvLinkErrorCounter:3")
    src = nv.NvmlSource(node, watch_xids=False, slow_every=1)
    src.collect(NO_FILES)
    src.collect(NO_FILES)
    # 18 links × 3 supported counters × 2 cycles, plus the one unsupported call.
    assert node.calls["nvmlDeviceGetNvLinkErrorCounter"] == 18 * 3 * 2 + 1


def test_processes_and_utilisation(node: FakeNvml) -> None:
    node.gpus[0].processes = [FakeProcess(900, 2 << 30), FakeProcess(12, None)]
    node.gpus[0].gpu_util, node.gpus[0].decoder_util = 97, 40
    node.gpus[0].encoder_util, node.gpus[0].jpeg_util = 3, 55
    gpu = nv.NvmlSource(node, watch_xids=False).collect(NO_FILES).gpus[0]
    assert gpu.processes == (nv.GpuProcess(12, None), nv.GpuProcess(900, 2 << 30))
    assert (gpu.gpu_util_percent, gpu.decoder_util_percent) == (97, 40)
    assert (gpu.encoder_util_percent, gpu.jpeg_util_percent) == (3, 55)


def test_link_peer_is_read_when_the_link_comes_up_not_every_cycle(node: FakeNvml) -> None:
    node.gpus[0].links[2].active = False
    src = nv.NvmlSource(node, watch_xids=False, slow_every=1)
    first = src.collect(NO_FILES).gpus[0].nvlinks[2]
    assert first.active is False and first.remote_pci_address is None
    src.collect(NO_FILES)
    asked = node.calls["nvmlDeviceGetNvLinkRemotePciInfo"]
    assert asked == 8 * 18 - 1
    node.gpus[0].links[2].active = True
    up = src.collect(NO_FILES).gpus[0].nvlinks[2]
    assert up.active and up.remote_pci_address == "0000:83:00.0"
    assert node.calls["nvmlDeviceGetNvLinkRemotePciInfo"] == asked + 1


# ---- failures -----------------------------------------------------------------------------


def test_gpu_lost_mid_run_records_an_event_and_drops_the_gpu(node: FakeNvml) -> None:
    wall = iter(range(1_700_000_000, 1_800_000_000))
    src = nv.NvmlSource(node, watch_xids=False, wall_clock=lambda: float(next(wall)))
    assert len(src.collect(NO_FILES).gpus) == 8
    node.gpus[6].lost = True
    after = src.collect(NO_FILES)
    assert [g.index for g in after.gpus] == [0, 1, 2, 3, 4, 5, 7]
    (event,) = after.events
    assert (event.kind, event.gpu, event.pci_address) == ("gpu_lost", 6, "0000:cb:00.0")
    assert "GpuIsLost" in event.detail
    assert after.lost == (nv.LostGpu(6, node.gpus[6].uuid, "0000:cb:00.0"),)
    requests = len(node.field_requests)
    later = src.collect(NO_FILES)
    assert len(later.events) == 1 and len(later.gpus) == 7
    assert [i for i, _ in node.field_requests[requests:]] == [0, 1, 2, 3, 4, 5, 7]


def test_lost_in_a_field_return_counts_as_lost() -> None:
    class LostField(FakeNvml):
        def _field(self, gpu: FakeGpu, fid: int, scope: int) -> tuple[int, int, int]:
            if gpu.uuid.endswith("1001"):
                return pynvml.NVML_ERROR_GPU_IS_LOST, 0, 0
            return super()._field(gpu, fid, scope)

    src = nv.NvmlSource(LostField(hgx_h100(2)), watch_xids=False)
    data = src.collect(NO_FILES)
    assert [g.index for g in data.gpus] == [0]
    assert data.events[0].gpu == 1


def test_no_driver_collect_raises_and_init_is_retried_slowly() -> None:
    fake = FakeNvml.no_driver()
    clock = Clock()
    src = nv.NvmlSource(fake, retry_seconds=60, clock=clock, event_wait_ms=50)
    with pytest.raises(nv.NvmlUnavailable, match="NVMLError_LibraryNotFound"):
        src.collect(NO_FILES)
    clock.now += 30
    with pytest.raises(nv.NvmlUnavailable, match="next attempt in 30 s"):
        src.collect(NO_FILES)
    assert fake.calls["nvmlInit"] == 1
    clock.now += 31
    fake.gpus = hgx_h100(2)
    fake.init_error = None
    assert len(src.collect(NO_FILES).gpus) == 2
    assert fake.calls["nvmlInit"] == 2
    src.close()


def test_the_collector_marks_the_source_down_and_goes_on() -> None:
    src = nv.NvmlSource(FakeNvml.no_driver())
    collector = Collector(roots=NO_FILES, scheduled=[ScheduledSource(src, 1.0)])
    snapshot = collector.run_cycle(force=True)
    assert snapshot.status["nvml"].up is False
    sample = snapshot.current["nvml"]
    assert sample.data is None and sample.error is not None
    assert "NvmlUnavailable" in sample.error and "LibraryNotFound" in sample.error


def test_driver_gone_mid_run_tears_down_and_reinitialises(node: FakeNvml) -> None:
    clock = Clock()
    src = nv.NvmlSource(node, watch_xids=False, retry_seconds=10, clock=clock)
    src.collect(NO_FILES)
    node.nvmlShutdown()  # every call now answers Uninitialized
    with pytest.raises(nv.NvmlUnavailable, match="Uninitialized"):
        src.collect(NO_FILES)
    with pytest.raises(nv.NvmlUnavailable):
        src.collect(NO_FILES)
    clock.now += 11
    assert len(src.collect(NO_FILES).gpus) == 8
    assert node.calls["nvmlInit"] == 2


def test_real_pynvml_here_makes_the_source_down() -> None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver")
    src = SOURCES["nvml"].make()
    assert SOURCES["nvml"].default_interval == 1.0
    with pytest.raises(nv.NvmlUnavailable, match="LibraryNotFound"):
        src.collect(NO_FILES)
    src.close()


# ---- Xids ---------------------------------------------------------------------------------


@pytest.mark.alone  # a bound on wall-clock time
def test_xid_thread_counts_events_and_stops_on_close(node: FakeNvml) -> None:
    src = nv.NvmlSource(node, event_wait_ms=100)
    assert node.calls["nvmlEventSetCreate"] == 0  # started lazily
    start = time.monotonic()
    src.collect(NO_FILES)
    assert time.monotonic() - start < 0.5  # collect does not wait for events
    assert wait_for(lambda: node.registered_event_sets() == 1)
    for xid in (79, 79, 48):
        node.inject_xid(4, xid)
    node.inject_xid(0, 13)
    assert wait_for(lambda: len(src.collect(NO_FILES).xids) == 3)
    data = src.collect(NO_FILES)
    assert data.xid_source == nv.XID_SOURCE_EVENTS
    assert set(data.xids) == {
        nv.XidCount(0, "0000:19:00.0", 13, 1),
        nv.XidCount(4, "0000:9b:00.0", 48, 1),
        nv.XidCount(4, "0000:9b:00.0", 79, 2),
    }
    threads = [t for t in threading.enumerate() if t.name == "nodescope-nvml-xid"]
    assert len(threads) == 1
    start = time.monotonic()
    src.close()
    assert time.monotonic() - start < 1.0
    assert not threads[0].is_alive()
    assert node.registered_event_sets() == 0  # the event set was freed


@pytest.mark.alone  # a bound on wall-clock time
def test_idle_xid_thread_wakes_once_per_event_wait_and_events_do_not_wait(
    node: FakeNvml,
) -> None:
    """The thread's wait is long (a timeout is a wake-up with nothing to do, and costs CPU);
    an event ends it at once, whatever is left of it."""
    src = nv.NvmlSource(node)
    assert src.event_wait_ms == nv.EVENT_WAIT_MS
    try:
        src.collect(NO_FILES)
        assert wait_for(lambda: node.registered_event_sets() == 1)
        waits = node.calls["nvmlEventSetWait"]
        time.sleep(0.9)
        # At 200 ms this was 4 or 5 waits; the thread waits once and has not timed out yet.
        assert node.calls["nvmlEventSetWait"] - waits <= 1
        start = time.monotonic()
        node.inject_xid(2, 79)
        assert wait_for(lambda: len(src.collect(NO_FILES).xids) == 1, timeout=0.5)
        assert time.monotonic() - start < 0.5
    finally:
        start = time.monotonic()
        src.close()
    # close waits for the wait under way: one event_wait_ms at most.
    assert time.monotonic() - start < nv.EVENT_WAIT_MS / 1000 + 0.5
    assert node.registered_event_sets() == 0


def test_without_event_support_xids_come_from_the_kernel_log(tmp_path: Path) -> None:
    gpus = hgx_h100()
    for gpu in gpus:
        gpu.supported_events = 0
    fake = FakeNvml(gpus)
    (tmp_path / "dev").mkdir()
    kmsg = tmp_path / "dev" / "kmsg"
    kmsg.write_bytes((CAPTURES / "dmesg-with-xid-119.log").read_bytes())
    roots = Roots.under(tmp_path)
    src = nv.NvmlSource(fake, event_wait_ms=50)
    try:
        assert wait_for(lambda: src.collect(roots).xid_source == nv.XID_SOURCE_KMSG)
        data = src.collect(roots)
        assert data.xids == (nv.XidCount(4, "0000:9b:00.0", 119, 5),)
        with kmsg.open("a") as f:
            f.write("3,5000,1,-;NVRM: Xid (PCI:0000:19:00): 79, pid='<unknown>', name=<unknown>, ")
            f.write("GPU has fallen off the bus.\n")
            # No GPU of this node: skipped and counted, no count of its own.
            f.write("3,5001,1,-;NVRM: Xid (PCI:0000:ee:00): 79, pid=1, name=x, y\n")
            f.write("3,5002,2,-;NVRM: Xid (PCI:0000:9b:00): 119, pid=1, name=x, Timeout")
        data = src.collect(roots)  # the unfinished last line waits for its newline
        assert set(data.xids) == {
            nv.XidCount(0, "0000:19:00.0", 79, 1),
            nv.XidCount(4, "0000:9b:00.0", 119, 5),
        }
        assert dict(data.skipped.counts) == {nv.SKIP_XID_UNKNOWN_GPU: 1}
        with kmsg.open("a") as f:
            f.write("\n")
        assert nv.XidCount(4, "0000:9b:00.0", 119, 6) in src.collect(roots).xids
    finally:
        src.close()


def test_no_event_support_and_no_kernel_log_means_no_xid_source() -> None:
    gpus = hgx_h100(1)
    gpus[0].supported_events = 0
    fake = FakeNvml(gpus)
    src = nv.NvmlSource(fake, event_wait_ms=50)
    try:
        assert src.collect(NO_FILES).xid_source is None
        # The thread found no GPU to register and freed its set.
        assert wait_for(lambda: fake.calls["nvmlEventSetFree"] == 1)
        assert src.collect(NO_FILES).xid_source is None
    finally:
        src.close()


# ---- kernel-log parser ----------------------------------------------------------------------


def test_parse_kmsg_xid_on_a_real_dmesg_capture() -> None:
    path = CAPTURES / "dmesg-with-xid-119.log"
    records = nv.parse_kmsg_xid(path.read_text())
    assert len(records) == 5
    first = records[0]
    assert (first.line, first.pci_address, first.xid) == (3, "0000:9b:00.0", 119)
    assert (first.pid, first.process) == (2024380, "nvidia-smi")
    assert first.message.startswith("Timeout after 6s of waiting for RPC response from GPU4 GSP!")
    assert first.sequence is None
    assert [r.process for r in records] == [
        "nvidia-smi",
        "nvidia-smi",
        "nvidia-smi",
        "cache_mgr_main",
        "gpud",
    ]


@pytest.mark.parametrize("name", ["kmsg.1.log", "kmsg.2.peermem.log"])
def test_parse_kmsg_xid_on_real_kmsg_captures_without_xids(name: str) -> None:
    path = CAPTURES / name
    tally = SkipTally()
    assert nv.parse_kmsg_xid(path.read_text(), tally) == ()
    assert not tally


def test_parse_kmsg_xid_record_forms() -> None:
    text = "\n".join(
        [
            "3,4012,57631398500,-;NVRM: Xid (PCI:0000:18:00): 94, pid=3310, name=python, "
            "Contained: SM (0x1). RST: No, D-RST: No",
            " SUBSYSTEM=pci",
            "Jan 18 11:38:05 host kernel: [  269.517039] NVRM: Xid (PCI:0000:01:00): 79, "
            "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
            "NVRM: Xid (PCI:0000:4b:00 GPU-I:02 GPU-C:01): 31, pid=77, name=train, Ch 0000000a",
            # Drivers before R525 print no name=.
            "<3>[  12.5] NVRM: Xid (PCI:10000:01:00): 13, pid=0, Graphics Exception",
        ]
    )
    tally = SkipTally()
    a, b, c, d = nv.parse_kmsg_xid(text, tally)
    assert not tally
    assert (a.sequence, a.kernel_usec, a.xid, a.pid, a.process) == (
        4012,
        57631398500,
        94,
        3310,
        "python",
    )
    assert a.message == "Contained: SM (0x1). RST: No, D-RST: No"
    assert (b.line, b.pci_address, b.xid, b.pid, b.process, b.message) == (
        3,
        "0000:01:00.0",
        79,
        None,
        None,
        "GPU has fallen off the bus.",
    )
    assert (c.pci_address, c.xid, c.pid) == ("0000:4b:00.0", 31, 77)
    assert d.pci_address == "10000:01:00.0"  # a VMD domain keeps its five digits
    assert (d.pid, d.process, d.message) == (0, None, "Graphics Exception")


XID_79 = "NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=x, GPU has fallen off the bus."


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("NVRM: Xid (PCI:0000:zz:00): 13, pid=1, name=x, y", nv.SKIP_XID_UNPARSABLE),
        ("NVRM: Xid (PCI:0000:01:00): thirteen, pid=1, name=x, y", nv.SKIP_XID_UNPARSABLE),
        ("NVRM: Xid (PCI:0000:01:3f): 13, pid=1, name=x, past 31", nv.SKIP_XID_UNPARSABLE),
        # No pid=: not the driver's line.
        ("NVRM: Xid (PCI:0000:01:00): 13, Graphics Exception", nv.SKIP_XID_UNPARSABLE),
        # Somewhere inside the message (a file name in the kernel's segfault report).
        (f"6,9,9,-;a[7]: segfault at 0 ip 1 sp 2 error 4 in {XID_79}[5+1000]", nv.SKIP_XID_LEVEL),
        (f"3,9,9,-;tmpfs: Unknown parameter '{XID_79}'", nv.SKIP_XID_UNPARSABLE),
        (f"tmpfs: Unknown parameter '{XID_79}'", nv.SKIP_XID_UNPARSABLE),
        (f"[  1.0] x {XID_79}", nv.SKIP_XID_UNPARSABLE),
        # Written to /dev/kmsg from user space: the kernel gave it the user facility.
        (f"11,9,9,-;{XID_79}", nv.SKIP_XID_NOT_KERNEL),
        (f"<14>{XID_79}", nv.SKIP_XID_NOT_KERNEL),
        # A kernel record at a level the driver never prints an Xid at.
        (f"6,9,9,-;{XID_79}", nv.SKIP_XID_LEVEL),
        (XID_79 + "x" * nv.MAX_XID_LINE, nv.SKIP_XID_TOO_LONG),
    ],
)
def test_parse_kmsg_xid_skips_and_counts_what_is_not_the_drivers_line(
    line: str, reason: str
) -> None:
    tally = SkipTally()
    [record] = nv.parse_kmsg_xid(f"ok line\n{line}\n3,10,10,-;{XID_79}\n", tally)
    assert (record.line, record.xid, record.pci_address) == (3, 79, "0000:18:00.0")
    assert dict(tally.freeze().counts) == {reason: 1}


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_parse_kmsg_xid_fuzz_any_text(text: str) -> None:
    tally = SkipTally()
    records = nv.parse_kmsg_xid(text, tally)
    lines = [line for line in text.split("\n") if "NVRM: Xid" in line]
    assert len(records) + sum(tally.freeze().counts.values()) <= len(lines)
    for record in records:
        assert record.message.isprintable() and len(record.message) <= 160


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["", "3,1,2,-;", "6,1,2,-;", "11,1,2,-;", "[  1.0] ", "<3>", "x "]),
            st.text(alphabet="0123456789abcdefPCI:.,() =-GU'pidname<>\x00\u2028", max_size=60),
        ),
        max_size=8,
    )
)
def test_parse_kmsg_xid_fuzz_every_xid_line_is_a_record_or_a_counted_skip(
    lines: list[tuple[str, str]],
) -> None:
    """Each line that mentions an Xid is a record in the driver's form at its start, or a
    skip with its reason: never an exception, never silently dropped."""
    text = "\n".join(f"{prefix}NVRM: Xid ({tail}" for prefix, tail in lines)
    tally = SkipTally()
    records = nv.parse_kmsg_xid(text, tally)
    assert len(records) + sum(tally.freeze().counts.values()) == len(lines)
    for record in records:
        assert 0 <= record.xid <= 999 and record.pci_address.count(":") == 2
        assert not text.split("\n")[record.line - 1].startswith(("x ", "6,", "11,"))


def test_parse_bus_id_parses_integers() -> None:
    assert nv.parse_bus_id("00000000:9B:00.0") == "0000:9b:00.0"
    assert nv.parse_bus_id("00010000:01:00.0") == "10000:01:00.0"
    assert nv.parse_bus_id("0000:05:1f.3") == "0000:05:1f.3"
    with pytest.raises(ParseError):
        nv.parse_bus_id("GPU-1234")


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=30))
def test_parse_bus_id_fuzz(text: str) -> None:
    with contextlib.suppress(ParseError):
        nv.parse_bus_id(text)


@pytest.mark.parametrize(
    ("value_type", "member", "number", "bits"),
    [
        (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, "uiVal", 7, 32),
        (pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, "ullVal", 1 << 40, 64),
        (pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT, "usVal", 9, 16),
        (pynvml.NVML_VALUE_TYPE_DOUBLE, "dVal", 2.5, None),
    ],
)
def test_field_value_reads_the_member_named_by_value_type(
    value_type: int, member: str, number: float, bits: int | None
) -> None:
    value = pynvml.c_nvmlFieldValue_t()
    value.valueType = value_type
    setattr(value.value, member, number)
    assert nv.field_value(value) == (number, bits)


def real_field_values(
    rows: list[tuple[int, int, int, int, int, str, int | float]],
) -> ctypes.Array[Any]:
    """An array of pynvml's own structs, filled attribute by attribute as NVML and pynvml
    fill them: (fieldId, scopeId, timestamp, nvmlReturn, valueType, member, number)."""
    values: ctypes.Array[Any] = (pynvml.c_nvmlFieldValue_t * len(rows))()
    for value, (fid, scope, stamp, ret, vtype, member, number) in zip(values, rows, strict=True):
        value.fieldId, value.scopeId, value.timestamp = fid, scope, stamp
        value.latencyUsec = 3
        value.nvmlReturn, value.valueType = ret, vtype
        setattr(value.value, member, number)
    return values


ALL_VALUE_TYPES = [
    (pynvml.NVML_VALUE_TYPE_DOUBLE, "dVal", -2.5),
    (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, "uiVal", (1 << 32) - 2),
    (pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG, "ulVal", 1 << 40),
    (pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, "ullVal", (1 << 64) - 3),
    (pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG, "sllVal", -(1 << 50)),
    (pynvml.NVML_VALUE_TYPE_SIGNED_INT, "siVal", -7),
    (pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT, "usVal", 65535),
]


def test_field_columns_from_memory_match_pynvml_attribute_reads() -> None:
    rows = [
        (197 + i, i, 1_700_000_000_000_000 + i, pynvml.NVML_SUCCESS, vtype, member, number)
        for i, (vtype, member, number) in enumerate(ALL_VALUE_TYPES)
    ]
    rows.append((138, 17, 0, pynvml.NVML_ERROR_NOT_SUPPORTED, 0, "ullVal", 0))
    values = real_field_values(rows)
    from_memory = nv.field_columns(values)
    by_attribute = nv.field_columns(list(values))  # not a ctypes array: read attribute-wise
    assert [list(c) for c in from_memory] == [list(c) for c in by_attribute]
    assert len(from_memory) == len(nv.FIELD_COLUMNS)
    for value, row in zip(values, zip(*from_memory, strict=True), strict=True):
        fid, scope, stamp, latency, vtype, ret, union = row
        assert (fid, scope, stamp, latency) == (value.fieldId, value.scopeId, value.timestamp, 3)
        assert (vtype, ret) == (value.valueType, value.nvmlReturn)
        if ret == pynvml.NVML_SUCCESS:
            assert nv.row_value(vtype, union) == nv.field_value(value)
    with pytest.raises(ValueError, match="valueType 99"):
        nv.row_value(99, 0)


def test_fields_of_every_value_type_give_the_counters_of_their_member() -> None:
    class Typed(FakeNvml):
        """PCIe fields of GPU 0 answered in one value type after another."""

        kind = 0

        def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: Any) -> Any:
            super().nvmlDeviceGetFieldValues(handle, fieldIds)
            vtype, member, number = ALL_VALUE_TYPES[self.kind]
            ok = pynvml.NVML_SUCCESS
            return real_field_values(
                [(fid, scope, 5_000_000, ok, vtype, member, number) for fid, scope in fieldIds]
            )

    fake = Typed(hgx_h100(1, 1))
    src = nv.NvmlSource(fake, watch_xids=False)
    widths = {"dVal": None, "uiVal": 32, "ulVal": 64, "ullVal": 64, "sllVal": 63, "siVal": 31}
    for kind, (_vtype, member, number) in enumerate(ALL_VALUE_TYPES):
        fake.kind = kind
        gpu = src.collect(NO_FILES).gpus[0]
        if number < 0:  # a negative count is no count
            assert gpu.pcie_tx is None and gpu.nvlinks[0].data_tx is None
            continue
        bits = widths.get(member, 16)
        assert gpu.pcie_tx == nv.CounterValue(int(number), 5_000_000, bits)
        assert gpu.nvlinks[0].data_tx == nv.CounterValue(
            int(number) * 1024, 5_000_000, None if bits is None else bits + 10
        )


# ---- slow counters ------------------------------------------------------------------------


def fixed_clock_fake(gpus: int = 2, links: int = 3) -> FakeNvml:
    return FakeNvml(hgx_h100(gpus, links), clock_us=lambda: 1_750_000_000_000_000)


def test_production_cadence_reads_fault_counters_every_slow_every_runs() -> None:
    fake = fixed_clock_fake()
    src = nv.NvmlSource(fake, watch_xids=False)
    assert src.slow_every == nv.SLOW_EVERY == 10
    first = src.collect(NO_FILES)
    asked = fake.calls["nvmlDeviceGetNvLinkErrorCounter"]
    assert asked == 2 * 3 * 4  # the first run reads everything
    gpu, link = fake.gpus[1], fake.gpus[1].links[2]
    link.errors[2] = 5  # crc_flit
    gpu.replay_counter, gpu.curr_gen = 7, 4
    link.data_tx_kib = 11
    for run in range(2, 11):
        data = src.collect(NO_FILES)
        sample = data.gpus[1]
        # Byte counters move every run; the fault counters keep their last reading.
        assert sample.nvlinks[2].data_tx == nv.CounterValue(11 * 1024, 1_750_000_000_000_000, 74)
        assert dict(sample.nvlinks[2].errors)["crc_flit"] == 0, run
        assert (sample.pcie_replays, sample.pcie_gen_current) == (0, 5)
        assert list(sample.nvlinks) == [
            dataclasses.replace(old, data_tx=new.data_tx)
            for old, new in zip(first.gpus[1].nvlinks, sample.nvlinks, strict=True)
        ]
    assert fake.calls["nvmlDeviceGetNvLinkErrorCounter"] == asked
    # Discovery probes one link past the last; the first run reads each link's state.
    assert fake.calls["nvmlDeviceGetNvLinkState"] == 2 * 4 + 2 * 3
    eleventh = src.collect(NO_FILES).gpus[1]
    assert dict(eleventh.nvlinks[2].errors)["crc_flit"] == 5
    assert (eleventh.pcie_replays, eleventh.pcie_gen_current) == (7, 4)
    assert fake.calls["nvmlDeviceGetNvLinkErrorCounter"] == 2 * asked
    counter_calls = [ids for _gpu, ids in fake.field_requests if ids != [(nv.FI_MEMORY_TEMP, 0)]]
    assert len(counter_calls) == 2 * 11


def test_slow_every_1_reads_fault_counters_every_run() -> None:
    fake = fixed_clock_fake()
    src = nv.NvmlSource(fake, watch_xids=False, slow_every=1)
    src.collect(NO_FILES)
    fake.gpus[0].links[1].errors[1] = 2  # recovery
    fake.gpus[0].links[0].active = False
    fake.gpus[0].replay_counter = 3
    gpu = src.collect(NO_FILES).gpus[0]
    assert dict(gpu.nvlinks[1].errors)["recovery"] == 2
    assert gpu.nvlinks[0].active is False and gpu.pcie_replays == 3


def test_carried_records_equal_fresh_ones_while_nothing_slow_moves() -> None:
    fresh_fake, slow_fake = fixed_clock_fake(), fixed_clock_fake()
    # Health read every run by both, on one wall clock, so it compares equal too.
    same = {"watch_xids": False, "health_every": 1, "wall_clock": lambda: 1.75e9}
    fresh = nv.NvmlSource(fresh_fake, slow_every=1, **same)  # type: ignore[arg-type]
    slow = nv.NvmlSource(slow_fake, slow_every=4, **same)  # type: ignore[arg-type]
    for run in range(9):
        for fake in (fresh_fake, slow_fake):
            fake.gpus[run % 2].links[run % 3].raw_rx_kib += 100 * run
            fake.gpus[1].pcie_rx_bytes += 4096
            fake.gpus[0].processes = [FakeProcess(1000 + run, 1 << 20)]
            fake.gpus[0].gpu_util = 10 * run
        assert slow.collect(NO_FILES) == fresh.collect(NO_FILES), run
    assert slow_fake.calls["nvmlDeviceGetNvLinkErrorCounter"] == 3 * 2 * 3 * 4  # runs 1, 5, 9
    assert fresh_fake.calls["nvmlDeviceGetNvLinkErrorCounter"] == 9 * 2 * 3 * 4


def test_a_lost_gpu_makes_the_next_run_read_everything() -> None:
    fake = fixed_clock_fake(3)
    src = nv.NvmlSource(fake, watch_xids=False)
    src.collect(NO_FILES)
    src.collect(NO_FILES)
    fake.gpus[2].links[0].errors[0] = 9
    fake.gpus[1].lost = True
    assert [g.index for g in src.collect(NO_FILES).gpus] == [0, 2]
    after = src.collect(NO_FILES).gpus[1]
    assert after.index == 2 and dict(after.nvlinks[0].errors)["replay"] == 9
    # ... and the cadence starts again from there.
    fake.gpus[2].links[0].errors[0] = 10
    assert dict(src.collect(NO_FILES).gpus[1].nvlinks[0].errors)["replay"] == 9


def test_gpus_found_at_reinitialisation_are_read_in_full_at_once() -> None:
    fake = fixed_clock_fake(1)
    clock = Clock()
    src = nv.NvmlSource(fake, watch_xids=False, retry_seconds=1, clock=clock)
    src.collect(NO_FILES)
    src.collect(NO_FILES)
    fake.nvmlShutdown()
    with pytest.raises(nv.NvmlUnavailable):
        src.collect(NO_FILES)
    fake.gpus = hgx_h100(2, 3)
    fake.gpus[1].links[1].errors[3] = 4
    fake.gpus[0].replay_counter = 6
    clock.now += 2
    data = src.collect(NO_FILES)
    assert len(data.gpus) == 2
    assert dict(data.gpus[1].nvlinks[1].errors)["crc_data"] == 4
    assert data.gpus[0].pcie_replays == 6
    assert all(link.active and link.remote_pci_address for g in data.gpus for link in g.nvlinks)


def test_the_simulated_node_sets_slow_every_on_the_nvml_source() -> None:
    from nodescope.sim.node import SimulatedNode
    from nodescope.sim.scenario import load_scenario

    node = SimulatedNode(load_scenario("dgx-h100"), Path("/nonexistent-nodescope-sim"))
    # The daemon's cadence: a replay reads link states and error counters as seldom as it does.
    (source,) = [s for s in node.sources() if isinstance(s, nv.NvmlSource)]
    assert source.slow_every == nv.SLOW_EVERY


# ---- rates and NV# ------------------------------------------------------------------------


def test_rates_use_field_timestamps_and_handle_a_32_bit_wrap() -> None:
    # Every read that dates itself takes the next stamp: the health run's too.
    stamps = iter(range(1_000_000, 100_000_000, 2_000_000))
    gpus = hgx_h100(1, 2)
    gpus[0].pcie_counter_bits = 32
    gpus[0].pcie_tx_bytes = (1 << 32) - 1000
    fake = FakeNvml(gpus, clock_us=lambda: next(stamps))
    src = nv.NvmlSource(fake, watch_xids=False)
    first = src.collect(NO_FILES)
    gpus[0].pcie_tx_bytes += 4000  # wraps past 2^32
    gpus[0].links[1].data_rx_kib += 2048
    second = src.collect(NO_FILES)
    (rates,) = nv.gpu_rates(first, second, 123.0).gpus  # 123 s is the poll clock: unused
    assert rates.pcie_rate_basis == "counter"
    assert rates.pcie_tx_bytes_per_second == pytest.approx(4000 / 2.0)
    assert rates.nvlinks[1].data_rx_bytes_per_second == pytest.approx(2048 * 1024 / 2.0)
    assert rates.nvlinks[0].data_rx_bytes_per_second == 0.0
    gpus[0].pcie_tx_bytes = 10  # a drop that is not one wrap from the upper half: a reset
    gpus[0].pcie_counter_bits = 64
    third = src.collect(NO_FILES)
    (after_reset,) = nv.gpu_rates(second, third, 1.0).gpus
    assert after_reset.pcie_tx_bytes_per_second is None


_counter = st.none() | st.builds(
    nv.CounterValue,
    st.integers(-2, 2**64 + 2),
    st.none() | st.integers(0, 10**7),
    st.sampled_from([None, 42, 64, 74]),
)
_link_row = st.builds(
    nv.NvLinkSample,
    st.integers(0, 5),
    st.none() | st.booleans(),
    st.sampled_from([None, "gpu", "switch"]),
    st.sampled_from([None, "0000:05:00.0"]),
    _counter,
    _counter,
    _counter,
    _counter,
    st.just((("replay", 1),)),
)


@settings(max_examples=200, deadline=None)
@given(
    before=st.lists(_link_row, max_size=6, unique_by=lambda x: x.link),
    after=st.lists(_link_row, max_size=6, unique_by=lambda x: x.link),
    seconds=st.sampled_from([0.0, 0.5, 1.0]),
)
def test_link_rates_over_columns_are_each_link_s_rate(
    before: list[nv.NvLinkSample], after: list[nv.NvLinkSample], seconds: float
) -> None:
    """Links held as columns give the rates each link's pair of readings gives, whatever
    the links before and after (matched by number: reordered, added, dropped), wraps,
    resets, missing readings and timestamps included."""
    old, new = model.NvLinks.of(before), model.NvLinks.of(after)
    assert list(old) == before and len(new) == len(after)
    table = model._link_rates(old, new, seconds)
    rows = {x.link: x for x in before}
    expected = [
        nv.NvLinkRates(
            x.link,
            *(
                model._rate(getattr(rows[x.link], name), getattr(x, name), seconds)
                for name in ("data_tx", "data_rx", "raw_tx", "raw_rx")
            ),
        )
        for x in after
        if x.link in rows
    ]
    assert list(table) == expected


def test_links_as_columns_refuse_ragged_columns_and_are_written_as_rows() -> None:
    rows = [
        nv.NvLinkSample(n, True, "switch", "0000:05:00.0", nv.CounterValue(n, 5, 74), None,
                        None, None, (("replay", n),))
        for n in range(3)
    ]  # fmt: skip
    links = model.NvLinks.of(rows)
    assert links[2] == rows[2] and links[0:2] == rows[0:2]
    assert jsonout.plain(links) == [jsonout.plain(r) for r in rows]
    with pytest.raises(ValueError, match="link columns"):
        dataclasses.replace(links, active=(True,))
    with pytest.raises(ValueError, match="differ in length"):
        model.CounterColumn((1, 2), (None,), (64, 64))


def test_a_snapshot_carries_the_gpu_rates(node: FakeNvml) -> None:
    src = nv.NvmlSource(node, watch_xids=False)
    first = src.collect(NO_FILES)
    node.gpus[0].pcie_rx_bytes += 10**6
    second = src.collect(NO_FILES)
    snapshot = Snapshot(
        cycle=2,
        monotonic=2.0,
        wall_time=0.0,
        current={"nvml": SourceSample("nvml", 2.0, 0.0, second)},
        previous={"nvml": SourceSample("nvml", 1.0, 0.0, first)},
    )
    rates = snapshot.derived.gpu_rates
    assert isinstance(rates, nv.NvmlRates)
    assert rates.gpus[0].pcie_rx_bytes_per_second is not None
    assert rates.gpus[0].pcie_rx_bytes_per_second > 0


def test_nvlink_pairs_through_nvswitches_is_nv18(node: FakeNvml) -> None:
    node.gpus[1].links[0].active = False
    data = nv.NvmlSource(node, watch_xids=False).collect(NO_FILES)
    pairs = {(p.gpu_a, p.gpu_b): p for p in nv.nvlink_pairs(data.gpus)}
    assert len(pairs) == 28
    assert pairs[(0, 7)] == BondedPair(0, 7, 18, "nvswitch")
    assert pairs[(0, 1)].links == 17  # one of GPU 1's links is down


def test_nvlink_pairs_counts_direct_links_by_peer_address() -> None:
    a, b, c = "00000000:07:00.0", "00000000:0F:00.0", "00000000:47:00.0"
    gpu = pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
    gpus = [
        FakeGpu("GPU-a", "A100", a, links=[FakeLink(b, gpu)] * 4 + [FakeLink(c, gpu)] * 2),
        FakeGpu("GPU-b", "A100", b, links=[FakeLink(a, gpu)] * 4),
        FakeGpu("GPU-c", "A100", c, links=[FakeLink(a, gpu)] * 2),
    ]
    data = nv.NvmlSource(FakeNvml(gpus), watch_xids=False).collect(NO_FILES)
    assert nv.nvlink_pairs(data.gpus) == (
        BondedPair(0, 1, 4, "direct"),
        BondedPair(0, 2, 2, "direct"),
    )


def test_the_source_module_does_not_import_torch() -> None:
    code = (
        "import sys, nodescope.sources.nvml, nodescope.sim.fake_nvml;"
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@settings(max_examples=300, deadline=None)
@given(
    # Never a leading space: a line that starts " KEY=" is a /dev/kmsg dictionary line.
    st.text(alphabet="abcxyz0123456789 :[]()=,'.-_\t", max_size=40).map(lambda t: "x" + t),
    st.sampled_from(["3,7,9,-;", "<3>", "", "[  1.0] "]),
)
def test_parse_kmsg_xid_fuzz_a_driver_line_inside_a_message_is_never_an_xid(
    before: str, prefix: str
) -> None:
    """The driver's exact line after any other text of the record (a file name, a mount
    option): never an Xid, always one counted skip."""
    tally = SkipTally()
    assert nv.parse_kmsg_xid(f"{prefix}{before}{XID_79}", tally) == ()
    assert sum(tally.freeze().counts.values()) == 1
