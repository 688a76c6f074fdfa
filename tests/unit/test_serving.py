"""The serving process's loop (nodescope.serving), driven turn by turn in this process: the
daemon's side is a Publisher on the other end of the control channel, the clients are plain
sockets."""

from __future__ import annotations

import gzip
import socket
import time
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nodescope import serving
from nodescope.httpserver import MAX_SLOTS, Publisher
from nodescope.serving import BadRequest, Server, accepts_gzip, parse_request


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    @property
    def text(self) -> str:
        if self.headers.get("content-encoding") == "gzip":
            return gzip.decompress(self.body).decode()
        return self.body.decode()


class Harness:
    def __init__(self) -> None:
        self.clock = Clock()
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.server = Server(self.listener, theirs, clock=self.clock)
        self.publisher = Publisher(ours)
        self.clients: list[socket.socket] = []
        self.leftover: dict[socket.socket, bytes] = {}

    def pump(self, turns: int = 3) -> None:
        for _ in range(turns):
            self.server.turn(0.0)

    def publish(self, metrics: bytes | None, alerts: bytes | None = None) -> None:
        assert self.publisher.send(metrics, alerts)
        self.pump(1)

    def connect(self) -> socket.socket:
        client = socket.create_connection(self.listener.getsockname()[:2], timeout=5)
        self.clients.append(client)
        self.pump()
        return client

    def read(self, client: socket.socket, head_only: bool = False) -> Response:
        """One response from ``client``, turning the loop while it is not complete."""
        client.setblocking(False)
        data = self.leftover.pop(client, b"")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            self.server.turn(0.0)
            try:
                chunk = client.recv(1 << 20)
                if not chunk:
                    raise ConnectionError(f"closed after {data!r}")
                data += chunk
            except BlockingIOError:
                pass
            head, sep, rest = data.partition(b"\r\n\r\n")
            if not sep:
                continue
            lines = head.decode("latin-1").split("\r\n")
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = 0 if head_only else int(headers["content-length"])
            if len(rest) >= length:
                self.leftover[client] = rest[length:]  # pipelined responses
                return Response(int(lines[0].split()[1]), headers, rest[:length])
        raise AssertionError(f"no complete response: {data[:200]!r}")

    def get(
        self, path: str, client: socket.socket | None = None, *, gzip: bool = False, extra: str = ""
    ) -> Response:
        client = client or self.connect()
        encoding = "Accept-Encoding: gzip\r\n" if gzip else ""
        client.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{encoding}{extra}\r\n".encode())
        return self.read(client)

    def closed(self, client: socket.socket) -> bool:
        client.setblocking(False)
        self.pump()
        try:
            return client.recv(1) == b""
        except BlockingIOError:
            return False
        except ConnectionResetError:
            return True

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self.publisher.close()
        self.server.close()
        self.listener.close()


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.close()


def exposition(generation: int, lines: int = 2000) -> bytes:
    return "".join(f'x{{gen="{generation}",i="{i}"}} {i}\n' for i in range(lines)).encode()


# -- requests ----------------------------------------------------------------------------------


def test_parse_a_get_and_leave_the_next_pipelined_request() -> None:
    first = b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\nAccept-Encoding: gzip, deflate\r\n\r\n"
    parsed = parse_request(first + b"GET / HTTP/1.1\r\n\r\n")
    assert parsed is not None
    request, used = parsed
    assert used == len(first)
    assert (request.method, request.path, request.keep_alive, request.gzip) == (
        "GET", "/metrics", True, True,
    )  # fmt: skip
    assert parse_request(first[:-2]) is None


def test_parse_keep_alive_rules_and_forms() -> None:
    def parse(raw: bytes) -> serving.Request:
        parsed = parse_request(raw)
        assert parsed is not None
        return parsed[0]

    assert not parse(b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n").keep_alive
    assert not parse(b"GET / HTTP/1.0\r\n\r\n").keep_alive
    assert parse(b"GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n").keep_alive
    assert parse(b"\r\nGET http://h:1/metrics HTTP/1.1\n\n").path == "/metrics"
    # A body with a Content-Length is waited for and skipped.
    assert parse_request(b"POST / HTTP/1.1\r\nContent-Length: 4\r\n\r\nab") is None
    assert parse_request(b"POST / HTTP/1.1\r\nContent-Length: 4\r\n\r\nabcd") is not None
    # The same length twice is one length (RFC 9110 §8.6).
    twice = b"POST / HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2, 2\r\n\r\nab"
    parsed = parse_request(twice)
    assert parsed is not None and parsed[1] == len(twice)
    assert parse(b"\r\n" * serving.MAX_BLANK_LINES + b"GET / HTTP/1.1\r\n\r\n").path == "/"
    assert parse(b"GET / HTTP/1.1\r\nAuthorization: Basic eA==\r\n\r\n").authorization == (
        "Basic eA=="
    )


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"GET /\r\n\r\n", 400),
        (b"GET / HTTP/2.0\r\n\r\n", 505),
        (b"GET / HTTP/1.1\r\nno colon\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 501),
        (b"GET / HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n", 413),
        (b"GET / HTTP/1.1\r\nContent-Length: \xb2\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nX: " + b"a" * 9000, 431),
        # Framing two ways at once: RFC 9112 §6.3 says such a message must not be trusted.
        (b"GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", 400),
        (b"GET / HTTP/1.1\r\nContent-Length: 1, 2\r\n\r\nab", 400),
        (b"GET / HTTP/1.1\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n", 413),
        (b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * (serving.MAX_HEADER_LINES + 1) + b"\r\n", 431),
        (b"\r\n" * (serving.MAX_BLANK_LINES + 1) + b"GET / HTTP/1.1\r\n\r\n", 400),
        (b"\r\n" * 100_000, 400),
        (b"GET / HTTP/1.1\r\nAuthorization: a\r\nAuthorization: b\r\n\r\n", 400),
    ],
)
def test_parse_rejects(raw: bytes, status: int) -> None:
    with pytest.raises(BadRequest) as info:
        parse_request(raw)
    assert info.value.status == status


@given(st.binary(max_size=400))
def test_parse_never_fails_otherwise(raw: bytes) -> None:
    try:
        parsed = parse_request(raw)
    except BadRequest as exc:
        assert exc.status in serving._REASONS
        return
    if parsed is not None:
        assert 0 < parsed[1] <= len(raw)


@pytest.mark.parametrize(
    ("header", "allowed"),
    [
        ("gzip", True),
        ("GZIP", True),
        ("deflate, gzip;q=0.5", True),
        ("x-gzip", True),
        ("*", True),
        ("", False),
        ("identity", False),
        ("deflate, br", False),
        ("gzip;q=0", False),
        ("gzip;q=0, *", False),
        ("*, gzip;q=0", False),
        ("*;q=0", False),
        ("gzip;q=oops", False),
    ],
)
def test_accept_encoding(header: str, allowed: bool) -> None:
    assert accepts_gzip(header) is allowed


# -- responses ---------------------------------------------------------------------------------


def test_503_until_published_then_the_documents(harness: Harness) -> None:
    assert harness.get("/metrics").status == 503
    alerts = harness.get("/api/v1/alerts")
    assert (alerts.status, alerts.headers["content-type"]) == (503, "application/json")
    assert (harness.get("/healthz").status, harness.get("/healthz").text) == (503, "starting\n")
    harness.publish(b"x 1\n", b'{"alerts": []}\n')
    metrics = harness.get("/metrics")
    assert (metrics.status, metrics.text) == (200, "x 1\n")
    assert metrics.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert harness.get("/api/v1/alerts").text == '{"alerts": []}\n'
    assert (harness.get("/healthz").status, harness.get("/healthz").text) == (200, "ok\n")
    assert "/metrics" in harness.get("/").text
    # The alerts document may come before the exposition (and the other way round).
    harness.publish(None, b"{}\n")
    assert harness.get("/metrics").status == 503
    assert harness.get("/api/v1/alerts").status == 200


def test_404_405_and_head(harness: Harness) -> None:
    harness.publish(exposition(1))
    assert harness.get("/nope").status == 404
    client = harness.connect()
    client.sendall(b"POST /metrics HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi")
    refused = harness.read(client)
    assert (refused.status, refused.headers["allow"]) == (405, "GET, HEAD")
    client.sendall(b"HEAD /metrics HTTP/1.1\r\n\r\n")
    head = harness.read(client, head_only=True)
    assert head.status == 200 and head.body == b""
    assert int(head.headers["content-length"]) == len(exposition(1))
    # The connection is still usable after both.
    assert harness.get("/metrics", client).text == exposition(1).decode()


def test_a_bad_request_gets_400_and_the_connection_closes(harness: Harness) -> None:
    client = harness.connect()
    client.sendall(b"NONSENSE\r\n\r\n")
    response = harness.read(client)
    assert response.status == 400 and response.headers["connection"] == "close"
    assert harness.closed(client)


def test_gzip_when_asked_and_identical_to_the_plain_body(harness: Harness) -> None:
    body = exposition(1)
    harness.publish(body)
    plain = harness.get("/metrics")
    assert "content-encoding" not in plain.headers
    assert plain.headers["vary"] == "Accept-Encoding"
    compressed = harness.get("/metrics", gzip=True)
    assert compressed.headers["content-encoding"] == "gzip"
    assert len(compressed.body) < len(body) / 3
    assert gzip.decompress(compressed.body) == body == plain.body
    refused = harness.get("/metrics", extra="Accept-Encoding: gzip;q=0\r\n")
    assert "content-encoding" not in refused.headers
    # Small bodies are sent as they are.
    assert "content-encoding" not in harness.get("/healthz", gzip=True).headers


def test_each_published_body_is_compressed_once(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[serving.Body] = []

    class Counting(serving.Compression):
        def __init__(self, body: serving.Body) -> None:
            made.append(body)
            super().__init__(body)

    monkeypatch.setattr(serving, "Compression", Counting)
    harness.publish(exposition(1))
    client = harness.connect()
    for _ in range(5):
        assert harness.get("/metrics", client, gzip=True).status == 200
    assert len(made) == 1
    harness.publish(exposition(2))
    harness.pump(30)
    for _ in range(5):
        assert 'gen="2"' in harness.get("/metrics", client, gzip=True).text
    assert len(made) == 2


def compressing(harness: Harness) -> bool:
    """Whether a published exposition waits for its gzip form."""
    return harness.server.pending is not None


def test_while_gzip_is_asked_a_new_exposition_waits_for_its_gzip_form(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serving, "COMPRESS_STEP", 4096)
    harness.publish(exposition(1))
    client = harness.connect()
    harness.get("/metrics", client, gzip=True)
    harness.publish(exposition(2))
    # Compression in steps: meanwhile the previous documents are served, in both encodings.
    assert compressing(harness)
    assert 'gen="1"' in harness.get("/metrics", client).text
    assert 'gen="1"' in harness.get("/metrics", client, gzip=True).text
    harness.pump(40)
    assert not compressing(harness)
    assert harness.server.current.metrics is not None
    assert harness.server.current.metrics.gzip is not None  # ready before anyone asked
    assert 'gen="2"' in harness.get("/metrics", client, gzip=True).text
    # A second publish before the first's compression ended: the newest is current at once.
    harness.publish(exposition(3))
    harness.publish(exposition(4))
    assert not compressing(harness)
    assert 'gen="4"' in harness.get("/metrics", client).text
    assert 'gen="4"' in harness.get("/metrics", client, gzip=True).text


def test_without_recent_gzip_requests_compression_waits_for_one(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serving, "COMPRESS_STEP", 4096)
    harness.publish(exposition(1))
    client = harness.connect()
    harness.get("/metrics", client, gzip=True)
    harness.clock.now += serving.EAGER_SECONDS + 1
    harness.publish(exposition(2))
    current = harness.server.current.metrics
    assert harness.server.pending is None and current is not None and current.gzip is None
    plain_client = harness.connect()
    # The gzip request waits for its compression; a plain one on another connection does not.
    client.sendall(b"GET /metrics HTTP/1.1\r\nAccept-Encoding: gzip\r\n\r\n")
    harness.pump(1)
    assert harness.server.parked
    assert 'gen="2"' in harness.get("/metrics", plain_client).text
    assert 'gen="2"' in harness.read(client).text
    assert current.gzip is not None


def test_keep_alive_pipelining_and_close(harness: Harness) -> None:
    harness.publish(b"x 1\n", b"{}\n")
    client = harness.connect()
    client.sendall(b"GET /metrics HTTP/1.1\r\n\r\nGET /api/v1/alerts HTTP/1.1\r\n\r\n")
    assert harness.read(client).text == "x 1\n"
    assert harness.read(client).text == "{}\n"
    response = harness.get("/healthz", client, extra="Connection: close\r\n")
    assert response.headers["connection"] == "close"
    assert harness.closed(client)
    old = harness.connect()
    old.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
    assert harness.read(old).status == 200
    assert harness.closed(old)


def test_connections_are_bounded_idle_then_oldest_unfinished_go(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the limit a newcomer takes the place of the longest idle connection, then of the
    oldest unfinished request: clients that never finish a request cannot fill the server."""
    monkeypatch.setattr(serving, "MAX_CONNECTIONS", 3)
    harness.publish(b"x 1\n")
    half_sent = harness.connect()
    half_sent.sendall(b"GET /metrics HTTP/1.1\r\n")
    harness.clock.now += 1
    silent = harness.connect()
    harness.clock.now += 1
    idle = harness.connect()
    assert harness.get("/metrics", idle).status == 200  # done: idle from now on
    harness.clock.now += 1
    first = harness.connect()
    assert harness.get("/metrics", first, extra="Connection: close\r\n").status == 200
    assert harness.closed(idle) and harness.closed(first)
    assert not harness.closed(half_sent) and not harness.closed(silent)
    harness.clock.now += 1
    later = harness.connect()
    later.sendall(b"GET /metrics HTTP/1.1\r\n")
    second = harness.connect()
    assert harness.get("/metrics", second).status == 200
    assert harness.closed(half_sent)
    assert not harness.closed(silent) and not harness.closed(later)
    assert len(harness.server.connections) == 3


def test_idle_and_slow_connections_are_closed(harness: Harness) -> None:
    harness.publish(b"x 1\n")
    idle = harness.connect()
    assert harness.get("/healthz", idle).status == 200
    slow = harness.connect()
    slow.sendall(b"GET /metrics HTTP/1.1\r\n")
    silent = harness.connect()
    harness.pump()
    harness.clock.now += serving.REQUEST_SECONDS + 2
    harness.pump()
    assert harness.closed(slow) and harness.closed(silent) and not harness.closed(idle)
    harness.clock.now += serving.IDLE_SECONDS
    harness.pump()
    assert harness.closed(idle)


def test_the_request_deadline_runs_from_the_connections_start(harness: Harness) -> None:
    """A byte sent just before the deadline does not buy a new one (slowloris)."""
    harness.publish(b"x 1\n")
    client = harness.connect()
    sent = 0
    for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\n":  # 12 s of clock at 2 bytes/s
        try:
            client.sendall(bytes([byte]))
        except ConnectionError:
            break
        sent += 1
        harness.clock.now += 0.5
        harness.pump(1)
    assert harness.closed(client)
    assert sent <= 2 * (serving.REQUEST_SECONDS + serving.SWEEP_SECONDS) + 1


def test_only_the_newest_queued_publish_is_read_and_every_memfd_released(
    harness: Harness,
) -> None:
    for generation in range(3):
        assert harness.publisher.send(exposition(generation, 10), None)
    harness.pump(1)
    assert 'gen="2"' in harness.get("/metrics").text
    # All three were released: the next publishes reuse them, no new memfd is made.
    for generation in range(3, 10):
        harness.publish(exposition(generation, 10))
    assert harness.publisher.memfds == 3
    assert 'gen="9"' in harness.get("/metrics").text


def test_the_loop_ends_when_the_daemon_closes_the_channel(harness: Harness) -> None:
    harness.publish(b"x 1\n")
    harness.publisher.control.close()
    harness.server.run()  # returns: end of file on the channel
    assert not harness.server.running


def test_remembered_request_heads_answer_as_a_parse_would(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serving, "PARSED_HEADS", 2)
    harness.publish(exposition(1))
    client = harness.connect()
    for _ in range(2):  # parsed, then remembered
        assert "content-encoding" not in harness.get("/metrics", client).headers
    assert harness.get("/metrics", client, gzip=True).headers["content-encoding"] == "gzip"
    assert harness.get("/metrics", client).headers.get("content-encoding") is None
    client.sendall(b"POST /metrics HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi")
    assert harness.read(client).status == 405
    # A request with a body is not remembered (its head alone is not the whole request), and
    # the memory stays within its bound.
    assert all(not head.startswith(b"POST") for head in harness.server._parsed)
    assert len(harness.server._parsed) <= 2
    assert harness.get("/healthz", client).status == 200


def test_slow_clients_keep_their_generation_whole(harness: Harness) -> None:
    """A response sent from a memfd holds it: the daemon writes later documents elsewhere
    (reusing the memfds released meanwhile, making new ones when all are held)."""

    def big(generation: int) -> bytes:
        return f'x{{gen="{generation}"}} 1\n'.encode() * 500_000  # 7 MB: more than buffers take

    slow: list[tuple[socket.socket, bytes, serving.Slot]] = []
    for generation in range(MAX_SLOTS + 1):
        body = big(generation)
        harness.publish(body)
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        client.connect(harness.listener.getsockname())
        harness.clients.append(client)
        harness.pump()
        client.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
        harness.pump()
        slot = harness.server.current.slot
        assert slot is not None
        slow.append((client, body, slot))
    harness.publish(b"x 1\n")
    assert harness.publisher.memfds == MAX_SLOTS
    assert len(harness.publisher._one_offs) == 2  # made for one publish each
    for client, body, slot in slow:
        assert slot.retired and slot.users == 1 and slot.fd != -1
        assert harness.read(client).body == body
        assert slot.fd == -1  # handed back once sent
    assert harness.get("/metrics").text == "x 1\n"
    for _ in range(3):
        harness.publish(b"x 2\n")
    assert harness.publisher.memfds == MAX_SLOTS and not harness.publisher._one_offs


# -- basic auth ----------------------------------------------------------------------------------


class CountingCheck:
    """bcrypt's checkpw stand-in that counts calls: the real one is tested against htpasswd's
    hashes in tests/adversarial/test_http.py; here what matters is when it is called."""

    def __init__(self) -> None:
        self.calls: list[bytes] = []

    def __call__(self, password: bytes, hashed: bytes) -> bool:
        self.calls.append(hashed)
        return hashed == b"hash-of-" + password


def basic(user: str, password: str) -> str:
    import base64

    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_basic_auth_remembers_a_correct_password_and_rations_checks() -> None:
    clock = Clock()
    check = CountingCheck()
    auth = serving.BasicAuth({"prom": b"hash-of-secret"}, check, clock)
    for _ in range(5):
        assert auth.allows(basic("prom", "secret"))
    assert len(check.calls) == 1  # checked once, then remembered
    # Wrong passwords: a burst is checked, then refused unchecked until the budget refills.
    refused = [auth.allows(basic("prom", f"guess{i}")) for i in range(20)]
    assert not any(refused)
    burst = int(serving.BCRYPT_BURST)  # the first check, of the correct password, took one
    assert len(check.calls) == burst
    assert auth.throttled == 20 - (burst - 1)
    assert auth.allows(basic("prom", "secret"))  # remembered: no budget needed
    clock.now += 1.0
    assert not auth.allows(basic("prom", "guess"))
    assert len(check.calls) == burst + 1
    # An unknown user is checked against a real hash, as long as a known one.
    clock.now += 10
    assert not auth.allows(basic("nobody", "secret"))
    assert check.calls[-1] == b"hash-of-secret"


@pytest.mark.parametrize(
    "header", ["", "Bearer x", "Basic", "Basic !!!", "Basic " + "eA==", "basic  " + "Og=="]
)
def test_basic_auth_refuses_malformed_credentials_without_a_check(header: str) -> None:
    check = CountingCheck()
    auth = serving.BasicAuth({"": b"hash-of-"}, check, Clock())
    assert not auth.allows(header) or header.endswith("Og==")
    assert len(check.calls) == (1 if header.endswith("Og==") else 0)


def test_401_with_a_challenge_then_200(harness: Harness) -> None:
    harness.server.auth = serving.BasicAuth({"prom": b"hash-of-secret"}, CountingCheck())
    harness.server.headers = "X-Frame-Options: deny\r\n"
    harness.publish(b"x 1\n")
    refused = harness.get("/metrics")
    assert refused.status == 401
    assert refused.headers["www-authenticate"].startswith('Basic realm="nodescope"')
    assert refused.headers["x-frame-options"] == "deny"
    client = harness.connect()
    assert harness.get("/metrics", client, extra="Authorization: Basic eDp5\r\n").status == 401
    good = harness.get("/metrics", client, extra=f"Authorization: {basic('prom', 'secret')}\r\n")
    assert (good.status, good.text) == (200, "x 1\n")


# -- rendering on demand -----------------------------------------------------------------------


def test_requests_for_an_unrendered_cycle_wait_for_it_and_ask_once(harness: Harness) -> None:
    asked: list[int] = []
    harness.publisher.on_demand = asked.append
    assert harness.publisher.send(exposition(1), b'{"gen": 1}\n', 1)
    harness.pump(1)
    assert 'gen="1"' in harness.get("/metrics").text
    assert 'gen="1"' in harness.get("/metrics").text
    harness.publisher.check()
    assert asked == [serving.SERVED]  # once per published exposition
    # A cycle completed and its documents are not rendered: the requests for them wait, and
    # the daemon is asked once, however many wait; /healthz and / do not wait.
    assert harness.publisher.announce(2)
    harness.pump(1)
    waiting = [harness.connect() for _ in range(3)]
    for client, path in zip(waiting, ("/metrics", "/metrics", "/api/v1/alerts"), strict=True):
        client.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    harness.pump(5)
    assert len(harness.server.parked) == 3
    assert harness.get("/healthz").status == 200
    harness.publisher.check()
    assert asked == [serving.SERVED, serving.WANT]
    assert harness.publisher.send(exposition(2), b'{"gen": 2}\n', 2)
    assert 'gen="2"' in harness.read(waiting[0]).text
    assert 'gen="2"' in harness.read(waiting[1]).text
    assert harness.read(waiting[2]).text == '{"gen": 2}\n'
    harness.publisher.check()
    assert asked == [serving.SERVED, serving.WANT, serving.SERVED]


def test_a_render_that_does_not_come_leaves_the_older_documents(harness: Harness) -> None:
    asked: list[int] = []
    harness.publisher.on_demand = asked.append
    assert harness.publisher.send(exposition(1), None, 1)
    harness.pump(1)
    assert harness.publisher.announce(2)
    harness.pump(1)
    client = harness.connect()
    client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    harness.pump(3)
    assert harness.server.parked
    harness.clock.now += serving.RENDER_WAIT_SECONDS + 0.1
    response = harness.read(client)
    assert (response.status, 'gen="1"' in response.text) == (200, True)
    # Meanwhile requests are answered at once; the next cycle is asked for again.
    assert 'gen="1"' in harness.get("/metrics").text
    assert harness.publisher.announce(3)
    harness.pump(1)
    client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    harness.pump(3)
    harness.publisher.check()
    assert asked.count(serving.WANT) == 2
    # A publish older than the newest announced cycle does not end the wait.
    assert harness.publisher.send(exposition(2), None, 2)
    harness.pump(3)
    assert harness.server.parked
    assert harness.publisher.send(exposition(3), None, 3)
    assert 'gen="3"' in harness.read(client).text


def test_an_announced_cycle_keeps_healthz_healthy(harness: Harness) -> None:
    harness.publisher.stale_after = 5.0
    harness.publisher.send(b"x 1\n", None, 1)
    harness.pump(1)
    for generation in range(2, 5):
        harness.clock.now += 4.0
        assert harness.publisher.announce(generation)
        harness.pump(1)
        # Cycles complete, nothing is published: healthy.
        assert harness.get("/healthz").status == 200
    harness.clock.now += 6.0
    assert harness.get("/healthz").text.startswith("stale")


def test_the_staleness_bound_comes_with_each_cycle(harness: Harness) -> None:
    """A reload changes the daemon's tick, and with it the bound: the serving process judges
    /healthz by the bound the newest cycle came with, in both directions."""
    harness.publisher.stale_after = 11.0
    assert harness.publisher.send(b"x 1\n", None, 1)
    harness.pump(1)
    harness.clock.now += 12.0
    assert harness.get("/healthz").text.startswith("stale")
    # The tick goes from 1 s to 30 s: the next cycle brings the 60 s bound.
    harness.publisher.stale_after = 60.0
    assert harness.publisher.announce(2)
    harness.pump(1)
    harness.clock.now += 30.0
    assert harness.get("/healthz").status == 200
    assert harness.publisher.send(b"x 3\n", None, 3)
    harness.pump(1)
    harness.clock.now += 59.0
    assert harness.get("/healthz").status == 200
    harness.clock.now += 2.0
    assert harness.get("/healthz").text.startswith("stale")
    # And back to 1 s: the cycle that brings the short bound is itself fresh.
    harness.publisher.stale_after = 11.0
    assert harness.publisher.send(b"x 4\n", None, 4)
    harness.pump(1)
    assert harness.get("/healthz").status == 200
    harness.clock.now += 12.0
    assert harness.get("/healthz").text.startswith("stale")
    # A daemon that sets no bound: never stale.
    harness.publisher.stale_after = serving.NO_BOUND
    assert harness.publisher.announce(5)
    harness.pump(1)
    harness.clock.now += 1e6
    assert harness.get("/healthz").status == 200


def test_each_client_address_has_its_own_bcrypt_budget() -> None:
    clock = Clock()
    check = CountingCheck()
    auth = serving.BasicAuth({"prom": b"hash-of-secret"}, check, clock)
    for i in range(50):
        assert not auth.allows(basic("prom", f"guess{i}"), "10.0.0.9")
    assert len(check.calls) == int(serving.BCRYPT_BURST)
    # The guesser spent its own budget: the scraper's first request is checked and passes.
    assert auth.allows(basic("prom", "secret"), "10.0.0.1")
    # The table of budgets is bounded: the address unused longest goes first.
    for i in range(serving.BCRYPT_CLIENTS + 10):
        auth.decide(basic("prom", "x"), f"client-{i}")
    assert len(auth._budgets) == serving.BCRYPT_CLIENTS


def test_remembered_credentials_are_hashed_and_evicted_one_at_a_time() -> None:
    check = CountingCheck()
    users = {f"u{i}": f"hash-of-p{i}".encode() for i in range(serving.VERIFIED_CREDENTIALS + 1)}
    auth = serving.BasicAuth(users, check, Clock())
    for i in range(serving.VERIFIED_CREDENTIALS + 1):
        auth.remember(basic(f"u{i}", f"p{i}"))
    assert len(auth._verified) == serving.VERIFIED_CREDENTIALS
    assert all(len(key) == 32 and b"p1" not in key for key in auth._verified)
    assert auth.decide(basic("u0", "p0"), "a") is None  # the oldest went
    assert auth.decide(basic("u1", "p1"), "a") is True  # the others stayed


def test_client_keys() -> None:
    assert serving.client_key(("192.0.2.7", 80)) == "192.0.2.7"
    assert serving.client_key(("::ffff:192.0.2.7", 80, 0, 0)) == "192.0.2.7"
    one = serving.client_key(("2001:db8:1:2::5", 80, 0, 0))
    assert one == serving.client_key(("2001:db8:1:2:ffff::9", 80, 0, 0))
    assert one != serving.client_key(("2001:db8:1:3::5", 80, 0, 0))
    assert serving.client_key("") == ""
