"""The request path from the configuration: the plugin registry, the loaded config, the
plugins' handle, flow control, the Director's request control and the config watcher that
rebuilds it on reload."""

from __future__ import annotations

from typing import TYPE_CHECKING

from adapters.redis import (
    RedisSharedLoad,
)
from app.config.loader import LoadedConfig, load_config
from app.config.overrides import ConfigOverrides
from app.config_watch import ConfigWatcher
from app.flowcontrol import build_flow_controller
from app.plugins import KubernetesAccess, build_registry
from app.settings import Settings
from domain.datastore.store import Datastore
from domain.flowcontrol import FlowController
from domain.plugins.base import PluginRegistry
from domain.plugins.handle import Handle
from domain.requestcontrol.admission import FlowControlAdmission, FlowSaturation
from domain.requestcontrol.director import Director, RequestControl
from domain.scheduling.observer import SchedulingObserver
from domain.scheduling.scheduler import Scheduler
from domain.scheduling.types import Candidate
from domain.sharedstate.degraded import DegradedGauge
from ports.codec import JsonCodec
from ports.kv_events import KVBlockStore
from ports.observer import Observer
from ports.prefix_index import BlockHasher, PrefixIndex
from ports.sessions import SessionStore
from ports.shared_state import SharedLoad

if TYPE_CHECKING:
    from kubernetes.client import ApiClient


__all__ = [
    "config_text",
    "config_watcher",
    "flow_controller",
    "handle",
    "loaded_config",
    "registry",
    "request_control",
]


def registry(settings: Settings) -> PluginRegistry:
    """Every plugin type; Kubernetes-backed ones reach the API unless in static mode."""
    if settings.static_endpoints:
        return build_registry()

    def api_client() -> ApiClient:
        from adapters.kubernetes import api_client_from_environment

        return api_client_from_environment(settings.kubeconfig)

    access = KubernetesAccess(namespace=settings.pool_namespace, api_client_factory=api_client)
    return build_registry(kubernetes=access)


def config_text(settings: Settings) -> str | None:
    if settings.config_text is not None:
        return settings.config_text
    if settings.config_file is not None:
        return settings.config_file.read_text()
    return None


def handle(
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


def loaded_config(
    text: str | None, registry: PluginRegistry, handle: Handle, settings: Settings
) -> LoadedConfig:
    return load_config(
        text, registry=registry, handle=handle, overrides=ConfigOverrides.from_settings(settings)
    )


def flow_controller(
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


def request_control(
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


def config_watcher(
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
        return request_control(new, settings, scheduling_observer, flow_controller, observer)

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
