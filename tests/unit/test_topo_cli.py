"""`nodescope topo` on the HGX H100 tree and on this machine's capture."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
from pathlib import Path

import pytest

from nodescope.cli import topo
from nodescope.cli.main import build_parser
from nodescope.cli.topo import affinity_matrix, render_text, select_devices
from nodescope.model.topology import DeviceClass
from nodescope.roots import Roots
from nodescope.sim.fake_nvml import (
    HGX_H100_GPU_BUSES,
    HGX_H100_NVSWITCH_BUSES,
    FakeNvml,
    hgx_h100,
)
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


# --- NV# from the NVLink graph --------------------------------------------------------------


def _show(hgx_root: Path, nvml: FakeNvml | None, *flags: str) -> tuple[int, str]:
    args = build_parser().parse_args(["topo", *flags])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = topo.show(args, Roots.under(hgx_root), nvml)
    return status, out.getvalue()


def test_nvlink_cells_from_the_nvml_source(hgx_root: Path) -> None:
    status, text = _show(hgx_root, FakeNvml(hgx_h100()))
    assert status == 0
    cells, extra = _parse_table(text)
    gpus = [f"GPU{i}" for i in range(8)]
    for a in gpus:
        for b in gpus:
            assert cells[a][b] == ("X" if a == b else "NV18"), (a, b)
    # GPU-NIC and GPU-NVMe cells are the PCIe relations they were without NVML.
    assert cells["GPU0"]["NIC2"] == "PIX" and cells["NIC2"]["GPU0"] == "PIX"
    assert cells["GPU0"]["NVME0"] == "PIX"
    assert cells["GPU0"]["NIC5"] == "NODE"
    assert cells["NVME7"]["GPU0"] == "SYS"
    assert cells["NIC3"]["NIC4"] == "PIX"
    assert extra["GPU0"] == ["0-55,112-167", "0", "0000:15:01.0"]
    assert "  NV#  = Connection traversing a bonded set of # NVLinks" in text
    assert (
        "  GPU0: 18 of 18 links active; NVSwitch 0000:83:00.0 x5, 0000:84:00.0 x4, "
        "0000:85:00.0 x4, 0000:86:00.0 x5"
    ) in text


def test_the_sysfs_gpus_are_the_fake_nvml_gpus(hgx_root: Path) -> None:
    topo_ = read_topology(Roots.under(hgx_root))
    sysfs = [d.bdf for d in topo_.of_class(DeviceClass.GPU)]
    assert sysfs == [f"0000:{bus:02x}:00.0" for bus in HGX_H100_GPU_BUSES]
    switches = [d.bdf for d in topo_.of_class(DeviceClass.NVSWITCH)]
    assert switches == [f"0000:{bus:02x}:00.0" for bus in HGX_H100_NVSWITCH_BUSES]


def test_json_has_the_nv_counts(hgx_root: Path) -> None:
    gpus = hgx_h100()
    gpus[3].links[17].active = False
    status, out = _show(hgx_root, FakeNvml(gpus), "--json")
    assert status == 0
    data = json.loads(out)
    assert data["matrix"]["GPU0"]["GPU7"] == "NV18"
    assert data["matrix"]["GPU3"]["GPU0"] == "NV17"  # one of GPU3's links is down
    assert data["matrix"]["GPU0"]["NIC2"] == "PIX"
    nvlink = data["nvlink"]
    assert len(nvlink["pairs"]) == 28
    assert {"a": "GPU0", "b": "GPU1", "links": 18, "via": "nvswitch"} in nvlink["pairs"]
    assert {"a": "GPU3", "b": "GPU5", "links": 17, "via": "nvswitch"} in nvlink["pairs"]
    gpu3 = next(g for g in nvlink["gpus"] if g["label"] == "GPU3")
    assert (gpu3["bdf"], gpu3["nvml_index"], gpu3["links"], gpu3["active_links"]) == (
        "0000:5d:00.0", 3, 18, 17,
    )  # fmt: skip
    assert gpu3["switches"] == {
        "0000:83:00.0": 5, "0000:84:00.0": 4, "0000:85:00.0": 4, "0000:86:00.0": 4,
    }  # fmt: skip
    assert gpu3["peers"]["GPU0"] == 17
    assert [s["bdf"] for s in nvlink["nvswitches"]] == [
        "0000:83:00.0", "0000:84:00.0", "0000:85:00.0", "0000:86:00.0",
    ]  # fmt: skip
    assert {s["numa_node"] for s in nvlink["nvswitches"]} == {1}
    assert nvlink["unmatched"] == [] and nvlink["gpus_not_in_nvml"] == []


def test_a_lost_gpu_is_shown_by_pcie_alone(hgx_root: Path) -> None:
    gpus = hgx_h100()
    gpus[4].lost = True
    status, text = _show(hgx_root, FakeNvml(gpus))
    assert status == 0
    cells, _ = _parse_table(text)
    assert cells["GPU4"]["GPU7"] == "NODE" and cells["GPU0"]["GPU4"] == "SYS"
    assert cells["GPU0"]["GPU7"] == "NV18"
    assert "  GPU4: on PCI, not listed by NVML" in text


def test_without_nvml_the_table_is_what_sysfs_alone_shows(hgx_root: Path, table: str) -> None:
    status, text = _show(hgx_root, FakeNvml.no_driver())
    assert status == 0
    assert text == table
    assert "NVLinks (NVML)" not in text
    status, out = _show(hgx_root, FakeNvml.no_driver(), "--json")
    assert json.loads(out)["nvlink"] is None


def test_nvml_is_asked_only_for_this_hosts_own_sysfs(
    hgx_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[Roots] = []

    def fake_show(args: object, roots: Roots, nvml: object) -> int:
        asked.append(roots)
        return 0 if nvml is None else 7

    monkeypatch.setattr(topo, "show", fake_show)
    monkeypatch.setattr(topo, "_host_nvml", lambda: FakeNvml([]))
    assert topo.run(build_parser().parse_args(["topo", "--sysfs", str(hgx_root / "sys")])) == 0
    assert topo.run(build_parser().parse_args(["topo"])) == 7
    assert [r.sysfs for r in asked] == [hgx_root / "sys", Path("/sys")]


def test_scenario_excludes_root_flags(hgx_root: Path) -> None:
    result = _nodescope("topo", "--scenario", "dgx-h100", "--sysfs", str(hgx_root / "sys"))
    assert result.returncode == 2
    assert "--scenario brings its own roots; drop --sysfs" in result.stderr


def test_unknown_scenario_is_reported() -> None:
    result = _nodescope("topo", "--scenario", "no-such-scenario")
    assert result.returncode == 1
    assert "no bundled scenario 'no-such-scenario'" in result.stderr and result.stdout == ""


@pytest.mark.slow  # a DGX scenario's tree
def test_scenario_dgx_h100_is_nv18_with_the_pcie_relations_of_its_tree(tmp_path: Path) -> None:
    from nodescope.sim.node import SimulatedNode
    from nodescope.sim.scenario import load_scenario

    result = _nodescope("topo", "--json", "--scenario", "dgx-h100")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    # The same node's tree read without NVML: every cell but the GPU pairs must match.
    node = SimulatedNode(load_scenario("dgx-h100"), tmp_path / "node")
    node.materialise()
    plain = _nodescope("topo", "--json", "--sysfs", str(node.roots.sysfs))
    assert plain.returncode == 0, plain.stderr
    pcie = json.loads(plain.stdout)
    assert data["devices"] == pcie["devices"]
    kinds = {d["label"]: d["kind"] for d in data["devices"]}
    gpus = [label for label, kind in kinds.items() if kind == "gpu"]
    assert len(gpus) == 8
    for a, row in data["matrix"].items():
        for b, cell in row.items():
            if a != b and kinds[a] == kinds[b] == "gpu":
                assert cell == "NV18", (a, b)
            else:
                assert cell == pcie["matrix"][a][b], (a, b)
    # GPUs sit behind PCIe switches shared with NICs and NVMe drives.
    for gpu in gpus:
        near = {kinds[b] for b, cell in data["matrix"][gpu].items() if cell == "PIX"}
        assert {"nic", "nvme"} <= near, gpu
    assert len(data["nvlink"]["pairs"]) == 28
    assert {(p["links"], p["via"]) for p in data["nvlink"]["pairs"]} == {(18, "nvswitch")}
    assert len(data["nvlink"]["nvswitches"]) == 4
    assert data["nvlink"]["unmatched"] == [] and data["nvlink"]["gpus_not_in_nvml"] == []
    text = _nodescope("topo", "--scenario", "dgx-h100")
    assert text.returncode == 0, text.stderr
    cells, _ = _parse_table(text.stdout)
    assert {cells[a][b] for a in gpus for b in gpus if a != b} == {"NV18"}
