"""A gateway whose ext_proc filter sends request or response bodies otherwise than ours.

The shipped Envoy config sends both bodies ``FULL_DUPLEX_STREAMED``, as the reference's
charts do. Gateways configured by hand, or by older guides, use other modes, and before
2026-11-29 the EPP served none of them:

- request bodies ``BUFFERED``: Envoy waits for the reply to the request headers before it
  sends the body, while the EPP, routing on the body, waited for the body: every request
  hung until Envoy's message timeout (1,000 s in the shipped config). Now it routes as ours
  does; a mode in which the EPP cannot see the body before the headers go on (``NONE``,
  ``STREAMED``) gets a 500 naming it;
- response bodies ``BUFFERED`` or ``STREAMED``: Envoy wants one plain body reply per message
  and got a full-duplex streamed one: a non-streamed response answered 503 (``BUFFERED``), a
  streamed one cut off (``STREAMED``). Now every response comes whole, its token usage is
  read and the request ends in the EPP's metrics.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping

import aiohttp
import orjson
import pytest

from tests.simulator import (
    BODY_SHA256_HEADER,
    DEFAULT_MODEL,
    DESTINATION_SEEN_HEADER,
    INSTANCE_HEADER,
)
from tests.support.stack import Stack, StackOptions, metric_sum, wait_for

pytestmark = pytest.mark.e2e

CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=15)  # far below Envoy's message timeout


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    options = StackOptions(simulators=2, simulator_base_ip="127.0.0.98", envoy=False)
    with Stack.run(options) as running:
        yield running


def _url(stack: Stack, mode: str, direction: str = "request") -> str:
    modes = {
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "response_body_mode": "FULL_DUPLEX_STREAMED",
    }
    modes[f"{direction}_body_mode"] = mode
    _, port = stack.start_envoy(
        ext_proc=True,
        name=f"envoy-{direction}-{mode.lower()}",
        request_body_mode=modes["request_body_mode"],
        response_body_mode=modes["response_body_mode"],
    )
    return f"http://127.0.0.1:{port}"


def _body(stream: bool) -> bytes:
    payload: dict[str, object] = {
        "model": DEFAULT_MODEL,
        "prompt": "Route me through a buffering gateway",
        "max_tokens": 5,
        "stream": stream,
    }
    return orjson.dumps(payload)


async def _post(url: str, body: bytes) -> tuple[int, Mapping[str, str], str]:
    """Status, headers and text of a completion sent through ``url``'s Envoy."""
    async with (
        aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as session,
        session.post(f"{url}/v1/completions", data=body) as response,
    ):
        return response.status, dict(response.headers), await response.text()


def _whole(text: str, *, stream: bool) -> None:
    """The client got the whole completion of 5 tokens."""
    if stream:
        events = [line for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert len(events) == 5 + 1  # one per token, then [DONE]
    else:
        assert orjson.loads(text)["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
async def test_a_buffering_gateway_routes_where_the_epp_chose(stack: Stack, stream: bool) -> None:
    url = _url(stack, "BUFFERED") if not stream else _url(stack, "BUFFERED_PARTIAL")
    body = _body(stream)
    status, headers, text = await _post(url, body)
    # before: no answer at all (the client's timeout)
    assert status == 200, text
    instance = headers[INSTANCE_HEADER]
    assert headers[DESTINATION_SEEN_HEADER] == stack.simulator_addresses[instance]
    assert headers["x-went-into-resp-headers"] == "true"
    # the body reached the model server whole, as the client sent it
    assert headers[BODY_SHA256_HEADER] == hashlib.sha256(body).hexdigest()
    _whole(text, stream=stream)


@pytest.mark.parametrize("mode", ["NONE", "STREAMED"])
async def test_a_mode_without_the_body_first_is_a_500_naming_it(stack: Stack, mode: str) -> None:
    status, headers, text = await _post(_url(stack, mode), _body(False))
    # before: no answer at all (the client's timeout)
    assert status == 500
    assert f"mode {mode}" in text
    assert "FULL_DUPLEX_STREAMED" in text
    assert INSTANCE_HEADER not in headers  # nothing reached a model server
    assert "requests with a body are refused" in (stack.epp.log() if stack.epp else "")


RUNNING = "inference_objective_running_requests"
COMPLETED = "inference_objective_request_duration_seconds_count"
INPUT_TOKENS = "inference_objective_input_tokens_count"


def _metrics(stack: Stack) -> dict[str, float]:
    return {
        name: metric_sum(stack.epp_metrics_url, name) for name in (RUNNING, COMPLETED, INPUT_TOKENS)
    }


@pytest.mark.parametrize("mode", ["BUFFERED", "STREAMED", "BUFFERED_PARTIAL"])
@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
async def test_a_gateway_sending_response_bodies_otherwise_gets_them_whole(
    stack: Stack, mode: str, stream: bool
) -> None:
    url = _url(stack, mode, "response")
    before = _metrics(stack)
    status, _, text = await _post(url, _body(stream))
    # before: 503 (BUFFERED, non-streamed), or a response cut off (STREAMED, streamed)
    assert status == 200, text
    _whole(text, stream=stream)

    def ended() -> dict[str, float] | None:
        now = _metrics(stack)
        return now if now[RUNNING] == 0 and now[COMPLETED] > before[COMPLETED] else None

    after = wait_for(ended, timeout=10, what="the request to end in the EPP's metrics")
    # the EPP read the response: the request completed and its token usage was counted
    assert after[COMPLETED] == before[COMPLETED] + 1
    if not stream:
        assert after[INPUT_TOKENS] == before[INPUT_TOKENS] + 1
