"""Process settings, validated by pydantic; built from the command line by ``app.cli``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["CIPHER_SUITES", "EXTPROC_TRANSPORTS", "LegacyMetrics", "Settings"]

Port = int


#: The TLS 1.2 suites of ``--tls-cipher-suites``: Go's names (the reference's flag) and the
#: BoringSSL names gRPC takes. TLS 1.3 suites are not configurable in gRPC.
CIPHER_SUITES = {
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
}


#: ``--extproc-transport``: grpc.aio, or the EPP's own HTTP/2 framing (docs/decisions/0020).
EXTPROC_TRANSPORTS = ("grpcio", "native")


class LegacyMetrics(BaseModel):
    """The reference's deprecated model-server metrics flags; ``None``: not given. Applied
    over the config's ``metrics-data-source`` parameters and the default engine's metric
    specs of ``core-metrics-extractor`` (``app.config.legacy``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    scheme: Literal["http", "https"] | None = None
    path: str | None = None
    port: int | None = Field(default=None, ge=0, le=65535)
    insecure_skip_verify: bool | None = None
    queued_requests_spec: str | None = None
    running_requests_spec: str | None = None
    kv_usage_spec: str | None = None
    lora_spec: str | None = None
    cache_info_spec: str | None = None

    def given(self) -> dict[str, object]:
        """The fields that were set, by name."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


class Settings(BaseModel):
    """Everything the process needs to start. Durations are in seconds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    grpc_port: Port = Field(default=9002, ge=0, le=65535)
    grpc_health_port: Port = Field(default=9003, ge=0, le=65535)
    metrics_port: Port = Field(default=9090, ge=0, le=65535)
    bind_address: str = "0.0.0.0"
    secure_serving: bool = True
    cert_path: Path | None = None
    grpc_client_ca_file: Path | None = None
    health_checking: bool = False
    extproc_transport: Literal["grpcio", "native"] = "native"
    config_file: Path | None = None
    config_text: str | None = None
    pool_name: str = ""
    pool_namespace: str = "default"
    pool_group: str = "inference.networking.k8s.io"
    static_endpoints: str = ""
    endpoint_selector: str = ""
    endpoint_target_ports: tuple[int, ...] = ()
    static_objectives: Path | None = None
    kubeconfig: Path | None = None
    prepare_data_timeout: float = Field(default=0.4, gt=0)
    explain_decisions: bool = False
    emit_endpoint_scores: bool = False
    disable_endpoint_subset_filter: bool = False
    refresh_metrics_interval: float = Field(default=0.05, gt=0)
    refresh_prometheus_metrics_interval: float = Field(default=5.0, gt=0)
    metrics_staleness_threshold: float = Field(default=2.0, gt=0)
    shutdown_grace_period: float = Field(default=30.0, ge=0)
    drain_timeout: float = Field(default=0.0, ge=0)
    max_request_body_bytes: int = Field(default=16 * 1024 * 1024, ge=0)
    max_response_buffer_bytes: int = Field(default=16 * 1024 * 1024, ge=0)
    stream_idle_timeout: float = Field(default=600.0, ge=0)
    max_concurrent_streams: int = Field(default=10_000, ge=0)
    max_streams_per_connection: int = Field(default=100, ge=0)
    max_unrouted_streams: int = Field(default=1000, ge=0)
    protocol_error_pause: float = Field(default=1.0, ge=0)
    verbosity: int = Field(default=0, ge=0)
    log_format: Literal["text", "json"] = "text"
    # The reference's zap logging flags (app.logsetup.LogOptions); None: not given.
    zap_log_level: str | None = None
    zap_devel: bool = False
    zap_stacktrace_level: str | None = None
    zap_time_encoding: str | None = None
    tracing: bool = True
    enable_pprof: bool = True
    metrics_endpoint_auth: bool = True
    ha_enable_leader_election: bool = False
    enable_cert_reload: bool = False
    watch_config_file: bool = False
    feature_gates: tuple[tuple[str, bool], ...] = ()
    allow_experimental_plugins: bool = False
    enable_grpc_stream_metrics: bool = False
    legacy_metrics: LegacyMetrics = LegacyMetrics()
    grpc_max_recv_msg_size: int = Field(default=4 * 1024 * 1024, ge=1024, lt=2**31)
    grpc_max_send_msg_size: int = Field(default=64 * 1024 * 1024, ge=1024, lt=2**31)
    tls_min_version: Literal["VersionTLS12"] = "VersionTLS12"
    tls_cipher_suites: tuple[str, ...] = ()
    metrics_cert_dir: Path | None = None
    metrics_client_ca_file: Path | None = None
    uvloop: bool = True
    # Shared state (docs/shared-state.md): empty redis_url keeps everything in process.
    redis_url: str = ""
    redis_key_prefix: str = ""
    redis_deadline: float = Field(default=0.005, gt=0)
    redis_claim_deadline: float = Field(default=0.05, gt=0)
    redis_lease: float = Field(default=10.0, gt=0)
    redis_load_staleness: float = Field(default=0.02, gt=0)
    redis_prefix_ttl: float = Field(default=3600.0, gt=0)
    redis_shared_admission: bool = True
    # Worker processes under one supervisor (app/workers); 1: this process serves alone.
    workers: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.config_file is not None and self.config_text is not None:
            raise ValueError("--config-file and --config-text are mutually exclusive")
        modes = [bool(self.pool_name), bool(self.static_endpoints), bool(self.endpoint_selector)]
        if sum(modes) != 1:
            raise ValueError(
                "exactly one of --pool-name, --endpoint-selector and --static-endpoints must be set"
            )
        if self.static_endpoints and self.metrics_endpoint_auth:
            raise ValueError(
                "--metrics-endpoint-auth needs Kubernetes; false with --static-endpoints"
            )
        if self.static_endpoints and self.ha_enable_leader_election:
            raise ValueError("--ha-enable-leader-election needs Kubernetes")
        if "{" in self.redis_key_prefix or "}" in self.redis_key_prefix:
            raise ValueError("--redis-key-prefix may not contain braces")
        if self.workers > 1 and not self.redis_url:
            raise ValueError("--workers > 1 needs --redis-url")
        if self.redis_load_staleness >= self.redis_lease:
            raise ValueError("--redis-load-staleness must be shorter than --redis-lease")
        return self

    def shared_key_prefix(self) -> str:
        """``--redis-key-prefix``, else ``epp:<pool-namespace>/<pool-name>`` (``epp:static``
        in static mode, ``epp:<namespace>/selector/<selector>`` with ``--endpoint-selector``)."""
        if self.redis_key_prefix:
            return self.redis_key_prefix
        if self.static_endpoints:
            return "epp:static"
        if self.pool_name:
            return f"epp:{self.pool_namespace}/{self.pool_name}"
        return f"epp:{self.pool_namespace}/selector/{self.endpoint_selector}"
