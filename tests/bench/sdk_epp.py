"""The EPP process with the OpenTelemetry SDK's tracing in place of ``adapters.otel``, for
``tests.bench.observability_overhead`` (not product code).

    python -m tests.bench.sdk_epp <the epp command's flags>

The same process as ``python -m app`` (flags, container, lifecycle, uvloop), with one
difference: the container's ``tracing`` provider is overridden with
``tests.bench.sdk_tracing.SdkTracing`` when ``--tracing`` is on.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from app.cli import parse_settings
from app.container import Container
from app.logsetup import LogOptions, configure_logging
from app.runner import run
from tests.bench.sdk_tracing import INSTALL_HINT, SdkTracing, otlp_exporter_available

logger = logging.getLogger("tests.bench.sdk_epp")


def _use_sdk_tracing(container: Container) -> None:
    tracing = SdkTracing()
    described = tracing.describe()
    logger.info("tracing on: sampler %s, exporter %s", described["sampler"], described["exporter"])
    container.tracing.override(tracing)


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(argv)
    configure_logging(LogOptions.from_settings(settings))
    if settings.tracing and not otlp_exporter_available():
        logger.error("%s", INSTALL_HINT)
        sys.exit(1)
    sys.exit(run(settings, _use_sdk_tracing if settings.tracing else None))


if __name__ == "__main__":
    main()
