"""The pci source: sysfs parsers, the tree reader and its cache, and the pci metrics."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.errors import ParseError
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.model.topology import DeviceClass, PortRole, Topology, path_to_root
from nodescope.roots import Roots
from nodescope.sim.lspci import parse_lspci_vvv
from nodescope.sim.sysfs_tree import materialise
from nodescope.sources import pci as pci_module
from nodescope.sources.pci import (
    SLOW_EVERY,
    PciSource,
    make_source,
    parse_aer,
    parse_class,
    parse_cpulist,
    parse_device_path,
    parse_hex_id,
    parse_link_speed,
    parse_link_width,
    parse_numa_node,
    parse_runtime_status,
    read_topology,
)
from nodescope.sources.registry import SOURCES, SourceInputs
from nodescope.sources.udev import UdevSource
from nodescope_exporters import pci_metrics
from nodescope_exporters.prometheus import render
from tests.conftest import HOST_FIXTURE as FIXTURE_HOST

# --- parsers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("32.0 GT/s PCIe\n", 32.0),
        ("2.5 GT/s PCIe\n", 2.5),
        ("64.0 GT/s PCIe", 64.0),
        ("8 GT/s\n", 8.0),  # Linux <= 5.6
        ("5 GT/s", 5.0),
        ("Unknown\n", None),
    ],
)
def test_parse_link_speed(text: str, expected: float | None) -> None:
    assert parse_link_speed(text) == expected


@pytest.mark.parametrize("text", ["", "fast", "32.0 GB/s PCIe", "GT/s", "32.0 GT/s PCIe\nx"])
def test_parse_link_speed_rejects(text: str) -> None:
    with pytest.raises(ParseError) as info:
        parse_link_speed(text, "/sys/x/current_link_speed")
    assert "/sys/x/current_link_speed" in str(info.value)


def test_parse_width_ids_class_numa() -> None:
    assert parse_link_width("16\n") == 16
    assert parse_link_width("0\n") == 0
    assert parse_hex_id("0x10de\n") == 0x10DE
    assert parse_class("0x030200\n") == 0x030200
    assert parse_numa_node("1\n") == 1
    assert parse_numa_node("-1\n") is None
    for bad, fn in [
        ("x16", parse_link_width),
        ("10de", parse_hex_id),
        ("0x10000", parse_hex_id),
        ("0x1000000", parse_class),
        ("-2", parse_numa_node),
        ("node0", parse_numa_node),
    ]:
        with pytest.raises(ParseError):
            fn(bad, "f")  # type: ignore[operator]


def test_parse_cpulist() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpulist("\n") == ()
    assert len(parse_cpulist("0-55,112-167")) == 112
    for bad in ("3-1", "a", "0-", "1,,2", "0-99999"):
        with pytest.raises(ParseError):
            parse_cpulist(bad, "local_cpulist")


AER_6_12 = """RxErr 2
BadTLP 0
BadDLLP 1
Rollover 0
Timeout 0
NonFatalErr 0
CorrIntErr 0
HeaderOF 0
TOTAL_ERR_COR 4
"""

#: The sample of Documentation/ABI/testing/sysfs-bus-pci-devices-aer_stats (multi-word names).
AER_ABI_SAMPLE = """Receiver Error 2
Bad TLP 0
Bad DLLP 0
RELAY_NUM Rollover 0
Replay Timer Timeout 0
Advisory Non-Fatal 0
Corrected Internal Error 0
Header Log Overflow 0
TOTAL_ERR_COR 2
"""


def test_parse_aer_6_12_names() -> None:
    record = parse_aer(AER_6_12, "correctable")
    assert record.severity == "correctable"
    assert record.total == 4  # the TOTAL line, not the sum of the types (3)
    assert [(c.name, c.value) for c in record.counters][:3] == [
        ("RxErr", 2),
        ("BadTLP", 0),
        ("BadDLLP", 1),
    ]


def test_parse_aer_multi_word_names_and_unnamed_bits() -> None:
    record = parse_aer(AER_ABI_SAMPLE, "correctable")
    assert record.counters[0].name == "Receiver Error"
    assert record.counters[3].name == "RELAY_NUM Rollover"
    assert record.total == 2
    fatal = parse_aer("Undefined 0\ndev_fatal_errs_bit[26] 3\nTOTAL_ERR_FATAL 3\n", "fatal")
    assert fatal.counters[1].name == "dev_fatal_errs_bit[26]" and fatal.counters[1].value == 3


def test_parse_aer_rejects() -> None:
    with pytest.raises(ParseError) as info:
        parse_aer("RxErr 1\nBadTLP lots\n", "correctable", "aer_dev_correctable")
    assert info.value.line == 2
    with pytest.raises(ParseError):
        parse_aer("TOTAL_ERR_FATAL 1\n", "correctable")
    with pytest.raises(ParseError):
        parse_aer("RxErr 1\n", "severe")


def test_parse_device_path() -> None:
    assert parse_device_path("devices/pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:02.0") == (
        "pci0000:17",
        ("0000:17:01.0", "0000:18:00.0", "0000:19:02.0"),
    )
    # Behind a VMD controller the NVMe drive belongs to the VMD's own domain.
    vmd = "devices/pci0000:00/0000:00:0e.0/pci10000:e0/10000:e0:1a.0/10000:e1:00.0"
    assert parse_device_path(vmd) == ("pci10000:e0", ("10000:e0:1a.0", "10000:e1:00.0"))
    for bad in ("devices/platform/foo", "devices/pci0000:00", "devices/pci0000:00/0000:00:01.0/x"):
        with pytest.raises(ParseError):
            parse_device_path(bad)


def test_parse_runtime_status() -> None:
    assert parse_runtime_status("suspended\n") == "suspended"
    with pytest.raises(ParseError):
        parse_runtime_status("asleep\n")


PARSERS = [
    parse_link_speed,
    parse_link_width,
    parse_hex_id,
    parse_class,
    parse_numa_node,
    parse_cpulist,
    parse_device_path,
    parse_runtime_status,
    lambda text, source: parse_aer(text, "nonfatal", source),
]

_SYSFS_ALPHABET = st.sampled_from(list("0123456789abcdefx-,:./ \nGTsPCIeUnknowTOAL_ER"))


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(range(len(PARSERS))),
    st.one_of(st.text(max_size=60), st.text(_SYSFS_ALPHABET, max_size=60)),
)
def test_parsers_raise_only_parse_error(index: int, text: str) -> None:
    with contextlib.suppress(ParseError):
        PARSERS[index](text, "fuzz")  # type: ignore[operator]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.one_of(st.sampled_from(["RxErr", "Bad TLP", "TOTAL_ERR_NONFATAL", ""]), st.text()),
            st.integers(min_value=0, max_value=2**66),
        ),
        max_size=6,
    )
)
def test_aer_fuzz_structured(lines: list[tuple[str, int]]) -> None:
    text = "".join(f"{name} {value}\n" for name, value in lines)
    try:
        record = parse_aer(text, "nonfatal")
    except ParseError:
        return
    assert all(0 <= c.value < 2**64 for c in record.counters)


# --- reader on this machine's capture ---------------------------------------------------------


def test_reads_the_kvm_guest_capture() -> None:
    topo = read_topology(Roots.under(FIXTURE_HOST))
    assert [d.bdf for d in topo.devices] == [f"0000:00:0{i}.0" for i in range(6)]
    assert [r.name for r in topo.roots] == ["pci0000:00"]
    net = topo.device("0000:00:03.0")
    assert (net.vendor_id, net.device_id, net.class_code) == (0x1AF4, 0x1041, 0x020000)
    assert net.device_class is DeviceClass.ETHERNET
    # A flat virtual bus: every function sits on the root bus, no links, no NUMA affinity.
    assert all(d.role is PortRole.RC_INTEGRATED_ENDPOINT for d in topo.devices)
    assert all(d.root_port is None and d.link is None for d in topo.devices)
    assert all(d.numa_node is None and d.local_cpus == (0, 1) for d in topo.devices)
    assert [(n.node, n.cpus) for n in topo.numa_nodes] == [(0, (0, 1))]


def test_registry_names_the_source() -> None:
    source = SOURCES["pci"].make()
    assert isinstance(source, PciSource) and source.name == "pci"
    source.close()


# --- reader on a small materialised tree ------------------------------------------------------

MINI_LSPCI = """\
15:01.0 PCI bridge: Intel Corporation Device 352a (rev 04) (prog-if 00 [Normal decode])
\tNUMA node: 0
\tBus: primary=15, secondary=16, subordinate=19, sec-latency=0
\tCapabilities: [40] Express (v2) Root Port (Slot-), MSI 00
\t\tLnkCap:\tPort #1, Speed 32GT/s, Width x16, ASPM not supported
\t\tLnkSta:\tSpeed 32GT/s (ok), Width x16 (ok)
\tCapabilities: [100 v2] Advanced Error Reporting

16:00.0 PCI bridge: Broadcom / LSI PEX890xx PCIe Gen 5 Switch (rev b0) (prog-if 00 [Normal decode])
\tNUMA node: 0
\tBus: primary=16, secondary=17, subordinate=19, sec-latency=0
\tCapabilities: [68] Express (v2) Upstream Port, MSI 00
\t\tLnkCap:\tPort #0, Speed 32GT/s, Width x16, ASPM L1
\t\tLnkSta:\tSpeed 32GT/s (ok), Width x16 (ok)

17:00.0 PCI bridge: Broadcom / LSI PEX890xx PCIe Gen 5 Switch (rev b0) (prog-if 00 [Normal decode])
\tNUMA node: 0
\tBus: primary=17, secondary=18, subordinate=18, sec-latency=0
\tCapabilities: [68] Express (v2) Downstream Port (Slot+), MSI 00
\t\tLnkCap:\tPort #0, Speed 32GT/s, Width x16, ASPM L1
\t\tLnkSta:\tSpeed 32GT/s (ok), Width x16 (ok)

17:01.0 PCI bridge: Broadcom / LSI PEX890xx PCIe Gen 5 Switch (rev b0) (prog-if 00 [Normal decode])
\tNUMA node: 0
\tBus: primary=17, secondary=19, subordinate=19, sec-latency=0
\tCapabilities: [68] Express (v2) Downstream Port (Slot+), MSI 00
\t\tLnkCap:\tPort #1, Speed 32GT/s, Width x16, ASPM L1
\t\tLnkSta:\tSpeed 32GT/s (ok), Width x16 (ok)

18:00.0 3D controller: NVIDIA Corporation Device 2330 (rev a1)
\tNUMA node: 0
\tCapabilities: [60] Express (v2) Endpoint, MSI 00
\t\tLnkCap:\tPort #0, Speed 32GT/s, Width x16, ASPM L1
\t\tLnkSta:\tSpeed 32GT/s (ok), Width x16 (ok)
\tCapabilities: [1b8 v2] Advanced Error Reporting
\tKernel driver in use: nvidia

19:00.0 Ethernet controller: Mellanox Technologies MT2910 Family [ConnectX-7]
\tNUMA node: 0
\tCapabilities: [60] Express (v2) Endpoint, MSI 00
\t\tLnkCap:\tPort #0, Speed 32GT/s, Width x16, ASPM not supported
\t\tLnkSta:\tSpeed 32GT/s (ok), Width x16 (ok)
\tCapabilities: [100 v1] Advanced Error Reporting
\tKernel driver in use: mlx5_core
"""


@pytest.fixture
def mini() -> Iterator[Path]:
    # A short root of its own rather than tmp_path: a skipped attribute's example is its path
    # cut at EXAMPLE_CHARS, and the tests find the attribute's name in it, whatever the name
    # of the test run's temporary directory (a worker's adds "popen-gwN/").
    with tempfile.TemporaryDirectory(prefix="ns-pci-") as root:
        dump = parse_lspci_vvv(MINI_LSPCI, "mini")
        materialise(dump, Path(root), {0: (0, 1, 2, 3)})
        yield Path(root)


def _dir(root: Path, bdf: str) -> Path:
    return Path(os.path.realpath(root / "sys" / "bus" / "pci" / "devices" / bdf))


def test_reader_on_a_switch_tree(mini: Path) -> None:
    topo = read_topology(Roots.under(mini))
    gpu = topo.device("0000:18:00.0")
    assert gpu.root == "pci0000:15"
    assert gpu.chain == ("0000:15:01.0", "0000:16:00.0", "0000:17:00.0", "0000:18:00.0")
    assert gpu.link is not None and gpu.link.current_speed_gts == 32.0
    assert gpu.local_cpus == (0, 1, 2, 3)
    assert [a.severity for a in gpu.aer] == ["correctable", "fatal", "nonfatal"]
    assert topo.device("0000:16:00.0").children == ("0000:17:00.0", "0000:17:01.0")
    assert topo.roots[0].children == ("0000:15:01.0",)
    nic = topo.device("0000:19:00.0")
    assert nic.ib_devices == ("mlx5_0",) and nic.net_interfaces == ("enp25s0np0",)


def test_a_device_event_of_the_udev_source_built_with_it_makes_it_walk_again(
    mini: Path,
) -> None:
    inputs = SourceInputs()
    source, udev = SOURCES["pci"].make(inputs), SOURCES["udev"].make(inputs)
    assert isinstance(source, PciSource) and isinstance(udev, UdevSource)
    assert source.topology is udev.topology is inputs.topology
    roots = Roots.under(mini)
    source.collect(roots)
    source.collect(roots)
    assert source.walks == 1
    udev.topology.advance()  # what its monitor does on a PCI device event
    source.collect(roots)
    assert source.walks == 2
    source.collect(roots)
    assert source.walks == 2
    # Built on their own, sources share nothing.
    alone = SOURCES["pci"].make()
    assert isinstance(alone, PciSource) and alone.topology is not udev.topology


def test_source_rereads_only_changing_files_until_the_device_set_changes(mini: Path) -> None:
    roots = Roots.under(mini)
    source = make_source()
    first = source.collect(roots)
    assert source.walks == 1
    gpu_dir = _dir(mini, "0000:18:00.0")
    (gpu_dir / "current_link_speed").write_text("2.5 GT/s PCIe\n")
    (gpu_dir / "aer_dev_correctable").write_text("RxErr 7\nTOTAL_ERR_COR 7\n")
    (gpu_dir / "numa_node").write_text("1\n")  # structural: not re-read from the cache
    second = source.collect(roots)
    assert source.walks == 1
    gpu = second.device("0000:18:00.0")
    assert gpu.link is not None and gpu.link.current_speed_gts == 2.5 and gpu.link.downtrained
    assert gpu.aer[0].counters[0].value == 7
    assert gpu.numa_node == first.device("0000:18:00.0").numa_node == 0
    # Hot-removing the NIC changes the device set: the tree is walked again.
    (mini / "sys" / "bus" / "pci" / "devices" / "0000:19:00.0").unlink()
    third = source.collect(roots)
    assert source.walks == 2
    assert third.get("0000:19:00.0") is None
    assert third.device("0000:18:00.0").numa_node == 1
    source.close()


def test_unchanged_tree_gives_the_same_topology_object(mini: Path) -> None:
    roots = Roots.under(mini)
    source = make_source()
    source.slow_every = 3
    first = source.collect(roots)
    assert source.collect(roots) is first
    assert source.collect(roots) is first
    # The third run after the walk walks again (slow_every): an equal tree is the same object.
    assert source.collect(roots) is first and source.walks == 2
    # A counter that moved gives a new topology in which only that function is a new record.
    gpu_dir = _dir(mini, "0000:18:00.0")
    (gpu_dir / "aer_dev_fatal").write_text("TLP 1\nTOTAL_ERR_FATAL 1\n")
    second = source.collect(roots)
    assert second is not first and second != first
    assert second.device("0000:18:00.0").aer[1].total == 1
    moved = [a.bdf for a, b in zip(first.devices, second.devices, strict=True) if a is not b]
    assert moved == ["0000:18:00.0"]
    assert source.collect(roots) is second
    source.close()


def test_a_malformed_attribute_is_absent_and_counted_the_rest_read(mini: Path) -> None:
    roots = Roots.under(mini)
    source = make_source()
    first = source.collect(roots)
    nic_speed = _dir(mini, "0000:19:00.0") / "current_link_speed"
    good = nic_speed.read_text()
    (_dir(mini, "0000:18:00.0") / "aer_dev_fatal").write_text("TLP 2\nTOTAL_ERR_FATAL 2\n")
    nic_speed.write_text("garbage\n")  # read after the GPU's
    second = source.collect(roots)
    assert second.device("0000:18:00.0").aer[1].total == 2
    nic_link = second.device("0000:19:00.0").link
    assert nic_link is not None and nic_link.current_speed_gts is None
    assert nic_link.current_width == 16
    assert second.skipped.counts == {pci_module.SKIP_ATTRIBUTE_UNPARSABLE: 1}
    assert (
        "0000:19:00.0/current_link_speed"
        in (second.skipped.examples[pci_module.SKIP_ATTRIBUTE_UNPARSABLE])
    )
    # Unchanged bytes are not parsed (nor counted) again; the record stops carrying the skip
    # and then the unchanged topology is the same object again.
    third = source.collect(roots)
    assert not third.skipped and third == second
    assert source.collect(roots) is third
    nic_speed.write_text(good)
    fourth = source.collect(roots)
    assert fourth.device("0000:19:00.0") == first.device("0000:19:00.0")
    source.close()


def test_static_files_are_read_again_every_slow_every_runs(mini: Path) -> None:
    roots = Roots.under(mini)
    source = make_source()
    assert source.slow_every == SLOW_EVERY > 1
    source.slow_every = 3
    source.collect(roots)
    (_dir(mini, "0000:18:00.0") / "numa_node").write_text("1\n")
    for _ in range(2):
        assert source.collect(roots).device("0000:18:00.0").numa_node == 0
    assert source.collect(roots).device("0000:18:00.0").numa_node == 1
    assert source.walks == 2
    # slow_every=1 (replay, tests): every run reads everything.
    source.slow_every = 1
    (_dir(mini, "0000:18:00.0") / "numa_node").write_text("0\n")
    assert source.collect(roots).device("0000:18:00.0").numa_node == 0
    assert source.walks == 3
    source.close()


def test_link_state_is_read_again_when_the_device_resumes(mini: Path) -> None:
    roots = Roots.under(mini)
    source = make_source()
    gpu_dir = _dir(mini, "0000:18:00.0")
    (gpu_dir / "power" / "runtime_status").write_text("suspended\n")
    link = source.collect(roots).device("0000:18:00.0").link
    assert link is not None and link.current_speed_gts is None
    (gpu_dir / "power" / "runtime_status").write_text("active\n")
    (gpu_dir / "current_link_width").write_text("8\n")
    link = source.collect(roots).device("0000:18:00.0").link
    assert link is not None and (link.current_speed_gts, link.current_width) == (32.0, 8)
    # A status that does not parse is counted, and the link is left alone as if suspended:
    # reading it might resume the device.
    (gpu_dir / "power" / "runtime_status").write_text("garbage\n")
    (gpu_dir / "current_link_width").write_text("not read\n")
    topology = source.collect(roots)
    link = topology.device("0000:18:00.0").link
    assert link is not None and link.current_width is None
    assert topology.skipped.counts == {pci_module.SKIP_ATTRIBUTE_UNPARSABLE: 1}
    assert "runtime_status" in topology.skipped.examples[pci_module.SKIP_ATTRIBUTE_UNPARSABLE]
    source.close()


def test_function_links_resolve_like_realpath(mini: Path, tmp_path: Path) -> None:
    expected = read_topology(Roots.under(mini))
    # An absolute link (not what the kernel writes) is resolved the slow way.
    link = mini / "sys" / "bus" / "pci" / "devices" / "0000:18:00.0"
    target = os.path.realpath(link)
    link.unlink()
    link.symlink_to(target)
    assert read_topology(Roots.under(mini)) == expected
    # A root reached through a link: relative links are joined to the resolved directory.
    alias = tmp_path / "alias"
    alias.symlink_to(mini)
    assert read_topology(Roots.under(alias)).device("0000:18:00.0").chain == (
        expected.device("0000:18:00.0").chain
    )


def test_os_names_follow_kernel_and_relative_device_links(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    function = sysfs / "devices" / "pci0000:00" / "0000:00:01.0" / "0000:18:00.0"
    other = sysfs / "devices" / "pci0000:00" / "0000:00:02.0"
    for d in (function / "infiniband" / "mlx5_0", function / "nvme" / "nvme0", other):
        d.mkdir(parents=True)
    cls = sysfs / "class"
    (cls / "infiniband").mkdir(parents=True)
    (cls / "nvme").mkdir()
    (cls / "misc").mkdir()
    # The kernel's links name the function; the simulated node's go up the tree.
    (function / "infiniband" / "mlx5_0" / "device").symlink_to("../../../0000:18:00.0")
    (function / "nvme" / "nvme0" / "device").symlink_to("../..")
    (cls / "infiniband" / "mlx5_0").symlink_to(
        "../../devices/pci0000:00/0000:00:01.0/0000:18:00.0/infiniband/mlx5_0"
    )
    (cls / "nvme" / "nvme0").symlink_to(function / "nvme" / "nvme0")  # absolute
    # A link through another link: resolved the slow way.
    (cls / "misc" / "via").mkdir()
    (cls / "misc" / "via" / "device").symlink_to(sysfs / "class" / "misc" / "other")
    (cls / "misc" / "other").symlink_to(other)
    (cls / "misc" / "none").mkdir()  # no device link: skipped
    assert pci_module._link_targets(cls / "infiniband") == {"0000:18:00.0": ("mlx5_0",)}
    assert pci_module._link_targets(cls / "nvme") == {"0000:18:00.0": ("nvme0",)}
    assert pci_module._link_targets(cls / "misc") == {"0000:00:02.0": ("via",)}
    assert pci_module._link_targets(cls / "absent") == {}


def test_suspended_device_link_is_not_read(mini: Path) -> None:
    gpu_dir = _dir(mini, "0000:18:00.0")
    (gpu_dir / "power" / "runtime_status").write_text("suspended\n")
    (gpu_dir / "current_link_speed").write_text("garbage that would not parse\n")
    gpu = read_topology(Roots.under(mini)).device("0000:18:00.0")
    assert gpu.link is not None
    assert gpu.link.current_speed_gts is None and gpu.link.max_speed_gts == 32.0


def test_a_function_with_a_bad_identity_is_skipped_and_named(mini: Path) -> None:
    good = read_topology(Roots.under(mini))
    (_dir(mini, "0000:19:00.0") / "class").write_text("ethernet\n")
    topology = read_topology(Roots.under(mini))
    assert [d.bdf for d in topology.devices] == [
        d.bdf for d in good.devices if d.bdf != "0000:19:00.0"
    ]
    assert topology.skipped.counts == {pci_module.SKIP_FUNCTION_UNREADABLE: 1}
    assert "0000:19:00.0/class" in topology.skipped.examples[pci_module.SKIP_FUNCTION_UNREADABLE]
    # Its bridge no longer lists it: the tree names only functions it holds.
    assert topology.device("0000:17:01.0").children == ()


def test_a_fifo_where_a_hot_plugged_bridge_has_its_vendor(mini: Path) -> None:
    """The bridge is left out with the function below it, without waiting on the FIFO; every
    remaining function's chain is in the tree."""
    vendor = _dir(mini, "0000:17:01.0") / "vendor"
    vendor.unlink()
    os.mkfifo(vendor)
    speed = _dir(mini, "0000:18:00.0") / "current_link_speed"
    speed.unlink()
    os.mkfifo(speed)
    topology = PciSource().collect(Roots.under(mini))
    assert [d.bdf for d in topology.devices] == [
        "0000:15:01.0",
        "0000:16:00.0",
        "0000:17:00.0",
        "0000:18:00.0",
    ]
    for device in topology.devices:
        assert [d.bdf for d in path_to_root(topology, device.bdf)] == list(reversed(device.chain))
    gpu_link = topology.device("0000:18:00.0").link
    assert gpu_link is not None and gpu_link.current_speed_gts is None
    assert topology.skipped.counts == {
        pci_module.SKIP_FUNCTION_UNREADABLE: 1,
        pci_module.SKIP_FUNCTION_BELOW_SKIPPED: 1,
        pci_module.SKIP_FILE_REFUSED: 1,
    }
    assert "FIFO" in topology.skipped.examples[pci_module.SKIP_FUNCTION_UNREADABLE]


def test_missing_tree_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        PciSource().collect(Roots.under(tmp_path))


# --- metrics ----------------------------------------------------------------------------------


def _snapshot(topo: Topology) -> Snapshot:
    return Snapshot(
        cycle=1,
        monotonic=10.0,
        wall_time=1.7e9,
        current={"pci": SourceSample("pci", 10.0, 0.01, topo)},
    )


def test_metrics_of_the_switch_tree(mini: Path) -> None:
    gpu_dir = _dir(mini, "0000:18:00.0")
    (gpu_dir / "aer_dev_correctable").write_text("RxErr 3\nBadTLP 1\nBadDLLP 0\nTOTAL_ERR_COR 5\n")
    text = render(_snapshot(read_topology(Roots.under(mini))), [pci_metrics.families]).decode()
    assert 'nodescope_pcie_link_speed_gts{bdf="0000:18:00.0"} 32.0' in text
    assert 'nodescope_pcie_link_width_lanes{bdf="0000:16:00.0"} 16.0' in text
    capacity = 'nodescope_pcie_link_capacity_bytes_per_second{bdf="0000:18:00.0"} 6.30153846'
    assert capacity in text
    assert (
        'nodescope_pcie_aer_errors_total{bdf="0000:18:00.0",severity="correctable",type="RxErr"}'
        " 3.0" in text
    )
    assert (
        'nodescope_pcie_aer_reported_errors_total{bdf="0000:18:00.0",severity="correctable"} 5.0'
        in text
    )
    # Zero-count types are left out (thousands of zero series on an HGX node); totals stay.
    assert 'type="BadDLLP"' not in text
    assert (
        'nodescope_pcie_device_info{bdf="0000:19:00.0",class="ethernet",device_id="0x1021",'
        'names="mlx5_0,enp25s0np0",numa_node="0",parent="0000:17:01.0",role="endpoint",'
        'root_port="0000:15:01.0",vendor_id="0x15b3"} 1.0' in text
    )
    assert 'role="downstream_port"' in text and 'role="root_port"' in text


def test_metrics_leave_out_uninteresting_functions_and_missing_data() -> None:
    topo = read_topology(Roots.under(FIXTURE_HOST))
    text = render(_snapshot(topo), [pci_metrics.families]).decode()
    assert 'bdf="0000:00:03.0"' in text  # the virtio NIC
    assert 'bdf="0000:00:02.0"' not in text  # virtio block is not NVMe
    assert "nodescope_pcie_link_speed_gts{" not in text  # no link files: no series
    empty = Snapshot(cycle=1, monotonic=1.0, wall_time=1.0)
    assert list(pci_metrics.families(empty)) == []


def test_a_virtual_function_names_its_physical_function(tmp_path: Path) -> None:
    vf_text = MINI_LSPCI + (
        "\n19:00.1 Ethernet controller: Mellanox Technologies ConnectX Family mlx5Gen Virtual"
        " Function\n\tNUMA node: 0\n\tCapabilities: [60] Express (v2) Endpoint, MSI 00\n"
        "\t\tLnkCap:\tPort #0, Speed 32GT/s, Width x16, ASPM not supported\n"
        "\t\tLnkSta:\tSpeed 32GT/s (ok), Width x16 (ok)\n"
        "\tKernel driver in use: mlx5_core\n"
    )
    materialise(parse_lspci_vvv(vf_text, "mini-sriov"), tmp_path, {0: (0, 1, 2, 3)})
    # As the kernel links them: the VF's physfn to the PF, the PF's virtfn0 to the VF.
    os.symlink("../0000:19:00.0", _dir(tmp_path, "0000:19:00.1") / "physfn")
    os.symlink("../0000:19:00.1", _dir(tmp_path, "0000:19:00.0") / "virtfn0")
    topo = read_topology(Roots.under(tmp_path))
    assert topo.device("0000:19:00.1").physical_function == "0000:19:00.0"
    assert topo.device("0000:19:00.0").physical_function is None
    # A physfn that does not name a function is none.
    (_dir(tmp_path, "0000:19:00.1") / "physfn").unlink()
    os.symlink("../not-a-function", _dir(tmp_path, "0000:19:00.1") / "physfn")
    assert read_topology(Roots.under(tmp_path)).device("0000:19:00.1").physical_function is None
