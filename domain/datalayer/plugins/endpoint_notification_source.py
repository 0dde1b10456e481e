"""``endpoint-notification-source``: endpoint add/update/delete events → its extractors.

A marker source (no parameters, nothing to run): its extractors must be endpoint
extractors (``EndpointExtractor``), and they hear every endpoint event of the datastore.
When the data-layer config lists at least one such source, endpoint events reach only the
extractors bound to these sources; when none is configured, every ``EndpointExtractor``
plugin hears them (the behaviour without a data-layer config).
"""

from __future__ import annotations

from domain.datalayer.interfaces import EndpointExtractor
from domain.plugins.base import EmptyParameters, PluginRegistry, TypedName, class_factory
from domain.plugins.hooks import TypedSource, ValidatingDataSource
from ports.endpoints import EndpointEvent

__all__ = ["TYPE", "EndpointNotificationSource", "register"]

TYPE = "endpoint-notification-source"


class EndpointNotificationSource(ValidatingDataSource, TypedSource):
    """Feeds endpoint lifecycle events to the endpoint extractors bound to it."""

    def __init__(self, typed_name: TypedName, parameters: EmptyParameters) -> None:
        self._typed_name = typed_name

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    def output_type(self) -> type:
        return EndpointEvent

    def validate_extractor(self, extractor: object) -> None:
        """Raises ``TypeError`` unless ``extractor`` is an ``EndpointExtractor``."""
        if not isinstance(extractor, EndpointExtractor):
            raise TypeError("it does not take endpoint events (no extract_endpoint)")


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, EndpointNotificationSource),
        description="delivers endpoint add/update/delete events to its endpoint extractors",
    )
