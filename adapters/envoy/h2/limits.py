"""What the native transport allows a peer and a call: one parameter object for the server,
read by its connections and calls."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HELD_PER_CONNECTION", "HELD_PER_PROCESS", "IDLE_TIMEOUT", "H2Limits"]

# bytes of large messages being received, reserved whole (flow.HeldBytes): on one
# connection, and in the whole process (at least the largest message each)
HELD_PER_CONNECTION = 16 << 20
HELD_PER_PROCESS = 64 << 20
# Seconds a connection may stay without a stream: 5 minutes, far less than the hour after
# which Envoy closes an idle upstream connection by default, so a connection a peer opened
# and left is not held for ever; a gateway's comes back at its next request, at the cost
# of a handshake.
IDLE_TIMEOUT = 300.0


@dataclass(frozen=True, slots=True, kw_only=True)
class H2Limits:
    """``max_concurrent_rpcs`` bounds the calls of the whole server (past it:
    ``RESOURCE_EXHAUSTED``), ``max_streams_per_connection`` one connection's
    (SETTINGS_MAX_CONCURRENT_STREAMS; past it: REFUSED_STREAM); 0 means no bound. A message
    larger than ``max_receive_message_length`` ends its call with ``RESOURCE_EXHAUSTED``, a
    response larger than ``max_send_message_length`` too. ``max_connection_age`` asks each
    connection to reconnect after about that many seconds (GOAWAY; its streams finish; 0:
    never). A connection that sends no preface within ``handshake_timeout`` seconds is
    closed; one without an open stream for ``idle_timeout`` seconds (to twice that) is
    asked to go away (GOAWAY, as for its age; 0: never).

    Bytes of messages not yet whole that a stream's window cannot bound (a message larger
    than about 768 KiB is reserved whole while it arrives) are held at most
    ``held_per_connection`` on a connection and ``held_per_process`` in all: 16 and 64 MiB,
    or the largest message if larger."""

    max_concurrent_rpcs: int = 0
    max_streams_per_connection: int = 0
    max_receive_message_length: int = 4 * 1024 * 1024
    max_send_message_length: int = 4 * 1024 * 1024
    max_connection_age: float = 0.0
    handshake_timeout: float = 20.0
    idle_timeout: float = IDLE_TIMEOUT

    @property
    def held_per_connection(self) -> int:
        return max(HELD_PER_CONNECTION, self.max_receive_message_length + 5)

    @property
    def held_per_process(self) -> int:
        return max(HELD_PER_PROCESS, self.held_per_connection)

    def __post_init__(self) -> None:
        for name in (
            "max_concurrent_rpcs",
            "max_streams_per_connection",
            "max_receive_message_length",
            "max_send_message_length",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0")
        if self.max_connection_age < 0 or self.handshake_timeout <= 0 or self.idle_timeout < 0:
            raise ValueError(
                "max_connection_age, idle_timeout: must be >= 0; handshake_timeout: > 0"
            )
