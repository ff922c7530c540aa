"""Token usage read from answers' bytes (`engine.usage`): each wire's JSON answer and stream,
events cut anywhere, garbage, and bodies far larger than what is kept."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from switchyard_mw.engine.usage import (
    WINDOW,
    AnswerUsage,
    StreamUsage,
    Tokens,
    answer_tokens,
)
from switchyard_mw.testing import _anthropic_replies, _chat_replies, _responses_replies
from switchyard_mw.testing._replies import ReplyContext
from switchyard_mw.wire import Wire
from usage_streams import ANTHROPIC_STREAM, CHAT_STREAM, RESPONSES_STREAM

STREAMS = [
    (Wire.ANTHROPIC, ANTHROPIC_STREAM, Tokens(15, 42, cache_read=5)),
    (Wire.OPENAI_CHAT, CHAT_STREAM, Tokens(7, 3)),
    (Wire.OPENAI_RESPONSES, RESPONSES_STREAM, Tokens(8, 9)),
]
IDS = ["anthropic", "chat", "responses"]


def read_stream(wire: Wire, pieces: list[bytes]) -> Tokens | None:
    usage = StreamUsage(wire)
    for piece in pieces:
        usage.feed(piece)
        assert usage.held <= WINDOW
    return usage.end()


@pytest.mark.parametrize(("wire", "stream", "expected"), STREAMS, ids=IDS)
def test_each_wires_stream_fed_event_by_event(wire: Wire, stream: bytes, expected: Tokens) -> None:
    events = [e + b"\n\n" for e in stream.split(b"\n\n") if e]
    assert read_stream(wire, events) == expected


@pytest.mark.parametrize(("wire", "stream", "expected"), STREAMS, ids=IDS)
def test_an_event_cut_at_any_byte_is_joined(wire: Wire, stream: bytes, expected: Tokens) -> None:
    for cut in range(1, len(stream)):
        assert read_stream(wire, [stream[:cut], stream[cut:]]) == expected, cut


@pytest.mark.parametrize(("wire", "stream", "expected"), STREAMS, ids=IDS)
def test_a_stream_fed_byte_by_byte_or_in_random_pieces(
    wire: Wire, stream: bytes, expected: Tokens
) -> None:
    assert read_stream(wire, [stream[i : i + 1] for i in range(len(stream))]) == expected
    rng = random.Random(7)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(stream)), 5))
        pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
        assert read_stream(wire, pieces) == expected


def test_crlf_line_ends_and_a_last_line_without_newline() -> None:
    stream = CHAT_STREAM.replace(b"\n", b"\r\n").rstrip(b"\r\n").replace(b"data: [DONE]", b"")
    assert read_stream(Wire.OPENAI_CHAT, [stream.rstrip()]) == Tokens(7, 3)


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x00\xff" * 1000,
        b'data: {"usage": "not an object"}\n\n',
        b'data: {"usage": {"input_tokens": "many"}}\n\n',
        b'data: {"usage": {"input_tokens": 3\n\n',  # cut off
        b'data: "usage"\n\ndata: [1, 2, "usage"]\n\n',
        b"<html>usage</html>",
        b'{"usage":{"prompt_tokens":1}}\n\n',  # not a data line
        b"",
    ],
)
def test_garbage_reports_nothing_and_never_raises(garbage: bytes) -> None:
    assert read_stream(Wire.OPENAI_CHAT, [garbage]) is None
    pieces = [garbage[i : i + 3] for i in range(0, len(garbage), 3)]
    assert read_stream(Wire.OPENAI_CHAT, pieces) is None


def test_a_huge_completed_event_is_read_from_its_tail_with_bounded_memory() -> None:
    # `response.completed` repeats the whole answer: 4 MiB of text, with braces and quotes.
    text = ('a "quoted" {brace} \\ ' * 200_000)[: 4 << 20]
    event = {
        "type": "response.completed",
        "response": {
            "output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}],
            "usage": {"input_tokens": 1234, "output_tokens": 98765, "input_tokens_details": {}},
            "metadata": {"k": "v"},
        },
    }
    data = b"event: response.completed\ndata: " + json.dumps(event).encode() + b"\n\n"
    pieces = [data[i : i + 16384] for i in range(0, len(data), 16384)]
    assert read_stream(Wire.OPENAI_RESPONSES, pieces) == Tokens(1234, 98765)


def test_an_endless_line_is_held_only_up_to_the_window() -> None:
    usage = StreamUsage(Wire.ANTHROPIC)
    for _ in range(1000):  # 16 MiB, never a newline
        usage.feed(b"x" * 16384)
        assert usage.held <= WINDOW
    assert usage.end() is None
    assert usage.held == 0


ANSWERS = [
    (
        Wire.ANTHROPIC,
        {"usage": {"input_tokens": 10, "output_tokens": 5, "cache_read_input_tokens": 90}},
        Tokens(100, 5, cache_read=90),
    ),
    (
        Wire.OPENAI_CHAT,
        {"usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}},
        Tokens(12, 3),
    ),
    (Wire.OPENAI_RESPONSES, {"usage": {"input_tokens": 7, "output_tokens": 2}}, Tokens(7, 2)),
    (Wire.ANTHROPIC, {"usage": {"input_tokens": "many"}}, None),
    (Wire.ANTHROPIC, {"id": "no usage"}, None),
]


@pytest.mark.parametrize(("wire", "answer", "expected"), ANSWERS)
def test_a_json_answer_whole_or_in_pieces(
    wire: Wire, answer: dict[str, object], expected: Tokens | None
) -> None:
    body = json.dumps(answer).encode()
    assert answer_tokens(wire, body) == expected
    usage = AnswerUsage(wire)
    for i in range(0, len(body), 7):
        usage.feed(body[i : i + 7])
    assert usage.end() == expected


@pytest.mark.parametrize("body", [b"", b"not json", b"[1,2]", b'{"usage": 3}', b"\xff" * 100])
def test_a_body_that_is_not_a_json_answer_reports_nothing(body: bytes) -> None:
    assert answer_tokens(Wire.OPENAI_CHAT, body) is None
    usage = AnswerUsage(Wire.OPENAI_CHAT)
    usage.feed(body)
    assert usage.end() is None


def test_a_huge_json_answer_is_read_from_its_tail_with_bounded_memory() -> None:
    # A tool's input may hold a "usage" key of its own: the answer's own usage comes last.
    answer = {
        "content": [
            {"type": "tool_use", "input": {"usage": {"input_tokens": 1, "output_tokens": 1}}},
            {"type": "text", "text": '"usage": {"input_tokens": 2} ' * 200_000},
        ],
        "usage": {"input_tokens": 321, "output_tokens": 654},
    }
    body = json.dumps(answer).encode()
    assert len(body) > 50 * WINDOW
    usage = AnswerUsage(Wire.ANTHROPIC)
    for i in range(0, len(body), 10_000):
        usage.feed(body[i : i + 10_000])
        assert usage.held <= WINDOW
    assert usage.end() == Tokens(321, 654)


@pytest.mark.parametrize(
    ("wire", "replies", "expected"),
    [
        (Wire.ANTHROPIC, _anthropic_replies, (100, 60, 30)),
        (Wire.OPENAI_CHAT, _chat_replies, (100, 60, None)),
        (Wire.OPENAI_RESPONSES, _responses_replies, (100, 60, None)),
    ],
    ids=IDS,
)
def test_cache_reads_and_writes_are_read_from_answers_and_streams(
    wire: Wire, replies: Any, expected: tuple[int, int, int | None]
) -> None:
    ctx = ReplyContext(
        model="m",
        text="hi",
        parts=("hi",),
        input_tokens=10,  # neither read from nor written to the cache
        output_tokens=5,
        include_usage=True,
        cache_read_tokens=60,
        cache_write_tokens=30,
    )
    inputs, read, written = expected
    want = Tokens(inputs, 5, read, written)
    assert answer_tokens(wire, replies.reply(ctx)) == want
    plan = replies.stream(ctx)
    assert read_stream(wire, [plan.prelude, *plan.deltas, plan.epilogue]) == want
