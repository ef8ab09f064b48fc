"""Plain GETs to the API server over kept-alive connections of our own, one per thread.

A ResourceClaim GET is on kubelet's prepare path. Through urllib3's pool it cost about
0.45 ms of this process's CPU; over an ``http.client`` connection that the calling
thread keeps, about 0.2 ms (measured against the local cluster's API server). One
connection per thread needs no pool and no lock: a gRPC thread reuses its own.

Only what is needed for a GET is done here: TLS with the kubeconfig's CA, client
certificate and server name, the two timeouts of ``API_TIMEOUT``, and one retry when a
kept-alive connection turns out to be closed by the server. A kubeconfig that goes
through a proxy is not handled (``KeptAliveGets.usable`` says so); its caller keeps
using the client's pool, which does.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

# A reused connection that the server closed while idle fails on the first send or
# read in one of these ways; a new connection is tried once.
_STALE: Final = (
    http.client.RemoteDisconnected,
    http.client.CannotSendRequest,
    http.client.BadStatusLine,
    BrokenPipeError,
    ConnectionResetError,
)


@dataclass(frozen=True)
class Answer:
    """The status line and the whole body of one response."""

    status: int
    reason: str
    data: bytes


class KeptAliveGets:
    """GETs to one API server over one kept-alive connection per calling thread."""

    def __init__(self, configuration: Any, *, connect_timeout: float, read_timeout: float):
        url = urlsplit(str(configuration.host))
        self._secure = url.scheme == "https"
        self._hostname = url.hostname or "localhost"
        self._port = url.port or (443 if self._secure else 80)
        self._prefix = url.path.rstrip("/")
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._proxy = bool(getattr(configuration, "proxy", None))
        self._configuration = configuration
        self._context: ssl.SSLContext | None = None  # made at the first connection
        self._server_name = getattr(configuration, "tls_server_name", None) or self._hostname
        self._local = threading.local()

    @property
    def usable(self) -> bool:
        """False when the API server is reached through a proxy (not done here)."""
        return not self._proxy

    def get(self, path: str, headers: Mapping[str, str]) -> Answer:
        """``GET path`` (with its query); raises ``OSError`` or ``http.client``'s
        exceptions when the server cannot be reached or answers garbage."""
        reused = getattr(self._local, "conn", None)
        if reused is not None:
            try:
                return self._exchange(reused, path, headers)
            except _STALE:
                self.drop()  # closed by the server while idle: once more, on a new one
            except BaseException:
                self.drop()  # a timeout mid-answer leaves nothing to reuse
                raise
        conn = self._connect()
        try:
            return self._exchange(conn, path, headers)
        except BaseException:
            self.drop()
            raise

    def drop(self) -> None:
        """Close this thread's connection (the next GET opens a new one)."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def _exchange(
        self, conn: http.client.HTTPConnection, path: str, headers: Mapping[str, str]
    ) -> Answer:
        conn.request("GET", self._prefix + path, headers=dict(headers))
        response = conn.getresponse()
        data = response.read()
        if response.will_close:
            self.drop()
        return Answer(status=response.status, reason=response.reason, data=data)

    def _connect(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection
        if self._secure:
            if self._context is None:  # read the files when used, as the client does
                self._context = _tls_context(self._configuration)
            conn = _TlsConnection(
                self._hostname,
                self._port,
                context=self._context,
                server_name=self._server_name,
                timeout=self._connect_timeout,
            )
        else:
            conn = http.client.HTTPConnection(
                self._hostname, self._port, timeout=self._connect_timeout
            )
        conn.connect()
        assert conn.sock is not None
        # The connect timeout bounds the TCP and TLS handshakes; from here each read
        # of the answer may take up to the read timeout (a slow server, not a dead one).
        conn.sock.settimeout(self._read_timeout)
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._local.conn = conn
        return conn


class _TlsConnection(http.client.HTTPSConnection):
    """HTTPS whose certificate check may name another server than the host dialled
    (a kubeconfig's ``tls-server-name``)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        context: ssl.SSLContext | None,
        server_name: str,
        timeout: float,
    ) -> None:
        super().__init__(host, port, context=context, timeout=timeout)
        self._server_name = server_name
        self._tls = context

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        assert self._tls is not None
        assert self.sock is not None
        self.sock = self._tls.wrap_socket(self.sock, server_hostname=self._server_name)


def _tls_context(configuration: Any) -> ssl.SSLContext:
    """The kubeconfig's TLS settings, as the generated client's urllib3 pool applies them."""
    context = ssl.create_default_context(
        cafile=configuration.ssl_ca_cert or None,
        cadata=getattr(configuration, "ca_cert_data", None) or None,
    )
    if configuration.cert_file:
        context.load_cert_chain(configuration.cert_file, configuration.key_file or None)
    if not configuration.verify_ssl:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif getattr(configuration, "assert_hostname", None) is False:
        context.check_hostname = False
    return context
