"""Which events of a stream carry content, and how much output a stream has made: sans-IO.

A stream starts at its first content event, not at its headers (design, third round): until
then the headers and the events that only open the answer are held back, so that a stream
that never says anything fails over like an attempt with no answer. Both fronts feed every
piece of a stream's body, cut anywhere, to one `ContentWatch`; it parses SSE `data:` lines
and says when the first content event passed and how many output tokens have passed so far.

Content events, per wire (the official SDKs' event types). Only the events that open an answer
are held back: an event this reader does not know (a newer event type, data that is not the
wire's JSON) counts as content, so that a stream of a newer API is never taken for a silent
one.

- Anthropic Messages: `content_block_delta` of any delta type but `signature_delta`, which
  only seals a thinking block (`text_delta`, `thinking_delta`, `input_json_delta`,
  `citations_delta`, and types to come), and `content_block_start` of a block
  that is itself output: a `tool_use`/`server_tool_use` block (the tool's name is the model's
  decision), or a text or thinking block that starts with text. `message_start`, `ping`,
  a `content_block_start` of an empty text block, `content_block_stop`, `message_delta`,
  `message_stop` and `error` are not.
- OpenAI Chat Completions: a chunk with a choice whose `delta` has non-empty `content`,
  `refusal`, `reasoning_content` or `reasoning` (the reasoning fields of compatible servers),
  or any `tool_calls`. The role-only first chunk, a usage-only chunk and `[DONE]` are not.
- OpenAI Responses: every event whose type ends in `.delta` (`response.output_text.delta`,
  `response.refusal.delta`, `response.function_call_arguments.delta`,
  `response.reasoning_text.delta`, `response.reasoning_summary_text.delta`, ...), and
  `response.output_item.added` of a function or custom tool call. `response.created`,
  `response.in_progress`, an added message item, `response.content_part.added` and the
  `.done`/`response.completed` events are not.

Output, for the throughput floor: the stream's own count where it reports one mid-stream
(Anthropic `message_delta`'s `usage.output_tokens`, a Chat chunk's or a Responses event's
`usage`), else an estimate of one token per `BYTES_PER_TOKEN` bytes of content (the text,
thinking or tool-argument fragments themselves, as their JSON spells them).
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..wire import Wire

__all__ = ["BYTES_PER_TOKEN", "ContentWatch", "watch_for"]

BYTES_PER_TOKEN = 4
"""Content bytes per output token, when a stream does not count its tokens: the usual
rule of thumb for English text with the GPT and Claude tokenizers (code and other scripts
run fewer bytes a token, so the estimate errs towards a slower rate)."""

_DATA = b"data:"
_NOT_CONTENT_DELTAS = frozenset({"signature_delta"})
_ANTHROPIC_OUTPUT_BLOCKS = frozenset({"tool_use", "server_tool_use"})
_CHAT_TEXT = ("content", "refusal", "reasoning_content", "reasoning")
_RESPONSES_CALL_ITEMS = frozenset({"function_call", "custom_tool_call"})
_decode = msgspec.json.Decoder().decode


class ContentWatch:
    """Reads one stream's events as they pass: `feed` each piece of the body, in order.

    `started`: the first content event has passed; `output_tokens`: output so far (counted
    where the stream reports it, else estimated from content bytes).
    """

    __slots__ = ("_counted", "_edge", "_estimate", "_reader", "started")

    def __init__(self, wire: Wire) -> None:
        self._reader = _READERS[wire]
        self._edge = b""  # the stream's bytes after its last newline (a line cut in two)
        self.started = False
        self._estimate = 0  # content bytes seen
        self._counted: int | None = None  # output tokens the stream itself reported

    @property
    def output_tokens(self) -> float:
        if self._counted is not None:
            return float(self._counted)
        return self._estimate / BYTES_PER_TOKEN

    def feed(self, piece: bytes) -> bool:
        """Read `piece`; whether a content event ended in it (the first or a later one)."""
        data = self._edge + piece if self._edge else piece
        end = data.rfind(b"\n")
        if end < 0:
            self._edge = data
            return False
        self._edge = data[end + 1 :]
        content = False
        for line in data[:end].split(b"\n"):
            if line.startswith(_DATA) and self._line(line[5:].strip()):
                content = True
        if content:
            self.started = True
        return content

    def _line(self, payload: bytes) -> bool:
        if payload == b"[DONE]" or not payload:
            return False
        event = None
        if payload.startswith(b"{"):
            try:
                event = _decode(payload)
            except msgspec.DecodeError:
                event = None
        if not isinstance(event, dict):
            # Not an event of the wire: nothing this reader knows to hold back.
            self._estimate += len(payload)
            return True
        size, counted = self._reader(event)
        if counted is not None:
            self._counted = counted
        if size < 0:
            return False
        self._estimate += size
        return True


def watch_for(wire: Wire | None) -> ContentWatch | None:
    """A `ContentWatch` for a stream of `wire`; None where no wire says what content is."""
    return None if wire is None or wire not in _READERS else ContentWatch(wire)


Read = tuple[int, int | None]
"""What an event says: its content bytes (-1: not a content event) and the output tokens the
stream reported in it (None: none)."""
_NOTHING: Read = (-1, None)
_UNKNOWN: Read = (0, None)
"""An event this reader does not know: content (holding back what it cannot read could take
a healthy stream of a newer API for a silent one), with no bytes to its estimate."""
_ANTHROPIC_OPENING = frozenset(
    {"message_start", "ping", "content_block_stop", "message_stop", "error"}
)
_RESPONSES_NOT_CONTENT = (
    ".created",
    ".in_progress",
    ".queued",
    ".added",
    ".done",
    ".completed",
    ".failed",
    ".incomplete",
)


def _anthropic(event: dict[str, Any]) -> Read:
    kind = event.get("type")
    if kind == "content_block_delta":
        delta = event.get("delta")
        if isinstance(delta, dict) and delta.get("type") not in _NOT_CONTENT_DELTAS:
            return _size(delta), None
        return _NOTHING
    if kind == "content_block_start":
        block = event.get("content_block")
        if not isinstance(block, dict):
            return _NOTHING
        if block.get("type") in _ANTHROPIC_OUTPUT_BLOCKS:
            return len(str(block.get("name", ""))), None
        text = block.get("text") or block.get("thinking")
        return (len(text), None) if isinstance(text, str) and text else _NOTHING
    if kind == "message_delta":
        return -1, _tokens(event.get("usage"), "output_tokens")
    return _NOTHING if kind in _ANTHROPIC_OPENING else _UNKNOWN


def _chat(event: dict[str, Any]) -> Read:
    counted = _tokens(event.get("usage"), "completion_tokens")
    choices = event.get("choices")
    if choices is None:
        # A usage-only chunk or an error says nothing; anything else is not known here.
        known = "usage" in event or "error" in event
        return (-1, counted) if known else _UNKNOWN
    size = -1
    for choice in choices if isinstance(choices, list) else ():
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict):
            continue
        for name in _CHAT_TEXT:
            text = delta.get(name)
            if isinstance(text, str) and text:
                size = max(size, 0) + len(text)
        calls = delta.get("tool_calls")
        if isinstance(calls, list) and calls:
            size = max(size, 0) + len(msgspec.json.encode(calls))
    return size, counted


def _responses(event: dict[str, Any]) -> Read:
    kind = event.get("type")
    if not isinstance(kind, str):
        return _UNKNOWN
    if kind.endswith(".delta"):
        return _size(event), None
    if kind == "response.output_item.added":
        item = event.get("item")
        if isinstance(item, dict) and item.get("type") in _RESPONSES_CALL_ITEMS:
            return len(str(item.get("name", ""))), None
        return _NOTHING
    if kind == "error" or kind.endswith(_RESPONSES_NOT_CONTENT):
        response = event.get("response")
        usage = response.get("usage") if isinstance(response, dict) else None
        return -1, _tokens(usage, "output_tokens")
    return _UNKNOWN


def _size(delta: dict[str, Any]) -> int:
    """The bytes of a delta's fragment: its text, thinking or partial JSON."""
    for name in ("text", "thinking", "partial_json", "delta"):
        fragment = delta.get(name)
        if isinstance(fragment, str):
            return len(fragment)
    return len(msgspec.json.encode(delta.get("citation", "")))


def _tokens(usage: object, name: str) -> int | None:
    if not isinstance(usage, dict):
        return None
    count = usage.get(name)
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else None


_READERS = {Wire.ANTHROPIC: _anthropic, Wire.OPENAI_CHAT: _chat, Wire.OPENAI_RESPONSES: _responses}
