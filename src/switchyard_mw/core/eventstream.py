"""The AWS event-stream binary framing (`application/vnd.amazon.eventstream`), sans-IO.

Amazon Bedrock sends a streamed answer as a sequence of binary messages, each one

    prelude:  total length (uint32) | headers length (uint32) | CRC32 of those 8 bytes
    headers:  name length (uint8) | name (UTF-8) | type (uint8) | value (by type)
    payload:  total - headers - 16 bytes
    CRC32 of everything before it

all integers big-endian. `Decoder` takes the bytes in whatever pieces the transport cut them
and gives back whole messages; `encode` makes one (the mock provider's Bedrock face).

Our own rather than botocore's `EventStreamBuffer` (read before writing this one): botocore has
no encoder, and the mock needs one; its limits are fixed module constants (a 24 MB payload),
where a gateway holding many streams wants its own bound; its buffer grows by `+=` and its
header parser slices the remaining bytes per header (quadratic for a frame fed in many pieces or
with many headers); and a malformed frame can surface as a `KeyError` (an unknown header type)
or a `struct.error` (a truncated header) rather than its parser error. This one is linear,
raises one `FramingError` for anything malformed, and needs no dependency, so the base install
and the core layer can read a Bedrock stream. Its output is checked against botocore's parser
in the tests, both ways.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping
from typing import NamedTuple

from .base_errors import FramingError

HeaderValue = bool | int | bytes | str
"""A header's value: booleans (types 0, 1), integers (byte, short, integer, long, and a
timestamp in milliseconds), byte arrays and UUIDs (bytes), strings."""

PRELUDE_BYTES = 12
_CRC_BYTES = 4
_MIN_FRAME = PRELUDE_BYTES + _CRC_BYTES
MAX_FRAME_BYTES = 8 << 20
"""The largest message a `Decoder` accepts by default (Bedrock's chunks are a few hundred
bytes: one Anthropic event, base64-encoded in a small JSON object)."""
MAX_HEADERS_BYTES = 128 << 10
"""The protocol's own limit on a message's headers."""

_PRELUDE = struct.Struct("!III")
_UINT32 = struct.Struct("!I")


__all__ = ["MAX_FRAME_BYTES", "Decoder", "FramingError", "HeaderValue", "Message", "encode"]


class Message(NamedTuple):
    """One event-stream message: its headers by name, and its payload."""

    headers: dict[str, HeaderValue]
    payload: bytes


class Decoder:
    """Whole messages out of an event stream fed in any pieces; bounded by `max_frame_bytes`.

    `feed(piece)` returns the messages that piece completed (often none, sometimes several).
    A frame whose prelude announces more than the bound is refused as soon as its 12-byte
    prelude has arrived, before its body is waited for. After a `FramingError` the stream
    cannot be resynchronised (lengths are the only delimiters): every later `feed` raises too.
    """

    __slots__ = ("_buffer", "_failed", "max_frame_bytes")

    def __init__(self, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        if max_frame_bytes < _MIN_FRAME:
            raise ValueError(f"max_frame_bytes must be >= {_MIN_FRAME}, got {max_frame_bytes}")
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()
        self._failed: FramingError | None = None

    @property
    def pending(self) -> int:
        """Bytes held of a message not yet whole (0 between messages: a clean end)."""
        return len(self._buffer)

    def feed(self, piece: bytes) -> list[Message]:
        if self._failed is not None:
            raise self._failed
        self._buffer += piece
        messages: list[Message] = []
        try:
            while (message := self._next()) is not None:
                messages.append(message)
        except FramingError as exc:
            self._failed = exc
            self._buffer.clear()
            raise
        return messages

    def _next(self) -> Message | None:
        buffer = self._buffer
        if len(buffer) < PRELUDE_BYTES:
            return None
        total, headers_length, prelude_crc = _PRELUDE.unpack_from(buffer)
        if zlib.crc32(buffer[:8]) != prelude_crc:
            raise FramingError("event stream: prelude checksum does not match")
        if total > self.max_frame_bytes:
            limit = self.max_frame_bytes
            raise FramingError(
                f"event stream: a {total}-byte message is over the {limit}-byte limit"
            )
        if headers_length > MAX_HEADERS_BYTES or total < _MIN_FRAME + headers_length:
            raise FramingError(
                f"event stream: lengths out of bounds (total {total}, headers {headers_length})"
            )
        if len(buffer) < total:
            return None
        frame = bytes(buffer[:total])  # the one copy: the payload is handed on as bytes
        del buffer[:total]  # from the front of a bytearray: no copy of what follows
        (message_crc,) = _UINT32.unpack_from(frame, total - _CRC_BYTES)
        if zlib.crc32(memoryview(frame)[: total - _CRC_BYTES]) != message_crc:
            raise FramingError("event stream: message checksum does not match")
        headers_end = PRELUDE_BYTES + headers_length
        headers = _headers(memoryview(frame)[PRELUDE_BYTES:headers_end])
        payload = frame[headers_end : total - _CRC_BYTES]
        return Message(headers, payload)


def _headers(block: memoryview) -> dict[str, HeaderValue]:
    headers: dict[str, HeaderValue] = {}
    at, end = 0, len(block)
    while at < end:
        name_length = block[at]
        name = _text(_take(block, at + 1, name_length))
        at += 1 + name_length
        kind = _take(block, at, 1)[0]
        value, at = _value(block, kind, at + 1)
        if name in headers:
            raise FramingError(f"event stream: header {name!r} twice")
        headers[name] = value
    return headers


_FIXED = {2: struct.Struct("!b"), 3: struct.Struct("!h"), 4: struct.Struct("!i")}
_LONG = struct.Struct("!q")  # types 5 (long) and 8 (timestamp, ms since the epoch)
_SHORT_LENGTH = struct.Struct("!H")


def _value(block: memoryview, kind: int, at: int) -> tuple[HeaderValue, int]:
    """The value of header type `kind` starting at `at`, and where the next header starts."""
    if kind in (0, 1):
        return kind == 0, at
    fixed = _LONG if kind in (5, 8) else _FIXED.get(kind)
    if fixed is not None:
        (number,) = fixed.unpack(_take(block, at, fixed.size))
        return int(number), at + fixed.size
    if kind == 9:
        return bytes(_take(block, at, 16)), at + 16
    if kind in (6, 7):
        (length,) = _SHORT_LENGTH.unpack(_take(block, at, 2))
        raw = _take(block, at + 2, length)
        return (_text(raw) if kind == 7 else bytes(raw)), at + 2 + length
    raise FramingError(f"event stream: unknown header type {kind}")


def _take(block: memoryview, at: int, length: int) -> memoryview:
    if at + length > len(block):
        raise FramingError("event stream: a header runs past the headers block")
    return block[at : at + length]


def _text(raw: memoryview) -> str:
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError:
        raise FramingError("event stream: a header is not UTF-8") from None


def encode(headers: Mapping[str, HeaderValue], payload: bytes) -> bytes:
    """One message: string headers as strings (type 7), bytes as byte arrays (6), booleans as
    0/1, integers as a 32-bit integer (4) when they fit, else a long (5)."""
    block = b"".join(_header(name, value) for name, value in headers.items())
    total = _MIN_FRAME + len(block) + len(payload)
    prelude = struct.pack("!II", total, len(block))
    prelude += _UINT32.pack(zlib.crc32(prelude))
    body = prelude + block + payload
    return body + _UINT32.pack(zlib.crc32(body))


def _header(name: str, value: HeaderValue) -> bytes:
    raw_name = name.encode()
    if not 0 < len(raw_name) < 256:
        raise ValueError(f"a header name is 1 to 255 bytes, got {len(raw_name)}")
    head = bytes([len(raw_name)]) + raw_name
    if isinstance(value, bool):
        return head + (b"\x00" if value else b"\x01")
    if isinstance(value, int):
        if -(2**31) <= value < 2**31:
            return head + b"\x04" + _FIXED[4].pack(value)
        return head + b"\x05" + _LONG.pack(value)
    raw = value.encode() if isinstance(value, str) else value
    if len(raw) > 0xFFFF:
        raise ValueError(f"header {name!r}: a value is at most 65535 bytes, got {len(raw)}")
    kind = b"\x07" if isinstance(value, str) else b"\x06"
    return head + kind + _SHORT_LENGTH.pack(len(raw)) + raw
