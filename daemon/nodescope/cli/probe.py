"""`nodescope probe`: PCIe copy bandwidth per GPU, the GPU pair matrix and a local
all-reduce, judged against the [probe] thresholds (the Slurm prolog's health gate).

--sizes 4K,64K,1M,256M replaces the sizes of the copy sweep and of the all-reduce (units K,
M, G are powers of 1024); the report records the sizes used. Beside its bandwidth the
all-reduce reports the latency of small messages (8 B to 4 KiB unless --sizes gives sizes
that small): each all-reduce timed on its own, the median and the 99th percentile, where a
hidden barrier of a few microseconds shows as a raised floor. A GPU pair whose two
directions differ is named with the path of the slower one as `nvidia-smi topo -m` names it
(NV#, PIX, PXB, PHB, NODE, SYS) and the NUMA nodes of both GPUs: a SYS path crosses the
SMP interconnect between sockets, a common cause of a bias of tens of per cent.

The measuring runs in its own process, `python -m nodescope.probe`, so torch stays out of
this one; its output and exit status are passed through: 0 passed, 1 a threshold failed
(one line on stderr says which), 2 bad usage or configuration, 3 nothing measured. Without
a GPU it measures a CPU stand-in (host memory copies, gloo) and says so.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from nodescope import assembly
from nodescope.cli.common import roots_from_args
from nodescope.errors import ConfigError, ParseError
from nodescope.hooks.transport import HookUnavailable, call, socket_path
from nodescope.model.probe import EXIT_FAILED, EXIT_NOT_MEASURED, EXIT_USAGE, report_to_json
from nodescope.probe.sweep import SIZES_HELP, format_sizes, sizes_argument
from nodescope.probe_runner import outcome_from_answer
from nodescope.roots import ROOT_NAMES
from nodescope.sources.probe_report import state_path


def register(subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "probe",
        parents=parents,
        help="measure PCIe and GPU pair bandwidth and all-reduce latency (torch); exit status"
        " for the prolog",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer sizes (64K..256M by 16) and iterations: within 15 s on 8 GPUs",
    )
    parser.add_argument(
        "--sizes", metavar="LIST", type=sizes_argument, default=None, help=SIZES_HELP
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--config", metavar="FILE", help="TOML configuration ([probe] thresholds)")
    parser.add_argument("--no-allreduce", action="store_true", help="skip the local all-reduce")
    parser.add_argument(
        "--cpu", action="store_true", help="use the CPU stand-in even when GPUs are present"
    )
    parser.add_argument(
        "--record",
        action="store_true",
        help="also write the report under the run root (/run/nodescope/probe-report.json),"
        " where the daemon exports it as metrics",
    )
    parser.add_argument(
        "--via-daemon",
        action="store_true",
        help="ask the running daemon to probe (its hook socket under the run root) and wait"
        " for the result; the daemon records it for /metrics",
    )
    parser.set_defaults(func=run)


def command(args: argparse.Namespace, python: str = sys.executable) -> list[str]:
    """The probe process's command line for these arguments."""
    cmd = [python, "-m", "nodescope.probe"]
    for flag in ("quick", "json", "no_allreduce", "cpu"):
        if getattr(args, flag):
            cmd.append("--" + flag.replace("_", "-"))
    if args.sizes is not None:
        cmd.append(f"--sizes={format_sizes(args.sizes)}")
    if args.config:
        cmd += ["--config", args.config]
    for name in ROOT_NAMES:
        value = getattr(args, name, None)
        if value is not None:
            cmd.append(f"--{name}={value}")
    if args.record:
        try:
            base = assembly.load(args.config).roots if args.config else None
        except ConfigError:
            base = None  # the probe process reports the configuration error itself
        cmd += ["--write-report", str(state_path(roots_from_args(args, base)))]
    return cmd


def via_daemon(
    args: argparse.Namespace, poll_seconds: float = 0.5, sleep: Callable[[float], None] = time.sleep
) -> int:
    """Start a probe in the daemon, poll for its outcome, print it like a local run."""
    try:
        config = assembly.load(args.config) if args.config else assembly.default_config()
    except ConfigError as exc:
        print(f"nodescope probe: {exc}", file=sys.stderr)
        return EXIT_USAGE
    path = socket_path(roots_from_args(args, config.roots))
    request: dict[str, Any] = {
        "command": "probe",
        "quick": args.quick,
        "no_allreduce": args.no_allreduce,
    }
    if args.sizes is not None:
        request["sizes"] = list(args.sizes)
    deadline = time.monotonic() + config.probe.timeout_seconds + 30
    try:
        started = call(path, request)
        if not started.get("ok"):
            print(f"nodescope probe: the daemon refused: {started.get('error')}", file=sys.stderr)
            return EXIT_NOT_MEASURED
        if not started.get("started"):
            print("nodescope probe: the daemon is already probing; waiting for it", file=sys.stderr)
        while True:
            answer = call(path, {"command": "probe_result"})
            if not answer.get("running") and answer.get("id") == started.get("id"):
                break
            if time.monotonic() > deadline:
                print("nodescope probe: no result from the daemon in time", file=sys.stderr)
                return EXIT_NOT_MEASURED
            sleep(poll_seconds)
        outcome = outcome_from_answer(answer)
    except (HookUnavailable, ParseError) as exc:
        print(f"nodescope probe: {exc}", file=sys.stderr)
        return EXIT_NOT_MEASURED
    if outcome.report is None:
        print(f"nodescope probe: nothing measured: {outcome.reason}", file=sys.stderr)
        return outcome.status
    if args.json:
        sys.stdout.write(json.dumps(report_to_json(outcome.report), indent=2) + "\n")
    else:
        # The table is torch-free; imported here so that other subcommands do not load it.
        from nodescope.probe.table import render

        sys.stdout.write(render(outcome.report))
    if outcome.status == EXIT_FAILED:
        print(f"nodescope probe: FAILED: {outcome.reason}", file=sys.stderr)
    return outcome.status


def run(args: argparse.Namespace) -> int:
    if args.via_daemon:
        return via_daemon(args)
    try:
        return subprocess.call(command(args))
    except OSError as exc:
        print(f"nodescope probe: cannot start the probe: {exc}", file=sys.stderr)
        return EXIT_USAGE
