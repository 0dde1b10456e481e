"""A stream the EPP refuses is opened again by the shipped Envoy config, not a 503.

The EPP refuses an ext_proc stream (RST_STREAM REFUSED_STREAM: the stream reached no
handler) past its ``--max-streams-per-connection``, and Envoy fails as refused the streams
it had queued on a connection when the EPP asks that connection to go (the GOAWAY of
``--workers``' rotation or of a drain). The shipped ``deploy/envoy/envoy.yaml`` retries them
(``retry_policy`` on the ext_proc filter's ``grpc_service``); without it, each such request
was answered 503 (22 of 24 in the case below).

The refusal is made certain here: a fresh Envoy gets 24 requests at once, attaches them all
to its first connection to the EPP as soon as TLS is up (before the EPP's SETTINGS, which
can only follow the handshake, tell it the limit), and the EPP, run with a limit of 2
streams per connection, refuses the other 22.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import orjson
import pytest

from tests.simulator import DEFAULT_MODEL
from tests.support.stack import Stack, StackOptions

pytestmark = pytest.mark.e2e

BURST = 24
LIMIT = 2  # --max-streams-per-connection


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    options = StackOptions(
        simulators=2,
        simulator_base_ip="127.0.0.96",
        epp_args=["--max-streams-per-connection", str(LIMIT), "--tracing=false"],
    )
    with Stack.run(options) as running:
        yield running


async def _burst(url: str, count: int) -> list[int]:
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> int:
            body = {"model": DEFAULT_MODEL, "prompt": f"request {i}", "max_tokens": 2}
            async with session.post(f"{url}/v1/completions", data=orjson.dumps(body)) as reply:
                await reply.read()
                return reply.status

        return list(await asyncio.gather(*(one(i) for i in range(count))))


def test_streams_the_epp_refused_are_retried_and_every_request_is_answered(
    stack: Stack,
) -> None:
    statuses = asyncio.run(_burst(stack.url, BURST))
    epp = stack.envoy_counters("envoy", "cluster.epp.")
    refused = epp.get("cluster.epp.http2.rx_reset", 0)
    # the EPP did refuse streams (else this test proves nothing) ...
    assert refused >= BURST - LIMIT - 2, epp
    # ... and each was opened again: every client got its answer
    assert statuses == [200] * BURST
    assert epp.get("cluster.epp.upstream_rq_retry_success", 0) == refused
    # Stack.run checks at exit that Envoy counted no failed ext_proc stream
