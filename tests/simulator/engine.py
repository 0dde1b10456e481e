"""Simulated inference engine: scheduling, timing, deterministic output and counters."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass, field

from tests.simulator.config import SimulatorConfig
from tests.simulator.scheduler import RequestState, Scheduler

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


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Point-in-time view of the engine, as exported on ``/metrics``."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    running_lora_adapters: tuple[str, ...]
    waiting_lora_adapters: tuple[str, ...]
    prompt_tokens_total: int
    generation_tokens_total: int
    request_success_total: dict[str, int] = field(default_factory=dict)


async def _pause(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)


def _distinct_adapters(states: Iterable[RequestState]) -> tuple[str, ...]:
    adapters = (state.lora_adapter for state in states if state.lora_adapter is not None)
    return tuple(dict.fromkeys(adapters))


class SimulatedEngine:
    """Runs requests through the scheduler and produces their tokens over time."""

    def __init__(self, config: SimulatorConfig) -> None:
        self._config = config
        self._scheduler = Scheduler(config.max_num_seqs)
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._finished: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)

    def new_request(
        self, request_id: str, model: str, prompt_tokens: int, max_tokens: int
    ) -> RequestState:
        """Describe a request; ``model`` naming a configured LoRA adapter marks it as such."""
        adapter = model if model in self._config.lora_adapters else None
        return RequestState(
            request_id=request_id,
            model=model,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            lora_adapter=adapter,
        )

    async def generate(self, state: RequestState) -> AsyncGenerator[str, None]:
        """Yield the request's tokens, holding a scheduler slot until the last one.

        Waits for a slot, spends ``ttft`` on prefill, then ``itl`` before each token.
        Close the iterator (``contextlib.aclosing``) when abandoning it early; the request
        then counts as aborted.
        """
        finished = False
        try:
            async with self._scheduler.slot(state):
                await _pause(self._config.ttft)
                self._prompt_tokens_total += state.prompt_tokens
                for index in range(state.max_tokens):
                    await _pause(self._config.itl)
                    state.generated_tokens += 1
                    self._generation_tokens_total += 1
                    yield filler_token(index)
                finished = True
        finally:
            self._finished["length" if finished else "abort"] += 1

    def kv_cache_usage(self) -> float:
        """Fraction (0..1) of the KV cache held by running requests."""
        used = sum(state.total_tokens for state in self._scheduler.running)
        return min(1.0, used / self._config.kv_cache_capacity_tokens)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self._scheduler.num_running,
            num_waiting=self._scheduler.num_waiting,
            kv_cache_usage=self.kv_cache_usage(),
            running_lora_adapters=_distinct_adapters(self._scheduler.running),
            waiting_lora_adapters=_distinct_adapters(self._scheduler.waiting),
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            request_success_total=dict(self._finished),
        )
