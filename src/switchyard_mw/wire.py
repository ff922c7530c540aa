"""Reads an LLM request body once into a small typed view, and writes the wire's own errors.

Only the fields a policy needs are decoded; msgspec skips the rest without building objects.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import re
import threading
from collections.abc import Callable
from typing import Annotated, Any, ParamSpec, TypeVar, cast

import msgspec
from msgspec import Meta, Raw, Struct

from . import simd_read
from .errors import WireError as WireError  # its home before the one exception tree
from .utf8 import check_utf8

NonNegInt = Annotated[int, Meta(ge=0)]


class Wire(enum.Enum):
    ANTHROPIC = "anthropic"
    OPENAI_CHAT = "openai_chat"
    OPENAI_RESPONSES = "openai_responses"
    GENERIC = "generic"

    # Members are singletons compared by identity: hash them that way too, in C, rather than
    # by Enum's Python-level hash of the name (a dict keyed by wire is read on every request).
    __hash__ = object.__hash__

    @property
    def anthropic_style(self) -> bool:
        """Errors and stream events in Anthropic's shape; everything else speaks OpenAI's."""
        return self is Wire.ANTHROPIC


COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
"""Anthropic's token counting: a Messages body, answered `{"input_tokens": N}`, no output."""

WIRE_PATHS: dict[str, Wire] = {
    "/v1/messages": Wire.ANTHROPIC,
    "/v1/chat/completions": Wire.OPENAI_CHAT,
    "/v1/responses": Wire.OPENAI_RESPONSES,
    COUNT_TOKENS_PATH: Wire.ANTHROPIC,  # last: a router tries the busy paths first
}


def too_large(limit: int) -> WireError:
    """A request body past `limit` bytes: 413 on every wire and through both fronts."""
    return WireError(413, "request_too_large", f"request body exceeds {limit} bytes")


def bad_request(message: str) -> WireError:
    return WireError(400, "invalid_request_error", message)


_UNSET: Any = object()


class RequestView:
    """What the policies need to know about one request body.

    `first_turn_hash` and `has_thinking` are worked out on first use: most requests (no
    canary, no failover) never ask, and hashing a conversation's first turn is the costliest
    part of reading a request.
    """

    __slots__ = (
        "_body",
        "_hash",
        "_messages",
        "_thinking",
        "_turn",
        "counts",
        "keyless_continuation",
        "max_tokens",
        "model",
        "stream",
        "user_key",
        "wire",
    )

    def __init__(
        self,
        *,
        wire: Wire,
        model: str,
        max_tokens: int | None,
        stream: bool,
        user_key: str | None,
        keyless_continuation: bool = False,
        first_turn: Raw | str | None = None,
        messages: list[_Message] | None = None,
        has_thinking: bool = False,
        thinking_in_body: bool = False,
        body: bytes = b"",
    ) -> None:
        self.wire = wire
        self.model = model
        self.max_tokens = max_tokens
        self.stream = stream
        self.user_key = user_key
        self.keyless_continuation = keyless_continuation
        self.counts = False
        """A token count (`COUNT_TOKENS_PATH`): only an account that can count may take it."""
        self._turn = first_turn
        self._messages = messages
        self._body = body  # the bytes `messages` was read from (a reference, not a copy)
        self._hash: str | None = _UNSET
        # `thinking_in_body`: an Anthropic body read without its messages (`simd_read`); they
        # are decoded from `body` if a policy asks, and only if it may hold signed thinking.
        unknown = messages is not None or thinking_in_body
        self._thinking: bool = _UNSET if unknown else has_thinking

    @property
    def first_turn_hash(self) -> str | None:
        """Canonical hash of the conversation's first user turn; None when it has none."""
        if self._hash is _UNSET:
            turn = self._turn
            if turn is None and self._messages is not None:
                turn = _first_user_content(self._messages)
            if turn is None:
                self._hash = None
            else:
                try:
                    self._hash = _turn_hash_of(turn)
                except RecursionError:
                    self._hash = on_fresh_stack(_turn_hash_of, turn)
        return self._hash

    @property
    def has_thinking(self) -> bool:
        """Whether an assistant turn carries signed thinking (it binds the conversation's model)."""
        if self._thinking is _UNSET:
            body = self._body
            # Signed thinking always has a `signature` (or is `redacted_thinking`): a body with
            # neither word has none, found by two C searches instead of decoding every turn.
            maybe = not body or b'"signature"' in body or b'"redacted_thinking"' in body
            messages = self._messages
            try:
                self._thinking = maybe and _thinks(messages, body)
            except RecursionError:
                self._thinking = on_fresh_stack(_thinks, messages, body)
        return self._thinking

    def __repr__(self) -> str:
        return (
            f"RequestView(wire={self.wire}, model={self.model!r}, max_tokens={self.max_tokens}, "
            f"stream={self.stream}, user_key={'set' if self.user_key else None})"
        )


# --- the three wires, each decoded into just the fields it needs ---------------------------


class _Message(Struct, gc=False):
    """One message of a conversation (hundreds in a long one). Values decoded from JSON hold
    no reference cycles, so the garbage collector need not track each message."""

    role: Any = None
    content: Raw = Raw(b"null")


class _Block(Struct):
    type: Any = None
    signature: Any = None


class _AnthropicMetadata(Struct):
    user_id: str | None = None


class _Anthropic(Struct):
    model: str
    max_tokens: NonNegInt | None = None
    stream: bool | None = None
    metadata: _AnthropicMetadata | None = None
    messages: list[_Message] = []


class _Messages(Struct):
    """An Anthropic body's messages alone, decoded when `RequestView.has_thinking` asks."""

    messages: list[_Message] = []


class _Chat(Struct):
    model: str
    max_completion_tokens: NonNegInt | None = None
    max_tokens: NonNegInt | None = None
    stream: bool | None = None
    user: str | None = None
    safety_identifier: str | None = None
    messages: list[_Message] = []


class _Item(Struct):
    type: Any = None
    role: Any = None
    content: Raw = Raw(b"null")
    encrypted_content: Any = None


class _Responses(Struct):
    model: str
    max_output_tokens: NonNegInt | None = None
    stream: bool | None = None
    user: str | None = None
    safety_identifier: str | None = None
    input: Raw = Raw(b"null")
    previous_response_id: str | None = None
    conversation: Raw = Raw(b"null")


class _Generic(Struct):
    model: str
    max_tokens: NonNegInt | None = None
    max_completion_tokens: NonNegInt | None = None
    max_output_tokens: NonNegInt | None = None
    stream: bool | None = None
    user: str | None = None


_DECODERS: dict[Wire, msgspec.json.Decoder[Any]] = {
    Wire.ANTHROPIC: msgspec.json.Decoder(_Anthropic),
    Wire.OPENAI_CHAT: msgspec.json.Decoder(_Chat),
    Wire.OPENAI_RESPONSES: msgspec.json.Decoder(_Responses),
    Wire.GENERIC: msgspec.json.Decoder(_Generic),
}
_MESSAGES = msgspec.json.Decoder(_Messages)
_BLOCKS = msgspec.json.Decoder(list[_Block] | str | None)
_ITEMS = msgspec.json.Decoder(list[_Item] | str | None)
_ANY = msgspec.json.Decoder()
_CANONICAL = msgspec.json.Encoder(order="sorted")


MAX_MODEL_BYTES = 256
"""The longest model name accepted (UTF-8 bytes): names are echoed in response headers."""


def read_request(wire: Wire, body: bytes, path: str = "") -> RequestView:
    """Decode `body` for `wire`; raise `WireError` (400) when it is not what the wire allows.

    A call on `COUNT_TOKENS_PATH` writes no output: its view's output cap is 0, so that the
    deadline rule never grows its deadline (not even by an account's `default_max_tokens`),
    and it `counts` (the attempt machine sends it only to an account that can count).
    """
    try:
        try:
            if len(body) < _SIMD_MIN_BYTES:
                view = _read(wire, body)
            else:
                view = _read_large(wire, body) or _read(wire, body)
        except RecursionError:
            view = on_fresh_stack(_read, wire, body)  # the one nesting decision: see there
    except msgspec.ValidationError as exc:
        raise bad_request(_field_message(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("request body nests too deeply") from None
    check_model(view.model)
    if path == COUNT_TOKENS_PATH:
        view.max_tokens = 0
        view.counts = True
    return view


def check_model(model: str) -> None:
    """Raise `WireError` (400) unless `model` is a name both fronts may echo in a header.

    The model name is the one piece of client text switchyard writes into a response header
    (`x-switchyard-model`): a control character there breaks the response (servers refuse
    it, Envoy fails the stream), and a long one makes every response carry it. Both fronts
    call this through `read_request`, before any policy sees the name.
    """
    # Four bytes at most per character: a name of up to 64 characters needs no encoding (and
    # no `len`: an empty slice is found without a call, on every request).
    if not model.isprintable():
        raise bad_request("model: must not contain control or other non-printable characters")
    if model[MAX_MODEL_BYTES // 4 :] and len(model.encode()) > MAX_MODEL_BYTES:
        raise bad_request(f"model: must be at most {MAX_MODEL_BYTES} bytes")


def _read_large(wire: Wire, body: bytes) -> RequestView | None:
    """A large conversation read by `simd_read` (one simdjson parse); None: msgspec reads it."""
    if wire not in _CONVERSATIONS:
        return None
    fields = simd_read.read(body, chat=wire is Wire.OPENAI_CHAT, pad=_simd_pad())
    if fields is None:
        return None
    return RequestView(
        wire=wire,
        model=fields.model,
        max_tokens=fields.max_tokens,
        stream=fields.stream,
        user_key=fields.user_key,
        first_turn=fields.first_turn,
        thinking_in_body=wire is Wire.ANTHROPIC,
        body=body,
    )


_CONVERSATIONS = frozenset({Wire.ANTHROPIC, Wire.OPENAI_CHAT})
_SIMD_MIN_BYTES = simd_read.MIN_BYTES  # a global, not an attribute: read on every request


_NESTING_MARGIN = 16


@functools.cache
def _simd_pad() -> int:
    """How many levels to wrap a body in so that simdjson refuses it before it nests as deep
    as msgspec's read can go (`on_fresh_stack`); msgspec then reads it and decides.

    msgspec's limit is Python's stack, so it is found, not assumed (it moves with the
    interpreter's version and recursion limit): the deepest body `_read` reads on a fresh
    stack, by halving, once per process (about ten short threads). That depth moves by a
    level from one thread to the next (measured: 994 or 995 on CPython 3.11), so simdjson
    stops `_NESTING_MARGIN` levels short of it: a body that deep is left to msgspec, whose
    verdict it gets today, and every body simdjson reads, msgspec's later readers can.
    """
    deepest, refused = 1, simd_read.SIMD_MAX_DEPTH + 1
    while refused - deepest > 1:
        depth = (deepest + refused) // 2
        if _reads_nested(depth):
            deepest = depth
        else:
            refused = depth
    return max(0, simd_read.SIMD_MAX_DEPTH - deepest + _NESTING_MARGIN)


def _reads_nested(depth: int) -> bool:
    """Whether `_read` reads, on a fresh stack, a body nested `depth` levels (its object one)."""
    inner = depth - 1
    body = b'{"model": "m", "x": ' + b"[" * inner + b"]" * inner + b"}"
    try:
        on_fresh_stack(_read, Wire.GENERIC, body)
    except RecursionError:
        return False
    return True


def _read(wire: Wire, body: bytes) -> RequestView:
    req = _DECODERS[wire].decode(body)
    # msgspec skips the fields a wire does not read without checking their UTF-8, so such a
    # body would pass here and fail later, inside the app's `receive()`, when `model` is
    # rewritten. JSON is UTF-8 (RFC 8259): one check over the bytes (`utf8`), ASCII's at once.
    if not body.isascii():
        try:
            check_utf8(body)
        except UnicodeDecodeError:
            raise bad_request("request body is not valid UTF-8") from None
    if isinstance(req, _Anthropic):
        meta_user = req.metadata.user_id if req.metadata else None
        return RequestView(
            wire=wire,
            model=req.model,
            max_tokens=req.max_tokens,
            stream=bool(req.stream),
            user_key=meta_user or None,
            messages=req.messages,
            body=body,
        )
    if isinstance(req, _Chat):
        return RequestView(
            wire=wire,
            model=req.model,
            max_tokens=(
                req.max_completion_tokens
                if req.max_completion_tokens is not None
                else req.max_tokens
            ),
            stream=bool(req.stream),
            user_key=req.user or req.safety_identifier or None,
            first_turn=_first_user_content(req.messages),
        )
    if isinstance(req, _Responses):
        return _responses_view(req)
    return RequestView(
        wire=wire,
        model=req.model,
        max_tokens=_first_set(req.max_tokens, req.max_completion_tokens, req.max_output_tokens),
        stream=bool(req.stream),
        user_key=req.user or None,
    )


def _responses_view(req: _Responses) -> RequestView:
    try:
        items = _ITEMS.decode(req.input)
    except msgspec.ValidationError as exc:
        raise bad_request(_field_message(str(exc), prefix="input")) from None
    user_key = req.user or req.safety_identifier or None
    # A continuation's `input` holds only the new turn, not the conversation's first one:
    # keying on it would move every turn somewhere else, so such a request has no turn key.
    continues = req.previous_response_id is not None or bytes(req.conversation) != b"null"
    first_turn: Raw | str | None = None
    thinking = False
    if isinstance(items, str):
        first_turn = None if continues else items
    elif items is not None:
        if not continues:
            first_turn = next(
                (
                    item.content
                    for item in items
                    if item.role == "user" and item.type in (None, "message")
                ),
                None,
            )
        thinking = any(item.type == "reasoning" and item.encrypted_content for item in items)
    return RequestView(
        wire=Wire.OPENAI_RESPONSES,
        model=req.model,
        max_tokens=req.max_output_tokens,
        stream=bool(req.stream),
        user_key=user_key,
        keyless_continuation=continues and user_key is None,
        first_turn=first_turn,
        has_thinking=thinking,
    )


def _first_set(*values: int | None) -> int | None:
    for value in values:
        if value is not None:
            return value
    return None


def _first_user_content(messages: list[_Message]) -> Raw | None:
    for message in messages:  # a loop, not a generator: this runs on every request
        if message.role == "user":
            return message.content
    return None


def _turn_hash_of(turn: Raw | str) -> str:
    if isinstance(turn, str):
        return _turn_hash(turn)
    raw = bytes(turn)
    if raw[:1] == b'"' and b"\\" not in raw:
        # A JSON string without escapes is already its canonical encoding (msgspec writes a
        # string's characters as they are, escaping only quotes, backslashes and controls,
        # none of which such a string can hold): hash it without decoding it first.
        return hashlib.blake2b(raw, digest_size=16).hexdigest()
    try:
        return _turn_hash(_ANY.decode(turn))
    except msgspec.DecodeError:
        # Not decodable (bad UTF-8 deep inside, say): its bytes still key it stably.
        return hashlib.blake2b(raw, digest_size=16).hexdigest()


def _thinks(messages: list[_Message] | None, body: bytes) -> bool:
    if messages is None:  # read by `simd_read`, which leaves the messages in the body
        messages = _MESSAGES.decode(body).messages if body else []
    return _messages_think(messages)


def _messages_think(messages: list[_Message]) -> bool:
    for message in messages:
        if message.role != "assistant" or not bytes(message.content).startswith(b"["):
            continue
        try:
            blocks = _BLOCKS.decode(message.content)
        except (msgspec.ValidationError, msgspec.DecodeError):
            continue
        if isinstance(blocks, list) and any(_is_signed_thinking(b) for b in blocks):
            return True
    return False


def _is_signed_thinking(block: _Block) -> bool:
    if block.type == "redacted_thinking":
        return True  # its payload is the signed, encrypted thought itself
    return block.type == "thinking" and bool(block.signature)


_TEXT_TYPES = frozenset({"text", "input_text"})


def _turn_hash(content: Any) -> str:
    """Hash of a user turn's content, the same for every JSON spelling of that content.

    Cache breakpoints are dropped and a lone run of text blocks reads as its text, since
    clients move `cache_control` and switch between a string and text blocks across turns.
    """
    if isinstance(content, list):
        blocks = [
            {k: v for k, v in b.items() if k != "cache_control"} if isinstance(b, dict) else b
            for b in content
        ]
        if blocks and all(_plain_text(b) for b in blocks):
            content = "\n".join(b["text"] for b in blocks)
        else:
            content = blocks
    return hashlib.blake2b(_CANONICAL.encode(content), digest_size=16).hexdigest()


def _plain_text(block: Any) -> bool:
    return _text_block(block) and len(block) == 2


def _text_block(block: Any) -> bool:
    """A `{"type": "text" | "input_text", "text": "..."}` block (other keys allowed). Its type
    is checked to be a string before the set lookup: a client's `type` may be any JSON value,
    and a list or an object is not hashable."""
    if not isinstance(block, dict):
        return False
    kind = block.get("type")
    return isinstance(kind, str) and kind in _TEXT_TYPES and isinstance(block.get("text"), str)


def _field_message(raw: str, *, prefix: str = "") -> str:
    """msgspec's `Expected `int`, got `str` - at `$.max_tokens`` as `max_tokens: expected ...`."""
    what, _, at = raw.partition(" - at `$")
    path = prefix + at.rstrip("`").lstrip(".")
    if what.startswith("Object missing required field `"):
        field = what.split("`")[1]
        return f"{path}.{field}: required" if path else f"{field}: required"
    what = what[:1].lower() + what[1:]
    return f"{path}: {what}" if path else what


# --- nesting: one limit for every reader ----------------------------------------------------

_T = TypeVar("_T")
_P = ParamSpec("_P")


def on_fresh_stack(fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """`fn(*args, **kwargs)` run on a new thread's empty stack, waited for; raises as it does.

    msgspec recurses once per level of nesting and stops at Python's recursion limit, counted
    from its caller's own depth. So how deep a body may nest would depend on who reads it: the
    body reader (at one depth under one server, another under the next) would accept a body
    that the judge's reader or the model rewrite, called a few frames deeper, then fail on,
    with a 500. Instead, a read that runs out of stack is done again here, where every reader
    starts from the same depth: whether a body nests too deeply is decided once, by
    `read_request` (400), and every later reader of a body it accepted reads no deeper than it
    did. Only such bodies pay for the thread (tens of µs); the others never come here.
    """
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, fn(*args, **kwargs)))
        except BaseException as exc:  # handed to the caller's thread as it was raised
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="switchyard-nesting", daemon=True)
    thread.start()
    thread.join()
    done, value = outcome[0]
    if not done:
        raise value
    return cast("_T", value)


# --- rewriting -------------------------------------------------------------------------------

_TOP = msgspec.json.Decoder(dict[str, Raw])
_ENCODER = msgspec.json.Encoder()


class _Object(Struct):
    """Any JSON object, every member skipped: decoding one only checks its structure."""


_OBJECT = msgspec.json.Decoder(_Object)
_KEY = b'"model"'
_WS = b" \t\n\r"  # JSON's whitespace: nothing else may stand between tokens
# A key that spells a letter of `model` as an escape (`"mod\u0065l"`) is `model` to every
# reader but not to a byte search: a body with one after the key found takes the decoding path.
_ESCAPE = b"\\u006"
_COLON = re.compile(rb"[ \t\n\r]*:[ \t\n\r]*")
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_AFTER = re.compile(rb"[ \t\n\r]*([,}])")
_BLANK = re.compile(rb"[ \t\n\r]*")
_MAX_VALUE_BYTES = 6 * MAX_MODEL_BYTES + 2  # the longest name, each character escaped, quoted
_MAX_WS_BEFORE = 256
_MAX_DECODED_CHECKS = 4


def rewrite_model(body: bytes, model: str) -> bytes:
    """`body` (JSON that `read_request` accepted) with its top-level `model` set to `model`.

    The new value is spliced into the body's own bytes: everything else is kept byte for
    byte, and the body is copied once, never decoded and encoded again. The key is searched
    from the end, where the official SDKs put it (after `messages`), so a long conversation
    before it is not read at all. A body the byte scan cannot prove (see `_model_span`) is
    decoded and encoded, and so is one with a second `model` key: that leaves one key, so an
    upstream that keeps the first of two keys (switchyard reads the last) is never handed a
    model the client chose and switchyard never routed.
    """
    span = _model_span(body)
    if span is None:
        try:
            return _rewrite(body, model)
        except RecursionError:
            return on_fresh_stack(_rewrite, body, model)
    start, end = span
    whole = memoryview(body)  # slices of a view are not copies: the join is the one copy
    return b"".join((whole[:start], _ENCODER.encode(model), whole[end:]))


def _rewrite(body: bytes, model: str) -> bytes:
    top = _TOP.decode(body)
    top["model"] = Raw(_ENCODER.encode(model))
    return _ENCODER.encode(top)


def _model_span(body: bytes) -> tuple[int, int] | None:
    """Byte span of the value of the last top-level `model` key; None when not proven.

    Each `"model"` in the body is a candidate, the last first. One preceded by `{` or `,` and
    followed by `:` opens a string in valid JSON (its quote is not escaped, and a closing
    quote cannot be followed by a letter), so it is a key of some object: `_top_level` then
    decides which. No key spelled with escapes may follow the one found.
    """
    checks = 0
    at = body.rfind(_KEY)
    while at != -1:
        before = _before(body, at)
        if before is None:
            return None
        colon = _COLON.match(body, at + len(_KEY))
        if body[before] in b"{," and colon is not None:  # a key: is it a top-level one?
            value = _STRING.match(body, colon.end(), colon.end() + _MAX_VALUE_BYTES)
            after = None if value is None else _AFTER.match(body, value.end())
            end = None if after is None else after.start(1)
            top = _top_level(body, before, end)
            if top is None:
                checks += 1
                if checks > _MAX_DECODED_CHECKS:
                    return None
                top = _decoded_top_level(body, before, end)
            if top:
                if value is None or end is None or _maybe_duplicated(body, at):
                    return None  # not a string a model name fits in, or perhaps a duplicate
                return value.span()
        at = body.rfind(_KEY, 0, at)
    return None


def _maybe_duplicated(body: bytes, at: int) -> bool:
    """Whether the body may hold another `model` key than the one at `at`: any earlier
    `"model"` (nested ones too: proving which is which would cost a parse) or a key spelled
    with escapes anywhere. Two searches in C, a small share of the UTF-8 check's cost."""
    return body.find(_KEY, 0, at) != -1 or body.find(_ESCAPE) != -1


def _before(body: bytes, at: int) -> int | None:
    """Index of the last non-whitespace byte before `at` (bounded); None past the bound."""
    start = at - 1
    while start >= 0 and body[start] in _WS:
        start -= 1
        if at - start > _MAX_WS_BEFORE:
            return None
    return start if start >= 0 else None


def _top_level(body: bytes, before: int, after: int | None) -> bool | None:
    """Whether the key between `body[before]` (`{` or `,`) and `body[after]` (`,` or `}`;
    None when its value's end is not known) is a member of the top-level object, when the
    bytes around it tell; else None.

    The top-level object's `{` is the body's first byte but whitespace, its `}` the last.
    """
    opens = body[before] == ord("{")
    if opens:
        return _BLANK.fullmatch(body, 0, before) is not None
    if after is not None and body[after] == ord("}"):
        return _BLANK.fullmatch(body, after + 1) is not None
    return None


def _decoded_top_level(body: bytes, before: int, after: int | None) -> bool:
    """Whether the member after the comma at `before` (before the comma at `after`) is at
    the top level, by decoding the shorter known side closed into an object.

    Cut at a member of the top-level object, `body[:before] + "}"` and `"{" +
    body[after + 1:]` are each one object; cut one level deeper or more, the first still has
    an open bracket and the second closes more than it opened: neither decodes.
    """
    if after is None or before < len(body) - after:
        side = body[:before] + b"}"
    else:
        side = b"{" + body[after + 1 :]
    try:
        try:
            _OBJECT.decode(side)
        except RecursionError:
            on_fresh_stack(_OBJECT.decode, side)
    except (msgspec.DecodeError, RecursionError):
        return False
    return True


# --- errors in the wire's own shape ----------------------------------------------------------


def model_not_served(wire: Wire, model: str) -> WireError:
    """The 404 for a model no account serves, in the terms each wire's own provider uses."""
    error_type = "not_found_error" if wire.anthropic_style else "model_not_found"
    return WireError(404, error_type, f"model `{model}` is not served by any account")


def answer_wire(path: str, anthropic_version: bool) -> Wire:
    """The wire an answer to a request that is no LLM call speaks (a models list, a 404): the
    path's own when it is under a wire's path, else Anthropic's when the request carries
    `anthropic-version` (every Anthropic SDK sends it), else OpenAI's."""
    for known, wire in WIRE_PATHS.items():
        if path == known or path.startswith(known + "/"):
            return wire
    return Wire.ANTHROPIC if anthropic_version else Wire.OPENAI_CHAT


def unknown_url(wire: Wire, method: str, path: str) -> bytes:
    """The 404 body for a path the gateway does not serve, as each wire's provider words it
    (the SDKs raise their `NotFoundError` with it)."""
    message = f"Invalid URL ({method} {path})"
    if wire.anthropic_style:
        return error_body(wire, "not_found_error", message)
    error = {"message": message, "type": "invalid_request_error", "param": None}
    return _ENCODER.encode({"error": {**error, "code": "unknown_url"}})


def error_body(wire: Wire, error_type: str, message: str) -> bytes:
    """An error body the wire's official SDK parses into its typed error."""
    if wire.anthropic_style:
        return _ENCODER.encode({"type": "error", "error": {"type": error_type, "message": message}})
    return _ENCODER.encode({"error": {"message": message, "type": error_type, "code": error_type}})


def stream_error_event(
    wire: Wire, error_type: str, message: str, sequence: StreamSequence | None = None
) -> bytes:
    """One SSE event that ends a started stream with an error the wire's clients report.

    Anthropic: `event: error`, data `{"type": "error", "error": {"type", "message"}}`.
    OpenAI Responses: `event: error`, data `{"type": "error", "code", "message", "param",
    "sequence_number"}` (its `ResponseErrorEvent`; the error type is the `code`), numbered after
    the last event `sequence` saw pass (0 without one). OpenAI Chat Completions and generic
    paths: a `data: {"error": {...}}` line, the body of an error answer.
    """
    if wire is Wire.OPENAI_RESPONSES:
        number = 0 if sequence is None else sequence.next
        event = {
            "type": "error",
            "code": error_type,
            "message": message,
            "param": None,
            "sequence_number": number,
        }
        return b"event: error\ndata: " + _ENCODER.encode(event) + b"\n\n"
    if wire.anthropic_style:
        return b"event: error\ndata: " + error_body(wire, error_type, message) + b"\n\n"
    return b"data: " + error_body(wire, error_type, message) + b"\n\n"


_SEQUENCE_KEY = b'"sequence_number"'
_SEQUENCE = re.compile(rb'"sequence_number"[ \t]*:[ \t]*([0-9]+)')  # one SSE line: no newline
_EDGE = 64
"""Bytes of the stream kept from one piece to the next: more than a `"sequence_number": N`
cut by a piece's end can span."""


class StreamSequence:
    """The last `sequence_number` an OpenAI Responses stream passed on, so that an error event
    written into it follows the last event the client received.

    Fed each piece as it passes, cut anywhere. A piece of whole lines after whole lines (how
    SSE is usually sent, and how the forwarder relays it) costs one search from its end and
    is kept by reference, read only if an error event needs its number: no number runs over
    its ends, and most streams end without an error. A piece that ends inside a line, or
    follows one, is read at once, with the few bytes around its start where a number cut by
    the previous piece ends. Inside a JSON string every quote is escaped, so a quoted
    `"sequence_number"` is a key.
    """

    __slots__ = ("_edge", "_known", "_unread")

    def __init__(self) -> None:
        self._known: int | None = None
        self._unread: bytes | None = None
        """The last piece of whole lines that holds the key, not read yet."""
        self._edge = b""
        """The stream's last bytes while it stands inside a line (empty after a newline)."""

    @property
    def last(self) -> int | None:
        """The last whole number that passed; None before any."""
        self._read()
        return self._known

    @property
    def next(self) -> int:
        """The number the next event takes: one after the last seen, 0 before any."""
        last = self.last
        return 0 if last is None else last + 1

    def feed(self, piece: bytes) -> None:
        ends_line = piece[-1:] == b"\n"
        if ends_line and not self._edge:
            if piece.rfind(_SEQUENCE_KEY) >= 0:
                self._unread = piece
            return
        self._read()
        found = _last_number(piece)
        if found is None and self._edge:
            found = _last_number(self._edge + piece[:_EDGE])
        if found is not None:
            self._known = found
        if ends_line:
            self._edge = b""
        else:
            self._edge = piece[-_EDGE:] if len(piece) >= _EDGE else (self._edge + piece)[-_EDGE:]

    def _read(self) -> None:
        if self._unread is not None:
            found = _last_number(self._unread)
            if found is not None:
                self._known = found
            self._unread = None


def sequence_for(wire: Wire | None) -> StreamSequence | None:
    """A `StreamSequence` for a stream of this wire; None where events carry no number."""
    return StreamSequence() if wire is Wire.OPENAI_RESPONSES else None


def _last_number(data: bytes) -> int | None:
    """The last `"sequence_number": N` in `data` whose digits end before `data` does."""
    end = len(data)
    while (at := data.rfind(_SEQUENCE_KEY, 0, end)) >= 0:
        found = _SEQUENCE.match(data, at)
        if found is not None and found.end() < len(data):
            return int(found[1])
        end = at
    return None


# --- the last user turn, as text (what a judge classifies) ------------------------------------


class _Turns(Struct):
    messages: list[_Message] | None = None
    input: Raw = Raw(b"null")


_TURNS = msgspec.json.Decoder(_Turns)


def last_user_text(wire: Wire, body: bytes) -> str:
    """The text of the conversation's last user turn; "" when there is none.

    Anthropic and Chat read `messages`, Responses reads `input` (a string is the user turn),
    a generic body whichever it has. Text blocks are joined with newlines; images, files and
    tool results are skipped. Never raises: the body was validated when it was read, and an
    odd shape here only means there is less text to show.
    """
    try:
        return _last_user_text(wire, body)
    except RecursionError:
        return on_fresh_stack(_last_user_text, wire, body)


def _last_user_text(wire: Wire, body: bytes) -> str:
    try:
        turns = _TURNS.decode(body)
        if wire is not Wire.OPENAI_RESPONSES and turns.messages:
            for message in reversed(turns.messages):
                if message.role == "user":
                    return _text_of(_ANY.decode(message.content))
            return ""
        if wire in (Wire.OPENAI_RESPONSES, Wire.GENERIC):
            items = _ANY.decode(turns.input)
            if isinstance(items, str):
                return items
            if isinstance(items, list):
                for item in reversed(items):
                    if (
                        isinstance(item, dict)
                        and item.get("role") == "user"
                        and item.get("type", "message") == "message"
                    ):
                        return _text_of(item.get("content"))
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    return ""


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "\n".join(block["text"] for block in content if _text_block(block))
