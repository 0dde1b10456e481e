"""ListQueue, MaxMinHeap and DeadlineHeap against simple models."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from domain.flowcontrol import FlowKey, FlowRequest, ListQueue, MaxMinHeap, QueueItem
from domain.flowcontrol.deadlines import DeadlineHeap


def make_item(seq: int, key: float = 0.0, *, size: int = 1, expires: float = math.inf) -> QueueItem:
    request = FlowRequest(request_id=f"r{seq}", flow_key=FlowKey("f", 0), received_at=0.0)
    item = QueueItem(request, byte_size=size, seq=seq, enqueued_at=float(seq), expires_at=expires)
    item.order = (key, 0.0, seq)
    return item


def _pop_head(queue: ListQueue | MaxMinHeap) -> QueueItem | None:
    """Takes the head out, as the controller dispatches it."""
    item = queue.peek_head()
    if item is not None:
        queue.remove(item)
    return item


def test_list_queue_is_fifo_and_tracks_size() -> None:
    queue = ListQueue("f")
    items = [make_item(i, size=i + 1) for i in range(4)]
    for item in items:
        queue.push(item)
    assert len(queue) == 4
    assert queue.byte_size == 1 + 2 + 3 + 4
    assert queue.peek_head() is items[0]
    assert queue.peek_tail() is items[3]
    assert list(queue) == items
    assert _pop_head(queue) is items[0]
    assert queue.peek_head() is items[1]
    assert queue.byte_size == 9


def test_list_queue_removes_any_item_and_unlinks_it() -> None:
    queue = ListQueue()
    a, b, c = (make_item(i) for i in range(3))
    for item in (a, b, c):
        queue.push(item)
    queue.remove(b)
    assert list(queue) == [a, c]
    assert b.queue is None
    assert b.prev is None
    assert b.next is None
    queue.remove(c)
    assert queue.peek_tail() is a
    queue.remove(a)
    assert len(queue) == 0
    assert queue.byte_size == 0
    assert queue.peek_head() is None
    assert queue.peek_tail() is None
    assert _pop_head(queue) is None


def test_queues_refuse_foreign_and_double_membership() -> None:
    one, other = ListQueue(), MaxMinHeap()
    item = make_item(0)
    one.push(item)
    with pytest.raises(ValueError, match="already queued"):
        other.push(item)
    with pytest.raises(ValueError, match="not in this queue"):
        other.remove(item)
    stranger = make_item(1)
    with pytest.raises(ValueError, match="not in this queue"):
        one.remove(stranger)


def test_max_min_heap_head_is_smallest_tail_is_largest() -> None:
    heap = MaxMinHeap("f")
    keys = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0]
    items = [make_item(i, k) for i, k in enumerate(keys)]
    for item in items:
        heap.push(item)
    assert heap.peek_head() is items[1]
    assert heap.peek_tail() is items[2]
    popped = [_pop_head(heap) for _ in range(len(keys))]
    assert [p.order[0] for p in popped if p is not None] == sorted(keys)
    assert _pop_head(heap) is None
    assert heap.peek_tail() is None


def test_max_min_heap_ties_break_by_arrival() -> None:
    heap = MaxMinHeap()
    items = [make_item(i, 1.0) for i in range(5)]
    for item in reversed(items):
        heap.push(item)
    assert heap.peek_head() is items[0]
    assert heap.peek_tail() is items[4]


_ops = st.lists(
    st.tuples(
        st.sampled_from(["push", "push", "push", "remove", "pop_head"]),
        st.integers(min_value=0, max_value=20),
        st.integers(min_value=0, max_value=10_000),
    ),
    max_size=120,
)


@settings(max_examples=200, deadline=None)
@given(_ops)
def test_max_min_heap_matches_a_sorted_model(ops: list[tuple[str, int, int]]) -> None:
    heap = MaxMinHeap()
    model: list[QueueItem] = []
    seq = 0
    for op, key, pick in ops:
        if op == "push":
            item = make_item(seq, float(key), size=key)
            seq += 1
            heap.push(item)
            model.append(item)
        elif op == "remove" and model:
            victim = model.pop(pick % len(model))
            heap.remove(victim)
            assert victim.queue is None
            assert victim.heap_index == -1
        elif op == "pop_head" and model:
            best = min(model, key=lambda i: i.order)
            assert _pop_head(heap) is best
            model.remove(best)
        assert len(heap) == len(model)
        assert heap.byte_size == sum(i.byte_size for i in model)
        if model:
            assert heap.peek_head() is min(model, key=lambda i: i.order)
            assert heap.peek_tail() is max(model, key=lambda i: i.order)
        else:
            assert heap.peek_head() is None
            assert heap.peek_tail() is None
        assert all(heap._heap[i].heap_index == i for i in range(len(heap)))


@settings(max_examples=200, deadline=None)
@given(_ops)
def test_deadline_heap_matches_a_sorted_model(ops: list[tuple[str, int, int]]) -> None:
    heap = DeadlineHeap()
    model: list[QueueItem] = []
    seq = 0
    for op, key, pick in ops:
        if op == "push":
            item = make_item(seq, expires=float(key))
            seq += 1
            heap.push(item)
            model.append(item)
        elif op == "remove" and model:
            victim = model.pop(pick % len(model))
            heap.remove(victim)
            assert victim.ttl_index == -1
        elif op == "pop_head" and model:
            first = heap.peek()
            assert first is not None
            model.remove(first)
            heap.remove(first)
        assert len(heap) == len(model)
        first = heap.peek()
        if model:
            assert first is not None
            assert first.expires_at == min(i.expires_at for i in model)
        else:
            assert first is None
        assert all(heap._heap[i].ttl_index == i for i in range(len(heap)))


def test_deadline_heap_refuses_double_push_and_unknown_remove() -> None:
    heap = DeadlineHeap()
    item = make_item(0, expires=1.0)
    heap.push(item)
    with pytest.raises(ValueError, match="already"):
        heap.push(item)
    with pytest.raises(ValueError, match="no deadline"):
        heap.remove(make_item(1, expires=2.0))
