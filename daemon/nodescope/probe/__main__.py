"""``python -m nodescope.probe``: measure, judge against ``[probe]``, print, exit.

Exit status: 0 every threshold held, 1 one did not (the first reason is one line on stderr,
for the Slurm prolog), 2 bad usage or configuration, 3 nothing could be measured (torch
missing, a CUDA error). ``--json`` prints the report (:mod:`nodescope.model.probe`) on
stdout instead of the table; the progress bar goes to stderr when that is a terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from nodescope import assembly
from nodescope.errors import ConfigError, ParseError
from nodescope.model.probe import EXIT_NOT_MEASURED, EXIT_USAGE, report_to_json
from nodescope.model.topology import Topology
from nodescope.probe import table, verdict
from nodescope.probe.sweep import FULL, QUICK, SIZES_HELP, sizes_argument, with_sizes
from nodescope.roots import ROOT_NAMES, Roots
from nodescope.safedir import open_directory

if TYPE_CHECKING:
    from nodescope.sources.nvml import NvmlAdapter

PROG = "nodescope probe"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    add_arguments(parser)
    for name in ROOT_NAMES:
        parser.add_argument(f"--{name}", metavar="DIR", default=None, help=argparse.SUPPRESS)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options ``nodescope probe`` shares with this entry point."""
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
        "--cpu",
        action="store_true",
        help="use the CPU stand-in even when GPUs are present (tests the probe itself)",
    )
    parser.add_argument(
        "--write-report",
        metavar="FILE",
        help="also write the JSON report to FILE (atomically), e.g. for the daemon to export",
    )


def write_atomically(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it over ``path``. The
    directory is reached from ``/`` without following a link another user made
    (:func:`nodescope.safedir.open_directory`: root writes the daemon's copy under the run
    root), and both names are used relative to it."""
    target = Path(path)
    dir_fd = open_directory(target.parent, create=True, private=False)
    temporary = f".{target.name}.{os.getpid()}.{os.urandom(6).hex()}"
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(temporary, flags, 0o644, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
            os.replace(temporary, target.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=dir_fd)
            raise
    finally:
        os.close(dir_fd)


def _topology(roots: Roots) -> Topology | None:
    from nodescope.sources.pci import read_topology

    try:
        return read_topology(roots)
    except (OSError, ParseError):
        return None


def nvlink_counts(
    roots: Roots, topology: Topology | None, nvml: NvmlAdapter | None = None
) -> Mapping[frozenset[str], int]:
    """NVLink counts of GPU pairs by PCI address, for the pairs' paths (``NV#``): from
    ``nvml``, or from the host's NVML when the tree is this host's (NVML describes the GPUs of
    this host only); empty where NVML does not answer."""
    if topology is None:
        return {}
    if nvml is None:
        if roots.sysfs != Roots().sysfs:
            return {}
        try:
            import pynvml
        except ImportError:
            return {}
        nvml = pynvml
    from nodescope.model.nvlink_graph import NvLinkGraph, attach
    from nodescope.sources.nvml import NvmlSource

    source = NvmlSource(nvml, watch_xids=False)
    try:
        graph = NvLinkGraph.from_gpus(source.collect(roots).gpus)
    except Exception:  # no driver, an NVML error: the paths fall back to the PCIe classes
        return {}
    finally:
        source.close()
    return attach(graph, topology).counts_by_bdf()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = assembly.load(args.config) if args.config else assembly.default_config()
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    roots = config.roots.with_overrides(**{n: getattr(args, n) for n in ROOT_NAMES})
    # CUDA numbers GPUs fastest first by default; in bus order they match NVML and sysfs.
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    # torch warns at import when NumPy is absent; the probe does not use NumPy. The variable
    # carries the filter into the all-reduce ranks, which are fresh interpreters.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    quiet = "ignore:Failed to initialize NumPy"
    os.environ["PYTHONWARNINGS"] = ",".join(
        w for w in (os.environ.get("PYTHONWARNINGS"), quiet) if w
    )
    try:
        from nodescope.probe import measure
    except ImportError as exc:
        print(
            f"{PROG}: cannot import torch ({exc}); install the probe extra:"
            " pip install 'nodescope[probe]' (torch==2.13.0)",
            file=sys.stderr,
        )
        return EXIT_NOT_MEASURED
    measure.configure_threads()
    plan = QUICK if args.quick else FULL
    if args.sizes is not None:
        plan = with_sizes(plan, args.sizes)
    topology = _topology(roots)
    try:
        report = measure.measure(
            plan,
            quick=args.quick,
            topology=topology,
            progress_stream=sys.stderr,
            with_allreduce=not args.no_allreduce,
            force_cpu=args.cpu,
            allreduce_timeout=min(120.0, config.probe.timeout_seconds),
            custom_sizes=args.sizes is not None,
            nvlinks=None if args.cpu else nvlink_counts(roots, topology),
        )
    except (RuntimeError, OSError) as exc:
        print(f"{PROG}: could not measure: {exc}".splitlines()[0], file=sys.stderr)
        return EXIT_NOT_MEASURED
    report = verdict.judge(report, config.probe)
    document = json.dumps(report_to_json(report), indent=2) + "\n"
    if args.write_report:
        write_atomically(args.write_report, document)
    sys.stdout.write(document if args.json else table.render(report))
    sys.stdout.flush()
    if report.stand_in and not args.json:
        print(f"{PROG}: measured the CPU stand-in (no GPU)", file=sys.stderr)
    if not report.passed:
        print(f"{PROG}: FAILED: {verdict.reason(report.failures)}", file=sys.stderr)
    return verdict.exit_status(report)


if __name__ == "__main__":
    sys.exit(main())
