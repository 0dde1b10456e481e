"""Real ``redis-server`` processes for tests: a single server, a 3-master cluster, TLS, ACL.

Every server runs on a free loopback port in its own temporary directory with persistence
off (``--save ''``, no AOF). Readiness is waited for with PING (or ``cluster info``) under a
deadline, never with a fixed sleep. The binaries come from Debian's ``redis-server`` and
``redis-tools`` packages (``make install`` installs them when missing).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization

from tests.support.certs import CertificateAuthority
from tests.support.ports import free_port

__all__ = [
    "ACL_PASSWORD",
    "ACL_USER",
    "RedisCluster",
    "RedisServer",
    "TlsFiles",
    "make_tls_files",
    "redis_available",
]

#: The user ``RedisServer.add_acl_user`` creates: keys ``epp:*`` only, the adapters' commands.
ACL_USER = "epp"
ACL_PASSWORD = "epp-secret"
#: Every command the Redis adapters send on a single server, the scripts' own included.
ACL_COMMANDS = (
    "+ping +evalsha +eval +hdel +zrange +del +zrem "  # sent by the client
    # sent by the scripts
    "+hgetall +hget +hmget +hset +hlen +pexpire +zadd +zcard +zpopmin +zremrangebyscore +time"
    " +hkeys +sadd +srem +scard +smembers +hincrby +zrangebyscore"
)
#: What the cluster client sends besides: the slot map, ``ASKING`` while a slot moves, and
#: ``COMMAND`` (the command table it routes by, read when it starts).
ACL_CLUSTER_COMMANDS = "+cluster|slots +asking +command"


def redis_available() -> bool:
    return shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None


#: a cluster node's bus listens on its port plus this
CLUSTER_BUS_OFFSET = 10000


def _free_port() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    return free_port(offsets=(0, CLUSTER_BUS_OFFSET))


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsFiles:
    """A CA and a server certificate for 127.0.0.1/localhost, as PEM files."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


def make_tls_files(directory: Path) -> TlsFiles:
    """Write a fresh CA and a server certificate signed by it into ``directory``."""
    ca = CertificateAuthority("epp test CA")
    server_cert, server_key = ca.issue(
        "localhost",
        directory / "server.pem",
        directory / "server.key",
        localhost=True,
        key_format=serialization.PrivateFormat.TraditionalOpenSSL,
    )
    return TlsFiles(
        ca_cert=ca.write(directory / "ca.pem"), server_cert=server_cert, server_key=server_key
    )


class RedisServer:
    """One ``redis-server`` on 127.0.0.1, started by ``start()`` and stopped by ``stop()``.

    ``kill()`` then ``start()`` restarts it empty on the same port (fault tests). With
    ``tls`` it listens on TLS only (``--port 0 --tls-port <port>``); with ``cluster`` it is
    a cluster-enabled node.
    """

    def __init__(
        self,
        *,
        tls: TlsFiles | None = None,
        cluster: bool = False,
        port: int | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.port = port if port is not None else _free_port()
        self.tls = tls
        self.cluster = cluster
        self._extra = list(extra_args)
        self._dir = Path(tempfile.mkdtemp(prefix=f"redis-{self.port}-"))
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://{self.address}"

    def start(self, *, timeout: float = 10.0) -> None:
        args = [
            "redis-server",
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self._dir),
            "--protected-mode",
            "no",
            "--loglevel",
            "warning",
            "--logfile",
            str(self._dir / "redis.log"),
        ]
        if self.tls:
            args += [
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                str(self.tls.server_cert),
                "--tls-key-file",
                str(self.tls.server_key),
                "--tls-ca-cert-file",
                str(self.tls.ca_cert),
                "--tls-auth-clients",
                "no",
            ]
        else:
            args += ["--port", str(self.port)]
        if self.cluster:
            args += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(self._dir / "nodes.conf"),
                "--cluster-node-timeout",
                "2000",
            ]
            (self._dir / "nodes.conf").unlink(missing_ok=True)
        self._process = subprocess.Popen(
            [*args, *self._extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout
        while True:
            if self._process.poll() is not None:
                log = self._dir / "redis.log"
                detail = log.read_text() if log.exists() else ""
                raise RuntimeError(f"redis-server on {self.port} exited at start: {detail}")
            if self.cli("PING", check=False).strip() == "PONG":
                return
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"redis-server on {self.port} not ready in {timeout:.0f}s")
            time.sleep(0.02)

    def cli(self, *command: str, check: bool = True) -> str:
        """Run one command with ``redis-cli`` (as the default user); returns its output."""
        args = ["redis-cli", "-h", "127.0.0.1", "-p", str(self.port)]
        if self.tls:
            args += ["--tls", "--cacert", str(self.tls.ca_cert)]
        done = subprocess.run(
            [*args, *command], capture_output=True, timeout=10, check=False, text=True
        )
        if check and (done.returncode != 0 or done.stdout.startswith("ERR")):
            raise RuntimeError(f"redis-cli {' '.join(command)}: {done.stdout}{done.stderr}")
        return done.stdout

    def add_acl_user(
        self, user: str = ACL_USER, password: str = ACL_PASSWORD, commands: str = ACL_COMMANDS
    ) -> None:
        """A user limited to the keys ``epp:*`` and ``commands`` (the adapters')."""
        self.cli("ACL", "SETUSER", user, "reset", "on", f">{password}", "~epp:*", "-@all")
        for command in commands.split():
            self.cli("ACL", "SETUSER", user, command)

    def freeze(self) -> None:
        """SIGSTOP: the server keeps its connections and answers nothing until ``thaw``."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT after ``freeze``: the server answers what it was sent meanwhile."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: the server dies at once, losing everything (nothing is persisted)."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait(timeout=10)
        self._process = None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=10)
        self._process = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


class RedisCluster:
    """Cluster-enabled masters (3 by default), each with ``replicas`` replicas (none by
    default), joined by ``redis-cli --cluster create``. ``nodes`` lists the masters first
    (as created; a failover may change which node is a master), then the replicas."""

    def __init__(self, masters: int = 3, *, replicas: int = 0) -> None:
        self.nodes = [RedisServer(cluster=True) for _ in range(masters * (1 + replicas))]
        self._masters = masters
        self._replicas = replicas

    @property
    def url(self) -> str:
        """The masters' addresses (the client learns the replicas from them)."""
        return "redis+cluster://" + ",".join(n.address for n in self.nodes[: self._masters])

    def start(self, *, timeout: float = 20.0) -> None:
        """Starts the nodes and joins them; on a failure, the nodes started are stopped."""
        try:
            self._start(timeout)
        except BaseException:
            self.close()
            raise

    def _start(self, timeout: float) -> None:
        for node in self.nodes:
            node.start()
        done = subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(node.address for node in self.nodes),
                "--cluster-replicas",
                str(self._replicas),
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")
        deadline = time.monotonic() + timeout
        while not all(
            "cluster_state:ok" in node.cli("CLUSTER", "INFO", check=False) for node in self.nodes
        ) or not all(
            "master_link_status:up" in node.cli("INFO", "replication", check=False)
            for node in self.nodes[self._masters :]
        ):
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not ok within {timeout:.0f}s")
            time.sleep(0.05)

    def role(self, node: RedisServer) -> str:
        """``master`` or ``slave``, as the node says (empty when it does not answer)."""
        for line in node.cli("INFO", "replication", check=False).splitlines():
            if line.startswith("role:"):
                return line.partition(":")[2].strip()
        return ""

    def node_of_slot(self, slot: int) -> int:
        """The index in ``nodes`` of the master serving ``slot``."""
        for i, node in enumerate(self.nodes):
            if node.cli("CLUSTER", "COUNTKEYSINSLOT", str(slot), check=False).strip().isdigit():
                for line in node.cli("CLUSTER", "NODES").splitlines():
                    fields = line.split()
                    if "myself" in fields[2]:
                        for spec in fields[8:]:
                            lo, _, hi = spec.partition("-")
                            if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                                return i
        raise LookupError(f"no node serves slot {slot}")

    def close(self) -> None:
        for node in self.nodes:
            node.close()
