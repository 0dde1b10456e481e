"""A prompt's block keys as the model server names them: tokenize, then hash the chain.

A chat request's messages are first rendered into the prompt text by the model's chat
template (``ports.tokenizer.ChatTemplate``), then tokenized without adding special tokens
(the template wrote them), as vLLM does for ``/v1/chat/completions``.

Tokenizing costs CPU on the routing path, so the token ids of recent prompts are kept in
an LRU keyed by the exact text (and whether special tokens were added), bounded by the
total characters held; and with
``max_blocks`` only the first ``max_blocks * block_size * MAX_CHARS_PER_TOKEN`` characters
are tokenized (far more than those blocks can span, so their tokens are those of the whole
text unless a token is longer than that on average).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from domain.prefixcache.engine_hash import EngineBlockHasher
from ports.kv_events import BlockStored, KVEvent, KVEventSink
from ports.tokenizer import ChatTemplate, Tokenizer

__all__ = ["MAX_CHARS_PER_TOKEN", "LoraAdapterNames", "PromptKeyer"]

MAX_CHARS_PER_TOKEN = 16


class PromptKeyer:
    """Text → the engine's 64-bit block keys (see ``engine_hash``)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        hasher: EngineBlockHasher,
        *,
        block_size: int,
        cache_chars: int = 32 * 1024 * 1024,
        chat: ChatTemplate | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self._tokenizer = tokenizer
        self._hasher = hasher
        self.block_size = block_size
        #: The model's chat template; ``None``: chat requests cannot be keyed.
        self.chat = chat
        self._cache: OrderedDict[tuple[str, bool], tuple[int, ...]] = OrderedDict()
        self._cache_chars = cache_chars
        self._held = 0
        self.hits = 0
        self.misses = 0

    def tokens(self, text: str, *, special: bool = True) -> tuple[int, ...]:
        """The prompt's token ids, with special tokens added when ``special`` (raises
        ``ports.tokenizer.TokenizerError``)."""
        cached = self.cached(text, special=special)
        if cached is not None:
            return cached
        ids = self.encode(text, special=special)
        self.remember(text, ids, special=special)
        return ids

    def cached(self, text: str, *, special: bool = True) -> tuple[int, ...] | None:
        """``text``'s token ids if the cache holds them (counted as a hit or a miss)."""
        key = (text, special)
        cached = self._cache.get(key)
        if cached is None:
            self.misses += 1
            return None
        self._cache.move_to_end(key)
        self.hits += 1
        return cached

    def encode(self, text: str, *, special: bool = True) -> tuple[int, ...]:
        """Tokenize without touching the cache: safe in a worker thread (the tokenizer is
        thread-safe; raises ``ports.tokenizer.TokenizerError``)."""
        return tuple(self._tokenizer.encode(text, add_special_tokens=special))

    def remember(self, text: str, ids: tuple[int, ...], *, special: bool = True) -> None:
        """Keep ``text``'s token ids in the cache (the oldest dropped past its bound)."""
        key = (text, special)
        if len(text) > self._cache_chars or key in self._cache:
            return
        self._cache[key] = ids
        self._held += len(text)
        while self._held > self._cache_chars:
            (old, _), _ = self._cache.popitem(last=False)
            self._held -= len(old)

    @staticmethod
    def prefix_text(text: str, block_size: int, max_blocks: int | None) -> str:
        """The part of ``text`` that ``max_blocks`` blocks can span."""
        if max_blocks is None:
            return text
        return text[: max_blocks * block_size * MAX_CHARS_PER_TOKEN]

    def keys(
        self,
        text: str,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        max_blocks: int | None = None,
    ) -> list[int]:
        """The block keys of ``text``'s full blocks (see :meth:`keys_for_tokens`)."""
        text = self.prefix_text(text, self.block_size, max_blocks)
        return self.keys_for_tokens(
            self.tokens(text), lora_name=lora_name, cache_salt=cache_salt, max_blocks=max_blocks
        )

    def keys_for_tokens(
        self,
        ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        max_blocks: int | None = None,
    ) -> list[int]:
        """The block keys of ``ids``, as vLLM hashes a request's blocks: a LoRA adapter's
        name is an extra key of every block, the request's ``cache_salt`` one of the first
        block (after the adapter's name)."""
        extra = (lora_name,) if lora_name else None
        first = (*(extra or ()), cache_salt) if cache_salt else None
        return self._hasher.keys(
            ids, self.block_size, extra_keys=extra, first_extra_keys=first, max_blocks=max_blocks
        )


class LoraAdapterNames:
    """The model names the pool's servers serve as LoRA adapters, as far as they say so:
    the ``lora_name`` of their ``BlockStored`` events (:meth:`watching` a sink), and the
    adapters their metrics report running or waiting (``add``). A request to one of these
    names is hashed with the adapter's name, as the engine hashes its blocks; any other
    model is the base model. Bounded: the ``limit`` most recently seen names are kept."""

    def __init__(self, limit: int = 4096) -> None:
        self._names: OrderedDict[str, None] = OrderedDict()
        self._limit = limit

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def add(self, name: str) -> None:
        names = self._names
        if name in names:
            names.move_to_end(name)
            return
        names[name] = None
        if len(names) > self._limit:
            names.popitem(last=False)

    def watching(self, sink: KVEventSink) -> KVEventSink:
        """``sink``, learning adapter names from the events it is given on the way."""
        return _NamesFromEvents(sink, self)


class _NamesFromEvents:
    __slots__ = ("_names", "_sink")

    def __init__(self, sink: KVEventSink, names: LoraAdapterNames) -> None:
        self._sink = sink
        self._names = names

    def apply(self, endpoint: str, events: Sequence[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored) and event.lora_name:
                self._names.add(event.lora_name)
        self._sink.apply(endpoint, events)

    def lost(self, endpoint: str) -> None:
        self._sink.lost(endpoint)

    def resynced(self, endpoint: str) -> None:
        self._sink.resynced(endpoint)

    def forget(self, endpoint: str) -> None:
        self._sink.forget(endpoint)
