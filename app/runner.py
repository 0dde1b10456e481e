"""The EPP process (alone, or as one worker of a pod): its services in start order, serving
until SIGTERM or SIGINT, then the drain and the stop in reverse order (``app.lifecycle``)."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from adapters.otel.tracing import TracingConfigError
from app.config.loader import ConfigError, LoadedConfig
from app.container import Container, build_container
from app.lifecycle import Lifecycle, Service, StartupError, run_process, step, task
from app.memory import malloc_trim, trim_periodically
from app.plugins import PluginLoadError
from app.settings import Settings
from domain.plugins.hooks import BackgroundPlugin
from domain.plugins.state import RequestStates
from domain.sharedstate import ResilientPrefixIndex

__all__ = ["StartupError", "run", "serve"]

logger = logging.getLogger(__name__)

STATE_SWEEP_INTERVAL = 60.0
LEADER_ELECTION = "leader-election"


def _tune_gc() -> None:
    """Fewer, cheaper collections on the request path.

    Every decision allocates a few short-lived container objects per candidate; with the
    default threshold (700) that means several young collections per request, and full
    collections walking the prefix index. Objects alive after start-up are frozen out of
    collection, and the young-generation threshold is raised.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)


async def _sweep(states: RequestStates) -> None:
    while True:
        await asyncio.sleep(STATE_SWEEP_INTERVAL)
        states.sweep()


async def serve(
    container: Container,
    stop: asyncio.Event,
    on_serving: Callable[[], Coroutine[Any, Any, None]] | None = None,
) -> None:
    """Run everything the container provides until ``stop`` is set, then drain.
    ``on_serving`` (a worker's status report to its supervisor) runs as a task from the
    moment the servers serve until the drain ends."""
    settings = container.settings()
    lifecycle = Lifecycle(_services(container, _prepare(container), on_serving))
    try:
        await lifecycle.start()
    except OSError as exc:  # a port in use
        raise StartupError(str(exc)) from exc
    _tune_gc()
    try:
        await lifecycle.wait(stop)
        # The Lease first, so a standby takes over while this one drains.
        await lifecycle.stop_one(LEADER_ELECTION)
        servers = container.servers()
        if settings.drain_timeout:
            servers.health.start_draining()
            logger.info("stopping: serving new streams for %.1fs", settings.drain_timeout)
            await asyncio.sleep(settings.drain_timeout)
        logger.info("stopping: draining for up to %.1fs", settings.shutdown_grace_period)
        await servers.drain(settings.shutdown_grace_period)
    finally:
        await lifecycle.stop()
    logger.info("stopped")


def _prepare(container: Container) -> LoadedConfig:
    """What is checked before anything starts: the config, the static objectives, the
    tracing variables and the endpoint discovery; each failure is a ``StartupError``."""
    settings = container.settings()
    try:
        loaded = container.config()
    except (ConfigError, PluginLoadError) as exc:
        raise StartupError(f"invalid configuration: {exc}") from exc
    logger.info(
        "scheduling profiles: %s; plugins: %s",
        ", ".join(loaded.profiles),
        ", ".join(f"{p.typed_name}" for p in loaded.plugins.values()),
    )
    if settings.static_objectives is not None:
        from app.static_objectives import StaticObjectivesError, load_static_objectives

        try:
            counts = load_static_objectives(settings.static_objectives, container.objectives())
        except StaticObjectivesError as exc:
            raise StartupError(f"--static-objectives: {exc}") from exc
        logger.info("static objectives: %d objective(s), %d rewrite rule(s)", *counts)
    try:
        container.tracing()
    except TracingConfigError as exc:
        raise StartupError(f"invalid tracing configuration: {exc}") from exc
    container.processor()
    try:
        container.endpoint_source()
    except Exception as exc:  # e.g. no usable Kubernetes configuration
        raise StartupError(f"cannot start endpoint discovery: {exc}") from exc
    if settings.redis_url:
        from adapters.redis import parse_redis_url

        logger.info(
            "shared state on %r, key prefix %s",
            parse_redis_url(settings.redis_url),  # its repr never shows the password
            settings.shared_key_prefix(),
        )
    return loaded


def _services(
    container: Container,
    loaded: LoadedConfig,
    on_serving: Callable[[], Coroutine[Any, Any, None]] | None,
) -> list[Service]:
    """The process's services in start order; they stop in the reverse order."""
    observability = container.observability()
    shared_load = container.shared_load()
    prefix_index = container.prefix_index()
    servers = container.servers()
    flow_controller = container.flow_controller()
    collectors = container.collectors()
    watcher = container.config_watcher()
    elector = container.leader_elector()
    background = [p for p in loaded.plugins.values() if isinstance(p, BackgroundPlugin)]

    async def start_plugins() -> None:
        # Started before serving, so the first request finds them; readiness waits for them.
        for plugin in background:
            await plugin.start()
        container.processor().startup_gates = [plugin.ready for plugin in background]

    async def stop_plugins() -> None:
        # the running config's (a reload stopped the ones it replaced); before the Redis
        # client closes: the shared KV-block index releases its writer leases
        running = watcher.running if watcher is not None else loaded
        for plugin in running.plugins.values():
            if isinstance(plugin, BackgroundPlugin):
                try:
                    await plugin.stop()
                except Exception:
                    logger.exception("%s: stopping failed", plugin)

    async def start_flow_control() -> None:
        if flow_controller is not None:
            flow_controller.start()
            logger.info("flow control on: requests queue by priority and fairness when saturated")

    async def stop_flow_control() -> None:
        if flow_controller is not None:
            await flow_controller.stop()

    async def start_collectors() -> None:
        collectors.start()

    services: list[Service] = [
        # /metrics first: its port is logged before ext_proc's; stopped last: flushes traces
        step("observability", observability.start, observability.stop),
        # closed after the prefix index and the load, which use it
        step("redis-client", stop=lambda: _close_redis(container)),
        # shared state before serving: the first requests already read and write it;
        # stopping withdraws this process's load from the pool
        step("shared-load", shared_load.start, shared_load.stop),
    ]
    if isinstance(prefix_index, ResilientPrefixIndex):
        services.append(step("prefix-index", prefix_index.start, prefix_index.stop))
    services += [
        step("background-plugins", start_plugins, stop_plugins),
        step("flow-control", start_flow_control, stop_flow_control),
        step("servers", servers.start, lambda: servers.drain(0)),
        step("collectors", start_collectors, collectors.stop),
        task("endpoint-source", lambda: container.endpoint_source().run(container.datastore())),
        task("request-state-sweep", lambda: _sweep(container.request_states())),
    ]
    if watcher is not None:
        services.append(task("config-watch", watcher.run))
    if on_serving is not None:
        services.append(task("serving-report", on_serving))
    if malloc_trim is not None:  # glibc: freed heap pages go back to the system
        services.append(task("malloc-trim", trim_periodically))
    # Every replica discovers and collects (a warm standby); only the leader is ready.
    if elector is not None:
        services.append(task(LEADER_ELECTION, elector.run))
    return services


async def _close_redis(container: Container) -> None:
    client = container.redis_client()
    if client is not None:
        try:
            await client.aclose()
        except Exception as exc:  # closing a client whose server is gone may fail
            logger.debug("closing the redis client: %r", exc)


def run(settings: Settings, customize: Callable[[Container], None] | None = None) -> int:
    """The EPP process: logging, the event loop, the container, until SIGTERM or SIGINT.
    ``customize`` may override the container's providers before anything starts."""

    async def main(stop: asyncio.Event) -> int:
        container = build_container(settings)
        if customize is not None:
            customize(container)
        await serve(container, stop)
        return 0

    return run_process(settings, main)
