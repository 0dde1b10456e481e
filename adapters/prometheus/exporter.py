"""The EPP's own Prometheus metrics: the metric part of the ``Observer``, and ``/metrics``.

``PrometheusObserver`` exports every metric of ``ports.metric_catalogue.CATALOGUE`` (the
reference's names, types, label names and buckets, plus two of this product's own) and
declares nothing of its own. Values live in plain Python counters updated on the event loop
(a few hundred nanoseconds per call) and are written as Prometheus text straight from them
when ``/metrics`` is scraped (``exposition_parts``: the text ``generate_latest`` gives for
the observer's own ``CollectorRegistry``, never the process-global one, at an eighth of its
CPU and without its per-sample objects; ``tests.bench.metrics_render``).

Reports name catalogue entries, so a misspelt name or a wrong kind cannot type-check; at
run time an entry this observer does not export (one built outside the catalogue), a label
set other than the entry's, or an invalid value is dropped and logged once per metric;
nothing ever raises into the caller. A gauge set to NaN removes that labelled series (how a
reporter says "this pod is gone").

Labels whose values come from requests (``REQUEST_DERIVED_LABELS``: the body's model, the
rewritten model, the fairness id) are bounded here, once for every metric that carries them:
a value longer than ``max_label_length`` characters, and every new value once
``max_label_values`` distinct ones of that label were seen, is exported as ``OTHER_LABEL``
(the reference caps at 1,000 values then ``other`` the same way). Without it one request with
a 1 MB model name made ``/metrics`` 337 MB and 20,000 names made 620k series that never
expire. The distinct values are counted per label name, so a model is ``other`` in every
metric or in none. Beyond those, each metric keeps ``max_series`` series, and all the series
with request-derived labels together at most ``max_request_series_bytes`` of text (each
new series is charged its lines, aliases included, as they would be written; a removed
gauge series is refunded): ``/metrics`` stays within that plus the per-endpoint series.

``MetricsServer`` serves the registry as Prometheus text on ``/metrics``, rendered in a
worker thread so that a large exposition never holds up routing on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import ssl
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from operator import itemgetter
from typing import Any, cast

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.metrics_core import Metric as MetricFamily
from prometheus_client.utils import floatToGoString

from ports.access import AccessVerdict, RequestAuthorizer
from ports.metric_catalogue import (
    CATALOGUE,
    CounterMetric,
    GaugeMetric,
    HistogramMetric,
    Metric,
    MetricKind,
)
from ports.observer import NoopSpan, Span

_go_float = cast(Callable[[float], str], floatToGoString)

__all__ = [
    "MAX_LABEL_LENGTH",
    "MAX_LABEL_VALUES",
    "MAX_REQUEST_SERIES_BYTES",
    "MAX_SERIES_PER_METRIC",
    "OTHER_LABEL",
    "REQUEST_DERIVED_LABELS",
    "MetricsServer",
    "PrometheusObserver",
    "TextPage",
    "authorization",
]

logger = logging.getLogger(__name__)

LabelKey = tuple[object, ...]
_NOOP_SPAN = NoopSpan()

#: Label names whose values a client chooses (the body's ``model``, the rewrite header, the
#: fairness header): bounded by ``PrometheusObserver``.
REQUEST_DERIVED_LABELS = frozenset(
    {"model_name", "target_model_name", "target_model", "fairness_id"}
)
#: The exported value of a request-derived label beyond the bounds.
OTHER_LABEL = "other"
#: Distinct values kept per request-derived label name (the reference's cap).
MAX_LABEL_VALUES = 1000
#: Series kept per metric with request-derived labels before new ones are folded into
#: ``OTHER_LABEL`` in every request-derived label (models x fairness ids could otherwise
#: reach a million series per metric within the per-label caps).
MAX_SERIES_PER_METRIC = 10_000
#: Text the series with request-derived labels may add to ``/metrics``, over every metric
#: (their lines, aliases included); past it new ones are folded into ``OTHER_LABEL``. Within
#: the per-label and per-metric caps alone, 1,000 models of 256 characters with ten fairness
#: ids each made ``/metrics`` 443 MiB of 537,503 series (``tests.bench.metrics_render
#: --worst``); 1,000 short model names in every metric fit (25 MiB).
MAX_REQUEST_SERIES_BYTES = 32 << 20
#: Longest request-derived label value kept, in characters (Hugging Face repository ids are
#: at most 96; a LoRA adapter name rarely more).
MAX_LABEL_LENGTH = 256


class _BoundedValues:
    """The first ``limit`` distinct values of one label (each at most ``max_length``
    characters) pass through; anything else becomes ``OTHER_LABEL``."""

    __slots__ = ("_limit", "_max_length", "_seen")

    def __init__(self, limit: int, max_length: int) -> None:
        self._limit = limit
        self._max_length = max_length
        self._seen: set[object] = set()

    def __call__(self, value: object) -> object:
        seen = self._seen
        if value in seen:
            return value
        if isinstance(value, str) and len(value) > self._max_length:
            return OTHER_LABEL
        if len(seen) >= self._limit:
            return OTHER_LABEL
        seen.add(value)
        return value


class _Histogram:
    """Per-bucket (not cumulative) counts, the last one for +Inf, and the sum."""

    __slots__ = ("counts", "sum")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * (buckets + 1)
        self.sum = 0.0


def _key_function(names: Sequence[str]) -> Callable[[Mapping[str, str]], LabelKey | None]:
    """Label values in declared order, or ``None`` when the label set is not ``names``."""
    count = len(names)
    if count == 0:

        def empty(labels: Mapping[str, str]) -> LabelKey | None:
            return () if not labels else None

        return empty
    getter = itemgetter(*names)
    single = count == 1

    def key(labels: Mapping[str, str]) -> LabelKey | None:
        if len(labels) != count:
            return None
        try:
            values = getter(labels)
        except KeyError:
            return None
        return (values,) if single else cast(LabelKey, values)

    return key


def _escape_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class _Exposition:
    """One name a family is exported under: its own or an alias's. ``positions`` are the
    places in a reported key of the labels it shows (``None``: all, in order: the key is
    its own), ``names`` their exposition names, ``constants`` fixed labels added."""

    __slots__ = (
        "constants",
        "header",
        "help",
        "label_names",
        "name",
        "positions",
        "sample_name",
        "sorted_labels",
    )

    def __init__(
        self,
        metric: Metric,
        name: str,
        names: tuple[str, ...],
        positions: tuple[int, ...] | None,
        constants: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.name = name
        self.positions = positions
        self.constants = constants
        self.help = metric.help
        #: every label name shown, constants last (the order of ``collect``'s families)
        self.label_names = (*names, *(label for label, _ in constants))
        # The text format as prometheus_client's ``generate_latest`` writes it: a counter's
        # samples and HELP/TYPE name end in _total, labels are sorted by name (``le`` too).
        if metric.kind is MetricKind.COUNTER:
            name = (name[:-6] if name.endswith("_total") else name) + "_total"
        self.sample_name = name
        kind = metric.kind.value if metric.kind is not MetricKind.HISTOGRAM else "histogram"
        help_text = metric.help.replace("\\", r"\\").replace("\n", r"\n")
        self.header = f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n"
        #: (position of the value in a shown key, label name), sorted by label name
        self.sorted_labels = sorted(enumerate(self.label_names), key=itemgetter(1))


class _TextBudget:
    """The bytes of text the request-labelled series may still add (shared by the
    families)."""

    __slots__ = ("remaining",)

    def __init__(self, total: int) -> None:
        self.remaining = total


class _Family:
    __slots__ = (
        "bounded",
        "bounds",
        "budget",
        "children",
        "expositions",
        "folded",
        "key",
        "le",
        "line_bytes",
        "lines",
        "max_series",
        "metric",
        "with_sum",
    )

    def __init__(
        self,
        metric: Metric,
        bounders: Mapping[str, _BoundedValues],
        max_series: int,
        budget: _TextBudget | None = None,
    ) -> None:
        self.metric = metric
        reported = metric.reported_labels
        self.key = _key_function(reported)
        #: (position, bounder) of each request-derived label
        self.bounded = tuple(
            (i, bounders[name]) for i, name in enumerate(reported) if name in bounders
        )
        self.max_series = max_series
        self.bounds = metric.buckets if isinstance(metric, HistogramMetric) else ()
        self.le = [_go_float(b) for b in self.bounds] + ["+Inf"]
        #: reported label values -> ``[value]`` (counter, gauge) or ``_Histogram``
        self.children: dict[LabelKey, Any] = {}
        #: gauges only: the non-zero values of series folded into ``OTHER_LABEL``, by their
        #: own label values, so that the folded series shows their sum
        self.folded: dict[LabelKey, float] = {}
        own = None if not metric.extra_labels else tuple(range(len(metric.labels)))
        self.expositions = [_Exposition(metric, metric.name, metric.labels, own)]
        for alias in metric.aliases:
            positions = tuple(reported.index(label) for label in alias.source_labels())
            identity = positions == tuple(range(len(reported)))
            self.expositions.append(
                _Exposition(
                    metric,
                    alias.name,
                    alias.labels,
                    None if identity else positions,
                    alias.constants,
                )
            )
        self.with_sum = not self.bounds or self.bounds[0] >= 0
        self.budget = budget
        #: lines one series writes (over its names), and the bytes of each but its values
        self.lines = (len(self.le) + 2 if self.bounds else 1) * len(self.expositions)
        self.line_bytes = (
            max(len(e.name) for e in self.expositions)
            + sum(len(label) + 4 for label in metric.labels)
            + 40  # a suffix, braces, constants, the value
        )

    def _rows(self, exposition: _Exposition) -> list[tuple[LabelKey, Any]]:
        """The series ``exposition`` shows: the children, or their sums over the labels it
        does not show; then its constant labels' values."""
        children = list(self.children.items())
        if not children and not self.metric.reported_labels:
            children = [((), self._zero())]
        positions = exposition.positions
        if positions is not None:
            summed: dict[LabelKey, Any] = {}
            histogram = self.metric.kind is MetricKind.HISTOGRAM
            for key, child in children:
                shown = tuple(key[i] for i in positions)
                total = summed.get(shown)
                if total is None:
                    total = summed[shown] = self._zero()
                if histogram:
                    total.counts = [a + b for a, b in zip(total.counts, child.counts, strict=True)]
                    total.sum += child.sum
                else:
                    total[0] += child[0]
            children = list(summed.items())
        if exposition.constants:
            values = tuple(value for _, value in exposition.constants)
            children = [(key + values, child) for key, child in children]
        return children

    def render(self, out: list[str]) -> None:
        """Appends this family's exposition text to ``out`` (what ``generate_latest``
        writes for ``collect()``, without building its samples)."""
        for exposition in self.expositions:
            self._render(exposition, out)

    def _render(self, exposition: _Exposition, out: list[str]) -> None:
        out.append(exposition.header)
        children = self._rows(exposition)
        name = exposition.sample_name
        labels = exposition.sorted_labels
        if self.metric.kind is not MetricKind.HISTOGRAM:
            for key, child in children:
                if labels:
                    text = ",".join(
                        f'{label}="{_escape_value(_text(key[i]))}"' for i, label in labels
                    )
                    out.append(f"{name}{{{text}}} {_go_float(child[0])}\n")
                else:
                    out.append(f"{name} {_go_float(child[0])}\n")
            return
        for key, child in children:
            pairs = [(label, _escape_value(_text(key[i]))) for i, label in labels]
            before = "".join(f'{label}="{value}",' for label, value in pairs if label < "le")
            after = "".join(f',{label}="{value}"' for label, value in pairs if label > "le")
            cumulative = 0
            for le, count in zip(self.le, child.counts, strict=True):
                cumulative += count
                out.append(f'{name}_bucket{{{before}le="{le}"{after}}} {_go_float(cumulative)}\n')
            if self.with_sum:
                plain = ",".join(f'{label}="{value}"' for label, value in pairs)
                plain = f"{{{plain}}}" if plain else ""
                out.append(f"{name}_count{plain} {_go_float(cumulative)}\n")
                out.append(f"{name}_sum{plain} {_go_float(child.sum)}\n")

    def collect(self) -> Iterator[MetricFamily]:
        for exposition in self.expositions:
            family = _empty_family(self.metric, exposition)
            if isinstance(family, HistogramMetricFamily):
                for key, child in self._rows(exposition):
                    cumulative = 0
                    buckets: list[tuple[str, float]] = []
                    for le, count in zip(self.le, child.counts, strict=True):
                        cumulative += count
                        buckets.append((le, cumulative))
                    family.add_metric(_values(key), buckets, child.sum)
            else:
                for key, child in self._rows(exposition):
                    family.add_metric(_values(key), child[0])
            yield family

    def child_key(self, key: LabelKey) -> LabelKey:
        """``key`` with its request-derived values bounded (only for a key not seen yet:
        a key already in ``children`` went through this). Past ``max_series`` series, a
        new key has every request-derived value folded into ``OTHER_LABEL``."""
        if not self.bounded or key in self.children:
            return key
        values = list(key)
        if len(self.children) >= self.max_series:
            for position, _ in self.bounded:
                values[position] = OTHER_LABEL
            return tuple(values)
        for position, bound in self.bounded:
            values[position] = bound(values[position])
        bounded = tuple(values)
        budget = self.budget
        if budget is None or bounded in self.children:
            return bounded
        cost = self.text_bytes(bounded)
        if cost > budget.remaining:
            for position, _ in self.bounded:
                values[position] = OTHER_LABEL
            return tuple(values)
        budget.remaining -= cost
        return bounded

    def text_bytes(self, key: LabelKey) -> int:
        """What the series ``key`` writes to ``/metrics``, about."""
        return self.lines * (self.line_bytes + sum(len(_text(value)) for value in key))

    def removed(self, key: LabelKey) -> None:
        """The series ``key`` is gone: its text no longer counts."""
        if self.bounded and self.budget is not None:
            self.budget.remaining += self.text_bytes(key)

    def _zero(self) -> Any:
        if self.metric.kind is MetricKind.HISTOGRAM:
            return _Histogram(len(self.bounds))
        return [0.0]


def _empty_family(
    metric: Metric, exposition: _Exposition
) -> CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily:
    name, help_text, labels = exposition.name, exposition.help, exposition.label_names
    if metric.kind is MetricKind.HISTOGRAM:
        return HistogramMetricFamily(name, help_text, labels=labels)
    if metric.kind is MetricKind.COUNTER:
        return CounterMetricFamily(name, help_text, labels=labels)
    return GaugeMetricFamily(name, help_text, labels=labels)


def _values(key: LabelKey) -> list[str]:
    return [v if isinstance(v, str) else str(v) for v in key]


def _text(value: object) -> str:
    return value if isinstance(value, str) else str(value)


class _Collector:
    """Turns the observer's values into metric families at scrape time."""

    def __init__(self, families: Iterable[_Family]) -> None:
        self._families = tuple(families)

    def collect(self) -> Iterator[MetricFamily]:
        for family in self._families:
            yield from family.collect()

    def describe(self) -> Iterator[MetricFamily]:
        for family in self._families:
            for exposition in family.expositions:
                yield _empty_family(family.metric, exposition)


class PrometheusObserver:
    """An ``Observer`` of metrics only (``start_span`` gives a no-op span).

    Call it from the event loop thread only. ``registry`` holds exactly the metrics of
    ``catalogue`` (default: ``CATALOGUE``, every metric the EPP exports), in its order.
    Request-derived labels are bounded by ``max_label_values`` and ``max_label_length``.
    """

    def __init__(
        self,
        catalogue: Sequence[Metric] = CATALOGUE,
        *,
        max_label_values: int = MAX_LABEL_VALUES,
        max_label_length: int = MAX_LABEL_LENGTH,
        max_series: int = MAX_SERIES_PER_METRIC,
        max_request_series_bytes: int = MAX_REQUEST_SERIES_BYTES,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        bounders = {
            name: _BoundedValues(max_label_values, max_label_length)
            for name in REQUEST_DERIVED_LABELS
        }
        budget = _TextBudget(max_request_series_bytes)
        families = [_Family(metric, bounders, max_series, budget) for metric in catalogue]
        names = [name for metric in catalogue for name in metric.names()]
        if len(set(names)) != len(names):
            raise ValueError("duplicate metric name in the catalogue")
        # Keyed by the entry itself: entries hash by identity, as cheaply as a name.
        self._families: dict[Metric, _Family] = {f.metric: f for f in families}
        self._counters = {f.metric: f for f in families if f.metric.kind is MetricKind.COUNTER}
        self._gauges = {f.metric: f for f in families if f.metric.kind is MetricKind.GAUGE}
        self._histograms = {f.metric: f for f in families if f.metric.kind is MetricKind.HISTOGRAM}
        self._warned: set[str] = set()
        self.registry.register(_Collector(families))

    def counter(self, metric: CounterMetric, labels: Mapping[str, str], value: float = 1.0) -> None:
        family = self._counters.get(metric)
        if family is None:
            self._reject(metric, MetricKind.COUNTER, labels)
            return
        key = family.key(labels)
        if key is None:
            self._reject(metric, MetricKind.COUNTER, labels)
            return
        if not value >= 0.0:  # negative or NaN: a counter never goes down
            self._warn(metric, f"counter {metric.name}: dropped the invalid increment {value!r}")
            return
        key = family.child_key(key)
        child = family.children.get(key)
        if child is None:
            family.children[key] = [value]
        else:
            child[0] += value

    def gauge(self, metric: GaugeMetric, labels: Mapping[str, str], value: float) -> None:
        family = self._gauges.get(metric)
        if family is None:
            self._reject(metric, MetricKind.GAUGE, labels)
            return
        key = family.key(labels)
        if key is None:
            self._reject(metric, MetricKind.GAUGE, labels)
            return
        if value != value and key not in family.children and key not in family.folded:
            return  # NaN for a series never set: nothing to remove
        bounded = family.child_key(key)
        if bounded != key:
            self._fold_gauge(family, key, bounded, value)
            return
        if value != value:  # NaN: the series is gone
            if family.children.pop(key, None) is not None:
                family.removed(key)
            return
        child = family.children.get(key)
        if child is None:
            family.children[key] = [value]
        else:
            child[0] = value

    def histogram(self, metric: HistogramMetric, labels: Mapping[str, str], value: float) -> None:
        family = self._histograms.get(metric)
        if family is None:
            self._reject(metric, MetricKind.HISTOGRAM, labels)
            return
        key = family.key(labels)
        if key is None:
            self._reject(metric, MetricKind.HISTOGRAM, labels)
            return
        if value != value or math.isinf(value):
            self._warn(
                metric, f"histogram {metric.name}: dropped the invalid observation {value!r}"
            )
            return
        key = family.child_key(key)
        child = family.children.get(key)
        if child is None:
            child = family.children[key] = _Histogram(len(family.bounds))
        child.counts[bisect_left(family.bounds, value)] += 1
        child.sum += value

    @staticmethod
    def _fold_gauge(family: _Family, key: LabelKey, bounded: LabelKey, value: float) -> None:
        """A gauge series beyond the label bounds: ``bounded`` shows the sum of the folded
        series' values (each remembered until it is set to 0 or NaN)."""
        old = family.folded.pop(key, 0.0)
        new = 0.0 if value != value else value
        if new:
            family.folded[key] = new
        child = family.children.get(bounded)
        if child is None:
            family.children[bounded] = [new - old]
        else:
            child[0] += new - old

    def start_span(
        self,
        name: str,
        *,
        parent: Span | None = None,
        carrier: Mapping[str, str] | None = None,
        attributes: Mapping[str, str | int | float | bool] | None = None,
    ) -> Span:
        return _NOOP_SPAN

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format (0.0.4)."""
        return b"".join(self.exposition_parts())

    def exposition_parts(self) -> list[bytes]:
        """``exposition()`` in pieces, one per metric family: the same text as
        ``generate_latest(self.registry)``, written straight from the values (about a third
        of its allocations: no sample objects), and never held whole twice. Safe to call
        from another thread while the event loop updates values (each family's series are
        snapshot with one ``list(dict.items())``, atomic under the GIL)."""
        parts = []
        for family in self._families.values():
            lines: list[str] = []
            family.render(lines)
            parts.append("".join(lines).encode())
        return parts

    def _reject(self, metric: Metric, kind: MetricKind, labels: Mapping[str, str]) -> None:
        name = getattr(metric, "name", repr(metric))
        if metric not in self._families:
            why = f"{kind.value} {name!r} is not a metric of this exporter's catalogue; dropped"
        elif metric.kind is not kind:
            why = f"{name} is a {metric.kind.value}, reported as a {kind.value}; dropped"
        else:
            why = (
                f"{kind.value} {name}: labels {sorted(labels)} are not the declared "
                f"{list(metric.reported_labels)}; dropped"
            )
        self._warn(metric, why)

    def _warn(self, metric: Metric, message: str) -> None:
        name = getattr(metric, "name", repr(metric))
        if name in self._warned:
            return
        self._warned.add(name)
        logger.warning("%s (logged once per metric)", message)


#: A text page beside ``/metrics``: called with the request's query parameters, it returns
#: the HTTP status and the text (``/debug/pprof/...`` with ``--enable-pprof``).
TextPage = Callable[[Mapping[str, str]], Awaitable[tuple[int, str]]]


def authorization(authorizer: RequestAuthorizer) -> Any:
    """An aiohttp middleware that authorizes every request with ``authorizer`` first: a
    refusal is answered 401, 403 or 503 (``AccessVerdict``) and the handler never runs."""

    @web.middleware
    async def authorize(
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        verdict = await authorizer.authorize(request.headers.get("Authorization"), request.path)
        if verdict is AccessVerdict.ALLOWED:
            return await handler(request)
        headers = {"WWW-Authenticate": "Bearer"} if verdict is AccessVerdict.UNAUTHENTICATED else {}
        return web.Response(status=verdict.value, text=f"{verdict.name.lower()}\n", headers=headers)

    return authorize


class MetricsServer:
    """Serves a ``PrometheusObserver``'s metrics (or any registry) as Prometheus text on
    ``GET /metrics`` (aiohttp on the event loop; the text is rendered in the server's own
    worker thread, so the loop keeps routing meanwhile; concurrent scrapes are rendered one
    after the other). An observer's text is written family by family as rendered, never
    joined into one more copy.

    ``source`` may also be a coroutine function giving the whole text (a pod's supervisor
    merging its workers' expositions). ``pages`` adds text pages at other paths, served as
    ``text/plain`` unless ``content_types`` names another type for the path. With an
    ``authorizer`` every request is
    authorized first: a refusal is answered 401, 403 or 503 (``AccessVerdict``) and renders
    nothing. With ``ssl_context`` the port serves HTTPS (and checks client certificates if
    the context asks for them).

    ``start`` binds ``host:port`` (port 0: any free port, see ``bound_port``) and raises
    ``OSError`` naming ``--metrics-port`` when it cannot; ``stop`` closes it (idempotent).
    """

    def __init__(
        self,
        source: PrometheusObserver | CollectorRegistry | Callable[[], Awaitable[bytes]],
        *,
        host: str,
        port: int,
        authorizer: RequestAuthorizer | None = None,
        pages: Mapping[str, TextPage] | None = None,
        content_types: Mapping[str, str] | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._render_parts: Callable[[], list[bytes]] | None = None
        self._exposition: Callable[[], Awaitable[bytes]] | None = None
        if isinstance(source, PrometheusObserver):
            self._render_parts = source.exposition_parts
        elif isinstance(source, CollectorRegistry):
            registry = source
            self._render_parts = lambda: [generate_latest(registry)]
        else:
            self._exposition = source
        self._content_types = dict(content_types or {})
        self._host = host
        self._port = port
        self._authorizer = authorizer
        self._pages = dict(pages or {})
        self._ssl_context = ssl_context
        self._runner: web.AppRunner | None = None
        self._render: ThreadPoolExecutor | None = None
        self.bound_port = 0

    async def start(self) -> None:
        middlewares = [] if self._authorizer is None else [authorization(self._authorizer)]
        app = web.Application(middlewares=middlewares)
        app.router.add_get("/metrics", self._metrics)
        for path in self._pages:
            app.router.add_get(path, self._page)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(
            runner, self._host, self._port, reuse_address=True, ssl_context=self._ssl_context
        )
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise OSError(
                f"--metrics-port: cannot listen on {self._host}:{self._port}: {exc}"
            ) from exc
        self._runner = runner
        self._render = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epp-metrics-render")
        address = runner.addresses[0]
        self.bound_port = int(address[1])
        logger.info(
            "metrics serving on %s:%d (%s%s%s)",
            self._host,
            self.bound_port,
            ", ".join(["/metrics", *self._pages]),
            ", HTTPS" if self._ssl_context is not None else "",
            ", bearer token required" if self._authorizer is not None else "",
        )

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        render, self._render = self._render, None
        if render is not None:
            render.shutdown(wait=False, cancel_futures=True)

    async def _page(self, request: web.Request) -> web.Response:
        status, text = await self._pages[request.path](request.query)
        content_type = self._content_types.get(request.path, "text/plain")
        return web.Response(status=status, text=text, content_type=content_type)

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        # The renders snapshot each family's children with one ``list(dict.items())``
        # (atomic under the GIL), so the loop may keep updating values meanwhile.
        render = self._render
        if render is None:
            raise web.HTTPServiceUnavailable()
        if self._exposition is not None:
            parts = [await self._exposition()]
        else:
            assert self._render_parts is not None
            loop = asyncio.get_running_loop()
            parts = await loop.run_in_executor(render, self._render_parts)
        response = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})
        response.content_length = sum(len(part) for part in parts)
        await response.prepare(request)
        while parts:
            await response.write(parts.pop(0))  # each piece freed once written
        await response.write_eof()
        return response
