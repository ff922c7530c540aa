"""A stream's first content event and its output rate: the sans-IO pieces both fronts share
(`engine.content_events`, `engine.stream_bounds`)."""

from __future__ import annotations

import json

import pytest

from switchyard_mw.engine.content_events import BYTES_PER_TOKEN, ContentWatch, watch_for
from switchyard_mw.engine.stream_bounds import ThroughputFloor, first_token_secs, floor_for
from switchyard_mw.wire import Wire


def sse(event: dict[str, object], name: str | None = None) -> bytes:
    head = b"" if name is None else f"event: {name}\n".encode()
    return head + b"data: " + json.dumps(event).encode() + b"\n\n"


A, CHAT, RESP = Wire.ANTHROPIC, Wire.OPENAI_CHAT, Wire.OPENAI_RESPONSES


# (wire, event, is it content): every event type the official SDKs name that opens a stream,
# and each kind of output.
def start(block: dict[str, object]) -> dict[str, object]:
    return {"type": "content_block_start", "index": 0, "content_block": block}


def delta(kind: str, **fields: object) -> dict[str, object]:
    return {"type": "content_block_delta", "index": 0, "delta": {"type": kind, **fields}}


def chat(**fields: object) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": fields}]}


def item(kind: str, **fields: object) -> dict[str, object]:
    return {"type": "response.output_item.added", "item": {"type": kind, **fields}}


def resp(kind: str, **fields: object) -> dict[str, object]:
    return {"type": f"response.{kind}", **fields}


CALL = [{"index": 0, "id": "c", "function": {"name": "f", "arguments": ""}}]
EVENTS: list[tuple[Wire, dict[str, object], bool]] = [
    (A, {"type": "message_start", "message": {"usage": {"output_tokens": 1}}}, False),
    (A, {"type": "ping"}, False),
    (A, start({"type": "text", "text": ""}), False),
    (A, start({"type": "thinking", "thinking": ""}), False),
    (A, start({"type": "tool_use", "id": "t", "name": "f", "input": {}}), True),
    (A, start({"type": "server_tool_use", "id": "t", "name": "web_search", "input": {}}), True),
    (A, delta("text_delta", text="Hi"), True),
    (A, delta("thinking_delta", thinking="Hm"), True),
    (A, delta("input_json_delta", partial_json='{"a'), True),
    (A, delta("signature_delta", signature="x"), False),
    (A, {"type": "content_block_stop", "index": 0}, False),
    (A, {"type": "message_delta", "delta": {}, "usage": {"output_tokens": 5}}, False),
    (A, {"type": "message_stop"}, False),
    (A, {"type": "error", "error": {"type": "overloaded_error", "message": "x"}}, False),
    (CHAT, chat(role="assistant", content=""), False),
    (CHAT, chat(role="assistant"), False),
    (CHAT, chat(content="Hi"), True),
    (CHAT, chat(reasoning_content="Hm"), True),
    (CHAT, chat(refusal="No"), True),
    (CHAT, chat(tool_calls=CALL), True),
    (CHAT, {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}, False),
    (CHAT, {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}, False),
    (RESP, resp("created", response={"usage": None}), False),
    (RESP, resp("in_progress", response={"usage": None}), False),
    (RESP, item("message"), False),
    (RESP, item("reasoning"), False),
    (RESP, resp("content_part.added", part={"type": "output_text", "text": ""}), False),
    (RESP, item("function_call", name="f"), True),
    (RESP, resp("output_text.delta", delta="Hi"), True),
    (RESP, resp("reasoning_summary_text.delta", delta="Hm"), True),
    (RESP, resp("reasoning_text.delta", delta="Hm"), True),
    (RESP, resp("function_call_arguments.delta", delta="{"), True),
    (RESP, resp("refusal.delta", delta="No"), True),
    (RESP, resp("output_text.done", text="Hi"), False),
    (RESP, resp("completed", response={"usage": {"output_tokens": 2}}), False),
    (RESP, {"type": "error", "code": "server_error", "message": "x"}, False),
    (CHAT, {"error": {"type": "server_error", "message": "x"}}, False),
    # Events not known here are content: a newer API's stream is never taken for silence.
    (A, {"type": "a_newer_event"}, True),
    (CHAT, {"id": "x", "object": "something.new"}, True),
    (RESP, resp("newer.event"), True),
]


@pytest.mark.parametrize(("wire", "event", "content"), EVENTS)
def test_which_events_are_content(wire: Wire, event: dict[str, object], content: bool) -> None:
    watch = ContentWatch(wire)
    assert watch.feed(sse(event)) is content
    assert watch.started is content


@pytest.mark.parametrize("wire", [A, CHAT, RESP])
def test_an_event_cut_anywhere_is_seen_once_whole(wire: Wire) -> None:
    opening = b"".join(sse(e) for w, e, content in EVENTS if w is wire and not content)
    first = next(sse(e) for w, e, content in EVENTS if w is wire and content)
    stream = opening + first
    for cut in range(1, len(stream)):
        watch = ContentWatch(wire)
        seen = [watch.feed(stream[:cut]), watch.feed(stream[cut:])]
        assert seen.count(True) == 1
        assert seen[0] is (cut > len(opening) + len(first) - 2)  # its data line was whole
        assert watch.started


@pytest.mark.parametrize("wire", [A, CHAT, RESP])
def test_data_that_is_not_the_wires_json_is_content_but_done_is_not(wire: Wire) -> None:
    assert ContentWatch(wire).feed(b"data: [DONE]\n\n") is False
    assert ContentWatch(wire).feed(b": a comment\nevent: a\n\n") is False  # no data line
    assert ContentWatch(wire).feed(b"event: a\ndata: 0\n\n") is True
    assert ContentWatch(wire).feed(b"data: {not json\n\n") is True


def test_a_wire_with_no_known_events_has_no_watch() -> None:
    assert watch_for(Wire.GENERIC) is None
    assert watch_for(None) is None
    assert isinstance(watch_for(Wire.ANTHROPIC), ContentWatch)


def test_output_is_estimated_from_content_until_the_stream_counts_it() -> None:
    watch = ContentWatch(A)
    text = "x" * 40
    watch.feed(sse(delta("text_delta", text=text)))
    assert watch.output_tokens == 40 / BYTES_PER_TOKEN
    watch.feed(
        sse({"type": "content_block_delta", "delta": {"type": "thinking_delta", "thinking": text}})
    )
    assert watch.output_tokens == 80 / BYTES_PER_TOKEN  # thinking is output too
    watch.feed(sse({"type": "message_delta", "usage": {"output_tokens": 33}}))
    assert watch.output_tokens == 33  # the stream's own count wins
    counted = ContentWatch(CHAT)
    counted.feed(sse({**chat(content=text), "usage": {"completion_tokens": 7}}))
    assert counted.output_tokens == 7


def test_first_token_secs_defaults_to_timeout_secs() -> None:
    class Limits:
        timeout_secs = 12.0
        first_token_secs: float | None = None

    limits = Limits()
    assert first_token_secs(limits) == 12.0
    limits.first_token_secs = 0.5
    assert first_token_secs(limits) == 0.5
    assert floor_for(limits, 0.0) is None  # no floor unless one is set


def test_the_floor_is_one_window_after_the_rate_fell_short() -> None:
    # 2 tokens/s over 10 s: 20 tokens a window.
    floor = ThroughputFloor(2.0, 10.0, started_at=100.0)
    # Nothing more than a first token: slow one window after the start.
    assert floor.note(100.0, 1.0) == 110.0
    # A steady 3 tokens/s keeps it ahead: each sample moves the time on.
    tokens = 1.0
    for second in range(1, 31):
        tokens += 3.0
        slow_at = floor.note(100.0 + second, tokens)
        # With nothing more after now, the window ending at slow_at holds less than 20.
        assert slow_at > 100.0 + second
    # Output stops at 130 s: slow once the last 20 tokens' window has passed them by.
    assert 130.0 < slow_at <= 140.0
    assert floor.note(135.0, tokens) == slow_at
    assert len(floor._samples) <= 12  # about one window of samples kept


def test_the_floor_at_its_exact_boundary() -> None:
    floor = ThroughputFloor(1.0, 4.0, started_at=0.0)
    # 4 tokens in the first window: exactly the floor, not below it.
    for second in (1, 2, 3, 4):
        slow_at = floor.note(float(second), float(second))
    # output(t) - output(t - 4) drops below 4 once the sample of second 1 leaves the window.
    assert slow_at == 5.0
