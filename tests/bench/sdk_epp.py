"""The EPP process with the OpenTelemetry SDK's tracing in place of ``adapters.otel``, for
``tests.bench.observability_overhead`` (not product code).

    python -m tests.bench.sdk_epp <the epp command's flags>

The same process as ``python -m app`` (flags, container, lifecycle, uvloop), with one
difference: the container's ``tracing`` provider is overridden with
``tests.bench.sdk_tracing.SdkTracing`` when ``--tracing`` is on.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from app.cli import parse_settings
from app.container import build_container
from app.logsetup import configure_logging
from app.runner import StartupError, serve
from app.settings import Settings
from tests.bench.sdk_tracing import INSTALL_HINT, SdkTracing, otlp_exporter_available

logger = logging.getLogger("tests.bench.sdk_epp")


async def _main(settings: Settings) -> int:
    container = build_container(settings)
    if settings.tracing:
        tracing = SdkTracing()
        described = tracing.describe()
        logger.info(
            "tracing on: sampler %s, exporter %s", described["sampler"], described["exporter"]
        )
        container.tracing.override(tracing)
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


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(argv)
    configure_logging(settings.verbosity, settings.log_format)
    if settings.tracing and not otlp_exporter_available():
        logger.error("%s", INSTALL_HINT)
        sys.exit(1)
    if settings.uvloop and sys.platform != "win32":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            sys.exit(uvloop.run(_main(settings)))
    sys.exit(asyncio.run(_main(settings)))


if __name__ == "__main__":
    main()
