"""Extractors: turn what a data source produced into endpoint metrics and attributes."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from domain.datastore.endpoint import Endpoint
from ports.datalayer import NotificationEvent
from ports.endpoints import EndpointEvent
from ports.plugins import TypedName

__all__ = [
    "EndpointExtractor",
    "Extractor",
    "IncompleteDataError",
    "NotificationExtractor",
    "OversizedDataError",
]


class IncompleteDataError(ValueError):
    """An extractor applied what it found and reports what it could not read (a metric
    family the server does not expose, a malformed optional value). The poll worked: the
    collector logs it when the message changes, and does not count it as a scrape error."""


class OversizedDataError(ValueError):
    """The poll result is too large to read within the extractor's bounds (a body with more
    series of the families it reads than it accepts). Nothing was applied, and the poll
    counts as failed: it is a scrape error, logged when the endpoint's error changes, and
    the source is retried with backoff, since every retry costs as much again."""


@runtime_checkable
class Extractor(Protocol):
    """Reads one poll result of a source whose output type matches ``expected_input_type``
    (or is a subclass of it) and updates the endpoint: its ``metrics`` snapshot is replaced
    whole, attributes are put. Raises ``ValueError`` naming what is missing or malformed;
    the collector logs it when the endpoint's error state changes. ``IncompleteDataError``
    (a ``ValueError``) says the endpoint was updated with what was there."""

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


@runtime_checkable
class NotificationExtractor(Protocol):
    """Reads the changes of watched objects of one GVK (``gvk()``, the same string as its
    source's ``NotificationSource.gvk()``; the config loader checks they are equal).

    ``extract_notification`` is called on the event loop for every add/update/delete, in
    order. Raises ``ValueError`` naming what is wrong with the object; the error is logged
    when the extractor's error state changes.
    """

    @property
    def typed_name(self) -> TypedName: ...

    def gvk(self) -> str: ...

    def extract_notification(self, event: NotificationEvent) -> None: ...
