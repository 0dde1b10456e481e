"""``DeadlineHeap``: the queued items that can expire, earliest deadline first.

An indexed binary min-heap on ``QueueItem.expires_at`` (ties in any order), with each item's
position kept in ``item.ttl_index`` so a dispatched or cancelled item is removed in
O(log n) at once (nothing stale is left behind). Items without a TTL are never added.
"""

from __future__ import annotations

from domain.flowcontrol.queues import QueueItem

__all__ = ["DeadlineHeap"]


class DeadlineHeap:
    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[QueueItem] = []

    def __len__(self) -> int:
        return len(self._heap)

    def peek(self) -> QueueItem | None:
        heap = self._heap
        return heap[0] if heap else None

    def push(self, item: QueueItem) -> None:
        if item.ttl_index >= 0:
            raise ValueError(f"{item!r} already has a deadline entry")
        heap = self._heap
        item.ttl_index = len(heap)
        heap.append(item)
        self._up(item.ttl_index)

    def remove(self, item: QueueItem) -> None:
        index = item.ttl_index
        heap = self._heap
        if index < 0 or index >= len(heap) or heap[index] is not item:
            raise ValueError(f"{item!r} has no deadline entry")
        last = heap.pop()
        item.ttl_index = -1
        if last is item:
            return
        heap[index] = last
        last.ttl_index = index
        self._up(index)
        if last.ttl_index == index:
            self._down(index)

    def _up(self, index: int) -> None:
        heap = self._heap
        item = heap[index]
        expires = item.expires_at
        while index > 0:
            parent = (index - 1) >> 1
            above = heap[parent]
            if not expires < above.expires_at:
                break
            heap[index] = above
            above.ttl_index = index
            index = parent
        heap[index] = item
        item.ttl_index = index

    def _down(self, index: int) -> None:
        heap = self._heap
        n = len(heap)
        item = heap[index]
        expires = item.expires_at
        while True:
            child = 2 * index + 1
            if child >= n:
                break
            below = heap[child]
            below_expires = below.expires_at
            right = child + 1
            if right < n:
                other = heap[right]
                if other.expires_at < below_expires:
                    child = right
                    below = other
                    below_expires = other.expires_at
            if not below_expires < expires:
                break
            heap[index] = below
            below.ttl_index = index
            index = child
        heap[index] = item
        item.ttl_index = index
