"""The lspci -vvv parser and the sysfs tree materialised from the HGX H100 capture.

pciutils' own ``lspci`` reading the materialised tree (``-A linux-sysfs -O sysfs.path=``) is
the oracle: it builds its tree from the sysfs directory nesting, and its ``-vvv`` output
must parse back to what the capture said.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.errors import ParseError
from nodescope.roots import Roots
from nodescope.sim.lspci import (
    BusNumbers,
    ExpressType,
    LspciDump,
    bridge_chains,
    parent_bridges,
    parse_lspci_vvv,
)
from nodescope.sim.sysfs_tree import (
    HGX_H100_CAPTURE,
    cached_hgx_h100_tree,
    cpus_of_sockets,
    speed_string,
)
from nodescope.sources.pci import read_topology

CAPTURE_TEXT = HGX_H100_CAPTURE.read_text()
needs_lspci = pytest.mark.skipif(shutil.which("lspci") is None, reason="pciutils not installed")


@pytest.fixture(scope="module")
def capture() -> LspciDump:
    return parse_lspci_vvv(CAPTURE_TEXT, str(HGX_H100_CAPTURE))


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cached_hgx_h100_tree(tmp_path_factory.getbasetemp() / "hgx-h100")


# --- the parser -------------------------------------------------------------------------------

HEADERS = [
    (
        "15:01.0 PCI bridge: Intel Corporation Device 352a (rev 04) (prog-if 00 [Normal decode])",
        ("0000:15:01.0", 0x060400, 0x8086, 0x352A, 0x04, True),
    ),
    (
        "18:00.0 Non-Volatile memory controller: Micron Technology Inc Device 51c3 (rev 01)"
        " (prog-if 02 [NVM Express])",
        ("0000:18:00.0", 0x010802, 0x1344, 0x51C3, 0x01, True),
    ),
    (
        "1a:00.0 Ethernet controller: Mellanox Technologies MT2910 Family [ConnectX-7]",
        ("0000:1a:00.0", 0x020000, 0x15B3, 0x1021, None, True),
    ),
    (  # -nn and -D: numbers shown, nothing inferred
        "0000:19:00.0 3D controller [0302]: NVIDIA Corporation GH100[H100 SXM5 80GB]"
        " [10de:2330] (rev a1)",
        ("0000:19:00.0", 0x030200, 0x10DE, 0x2330, 0xA1, False),
    ),
    (  # a subclass pci.ids does not name: lspci shows the code
        "00:00.4 Generic system peripheral [0807]: Intel Corporation Device 0b23",
        ("0000:00:00.4", 0x080700, 0x8086, 0x0B23, None, True),
    ),
    (
        "41:00.0 Processing accelerators: Acme Widgets Device 1234",
        ("0000:41:00.0", 0x120000, None, 0x1234, None, False),
    ),
]


@pytest.mark.parametrize(("line", "expected"), HEADERS)
def test_header_lines(line: str, expected: tuple[object, ...]) -> None:
    (dev,) = parse_lspci_vvv(line + "\n").devices
    got = (dev.bdf, dev.class_code, dev.vendor_id, dev.device_id, dev.revision, dev.ids_inferred)
    assert got == expected


def test_attributes_of_a_root_port() -> None:
    text = (
        "15:01.0 PCI bridge: Intel Corporation Device 352a (rev 04) (prog-if 00 [Normal decode])\n"
        "\tDeviceName: Root Port\n"
        "\tNUMA node: 1\n"
        "\tBus: primary=15, secondary=16, subordinate=1c, sec-latency=0\n"
        "\tCapabilities: [40] Express (v2) Root Port (Slot-), MSI 00\n"
        "\t\tLnkCap:\tPort #1, Speed 32GT/s, Width x16, ASPM not supported\n"
        "\t\tLnkSta:\tSpeed 16GT/s (downgraded), Width x8 (downgraded)\n"
        "\t\tLnkCap2: Supported Link Speeds: 2.5-32GT/s, Crosslink- Retimer+ 2Retimers+ DRS-\n"
        "\t\tLnkSta2: Current De-emphasis Level: -6dB, EqualizationComplete+\n"
        "\tCapabilities: [100 v2] Advanced Error Reporting\n"
        "\tKernel driver in use: pcieport\n"
    )
    (dev,) = parse_lspci_vvv(text).devices
    assert dev.numa_node == 1
    assert dev.bus == BusNumbers(0x15, 0x16, 0x1C)
    assert dev.express_type is ExpressType.ROOT_PORT
    assert (dev.link_cap_speed_gts, dev.link_cap_width) == (32.0, 16)
    assert (dev.link_sta_speed_gts, dev.link_sta_width) == (16.0, 8)
    assert dev.has_aer and dev.driver == "pcieport" and dev.is_bridge


def test_access_control_services_registers() -> None:
    text = (
        "17:01.0 PCI bridge: Broadcom / LSI PEX890xx PCIe Gen 5 Switch (rev b0)\n"
        "\tCapabilities: [40] Express (v2) Downstream Port (Slot+), MSI 00\n"
        "\tCapabilities: [148 v1] Access Control Services\n"
        "\t\tACSCap:\tSrcValid+ TransBlk+ ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- "
        "DirectTrans+\n"
        "\t\tACSCtl:\tSrcValid+ TransBlk- ReqRedir+ CmpltRedir- UpstreamFwd- EgressCtrl+ "
        "DirectTrans- NewFlag+\n"
        "18:00.0 Non-Volatile memory controller: Micron Technology Inc Device 51c3\n"
    )
    port, drive = parse_lspci_vvv(text).devices
    assert port.acs_capability == 0b1011111
    assert port.acs_control == 0b0100101  # a name lspci may add later is passed over
    assert (drive.acs_capability, drive.acs_control) == (None, None)


def test_old_link_status_and_express_types() -> None:
    text = (
        "03:00.0 Ethernet controller: Intel Corporation Device 1572\n"
        "\tCapabilities: [a0] Express (v1) Legacy Endpoint, MSI 00\n"
        "\t\tLnkSta:\tSpeed 2.5GT/s, Width x1, TrErr- Train- SlotClk+\n"
        "04:00.0 PCI bridge: Intel Corporation Device 1234\n"
        "\tCapabilities: [a0] Express (v2) Root Complex Event Collector, MSI 00\n"
        "05:00.0 PCI bridge: Intel Corporation Device 1234\n"
        "\tCapabilities: [a0] Express (v3) Something New, MSI 00\n"
    )
    a, b, c = parse_lspci_vvv(text).devices
    assert a.express_type is ExpressType.LEGACY_ENDPOINT
    assert (a.link_sta_speed_gts, a.link_sta_width) == (2.5, 1)
    assert b.express_type is ExpressType.RC_EVENT_COLLECTOR
    assert c.express_type is ExpressType.UNKNOWN


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("\tNUMA node: 0\n", 1),
        ("15:01.0 PCI bridge: x\nnot a header\n", 2),
        ("15:01.0 PCI bridge: x\n15:01.0 PCI bridge: x\n", 2),
        ("15:01.0 PCI bridge: x\n\tNUMA node: zero\n", 2),
        ("15:01.0 PCI bridge: x\n\tBus: primary=15, secondary=xx\n", 2),
        ("15:01.0 PCI bridge: x\n\t\tLnkCap:\tPort #1, ASPM not supported\n", 2),
        ("15:01.0 no class here\n", 1),
        ("15:01.0 PCI bridge: x\n\t\tACSCtl:\tSrcValid TransBlk- ReqRedir-\n", 2),
        (  # DirectTrans missing
            "15:01.0 PCI bridge: x\n\tNUMA node: 0\n\t\tACSCap:\tSrcValid+ TransBlk- "
            "ReqRedir- CmpltRedir- UpstreamFwd- EgressCtrl-\n",
            3,
        ),
    ],
)
def test_parse_errors_name_the_line(text: str, line: int) -> None:
    with pytest.raises(ParseError) as info:
        parse_lspci_vvv(text, "capture.txt")
    assert info.value.line == line and "capture.txt" in str(info.value)


def test_hierarchy_errors() -> None:
    two_claims = (
        "00:01.0 PCI bridge: x\n\tBus: primary=00, secondary=01, subordinate=01\n"
        "00:02.0 PCI bridge: x\n\tBus: primary=00, secondary=01, subordinate=01\n"
    )
    with pytest.raises(ParseError):
        parent_bridges(parse_lspci_vvv(two_claims))
    loop = (
        "01:00.0 PCI bridge: x\n\tBus: primary=01, secondary=02, subordinate=02\n"
        "02:00.0 PCI bridge: x\n\tBus: primary=02, secondary=01, subordinate=01\n"
    )
    with pytest.raises(ParseError):
        bridge_chains(parse_lspci_vvv(loop))


# --- the real capture -------------------------------------------------------------------------


def test_capture_as_parsed(capture: LspciDump) -> None:
    devices = capture.devices
    assert len(devices) == 517
    assert all(d.class_code is not None and d.vendor_id is not None for d in devices)
    assert all(d.device_id is not None for d in devices)
    types = collections.Counter(d.express_type for d in devices)
    assert types == {
        ExpressType.RC_INTEGRATED_ENDPOINT: 370,
        ExpressType.ENDPOINT: 43,
        ExpressType.DOWNSTREAM_PORT: 38,
        ExpressType.RC_EVENT_COLLECTOR: 20,
        ExpressType.ROOT_PORT: 11,
        ExpressType.UPSTREAM_PORT: 9,
        ExpressType.PCIE_TO_PCI_BRIDGE: 1,
        None: 25,  # conventional PCI functions of the chipset
    }
    gpus = [d for d in devices if (d.vendor_id, d.device_id) == (0x10DE, 0x2330)]
    assert [g.bdf for g in gpus] == [f"0000:{b}:00.0" for b in
                                     ("19", "3b", "4c", "5d", "9b", "bb", "cb", "db")]  # fmt: skip
    assert all(g.class_code == 0x030200 and g.driver == "nvidia" for g in gpus)
    assert collections.Counter(d.numa_node for d in devices) == {0: 261, 1: 256}
    nvme = [d for d in devices if d.class_code == 0x010802]
    assert len(nvme) == 8
    dsp = capture.device("0000:17:00.0")  # the port of a Gen4 drive: trained below its Gen5 cap
    assert (dsp.link_cap_speed_gts, dsp.link_sta_speed_gts, dsp.link_sta_width) == (32.0, 16.0, 4)


def test_capture_hierarchy(capture: LspciDump) -> None:
    chains = bridge_chains(capture)
    assert chains["0000:19:00.0"] == (
        "0000:15:01.0",
        "0000:16:00.0",
        "0000:17:01.0",
        "0000:19:00.0",
    )
    assert chains["0000:83:00.0"] == ("0000:80:01.0", "0000:81:00.0", "0000:82:00.0",
                                      "0000:83:00.0")  # fmt: skip
    assert chains["0000:00:00.0"] == ("0000:00:00.0",)
    # Each H100 shares its switch with one NVMe drive and at least one NIC.
    for gpu in ("19", "3b", "4c", "5d", "9b", "bb", "cb", "db"):
        usp = chains[f"0000:{gpu}:00.0"][1]
        below = [capture.device(b) for b, c in chains.items() if len(c) == 4 and c[1] == usp]
        classes = collections.Counter((d.class_code or 0) >> 8 for d in below)
        assert classes[0x0302] == 1 and classes[0x0108] == 1 and classes[0x0200] >= 1


# --- the materialised tree --------------------------------------------------------------------


def test_tree_layout(tree: Path) -> None:
    sys_dir = tree / "sys"
    gpu = sys_dir / "bus" / "pci" / "devices" / "0000:19:00.0"
    assert os.readlink(gpu) == (
        "../../../devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:01.0/0000:19:00.0"
    )
    real = Path(os.path.realpath(gpu))
    assert (real / "vendor").read_text() == "0x10de\n"
    assert (real / "device").read_text() == "0x2330\n"
    assert (real / "class").read_text() == "0x030200\n"
    assert (real / "current_link_speed").read_text() == "32.0 GT/s PCIe\n"
    assert (real / "max_link_width").read_text() == "16\n"
    assert (real / "numa_node").read_text() == "0\n"
    assert (real / "local_cpulist").read_text() == "0-55,112-167\n"
    assert (real / "aer_dev_correctable").read_text().endswith("TOTAL_ERR_COR 0\n")
    assert os.path.realpath(sys_dir / "class" / "nvme" / "nvme0" / "device").endswith(
        "/0000:18:00.0"
    )
    assert os.path.realpath(sys_dir / "class" / "infiniband" / "mlx5_0" / "device").endswith(
        "/0000:1a:00.0"
    )
    assert (sys_dir / "devices" / "system" / "node" / "node1" / "cpulist").read_text() == (
        "56-111,168-223\n"
    )
    rcep = Path(os.path.realpath(sys_dir / "bus" / "pci" / "devices" / "0000:00:00.0"))
    assert (rcep / "current_link_speed").read_text() == "Unknown\n"


def test_helpers() -> None:
    assert speed_string(2.5) == "2.5 GT/s PCIe" and speed_string(None) == "Unknown"
    assert cpus_of_sockets(2, 2, 2) == {0: (0, 1, 4, 5), 1: (2, 3, 6, 7)}


def test_reader_sees_the_captured_structure(capture: LspciDump, tree: Path) -> None:
    topo = read_topology(Roots.under(tree))
    chains = bridge_chains(capture)
    assert {d.bdf: d.chain for d in topo.devices} == chains
    for dev in capture.devices:
        got = topo.device(dev.bdf)
        assert (got.vendor_id, got.device_id, got.class_code) == (
            dev.vendor_id,
            dev.device_id,
            dev.class_code,
        )
        assert got.numa_node == dev.numa_node
        if dev.link_sta_speed_gts is not None:
            assert got.link is not None
            assert (got.link.current_speed_gts, got.link.current_width) == (
                dev.link_sta_speed_gts,
                dev.link_sta_width,
            )
            assert (got.link.max_speed_gts, got.link.max_width) == (
                dev.link_cap_speed_gts,
                dev.link_cap_width,
            )


_LSPCI_TOKEN = re.compile(
    r"\[(?P<domain>[0-9a-f]{4}):(?P<rootbus>[0-9a-f]{2})\]"
    r"|(?P<dev>[0-9a-f]{2})\.(?P<fn>[0-7])(?:-\[(?P<sec>[0-9a-f]{2})(?:-[0-9a-f]{2})?\])?"
)


def parse_lspci_tree(text: str) -> dict[str, str | None]:
    """BDF -> parent bridge BDF from ``lspci -tv`` drawing, by the columns children sit at."""
    parents: dict[str, str | None] = {}
    # (column after which children start, domain, bus of the children, bridge BDF)
    contexts: list[tuple[int, str, str, str | None]] = []
    for raw in text.splitlines():
        line = re.sub(r"([0-9a-f]{2}\.[0-7])  .*$", r"\1", raw)  # drop -v names
        for match in _LSPCI_TOKEN.finditer(line):
            start = match.start()
            contexts = [c for c in contexts if c[0] <= start]
            if match.group("domain"):
                contexts = [(match.end(), match.group("domain"), match.group("rootbus"), None)]
                continue
            _, domain, bus, bridge = contexts[-1]
            bdf = f"{domain}:{bus}:{match.group('dev')}.{match.group('fn')}"
            parents[bdf] = bridge
            if match.group("sec"):
                contexts.append((match.end(), domain, match.group("sec"), bdf))
    return parents


def _lspci(tree: Path, *args: str) -> str:
    sysfs_path = tree / "sys" / "bus" / "pci"
    result = subprocess.run(
        ["lspci", "-A", "linux-sysfs", "-O", f"sysfs.path={sysfs_path}", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return result.stdout


@needs_lspci
def test_lspci_tree_matches_the_capture(capture: LspciDump, tree: Path) -> None:
    drawn = parse_lspci_tree(_lspci(tree, "-tv"))
    assert drawn == parent_bridges(capture)
    assert drawn["0000:19:00.0"] == "0000:17:01.0"
    assert drawn["0000:17:01.0"] == "0000:16:00.0"
    assert drawn["0000:16:00.0"] == "0000:15:01.0"
    assert drawn["0000:15:01.0"] is None


@needs_lspci
def test_lspci_reads_back_what_the_capture_said(capture: LspciDump, tree: Path) -> None:
    readback = parse_lspci_vvv(_lspci(tree, "-vvv", "-nn", "-D"), "lspci readback")
    assert [d.bdf for d in readback.devices] == sorted(d.bdf for d in capture.devices)
    for dev in readback.devices:
        want = capture.device(dev.bdf)
        assert (dev.vendor_id, dev.device_id, dev.class_code, dev.revision) == (
            want.vendor_id,
            want.device_id,
            want.class_code,
            want.revision,
        ), dev.bdf
        assert dev.numa_node == want.numa_node
        assert dev.bus == want.bus
        assert dev.express_type == want.express_type
        assert (dev.link_cap_speed_gts, dev.link_cap_width) == (
            want.link_cap_speed_gts,
            want.link_cap_width,
        )
        assert (dev.link_sta_speed_gts, dev.link_sta_width) == (
            want.link_sta_speed_gts,
            want.link_sta_width,
        )
        assert dev.driver == want.driver
        assert (dev.acs_capability, dev.acs_control) == (want.acs_capability, want.acs_control)


def test_lspci_tree_drawing_parser() -> None:
    drawing = (
        "-+-[0000:00]-+-00.0  Intel Corporation Device 09a2\n"
        " |           \\-0c.0-[01]--+-00.0  Broadcom NetXtreme\n"
        " |                        \\-00.1  Broadcom NetXtreme\n"
        " \\-[0000:15]-+-00.0  Intel\n"
        "             \\-01.0-[16-17]----00.0-[17]--+-00.0  NVMe\n"
        "                                         \\-01.0  GPU\n"
    )
    assert parse_lspci_tree(drawing) == {
        "0000:00:00.0": None,
        "0000:00:0c.0": None,
        "0000:01:00.0": "0000:00:0c.0",
        "0000:01:00.1": "0000:00:0c.0",
        "0000:15:00.0": None,
        "0000:15:01.0": None,
        "0000:16:00.0": "0000:15:01.0",
        "0000:17:00.0": "0000:16:00.0",
        "0000:17:01.0": "0000:16:00.0",
    }


# --- fuzz -------------------------------------------------------------------------------------

_CAPTURE_LINES = CAPTURE_TEXT.splitlines()[:400]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.sampled_from(_CAPTURE_LINES),
            st.sampled_from(
                [
                    "",
                    "\tNUMA node: ",
                    "\tBus: primary=00, secondary=00, subordinate=00",
                    "\tBus: primary=01, secondary=01, subordinate=01",
                    "00:01.0 PCI bridge [0604]: x",
                    "\t\tLnkSta:\tSpeed 99GT/s, Width x99",
                    "\tCapabilities: [40] Express (v2) ",
                    "\t\tACSCtl:\tSrcValid+ ReqRedir",
                    "\t\tACSCap:\t",
                ]
            ),
            st.text(max_size=40),
        ),
        max_size=30,
    )
)
def test_lspci_parser_raises_only_parse_error(lines: list[str]) -> None:
    try:
        dump = parse_lspci_vvv("\n".join(lines), "fuzz")
        bridge_chains(dump)
    except ParseError:
        pass
