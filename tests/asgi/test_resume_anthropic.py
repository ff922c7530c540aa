"""Resumed Anthropic streams: the continuation request, the splice, and the SDK reading it."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx2
import pytest

from switchyard_mw.asgi.resume_anthropic import (
    AnthropicSplice,
    ResumeRefusal,
    continuation_request,
    encode,
    refusal,
)

Event = dict[str, Any]


def message_start(input_tokens: int, output_tokens: int = 1) -> Event:
    return {
        "type": "message_start",
        "message": {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "claude-sonnet-4-5",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
        },
    }


def block_start(index: int, block: Event) -> Event:
    return {"type": "content_block_start", "index": index, "content_block": block}


def text_start(index: int) -> Event:
    return block_start(index, {"type": "text", "text": ""})


def text(index: int, chunk: str) -> Event:
    return {
        "type": "content_block_delta",
        "index": index,
        "delta": {"type": "text_delta", "text": chunk},
    }


def stop(index: int) -> Event:
    return {"type": "content_block_stop", "index": index}


def message_delta(output_tokens: int) -> Event:
    return {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {"output_tokens": output_tokens},
    }


def tool_start(index: int) -> Event:
    return block_start(index, {"type": "tool_use", "id": "toolu_1", "name": "get", "input": {}})


def thinking_start(index: int) -> Event:
    return block_start(index, {"type": "thinking", "thinking": "", "signature": ""})


MESSAGE_STOP: Event = {"type": "message_stop"}

CUT_IN_TEXT = [message_start(10), text_start(0), text(0, "The quick brown "), text(0, "fox")]

CONTINUATION = [
    message_start(25),
    text_start(0),
    text(0, " jumps over"),
    text(0, " the lazy dog."),
    stop(0),
    message_delta(6),
    MESSAGE_STOP,
]

REQUEST: Event = {
    "model": "claude-sonnet-4-5",
    "max_tokens": 100,
    "stream": True,
    "messages": [{"role": "user", "content": "Say the pangram."}],
}


def splice(sent: list[Event], continuation: list[Event]) -> list[Event]:
    s = AnthropicSplice(sent)
    return [out for event in continuation for out in s.feed(event)]


def test_a_cut_inside_text_merges_into_the_open_block() -> None:
    assert splice(CUT_IN_TEXT, CONTINUATION) == [
        text(0, " jumps over"),
        text(0, " the lazy dog."),
        stop(0),
        {**message_delta(0), "usage": {"input_tokens": 35, "output_tokens": 7}},
        MESSAGE_STOP,
    ]


def test_a_continuation_without_blocks_still_closes_the_open_one() -> None:
    out = splice(CUT_IN_TEXT, [message_start(25), message_delta(1), MESSAGE_STOP])
    assert out == [
        stop(0),
        {**message_delta(0), "usage": {"input_tokens": 35, "output_tokens": 2}},
        MESSAGE_STOP,
    ]


def test_a_cut_between_blocks_continues_the_indices() -> None:
    sent = [message_start(10), text_start(0), text(0, "Part one."), stop(0)]
    out = splice(sent, CONTINUATION)
    assert out[0] == text_start(1)
    assert [e["index"] for e in out if "index" in e] == [1, 1, 1, 1]


def test_a_continuation_that_opens_with_a_tool_call_closes_the_open_text_first() -> None:
    continuation = [
        message_start(25),
        tool_start(0),
        stop(0),
        text_start(1),
        text(1, "ok"),
        stop(1),
    ]
    out = splice(CUT_IN_TEXT, continuation)
    assert out == [stop(0), tool_start(1), stop(1), text_start(2), text(2, "ok"), stop(2)]


@pytest.mark.parametrize(
    ("sent_text", "first_chunk", "sent_to_client"),
    [
        ("fox ", " jumps", "jumps"),  # the client has the space: the model's repeat is dropped
        ("fox ", "   ", None),  # whitespace only: nothing to send yet ...
        ("fox", " jumps", " jumps"),  # no whitespace at the cut: kept as the model wrote it
        ("fox\n", "\nNext", "Next"),
    ],
)
def test_whitespace_at_the_seam(
    sent_text: str, first_chunk: str, sent_to_client: str | None
) -> None:
    s = AnthropicSplice([message_start(10), text_start(0), text(0, sent_text)])
    assert s.feed(message_start(5)) == []
    assert s.feed(text_start(0)) == []
    out = s.feed(text(0, first_chunk))
    assert out == ([] if sent_to_client is None else [text(0, sent_to_client)])


def test_whitespace_is_trimmed_only_until_text_arrives() -> None:
    s = AnthropicSplice([message_start(10), text_start(0), text(0, "fox ")])
    s.feed(text_start(0))
    assert s.feed(text(0, "  ")) == []
    assert s.feed(text(0, " a b")) == [text(0, "a b")]
    assert s.feed(text(0, " c")) == [text(0, " c")]


def test_usage_sums_every_field_both_parts_report() -> None:
    first = message_start(10, 1)
    first["message"]["usage"]["cache_read_input_tokens"] = 4
    s = AnthropicSplice([first, text_start(0), text(0, "a")])
    s.feed(message_start(20, 1))
    *_, delta = s.feed(message_delta(9))
    assert delta["usage"] == {"cache_read_input_tokens": 4, "input_tokens": 30, "output_tokens": 10}


def test_pings_and_errors_pass_through() -> None:
    ping = {"type": "ping"}
    error = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    assert splice(CUT_IN_TEXT, [ping, error]) == [ping, error]


@pytest.mark.parametrize(
    ("sent", "why"),
    [
        ([], ResumeRefusal.NOT_STARTED),
        ([message_start(1), thinking_start(0)], ResumeRefusal.SIGNED_THINKING),
        (
            [message_start(1), thinking_start(0), stop(0), text_start(1)],
            ResumeRefusal.SIGNED_THINKING,
        ),
        ([message_start(1), tool_start(0)], ResumeRefusal.TOOL_USE),  # in progress
        (
            [message_start(1), text_start(0), stop(0), tool_start(1), stop(1)],
            ResumeRefusal.TOOL_USE,
        ),
        (CUT_IN_TEXT, None),
    ],
)
def test_refusals_are_named(sent: list[Event], why: ResumeRefusal | None) -> None:
    assert refusal(sent) is why
    built = continuation_request(REQUEST, sent)
    assert built is why if why is not None else isinstance(built, dict)
    if why is not None:
        with pytest.raises(ValueError, match=why.value):
            AnthropicSplice(sent)


@pytest.mark.parametrize(
    ("messages", "sent", "last"),
    [
        (  # the partial text becomes a trailing assistant turn, trailing whitespace dropped
            REQUEST["messages"],
            [message_start(1), text_start(0), text(0, "The quick "), text(0, "brown ")],
            {"role": "assistant", "content": [{"type": "text", "text": "The quick brown"}]},
        ),
        (  # the client's own prefill is continued, not replaced
            [*REQUEST["messages"], {"role": "assistant", "content": "Here:"}],
            [message_start(1), text_start(0), text(0, " The quick")],
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Here:"},
                    {"type": "text", "text": " The quick"},
                ],
            },
        ),
        (  # nothing but message_start reached the client: the request as it was
            REQUEST["messages"],
            [message_start(1), text_start(0)],
            REQUEST["messages"][-1],
        ),
    ],
)
def test_continuation_request(messages: list[Event], sent: list[Event], last: Event) -> None:
    request = {**REQUEST, "messages": messages}
    built = continuation_request(request, sent)
    assert isinstance(built, dict)
    assert built["messages"][-1] == last
    assert built["messages"][:-1] == messages[: len(built["messages"]) - 1]
    assert {k: v for k, v in built.items() if k != "messages"} == {
        k: v for k, v in REQUEST.items() if k != "messages"
    }
    assert request["messages"] is messages  # the caller's request is left as it was


def sdk_client(body: bytes) -> anthropic.Anthropic:
    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    return anthropic.Anthropic(
        api_key="test",
        base_url="http://127.0.0.1",
        http_client=anthropic.DefaultHttpxClient(transport=httpx2.MockTransport(handler)),
    )


def sdk_read(body: bytes) -> tuple[str, anthropic.types.Message]:
    client = sdk_client(body)
    with client.messages.stream(**{k: v for k, v in REQUEST.items() if k != "stream"}) as stream:
        streamed = "".join(stream.text_stream)
        return streamed, stream.get_final_message()


@pytest.mark.parametrize(
    ("sent", "blocks"),
    [
        (CUT_IN_TEXT, ["The quick brown fox jumps over the lazy dog."]),
        (
            [message_start(10), text_start(0), text(0, "The quick brown fox"), stop(0)],
            ["The quick brown fox", " jumps over the lazy dog."],
        ),
    ],
)
def test_the_official_sdk_reads_one_answer(sent: list[Event], blocks: list[str]) -> None:
    streamed, final = sdk_read(b"".join(encode(e) for e in [*sent, *splice(sent, CONTINUATION)]))
    assert streamed == "The quick brown fox jumps over the lazy dog."
    assert [b.text for b in final.content if b.type == "text"] == blocks
    assert len(final.content) == len(blocks)
    assert (final.usage.input_tokens, final.usage.output_tokens) == (35, 7)
    assert final.stop_reason == "end_turn"


def test_without_the_splice_the_sdk_reads_a_broken_answer() -> None:
    # What the splice is for: the raw concatenation parses, but into a stray empty block and
    # the second part's usage only.
    _, final = sdk_read(b"".join(encode(e) for e in [*CUT_IN_TEXT, *CONTINUATION]))
    assert len(final.content) == 2
    assert (final.usage.input_tokens, final.usage.output_tokens) == (10, 6)
