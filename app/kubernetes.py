"""Kubernetes discovery wiring: the API client and the endpoint source for the flags."""

from __future__ import annotations

import logging
from pathlib import Path

from kubernetes import client, config

from adapters.kubernetes.pool_source import InferencePoolSource
from adapters.kubernetes.selector_source import EndpointSelectorSource
from app.settings import Settings
from ports.endpoints import EndpointSource
from ports.objectives import ObjectiveSink

__all__ = ["api_client", "kubernetes_source", "parse_selector"]

logger = logging.getLogger(__name__)


def api_client(kubeconfig: Path | None) -> client.ApiClient:
    """In-cluster configuration, else the kubeconfig file (``--kubeconfig`` or the default)."""
    if kubeconfig is not None:
        return config.new_client_from_config(config_file=str(kubeconfig))
    try:
        config.load_incluster_config()
        return client.ApiClient()
    except config.ConfigException:
        return config.new_client_from_config()


def parse_selector(text: str) -> dict[str, str]:
    selector: dict[str, str] = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        selector[key.strip()] = value.strip()
    return selector


def kubernetes_source(settings: Settings, objectives: ObjectiveSink) -> EndpointSource:
    api = api_client(settings.kubeconfig)
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
        selector=parse_selector(settings.endpoint_selector),
        target_ports=settings.endpoint_target_ports,
    )
