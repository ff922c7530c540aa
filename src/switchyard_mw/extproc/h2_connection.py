"""One HTTP/2 connection of the `h2` and `frames` transports, sans-IO: the gRPC calls Envoy (or a
health probe) makes on it, from the bytes it sends to the bytes it is answered.

`GrpcConnection` reads no socket, runs no task and reads no clock, in the manner of h11's and
hyper-h2's connections. Its driver (`h2_transport._Connection`, an asyncio protocol) hands it
what arrived and the time, and does what it is told:

- bytes in, bytes out: `receive(data, now)`; `data_to_send()` is what to write;
- `events`, in order: OPEN a Process stream's handler, WORK through its messages (`take` each
  and `send` the answers, until `take` says None), END its handler once the stream closed;
- `state`: CLOSING or HANGING_UP when the socket is to be closed (see `State`);
- deadlines: `tick(now)` checks the timers and returns when to call it again; `drain(now)`
  returns when `final_goaway` is due;
- `notices`: lines for the log (a peer past a reset budget).

What it drives, each a plain object of its own module: the HTTP/2 state machine (`h2_engine`),
gRPC's framing (`h2_framing`), each stream's states (`h2_stream`), bytes held and streams cut
short (`h2_accounting`), the timers (`h2_timers`) and the health service (`h2_health`).

Graceful stop, as gRPC servers do it: GOAWAY with the largest stream id ("open no more"), then,
after a round trip's grace, GOAWAY with the last stream id accepted; streams in flight finish,
later ones are refused (REFUSED_STREAM, which a client may retry elsewhere). `h2` closes its
state machine as soon as it sends a GOAWAY (python-hyper/h2#1181), which would cut the streams
in flight, so the two GOAWAY frames are written beside it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import h2.errors
import h2.events
import h2.exceptions
from hyperframe.frame import GoAwayFrame

from .h2_accounting import Buffers, Cut, ProcessBytes, ProcessResets, ResetBudget, StreamsCut
from .h2_engine import HTTP2
from .h2_frames import VIEW_BYTES, DataPieces, data_received
from .h2_framing import (
    DEADLINE_EXCEEDED,
    OK,
    PREFIX_BYTES,
    RESOURCE_EXHAUSTED,
    RESPONSE_HEADERS,
    UNAVAILABLE,
    UNIMPLEMENTED,
    Refusal,
    frame,
    read_headers,
    trailers,
)
from .h2_health import Health
from .h2_limits import H2Limits
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

PROCESS_PATH = b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"
CHECK_PATH = b"/grpc.health.v1.Health/Check"
WATCH_PATH = b"/grpc.health.v1.Health/Watch"
DRAIN_ROUND_TRIP_SECS = 0.2
"""Between the two GOAWAY frames: time for a stream the client opened as we sent the first."""
WRITE_BATCH_BYTES = 256 << 10
"""Answer bytes one stream hands the engine at a time: a large answer goes a batch at a time
(`held_back`, `send_held`), so that a socket that fills up (`paused`) stops it midway."""
PROCESS_LOG_EVERY_SECS = 60.0
"""The process-wide reset budget's log line comes at most this often (an attacker reconnecting
after each GOAWAY would otherwise write one per connection)."""
_LAST_STREAM_ID = (1 << 31) - 1
_E = h2.errors.ErrorCodes


class Event(enum.IntEnum):
    """What the driver is asked to do for a stream (`GrpcConnection.events`)."""

    OPEN = 0
    """A Process stream opened: make its handler (on failure, `fail` it: UNKNOWN)."""
    WORK = 1
    """Messages wait for the stream's handler: answer them in turn (`take`, `send`) until
    `take` says None. Not asked again until then: later messages join the same queue."""
    END = 2
    """The stream closed: end its handler, after stopping its work if any is running."""


class State(enum.IntEnum):
    """The connection's life; from CLOSING on, what arrives is dropped."""

    SERVING = 0
    REFUSING = 1
    """A final GOAWAY went (the drain's second, or one asking the peer to calm down): streams
    above `refuse_above` are refused, and the connection closes once its last stream ends."""
    CLOSING = 2
    """Close the socket once what is left is written; drop what is unsent after a linger."""
    HANGING_UP = 3
    """A GOAWAY ended the connection: write what is left, end our side (EOF), read and drop
    what still comes for a linger (a peer still sending would otherwise get the connection
    reset, and the GOAWAY lost with it), then close; or close, when EOF cannot be sent."""
    GONE = 4
    """The socket is gone."""


class DataEvent(Protocol):
    """What the connection reads of a DATA frame's event: h2's `DataReceived`, whose `data`
    the `frames` engine may make a view of the read (h2's annotation says bytes, which a
    compiled build would check)."""

    @property
    def stream_id(self) -> int: ...

    @property
    def data(self) -> bytes | memoryview: ...


@dataclass(frozen=True, slots=True)
class Shared:
    """What every connection of a server shares: the limits, the process-wide accounts and the
    health service."""

    limits: H2Limits
    buffers: ProcessBytes
    resets: ProcessResets
    health: Health

    @classmethod
    def of(cls, limits: H2Limits, services: frozenset[str], now: float) -> Shared:
        resets = ProcessResets(
            limits.process_resets_per_sec,
            limits.process_reset_burst,
            now,
            log_every_secs=PROCESS_LOG_EVERY_SECS,
        )
        return cls(limits, ProcessBytes(limits.process_buffer_bytes), resets, Health(services))


_ANSWER = StreamInput.ANSWER
_REQUEST_END = StreamInput.REQUEST_END
_FINISH = StreamInput.FINISH
_CLOSE = StreamInput.CLOSE
_CLOSED = StreamState.CLOSED
_OPEN, _WORK, _END = Event.OPEN, Event.WORK, Event.END
_CLOSING = State.CLOSING
_STREAM_GONE = (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError)


class GrpcConnection:
    """The gRPC calls of one HTTP/2 connection: the engine's events in, each stream's messages
    to its handler (through the driver) or to the health service, answers and trailers out,
    every bound on what the peer may hold checked, GOAWAY when it ends."""

    def __init__(self, engine: HTTP2, shared: Shared, now: float) -> None:
        self.h2 = engine
        self.shared = shared
        limits = self.limits = shared.limits
        self.health = shared.health
        self.now = now
        """The time of the latest input (every input that may need it brings it)."""
        self.state = State.SERVING
        self.streams: dict[int, Stream] = {}
        self.events: list[tuple[Event, Stream]] = []
        """For the driver, in order; it clears the list once done."""
        self.notices: list[str] = []
        """Lines for the log; the driver clears the list once logged."""
        self.last_stream = 0
        self.refuse_above: int | None = None
        """Set with REFUSING: streams above it are refused."""
        self.buffers = Buffers(
            limits.stream_buffer_bytes, limits.connection_buffer_bytes, shared.buffers
        )
        self.resets = StreamsCut(
            ResetBudget(limits.resets_per_sec, limits.reset_burst, now), shared.resets
        )
        self.timers: ConnectionTimers[Stream] = ConnectionTimers(
            now,
            preface_secs=limits.preface_secs,
            idle_secs=limits.idle_secs,
            message_secs=limits.message_secs,
            write_stall_secs=limits.write_stall_secs,
        )
        self.blocked: set[Stream] = set()
        """Streams with answers held back: by the peer's flow-control window, a paused
        socket, or `WRITE_BATCH_BYTES` (then `held_back`)."""
        self.writing_paused = False
        """The socket takes no more for now (the driver's `paused` and `resumed`)."""
        self.held_back = False
        """An answer stopped at `WRITE_BATCH_BYTES`: once what is out is written, `send_held`."""
        self._out: list[bytes] = []
        """Bytes written beside the engine (the GOAWAY frames), before its own."""
        self._headers: list[tuple[bytes, bytes]] | None = None
        self._call = read_headers(())
        """The last header block read (as the engine decoded it) and what was read of it:
        Envoy sends the same headers on each new stream (and `frames` hands them over as the
        same list)."""
        self.data_to_send: Callable[[], bytes] = engine.data_to_send
        """What to write now: the engine's own (no call of ours on the hot path), or, once
        a GOAWAY went beside it, `_joined` until that is taken."""

    @property
    def closed(self) -> bool:
        return self.state >= _CLOSING

    @property
    def active_at(self) -> float:
        """When a stream last opened or ended here (the longest idle makes room first)."""
        return self.timers.active_at

    def _joined(self) -> bytes:
        """`data_to_send` with frames written beside the engine: those first."""
        out = self._out
        out.append(self.h2.data_to_send())
        data = b"".join(out)
        out.clear()
        self.data_to_send = self.h2.data_to_send
        return data

    # input --------------------------------------------------------------------------------
    def receive(self, data: bytes, now: float) -> None:
        """What the peer sent."""
        if self.state >= _CLOSING:
            return  # lingering after a GOAWAY: read and drop, so the peer gets it (no RST)
        self.now = now
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError:  # the engine queued its GOAWAY
            self._close()
            return
        received: dict[int, int] = {}  # flow-controlled bytes per stream, credited per read
        try:
            for event in events:
                if self.state >= _CLOSING:
                    return
                kind = type(event)
                if kind is h2.events.DataReceived:
                    sid = event.stream_id  # type: ignore[attr-defined]
                    received[sid] = received.get(sid, 0) + event.flow_controlled_length  # type: ignore[attr-defined]
                    self._on_data(event)  # type: ignore[arg-type]
                elif kind is DataPieces:
                    sid = event.stream_id  # type: ignore[attr-defined]
                    received[sid] = received.get(sid, 0) + event.flow_controlled_length  # type: ignore[attr-defined]
                    self._on_pieces(event)  # type: ignore[arg-type]
                elif kind is h2.events.RequestReceived:
                    self._on_request(event)  # type: ignore[arg-type]
                elif kind is h2.events.StreamEnded:
                    self._on_request_end(event.stream_id)  # type: ignore[attr-defined]
                elif kind is h2.events.StreamReset:
                    self._on_reset(event.stream_id)  # type: ignore[attr-defined]
                elif kind is h2.events.WindowUpdated or kind is h2.events.RemoteSettingsChanged:
                    self._room_to_send()
                elif kind is h2.events.ConnectionTerminated:
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
        finally:
            if len(data) >= VIEW_BYTES:  # (a shorter read holds no view: see there)
                self._settle(received)

    def _room_to_send(self) -> None:
        """The peer's window grew or its settings changed: what waited for room goes out."""
        self.timers.greeted = True  # the client's first SETTINGS ends its preface
        for stream in list(self.streams.values()):
            self._send_out(stream)

    def _settle(self, received: dict[int, int]) -> None:
        """What a stream keeps of a message still arriving holds no view of the read just
        handled (`MessageReader.settle`); a message whole within it was joined from it."""
        for sid in received:
            stream = self.streams.get(sid)
            if stream is not None and stream.size:
                stream.settle()

    def _on_request(self, event: h2.events.RequestReceived) -> None:
        sid = event.stream_id
        if (self.refuse_above is not None and sid > self.refuse_above) or len(
            self.streams
        ) >= self.limits.max_streams:
            # A stream error, not a connection error (RFC 9113 5.1.2): the others live on.
            self.h2.reset_stream(sid, _E.REFUSED_STREAM)
            self._count_reset()
            return
        self.last_stream = max(self.last_stream, sid)
        # header_encoding=None: h2 hands names and values over as bytes
        headers = event.headers
        if headers is self._headers or headers == self._headers:
            call = self._call  # (its metadata is then shared: handlers read it, never change it)
        else:
            call = self._call = read_headers(headers or ())
            self._headers = headers
        if not call.content_type.startswith(b"application/grpc"):
            self.h2.send_headers(sid, [(b":status", b"415")], end_stream=True)
            return
        path = call.path
        stream = Stream(sid, path)
        self.streams[sid] = stream
        self.timers.active_at = self.now
        if call.encoding not in (b"", b"identity"):
            self._fail(stream, UNIMPLEMENTED, f"grpc-encoding {call.encoding.decode('latin-1')}")
        elif path == PROCESS_PATH:
            stream.metadata = call.metadata
            self.events.append((_OPEN, stream))
        elif path not in (CHECK_PATH, WATCH_PATH):
            self._fail(stream, UNIMPLEMENTED, f"method {path.decode('latin-1')} not found")
        if event.stream_ended is not None:
            self._on_request_end(sid)

    def _on_reset(self, sid: int) -> None:
        stream = self.streams.get(sid)
        if stream is None:
            return
        cut_short = stream.unanswered_work()
        self._release(stream)
        if cut_short:  # the work a rapid reset costs us
            self._count_reset()

    def _count_reset(self) -> None:
        """One stream cut short: past the connection's budget it is closed at once; past the
        process's, it is asked to go (`Cut`)."""
        cut, line = self.resets.count(self.now, asked_to_go=self.refuse_above is not None)
        if line is not None:
            self.notices.append(line)
        if cut is Cut.HANG_UP:
            self.goodbye(_E.ENHANCE_YOUR_CALM, linger=True)
        elif cut is Cut.CALM_DOWN:
            self._calm_down()

    def _calm_down(self) -> None:
        """GOAWAY ENHANCE_YOUR_CALM: no new streams; those in flight may finish, then close."""
        if not self.streams:
            self.goodbye(_E.ENHANCE_YOUR_CALM, linger=True)
            return
        self._refuse_above(self.last_stream)
        self._goaway(self.last_stream, _E.ENHANCE_YOUR_CALM)

    def _on_data(self, event: DataEvent) -> None:
        stream = self.streams.get(event.stream_id)
        data = event.data
        if stream is None or stream.state not in TAKING or not data:
            return
        if not stream.size:
            stream.partial_at = self.now
            self.timers.partial.add(stream)
        stream.add(data)
        over = self.buffers.add(stream, len(data))
        if over is not None:
            self._overflow(stream, over)
            return
        self._take_messages(stream)

    def _on_pieces(self, event: DataPieces) -> None:
        """A run of DATA frames taken at once when it fits every bound of the byte account
        (nothing taken meanwhile gives bytes back, so neither would a frame at a time cross
        one); else a frame at a time, so that a bound is crossed where it always was."""
        sid, size = event.stream_id, event.flow_controlled_length  # (no padding in a run)
        stream = self.streams.get(sid)
        if stream is None or stream.state not in TAKING:
            return
        if size > self.buffers.room(stream):
            for data in event.pieces:
                self._on_data(data_received(sid, data, 0))  # (credited with the run)
            return
        if not stream.size:
            stream.partial_at = self.now
            self.timers.partial.add(stream)
        stream.add_all(event.pieces)
        self.buffers.add(stream, size)
        self._take_messages(stream)

    def _take_messages(self, stream: Stream) -> None:
        """Hand each whole message the stream has received to it, in order: a Process
        stream's to its handler's queue (asking for WORK unless it is at it), a health call's
        to the health service."""
        limit = self.limits.max_message_bytes
        process = stream.method == PROCESS_PATH
        while stream.size >= stream.need:  # (a call fewer per DATA frame than asking)
            payload = stream.next_message(limit)
            if payload is None:
                break
            if isinstance(payload, Refusal):
                self._fail(stream, payload.status, payload.detail)
                return
            stream.partial_at = self.now
            if process:
                # The prefix is held until the payload is taken: one account call a message.
                stream.pending.append(payload)
                if not stream.working:
                    stream.working = True
                    self.events.append((_WORK, stream))
                continue
            self._on_health(stream, payload)
            if stream.state not in TAKING:
                return
        if not stream.size:
            self.timers.partial.discard(stream)

    def _on_health(self, stream: Stream, payload: memoryview) -> None:
        self.buffers.release(stream, PREFIX_BYTES + len(payload))
        health = self.health
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
        if not stream.working and stream.state not in FINISHING:
            self._finish(stream)

    # the handler's side -------------------------------------------------------------------
    def take(self, stream: Stream, now: float) -> memoryview | None:
        """The stream's next message for its handler, or None: none left, or the stream takes
        no more (failed, or gone). None also ends the WORK (the next message asks again), and
        the stream, OK unless it failed, if its request has ended."""
        if stream.pending and stream.state in TAKING:
            payload = stream.pending.popleft()
            self.buffers.release(stream, PREFIX_BYTES + len(payload))
            return payload
        stream.working = False
        if stream.state in REQUEST_DONE and stream.state not in FINISHING:
            self.now = now
            self._finish(stream)
        return None

    def send(self, stream: Stream, payload: bytes, now: float) -> None:
        """One answer (a serialized message) on the stream, unless it is closed."""
        if stream.state is _CLOSED:
            return
        self.now = now
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

    def send_health(self, stream: Stream) -> None:
        """The health of the service the stream asked about, now."""
        self.send(stream, self.health.answer(stream.service or ""), self.now)

    def fail(self, stream: Stream, status: int, detail: str, now: float) -> None:
        """The handler failed (or could not be made): its work is over, and the stream ends
        with `status` once its answers are out."""
        self.now = now
        stream.working = False
        self._fail(stream, status, detail)

    def _fail(self, stream: Stream, status: int, detail: str) -> None:
        """End the stream with `status` once its answers are out; what it received is dropped."""
        stream.status, stream.detail = status, detail
        dropped = stream.drop_partial() + sum(PREFIX_BYTES + len(p) for p in stream.pending)
        stream.pending.clear()
        self.timers.partial.discard(stream)
        self.buffers.release(stream, dropped)
        self._finish(stream)

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

    # output -------------------------------------------------------------------------------
    def _send_now(self, stream: Stream, message: bytes) -> bool:
        """Hand `message` to the engine at once when the peer's window and the frame size
        allow it (every answer of a small request): never queued, never counted as held.
        False when it must wait in `out`."""
        h = self.h2
        sid = stream.sid
        try:
            if len(message) > min(h.local_flow_control_window(sid), h.max_outbound_frame_size):
                return False
            if stream.state in UNANSWERED:
                stream.step(_ANSWER)
                h.send_headers(sid, RESPONSE_HEADERS)
            h.send_data(sid, message)
        except _STREAM_GONE:
            self._release(stream)
            return True
        self.timers.sent_at = self.now
        return True

    def _finish(self, stream: Stream) -> None:
        """End the stream with its status once what it still has to send is sent; with
        nothing sent yet, at once (trailers only)."""
        if stream.state not in UNANSWERED:
            stream.step(_FINISH)
            self._send_out(stream)
            return
        try:
            self._end_stream(stream)
        except _STREAM_GONE:
            self._release(stream)

    def _send_out(self, stream: Stream) -> None:
        """What the stream has queued, as far as the peer's window, the socket and the write
        batch let it go; then its trailers, if it is finishing."""
        h = self.h2
        sid = stream.sid
        out = stream.out
        try:
            sent = 0
            while out:
                chunk = out[0]
                room = min(len(chunk), h.local_flow_control_window(sid), h.max_outbound_frame_size)
                if room <= 0 or self.writing_paused or sent >= WRITE_BATCH_BYTES:
                    # The rest goes when the client opens its window (WindowUpdated), the
                    # socket takes more (`resumed`) or this batch is written (`send_held`);
                    # the stall timer watches the wait.
                    if sent >= WRITE_BATCH_BYTES:
                        self.held_back = True
                    self.blocked.add(stream)
                    if sent:
                        self.timers.sent_at = self.now
                    return
                h.send_data(sid, chunk[:room])
                self.buffers.release(stream, room)
                if room == len(chunk):
                    out.popleft()
                else:
                    out[0] = chunk[room:]
                sent += room
            if sent:
                self.timers.sent_at = self.now
            self.blocked.discard(stream)
            if stream.state in FINISHING:
                self._end_stream(stream)
        except _STREAM_GONE:
            self._release(stream)

    def send_held(self, now: float) -> None:
        """What `WRITE_BATCH_BYTES` held back, now that the batch before it was written."""
        self.now = now
        self.held_back = False
        for stream in list(self.blocked):
            self._send_out(stream)

    def paused(self) -> None:
        """The socket takes no more for now: answers wait (the stall timer watches them)."""
        self.writing_paused = True

    def resumed(self, now: float) -> None:
        """The socket takes more: what waited goes."""
        self.writing_paused = False
        self.now = now
        self.timers.sent_at = now
        for stream in list(self.streams.values()):
            self._send_out(stream)

    def _end_stream(self, stream: Stream) -> None:
        """The trailers (a trailers-only answer when nothing was sent), then CLOSED."""
        block = trailers(stream.status, stream.detail, trailers_only=stream.state in UNANSWERED)
        self.h2.send_headers(stream.sid, block, end_stream=True)
        if stream.status != OK and stream.state not in REQUEST_DONE:
            # The rest of the request is of no use: ask the client to stop sending it
            # (RFC 9113 8.1: a complete response, then RST_STREAM with NO_ERROR).
            self.h2.reset_stream(stream.sid, _E.NO_ERROR)
        self._release(stream)

    def _release(self, stream: Stream) -> None:
        """The stream is CLOSED: its trailers went, or it is gone (reset, refused, its
        connection closed). What it holds is let go, its handler ended (END)."""
        if stream.step(_CLOSE) is _CLOSED:
            return  # emptied when it closed
        self._empty(stream)
        self.streams.pop(stream.sid, None)
        self.timers.active_at = self.now
        method = stream.method
        if method == PROCESS_PATH:
            self.events.append((_END, stream))
        elif method == WATCH_PATH:
            self.health.unwatch(stream)
        if self.refuse_above is not None and not self.streams:
            self._close()

    # the connection's end -----------------------------------------------------------------
    def tick(self, now: float) -> float | None:
        """Check the timers (`ConnectionTimers`); when to check them next (None: the
        connection is over)."""
        if self.state >= _CLOSING:
            return None
        self.now = now
        timers = self.timers
        expiry = timers.expired(
            now,
            streams_open=bool(self.streams),
            waiting_on_peer=self.writing_paused or bool(self.blocked),
        )
        if expiry is Expiry.NO_PREFACE:
            self._close()  # no preface, no HTTP/2 to say goodbye in
            return None
        if expiry is not Expiry.NONE:
            self.goodbye(_E.NO_ERROR)
            return None
        late = f"message incomplete after {self.limits.message_secs:g} s"
        for stream in timers.late(now):
            self._fail(stream, DEADLINE_EXCEEDED, late)
        return now + self.limits.tick_secs

    def goodbye(self, code: h2.errors.ErrorCodes, *, linger: bool = False) -> None:
        """GOAWAY with `code` and the last stream accepted, then CLOSING; with `linger`,
        HANGING_UP, its streams dropped."""
        if self.state >= _CLOSING:
            return
        self._goaway(self.last_stream, code)
        if not linger:
            self._close()
            return
        self.state = State.HANGING_UP
        for stream in list(self.streams.values()):
            self._release(stream)

    def drain(self, now: float) -> float | None:
        """Ask the client to open no more streams; when `final_goaway` is due (None: the
        connection is over already)."""
        if self.state >= _CLOSING:
            return None
        self._goaway(_LAST_STREAM_ID)
        return now + DRAIN_ROUND_TRIP_SECS

    def final_goaway(self, now: float) -> None:
        """Refuse streams above the last accepted; close once those in flight are done (a
        health watch is not waited for: it lasts until cancelled)."""
        if self.state >= _CLOSING:
            return
        self.now = now
        self._refuse_above(self.last_stream)
        self._goaway(self.last_stream)
        if not self.streams or all(s.method == WATCH_PATH for s in self.streams.values()):
            self._close()

    def abort(self, now: float) -> None:
        """Grace is over: end what is still running as UNAVAILABLE, then CLOSING."""
        self.now = now
        for stream in list(self.streams.values()):
            self._empty(stream)
            self._fail(stream, UNAVAILABLE, "server stopping")
        self._close()

    def lost(self, now: float) -> None:
        """The socket is gone: every stream with it."""
        self.now = now
        self.state = State.GONE
        for stream in list(self.streams.values()):
            self._release(stream)

    def _refuse_above(self, last: int) -> None:
        self.refuse_above = last
        self.state = State.REFUSING

    def _close(self) -> None:
        if self.state < _CLOSING:
            self.state = _CLOSING

    def _goaway(self, last_stream_id: int, code: h2.errors.ErrorCodes = _E.NO_ERROR) -> None:
        goaway = GoAwayFrame(0)
        goaway.last_stream_id = last_stream_id
        goaway.error_code = code
        self._out.append(self.h2.data_to_send())
        self._out.append(goaway.serialize())
        self.data_to_send = self._joined
