"""The in-tree plugin types, registered into a registry by ``register_in_tree``.

Each module below defines one plugin and a ``register(registry)`` function.
"""

from __future__ import annotations

import importlib

from domain.plugins.base import PluginRegistry

__all__ = ["IN_TREE_MODULES", "register_in_tree"]

IN_TREE_MODULES = (
    # scheduling
    "domain.scheduling.plugins.max_score_picker",
    "domain.scheduling.plugins.random_picker",
    "domain.scheduling.plugins.weighted_random_picker",
    "domain.scheduling.plugins.single_profile_handler",
    "domain.scheduling.plugins.pd_decider",
    "domain.scheduling.plugins.disagg_profile_handler",
    "domain.scheduling.plugins.disagg_headers_handler",
    "domain.scheduling.plugins.queue_scorer",
    "domain.scheduling.plugins.running_requests_scorer",
    "domain.scheduling.plugins.kv_cache_scorer",
    "domain.scheduling.plugins.lora_affinity_scorer",
    "domain.scheduling.plugins.token_load_scorer",
    "domain.scheduling.plugins.active_request_scorer",
    "domain.scheduling.plugins.header_filter",
    "domain.scheduling.plugins.role_filter",
    "domain.scheduling.plugins.prefix_cache_scorer",
    "domain.scheduling.plugins.prefix_affinity_filter",
    "domain.scheduling.plugins.metrics_freshness_filter",
    "domain.scheduling.plugins.utilization_filter",
    "domain.scheduling.plugins.no_hit_lru_scorer",
    "domain.scheduling.plugins.endpoint_attribute_filter",
    "domain.scheduling.plugins.endpoint_attribute_scorer",
    "domain.scheduling.plugins.header_profile_handler",
    "domain.scheduling.plugins.session_affinity_filter",
    "domain.scheduling.plugins.session_affinity_scorer",
    "domain.scheduling.plugins.latency_scorer",
    "domain.scheduling.plugins.slo_headroom_tier_filter",
    # request control
    "domain.requestcontrol.plugins.prefix_producer",
    "domain.requestcontrol.plugins.inflight_load",
    "domain.requestcontrol.plugins.kv_capacity_gate",
    "domain.requestcontrol.plugins.utilization_detector",
    "domain.requestcontrol.plugins.concurrency_detector",
    "domain.requestcontrol.plugins.standing_queue_detector",
    "domain.requestcontrol.plugins.served_verifier",
    "domain.requestcontrol.plugins.openai_parser",
    "domain.requestcontrol.plugins.passthrough_parser",
    "domain.requestcontrol.plugins.anthropic_parser",
    "domain.requestcontrol.plugins.predicted_latency_producer",
    "domain.requestcontrol.plugins.latency_slo_admitter",
    # data layer
    "domain.datalayer.plugins.core_metrics_extractor",
    "domain.datalayer.plugins.endpoint_notification_source",
    # flow control
    "domain.flowcontrol.plugins.fcfs_ordering",
    "domain.flowcontrol.plugins.edf_ordering",
    "domain.flowcontrol.plugins.slo_deadline_ordering",
    "domain.flowcontrol.plugins.global_strict_fairness",
    "domain.flowcontrol.plugins.round_robin_fairness",
    "domain.flowcontrol.plugins.max_min_fairness",
    "domain.flowcontrol.plugins.static_usage_limit",
    "domain.flowcontrol.plugins.priority_holdback",
)


def register_in_tree(registry: PluginRegistry) -> None:
    for module_name in IN_TREE_MODULES:
        module = importlib.import_module(module_name)
        module.register(registry)
