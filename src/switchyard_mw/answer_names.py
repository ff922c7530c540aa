"""The public model name written into an answer: bytes in, bytes out.

An account that knows a model by its own name (`models = {public = provider}`, a Bedrock or
Vertex id) answers with that name, or a dated version of it, in `model`: of a JSON answer (all
three wires), of Anthropic's `message_start`, of every Chat Completions chunk and of the
Responses API's `response.*` lifecycle events. The client asked for the public name (or was
routed to it), so that is what it gets back; the provider's name stays in telemetry
(`gen_ai.response.model` on the attempt's span).

The value is spliced into the answer's own bytes: nothing else is decoded, encoded or moved.
A stream is rewritten line by line as it passes, never held whole: a line waits for its end
only until its `model` value is whole (a `response.completed` line repeats the whole answer,
and its `model` comes before the output), and never past `HOLD_MAX` bytes. Inside a JSON
string every quote is escaped, so a quoted `"model"` followed by `:` is a key; only one at the
top of the object, or of the `message` / `response` object a stream event wraps, is the
answer's model. Once a stream's event named it, later pieces whose every `"model"` is that same
member, spelled byte for byte, are renamed by one `replace` (Chat Completions repeats it in
every chunk); a piece with any other `"model"` is read line by line. Anything that is not such
JSON passes unchanged.
"""

from __future__ import annotations

import re
from typing import Protocol

import msgspec

HOLD_MAX = 64 << 10
"""Bytes of one unfinished line (or of a JSON answer's opening) held while its `model` value
is incomplete; past that it goes on as it is."""

_KEY = b'"model"'
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[{}\[\]]|"', re.DOTALL)
"""A whole JSON string, a bracket, or a quote whose string does not end in the text: what
depth and keys are read from."""
_COLON = re.compile(rb"[ \t\r\n]*:[ \t\r\n]*")
_WRAPPER = re.compile(rb'"(?:message|response)"[ \t\r\n]*:[ \t\r\n]*\Z')
"""The key of the object a stream event wraps its answer in (Anthropic's `message_start`, the
Responses API's `response.*` events)."""
_DATA = b"data:"


class Namer(Protocol):
    """Renames an answer fed in pieces: `feed` gives what goes on now, `end` what was held."""

    @property
    def held(self) -> int: ...

    def feed(self, piece: bytes) -> bytes: ...

    def end(self) -> bytes: ...


def namer_for(public: str, content_type: bytes, encoding: bytes) -> Namer | None:
    """What renames an answer passing in pieces to `public`, given its headers; None: neither
    an event stream nor JSON, or compressed (an upstream that compresses anyway keeps its
    bytes: the fronts ask an account that renames for `identity`)."""
    if encoding.strip().lower() not in (b"", b"identity"):
        return None
    kind = content_type.lower()
    if kind.startswith(b"text/event-stream"):
        return StreamNamer(public)
    return AnswerNamer(public) if b"json" in kind else None


class Found:
    """The span of a `model` value in a text being read."""

    __slots__ = ("end", "start")

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end


INCOMPLETE = Found(-1, -1)
"""The text was cut before the answer's `model` value ended (or before it showed whether it
has one): more of it is needed."""


def find_model(data: bytes, start: int, end: int, *, wrapped: bool, whole: bool) -> Found | None:
    """The answer's `model` string value in the JSON object opening at or after `start` (up to
    `end`): at its top level, or (`wrapped`, a stream event) inside its `message` or
    `response` member. None: it has none, or is not JSON; `INCOMPLETE`: the text is cut
    (`whole` False) before that is known."""
    plain = _plain(data, start, end, wrapped=wrapped)
    if plain is not None:
        return plain
    cut = None if whole else INCOMPLETE
    depth, opened = 0, -1
    for token in _TOKEN.finditer(data, start, end):
        at, stop = token.span()
        first = data[at]
        if first == 0x7B or first == 0x5B:  # { [
            depth += 1
            if depth == 2 and first == 0x7B:
                opened = at
            continue
        if first != 0x22:  # } ]
            depth -= 1
            if depth <= 0:
                return None  # the object closed without it
            continue
        if stop - at == 1:
            return cut  # a string that does not end here
        if stop - at != len(_KEY) or data[at:stop] != _KEY:
            continue
        colon = _COLON.match(data, stop, end)
        if colon is None:
            if not whole and not data[stop:end].strip():
                return INCOMPLETE
            continue  # a value spelled "model", not a key
        if not _ours(data, depth, opened, wrapped=wrapped):
            continue
        value = _STRING.match(data, colon.end(), end)
        if value is not None:
            return Found(*value.span())
        if colon.end() < end and data[colon.end()] != 0x22:
            return None  # null, or not a name: nothing to replace
        return cut
    return cut


def _plain(data: bytes, start: int, end: int, *, wrapped: bool) -> Found | None:
    """The answer's `model` value in the shape providers send, proven by a few searches in C:
    before the first `"model"`, no backslash, no bracket but the object's `{` (and the
    wrapper's, right after its key), and whole strings only, so that key is a member of the
    object. None: another shape, read token by token."""
    at = data.find(_KEY, start, end)
    if at < 0:
        return None
    opens = data.count(b"{", start, at)
    if not 0 < opens <= (2 if wrapped else 1):
        return None
    for other in _NOT_BEFORE:
        if data.find(other, start, at) >= 0:
            return None
    if data.count(b'"', start, at) % 2:
        return None
    if opens == 2:
        inner = data.rfind(b"{", start, at)
        if _WRAPPER.search(data, max(start, inner - 32), inner) is None:
            return None
    colon = _COLON.match(data, at + len(_KEY), end)
    value = None if colon is None else _STRING.match(data, colon.end(), end)
    return None if value is None else Found(*value.span())


_NOT_BEFORE = (b"\\", b"[", b"]", b"}")


def _ours(data: bytes, depth: int, opened: int, *, wrapped: bool) -> bool:
    """Whether a key at `depth` names the answer's model (`opened`: where the object at depth
    2 opened)."""
    if depth == 1:
        return True
    if depth != 2 or not wrapped or opened < 0:
        return False
    return _WRAPPER.search(data, max(0, opened - 32), opened) is not None


def _splice(data: bytes, found: Found, name: bytes) -> bytes:
    if data[found.start : found.end] == name:
        return data
    return b"".join((data[: found.start], name, data[found.end :]))


def answer_with_model(body: bytes, public: str) -> bytes:
    """A whole JSON answer with its top-level `model` set to `public` (else unchanged)."""
    if _KEY not in body:
        return body
    found = find_model(body, 0, len(body), wrapped=False, whole=True)
    return body if found is None else _splice(body, found, msgspec.json.encode(public))


class AnswerNamer:
    """A JSON answer fed in pieces: its opening is held until its `model` value is whole (at
    most `HOLD_MAX` bytes), rewritten, and everything after passes as it comes."""

    __slots__ = ("_done", "_held", "_name", "_public")

    def __init__(self, public: str) -> None:
        self._public = public
        self._name = msgspec.json.encode(public)
        self._held = b""
        self._done = False

    @property
    def held(self) -> int:
        return len(self._held)

    def feed(self, piece: bytes) -> bytes:
        if self._done:
            return piece
        data = self._held + piece if self._held else piece
        found = find_model(data, 0, len(data), wrapped=False, whole=False)
        if found is INCOMPLETE and len(data) <= HOLD_MAX:
            self._held = data
            return b""
        self._held, self._done = b"", True
        if found is None or found is INCOMPLETE:
            return data
        return _splice(data, found, self._name)

    def end(self) -> bytes:
        """What is held, once the answer ended (then whole: rewritten if it can be)."""
        held, self._held, self._done = self._held, b"", True
        return answer_with_model(held, self._public) if held else held


class StreamNamer:
    """An event stream fed in pieces cut anywhere: each `data:` line's `model` rewritten as the
    line passes. Whole lines go on at once; an unfinished one waits only while its `model`
    value may still come whole (at most `HOLD_MAX` bytes)."""

    __slots__ = ("_held", "_learned", "_name", "_passing", "_renamed")

    def __init__(self, public: str) -> None:
        self._name = msgspec.json.encode(public)
        self._learned = b""
        """The `"model": "..."` member as the first event that named the model spelled it; a
        piece whose every `"model"` is that member is renamed by one `replace` (Chat
        Completions repeats it in every chunk)."""
        self._renamed = b""
        self._held = b""
        """The unfinished line, from its start, while it may still need rewriting."""
        self._passing = False
        """The unfinished line was dealt with: the rest of it passes unread."""

    @property
    def held(self) -> int:
        return len(self._held)

    def feed(self, piece: bytes) -> bytes:
        if not self._held and not self._passing and piece[-1:] == b"\n" and _KEY not in piece:
            return piece  # whole lines that name no model: most events of most streams
        out: list[bytes] = []
        if self._passing:
            newline = piece.find(b"\n")
            if newline < 0:
                return piece
            self._passing = False
            out.append(piece[: newline + 1])
            piece = piece[newline + 1 :]
        data = self._held + piece if self._held else piece
        self._held = b""
        last = data.rfind(b"\n") + 1
        if last:
            out.append(self._lines(data if last == len(data) else data[:last]))
        if last < len(data):
            out.append(self._open_line(data[last:] if last else data))
        return out[0] if len(out) == 1 else b"".join(out)

    def end(self) -> bytes:
        """What is held, once the stream ended (a last line without its newline)."""
        held, self._held, self._passing = self._held, b"", False
        if not held:
            return held
        found = _in_line(held, 0, len(held), whole=True)
        return held if found is None else _splice(held, found, self._name)

    def _lines(self, lines: bytes) -> bytes:
        """Whole lines, each `data:` line's `model` rewritten (the first `"model"` of a line
        is where its reading starts; a line is read once)."""
        at = lines.find(_KEY)
        if at < 0:
            return lines
        learned = self._learned
        if learned and lines.count(learned) == lines.count(_KEY):
            return lines.replace(learned, self._renamed)
        parts: list[bytes] = []
        done = 0  # bytes of `lines` already in `parts`
        while at >= 0:
            start = lines.rfind(b"\n", 0, at) + 1
            end = lines.find(b"\n", at)
            found = _in_line(lines, start, end, whole=True)
            if found is not None and lines[found.start : found.end] != self._name:
                key = lines.rfind(_KEY, start, found.start)
                learned = self._learned = lines[key : found.end]
                self._renamed = lines[key : found.start] + self._name
                parts += (lines[done : found.start], self._name)
                done = found.end
                if lines.count(learned, done) == lines.count(_KEY, done):
                    parts.append(lines[done:].replace(learned, self._renamed))
                    return b"".join(parts)  # the rest of the piece as it spells the member
            at = lines.find(_KEY, end)
        if not parts:
            return lines
        parts.append(lines[done:])
        return b"".join(parts)

    def _open_line(self, line: bytes) -> bytes:
        """The start of a line not ended yet: rewritten and passed on once its `model` is
        whole, held while it may come, passed as it is when it cannot."""
        found = _in_line(line, 0, len(line), whole=False)
        if found is INCOMPLETE and len(line) <= HOLD_MAX:
            self._held = line
            return b""
        self._passing = True
        if found is None or found is INCOMPLETE:
            return line
        return _splice(line, found, self._name)


def _in_line(data: bytes, start: int, end: int, *, whole: bool) -> Found | None:
    """The `model` value of the SSE line `data[start:end]` (a `data:` line's JSON event)."""
    if data.startswith(_DATA, start, end):
        return find_model(data, start + len(_DATA), end, wrapped=True, whole=whole)
    if not whole and _DATA.startswith(data[start:end]):
        return INCOMPLETE  # not yet long enough to tell
    return None
