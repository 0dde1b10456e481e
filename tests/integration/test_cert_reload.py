"""``--enable-cert-reload``: a renewed tls.crt/tls.key reaches new TLS connections of the
ext_proc port without a restart; open streams keep going; a half-written pair is not used;
client certificates (``--grpc-client-ca-file``) stay required with the renewed pair."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import grpc
import pytest
from cryptography import x509

from adapters.envoy.server import TRANSPORTS, GrpcServers, ServerOptions
from adapters.envoy.tls import (
    ServerCertificate,
    load_certificate,
    load_client_ca,
    self_signed_certificate,
)
from domain.datastore import Datastore
from tests.support.certs import client_pair, served_certificate
from tests.support.director import configured_director
from tests.support.extproc import completion, envoy_headers, request_body_chunks, request_headers

from .test_extproc_protocol import ENDPOINT_IPS, EnvoyStream, endpoint_event


def _write(directory: Path, name: str, data: bytes) -> None:
    """Replace a file the way a Secret volume does: a new file renamed over the old one."""
    partial = directory / f".{name}.new"
    partial.write_bytes(data)
    os.replace(partial, directory / name)


def _served_subject(port: int) -> str:
    """The subject CN of the certificate a new TLS connection to ``port`` is given."""
    name = x509.load_der_x509_certificate(served_certificate(port)).subject
    return str(name.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value)


async def _subject(port: int) -> str:
    return await asyncio.to_thread(_served_subject, port)


async def _reloading_servers(
    directory: Path, client_ca: bytes | None = None, transport: str = "native"
) -> GrpcServers:
    """Started servers routing to ``ENDPOINT_IPS``, serving the pair in ``directory`` and
    its renewals."""
    datastore = Datastore()
    for ip in ENDPOINT_IPS:
        datastore.apply(endpoint_event(ip))
    datastore.mark_synced()
    servers = GrpcServers(
        configured_director(datastore),
        ServerOptions(
            host="127.0.0.1",
            grpc_port=0,
            health_port=0,
            certificate=load_certificate(directory),
            reload_certificate_from=directory,
            client_ca=client_ca,
            transport=transport,
        ),
    )
    await servers.start()
    return servers


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_renewed_pair_reaches_new_connections_and_open_streams_go_on(
    transport: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="adapters.envoy.tls")
    old, new = self_signed_certificate("epp-old"), self_signed_certificate("epp-new")
    _write(tmp_path, "tls.crt", old.certificate_pem)
    _write(tmp_path, "tls.key", old.private_key_pem)
    servers = await _reloading_servers(tmp_path, transport=transport)
    port = servers.bound_grpc_port
    old_channel = grpc.aio.secure_channel(
        f"127.0.0.1:{port}",
        grpc.ssl_channel_credentials(root_certificates=old.certificate_pem),
        options=[("grpc.ssl_target_name_override", "localhost")],
    )
    try:
        assert await _subject(port) == "epp-old"
        # a stream opened on the old certificate, in the middle of its request
        open_stream = EnvoyStream(old_channel)
        await open_stream.send(request_headers(envoy_headers()))

        # half renewed: the new certificate with the old key is not a pair
        _write(tmp_path, "tls.crt", new.certificate_pem)
        assert await _subject(port) == "epp-old"
        # half written: a truncated key
        _write(tmp_path, "tls.key", new.private_key_pem[:40])
        assert await _subject(port) == "epp-old"
        assert "not reloaded" in caplog.text
        # the whole pair
        _write(tmp_path, "tls.key", new.private_key_pem)
        assert await _subject(port) == "epp-new"
        assert "serving the renewed certificate" in caplog.text

        # the open stream finishes its request on its old connection
        await open_stream.send(*request_body_chunks(completion()))
        header_reply, _ = await open_stream.read_request_replies()
        assert header_reply.request_headers.response.header_mutation.set_headers
        await open_stream.finish()

        # a new client trusting only the new certificate is served
        async with grpc.aio.secure_channel(
            f"127.0.0.1:{port}",
            grpc.ssl_channel_credentials(root_certificates=new.certificate_pem),
            options=[("grpc.ssl_target_name_override", "localhost")],
        ) as new_channel:
            stream = EnvoyStream(new_channel)
            await stream.route(completion())
            await stream.finish()
        assert servers.reloader is not None
        assert servers.reloader.reloads == 1
    finally:
        await old_channel.close()
        await servers.drain(0)


def test_the_reloader_keeps_serving_when_the_files_vanish(tmp_path: Path) -> None:
    pair = self_signed_certificate()
    _write(tmp_path, "tls.crt", pair.certificate_pem)
    _write(tmp_path, "tls.key", pair.private_key_pem)
    servers = GrpcServers(
        configured_director(Datastore()),
        ServerOptions(
            host="127.0.0.1",
            grpc_port=0,
            health_port=0,
            certificate=ServerCertificate(
                certificate_pem=pair.certificate_pem, private_key_pem=pair.private_key_pem
            ),
            reload_certificate_from=tmp_path,
        ),
    )
    reloader = servers.reloader
    assert reloader is not None
    (tmp_path / "tls.key").unlink()
    assert reloader.fetch() is None
    assert reloader.current.private_key_pem == pair.private_key_pem


async def _routes(port: int, served: bytes, client: tuple[Path, Path] | None) -> str:
    """How one request on a new connection to ``port`` trusting ``served``, presenting
    ``client``, ends: ``OK`` (routed) or the gRPC code."""
    credentials = grpc.ssl_channel_credentials(
        root_certificates=served,
        private_key=client[1].read_bytes() if client else None,
        certificate_chain=client[0].read_bytes() if client else None,
    )
    async with grpc.aio.secure_channel(
        f"127.0.0.1:{port}",
        credentials,
        options=[("grpc.ssl_target_name_override", "localhost"), ("test.tag", str(client))],
    ) as channel:
        stream = EnvoyStream(channel)
        try:
            await stream.route(completion())
            await stream.finish()
        except grpc.aio.AioRpcError as error:
            return error.code().name
    return "OK"


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_client_certificates_stay_required_after_a_renewal(
    tmp_path: Path, transport: str
) -> None:
    served = tmp_path / "served"
    served.mkdir()
    old, new = self_signed_certificate("epp-old"), self_signed_certificate("epp-new")
    _write(served, "tls.crt", old.certificate_pem)
    _write(served, "tls.key", old.private_key_pem)
    ca, client_crt, client_key = client_pair(tmp_path, "gateway")
    servers = await _reloading_servers(served, load_client_ca(ca), transport)
    port = servers.bound_grpc_port
    client = client_crt, client_key
    try:
        assert await _routes(port, old.certificate_pem, client) == "OK"
        assert await _routes(port, old.certificate_pem, None) == "UNAVAILABLE"
        _write(served, "tls.crt", new.certificate_pem)
        _write(served, "tls.key", new.private_key_pem)
        assert await _routes(port, new.certificate_pem, client) == "OK"
        assert await _routes(port, new.certificate_pem, None) == "UNAVAILABLE"
        assert servers.reloader is not None
        assert servers.reloader.reloads == 1
    finally:
        await servers.drain(0)
