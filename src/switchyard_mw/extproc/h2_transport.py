"""`switchyard-mw extproc --transport h2`: the ext_proc service over HTTP/2 on the `h2` library.

grpc.aio spends most of a processor's CPU on its own machinery: about 0.44 ms per request for a
processor that does almost nothing, against 0.13-0.15 ms for the same work over a plain asyncio
HTTP/2 connection (bench/README). This module is that connection: gRPC's framing (a 5-byte
prefix per message, `grpc-status` in the trailers) over `h2`'s state machine, serving the two
methods Envoy calls, `ExternalProcessor/Process` and `Health/Check` (with `Health/Watch`, for
probes that watch). Each message of a stream is handled in turn in its own task (the handler
may await a judge or a shared store), with the stream's own contextvars.

What it does not do, and grpc.aio would: TLS (listen on loopback or a unix socket, as the
default transport is also set up), compression (never advertised, so Envoy sends none), and
`grpc-timeout` (Envoy bounds each message itself with `message_timeout`, and resets the stream
when it gives up: the stream's task is then cancelled).

Graceful stop, as gRPC servers do it: GOAWAY with the largest stream id ("open no more"), then,
after a round trip's grace, GOAWAY with the last stream id accepted; streams in flight finish,
later ones are refused (REFUSED_STREAM, which a client may retry elsewhere). `h2` closes its
state machine as soon as it sends a GOAWAY (python-hyper/h2#1181), which would cut the streams
in flight, so the two GOAWAY frames are written beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from hyperframe.frame import GoAwayFrame

_log = logging.getLogger(__name__)

PROCESS_PATH = b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"
CHECK_PATH = b"/grpc.health.v1.Health/Check"
WATCH_PATH = b"/grpc.health.v1.Health/Watch"
MAX_STREAMS = 1000
STREAM_WINDOW = 16 << 20
"""Our receive window per stream: a body of a few MB arrives without waiting on us."""
CONNECTION_WINDOW = 64 << 20
DRAIN_ROUND_TRIP_SECS = 0.2
"""Between the two GOAWAY frames: time for a stream the client opened as we sent the first."""
_LAST_STREAM_ID = (1 << 31) - 1
_CONFIG = h2.config.H2Configuration(
    client_side=False,
    header_encoding=None,
    # Envoy's headers are well-formed; h2's checks cost more than the rest of a stream.
    validate_inbound_headers=False,
    validate_outbound_headers=False,
    normalize_inbound_headers=False,
    normalize_outbound_headers=False,
)
_SERVING = 1
_NOT_SERVING = 2
"""grpc.health.v1.HealthCheckResponse.ServingStatus"""
_RESPONSE_HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc")]

# gRPC status codes (grpc/doc/statuscodes.md)
OK = 0
UNKNOWN = 2
INVALID_ARGUMENT = 3
NOT_FOUND = 5
RESOURCE_EXHAUSTED = 8
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14


class Handler(Protocol):
    """One ext_proc stream's state: answers each message in turn, released once at the end."""

    def on(self, request: ep.ProcessingRequest) -> Awaitable[ep.ProcessingResponse]: ...


OpenStream = Callable[[list[tuple[str, bytes]]], Handler]
"""Makes a stream's handler from its metadata (the request headers that are not pseudo-headers)."""
EndStream = Callable[[Handler], None]


@dataclass(slots=True)
class Health:
    """What `Health/Check` and `Health/Watch` answer; NOT_SERVING once stopping."""

    services: frozenset[str]
    serving: bool = True
    watchers: list[tuple[_Connection, _Stream]] = field(default_factory=list)

    def status_of(self, service: str) -> int | None:
        if service not in self.services:
            return None
        return _SERVING if self.serving else _NOT_SERVING

    def stop_serving(self) -> None:
        self.serving = False
        for connection, stream in self.watchers:
            connection.send_health(stream)


def _message(payload: bytes) -> bytes:
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


class _Stream:
    __slots__ = (
        "buffer",
        "client_done",
        "context",
        "detail",
        "ended",
        "finishing",
        "handler",
        "headers_sent",
        "method",
        "out",
        "pending",
        "released",
        "service",
        "sid",
        "status",
        "task",
    )

    def __init__(self, sid: int, method: bytes) -> None:
        self.sid = sid
        self.method = method
        self.handler: Handler | None = None
        self.context: contextvars.Context | None = None
        self.buffer = bytearray()
        self.pending: deque[bytearray] = deque()
        self.task: asyncio.Task[None] | None = None
        self.out: deque[memoryview] = deque()
        self.headers_sent = False
        self.client_done = False
        self.status = OK
        self.detail = ""
        self.finishing = False
        self.service = ""
        self.released = False
        self.ended = False


class _Connection(asyncio.Protocol):
    """One HTTP/2 connection from Envoy (or a health probe) and its streams."""

    def __init__(self, server: H2Server) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.h2 = h2.connection.H2Connection(config=_CONFIG)
        self.streams: dict[int, _Stream] = {}
        self.transport: asyncio.Transport | None = None
        self.last_stream = 0
        self.refuse_above: int | None = None
        """Set by the final GOAWAY: streams above it are refused."""
        self._flush_pending = False

    # asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.server.connections.add(self)
        self.server.idle.clear()
        h = self.h2
        h.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: MAX_STREAMS,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
                h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 1 << 16,
            },
        )
        h.initiate_connection()
        h.increment_flow_control_window(CONNECTION_WINDOW - 65535)
        transport.write(h.data_to_send())
        if self.server.draining:
            self.drain()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        if not self.server.connections:
            self.server.idle.set()
        self.transport = None
        for stream in list(self.streams.values()):
            self._drop(stream)

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError:
            self._write(self.h2.data_to_send())
            self._close()
            return
        for event in events:
            kind = type(event)
            if kind is h2.events.DataReceived:
                self._on_data(event)  # type: ignore[arg-type]
            elif kind is h2.events.RequestReceived:
                self._on_request(event)  # type: ignore[arg-type]
            elif kind is h2.events.StreamEnded:
                self._on_client_end(event.stream_id)  # type: ignore[attr-defined]
            elif kind is h2.events.StreamReset:
                stream = self.streams.get(event.stream_id)  # type: ignore[attr-defined]
                if stream is not None:
                    self._drop(stream)
            elif kind is h2.events.WindowUpdated or kind is h2.events.RemoteSettingsChanged:
                for stream in list(self.streams.values()):
                    self._send_out(stream)
            elif kind is h2.events.ConnectionTerminated:
                self._write(self.h2.data_to_send())
                self._close()
                return
        self._write(self.h2.data_to_send())

    # incoming -----------------------------------------------------------------------------
    def _on_request(self, event: h2.events.RequestReceived) -> None:
        sid = event.stream_id
        if self.refuse_above is not None and sid > self.refuse_above:
            self.h2.reset_stream(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        self.last_stream = max(self.last_stream, sid)
        path = content_type = encoding = b""
        metadata: list[tuple[str, bytes]] = []
        for name, value in event.headers or ():
            assert isinstance(name, bytes)
            assert isinstance(value, bytes)
            if name[:1] == b":":
                if name == b":path":
                    path = value
            elif name == b"content-type":
                content_type = value
            elif name == b"grpc-encoding":
                encoding = value
            else:
                metadata.append((name.decode("latin-1"), value))
        if not content_type.startswith(b"application/grpc"):
            self.h2.send_headers(sid, [(b":status", b"415")], end_stream=True)
            return
        stream = _Stream(sid, path)
        self.streams[sid] = stream
        if encoding not in (b"", b"identity"):
            self._fail(stream, UNIMPLEMENTED, f"grpc-encoding {encoding.decode('latin-1')}")
        elif path == PROCESS_PATH:
            stream.context = contextvars.copy_context()
            try:
                stream.handler = stream.context.run(self.server.open_stream, metadata)
            except Exception as exc:
                _log.exception("ext_proc stream could not start")
                self._fail(stream, UNKNOWN, f"{type(exc).__name__}: {exc}")
        elif path not in (CHECK_PATH, WATCH_PATH):
            self._fail(stream, UNIMPLEMENTED, f"method {path.decode('latin-1')} not found")
        if event.stream_ended is not None:
            self._on_client_end(sid)

    def _on_data(self, event: h2.events.DataReceived) -> None:
        sid = event.stream_id
        # Credited back at once: a stream's memory is bounded by the message size limit.
        with contextlib.suppress(h2.exceptions.StreamClosedError):
            self.h2.acknowledge_received_data(event.flow_controlled_length, sid)
        stream = self.streams.get(sid)
        if stream is None or stream.finishing:
            return
        buffer = stream.buffer
        buffer += event.data or b""
        limit = self.server.max_message_bytes
        while len(buffer) >= 5:
            size = int.from_bytes(buffer[1:5], "big")
            if size > limit:
                self._fail(stream, RESOURCE_EXHAUSTED, f"message of {size} bytes over {limit}")
                return
            if len(buffer) < 5 + size:
                break
            if buffer[0]:
                self._fail(stream, INTERNAL, "compressed message but no grpc-encoding")
                return
            payload = buffer[5 : 5 + size]  # a copy already: protobuf parses a bytearray
            del buffer[: 5 + size]
            self._on_message(stream, payload)

    def _on_message(self, stream: _Stream, payload: bytearray) -> None:
        if stream.handler is not None:
            stream.pending.append(payload)
            if stream.task is None:
                task = self.loop.create_task(self._work(stream), context=stream.context)
                task.add_done_callback(lambda done: self._work_done(stream, done))
                stream.task = task
            return
        try:
            service = health_pb2.HealthCheckRequest.FromString(payload).service
        except DecodeError:
            self._fail(stream, INVALID_ARGUMENT, "cannot parse HealthCheckRequest")
            return
        stream.service = service
        if self.server.health.status_of(service) is None:
            self._fail(stream, NOT_FOUND, f"unknown service {service!r}")
        elif stream.method == WATCH_PATH:
            self.server.health.watchers.append((self, stream))
            self.send_health(stream)
        else:
            self.send_health(stream)
            self._finish(stream)

    def _on_client_end(self, sid: int) -> None:
        stream = self.streams.get(sid)
        if stream is None or stream.client_done:
            return
        stream.client_done = True
        if stream.method == WATCH_PATH:
            return  # a watch lasts until the client cancels it or the connection goes
        if stream.task is None and not stream.finishing:
            self._finish(stream)

    # the handler --------------------------------------------------------------------------
    async def _work(self, stream: _Stream) -> None:
        """Answer the stream's pending messages in order, then let the next one start a task."""
        handler = stream.handler
        assert handler is not None
        try:
            while stream.pending and not stream.finishing:
                try:
                    request = ep.ProcessingRequest.FromString(stream.pending.popleft())
                except DecodeError:
                    self._fail(stream, INVALID_ARGUMENT, "cannot parse ProcessingRequest")
                    break
                try:
                    answer = await handler.on(request)
                except Exception as exc:
                    _log.exception("ext_proc stream failed")
                    self._fail(stream, UNKNOWN, f"{type(exc).__name__}: {exc}")
                    break
                self._send(stream, answer.SerializeToString())
        finally:
            stream.task = None  # before any later message: that one starts a new task
        if stream.client_done and not stream.finishing:
            self._finish(stream)
        self._flush_soon()

    def _work_done(self, stream: _Stream, _task: asyncio.Task[None]) -> None:
        # Also runs for a task cancelled before its first step, which no `finally` sees.
        if stream.released:
            self._end(stream)

    def _end(self, stream: _Stream) -> None:
        if stream.handler is not None and not stream.ended:
            stream.ended = True
            self.server.end_stream(stream.handler)

    # outgoing -----------------------------------------------------------------------------
    def send_health(self, stream: _Stream) -> None:
        status = self.server.health.status_of(stream.service)
        reply = health_pb2.HealthCheckResponse(status=status or 0)
        self._send(stream, reply.SerializeToString())
        self._flush_soon()

    def _send(self, stream: _Stream, payload: bytes) -> None:
        if stream.released:
            return
        if not stream.headers_sent:
            stream.headers_sent = True
            self.h2.send_headers(stream.sid, _RESPONSE_HEADERS)
        stream.out.append(memoryview(_message(payload)))
        self._send_out(stream)

    def _fail(self, stream: _Stream, status: int, detail: str) -> None:
        stream.status, stream.detail = status, detail
        stream.pending.clear()
        self._finish(stream)

    def _finish(self, stream: _Stream) -> None:
        """End the stream with its status once what it still has to send is sent."""
        stream.finishing = True
        self._send_out(stream)

    def _send_out(self, stream: _Stream) -> None:
        h = self.h2
        sid = stream.sid
        out = stream.out
        try:
            while out:
                chunk = out[0]
                room = min(len(chunk), h.local_flow_control_window(sid), h.max_outbound_frame_size)
                if room <= 0:
                    return  # the rest goes when the client opens its window (WindowUpdated)
                h.send_data(sid, chunk[:room])
                if room == len(chunk):
                    out.popleft()
                else:
                    out[0] = chunk[room:]
            if stream.finishing:
                trailers = [(b"grpc-status", str(stream.status).encode())]
                if stream.detail:
                    trailers.append((b"grpc-message", _percent_encoded(stream.detail)))
                if not stream.headers_sent:  # a trailers-only answer
                    trailers = _RESPONSE_HEADERS + trailers
                h.send_headers(sid, trailers, end_stream=True)
                if stream.status != OK and not stream.client_done:
                    # The rest of the request is of no use: ask the client to stop sending it
                    # (RFC 9113 8.1: a complete response, then RST_STREAM with NO_ERROR).
                    h.reset_stream(sid, h2.errors.ErrorCodes.NO_ERROR)
                self._release(stream)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            self._drop(stream)

    def _drop(self, stream: _Stream) -> None:
        """The stream is gone (reset, or its connection closed): stop its work."""
        stream.finishing = True
        stream.pending.clear()
        stream.out.clear()
        if stream.task is not None:
            stream.task.cancel()
        self._release(stream)

    def _release(self, stream: _Stream) -> None:
        if stream.released:
            return
        stream.released = True
        self.streams.pop(stream.sid, None)
        if stream.task is None:
            self._end(stream)  # else `_work_done` does, once the task has unwound
        if stream.method == WATCH_PATH:
            with contextlib.suppress(ValueError):
                self.server.health.watchers.remove((self, stream))
        if self.refuse_above is not None and not self.streams:
            self.loop.call_soon(self._close)

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
        if self.transport is not None and not self.transport.is_closing():
            self._flush()
            self.transport.close()

    # stopping -----------------------------------------------------------------------------
    def _goaway(self, last_stream_id: int) -> None:
        frame = GoAwayFrame(0)
        frame.last_stream_id = last_stream_id
        frame.error_code = h2.errors.ErrorCodes.NO_ERROR
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
            stream.out.clear()
            self._fail(stream, UNAVAILABLE, "server stopping")
        self._close()


def _percent_encoded(text: str) -> bytes:
    """grpc-message's encoding: printable ASCII as is, everything else as %XX of its UTF-8."""
    return b"".join(
        bytes([b]) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b
        for b in text.encode("utf-8")
    )


class H2Server:
    """A listening ext_proc server on `h2`; `port` is the bound TCP port (None for unix)."""

    def __init__(
        self,
        open_stream: OpenStream,
        end_stream: EndStream,
        *,
        services: Iterable[str],
        max_message_bytes: int,
    ) -> None:
        self.open_stream = open_stream
        self.end_stream = end_stream
        self.max_message_bytes = max_message_bytes
        self.health = Health(frozenset(services))
        self.connections: set[_Connection] = set()
        self.idle = asyncio.Event()
        """Set while no connection is open."""
        self.idle.set()
        self.draining = False
        self.port: int | None = None
        self._listener: asyncio.Server | None = None

    async def listen(self, address: str, *, reuse_port: bool = False) -> None:
        """Bind `address` (`host:port`, `[v6]:port` or `unix:/path`, as `parse_listen` checks)."""
        loop = asyncio.get_running_loop()
        if address.startswith("unix:"):
            self._listener = await loop.create_unix_server(
                lambda: _Connection(self), address[len("unix:") :]
            )
            return
        host, _, port = address.rpartition(":")
        self._listener = await loop.create_server(
            lambda: _Connection(self),
            host.strip("[]"),
            int(port),
            reuse_port=reuse_port or None,
            backlog=1024,
        )
        sockets = self._listener.sockets
        self.port = sockets[0].getsockname()[1] if sockets else None

    async def stop(self, grace_secs: float) -> None:
        """NOT_SERVING, no new connections or streams, `grace_secs` for those in flight."""
        self.health.stop_serving()
        self.draining = True
        if self._listener is not None:
            self._listener.close()
        for connection in list(self.connections):
            connection.drain()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.idle.wait(), max(grace_secs, DRAIN_ROUND_TRIP_SECS))
        for connection in list(self.connections):
            connection.abort()
        if self._listener is not None:
            await self._listener.wait_closed()
