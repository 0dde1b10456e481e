"""The EndpointPickerConfig YAML, as strict pydantic models.

Field aliases are the reference's JSON keys (camelCase). Decoding is strict: an unknown key
at any level is refused, and values are not coerced between types (``"5"`` is not a number).
Plugin ``parameters`` stay a raw mapping here; they are validated later against the
plugin type's parameters dataclass (``app.config.parameters``).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from app.config.parameters import parse_duration_value, parse_quantity_value

__all__ = [
    "API_VERSION",
    "API_VERSIONS",
    "KIND",
    "LLMD_API_VERSION",
    "LLMD_API_VERSION_V1",
    "DataLayerSection",
    "DataSourceSpec",
    "DefaultPriorityBandSpec",
    "EndpointPickerConfigSpec",
    "ExtractorSpec",
    "FlowControlSpec",
    "PluginEntry",
    "PluginRefSpec",
    "PriorityBandSpec",
    "ProfilePluginRef",
    "RequestHandlerSection",
    "SaturationDetectorSpec",
    "SchedulingProfileSpec",
]

API_VERSION = "inference.networking.x-k8s.io/v1alpha1"
#: The group the llm-d router moved EndpointPickerConfig to in 2026 (accepted as well).
LLMD_API_VERSION = "llm-d.ai/v1alpha1"
#: The version the llm-d guides write since the configuration API graduated (same schema).
LLMD_API_VERSION_V1 = "llm-d.ai/v1"
API_VERSIONS = (LLMD_API_VERSION_V1, LLMD_API_VERSION, API_VERSION)
KIND = "EndpointPickerConfig"

#: A non-negative whole Kubernetes quantity (``10Gi``, ``5000``).
QuantityValue = Annotated[int, BeforeValidator(parse_quantity_value)]
#: A Go duration (``60s``) or a number of seconds; the value is seconds.
DurationValue = Annotated[float, BeforeValidator(parse_duration_value)]


def _empty_if_null(value: object) -> object:
    """A YAML key with no value (``plugins:``) is an empty list, as in the reference."""
    return [] if value is None else value


_OrEmpty = BeforeValidator(_empty_if_null)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=False, frozen=True)


class PluginEntry(_Strict):
    """One ``plugins[]`` item. ``name`` defaults to ``type``."""

    name: str | None = None
    type: str
    parameters: dict[str, Any] | None = None


class ProfilePluginRef(_Strict):
    """One plugin of a scheduling profile. ``weight`` matters for scorers only (default 1)."""

    plugin_ref: str = Field(alias="pluginRef")
    weight: float | None = None


class SchedulingProfileSpec(_Strict):
    name: str
    plugins: Annotated[list[ProfilePluginRef], _OrEmpty] = Field(default_factory=list)


class PluginRefSpec(_Strict):
    """A section that names one plugin (``parser``, ``requestHandler.parsers[]``)."""

    plugin_ref: str = Field(alias="pluginRef")


class SaturationDetectorSpec(_Strict):
    """``saturationDetector`` (top level or in ``flowControl``): the detector plugin; no
    ``pluginRef`` means the default, ``utilization-detector``."""

    plugin_ref: str | None = Field(default=None, alias="pluginRef")


class RequestHandlerSection(_Strict):
    """``requestHandler``: the parsers, in the order their path claims are tried."""

    parsers: Annotated[list[PluginRefSpec], _OrEmpty] = Field(default_factory=list)


class ExtractorSpec(_Strict):
    plugin_ref: str = Field(alias="pluginRef")


class DataSourceSpec(_Strict):
    """One source. ``interval``: how often a polling source is polled (seconds; unset: the
    source's own ``interval`` parameter, else every ``--refresh-metrics-interval``)."""

    plugin_ref: str = Field(alias="pluginRef")
    extractors: Annotated[list[ExtractorSpec], _OrEmpty] = Field(default_factory=list)
    interval: DurationValue | None = None


class DataLayerSection(_Strict):
    """``dataLayer``: the sources to poll and, per source, the extractors it feeds.

    ``injectDefaults`` (unset: see ``app.config.datalayer``) adds the default metrics source
    beside the listed ones; with no source at all, metric collection is off. ``discovery``,
    ``peerDiscovery`` and ``crossReplicaSyncerPluginRef`` name llm-d router plugin kinds
    this EPP does not have (the loader refuses them, saying why);
    ``crossReplicaSyncInterval`` is accepted and has no effect.
    """

    inject_defaults: bool | None = Field(default=None, alias="injectDefaults")
    sources: Annotated[list[DataSourceSpec], _OrEmpty] = Field(default_factory=list)
    discovery: dict[str, Any] | None = None
    peer_discovery: dict[str, Any] | None = Field(default=None, alias="peerDiscovery")
    cross_replica_syncer_plugin_ref: str | None = Field(
        default=None, alias="crossReplicaSyncerPluginRef"
    )
    cross_replica_sync_interval: DurationValue | None = Field(
        default=None, alias="crossReplicaSyncInterval"
    )


class DefaultPriorityBandSpec(_Strict):
    """The template for priority bands created on demand. Unset values: the flow-control
    defaults (1 GB per band, unlimited requests, the default policies, the section's
    ``defaultRequestTTL``). ``priority`` is accepted (the schema shares it with a
    configured band) and has no effect on a template."""

    priority: int | None = None
    max_bytes: QuantityValue | None = Field(default=None, alias="maxBytes")
    max_requests: QuantityValue | None = Field(default=None, alias="maxRequests")
    fairness_policy_ref: str | None = Field(default=None, alias="fairnessPolicyRef")
    ordering_policy_ref: str | None = Field(default=None, alias="orderingPolicyRef")
    default_request_ttl: DurationValue | None = Field(default=None, alias="defaultRequestTTL")


class PriorityBandSpec(DefaultPriorityBandSpec):
    """One configured priority band (higher ``priority`` is served first)."""

    priority: int


class FlowControlSpec(_Strict):
    """``flowControl``: global capacity, request TTL, priority bands and the saturation
    detector.

    ``max_bytes``/``max_requests`` 0 or unset mean unlimited; ``default_request_ttl`` 0 or
    unset means a request waits until its client gives up. ``default_negative_priority_band``
    is the template for bands below priority 0 (unset: ``default_priority_band``).
    ``saturation_detector`` applies whether or not the ``flowControl`` gate is on, and wins
    over the top-level one. ``no_endpoint_request_ttl`` and ``enable_eviction`` are accepted
    and have no effect here (the loader says so at start-up).
    """

    max_bytes: QuantityValue | None = Field(default=None, alias="maxBytes")
    max_requests: QuantityValue | None = Field(default=None, alias="maxRequests")
    default_request_ttl: DurationValue | None = Field(default=None, alias="defaultRequestTTL")
    no_endpoint_request_ttl: DurationValue | None = Field(
        default=None, alias="noEndpointRequestTTL"
    )
    default_priority_band: DefaultPriorityBandSpec | None = Field(
        default=None, alias="defaultPriorityBand"
    )
    default_negative_priority_band: DefaultPriorityBandSpec | None = Field(
        default=None, alias="defaultNegativePriorityBand"
    )
    priority_bands: Annotated[list[PriorityBandSpec], _OrEmpty] = Field(
        default_factory=list, alias="priorityBands"
    )
    usage_limit_policy_plugin_ref: str | None = Field(
        default=None, alias="usageLimitPolicyPluginRef"
    )
    saturation_detector: SaturationDetectorSpec | None = Field(
        default=None, alias="saturationDetector"
    )
    enable_eviction: bool | None = Field(default=None, alias="enableEviction")


class EndpointPickerConfigSpec(_Strict):
    """The whole document. ``apiVersion``/``kind`` may be left out; when given they must be
    the reference's or the llm-d router's (``apiVersion`` ``llm-d.ai/v1``,
    ``llm-d.ai/v1alpha1`` or the older ``inference.networking.x-k8s.io/v1alpha1``: one
    schema). ``featureGates`` entries are ``name``, ``name=true`` or ``name=false``."""

    api_version: str | None = Field(default=None, alias="apiVersion")
    kind: str | None = None
    feature_gates: Annotated[list[str], _OrEmpty] = Field(
        default_factory=list, alias="featureGates"
    )
    plugins: Annotated[list[PluginEntry], _OrEmpty] = Field(default_factory=list)
    scheduling_profiles: Annotated[list[SchedulingProfileSpec], _OrEmpty] = Field(
        default_factory=list, alias="schedulingProfiles"
    )
    saturation_detector: SaturationDetectorSpec | None = Field(
        default=None, alias="saturationDetector"
    )
    data_layer: DataLayerSection | None = Field(default=None, alias="dataLayer")
    flow_control: FlowControlSpec | None = Field(default=None, alias="flowControl")
    parser: PluginRefSpec | None = None
    request_handler: RequestHandlerSection | None = Field(default=None, alias="requestHandler")

    @field_validator("api_version")
    @classmethod
    def _check_api_version(cls, value: str | None) -> str | None:
        if value is not None and value not in API_VERSIONS:
            allowed = " or ".join(repr(v) for v in API_VERSIONS)
            raise ValueError(f"must be {allowed}, got {value!r}")
        return value

    @field_validator("kind")
    @classmethod
    def _check_kind(cls, value: str | None) -> str | None:
        if value is not None and value != KIND:
            raise ValueError(f"must be {KIND!r}, got {value!r}")
        return value
