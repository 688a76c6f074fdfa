"""``nodescope snapshot``: one collection cycle — two samples, so rates exist — printed.

The text says what was seen: the disks' rates in ``nodescope iostat``'s columns, the PCIe
topology as ``nodescope topo`` summarises it (root ports, the GPUs, NICs and NVMe drives
below each, their NUMA nodes), the GPUs with their utilisation and PCIe/NVLink rates, the
InfiniBand and network ports' rates, the jobs, and at the end each source's state.
``--json`` prints every source's record and rates as a document.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from nodescope import __version__, jsonout, logs
from nodescope.cli.common import seconds_in
from nodescope.cli.iostat import format_report
from nodescope.cli.run import overrides_from_args
from nodescope.cli.topo import select_devices
from nodescope.collect import Collector
from nodescope.errors import ConfigError
from nodescope.model.disks import DISKS
from nodescope.model.infiniband import INFINIBAND
from nodescope.model.netdev import NETDEV
from nodescope.model.nvml import NVML
from nodescope.model.snapshot import Snapshot
from nodescope.model.topology import PCI
from nodescope.service import config_loader
from nodescope.sources.registry import SOURCES

#: The interval between the two samples: long enough that rates mean something, short
#: enough that the command answers (the daemon's own cycle is one second).
MIN_INTERVAL, MAX_INTERVAL = 0.1, 60.0

#: Rows a section lists at most: a node with hundreds of disks or ports stays readable.
MOST_ROWS = 64


#: ``--interval``: a number of seconds in [MIN_INTERVAL, MAX_INTERVAL].
interval_seconds = seconds_in(MIN_INTERVAL, MAX_INTERVAL)


def register(subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "snapshot",
        parents=parents,
        help="read every source twice and print what was seen, with rates",
    )
    parser.add_argument("--config", metavar="FILE", help="TOML configuration file")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--interval",
        type=interval_seconds,
        default=1.0,
        metavar="SECONDS",
        help=f"seconds between the two samples, {MIN_INTERVAL:g} to {MAX_INTERVAL:g} (default 1)",
    )
    parser.set_defaults(func=run, listen=None)


def _rates_of(snapshot: Snapshot, name: str) -> object | None:
    """The rates of the source named ``name`` (``None``: it has none, or not yet)."""
    spec = SOURCES.get(name)
    return None if spec is None or spec.rates is None else spec.rates(snapshot.derived)


def snapshot_document(snapshot: Snapshot) -> dict[str, Any]:
    sources: dict[str, Any] = {}
    for name, sample in snapshot.current.items():
        previous = snapshot.previous.get(name)
        sources[name] = {
            "ok": sample.ok,
            "error": sample.error,
            "duration_seconds": sample.duration,
            # The measured time the derived rates are computed over.
            "seconds_between_samples": (
                sample.monotonic - previous.monotonic if previous is not None else None
            ),
            "data": jsonout.plain(sample.data),
            "derived": jsonout.plain(_rates_of(snapshot, name)),
        }
    return {
        "nodescope_version": __version__,
        "wall_time": snapshot.wall_time,
        "cycle": snapshot.cycle,
        "sources": sources,
    }


def take(collector: Collector, interval: float) -> Snapshot:
    collector.run_cycle(force=True)
    time.sleep(max(0.0, interval))
    return collector.run_cycle(force=True)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_loader(args.config, overrides_from_args(args))()
    except ConfigError as exc:
        print(f"nodescope: {exc}", file=sys.stderr)
        return 2
    logs.setup("warning")
    collector = Collector.from_config(config)
    try:
        snapshot = take(collector, args.interval)
    finally:
        collector.close()
    document = snapshot_document(snapshot)
    if args.json:
        sys.stdout.write(jsonout.dumps(document))
        return 0
    sys.stdout.write(render_text(snapshot, document))
    return 0


def _rate(value: float | None) -> str:
    """Bytes per second with an SI prefix (``12.3 GB/s``), ``?`` when not knowable."""
    if value is None:
        return "?"
    for unit, size in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B/s"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _capped(lines: list[str], total: int, noun: str) -> list[str]:
    if total > MOST_ROWS:
        return [*lines[:MOST_ROWS], f"  ... and {total - MOST_ROWS} more {noun}"]
    return lines


def render_text(snapshot: Snapshot, document: dict[str, Any]) -> str:
    """What the two samples saw, section by section; a section whose source is down says so
    in its one line."""
    sections = [
        _disks(snapshot),
        _topology(snapshot),
        _gpus(snapshot),
        _ports(snapshot),
        _jobs(snapshot),
        _sources(document),
    ]
    return "\n\n".join("\n".join(lines) for lines in sections) + "\n"


def _down(snapshot: Snapshot, name: str) -> str:
    sample = snapshot.current.get(name)
    if sample is None:
        return "not enabled"
    return f"{sample.error or 'no record'}"


def _disks(snapshot: Snapshot) -> list[str]:
    head = "Disks (the columns of iostat -dxm over the interval):"
    pair = snapshot.pair(DISKS)
    report = snapshot.derived.disk_rates
    if pair is None or report is None:
        return [head, f"  disks: {_down(snapshot, DISKS.name)}"]
    previous, current, _ = pair
    table = format_report(report, current, previous).rstrip("\n").splitlines()
    if len(table) == 1:
        return [head, "  no disk has completed a request since boot"]
    return [head, *_capped(table, len(table), "disks")]


def _topology(snapshot: Snapshot) -> list[str]:
    topology = snapshot.latest(PCI)
    if topology is None:
        return ["Topology:", f"  pci: {_down(snapshot, PCI.name)}"]
    entries = select_devices(topology)
    counts = {kind: sum(1 for e in entries if e.kind == kind) for kind in ("gpu", "nic", "nvme")}
    numa = sorted({e.numa_node for e in entries if e.numa_node is not None})
    lines = [
        f"Topology: {_count(counts['gpu'], 'GPU')}, {_count(counts['nic'], 'NIC')},"
        f" {_count(counts['nvme'], 'NVMe drive')};"
        f" NUMA nodes {', '.join(str(n) for n in numa) or 'none reported'}"
    ]
    ports: dict[str, list[str]] = {}
    for entry in entries:
        if entry.root_port is not None:
            ports.setdefault(entry.root_port, []).append(entry.label)
    rows = []
    for bdf, labels in ports.items():
        port = topology.device(bdf)
        link = port.link
        width = (
            "link ?"
            if link is None or link.current_generation is None
            else f"Gen{link.current_generation} x{link.current_width}"
        )
        node = "?" if port.numa_node is None else str(port.numa_node)
        rows.append(f"  root port {bdf}  NUMA {node}  {width}  {' '.join(labels)}")
    unplaced = [e.label for e in entries if e.root_port is None]
    if unplaced:
        rows.append(f"  without a root port: {' '.join(unplaced)}")
    return [*lines, *_capped(rows, len(rows), "root ports")]


def _gpus(snapshot: Snapshot) -> list[str]:
    nvml = snapshot.latest(NVML)
    if nvml is None:
        return [f"GPUs: NVML: {_down(snapshot, NVML.name)}"]
    rates = snapshot.derived.gpu_rates
    by_index = {g.index: g for g in rates.gpus} if rates is not None else {}
    lines = [f"GPUs: {nvml.device_count}"]
    rows = []
    for gpu in nvml.gpus:
        rate = by_index.get(gpu.index)
        util = "?" if gpu.gpu_util_percent is None else f"{gpu.gpu_util_percent}%"
        memory = "?" if gpu.memory_util_percent is None else f"{gpu.memory_util_percent}%"
        pcie = nvlink = "?"
        if rate is not None:
            pcie = (
                f"tx {_rate(rate.pcie_tx_bytes_per_second)}"
                f" rx {_rate(rate.pcie_rx_bytes_per_second)}"
            )
            if len(rate.nvlinks):
                tx = [v for v in rate.nvlinks.data_tx_bytes_per_second if v is not None]
                rx = [v for v in rate.nvlinks.data_rx_bytes_per_second if v is not None]
                nvlink = (
                    f"tx {_rate(sum(tx) if tx else None)} rx {_rate(sum(rx) if rx else None)}"
                    f" over {len(rate.nvlinks)} links"
                )
            else:
                nvlink = "no links"
        rows.append(
            f"  GPU{gpu.index} {gpu.name}  {gpu.pci_address}  util {util}  memory util {memory}"
            f"  PCIe {pcie}  NVLink {nvlink}"
        )
    if nvml.lost:
        rows.append(f"  lost: {', '.join(f'GPU{g.gpu} {g.pci_address}' for g in nvml.lost)}")
    return [*lines, *_capped(rows, len(rows), "GPUs")]


def _ports(snapshot: Snapshot) -> list[str]:
    ib = snapshot.derived.ib_rates
    net = snapshot.derived.netdev_rates
    ib_ports = None
    if ib is not None:
        ib_ports = [
            (f"{p.device} port {p.port}", p.xmit_bytes_per_second, p.rcv_bytes_per_second)
            for p in ib.ports
        ]
    links = None
    if net is not None:
        links = [(n.name, n.tx_bytes_per_second, n.rx_bytes_per_second) for n in net.links]
    return [
        "Network ports (bytes per second over the interval):",
        *_rate_rows(snapshot, INFINIBAND.name, ib_ports, "InfiniBand ports"),
        *_rate_rows(snapshot, NETDEV.name, links, "network interfaces"),
    ]


def _rate_rows(
    snapshot: Snapshot,
    source: str,
    ports: list[tuple[str, float | None, float | None]] | None,
    noun: str,
) -> list[str]:
    """One line per (name, tx, rx) port; ``None``: the source gave no rates (its line says
    why)."""
    if ports is None:
        return [f"  {source}: {_down(snapshot, source)}"]
    if not ports:
        return [f"  {source}: no {noun}"]
    rows = [f"  {name}  tx {_rate(tx)}  rx {_rate(rx)}" for name, tx, rx in ports]
    return _capped(rows, len(rows), noun)


def _jobs(snapshot: Snapshot) -> list[str]:
    jobs = snapshot.derived.jobs
    if not jobs:
        return ["Jobs: none"]
    rows = []
    for job in jobs:
        gpus = ",".join(str(g) for g in job.gpus) or "none"
        state = "running" if job.running else "ended"
        rows.append(
            f"  job {job.job_id}  user {job.user or '?'}  GPUs {gpus}  {state}"
            f"  {len(job.tasks)} tasks"
        )
    return [f"Jobs: {len(jobs)}", *_capped(rows, len(rows), "jobs")]


def _sources(document: dict[str, Any]) -> list[str]:
    """Each source's state, several to a line: ``disks ok 1.2 ms``."""
    cells = []
    for name, entry in document["sources"].items():
        state = "ok" if entry["ok"] else "DOWN"
        cells.append(f"{name} {state} {entry['duration_seconds'] * 1000:.1f} ms")
    lines = ["Sources:"]
    for at in range(0, len(cells), 4):
        lines.append("  " + "   ".join(cells[at : at + 4]))
    lines += [
        f"  {name}: {entry['error']}"
        for name, entry in document["sources"].items()
        if not entry["ok"] and entry["error"]
    ]
    return lines
