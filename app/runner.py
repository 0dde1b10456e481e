"""Process lifecycle: start, serve until SIGTERM or SIGINT, drain, stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys

from app.container import Container, build_container
from app.logsetup import configure_logging
from app.settings import Settings

__all__ = ["run", "serve"]

logger = logging.getLogger(__name__)


async def serve(container: Container, stop: asyncio.Event) -> None:
    """Run everything the container provides until ``stop`` is set, then drain."""
    settings = container.settings()
    datastore = container.datastore()
    source = container.endpoint_source()
    servers = container.servers()
    if settings.config_file is not None or settings.config_text is not None:
        logger.warning(
            "EndpointPickerConfig given but not applied in this version: "
            "routing is a uniform random pick"
        )
    await servers.start()
    source_task = asyncio.create_task(source.run(datastore), name="endpoint-source")
    try:
        stop_task = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({source_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if source_task in done:
            stop_task.cancel()
            source_task.result()  # raises the source's error
        logger.info("stopping: draining for up to %.1fs", settings.shutdown_grace_period)
        await servers.drain(settings.shutdown_grace_period)
    finally:
        source_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await source_task
        await servers.drain(0)
    logger.info("stopped")


async def _main(settings: Settings) -> int:
    container = build_container(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await serve(container, stop)
    except OSError as exc:
        logger.error("%s", exc)
        return 1
    return 0


def run(settings: Settings) -> int:
    configure_logging(settings.verbosity, settings.log_format)
    if settings.uvloop and sys.platform != "win32":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(_main(settings))
    return asyncio.run(_main(settings))
