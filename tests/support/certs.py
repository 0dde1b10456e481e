"""Throw-away certificates for TLS and mTLS in tests and benches: a CA and certificates it
signed, and the self-signed pair an EPP serves."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from adapters.envoy.tls import ServerCertificate, self_signed_certificate

__all__ = ["CertificateAuthority", "client_pair", "write_served_pair"]

_PEM = serialization.Encoding.PEM


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    """A certificate of ``subject`` by ``issuer``, valid from 5 minutes ago for a day."""
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


class CertificateAuthority:
    """A CA valid for a day, that signs certificates written out as PEM files."""

    def __init__(self, name: str) -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        self.certificate = (
            _builder(_name(name), _name(name), self._key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )

    def write(self, path: Path) -> Path:
        """The CA's certificate, written to ``path``."""
        path.write_bytes(self.certificate.public_bytes(_PEM))
        return path

    def issue(
        self,
        name: str,
        certificate: Path,
        key: Path,
        *,
        localhost: bool = False,
        key_format: serialization.PrivateFormat = serialization.PrivateFormat.PKCS8,
    ) -> tuple[Path, Path]:
        """A certificate for ``name`` signed by this CA (with ``localhost``, for the names
        localhost and 127.0.0.1 too), and its key, written to ``certificate`` and ``key``."""
        private = ec.generate_private_key(ec.SECP256R1())
        builder = _builder(_name(name), self.certificate.subject, private.public_key())
        if localhost:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        certificate.write_bytes(builder.sign(self._key, hashes.SHA256()).public_bytes(_PEM))
        key.write_bytes(private.private_bytes(_PEM, key_format, serialization.NoEncryption()))
        return certificate, key


def client_pair(directory: Path, client: str = "client") -> tuple[Path, Path, Path]:
    """Write ``ca.crt``, and ``<client>.crt`` and ``<client>.key`` signed by that CA, into
    ``directory``; returns their paths in that order."""
    ca = CertificateAuthority(f"{client}-ca")
    certificate, key = ca.issue(client, directory / f"{client}.crt", directory / f"{client}.key")
    return ca.write(directory / "ca.crt"), certificate, key


def write_served_pair(directory: Path) -> ServerCertificate:
    """A fresh self-signed pair as an EPP serves it: ``tls.crt`` and ``tls.key`` in
    ``directory`` (made if missing), for ``--cert-path`` or ``--metrics-cert-dir``."""
    directory.mkdir(parents=True, exist_ok=True)
    pair = self_signed_certificate()
    (directory / "tls.crt").write_bytes(pair.certificate_pem)
    (directory / "tls.key").write_bytes(pair.private_key_pem)
    return pair


def served_certificate(port: int) -> bytes:
    """The DER certificate a new TLS connection (ALPN ``h2``, not verified) to
    ``127.0.0.1:port`` is given."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der
