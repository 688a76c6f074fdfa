"""``nodescope.verdict``: findings and the daemon's alerts filed under the node's components.

The snapshot is a simulated DGX H100's (its PCI tree is the HGX H100 capture's), taken from a
replay, so the components are those a real 8-GPU node has: eight GPUs, the NVLink fabric, the
root ports with GPUs, NICs and NVMe below, ten RDMA ports, the disks and the jobs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.cli.check import Watch, _watch_scenario
from nodescope.model.disks import DISKS, DisksData
from nodescope.model.finding import Finding, Severity
from nodescope.model.nvml import NVML
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.model.topology import PCI, DeviceClass
from nodescope.verdict import Status, assess


def _action(kind: str, severity: Severity) -> str:
    return {Severity.CRITICAL: "drain", Severity.WARNING: "alert"}.get(severity, "none")


@pytest.fixture(scope="module")
def node() -> Snapshot:
    snapshot = _watch_scenario("dgx-h100", 4.0, Watch())
    assert snapshot is not None
    return snapshot


def _component(verdict: Any, category: str, name: str) -> Any:
    return next(c for c in verdict.components if (c.category, c.name) == (category, name))


def test_a_quiet_node_lists_every_part_as_healthy(node: Snapshot) -> None:
    verdict = assess(node, (), _action)
    assert verdict.status is Status.HEALTHY
    nvml = node.latest(NVML)
    assert nvml is not None
    gpus = [c for c in verdict.components if c.category == "gpu"]
    assert [c.name for c in gpus] == [str(g.index) for g in nvml.gpus]
    assert len(gpus) == 8
    topology = node.latest(PCI)
    assert topology is not None
    ports = {c.name for c in verdict.components if c.category == "pcie"}
    # Every root port with a GPU below it is a component of its own.
    for gpu in topology.of_class(DeviceClass.GPU):
        assert gpu.root_port in ports
    assert any(c.category == "infiniband" for c in verdict.components)
    assert any(c.category == "fabric" for c in verdict.components)
    assert all(c.status is Status.HEALTHY for c in verdict.components)


def test_a_critical_finding_fails_its_gpu_and_the_node(node: Snapshot) -> None:
    finding = Finding(
        "gpu_xid_hardware", Severity.CRITICAL, {"gpu": "3", "xid": "79"}, {"count": 1.0}, "Xid 79"
    )
    verdict = assess(node, [finding], _action)
    assert verdict.status is Status.FAILED
    gpu3 = _component(verdict, "gpu", "3")
    assert gpu3.status is Status.FAILED
    assert [(c.kind, c.action) for c in gpu3.concerns] == [("gpu_xid_hardware", "drain")]
    assert _component(verdict, "gpu", "2").status is Status.HEALTHY


def test_a_warning_degrades_and_info_is_shown_but_healthy(node: Snapshot) -> None:
    warning = Finding("pcie_link_downtrained", Severity.WARNING, {"gpu": "1"}, {}, "x8")
    info = Finding("ib_xmit_wait", Severity.INFO, {"hca": "mlx5_0", "port": "1"}, {}, "wait")
    verdict = assess(node, [warning, info], _action)
    assert verdict.status is Status.DEGRADED
    port = _component(verdict, "infiniband", "mlx5_0/1")
    assert port.status is Status.HEALTHY
    assert [c.kind for c in port.concerns] == ["ib_xmit_wait"]


def test_pci_findings_go_to_the_gpu_at_that_address_or_the_root_port_above(
    node: Snapshot,
) -> None:
    nvml = node.latest(NVML)
    topology = node.latest(PCI)
    assert nvml is not None and topology is not None
    gpu = nvml.gpus[2]
    nvme = topology.of_class(DeviceClass.NVME)[0]
    findings = [
        Finding("pcie_aer_errors", Severity.WARNING, {"device": gpu.pci_address}, {}, "aer"),
        Finding("pcie_aer_errors", Severity.CRITICAL, {"device": nvme.bdf}, {}, "fatal"),
    ]
    verdict = assess(node, findings, _action)
    assert _component(verdict, "gpu", str(gpu.index)).status is Status.DEGRADED
    assert nvme.root_port is not None
    assert _component(verdict, "pcie", nvme.root_port).status is Status.FAILED


def test_fabric_job_and_unknown_subjects_each_have_a_place(node: Snapshot) -> None:
    findings = [
        Finding("nvlink_errors", Severity.WARNING, {"gpu": "0", "nvlink": "3"}, {}, "crc"),
        Finding("job_oom_kill", Severity.WARNING, {"job": "424242"}, {}, "oom"),
        Finding("gpu_xid_unknown_device", Severity.WARNING, {}, {}, "xid"),
        Finding("something_new", Severity.WARNING, {"what": "x"}, {}, "new"),
    ]
    verdict = assess(node, findings, _action)
    assert _component(verdict, "fabric", "nvlink").status is Status.DEGRADED
    # The fabric's kinds are the fabric's even when they name a GPU.
    assert _component(verdict, "gpu", "0").status is Status.HEALTHY
    assert _component(verdict, "jobs", "424242").title == "Job 424242"
    assert _component(verdict, "kernel_log", "kmsg").status is Status.DEGRADED
    assert _component(verdict, "node", "node").status is Status.DEGRADED


def test_the_daemons_firing_alerts_count_and_pending_ones_do_not(node: Snapshot) -> None:
    alerts = [
        {
            "state": "firing",
            "kind": "job_stalled_on_storage",
            "severity": "critical",
            "subjects": {"job": "7"},
            "message": "stalled",
            "evidence_last": {"seconds": 40, "bad": "x"},
        },
        {"state": "pending", "kind": "pcie_contention", "severity": "warning", "subjects": {}},
    ]
    verdict = assess(node, (), _action, alerts)
    job = _component(verdict, "jobs", "7")
    assert job.status is Status.FAILED
    (concern,) = job.concerns
    assert (concern.origin, concern.action, dict(concern.evidence)) == (
        "daemon",
        "drain",
        {"seconds": 40.0},
    )
    assert verdict.status is Status.FAILED


def test_gpus_on_the_bus_without_nvml_fail_the_node(node: Snapshot) -> None:
    nvml_sample = node.current[NVML.name]
    down = dataclasses.replace(nvml_sample, data=None, error="NVML unavailable")
    snapshot = dataclasses.replace(
        node, current={**node.current, NVML.name: down}, previous={}, figures=None
    )
    verdict = assess(snapshot, (), _action)
    (gpus,) = [c for c in verdict.components if c.category == "gpu"]
    assert gpus.status is Status.FAILED
    assert gpus.concerns[0].kind == "gpu_driver_unavailable"
    assert "8 NVIDIA GPU(s)" in gpus.concerns[0].message


def test_a_source_down_is_a_part_not_checked(node: Snapshot) -> None:
    name = next(n for n in node.current if n != NVML.name)
    sample: SourceSample = node.current[name]
    down = dataclasses.replace(sample, data=None, error="boom")
    snapshot = dataclasses.replace(
        node, current={**node.current, name: down}, previous={}, figures=None
    )
    verdict = assess(snapshot, (), _action)
    assert verdict.status is Status.DEGRADED
    assert dict(verdict.sources_down) == {name: "boom"}
    assert "boom" in (_component(verdict, "node", "node").unchecked or "")


_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=10,
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.dictionaries(st.text(max_size=12), _values, max_size=6), max_size=4))
def test_any_alerts_document_is_taken_or_skipped_never_a_crash(
    node: Snapshot, alerts: list[dict[str, Any]]
) -> None:
    verdict = assess(node, (), _action, alerts)
    assert verdict.status in tuple(Status)


def test_disks_name_the_hardware_in_natural_order_and_count_virtual_ones(
    node: Snapshot,
) -> None:
    sample = node.current[DISKS.name]
    assert isinstance(sample.data, DisksData)
    stat = sample.data.disks[0]
    # A host with a dozen attached loop images beside ten NVMe drives and a zram swap.
    names = [f"loop{i}" for i in range(12)] + [f"nvme{i}n1" for i in range(10)] + ["zram0"]
    disks = tuple(dataclasses.replace(stat, name=name) for name in names)
    data = dataclasses.replace(sample.data, disks=disks)
    snapshot = dataclasses.replace(
        node,
        current={**node.current, DISKS.name: dataclasses.replace(sample, data=data)},
        previous={},
        figures=None,
    )
    (line,) = _component(assess(snapshot, (), _action), "disks", "disks").facts
    assert line == (
        "nvme0n1, nvme1n1, nvme2n1, nvme3n1, nvme4n1, nvme5n1, nvme6n1, nvme7n1 and 2 more;"
        " virtual: 12 loop, 1 zram"
    )
