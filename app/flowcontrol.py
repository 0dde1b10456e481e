"""Wiring flow control: the ``flowControl`` config section onto the domain's controller."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from app.config.schema import DefaultPriorityBandSpec, FlowControlSpec
from domain.flowcontrol import (
    DEFAULT_BAND_MAX_BYTES,
    DEFAULT_USAGE_LIMIT_POLICY,
    BandConfig,
    FlowControlConfig,
    FlowController,
    PriorityBandConfig,
)
from ports.observer import Observer
from ports.shared_state import SharedAdmission

__all__ = ["build_flow_controller", "flow_control_config"]


def _band(spec: DefaultPriorityBandSpec | None, template: BandConfig) -> BandConfig:
    if spec is None:
        return template
    return BandConfig(
        max_bytes=spec.max_bytes or DEFAULT_BAND_MAX_BYTES,
        max_requests=spec.max_requests or 0,
        fairness_policy_ref=spec.fairness_policy_ref or template.fairness_policy_ref,
        ordering_policy_ref=spec.ordering_policy_ref or template.ordering_policy_ref,
        request_ttl=(
            template.request_ttl if spec.default_request_ttl is None else spec.default_request_ttl
        ),
    )


def flow_control_config(spec: FlowControlSpec) -> FlowControlConfig:
    """The reference's semantics: 0 or unset means unlimited (band bytes: 1 GB); explicit
    bands take their unset policies and TTL from ``defaultPriorityBand``, or, below
    priority 0, from ``defaultNegativePriorityBand`` when it is set (llm-d's)."""
    default_band = _band(spec.default_priority_band, BandConfig())
    negative_band = (
        None
        if spec.default_negative_priority_band is None
        else _band(spec.default_negative_priority_band, default_band)
    )
    bands = []
    for band_spec in spec.priority_bands:
        template = negative_band if band_spec.priority < 0 and negative_band else default_band
        band = _band(band_spec, template)
        bands.append(
            PriorityBandConfig(
                priority=band_spec.priority,
                max_bytes=band.max_bytes,
                max_requests=band.max_requests,
                fairness_policy_ref=band.fairness_policy_ref,
                ordering_policy_ref=band.ordering_policy_ref,
                request_ttl=band.request_ttl,
            )
        )
    return FlowControlConfig(
        max_bytes=spec.max_bytes or 0,
        max_requests=spec.max_requests or 0,
        default_request_ttl=spec.default_request_ttl or 0.0,
        default_priority_band=default_band,
        default_negative_priority_band=negative_band,
        priority_bands=tuple(bands),
        usage_limit_policy_plugin_ref=spec.usage_limit_policy_plugin_ref
        or DEFAULT_USAGE_LIMIT_POLICY,
    )


def build_flow_controller(
    spec: FlowControlSpec,
    *,
    saturation: Callable[[], float],
    plugins: Mapping[str, object],
    observer: Observer,
    pool_name: str,
    pool: SharedAdmission | None = None,
) -> FlowController:
    return FlowController(
        flow_control_config(spec),
        saturation=saturation,
        plugins=plugins,
        observer=observer,
        pool_name=pool_name,
        pool=pool,
    )
