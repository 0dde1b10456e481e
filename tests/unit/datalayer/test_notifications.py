"""Notification data sources: config validation and runtime delivery to extractors."""

from __future__ import annotations

import asyncio
import logging
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from app.config.loader import ConfigError, LoadedConfig, load_config
from app.plugins import KubernetesAccess, build_registry
from app.settings import Settings
from app.wiring.data_layer import collectors as _collectors
from domain.datastore.endpoint import Endpoint
from domain.datastore.store import Datastore
from domain.plugins.base import PluginRegistry, TypedName, class_factory
from ports.datalayer import MetricsText, NotificationEvent, NotificationKind
from ports.endpoints import EndpointAddress, EndpointEvent, EndpointEventKind, EndpointInfo
from ports.observer import NoopObserver
from tests.support.kube_api import wait_until
from tests.support.scheduling import plugin_handle

OBJECTIVE_GVK = "inference.networking.x-k8s.io/v1alpha2, Kind=InferenceObjective"
K8S_SOURCE = """\
- type: k8s-notification-source
  parameters: {group: inference.networking.x-k8s.io, version: v1alpha2, kind: InferenceObjective}
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class GvkParameters:
    gvk: str = OBJECTIVE_GVK


class RecordingNotificationExtractor:
    def __init__(self, typed_name: TypedName, parameters: GvkParameters) -> None:
        self.typed_name = typed_name
        self._gvk = parameters.gvk
        self.events: list[NotificationEvent] = []
        self.fail = False

    def gvk(self) -> str:
        return self._gvk

    def extract_notification(self, event: NotificationEvent) -> None:
        self.events.append(event)
        if self.fail:
            raise ValueError("spec.priority: not an integer")


class RecordingEndpointExtractor:
    def __init__(self, typed_name: TypedName, parameters: object) -> None:
        self.typed_name = typed_name
        self.events: list[tuple[EndpointEventKind, str]] = []

    def extract_endpoint(self, event: EndpointEvent, endpoint: Endpoint) -> None:
        self.events.append((event.kind, endpoint.name))


class EventReadingExtractor:
    """A polled-data extractor that wants notification events (a mismatch for metrics)."""

    def __init__(self, typed_name: TypedName, parameters: object) -> None:
        self.typed_name = typed_name

    def expected_input_type(self) -> type:
        return NotificationEvent

    def extract(self, data: object, endpoint: Endpoint, now: float) -> None:
        raise AssertionError("never called")


class ScriptedNotificationSource:
    """Delivers what the test puts in ``pending`` until cancelled."""

    def __init__(self, typed_name: TypedName, parameters: GvkParameters) -> None:
        self.typed_name = typed_name
        self._gvk = parameters.gvk
        self.pending: asyncio.Queue[NotificationEvent] = asyncio.Queue()
        self.cancelled = False

    def gvk(self) -> str:
        return self._gvk

    def output_type(self) -> type:
        return NotificationEvent

    async def run(self, deliver: Callable[[NotificationEvent], None]) -> None:
        try:
            while True:
                deliver(await self.pending.get())
        except asyncio.CancelledError:
            self.cancelled = True
            raise


def _no_client() -> object:
    raise AssertionError("no API client in these tests")


def registry(*, kubernetes: bool = True) -> PluginRegistry:
    access = KubernetesAccess(namespace="default", api_client_factory=_no_client)  # type: ignore[arg-type]
    reg = build_registry(include_entry_points=False, kubernetes=access if kubernetes else None)
    for type_name, cls, params in (
        ("test-notification-extractor", RecordingNotificationExtractor, GvkParameters),
        ("test-endpoint-extractor", RecordingEndpointExtractor, dict),
        ("test-event-reader", EventReadingExtractor, dict),
        ("test-notification-source", ScriptedNotificationSource, GvkParameters),
    ):
        reg.register(type_name, class_factory(type_name, cls), parameters=params)
    return reg


def load(text: str, *, kubernetes: bool = True, datastore: Datastore | None = None) -> LoadedConfig:
    return load_config(
        textwrap.dedent(text),
        registry=registry(kubernetes=kubernetes),
        handle=plugin_handle(datastore=datastore),
    )


def error(text: str, *, kubernetes: bool = True) -> str:
    with pytest.raises(ConfigError) as caught:
        load(text, kubernetes=kubernetes)
    return str(caught.value)


# -- config ------------------------------------------------------------------------------------


def test_k8s_source_is_named_after_its_gvk_and_feeds_extractors_of_that_gvk() -> None:
    loaded = load(
        "plugins:\n"
        + K8S_SOURCE
        + textwrap.dedent(
            f"""\
        - {{name: ex, type: test-notification-extractor}}
        dataLayer:
          sources:
          - pluginRef: "{OBJECTIVE_GVK}"
            extractors: [{{pluginRef: ex}}]
        """
        )
    )
    assert loaded.data_layer is not None
    [spec] = loaded.data_layer.sources
    assert spec.source.typed_name == TypedName("k8s-notification-source", OBJECTIVE_GVK)
    assert [e.typed_name.name for e in spec.extractors] == ["ex"]


def test_k8s_source_core_group_gvk_and_explicit_name() -> None:
    loaded = load(
        """\
        plugins:
        - {name: cms, type: k8s-notification-source, parameters: {version: v1, kind: ConfigMap}}
        """
    )
    source = loaded.plugins["cms"]
    assert source.gvk() == "/v1, Kind=ConfigMap"  # type: ignore[attr-defined]


@pytest.mark.parametrize("missing", ["version", "kind"])
def test_k8s_source_requires_version_and_kind(missing: str) -> None:
    parameters = {"group": "g", "version": "v1", "kind": "K"}
    del parameters[missing]
    text = f"plugins:\n- {{type: k8s-notification-source, parameters: {parameters}}}\n"
    message = error(text)
    assert message.startswith("plugins[0].parameters")
    assert f"{missing}: required" in message


def test_gvk_mismatch_names_the_extractor_entry() -> None:
    message = error(
        "plugins:\n"
        + K8S_SOURCE
        + textwrap.dedent(
            f"""\
        - {{name: good, type: test-notification-extractor}}
        - {{name: pods, type: test-notification-extractor, parameters: {{gvk: "/v1, Kind=Pod"}}}}
        dataLayer:
          sources:
          - pluginRef: "{OBJECTIVE_GVK}"
            extractors: [{{pluginRef: good}}, {{pluginRef: pods}}]
        """
        )
    )
    assert message == (
        'dataLayer.sources[0].extractors[1].pluginRef: extractor "pods" (type '
        'test-notification-extractor) cannot be fed by source "' + OBJECTIVE_GVK + '" (type '
        'k8s-notification-source): GVK mismatch: the extractor expects "/v1, Kind=Pod", '
        'the source watches "' + OBJECTIVE_GVK + '"'
    )


def test_notification_source_rejects_other_extractor_kinds() -> None:
    message = error(
        "plugins:\n"
        + K8S_SOURCE
        + textwrap.dedent(
            f"""\
        - {{name: ep, type: test-endpoint-extractor}}
        dataLayer:
          sources:
          - pluginRef: "{OBJECTIVE_GVK}"
            extractors: [{{pluginRef: ep}}]
        """
        )
    )
    assert message.startswith('dataLayer.sources[0].extractors[0].pluginRef: extractor "ep"')
    assert message.endswith("it does not take notifications (no extract_notification)")


def test_endpoint_notification_source_takes_only_endpoint_extractors() -> None:
    message = error(
        """\
        plugins:
        - {type: endpoint-notification-source}
        - {name: ex, type: test-notification-extractor}
        dataLayer:
          sources:
          - pluginRef: endpoint-notification-source
            extractors: [{pluginRef: ex}]
        """
    )
    assert message.startswith("dataLayer.sources[0].extractors[0].pluginRef:")
    assert message.endswith("it does not take endpoint events (no extract_endpoint)")


def test_extractor_input_type_must_match_the_source_output() -> None:
    message = error(
        """\
        plugins:
        - {type: metrics-data-source}
        - {name: reader, type: test-event-reader}
        dataLayer:
          sources:
          - pluginRef: metrics-data-source
            extractors: [{pluginRef: reader}]
        """
    )
    assert message.endswith(
        f"the extractor reads NotificationEvent, the source produces {MetricsText.__name__}"
    )


def test_k8s_source_in_static_mode_stops_the_load() -> None:
    message = error("plugins:\n" + K8S_SOURCE, kubernetes=False)
    assert message == (
        'plugins[0]: plugin "k8s-notification-source" of type k8s-notification-source needs '
        "the Kubernetes API, which is not used in static mode (--static-endpoints)"
    )


# -- runtime -----------------------------------------------------------------------------------

SETTINGS = Settings(static_endpoints="10.0.0.1:8000", metrics_endpoint_auth=False)


def endpoint(name: str) -> EndpointInfo:
    return EndpointInfo(name=name, address=EndpointAddress(ip="10.0.0.1", port=8000))


def apply_add_and_delete(datastore: Datastore) -> None:
    datastore.apply(EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=endpoint("a")))
    datastore.apply(EndpointEvent(kind=EndpointEventKind.DELETE, endpoint=endpoint("a")))


EXPECTED_ENDPOINT_EVENTS = [(EndpointEventKind.ADD_OR_UPDATE, "a"), (EndpointEventKind.DELETE, "a")]


async def test_endpoint_events_reach_the_extractors_of_endpoint_notification_sources() -> None:
    datastore = Datastore()
    loaded = load(
        """\
        plugins:
        - {type: endpoint-notification-source}
        - {name: bound, type: test-endpoint-extractor}
        - {name: unbound, type: test-endpoint-extractor}
        dataLayer:
          sources:
          - pluginRef: endpoint-notification-source
            extractors: [{pluginRef: bound}]
        """,
        datastore=datastore,
    )
    collectors = _collectors(loaded, datastore, SETTINGS, NoopObserver(), None)
    collectors.start()
    apply_add_and_delete(datastore)
    await collectors.stop()
    assert loaded.plugins["bound"].events == EXPECTED_ENDPOINT_EVENTS  # type: ignore[attr-defined]
    assert loaded.plugins["unbound"].events == []  # type: ignore[attr-defined]


async def test_without_endpoint_notification_source_every_endpoint_extractor_hears() -> None:
    datastore = Datastore()
    loaded = load(
        "plugins:\n- {name: one, type: test-endpoint-extractor}\ndataLayer: {sources: []}\n",
        datastore=datastore,
    )
    collectors = _collectors(loaded, datastore, SETTINGS, NoopObserver(), None)
    apply_add_and_delete(datastore)
    await collectors.stop()
    assert loaded.plugins["one"].events == EXPECTED_ENDPOINT_EVENTS  # type: ignore[attr-defined]


async def test_notifications_reach_extractors_and_failures_log_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    datastore = Datastore()
    loaded = load(
        """\
        plugins:
        - {name: src, type: test-notification-source}
        - {name: first, type: test-notification-extractor}
        - {name: second, type: test-notification-extractor}
        dataLayer:
          sources:
          - pluginRef: src
            extractors: [{pluginRef: first}, {pluginRef: second}]
        """,
        datastore=datastore,
    )
    source: ScriptedNotificationSource = loaded.plugins["src"]  # type: ignore[assignment]
    first: RecordingNotificationExtractor = loaded.plugins["first"]  # type: ignore[assignment]
    second: RecordingNotificationExtractor = loaded.plugins["second"]  # type: ignore[assignment]
    first.fail = True
    collectors = _collectors(loaded, datastore, SETTINGS, NoopObserver(), None)
    collectors.start()
    events = [
        NotificationEvent(kind=kind, gvk=OBJECTIVE_GVK, object={"metadata": {"name": name}})
        for kind, name in [
            (NotificationKind.ADD_OR_UPDATE, "x"),
            (NotificationKind.ADD_OR_UPDATE, "y"),
            (NotificationKind.DELETE, "x"),
        ]
    ]
    with caplog.at_level(logging.INFO, logger="domain.datalayer.collector"):
        for event in events:
            source.pending.put_nowait(event)
        await wait_until(lambda: len(second.events) == 3, what="three notifications")
        first.fail = False
        source.pending.put_nowait(events[0])
        await wait_until(lambda: len(second.events) == 4, what="the fourth notification")
    await collectors.stop()
    assert first.events == [*events, events[0]]
    assert second.events == [*events, events[0]]
    assert source.cancelled
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "notification extractor first/test-notification-extractor failing on "
        f"{OBJECTIVE_GVK}: spec.priority: not an integer",
        "notification extractor first/test-notification-extractor recovered",
    ]
