"""Data producers: the default producer of every consumed key, and the order they run in.

A key some plugin consumes (``ConsumerPlugin``) and none produces (``ProducerPlugin``) gets
the plugin type registered as its default producer, built with the parameters the consumer
hands over (its ``producer_parameters()``, else its own ``parameters`` when they are of the
producer's parameters type). ``DataProducer`` plugins then run in dependency order.

A key has one producer: each endpoint holds one value of it per request, so a second
producer of a key (the llm-d guides' tiered prefix caches, two producers each read by its
own scorer) is refused rather than left to overwrite the first. A consumer naming the
producer it reads (``NamedProducerConsumer``) must name one that produces the key.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from app.config.errors import ConfigError
from app.config.instances import PluginInstances
from domain.plugins.base import plugins_with
from domain.plugins.hooks import (
    ConsumerPlugin,
    NamedProducerConsumer,
    ParameterizedPlugin,
    ProducerParametersProvider,
    ProducerPlugin,
)
from domain.requestcontrol.interfaces import DataProducer

__all__ = ["add_missing_producers", "check_producers", "sorted_producers"]

logger = logging.getLogger(__name__)


def _keys(declared: Iterable[Any]) -> list[str]:
    """Data keys from ``produces()``/``consumes()`` (a sequence or a mapping's keys)."""
    return [str(key) for key in declared]


def _produced(plugin: object) -> list[str]:
    return _keys(plugin.produces()) if isinstance(plugin, ProducerPlugin) else []


def _consumed(plugin: object) -> list[str]:
    return _keys(plugin.consumes()) if isinstance(plugin, ConsumerPlugin) else []


def add_missing_producers(instances: PluginInstances) -> None:
    """Creates the registered default producer of every consumed key nothing produces
    (repeatedly, since a new producer may consume keys of its own)."""
    plugins = instances.plugins
    while True:
        produced = {key for plugin in plugins.values() for key in _produced(plugin)}
        missing = next(
            (
                (plugin, key)
                for plugin in plugins.values()
                for key in _consumed(plugin)
                if key not in produced
            ),
            None,
        )
        if missing is None:
            return
        consumer, key = missing
        path = instances.path_of(consumer)
        type_name = instances.registry.default_producer_for(key)
        if type_name is None:
            raise ConfigError(
                f'{path}: plugin "{consumer.typed_name.name}" consumes "{key}", which no '
                "plugin produces and no plugin type is registered to produce"
            )
        if type_name in plugins:
            taken = plugins[type_name]
            raise ConfigError(
                f'{instances.path_of(taken)}: plugin "{type_name}" (type '
                f'{taken.typed_name.type}) does not produce "{key}", which '
                f'"{consumer.typed_name.name}" consumes; the default producer '
                f'"{type_name}" cannot be added'
            )
        parameters = _producer_parameters(instances, consumer, type_name)
        producer = instances.create(type_name, type_name, parameters, path)
        if key not in _produced(producer):
            raise ConfigError(
                f'{path}: the default producer "{type_name}" of "{key}" does not produce it'
            )
        logger.info(
            "added data producer %s for %s, consumed by %s",
            producer.typed_name,
            key,
            consumer.typed_name,
        )


def check_producers(instances: PluginInstances) -> None:
    """One producer per key, and every producer a consumer names produces its key."""
    producer_of: dict[str, str] = {}
    for name, plugin in instances.plugins.items():
        for key in _produced(plugin):
            first = producer_of.setdefault(key, name)
            if first != name:
                raise ConfigError(
                    f'{instances.path_of(plugin)}: plugin "{name}" produces "{key}", which '
                    f'"{first}" produces already; this EPP keeps one "{key}" per endpoint, '
                    "so a second producer of it (such as a second prefix-cache tier) is not "
                    "available"
                )
    for plugin in instances.plugins.values():
        if not isinstance(plugin, NamedProducerConsumer):
            continue
        for key, wanted in plugin.producer_names().items():
            if not wanted:
                continue
            path = instances.path_of(plugin)
            producer = instances.plugins.get(wanted)
            if producer is None:
                raise ConfigError(
                    f'{path}: the producer of "{key}" it names, "{wanted}", is not a plugin'
                )
            if key not in _produced(producer):
                raise ConfigError(
                    f'{path}: the plugin it names as the producer of "{key}", "{wanted}" '
                    f"(type {producer.typed_name.type}), does not produce it"
                )


def _producer_parameters(instances: PluginInstances, consumer: object, type_name: str) -> Any:
    """What the consumer wants its auto-created producer built with: the result of its
    ``producer_parameters()`` method, else its own ``parameters`` attribute, when either
    is an instance of the producer type's parameters class; ``None`` (the defaults)
    otherwise."""
    wanted: object = None
    if isinstance(consumer, ProducerParametersProvider):
        wanted = consumer.producer_parameters()
    elif isinstance(consumer, ParameterizedPlugin):
        wanted = consumer.parameters
    return wanted if isinstance(wanted, instances.registry.spec(type_name).parameters) else None


def sorted_producers(plugins: Iterable[object]) -> list[DataProducer]:
    """DataProducers in dependency order (a consumer of K after K's producers); ties
    keep plugin order."""
    producers: list[DataProducer] = plugins_with(plugins, DataProducer)
    producers_of: dict[str, list[DataProducer]] = {}
    for producer in producers:
        for key in _keys(producer.produces()):
            producers_of.setdefault(key, []).append(producer)
    depends: dict[str, list[DataProducer]] = {}
    for producer in producers:
        depends[producer.typed_name.name] = [
            other
            for key in _keys(producer.consumes())
            for other in producers_of.get(key, ())
            if other is not producer
        ]
    ordered: list[DataProducer] = []
    done: set[str] = set()
    pending = list(producers)
    while pending:
        ready = next(
            (
                p
                for p in pending
                if all(d.typed_name.name in done for d in depends[p.typed_name.name])
            ),
            None,
        )
        if ready is None:
            cycle = _cycle(depends, {p.typed_name.name for p in pending})
            raise ConfigError(f"plugins: data producers form a cycle: {cycle}")
        pending.remove(ready)
        ordered.append(ready)
        done.add(ready.typed_name.name)
    return ordered


def _cycle(depends: dict[str, list[DataProducer]], blocked: set[str]) -> str:
    """One cycle among the ``blocked`` producers (each waits for another blocked one),
    as ``"a" -> "b" -> "a"``."""
    walk = [min(blocked)]
    while True:
        following = next(
            d.typed_name.name for d in depends[walk[-1]] if d.typed_name.name in blocked
        )
        if following in walk:
            cycle = [*walk[walk.index(following) :], following]
            return " -> ".join(f'"{name}"' for name in cycle)
        walk.append(following)
