"""What the README and docs/ tell a reader to type or to paste: shell commands and config snippets.

Pure functions over a document's text, so the extraction is tested on its own
(tests/unit/test_doc_snippets.py) and tests/integration/test_docs_run.py runs what it finds.

A command is a line of a ``sh``/``bash``/``shell`` fenced block (comments and blank lines
dropped, backslash continuations joined), or a line starting with ``$ `` anywhere else (a
``console`` block, a plain block of a terminal session, a paragraph): there the rest of the
block is the command's output. A snippet is the body of a fenced block in a configuration
language (``toml``, ``yaml``, ``json``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

SHELL_LANGUAGES = frozenset({"sh", "bash", "shell"})
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)(?P<lang>[^\s`]*)")
_PROMPT = re.compile(r"^\s*\$ (?P<command>.+)$")


@dataclass(frozen=True, slots=True)
class Block:
    """A fenced block: its language tag (``""`` when none), the line of its opening fence
    (1-based) and its body, the fence's indentation removed."""

    lang: str
    line: int
    body: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Command:
    """One command as the reader would type it: ``text`` has its comment removed and its
    whitespace runs collapsed (how the marked list names it). ``block`` is the opening line of
    the block it belongs to (0: a prompt line outside any block): a block's commands run in
    order in one directory, as a reader pasting it would."""

    doc: str
    line: int
    block: int
    text: str


@dataclass(frozen=True, slots=True)
class Snippet:
    doc: str
    line: int
    lang: str
    text: str


def blocks(text: str) -> list[Block]:
    """Every fenced block; an unclosed one runs to the end of the document."""
    found: list[Block] = []
    opening: re.Match[str] | None = None
    start = 0
    body: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        match = _FENCE.match(line)
        if opening is None:
            if match:
                opening, start, body = match, number, []
            continue
        if match and match["fence"].startswith(opening["fence"]) and not match["lang"]:
            found.append(Block(opening["lang"].lower(), start, tuple(body)))
            opening = None
            continue
        indent = opening["indent"]
        body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
    if opening is not None:
        found.append(Block(opening["lang"].lower(), start, tuple(body)))
    return found


def strip_comment(line: str) -> str:
    """The line without a shell comment: a ``#`` at the start or after whitespace, outside
    quotes (``"a # b"``, ``${#x}`` and ``x#y`` are not comments)."""
    quote = ""
    previous = " "
    for index, char in enumerate(line):
        if quote:
            if char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char == "#" and previous.isspace():
            return line[:index].rstrip()
        previous = char
    return line.rstrip()


def normalise(command: str) -> str:
    return " ".join(command.split())


def _logical_lines(body: tuple[str, ...], first: int) -> list[tuple[int, str]]:
    """(line number, line) with backslash continuations joined onto their first line."""
    joined: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for offset, raw in enumerate(body):
        number = first + offset
        line = strip_comment(raw) if pending is None else raw.rstrip()
        if pending is not None:
            line = pending[1] + " " + line.strip()
            number = pending[0]
        if line.endswith("\\"):
            pending = (number, line[:-1])
            continue
        pending = None
        joined.append((number, line))
    if pending is not None:
        joined.append(pending)
    return joined


def _prompted(line: str) -> str:
    """The command of a ``$ `` prompt line (``""``: not one)."""
    prompt = _PROMPT.match(line)
    return normalise(strip_comment(prompt["command"])) if prompt else ""


def commands(doc: str, text: str) -> list[Command]:
    """Every command of a document, in the order it shows them."""
    found: list[Command] = []
    in_block: set[int] = set()
    for block in blocks(text):
        first = block.line + 1
        in_block.update(range(block.line, first + len(block.body) + 1))
        if block.lang in SHELL_LANGUAGES:
            for number, line in _logical_lines(block.body, first):
                command = normalise(strip_comment(line))
                if command:
                    found.append(Command(doc, number, block.line, command))
            continue
        for offset, line in enumerate(block.body):
            command = _prompted(line)
            if command:
                found.append(Command(doc, first + offset, block.line, command))
    for number, line in enumerate(text.splitlines(), start=1):
        command = _prompted(line)
        if command and number not in in_block:
            found.append(Command(doc, number, 0, command))
    return sorted(found, key=lambda c: c.line)


def snippets(doc: str, text: str, languages: frozenset[str]) -> list[Snippet]:
    return [
        Snippet(doc, block.line, block.lang, "\n".join(block.body) + "\n")
        for block in blocks(text)
        if block.lang in languages
    ]


def json_fragment(text: str) -> Any:
    """A JSON example as a value: a whole document as it is; ``"key": value`` (a member shown
    out of its object) as ``{"key": value}``; ``{...},\n{...}`` (array elements shown out of
    their array) as ``[{...}, {...}]``. Raises ValueError when none of these parses."""
    stripped = text.strip().rstrip(",")
    for candidate in (stripped, "{" + stripped + "}", "[" + stripped + "]"):
        try:
            return json.loads(candidate)
        except json.JSONDecodeError:
            continue
    raise ValueError(f"not JSON, a member or array elements: {stripped[:80]!r}")
