"""Flow control: queue requests in the EPP by priority and fairness until the pool has room.

With the ``flowControl`` feature gate, admission stops being "shed sheddable requests when
saturated" and becomes ``await controller.enqueue_and_wait(request)``: the request waits
in its priority band and flow queue until the pool's saturation is below the band's
ceiling, then continues through the Director (PrepareData, Admitters, Schedule: the
endpoint is chosen late, when capacity exists).

Integration API (what the Director and the app use)
----------------------------------------------------

Build and run (app)::

    config = FlowControlConfig(          # map app.config.schema.FlowControlSpec onto this
        max_bytes=spec.max_bytes or 0,
        max_requests=spec.max_requests or 0,
        default_request_ttl=spec.default_request_ttl or 0.0,
        default_priority_band=BandConfig(...),       # unset/0 maxBytes -> DEFAULT_BAND_MAX_BYTES
        priority_bands=(PriorityBandConfig(priority=..., ...), ...),
        usage_limit_policy_plugin_ref=spec.usage_limit_policy_plugin_ref
        or DEFAULT_USAGE_LIMIT_POLICY,
    )
    controller = FlowController(
        config,
        saturation=lambda: detector.saturation(candidates()),  # () -> float, cheap
        plugins=loaded.plugins,          # policy refs are plugin names; raises ValueError
        observer=observer,               # default NoopObserver
        pool_name=pool_name,             # inference_pool label of pool_saturation
    )                                    # optional: clock=time.monotonic, timers=LoopTimers
    controller.start()
    ...
    await controller.stop()              # queued requests end RejectedOther (not running)

Per request (Director, in place of legacy admission)::

    result = await controller.enqueue_and_wait(FlowRequest(
        request_id=..., flow_key=FlowKey(fairness_id, priority), byte_size=len(body),
        received_at=<monotonic receive time>, ttl=0.0, slo_ttft_ms=<x-slo-ttft-ms or None>,
        inference_pool=..., model_name=..., target_model_name=..., payload=...,
    ))
    if result.outcome is not QueueOutcome.DISPATCHED:
        ...  # map to an error: see below

Capacity signals (caller wires them): ``controller.notify()`` whenever capacity may have
freed up: after a metrics refresh and when a request completes. Cheap; coalesced. Without
it a fallback tick still notices (within ``max_dispatch_interval``, 50 ms by default).

When nothing is queued and the pool has room, ``enqueue_and_wait`` returns Dispatched
without suspending (no task switch); a caller that loops on it must await something else
between calls. All methods must be called from the event loop's thread.

Signatures:

- ``FlowKey(id: str, priority: int)``; ``str()`` is ``"id:priority"``; sorts higher
  priority first, then id.
- ``FlowRequest(*, request_id, flow_key, byte_size=0, received_at, ttl=0.0,
  slo_ttft_ms=None, inference_pool="", model_name="", target_model_name="",
  payload=None)``.
- ``FlowResult(outcome: QueueOutcome, error: FlowControlError | None, queue_time:
  float)``; ``error`` is None exactly when dispatched.
- ``QueueOutcome``: NOT_YET_FINALIZED 0, DISPATCHED 1, REJECTED_CAPACITY 2,
  REJECTED_OTHER 3, EVICTED_TTL 4, EVICTED_CONTEXT_CANCELLED 5, EVICTED_OTHER 6; ``str()``
  is the reference's form ("Dispatched", ...).
- Errors: ``FlowControlError`` (``.reason: FlowControlReason``) with families
  ``RequestRejectedError`` ("request rejected pre-queue: <reason>") and
  ``RequestEvictedError`` ("request evicted from queue: <reason>"); reasons "queue at
  capacity", "request TTL expired", "request context cancelled", "flow controller is
  not running", ours "request displaced by higher-priority traffic" and "flow control
  internal error".
- ``FlowController(config, *, saturation, plugins=None, observer=None,
  clock=time.monotonic, timers=None, pool_name="", fairness_label_limit=1000)``;
  ``start() -> None``; ``async stop() -> None``; ``async enqueue_and_wait(request) ->
  FlowResult``; ``notify() -> None``; ``stats() -> FlowControlStats``.

Outcome → response, as the reference does it: RejectedCapacity → 429; EvictedTTL → 503
("request timed out in queue"); EvictedContextCancelled → 503 (the client is gone
anyway); RejectedOther/EvictedOther → 500. Displacement is EvictedOther with reason
``DISPLACED``; shedding-style 429 fits it better than 500 (the integrator's choice).

Cancellation: if the task awaiting ``enqueue_and_wait`` is cancelled (the gateway
dropped the stream), the request leaves its queue at once, ends EvictedContextCancelled
(counted in metrics) and ``CancelledError`` propagates; nothing about it is kept.

Policy plugins implement ``OrderingPolicy.order_key(item)`` (+ ``requires_priority_queue``),
``FairnessPolicy.new_state()``/``pick_flow(state, band: BandView)`` and
``UsageLimitPolicy.compute_limit(saturation, priorities)``.

Behaviour: see ``controller`` (dispatch, pacing, TTL, displacement, GC), ``queues``,
``interfaces`` (policy extension points) and ``plugins`` (in-tree policies:
``fcfs-ordering-policy``, ``edf-ordering-policy``, ``slo-deadline-ordering-policy``,
``global-strict-fairness-policy``, ``round-robin-fairness-policy``,
``max-min-fairness-policy``, ``static-usage-limit-policy``, ``priority-holdback-policy``).
Metrics: ``metrics``.
"""

from __future__ import annotations

from domain.flowcontrol.config import (
    DEFAULT_BAND_MAX_BYTES,
    DEFAULT_FAIRNESS_POLICY,
    DEFAULT_ORDERING_POLICY,
    DEFAULT_USAGE_LIMIT_POLICY,
    BandConfig,
    FlowControlConfig,
    PriorityBandConfig,
)
from domain.flowcontrol.controller import BandStats, FlowController, FlowControlStats
from domain.flowcontrol.interfaces import (
    BandView,
    FairnessPolicy,
    LoopTimers,
    OrderingPolicy,
    TimerHandle,
    Timers,
    UsageLimitPolicy,
)
from domain.flowcontrol.queues import FlowQueue, ListQueue, MaxMinHeap, QueueItem
from domain.flowcontrol.types import (
    ERR_EVICTED,
    ERR_REJECTED,
    FlowControlError,
    FlowControlReason,
    FlowKey,
    FlowRequest,
    FlowResult,
    QueueOutcome,
    RequestEvictedError,
    RequestRejectedError,
)

__all__ = [
    "DEFAULT_BAND_MAX_BYTES",
    "DEFAULT_FAIRNESS_POLICY",
    "DEFAULT_ORDERING_POLICY",
    "DEFAULT_USAGE_LIMIT_POLICY",
    "ERR_EVICTED",
    "ERR_REJECTED",
    "BandConfig",
    "BandStats",
    "BandView",
    "FairnessPolicy",
    "FlowControlConfig",
    "FlowControlError",
    "FlowControlReason",
    "FlowControlStats",
    "FlowController",
    "FlowKey",
    "FlowQueue",
    "FlowRequest",
    "FlowResult",
    "ListQueue",
    "LoopTimers",
    "MaxMinHeap",
    "OrderingPolicy",
    "PriorityBandConfig",
    "QueueItem",
    "QueueOutcome",
    "RequestEvictedError",
    "RequestRejectedError",
    "TimerHandle",
    "Timers",
    "UsageLimitPolicy",
]
