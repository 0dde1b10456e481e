"""A gateway whose ext_proc filter sends request bodies otherwise than ours.

The shipped Envoy config sends the request body ``FULL_DUPLEX_STREAMED``, as the reference's
charts do. Gateways configured by hand, or by older guides, use ``BUFFERED``: Envoy then waits
for the reply to the request headers before it sends the body, while the EPP, routing on the
body, waited for the body: every request hung until Envoy's message timeout (1,000 s in the
shipped config). Now a ``BUFFERED`` gateway routes as ours does, and a mode in which the EPP
cannot see the body before the headers go on (``NONE``, ``STREAMED``) gets a 500 naming it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import aiohttp
import orjson
import pytest

from tests.simulator import (
    BODY_SHA256_HEADER,
    DEFAULT_MODEL,
    DESTINATION_SEEN_HEADER,
    INSTANCE_HEADER,
)
from tests.support.stack import Stack, StackOptions

pytestmark = pytest.mark.e2e

CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=15)  # far below Envoy's message timeout


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    options = StackOptions(simulators=2, simulator_base_ip="127.0.0.98", envoy=False)
    with Stack.run(options) as running:
        yield running


def _url(stack: Stack, mode: str) -> str:
    _, port = stack.start_envoy(ext_proc=True, name=f"envoy-{mode.lower()}", request_body_mode=mode)
    return f"http://127.0.0.1:{port}"


def _body(stream: bool) -> bytes:
    payload: dict[str, object] = {
        "model": DEFAULT_MODEL,
        "prompt": "Route me through a buffering gateway",
        "max_tokens": 5,
        "stream": stream,
    }
    return orjson.dumps(payload)


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
async def test_a_buffering_gateway_routes_where_the_epp_chose(stack: Stack, stream: bool) -> None:
    url = _url(stack, "BUFFERED") if not stream else _url(stack, "BUFFERED_PARTIAL")
    body = _body(stream)
    async with (
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session,
        session.post(f"{url}/v1/completions", data=body) as response,
    ):
        text = await response.text()
        # before: no answer at all (the client's timeout)
        assert response.status == 200, text
        instance = response.headers[INSTANCE_HEADER]
        assert response.headers[DESTINATION_SEEN_HEADER] == stack.simulator_addresses[instance]
        assert response.headers["x-went-into-resp-headers"] == "true"
        # the body reached the model server whole, as the client sent it
        assert response.headers[BODY_SHA256_HEADER] == hashlib.sha256(body).hexdigest()
    if stream:
        assert text.rstrip().endswith("data: [DONE]")
    else:
        assert orjson.loads(text)["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("mode", ["NONE", "STREAMED"])
async def test_a_mode_without_the_body_first_is_a_500_naming_it(stack: Stack, mode: str) -> None:
    url = _url(stack, mode)
    async with (
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session,
        session.post(f"{url}/v1/completions", data=_body(False)) as response,
    ):
        text = await response.text()
    # before: no answer at all (the client's timeout)
    assert response.status == 500
    assert f"mode {mode}" in text
    assert "FULL_DUPLEX_STREAMED" in text
    assert INSTANCE_HEADER not in response.headers  # nothing reached a model server
    assert "requests with a body are refused" in (stack.epp.log() if stack.epp else "")
