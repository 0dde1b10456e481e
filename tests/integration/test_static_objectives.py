"""``--static-objectives``: InferenceObjective and InferenceModelRewrite manifests from a file.

What the file says reaches the domain's ``ObjectiveStore`` (priorities by objective name,
model rewrites); a file that cannot be used stops the process at start-up, with a message
naming the file, the document and the problem.
"""

from __future__ import annotations

import random
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from app.cli import parse_settings
from app.config.decoding import MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH
from app.static_objectives import StaticObjectivesError, load_static_objectives
from domain.datastore.objectives import ObjectiveStore
from ports.objectives import ModelRewriteRule, ModelRewriteTarget
from tests.support.kube_api import RecordingSink

MANIFESTS = """\
# Applied to a cluster, the same documents would configure the pool "pool".
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata:
  name: batch
spec:
  priority: -1
  poolRef: {name: pool}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata:
  name: chat
spec:
  priority: 10
  poolRef: {name: pool}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata:
  name: unprioritised
spec:
  poolRef: {name: pool}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModelRewrite
metadata:
  name: food
  creationTimestamp: "2025-01-02T03:04:05Z"
spec:
  poolRef: {name: pool}
  rules:
  - matches:
    - model: {type: Exact, value: food-review}
    - model: {value: food-review-latest}
    targets:
    - {modelRewrite: food-review-1, weight: 90}
    - {modelRewrite: food-review-2, weight: 10}
  - targets:
    - {modelRewrite: base-model}
---
"""


@pytest.fixture
def manifests(tmp_path: Path) -> Path:
    path = tmp_path / "objectives.yaml"
    path.write_text(MANIFESTS)
    return path


def test_priorities_and_rewrites_reach_the_objective_store(manifests: Path) -> None:
    store = ObjectiveStore()
    assert load_static_objectives(manifests, store) == (3, 3)
    assert store.priority_of("batch") == -1
    assert store.priority_of("chat") == 10
    assert store.priority_of("unprioritised") == 0
    assert store.priority_of("not-in-the-file") == 0

    rng = random.Random(7)
    chosen = [store.rewrite("food-review", rng) for _ in range(200)]
    targets = [target for _, target in (c for c in chosen if c is not None)]
    assert len(targets) == 200
    assert {c[0] for c in chosen if c is not None} == {"food"}
    assert set(targets) == {"food-review-1", "food-review-2"}
    assert targets.count("food-review-1") > 150  # weights 90:10
    assert store.rewrite("food-review-latest", rng) in {
        ("food", "food-review-1"),
        ("food", "food-review-2"),
    }
    # The rule without matches applies to every other model.
    assert store.rewrite("some-other-model", rng) == ("food", "base-model")


def test_rules_keep_the_manifest_order_and_creation_time(manifests: Path) -> None:
    sink = RecordingSink()
    load_static_objectives(manifests, sink)
    assert sink.objectives == {"batch": -1, "chat": 10, "unprioritised": None}
    created = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC).timestamp()
    food = (
        ModelRewriteTarget(model="food-review-1", weight=90),
        ModelRewriteTarget(model="food-review-2", weight=10),
    )
    assert sink.rules == (
        ModelRewriteRule(name="food", match="food-review", targets=food, created=created),
        ModelRewriteRule(name="food", match="food-review-latest", targets=food, created=created),
        ModelRewriteRule(
            name="food",
            match="",
            targets=(ModelRewriteTarget(model="base-model", weight=1),),
            created=created,
            order=1,
        ),
    )


def test_a_file_without_documents_sets_no_objectives_and_no_rules(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing yet\n---\n")
    sink = RecordingSink()
    assert load_static_objectives(path, sink) == (0, 0)
    assert (sink.objectives, sink.rules) == ({}, ())


_OBJECTIVE = """\
kind: InferenceObjective
metadata: {name: batch}
spec: {priority: -1}
"""

BAD_FILES = [
    pytest.param(
        _OBJECTIVE + "---\nkind: InferencePool\nmetadata: {name: pool}\n",
        "document 2: kind 'InferencePool' is not InferenceObjective or InferenceModelRewrite",
        id="other-kind",
    ),
    pytest.param(
        _OBJECTIVE + "---\nkind: InferenceObjective\nmetadata: {}\nspec: {priority: 1}\n",
        "document 2: metadata.name is required",
        id="no-name",
    ),
    pytest.param(
        _OBJECTIVE + "---\nkind: InferenceObjective\nmetadata: {name: x}\nspec: {priority: high}\n",
        "document 2 (x): spec.priority must be an integer, not 'high'",
        id="priority-not-integer",
    ),
    pytest.param(
        _OBJECTIVE + "---\nkind: Service\nmetadata: {}\n",
        "document 2: kind 'Service' is not InferenceObjective or InferenceModelRewrite",
        id="other-kind-without-name",
    ),
    pytest.param(
        "- kind: InferenceObjective\n",
        "document 1: not a mapping",
        id="a-list",
    ),
    pytest.param(
        _OBJECTIVE + "---\nkind: InferenceObjective\nmetadata: {name: [oops\n",
        "line 6",
        id="invalid-yaml",
    ),
]


#: 10 KB of nested YAML lists: composed recursively, deeper than the interpreter's stack.
NESTED = "kind: " + "[" * 5000 + "]" * 5000 + "\n"
#: A usable file padded with comments past the size limit (a ConfigMap's 1 MiB).
OVERSIZED = _OBJECTIVE + "#" * MAX_CONFIG_BYTES + "\n"
LIMITS = [
    pytest.param(NESTED, f"nested deeper than {MAX_CONFIG_DEPTH} levels", id="nested"),
    pytest.param(OVERSIZED, f"more than the {MAX_CONFIG_BYTES} bytes allowed", id="oversized"),
]


@pytest.mark.parametrize(("content", "message"), [*BAD_FILES, *LIMITS])
def test_a_bad_file_is_refused_naming_the_document(
    tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    store = ObjectiveStore()
    with pytest.raises(StaticObjectivesError) as raised:
        load_static_objectives(path, store)
    assert str(raised.value).startswith(str(path))
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)
    assert store.priority_of("batch") == 0  # nothing of the file was applied


def _run_epp(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "app",
            "--static-endpoints",
            "127.0.0.1:9",
            "--metrics-endpoint-auth=false",
            "--bind-address",
            "127.0.0.1",
            "--grpc-port",
            "0",
            "--grpc-health-port",
            "0",
            "--metrics-port",
            "0",
            "--secure-serving=false",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize(("content", "message"), [BAD_FILES[0], BAD_FILES[5], *LIMITS])
def test_the_process_does_not_start_with_a_bad_file_one_line(
    tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    result = _run_epp("--static-objectives", str(path))
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-2000:]
    assert "Traceback" not in output, output[-2000:]
    errors = [line for line in output.splitlines() if "--static-objectives:" in line]
    assert len(errors) == 1, output[-2000:]
    assert f"--static-objectives: {path}" in errors[0]
    assert message in errors[0]
    assert "ext_proc serving" not in output


def test_a_missing_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.yaml"
    with pytest.raises(SystemExit) as raised:
        parse_settings(
            [
                "--static-endpoints",
                "127.0.0.1:9",
                "--metrics-endpoint-auth=false",
                "--static-objectives",
                str(missing),
            ]
        )
    assert raised.value.code == 2
    assert f"--static-objectives {missing}: is not a file" in capsys.readouterr().err
