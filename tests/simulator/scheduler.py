"""Admission control like vLLM v1's FCFS scheduler: slots, LoRA adapters and KV blocks.

- Waiting requests are admitted in arrival order while fewer than ``max_num_seqs`` run.
- A request for a LoRA adapter is skipped (it keeps its place; later requests may pass
  it) while ``max_loras`` other adapters are in use by running requests.
- Admission looks up the longest cached prefix of the request's full prompt blocks (at
  most ``(tokens - 1) // block_size`` blocks: the last token is always recomputed), then
  allocates blocks for the rest of its tokens. When they do not fit, it stops: the request
  and everything behind it wait (head-of-line blocking, as in vLLM).
- A running request needs ``ceil((prompt + generated) / block_size)`` blocks before each
  decode step. When no block is free, the most recently admitted running request is
  preempted: its blocks are freed (their cached content stays findable) and it goes back
  to the front of the queue, to be prefilled again (prompt and generated tokens, minus
  cache hits) once readmitted. If it was the request that needed the block, it waits.
- Prefix-cache statistics count, on every admission, the request's tokens (queries) and
  the tokens found in the cache (hits), like vLLM v1's ``prefix_cache_*`` counters.

Only prompt blocks are hashed; blocks filled by generated tokens are never shared.
Everything here is synchronous; the engine awaits the futures it places on requests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from tests.simulator.kvcache import Block, KVCache
from tests.simulator.tokens import PromptTokens


class Phase(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class RequestState:
    """One request as the scheduler and the engine see it (compared by identity)."""

    request_id: str
    model: str
    prompt: PromptTokens
    max_tokens: int
    lora_adapter: str | None = None
    block_hashes: tuple[bytes, ...] = ()
    """Hash chain of the prompt's full blocks (see :mod:`tests.simulator.kvcache`)."""
    generated_tokens: int = 0
    phase: Phase = Phase.WAITING
    blocks: list[Block] = field(default_factory=list)
    epoch: int = 0
    """Number of admissions so far (a preempted request is admitted again)."""
    num_preemptions: int = 0
    cached_tokens: int = 0
    """Prompt tokens found in the prefix cache at the latest admission."""
    first_cached_tokens: int | None = None
    """Prompt tokens found in the prefix cache at the first admission."""
    running_at_admission: int = 0
    """Running requests, this one included, right after the latest admission."""
    enqueued_at: float = 0.0
    admitted_at: float = 0.0
    admission: asyncio.Future[None] | None = None
    """Resolved by the scheduler when the waiting request is admitted."""
    interrupt: asyncio.Future[bool] | None = None
    """A pending compute step; the scheduler resolves it with ``False`` on preemption."""

    @property
    def prompt_tokens(self) -> int:
        return self.prompt.num_tokens

    @property
    def total_tokens(self) -> int:
        """Prompt and generated tokens."""
        return self.prompt_tokens + self.generated_tokens


class Scheduler:
    """Running set, FIFO waiting queue, LoRA limit and KV blocks of one engine."""

    def __init__(self, *, max_num_seqs: int, max_loras: int, kv_cache: KVCache) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self._max_num_seqs = max_num_seqs
        self._max_loras = max_loras
        self._kv = kv_cache
        # dict keeps admission order: the last entry is the next preemption victim
        self._running: dict[RequestState, None] = {}
        self._waiting: deque[RequestState] = deque()
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.preemptions = 0

    @property
    def kv_cache(self) -> KVCache:
        return self._kv

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> tuple[RequestState, ...]:
        """Running requests in admission order."""
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[RequestState, ...]:
        """Waiting requests in queue order."""
        return tuple(self._waiting)

    def add(self, state: RequestState, now: float) -> None:
        """Queue a new request and admit whatever fits."""
        state.phase = Phase.WAITING
        state.enqueued_at = now
        self._waiting.append(state)
        self.schedule(now)

    def schedule(self, now: float) -> None:
        """Admit waiting requests in order while slots, adapters and blocks allow."""
        if not self._waiting:
            return
        adapters = {s.lora_adapter for s in self._running if s.lora_adapter is not None}
        skipped: list[RequestState] = []
        while self._waiting and len(self._running) < self._max_num_seqs:
            state = self._waiting[0]
            adapter = state.lora_adapter
            if adapter is not None and adapter not in adapters and len(adapters) >= self._max_loras:
                skipped.append(self._waiting.popleft())
                continue
            if not self._allocate_for_admission(state):
                break
            self._waiting.popleft()
            if adapter is not None:
                adapters.add(adapter)
            self._admit(state, now)
        if skipped:
            self._waiting.extendleft(reversed(skipped))

    def grow(self, state: RequestState, now: float) -> bool:
        """Give ``state`` the blocks of its next decode step, preempting if necessary.

        Returns ``False`` when ``state`` itself got preempted (it is waiting again).
        """
        kv = self._kv
        needed = kv.blocks_for(state.total_tokens)
        while len(state.blocks) < needed:
            if kv.num_free > 0:
                state.blocks.extend(kv.allocate(1))
                continue
            victim = next(reversed(self._running))
            self._preempt(victim, now)
            if victim is state:
                return False
        return True

    def finish(self, state: RequestState, now: float) -> None:
        """Forget a finished or abandoned request, free its blocks, admit others."""
        if state.phase is Phase.RUNNING:
            del self._running[state]
            self._kv.free(state.blocks)
            state.blocks = []
        elif state.phase is Phase.WAITING:
            with contextlib.suppress(ValueError):
                self._waiting.remove(state)
        state.phase = Phase.FINISHED
        self.schedule(now)

    def _allocate_for_admission(self, state: RequestState) -> bool:
        kv = self._kv
        num_tokens = state.total_tokens
        hits = kv.longest_prefix(state.block_hashes, (num_tokens - 1) // kv.block_size)
        num_new = kv.blocks_for(num_tokens) - len(hits)
        if not kv.can_allocate(hits, num_new):
            return False
        kv.acquire(hits)
        fresh = kv.allocate(num_new)
        hashes = state.block_hashes
        if len(hits) < len(hashes) and kv.listener is not None:
            tokens = list(state.prompt.block_token_ids(kv.block_size))
        else:
            tokens = []
        for index, block in enumerate(fresh, start=len(hits)):
            if index >= len(hashes):
                break
            kv.cache(
                block,
                hashes[index],
                parent_hash=hashes[index - 1] if index else None,
                token_ids=tokens[index] if tokens else (),
                lora_name=state.lora_adapter,
            )
        state.blocks = hits + fresh
        state.cached_tokens = len(hits) * kv.block_size
        if state.first_cached_tokens is None:
            state.first_cached_tokens = state.cached_tokens
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += state.cached_tokens
        return True

    def _admit(self, state: RequestState, now: float) -> None:
        self._running[state] = None
        state.phase = Phase.RUNNING
        state.epoch += 1
        state.admitted_at = now
        state.running_at_admission = len(self._running)
        admission, state.admission = state.admission, None
        if admission is not None and not admission.done():
            admission.set_result(None)

    def _preempt(self, victim: RequestState, now: float) -> None:
        del self._running[victim]
        self._kv.free(victim.blocks)
        victim.blocks = []
        victim.phase = Phase.WAITING
        victim.enqueued_at = now
        victim.num_preemptions += 1
        self.preemptions += 1
        self._waiting.appendleft(victim)
        interrupt, victim.interrupt = victim.interrupt, None
        if interrupt is not None and not interrupt.done():
            interrupt.set_result(False)
