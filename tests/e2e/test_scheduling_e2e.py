"""Scheduling through a real Envoy: load, prefix affinity, fallbacks, P/D disaggregation."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

import aiohttp
import orjson
import pytest

from app.config import REFERENCE_DEFAULT_CONFIG_TEXT
from tests.simulator import (
    DEFAULT_MODEL,
    DESTINATION_SEEN_HEADER,
    INSTANCE_HEADER,
    PREFILLER_SEEN_HEADER,
)
from tests.support.stack import Stack, StackOptions

pytestmark = pytest.mark.e2e

DECISION_HEADER = "x-epp-decision"


def _completion(prompt: str, max_tokens: int = 1) -> bytes:
    return orjson.dumps({"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": max_tokens})


async def _post(session: aiohttp.ClientSession, url: str, body: bytes) -> aiohttp.ClientResponse:
    async with session.post(f"{url}/v1/completions", data=body) as response:
        await response.read()
        assert response.status == 200, await response.text()
        return response


async def _waiting(session: aiohttp.ClientSession, sim_url: str) -> float:
    async with session.get(f"{sim_url}/metrics") as response:
        for line in (await response.text()).splitlines():
            if line.startswith("vllm:num_requests_waiting{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_requests_go_to_the_less_loaded_server() -> None:
    options = StackOptions(
        simulators=2,
        simulator_base_ip="127.0.0.12",
        simulator_args=["--max-num-seqs", "1", "--itl-ms", "200"],
        # the reference's default: load that bypasses the EPP shows only in scraped metrics
        epp_args=["--explain-decisions", "--config-text", REFERENCE_DEFAULT_CONFIG_TEXT],
    )
    with Stack.run(options) as stack:
        busy_name, busy_url = next(iter(stack.simulator_urls.items()))
        async with aiohttp.ClientSession() as session:
            # Load one server directly (not through the EPP): 1 running, 2 waiting.
            hogs = [
                asyncio.create_task(_post(session, busy_url, _completion(f"hog {i}", 60)))
                for i in range(3)
            ]
            try:
                deadline = time.monotonic() + 10
                while await _waiting(session, busy_url) < 2:
                    assert time.monotonic() < deadline, "the busy server never queued"
                # Wait until the EPP's scrape shows it (the decision header names the scores).
                # A probe the EPP sends to the busy server before it knows would wait
                # behind the hogs: give up on such a probe quickly and send another.
                busy = stack.simulator_addresses[busy_name]
                probe_timeout = aiohttp.ClientTimeout(total=1)
                while True:
                    assert time.monotonic() < deadline, "the EPP never saw the load"
                    try:
                        async with session.post(
                            f"{stack.url}/v1/completions",
                            data=_completion("probe"),
                            timeout=probe_timeout,
                        ) as response:
                            decision = response.headers[DECISION_HEADER]
                    except TimeoutError:
                        continue
                    if "queue-scorer=0.00" in _scores_of(decision, busy):
                        break
                served: Counter[str] = Counter()
                for i in range(10):
                    response = await _post(session, stack.url, _completion(f"question {i}"))
                    served[response.headers[INSTANCE_HEADER]] += 1
                assert busy_name not in served, served
                assert sum(served.values()) == 10
            finally:
                for hog in hogs:
                    hog.cancel()
                for hog in hogs:
                    with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                        await hog


def _scores_of(decision: str, endpoint: str) -> str:
    """The ``(scorer=x ...)`` part of ``endpoint`` in an ``x-epp-decision`` header."""
    start = decision.index(f"{endpoint}=")
    return decision[start : decision.index(")", start)]


async def test_the_same_long_prompt_goes_back_to_the_same_server() -> None:
    system = "You are a careful assistant that answers questions about Kubernetes. " * 30
    with Stack.run(StackOptions(simulators=3, simulator_base_ip="127.0.0.22")) as stack:
        async with aiohttp.ClientSession() as session:
            first = await _post(session, stack.url, _completion(system + "What is a pod?"))
            home = first.headers[INSTANCE_HEADER]
            for question in ("What is a node?", "What is a service?", "What is a pod?"):
                response = await _post(session, stack.url, _completion(system + question))
                assert response.headers[INSTANCE_HEADER] == home
            # Prefix-cache hits on that server prove the affinity paid off.
            async with session.get(f"{stack.simulator_urls[home]}/sim/stats") as stats:
                assert (await stats.json())["prefix_cache"]["hits"] > 0


async def test_max_num_of_endpoints_gives_an_ordered_fallback_list() -> None:
    config = """
plugins:
- type: queue-scorer
- type: max-score-picker
  parameters: {maxNumOfEndpoints: 2}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}, {pluginRef: max-score-picker}]
"""
    options = StackOptions(
        simulators=3, simulator_base_ip="127.0.0.32", epp_args=["--config-text", config]
    )
    with Stack.run(options) as stack:
        async with aiohttp.ClientSession() as session:
            for i in range(5):
                response = await _post(session, stack.url, _completion(f"fallbacks {i}"))
                listed = response.headers[DESTINATION_SEEN_HEADER].split(",")
                assert len(listed) == 2
                assert len(set(listed)) == 2
                assert set(listed) <= set(stack.simulator_addresses.values())
                # Envoy sent it to the primary, the first entry.
                served_by = stack.simulator_addresses[response.headers[INSTANCE_HEADER]]
                assert listed[0] == served_by


async def test_pd_disaggregation_names_the_prefill_server() -> None:
    config = """
plugins:
- type: pd-profile-handler
  parameters: {threshold: 50}
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: prefill
  plugins: [{pluginRef: queue-scorer}, {pluginRef: max-score-picker}]
- name: decode
  plugins: [{pluginRef: queue-scorer}, {pluginRef: max-score-picker}]
"""
    options = StackOptions(
        simulators=2, simulator_base_ip="127.0.0.42", epp_args=["--config-text", config]
    )
    with Stack.run(options) as stack:
        addresses = set(stack.simulator_addresses.values())
        async with aiohttp.ClientSession() as session:
            long_prompt = "Summarise the following report. " * 20  # ~160 tokens uncached
            response = await _post(session, stack.url, _completion(long_prompt))
            assert response.headers[PREFILLER_SEEN_HEADER] in addresses
            assert response.headers[DESTINATION_SEEN_HEADER] in addresses
            short = await _post(session, stack.url, _completion("Hi"))  # ~1 token
            assert PREFILLER_SEEN_HEADER not in short.headers
