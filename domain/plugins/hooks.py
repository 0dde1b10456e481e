"""The optional hooks the config loader calls on plugins (and on their parameters).

Extension points (``Filter``, ``Scorer``, ``DataProducer``, ``Extractor``, ...) say what a
plugin does per request; these hooks say what the loader should know about it while it
loads the EndpointPickerConfig at start-up: which data keys it reads and writes, what to
call it when the config gives no name, which profiles or extractors it accepts. Each is
optional: a plugin that lacks a hook is loaded without that check or declaration.

A plugin fills a hook by having the method (or attribute), exactly like an extension point;
naming the Protocol as a base class as well lets mypy check the signature (the in-tree
plugins do). The loader tests for them with ``isinstance``. Every hook is called while the
config loads, before any request is served; it must be quick and must not block (no I/O).

Errors: a hook that may refuse the configuration says which exceptions it raises; the
loader turns them into one configuration error whose message starts with the config path
of the plugin concerned (``plugins[3]: ...``), and the EPP does not start. Any other
exception from a hook is a bug in the plugin: it stops start-up with a traceback.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from domain.plugins.base import Plugin

__all__ = [
    "BackgroundPlugin",
    "ConfigNoticePlugin",
    "ConsumerPlugin",
    "NamedProducerConsumer",
    "NamingParameters",
    "ParameterizedPlugin",
    "PollIntervalSource",
    "ProducerParametersProvider",
    "ProducerPlugin",
    "TypedExtractor",
    "TypedSource",
    "ValidatingDataSource",
    "ValidatingProfileHandler",
]

# Each hook declares empty ``__slots__`` so a plugin class with ``__slots__`` may name it
# as a base and stay without a ``__dict__``.


@runtime_checkable
class ProducerPlugin(Protocol):
    """A plugin that writes per-request data under named keys (e.g.
    ``PrefixCacheMatchInfo``); ``DataProducer`` plugins are the usual ones.

    ``produces()`` returns those keys: a sequence of strings, or a mapping whose keys are
    the data keys (as in the reference). The loader calls it, any number of times, once
    every plugin is built: to find the consumed keys that nothing produces (see
    ``ConsumerPlugin``), to check that a producer it created for a key does produce it, and
    to run the ``DataProducer`` plugins in dependency order (after the producers of the keys
    they consume). It must return the same keys every time and must not raise.

    Reported as configuration errors: two ``DataProducer`` plugins waiting for each other
    (``plugins: data producers form a cycle: "a" -> "b" -> "a"``), and a producer created
    for a key it does not list.
    """

    __slots__ = ()

    def produces(self) -> Iterable[str]: ...


@runtime_checkable
class ConsumerPlugin(Protocol):
    """A plugin that reads per-request data produced by another plugin under named keys.

    ``consumes()`` returns those keys, like ``ProducerPlugin.produces``. The loader calls it
    once every plugin is built: for a key that no plugin produces it creates the plugin type
    registered as that key's default producer (``PluginRegistry.register(...,
    default_for=(key,))``), named after its type and built with the parameters this plugin
    hands over (``ProducerParametersProvider``, ``ParameterizedPlugin``) or the type's
    defaults; a ``DataProducer`` that consumes keys runs after their producers. It must
    return the same keys every time and must not raise.

    Reported as configuration errors: a key that nothing produces and no plugin type is
    registered to produce (at this plugin's path), and a default producer whose name is
    already taken by a plugin that does not produce the key (at that plugin's path).
    """

    __slots__ = ()

    def consumes(self) -> Iterable[str]: ...


@runtime_checkable
class NamedProducerConsumer(Protocol):
    """A consumer whose parameters name the plugin whose data it reads, per data key (the
    llm-d router's ``prefixMatchInfoProducerName``, ``inFlightLoadProducerName``).

    ``producer_names()`` maps a consumed key to a plugin name ("" or absent: any producer).
    The loader checks, once every plugin is built, that each named plugin exists and
    produces that key (``ProducerPlugin``). This EPP keeps one value per key and endpoint,
    so the name selects nothing more. It must not raise.

    Reported as configuration errors: a name no plugin has, and a plugin that does not
    produce the key it is named for.
    """

    __slots__ = ()

    def producer_names(self) -> Mapping[str, str]: ...


@runtime_checkable
class ProducerParametersProvider(Protocol):
    """A consumer that chooses the parameters of the producer the loader creates for it.

    ``producer_parameters()`` is called at most once per created producer, when this plugin
    is the first (in plugin order) to consume a key that nothing produces. It returns an
    instance of the producer type's parameters dataclass (the one it was registered with),
    which the producer's factory receives; anything else (e.g. ``None``) means the type's
    default parameters. It must not raise. Without this hook the loader looks at
    ``ParameterizedPlugin.parameters``.
    """

    __slots__ = ()

    def producer_parameters(self) -> object: ...


@runtime_checkable
class ParameterizedPlugin(Protocol):
    """A plugin that keeps the parameters it was built with as ``parameters``.

    Read only for a consumer without ``producer_parameters()`` whose consumed key nothing
    produces: when ``parameters`` is an instance of the producer type's parameters
    dataclass, the created producer is built with it (so a scorer configured with
    ``blockSizeTokens: 32`` gets a producer hashing blocks of 32 tokens); otherwise the
    producer gets its type's default parameters.
    """

    __slots__ = ()

    @property
    def parameters(self) -> object: ...


@runtime_checkable
class ConfigNoticePlugin(Protocol):
    """A plugin some of whose configuration has no effect here (a parameter accepted for
    compatibility, a deprecated one).

    ``config_notices()`` returns one line per such item, each starting with the camelCase
    parameter (``requestTimeout: accepted and ignored: ...``). The loader calls it once the
    plugin is built, prefixes each line with the plugin's config path and logs it at
    start-up, once per process (a config reload does not repeat a line). It must not raise.
    """

    __slots__ = ()

    def config_notices(self) -> Sequence[str]: ...


@runtime_checkable
class NamingParameters(Protocol):
    """Parameters (the frozen dataclass a plugin type registers) that name their plugin.

    ``default_name()`` is called once for a ``plugins`` entry that has no ``name``, after
    its parameters are validated and before the factory runs; its result is the plugin's
    name instead of the plugin type (e.g. a watched kind's GVK string). It must not raise.
    A name another plugin already has is reported as a configuration error at
    ``plugins[i].name``.
    """

    __slots__ = ()

    def default_name(self) -> str: ...


@runtime_checkable
class ValidatingProfileHandler(Protocol):
    """A profile handler that checks the scheduling profiles it is given.

    ``validate_profiles(names)`` is called once, on the profile handler the config uses,
    after every profile is built, with the profile names in config order (``["default"]``
    when the config lists none). It returns ``None`` to accept them, or raises
    ``ValueError`` (``PluginConfigError`` is one) saying what is missing or wrong; that is
    reported as a configuration error at the handler's path (``plugins[2]: <message>``).
    """

    __slots__ = ()

    def validate_profiles(self, names: Sequence[str]) -> None: ...


@runtime_checkable
class ValidatingDataSource(Protocol):
    """A data source that checks which extractors it can feed.

    ``validate_extractor(extractor)`` is called once per extractor listed under the source
    in ``dataLayer.sources`` (or for the default source and extractor when the config has no
    ``dataLayer``), before the loader's own checks (GVKs of notification sources and
    extractors, ``TypedSource`` against ``TypedExtractor``). It returns ``None`` to accept
    the extractor, or raises ``TypeError`` or ``ValueError`` saying why not; that is
    reported as a configuration error at the extractor's reference
    (``dataLayer.sources[0].extractors[1].pluginRef: extractor "x" (type t) cannot be fed by
    source "s" (type u): <message>``).
    """

    __slots__ = ()

    def validate_extractor(self, extractor: Plugin) -> None: ...


@runtime_checkable
class PollIntervalSource(Protocol):
    """A polling data source whose parameters say how often it is polled (the llm-d
    router's ``interval`` source parameter).

    ``poll_interval()`` returns seconds, or ``None`` for the collectors' interval
    (``--refresh-metrics-interval``). The loader reads it once, when it wires the data
    layer; ``dataLayer.sources[].interval`` may say the same, and a different value there
    is a configuration error. It must not raise.
    """

    __slots__ = ()

    def poll_interval(self) -> float | None: ...


@runtime_checkable
class TypedSource(Protocol):
    """A data source that says what it produces: ``output_type()`` returns the class of
    every value it yields (``PollingDataSource`` and ``NotificationSource`` declare it).

    Checked at load against the ``expected_input_type()`` of each of its extractors (see
    ``TypedExtractor``). It must return a class; a ``TypeError`` or ``ValueError`` it
    raises is reported like a ``ValidatingDataSource`` refusal.
    """

    __slots__ = ()

    def output_type(self) -> type: ...


@runtime_checkable
class TypedExtractor(Protocol):
    """An extractor that says what it reads: ``expected_input_type()`` returns a class
    (``Extractor`` declares it; ``object`` reads anything).

    When its source is a ``TypedSource``, the loader requires the source's output type to
    be this class or a subclass of it; otherwise it reports a configuration error at the
    extractor's reference (``...: the extractor reads MetricsText, the source produces
    EndpointEvent``). It must return a class; a ``TypeError`` or ``ValueError`` it raises
    is reported like a ``ValidatingDataSource`` refusal.
    """

    __slots__ = ()

    def expected_input_type(self) -> type: ...


@runtime_checkable
class BackgroundPlugin(Protocol):
    """A plugin with background work (subscriptions, tasks, leases on a shared store).

    Not a loader hook: the app calls ``start`` on the event loop once the config is loaded,
    before the servers serve, and ``stop`` at shutdown (before the shared-state client
    closes) and when a config reload replaces the plugin. ``start`` must not block for
    long (it starts tasks); ``stop`` must end within a few seconds and not raise.
    ``ready`` gates the process's readiness at start-up only (a new process takes no
    request before it is true, e.g. before an index loaded its shared copy): it must turn
    true by itself within seconds, whatever fails.
    """

    __slots__ = ()

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def ready(self) -> bool: ...
