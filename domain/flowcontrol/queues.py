"""Queued items and the per-flow queues that hold them.

Every flow has one queue. Its kind follows the band's ordering policy:

- ``ListQueue`` (capability FIFO, the default): an intrusive doubly linked list; the head
  is the oldest item. It serves policies whose order is arrival order (FCFS).
- ``MaxMinHeap`` (capability priority-configurable): a min-max heap on ``QueueItem.order``;
  the head is the item that sorts first, the tail the one that sorts last. It serves
  policies that reorder (EDF, SLO deadline).

Both give O(1) peek at head and tail and remove any item they hold in O(1) (list) or
O(log n) (heap) through links stored on the item itself, so a cancelled or expired
request leaves no trace. An item is in at most one queue at a time (``item.queue``).
Not thread-safe: the controller uses them from the event loop only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, Protocol

from domain.flowcontrol.types import FlowControlError, FlowRequest, QueueOutcome

__all__ = ["FlowQueue", "ListQueue", "MaxMinHeap", "QueueItem"]

#: How a queued item sorts: the ordering policy's (primary, secondary) key, then arrival.
Order = tuple[float, float, int]


class QueueItem:
    """One request while it is in flow control.

    Public, read-only for policies: ``request``, ``byte_size``, ``seq`` (arrival number,
    unique and increasing), ``enqueued_at`` and ``expires_at`` (controller clock;
    ``inf`` without TTL), ``order``. The other slots are bookkeeping for the queues and the
    controller.
    """

    __slots__ = (
        "band_next",
        "band_prev",
        "byte_size",
        "enqueued_at",
        "error",
        "expires_at",
        "finished_at",
        "heap_index",
        "next",
        "order",
        "outcome",
        "owner",
        "prev",
        "queue",
        "request",
        "seq",
        "series",
        "ttl_index",
        "waiter",
    )

    def __init__(
        self,
        request: FlowRequest,
        *,
        byte_size: int,
        seq: int,
        enqueued_at: float,
        expires_at: float,
    ) -> None:
        self.request = request
        self.byte_size = byte_size
        self.seq = seq
        self.enqueued_at = enqueued_at
        self.expires_at = expires_at
        self.order: Order = (enqueued_at, 0.0, seq)
        # queue links
        self.queue: FlowQueue | None = None
        self.prev: QueueItem | None = None
        self.next: QueueItem | None = None
        self.heap_index = -1
        # controller bookkeeping
        self.owner: Any = None
        self.band_prev: QueueItem | None = None
        self.band_next: QueueItem | None = None
        self.ttl_index = -1
        self.series: Any = None
        self.waiter: asyncio.Future[None] | None = None
        self.outcome = QueueOutcome.NOT_YET_FINALIZED
        self.error: FlowControlError | None = None
        self.finished_at = 0.0

    def __repr__(self) -> str:
        return f"QueueItem({self.request.request_id!r}, seq={self.seq}, order={self.order})"


class FlowQueue(Protocol):
    """What fairness policies see of a flow's queue."""

    @property
    def flow_id(self) -> str: ...

    @property
    def byte_size(self) -> int: ...

    def __len__(self) -> int: ...

    def peek_head(self) -> QueueItem | None:
        """The item to dispatch next from this flow."""
        ...

    def peek_tail(self) -> QueueItem | None:
        """The item that would be dispatched last."""
        ...


class ListQueue:
    """FIFO queue: an intrusive doubly linked list (capability FIFO)."""

    __slots__ = ("_bytes", "_head", "_len", "_tail", "flow_id")

    def __init__(self, flow_id: str = "") -> None:
        self.flow_id = flow_id
        self._head: QueueItem | None = None
        self._tail: QueueItem | None = None
        self._len = 0
        self._bytes = 0

    def __len__(self) -> int:
        return self._len

    @property
    def byte_size(self) -> int:
        return self._bytes

    def push(self, item: QueueItem) -> None:
        """Appends ``item`` at the tail. It must not be in a queue."""
        if item.queue is not None:
            raise ValueError(f"{item!r} is already queued")
        item.queue = self
        tail = self._tail
        item.prev = tail
        item.next = None
        if tail is None:
            self._head = item
        else:
            tail.next = item
        self._tail = item
        self._len += 1
        self._bytes += item.byte_size

    def remove(self, item: QueueItem) -> None:
        """Unlinks ``item``, which must be in this queue."""
        if item.queue is not self:
            raise ValueError(f"{item!r} is not in this queue")
        prev = item.prev
        nxt = item.next
        if prev is None:
            self._head = nxt
        else:
            prev.next = nxt
        if nxt is None:
            self._tail = prev
        else:
            nxt.prev = prev
        item.prev = item.next = None
        item.queue = None
        self._len -= 1
        self._bytes -= item.byte_size

    def peek_head(self) -> QueueItem | None:
        return self._head

    def peek_tail(self) -> QueueItem | None:
        return self._tail

    def __iter__(self) -> Iterator[QueueItem]:
        """Head to tail. Do not modify the queue while iterating."""
        item = self._head
        while item is not None:
            yield item
            item = item.next


class MaxMinHeap:
    """Priority queue on ``QueueItem.order`` (capability priority-configurable).

    A min-max heap: even levels hold minima of their subtrees, odd levels maxima. The head
    (smallest order) is at the root, the tail (largest) is one of the root's children.
    """

    __slots__ = ("_bytes", "_heap", "flow_id")

    def __init__(self, flow_id: str = "") -> None:
        self.flow_id = flow_id
        self._heap: list[QueueItem] = []
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._heap)

    @property
    def byte_size(self) -> int:
        return self._bytes

    def push(self, item: QueueItem) -> None:
        if item.queue is not None:
            raise ValueError(f"{item!r} is already queued")
        item.queue = self
        heap = self._heap
        item.heap_index = len(heap)
        heap.append(item)
        self._bytes += item.byte_size
        self._bubble_up(item.heap_index)

    def remove(self, item: QueueItem) -> None:
        if item.queue is not self:
            raise ValueError(f"{item!r} is not in this queue")
        heap = self._heap
        index = item.heap_index
        last = heap.pop()
        item.queue = None
        item.heap_index = -1
        self._bytes -= item.byte_size
        if last is item:
            return
        heap[index] = last
        last.heap_index = index
        self._fix(index)

    def peek_head(self) -> QueueItem | None:
        heap = self._heap
        return heap[0] if heap else None

    def peek_tail(self) -> QueueItem | None:
        heap = self._heap
        n = len(heap)
        if n <= 2:
            return heap[-1] if heap else None
        return heap[1] if heap[1].order >= heap[2].order else heap[2]

    def __iter__(self) -> Iterator[QueueItem]:
        """In heap (not sorted) order. Do not modify the queue while iterating."""
        return iter(self._heap)

    # -- heap maintenance ----------------------------------------------------------------

    def _swap(self, i: int, j: int) -> None:
        heap = self._heap
        a = heap[i]
        b = heap[j]
        heap[i] = b
        heap[j] = a
        b.heap_index = i
        a.heap_index = j

    def _fix(self, index: int) -> None:
        """Restores the heap after the item at ``index`` was replaced by an arbitrary one."""
        heap = self._heap
        moved = heap[index]
        if index > 0:
            parent = (index - 1) >> 1
            on_min = _is_min_level(index)
            if (on_min and moved.order > heap[parent].order) or (
                not on_min and moved.order < heap[parent].order
            ):
                self._swap(index, parent)
                self._push_down(index)
                if on_min:
                    self._up_max(parent)
                else:
                    self._up_min(parent)
                return
        self._push_down(index)
        if moved.heap_index == index:
            self._bubble_up(index)

    def _bubble_up(self, index: int) -> None:
        if index == 0:
            return
        heap = self._heap
        parent = (index - 1) >> 1
        if _is_min_level(index):
            if heap[index].order > heap[parent].order:
                self._swap(index, parent)
                self._up_max(parent)
            else:
                self._up_min(index)
        elif heap[index].order < heap[parent].order:
            self._swap(index, parent)
            self._up_min(parent)
        else:
            self._up_max(index)

    def _up_min(self, index: int) -> None:
        heap = self._heap
        while index > 2:
            grand = (((index - 1) >> 1) - 1) >> 1
            if heap[index].order < heap[grand].order:
                self._swap(index, grand)
                index = grand
            else:
                return

    def _up_max(self, index: int) -> None:
        heap = self._heap
        while index > 2:
            grand = (((index - 1) >> 1) - 1) >> 1
            if heap[index].order > heap[grand].order:
                self._swap(index, grand)
                index = grand
            else:
                return

    def _push_down(self, index: int) -> None:
        if _is_min_level(index):
            self._down(index, smaller=True)
        else:
            self._down(index, smaller=False)

    def _down(self, index: int, *, smaller: bool) -> None:
        heap = self._heap
        n = len(heap)
        while True:
            child = 2 * index + 1
            if child >= n:
                return
            # the best of the children and grandchildren (2*child+1 .. 2*child+4)
            best = child
            best_order = heap[child].order
            first_grand = 2 * child + 1
            for j in (child + 1, first_grand, first_grand + 1, first_grand + 2, first_grand + 3):
                if j >= n:
                    break
                order = heap[j].order
                if (order < best_order) if smaller else (order > best_order):
                    best = j
                    best_order = order
            current = heap[index].order
            if not ((best_order < current) if smaller else (best_order > current)):
                return
            self._swap(index, best)
            if best < first_grand:
                return
            parent = (best - 1) >> 1
            moved = heap[best].order
            parent_order = heap[parent].order
            if (moved > parent_order) if smaller else (moved < parent_order):
                self._swap(best, parent)
            index = best


def _is_min_level(index: int) -> bool:
    return bool((index + 1).bit_length() & 1)
