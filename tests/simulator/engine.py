"""Simulated inference engine: scheduling, timing, deterministic output and records.

Each request runs as its own coroutine (:meth:`SimulatedEngine.generate`): it waits to be
admitted, spends its prefill time, yields its first token, then spends one inter-token
latency per further token, growing its KV blocks as it goes (see
:mod:`tests.simulator.scheduler` for admission and preemption, and
:class:`~tests.simulator.config.SimulatorConfig` for the timing formulas).

Every duration is simulated and waited for as ``duration * time_scale`` real seconds.
Records (TTFT, inter-token latency, end-to-end latency, queue time) are kept in
simulated seconds: compute steps count their nominal duration, and time spent waiting
in the queue counts its real duration divided by ``time_scale`` (zero when it is 0). An
unloaded request therefore records exactly its formula TTFT, whatever the time scale.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Iterable
from pathlib import Path
from typing import Any

from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from adapters.xxhash import xxh3_128
from domain.prefixcache.engine_hash import EngineBlockHasher
from tests.simulator.config import SimulatorConfig
from tests.simulator.kvcache import KVCache, block_hashes
from tests.simulator.scheduler import Phase, RequestState, Scheduler
from tests.simulator.stats import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    EngineStats,
    Histogram,
)
from tests.simulator.tokens import ChatInput, PromptTokens

FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")
"""Finish reasons counted by ``vllm:request_success_total``."""

_FILLER_WORDS: tuple[str, ...] = (
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "again",
    "and",
    "again",
)


def filler_token(index: int) -> str:
    """Text of generated token number ``index`` (deterministic)."""
    word = _FILLER_WORDS[index % len(_FILLER_WORDS)]
    return word if index == 0 else f" {word}"


def filler_text(num_tokens: int) -> str:
    """The full text the engine generates for ``num_tokens`` tokens."""
    return "".join(filler_token(index) for index in range(num_tokens))


def _distinct_adapters(states: Iterable[RequestState]) -> tuple[str, ...]:
    adapters = (state.lora_adapter for state in states if state.lora_adapter is not None)
    return tuple(dict.fromkeys(adapters))


def _chat_template(tokenizer_path: str) -> tuple[Template, dict[str, Any]] | None:
    """The ``chat_template`` of the ``tokenizer_config.json`` beside the tokenizer, and its
    special tokens; ``None`` without one."""
    config_file = Path(tokenizer_path).with_name("tokenizer_config.json")
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    source = config.get("chat_template")
    if not isinstance(source, str):
        return None
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    special = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
    return env.from_string(source), special


def _render(template: tuple[Template, dict[str, Any]], chat: ChatInput) -> str:
    """The prompt text of a chat request, as vLLM renders it for string-content templates."""
    compiled, special = template
    messages = [{**message, "content": _text(message.get("content"))} for message in chat.messages]
    return compiled.render(
        {
            **special,
            **chat.kwargs,
            "messages": messages,
            "add_generation_prompt": chat.add_generation_prompt,
        }
    )


def _text(content: object) -> str:
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content if part.get("type") == "text")
    return content if isinstance(content, str) else ""


def _resolve(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)


class _Clock:
    """Simulated time of one request since it arrived, plus its last token's time."""

    __slots__ = ("elapsed", "last_token")

    def __init__(self) -> None:
        self.elapsed = 0.0
        self.last_token = 0.0


class SimulatedEngine:
    """Runs requests through the scheduler and produces their tokens over time."""

    def __init__(self, config: SimulatorConfig) -> None:
        self._config = config
        self._scheduler = Scheduler(
            max_num_seqs=config.max_num_seqs,
            max_loras=config.max_loras,
            kv_cache=KVCache(config.num_gpu_blocks, config.block_size),
        )
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._finished: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self._ttft = Histogram(TTFT_BUCKETS, keep_samples=True)
        self._itl = Histogram(ITL_BUCKETS)
        self._e2e = Histogram(REQUEST_LATENCY_BUCKETS, keep_samples=True)
        self._queue_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self._tokenizer: Tokenizer | None = None
        self._hasher: EngineBlockHasher | None = None
        self._chat_template: tuple[Template, dict[str, Any]] | None = None
        if config.tokenizer_path is not None:
            self._tokenizer = Tokenizer.from_file(config.tokenizer_path)
            self._chat_template = _chat_template(config.tokenizer_path)
            self._hasher = EngineBlockHasher(
                algorithm=config.prefix_caching_hash_algo, seed=config.hash_seed, xxh3_128=xxh3_128
            )

    @property
    def config(self) -> SimulatorConfig:
        return self._config

    @property
    def scheduler(self) -> Scheduler:
        return self._scheduler

    def new_request(
        self, request_id: str, model: str, prompt: PromptTokens, max_tokens: int
    ) -> RequestState:
        """Describe a request; ``model`` naming a configured LoRA adapter runs it on that.

        Raises ``ValueError`` when prompt + ``max_tokens`` exceeds the model length.
        """
        config = self._config
        if self._tokenizer is not None and prompt.ids is None:
            if prompt.chat is not None and self._chat_template is not None:
                # vLLM: the rendered template, tokenized without adding special tokens
                text = _render(self._chat_template, prompt.chat)
                ids = tuple(self._tokenizer.encode(text, add_special_tokens=False).ids)
            else:
                ids = tuple(self._tokenizer.encode(prompt.text).ids)
            if ids:
                prompt = PromptTokens.from_ids(ids)
        total = prompt.num_tokens + max_tokens
        if total > config.effective_max_model_len:
            raise ValueError(
                f"prompt ({prompt.num_tokens} tokens) + max_tokens ({max_tokens}) ="
                f" {total} exceeds the maximum model length {config.effective_max_model_len}"
            )
        adapter = model if model in config.lora_adapters else None
        cache_key = adapter if adapter is not None else config.model_name
        if self._hasher is not None and prompt.ids is not None:
            hashes = tuple(
                self._hasher.chain(
                    prompt.ids,
                    config.block_size,
                    extra_keys=(adapter,) if adapter is not None else None,
                )
            )
        else:
            hashes = block_hashes(cache_key, prompt.full_blocks(config.block_size))
        return RequestState(
            request_id=request_id,
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            lora_adapter=adapter,
            block_hashes=hashes,
        )

    def cached_prefix_tokens(self, state: RequestState) -> int:
        """The prompt tokens the cache holds now for ``state`` (as many as admission would
        reuse: never the prompt's last token)."""
        kv = self._scheduler.kv_cache
        limit = (state.prompt_tokens - 1) // kv.block_size
        return len(kv.longest_prefix(state.block_hashes, limit)) * kv.block_size

    async def generate(self, state: RequestState) -> AsyncGenerator[str, None]:
        """Yield the request's tokens, holding its slot and blocks until the last one.

        Close the iterator (``contextlib.aclosing``) when abandoning it early; the request
        then counts as aborted.
        """
        loop = asyncio.get_running_loop()
        scheduler = self._scheduler
        clock = _Clock()
        completed = False
        first_admission = True
        scheduler.add(state, loop.time())
        try:
            while state.generated_tokens < state.max_tokens:
                waited = await self._admission(state)
                clock.elapsed += waited
                if first_admission:
                    self._queue_time.observe(waited)
                    first_admission = False
                epoch = state.epoch
                if not await self._compute(state, clock, self._prefill_seconds(state)):
                    continue  # preempted during prefill
                yield self._emit(state, clock)
                while state.generated_tokens < state.max_tokens:
                    if state.epoch != epoch or state.phase is not Phase.RUNNING:
                        break  # preempted while the consumer held the token
                    if not scheduler.grow(state, loop.time()):
                        break
                    decode = self._config.itl * self._config.load_factor(scheduler.num_running)
                    if not await self._compute(state, clock, decode):
                        break
                    yield self._emit(state, clock)
            completed = True
        finally:
            scheduler.finish(state, loop.time())
            self._finished["length" if completed else "abort"] += 1
            if completed:
                self._e2e.observe(clock.elapsed)

    async def _admission(self, state: RequestState) -> float:
        """Wait until ``state`` runs; returns the simulated seconds it waited."""
        scale = self._config.time_scale
        waited = 0.0
        while state.phase is Phase.WAITING:
            since = state.enqueued_at
            admission: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            state.admission = admission
            await admission
            if state.phase is Phase.WAITING and scale > 0:
                # admitted, then preempted again before this coroutine resumed
                waited += (state.enqueued_at - since) / scale
        if scale > 0:
            waited += (state.admitted_at - state.enqueued_at) / scale
        return waited

    def _prefill_seconds(self, state: RequestState) -> float:
        config = self._config
        uncached = state.total_tokens - state.cached_tokens
        base = config.prefill_overhead + uncached * config.prefill_per_token
        return base * config.load_factor(state.running_at_admission)

    async def _compute(self, state: RequestState, clock: _Clock, seconds: float) -> bool:
        """Spend ``seconds`` of simulated compute; ``False`` if preempted meanwhile."""
        wall = seconds * self._config.time_scale
        if wall <= 0:
            clock.elapsed += seconds
            return True
        loop = asyncio.get_running_loop()
        done: asyncio.Future[bool] = loop.create_future()
        timer = loop.call_later(wall, _resolve, done, True)
        state.interrupt = done
        epoch = state.epoch
        started = loop.time()
        try:
            finished = await done
        finally:
            timer.cancel()
            if state.interrupt is done:
                state.interrupt = None
        # preempted between the timer firing and this coroutine resuming
        finished = finished and state.epoch == epoch and state.phase is Phase.RUNNING
        if finished:
            clock.elapsed += seconds
        else:
            clock.elapsed += (loop.time() - started) / self._config.time_scale
        return finished

    def _emit(self, state: RequestState, clock: _Clock) -> str:
        index = state.generated_tokens
        state.generated_tokens += 1
        self._generation_tokens_total += 1
        if index == 0:
            self._prompt_tokens_total += state.prompt_tokens
            self._ttft.observe(clock.elapsed)
        else:
            self._itl.observe(clock.elapsed - clock.last_token)
        clock.last_token = clock.elapsed
        return filler_token(index)

    def kv_cache_usage(self) -> float:
        """Fraction (0..1) of the KV-cache blocks referenced by running requests."""
        return self._scheduler.kv_cache.usage

    def stats(self, *, with_samples: bool = False) -> EngineStats:
        """Snapshot of the engine; ``with_samples`` copies TTFT and e2e-latency samples."""
        scheduler = self._scheduler
        kv = scheduler.kv_cache
        return EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            kv_used_blocks=kv.num_used,
            kv_cached_blocks=kv.num_cached,
            kv_evictions=kv.num_evictions,
            running_lora_adapters=_distinct_adapters(scheduler.running),
            waiting_lora_adapters=_distinct_adapters(scheduler.waiting),
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            prefix_cache_queries_total=scheduler.prefix_cache_queries,
            prefix_cache_hits_total=scheduler.prefix_cache_hits,
            preemptions_total=scheduler.preemptions,
            request_success_total=dict(self._finished),
            ttft=self._ttft.snapshot(with_samples=with_samples),
            itl=self._itl.snapshot(),
            e2e_latency=self._e2e.snapshot(with_samples=with_samples),
            queue_time=self._queue_time.snapshot(),
        )
