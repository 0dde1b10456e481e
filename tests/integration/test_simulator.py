"""End-to-end checks of the vLLM-compatible model-server simulator."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.simulator import (
    BODY_SHA256_HEADER,
    DEFAULT_MODEL,
    INSTANCE_HEADER,
    RECEIVED_BYTES_HEADER,
    ModelServerSimulator,
    SimulatorConfig,
    SimulatorFleet,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEADLINE = 10.0

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


# --------------------------------------------------------------------------- helpers


async def eventually(check: Callable[[], Awaitable[bool]], within: float = DEADLINE) -> None:
    """Poll ``check`` until it holds, failing once ``within`` seconds have passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not await check():
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {within}s")
        await asyncio.sleep(0.01)


def generation_body(path: str, model: str = DEFAULT_MODEL, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, **extra}
    if path == CHAT:
        body.setdefault("messages", [{"role": "user", "content": "x" * 400}])
    else:
        body.setdefault("prompt", "x" * 400)
    return body


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(?:,|$)')


def parse_metrics(text: str) -> tuple[dict[str, str], list[Sample]]:
    """Parse Prometheus text exposition line by line; returns (family types, samples)."""
    helps: set[str] = set()
    types: dict[str, str] = {}
    samples: list[Sample] = []
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, help_text = line[len("# HELP ") :].split(" ", 1)
            assert help_text
            helps.add(name)
        elif line.startswith("# TYPE "):
            name, kind = line[len("# TYPE ") :].split(" ")
            assert kind in {"gauge", "counter", "histogram"}
            assert name in helps, f"TYPE before HELP for {name}"
            types[name] = kind
        else:
            match = _SAMPLE.match(line)
            assert match is not None, f"unparsable metrics line: {line!r}"
            raw_labels = match.group("labels") or ""
            pairs = _LABEL.findall(raw_labels)
            assert "".join(f'{k}="{v}",' for k, v in pairs).rstrip(",") == raw_labels
            family = _family_of(match.group("name"), types)
            assert family is not None, f"sample without TYPE: {line!r}"
            samples.append(Sample(match.group("name"), dict(pairs), float(match.group("value"))))
    return types, samples


def _family_of(sample_name: str, types: dict[str, str]) -> str | None:
    if sample_name in types:
        return sample_name
    for suffix in ("_bucket", "_sum", "_count"):
        family = sample_name.removesuffix(suffix)
        if family != sample_name and types.get(family) == "histogram":
            return family
    return None


def only(samples: list[Sample], name: str) -> Sample:
    found = [sample for sample in samples if sample.name == name]
    assert len(found) == 1, f"expected one {name} sample, got {found}"
    return found[0]


async def scrape(session: aiohttp.ClientSession, url: str) -> list[Sample]:
    async with session.get(f"{url}/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        _, samples = parse_metrics(await response.text())
        return samples


def parse_sse(body: str) -> list[str]:
    """Split an SSE body into its ``data:`` payloads, checking the framing."""
    assert body.endswith("\n\n")
    events = body.split("\n\n")
    assert events[-1] == ""
    payloads = []
    for event in events[:-1]:
        assert event.startswith("data: "), f"bad SSE event {event!r}"
        assert "\n" not in event
        payloads.append(event[len("data: ") :])
    return payloads


async def post_status(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> int:
    async with session.post(url, json=body) as response:
        await response.read()
        return response.status


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=DEADLINE)) as client:
        yield client


@pytest.fixture
async def fleet() -> AsyncIterator[SimulatorFleet]:
    async with SimulatorFleet(3, base_ip="127.0.0.2", port=0) as running:
        yield running


# --------------------------------------------------------------------------- tests


async def test_fleet_instances_have_own_addresses_and_names(
    fleet: SimulatorFleet, session: aiohttp.ClientSession
) -> None:
    assert [sim.name for sim in fleet] == ["sim-0", "sim-1", "sim-2"]
    assert [sim.address for sim in fleet] == ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    for sim in fleet:
        assert sim.port > 0
        assert sim.url == f"http://{sim.address}:{sim.port}"
        async with session.get(f"{sim.url}/health") as response:
            assert response.status == 200
            assert response.headers[INSTANCE_HEADER] == sim.name
        async with session.post(
            f"{sim.url}{COMPLETIONS}", json=generation_body(COMPLETIONS)
        ) as response:
            assert response.status == 200
            assert response.headers[INSTANCE_HEADER] == sim.name


async def test_completion_json(fleet: SimulatorFleet, session: aiohttp.ClientSession) -> None:
    body = generation_body(COMPLETIONS, model="my-model", max_tokens=5)
    async with session.post(
        f"{fleet[1].url}{COMPLETIONS}", json=body, headers={"x-request-id": "req-42"}
    ) as response:
        assert response.status == 200
        assert response.headers["x-request-id"] == "req-42"
        payload = await response.json()
    assert payload["object"] == "text_completion"
    assert payload["model"] == "my-model"
    assert "req-42" in payload["id"]
    assert isinstance(payload["created"], int)
    [choice] = payload["choices"]
    assert choice["finish_reason"] == "length"
    assert len(choice["text"].split()) == 5
    assert payload["usage"] == {"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105}


async def test_chat_json_defaults_to_16_tokens(
    fleet: SimulatorFleet, session: aiohttp.ClientSession
) -> None:
    async with session.post(f"{fleet[0].url}{CHAT}", json=generation_body(CHAT)) as response:
        assert response.status == 200
        assert "x-request-id" not in response.headers
        payload = await response.json()
    assert payload["object"] == "chat.completion"
    assert payload["model"] == DEFAULT_MODEL
    [choice] = payload["choices"]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 16
    assert payload["usage"] == {"prompt_tokens": 100, "completion_tokens": 16, "total_tokens": 116}


async def test_generation_is_deterministic(
    fleet: SimulatorFleet, session: aiohttp.ClientSession
) -> None:
    texts = []
    for sim in fleet:
        async with session.post(
            f"{sim.url}{COMPLETIONS}", json=generation_body(COMPLETIONS, max_tokens=7)
        ) as response:
            texts.append((await response.json())["choices"][0]["text"])
    assert len(set(texts)) == 1


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("include_usage", [True, False])
async def test_streaming(
    fleet: SimulatorFleet, session: aiohttp.ClientSession, path: str, include_usage: bool
) -> None:
    body = generation_body(path, model="stream-model", max_tokens=4, stream=True) | {
        "stream_options": {"include_usage": include_usage}
    }
    async with session.post(f"{fleet[2].url}{path}", json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        assert response.headers[INSTANCE_HEADER] == "sim-2"
        text = await response.text()

    payloads = parse_sse(text)
    assert payloads[-1] == "[DONE]"
    assert "[DONE]" not in payloads[:-1]
    chunks = [json.loads(payload) for payload in payloads[:-1]]
    expected_object = "text_completion" if path == COMPLETIONS else "chat.completion.chunk"
    assert {chunk["object"] for chunk in chunks} == {expected_object}
    assert {chunk["model"] for chunk in chunks} == {"stream-model"}
    assert len({chunk["id"] for chunk in chunks}) == 1

    usage_chunks = [chunk for chunk in chunks if "usage" in chunk]
    if include_usage:
        assert usage_chunks == [chunks[-1]]
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"] == {
            "prompt_tokens": 100,
            "completion_tokens": 4,
            "total_tokens": 104,
        }
        content_chunks = chunks[:-1]
    else:
        assert usage_chunks == []
        content_chunks = chunks

    if path == CHAT:
        role_chunk, *content_chunks = content_chunks
        assert role_chunk["choices"][0]["delta"]["role"] == "assistant"
        pieces = [chunk["choices"][0]["delta"]["content"] for chunk in content_chunks]
    else:
        pieces = [chunk["choices"][0]["text"] for chunk in content_chunks]
    assert len(pieces) == 4
    assert all(pieces)
    reasons = [chunk["choices"][0]["finish_reason"] for chunk in content_chunks]
    assert reasons == [None, None, None, "length"]


async def test_stream_without_stream_options_has_no_usage(
    fleet: SimulatorFleet, session: aiohttp.ClientSession
) -> None:
    body = generation_body(COMPLETIONS, max_tokens=2, stream=True)
    async with session.post(f"{fleet[0].url}{COMPLETIONS}", json=body) as response:
        payloads = parse_sse(await response.text())
    assert len(payloads) == 3
    assert payloads[-1] == "[DONE]"
    assert all("usage" not in json.loads(payload) for payload in payloads[:-1])


async def test_streaming_paces_chunks_by_ttft_and_itl(session: aiohttp.ClientSession) -> None:
    ttft, itl = 0.05, 0.05
    config = SimulatorConfig(prefill_overhead=ttft, itl=itl)
    async with ModelServerSimulator(config, host="127.0.0.2", port=0) as sim:
        loop = asyncio.get_running_loop()
        arrivals: list[float] = []
        body = generation_body(COMPLETIONS, max_tokens=4, stream=True)
        sent = loop.time()
        async with session.post(f"{sim.url}{COMPLETIONS}", json=body) as response:
            async for line in response.content:
                if line.startswith(b"data: {"):
                    arrivals.append(loop.time() - sent)
    assert len(arrivals) == 4
    # lower bounds only: the server cannot send a chunk before its delay has elapsed
    slack = 0.9
    assert arrivals[0] >= ttft * slack, arrivals
    assert arrivals[-1] >= (ttft + 3 * itl) * slack, arrivals


async def test_metrics_exposition(fleet: SimulatorFleet, session: aiohttp.ClientSession) -> None:
    url = fleet[0].url
    for _ in range(2):
        assert (
            await post_status(session, f"{url}{COMPLETIONS}", generation_body(COMPLETIONS)) == 200
        )

    async with session.get(f"{url}/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert response.headers[INSTANCE_HEADER] == "sim-0"
        types, samples = parse_metrics(await response.text())

    assert types == {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:lora_requests_info": "gauge",
        "vllm:cache_config_info": "gauge",
        "vllm:prefix_cache_queries_total": "counter",
        "vllm:prefix_cache_hits_total": "counter",
        "vllm:num_preemptions_total": "counter",
        "vllm:prompt_tokens_total": "counter",
        "vllm:generation_tokens_total": "counter",
        "vllm:request_success_total": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
    }
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        sample = only(samples, name)
        assert sample.labels["model_name"] == DEFAULT_MODEL
        assert sample.value == 0.0
    kv = only(samples, "vllm:kv_cache_usage_perc")
    assert kv.labels["model_name"] == DEFAULT_MODEL
    assert kv.value == 0.0

    lora = only(samples, "vllm:lora_requests_info")
    assert lora.labels == {
        "max_lora": "1",
        "running_lora_adapters": "",
        "waiting_lora_adapters": "",
    }
    assert lora.value > 1.6e9  # a unix timestamp

    cache = only(samples, "vllm:cache_config_info")
    assert cache.value == 1.0
    assert cache.labels["block_size"] == "16"
    assert cache.labels["num_gpu_blocks"] == str(SimulatorConfig().num_gpu_blocks)

    assert only(samples, "vllm:prompt_tokens_total").value == 200.0
    assert only(samples, "vllm:generation_tokens_total").value == 32.0
    # the same 100-token prompt twice: the second finds its 6 full blocks cached
    assert only(samples, "vllm:prefix_cache_queries_total").value == 200.0
    assert only(samples, "vllm:prefix_cache_hits_total").value == 96.0
    ttft_count = only(samples, "vllm:time_to_first_token_seconds_count")
    assert ttft_count.labels == {"engine": "0", "model_name": DEFAULT_MODEL}
    assert ttft_count.value == 2.0
    buckets = [s for s in samples if s.name == "vllm:time_to_first_token_seconds_bucket"]
    assert buckets[-1].labels["le"] == "+Inf"
    assert buckets[-1].value == 2.0
    assert [b.value for b in buckets] == sorted(b.value for b in buckets)
    successes = {
        sample.labels["finished_reason"]: sample.value
        for sample in samples
        if sample.name == "vllm:request_success_total"
    }
    assert successes["length"] == 2.0
    assert sum(successes.values()) == 2.0

    # the other instances have their own counters
    assert only(await scrape(session, fleet[1].url), "vllm:prompt_tokens_total").value == 0.0
    in_process = fleet.stats()
    assert list(in_process) == ["sim-0", "sim-1", "sim-2"]
    assert in_process["sim-0"].prompt_tokens_total == 200
    assert in_process["sim-0"].prefix_cache_hits_total == 96
    assert in_process["sim-1"].prompt_tokens_total == 0


async def test_metrics_track_running_waiting_kv_and_lora(session: aiohttp.ClientSession) -> None:
    config = SimulatorConfig(
        max_num_seqs=1,
        prefill_overhead=60.0,
        lora_adapters=("sql-lora", "tweet-lora"),
        max_loras=2,
        block_size=16,
        num_gpu_blocks=100,
    )
    sim = ModelServerSimulator(config, name="busy", host="127.0.0.3", port=0)
    await sim.start()
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[int]] = []
    try:
        url = f"{sim.url}{COMPLETIONS}"
        # 400 prompt tokens for the running request
        first = generation_body(COMPLETIONS, model="sql-lora", prompt="y" * 1600)
        tasks.append(asyncio.create_task(post_status(session, url, first)))

        async def one_running() -> bool:
            samples = await scrape(session, sim.url)
            return only(samples, "vllm:num_requests_running").value == 1.0

        await eventually(one_running)
        for model in ("tweet-lora", DEFAULT_MODEL):
            body = generation_body(COMPLETIONS, model=model)
            tasks.append(asyncio.create_task(post_status(session, url, body)))

        async def one_running_two_waiting() -> bool:
            samples = await scrape(session, sim.url)
            return (
                only(samples, "vllm:num_requests_running").value == 1.0
                and only(samples, "vllm:num_requests_waiting").value == 2.0
            )

        await eventually(one_running_two_waiting)
        samples = await scrape(session, sim.url)
        assert only(samples, "vllm:kv_cache_usage_perc").value == pytest.approx(400 / 1600)
        lora = only(samples, "vllm:lora_requests_info")
        assert lora.labels == {
            "max_lora": "2",
            "running_lora_adapters": "sql-lora",
            "waiting_lora_adapters": "tweet-lora",
        }
        assert not any(task.done() for task in tasks)
    finally:
        started = loop.time()
        await sim.stop()
        stop_duration = loop.time() - started
        outcomes = await asyncio.wait_for(
            asyncio.gather(*tasks, return_exceptions=True), timeout=DEADLINE
        )
    assert stop_duration < 3.0
    # the held requests were cut off by the shutdown rather than answered
    assert all(isinstance(outcome, aiohttp.ClientError) for outcome in outcomes), outcomes


async def test_waiting_requests_complete_in_order(session: aiohttp.ClientSession) -> None:
    config = SimulatorConfig(max_num_seqs=1, itl=0.01)
    async with ModelServerSimulator(config, host="127.0.0.4", port=0) as sim:
        url = f"{sim.url}{COMPLETIONS}"
        statuses = await asyncio.gather(
            *(
                post_status(session, url, generation_body(COMPLETIONS, max_tokens=3))
                for _ in range(4)
            )
        )
        assert statuses == [200] * 4
        samples = await scrape(session, sim.url)
        assert only(samples, "vllm:num_requests_running").value == 0.0
        assert only(samples, "vllm:num_requests_waiting").value == 0.0
        assert only(samples, "vllm:kv_cache_usage_perc").value == 0.0
        assert only(samples, "vllm:generation_tokens_total").value == 12.0


@pytest.mark.parametrize(
    ("path", "raw_body"),
    [
        (COMPLETIONS, b"{not json"),
        (CHAT, b"{not json"),
        (COMPLETIONS, b'{"prompt": "hello"}'),
        (CHAT, b'{"messages": [{"role": "user", "content": "hi"}]}'),
        (COMPLETIONS, b'["model", "prompt"]'),
        (COMPLETIONS, b'{"model": "m", "prompt": "hi", "max_tokens": 0}'),
        (CHAT, b'{"model": "m", "messages": []}'),
    ],
)
async def test_bad_request_body_is_400(
    fleet: SimulatorFleet, session: aiohttp.ClientSession, path: str, raw_body: bytes
) -> None:
    async with session.post(
        f"{fleet[0].url}{path}", data=raw_body, headers={"Content-Type": "application/json"}
    ) as response:
        assert response.status == 400
        assert response.headers[INSTANCE_HEADER] == "sim-0"
        payload = await response.json()
    error = payload["error"]
    assert error["code"] == 400
    assert error["type"] == "BadRequestError"
    assert isinstance(error["message"], str)
    assert error["message"]


async def test_large_prompt_arrives_intact(
    fleet: SimulatorFleet, session: aiohttp.ClientSession
) -> None:
    prompt = "".join(chr(ord("a") + index % 26) for index in range(1_000_000))
    raw = json.dumps({"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": 1}).encode()
    async with session.post(
        f"{fleet[2].url}{COMPLETIONS}", data=raw, headers={"Content-Type": "application/json"}
    ) as response:
        assert response.status == 200
        assert response.headers[RECEIVED_BYTES_HEADER] == str(len(raw))
        assert response.headers[BODY_SHA256_HEADER] == hashlib.sha256(raw).hexdigest()
        payload = await response.json()
    assert payload["usage"]["prompt_tokens"] == 250_000


async def test_models_lists_served_models_and_adapters(session: aiohttp.ClientSession) -> None:
    config = SimulatorConfig(served_model_names=("base", "base-alias"), lora_adapters=("ad",))
    async with (
        ModelServerSimulator(config, host="127.0.0.2", port=0) as sim,
        session.get(f"{sim.url}/v1/models") as response,
    ):
        assert response.status == 200
        payload = await response.json()
    assert payload["object"] == "list"
    assert [card["id"] for card in payload["data"]] == ["base", "base-alias", "ad"]
    assert payload["data"][2]["parent"] == "base"


def test_config_rejects_invalid_values() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        SimulatorConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="prefill_overhead"):
        SimulatorConfig(prefill_overhead=-1.0)
    with pytest.raises(ValueError, match="time_scale"):
        SimulatorConfig(time_scale=float("nan"))
    with pytest.raises(ValueError, match="max_model_len"):
        SimulatorConfig(num_gpu_blocks=4, block_size=16, max_model_len=65)
    with pytest.raises(ValueError, match="served_model_names"):
        SimulatorConfig(served_model_names=())


async def test_command_line_mode(session: aiohttp.ClientSession) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.simulator",
        "--instances",
        "2",
        "--base-ip",
        "127.0.0.5",
        "--port",
        "0",
        cwd=REPO_ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        ready: dict[str, str] = {}
        for _ in range(2):
            line = await asyncio.wait_for(process.stdout.readline(), timeout=DEADLINE)
            match = re.fullmatch(rb"ready (\S+) (http://127\.0\.0\.[56]:\d+)\n", line)
            assert match is not None, line
            ready[match.group(1).decode()] = match.group(2).decode()
        assert sorted(ready) == ["sim-0", "sim-1"]
        assert ready["sim-0"].startswith("http://127.0.0.5:")
        assert ready["sim-1"].startswith("http://127.0.0.6:")

        for name, url in ready.items():
            async with session.post(
                f"{url}{CHAT}", json=generation_body(CHAT, max_tokens=2)
            ) as response:
                assert response.status == 200
                assert response.headers[INSTANCE_HEADER] == name

        process.send_signal(signal.SIGTERM)
        returncode = await asyncio.wait_for(process.wait(), timeout=DEADLINE)
        assert returncode == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
