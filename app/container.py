"""The composition root: wires settings, adapters and the domain."""

from __future__ import annotations

import functools
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dependency_injector import containers, providers

from adapters.envoy.extproc import StreamLimits
from adapters.envoy.server import GrpcServers, ServerOptions
from adapters.envoy.tls import (
    ServerCertificate,
    load_certificate,
    load_client_ca,
    self_signed_certificate,
)
from adapters.jsoncodec.orjson_codec import OrjsonCodec
from adapters.prometheus.exporter import PrometheusObserver, TextPage
from adapters.redis import (
    RedisClient,
    RedisKVBlockStore,
    RedisPrefixIndex,
    RedisSessionStore,
    RedisSharedLoad,
    connect,
)
from adapters.workerlink import SupervisorHub, WorkerLink
from adapters.xxhash.block_hasher import XxhashBlockHasher
from app.config.loader import LoadedConfig, load_config
from app.config.overrides import ConfigOverrides
from app.config_watch import ConfigWatcher
from app.flowcontrol import build_flow_controller
from app.metrics_relay import supervisor_binding, worker_binding
from app.observability import EppObserver, Observability, build_tracing
from app.plugins import KubernetesAccess, build_registry
from app.settings import CIPHER_SUITES, Settings
from domain.datalayer.collector import Collectors, NotificationBinding, SourceBinding
from domain.datalayer.interfaces import EndpointExtractor, Extractor, NotificationExtractor
from domain.datalayer.plugins.endpoint_notification_source import EndpointNotificationSource
from domain.datastore.objectives import ObjectiveStore
from domain.datastore.static_source import StaticEndpointSource, parse_endpoint_list
from domain.datastore.store import Datastore
from domain.flowcontrol import FlowController
from domain.plugins.base import PluginRegistry, plugins_with
from domain.plugins.handle import Handle
from domain.plugins.state import RequestStates
from domain.prefixcache.index import InMemoryPrefixIndex
from domain.requestcontrol.admission import FlowControlAdmission, FlowSaturation
from domain.requestcontrol.director import Director, RequestControl
from domain.scheduling.observer import SchedulingObserver, SchedulingReporter
from domain.scheduling.scheduler import Scheduler
from domain.scheduling.types import Candidate
from domain.sharedstate.degraded import DegradedGauge
from domain.sharedstate.load import LocalSharedLoad
from domain.sharedstate.resilient_index import ResilientPrefixIndex
from domain.sharedstate.sessions import InMemorySessionStore
from ports.access import RequestAuthorizer
from ports.codec import JsonCodec
from ports.datalayer import NotificationSource, PollingDataSource
from ports.endpoints import EndpointSource
from ports.kv_events import KVBlockStore
from ports.metric_catalogue import CATALOGUE, EXTPROC_STREAM_METRICS, Metric
from ports.objectives import ObjectiveSink
from ports.observer import Observer
from ports.prefix_index import BlockHasher, PrefixIndex
from ports.sessions import SessionStore
from ports.shared_state import SharedLoad

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

    from adapters.kubernetes import LeaderElector

__all__ = ["Container", "build_container", "build_supervisor_container"]


def _certificate(settings: Settings) -> ServerCertificate | None:
    if not settings.secure_serving:
        return None
    if settings.cert_path is not None:
        return load_certificate(settings.cert_path)
    return self_signed_certificate()


#: A worker's collectors wait for the supervisor's next poll result as long as it takes.
RELAYED_POLL_TIMEOUT = 365 * 86400.0


@dataclass(frozen=True, slots=True)
class ProcessRole:
    """What this process is, chosen once: alone (the default); a worker of a pod (``link``
    to its supervisor, which feeds it, and ``handoff``, the socket on which the supervisor
    hands it accepted connections); or the supervisor (``hub``, which tees its data layer
    to the workers)."""

    link: WorkerLink | None = None
    handoff: socket.socket | None = None
    hub: SupervisorHub | None = None

    @property
    def worker(self) -> bool:
        return self.link is not None


_ALONE = ProcessRole()


def _endpoint_source(
    settings: Settings, objectives: ObjectiveSink, role: ProcessRole
) -> EndpointSource:
    if role.link is not None:  # a worker: the supervisor discovers for the pod
        return role.link.endpoint_source(objectives)
    if settings.static_endpoints:
        return StaticEndpointSource(parse_endpoint_list(settings.static_endpoints))
    from app.kubernetes import kubernetes_source  # imports the Kubernetes client lazily

    return kubernetes_source(settings, objectives)


def _metrics_authorizer(settings: Settings) -> RequestAuthorizer | None:
    if not settings.metrics_endpoint_auth:
        return None
    from app.kubernetes import metrics_authorizer  # imports the Kubernetes client lazily

    return metrics_authorizer(settings)


def _leader_elector(settings: Settings) -> LeaderElector | None:
    if not settings.ha_enable_leader_election:
        return None
    from app.kubernetes import leader_elector

    return leader_elector(settings)


def _leader_check(elector: LeaderElector | None) -> Callable[[], bool] | None:
    return elector.leader if elector is not None else None


def _pprof_pages(settings: Settings) -> dict[str, TextPage]:
    if not settings.enable_pprof:
        return {}
    from app.profiling import pprof_pages

    return pprof_pages()


def _redis_client(settings: Settings) -> RedisClient | None:
    """The one Redis client of the process with ``--redis-url``, else None. It connects
    lazily: a Redis that is down at start-up only degrades the shared state."""
    return connect(settings.redis_url) if settings.redis_url else None


def _prefix_index(
    settings: Settings, client: RedisClient | None, observer: Observer, degraded: DegradedGauge
) -> PrefixIndex:
    if client is None:
        return InMemoryPrefixIndex()
    remote = RedisPrefixIndex(
        client, key_prefix=settings.shared_key_prefix(), ttl=settings.redis_prefix_ttl
    )
    return ResilientPrefixIndex(
        remote,
        InMemoryPrefixIndex(),
        observer=observer,
        degraded_gauge=degraded,
        budget=settings.redis_deadline,
        claim_budget=settings.redis_claim_deadline,
        # The first requests find open connections (a burst of new prefixes needs a match, a
        # load refresh and a claim each) and a loaded match script.
        warm_connections=16,
    )


def _shared_load(
    settings: Settings, client: RedisClient | None, observer: Observer, degraded: DegradedGauge
) -> SharedLoad:
    if client is None:
        return LocalSharedLoad()
    return RedisSharedLoad(
        client,
        key_prefix=settings.shared_key_prefix(),
        lease=settings.redis_lease,
        staleness=settings.redis_load_staleness,
        refresh_budget=settings.redis_deadline,
        observer=observer,
        on_degraded=functools.partial(degraded.set, "shared-load"),
    )


def _kv_block_store(settings: Settings, client: RedisClient | None) -> KVBlockStore | None:
    """The KV-block index's shared copy on Redis with ``--redis-url``, else none."""
    if client is None:
        return None
    return RedisKVBlockStore(
        client, key_prefix=settings.shared_key_prefix(), ttl=settings.redis_prefix_ttl
    )


def _sessions(settings: Settings, client: RedisClient | None) -> SessionStore:
    if client is None:
        return InMemorySessionStore()
    return RedisSessionStore(client, key_prefix=settings.shared_key_prefix())


def _registry(settings: Settings) -> PluginRegistry:
    """Every plugin type; Kubernetes-backed ones reach the API unless in static mode."""
    if settings.static_endpoints:
        return build_registry()

    def api_client() -> ApiClient:
        from adapters.kubernetes import api_client_from_environment

        return api_client_from_environment(settings.kubeconfig)

    access = KubernetesAccess(namespace=settings.pool_namespace, api_client_factory=api_client)
    return build_registry(kubernetes=access)


def _config_text(settings: Settings) -> str | None:
    if settings.config_text is not None:
        return settings.config_text
    if settings.config_file is not None:
        return settings.config_file.read_text()
    return None


def _handle(
    codec: JsonCodec,
    hasher: BlockHasher,
    prefix_index: PrefixIndex,
    datastore: Datastore,
    observer: Observer,
    shared_load: SharedLoad,
    sessions: SessionStore,
    settings: Settings,
    kv_block_store: KVBlockStore | None = None,
    shared_degraded: DegradedGauge | None = None,
) -> Handle:
    return Handle(
        codec=codec,
        hasher=hasher,
        prefix_index=prefix_index,
        datastore=datastore,
        observer=observer,
        shared_load=shared_load,
        sessions=sessions,
        shared_state_deadline=settings.redis_deadline,
        kv_block_store=kv_block_store,
        shared_kv_blocks=(
            shared_load
            if settings.redis_shared_admission and isinstance(shared_load, RedisSharedLoad)
            else None
        ),
        shared_degraded=shared_degraded,
    )


def _server_options(
    settings: Settings, role: ProcessRole, certificate: ServerCertificate | None
) -> ServerOptions:
    """The ext_proc and health servers' options from the flags. A worker serves no health
    port (its supervisor serves the pod's) and shares the ext_proc port."""
    return ServerOptions(
        host=settings.bind_address,
        grpc_port=settings.grpc_port,
        health_port=None if role.worker else settings.grpc_health_port,
        health_on_extproc_port=settings.health_checking,
        transport=settings.extproc_transport,
        certificate=certificate,
        reload_certificate_from=settings.cert_path if settings.enable_cert_reload else None,
        client_ca=(
            load_client_ca(settings.grpc_client_ca_file)
            if settings.grpc_client_ca_file is not None
            else None
        ),
        cipher_suites=tuple(CIPHER_SUITES[name] for name in settings.tls_cipher_suites),
        limits=StreamLimits(
            max_request_body_bytes=settings.max_request_body_bytes,
            max_response_buffer_bytes=settings.max_response_buffer_bytes,
            idle_timeout=settings.stream_idle_timeout,
            max_unrouted_streams=settings.max_unrouted_streams,
            protocol_error_pause=settings.protocol_error_pause,
        ),
        max_concurrent_streams=settings.max_concurrent_streams,
        max_streams_per_connection=settings.max_streams_per_connection,
        max_receive_message_length=settings.grpc_max_recv_msg_size,
        max_send_message_length=settings.grpc_max_send_msg_size,
        shared_port=role.worker,
        handoff=role.handoff,
        stream_metrics=settings.enable_grpc_stream_metrics,
    )


def _metric_catalogue(settings: Settings) -> tuple[Metric, ...]:
    """What /metrics exports: the ext_proc stream metrics only with
    ``--enable-grpc-stream-metrics``, as the llm-d router."""
    if settings.enable_grpc_stream_metrics:
        return CATALOGUE
    return tuple(metric for metric in CATALOGUE if metric not in EXTPROC_STREAM_METRICS)


def _loaded_config(
    text: str | None, registry: PluginRegistry, handle: Handle, settings: Settings
) -> LoadedConfig:
    return load_config(
        text, registry=registry, handle=handle, overrides=ConfigOverrides.from_settings(settings)
    )


def _flow_controller(
    loaded: LoadedConfig,
    datastore: Datastore,
    settings: Settings,
    observer: Observer,
    shared_load: SharedLoad,
) -> FlowController | None:
    """The flow controller when the ``flowControl`` gate is on, else None (legacy admission);
    it shares its flows with the pool's other processes on the shared store
    (``--redis-shared-admission``)."""
    if loaded.flow_control is None:
        return None
    saturation = FlowSaturation(
        loaded.saturation_detector, lambda: [Candidate(e) for e in datastore.endpoints()]
    )
    pooled = settings.redis_shared_admission and isinstance(shared_load, RedisSharedLoad)
    controller = build_flow_controller(
        loaded.flow_control,
        saturation=saturation,
        plugins=loaded.plugins,
        observer=observer,
        pool_name=settings.pool_name,
        pool=shared_load if pooled and isinstance(shared_load, RedisSharedLoad) else None,
    )
    saturation.controller = controller
    return controller


def _request_control(
    loaded: LoadedConfig,
    settings: Settings,
    scheduling_observer: SchedulingObserver,
    flow_controller: FlowController | None,
    observer: Observer,
) -> RequestControl:
    admission = None
    if flow_controller is not None:
        admission = FlowControlAdmission(
            flow_controller, pool_name=settings.pool_name, observer=observer
        )
    return RequestControl(
        admission=admission,
        parser=loaded.parser,
        scheduler=Scheduler(loaded.profile_handler, loaded.profiles, scheduling_observer),
        saturation_detector=loaded.saturation_detector,
        data_producers=loaded.data_producers,
        admitters=loaded.admitters,
        placement_claimers=loaded.placement_claimers,
        pre_request=loaded.pre_request,
        response_header=loaded.response_header,
        response_body=loaded.response_body,
        prepare_data_timeout=settings.prepare_data_timeout,
        subset_filter=not settings.disable_endpoint_subset_filter,
        explain_decisions=settings.explain_decisions,
        emit_endpoint_scores=settings.emit_endpoint_scores,
    )


def _collectors(
    loaded: LoadedConfig,
    datastore: Datastore,
    settings: Settings,
    observer: Observer,
    flow_controller: FlowController | None,
    role: ProcessRole = _ALONE,
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


def _config_watcher(
    settings: Settings,
    text: str | None,
    loaded: LoadedConfig,
    registry: PluginRegistry,
    handle: Handle,
    datastore: Datastore,
    director: Director,
    scheduling_observer: SchedulingObserver,
    flow_controller: FlowController | None,
    observer: Observer,
) -> ConfigWatcher | None:
    """``--watch-config-file``: reloads build the Director's plugins as start-up does."""
    if not settings.watch_config_file or settings.config_file is None:
        return None

    def build_control(new: LoadedConfig) -> RequestControl:
        return _request_control(new, settings, scheduling_observer, flow_controller, observer)

    return ConfigWatcher(
        settings.config_file,
        running_text=text,
        running=loaded,
        registry=registry,
        handle=handle,
        datastore=datastore,
        director=director,
        build_control=build_control,
        overrides=ConfigOverrides.from_settings(settings),
    )


class Container(containers.DeclarativeContainer):
    """Providers for everything the process runs. Tests override any of them."""

    settings = providers.Dependency(instance_of=Settings)
    codec = providers.Singleton(OrjsonCodec)
    hasher = providers.Singleton(XxhashBlockHasher)
    datastore = providers.Singleton(Datastore)
    objectives = providers.Singleton(ObjectiveStore)
    request_states = providers.Singleton(RequestStates)
    registry = providers.Singleton(_registry, settings)
    # alone, a worker of a pod, or its supervisor (app/workers)
    role: providers.Provider[ProcessRole] = providers.Object(_ALONE)
    # --- observability (spec section 9): one Observer for the domain and the adapters ---
    metrics_observer = providers.Singleton(
        PrometheusObserver, providers.Callable(_metric_catalogue, settings)
    )
    tracing = providers.Singleton(build_tracing, settings)
    observer = providers.Singleton(EppObserver, metrics_observer, tracing)
    # --- shared state (docs/shared-state.md): in process, or on Redis with --redis-url ---
    redis_client = providers.Singleton(_redis_client, settings)
    # One degraded gauge for every component on the shared store.
    shared_degraded = providers.Singleton(DegradedGauge, observer)
    prefix_index = providers.Singleton(
        _prefix_index, settings, redis_client, observer, shared_degraded
    )
    # The other processes' in-flight load: none without --redis-url.
    shared_load = providers.Singleton(
        _shared_load, settings, redis_client, observer, shared_degraded
    )
    # The session_id bindings of session affinity: shared too with --redis-url.
    sessions = providers.Singleton(_sessions, settings, redis_client)
    # The KV-block index's shared copy (precise prefix routing): on Redis with --redis-url.
    kv_block_store = providers.Singleton(_kv_block_store, settings, redis_client)
    scheduling_observer = providers.Singleton(SchedulingReporter, observer)
    metrics_authorizer = providers.Singleton(_metrics_authorizer, settings)
    pprof_pages = providers.Singleton(_pprof_pages, settings)
    observability = providers.Singleton(
        Observability,
        settings=settings,
        metrics=metrics_observer,
        tracing=tracing,
        datastore=datastore,
        prefix_index=prefix_index,
        authorizer=metrics_authorizer,
        pages=pprof_pages,
        loopback_metrics=role.provided.worker,
    )
    # --- end observability ---
    handle = providers.Singleton(
        _handle,
        codec,
        hasher,
        prefix_index,
        datastore,
        observer,
        shared_load,
        sessions,
        settings,
        kv_block_store,
        shared_degraded,
    )
    config_text = providers.Singleton(_config_text, settings)
    config = providers.Singleton(_loaded_config, config_text, registry, handle, settings)
    flow_controller = providers.Singleton(
        _flow_controller, config, datastore, settings, observer, shared_load
    )
    request_control = providers.Singleton(
        _request_control, config, settings, scheduling_observer, flow_controller, observer
    )
    collectors = providers.Singleton(
        _collectors, config, datastore, settings, observer, flow_controller, role
    )
    endpoint_source = providers.Singleton(_endpoint_source, settings, objectives, role)
    processor = providers.Singleton(
        Director,
        datastore=datastore,
        codec=codec,
        control=request_control,
        objectives=objectives,
        states=request_states,
        observer=observer,
    )
    config_watcher = providers.Singleton(
        _config_watcher,
        settings,
        config_text,
        config,
        registry,
        handle,
        datastore,
        processor,
        scheduling_observer,
        flow_controller,
        observer,
    )
    certificate = providers.Singleton(_certificate, settings)
    leader_elector = providers.Singleton(_leader_elector, settings)
    servers = providers.Singleton(
        GrpcServers,
        processor,
        providers.Callable(_server_options, settings, role, certificate),
        observer=observer,
        leader=providers.Callable(_leader_check, leader_elector),
    )


def build_container(settings: Settings, role: ProcessRole | None = None) -> Container:
    """The process's container, for its ``role`` (default: a process serving alone)."""
    container = Container()
    container.settings.override(settings)
    if role is not None:
        container.role.override(providers.Object(role))
    return container


def build_supervisor_container(settings: Settings, hub: SupervisorHub) -> Container:
    """The supervisor's container (``--workers``): only its data layer is used (endpoint
    discovery, the model servers' polls, notification watches), teed into ``hub``; it
    serves no request, so it has no flow controller and no shared-state client."""
    container = build_container(settings, ProcessRole(hub=hub))
    container.redis_client.override(providers.Object(None))
    container.flow_controller.override(providers.Object(None))
    container.objectives.override(providers.Object(hub.objectives(ObjectiveStore())))
    return container
