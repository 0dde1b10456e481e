"""The in-tree flow-control policy plugins."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from domain.flowcontrol import (
    FairnessPolicy,
    FlowKey,
    FlowQueue,
    FlowRequest,
    ListQueue,
    MaxMinHeap,
    OrderingPolicy,
    QueueItem,
    UsageLimitPolicy,
)
from domain.flowcontrol.plugins.edf_ordering import EdfOrderingPolicy
from domain.flowcontrol.plugins.fcfs_ordering import FcfsOrderingPolicy
from domain.flowcontrol.plugins.global_strict_fairness import GlobalStrictFairnessPolicy
from domain.flowcontrol.plugins.max_min_fairness import MaxMinFairnessPolicy
from domain.flowcontrol.plugins.round_robin_fairness import RoundRobinFairnessPolicy
from domain.flowcontrol.plugins.slo_deadline_ordering import SloDeadlineOrderingPolicy
from domain.flowcontrol.plugins.static_usage_limit import (
    StaticUsageLimitParameters,
    StaticUsageLimitPolicy,
)
from domain.plugins.base import EmptyParameters, PluginRegistry, TypedName
from domain.plugins.intree import register_in_tree
from domain.requestcontrol.interfaces import (
    Admitter,
    DataProducer,
    Parser,
    PreRequest,
    ResponseBodyProcessor,
    ResponseHeaderProcessor,
    SaturationDetector,
)
from domain.scheduling.interfaces import Filter, Picker, ProfileHandler, Scorer
from tests.support.scheduling import plugin_handle

POLICY_TYPES = {
    "fcfs-ordering-policy": OrderingPolicy,
    "edf-ordering-policy": OrderingPolicy,
    "slo-deadline-ordering-policy": OrderingPolicy,
    "global-strict-fairness-policy": FairnessPolicy,
    "round-robin-fairness-policy": FairnessPolicy,
    "max-min-fairness-policy": FairnessPolicy,
    "static-usage-limit-policy": UsageLimitPolicy,
}


def item(
    seq: int,
    *,
    enqueued_at: float = 0.0,
    received_at: float = 0.0,
    expires_at: float = math.inf,
    slo: float | None = None,
    flow: str = "f",
) -> QueueItem:
    request = FlowRequest(
        request_id=f"r{seq}",
        flow_key=FlowKey(flow, 0),
        received_at=received_at,
        slo_ttft_ms=slo,
    )
    return QueueItem(request, byte_size=1, seq=seq, enqueued_at=enqueued_at, expires_at=expires_at)


def ordered(policy: OrderingPolicy, queued: QueueItem) -> QueueItem:
    key = policy.order_key(queued)
    queued.order = (key[0], key[1], queued.seq)
    return queued


@pytest.mark.parametrize(("type_name", "kind"), list(POLICY_TYPES.items()))
def test_policies_register_in_tree_and_build_with_defaults(type_name: str, kind: type) -> None:
    registry = PluginRegistry()
    register_in_tree(registry)
    plugin = registry.create(type_name, f"my-{type_name}", None, plugin_handle())
    assert plugin.typed_name == TypedName(type_name, f"my-{type_name}")
    assert isinstance(plugin, kind)


def test_policies_fill_no_other_extension_point() -> None:
    """Extension points are found structurally: a policy must not look like, e.g., a
    scheduling Picker (the loader would put it into the default profile)."""
    registry = PluginRegistry()
    register_in_tree(registry)
    others = (
        Filter,
        Scorer,
        Picker,
        ProfileHandler,
        Parser,
        DataProducer,
        Admitter,
        PreRequest,
        ResponseHeaderProcessor,
        ResponseBodyProcessor,
        SaturationDetector,
    )
    for type_name in POLICY_TYPES:
        plugin = registry.create(type_name, type_name, None, plugin_handle())
        assert [kind.__name__ for kind in others if isinstance(plugin, kind)] == []


def test_queue_capability_flags() -> None:
    assert (
        FcfsOrderingPolicy(TypedName("t", "n"), EmptyParameters()).requires_priority_queue is False
    )
    assert EdfOrderingPolicy(TypedName("t", "n"), EmptyParameters()).requires_priority_queue
    assert SloDeadlineOrderingPolicy(TypedName("t", "n"), EmptyParameters()).requires_priority_queue


def test_fcfs_orders_by_enqueue_time() -> None:
    policy = FcfsOrderingPolicy(TypedName("t", "n"), EmptyParameters())
    early = ordered(policy, item(2, enqueued_at=1.0))
    late = ordered(policy, item(1, enqueued_at=2.0))
    assert early.order < late.order


def test_edf_orders_by_ttl_deadline_and_no_ttl_last() -> None:
    policy = EdfOrderingPolicy(TypedName("t", "n"), EmptyParameters())
    soon = ordered(policy, item(3, enqueued_at=5.0, expires_at=10.0))
    later = ordered(policy, item(1, enqueued_at=1.0, expires_at=20.0))
    never = ordered(policy, item(0, enqueued_at=0.0))
    same_deadline_enqueued_later = ordered(policy, item(5, enqueued_at=2.0, expires_at=20.0))
    ranked = sorted([never, same_deadline_enqueued_later, later, soon], key=lambda i: i.order)
    assert ranked == [soon, later, same_deadline_enqueued_later, never]


def test_slo_deadline_orders_by_received_plus_ttft_slo() -> None:
    policy = SloDeadlineOrderingPolicy(TypedName("t", "n"), EmptyParameters())
    tight = ordered(policy, item(1, received_at=10.0, slo=100))  # deadline 10.1
    loose = ordered(policy, item(0, received_at=9.0, slo=2000))  # deadline 11.0
    none_old = ordered(policy, item(2, received_at=1.0))
    none_new = ordered(policy, item(3, received_at=2.0, slo=0))
    ranked = sorted([none_new, loose, none_old, tight], key=lambda i: i.order)
    assert ranked == [tight, loose, none_old, none_new]


@dataclass
class View:
    """A ``BandView`` over plain queues; ``in_flight`` is each flow's count over the pool,
    ``elsewhere`` the flows waiting only at other processes."""

    queues: dict[str, FlowQueue]
    arrival_ordered: bool = True
    priority: int = 0
    in_flight: dict[str, int] = field(default_factory=dict)
    elsewhere: list[tuple[str, int]] = field(default_factory=list)

    @property
    def oldest(self) -> QueueItem | None:
        heads = [item for queue in self.queues.values() for item in queue]  # type: ignore[attr-defined]
        return min(heads, key=lambda i: i.seq) if heads else None

    def pool_in_flight(self, flow_id: str) -> int:
        return self.in_flight.get(flow_id, 0)

    def waiting_elsewhere(self) -> Iterator[tuple[str, int]]:
        return iter(self.elsewhere)


def band_of(*groups: tuple[str, list[QueueItem]]) -> View:
    found: dict[str, FlowQueue] = {}
    for flow_id, members in groups:
        queue = ListQueue(flow_id)
        for member in members:
            queue.push(member)
        found[flow_id] = queue
    return View(found)


def test_global_strict_picks_the_flow_with_the_best_head() -> None:
    policy = GlobalStrictFairnessPolicy(TypedName("t", "n"), EmptyParameters())
    fcfs = FcfsOrderingPolicy(TypedName("t", "n"), EmptyParameters())
    a = [
        ordered(fcfs, item(2, enqueued_at=2.0, flow="a")),
        ordered(fcfs, item(4, enqueued_at=4.0, flow="a")),
    ]
    b = [ordered(fcfs, item(1, enqueued_at=1.0, flow="b"))]
    c = [ordered(fcfs, item(3, enqueued_at=3.0, flow="c"))]
    band = band_of(("a", a), ("b", b), ("c", c))
    state = policy.new_state()
    assert policy.pick_flow(state, band) is band.queues["b"]  # via the band's oldest request
    band.arrival_ordered = False
    assert policy.pick_flow(state, band) is band.queues["b"]  # by comparing the heads
    assert policy.pick_flow(state, View({})) is None
    assert policy.pick_flow(state, View({}, arrival_ordered=False)) is None


def test_global_strict_over_heaps_uses_the_heap_heads() -> None:
    policy = GlobalStrictFairnessPolicy(TypedName("t", "n"), EmptyParameters())
    edf = EdfOrderingPolicy(TypedName("t", "n"), EmptyParameters())
    x, y = MaxMinHeap("x"), MaxMinHeap("y")
    x.push(ordered(edf, item(0, expires_at=50.0)))
    x.push(ordered(edf, item(1, expires_at=5.0)))
    y.push(ordered(edf, item(2, expires_at=7.0)))
    assert policy.pick_flow(None, View({"x": x, "y": y}, arrival_ordered=False)) is x


def test_round_robin_takes_flows_in_id_order_and_wraps() -> None:
    policy = RoundRobinFairnessPolicy(TypedName("t", "n"), EmptyParameters())
    band = band_of(("b", [item(0)]), ("a", [item(1)]), ("c", [item(2)]))
    state = policy.new_state()
    picks = [policy.pick_flow(state, band) for _ in range(4)]
    assert [p.flow_id for p in picks if p is not None] == ["a", "b", "c", "a"]


def test_round_robin_skips_flows_that_left_and_keeps_state_per_band() -> None:
    policy = RoundRobinFairnessPolicy(TypedName("t", "n"), EmptyParameters())
    band_one, band_two = policy.new_state(), policy.new_state()
    all_three = band_of(("a", [item(0)]), ("b", [item(1)]), ("c", [item(2)]))
    queues = all_three.queues
    assert policy.pick_flow(band_one, all_three) is queues["a"]
    assert policy.pick_flow(band_one, all_three) is queues["b"]
    without_c = View({k: v for k, v in queues.items() if k != "c"})
    picked = policy.pick_flow(band_one, without_c)  # after "b" comes "c", which left: wrap to "a"
    assert picked is queues["a"]
    assert policy.pick_flow(band_two, all_three) is queues["a"]
    assert policy.pick_flow(band_one, View({})) is None


def test_max_min_picks_the_flow_with_the_fewest_in_flight() -> None:
    policy = MaxMinFairnessPolicy(TypedName("t", "n"), EmptyParameters())
    fcfs = FcfsOrderingPolicy(TypedName("t", "n"), EmptyParameters())
    heavy = [ordered(fcfs, item(0, enqueued_at=1.0, flow="heavy"))]
    light = [ordered(fcfs, item(1, enqueued_at=2.0, flow="light"))]
    band = band_of(("heavy", heavy), ("light", light))
    band.in_flight = {"heavy": 9, "light": 2}
    assert policy.pick_flow(None, band) is band.queues["light"]  # though its head is newer
    band.in_flight = {"heavy": 3, "light": 3}
    assert policy.pick_flow(None, band) is band.queues["heavy"]  # a tie: the older head
    assert policy.pick_flow(None, View({})) is None


def test_max_min_yields_to_a_flow_further_below_its_share_elsewhere() -> None:
    policy = MaxMinFairnessPolicy(TypedName("t", "n"), EmptyParameters())
    band = band_of(("heavy", [item(0, flow="heavy")]))
    band.in_flight = {"heavy": 6}
    band.elsewhere = [("light", 2)]
    assert policy.pick_flow(None, band) is None  # the room goes to the other process
    band.elsewhere = [("light", 6), ("other", 7)]
    assert policy.pick_flow(None, band) is band.queues["heavy"]  # not below: dispatch here


def test_static_usage_limit_gives_every_band_the_threshold() -> None:
    default = StaticUsageLimitPolicy(TypedName("t", "n"), StaticUsageLimitParameters())
    assert list(default.compute_limit(0.3, [10, 0, -1])) == [1.0, 1.0, 1.0]
    custom = StaticUsageLimitPolicy(TypedName("t", "n"), StaticUsageLimitParameters(threshold=0.8))
    assert list(custom.compute_limit(5.0, [1])) == [0.8]
    assert list(custom.compute_limit(0.0, [])) == []


@pytest.mark.parametrize("threshold", [0.0, -1.0, math.inf, math.nan])
def test_static_usage_limit_threshold_must_be_positive_and_finite(threshold: float) -> None:
    with pytest.raises(ValueError, match="threshold"):
        StaticUsageLimitParameters(threshold=threshold)
