"""``nodescope``: the daemon and the tools around it.

Each subcommand lives in its own module exposing ``register(subparsers, parents)``, which adds
the subcommand and sets ``func(args) -> exit status``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from nodescope import __version__
from nodescope.cli.common import roots_parent

COMMANDS = (
    "nodescope.cli.run",
    "nodescope.cli.snapshot",
    "nodescope.cli.check",
    "nodescope.cli.topo",
    "nodescope.cli.iostat",
    "nodescope.cli.alerts",
    "nodescope.cli.replay",
    "nodescope.cli.demo",
    "nodescope.cli.slurm",
    "nodescope.cli.report",
    "nodescope.cli.probe",
    "nodescope.cli.analyze",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nodescope",
        description="Node agent for GPU training clusters.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"nodescope {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parents = [roots_parent()]
    for name in COMMANDS:
        importlib.import_module(name).register(subparsers, parents)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status: int = args.func(args)
    except BrokenPipeError:
        # `nodescope topo | head` closes the pipe: not an error of ours.
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        return 130
    return status


if __name__ == "__main__":
    sys.exit(main())
