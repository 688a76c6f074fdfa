"""``python -m nodescope.sim.run_node SCENARIO ROOT``: a simulated node in a process of its own.

Materialises the scenario's node under ``ROOT`` (empty or absent) and keeps it moving, so a
daemon started separately (``nodescope run --sysfs ROOT/sys --procfs ROOT/proc …``, or the
benchmark's daemon in ``bench/``) reads files that change under it, with none of the
simulator's work in the daemon's process. The fake NVML cannot be shared between processes:
its state is published after every tick to ``ROOT/nvml-state.json``
(:mod:`nodescope.sim.nvml_mirror`) for a :class:`~nodescope.sim.nvml_mirror.MirroredNvml` to
follow.

Two ways to run:

* real time (default): simulated time is the wall time since the start, until
  SIGTERM/SIGINT. The daemon in another process cannot ask for a refresh before it reads, as
  the demo's sources do, so the node refreshes on its own: every ``--refresh`` seconds (0.1
  by default) the files the daemon reads every second (``/proc/diskstats`` and the other
  ``/proc`` files, the InfiniBand counters) and the NVML state are brought to the present,
  so such a counter is at most that old when read; once per ``tick_seconds`` every file,
  a read of the nvlink_counter module (its window, one per tick) and the churn. The process
  and cgroup files are read every 10 to 15 s: a tick old at most, they are within a tenth of
  their interval, and writing them ten times a second would cost the simulator several times
  its CPU (dgx-h100: 21 % of a core instead of 7 %). Past the scenario's end the node goes
  on at the rates its open-ended activities leave (as ``nodescope demo`` does). After a
  stall the next refresh is at the present.
* ``--stepped``: for each line ``T`` read on stdin, advance to simulated second ``T`` and
  answer one JSON line ``{"t": T, "active": [...], "ended": [...]}`` (the churn jobs' ids)
  when the files are written; exits at end of input. A driver in simulated time (the soak)
  runs the daemon's cycle between two steps.

``--churn-slots K --churn-every N`` adds K short jobs that take turns, one ending and one
starting every N ticks (:mod:`nodescope.sim.churn`). "ready" is printed on stdout once the
node is materialised at t = 0.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from nodescope.sim.churn import JobChurn
from nodescope.sim.node import EPOCH, Part, SimulatedNode
from nodescope.sim.nvml_mirror import STATE_FILE, XidRecorder, state_document, write_state
from nodescope.sim.scenario import load_scenario

#: How stale a counter read in real time may be: 10 % of one second between two reads.
DEFAULT_REFRESH_SECONDS = 0.1
#: What a refresh between two ticks writes: the counters the daemon reads every second.
REFRESHED_PARTS = frozenset({Part.PROC_FILES, Part.INFINIBAND})


class NodeProcess:
    """The node, its churn and the NVML state file, advanced together."""

    def __init__(self, node: SimulatedNode, churn: JobChurn | None, state_path: Path) -> None:
        self.node = node
        self.churn = churn
        self.state_path = state_path
        self.xids = XidRecorder(node.nvml)

    def advance(self, t: float) -> None:
        """One tick at ``t``: every file, a read of the nvlink_counter module, the churn."""
        self.node.advance_to(t)
        if self.churn is not None:
            self.churn.apply(t)
        self._publish(t)

    def refresh(self, t: float) -> None:
        """The files read every second and the NVML state at ``t``, between two ticks."""
        self.node.move_to(t, REFRESHED_PARTS)
        if self.churn is not None:
            self.churn.add_gpu_processes()
        self._publish(t)

    def _publish(self, t: float) -> None:
        document = state_document(self.node.nvml, t, EPOCH, self.xids.drain())
        write_state(self.state_path, document)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nodescope.sim.run_node",
        description="Run a simulated node in this process, writing its trees under ROOT.",
    )
    parser.add_argument("scenario", help="bundled scenario name or scenario file")
    parser.add_argument("root", type=Path, help="directory to materialise the node in")
    parser.add_argument("--stepped", action="store_true", help="advance on stdin lines")
    parser.add_argument("--tick", type=float, help="seconds per tick (default: the scenario's)")
    parser.add_argument(
        "--refresh",
        type=float,
        default=DEFAULT_REFRESH_SECONDS,
        metavar="SECONDS",
        help="real time: seconds between refreshes of the files (default: %(default)s)",
    )
    parser.add_argument("--churn-slots", type=int, default=0, metavar="K")
    parser.add_argument("--churn-every", type=int, default=50, metavar="N")
    return parser


def run_in_real_time(
    process: NodeProcess,
    tick: float,
    refresh: float,
    stop: threading.Event,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Move the node with the wall clock until ``stop`` is set: a refresh every ``refresh``
    seconds, a tick's work once per ``tick`` seconds."""
    started = clock()
    next_tick = tick
    n = 0
    while True:
        n += 1
        if stop.wait(max(0.0, started + n * refresh - clock())):
            return
        t = clock() - started
        # After a stall, go on from the present rather than catching up missed refreshes.
        n = max(n, int(t / refresh))
        if t >= next_tick:
            process.advance(t)
            next_tick = (math.floor(t / tick) + 1) * tick
        else:
            process.refresh(t)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not (math.isfinite(args.refresh) and args.refresh > 0):
        print(
            f"--refresh must be a positive number of seconds, not {args.refresh}", file=sys.stderr
        )
        return 2
    scenario = load_scenario(args.scenario)
    tick = args.tick or scenario.tick_seconds
    node = SimulatedNode(scenario, args.root)
    node.materialise()
    churn = (
        JobChurn(node.roots, node.nvml, args.churn_slots, args.churn_every)
        if args.churn_slots
        else None
    )
    process = NodeProcess(node, churn, args.root / STATE_FILE)
    process.advance(0.0)
    print("ready", flush=True)
    if args.stepped:
        for line in sys.stdin:
            if not line.strip():
                continue
            t = float(line)
            process.advance(t)
            reply = {
                "t": t,
                "active": sorted(churn.active_ids()) if churn else [],
                "ended": [str(j) for j in churn.ended] if churn else [],
            }
            print(json.dumps(reply), flush=True)
        return 0
    stop = threading.Event()

    def on_stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    run_in_real_time(process, tick, min(args.refresh, tick), stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
