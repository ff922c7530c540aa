"""Bedrock's streamed answer (InvokeModelWithResponseStream) as the Anthropic API's SSE events.

Bedrock wraps each Anthropic event in a binary event-stream message (`core.eventstream`):
`:message-type` `event`, `:event-type` `chunk`, payload `{"bytes": base64(event JSON), "p":
padding}`. The event inside is the API's own (`message_start`, `content_block_delta`, ...,
`message_delta` with the usage, `message_stop`), so each becomes `event: TYPE` / `data: JSON`
unchanged, except `message_stop`: Bedrock adds `amazon-bedrock-invocationMetrics` to it (token
counts and latencies, the same counts `message_start` and `message_delta` already carry, which
is where the usage reader looks), and the client gets the API's bare `message_stop`, so it
cannot tell which provider answered.

An error after the stream started arrives as a message of type `exception` (its
`:exception-type` names it, its payload carries the message): the client's stream ends with
the Anthropic `error` event of that kind, and `failure` says the status it stands for, for the
cooling policy. Bytes that are not an event stream, or a stream cut inside a message, raise
`errors.RemoteProtocolError`, as a broken upstream does.
"""

from __future__ import annotations

import base64
import binascii
import enum

import msgspec

from .. import errors
from ..core.eventstream import MAX_FRAME_BYTES, Decoder, FramingError, Message
from .bedrock_errors import mapped

SSE_TYPE = b"text/event-stream; charset=utf-8"
EVENTSTREAM_TYPE = "application/vnd.amazon.eventstream"
METRICS_KEY = "amazon-bedrock-invocationMetrics"


class _Chunk(msgspec.Struct):
    bytes: str


class _Typed(msgspec.Struct):
    type: str


class _Failure(msgspec.Struct):
    message: str | None = None


_CHUNK = msgspec.json.Decoder(_Chunk)
_TYPED = msgspec.json.Decoder(_Typed)
_FAILURE = msgspec.json.Decoder(_Failure)
_MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


class State(enum.Enum):
    STREAMING = "streaming"
    FAILED = "failed"
    """The stream carried an exception: its error event was given, nothing after it is."""


class BedrockStream:
    """One Bedrock stream being turned into Anthropic SSE: `feed` the bytes as they come."""

    content_type = SSE_TYPE

    __slots__ = ("_decoder", "failure", "state")

    def __init__(self, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._decoder = Decoder(max_frame_bytes=max_frame_bytes)
        self.state = State.STREAMING
        self.failure: int | None = None
        """The status the stream's exception stands for (429 a throttle, 5xx a fault)."""

    def feed(self, chunk: bytes) -> bytes:
        """The SSE events of the messages `chunk` completes (b"" while a message is cut)."""
        if self.state is State.FAILED:
            return b""
        try:
            messages = self._decoder.feed(chunk)
        except FramingError as exc:
            raise errors.RemoteProtocolError(f"Bedrock stream: {exc}") from None
        out = []
        for message in messages:
            out.append(self._event(message))
            if self.failure is not None:
                break  # nothing after the stream's error reaches the client
        return b"".join(out)

    def end(self) -> bytes:
        """Nothing more to say; raises if the stream stopped inside a message."""
        if self.state is State.STREAMING and self._decoder.pending:
            raise errors.RemoteProtocolError(
                f"Bedrock stream ended inside a message ({self._decoder.pending} bytes held)"
            )
        return b""

    def _event(self, message: Message) -> bytes:
        kind = message.headers.get(":message-type")
        if kind == "event":
            return _chunk(message) if message.headers.get(":event-type") == "chunk" else b""
        if kind == "exception":
            named = message.headers.get(":exception-type")
            return self._fail(named if isinstance(named, str) else None, message.payload)
        if kind == "error":  # the protocol's own error: a code and a message in headers
            text = message.headers.get(":error-message")
            return self._fail(None, b"", text if isinstance(text, str) else None)
        return b""

    def _fail(self, exception: str | None, payload: bytes, text: str | None = None) -> bytes:
        self.state = State.FAILED
        error = mapped(exception, 502)
        self.failure = error.status
        if text is None:
            try:
                text = _FAILURE.decode(payload).message
            except msgspec.DecodeError:
                text = None
        message = f"Bedrock: {exception or 'stream error'}: {text or 'no message'}"
        data = msgspec.json.encode(
            {"type": "error", "error": {"type": error.error_type, "message": message}}
        )
        return b"event: error\ndata: " + data + b"\n\n"


def _chunk(message: Message) -> bytes:
    """The Anthropic event inside a `chunk` message, as one SSE event."""
    try:
        event = base64.b64decode(_CHUNK.decode(message.payload).bytes, validate=True)
        kind = _TYPED.decode(event).type
    except (msgspec.DecodeError, binascii.Error):
        kind = ""
    if not kind.isascii() or not kind.isprintable():  # it becomes a line of its own
        raise errors.RemoteProtocolError("Bedrock stream: a chunk that is not an event")
    if kind == "message_stop" and METRICS_KEY.encode() in event:
        return _MESSAGE_STOP  # the API's own, without Bedrock's metrics
    if b"\n" in event:  # JSON may hold raw newlines between tokens: one data line each
        event = b"\ndata: ".join(event.splitlines())
    return b"event: " + kind.encode() + b"\ndata: " + event + b"\n\n"
