"""The ``epp`` command line, flag-compatible with the reference Endpoint Picker."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import ValidationError

from app.durations import parse_duration
from app.settings import CIPHER_SUITES, EXTPROC_TRANSPORTS, Settings
from domain.datastore.static_source import parse_endpoint_list

__all__ = ["build_parser", "main", "parse_settings"]

_TRUE = {"1", "t", "true", "yes", "y", "on"}
_FALSE = {"0", "f", "false", "no", "n", "off"}


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true or false)")


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not in 0..65535")
    return value


def _verbosity(text: str) -> int:
    try:
        value = int(text.removeprefix("="))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def _endpoints(text: str) -> str:
    if not text:
        return text
    try:
        parse_endpoint_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _ports(text: str) -> tuple[int, ...]:
    try:
        ports = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated port list") from None
    if not 1 <= len(ports) <= 8 or any(not 0 < p < 65536 for p in ports):
        raise argparse.ArgumentTypeError("must be 1 to 8 ports in 1..65535")
    if len(set(ports)) != len(ports):
        raise argparse.ArgumentTypeError("ports must be unique")
    return ports


def _bytes(text: str) -> int:
    """A size in bytes: ``16777216``, or with a binary suffix ``16Mi``, ``512Ki``, ``1Gi``."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    number, factor = text.strip(), 1
    for suffix, size in units.items():
        if number.endswith(suffix):
            number, factor = number.removesuffix(suffix), size
            break
    if not number.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes (e.g. 16Mi)")
    return int(number) * factor


def _count(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer")
    return int(text)


def _tls_version(text: str) -> str:
    if text == "VersionTLS12":
        return text
    if text == "VersionTLS13":
        raise argparse.ArgumentTypeError(
            "gRPC's Python server cannot be limited to TLS 1.3; it negotiates TLS 1.3 with "
            "clients that offer it and never accepts less than TLS 1.2 (VersionTLS12)"
        )
    if text in ("VersionTLS10", "VersionTLS11"):
        raise argparse.ArgumentTypeError(f"{text}: gRPC never accepts less than TLS 1.2")
    raise argparse.ArgumentTypeError(f"{text!r} is not a TLS version (VersionTLS12)")


def _cipher_suites(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in CIPHER_SUITES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"{', '.join(unknown)}: not a TLS 1.2 cipher suite gRPC can use "
            f"(one of {', '.join(CIPHER_SUITES)})"
        )
    if not names:
        raise argparse.ArgumentTypeError("no cipher suite named")
    return names


def _workers(text: str) -> int:
    """A positive worker count, or ``auto``: the cores this process may use."""
    if text.strip().lower() == "auto":
        from app.workers.cpus import usable_cpus

        return usable_cpus()
    value = text.strip()
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer or auto")
    return int(value)


def _selector(text: str) -> str:
    if not text:
        return text
    for part in text.split(","):
        key, sep, _ = part.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"{part!r} is not key=value")
    return text


def _ca_file_problem(path: Path) -> str:
    """Why ``path`` is not a usable PEM file of CA certificates ("" when it is)."""
    from adapters.envoy.tls import load_client_ca  # cryptography, only when asked for

    try:
        load_client_ca(path)
    except (OSError, ValueError) as exc:
        return str(exc)
    return ""


def _add_bool(parser: argparse.ArgumentParser, flag: str, default: bool, help_text: str) -> None:
    parser.add_argument(
        flag,
        type=_bool,
        nargs="?",
        const=True,
        default=default,
        metavar="BOOL",
        help=f"{help_text} (default {str(default).lower()}; --flag, --flag=true, --flag=false)",
    )


def _add(
    parser: argparse.ArgumentParser,
    flag: str,
    kind: Callable[[str], object],
    default: object,
    help_text: str,
) -> None:
    parser.add_argument(flag, type=kind, default=default, help=f"{help_text} (default {default})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epp",
        description="Endpoint Picker for LLM inference, serving Envoy ext_proc.",
        allow_abbrev=False,
    )
    _add(parser, "--grpc-port", _port, 9002, "ext_proc gRPC port")
    _add(parser, "--grpc-health-port", _port, 9003, "gRPC health port")
    _add(parser, "--metrics-port", _port, 9090, "Prometheus metrics port")
    _add(parser, "--bind-address", str, "0.0.0.0", "address the gRPC servers listen on")
    _add_bool(parser, "--secure-serving", True, "serve ext_proc over TLS")
    parser.add_argument(
        "--cert-path",
        type=Path,
        default=None,
        help="directory with tls.crt and tls.key; a self-signed certificate when empty",
    )
    parser.add_argument(
        "--grpc-client-ca-file",
        type=Path,
        default=None,
        help="require ext_proc clients (the gateway) to present a certificate signed by a CA "
        "of this PEM file (mTLS); read at start-up",
    )
    _add_bool(parser, "--health-checking", False, "also serve gRPC health on the ext_proc port")
    parser.add_argument(
        "--extproc-transport",
        choices=EXTPROC_TRANSPORTS,
        default="native",
        help="what serves the ext_proc port: grpcio (grpc.aio), or native (the EPP's own "
        "HTTP/2 framing, about a third of grpcio's CPU per message; docs/decisions/0020) "
        "(default native)",
    )
    config = parser.add_mutually_exclusive_group()
    config.add_argument("--config-file", type=Path, default=None, help="EndpointPickerConfig file")
    config.add_argument("--config-text", default=None, help="EndpointPickerConfig as text")
    _add(parser, "--pool-name", str, "", "InferencePool to serve")
    parser.add_argument(
        "--pool-namespace",
        default=None,
        help="namespace of the pool (default: $NAMESPACE, else 'default')",
    )
    _add(parser, "--pool-group", str, "inference.networking.k8s.io", "InferencePool API group")
    parser.add_argument(
        "--static-endpoints",
        type=_endpoints,
        default="",
        help='model servers outside Kubernetes, "ip:port,ip:port" (metrics at /metrics)',
    )
    parser.add_argument(
        "--endpoint-selector",
        type=_selector,
        default="",
        help='standalone mode without InferencePool: pods matching "k=v,k=v"',
    )
    parser.add_argument(
        "--endpoint-target-ports",
        type=_ports,
        default=(),
        help='ports of --endpoint-selector pods, "8000,8001" (1 to 8)',
    )
    parser.add_argument(
        "--kubeconfig",
        type=Path,
        default=None,
        help="kubeconfig file (default: in-cluster config, else ~/.kube/config)",
    )
    parser.add_argument(
        "--static-objectives",
        type=Path,
        default=None,
        help="YAML of InferenceObjective and InferenceModelRewrite manifests, for use "
        "without Kubernetes",
    )
    _add(
        parser,
        "--prepare-data-timeout",
        _duration,
        "400ms",
        "total time the data producers may take per request",
    )
    _add_bool(
        parser,
        "--explain-decisions",
        False,
        "add an x-epp-decision response header naming each profile's choice",
    )
    _add_bool(
        parser,
        "--emit-endpoint-scores",
        False,
        "put the primary profile's per-endpoint scores in the envoy.lb dynamic metadata"
        " (x-gateway-destination-endpoint-scores)",
    )
    _add_bool(
        parser,
        "--disable-endpoint-subset-filter",
        False,
        "ignore the gateway's envoy.lb.subset_hint metadata",
    )
    _add(parser, "--refresh-metrics-interval", _duration, "50ms", "model-server scrape interval")
    _add(
        parser,
        "--refresh-prometheus-metrics-interval",
        _duration,
        "5s",
        "pool gauge refresh interval",
    )
    _add(parser, "--metrics-staleness-threshold", _duration, "2s", "age of stale metrics")
    _add(
        parser,
        "--shutdown-grace-period",
        _duration,
        "30s",
        "how long in-flight streams may finish after SIGTERM",
    )
    _add(
        parser,
        "--max-request-body-bytes",
        _bytes,
        "16Mi",
        "request bodies larger than this are answered 413 (0: no limit)",
    )
    _add(
        parser,
        "--max-response-buffer-bytes",
        _bytes,
        "16Mi",
        "a non-streamed response larger than this is passed through unbuffered, without "
        "reading its token usage (0: no limit)",
    )
    _add(
        parser,
        "--stream-idle-timeout",
        _duration,
        "10m",
        "close an ext_proc stream after this long without a message from Envoy (0: never)",
    )
    _add(
        parser,
        "--max-concurrent-streams",
        _count,
        10000,
        "ext_proc streams served at once; more are refused (0: no limit)",
    )
    _add(
        parser,
        "--max-streams-per-connection",
        _count,
        100,
        "ext_proc streams one HTTP/2 connection may open at once (SETTINGS_MAX_CONCURRENT_"
        "STREAMS); Envoy opens more connections as needed (0: no limit)",
    )
    _add(
        parser,
        "--max-unrouted-streams",
        _count,
        1000,
        "ext_proc streams whose request is not yet routed; past it the oldest is closed "
        "(0: no limit)",
    )
    _add(
        parser,
        "--protocol-error-pause",
        _duration,
        "1s",
        "after an ext_proc stream breaks the protocol (a second request on it, say), its "
        "connection is not read for 10 ms, doubling with each such stream from that host, up "
        "to this (native transport; 0: never)",
    )
    parser.add_argument(
        "-v",
        "--v",
        dest="verbosity",
        type=_verbosity,
        default=0,
        help="log verbosity: 0-2 info, 3 and above debug (default 0)",
    )
    parser.add_argument(
        "--log-format", choices=("text", "json"), default="text", help="log format (default text)"
    )
    _add_bool(parser, "--tracing", True, "OpenTelemetry tracing")
    _add_bool(
        parser,
        "--enable-pprof",
        True,
        "serve /debug/pprof/ on the metrics port: stacks of all asyncio tasks and threads, "
        "and a sampled CPU profile",
    )
    _add_bool(
        parser,
        "--metrics-endpoint-auth",
        True,
        "require a bearer token on the metrics port, checked with a Kubernetes TokenReview "
        "and a SubjectAccessReview (get on the path); must be false with --static-endpoints",
    )
    _add_bool(
        parser,
        "--ha-enable-leader-election",
        False,
        "active-passive: only the holder of a coordination.k8s.io Lease reports ready",
    )
    _add_bool(
        parser,
        "--enable-cert-reload",
        False,
        "serve a renewed tls.crt/tls.key from --cert-path to new connections without a restart",
    )
    _add_bool(
        parser,
        "--watch-config-file",
        False,
        "reload --config-file when it changes (a ConfigMap update); a bad new config is "
        "logged and the running one kept",
    )
    _add(
        parser,
        "--grpc-max-recv-msg-size",
        _bytes,
        "64Mi",
        "largest gRPC message the ext_proc server accepts",
    )
    _add(
        parser,
        "--grpc-max-send-msg-size",
        _bytes,
        "64Mi",
        "largest gRPC message the ext_proc server sends",
    )
    parser.add_argument(
        "--tls-min-version",
        type=_tls_version,
        default="VersionTLS12",
        help="lowest TLS version on the ext_proc port; gRPC's TLS always refuses versions "
        "below 1.2, and VersionTLS13 cannot be required with it (default VersionTLS12)",
    )
    parser.add_argument(
        "--tls-cipher-suites",
        type=_cipher_suites,
        default=(),
        help="comma-separated TLS 1.2 cipher suites (Go names, e.g. "
        "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256) for the ext_proc port; TLS 1.3 suites are "
        "fixed by gRPC (default: gRPC's)",
    )
    parser.add_argument(
        "--metrics-cert-dir",
        type=Path,
        default=None,
        help="serve the metrics port over HTTPS with tls.crt and tls.key of this directory",
    )
    parser.add_argument(
        "--metrics-client-ca-file",
        type=Path,
        default=None,
        help="with --metrics-cert-dir: require client certificates signed by this CA (mTLS)",
    )
    _add_bool(parser, "--uvloop", True, "run on uvloop when it is installed")
    parser.add_argument(
        "--redis-url",
        default="",
        help="share the prefix index and in-flight load with the pool's other EPP processes "
        "on this Redis (redis://, rediss://, redis+cluster://, rediss+cluster://); "
        "default empty: everything stays in this process",
    )
    parser.add_argument(
        "--redis-key-prefix",
        default="",
        help="prefix of every Redis key (default epp:<pool-namespace>/<pool-name>, "
        "epp:static with --static-endpoints)",
    )
    _add(
        parser,
        "--redis-deadline",
        _duration,
        "5ms",
        "the routing path's budget for the shared prefix match (past it, the local index)"
        " and for each session-binding read or write (past it, unbound)",
    )
    _add(
        parser,
        "--redis-claim-deadline",
        _duration,
        "50ms",
        "how long a request with a prefix nobody holds waits for its claim (past it, the "
        "pick stands for that request); it then pays a full prefill, so the wait is small "
        "beside it",
    )
    _add(parser, "--redis-lease", _duration, "10s", "how long a process's published load lives")
    _add(
        parser,
        "--redis-load-staleness",
        _duration,
        "20ms",
        "how often the other processes' load is read back without a change here "
        "(a change syncs after a quarter of it; idle with nothing booked, every second)",
    )
    _add(parser, "--redis-prefix-ttl", _duration, "1h", "life of a prefix block after its write")
    parser.add_argument(
        "--workers",
        type=_workers,
        default=1,
        metavar="N|auto",
        help="worker processes serving ext_proc on the same port, under one supervisor "
        "(auto: the cores this process may use, cgroup CPU limits included); more than 1 "
        "needs --redis-url (default 1: one process, no supervisor)",
    )
    return parser


def parse_settings(argv: Sequence[str] | None = None) -> Settings:
    """Parse flags into ``Settings``; on a bad flag print why and exit with code 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    values = vars(args)
    if values["pool_namespace"] is None:
        values["pool_namespace"] = os.environ.get("NAMESPACE") or "default"
    for flag in ("refresh_metrics_interval", "refresh_prometheus_metrics_interval"):
        if values[flag] <= 0:
            parser.error(f"argument --{flag.replace('_', '-')}: must be greater than 0")
    if values["metrics_staleness_threshold"] <= 0:
        parser.error("argument --metrics-staleness-threshold: must be greater than 0")
    modes = [values["pool_name"], values["static_endpoints"], values["endpoint_selector"]]
    if sum(bool(m) for m in modes) != 1:
        parser.error(
            "exactly one of --pool-name, --endpoint-selector and --static-endpoints must be set"
        )
    if values["endpoint_selector"] and not values["endpoint_target_ports"]:
        parser.error("argument --endpoint-target-ports: required with --endpoint-selector")
    if values["prepare_data_timeout"] <= 0:
        parser.error("argument --prepare-data-timeout: must be greater than 0")
    for flag in (
        "redis_deadline",
        "redis_claim_deadline",
        "redis_lease",
        "redis_load_staleness",
        "redis_prefix_ttl",
    ):
        if values[flag] <= 0:
            parser.error(f"argument --{flag.replace('_', '-')}: must be greater than 0")
    if values["redis_url"]:
        from adapters.redis import parse_redis_url

        try:
            parse_redis_url(values["redis_url"])
        except ValueError as exc:  # the message masks the password
            parser.error(f"argument --redis-url: {exc}")
    if "{" in values["redis_key_prefix"] or "}" in values["redis_key_prefix"]:
        parser.error("argument --redis-key-prefix: may not contain braces")
    if values["redis_load_staleness"] >= values["redis_lease"]:
        parser.error("argument --redis-load-staleness: must be shorter than --redis-lease")
    if values["workers"] > 1 and not values["redis_url"]:
        parser.error(
            f"argument --workers: {values['workers']} workers need --redis-url: workers share "
            "the prefix index and in-flight load through it (use --workers 1 without Redis)"
        )
    for flag in ("static_objectives", "kubeconfig"):
        if values[flag] is not None and not values[flag].is_file():
            parser.error(f"argument --{flag.replace('_', '-')}: {values[flag]} is not a file")
    if values["cert_path"] is not None and not values["cert_path"].is_dir():
        parser.error(f"argument --cert-path: {values['cert_path']} is not a directory")
    if values["config_file"] is not None and not values["config_file"].is_file():
        parser.error(f"argument --config-file: {values['config_file']} is not a readable file")
    _check_operations(parser, values)
    try:
        return Settings(**values)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = "--" + "-".join(str(p) for p in first["loc"]).replace("_", "-")
        parser.error(f"argument {field}: {first['msg']}")


def _check_operations(parser: argparse.ArgumentParser, values: dict[str, object]) -> None:
    """The flags of operations (issue 15) that need something else to be set."""
    static = bool(values["static_endpoints"])
    if static and values["metrics_endpoint_auth"]:
        parser.error(
            "argument --metrics-endpoint-auth: checks tokens with the Kubernetes API, which "
            "--static-endpoints does not use; pass --metrics-endpoint-auth=false, then keep "
            "the metrics port private or require client certificates (--metrics-cert-dir "
            "with --metrics-client-ca-file)"
        )
    if static and values["ha_enable_leader_election"]:
        parser.error(
            "argument --ha-enable-leader-election: needs the Kubernetes API, which "
            "--static-endpoints does not use"
        )
    if values["enable_cert_reload"] and not (values["secure_serving"] and values["cert_path"]):
        parser.error(
            "argument --enable-cert-reload: needs --secure-serving and --cert-path (the "
            "self-signed certificate is never renewed)"
        )
    if values["watch_config_file"] and values["config_file"] is None:
        parser.error("argument --watch-config-file: needs --config-file")
    client_ca = values["grpc_client_ca_file"]
    if client_ca is not None:
        assert isinstance(client_ca, Path)
        if not values["secure_serving"]:
            parser.error("argument --grpc-client-ca-file: needs --secure-serving")
        problem = _ca_file_problem(client_ca)
        if problem:
            parser.error(f"argument --grpc-client-ca-file: {problem}")
    cert_dir = values["metrics_cert_dir"]
    if cert_dir is not None:
        assert isinstance(cert_dir, Path)
        missing = [n for n in ("tls.crt", "tls.key") if not (cert_dir / n).is_file()]
        if missing:
            parser.error(f"argument --metrics-cert-dir: no {' or '.join(missing)} in {cert_dir}")
    ca_file = values["metrics_client_ca_file"]
    if ca_file is not None:
        assert isinstance(ca_file, Path)
        if cert_dir is None:
            parser.error("argument --metrics-client-ca-file: needs --metrics-cert-dir")
        if not ca_file.is_file():
            parser.error(f"argument --metrics-client-ca-file: {ca_file} is not a file")
    if values["tls_cipher_suites"] and not values["secure_serving"]:
        parser.error("argument --tls-cipher-suites: needs --secure-serving")
    for flag in ("grpc_max_recv_msg_size", "grpc_max_send_msg_size"):
        size = values[flag]
        assert isinstance(size, int)
        if not 1024 <= size <= 2**31 - 1:
            parser.error(f"argument --{flag.replace('_', '-')}: must be 1Ki to 2Gi-1 bytes")


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
