"""Extractors: turn what a data source produced into endpoint metrics and attributes."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from domain.datalayer.endpoint import Endpoint
from ports.endpoints import EndpointEvent
from ports.plugins import TypedName

__all__ = ["EndpointExtractor", "Extractor"]


@runtime_checkable
class Extractor(Protocol):
    """Reads one poll result of a source whose output type matches ``expected_input_type``
    (or is a subclass of it) and updates the endpoint: its ``metrics`` snapshot is replaced
    whole, attributes are put. Raises ``ValueError`` naming what is missing or malformed;
    the collector logs it when the endpoint's error state changes."""

    @property
    def typed_name(self) -> TypedName: ...

    def expected_input_type(self) -> type: ...

    def extract(self, data: object, endpoint: Endpoint, now: float) -> None: ...


@runtime_checkable
class EndpointExtractor(Protocol):
    """Hears every endpoint add/update/delete (e.g. to prune per-endpoint state)."""

    @property
    def typed_name(self) -> TypedName: ...

    def extract_endpoint(self, event: EndpointEvent, endpoint: Endpoint) -> None: ...
