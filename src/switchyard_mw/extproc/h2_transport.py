"""`switchyard-mw extproc` (transports `frames`, the default, and `h2`): ext_proc over HTTP/2.

grpc.aio spends most of a processor's CPU on its own machinery: about 0.44 ms per request for a
processor that does almost nothing, against 0.13-0.15 ms for the same work over a plain asyncio
HTTP/2 connection (docs/performance.md, "Envoy processor transport"). This module is that
connection's asyncio side: it listens, accepts, and drives each connection's protocol, which is
sans-IO (`h2_connection.GrpcConnection`: gRPC's framing, a 5-byte prefix per message and
`grpc-status` in the trailers, over an HTTP/2 state machine, `h2_engine`): it hands it the bytes
read and the time, writes what it has to send, hands each message of a stream in turn to the
handler it asks for, with the stream's own contextvars (at once when the handler answers at
once; in a task when its answer takes waiting: a judge, a shared store), and calls it back when
its timers are due. It serves the two
methods Envoy calls, `ExternalProcessor/Process` and `Health/Check` (with `Health/Watch`, for
probes that watch).

What it does not do, and grpc.aio (`--transport grpcio`) would: TLS (listen on loopback or a
unix socket, as the grpc.aio transport is also set up), compression (never advertised, so
Envoy sends none), and `grpc-timeout` (Envoy bounds each message itself with
`message_timeout`, and resets the stream when it gives up: the stream's task is then
cancelled).

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
import logging
import os
import resource
import socket
import stat
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol, cast

import h2.errors
from google.protobuf.message import DecodeError

from .._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from .body_envelope import MIN_BYTES as _ENVELOPE_MIN_BYTES
from .body_envelope import REQUEST_BODY, body_span
from .h2_connection import (
    CHECK_PATH,
    DRAIN_ROUND_TRIP_SECS,
    PROCESS_PATH,
    WATCH_PATH,
    Event,
    GrpcConnection,
    Shared,
    State,
)
from .h2_engine import ENGINES, Engine, serving
from .h2_framing import INVALID_ARGUMENT, UNKNOWN
from .h2_limits import DEFAULT_MESSAGE_BYTES, H2Limits
from .h2_stream import TAKING, Answer, Answering, Handler, Stream, StreamState

__all__ = [
    "CHECK_PATH",
    "DEFAULT_MESSAGE_BYTES",
    "ENGINES",
    "PROCESS_PATH",
    "WATCH_PATH",
    "Engine",
    "H2Limits",
    "H2Server",
    "Handler",
    "Pushing",
]

_log = logging.getLogger(__name__)
_RESPONSE = ep.ProcessingResponse

WRITE_BUFFER_BYTES = 1 << 20
"""Bytes the socket may hold unsent before writing pauses (asyncio's high-water mark)."""
LINGER_SECS = 1.0
"""After a GOAWAY that ends a connection, input is read and dropped this long before closing
(and a closing connection's unsent output is dropped after it)."""
BACKLOG = 1024
ACCEPT_RETRY_SECS = 1.0
"""Out of file descriptors: accepting pauses this long (asyncio's own retry delay)."""
_ACCEPT_BATCH = 64


class Pushing(Protocol):
    """A handler whose answers are not one per message (`first_token`): it is handed how to
    send one whenever it has one (a timer, a held answer let go)."""

    def attach(self, emit: Callable[[ep.ProcessingResponse], None]) -> None: ...


OpenStream = Callable[[list[tuple[str, bytes]]], Handler]
"""Makes a stream's handler from its metadata (the request headers that are not pseudo-headers;
shared by streams whose headers were the same: read it, never change it)."""
EndStream = Callable[[Handler], None]

_OPEN, _WORK, _END = Event.OPEN, Event.WORK, Event.END
_CLOSING = State.CLOSING
_CLOSED = StreamState.CLOSED
_now = time.monotonic
"""The connection's clock: the event loop's (asyncio's and uvloop's are monotonic), read
without the loop's Python-level `time()` on the hot path."""


class _Connection(asyncio.Protocol):
    """One HTTP/2 connection from Envoy (or a health probe), on asyncio: the socket's bytes
    to its `GrpcConnection` and back, a task per stream for its handler, the connection's
    timer. Every decision is the `GrpcConnection`'s."""

    def __init__(self, server: H2Server) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.core = GrpcConnection(serving(server.engine, server.limits), server.shared, _now())
        self.transport: asyncio.Transport | None = None
        self.closed = False
        """Closing or closed: no longer counted in `open_connections`."""
        self._act_pending = False
        self._timer: asyncio.TimerHandle | None = None

    @property
    def streams(self) -> dict[int, Stream]:
        return self.core.streams

    # asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport, whatever its class: uvloop's (an application's loop under
        # `uvicorn[standard]`, say) has asyncio.Transport's methods without subclassing it.
        self.transport = transport = cast("asyncio.Transport", transport)
        transport.set_write_buffer_limits(high=WRITE_BUFFER_BYTES)
        server = self.server
        server.open_connections += 1
        server.connections.add(self)
        server.idle.clear()
        transport.write(self.core.data_to_send())
        self._timer = self.loop.call_later(server.limits.tick_secs, self._tick)
        if server.draining:
            self.drain()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self._timer is not None:
            self._timer.cancel()
        self.core.lost(_now())
        self._act()
        server = self.server
        server.connections.discard(self)
        if not server.connections:
            server.idle.set()

    def pause_writing(self) -> None:
        # The peer reads no more: stop reading it too (a flood of PINGs or SETTINGS would
        # otherwise queue their answers without end) until it does, or the stall timer ends it.
        self.core.paused()
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()
        self.core.resumed(_now())
        self._act()

    def data_received(self, data: bytes) -> None:
        self.core.receive(data, _now())
        self._act()

    # what the connection asks -------------------------------------------------------------
    def _act(self) -> None:
        """Do what the connection asked for, in order, then write what it has to send."""
        self._act_pending = False
        core = self.core
        events = core.events
        if events:
            for event, stream in events:  # handling one may add more: the loop sees them
                if event is _WORK:
                    if stream.state is not _CLOSED and stream.handler is not None:
                        self._answer(stream)
                elif event is _OPEN:
                    self._open(stream)
                else:
                    self._end(stream)
            events.clear()
        if core.notices:
            for line in core.notices:
                _log.warning("%s", line)
            core.notices.clear()
        if core.state >= _CLOSING:
            # Closed once; after that nothing is written (a half-closed socket takes no more).
            if not self.closed:
                self._close()
            return
        data = core.data_to_send()
        transport = self.transport
        if data and transport is not None and not transport.is_closing():
            transport.write(data)
        if core.held_back:
            self._flush()

    def _open(self, stream: Stream) -> None:
        """A Process stream's handler, made in a context of its own."""
        stream.context = context = contextvars.copy_context()
        try:
            handler = stream.handler = context.run(self.server.open_stream, stream.metadata or [])
            # `Pushing` by its one method: a runtime-checkable Protocol's isinstance walks
            # the protocol's attributes on every call, a large share of a stream's cost.
            attach = getattr(handler, "attach", None)
            if attach is not None:
                attach(lambda answer: self._push(stream, answer))
            stream.answer_body = getattr(handler, "answer_body", None)  # a `TakesBody`'s
        except Exception as exc:
            _log.exception("ext_proc stream could not start")
            self.core.fail(stream, UNKNOWN, f"{type(exc).__name__}: {exc}", _now())
        stream.metadata = None

    def _end(self, stream: Stream) -> None:
        """The stream closed: its handler ends once, after its task (if any) has unwound (a
        callback, not the task's `finally`: a task cancelled before its first step runs
        none)."""
        task = stream.task
        if task is None:
            if stream.handler is not None:
                self.server.end_stream(stream.handler)
        else:
            task.cancel()
            task.add_done_callback(lambda _: self._end_handler(stream))

    def _end_handler(self, stream: Stream) -> None:
        if stream.handler is not None:
            self.server.end_stream(stream.handler)

    # the handler --------------------------------------------------------------------------
    def _answer(self, stream: Stream) -> None:
        """Answer the stream's pending messages in order: here, in the stream's context, while
        its handler answers them at once; from the first whose answer takes waiting, in a
        task (`_work`), which answers the ones behind it too.

        Most messages take no waiting (every phase but a request's body, and a retry's
        headers), and a task per message was a large share of a request's cost: its
        creation, its scheduling, and the loop's turn to run it."""
        handler, context = stream.handler, stream.context
        assert handler is not None
        assert context is not None
        while (request := self._next_request(stream)) is not None:
            try:
                if isinstance(request, bytes):  # a request body, for a `TakesBody`
                    assert stream.answer_body is not None
                    answering = context.run(stream.answer_body, request)
                else:
                    answering = context.run(handler.answer, request)
            except Exception as exc:
                self._failed(stream, exc)
                return
            if answering is not None and not isinstance(answering, _RESPONSE):
                work = self._work(stream, answering)  # it takes waiting
                stream.task = self.loop.create_task(work, context=context)
                return
            self._send_answer(stream, answering)

    async def _work(self, stream: Stream, answering: Answering) -> None:
        """Await an answer that takes waiting, then answer the stream's messages behind it in
        order; the next one after them starts anew (`_answer`)."""
        handler = stream.handler
        assert handler is not None
        request: ep.ProcessingRequest | bytes | None = None
        try:
            while True:
                try:
                    if isinstance(request, bytes):
                        assert stream.answer_body is not None
                        answering = stream.answer_body(request)
                    elif request is not None:
                        answering = handler.answer(request)
                    if answering is None or isinstance(answering, _RESPONSE):
                        answer = answering
                    else:
                        answer = await answering
                except Exception as exc:
                    self._failed(stream, exc)
                    break
                self._send_answer(stream, answer)
                if (request := self._next_request(stream)) is None:
                    break
        finally:
            stream.task = None  # before any later message: that one starts anew
        self._act_soon()

    def _next_request(self, stream: Stream) -> ep.ProcessingRequest | bytes | None:
        """The stream's next message, parsed; None when none is left (or it did not parse:
        the stream then fails). A large request body's own bytes (`bytes`) for a handler that
        takes them (`TakesBody`), when the message is that body (`body_envelope`)."""
        core = self.core
        payload = core.take(stream, _now())
        if payload is None:
            return None
        if (
            len(payload) >= _ENVELOPE_MIN_BYTES  # first: most messages are small
            and payload[0] == REQUEST_BODY
            and stream.answer_body is not None
        ):
            span = body_span(payload)
            if span is not None:
                return bytes(payload[span[0] : span[1]])
        try:
            return ep.ProcessingRequest.FromString(payload)
        except DecodeError:
            core.fail(stream, INVALID_ARGUMENT, "cannot parse ProcessingRequest", _now())
            return None

    def _send_answer(self, stream: Stream, answer: Answer) -> None:
        if answer is None:
            return
        core = self.core
        core.send(stream, answer.SerializeToString(), _now())
        if core.held_back:  # a large answer: out a batch at a time
            self._flush()

    def _failed(self, stream: Stream, exc: Exception) -> None:
        _log.error("ext_proc stream failed", exc_info=exc)
        self.core.fail(stream, UNKNOWN, f"{type(exc).__name__}: {exc}", _now())

    def _push(self, stream: Stream, answer: ep.ProcessingResponse) -> None:
        """An answer a `Pushing` handler sends on its own: out now, unless the stream is
        done taking answers."""
        core = self.core
        if stream.state in TAKING:
            core.send(stream, answer.SerializeToString(), _now())
            self._act_soon()

    # writing ------------------------------------------------------------------------------
    def _act_soon(self) -> None:
        """`_act` once the running callbacks are done (their answers go in one write)."""
        if not self._act_pending:
            self._act_pending = True
            self.loop.call_soon(self._act)

    def _flush(self) -> None:
        """Write what the connection has to send; a large answer a batch at a time, until the
        socket is full (then `pause_writing` stops it)."""
        core = self.core
        if core.closed:
            return  # `_act` closes it
        self._write(core.data_to_send())
        while core.held_back and not core.writing_paused and not core.closed:
            core.send_held(_now())
            self._write(core.data_to_send())

    def _write(self, data: bytes) -> None:
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _close(self) -> None:
        """The connection said CLOSING or HANGING_UP (or the socket is gone)."""
        transport = self.transport
        if transport is not None:
            self._write(self.core.data_to_send())
        self._mark_closed()
        if transport is None or transport.is_closing():
            return
        if self.core.state is State.HANGING_UP and transport.can_write_eof():
            transport.write_eof()
        else:
            transport.close()
        # close() waits for the peer to take what is buffered, and a half-closed connection
        # on the peer's next move: a peer that does neither would hold it open for good.
        self.loop.call_later(LINGER_SECS, transport.abort)

    def _mark_closed(self) -> None:
        if not self.closed:
            self.closed = True
            self.server.open_connections -= 1

    # timers and stopping ------------------------------------------------------------------
    def _tick(self) -> None:
        now = _now()
        due = self.core.tick(now)
        self._act()
        if due is not None:
            self._timer = self.loop.call_later(due - now, self._tick)

    def goodbye(self) -> None:
        """GOAWAY NO_ERROR and close (to make room for a new connection)."""
        self.core.goodbye(h2.errors.ErrorCodes.NO_ERROR)
        self._act()

    def drain(self) -> None:
        """Ask the client to open no more streams; close once those in flight are done."""
        now = _now()
        due = self.core.drain(now)
        self._act()
        if due is not None:
            self.loop.call_later(due - now, self._final_goaway)

    def _final_goaway(self) -> None:
        if self.transport is None:
            return
        self.core.final_goaway(_now())
        self._act()

    def abort(self) -> None:
        """Grace is over: end what is still running as UNAVAILABLE and close."""
        self.core.abort(_now())
        self._act()


class H2Server:
    """A listening ext_proc server on HTTP/2 (`engine`: whose); `port` is the bound TCP port
    (None for unix)."""

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
        # time.monotonic is the event loop's clock (and the server may be made before it runs).
        self.shared = Shared.of(self.limits, frozenset(services), time.monotonic())
        self.health = self.shared.health
        self.connections: set[_Connection] = set()
        self.open_connections = 0
        """Connections not yet closing: what `max_connections` counts."""
        self.idle = asyncio.Event()
        """Set while no connection is open."""
        self.idle.set()
        self.draining = False
        self.port: int | None = None
        self._listeners: list[_Listener] = []

    @property
    def held(self) -> int:
        """Bytes held by every stream of every connection (see `Stream.held`)."""
        return self.shared.buffers.held

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
        min(idle, key=lambda c: c.core.active_at).goodbye()
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
