"""Peer-to-peer facts of the simulated node: each port's Access Control Services redirect in
its config space, and the GPUDirect kernel modules in ``/sys/module``.

Debian's ``lspci`` reading the materialised tree is the oracle for config space: it must print
the capture's ``ACSCtl:`` line for every function. The daemon's PCI source must then read the
same redirect bits, and a scenario's ``acs_redirect`` and ``kernel_modules`` must reach both.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from nodescope.errors import ParseError
from nodescope.model.topology import PortRole, Topology
from nodescope.roots import Roots
from nodescope.sim.lspci import ACS_FLAG_BITS, LspciDump, parse_lspci_vvv
from nodescope.sim.node import SimulatedNode, make_temp_root
from nodescope.sim.scenario import FORMAT, load_scenario, parse_scenario
from nodescope.sim.sysfs_tree import HGX_H100_CAPTURE, cached_hgx_h100_tree
from nodescope.sources.pci import parse_acs_redirect, read_topology

needs_lspci = pytest.mark.skipif(shutil.which("lspci") is None, reason="pciutils not installed")

#: GPU 0's switch downstream port: ``ReqRedir-`` in the capture.
GPU0_DOWNSTREAM_PORT = "0000:17:01.0"
#: A downstream port of the NVSwitch tray's switch: ``ReqRedir+ CmpltRedir+`` in the capture.
REDIRECTING_PORT = "0000:82:00.0"
#: GPU 0's switch upstream port: no ACS capability in the capture.
UPSTREAM_PORT_WITHOUT_ACS = "0000:16:00.0"
REQ_REDIR = ACS_FLAG_BITS["ReqRedir"]
REDIRECT_BITS = REQ_REDIR | ACS_FLAG_BITS["CmpltRedir"]
PORTS = (PortRole.ROOT_PORT, PortRole.DOWNSTREAM_PORT)


def lspci_vvv(root: Path, *args: str) -> str:
    result = subprocess.run(
        ["lspci", "-A", "linux-sysfs", "-O", f"sysfs.path={root / 'sys' / 'bus' / 'pci'}",
         "-vvv", "-D", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )  # fmt: skip
    return result.stdout


def acs_lines(text: str, label: str) -> dict[str, str]:
    """BDF (with domain) -> the text after ``<label>:`` of each function of an ``lspci -vvv``
    listing that has such a line."""
    lines: dict[str, str] = {}
    bdf = ""
    for line in text.splitlines():
        if line and not line[0].isspace():
            first = line.split(" ", 1)[0]
            bdf = first if first.count(":") == 2 else f"0000:{first}"
        elif line.strip().startswith(f"{label}:"):
            lines[bdf] = line.strip().removeprefix(f"{label}:").strip()
    return lines


@pytest.fixture(scope="module")
def capture_text() -> str:
    return HGX_H100_CAPTURE.read_text()


@pytest.fixture(scope="module")
def capture(capture_text: str) -> LspciDump:
    return parse_lspci_vvv(capture_text, str(HGX_H100_CAPTURE))


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cached_hgx_h100_tree(tmp_path_factory.getbasetemp() / "hgx-h100")


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    root = make_temp_root("nodescope-test-p2p-")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def capture_node(
    scratch: Path, name: str, functions: dict[str, Any], os_spec: dict[str, Any]
) -> SimulatedNode:
    """A node of the HGX H100 capture's PCIe tree alone (no GPUs, drives or jobs), with
    ``functions`` changed, materialised under ``scratch/name``."""
    document = {
        "format": FORMAT,
        "name": name,
        "duration_seconds": 1,
        "hardware": {
            "pcie": {"lspci": "hgx-h100", "functions": functions},
            "cpu": {"sockets": 2, "cores_per_socket": 56, "threads_per_core": 2},
            "os": {"background_processes": 0, **os_spec},
        },
    }
    node = SimulatedNode(parse_scenario(document, scratch / f"{name}.json"), scratch / name)
    node.materialise()
    return node


def port_redirects(topology: Topology) -> dict[str, bool | None]:
    return {d.bdf: d.acs_redirect for d in topology.devices if d.role in PORTS}


# --- the capture and the materialised tree -----------------------------------------------------


def test_capture_acs_registers(capture: LspciDump) -> None:
    with_acs = [d for d in capture.devices if d.acs_control is not None]
    assert len(with_acs) == 55
    assert all(d.acs_capability is not None for d in with_acs)
    port = capture.device(GPU0_DOWNSTREAM_PORT)
    # ACSCap: SrcValid+ TransBlk+ ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans+
    assert (port.acs_capability, port.acs_control) == (0b1011111, 0)
    assert capture.device(REDIRECTING_PORT).acs_control == 0b0011101
    assert capture.device(UPSTREAM_PORT_WITHOUT_ACS).acs_control is None


@needs_lspci
def test_lspci_prints_the_captured_acs_lines_for_every_function(
    capture_text: str, tree: Path
) -> None:
    readback = lspci_vvv(tree)
    for label in ("ACSCtl", "ACSCap"):
        want = acs_lines(capture_text, label)
        assert len(want) == 55
        assert acs_lines(readback, label) == want, label


def test_the_daemon_reads_each_ports_redirect(capture: LspciDump, tree: Path) -> None:
    topology = read_topology(Roots.under(tree))
    redirects = port_redirects(topology)
    assert len(redirects) == 49
    for bdf, redirect in redirects.items():
        control = capture.device(bdf).acs_control
        assert control is not None
        assert redirect is bool(control & ACS_FLAG_BITS["ReqRedir"]), bdf
    assert redirects[GPU0_DOWNSTREAM_PORT] is False
    assert redirects[REDIRECTING_PORT] is True
    assert not topology.skipped


# --- a scenario's acs_redirect and kernel_modules ----------------------------------------------


@pytest.fixture(scope="module")
def overridden(scratch: Path) -> SimulatedNode:
    return capture_node(
        scratch,
        "acs-overridden",
        {
            GPU0_DOWNSTREAM_PORT: {"acs_redirect": True},
            REDIRECTING_PORT: {"acs_redirect": False},
            UPSTREAM_PORT_WITHOUT_ACS: {"acs_redirect": True},
        },
        {"kernel_modules": ["nvidia_peermem"]},
    )


def test_acs_redirect_overrides_the_capture(capture: LspciDump, overridden: SimulatedNode) -> None:
    topology = read_topology(overridden.roots)
    redirects = port_redirects(topology)
    assert redirects[GPU0_DOWNSTREAM_PORT] is True
    assert redirects[REDIRECTING_PORT] is False
    others = {
        b: r for b, r in redirects.items() if b not in (GPU0_DOWNSTREAM_PORT, REDIRECTING_PORT)
    }
    assert all(
        r is bool((capture.device(b).acs_control or 0) & REQ_REDIR) for b, r in others.items()
    )
    functions = {d.bdf: d for d in overridden.hardware.pcie.devices}
    captured = capture.device(REDIRECTING_PORT)
    assert captured.acs_control is not None
    # Only the two redirect bits change.
    assert functions[REDIRECTING_PORT].acs_control == captured.acs_control & ~REDIRECT_BITS
    added = functions[UPSTREAM_PORT_WITHOUT_ACS]
    assert (added.acs_capability, added.acs_control) == (None, REDIRECT_BITS)


@needs_lspci
def test_lspci_shows_the_overridden_redirects(overridden: SimulatedNode) -> None:
    text = lspci_vvv(overridden.root)
    control = acs_lines(text, "ACSCtl")
    capability = acs_lines(text, "ACSCap")
    assert control[GPU0_DOWNSTREAM_PORT] == (
        "SrcValid- TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd- EgressCtrl- DirectTrans-"
    )
    assert control[REDIRECTING_PORT] == (
        "SrcValid+ TransBlk- ReqRedir- CmpltRedir- UpstreamFwd+ EgressCtrl- DirectTrans-"
    )
    # An upstream port the capture shows without ACS gets the capability.
    assert (
        capability[UPSTREAM_PORT_WITHOUT_ACS]
        == control[UPSTREAM_PORT_WITHOUT_ACS]
        == ("SrcValid- TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd- EgressCtrl- DirectTrans-")
    )
    assert len(control) == 56


def test_setting_a_redirect_the_capability_lacks_sets_it_there_too(tmp_path: Path) -> None:
    root_port = "0000:00:0c.0"  # ACSCap: SrcValid+ TransBlk+ ReqRedir- CmpltRedir- UpstreamFwd+
    document = {
        "format": FORMAT,
        "name": "root-port-redirect",
        "duration_seconds": 1,
        "hardware": {
            "pcie": {"lspci": "hgx-h100", "functions": {root_port: {"acs_redirect": True}}}
        },
    }
    captured = parse_lspci_vvv(HGX_H100_CAPTURE.read_text()).device(root_port)
    assert captured.acs_capability is not None and not captured.acs_capability & REDIRECT_BITS
    port = parse_scenario(document, tmp_path / "s.json").hardware.pcie.device(root_port)
    assert port.acs_capability == captured.acs_capability | REDIRECT_BITS
    assert port.acs_control == (captured.acs_control or 0) | REDIRECT_BITS


def test_kernel_modules_are_directories_in_sys_module(overridden: SimulatedNode) -> None:
    module = overridden.roots.sysfs / "module" / "nvidia_peermem"
    assert (module / "refcnt").read_text() == "0\n"
    assert read_topology(overridden.roots).peer_modules == {"nvidia_peermem"}


def test_no_kernel_modules_no_peer_modules(scratch: Path) -> None:
    node = capture_node(scratch, "no-modules", {}, {})
    assert not (node.roots.sysfs / "module").exists()
    topology = read_topology(node.roots)
    assert topology.peer_modules == frozenset()
    # Untouched, the scenario's tree reads as the capture's.
    assert all(r is not None for r in port_redirects(topology).values())


def test_the_bundled_baseline_loads_no_module() -> None:
    assert load_scenario("dgx-h100").hardware.os.kernel_modules == ()


@pytest.mark.parametrize(
    ("hardware", "pointer", "message"),
    [
        (
            {"os": {"kernel_modules": ["nvidia-peermem"]}},
            "/hardware/os/kernel_modules/0",
            "not a kernel module name",
        ),
        (
            {"os": {"kernel_modules": ["nvidia_fs", "nvidia_fs"]}},
            "/hardware/os/kernel_modules",
            "lists a module twice",
        ),
        ({"os": {"kernel_modules": "nvidia_fs"}}, "/hardware/os/kernel_modules", "an array"),
        (
            {"pcie": {"functions": {GPU0_DOWNSTREAM_PORT: {"acs_redirect": "yes"}}}},
            f"/hardware/pcie/functions/{GPU0_DOWNSTREAM_PORT}/acs_redirect",
            "true or false",
        ),
        (  # a conventional PCI function of the chipset: no extended capabilities
            {"pcie": {"functions": {"0000:00:1f.0": {"acs_redirect": True}}}},
            "/hardware/pcie/functions/0000:00:1f.0/acs_redirect",
            "no 'express' port type",
        ),
    ],
)
def test_bad_p2p_keys_are_reported_where_they_are(
    tmp_path: Path, hardware: dict[str, Any], pointer: str, message: str
) -> None:
    spec: dict[str, Any] = {"pcie": {"lspci": "hgx-h100"}}
    for key, value in hardware.items():
        spec[key] = {**spec.get(key, {}), **value}
    document = {"format": FORMAT, "name": "bad", "duration_seconds": 1, "hardware": spec}
    with pytest.raises(ParseError) as info:
        parse_scenario(document, tmp_path / "bad.json")
    assert f"{pointer}: " in str(info.value) and message in str(info.value)


# --- parse_acs_redirect ------------------------------------------------------------------------


def header(capability_id: int, next_offset: int, version: int = 1) -> bytes:
    return struct.pack("<I", capability_id | (version << 16) | (next_offset << 20))


def config_with(capabilities: dict[int, bytes], size: int = 4096) -> bytes:
    data = bytearray(size)
    for offset, content in capabilities.items():
        data[offset : offset + len(content)] = content
    return bytes(data)


def test_acs_found_second_in_the_list() -> None:
    aer, acs = 0x100, 0x148
    data = config_with(
        {
            aer: header(0x0001, acs, version=2),
            acs: header(0x000D, 0) + struct.pack("<HH", 0x005F, 0x001D),
        }
    )
    assert parse_acs_redirect(data) is True
    cleared = config_with(
        {aer: header(0x0001, acs), acs: header(0x000D, 0) + struct.pack("<HH", 0x005F, 0x0001)}
    )
    assert parse_acs_redirect(cleared) is False


def test_no_extended_capabilities_or_no_acs() -> None:
    assert parse_acs_redirect(bytes(64)) is None
    assert parse_acs_redirect(bytes(256)) is None
    assert parse_acs_redirect(bytes(4096)) is None
    assert parse_acs_redirect(b"\xff" * 4096) is None
    assert parse_acs_redirect(config_with({0x100: header(0x0001, 0)})) is None


@pytest.mark.parametrize(
    "capabilities",
    [
        {0x100: header(0x0001, 0x140), 0x140: header(0x0002, 0x100)},  # back to the start
        {0x100: header(0x0001, 0x100)},  # to itself
        {0x100: header(0x0001, 0x0FFC)},  # past the end for a header and a register
        {0x100: header(0x0001, 0x0142)},  # not dword-aligned
        {0x100: header(0x0001, 0x0040)},  # into conventional space
    ],
)
def test_broken_lists_raise_parse_error(capabilities: dict[int, bytes]) -> None:
    with pytest.raises(ParseError):
        parse_acs_redirect(config_with(capabilities), "config")


def check_outcome(data: bytes) -> bool | None:
    try:
        result = parse_acs_redirect(data, "fuzz")
    except ParseError:
        return None
    assert result is None or isinstance(result, bool)
    return result


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=4096))
def test_fuzz_random_bytes(data: bytes) -> None:
    check_outcome(data)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0x000, 0xFFF),  # where a header is put
            st.sampled_from([0x0001, 0x0002, 0x000D, 0x000B, 0xFFFF, 0x0000]),
            st.integers(0x000, 0xFFF),  # the next offset it names
            st.integers(0, 0xFFFF),  # the word after the capability register
        ),
        max_size=12,
    ),
    st.sampled_from([256, 260, 300, 1024, 4096]),
)
def test_fuzz_random_chains(entries: list[tuple[int, int, int, int]], size: int) -> None:
    data = bytearray(size)
    for offset, capability_id, next_offset, control in entries:
        record = header(capability_id, next_offset) + struct.pack("<HH", 0, control)
        data[offset : offset + 8] = record
        del data[size:]
    check_outcome(bytes(data))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0x100 // 4, 0xFF8 // 4), min_size=1, max_size=20, unique=True),
    st.lists(st.sampled_from([0x0001, 0x0002, 0x000B, 0x000D, 0x0010]), min_size=20, max_size=20),
    st.lists(st.integers(0, 0xFFFF), min_size=20, max_size=20),
)
def test_fuzz_well_formed_chains_find_the_first_acs(
    dwords: list[int], ids: list[int], controls: list[int]
) -> None:
    """A list that ends, at distinct aligned offsets in the file: the first ACS capability in
    list order is the one read, or ``None`` when there is none."""
    # The list starts at 0x100; at most one capability per id drawn.
    offsets = [0x100, *[d * 4 for d in dwords if d * 4 != 0x100]][: len(ids)]
    # Overlapping records are not a list a function could have.
    assume(all(abs(a - b) >= 8 for i, a in enumerate(offsets) for b in offsets[i + 1 :]))
    data = bytearray(4096)
    for index, offset in enumerate(offsets):
        following = offsets[index + 1] if index + 1 < len(offsets) else 0
        record = header(ids[index], following) + struct.pack("<HH", 0, controls[index])
        data[offset : offset + 8] = record
    want = next(
        (bool(controls[i] & REQ_REDIR) for i in range(len(offsets)) if ids[i] == 0x000D), None
    )
    assert parse_acs_redirect(bytes(data)) is want
