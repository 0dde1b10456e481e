"""``--tls-cipher-suites`` on the ext_proc port and mTLS on the metrics port
(``--metrics-cert-dir``, ``--metrics-client-ca-file``), on the EPP process."""

from __future__ import annotations

import socket
import ssl
import sys
import urllib.request
from pathlib import Path

import pytest

from adapters.envoy.server import TRANSPORTS
from tests.support.certs import client_pair, write_served_pair
from tests.support.stack import ChildProcess, free_port, wait_for


def _tls12_handshake(port: int, cipher: str) -> str | None:
    """The cipher a TLS 1.2 client offering only ``cipher`` gets; None when refused."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(cipher)
    context.set_alpn_protocols(["h2"])
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
            context.wrap_socket(raw) as tls,
        ):
            return tls.cipher()[0]  # type: ignore[index]
    except (ssl.SSLError, OSError):
        return None


def _scrape(port: int, client: tuple[Path, Path] | None) -> int:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if client is not None:
        context.load_cert_chain(*client)
    with urllib.request.urlopen(
        f"https://127.0.0.1:{port}/metrics", context=context, timeout=5
    ) as response:
        return int(response.status)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_cipher_suites_and_metrics_mtls(tmp_path: Path, transport: str) -> None:
    ca, client_cert, client_key = client_pair(tmp_path, "prometheus")
    served = tmp_path / "metrics-tls"
    write_served_pair(served)
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    epp = ChildProcess(
        "epp",
        [
            sys.executable,
            "-m",
            "app",
            "--static-endpoints",
            "127.0.0.1:9",
            "--metrics-endpoint-auth=false",
            "--bind-address",
            "127.0.0.1",
            "--grpc-port",
            str(grpc_port),
            "--grpc-health-port",
            str(health_port),
            "--metrics-port",
            str(metrics_port),
            "--tls-cipher-suites",
            "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384",
            f"--extproc-transport={transport}",
            "--metrics-cert-dir",
            str(served),
            "--metrics-client-ca-file",
            str(ca),
        ],
        tmp_path / "epp.log",
    )
    epp.start()
    try:

        def serving() -> bool:
            epp.check_alive()
            return "ext_proc serving" in epp.log()

        wait_for(serving, timeout=60, what="the EPP to serve")
        assert _tls12_handshake(grpc_port, "ECDHE-ECDSA-AES256-GCM-SHA384") == (
            "ECDHE-ECDSA-AES256-GCM-SHA384"
        )
        assert _tls12_handshake(grpc_port, "ECDHE-ECDSA-AES128-GCM-SHA256") is None
        assert _scrape(metrics_port, (client_cert, client_key)) == 200
        with pytest.raises((ssl.SSLError, OSError)):
            _scrape(metrics_port, None)  # no client certificate: the handshake fails
    finally:
        epp.stop()
