"""``precise-prefix-cache-producer``: matches from the events' index, speculation, fallbacks."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace

from domain.datalayer.attributes import PREFIX_CACHE_MATCH_INFO, PrefixCacheMatchInfo
from domain.plugins.base import Duration, TypedName
from domain.prefixcache.engine_hash import EngineBlockHasher
from domain.prefixcache.hasher import StdlibBlockHasher
from domain.prefixcache.index import InMemoryPrefixIndex
from domain.prefixcache.kv_block_index import InMemoryKVBlockIndex
from domain.prefixcache.precise import PromptKeyer
from domain.requestcontrol.plugins.precise_prefix_producer import (
    TYPE,
    KVEventsConfig,
    PrecisePrefixCacheParameters,
    PrecisePrefixCacheProducer,
    TokenProcessorConfig,
    _shared_keys,
)
from domain.requestcontrol.plugins.prefix_producer import (
    ApproxPrefixCacheProducer,
    PrefixCacheParameters,
)
from domain.scheduling.load import PREFIX_BLOCKS, PREFIX_BLOCKS_OWNER, PrefixBlocks
from domain.scheduling.types import Candidate, ProfileRunResult, SchedulingResult
from ports.endpoints import EndpointEvent, EndpointEventKind
from ports.kv_events import DATA_PARALLEL_RANK_HEADER, BlockStored, rank_key
from ports.metric_catalogue import KV_KEYS_UNKEYED
from ports.tokenizer import ChatTemplateError, TokenizerError
from tests.fakes.observer import RecordingObserver
from tests.support.scheduling import candidate, inference_request, plugin_handle

BLOCK = 4


class CharTokenizer:
    """One token per character (its code point); ``!`` cannot be encoded."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> Sequence[int]:
        if "!" in text:
            raise TokenizerError("cannot encode '!'")
        return [ord(c) for c in text]


def producer(ttl: float = 2.0) -> tuple[PrecisePrefixCacheProducer, InMemoryKVBlockIndex]:
    now = [0.0]
    index = InMemoryKVBlockIndex(clock=lambda: now[0])
    params = PrecisePrefixCacheParameters(
        token_processor_config=TokenProcessorConfig(
            block_size_tokens=BLOCK, hash_seed="1", tokenizer_path="unused"
        ),
        speculative_ttl=Duration(ttl),
    )
    keyer = PromptKeyer(CharTokenizer(), EngineBlockHasher(seed="1"), block_size=BLOCK)
    return PrecisePrefixCacheProducer(
        TypedName(TYPE, TYPE), params, keyer=keyer, index=index
    ), index


def stored(keys: Sequence[int]) -> BlockStored:
    return BlockStored(block_hashes=tuple(keys), parent_block_hash=None, block_size=BLOCK)


async def test_candidates_get_the_blocks_their_events_reported() -> None:
    plugin, index = producer()
    keys = plugin.keyer.keys("abcdefghijkl")
    index.apply("a", [stored(keys)])
    index.apply("b", [stored(keys[:1])])
    cands = [candidate("a"), candidate("b"), candidate("c")]
    request = inference_request({"model": "m", "prompt": "abcdefghijklmn"})
    await plugin.prepare_request_data(request, cands)
    infos = [c.attributes[PREFIX_CACHE_MATCH_INFO] for c in cands]
    assert infos == [
        PrefixCacheMatchInfo(3, 3, BLOCK),
        PrefixCacheMatchInfo(1, 3, BLOCK),
        PrefixCacheMatchInfo(0, 3, BLOCK),
    ]
    # The keys are left for kv-capacity-gate, which counts a shared block once.
    blocks = request.state.get(PREFIX_BLOCKS_OWNER, PREFIX_BLOCKS)
    assert blocks == PrefixBlocks(keys, BLOCK)


async def test_the_chosen_endpoint_is_credited_until_events_arrive() -> None:
    plugin, index = producer()
    index.apply("a", [])  # known, no blocks
    cands = [candidate("a"), candidate("b")]
    request = inference_request({"model": "m", "prompt": "abcdefgh"})
    await plugin.prepare_request_data(request, cands)
    result = SchedulingResult(
        profile_results={"default": ProfileRunResult((cands[0],))}, primary_profile_name="default"
    )
    await plugin.pre_request(request, result)
    again = [candidate("a"), candidate("b")]
    await plugin.prepare_request_data(
        inference_request({"model": "m", "prompt": "abcdefgh"}), again
    )
    assert again[0].attributes[PREFIX_CACHE_MATCH_INFO] == PrefixCacheMatchInfo(2, 2, BLOCK)


async def test_unkeyable_requests_match_nothing_without_a_fallback() -> None:
    plugin, _ = producer()
    plugin.keyer.chat = None
    chat = {"model": "m", "messages": [{"role": "user", "content": "abcdefgh"}]}
    for request in (
        inference_request({"model": "m", "prompt": "abcdefgh!"}),  # the tokenizer fails
        inference_request(chat, path="/v1/chat/completions"),  # no chat template
        inference_request({"model": "m", "prompt": "abc"}),  # shorter than a block
    ):
        cands = [candidate("a")]
        await plugin.prepare_request_data(request, cands)
        assert cands[0].attributes[PREFIX_CACHE_MATCH_INFO] == PrefixCacheMatchInfo(0, 0, BLOCK)


class JoinTemplate:
    """Renders ``>`` for the generation prompt, the options' names, then ``role:content``
    lines; a message saying ``boom`` fails."""

    def render(
        self,
        messages: Sequence[object],
        *,
        add_generation_prompt: bool,
        options: Mapping[str, object],
    ) -> str:
        lines = []
        for message in messages:
            assert isinstance(message, dict)
            if message["content"] == "boom":
                raise ChatTemplateError("boom")
            lines.append(f"{message['role']}:{message['content']}")
        return (">" if add_generation_prompt else "") + "".join(options) + "\n".join(lines)


class FlagTokenizer(CharTokenizer):
    """Records whether special tokens were asked for; adds a BOS (0) when they are."""

    def __init__(self) -> None:
        self.flags: list[bool] = []

    def encode(self, text: str, *, add_special_tokens: bool = True) -> Sequence[int]:
        self.flags.append(add_special_tokens)
        ids = list(super().encode(text))
        return [0, *ids] if add_special_tokens else ids


async def test_chat_requests_are_keyed_from_the_rendered_template() -> None:
    plugin, index = producer()
    tokenizer = FlagTokenizer()
    plugin.keyer = PromptKeyer(
        tokenizer, EngineBlockHasher(seed="1"), block_size=BLOCK, chat=JoinTemplate()
    )
    rendered = ">system:be brief\nuser:abcdefgh"
    keys = plugin.keyer.keys_for_tokens([ord(c) for c in rendered])
    index.apply("a", [stored(keys)])
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abcdefgh"}]
    cands = [candidate("a"), candidate("b")]
    body = {"model": "m", "messages": messages}
    await plugin.prepare_request_data(inference_request(body, path="/v1/chat/completions"), cands)
    assert tokenizer.flags == [False]  # the template wrote the special tokens
    total = len(rendered) // BLOCK
    assert [c.attributes[PREFIX_CACHE_MATCH_INFO] for c in cands] == [
        PrefixCacheMatchInfo(total, total, BLOCK),
        PrefixCacheMatchInfo(0, total, BLOCK),
    ]
    # the request's own options change the text, hence the keys
    for extra in (
        {"add_generation_prompt": False},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"add_special_tokens": True},
    ):
        cands = [candidate("a")]
        request = inference_request({**body, **extra}, path="/v1/chat/completions")
        await plugin.prepare_request_data(request, cands)
        info = cands[0].attributes[PREFIX_CACHE_MATCH_INFO]
        assert isinstance(info, PrefixCacheMatchInfo)
        assert info.total_blocks > 0
        assert info.match_blocks == 0, extra
    assert tokenizer.flags[-1] is True


async def test_chat_requests_it_cannot_render_are_counted_by_reason() -> None:
    plugin, _ = producer()
    observer = RecordingObserver()
    plugin._observer = observer
    plugin.keyer.chat = JoinTemplate()
    user = {"role": "user", "content": "abcdefgh"}
    path = "/v1/chat/completions"
    cases: dict[str, dict[str, object]] = {
        "chat_template": {"messages": [{"role": "user", "content": "boom"}]},
        "chat_options": {"messages": [user], "tools": [{"type": "function"}]},
    }
    for reason, body in cases.items():
        cands = [candidate("a")]
        await plugin.prepare_request_data(
            inference_request({"model": "m", **body}, path=path), cands
        )
        assert cands[0].attributes[PREFIX_CACHE_MATCH_INFO] == PrefixCacheMatchInfo(0, 0, BLOCK)
        assert observer.total(KV_KEYS_UNKEYED, reason=reason) == 1
    others: tuple[dict[str, object], ...] = (
        {"messages": [user], "chat_template": "{{ x }}"},
        {"messages": [user], "continue_final_message": True},
        {"messages": [user], "tools": []},  # the server passes an empty list on
        {"messages": [user], "documents": [{"text": "d"}]},
    )
    for body in others:
        await plugin.prepare_request_data(inference_request({"model": "m", **body}, path=path), [])
    assert observer.total(KV_KEYS_UNKEYED, reason="chat_options") == 5
    plugin.keyer.chat = None
    await plugin.prepare_request_data(
        inference_request({"model": "m", "messages": [user]}, path=path), []
    )
    await plugin.prepare_request_data(inference_request({"model": "m", "prompt": [1, 2]}), [])
    assert observer.total(KV_KEYS_UNKEYED, reason="no_chat_template") == 1
    assert observer.total(KV_KEYS_UNKEYED, reason="prompt") == 1


def test_only_the_text_the_matched_blocks_can_span_is_tokenized() -> None:
    seen: list[int] = []

    class Counting(CharTokenizer):
        def encode(self, text: str, *, add_special_tokens: bool = True) -> Sequence[int]:
            seen.append(len(text))
            return super().encode(text)

    keyer = PromptKeyer(Counting(), EngineBlockHasher(seed="1"), block_size=BLOCK)
    text = "x" * 10_000
    assert keyer.keys(text, max_blocks=2) == keyer.keys(text)[:2]
    assert seen[0] == 2 * BLOCK * 16


async def test_requests_it_cannot_key_fall_back_to_the_approximate_path() -> None:
    plugin, _ = producer()
    handle = plugin_handle(hasher=StdlibBlockHasher(), prefix_index=InMemoryPrefixIndex())
    plugin.fallback = ApproxPrefixCacheProducer(
        TypedName("approx-prefix-cache-producer", "fallback"),
        PrefixCacheParameters(block_size_tokens=BLOCK, auto_tune=False),
        handle,
    )
    for name in ("a", "b"):  # the fallback records endpoints of the pool only
        handle.datastore.apply(
            EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=candidate(name).info)
        )
    chat = {"model": "m", "messages": [{"role": "user", "content": "abcdefgh" * 20}]}
    refused = {"model": "m", "prompt": "abcdefgh!" * 20}  # the tokenizer fails
    for body, path in ((chat, "/v1/chat/completions"), (refused, "/v1/completions")):
        first = [candidate("a"), candidate("b")]
        request = inference_request(body, path=path)
        await plugin.prepare_request_data(request, first)
        assert _matched(first[0]) == 0
        result = SchedulingResult(
            profile_results={"default": ProfileRunResult((first[1],))},
            primary_profile_name="default",
        )
        await plugin.pre_request(request, result)  # recorded where it went: b
        again = [candidate("a"), candidate("b")]
        await plugin.prepare_request_data(inference_request(body, path=path), again)
        info = again[1].attributes[PREFIX_CACHE_MATCH_INFO]
        assert isinstance(info, PrefixCacheMatchInfo)
        assert info.match_blocks == info.total_blocks > 0
        assert _matched(again[0]) == 0


def _matched(target: Candidate) -> int:
    info = target.attributes[PREFIX_CACHE_MATCH_INFO]
    assert isinstance(info, PrefixCacheMatchInfo)
    return info.match_blocks


async def test_long_prompts_are_tokenized_off_the_event_loop() -> None:
    threads: list[bool] = []

    class Recording(CharTokenizer):
        def encode(self, text: str, *, add_special_tokens: bool = True) -> Sequence[int]:
            threads.append(threading.current_thread() is threading.main_thread())
            return super().encode(text)

    plugin, index = producer()
    plugin.keyer = PromptKeyer(Recording(), EngineBlockHasher(seed="1"), block_size=BLOCK)
    threshold = plugin.parameters.tokenize_in_thread_chars
    short, long = "s" * (threshold - 1), "l" * threshold
    other = PromptKeyer(CharTokenizer(), EngineBlockHasher(seed="1"), block_size=BLOCK)
    index.apply("a", [stored(other.keys(long)[:3])])
    for prompt in (short, long, long):  # the second long one is cached
        cands = [candidate("a")]
        await plugin.prepare_request_data(
            inference_request({"model": "m", "prompt": prompt}), cands
        )
    assert threads == [True, False]  # the short one on the loop, the long one in a thread
    info = cands[0].attributes[PREFIX_CACHE_MATCH_INFO]
    assert info == PrefixCacheMatchInfo(3, threshold // BLOCK, BLOCK)


async def test_a_lora_adapters_requests_are_keyed_with_its_name() -> None:
    """An adapter is a name the servers' events or metrics give; its requests' keys carry
    it (the engine's hash does), the base model's do not."""
    plugin, index = producer()
    prompt = "abcdefghijkl"
    base = plugin.keyer.keys(prompt)
    sql = plugin.keyer.keys(prompt, lora_name="sql")
    chat = plugin.keyer.keys(prompt, lora_name="chat")
    index.apply("a", [stored(sql)])
    index.apply("b", [stored(base)])
    # "chat" is known from a BlockStored event's lora_name
    plugin.adapters.watching(index).apply("c", [replace(stored(chat), lora_name="chat")])

    async def matches(model: str, **metrics: object) -> list[int]:
        cands = [candidate(n, **metrics) for n in ("a", "b", "c")]
        await plugin.prepare_request_data(
            inference_request({"model": model, "prompt": prompt}), cands
        )
        return [_matched(c) for c in cands]

    assert await matches("sql") == [0, 3, 0]  # not known as an adapter yet: the base keys
    # a server's metrics report "sql" running: an adapter from now on
    assert await matches("sql", active_models=frozenset({"sql"})) == [3, 0, 0]
    assert await matches("sql") == [3, 0, 0]
    assert await matches("chat") == [0, 0, 3]
    assert await matches("m") == [0, 3, 0]


async def test_the_cache_salt_goes_with_the_first_block() -> None:
    plugin, index = producer()
    prompt = "abcdefghijkl"
    index.apply("a", [stored(plugin.keyer.keys(prompt, cache_salt="tenant-1"))])
    for salt, matched in (("tenant-1", 3), ("tenant-2", 0), (None, 0)):
        cands = [candidate("a")]
        body = {"model": "m", "prompt": prompt, **({"cache_salt": salt} if salt else {})}
        await plugin.prepare_request_data(inference_request(body), cands)
        assert _matched(cands[0]) == matched, salt


def sharing(
    shared: InMemoryPrefixIndex, now: list[float], ttl: float = 2.0
) -> PrecisePrefixCacheProducer:
    """A producer of one EPP process whose speculative entries go to ``shared`` (the pool's
    prefix index), with its own events' index (no events: every prompt is cold)."""
    plugin, _ = producer(ttl)
    plugin.shared = shared
    plugin._clock = lambda: now[0]
    return plugin


def picked(*targets: Candidate) -> SchedulingResult:
    return SchedulingResult(
        profile_results={"default": ProfileRunResult(targets)}, primary_profile_name="default"
    )


PROMPT = {"model": "m", "prompt": "abcdefghijklmnop"}


async def test_a_new_prompt_routed_by_two_processes_at_once_follows_the_first_claim() -> None:
    shared, now = InMemoryPrefixIndex(), [100.0]
    first, second = sharing(shared, now), sharing(shared, now)
    one, two = inference_request(PROMPT), inference_request(PROMPT)
    mine, theirs = [candidate("a"), candidate("b")], [candidate("a"), candidate("b")]
    await first.prepare_request_data(one, mine)
    await second.prepare_request_data(two, theirs)  # both matched before any claim
    assert await first.claim_placement(one, picked(mine[0])) is None  # recorded for a
    moved = await second.claim_placement(two, picked(theirs[1]))  # b, told a owns it
    assert moved is theirs[0]
    # a third request through the second process sees where the prompt went
    again = [candidate("a"), candidate("b")]
    await second.prepare_request_data(inference_request(PROMPT), again)
    assert [_matched(c) for c in again] == [4, 0]
    # until speculativeTtl has passed (the windows are half of it): then it is forgotten
    now[0] += 2.0
    later = [candidate("a"), candidate("b")]
    await second.prepare_request_data(inference_request(PROMPT), later)
    assert [_matched(c) for c in later] == [0, 0]


async def test_the_pick_of_an_unclaimed_new_prompt_is_shared_after_routing() -> None:
    shared, now = InMemoryPrefixIndex(), [100.0]
    first, second = sharing(shared, now), sharing(shared, now)
    request, cands = inference_request(PROMPT), [candidate("a"), candidate("b")]
    await first.prepare_request_data(request, cands)
    await first.pre_request(request, picked(cands[1]))  # no claim ran (as without claimers)
    seen = [candidate("a"), candidate("b")]
    await second.prepare_request_data(inference_request(PROMPT), seen)
    assert [_matched(c) for c in seen] == [0, 4]


async def test_a_prompt_a_server_holds_claims_nothing() -> None:
    shared, now = InMemoryPrefixIndex(), [100.0]
    plugin = sharing(shared, now)
    index = plugin.index
    assert isinstance(index, InMemoryKVBlockIndex)
    index.apply("b", [stored(plugin.keyer.keys("abcdefgh"))])  # its first two blocks
    request, cands = inference_request(PROMPT), [candidate("a"), candidate("b")]
    await plugin.prepare_request_data(request, cands)
    assert [_matched(c) for c in cands] == [0, 2]
    assert await plugin.claim_placement(request, picked(cands[0])) is None
    await plugin.pre_request(request, picked(cands[0]))
    assert shared.size() == 0


async def test_speculative_entries_off_share_nothing() -> None:
    shared, now = InMemoryPrefixIndex(), [100.0]
    plugin, _ = producer(ttl=0)
    plugin = PrecisePrefixCacheProducer(
        plugin.typed_name, plugin.parameters, keyer=plugin.keyer, index=plugin.index,
        shared=shared, clock=lambda: now[0],
    )  # fmt: skip
    request, cands = inference_request(PROMPT), [candidate("a"), candidate("b")]
    await plugin.prepare_request_data(request, cands)
    assert await plugin.claim_placement(request, picked(cands[0])) is None
    await plugin.pre_request(request, picked(cands[0]))
    assert shared.size() == 0


async def test_requests_on_the_approximate_path_are_claimed_once_by_the_fallback() -> None:
    shared, now = InMemoryPrefixIndex(), [100.0]
    plugin = sharing(shared, now)
    plugin.keyer.chat = None  # chat requests take the approximate path
    handle = plugin_handle(hasher=StdlibBlockHasher(), prefix_index=shared)
    plugin.fallback = ApproxPrefixCacheProducer(
        TypedName("approx-prefix-cache-producer", "fallback"),
        PrefixCacheParameters(block_size_tokens=BLOCK, auto_tune=False),
        handle,
    )
    for name in ("a", "b"):
        handle.datastore.apply(
            EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=candidate(name).info)
        )
    chat = {"model": "m", "messages": [{"role": "user", "content": "abcdefgh" * 20}]}
    request = inference_request(chat, path="/v1/chat/completions")
    cands = [candidate("a"), candidate("b")]
    await plugin.prepare_request_data(request, cands)
    assert await plugin.claim_placement(request, picked(cands[1])) is None
    blocks = shared.size()
    assert blocks > 0  # the fallback's claim: its character hashes, for b
    await plugin.pre_request(request, picked(cands[1]))
    assert shared.size() == blocks  # recorded once, by the claim
    # another process routing the same chat request follows b
    other = sharing(shared, now)
    other.keyer.chat = None
    other.fallback = plugin.fallback
    again = [candidate("a"), candidate("b")]
    await other.prepare_request_data(inference_request(chat, path="/v1/chat/completions"), again)
    assert _matched(again[0]) == 0
    assert _matched(again[1]) > 0


async def test_data_parallel_endpoints_are_claimed_whole_and_pinned_once_an_engine_holds() -> None:
    shared, now = InMemoryPrefixIndex(), [100.0]
    plugin = sharing(shared, now)
    plugin.parameters = replace(
        plugin.parameters, kv_events_config=KVEventsConfig(data_parallel_size=2)
    )
    first, cands = inference_request(PROMPT), [candidate("a"), candidate("b")]
    await plugin.prepare_request_data(first, cands)
    assert await plugin.claim_placement(first, picked(cands[1])) is None
    await plugin.pre_request(first, picked(cands[1]))
    assert not first.upstream_headers  # no engine holds it: the server balances them
    assert await shared.match(plugin_keys(plugin, now[0])) == {"b": 4}  # the endpoint
    index = plugin.index
    assert isinstance(index, InMemoryKVBlockIndex)
    index.apply(rank_key("b", 1), [stored(plugin.keyer.keys(PROMPT["prompt"]))])
    second, again = inference_request(PROMPT), [candidate("a"), candidate("b")]
    await plugin.prepare_request_data(second, again)
    assert await plugin.claim_placement(second, picked(again[1])) is None
    await plugin.pre_request(second, picked(again[1]))
    assert second.upstream_headers == [(DATA_PARALLEL_RANK_HEADER, "1")]


def plugin_keys(plugin: PrecisePrefixCacheProducer, now: float) -> list[int]:
    """The prompt's keys as the shared prefix index holds them now."""
    window = int(now // (plugin.parameters.speculative_ttl / 2))
    return _shared_keys(plugin.keyer.keys(PROMPT["prompt"]), window)
