"""The HTTP side of a daemon: ``/metrics`` for Prometheus, ``/healthz`` for probes."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

HealthCheck = Callable[[], tuple[bool, str]]


def parse_addr(addr: str) -> tuple[str, int] | None:
    """``:9400`` / ``127.0.0.1:9400`` -> (host, port); empty or ``0`` disables."""
    if addr in ("", "0"):
        return None
    host, _, port = addr.rpartition(":")
    if not port.isdigit() or int(port) > 65535:
        raise ValueError(
            f"address {addr!r}: expected [host]:port, e.g. :9400 or 127.0.0.1:9400 "
            "(port from 0 to 65535)"
        )
    return (host or "0.0.0.0", int(port))


def serve_http(
    addr: str, *, registry: CollectorRegistry | None = None, health: HealthCheck | None = None
) -> ThreadingHTTPServer | None:
    """Serve in a daemon thread; returns the server (``server_address`` has the port)."""
    where = parse_addr(addr)
    if where is None:
        return None

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics" and registry is not None:
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path in ("/healthz", "/readyz") and health is not None:
                ok, detail = health()
                self._send(200 if ok else 503, (detail or "ok").encode() + b"\n", "text/plain")
            else:
                self._send(404, b"not found\n", "text/plain")

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("http " + format, *args)

    server = ThreadingHTTPServer(where, Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name=f"http{where[1]}", daemon=True).start()
    log.info("serving HTTP", extra={"address": f"{where[0]}:{server.server_port}"})
    return server
