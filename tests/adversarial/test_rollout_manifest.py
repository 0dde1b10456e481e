"""Finding: the shipped Deployment allowed 130 s to terminate, but the EPP it starts drained
for its default 30 s only (the manifest did not pass ``--shutdown-grace-period``), so a
rollout cut in-flight generations after 30 s while Kubernetes would have waited 130 s.

The manifest now passes the grace period, and Kubernetes' ``terminationGracePeriodSeconds``
must exceed it by the time the EPP needs after draining (the trace flush, then exit).
This reads the base Deployment; tests/deploy/test_operator_checks.py checks the same in every
rendered overlay.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from app.cli import parse_settings
from app.observability import TRACE_FLUSH_TIMEOUT

MANIFEST = (
    Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "base" / "deployment.yaml"
)
#: After the drain: the trace flush (bounded by TRACE_FLUSH_TIMEOUT + 1 s) and the exit.
AFTER_DRAIN_SECONDS = TRACE_FLUSH_TIMEOUT + 1 + 3


def _deployment() -> dict[str, Any]:
    for document in yaml.safe_load_all(MANIFEST.read_text()):
        if document and document.get("kind") == "Deployment":
            return dict(document)
    raise AssertionError(f"no Deployment in {MANIFEST}")


def _epp_args(pod: dict[str, Any]) -> list[str]:
    (container,) = [c for c in pod["containers"] if c["name"] == "epp"]
    # the config file exists only in the pod (its mount is checked in tests/deploy)
    args = [str(arg) for arg in container["args"] if not str(arg).startswith("--config-file")]
    return [arg.replace("$(NAMESPACE)", "default") for arg in args]


def test_kubernetes_waits_longer_than_the_epp_drains() -> None:
    pod = _deployment()["spec"]["template"]["spec"]
    args = _epp_args(pod)
    # the flag is given explicitly, so a change of its default cannot break the rollout
    assert any(arg.startswith("--shutdown-grace-period") for arg in args), args
    grace = parse_settings(args).shutdown_grace_period
    termination = pod["terminationGracePeriodSeconds"]
    # before: grace 30 s (the default) against 130 s; after: 120 s against 130 s
    assert grace >= 60, f"in-flight generations get only {grace}s on a rollout"
    assert termination >= grace + AFTER_DRAIN_SECONDS, (termination, grace)
