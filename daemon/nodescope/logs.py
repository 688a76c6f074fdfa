"""Logging as ``key=value`` lines on stderr; journald adds time, host and unit."""

from __future__ import annotations

import logging
import sys

from nodescope.text import sanitize

#: The longest message of one log line.
MAX_MESSAGE = 4000


class SafeFormatter(logging.Formatter):
    """Every message through the sanitiser: a log line may quote a process name, a path or a
    kernel message a user wrote, and journald, a terminal running ``journalctl`` or a log
    shipper must get one line of text, not an escape sequence or a forged second line."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = sanitize(record.message, MAX_MESSAGE)
        return super().formatMessage(record)


_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}


def setup(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(SafeFormatter("level=%(levelname)s logger=%(name)s %(message)s"))
    root = logging.getLogger("nodescope")
    root.handlers[:] = [handler]
    root.propagate = False
    set_level(level)


def set_level(level: str) -> None:
    logging.getLogger("nodescope").setLevel(_LEVELS.get(level, logging.ERROR))
