"""Text a user controls, made safe where it leaves nodescope: Slurm drain reasons, log lines
and what the command line prints on an operator's terminal.

Any user names their processes (``/proc/<pid>/comm`` takes any 15 bytes but NUL), their
files, their jobs' output; those names reach findings, alert messages, job reports and drain
reasons. Two functions here are the ways such text leaves: :func:`escape` for a log field
(lossless: the log is evidence, so every character reads back), :func:`sanitize` for
everything else, a drain reason and what a terminal shows:

* always: one line of printable characters. Control characters (C0, DEL, C1: an ESC starts a
  terminal escape sequence that can retitle a window, move the cursor, rewrite what was printed
  or, on some terminals, answer back as input), Unicode format characters (bidirectional
  overrides that make a line read differently from what it holds), line and paragraph
  separators, lone surrogates (a name that is not valid UTF-8, decoded with
  ``surrogateescape``) and unassigned code points become ``?``, a run of them one ``?``;
  bytes are decoded as UTF-8 with invalid sequences replaced;
* ``ascii_only`` (a drain reason, which travels as one argument of ``scontrol`` and is shown by
  ``sinfo``, ``scontrol show node`` and in Slurm's logs): only letters, digits, space and
  ``_.,:=/+()#%@-`` stay; quotes, ``$``, backticks, ``;``, ``\\``, ``<``, ``>``, ``|``, ``&``,
  ``*``, ``?``, ``!``, braces and brackets (anything a shell, scontrol's own parser or a log
  reader could take for more than text) become ``?``, and runs of blanks one space;
* cut to ``limit`` characters (``…`` marks a cut outside ``ascii_only``).

A leaf: the standard library only, so that every layer may use it.
"""

from __future__ import annotations

import re

#: What a drain reason may hold (``ascii_only``).
_NOT_REASON = re.compile(r"[^A-Za-z0-9 _.,:=/+()#%@-]+")
_BLANKS = re.compile(r"\s+")
#: Longest text :func:`sanitize` keeps by default: a log line or one line of a terminal.
DEFAULT_LIMIT = 1000
#: A logfmt value that needs no quotes: printable, no blank, quote, ``=`` or backslash.
_BARE = re.compile(r"[^\s\"=\\]+")


def cut(text: str, limit: int) -> str:
    """``text`` at most ``limit`` characters, ``…`` marking a cut."""
    return text if len(text) <= limit else text[: max(0, limit - 1)] + "…"


def escape(value: str, limit: int = DEFAULT_LIMIT) -> str:
    """``value`` as one logfmt value: bare when it is a non-empty run of printable characters
    without blank, ``"``, ``=`` or ``\\``; otherwise in double quotes with ``\\`` and ``"``
    escaped and every character that is not printable written as ``\\n``, ``\\t``,
    ``\\xNN``, ``\\uNNNN`` or ``\\UNNNNNNNN`` (an ESC, a line break, a bidirectional
    override, a lone surrogate of a name that is not UTF-8). Cut at ``limit`` characters first."""
    value = cut(value, limit)
    if value and value.isprintable() and _BARE.fullmatch(value):
        return value
    escaped = []
    for char in value:
        if char in '"\\':
            escaped.append("\\" + char)
        elif char == "\n":
            escaped.append("\\n")
        elif char == "\t":
            escaped.append("\\t")
        elif not char.isprintable():
            code = ord(char)
            escaped.append(
                f"\\x{code:02x}"
                if code < 0x100
                else f"\\u{code:04x}"
                if code < 0x10000
                else f"\\U{code:08x}"
            )
        else:
            escaped.append(char)
    return '"' + "".join(escaped) + '"'


def sanitize(text: str | bytes, limit: int = DEFAULT_LIMIT, *, ascii_only: bool = False) -> str:
    """``text`` as one safe line (see the module docstring); at most ``limit`` characters."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    if ascii_only:
        cleaned = _NOT_REASON.sub("?", _BLANKS.sub(" ", text[: limit * 4]))
        return " ".join(cleaned.split())[:limit].rstrip()
    cut = text[: limit + 1]
    if not cut.isprintable():
        out: list[str] = []
        replaced = False
        for char in cut:
            if char.isprintable():
                out.append(char)
                replaced = False
            elif not replaced:
                out.append("?")
                replaced = True
        cut = "".join(out)
    if len(cut) > limit:
        cut = cut[: max(0, limit - 1)] + "…"
    return cut


def sanitize_lines(text: str, limit: int = DEFAULT_LIMIT) -> str:
    """Several lines for a terminal (a rendered report): each line through :func:`sanitize`,
    the line breaks kept, a trailing one too."""
    lines = text.split("\n")
    return "\n".join(sanitize(line, limit) for line in lines)
