"""The read's verdict on Anthropic's and Chat's `messages` is the one a message-by-message read
gives: the same 400s with the same words, the same first error in the body, the same fields,
the same first-turn hash and thinking. A guard for any cheaper read of `messages` (one that
kept each message raw and checked its first byte was measured and cost more: see
docs/performance.md, "The processor at 128 KB")."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec import Raw, Struct

from switchyard_mw.wire import RequestView, Wire, WireError, _field_message, read_request


class _RefMessage(Struct):
    role: Any = None
    content: Raw = Raw(b"null")


class _RefMetadata(Struct):
    user_id: str | None = None


class _RefAnthropic(Struct):
    """What the read decoded before messages were kept raw: a struct per message."""

    model: str
    max_tokens: int | None = None
    stream: bool | None = None
    metadata: _RefMetadata | None = None
    messages: list[_RefMessage] = []


class _RefChat(Struct):
    model: str
    max_completion_tokens: int | None = None
    max_tokens: int | None = None
    stream: bool | None = None
    user: str | None = None
    safety_identifier: str | None = None
    messages: list[_RefMessage] = []


_REFERENCE = {Wire.ANTHROPIC: _RefAnthropic, Wire.OPENAI_CHAT: _RefChat}


def refusal(wire: Wire, body: bytes) -> str | None:
    """The 400's words where the message-by-message read fails (msgspec's error, worded as
    the read words it); None: it reads."""
    try:
        msgspec.json.decode(body, type=_REFERENCE[wire])
    except msgspec.ValidationError as exc:
        return _field_message(str(exc))
    except msgspec.DecodeError as exc:
        return f"request body is not valid JSON: {exc}"
    return None


def verdict(wire: Wire, body: bytes) -> str | RequestView:
    try:
        return read_request(wire, body)
    except WireError as exc:
        return exc.message if exc.status == 400 else f"status {exc.status}"


WIRES = [Wire.ANTHROPIC, Wire.OPENAI_CHAT]


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize(
    ("messages", "words"),
    [
        ([1], "messages[0]: expected `object`, got `int`"),
        ([{"role": "user", "content": "x"}, "hi"], "messages[1]: expected `object`, got `str`"),
        ([{"role": "user"}, None], "messages[1]: expected `object`, got `null`"),
        ([{"role": "user"}, [{"role": "user"}]], "messages[1]: expected `object`, got `array`"),
        ([{}, True, 2.5], "messages[1]: expected `object`, got `bool`"),
        ({"role": "user"}, "messages: expected `array`, got `object`"),
    ],
)
def test_a_message_that_is_not_an_object_is_refused(
    wire: Wire, messages: object, words: str
) -> None:
    body = json.dumps({"model": "m", "messages": messages}).encode()
    assert verdict(wire, body) == words
    assert refusal(wire, body) is not None


@pytest.mark.parametrize("wire", WIRES)
def test_the_first_error_in_the_body_is_the_one_reported(wire: Wire) -> None:
    """A read that skipped messages would let the body's later error speak first."""
    messages_first = b'{"messages": [1], "model": 5}'
    assert verdict(wire, messages_first) == "messages[0]: expected `object`, got `int`"
    model_first = b'{"model": 5, "messages": [1]}'
    assert verdict(wire, model_first) == "model: expected `str`, got `int`"
    broken_after = b'{"messages": [1], "model": "m", '
    assert verdict(wire, broken_after) == "messages[0]: expected `object`, got `int`"
    broken = b'{"messages": [{"role": "user"}], "model": "m", '
    assert isinstance(verdict(wire, broken), str)
    assert str(verdict(wire, broken)).startswith("request body is not valid JSON: ")


@pytest.mark.parametrize("wire", WIRES)
def test_whitespace_around_messages_is_read_as_json_allows(wire: Wire) -> None:
    body = b'{"model": "m", "messages": [ \n\t{"role": "user", "content": "hi"} ,\r {} ]}'
    view = verdict(wire, body)
    assert isinstance(view, RequestView)
    assert view.first_turn_hash is not None


def test_invalid_utf8_inside_a_message_is_refused() -> None:
    for wire in WIRES:
        body = b'{"model": "m", "messages": [{"role": "user", "content": "caf\xc3"}]}'
        assert verdict(wire, body) == "request body is not valid UTF-8"


_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 5), st.sampled_from(["", "user", "é ☕"])
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from("abc"), inner, max_size=2)
    ),
    max_leaves=6,
)
_BLOCK = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "thinking", "redacted_thinking"])},
    optional={"signature": st.sampled_from(["", "sig"]), "text": st.just("t")},
)
_MESSAGE = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.one_of(st.sampled_from(["user", "assistant", "system"]), _VALUES),
            "content": st.one_of(_VALUES, st.lists(_BLOCK, max_size=3)),
        },
    ),
    _VALUES,
)


@settings(max_examples=600, deadline=None)
@given(
    wire=st.sampled_from(WIRES),
    messages=st.one_of(st.lists(_MESSAGE, max_size=5), _VALUES),
    model=st.one_of(st.just("m"), _VALUES),
    messages_first=st.booleans(),
    user=st.one_of(st.none(), st.just("u")),
    tail=st.sampled_from(["", ",", ', "max_tokens": "x"', ', "stream": true']),
)
def test_every_body_gets_the_verdict_of_a_message_by_message_read(
    wire: Wire,
    messages: object,
    model: object,
    messages_first: bool,
    user: str | None,
    tail: str,
) -> None:
    fields: list[tuple[str, object]] = [("model", model), ("messages", messages)]
    if messages_first:
        fields.reverse()
    if user is not None:
        fields.append(("metadata", {"user_id": user}) if wire is Wire.ANTHROPIC else ("user", user))
    text = "{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in fields) + tail + "}"
    body = text.encode()
    expected = refusal(wire, body)
    got = verdict(wire, body)
    if expected is not None:
        assert got == expected, body
        return
    if isinstance(got, str):  # the read's own checks past msgspec's (a model name, UTF-8)
        assert got.startswith("model: ") or got == "request body is not valid UTF-8", got
        return
    reference = msgspec.json.decode(body, type=_REFERENCE[wire])
    first = next((m.content for m in reference.messages if m.role == "user"), None)
    assert (got.first_turn_hash is None) == (first is None)
    if first is not None:
        same = read_request(wire, json.dumps({"model": "m", "messages": [first_of(body)]}).encode())
        assert got.first_turn_hash == same.first_turn_hash
    thinking = wire is Wire.ANTHROPIC and any(
        m.role == "assistant" and _signed(msgspec.json.decode(m.content))
        for m in reference.messages
    )
    assert got.has_thinking is thinking


def first_of(body: bytes) -> dict[str, Any]:
    """The body's first user message, decoded."""
    data = json.loads(body)
    return next(m for m in data["messages"] if isinstance(m, dict) and m.get("role") == "user")


def _signed(content: object) -> bool:
    return isinstance(content, list) and any(
        isinstance(block, dict)
        and (
            block.get("type") == "redacted_thinking"
            or (block.get("type") == "thinking" and bool(block.get("signature")))
        )
        for block in content
    )
