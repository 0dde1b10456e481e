"""Online latency models: a request's TTFT and TPOT on an endpoint, learned from what the
EPP observes, in process.

One ``LatencyModel`` predicts one target (TTFT or TPOT, in ms) as a linear function of a
request's features on an endpoint (``FEATURES``: the uncached prompt, the load in flight
there, the endpoint's scraped queue, batch and KV-cache usage). Its coefficients are a
three-level hierarchy of ridge regressions, each shrunk toward the level above:

- the **heuristic** (``prior``, fixed coefficients: for TTFT an overhead plus the tokens
  ahead over a peak prefill throughput, today's ``prefix-cache-affinity-filter`` estimate);
- the **pool** model: every endpoint's samples, shrunk toward the heuristic with a weight
  worth ``prior_weight`` samples;
- one **endpoint** model per endpoint: its own samples, shrunk toward the pool model with
  the same weight, so a new endpoint starts from the pool's model and a server twice as slow
  grows coefficients twice as large as it sends its own samples.

Each level keeps exponentially weighted sufficient statistics (``X'WX`` and ``X'Wy``,
factor ``decay`` per sample: about 1 / (1 - decay) samples of memory, so bounded memory
whatever the traffic) and solves its small system after every ``refit_every`` samples:
no refit ever scans samples, and the cost per sample is fixed (a few tens of microseconds
in pure Python for the 7 features). A prediction is a dot product per candidate.

Robustness: a sample outside ``(0, max_target]`` is refused (a clock that jumped, a
server that answered after an hour); an accepted sample's residual against the current
prediction is clipped to ``clip`` times the model's running mean absolute residual (a
Huber-like update), so one absurd sample moves the model by a bounded amount. A level with
fewer than ``min_samples`` (decayed) samples is not used: the prediction then comes from
the level above and says so (``source``).

The statistics serialise to plain numbers (``export``/``merge``) for sharing between EPP
processes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "FEATURES",
    "SOURCE_ENDPOINT",
    "SOURCE_HEURISTIC",
    "SOURCE_POOL",
    "LatencyModel",
    "ModelParameters",
    "Prediction",
    "dot",
    "solve",
]

#: Names of the features, in vector order: a constant, the request's uncached prompt tokens
#: on the endpoint (thousands), the tokens in flight there (thousands; the pool's when
#: shared), the requests in flight there, the endpoint's scraped waiting and running
#: requests (tens) and its KV-cache usage (0..1).
FEATURES = (
    "constant",
    "uncached_ktokens",
    "inflight_ktokens",
    "inflight_requests_tens",
    "waiting_tens",
    "running_tens",
    "kv_usage",
)
DIMENSION = len(FEATURES)

#: How fast the residual scale that bounds a sample's influence follows the residuals.
_SCALE_DECAY = 0.9

SOURCE_ENDPOINT = "endpoint"
SOURCE_POOL = "pool"
SOURCE_HEURISTIC = "heuristic"


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelParameters:
    """How a ``LatencyModel`` learns (see the module docstring)."""

    prior: tuple[float, ...]
    decay: float = 0.995
    prior_weight: float = 8.0
    min_samples: float = 16.0
    refit_every: int = 4
    clip: float = 4.0
    max_target: float = 600_000.0
    #: the smallest residual clip (ms): early residuals are not clipped below it
    clip_floor: float = 50.0

    def __post_init__(self) -> None:
        if len(self.prior) != DIMENSION:
            raise ValueError(f"prior: needs {DIMENSION} coefficients")
        if not 0.5 <= self.decay < 1.0:
            raise ValueError("decay: must be within [0.5, 1)")
        if not self.prior_weight > 0 or not self.min_samples >= 1:
            raise ValueError("prior_weight and min_samples: must be positive")


@dataclass(frozen=True, slots=True)
class Prediction:
    """A predicted value (ms) and the level that made it."""

    value: float
    source: str


class _Level:
    """Exponentially weighted ridge statistics and their current solution."""

    __slots__ = ("coef", "count", "pending", "residual", "xtx", "xty")

    def __init__(self, coef: Sequence[float]) -> None:
        self.xtx = [0.0] * (DIMENSION * DIMENSION)
        self.xty = [0.0] * DIMENSION
        self.count = 0.0  # decayed number of samples
        self.residual = 0.0  # decayed mean absolute residual (ms)
        self.pending = 0
        self.coef = list(coef)

    def add(self, x: Sequence[float], y: float, decay: float, clip: float, floor: float) -> bool:
        """Adds one sample (its residual clipped); returns whether it was clipped."""
        predicted = dot(self.coef, x)
        residual = y - predicted
        bound = max(floor, clip * self.residual) if self.count >= 4.0 else math.inf
        clipped = abs(residual) > bound
        if clipped:
            residual = math.copysign(bound, residual)
            y = predicted + residual
        self.residual = self.residual * _SCALE_DECAY + abs(residual) * (1.0 - _SCALE_DECAY)
        if self.count < 4.0:  # the first samples set the scale
            self.residual = max(self.residual, abs(residual) / 4.0)
        xtx = self.xtx
        xty = self.xty
        for i in range(DIMENSION):
            xi = x[i]
            row = i * DIMENSION
            xty[i] = xty[i] * decay + xi * y
            for j in range(DIMENSION):
                xtx[row + j] = xtx[row + j] * decay + xi * x[j]
        self.count = self.count * decay + 1.0
        self.pending += 1
        return clipped

    def refit(self, prior: Sequence[float], weight: float) -> None:
        """``coef = (X'WX + weight I)^-1 (X'Wy + weight prior)``."""
        matrix = list(self.xtx)
        vector = list(self.xty)
        for i in range(DIMENSION):
            matrix[i * DIMENSION + i] += weight
            vector[i] += weight * prior[i]
        solution = solve(matrix, vector, DIMENSION)
        if solution is not None:
            self.coef = solution
        self.pending = 0


def dot(coef: Sequence[float], x: Sequence[float]) -> float:
    """The coefficients' dot product with the features (unrolled: it runs for every
    candidate of every request)."""
    return (
        coef[0] * x[0]
        + coef[1] * x[1]
        + coef[2] * x[2]
        + coef[3] * x[3]
        + coef[4] * x[4]
        + coef[5] * x[5]
        + coef[6] * x[6]
    )


def solve(matrix: list[float], vector: list[float], n: int) -> list[float] | None:
    """The solution of the symmetric positive-definite system ``matrix x = vector``
    (``matrix`` row-major, n x n) by Cholesky; ``None`` when it is not positive definite.
    Overwrites its arguments."""
    a = matrix
    for j in range(n):
        row_j = j * n
        diagonal = a[row_j + j]
        for k in range(j):
            diagonal -= a[row_j + k] * a[row_j + k]
        if not diagonal > 1e-12:
            return None
        root = math.sqrt(diagonal)
        a[row_j + j] = root
        for i in range(j + 1, n):
            row_i = i * n
            value = a[row_i + j]
            for k in range(j):
                value -= a[row_i + k] * a[row_j + k]
            a[row_i + j] = value / root
    y = vector
    for i in range(n):
        row = i * n
        value = y[i]
        for k in range(i):
            value -= a[row + k] * y[k]
        y[i] = value / a[row + i]
    for i in range(n - 1, -1, -1):
        value = y[i]
        for k in range(i + 1, n):
            value -= a[k * n + i] * y[k]
        y[i] = value / a[i * n + i]
    return y


class LatencyModel:
    """One target's hierarchy: the heuristic, the pool and one model per endpoint.

    Not thread-safe; used from the event loop. Memory: two levels of ``DIMENSION``^2
    numbers per endpoint known (``forget`` drops one).
    """

    __slots__ = ("_endpoints", "_learnt", "_parameters", "_pool", "clipped", "samples")

    def __init__(self, parameters: ModelParameters) -> None:
        self._parameters = parameters
        self._pool = _Level(parameters.prior)
        self._endpoints: dict[str, _Level] = {}
        #: the levels samples were learnt into since ``take_learnt`` (None: the pool)
        self._learnt: set[str | None] = set()
        #: samples accepted and clipped since start (for the operator)
        self.samples = 0
        self.clipped = 0

    @property
    def parameters(self) -> ModelParameters:
        return self._parameters

    def coefficients(self, endpoint: str) -> tuple[Sequence[float], str]:
        """The coefficients a prediction on ``endpoint`` uses now (the model's own: not to
        be changed), and their level. A prediction is their dot product with the features,
        at least 0 (``predict``)."""
        p = self._parameters
        level = self._endpoints.get(endpoint)
        if level is not None and level.count >= p.min_samples:
            return level.coef, SOURCE_ENDPOINT
        if self._pool.count >= p.min_samples:
            return self._pool.coef, SOURCE_POOL
        return p.prior, SOURCE_HEURISTIC

    def predict(self, endpoint: str, x: Sequence[float]) -> Prediction:
        coef, source = self.coefficients(endpoint)
        value = dot(coef, x)
        return Prediction(value if value > 0.0 else 0.0, source)

    def observe(self, endpoint: str, x: Sequence[float], y: float) -> bool:
        """Learns that ``x`` on ``endpoint`` gave ``y`` (ms). Returns False when the sample
        is refused (not a finite number within ``(0, max_target]``)."""
        p = self._parameters
        if not 0.0 < y <= p.max_target:  # also refuses NaN
            return False
        pool = self._pool
        if pool.add(x, y, p.decay, p.clip, p.clip_floor):
            self.clipped += 1
        if pool.pending >= p.refit_every:
            pool.refit(p.prior, p.prior_weight)
        level = self._endpoints.get(endpoint)
        if level is None:
            level = self._endpoints[endpoint] = _Level(pool.coef)
        level.add(x, y, p.decay, p.clip, p.clip_floor)
        if level.pending >= p.refit_every:
            level.refit(pool.coef, p.prior_weight)
        self.samples += 1
        self._learnt.add(endpoint)
        self._learnt.add(None)
        return True

    def take_learnt(self) -> set[str | None]:
        """The levels (endpoint names, ``None`` for the pool) that learnt a sample since the
        last call: the ones worth sharing again."""
        learnt, self._learnt = self._learnt, set()
        return learnt

    def forget(self, endpoint: str) -> None:
        self._endpoints.pop(endpoint, None)

    def endpoints(self) -> Iterator[str]:
        return iter(self._endpoints)

    def sample_count(self, endpoint: str | None = None) -> float:
        """The decayed sample count of ``endpoint``'s level (``None``: the pool's)."""
        level = self._pool if endpoint is None else self._endpoints.get(endpoint)
        return level.count if level is not None else 0.0

    # sharing

    def export(self, endpoint: str | None = None) -> dict[str, object] | None:
        """The statistics of ``endpoint``'s level (``None``: the pool's) as plain numbers,
        or ``None`` when it has no samples."""
        level = self._pool if endpoint is None else self._endpoints.get(endpoint)
        if level is None or level.count <= 0.0:
            return None
        return {
            "n": level.count,
            "r": level.residual,
            "a": list(level.xtx),
            "b": list(level.xty),
        }

    def merge(self, endpoint: str | None, document: Mapping[str, object]) -> bool:
        """Adopts shared statistics for ``endpoint`` (``None``: the pool) while this
        process has fewer than ``min_samples`` of its own there: they are added to its own
        and the level refitted. Returns whether they were taken; a document that does not
        have the expected shape, or holds non-finite numbers, is ignored."""
        p = self._parameters
        parsed = _parse(document)
        if parsed is None:
            return False
        count, residual, xtx, xty = parsed
        if endpoint is None:
            level = self._pool
        else:
            level = self._endpoints.get(endpoint) or self._endpoints.setdefault(
                endpoint, _Level(self._pool.coef)
            )
        if level.count >= p.min_samples:
            return False
        for i in range(DIMENSION * DIMENSION):
            level.xtx[i] += xtx[i]
        for i in range(DIMENSION):
            level.xty[i] += xty[i]
        level.residual = max(level.residual, residual)
        level.count += count
        level.refit(p.prior if endpoint is None else self._pool.coef, p.prior_weight)
        return True


def _parse(document: Mapping[str, object]) -> tuple[float, float, list[float], list[float]] | None:
    count = document.get("n")
    residual = document.get("r")
    xtx = document.get("a")
    xty = document.get("b")
    if not isinstance(xtx, list) or not isinstance(xty, list):
        return None
    if len(xtx) != DIMENSION * DIMENSION or len(xty) != DIMENSION:
        return None
    numbers = [count, residual, *xtx, *xty]
    if not all(
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in numbers
    ):
        return None
    assert isinstance(count, int | float)
    assert isinstance(residual, int | float)
    if count <= 0 or residual < 0:
        return None
    return float(count), float(residual), [float(v) for v in xtx], [float(v) for v in xty]
