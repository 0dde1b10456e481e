"""Redis clients from a URL: a single server or a cluster, plain or TLS.

URL forms (``--redis-url``):

- ``redis://[user[:password]@]host[:port][/db]``: one server (port 6379, db 0 by default);
- ``rediss://...``: the same over TLS;
- ``redis+cluster://[user[:password]@]host[:port][,host[:port]...]``: a Redis Cluster; the
  hosts are seed nodes, the client discovers the others (``CLUSTER SLOTS``); no ``/db``;
- ``rediss+cluster://...``: a cluster over TLS.

Query parameters (TLS only): ``ssl_ca_certs=<path of a PEM CA bundle>`` (default: the system's
CAs), ``ssl_cert_reqs=required|optional|none`` (default ``required``),
``ssl_check_hostname=true|false`` (default ``true``). User and password are percent-decoded.

The routing path does not rely on these timeouts: the domain wraps each match in its own
few-millisecond deadline (``--redis-deadline``) and cancels the call there. They bound what
runs in the background (writes, the load's sync, the recovery probe): one second, so that a
busy machine, or a reconnect after an outage, is not taken for a store that is down (with
100 ms, one slow reply under load degraded the shared state and logged, and the probe could
not heal it). redis-py's own retries are off: a failed call fails at once, the caller
degrades, and the next call tries again on a new connection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from adapters.redis.pipelined import ScriptChannel, TlsOptions

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_SOCKET_TIMEOUT",
    "PipelinedRedis",
    "RedisClient",
    "RedisUrl",
    "connect",
    "parse_redis_url",
]

#: Seconds to open a TCP (and TLS) connection.
DEFAULT_CONNECT_TIMEOUT = 1.0
#: Seconds to wait for a reply on an open connection.
DEFAULT_SOCKET_TIMEOUT = 1.0

RedisClient = Redis | RedisCluster

_SCHEMES = {
    "redis": (False, False),
    "rediss": (True, False),
    "redis+cluster": (False, True),
    "rediss+cluster": (True, True),
}
_CERT_REQS = ("required", "optional", "none")
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


@dataclass(frozen=True, slots=True, kw_only=True)
class RedisUrl:
    """A parsed Redis URL (the password is kept out of ``repr``)."""

    tls: bool
    cluster: bool
    nodes: tuple[tuple[str, int], ...]
    db: int = 0
    username: str | None = None
    password: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: str = "required"
    ssl_check_hostname: bool = True

    def __repr__(self) -> str:
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        hosts = ",".join(f"{h}:{p}" for h, p in self.nodes)
        return f"RedisUrl({scheme}://{hosts}/{self.db})"


def _host_port(text: str, url: str) -> tuple[str, int]:
    if not text:
        raise ValueError(f"redis URL {url!r}: missing host")
    if text.startswith("["):  # [ipv6]:port
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
        if rest and not rest.startswith(":"):
            raise ValueError(f"redis URL {url!r}: bad host {text!r}")
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ValueError(f"redis URL {url!r}: missing host in {text!r}")
    if not port_text:
        return host, 6379
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"redis URL {url!r}: bad port {port_text!r}")
    return host, int(port_text)


def parse_redis_url(url: str) -> RedisUrl:
    """Parse ``url``; a ``ValueError`` names what is wrong (scheme, host, port, db, query)."""
    shown = _redact(url)
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"redis URL {shown!r}: expected <scheme>://host:port")
    if scheme.lower() not in _SCHEMES:
        raise ValueError(
            f"redis URL {shown!r}: unknown scheme {scheme!r} "
            f"(expected one of {', '.join(sorted(_SCHEMES))})"
        )
    tls, cluster = _SCHEMES[scheme.lower()]
    # urlsplit cannot take several hosts: split the authority ourselves.
    try:
        parts = urlsplit("x://" + rest)
    except ValueError as error:
        raise ValueError(f"redis URL {shown!r}: {error}") from None
    authority = parts.netloc
    userinfo, at, hosts = authority.rpartition("@")
    username: str | None = None
    password: str | None = None
    if at:
        user_text, colon, password_text = userinfo.partition(":")
        username = unquote(user_text) or None
        password = unquote(password_text) if colon else None
    host_texts = hosts.split(",")
    if not cluster and len(host_texts) > 1:
        raise ValueError(f"redis URL {shown!r}: several hosts need a +cluster scheme")
    nodes = tuple(_host_port(text, shown) for text in host_texts)
    path = parts.path.strip("/")
    db = 0
    if path:
        if cluster:
            raise ValueError(f"redis URL {shown!r}: a cluster has no database number")
        if not path.isdigit():
            raise ValueError(f"redis URL {shown!r}: bad database number {path!r}")
        db = int(path)
    options: dict[str, Any] = {}
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key not in ("ssl_ca_certs", "ssl_cert_reqs", "ssl_check_hostname"):
            raise ValueError(f"redis URL {shown!r}: unknown query parameter {key!r}")
        if not tls:
            raise ValueError(f"redis URL {shown!r}: {key} needs a rediss scheme")
        if key == "ssl_cert_reqs":
            if value not in _CERT_REQS:
                raise ValueError(
                    f"redis URL {shown!r}: ssl_cert_reqs={value!r} "
                    f"(expected one of {', '.join(_CERT_REQS)})"
                )
            options[key] = value
        elif key == "ssl_check_hostname":
            if value.lower() not in _BOOLS:
                raise ValueError(f"redis URL {shown!r}: ssl_check_hostname={value!r}")
            options[key] = _BOOLS[value.lower()]
        else:
            if not value:
                raise ValueError(f"redis URL {shown!r}: empty ssl_ca_certs")
            options[key] = value
    return RedisUrl(
        tls=tls,
        cluster=cluster,
        nodes=nodes,
        db=db,
        username=username,
        password=password,
        **options,
    )


def connect(
    url: str,
    *,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    socket_timeout: float = DEFAULT_SOCKET_TIMEOUT,
    max_connections: int = 64,
) -> RedisClient:
    """A client for ``url`` (see the module docstring). Connects lazily, on the first call."""
    parsed = parse_redis_url(url)
    common: dict[str, Any] = {
        "username": parsed.username,
        "password": parsed.password,
        "socket_connect_timeout": connect_timeout,
        "socket_timeout": socket_timeout,
        "retry": Retry(NoBackoff(), 0),
        "max_connections": max_connections,
    }
    if parsed.tls:
        common |= {
            "ssl": True,
            "ssl_ca_certs": parsed.ssl_ca_certs,
            "ssl_cert_reqs": parsed.ssl_cert_reqs,
            "ssl_check_hostname": parsed.ssl_check_hostname and parsed.ssl_cert_reqs != "none",
        }
    if parsed.cluster:
        _send_asking_on_the_redirected_connection()
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in parsed.nodes],
            require_full_coverage=False,
            **common,
        )
    host, port = parsed.nodes[0]
    channel = ScriptChannel(
        host,
        port,
        db=parsed.db,
        username=parsed.username,
        password=parsed.password,
        tls=TlsOptions(
            ca_certs=parsed.ssl_ca_certs,
            cert_reqs=parsed.ssl_cert_reqs,
            check_hostname=parsed.ssl_check_hostname,
        )
        if parsed.tls
        else None,
        connect_timeout=connect_timeout,
        socket_timeout=socket_timeout,
    )
    return PipelinedRedis(channel, host=host, port=port, db=parsed.db, **common)


class PipelinedRedis(Redis):
    """redis-py's client for one server, whose Lua scripts (``LuaScript.run``, the routing
    path's calls) go on one pipelined connection, ``script_channel``, instead of the pool."""

    def __init__(self, script_channel: ScriptChannel, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.script_channel = script_channel

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await self.script_channel.aclose()
        await super().aclose(close_connection_pool)


def _send_asking_on_the_redirected_connection() -> None:
    """Make redis-py's asyncio cluster client follow ``ASK`` redirections.

    On ``ASK`` (a key already migrated while its slot moves) the client sends ``ASKING`` and
    then the command as two calls on the target node, each taking a connection from the
    node's free list (oldest first) and putting it back at the end. With two or more idle
    connections the command goes out on another connection than ``ASKING``, the node
    answers ``MOVED`` back to the old node, which answers ``ASK`` again, until the client
    gives up ("TTL exhausted"): every call on a migrating slot failed. Here a released
    connection is put back first in line (last in, first out), so the command takes the
    connection ``ASKING`` was just sent on (nothing else runs in between: neither call
    yields to the event loop between the release and the next acquire). Applied once; a
    redis-py without that free list is left as it is.
    """
    release = getattr(ClusterNode, "release", None)
    if release is None or getattr(release, "_lifo", False):
        return

    def lifo_release(self: ClusterNode, connection: Connection) -> None:
        release(self, connection)
        free = getattr(self, "_free", None)
        if free and free[-1] is connection:
            free.rotate(1)  # to the front: the next acquire (popleft) takes it

    lifo_release._lifo = True  # type: ignore[attr-defined]
    ClusterNode.release = lifo_release  # type: ignore[method-assign]


def _redact(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for error messages)."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, tail = rest.partition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.partition(':')[0]}:***@{tail}"
