"""The ``epp`` flags as one table: the parser, ``--help`` and ``docs/flags.md`` come from it.

Each row is one flag: its group, default, meaning, where else it exists (the reference
Endpoint Picker, the llm-d router) and its status here:

- ``supported``: it does what it does there (or, for this EPP's own flags, what it says);
- ``deprecated``: the reference still accepts it but names a replacement; accepted, applied
  where it has a meaning here, and warned about once at start-up;
- ``ignored``: it cannot apply here; accepted and logged once at start-up as ignored.

``python -m app.flags`` prints the flag reference (``docs/flags.md``); a test keeps that
file equal to it.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn

from app.durations import parse_duration
from app.settings import CIPHER_SUITES, EXTPROC_TRANSPORTS, Settings
from domain.datastore.static_source import parse_endpoint_list

__all__ = [
    "FLAGS",
    "GROUPS",
    "Flag",
    "FlagError",
    "build_parser",
    "defaults",
    "log_startup_notices",
    "render_markdown",
    "startup_notices",
]

logger = logging.getLogger(__name__)

REFERENCE = "reference"
LLM_D = "llm-d"
BOTH = frozenset({REFERENCE, LLM_D})

#: The groups of ``--help`` and of the flag reference, in order, with one line each.
GROUPS: dict[str, str] = {
    "serving": "the ext_proc and health servers, request limits, shutdown",
    "discovery": "where the model servers come from",
    "scheduling and data": "the EndpointPickerConfig, scraping, what the decision emits",
    "shared state": "replicas and workers sharing their state on Redis",
    "workers": "several worker processes under one supervisor",
    "observability": "logs, metrics, traces, profiles",
    "security": "TLS and who may read the metrics",
    "compatibility": "the reference's deprecated flags, accepted for its Helm charts",
}


class FlagError(Exception):
    """A bad command line; the message is one line naming the flag and what is wrong."""


# -- value parsers: each raises argparse.ArgumentTypeError with a reason naming the value --

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
        raise argparse.ArgumentTypeError(f"{value}: must be >= 0")
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
        raise argparse.ArgumentTypeError(f"{text!r}: must be 1 to 8 ports in 1..65535")
    if len(set(ports)) != len(ports):
        raise argparse.ArgumentTypeError(f"{text!r}: ports must be unique")
    return ports


_SIZE = re.compile(r"(\d+)\s*(Ki|Mi|Gi|Ti|k|K|M|G|T)?(B)?")
_SIZE_FACTORS = {
    None: 1,
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
    "k": 10**3,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
}


def _bytes(text: str) -> int:
    """A size in bytes: ``16777216``, ``16Mi``, ``16MiB``, ``25MB``, ``512Ki`` (binary
    suffixes are powers of 1024, decimal ones of 1000, as Kubernetes quantities)."""
    match = _SIZE.fullmatch(text.strip())
    if match is None or (match.group(3) and not match.group(2)):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size in bytes (e.g. 16Mi, 16MiB, 25MB, 4194304)"
        )
    return int(match.group(1)) * _SIZE_FACTORS[match.group(2)]


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
        from app.cpus import usable_cpus

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


def _unquoted(text: str) -> str:
    """The value without one pair of enclosing double quotes: the reference's chart
    renders some values as ``--flag="value"`` inside a YAML string, quotes included."""
    if len(text) >= 2 and text[0] == text[-1] == '"':
        return text[1:-1]
    return text


def _metric_spec(text: str) -> str:
    from domain.datalayer.metric_spec import parse_metric_spec

    spec = _unquoted(text)
    try:
        parse_metric_spec(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{spec!r} is not a metric spec: {exc}") from None
    return spec


def _scheme(text: str) -> str:
    scheme = _unquoted(text)
    if scheme not in ("http", "https"):
        raise argparse.ArgumentTypeError(f"{scheme!r} is not a scheme (http or https)")
    return scheme


def _metrics_path(text: str) -> str:
    path = _unquoted(text)
    if not path.startswith("/") or any(c in path for c in " \r\n"):
        raise argparse.ArgumentTypeError(f"{path!r} is not an absolute path without spaces")
    return path


def _zap_encoder(text: str) -> str:
    """``json`` is this EPP's JSON lines; ``console`` its text lines."""
    encoders = {"json": "json", "console": "text"}
    if text not in encoders:
        raise argparse.ArgumentTypeError(f"{text!r} is not a zap encoder (json or console)")
    return encoders[text]


_ZAP_LEVELS = ("debug", "info", "warn", "error", "dpanic", "panic", "fatal")


def _zap_level(text: str) -> str:
    """A zap level name, or an integer > 0: that verbosity (as ``-v``)."""
    lowered = text.strip().lower()
    if lowered in _ZAP_LEVELS or (lowered.isdigit() and int(lowered) > 0):
        return lowered
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a zap level ({', '.join(_ZAP_LEVELS)}, or an integer > 0)"
    )


def _zap_stacktrace_level(text: str) -> str:
    lowered = text.strip().lower()
    if lowered in _ZAP_LEVELS:
        return lowered
    raise argparse.ArgumentTypeError(f"{text!r} is not a zap level ({', '.join(_ZAP_LEVELS)})")


TIME_ENCODINGS = ("epoch", "millis", "nano", "iso8601", "rfc3339", "rfc3339nano")


def _zap_time_encoding(text: str) -> str:
    if text not in TIME_ENCODINGS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a zap time encoding ({', '.join(TIME_ENCODINGS)})"
        )
    return text


_GATE = re.compile(r"[A-Za-z][A-Za-z0-9]*")


def _feature_gates(text: str) -> tuple[tuple[str, bool], ...]:
    """``name=true,other=false`` (a bare name means true), as Kubernetes' feature gates."""
    gates: list[tuple[str, bool]] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not _GATE.fullmatch(name):
            raise argparse.ArgumentTypeError(f"{part!r} is not name=true|false")
        gates.append((name, _bool(value) if sep else True))
    return tuple(gates)


# -- the table --

Status = Literal["supported", "deprecated", "ignored"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Flag:
    """One flag. ``dest`` is the ``Settings`` field (a dotted path for a nested one);
    ``parse`` is ``None`` for a boolean (``--f``, ``--f=true``, ``--f=false``)."""

    names: tuple[str, ...]
    group: str
    help: str
    default: object = None
    parse: Callable[[str], object] | None = str
    dest: str = ""
    choices: tuple[str, ...] = ()
    metavar: str | None = None
    origin: frozenset[str] = frozenset()
    status: Status = "supported"
    #: deprecated: what replaces it; ignored: why it cannot apply
    note: str = ""
    #: shown as the default in --help and the docs when the default is computed
    shown_default: str = ""
    #: argparse mutually exclusive group name (``--config-file``/``--config-text``)
    exclusive: str = ""

    @property
    def name(self) -> str:
        """The long name (``--grpc-port``)."""
        return next(n for n in self.names if n.startswith("--"))

    @property
    def settings_field(self) -> str:
        return self.dest or self.name.removeprefix("--").replace("-", "_")

    @property
    def is_bool(self) -> bool:
        return self.parse is None

    def default_text(self) -> str:
        if self.shown_default:
            return self.shown_default
        if self.default is None or self.default in ((), ""):
            return '""' if not self.is_bool else "false"
        if isinstance(self.default, bool):
            return str(self.default).lower()
        return str(self.default)


def _flag(
    name: str | tuple[str, ...],
    group: str,
    help: str,
    default: object = None,
    parse: Callable[[str], object] | None = str,
    **kwargs: Any,
) -> Flag:
    names = (name,) if isinstance(name, str) else name
    return Flag(names=names, group=group, help=help, default=default, parse=parse, **kwargs)


def _bool_flag(
    name: str,
    group: str,
    help: str,
    default: bool | None,
    **kwargs: Any,
) -> Flag:
    return _flag(name, group, help, default, None, **kwargs)


_SERVING = "serving"
_DISCOVERY = "discovery"
_SCHEDULING = "scheduling and data"
_SHARED = "shared state"
_WORKERS = "workers"
_OBSERVABILITY = "observability"
_SECURITY = "security"
_COMPAT = "compatibility"

_LEGACY_METRIC = "the core-metrics-extractor's engineConfigs in the EndpointPickerConfig"
_LEGACY_SOURCE = "the metrics-data-source's parameters in the EndpointPickerConfig"

FLAGS: tuple[Flag, ...] = (
    # serving
    _flag("--grpc-port", _SERVING, "ext_proc gRPC port", "9002", _port, origin=BOTH),
    _flag("--grpc-health-port", _SERVING, "gRPC health port", "9003", _port, origin=BOTH),
    _flag("--bind-address", _SERVING, "address the gRPC servers listen on", "0.0.0.0"),
    _flag(
        "--extproc-transport",
        _SERVING,
        "what serves the ext_proc port: grpcio (grpc.aio), or native (the EPP's own HTTP/2 "
        "framing, about a third of grpcio's CPU per message; docs/decisions/0020)",
        "native",
        str,
        choices=EXTPROC_TRANSPORTS,
    ),
    _bool_flag(
        "--health-checking",
        _SERVING,
        "also serve gRPC health on the ext_proc port",
        False,
        origin=BOTH,
    ),
    _bool_flag(
        "--ha-enable-leader-election",
        _SERVING,
        "active-passive: only the holder of a coordination.k8s.io Lease reports ready",
        False,
        origin=BOTH,
    ),
    _flag(
        "--shutdown-grace-period",
        _SERVING,
        "after SIGTERM: health goes NOT_SERVING, the Lease is released, and in-flight "
        "streams may finish for this long",
        "30s",
        _duration,
    ),
    _flag(
        "--drain-timeout",
        _SERVING,
        "after SIGTERM, with health NOT_SERVING and the Lease released, keep serving new "
        "ext_proc streams this long (gateways that still send here meanwhile are served), "
        "then drain for --shutdown-grace-period",
        "0s",
        _duration,
        origin=frozenset({LLM_D}),
    ),
    _flag(
        "--max-request-body-bytes",
        _SERVING,
        "request bodies larger than this are answered 413 (0: no limit)",
        "16Mi",
        _bytes,
    ),
    _flag(
        "--max-response-buffer-bytes",
        _SERVING,
        "a non-streamed response larger than this is passed through unbuffered, without "
        "reading its token usage (0: no limit)",
        "16Mi",
        _bytes,
    ),
    _flag(
        "--stream-idle-timeout",
        _SERVING,
        "close an ext_proc stream after this long without a message from Envoy (0: never)",
        "10m",
        _duration,
    ),
    _flag(
        "--max-concurrent-streams",
        _SERVING,
        "ext_proc streams served at once; more are refused (0: no limit)",
        "10000",
        _count,
    ),
    _flag(
        "--max-streams-per-connection",
        _SERVING,
        "ext_proc streams one HTTP/2 connection may open at once (SETTINGS_MAX_CONCURRENT_"
        "STREAMS); Envoy opens more connections as needed (0: no limit)",
        "100",
        _count,
    ),
    _flag(
        "--max-unrouted-streams",
        _SERVING,
        "ext_proc streams whose request is not yet routed; past it the oldest is closed "
        "(0: no limit)",
        "1000",
        _count,
    ),
    _flag(
        "--protocol-error-pause",
        _SERVING,
        "after an ext_proc stream breaks the protocol (a second request on it, say), its "
        "connection is not read for 10 ms, doubling with each such stream from that host, up "
        "to this (native transport; 0: never)",
        "1s",
        _duration,
    ),
    _flag(
        "--grpc-max-recv-msg-size",
        _SERVING,
        "largest gRPC message the ext_proc server accepts (gRPC's default; Envoy sends a "
        "request or response body in chunks, each a message far smaller)",
        "4Mi",
        _bytes,
        origin=frozenset({LLM_D}),
    ),
    _flag(
        "--grpc-max-send-msg-size",
        _SERVING,
        "largest gRPC message the ext_proc server sends",
        "64Mi",
        _bytes,
        origin=frozenset({LLM_D}),
    ),
    _bool_flag("--uvloop", _SERVING, "run on uvloop when it is installed", True),
    # discovery
    _flag("--pool-name", _DISCOVERY, "InferencePool to serve", "", origin=BOTH),
    _flag(
        "--pool-namespace",
        _DISCOVERY,
        "namespace of the pool",
        None,
        origin=BOTH,
        shown_default="$NAMESPACE, else default",
    ),
    _flag(
        "--pool-group",
        _DISCOVERY,
        "InferencePool API group",
        "inference.networking.k8s.io",
        origin=BOTH,
    ),
    _flag(
        "--endpoint-selector",
        _DISCOVERY,
        'standalone mode without InferencePool: pods matching "k=v,k=v"',
        "",
        _selector,
        origin=BOTH,
    ),
    _flag(
        "--endpoint-target-ports",
        _DISCOVERY,
        'ports of --endpoint-selector pods, "8000,8001" (1 to 8)',
        (),
        _ports,
        origin=BOTH,
    ),
    _flag(
        "--static-endpoints",
        _DISCOVERY,
        'model servers outside Kubernetes, "ip:port,ip:port" (metrics at /metrics)',
        "",
        _endpoints,
    ),
    _flag(
        "--kubeconfig",
        _DISCOVERY,
        "kubeconfig file (default: in-cluster config, else ~/.kube/config)",
        None,
        Path,
        origin=BOTH,
    ),
    _flag(
        "--static-objectives",
        _DISCOVERY,
        "YAML of InferenceObjective and InferenceModelRewrite manifests, for use without "
        "Kubernetes",
        None,
        Path,
    ),
    # scheduling and data
    _flag(
        "--config-file",
        _SCHEDULING,
        "EndpointPickerConfig file",
        None,
        Path,
        origin=BOTH,
        exclusive="config",
    ),
    _flag(
        "--config-text",
        _SCHEDULING,
        "EndpointPickerConfig as text",
        None,
        origin=BOTH,
        exclusive="config",
    ),
    _bool_flag(
        "--watch-config-file",
        _SCHEDULING,
        "reload --config-file when it changes (a ConfigMap update); a bad new config is "
        "logged and the running one kept",
        False,
    ),
    _flag(
        "--feature-gates",
        _SCHEDULING,
        "feature gates, name=true|false,...; added to the config's featureGates (false "
        "removes one the config turns on)",
        (),
        _feature_gates,
        origin=frozenset({LLM_D}),
        metavar="GATES",
    ),
    _bool_flag(
        "--allow-experimental-plugins",
        _SCHEDULING,
        "allow plugins of alpha stability",
        False,
        origin=frozenset({LLM_D}),
        status="ignored",
        note="this EPP has no stability levels: every plugin type it registers can be "
        "configured without it",
    ),
    _flag(
        "--prepare-data-timeout",
        _SCHEDULING,
        "total time the data producers may take per request",
        "400ms",
        _duration,
    ),
    _bool_flag(
        "--explain-decisions",
        _SCHEDULING,
        "add an x-epp-decision response header naming each profile's choice",
        False,
    ),
    _bool_flag(
        "--emit-endpoint-scores",
        _SCHEDULING,
        "put the primary profile's per-endpoint scores in the envoy.lb dynamic metadata "
        "(x-gateway-destination-endpoint-scores)",
        False,
        origin=frozenset({LLM_D}),
    ),
    _bool_flag(
        "--disable-endpoint-subset-filter",
        _SCHEDULING,
        "ignore the gateway's envoy.lb.subset_hint metadata",
        False,
        origin=BOTH,
    ),
    _flag(
        "--refresh-metrics-interval",
        _SCHEDULING,
        "model-server scrape interval",
        "50ms",
        _duration,
        origin=BOTH,
    ),
    _flag(
        "--metrics-staleness-threshold",
        _SCHEDULING,
        "age of stale metrics",
        "2s",
        _duration,
        origin=BOTH,
    ),
    # shared state
    _flag(
        "--redis-url",
        _SHARED,
        "share the prefix index and in-flight load with the pool's other EPP processes on "
        "this Redis (redis://, rediss://, redis+cluster://, rediss+cluster://); empty: "
        "everything stays in this process",
        "",
    ),
    _flag(
        "--redis-key-prefix",
        _SHARED,
        "prefix of every Redis key",
        "",
        shown_default="epp:<pool-namespace>/<pool-name>; epp:static with --static-endpoints",
    ),
    _flag(
        "--redis-deadline",
        _SHARED,
        "the routing path's budget for the shared prefix match (past it, the local index) "
        "and for each session-binding read or write (past it, unbound)",
        "5ms",
        _duration,
    ),
    _flag(
        "--redis-claim-deadline",
        _SHARED,
        "how long a request with a prefix nobody holds waits for its claim (past it, the "
        "pick stands for that request)",
        "50ms",
        _duration,
    ),
    _flag("--redis-lease", _SHARED, "how long a process's published load lives", "10s", _duration),
    _flag(
        "--redis-load-staleness",
        _SHARED,
        "how often the other processes' load is read back without a change here (a change "
        "syncs after a quarter of it; idle with nothing booked, every second)",
        "20ms",
        _duration,
    ),
    _flag(
        "--redis-prefix-ttl",
        _SHARED,
        "life of a prefix block after its write",
        "1h",
        _duration,
    ),
    _bool_flag(
        "--redis-shared-admission",
        _SHARED,
        "flow control and kv-capacity-gate share their state with the pool's other processes "
        "(fairness, priority and in-flight requests counted over the pool; the KV blocks "
        "in-flight requests hold, shared prefixes once); false: each process's own",
        True,
    ),
    # workers
    _flag(
        "--workers",
        _WORKERS,
        "worker processes serving ext_proc on the same port, under one supervisor (auto: "
        "the cores this process may use, cgroup CPU limits included); more than 1 needs "
        "--redis-url",
        "1",
        _workers,
        metavar="N|auto",
    ),
    # observability
    _flag("--metrics-port", _OBSERVABILITY, "Prometheus metrics port", "9090", _port, origin=BOTH),
    _flag(
        "--refresh-prometheus-metrics-interval",
        _OBSERVABILITY,
        "pool gauge refresh interval",
        "5s",
        _duration,
        origin=BOTH,
    ),
    _flag(
        ("-v", "--v"),
        _OBSERVABILITY,
        "log verbosity: 0-2 info, 3 and above debug",
        "0",
        _verbosity,
        dest="verbosity",
        origin=BOTH,
    ),
    _flag(
        "--log-format",
        _OBSERVABILITY,
        "log format: text, or json (JSON lines)",
        "text",
        str,
        choices=("text", "json"),
    ),
    _flag(
        "--zap-encoder",
        _OBSERVABILITY,
        "the reference's name for --log-format: json (JSON lines) or console (text)",
        None,
        _zap_encoder,
        dest="log_format",
        origin=BOTH,
        shown_default="console",
        metavar="json|console",
    ),
    _flag(
        "--zap-log-level",
        _OBSERVABILITY,
        "debug, info, warn, error, dpanic, panic or fatal; or an integer > 0: that "
        "verbosity, as -v (wins over -v)",
        None,
        _zap_level,
        origin=BOTH,
        shown_default="from -v",
        metavar="LEVEL",
    ),
    _bool_flag(
        "--zap-devel",
        _OBSERVABILITY,
        "development logging: stack traces from warn up (unless --zap-stacktrace-level)",
        False,
        origin=BOTH,
    ),
    _flag(
        "--zap-stacktrace-level",
        _OBSERVABILITY,
        "records at this level and above carry the stack that logged them",
        None,
        _zap_stacktrace_level,
        origin=BOTH,
        shown_default="none; warn with --zap-devel",
        metavar="LEVEL",
    ),
    _flag(
        "--zap-time-encoding",
        _OBSERVABILITY,
        "the time of each log record: " + ", ".join(TIME_ENCODINGS),
        None,
        _zap_time_encoding,
        origin=BOTH,
        shown_default="iso8601 (UTC, milliseconds)",
        metavar="ENCODING",
    ),
    _bool_flag("--tracing", _OBSERVABILITY, "OpenTelemetry tracing", True, origin=BOTH),
    _bool_flag(
        "--enable-pprof",
        _OBSERVABILITY,
        "serve /debug/pprof/ on the metrics port: stacks of all asyncio tasks and threads, "
        "and a sampled CPU profile",
        True,
        origin=BOTH,
    ),
    _bool_flag(
        "--enable-grpc-stream-metrics",
        _OBSERVABILITY,
        "export the ext_proc stream metrics (in-flight streams, stream duration, streams "
        "ended by gRPC code)",
        False,
        origin=frozenset({LLM_D}),
    ),
    # security
    _bool_flag("--secure-serving", _SECURITY, "serve ext_proc over TLS", True, origin=BOTH),
    _flag(
        "--cert-path",
        _SECURITY,
        "directory with tls.crt and tls.key; a self-signed certificate when empty",
        None,
        Path,
        origin=BOTH,
    ),
    _bool_flag(
        "--enable-cert-reload",
        _SECURITY,
        "serve a renewed tls.crt/tls.key from --cert-path to new connections without a restart",
        False,
        origin=BOTH,
    ),
    _flag(
        "--grpc-client-ca-file",
        _SECURITY,
        "require ext_proc clients (the gateway) to present a certificate signed by a CA of "
        "this PEM file (mTLS); read at start-up",
        None,
        Path,
    ),
    _flag(
        "--tls-min-version",
        _SECURITY,
        "lowest TLS version on the ext_proc port; gRPC's TLS always refuses versions below "
        "1.2, and VersionTLS13 cannot be required with it",
        "VersionTLS12",
        _tls_version,
        origin=frozenset({LLM_D}),
    ),
    _flag(
        "--tls-cipher-suites",
        _SECURITY,
        "comma-separated TLS 1.2 cipher suites (Go names, e.g. "
        "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256) for the ext_proc port; TLS 1.3 suites are "
        "fixed by gRPC",
        (),
        _cipher_suites,
        origin=frozenset({LLM_D}),
        shown_default="gRPC's",
    ),
    _bool_flag(
        "--metrics-endpoint-auth",
        _SECURITY,
        "require a bearer token on the metrics port, checked with a Kubernetes TokenReview "
        "and a SubjectAccessReview (get on the path); must be false with --static-endpoints",
        True,
        origin=BOTH,
    ),
    _flag(
        "--metrics-cert-dir",
        _SECURITY,
        "serve the metrics port over HTTPS with tls.crt and tls.key of this directory",
        None,
        Path,
        origin=frozenset({LLM_D}),
    ),
    _flag(
        "--metrics-client-ca-file",
        _SECURITY,
        "with --metrics-cert-dir: require client certificates signed by this CA (mTLS)",
        None,
        Path,
        origin=frozenset({LLM_D}),
    ),
    # compatibility: the reference's deprecated flags
    _flag(
        "--model-server-metrics-scheme",
        _COMPAT,
        "scheme of the model servers' metrics: http or https",
        None,
        _scheme,
        dest="legacy_metrics.scheme",
        origin=frozenset({REFERENCE}),
        status="deprecated",
        note=_LEGACY_SOURCE + " (scheme)",
        shown_default="http",
    ),
    _flag(
        "--model-server-metrics-path",
        _COMPAT,
        "path of the model servers' metrics",
        None,
        _metrics_path,
        dest="legacy_metrics.path",
        origin=frozenset({REFERENCE}),
        status="deprecated",
        note=_LEGACY_SOURCE + " (path)",
        shown_default="/metrics",
    ),
    _flag(
        "--model-server-metrics-port",
        _COMPAT,
        "port of the model servers' metrics (0: each endpoint's own port)",
        None,
        _port,
        dest="legacy_metrics.port",
        origin=frozenset({REFERENCE}),
        status="deprecated",
        note="the metrics-data-source's port parameter in the EndpointPickerConfig",
        shown_default="0",
    ),
    _bool_flag(
        "--model-server-metrics-https-insecure-skip-verify",
        _COMPAT,
        "do not verify the model servers' certificates when the scheme is https",
        None,
        dest="legacy_metrics.insecure_skip_verify",
        origin=frozenset({REFERENCE}),
        status="deprecated",
        note=_LEGACY_SOURCE + " (insecureSkipVerify)",
        shown_default="true",
    ),
    _flag(
        "--total-queued-requests-metric",
        _COMPAT,
        "metric spec of a model server's waiting requests",
        None,
        _metric_spec,
        dest="legacy_metrics.queued_requests_spec",
        origin=BOTH,
        status="deprecated",
        note=_LEGACY_METRIC + " (queuedRequestsSpec)",
        shown_default="the engine's",
        metavar="SPEC",
    ),
    _flag(
        "--total-running-requests-metric",
        _COMPAT,
        "metric spec of a model server's running requests",
        None,
        _metric_spec,
        dest="legacy_metrics.running_requests_spec",
        origin=BOTH,
        status="deprecated",
        note=_LEGACY_METRIC + " (runningRequestsSpec)",
        shown_default="the engine's",
        metavar="SPEC",
    ),
    _flag(
        "--kv-cache-usage-percentage-metric",
        _COMPAT,
        "metric spec of a model server's KV-cache usage (a fraction)",
        None,
        _metric_spec,
        dest="legacy_metrics.kv_usage_spec",
        origin=BOTH,
        status="deprecated",
        note=_LEGACY_METRIC + " (kvUsageSpec)",
        shown_default="the engine's",
        metavar="SPEC",
    ),
    _flag(
        "--lora-info-metric",
        _COMPAT,
        'metric spec of a model server\'s LoRA adapters ("": not read)',
        None,
        _metric_spec,
        dest="legacy_metrics.lora_spec",
        origin=BOTH,
        status="deprecated",
        note=_LEGACY_METRIC + " (loraSpec)",
        shown_default="the engine's",
        metavar="SPEC",
    ),
    _flag(
        "--cache-info-metric",
        _COMPAT,
        'metric spec of a model server\'s cache configuration ("": not read)',
        None,
        _metric_spec,
        dest="legacy_metrics.cache_info_spec",
        origin=BOTH,
        status="deprecated",
        note=_LEGACY_METRIC + " (cacheInfoSpec)",
        shown_default="the engine's",
        metavar="SPEC",
    ),
)


def flags_in(group: str) -> Iterable[Flag]:
    return (f for f in FLAGS if f.group == group)


def startup_notices(settings: Settings) -> list[tuple[int, str]]:
    """What start-up logs once about the compatibility flags given: a warning for each
    deprecated one (what replaces it, what was applied), a line for each ignored one."""
    notices: list[tuple[int, str]] = []
    legacy = settings.legacy_metrics.given()
    for flag in FLAGS:
        field = flag.settings_field
        if flag.status == "deprecated" and field.startswith("legacy_metrics."):
            name = field.partition(".")[2]
            if name in legacy:
                notices.append(
                    (
                        logging.WARNING,
                        f"flag {flag.name} is deprecated: use {flag.note}; applied: "
                        f"{legacy[name]!r}",
                    )
                )
        elif flag.status == "ignored" and getattr(settings, field, False):
            notices.append((logging.INFO, f"flag {flag.name} accepted and ignored: {flag.note}"))
    if settings.feature_gates:
        from app.config.loader import FEATURE_GATES, NOOP_FEATURE_GATES

        gates = (*FEATURE_GATES, *NOOP_FEATURE_GATES)
        known = [f"{n}={str(v).lower()}" for n, v in settings.feature_gates if n in gates]
        unknown = [n for n, _ in settings.feature_gates if n not in gates]
        if known:
            notices.append((logging.INFO, f"flag --feature-gates: applied {', '.join(known)}"))
        if unknown:
            notices.append(
                (
                    logging.INFO,
                    f"flag --feature-gates: accepted and ignored {', '.join(unknown)}: not a "
                    f"feature gate of this EPP (known: {', '.join(gates)})",
                )
            )
    return notices


def log_startup_notices(settings: Settings) -> None:
    """Logs ``startup_notices`` once (the single process or the supervisor, not each worker)."""
    for level, message in startup_notices(settings):
        logger.log(level, "%s", message)


class _Parser(argparse.ArgumentParser):
    """argparse, with every error raised as one line instead of usage and exit."""

    def error(self, message: str) -> NoReturn:
        raise FlagError(_one_line(message))


def _one_line(message: str) -> str:
    """argparse's message in the form ``--flag: why``."""
    if message.startswith("unrecognized arguments: "):
        unknown = message.removeprefix("unrecognized arguments: ").split()
        flags = [a for a in unknown if a.startswith("-")] or unknown
        return f"unknown flag {flags[0].split('=', 1)[0]}"
    if message.startswith("argument "):
        message = message.removeprefix("argument ")
        names, sep, reason = message.partition(": ")
        if sep:
            return f"{names.split('/')[-1]}: {reason}"
    return message


def build_parser() -> argparse.ArgumentParser:
    """The ``epp`` parser, grouped as ``GROUPS``. Flags not given are absent from the
    namespace (``argparse.SUPPRESS``): the caller applies the table's defaults, so it knows
    which flags were given."""
    from importlib.metadata import PackageNotFoundError, version

    parser = _Parser(
        formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=44, width=100),
        prog="epp",
        usage="epp (--pool-name NAME | --endpoint-selector K=V --endpoint-target-ports P | "
        "--static-endpoints IP:PORT,...) [flags]",
        description="Endpoint Picker for LLM inference, serving Envoy ext_proc. "
        "Flag reference: docs/flags.md.",
        allow_abbrev=False,
        argument_default=argparse.SUPPRESS,
    )
    try:
        release = version("epp")
    except PackageNotFoundError:  # a source tree that was never installed
        release = "unknown"
    parser.add_argument("--version", action="version", version=f"epp {release}")
    for group, summary in GROUPS.items():
        section = parser.add_argument_group(group, summary)
        exclusive: dict[str, argparse._MutuallyExclusiveGroup] = {}
        for flag in flags_in(group):
            target: argparse._ActionsContainer = section
            if flag.exclusive:
                if flag.exclusive not in exclusive:
                    exclusive[flag.exclusive] = section.add_mutually_exclusive_group()
                target = exclusive[flag.exclusive]
            _add(target, flag)
    return parser


_METAVARS: dict[object, str] = {
    _duration: "DURATION",
    _port: "PORT",
    _bytes: "SIZE",
    _count: "N",
    _verbosity: "N",
    Path: "PATH",
    _metric_spec: "SPEC",
}


def _add(target: argparse._ActionsContainer, flag: Flag) -> None:
    help_text = f"{flag.help} (default {flag.default_text()})"
    if flag.status == "deprecated":
        help_text += f"; deprecated: use {flag.note}"
    elif flag.status == "ignored":
        help_text += f"; accepted and ignored: {flag.note}"
    if flag.parse is None:
        target.add_argument(
            *flag.names,
            dest=flag.settings_field,
            type=_bool,
            nargs="?",
            const=True,
            metavar="BOOL",
            help=help_text,
        )
        return
    target.add_argument(
        *flag.names,
        dest=flag.settings_field,
        type=flag.parse,
        choices=flag.choices or None,
        metavar=flag.metavar or _METAVARS.get(flag.parse, None if flag.choices else "VALUE"),
        help=help_text,
    )


def defaults() -> dict[str, object]:
    """Each flag's default, parsed as if given, by settings field (the first flag of a
    field gives its default)."""
    values: dict[str, object] = {}
    for flag in FLAGS:
        if flag.settings_field in values:
            continue
        value = flag.default
        if isinstance(value, str) and flag.parse is not None and flag.parse is not str:
            value = flag.parse(value)
        values[flag.settings_field] = value
    return values


def compatibility_counts() -> dict[str, dict[str, int]]:
    """Per project (reference, llm-d): how many of its flags are supported here, deprecated
    (accepted, applied, warned) and accepted-and-ignored. None is refused."""
    counts = {
        origin: dict.fromkeys(("supported", "deprecated", "ignored"), 0)
        for origin in (REFERENCE, LLM_D)
    }
    for flag in FLAGS:
        for origin in flag.origin:
            counts[origin][flag.status] += 1
    return counts


def render_markdown() -> str:
    """The flag reference, ``docs/flags.md``."""
    counts = compatibility_counts()
    lines = [
        "# Flags",
        "",
        "Generated from the flag table in `app/flags.py` by `python -m app.flags`; a test keeps",
        "this file equal to it. *Also in*: the reference Endpoint Picker (GIE) and the llm-d",
        "router accept the flag too. A boolean takes `--flag`, `--flag=true` or",
        "`--flag=false`. A bad value stops start-up with one line naming the flag and the value.",
        "",
        "| flags of | supported | deprecated: accepted, applied, warned | accepted and ignored | "
        "refused |",
        "| --- | --- | --- | --- | --- |",
        *(
            f"| {origin} | {c['supported']} | {c['deprecated']} | {c['ignored']} | 0 |"
            for origin, c in counts.items()
        ),
        "",
    ]
    for group, summary in GROUPS.items():
        lines += [f"## {group.capitalize()}", "", f"{summary.capitalize()}.", ""]
        lines += ["| flag | default | meaning | also in |", "| --- | --- | --- | --- |"]
        for flag in flags_in(group):
            names = ", ".join(f"`{n}`" for n in flag.names)
            meaning = flag.help
            if flag.status == "deprecated":
                meaning += f". **Deprecated**: use {flag.note}; applied, with a warning"
            elif flag.status == "ignored":
                meaning += f". **Accepted and ignored**: {flag.note}"
            also = ", ".join(o for o in (REFERENCE, LLM_D) if o in flag.origin) or "-"
            default = flag.default_text().replace("|", "\\|")
            meaning = meaning.replace("|", "\\|")
            lines.append(f"| {names} | `{default}` | {meaning} | {also} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render_markdown())
