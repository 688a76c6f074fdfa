"""`nodescope topo` on the HGX H100 tree and on this machine's capture."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from nodescope.cli.topo import affinity_matrix, render_text, select_devices
from nodescope.roots import Roots
from nodescope.sim.sysfs_tree import cached_hgx_h100_tree
from nodescope.sources.pci import read_topology
from tests.conftest import HOST_FIXTURE, nodescope_command


def _nodescope(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*nodescope_command(), *args], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.fixture(scope="module")
def hgx_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cached_hgx_h100_tree(tmp_path_factory.getbasetemp() / "hgx-h100")


def _parse_table(text: str) -> tuple[dict[str, dict[str, str]], dict[str, list[str]]]:
    """(matrix cells by row and column label, the extra columns of each row)."""
    lines = text.splitlines()
    header = lines[0].split()
    labels = header[: header.index("CPU")]
    cells: dict[str, dict[str, str]] = {}
    extra: dict[str, list[str]] = {}
    for line in lines[1 : 1 + len(labels)]:
        fields = line.split()
        cells[fields[0]] = dict(zip(labels, fields[1 : 1 + len(labels)], strict=True))
        extra[fields[0]] = fields[1 + len(labels) :]
    return cells, extra


@pytest.fixture(scope="module")
def table(hgx_root: Path) -> str:
    result = _nodescope("topo", "--sysfs", str(hgx_root / "sys"))
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_table_cells(table: str) -> None:
    cells, extra = _parse_table(table)
    assert len(cells) == 8 + 14 + 8  # GPUs, NICs (12 mlx5 functions + 2 onboard), NVMe
    # GPU0 (19:00.0), NIC2 = mlx5_0 (1a:00.0) and NVME0 (18:00.0) share one switch.
    assert cells["GPU0"]["NIC2"] == "PIX"
    assert cells["NIC2"]["GPU0"] == "PIX"
    assert cells["GPU0"]["NVME0"] == "PIX"
    assert cells["NIC3"]["NIC4"] == "PIX"  # the two ports of a ConnectX-6 Dx
    # Root ports of one socket are each on their own host bridge: NODE; across sockets: SYS.
    assert cells["GPU0"]["GPU1"] == "NODE"
    assert cells["GPU0"]["NIC5"] == "NODE"
    assert cells["GPU0"]["GPU4"] == "SYS"
    assert cells["NVME7"]["GPU0"] == "SYS"
    assert cells["GPU4"]["GPU7"] == "NODE"
    assert all(cells[label][label] == "X" for label in cells)
    assert extra["GPU0"] == ["0-55,112-167", "0", "0000:15:01.0"]
    assert extra["GPU7"] == ["56-111,168-223", "1", "0000:d7:01.0"]


def test_table_is_grouped_by_root_port_and_has_legends(table: str) -> None:
    cells, extra = _parse_table(table)
    ports = [extra[label][-1] for label in cells]
    # Rows of one root port are contiguous, NUMA node 0 first.
    firsts = [p for i, p in enumerate(ports) if i == 0 or ports[i - 1] != p]
    assert len(firsts) == len(set(ports))
    assert list(cells)[2:7] == ["GPU0", "NIC2", "NIC3", "NIC4", "NVME0"]
    assert "  PIX  = Connection traversing at most a single PCIe bridge" in table
    assert "  NIC2: mlx5_0 (enp26s0np0)" in table
    assert "  NVME0: nvme0" in table
    assert (
        "  0000:15:01.0  NUMA 0  Gen5 x16  63.0 GB/s per direction  GPU0 NIC2 NIC3 NIC4 NVME0"
        in (table)
    )


def test_json(hgx_root: Path, table: str) -> None:
    result = _nodescope("topo", "--json", "--sysfs", str(hgx_root / "sys"))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    cells, _ = _parse_table(table)
    assert data["matrix"] == cells
    devices = {d["label"]: d for d in data["devices"]}
    assert devices["GPU0"] == {
        "label": "GPU0",
        "bdf": "0000:19:00.0",
        "kind": "gpu",
        "names": [],
        "numa_node": 0,
        "cpu_affinity": "0-55,112-167",
        "root_port": "0000:15:01.0",
        "switch": "0000:16:00.0",
    }
    assert devices["NIC2"]["names"] == ["mlx5_0", "enp26s0np0"]
    ports = {p["bdf"]: p for p in data["root_ports"]}
    port = ports["0000:97:01.0"]
    assert (port["numa_node"], port["generation"], port["width"]) == (1, 5, 16)
    assert port["capacity_bytes_per_s"] == pytest.approx(63.015e9, rel=1e-4)
    assert port["devices"] == ["GPU4", "NIC8", "NIC9", "NIC10", "NVME4"]
    assert data["legend"]["SYS"].startswith("Connection traversing PCIe as well as the SMP")


def test_nvlink_seam(hgx_root: Path) -> None:
    topo = read_topology(Roots.under(hgx_root))
    entries = select_devices(topo)
    gpus = [e.bdf for e in entries if e.kind == "gpu"]
    nvlinks = {frozenset((a, b)): 18 for a in gpus for b in gpus if a != b}
    matrix = affinity_matrix(topo, entries, nvlinks)
    text = render_text(topo, entries, matrix)
    cells, _ = _parse_table(text)
    assert cells["GPU0"]["GPU4"] == "NV18"
    assert cells["GPU0"]["GPU0"] == "X"
    assert cells["GPU0"]["NIC2"] == "PIX"


def test_this_machine(tmp_path: Path) -> None:
    result = _nodescope("topo", "--sysfs", str(HOST_FIXTURE / "sys"))
    assert result.returncode == 0, result.stderr
    cells, extra = _parse_table(result.stdout)
    assert cells == {"NIC0": {"NIC0": "X"}}
    assert extra["NIC0"] == ["0-1", "N/A", "N/A"]
    assert "  NIC0: 0000:00:03.0" in result.stdout


def test_unreadable_tree_is_reported(tmp_path: Path) -> None:
    result = _nodescope("topo", "--sysfs", str(tmp_path))
    assert result.returncode == 1
    assert "cannot read the PCI tree" in result.stderr and result.stdout == ""
