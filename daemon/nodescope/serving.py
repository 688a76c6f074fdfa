"""The serving process: answers ``/metrics``, ``/api/v1/alerts``, ``/healthz`` and ``/`` from
the documents the daemon published last, so that a scrape never waits for the daemon's
interpreter (a collection cycle holds its GIL for tens of milliseconds).

The daemon (:class:`nodescope.httpserver.MetricsHTTPServer`) binds the listening socket and
runs this file as a script, ``python -I -S serving.py --listen-fd N --control-fd M
[--settings-fd S]``: the standard library only (and ``bcrypt`` when basic auth is configured),
nothing else of nodescope, one :mod:`selectors` loop in one thread (and, with basic auth, a
thread that runs the bcrypt checks, :class:`CheckThread`, so that a check never holds the loop).

Settings come as one JSON document read from ``--settings-fd`` (a memfd, not the command line:
``/proc/<pid>/cmdline`` is readable by every user and the settings hold password hashes): the
TLS context (:func:`tls_context`), the basic auth users, extra response headers, and the user
to become. Once it has its sockets, the TLS files and bcrypt, this process gives up root and
every capability (:func:`drop_privileges`); it needs neither to accept connections and read the
memfds it is handed.

The control channel is an ``AF_UNIX``/``SOCK_SEQPACKET`` pair (one packet per message):

- daemon → here, one packet per publish: :data:`PUBLISH` (slot, exposition length, alerts
  length — :data:`NOT_READY` for a document that does not exist yet — the documents'
  generation, and the staleness bound of the daemon's tick) with a memfd attached
  (``SCM_RIGHTS``, unix(7)) that holds the exposition followed by the alerts JSON;
- daemon → here, :data:`OUTDATED` (a generation, the staleness bound): a cycle completed
  whose documents the daemon has not rendered. The daemon renders every cycle only while
  requests come often; otherwise rendering waits for a request that needs it (a Prometheus
  scraping every 15 s costs one render per scrape, not fifteen);
- here → daemon: :data:`RELEASE` (slot) once nothing here uses that memfd any more, so the
  daemon may write later documents into it. The exposition is not copied here: it is sent
  from the memfd with sendfile(2) (a response in flight keeps its memfd, so a slow client
  gets the cycle it asked for, whole) and read only to be compressed. A cycle nobody scrapes
  costs this process one message;
- here → daemon: :data:`DEMAND` — :data:`WANT` when a request for ``/metrics`` or
  ``/api/v1/alerts`` arrives while the published documents are older than the newest
  generation (the request waits for the rendered ones, at most :data:`RENDER_WAIT_SECONDS`,
  then gets the older ones), :data:`SERVED` the first time a published exposition is sent.
  The daemon keeps rendering every cycle while these come within about a tick of each other.
  However many clients ask, the daemon renders a cycle at most once.

End of file on the channel (the daemon closed it, exited or was killed) ends this process: it
never outlives the daemon. SIGINT, SIGTERM and SIGHUP are ignored for the same reason: a stop
of the unit or a Ctrl-C reaches the daemon, which ends this process by closing the channel.

HTTP/1.1 as RFC 9112 defines it, without what a scrape target does not need: GET and HEAD,
keep-alive (HTTP/1.0 clients get it when they ask), pipelined requests answered in order,
request bodies only with a Content-Length (read and dropped), no chunked requests.

Every client is presumed hostile, and no client can take the loop or the connection slots from
another: a connection's request (its head, and its body if any) must arrive whole within
:data:`REQUEST_SECONDS` of its first byte — of the connection's start for the first request,
so a client that connects and says nothing, or sends a byte a second, is closed; at the
connection limit the longest idle connection, then the oldest unfinished request, makes room
for a new one; at most :data:`MAX_BLANK_LINES` empty lines may come before a request line;
heads are bounded in bytes and in header lines; two different ``Content-Length`` values are a
400 (RFC 9112 §6.3: a message whose framing is ambiguous must not be trusted).
``Content-Encoding: gzip`` (RFC 9110 §8.4 and §12.5.3) is sent when Accept-Encoding allows it
and the body is worth it; a document is compressed at most once, on its first gzip request,
or as soon as it is published while gzip requests keep coming (a new exposition is then served
only once its compressed form is ready, so both encodings of one request always show the same
cycle). Compression runs in steps between the loop's turns: requests that do not need it are
answered meanwhile.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import os
import selectors
import signal
import socket
import struct
import sys
import time
import zlib
from collections import deque
from collections.abc import Callable

# Only what a socket server needs is imported (not typing, argparse or logging: each would add
# close to 1 MiB to this process's 12), so the annotations below stay strings. What is imported
# later (ssl, bcrypt, ctypes) is imported before the process gives up root: the interpreter's
# own files may be readable by root alone (a Python under /root), so nothing may be imported
# after that.

#: daemon → serving process: slot of the attached memfd, then the exposition's and the
#: alerts document's lengths (the alerts follow the exposition in the memfd), then their
#: generation (it grows by one per cycle), then the seconds without a cycle after which
#: /healthz answers 503 (:data:`NO_BOUND`: never). The bound comes with every cycle, so a
#: reload that changes the daemon's tick reaches this process with the first cycle it times.
PUBLISH = struct.Struct("<IqqQd")
#: daemon → serving process, without a memfd: the generation of a cycle whose documents are
#: not rendered yet, and the staleness bound as in :data:`PUBLISH`.
OUTDATED = struct.Struct("<Qd")
#: The staleness bound of a daemon that sets none.
NO_BOUND = -1.0
#: serving process → daemon: the slot whose memfd is no longer used here.
RELEASE = struct.Struct("<I")
#: serving process → daemon: what requests did with the documents (:data:`WANT`,
#: :data:`SERVED`); one byte, so it is told apart from a RELEASE by its size.
DEMAND = struct.Struct("<B")
#: A request waits for the documents of the newest generation: render them now.
WANT = 1
#: A published exposition was sent for the first time.
SERVED = 2
NOT_READY = -1
#: How long a request waits for documents it asked the daemon to render before it is answered
#: with the older ones (a daemon busy beyond this is late anyway; /healthz says when it is
#: stale).
RENDER_WAIT_SECONDS = 2.0

# The classic text format: every name nodescope exports is a legal legacy name, and every
# Prometheus release (Debian 12 ships 2.42) parses it.
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
JSON_TYPE = "application/json"
TEXT_TYPE = "text/plain"
HTML_TYPE = "text/html; charset=utf-8"

INDEX = b"""<html><head><title>nodescope</title></head><body>
<h1>nodescope</h1><p><a href="/metrics">/metrics</a>
&middot; <a href="/api/v1/alerts">/api/v1/alerts</a> &middot; <a href="/healthz">/healthz</a></p>
</body></html>
"""

#: Connections served at once. At the limit a new one takes the place of the longest idle
#: connection, or else of the one whose unfinished request started first (see
#: Server._make_room): clients that hold connections without completing requests cannot lock
#: Prometheus out. The process raises its descriptor limit to fit (systemd gives services a
#: soft limit of 1024 and a hard one of 524288).
MAX_CONNECTIONS = 2048
#: Descriptors kept for everything but client connections (listener, control channel, memfds).
RESERVED_FDS = 64
#: A request line and headers larger than this get 431 (real scrapers send about 300 bytes).
MAX_REQUEST_HEAD = 8192
#: Header lines in one request (Prometheus sends 5, curl 3).
MAX_HEADER_LINES = 64
#: Empty lines accepted before a request line (RFC 9112 §2.2 asks servers to ignore at least
#: one, which some clients send after a body); more is a stream of noise, answered with 400.
MAX_BLANK_LINES = 8
#: Scrapes have no body; this only lets a small one through to be read and dropped, and keeps
#: what a connection can make this process hold small.
MAX_REQUEST_BODY = 4096
#: A keep-alive connection with nothing to do is closed after this long; Prometheus scrapes
#: at most every few minutes and reconnects when it must.
IDLE_SECONDS = 300.0
#: A request must arrive whole within this long of its first byte (of the connection's start,
#: TLS handshake included, for the first one): Prometheus sends its head in one packet. A
#: response must make progress within WRITE_STALL_SECONDS.
REQUEST_SECONDS = 5.0
WRITE_STALL_SECONDS = 30.0
SWEEP_SECONDS = 1.0
#: Request heads remembered with what they parse to (see Server._parse).
PARSED_HEADS = 64

#: Level 1: about 3 ms for an 800 KB exposition, 14:1; level 6 takes 2.5 times as long for
#: 15 % fewer bytes.
GZIP_LEVEL = 1
#: Bodies smaller than this are always sent as they are.
MIN_GZIP_BYTES = 1024
#: Input compressed per turn of the loop (about half a millisecond at level 1).
COMPRESS_STEP = 128 * 1024
#: While gzip requests came in within this long, a new exposition is compressed as soon as it
#: is published (a scraper every second or a burst of them never waits for it); otherwise on
#: its first gzip request (a scraper every 15 s pays one compression per scrape, not 15).
EAGER_SECONDS = 3.0

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    501: "Not Implemented",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}
_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def escape(value: str) -> str:
    """``value`` as one logfmt value, by the daemon's rule (``nodescope.text.escape``, written
    out here because this script imports nothing of nodescope; a test holds the two equal):
    bare when plain, else quoted with every character that is not printable escaped."""
    if value and value.isprintable() and not any(c in value for c in ' "=\\'):
        return value
    out = []
    for char in value:
        code = ord(char)
        if char in '"\\':
            out.append("\\" + char)
        elif char == "\n":
            out.append("\\n")
        elif char == "\t":
            out.append("\\t")
        elif char.isprintable():
            out.append(char)
        elif code < 0x100:
            out.append(f"\\x{code:02x}")
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return '"' + "".join(out) + '"'


def log(event: str, **fields: object) -> None:
    """One line on stderr in the daemon's format: ``NODESCOPE_LOG_FORMAT`` (logfmt or json),
    which the daemon sets from its own; a time stamp first unless stderr is the journal's
    (``JOURNAL_STREAM``, as the daemon's ``nodescope.logs`` decides)."""
    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"
    journal = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(sys.stderr.fileno())
        under_journal = bool(journal) and journal == f"{st.st_dev}:{st.st_ino}"
    except (OSError, ValueError, AttributeError):
        under_journal = False
    pairs = [] if under_journal else [("time", stamp)]
    pairs += [("level", "error"), ("logger", "nodescope.serving"), ("event", event)]
    pairs += [(key, str(value)[:4000]) for key, value in fields.items()]
    if os.environ.get("NODESCOPE_LOG_FORMAT") == "json":
        import json

        line = json.dumps(dict(pairs), ensure_ascii=True)
    else:
        line = " ".join(f"{key}={escape(value)}" for key, value in pairs)
    print(line, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Documents


class Slot:
    """A memfd the daemon published: held open while a document in it may still be sent or
    read, then closed and handed back (:data:`RELEASE`) so the daemon may write into it."""

    __slots__ = ("_release", "fd", "number", "retired", "users")

    def __init__(self, fd: int, number: int, release: Callable[[int], None]) -> None:
        self.fd = fd
        self.number = number
        self._release = release
        #: Responses being sent from it.
        self.users = 0
        #: Neither current nor pending any more: no new response will use it.
        self.retired = False

    def hold(self) -> None:
        self.users += 1

    def drop(self) -> None:
        self.users -= 1
        self._maybe_release()

    def retire(self) -> None:
        self.retired = True
        self._maybe_release()

    def _maybe_release(self) -> None:
        if self.retired and self.users <= 0 and self.fd != -1:
            os.close(self.fd)
            self.fd = -1
            self._release(self.number)


class Body:
    """One response body, as bytes or as a range of a published memfd (sent with sendfile(2),
    read only to be compressed), and, once computed, its gzip form."""

    __slots__ = ("_data", "content_type", "gzip", "offset", "size", "slot")

    def __init__(
        self,
        data: bytes | None,
        content_type: str,
        *,
        slot: Slot | None = None,
        offset: int = 0,
        size: int = 0,
    ) -> None:
        self._data = data
        self.content_type = content_type
        self.slot = slot
        self.offset = offset
        self.size = len(data) if data is not None else size
        self.gzip: bytes | None = None

    @property
    def data(self) -> bytes:
        if self._data is None:
            assert self.slot is not None and self.slot.fd != -1
            self._data = _pread(self.slot.fd, self.size, self.offset)
        return self._data

    @property
    def negotiable(self) -> bool:
        return self.size >= MIN_GZIP_BYTES


class Documents:
    """What the daemon published last: ``None`` for a document that does not exist yet."""

    __slots__ = ("alerts", "generation", "metrics", "slot")

    def __init__(
        self,
        metrics: Body | None,
        alerts: Body | None,
        slot: Slot | None = None,
        generation: int = 0,
    ) -> None:
        self.metrics = metrics
        self.alerts = alerts
        #: The memfd the exposition is sent from.
        self.slot = slot
        #: The daemon's count of the cycle they were rendered for.
        self.generation = generation

    def retire(self) -> None:
        if self.slot is not None:
            self.slot.retire()


class FileRange:
    """The part of a memfd-backed body still to send on a connection."""

    __slots__ = ("offset", "remaining", "slot")

    def __init__(self, slot: Slot, offset: int, remaining: int) -> None:
        self.slot = slot
        self.offset = offset
        self.remaining = remaining


_NOT_READY_METRICS = Body(b"no collection cycle has completed yet\n", TEXT_TYPE)
_NOT_READY_ALERTS = Body(b'{"error": "no analysis cycle has completed yet"}\n', JSON_TYPE)
_HEALTHY = Body(b"ok\n", TEXT_TYPE)
_STARTING = Body(b"starting\n", TEXT_TYPE)
_STALE = Body(b"stale: no collection cycle completed recently\n", TEXT_TYPE)
_INDEX = Body(INDEX, HTML_TYPE)
_NOT_FOUND = Body(b"not found\n", TEXT_TYPE)
#: The paths whose documents the daemon renders.
_DOCUMENTS = ("/metrics", "/api/v1/alerts")


def route(method: str, path: str, current: Documents, stale: bool = False) -> tuple[int, Body, str]:
    """(status, body, extra header lines) of a request, from the current documents;
    ``stale`` when the daemon has published nothing for longer than it should."""
    if method not in ("GET", "HEAD"):
        return 405, Body(f"{method} is not allowed\n".encode(), TEXT_TYPE), "Allow: GET, HEAD\r\n"
    if path == "/metrics":
        if current.metrics is None:
            return 503, _NOT_READY_METRICS, ""
        return 200, current.metrics, ""
    if path == "/api/v1/alerts":
        if current.alerts is None:
            return 503, _NOT_READY_ALERTS, ""
        return 200, current.alerts, ""
    if path == "/healthz":
        if current.metrics is None:
            return 503, _STARTING, ""
        return (503, _STALE, "") if stale else (200, _HEALTHY, "")
    if path == "/":
        return 200, _INDEX, ""
    return 404, _NOT_FOUND, ""


class Compression:
    """gzip of one body, a step at a time."""

    def __init__(self, body: Body) -> None:
        self.body = body
        self._z = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31)  # 31: a gzip member
        self._offset = 0
        self._parts: list[bytes] = []

    def step(self) -> bool:
        """Compress the next piece; True once the body's gzip form is set."""
        data = self.body.data
        piece = memoryview(data)[self._offset : self._offset + COMPRESS_STEP]
        self._parts.append(self._z.compress(piece))
        self._offset += len(piece)
        if self._offset < len(data):
            return False
        self._parts.append(self._z.flush())
        self.body.gzip = b"".join(self._parts)
        self._parts = []
        return True


# --------------------------------------------------------------------------------------------
# Requests


class BadRequest(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class Request:
    __slots__ = ("authorization", "gzip", "http10", "keep_alive", "method", "path")

    def __init__(
        self,
        method: str,
        path: str,
        keep_alive: bool,
        http10: bool,
        gzip: bool,
        authorization: str = "",
    ) -> None:
        self.method = method
        self.path = path
        self.keep_alive = keep_alive
        #: HTTP/1.0: keep-alive is announced only when the client asked for it.
        self.http10 = http10
        #: Whether Accept-Encoding allows gzip.
        self.gzip = gzip
        #: The Authorization header's value, as sent ("" without one).
        self.authorization = authorization


def accepts_gzip(header: str) -> bool:
    """Whether an Accept-Encoding value (RFC 9110 §12.5.3) allows gzip."""
    allowed = False
    for item in header.split(","):
        coding, _, params = item.strip().partition(";")
        coding = coding.strip().lower()
        if coding not in ("gzip", "x-gzip", "*"):
            continue
        weight = 1.0
        for param in params.split(";"):
            name, _, value = param.strip().partition("=")
            if name.strip().lower() == "q":
                try:
                    weight = float(value)
                except ValueError:
                    weight = 0.0
        if coding == "*" and allowed:
            continue  # an explicit gzip entry wins over the wildcard
        allowed = weight > 0
        if coding != "*":
            return allowed
    return allowed


def parse_request(buffer: bytes | bytearray) -> tuple[Request, int] | None:
    """The first request in ``buffer`` and the bytes it takes (head and body), or None while
    it is incomplete. Raises :class:`BadRequest` with the status to answer before closing."""
    start = 0
    # RFC 9112 §2.2: empty lines before a request line are ignored, a few of them: an endless
    # stream of them would otherwise be rescanned on every read and never end.
    blank = 0
    while buffer.startswith(b"\r\n", start) or buffer.startswith(b"\n", start):
        start += 2 if buffer.startswith(b"\r\n", start) else 1
        blank += 1
        if blank > MAX_BLANK_LINES:
            raise BadRequest(400)
    end = buffer.find(b"\n\r\n", start)
    bare = buffer.find(b"\n\n", start)
    if bare != -1 and (end == -1 or bare < end):
        head_end, body_start = bare, bare + 2
    elif end != -1:
        head_end, body_start = end, end + 3
    else:
        if len(buffer) - start > MAX_REQUEST_HEAD:
            raise BadRequest(431)
        return None
    if head_end - start > MAX_REQUEST_HEAD:
        raise BadRequest(431)
    lines = bytes(buffer[start:head_end]).decode("latin-1").split("\n")
    if len(lines) - 1 > MAX_HEADER_LINES:
        raise BadRequest(431)
    parts = lines[0].strip().split()
    if len(parts) != 3:
        raise BadRequest(400)
    method, target, version = parts
    if not version.startswith("HTTP/1."):
        raise BadRequest(505 if version.startswith("HTTP/") else 400)
    http10 = version == "HTTP/1.0"
    connection = ""
    encoding = ""
    authorization = ""
    length: int | None = None
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or name != name.strip():
            raise BadRequest(400)
        name = name.lower()
        value = value.strip()
        if name == "connection":
            connection = value.lower()
        elif name == "accept-encoding":
            encoding = f"{encoding},{value}" if encoding else value
        elif name == "authorization":
            if authorization:
                raise BadRequest(400)  # which one would a proxy in front have checked?
            authorization = value
        elif name == "content-length":
            # RFC 9110 §8.6: a list of one value repeated ("5, 5") is the same length; two
            # different values, in one header or several, leave the framing ambiguous.
            for item in value.split(","):
                item = item.strip()
                if not (item.isascii() and item.isdigit()):  # latin-1 has "²", a digit
                    raise BadRequest(400)
                if len(item) > 18:  # int() refuses more than 4300 digits; all are too many
                    raise BadRequest(413)
                if length is not None and int(item) != length:
                    raise BadRequest(400)
                length = int(item)
            if length is not None and length > MAX_REQUEST_BODY:
                raise BadRequest(413)
        elif name == "transfer-encoding":
            raise BadRequest(501)
    length = length or 0
    if len(buffer) < body_start + length:
        return None
    tokens = {t.strip() for t in connection.split(",")}
    keep_alive = "keep-alive" in tokens if http10 else "close" not in tokens
    path = target.split("?", 1)[0]
    if path.startswith(("http://", "https://")):  # absolute form (RFC 9112 §3.2.2)
        path = "/" + path.split("://", 1)[1].partition("/")[2]
    request = Request(method, path, keep_alive, http10, accepts_gzip(encoding), authorization)
    return request, body_start + length


# --------------------------------------------------------------------------------------------
# Access: TLS, basic auth, privileges

#: exporter-toolkit's version names (web-config.yml ``min_version``/``max_version``).
TLS_VERSIONS = ("TLS10", "TLS11", "TLS12", "TLS13")
#: Successful credentials remembered, so that a scraper pays one bcrypt check, not one per
#: scrape; only a correct password adds an entry. Keyed by a SHA-256 of the user, the hash it
#: was checked against and the password (as exporter-toolkit keys its cache), so no password
#: is kept here in the clear; the oldest entry goes first when it is full.
VERIFIED_CREDENTIALS = 64
#: bcrypt checks of unremembered credentials, per client address (an IPv6 client by its /64):
#: a burst of this many, then this many per second. One check at cost 10 takes about 60 ms of
#: a core, so wrong passwords sent as fast as a client can send them are refused without a
#: check beyond the budget (the client cannot tell the difference), and a client that guesses
#: spends its own budget only: the scraper's first request after a restart is checked at once.
BCRYPT_CHECKS_PER_SECOND = 2.0
BCRYPT_BURST = 4.0
#: Client addresses whose budgets are kept; the one unused longest goes first (a new address
#: starts with a full burst, so a table at its bound costs an attacker with many addresses no
#: more than its addresses already give it).
BCRYPT_CLIENTS = 4096
#: Checks queued for the checking thread at most: beyond them a request is refused unchecked,
#: so that many guessing addresses together cannot queue work without a bound.
BCRYPT_PENDING = 16
#: The nice value of the thread that runs the bcrypt checks.
CHECK_NICE = 10
#: How long a request refused without a check (its client's budget spent) waits for its 401:
#: a guessing client's connections then spend their time waiting, not the loop's time on
#: refusals as fast as they can be sent. About when its budget has a check again.
REFUSAL_DELAY_SECONDS = 1.0 / BCRYPT_CHECKS_PER_SECOND
#: What a 401 asks for (RFC 7617).
AUTHENTICATE = 'WWW-Authenticate: Basic realm="nodescope", charset="UTF-8"\r\n'


def tls_context(settings: dict[str, object]) -> object:
    """The server's ssl.SSLContext from the ``tls`` settings the daemon derived from
    web-config.yml (nodescope.webconfig checks them and calls this too, so that a file that
    cannot be loaded is an error at start, not in this process). Raises OSError or
    ssl.SSLError (a subclass) when a file cannot be read or does not match."""
    import ssl  # only with TLS: it costs this process about 2 MiB

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with contextlib.ExitStack() as opened:
        cert = opened.enter_context(_RegularFile(str(settings["cert_file"])))
        key = opened.enter_context(_RegularFile(str(settings["key_file"])))
        context.load_cert_chain(cert.path, key.path)
        if settings.get("client_ca_file"):
            ca = opened.enter_context(_RegularFile(str(settings["client_ca_file"])))
            context.load_verify_locations(cafile=ca.path)
    versions = dict(
        zip(
            TLS_VERSIONS,
            (ssl.TLSVersion.TLSv1, ssl.TLSVersion.TLSv1_1, ssl.TLSVersion.TLSv1_2,
             ssl.TLSVersion.TLSv1_3),
            strict=True,
        )
    )  # fmt: skip
    context.minimum_version = versions[str(settings["min_version"])]
    if settings.get("max_version"):
        context.maximum_version = versions[str(settings["max_version"])]
    if settings.get("ciphers"):
        context.set_ciphers(str(settings["ciphers"]))
    if settings.get("prefer_server_cipher_suites", True):
        context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    client_auth = settings.get("client_auth", "none")
    if client_auth == "optional":
        context.verify_mode = ssl.CERT_OPTIONAL
    elif client_auth == "required":
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class _RegularFile:
    """A file OpenSSL may read: opened without blocking (a FIFO planted at the path would hold
    OpenSSL's open for good) and refused unless regular; OpenSSL then reads the very file
    that was checked, through ``/proc/self/fd``."""

    def __init__(self, path: str) -> None:
        self.name = path
        self.fd = -1

    def __enter__(self) -> _RegularFile:
        import stat

        self.fd = os.open(self.name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        if not stat.S_ISREG(os.fstat(self.fd).st_mode):
            os.close(self.fd)
            raise OSError(errno.EINVAL, "not a regular file", self.name)
        return self

    @property
    def path(self) -> str:
        return f"/proc/self/fd/{self.fd}"

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def peer_allowed(peer: object, allowed_sans: list[str]) -> bool:
    """Whether a verified client certificate (``SSLSocket.getpeercert()``) names one of
    ``allowed_sans`` among its subject alternative names; any certificate when none are set."""
    if not allowed_sans:
        return True
    if not isinstance(peer, dict):
        return False
    names = {str(value) for _kind, value in peer.get("subjectAltName", ())}
    return any(name in names for name in allowed_sans)


class BasicAuth:
    """RFC 7617 basic auth against bcrypt hashes (web-config.yml ``basic_auth_users``).

    :meth:`decide` answers at once what needs no bcrypt (remembered, malformed, over the
    client's budget) and otherwise leaves the check (:meth:`check`, the slow part) to the
    caller: the loop hands it to :class:`CheckThread`, so that no request waits for a check it
    did not ask for. :meth:`allows` does both in line."""

    def __init__(
        self,
        users: dict[str, bytes],
        checkpw: Callable[[bytes, bytes], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.users = users
        self._checkpw = checkpw
        self._clock = clock
        # An unknown user is checked against a real hash too, so the time a refusal takes
        # does not tell which user names exist.
        self._decoy = next(iter(users.values()))
        import hashlib  # here, before the process gives up root: only with basic auth

        self._sha256 = hashlib.sha256
        self._verified: dict[bytes, None] = {}
        #: client key -> [tokens, when last refilled]; the least recently used first.
        self._budgets: dict[str, list[float]] = {}
        #: Checks refused for want of budget (for the tests and the log).
        self.throttled = 0

    def decide(self, authorization: str, client: str = "") -> bool | None:
        """True: remembered; False: refused without a check (not basic credentials, or the
        client's budget is spent); None: a check is due (the budget paid for it)."""
        user_password = _basic_credentials(authorization)
        if user_password is None:
            return False
        if self._key(*user_password) in self._verified:
            return True
        if not self._take_token(client):
            self.throttled += 1
            return False
        return None

    def check(self, authorization: str) -> bool:
        """The bcrypt check (any thread may run it: it changes nothing here)."""
        user_password = _basic_credentials(authorization)
        if user_password is None:
            return False
        user, password = user_password
        hashed = self.users.get(user, self._decoy)
        try:
            matched = self._checkpw(password, hashed)
        except ValueError:  # a password bcrypt refuses (e.g. a NUL byte)
            matched = False
        return matched and user in self.users

    def remember(self, authorization: str) -> None:
        """A credential :meth:`check` accepted: later requests with it need no check."""
        user_password = _basic_credentials(authorization)
        if user_password is None:
            return
        if len(self._verified) >= VERIFIED_CREDENTIALS:
            del self._verified[next(iter(self._verified))]
        self._verified[self._key(*user_password)] = None

    def allows(self, authorization: str, client: str = "") -> bool:
        """:meth:`decide`, with the check done here when one is due."""
        decided = self.decide(authorization, client)
        if decided is not None:
            return decided
        if not self.check(authorization):
            return False
        self.remember(authorization)
        return True

    def _key(self, user: str, password: bytes) -> bytes:
        hashed = self.users.get(user, b"")
        return self._sha256(b"\0".join((user.encode(), hashed, password))).digest()

    def _take_token(self, client: str) -> bool:
        now = self._clock()
        budget = self._budgets.pop(client, None)
        if budget is None:
            budget = [BCRYPT_BURST, now]
            while len(self._budgets) >= BCRYPT_CLIENTS:
                del self._budgets[next(iter(self._budgets))]
        self._budgets[client] = budget  # most recently used last
        elapsed = max(0.0, now - budget[1])
        budget[1] = now
        budget[0] = min(BCRYPT_BURST, budget[0] + elapsed * BCRYPT_CHECKS_PER_SECOND)
        if budget[0] < 1.0:
            return False
        budget[0] -= 1.0
        return True


def client_key(address: object) -> str:
    """Whose budget a connection spends: the peer's IPv4 address, an IPv6 peer's /64 (one
    host usually holds a whole /64), an IPv4-mapped IPv6 address as the IPv4 one."""
    if not isinstance(address, tuple) or not address or not isinstance(address[0], str):
        return ""
    host = address[0]
    if ":" not in host:
        return host
    if host.startswith("::ffff:") and "." in host:
        return host[7:]
    try:
        return socket.inet_pton(socket.AF_INET6, host.split("%", 1)[0])[:8].hex() + "::/64"
    except (OSError, ValueError):
        return host


class CheckThread:
    """The bcrypt checks, run one at a time in a thread of their own (bcrypt releases the
    GIL while it hashes), so that the loop goes on serving meanwhile. The loop submits a
    check with a token of its own and learns of finished ones through a pipe it selects on.

    Made (its modules imported) before the process gives up root, started after: a thread
    has credentials of its own (capability sets, the bounding set, no-new-privs), and one
    started first would keep root's."""

    def __init__(self, auth: BasicAuth) -> None:
        import queue
        import threading

        self.auth = auth
        self._todo: queue.SimpleQueue[tuple[object, str] | None] = queue.SimpleQueue()
        self._done: deque[tuple[object, str, bool]] = deque()
        self.wakeup, self._signal = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        #: Submitted and not yet collected (the loop's count: only the loop changes it).
        self.pending = 0
        self._thread = threading.Thread(target=self._run, name="bcrypt", daemon=True)
        self._native_id = threading.get_native_id

    def start(self) -> None:
        self._thread.start()

    def submit(self, token: object, authorization: str) -> bool:
        """Queue a check; False when :data:`BCRYPT_PENDING` are queued already."""
        if self.pending >= BCRYPT_PENDING:
            return False
        self.pending += 1
        self._todo.put((token, authorization))
        return True

    def collect(self) -> list[tuple[object, str, bool]]:
        """The checks finished since the last call: (token, authorization, accepted)."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wakeup, 4096):
                pass
        finished: list[tuple[object, str, bool]] = []
        while self._done:
            finished.append(self._done.popleft())
        self.pending -= len(finished)
        return finished

    def _run(self) -> None:
        # Below the loop's priority (a nice value is a thread's own on Linux): when the CPU
        # is short, answering requests goes first and checking passwords waits.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, self._native_id(), CHECK_NICE)
        while True:
            job = self._todo.get()
            if job is None:
                return
            token, authorization = job
            try:
                accepted = self.auth.check(authorization)
            except Exception:  # never a crash of the thread: a refusal
                accepted = False
            self._done.append((token, authorization, accepted))
            with contextlib.suppress(BlockingIOError):
                os.write(self._signal, b"\0")

    def close(self) -> None:
        self._todo.put(None)
        if self._thread.is_alive():
            self._thread.join(1.0)
        os.close(self.wakeup)
        os.close(self._signal)


def _basic_credentials(authorization: str) -> tuple[str, bytes] | None:
    """(user, password) of a ``Basic`` Authorization value, None when it is not one."""
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "basic" or not token:
        return None
    try:
        decoded = base64.b64decode(token.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    user, colon, password = decoded.partition(b":")
    if not colon:
        return None
    try:
        return user.decode("utf-8"), password
    except UnicodeDecodeError:
        return None


def raise_fd_limit(wanted: int) -> int:
    """Raise the soft descriptor limit towards ``wanted`` (no privilege needed below the hard
    limit); the connections that fit in what was granted."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    granted = wanted if soft == resource.RLIM_INFINITY else soft
    return max(1, min(MAX_CONNECTIONS, granted - RESERVED_FDS))


_PR_CAPBSET_DROP = 24
_PR_SET_DUMPABLE = 4
_PR_SET_NO_NEW_PRIVS = 38


def drop_privileges(user: str) -> str:
    """Become ``user`` with no capability and no way to gain one: ``""`` when done (or when
    this process was not root), otherwise why it could not be done.

    Order matters: the bounding set needs CAP_SETPCAP, gone once the uid is not 0; the
    supplementary groups and gid need CAP_SETGID, gone with the uid too. Changing every uid
    away from 0 clears the permitted, effective and ambient sets (capabilities(7), "Effect of
    user ID changes on capabilities"). No-new-privs keeps an execve from gaining any back; not
    dumpable keeps other processes of the same user from tracing this one or reading its
    memory (the TLS key, the password hashes).
    """
    if os.geteuid() != 0:
        return ""
    import ctypes
    import pwd

    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return f"no user {user!r}"
    if entry.pw_uid == 0:
        return f"user {user!r} is root"
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = libc.prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    try:
        with open("/proc/sys/kernel/cap_last_cap") as handle:
            last_cap = int(handle.read())
    except (OSError, ValueError):
        last_cap = 63
    for cap in range(last_cap + 1):
        # Without CAP_SETPCAP (a unit that withholds it) this fails; the uid change below
        # still empties every set that matters, and no-new-privs makes the bounding set moot.
        prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
    try:
        os.setgroups([])
        os.setresgid(entry.pw_gid, entry.pw_gid, entry.pw_gid)
        os.setresuid(entry.pw_uid, entry.pw_uid, entry.pw_uid)
    except OSError as exc:
        return f"cannot become {user!r}: {exc}"
    if prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return f"PR_SET_NO_NEW_PRIVS: {os.strerror(ctypes.get_errno())}"
    prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    return ""


# --------------------------------------------------------------------------------------------
# The loop


class Connection:
    __slots__ = (
        "client", "close_after", "events", "handshaking", "held", "inbuf", "last", "out",
        "sock", "started", "tls", "waiting", "wants_write",
    )  # fmt: skip

    def __init__(
        self, sock: socket.socket, now: float, tls: bool = False, client: str = ""
    ) -> None:
        self.sock = sock
        #: Whose bcrypt budget this connection spends (:func:`client_key`).
        self.client = client
        #: Its request waits for a delayed 401 (:data:`REFUSAL_DELAY_SECONDS`).
        self.held = False
        self.inbuf = bytearray()
        self.out: deque[memoryview | FileRange] = deque()
        self.last = now
        #: When the request being received started (its first byte; the connection's start
        #: for its first request), or None between requests.
        self.started: float | None = now
        self.close_after = False
        #: A request parked until the gzip form of what it asks for is ready, the documents
        #: are rendered, or its credentials are checked.
        self.waiting: Request | None = None
        self.events = selectors.EVENT_READ
        #: An ssl.SSLSocket: bodies are sent through it, never with sendfile(2).
        self.tls = tls
        self.handshaking = tls
        #: The TLS layer needs the socket writable before it can go on (a handshake).
        self.wants_write = False

    def eviction_rank(self) -> tuple[int, float]:
        """Which connection makes room first at the limit: the longest idle, then the one
        whose unfinished request (or silent start) began first, then a response whose client
        stopped reading longest ago. A parked request waits on this process, not on its client:
        it goes last, except one held for a delayed refusal, which goes first."""
        if self.held:
            return (-1, self.last)
        if self.waiting is not None:
            return (3, self.last)
        if self.out:
            return (2, self.last)
        if self.started is not None:
            return (1, self.started)
        return (0, self.last)


_LISTEN = "listen"
_CONTROL = "control"
_CHECKED = "checked"


class Server:
    """The loop. ``tls`` is an ssl.SSLContext to wrap every connection in; ``auth`` checks
    every request's credentials; ``headers`` are header lines added to every response;
    ``max_connections`` defaults to :data:`MAX_CONNECTIONS`."""

    def __init__(
        self,
        listener: socket.socket,
        control: socket.socket,
        clock: Callable[[], float] = time.monotonic,
        *,
        tls: object | None = None,
        allowed_sans: list[str] | None = None,
        auth: BasicAuth | None = None,
        checks: CheckThread | None = None,
        headers: str = "",
        max_connections: int | None = None,
        stale_after: float | None = None,
    ) -> None:
        self.listener = listener
        self.control = control
        self.clock = clock
        #: /healthz answers 503 once the documents are older than this (``None``: never).
        self.stale_after = stale_after
        self.published_at = clock()
        self.tls = tls
        self.allowed_sans = allowed_sans or []
        self.auth = auth
        #: Where credentials are checked off the loop (None: in line, by ``auth``).
        self.checks = checks
        self.headers = headers
        self.max_connections = max_connections
        listener.setblocking(False)
        control.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, _LISTEN)
        self.selector.register(control, selectors.EVENT_READ, _CONTROL)
        if checks is not None:
            self.selector.register(checks.wakeup, selectors.EVENT_READ, _CHECKED)
        self.listening = True
        self.connections: dict[int, Connection] = {}
        self.current = Documents(None, None)
        #: A published exposition that becomes current once its gzip form is ready.
        self.pending: Documents | None = None
        self.job: Compression | None = None
        self.parked: list[Connection] = []
        #: Connections whose 401 is delayed, with when it is due (in that order).
        self.held: deque[tuple[float, Connection]] = deque()
        self.gzip_requested_at = -EAGER_SECONDS
        #: The newest generation the daemon announced (OUTDATED or PUBLISH).
        self.latest_generation = 0
        #: When WANT was sent for documents not published yet (None: nothing asked).
        self.want_sent_at: float | None = None
        #: The generation of the last exposition whose first sending the daemon was told of.
        self.served_generation = -1
        self._parsed: dict[bytes, Request] = {}
        self.running = True
        self._date_second = -1
        self._date = ""
        self._next_sweep = clock() + SWEEP_SECONDS

    def run(self) -> None:
        while self.running:
            timeout = SWEEP_SECONDS
            if self.job is not None:
                timeout = 0.0
            elif self.held:
                timeout = max(0.0, min(timeout, self.held[0][0] - self.clock()))
            self.turn(timeout)
        self.close()

    def turn(self, timeout: float) -> None:
        """One turn of the loop: events, then a step of compression, then timeouts."""
        events = self.selector.select(timeout)
        # The control channel first: a document published before a request arrived is the
        # one that request gets.
        events.sort(key=lambda event: event[0].data != _CONTROL)
        for key, mask in events:
            if key.data == _CONTROL:
                self._on_control()
            elif key.data == _LISTEN:
                self._on_accept()
            elif key.data == _CHECKED:
                self._on_checked()
            else:
                conn: Connection = key.data
                if conn.sock.fileno() == -1:
                    continue  # closed earlier in this turn
                try:
                    if conn.handshaking:
                        self._handshake(conn)
                        continue
                    if mask & selectors.EVENT_WRITE and self._write(conn) and not conn.out:
                        self._process_input(conn)
                    if mask & selectors.EVENT_READ and conn.sock.fileno() != -1:
                        self._on_readable(conn)
                except Exception as exc:  # one client's trouble must not end the others'
                    log("connection_failed", error=f"{type(exc).__name__}: {exc}")
                    self._close(conn)
            if not self.running:
                return
        if self.job is not None:
            self._compress_step()
        now = self.clock()
        if self.want_sent_at is not None and now - self.want_sent_at > RENDER_WAIT_SECONDS:
            # The daemon did not render in time: the waiting requests get what is here.
            self._resume_parked()
        while self.held and self.held[0][0] <= now:
            conn = self.held.popleft()[1]
            request, conn.waiting, conn.held = conn.waiting, None, False
            if request is not None and conn.sock.fileno() != -1:
                self._refuse(conn, request)
                if conn.sock.fileno() != -1:
                    self._process_input(conn)
        if now >= self._next_sweep:
            self._next_sweep = now + SWEEP_SECONDS
            self._sweep(now)

    def close(self) -> None:
        for conn in list(self.connections.values()):
            self._close(conn)
        self.selector.close()
        if self.checks is not None:
            self.checks.close()

    # -- documents -----------------------------------------------------------------------
    def _on_control(self) -> None:
        received: list[tuple[int, int, int, int, int]] = []
        while True:
            try:
                message, fds, _flags, _addr = socket.recv_fds(self.control, PUBLISH.size, 4)
            except BlockingIOError:
                break
            except OSError:
                message, fds = b"", []
            if not message:
                for fd in fds:
                    os.close(fd)
                self.running = False  # the daemon is gone
                break
            if len(message) == OUTDATED.size and not fds:
                generation, bound = OUTDATED.unpack(message)
                self._set_bound(bound)
                self._outdated(generation)
                continue
            if len(message) != PUBLISH.size or len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                log("bad_control_message", bytes=len(message), fds=len(fds))
                continue
            slot, metrics_len, alerts_len, generation, bound = PUBLISH.unpack(message)
            self._set_bound(bound)
            received.append((slot, fds[0], metrics_len, alerts_len, generation))
        # Only the newest of several queued publishes is used; the others are handed back.
        for index, (number, fd, metrics_len, alerts_len, generation) in enumerate(received):
            slot = Slot(fd, number, self._release)
            if index < len(received) - 1:
                slot.retire()
                continue
            try:
                # The exposition stays in the memfd (sent from there, read only to be
                # compressed): a cycle nobody scrapes costs this process nothing more.
                alerts = None
                if alerts_len >= 0:
                    alerts = Body(_pread(fd, alerts_len, max(0, metrics_len)), JSON_TYPE)
            except OSError as exc:
                log("publish_unreadable", error=f"{type(exc).__name__}: {exc}")
                slot.retire()
                continue
            if metrics_len < 0:
                slot.retire()
                self.publish(Documents(None, alerts, generation=generation))
            else:
                metrics = Body(None, METRICS_TYPE, slot=slot, size=metrics_len)
                self.publish(Documents(metrics, alerts, slot, generation))

    def _set_bound(self, bound: float) -> None:
        """The staleness bound of the cycle just heard of (the daemon's tick may have
        changed with a reload)."""
        self.stale_after = bound if bound >= 0 else None

    def _release(self, number: int) -> None:
        # Unsent, the daemon makes a new memfd when it has none released.
        with contextlib.suppress(OSError):
            self.control.send(RELEASE.pack(number))

    def _demand(self, kind: int) -> None:
        # Unsent (the channel is full: the daemon is not reading), the request is answered
        # with what is here once RENDER_WAIT_SECONDS have passed.
        with contextlib.suppress(OSError):
            self.control.send(DEMAND.pack(kind))

    def _outdated(self, generation: int) -> None:
        """A cycle completed; its documents are rendered when a request asks."""
        self.latest_generation = max(self.latest_generation, generation)
        # Cycles complete: /healthz stays healthy though nothing is published.
        self.published_at = self.clock()
        if self.want_sent_at is not None and self.clock() - self.want_sent_at > RENDER_WAIT_SECONDS:
            self.want_sent_at = None  # an unanswered WANT is asked again for the new cycle

    def _newest(self) -> int:
        """The generation of the documents here, current or waiting for their gzip form."""
        pending = self.pending.generation if self.pending is not None else 0
        return max(self.current.generation, pending)

    def _wait_for_render(self, conn: Connection, request: Request) -> bool:
        """Whether ``request`` was parked until the daemon renders the newest cycle's
        documents (asked for once, however many requests wait)."""
        if self.latest_generation <= self._newest() or self.current.metrics is None:
            # Up to date, or nothing published yet (the first cycle is always published).
            return False
        now = self.clock()
        if self.want_sent_at is None:
            self._demand(WANT)
            self.want_sent_at = now
        elif now - self.want_sent_at > RENDER_WAIT_SECONDS:
            return False
        conn.waiting = request
        self.parked.append(conn)
        self._set_events(conn)
        return True

    def publish(self, docs: Documents) -> None:
        self.latest_generation = max(self.latest_generation, docs.generation)
        self.want_sent_at = None
        # A cycle completed, whether its exposition becomes current now or once compressed.
        self.published_at = self.clock()
        if self.pending is not None:
            # Superseded before its compression finished: the newer documents become current
            # at once, so a publish rate above the compression rate cannot freeze them.
            self.pending.retire()
            self.pending = None
            self.job = None
            self._swap(docs)
            return
        eager = (
            docs.metrics is not None
            and docs.metrics.negotiable
            and self.clock() - self.gzip_requested_at < EAGER_SECONDS
        )
        if eager:
            assert docs.metrics is not None
            self.pending = docs
            self.job = Compression(docs.metrics)
        else:
            self._swap(docs)

    def _swap(self, docs: Documents) -> None:
        if self.current is not docs:
            self.current.retire()
        self.current = docs
        self.published_at = self.clock()
        if self.job is not None and self.job.body is not docs.metrics:
            self.job = None  # nothing current needs it any more
        self._resume_parked()

    def _compress_step(self) -> None:
        job = self.job
        assert job is not None
        if not job.step():
            return
        self.job = None
        if self.pending is not None and job.body is self.pending.metrics:
            docs, self.pending = self.pending, None
            self._swap(docs)
        else:
            self._resume_parked()

    def _resume_parked(self) -> None:
        parked, self.parked = self.parked, []
        for conn in parked:
            request, conn.waiting = conn.waiting, None
            if request is None or conn.sock.fileno() == -1:
                continue
            self._respond(conn, request)
            if conn.sock.fileno() != -1:
                self._process_input(conn)

    # -- connections ---------------------------------------------------------------------
    def _on_accept(self) -> None:
        for _ in range(64):
            try:
                sock, address = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors or memory: stop accepting until the next sweep, or
                    # the loop would spin on a listening socket that stays readable.
                    log("accept_failed", error=f"{type(exc).__name__}: {exc}")
                    self.selector.unregister(self.listener)
                    self.listening = False
                return
            now = self.clock()
            limit = MAX_CONNECTIONS if self.max_connections is None else self.max_connections
            while len(self.connections) >= limit and self.connections:
                self._close(min(self.connections.values(), key=Connection.eviction_rank))
            sock.setblocking(False)
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                try:
                    sock = self.tls.wrap_socket(  # type: ignore[attr-defined]
                        sock, server_side=True, do_handshake_on_connect=False
                    )
                except OSError:
                    sock.close()
                    continue
            conn = Connection(sock, now, tls=self.tls is not None, client=client_key(address))
            self.connections[sock.fileno()] = conn
            self.selector.register(sock, selectors.EVENT_READ, conn)

    def _handshake(self, conn: Connection) -> None:
        """A step of the TLS handshake; once done, the client certificate's names are checked
        and what the client already sent is read."""
        import ssl

        try:
            conn.sock.do_handshake()  # type: ignore[attr-defined]
        except ssl.SSLWantReadError:
            conn.wants_write = False
            self._set_events(conn)
            return
        except ssl.SSLWantWriteError:
            conn.wants_write = True
            self._set_events(conn)
            return
        except OSError:  # ssl.SSLError included: a bad or missing client certificate, noise
            self._close(conn)
            return
        conn.handshaking = False
        conn.wants_write = False
        peer = conn.sock.getpeercert() if self.allowed_sans else None  # type: ignore[attr-defined]
        if self.allowed_sans and not peer_allowed(peer, self.allowed_sans):
            self._close(conn)
            return
        conn.last = self.clock()
        self._on_readable(conn)

    def _on_readable(self, conn: Connection) -> None:
        data = self._receive(conn)
        if data is None:
            return
        if not data:
            self._close(conn)
            return
        now = self.clock()
        if conn.started is None:
            conn.started = now
        conn.last = now
        conn.inbuf += data
        if conn.waiting is not None or conn.out:
            # Pipelined behind a response not yet sent: read on, within bounds.
            if len(conn.inbuf) > MAX_REQUEST_HEAD + MAX_REQUEST_BODY:
                self._close(conn)
            return
        self._process_input(conn)

    def _receive(self, conn: Connection) -> bytes | None:
        """What the client sent (b"" at its end, or after an error, having closed the
        connection), None when nothing is there yet."""
        if not conn.tls:
            try:
                return conn.sock.recv(16384)
            except BlockingIOError:
                return None
            except OSError:
                return b""
        import ssl

        # Records already decrypted do not make the socket readable again: take them all now.
        parts: list[bytes] = []
        size = 0
        while size < 65536:
            try:
                chunk = conn.sock.recv(16384)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
                break
            except OSError:
                return b""
            if not chunk:
                if parts:
                    break
                return b""
            parts.append(chunk)
            size += len(chunk)
        return b"".join(parts) if parts else None

    def _process_input(self, conn: Connection) -> None:
        if conn.sock.fileno() == -1:
            return
        # One request at a time: the next is parsed once the previous response is sent, so a
        # client that pipelines without reading holds one response's worth of memory here.
        while conn.inbuf and not conn.out and conn.waiting is None and not conn.close_after:
            try:
                parsed = self._parse(conn.inbuf)
            except BadRequest as exc:
                conn.inbuf.clear()
                body = Body(f"{_REASONS[exc.status].lower()}\n".encode(), TEXT_TYPE)
                self._send(conn, exc.status, body, False, False, "", keep_alive=False)
                break
            if parsed is None:
                break
            request, used = parsed
            del conn.inbuf[:used]
            conn.started = self.clock() if conn.inbuf else None
            self._respond(conn, request)
            if conn.sock.fileno() == -1:
                return
        self._set_events(conn)

    def _parse(self, buffer: bytearray) -> tuple[Request, int] | None:
        """:func:`parse_request`, remembering the heads it parsed: a scraper sends the same
        bytes every time, and a look-up costs a tenth of a parse."""
        end = buffer.find(b"\r\n\r\n")
        if end == -1:
            return parse_request(buffer)
        head = bytes(buffer[: end + 4])
        known = self._parsed.get(head)
        if known is not None:
            return known, len(head)
        parsed = parse_request(buffer)
        if parsed is not None and parsed[1] == len(head):  # no body, no leading empty line
            if len(self._parsed) >= PARSED_HEADS:
                self._parsed.clear()
            self._parsed[head] = parsed[0]
        return parsed

    def _respond(self, conn: Connection, request: Request) -> None:
        if self.auth is not None:
            throttled = self.auth.throttled
            allowed = self.auth.decide(request.authorization, conn.client)
            if allowed is None:
                if self.checks is None:
                    allowed = self.auth.check(request.authorization)
                    if allowed:
                        self.auth.remember(request.authorization)
                elif self.checks.submit(conn, request.authorization):
                    # Parked until the check is done: the loop serves the others meanwhile.
                    conn.waiting = request
                    self._set_events(conn)
                    return
                else:
                    self.auth.throttled += 1
                    allowed = False
            if not allowed:
                if self.checks is not None and self.auth.throttled > throttled:
                    # Refused unchecked: the 401 comes later, so the client waits, not the
                    # loop (a delayed answer is one a password guesser can do nothing with).
                    conn.waiting, conn.held = request, True
                    self.held.append((self.clock() + REFUSAL_DELAY_SECONDS, conn))
                    self._set_events(conn)
                    return
                self._refuse(conn, request)
                return
        document = request.path in _DOCUMENTS and request.method in ("GET", "HEAD")
        if document and self._wait_for_render(conn, request):
            return
        stale = self.stale_after is not None and self.clock() - self.published_at > self.stale_after
        status, body, extra = route(request.method, request.path, self.current, stale)
        if body is self.current.metrics and self.served_generation != self.current.generation:
            self.served_generation = self.current.generation
            self._demand(SERVED)
        gzip = request.gzip and body.negotiable
        if gzip:
            if body is self.current.metrics:
                self.gzip_requested_at = self.clock()
            if body.gzip is None and not self._compress_now_or_park(conn, body, request):
                return
        self._send(
            conn, status, body, gzip, request.method == "HEAD", extra,
            keep_alive=request.keep_alive, http10=request.http10,
        )  # fmt: skip

    def _refuse(self, conn: Connection, request: Request) -> None:
        body = Body(b"unauthorized\n", TEXT_TYPE)
        self._send(
            conn, 401, body, False, request.method == "HEAD", AUTHENTICATE,
            keep_alive=request.keep_alive, http10=request.http10,
        )  # fmt: skip

    def _on_checked(self) -> None:
        """Answer the requests whose credentials were checked."""
        assert self.checks is not None and self.auth is not None
        for token, authorization, accepted in self.checks.collect():
            if accepted:
                self.auth.remember(authorization)
            conn = token
            if not isinstance(conn, Connection) or conn.sock.fileno() == -1:
                continue  # closed meanwhile
            request, conn.waiting = conn.waiting, None
            if request is None:
                continue
            if accepted:
                self._respond(conn, request)  # remembered now: no second check
            else:
                self._refuse(conn, request)
            if conn.sock.fileno() != -1:
                self._process_input(conn)

    def _compress_now_or_park(self, conn: Connection, body: Body, request: Request) -> bool:
        """Whether ``body.gzip`` is ready now; otherwise the request waits for it."""
        if body.size <= COMPRESS_STEP:
            Compression(body).step()
            return True
        conn.waiting = request
        self.parked.append(conn)
        if self.job is None:
            self.job = Compression(body)
        self._set_events(conn)
        return False

    def _send(
        self,
        conn: Connection,
        status: int,
        body: Body,
        gzip: bool,
        head_only: bool,
        extra: str,
        *,
        keep_alive: bool,
        http10: bool = False,
    ) -> None:
        compressed = gzip and body.gzip is not None
        length = len(body.gzip) if compressed and body.gzip is not None else body.size
        head = (
            f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
            f"Date: {self._http_date()}\r\nServer: nodescope\r\n"
            f"Content-Type: {body.content_type}\r\nContent-Length: {length}\r\n"
            + ("Content-Encoding: gzip\r\n" if compressed else "")
            + ("Vary: Accept-Encoding\r\n" if body.negotiable else "")
            + ("" if keep_alive and not http10 else
               "Connection: keep-alive\r\n" if keep_alive else "Connection: close\r\n")
            + extra
            + self.headers
            + "\r\n"
        )  # fmt: skip
        conn.out.append(memoryview(head.encode("latin-1")))
        if head_only or not length:
            pass
        elif compressed and body.gzip is not None:
            conn.out.append(memoryview(body.gzip))
        elif body.slot is not None and body._data is None and not conn.tls:
            body.slot.hold()
            conn.out.append(FileRange(body.slot, body.offset, body.size))
        else:
            conn.out.append(memoryview(body.data))
        if not keep_alive:
            conn.close_after = True
        self._write(conn)

    def _write(self, conn: Connection) -> bool:
        """Send what the socket takes now; False when the connection was closed (a write
        failed, or the last response of a ``Connection: close`` exchange went out)."""
        out = conn.out
        while out:
            first = out[0]
            try:
                if conn.tls:
                    assert isinstance(first, memoryview)
                    # Without partial writes, OpenSSL wants a retry of the same length: the
                    # same slice of the same view, which an unchanged queue gives it.
                    sent = conn.sock.send(first[:262144])
                elif isinstance(first, FileRange):
                    sent = os.sendfile(
                        conn.sock.fileno(), first.slot.fd, first.offset, first.remaining
                    )
                    if not sent:
                        raise OSError(errno.EIO, "the memfd ended early")
                else:
                    views: list[memoryview] = []
                    for item in out:
                        if not isinstance(item, memoryview) or len(views) == 16:
                            break
                        views.append(item)
                    sent = conn.sock.sendmsg(views)
            except BlockingIOError:  # ssl.SSLWantWriteError is not one
                break
            except OSError as exc:
                if conn.tls and _wants_io(exc):
                    break
                self._close(conn)
                return False
            conn.last = self.clock()
            if isinstance(first, FileRange):
                first.offset += sent
                first.remaining -= sent
                if not first.remaining:
                    out.popleft()
                    first.slot.drop()
                continue
            while sent:
                head = out[0]
                assert isinstance(head, memoryview)
                if len(head) <= sent:
                    sent -= len(head)
                    out.popleft()
                else:
                    out[0] = head[sent:]
                    sent = 0
        if not out and conn.close_after:
            self._close(conn)
            return False
        self._set_events(conn)
        return True

    def _set_events(self, conn: Connection) -> None:
        if conn.sock.fileno() == -1:
            return
        writing = conn.out or conn.wants_write
        events = selectors.EVENT_WRITE if writing else selectors.EVENT_READ
        if events != conn.events:
            conn.events = events
            self.selector.modify(conn.sock, events, conn)

    def _close(self, conn: Connection) -> None:
        fd = conn.sock.fileno()
        if fd == -1:
            return
        self.connections.pop(fd, None)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn.sock)
        conn.sock.close()
        for item in conn.out:
            if isinstance(item, FileRange):
                item.slot.drop()
        conn.out.clear()
        conn.waiting = None

    def _sweep(self, now: float) -> None:
        if not self.listening:
            self.selector.register(self.listener, selectors.EVENT_READ, _LISTEN)
            self.listening = True
        for conn in list(self.connections.values()):
            if conn.waiting is not None:
                continue
            if conn.out:
                expired = now - conn.last > WRITE_STALL_SECONDS
            elif conn.started is not None:
                expired = now - conn.started > REQUEST_SECONDS
            else:
                expired = now - conn.last > IDLE_SECONDS
            if expired:
                self._close(conn)

    def _http_date(self) -> str:
        now = int(time.time())
        if now != self._date_second:
            t = time.gmtime(now)
            self._date_second = now
            self._date = (
                f"{_DAYS[t.tm_wday]}, {t.tm_mday:02d} {_MONTHS[t.tm_mon - 1]} {t.tm_year} "
                f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} GMT"
            )
        return self._date


def _wants_io(exc: OSError) -> bool:
    """Whether an error from a TLS socket only means: try again when it is ready."""
    import ssl

    return isinstance(exc, (ssl.SSLWantReadError, ssl.SSLWantWriteError))


def _pread(fd: int, length: int, offset: int) -> bytes:
    parts: list[bytes] = []
    while length > 0:
        chunk = os.pread(fd, length, offset)
        if not chunk:
            raise OSError(errno.EIO, f"memfd ends {length} bytes early")
        parts.append(chunk)
        length -= len(chunk)
        offset += len(chunk)
    return b"".join(parts)


def read_settings(fd: int) -> dict[str, object]:
    """The settings document the daemon wrote into a memfd (see the module docstring)."""
    import json

    with os.fdopen(fd, "rb") as handle:
        data = handle.read(1 << 20)
    document = json.loads(data)
    if not isinstance(document, dict):
        raise ValueError("the settings are not a JSON object")
    return document


def build_server(
    listener: socket.socket, control: socket.socket, settings: dict[str, object]
) -> Server:
    """The loop with its TLS context, basic auth and headers; then the privileges go."""
    max_connections = raise_fd_limit(MAX_CONNECTIONS + RESERVED_FDS)
    tls_settings = settings.get("tls")
    tls = tls_context(tls_settings) if isinstance(tls_settings, dict) else None
    allowed = tls_settings.get("client_allowed_sans", []) if isinstance(tls_settings, dict) else []
    auth = None
    checks = None
    users = settings.get("users")
    if isinstance(users, dict) and users:
        bcrypt_path = settings.get("bcrypt_path")
        if isinstance(bcrypt_path, str) and bcrypt_path and bcrypt_path not in sys.path:
            sys.path.append(bcrypt_path)  # -S left site-packages out; bcrypt alone is used
        import bcrypt

        auth = BasicAuth({str(k): str(v).encode() for k, v in users.items()}, bcrypt.checkpw)
        checks = CheckThread(auth)
    headers = settings.get("headers")
    extra = ""
    if isinstance(headers, dict):
        extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    stale_after = settings.get("stale_after")
    server = Server(
        listener, control, tls=tls, allowed_sans=[str(n) for n in allowed], auth=auth,
        checks=checks,
        headers=extra, max_connections=max_connections,
        stale_after=float(stale_after) if isinstance(stale_after, int | float) else None,
    )  # fmt: skip
    user = settings.get("user", "nobody")
    reason = drop_privileges(str(user))
    if reason:
        # Serving on beats not serving: the daemon's unit may withhold what the change needs
        # (CAP_SETUID, CAP_SETGID and the set*id system calls); say so on every start.
        log("privileges_kept", user=user, reason=reason)
    if checks is not None:
        checks.start()
    return server


def main(argv: list[str] | None = None) -> int:
    """``serving.py --listen-fd N --control-fd M [--settings-fd S]``; the daemon is the only
    caller."""
    args = sys.argv[1:] if argv is None else argv
    fds: dict[str, int] = {}
    for name, value in zip(args[::2], args[1::2], strict=False):
        if name in ("--listen-fd", "--control-fd", "--settings-fd") and value.isdigit():
            fds[name] = int(value)
    if "--listen-fd" not in fds or "--control-fd" not in fds or len(args) != 2 * len(fds):
        print("usage: serving.py --listen-fd N --control-fd M [--settings-fd S]", file=sys.stderr)
        return 2
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    listener = socket.socket(fileno=fds["--listen-fd"])
    control = socket.socket(fileno=fds["--control-fd"])
    try:
        settings = read_settings(fds["--settings-fd"]) if "--settings-fd" in fds else {}
        server = build_server(listener, control, settings)
        server.run()
    except Exception as exc:
        try:
            import traceback  # only now: it pulls in linecache and tokenize

            detail = traceback.format_exc()
        except ImportError:  # after the change of user, the standard library may be out of reach
            detail = repr(exc)
        log("serving_failed", error=detail)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
