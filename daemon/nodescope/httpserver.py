"""The HTTP endpoint: ``/metrics`` from the per-cycle cache, ``/api/v1/alerts`` (the active
alerts and findings as JSON, for ``nodescope alerts``), ``/healthz`` and an index page.

Requests never trigger collection or analysis: they copy the bytes rendered at the end of the
last cycle, so 50 concurrent scrapers cost 50 memcpy's, not 50 collections.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from nodescope_exporters.prometheus import MetricsCache

log = logging.getLogger("nodescope.http")

# The classic text format: every name we export is a legal legacy name, and every Prometheus
# release (Debian 12 ships 2.42) parses it.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
JSON = "application/json"

INDEX = b"""<html><head><title>nodescope</title></head><body>
<h1>nodescope</h1><p><a href="/metrics">/metrics</a>
&middot; <a href="/api/v1/alerts">/api/v1/alerts</a> &middot; <a href="/healthz">/healthz</a></p>
</body></html>
"""


class JsonCache:
    """A JSON document rendered once per cycle by the loop and served as bytes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._body: bytes | None = None

    def update(self, document: Any) -> None:
        body = (json.dumps(document, indent=2) + "\n").encode()
        with self._lock:
            self._body = body

    def body(self) -> bytes | None:
        with self._lock:
            return self._body


class _Handler(BaseHTTPRequestHandler):
    server: MetricsHTTPServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            ready, body = self.server.cache.body()
            if not ready:
                self._send(503, b"no collection cycle has completed yet\n", "text/plain")
                return
            self._send(200, body, CONTENT_TYPE)
        elif path == "/api/v1/alerts":
            document = self.server.alerts.body() if self.server.alerts is not None else None
            if document is None:
                self._send(503, b'{"error": "no analysis cycle has completed yet"}\n', JSON)
                return
            self._send(200, document, JSON)
        elif path == "/healthz":
            ready, _ = self.server.cache.body()
            self._send(200 if ready else 503, b"ok\n" if ready else b"starting\n", "text/plain")
        elif path == "/":
            self._send(200, INDEX, "text/html; charset=utf-8")
        else:
            self._send(404, b"not found\n", "text/plain")

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("client=%s request=%r", self.address_string(), format % args)


class MetricsHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self, address: tuple[str, int], cache: MetricsCache, alerts: JsonCache | None = None
    ) -> None:
        self.cache = cache
        self.alerts = alerts
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)
        self._thread: threading.Thread | None = None

    @property
    def bound(self) -> str:
        host, port = self.server_address[:2]
        text = host.decode() if isinstance(host, bytes) else str(host)
        return f"[{text}]:{port}" if ":" in text else f"{text}:{port}"

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.2}, name="http", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
