"""A Director wired like the process (default config, in-tree plugins) reporting to an
``Observer`` (in tests a ``RecordingObserver``), over endpoints with metrics."""

from __future__ import annotations

import random

from adapters.jsoncodec.orjson_codec import OrjsonCodec
from adapters.xxhash.block_hasher import XxhashBlockHasher
from app.config.loader import load_config
from app.plugins import build_registry
from domain.datastore.endpoint import EndpointMetrics
from domain.datastore.objectives import ObjectiveStore
from domain.datastore.store import Datastore
from domain.plugins.handle import Handle
from domain.plugins.state import RequestStates
from domain.prefixcache.index import InMemoryPrefixIndex
from domain.requestcontrol.admission import Admission
from domain.requestcontrol.director import Director, RequestControl
from domain.scheduling.observer import SchedulingReporter
from domain.scheduling.scheduler import Scheduler
from ports.endpoints import EndpointAddress, EndpointEvent, EndpointEventKind, EndpointInfo
from ports.observer import Observer, Span
from ports.requests import InboundRequest

__all__ = ["ENDPOINTS", "inbound", "observed_director", "populated_datastore"]

ENDPOINTS = (("10.0.0.1", 8000), ("10.0.0.2", 8000), ("10.0.0.3", 8001))


def populated_datastore(now: float = 0.0) -> Datastore:
    store = Datastore()
    for i, (ip, port) in enumerate(ENDPOINTS):
        address = EndpointAddress(ip=ip, port=port)
        info = EndpointInfo(
            name=address.host_port(), address=address, pod_name=f"pod-{i}", namespace="ns"
        )
        store.apply(EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=info))
        endpoint = store.get(info.name)
        assert endpoint is not None
        endpoint.metrics = EndpointMetrics(
            waiting_queue_size=i, kv_cache_usage_percent=0.1 * i, update_time=now
        )
    store.mark_synced()
    return store


def observed_director(
    observer: Observer,
    datastore: Datastore | None = None,
    *,
    config_text: str | None = None,
    objectives: ObjectiveStore | None = None,
    admission: Admission | None = None,
) -> Director:
    codec = OrjsonCodec()
    store = datastore if datastore is not None else populated_datastore()
    handle = Handle(
        codec=codec,
        hasher=XxhashBlockHasher(),
        prefix_index=InMemoryPrefixIndex(),
        datastore=store,
        rng=random.Random(0),
        observer=observer,
    )
    loaded = load_config(
        config_text, registry=build_registry(include_entry_points=False), handle=handle
    )
    control = RequestControl(
        parser=loaded.parser,
        scheduler=Scheduler(loaded.profile_handler, loaded.profiles, SchedulingReporter(observer)),
        saturation_detector=loaded.saturation_detector,
        data_producers=loaded.data_producers,
        admitters=loaded.admitters,
        placement_claimers=loaded.placement_claimers,
        pre_request=loaded.pre_request,
        response_header=loaded.response_header,
        response_body=loaded.response_body,
        admission=admission,
    )
    return Director(
        datastore=store,
        codec=codec,
        control=control,
        objectives=objectives,
        states=RequestStates(),
        rng=random.Random(0),
        observer=observer,
    )


def inbound(
    body: bytes | None,
    *,
    request_id: str = "req-1",
    span: Span | None = None,
    headers: dict[str, str] | None = None,
) -> InboundRequest:
    return InboundRequest(
        request_id=request_id,
        headers={":path": "/v1/completions", "x-request-id": request_id, **(headers or {})},
        body=body,
        span=span,
    )
