"""`nodescope iostat`."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("iostat", parents=parents, help="(not yet built)")
    parser.set_defaults(func=lambda args: 1)
