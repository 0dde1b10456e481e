"""Flow keys, outcomes, errors and the configuration dataclasses."""

from __future__ import annotations

import pytest

from domain.flowcontrol import (
    DEFAULT_BAND_MAX_BYTES,
    BandConfig,
    FlowControlConfig,
    FlowControlReason,
    FlowKey,
    FlowResult,
    PriorityBandConfig,
    QueueOutcome,
    RequestEvictedError,
    RequestRejectedError,
)


def test_flow_key_renders_id_colon_priority() -> None:
    assert str(FlowKey("tenant-a", 10)) == "tenant-a:10"
    assert str(FlowKey("default-flow", -1)) == "default-flow:-1"


def test_flow_keys_sort_higher_priority_first_then_id() -> None:
    keys = [FlowKey("b", 0), FlowKey("a", -1), FlowKey("c", 5), FlowKey("a", 0), FlowKey("z", 5)]
    assert sorted(keys) == [
        FlowKey("c", 5),
        FlowKey("z", 5),
        FlowKey("a", 0),
        FlowKey("b", 0),
        FlowKey("a", -1),
    ]
    assert FlowKey("a", 1) < FlowKey("a", 0)
    assert FlowKey("a", 0) >= FlowKey("a", 0)
    assert FlowKey("b", 0) > FlowKey("a", 0)


def test_queue_outcome_values_and_reference_labels() -> None:
    assert [(o.value, str(o)) for o in QueueOutcome] == [
        (0, "NotYetFinalized"),
        (1, "Dispatched"),
        (2, "RejectedCapacity"),
        (3, "RejectedOther"),
        (4, "EvictedTTL"),
        (5, "EvictedContextCancelled"),
        (6, "EvictedOther"),
    ]
    assert QueueOutcome.EVICTED_TTL.label == "EvictedTTL"


def test_error_messages_are_family_then_reason() -> None:
    capacity = RequestRejectedError(FlowControlReason.QUEUE_AT_CAPACITY)
    assert str(capacity) == "request rejected pre-queue: queue at capacity"
    assert capacity.reason is FlowControlReason.QUEUE_AT_CAPACITY
    assert (
        RequestEvictedError(FlowControlReason.TTL_EXPIRED).message
        == "request evicted from queue: request TTL expired"
    )
    assert (
        str(RequestEvictedError(FlowControlReason.CONTEXT_CANCELLED))
        == "request evicted from queue: request context cancelled"
    )
    assert (
        str(RequestRejectedError(FlowControlReason.NOT_RUNNING))
        == "request rejected pre-queue: flow controller is not running"
    )
    displaced = str(RequestEvictedError(FlowControlReason.DISPLACED))
    assert displaced == "request evicted from queue: request displaced by higher-priority traffic"


def test_flow_result_dispatched() -> None:
    assert FlowResult(outcome=QueueOutcome.DISPATCHED).dispatched
    assert not FlowResult(outcome=QueueOutcome.EVICTED_TTL).dispatched


def test_config_defaults_mirror_the_reference() -> None:
    config = FlowControlConfig()
    assert config.max_bytes == 0
    assert config.max_requests == 0
    assert config.default_request_ttl == 0
    assert config.default_priority_band.max_bytes == DEFAULT_BAND_MAX_BYTES == 1_000_000_000
    assert config.default_priority_band.max_requests == 0
    assert config.default_priority_band.fairness_policy_ref == "global-strict-fairness-policy"
    assert config.default_priority_band.ordering_policy_ref == "fcfs-ordering-policy"
    assert config.usage_limit_policy_plugin_ref == "static-usage-limit-policy"
    assert config.displacement is True
    assert config.dispatch_interval == 0.001
    assert config.max_dispatch_interval == 0.05
    assert config.flow_gc_timeout == 300
    assert config.band_gc_timeout == 600


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_bytes": -1}, "maxBytes"),
        ({"max_requests": -1}, "maxRequests"),
        ({"default_request_ttl": -1.0}, "defaultRequestTTL"),
        ({"dispatch_interval": 0.0}, "dispatchInterval"),
        ({"max_dispatch_per_cycle": 0}, "maxDispatchPerCycle"),
        ({"dispatch_interval": 0.01, "max_dispatch_interval": 0.005}, "maxDispatchInterval"),
        ({"flow_gc_timeout": 0.0}, "flowGCTimeout"),
        ({"band_gc_timeout": -1.0}, "bandGCTimeout"),
        ({"usage_limit_policy_plugin_ref": ""}, "usageLimitPolicyPluginRef"),
        (
            {
                "priority_bands": (
                    PriorityBandConfig(priority=1),
                    PriorityBandConfig(priority=1),
                )
            },
            r"priorityBands\[1\].priority: duplicate 1",
        ),
    ],
)
def test_config_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FlowControlConfig(**kwargs)  # type: ignore[arg-type]


def test_band_config_validation() -> None:
    with pytest.raises(ValueError, match="maxBytes"):
        BandConfig(max_bytes=-5)
    with pytest.raises(ValueError, match="maxRequests"):
        PriorityBandConfig(priority=3, max_requests=-1)
    with pytest.raises(ValueError, match="orderingPolicyRef"):
        BandConfig(ordering_policy_ref="")
