"""`h2_frames.FrameConnection`, the `frames` transport's HTTP/2, without sockets: against `h2` as
the client (what it sends is read right, what it writes `h2` reads), and each rule of RFC 9113
a peer could break ends the connection or the stream as the RFC says."""

from __future__ import annotations

import struct
from itertools import chain

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import hpack
import pytest
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st

from switchyard_mw.extproc.h2_frames import (
    MAX_CONTINUATIONS,
    PREFACE,
    DataPieces,
    FrameConnection,
    HeaderDecoder,
    data_received,
    encode_headers,
    request_received,
    stream_reset,
)

E = h2.errors.ErrorCodes
STREAM_WINDOW = 16 << 20
CONNECTION_WINDOW = 64 << 20
REQUEST = [
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":path", b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"),
    (b":authority", b"switchyard"),
    (b"content-type", b"application/grpc"),
    (b"te", b"trailers"),
    (b"x-request-id", b"rid-1"),
]


def server() -> FrameConnection:
    connection = FrameConnection()
    connection.initiate(
        max_streams=100,
        stream_window=STREAM_WINDOW,
        connection_window=CONNECTION_WINDOW,
        max_header_list_bytes=64 << 10,
    )
    return connection


def client() -> h2.connection.H2Connection:
    config = h2.config.H2Configuration(client_side=True, header_encoding=None)
    connection = h2.connection.H2Connection(config=config)
    connection.initiate_connection()
    return connection


def frames(data: bytes) -> list[Frame]:
    out = []
    while data:
        frame, length = Frame.parse_frame_header(memoryview(data[:9]))
        frame.parse_body(memoryview(data[9 : 9 + length]))
        out.append(frame)
        data = data[9 + length :]
    return out


def greeted() -> tuple[FrameConnection, h2.connection.H2Connection]:
    """A server and an `h2` client past both prefaces."""
    srv, cli = server(), client()
    srv.receive_data(cli.data_to_send())
    cli.receive_data(srv.data_to_send())
    srv.receive_data(cli.data_to_send())  # the client's SETTINGS ack
    srv.data_to_send()
    return srv, cli


def raw(kind: Frame) -> bytes:
    return kind.serialize()


def preface_and_settings() -> bytes:
    return PREFACE + SettingsFrame(0).serialize()


def goaway_code(connection: FrameConnection) -> int:
    (last,) = [f for f in frames(connection.data_to_send()) if isinstance(f, GoAwayFrame)]
    return last.error_code


# -- the exchange Envoy makes ----------------------------------------------------------------------


def test_the_server_preface_advertises_the_limits_and_opens_the_connection_window() -> None:
    srv = server()
    settings, window = frames(srv.data_to_send())
    assert isinstance(settings, SettingsFrame)
    assert settings.settings == {
        SettingsFrame.MAX_CONCURRENT_STREAMS: 100,
        SettingsFrame.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
        SettingsFrame.MAX_HEADER_LIST_SIZE: 64 << 10,
    }
    assert isinstance(window, WindowUpdateFrame)
    assert window.stream_id == 0
    assert window.window_increment == CONNECTION_WINDOW - 65535


def test_a_grpc_call_from_h2_is_read_and_answered_in_a_form_h2_reads() -> None:
    srv, cli = greeted()
    cli.send_headers(1, REQUEST)
    cli.send_data(1, b"\x00\x00\x00\x00\x03abc", end_stream=True)
    events = srv.receive_data(cli.data_to_send())
    request, data, ended = events
    assert isinstance(request, h2.events.RequestReceived)
    assert request.stream_id == 1
    assert list(request.headers or ()) == REQUEST
    assert request.stream_ended is None
    assert isinstance(data, h2.events.DataReceived)
    assert data.data == b"\x00\x00\x00\x00\x03abc"
    assert data.flow_controlled_length == 8
    assert isinstance(ended, h2.events.StreamEnded)
    assert ended.stream_id == 1

    srv.send_headers(1, [(b":status", b"200"), (b"content-type", b"application/grpc")])
    srv.send_data(1, memoryview(b"\x00\x00\x00\x00\x02ok"))
    detail = b"x" * 300  # a length past HPACK's 7-bit prefix
    srv.send_headers(1, [(b"grpc-status", b"0"), (b"grpc-message", detail)], end_stream=True)
    answer = cli.receive_data(srv.data_to_send())
    kinds = [type(e) for e in answer]
    assert kinds == [
        h2.events.ResponseReceived,
        h2.events.DataReceived,
        h2.events.TrailersReceived,
        h2.events.StreamEnded,
    ]
    assert answer[0].headers == [(b":status", b"200"), (b"content-type", b"application/grpc")]  # type: ignore[attr-defined]
    assert answer[1].data == b"\x00\x00\x00\x00\x02ok"  # type: ignore[attr-defined]
    assert answer[2].headers == [(b"grpc-status", b"0"), (b"grpc-message", detail)]  # type: ignore[attr-defined]
    assert srv.streams == {}  # both sides ended


def test_the_same_block_on_each_new_stream_is_decoded_once_and_read_alike() -> None:
    srv, cli = greeted()
    seen = []
    for sid in (1, 3, 5, 7):
        cli.send_headers(sid, REQUEST, end_stream=True)
        (event,) = srv.receive_data(cli.data_to_send())
        assert isinstance(event, h2.events.RequestReceived)
        assert event.stream_ended is not None
        seen.append(event.headers)
    assert all(list(h or ()) == REQUEST for h in seen)
    assert seen[2] is seen[3]  # the warm block: the last decoding, re-used


def test_a_remembered_block_is_decoded_again_once_the_table_changed() -> None:
    encoder, reference = hpack.Encoder(), hpack.Decoder()
    decoder = HeaderDecoder(64 << 10)
    first = encoder.encode([(b"x-a", b"1")])  # inserts x-a: 1 at index 62
    warm = encoder.encode([(b"x-a", b"1")])  # index 62, changes nothing
    assert decoder.decode(first) == reference.decode(first, raw=True)
    assert decoder.decode(warm) == reference.decode(warm, raw=True) == [(b"x-a", b"1")]
    assert decoder.decode(warm) == [(b"x-a", b"1")]
    other = encoder.encode([(b"x-b", b"2")])  # inserts: index 62 is now x-b: 2
    assert decoder.decode(other) == reference.decode(other, raw=True)
    assert decoder.decode(warm) == reference.decode(warm, raw=True) == [(b"x-b", b"2")]
    resize = b"\x20" + warm  # a table size update to 0 first: the table empties
    with pytest.raises(hpack.HPACKDecodingError):
        reference.decode(resize, raw=True)
    with pytest.raises(hpack.HPACKDecodingError):
        decoder.decode(resize)


@pytest.mark.parametrize(
    "headers",
    [
        [(b":status", b"200")],
        [(b":status", b"415")],
        [(b"content-type", b"application/grpc"), (b"grpc-status", b"13")],
        [(b"grpc-message", b"%20" * 2000)],
    ],
)
def test_encoded_blocks_decode_to_what_was_encoded_and_leave_the_table_alone(
    headers: list[tuple[bytes, bytes]],
) -> None:
    decoder = hpack.Decoder()
    assert decoder.decode(encode_headers(headers), raw=True) == headers
    assert len(decoder.header_table.dynamic_entries) == 0


def test_a_block_larger_than_a_frame_goes_in_continuation_frames() -> None:
    srv, cli = greeted()
    cli.send_headers(1, REQUEST)
    srv.receive_data(cli.data_to_send())
    block = [(b":status", b"200"), (b"grpc-status", b"2"), (b"grpc-message", b"y" * 40_000)]
    srv.send_headers(1, block, end_stream=True)  # trailers only
    out = srv.data_to_send()
    assert [type(f) for f in frames(out)] == [HeadersFrame, ContinuationFrame, ContinuationFrame]
    events = cli.receive_data(out)
    assert events[0].headers == block  # type: ignore[attr-defined]


def test_a_ping_is_answered_and_settings_are_acknowledged() -> None:
    srv, _ = greeted()
    ping = PingFrame(0)
    ping.opaque_data = b"12345678"
    settings = SettingsFrame(0)
    settings.settings = {SettingsFrame.MAX_FRAME_SIZE: 1 << 20}
    events = srv.receive_data(raw(ping) + raw(settings))
    assert [type(e) for e in events] == [h2.events.RemoteSettingsChanged]
    pong, ack = frames(srv.data_to_send())
    assert isinstance(pong, PingFrame)
    assert "ACK" in pong.flags
    assert pong.opaque_data == b"12345678"
    assert isinstance(ack, SettingsFrame)
    assert "ACK" in ack.flags
    assert srv.max_outbound_frame_size == 1 << 20


# -- flow control ---------------------------------------------------------------------------------


def test_sending_keeps_to_the_peers_windows_and_follows_their_changes() -> None:
    srv, cli = greeted()
    cli.send_headers(1, REQUEST)
    srv.receive_data(cli.data_to_send())
    assert srv.local_flow_control_window(1) == 65535
    srv.send_data(1, b"x" * 16384)
    assert srv.local_flow_control_window(1) == 65535 - 16384
    with pytest.raises(h2.exceptions.FlowControlError):
        srv.send_data(1, b"x" * 16385)  # over the frame size
    settings = SettingsFrame(0)
    settings.settings = {SettingsFrame.INITIAL_WINDOW_SIZE: 1000}
    srv.receive_data(raw(settings))
    assert srv.local_flow_control_window(1) == 1000 - 16384  # may go below zero (RFC 9113 6.9.2)
    grow = WindowUpdateFrame(1)
    grow.window_increment = 20_000
    (event,) = srv.receive_data(raw(grow))
    assert isinstance(event, h2.events.WindowUpdated)
    assert event.delta == 20_000
    assert srv.local_flow_control_window(1) == 1000 - 16384 + 20_000
    srv.reset_stream(1, E.CANCEL)
    with pytest.raises(h2.exceptions.StreamClosedError):
        srv.local_flow_control_window(1)
    with pytest.raises(h2.exceptions.StreamClosedError):
        srv.send_data(1, b"x")


def test_received_data_is_given_back_once_half_a_window_is_due() -> None:
    srv, cli = greeted()
    cli.send_headers(1, REQUEST)
    srv.receive_data(cli.data_to_send())
    srv.data_to_send()
    srv.acknowledge_received_data(STREAM_WINDOW // 2 - 1, 1)
    assert srv.data_to_send() == b""
    srv.acknowledge_received_data(1, 1)
    (update,) = frames(srv.data_to_send())
    assert isinstance(update, WindowUpdateFrame)
    assert (update.stream_id, update.window_increment) == (1, STREAM_WINDOW // 2)
    srv.acknowledge_received_data(CONNECTION_WINDOW // 2, 1)
    sids = {f.stream_id for f in frames(srv.data_to_send()) if isinstance(f, WindowUpdateFrame)}
    assert sids == {0, 1}


@pytest.mark.parametrize("cut", [None, 100], ids=["whole", "cut-by-a-read"])
def test_data_over_a_streams_window_resets_that_stream_alone(cut: int | None) -> None:
    """A frame past the window, whole or cut by a read: reset at its header (before the rest
    of a cut one arrives, which is dropped), and the connection reads on."""
    srv, cli = greeted()
    cli.send_headers(1, REQUEST)
    srv.receive_data(cli.data_to_send())
    srv.data_to_send()
    data = DataFrame(1)
    data.data = b"x" * 16384
    chunk = raw(data)
    events = []
    for _ in range(STREAM_WINDOW // 16384):
        events += srv.receive_data(chunk)
    assert all(isinstance(e, h2.events.DataReceived) for e in events)
    srv.data_to_send()
    (reset,) = srv.receive_data(chunk[:cut])
    assert isinstance(reset, h2.events.StreamReset)
    assert reset.error_code == E.FLOW_CONTROL_ERROR
    (rst,) = [f for f in frames(srv.data_to_send()) if isinstance(f, RstStreamFrame)]
    assert rst.error_code == E.FLOW_CONTROL_ERROR
    if cut is not None:
        assert srv.receive_data(chunk[cut:]) == []  # the rest is dropped
    cli.send_headers(3, REQUEST)
    (opened,) = srv.receive_data(cli.data_to_send())
    assert isinstance(opened, h2.events.RequestReceived)


def test_data_after_the_stream_closed_is_dropped_and_given_back() -> None:
    srv, cli = greeted()
    cli.send_headers(1, REQUEST)
    srv.receive_data(cli.data_to_send())
    srv.reset_stream(1, E.REFUSED_STREAM)
    srv.data_to_send()
    data = DataFrame(1)
    data.data = b"x" * 16384
    for _ in range(CONNECTION_WINDOW // 16384 + 10):  # more than the connection's window
        assert srv.receive_data(raw(data)) == []
    assert any(isinstance(f, WindowUpdateFrame) for f in frames(srv.data_to_send()))


# -- connection errors ----------------------------------------------------------------------------


def continuation_flood() -> bytes:
    first = HeadersFrame(1)
    first.data = b"\x82"
    more = ContinuationFrame(1)
    more.data = b"\x00\x01a\x01b"
    return raw(first) + raw(more) * (MAX_CONTINUATIONS + 1)


def data_on_stream_zero() -> bytes:
    head = struct.pack(">BHBBL", 0, 1, 0, 0, 0)
    return head + b"x"


def interleaved_block() -> bytes:
    first = HeadersFrame(1)
    first.data = b"\x82"
    return raw(first) + raw(PingFrame(0))


def oversized_frame() -> bytes:
    return struct.pack(">BHBBL", 0, 16385, 0, 0, 1) + bytes(16385)


def window_overflow() -> bytes:
    grow = WindowUpdateFrame(0)
    grow.window_increment = (1 << 31) - 1
    return raw(grow)


def bad_hpack() -> bytes:
    headers = HeadersFrame(1)
    headers.data = b"\xff\xff\xff\xff\xff\xff"  # an index far past any table
    headers.flags.add("END_HEADERS")
    return raw(headers)


def even_stream() -> bytes:
    headers = HeadersFrame(2)
    headers.data = b"\x82"
    headers.flags.add("END_HEADERS")
    return raw(headers)


@pytest.mark.parametrize(
    ("make", "code"),
    [
        (continuation_flood, E.ENHANCE_YOUR_CALM),
        (data_on_stream_zero, E.PROTOCOL_ERROR),
        (interleaved_block, E.PROTOCOL_ERROR),
        (oversized_frame, E.FRAME_SIZE_ERROR),
        (window_overflow, E.FLOW_CONTROL_ERROR),
        (bad_hpack, E.COMPRESSION_ERROR),
        (even_stream, E.PROTOCOL_ERROR),
    ],
    ids=["continuations", "data-stream-0", "interleaved", "frame-size", "window", "hpack", "even"],
)
def test_a_connection_error_queues_goaway_and_raises(make: object, code: E) -> None:
    srv, _ = greeted()
    with pytest.raises(h2.exceptions.ProtocolError):
        srv.receive_data(make())  # type: ignore[operator]
    assert goaway_code(srv) == code


@pytest.mark.parametrize(
    "opening",
    [b"GET / HTTP/1.1\r\n", PREFACE + raw(PingFrame(0)), PREFACE[:10] + b"x"],
    ids=["http1", "no-settings-first", "bad-preface"],
)
def test_a_client_that_does_not_open_with_the_preface_and_settings_is_refused(
    opening: bytes,
) -> None:
    srv = server()
    srv.data_to_send()
    with pytest.raises(h2.exceptions.ProtocolError):
        srv.receive_data(opening)


def test_a_preface_may_arrive_a_byte_at_a_time() -> None:
    srv = server()
    events = []
    for byte in preface_and_settings():
        events += srv.receive_data(bytes([byte]))
    assert [type(e) for e in events] == [h2.events.RemoteSettingsChanged]


def test_a_goaway_from_the_client_ends_the_connection() -> None:
    srv, _ = greeted()
    goaway = GoAwayFrame(0)
    goaway.last_stream_id = 0
    goaway.error_code = E.NO_ERROR
    (event,) = srv.receive_data(raw(goaway))
    assert isinstance(event, h2.events.ConnectionTerminated)


@pytest.mark.parametrize("cut", [1, 7, 9, 10, 4096, 16393, 65536])
def test_frames_cut_anywhere_by_reads_give_the_same_events(cut: int) -> None:
    srv, cli = greeted()
    cli.send_headers(1, REQUEST)
    body = bytes(range(256)) * 200  # 51 KB: four DATA frames, one short
    for at in range(0, len(body), 16384):
        cli.send_data(1, body[at : at + 16384])
    cli.end_stream(1)
    sent = cli.data_to_send()
    events = []
    for at in range(0, len(sent), cut):
        events += srv.receive_data(sent[at : at + cut])
    kinds = [type(e) for e in events]
    assert kinds[0] is h2.events.RequestReceived
    assert kinds[-1] is h2.events.StreamEnded
    (data,) = [item for item in merged(told(events)) if item[0] == "data"]
    assert data[2] == body


def told(events: list[h2.events.Event]) -> list[tuple[object, ...]]:
    """What `events` tell, one item each: (data, stream, its bytes, flow-controlled length),
    (end, stream), (reset, stream, code)."""
    items: list[tuple[object, ...]] = []
    for e in events:
        if isinstance(e, h2.events.DataReceived | DataPieces):
            pieces = e.pieces if isinstance(e, DataPieces) else [e.data]
            data = b"".join(bytes(p) for p in pieces)
            items.append(("data", e.stream_id, data, e.flow_controlled_length))
        elif isinstance(e, h2.events.StreamEnded):
            items.append(("end", e.stream_id))
        elif isinstance(e, h2.events.StreamReset):
            items.append(("reset", e.stream_id, e.error_code))
        else:
            items.append((type(e).__name__,))
    return items


def merged(items: list[tuple[object, ...]]) -> list[tuple[object, ...]]:
    """`told`'s items with each stream's DATA back to back taken as one (however many events
    or reads it came in)."""
    out: list[tuple[object, ...]] = []
    for item in items:
        if item[0] == "data" and out and out[-1][:2] == item[:2]:
            _, sid, before, flow = out.pop()
            out.append(("data", sid, before + item[2], flow + item[3]))  # type: ignore[operator]
        else:
            out.append(item)
    return out


def test_data_frames_of_a_stream_back_to_back_in_a_read_are_one_event_of_views() -> None:
    """A large body whole within one read comes in one event, not one a frame (the
    per-frame steps were most of what a 128 KB body added to the transport's work), its
    pieces views of the read, then copied once, when its message is joined (`h2_connection`
    copies whatever it keeps past the read: its tests hold that)."""
    srv, cli = greeted()
    cli.send_headers(1, REQUEST)
    body = bytes(range(256)) * 256  # 64 KB: four DATA frames of 16 KB, then a short one
    for at in range(0, len(body), 16384):
        cli.send_data(1, body[at : at + 16384])
    cli.send_data(1, b"tail", end_stream=True)
    read = cli.data_to_send()
    opened, run, ended = srv.receive_data(read)
    assert isinstance(opened, h2.events.RequestReceived)
    assert isinstance(run, DataPieces)
    assert run.stream_id == 1
    assert run.flow_controlled_length == len(body) + 4  # both windows charged once, in full
    *large, small = run.pieces
    assert len(large) == 4
    assert all(isinstance(p, memoryview) and p.obj is read for p in large)
    assert isinstance(small, bytes)  # a small piece is copied (see `VIEW_BYTES`)
    assert b"".join(run.pieces) == body + b"tail"
    assert isinstance(ended, h2.events.StreamEnded)


def test_a_run_of_data_frames_stops_at_another_stream_a_padded_frame_or_a_cut_one() -> None:
    srv, cli = greeted()
    cli.send_headers(1, REQUEST)
    cli.send_headers(3, REQUEST)
    srv.receive_data(cli.data_to_send())
    chunk = b"x" * 16384
    frames_sent = b"".join(
        [
            _data_bytes(1, chunk, end=False, pad=None),
            _data_bytes(1, chunk, end=False, pad=None),
            _data_bytes(3, chunk, end=False, pad=None),
            _data_bytes(1, chunk, end=False, pad=None),
            _data_bytes(1, chunk[:8000], end=False, pad=10),
            _data_bytes(1, chunk, end=False, pad=None),
        ]
    )
    events = srv.receive_data(frames_sent[:-100])
    kinds = [(type(e).__name__, e.stream_id) for e in events]  # type: ignore[attr-defined]
    assert kinds == [
        ("DataPieces", 1),
        ("DataReceived", 3),
        ("DataReceived", 1),
        ("DataReceived", 1),  # padded: never in a run
        ("DataReceived", 1),  # cut by the read: its first piece
    ]


def _data_bytes(sid: int, data: bytes, *, end: bool, pad: int | None) -> bytes:
    """A DATA frame as bytes, on any stream (hyperframe refuses to write one on stream 0)."""
    flags = (0x1 if end else 0) | (0x8 if pad is not None else 0)
    payload = data if pad is None else bytes([pad]) + data + b"\0" * pad
    size = len(payload)
    return struct.pack(">BHBBL", size >> 16, size & 0xFFFF, 0, flags, sid) + payload


_FRAMES = st.tuples(
    st.sampled_from([1, 3, 5, 0]),  # two open streams, one idle, the connection's
    st.integers(1, 4),  # frames of that stream back to back
    st.sampled_from([0, 1, 4095, 4096, 16384]),
    st.booleans(),  # END_STREAM on the last of them
    st.sampled_from([None, None, 0, 7]),  # padding
).map(lambda f: [(f[0], f[2], f[3] and i == f[1] - 1, f[4]) for i in range(f[1])])


_BIG, _SMALL = (3, 16384, False, None), (1, 4096, False, None)


@settings(max_examples=400, deadline=None)
@example(sent=[_BIG] * 3 + [_SMALL] * 4)  # a run its stream admits, past the connection's window
@example(sent=[(1, 16384, False, None)] * 3)  # a run past its stream's window
@example(sent=[(1, 16384, True, None), (1, 16384, False, None)])  # DATA after the stream's end
@given(sent=st.lists(_FRAMES, min_size=1, max_size=6).map(lambda runs: list(chain(*runs))))
def test_data_frames_in_one_read_tell_what_they_tell_a_read_each(
    sent: list[tuple[int, int, bool, int | None]],
) -> None:
    """Frames back to back in one read give the same DATA, ends, resets, bytes written and
    connection errors as the same frames read one at a time: windows charged frame by
    frame where a run would not fit, closed and idle streams, padding, END_STREAM."""

    def opened() -> FrameConnection:
        srv = FrameConnection()
        srv.initiate(
            max_streams=100,
            stream_window=40000,
            connection_window=65535,  # less than both streams may take
            max_header_list_bytes=64 << 10,
        )
        cli = client()
        cli.send_headers(1, REQUEST)
        cli.send_headers(3, REQUEST)
        srv.receive_data(cli.data_to_send())
        srv.data_to_send()
        return srv

    wire = [_data_bytes(sid, b"d" * size, end=end, pad=pad) for sid, size, end, pad in sent]
    together, apart = opened(), opened()
    one_read: list[tuple[object, ...]] | None
    try:
        one_read = merged(told(together.receive_data(b"".join(wire))))
    except h2.exceptions.ProtocolError:
        one_read = None
    a_read_each: list[tuple[object, ...]] | None = []
    for frame in wire:
        try:
            a_read_each += told(apart.receive_data(frame))  # type: ignore[operator]
        except h2.exceptions.ProtocolError:
            a_read_each = None
            break
    # Both end the connection (with the same GOAWAY, below), or tell the same.
    assert one_read == (None if a_read_each is None else merged(a_read_each))
    assert together.data_to_send() == apart.data_to_send()


def _one_frame_cut(at: int, *, end_stream: bool = False) -> tuple[FrameConnection, list[bytes]]:
    """A server greeted, stream 1 open, and one 16 KB DATA frame of stream 1 cut into two
    reads `at` bytes into its payload (not yet received)."""
    srv, cli = greeted()
    cli.send_headers(1, REQUEST)
    srv.receive_data(cli.data_to_send())
    srv.data_to_send()
    cli.send_data(1, bytes(range(256)) * 64, end_stream=end_stream)
    sent = cli.data_to_send()
    return srv, [sent[: 9 + at], sent[9 + at :]]


def _data(events: list[h2.events.Event]) -> list[h2.events.DataReceived]:
    return [e for e in events if isinstance(e, h2.events.DataReceived)]


def test_a_data_frame_cut_by_a_read_is_handed_on_in_pieces_as_views_of_each_read() -> None:
    """Not put together first: each piece of its payload is handed on as it arrives (a view
    of its read once it is large), so a body whose frames the reads cut is not copied twice
    more on its way (the cut frame's bytes sliced, then joined)."""
    srv, reads = _one_frame_cut(6000, end_stream=True)
    first = srv.receive_data(reads[0])
    assert [type(e) for e in first] == [h2.events.DataReceived]  # the stream has not ended
    second = srv.receive_data(reads[1])
    assert [type(e) for e in second] == [h2.events.DataReceived, h2.events.StreamEnded]
    pieces = [e.data for e in _data(first + second)]
    assert [len(p) for p in pieces] == [6000, 16384 - 6000]
    assert all(isinstance(p, memoryview) for p in pieces)
    assert pieces[0].obj is reads[0]  # type: ignore[attr-defined]
    assert pieces[1].obj is reads[1]  # type: ignore[attr-defined]
    assert b"".join(pieces) == bytes(range(256)) * 64
    # The whole frame counts against the windows once, with its first piece.
    assert [e.flow_controlled_length for e in _data(first + second)] == [16384, 0]


@pytest.mark.parametrize("at", [0, 1, 100, 4095])
def test_a_small_piece_of_a_cut_frame_is_a_copy_and_an_empty_one_still_counts(at: int) -> None:
    srv, reads = _one_frame_cut(at)
    (first,) = _data(srv.receive_data(reads[0]))
    assert isinstance(first.data, bytes)
    assert len(first.data) == at
    assert first.flow_controlled_length == 16384
    (second,) = _data(srv.receive_data(reads[1]))
    assert isinstance(second.data, memoryview)
    assert len(second.data) == 16384 - at
    assert second.flow_controlled_length == 0


def test_a_data_frame_sent_a_byte_a_read_is_handed_on_a_byte_a_read() -> None:
    """A peer trickling a frame costs a piece per read, not a copy of all it sent so far per
    read (putting a 16 KB frame together a byte at a time copied about 134 MB)."""
    srv, reads = _one_frame_cut(0)
    srv.receive_data(reads[0])
    rest = reads[1]
    sizes = []
    for i in range(len(rest)):
        (piece,) = _data(srv.receive_data(rest[i : i + 1]))
        sizes.append(len(piece.data))
    assert sizes == [1] * 16384


def test_a_cut_frame_over_the_connections_window_ends_the_connection_at_once() -> None:
    srv = FrameConnection()  # the connection's window left at 65,535 bytes
    srv.initiate(
        max_streams=100,
        stream_window=STREAM_WINDOW,
        connection_window=65535,
        max_header_list_bytes=64 << 10,
    )
    srv.receive_data(preface_and_settings())
    srv.data_to_send()
    head = HeadersFrame(1)
    head.data = hpack.Encoder().encode(REQUEST)
    head.flags.add("END_HEADERS")
    srv.receive_data(raw(head))
    data = DataFrame(1)
    data.data = b"x" * 16384
    for _ in range(3):
        srv.receive_data(raw(data))  # 49,152 bytes, not given back: 16,383 left
    with pytest.raises(h2.exceptions.ProtocolError):
        srv.receive_data(raw(data)[:50])
    assert goaway_code(srv) == E.FLOW_CONTROL_ERROR


def test_the_rest_of_a_cut_frame_on_a_stream_reset_meanwhile_is_dropped() -> None:
    srv, reads = _one_frame_cut(6000, end_stream=True)
    (first,) = _data(srv.receive_data(reads[0]))
    srv.acknowledge_received_data(first.flow_controlled_length, 1)
    srv.reset_stream(1, E.CANCEL)
    srv.data_to_send()
    assert srv.receive_data(reads[1]) == []  # no data, no end: the stream is gone
    assert srv._recv_window + srv._unacked == CONNECTION_WINDOW  # credited once, whole


def test_a_padded_frame_cut_by_a_read_is_put_together_and_unpadded() -> None:
    srv, cli = greeted()
    cli.send_headers(1, REQUEST)
    srv.receive_data(cli.data_to_send())
    srv.data_to_send()
    cli.send_data(1, b"y" * 9000, pad_length=20)
    sent = cli.data_to_send()
    assert _data(srv.receive_data(sent[:5000])) == []
    (data,) = _data(srv.receive_data(sent[5000:]))
    assert bytes(data.data) == b"y" * 9000
    assert data.flow_controlled_length == 9000 + 20 + 1


def test_padding_is_dropped_and_padding_longer_than_its_frame_ends_the_connection() -> None:
    srv, cli = greeted()
    cli.send_headers(1, REQUEST)
    cli.send_data(1, b"abc", pad_length=10)
    events = srv.receive_data(cli.data_to_send())
    (data,) = [e for e in events if isinstance(e, h2.events.DataReceived)]
    assert data.data == b"abc"
    assert data.flow_controlled_length == 3 + 10 + 1  # padding counts against the window
    bad = struct.pack(">BHBBL", 0, 2, 0, 0x8, 1) + b"\x05x"  # 5 bytes of padding in 2
    with pytest.raises(h2.exceptions.ProtocolError):
        srv.receive_data(bad)
    assert goaway_code(srv) == E.PROTOCOL_ERROR


def test_the_events_built_directly_are_the_ones_h2_builds() -> None:
    """The events of every stream (its request, its DATA, its reset) are built without h2's
    dataclass `__init__` (keyword-only arguments, about three times the cost): each must be
    the event h2's own constructor gives, every field set, so a field h2 adds shows here."""
    ended = h2.events.StreamEnded(stream_id=3)
    pairs = [
        (
            data_received(3, b"body", 9),
            h2.events.DataReceived(stream_id=3, data=b"body", flow_controlled_length=9),
        ),
        (
            request_received(5, [(b":path", b"/p")], ended),
            h2.events.RequestReceived(stream_id=5, headers=[(b":path", b"/p")], stream_ended=ended),
        ),
        (
            request_received(5, [], None),
            h2.events.RequestReceived(stream_id=5, headers=[]),
        ),
        (stream_reset(7, 8), h2.events.StreamReset(stream_id=7, error_code=8)),
        (
            stream_reset(7, E.CANCEL, remote=False),
            h2.events.StreamReset(stream_id=7, error_code=E.CANCEL, remote_reset=False),
        ),
    ]
    for built, by_h2 in pairs:
        assert type(built) is type(by_h2)
        assert vars(built) == vars(by_h2)
