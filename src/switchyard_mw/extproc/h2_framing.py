"""gRPC's framing for the `h2` transport, without sockets or HTTP/2 (grpc/doc/PROTOCOL-HTTP2.md).

A call's request headers name its method and carry its metadata (`read_headers`). A gRPC
message is a flag byte (1: compressed), a 4-byte big-endian length and the payload:
`MessageReader` cuts messages out of the DATA pieces as they arrive, `frame` makes one. A call
ends with `grpc-status` (and `grpc-message`, percent-encoded) in its trailers (`trailers`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# gRPC status codes (grpc/doc/statuscodes.md)
OK = 0
UNKNOWN = 2
INVALID_ARGUMENT = 3
DEADLINE_EXCEEDED = 4
NOT_FOUND = 5
RESOURCE_EXHAUSTED = 8
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14

PREFIX_BYTES = 5
"""The flag byte and the length before each message."""
SMALL_PIECE = 256
"""DATA pieces smaller than this are gathered into one bytearray: a peer sending tiny frames
would otherwise make a stream hold an object (~40 bytes) for every byte or few it sent."""

Piece = bytes | bytearray | memoryview
RESPONSE_HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc")]
"""Before a call's first answer, or in its trailers when it has none (trailers only)."""


@dataclass(frozen=True, slots=True)
class RequestHeaders:
    """What the transport reads of a call's request headers."""

    path: bytes
    content_type: bytes
    encoding: bytes
    metadata: list[tuple[str, bytes]]
    """Every header that is not a pseudo-header, `content-type` or `grpc-encoding`."""


def read_headers(headers: Iterable[tuple[bytes, bytes]]) -> RequestHeaders:
    """The method's path, content type, message encoding and metadata of a call."""
    path = content_type = encoding = b""
    metadata: list[tuple[str, bytes]] = []
    for name, value in headers:
        if name[:1] == b":":
            if name == b":path":
                path = value
        elif name == b"content-type":
            content_type = value
        elif name == b"grpc-encoding":
            encoding = value
        else:
            metadata.append((name.decode("latin-1"), value))
    return RequestHeaders(path, content_type, encoding, metadata)


def trailers(status: int, detail: str, *, trailers_only: bool) -> list[tuple[bytes, bytes]]:
    """The headers that end a call with `status`; with `trailers_only` (nothing was sent),
    the response headers too."""
    block = [(b"grpc-status", str(status).encode())]
    if detail:
        block.append((b"grpc-message", percent_encoded(detail)))
    return RESPONSE_HEADERS + block if trailers_only else block


@dataclass(frozen=True, slots=True)
class Refusal:
    """A message the stream cannot take: its status and detail end the stream. (Returned:
    the transport ends the stream, and nothing above it ever sees one.)"""

    status: int
    detail: str


class MessageReader:
    """The messages of one stream's request, cut out of its DATA pieces in order.

    A message's pieces are joined once it is whole, and its payload is a view of them: one
    copy of a message that came in many DATA frames, none of one that came in one (but for
    a piece that is a view of a read, copied once: see `settle`).

    The transport's stream is a `MessageReader` itself (a subclass, not an attribute): one
    object fewer per stream on the hot path.
    """

    __slots__ = ("need", "parts", "size")

    def __init__(self) -> None:
        self.parts: list[Piece] = []
        """The pieces of the message now arriving (and of any after it)."""
        self.size = 0
        """Bytes in `parts`."""
        self.need = PREFIX_BYTES
        """What `size` must reach before asking `next_message`: a prefix, then, once one is
        in, its whole message (a large message's DATA pieces are not each asked about)."""

    def add(self, data: bytes | memoryview) -> None:
        """Take one DATA piece (not empty)."""
        parts = self.parts
        if len(data) >= SMALL_PIECE:
            parts.append(data)
        elif parts and type(parts[-1]) is bytearray:
            parts[-1] += data
        else:
            parts.append(bytearray(data))
        self.size += len(data)

    def add_all(self, pieces: Sequence[bytes | memoryview]) -> None:
        """Take the pieces of several DATA frames (some may be empty)."""
        for data in pieces:
            if data:
                self.add(data)

    def next_message(self, limit: int) -> memoryview | Refusal | None:
        """The payload of the next whole message (its prefix dropped), or None until one is
        whole. A `Refusal` when its length is over `limit` (known as soon as the prefix is
        in) or it is flagged compressed (no compression is ever negotiated)."""
        if self.size < PREFIX_BYTES:
            return None
        parts = self.parts
        if len(parts[0]) < PREFIX_BYTES:  # a length prefix split over frames
            _merge_head(parts)
        head = parts[0]
        size = int.from_bytes(head[1:5], "big")
        if size > limit:
            return Refusal(RESOURCE_EXHAUSTED, f"message of {size} bytes over {limit}")
        end = PREFIX_BYTES + size
        if self.size < end:
            self.need = end
            return None
        if head[0]:
            return Refusal(INTERNAL, "compressed message but no grpc-encoding")
        joined = len(parts) > 1
        if joined:
            whole = memoryview(b"".join(parts))
        elif type(head) is memoryview:  # a view of a read: copied, as `settle` says why
            whole = memoryview(head.tobytes())
        else:
            whole = memoryview(head)
        parts.clear()
        self.size -= end
        self.need = PREFIX_BYTES
        if self.size:
            # The next message's start. After a join it is copied (at most the last piece),
            # so that a few bytes never keep a whole large message alive.
            rest = whole[end:]
            parts.append(rest.tobytes() if joined else rest)
        return whole[PREFIX_BYTES:end]

    def settle(self) -> None:
        """Copy the pieces that are views of a read (the `frames` engine hands DATA on so).

        Called once the read is handled: pieces of a message whole within the read were
        joined straight from the read's bytes (one copy), and the pieces of one still arriving
        are copied here, so that a few bytes held never keep a whole read (up to 256 KiB)
        alive beyond what the byte account counts.
        """
        parts = self.parts
        for i, part in enumerate(parts):
            if type(part) is memoryview:
                parts[i] = part.tobytes()

    def drop_partial(self) -> int:
        """Let go of what has arrived of messages not yet whole; how many bytes that was."""
        dropped = self.size
        self.parts.clear()
        self.size = 0
        self.need = PREFIX_BYTES
        return dropped


def _merge_head(parts: list[Piece]) -> None:
    """Join the first pieces of `parts` into one of at least 5 bytes (or all of them)."""
    count, size = 0, 0
    while size < PREFIX_BYTES and count < len(parts):
        size += len(parts[count])
        count += 1
    parts[:count] = [b"".join(parts[:count])]


def frame(payload: bytes) -> bytes:
    """One uncompressed gRPC message."""
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


def percent_encoded(text: str) -> bytes:
    """grpc-message's encoding: printable ASCII as is, everything else as %XX of its UTF-8."""
    return b"".join(
        bytes([b]) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b
        for b in text.encode("utf-8")
    )
