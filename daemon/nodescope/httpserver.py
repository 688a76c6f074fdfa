"""The HTTP endpoint, from the daemon's side: ``/metrics`` from the per-cycle cache,
``/api/v1/alerts`` (the active alerts and findings as JSON, for ``nodescope alerts``),
``/healthz`` and an index page.

The daemon binds the listening socket (so a bind error is its own, reported at start or
reload) and hands it to a serving process, :mod:`nodescope.serving`, which answers every
request: a scrape never waits for the daemon's interpreter, which a collection cycle holds for
tens of milliseconds. Requests never trigger collection or analysis. After each cycle
:meth:`MetricsHTTPServer.publish` writes the rendered exposition and the alerts document into
a memfd (memfd_create(2)) and passes it to the serving process over an ``AF_UNIX`` socket
(``SCM_RIGHTS``, unix(7)); the protocol is described in :mod:`nodescope.serving`. The memfds
are reused once the serving process has released them, so a publish costs the daemon a copy
of the bytes and two system calls, and never waits for the serving process.

If the serving process dies, the next publish logs it and starts a new one on the same socket
(connections that arrive meanwhile wait in the socket's backlog). It exits by itself when the
daemon closes its end of the channel, or dies: it never outlives the daemon.

TLS, basic auth and response headers come from a web-config.yml (:mod:`nodescope.webconfig`),
handed to the serving process as a settings document in a memfd; with or without one, the
serving process gives up root and every capability once it has its socket
(:func:`nodescope.serving.drop_privileges`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nodescope import serving
from nodescope.webconfig import WebConfig
from nodescope_exporters.prometheus import MetricsCache

log = logging.getLogger("nodescope.http")

CONTENT_TYPE = serving.METRICS_TYPE
JSON = serving.JSON_TYPE
INDEX = serving.INDEX

#: Pending connections the kernel holds while the serving process is busy or restarting.
BACKLOG = 128
#: memfds the daemon writes into again once the serving process released them (it holds one
#: while its documents are current, and one per older exposition a slow client still reads).
MAX_SLOTS = 4
#: memfds beyond those, made for one publish each while all of the above are held; more than
#: this many unreleased means the serving process is not reading: the publish is skipped.
MAX_ONE_OFFS = 8
#: A serving process that lived less than this before it exited counts as failing to start:
#: from the second such exit in a row the next start waits 1, 2, 4 … up to
#: MAX_BACKOFF_SECONDS (a crash loop must not cost a process start per cycle).
QUICK_EXIT_SECONDS = 10.0
MAX_BACKOFF_SECONDS = 60.0
STOP_SECONDS = 1.0
#: What the serving process must not inherit: only the daemon talks to systemd.
_SYSTEMD_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID")


class JsonCache:
    """A JSON document rendered once per cycle by the loop and served as bytes. Subscribers
    (the server, to publish it) are called after each update."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._body: bytes | None = None
        self._subscribers: list[Callable[[], None]] = []

    def update(self, document: Any) -> None:
        body = (json.dumps(document, indent=2) + "\n").encode()
        with self._lock:
            self._body = body
            subscribers = list(self._subscribers)
        for callback in subscribers:
            callback()

    def body(self) -> bytes | None:
        with self._lock:
            return self._body

    def subscribe(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._subscribers.append(callback)

    def unsubscribe(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if callback in self._subscribers:
                self._subscribers.remove(callback)


def listen(address: tuple[str, int]) -> socket.socket:
    """A listening TCP socket on ``address`` (IPv6 when the host has a colon)."""
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


class Publisher:
    """The daemon's end of the control channel: writes documents into reused memfds and
    passes them over."""

    def __init__(self, control: socket.socket) -> None:
        control.setblocking(False)
        self.control = control
        #: The other end is gone (the serving process exited).
        self.closed = False
        self._memfds: dict[int, int] = {}
        self._free: list[int] = []
        self._one_offs: set[int] = set()
        self._next_one_off = MAX_SLOTS

    @property
    def memfds(self) -> int:
        return len(self._memfds)

    def send(self, metrics: bytes | None, alerts: bytes | None) -> bool:
        """Hand the documents over; False when the channel is full (the serving process is
        not reading) or closed (it exited)."""
        self._collect_releases()
        one_off = False
        if self._free:
            slot = self._free.pop()
        elif len(self._memfds) < MAX_SLOTS:
            slot = len(self._memfds)
            self._memfds[slot] = os.memfd_create(f"nodescope-documents-{slot}")
        elif len(self._one_offs) < MAX_ONE_OFFS:
            one_off = True
            slot = self._next_one_off
            self._next_one_off = MAX_SLOTS + (self._next_one_off - MAX_SLOTS + 1) % 2**31
        else:
            return False
        fd = os.memfd_create("nodescope-documents") if one_off else self._memfds[slot]
        try:
            sent = self._send(slot, fd, metrics, alerts)
        finally:
            if one_off:
                os.close(fd)  # the serving process has its own descriptor
        if not sent:
            if not one_off:
                self._free.append(slot)
            return False
        if one_off:
            self._one_offs.add(slot)
        return True

    def _send(self, slot: int, fd: int, metrics: bytes | None, alerts: bytes | None) -> bool:
        offset = 0
        for data in (metrics, alerts):
            if data:
                _pwrite(fd, data, offset)
                offset += len(data)
        header = serving.PUBLISH.pack(
            slot,
            serving.NOT_READY if metrics is None else len(metrics),
            serving.NOT_READY if alerts is None else len(alerts),
        )
        try:
            socket.send_fds(self.control, [header], [fd], socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            self.closed = True
            return False
        return True

    def check(self) -> bool:
        """Take the releases that came in; whether the other end is gone."""
        if not self.closed:
            self._collect_releases()
        return self.closed

    def _collect_releases(self) -> None:
        while True:
            try:
                message = self.control.recv(serving.RELEASE.size, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                self.closed = True
                return
            if not message:
                self.closed = True
                return
            if len(message) != serving.RELEASE.size:
                return
            (slot,) = serving.RELEASE.unpack(message)
            if slot in self._memfds and slot not in self._free:
                self._free.append(slot)
            self._one_offs.discard(slot)

    def close(self) -> None:
        self.control.close()
        for fd in self._memfds.values():
            os.close(fd)
        self._memfds.clear()
        self._free.clear()


class ServingProcess:
    """One serving process and the daemon's end of its control channel."""

    def __init__(
        self,
        listener: socket.socket,
        web: WebConfig | None = None,
        stale_after: float | None = None,
    ) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {k: v for k, v in os.environ.items() if k not in _SYSTEMD_VARIABLES}
        settings = _settings_memfd(web or WebConfig(), stale_after)
        fds = (listener.fileno(), theirs.fileno(), settings)
        try:
            # -I -S: the standard library only, whatever the environment says; the script
            # runs as __main__, so nothing else of nodescope is imported.
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(Path(serving.__file__)),
                 "--listen-fd", str(fds[0]), "--control-fd", str(fds[1]),
                 "--settings-fd", str(fds[2])],
                pass_fds=fds, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env,
            )  # fmt: skip
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
            os.close(settings)
        self.publisher = Publisher(ours)
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exit_status(self) -> int | None:
        return self.proc.poll()

    def send(self, metrics: bytes | None, alerts: bytes | None) -> bool:
        return self.publisher.send(metrics, alerts)

    def gone(self) -> bool:
        """Whether the process exited: its end of the channel closes then, so a publish need
        not ask the kernel about the process every cycle."""
        return self.publisher.check()

    def stop(self, timeout: float = STOP_SECONDS) -> int:
        """Close the channel (the serving process exits on its end of file) and reap it."""
        self.publisher.close()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def _settings_memfd(web: WebConfig, stale_after: float | None) -> int:
    """A memfd holding the serving process's settings (JSON), at offset 0: not on its command
    line, which every user can read, since the settings hold password hashes."""
    fd = os.memfd_create("nodescope-serving-settings")
    settings = dict(web.settings())
    if stale_after is not None:
        settings["stale_after"] = stale_after
    try:
        _pwrite(fd, json.dumps(settings).encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _pwrite(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def _backoff(quick_exits: int) -> float:
    """Seconds before the next start: none after one quick exit, then 1, 2, 4 …"""
    return 0.0 if quick_exits <= 1 else min(MAX_BACKOFF_SECONDS, 2.0 ** (quick_exits - 2))


def describe_status(status: int) -> str:
    if status < 0:
        try:
            return f"signal={signal.Signals(-status).name}"
        except ValueError:
            return f"signal={-status}"
    return f"exit={status}"


class MetricsHTTPServer:
    """The listening socket, the serving process behind it, and the documents it serves:
    ``cache`` (the exposition) and ``alerts`` (published whenever it is updated).

    ``stale_after``: seconds without a new publish after which ``/healthz`` answers 503 — the
    daemon publishes after every completed cycle, so stale documents mean cycles stopped.
    """

    def __init__(
        self,
        address: tuple[str, int],
        cache: MetricsCache,
        alerts: JsonCache | None = None,
        web: WebConfig | None = None,
        stale_after: float | None = None,
    ) -> None:
        self.cache = cache
        self.alerts = alerts
        self.web = web
        self.stale_after = stale_after
        self.socket = listen(address)
        self.process: ServingProcess | None = None
        self._lock = threading.RLock()
        self._published: tuple[bytes | None, bytes | None] | None = None
        self._started = False
        self._quick_exits = 0
        self._start_after = 0.0

    @property
    def bound(self) -> str:
        host, port = self.socket.getsockname()[:2]
        text = str(host)
        return f"[{text}]:{port}" if ":" in text else f"{text}:{port}"

    def start(self) -> None:
        with self._lock:
            self._started = True
            self.process = ServingProcess(self.socket, self.web, self.stale_after)
            log.debug("event=serving_started pid=%d", self.process.pid)
            if self.alerts is not None:
                self.alerts.subscribe(self.publish)
            self.publish()

    def publish(self) -> None:
        """Hand the current documents to the serving process (unless it has them already);
        start a new one first if it exited."""
        with self._lock:
            if not self._started:
                return
            for _attempt in (0, 1):
                self._supervise()
                process = self.process
                if process is None:
                    return
                ready, body = self.cache.body()
                documents = (body if ready else None, self.alerts.body() if self.alerts else None)
                last = self._published
                if last is not None and last[0] is documents[0] and last[1] is documents[1]:
                    return
                if process.send(*documents):
                    self._published = documents
                    return
                if not process.publisher.closed:
                    log.debug("event=publish_skipped reason=serving_process_not_reading")
                    return

    def _supervise(self) -> None:
        """Notice a serving process that exited and start another one when it is time."""
        now = time.monotonic()
        process = self.process
        if process is not None:
            if not process.gone():
                return
            status = process.stop()
            self.process = None
            self._published = None
            lived = now - process.started
            self._quick_exits = self._quick_exits + 1 if lived < QUICK_EXIT_SECONDS else 0
            self._start_after = now + _backoff(self._quick_exits)
            log.error(
                "event=serving_exited pid=%d %s lived_seconds=%.1f restart_in_seconds=%.0f",
                process.pid, describe_status(status), lived, max(0.0, self._start_after - now),
            )  # fmt: skip
        if now < self._start_after:
            return
        try:
            self.process = ServingProcess(self.socket, self.web, self.stale_after)
        except OSError as exc:
            self._quick_exits += 1
            self._start_after = now + _backoff(self._quick_exits)
            log.error("event=serving_start_failed error=%r", str(exc))
            return
        log.info("event=serving_started pid=%d", self.process.pid)

    def stop(self) -> None:
        if self.alerts is not None:
            self.alerts.unsubscribe(self.publish)
        with self._lock:
            self._started = False
            if self.process is not None:
                self.process.stop()
                self.process = None
            self.socket.close()
