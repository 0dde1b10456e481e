"""Which endpoints a model-server pod contributes, and the endpoint set of a group of pods.

A pod contributes endpoints when its labels match the selector, it is Ready (condition
``Ready`` is ``True``), it has a pod IP and it is not being deleted. It then contributes one
endpoint per target port, named ``<pod>-rank-<i>`` with ``i`` the port's index in the target
ports, unless the annotation ``inference.networking.k8s.io/active-ports: "8000,8001"`` lists
the ports that are active: then only those ranks are endpoints.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from adapters.kubernetes.api import KubeObject
from ports.endpoints import (
    EndpointAddress,
    EndpointEvent,
    EndpointEventKind,
    EndpointInfo,
    EndpointSink,
)

__all__ = [
    "ACTIVE_PORTS_ANNOTATION",
    "PodEndpoints",
    "format_label_selector",
    "labels_match",
    "pod_endpoints",
    "validate_target_ports",
]

_LOG = logging.getLogger(__name__)

ACTIVE_PORTS_ANNOTATION = "inference.networking.k8s.io/active-ports"
_MAX_TARGET_PORTS = 8


def validate_target_ports(ports: Sequence[int]) -> tuple[int, ...]:
    """The ports as a tuple; ``ValueError`` unless 1 to 8 unique ports in 1..65535."""
    result = tuple(ports)
    if not 1 <= len(result) <= _MAX_TARGET_PORTS:
        raise ValueError(f"target ports: need 1 to {_MAX_TARGET_PORTS}, got {len(result)}")
    for port in result:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"target ports: {port!r} is not a port number")
    if len(set(result)) != len(result):
        raise ValueError("target ports: listed twice")
    return result


def format_label_selector(selector: Mapping[str, str]) -> str:
    """``k=v,k2=v2`` (sorted), the equality-based label selector of the API."""
    return ",".join(f"{key}={value}" for key, value in sorted(selector.items()))


def labels_match(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    """Whether every ``key=value`` of the selector is among the labels (empty: everything)."""
    return all(labels.get(key) == value for key, value in selector.items())


def pod_endpoints(
    pod: KubeObject, *, selector: Mapping[str, str], target_ports: Sequence[int]
) -> dict[str, EndpointInfo]:
    """The endpoints of one pod, by name; empty when the pod does not qualify."""
    metadata = _map(pod.get("metadata"))
    status = _map(pod.get("status"))
    name = metadata.get("name")
    ip = status.get("podIP")
    if not isinstance(name, str) or not name or not isinstance(ip, str) or not ip:
        return {}
    if metadata.get("deletionTimestamp") or not _ready(status):
        return {}
    labels = {str(k): str(v) for k, v in _map(metadata.get("labels")).items()}
    if not labels_match(labels, selector):
        return {}
    active = _active_ports(_map(metadata.get("annotations")))
    namespace = str(metadata.get("namespace") or "")
    endpoints: dict[str, EndpointInfo] = {}
    for rank, port in enumerate(target_ports):
        if active is not None and port not in active:
            continue
        address = EndpointAddress(ip=ip, port=port)
        endpoint_name = f"{name}-rank-{rank}"
        endpoints[endpoint_name] = EndpointInfo(
            name=endpoint_name,
            address=address,
            pod_name=name,
            namespace=namespace,
            labels=labels,
            metrics_host=address.host_port(),
            rank=rank,
        )
    return endpoints


class PodEndpoints:
    """The endpoints of a set of pods under a selector and target ports.

    Lives on the event loop thread. Every change is reported to the sink as the difference
    between the endpoints before and after it: no event for an endpoint that did not change.
    """

    def __init__(
        self,
        sink: EndpointSink,
        *,
        selector: Mapping[str, str],
        target_ports: Sequence[int],
    ) -> None:
        self._sink = sink
        self._selector = dict(selector)
        self._ports = tuple(target_ports)
        self._pods: dict[str, KubeObject] = {}
        self._endpoints: dict[str, dict[str, EndpointInfo]] = {}

    @property
    def pods(self) -> Mapping[str, KubeObject]:
        return self._pods

    def endpoint_count(self) -> int:
        return sum(len(endpoints) for endpoints in self._endpoints.values())

    def upsert(self, pod: KubeObject) -> None:
        name = _pod_name(pod)
        if not name:
            return
        self._pods[name] = pod
        self._update(name, self._compute(pod))

    def delete(self, pod: KubeObject) -> None:
        name = _pod_name(pod)
        self._pods.pop(name, None)
        self._update(name, {})

    def replace(
        self,
        pods: Mapping[str, KubeObject],
        *,
        selector: Mapping[str, str] | None = None,
        target_ports: Sequence[int] | None = None,
    ) -> None:
        """Full resync: the pods (and optionally selector and ports) replace the current ones."""
        if selector is not None:
            self._selector = dict(selector)
        if target_ports is not None:
            self._ports = tuple(target_ports)
        self._pods = dict(pods)
        for name in [n for n in self._endpoints if n not in self._pods]:
            self._update(name, {})
        for name, pod in self._pods.items():
            self._update(name, self._compute(pod))

    def clear(self) -> None:
        """Forgets every pod, deleting every endpoint."""
        self.replace({})

    def _compute(self, pod: KubeObject) -> dict[str, EndpointInfo]:
        return pod_endpoints(pod, selector=self._selector, target_ports=self._ports)

    def _update(self, pod_name: str, new: dict[str, EndpointInfo]) -> None:
        old = self._endpoints.get(pod_name, {})
        for name, endpoint in old.items():
            if name not in new:
                self._sink.apply(EndpointEvent(kind=EndpointEventKind.DELETE, endpoint=endpoint))
        for name, endpoint in new.items():
            if old.get(name) != endpoint:
                self._sink.apply(
                    EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=endpoint)
                )
        if new:
            self._endpoints[pod_name] = new
        else:
            self._endpoints.pop(pod_name, None)
        if old.keys() != new.keys():
            _LOG.debug("pod %s now has endpoints %s", pod_name, sorted(new))


def _ready(status: Mapping[str, Any]) -> bool:
    conditions = status.get("conditions")
    if not isinstance(conditions, list):
        return False
    for condition in conditions:
        if isinstance(condition, dict) and condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return False


def _active_ports(annotations: Mapping[str, Any]) -> set[int] | None:
    value = annotations.get(ACTIVE_PORTS_ANNOTATION)
    if value is None:
        return None
    ports: set[int] = set()
    for item in str(value).split(","):
        text = item.strip()
        if text.isdigit() and int(text) > 0:
            ports.add(int(text))
    return ports


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _pod_name(pod: KubeObject) -> str:
    name = _map(pod.get("metadata")).get("name")
    return name if isinstance(name, str) else ""
