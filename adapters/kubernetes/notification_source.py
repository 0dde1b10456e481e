"""``k8s-notification-source``: list+watch of one Kubernetes kind, reported as notifications.

The source watches the objects of one GVK (``group``, ``version``, ``kind``; ``group`` "" is
the core API) in the EPP's namespace. On ``run`` it resolves the kind's resource name
(plural) through the discovery API (``/api/v1`` or ``/apis/<group>/<version>``), retrying
with a backoff while the API fails or does not serve the kind (a warning is logged once per
state change), then lists and watches the collection (``ListWatch``): every added or changed
object is delivered as ``ADD_OR_UPDATE``, every deleted one (or one missing from a relist) as
``DELETE``, on the event loop, in order. Its GVK string is ``"<group>/<version>, Kind=<kind>"``
(``"/v1, Kind=ConfigMap"`` for the core API); it is also the plugin's default name.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import urllib3
from kubernetes.client import ApiClient, CoreV1Api, CustomObjectsApi
from kubernetes.client.exceptions import ApiException

from adapters.kubernetes.api import RequestTimeout, ResourceApi, ResourceType
from adapters.kubernetes.watch import ListWatch, WatchEvent, WatchEventKind, WatchOptions, stop_all
from ports.datalayer import NotificationEvent, NotificationKind
from ports.plugins import TypedName

__all__ = ["TYPE", "K8sNotificationSource", "K8sNotificationSourceParameters", "gvk_string"]

TYPE = "k8s-notification-source"

_LOG = logging.getLogger(__name__)
_TIMEOUT: RequestTimeout = (10.0, 60.0)


def gvk_string(group: str, version: str, kind: str) -> str:
    """``"<group>/<version>, Kind=<kind>"``: how a GVK is named in configs and logs."""
    return f"{group}/{version}, Kind={kind}"


@dataclass(frozen=True, slots=True, kw_only=True)
class K8sNotificationSourceParameters:
    """``group`` (default "", the core API), ``version`` and ``kind`` (both required)."""

    group: str = ""
    version: str = ""
    kind: str = ""

    def __post_init__(self) -> None:
        if not self.version:
            raise ValueError("version: required")
        if not self.kind:
            raise ValueError("kind: required")

    def default_name(self) -> str:
        """The plugin's name when the config gives none: the GVK string."""
        return gvk_string(self.group, self.version, self.kind)


class K8sNotificationSource:
    """Watches the objects of one GVK in ``namespace``; see the module docstring.

    ``api_client_factory`` is called once per ``run`` (in a worker thread) for the client to
    use; the caller owns the client it returns.
    """

    def __init__(
        self,
        typed_name: TypedName,
        parameters: K8sNotificationSourceParameters,
        *,
        api_client_factory: Callable[[], ApiClient],
        namespace: str,
        options: WatchOptions | None = None,
    ) -> None:
        self._typed_name = typed_name
        self._parameters = parameters
        self._gvk = parameters.default_name()
        self._api_client_factory = api_client_factory
        self._namespace = namespace
        self._options = options if options is not None else WatchOptions()

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    def gvk(self) -> str:
        return self._gvk

    def output_type(self) -> type:
        return NotificationEvent

    async def run(self, deliver: Callable[[NotificationEvent], None]) -> None:
        """Resolves the resource, then lists and watches it until cancelled."""
        client = await asyncio.to_thread(self._api_client_factory)
        resource = await self._resolve(client)
        loop = asyncio.get_running_loop()
        gvk = self._gvk

        def on_event(event: WatchEvent) -> None:
            if event.object is None:
                return  # SYNCED (ABSENT is not reported: discovery was done above)
            kind = (
                NotificationKind.DELETE
                if event.kind is WatchEventKind.DELETE
                else NotificationKind.ADD_OR_UPDATE
            )
            deliver(NotificationEvent(kind=kind, gvk=gvk, object=event.object))

        api = _AnyResourceApi(client, resource, namespace=self._namespace)
        watch = ListWatch(api, on_event, loop=loop, options=self._options)
        watch.start()
        try:
            await watch.finished
        finally:
            await stop_all([watch])
        raise RuntimeError(f"{self._typed_name}: the watch of {api.describe()} ended")

    async def _resolve(self, client: ApiClient) -> ResourceType:
        """The namespaced resource serving the kind, by discovery; retries until found."""
        delay = self._options.backoff_initial
        last_problem = ""
        while True:
            try:
                resource = await asyncio.to_thread(self._discover, client)
                problem = "" if resource is not None else "the API server does not serve it"
            except (ApiException, urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
                resource, problem = None, f"discovery failed: {_describe_error(exc)}"
            if resource is not None:
                if last_problem:
                    _LOG.info("%s: %s is served now", self._typed_name, self._gvk)
                return resource
            if problem != last_problem:
                _LOG.warning(
                    "%s: cannot watch %s: %s; retrying", self._typed_name, self._gvk, problem
                )
                last_problem = problem
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._options.backoff_max)

    def _discover(self, client: ApiClient) -> ResourceType | None:
        p = self._parameters
        try:
            if p.group:
                raw = CustomObjectsApi(client).get_api_resources(
                    p.group, p.version, _preload_content=False, _request_timeout=_TIMEOUT
                )
            elif p.version == "v1":
                raw = CoreV1Api(client).get_api_resources(
                    _preload_content=False, _request_timeout=_TIMEOUT
                )
            else:
                return None
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        response = cast(urllib3.BaseHTTPResponse, raw)
        try:
            document = json.loads(response.data)
        finally:
            response.release_conn()
        resources = document.get("resources") if isinstance(document, dict) else None
        for item in resources if isinstance(resources, list) else []:
            if not isinstance(item, dict) or item.get("kind") != p.kind:
                continue
            name = item.get("name")
            if isinstance(name, str) and "/" not in name and item.get("namespaced", True):
                return ResourceType(group=p.group, version=p.version, plural=name, kind=p.kind)
        return None


class _AnyResourceApi(ResourceApi):
    """A ``ResourceApi`` for any namespaced resource, core ones included (plain REST paths)."""

    def __init__(self, api_client: ApiClient, resource: ResourceType, *, namespace: str) -> None:
        self.resource = resource
        self.namespace = namespace
        self.label_selector = ""
        self.field_selector = ""
        self._client = api_client
        self._core = CoreV1Api(api_client)
        self._custom = CustomObjectsApi(api_client)

    def _call(
        self, *, request_timeout: RequestTimeout, watch: bool, **extra: Any
    ) -> urllib3.BaseHTTPResponse:
        r = self.resource
        prefix = f"/apis/{r.group}/{r.version}" if r.group else f"/api/{r.version}"
        query: list[tuple[str, object]] = []
        if watch:
            query.append(("watch", "true"))
            query.append(("allowWatchBookmarks", "true"))
            query.append(("resourceVersion", extra["resource_version"]))
            query.append(("timeoutSeconds", extra["timeout_seconds"]))
        request = self._client.param_serialize(
            method="GET",
            resource_path=f"{prefix}/namespaces/{{namespace}}/{r.plural}",
            path_params={"namespace": self.namespace},
            query_params=query,
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        result = self._client.call_api(*request, _request_timeout=request_timeout)
        if not 200 <= result.status <= 299:
            cast(Any, result).read()
            raise ApiException.from_response(http_resp=result, body=None, data=None)
        return cast(urllib3.BaseHTTPResponse, result.response)


def _describe_error(error: Exception) -> str:
    if isinstance(error, ApiException):
        return f"HTTP {error.status} {error.reason}"
    return f"{type(error).__name__}: {error}"
