"""``core-metrics-extractor``: a model server's Prometheus metrics → the endpoint's metrics.

Reads the ``/metrics`` body (``MetricsText``) of one endpoint and replaces the endpoint's
``EndpointMetrics`` snapshot. Which series hold the numbers depends on the serving engine,
chosen per endpoint from its pod label ``engineLabelKey`` (missing or empty: ``defaultEngine``;
the value ``default`` also means ``defaultEngine``). Each engine config names its series
with metric specs (``name{label=value}``, see ``domain.datalayer.metric_spec``; empty = not
read):

- ``queuedRequestsSpec`` → ``waiting_queue_size``, ``runningRequestsSpec`` →
  ``running_requests_size`` (ints), ``kvUsageSpec`` → ``kv_cache_usage_percent`` (a
  fraction, clamped to [0, 1]): required when configured; among the matching series the
  one with the largest timestamp (the first when none has one) counts. A vLLM server
  without ``vllm:kv_cache_usage_perc`` is read from the older ``vllm:gpu_cache_usage_perc``.
- ``loraSpec`` (optional): the matching series with the largest value (its last-update
  time); labels ``running_lora_adapters``/``waiting_lora_adapters`` (comma-separated) →
  ``active_models``/``waiting_models``, ``max_lora`` → ``max_active_models``.
- ``cacheInfoSpec`` (optional): an info series whose labels ``cacheBlockSizeLabelName``
  (default ``block_size``) and ``cacheNumBlocksLabelName`` (default ``num_gpu_blocks``) give
  ``cache_block_size`` and ``cache_num_blocks``; ``cacheBlockSizeSpec`` /
  ``cacheNumBlocksSpec`` (optional) read them from gauges instead, and win when present.

Built-in engines: ``vllm``, ``sglang``, ``trtllm-serve`` and ``triton-tensorrt-llm``; a
configured engine with a built-in name replaces that engine's whole config. ``default`` is
reserved.

``extract`` parses only the families the endpoint's engine reads. A NaN or infinite
count, a NaN KV usage, a malformed body, or a body holding none of the engine's required
families (an error page, another engine's metrics) raises ``ValueError`` and leaves the
old snapshot in place (it then goes stale). Otherwise a new snapshot with
``update_time = now`` replaces the old one, even if no value changed, as the reference
does: a required family that is missing (``metric family "x" not found``; an older or
newer engine version) or whose series no longer match keeps its previous value (0 when
there is none), a malformed optional value (``max_lora="x"``) is read as 0, and all of
them are reported by an ``IncompleteDataError`` raised after the replacement.

A body with more than ``maxSeriesPerScrape`` (default 2,048) lines of the families the
engine reads (their series, their HELP/TYPE lines, and lines of families whose names start
with theirs) is not read at all: ``OversizedDataError``, a failed scrape that is retried
with backoff. A model server exposes a handful of such series (one per model, or per LoRA
adapter combination); parsing one costs about 8 µs on the event loop, so the bound keeps a
hostile body's parsing to about 15 ms per attempt instead of seconds. The reference has no
such bound.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from domain.datalayer.interfaces import IncompleteDataError, OversizedDataError
from domain.datalayer.metric_spec import (
    MetricSpec,
    latest_by_timestamp,
    latest_by_value,
    parse_metric_spec,
)
from domain.datalayer.prometheus_text import (
    MetricFamily,
    Sample,
    TooManyLinesError,
    parse_families,
)
from domain.datastore.endpoint import Endpoint, EndpointMetrics
from domain.plugins.base import PluginRegistry, TypedName, class_factory
from domain.plugins.hooks import TypedExtractor
from ports.datalayer import MetricsText

__all__ = [
    "BUILTIN_ENGINES",
    "DEFAULT_ENGINE",
    "DEFAULT_ENGINE_LABEL_KEY",
    "DEFAULT_MAX_SERIES_PER_SCRAPE",
    "RESERVED_ENGINE_NAME",
    "TYPE",
    "CoreMetricsExtractor",
    "CoreMetricsExtractorParameters",
    "EngineConfig",
    "register",
]

TYPE = "core-metrics-extractor"
DEFAULT_ENGINE_LABEL_KEY = "inference.networking.k8s.io/engine-type"
DEFAULT_ENGINE = "vllm"
RESERVED_ENGINE_NAME = "default"
#: The default bound on the lines of the read families in one body (see the module doc).
DEFAULT_MAX_SERIES_PER_SCRAPE = 2048

_DEFAULT_BLOCK_SIZE_LABEL: Final = "block_size"
_DEFAULT_NUM_BLOCKS_LABEL: Final = "num_gpu_blocks"
_VLLM_KV_USAGE: Final = "vllm:kv_cache_usage_perc"
_VLLM_OLD_KV_USAGE: Final = "vllm:gpu_cache_usage_perc"
_LORA_RUNNING: Final = "running_lora_adapters"
_LORA_WAITING: Final = "waiting_lora_adapters"
_LORA_MAX: Final = "max_lora"
_INT_RE: Final = re.compile(r"[+-]?[0-9]+")
# Label values that mean "not known yet" rather than a malformed number.
_UNSET_VALUES: Final = frozenset({"", "None"})


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """The metric specs of one engine type (``engineConfigs[]``). Empty specs are not read;
    empty label names mean ``block_size`` / ``num_gpu_blocks``."""

    name: str
    queued_requests_spec: str = ""
    running_requests_spec: str = ""
    kv_usage_spec: str = ""
    lora_spec: str = ""
    cache_info_spec: str = ""
    cache_block_size_label_name: str = ""
    cache_num_blocks_label_name: str = ""
    cache_block_size_spec: str = ""
    cache_num_blocks_spec: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: must not be empty")
        if self.name == RESERVED_ENGINE_NAME:
            raise ValueError(f"name: {RESERVED_ENGINE_NAME!r} is reserved")
        for key, spec in (
            ("queuedRequestsSpec", self.queued_requests_spec),
            ("runningRequestsSpec", self.running_requests_spec),
            ("kvUsageSpec", self.kv_usage_spec),
            ("loraSpec", self.lora_spec),
            ("cacheInfoSpec", self.cache_info_spec),
            ("cacheBlockSizeSpec", self.cache_block_size_spec),
            ("cacheNumBlocksSpec", self.cache_num_blocks_spec),
        ):
            try:
                parse_metric_spec(spec)
            except ValueError as exc:
                raise ValueError(f"{key}: {exc}") from None


#: The engines known without configuration, by name.
BUILTIN_ENGINES: Final[Mapping[str, EngineConfig]] = {
    config.name: config
    for config in (
        EngineConfig(
            name="vllm",
            queued_requests_spec="vllm:num_requests_waiting",
            running_requests_spec="vllm:num_requests_running",
            kv_usage_spec=_VLLM_KV_USAGE,
            lora_spec="vllm:lora_requests_info",
            cache_info_spec="vllm:cache_config_info",
        ),
        EngineConfig(
            name="sglang",
            queued_requests_spec="sglang:num_queue_reqs",
            running_requests_spec="sglang:num_running_reqs",
            kv_usage_spec="sglang:token_usage",
            cache_info_spec="sglang:cache_config_info",
            cache_block_size_label_name="page_size",
            cache_num_blocks_label_name="num_pages",
        ),
        EngineConfig(
            name="trtllm-serve",
            queued_requests_spec="trtllm_num_requests_waiting",
            running_requests_spec="trtllm_num_requests_running",
            kv_usage_spec="trtllm_kv_cache_utilization",
            cache_block_size_spec="trtllm_kv_cache_tokens_per_block",
            cache_num_blocks_spec="trtllm_kv_cache_max_blocks",
        ),
        EngineConfig(
            name="triton-tensorrt-llm",
            queued_requests_spec='nv_trt_llm_request_metrics{request_type="waiting"}',
            running_requests_spec='nv_trt_llm_request_metrics{request_type="scheduled"}',
            kv_usage_spec='nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"}',
            cache_block_size_spec=(
                'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per"}'
            ),
            cache_num_blocks_spec='nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"}',
        ),
    )
}


@dataclass(frozen=True, slots=True, kw_only=True)
class CoreMetricsExtractorParameters:
    """``engineLabelKey`` (empty: the default key), ``defaultEngine`` (empty: ``vllm``; must
    name a built-in or configured engine), ``engineConfigs`` (unique names) and
    ``maxSeriesPerScrape`` (> 0; not in the reference: see the module docstring)."""

    engine_label_key: str = DEFAULT_ENGINE_LABEL_KEY
    default_engine: str = DEFAULT_ENGINE
    engine_configs: tuple[EngineConfig, ...] = ()
    max_series_per_scrape: int = DEFAULT_MAX_SERIES_PER_SCRAPE

    def __post_init__(self) -> None:
        if self.max_series_per_scrape <= 0:
            raise ValueError("maxSeriesPerScrape: must be > 0")
        seen: set[str] = set()
        for config in self.engine_configs:
            if config.name in seen:
                raise ValueError(f"engineConfigs: engine {config.name!r} is configured twice")
            seen.add(config.name)
        engines = self.engines()
        default = self.default_engine or DEFAULT_ENGINE
        if default not in engines:
            raise ValueError(
                f"defaultEngine: unknown engine {default!r} (known: {', '.join(sorted(engines))})"
            )

    def engines(self) -> dict[str, EngineConfig]:
        """Every engine by name: the built-ins, replaced or joined by ``engineConfigs``."""
        return {**BUILTIN_ENGINES, **{config.name: config for config in self.engine_configs}}


@dataclass(frozen=True, slots=True)
class _Engine:
    """An engine config with its specs parsed and the families they read."""

    name: str
    queued: MetricSpec | None
    running: MetricSpec | None
    kv_usage: MetricSpec | None
    kv_usage_fallback: MetricSpec | None
    lora: MetricSpec | None
    cache_info: MetricSpec | None
    block_size_label: str
    num_blocks_label: str
    block_size: MetricSpec | None
    num_blocks: MetricSpec | None
    wanted: frozenset[str]

    @classmethod
    def of(cls, config: EngineConfig) -> _Engine:
        kv_usage = parse_metric_spec(config.kv_usage_spec)
        fallback = (
            MetricSpec(name=_VLLM_OLD_KV_USAGE, labels=kv_usage.labels)
            if kv_usage is not None and kv_usage.name == _VLLM_KV_USAGE
            else None
        )
        queued = parse_metric_spec(config.queued_requests_spec)
        running = parse_metric_spec(config.running_requests_spec)
        lora = parse_metric_spec(config.lora_spec)
        cache_info = parse_metric_spec(config.cache_info_spec)
        block_size = parse_metric_spec(config.cache_block_size_spec)
        num_blocks = parse_metric_spec(config.cache_num_blocks_spec)
        specs = (queued, running, kv_usage, fallback, lora, cache_info, block_size, num_blocks)
        return cls(
            name=config.name,
            queued=queued,
            running=running,
            kv_usage=kv_usage,
            kv_usage_fallback=fallback,
            lora=lora,
            cache_info=cache_info,
            block_size_label=config.cache_block_size_label_name or _DEFAULT_BLOCK_SIZE_LABEL,
            num_blocks_label=config.cache_num_blocks_label_name or _DEFAULT_NUM_BLOCKS_LABEL,
            block_size=block_size,
            num_blocks=num_blocks,
            wanted=frozenset(spec.name for spec in specs if spec is not None),
        )


class CoreMetricsExtractor(TypedExtractor):
    """Extractor of the model-server protocol metrics; see the module docstring."""

    __slots__ = ("_default", "_engines", "_label_key", "_max_series", "typed_name")

    def __init__(self, typed_name: TypedName, parameters: CoreMetricsExtractorParameters) -> None:
        self.typed_name = typed_name
        self._label_key = parameters.engine_label_key or DEFAULT_ENGINE_LABEL_KEY
        self._engines = {name: _Engine.of(config) for name, config in parameters.engines().items()}
        self._default = self._engines[parameters.default_engine or DEFAULT_ENGINE]
        self._max_series = parameters.max_series_per_scrape

    def expected_input_type(self) -> type:
        return MetricsText

    def engine_for(self, endpoint: Endpoint) -> str:
        """The engine name an endpoint's metrics are read as; ``ValueError`` if unknown."""
        return self._engine(endpoint).name

    def _engine(self, endpoint: Endpoint) -> _Engine:
        value = endpoint.info.labels.get(self._label_key)
        if not value or value == RESERVED_ENGINE_NAME:
            return self._default
        engine = self._engines.get(value)
        if engine is None:
            raise ValueError(
                f"no engine config for engine type {value!r} "
                f"(label {self._label_key!r}; known: {', '.join(sorted(self._engines))})"
            )
        return engine

    def extract(self, data: object, endpoint: Endpoint, now: float) -> None:
        if not isinstance(data, MetricsText):
            raise ValueError(f"expected MetricsText, got {type(data).__name__}")
        engine = self._engine(endpoint)
        try:
            families = parse_families(data.body, engine.wanted, max_lines=self._max_series)
        except TooManyLinesError as exc:
            raise OversizedDataError(str(exc)) from None
        previous = endpoint.metrics or _NO_METRICS

        # A required metric that is missing keeps its previous value and is reported.
        missing: list[str] = []
        found = 0
        waiting = previous.waiting_queue_size
        running = previous.running_requests_size
        kv_usage = previous.kv_cache_usage_percent
        if engine.queued is not None:
            sample = _required(families, engine.queued, missing)
            if sample is not None:
                waiting = _count(sample, engine.queued)
                found += 1
        if engine.running is not None:
            sample = _required(families, engine.running, missing)
            if sample is not None:
                running = _count(sample, engine.running)
                found += 1
        if engine.kv_usage is not None:
            kv_spec = engine.kv_usage
            fallback = engine.kv_usage_fallback
            if kv_spec.name not in families and fallback is not None and fallback.name in families:
                kv_spec = fallback
            sample = _required(families, kv_spec, missing)
            if sample is not None:
                kv_usage = _fraction(sample, kv_spec)
                found += 1
        if missing and not found:  # nothing of this engine's: not its metrics at all
            raise ValueError("; ".join(missing))

        problems: list[str] = missing
        active: frozenset[str] = frozenset()
        queued_models: frozenset[str] = frozenset()
        max_active = 0
        if engine.lora is not None and (family := families.get(engine.lora.name)) is not None:
            lora = latest_by_value(engine.lora, family.samples)
            if lora is not None:
                active = _adapters(lora.labels.get(_LORA_RUNNING, ""))
                queued_models = _adapters(lora.labels.get(_LORA_WAITING, ""))
                max_active = _label_int(lora, _LORA_MAX, problems)

        block_size = num_blocks = 0
        if engine.cache_info is not None:
            info = _optional(families, engine.cache_info)
            if info is not None:
                block_size = _label_int(info, engine.block_size_label, problems)
                num_blocks = _label_int(info, engine.num_blocks_label, problems)
        if engine.block_size is not None:
            sample = _optional(families, engine.block_size)
            if sample is not None:
                block_size = _gauge_int(sample, engine.block_size, problems)
        if engine.num_blocks is not None:
            sample = _optional(families, engine.num_blocks)
            if sample is not None:
                num_blocks = _gauge_int(sample, engine.num_blocks, problems)

        endpoint.metrics = EndpointMetrics(
            waiting_queue_size=waiting,
            running_requests_size=running,
            kv_cache_usage_percent=kv_usage,
            active_models=active,
            waiting_models=queued_models,
            max_active_models=max_active,
            cache_block_size=block_size,
            cache_num_blocks=num_blocks,
            update_time=now,
        )
        if problems:
            raise IncompleteDataError("; ".join(problems))


_NO_METRICS = EndpointMetrics()


def _required(
    families: Mapping[str, MetricFamily], spec: MetricSpec, missing: list[str]
) -> Sample | None:
    """The sample ``spec`` reads, or None with the reason added to ``missing``."""
    family = families.get(spec.name)
    if family is None:
        missing.append(f'metric family "{spec.name}" not found')
        return None
    sample = latest_by_timestamp(spec, family.samples)
    if sample is None:
        missing.append(f"no series of metric family {spec.name!r} matches {spec}")
    return sample


def _optional(families: Mapping[str, MetricFamily], spec: MetricSpec) -> Sample | None:
    family = families.get(spec.name)
    return None if family is None else latest_by_timestamp(spec, family.samples)


def _count(sample: Sample, spec: MetricSpec) -> int:
    value = sample.value
    if not math.isfinite(value):
        raise ValueError(f"{spec} is {value}, not a count")
    return int(value) if value > 0 else 0


def _fraction(sample: Sample, spec: MetricSpec) -> float:
    value = sample.value
    if math.isnan(value):
        raise ValueError(f"{spec} is NaN, not a fraction")
    return 0.0 if value < 0.0 else 1.0 if value > 1.0 else value


def _adapters(listed: str) -> frozenset[str]:
    if not listed:
        return frozenset()
    return frozenset(name for part in listed.split(",") if (name := part.strip()))


def _label_int(sample: Sample, label: str, problems: list[str]) -> int:
    """A non-negative integer label; absent, empty or ``None`` is 0, anything else that is
    not such an integer is 0 and a problem."""
    raw = sample.labels.get(label, "")
    if raw in _UNSET_VALUES:
        return 0
    if _INT_RE.fullmatch(raw) is None or int(raw) < 0:
        problems.append(f"label {label}={raw!r} of {sample.name!r} is not a non-negative integer")
        return 0
    return int(raw)


def _gauge_int(sample: Sample, spec: MetricSpec, problems: list[str]) -> int:
    value = sample.value
    if not math.isfinite(value) or value < 0:
        problems.append(f"{spec} is {value}, not a non-negative number")
        return 0
    return int(value)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, CoreMetricsExtractor),
        parameters=CoreMetricsExtractorParameters,
        description="endpoint metrics from vLLM, SGLang and TensorRT-LLM Prometheus metrics",
    )
