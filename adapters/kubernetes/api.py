"""The Kubernetes API calls discovery makes: list, watch and API discovery of one resource type.

Everything here blocks (the ``kubernetes`` client is synchronous); it is called from the
list+watch worker threads only, never on the event loop. Responses are returned raw
(``urllib3`` responses, JSON decoded by the caller) so that watches can be streamed and
interrupted, and so that custom resources and pods are handled alike as plain JSON maps.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import urllib3
from kubernetes.client import ApiClient, CoreV1Api, CustomObjectsApi
from kubernetes.client.exceptions import ApiException

__all__ = [
    "INFERENCE_MODEL_REWRITES",
    "INFERENCE_OBJECTIVES",
    "INFERENCE_POOLS_V1",
    "INFERENCE_POOLS_V1ALPHA2",
    "LLMD_INFERENCE_MODEL_REWRITES",
    "LLMD_INFERENCE_OBJECTIVES",
    "PODS",
    "KubeObject",
    "RequestTimeout",
    "ResourceApi",
    "ResourceType",
]

#: A Kubernetes object as decoded JSON.
KubeObject = Mapping[str, Any]
#: ``(connect, read)`` timeouts in seconds.
RequestTimeout = tuple[float, float]


@dataclass(frozen=True, slots=True, kw_only=True)
class ResourceType:
    """A namespaced resource collection: ``group`` "" is the core API."""

    group: str
    version: str
    plural: str
    kind: str

    @property
    def group_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def __str__(self) -> str:
        return f"{self.plural}.{self.group_version}"


PODS = ResourceType(group="", version="v1", plural="pods", kind="Pod")
INFERENCE_POOLS_V1 = ResourceType(
    group="inference.networking.k8s.io", version="v1", plural="inferencepools", kind="InferencePool"
)
INFERENCE_POOLS_V1ALPHA2 = ResourceType(
    group="inference.networking.x-k8s.io",
    version="v1alpha2",
    plural="inferencepools",
    kind="InferencePool",
)
INFERENCE_OBJECTIVES = ResourceType(
    group="inference.networking.x-k8s.io",
    version="v1alpha2",
    plural="inferenceobjectives",
    kind="InferenceObjective",
)
INFERENCE_MODEL_REWRITES = ResourceType(
    group="inference.networking.x-k8s.io",
    version="v1alpha2",
    plural="inferencemodelrewrites",
    kind="InferenceModelRewrite",
)
#: The llm-d router's 2026 group for the same two kinds; when served, it wins over the above.
LLMD_INFERENCE_OBJECTIVES = ResourceType(
    group="llm-d.ai", version="v1alpha2", plural="inferenceobjectives", kind="InferenceObjective"
)
LLMD_INFERENCE_MODEL_REWRITES = ResourceType(
    group="llm-d.ai",
    version="v1alpha2",
    plural="inferencemodelrewrites",
    kind="InferenceModelRewrite",
)


class ResourceApi:
    """List, watch and discover one namespaced resource type through an ``ApiClient``.

    Raises ``ApiException`` for non-2xx answers and ``urllib3`` errors for transport failures.
    """

    def __init__(
        self,
        api_client: ApiClient,
        resource: ResourceType,
        *,
        namespace: str,
        label_selector: str = "",
        field_selector: str = "",
    ) -> None:
        if not resource.group and resource != PODS:
            raise ValueError(f"{resource}: the only core resource supported is pods")
        self.resource = resource
        self.namespace = namespace
        self.label_selector = label_selector
        self.field_selector = field_selector
        self._core = CoreV1Api(api_client)
        self._custom = CustomObjectsApi(api_client)

    def describe(self) -> str:
        """``pods.v1 in <ns> (labelSelector ...)``, for log lines."""
        text = f"{self.resource} in {self.namespace}"
        selectors = [s for s in (self.label_selector, self.field_selector) if s]
        return f"{text} ({', '.join(selectors)})" if selectors else text

    def list(self, *, request_timeout: RequestTimeout) -> urllib3.BaseHTTPResponse:
        """Starts a consistent list; the caller reads (and may interrupt) the body."""
        return self._call(request_timeout=request_timeout, watch=False)

    def watch(
        self,
        *,
        resource_version: str,
        timeout_seconds: int,
        request_timeout: RequestTimeout,
    ) -> urllib3.BaseHTTPResponse:
        """Opens a watch from ``resource_version`` with bookmarks; the caller streams the body."""
        return self._call(
            request_timeout=request_timeout,
            watch=True,
            resource_version=resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout_seconds,
        )

    def served(self, *, request_timeout: RequestTimeout) -> bool:
        """Whether the API server serves this resource (discovery of its group/version)."""
        if not self.resource.group:
            return True
        try:
            response = cast(
                urllib3.BaseHTTPResponse,
                self._custom.get_api_resources(
                    self.resource.group,
                    self.resource.version,
                    _preload_content=False,
                    _request_timeout=request_timeout,
                ),
            )
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        try:
            document = json.loads(response.data)
        finally:
            response.release_conn()
        resources = document.get("resources") if isinstance(document, dict) else None
        if not isinstance(resources, list):
            return False
        return any(
            isinstance(item, dict) and item.get("name") == self.resource.plural
            for item in resources
        )

    def _call(
        self,
        *,
        request_timeout: RequestTimeout,
        watch: bool,
        **extra: Any,
    ) -> urllib3.BaseHTTPResponse:
        options: dict[str, Any] = {
            "_preload_content": False,
            "_request_timeout": request_timeout,
            **extra,
        }
        if watch:
            options["watch"] = True
        if self.label_selector:
            options["label_selector"] = self.label_selector
        if self.field_selector:
            options["field_selector"] = self.field_selector
        result: object
        if not self.resource.group:
            result = self._core.list_namespaced_pod(self.namespace, **options)
        else:
            result = self._custom.list_namespaced_custom_object(
                self.resource.group,
                self.resource.version,
                self.namespace,
                self.resource.plural,
                **options,
            )
        return cast(urllib3.BaseHTTPResponse, result)
