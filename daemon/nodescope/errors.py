"""Errors that name where bad input came from."""

from __future__ import annotations


class ParseError(ValueError):
    """Input that does not match its documented format.

    ``source`` is the file (or a description of the input), ``line`` the 1-based line number
    when the format is line-oriented. The message always names both, so an operator can find
    the offending file from one log line.
    """

    def __init__(self, source: str, message: str, line: int | None = None) -> None:
        self.source = source
        self.line = line
        self.reason = message
        where = f"{source}:{line}" if line is not None else source
        super().__init__(f"{where}: {message}")


class ConfigError(ValueError):
    """A configuration file that is unreadable or invalid; names the file and the key."""

    def __init__(self, path: str, key: str | None, message: str) -> None:
        self.path = path
        self.key = key
        where = f"{path}: {key}" if key else path
        super().__init__(f"{where}: {message}")
