"""KV-cache events from model servers over ZMQ (pyzmq), in vLLM's msgpack format (msgspec).

``decode`` turns one payload into ``ports.kv_events`` events; ``subscriber`` follows one
endpoint's publisher (sequence checks, replay, reconnects); ``subscriptions`` keeps one
subscriber per endpoint of the pool.
"""

from adapters.kvevents.decode import DecodedBatch, KVEventDecodeError, decode_batch
from adapters.kvevents.subscriber import KVEventSubscriber, SubscriberConfig, SubscriptionState
from adapters.kvevents.subscriptions import KVEventSubscriptions

__all__ = [
    "DecodedBatch",
    "KVEventDecodeError",
    "KVEventSubscriber",
    "KVEventSubscriptions",
    "SubscriberConfig",
    "SubscriptionState",
    "decode_batch",
]
