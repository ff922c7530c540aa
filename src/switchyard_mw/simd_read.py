"""A large conversation's request body read from simdjson's one parse, not msgspec's scan.

`wire.read_request` decodes a body with msgspec into the few fields the policies use. msgspec
still walks every byte of what it skips (a byte at a time) and builds a struct for each
message of a conversation, and a body past ASCII is then parsed once more by simdjson for its
UTF-8 (`utf8`). For the two conversation wires (Anthropic Messages, OpenAI Chat), a body of
`MIN_BYTES` or more is read here instead, when pysimdjson is installed: one parse checks its
JSON and its UTF-8 at vector speed, and the fields are taken from the document
(docs/performance.md, "The read by simdjson").

msgspec stays the judge. This read answers only for a body that msgspec reads to the same
view, and None for anything else: a field of another type, a key given twice (msgspec keeps
the last, simdjson finds the first), a message that is not an object, a first turn whose
content is a bare number, a body simdjson refuses. Such a body is then read by msgspec, whose
verdict and words stand. How deep a body may nest is the one limit the two set apart
(simdjson's is 1,024 levels, msgspec's Python's stack): the caller wraps the body in as many
levels as simdjson's limit exceeds msgspec's, so that simdjson refuses what msgspec would.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from itertools import repeat
from typing import Any, NamedTuple

from msgspec import Raw

from switchyard_mw.utf8 import SIMD_MAX_BYTES, simd_parser

MIN_BYTES = 16384
"""The smallest body read here: below, msgspec's read costs no more than the parse and the
calls that take the fields from the document."""

SIMD_MAX_DEPTH = 1024
"""simdjson's nesting limit (its default, which pysimdjson does not change)."""

_NULL = Raw(b"null")
_ABSENT: Any = object()  # `messages` left out: msgspec's default, an empty list


class Fields(NamedTuple):
    """What `wire.RequestView` is built from, as msgspec's read gives it."""

    model: str
    max_tokens: int | None
    stream: bool
    user_key: str | None
    first_turn: Raw | str | None
    """The first user turn's content (`Raw` JSON, or the text of a string); None: no user turn."""


_REFUSED = "not a body this read answers for: msgspec reads it"
"""The words of the `ValueError` a helper raises to hand the body to msgspec (a fresh one each
time: a raised exception keeps its frames, and their proxies would keep the parser busy)."""


def read(body: bytes, *, chat: bool, pad: int) -> Fields | None:
    """The fields of an OpenAI Chat (`chat`) or Anthropic Messages body, or None: msgspec reads
    it. `pad`: levels to wrap the body in, so that simdjson refuses a body nested deeper than
    msgspec reads."""
    parser = simd_parser()
    if parser is None or len(body) + 2 * pad > SIMD_MAX_BYTES:
        return None
    try:
        # Every proxy of the document is a local of this frame or its callees, gone when
        # they return: the thread's parser is free again for the next body.
        if pad:
            with _wrapped(body, pad) as wrapped:
                doc = parser.parse(wrapped)
        else:
            doc = parser.parse(body)
    except (ValueError, RuntimeError):  # not JSON, not UTF-8, too deep: msgspec's verdict
        return None
    top = doc.at_pointer("/0" * pad) if pad else doc
    try:
        return _chat(top) if chat else _anthropic(top)
    except ValueError:  # `_REFUSED`: msgspec reads the body, and its verdict stands
        return None


def _wrapped(body: bytes, pad: int) -> memoryview:
    """`body` inside `pad` array levels, written into this thread's buffer.

    Not a new `bytes` of the body's size each time: past a few hundred KB, a fresh allocation
    of that size is fresh pages from the kernel on every request (its faults, measured under
    Envoy at 1 MB, cost more than the copy). The buffer grows to the largest body wrapped,
    at most `SIMD_MAX_BYTES`; simdjson copies the document into its own buffer, so the view
    is released as soon as the parse returns.
    """
    size = len(body) + 2 * pad
    held: tuple[int, bytearray] | None = getattr(_local, "held", None)
    if held is None or held[0] != pad or len(held[1]) < size:
        held = _local.held = (pad, bytearray(b"[" * pad) + bytearray(size - pad))
    # Written through a view: a `bytearray` slice given `bytes` first copies them into a
    # new bytearray of their size (CPython's `bytearray_ass_subscript`), a second copy of
    # the body and an allocation of its size on every read.
    view = memoryview(held[1])[:size]
    end = size - pad
    view[pad:end] = body
    view[end:] = b"]" * pad
    return view


_local = threading.local()


def _anthropic(doc: Any) -> Fields:
    get = _members(doc)
    metadata = get("metadata")
    user_id = None if metadata is None else _optional_str(_members(metadata)("user_id"))
    return Fields(
        model=_str(get("model")),
        max_tokens=_count(get("max_tokens")),
        stream=_flag(get("stream")),
        user_key=user_id or None,
        first_turn=_first_turn(get("messages", _ABSENT)),
    )


def _chat(doc: Any) -> Fields:
    get = _members(doc)
    completion = _count(get("max_completion_tokens"))
    legacy = _count(get("max_tokens"))
    user = _optional_str(get("user"))
    safety = _optional_str(get("safety_identifier"))
    return Fields(
        model=_str(get("model")),
        max_tokens=completion if completion is not None else legacy,
        stream=_flag(get("stream")),
        user_key=user or safety or None,
        first_turn=_first_turn(get("messages", _ABSENT)),
    )


def _members(value: Any) -> Callable[..., Any]:
    """`get(key, default=None)` for an object whose keys are all different; refused otherwise.

    The keys are looked up in a set of their names first: pysimdjson finds a key that is not
    there by raising and catching an exception, about 2 µs each (measured), for each of the
    optional fields most bodies leave out.
    """
    if not _is_object(value):
        raise ValueError(_REFUSED)
    names = set(value.keys())
    if len(names) != len(value):
        raise ValueError(_REFUSED)

    def get(key: str, default: Any = None) -> Any:
        return value[key] if key in names else default

    return get


def _first_turn(messages: Any) -> Raw | str | None:
    if messages is _ABSENT:
        return None
    if not _is_array(messages) or not all(map(isinstance, messages, repeat(_OBJECT))):
        raise ValueError(_REFUSED)  # msgspec words which message, and how it is wrong
    for message in messages:  # a loop, not a generator: the first user turn is near the start
        get = _members(message)
        role = get("role")
        if type(role) is str and role == "user":
            return _content(get("content"))
    return None


def _content(content: Any) -> Raw | str:
    if content is None:
        return _NULL
    if type(content) is str:
        return content
    if _is_object(content) or _is_array(content):
        # Minified, the same JSON (numbers keep their kind: 1.0 stays 1.0): its hash, worked
        # out by `wire` on first use, is the one msgspec's raw bytes give.
        return Raw(content.mini)
    raise ValueError(_REFUSED)  # a bare number or boolean: rare enough to leave to msgspec


def _str(value: Any) -> str:
    if type(value) is not str:
        raise ValueError(_REFUSED)
    return value


def _optional_str(value: Any) -> str | None:
    if value is not None and type(value) is not str:
        raise ValueError(_REFUSED)
    return value


def _count(value: Any) -> int | None:
    """A `NonNegInt | None`, as msgspec reads one (a boolean is not a number there)."""
    if value is None or (type(value) is int and value >= 0):
        return value
    raise ValueError(_REFUSED)


def _flag(value: Any) -> bool:
    if value is None or value is False:
        return False
    if value is True:
        return True
    raise ValueError(_REFUSED)


def _object_type() -> tuple[type, type]:
    try:
        from simdjson import Array, Object
    except ImportError:  # no parser either: `read` answers None before any proxy
        return type(None), type(None)
    return Object, Array


_OBJECT, _ARRAY = _object_type()


def _is_object(value: Any) -> bool:
    return type(value) is _OBJECT


def _is_array(value: Any) -> bool:
    return type(value) is _ARRAY
