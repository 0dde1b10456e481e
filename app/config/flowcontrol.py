"""The flow-control section: its policy plugins and its references to them.

The default policy plugins are always added (when their types are registered) so a config
can name them. The section's plugin references and priorities are checked whether or not
the ``flowControl`` gate is on; only with the gate on is the section (or, without one,
the defaults) used. Its ``saturationDetector`` is the loader's (used either way); the keys
of the llm-d router that have no effect here (``noEndpointRequestTTL``,
``enableEviction``, a template band's ``priority``) are said once at start-up.
"""

from __future__ import annotations

import logging

from app.config.compatibility import ignored_reason
from app.config.errors import ConfigError
from app.config.instances import PluginInstances
from app.config.schema import FlowControlSpec

__all__ = ["FLOW_CONTROL_POLICIES", "add_policy_plugins", "check_flow_control"]

logger = logging.getLogger(__name__)

#: Flow-control policy plugins always added (when their types are registered).
FLOW_CONTROL_POLICIES = (
    "fcfs-ordering-policy",
    "global-strict-fairness-policy",
    "static-usage-limit-policy",
)


def add_policy_plugins(instances: PluginInstances) -> None:
    """Adds each of ``FLOW_CONTROL_POLICIES`` that is registered and not configured."""
    for policy in FLOW_CONTROL_POLICIES:
        if policy in instances.registry:
            instances.default(policy, "flowControl")


def check_flow_control(
    instances: PluginInstances, section: FlowControlSpec | None, gates: frozenset[str]
) -> FlowControlSpec | None:
    """The section to use (``None`` when the gate is off), after checking its references."""
    if section is not None:
        path = "flowControl"
        for key, band in (
            ("defaultPriorityBand", section.default_priority_band),
            ("defaultNegativePriorityBand", section.default_negative_priority_band),
        ):
            if band is None:
                continue
            _policy_refs(
                instances, band.fairness_policy_ref, band.ordering_policy_ref, f"{path}.{key}."
            )
            if band.priority is not None:
                instances.notices.ignored(
                    f"{path}.{key}.priority", ignored_reason(f"{path}.{key}.priority")
                )
        _ignored_keys(instances, section)
        priorities: set[int] = set()
        for index, priority_band in enumerate(section.priority_bands):
            band_path = f"{path}.priorityBands[{index}]."
            if priority_band.priority in priorities:
                raise ConfigError(
                    f"{band_path}priority: duplicate priority {priority_band.priority}"
                )
            priorities.add(priority_band.priority)
            _policy_refs(
                instances,
                priority_band.fairness_policy_ref,
                priority_band.ordering_policy_ref,
                band_path,
            )
        if section.usage_limit_policy_plugin_ref is not None:
            instances.ref(
                section.usage_limit_policy_plugin_ref, f"{path}.usageLimitPolicyPluginRef"
            )
    if "flowControl" not in gates:
        if section is not None and _queueing_keys(section):
            instances.notices.note(
                "flowControl",
                "ignored, the flowControl feature gate is off (its saturationDetector is used)",
                logging.WARNING,
            )
        return None
    return section if section is not None else FlowControlSpec()


def _queueing_keys(section: FlowControlSpec) -> bool:
    """Whether the section sets anything besides the saturation detector."""
    return bool(section.model_fields_set - {"saturation_detector"})


def _ignored_keys(instances: PluginInstances, section: FlowControlSpec) -> None:
    if section.no_endpoint_request_ttl is not None:
        instances.notices.ignored(
            "flowControl.noEndpointRequestTTL",
            ignored_reason("flowControl.noEndpointRequestTTL"),
        )
    if section.enable_eviction:
        instances.notices.ignored(
            "flowControl.enableEviction", ignored_reason("flowControl.enableEviction")
        )


def _policy_refs(
    instances: PluginInstances, fairness: str | None, ordering: str | None, prefix: str
) -> None:
    if fairness is not None:
        instances.ref(fairness, f"{prefix}fairnessPolicyRef")
    if ordering is not None:
        instances.ref(ordering, f"{prefix}orderingPolicyRef")
