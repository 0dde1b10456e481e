"""Length-prefixed pickle frames over a unix stream socket.

Only the pod's own processes reach the socket (a 0700 directory of the supervisor's user),
so the frames are trusted like the processes themselves; a frame above ``MAX_FRAME_BYTES``
ends the connection.
"""

from __future__ import annotations

import asyncio
import pickle

__all__ = ["MAX_FRAME_BYTES", "encode_frame", "read_frame", "write_frame"]

#: A model server's ``/metrics`` is bounded by the scrape client (64 MiB at most).
MAX_FRAME_BYTES = 80 * 1024 * 1024


async def read_frame(reader: asyncio.StreamReader) -> object:
    """The next message; raises ``asyncio.IncompleteReadError`` at the end of the stream
    and ``ValueError`` for an oversized frame."""
    header = await reader.readexactly(4)
    size = int.from_bytes(header, "big")
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {size} bytes is larger than {MAX_FRAME_BYTES}")
    return pickle.loads(await reader.readexactly(size))


def encode_frame(message: object) -> bytes:
    """One frame, encoded once for any number of writers."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(4, "big") + data


def write_frame(writer: asyncio.StreamWriter, message: object) -> None:
    writer.write(encode_frame(message))
