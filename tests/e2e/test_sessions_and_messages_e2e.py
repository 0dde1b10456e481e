"""Through a real Envoy: session affinity's token returned and honoured, and the Anthropic
Messages API (routed by anthropic-parser, its token usage counted)."""

from __future__ import annotations

import asyncio
import base64
import time
from collections import Counter

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.simulator import DEFAULT_MODEL, INSTANCE_HEADER
from tests.support.stack import Stack, StackOptions

pytestmark = pytest.mark.e2e

TOKEN_HEADER = "x-session-token"

# random-picker: without the filter's pin, requests land anywhere.
SESSION_CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: session-affinity-filter
- type: random-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: session-affinity-filter
  - pluginRef: random-picker
"""


async def _ask(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None
) -> tuple[str, str | None]:
    body = orjson.dumps({"model": DEFAULT_MODEL, "prompt": "hello", "max_tokens": 1})
    async with session.post(f"{url}/v1/completions", data=body, headers=headers) as response:
        await response.read()
        assert response.status == 200, await response.text()
        return response.headers[INSTANCE_HEADER], response.headers.get(TOKEN_HEADER)


async def test_session_token_is_returned_and_honoured() -> None:
    options = StackOptions(
        simulators=3,
        simulator_base_ip="127.0.0.31",
        epp_args=["--config-text", SESSION_CONFIG],
    )
    with Stack.run(options) as stack:
        address_of = stack.simulator_addresses
        async with aiohttp.ClientSession() as session:
            first, token = await _ask(session, stack.url)
            assert token is not None
            assert base64.b64decode(token).decode() == f"/{address_of[first]}"

            pinned = Counter(
                [(await _ask(session, stack.url, {TOKEN_HEADER: token}))[0] for _ in range(12)]
            )
            assert pinned == Counter({first: 12})

            # Without the token the picker is random: it spreads.
            spread = Counter([(await _ask(session, stack.url))[0] for _ in range(30)])
            assert len(spread) > 1

            # Garbage and foreign tokens are ignored, never an error; a fresh token comes back.
            foreign = base64.b64encode(b"other-pool/127.0.0.99:8000").decode()
            for bad in ("%%% not base64 %%%", foreign, "A" * 2000):
                served, fresh = await _ask(session, stack.url, {TOKEN_HEADER: bad})
                assert fresh == base64.b64encode(f"/{address_of[served]}".encode()).decode()


def _input_tokens(text: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "inference_objective_input_tokens_sum":
                total += sample.value
    return total


async def test_anthropic_messages_are_routed_and_their_usage_counted() -> None:
    options = StackOptions(simulators=2, simulator_base_ip="127.0.0.41")
    with Stack.run(options) as stack:
        body = orjson.dumps(
            {
                "model": DEFAULT_MODEL,
                "max_tokens": 3,
                "system": "You are terse.",
                "messages": [{"role": "user", "content": "Say hello " * 20}],
            }
        )
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{stack.url}/v1/messages", data=body) as response:
                payload = orjson.loads(await response.read())
                assert response.status == 200, payload
            assert payload["type"] == "message"
            assert payload["usage"]["output_tokens"] == 3
            prompt = payload["usage"]["input_tokens"] + payload["usage"]["cache_read_input_tokens"]

            # A Messages body the parser refuses is a 400 for that request only.
            bad = orjson.dumps({"model": DEFAULT_MODEL, "messages": []})
            async with session.post(f"{stack.url}/v1/messages", data=bad) as response:
                assert response.status == 400

            deadline = time.monotonic() + 10
            while True:
                async with session.get(stack.epp_metrics_url) as metrics:
                    if _input_tokens(await metrics.text()) == prompt:
                        break
                assert time.monotonic() < deadline, "input tokens never counted"
                await asyncio.sleep(0.05)
