"""Precise prefix-cache routing through a real Envoy: the servers' KV-cache events decide.

Three simulators tokenize with a tokenizer the test makes, hash blocks as vLLM does and
publish KV-cache events on ZMQ; the EPP runs ``precise-prefix-cache-producer`` (speculative
entries off, so only events count) feeding ``prefix-cache-scorer``.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import aiohttp
import orjson
import pytest

from tests.simulator import DEFAULT_MODEL, INSTANCE_HEADER
from tests.support.stack import Stack, StackOptions, free_port
from tests.support.tokenizer import write_tokenizer_json

pytestmark = pytest.mark.e2e

DECISION_HEADER = "x-epp-decision"
BASE_IP = "127.0.0.52"
SEED = "7"
SYSTEM = (
    "You are a helpful assistant. Summarize the following document about prefix caching "
    "and KV-cache events: routing decisions depend on which server holds the blocks. "
) * 3


def _config(tokenizer: Path, port: int, *, speculative_ttl: str = "0s") -> str:
    return f"""
plugins:
- type: precise-prefix-cache-producer
  parameters:
    tokenProcessorConfig: {{blockSizeTokens: 16, hashSeed: "{SEED}", tokenizerPath: "{tokenizer}"}}
    kvEventsConfig: {{socketPort: {port}, replayPort: {port + 1}}}
    speculativeTtl: {speculative_ttl}
- type: prefix-cache-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins: [{{pluginRef: prefix-cache-scorer}}, {{pluginRef: max-score-picker}}]
"""


async def _post(
    session: aiohttp.ClientSession, url: str, prompt: str, *, chat: bool = False
) -> tuple[str, str]:
    if chat:
        messages = [{"role": "system", "content": prompt}, {"role": "user", "content": "Go."}]
        body = orjson.dumps({"model": DEFAULT_MODEL, "messages": messages, "max_tokens": 1})
    else:
        body = orjson.dumps({"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": 1})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with session.post(f"{url}{path}", data=body) as response:
        assert response.status == 200, await response.text()
        return response.headers[INSTANCE_HEADER], response.headers.get(DECISION_HEADER, "")


def _prefix_score(decision: str, endpoint: str) -> float:
    match = re.search(re.escape(endpoint) + r"=[^(]*\([^)]*prefix-cache-scorer=([0-9.]+)", decision)
    assert match is not None, decision
    return float(match.group(1))


async def _unkeyed(session: aiohttp.ClientSession, url: str) -> float:
    """Requests the producer could not key (matched on the approximate path instead)."""
    async with session.get(url) as response:
        text = await response.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("inference_extension_precise_prefix_unkeyed_total{")
    )


async def _removed(session: aiohttp.ClientSession, url: str) -> float:
    """BlockRemoved events the EPP received, over all endpoints."""
    async with session.get(url) as response:
        text = await response.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("inference_extension_kv_events_total{") and "BlockRemoved" in line
    )


async def test_repeated_prefix_goes_to_its_holder_until_evicted(tmp_path: Path) -> None:
    tokenizer = write_tokenizer_json(tmp_path / "tokenizer.json")
    port = free_port(BASE_IP)
    options = StackOptions(
        simulators=3,
        simulator_base_ip=BASE_IP,
        simulator_args=[
            "--kv-events-port", str(port),
            "--tokenizer", str(tokenizer),
            "--hash-seed", SEED,
            "--block-size", "16",
            "--num-gpu-blocks", "48",
        ],
        epp_args=["--config-text", _config(tokenizer, port), "--explain-decisions"],
    )  # fmt: skip
    with Stack.run(options) as stack:
        async with aiohttp.ClientSession() as session:
            # Until the EPP's subscribers are connected, events can be missed: repeat the
            # prompt until a request goes where the events say the prefix is, in full.
            deadline = time.monotonic() + 30
            while True:
                assert time.monotonic() < deadline, "the EPP never learned where the prefix is"
                served, decision = await _post(session, stack.url, SYSTEM)
                address = stack.simulator_addresses[served]
                if _prefix_score(decision, address) == 1.0:
                    break
            home = served
            # every repeat goes to a server holding the whole prefix (two may hold it, when
            # requests went to both before the EPP's subscribers were connected)
            for _ in range(5):
                served, decision = await _post(session, stack.url, SYSTEM)
                assert _prefix_score(decision, stack.simulator_addresses[served]) == 1.0

            # A chat request is keyed through the model's chat template, as the server
            # renders it: once served, its server holds all of its blocks.
            chat_prompt = "Answer in one short paragraph. " + SYSTEM
            deadline = time.monotonic() + 10
            while True:
                served, decision = await _post(session, stack.url, chat_prompt, chat=True)
                if _prefix_score(decision, stack.simulator_addresses[served]) == 1.0:
                    break
                assert time.monotonic() < deadline, "the chat request's blocks never matched"
            assert await _unkeyed(session, stack.epp_metrics_url) == 0  # not the fallback

            # Evict it on its server: other long prompts sent to that server directly.
            before = await _removed(session, stack.epp_metrics_url)
            for i in range(4):
                other = " ".join(f"filler{i} document number {j} about caching" for j in range(30))
                async with session.post(
                    f"{stack.simulator_urls[home]}/v1/completions",
                    json={"model": DEFAULT_MODEL, "prompt": other, "max_tokens": 1},
                ) as response:
                    assert response.status == 200
            async with session.get(f"{stack.simulator_urls[home]}/sim/stats") as stats:
                assert (await stats.json())["kv_cache"]["evictions"] > 0
            deadline = time.monotonic() + 10
            while await _removed(session, stack.epp_metrics_url) <= before:
                assert time.monotonic() < deadline, "the EPP never saw the evictions"
            # The EPP no longer credits that server with the prefix.
            deadline = time.monotonic() + 10
            while True:
                _, decision = await _post(session, stack.url, SYSTEM)
                if _prefix_score(decision, stack.simulator_addresses[home]) < 1.0:
                    break
                assert time.monotonic() < deadline, "the evicted prefix is still trusted"
