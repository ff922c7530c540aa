"""Resumed Anthropic Messages streams, sans-IO: the continuation request and the splice.

A started stream broke after the client received ``message_start`` and some content. The front
asks ``continuation_request`` for the request to send to another account: the conversation
plus the partial assistant text as a trailing assistant message (a prefill), or a named
``ResumeRefusal`` where a prefill cannot carry the answer on (signed thinking, a tool call).
It then feeds each event of the continuation stream (parsed SSE ``data`` objects) to an
``AnthropicSplice`` and writes what comes back, so that the client sees one stream:

- the continuation's ``message_start`` is swallowed (the client has one);
- content-block indices continue after the last index the client saw;
- where the cut fell inside a text block, that block stays open and the continuation's first
  text block is merged into it (its start and its own index vanish);
- the final ``message_delta`` carries the usage of both parts summed (both attempts were
  billed: input tokens of each request, output tokens of each answer);
- one ``message_stop``, the continuation's.

The API refuses a final assistant message ending in whitespace, so the prefill drops trailing
whitespace; the model then usually begins with the whitespace the client already has, so the
merged block drops the continuation's leading whitespace in that case. Resumed answers may
still read unevenly at the seam (a repeated or re-worded word): the model sees the text, not
the tokens, that came before.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping
from typing import Any

from .resume_refusal import ResumeRefusal as ResumeRefusal

Event = dict[str, Any]


class Cut(enum.Enum):
    """Where the client's stream stopped."""

    BETWEEN_BLOCKS = "between_blocks"
    IN_TEXT = "in_text"
    IN_OTHER_BLOCK = "in_other_block"  # thinking or tool_use: refused before any splice


class _Sent:
    """What the client has seen: read once from its events."""

    def __init__(self, events: Iterable[Mapping[str, Any]]) -> None:
        self.started = False
        self.usage: dict[str, int] = {}
        self.texts: list[str] = []  # one per text block, in order
        self.kinds: set[str] = set()
        self.open_index: int | None = None
        self.open_kind = ""
        self.next_index = 0
        for event in events:
            self._take(event)

    def _take(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        if kind == "message_start":
            self.started = True
            self.usage = _ints(event.get("message", {}).get("usage", {}))
        elif kind == "content_block_start":
            block = event["content_block"]
            self.open_index, self.open_kind = event["index"], block["type"]
            self.next_index = max(self.next_index, event["index"] + 1)
            self.kinds.add(block["type"])
            if block["type"] == "text":
                self.texts.append(block.get("text", ""))
        elif kind == "content_block_delta":
            delta = event["delta"]
            if delta.get("type") == "text_delta" and self.texts:
                self.texts[-1] += delta["text"]
        elif kind == "content_block_stop":
            self.open_index, self.open_kind = None, ""
        elif kind == "message_delta":
            self.usage.update(_ints(event.get("usage", {})))

    @property
    def cut(self) -> Cut:
        if self.open_index is None:
            return Cut.BETWEEN_BLOCKS
        return Cut.IN_TEXT if self.open_kind == "text" else Cut.IN_OTHER_BLOCK


def _ints(usage: Mapping[str, Any]) -> dict[str, int]:
    return {k: v for k, v in usage.items() if isinstance(v, int) and not isinstance(v, bool)}


def refusal(sent: Iterable[Mapping[str, Any]]) -> ResumeRefusal | None:
    """Why these client-side events cannot be continued with a prefill, or None."""
    return _refusal(_Sent(sent))


def _refusal(seen: _Sent) -> ResumeRefusal | None:
    if not seen.started:
        return ResumeRefusal.NOT_STARTED
    if seen.kinds & {"thinking", "redacted_thinking"}:
        return ResumeRefusal.SIGNED_THINKING
    if seen.kinds & {"tool_use", "server_tool_use"}:
        return ResumeRefusal.TOOL_USE
    return None


def continuation_request(
    request: Mapping[str, Any], sent: Iterable[Mapping[str, Any]]
) -> dict[str, Any] | ResumeRefusal:
    """The request that continues the answer the client has part of, or why there is none."""
    seen = _Sent(sent)
    why = _refusal(seen)
    if why is not None:
        return why
    blocks = [{"type": "text", "text": text} for text in seen.texts]
    if blocks:
        blocks[-1]["text"] = blocks[-1]["text"].rstrip()
    blocks = [block for block in blocks if block["text"]]
    messages = list(request.get("messages", []))
    if not blocks:
        return {**request, "messages": messages}
    if messages and messages[-1].get("role") == "assistant":
        # The client prefilled already: the answer continues its prefill.
        messages[-1] = {**messages[-1], "content": _content(messages[-1]) + blocks}
    else:
        messages.append({"role": "assistant", "content": blocks})
    return {**request, "messages": messages}


def _content(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    content = message.get("content", [])
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    return list(content)


class AnthropicSplice:
    """Turns a continuation's events into the events that carry the client's stream on."""

    def __init__(self, sent: Iterable[Mapping[str, Any]]) -> None:
        seen = _Sent(sent)
        why = _refusal(seen)
        if why is not None:
            raise ValueError(f"cannot splice: {why.value}")
        self._first_usage = seen.usage
        self._next_index = seen.next_index
        self._open_text = seen.open_index if seen.cut is Cut.IN_TEXT else None
        # Leading whitespace is dropped only while the merged block has had nothing yet.
        self._trim = bool(seen.texts) and seen.texts[-1] != seen.texts[-1].rstrip()
        self._second_input: dict[str, int] = {}
        self._indices: dict[int, int] = {}

    def feed(self, event: Mapping[str, Any]) -> list[Event]:
        kind = event.get("type")
        if kind == "message_start":
            self._second_input = _ints(event.get("message", {}).get("usage", {}))
            return []
        if kind == "content_block_start":
            return self._block_start(event)
        if kind == "content_block_delta":
            return self._delta(event)
        if kind == "content_block_stop":
            return [{**event, "index": self._indices.get(event["index"], event["index"])}]
        if kind == "message_delta":
            return [
                *self._close_open(),
                {**event, "usage": self._summed(_ints(event.get("usage", {})))},
            ]
        return [dict(event)]

    def _close_open(self) -> list[Event]:
        """A continuation that ends with no block of its own still closes the block left open."""
        if self._open_text is None:
            return []
        index, self._open_text = self._open_text, None
        return [{"type": "content_block_stop", "index": index}]

    def _block_start(self, event: Mapping[str, Any]) -> list[Event]:
        block = event["content_block"]
        out: list[Event] = []
        if self._open_text is not None:
            merged, self._open_text = self._open_text, None
            if block["type"] == "text":
                self._indices[event["index"]] = merged
                text = self._trimmed(block.get("text", ""))
                if text:
                    out.append(_text_delta(merged, text))
                return out
            out.append({"type": "content_block_stop", "index": merged})
        self._indices[event["index"]] = self._next_index
        out.append({**event, "index": self._next_index})
        self._next_index += 1
        return out

    def _delta(self, event: Mapping[str, Any]) -> list[Event]:
        index = self._indices.get(event["index"], event["index"])
        delta = event["delta"]
        if delta.get("type") == "text_delta" and self._trim:
            text = self._trimmed(delta["text"])
            if not text:
                return []
            delta = {**delta, "text": text}
        return [{**event, "index": index, "delta": delta}]

    def _trimmed(self, text: str) -> str:
        if not self._trim:
            return text
        text = text.lstrip()
        self._trim = not text
        return text

    def _summed(self, second: dict[str, int]) -> dict[str, int]:
        both = {**self._second_input, **second}
        keys = set(self._first_usage) | set(both)
        return {k: self._first_usage.get(k, 0) + both.get(k, 0) for k in sorted(keys)}


def _text_delta(index: int, text: str) -> Event:
    return {
        "type": "content_block_delta",
        "index": index,
        "delta": {"type": "text_delta", "text": text},
    }


def encode(event: Mapping[str, Any]) -> bytes:
    """One event as the SSE frame Anthropic writes: ``event: <type>`` then its ``data``."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()
