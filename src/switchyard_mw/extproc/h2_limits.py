"""What one peer of the `h2` and `frames` transports may take of the server (`H2Limits`), one
frozen object handed to the server and read by each connection (SECURITY.md, "ext_proc")."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

DEFAULT_MESSAGE_BYTES = (32 << 20) + (1 << 20)
"""The largest message at the default `[server] max_body_bytes`, with room for framing."""


@dataclass(frozen=True, slots=True, kw_only=True)
class H2Limits:
    """What one peer may take of the server. The defaults sit far above what a real Envoy
    uses (one message each way per stream, read as it is written) and well below what hurts
    the process; `for_message_size` scales the byte bounds with the largest message."""

    max_message_bytes: int = DEFAULT_MESSAGE_BYTES
    """A gRPC message's length prefix over this fails its stream (RESOURCE_EXHAUSTED)."""
    stream_buffer_bytes: int = 2 * DEFAULT_MESSAGE_BYTES
    """Bytes one stream holds: received and not yet handed to its handler, plus answers not
    yet written (body mutations included). Over it the stream fails, RESOURCE_EXHAUSTED."""
    connection_buffer_bytes: int = 4 * DEFAULT_MESSAGE_BYTES
    """The same, summed over a connection's streams."""
    process_buffer_bytes: int = 8 * DEFAULT_MESSAGE_BYTES
    """The same, summed over every connection of the process."""
    max_streams: int = 1000
    """Concurrent streams per connection, advertised; one more is refused (REFUSED_STREAM)."""
    max_connections: int = 1000
    """Per process, and at most half the open-file limit (the rest is for upstream calls)."""
    max_header_list_bytes: int = 64 << 10
    """A header block's decoded size (h2 also stops a CONTINUATION flood at 64 frames)."""
    resets_per_sec: float = 100.0
    """Streams the peer resets before their answers (or opens over `max_streams`) per second,
    on average... (a reset once every message is answered, as Envoy ends streams, is free)"""
    reset_burst: int = 1000
    """...and at once; past the budget, GOAWAY ENHANCE_YOUR_CALM and the connection closes."""
    process_resets_per_sec: float = 200.0
    """The same count over every connection of the process, on average...: a peer that
    reconnects after each GOAWAY gets no fresh burst (memory: one bucket, whatever the peers)"""
    process_reset_burst: int = 2000
    """...and at once; past it, a connection that cuts a stream short is sent GOAWAY
    ENHANCE_YOUR_CALM, takes no new streams and closes once those in flight are done."""
    preface_secs: float = 10.0
    """From accept to the client's preface and SETTINGS."""
    idle_secs: float = 300.0
    """A connection with no stream open for this long (since its last one ended, or since it
    opened) is closed (GOAWAY NO_ERROR); PINGs do not keep it open."""
    message_secs: float = 30.0
    """From a message's first byte to its last (a length prefix that lies, then silence):
    over it the stream fails, DEADLINE_EXCEEDED."""
    write_stall_secs: float = 30.0
    """Answers waiting on a peer that neither reads nor opens its window: the connection
    closes."""

    @classmethod
    def for_message_size(cls, max_message_bytes: int, **changes: Any) -> H2Limits:
        """The defaults, with the byte bounds scaled to `max_message_bytes`."""
        scaled = cls(
            max_message_bytes=max_message_bytes,
            stream_buffer_bytes=2 * max_message_bytes,
            connection_buffer_bytes=4 * max_message_bytes,
            process_buffer_bytes=8 * max_message_bytes,
        )
        return dataclasses.replace(scaled, **changes)

    @property
    def tick_secs(self) -> float:
        """How often a connection's timers are checked: a quarter of the shortest, at most 1 s."""
        shortest = min(self.preface_secs, self.idle_secs, self.message_secs, self.write_stall_secs)
        return min(max(shortest / 4, 0.01), 1.0)
