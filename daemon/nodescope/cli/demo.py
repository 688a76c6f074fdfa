"""``nodescope demo [SCENARIO]``: the daemon against a simulated node, in real time.

Materialises the node under a temporary directory, serves ``/metrics`` for it (with the fake
NVML in place of the driver) and shows a terminal view refreshed once per second: per-GPU
PCIe and NVLink rates, disks, InfiniBand ports, source health, events. Stops on Ctrl-C,
SIGTERM or after ``--duration`` seconds, and removes its directory. ``--config`` takes the
``[alerts]`` and ``[detectors]`` tables of a configuration file (thresholds, ``for`` and
resolve times, an Alertmanager to push to); the rest of the demo's configuration is its own.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from nodescope import config as config_mod
from nodescope import logs
from nodescope.config import DEFAULT_LISTEN, parse_listen
from nodescope.errors import ConfigError, ParseError

#: Shows GPU copies and NVMe reads piling onto one root port within its first 30 s.
DEFAULT_SCENARIO = "root-port-contention"


def register(subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="serve /metrics for a simulated node in real time, with a live terminal view",
        description=(
            "Run the daemon against a simulated GPU node (no GPU needed): /metrics is served "
            "on --listen and a terminal view refreshes once per second."
        ),
    )
    parser.add_argument(
        "scenario",
        nargs="?",
        default=DEFAULT_SCENARIO,
        metavar="SCENARIO",
        help=f"bundled scenario name or file path (default {DEFAULT_SCENARIO})",
    )
    parser.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help=f"address of the /metrics server (default {DEFAULT_LISTEN})",
    )
    parser.add_argument(
        "--duration", type=float, metavar="SECONDS", help="stop after SECONDS (default: Ctrl-C)"
    )
    parser.add_argument(
        "--no-tty",
        action="store_true",
        help="print one summary block per second instead of redrawing the screen",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="take the [alerts] and [detectors] settings from this configuration file",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from nodescope.sim.scenario import load_scenario

    try:
        parse_listen(args.listen)
    except ValueError as exc:
        print(f"nodescope demo: --listen: {exc}", file=sys.stderr)
        return 2
    if args.duration is not None and args.duration <= 0:
        print("nodescope demo: --duration must be greater than 0", file=sys.stderr)
        return 2
    try:
        settings = config_mod.load(args.config) if args.config else None
    except ConfigError as exc:
        print(f"nodescope demo: {exc}", file=sys.stderr)
        return 2
    try:
        scenario = load_scenario(args.scenario)
    except (ParseError, OSError) as exc:
        print(f"nodescope demo: {exc}", file=sys.stderr)
        return 2
    tty = not args.no_tty and sys.stdout.isatty()
    # A redrawn screen has no room for log lines; plain output keeps the warnings.
    logs.setup("error" if tty else "warning")
    from nodescope.sim.driver import demo

    return demo(scenario, args.listen, duration=args.duration, tty=tty, settings=settings)
