"""The transport of the claim GET (``drasil.driver.keptalive``): one connection kept
alive per thread, renewed when the server closed it, TLS checked as the kubeconfig
says, a proxy left to the client's pool.

The peer is a plain HTTP server answering every path with its own path: this tests
connections, not the Kubernetes API (the e2e tests read real claims through it).
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from kubernetes import client

from drasil.driver.keptalive import KeptAliveGets
from drasil.driver.kubeapi import ApiUnavailable, KubeApi


@dataclass
class Server:
    url: str = ""
    connections: list[tuple[str, int]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    close_after: list[bool] = field(default_factory=lambda: [False])


def serve(server: Server, context: ssl.SSLContext | None = None) -> Iterator[Server]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive

        def setup(self) -> None:
            super().setup()
            server.connections.append(self.client_address)

        def do_GET(self) -> None:
            server.headers.append(dict(self.headers))
            if self.path == "/slow":
                time.sleep(0.5)
            body = self.path.encode()
            self.send_response(404 if self.path.endswith("/gone") else 200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            if server.close_after[0]:  # the server drops the connection afterwards
                self.close_connection = True

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    if context is not None:
        httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    scheme = "https" if context else "http"
    server.url = f"{scheme}://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield server
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def plain() -> Iterator[Server]:
    yield from serve(Server())


def gets_for(url: str, **settings: Any) -> KeptAliveGets:
    configuration = client.Configuration()
    configuration.host = url
    for name, value in settings.items():
        setattr(configuration, name, value)
    return KeptAliveGets(configuration, connect_timeout=2.0, read_timeout=2.0)


def test_one_thread_reuses_one_connection(plain: Server) -> None:
    gets = gets_for(plain.url)
    for n in range(5):
        answer = gets.get(f"/a/{n}?x=1", {"Authorization": "Bearer t"})
        assert (answer.status, answer.data) == (200, f"/a/{n}?x=1".encode())
    assert len(plain.connections) == 1
    assert plain.headers[-1]["Authorization"] == "Bearer t"


def test_each_thread_has_its_own_connection(plain: Server) -> None:
    gets = gets_for(plain.url)

    def three() -> None:
        for _ in range(3):
            assert gets.get("/a", {}).status == 200

    threads = [threading.Thread(target=three) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(plain.connections) == 4


def test_a_connection_the_server_closed_is_replaced(plain: Server) -> None:
    gets = gets_for(plain.url)
    plain.close_after[0] = True
    for _ in range(3):
        assert gets.get("/a", {}).status == 200
    assert len(plain.connections) == 3


def test_after_a_timed_out_answer_the_next_get_has_a_new_connection(plain: Server) -> None:
    configuration = client.Configuration()
    configuration.host = plain.url
    gets = KeptAliveGets(configuration, connect_timeout=1.0, read_timeout=0.2)
    assert gets.get("/a", {}).status == 200
    with pytest.raises(TimeoutError):
        gets.get("/slow", {})
    assert gets.get("/b", {}).data == b"/b"
    assert len(plain.connections) == 2


def test_an_error_status_is_an_answer(plain: Server) -> None:
    answer = gets_for(plain.url).get("/gone", {})
    assert (answer.status, answer.reason) == (404, "Not Found")


def test_a_path_prefix_in_the_host_is_kept(plain: Server) -> None:
    answer = gets_for(plain.url + "/k8s/clusters/c-1").get("/apis/x", {})
    assert answer.data == b"/k8s/clusters/c-1/apis/x"


def test_a_proxied_api_server_is_left_to_the_clients_pool() -> None:
    assert not gets_for("https://10.0.0.1:6443", proxy="http://proxy.example:3128").usable
    assert gets_for("https://10.0.0.1:6443").usable


# --- TLS ---------------------------------------------------------------------------------


@dataclass
class Pki:
    ca: Path
    cert: Path
    key: Path


def certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    *,
    issuer: x509.Certificate | None = None,
    issuer_key: ec.EllipticCurvePrivateKey | None = None,
    names: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    """A day-long certificate for ``subject``: a CA when ``issuer`` is None."""
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer.subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    if issuer is None:
        builder = builder.add_extension(
            x509.BasicConstraints(ca=True, path_length=None), critical=True
        )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


def pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A CA and a server certificate for ``api.internal`` and 127.0.0.1."""
    root = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = certificate("test-ca", ca_key)
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("api.internal"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = certificate("api", key, issuer=ca, issuer_key=ca_key, names=names)
    pki = Pki(ca=root / "ca.crt", cert=root / "api.crt", key=root / "api.key")
    pki.ca.write_bytes(pem(ca))
    pki.cert.write_bytes(pem(cert))
    pki.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return pki


@pytest.fixture
def secure(pki: Pki) -> Iterator[Server]:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki.cert, pki.key)
    yield from serve(Server(), context)


def test_tls_with_the_kubeconfigs_ca(secure: Server, pki: Pki) -> None:
    gets = gets_for(secure.url, ssl_ca_cert=str(pki.ca))
    assert gets.get("/a", {}).status == 200
    assert gets.get("/b", {}).status == 200
    assert len(secure.connections) == 1


def test_tls_refuses_a_server_the_ca_did_not_sign(secure: Server, tmp_path: Path) -> None:
    other = tmp_path / "other-ca.crt"
    other.write_bytes(pem(certificate("other", ec.generate_private_key(ec.SECP256R1()))))
    with pytest.raises(ssl.SSLCertVerificationError):
        gets_for(secure.url, ssl_ca_cert=str(other)).get("/a", {})
    # The claim read says what failed.
    configuration = client.Configuration()
    configuration.host = secure.url
    configuration.ssl_ca_cert = str(other)
    api = KubeApi(client.ApiClient(configuration))
    with pytest.raises(ApiUnavailable, match=r"cannot be reached: .*certificate verify failed"):
        api.get_claim("default", "train")


def test_tls_server_name_names_the_certificate_to_check(secure: Server, pki: Pki) -> None:
    named = gets_for(secure.url, ssl_ca_cert=str(pki.ca), tls_server_name="api.internal")
    assert named.get("/a", {}).status == 200
    other = gets_for(secure.url, ssl_ca_cert=str(pki.ca), tls_server_name="elsewhere.internal")
    with pytest.raises(ssl.SSLCertVerificationError):
        other.get("/a", {})
