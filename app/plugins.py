"""Building the plugin registry: the in-tree types plus those of installed distributions.

An installed distribution adds plugin types by declaring an entry point in the
``epp.plugins`` group that names a callable ``register(registry)``::

    [project.entry-points."epp.plugins"]
    my-plugins = "my_package.epp:register"

The callable registers its types exactly like the in-tree modules do. A type registered
twice (by two distributions, or clashing with an in-tree type) stops start-up.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any

from adapters.chattemplate import JinjaChatTemplate
from adapters.hftokenizers import HFTokenizer
from adapters.kvevents import KVEventSubscriptions, SubscriberConfig
from adapters.prometheus.scrape import MetricsDataSource, MetricsSourceParameters
from adapters.xxhash import xxh3_128
from domain.plugins.base import (
    Plugin,
    PluginConfigError,
    PluginRegistry,
    TypedName,
    class_factory,
)
from domain.plugins.handle import Handle
from domain.plugins.intree import register_in_tree
from domain.prefixcache.engine_hash import EngineBlockHasher
from domain.prefixcache.kv_block_index import InMemoryKVBlockIndex
from domain.prefixcache.precise import LoraAdapterNames, PromptKeyer
from domain.requestcontrol.plugins.precise_prefix_producer import (
    TYPE as PRECISE_PREFIX_CACHE_PRODUCER,
)
from domain.requestcontrol.plugins.precise_prefix_producer import (
    PrecisePrefixCacheParameters,
    PrecisePrefixCacheProducer,
)
from domain.requestcontrol.plugins.prefix_producer import (
    TYPE as APPROX_PREFIX_CACHE_PRODUCER,
)
from domain.requestcontrol.plugins.prefix_producer import (
    ApproxPrefixCacheProducer,
    PrefixCacheParameters,
)
from domain.sharedstate.shared_kv_index import SharedKVBlockIndex
from ports.tokenizer import ChatTemplateError, TokenizerError

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

__all__ = [
    "ENTRY_POINT_GROUP",
    "K8S_NOTIFICATION_SOURCE",
    "KubernetesAccess",
    "PluginLoadError",
    "build_registry",
    "load_entry_point_plugins",
    "register_adapter_plugins",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "epp.plugins"
K8S_NOTIFICATION_SOURCE = "k8s-notification-source"


@dataclass(frozen=True, slots=True, kw_only=True)
class KubernetesAccess:
    """How Kubernetes-backed plugins reach the API: the EPP's namespace and a factory of
    API clients (called when a plugin starts, not at config load)."""

    namespace: str
    api_client_factory: Callable[[], ApiClient]


class PluginLoadError(RuntimeError):
    """An out-of-tree plugin entry point could not be loaded or registered."""


def _describe(entry_point: EntryPoint) -> str:
    dist = entry_point.dist
    origin = f" from {dist.name} {dist.version}" if dist is not None else ""
    return f'entry point "{entry_point.name} = {entry_point.value}"{origin}'


def load_entry_point_plugins(registry: PluginRegistry) -> list[str]:
    """Calls ``register(registry)`` of every ``epp.plugins`` entry point (ordered by
    name). Returns the plugin types they added. Raises ``PluginLoadError``."""
    added: list[str] = []
    found = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: (ep.name, ep.value))
    for entry_point in found:
        before = set(registry.types())
        try:
            register = entry_point.load()
        except Exception as exc:
            raise PluginLoadError(f"{_describe(entry_point)}: cannot be loaded: {exc}") from exc
        if not callable(register):
            raise PluginLoadError(f"{_describe(entry_point)}: is not a callable register(registry)")
        try:
            register(registry)
        except ValueError as exc:
            raise PluginLoadError(f"{_describe(entry_point)}: {exc}") from exc
        new = sorted(set(registry.types()) - before)
        logger.info("%s registered plugin types: %s", _describe(entry_point), ", ".join(new))
        added.extend(new)
    return added


def register_adapter_plugins(
    registry: PluginRegistry, *, kubernetes: KubernetesAccess | None = None
) -> None:
    """The in-tree plugin types backed by adapters (they talk to the outside world).

    Without ``kubernetes`` (static mode, no API server) ``k8s-notification-source`` is
    still known, but configuring one stops the load with a message saying why.
    """
    registry.register(
        "metrics-data-source",
        class_factory("metrics-data-source", MetricsDataSource),
        parameters=MetricsSourceParameters,
        description="polls each endpoint's Prometheus /metrics over HTTP",
    )
    registry.register(
        PRECISE_PREFIX_CACHE_PRODUCER,
        _precise_prefix_cache_producer,
        parameters=PrecisePrefixCacheParameters,
        description="prefix-cache match per endpoint from the model servers' KV-cache events",
    )
    description = "watches one Kubernetes kind (group/version/kind) and notifies its extractors"
    if kubernetes is None:
        registry.register(
            K8S_NOTIFICATION_SOURCE,
            _no_kubernetes,
            parameters=dict,
            description=description,
        )
        return
    # Imported here: the Kubernetes client is loaded only when the API server is used.
    from adapters.kubernetes.notification_source import K8sNotificationSourceParameters

    registry.register(
        K8S_NOTIFICATION_SOURCE,
        functools.partial(_k8s_notification_source, kubernetes),
        parameters=K8sNotificationSourceParameters,
        description=description,
    )


def _k8s_notification_source(
    kubernetes: KubernetesAccess, name: str, parameters: Any, handle: Handle
) -> Plugin:
    from adapters.kubernetes.notification_source import K8sNotificationSource

    return K8sNotificationSource(
        TypedName(K8S_NOTIFICATION_SOURCE, name),
        parameters,
        api_client_factory=kubernetes.api_client_factory,
        namespace=kubernetes.namespace,
    )


def _precise_prefix_cache_producer(
    name: str, parameters: PrecisePrefixCacheParameters, handle: Handle
) -> Plugin:
    """The producer, its tokenizer (a missing one stops start-up naming the path), its
    index, and one KV-event subscriber per endpoint, following the datastore."""
    tokens = parameters.token_processor_config
    try:
        tokenizer = HFTokenizer.from_file(tokens.tokenizer_path)
    except TokenizerError as exc:
        raise PluginConfigError(
            f'plugin "{name}": tokenProcessorConfig.tokenizerPath: {exc}'
        ) from None
    chat = _chat_template(name, tokens.tokenizer_path, tokens.chat_template_path)
    keyer = PromptKeyer(
        tokenizer,
        EngineBlockHasher(
            algorithm=tokens.hash_algorithm, seed=tokens.hash_seed, xxh3_128=xxh3_128
        ),
        block_size=tokens.tokens_per_block,
        cache_chars=parameters.tokenization_cache_chars,
        chat=chat,
    )
    indexer = parameters.indexer_config
    local = InMemoryKVBlockIndex(
        max_blocks_per_endpoint=indexer.max_blocks_per_endpoint, observer=handle.observer
    )
    index: InMemoryKVBlockIndex | SharedKVBlockIndex = local
    store = handle.kv_block_store
    if indexer.backend == "redis" and store is None:
        raise PluginConfigError(f'plugin "{name}": indexerConfig.backend: redis needs --redis-url')
    if store is not None and indexer.backend != "in-memory":
        index = SharedKVBlockIndex(
            store,
            local,
            owner=uuid.uuid4().hex,
            cap=indexer.max_blocks_per_endpoint,
            observer=handle.observer,
            degraded_gauge=handle.shared_degraded,
        )
    events = parameters.kv_events_config
    adapters = LoraAdapterNames()  # learnt from the events' lora_name
    subscriptions = KVEventSubscriptions(
        sink=adapters.watching(index),
        port=events.socket_port,
        replay_port=events.replay_port,
        config=SubscriberConfig(
            topic_filter=events.topic_filter.encode(), replay_timeout=events.replay_timeout
        ),
        observer=handle.observer,
        data_parallel_size=events.data_parallel_size,
    )
    producer = PrecisePrefixCacheProducer(
        TypedName(PRECISE_PREFIX_CACHE_PRODUCER, name),
        parameters,
        keyer=keyer,
        index=index,
        observer=handle.observer,
        feed=subscriptions,
        # chat and other requests it cannot key: the approximate path, for that request
        fallback=ApproxPrefixCacheProducer(
            TypedName(APPROX_PREFIX_CACHE_PRODUCER, f"{name}/approximate-fallback"),
            PrefixCacheParameters(),
            handle,
        ),
        adapters=adapters,
        # speculative entries shared by the pool's processes (Redis with --redis-url)
        shared=handle.prefix_index,
        datastore=handle.datastore,
    )
    handle.datastore.subscribe(producer.on_endpoint_event)
    return producer


def _chat_template(
    name: str, tokenizer_path: str, chat_template_path: str
) -> JinjaChatTemplate | None:
    """The model's chat template: ``chatTemplatePath`` (unreadable or invalid: start-up stops
    naming it), else the one beside the tokenizer (invalid: a warning, and chat requests
    take the approximate path, as without one)."""
    try:
        chat = JinjaChatTemplate.load(tokenizer_path, chat_template_path)
    except ChatTemplateError as exc:
        if chat_template_path:
            raise PluginConfigError(
                f'plugin "{name}": tokenProcessorConfig.chatTemplatePath: {exc}'
            ) from None
        logger.warning('plugin "%s": %s; chat requests take the approximate path', name, exc)
        return None
    if chat is None:
        logger.info(
            'plugin "%s": no chat template beside %s; chat requests take the approximate path',
            name,
            tokenizer_path,
        )
    return chat


def _no_kubernetes(name: str, parameters: Any, handle: Handle) -> Plugin:
    raise PluginConfigError(
        f'plugin "{name}" of type {K8S_NOTIFICATION_SOURCE} needs the Kubernetes API, '
        "which is not used in static mode (--static-endpoints)"
    )


def build_registry(
    *, include_entry_points: bool = True, kubernetes: KubernetesAccess | None = None
) -> PluginRegistry:
    """A registry with every in-tree plugin type and, unless told otherwise, the types of
    installed distributions' ``epp.plugins`` entry points. ``kubernetes``: see
    ``register_adapter_plugins``."""
    registry = PluginRegistry()
    register_in_tree(registry)
    register_adapter_plugins(registry, kubernetes=kubernetes)
    if include_entry_points:
        load_entry_point_plugins(registry)
    return registry
