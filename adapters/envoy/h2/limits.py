"""What the native transport allows a peer and a call: one parameter object for the server,
read by its connections and calls."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["H2Limits"]


@dataclass(frozen=True, slots=True, kw_only=True)
class H2Limits:
    """``max_concurrent_rpcs`` bounds the calls of the whole server (past it:
    ``RESOURCE_EXHAUSTED``), ``max_streams_per_connection`` one connection's
    (SETTINGS_MAX_CONCURRENT_STREAMS; past it: REFUSED_STREAM); 0 means no bound. A message
    larger than ``max_receive_message_length`` ends its call with ``RESOURCE_EXHAUSTED``, a
    response larger than ``max_send_message_length`` too. ``max_connection_age`` asks each
    connection to reconnect after about that many seconds (GOAWAY; its streams finish; 0:
    never). A connection that sends no preface within ``handshake_timeout`` seconds is
    closed."""

    max_concurrent_rpcs: int = 0
    max_streams_per_connection: int = 0
    max_receive_message_length: int = 4 * 1024 * 1024
    max_send_message_length: int = 4 * 1024 * 1024
    max_connection_age: float = 0.0
    handshake_timeout: float = 20.0

    def __post_init__(self) -> None:
        for name in (
            "max_concurrent_rpcs",
            "max_streams_per_connection",
            "max_receive_message_length",
            "max_send_message_length",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0")
        if self.max_connection_age < 0 or self.handshake_timeout <= 0:
            raise ValueError("max_connection_age: must be >= 0; handshake_timeout: > 0")
