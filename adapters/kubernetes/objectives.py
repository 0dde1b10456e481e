"""InferenceObjectives and InferenceModelRewrites of one pool, reported whole to an ObjectiveSink.

Only resources whose ``spec.poolRef.name`` is the pool, and whose ``spec.poolRef.group`` (when
set) is the pool's group, count. Objectives map ``metadata.name`` to ``spec.priority`` (``None``
when unset). Every rule of a rewrite becomes one ``ModelRewriteRule`` per ``matches[].model.value``
(a rule without matches applies to every model: match ``""``), with the resource's
``creationTimestamp`` as ``created`` and the rule's index as ``order``.

Both kinds exist in two API groups: ``llm-d.ai/v1alpha2`` (the llm-d router's, 2026) and
``inference.networking.x-k8s.io/v1alpha2``. When the cluster serves the newer group, only
its resources count; the older group's count only where the newer is not served.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from adapters.kubernetes.api import KubeObject
from adapters.kubernetes.watch import WatchEvent, WatchEventKind
from ports.objectives import ModelRewriteRule, ModelRewriteTarget, ObjectiveSink

__all__ = ["ObjectiveTracker", "objective_priority", "references_pool", "rewrite_rules"]

_LOG = logging.getLogger(__name__)

NEWER_GROUP = "llm-d.ai/v1alpha2"
LEGACY_GROUP = "inference.networking.x-k8s.io/v1alpha2"


def references_pool(obj: KubeObject, *, pool_name: str, pool_group: str) -> bool:
    """Whether the resource's ``spec.poolRef`` names this pool."""
    ref = _map(_map(obj.get("spec")).get("poolRef"))
    if ref.get("name") != pool_name:
        return False
    group = ref.get("group")
    return not group or group == pool_group


def objective_priority(obj: KubeObject) -> int | None:
    """``spec.priority``, ``None`` when unset (or not an integer)."""
    priority = _map(obj.get("spec")).get("priority")
    if priority is None:
        return None
    if isinstance(priority, bool) or not isinstance(priority, int):
        _LOG.warning("InferenceObjective %s: priority %r is not an integer", _name(obj), priority)
        return None
    return priority


def rewrite_rules(obj: KubeObject) -> list[ModelRewriteRule]:
    """The ``ModelRewriteRule``s of one InferenceModelRewrite, in rule order."""
    name = _name(obj)
    created = _timestamp(_map(obj.get("metadata")).get("creationTimestamp"))
    rules: list[ModelRewriteRule] = []
    raw_rules = _map(obj.get("spec")).get("rules")
    for order, raw in enumerate(raw_rules if isinstance(raw_rules, list) else []):
        rule = _map(raw)
        targets = _targets(rule.get("targets"))
        for match in _match_values(rule.get("matches")):
            rules.append(
                ModelRewriteRule(
                    name=name, match=match, targets=targets, created=created, order=order
                )
            )
    return rules


class _Collection:
    """The objects of one kind from one group's watch."""

    __slots__ = ("absent", "objects", "synced")

    def __init__(self) -> None:
        self.objects: dict[str, KubeObject] = {}
        self.synced = False
        self.absent = False


class _Kind:
    """One kind (objectives or rewrites) watched in the newer ``llm-d.ai`` group and the
    legacy ``inference.networking.x-k8s.io`` group. The newer wins whenever its CRD is
    served (its watch synced); the legacy group counts only once the newer one is known
    not to be served (as in the reference: when both exist, only the new ones count)."""

    __slots__ = ("legacy", "newer", "what")

    def __init__(self, what: str) -> None:
        self.what = what
        self.newer = _Collection()
        self.legacy = _Collection()

    def effective(self) -> dict[str, KubeObject] | None:
        """The objects that count, or None while that is not known yet."""
        if self.newer.synced:
            return self.newer.objects
        if self.newer.absent and self.legacy.synced:
            return self.legacy.objects
        return None


class ObjectiveTracker:
    """Keeps the pool's objectives and rewrites from watch events; lives on the event loop.

    Each kind is watched in two groups (``llm-d.ai/v1alpha2``, the newer, and
    ``inference.networking.x-k8s.io/v1alpha2``); see ``_Kind`` for which one counts. Reports
    the complete sets to the sink once the counting watch is synced, then after every
    change that alters them.
    """

    def __init__(self, sink: ObjectiveSink, *, pool_name: str, pool_group: str) -> None:
        self._sink = sink
        self._pool_name = pool_name
        self._pool_group = pool_group
        self._objectives = _Kind("InferenceObjective")
        self._rewrites = _Kind("InferenceModelRewrite")
        self._published_priorities: dict[str, int | None] | None = None
        self._published_rules: list[ModelRewriteRule] | None = None

    def on_objective(self, event: WatchEvent) -> None:
        """An event of the ``llm-d.ai`` InferenceObjective watch."""
        self._on(self._objectives, self._objectives.newer, event, NEWER_GROUP)
        self._publish_objectives()

    def on_legacy_objective(self, event: WatchEvent) -> None:
        """An event of the ``inference.networking.x-k8s.io`` InferenceObjective watch."""
        self._on(self._objectives, self._objectives.legacy, event, LEGACY_GROUP)
        self._publish_objectives()

    def on_rewrite(self, event: WatchEvent) -> None:
        self._on(self._rewrites, self._rewrites.newer, event, NEWER_GROUP)
        self._publish_rules()

    def on_legacy_rewrite(self, event: WatchEvent) -> None:
        self._on(self._rewrites, self._rewrites.legacy, event, LEGACY_GROUP)
        self._publish_rules()

    def _on(self, kind: _Kind, collection: _Collection, event: WatchEvent, group: str) -> None:
        if event.kind is WatchEventKind.ABSENT:
            collection.absent = True
            if kind.newer.absent and kind.legacy.absent:
                _LOG.info(
                    "%s is not served (neither %s nor %s); it is not watched",
                    kind.what,
                    NEWER_GROUP,
                    LEGACY_GROUP,
                )
            return
        if event.kind is WatchEventKind.SYNCED:
            if not collection.synced and collection is kind.newer:
                _LOG.info(
                    "%s: the %s resources count (%s is ignored)", kind.what, group, LEGACY_GROUP
                )
            collection.synced = True
            return
        self._track(collection.objects, event)

    def _track(self, objects: dict[str, KubeObject], event: WatchEvent) -> None:
        obj = event.object or {}
        name = _name(obj)
        if not name:
            return
        if event.kind is WatchEventKind.UPSERT and references_pool(
            obj, pool_name=self._pool_name, pool_group=self._pool_group
        ):
            objects[name] = obj
        else:
            objects.pop(name, None)

    def _publish_objectives(self) -> None:
        objects = self._objectives.effective()
        if objects is None:
            return
        priorities = {name: objective_priority(obj) for name, obj in sorted(objects.items())}
        if priorities != self._published_priorities:
            self._published_priorities = priorities
            self._sink.set_objectives(dict(priorities))

    def _publish_rules(self) -> None:
        objects = self._rewrites.effective()
        if objects is None:
            return
        rules = [rule for _, obj in sorted(objects.items()) for rule in rewrite_rules(obj)]
        if rules != self._published_rules:
            self._published_rules = rules
            self._sink.set_rules(tuple(rules))


def _match_values(raw: Any) -> list[str]:
    if not isinstance(raw, list) or not raw:
        return [""]
    values: list[str] = []
    for item in raw:
        model = _map(_map(item).get("model"))
        kind = model.get("type") or "Exact"
        value = model.get("value")
        if kind == "Exact" and isinstance(value, str) and value:
            values.append(value)
    return values


def _targets(raw: Any) -> tuple[ModelRewriteTarget, ...]:
    targets: list[ModelRewriteTarget] = []
    for item in raw if isinstance(raw, list) else []:
        target = _map(item)
        model = target.get("modelRewrite")
        weight = target.get("weight", 1)
        if not isinstance(model, str) or not model:
            continue
        if isinstance(weight, bool) or not isinstance(weight, int):
            weight = 1
        targets.append(ModelRewriteTarget(model=model, weight=weight))
    return tuple(targets)


def _timestamp(value: Any) -> float:
    if not isinstance(value, str) or not value:
        return 0.0
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return 0.0


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _name(obj: KubeObject) -> str:
    name = _map(obj.get("metadata")).get("name")
    return name if isinstance(name, str) else ""
