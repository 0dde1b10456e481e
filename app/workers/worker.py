"""One worker of a pod (``--workers`` > 1): a full EPP on the shared ext_proc port.

It differs from a lone EPP in four ways: its endpoints, objectives, model-server metrics
and watched objects come from the supervisor (``WorkerLink``) instead of its own discovery,
polls and watches; it serves the ext_proc connections the supervisor accepts and hands
over (with ``--extproc-transport=grpcio``: it accepts on the port with ``SO_REUSEPORT``
beside the other workers); it serves no health port (the supervisor serves the pod's) and
its ``/metrics`` on a loopback port that the supervisor merges; and it dies with its
supervisor (Linux: ``PR_SET_PDEATHSIG`` = SIGKILL, so no orphan keeps the port; elsewhere,
and as well, it stops when the supervisor's socket closes).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys

from adapters.workerlink import WorkerLink
from app.container import ProcessRole, build_container
from app.lifecycle import StartupError, run_process
from app.runner import serve
from app.settings import Settings
from app.workers.role import WorkerRole

__all__ = ["REPORT_INTERVAL", "run_worker"]

logger = logging.getLogger(__name__)

#: How often a worker checks its readiness for the supervisor (sent only on a change).
REPORT_INTERVAL = 0.05

_PR_SET_PDEATHSIG = 1


def _die_with_supervisor(supervisor_pid: int) -> None:
    """SIGKILL this process when its parent dies (Linux), and exit at once if that has
    happened already (the parent died before the flag was set)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != supervisor_pid:
        logger.error("the supervisor (pid %d) is gone; exiting", supervisor_pid)
        os._exit(1)


async def _main(settings: Settings, role: WorkerRole, stop: asyncio.Event) -> int:
    try:
        link = await WorkerLink.connect(role.socket_path, role.worker_id)
    except OSError as exc:
        raise StartupError(f"cannot reach the supervisor at {role.socket_path}: {exc}") from exc
    handoff = socket.socket(fileno=role.handoff_fd) if role.handoff_fd >= 0 else None
    container = build_container(settings, ProcessRole(link=link, handoff=handoff))

    async def stop_when_lost() -> None:
        await link.lost.wait()
        stop.set()

    async def report() -> None:
        servers = container.servers()
        metrics_server = container.observability().server
        while True:
            link.report(
                servers.health.serving(),
                metrics_server.bound_port,
                servers.handed_connections(),
            )
            await asyncio.sleep(REPORT_INTERVAL)

    watch = asyncio.create_task(stop_when_lost(), name="supervisor-watch")
    try:
        await serve(container, stop, report)
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
        await link.close()
    return 0


def run_worker(settings: Settings, role: WorkerRole) -> int:
    """The worker process, until SIGTERM, SIGINT or its supervisor's end."""
    # the supervisor holds the pod's Lease, gates the pod's readiness on it and keeps
    # handing connections over for --drain-timeout before it stops its workers
    settings = settings.model_copy(
        update={
            "grpc_port": role.grpc_port,
            "ha_enable_leader_election": False,
            "drain_timeout": 0.0,
        }
    )

    async def main(stop: asyncio.Event) -> int:
        _die_with_supervisor(role.supervisor_pid)
        return await _main(settings, role, stop)

    return run_process(settings, main, worker=str(role.worker_id))
