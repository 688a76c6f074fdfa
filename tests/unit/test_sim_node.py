"""The simulated node, read back by the daemon's real sources.

Nodes are built on a tmpfs when the machine has one (``make_temp_root``): a node writes some
30,000 small files, which a disk-backed /tmp can take many seconds for.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml
import pytest

from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.model.topology import DeviceClass, Topology
from nodescope.roots import Roots
from nodescope.sim.lspci import bridge_chains, parse_lspci_vvv
from nodescope.sim.node import SimulatedNode, make_temp_root
from nodescope.sim.scenario import load_scenario
from nodescope.sources.cgroup import CgroupTree
from nodescope.sources.diskstats import DisksData, parse_diskstats
from nodescope.sources.infiniband import InfinibandData, read_infiniband
from nodescope.sources.nvml import NvmlData, nvlink_pairs
from nodescope.sources.registry import simulated_specs
from tests.conftest import FIXTURES
from tests.unit.scenario_helpers import read_in_full

CAPTURE = FIXTURES / "captures" / "hgx-h100" / "lspci-vvv.hgx-h100"
GPU_BUSES = ("19", "3b", "4c", "5d", "9b", "bb", "cb", "db")
NVME_BUSES = ("18", "3a", "4b", "5c", "9a", "ba", "ca", "da")
CX7_BUSES = ("1a", "3c", "4d", "5e", "9c", "bc", "cc", "dc")
GB = 1e9


@dataclass
class Run:
    node: SimulatedNode
    samples: dict[float, dict[str, Any]]

    def snapshot(self, t0: float, t1: float) -> Snapshot:
        def sample(t: float) -> dict[str, SourceSample]:
            return {n: SourceSample(n, t, 0.0, d) for n, d in self.samples[t].items()}

        return Snapshot(1, t1, t1, current=sample(t1), previous=sample(t0))


def run_scenario(name: str, root: Path, times: tuple[float, ...]) -> Run:
    """Build ``name`` under ``root``, advance it to each of ``times`` and collect every source
    at each."""
    node = SimulatedNode(load_scenario(name), root / "node")
    node.materialise()
    sources = read_in_full(node.sources())
    samples: dict[float, dict[str, Any]] = {}
    try:
        for t in times:
            node.advance_to(t)
            samples[t] = {s.name: s.collect(node.roots) for s in sources}
    finally:
        for s in sources:
            s.close()
    return Run(node, samples)


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    root = make_temp_root("nodescope-test-sim-")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def dgx(scratch: Path) -> Run:
    return run_scenario("dgx-h100", scratch / "dgx", (0.0, 1.0))


# --------------------------------------------------------------------------------------------
# dgx-h100: topology


def test_sources_are_the_tree_sources_and_nvml(dgx: Run) -> None:
    names = [s.name for s in dgx.node.sources()]
    # The specs that declare what they read of the simulated node, in the registry's order;
    # ``traces`` only with a spool, which this node has not.
    assert names == [s.name for s in simulated_specs() if s.name != "traces"]
    assert names[:5] == ["pci", "disks", "infiniband", "cgroups", "procs"]
    assert {"nvml", "nvlink_kmod", "udev", "link_events", "sxid"} <= set(names)
    assert set(dgx.samples[1.0]) == set(names)


def test_topology_counts(dgx: Run) -> None:
    topo: Topology = dgx.samples[1.0]["pci"]
    classes = collections.Counter(d.device_class for d in topo.devices)
    assert classes[DeviceClass.GPU] == 8
    assert classes[DeviceClass.NVSWITCH] == 4
    assert classes[DeviceClass.NVME] == 8
    assert [n.node for n in topo.numa_nodes] == [0, 1]
    assert [len(n.cpus) for n in topo.numa_nodes] == [112, 112]
    ib: InfinibandData = dgx.samples[1.0]["infiniband"]
    assert len(ib.devices) == 10  # 8 compute HCAs, 2 storage bonds
    by_bdf = {d.bdf: d for d in topo.devices}
    mellanox_slots = {d.bdf[:-2] for d in topo.devices if d.vendor_id == 0x15B3}
    assert len(mellanox_slots) == 10
    for device in ib.devices:
        assert device.pci_address is not None
        assert device.pci_address[:-2] in mellanox_slots
        assert device.name in by_bdf[device.pci_address].ib_devices
    assert [p.rate.gbps for p in ib.ports() if p.device.startswith("mlx5_bond")] == [200.0, 200.0]
    assert {p.link_layer for p in ib.ports() if not p.device.startswith("mlx5_bond")} == {
        "InfiniBand"
    }


def test_topology_matches_the_capture(dgx: Run) -> None:
    """Each GPU shares its switch and root port with one NVMe drive and one ConnectX-7, as in
    the real server; GPUs 0-3 sit on NUMA node 0, 4-7 on node 1; the NVSwitches share a root
    port of their own on node 1."""
    topo: Topology = dgx.samples[1.0]["pci"]
    by_bdf = {d.bdf: d for d in topo.devices}
    capture_chains = bridge_chains(parse_lspci_vvv(CAPTURE.read_text(), str(CAPTURE)))
    for i, (gpu_bus, nvme_bus, nic_bus) in enumerate(
        zip(GPU_BUSES, NVME_BUSES, CX7_BUSES, strict=True)
    ):
        gpu, nvme, nic = (by_bdf[f"0000:{b}:00.0"] for b in (gpu_bus, nvme_bus, nic_bus))
        assert gpu.device_class == DeviceClass.GPU and nvme.device_class == DeviceClass.NVME
        assert gpu.chain == capture_chains[gpu.bdf]
        assert nvme.chain == capture_chains[nvme.bdf] and nic.chain == capture_chains[nic.bdf]
        assert gpu.chain[:2] == nvme.chain[:2] == nic.chain[:2]  # root port, switch upstream port
        assert gpu.numa_node == nvme.numa_node == nic.numa_node == (0 if i < 4 else 1)
        assert gpu.link is not None and gpu.link.current_speed_gts == 32.0
        assert gpu.link.current_width == 16
        assert nvme.nvme_controllers == (f"nvme{i}",)
    roots = {by_bdf[f"0000:{b}:00.0"].chain[0] for b in GPU_BUSES}
    assert len(roots) == 8
    switches = [d for d in topo.devices if d.device_class == DeviceClass.NVSWITCH]
    assert {s.chain[0] for s in switches} == {"0000:80:01.0"}
    assert {s.numa_node for s in switches} == {1}


def test_nvml_sees_the_gpus_and_nvlink_graph(dgx: Run) -> None:
    data: NvmlData = dgx.samples[1.0]["nvml"]
    assert [g.pci_address for g in data.gpus] == [f"0000:{b}:00.0" for b in GPU_BUSES]
    switches = {f"0000:{b}:00.0" for b in ("83", "84", "85", "86")}
    for gpu in data.gpus:
        assert len(gpu.nvlinks) == 18
        assert {link.remote_type for link in gpu.nvlinks} == {"switch"}
        assert {link.remote_pci_address for link in gpu.nvlinks} == switches
        assert (gpu.pcie_gen_current, gpu.pcie_width_current, gpu.pcie_gen_max) == (5, 16, 5)
        assert [p.pid for p in gpu.processes]
    pairs = nvlink_pairs(data.gpus)
    assert len(pairs) == 28 and {p.links for p in pairs} == {18}


# --------------------------------------------------------------------------------------------
# dgx-h100: rates read back equal the configured ones


def test_disk_rates_equal_the_scenario(dgx: Run) -> None:
    report = dgx.snapshot(0.0, 1.0).derived.disk_rates
    assert report is not None and len(report.devices) == 8
    for figures in report.devices:
        assert figures.rmb_s * 2**20 == pytest.approx(800e6, rel=0.01)
        assert figures.wmb_s * 2**20 == pytest.approx(50e6, rel=0.01)
        assert figures.r_s == pytest.approx(800e6 / 131072, rel=0.01)
        assert figures.r_await == pytest.approx(0.12, rel=0.01)
    data: DisksData = dgx.samples[1.0]["disks"]
    assert [ns.paths[0].pci_address for ns in data.nvme] == [f"0000:{b}:00.0" for b in NVME_BUSES]


def test_infiniband_rates_equal_the_scenario(dgx: Run) -> None:
    rates = dgx.snapshot(0.0, 1.0).derived.ib_rates
    assert rates is not None
    expected = {"mlx5_0": 20 * GB, "mlx5_5": 20 * GB, "mlx5_6": 10 * GB, "mlx5_9": GB}
    for device, rate in expected.items():
        port = rates.port(device, 1)
        assert port is not None
        assert port.xmit_bytes_per_second == pytest.approx(rate, rel=1e-6)
        assert port.rcv_bytes_per_second == pytest.approx(rate, rel=1e-6)
    bond = rates.port("mlx5_bond_0", 1)
    assert bond is not None and bond.rcv_bytes_per_second == pytest.approx(1.2 * GB, rel=1e-6)


def test_infiniband_starts_from_the_captured_counters(dgx: Run) -> None:
    captured = read_infiniband(Roots.under(FIXTURES / "captures" / "h100-node-infiniband"))
    before = {p.device: p for p in captured.ports()}
    at_zero: InfinibandData = dgx.samples[0.0]["infiniband"]
    for port in at_zero.ports():
        source = before["mlx5_bond_0" if port.device.startswith("mlx5_bond") else port.device]
        assert {c.name for c in port.counters} == {c.name for c in source.counters}
        assert port.xmit_bytes == source.xmit_bytes


def test_gpu_pcie_and_nvlink_rates_equal_the_scenario(dgx: Run) -> None:
    rates = dgx.snapshot(0.0, 1.0).derived.gpu_rates
    assert rates is not None and len(rates.gpus) == 8
    for gpu in rates.gpus:
        assert gpu.pcie_rate_basis == "counter"
        assert gpu.pcie_rx_bytes_per_second == pytest.approx(2 * GB, rel=0.01)
        assert gpu.pcie_tx_bytes_per_second == pytest.approx(0.5 * GB, rel=0.01)
        per_link = {0: 5, 1: 5, 2: 5, 3: 5, 4: 3, 5: 3}.get(gpu.index, 0) * GB
        for link in gpu.nvlinks:
            assert link.data_tx_bytes_per_second == pytest.approx(per_link, rel=0.01, abs=1)


# --------------------------------------------------------------------------------------------
# dgx-h100: processes, cgroups, procfs


def _stat_fields(text: str) -> tuple[str, list[str]]:
    head, _, rest = text.rpartition(")")
    return head.split(" (", 1)[1], rest.split()


def test_about_two_thousand_processes(dgx: Run) -> None:
    procfs = dgx.node.roots.procfs
    pids = [p for p in os.listdir(procfs) if p.isdigit()]
    assert 1900 <= len(pids) <= 2100
    for pid in pids[:: len(pids) // 50]:
        comm, fields = _stat_fields((procfs / pid / "stat").read_text())
        assert len(fields) == 50  # 52 fields: pid and comm before the last ")"
        assert fields[0] in "RSDTtXZPI"
        assert comm == (procfs / pid / "comm").read_text().rstrip("\n")
        tasks = os.listdir(procfs / pid / "task")
        assert int(fields[17]) == len(tasks)  # num_threads
        assert pid in tasks


def test_slurm_cgroup_v2_layout(dgx: Run) -> None:
    tree: CgroupTree = dgx.samples[1.0]["cgroups"]
    assert tree.mode == "unified"
    paths = {c.path: c for c in tree.cgroups}
    job = "/system.slice/slurmstepd.scope/job_81730"
    for sub in (
        "",
        "/step_extern/slurm",
        "/step_extern/user/task_special",
        "/step_batch/slurm",
        "/step_batch/user/task_0",
        "/step_0/slurm",
        "/step_0/user/task_0",
        "/step_0/user/task_3",
    ):
        assert job + sub in paths, sub
    assert paths[job].memory_max is not None and paths[job].memory_max.value == 512 * 2**30
    assert paths[f"{job}/step_0/user/task_0"].nr_procs == 5  # a rank and its four loaders
    total = sum(c.nr_procs or 0 for c in tree.cgroups)
    assert total == len([p for p in os.listdir(dgx.node.roots.procfs) if p.isdigit()])


def test_rank_process_files(dgx: Run) -> None:
    procfs = dgx.node.roots.procfs
    pid = dgx.node.pid_of("j81730-rank", 2)
    environ = dict(
        item.split("=", 1)
        for item in (procfs / str(pid) / "environ").read_bytes().decode().split("\0")
        if item
    )
    assert environ["NCCL_IB_HCA"] == "mlx5_0,mlx5_1,mlx5_4,mlx5_5"
    assert environ["CUDA_VISIBLE_DEVICES"] == "2" and environ["SLURM_JOB_ID"] == "81730"
    cgroup = (procfs / str(pid) / "cgroup").read_text()
    assert cgroup == "0::/system.slice/slurmstepd.scope/job_81730/step_0/user/task_2\n"
    tids = sorted(int(t) for t in os.listdir(procfs / str(pid) / "task"))
    assert len(tids) == 16 and tids[0] == pid
    names = collections.Counter(
        (procfs / str(pid) / "task" / str(t) / "comm").read_text().strip() for t in tids
    )
    assert names["NCCL Progress 0"] == 2 and names["python3"] == 11
    threads = dgx.node.roots.cgroupfs / cgroup[4:].strip().lstrip("/") / "cgroup.threads"
    assert set(tids) <= {int(x) for x in threads.read_text().split()}
    nvml: NvmlData = dgx.samples[1.0]["nvml"]
    assert pid in [p.pid for p in nvml.gpus[2].processes]


def test_proc_files_for_later_sources(dgx: Run) -> None:
    procfs = dgx.node.roots.procfs
    mountstats = (procfs / "self" / "mountstats").read_text()
    assert (
        "device ckpt-nfs:/export/ckpt mounted on /mnt/ckpt with fstype nfs4 statvers=1.1"
        in mountstats
    )
    read_line = re.search(r"^\s+READ: (.*)$", mountstats, re.MULTILINE)
    assert read_line is not None and len(read_line.group(1).split()) == 9
    snmp = (procfs / "net" / "snmp").read_text().splitlines()
    tcp = [line.split()[1:] for line in snmp if line.startswith("Tcp:")]
    assert dict(zip(tcp[0], tcp[1], strict=True))["RetransSegs"].isdigit()
    locks = (procfs / "locks").read_text().splitlines()
    assert all(re.match(r"\d+: (POSIX|FLOCK) ", line) for line in locks)
    uptime = float((procfs / "uptime").read_text().split()[0])
    assert uptime == 864001.0


# --------------------------------------------------------------------------------------------
# Ticks: only changed files, atomically, fast


@pytest.mark.alone  # a bound on wall-clock time
def test_a_tick_rewrites_only_what_changed(scratch: Path) -> None:
    node = SimulatedNode(load_scenario("dgx-h100"), scratch / "ticks")
    start = time.perf_counter()
    node.materialise()
    assert time.perf_counter() - start < 10.0
    node.advance_to(0.0)
    written = node.writes
    node.advance_to(0.0)
    assert node.writes == written  # nothing moved
    durations = []
    for t in (1.0, 2.0, 3.0):
        before = node.writes
        start = time.perf_counter()
        node.advance_to(t)
        durations.append(time.perf_counter() - start)
        assert 0 < node.writes - before < 400  # of some 30,000 files
    assert min(durations) < 0.1
    with pytest.raises(ValueError):
        node.advance_to(2.0)


def test_concurrent_readers_never_see_a_torn_file(scratch: Path) -> None:
    node = SimulatedNode(load_scenario("dgx-h100"), scratch / "torn")
    node.materialise()
    node.advance_to(0.0)
    diskstats = node.roots.procfs / "diskstats"
    counters = node.roots.sysfs / "class" / "infiniband" / "mlx5_0" / "ports" / "1" / "counters"
    names = set(os.listdir(counters))
    problems: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            disks = [d for d in parse_diskstats(diskstats.read_text()) if d.name.startswith("nvme")]
            if len(disks) != 8:
                problems.append(f"{len(disks)} disks")
            if set(os.listdir(counters)) != names:
                problems.append("counter directory changed")
            value = (counters / "port_xmit_data").read_text()
            if not re.fullmatch(r"[0-9]+\n", value):
                problems.append(repr(value))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for step in range(1, 41):
            node.advance_to(step * 0.25)
    finally:
        stop.set()
        thread.join()
    assert not problems


def test_nvlink_snapshot_is_the_modules_file_under_dev(dgx: Run) -> None:
    assert dgx.node.nvlink_snapshot_path == dgx.node.roots.dev / "nvlink_stats"
    data = dgx.samples[1.0]["nvlink_kmod"]
    assert data.kind == "file" and data.serving
    assert data.snapshot.header.record_count == 8 * 18


# --------------------------------------------------------------------------------------------
# Faults


def test_root_port_contention(scratch: Path) -> None:
    run = run_scenario("root-port-contention", scratch / "contention", (1.0, 2.0, 15.0, 16.0))
    topo: Topology = run.samples[16.0]["pci"]
    by_bdf = {d.bdf: d for d in topo.devices}
    assert by_bdf["0000:19:00.0"].chain[0] == by_bdf["0000:18:00.0"].chain[0] == "0000:15:01.0"
    before_gpu = run.snapshot(1.0, 2.0).derived.gpu_rates
    during_gpu = run.snapshot(15.0, 16.0).derived.gpu_rates
    before_disk = run.snapshot(1.0, 2.0).derived.disk_rates
    during_disk = run.snapshot(15.0, 16.0).derived.disk_rates
    assert before_gpu and during_gpu and before_disk and during_disk
    assert before_gpu.gpus[0].pcie_rx_bytes_per_second == pytest.approx(3 * GB, rel=0.01)
    assert during_gpu.gpus[0].pcie_rx_bytes_per_second == pytest.approx(41 * GB, rel=0.01)
    assert during_gpu.gpus[1].pcie_rx_bytes_per_second == pytest.approx(3 * GB, rel=0.01)
    nvme0 = {d.device: d for d in during_disk.devices}["nvme0n1"]
    assert nvme0.rmb_s * 2**20 == pytest.approx(6.5 * GB, rel=0.01)
    assert {d.device: d for d in before_disk.devices}["nvme0n1"].rmb_s == 0.0
    assert run.samples[16.0]["nvml"].gpus[0].jpeg_util_percent == 85


def test_link_downtrained(scratch: Path) -> None:
    run = run_scenario("link-downtrained", scratch / "downtrained", (5.0, 11.0, 16.0))
    sysfs = run.node.roots.sysfs / "bus" / "pci" / "devices"
    assert (sysfs / "0000:5d:00.0" / "current_link_speed").read_text() == "2.5 GT/s PCIe\n"
    assert (sysfs / "0000:5d:00.0" / "max_link_speed").read_text() == "32.0 GT/s PCIe\n"
    assert (sysfs / "0000:5b:01.0" / "current_link_speed").read_text() == "2.5 GT/s PCIe\n"
    for t, gen in ((5.0, 5), (11.0, 1)):
        topo: Topology = run.samples[t]["pci"]
        gpu3 = {d.bdf: d for d in topo.devices}["0000:5d:00.0"]
        assert gpu3.link is not None and gpu3.link.current_generation == gen
        nvml: NvmlData = run.samples[t]["nvml"]
        assert (nvml.gpus[3].pcie_gen_current, nvml.gpus[3].pcie_gen_max) == (gen, 5)
    assert run.samples[11.0]["nvml"].gpus[6].pcie_width_current == 16
    assert run.samples[16.0]["nvml"].gpus[6].pcie_width_current == 8
    assert (sysfs / "0000:cb:00.0" / "current_link_width").read_text() == "8\n"


def test_xid79_falls_off_the_bus(scratch: Path) -> None:
    node = SimulatedNode(load_scenario("xid79-fell-off-bus"), scratch / "xid79")
    node.materialise()
    sources = {s.name: s for s in node.sources()}
    devices = node.roots.sysfs / "bus" / "pci" / "devices"
    try:
        node.advance_to(19.0)
        before: NvmlData = sources["nvml"].collect(node.roots)
        assert (devices / "0000:bb:00.0").exists() and len(before.gpus) == 8
        node.advance_to(20.0)
        handle = node.nvml.handle(5)
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            node.nvml.nvmlDeviceGetUUID(handle)
        node.nvml.nvmlDeviceGetUUID(node.nvml.handle(4))  # the others still answer
        assert not (devices / "0000:bb:00.0").exists()
        topo: Topology = sources["pci"].collect(node.roots)
        assert "0000:bb:00.0" not in {d.bdf for d in topo.devices}
        assert "0000:b9:01.0" in {d.bdf for d in topo.devices}  # its switch port remains
        deadline = time.monotonic() + 5.0
        while True:
            data: NvmlData = sources["nvml"].collect(node.roots)
            if any(x.gpu == 5 and x.xid == 79 for x in data.xids) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert [(x.gpu, x.xid, x.count) for x in data.xids] == [(5, 79, 1)]
        assert [lost.gpu for lost in data.lost] == [5]
        assert 5 not in [g.index for g in data.gpus]
    finally:
        for source in sources.values():
            source.close()


def test_allreduce_hang_on_an_nfs_lock(scratch: Path) -> None:
    run = run_scenario("allreduce-hang-nfs-lock", scratch / "hang", (10.0, 19.0, 25.0, 30.0))
    node = run.node
    procfs = node.roots.procfs
    writer, holder = node.pid_of("ckpt-writer"), node.pid_of("stale-rsync")
    locks = (procfs / "locks").read_text().splitlines()
    assert f"3: POSIX  ADVISORY  WRITE {holder} 00:34:4721 0 EOF" in locks
    assert f"3: -> POSIX  ADVISORY  WRITE {writer} 00:34:4721 0 EOF" in locks
    _, fields = _stat_fields((procfs / str(writer) / "stat").read_text())
    assert fields[0] == "D"
    assert (procfs / str(writer) / "wchan").read_text() == "rpc_wait_bit_killable"
    rank0 = node.pid_of("hang-rank", 0)
    assert (procfs / str(rank0) / "task" / str(rank0) / "wchan").read_text() == "futex_wait_queue"

    def lock_ops(text: str) -> list[int]:
        match = re.search(r"^\s+LOCK: (.*)$", text.split("/mnt/ckpt", 1)[1], re.MULTILINE)
        assert match is not None
        return [int(v) for v in match.group(1).split()]

    mountstats = (procfs / "self" / "mountstats").read_text()
    ops, _, _, _, _, _, _, _, errors = lock_ops(mountstats)
    assert ops == errors == 2  # 0.2/s of DENIED retries over 10 s
    util = [g.gpu_util_percent for g in run.samples[25.0]["nvml"].gpus]
    assert (
        util == [0] * 8 and [g.gpu_util_percent for g in run.samples[10.0]["nvml"].gpus] == [95] * 8
    )
    idle = run.snapshot(25.0, 30.0).derived.gpu_rates
    assert idle is not None and {g.pcie_rx_bytes_per_second for g in idle.gpus} == {0.0}


def test_escaped_nccl_threads(scratch: Path) -> None:
    run = run_scenario("escaped-nccl-threads", scratch / "escaped", (0.0,))
    node = run.node
    rank = node.pid_of("esc-rank", 1)
    cgroup = (node.roots.procfs / str(rank) / "cgroup").read_text()
    assert cgroup == "0::/user.slice/user-1109.slice/session-12.scope\n"
    tree: CgroupTree = run.samples[0.0]["cgroups"]
    paths = {c.path: c for c in tree.cgroups}
    job = "/system.slice/slurmstepd.scope/job_81750"
    assert paths[job].memory_max is not None and paths[job].memory_max.value is None
    step = paths[f"{job}/step_0"]
    assert step.memory_max is not None and step.memory_max.value == 128 * 2**30
    session = paths["/user.slice/user-1109.slice/session-12.scope"]
    assert session.nr_procs == 4 and session.nr_threads == 64
    assert (session.memory_current or 0) > 300 * 2**30 > (paths[job].memory_current or 0)


def test_hca_numa_mismatch(scratch: Path) -> None:
    run = run_scenario("hca-numa-mismatch", scratch / "numa", (0.0, 1.0))
    node = run.node
    environ = (node.roots.procfs / str(node.pid_of("numa-rank", 0)) / "environ").read_bytes()
    assert b"NCCL_IB_HCA=mlx5_6,mlx5_7\0" in environ and b"CUDA_VISIBLE_DEVICES=0\0" in environ
    topo: Topology = run.samples[1.0]["pci"]
    ib: InfinibandData = run.samples[1.0]["infiniband"]
    numa = {d.bdf: d.numa_node for d in topo.devices}
    hca_numa = {d.name: numa[d.pci_address or ""] for d in ib.devices}
    assert (numa["0000:19:00.0"], hca_numa["mlx5_6"], hca_numa["mlx5_0"]) == (0, 1, 0)
    rates = run.snapshot(0.0, 1.0).derived.ib_rates
    assert rates is not None
    assert rates.port("mlx5_6", 1).xmit_bytes_per_second == pytest.approx(22 * GB)  # type: ignore[union-attr]
    assert rates.port("mlx5_0", 1).xmit_bytes_per_second == 0.0  # type: ignore[union-attr]


def test_nvlink_bursts_average_out_over_a_poll(scratch: Path) -> None:
    run = run_scenario("nvlink-stall-bursts", scratch / "bursts", (3.0, 4.0))
    rates = run.snapshot(3.0, 4.0).derived.gpu_rates
    assert rates is not None
    assert rates.gpus[0].nvlinks[0].data_tx_bytes_per_second == pytest.approx(4 * GB, rel=0.01)
    # The nvlink_counter snapshot holds what the poll cannot see: 80 % in the burst samples.
    records = run.samples[4.0]["nvlink_kmod"].snapshot.records
    record = next(r for r in records if (r.device, r.link) == (0, 0))
    assert record.window_max_util / 65536 == pytest.approx(0.8, abs=1e-4)
