"""Server certificates for the ext_proc port: loaded from disk or made at start."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = ["ServerCertificate", "load_certificate", "self_signed_certificate"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerCertificate:
    """PEM-encoded certificate chain and private key."""

    certificate_pem: bytes
    private_key_pem: bytes


def load_certificate(directory: Path) -> ServerCertificate:
    """Read ``tls.crt`` and ``tls.key`` from ``directory`` (a mounted Kubernetes secret)."""
    return ServerCertificate(
        certificate_pem=(directory / "tls.crt").read_bytes(),
        private_key_pem=(directory / "tls.key").read_bytes(),
    )


def self_signed_certificate(common_name: str = "epp", days: int = 365) -> ServerCertificate:
    """A fresh self-signed ECDSA P-256 certificate, for TLS without a configured one."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName(common_name),
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    x509.IPAddress(ipaddress.ip_address("::1")),
                ]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    return ServerCertificate(
        certificate_pem=certificate.public_bytes(serialization.Encoding.PEM),
        private_key_pem=key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )
