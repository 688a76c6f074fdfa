"""The daemon's Unix socket for the Slurm hooks: the protocol, its client and its server.

Protocol: a client connects to ``<run>/nodescope/nodescope.sock``, writes one JSON object
with a ``command`` field, ``issued_at`` and ``deadline`` (wall clock, seconds since the epoch:
when the call began and when the client stops waiting) and a newline, and reads one JSON
object back: ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``; then the connection
closes. Commands are looked up in :attr:`HookServer.handlers`; another part of the daemon adds
one with :meth:`HookServer.register`.

Who can reach it, in three layers:

* the directory ``<run>/nodescope`` is root's, mode 0750, and a POSIX ACL entry gives the
  SlurmUser search (``--x``) on it; the socket is 0600 with an ACL entry giving the SlurmUser
  read-write (:mod:`nodescope.hooks.auth`). Nobody else can ``connect()`` at all.
* ``SO_PEERCRED`` is checked as soon as a connection is accepted, before a byte is read: a
  peer that is neither root nor the SlurmUser (a socket opened up by hand, an ACL the
  filesystem does not keep) gets one line and is closed at once. Refusals are counted and
  logged at most once per :data:`LOG_EVERY_SECONDS`.
* one thread multiplexes every connection (``selectors``); requests run on a small fixed pool
  of workers. A connection that has not sent its request by its deadline is closed; at most
  :data:`MAX_CONNECTIONS` connections are open, at most :data:`MAX_CONNECTIONS_PER_UID` per
  user other than root, so one user's idle connections cannot starve another's.

A request whose ``deadline`` has passed is dropped, when it is read and again when a worker
picks it up: the client has already given up on the daemon and done the work itself.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import queue
import selectors
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodescope.hooks.auth import Peer, grant, peer_of, prepare_directory
from nodescope.model.job_records import RUN_SUBDIR
from nodescope.roots import Roots

#: One logger for every part of the hooks: its name is in each line operators search for.
log = logging.getLogger("nodescope.hooks")

SOCKET_NAME = "nodescope.sock"
MAX_REQUEST_BYTES = 1 << 20
#: Connections open at once, and per user other than root (root runs every prolog and
#: epilog: hundreds may start together when a large job array lands on the node).
MAX_CONNECTIONS = 1024
MAX_CONNECTIONS_PER_UID = 32
#: Workers that run requests; a request takes milliseconds (a registration, a report).
WORKERS = 4
#: The most a request's deadline may lie ahead: a hook waits at most 2 s
#: (``[slurm] timeout_seconds``); the rest is room for a clock that steps.
MAX_DEADLINE_AHEAD_SECONDS = 10.0
#: Backlog of the listening socket: connections the kernel queues while the loop is busy.
BACKLOG = 512
#: Refusals, expired requests and the like are logged at most once per this many seconds,
#: with the count since the last line.
LOG_EVERY_SECONDS = 60.0

Request = dict[str, Any]
Response = dict[str, Any]


# ---------------------------------------------------------------------------------------------
# Client


class HookUnavailable(RuntimeError):
    """The daemon did not answer: no socket, refused, timed out, or an unreadable answer."""


def call(path: Path, request: Request, timeout: float = 2.0) -> Response:
    """Send one request and return the response; never waits longer than ``timeout`` in all.

    The request goes out with ``issued_at`` and ``deadline`` (wall clock) so that a daemon
    that reads it late does not act on it. A full listen queue (``EAGAIN``: many hooks at
    once) is retried until the deadline."""
    started = time.monotonic()
    deadline = started + timeout
    now = time.time()
    # The caller may date the call itself (the epilog stamps its own report with it).
    message = {"issued_at": now, **request, "deadline": now + timeout}

    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        return left

    chunks: list[bytes] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
            pause = 0.005
            while True:
                sock.settimeout(remaining())
                try:
                    sock.connect(str(path))
                    break
                except BlockingIOError:
                    # The server's backlog is full: it is busy, not gone.
                    time.sleep(min(pause, remaining()))
                    pause = min(pause * 2, 0.1)
            sock.settimeout(remaining())
            sock.sendall(json.dumps(message, allow_nan=False).encode() + b"\n")
            sock.shutdown(socket.SHUT_WR)
            size = 0
            while True:
                sock.settimeout(remaining())
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_REQUEST_BYTES:
                    raise HookUnavailable("response too large")
    except (OSError, TimeoutError) as exc:
        raise HookUnavailable(f"{path}: {type(exc).__name__}: {exc}") from None
    try:
        response = json.loads(b"".join(chunks))
    except ValueError as exc:
        raise HookUnavailable(f"{path}: unreadable response: {exc}") from None
    if not isinstance(response, dict):
        raise HookUnavailable(f"{path}: response is not a JSON object")
    return response


# ---------------------------------------------------------------------------------------------
# Where the socket is


def run_dir(roots: Roots) -> Path:
    """``<run>/nodescope``: the socket's directory, which also holds the registrations and
    the gate record."""
    return roots.run / RUN_SUBDIR


def socket_path(roots: Roots) -> Path:
    return run_dir(roots) / SOCKET_NAME


# ---------------------------------------------------------------------------------------------
# Rate-limited counts


@dataclass
class Tally:
    """Counts of one kind of event, logged at most once per ``every`` seconds."""

    event: str
    every: float = LOG_EVERY_SECONDS
    level: int = logging.WARNING
    total: int = 0
    _since_line: int = 0
    _last_line: float = -math.inf
    _detail: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, detail: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self.total += 1
            self._since_line += 1
            self._detail = detail
            if now - self._last_line < self.every:
                return
            count, self._since_line, self._last_line = self._since_line, 0, now
        log.log(self.level, "event=%s count=%d total=%d last=%s", self.event, count, self.total,
                detail)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Server


Handler = Callable[[Request, Peer], Response]


@dataclass
class _Connection:
    sock: socket.socket
    peer: Peer
    deadline: float  # monotonic: the request must be complete by then
    data: bytearray = field(default_factory=bytearray)


@dataclass(frozen=True, slots=True)
class _Job:
    conn: _Connection
    request: Request


class HookServer:
    """One thread that accepts and reads every connection, and :data:`WORKERS` threads that
    run the requests; one request per connection."""

    def __init__(
        self,
        path: Path,
        authorize: Callable[[Peer], bool],
        timeout: Callable[[], float] = lambda: 2.0,
        *,
        grant_uid: Callable[[], int | None] = lambda: None,
        workers: int = WORKERS,
        max_connections: int = MAX_CONNECTIONS,
        max_per_uid: int = MAX_CONNECTIONS_PER_UID,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.authorize = authorize
        self.timeout = timeout
        self.grant_uid = grant_uid
        self.workers = workers
        self.max_connections = max_connections
        self.max_per_uid = max_per_uid
        self.wall_clock = wall_clock
        self.handlers: dict[str, Handler] = {"ping": _ping}
        self.refused = Tally("hook_refused")
        self.busy = Tally("hook_busy")
        self.expired = Tally("hook_deadline_passed", level=logging.INFO)
        self.timed_out = Tally("hook_request_timeout", level=logging.INFO)
        self.invalid = Tally("hook_invalid_request")
        self._open_by_uid: dict[int, int] = {}
        self._open = 0
        self._count_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=max_connections)
        self._stop = threading.Event()
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._made: Path | None = None

    def register(self, command: str, handler: Handler) -> None:
        self.handlers[command] = handler

    @property
    def open_connections(self) -> int:
        with self._count_lock:
            return self._open

    # -- life cycle ----------------------------------------------------------------------
    def start(self) -> None:
        directory = self.path.parent
        if prepare_directory(directory):
            self._made = directory
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                if _answers(self.path):
                    raise OSError(f"{self.path}: another daemon is listening there")
                os.unlink(self.path)  # left by a daemon that did not stop cleanly
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(str(self.path))
            os.chmod(self.path, 0o600)
            sock.listen(BACKLOG)
        except OSError:
            sock.close()
            raise
        self._grant_slurm_user(directory)
        sock.setblocking(False)
        self._sock = sock
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stop.clear()
        self._threads = [threading.Thread(target=self._loop, name="nodescope-hooks", daemon=True)]
        self._threads += [
            threading.Thread(target=self._work, name=f"nodescope-hooks-{n}", daemon=True)
            for n in range(self.workers)
        ]
        for thread in self._threads:
            thread.start()

    def _grant_slurm_user(self, directory: Path) -> None:
        uid = self.grant_uid()
        if uid is None or uid == 0:
            return
        try:
            grant(directory, uid, 0o1)  # search only: the registrations stay unlisted
            grant(self.path, uid, 0o6)
        except OSError as exc:
            log.error(
                "event=hook_acl_failed path=%s uid=%d error=%s only_root_can_use_the_socket=true",
                directory, uid, str(exc),
            )  # fmt: skip

    def stop(self) -> None:
        self._stop.set()
        for _ in range(self.workers):
            with contextlib.suppress(queue.Full):
                self._jobs.put_nowait(None)
        self._wake()
        for thread in self._threads:
            thread.join(timeout=5)
        self._threads = []
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            if self._made is not None:
                with contextlib.suppress(OSError):
                    self._made.rmdir()  # only when empty: registrations stay
        for end in (self._wake_r, self._wake_w):
            if end is not None:
                end.close()
        self._wake_r = self._wake_w = None

    def _wake(self) -> None:
        if self._wake_w is not None:
            with contextlib.suppress(OSError):
                self._wake_w.send(b"\0", socket.MSG_DONTWAIT)

    # -- the accepting and reading thread ------------------------------------------------
    def _loop(self) -> None:
        assert self._sock is not None and self._wake_r is not None
        selector = selectors.DefaultSelector()
        selector.register(self._sock, selectors.EVENT_READ, None)
        selector.register(self._wake_r, selectors.EVENT_READ, None)
        reading: dict[int, _Connection] = {}
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                wait = min([c.deadline for c in reading.values()], default=now + 1.0) - now
                for key, _ in selector.select(max(0.0, min(wait, 1.0))):
                    if key.fileobj is self._sock:
                        self._accept(selector, reading)
                    elif key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        conn = key.data
                        assert isinstance(conn, _Connection)
                        self._read(selector, reading, conn)
                now = time.monotonic()
                for conn in [c for c in reading.values() if c.deadline <= now]:
                    self.timed_out.add(f"uid={conn.peer.uid} pid={conn.peer.pid}")
                    self._drop(selector, reading, conn)
                    self._close(conn)
        except Exception as exc:  # the socket must outlive any one bug
            log.error("event=hook_loop_failed error=%r", f"{type(exc).__name__}: {exc}")
        finally:
            for conn in list(reading.values()):
                self._close(conn)
            selector.close()

    def _accept(self, selector: selectors.BaseSelector, reading: dict[int, _Connection]) -> None:
        assert self._sock is not None
        # A bounded batch, so that a flood of connections cannot keep the loop from reading.
        for _ in range(64):
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self.busy.add(f"accept: {exc.strerror}")
                    return
                raise
            try:
                peer = peer_of(sock)
            except OSError:
                sock.close()
                continue
            if not self.authorize(peer):
                # Nothing is read from a stranger; one line tells a misconfigured client why.
                # Counted first: whoever reads the answer then finds the refusal counted.
                self.refused.add(f"uid={peer.uid} pid={peer.pid} gid={peer.gid}")
                _say_and_close(sock, {"ok": False, "error": "permission denied"})
                continue
            if not self._admit(peer):
                self.busy.add(f"uid={peer.uid} pid={peer.pid}")
                _say_and_close(sock, {"ok": False, "error": "busy: too many connections"})
                continue
            sock.setblocking(False)
            conn = _Connection(sock, peer, time.monotonic() + self._timeout())
            reading[sock.fileno()] = conn
            selector.register(sock, selectors.EVENT_READ, conn)

    def _timeout(self) -> float:
        try:
            value = float(self.timeout())
        except Exception:
            return 2.0
        return value if math.isfinite(value) and 0 < value <= 2.0 else 2.0

    def _admit(self, peer: Peer) -> bool:
        with self._count_lock:
            if self._open >= self.max_connections:
                return False
            held = self._open_by_uid.get(peer.uid, 0)
            if peer.uid != 0 and held >= self.max_per_uid:
                return False
            self._open += 1
            self._open_by_uid[peer.uid] = held + 1
            return True

    def _read(
        self, selector: selectors.BaseSelector, reading: dict[int, _Connection], conn: _Connection
    ) -> None:
        try:
            chunk = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
            conn.data.clear()
        conn.data += chunk
        if len(conn.data) > MAX_REQUEST_BYTES:
            self.invalid.add(f"uid={conn.peer.uid} request over {MAX_REQUEST_BYTES} bytes")
            self._drop(selector, reading, conn)
            self._answer_now(conn, {"ok": False, "error": "request too large"})
            return
        if chunk and b"\n" not in chunk:
            return
        self._drop(selector, reading, conn)
        request, error = self._parse(conn)
        if request is None:
            self._answer_now(conn, {"ok": False, "error": error})
            return
        try:
            self._jobs.put_nowait(_Job(conn, request))
        except queue.Full:  # cannot happen while the queue holds max_connections
            self._answer_now(conn, {"ok": False, "error": "busy"})

    def _parse(self, conn: _Connection) -> tuple[Request | None, str]:
        line = bytes(conn.data).split(b"\n", 1)[0]
        try:
            request = json.loads(line or b"null")
        except (ValueError, RecursionError) as exc:
            self.invalid.add(f"uid={conn.peer.uid} not JSON")
            return None, f"not JSON: {exc}"
        if not isinstance(request, dict) or not isinstance(request.get("command"), str):
            self.invalid.add(f"uid={conn.peer.uid} not an object with a command")
            return None, "expected an object with a command"
        problem = self._deadline_problem(request)
        if problem is not None:
            return None, problem
        return request, ""

    def _deadline_problem(self, request: Request) -> str | None:
        deadline, issued = request.get("deadline"), request.get("issued_at")
        for name, value in (("deadline", deadline), ("issued_at", issued)):
            if (
                not isinstance(value, int | float)
                or isinstance(value, bool)
                or not math.isfinite(value)
            ):
                self.invalid.add(f"{name}={value!r}")
                return f"{name}: expected the wall-clock time in seconds"
        assert isinstance(deadline, int | float) and isinstance(issued, int | float)
        now = self.wall_clock()
        if deadline <= now:
            self.expired.add(f"command={request['command']} late by {now - deadline:.3f}s")
            return "deadline passed: the client has stopped waiting"
        if deadline - now > MAX_DEADLINE_AHEAD_SECONDS or issued > deadline:
            self.invalid.add(f"deadline {deadline - now:.1f}s ahead")
            return f"deadline: at most {MAX_DEADLINE_AHEAD_SECONDS:.0f} s ahead, after issued_at"
        return None

    def _drop(
        self, selector: selectors.BaseSelector, reading: dict[int, _Connection], conn: _Connection
    ) -> None:
        reading.pop(conn.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(conn.sock)

    # -- the workers ---------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._finish(job.conn, self._run(job))
            except Exception as exc:  # one bad client must not stop a worker
                log.warning("event=hook_error error=%r", f"{type(exc).__name__}: {exc}")
                self._close(job.conn)

    def _run(self, job: _Job) -> Response:
        request, peer = job.request, job.conn.peer
        # Checked again: the request may have waited for a worker.
        problem = self._deadline_problem(request)
        if problem is not None:
            return {"ok": False, "error": problem}
        handler = self.handlers.get(request["command"])
        if handler is None:
            known = ", ".join(sorted(self.handlers))
            return {"ok": False, "error": f"unknown command; known: {known}"}
        try:
            return handler(request, peer)
        except Exception as exc:
            log.error(
                "event=hook_command_failed command=%s error=%r",
                request["command"],
                f"{type(exc).__name__}: {exc}",
            )
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}

    def _answer_now(self, conn: _Connection, response: Response) -> None:
        """Answer from the reading thread: never waits for a client that does not read."""
        with contextlib.suppress(OSError):
            conn.sock.send(json.dumps(response).encode() + b"\n", socket.MSG_DONTWAIT)
        self._close(conn)

    def _finish(self, conn: _Connection, response: Response) -> None:
        try:
            conn.sock.setblocking(True)
            conn.sock.settimeout(max(0.05, conn.deadline - time.monotonic()))
            conn.sock.sendall(json.dumps(response, allow_nan=False).encode() + b"\n")
        except (OSError, ValueError):
            pass  # the client left; its hook has gone its own way
        finally:
            self._close(conn)

    def _close(self, conn: _Connection) -> None:
        if conn.sock.fileno() < 0:
            return
        conn.sock.close()
        with self._count_lock:
            self._open -= 1
            left = self._open_by_uid.get(conn.peer.uid, 1) - 1
            if left > 0:
                self._open_by_uid[conn.peer.uid] = left
            else:
                self._open_by_uid.pop(conn.peer.uid, None)


def _say_and_close(sock: socket.socket, response: Response) -> None:
    with contextlib.suppress(OSError):
        sock.send(json.dumps(response).encode() + b"\n", socket.MSG_DONTWAIT)
    sock.close()


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def _ping(request: Request, peer: Peer) -> Response:
    return {"ok": True, "pid": os.getpid()}
