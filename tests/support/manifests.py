"""The Kubernetes manifests under ``deploy/kubernetes``: rendered, and what the code needs of them.

- ``render(directory)``: the objects ``kubectl kustomize`` renders for a kustomization
  (Debian's ``kubectl``; ``make install`` installs it when missing).
- ``code_grants()``: the RBAC grants the EPP's own Kubernetes API calls need, derived from the
  code: every call in ``adapters/`` and ``app/`` (modules that import ``kubernetes``) of a
  method of the ``kubernetes`` client's API classes is looked up in the client's generated
  source for its HTTP method and path, which give the resource, its scope and the verb.
  Generic custom-object calls (``{group}``/``{plural}`` in the path) stand for every
  ``ResourceType`` the Kubernetes adapter defines. Discovery paths need no grant (every
  authenticated client may read them).
- ``gateway_envoy_text()``: the Envoy config of the ``gateway`` overlay, generated from
  ``deploy/envoy/envoy.yaml`` with only the EPP address changed;
  ``python -m tests.support.manifests --write`` rewrites it.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import inspect
import pkgutil
import re
import shutil
import subprocess
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "CODE_PACKAGES",
    "DYNAMIC_CALL_MODULES",
    "ENVOY_SOURCE",
    "GATEWAY_ENVOY",
    "KUBERNETES",
    "OVERLAYS",
    "ROOT",
    "CallSite",
    "Grant",
    "bound_grants",
    "code_grants",
    "gateway_envoy_text",
    "kube_calls",
    "kubectl",
    "render",
]

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("standalone", "ha", "gateway")
ENVOY_SOURCE = ROOT / "deploy" / "envoy" / "envoy.yaml"
GATEWAY_ENVOY = KUBERNETES / "overlays" / "gateway" / "envoy.yaml"
#: The packages whose Kubernetes calls the EPP makes.
CODE_PACKAGES = ("adapters", "app")
#: Modules allowed to build request paths at run time (not derivable from the code): the
#: ``k8s-notification-source`` plugin watches a kind named in the EndpointPickerConfig, so
#: what it needs is checked against the configs instead.
DYNAMIC_CALL_MODULES = frozenset({"adapters.kubernetes.notification_source"})

#: The EPP address in deploy/envoy/envoy.yaml, and what the gateway overlay's copy says.
_EPP_ADDRESS_LINE = "socket_address: {address: 127.0.0.1, port_value: 9002}"
_EPP_SERVICE_LINE = "socket_address: {address: my-pool-epp, port_value: 9002}"
_GENERATED_HEADER = (
    "# GENERATED from deploy/envoy/envoy.yaml by `python -m tests.support.manifests --write`:\n"
    "# edit that file, not this one. Only the EPP address differs: the EPP Service of this\n"
    "# namespace (my-pool-epp:9002) instead of 127.0.0.1:9002.\n"
)


def kubectl() -> str:
    """The ``kubectl`` binary, or an error saying how to get it."""
    path = shutil.which("kubectl")
    if path is None:
        raise RuntimeError(
            "kubectl is not on PATH: `make install` installs Debian's kubernetes-client "
            "package (apt-get install -y kubernetes-client, as root), or put any kubectl on PATH"
        )
    return path


@functools.cache
def _render(directory: Path) -> tuple[Mapping[str, Any], ...]:
    result = subprocess.run(
        [kubectl(), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory} failed:\n{result.stderr}")
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


def render(directory: Path) -> list[Mapping[str, Any]]:
    """The objects ``kubectl kustomize directory`` prints (cached per directory)."""
    return list(_render(directory.resolve()))


def gateway_envoy_text() -> str:
    """What ``overlays/gateway/envoy.yaml`` must hold, from ``deploy/envoy/envoy.yaml``."""
    source = ENVOY_SOURCE.read_text()
    if source.count(_EPP_ADDRESS_LINE) != 1:
        raise AssertionError(
            f"{ENVOY_SOURCE}: expected the EPP address `{_EPP_ADDRESS_LINE}` exactly once"
        )
    return _GENERATED_HEADER + source.replace(_EPP_ADDRESS_LINE, _EPP_SERVICE_LINE)


# --- RBAC derived from the code -------------------------------------------------------------


@dataclass(frozen=True, slots=True, order=True)
class Grant:
    """One verb on one resource; ``namespaced`` False for cluster-scoped resources."""

    namespaced: bool
    group: str
    resource: str
    verb: str

    def __str__(self) -> str:
        scope = "namespaced" if self.namespaced else "cluster"
        return f"{self.verb} {self.resource}.{self.group or 'core'} ({scope})"


@dataclass(frozen=True, slots=True)
class CallSite:
    """A Kubernetes client call in the code, and the grants it needs."""

    module: str
    line: int
    method: str
    grants: frozenset[Grant]
    dynamic: bool = False


_SERIALIZED = re.compile(r"method='(?P<method>\w+)',\s*resource_path='(?P<path>[^']+)'")
_LEGACY = re.compile(r"call_api\(\s*'(?P<path>[^']+)',\s*'(?P<method>\w+)'")
_DISCOVERY = re.compile(r"^/(api/v1|apis/[^/]+/[^/]+|api|apis|apis/[^/]+|version)/?$")
_VERBS = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}


@functools.cache
def _api_class(name: str) -> type | None:
    """The ``kubernetes`` client's API class ``name`` (``CoreV1Api``, ...), if it is one."""
    if not name.endswith("Api") or name == "ApiClient":
        return None
    value = getattr(importlib.import_module("kubernetes.client"), name, None)
    return value if isinstance(value, type) else None


@functools.cache
def _client_endpoints(name: str, classes: tuple[type, ...]) -> frozenset[tuple[str, str]] | None:
    """The (HTTP method, path)s of the methods called ``name`` of the API ``classes``, read
    from the client's generated source; None when none of them has a request method so named.
    """
    found: set[tuple[str, str]] = set()
    known = False
    for cls in classes:
        if not callable(getattr(cls, f"{name}_with_http_info", None)):
            continue
        known = True
        for attribute, pattern in (
            (f"_{name}_serialize", _SERIALIZED),
            (f"{name}_with_http_info", _LEGACY),
        ):
            function = getattr(cls, attribute, None)
            match = pattern.search(inspect.getsource(function)) if function else None
            if match is not None:
                found.add((match["method"], match["path"]))
                break
        else:
            raise AssertionError(f"cannot read the request of {cls.__name__}.{name}")
    return frozenset(found) if known else None


@functools.cache
def _custom_resources() -> frozenset[tuple[str, str]]:
    """(group, plural) of every ``ResourceType`` the Kubernetes adapter defines."""
    api = importlib.import_module("adapters.kubernetes.api")
    package = importlib.import_module("adapters.kubernetes")
    found: set[tuple[str, str]] = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, api.ResourceType) and value.group:
                found.add((value.group, value.plural))
    return frozenset(found)


def _grants_for(http_method: str, path: str, *, watch: bool) -> set[Grant]:
    """The grants one request needs; empty for discovery (non-resource) paths."""
    if _DISCOVERY.match(path):
        return set()
    parts = path.strip("/").split("/")
    if parts[0] == "api":
        groups, rest = [""], parts[2:]
    elif parts[0] == "apis":
        groups, rest = [parts[1]], parts[3:]
    else:
        raise AssertionError(f"not a Kubernetes API path: {path}")
    if rest and rest[0] == "watch":
        rest, watch = rest[1:], True
    namespaced = len(rest) >= 3 and rest[0] == "namespaces" and rest[1] == "{namespace}"
    if namespaced:
        rest = rest[2:]
    resource, item = rest[0], len(rest) > 1
    if len(rest) > 2:
        resource = f"{resource}/{rest[2]}"
    if http_method == "GET" and not item:
        verbs = {"list", "watch"} if watch else {"list"}
    elif http_method == "DELETE" and not item:
        verbs = {"deletecollection"}
    else:
        verbs = {_VERBS[http_method]}
    pairs = [(g, resource) for g in groups]
    if "{group}" in groups or resource.startswith("{plural}"):
        suffix = resource.removeprefix("{plural}")
        pairs = [(g, plural + suffix) for g, plural in sorted(_custom_resources())]
    return {Grant(namespaced, g, r, v) for g, r in pairs for v in verbs}


def _product_modules(packages: Iterable[str]) -> Iterator[tuple[str, Path]]:
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).with_suffix("")
            parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
            yield ".".join(parts), path


def _imported_api_classes(tree: ast.Module) -> tuple[type, ...]:
    """The client API classes a module imports (``from kubernetes.client import CoreV1Api``;
    ``import kubernetes`` counts as all the classes it names as ``client.XxxApi``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kubernetes"):
            names |= {a.name for a in node.names}
        if isinstance(node, ast.Attribute) and node.attr.endswith("Api"):
            names.add(node.attr)
    if not any(
        isinstance(node, ast.Import | ast.ImportFrom)
        and any(
            (getattr(node, "module", None) or a.name).split(".")[0] == "kubernetes"
            for a in node.names
        )
        for node in ast.walk(tree)
    ):
        return ()
    classes = (_api_class(name) for name in sorted(names))
    return tuple(cls for cls in classes if cls is not None)


def _functions(tree: ast.Module) -> Iterator[tuple[ast.AST, ast.AST]]:
    """(node, its innermost enclosing function, or the module) for every node."""
    stack: list[tuple[ast.AST, ast.AST]] = [(tree, tree)]
    while stack:
        node, scope = stack.pop()
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else scope
            yield child, inner
            stack.append((child, inner))


def _may_watch(scope: ast.AST) -> bool:
    """Whether the function passes ``watch``: a ``watch`` name, keyword or option key."""
    for node in ast.walk(scope):
        if isinstance(node, ast.Name | ast.arg) and getattr(node, "id", None) == "watch":
            return True
        if isinstance(node, ast.arg) and node.arg == "watch":
            return True
        if isinstance(node, ast.keyword) and node.arg == "watch":
            return True
        if isinstance(node, ast.Constant) and node.value == "watch":
            return True
    return False


def kube_calls(sources: Mapping[str, str]) -> list[CallSite]:
    """The Kubernetes client calls in ``sources`` (module name to its text)."""
    sites: list[CallSite] = []
    for module, text in sources.items():
        tree = ast.parse(text)
        classes = _imported_api_classes(tree)
        if not classes:
            continue
        for node, scope in _functions(tree):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            name = node.func.attr
            if name in ("param_serialize", "call_api"):
                sites.append(CallSite(module, node.lineno, name, frozenset(), dynamic=True))
                continue
            endpoints = _client_endpoints(name, classes)
            if endpoints is None:
                continue
            watch = _may_watch(scope)
            grants: set[Grant] = set()
            for http_method, path in endpoints:
                grants |= _grants_for(http_method, path, watch=watch)
            sites.append(CallSite(module, node.lineno, name, frozenset(grants)))
    return sites


def code_grants(packages: Iterable[str] = CODE_PACKAGES) -> tuple[set[Grant], list[CallSite]]:
    """The grants the code's static calls need, and every call site found."""
    sites = _code_sites(tuple(packages))
    return {g for site in sites for g in site.grants}, list(sites)


@functools.cache
def _code_sites(packages: tuple[str, ...]) -> tuple[CallSite, ...]:
    sources = {module: path.read_text() for module, path in _product_modules(packages)}
    return tuple(kube_calls(sources))


def _rule_grants(rule: Mapping[str, Any], *, namespaced: bool) -> set[Grant]:
    for key in ("apiGroups", "resources", "verbs"):
        if "*" in rule.get(key, []):
            raise AssertionError(f"a wildcard in an RBAC rule: {rule}")
    if rule.get("resourceNames") or rule.get("nonResourceURLs"):
        raise AssertionError(f"rule form not understood by this check: {rule}")
    return {
        Grant(namespaced, group, resource, verb)
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def bound_grants(objects: Iterable[Mapping[str, Any]], account: str) -> set[Grant]:
    """What the ServiceAccount ``account`` is granted by the rendered objects.

    A RoleBinding grants its Role's (or ClusterRole's) rules in the namespace; a
    ClusterRoleBinding grants its ClusterRole's rules cluster-wide, reported as cluster-scoped
    grants (so a namespaced resource granted that way shows up as too much).
    """
    objects = list(objects)
    roles = {
        (o["kind"], o["metadata"]["name"]): o
        for o in objects
        if o["kind"] in ("Role", "ClusterRole")
    }
    granted: set[Grant] = set()
    for binding in objects:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        subjects = binding.get("subjects", [])
        if not any(s.get("kind") == "ServiceAccount" and s["name"] == account for s in subjects):
            continue
        ref = binding["roleRef"]
        role = roles.get((ref["kind"], ref["name"]))
        if role is None:
            raise AssertionError(f"{binding['kind']} {binding['metadata']['name']}: no {ref}")
        namespaced = binding["kind"] == "RoleBinding"
        for rule in role.get("rules", []):
            granted |= _rule_grants(rule, namespaced=namespaced)
    return granted


# --- schemas ---------------------------------------------------------------------------------

#: The oldest Kubernetes minor the manifests support: gRPC probes (GA 1.27), CRD validation
#: rules (GA 1.29), autoscaling/v2, policy/v1.
OLDEST_SUPPORTED = (1, 29)


def supported_versions() -> list[str]:
    """The Kubernetes versions whose schemas ``kubernetes-validate`` ships, oldest supported on."""
    from kubernetes_validate import utils

    versions = sorted(set(utils.all_versions()), key=lambda v: tuple(int(x) for x in v.split(".")))
    return [v for v in versions if tuple(int(x) for x in v.split(".")[:2]) >= OLDEST_SUPPORTED]


def builtin_problems(obj: Mapping[str, Any], version: str) -> list[str] | None:
    """Schema errors of a built-in kind for ``version`` (strict: unknown fields are errors);
    None when the version has no schema for the kind (a custom resource)."""
    from kubernetes_validate import utils
    from kubernetes_validate import validate as k8s_validate

    try:
        k8s_validate(dict(obj), version, strict=True)
    except utils.SchemaNotFoundError:
        return None
    except utils.ValidationError as error:
        return [str(error.message)]
    return []


def structural_problems(schema: Mapping[str, Any], path: str = "") -> list[str]:
    """Where a CRD schema is not structural (Kubernetes refuses those): a node without a type,
    or a $ref."""
    problems: list[str] = []
    if "$ref" in schema:
        problems.append(f"{path or '/'}: $ref")
    if "type" not in schema and not (
        schema.get("x-kubernetes-int-or-string")
        or schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        problems.append(f"{path or '/'}: no type")
    for name, sub in schema.get("properties", {}).items():
        problems += structural_problems(sub, f"{path}/{name}")
    if isinstance(schema.get("items"), Mapping):
        problems += structural_problems(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), Mapping):
        problems += structural_problems(schema["additionalProperties"], f"{path}/*")
    return problems


def _closed(schema: Mapping[str, Any]) -> dict[str, Any]:
    """The schema with unknown fields refused where the API server would refuse them (strict
    field validation, kubectl's default): objects with properties and no escape hatch."""
    result = dict(schema)
    if "properties" in schema:
        result["properties"] = {k: _closed(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            result["additionalProperties"] = False
    if isinstance(schema.get("items"), Mapping):
        result["items"] = _closed(schema["items"])
    if isinstance(schema.get("additionalProperties"), Mapping):
        result["additionalProperties"] = _closed(schema["additionalProperties"])
    return result


def custom_resource_schemas(
    crds: Iterable[Mapping[str, Any]],
) -> dict[tuple[str, str], Mapping[str, Any]]:
    """(apiVersion, kind) to the JSON schema of every served version of the CRDs."""
    schemas: dict[tuple[str, str], Mapping[str, Any]] = {}
    for crd in crds:
        spec = crd["spec"]
        for version in spec["versions"]:
            if version.get("served"):
                key = (f"{spec['group']}/{version['name']}", spec["names"]["kind"])
                schemas[key] = _closed(version["schema"]["openAPIV3Schema"])
    return schemas


def custom_problems(obj: Mapping[str, Any], schema: Mapping[str, Any]) -> list[str]:
    """Errors of a custom resource against its CRD's schema."""
    import jsonschema

    validator = jsonschema.Draft7Validator(schema)
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '/'}: {e.message}"
        for e in validator.iter_errors(dict(obj))
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write", action="store_true", help=f"rewrite {GATEWAY_ENVOY.relative_to(ROOT)}"
    )
    parser.add_argument("--grants", action="store_true", help="print the code's RBAC needs")
    args = parser.parse_args()
    if args.write:
        GATEWAY_ENVOY.write_text(gateway_envoy_text())
        print(f"wrote {GATEWAY_ENVOY.relative_to(ROOT)}")
    if args.grants:
        grants, sites = code_grants()
        for site in sites:
            print(f"{site.module}:{site.line} {site.method}: " + ", ".join(map(str, site.grants)))
        for grant in sorted(grants):
            print(grant)


if __name__ == "__main__":
    main()
