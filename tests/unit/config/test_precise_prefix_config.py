"""``precise-prefix-cache-producer`` in an EndpointPickerConfig: its parameters and errors."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from adapters.xxhash import xxh3_128
from app.config import ConfigError, load_config
from app.plugins import build_registry
from domain.prefixcache.engine_hash import EngineBlockHasher
from domain.prefixcache.kv_block_index import InMemoryKVBlockIndex
from domain.requestcontrol.plugins.precise_prefix_producer import PrecisePrefixCacheProducer
from domain.sharedstate.kv_blocks import InMemoryKVBlockStore
from domain.sharedstate.shared_kv_index import SharedKVBlockIndex
from tests.support.tokenizer import write_tokenizer_json
from tests.unit.config import make_handle


def config(parameters: str) -> str:
    return textwrap.dedent(
        """\
        plugins:
        - type: precise-prefix-cache-producer
          parameters:
        {parameters}
        - type: prefix-cache-scorer
        - type: max-score-picker
        schedulingProfiles:
        - name: default
          plugins: [{{pluginRef: prefix-cache-scorer}}, {{pluginRef: max-score-picker}}]
        """
    ).format(parameters=textwrap.indent(textwrap.dedent(parameters), "    "))


def load(text: str, *, shared: bool = False) -> object:
    handle = make_handle()
    if shared:  # as with --redis-url
        handle.kv_block_store = InMemoryKVBlockStore()
    return load_config(text, registry=build_registry(include_entry_points=False), handle=handle)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_json(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def test_parameters_and_the_scorer_reads_its_matches(tokenizer: Path) -> None:
    loaded = load(
        config(
            f"""\
            tokenProcessorConfig:
              blockSizeTokens: 64
              hashSeed: "42"
              hashAlgorithm: sha256_cbor
              tokenizerPath: {tokenizer}
            kvEventsConfig: {{socketPort: 5557, replayPort: 5558, topicFilter: "kv@"}}
            indexerConfig: {{backend: in-memory, maxBlocksPerEndpoint: 1000}}
            speculativeTtl: 500ms
            """
        )
    )
    plugins = loaded.plugins  # type: ignore[attr-defined]
    producer = plugins["precise-prefix-cache-producer"]
    assert isinstance(producer, PrecisePrefixCacheProducer)
    assert producer.keyer.block_size == 64
    assert producer.parameters.speculative_ttl == 0.5
    assert producer.parameters.kv_events_config.replay_port == 5558
    # the scorer's match info comes from this producer: no approximate one is added,
    # only its own fallback for requests it cannot key (chat)
    assert "approx-prefix-cache-producer" not in plugins
    assert producer.fallback is not None
    # the chat template beside the tokenizer
    assert producer.keyer.chat is not None


@pytest.mark.parametrize("algorithm", ["xxhash", "xxhash_cbor"])
def test_the_xxhash_algorithms_are_wired(tokenizer: Path, algorithm: str) -> None:
    line = f'tokenProcessorConfig: {{hashSeed: "1", tokenizerPath: {tokenizer}, '
    loaded = load(config(line + f"hashAlgorithm: {algorithm}}}\n"))
    producer = loaded.plugins["precise-prefix-cache-producer"]  # type: ignore[attr-defined]
    assert producer.keyer.keys_for_tokens(list(range(32))) == EngineBlockHasher(
        algorithm=algorithm, seed="1", xxh3_128=xxh3_128
    ).keys(list(range(32)), 16)


def test_a_chat_template_file_and_its_errors(tokenizer: Path, tmp_path: Path) -> None:
    own = tmp_path / "chat.jinja"
    own.write_text("{{ messages[0].content }}!")
    line = f'tokenProcessorConfig: {{hashSeed: "1", tokenizerPath: {tokenizer}, '
    loaded = load(config(line + f"chatTemplatePath: {own}}}\n"))
    producer = loaded.plugins["precise-prefix-cache-producer"]  # type: ignore[attr-defined]
    assert (
        producer.keyer.chat.render(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True, options={}
        )
        == "hi!"
    )
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% if %}")
    for path in (tmp_path / "missing.jinja", broken):
        with pytest.raises(ConfigError, match=f"chatTemplatePath: .*{path}"):
            load(config(line + f"chatTemplatePath: {path}}}\n"))


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ("tokenProcessorConfig: {tokenizerPath: /x}\n", "hashSeed: required"),
        ('tokenProcessorConfig: {hashSeed: "1"}\n', "tokenizerPath: required"),
        (
            'tokenProcessorConfig: {hashSeed: "1", tokenizerPath: /x, hashAlgorithm: md5}\n',
            "hashAlgorithm: must be one of sha256, sha256_cbor, xxhash, xxhash_cbor",
        ),
        (
            'tokenProcessorConfig: {hashSeed: "1", tokenizerPath: /nowhere/tokenizer.json}\n',
            "/nowhere/tokenizer.json",
        ),
        (
            'tokenProcessorConfig: {hashSeed: "1", tokenizerPath: /x}\n'
            "indexerConfig: {backend: valkey}\n",
            "backend: must be one of in-memory, redis",
        ),
        (
            'tokenProcessorConfig: {hashSeed: "1", tokenizerPath: /x}\n'
            "kvEventsConfig: {dataParallelSize: 0}\n",
            "dataParallelSize: must be >= 1",
        ),
        (
            'tokenProcessorConfig: {hashSeed: "1", tokenizerPath: /x}\n'
            "kvEventsConfig: {socketPort: 65535, dataParallelSize: 2}\n",
            r"socketPort: must be within 1\.\.65534",
        ),
    ],
)
def test_bad_parameters_stop_the_load_naming_the_field(parameters: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(config(parameters))


def _index(tokenizer: Path, backend: str, *, shared: bool) -> object:
    line = f"indexerConfig: {{backend: {backend}}}\n" if backend else ""
    loaded = load(
        config(f'tokenProcessorConfig: {{hashSeed: "1", tokenizerPath: {tokenizer}}}\n' + line),
        shared=shared,
    )
    producer = loaded.plugins["precise-prefix-cache-producer"]  # type: ignore[attr-defined]
    assert isinstance(producer, PrecisePrefixCacheProducer)
    return producer.index


def test_the_index_is_shared_with_redis_url_unless_in_memory_is_asked(tokenizer: Path) -> None:
    assert isinstance(_index(tokenizer, "", shared=False), InMemoryKVBlockIndex)
    assert isinstance(_index(tokenizer, "", shared=True), SharedKVBlockIndex)
    assert isinstance(_index(tokenizer, "redis", shared=True), SharedKVBlockIndex)
    assert isinstance(_index(tokenizer, "in-memory", shared=True), InMemoryKVBlockIndex)


def test_the_redis_backend_without_redis_url_stops_the_load(tokenizer: Path) -> None:
    with pytest.raises(ConfigError, match=r"indexerConfig\.backend: redis needs --redis-url"):
        _index(tokenizer, "redis", shared=False)
