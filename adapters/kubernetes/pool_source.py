"""Endpoints of one InferencePool: the pool, its pods, and optionally its objectives and rewrites.

``InferencePoolSource`` watches the named InferencePool (and nothing else of its kind), the
pods of its namespace that match the pool's selector, and, when an ``ObjectiveSink`` is given
and the API server serves them, the InferenceObjectives and InferenceModelRewrites that refer
to the pool. See ``adapters.kubernetes.pods`` for the endpoint rules and
``adapters.kubernetes.watch`` for the list+watch behaviour.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from kubernetes.client import ApiClient

from adapters.kubernetes.api import (
    INFERENCE_MODEL_REWRITES,
    INFERENCE_OBJECTIVES,
    INFERENCE_POOLS_V1,
    INFERENCE_POOLS_V1ALPHA2,
    LLMD_INFERENCE_MODEL_REWRITES,
    LLMD_INFERENCE_OBJECTIVES,
    PODS,
    KubeObject,
    ResourceApi,
    ResourceType,
)
from adapters.kubernetes.objectives import ObjectiveTracker
from adapters.kubernetes.pods import PodEndpoints, format_label_selector
from adapters.kubernetes.watch import (
    ListWatch,
    WatchEvent,
    WatchEventKind,
    WatchOptions,
    stop_all,
)
from ports.endpoints import EndpointSink
from ports.objectives import ObjectiveSink

__all__ = ["POOL_GROUPS", "InferencePoolSource", "PoolSpec", "parse_pool"]

_LOG = logging.getLogger(__name__)

#: The InferencePool group/versions understood, by group.
POOL_GROUPS: Mapping[str, ResourceType] = {
    INFERENCE_POOLS_V1.group: INFERENCE_POOLS_V1,
    INFERENCE_POOLS_V1ALPHA2.group: INFERENCE_POOLS_V1ALPHA2,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolSpec:
    """What of an InferencePool decides its endpoints."""

    selector: Mapping[str, str]
    target_ports: tuple[int, ...]


def parse_pool(pool: KubeObject, *, group: str) -> PoolSpec:
    """The selector and target ports of a pool of ``group`` (``v1`` or ``v1alpha2`` shape).

    Malformed entries are left out (a pool without valid ports has no endpoints).
    """
    spec = _map(pool.get("spec"))
    raw_selector = _map(spec.get("selector"))
    ports: list[int] = []
    if group == INFERENCE_POOLS_V1.group:
        raw_selector = _map(raw_selector.get("matchLabels"))
        raw_ports = spec.get("targetPorts")
        for item in raw_ports if isinstance(raw_ports, list) else []:
            number = _map(item).get("number")
            if _is_port(number) and number not in ports:
                ports.append(number)
    else:
        number = spec.get("targetPortNumber")
        if _is_port(number):
            ports.append(number)
    selector = {str(k): str(v) for k, v in raw_selector.items()}
    return PoolSpec(selector=selector, target_ports=tuple(ports))


class InferencePoolSource:
    """An ``EndpointSource`` for the InferencePool ``namespace/pool_name``.

    ``run`` marks the sink synced once the pool exists and its pods have been listed; until
    then (the pool does not exist, or the API server cannot be reached) it keeps trying and
    the endpoint set stays empty. A change of the pool's selector restarts the pod watch and
    resyncs; a change of its target ports resyncs; deleting the pool deletes every endpoint.
    A failed watch never deletes endpoints: the last known state stays until the watch is back.
    ``run`` returns (raising ``CancelledError``) within about two seconds of cancellation.
    """

    def __init__(
        self,
        api_client: ApiClient,
        *,
        namespace: str,
        pool_name: str,
        pool_group: str = INFERENCE_POOLS_V1.group,
        objective_sink: ObjectiveSink | None = None,
        resync_backoff: tuple[float, float] = (0.5, 30.0),
        watch_timeout: float = 300.0,
    ) -> None:
        if pool_group not in POOL_GROUPS:
            raise ValueError(f"pool group {pool_group!r}: must be one of {sorted(POOL_GROUPS)}")
        if not pool_name:
            raise ValueError("pool name: must not be empty")
        if not namespace:
            raise ValueError("pool namespace: must not be empty")
        self._api_client = api_client
        self._namespace = namespace
        self._pool_name = pool_name
        self._pool_resource = POOL_GROUPS[pool_group]
        self._objective_sink = objective_sink
        self._options = WatchOptions(
            backoff_initial=resync_backoff[0],
            backoff_max=resync_backoff[1],
            watch_timeout=watch_timeout,
        )

    async def run(self, sink: EndpointSink) -> None:
        run = _PoolRun(
            sink,
            loop=asyncio.get_running_loop(),
            api_client=self._api_client,
            namespace=self._namespace,
            pool_name=self._pool_name,
            pool_resource=self._pool_resource,
            objective_sink=self._objective_sink,
            options=self._options,
        )
        try:
            run.start()
            await asyncio.Future()
        finally:
            await run.close()


class _PoolRun:
    """The state of one ``run``; every method runs on the event loop thread."""

    def __init__(
        self,
        sink: EndpointSink,
        *,
        loop: asyncio.AbstractEventLoop,
        api_client: ApiClient,
        namespace: str,
        pool_name: str,
        pool_resource: ResourceType,
        objective_sink: ObjectiveSink | None,
        options: WatchOptions,
    ) -> None:
        self._sink = sink
        self._loop = loop
        self._api_client = api_client
        self._namespace = namespace
        self._pool_name = pool_name
        self._pool_resource = pool_resource
        self._objective_sink = objective_sink
        self._options = options
        self._watches: list[ListWatch] = []
        self._pool: PoolSpec | None = None
        self._absence_logged = False
        self._marked_synced = False
        self._endpoints = PodEndpoints(sink, selector={}, target_ports=())
        self._pod_watch: ListWatch | None = None
        self._pod_watch_synced = False
        self._pending_pods: dict[str, KubeObject] = {}
        self._described = f"InferencePool {namespace}/{pool_name}"

    def start(self) -> None:
        pool_api = self._api(self._pool_resource, field_selector=f"metadata.name={self._pool_name}")
        self._start_watch(pool_api, self._on_pool_event, self._options)
        if self._objective_sink is not None:
            tracker = ObjectiveTracker(
                self._objective_sink,
                pool_name=self._pool_name,
                pool_group=self._pool_resource.group,
            )
            discovering = dataclasses.replace(self._options, require_discovery=True)
            for resource, on_event in (
                (LLMD_INFERENCE_OBJECTIVES, tracker.on_objective),
                (INFERENCE_OBJECTIVES, tracker.on_legacy_objective),
                (LLMD_INFERENCE_MODEL_REWRITES, tracker.on_rewrite),
                (INFERENCE_MODEL_REWRITES, tracker.on_legacy_rewrite),
            ):
                self._start_watch(self._api(resource), on_event, discovering)

    async def close(self) -> None:
        await stop_all(self._watches)

    def _api(self, resource: ResourceType, **selectors: str) -> ResourceApi:
        return ResourceApi(self._api_client, resource, namespace=self._namespace, **selectors)

    def _start_watch(
        self, api: ResourceApi, on_event: Callable[[WatchEvent], None], options: WatchOptions
    ) -> ListWatch:
        watch = ListWatch(api, on_event, loop=self._loop, options=options)
        self._watches = [w for w in self._watches if not w.finished.done()]
        self._watches.append(watch)
        watch.start()
        return watch

    # -- the pool ---------------------------------------------------------------------------

    def _on_pool_event(self, event: WatchEvent) -> None:
        if event.kind is WatchEventKind.UPSERT and event.object is not None:
            spec = parse_pool(event.object, group=self._pool_resource.group)
            if not spec.target_ports:
                _LOG.warning("%s has no valid target ports: it has no endpoints", self._described)
            self._set_pool(spec)
        elif event.kind is WatchEventKind.DELETE:
            _LOG.info("%s was deleted: removing all its endpoints", self._described)
            self._remove_pool()
        elif (
            event.kind is WatchEventKind.SYNCED and self._pool is None and not self._absence_logged
        ):
            self._absence_logged = True
            _LOG.warning(
                "%s not found (%s); waiting for it to be created, not ready until then",
                self._described,
                self._pool_resource,
            )

    def _set_pool(self, spec: PoolSpec) -> None:
        previous, self._pool = self._pool, spec
        self._absence_logged = False
        if previous is None or previous.selector != spec.selector:
            _LOG.info(
                "%s selects pods by %r, target ports %s",
                self._described,
                format_label_selector(spec.selector),
                list(spec.target_ports),
            )
            self._restart_pod_watch(spec)
        elif previous.target_ports != spec.target_ports:
            _LOG.info("%s target ports are now %s", self._described, list(spec.target_ports))
            if self._pod_watch_synced:
                self._endpoints.replace(self._endpoints.pods, target_ports=spec.target_ports)

    def _remove_pool(self) -> None:
        self._pool = None
        self._stop_pod_watch()
        self._endpoints.clear()
        if self._marked_synced:
            self._marked_synced = False
            self._sink.mark_unsynced()

    # -- the pods ---------------------------------------------------------------------------

    def _restart_pod_watch(self, spec: PoolSpec) -> None:
        """A new pod watch for the selector; the endpoints resync when its first list is in."""
        self._stop_pod_watch()
        api = self._api(PODS, label_selector=format_label_selector(spec.selector))
        self._pod_watch = self._start_watch(api, self._on_pod_event, self._options)

    def _stop_pod_watch(self) -> None:
        if self._pod_watch is not None:
            self._pod_watch.stop()
            self._pod_watch = None
        self._pod_watch_synced = False
        self._pending_pods = {}

    def _on_pod_event(self, event: WatchEvent) -> None:
        pod = event.object
        if not self._pod_watch_synced:
            if pod is not None:
                name = _map(pod.get("metadata")).get("name")
                if event.kind is WatchEventKind.UPSERT:
                    self._pending_pods[str(name)] = pod
                else:
                    self._pending_pods.pop(str(name), None)
            elif event.kind is WatchEventKind.SYNCED and self._pool is not None:
                self._pod_watch_synced = True
                self._endpoints.replace(
                    self._pending_pods,
                    selector=self._pool.selector,
                    target_ports=self._pool.target_ports,
                )
                self._pending_pods = {}
                _LOG.info(
                    "%s: %d pods, %d endpoints",
                    self._described,
                    len(self._endpoints.pods),
                    self._endpoints.endpoint_count(),
                )
                if not self._marked_synced:
                    self._marked_synced = True
                    self._sink.mark_synced()
            return
        if event.kind is WatchEventKind.UPSERT and pod is not None:
            self._endpoints.upsert(pod)
        elif event.kind is WatchEventKind.DELETE and pod is not None:
            self._endpoints.delete(pod)


def _is_port(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}
