"""Logging as ``key=value`` lines on stderr; journald adds time, host and unit."""

from __future__ import annotations

import logging
import sys

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}


def setup(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("level=%(levelname)s logger=%(name)s %(message)s"))
    root = logging.getLogger("nodescope")
    root.handlers[:] = [handler]
    root.propagate = False
    set_level(level)


def set_level(level: str) -> None:
    logging.getLogger("nodescope").setLevel(_LEVELS.get(level, logging.ERROR))
