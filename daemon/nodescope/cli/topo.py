"""`nodescope topo`: the ``nvidia-smi topo -m`` matrix of GPUs, NICs and NVMe drives.

PCIe relations are computed from sysfs alone (``docs/datasources.md`` §9): no driver needed,
so it also answers on nodes whose GPU driver is down, and it shows NVMe drives, which
``nvidia-smi`` does not. Rows are grouped by root port, the unit of PCIe contention. ``NV#``
cells come from the NVLink graph (:mod:`nodescope.model.nvlink_graph`) that the NVML source
reads, when NVML answers: on this host's own ``/sys``, or on a simulated node
(``--scenario``) with its fake NVML. Without NVML every cell is a PCIe relation.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodescope.cli.common import roots_from_args
from nodescope.errors import ParseError
from nodescope.model.nvlink_graph import NvLinkGraph, PlacedGraph, attach
from nodescope.model.topology import (
    RELATION_LEGEND,
    DeviceClass,
    PciDevice,
    Topology,
    affinity,
    format_cpulist,
    switch_of,
)
from nodescope.roots import ROOT_NAMES, Roots
from nodescope.sources.nvml import NvmlAdapter, NvmlSource, NvmlUnavailable
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


def render_nvlink_text(placed: PlacedGraph, entries: Sequence[TopoEntry]) -> list[str]:
    """Per GPU: active links of all links, and where they go (NVSwitches or GPUs)."""
    labels = {e.bdf: e.label for e in entries}
    graph = placed.graph
    lines = ["", "NVLinks (NVML):", ""]
    for gpu in graph.gpus:
        label = labels.get(gpu.pci_address, f"NVML GPU {gpu.index} ({gpu.pci_address})")
        total = sum(1 for e in graph.links if e.gpu == gpu.index)
        active = graph.active_links(gpu.index)
        line = f"  {label}: {len(active)} of {total} links active"
        switches = graph.switches_of(gpu.index)
        if switches:
            line += "; NVSwitch " + ", ".join(f"{s.switch} x{s.links}" for s in switches)
        peers = _peer_counts(placed, gpu.index, labels)
        if peers and not switches:
            line += "; " + ", ".join(f"{peer} x{n}" for peer, n in peers.items())
        lines.append(line)
    for address in placed.unmatched:
        lines.append(f"  NVML names {address}, which the PCI tree does not show as such")
    for bdf in placed.gpus_without_nvlink_graph:
        lines.append(f"  {labels.get(bdf, bdf)}: on PCI, not listed by NVML")
    return lines


def _peer_counts(placed: PlacedGraph, index: int, labels: Mapping[str, str]) -> dict[str, int]:
    """NV# of GPU ``index`` with each peer, by the peer's matrix label."""
    graph = placed.graph
    result: dict[str, int] = {}
    for other in graph.gpus:
        pair = graph.bonded(index, other.index)
        if pair is not None:
            result[labels.get(other.pci_address, other.pci_address)] = pair.links
    return result


def nvlink_json(placed: PlacedGraph, entries: Sequence[TopoEntry]) -> dict[str, Any]:
    labels = {e.bdf: e.label for e in entries}
    graph = placed.graph
    return {
        "source": "nvml",
        "gpus": [
            {
                "label": labels.get(gpu.pci_address),
                "bdf": gpu.pci_address,
                "nvml_index": gpu.index,
                "links": sum(1 for e in graph.links if e.gpu == gpu.index),
                "active_links": len(graph.active_links(gpu.index)),
                "switches": {s.switch: s.links for s in graph.switches_of(gpu.index)},
                "peers": _peer_counts(placed, gpu.index, labels),
            }
            for gpu in graph.gpus
        ],
        "pairs": [
            {
                "a": labels.get(graph.gpu(p.gpu_a).pci_address, graph.gpu(p.gpu_a).pci_address),
                "b": labels.get(graph.gpu(p.gpu_b).pci_address, graph.gpu(p.gpu_b).pci_address),
                "links": p.links,
                "via": p.via,
            }
            for p in graph.bonded_pairs()
        ],
        "nvswitches": [
            {
                "bdf": n.pci_address,
                "numa_node": None if n.device is None else n.device.numa_node,
                "root_port": None if n.device is None else n.device.root_port,
            }
            for n in placed.nodes
            if n.gpu is None
        ],
        "unmatched": list(placed.unmatched),
        "gpus_not_in_nvml": list(placed.gpus_without_nvlink_graph),
    }


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


def read_nvlink_graph(nvml: NvmlAdapter, roots: Roots) -> NvLinkGraph | None:
    """The NVLink graph of the GPUs the NVML source reads once; ``None`` when NVML does not
    answer (no driver, no library)."""
    source = NvmlSource(nvml, watch_xids=False)
    try:
        return NvLinkGraph.from_gpus(source.collect(roots).gpus)
    except NvmlUnavailable:
        return None
    finally:
        source.close()


def _host_nvml() -> NvmlAdapter:
    import pynvml

    adapter: NvmlAdapter = pynvml
    return adapter


@contextmanager
def _scenario_node(name: str) -> Iterator[tuple[Roots, NvmlAdapter]]:
    """The simulated node of a scenario, materialised under a temporary directory."""
    from nodescope.sim.node import SimulatedNode, preferred_temp_dir
    from nodescope.sim.scenario import load_scenario

    scenario = load_scenario(name)
    with tempfile.TemporaryDirectory(prefix="nodescope-topo-", dir=preferred_temp_dir()) as tmp:
        node = SimulatedNode(scenario, Path(tmp))
        node.materialise()
        yield node.roots, node.nvml


def show(args: argparse.Namespace, roots: Roots, nvml: NvmlAdapter | None) -> int:
    try:
        topology = read_topology(roots)
    except (OSError, ParseError) as exc:
        print(f"nodescope topo: cannot read the PCI tree under {roots.sysfs}: {exc}",
              file=sys.stderr)  # fmt: skip
        return 1
    graph = None if nvml is None else read_nvlink_graph(nvml, roots)
    placed = None if graph is None else attach(graph, topology)
    entries = select_devices(topology)
    counts = None if placed is None else placed.counts_by_bdf()
    matrix = affinity_matrix(topology, entries, counts)
    if args.json:
        document = render_json(topology, entries, matrix)
        document["nvlink"] = None if placed is None else nvlink_json(placed, entries)
        json.dump(document, sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif not entries:
        print("no GPUs, NICs or NVMe drives on PCI")
    else:
        text = render_text(topology, entries, matrix)
        if placed is not None and placed.graph.links:
            text += "\n".join(render_nvlink_text(placed, entries)) + "\n"
        sys.stdout.write(text)
    return 0


def run(args: argparse.Namespace) -> int:
    scenario = getattr(args, "scenario", None)
    if scenario is None:
        roots = roots_from_args(args)
        # NVML describes the GPUs of this host: ask it only when the tree is this host's.
        nvml = _host_nvml() if roots.sysfs == Roots().sysfs else None
        return show(args, roots, nvml)
    given = [f"--{name}" for name in ROOT_NAMES if getattr(args, name, None) is not None]
    if given:
        print(f"nodescope topo: --scenario brings its own roots; drop {' '.join(given)}",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        with _scenario_node(scenario) as (roots, nvml):
            return show(args, roots, nvml)
    except ParseError as exc:
        print(f"nodescope topo: scenario {scenario}: {exc}", file=sys.stderr)
        return 1


def register(subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "topo",
        parents=parents,
        help="GPU/NIC/NVMe affinity matrix (nvidia-smi topo -m legend) from sysfs",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--scenario",
        metavar="NAME",
        default=None,
        help="show the simulated node of a bundled scenario (or scenario file): its PCI "
        "tree and its fake NVML's NVLinks",
    )
    parser.set_defaults(func=run)
