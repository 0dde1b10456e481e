"""The supervisor of a pod's workers (``--workers N``, N > 1).

It is the pod's one face and its one data layer; the workers serve the requests:

- **Workers.** N processes (``python -m app`` with the same flags and ``EPP_WORKER`` set),
  each a full EPP. The supervisor holds the ext_proc port from start to end (which also
  resolves ``--grpc-port 0``), so it stays the pod's while workers restart. With the native
  transport it listens, and hands each connection to a ready worker
  (``ConnectionDispatcher``): the one with the fewest connections still taking streams,
  then the one that started the fewest calls lately, as each worker reports. With
  ``--extproc-transport=grpcio`` (grpc.aio cannot serve a socket handed to it) the port is
  a bound, non-listening ``SO_REUSEPORT`` socket, and the workers accept beside it: the
  kernel picks a worker per connection by a hash. With TLS and no ``--cert-path``, the
  supervisor makes one self-signed certificate and gives every worker its directory.
- **Restarts.** A worker that exits is started again after a backoff: 0.5 s, doubling per
  exit in a row up to 30 s, back to 0.5 s once a worker lived 30 s; each exit is logged with
  its code and the delay. A worker that fails before any worker of the pod was ever ready
  ends the supervisor with its exit code (a port in use, a bad flag: restarting cannot help).
- **Health.** One gRPC health port: SERVING while at least one worker reports ready and the
  supervisor is not draining; ``liveness`` stays SERVING while draining. With
  ``--ha-enable-leader-election`` the supervisor campaigns for the pool's Lease (its workers
  do not) and the pod is ready only while it holds it, as one process would be; on SIGTERM
  it releases the Lease before the workers drain, so a standby pod takes over meanwhile.
- **Metrics.** One ``/metrics``: the supervisor's own registry (scrape errors: it is the one
  that polls) merged with every connected worker's (``adapters.prometheus.merge``);
  ``/workers`` lists the workers as JSON (id, pid, ready, metrics port, restarts, and the
  connections handed to each: taken, still taking streams, calls started).
- **Data layer.** Endpoint discovery, the model servers' ``/metrics`` polls and notification
  watches run here once for the pod and are relayed to the workers (``SupervisorHub``).
- **Shutdown.** SIGTERM or SIGINT: readiness turns NOT_SERVING, every worker gets SIGTERM
  and drains within ``--shutdown-grace-period``; one still running 5 s after that is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from adapters.envoy.health import HealthServer, HealthServicer
from adapters.envoy.tls import self_signed_certificate
from adapters.prometheus.exporter import MetricsServer, TextPage
from adapters.prometheus.merge import merge_expositions
from adapters.workerlink import ConnectionDispatcher, SupervisorHub
from app.config.loader import ConfigError
from app.container import build_supervisor_container
from app.lifecycle import Lifecycle, Service, StartupError, run_process, step, task
from app.observability import metrics_ssl_context
from app.plugins import PluginLoadError
from app.profiling import pprof_pages
from app.runner import LEADER_ELECTION
from app.settings import Settings
from app.workers.role import WORKER_VARIABLE, WorkerRole

if TYPE_CHECKING:  # the kubernetes client is imported only when a Lease is used
    from adapters.kubernetes.leader import LeaderElector

__all__ = ["BACKOFF_MAX", "BACKOFF_START", "STABLE_AFTER", "run_supervisor"]

logger = logging.getLogger(__name__)

BACKOFF_START = 0.5
BACKOFF_MAX = 30.0
#: A worker that lived this long resets its slot's backoff.
STABLE_AFTER = 30.0
DISPATCH = "dispatch"
#: How long a worker may take past the grace period before it is killed.
KILL_AFTER_GRACE = 5.0
#: A worker's /metrics must answer within this, else the merge leaves it out.
WORKER_SCRAPE_TIMEOUT = 2.0


def _reserve_port(host: str, port: int, *, listen: bool) -> socket.socket:
    """The ext_proc port (raises ``OSError`` naming ``--grpc-port``): listening, for the
    supervisor to accept on (``listen``), or a bound, non-listening ``SO_REUSEPORT`` socket
    that the workers' listeners join."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if listen:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        else:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host.strip("[]"), port))
        if listen:
            sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise OSError(f"--grpc-port: cannot listen on {host}:{port}: {exc}") from exc
    return sock


def _write_self_signed(workdir: str) -> str:
    """A fresh self-signed certificate as ``tls.crt`` and ``tls.key`` in a new directory of
    ``workdir`` (readable by this user only); returns the directory."""
    directory = os.path.join(workdir, "certificate")
    os.mkdir(directory, 0o700)
    certificate = self_signed_certificate()
    for name, pem in (
        ("tls.crt", certificate.certificate_pem),
        ("tls.key", certificate.private_key_pem),
    ):
        descriptor = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT, 0o600)
        with os.fdopen(descriptor, "wb") as file:
            file.write(pem)
    return directory


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


#: The longest profile a worker samples (``profile?seconds=60``) plus room to answer.
PPROF_TIMEOUT = 75.0


@dataclass(slots=True)
class _Slot:
    worker_id: int
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    exits_in_a_row: int = 0


class Supervisor:
    def __init__(self, settings: Settings, argv: Sequence[str]) -> None:
        self.settings = settings
        self.argv = list(argv)
        self.workdir = tempfile.mkdtemp(prefix="epp-workers-")  # mode 0700
        if settings.secure_serving and settings.cert_path is None:
            # One self-signed certificate for the pod, not one per worker: a client that
            # pins the certificate it saw works whichever worker serves it next.
            self.argv += ["--cert-path", _write_self_signed(self.workdir)]
        self.hub = SupervisorHub(os.path.join(self.workdir, "link.sock"))
        self.container = build_supervisor_container(settings, self.hub)
        # the pod's Lease (--ha-enable-leader-election), held here, not by the workers;
        # made in run(), where a Kubernetes configuration that does not work is reported
        self.elector: LeaderElector | None = None
        self.health = HealthServicer(
            lambda: self.hub.ready_workers() > 0,
            self._leads if settings.ha_enable_leader_election else None,
        )
        self.slots = [_Slot(i) for i in range(settings.workers)]
        self.stop = asyncio.Event()
        self.draining = False
        self.fatal: int | None = None
        self.ever_ready = False
        self.grpc_port = 0
        self.dispatcher: ConnectionDispatcher | None = None
        self._port: socket.socket | None = None
        self._session: aiohttp.ClientSession | None = None

    # --- the pod's face ---

    def _leads(self) -> bool:
        return self.elector is not None and self.elector.leader()

    async def _worker_metrics(self, port: int) -> bytes | None:
        assert self._session is not None
        try:
            async with self._session.get(f"http://127.0.0.1:{port}/metrics") as response:
                if response.status != 200:
                    return None
                return await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.debug("worker metrics on port %d: %r", port, exc)
            return None

    async def _merged_metrics(self) -> bytes:
        """The pod's ``/metrics``: the supervisor's own and every connected worker's."""
        ports = [w.metrics_port for w in self.hub.workers() if w.metrics_port]
        texts = await asyncio.gather(*(self._worker_metrics(port) for port in ports))
        own = self.container.metrics_observer().exposition()
        merged: bytes = await asyncio.to_thread(
            merge_expositions, [own, *(t for t in texts if t is not None)]
        )
        return merged

    def _pprof(self, path: str) -> TextPage:
        """The pprof page ``path`` of one worker (``?worker=<id>``, by default the first
        connected), fetched from its loopback port: profiling is per process."""

        async def page(query: Mapping[str, str]) -> tuple[int, str]:
            workers = [w for w in self.hub.workers() if w.metrics_port]
            wanted = query.get("worker")
            chosen = next(
                (w for w in workers if wanted is None or str(w.worker_id) == wanted), None
            )
            if chosen is None:
                known = ", ".join(str(w.worker_id) for w in workers) or "none connected"
                return 404, f"no worker {wanted!r} (workers: {known})\n"
            params = {k: v for k, v in query.items() if k != "worker"}
            assert self._session is not None
            try:
                async with self._session.get(
                    f"http://127.0.0.1:{chosen.metrics_port}{path}",
                    params=params,
                    timeout=aiohttp.ClientTimeout(total=PPROF_TIMEOUT),
                ) as response:
                    text = await response.text()
                    status = response.status
            except (aiohttp.ClientError, TimeoutError) as exc:
                return 502, f"worker {chosen.worker_id}: {exc!r}\n"
            return status, f"# worker {chosen.worker_id}\n{text}"

        return page

    def _metrics_server(self) -> MetricsServer:
        # The pod's face: the same bearer-token check (--metrics-endpoint-auth), HTTPS and
        # client certificates (--metrics-cert-dir) as one process's.
        pages: dict[str, TextPage] = {"/workers": self._workers}
        if self.settings.enable_pprof:
            pages.update({path: self._pprof(path) for path in pprof_pages()})
        return MetricsServer(
            self._merged_metrics,
            host=self.settings.bind_address,
            port=self.settings.metrics_port,
            authorizer=self.container.metrics_authorizer(),
            pages=pages,
            content_types={"/workers": "application/json"},
            ssl_context=metrics_ssl_context(self.settings),
        )

    async def _workers(self, query: Mapping[str, str]) -> tuple[int, str]:
        connected = {w.worker_id: w for w in self.hub.workers()}
        listing = []
        for slot in self.slots:
            status = connected.get(slot.worker_id)
            process = slot.process
            listing.append(
                {
                    "worker": slot.worker_id,
                    "pid": process.pid if process and process.returncode is None else None,
                    "ready": bool(status and status.ready),
                    "metrics_port": status.metrics_port if status else 0,
                    "restarts": slot.restarts,
                    # handed connections (native transport), as the worker last reported
                    "connections_taken": status.connections.received if status else 0,
                    "connections_accepting": status.connections.accepting if status else 0,
                    "calls_started": status.connections.calls if status else 0,
                }
            )
        return 200, orjson.dumps(listing).decode()

    # --- workers ---

    async def _spawn(self, slot: _Slot) -> asyncio.subprocess.Process:
        handoff = self.dispatcher.attach(slot.worker_id) if self.dispatcher else None
        role = WorkerRole(
            worker_id=slot.worker_id,
            supervisor_pid=os.getpid(),
            grpc_port=self.grpc_port,
            socket_path=self.hub.path,
            handoff_fd=handoff.fileno() if handoff else -1,
        )
        try:
            return await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "app",
                *self.argv,
                env={**os.environ, WORKER_VARIABLE: role.encode()},
                stdin=asyncio.subprocess.DEVNULL,
                pass_fds=(handoff.fileno(),) if handoff else (),
            )
        finally:
            if handoff is not None:
                handoff.close()  # the worker's copy is the one that counts

    async def _keep(self, slot: _Slot) -> None:
        while not self.draining:
            process = await self._spawn(slot)
            slot.process = process
            started = time.monotonic()
            logger.info("worker %d started (pid %d)", slot.worker_id, process.pid)
            code = await process.wait()
            self.hub.disconnect(slot.worker_id)
            if self.dispatcher is not None:
                self.dispatcher.detach(slot.worker_id)
            if self.draining:
                logger.info(
                    "worker %d (pid %d) ended: %s",
                    slot.worker_id,
                    process.pid,
                    _describe_exit(code),
                )
                return
            lived = time.monotonic() - started
            if not self.ever_ready and code > 0:
                logger.error(
                    "worker %d (pid %d) failed to start (%s); stopping the pod",
                    slot.worker_id,
                    process.pid,
                    _describe_exit(code),
                )
                self.fatal = code
                self.stop.set()
                return
            slot.exits_in_a_row = 1 if lived >= STABLE_AFTER else slot.exits_in_a_row + 1
            delay = min(BACKOFF_MAX, BACKOFF_START * 2.0 ** (slot.exits_in_a_row - 1))
            logger.warning(
                "worker %d (pid %d) exited (%s) after %.1fs; restarting in %.1fs "
                "(%d exit(s) in a row; %d of %d workers ready)",
                slot.worker_id,
                process.pid,
                _describe_exit(code),
                lived,
                delay,
                slot.exits_in_a_row,
                self.hub.ready_workers(),
                len(self.slots),
            )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self.stop.wait()
            slot.restarts += 1

    async def _watch_readiness(self) -> None:
        previous = -1
        while True:
            ready = self.hub.ready_workers()
            if ready:
                self.ever_ready = True
            if ready != previous:
                logger.info("%d of %d workers ready", ready, len(self.slots))
                previous = ready
            await asyncio.sleep(0.1)

    async def _drain_workers(self) -> None:
        self.draining = True
        self.health.start_draining()
        if self.dispatcher is not None and self._port is not None:
            self._port.close()  # new connections are refused from here on (dispatch stopped)
        grace = self.settings.shutdown_grace_period
        logger.info("stopping: draining %d workers for up to %.1fs", len(self.slots), grace)
        running = [s.process for s in self.slots if s.process and s.process.returncode is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        waits = [asyncio.create_task(p.wait()) for p in running]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=grace + KILL_AFTER_GRACE)
            for process in running:
                if process.returncode is None:
                    logger.warning("worker pid %d did not stop in time: killed", process.pid)
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
            if pending:
                await asyncio.wait(pending, timeout=5)

    async def run(self) -> int:
        """The pod until ``stop``: its services started in order, the Lease released, the
        workers drained, the services stopped in reverse."""
        try:
            self.container.config()
        except (ConfigError, PluginLoadError) as exc:
            raise StartupError(f"invalid configuration: {exc}") from exc
        native = self.settings.extproc_transport == "native"
        try:
            reserved = _reserve_port(
                self.settings.bind_address, self.settings.grpc_port, listen=native
            )
        except OSError as exc:
            raise StartupError(str(exc)) from exc
        self.grpc_port = reserved.getsockname()[1]
        self._port = reserved
        if native:
            self.dispatcher = ConnectionDispatcher(
                reserved, self.hub.is_ready, self.hub.connections
            )
        try:
            lifecycle = Lifecycle(self._services())
            try:
                await lifecycle.start()
            except OSError as exc:
                raise StartupError(str(exc)) from exc
            try:
                await lifecycle.wait(self.stop)
            except Exception as exc:
                logger.error("stopped: %r", exc)
                self.fatal = 1
            # the Lease first, so a standby pod takes over meanwhile
            await lifecycle.stop_one(LEADER_ELECTION)
            if self.settings.drain_timeout:  # new connections still go to the workers
                self.health.start_draining()
                logger.info("stopping: serving new streams for %.1fs", self.settings.drain_timeout)
                await asyncio.sleep(self.settings.drain_timeout)
            await lifecycle.stop_one(DISPATCH)
            await self._drain_workers()
            await lifecycle.stop()
        finally:
            reserved.close()
            shutil.rmtree(self.workdir, ignore_errors=True)
        logger.info("stopped")
        return self.fatal or 0

    def _services(self) -> list[Service]:
        """The pod's services in start order; they stop in the reverse order."""
        try:
            source = self.container.endpoint_source()
        except Exception as exc:  # e.g. no usable Kubernetes configuration
            raise StartupError(f"cannot start endpoint discovery: {exc}") from exc
        try:
            self.elector = self.container.leader_elector()
        except Exception as exc:
            raise StartupError(f"cannot start leader election: {exc}") from exc
        metrics = self._metrics_server()
        health = HealthServer(
            self.health, host=self.settings.bind_address, port=self.settings.grpc_health_port
        )
        collectors = self.container.collectors()

        async def open_session() -> None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=WORKER_SCRAPE_TIMEOUT)
            )

        async def close_session() -> None:
            if self._session is not None:
                await self._session.close()

        async def start_collectors() -> None:
            self._log_serving(health.port)
            collectors.start()

        services: list[Service] = [
            step("metrics-server", metrics.start, metrics.stop),
            step("health-server", health.start, health.stop),
            step("worker-scrapes", open_session, close_session),
            step("hub", self.hub.start, self.hub.stop),
            step("collectors", start_collectors, collectors.stop),
            task("endpoint-source", lambda: source.run(self.hub.sink(self.container.datastore()))),
            task("readiness", self._watch_readiness),
        ]
        if self.dispatcher is not None:
            services.append(task(DISPATCH, self.dispatcher.run))
        if self.elector is not None:
            services.append(task(LEADER_ELECTION, self.elector.run))
        services += [task(f"worker-{slot.worker_id}", self._keeper(slot)) for slot in self.slots]
        return services

    def _keeper(self, slot: _Slot) -> Callable[[], Coroutine[Any, Any, None]]:
        return lambda: self._keep(slot)

    def _log_serving(self, health_port: int) -> None:
        logger.info(
            "ext_proc serving on %s:%d (%s), health on %s:%d; %d workers",
            self.settings.bind_address,
            self.grpc_port,
            (
                "plaintext"
                if not self.settings.secure_serving
                else "TLS, client certificates required"
                if self.settings.grpc_client_ca_file
                else "TLS"
            ),
            self.settings.bind_address,
            health_port,
            len(self.slots),
        )


def run_supervisor(settings: Settings, argv: Sequence[str]) -> int:
    """The supervisor process (``--workers`` > 1), until SIGTERM or SIGINT; ``argv`` are the
    flags it was started with, given to every worker."""

    async def main(stop: asyncio.Event) -> int:
        supervisor = Supervisor(settings, argv)
        supervisor.stop = stop
        return await supervisor.run()

    return run_process(settings, main, worker="supervisor")
