"""The HTTP port as a hostile client sees it: the real serving process on 127.0.0.1, attacked
by real sockets from other processes (slowloris, half-sent requests, an endless stream of
empty lines, ambiguous framing), under the limits of the shipped unit; TLS, basic auth and
client certificates from a web-config.yml, with a certificate made by openssl, a password
hash made by htpasswd and curl as the client; and the serving process's privileges, read
from /proc.

Run as a script, this file is the attacker (``python test_http.py slowloris PORT N SECONDS``):
the attack runs in processes of its own, so the scraper timed here never waits for its GIL.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import resource
import selectors
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.adversarial.common import cgroup_v1_limits, unit_limits

# A scraper's p99 within 50 ms under attack, deadlines of a second or two: bounds on a machine
# of its own.
pytestmark = pytest.mark.alone

REPO = Path(__file__).resolve().parents[2]
#: Run as a module (attackers and the daemon side are this file run again), so its imports of
#: the tests package resolve from the repository root.
MODULE = "tests.adversarial.test_http"
UNIT = REPO / "systemd" / "nodescoped.service"
#: systemd's default for services that set no LimitNOFILE= (systemd.exec(5)): soft 1024,
#: hard 524288.
SYSTEMD_NOFILE = (1024, 524288)
#: The done-when figure: a normal scraper's p99 while the attacks run.
P99_SECONDS = 0.050

SLOW_HEAD = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: slow\r\n"


# --------------------------------------------------------------------------------------------
# The attackers (run in their own processes)


def _raise_own_nofile(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))


def slowloris(port: int, count: int, seconds: float, interval: float = 1.0) -> None:
    """``count`` connections, each sending one byte of a head that never ends every
    ``interval`` seconds; a connection the server closes is opened again at once."""
    _raise_own_nofile(count + 64)
    selector = selectors.DefaultSelector()
    sent: dict[socket.socket, int] = {}
    reopened = 0

    def open_one() -> None:
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        sent[sock] = 0
        selector.register(sock, selectors.EVENT_READ)

    def close(sock: socket.socket) -> None:
        selector.unregister(sock)
        sent.pop(sock)
        sock.close()

    for _ in range(count):
        open_one()
    deadline = time.monotonic() + seconds
    next_round = time.monotonic()
    while time.monotonic() < deadline:
        for key, _mask in selector.select(max(0.0, next_round - time.monotonic())):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            with contextlib.suppress(BlockingIOError):
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    close(sock)
                    open_one()
                    reopened += 1
        if time.monotonic() < next_round:
            continue
        next_round += interval
        for sock in list(sent):
            position = sent[sock]
            byte = SLOW_HEAD[position] if position < len(SLOW_HEAD) else b"X-a: b\r\n"[position % 8]
            try:
                if sock.send(bytes([byte])) == 1:
                    sent[sock] = position + 1
            except BlockingIOError:
                pass
            except OSError:
                close(sock)
                open_one()
                reopened += 1
    print(f"open={len(sent)} reopened={reopened}", flush=True)


def crlf_stream(port: int, seconds: float) -> None:
    """Empty lines as fast as the connection takes them; a new connection when one ends."""
    chunk = b"\r\n" * 8192
    deadline = time.monotonic() + seconds
    connections = 0
    sent = 0
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                connections += 1
                while time.monotonic() < deadline:
                    sock.sendall(chunk)
                    sent += len(chunk)
        except OSError:
            pass
    print(f"connections={connections} bytes={sent}", flush=True)


def start_attack(*args: object) -> subprocess.Popen[str]:
    """An attacker process at the lowest priority: a real one runs on another machine, so its
    own CPU must not be taken from the server and the scraper on this one."""
    return subprocess.Popen(
        ["nice", "-n", "19", sys.executable, "-m", MODULE, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )


def finish(attack: subprocess.Popen[str]) -> str:
    try:
        out, _ = attack.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        attack.kill()
        out, _ = attack.communicate()
    return out.strip()


# --------------------------------------------------------------------------------------------
# The server under the shipped unit's limits


def _nofile(limits: dict[str, str]) -> tuple[int, int]:
    value = limits.get("LimitNOFILE")
    if value is None:
        return SYSTEMD_NOFILE
    soft, _, hard = value.partition(":")
    return int(soft), int(hard or soft)


class FixedCache:
    """A published exposition that does not change: what the daemon hands over each cycle."""

    #: One rendered generation, always the newest offered.
    generation = offered_generation = 1

    def __init__(self, body: bytes) -> None:
        self.fixed = body

    def body(self) -> tuple[bool, bytes]:
        return True, self.fixed


def exposition(series: int = 3000) -> bytes:
    return b"# HELP x x\n# TYPE x gauge\n" + b"".join(
        b'x{gpu="%d",link="%d"} %d\n' % (i % 8, i, i) for i in range(series)
    )


def daemon_side(soft: int, hard: int, web_config: str) -> None:
    """The daemon's part, in a process of its own (as under systemd): descriptor limits as
    given, the real MetricsHTTPServer and its serving process; one line ``PORT PID`` on
    stdout, then it serves until stdin closes."""
    from nodescope import webconfig
    from nodescope.httpserver import JsonCache, MetricsHTTPServer

    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    web = webconfig.load(web_config) if web_config else None
    server = MetricsHTTPServer(
        ("127.0.0.1", 0),
        FixedCache(exposition()),  # type: ignore[arg-type]
        JsonCache(),
        web,
    )
    server.start()
    assert server.process is not None
    print(server_port(server), server.process.pid, flush=True)
    try:
        sys.stdin.read()
    finally:
        server.stop()


class Served:
    def __init__(self, port: int, pid: int, applied: list[str]) -> None:
        self.port = port
        self.pid = pid
        self.applied = applied


@contextlib.contextmanager
def serving(
    *, nofile: tuple[int, int] | None = None, web_config: str = "", unit: bool = True
) -> Iterator[Served]:
    """The real serving process, started by the daemon's MetricsHTTPServer in a process that
    has the descriptor limits systemd would give it and, as root, put into cgroups with the
    unit's memory and CPU limits."""
    limits = unit_limits()
    soft, hard = nofile or _nofile(limits)
    own_hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    # Without CAP_SYS_RESOURCE no process here may go above this process's hard limit.
    hard = min(hard, own_hard)
    daemon = subprocess.Popen(
        [sys.executable, "-m", MODULE, "serve", str(min(soft, hard)), str(hard), web_config],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert daemon.stdout is not None
        line = daemon.stdout.readline().split()
        assert len(line) == 2, "the daemon side did not start"
        port, pid = int(line[0]), int(line[1])
        if unit and os.geteuid() == 0:
            with cgroup_v1_limits(pid, limits) as applied:
                yield Served(port, pid, applied)
        else:
            yield Served(port, pid, [])
    finally:
        if daemon.stdin is not None:
            daemon.stdin.close()
        try:
            daemon.wait(10)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


def server_port(server: object) -> int:
    return int(server.bound.rsplit(":", 1)[1])  # type: ignore[attr-defined]


def wait_until(condition: object, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if condition():  # type: ignore[operator]
                return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def scrape_once(port: int, timeout: float = 2.0, path: str = "/metrics") -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def scrape_latencies(port: int, seconds: float, pause: float = 0.02) -> tuple[list[float], int]:
    """A scraper as Prometheus is: keep-alive, gzip, one request at a time; the latency of
    each scrape (request to last body byte) and how many failed."""
    latencies: list[float] = []
    failures = 0
    conn: http.client.HTTPConnection | None = None
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if conn is None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        started = time.perf_counter()
        try:
            conn.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
            response = conn.getresponse()
            body = response.read()
            ok = response.status == 200 and len(body) > 1000
        except (OSError, http.client.HTTPException):
            ok = False
        if ok:
            latencies.append(time.perf_counter() - started)
        else:
            failures += 1
            conn.close()
            conn = None
        time.sleep(pause)
    if conn is not None:
        conn.close()
    return latencies, failures


def throttling(pid: int) -> str:
    """The CPU quota's throttling of ``pid``'s cpu cgroup (v1 cpu.stat), for the report."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, where = line.split(":", 2)
        if "cpu" in controllers.split(","):
            stat = Path("/sys/fs/cgroup/cpu") / where.lstrip("/") / "cpu.stat"
            with contextlib.suppress(OSError):
                return " ".join(stat.read_text().split())
    return "n/a"


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process, in KiB."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="sets rlimits and cgroups as root")


# --------------------------------------------------------------------------------------------
# Findings: connections


@needs_root
def test_half_sent_requests_cannot_hold_every_connection() -> None:
    """400 requests whose head never ends, against a process that can serve 256 connections
    at once (its descriptor limit allows no more): every scrape is still answered, at once,
    because the oldest unfinished request makes room for a new connection."""
    from nodescope import serving as serving_mod

    hard = 256 + serving_mod.RESERVED_FDS
    _raise_own_nofile(600)
    with serving(nofile=(hard, hard)) as served:
        held = []
        try:
            for _ in range(400):
                sock = socket.create_connection(("127.0.0.1", served.port), timeout=2)
                sock.sendall(SLOW_HEAD)
                held.append(sock)
            time.sleep(0.2)
            answered = []
            for _ in range(5):
                started = time.monotonic()
                status = scrape_once(served.port, timeout=2)
                answered.append((status, time.monotonic() - started))
        finally:
            for sock in held:
                sock.close()
    print(f"half-sent=400 limit=256 scrapes={answered}")
    assert [status for status, _ in answered] == [200] * 5
    assert max(seconds for _, seconds in answered) < 2


def limit() -> float:
    """When a request that began at a connection's start must have been cut off."""
    from nodescope import serving as serving_mod

    return serving_mod.REQUEST_SECONDS + serving_mod.SWEEP_SECONDS + 1


def test_a_request_head_has_a_deadline() -> None:
    """A client that sends its head a byte at a time is closed once the deadline from its
    connection's start has passed, whatever it sends meanwhile."""
    from nodescope import serving as serving_mod

    with serving(unit=False) as served:
        silent = socket.create_connection(("127.0.0.1", served.port), timeout=10)
        sock = socket.create_connection(("127.0.0.1", served.port), timeout=10)
        started = time.monotonic()
        closed_after = None
        try:
            for byte in SLOW_HEAD * 4:
                try:
                    sock.sendall(bytes([byte]))
                    sock.settimeout(0.25)
                    if sock.recv(1) == b"":
                        closed_after = time.monotonic() - started
                        break
                except TimeoutError:
                    continue
                except OSError:
                    closed_after = time.monotonic() - started
                    break
            # A connection that never says anything has the same deadline.
            silent.settimeout(max(0.1, started + limit() - time.monotonic()))
            with contextlib.suppress(ConnectionResetError):
                assert silent.recv(1) == b""
        finally:
            sock.close()
            silent.close()
    assert closed_after is not None
    assert serving_mod.REQUEST_SECONDS <= closed_after < limit()


def test_an_endless_stream_of_empty_lines_is_cut_off() -> None:
    """Empty lines before a request line are ignored a few at a time, then answered with 400
    and the connection closed: a stream of them is not buffered and rescanned for ever."""
    with serving(unit=False) as served:
        sock = socket.create_connection(("127.0.0.1", served.port), timeout=5)
        received = b""
        sent = 0
        try:
            with contextlib.suppress(OSError):
                while sent < 64 << 20:
                    sock.sendall(b"\r\n" * 4096)
                    sent += 8192
            sock.settimeout(2)
            with contextlib.suppress(OSError):
                while chunk := sock.recv(4096):
                    received += chunk
        finally:
            sock.close()
        rss, _hwm = rss_kib(served.pid)
    assert received.startswith(b"HTTP/1.1 400 ")
    assert sent < 16 << 20  # refused within the first few reads, not after 64 MiB
    assert rss < 64 << 10


def test_two_different_content_lengths_are_refused() -> None:
    """RFC 9112 §6.3: a message framed two ways must not be trusted (request smuggling
    through a proxy that reads the other length)."""
    with (
        serving(unit=False) as served,
        socket.create_connection(("127.0.0.1", served.port), timeout=5) as sock,
    ):
        sock.sendall(
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
            b"Content-Length: 41\r\n\r\nGET /metrics HTTP/1.1\r\nHost: smuggled\r\n\r\n"
        )
        sock.settimeout(5)
        response = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                response += chunk
    assert response.startswith(b"HTTP/1.1 400 ")
    assert response.count(b"HTTP/1.1 ") == 1  # nothing answered for the smuggled request


@needs_root
def test_scrapes_stay_fast_under_slowloris_and_a_crlf_stream() -> None:
    """The done-when figure: with 1,000 slowloris connections (a byte a second each, opened
    again whenever closed) and an endless stream of empty lines, a normal scraper's p99 stays
    within 50 ms, the serving process running under the unit's MemoryMax=, CPUQuota= and the
    descriptor limits systemd gives it."""
    with serving() as served:
        quiet, _ = scrape_latencies(served.port, 3)  # the same scraper without the attack
        slow = start_attack("slowloris", served.port, 1000, 16)
        crlf = start_attack("crlf", served.port, 16)
        try:
            time.sleep(3)  # every slow connection open and trickling
            latencies, failures = scrape_latencies(served.port, 10)
        finally:
            slow_report = finish(slow)
            crlf_report = finish(crlf)
        _rss, hwm = rss_kib(served.pid)
        throttled = throttling(served.pid)
    p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
    print(
        f"scrapes={len(latencies)} failed={failures} p50_ms={p50 * 1000:.1f} "
        f"p99_ms={p99 * 1000:.1f} max_ms={max(latencies) * 1000:.1f} peak_rss_kib={hwm} "
        f"limits={served.applied} slowloris[{slow_report}] crlf[{crlf_report}] "
        f"without_attack_p99_ms={percentile(quiet, 0.99) * 1000:.1f} "
        f"load={os.getloadavg()[0]:.1f} throttled=[{throttled}]"
    )
    assert "open=1000" in slow_report
    assert failures == 0 and len(latencies) > 100
    assert p99 <= P99_SECONDS


# --------------------------------------------------------------------------------------------
# Findings: privileges


def status_fields(pid: int) -> dict[str, str]:
    return {
        name: value.strip()
        for name, _, value in (
            line.partition(":") for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        )
    }


@needs_root
def test_the_serving_process_gives_up_root_and_every_capability() -> None:
    """Started by a root daemon, the serving process runs as nobody with no capability in
    any set, no supplementary group and no-new-privs, and still serves what the daemon
    publishes (memfds it was handed, read after the change)."""
    nobody = __import__("pwd").getpwnam("nobody")
    with serving(unit=False) as served:
        conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=5)
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        body = response.read()
        conn.close()
        fields = status_fields(served.pid)  # answering: it has made the change before
    print({k: fields[k] for k in ("Uid", "Gid", "Groups", "CapEff", "CapPrm", "NoNewPrivs")})
    assert fields["Uid"].split() == [str(nobody.pw_uid)] * 4
    assert fields["Gid"].split() == [str(nobody.pw_gid)] * 4
    assert fields["Groups"] == ""
    for capability_set in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(fields[capability_set], 16) == 0, capability_set
    assert fields["NoNewPrivs"] == "1"
    assert response.status == 200 and body == exposition()


# --------------------------------------------------------------------------------------------
# Findings: no TLS, no authentication (web-config.yml)

tools = pytest.mark.skipif(
    not all(shutil.which(tool) for tool in ("openssl", "htpasswd", "curl")),
    reason="openssl, htpasswd (apache2-utils) and curl: scripts/lib.sh installs them",
)


def run_tool(*args: str | Path) -> str:
    done = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout


def make_certificate(directory: Path, name: str, ca: str, san: str) -> tuple[Path, Path]:
    """A P-256 key and a certificate for ``san`` signed by the CA ``ca`` (made by openssl)."""
    key, csr, cert = (directory / f"{name}.{ext}" for ext in ("key", "csr", "crt"))
    ext = directory / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\nbasicConstraints=CA:FALSE\n")
    run_tool("openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", key, "-out", csr, "-subj", f"/CN={name}")  # fmt: skip
    run_tool("openssl", "x509", "-req", "-in", csr, "-CA", directory / f"{ca}.crt",
             "-CAkey", directory / f"{ca}.key", "-CAcreateserial", "-days", "1",
             "-extfile", ext, "-out", cert)  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1, a client certificate the CA signed and one
    from another CA; a password hash from htpasswd."""
    if not all(shutil.which(tool) for tool in ("openssl", "htpasswd", "curl")):
        pytest.skip("openssl, htpasswd (apache2-utils) and curl: scripts/lib.sh installs them")
    directory = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "other-ca"):
        run_tool("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                 "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", directory / f"{ca}.key",
                 "-out", directory / f"{ca}.crt", "-days", "1", "-subj", f"/CN={ca}")  # fmt: skip
    make_certificate(directory, "server", "ca", "IP:127.0.0.1,DNS:localhost")
    make_certificate(directory, "client", "ca", "DNS:prometheus.test")
    make_certificate(directory, "stranger", "other-ca", "DNS:prometheus.test")
    make_certificate(directory, "wrong-name", "ca", "DNS:somebody.test")
    for key in directory.glob("*.key"):
        key.chmod(0o600)  # root's alone: the serving process reads it before it drops root
    line = run_tool("htpasswd", "-nbBC", "10", "prometheus", "correct horse").strip()
    (directory / "hash").write_text(line.split(":", 1)[1])
    return directory


def write_web_config(pki: Path, *, client_auth: str = "", sans: str = "") -> str:
    hashed = (pki / "hash").read_text()
    text = (
        "tls_server_config:\n"
        f"  cert_file: {pki / 'server.crt'}\n"
        f"  key_file: {pki / 'server.key'}\n"
        "  min_version: TLS12\n"
        "  cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256]\n"
    )
    if client_auth:
        text += f"  client_auth_type: {client_auth}\n  client_ca_file: {pki / 'ca.crt'}\n"
    if sans:
        text += f"  client_allowed_sans: [{sans}]\n"
    text += (
        "http_server_config:\n"
        "  headers:\n"
        "    Strict-Transport-Security: max-age=31536000\n"
        f"basic_auth_users:\n  prometheus: '{hashed}'\n"
    )
    path = pki / f"web-{client_auth or 'none'}-{sans or 'any'}.yml"
    path.write_text(text)
    return str(path)


def curl(url: str, *args: str | Path) -> tuple[int, str, str]:
    """curl's exit status, the HTTP status it got ("000" when none) and the headers."""
    done = subprocess.run(
        ["curl", "-sS", "--max-time", "5", "-o", "/dev/null", "-D", "-",
         "-w", "%{http_code}", *map(str, args), url],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    return done.returncode, done.stdout[-3:], done.stdout[:-3]


@tools
def test_tls_and_basic_auth_from_a_web_config(pki: Path) -> None:
    """Good password 200 over TLS; a wrong or missing one 401 with WWW-Authenticate; the
    configured header on every response; plain HTTP to the TLS port gets nothing."""
    with serving(web_config=write_web_config(pki), unit=False) as served:
        url = f"https://127.0.0.1:{served.port}/metrics"
        ca = ("--cacert", pki / "ca.crt")
        rc, status, headers = curl(url, *ca, "-u", "prometheus:correct horse")
        assert (rc, status) == (0, "200")
        assert "strict-transport-security: max-age=31536000" in headers.lower()
        for credentials in (("-u", "prometheus:wrong"), ("-u", "nobody:correct horse"), ()):
            rc, status, headers = curl(url, *ca, *credentials)
            assert (rc, status) == (0, "401"), credentials
            assert 'www-authenticate: basic realm="nodescope"' in headers.lower()
        rc, status, _ = curl(f"http://127.0.0.1:{served.port}/metrics")
        assert rc != 0 and status == "000"
        # The scrape after all that still works (a bad client never takes the process down).
        assert curl(url, *ca, "-u", "prometheus:correct horse")[:2] == (0, "200")


@tools
def test_a_client_certificate_is_required_when_configured(pki: Path) -> None:
    web = write_web_config(pki, client_auth="RequireAndVerifyClientCert", sans="prometheus.test")
    with serving(web_config=web, unit=False) as served:
        url = f"https://127.0.0.1:{served.port}/metrics"
        base = ("--cacert", pki / "ca.crt", "-u", "prometheus:correct horse")

        def with_cert(name: str) -> tuple[int, str]:
            rc, status, _ = curl(url, *base, "--cert", pki / f"{name}.crt",
                                 "--key", pki / f"{name}.key")  # fmt: skip
            return rc, status

        assert with_cert("client") == (0, "200")
        assert curl(url, *base)[1] == "000"  # no certificate
        assert with_cert("stranger")[1] == "000"  # signed by another CA
        assert with_cert("wrong-name")[1] == "000"  # not in client_allowed_sans


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("tls_server_config:\n  cert_file: /x\n  key_file: /y\n  curve_preferences: [X25519]\n",
         "tls_server_config.curve_preferences"),
        ("tls_server_config:\n  cert_file: /x\n  key_file: /y\n"
         "  client_auth_type: RequireAnyClientCert\n", "tls_server_config.client_auth_type"),
        ("tls_server_config:\n  cert_file: /x\n  key_file: /y\n"
         "  cipher_suites: [TLS_AES_128_GCM_SHA256]\n", "tls_server_config.cipher_suites"),
        ("tls_server_config:\n  cert_file: /x\n  key_file: /y\n"
         "  cipher_suites: [TLS_RSA_WITH_RC4_128_SHA]\n", "tls_server_config.cipher_suites"),
        ("tls_server_config:\n  cert_file: /x\n  key_file: /y\n  min_version: TLS14\n",
         "tls_server_config.min_version"),
        ("tls_server_config:\n  cert_file: /x\n  key_file: /y\n"
         "  min_version: TLS13\n  max_version: TLS12\n", "tls_server_config.max_version"),
        ("tls_server_config:\n  key_file: /y\n", "tls_server_config.cert_file"),
        ("tls_server_config:\n  cert_file: /nonexistent/x\n  key_file: /nonexistent/y\n",
         "tls_server_config"),
        ("basic_auth_users:\n  prometheus: plaintext\n", "basic_auth_users.prometheus"),
        ("basic_auth_users:\n  'a:b': '$2y$10$" + "a" * 53 + "'\n", "basic_auth_users.a:b"),
        ("http_server_config:\n  headers:\n    Content-Type: text/html\n",
         "http_server_config.headers.Content-Type"),
        ('http_server_config:\n  headers:\n    X-Frame-Options: "deny\\r\\nSet-Cookie: a=b"\n',
         "http_server_config.headers.X-Frame-Options"),
        ("rate_limit:\n  interval: 1s\n", "rate_limit"),
        ("[" * 100_000, None),
    ],
)  # fmt: skip
def test_a_bad_web_config_is_an_error_naming_the_key(text: str, key: str | None) -> None:
    from nodescope import webconfig
    from nodescope.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        webconfig.parse(text.encode(), "web.yml")
    assert info.value.key == key
    assert str(info.value).startswith("web.yml")


@tools
def test_a_key_that_does_not_match_its_certificate_is_refused(pki: Path) -> None:
    from nodescope import webconfig
    from nodescope.errors import ConfigError

    text = (
        f"tls_server_config:\n  cert_file: {pki / 'server.crt'}\n  key_file: {pki / 'client.key'}\n"
    )
    with pytest.raises(ConfigError, match="TLS setup failed"):
        webconfig.parse(text.encode(), "web.yml")


_KEYS = st.sampled_from(
    ["tls_server_config", "http_server_config", "basic_auth_users", "cert_file", "key_file",
     "client_auth_type", "client_ca_file", "client_allowed_sans", "min_version", "max_version",
     "cipher_suites", "prefer_server_cipher_suites", "headers", "http2", "X-Frame-Options",
     "prometheus", "TLS13", "NoClientCert", "/dev/null"]
) | st.text(max_size=8)  # fmt: skip
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | _KEYS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_KEYS, _VALUES, max_size=4) | st.binary(max_size=200).map(bytes))
def test_any_web_config_is_read_or_refused_with_a_config_error(document: object) -> None:
    import yaml

    from nodescope import webconfig
    from nodescope.errors import ConfigError

    data = document if isinstance(document, bytes) else yaml.safe_dump(document).encode()
    try:
        result = webconfig.parse(data, "web.yml")
    except ConfigError:
        return
    assert isinstance(result, webconfig.WebConfig)


@pytest.mark.parametrize("kind", ["fifo", "unknown-key", "fifo-cert"])
def test_nodescope_run_exits_2_on_a_bad_web_config(tmp_path: Path, kind: str) -> None:
    """A FIFO in place of the file (or of a certificate) is refused, not waited on."""
    path = tmp_path / "web.yml"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "unknown-key":
        path.write_text("basic_auth_user: {}\n")
    else:
        os.mkfifo(tmp_path / "cert.pem")
        path.write_text(
            f"tls_server_config:\n  cert_file: {tmp_path / 'cert.pem'}\n"
            f"  key_file: {tmp_path / 'cert.pem'}\n"
        )
    done = subprocess.run(
        [sys.executable, "-m", "nodescope.cli.main", "run", "--listen", "127.0.0.1:0",
         "--web-config-file", str(path)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert str(path) in done.stderr


if __name__ == "__main__":
    kind, *rest = sys.argv[1:]
    if kind == "serve":
        daemon_side(int(rest[0]), int(rest[1]), rest[2] if len(rest) > 2 else "")
    elif kind == "slowloris":
        slowloris(int(rest[0]), int(rest[1]), float(rest[2]))
    elif kind == "crlf":
        crlf_stream(int(rest[0]), float(rest[1]))
    else:
        raise SystemExit(f"unknown attack {kind!r}")


def test_the_unit_lets_the_serving_process_give_up_root() -> None:
    """Under the shipped unit the drop must be possible: the capabilities it uses in the
    bounding set, and the calls it makes allowed after the filter that refuses
    ``@privileged``."""
    lines = [line.strip() for line in UNIT.read_text().splitlines()]
    bounding = next(line for line in lines if line.startswith("CapabilityBoundingSet="))
    for capability in ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP"):
        assert capability in bounding.split("=", 1)[1].split()
    filters = [line.split("=", 1)[1] for line in lines if line.startswith("SystemCallFilter=")]
    refusing = next(i for i, value in enumerate(filters) if "~@privileged" in value)
    allowed_after = {call for value in filters[refusing + 1 :] for call in value.split()}
    assert {"setgroups", "setresuid", "setresgid"} <= allowed_after
    assert "NoNewPrivileges=yes" in lines
