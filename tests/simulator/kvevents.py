"""KV-cache events over ZMQ, in vLLM's wire format.

vLLM (``--kv-events-config``) publishes its prefix cache's changes on a ZMQ PUB socket:

- every message has three frames: the topic, an 8-byte big-endian sequence number (0, 1, 2,
  ... per publisher) and a msgpack payload;
- the payload is an ``EventBatch``: ``[ts, events, data_parallel_rank]`` (array layout);
- each event is an array whose first item is its kind, the class name:
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name]``, ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``;
- block hashes are unsigned 64-bit integers: the low 8 bytes of the engine's hash;
- an optional ROUTER socket replays buffered batches: a request ``[b"", start_seq]`` (8
  bytes, big-endian) is answered by ``[b"", seq, payload]`` for every buffered batch with a
  sequence number ``>= start_seq``, then ``[b"", -1 (signed), b""]``.

:class:`KVEventPublisher` is a :class:`~tests.simulator.kvcache.KVCacheListener`: the
changes of one event-loop turn go out as one batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

_log = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


def external_hash(block_hash: bytes) -> int:
    """The event's integer form of an engine block hash: its low 64 bits (big-endian)."""
    return int.from_bytes(block_hash[-8:], "big")


class KVEventPublisher:
    """Publishes one simulated engine's KV-cache changes as vLLM's event batches.

    ``endpoint`` and ``replay_endpoint`` are ZMQ addresses to bind (``tcp://host:*``: a free
    port, see :attr:`endpoint` once started); ``replay_endpoint=None``: no replay socket.
    """

    def __init__(
        self,
        *,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        block_size: int = 16,
        data_parallel_rank: int = 0,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        self._requested = endpoint
        self._requested_replay = replay_endpoint
        self._topic = topic.encode()
        self._block_size = block_size
        self._rank = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._hwm = hwm
        self._encoder = msgspec.msgpack.Encoder()
        self._pending: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        self._seq = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._flush_handle: asyncio.Handle | None = None
        self.endpoint = ""
        self.replay_endpoint: str | None = None
        self.lora_name: str | None = None
        self.batches_sent = 0
        self._drop = 0
        self._drop_replayable = True

    @property
    def next_sequence(self) -> int:
        """The sequence number of the next batch."""
        return self._seq

    def start(self) -> None:
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        pub.set_hwm(self._hwm)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(self._requested)
        self.endpoint = str(pub.getsockopt_string(zmq.LAST_ENDPOINT))
        self._ctx, self._pub = ctx, pub
        if self._requested_replay is not None:
            replay = ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(self._requested_replay)
            self.replay_endpoint = str(replay.getsockopt_string(zmq.LAST_ENDPOINT))
            self._replay = replay
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def stop(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush()
        task, self._replay_task = self._replay_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # KVCacheListener

    def stored(
        self,
        block_hash: bytes,
        parent_hash: bytes | None,
        token_ids: Sequence[int],
        lora_name: str | None = None,
    ) -> None:
        lora_name = lora_name if lora_name is not None else self.lora_name
        parent = external_hash(parent_hash) if parent_hash is not None else None
        wire = external_hash(block_hash)
        last = self._pending[-1] if self._pending else None
        if (
            isinstance(last, BlockStored)
            and last.block_hashes
            and parent == last.block_hashes[-1]
            and last.lora_name == lora_name
        ):
            # a chain continues the previous event: one event per stored run, as vLLM does
            last.block_hashes.append(wire)
            last.token_ids.extend(token_ids)
        else:
            self._add(
                BlockStored(
                    block_hashes=[wire],
                    parent_block_hash=parent,
                    token_ids=list(token_ids),
                    block_size=self._block_size,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    lora_name=lora_name,
                )
            )

    def removed(self, block_hash: bytes) -> None:
        last = self._pending[-1] if self._pending else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(external_hash(block_hash))
        else:
            self._add(BlockRemoved(block_hashes=[external_hash(block_hash)], medium=MEDIUM_GPU))

    def cleared(self) -> None:
        self._add(AllBlocksCleared())

    def publish(self, events: list[Any], *, ts: float | None = None) -> int:
        """Send ``events`` as one batch now; returns its sequence number (tests use this)."""
        return self._send(EventBatch(ts=time.time() if ts is None else ts, events=events))

    def drop_next(self, count: int, *, replayable: bool = True) -> None:
        """Lose the next ``count`` batches on the PUB socket (a slow subscriber's drops);
        ``replayable=False``: lose them from the replay buffer too."""
        self._drop = count
        self._drop_replayable = replayable

    def _add(self, event: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        self._pending.append(event)
        if self._flush_handle is None and self._pub is not None:
            self._flush_handle = asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        events, self._pending = self._pending, []
        if events:
            self._send(EventBatch(ts=time.time(), events=list(events)))

    def _send(self, batch: EventBatch) -> int:
        batch.data_parallel_rank = self._rank
        payload = self._encoder.encode(batch)
        seq = self._seq
        self._seq += 1
        if self._drop:
            self._drop -= 1
            if self._drop_replayable:
                self._buffer.append((seq, payload))
            self.batches_sent += 1
            return seq
        self._buffer.append((seq, payload))
        if self._pub is not None:
            # a PUB socket never blocks: past its high-water mark it drops, like vLLM's
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        self.batches_sent += 1
        return seq

    async def _serve_replay(self) -> None:
        replay = self._replay
        assert replay is not None
        while True:
            frames = await replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                _log.warning("kv-events replay: malformed request of %d frames", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            await replay.send_multipart((client, b"", END_OF_REPLAY, b""))
