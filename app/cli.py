"""The ``epp`` command line: the flags of ``app.flags`` checked together into ``Settings``.

Every flag the reference Endpoint Picker and the llm-d router document, and every flag their
Helm charts pass, is accepted (docs/drop-in.md); an unknown flag or a bad value stops
start-up with one line naming it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from app.flags import FlagError, build_parser, defaults
from app.settings import CIPHER_SUITES, Settings

__all__ = ["build_parser", "main", "parse_settings"]


def parse_settings(argv: Sequence[str] | None = None) -> Settings:
    """Parse flags into ``Settings``; on a bad flag print one line saying why (the flag,
    the value, what is expected) and exit with code 2."""
    try:
        return _parse(list(sys.argv[1:] if argv is None else argv))
    except FlagError as exc:
        hint = " (epp --help lists the flags)" if str(exc).startswith("unknown flag") else ""
        sys.stderr.write(f"epp: {exc}{hint}\n")
        raise SystemExit(2) from None


def _parse(argv: list[str]) -> Settings:
    given = vars(build_parser().parse_args(argv))
    values = {**defaults(), **given}
    if values["pool_namespace"] is None:
        values["pool_namespace"] = os.environ.get("NAMESPACE") or "default"
    _check_modes(values)
    _check_durations(values)
    _check_shared_state(values)
    _check_files(values)
    _check_operations(values)
    nested: dict[str, dict[str, object]] = {}
    for key in [k for k in values if "." in k]:
        group, _, name = key.partition(".")
        value = values.pop(key)
        if value is not None:
            nested.setdefault(group, {})[name] = value
    try:
        return Settings(**values, **nested)  # type: ignore[arg-type]
    except ValidationError as exc:
        first = exc.errors()[0]
        field = "--" + "-".join(str(p) for p in first["loc"]).replace("_", "-")
        raise FlagError(f"{field}: {first['msg']}") from None


def _check_modes(values: dict[str, Any]) -> None:
    modes = [values["pool_name"], values["static_endpoints"], values["endpoint_selector"]]
    if sum(bool(m) for m in modes) != 1:
        raise FlagError(
            "exactly one of --pool-name, --endpoint-selector and --static-endpoints must be set"
        )
    if values["endpoint_selector"] and not values["endpoint_target_ports"]:
        raise FlagError("--endpoint-target-ports: required with --endpoint-selector")
    if values["workers"] > 1 and not values["redis_url"]:
        raise FlagError(
            f"--workers {values['workers']}: workers need --redis-url: they share the prefix "
            "index and in-flight load through it (use --workers 1 without Redis)"
        )


_POSITIVE_DURATIONS = (
    "refresh_metrics_interval",
    "refresh_prometheus_metrics_interval",
    "metrics_staleness_threshold",
    "prepare_data_timeout",
    "redis_deadline",
    "redis_claim_deadline",
    "redis_lease",
    "redis_load_staleness",
    "redis_prefix_ttl",
)


def _check_durations(values: dict[str, Any]) -> None:
    for name in _POSITIVE_DURATIONS:
        if values[name] <= 0:
            raise FlagError(f"--{name.replace('_', '-')}: must be greater than 0")


def _check_shared_state(values: dict[str, Any]) -> None:
    if values["redis_url"]:
        from adapters.redis import parse_redis_url

        try:
            parse_redis_url(values["redis_url"])
        except ValueError as exc:  # the message masks the password
            raise FlagError(f"--redis-url: {exc}") from None
    if "{" in values["redis_key_prefix"] or "}" in values["redis_key_prefix"]:
        raise FlagError(f"--redis-key-prefix {values['redis_key_prefix']}: may not contain braces")
    if values["redis_load_staleness"] >= values["redis_lease"]:
        raise FlagError("--redis-load-staleness: must be shorter than --redis-lease")


def _check_files(values: dict[str, Any]) -> None:
    for name in ("static_objectives", "kubeconfig"):
        if values[name] is not None and not values[name].is_file():
            raise FlagError(f"--{name.replace('_', '-')} {values[name]}: is not a file")
    if values["cert_path"] is not None and not values["cert_path"].is_dir():
        raise FlagError(f"--cert-path {values['cert_path']}: is not a directory")
    if values["config_file"] is not None and not values["config_file"].is_file():
        raise FlagError(f"--config-file {values['config_file']}: is not a readable file")


def _ca_file_problem(path: Path) -> str:
    """Why ``path`` is not a usable PEM file of CA certificates ("" when it is)."""
    from adapters.envoy.tls import load_client_ca  # cryptography, only when asked for

    try:
        load_client_ca(path)
    except (OSError, ValueError) as exc:
        return str(exc)
    return ""


def _check_operations(values: dict[str, Any]) -> None:
    """The flags of operations that need something else to be set."""
    static = bool(values["static_endpoints"])
    if static and values["metrics_endpoint_auth"]:
        raise FlagError(
            "--metrics-endpoint-auth: checks tokens with the Kubernetes API, which "
            "--static-endpoints does not use; pass --metrics-endpoint-auth=false, then keep "
            "the metrics port private or require client certificates (--metrics-cert-dir "
            "with --metrics-client-ca-file)"
        )
    if static and values["ha_enable_leader_election"]:
        raise FlagError(
            "--ha-enable-leader-election: needs the Kubernetes API, which --static-endpoints "
            "does not use"
        )
    if values["enable_cert_reload"] and not (values["secure_serving"] and values["cert_path"]):
        raise FlagError(
            "--enable-cert-reload: needs --secure-serving and --cert-path (the self-signed "
            "certificate is never renewed)"
        )
    if values["watch_config_file"] and values["config_file"] is None:
        raise FlagError("--watch-config-file: needs --config-file")
    client_ca = values["grpc_client_ca_file"]
    if client_ca is not None:
        if not values["secure_serving"]:
            raise FlagError("--grpc-client-ca-file: needs --secure-serving")
        problem = _ca_file_problem(client_ca)
        if problem:
            raise FlagError(f"--grpc-client-ca-file {client_ca}: {problem}")
    cert_dir = values["metrics_cert_dir"]
    if cert_dir is not None:
        missing = [n for n in ("tls.crt", "tls.key") if not (cert_dir / n).is_file()]
        if missing:
            raise FlagError(f"--metrics-cert-dir {cert_dir}: no {' or '.join(missing)} in it")
    ca_file = values["metrics_client_ca_file"]
    if ca_file is not None:
        if cert_dir is None:
            raise FlagError("--metrics-client-ca-file: needs --metrics-cert-dir")
        if not ca_file.is_file():
            raise FlagError(f"--metrics-client-ca-file {ca_file}: is not a file")
    if values["tls_cipher_suites"] and not values["secure_serving"]:
        raise FlagError("--tls-cipher-suites: needs --secure-serving")
    for name in ("grpc_max_recv_msg_size", "grpc_max_send_msg_size"):
        if not 1024 <= values[name] <= 2**31 - 1:
            raise FlagError(
                f"--{name.replace('_', '-')} {values[name]}: must be 1Ki to 2Gi-1 bytes"
            )


def main(argv: Sequence[str] | None = None) -> None:
    arguments = list(sys.argv[1:] if argv is None else argv)
    settings = parse_settings(arguments)
    if settings.tls_cipher_suites:
        # Read by gRPC's core once, when it loads: set before anything imports grpc.
        os.environ["GRPC_SSL_CIPHER_SUITES"] = ":".join(
            CIPHER_SUITES[name] for name in settings.tls_cipher_suites
        )
    from app.workers.role import worker_role_from_environment

    role = worker_role_from_environment()
    if role is not None:  # started by a supervisor (``--workers`` > 1)
        from app.workers.worker import run_worker

        sys.exit(run_worker(settings, role))
    if settings.workers > 1:
        # The supervisor starts workers with fork+exec while its gRPC health server runs:
        # gRPC's fork handlers are for children that keep using gRPC, which these never do.
        os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
        from app.workers.supervisor import run_supervisor

        sys.exit(run_supervisor(settings, arguments))
    from app.runner import run

    sys.exit(run(settings))
