"""What the process serves and how: the ext_proc and health servers' options, the serving
certificate, leader election, and what ``/metrics`` exports and to whom."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from adapters.envoy.extproc import StreamLimits
from adapters.envoy.server import ServerOptions
from adapters.envoy.tls import (
    ServerCertificate,
    load_certificate,
    load_client_ca,
    self_signed_certificate,
)
from adapters.prometheus.exporter import TextPage
from app.settings import CIPHER_SUITES, Settings
from app.wiring.role import ProcessRole
from ports.access import RequestAuthorizer
from ports.metric_catalogue import CATALOGUE, EXTPROC_STREAM_METRICS, Metric

if TYPE_CHECKING:
    from adapters.kubernetes import LeaderElector

__all__ = [
    "certificate",
    "leader_check",
    "leader_elector",
    "metric_catalogue",
    "metrics_authorizer",
    "pprof_pages",
    "server_options",
]


def certificate(settings: Settings) -> ServerCertificate | None:
    if not settings.secure_serving:
        return None
    if settings.cert_path is not None:
        return load_certificate(settings.cert_path)
    return self_signed_certificate()


def server_options(
    settings: Settings, role: ProcessRole, certificate: ServerCertificate | None
) -> ServerOptions:
    """The ext_proc and health servers' options from the flags. A worker serves no health
    port (its supervisor serves the pod's) and shares the ext_proc port."""
    return ServerOptions(
        host=settings.bind_address,
        grpc_port=settings.grpc_port,
        health_port=None if role.worker else settings.grpc_health_port,
        health_on_extproc_port=settings.health_checking,
        transport=settings.extproc_transport,
        certificate=certificate,
        reload_certificate_from=settings.cert_path if settings.enable_cert_reload else None,
        client_ca=(
            load_client_ca(settings.grpc_client_ca_file)
            if settings.grpc_client_ca_file is not None
            else None
        ),
        cipher_suites=tuple(CIPHER_SUITES[name] for name in settings.tls_cipher_suites),
        limits=StreamLimits(
            max_request_body_bytes=settings.max_request_body_bytes,
            max_response_buffer_bytes=settings.max_response_buffer_bytes,
            idle_timeout=settings.stream_idle_timeout,
            max_unrouted_streams=settings.max_unrouted_streams,
            protocol_error_pause=settings.protocol_error_pause,
        ),
        max_concurrent_streams=settings.max_concurrent_streams,
        max_streams_per_connection=settings.max_streams_per_connection,
        max_receive_message_length=settings.grpc_max_recv_msg_size,
        max_send_message_length=settings.grpc_max_send_msg_size,
        shared_port=role.worker,
        handoff=role.handoff,
        stream_metrics=settings.enable_grpc_stream_metrics,
    )


def leader_elector(settings: Settings) -> LeaderElector | None:
    if not settings.ha_enable_leader_election:
        return None
    from app.kubernetes import leader_elector

    return leader_elector(settings)


def leader_check(elector: LeaderElector | None) -> Callable[[], bool] | None:
    return elector.leader if elector is not None else None


def metrics_authorizer(settings: Settings) -> RequestAuthorizer | None:
    if not settings.metrics_endpoint_auth:
        return None
    from app.kubernetes import metrics_authorizer  # imports the Kubernetes client lazily

    return metrics_authorizer(settings)


def pprof_pages(settings: Settings) -> dict[str, TextPage]:
    if not settings.enable_pprof:
        return {}
    from app.profiling import pprof_pages

    return pprof_pages()


def metric_catalogue(settings: Settings) -> tuple[Metric, ...]:
    """What /metrics exports: the ext_proc stream metrics only with
    ``--enable-grpc-stream-metrics``, as the llm-d router."""
    if settings.enable_grpc_stream_metrics:
        return CATALOGUE
    return tuple(metric for metric in CATALOGUE if metric not in EXTPROC_STREAM_METRICS)
