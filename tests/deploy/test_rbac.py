"""The EPP's ServiceAccount is granted exactly what its code calls, in every overlay.

The grants are derived from the code (``tests.support.manifests.code_grants``): a new
Kubernetes call in ``adapters/`` or ``app/`` (a Lease for leader election, a TokenReview for
metrics auth, ...) makes this test fail until the manifests grant it, and a grant no code
needs any more fails it too.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from typing import Any

import pytest
import yaml

from tests.support.manifests import (
    DYNAMIC_CALL_MODULES,
    OVERLAYS,
    Grant,
    bound_grants,
    code_grants,
    kube_calls,
)

Obj = Mapping[str, Any]
NOTIFICATION_SOURCE = "k8s-notification-source"


def _account(objects: list[Obj]) -> str:
    (deployment,) = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "my-pool-epp"
    ]
    return str(deployment["spec"]["template"]["spec"]["serviceAccountName"])


def _diff(granted: set[Grant], needed: set[Grant]) -> str:
    missing = "\n".join(f"  missing: {g}" for g in sorted(needed - granted))
    extra = "\n".join(f"  not needed by the code: {g}" for g in sorted(granted - needed))
    return "\n".join(part for part in (missing, extra) if part)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_epp_is_granted_exactly_what_its_code_calls(
    overlays: dict[str, list[Obj]], overlay: str
) -> None:
    objects = overlays[overlay]
    needed, _ = code_grants()
    granted = bound_grants(objects, _account(objects))
    # namespaced resources through a RoleBinding (never cluster-wide), cluster-scoped ones
    # (TokenReview, SubjectAccessReview) through a ClusterRoleBinding
    assert granted == needed, _diff(granted, needed)
    assert {o["kind"] for o in objects if "Binding" in o["kind"]} <= (
        {"RoleBinding", "ClusterRoleBinding"}
        if any(not g.namespaced for g in needed)
        else {"RoleBinding"}
    )


def test_cluster_wide_bindings_name_the_service_accounts_namespace(
    overlays: dict[str, list[Obj]],
) -> None:
    # the API server refuses a ClusterRoleBinding to a ServiceAccount without its namespace
    for overlay, objects in overlays.items():
        bindings = [o for o in objects if o["kind"] == "ClusterRoleBinding"]
        assert bindings, overlay
        for binding in bindings:
            for subject in binding["subjects"]:
                assert subject["kind"] != "ServiceAccount" or subject.get("namespace"), overlay


def test_what_the_code_needs_today() -> None:
    needed, sites = code_grants()
    read = {"list", "watch"}
    assert {Grant(True, "", "pods", verb) for verb in read} | {
        Grant(True, "inference.networking.k8s.io", "inferencepools", verb) for verb in read
    } <= (needed)
    # the pool is listed by a field selector on its name: what is watched is never read with
    # a get
    watched = {g.resource for g in needed if g.verb == "watch"}
    assert not any(g.verb == "get" and g.resource in watched for g in needed), sorted(needed)
    assert {s.module for s in sites} >= {"adapters.kubernetes.api"}


def test_only_the_notification_source_builds_request_paths_at_run_time() -> None:
    _, sites = code_grants()
    dynamic = {site.module for site in sites if site.dynamic}
    assert dynamic <= DYNAMIC_CALL_MODULES, (
        f"{dynamic - DYNAMIC_CALL_MODULES}: a request path built at run time; derive its "
        "grants in tests/support/manifests.py"
    )


def test_no_shipped_config_watches_a_kind_the_role_does_not_cover(
    overlays: dict[str, list[Obj]],
) -> None:
    # What k8s-notification-source watches is named in the EndpointPickerConfig, not in the
    # code: a shipped config using it needs its own grant (and this test, extending).
    for overlay, objects in overlays.items():
        for obj in objects:
            if obj["kind"] != "ConfigMap":
                continue
            for text in obj.get("data", {}).values():
                document = yaml.safe_load(text)
                if isinstance(document, dict) and document.get("kind") == "EndpointPickerConfig":
                    types = {p.get("type") for p in document.get("plugins", [])}
                    assert NOTIFICATION_SOURCE not in types, overlay


# --- the derivation itself, on code the EPP does not have (yet) ---------------------------


def _grants(source: str) -> set[Grant]:
    sites = kube_calls({"adapters.kubernetes.example": textwrap.dedent(source)})
    return {g for s in sites for g in s.grants}


def test_a_token_review_and_an_access_review_need_cluster_wide_create() -> None:
    assert _grants(
        """
        from kubernetes.client import AuthenticationV1Api, AuthorizationV1Api

        def review(client, token, sar):
            AuthenticationV1Api(client).create_token_review(token)
            AuthorizationV1Api(client).create_subject_access_review(sar)
        """
    ) == {
        Grant(False, "authentication.k8s.io", "tokenreviews", "create"),
        Grant(False, "authorization.k8s.io", "subjectaccessreviews", "create"),
    }


def test_leader_election_on_a_lease_needs_get_create_update_in_the_namespace() -> None:
    assert _grants(
        """
        from kubernetes.client import CoordinationV1Api

        def elect(client, ns, name, body):
            api = CoordinationV1Api(client)
            api.read_namespaced_lease(name, ns)
            api.create_namespaced_lease(ns, body)
            api.replace_namespaced_lease(name, ns, body)
        """
    ) == {
        Grant(True, "coordination.k8s.io", "leases", verb) for verb in ("get", "create", "update")
    }


def test_a_list_is_a_watch_only_where_the_call_asks_for_one() -> None:
    assert _grants(
        """
        from kubernetes.client import CoreV1Api

        def pods(client, ns):
            return CoreV1Api(client).list_namespaced_pod(ns)
        """
    ) == {Grant(True, "", "pods", "list")}
    assert _grants(
        """
        from kubernetes.client import CoreV1Api

        def pods(client, ns):
            return CoreV1Api(client).list_namespaced_pod(ns, watch=True)
        """
    ) == {Grant(True, "", "pods", "list"), Grant(True, "", "pods", "watch")}


def test_discovery_and_modules_without_the_client_need_nothing() -> None:
    assert (
        _grants(
            """
            from kubernetes.client import CustomObjectsApi

            def served(client):
                return CustomObjectsApi(client).get_api_resources("g", "v1")
            """
        )
        == set()
    )
    sites = kube_calls({"app.other": "def f(x):\n    return x.list_namespaced_pod('ns')\n"})
    assert sites == []
