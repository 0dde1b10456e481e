"""Micro-benchmark (not a test): what one relayed model-server poll costs under ``--workers``.

The supervisor polls each model server once for the pod and relays the result to every
worker. Two ways, on the ~11 KB vLLM fixture whose load gauges change on every poll:

- **raw**: the supervisor pickles the ``MetricsText`` body into a frame; each worker
  unpickles it and runs ``core-metrics-extractor`` on it (what every worker did before
  snapshots);
- **snapshot**: the supervisor's extractor has run anyway (it is the one that polls); it
  encodes the resulting ``EndpointMetrics`` as a ``MetricsSnapshot`` frame; each worker
  decodes it and installs it (``app.metrics_relay``).

Prints CPU µs per poll (this thread's CPU time, the best of several rounds) on each side,
the frame sizes, and what a pod of N workers spends on it at the default scrape rate for
3 and 100 endpoints (one poll every 50 ms each).

    .venv/bin/python -m tests.bench.worker_relay [--rounds 7] [--number 2000] [--workers 2]
"""

from __future__ import annotations

import argparse
import itertools

from adapters.workerlink.frames import decode_message, encode_frame, encode_snapshot_frame
from app.metrics_relay import RelayedMetricsExtractor, snapshot_of
from domain.datalayer.plugins.core_metrics_extractor import (
    TYPE,
    CoreMetricsExtractor,
    CoreMetricsExtractorParameters,
)
from domain.plugins.base import TypedName
from ports.datalayer import MetricsText
from tests.bench.metrics_parse import FIXTURE, best_us, varying_bodies
from tests.support.scheduling import endpoint

SOURCE = "metrics-data-source/metrics-data-source"
NAME = "10.0.0.1:8000"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    rounds, number = args.rounds, args.number

    extractor = CoreMetricsExtractor(TypedName(TYPE, TYPE), CoreMetricsExtractorParameters())
    texts = [
        MetricsText(body=b, fetched_at=0.0) for b in varying_bodies(FIXTURE.read_bytes(), 5000)
    ]
    supervisor_side = endpoint(NAME)
    snapshots = []
    for text in texts[:500]:
        extractor.extract(text, supervisor_side, 1.0)
        assert supervisor_side.metrics is not None
        snapshots.append(supervisor_side.metrics)
    raw_frames = itertools.cycle([encode_frame(("poll", SOURCE, NAME, t)) for t in texts])
    snap_frames = itertools.cycle(
        [encode_snapshot_frame(SOURCE, NAME, snapshot_of(m)) for m in snapshots]
    )
    texts_cycle = itertools.cycle(texts)
    metrics_cycle = itertools.cycle(snapshots)
    worker_side = endpoint(NAME)
    applier = RelayedMetricsExtractor(SOURCE)

    def raw_send() -> None:
        encode_frame(("poll", SOURCE, NAME, next(texts_cycle)))

    def snapshot_send() -> None:
        encode_snapshot_frame(SOURCE, NAME, snapshot_of(next(metrics_cycle)))

    def raw_receive() -> None:
        message = decode_message(next(raw_frames)[4:])
        assert isinstance(message, tuple)
        extractor.extract(message[3], worker_side, 1.0)

    def snapshot_receive() -> None:
        message = decode_message(next(snap_frames)[4:])
        assert isinstance(message, tuple)
        applier.extract(message[3], worker_side, 1.0)

    results = {
        ("raw", "supervisor"): best_us(raw_send, rounds, number),
        ("raw", "worker"): best_us(raw_receive, rounds, number),
        ("snapshot", "supervisor"): best_us(snapshot_send, rounds, number),
        ("snapshot", "worker"): best_us(snapshot_receive, rounds, number),
    }
    sizes = {
        "raw": len(encode_frame(("poll", SOURCE, NAME, texts[0]))),
        "snapshot": len(encode_snapshot_frame(SOURCE, NAME, snapshot_of(snapshots[0]))),
    }
    print(f"per relayed poll, CPU µs (best of {rounds} x {number}), {args.workers} workers:")
    print(f"  {'relay':<9}{'frame B':>9}{'supervisor':>12}{'each worker':>13}{'pod':>9}")
    for mode in ("raw", "snapshot"):
        send, receive = results[(mode, "supervisor")], results[(mode, "worker")]
        pod = send + args.workers * receive
        print(f"  {mode:<9}{sizes[mode]:>9}{send:>12.1f}{receive:>13.1f}{pod:>9.1f}")
        for endpoints in (3, 100):
            share = pod * endpoints * 20 / 1e6
            print(f"    {endpoints} endpoints every 50 ms: {share:.2%} of one core")
    print("(the supervisor's own extract is the same either way and is not counted)")


if __name__ == "__main__":
    main()
