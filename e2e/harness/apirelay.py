"""A TCP relay from the node IP to the API server, for daemons on the Pod network.

The local cluster's API server listens on 127.0.0.1 only and there is no kube-proxy, so
a Pod on the node's Pod network (the CNI bridge) cannot reach it. A chart installed with
the chart's defaults (no host network, per-Pod socket names, a surge on update) needs
that: its plugin Pods talk to the API server at `apiServer.host/port`, which the tests
set to this relay on the node IP. The relay copies bytes and looks at none: TLS runs end
to end between the Pod and kube-apiserver, whose serving certificate names every node IP
a run may get (e2e.harness.cluster.control_plane).

It runs as threads of the test process and lives as long as its `with` block: nothing
to find or stop on the host afterwards.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

# A connection to the API server that cannot be made in this long is refused at once;
# the client's own timeouts and retries take over.
CONNECT_TIMEOUT = 10.0
CHUNK = 65536


class ApiRelay:
    """Accepts on `listen_host` (a free port) and relays each connection to
    127.0.0.1:`target_port`."""

    def __init__(self, listen_host: str, target_port: int) -> None:
        self.listen_host = listen_host
        self.target_port = target_port
        self._server = socket.create_server((listen_host, 0))
        self.port: int = self._server.getsockname()[1]
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.connections = 0

    def start(self) -> None:
        threading.Thread(target=self._accept, name="api-relay", daemon=True).start()

    def close(self) -> None:
        """Stop accepting and cut every relayed connection (the clients see a reset and
        reconnect elsewhere, as after an API server restart)."""
        with self._lock:
            self._closed = True
            open_now = list(self._open)
        # shutdown first: closing a listening socket that a thread waits in accept() on
        # leaves it listening until that accept returns (Linux); shutdown wakes it.
        _shut(self._server)
        with contextlib.suppress(OSError):
            self._server.close()
        for sock in open_now:
            _shut(sock)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port), CONNECT_TIMEOUT)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        with self._lock:
            if self._closed:
                _shut(client)
                _shut(upstream)
                return
            self._open.update((client, upstream))
            self.connections += 1
        back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
        back.start()
        _pump(client, upstream)
        back.join()
        with self._lock:
            self._open.difference_update((client, upstream))
        client.close()
        upstream.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """Copy until either side ends; then end the other side's writing (half-close), so
    the peer sees the same end of stream it would have seen directly."""
    try:
        while data := source.recv(CHUNK):
            sink.sendall(data)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


@contextlib.contextmanager
def api_relay(listen_host: str, target_port: int) -> Iterator[ApiRelay]:
    """An `ApiRelay` that accepts for the `with` block's duration."""
    relay = ApiRelay(listen_host, target_port)
    relay.start()
    try:
        yield relay
    finally:
        relay.close()
