"""One ``/metrics`` for a pod of workers: their expositions merged into one.

Each worker keeps its own registry (``PrometheusObserver``) and serves it on a loopback
port; the supervisor fetches them all at scrape time and merges them here, instead of
``prometheus_client``'s multiprocess mode (which needs ``prometheus_client``'s own metric
classes writing to mmap files; our exporter keeps plain counters and renders at scrape
time, so fetch-and-merge costs nothing on the request path). Per series (name and labels):

- counters and histograms (every ``_bucket``, ``_sum``, ``_count``) are summed;
- gauges follow their meaning: the ones counting this process's own work
  (``SUMMED_GAUGES``: running requests, flow-control queue size and bytes) are summed; the
  others describe the pool as every worker sees it alike (the pool averages, ready pods,
  per-pod queue size, saturation, the info gauge), or are one worker's view of a shared
  thing (the prefix index size, shared state degraded), and are taken as the largest value.

The first exposition's family order is kept, then any family only later ones have.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import cast

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from ports.metric_catalogue import (
    FLOW_CONTROL_QUEUE_BYTES,
    FLOW_CONTROL_QUEUE_SIZE,
    RUNNING_REQUESTS,
)

__all__ = ["SUMMED_GAUGES", "merge_expositions"]

#: Gauges whose pod value is the sum of the workers' values.
SUMMED_GAUGES = frozenset(
    name
    for metric in (RUNNING_REQUESTS, FLOW_CONTROL_QUEUE_SIZE, FLOW_CONTROL_QUEUE_BYTES)
    for name in metric.names()
)

_go_float = cast(Callable[[float], str], floatToGoString)

_SeriesKey = tuple[str, tuple[tuple[str, str], ...]]


class _Family:
    __slots__ = ("documentation", "name", "samples", "type")

    def __init__(self, name: str, kind: str, documentation: str) -> None:
        self.name = name
        self.type = kind
        self.documentation = documentation
        self.samples: dict[_SeriesKey, float] = {}

    def add(self, key: _SeriesKey, value: float) -> None:
        previous = self.samples.get(key)
        if previous is None:
            self.samples[key] = value
        elif self.type == "gauge" and self.name not in SUMMED_GAUGES:
            self.samples[key] = max(previous, value)
        else:
            self.samples[key] = previous + value


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _render(families: Iterable[_Family]) -> bytes:
    lines: list[str] = []
    for family in families:
        documentation = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
        # As prometheus_client writes 0.0.4: a counter family is named with its _total.
        header = family.name + "_total" if family.type == "counter" else family.name
        lines.append(f"# HELP {header} {documentation}")
        lines.append(f"# TYPE {header} {family.type}")
        for (name, labels), value in family.samples.items():
            if labels:
                text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
                lines.append(f"{name}{{{text}}} {_go_float(value)}")
            else:
                lines.append(f"{name} {_go_float(value)}")
    return ("\n".join(lines) + "\n").encode() if lines else b""


def merge_expositions(expositions: Sequence[bytes]) -> bytes:
    """The Prometheus text expositions (0.0.4) merged as described above."""
    families: dict[str, _Family] = {}
    for exposition in expositions:
        for parsed in text_string_to_metric_families(exposition.decode()):
            family = families.get(parsed.name)
            if family is None:
                family = families[parsed.name] = _Family(
                    parsed.name, parsed.type, parsed.documentation
                )
            for sample in parsed.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                family.add(key, float(sample.value))
    return _render(families.values())
