"""How a model server's poll reaches the workers: parsed once, by the supervisor.

The supervisor polls each model server once for the pod. When every extractor of a polling
source is a ``core-metrics-extractor`` (the default data layer), what the workers need from
a poll is only the endpoint's metrics snapshot, so the supervisor relays that snapshot
(``SnapshotRelay``, a compact ``MetricsSnapshot`` frame) and each worker applies it as it
is (``RelayedMetricsExtractor``) instead of parsing the ``/metrics`` body again. Any other
extractor (one that may put attributes, or read the body its own way) keeps the raw result
relayed, and the worker's own extractors run on it unchanged.

Both processes load the same configuration, so they choose the same way
(``relays_snapshots``). The worker's snapshot is the supervisor's, field for field,
``update_time`` included (one monotonic clock on one host); a poll after which the
supervisor's extractors left the snapshot unchanged (a malformed body) relays nothing, and
the worker's copy goes stale as the supervisor's does.
"""

from __future__ import annotations

from adapters.workerlink import MetricsSnapshot, SupervisorHub, WorkerLink
from domain.datalayer.collector import SourceBinding
from domain.datalayer.interfaces import Extractor
from domain.datalayer.plugins.core_metrics_extractor import CoreMetricsExtractor
from domain.datastore.endpoint import Endpoint, EndpointMetrics
from ports.plugins import TypedName

__all__ = [
    "RelayedMetricsExtractor",
    "SnapshotRelay",
    "relays_snapshots",
    "snapshot_of",
    "supervisor_binding",
    "worker_binding",
]

RELAY_TYPE = "metrics-snapshot-relay"


def relays_snapshots(binding: SourceBinding) -> bool:
    """Whether the workers get this source's results as metrics snapshots: every one of its
    extractors is a ``core-metrics-extractor`` (which only replaces ``endpoint.metrics``)."""
    return bool(binding.extractors) and all(
        type(extractor) is CoreMetricsExtractor for extractor in binding.extractors
    )


#: The fields a snapshot carries, the same names on both sides.
_FIELDS = MetricsSnapshot.__struct_fields__


def snapshot_of(metrics: EndpointMetrics) -> MetricsSnapshot:
    return MetricsSnapshot(**{name: getattr(metrics, name) for name in _FIELDS})


def metrics_of(snapshot: MetricsSnapshot) -> EndpointMetrics:
    return EndpointMetrics(**{name: getattr(snapshot, name) for name in _FIELDS})


class SnapshotRelay:
    """The supervisor's extractor of a snapshot-relayed source: runs the source's extractors
    as the collector would (in order, the first error stops them and is raised), then, if
    they replaced the endpoint's metrics (an ``IncompleteDataError`` included), relays the
    new snapshot to the workers."""

    __slots__ = ("_extractors", "_hub", "_source", "typed_name")

    def __init__(self, hub: SupervisorHub, source: str, extractors: tuple[Extractor, ...]) -> None:
        self.typed_name = TypedName(RELAY_TYPE, source)
        self._hub = hub
        self._source = source
        self._extractors = extractors

    def expected_input_type(self) -> type:
        return self._extractors[0].expected_input_type()

    def extract(self, data: object, endpoint: Endpoint, now: float) -> None:
        before = endpoint.metrics
        try:
            for extractor in self._extractors:
                extractor.extract(data, endpoint, now)
        finally:
            after = endpoint.metrics
            if after is not None and after is not before:
                self._hub.metrics_snapshot(self._source, endpoint.name, snapshot_of(after))


class RelayedMetricsExtractor:
    """A worker's extractor of a snapshot-relayed source: the supervisor's snapshot becomes
    the endpoint's metrics as it is."""

    __slots__ = ("typed_name",)

    def __init__(self, source: str) -> None:
        self.typed_name = TypedName(RELAY_TYPE, source)

    def expected_input_type(self) -> type:
        return MetricsSnapshot

    def extract(self, data: object, endpoint: Endpoint, now: float) -> None:
        if not isinstance(data, MetricsSnapshot):
            raise ValueError(f"expected MetricsSnapshot, got {type(data).__name__}")
        endpoint.metrics = metrics_of(data)


def supervisor_binding(binding: SourceBinding, hub: SupervisorHub) -> SourceBinding:
    """The supervisor's binding: its source teed raw to the workers, or (snapshots) not
    teed and its extractors relaying what they made."""
    if relays_snapshots(binding):
        name = str(binding.source.typed_name)
        relay = SnapshotRelay(hub, name, binding.extractors)
        return SourceBinding(binding.source, (relay,), binding.interval)
    return SourceBinding(hub.polling(binding.source), binding.extractors, binding.interval)


def worker_binding(binding: SourceBinding, link: WorkerLink) -> SourceBinding:
    """A worker's binding: the relayed source of the same name, with its own extractors
    (raw results) or the snapshot applier."""
    typed_name = binding.source.typed_name
    if relays_snapshots(binding):
        source = link.polling_source(typed_name, MetricsSnapshot)
        return SourceBinding(source, (RelayedMetricsExtractor(str(typed_name)),))
    return SourceBinding(
        link.polling_source(typed_name, binding.source.output_type()), binding.extractors
    )
