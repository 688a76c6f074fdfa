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

import contextlib
import importlib.util
import json
import logging
import math
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from nodescope import logs, serving
from nodescope.timing import Timing
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
#: How long the render thread waits in poll(2) before it looks at the serving process again
#: (a new one after a restart); messages and a stop wake it at once.
RENDER_LOOP_POLL_MS = 1000
#: What the serving process must not inherit: only the daemon talks to systemd.
_SYSTEMD_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID")


class JsonCache:
    """A JSON document rendered once per cycle (or only when a request asks for it: see
    :class:`MetricsHTTPServer`) and served as bytes. Subscribers (the server, to publish it)
    are called after each update."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._body: bytes | None = None
        self._offered: Callable[[], Any] | None = None
        self._subscribers: list[Callable[[], None]] = []

    def update(self, document: Any) -> None:
        self._store(document, None)

    def _store(self, document: Any, made_by: Callable[[], Any] | None) -> None:
        """Render ``document``; an offer is dropped when the document replaces it (any, for
        :meth:`update`; the one it was made by, for :meth:`render_latest`, so a newer offer
        that came meanwhile is still rendered)."""
        body = (json.dumps(document, indent=2) + "\n").encode()
        with self._lock:
            self._body = body
            if made_by is None or self._offered is made_by:
                self._offered = None
            subscribers = list(self._subscribers)
        for callback in subscribers:
            callback()

    def offer(self, make: Callable[[], Any]) -> None:
        """The newest cycle's document, made and rendered when :meth:`render_latest` is
        called (as the cycle ends, or when a request asks for it)."""
        with self._lock:
            self._offered = make

    def render_latest(self) -> None:
        """Make and render the newest offered document unless that was done already."""
        with self._lock:
            make = self._offered
        if make is not None:
            self._store(make(), make)

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
    passes them over. ``on_demand`` is called with each :data:`~nodescope.serving.DEMAND`
    the serving process sends (WANT or SERVED), on the thread that reads the channel.

    ``stale_after`` (seconds; ``None``: no bound) travels with every publish and announcement:
    the serving process judges ``/healthz`` by the bound of the newest cycle it heard of."""

    def __init__(
        self,
        control: socket.socket,
        on_demand: Callable[[int], None] | None = None,
        stale_after: float | None = None,
    ) -> None:
        control.setblocking(False)
        self.control = control
        self.on_demand = on_demand
        self.stale_after = serving.NO_BOUND if stale_after is None else stale_after
        #: The other end is gone (the serving process exited).
        self.closed = False
        self._memfds: dict[int, int] = {}
        self._free: list[int] = []
        self._one_offs: set[int] = set()
        self._next_one_off = MAX_SLOTS

    @property
    def memfds(self) -> int:
        return len(self._memfds)

    def announce(self, generation: int) -> bool:
        """Tell the serving process that the documents of ``generation`` exist but are not
        rendered; False when the channel is full or closed."""
        self._collect_releases()
        message = serving.OUTDATED.pack(generation, self.stale_after)
        return self._deliver(lambda: self.control.send(message, socket.MSG_DONTWAIT))

    def send(self, metrics: bytes | None, alerts: bytes | None, generation: int = 0) -> bool:
        """Hand the documents (of ``generation``) over; False when the channel is full (the
        serving process is not reading) or closed (it exited)."""
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
            sent = self._send(slot, fd, metrics, alerts, generation)
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

    def _send(
        self, slot: int, fd: int, metrics: bytes | None, alerts: bytes | None, generation: int
    ) -> bool:
        offset = 0
        for data in (metrics, alerts):
            if data:
                _pwrite(fd, data, offset)
                offset += len(data)
        header = serving.PUBLISH.pack(
            slot,
            serving.NOT_READY if metrics is None else len(metrics),
            serving.NOT_READY if alerts is None else len(alerts),
            generation,
            self.stale_after,
        )
        return self._deliver(
            lambda: socket.send_fds(self.control, [header], [fd], socket.MSG_DONTWAIT)
        )

    def _deliver(self, send: Callable[[], object]) -> bool:
        """One packet on the channel without waiting: False when it is full (the serving
        process is not reading) or closed (it exited: noted)."""
        try:
            send()
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
        """Read what the serving process sent: releases, and demands for ``on_demand``."""
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
            if len(message) == serving.DEMAND.size:
                if self.on_demand is not None:
                    self.on_demand(serving.DEMAND.unpack(message)[0])
                continue
            if len(message) != serving.RELEASE.size:
                continue
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
        on_demand: Callable[[int], None] | None = None,
    ) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {k: v for k, v in os.environ.items() if k not in _SYSTEMD_VARIABLES}
        # Its log lines in the daemon's format (it imports nothing of nodescope to ask).
        env["NODESCOPE_LOG_FORMAT"] = logs.current_format()
        settings = _settings_memfd(web or WebConfig(), stale_after)
        fds = (listener.fileno(), theirs.fileno(), settings)
        try:
            # -I -S: the standard library only, whatever the environment says; the script
            # runs as __main__, so nothing else of nodescope is imported.
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", serving_script(),
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
        self.publisher = Publisher(ours, on_demand, stale_after)
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exit_status(self) -> int | None:
        return self.proc.poll()

    def send(self, metrics: bytes | None, alerts: bytes | None, generation: int = 0) -> bool:
        return self.publisher.send(metrics, alerts, generation)

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


#: The serving process's script in a ``/proc/<pid>/cmdline`` (arguments end in NUL): the
#: source or its compiled file, whichever :func:`serving_script` chose.
SERVING_COMMAND_LINE = re.compile(rb"/serving(\.py|\.cpython-\d+\.pyc)\x00")


def serving_script(source: str | None = None, cached: str | None = None) -> str:
    """What the interpreter runs as the serving process: its compiled file when that is
    the compiled form of the source as it is now, else the source.

    Python never caches the bytecode of a script it is given, so started from the source the
    serving process compiles it on every start, and the compiler's leftovers stay in its
    heap (about 2.6 MiB of its 14). An installed nodescope has the file compiled (pip and the
    packages byte-compile what they install); a compiled file that does not match the source
    (its header's size and modification time, as the import system checks them, or a
    hash-based one) is not used, so an edited source always runs as it is."""
    source = serving.__file__ if source is None else source
    if cached is None:
        spec = serving.__spec__
        cached = spec.cached if spec is not None else None
    if not cached:
        return source
    try:
        with open(cached, "rb") as handle:
            header = handle.read(16)
        stat = os.stat(source)
    except OSError:
        return source
    if (
        len(header) == 16
        and header[:4] == importlib.util.MAGIC_NUMBER
        and int.from_bytes(header[4:8], "little") == 0  # timestamp-based, not hash-based
        and int.from_bytes(header[8:12], "little") == int(stat.st_mtime) & 0xFFFFFFFF
        and int.from_bytes(header[12:16], "little") == stat.st_size & 0xFFFFFFFF
    ):
        return cached
    return source


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

    ``timing``: the daemon's clock rules (:class:`~nodescope.timing.Timing`): its
    ``stale_after`` is how long without a completed cycle ``/healthz`` answers 503 after (the
    daemon publishes or announces after every completed cycle, so stale documents mean cycles
    stopped), its ``render_window`` how recent a request keeps every cycle rendered; ``None``:
    no staleness bound. :meth:`retime` applies a reloaded one, to the serving process too.

    ``render``, when given, renders the documents of the newest cycle the caches were offered
    (:meth:`MetricsCache.offer`) into them: documents are then rendered when a request asks
    for them (the serving process's WANT), on a thread of this server, and :meth:`publish`
    announces a cycle it has no rendered documents for instead of publishing.
    :meth:`rendering_wanted` says when rendering every cycle is worth it: while requests come
    about every tick.
    """

    def __init__(
        self,
        address: tuple[str, int],
        cache: MetricsCache,
        alerts: JsonCache | None = None,
        web: WebConfig | None = None,
        timing: Timing | None = None,
        render: Callable[[], None] | None = None,
    ) -> None:
        self.cache = cache
        self.alerts = alerts
        self.web = web
        self.timing = timing
        self.socket = listen(address)
        self.process: ServingProcess | None = None
        self._lock = threading.RLock()
        self._published: tuple[bytes | None, bytes | None] | None = None
        self._announced = 0
        self._started = False
        self._quick_exits = 0
        self._start_after = 0.0
        self._render = render
        #: When the serving process last asked for documents or sent a new exposition
        #: (monotonic); the render thread sets it.
        self.demanded_at = -math.inf
        self._render_wanted = False
        self._stopping = False
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) if render else -1
        self._render_thread: threading.Thread | None = None

    @property
    def bound(self) -> str:
        host, port = self.socket.getsockname()[:2]
        text = str(host)
        return f"[{text}]:{port}" if ":" in text else f"{text}:{port}"

    def start(self) -> None:
        with self._lock:
            self._started = True
            self.process = self._new_process()
            log.debug("event=serving_started pid=%d", self.process.pid)
            if self.alerts is not None:
                self.alerts.subscribe(self.publish)
            self.publish()
        if self._render is not None:
            self._render_thread = threading.Thread(
                target=self._render_loop, name="nodescope-render", daemon=True
            )
            self._render_thread.start()

    def _new_process(self) -> ServingProcess:
        stale_after = self.timing.stale_after if self.timing is not None else None
        return ServingProcess(
            self.socket, self.web, stale_after, self._on_demand if self._render else None
        )

    def retime(self, timing: Timing) -> None:
        """Apply reloaded clock rules: here at once, in the serving process with the next
        cycle's publish or announcement (which carries the new bound), so the serving process
        never judges a cycle of the old tick by the new, shorter bound. A serving process
        started later gets it with its settings."""
        with self._lock:
            self.timing = timing
            if self.process is not None:
                self.process.publisher.stale_after = timing.stale_after

    def rendering_wanted(self) -> bool:
        """Whether the documents of a cycle should be rendered as it ends: always without
        on-demand rendering, and while nothing was published to the serving process yet
        (it serves 503 until then) or requests came within the timing's render window (one
        and a half ticks: a scraper every second then never waits for a render; one every
        15 s costs one render per scrape and one after it)."""
        if self._render is None or self._published is None or self._published[0] is None:
            return True
        window = self.timing.render_window if self.timing is not None else 0.0
        return time.monotonic() - self.demanded_at <= window

    def publish(self) -> None:
        """Hand the current documents to the serving process (unless it has them already),
        or, when the newest cycle's are not rendered, announce that cycle; start a new
        serving process first if it exited."""
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
                    offered = self.cache.offered_generation
                    announce = self._render is not None and offered > self._announced
                    if announce and process.publisher.announce(offered):
                        self._announced = offered
                    return
                if process.send(*documents, self.cache.generation):
                    self._published = documents
                    self._announced = self.cache.generation
                    return
                if not process.publisher.closed:
                    log.debug("event=publish_skipped reason=serving_process_not_reading")
                    return

    # -- rendering on demand -------------------------------------------------------------
    def _on_demand(self, kind: int) -> None:
        """A demand from the serving process (read under the lock, on either thread)."""
        self.demanded_at = time.monotonic()
        if kind == serving.WANT:
            self._render_wanted = True
            os.eventfd_write(self._wake, 1)

    def _render_loop(self) -> None:
        """Reads the control channel while the loop sleeps or collects, and renders and
        publishes when the serving process wants documents. A failure is logged and the
        thread goes on: without it, requests would wait out RENDER_WAIT_SECONDS for ever."""
        while not self._stopping:
            try:
                self._render_turn()
            except Exception as exc:
                log.error("event=render_thread_error error=%r", f"{type(exc).__name__}: {exc}")
                time.sleep(RENDER_LOOP_POLL_MS / 1000)

    def _render_turn(self) -> None:
        """One wait for messages or a wake-up, then a render if one was asked for."""
        with self._lock:
            process = self.process
        poller = select.poll()
        poller.register(self._wake, select.POLLIN)
        control = -1
        if process is not None and not process.publisher.closed:
            control = process.publisher.control.fileno()
            if control != -1:
                poller.register(control, select.POLLIN)
        for fd, _events in poller.poll(RENDER_LOOP_POLL_MS):
            if fd == self._wake:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._wake)
            elif fd == control:
                with self._lock:
                    if self.process is process and process is not None:
                        process.gone()  # takes releases and demands
        if self._render_wanted and not self._stopping:
            self._render_wanted = False
            try:
                assert self._render is not None
                self._render()
            except Exception as exc:
                log.error("event=render_failed error=%r", f"{type(exc).__name__}: {exc}")
            self.publish()

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
                "event=serving_exited pid=%d ended=%s lived_seconds=%.1f restart_in_seconds=%.0f",
                process.pid, describe_status(status), lived, max(0.0, self._start_after - now),
            )  # fmt: skip
        if now < self._start_after:
            return
        try:
            self.process = self._new_process()
        except OSError as exc:
            self._quick_exits += 1
            self._start_after = now + _backoff(self._quick_exits)
            log.error("event=serving_start_failed error=%r", str(exc))
            return
        log.info("event=serving_started pid=%d", self.process.pid)

    def stop(self) -> None:
        if self.alerts is not None:
            self.alerts.unsubscribe(self.publish)
        self._stopping = True
        if self._render_thread is not None:
            os.eventfd_write(self._wake, 1)
            self._render_thread.join(STOP_SECONDS)
            self._render_thread = None
        with self._lock:
            self._started = False
            if self.process is not None:
                self.process.stop()
                self.process = None
            self.socket.close()
            if self._wake != -1:
                os.close(self._wake)
                self._wake = -1
