"""sd_notify(3) without a dependency: READY, WATCHDOG, RELOADING, STOPPING, STATUS.

The protocol is one datagram of ``KEY=VALUE`` lines to the AF_UNIX socket named by
``$NOTIFY_SOCKET`` (a leading ``@`` means the abstract namespace). Without the variable every
call is a no-op, so the daemon runs the same outside systemd.
"""

from __future__ import annotations

import os
import socket
import time


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        self.address = address if address is not None else os.environ.get("NOTIFY_SOCKET")
        self._sock: socket.socket | None = None
        watchdog_usec = os.environ.get("WATCHDOG_USEC")
        watchdog_pid = os.environ.get("WATCHDOG_PID")
        self.watchdog_seconds: float | None = None
        if watchdog_usec and (not watchdog_pid or watchdog_pid == str(os.getpid())):
            try:
                self.watchdog_seconds = int(watchdog_usec) / 1e6
            except ValueError:
                self.watchdog_seconds = None

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def detach_environment(self) -> None:
        """Keep the address but drop it from the environment, so child processes (probes,
        hooks) do not talk to systemd on our behalf."""
        for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
            os.environ.pop(name, None)

    def notify(self, *lines: str) -> bool:
        if not self.address:
            return False
        target = self.address
        if target.startswith("@"):
            target = "\0" + target[1:]
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            # Never block the collection loop on a notify socket nobody drains.
            self._sock.sendto("\n".join(lines).encode(), socket.MSG_DONTWAIT, target)
        except OSError:
            return False
        return True

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def reloading(self) -> bool:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def watchdog(self) -> bool:
        """Keep-alive, only when systemd asked for one (``WatchdogSec=``)."""
        if self.watchdog_seconds is None:
            return False
        return self.notify("WATCHDOG=1")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
