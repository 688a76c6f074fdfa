"""A plain progress bar on stderr, drawn only when stderr is a terminal: the probe's copies,
``nodescope replay``'s simulated time, a fleet's start.

Logs and the prolog's captured stderr get nothing from it: carriage-return redraws are noise
in a file.
"""

from __future__ import annotations

from typing import TextIO

WIDTH = 30


def render(done: int, total: int, label: str, width: int = WIDTH) -> str:
    """``[##########--------------------]  12/40  h2d GPU0 16M``."""
    total = max(total, 1)
    done = min(max(done, 0), total)
    filled = done * width // total
    digits = len(str(total))
    return f"[{'#' * filled}{'-' * (width - filled)}] {done:>{digits}}/{total}  {label}"


class Progress:
    """Counts steps out of ``total``; draws on ``stream`` when ``enabled``."""

    def __init__(self, total: int, stream: TextIO, enabled: bool | None = None) -> None:
        self.total = total
        self.done = 0
        self.stream = stream
        self.enabled = stream.isatty() if enabled is None else enabled
        self._last_width = 0

    def step(self, label: str, count: int = 1) -> None:
        self.done += count
        self.show(label)

    def show(self, label: str) -> None:
        if not self.enabled:
            return
        line = render(self.done, self.total, label)
        pad = " " * max(0, self._last_width - len(line))
        self._last_width = len(line)
        self.stream.write(f"\r{line}{pad}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._last_width:
            self.stream.write("\r" + " " * self._last_width + "\r")
            self.stream.flush()
            self._last_width = 0
