"""gRPC's framing (`h2_framing`), alone: messages cut out of DATA pieces however the pieces
fall, the bounds a length prefix meets, the framing written back, request headers read and
trailers written."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from switchyard_mw.extproc.h2_framing import (
    INTERNAL,
    PREFIX_BYTES,
    RESOURCE_EXHAUSTED,
    RESPONSE_HEADERS,
    MessageReader,
    Refusal,
    frame,
    percent_encoded,
    read_headers,
    trailers,
)

LIMIT = 1 << 20


def take_all(reader: MessageReader) -> list[bytes]:
    found = []
    while (payload := reader.next_message(LIMIT)) is not None:
        assert isinstance(payload, memoryview)
        found.append(bytes(payload))
    return found


def test_a_message_in_one_piece_is_a_view_of_it() -> None:
    data = frame(b"h" * 300)
    reader = MessageReader()
    reader.add(data)
    payload = reader.next_message(LIMIT)
    assert isinstance(payload, memoryview)
    assert bytes(payload) == b"h" * 300
    assert payload.obj is data  # not copied
    assert reader.size == 0
    assert reader.next_message(LIMIT) is None


def test_two_messages_in_one_piece_come_out_in_order() -> None:
    reader = MessageReader()
    reader.add(frame(b"one") + frame(b"") + frame(b"three"))
    assert take_all(reader) == [b"one", b"", b"three"]
    assert reader.size == 0
    assert reader.parts == []


def take_due(reader: MessageReader) -> list[bytes]:
    """As the transport takes them: asked only while `size` reaches `need` (not for each DATA
    piece of a large message)."""
    found = []
    while reader.size >= reader.need and (payload := reader.next_message(LIMIT)) is not None:
        assert isinstance(payload, memoryview)
        found.append(bytes(payload))
    return found


def cut_up(wire: bytes, cuts: list[int]) -> Iterator[bytes]:
    """`wire` in pieces of the sizes in `cuts`, the rest in one last piece."""
    at = 0
    for cut in [*cuts, len(wire)]:
        piece = wire[at : at + cut]
        at += len(piece)
        if piece:
            yield piece


@pytest.mark.parametrize("take", [take_all, take_due])
@given(
    payloads=st.lists(st.binary(max_size=600), min_size=1, max_size=5),
    cuts=st.lists(st.integers(min_value=1, max_value=700), max_size=30),
)
def test_messages_cut_anywhere_arrive_whole_and_in_order(
    take: Callable[[MessageReader], list[bytes]], payloads: list[bytes], cuts: list[int]
) -> None:
    reader = MessageReader()
    got: list[bytes] = []
    for piece in cut_up(b"".join(frame(p) for p in payloads), cuts):
        reader.add(piece)
        got += take(reader)
    assert got == payloads
    assert reader.size == 0
    assert reader.need == PREFIX_BYTES


def test_the_need_is_a_prefix_then_the_whole_message_then_a_prefix_again() -> None:
    data = frame(b"x" * 70_000)
    reader = MessageReader()
    assert reader.need == PREFIX_BYTES
    reader.add(data[:16_000])
    assert reader.next_message(LIMIT) is None
    assert reader.need == PREFIX_BYTES + 70_000
    reader.add(data[16_000:])
    assert bytes(reader.next_message(LIMIT)) == b"x" * 70_000  # type: ignore[arg-type]
    assert reader.need == PREFIX_BYTES
    reader.add(data[:100])
    assert reader.next_message(LIMIT) is None
    assert reader.drop_partial() == 100
    assert reader.need == PREFIX_BYTES


def test_a_length_prefix_split_over_pieces_is_read() -> None:
    data = frame(b"x" * 300)
    reader = MessageReader()
    for i in range(PREFIX_BYTES):
        reader.add(data[i : i + 1])
        assert reader.next_message(LIMIT) is None
    reader.add(data[PREFIX_BYTES:])
    assert take_all(reader) == [b"x" * 300]


def test_tiny_pieces_are_gathered_not_kept_one_object_each() -> None:
    data = frame(b"x" * 10_000)
    reader = MessageReader()
    for i in range(5000):
        reader.add(data[i : i + 1])
    assert reader.size == 5000
    assert sum(sys.getsizeof(part) for part in reader.parts) < 2 * reader.size


def test_the_bytes_after_a_joined_message_do_not_keep_it_alive() -> None:
    first = frame(b"a" * 1000)
    second = frame(b"b" * 10)
    reader = MessageReader()
    reader.add(first[:600])
    reader.add(first[600:] + second[:3])
    joined = reader.next_message(LIMIT)
    assert isinstance(joined, memoryview)
    assert bytes(joined) == b"a" * 1000
    assert reader.size == 3
    (rest,) = reader.parts
    assert isinstance(rest, bytes)  # copied out of the joined message
    reader.add(second[3:])
    assert take_all(reader) == [b"b" * 10]


def test_a_length_at_the_limit_is_taken_one_over_is_refused_at_once() -> None:
    reader = MessageReader()
    reader.add(frame(b"y" * 100))
    at_limit = reader.next_message(100)
    assert isinstance(at_limit, memoryview)
    assert bytes(at_limit) == b"y" * 100
    reader = MessageReader()
    reader.add(b"\x00" + (101).to_bytes(4, "big"))  # only the prefix: refused already
    refusal = reader.next_message(100)
    assert refusal == Refusal(RESOURCE_EXHAUSTED, "message of 101 bytes over 100")


def test_the_compressed_flag_is_refused() -> None:
    reader = MessageReader()
    reader.add(b"\x01" + (3).to_bytes(4, "big") + b"abc")
    refusal = reader.next_message(LIMIT)
    assert isinstance(refusal, Refusal)
    assert refusal.status == INTERNAL


def test_drop_partial_lets_go_of_what_arrived() -> None:
    reader = MessageReader()
    reader.add(frame(b"z" * 50)[:30])
    assert reader.drop_partial() == 30
    assert (reader.size, reader.parts) == (0, [])


def test_frame_writes_the_prefix() -> None:
    assert frame(b"abc") == b"\x00\x00\x00\x00\x03abc"
    assert frame(b"") == b"\x00" * 5


@pytest.mark.parametrize(
    ("text", "encoded"),
    [
        ("plain text", b"plain text"),
        ("100%", b"100%25"),
        ("caf\u00e9\n", b"caf%C3%A9%0A"),
        ("~ \x7f", b"~ %7F"),
    ],
)
def test_percent_encoding_of_a_status_detail(text: str, encoded: bytes) -> None:
    assert percent_encoded(text) == encoded


def test_request_headers_name_the_method_and_keep_the_metadata() -> None:
    call = read_headers(
        [
            (b":method", b"POST"),
            (b":path", b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"),
            (b"content-type", b"application/grpc"),
            (b"grpc-encoding", b"identity"),
            (b"te", b"trailers"),
            (b"x-switchyard-filter", b"upstream"),
        ]
    )
    assert call.path == b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"
    assert (call.content_type, call.encoding) == (b"application/grpc", b"identity")
    assert call.metadata == [("te", b"trailers"), ("x-switchyard-filter", b"upstream")]


def test_request_headers_without_the_grpc_ones_are_empty() -> None:
    call = read_headers([(b":path", b"/x"), (b"x-\xe9", b"v")])
    assert (call.content_type, call.encoding) == (b"", b"")
    assert call.metadata == [("x-\u00e9", b"v")]  # names as latin-1, as gRPC metadata


def test_trailers_carry_the_status_and_its_detail() -> None:
    assert trailers(0, "", trailers_only=False) == [(b"grpc-status", b"0")]
    assert trailers(8, "over 5%", trailers_only=False) == [
        (b"grpc-status", b"8"),
        (b"grpc-message", b"over 5%25"),
    ]
    assert trailers(12, "", trailers_only=True) == [*RESPONSE_HEADERS, (b"grpc-status", b"12")]
