"""The llm-d router's config keys and plugin types beyond the reference's: what each does
here (applied, said once to have no effect, or refused naming why)."""

from __future__ import annotations

import logging
import textwrap

import pytest

from app.config import ConfigError, LoadedConfig, load_config
from app.config.notices import NoticeLog
from app.flowcontrol import flow_control_config
from app.plugins import build_registry
from domain.flowcontrol import DEFAULT_BAND_MAX_BYTES
from tests.support.scheduling import plugin_handle

LLMD = "apiVersion: llm-d.ai/v1\nkind: EndpointPickerConfig\n"
REFERENCE = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
SCORER = "plugins:\n- type: queue-scorer\n"


def load(text: str, notice_log: NoticeLog | None = None) -> LoadedConfig:
    return load_config(
        textwrap.dedent(text),
        registry=build_registry(include_entry_points=False),
        handle=plugin_handle(),
        notice_log=notice_log or NoticeLog(),
    )


def error(text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load(text)
    return str(caught.value)


def notices(loaded: LoadedConfig) -> list[str]:
    return [line for _, line in loaded.notices]


# -- feature gates -------------------------------------------------------------------------


def test_a_gate_may_be_turned_on_or_off_and_the_last_entry_wins() -> None:
    assert load("featureGates: [flowControl]\n").feature_gates == {"flowControl"}
    assert load("featureGates: [flowControl=true]\n").feature_gates == {"flowControl"}
    assert load("featureGates: [flowControl, flowControl=False]\n").feature_gates == set()
    assert load("featureGates: ['flowControl=0', 'flowControl=t']\n").feature_gates == {
        "flowControl"
    }


def test_a_gate_value_that_is_not_a_boolean_is_refused() -> None:
    assert error("featureGates: [flowControl=maybe]\n") == (
        'featureGates[0]: "flowControl=maybe": the value must be true or false'
    )


def test_the_llm_d_gate_for_standby_replicas_is_what_replicas_here_do() -> None:
    loaded = load("featureGates: [haPopulateNonLeaderDatastore]\n")
    assert loaded.feature_gates == set()
    assert notices(loaded) == []
    off = load("featureGates: [haPopulateNonLeaderDatastore=false]\n")
    assert notices(off) == [
        "featureGates: haPopulateNonLeaderDatastore=false: accepted and ignored: a standby "
        "replica here always discovers endpoints and collects metrics"
    ]


def test_the_reference_data_layer_gate_is_said_to_have_no_effect() -> None:
    assert notices(load("featureGates: [dataLayer]\n")) == [
        "featureGates: dataLayer: accepted and ignored: the data layer is always on here "
        "(the gate was removed from llm-d)"
    ]


# -- plugin types ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("type_name", "reason"),
    [
        ("token-producer", "is not available in this EPP: tokenization by a separate service"),
        ("program-aware-fairness", "is not available in this EPP: fairness policy not"),
        ("multicluster-queue-scorer", "is not available in this EPP: multi-cluster routing"),
        ("vllmgrpc-parser", "is not available in this EPP: the vLLM gRPC protocol"),
    ],
)
def test_an_llm_d_type_this_epp_lacks_is_refused_saying_why(type_name: str, reason: str) -> None:
    message = error(f"plugins:\n- type: queue-scorer\n- type: {type_name}\n")
    assert message.startswith(f'plugins[1].type: plugin type "{type_name}" {reason}')


def test_a_type_nobody_registers_is_unknown() -> None:
    assert error("plugins:\n- type: queue-scorrer\n") == (
        'plugins[0].type: unknown plugin type "queue-scorrer"'
    )


def test_the_p_d_headers_handler_loads_and_is_said_to_do_nothing() -> None:
    loaded = load("plugins:\n- type: queue-scorer\n- type: disagg-headers-handler\n")
    assert notices(loaded) == [
        "plugins[1] (disagg-headers-handler): accepted and ignored: disagg-profile-handler's "
        "prefill endpoint is always sent in the x-prefiller-host-port header here"
    ]


def test_a_deprecated_parameter_is_said_once_with_its_path() -> None:
    loaded = load("plugins:\n- type: active-request-scorer\n  parameters: {requestTimeout: 2m}\n")
    assert notices(loaded) == [
        "plugins[0].parameters.requestTimeout: accepted and ignored: a request counts as in "
        "flight until it ends (deprecated in the llm-d router as well)"
    ]


# -- producer names --------------------------------------------------------------------------


def test_a_named_producer_must_exist_and_produce_what_is_read() -> None:
    base = (
        "plugins:\n- type: approx-prefix-cache-producer\n  name: gpu\n- type: prefix-cache-scorer\n"
    )
    loaded = load(base + "  parameters: {prefixMatchInfoProducerName: gpu}\n")
    assert [p.typed_name.name for p in loaded.data_producers] == ["gpu"]
    assert error(base + "  parameters: {prefixMatchInfoProducerName: cpu}\n") == (
        'plugins[1]: the producer of "PrefixCacheMatchInfo" it names, "cpu", is not a plugin'
    )
    assert error(
        "plugins:\n- type: queue-scorer\n- type: prefix-cache-scorer\n"
        "  parameters: {prefixMatchInfoProducerName: queue-scorer}\n"
    ) == (
        'plugins[1]: the plugin it names as the producer of "PrefixCacheMatchInfo", '
        '"queue-scorer" (type queue-scorer), does not produce it'
    )


def test_a_second_producer_of_one_key_is_refused() -> None:
    assert error(
        "plugins:\n- type: approx-prefix-cache-producer\n  name: gpu\n"
        "- type: approx-prefix-cache-producer\n  name: cpu\n- type: prefix-cache-scorer\n"
    ) == (
        'plugins[1]: plugin "cpu" produces "PrefixCacheMatchInfo", which "gpu" produces '
        'already; this EPP keeps one "PrefixCacheMatchInfo" per endpoint, so a second '
        "producer of it (such as a second prefix-cache tier) is not available"
    )


# -- dataLayer -------------------------------------------------------------------------------

NOTIFIED = """\
plugins:
- type: queue-scorer
- type: endpoint-notification-source
- type: metrics-data-source
  name: metrics
- type: core-metrics-extractor
"""


def _sources(loaded: LoadedConfig) -> list[tuple[str, float | None]]:
    assert loaded.data_layer is not None
    return [(s.source.typed_name.name, s.interval) for s in loaded.data_layer.sources]


def test_an_llm_d_document_keeps_the_default_metrics_source_beside_the_listed_ones() -> None:
    section = "dataLayer:\n  sources:\n  - pluginRef: endpoint-notification-source\n"
    assert _sources(load(LLMD + NOTIFIED + section)) == [
        ("endpoint-notification-source", None),
        ("metrics", None),  # the configured one is reused
    ]
    # the reference's documents list every source they want
    assert _sources(load(REFERENCE + NOTIFIED + section)) == [
        ("endpoint-notification-source", None)
    ]


@pytest.mark.parametrize("header", [LLMD, REFERENCE])
def test_inject_defaults_says_it_explicitly(header: str) -> None:
    section = "dataLayer:\n  sources:\n  - pluginRef: endpoint-notification-source\n"
    off = load(header + NOTIFIED + section + "  injectDefaults: false\n")
    assert _sources(off) == [("endpoint-notification-source", None)]
    on = load(header + NOTIFIED + section + "  injectDefaults: true\n")
    assert _sources(on) == [("endpoint-notification-source", None), ("metrics", None)]


def test_a_listed_metrics_source_is_not_added_twice() -> None:
    section = "dataLayer:\n  sources:\n  - pluginRef: metrics\n    extractors:\n"
    loaded = load(LLMD + NOTIFIED + section + "    - pluginRef: core-metrics-extractor\n")
    assert _sources(loaded) == [("metrics", None)]


def test_a_source_is_polled_at_its_interval_from_either_place() -> None:
    section = "dataLayer:\n  sources:\n  - pluginRef: metrics\n"
    assert _sources(load(REFERENCE + NOTIFIED + section + "    interval: 1s\n")) == [
        ("metrics", 1.0)
    ]
    parameter = NOTIFIED.replace(
        "  name: metrics\n", "  name: metrics\n  parameters: {interval: 250ms}\n"
    )
    assert _sources(load(REFERENCE + parameter + section)) == [("metrics", 0.25)]
    # no dataLayer section: the default source is the configured one, with its interval
    assert _sources(load(REFERENCE + parameter)) == [("metrics", 0.25)]


def test_two_different_intervals_for_one_source_are_refused() -> None:
    parameter = NOTIFIED.replace(
        "  name: metrics\n", "  name: metrics\n  parameters: {interval: 250ms}\n"
    )
    section = "dataLayer:\n  sources:\n  - pluginRef: metrics\n    interval: 1s\n"
    assert error(REFERENCE + parameter + section) == (
        "dataLayer.sources[0].interval: 1s, but the source's own interval parameter is "
        "0.25s; give one of them"
    )


def test_a_notified_source_takes_no_interval() -> None:
    section = (
        "dataLayer:\n  sources:\n  - pluginRef: endpoint-notification-source\n    interval: 1s\n"
    )
    assert error(REFERENCE + NOTIFIED + section) == (
        'dataLayer.sources[0].interval: source "endpoint-notification-source" (type '
        "endpoint-notification-source) is not polled (it is notified of changes), so it "
        "takes no interval"
    )


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("discovery", "{pluginRef: files}", "endpoint discovery plugins are not implemented"),
        ("peerDiscovery", "{pluginRef: peers}", "peer discovery plugins are not implemented"),
        ("crossReplicaSyncerPluginRef", "syncer", "cross-replica syncer plugins are not"),
    ],
)
def test_data_layer_keys_naming_absent_plugin_kinds_are_refused(
    key: str, value: str, reason: str
) -> None:
    message = error(f"{SCORER}dataLayer:\n  {key}: {value}\n")
    assert message.startswith(f"dataLayer.{key}: not available in this EPP: {reason}")


def test_the_cross_replica_sync_interval_is_said_to_have_no_effect() -> None:
    loaded = load(f"{SCORER}dataLayer:\n  crossReplicaSyncInterval: 200ms\n")
    assert notices(loaded) == [
        "dataLayer.crossReplicaSyncInterval: accepted and ignored: no cross-replica syncer "
        "here; with --redis-url each request's load is shared as it is booked"
    ]


# -- flowControl -----------------------------------------------------------------------------

DETECTORS = """\
plugins:
- type: queue-scorer
- type: concurrency-detector
  parameters: {maxConcurrency: 7}
- type: utilization-detector
  name: util
"""


def test_the_nested_saturation_detector_is_used_with_or_without_the_gate() -> None:
    nested = "flowControl:\n  saturationDetector: {pluginRef: concurrency-detector}\n"
    off = load(DETECTORS + nested)
    assert off.saturation_detector is off.plugins["concurrency-detector"]
    assert off.flow_control is None
    assert notices(off) == []  # nothing but the detector: nothing is ignored
    on = load("featureGates: [flowControl]\n" + DETECTORS + nested)
    assert on.saturation_detector is on.plugins["concurrency-detector"]


def test_the_nested_saturation_detector_wins_over_the_top_level_one() -> None:
    loaded = load(
        DETECTORS
        + "saturationDetector: {pluginRef: util}\n"
        + "flowControl:\n  saturationDetector: {pluginRef: concurrency-detector}\n"
    )
    assert loaded.saturation_detector is loaded.plugins["concurrency-detector"]
    assert loaded.notices == (
        (
            logging.WARNING,
            "saturationDetector: not used: flowControl.saturationDetector is set and wins",
        ),
    )


def test_a_detector_section_without_a_plugin_means_the_default_one() -> None:
    loaded = load(SCORER + "flowControl:\n  saturationDetector: {}\n")
    assert loaded.saturation_detector.typed_name.type == "utilization-detector"


def test_a_detector_that_is_not_one_is_refused_at_its_path() -> None:
    assert error(DETECTORS + "flowControl:\n  saturationDetector: {pluginRef: queue-scorer}\n") == (
        'flowControl.saturationDetector.pluginRef: plugin "queue-scorer" (type queue-scorer) '
        "is not a saturation detector"
    )


def test_the_queueing_keys_without_the_gate_are_said_to_be_ignored() -> None:
    loaded = load(SCORER + "flowControl:\n  maxRequests: 5\n")
    assert loaded.flow_control is None
    assert loaded.notices == (
        (
            logging.WARNING,
            "flowControl: ignored, the flowControl feature gate is off (its "
            "saturationDetector is used)",
        ),
    )


def test_eviction_and_the_no_endpoint_ttl_are_said_to_have_no_effect() -> None:
    loaded = load(
        "featureGates: [flowControl]\n"
        + SCORER
        + "flowControl:\n  enableEviction: true\n  noEndpointRequestTTL: 10m\n"
        + "  defaultPriorityBand: {priority: 3}\n"
    )
    assert notices(loaded) == [
        "flowControl.defaultPriorityBand.priority: accepted and ignored: a band made from the "
        "template takes the priority of its requests",
        "flowControl.noEndpointRequestTTL: accepted and ignored: one budget here: a request "
        "waits under defaultRequestTTL whether or not the pool has endpoints",
        "flowControl.enableEviction: accepted and ignored: in-flight requests are never "
        "cancelled here to make room; a queued request of a lower priority band is displaced "
        "when a higher one does not fit",
    ]
    assert (
        notices(
            load(
                "featureGates: [flowControl]\n" + SCORER + "flowControl: {enableEviction: false}\n"
            )
        )
        == []
    )


def test_the_negative_band_template_and_band_ttls_reach_the_flow_controller() -> None:
    loaded = load(
        "featureGates: [flowControl]\n"
        + SCORER
        + """\
- type: round-robin-fairness-policy
flowControl:
  defaultRequestTTL: 60s
  defaultPriorityBand: {maxRequests: 100, defaultRequestTTL: 30s}
  defaultNegativePriorityBand: {maxRequests: 5, fairnessPolicyRef: round-robin-fairness-policy}
  priorityBands:
  - {priority: -1, defaultRequestTTL: 9000s}
  - {priority: 10}
"""
    )
    assert loaded.flow_control is not None
    config = flow_control_config(loaded.flow_control)
    assert config.default_request_ttl == 60.0
    assert config.default_priority_band.max_requests == 100
    assert config.default_priority_band.request_ttl == 30.0
    negative = config.default_negative_priority_band
    assert negative is not None
    assert (negative.max_requests, negative.max_bytes, negative.request_ttl) == (
        5,
        DEFAULT_BAND_MAX_BYTES,
        30.0,  # unset: from defaultPriorityBand
    )
    assert negative.fairness_policy_ref == "round-robin-fairness-policy"
    low, high = config.priority_bands
    # a configured band below 0 starts from the negative template, one above from the default
    assert (low.priority, low.max_requests, low.request_ttl) == (-1, 0, 9000.0)
    assert low.fairness_policy_ref == "round-robin-fairness-policy"
    assert (high.priority, high.request_ttl, high.fairness_policy_ref) == (
        10,
        30.0,
        "global-strict-fairness-policy",
    )


def test_the_negative_band_templates_policies_must_exist() -> None:
    assert error(
        SCORER + "flowControl:\n  defaultNegativePriorityBand: {orderingPolicyRef: lifo}\n"
    ) == ('flowControl.defaultNegativePriorityBand.orderingPolicyRef: no plugin named "lifo"')


# -- notices are said once -------------------------------------------------------------------


def test_a_notice_is_logged_once_per_process_not_on_every_reload(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = NoticeLog()
    text = SCORER + "dataLayer:\n  crossReplicaSyncInterval: 1s\n"
    caplog.set_level(logging.INFO, logger="app.config.notices")
    load(text, log)
    load(text, log)  # a reload with the same config
    said = [r.getMessage() for r in caplog.records if r.name == "app.config.notices"]
    assert said == [
        "config dataLayer.crossReplicaSyncInterval: accepted and ignored: no cross-replica "
        "syncer here; with --redis-url each request's load is shared as it is booked"
    ]
    load(text + "featureGates: [dataLayer]\n", log)  # a reload adding one: only it is said
    said = [r.getMessage() for r in caplog.records if r.name == "app.config.notices"]
    assert len(said) == 2
    assert said[1].startswith("config featureGates: dataLayer: accepted and ignored")
