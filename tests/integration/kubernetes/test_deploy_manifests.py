"""The manifests in deploy/kubernetes grant what discovery watches, no more, and fit together."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from adapters.kubernetes.api import (
    INFERENCE_MODEL_REWRITES,
    INFERENCE_OBJECTIVES,
    INFERENCE_POOLS_V1,
    LLMD_INFERENCE_MODEL_REWRITES,
    LLMD_INFERENCE_OBJECTIVES,
    PODS,
)

DEPLOY = Path(__file__).resolve().parents[3] / "deploy" / "kubernetes"


def load(name: str) -> dict[str, dict[str, Any]]:
    """The documents of one manifest file, by kind."""
    documents = [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]
    by_kind = {d["kind"]: d for d in documents}
    assert len(by_kind) == len(documents)
    return by_kind


@pytest.fixture(scope="module")
def rbac() -> dict[str, dict[str, Any]]:
    return load("rbac.yaml")


@pytest.fixture(scope="module")
def epp() -> dict[str, dict[str, Any]]:
    return load("epp.yaml")


def test_the_role_grants_read_access_to_what_discovery_watches_and_nothing_else(
    rbac: dict[str, dict[str, Any]],
) -> None:
    granted = set()
    for rule in rbac["Role"]["rules"]:
        assert sorted(rule["verbs"]) == ["get", "list", "watch"]
        assert set(rule) == {"apiGroups", "resources", "verbs"}
        granted |= {(g, r) for g in rule["apiGroups"] for r in rule["resources"]}
    watched = {
        (resource.group, resource.plural)
        for resource in (
            PODS,
            INFERENCE_POOLS_V1,
            INFERENCE_OBJECTIVES,
            INFERENCE_MODEL_REWRITES,
            LLMD_INFERENCE_OBJECTIVES,
            LLMD_INFERENCE_MODEL_REWRITES,
        )
    }
    assert granted == watched
    assert set(rbac) == {"ServiceAccount", "Role", "RoleBinding"}  # nothing cluster-wide


def test_the_deployment_runs_as_the_bound_service_account(
    rbac: dict[str, dict[str, Any]], epp: dict[str, dict[str, Any]]
) -> None:
    binding = rbac["RoleBinding"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": rbac["Role"]["metadata"]["name"],
    }
    account = rbac["ServiceAccount"]["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert epp["Deployment"]["spec"]["template"]["spec"]["serviceAccountName"] == account


def test_the_epp_serves_the_pool_on_the_reference_ports_with_grpc_probes(
    epp: dict[str, dict[str, Any]],
) -> None:
    pod_spec = epp["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod_spec["containers"]
    assert "--pool-name=my-pool" in container["args"]
    assert "--pool-namespace=$(NAMESPACE)" in container["args"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "grpc": 9002,
        "grpc-health": 9003,
        "metrics": 9090,
    }
    assert container["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {"NAMESPACE": "metadata.namespace", "POD_NAME": "metadata.name"}


def test_the_pool_points_at_the_epp_service(epp: dict[str, dict[str, Any]]) -> None:
    pool = load("inferencepool.yaml")["InferencePool"]
    service = epp["Service"]
    pod_labels = epp["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == service["metadata"]["name"]
    assert ref["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}
    assert pool["apiVersion"] == f"{INFERENCE_POOLS_V1.group}/{INFERENCE_POOLS_V1.version}"
    assert pool["metadata"]["name"] == "my-pool"
