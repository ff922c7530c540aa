"""Whose HTTP/2 a connection of the `h2` and `frames` transports speaks, set up for serving:
`h2_frames.FrameConnection` (`frames`: frames read and written for what an ext_proc peer sends)
or the `h2` library's general state machine (`h2`), with the same calls and events (`HTTP2`).

Both are sans-IO: bytes in (`receive_data`), events out, bytes to write (`data_to_send`).
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import h2.config
import h2.connection
import h2.events
import h2.frame_buffer
import h2.settings
from hyperframe.frame import DataFrame, Frame

from .h2_frames import FrameConnection
from .h2_limits import H2Limits

Engine = Literal["h2", "frames"]
"""Whose HTTP/2 the connection speaks: the `h2` library's state machine, or `h2_frames`'
frames read and written for what an ext_proc peer sends (the same calls and events)."""
ENGINES: tuple[Engine, ...] = ("h2", "frames")

STREAM_WINDOW = 16 << 20
"""Our receive window per stream: a body of a few MB arrives without waiting on us."""
CONNECTION_WINDOW = 64 << 20
_UNLIMITED_STREAMS = (1 << 31) - 1
"""What h2 itself enforces: over the advertised limit it would end the whole connection."""
_CONFIG = h2.config.H2Configuration(
    client_side=False,
    header_encoding=None,
    # Envoy's headers are well-formed; h2's checks cost more than the rest of a stream.
    validate_inbound_headers=False,
    validate_outbound_headers=False,
    normalize_inbound_headers=False,
    normalize_outbound_headers=False,
)


class HTTP2(Protocol):
    """What a connection asks of an HTTP/2 state machine (`h2`'s `H2Connection` or
    `FrameConnection`)."""

    def receive_data(self, data: bytes) -> list[h2.events.Event]: ...
    def send_headers(
        self, stream_id: int, headers: list[tuple[bytes, bytes]], end_stream: bool = False
    ) -> None: ...
    def send_data(self, stream_id: int, data: Any, end_stream: bool = False) -> None: ...
    def reset_stream(self, stream_id: int, error_code: int = 0) -> None: ...
    def acknowledge_received_data(self, acknowledged_size: int, stream_id: int) -> None: ...
    def local_flow_control_window(self, stream_id: int) -> int: ...
    @property
    def max_outbound_frame_size(self) -> int: ...
    def data_to_send(self) -> bytes: ...


def serving(engine: Engine, limits: H2Limits) -> HTTP2:
    """The server side of a new connection on `engine`, its preface (our SETTINGS, the
    connection's window opened wide) queued in `data_to_send`."""
    if engine == "frames":
        frames = FrameConnection()
        frames.initiate(
            max_streams=limits.max_streams,
            stream_window=STREAM_WINDOW,
            connection_window=CONNECTION_WINDOW,
            max_header_list_bytes=limits.max_header_list_bytes,
        )
        return frames
    connection = h2.connection.H2Connection(config=_CONFIG)
    connection.incoming_buffer = _FrameBuffer(server=True)
    _start_h2(connection, limits)
    return connection


def _unnamed_payload() -> str:
    return "<payload>"


class _FrameBuffer(h2.frame_buffer.FrameBuffer):
    """h2's frame buffer, whose DATA frames keep their payload out of their repr.

    h2 formats every frame it receives for its trace log (`repr(frame)`, whether or not
    anything logs), and a DATA frame's repr hex-dumps its whole payload: a copy, a hex string
    twice its size and that string's decode, for every byte received. That was the largest
    per-byte cost of a large body (docs/performance.md, "Envoy processor transport")."""

    def __next__(self) -> Frame:
        frame = super().__next__()
        if type(frame) is DataFrame:
            frame._body_repr = _unnamed_payload  # type: ignore[method-assign]
        return frame


def _start_h2(h: h2.connection.H2Connection, limits: H2Limits) -> None:
    """Our SETTINGS and the connection's window, on `h2`."""
    settings = {
        h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: limits.max_streams,
        h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
        h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: limits.max_header_list_bytes,
    }
    h.local_settings = h2.settings.Settings(client=False, initial_values=settings)
    h.initiate_connection()  # advertises `settings`
    # h2 answers a stream over its own limit by ending the connection (PROTOCOL_ERROR);
    # the limit is enforced by the connection instead, refusing that stream alone.
    settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] = _UNLIMITED_STREAMS
    h.local_settings = h2.settings.Settings(client=False, initial_values=settings)
    h.decoder.max_header_list_size = limits.max_header_list_bytes
    h.increment_flow_control_window(CONNECTION_WINDOW - 65535)
