"""The flow-control section: its policy plugins and its references to them.

The default policy plugins are always added (when their types are registered) so a config
can name them. The section's plugin references and priorities are checked whether or not
the ``flowControl`` gate is on; only with the gate on is the section (or, without one,
the defaults) used.
"""

from __future__ import annotations

import logging

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
        band = section.default_priority_band
        if band is not None:
            _policy_refs(
                instances,
                band.fairness_policy_ref,
                band.ordering_policy_ref,
                f"{path}.defaultPriorityBand.",
            )
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
        if section is not None:
            logger.warning("flowControl: ignored, the flowControl feature gate is off")
        return None
    return section if section is not None else FlowControlSpec()


def _policy_refs(
    instances: PluginInstances, fairness: str | None, ordering: str | None, prefix: str
) -> None:
    if fairness is not None:
        instances.ref(fairness, f"{prefix}fairnessPolicyRef")
    if ordering is not None:
        instances.ref(ordering, f"{prefix}orderingPolicyRef")
