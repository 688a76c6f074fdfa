"""Log lines on stderr: logfmt (``key=value``) or JSON, one record a line.

Every log call in nodescope writes its message as ``key=%s`` pairs (``"source=%s state=down
error=%s"``), so a record is a list of fields, not prose. The formatter reads those fields from
the call's template and arguments and writes each value by one quoting rule, whatever the call
used (``%s`` or ``%r``):

* ``logfmt``: each value as :func:`nodescope.text.escape` writes it — bare when it is a
  non-empty run of printable characters without space, ``"`` or ``=``; otherwise in double
  quotes with ``\\``, ``"`` and every character that is not printable escaped. A process name
  or a path a user chose therefore stays one field on one line, carries no escape sequence to a
  terminal, and reads back exactly (the evidence a log is for).
* ``json``: one object per line, the same fields as strings (numbers as the call formatted them),
  ``json`` escaping every character outside ASCII.

A value is cut at :data:`MAX_VALUE` characters.

``time`` (RFC 3339, UTC, milliseconds) leads every line unless stderr is journald's stream
(``JOURNAL_STREAM`` names stderr's device and inode, as systemd sets it), which stamps each line
itself; then ``level`` and ``logger``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from datetime import UTC, datetime
from typing import TextIO

from nodescope.text import cut, escape

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
FORMATS = ("logfmt", "json")
#: The longest value of one field: a log line stays a line a reader can take in.
MAX_VALUE = 4000

#: One ``%`` directive of a template: flags, width, precision and the conversion.
_DIRECTIVE = re.compile(r"%[-#0 +]*(?:\d+)?(?:\.\d+)?[sdrifgex]")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


def fields(record: logging.LogRecord) -> list[tuple[str, str]]:
    """The record's ``key=value`` fields, values as the call formatted them. A message that is
    not a sequence of ``key=value`` tokens is one field, ``msg``."""
    template = record.msg if isinstance(record.msg, str) else str(record.msg)
    args = record.args if isinstance(record.args, tuple) else ()
    out: list[tuple[str, str]] = []
    remaining = list(args)
    for token in template.split():
        key, sep, value = token.partition("=")
        if not sep or not _KEY.fullmatch(key):
            return [("msg", record.getMessage())]
        directives = _DIRECTIVE.findall(value)
        if len(directives) > len(remaining):
            return [("msg", record.getMessage())]
        taken = tuple(remaining[: len(directives)])
        del remaining[: len(directives)]
        try:
            # %r of a string would put Python's quotes in the value; the quoting rule is ours.
            plain = _DIRECTIVE.sub(
                lambda m: "%s" if m.group(0).endswith("r") else m.group(0), value
            )
            out.append((key, plain % taken if directives else value))
        except (TypeError, ValueError):
            return [("msg", record.getMessage())]
    if remaining:
        return [("msg", record.getMessage())]
    return out


def rfc3339(created: float) -> str:
    stamp = datetime.fromtimestamp(created, tz=UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z"


class FieldFormatter(logging.Formatter):
    def __init__(self, form: str = "logfmt", *, with_time: bool = True) -> None:
        super().__init__()
        if form not in FORMATS:
            raise ValueError(f"log format must be one of {', '.join(FORMATS)}")
        self.form = form
        self.with_time = with_time

    def format(self, record: logging.LogRecord) -> str:
        head: list[tuple[str, str]] = []
        if self.with_time:
            head.append(("time", rfc3339(record.created)))
        head += [("level", record.levelname.lower()), ("logger", record.name)]
        body = fields(record)
        if record.exc_info:
            body.append(("exception", self.formatException(record.exc_info)))
        if self.form == "json":
            return json.dumps({k: cut(v, MAX_VALUE) for k, v in head + body}, ensure_ascii=True)
        return " ".join(f"{key}={escape(value, MAX_VALUE)}" for key, value in head + body)


def under_journald(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (stderr) is the journal's: systemd sets ``JOURNAL_STREAM`` to its
    ``device:inode``, so a redirected stderr is told apart from the unit's own."""
    stream = sys.stderr if stream is None else stream
    expected = os.environ.get("JOURNAL_STREAM", "")
    if not expected:
        return False
    try:
        st = os.fstat(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return False
    return expected == f"{st.st_dev}:{st.st_ino}"


def setup(level: str = "info", form: str = "logfmt") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(FieldFormatter(form, with_time=not under_journald()))
    root = logging.getLogger("nodescope")
    root.handlers[:] = [handler]
    root.propagate = False
    set_level(level)


def set_level(level: str) -> None:
    logging.getLogger("nodescope").setLevel(LEVELS.get(level, logging.ERROR))


def current_format() -> str:
    """The format nodescope's log lines are written in now (``logfmt`` until :func:`setup` says
    otherwise): what the serving process, which imports none of this, is told to use."""
    for handler in logging.getLogger("nodescope").handlers:
        formatter = handler.formatter
        if isinstance(formatter, FieldFormatter):
            return formatter.form
    return "logfmt"
