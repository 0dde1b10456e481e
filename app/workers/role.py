"""How a supervisor tells a worker process who it is: the ``EPP_WORKER`` variable."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["WORKER_VARIABLE", "WorkerRole", "worker_role_from_environment"]

#: ``<worker id>:<supervisor pid>:<grpc port>:<handoff fd>:<supervisor socket path>``, set
#: by the supervisor for each worker it starts; never set by hand. The handoff fd (-1: none)
#: is the inherited unix socket on which the supervisor hands over ext_proc connections.
WORKER_VARIABLE = "EPP_WORKER"


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerRole:
    worker_id: int
    supervisor_pid: int
    grpc_port: int
    socket_path: str
    handoff_fd: int = -1

    def encode(self) -> str:
        return (
            f"{self.worker_id}:{self.supervisor_pid}:{self.grpc_port}:{self.handoff_fd}:"
            f"{self.socket_path}"
        )


def worker_role_from_environment() -> WorkerRole | None:
    text = os.environ.get(WORKER_VARIABLE)
    if not text:
        return None
    worker_id, supervisor_pid, grpc_port, handoff_fd, socket_path = text.split(":", 4)
    return WorkerRole(
        worker_id=int(worker_id),
        supervisor_pid=int(supervisor_pid),
        grpc_port=int(grpc_port),
        handoff_fd=int(handoff_fd),
        socket_path=socket_path,
    )
