"""Two EPP processes' ``predicted-latency-producer`` on one real Redis (``--redis-url``): the
models one learnt are the ones a new one routes with."""

from __future__ import annotations

import time

from adapters.redis.connection import RedisClient
from adapters.redis.sessions import RedisSessionStore
from domain.datastore.endpoint import EndpointMetrics
from domain.datastore.store import Datastore
from domain.plugins.base import TypedName
from domain.requestcontrol.latency_model import SOURCE_ENDPOINT, SOURCE_HEURISTIC
from domain.requestcontrol.plugins.predicted_latency_producer import (
    TYPE,
    PredictedLatencyParameters,
    PredictedLatencyProducer,
)
from ports.endpoints import EndpointAddress, EndpointEvent, EndpointEventKind, EndpointInfo
from tests.support.scheduling import plugin_handle


def _producer(
    client: RedisClient, key_prefix: str, datastore: Datastore
) -> PredictedLatencyProducer:
    handle = plugin_handle(datastore=datastore)
    handle.sessions = RedisSessionStore(client, key_prefix=key_prefix)
    return PredictedLatencyProducer(TypedName(TYPE, TYPE), PredictedLatencyParameters(), handle)


async def test_a_new_process_adopts_what_another_learnt_on_redis(
    redis_client: RedisClient, key_prefix: str
) -> None:
    datastore = Datastore()
    info = EndpointInfo(name="pod-0", address=EndpointAddress(ip="10.0.0.1", port=8000))
    datastore.apply(EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=info))
    endpoint = datastore.get("pod-0")
    assert endpoint is not None
    endpoint.metrics = EndpointMetrics(update_time=time.monotonic())
    learnt = _producer(redis_client, key_prefix, datastore)
    for i in range(60):
        x = (1.0, 0.5 + i % 4 * 0.5, i % 5 * 1.0, 0.1, 0.0, 0.1, 0.3)
        learnt.ttft.observe("pod-0", x, 80.0 + 400.0 * x[1] + 150.0 * x[2])
    await learnt.share()

    fresh = _producer(redis_client, key_prefix, datastore)
    probe = (1.0, 1.0, 2.0, 0.1, 0.0, 0.1, 0.3)
    assert fresh.ttft.predict("pod-0", probe).source == SOURCE_HEURISTIC
    await fresh.share()
    adopted = fresh.ttft.predict("pod-0", probe)
    assert adopted.source == SOURCE_ENDPOINT
    assert adopted.value == learnt.ttft.predict("pod-0", probe).value
