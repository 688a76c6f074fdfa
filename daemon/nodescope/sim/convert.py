"""Describe a real server as a scenario's hardware, from its ``lspci -vvv``.

``python -m nodescope.sim.convert lspci.txt > hardware.json`` writes a
``nodescope-hardware/1`` document (docs/scenarios.md): every PCI function of the listing
with the ids, NUMA node, PCIe port type, link capabilities and status, bridge bus numbers,
AER presence and driver that ``lspci -vvv`` printed (parsed by :mod:`nodescope.sim.lspci`),
and the devices nodescope simulates, found by class:

* GPUs: display controllers (class 0x03) of NVIDIA, indexed in PCI address order as NVML
  enumerates them; names and NVLink counts from :data:`GPU_MODELS` where the device id is
  known; an SXM GPU's links are spread over the NVSwitches;
* NVSwitches: NVIDIA bridges of class 0x0680 (docs/datasources.md §2.4);
* NVMe drives: class 0x010802, named ``nvme<N>n1`` in address order;
* NICs: Mellanox network functions, one RDMA device each (``mlx5_<N>`` in address order);
  ConnectX-7 are compute NICs, others storage. Operators adjust names, roles and bonds.

What ``lspci`` does not show — CPU counts, OS names — is a guess a scenario may override; the
document says so in its ``comment``.

``python -m nodescope.sim.convert --infiniband <dir>`` turns a captured
``/sys/class/infiniband`` tree into the JSON the simulator takes NIC counters from
(``nodescope/sim/data/h100-node-infiniband.json`` was made this way).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nodescope.errors import ParseError
from nodescope.sim.lspci import LspciDevice, LspciDump, bridge_chains, parse_lspci_vvv
from nodescope.sim.scenario import HARDWARE_FORMAT

NVIDIA = 0x10DE
MELLANOX = 0x15B3

#: NVIDIA device id -> (NVML name, NVLinks, memory bytes) of data-centre GPUs we know.
GPU_MODELS: dict[int, tuple[str, int, int]] = {
    0x2330: ("NVIDIA H100 80GB HBM3", 18, 80 * 2**30),
    0x2324: ("NVIDIA H800", 8, 80 * 2**30),
    0x2335: ("NVIDIA H200", 18, 141 * 10**9),
    0x2331: ("NVIDIA H100 PCIe", 0, 80 * 2**30),
    0x20B2: ("NVIDIA A100-SXM4-80GB", 12, 80 * 2**30),
    0x20B0: ("NVIDIA A100-SXM4-40GB", 12, 40 * 2**30),
    0x20B5: ("NVIDIA A100 80GB PCIe", 0, 80 * 2**30),
}
#: Mellanox device id -> (hca_type, default rate, role)
NIC_MODELS: dict[int, tuple[str, str, str]] = {
    0x1021: ("MT4129", "400 Gb/sec (4X NDR)", "compute"),  # ConnectX-7
    0x101B: ("MT4123", "200 Gb/sec (4X HDR)", "compute"),  # ConnectX-6
    0x101D: ("MT4125", "100 Gb/sec (4X EDR)", "storage"),  # ConnectX-6 Dx
    0xA2DC: ("MT41692", "200 Gb/sec (2X NDR)", "storage"),  # BlueField-3
}
#: NVLinks per NVSwitch on the HGX H100 8-GPU baseboard (5/4/4/5 over four switches).
HGX_SWITCH_SPREAD = (5, 4, 4, 5)


def _hex(value: int | None, digits: int) -> str | None:
    return None if value is None else f"0x{value:0{digits}x}"


def function_json(dev: LspciDevice) -> dict[str, Any]:
    """One function as ``hardware.pcie.functions`` holds it."""
    obj: dict[str, Any] = {
        "class": _hex(dev.class_code, 6),
        "vendor": _hex(dev.vendor_id, 4),
        "device": _hex(dev.device_id, 4),
    }
    if dev.revision is not None:
        obj["revision"] = _hex(dev.revision, 2)
    obj["name"] = " ".join(x for x in (dev.vendor_name, dev.device_name) if x)
    obj["numa_node"] = dev.numa_node
    if dev.express_type is not None:
        obj["express"] = dev.express_type.value
    if dev.link_cap_speed_gts is not None or dev.link_cap_width is not None:
        obj["link_cap"] = {"speed_gts": dev.link_cap_speed_gts, "width": dev.link_cap_width}
    if dev.link_sta_speed_gts is not None or dev.link_sta_width is not None:
        obj["link"] = {"speed_gts": dev.link_sta_speed_gts, "width": dev.link_sta_width}
    if dev.bus is not None:
        obj["bus"] = {
            "primary": dev.bus.primary,
            "secondary": dev.bus.secondary,
            "subordinate": dev.bus.subordinate,
        }
    if dev.has_aer:
        obj["aer"] = True
    if dev.driver is not None:
        obj["driver"] = dev.driver
    return {k: v for k, v in obj.items() if v is not None or k == "numa_node"}


def _spread(links: int, switches: Sequence[str]) -> list[dict[str, Any]]:
    if not links or not switches:
        return []
    if len(switches) == len(HGX_SWITCH_SPREAD) and links == sum(HGX_SWITCH_SPREAD):
        counts = list(HGX_SWITCH_SPREAD)
    else:
        counts = [
            links // len(switches) + (1 if i < links % len(switches) else 0)
            for i in range(len(switches))
        ]
    return [{"peer": s, "count": n} for s, n in zip(switches, counts, strict=True) if n]


def lspci_to_hardware(
    dump: LspciDump,
    *,
    sockets: int | None = None,
    cores_per_socket: int = 56,
    threads_per_core: int = 2,
) -> dict[str, Any]:
    """The hardware document of a parsed ``lspci -vvv`` listing."""
    bridge_chains(dump)  # raises ParseError on an inconsistent tree
    devices = sorted(dump.devices, key=lambda d: (d.domain, d.bdf))
    numa = {d.numa_node for d in devices if d.numa_node is not None}
    nvswitches = [
        d.bdf for d in devices if d.vendor_id == NVIDIA and (d.class_code or 0) >> 8 == 0x0680
    ]
    gpus: dict[str, Any] = {}
    for dev in devices:
        if dev.vendor_id != NVIDIA or (dev.class_code or 0) >> 16 != 0x03:
            continue
        name, links, memory = GPU_MODELS.get(
            dev.device_id or 0, (f"NVIDIA {dev.device_name}", 0, 80 * 2**30)
        )
        gpus[str(len(gpus))] = {
            "pci": dev.bdf,
            "name": name,
            "memory_bytes": memory,
            "nvlinks": _spread(links, nvswitches),
        }
    nvme: dict[str, Any] = {}
    for dev in devices:
        if dev.class_code == 0x010802:
            n = len(nvme)
            nvme[f"nvme{n}n1"] = {
                "pci": dev.bdf,
                "controller": f"nvme{n}",
                "major": 259,
                "minor": n,
                "model": " ".join(x for x in (dev.vendor_name, dev.device_name) if x),
            }
    nics: dict[str, Any] = {}
    for dev in devices:
        if dev.vendor_id != MELLANOX or (dev.class_code or 0) >> 16 != 0x02:
            continue
        hca_type, rate, role = NIC_MODELS.get(
            dev.device_id or 0, ("MT0000", "100 Gb/sec (4X EDR)", "compute")
        )
        nics[f"mlx5_{len(nics)}"] = {
            "pci": [dev.bdf],
            "role": role,
            "link_layer": "InfiniBand" if (dev.class_code or 0) >> 8 == 0x0207 else "Ethernet",
            "rate": rate,
            "hca_type": hca_type,
        }
    return {
        "format": HARDWARE_FORMAT,
        "comment": (
            f"converted from {dump.source} by nodescope.sim.convert; CPU counts and OS names "
            "(nvme<N>, mlx5_<N>) are guesses: lspci shows neither"
        ),
        "pcie": {"functions": {d.bdf: function_json(d) for d in devices}},
        "cpu": {
            "sockets": sockets if sockets is not None else max(1, max(numa, default=0) + 1),
            "cores_per_socket": cores_per_socket,
            "threads_per_core": threads_per_core,
        },
        "gpus": gpus,
        "nvswitches": nvswitches,
        "nvme": nvme,
        "nics": nics,
    }


def infiniband_capture_to_json(class_dir: Path, source: str) -> dict[str, Any]:
    """A captured ``/sys/class/infiniband`` as ``{devices: {name: {attributes, ports}}}``:
    attribute files as text, counter files as integers, as the files hold them."""

    def text(path: Path) -> str:
        return path.read_text().strip()

    devices: dict[str, Any] = {}
    for device in sorted(p for p in class_dir.iterdir() if p.is_dir()):
        entry: dict[str, Any] = {}
        for attr in ("hca_type", "fw_ver", "board_id", "node_guid"):
            if (device / attr).is_file():
                entry[attr] = text(device / attr)
        ports: dict[str, Any] = {}
        for port in sorted((device / "ports").iterdir(), key=lambda p: int(p.name)):
            port_entry: dict[str, Any] = {
                attr: text(port / attr)
                for attr in ("state", "phys_state", "rate", "link_layer")
                if (port / attr).is_file()
            }
            for group in ("counters", "hw_counters"):
                if (port / group).is_dir():
                    port_entry[group] = {
                        f.name: int(text(f)) for f in sorted((port / group).iterdir())
                    }
            ports[port.name] = port_entry
        entry["ports"] = ports
        devices[device.name] = entry
    return {"source": source, "devices": devices}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nodescope.sim.convert",
        description="Write a scenario hardware document from an `lspci -vvv` listing.",
    )
    parser.add_argument("lspci", nargs="?", help="lspci -vvv output ('-' for stdin)")
    parser.add_argument("--sockets", type=int, help="CPU sockets (default: NUMA nodes seen)")
    parser.add_argument("--cores-per-socket", type=int, default=56)
    parser.add_argument("--threads-per-core", type=int, default=2)
    parser.add_argument(
        "--infiniband",
        metavar="DIR",
        help="instead: convert a captured /sys/class/infiniband directory",
    )
    args = parser.parse_args(argv)
    try:
        if args.infiniband is not None:
            document = infiniband_capture_to_json(Path(args.infiniband), args.infiniband)
        else:
            if args.lspci is None:
                parser.error("an lspci -vvv file is needed")
            if args.lspci == "-":
                text, source = sys.stdin.read(), "<stdin>"
            else:
                text, source = Path(args.lspci).read_text(), os.fspath(args.lspci)
            document = lspci_to_hardware(
                parse_lspci_vvv(text, source),
                sockets=args.sockets,
                cores_per_socket=args.cores_per_socket,
                threads_per_core=args.threads_per_core,
            )
    except (ParseError, OSError, UnicodeDecodeError, ValueError) as exc:
        print(f"nodescope.sim.convert: {exc}", file=sys.stderr)
        return 2
    json.dump(document, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
