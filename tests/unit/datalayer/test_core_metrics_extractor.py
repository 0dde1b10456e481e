"""``core-metrics-extractor``: engine metrics from real-looking bodies → endpoint metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.config.parameters import ParameterError, validate_parameters
from domain.datalayer.interfaces import Extractor, OversizedDataError
from domain.datalayer.plugins import core_metrics_extractor
from domain.datalayer.plugins.core_metrics_extractor import (
    DEFAULT_ENGINE_LABEL_KEY,
    TYPE,
    CoreMetricsExtractor,
    CoreMetricsExtractorParameters,
    EngineConfig,
)
from domain.datastore.endpoint import Endpoint, EndpointMetrics
from domain.plugins.base import PluginRegistry
from domain.plugins.intree import IN_TREE_MODULES
from ports.datalayer import MetricsText
from tests.support.scheduling import endpoint, plugin_handle

FIXTURES = Path(__file__).parent / "fixtures"
ENGINE = DEFAULT_ENGINE_LABEL_KEY


def fixture(name: str) -> bytes:
    return (FIXTURES / f"{name}.txt").read_bytes()


def text(body: bytes | str) -> MetricsText:
    return MetricsText(body=body.encode() if isinstance(body, str) else body, fetched_at=0.0)


def extractor(parameters: dict[str, Any] | None = None) -> CoreMetricsExtractor:
    """Built the way the app builds it: YAML-shaped parameters through the registry."""
    registry = PluginRegistry()
    core_metrics_extractor.register(registry)
    validated = validate_parameters(CoreMetricsExtractorParameters, parameters)
    plugin = registry.create(TYPE, "metrics", validated, plugin_handle())
    assert isinstance(plugin, CoreMetricsExtractor)
    assert isinstance(plugin, Extractor)
    return plugin


def pod(engine: str | None = None, key: str = ENGINE) -> Endpoint:
    return endpoint("pod-a", labels={key: engine} if engine is not None else {})


def extracted(
    body: bytes | str, ep: Endpoint | None = None, params: dict[str, Any] | None = None
) -> EndpointMetrics:
    ep = ep or pod()
    extractor(params).extract(text(body), ep, 12.5)
    assert ep.metrics is not None
    return ep.metrics


VLLM_MINIMAL = (
    "# TYPE vllm:num_requests_waiting gauge\n"
    "vllm:num_requests_waiting 2\n"
    "vllm:num_requests_running 5\n"
    "vllm:kv_cache_usage_perc 0.5\n"
)


# --- each engine from its fixture ------------------------------------------------------


def test_vllm_fixture() -> None:
    assert extracted(fixture("vllm")) == EndpointMetrics(
        waiting_queue_size=3,
        running_requests_size=7,
        kv_cache_usage_percent=0.4172661870503597,
        # The newest lora_requests_info series (largest value) wins; names are trimmed,
        # empty entries dropped.
        active_models=frozenset({"sql-lora", "tweet-summary"}),
        waiting_models=frozenset({"chat-lora"}),
        max_active_models=4,
        cache_block_size=16,
        cache_num_blocks=27161,
        update_time=12.5,
    )


def test_sglang_fixture() -> None:
    assert extracted(fixture("sglang"), pod("sglang")) == EndpointMetrics(
        waiting_queue_size=2,
        running_requests_size=12,
        kv_cache_usage_percent=0.28,
        cache_block_size=64,
        cache_num_blocks=8192,
        update_time=12.5,
    )


def test_trtllm_serve_fixture() -> None:
    assert extracted(fixture("trtllm_serve"), pod("trtllm-serve")) == EndpointMetrics(
        waiting_queue_size=4,
        running_requests_size=9,
        kv_cache_usage_percent=0.6125,
        cache_block_size=32,
        cache_num_blocks=12288,
        update_time=12.5,
    )


def test_triton_tensorrt_llm_fixture() -> None:
    assert extracted(fixture("triton_trtllm"), pod("triton-tensorrt-llm")) == EndpointMetrics(
        waiting_queue_size=5,
        running_requests_size=6,
        kv_cache_usage_percent=0.25341796875,
        cache_block_size=64,
        cache_num_blocks=4096,
        update_time=12.5,
    )


# --- engine choice ---------------------------------------------------------------------


def test_engine_follows_the_pod_label() -> None:
    plugin = extractor()
    assert plugin.engine_for(pod()) == "vllm"
    assert plugin.engine_for(pod("")) == "vllm"
    assert plugin.engine_for(pod("default")) == "vllm"
    assert plugin.engine_for(pod("sglang")) == "sglang"
    # The vLLM body read as SGLang finds none of SGLang's families.
    ep = pod("sglang")
    with pytest.raises(ValueError, match='metric family "sglang:num_queue_reqs" not found'):
        plugin.extract(text(fixture("vllm")), ep, 1.0)
    assert ep.metrics is None


def test_default_engine_and_label_key_are_configurable() -> None:
    plugin = extractor({"defaultEngine": "sglang", "engineLabelKey": "example.com/engine"})
    assert plugin.engine_for(pod()) == "sglang"
    assert plugin.engine_for(pod("vllm")) == "sglang"  # not the configured key
    assert plugin.engine_for(pod("vllm", key="example.com/engine")) == "vllm"
    # Empty values mean the defaults, as in the reference.
    plugin = extractor({"defaultEngine": "", "engineLabelKey": ""})
    assert plugin.engine_for(pod("sglang")) == "sglang"
    assert plugin.engine_for(pod()) == "vllm"


def test_unknown_engine_label_is_an_error_naming_it() -> None:
    ep = pod("tgi")
    with pytest.raises(ValueError, match="no engine config for engine type 'tgi'"):
        extractor().extract(text(fixture("vllm")), ep, 1.0)
    assert ep.metrics is None


# --- configuration ---------------------------------------------------------------------


def test_engine_configs_add_engines() -> None:
    body = 'queue{kind="wait"} 8\nqueue{kind="run"} 3\nkv 0.9\n'
    params = {
        "engineConfigs": [
            {
                "name": "my-engine",
                "queuedRequestsSpec": "queue{kind=wait}",
                "runningRequestsSpec": 'queue{kind="run"}',
                "kvUsageSpec": "kv",
            }
        ]
    }
    got = extracted(body, pod("my-engine"), params)
    assert (got.waiting_queue_size, got.running_requests_size) == (8, 3)
    assert got.kv_cache_usage_percent == 0.9
    # The built-ins are still there.
    assert extracted(fixture("sglang"), pod("sglang"), params).waiting_queue_size == 2


def test_a_built_in_name_replaces_that_engines_whole_config() -> None:
    params = {
        "engineConfigs": [
            {
                "name": "vllm",
                "queuedRequestsSpec": "vllm:num_requests_running",
                "runningRequestsSpec": "vllm:num_requests_waiting",
                "cacheInfoSpec": "vllm:cache_config_info",
                "cacheBlockSizeLabelName": "num_gpu_blocks",
                "cacheNumBlocksLabelName": "swap_space",
            }
        ]
    }
    got = extracted(fixture("vllm"), params=params)
    assert (got.waiting_queue_size, got.running_requests_size) == (7, 3)
    # No kvUsageSpec and no loraSpec any more: not read.
    assert got.kv_cache_usage_percent == 0.0
    assert got.active_models == frozenset()
    assert (got.cache_block_size, got.cache_num_blocks) == (27161, 4)


@pytest.mark.parametrize(
    ("params", "path", "problem"),
    [
        ({"engineConfigs": [{"name": "default"}]}, "engineConfigs[0].name", "reserved"),
        ({"engineConfigs": [{"name": ""}]}, "engineConfigs[0].name", "must not be empty"),
        (
            {"engineConfigs": [{"name": "x"}, {"name": "x"}]},
            "engineConfigs",
            "configured twice",
        ),
        ({"defaultEngine": "tgi"}, "defaultEngine", "unknown engine 'tgi'"),
        (
            {"engineConfigs": [{"name": "x", "kvUsageSpec": "kv{a!=b}"}]},
            "engineConfigs[0].kvUsageSpec",
            "only '=' label matchers",
        ),
        (
            {"engineConfigs": [{"name": "x", "queuedRequestsSpec": "{a=b}"}]},
            "engineConfigs[0].queuedRequestsSpec",
            "metric name",
        ),
        (
            {"engineConfigs": [{"name": "x", "loraSpecs": "l"}]},
            "engineConfigs[0].loraSpecs",
            "unknown field",
        ),
    ],
)
def test_invalid_configuration(params: dict[str, Any], path: str, problem: str) -> None:
    with pytest.raises(ParameterError, match=problem) as info:
        validate_parameters(CoreMetricsExtractorParameters, params)
    assert info.value.path == path


def test_defaults_and_dataclass_validation() -> None:
    params = CoreMetricsExtractorParameters()
    assert params.engine_label_key == "inference.networking.k8s.io/engine-type"
    assert params.default_engine == "vllm"
    assert set(params.engines()) == {"vllm", "sglang", "trtllm-serve", "triton-tensorrt-llm"}
    with pytest.raises(ValueError, match="defaultEngine"):
        CoreMetricsExtractorParameters(default_engine="mine")
    mine = EngineConfig(name="mine", queued_requests_spec="q")
    assert CoreMetricsExtractorParameters(default_engine="mine", engine_configs=(mine,))


def test_registered_in_tree_and_takes_metrics_text() -> None:
    assert "domain.datalayer.plugins.core_metrics_extractor" in IN_TREE_MODULES
    plugin = extractor()
    assert plugin.expected_input_type() is MetricsText
    assert (plugin.typed_name.type, plugin.typed_name.name) == (TYPE, "metrics")


# --- series choice ---------------------------------------------------------------------


def test_series_with_the_largest_timestamp_wins() -> None:
    body = (
        "vllm:num_requests_waiting 1 1000\n"
        "vllm:num_requests_waiting 9 3000\n"
        "vllm:num_requests_waiting 4 2000\n"
        "vllm:num_requests_running 6\n"
        "vllm:num_requests_running 2\n"
        "vllm:kv_cache_usage_perc 0.5\n"
    )
    got = extracted(body)
    assert got.waiting_queue_size == 9
    assert got.running_requests_size == 6  # no timestamps: the first


def test_triton_series_are_chosen_by_label() -> None:
    body = fixture("triton_trtllm").replace(b'request_type="waiting"', b'request_type="queued"')
    with pytest.raises(ValueError, match="no series of metric family 'nv_trt_llm_request_metrics'"):
        extractor().extract(text(body), pod("triton-tensorrt-llm"), 1.0)


def test_lora_series_with_the_largest_value_wins() -> None:
    body = VLLM_MINIMAL + (
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",'
        'waiting_lora_adapters=""} 100\n'
        'vllm:lora_requests_info{max_lora="3",running_lora_adapters=" a , b ,,",'
        'waiting_lora_adapters="c"} 300\n'
        'vllm:lora_requests_info{max_lora="1",running_lora_adapters="mid",'
        'waiting_lora_adapters=""} 200 99999\n'
    )
    got = extracted(body)
    assert got.active_models == frozenset({"a", "b"})
    assert got.waiting_models == frozenset({"c"})
    assert got.max_active_models == 3


def test_old_gpu_cache_usage_metric_is_read_when_the_new_one_is_absent() -> None:
    body = VLLM_MINIMAL.replace("vllm:kv_cache_usage_perc 0.5", "vllm:gpu_cache_usage_perc 0.75")
    assert extracted(body).kv_cache_usage_percent == 0.75
    both = VLLM_MINIMAL + "vllm:gpu_cache_usage_perc 0.75\n"
    assert extracted(both).kv_cache_usage_percent == 0.5


def test_optional_metrics_may_be_missing() -> None:
    got = extracted(VLLM_MINIMAL)
    assert got == EndpointMetrics(
        waiting_queue_size=2, running_requests_size=5, kv_cache_usage_percent=0.5, update_time=12.5
    )


def test_unset_cache_info_labels_read_as_zero() -> None:
    body = VLLM_MINIMAL + 'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1\n'
    got = extracted(body)
    assert (got.cache_block_size, got.cache_num_blocks) == (16, 0)


# --- failures and freshness ------------------------------------------------------------


def test_missing_required_family_keeps_its_old_value_and_updates_the_rest() -> None:
    # Was: the old snapshot stayed whole (finding 10 of the hardening issue: the reference
    # applies the metrics it finds and reports the missing ones).
    plugin = extractor()
    ep = pod()
    plugin.extract(text(fixture("vllm")), ep, 1.0)
    old = ep.metrics
    assert old is not None
    body = VLLM_MINIMAL.replace("vllm:num_requests_waiting 2\n", "")
    with pytest.raises(ValueError, match=r'^metric family "vllm:num_requests_waiting" not found$'):
        plugin.extract(text(body), ep, 2.0)
    assert ep.metrics == EndpointMetrics(
        waiting_queue_size=old.waiting_queue_size,
        running_requests_size=5,
        kv_cache_usage_percent=0.5,
        update_time=2.0,
    )


VLLM_BODY = fixture("vllm")


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        pytest.param(
            VLLM_BODY[: VLLM_BODY.index(b"} 3.0\n") + 3],
            r"^line 42: unexpected end of input",
            id="truncated-in-a-wanted-line",
        ),
        pytest.param(VLLM_BODY[:100], "not found", id="truncated-early"),
        pytest.param(b"<html><body>502 Bad Gateway</body></html>\n", "not found", id="html"),
        pytest.param(b"\x00\x01\x02garbage", "not found", id="binary"),
        pytest.param(b"", "not found", id="empty"),
        pytest.param(
            VLLM_MINIMAL.replace("2\n", "two\n").encode(),
            "line 2: invalid value 'two'",
            id="malformed-wanted-line",
        ),
    ],
)
def test_bad_bodies_are_errors_and_keep_the_old_snapshot(body: bytes, problem: str) -> None:
    plugin = extractor()
    ep = pod()
    plugin.extract(text(VLLM_BODY), ep, 1.0)
    old = ep.metrics
    with pytest.raises(ValueError, match=problem):
        plugin.extract(text(body), ep, 2.0)
    assert ep.metrics is old


def test_malformed_unrelated_lines_are_not_read() -> None:
    body = "this is { not a metric\n" + VLLM_MINIMAL + 'unrelated{a="1} 2\n'
    assert extracted(body).waiting_queue_size == 2


def test_update_time_moves_even_when_nothing_else_changed() -> None:
    plugin = extractor()
    ep = pod()
    plugin.extract(text(fixture("vllm")), ep, 1.0)
    first = ep.metrics
    plugin.extract(text(fixture("vllm")), ep, 1.05)
    assert ep.metrics is not first
    assert ep.metrics is not None
    assert first is not None
    assert ep.metrics.update_time == 1.05
    assert ep.metrics == EndpointMetrics(
        **{**_fields(first), "update_time": 1.05},
    )


def _fields(metrics: EndpointMetrics) -> dict[str, Any]:
    return {name: getattr(metrics, name) for name in EndpointMetrics.__dataclass_fields__}


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("vllm:num_requests_waiting NaN", "vllm:num_requests_waiting is nan, not a count"),
        ("vllm:num_requests_waiting +Inf", "is inf, not a count"),
        ("vllm:num_requests_running NaN", "vllm:num_requests_running is nan"),
        ("vllm:kv_cache_usage_perc NaN", "vllm:kv_cache_usage_perc is NaN"),
    ],
)
def test_non_finite_values_are_errors(line: str, problem: str) -> None:
    name = line.split()[0]
    body = "".join(
        f"{line}\n" if existing.startswith(name + " ") else f"{existing}\n"
        for existing in VLLM_MINIMAL.splitlines()
    )
    ep = pod()
    with pytest.raises(ValueError, match=problem):
        extractor().extract(text(body), ep, 1.0)
    assert ep.metrics is None


@pytest.mark.parametrize(("value", "expected"), [("1.7", 1.0), ("-0.2", 0.0), ("+Inf", 1.0)])
def test_kv_usage_is_clamped(value: str, expected: float) -> None:
    body = VLLM_MINIMAL.replace("vllm:kv_cache_usage_perc 0.5", f"vllm:kv_cache_usage_perc {value}")
    assert extracted(body).kv_cache_usage_percent == expected


def test_counts_are_whole_and_never_negative() -> None:
    body = VLLM_MINIMAL.replace(" 2\n", " 2.9\n").replace(" 5\n", " -1\n")
    got = extracted(body)
    assert (got.waiting_queue_size, got.running_requests_size) == (2, 0)


def test_malformed_optional_values_replace_then_report() -> None:
    body = VLLM_MINIMAL + (
        'vllm:lora_requests_info{max_lora="many",running_lora_adapters="a",'
        'waiting_lora_adapters=""} 5\n'
        'vllm:cache_config_info{block_size="sixteen",num_gpu_blocks="100"} 1\n'
    )
    ep = pod()
    with pytest.raises(ValueError, match=r"max_lora='many'.*block_size='sixteen'"):
        extractor().extract(text(body), ep, 3.0)
    assert ep.metrics == EndpointMetrics(
        waiting_queue_size=2,
        running_requests_size=5,
        kv_cache_usage_percent=0.5,
        active_models=frozenset({"a"}),
        cache_num_blocks=100,
        update_time=3.0,
    )


def test_input_of_another_type_is_an_error() -> None:
    with pytest.raises(ValueError, match="expected MetricsText, got bytes"):
        extractor().extract(b"vllm:num_requests_waiting 1\n", pod(), 1.0)


# --- the bound on the series read from one body ----------------------------------------


def _many_running(series: int) -> str:
    return VLLM_MINIMAL + "".join(
        f'vllm:num_requests_running{{replica="{i}"}} 1\n' for i in range(series)
    )


def test_a_body_with_too_many_series_of_a_read_family_is_refused_whole() -> None:
    ep = pod()
    ep.metrics = EndpointMetrics(waiting_queue_size=9, update_time=1.0)
    with pytest.raises(OversizedDataError, match=r"^line 11: more than 10 series .*running"):
        extractor({"maxSeriesPerScrape": 10}).extract(text(_many_running(10)), ep, 12.5)
    assert ep.metrics.waiting_queue_size == 9  # nothing applied
    assert ep.metrics.update_time == 1.0


def test_series_up_to_the_bound_are_read() -> None:
    # 4 lines of VLLM_MINIMAL + 6 series = 10 lines of the read families
    assert extracted(_many_running(6), params={"maxSeriesPerScrape": 10}).waiting_queue_size == 2


def test_the_default_bound_leaves_room_for_real_servers() -> None:
    assert CoreMetricsExtractorParameters().max_series_per_scrape == 2048
    assert extracted(_many_running(2000)).running_requests_size == 5
    with pytest.raises(OversizedDataError):
        extracted(_many_running(2100))


def test_the_bound_must_be_positive() -> None:
    with pytest.raises(ParameterError, match="maxSeriesPerScrape"):
        extractor({"maxSeriesPerScrape": 0})
