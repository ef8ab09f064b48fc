"""The relay the chart's daemons on the Pod network reach the API server through
(e2e.harness.apirelay): bytes both ways untouched, ends of stream passed on, every
connection cut when it closes."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest

from e2e.harness.apirelay import ApiRelay, api_relay


@pytest.fixture
def upstream() -> Iterator[socket.socket]:
    """A server on 127.0.0.1 that answers each connection with what it read, reversed,
    once the client has finished sending."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                received = b""
                while data := conn.recv(4096):
                    received += data
                conn.sendall(received[::-1])

    threading.Thread(target=serve, daemon=True).start()
    yield server
    server.close()


def _dial(relay: ApiRelay) -> socket.socket:
    return socket.create_connection((relay.listen_host, relay.port), timeout=10)


def test_bytes_go_through_both_ways_and_an_end_of_stream_is_passed_on(
    upstream: socket.socket,
) -> None:
    with api_relay("127.0.0.1", upstream.getsockname()[1]) as relay, _dial(relay) as conn:
        payload = bytes(range(256)) * 1000  # more than one chunk
        conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)  # the server answers only after our end of stream
        answer = b""
        while data := conn.recv(65536):
            answer += data
        assert answer == payload[::-1]
        assert relay.connections == 1


def test_closing_the_relay_cuts_its_connections_and_refuses_new_ones(
    upstream: socket.socket,
) -> None:
    with api_relay("127.0.0.1", upstream.getsockname()[1]) as relay:
        conn = _dial(relay)
        conn.sendall(b"half a request")
        relay.close()
        # Cut: an end of stream or a reset, either way not left hanging.
        with conn, contextlib.suppress(ConnectionResetError):
            assert conn.recv(100) == b""
        with pytest.raises(ConnectionRefusedError):
            _dial(relay)


def test_a_target_that_refuses_ends_the_client_connection() -> None:
    spare = socket.create_server(("127.0.0.1", 0))
    port = spare.getsockname()[1]
    spare.close()  # nothing listens there now
    with api_relay("127.0.0.1", port) as relay, _dial(relay) as conn:
        assert conn.recv(100) == b""
        assert relay.connections == 0
