"""Loading EndpointPickerConfig YAML: shape, defaults, validation and the producer DAG."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Any

import pytest

from app.config import (
    REFERENCE_DEFAULT_CONFIG_TEXT,
    ConfigError,
    DataLayerSpec,
    FlowControlSpec,
    LoadedConfig,
    load_config,
)
from app.plugins import build_registry
from domain.plugins.base import Plugin, PluginRegistry
from domain.plugins.handle import Handle
from domain.plugins.hooks import ParameterizedPlugin
from domain.requestcontrol.parsers import ParserRouter
from tests.unit.config import (
    DetectorDouble,
    DisaggHandlerDouble,
    HandlerDouble,
    LoadParameters,
    ParserDouble,
    PickerDouble,
    PrefixParameters,
    make_handle,
    make_registry,
)

HEADER = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
"""


def load(
    text: str | None, registry: PluginRegistry | None = None, handle: Handle | None = None
) -> LoadedConfig:
    if text is not None:
        text = textwrap.dedent(text)
    return load_config(text, registry=registry or make_registry(), handle=handle or make_handle())


def error(text: str, registry: PluginRegistry | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        load(text, registry)
    return str(caught.value)


def names(plugins: object) -> list[str]:
    return [p.typed_name.name for p in plugins]  # type: ignore[attr-defined]


def scorer_weights(loaded: LoadedConfig, profile: str) -> list[tuple[str, float]]:
    return [(w.scorer.typed_name.name, w.weight) for w in loaded.profiles[profile].scorers]


# -- the spec's examples ---------------------------------------------------------------------

PREFIX_EXAMPLE = (
    HEADER
    + """\
plugins:
- type: prefix-cache-scorer
  parameters:
    blockSizeTokens: 5
    maxPrefixBlocksToMatch: 256
    lruCapacityPerServer: 31250
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-scorer
    weight: 50
"""
)

CONFORMANCE_EXAMPLE = """\
plugins:
- type: header-based-testing-filter
- type: destination-endpoint-served-verifier
schedulingProfiles:
- name: conformance-profile
  plugins:
  - pluginRef: header-based-testing-filter
"""


def test_prefix_example_is_completed_with_handler_picker_and_producer() -> None:
    loaded = load(PREFIX_EXAMPLE)
    profile = loaded.profiles["default"]
    assert list(loaded.profiles) == ["default"]
    assert scorer_weights(loaded, "default") == [("prefix-cache-scorer", 50.0)]
    assert profile.filters == ()
    assert profile.picker.typed_name.name == "max-score-picker"
    assert isinstance(loaded.profile_handler, HandlerDouble)
    assert loaded.profile_handler.typed_name.name == "single-profile-handler"
    producer = loaded.plugins["approx-prefix-cache-producer"]
    assert loaded.data_producers == [producer]
    assert isinstance(producer, ParameterizedPlugin)
    assert producer.parameters == PrefixParameters(
        block_size_tokens=5, max_prefix_blocks_to_match=256, lru_capacity_per_server=31250
    )
    assert list(loaded.plugins)[:2] == ["prefix-cache-scorer", "max-score-picker"]


def test_conformance_example() -> None:
    loaded = load(CONFORMANCE_EXAMPLE)
    profile = loaded.profiles["conformance-profile"]
    assert names(profile.filters) == ["header-based-testing-filter"]
    assert profile.scorers == ()
    assert profile.picker.typed_name.name == "max-score-picker"
    assert names(loaded.response_body) == ["destination-endpoint-served-verifier"]
    assert loaded.profile_handler.typed_name.type == "single-profile-handler"


# -- no config ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", [None, "", "  \n", "# nothing configured\n"])
def test_no_config_gives_sticky_until_saturated(text: str | None) -> None:
    loaded = load(text)
    assert list(loaded.profiles) == ["default"]
    profile = loaded.profiles["default"]
    assert names(profile.filters) == ["prefix-cache-affinity-filter", "metrics-freshness-filter"]
    assert scorer_weights(loaded, "default") == [("token-load-scorer", 1.0)]
    assert profile.picker.typed_name.name == "max-score-picker"
    assert loaded.profile_handler.typed_name.name == "single-profile-handler"
    assert isinstance(loaded.parser, ParserDouble)
    assert loaded.parser.typed_name.name == "openai-parser"
    assert isinstance(loaded.saturation_detector, DetectorDouble)
    assert names(loaded.data_producers) == [
        "approx-prefix-cache-producer",
        "inflight-load-producer",
    ]
    prefix = loaded.plugins["approx-prefix-cache-producer"]
    assert isinstance(prefix, ParameterizedPlugin)
    assert prefix.parameters == PrefixParameters(auto_tune=False)
    load_producer = loaded.plugins["inflight-load-producer"]
    assert isinstance(load_producer, ParameterizedPlugin)
    assert load_producer.parameters == LoadParameters(add_estimated_output_tokens=False)
    assert loaded.data_layer is not None
    [source] = loaded.data_layer.sources
    assert source.source.typed_name.name == "metrics-data-source"
    assert names(source.extractors) == ["core-metrics-extractor"]
    assert loaded.flow_control is None
    assert loaded.feature_gates == frozenset()
    # After scheduling, the KV-capacity gate is the last PreRequest hook.
    assert names(loaded.pre_request)[-1] == "kv-capacity-gate"


def test_the_reference_default_is_kept_as_a_config() -> None:
    loaded = load(REFERENCE_DEFAULT_CONFIG_TEXT)
    assert scorer_weights(loaded, "default") == [
        ("queue-scorer", 2.0),
        ("kv-cache-utilization-scorer", 2.0),
        ("prefix-cache-scorer", 3.0),
    ]
    assert loaded.profiles["default"].filters == ()
    assert loaded.profiles["default"].picker.typed_name.name == "max-score-picker"
    assert names(loaded.data_producers) == ["approx-prefix-cache-producer"]


def test_no_config_without_data_layer_types_has_no_data_layer() -> None:
    loaded = load(None, make_registry(data_layer=False))
    assert loaded.data_layer is None


# -- document shape and strictness --------------------------------------------------------


def test_api_version_and_kind_are_optional() -> None:
    assert list(load(CONFORMANCE_EXAMPLE).profiles) == ["conformance-profile"]


@pytest.mark.parametrize(
    "api_version", ["llm-d.ai/v1", "llm-d.ai/v1alpha1", "inference.networking.x-k8s.io/v1alpha1"]
)
def test_both_api_groups_are_accepted(api_version: str) -> None:
    text = f"apiVersion: {api_version}\nkind: EndpointPickerConfig\n" + CONFORMANCE_EXAMPLE
    assert list(load(text).profiles) == ["conformance-profile"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "apiVersion: v1\n",
            "apiVersion: must be 'llm-d.ai/v1' or 'llm-d.ai/v1alpha1' or"
            " 'inference.networking.x-k8s.io/v1alpha1', got 'v1'",
        ),
        ("kind: Config\n", "kind: must be 'EndpointPickerConfig', got 'Config'"),
        ("plugin: []\n", "plugin: unknown field"),
        (
            "data: {sources: []}\n",
            "data: unknown field (the data-layer section is called dataLayer)",
        ),
        ("plugins:\n- type: queue-scorer\n  nmae: q\n", "plugins[0].nmae: unknown field"),
        ("plugins:\n- name: q\n", "plugins[0].type: required field is missing"),
        (
            "plugins:\n- type: queue-scorer\n  parameters: [1]\n",
            "plugins[0].parameters: Input should be a valid dictionary",
        ),
        (
            "schedulingProfiles:\n- name: p\n  plugins:\n  - pluginRef: x\n    wieght: 2\n",
            "schedulingProfiles[0].plugins[0].wieght: unknown field",
        ),
        (
            "schedulingProfiles:\n- plugins: []\n",
            "schedulingProfiles[0].name: required field is missing",
        ),
        (
            "schedulingProfiles:\n- name: p\n  plugins:\n  - pluginRef: x\n    weight: heavy\n",
            "schedulingProfiles[0].plugins[0].weight: Input should be a valid number",
        ),
        ("parser: {pluginRef: p, extra: 1}\n", "parser.extra: unknown field"),
        ("saturationDetector: {plugin: d}\n", "saturationDetector.plugin: unknown field"),
        (
            "flowControl: {saturationDetector: {pluginref: d}}\n",
            "flowControl.saturationDetector.pluginref: unknown field",
        ),
        (
            "dataLayer:\n  sources:\n  - pluginRef: s\n    intervall: 1s\n",
            "dataLayer.sources[0].intervall: unknown field",
        ),
        (
            "dataLayer:\n  sources:\n  - pluginRef: s\n    interval: soon\n",
            "dataLayer.sources[0].interval: 'soon' is not a duration such as 50ms, 2s or 1m30s",
        ),
        (
            "dataLayer: {injectDefaults: yes please}\n",
            "dataLayer.injectDefaults: Input should be a valid boolean",
        ),
        (
            "flowControl: {enableEviction: 1}\n",
            "flowControl.enableEviction: Input should be a valid boolean",
        ),
        (
            "dataLayer:\n  sources:\n  - pluginRef: s\n"
            "    extractors:\n    - {pluginRef: e, x: 1}\n",
            "dataLayer.sources[0].extractors[0].x: unknown field",
        ),
        ("flowControl: {maxbytes: 1}\n", "flowControl.maxbytes: unknown field"),
        (
            "flowControl:\n  priorityBands:\n  - {priority: 1, maxBytes: 1, fairness: x}\n",
            "flowControl.priorityBands[0].fairness: unknown field",
        ),
        (
            "flowControl:\n  priorityBands:\n  - {maxBytes: 1}\n",
            "flowControl.priorityBands[0].priority: required field is missing",
        ),
        (
            "flowControl: {defaultNegativePriorityBand: {priorty: 3}}\n",
            "flowControl.defaultNegativePriorityBand.priorty: unknown field",
        ),
        ("featureGates: flowControl\n", "featureGates: Input should be a valid list"),
        ("- plugins\n", "config: must be a mapping, got list"),
    ],
)
def test_strict_decoding(text: str, message: str) -> None:
    assert error(text) == message


def test_a_repeated_key_is_refused() -> None:
    assert error("plugins: []\nplugins: []\n") == (
        "config: invalid YAML at line 2, column 1: found duplicate key 'plugins'"
    )


def test_invalid_yaml() -> None:
    assert error("plugins: [\n").startswith("config: invalid YAML at line 2, column 1: ")


def test_keys_without_values_are_empty_lists() -> None:
    loaded = load("featureGates:\nplugins:\nschedulingProfiles:\n")
    assert list(loaded.profiles) == ["default"]


# -- feature gates -----------------------------------------------------------------------


def test_known_feature_gates() -> None:
    loaded = load("featureGates: [dataLayer, enableLegacyMetrics, flowControl]\n")
    assert loaded.feature_gates == {"dataLayer", "enableLegacyMetrics", "flowControl"}


def test_unknown_feature_gate() -> None:
    assert error("featureGates: [flowControl, fastLane]\n") == (
        'featureGates[1]: unknown feature gate "fastLane" '
        "(known: dataLayer, enableLegacyMetrics, flowControl, haPopulateNonLeaderDatastore)"
    )


# -- plugins ---------------------------------------------------------------------------------


def test_plugin_name_defaults_to_type_and_plugins_reach_the_handle() -> None:
    handle = make_handle()
    loaded = load(
        """\
        plugins:
        - type: queue-scorer
        - name: second-queue
          type: queue-scorer
        """,
        handle=handle,
    )
    assert list(loaded.plugins)[:2] == ["queue-scorer", "second-queue"]
    assert loaded.plugins["second-queue"].typed_name.type == "queue-scorer"
    assert handle.plugins == loaded.plugins


def test_a_factory_finds_earlier_plugins_through_the_handle() -> None:
    loaded = load(
        """\
        plugins:
        - type: queue-scorer
        - type: peer-filter
          parameters: {peer: queue-scorer}
        """
    )
    peer = loaded.plugins["peer-filter"]
    assert peer.parameters is loaded.plugins["queue-scorer"]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "plugins:\n- type: queue-scorer\n- type: hooks\n- type: inert\n- type: bogus\n",
            'plugins[3].type: unknown plugin type "bogus"',
        ),
        (
            "plugins:\n- type: hooks\n- {name: hooks, type: inert}\n",
            'plugins[1].name: duplicate plugin name "hooks"',
        ),
        (
            "plugins:\n- {name: x, type: hooks}\n- {name: x, type: hooks}\n",
            'plugins[1].name: duplicate plugin name "x"',
        ),
        (
            "plugins:\n- type: hooks\n- type: hooks\n",
            'plugins[1].name: duplicate plugin name "hooks"',
        ),
        (
            "plugins:\n- type: hooks\n- type: inert\n"
            "- type: prefix-cache-scorer\n  parameters: {blockSizeTokens: 0}\n",
            "plugins[2].parameters.blockSizeTokens: must be > 0",
        ),
        (
            "plugins:\n- type: prefix-cache-scorer\n  parameters: {blockSize: 64}\n",
            "plugins[0].parameters.blockSize: unknown field (expected one of autoTune, "
            "blockSizeTokens, maxPrefixBlocksToMatch, lruCapacityPerServer)",
        ),
        (
            "plugins:\n- type: prefix-cache-scorer\n  parameters: {blockSizeTokens: '5'}\n",
            "plugins[0].parameters.blockSizeTokens: Input should be a valid integer",
        ),
        (
            "plugins:\n- type: hooks\n  parameters: {verbose: true}\n",
            "plugins[0].parameters.verbose: unknown field (this plugin type takes no parameters)",
        ),
        (
            "plugins:\n- type: failing\n",
            "plugins[0].parameters.peer: the backend is unreachable",
        ),
        (
            "plugins:\n- type: peer-filter\n  parameters: {peer: later}\n"
            "- {name: later, type: hooks}\n",
            'plugins[0].parameters.peer: no plugin named "later" before this one',
        ),
    ],
)
def test_plugin_errors(text: str, message: str) -> None:
    assert error(text) == message


def test_plugin_without_parameters_accepts_an_empty_mapping() -> None:
    loaded = load("plugins:\n- type: hooks\n  parameters: {}\n")
    assert "hooks" in loaded.plugins


# -- scheduling profiles -------------------------------------------------------------------


def test_profiles_in_config_order_with_filters_scorers_and_weights() -> None:
    loaded = load(
        """\
        plugins:
        - {name: f1, type: header-based-testing-filter}
        - {name: f2, type: header-based-testing-filter}
        - type: queue-scorer
        - type: kv-cache-utilization-scorer
        - type: random-picker
        - type: disagg-profile-handler
        schedulingProfiles:
        - name: prefill
          plugins:
          - pluginRef: f2
          - pluginRef: f1
            weight: 7
          - pluginRef: kv-cache-utilization-scorer
            weight: 0.5
          - pluginRef: queue-scorer
          - pluginRef: random-picker
        - name: decode
          plugins:
          - pluginRef: queue-scorer
            weight: 4
        """
    )
    assert list(loaded.profiles) == ["prefill", "decode"]
    prefill = loaded.profiles["prefill"]
    assert names(prefill.filters) == ["f2", "f1"]
    assert scorer_weights(loaded, "prefill") == [
        ("kv-cache-utilization-scorer", 0.5),
        ("queue-scorer", 1.0),
    ]
    assert prefill.picker.typed_name.name == "random-picker"
    # the first picker found is appended to a profile without one
    assert loaded.profiles["decode"].picker is prefill.picker
    assert scorer_weights(loaded, "decode") == [("queue-scorer", 4.0)]
    assert isinstance(loaded.profile_handler, DisaggHandlerDouble)
    assert "max-score-picker" not in loaded.plugins


def test_no_profiles_gives_a_default_profile_of_every_filter_scorer_and_picker() -> None:
    loaded = load(
        """\
        plugins:
        - type: queue-scorer
        - type: header-based-testing-filter
        - type: hooks
        - type: random-picker
        - type: kv-cache-utilization-scorer
        """
    )
    profile = loaded.profiles["default"]
    assert names(profile.filters) == ["header-based-testing-filter"]
    assert scorer_weights(loaded, "default") == [
        ("queue-scorer", 1.0),
        ("kv-cache-utilization-scorer", 1.0),
    ]
    assert profile.picker.typed_name.name == "random-picker"
    assert loaded.profile_handler.typed_name.name == "single-profile-handler"


def test_no_picker_anywhere_adds_max_score_picker_to_every_profile() -> None:
    loaded = load(
        """\
        plugins:
        - type: queue-scorer
        - type: single-profile-handler
        schedulingProfiles:
        - name: only
          plugins:
          - pluginRef: queue-scorer
        """
    )
    picker = loaded.profiles["only"].picker
    assert isinstance(picker, PickerDouble)
    assert picker.typed_name.name == "max-score-picker"
    assert loaded.plugins["max-score-picker"] is picker


def test_a_profile_may_reference_the_defaulted_picker() -> None:
    loaded = load(
        """\
        plugins:
        - type: queue-scorer
        schedulingProfiles:
        - name: p
          plugins:
          - pluginRef: queue-scorer
          - pluginRef: max-score-picker
        """
    )
    assert loaded.profiles["p"].picker.typed_name.name == "max-score-picker"


def test_weight_of_a_non_scorer_is_ignored() -> None:
    loaded = load(
        """\
        plugins:
        - type: header-based-testing-filter
        schedulingProfiles:
        - name: p
          plugins:
          - pluginRef: header-based-testing-filter
            weight: 3
        """
    )
    assert loaded.profiles["p"].scorers == ()
    assert names(loaded.profiles["p"].filters) == ["header-based-testing-filter"]


def test_unused_scorer_is_fine_without_profiles() -> None:
    loaded = load("plugins:\n- type: queue-scorer\n")
    assert scorer_weights(loaded, "default") == [("queue-scorer", 1.0)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            """\
            plugins:
            - type: queue-scorer
            schedulingProfiles:
            - name: p
              plugins:
              - pluginRef: queue-scorer
              - pluginRef: foo
            """,
            'schedulingProfiles[0].plugins[1].pluginRef: no plugin named "foo"',
        ),
        (
            """\
            plugins:
            - type: random-picker
            - type: max-score-picker
            schedulingProfiles:
            - name: p
              plugins:
              - pluginRef: random-picker
              - pluginRef: max-score-picker
            """,
            'schedulingProfiles[0].plugins[1].pluginRef: profile "p" already has the picker '
            '"random-picker"; only one picker is allowed',
        ),
        (
            """\
            plugins:
            - type: queue-scorer
            schedulingProfiles:
            - name: p
              plugins:
              - pluginRef: queue-scorer
              - pluginRef: queue-scorer
            """,
            'schedulingProfiles[0].plugins[1].pluginRef: plugin "queue-scorer" is already in '
            'profile "p"',
        ),
        (
            """\
            schedulingProfiles:
            - name: p
            - name: p
            """,
            'schedulingProfiles[1].name: duplicate profile name "p"',
        ),
        (
            """\
            schedulingProfiles:
            - name: ""
            """,
            "schedulingProfiles[0].name: must not be empty",
        ),
        (
            """\
            plugins:
            - type: queue-scorer
            schedulingProfiles:
            - name: p
              plugins:
              - pluginRef: queue-scorer
                weight: .nan
            """,
            "schedulingProfiles[0].plugins[0].weight: must be a finite number",
        ),
        (
            """\
            plugins:
            - type: random-picker
            - type: max-score-picker
            """,
            'plugins[1]: the default profile would get a second picker "max-score-picker" '
            '(it has "random-picker"); configure schedulingProfiles',
        ),
    ],
)
def test_profile_errors(text: str, message: str) -> None:
    assert error(text) == message


def test_a_profile_may_name_a_plugin_that_is_not_a_scheduling_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The llm-d chart's latency-predictor config lists its data producer in the profile.
    caplog.set_level("INFO")
    loaded = load(
        """\
        plugins:
        - type: hooks
        - type: queue-scorer
        schedulingProfiles:
        - name: p
          plugins:
          - pluginRef: hooks
          - pluginRef: queue-scorer
        """
    )
    assert scorer_weights(loaded, "p") == [("queue-scorer", 1.0)]
    assert not loaded.profiles["p"].filters
    assert "hooks" in names(loaded.admitters)
    assert 'plugin "hooks" (type hooks) is not a filter, scorer or picker' in caplog.text


def test_a_scorer_no_profile_uses_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    # The reference and the llm-d router accept it; the llm-d chart's latency config has some.
    loaded = load(
        """\
        plugins:
        - type: queue-scorer
        - type: kv-cache-utilization-scorer
        schedulingProfiles:
        - name: p
          plugins:
          - pluginRef: queue-scorer
        """
    )
    assert scorer_weights(loaded, "p") == [("queue-scorer", 1.0)]
    assert 'plugins[1]: scorer "kv-cache-utilization-scorer" is not used by any scheduling' in (
        caplog.text
    )


# -- profile handler -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            """\
            plugins:
            - type: single-profile-handler
            - type: hooks
            - name: pd
              type: disagg-profile-handler
            """,
            'plugins[2]: a second profile handler "pd" (the first is "single-profile-handler"); '
            "exactly one is allowed",
        ),
        (
            """\
            schedulingProfiles:
            - name: a
            - name: b
            """,
            "schedulingProfiles: 2 profiles need a profile handler; configure one in plugins",
        ),
        (
            """\
            plugins:
            - type: single-profile-handler
            schedulingProfiles:
            - name: a
            - name: b
            """,
            'plugins[0]: single-profile-handler "single-profile-handler" allows exactly one '
            "scheduling profile, the config has 2",
        ),
        (
            """\
            plugins:
            - type: disagg-profile-handler
            schedulingProfiles:
            - name: decode
            - name: prefil
            """,
            'plugins[0]: no scheduling profile named "prefill"',
        ),
    ],
)
def test_profile_handler_errors(text: str, message: str) -> None:
    assert error(text) == message


def test_configured_single_profile_handler_is_used() -> None:
    loaded = load(
        """\
        plugins:
        - name: mine
          type: single-profile-handler
        schedulingProfiles:
        - name: p
        """
    )
    assert loaded.profile_handler.typed_name.name == "mine"
    assert "single-profile-handler" not in loaded.plugins


# -- parser and saturation detector --------------------------------------------------------


def test_parser_and_saturation_detector_refs() -> None:
    loaded = load(
        """\
        plugins:
        - {name: raw, type: passthrough-parser}
        - {name: detector, type: utilization-detector}
        schedulingProfiles:
        - name: p
        parser:
          pluginRef: raw
        saturationDetector:
          pluginRef: detector
        """
    )
    assert loaded.parser is loaded.plugins["raw"]
    assert loaded.saturation_detector is loaded.plugins["detector"]
    assert "openai-parser" not in loaded.plugins
    assert "utilization-detector" not in loaded.plugins


def test_configured_default_types_are_reused() -> None:
    loaded = load(
        """\
        plugins:
        - {name: my-parser, type: openai-parser}
        - {name: my-detector, type: utilization-detector}
        schedulingProfiles:
        - name: p
        """
    )
    assert loaded.parser.typed_name.name == "my-parser"
    assert loaded.saturation_detector.typed_name.name == "my-detector"
    assert "openai-parser" not in loaded.plugins


def test_defaulted_detector_is_not_added_to_the_default_profile() -> None:
    loaded = load("plugins:\n- type: queue-scorer\n")
    assert loaded.profiles["default"].filters == ()
    assert loaded.saturation_detector is loaded.plugins["utilization-detector"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("parser: {pluginRef: nope}\n", 'parser.pluginRef: no plugin named "nope"'),
        (
            "plugins:\n- type: hooks\nparser: {pluginRef: hooks}\n",
            'parser.pluginRef: plugin "hooks" (type hooks) is not a parser',
        ),
        (
            "saturationDetector: {pluginRef: nope}\n",
            'saturationDetector.pluginRef: no plugin named "nope"',
        ),
        (
            "plugins:\n- type: queue-scorer\nsaturationDetector: {pluginRef: queue-scorer}\n",
            'saturationDetector.pluginRef: plugin "queue-scorer" (type queue-scorer) is not a '
            "saturation detector",
        ),
        (
            "plugins:\n- {name: openai-parser, type: hooks}\n",
            'plugins[0]: the name "openai-parser" is taken by a plugin of type "hooks", so the '
            'default "openai-parser" cannot be added',
        ),
    ],
)
def test_parser_and_detector_errors(text: str, message: str) -> None:
    assert error(text) == message


def test_missing_default_type_is_an_error() -> None:
    registry = PluginRegistry()
    assert error("", registry).startswith(
        'plugins[0].type: unknown plugin type "approx-prefix-cache-producer"'
    )
    assert error("plugins: []\n", registry) == (
        'schedulingProfiles: the default plugin type "max-score-picker" is not registered'
    )


# -- data producers ----------------------------------------------------------------------


def test_producers_are_sorted_by_their_dependencies() -> None:
    loaded = load(
        """\
        plugins:
        - {name: c, type: chain-producer, parameters: {produces: [C], consumes: [B]}}
        - {name: b, type: chain-producer, parameters: {produces: [B], consumes: [A]}}
        - {name: x, type: chain-producer, parameters: {produces: [X]}}
        - {name: a, type: chain-producer, parameters: {produces: [A]}}
        - {name: d, type: chain-producer, parameters: {consumes: [A, C]}}
        """
    )
    assert names(loaded.data_producers) == ["x", "a", "b", "c", "d"]
    assert names(loaded.pre_request) == ["c", "b", "x", "a", "d"]


def test_a_producer_cycle_is_an_error() -> None:
    message = error(
        """\
        plugins:
        - {name: free, type: chain-producer, parameters: {produces: [F]}}
        - {name: a, type: chain-producer, parameters: {produces: [A], consumes: [B]}}
        - {name: b, type: chain-producer, parameters: {produces: [B], consumes: [C]}}
        - {name: c, type: chain-producer, parameters: {produces: [C], consumes: [A]}}
        - {name: after, type: chain-producer, parameters: {consumes: [C]}}
        """
    )
    assert message == 'plugins: data producers form a cycle: "a" -> "b" -> "c" -> "a"'


def test_missing_producers_are_created_transitively() -> None:
    loaded = load(
        """\
        plugins:
        - {type: key-consumer, parameters: {consumes: [InFlightLoad]}}
        """
    )
    # the load producer consumes the prefix key, whose default producer is added in turn
    assert names(loaded.data_producers) == [
        "approx-prefix-cache-producer",
        "inflight-load-producer",
    ]
    assert list(loaded.plugins)[-2:] == ["inflight-load-producer", "approx-prefix-cache-producer"]
    producer = loaded.plugins["approx-prefix-cache-producer"]
    assert isinstance(producer, ParameterizedPlugin)
    assert producer.parameters == PrefixParameters()


def test_a_consumer_sharing_the_producer_parameters_passes_them_on() -> None:
    loaded = load(
        """\
        plugins:
        - type: prefix-consumer-filter
          parameters: {blockSizeTokens: 8, autoTune: false}
        """
    )
    producer = loaded.plugins["approx-prefix-cache-producer"]
    assert isinstance(producer, ParameterizedPlugin)
    assert producer.parameters == PrefixParameters(block_size_tokens=8, auto_tune=False)


def test_a_configured_producer_is_not_duplicated() -> None:
    loaded = load(
        """\
        plugins:
        - type: prefix-cache-scorer
        - name: my-producer
          type: approx-prefix-cache-producer
          parameters: {blockSizeTokens: 32}
        """
    )
    assert names(loaded.data_producers) == ["my-producer"]
    assert "approx-prefix-cache-producer" not in loaded.plugins


def test_an_unproducible_key_is_an_error() -> None:
    assert error(
        "plugins:\n- type: hooks\n- {type: key-consumer, parameters: {consumes: [Z]}}\n"
    ) == (
        'plugins[1]: plugin "key-consumer" consumes "Z", which no plugin produces and no plugin '
        "type is registered to produce"
    )


# -- request-control hooks -----------------------------------------------------------------


def test_hook_lists_follow_plugin_order() -> None:
    loaded = load(
        """\
        plugins:
        - {name: h2, type: hooks}
        - type: destination-endpoint-served-verifier
        - {name: h1, type: hooks}
        """
    )
    expected = ["h2", "destination-endpoint-served-verifier", "h1"]
    assert names(loaded.admitters) == expected
    assert names(loaded.response_header) == expected
    assert names(loaded.response_body) == expected
    assert loaded.pre_request == []


# -- data layer ------------------------------------------------------------------------------


def test_explicit_data_layer() -> None:
    loaded = load(
        """\
        plugins:
        - {name: src, type: metrics-data-source}
        - {name: ex1, type: core-metrics-extractor}
        - {name: ex2, type: other-extractor}
        - {name: bare, type: notification-source}
        dataLayer:
          sources:
          - pluginRef: src
            extractors:
            - pluginRef: ex2
            - pluginRef: ex1
          - pluginRef: bare
        """
    )
    assert loaded.data_layer is not None
    assert [s.source.typed_name.name for s in loaded.data_layer.sources] == ["src", "bare"]
    assert names(loaded.data_layer.sources[0].extractors) == ["ex2", "ex1"]
    assert loaded.data_layer.sources[1].extractors == []
    assert "metrics-data-source" not in loaded.plugins


@pytest.mark.parametrize("text", ["dataLayer:\n  sources: []\n", "dataLayer: {}\n"])
def test_empty_sources_disable_collection(text: str) -> None:
    loaded = load(text)
    assert loaded.data_layer == DataLayerSpec(sources=[])
    assert "metrics-data-source" not in loaded.plugins


def test_legacy_metrics_gate_turns_off_the_default_data_layer() -> None:
    loaded = load("featureGates: [enableLegacyMetrics]\n")
    assert loaded.data_layer is None
    assert "metrics-data-source" not in loaded.plugins


def test_default_data_layer_reuses_configured_plugins() -> None:
    loaded = load("plugins:\n- {name: mine, type: metrics-data-source}\n")
    assert loaded.data_layer is not None
    assert loaded.data_layer.sources[0].source is loaded.plugins["mine"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "dataLayer:\n  sources:\n  - pluginRef: nope\n",
            'dataLayer.sources[0].pluginRef: no plugin named "nope"',
        ),
        (
            "plugins:\n- type: metrics-data-source\n"
            "dataLayer:\n  sources:\n  - pluginRef: metrics-data-source\n"
            "    extractors:\n    - pluginRef: nope\n",
            'dataLayer.sources[0].extractors[0].pluginRef: no plugin named "nope"',
        ),
        (
            "plugins:\n- type: metrics-data-source\n- type: notification-source\n"
            "dataLayer:\n  sources:\n  - pluginRef: metrics-data-source\n"
            "    extractors:\n    - pluginRef: notification-source\n",
            'dataLayer.sources[0].extractors[0].pluginRef: extractor "notification-source" '
            '(type notification-source) cannot be fed by source "metrics-data-source" '
            "(type metrics-data-source): notification-source does not read metrics",
        ),
        (
            "plugins:\n- type: metrics-data-source\n"
            "dataLayer:\n  sources:\n  - pluginRef: metrics-data-source\n"
            "  - pluginRef: metrics-data-source\n",
            'dataLayer.sources[1].pluginRef: source "metrics-data-source" is listed twice',
        ),
    ],
)
def test_data_layer_errors(text: str, message: str) -> None:
    assert error(text) == message


# -- flow control ----------------------------------------------------------------------------

FLOW_CONTROL = """\
featureGates: [flowControl]
plugins:
- type: round-robin-fairness-policy
flowControl:
  maxBytes: 10Gi
  maxRequests: 5000
  defaultRequestTTL: 60s
  defaultPriorityBand: {maxBytes: 1Gi, maxRequests: 100,
    fairnessPolicyRef: global-strict-fairness-policy, orderingPolicyRef: fcfs-ordering-policy}
  priorityBands:
  - {priority: 100, maxBytes: 5Gi, maxRequests: 500,
     fairnessPolicyRef: round-robin-fairness-policy, orderingPolicyRef: fcfs-ordering-policy}
  - {priority: -1}
  usageLimitPolicyPluginRef: static-usage-limit-policy
"""


def test_flow_control_section_is_parsed_when_the_gate_is_on() -> None:
    loaded = load(FLOW_CONTROL)
    spec = loaded.flow_control
    assert spec is not None
    assert spec.max_bytes == 10 * 1024**3
    assert spec.max_requests == 5000
    assert spec.default_request_ttl == 60.0
    assert spec.default_priority_band is not None
    assert spec.default_priority_band.max_bytes == 1024**3
    assert spec.default_priority_band.max_requests == 100
    assert spec.default_priority_band.fairness_policy_ref == "global-strict-fairness-policy"
    assert [b.priority for b in spec.priority_bands] == [100, -1]
    assert spec.priority_bands[0].max_bytes == 5 * 1024**3
    assert spec.priority_bands[0].ordering_policy_ref == "fcfs-ordering-policy"
    assert spec.priority_bands[1].max_bytes is None
    assert spec.usage_limit_policy_plugin_ref == "static-usage-limit-policy"


def test_flow_control_is_none_without_the_gate() -> None:
    assert load(FLOW_CONTROL.replace("[flowControl]", "[]")).flow_control is None


def test_flow_control_gate_without_section_gives_the_defaults() -> None:
    assert load("featureGates: [flowControl]\n").flow_control == FlowControlSpec()


def test_policy_plugins_are_always_added_when_registered() -> None:
    loaded = load(None)
    for policy in ("fcfs-ordering-policy", "global-strict-fairness-policy"):
        assert policy in loaded.plugins
    assert "static-usage-limit-policy" in loaded.plugins
    assert "round-robin-fairness-policy" not in loaded.plugins
    unregistered = load(None, make_registry(policies=False))
    assert "fcfs-ordering-policy" not in unregistered.plugins


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "flowControl: {maxBytes: 10GB}\n",
            "flowControl.maxBytes: '10GB': unknown quantity suffix 'GB'",
        ),
        ("flowControl: {maxRequests: 1.5}\n", "flowControl.maxRequests: 1.5 is not a whole number"),
        (
            "flowControl: {defaultRequestTTL: forever}\n",
            "flowControl.defaultRequestTTL: 'forever' is not a duration such as 50ms, 2s or 1m30s",
        ),
        (
            "flowControl: {usageLimitPolicyPluginRef: nope}\n",
            'flowControl.usageLimitPolicyPluginRef: no plugin named "nope"',
        ),
        (
            "flowControl: {defaultPriorityBand: {orderingPolicyRef: edf}}\n",
            'flowControl.defaultPriorityBand.orderingPolicyRef: no plugin named "edf"',
        ),
        (
            "flowControl:\n  priorityBands:\n  - {priority: 1}\n"
            "  - {priority: 2, fairnessPolicyRef: rr}\n",
            'flowControl.priorityBands[1].fairnessPolicyRef: no plugin named "rr"',
        ),
        (
            "flowControl:\n  priorityBands:\n  - {priority: 1}\n  - {priority: 1}\n",
            "flowControl.priorityBands[1].priority: duplicate priority 1",
        ),
    ],
)
def test_flow_control_errors(text: str, message: str) -> None:
    assert error("featureGates: [flowControl]\n" + text) == message


# -- with the in-tree plugins ----------------------------------------------------------------


@dataclass(slots=True)
class RecordingRegistry(PluginRegistry):
    """Remembers the parameters each plugin was created with."""

    created: dict[str, Any] = field(default_factory=dict)

    def create(self, type_name: str, name: str, parameters: Any, handle: Handle) -> Plugin:
        self.created[name] = parameters
        return PluginRegistry.create(self, type_name, name, parameters, handle)


def in_tree_registry() -> RecordingRegistry:
    registry = RecordingRegistry()
    for_real = build_registry(include_entry_points=False)
    for type_name in for_real.types():
        spec = for_real.spec(type_name)
        registry.register(
            type_name, spec.factory, parameters=spec.parameters, default_for=spec.default_for
        )
    return registry


def test_in_tree_no_config() -> None:
    registry = in_tree_registry()
    loaded = load(None, registry)
    assert scorer_weights(loaded, "default") == [("token-load-scorer", 1.0)]
    assert [f.typed_name.type for f in loaded.profiles["default"].filters] == [
        "prefix-cache-affinity-filter",
        "metrics-freshness-filter",
    ]
    assert loaded.profiles["default"].picker.typed_name.type == "max-score-picker"
    assert loaded.profile_handler.typed_name.type == "single-profile-handler"
    assert isinstance(loaded.parser, ParserRouter)
    assert [p.typed_name.type for p in loaded.parser.parsers] == [
        "openai-parser",
        "anthropic-parser",
    ]
    assert loaded.saturation_detector.typed_name.type == "utilization-detector"
    assert names(loaded.data_producers) == [
        "approx-prefix-cache-producer",
        "inflight-load-producer",
    ]
    assert registry.created["approx-prefix-cache-producer"].auto_tune is False
    if "metrics-data-source" in registry and "core-metrics-extractor" in registry:
        assert loaded.data_layer is not None
        assert [s.source.typed_name.name for s in loaded.data_layer.sources] == [
            "metrics-data-source"
        ]
    else:
        assert loaded.data_layer is None


def test_in_tree_prefix_example_passes_the_block_size_to_the_producer() -> None:
    registry = in_tree_registry()
    loaded = load(PREFIX_EXAMPLE, registry)
    assert scorer_weights(loaded, "default") == [("prefix-cache-scorer", 50.0)]
    assert loaded.profiles["default"].picker.typed_name.type == "max-score-picker"
    assert loaded.profile_handler.typed_name.type == "single-profile-handler"
    assert names(loaded.data_producers) == ["approx-prefix-cache-producer"]
    assert registry.created["approx-prefix-cache-producer"].block_size_tokens == 5
    assert registry.created["approx-prefix-cache-producer"].lru_capacity_per_server == 31250


def test_in_tree_conformance_example() -> None:
    loaded = load(CONFORMANCE_EXAMPLE, in_tree_registry())
    profile = loaded.profiles["conformance-profile"]
    assert names(profile.filters) == ["header-based-testing-filter"]
    assert profile.picker.typed_name.type == "max-score-picker"
    assert "destination-endpoint-served-verifier" in names(
        [*loaded.pre_request, *loaded.response_header, *loaded.response_body]
    )


def test_in_tree_parameter_error_names_its_path() -> None:
    assert (
        error(
            "plugins:\n- type: queue-scorer\n- type: max-score-picker\n"
            "- type: prefix-cache-scorer\n  parameters: {blockSizeTokens: 0}\n",
            in_tree_registry(),
        )
        == "plugins[2].parameters.blockSizeTokens: must be > 0"
    )


def test_in_tree_prefill_decode() -> None:
    text = """\
        plugins:
        - type: disagg-profile-handler
        - type: prefix-cache-scorer
        - type: queue-scorer
        schedulingProfiles:
        - name: decode
          plugins:
          - pluginRef: prefix-cache-scorer
          - pluginRef: queue-scorer
        - name: prefill
          plugins:
          - pluginRef: queue-scorer
        """
    loaded = load(text, in_tree_registry())
    assert list(loaded.profiles) == ["decode", "prefill"]
    assert loaded.profile_handler.typed_name.type == "disagg-profile-handler"
    message = error(text.replace("name: prefill", "name: prefil"), in_tree_registry())
    assert message.startswith("plugins[0]: ")
    assert "'prefill'" in message


def test_in_tree_consumers_of_in_flight_load_get_its_producer() -> None:
    loaded = load(
        """\
        plugins:
        - type: concurrency-detector
        - type: token-load-scorer
        schedulingProfiles:
        - name: p
          plugins:
          - pluginRef: token-load-scorer
        saturationDetector:
          pluginRef: concurrency-detector
        """,
        in_tree_registry(),
    )
    assert loaded.saturation_detector.typed_name.type == "concurrency-detector"
    assert "inflight-load-producer" in names(loaded.data_producers)
    assert "inflight-load-producer" in names(loaded.pre_request)


HANDLERS_NEEDING_PROFILES = {"disagg-profile-handler", "pd-profile-handler"}
#: Types with required parameters (version, kind) or an API server: tested on their own.
NEEDING_PARAMETERS = {
    "k8s-notification-source",
    "utilization-filter",
    "endpoint-attribute-filter",
    "endpoint-attribute-scorer",
    "precise-prefix-cache-producer",  # tokenProcessorConfig: the engine's seed, a tokenizer
    "priority-holdback-policy",  # minCeiling
}


def test_every_in_tree_type_loads_with_its_defaults() -> None:
    registry = in_tree_registry()
    for type_name in registry.types():
        if type_name in HANDLERS_NEEDING_PROFILES or type_name in NEEDING_PARAMETERS:
            continue
        loaded = load(f"plugins:\n- type: {type_name}\n", registry)
        assert loaded.plugins[type_name].typed_name.type == type_name
