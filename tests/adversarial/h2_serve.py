"""The probes' native HTTP/2 gRPC server (``test_h2_transport.HANDLERS``) in a process of its
own, on uvloop as the EPP runs, so that its memory is measured apart from the client's.

    python -m tests.adversarial.h2_serve MAX_RECEIVE_MESSAGE_LENGTH  # 0: the default

prints the port it listens on (loopback), and serves until its standard input closes.
"""

from __future__ import annotations

import asyncio
import sys

import uvloop

from adapters.envoy.h2 import H2GrpcServer, H2Limits
from tests.adversarial.test_h2_transport import HANDLERS

__all__ = ["main"]


async def _serve(max_receive_message_length: int) -> None:
    options = {"max_receive_message_length": max_receive_message_length}
    limits = H2Limits(**options) if max_receive_message_length else H2Limits()
    server = H2GrpcServer(HANDLERS, limits=limits)
    print(await server.start("127.0.0.1", 0), flush=True)
    await asyncio.to_thread(sys.stdin.read)
    await server.stop(0)


def main() -> None:
    uvloop.install()
    asyncio.run(_serve(int(sys.argv[1])))


if __name__ == "__main__":
    main()
