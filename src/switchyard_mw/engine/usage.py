"""Token usage read from an LLM answer's bytes, for both fronts: bytes in, token counts out.

A JSON answer carries `usage` at its top level. A stream says it in its own events: Anthropic
gives input in `message_start` and output in the last `message_delta`; OpenAI Chat in its last
chunk (when the caller asked with `stream_options.include_usage`); OpenAI Responses in
`response.completed`. Counts come out in the GenAI conventions' terms: input tokens include
cached ones.

Sans-IO and incremental: a stream is fed in pieces however they were cut (an event split across
pieces is joined), and memory stays bounded whatever a peer sends. Of the event being read only
its last `WINDOW` bytes are kept: an event longer than that (a `response.completed` repeats the
whole answer) is read from that tail, where its `usage` sits. A body that is not what it should
be gives no usage, never an error.
"""

from __future__ import annotations

import collections
import re
from typing import Any, NamedTuple

import msgspec

from ..context import RequestContext
from ..wire import Wire

WINDOW = 64 << 10
"""Bytes kept of the event (or JSON answer) being read."""


class Tokens(NamedTuple):
    """What an answer used; None where it did not say. `cache_read` and `cache_write` are
    the part of `input` read from and written to the provider's prompt cache."""

    input: int | None
    output: int | None
    cache_read: int | None = None
    cache_write: int | None = None


class _Details(msgspec.Struct):
    cached_tokens: int | None = None  # OpenAI: input tokens read from the prompt cache


class Usage(msgspec.Struct):
    input_tokens: int | None = None  # Anthropic Messages, OpenAI Responses
    output_tokens: int | None = None
    cache_read_input_tokens: int | None = None  # Anthropic counts cached input apart
    cache_creation_input_tokens: int | None = None
    prompt_tokens: int | None = None  # OpenAI Chat Completions
    completion_tokens: int | None = None
    prompt_tokens_details: _Details | None = None  # OpenAI Chat Completions
    input_tokens_details: _Details | None = None  # OpenAI Responses


class _Answer(msgspec.Struct):
    usage: Usage | None = None


class _Event(msgspec.Struct):
    usage: Usage | None = None  # Anthropic `message_delta`, OpenAI Chat's last chunk
    message: _Answer | None = None  # Anthropic `message_start`
    response: _Answer | None = None  # OpenAI Responses `response.completed`


_ANSWER = msgspec.json.Decoder(_Answer)  # skips every other field unread
_EVENT = msgspec.json.Decoder(_Event)
_USAGE = msgspec.json.Decoder(Usage)
_FIELDS = tuple(Usage.__struct_fields__)
_USAGE_KEY = re.compile(rb'"usage"\s*:\s*\{')
_OBJECT_BYTES = re.compile(rb'[{}"\\]')
_OPEN, _CLOSE, _QUOTE, _BACKSLASH = b'{}"\\'


def tokens_of(wire: Wire | None, usage: Usage) -> Tokens:
    if wire is Wire.OPENAI_CHAT or usage.input_tokens is None:
        details = usage.prompt_tokens_details
        cached = None if details is None else details.cached_tokens
        return Tokens(usage.prompt_tokens, usage.completion_tokens, cached)
    inputs = usage.input_tokens
    if wire is Wire.ANTHROPIC:
        read, written = usage.cache_read_input_tokens, usage.cache_creation_input_tokens
        inputs += (read or 0) + (written or 0)
        return Tokens(inputs, usage.output_tokens, read, written)
    details = usage.input_tokens_details
    cached = None if details is None else details.cached_tokens
    return Tokens(inputs, usage.output_tokens, cached)


def answer_tokens(wire: Wire | None, body: bytes) -> Tokens | None:
    """The usage of a whole JSON answer; None when it has none (or is not such an answer)."""
    try:
        usage = _ANSWER.decode(body).usage
    except msgspec.DecodeError:
        return None  # not a shape we know: report nothing rather than something wrong
    return None if usage is None else tokens_of(wire, usage)


def tail_usage(tail: bytes) -> Usage | None:
    """The last `"usage": {...}` object whole in `tail` (the end of a text too long to keep).

    Inside a JSON string every quote is escaped, so `"usage":` followed by `{` is a key; the
    last one is the answer's own (it comes after the content that might hold another).
    """
    found = collections.deque(_USAGE_KEY.finditer(tail), maxlen=1)
    if not found:
        return None
    start = found[0].end() - 1
    end = _object_end(tail, start)
    if end is None:
        return None
    try:
        return _USAGE.decode(tail[start:end])
    except msgspec.DecodeError:
        return None


def _object_end(data: bytes, start: int) -> int | None:
    """The end of the JSON object opening at `data[start]`, or None if it does not close."""
    depth, in_string, skip_to = 0, False, 0
    for mark in _OBJECT_BYTES.finditer(data, start):
        at = mark.start()
        if at < skip_to:
            continue  # the byte a backslash escapes
        char = data[at]
        if in_string:
            if char == _BACKSLASH:
                skip_to = at + 2
            elif char == _QUOTE:
                in_string = False
        elif char == _QUOTE:
            in_string = True
        elif char == _OPEN:
            depth += 1
        elif char == _CLOSE:
            depth -= 1
            if depth == 0:
                return at + 1
    return None


class _Seen:
    """Usage fields seen so far; later events carry the running totals."""

    __slots__ = ("fields", "wire")

    def __init__(self, wire: Wire | None) -> None:
        self.wire = wire
        self.fields: dict[str, Any] = {}  # ints, and the OpenAI details objects

    def add(self, usage: Usage | None) -> None:
        if usage is None:
            return
        for name in _FIELDS:
            value = getattr(usage, name)
            if value is not None:
                self.fields[name] = value

    def tokens(self) -> Tokens | None:
        return tokens_of(self.wire, Usage(**self.fields)) if self.fields else None


class StreamUsage:
    """The usage an event stream reports along the way, fed in pieces as they pass.

    Only lines naming `"usage"` are decoded; nearly every piece costs one search.
    """

    __slots__ = ("_cut", "_line", "_seen")

    def __init__(self, wire: Wire | None) -> None:
        self._seen = _Seen(wire)
        self._line = b""
        """The line begun and not yet ended (its last `WINDOW` bytes)."""
        self._cut = False
        """Whether `_line` lost its beginning to the window."""

    @property
    def held(self) -> int:
        """Bytes kept between pieces (at most `WINDOW`)."""
        return len(self._line)

    def feed(self, piece: bytes) -> None:
        data = self._line + piece if self._line else piece
        end = data.rfind(b"\n")
        if end < 0:
            self._hold(data, self._cut)
            return
        first_cut = self._cut
        whole = data if end == len(data) - 1 else data[:end]
        self._hold(data[end + 1 :], False)
        if b'"usage"' in whole:
            self._lines(whole, first_cut)

    def end(self) -> Tokens | None:
        """The usage seen, once the stream ended (a last line without a newline counts)."""
        if self._line and b'"usage"' in self._line:
            self._lines(self._line, self._cut)
        self._hold(b"", False)
        return self._seen.tokens()

    def _hold(self, data: bytes, cut: bool) -> None:
        if len(data) > WINDOW:
            data, cut = data[-WINDOW:], True
        self._line, self._cut = data, cut

    def _lines(self, whole: bytes, first_cut: bool) -> None:
        for i, line in enumerate(whole.split(b"\n")):
            if b'"usage"' not in line:
                continue
            if i == 0 and first_cut:
                self._seen.add(tail_usage(line))
                continue
            line = line.strip()
            if line.startswith(b"data:"):
                self._event(line[5:])

    def _event(self, data: bytes) -> None:
        try:
            event = _EVENT.decode(data)
        except msgspec.DecodeError:
            return
        self._seen.add(event.usage)
        for holder in (event.message, event.response):
            if holder is not None:
                self._seen.add(holder.usage)


class AnswerUsage:
    """The usage of a JSON answer fed in pieces; of a long one only the last `WINDOW` bytes
    are kept, and its `usage` is read there."""

    __slots__ = ("_cut", "_held", "wire")

    def __init__(self, wire: Wire | None) -> None:
        self.wire = wire
        self._held = b""
        self._cut = False

    @property
    def held(self) -> int:
        return len(self._held)

    def feed(self, piece: bytes) -> None:
        data = self._held + piece if self._held else piece
        if len(data) > WINDOW:
            data, self._cut = data[-WINDOW:], True
        self._held = data

    def end(self) -> Tokens | None:
        held, self._held = self._held, b""
        if not self._cut:
            return answer_tokens(self.wire, held)
        usage = tail_usage(held)
        return None if usage is None else tokens_of(self.wire, usage)


def report_tokens(ctx: RequestContext, tokens: Tokens | None) -> None:
    """Report an answer's token usage, if it said any, to the request's span and metrics."""
    if tokens is not None:
        ctx.report_usage(
            input_tokens=tokens.input,
            output_tokens=tokens.output,
            cache_read_tokens=tokens.cache_read,
            cache_write_tokens=tokens.cache_write,
        )
