"""``metrics-data-source`` over https with the llm-d router's TLS parameters: the servers'
certificates verified against ``caCertPath``, and ``clientCertPath``/``clientKeyPath``
presented to a model server that requires a client certificate (mTLS), on loopback."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from adapters.prometheus.scrape import MetricsDataSource, MetricsSourceParameters
from app.config import ConfigError, load_config
from app.config.notices import NoticeLog
from app.plugins import build_registry
from ports.datalayer import MetricsText
from ports.endpoints import EndpointAddress, EndpointInfo
from ports.plugins import TypedName
from tests.support.certs import CertificateAuthority
from tests.support.scheduling import plugin_handle

BODY = b"vllm:num_requests_waiting 3\n"


class Pki:
    """A CA for the model server and another for the EPP's client certificate."""

    def __init__(self, directory: Path) -> None:
        servers, clients = CertificateAuthority("servers"), CertificateAuthority("clients")
        self.server_ca = servers.write(directory / "server-ca.crt")
        self.client_ca = clients.write(directory / "client-ca.crt")
        self.server_cert, self.server_key = servers.issue(
            "model-server", directory / "server.crt", directory / "server.key", localhost=True
        )
        self.client_cert, self.client_key = clients.issue(
            "epp", directory / "epp.crt", directory / "epp.key"
        )


@asynccontextmanager
async def mtls_metrics_server(pki: Pki) -> AsyncIterator[int]:
    """An https /metrics on loopback that requires a client certificate of the clients' CA."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pki.server_cert, pki.server_key)
    context.load_verify_locations(cafile=pki.client_ca)
    context.verify_mode = ssl.CERT_REQUIRED

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (await reader.readuntil(b"\r\n\r\n")).startswith(b"GET"):
                head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY)
                writer.write(head + BODY)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


def _source(**parameters: object) -> MetricsDataSource:
    return MetricsDataSource(
        TypedName("metrics-data-source", "tls"),
        MetricsSourceParameters(scheme="https", **parameters),  # type: ignore[arg-type]
    )


def _endpoint(port: int) -> EndpointInfo:
    return EndpointInfo(name="ms", address=EndpointAddress(ip="127.0.0.1", port=port))


async def test_a_verified_mtls_scrape_reads_the_metrics(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    async with mtls_metrics_server(pki) as port:
        source = _source(
            insecure_skip_verify=False,
            ca_cert_path=str(pki.server_ca),
            client_cert_path=str(pki.client_cert),
            client_key_path=str(pki.client_key),
        )
        try:
            result = await source.poll(_endpoint(port))
            assert isinstance(result, MetricsText)
            assert result.body == BODY
        finally:
            await source.close()


async def test_without_the_client_certificate_the_server_refuses_the_scrape(
    tmp_path: Path,
) -> None:
    pki = Pki(tmp_path)
    async with mtls_metrics_server(pki) as port:
        source = _source(insecure_skip_verify=False, ca_cert_path=str(pki.server_ca))
        try:
            with pytest.raises((OSError, ValueError)):
                await source.poll(_endpoint(port))
        finally:
            await source.close()


async def test_a_server_certificate_of_another_ca_is_refused(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    async with mtls_metrics_server(pki) as port:
        source = _source(
            insecure_skip_verify=False,
            ca_cert_path=str(pki.client_ca),  # not the servers' CA
            client_cert_path=str(pki.client_cert),
            client_key_path=str(pki.client_key),
        )
        try:
            with pytest.raises((OSError, ValueError), match="certificate verify failed"):
                await source.poll(_endpoint(port))
        finally:
            await source.close()


def _load(parameters: str) -> str:
    text = (
        "plugins:\n- type: queue-scorer\n- type: metrics-data-source\n"
        f"  parameters: {{{parameters}}}\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(
            text,
            registry=build_registry(include_entry_points=False),
            handle=plugin_handle(),
            notice_log=NoticeLog(),
        )
    return str(caught.value)


def test_tls_files_that_do_not_load_stop_the_config_naming_the_parameter(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.crt"
    assert _load(f"scheme: https, insecureSkipVerify: false, caCertPath: {missing}").startswith(
        f"plugins[1].parameters.caCertPath: cannot load {missing}: No such file or directory"
    )
    assert _load(f"scheme: https, clientCertPath: {missing}") == (
        "plugins[1].parameters.clientCertPath: give clientCertPath and clientKeyPath together"
    )


def test_tls_files_without_an_effect_are_said_so(tmp_path: Path) -> None:
    ca = CertificateAuthority("servers").write(tmp_path / "ca.crt")
    loaded = load_config(
        f"plugins:\n- type: queue-scorer\n- type: metrics-data-source\n"
        f"  parameters: {{scheme: https, caCertPath: {ca}}}\n",
        registry=build_registry(include_entry_points=False),
        handle=plugin_handle(),
        notice_log=NoticeLog(),
    )
    assert [line for _, line in loaded.notices] == [
        "plugins[1].parameters.caCertPath: accepted and ignored: insecureSkipVerify is true"
    ]
