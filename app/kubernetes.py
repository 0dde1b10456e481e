"""Kubernetes discovery wiring: the endpoint source the flags ask for."""

from __future__ import annotations

from adapters.kubernetes import (
    EndpointSelectorSource,
    InferencePoolSource,
    TokenReviewAuthorizer,
    api_client_from_environment,
    parse_label_selector,
)
from app.settings import Settings
from ports.endpoints import EndpointSource
from ports.objectives import ObjectiveSink

__all__ = ["kubernetes_source", "metrics_authorizer"]


def kubernetes_source(settings: Settings, objectives: ObjectiveSink) -> EndpointSource:
    """``--pool-name``: the InferencePool's pods, objectives and rewrites;
    ``--endpoint-selector``: the matching pods on ``--endpoint-target-ports``."""
    api = api_client_from_environment(settings.kubeconfig)
    if settings.pool_name:
        return InferencePoolSource(
            api,
            namespace=settings.pool_namespace,
            pool_name=settings.pool_name,
            pool_group=settings.pool_group,
            objective_sink=objectives,
        )
    return EndpointSelectorSource(
        api,
        namespace=settings.pool_namespace,
        selector=parse_label_selector(settings.endpoint_selector),
        target_ports=settings.endpoint_target_ports,
    )


def metrics_authorizer(settings: Settings) -> TokenReviewAuthorizer:
    """``--metrics-endpoint-auth``: tokens reviewed by the cluster's API server."""
    return TokenReviewAuthorizer(api_client_from_environment(settings.kubeconfig))
