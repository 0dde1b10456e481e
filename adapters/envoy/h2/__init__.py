"""A gRPC server over HTTP/2 on asyncio, for the ext_proc port (``--extproc-transport=native``).

grpc.aio costs 65 to 90 µs of CPU per message pair on this project's machine
(``tests.bench.grpc_floor``), and an ext_proc stream is one message pair per body chunk:
that floor, not our handling, decided the EPP's cost per request and per SSE chunk
(docs/decisions/0013). No kept Python library serves gRPC cheaper (``h2``, the pure-Python
HTTP/2 state machine, costs about 40 µs a pair), so this package frames HTTP/2 itself and
leaves header compression to ``hpack``. ``tests.bench.grpc_floor`` prints them side by side
(docs/decisions/0020).

What it serves is gRPC as Envoy's client speaks it: one method table, stream-stream and
unary-unary handlers on a context with ``read()``, ``write()`` and ``abort()`` (the subset
of ``grpc.aio.ServicerContext`` the EPP's handlers use), statuses in trailers,
``grpc-timeout``, identity encoding only. What it guards, because the port may be reached by
more than Envoy:

- flow control both ways: a stream's unread messages are bounded by its window (credit is
  returned as the handler reads), a message by ``max_receive_message_length``
  (``RESOURCE_EXHAUSTED``), and a peer that stops reading stops our reading of it too
  (transport back-pressure), so nothing it sends grows memory without bound;
- frame sizes, header blocks (compressed and decoded size), stream ids, CONTINUATION
  sequences, SETTINGS values: a violation is a connection error (GOAWAY) or a stream error
  (RST_STREAM), as RFC 9113 says;
- floods: control frames (PING, SETTINGS, RST_STREAM, PRIORITY, WINDOW_UPDATE, empty
  DATA) past a budget that only requests refill, and streams the peer resets faster than
  they complete ("rapid reset"), end the connection with ENHANCE_YOUR_CALM;
- a connection that sends no preface within ``handshake_timeout`` is closed.

Its rooms, each a module that reaches the others only through their public methods:

- ``frames``: the codes, frames built to send, frames cut from what a peer sends, and the
  shape of each frame checked;
- ``headers``: header blocks assembled from HEADERS and CONTINUATION, decoded with HPACK
  (and kept decoded while the table does not change), and the blocks we send;
- ``flow``: the windows both ways, and the data waiting for them;
- ``connection``: one connection's state machine (its streams, the peer's budgets, GOAWAY,
  drain, close);
- ``calls``: the gRPC call layer (a stream's headers turned into a call, messages cut from
  DATA, the handler's context, its status);
- ``server``: listening, connections handed over, the drain; ``limits``: what a peer and a
  call may use.
"""

from __future__ import annotations

from adapters.envoy.h2.calls import MethodHandler, RpcContext
from adapters.envoy.h2.limits import H2Limits
from adapters.envoy.h2.server import H2GrpcServer

__all__ = ["H2GrpcServer", "H2Limits", "MethodHandler", "RpcContext"]
