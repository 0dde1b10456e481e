"""Scheduling: the default picker, the scheduler profiles and the profile handler.

Without ``schedulingProfiles`` the one ``default`` profile holds every filter, scorer
(weight 1) and picker, in plugin order. A profile without a picker gets the first one. A
profile may name a plugin of another kind (a data producer): it is skipped there, with an
info line; a scorer no profile uses is a warning. With
one profile and no configured handler, ``single-profile-handler`` is added; a handler that
validates its profiles (``ValidatingProfileHandler``) is asked whether it accepts them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from app.config.errors import ConfigError
from app.config.instances import PluginInstances, describe
from app.config.schema import SchedulingProfileSpec
from domain.plugins.base import Plugin, plugins_with
from domain.plugins.hooks import ValidatingProfileHandler
from domain.scheduling.interfaces import Filter, Picker, ProfileHandler, Scorer
from domain.scheduling.profile import SchedulerProfile, WeightedScorer

__all__ = [
    "DEFAULT_PICKER",
    "DEFAULT_PROFILE",
    "DEFAULT_PROFILE_HANDLER",
    "add_default_picker",
    "build_profiles",
    "choose_profile_handler",
]

logger = logging.getLogger(__name__)

DEFAULT_PICKER = "max-score-picker"
DEFAULT_PROFILE_HANDLER = "single-profile-handler"
DEFAULT_PROFILE = "default"


def add_default_picker(instances: PluginInstances) -> None:
    """Adds ``max-score-picker`` when no plugin is a picker."""
    if not plugins_with(instances.plugins.values(), Picker):
        instances.required_default(DEFAULT_PICKER, "schedulingProfiles", Picker, "picker")


def build_profiles(
    instances: PluginInstances,
    specs: Sequence[SchedulingProfileSpec],
    scheduling_plugins: Sequence[Plugin],
    configured: Sequence[str],
) -> dict[str, SchedulerProfile]:
    """The profiles of ``specs`` (or the default profile of ``scheduling_plugins``); every
    ``configured`` scorer must be in one."""
    if not specs:
        return {DEFAULT_PROFILE: _default_profile(instances, scheduling_plugins)}
    profiles: dict[str, SchedulerProfile] = {}
    referenced: set[str] = set()
    first_picker = next(iter(plugins_with(instances.plugins.values(), Picker)))
    for index, profile_spec in enumerate(specs):
        path = f"schedulingProfiles[{index}]"
        name = profile_spec.name
        if not name:
            raise ConfigError(f"{path}.name: must not be empty")
        if name in profiles:
            raise ConfigError(f'{path}.name: duplicate profile name "{name}"')
        filters: list[Filter] = []
        scorers: list[WeightedScorer] = []
        picker: Picker | None = None
        members: set[str] = set()
        for ref_index, ref in enumerate(profile_spec.plugins):
            ref_path = f"{path}.plugins[{ref_index}]"
            plugin = instances.ref(ref.plugin_ref, f"{ref_path}.pluginRef")
            if ref.plugin_ref in members:
                raise ConfigError(
                    f'{ref_path}.pluginRef: plugin "{ref.plugin_ref}" is already in '
                    f'profile "{name}"'
                )
            members.add(ref.plugin_ref)
            is_filter = isinstance(plugin, Filter)
            is_scorer = isinstance(plugin, Scorer)
            is_picker = isinstance(plugin, Picker)
            if not (is_filter or is_scorer or is_picker):
                # The llm-d router's charts list a data producer among a profile's plugins
                # (its latency-predictor config); it runs where its extension points are.
                logger.info(
                    "%s.pluginRef: plugin %s is not a filter, scorer or picker; it runs at its "
                    "own extension points, not in profile %r",
                    ref_path,
                    describe(plugin),
                    name,
                )
                referenced.add(ref.plugin_ref)
                continue
            weight = 1.0 if ref.weight is None else ref.weight
            if not math.isfinite(weight):
                raise ConfigError(f"{ref_path}.weight: must be a finite number")
            if ref.weight is not None and not is_scorer:
                logger.warning(
                    "%s.weight: plugin %s is not a scorer; its weight is ignored",
                    ref_path,
                    plugin.typed_name,
                )
            if is_filter:
                filters.append(plugin)  # type: ignore[arg-type]
            if is_scorer:
                scorers.append(WeightedScorer(plugin, weight))  # type: ignore[arg-type]
            if is_picker:
                if picker is not None:
                    raise ConfigError(
                        f'{ref_path}.pluginRef: profile "{name}" already has the picker '
                        f'"{picker.typed_name.name}"; only one picker is allowed'
                    )
                picker = plugin  # type: ignore[assignment]
            referenced.add(ref.plugin_ref)
        profiles[name] = SchedulerProfile(
            name, filters=filters, scorers=scorers, picker=picker or first_picker
        )
    for plugin_name in configured:
        plugin = instances.plugins[plugin_name]
        if isinstance(plugin, Scorer) and plugin_name not in referenced:
            # A warning, as the reference and the llm-d router accept it (the llm-d chart's
            # latency-predictor config declares scorers no profile uses).
            logger.warning(
                '%s: scorer "%s" is not used by any scheduling profile',
                instances.path_of(plugin),
                plugin_name,
            )
    return profiles


def _default_profile(
    instances: PluginInstances, scheduling_plugins: Sequence[Plugin]
) -> SchedulerProfile:
    """Every filter, scorer (weight 1) and picker, in plugin order."""
    filters: list[Filter] = []
    scorers: list[WeightedScorer] = []
    picker: Picker | None = None
    for plugin in scheduling_plugins:
        if isinstance(plugin, Filter):
            filters.append(plugin)
        if isinstance(plugin, Scorer):
            scorers.append(WeightedScorer(plugin, 1.0))
        if isinstance(plugin, Picker):
            if picker is not None:
                raise ConfigError(
                    f"{instances.path_of(plugin)}: the default profile would get a second "
                    f'picker "{plugin.typed_name.name}" (it has "{picker.typed_name.name}"); '
                    "configure schedulingProfiles"
                )
            picker = plugin
    assert picker is not None  # a default picker was added when there was none
    return SchedulerProfile(DEFAULT_PROFILE, filters=filters, scorers=scorers, picker=picker)


def choose_profile_handler(
    instances: PluginInstances, profiles: dict[str, SchedulerProfile]
) -> ProfileHandler:
    """The one configured profile handler, or the default one for a single profile."""
    handlers: list[ProfileHandler] = plugins_with(instances.plugins.values(), ProfileHandler)
    if len(handlers) > 1:
        first, second = handlers[0], handlers[1]
        raise ConfigError(
            f'{instances.path_of(second)}: a second profile handler "{second.typed_name.name}" '
            f'(the first is "{first.typed_name.name}"); exactly one is allowed'
        )
    if handlers:
        handler = handlers[0]
    elif len(profiles) == 1:
        handler = instances.required_default(
            DEFAULT_PROFILE_HANDLER, "schedulingProfiles", ProfileHandler, "profile handler"
        )
    else:
        raise ConfigError(
            f"schedulingProfiles: {len(profiles)} profiles need a profile handler; "
            "configure one in plugins"
        )
    path = instances.path_of(handler)
    if handler.typed_name.type == DEFAULT_PROFILE_HANDLER and len(profiles) > 1:
        raise ConfigError(
            f'{path}: {DEFAULT_PROFILE_HANDLER} "{handler.typed_name.name}" allows exactly '
            f"one scheduling profile, the config has {len(profiles)}"
        )
    if isinstance(handler, ValidatingProfileHandler):
        try:
            handler.validate_profiles(list(profiles))
        except ValueError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
    return handler
