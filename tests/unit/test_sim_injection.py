"""Fault injection on the simulated node: each timeline activity that injects what operators
meet (error counters, pressure, per-job block I/O, process exits, processes outside the jobs,
GPUDirect flows), read back through the daemon's real sources.

Each test builds the small node of ``test_scenario.small_document`` (one GPU, drive and HCA
below one switch) with only its own activity, on a tmpfs when there is one.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodescope.errors import ParseError
from nodescope.sim.node import SimulatedNode, make_temp_root
from nodescope.sim.scenario import Scenario, ScenarioLoader
from nodescope.sources.cgroup import CgroupTree
from nodescope.sources.diskstats import DisksData
from nodescope.sources.infiniband import InfinibandData, port_rates
from nodescope.sources.nvml import NvmlData
from tests.unit.scenario_helpers import read_in_full
from tests.unit.test_scenario import small_document

JOB = "/system.slice/slurmstepd.scope/job_7"
STEP = f"{JOB}/step_0"
GPU_BDF = "0000:03:00.0"

_LOADER = ScenarioLoader()


@pytest.fixture
def scratch() -> Iterator[Path]:
    root = make_temp_root("nodescope-test-inject-")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def scenario(timeline: list[dict[str, Any]], **hardware: Any) -> Scenario:
    document = small_document()
    document.pop("expect")
    document["timeline"] = timeline
    document["hardware"]["pcie"]["functions"][GPU_BDF]["aer"] = True
    document["hardware"]["os"].update(hardware)
    return _LOADER.parse(document, Path("inject.json"))


def bad(timeline: list[dict[str, Any]], **hardware: Any) -> str:
    with pytest.raises(ParseError) as caught:
        scenario(timeline, **hardware)
    return str(caught.value)


class Run:
    """A node advanced to each of ``times`` with every source collected at each."""

    def __init__(self, root: Path, scenario: Scenario, times: tuple[float, ...]) -> None:
        self.node = SimulatedNode(scenario, root / "node")
        self.node.materialise()
        sources = read_in_full(self.node.sources())
        self.samples: dict[float, dict[str, Any]] = {}
        try:
            for t in times:
                self.node.advance_to(t)
                self.samples[t] = {s.name: s.collect(self.node.roots) for s in sources}
        finally:
            for source in sources:
                source.close()

    def rate(self, read: Any, t0: float, t1: float) -> float:
        return float(read(self.samples[t1]) - read(self.samples[t0])) / (t1 - t0)


def _nvml(sample: dict[str, Any]) -> NvmlData:
    data: NvmlData = sample["nvml"]
    return data


def _ib_counter(sample: dict[str, Any], name: str, hw: bool = False) -> int:
    """The value of mlx5_0 port 1's ``counters/<name>`` (``hw_counters/<name>`` with ``hw``)."""
    data: InfinibandData = sample["infiniband"]
    port = next(p for p in data.ports() if p.device == "mlx5_0" and p.port == 1)
    counter = port.hw_counter(name) if hw else port.counter(name)
    assert counter is not None
    return counter.value


def _cgroup(sample: dict[str, Any], path: str) -> Any:
    tree: CgroupTree = sample["cgroups"]
    cgroup = tree.get(path)
    assert cgroup is not None
    return cgroup


def _disk(sample: dict[str, Any]) -> Any:
    data: DisksData = sample["disks"]
    return next(d for d in data.disks if d.name == "nvme0n1")


# --------------------------------------------------------------------------------------------
# errors


def test_nvlink_error_counters_through_nvml(scratch: Path) -> None:
    run = Run(
        scratch,
        scenario(
            [
                {
                    "kind": "errors",
                    "from": 2,
                    "to": 6,
                    "gpu": 0,
                    "links": [1, 3],
                    "nvlink": {"crc_flit": 20.0, "crc_data": 2.5, "replay": 1.0, "recovery": 0.5},
                }
            ]
        ),
        (0.0, 2.0, 4.0, 8.0),
    )

    def errors(sample: dict[str, Any], link: int) -> dict[str, int]:
        return dict(_nvml(sample).gpus[0].nvlinks[link].errors)

    assert errors(run.samples[2.0], 1)["crc_flit"] == 0
    for link in (1, 3):
        at4, at8 = errors(run.samples[4.0], link), errors(run.samples[8.0], link)
        assert at4 == {"replay": 2, "recovery": 1, "crc_flit": 40, "crc_data": 5}
        # Over by t=6: 4 s of errors in all, and the counters never go back.
        assert at8 == {"replay": 4, "recovery": 2, "crc_flit": 80, "crc_data": 10}
    assert set(errors(run.samples[8.0], 0).values()) == {0}


def test_pcie_replays_through_nvml(scratch: Path) -> None:
    run = Run(
        scratch,
        scenario([{"kind": "errors", "gpu": 0, "pcie_replays_per_second": 12.5}]),
        (0.0, 2.0, 4.0),
    )
    assert run.rate(lambda s: _nvml(s).gpus[0].pcie_replays, 2.0, 4.0) == 12.5


def test_infiniband_error_counters(scratch: Path) -> None:
    rates = {
        "symbol_error": 3.0,
        "link_downed": 1.0,
        "port_rcv_errors": 2.0,
        "link_error_recovery": 0.5,
    }
    run = Run(
        scratch,
        scenario([{"kind": "errors", "ib": "mlx5_0", "port": 1, "counters": rates}]),
        (0.0, 2.0, 4.0),
    )
    for name, rate in rates.items():
        assert run.rate(lambda s, n=name: _ib_counter(s, n), 2.0, 4.0) == rate
    # The data counters are untouched by errors.
    assert run.rate(lambda s: _ib_counter(s, "port_rcv_data"), 2.0, 4.0) == 0


def test_infiniband_error_counters_saturate(scratch: Path) -> None:
    """PMA error counters stop at their width's maximum: link_downed is 8 bits."""
    run = Run(
        scratch,
        scenario([{"kind": "errors", "ib": "mlx5_0", "counters": {"link_downed": 100.0}}]),
        (0.0, 2.0, 4.0),
    )
    assert _ib_counter(run.samples[2.0], "link_downed") == 200
    assert _ib_counter(run.samples[4.0], "link_downed") == 255


def test_infiniband_any_counter_by_name_reaches_port_rates(scratch: Path) -> None:
    """An ``errors`` activity raises any counters/ error counter and any driver counter by
    name (here a congestion one the capture's port does not have); the daemon's source reads
    them on its full reads, and the rates reach PortRates by name, errors and congestion
    apart."""
    counters = {"port_xmit_discards": 200.0, "VL15_dropped": 1.0}
    hw = {"out_of_buffer": 40.0, "roce_adp_retrans": 3.0, "np_cnp_sent": 500.0}
    run = Run(
        scratch,
        scenario(
            [
                {
                    "kind": "errors",
                    "ib": "mlx5_0",
                    "counters": counters,
                    "hw_counters": hw,
                }
            ]
        ),
        (0.0, 2.0, 4.0),
    )
    for name, rate in counters.items():
        assert run.rate(lambda s, n=name: _ib_counter(s, n), 2.0, 4.0) == rate
    for name, rate in hw.items():
        assert run.rate(lambda s, n=name: _ib_counter(s, n, hw=True), 2.0, 4.0) == rate
    before, after = run.samples[2.0]["infiniband"], run.samples[4.0]["infiniband"]
    assert isinstance(before, InfinibandData) and isinstance(after, InfinibandData)
    # The sources read everything on every run here (SimulatedNode.sources' default).
    rates = port_rates(before, after, 2.0).port("mlx5_0", 1)
    assert rates is not None
    errors = {r.name: r.per_second for r in rates.errors}
    congestion = {r.name: r.per_second for r in rates.congestion}
    for name in ("port_xmit_discards", "VL15_dropped", "out_of_buffer", "roce_adp_retrans"):
        assert errors[name] == {**counters, **hw}[name], name
    assert congestion["np_cnp_sent"] == 500.0
    assert "np_cnp_sent" in {r.name for r in rates.congestion}
    assert "np_cnp_sent" not in {r.name for r in rates.errors}
    assert rates.rate("out_of_buffer") == 40.0


def test_hw_counters_schema() -> None:
    odd = {"kind": "errors", "ib": "mlx5_0", "hw_counters": {"Out Of Buffer": 1}}
    assert "is not a driver counter name" in bad([odd])
    assert "needs its target" in bad([{"kind": "errors", "gpu": 0, "hw_counters": {"x": 1}}])
    negative = {"kind": "errors", "ib": "mlx5_0", "hw_counters": {"out_of_buffer": -1}}
    assert "/timeline/0/hw_counters/out_of_buffer: must be >= 0" in bad([negative])


def test_aer_counters_through_the_pci_source(scratch: Path) -> None:
    aer = {"correctable": {"RxErr": 2.0, "BadTLP": 0.5}, "nonfatal": {"CmpltTO": 1.0}}
    run = Run(
        scratch,
        scenario([{"kind": "errors", "from": 1, "pci": GPU_BDF, "aer": aer}]),
        (0.0, 5.0),
    )
    records = {r.severity: r for r in run.samples[5.0]["pci"].device(GPU_BDF).aer}
    correctable = {c.name: c.value for c in records["correctable"].counters}
    assert correctable["RxErr"] == 8 and correctable["BadTLP"] == 2
    assert records["correctable"].total == sum(correctable.values()) == 10
    nonfatal = {c.name: c.value for c in records["nonfatal"].counters}
    assert nonfatal["CmpltTO"] == 4 and records["nonfatal"].total == 4
    assert records["fatal"].total == 0


def test_errors_schema_needs_exactly_one_target() -> None:
    both = {"kind": "errors", "gpu": 0, "ib": "mlx5_0"}
    assert "/timeline/0: names exactly one target" in bad([both])
    orphan = {"kind": "errors", "ib": "mlx5_0", "aer": {"correctable": {"RxErr": 1}}}
    assert "/timeline/0: needs its target" in bad([orphan])
    unknown = {"kind": "errors", "pci": GPU_BDF, "aer": {"correctable": {"Nope": 1}}}
    assert "/timeline/0/aer/correctable/Nope: unknown AER error" in bad([unknown])
    negative = {"kind": "errors", "gpu": 0, "nvlink": {"crc_flit": -1}}
    assert "/timeline/0/nvlink/crc_flit: must be >= 0, got -1" in bad([negative])


def test_errors_cross_references_are_checked() -> None:
    no_aer = {"kind": "errors", "pci": "0000:04:00.0", "aer": {"fatal": {"DLP": 1}}}
    assert "/timeline/0/pci: 0000:04:00.0 has no AER capability" in bad([no_aer])
    assert "/timeline/0/ib: no NIC 'mlx5_9'" in bad([{"kind": "errors", "ib": "mlx5_9"}])
    port = {"kind": "errors", "ib": "mlx5_0", "port": 2, "counters": {"symbol_error": 1}}
    assert "/timeline/0/port: mlx5_0 has 1 port(s)" in bad([port])
    link = {"kind": "errors", "gpu": 0, "links": [4], "nvlink": {"replay": 1}}
    assert "/timeline/0/links/0: must be in 0..3, got 4" in bad([link])


# --------------------------------------------------------------------------------------------
# pressure


def test_pressure_of_a_job_cgroup(scratch: Path) -> None:
    activity = {
        "kind": "pressure",
        "from": 2,
        "to": 6,
        "job": 7,
        "level": "step",
        "resource": "memory",
        "some_avg10": 40.0,
        "some_avg60": 25.0,
        "full_avg10": 10.0,
    }
    run = Run(scratch, scenario([activity]), (0.0, 3.0, 5.0, 8.0))
    for path in (STEP, JOB):
        during = _cgroup(run.samples[5.0], path).memory_pressure
        assert (during.some.avg10, during.some.avg60, during.some.avg300) == (40.0, 25.0, 40.0)
        assert during.full.avg10 == 10.0
        before = _cgroup(run.samples[3.0], path).memory_pressure
        # total: µs stalled, 40 % of each second for some, 10 % for full
        assert during.some.total_usec - before.some.total_usec == 800_000
        assert during.full.total_usec - before.full.total_usec == 200_000
        after = _cgroup(run.samples[8.0], path).memory_pressure
        assert after.some.avg10 == 0.0 and after.some.total_usec == 1_600_000
        assert _cgroup(run.samples[5.0], path).io_pressure.some.total_usec == 0
    # Not the job's other steps, not above the job.
    assert _cgroup(run.samples[5.0], f"{JOB}/step_batch").memory_pressure.some.total_usec == 0
    parent = _cgroup(run.samples[5.0], "/system.slice/slurmstepd.scope").memory_pressure
    assert parent.some.avg10 == 0.0


def test_pressure_full_above_some_is_rejected() -> None:
    activity = {"kind": "pressure", "job": 7, "resource": "io", "some_avg10": 5, "full_avg10": 9}
    assert "/timeline/0/full_avg10: must be <= some_avg10 (5)" in bad([activity])
    assert "/timeline/0/resource: must be one of" in bad(
        [{"kind": "pressure", "job": 7, "resource": "gpu"}]
    )
    assert "/timeline/0/job: no job 8" in bad([{"kind": "pressure", "job": 8, "resource": "io"}])


# --------------------------------------------------------------------------------------------
# per-job block I/O


def test_job_io_in_io_stat_and_diskstats(scratch: Path) -> None:
    activity = {
        "kind": "job_io",
        "job": 7,
        "device": "nvme0n1",
        "read_bytes_per_second": 2.5e8,
        "write_bytes_per_second": 1.31072e8,
    }
    run = Run(scratch, scenario([activity]), (0.0, 2.0, 4.0))
    for path in (STEP, JOB, "/system.slice"):

        def stat(sample: dict[str, Any], p: str = path) -> Any:
            return _cgroup(sample, p).io_stat.get("259:0")

        assert run.rate(lambda s, st=stat: st(s).rbytes, 2.0, 4.0) == 2.5e8
        assert run.rate(lambda s, st=stat: st(s).wbytes, 2.0, 4.0) == 1.31072e8
        assert run.rate(lambda s, st=stat: st(s).wios, 2.0, 4.0) == 1000
    assert _cgroup(run.samples[4.0], f"{JOB}/step_batch").io_stat.devices == ()
    # The same bytes reach the drive.
    # Whole sectors: within one sector a second.
    assert run.rate(lambda s: _disk(s).sectors_read * 512, 2.0, 4.0) == pytest.approx(
        2.5e8, abs=512
    )
    assert run.rate(lambda s: _disk(s).writes_completed, 2.0, 4.0) == 1000


def test_job_io_left_out_of_diskstats(scratch: Path) -> None:
    """A scenario whose ``disk`` activity already carries the drive's traffic charges it to the
    job without counting it twice on the drive."""
    activity = {
        "kind": "job_io",
        "job": 7,
        "level": "job",
        "device": "nvme0n1",
        "read_bytes_per_second": 1e8,
        "in_diskstats": False,
    }
    run = Run(scratch, scenario([activity]), (0.0, 1.0, 3.0))
    assert run.rate(lambda s: _cgroup(s, JOB).io_stat.get("259:0").rbytes, 1.0, 3.0) == 1e8
    assert _cgroup(run.samples[3.0], STEP).io_stat.devices == ()
    assert run.rate(lambda s: _disk(s).sectors_read, 0.0, 3.0) == 0


def test_job_io_names_a_drive() -> None:
    activity = {"kind": "job_io", "job": 7, "device": "nvme9n1"}
    assert "/timeline/0/device: no disk 'nvme9n1'" in bad([activity])


# --------------------------------------------------------------------------------------------
# process exit


def test_process_exit_removes_it_everywhere(scratch: Path) -> None:
    sc = scenario([{"kind": "process_exit", "from": 3, "process": "rank", "signal": "SIGKILL"}])
    run = Run(scratch, sc, (0.0, 2.0, 4.0))
    pid = run.node.pid_of("rank")
    writer = run.node.pid_of("writer")
    procfs = run.node.roots.procfs
    assert not (procfs / str(pid)).exists() and (procfs / str(writer)).exists()

    def listed(sample: dict[str, Any]) -> set[int]:
        return {p.pid for p in sample["procs"].processes}

    assert pid in listed(run.samples[2.0]) and pid not in listed(run.samples[4.0])
    assert writer in listed(run.samples[4.0])
    task = f"{STEP}/user/task_0"
    assert _cgroup(run.samples[2.0], task).nr_procs == 2
    assert _cgroup(run.samples[4.0], task).nr_procs == 1
    nvml = _nvml(run.samples[4.0]).gpus[0]
    assert [p.pid for p in _nvml(run.samples[2.0]).gpus[0].processes] == [pid]
    assert nvml.processes == ()


def test_process_exit_of_one_replica(scratch: Path) -> None:
    document_timeline = [{"kind": "process_exit", "from": 1, "process": "writer#0"}]
    run = Run(scratch, scenario(document_timeline), (0.0, 2.0))
    assert not (run.node.roots.procfs / str(run.node.pid_of("writer"))).exists()
    assert "/timeline/0/to: unknown key" in bad(
        [{"kind": "process_exit", "from": 1, "to": 2, "process": "writer"}]
    )
    assert "/timeline/0/process: no process 'nobody'" in bad(
        [{"kind": "process_exit", "process": "nobody"}]
    )


# --------------------------------------------------------------------------------------------
# processes outside every job


def test_system_processes_hold_locks(scratch: Path) -> None:
    system = [
        {
            "key": "backup",
            "comm": "rsync",
            "cmdline": "rsync -a /mnt/ckpt /backup",
            "state": "D",
            "wchan": "rpc_wait_bit_killable",
        },
        {"key": "flusher", "comm": "kworker/u8:2", "kernel": True, "cpu_percent": 50},
    ]
    lock = {
        "kind": "lock",
        "from": 1,
        "holder": "backup",
        "waiters": ["writer"],
        "mount": "/mnt/ckpt",
        "inode": 77,
    }
    run = Run(scratch, scenario([lock], system_processes=system), (0.0, 2.0))
    node = run.node
    backup, flusher = node.pid_of("backup"), node.pid_of("flusher")
    procfs = node.roots.procfs
    assert (procfs / str(backup) / "cgroup").read_text() == "0::/system.slice/backup.service\n"
    assert (procfs / str(flusher) / "cgroup").read_text() == "0::/\n"
    assert (procfs / str(flusher) / "cmdline").read_bytes() == b""
    assert (procfs / str(flusher) / "comm").read_text() == "kworker/u8:2\n"
    assert (procfs / str(backup) / "stat").read_text().split()[2] == "D"
    (contended,) = run.samples[2.0]["locks"].contended
    assert (contended.holder.pid, contended.holder.comm) == (backup, "rsync")
    assert [w.pid for w in contended.waiters] == [node.pid_of("writer")]
    # Outside every job: the job sources do not take it for a job's.
    assert backup not in {p.pid for p in run.samples[2.0]["procs"].processes}


def test_system_process_keys_are_unique() -> None:
    system = [{"key": "writer", "comm": "rsync"}]
    assert "/jobs/0/processes/1/key: process key 'writer' used twice" in bad(
        [], system_processes=system
    )
    assert "/hardware/os/system_processes/0/comm: must match" in bad(
        [], system_processes=[{"key": "x", "comm": "a-name-longer-than-15"}]
    )


# --------------------------------------------------------------------------------------------
# GPUDirect


def test_gpu_peer_rdma_counts_on_both_ends(scratch: Path) -> None:
    activity = {
        "kind": "gpu_peer",
        "gpu": 0,
        "peer": "mlx5_0",
        "to_gpu_bytes_per_second": 4e10,
        "from_gpu_bytes_per_second": 1e10,
    }
    run = Run(scratch, scenario([activity], kernel_modules=["nvidia_peermem"]), (0.0, 2.0, 4.0))

    def pcie(sample: dict[str, Any], direction: str) -> int:
        value = getattr(_nvml(sample).gpus[0], f"pcie_{direction}")
        return int(value.value)

    assert run.rate(lambda s: pcie(s, "rx"), 2.0, 4.0) == 4e10
    assert run.rate(lambda s: pcie(s, "tx"), 2.0, 4.0) == 1e10
    assert run.rate(lambda s: _ib_counter(s, "port_rcv_data") * 4, 2.0, 4.0) == 4e10
    assert run.rate(lambda s: _ib_counter(s, "port_xmit_data") * 4, 2.0, 4.0) == 1e10


def test_gpu_peer_storage_counts_on_the_drive(scratch: Path) -> None:
    activity = {
        "kind": "gpu_peer",
        "gpu": 0,
        "peer": "nvme0n1",
        "to_gpu_bytes_per_second": 5.12e9,
    }
    run = Run(scratch, scenario([activity], kernel_modules=["nvidia_fs"]), (0.0, 2.0, 4.0))
    assert run.rate(lambda s: int(_nvml(s).gpus[0].pcie_rx.value), 2.0, 4.0) == 5.12e9
    assert run.rate(lambda s: _disk(s).sectors_read * 512, 2.0, 4.0) == pytest.approx(
        5.12e9, abs=512
    )
    assert "/timeline/0/peer: no NIC or disk 'mlx5_7'" in bad(
        [{**copy.deepcopy(activity), "peer": "mlx5_7"}]
    )
