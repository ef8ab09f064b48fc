"""The throwaway PKI of one cluster run: a CA, serving and client certs, the SA key.

ECDSA P-256 everywhere: every component accepts it and generating keys costs
microseconds, so a fresh PKI per run is free.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=365)


def _write(path: Path, data: bytes, *, private: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path

    def cert_data(self) -> str:
        return base64.b64encode(self.cert.read_bytes()).decode()

    def key_data(self) -> str:
        return base64.b64encode(self.key.read_bytes()).decode()


class CertificateAuthority:
    """A self-signed CA whose files live in `directory` (ca.crt, ca.key)."""

    def __init__(
        self,
        directory: Path,
        key: ec.EllipticCurvePrivateKey,
        cert: x509.Certificate,
        *,
        name: str = "ca",
    ) -> None:
        self.directory = directory
        self._key = key
        self._cert = cert
        self.pair = CertPair(directory / f"{name}.crt", directory / f"{name}.key")

    @classmethod
    def create(
        cls, directory: Path, *, name: str = "ca", common_name: str = "drasil-e2e-ca"
    ) -> CertificateAuthority:
        """A new CA written to `<directory>/<name>.crt` and `<name>.key`."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        cert = (
            _builder(subject, subject, key, ca=True)
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .sign(key, hashes.SHA256())
        )
        ca = cls(directory, key, cert, name=name)
        _write(ca.pair.cert, _cert_pem(cert))
        _write(ca.pair.key, _key_pem(key), private=True)
        return ca

    @classmethod
    def load(cls, directory: Path, *, name: str = "ca") -> CertificateAuthority:
        key = serialization.load_pem_private_key((directory / f"{name}.key").read_bytes(), None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise TypeError(f"{directory / name}.key is not an EC key")
        cert = x509.load_pem_x509_certificate((directory / f"{name}.crt").read_bytes())
        return cls(directory, key, cert, name=name)

    def issue(
        self,
        name: str,
        *,
        common_name: str,
        organizations: Sequence[str] = (),
        server: bool = False,
        client: bool = False,
        dns_names: Sequence[str] = (),
        ips: Sequence[str] = (),
    ) -> CertPair:
        """Write `<name>.crt` and `<name>.key` next to the CA and return their paths."""
        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
        attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
        usages = []
        if server:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        if client:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        builder = (
            _builder(x509.Name(attrs), self._cert.subject, key, ca=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
        )
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        pair = CertPair(self.directory / f"{name}.crt", self.directory / f"{name}.key")
        _write(pair.cert, _cert_pem(cert))
        _write(pair.key, _key_pem(key), private=True)
        return pair


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey, *, ca: bool
) -> x509.CertificateBuilder:
    """A certificate of `key` valid from five minutes ago for VALIDITY, for a CA (it
    signs certificates) or else for TLS (it signs handshakes)."""
    now = datetime.datetime.now(datetime.UTC)
    usage = x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(usage, critical=True)
    )


def write_service_account_key(directory: Path) -> tuple[Path, Path]:
    """The key pair kube-apiserver signs (and verifies) service-account tokens with."""
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = directory / "sa.key", directory / "sa.pub"
    _write(private, _key_pem(key), private=True)
    _write(
        public,
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
    )
    return private, public


def write_kubeconfig(
    path: Path, *, server: str, ca: CertPair, client: CertPair, user: str, cluster: str
) -> Path:
    """A self-contained kubeconfig (certificates inline), readable only by us."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": cluster,
                "cluster": {"server": server, "certificate-authority-data": ca.cert_data()},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": client.cert_data(),
                    "client-key-data": client.key_data(),
                },
            }
        ],
        "contexts": [{"name": cluster, "context": {"cluster": cluster, "user": user}}],
        "current-context": cluster,
    }
    _write(path, yaml.safe_dump(config, sort_keys=False).encode(), private=True)
    return path
