"""A loopback Kubernetes API server speaking list/watch, for tests of Kubernetes discovery.

``KubeApiServer`` serves, over plain HTTP/1.1 on 127.0.0.1, namespaced collections of core v1
pods, InferencePools (``inference.networking.k8s.io/v1`` and
``inference.networking.x-k8s.io/v1alpha2``), InferenceObjectives and InferenceModelRewrites,
and coordination.k8s.io/v1 Leases, plus discovery (``/api``, ``/apis``,
``/apis/<group>/<version>``). ``POST`` creates an object (409 AlreadyExists) and ``PUT``
replaces one, with a 409 Conflict when its ``metadata.resourceVersion`` is not the stored one.
Objects live in memory with one monotonically increasing resourceVersion; the test changes
them with ``create``, ``update`` and ``delete``, which open watches see as
ADDED/MODIFIED/DELETED events (label-selected watches see an object leaving or entering their
selection as DELETED/ADDED, as from a real server).

List supports ``labelSelector`` (``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``) and
``fieldSelector`` (``metadata.name=``, ``metadata.namespace=``). ``watch=true`` streams
newline-delimited JSON events with chunked transfer encoding, from the given resourceVersion
(replaying the history since then) or, without one, from synthetic ADDED events of the current
objects; it honours ``timeoutSeconds`` (a clean end of the stream).

Test hooks: ``send_bookmark()`` (to watches that allow bookmarks; once
``bookmarks_pending()`` is 0 they are written before anything that follows), ``compact()`` (older
resourceVersions expire: watching from one gets an ERROR event with a Status code 410),
``expire_watches()`` (compact, and end every open watch with that ERROR event),
``drop_watches()`` (close open watch connections mid-stream), ``pause_watches()`` /
``resume_watches()`` (open watches stop / resume sending, as a stalled connection would),
``add_token()``/``grant()``/``revoke()``/``delay_reviews()`` (the answers of TokenReviews and
SubjectAccessReviews, which it serves for ``create``),
``fail_requests()`` (answer the next matching requests with an HTTP error), and a log of the
requests served. It runs in its own threads, independent of any event loop.

For the tests of sources: ``kube_client`` (a real ``kubernetes`` ``ApiClient`` for the server),
``RecordingSink`` (records endpoint events, sync, objectives and rules), ``running`` (runs a
source for a block, then cancels it) and ``wait_until`` (polls a condition with a deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import select
import socket
import threading
import time
import uuid
from collections.abc import (
    AsyncIterator,
    Callable,
    Generator,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qs, urlsplit

from kubernetes.client import ApiClient, Configuration

from adapters.kubernetes.pool_source import InferencePoolSource
from ports.endpoints import EndpointEvent, EndpointEventKind, EndpointInfo, EndpointSource
from ports.objectives import ModelRewriteRule

__all__ = [
    "ALL_RESOURCES",
    "INFERENCE_MODEL_REWRITES",
    "INFERENCE_OBJECTIVES",
    "INFERENCE_POOLS_V1",
    "INFERENCE_POOLS_V1ALPHA2",
    "LEASES",
    "LLMD_INFERENCE_MODEL_REWRITES",
    "LLMD_INFERENCE_OBJECTIVES",
    "PODS",
    "SUBJECT_ACCESS_REVIEWS",
    "TOKEN_REVIEWS",
    "WITH_LLMD_RESOURCES",
    "KubeApiServer",
    "RecordingSink",
    "Resource",
    "ServedRequest",
    "inference_objective",
    "inference_pool_v1",
    "inference_pool_v1alpha2",
    "kube_client",
    "model_rewrite",
    "pod",
    "pool_source",
    "running",
    "wait_until",
    "write_kubeconfig",
]

Obj = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Resource:
    """A namespaced resource type the server can serve; ``group`` "" is the core API."""

    group: str
    version: str
    plural: str
    kind: str

    @property
    def group_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


PODS = Resource("", "v1", "pods", "Pod")
INFERENCE_POOLS_V1 = Resource(
    "inference.networking.k8s.io", "v1", "inferencepools", "InferencePool"
)
INFERENCE_POOLS_V1ALPHA2 = Resource(
    "inference.networking.x-k8s.io", "v1alpha2", "inferencepools", "InferencePool"
)
INFERENCE_OBJECTIVES = Resource(
    "inference.networking.x-k8s.io", "v1alpha2", "inferenceobjectives", "InferenceObjective"
)
INFERENCE_MODEL_REWRITES = Resource(
    "inference.networking.x-k8s.io", "v1alpha2", "inferencemodelrewrites", "InferenceModelRewrite"
)
LEASES = Resource("coordination.k8s.io", "v1", "leases", "Lease")
LLMD_INFERENCE_OBJECTIVES = Resource(
    "llm-d.ai", "v1alpha2", "inferenceobjectives", "InferenceObjective"
)
LLMD_INFERENCE_MODEL_REWRITES = Resource(
    "llm-d.ai", "v1alpha2", "inferencemodelrewrites", "InferenceModelRewrite"
)
#: What a cluster with the llm-d.ai CRDs installed as well serves.
WITH_LLMD_RESOURCES = (
    PODS,
    INFERENCE_POOLS_V1,
    INFERENCE_POOLS_V1ALPHA2,
    INFERENCE_OBJECTIVES,
    INFERENCE_MODEL_REWRITES,
    LLMD_INFERENCE_OBJECTIVES,
    LLMD_INFERENCE_MODEL_REWRITES,
    LEASES,
)
ALL_RESOURCES = (
    PODS,
    INFERENCE_POOLS_V1,
    INFERENCE_POOLS_V1ALPHA2,
    INFERENCE_OBJECTIVES,
    INFERENCE_MODEL_REWRITES,
    LEASES,
)
#: Cluster-scoped reviews, served for ``create`` only (``POST``): never stored.
TOKEN_REVIEWS = Resource("authentication.k8s.io", "v1", "tokenreviews", "TokenReview")
SUBJECT_ACCESS_REVIEWS = Resource(
    "authorization.k8s.io", "v1", "subjectaccessreviews", "SubjectAccessReview"
)
_REVIEWS = {
    f"/apis/{r.group_version}/{r.plural}": r for r in (TOKEN_REVIEWS, SUBJECT_ACCESS_REVIEWS)
}


# -- object builders -----------------------------------------------------------------------


def pod(
    name: str,
    *,
    ip: str | None = "10.0.0.1",
    labels: Mapping[str, str] | None = None,
    ready: bool = True,
    annotations: Mapping[str, str] | None = None,
    deleting: bool = False,
    namespace: str = "default",
) -> Obj:
    """A Pod with the given readiness (condition ``Ready``) and IP."""
    metadata: Obj = {"name": name, "namespace": namespace, "labels": dict(labels or {})}
    if annotations:
        metadata["annotations"] = dict(annotations)
    if deleting:
        metadata["deletionTimestamp"] = _now()
    status: Obj = {
        "phase": "Running",
        "conditions": [
            {"type": "Initialized", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ],
    }
    if ip:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {"containers": [{"name": "server", "image": "model-server"}]},
        "status": status,
    }


def inference_pool_v1(
    name: str,
    *,
    selector: Mapping[str, str],
    ports: Sequence[int] = (8000,),
    namespace: str = "default",
) -> Obj:
    """An ``inference.networking.k8s.io/v1`` InferencePool."""
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": dict(selector)},
            "targetPorts": [{"number": port} for port in ports],
            "endpointPickerRef": {"name": f"{name}-epp", "port": {"number": 9002}},
        },
    }


def inference_pool_v1alpha2(
    name: str, *, selector: Mapping[str, str], port: int = 8000, namespace: str = "default"
) -> Obj:
    """An ``inference.networking.x-k8s.io/v1alpha2`` InferencePool."""
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": dict(selector),
            "targetPortNumber": port,
            "extensionRef": {"name": f"{name}-epp"},
        },
    }


def inference_objective(
    name: str,
    *,
    pool: str,
    priority: int | None = None,
    pool_group: str | None = None,
    namespace: str = "default",
    api_version: str = "inference.networking.x-k8s.io/v1alpha2",
) -> Obj:
    """An InferenceObjective referring to ``pool``."""
    pool_ref: Obj = {"name": pool}
    if pool_group is not None:
        pool_ref["group"] = pool_group
    spec: Obj = {"poolRef": pool_ref}
    if priority is not None:
        spec["priority"] = priority
    return {
        "apiVersion": api_version,
        "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def model_rewrite(
    name: str,
    *,
    pool: str,
    rules: Sequence[tuple[Sequence[str], Sequence[tuple[str, int]]]],
    pool_group: str | None = None,
    created: str | None = None,
    namespace: str = "default",
    api_version: str = "inference.networking.x-k8s.io/v1alpha2",
) -> Obj:
    """An InferenceModelRewrite: ``rules`` are ``(match models, [(target model, weight)])``."""
    pool_ref: Obj = {"name": pool}
    if pool_group is not None:
        pool_ref["group"] = pool_group
    metadata: Obj = {"name": name, "namespace": namespace}
    if created is not None:
        metadata["creationTimestamp"] = created
    return {
        "apiVersion": api_version,
        "kind": "InferenceModelRewrite",
        "metadata": metadata,
        "spec": {
            "poolRef": pool_ref,
            "rules": [
                {
                    "matches": [{"model": {"type": "Exact", "value": m}} for m in matches],
                    "targets": [{"modelRewrite": t, "weight": w} for t, w in targets],
                }
                for matches, targets in rules
            ],
        },
    }


# -- the server ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServedRequest:
    """One request the server answered: its path, query (single values), collection, and
    when it arrived (``time.monotonic()``)."""

    path: str
    query: Mapping[str, str]
    resource: Resource | None
    at: float

    @property
    def watch(self) -> bool:
        return self.query.get("watch") in ("true", "1")


@dataclass(slots=True)
class _Event:
    version: int
    resource: Resource
    type: str
    obj: Obj
    old: Obj | None


@dataclass(slots=True)
class _Watch:
    resource: Resource
    bookmarks: bool
    drop: bool = False
    expire: bool = False
    bookmark_pending: bool = False


@dataclass(slots=True)
class _Failure:
    resource: Resource | None
    watch: bool | None
    status: int
    remaining: int


@dataclass(slots=True)
class _Query:
    resource: Resource
    namespace: str | None
    name: str | None
    params: dict[str, str] = field(default_factory=dict)


class KubeApiServer:
    """The loopback API server; see the module docstring. Use as a context manager."""

    def __init__(self, *, resources: Iterable[Resource] = ALL_RESOURCES) -> None:
        self._resources = tuple(resources)
        self._cond = threading.Condition()
        self._version = 100
        self._compacted = 0
        self._objects: dict[Resource, dict[tuple[str, str], Obj]] = {r: {} for r in self._resources}
        self._history: list[_Event] = []
        self._watches: list[_Watch] = []
        self._paused = False
        self._closing = False
        self._failures: list[_Failure] = []
        self._requests: list[ServedRequest] = []
        self._connections: set[socket.socket] = set()
        self._tokens: dict[str, Obj] = {}
        self._grants: set[tuple[str, str, str]] = set()
        self._review_delay = 0.0
        self._httpd = _HttpServer(("127.0.0.1", 0), _Handler, self)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="kube-api-server",
            daemon=True,
        )

    # -- lifecycle --

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> KubeApiServer:
        self._thread.start()
        return self

    def close(self) -> None:
        """Ends every watch and connection and stops serving."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            connections = list(self._connections)
        self._httpd.shutdown()
        self._httpd.server_close()
        for connection in connections:
            _shutdown(connection)
        self._thread.join(timeout=5)

    def __enter__(self) -> KubeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the objects --

    def create(self, resource: Resource, obj: Obj) -> Obj:
        """Stores a new object (namespace "default" unless set); returns the stored copy."""
        with self._cond:
            stored = copy.deepcopy(obj)
            metadata = stored.setdefault("metadata", {})
            metadata.setdefault("namespace", "default")
            key = (metadata["namespace"], metadata["name"])
            if key in self._objects[resource]:
                raise KeyError(f"{resource.plural} {key} exists")
            metadata.setdefault("uid", str(uuid.uuid4()))
            metadata.setdefault("creationTimestamp", _now())
            self._objects[resource][key] = self._record(resource, "ADDED", stored, None)
            return copy.deepcopy(stored)

    def update(self, resource: Resource, obj: Obj) -> Obj:
        """Replaces an existing object (its uid and creationTimestamp are kept)."""
        with self._cond:
            stored = copy.deepcopy(obj)
            metadata = stored.setdefault("metadata", {})
            metadata.setdefault("namespace", "default")
            key = (metadata["namespace"], metadata["name"])
            old = self._objects[resource][key]
            for kept in ("uid", "creationTimestamp"):
                metadata[kept] = old["metadata"][kept]
            self._objects[resource][key] = self._record(resource, "MODIFIED", stored, old)
            return copy.deepcopy(stored)

    def modify(self, resource: Resource, name: str, change: Callable[[Obj], None]) -> Obj:
        """``update`` with a copy of the stored object changed in place by ``change``."""
        obj = self.get(resource, name)
        if obj is None:
            raise KeyError(name)
        change(obj)
        return self.update(resource, obj)

    def delete(self, resource: Resource, name: str, *, namespace: str = "default") -> None:
        with self._cond:
            old = self._objects[resource].pop((namespace, name))
            gone = copy.deepcopy(old)
            self._record(resource, "DELETED", gone, old)

    def get(self, resource: Resource, name: str, *, namespace: str = "default") -> Obj | None:
        with self._cond:
            obj = self._objects[resource].get((namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    @property
    def resource_version(self) -> int:
        with self._cond:
            return self._version

    def _record(self, resource: Resource, kind: str, obj: Obj, old: Obj | None) -> Obj:
        self._version += 1
        obj["metadata"]["resourceVersion"] = str(self._version)
        self._history.append(_Event(self._version, resource, kind, obj, old))
        self._cond.notify_all()
        return obj

    # -- authentication and authorization (TokenReview, SubjectAccessReview) --

    def add_token(
        self, token: str, *, username: str, groups: Sequence[str] = (), uid: str = ""
    ) -> None:
        """A TokenReview of ``token`` authenticates it as ``username``."""
        with self._cond:
            self._tokens[token] = {"username": username, "groups": list(groups), "uid": uid}

    def grant(self, username: str, path: str, verb: str = "get") -> None:
        """A SubjectAccessReview allows ``username`` ``verb`` on the non-resource ``path``."""
        with self._cond:
            self._grants.add((username, path, verb))

    def revoke(self, username: str, path: str, verb: str = "get") -> None:
        with self._cond:
            self._grants.discard((username, path, verb))

    def delay_reviews(self, seconds: float) -> None:
        """Reviews are answered only after ``seconds`` (0: at once), as a slow server."""
        with self._cond:
            self._review_delay = seconds

    def _review(self, resource: Resource, body: Obj) -> tuple[int, Obj]:
        spec = body.get("spec") or {}
        with self._cond:
            delay = self._review_delay
        if delay:
            time.sleep(delay)
        with self._cond:
            if resource == TOKEN_REVIEWS:
                user = self._tokens.get(str(spec.get("token", "")))
                status: Obj = {"authenticated": user is not None}
                if user is not None:
                    status["user"] = copy.deepcopy(user)
                else:
                    status["error"] = "invalid bearer token"
            else:
                attributes = spec.get("nonResourceAttributes") or {}
                key = (spec.get("user"), attributes.get("path"), attributes.get("verb"))
                status = {"allowed": key in self._grants}
        return 201, {
            "kind": resource.kind,
            "apiVersion": resource.group_version,
            "metadata": {},
            "spec": spec,
            "status": status,
        }

    # -- test hooks --

    def send_bookmark(self) -> None:
        """Each open watch that allows bookmarks sends one at the latest resourceVersion."""
        with self._cond:
            for watch in self._watches:
                if watch.bookmarks:
                    watch.bookmark_pending = True
            self._cond.notify_all()

    def bookmarks_pending(self) -> int:
        """How many watches have not yet taken the bookmark ``send_bookmark`` asked for."""
        with self._cond:
            return sum(1 for watch in self._watches if watch.bookmark_pending)

    def compact(self) -> None:
        """Every resourceVersion older than the current one expires (410 Gone on watch)."""
        with self._cond:
            self._compacted = self._version
            self._history.clear()

    def expire_watches(self) -> None:
        """``compact()``, and every open watch ends with an ERROR event, code 410."""
        with self._cond:
            self._compacted = self._version
            self._history.clear()
            for watch in self._watches:
                watch.expire = True
            self._cond.notify_all()

    def drop_watches(self) -> None:
        """Every open watch connection is closed abruptly (no end of the chunked body)."""
        with self._cond:
            for watch in self._watches:
                watch.drop = True
            self._cond.notify_all()

    def pause_watches(self) -> None:
        """Open and new watches send nothing (events stay in the history) until resumed."""
        with self._cond:
            self._paused = True

    def resume_watches(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def fail_requests(
        self,
        status: int,
        *,
        resource: Resource | None = None,
        watch: bool | None = None,
        count: int = 1,
    ) -> None:
        """The next ``count`` requests for ``resource`` (any), of the kind ``watch`` (any)
        are answered with HTTP ``status`` and a Status body."""
        with self._cond:
            self._failures.append(_Failure(resource, watch, status, count))

    def requests(
        self, resource: Resource | None = None, *, watch: bool | None = None
    ) -> list[ServedRequest]:
        """The requests served (for collections of ``resource`` only, when given)."""
        with self._cond:
            served = list(self._requests)
        return [
            request
            for request in served
            if (resource is None or request.resource == resource)
            and (watch is None or request.watch == watch)
        ]

    def open_watches(self, resource: Resource | None = None) -> int:
        with self._cond:
            return sum(1 for w in self._watches if resource is None or w.resource == resource)

    # -- serving (handler threads) --

    def _take_failure(self, resource: Resource, watch: bool) -> int | None:
        with self._cond:
            for failure in self._failures:
                if failure.resource not in (None, resource):
                    continue
                if failure.watch is not None and failure.watch != watch:
                    continue
                failure.remaining -= 1
                if failure.remaining <= 0:
                    self._failures.remove(failure)
                return failure.status
        return None

    def _log(self, path: str, params: Mapping[str, str], resource: Resource | None) -> None:
        with self._cond:
            self._requests.append(ServedRequest(path, dict(params), resource, time.monotonic()))

    def _register(self, connection: socket.socket) -> None:
        with self._cond:
            self._connections.add(connection)

    def _unregister(self, connection: socket.socket) -> None:
        with self._cond:
            self._connections.discard(connection)

    def _discovery(self, path: str) -> tuple[int, Obj]:
        if path == "/api":
            return 200, {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [],
            }
        if path == "/apis":
            groups: dict[str, list[str]] = {}
            for r in self._resources:
                if r.group and r.version not in groups.setdefault(r.group, []):
                    groups[r.group].append(r.version)
            return 200, {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [
                    {
                        "name": g,
                        "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in vs],
                        "preferredVersion": {"groupVersion": f"{g}/{vs[0]}", "version": vs[0]},
                    }
                    for g, vs in groups.items()
                ],
            }
        group_version = path.removeprefix("/apis/") if path.startswith("/apis/") else "v1"
        served = [r for r in self._resources if r.group_version == group_version]
        if not served:
            return 404, _status(404, "NotFound", "the server could not find the requested resource")
        return 200, {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": group_version,
            "resources": [
                {
                    "name": r.plural,
                    "singularName": r.kind.lower(),
                    "namespaced": True,
                    "kind": r.kind,
                    "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
                }
                for r in served
            ],
        }

    def _route(self, path: str) -> _Query | None:
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["api", "v1"]:
            group, version, rest = "", "v1", parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 3:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return None
        namespace: str | None = None
        if len(rest) >= 2 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        if len(rest) not in (1, 2):
            return None
        for resource in self._resources:
            if (resource.group, resource.version, resource.plural) == (group, version, rest[0]):
                return _Query(resource, namespace, rest[1] if len(rest) == 2 else None)
        return None

    def _list(self, query: _Query, selects: Callable[[Obj], bool]) -> Obj:
        with self._cond:
            items = [
                copy.deepcopy(obj)
                for (namespace, _), obj in sorted(self._objects[query.resource].items())
                if query.namespace in (None, namespace) and selects(obj)
            ]
            version = self._version
        resource = query.resource
        return {
            "kind": f"{resource.kind}List",
            "apiVersion": resource.group_version,
            "metadata": {"resourceVersion": str(version)},
            "items": items,
        }

    def _stream(
        self, query: _Query, selects: Callable[[Obj], bool], client_gone: Callable[[], bool]
    ) -> Generator[bytes | None]:
        """The watch's event lines; ``None`` asks the handler to drop the connection.

        Never yields while holding the lock.
        """
        params = query.params
        deadline = time.monotonic() + float(params.get("timeoutSeconds") or 1800)
        watch = _Watch(query.resource, params.get("allowWatchBookmarks") in ("true", "1"))
        since_text = params.get("resourceVersion", "")
        with self._cond:
            self._watches.append(watch)
            expired = False
            initial: list[bytes] = []
            if since_text and since_text != "0":
                cursor = int(since_text)
                expired = cursor < self._compacted
            else:
                cursor = self._version
                initial = [
                    _line("ADDED", copy.deepcopy(obj))
                    for (namespace, _), obj in sorted(self._objects[query.resource].items())
                    if query.namespace in (None, namespace) and selects(obj)
                ]
        try:
            if expired:
                message = f"too old resource version: {since_text} ({self._compacted})"
                yield _line("ERROR", _status(410, "Expired", message))
                return
            yield from initial
            while True:
                lines, cursor, end = self._next_lines(
                    query, selects, watch, cursor, deadline, client_gone
                )
                yield from lines
                if end == "drop":
                    yield None
                if end:
                    return
        finally:
            with self._cond:
                self._watches.remove(watch)

    def _next_lines(
        self,
        query: _Query,
        selects: Callable[[Obj], bool],
        watch: _Watch,
        cursor: int,
        deadline: float,
        client_gone: Callable[[], bool],
    ) -> tuple[list[bytes], int, str]:
        """Waits for something to send: ``(lines, new cursor, "" | "end" | "drop")``."""
        with self._cond:
            while True:
                if self._closing or watch.drop or client_gone():
                    return [], cursor, "drop"
                if watch.expire:
                    return [_line("ERROR", _status(410, "Expired", "expired"))], cursor, "end"
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return [], cursor, "end"
                if not self._paused:
                    lines, cursor = self._pending(query, selects, cursor)
                    if watch.bookmark_pending:
                        watch.bookmark_pending = False
                        cursor = max(cursor, self._version)
                        bookmark = {
                            "kind": query.resource.kind,
                            "apiVersion": query.resource.group_version,
                            "metadata": {"resourceVersion": str(cursor)},
                        }
                        lines.append(_line("BOOKMARK", bookmark))
                    if lines:
                        return lines, cursor, ""
                self._cond.wait(timeout=min(remaining, 0.05))

    def _pending(
        self, query: _Query, selects: Callable[[Obj], bool], cursor: int
    ) -> tuple[list[bytes], int]:
        lines = []
        for event in self._history:
            if event.version <= cursor:
                continue
            cursor = event.version
            if event.resource != query.resource:
                continue
            namespace = event.obj["metadata"].get("namespace")
            if query.namespace not in (None, namespace):
                continue
            now = selects(event.obj)
            before = event.old is not None and selects(event.old)
            kind = event.type
            if kind == "MODIFIED":
                if now and not before:
                    kind = "ADDED"
                elif before and not now:
                    kind = "DELETED"
                elif not now:
                    continue
            elif not now:
                continue
            lines.append(_line(kind, copy.deepcopy(event.obj)))
        return lines, cursor


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(
        self, address: tuple[str, int], handler: type[_Handler], api: KubeApiServer
    ) -> None:
        super().__init__(address, handler)
        self.api = api


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HttpServer

    def setup(self) -> None:
        super().setup()
        self.server.api._register(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.api._unregister(self.connection)

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        api = self.server.api
        url = urlsplit(self.path)
        params = {k: v[-1] for k, v in parse_qs(url.query).items()}
        path = url.path.rstrip("/") or "/"
        if path in ("/api", "/apis", "/api/v1") or (
            path.startswith("/apis/") and path.count("/") == 3
        ):
            api._log(path, params, None)
            self._json(*api._discovery(path))
            return
        query = api._route(path)
        api._log(path, params, query.resource if query is not None else None)
        if query is None:
            self._json(404, _status(404, "NotFound", f"no resource at {path}"))
            return
        query.params = params
        watching = params.get("watch") in ("true", "1")
        failure = api._take_failure(query.resource, watching)
        if failure is not None:
            phrase = HTTPStatus(failure).phrase.replace(" ", "")
            self._json(failure, _status(failure, phrase, "injected failure"))
            return
        selects = _selector(params)
        if query.name is not None:
            obj = api.get(query.resource, query.name, namespace=query.namespace or "default")
            if obj is None:
                self._json(404, _status(404, "NotFound", f"{query.name} not found"))
            else:
                self._json(200, obj)
        elif watching:
            self._watch(api._stream(query, selects, self._client_gone))
        else:
            self._json(200, api._list(query, selects))

    def _body(self) -> Obj:
        length = int(self.headers.get("Content-Length") or 0)
        document = json.loads(self.rfile.read(length) or b"{}")
        return document if isinstance(document, dict) else {}

    def do_POST(self) -> None:
        """Create: the reviews, or a new object in a namespaced collection (409 if it
        exists)."""
        api = self.server.api
        path = urlsplit(self.path).path.rstrip("/")
        body = self._body()
        review = _REVIEWS.get(path)
        query = api._route(path) if review is None else None
        resource = review or (query.resource if query is not None else None)
        api._log(path, {"verb": "create"}, resource)
        if resource is None or (query is not None and (query.name or not query.namespace)):
            self._json(404, _status(404, "NotFound", f"cannot create at {path}"))
            return
        failure = api._take_failure(resource, False)
        if failure is not None:
            phrase = HTTPStatus(failure).phrase.replace(" ", "")
            self._json(failure, _status(failure, phrase, "injected failure"))
            return
        if review is not None:
            answer = api._review(review, body)
            with contextlib.suppress(OSError):  # a client that timed out is gone
                self._json(*answer)
            return
        assert query is not None
        assert query.namespace is not None
        body.setdefault("metadata", {})["namespace"] = query.namespace
        try:
            created = api.create(resource, body)
        except KeyError:
            name = body["metadata"].get("name")
            self._json(409, _status(409, "AlreadyExists", f"{resource.plural} {name} exists"))
            return
        self._json(201, created)

    def do_PUT(self) -> None:
        """Replace: a ``metadata.resourceVersion`` other than the stored one is a 409
        Conflict, as optimistic concurrency on a real server."""
        api = self.server.api
        path = urlsplit(self.path).path.rstrip("/")
        body = self._body()
        query = api._route(path)
        api._log(path, {"verb": "update"}, query.resource if query is not None else None)
        if query is None or query.name is None or query.namespace is None:
            self._json(404, _status(404, "NotFound", f"cannot replace at {path}"))
            return
        failure = api._take_failure(query.resource, False)
        if failure is not None:
            phrase = HTTPStatus(failure).phrase.replace(" ", "")
            self._json(failure, _status(failure, phrase, "injected failure"))
            return
        body.setdefault("metadata", {})["namespace"] = query.namespace
        with api._cond:
            stored = api._objects[query.resource].get((query.namespace, query.name))
            if stored is None:
                self._json(404, _status(404, "NotFound", f"{query.name} not found"))
                return
            expected = body["metadata"].get("resourceVersion")
            if expected and expected != stored["metadata"]["resourceVersion"]:
                message = f"the object has been modified; {expected} is not the latest"
                self._json(409, _status(409, "Conflict", message))
                return
            replaced = api.update(query.resource, body)
        self._json(200, replaced)

    def _client_gone(self) -> bool:
        """Whether the client closed the connection (a watch request has no more to send)."""
        readable, _, _ = select.select([self.connection], [], [], 0)
        if not readable:
            return False
        try:
            return bool(self.connection.recv(1, socket.MSG_PEEK) == b"")
        except OSError:
            return True

    def _json(self, status: int, body: Obj) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _watch(self, lines: Generator[bytes | None]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for line in lines:
                if line is None:  # drop the connection mid-stream
                    self.close_connection = True
                    _shutdown(self.connection)
                    return
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            self.close_connection = True
        finally:
            lines.close()


def _selector(params: Mapping[str, str]) -> Callable[[Obj], bool]:
    labels_required = [r.strip() for r in params.get("labelSelector", "").split(",") if r.strip()]
    fields_required = [r.strip() for r in params.get("fieldSelector", "").split(",") if r.strip()]

    def selects(obj: Obj) -> bool:
        metadata = obj.get("metadata", {})
        labels = metadata.get("labels") or {}
        if not all(_label_matches(requirement, labels) for requirement in labels_required):
            return False
        fields = {
            "metadata.name": metadata.get("name"),
            "metadata.namespace": metadata.get("namespace"),
        }
        for requirement in fields_required:
            key, _, value = requirement.partition("=")
            if fields.get(key.strip()) != value.removeprefix("=").strip():
                return False
        return True

    return selects


def _label_matches(requirement: str, labels: Mapping[str, str]) -> bool:
    if "!=" in requirement:
        key, _, value = requirement.partition("!=")
        return labels.get(key.strip()) != value.strip()
    if "=" in requirement:
        key, _, value = requirement.partition("=")
        return labels.get(key.strip()) == value.removeprefix("=").strip()
    if requirement.startswith("!"):
        return requirement[1:].strip() not in labels
    return requirement in labels


def _status(code: int, reason: str, message: str) -> Obj:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _line(kind: str, obj: Obj) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _shutdown(connection: socket.socket) -> None:
    with contextlib.suppress(OSError):
        connection.shutdown(socket.SHUT_RDWR)


# -- helpers for tests of discovery ------------------------------------------------------------


class RecordingSink:
    """An ``EndpointSink`` and ``ObjectiveSink`` that records what it is told."""

    def __init__(self) -> None:
        self.events: list[EndpointEvent] = []
        self.endpoints: dict[str, EndpointInfo] = {}
        self.synced = False
        self.synced_calls = 0
        self.objectives: dict[str, int | None] | None = None
        self.rules: tuple[ModelRewriteRule, ...] | None = None

    def apply(self, event: EndpointEvent) -> None:
        self.events.append(event)
        if event.kind is EndpointEventKind.ADD_OR_UPDATE:
            self.endpoints[event.endpoint.name] = event.endpoint
        else:
            self.endpoints.pop(event.endpoint.name, None)

    def mark_synced(self) -> None:
        self.synced = True
        self.synced_calls += 1

    def mark_unsynced(self) -> None:
        self.synced = False

    def set_objectives(self, priorities: Mapping[str, int | None]) -> None:
        self.objectives = dict(priorities)

    def set_rules(self, rules: Sequence[ModelRewriteRule]) -> None:
        self.rules = tuple(rules)

    def addresses(self) -> dict[str, str]:
        """``{endpoint name: ip:port}`` of the current endpoints."""
        return {name: e.address.host_port() for name, e in self.endpoints.items()}

    def kinds(self, name: str) -> list[EndpointEventKind]:
        """The kinds of the events received for the endpoint ``name``, in order."""
        return [e.kind for e in self.events if e.endpoint.name == name]


async def wait_until(
    condition: Callable[[], bool], *, within: float = 5.0, what: str = "the condition"
) -> None:
    """Polls ``condition`` until it holds; fails the test after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@contextlib.contextmanager
def kube_client(server: KubeApiServer) -> Iterator[ApiClient]:
    """A real ``kubernetes`` ``ApiClient`` talking to the loopback server, closed afterwards."""
    client = ApiClient(Configuration(host=server.url))
    try:
        yield client
    finally:
        _close_client(client)


# ``ApiClient.close`` is untyped in the ``kubernetes`` package.
_close_client = cast(Callable[[ApiClient], None], ApiClient.close)


@contextlib.asynccontextmanager
async def running(source: EndpointSource, sink: RecordingSink) -> AsyncIterator[asyncio.Task[None]]:
    """Runs ``source.run(sink)`` for the block; cancels it (and checks it ends) afterwards."""
    task = asyncio.create_task(source.run(sink))
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=5)


def pool_source(api_client: ApiClient, **options: Any) -> InferencePoolSource:
    """An InferencePoolSource for pool ``default/pool`` with fast retries, for tests."""
    return InferencePoolSource(
        api_client,
        namespace="default",
        pool_name="pool",
        resync_backoff=(0.05, 0.2),
        **options,
    )


def write_kubeconfig(path: Path, server_url: str) -> Path:
    """A minimal kubeconfig for the loopback server (plain HTTP), namespace ``default``."""
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters:
- name: loopback
  cluster:
    server: {server_url}
users:
- name: tester
  user:
    token: not-checked
contexts:
- name: loopback
  context:
    cluster: loopback
    user: tester
    namespace: default
current-context: loopback
"""
    )
    return path
