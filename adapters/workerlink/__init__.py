"""The link between a supervisor and its workers (``--workers``): one unix socket per pod.

The supervisor runs the data layer once for the pod (endpoint discovery, the model servers'
``/metrics`` polls, notification watches) and relays what it learns to every worker
(``SupervisorHub``); each worker feeds it to its own datastore and extractors through
relayed ports (``WorkerLink``) and reports its readiness and metrics port back. A model
server's poll is relayed as the metrics snapshot the supervisor extracted from it
(``MetricsSnapshot``) when the workers need nothing else from it, so it is parsed once per pod.
With the native transport the supervisor also accepts the ext_proc connections and hands
them to the workers in turn (``ConnectionDispatcher``).
"""

from adapters.workerlink.frames import MetricsSnapshot
from adapters.workerlink.handoff import ConnectionDispatcher
from adapters.workerlink.hub import SupervisorHub, WorkerStatus
from adapters.workerlink.link import WorkerLink

__all__ = ["ConnectionDispatcher", "MetricsSnapshot", "SupervisorHub", "WorkerLink", "WorkerStatus"]
