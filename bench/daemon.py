"""The daemon under test in the benchmark: ``nodescope run``'s service, against a simulated
node that runs in another process (``python -m nodescope.sim.run_node``).

Everything but NVML is the daemon a node runs: the configuration's defaults (1 s tick, every
source at its default interval), the Collector, the analysis step, the exposition rendered
as the daemon renders it (each cycle while scrapes come every cycle, else when one asks) and
the HTTP server (a serving process the daemon starts, which the
benchmark measures with it). The sources are the simulated node's, those of
:meth:`nodescope.sim.node.SimulatedNode.sources` (the registry's tree sources reading
``ROOT/sys``, ``ROOT/proc``, ``ROOT/sys/fs/cgroup``, ``ROOT/dev``, ``ROOT/run``; no udev
monitor), built here without importing the simulator, which a node's daemon never
loads (its modules alone are 5 MiB of the measured RSS); a unit test holds the two lists
equal but for the rtnetlink sources: the simulated node has no network namespace, so the
``netdev`` source and ``link_events``' monitor read this machine's, as they would a node's.
NVML is the other difference: the NVML source (with its production settings) runs over a
:class:`~nodescope.sim.nvml_mirror.MirroredNvml`, a fake NVML that takes the simulator's GPU
state from ``ROOT/nvml-state.json`` before each read. That refresh is simulation plumbing; its
CPU time is measured on its own and reported in the stats file, so it can be taken out.

On SIGTERM the service stops and ``--stats FILE`` receives, as JSON, each cycle's end
(CLOCK_MONOTONIC, comparable across processes) and main-thread CPU seconds, and the mirror's
refresh CPU.

``--record-files FILE`` makes this a recording run instead, for the benchmark's floor
(``bench/floor.py``): an audit hook notes every file, directory and link the process reads
under ROOT in ``--record-cycles`` cycles after ``--record-skip`` cycles of warm-up (the first
cycle reads everything), the file list goes to FILE and the daemon stops. The hook stays for
the life of the process and costs CPU on every audited call, so a recording run is never the
one measured.

    python bench/daemon.py ROOT --listen 127.0.0.1:9841 --stats stats.json
    python bench/daemon.py ROOT --listen 127.0.0.1:9842 --record-files files.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import floor  # bench/floor.py, beside this script

from nodescope import logs
from nodescope.assembly import default_config
from nodescope.collect import Collector
from nodescope.roots import Roots
from nodescope.service import Service
from nodescope.sim.nvml_mirror import STATE_FILE, MirroredNvml
from nodescope.sources.base import Source
from nodescope.sources.infiniband import InfinibandSource
from nodescope.sources.link_events import LinkEventsSource
from nodescope.sources.nvml import NvmlSource
from nodescope.sources.registry import SOURCE_TABLE, SourceInputs, simulated_specs
from nodescope.sources.udev import UdevSource


class MirroredNvmlSource:
    """The NVML source, after taking the simulator's latest GPU state."""

    name = "nvml"

    def __init__(self, mirror: MirroredNvml) -> None:
        self.mirror = mirror
        self.inner = NvmlSource(mirror, wall_clock=mirror.wall_clock)

    def collect(self, roots: Roots) -> Any:
        self.mirror.refresh()
        return self.inner.collect(roots)

    def close(self) -> None:
        self.inner.close()


def node_sources(mirror: MirroredNvml, inputs: SourceInputs) -> list[Source]:
    """The simulated node's source list (the specs it runs, in their order) at each source's
    production cadence, with the NVML source over the mirror, and the interface dump;
    ``inputs``: what they share, for their collector."""
    # No device monitor: the node's devices change only in its trees, and the node steps in
    # another process, so no device event reaches this daemon. The simulated node has no
    # network namespace of its own; the sources a real node runs on rtnetlink (the interface
    # dump every second, the link monitor's thread) read this machine's, so their cost is in
    # the figures too.
    stand_ins: dict[str, Source] = {
        "nvml": MirroredNvmlSource(mirror),
        "udev": UdevSource(monitor=None, topology=inputs.topology),
        "link_events": LinkEventsSource(netlink=True),
    }
    # The bench's node drops no traces: ``traces`` has no spool to read.
    simulated = [spec for spec in simulated_specs() if spec.name != "traces"]
    sources: list[Source] = []
    for spec in SOURCE_TABLE:
        if spec.sim_stand_in:
            sources.append(stand_ins[spec.name])
        elif spec in simulated or spec.name == "netdev":
            sources.append(spec.make(inputs))
    for source in sources:
        if isinstance(source, InfinibandSource):
            # Its slow counters' span is timed on the node's clock, as NVML's is.
            source.clock = mirror.wall_clock
    return sources


def time_calls(owner: Any, method: str, totals: dict[str, float], key: str) -> None:
    """Add the CPU time of each call of ``owner.method``, on the clock of the thread that
    makes it, to ``totals[key]``: an attribute of that one object, so the code under test is
    unchanged."""
    inner: Callable[..., Any] = getattr(owner, method)

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[key] += time.thread_time() - started

    setattr(owner, method, timed)


class PartClocks:
    """CPU time per part of the daemon, on the clock of the thread that runs it (a source's
    collect on the collector's worker, a render on the render thread): every source, the
    analysis, each document's render, the self-measurement. ``log`` holds the running totals
    at each cycle's end, so the benchmark can take them over any window of cycles."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.totals: dict[str, float] = {}
        self.log: list[list[float]] = []

    def wrap(self, owner: Any, method: str, part: str) -> None:
        """Time ``owner.method`` as ``part`` (several methods may share one part)."""
        if part not in self.totals:
            self.names.append(part)
            self.totals[part] = 0.0
        time_calls(owner, method, self.totals, part)

    def end_cycle(self) -> None:
        self.log.append([self.totals[name] for name in self.names])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--listen", default="127.0.0.1:9841")
    parser.add_argument("--stats", type=Path)
    parser.add_argument("--record-files", type=Path, help="a recording run: the file list")
    parser.add_argument("--record-skip", type=int, default=2)
    # 30: the longest default interval (pci, probe), and three periods of slow_every (10), so
    # the recorded cycles are one whole period of the daemon's schedule.
    parser.add_argument("--record-cycles", type=int, default=30)
    args = parser.parse_args(argv)

    mirror = MirroredNvml(args.root / STATE_FILE)
    config = default_config(
        listen=args.listen, tick_seconds=1.0, log_level="warning", roots=Roots.under(args.root)
    )
    logs.setup(config.log_level)
    inputs = SourceInputs()
    sources = node_sources(mirror, inputs)
    service = Service(
        lambda: config, make_collector=lambda cfg: Collector.from_config(cfg, sources, inputs)
    )
    clocks = PartClocks()
    for source in sources:
        clocks.wrap(source, "collect", f"source {source.name}")
    clocks.wrap(service.analyzer, "analyze", "analysis")
    clocks.wrap(service.cache, "render_latest", "render /metrics")
    clocks.wrap(service.alerts_cache, "render_latest", "render alerts document")
    clocks.wrap(service.process_meter, "measure", "self-measurement")
    ends: list[float] = []
    cpu: list[float] = []
    run_cycle = service.run_cycle
    recorder: floor.FileRecorder | None = None
    if args.record_files is not None:
        # The simulator's GPU state file is simulation plumbing, not something a node's agent
        # reads: counted, not listed.
        recorder = floor.FileRecorder(
            args.root, args.record_skip, args.record_cycles, exclude=[STATE_FILE]
        )
        recorder.install()

    def timed_cycle() -> None:
        if recorder is not None:
            recorder.begin(len(ends))
        started = time.thread_time()
        run_cycle()
        cpu.append(time.thread_time() - started)
        ends.append(time.monotonic())
        clocks.end_cycle()
        if recorder is not None:
            recorder.end()
            if recorder.done:
                service.request_stop()

    service.run_cycle = timed_cycle  # type: ignore[method-assign]
    service.install_signal_handlers()
    service.start_server()
    status = service.run()
    if recorder is not None:
        recorder.file_list().write(args.record_files)
    if args.stats is not None:
        stats = {
            "cycle_end_monotonic": ends,
            "cycle_thread_cpu_seconds": cpu,
            "nvml_refresh_cpu_seconds": mirror.refresh_cpu_seconds,
            "nvml_refreshes": mirror.refreshes,
            "sources": [s.name for s in sources],
            "parts": clocks.names,
            "parts_cpu_cumulative": clocks.log,
        }
        args.stats.write_text(json.dumps(stats))
    return status


if __name__ == "__main__":
    sys.exit(main())
