"""What this process is, chosen once by its entry point: alone, a worker of a pod, or the
pod's supervisor (``--workers``)."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from adapters.workerlink import SupervisorHub, WorkerLink

__all__ = ["ALONE", "ProcessRole"]


@dataclass(frozen=True, slots=True)
class ProcessRole:
    """What this process is, chosen once: alone (the default); a worker of a pod (``link``
    to its supervisor, which feeds it, and ``handoff``, the socket on which the supervisor
    hands it accepted connections); or the supervisor (``hub``, which tees its data layer
    to the workers)."""

    link: WorkerLink | None = None
    handoff: socket.socket | None = None
    hub: SupervisorHub | None = None

    @property
    def worker(self) -> bool:
        return self.link is not None


ALONE = ProcessRole()
