"""Server certificates for the ext_proc port: loaded from disk or made at start."""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import ssl
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from cryptography.x509.oid import NameOID

__all__ = [
    "CertificateReloader",
    "ServerCertificate",
    "load_certificate",
    "load_client_ca",
    "reloading_ssl_context",
    "self_signed_certificate",
    "server_credentials",
    "ssl_context",
    "validate_pair",
]

logger = logging.getLogger(__name__)


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


def load_client_ca(path: Path) -> bytes:
    """The PEM bundle of CA certificates in ``path`` that clients' certificates must chain
    to (mTLS); ``OSError`` when it cannot be read, ``ValueError`` saying why when it holds no
    certificate or one does not parse."""
    pem = path.read_bytes()
    try:
        certificates = x509.load_pem_x509_certificates(pem)
    except ValueError as exc:
        raise ValueError(f"{path}: no PEM certificate ({exc})") from None
    if not certificates:
        raise ValueError(f"{path}: no PEM certificate")
    return pem


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


def validate_pair(pair: ServerCertificate) -> x509.Certificate:
    """The leaf certificate of ``pair``; ``ValueError`` saying why when the chain or the key
    does not parse, or the key is not the certificate's."""
    try:
        chain = x509.load_pem_x509_certificates(pair.certificate_pem)
    except ValueError as exc:
        raise ValueError(f"tls.crt: {exc}") from None
    try:
        key = load_pem_private_key(pair.private_key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"tls.key: {exc}") from None
    raw = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*raw) != chain[0].public_key().public_bytes(*raw):
        raise ValueError("tls.key is not the key of tls.crt")
    return chain[0]


def _signature(directory: Path) -> tuple[tuple[int, int, int], ...] | None:
    """What changes when either file is rewritten or its symlink swapped."""
    try:
        stats = [os.stat(directory / name) for name in ("tls.crt", "tls.key")]
    except OSError:
        return None
    return tuple((s.st_ino, s.st_size, s.st_mtime_ns) for s in stats)


class CertificateReloader:
    """``--enable-cert-reload``: gRPC asks ``fetch`` for the certificate at every new TLS
    handshake (``grpc.dynamic_ssl_server_credentials``), so a renewed pair in ``directory``
    reaches new connections while open ones keep theirs.

    ``fetch`` stats the two files (a few microseconds) and reads them only when either
    changed (inode, size or mtime, so a Secret volume's symlink swap counts). A pair that does
    not parse, or whose key is not the certificate's, as when one file is half written or
    only one of them was replaced yet, is logged once and the one being served is kept; the
    next change is checked again. ``fetch`` never raises: it runs in gRPC's threads.
    """

    def __init__(
        self, directory: Path, initial: ServerCertificate, client_ca: bytes | None = None
    ) -> None:
        self._directory = directory
        self._client_ca = client_ca
        self._lock = threading.Lock()
        self._seen = _signature(directory)
        self.current = initial
        self.reloads = 0

    @property
    def client_ca(self) -> bytes | None:
        """The CA clients' certificates must be signed by (``--grpc-client-ca-file``), or None."""
        return self._client_ca

    def credentials(self) -> grpc.ServerCredentials:
        # gRPC documents ``None`` from the fetcher as "no change"; its stubs do not.
        fetch = cast(Callable[[], grpc.ServerCertificateConfiguration], self.fetch)
        return grpc.dynamic_ssl_server_credentials(
            _configuration(self.current, self._client_ca),
            fetch,
            require_client_authentication=self._client_ca is not None,
        )

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        pair = self.poll()
        return None if pair is None else _configuration(pair, self._client_ca)

    def poll(self) -> ServerCertificate | None:
        """The renewed pair, once, when the files changed and hold a valid pair; else None."""
        try:
            with self._lock:
                signature = _signature(self._directory)
                if signature is None or signature == self._seen:
                    return None
                self._seen = signature
                pair = load_certificate(self._directory)
                if pair == self.current:
                    return None
                try:
                    leaf = validate_pair(pair)
                except ValueError as exc:
                    logger.warning(
                        "certificate in %s not reloaded, still serving the previous one: %s",
                        self._directory,
                        exc,
                    )
                    return None
                self.current = pair
                self.reloads += 1
            logger.info(
                "serving the renewed certificate from %s (%s, valid until %s)",
                self._directory,
                leaf.subject.rfc4514_string(),
                leaf.not_valid_after_utc.isoformat(),
            )
            return pair
        except Exception:  # never into a handshake
            logger.exception("certificate reload failed; still serving the previous one")
            return None


def _configuration(
    pair: ServerCertificate, client_ca: bytes | None
) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(pair.private_key_pem, pair.certificate_pem)], root_certificates=client_ca
    )


def ssl_context(
    pair: ServerCertificate, client_ca: bytes | None = None, ciphers: tuple[str, ...] = ()
) -> ssl.SSLContext:
    """The TLS context of ``--extproc-transport=native``: ``pair``, ALPN ``h2``, TLS 1.2 or
    newer; with ``client_ca``, clients must present a certificate signed by it; ``ciphers``
    (OpenSSL names) limit the TLS 1.2 suites."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"])
    if ciphers:
        context.set_ciphers(":".join(ciphers))
    # the ssl module loads a key pair from files only: a private directory, gone at once
    with tempfile.TemporaryDirectory(prefix="epp-tls-") as directory:
        certificate, key = Path(directory) / "tls.crt", Path(directory) / "tls.key"
        for path, data in ((certificate, pair.certificate_pem), (key, pair.private_key_pem)):
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "wb") as file:
                file.write(data)
        context.load_cert_chain(certificate, key)
    if client_ca is not None:
        context.load_verify_locations(cadata=client_ca.decode("ascii"))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def reloading_ssl_context(
    reloader: CertificateReloader, ciphers: tuple[str, ...] = ()
) -> ssl.SSLContext:
    """A context that serves the reloader's pair, renewed at the next handshake after the
    files change (checked at each handshake, as with grpcio's dynamic credentials)."""
    client_ca = reloader.client_ca
    base = ssl_context(reloader.current, client_ca, ciphers)
    served = [base]

    def on_hello(connection: ssl.SSLObject | ssl.SSLSocket, name: str | None, _: object) -> None:
        renewed = reloader.poll()
        if renewed is not None:
            try:
                served[0] = ssl_context(renewed, client_ca, ciphers)
            except (ssl.SSLError, ValueError):
                logger.exception("renewed certificate not served; still serving the previous one")
        if served[0] is not base:
            connection.context = served[0]

    base.sni_callback = on_hello
    return base


def server_credentials(
    pair: ServerCertificate, client_ca: bytes | None = None
) -> grpc.ServerCredentials:
    """TLS with ``pair``; with ``client_ca``, clients must present a certificate signed by
    it, or the handshake fails (in gRPC's threads: no call, nothing on the event loop)."""
    return grpc.ssl_server_credentials(
        [(pair.private_key_pem, pair.certificate_pem)],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )
