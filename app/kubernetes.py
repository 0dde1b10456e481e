"""Kubernetes discovery wiring: the endpoint source the flags ask for."""

from __future__ import annotations

import hashlib
import os
import socket
import uuid

from adapters.kubernetes import (
    EndpointSelectorSource,
    InferencePoolSource,
    LeaderElector,
    TokenReviewAuthorizer,
    api_client_from_environment,
    parse_label_selector,
)
from app.settings import Settings
from ports.endpoints import EndpointSource
from ports.objectives import ObjectiveSink

__all__ = ["kubernetes_source", "leader_elector", "lease_name", "metrics_authorizer"]


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


def lease_name(settings: Settings) -> str:
    """The reference's Lease name, ``epp-<namespace>-<pool>.gateway-api-inference-extension.
    sigs.k8s.io``; with ``--endpoint-selector``, ``selector-<hash of the selector>`` stands
    for the pool (a selector is not a valid name)."""
    pool = settings.pool_name
    if not pool:
        pool = "selector-" + hashlib.sha256(settings.endpoint_selector.encode()).hexdigest()[:10]
    return f"epp-{settings.pool_namespace}-{pool}.gateway-api-inference-extension.sigs.k8s.io"


def leader_elector(settings: Settings) -> LeaderElector:
    """``--ha-enable-leader-election``: the Lease in the pool's namespace; the identity is
    the pod's name (``POD_NAME``, else the host name) and a unique suffix, as client-go's."""
    host = os.environ.get("POD_NAME") or socket.gethostname()
    return LeaderElector(
        api_client_from_environment(settings.kubeconfig),
        namespace=settings.pool_namespace,
        name=lease_name(settings),
        identity=f"{host}_{uuid.uuid4()}",
    )
