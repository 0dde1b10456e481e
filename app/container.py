"""The composition root: wires settings, adapters and the domain."""

from __future__ import annotations

from dependency_injector import containers, providers

from adapters.envoy.server import GrpcServers
from adapters.jsoncodec.orjson_codec import OrjsonCodec
from adapters.prometheus.exporter import PrometheusObserver
from adapters.workerlink import SupervisorHub
from adapters.xxhash.block_hasher import XxhashBlockHasher
from app.observability import EppObserver, Observability, build_tracing
from app.settings import Settings
from app.wiring import data_layer, request_path, serving, shared_state
from app.wiring.role import ALONE, ProcessRole
from domain.datastore.objectives import ObjectiveStore
from domain.datastore.store import Datastore
from domain.plugins.state import RequestStates
from domain.requestcontrol.director import Director
from domain.scheduling.observer import SchedulingReporter
from domain.sharedstate.degraded import DegradedGauge

__all__ = ["Container", "ProcessRole", "build_container", "build_supervisor_container"]


class Container(containers.DeclarativeContainer):
    """Providers for everything the process runs. Tests override any of them."""

    settings = providers.Dependency(instance_of=Settings)
    codec = providers.Singleton(OrjsonCodec)
    hasher = providers.Singleton(XxhashBlockHasher)
    datastore = providers.Singleton(Datastore)
    objectives = providers.Singleton(ObjectiveStore)
    request_states = providers.Singleton(RequestStates)
    registry = providers.Singleton(request_path.registry, settings)
    # alone, a worker of a pod, or its supervisor (app/workers)
    role: providers.Provider[ProcessRole] = providers.Object(ALONE)
    # --- observability (spec section 9): one Observer for the domain and the adapters ---
    metrics_observer = providers.Singleton(
        PrometheusObserver, providers.Callable(serving.metric_catalogue, settings)
    )
    tracing = providers.Singleton(build_tracing, settings)
    observer = providers.Singleton(EppObserver, metrics_observer, tracing)
    # --- shared state (docs/shared-state.md): in process, or on Redis with --redis-url ---
    redis_client = providers.Singleton(shared_state.redis_client, settings)
    # One degraded gauge for every component on the shared store.
    shared_degraded = providers.Singleton(DegradedGauge, observer)
    prefix_index = providers.Singleton(
        shared_state.prefix_index, settings, redis_client, observer, shared_degraded
    )
    # The other processes' in-flight load: none without --redis-url.
    shared_load = providers.Singleton(
        shared_state.shared_load, settings, redis_client, observer, shared_degraded
    )
    # The session_id bindings of session affinity: shared too with --redis-url.
    sessions = providers.Singleton(shared_state.sessions, settings, redis_client)
    # The KV-block index's shared copy (precise prefix routing): on Redis with --redis-url.
    kv_block_store = providers.Singleton(shared_state.kv_block_store, settings, redis_client)
    scheduling_observer = providers.Singleton(SchedulingReporter, observer)
    metrics_authorizer = providers.Singleton(serving.metrics_authorizer, settings)
    pprof_pages = providers.Singleton(serving.pprof_pages, settings)
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
        request_path.handle,
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
    config_text = providers.Singleton(request_path.config_text, settings)
    config = providers.Singleton(
        request_path.loaded_config, config_text, registry, handle, settings
    )
    flow_controller = providers.Singleton(
        request_path.flow_controller, config, datastore, settings, observer, shared_load
    )
    request_control = providers.Singleton(
        request_path.request_control,
        config,
        settings,
        scheduling_observer,
        flow_controller,
        observer,
    )
    collectors = providers.Singleton(
        data_layer.collectors, config, datastore, settings, observer, flow_controller, role
    )
    endpoint_source = providers.Singleton(data_layer.endpoint_source, settings, objectives, role)
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
        request_path.config_watcher,
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
    certificate = providers.Singleton(serving.certificate, settings)
    leader_elector = providers.Singleton(serving.leader_elector, settings)
    servers = providers.Singleton(
        GrpcServers,
        processor,
        providers.Callable(serving.server_options, settings, role, certificate),
        observer=observer,
        leader=providers.Callable(serving.leader_check, leader_elector),
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
