"""precise-prefix-cache-producer owns its KV-event subscriptions: an endpoint known before
the event loop runs is followed by exactly one subscriber once the producer starts, its
events reach the index, and ``stop`` ends every subscriber (real ZMQ sockets, the
simulator's publisher)."""

from __future__ import annotations

import asyncio
import time

from adapters.kvevents import KVEventSubscriptions
from domain.datastore.store import Datastore
from domain.plugins.base import TypedName
from domain.prefixcache.engine_hash import EngineBlockHasher
from domain.prefixcache.kv_block_index import InMemoryKVBlockIndex
from domain.prefixcache.precise import PromptKeyer
from domain.requestcontrol.plugins.precise_prefix_producer import (
    TYPE,
    KVEventsConfig,
    PrecisePrefixCacheParameters,
    PrecisePrefixCacheProducer,
    TokenProcessorConfig,
)
from ports.endpoints import EndpointAddress, EndpointEvent, EndpointEventKind, EndpointInfo
from tests.integration.test_kvevents_data_parallel import CharTokenizer, stored
from tests.simulator.kvevents import KVEventPublisher
from tests.support.stack import free_port

IP = "127.0.0.63"
BLOCK = 4


def _subscribers() -> list[str]:
    return sorted(
        task.get_name()
        for task in asyncio.all_tasks()
        if task.get_name().startswith("kv-events ") and not task.done()
    )


def test_an_endpoint_known_before_the_loop_gets_one_subscriber_and_stop_ends_it() -> None:
    port = free_port()
    index = InMemoryKVBlockIndex()
    datastore = Datastore()
    params = PrecisePrefixCacheParameters(
        token_processor_config=TokenProcessorConfig(
            block_size_tokens=BLOCK, hash_seed="1", tokenizer_path="unused"
        ),
        kv_events_config=KVEventsConfig(socket_port=port),
    )
    keyer = PromptKeyer(CharTokenizer(), EngineBlockHasher(seed="1"), block_size=BLOCK)
    producer = PrecisePrefixCacheProducer(
        TypedName(TYPE, TYPE),
        params,
        keyer=keyer,
        index=index,
        feed=KVEventSubscriptions(sink=index, port=port),
        datastore=datastore,
    )
    datastore.subscribe(producer.on_endpoint_event)
    # the pool's watch reports the endpoint before the event loop runs
    info = EndpointInfo(name="pod-a", address=EndpointAddress(ip=IP, port=8000))
    datastore.apply(EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=info))
    keys = keyer.keys("abcdefgh")

    async def scenario() -> None:
        publisher = KVEventPublisher(endpoint=f"tcp://{IP}:{port}")
        publisher.start()
        try:
            await producer.start()
            assert _subscribers() == ["kv-events pod-a"]
            deadline = time.monotonic() + 5
            while index.match(keys, ["pod-a"]).get("pod-a", 0) != 2:
                assert time.monotonic() < deadline, "the endpoint's events never arrived"
                publisher.publish([stored(keys)])
                await asyncio.sleep(0.02)
            await producer.start()  # a second start changes nothing
            assert _subscribers() == ["kv-events pod-a"]
            await producer.stop()
            assert _subscribers() == []
        finally:
            await publisher.stop()

    asyncio.run(scenario())
