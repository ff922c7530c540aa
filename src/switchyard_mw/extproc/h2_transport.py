"""`switchyard-mw extproc` (transports `frames`, the default, and `h2`): ext_proc over HTTP/2.

grpc.aio spends most of a processor's CPU on its own machinery: about 0.44 ms per request for a
processor that does almost nothing, against 0.13-0.15 ms for the same work over a plain asyncio
HTTP/2 connection (docs/performance.md, "Envoy processor transport"). This module is that
connection: gRPC's framing (a 5-byte prefix per message, `grpc-status` in the trailers) over an
HTTP/2 state machine (`Engine`: `h2_frames.FrameConnection`, frames read and written for what
an ext_proc peer sends, or the `h2` library's general one, with the same calls and events),
serving the two methods Envoy calls, `ExternalProcessor/Process` and
`Health/Check` (with `Health/Watch`, for probes that watch). Each message of a stream is
handled in turn in its own task (the handler may await a judge or a shared store), with the
stream's own contextvars.

What it does not do, and grpc.aio (`--transport grpcio`) would: TLS (listen on loopback or a
unix socket, as the grpc.aio transport is also set up), compression (never advertised, so
Envoy sends none), and `grpc-timeout` (Envoy bounds each message itself with
`message_timeout`, and resets the stream when it gives up: the stream's task is then
cancelled).

Graceful stop, as gRPC servers do it: GOAWAY with the largest stream id ("open no more"), then,
after a round trip's grace, GOAWAY with the last stream id accepted; streams in flight finish,
later ones are refused (REFUSED_STREAM, which a client may retry elsewhere). `h2` closes its
state machine as soon as it sends a GOAWAY (python-hyper/h2#1181), which would cut the streams
in flight, so the two GOAWAY frames are written beside it.

The listener also serves whatever else can reach it, so everything a peer controls is bounded
(`H2Limits`, one frozen object handed to the server): bytes held per stream, connection and
process (received and not yet handed to a handler, answers not yet written), streams per
connection (one over is refused alone, REFUSED_STREAM), streams reset before their answer
per second, per connection and per process (past the budget GOAWAY ENHANCE_YOUR_CALM, as
Envoy, Go and nghttp2 answer a rapid reset; Envoy itself resets every stream once answered,
which costs nothing; the process's budget leaves no fresh burst to a peer that reconnects
after each GOAWAY), the preface,
an idle connection, a message that stops arriving, a peer that stops reading, header blocks,
and connections per process (at the cap the longest-idle connection makes room; at the fd
limit accepting pauses for a second, one log line per episode).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import os
import resource
import socket
import stat
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.frame_buffer
import h2.settings
from google.protobuf.message import DecodeError
from hyperframe.frame import DataFrame, Frame, GoAwayFrame

from .._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from .h2_accounting import Buffers, ProcessBytes, ProcessResets, ResetBudget
from .h2_frames import FrameConnection
from .h2_framing import (
    DEADLINE_EXCEEDED,
    INVALID_ARGUMENT,
    OK,
    PREFIX_BYTES,
    RESOURCE_EXHAUSTED,
    RESPONSE_HEADERS,
    UNAVAILABLE,
    UNIMPLEMENTED,
    UNKNOWN,
    Refusal,
    frame,
    read_headers,
    trailers,
)
from .h2_health import Health
from .h2_stream import (
    FINISHING,
    REQUEST_DONE,
    TAKING,
    UNANSWERED,
    Stream,
    StreamInput,
    StreamState,
)
from .h2_timers import ConnectionTimers, Expiry

_log = logging.getLogger(__name__)

PROCESS_PATH = b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"
CHECK_PATH = b"/grpc.health.v1.Health/Check"
WATCH_PATH = b"/grpc.health.v1.Health/Watch"
STREAM_WINDOW = 16 << 20
"""Our receive window per stream: a body of a few MB arrives without waiting on us."""
CONNECTION_WINDOW = 64 << 20
DRAIN_ROUND_TRIP_SECS = 0.2
"""Between the two GOAWAY frames: time for a stream the client opened as we sent the first."""
_LAST_STREAM_ID = (1 << 31) - 1
_UNLIMITED_STREAMS = (1 << 31) - 1
"""What h2 itself enforces: over the advertised limit it would end the whole connection."""
DEFAULT_MESSAGE_BYTES = (32 << 20) + (1 << 20)
"""The largest message at the default `[server] max_body_bytes`, with room for framing."""
WRITE_BUFFER_BYTES = 1 << 20
"""Bytes the socket may hold unsent before writing pauses (asyncio's high-water mark)."""
_WRITE_BATCH = 256 << 10
"""Handed to the socket at a time, so that a paused socket stops a large answer midway."""
LINGER_SECS = 1.0
"""After a GOAWAY that ends a connection, input is read and dropped this long before closing
(and a closing connection's unsent output is dropped after it)."""
BACKLOG = 1024
ACCEPT_RETRY_SECS = 1.0
"""Out of file descriptors: accepting pauses this long (asyncio's own retry delay)."""
_ACCEPT_BATCH = 64
_CONFIG = h2.config.H2Configuration(
    client_side=False,
    header_encoding=None,
    # Envoy's headers are well-formed; h2's checks cost more than the rest of a stream.
    validate_inbound_headers=False,
    validate_outbound_headers=False,
    normalize_inbound_headers=False,
    normalize_outbound_headers=False,
)
_PROCESS_LOG_EVERY_SECS = 60.0
"""The process-wide reset budget's log line comes at most this often (an attacker reconnecting
after each GOAWAY would otherwise write one per connection)."""


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


class Handler(Protocol):
    """One ext_proc stream's state: answers each message in turn, released once at the end.
    None: nothing to send now (a stream that pushes its answers itself, see `Pushing`)."""

    def on(self, request: ep.ProcessingRequest) -> Awaitable[ep.ProcessingResponse | None]: ...


@runtime_checkable
class Pushing(Protocol):
    """A handler whose answers are not one per message (`first_token`): it is handed how to
    send one whenever it has one (a timer, a held answer let go)."""

    def attach(self, emit: Callable[[ep.ProcessingResponse], None]) -> None: ...


Engine = Literal["h2", "frames"]
"""Whose HTTP/2 the connection speaks: the `h2` library's state machine, or `h2_frames`'
frames read and written for what an ext_proc peer sends (the same calls and events)."""
ENGINES: tuple[Engine, ...] = ("h2", "frames")


class HTTP2(Protocol):
    """What `_Connection` asks of an HTTP/2 state machine (`h2`'s `H2Connection` or
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


OpenStream = Callable[[list[tuple[str, bytes]]], Handler]
"""Makes a stream's handler from its metadata (the request headers that are not pseudo-headers)."""
EndStream = Callable[[Handler], None]


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


def _h2_connection() -> h2.connection.H2Connection:
    connection = h2.connection.H2Connection(config=_CONFIG)
    connection.incoming_buffer = _FrameBuffer(server=True)
    return connection


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
    # the limit is enforced in `_on_request` instead, refusing that stream alone.
    settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] = _UNLIMITED_STREAMS
    h.local_settings = h2.settings.Settings(client=False, initial_values=settings)
    h.decoder.max_header_list_size = limits.max_header_list_bytes
    h.increment_flow_control_window(CONNECTION_WINDOW - 65535)


_ANSWER = StreamInput.ANSWER
_REQUEST_END = StreamInput.REQUEST_END
_FINISH = StreamInput.FINISH
_CLOSE = StreamInput.CLOSE
_CLOSED = StreamState.CLOSED


class _Connection(asyncio.Protocol):
    """One HTTP/2 connection from Envoy (or a health probe): h2's events in, its streams'
    messages to their handlers, answers and trailers out, GOAWAY when it ends.

    The rest is in units of its own: gRPC framing (`h2_framing`), a stream's states
    (`h2_stream`), bytes held and streams cut short (`h2_accounting`), the timers
    (`h2_timers`) and the health service (`h2_health`)."""

    def __init__(self, server: H2Server) -> None:
        self.server = server
        limits = self.limits = server.limits
        self.loop = asyncio.get_running_loop()
        self.h2: HTTP2 = FrameConnection() if server.engine == "frames" else _h2_connection()
        self.streams: dict[int, Stream] = {}
        self.transport: asyncio.Transport | None = None
        self.last_stream = 0
        self.refuse_above: int | None = None
        """Set by the final GOAWAY (or one asking the peer to calm down): streams above it
        are refused."""
        self._flush_pending = False
        self.closed = False
        self.buffers = Buffers(
            limits.stream_buffer_bytes, limits.connection_buffer_bytes, server.buffers
        )
        self.blocked: set[Stream] = set()
        """Streams with answers the peer's flow-control window holds back."""
        now = self.loop.time()
        self.timers: ConnectionTimers[Stream] = ConnectionTimers(
            now,
            preface_secs=limits.preface_secs,
            idle_secs=limits.idle_secs,
            message_secs=limits.message_secs,
            write_stall_secs=limits.write_stall_secs,
        )
        self.writing_paused = False
        self.resets = ResetBudget(limits.resets_per_sec, limits.reset_burst, now)
        self._timer: asyncio.TimerHandle | None = None

    @property
    def active_at(self) -> float:
        """When a stream last opened or ended here (the longest idle makes room first)."""
        return self.timers.active_at

    # asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=WRITE_BUFFER_BYTES)
        self.server.open_connections += 1
        self.server.connections.add(self)
        self.server.idle.clear()
        limits = self.limits
        h = self.h2
        if isinstance(h, FrameConnection):
            h.initiate(
                max_streams=limits.max_streams,
                stream_window=STREAM_WINDOW,
                connection_window=CONNECTION_WINDOW,
                max_header_list_bytes=limits.max_header_list_bytes,
            )
        else:
            assert isinstance(h, h2.connection.H2Connection)
            _start_h2(h, limits)
        transport.write(h.data_to_send())
        self._timer = self.loop.call_later(self.limits.tick_secs, self._check)
        if self.server.draining:
            self.drain()

    def connection_lost(self, exc: Exception | None) -> None:
        self._mark_closed()
        self.server.connections.discard(self)
        if not self.server.connections:
            self.server.idle.set()
        self.transport = None
        if self._timer is not None:
            self._timer.cancel()
        for stream in list(self.streams.values()):
            self._drop(stream)

    def pause_writing(self) -> None:
        # The peer reads no more: stop reading it too (a flood of PINGs or SETTINGS would
        # otherwise queue their answers without end) until it does, or the stall timer ends it.
        self.writing_paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.writing_paused = False
        self.timers.sent_at = self.loop.time()
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()
        for stream in list(self.streams.values()):
            self._send_out(stream)
        self._flush()

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return  # lingering after a GOAWAY: read and drop, so the peer gets it (no RST)
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError:
            self._write(self.h2.data_to_send())
            self._close()
            return
        received: dict[int, int] = {}  # flow-controlled bytes per stream, credited per read
        for event in events:
            if self.closed:
                return
            kind = type(event)
            if kind is h2.events.DataReceived:
                sid = event.stream_id  # type: ignore[attr-defined]
                received[sid] = received.get(sid, 0) + event.flow_controlled_length  # type: ignore[attr-defined]
                self._on_data(event)  # type: ignore[arg-type]
            elif kind is h2.events.RequestReceived:
                self._on_request(event)  # type: ignore[arg-type]
            elif kind is h2.events.StreamEnded:
                self._on_request_end(event.stream_id)  # type: ignore[attr-defined]
            elif kind is h2.events.StreamReset:
                self._on_reset(event.stream_id)  # type: ignore[attr-defined]
            elif kind is h2.events.WindowUpdated or kind is h2.events.RemoteSettingsChanged:
                self.timers.greeted = True  # the client's first SETTINGS ends its preface
                for stream in list(self.streams.values()):
                    self._send_out(stream)
            elif kind is h2.events.ConnectionTerminated:
                self._write(self.h2.data_to_send())
                self._close()
                return
        # Credited back at once (before the next read): the byte account bounds what a
        # stream, connection and process keep.
        acknowledge = self.h2.acknowledge_received_data
        for sid, size in received.items():
            try:  # noqa: SIM105 (suppress: three calls a stream, where `try` costs none)
                acknowledge(size, sid)
            except h2.exceptions.StreamClosedError:
                pass
        self._write(self.h2.data_to_send())

    # incoming -----------------------------------------------------------------------------
    def _on_request(self, event: h2.events.RequestReceived) -> None:
        sid = event.stream_id
        if (self.refuse_above is not None and sid > self.refuse_above) or len(
            self.streams
        ) >= self.limits.max_streams:
            # A stream error, not a connection error (RFC 9113 5.1.2): the others live on.
            self.h2.reset_stream(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
            self._count_reset()
            return
        self.last_stream = max(self.last_stream, sid)
        # header_encoding=None: h2 hands names and values over as bytes
        call = read_headers(event.headers or ())
        if not call.content_type.startswith(b"application/grpc"):
            self.h2.send_headers(sid, [(b":status", b"415")], end_stream=True)
            return
        path = call.path
        stream = Stream(sid, path)
        self.streams[sid] = stream
        self.timers.active_at = self.loop.time()
        if call.encoding not in (b"", b"identity"):
            self._fail(stream, UNIMPLEMENTED, f"grpc-encoding {call.encoding.decode('latin-1')}")
        elif path == PROCESS_PATH:
            stream.context = contextvars.copy_context()
            try:
                stream.handler = stream.context.run(self.server.open_stream, call.metadata)
                # `Pushing` by its one method: a runtime-checkable Protocol's isinstance walks
                # the protocol's attributes on every call, a large share of a stream's cost.
                attach = getattr(stream.handler, "attach", None)
                if attach is not None:
                    attach(lambda answer: self._push(stream, answer))
            except Exception as exc:
                _log.exception("ext_proc stream could not start")
                self._fail(stream, UNKNOWN, f"{type(exc).__name__}: {exc}")
        elif path not in (CHECK_PATH, WATCH_PATH):
            self._fail(stream, UNIMPLEMENTED, f"method {path.decode('latin-1')} not found")
        if event.stream_ended is not None:
            self._on_request_end(sid)

    def _on_reset(self, sid: int) -> None:
        stream = self.streams.get(sid)
        if stream is None:
            return
        cut_short = stream.unanswered_work()
        self._drop(stream)
        if cut_short:  # the work a rapid reset costs us
            self._count_reset()

    def _count_reset(self) -> None:
        """Spend one of the connection's reset budget and one of the process's. Past the
        connection's, it is closed at once; past the process's, it is asked to go (GOAWAY
        ENHANCE_YOUR_CALM) and its streams in flight may finish: it may be an innocent one
        (Envoy) resetting a stream while another peer spends the budget."""
        now = self.loop.time()
        own = self.resets.spend(now)
        shared = self.server.resets.spend(now)
        limits = self.limits
        if not own:
            _log.warning(
                "ext_proc h2: a client reset or over-opened streams faster than %g/s "
                "(burst %d); closing its connection with ENHANCE_YOUR_CALM",
                limits.resets_per_sec,
                limits.reset_burst,
            )
            self._goodbye(h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, linger=True)
        elif not shared and self.refuse_above is None:
            trips = self.server.resets.tripped(now)
            if trips is not None:
                _log.warning(
                    "ext_proc h2: clients reset or over-opened streams faster than %g/s "
                    "(burst %d) across the process; %d connection(s) asked to go with "
                    "ENHANCE_YOUR_CALM (one line per %g s at most)",
                    limits.process_resets_per_sec,
                    limits.process_reset_burst,
                    trips,
                    _PROCESS_LOG_EVERY_SECS,
                )
            self._calm_down()

    def _calm_down(self) -> None:
        """GOAWAY ENHANCE_YOUR_CALM: no new streams; those in flight may finish, then close."""
        if not self.streams:
            self._goodbye(h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, linger=True)
            return
        self.refuse_above = self.last_stream
        self._goaway(self.last_stream, h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)

    def _on_data(self, event: h2.events.DataReceived) -> None:
        stream = self.streams.get(event.stream_id)
        data = event.data
        if stream is None or stream.state not in TAKING or not data:
            return
        if not stream.size:
            stream.partial_at = self.loop.time()
            self.timers.partial.add(stream)
        stream.add(data)
        over = self.buffers.add(stream, len(data))
        if over is not None:
            self._overflow(stream, over)
            return
        self._take_messages(stream)

    def _take_messages(self, stream: Stream) -> None:
        """Hand each whole message the stream has received to it, in order."""
        limit = self.limits.max_message_bytes
        while stream.size >= PREFIX_BYTES:  # (a call fewer per DATA frame than asking)
            payload = stream.next_message(limit)
            if payload is None:
                break
            if isinstance(payload, Refusal):
                self._fail(stream, payload.status, payload.detail)
                return
            stream.partial_at = self.loop.time()
            self._on_message(stream, payload)
            if stream.state not in TAKING:
                return
        if not stream.size:
            self.timers.partial.discard(stream)

    def _overflow(self, stream: Stream, over: str) -> None:
        """The stream took on more bytes than a bound allows: it fails, its holds let go."""
        self._empty(stream)
        self._fail(stream, RESOURCE_EXHAUSTED, over)

    def _empty(self, stream: Stream) -> None:
        """Let go of all the stream holds (its answers unsent are lost)."""
        stream.drop_partial()
        stream.pending.clear()
        stream.out.clear()
        self.timers.partial.discard(stream)
        self.blocked.discard(stream)
        self.buffers.forget(stream)

    def _on_message(self, stream: Stream, payload: memoryview) -> None:
        # The prefix is held until the payload is taken: one account call per message.
        if stream.handler is not None:
            stream.pending.append(payload)
            if stream.task is None:
                stream.task = self.loop.create_task(self._work(stream), context=stream.context)
            return
        self.buffers.release(stream, PREFIX_BYTES + len(payload))
        health = self.server.health
        verdict = health.judge(payload, asked=stream.service is not None)
        stream.service = verdict.service
        if verdict.status != OK:
            self._fail(stream, verdict.status, verdict.detail)
        elif stream.method == WATCH_PATH:
            health.watch(stream, lambda: self.send_health(stream))
            self.send_health(stream)
        else:
            self.send_health(stream)
            self._finish(stream)

    def _on_request_end(self, sid: int) -> None:
        stream = self.streams.get(sid)
        if stream is None or stream.step(_REQUEST_END) in REQUEST_DONE:
            return
        if stream.method == WATCH_PATH:
            return  # a watch lasts until the client cancels it or the connection goes
        if stream.task is None and stream.state not in FINISHING:
            self._finish(stream)

    # the handler --------------------------------------------------------------------------
    async def _work(self, stream: Stream) -> None:
        """Answer the stream's pending messages in order, then let the next one start a task."""
        handler = stream.handler
        assert handler is not None
        try:
            while stream.pending and stream.state in TAKING:
                payload = stream.pending.popleft()
                self.buffers.release(stream, PREFIX_BYTES + len(payload))
                try:
                    request = ep.ProcessingRequest.FromString(payload)
                except DecodeError:
                    self._fail(stream, INVALID_ARGUMENT, "cannot parse ProcessingRequest")
                    break
                del payload
                try:
                    answer = await handler.on(request)
                except Exception as exc:
                    _log.exception("ext_proc stream failed")
                    self._fail(stream, UNKNOWN, f"{type(exc).__name__}: {exc}")
                    break
                if answer is not None:
                    self._send(stream, answer.SerializeToString())
        finally:
            stream.task = None  # before any later message: that one starts a new task
        if stream.state in REQUEST_DONE and stream.state not in FINISHING:
            self._finish(stream)
        self._flush_soon()

    # outgoing -----------------------------------------------------------------------------
    def _push(self, stream: Stream, answer: ep.ProcessingResponse) -> None:
        """An answer a `Pushing` handler sends on its own: out now, unless the stream is
        done taking answers."""
        if stream.state in TAKING:
            self._send(stream, answer.SerializeToString())
            self._flush_soon()

    def send_health(self, stream: Stream) -> None:
        self._send(stream, self.server.health.answer(stream.service or ""))
        self._flush_soon()

    def _send(self, stream: Stream, payload: bytes) -> None:
        if stream.state is _CLOSED:
            return
        message = frame(payload)
        if not stream.out and not self.writing_paused and self._send_now(stream, message):
            return
        stream.out.append(memoryview(message))
        over = self.buffers.add(stream, len(message))
        if over is not None:
            self._overflow(stream, over)
            return
        if stream.state in UNANSWERED:
            stream.step(_ANSWER)
            self.h2.send_headers(stream.sid, RESPONSE_HEADERS)
        self._send_out(stream)

    def _send_now(self, stream: Stream, message: bytes) -> bool:
        """Hand `message` to h2 at once when the peer's window and the frame size allow it
        (every answer of a small request): never queued, never counted as held. False when
        it must wait in `out`."""
        h = self.h2
        sid = stream.sid
        try:
            if len(message) > min(h.local_flow_control_window(sid), h.max_outbound_frame_size):
                return False
            if stream.state in UNANSWERED:
                stream.step(_ANSWER)
                h.send_headers(sid, RESPONSE_HEADERS)
            h.send_data(sid, message)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self._drop(stream)
            return True
        self.timers.sent_at = self.loop.time()
        return True

    def _fail(self, stream: Stream, status: int, detail: str) -> None:
        """End the stream with `status` once its answers are out; what it received is dropped."""
        stream.status, stream.detail = status, detail
        dropped = stream.drop_partial() + sum(PREFIX_BYTES + len(p) for p in stream.pending)
        stream.pending.clear()
        self.timers.partial.discard(stream)
        self.buffers.release(stream, dropped)
        self._finish(stream)

    def _finish(self, stream: Stream) -> None:
        """End the stream with its status once what it still has to send is sent; with
        nothing sent yet, at once (trailers only)."""
        if stream.state not in UNANSWERED:
            stream.step(_FINISH)
            self._send_out(stream)
            return
        try:
            self._end_stream(stream)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self._drop(stream)

    def _send_out(self, stream: Stream) -> None:
        h = self.h2
        sid = stream.sid
        out = stream.out
        batch = 0
        try:
            while out:
                chunk = out[0]
                room = min(len(chunk), h.local_flow_control_window(sid), h.max_outbound_frame_size)
                if room <= 0 or self.writing_paused:
                    # The rest goes when the client opens its window (WindowUpdated) or reads
                    # again (resume_writing); the stall timer watches the wait.
                    self.blocked.add(stream)
                    return
                h.send_data(sid, chunk[:room])
                self.buffers.release(stream, room)
                if room == len(chunk):
                    out.popleft()
                else:
                    out[0] = chunk[room:]
                batch += room
                if batch >= _WRITE_BATCH:  # to the socket now: a full one pauses writing
                    batch = 0
                    self.timers.sent_at = self.loop.time()
                    self._write(h.data_to_send())
            if batch:
                self.timers.sent_at = self.loop.time()
            self.blocked.discard(stream)
            if stream.state in FINISHING:
                self._end_stream(stream)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self._drop(stream)

    def _end_stream(self, stream: Stream) -> None:
        """The trailers (a trailers-only answer when nothing was sent), then CLOSED."""
        block = trailers(stream.status, stream.detail, trailers_only=stream.state in UNANSWERED)
        self.h2.send_headers(stream.sid, block, end_stream=True)
        if stream.status != OK and stream.state not in REQUEST_DONE:
            # The rest of the request is of no use: ask the client to stop sending it
            # (RFC 9113 8.1: a complete response, then RST_STREAM with NO_ERROR).
            self.h2.reset_stream(stream.sid, h2.errors.ErrorCodes.NO_ERROR)
        self._release(stream)

    def _drop(self, stream: Stream) -> None:
        """The stream is gone (reset, or its connection closed): stop its work."""
        self._empty(stream)
        if stream.task is not None:
            stream.task.cancel()
        self._release(stream)

    def _release(self, stream: Stream) -> None:
        if stream.step(_CLOSE) is _CLOSED:
            return
        self._empty(stream)
        self.streams.pop(stream.sid, None)
        self.timers.active_at = self.loop.time()
        if stream.task is None:
            self._end(stream)
        else:
            # The stream failed mid-answer: nobody takes what it makes. The stream ends once
            # the task has unwound (a callback, not the task's `finally`: a task cancelled
            # before its first step runs none), and only such a task needs one.
            stream.task.cancel()
            stream.task.add_done_callback(lambda _: self._end(stream))
        self.server.health.unwatch(stream)
        if self.refuse_above is not None and not self.streams:
            self.loop.call_soon(self._close)

    def _end(self, stream: Stream) -> None:
        """The handler's end: once, as the stream closed once."""
        if stream.handler is not None:
            self.server.end_stream(stream.handler)

    def _flush_soon(self) -> None:
        if not self._flush_pending:
            self._flush_pending = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        self._write(self.h2.data_to_send())

    def _write(self, data: bytes) -> None:
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _close(self) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            self._flush()
            transport.close()
            # close() waits for the peer to take what is buffered; a peer that reads no more
            # would hold the connection open for good.
            self.loop.call_later(LINGER_SECS, transport.abort)
        self._mark_closed()

    def _mark_closed(self) -> None:
        if not self.closed:
            self.closed = True
            self.server.open_connections -= 1

    def _goodbye(self, code: h2.errors.ErrorCodes, *, linger: bool = False) -> None:
        """GOAWAY with `code` and the last stream accepted, then close; with `linger`, once
        the peer has had `LINGER_SECS` to read it (a peer still sending would otherwise get
        the connection reset, and the GOAWAY lost with it)."""
        self._goaway(self.last_stream, code)
        transport = self.transport
        if (
            not linger
            or transport is None
            or transport.is_closing()
            or not transport.can_write_eof()
        ):
            self._close()
            return
        transport.write_eof()
        self._mark_closed()
        for stream in list(self.streams.values()):
            self._drop(stream)
        self.loop.call_later(LINGER_SECS, transport.abort)

    # timers -------------------------------------------------------------------------------
    def _check(self) -> None:
        """The connection's timers (`ConnectionTimers`), checked every `tick_secs`."""
        if self.closed:
            return
        now = self.loop.time()
        timers = self.timers
        expiry = timers.expired(
            now,
            streams_open=bool(self.streams),
            waiting_on_peer=self.writing_paused or bool(self.blocked),
        )
        if expiry is Expiry.NO_PREFACE:
            self._close()  # no preface, no HTTP/2 to say goodbye in
            return
        if expiry is not Expiry.NONE:
            self._goodbye(h2.errors.ErrorCodes.NO_ERROR)
            return
        late = f"message incomplete after {self.limits.message_secs:g} s"
        for stream in timers.late(now):
            self._fail(stream, DEADLINE_EXCEEDED, late)
        self._flush()
        self._timer = self.loop.call_later(self.limits.tick_secs, self._check)

    # stopping -----------------------------------------------------------------------------
    def _goaway(
        self, last_stream_id: int, code: h2.errors.ErrorCodes = h2.errors.ErrorCodes.NO_ERROR
    ) -> None:
        frame = GoAwayFrame(0)
        frame.last_stream_id = last_stream_id
        frame.error_code = code
        self._flush()
        self._write(frame.serialize())

    def drain(self) -> None:
        """Ask the client to open no more streams; close once those in flight are done."""
        self._goaway(_LAST_STREAM_ID)
        self.loop.call_later(DRAIN_ROUND_TRIP_SECS, self._final_goaway)

    def _final_goaway(self) -> None:
        if self.transport is None:
            return
        self.refuse_above = self.last_stream
        self._goaway(self.last_stream)
        if not self.streams or all(s.method == WATCH_PATH for s in self.streams.values()):
            self._close()

    def abort(self) -> None:
        """Grace is over: end what is still running as UNAVAILABLE and close."""
        for stream in list(self.streams.values()):
            if stream.task is not None:
                stream.task.cancel()
            self._empty(stream)
            self._fail(stream, UNAVAILABLE, "server stopping")
        self._close()


class H2Server:
    """A listening ext_proc server on `h2`; `port` is the bound TCP port (None for unix)."""

    def __init__(
        self,
        open_stream: OpenStream,
        end_stream: EndStream,
        *,
        services: Iterable[str],
        limits: H2Limits | None = None,
        engine: Engine = "h2",
    ) -> None:
        if engine not in ENGINES:
            raise ValueError(f"engine {engine!r}: expected one of {', '.join(ENGINES)}")
        self.engine = engine
        self.open_stream = open_stream
        self.end_stream = end_stream
        self.limits = limits if limits is not None else H2Limits()
        self.health = Health(frozenset(services))
        self.connections: set[_Connection] = set()
        self.open_connections = 0
        """Connections not yet closing: what `max_connections` counts."""
        self.buffers = ProcessBytes(self.limits.process_buffer_bytes)
        # time.monotonic is the event loop's clock (and the server may be made before it runs).
        self.resets = ProcessResets(
            self.limits.process_resets_per_sec,
            self.limits.process_reset_burst,
            time.monotonic(),
            log_every_secs=_PROCESS_LOG_EVERY_SECS,
        )
        self.idle = asyncio.Event()
        """Set while no connection is open."""
        self.idle.set()
        self.draining = False
        self.port: int | None = None
        self._listeners: list[_Listener] = []

    @property
    def held(self) -> int:
        """Bytes held by every stream of every connection (see `Stream.held`)."""
        return self.buffers.held

    @property
    def max_message_bytes(self) -> int:
        return self.limits.max_message_bytes

    @property
    def max_connections(self) -> int:
        """`limits.max_connections`, or half the open-file limit when that is lower."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.limits.max_connections
        return max(1, min(self.limits.max_connections, soft // 2))

    async def listen(self, address: str, *, reuse_port: bool = False) -> None:
        """Bind `address` (`host:port`, `[v6]:port` or `unix:/path`, as `parse_listen` checks)."""
        if address.startswith("unix:"):
            sockets = [_unix_socket(address[len("unix:") :])]
        else:
            host, _, port = address.rpartition(":")
            sockets = await _tcp_sockets(host.strip("[]"), int(port), reuse_port)
            self.port = sockets[0].getsockname()[1]
        cap = self.max_connections
        self._listeners = [_Listener(self, sock, cap) for sock in sockets]

    def make_room(self) -> bool:
        """Close the connection idle the longest (no stream open) to admit a new one; False
        when every connection has streams open."""
        idle = [c for c in self.connections if not c.streams and not c.closed]
        if not idle:
            return False
        min(idle, key=lambda c: c.active_at)._goodbye(h2.errors.ErrorCodes.NO_ERROR)
        return True

    async def stop(self, grace_secs: float) -> None:
        """NOT_SERVING, no new connections or streams, `grace_secs` for those in flight."""
        self.health.stop_serving()
        self.draining = True
        for listener in self._listeners:
            listener.close()
        for connection in list(self.connections):
            connection.drain()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.idle.wait(), max(grace_secs, DRAIN_ROUND_TRIP_SECS))
        for connection in list(self.connections):
            connection.abort()
        for listener in self._listeners:
            await listener.closed()


class _Listener:
    """Accepts connections on one listening socket, up to the connection cap.

    asyncio's own accept loop, on running out of file descriptors, logs a traceback for each
    of up to `backlog` tries in a row and schedules as many retries; this one logs one line
    per episode and retries once a second.
    """

    def __init__(self, server: H2Server, sock: socket.socket, max_connections: int) -> None:
        self.server = server
        self.sock = sock
        self.max_connections = max_connections
        self.loop = asyncio.get_running_loop()
        self.starting: set[asyncio.Task[Any]] = set()
        self.out_of_files = False
        self._retry: asyncio.TimerHandle | None = None
        self.loop.add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                if self.out_of_files:  # all waiting were taken: the episode is over
                    self.out_of_files = False
                    _log.warning("ext_proc h2: accepting connections again")
                return
            except OSError as exc:  # EMFILE and its kin, or anything else accept may say
                self._back_off(exc)
                return
            conn.setblocking(False)
            if not self._admit():
                conn.close()
                continue
            task = self.loop.create_task(
                self.loop.connect_accepted_socket(lambda: _Connection(self.server), conn)
            )
            self.starting.add(task)
            task.add_done_callback(self._started)

    def _admit(self) -> bool:
        count = self.server.open_connections + len(self.starting)
        return count < self.max_connections or self.server.make_room()

    def _started(self, task: asyncio.Task[Any]) -> None:
        self.starting.discard(task)
        if not task.cancelled() and task.exception() is not None:
            _log.debug("ext_proc h2: a connection could not start: %s", task.exception())

    def _back_off(self, exc: OSError) -> None:
        """Out of file descriptors (or memory): pause accepting, retry once a second, one log
        line per episode."""
        if not self.out_of_files:
            self.out_of_files = True
            _log.warning(
                "ext_proc h2: cannot accept connections (%s); retrying every %g s",
                exc.strerror,
                ACCEPT_RETRY_SECS,
            )
        self.server.make_room()  # an idle connection's descriptor serves the next one better
        self.loop.remove_reader(self.sock.fileno())
        self._retry = self.loop.call_later(ACCEPT_RETRY_SECS, self._resume)

    def _resume(self) -> None:
        self._retry = None
        if self.sock.fileno() >= 0:
            self.loop.add_reader(self.sock.fileno(), self._accept)

    def close(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
        if self.sock.fileno() >= 0:
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()

    async def closed(self) -> None:
        """Once the connections accepted before `close` have started."""
        if self.starting:
            await asyncio.wait(list(self.starting))


async def _tcp_sockets(host: str, port: int, reuse_port: bool) -> list[socket.socket]:
    """Listening sockets for every address `host` names, as asyncio's `create_server` binds."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(BACKLOG)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _unix_socket(path: str) -> socket.socket:
    """A listening unix socket at `path`; a stale socket file there is replaced."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.remove(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock
