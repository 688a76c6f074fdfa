"""`nodescope topo`: the ``nvidia-smi topo -m`` matrix of GPUs, NICs and NVMe drives.

Computed from sysfs alone (``docs/datasources.md`` §9): no driver needed, so it also answers
on nodes whose GPU driver is down, and it shows NVMe drives, which ``nvidia-smi`` does not.
Rows are grouped by root port, the unit of PCIe contention. ``NV#`` cells come from NVLink
counts handed to :func:`affinity_matrix`; without them every cell is a PCIe relation.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nodescope.cli.common import roots_from_args
from nodescope.errors import ParseError
from nodescope.model.topology import (
    RELATION_LEGEND,
    DeviceClass,
    PciDevice,
    Topology,
    affinity,
    format_cpulist,
    switch_of,
)
from nodescope.sources.pci import read_topology

_KINDS: tuple[tuple[str, str, tuple[DeviceClass, ...]], ...] = (
    ("gpu", "GPU", (DeviceClass.GPU,)),
    ("nic", "NIC", (DeviceClass.ETHERNET, DeviceClass.INFINIBAND)),
    ("nvme", "NVME", (DeviceClass.NVME,)),
)
_KIND_ORDER = {kind: index for index, (kind, _, _) in enumerate(_KINDS)}


@dataclass(frozen=True, slots=True)
class TopoEntry:
    """One row/column of the matrix."""

    label: str
    bdf: str
    kind: str
    names: tuple[str, ...]
    numa_node: int | None
    cpu_affinity: str | None
    root_port: str | None
    switch: str | None


def _switch(topology: Topology, dev: PciDevice) -> str | None:
    parent = dev.parent
    return None if parent is None else switch_of(topology, parent)


def select_devices(topology: Topology) -> list[TopoEntry]:
    """The GPUs, NICs and NVMe drives, labelled in BDF order per kind (``GPU0``, ``NIC0``,
    ``NVME0``), ordered by root port (NUMA node first), then kind, then BDF."""
    entries: list[TopoEntry] = []
    for kind, prefix, classes in _KINDS:
        for index, dev in enumerate(topology.of_class(*classes)):
            entries.append(
                TopoEntry(
                    label=f"{prefix}{index}",
                    bdf=dev.bdf,
                    kind=kind,
                    names=dev.os_names,
                    numa_node=dev.numa_node,
                    cpu_affinity=(
                        format_cpulist(dev.local_cpus) if dev.local_cpus is not None else None
                    ),
                    root_port=dev.root_port,
                    switch=_switch(topology, dev),
                )
            )

    def key(entry: TopoEntry) -> tuple[int, int, str, int, str]:
        numa = entry.numa_node if entry.numa_node is not None else 1 << 30
        return (numa, entry.root_port is None, entry.root_port or "", _KIND_ORDER[entry.kind],
                entry.bdf)  # fmt: skip

    return sorted(entries, key=key)


def affinity_matrix(
    topology: Topology,
    entries: Sequence[TopoEntry],
    nvlinks: Mapping[frozenset[str], int] | None = None,
) -> list[list[str]]:
    """Cell ``[i][j]`` relates ``entries[i]`` to ``entries[j]``; ``nvlinks`` maps a pair of
    BDFs to its count of active NVLinks (the ``NV#`` cells)."""
    return [[affinity(topology, a.bdf, b.bdf, nvlinks) for b in entries] for a in entries]


def _gb(value: float | None) -> str:
    return "?" if value is None else f"{value / 1e9:.1f} GB/s"


def _root_ports(topology: Topology, entries: Sequence[TopoEntry]) -> list[dict[str, Any]]:
    ports: list[dict[str, Any]] = []
    seen: dict[str, dict[str, Any]] = {}
    for entry in entries:
        if entry.root_port is None:
            continue
        port = seen.get(entry.root_port)
        if port is None:
            dev = topology.device(entry.root_port)
            link = dev.link
            port = {
                "bdf": dev.bdf,
                "host_bridge": dev.root,
                "numa_node": dev.numa_node,
                "generation": None if link is None else link.current_generation,
                "width": None if link is None else link.current_width,
                "max_generation": None if link is None else link.max_generation,
                "max_width": None if link is None else link.max_width,
                "capacity_bytes_per_s": None if link is None else link.current_capacity_bytes_per_s,
                "devices": [],
            }
            seen[entry.root_port] = port
            ports.append(port)
        port["devices"].append(entry.label)
    return ports


def _nic_name(entry: TopoEntry) -> str:
    if not entry.names:
        return entry.bdf
    first, rest = entry.names[0], entry.names[1:]
    return f"{first} ({', '.join(rest)})" if rest else first


def render_text(topology: Topology, entries: Sequence[TopoEntry], matrix: list[list[str]]) -> str:
    labels = [e.label for e in entries]
    width = max([len(x) for x in labels] + [4]) + 2
    header = " " * width + "".join(label.ljust(width) for label in labels)
    header += "CPU Affinity".ljust(18) + "NUMA Affinity".ljust(15) + "Root Port"
    lines = [header.rstrip()]
    for entry, row in zip(entries, matrix, strict=True):
        numa = "N/A" if entry.numa_node is None else str(entry.numa_node)
        cpus = entry.cpu_affinity or "N/A"
        line = entry.label.ljust(width) + "".join(cell.center(width - 1) + " " for cell in row)
        line += cpus.ljust(18) + numa.ljust(15) + (entry.root_port or "N/A")
        lines.append(line.rstrip())
    lines += ["", "Legend:", ""]
    lines += [f"  {code:<4} = {text}" for code, text in RELATION_LEGEND]
    nics = [e for e in entries if e.kind == "nic"]
    if nics:
        lines += ["", "NIC Legend:", ""]
        lines += [f"  {e.label}: {_nic_name(e)}" for e in sorted(nics, key=_label_order)]
    drives = [e for e in entries if e.kind == "nvme"]
    if drives:
        lines += ["", "NVMe Legend:", ""]
        lines += [f"  {e.label}: {_nic_name(e)}" for e in sorted(drives, key=_label_order)]
    ports = _root_ports(topology, entries)
    if ports:
        lines += ["", "Root ports:", ""]
        for port in ports:
            gen = port["generation"]
            link = "link ?" if gen is None else f"Gen{gen} x{port['width']}"
            if port["max_generation"] is not None and (
                port["max_generation"] != gen or port["max_width"] != port["width"]
            ):
                link += f" (max Gen{port['max_generation']} x{port['max_width']})"
            numa = "N/A" if port["numa_node"] is None else port["numa_node"]
            lines.append(
                f"  {port['bdf']}  NUMA {numa}  {link}  "
                f"{_gb(port['capacity_bytes_per_s'])} per direction  " + " ".join(port["devices"])
            )
    return "\n".join(lines) + "\n"


def _label_order(entry: TopoEntry) -> tuple[str, int]:
    prefix = entry.label.rstrip("0123456789")
    return prefix, int(entry.label[len(prefix) :])


def render_json(
    topology: Topology, entries: Sequence[TopoEntry], matrix: list[list[str]]
) -> dict[str, Any]:
    return {
        "devices": [
            {
                "label": e.label,
                "bdf": e.bdf,
                "kind": e.kind,
                "names": list(e.names),
                "numa_node": e.numa_node,
                "cpu_affinity": e.cpu_affinity,
                "root_port": e.root_port,
                "switch": e.switch,
            }
            for e in entries
        ],
        "matrix": {
            a.label: {b.label: cell for b, cell in zip(entries, row, strict=True)}
            for a, row in zip(entries, matrix, strict=True)
        },
        "root_ports": _root_ports(topology, entries),
        "legend": dict(RELATION_LEGEND),
    }


def run(args: argparse.Namespace) -> int:
    roots = roots_from_args(args)
    try:
        topology = read_topology(roots)
    except (OSError, ParseError) as exc:
        print(f"nodescope topo: cannot read the PCI tree under {roots.sysfs}: {exc}",
              file=sys.stderr)  # fmt: skip
        return 1
    entries = select_devices(topology)
    matrix = affinity_matrix(topology, entries)
    if args.json:
        json.dump(render_json(topology, entries, matrix), sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif not entries:
        print("no GPUs, NICs or NVMe drives on PCI")
    else:
        sys.stdout.write(render_text(topology, entries, matrix))
    return 0


def register(subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "topo",
        parents=parents,
        help="GPU/NIC/NVMe affinity matrix (nvidia-smi topo -m legend) from sysfs",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)
