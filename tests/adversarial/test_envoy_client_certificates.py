"""Finding: anything that reaches the ext_proc port can open streams (TLS without client
certificates), and opening streams costs the EPP's event loop whatever it does with them.

With ``--grpc-client-ca-file`` the EPP requires a client certificate signed by that CA: the
shipped Envoy config, given one, routes as before; a peer without one, or with one from
another CA, fails the TLS handshake and never gets a stream.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from tests.simulator import DEFAULT_MODEL
from tests.support.certs import client_pair, write_served_pair
from tests.support.extproc import epp_tls_channel, non_streamed_exchange
from tests.support.stack import Stack, StackOptions

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("mtls")
    ca, gateway_crt, gateway_key = client_pair(directory, "gateway")
    other = directory / "other"
    other.mkdir()
    _, stranger_crt, stranger_key = client_pair(other, "gateway")
    served = directory / "served"
    write_served_pair(served)
    return {
        "ca": ca,
        "gateway.crt": gateway_crt,
        "gateway.key": gateway_key,
        "stranger.crt": stranger_crt,
        "stranger.key": stranger_key,
        "served": served,
    }


@pytest.fixture(scope="module")
def stack(certificates: dict[str, Path]) -> Iterator[Stack]:
    options = StackOptions(
        simulators=1,
        epp_args=[
            "--cert-path",
            str(certificates["served"]),
            "--grpc-client-ca-file",
            str(certificates["ca"]),
        ],
        epp_client_certificate=(certificates["gateway.crt"], certificates["gateway.key"]),
    )
    with Stack.run(options) as running:
        yield running


async def _completion(session: aiohttp.ClientSession, url: str) -> int:
    body = orjson.dumps({"model": DEFAULT_MODEL, "prompt": "hello", "max_tokens": 5})
    async with session.post(f"{url}/v1/completions", data=body) as response:
        await response.read()
        return response.status


async def _exchange_code(stack: Stack, client: tuple[Path, Path] | None, tag: str) -> str:
    """How one request on a raw ext_proc stream to the EPP ends: ``OK`` or a gRPC code."""
    served = (Path(stack.options.epp_args[1]) / "tls.crt").read_bytes()
    channel = epp_tls_channel(stack.epp_port, tag, server_pem=served, client=client)
    try:
        async with asyncio.timeout(30):
            call = await non_streamed_exchange(pb_grpc.ExternalProcessorStub(channel))
            call.cancel()
            return "OK"
    except grpc.aio.AioRpcError as error:
        return error.code().name
    finally:
        await channel.close()


async def test_the_gateway_with_its_certificate_is_routed(stack: Stack) -> None:
    async with aiohttp.ClientSession() as session:
        statuses = await asyncio.gather(*(_completion(session, stack.url) for _ in range(20)))
    assert Counter(statuses) == {200: 20}


async def test_a_peer_without_a_trusted_certificate_gets_no_stream(
    stack: Stack, certificates: dict[str, Path]
) -> None:
    assert await _exchange_code(stack, None, "none") == "UNAVAILABLE"
    stranger = certificates["stranger.crt"], certificates["stranger.key"]
    assert await _exchange_code(stack, stranger, "stranger") == "UNAVAILABLE"
    # the same exchange with the gateway's certificate is served
    gateway = certificates["gateway.crt"], certificates["gateway.key"]
    assert await _exchange_code(stack, gateway, "gateway") == "OK"
