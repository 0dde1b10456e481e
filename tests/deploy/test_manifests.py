"""Every kustomization renders with ``kubectl kustomize``, and every object it renders is valid:
built-in kinds against the Kubernetes schemas of each supported version (unknown fields are
errors, as with kubectl's strict field validation), custom resources against our CRDs'
schemas."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import yaml

from app.config.loader import DEFAULT_CONFIG
from tests.support.manifests import (
    ROOT,
    builtin_problems,
    custom_problems,
    custom_resource_schemas,
    structural_problems,
    supported_versions,
)

Obj = Mapping[str, Any]

#: What each overlay creates (generated names without their content hash).
EXPECTED = {
    "standalone": {
        "ServiceAccount/my-pool-epp",
        "Role/my-pool-epp",
        "RoleBinding/my-pool-epp",
        "ClusterRole/my-pool-epp-metrics-auth",
        "ClusterRoleBinding/my-pool-epp-metrics-auth",
        "ClusterRole/my-pool-epp-metrics-reader",
        "ConfigMap/my-pool-epp-config",
        "Service/my-pool-epp",
        "Deployment/my-pool-epp",
        "PodDisruptionBudget/my-pool-epp",
    },
}
EXPECTED["ha"] = EXPECTED["standalone"] | {
    "Secret/my-pool-epp-redis",
    "Deployment/my-pool-epp-redis",
    "Service/my-pool-epp-redis",
    "HorizontalPodAutoscaler/my-pool-epp",
    "NetworkPolicy/my-pool-epp-redis",
}
EXPECTED["gateway"] = EXPECTED["standalone"] | {
    "ConfigMap/my-pool-gateway-envoy",
    "Deployment/my-pool-gateway",
    "Service/my-pool-gateway",
    "NetworkPolicy/my-pool-epp-ext-proc",
}
_HASH = re.compile(r"-[a-z0-9]{10}$")


def _names(objects: list[Obj]) -> set[str]:
    names = set()
    for obj in objects:
        name = obj["metadata"]["name"]
        if obj["kind"] in ("ConfigMap", "Secret"):
            name = _HASH.sub("", name)
        names.add(f"{obj['kind']}/{name}")
    return names


@pytest.mark.parametrize("overlay", sorted(EXPECTED))
def test_each_overlay_renders_the_objects_it_documents(
    overlays: dict[str, list[Obj]], overlay: str
) -> None:
    assert _names(overlays[overlay]) == EXPECTED[overlay]
    assert len(overlays[overlay]) == len(EXPECTED[overlay])


def test_the_crds_and_examples_render(crds: list[Obj], examples: list[Obj]) -> None:
    assert {o["metadata"]["name"] for o in crds} == {
        "inferencepools.inference.networking.k8s.io",
        "inferenceobjectives.inference.networking.x-k8s.io",
        "inferencemodelrewrites.inference.networking.x-k8s.io",
    }
    assert _names(examples) == {
        "InferencePool/my-pool",
        "InferenceObjective/interactive",
        "InferenceObjective/batch",
        "InferenceModelRewrite/my-model-canary",
    }


def test_supported_versions_span_the_oldest_supported_to_the_newest_known() -> None:
    versions = supported_versions()
    assert versions[0] == "1.29.0"
    assert len(versions) >= 5, versions


def test_every_built_in_object_is_valid_for_the_oldest_and_newest_supported_version(
    overlays: dict[str, list[Obj]], crds: list[Obj]
) -> None:
    # A field valid in both the oldest and the newest is valid in between: Kubernetes adds
    # fields to its stable kinds, it does not remove and re-add them. (Every version takes
    # 0.1-0.2 s of CPU here.)
    unique = {json.dumps(o, sort_keys=True): o for objs in overlays.values() for o in objs}
    objects = [*unique.values(), *crds]
    versions = supported_versions()
    problems = []
    for version in (versions[0], versions[-1]):
        for obj in objects:
            found = builtin_problems(obj, version)
            assert found is not None, f"{version}: no schema for {obj['kind']}"
            problems += [f"{version} {obj['kind']}/{obj['metadata']['name']}: {p}" for p in found]
    assert problems == []


def test_a_misspelt_field_is_caught(overlays: dict[str, list[Obj]]) -> None:
    (deployment,) = [
        o
        for o in overlays["standalone"]
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "my-pool-epp"
    ]
    broken: dict[str, Any] = copy.deepcopy(dict(deployment))
    broken["spec"]["template"]["spec"]["terminationGracePeriod"] = 130
    assert builtin_problems(broken, supported_versions()[-1])


def test_the_crds_are_structural(crds: list[Obj]) -> None:
    for crd in crds:
        for version in crd["spec"]["versions"]:
            schema = version["schema"]["openAPIV3Schema"]
            assert structural_problems(schema) == [], crd["metadata"]["name"]


def test_every_custom_resource_matches_its_crd_schema(crds: list[Obj], examples: list[Obj]) -> None:
    schemas = custom_resource_schemas(crds)
    assert set(schemas) == {
        ("inference.networking.k8s.io/v1", "InferencePool"),
        ("inference.networking.x-k8s.io/v1alpha2", "InferenceObjective"),
        ("inference.networking.x-k8s.io/v1alpha2", "InferenceModelRewrite"),
    }
    for obj in examples:
        schema = schemas[(obj["apiVersion"], obj["kind"])]
        assert custom_problems(obj, schema) == [], obj["metadata"]["name"]


def test_the_crd_schemas_refuse_what_the_api_server_would(
    crds: list[Obj], examples: list[Obj]
) -> None:
    schemas = custom_resource_schemas(crds)
    (pool,) = [o for o in examples if o["kind"] == "InferencePool"]
    schema = schemas[(pool["apiVersion"], pool["kind"])]
    changes: list[tuple[Callable[[dict[str, Any]], None], str]] = [
        (lambda p: p["spec"].update(targetPorts=[]), "spec/targetPorts"),
        (lambda p: p["spec"].update(targetPorts=[{"number": n} for n in range(1, 10)]), "spec"),
        (lambda p: p["spec"]["endpointPickerRef"].update(failureMode="Open"), "failureMode"),
        (lambda p: p["spec"].update(selectr={}), "spec"),
    ]
    for change, where in changes:
        broken: dict[str, Any] = copy.deepcopy(dict(pool))
        change(broken)
        problems = custom_problems(broken, schema)
        assert problems, where
        assert any(where in p for p in problems), problems


def test_the_base_config_is_the_built_in_default() -> None:
    """deploy/kubernetes/base/epp-config.yaml says it is the default profile written out."""
    shipped = yaml.safe_load((ROOT / "deploy/kubernetes/base/epp-config.yaml").read_text())
    assert shipped.pop("apiVersion") == "inference.networking.x-k8s.io/v1alpha1"
    assert shipped.pop("kind") == "EndpointPickerConfig"
    assert shipped == DEFAULT_CONFIG
