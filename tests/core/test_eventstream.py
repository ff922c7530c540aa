"""The AWS event-stream framing: our messages read by botocore's parser, any split of a
stream gives the same messages, and every malformed or oversized frame is a `FramingError`."""

from __future__ import annotations

import itertools
import struct
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from switchyard_mw.core.eventstream import (
    MAX_FRAME_BYTES,
    PRELUDE_BYTES,
    Decoder,
    FramingError,
    Message,
    encode,
)

botocore_eventstream = pytest.importorskip("botocore.eventstream")

CHUNK_HEADERS = {
    ":event-type": "chunk",
    ":content-type": "application/json",
    ":message-type": "event",
}


def _botocore_reads(data: bytes) -> list[tuple[dict[str, object], bytes]]:
    buffer = botocore_eventstream.EventStreamBuffer()
    buffer.add_data(data)
    return [(message.headers, message.payload) for message in buffer]


def test_botocore_reads_what_we_encode_and_we_read_it_back() -> None:
    headers = {
        ":event-type": "chunk",
        "flag-on": True,
        "flag-off": False,
        "small": 7,
        "negative": -(2**31),
        "large": 2**40,
        "raw": b"\x00\xffbytes",
        "text": "ünïcode",
    }
    payloads = [b'{"bytes":"eyJ0eXBlIjoibWVzc2FnZV9zdG9wIn0="}', b"", b"x" * 70_000]
    data = b"".join(encode(headers, p) for p in payloads)

    expected = [(headers, p) for p in payloads]
    assert _botocore_reads(data) == expected
    assert [(m.headers, m.payload) for m in Decoder().feed(data)] == expected


@given(
    payloads=st.lists(st.binary(max_size=300), min_size=1, max_size=6),
    cuts=st.lists(st.integers(min_value=0, max_value=3000), max_size=12),
)
def test_any_split_gives_the_same_messages(payloads: list[bytes], cuts: list[int]) -> None:
    data = b"".join(encode(CHUNK_HEADERS, p) for p in payloads)
    bounds = sorted({0, len(data), *(c for c in cuts if c < len(data))})
    decoder = Decoder()
    got: list[Message] = []
    for start, end in itertools.pairwise(bounds):
        got += decoder.feed(data[start:end])
    assert [m.payload for m in got] == payloads
    assert all(m.headers == CHUNK_HEADERS for m in got)
    assert decoder.pending == 0


def test_a_partial_message_is_pending_until_its_last_byte() -> None:
    frame = encode(CHUNK_HEADERS, b"payload")
    decoder = Decoder()
    assert decoder.feed(frame[:-1]) == []
    assert decoder.pending == len(frame) - 1
    assert decoder.feed(frame[-1:]) == [Message(CHUNK_HEADERS, b"payload")]
    assert decoder.pending == 0


def _frame_of_size(total: int) -> bytes:
    return encode({}, b"p" * (total - 16))


def test_the_frame_limit_is_exact() -> None:
    limit = 1000
    assert Decoder(max_frame_bytes=limit).feed(_frame_of_size(limit))[0].payload == b"p" * 984
    with pytest.raises(FramingError, match="1001-byte message is over the 1000-byte limit"):
        Decoder(max_frame_bytes=limit).feed(_frame_of_size(limit + 1))


def test_an_oversized_frame_is_refused_from_its_prelude_alone() -> None:
    # A prelude announcing 4 GiB: refused on its 12 bytes, nothing waited for or held.
    prelude = struct.pack("!II", 0xFFFFFFF0, 0)
    prelude += struct.pack("!I", zlib.crc32(prelude))
    decoder = Decoder()
    with pytest.raises(FramingError, match="over the"):
        decoder.feed(prelude)
    assert decoder.pending == 0
    assert len(prelude) == PRELUDE_BYTES
    assert MAX_FRAME_BYTES < 0xFFFFFFF0


def _corrupt(frame: bytes, at: int) -> bytes:
    return frame[:at] + bytes([frame[at] ^ 0x01]) + frame[at + 1 :]


def _with_headers_block(block: bytes, payload: bytes = b"{}") -> bytes:
    """A frame with valid checksums around an arbitrary headers block."""
    total = 16 + len(block) + len(payload)
    prelude = struct.pack("!II", total, len(block))
    prelude += struct.pack("!I", zlib.crc32(prelude))
    body = prelude + block + payload
    return body + struct.pack("!I", zlib.crc32(body))


def _prelude_only(total: int, headers_length: int) -> bytes:
    prelude = struct.pack("!II", total, headers_length)
    return prelude + struct.pack("!I", zlib.crc32(prelude))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_corrupt(encode(CHUNK_HEADERS, b"{}"), 2), "prelude checksum"),
        (_corrupt(encode(CHUNK_HEADERS, b"{}"), 20), "message checksum"),
        (_corrupt(encode(CHUNK_HEADERS, b"{}"), -1), "message checksum"),
        (_with_headers_block(b"\x01a\x0a"), "unknown header type 10"),
        (_with_headers_block(b"\x01a\x07\x00\x09abc"), "runs past"),
        (_with_headers_block(b"\x05abc"), "runs past"),
        (_with_headers_block(b"\x01a\x04\x00\x00"), "runs past"),
        (_with_headers_block(b"\x01a\x07\x00\x02\xff\xfe"), "not UTF-8"),
        (_with_headers_block(b"\x01a\x00\x01a\x01"), "header 'a' twice"),
        (_prelude_only(15, 0), "out of bounds"),
    ],
)
def test_malformed_frames_are_framing_errors(data: bytes, message: str) -> None:
    decoder = Decoder()
    with pytest.raises(FramingError, match=message):
        decoder.feed(data)
    # No resynchronising a stream whose only delimiters are its lengths.
    with pytest.raises(FramingError, match=message):
        decoder.feed(encode(CHUNK_HEADERS, b"{}"))


def test_every_header_type_botocore_knows_is_read() -> None:
    block = (
        b"\x01b\x02\xff"  # byte -1
        + b"\x01s\x03\x80\x00"  # short -32768
        + b"\x01t\x08"
        + struct.pack("!q", 1_764_670_000_000)  # timestamp (ms)
        + b"\x01u\x09"
        + bytes(range(16))  # uuid
    )
    frame = _with_headers_block(block)
    ours = Decoder().feed(frame)[0].headers
    assert ours == {"b": -1, "s": -32768, "t": 1_764_670_000_000, "u": bytes(range(16))}
    assert _botocore_reads(frame)[0][0] == ours
