"""A large conversation's body read by simdjson's one parse (`simd_read`) gives msgspec's
verdict and view on every body: where it answers, the view is the one msgspec's read gives;
where it does not (a key given twice, a field of another type, a message that is not an
object, a body nested near the limit), msgspec reads the body and its words stand."""

from __future__ import annotations

import json
import threading
import tracemalloc
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard_mw import simd_read, utf8, wire
from switchyard_mw.wire import (
    COUNT_TOKENS_PATH,
    RequestView,
    Wire,
    WireError,
    on_fresh_stack,
    read_request,
)

pytest.importorskip("simdjson")

WIRES = [Wire.ANTHROPIC, Wire.OPENAI_CHAT]
FILLER = "Grüße, 日本語 ☕ and plain words " * 700  # about 23 KB: past MIN_BYTES alone


def conversation(wire: Wire, turns: int, **top: Any) -> bytes:
    """A conversation as clients send it: text past ASCII, block lists, tool results."""
    messages: list[dict[str, Any]] = []
    for i in range(turns):
        if i % 2 == 0:
            content: Any = (
                f"question {i}: ¿qué tal? ☕ " * 20
                if i % 4 == 0
                else [{"type": "text", "text": f"part {i} — é", "cache_control": {"t": 1.0}}]
            )
            messages.append({"role": "user", "content": content})
        else:
            messages.append({"role": "assistant", "content": f"answer {i}: 日本語 " * 30})
    fields: dict[str, Any] = {"model": "claude-x", "max_tokens": 512, "messages": messages}
    if wire is Wire.ANTHROPIC:
        fields["metadata"] = {"user_id": "u-1"}
    else:
        fields["user"] = "u-1"
    fields.update(top)
    return json.dumps(fields, ensure_ascii=False).encode()


def facts(view: RequestView) -> tuple[Any, ...]:
    return (
        view.wire,
        view.model,
        view.max_tokens,
        view.stream,
        view.user_key,
        view.keyless_continuation,
        view.counts,
        view.first_turn_hash,
        view.has_thinking,
    )


def by_msgspec(wire_: Wire, body: bytes, path: str = "") -> tuple[Any, ...] | str:
    """The verdict of the read without simdjson's: the reference."""
    original = wire._read_large
    wire._read_large = lambda *_: None  # type: ignore[assignment]
    try:
        return verdict(wire_, body, path)
    finally:
        wire._read_large = original  # type: ignore[assignment]


def verdict(wire_: Wire, body: bytes, path: str = "") -> tuple[Any, ...] | str:
    try:
        return facts(read_request(wire_, body, path))
    except WireError as exc:
        return exc.message


class Counted:
    def __init__(self, real: Any) -> None:
        self.real, self.calls = real, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.real(*args, **kwargs)


@pytest.fixture
def msgspec_reads(monkeypatch: pytest.MonkeyPatch) -> Counted:
    wire._simd_pad()  # found once per process, by reads of its own
    counted = Counted(wire._read)
    monkeypatch.setattr(wire, "_read", counted)
    return counted


@pytest.mark.parametrize("wire_", WIRES)
@pytest.mark.parametrize("turns", [40, 300, 2400])  # about 16 KB, 128 KB, 1 MB
def test_a_large_conversation_is_read_by_simdjson_to_msgspecs_view(
    wire_: Wire, turns: int, msgspec_reads: Counted
) -> None:
    body = conversation(wire_, turns)
    assert len(body) >= simd_read.MIN_BYTES
    got = verdict(wire_, body)
    assert msgspec_reads.calls == 0
    assert got == by_msgspec(wire_, body)
    assert isinstance(got, tuple)
    assert got[7] is not None  # the first turn's hash


@pytest.mark.parametrize("wire_", WIRES)
def test_a_body_under_the_size_is_read_by_msgspec(wire_: Wire, msgspec_reads: Counted) -> None:
    body = conversation(wire_, 4)
    assert len(body) < simd_read.MIN_BYTES
    assert isinstance(verdict(wire_, body), tuple)
    assert msgspec_reads.calls == 1


@pytest.mark.parametrize("wire_", [Wire.OPENAI_RESPONSES, Wire.GENERIC])
def test_the_other_wires_are_read_by_msgspec(wire_: Wire, msgspec_reads: Counted) -> None:
    body = json.dumps({"model": "m", "input": FILLER, "filler": FILLER}).encode()
    assert isinstance(verdict(wire_, body), tuple)
    assert msgspec_reads.calls == 1


@pytest.mark.parametrize("wire_", WIRES)
@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('"model": 5', "model: expected `str`, got `int`"),
        ('"max_tokens": -1', "max_tokens: expected `int` >= 0"),
        ('"max_tokens": 1.0', "max_tokens: expected `int | null`, got `float`"),
        ('"max_tokens": true', "max_tokens: expected `int | null`, got `bool`"),
        ('"stream": 1', "stream: expected `bool | null`, got `int`"),
        ('"messages": {}', "messages: expected `array`, got `object`"),
        ('"messages": null', "messages: expected `array`, got `null`"),
    ],
)
def test_a_field_of_another_type_gets_msgspecs_words(wire_: Wire, text: str, words: str) -> None:
    body = conversation(wire_, 300)[:-1] + b", " + text.encode() + b"}"
    assert verdict(wire_, body) == by_msgspec(wire_, body)
    assert str(verdict(wire_, body)).startswith(words)


@pytest.mark.parametrize("wire_", WIRES)
@pytest.mark.parametrize("at", [0, 150, 299])
@pytest.mark.parametrize("bad", ["1", '"hi"', "null", "[]", "true"])
def test_a_message_that_is_not_an_object_is_named(wire_: Wire, at: int, bad: str) -> None:
    data = json.loads(conversation(wire_, 300))
    data["messages"][at] = json.loads(bad)
    body = json.dumps(data, ensure_ascii=False).encode()
    got = verdict(wire_, body)
    assert got == by_msgspec(wire_, body)
    assert str(got).startswith(f"messages[{at}]: expected `object`")


@pytest.mark.parametrize("wire_", WIRES)
@pytest.mark.parametrize(
    "text",
    [
        '"model": "second"',  # msgspec keeps the last
        '"max_tokens": 7',
        '"stream": true',
        '"messages": [{"role": "user", "content": "the last"}]',
    ],
)
def test_a_key_given_twice_reads_as_msgspec_reads_it(
    wire_: Wire, text: str, msgspec_reads: Counted
) -> None:
    body = conversation(wire_, 300, stream=False)[:-1] + b", " + text.encode() + b"}"
    got = verdict(wire_, body)
    assert msgspec_reads.calls == 1  # left to msgspec
    assert got == by_msgspec(wire_, body)
    assert isinstance(got, tuple)


@pytest.mark.parametrize("wire_", WIRES)
def test_a_first_turn_with_a_key_twice_is_keyed_as_msgspec_keys_it(wire_: Wire) -> None:
    plain = conversation(wire_, 300)
    first = b'{"role": "user", "content": '
    body = plain.replace(first, first + b'1, "content": ', 1)
    assert body != plain
    assert verdict(wire_, body) == by_msgspec(wire_, body)
    twice = plain.replace(b'{"role": "user"', b'{"role": "assistant", "role": "user"', 1)
    assert verdict(wire_, twice) == by_msgspec(wire_, twice)
    metadata = plain.replace(b'{"user_id": "u-1"}', b'{"user_id": "u-1", "user_id": "u-2"}')
    assert verdict(wire_, metadata) == by_msgspec(wire_, metadata)


@pytest.mark.parametrize("wire_", WIRES)
@pytest.mark.parametrize(
    "content",
    [
        None,
        "",
        'with "quotes", a \\ and a\nnew line, é ☕',
        [{"type": "text", "text": "one"}, {"type": "text", "text": "two", "cache_control": {}}],
        [{"type": "image", "source": {"w": 1.0, "h": 2, "x": -0.0, "y": 1e300, "z": 2.5e-320}}],
        {"an": "object", "n": [1, 2.0, 18446744073709551615]},
        [],
        True,
        3.5,
    ],
)
def test_the_first_turns_hash_is_msgspecs(wire_: Wire, content: Any) -> None:
    data = json.loads(conversation(wire_, 300))
    data["messages"].insert(1, {"role": "user", "content": content})
    data["messages"][0]["role"] = "system"
    body = json.dumps(data, ensure_ascii=False).encode()
    assert verdict(wire_, body) == by_msgspec(wire_, body)


@pytest.mark.parametrize("wire_", WIRES)
def test_no_user_turn_and_no_messages(wire_: Wire) -> None:
    data = json.loads(conversation(wire_, 300))
    for message in data["messages"]:
        message["role"] = "assistant"
    no_user = json.dumps(data, ensure_ascii=False).encode()
    assert verdict(wire_, no_user) == by_msgspec(wire_, no_user)
    assert verdict(wire_, no_user)[7] is None  # type: ignore[index]
    del data["messages"]
    data["filler"] = FILLER
    none = json.dumps(data, ensure_ascii=False).encode()
    assert verdict(wire_, none) == by_msgspec(wire_, none)


@pytest.mark.parametrize(
    ("block", "thinks"),
    [
        ({"type": "thinking", "thinking": "hm", "signature": "sig"}, True),
        ({"type": "thinking", "thinking": "hm", "signature": ""}, False),
        ({"type": "redacted_thinking", "data": "x"}, True),
        ({"type": "text", "text": 'a "signature" in words'}, False),
    ],
)
def test_signed_thinking_is_found_in_a_body_read_by_simdjson(
    block: dict[str, Any], thinks: bool
) -> None:
    data = json.loads(conversation(Wire.ANTHROPIC, 300))
    data["messages"][201]["content"] = [block, {"type": "text", "text": "answer"}]
    body = json.dumps(data, ensure_ascii=False).encode()
    got = verdict(Wire.ANTHROPIC, body)
    assert got == by_msgspec(Wire.ANTHROPIC, body)
    assert got[8] is thinks  # type: ignore[index]
    chat = json.loads(conversation(Wire.OPENAI_CHAT, 300))
    chat["messages"][201]["content"] = [block]
    assert verdict(Wire.OPENAI_CHAT, json.dumps(chat).encode())[8] is False  # type: ignore[index]


def test_a_token_count_writes_nothing() -> None:
    body = conversation(Wire.ANTHROPIC, 300)
    got = verdict(Wire.ANTHROPIC, body, COUNT_TOKENS_PATH)
    assert got == by_msgspec(Wire.ANTHROPIC, body, COUNT_TOKENS_PATH)
    assert got[2] == 0  # type: ignore[index]
    assert got[6] is True  # type: ignore[index]


@pytest.mark.parametrize("wire_", WIRES)
@pytest.mark.parametrize("where", [0.01, 0.5, 0.999])
def test_a_body_not_utf8_is_refused_as_before(wire_: Wire, where: float) -> None:
    body = conversation(wire_, 300)
    at = body.rindex(b"\xc3", 0, int(len(body) * where))
    bad = body[:at] + b"\xc3\x28" + body[at + 2 :]
    assert verdict(wire_, bad) == "request body is not valid UTF-8"
    assert by_msgspec(wire_, bad) == "request body is not valid UTF-8"


@pytest.mark.parametrize("wire_", WIRES)
def test_a_body_that_is_not_json_gets_msgspecs_words(wire_: Wire) -> None:
    body = conversation(wire_, 300)
    for broken in (body[:-1], body + b"x", body.replace(b'"role"', b"'role'", 1)):
        got = verdict(wire_, broken)
        assert got == by_msgspec(wire_, broken)
        assert str(got).startswith("request body is not valid JSON: ")


def nested(wire_: Wire, depth: int, where: str) -> bytes:
    """A large body nested `depth` levels, its own object one, in a skipped field or inside
    the first user turn's content."""
    if where == "skipped":
        inner = depth - 1
        return (
            f'{{"model": "m", "filler": "{FILLER}", "x": '.encode()
            + b"[" * inner
            + b"]" * inner
            + b"}"
        )
    inner = depth - 3  # the body, its messages, the message
    return (
        f'{{"model": "m", "filler": "{FILLER}", "messages": [{{"role": "user", "content": '.encode()
        + b"[" * inner
        + b"]" * inner
        + b"}]}"
    )


def test_simdjson_stops_short_of_the_depth_msgspec_reads() -> None:
    pad = wire._simd_pad()
    deepest = simd_read.SIMD_MAX_DEPTH - pad  # the deepest body simdjson reads, wrapped
    assert deepest <= 1000
    # msgspec reads past it, by more than the level its own limit moves between threads
    assert wire._reads_nested(deepest + wire._NESTING_MARGIN // 2)
    for wire_ in WIRES:
        for where in ("skipped", "content"):
            for depth in range(deepest - 2, deepest + 3):
                body = nested(wire_, depth, where)
                answered = simd_read.read(body, chat=wire_ is Wire.OPENAI_CHAT, pad=pad)
                assert (answered is not None) is (depth <= deepest), (where, depth)
            assert on_fresh_stack(wire._read, wire_, nested(wire_, deepest, where))


@pytest.mark.parametrize("wire_", WIRES)
@pytest.mark.parametrize("where", ["skipped", "content"])
def test_a_body_nested_past_any_limit_is_refused_as_before(wire_: Wire, where: str) -> None:
    for depth in (1023, 1024, 1025, 1100):
        body = nested(wire_, depth, where)
        assert verdict(wire_, body) == "request body nests too deeply"


def test_the_parser_is_free_after_every_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy of the document that outlived the read would make the thread's next parse fail
    (simdjson refuses to parse again while one lives), and the UTF-8 check fall back to the
    decoder: after each kind of answer the next check is still simdjson's."""
    decoder = Counted(utf8._decoder_check)
    monkeypatch.setattr(utf8, "_decoder_check", decoder)
    body = conversation(Wire.ANTHROPIC, 300)
    bodies = [
        body,  # answered
        body[:-1] + b', "model": "twice"}',  # refused: a key twice
        body.replace(b'"messages": [', b'"messages": [1, ', 1),  # refused: a message
        body[:-1],  # not JSON
    ]
    for one in bodies:
        verdict(Wire.ANTHROPIC, one)
        verdict(Wire.ANTHROPIC, one)
        assert decoder.calls == 0, one[-40:]
        utf8.check_utf8('"é"'.encode())
        assert decoder.calls == 0


def test_without_pysimdjson_msgspec_reads_every_body(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(utf8, "_new_parser", lambda: None)
    monkeypatch.setattr(utf8, "_local", threading.local())
    body = conversation(Wire.OPENAI_CHAT, 300)
    assert simd_read.read(body, chat=True, pad=0) is None
    assert verdict(Wire.OPENAI_CHAT, body) == by_msgspec(Wire.OPENAI_CHAT, body)


def test_threads_read_at_once_each_with_its_own_parser() -> None:
    bodies = {wire_: conversation(wire_, 300) for wire_ in WIRES}
    expected = {wire_: by_msgspec(wire_, body) for wire_, body in bodies.items()}
    wrong: list[Any] = []

    def reader(wire_: Wire) -> None:
        for _ in range(30):
            got = verdict(wire_, bodies[wire_])
            if got != expected[wire_]:
                wrong.append(got)

    threads = [threading.Thread(target=reader, args=(WIRES[i % 2],)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


# --- any body: the same verdict as msgspec's read ------------------------------------------

_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 2**64),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["", "user", "assistant", "é ☕", 'a "q"\n']),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["a", "type", "text", "signature"]), inner, max_size=3),
    ),
    max_leaves=6,
)
_MESSAGE = st.one_of(
    st.lists(
        st.tuples(
            st.sampled_from(["role", "content", "name"]),
            st.one_of(st.sampled_from(["user", "assistant"]), _VALUES),
        ),
        max_size=4,
    ).map(lambda pairs: ("object", pairs)),
    _VALUES.map(lambda value: ("value", value)),
)
_KEYS = [
    "model",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "user",
    "safety_identifier",
    "metadata",
    "messages",
    "other",
]


def _text(value: Any) -> str:
    """JSON text of a value whose objects may hold a key twice: ("object", pairs)."""
    if isinstance(value, tuple) and value and value[0] == "object":
        return "{" + ", ".join(f"{json.dumps(k)}: {_text(v)}" for k, v in value[1]) + "}"
    if isinstance(value, tuple) and value and value[0] == "value":
        return _text(value[1])
    if isinstance(value, list):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


_FIELD_VALUES = {
    "model": st.one_of(st.just("m"), st.just("é-model"), _VALUES),
    "max_tokens": st.one_of(st.integers(-1, 2**64), _VALUES),
    "max_completion_tokens": st.one_of(st.integers(0, 9), _VALUES),
    "stream": _VALUES,
    "user": st.one_of(st.just("u"), _VALUES),
    "safety_identifier": st.one_of(st.just("s"), _VALUES),
    "metadata": st.one_of(
        st.lists(st.tuples(st.sampled_from(["user_id", "x"]), _VALUES), max_size=3).map(
            lambda pairs: ("object", pairs)
        ),
        _VALUES,
    ),
    "messages": st.one_of(st.lists(_MESSAGE, max_size=5), _VALUES),
    "other": _VALUES,
}


@st.composite
def _bodies(draw: st.DrawFn) -> bytes:
    keys = draw(st.lists(st.sampled_from(_KEYS), min_size=1, max_size=8))
    if draw(st.booleans()):
        keys = ["model", "messages", *keys]
    fields = [(key, draw(_FIELD_VALUES[key])) for key in keys]
    filler_at = draw(st.integers(0, len(fields)))
    fields.insert(filler_at, ("filler", FILLER))
    return ("{" + ", ".join(f"{json.dumps(k)}: {_text(v)}" for k, v in fields) + "}").encode()


@settings(max_examples=500, deadline=None)
@given(wire_=st.sampled_from(WIRES), body=_bodies())
def test_every_large_body_gets_msgspecs_verdict(wire_: Wire, body: bytes) -> None:
    assert len(body) >= simd_read.MIN_BYTES
    assert verdict(wire_, body) == by_msgspec(wire_, body)


_COUNTS = st.one_of(st.none(), st.integers(0, 2**64 - 1))
_NAMES = st.one_of(st.none(), st.sampled_from(["", "u", "é"]))
_BLOCK = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "thinking", "redacted_thinking", "image"])},
    optional={
        "text": st.sampled_from(["t", "é ☕", 'a "signature"']),
        "signature": st.sampled_from(["", "sig"]),
        "cache_control": st.just({"type": "ephemeral"}),
        "n": st.floats(allow_nan=False, allow_infinity=False),
    },
)
_GOOD_FIELDS = {
    "max_tokens": _COUNTS,
    "max_completion_tokens": _COUNTS,
    "stream": st.one_of(st.none(), st.booleans()),
    "user": _NAMES,
    "safety_identifier": _NAMES,
    "metadata": st.one_of(
        st.none(), st.fixed_dictionaries({}, optional={"user_id": _NAMES, "x": _VALUES})
    ),
    "messages": st.lists(
        st.fixed_dictionaries(
            {},
            optional={
                "role": st.one_of(st.sampled_from(["user", "assistant", "system"]), _VALUES),
                "content": st.one_of(st.text(max_size=8), st.lists(_BLOCK, max_size=3), _VALUES),
            },
        ),
        max_size=6,
    ),
    "other": _VALUES,
}


@st.composite
def _readable_bodies(draw: st.DrawFn) -> bytes:
    """Bodies msgspec reads, most of them: each key once, each field of its type."""
    keys = draw(st.lists(st.sampled_from(sorted(_GOOD_FIELDS)), unique=True))
    fields: list[tuple[str, Any]] = [("model", draw(st.sampled_from(["m", "é-model"])))]
    fields += [(key, draw(_GOOD_FIELDS[key])) for key in keys]
    fields.insert(draw(st.integers(0, len(fields))), ("filler", FILLER))
    return json.dumps(dict(fields), ensure_ascii=False).encode()


@settings(max_examples=500, deadline=None)
@given(wire_=st.sampled_from(WIRES), body=_readable_bodies())
def test_every_readable_large_body_gets_msgspecs_view(wire_: Wire, body: bytes) -> None:
    assert verdict(wire_, body) == by_msgspec(wire_, body)


def test_the_wrapping_buffer_is_reused_and_never_reads_an_older_bodys_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A body is wrapped for the nesting bound in one buffer per thread, written over: a body
    read after a larger one reads only its own bytes, and the buffer is not replaced."""
    monkeypatch.setattr(simd_read, "_local", threading.local())
    pad = wire._simd_pad()
    large, small = conversation(Wire.OPENAI_CHAT, 2400), conversation(Wire.OPENAI_CHAT, 60)
    for body in (large, small, large, small):
        assert verdict(Wire.OPENAI_CHAT, body) == by_msgspec(Wire.OPENAI_CHAT, body)
    held = simd_read._local.held
    assert held[0] == pad
    assert len(held[1]) == len(large) + 2 * pad
    assert verdict(Wire.OPENAI_CHAT, small[:-1]) == by_msgspec(Wire.OPENAI_CHAT, small[:-1])
    assert simd_read._local.held is held  # the same buffer, written over
    other = simd_read.read(small, chat=True, pad=pad + 1)  # another depth: a buffer of its own
    assert other == simd_read.read(small, chat=True, pad=pad)


def test_the_buffers_hold_at_most_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(simd_read, "_local", threading.local())
    pad = wire._simd_pad()
    body = conversation(Wire.ANTHROPIC, 300)
    over = body[:-1] + b', "x": "' + b"y" * (utf8.SIMD_MAX_BYTES - len(body)) + b'"}'
    assert len(over) + 2 * pad > utf8.SIMD_MAX_BYTES
    assert simd_read.read(over, chat=False, pad=pad) is None  # msgspec reads it
    assert not hasattr(simd_read._local, "held")
    assert verdict(Wire.ANTHROPIC, over) == by_msgspec(Wire.ANTHROPIC, over)


def test_a_body_is_wrapped_in_one_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wrapping a body writes its bytes into the thread's buffer once: no temporary of the
    body's size on the way (a `bytearray` slice given `bytes` copies them into a new
    bytearray first; a large body would pay for two copies, and the second's allocation)."""
    monkeypatch.setattr(simd_read, "_local", threading.local())
    pad = wire._simd_pad()
    body = conversation(Wire.ANTHROPIC, 600)
    assert len(body) > 100_000
    with simd_read._wrapped(body, pad):  # the buffer made once, at its size
        pass
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        with simd_read._wrapped(body, pad) as wrapped:
            _, peak = tracemalloc.get_traced_memory()
            assert bytes(wrapped[pad:-pad]) == body
            assert bytes(wrapped[:pad]) == b"[" * pad
            assert bytes(wrapped[-pad:]) == b"]" * pad
    finally:
        tracemalloc.stop()
    assert peak - before < len(body) // 2, peak - before
