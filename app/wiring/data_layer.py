"""The data layer: where endpoints come from (Kubernetes, a static list, or a worker's
supervisor) and the collectors that poll and watch the model servers."""

from __future__ import annotations

from app.config.loader import LoadedConfig
from app.metrics_relay import supervisor_binding, worker_binding
from app.settings import Settings
from app.wiring.role import ALONE, ProcessRole
from domain.datalayer.collector import Collectors, NotificationBinding, SourceBinding
from domain.datalayer.interfaces import EndpointExtractor, Extractor, NotificationExtractor
from domain.datalayer.plugins.endpoint_notification_source import EndpointNotificationSource
from domain.datastore.static_source import StaticEndpointSource, parse_endpoint_list
from domain.datastore.store import Datastore
from domain.flowcontrol import FlowController
from domain.plugins.base import plugins_with
from ports.datalayer import NotificationSource, PollingDataSource
from ports.endpoints import EndpointSource
from ports.objectives import ObjectiveSink
from ports.observer import Observer

__all__ = ["RELAYED_POLL_TIMEOUT", "collectors", "endpoint_source"]


#: A worker's collectors wait for the supervisor's next poll result as long as it takes.
RELAYED_POLL_TIMEOUT = 365 * 86400.0


def endpoint_source(
    settings: Settings, objectives: ObjectiveSink, role: ProcessRole
) -> EndpointSource:
    if role.link is not None:  # a worker: the supervisor discovers for the pod
        return role.link.endpoint_source(objectives)
    if settings.static_endpoints:
        return StaticEndpointSource(parse_endpoint_list(settings.static_endpoints))
    from app.kubernetes import kubernetes_source  # imports the Kubernetes client lazily

    return kubernetes_source(settings, objectives)


def collectors(
    loaded: LoadedConfig,
    datastore: Datastore,
    settings: Settings,
    observer: Observer,
    flow_controller: FlowController | None,
    role: ProcessRole = ALONE,
) -> Collectors:
    """Polling sources feed the collectors; notification sources run beside them. Endpoint
    events reach the extractors of the configured endpoint-notification-sources or, when
    none is configured, every EndpointExtractor plugin.

    Under ``--workers``, the supervisor's sources are teed to the workers (``hub``), and a
    worker's sources are the relayed ones of the same names (``link``): the model servers
    are polled and watched once per pod, and parsed once when the workers only need the
    metrics snapshots (``app.metrics_relay``)."""
    link, hub = role.link, role.hub

    def polling(binding: SourceBinding) -> SourceBinding:
        if link is not None:
            return worker_binding(binding, link)
        return supervisor_binding(binding, hub) if hub is not None else binding

    def notifying(source: NotificationSource) -> NotificationSource:
        if link is not None:
            return link.notification_source(source.typed_name, source.gvk(), source.output_type())
        return hub.notifications(source) if hub is not None else source

    bindings = []
    notifications = []
    endpoint_extractors: list[EndpointExtractor] = []
    endpoint_sources = 0
    if loaded.data_layer is not None:
        for spec in loaded.data_layer.sources:
            if isinstance(spec.source, PollingDataSource):
                extractors = tuple(e for e in spec.extractors if isinstance(e, Extractor))
                bindings.append(polling(SourceBinding(spec.source, extractors, spec.interval)))
            elif isinstance(spec.source, NotificationSource):
                notified = tuple(e for e in spec.extractors if isinstance(e, NotificationExtractor))
                notifications.append(NotificationBinding(notifying(spec.source), notified))
            elif isinstance(spec.source, EndpointNotificationSource):
                endpoint_sources += 1
                endpoint_extractors.extend(
                    e
                    for e in spec.extractors
                    if isinstance(e, EndpointExtractor) and e not in endpoint_extractors
                )
    if not endpoint_sources:
        endpoint_extractors = plugins_with(loaded.plugins.values(), EndpointExtractor)
    return Collectors(
        datastore=datastore,
        bindings=bindings,
        interval=settings.refresh_metrics_interval,
        poll_timeout=RELAYED_POLL_TIMEOUT if link is not None else 1.0,
        endpoint_extractors=endpoint_extractors,
        notifications=notifications,
        observer=observer,
        on_update=flow_controller.notify if flow_controller is not None else None,
    )
