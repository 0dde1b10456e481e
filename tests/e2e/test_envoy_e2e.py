"""Through a real Envoy (the shipped config) to the EPP and three simulated model servers,
once per ext_proc transport (``--extproc-transport``)."""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter
from collections.abc import Iterator

import aiohttp
import orjson
import pytest

from adapters.envoy.server import TRANSPORTS
from tests.simulator import (
    BODY_SHA256_HEADER,
    DEFAULT_MODEL,
    DESTINATION_SEEN_HEADER,
    INSTANCE_HEADER,
)
from tests.support.stack import Stack, StackOptions

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=TRANSPORTS)
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    options = StackOptions(
        simulators=3,
        simulator_base_ip="127.0.0.2",
        epp_args=[f"--extproc-transport={request.param}"],
    )
    with Stack.run(options) as running:
        yield running


def _body(api: str, stream: bool, prompt: str = "Say hello to the cluster") -> bytes:
    payload: dict[str, object] = {"model": DEFAULT_MODEL, "max_tokens": 5, "stream": stream}
    if api == "chat/completions":
        payload["messages"] = [{"role": "user", "content": prompt}]
    else:
        payload["prompt"] = prompt
    if stream:
        payload["stream_options"] = {"include_usage": True}
    return orjson.dumps(payload)


@pytest.mark.parametrize("api", ["completions", "chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
async def test_request_lands_on_the_instance_the_epp_chose(
    stack: Stack, api: str, stream: bool
) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{stack.url}/v1/{api}", data=_body(api, stream)) as response,
    ):
        text = await response.text()
        assert response.status == 200, text
        instance = response.headers[INSTANCE_HEADER]
        # The EPP's choice, as the model server received it from Envoy:
        chosen = response.headers[DESTINATION_SEEN_HEADER]
        assert chosen == stack.simulator_addresses[instance]
        assert response.headers["x-went-into-resp-headers"] == "true"
    if stream:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        chunks = [orjson.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert all(c["model"] == DEFAULT_MODEL for c in chunks)
        assert chunks[-1]["usage"]["completion_tokens"] == 5
    else:
        payload = orjson.loads(text)
        assert payload["model"] == DEFAULT_MODEL
        assert payload["usage"]["completion_tokens"] == 5


async def test_requests_are_spread_over_the_instances(stack: Stack) -> None:
    seen: Counter[str] = Counter()
    async with aiohttp.ClientSession() as session:
        for _ in range(30):
            async with session.post(
                f"{stack.url}/v1/completions", data=_body("completions", False)
            ) as response:
                assert response.status == 200
                seen[response.headers[INSTANCE_HEADER]] += 1
    assert set(seen) <= set(stack.simulator_addresses)
    assert len(seen) >= 2, seen


async def test_a_one_megabyte_prompt_arrives_intact(stack: Stack) -> None:
    prompt = "".join(f"{i:07d} " for i in range(131_072))  # 1 MiB of text
    body = _body("completions", False, prompt)
    assert len(body) > 1_000_000
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{stack.url}/v1/completions", data=body) as response,
    ):
        assert response.status == 200, await response.text()
        assert response.headers[BODY_SHA256_HEADER] == hashlib.sha256(body).hexdigest()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "inference error: BadRequest - "),
        (
            b'{"prompt": "no model"}',
            "inference error: BadRequest - model not found in request body",
        ),
        (b'{"model": "m", "prompt": ""}', "inference error: BadRequest - "),
    ],
)
async def test_an_invalid_body_gets_400_and_nothing_else_breaks(
    stack: Stack, body: bytes, message: str
) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{stack.url}/v1/completions", data=body) as response:
            assert response.status == 400
            assert (await response.text()).startswith(message)
            assert INSTANCE_HEADER not in response.headers
        async with session.post(
            f"{stack.url}/v1/completions", data=_body("completions", False)
        ) as response:
            assert response.status == 200


async def test_a_request_without_body_is_routed(stack: Stack) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{stack.url}/v1/models") as response,
    ):
        assert response.status == 200
        listed = [m["id"] for m in (await response.json())["data"]]
        assert DEFAULT_MODEL in listed
        assert response.headers[INSTANCE_HEADER] in stack.simulator_addresses


async def test_two_hundred_concurrent_requests_all_succeed(stack: Stack) -> None:
    connector = aiohttp.TCPConnector(limit=200)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(i: int) -> tuple[int, str]:
            api = "chat/completions" if i % 2 else "completions"
            async with session.post(
                f"{stack.url}/v1/{api}", data=_body(api, i % 3 == 0, f"request {i}")
            ) as response:
                await response.read()
                return response.status, response.headers.get(INSTANCE_HEADER, "")

        results = await asyncio.gather(*(one(i) for i in range(200)))
    statuses = Counter(status for status, _ in results)
    assert statuses == {200: 200}
    assert {instance for _, instance in results} == set(stack.simulator_addresses)
