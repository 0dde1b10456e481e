"""Process lifecycle: load the config, start, serve until SIGTERM or SIGINT, drain, stop."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from adapters.otel.tracing import TracingConfigError
from app.config.loader import ConfigError
from app.container import Container, build_container
from app.flags import log_startup_notices
from app.logsetup import LogOptions, configure_logging
from app.memory import malloc_trim, trim_periodically
from app.plugins import PluginLoadError
from app.settings import Settings
from domain.plugins.hooks import BackgroundPlugin
from domain.plugins.state import RequestStates
from domain.sharedstate import ResilientPrefixIndex

__all__ = ["StartupError", "run", "serve"]

logger = logging.getLogger(__name__)

STATE_SWEEP_INTERVAL = 60.0


class StartupError(Exception):
    """The process cannot start; the message says why (a config entry, a port, ...)."""


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
    datastore = container.datastore()
    container.processor()
    collectors = container.collectors()
    try:
        source = container.endpoint_source()
    except Exception as exc:  # e.g. no usable Kubernetes configuration
        raise StartupError(f"cannot start endpoint discovery: {exc}") from exc
    servers = container.servers()
    observability = container.observability()
    try:
        await observability.start()  # /metrics first: its port is logged before ext_proc's
    except OSError as exc:
        raise StartupError(str(exc)) from exc
    # Shared state before serving: the first requests already read and write it.
    if settings.redis_url:
        from adapters.redis import parse_redis_url

        logger.info(
            "shared state on %r, key prefix %s",
            parse_redis_url(settings.redis_url),  # its repr never shows the password
            settings.shared_key_prefix(),
        )
    shared_load = container.shared_load()
    await shared_load.start()
    prefix_index = container.prefix_index()
    if isinstance(prefix_index, ResilientPrefixIndex):
        await prefix_index.start()
    # Plugins' background work (the KV-event subscriptions and the shared KV-block index's
    # warm load): started now, so the first request finds it; readiness waits for it.
    background = [p for p in loaded.plugins.values() if isinstance(p, BackgroundPlugin)]
    for plugin in background:
        await plugin.start()
    container.processor().startup_gates = [plugin.ready for plugin in background]
    try:
        await servers.start()
    except OSError as exc:
        await _stop_plugins(background)
        if isinstance(prefix_index, ResilientPrefixIndex):
            await prefix_index.stop()
        await shared_load.stop()
        await _close_redis(container)
        await observability.stop()
        raise StartupError(str(exc)) from exc
    flow_controller = container.flow_controller()
    if flow_controller is not None:
        flow_controller.start()
        logger.info("flow control on: requests queue by priority and fairness when saturated")
    collectors.start()
    _tune_gc()
    tasks = {
        asyncio.create_task(source.run(datastore), name="endpoint-source"),
        asyncio.create_task(_sweep(container.request_states()), name="request-state-sweep"),
    }
    watcher = container.config_watcher()
    if watcher is not None:
        tasks.add(asyncio.create_task(watcher.run(), name="config-watch"))
    # Every replica discovers and collects (a warm standby); only the leader is ready.
    elector = container.leader_elector()
    campaign = asyncio.create_task(elector.run(), name="leader-election") if elector else None
    if on_serving is not None:
        tasks.add(asyncio.create_task(on_serving(), name="serving-report"))
    if malloc_trim is not None:  # glibc: freed heap pages go back to the system
        tasks.add(asyncio.create_task(trim_periodically(), name="malloc-trim"))
    try:
        stop_task = asyncio.create_task(stop.wait())
        waited = {*tasks, stop_task, *([campaign] if campaign else [])}
        done, _ = await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
        stop_task.cancel()
        for task in done - {stop_task}:
            task.result()  # raises the background task's error
        if campaign is not None:  # release the Lease first: a standby takes over meanwhile
            await _cancel(campaign)
        logger.info("stopping: draining for up to %.1fs", settings.shutdown_grace_period)
        await servers.drain(settings.shutdown_grace_period)
    finally:
        if campaign is not None:
            await _cancel(campaign)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await collectors.stop()
        await servers.drain(0)
        if flow_controller is not None:
            await flow_controller.stop()
        # the running config's (a reload stopped the ones it replaced); before the Redis
        # client closes: the shared KV-block index releases its writer leases
        running = watcher.running if watcher is not None else loaded
        await _stop_plugins(
            [p for p in running.plugins.values() if isinstance(p, BackgroundPlugin)]
        )
        if isinstance(prefix_index, ResilientPrefixIndex):
            await prefix_index.stop()
        await shared_load.stop()  # withdraws this process's load from the pool
        await _close_redis(container)  # after the index and the load: they use it
        await observability.stop()  # after the last request: flushes the traces
    logger.info("stopped")


async def _stop_plugins(plugins: Sequence[BackgroundPlugin]) -> None:
    for plugin in plugins:
        try:
            await plugin.stop()
        except Exception:
            logger.exception("%s: stopping failed", plugin)


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _close_redis(container: Container) -> None:
    client = container.redis_client()
    if client is not None:
        try:
            await client.aclose()
        except Exception as exc:  # closing a client whose server is gone may fail
            logger.debug("closing the redis client: %r", exc)


async def _main(settings: Settings, customize: Callable[[Container], None] | None) -> int:
    container = build_container(settings)
    if customize is not None:
        customize(container)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await serve(container, stop)
    except StartupError as exc:
        logger.error("%s", exc)
        return 1
    return 0


def run(settings: Settings, customize: Callable[[Container], None] | None = None) -> int:
    """The EPP process: logging, the event loop, the container, until SIGTERM or SIGINT.
    ``customize`` may override the container's providers before anything starts."""
    configure_logging(LogOptions.from_settings(settings))
    log_startup_notices(settings)
    if settings.uvloop and sys.platform != "win32":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(_main(settings, customize))
    return asyncio.run(_main(settings, customize))
