"""Endpoints of the pods matching a label selector, without an InferencePool (standalone mode)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from kubernetes.client import ApiClient

from adapters.kubernetes.api import PODS, ResourceApi
from adapters.kubernetes.pods import PodEndpoints, format_label_selector, validate_target_ports
from adapters.kubernetes.watch import ListWatch, WatchEvent, WatchEventKind, WatchOptions, stop_all
from ports.endpoints import EndpointSink

__all__ = ["EndpointSelectorSource", "parse_label_selector"]


def parse_label_selector(text: str) -> dict[str, str]:
    """``"k=v,k2=v2"`` (as ``--endpoint-selector`` takes it) as a map; ``ValueError`` if bad."""
    selector: dict[str, str] = {}
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if value.startswith("="):  # ``k==v`` is the same requirement
            value = value[1:].strip()
        if not sep or not key or key.endswith("!"):
            raise ValueError(f"{item!r} is not key=value")
        if key in selector and selector[key] != value:
            raise ValueError(f"{key!r} is given twice")
        selector[key] = value
    if not selector:
        raise ValueError("the selector is empty")
    return selector


class EndpointSelectorSource:
    """An ``EndpointSource`` over the pods of ``namespace`` matching ``selector``.

    Same endpoint rules as an InferencePool with these target ports (see
    ``adapters.kubernetes.pods``); synced after the first list of pods.
    """

    def __init__(
        self,
        api_client: ApiClient,
        *,
        namespace: str,
        selector: Mapping[str, str],
        target_ports: Sequence[int],
        resync_backoff: tuple[float, float] = (0.5, 30.0),
        watch_timeout: float = 300.0,
    ) -> None:
        if not selector:
            raise ValueError("endpoint selector: must not be empty")
        if not namespace:
            raise ValueError("namespace: must not be empty")
        self._api_client = api_client
        self._namespace = namespace
        self._selector = dict(selector)
        self._ports = validate_target_ports(target_ports)
        self._options = WatchOptions(
            backoff_initial=resync_backoff[0],
            backoff_max=resync_backoff[1],
            watch_timeout=watch_timeout,
        )

    async def run(self, sink: EndpointSink) -> None:
        endpoints = PodEndpoints(sink, selector=self._selector, target_ports=self._ports)
        synced = False

        def on_event(event: WatchEvent) -> None:
            nonlocal synced
            if event.kind is WatchEventKind.UPSERT and event.object is not None:
                endpoints.upsert(event.object)
            elif event.kind is WatchEventKind.DELETE and event.object is not None:
                endpoints.delete(event.object)
            elif event.kind is WatchEventKind.SYNCED and not synced:
                synced = True
                sink.mark_synced()

        api = ResourceApi(
            self._api_client,
            PODS,
            namespace=self._namespace,
            label_selector=format_label_selector(self._selector),
        )
        watch = ListWatch(api, on_event, loop=asyncio.get_running_loop(), options=self._options)
        try:
            watch.start()
            await asyncio.Future()
        finally:
            await stop_all([watch])
