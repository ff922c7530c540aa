"""The `frames` transport's HTTP/2: the server side of RFC 9113 for what an ext_proc peer sends,
read and written by this module instead of the `h2` library's general state machine.

Envoy's ext_proc client opens one HTTP/2 connection and, per request, one gRPC stream: a
HEADERS frame (the same block every time once its HPACK table is warm), a few DATA frames
(one message per phase; a large body in 16 KB frames) and a RST_STREAM once it has its last
answer. The server answers with one HEADERS block, a DATA frame per answer and the trailers.
`h2` spends most of a request's transport cost on that path in pure-Python generality (an
object per frame, a stream state machine of 20-odd transitions, events, HPACK encoding of
every block: docs/performance.md, "Envoy processor transport"); this module parses a frame
header with one `struct` call, decodes a header block with the `hpack` library (re-using the
last decoding when the block and the HPACK table are unchanged, which is Envoy's steady
state), and writes the server's few header blocks from a cache.

It keeps `h2`'s interface as the connection (`h2_connection.GrpcConnection`) uses it (the
same events and exceptions, the same calls), so the connection's bounds, timers and
accounting are the same code on either. Like `h2`, it is sans-IO: bytes in, events and bytes
out, no socket, no event loop, no clock.
What a peer may make it do stays bounded: a frame is at most 16 KB (SETTINGS_MAX_FRAME_SIZE
as advertised), a header block at most `max_header_list_bytes` and 64 CONTINUATION frames,
flow control is enforced both ways, and every violation RFC 9113 makes a connection error ends
the connection with GOAWAY (`ProtocolError` to the caller, as `h2` does).
"""

from __future__ import annotations

import struct
from typing import Final, overload

import h2.errors
import h2.events
import h2.exceptions
import hpack
import hpack.table
from hpack.exceptions import HPACKError, OversizedHeaderListError

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
MAX_FRAME_BYTES: Final = 16384
"""What we accept (SETTINGS_MAX_FRAME_SIZE's default, never raised: see docs)."""
VIEW_BYTES: Final = 4096
"""DATA payloads of at least this many bytes are handed on as views of the read (see
`_frames`); a smaller one is copied, which costs less than a view and its later copy."""
MAX_CONTINUATIONS: Final = 64
"""CONTINUATION frames one header block may take (as `h2` bounds it)."""
_MAX_WINDOW: Final = (1 << 31) - 1
_DEFAULT_WINDOW: Final = 65535

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS = 0, 1, 2, 3, 4
PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 5, 6, 7, 8, 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20

# SETTINGS identifiers (RFC 9113 6.5.2)
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS = 1, 2, 3
INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = 4, 5, 6

_HEAD = struct.Struct(">BHBBL")
"""A frame header: the length's high byte and low 16 bits, type, flags, stream id."""
_U32 = struct.Struct(">L")
_SETTING = struct.Struct(">HL")
_E = h2.errors.ErrorCodes


class _Stream:
    """What the connection keeps of an open stream: its send window and whether the peer has
    ended its side. Gone once ours is ended or either side resets it."""

    __slots__ = ("receivable", "remote_done", "unacked", "window")

    def __init__(self, window: int, receivable: int) -> None:
        self.window = window
        self.receivable = receivable
        """Bytes the peer may still send on it (our window)."""
        """Bytes we may still send on it (the peer's window)."""
        self.remote_done = False
        self.unacked = 0
        """Bytes received and handed on, not yet given back in a WINDOW_UPDATE."""


class _CutData:
    """The rest of a DATA frame a read cut, still to come: its pieces are handed on as they
    arrive (`FrameConnection._go_on`), not put together first."""

    __slots__ = ("ends", "kept", "left", "sid")

    def __init__(self, sid: int, left: int, ends: bool, kept: bool) -> None:
        self.sid = sid
        self.left = left
        """Payload bytes of the frame not yet read."""
        self.ends = ends
        """The frame carries END_STREAM: the stream's end is told after its last piece."""
        self.kept = kept
        """The frame was admitted (its stream open, the frame within both windows): its
        pieces are handed on; if not, they are dropped (the whole frame was given back to the
        connection's window at its header)."""


# The events every stream brings (its request, each DATA frame, its reset) are built without
# h2's own `__init__`: h2's events are dataclasses whose keyword-only `__init__` costs about
# 0.9 µs an event, three times setting the fields here (timed in process). Each sets every
# field its dataclass has (`tests/extproc/test_frame_connection.py` compares them with h2's).
_new = object.__new__


def data_received(sid: int, data: bytes | memoryview, length: int) -> h2.events.DataReceived:
    """h2's `DataReceived` for a DATA frame's payload, or a piece of it (`length`: what it
    counts against the windows). `data` may be a view: the connection reads any buffer."""
    event = _new(h2.events.DataReceived)
    event.stream_id = sid
    event.data = data  # type: ignore[assignment]
    event.flow_controlled_length = length
    event.stream_ended = None
    return event


def request_received(
    sid: int, headers: list[tuple[bytes, bytes]], ended: h2.events.StreamEnded | None
) -> h2.events.RequestReceived:
    """h2's `RequestReceived` for a stream's request headers (`ended`: its END_STREAM's)."""
    event = _new(h2.events.RequestReceived)
    event.stream_id = sid
    event.headers = headers
    event.stream_ended = ended
    event.priority_updated = None
    return event


def stream_reset(sid: int, code: int, remote: bool = True) -> h2.events.StreamReset:
    """h2's `StreamReset` for a RST_STREAM with `code`: the peer's, or ours (`remote` False)."""
    event = _new(h2.events.StreamReset)
    event.stream_id = sid
    event.error_code = code
    event.remote_reset = remote
    return event


class DataPieces(h2.events.Event):
    """Whole DATA frames of one stream back to back in one read, handed on as one event where
    `h2` would give a `DataReceived` each: a large body arrives so (Envoy's 128 KB body in
    nine frames, one read), and the steps taken per frame and per event were most of what a
    large body added to the transport's work. Only frames that both windows admit together
    come so (`FrameConnection._on_run`); the others are handed on a frame at a time."""

    def __init__(
        self, stream_id: int, pieces: list[bytes | memoryview], flow_controlled_length: int
    ) -> None:
        self.stream_id = stream_id
        self.pieces = pieces
        """Each frame's payload, in order: a view of the read once it is `VIEW_BYTES` or more,
        a copy below (as a frame alone is handed on); some may be empty."""
        self.flow_controlled_length = flow_controlled_length
        """The frames' payloads together, charged to both windows."""


class _CountingTable(hpack.table.HeaderTable):
    """hpack's dynamic table, counting its changes: a header block decoded twice with no
    change between gives the same headers (and, when it changed nothing, leaves none)."""

    def __init__(self) -> None:
        super().__init__()
        self.version = 0

    def add(self, name: bytes, value: bytes) -> None:
        self.version += 1
        super().add(name, value)

    @property
    def maxsize(self) -> int:
        return self._maxsize

    @maxsize.setter
    def maxsize(self, newmax: int) -> None:
        self.version += 1
        hpack.table.HeaderTable.maxsize.fset(self, newmax)  # type: ignore[attr-defined]


class HeaderDecoder:
    """HPACK decoding of the peer's header blocks, the last one remembered: Envoy's block for
    each new stream is the same bytes once its table is warm, and decoding it changes nothing,
    so the same bytes at the same table version are the same headers."""

    def __init__(self, max_header_list_size: int) -> None:
        self.decoder = hpack.Decoder(max_header_list_size=max_header_list_size)
        self.table = self.decoder.header_table = _CountingTable()
        self._last_block = b""
        self._last_version = -1
        self._last_headers: list[tuple[bytes, bytes]] = []

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        version = self.table.version
        if block == self._last_block and version == self._last_version:
            return self._last_headers
        headers: list[tuple[bytes, bytes]] = self.decoder.decode(block, raw=True)  # type: ignore[assignment]
        if self.table.version == version:  # it changed nothing: the same bytes decode alike
            self._last_block, self._last_version, self._last_headers = block, version, headers
        return headers


_STATIC_NAMES: dict[bytes, int] = {}
for _index, (_name, _) in reversed(list(enumerate(hpack.table.HeaderTable.STATIC_TABLE, 1))):
    _STATIC_NAMES[_name] = _index
_STATIC_FIELDS = {field: i for i, field in enumerate(hpack.table.HeaderTable.STATIC_TABLE, 1)}


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer (RFC 7541 5.1) with `first`'s high bits in its first byte."""
    top = (1 << prefix_bits) - 1
    if value < top:
        return bytes([first | value])
    out = bytearray([first | top])
    value -= top
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_headers(headers: list[tuple[bytes, bytes]]) -> bytes:
    """A header block that leaves the peer's table as it is: a static entry by index, else a
    literal without indexing (by the static name's index where there is one), no Huffman.
    The server's blocks are few and small, so the dynamic table would save nothing."""
    out = bytearray()
    for name, value in headers:
        whole = _STATIC_FIELDS.get((name, value))
        if whole is not None:
            out += _integer(whole, 7, 0x80)
            continue
        index = _STATIC_NAMES.get(name)
        if index is None:
            out += b"\x00" + _integer(len(name), 7, 0) + name
        else:
            out += _integer(index, 4, 0)
        out += _integer(len(value), 7, 0) + value
    return bytes(out)


_ENCODED: dict[tuple[tuple[bytes, bytes], ...], bytes] = {}
_ENCODED_MAX = 256
"""Blocks remembered (the server's own, a status and a detail each: a few in practice)."""


def _encoded(headers: list[tuple[bytes, bytes]]) -> bytes:
    key = tuple(headers)
    block = _ENCODED.get(key)
    if block is None:
        block = encode_headers(headers)
        if len(_ENCODED) >= _ENCODED_MAX:
            _ENCODED.clear()
        _ENCODED[key] = block
    return block


def _frame(kind: int, flags: int, sid: int, payload: bytes | bytearray | memoryview = b"") -> bytes:
    n = len(payload)
    return _HEAD.pack(n >> 16, n & 0xFFFF, kind, flags, sid) + payload


class FrameConnection:
    """The server side of one HTTP/2 connection, with the calls and events of `h2`'s
    `H2Connection` that `GrpcConnection` uses (`receive_data`, `send_headers`, `send_data`,
    `reset_stream`, `acknowledge_received_data`, `local_flow_control_window`,
    `max_outbound_frame_size`, `data_to_send`)."""

    def __init__(self) -> None:
        self.streams: dict[int, _Stream] = {}
        self.highest = 0
        """The highest stream id the peer has opened: ids at or under it not in `streams`
        are closed."""
        self._out: list[bytes | memoryview] = []
        self._pending = b""
        """A frame the last read cut in its header, or one not DATA (or padded) cut anywhere:
        put together from the next read."""
        self._cut: _CutData | None = None
        self._preface_left = len(PREFACE)
        self._greeted = False
        self._block: list[bytes] | None = None
        """A header block awaiting its CONTINUATION frames (with `_block_*` below)."""
        self._block_sid = 0
        self._block_end = False
        self._block_frames = 0
        self._block_bytes = 0
        self._peer_window = _DEFAULT_WINDOW
        """The peer's SETTINGS_INITIAL_WINDOW_SIZE: each new stream's send window."""
        self._send_window = _DEFAULT_WINDOW
        self.max_outbound_frame_size = MAX_FRAME_BYTES
        self._stream_window = _DEFAULT_WINDOW
        self._recv_window = _DEFAULT_WINDOW
        """Bytes the peer may still send on the connection."""
        self._recv_target = _DEFAULT_WINDOW
        self._unacked = 0
        self._max_header_bytes = 64 << 10
        self._headers = HeaderDecoder(self._max_header_bytes)

    # setting up ---------------------------------------------------------------------------
    def initiate(
        self,
        *,
        max_streams: int,
        stream_window: int,
        connection_window: int,
        max_header_list_bytes: int,
    ) -> None:
        """Our SETTINGS (the server's preface) and the connection window opened wide."""
        self._stream_window = stream_window
        self._max_header_bytes = max_header_list_bytes
        self._headers = HeaderDecoder(max_header_list_bytes)
        settings = b"".join(
            _SETTING.pack(code, value)
            for code, value in (
                (MAX_CONCURRENT_STREAMS, max_streams),
                (INITIAL_WINDOW_SIZE, stream_window),
                (MAX_HEADER_LIST_SIZE, max_header_list_bytes),
            )
        )
        self._out.append(_frame(SETTINGS, 0, 0, settings))
        grow = connection_window - _DEFAULT_WINDOW
        if grow > 0:
            self._out.append(_frame(WINDOW_UPDATE, 0, 0, _U32.pack(grow)))
            self._recv_window = self._recv_target = connection_window

    # receiving ----------------------------------------------------------------------------
    def receive_data(self, data: bytes) -> list[h2.events.Event]:
        """The events of what the peer sent; `ProtocolError` (GOAWAY queued) on a connection
        error."""
        events: list[h2.events.Event] = []
        at = 0
        if self._preface_left:
            at = self._read_preface(data)
            if self._preface_left:
                return events
        cut = self._cut
        if cut is not None:
            at = self._go_on(cut, data, at, events)
            # Asked of `cut`, not `self._cut`: mypy keeps that narrowed past the call that
            # clears it, and a compiled build would then check None as a `_CutData`.
            if cut.left:
                return events
        if self._pending:
            # Only a frame the last read cut and that is not handed on in pieces is completed
            # by copying; the rest of each read is parsed in place.
            at = self._complete(data, at, events)
            if self._pending:
                return events
        at = self._frames(data, at, events)
        if at < len(data):
            self._pending = data[at:]
        return events

    def _complete(self, data: bytes, at: int, events: list[h2.events.Event]) -> int:
        """`_pending` completed with the bytes of `data` from `at` its frame needs, and that
        frame handled; where in `data` the next frame starts."""
        pending = self._pending
        if len(pending) < 9:
            take = 9 - len(pending)
            pending += data[at : at + take]
            at += take
            if len(pending) < 9:
                self._pending = pending
                return at
        total = 9 + self._length(pending, 0)
        take = total - len(pending)
        pending += data[at : at + take]
        at += take
        if len(pending) < total:
            self._pending = pending
            return at
        self._pending = b""
        self._frames(pending, 0, events)
        return at

    def _length(self, data: bytes, at: int) -> int:
        high, low = data[at], (data[at + 1] << 8) | data[at + 2]
        length = (high << 16) | low
        if length > MAX_FRAME_BYTES:
            self._fail(_E.FRAME_SIZE_ERROR, f"a frame of {length} bytes")
        return length

    def _frames(self, data: bytes, at: int, events: list[h2.events.Event]) -> int:
        """Each whole frame of `data` from `at` handled; where the first partial one starts.

        A large DATA frame's payload is handed on as a view of `data`, not a copy: a large
        message whole within one read is then copied once, when its pieces are joined. Whoever keeps
        a piece past the read copies it (`MessageReader.settle`), so that a few bytes held
        never keep a whole read alive.
        """
        end = len(data)
        head = _HEAD.unpack_from
        whole: memoryview | None = None
        while end - at >= 9:
            high, low, kind, flags, sid = head(data, at)
            length = (high << 16) | low
            if length > MAX_FRAME_BYTES:
                self._fail(_E.FRAME_SIZE_ERROR, f"a frame of {length} bytes")
            if end - at - 9 < length:
                if kind == DATA and not flags & PADDED and self._block is None and self._greeted:
                    at = self._cut_at(flags, sid & _MAX_WINDOW, length, data, at + 9, events)
                break
            start, at = at + 9, at + 9 + length
            if kind == DATA and length >= VIEW_BYTES and self._block is None and self._greeted:
                if whole is None:
                    whole = memoryview(data)
                at = self._data_run(flags, sid & _MAX_WINDOW, whole, start, at, events)
            else:
                self._on_frame(kind, flags, sid & _MAX_WINDOW, data[start:at], events)
        return at

    def _read_preface(self, data: bytes) -> int:
        taken = min(self._preface_left, len(data))
        start = len(PREFACE) - self._preface_left
        if data[:taken] != PREFACE[start : start + taken]:
            self._fail(_E.PROTOCOL_ERROR, "not an HTTP/2 preface")
        self._preface_left -= taken
        return taken

    def _on_frame(
        self, kind: int, flags: int, sid: int, payload: bytes, events: list[h2.events.Event]
    ) -> None:
        if self._block is not None and kind != CONTINUATION:
            self._fail(_E.PROTOCOL_ERROR, "a header block cut by another frame")
        if not self._greeted:
            if kind != SETTINGS or flags & ACK:
                self._fail(_E.PROTOCOL_ERROR, "the preface's SETTINGS missing")
            self._greeted = True
        if kind == DATA:
            self._on_data(flags, sid, payload, events)
        elif kind == HEADERS:
            self._on_headers(flags, sid, payload, events)
        elif kind == RST_STREAM:
            self._on_reset(sid, payload, events)
        elif kind == WINDOW_UPDATE:
            self._on_window_update(sid, payload, events)
        elif kind == SETTINGS:
            self._on_settings(flags, sid, payload, events)
        elif kind == PING:
            self._on_ping(flags, sid, payload)
        elif kind == CONTINUATION:
            self._on_continuation(flags, sid, payload, events)
        elif kind == GOAWAY:
            self._on_goaway(sid, payload, events)
        elif kind == PRIORITY:
            if sid == 0 or len(payload) != 5:
                self._fail(_E.PROTOCOL_ERROR, "a malformed PRIORITY")
        elif kind == PUSH_PROMISE:
            self._fail(_E.PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # Frames of unknown types are ignored (RFC 9113 5.5).

    def _on_data(
        self, flags: int, sid: int, payload: bytes | memoryview, events: list[h2.events.Event]
    ) -> None:
        length = len(payload)
        stream = self._admit(sid, length, events)
        if stream is None:
            return
        data = self._unpadded(payload, flags) if flags & PADDED else payload
        events.append(data_received(sid, data, length))
        if flags & END_STREAM:
            stream.remote_done = True
            events.append(h2.events.StreamEnded(stream_id=sid))

    def _data_run(
        self,
        flags: int,
        sid: int,
        whole: memoryview,
        start: int,
        at: int,
        events: list[h2.events.Event],
    ) -> int:
        """The large DATA frame of `sid` in `whole[start:at]` handed on, with the whole
        unpadded DATA frames of `sid` right behind it in the read (`DataPieces`); where the
        next frame starts. A padded frame, one the read cuts, one of another kind or stream
        and a stream's end close the run."""
        if flags & (PADDED | END_STREAM):
            self._on_data(flags, sid, whole[start:at], events)
            return at
        spans = [(start, at)]
        end = len(whole)
        head = _HEAD.unpack_from
        while end - at >= 9:
            high, low, kind, next_flags, next_sid = head(whole, at)
            length = (high << 16) | low
            if kind != DATA or next_flags & PADDED or next_sid & _MAX_WINDOW != sid:
                break
            if length > end - at - 9 or length > MAX_FRAME_BYTES:
                break  # cut by the read, or too large: `_frames` takes it from here
            flags = next_flags
            spans.append((at + 9, at + 9 + length))
            at += 9 + length
            if flags & END_STREAM:
                break
        if len(spans) == 1:
            self._on_data(flags, sid, whole[start:at], events)
        else:
            self._on_run(sid, spans, flags & END_STREAM, whole, events)
        return at

    def _on_run(
        self,
        sid: int,
        spans: list[tuple[int, int]],
        ends: int,
        whole: memoryview,
        events: list[h2.events.Event],
    ) -> None:
        """DATA frames of `sid` (a payload `whole[start:stop]` for each span; the last ends
        the stream if `ends`) handed on as one `DataPieces` when both windows admit them all,
        else each in turn, as a frame alone is (charged, or refused, frame by frame)."""
        pieces = [self._piece(whole, start, stop) for start, stop in spans]
        total = sum(map(len, pieces))
        stream = self.streams.get(sid)
        if (
            stream is None  # idle (a connection error) or closed: `_admit` says which
            or stream.remote_done
            or total > stream.receivable
            or total > self._recv_window
        ):
            last = len(pieces) - 1
            for i, piece in enumerate(pieces):
                self._on_data(ends if i == last else 0, sid, piece, events)
            return
        self._recv_window -= total
        stream.receivable -= total
        events.append(DataPieces(sid, pieces, total))
        if ends:
            stream.remote_done = True
            events.append(h2.events.StreamEnded(stream_id=sid))

    def _admit(self, sid: int, length: int, events: list[h2.events.Event]) -> _Stream | None:
        """A DATA frame of `length` payload bytes counted against the windows: its stream, or
        None when its bytes are dropped (given back at once) and the stream reset."""
        if sid == 0 or sid > self.highest:
            self._fail(_E.PROTOCOL_ERROR, "DATA on an idle stream")
        if length > self._recv_window:
            self._fail(_E.FLOW_CONTROL_ERROR, "DATA over the connection's window")
        self._recv_window -= length
        stream = self.streams.get(sid)
        if stream is None or stream.remote_done:
            # A stream closed (ours ended, or reset): its bytes are dropped and given back to
            # the connection's window at once.
            self._credit(length)
            if stream is not None:  # the peer had ended its side: STREAM_CLOSED
                self._reset(sid, _E.STREAM_CLOSED, events)
            return None
        stream.receivable -= length
        if stream.receivable < 0:
            self._credit(length)
            self._reset(sid, _E.FLOW_CONTROL_ERROR, events)
            return None
        return stream

    def _cut_at(
        self,
        flags: int,
        sid: int,
        length: int,
        data: bytes,
        start: int,
        events: list[h2.events.Event],
    ) -> int:
        """An unpadded DATA frame whose payload the read cuts at its end: admitted by its
        header, its first piece handed on now and the rest as it comes (`_go_on`); the
        read's end.

        Not put together first: a read often ends inside a large body's frame, and putting
        that frame together copied its bytes twice (a slice of each read, then the two
        joined) before the message's own join copied them again, and a frame trickled a byte
        a read was copied whole on every read. The whole frame counts against the windows
        with the first piece (`flow_controlled_length`), the later pieces with none.
        """
        kept = self._admit(sid, length, events) is not None
        end = len(data)
        if kept:
            events.append(data_received(sid, self._piece(data, start, end), length))
        self._cut = _CutData(sid, length - (end - start), bool(flags & END_STREAM), kept)
        return end

    def _go_on(self, cut: _CutData, data: bytes, at: int, events: list[h2.events.Event]) -> int:
        """The next piece of the DATA frame `cut` by the last read handed on (or dropped);
        where in `data` the next frame starts."""
        take = min(cut.left, len(data) - at)
        cut.left -= take
        stream = self.streams.get(cut.sid) if cut.kept else None
        if stream is not None and take:
            piece = self._piece(data, at, at + take)
            events.append(data_received(cut.sid, piece, 0))
        if not cut.left:
            self._cut = None
            if cut.ends and stream is not None:
                stream.remote_done = True
                events.append(h2.events.StreamEnded(stream_id=cut.sid))
        return at + take

    @staticmethod
    def _piece(data: bytes | memoryview, start: int, end: int) -> bytes | memoryview:
        """`data[start:end]`, a view of the read when it is large (as `_frames` hands DATA
        on), else a copy."""
        if end - start >= VIEW_BYTES:
            return memoryview(data)[start:end]
        return bytes(data[start:end])

    def _on_headers(
        self, flags: int, sid: int, payload: bytes, events: list[h2.events.Event]
    ) -> None:
        if sid == 0 or not sid & 1:
            self._fail(_E.PROTOCOL_ERROR, "HEADERS on a stream a client cannot open")
        fragment = self._unpadded(payload, flags)
        if flags & PRIORITY_FLAG:
            if len(fragment) < 5:
                self._fail(_E.PROTOCOL_ERROR, "a truncated priority")
            fragment = fragment[5:]
        if flags & END_HEADERS:
            self._on_block(sid, fragment, bool(flags & END_STREAM), events)
            return
        self._block, self._block_sid = [fragment], sid
        self._block_end, self._block_frames = bool(flags & END_STREAM), 0
        self._block_bytes = len(fragment)
        self._check_block()

    def _on_continuation(
        self, flags: int, sid: int, payload: bytes, events: list[h2.events.Event]
    ) -> None:
        block = self._block
        if block is None or sid != self._block_sid:
            self._fail(_E.PROTOCOL_ERROR, "CONTINUATION out of place")
            return
        block.append(payload)
        self._block_frames += 1
        self._block_bytes += len(payload)
        self._check_block()
        if flags & END_HEADERS:
            self._block = None
            self._on_block(sid, b"".join(block), self._block_end, events)

    def _check_block(self) -> None:
        if self._block_frames > MAX_CONTINUATIONS or self._block_bytes > self._max_header_bytes:
            self._fail(_E.ENHANCE_YOUR_CALM, "a header block over its bounds")

    def _on_block(
        self, sid: int, block: bytes, end_stream: bool, events: list[h2.events.Event]
    ) -> None:
        # Decoded whatever becomes of the stream: the HPACK table must stay in step.
        try:
            headers = self._headers.decode(block)
        except OversizedHeaderListError:
            self._fail(_E.ENHANCE_YOUR_CALM, "a header list over the limit")
            return
        except HPACKError:
            self._fail(_E.COMPRESSION_ERROR, "a header block that does not decode")
            return
        if sid > self.highest:
            self.highest = sid
            opened = self.streams[sid] = _Stream(self._peer_window, self._stream_window)
            ended = None
            if end_stream:
                opened.remote_done = True
                ended = h2.events.StreamEnded(stream_id=sid)
            events.append(request_received(sid, headers, ended))
            return
        stream = self.streams.get(sid)
        if stream is None:
            return  # trailers of a stream closed on our side: nothing to do
        if stream.remote_done or not end_stream:
            self._reset(sid, _E.PROTOCOL_ERROR, events)  # a second block must end the stream
            return
        stream.remote_done = True
        events.append(h2.events.StreamEnded(stream_id=sid))

    def _on_reset(self, sid: int, payload: bytes, events: list[h2.events.Event]) -> None:
        if len(payload) != 4:
            self._fail(_E.FRAME_SIZE_ERROR, "RST_STREAM of the wrong size")
        if sid == 0 or sid > self.highest:
            self._fail(_E.PROTOCOL_ERROR, "RST_STREAM on an idle stream")
        if self.streams.pop(sid, None) is None:
            return
        events.append(stream_reset(sid, _U32.unpack(payload)[0]))

    def _on_window_update(self, sid: int, payload: bytes, events: list[h2.events.Event]) -> None:
        if len(payload) != 4:
            self._fail(_E.FRAME_SIZE_ERROR, "WINDOW_UPDATE of the wrong size")
        grow = _U32.unpack(payload)[0] & _MAX_WINDOW
        if sid == 0:
            if grow == 0:
                self._fail(_E.PROTOCOL_ERROR, "a WINDOW_UPDATE of nothing")
            self._send_window += grow
            if self._send_window > _MAX_WINDOW:
                self._fail(_E.FLOW_CONTROL_ERROR, "the connection's window over 2^31-1")
        else:
            if sid > self.highest:
                self._fail(_E.PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
            stream = self.streams.get(sid)
            if stream is None:
                return
            if grow == 0 or stream.window + grow > _MAX_WINDOW:
                code = _E.PROTOCOL_ERROR if grow == 0 else _E.FLOW_CONTROL_ERROR
                self._reset(sid, code, events)
                return
            stream.window += grow
        events.append(h2.events.WindowUpdated(stream_id=sid, delta=grow))

    def _on_settings(
        self, flags: int, sid: int, payload: bytes, events: list[h2.events.Event]
    ) -> None:
        if sid != 0:
            self._fail(_E.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                self._fail(_E.FRAME_SIZE_ERROR, "a SETTINGS ack with a payload")
            return
        if len(payload) % 6:
            self._fail(_E.FRAME_SIZE_ERROR, "SETTINGS of the wrong size")
        for at in range(0, len(payload), 6):
            self._setting(*_SETTING.unpack_from(payload, at))
        self._out.append(_frame(SETTINGS, ACK, 0))
        events.append(h2.events.RemoteSettingsChanged())

    def _setting(self, code: int, value: int) -> None:
        if code == INITIAL_WINDOW_SIZE:
            if value > _MAX_WINDOW:
                self._fail(_E.FLOW_CONTROL_ERROR, "an initial window over 2^31-1")
            delta = value - self._peer_window
            self._peer_window = value
            for stream in self.streams.values():
                stream.window += delta
                if stream.window > _MAX_WINDOW:
                    self._fail(_E.FLOW_CONTROL_ERROR, "a stream's window over 2^31-1")
        elif code == MAX_FRAME_SIZE:
            if not MAX_FRAME_BYTES <= value < 1 << 24:
                self._fail(_E.PROTOCOL_ERROR, "a frame size out of range")
            self.max_outbound_frame_size = value
        elif code == ENABLE_PUSH and value > 1:
            self._fail(_E.PROTOCOL_ERROR, "ENABLE_PUSH neither 0 nor 1")
        # HEADER_TABLE_SIZE bounds a dynamic table our blocks never use; the rest is advice.

    def _on_ping(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0:
            self._fail(_E.PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            self._fail(_E.FRAME_SIZE_ERROR, "PING of the wrong size")
        if not flags & ACK:
            self._out.append(_frame(PING, ACK, 0, payload))

    def _on_goaway(self, sid: int, payload: bytes, events: list[h2.events.Event]) -> None:
        if sid != 0:
            self._fail(_E.PROTOCOL_ERROR, "GOAWAY on a stream")
        if len(payload) < 8:
            self._fail(_E.FRAME_SIZE_ERROR, "GOAWAY too short")
        event = h2.events.ConnectionTerminated()
        event.last_stream_id = _U32.unpack_from(payload, 0)[0] & _MAX_WINDOW
        event.error_code = _U32.unpack_from(payload, 4)[0]
        event.additional_data = payload[8:]
        events.append(event)

    @overload
    def _unpadded(self, payload: bytes, flags: int) -> bytes: ...
    @overload
    def _unpadded(self, payload: memoryview, flags: int) -> memoryview: ...
    def _unpadded(self, payload: bytes | memoryview, flags: int) -> bytes | memoryview:
        if not flags & PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            self._fail(_E.PROTOCOL_ERROR, "padding longer than its frame")
        return payload[1 : len(payload) - payload[0]]

    def _fail(self, code: h2.errors.ErrorCodes, detail: str) -> None:
        """A connection error: GOAWAY with `code`, then `ProtocolError` for the caller."""
        self._out.append(_frame(GOAWAY, 0, 0, _U32.pack(self.highest) + _U32.pack(code)))
        raise h2.exceptions.ProtocolError(f"{code.name}: {detail}")

    def _reset(self, sid: int, code: h2.errors.ErrorCodes, events: list[h2.events.Event]) -> None:
        """A stream error: RST_STREAM, and the stream's end told to the connection."""
        self.reset_stream(sid, code)
        events.append(stream_reset(sid, code, remote=False))

    # flow control -------------------------------------------------------------------------
    def acknowledge_received_data(self, size: int, sid: int) -> None:
        """`size` bytes of `sid` handed on: given back to the peer's windows, a WINDOW_UPDATE
        once half a window is due (as `h2` does)."""
        self._credit(size)
        stream = self.streams.get(sid)
        if stream is None or stream.remote_done:
            return
        stream.unacked += size
        if stream.unacked >= self._stream_window // 2:
            self._out.append(_frame(WINDOW_UPDATE, 0, sid, _U32.pack(stream.unacked)))
            stream.receivable += stream.unacked
            stream.unacked = 0

    def _credit(self, size: int) -> None:
        self._unacked += size
        if self._unacked >= self._recv_target // 2:
            self._out.append(_frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._unacked)))
            self._recv_window += self._unacked
            self._unacked = 0

    def local_flow_control_window(self, sid: int) -> int:
        """Bytes we may send on `sid` now; `StreamClosedError` if it is closed."""
        stream = self.streams.get(sid)
        if stream is None:
            raise h2.exceptions.StreamClosedError(sid)
        return min(stream.window, self._send_window)

    # sending ------------------------------------------------------------------------------
    def send_headers(
        self, sid: int, headers: list[tuple[bytes, bytes]], end_stream: bool = False
    ) -> None:
        if sid not in self.streams:
            raise h2.exceptions.StreamClosedError(sid)
        block = _encoded(headers)
        flags = END_STREAM if end_stream else 0
        size = self.max_outbound_frame_size
        if len(block) <= size:
            self._out.append(_frame(HEADERS, flags | END_HEADERS, sid, block))
        else:
            pieces = [block[i : i + size] for i in range(0, len(block), size)]
            self._out.append(_frame(HEADERS, flags, sid, pieces[0]))
            for piece in pieces[1:-1]:
                self._out.append(_frame(CONTINUATION, 0, sid, piece))
            self._out.append(_frame(CONTINUATION, END_HEADERS, sid, pieces[-1]))
        if end_stream:
            del self.streams[sid]

    def send_data(self, sid: int, data: bytes | memoryview, end_stream: bool = False) -> None:
        stream = self.streams.get(sid)
        if stream is None:
            raise h2.exceptions.StreamClosedError(sid)
        size = len(data)
        if size > min(stream.window, self._send_window, self.max_outbound_frame_size):
            raise h2.exceptions.FlowControlError(f"{size} bytes over the window or frame size")
        stream.window -= size
        self._send_window -= size
        self._out.append(
            _HEAD.pack(size >> 16, size & 0xFFFF, DATA, END_STREAM if end_stream else 0, sid)
        )
        self._out.append(data)
        if end_stream:
            del self.streams[sid]

    def reset_stream(self, sid: int, error_code: int = 0) -> None:
        self.streams.pop(sid, None)
        self._out.append(_frame(RST_STREAM, 0, sid, _U32.pack(error_code)))

    def data_to_send(self) -> bytes:
        out = self._out
        if not out:
            return b""
        data = bytes(out[0]) if len(out) == 1 else b"".join(out)
        out.clear()
        return data
