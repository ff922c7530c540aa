"""A resumable stream's bookkeeping, sans-IO: what the client has read, whether and where it
broke, and the continuation's request and splice for its wire (`resume_streams`).

Both wires that take a prefill are read here, one SSE frame at a time: Anthropic Messages and
OpenAI Chat Completions (`resume_anthropic`, `resume_chat` build the continuation and splice
it). A `Transcript` is fed the stream's whole frames as they go to the client; it keeps the
parsed events (the continuation needs all of them), counts the bytes the client got, and says
where an error frame begins: the point where the stream broke.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from ..wire import Wire
from . import resume_anthropic, resume_chat
from .resume_refusal import ResumeRefusal

if TYPE_CHECKING:
    from ..accounts import Account
    from ..config import LLMClient, Server

__all__ = [
    "RESUMABLE_WIRES",
    "Splice",
    "Transcript",
    "accepts_prefill",
    "continuation",
    "enabled",
    "frames_end",
    "prefill_accounts",
    "refusal",
    "splice_for",
]

RESUMABLE_WIRES = frozenset({Wire.ANTHROPIC, Wire.OPENAI_CHAT})
"""The wires whose requests take a trailing assistant message as the start of the answer."""

_FRAME_END = re.compile(rb"\r?\n\r?\n")
_DONE = b"[DONE]"
_ERROR = b"error"
_decode = msgspec.json.Decoder().decode


def enabled(spec: LLMClient, server: Server) -> bool:
    """Whether a stream that broke on the account of `spec` is to be continued."""
    own = spec.resume_streams
    return server.resume_streams if own is None else own


def accepts_prefill(spec: LLMClient, wire: Wire) -> bool:
    """Whether the account of `spec` may take a continuation on `wire`: said by the account,
    else yes on Anthropic Messages (the API's prefill), no on Chat."""
    if wire not in RESUMABLE_WIRES:
        return False
    own = spec.accepts_prefill
    return wire is Wire.ANTHROPIC if own is None else own


def prefill_accounts(
    accounts: Mapping[str, Account], model: str, wire: Wire, routable: Collection[str] | None
) -> frozenset[str]:
    """The accounts that serve `model` and may take its continuation on `wire`."""
    return frozenset(
        name
        for name, account in accounts.items()
        if (routable is None or name in routable)
        and account.spec.serves(model)
        and accepts_prefill(account.spec, wire)
    )


def frames_end(data: bytes) -> int:
    """The length of the prefix of `data` that holds only whole SSE frames."""
    end = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(end + 2 if end >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def _frames(data: bytes) -> Iterable[tuple[int, bytes]]:
    """Each whole frame of `data` (whole frames only) with its offset."""
    start = 0
    for found in _FRAME_END.finditer(data):
        yield start, data[start : found.start()]
        start = found.end()


def _payload(frame: bytes) -> Any:
    """The frame's `data` as JSON (`[DONE]` as itself; None: no data, or not JSON)."""
    lines = [line[5:].strip() for line in frame.splitlines() if line.startswith(b"data:")]
    if not lines:
        return None
    data = b"\n".join(lines)
    if data == _DONE:
        return _DONE
    try:
        return _decode(data)
    except msgspec.DecodeError:
        return None


def _is_error(wire: Wire, event: Any) -> bool:
    if not isinstance(event, dict):
        return False
    if wire is Wire.ANTHROPIC:
        return event.get("type") == "error"
    return "error" in event and "choices" not in event


def _is_content(wire: Wire, event: Any) -> bool:
    """A content event: text the client can show (or a tool call, which then refuses)."""
    if not isinstance(event, dict):
        return False
    if wire is Wire.ANTHROPIC:
        kind = event.get("type")
        if kind == "content_block_start":
            block = event.get("content_block")
            return isinstance(block, dict) and (
                block.get("type") != "text" or bool(block.get("text"))
            )
        delta = event.get("delta")
        return (
            kind == "content_block_delta"
            and isinstance(delta, dict)
            and delta.get("type") != "signature_delta"
        )
    for choice in event.get("choices") or ():
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls")):
            return True
    return False


def _is_said_done(wire: Wire, event: dict[str, Any]) -> bool:
    """The event says the answer is complete (its stop reason), its last event aside."""
    if wire is Wire.ANTHROPIC:
        return event.get("type") == "message_delta"
    return any(
        isinstance(choice, dict) and choice.get("finish_reason")
        for choice in event.get("choices") or ()
    )


def _is_end(wire: Wire, event: Any) -> bool:
    if wire is Wire.ANTHROPIC:
        return isinstance(event, dict) and event.get("type") == "message_stop"
    return bool(event == _DONE)


class Transcript:
    """The client's side of one stream: the bytes it got (`sent_bytes`), and, read from them
    only when asked (a break, the stream's end), its events (`events`), whether content reached
    it (`content`), whether its stop reason did (`said_done`: the answer is complete, nothing
    is left to continue) and whether its last event did (`ended`). `feed` takes whole frames
    only, and parses none unless they may hold an error: a healthy stream costs a search for
    the word `error` per piece and the list of its pieces."""

    __slots__ = ("_events", "_pieces", "sent_bytes", "wire")

    def __init__(self, wire: Wire) -> None:
        self.wire = wire
        self._pieces: list[bytes] = []
        self._events: list[dict[str, Any]] | None = []
        self.sent_bytes = 0

    def feed(self, data: bytes) -> int | None:
        """Take the whole frames `data`; the offset where an error frame begins (the frames
        before it taken, nothing after), or None."""
        if _ERROR in data:  # rare: only then are the frames read
            for offset, frame in _frames(data):
                if _is_error(self.wire, _payload(frame)):
                    self._take(data[:offset])
                    return offset
        self._take(data)
        return None

    def _take(self, data: bytes) -> None:
        if data:
            self._pieces.append(data)
            self.sent_bytes += len(data)
            self._events = None

    @property
    def events(self) -> list[dict[str, Any]]:
        events = self._events
        if events is None:
            data = b"".join(self._pieces)
            found = (_payload(frame) for _, frame in _frames(data))
            events = self._events = [event for event in found if isinstance(event, dict)]
        return events

    @property
    def content(self) -> bool:
        return any(_is_content(self.wire, event) for event in self.events)

    @property
    def said_done(self) -> bool:
        return any(_is_said_done(self.wire, event) for event in self.events)

    @property
    def ended(self) -> bool:
        """Whether the stream's last event reached the client: its last frame is read."""
        last = self._pieces[-1].rstrip(b"\r\n") if self._pieces else b""
        cut = frames_end(last)
        return _is_end(self.wire, _payload(last[cut:]))


def refusal(wire: Wire, events: Iterable[Mapping[str, Any]]) -> ResumeRefusal | None:
    """Why the stream whose client-side events are `events` cannot be continued, or None."""
    found = continuation(wire, {}, events)
    return found if isinstance(found, ResumeRefusal) else None


def continuation(
    wire: Wire, request: Mapping[str, Any], events: Iterable[Mapping[str, Any]]
) -> dict[str, Any] | ResumeRefusal:
    """The request that continues the answer: `request` plus the partial answer as a prefill."""
    if wire is Wire.ANTHROPIC:
        return resume_anthropic.continuation_request(request, events)
    return resume_chat.continuation_request(request, events)


class Splice(Protocol):
    """Turns each event of the continuation into the bytes that carry the client's stream on."""

    def feed(self, event: Any) -> bytes: ...


class _AnthropicSplice:
    __slots__ = ("_splice",)

    def __init__(self, events: Iterable[Mapping[str, Any]]) -> None:
        self._splice = resume_anthropic.AnthropicSplice(events)

    def feed(self, event: Any) -> bytes:
        if not isinstance(event, dict):
            return b""
        return b"".join(resume_anthropic.encode(out) for out in self._splice.feed(event))


class _ChatSplice:
    __slots__ = ("_splice",)

    def __init__(self, events: Iterable[Mapping[str, Any]]) -> None:
        self._splice = resume_chat.ChatSplice(events)

    def feed(self, event: Any) -> bytes:
        if event == _DONE:
            return resume_chat.DONE
        if not isinstance(event, dict):
            return b""
        return resume_chat.encode(self._splice.feed(event))


def splice_for(wire: Wire, events: Iterable[Mapping[str, Any]]) -> Splice:
    """The splice of a continuation into the stream whose client-side events are `events`."""
    if wire is Wire.ANTHROPIC:
        return _AnthropicSplice(events)
    return _ChatSplice(events)


class SpliceReader:
    """Reads the continuation's stream as it comes (pieces cut anywhere) and gives the bytes
    that go to the client; `ended`: its last event passed, `failed`: it carried an error."""

    __slots__ = ("_rest", "_splice", "ended", "failed", "wire")

    def __init__(self, wire: Wire, splice: Splice) -> None:
        self.wire = wire
        self._splice = splice
        self._rest = b""
        self.ended = False
        self.failed = False

    def feed(self, piece: bytes) -> bytes:
        data = self._rest + piece if self._rest else piece
        end = frames_end(data)
        self._rest = data[end:]
        out: list[bytes] = []
        for _, frame in _frames(data[:end]):
            event = _payload(frame)
            if self.failed or _is_error(self.wire, event):
                self.failed = True
                break
            if event is None:
                continue
            out.append(self._splice.feed(event))
            self.ended = self.ended or _is_end(self.wire, event)
        return b"".join(out)
