"""`nodescope topo`."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("topo", parents=parents, help="(not yet built)")
    parser.set_defaults(func=lambda args: 1)
