"""Resumed OpenAI Chat streams: the continuation request, the splice, and the SDK reading it."""

from __future__ import annotations

from typing import Any

import httpx2
import openai
import pytest

from switchyard_mw.asgi.resume_chat import DONE, ChatSplice, continuation_request, encode
from switchyard_mw.asgi.resume_refusal import ResumeRefusal

Chunk = dict[str, Any]


def chunk(cid: str, delta: Chunk, finish: str | None = None) -> Chunk:
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": 1700000000 if cid == "a" else 1700000099,
        "model": "gpt-4o" if cid == "a" else "gpt-4o-2024-08-06",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def usage_chunk(cid: str, prompt: int, completion: int) -> Chunk:
    c = chunk(cid, {})
    c["choices"] = []
    c["usage"] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    return c


SENT = [
    chunk("a", {"role": "assistant", "content": ""}),
    chunk("a", {"content": "The quick "}),
    chunk("a", {"content": "brown fox"}),
]
CONTINUATION = [
    chunk("b", {"role": "assistant", "content": ""}),
    chunk("b", {"content": " jumps over the lazy dog."}),
    chunk("b", {}, "stop"),
    usage_chunk("b", 30, 7),
]
REQUEST: Chunk = {
    "model": "gpt-4o",
    "stream": True,
    "messages": [{"role": "user", "content": "Say the pangram."}],
}


def test_the_splice_keeps_the_first_id_and_sums_usage() -> None:
    s = ChatSplice(SENT)
    out = [s.feed(c) for c in CONTINUATION]
    assert {(c["id"], c["created"], c["model"]) for c in out} == {("a", 1700000000, "gpt-4o")}
    assert out[0]["choices"][0]["delta"] == {"content": ""}  # no second role
    assert out[-1]["usage"] == {"completion_tokens": 7, "prompt_tokens": 30, "total_tokens": 37}
    s2 = ChatSplice([*SENT, usage_chunk("a", 10, 3)])
    assert s2.feed(usage_chunk("b", 30, 7))["usage"] == {
        "completion_tokens": 10,
        "prompt_tokens": 40,
        "total_tokens": 50,
    }


@pytest.mark.parametrize(
    ("sent", "result"),
    [
        ([], ResumeRefusal.NOT_STARTED),
        (
            [
                *SENT,
                chunk("a", {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f"}}]}),
            ],
            ResumeRefusal.TOOL_USE,
        ),
        (SENT, [*REQUEST["messages"], {"role": "assistant", "content": "The quick brown fox"}]),
        (SENT[:1], REQUEST["messages"]),
    ],
)
def test_continuation_request(sent: list[Chunk], result: Any) -> None:
    built = continuation_request(REQUEST, sent)
    if isinstance(result, ResumeRefusal):
        assert built is result
        with pytest.raises(ValueError, match=result.value):
            ChatSplice(sent)
    else:
        assert isinstance(built, dict)
        assert built == {**REQUEST, "messages": result}


def test_the_official_sdk_reads_one_answer() -> None:
    s = ChatSplice(SENT)
    body = b"".join(encode(c) for c in [*SENT, *(s.feed(c) for c in CONTINUATION)]) + DONE

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    client = openai.OpenAI(
        api_key="test",
        base_url="http://127.0.0.1/v1",
        http_client=openai.DefaultHttpxClient(transport=httpx2.MockTransport(handler)),
    )
    request = {k: v for k, v in REQUEST.items() if k != "stream"}
    with client.chat.completions.stream(
        **request, stream_options={"include_usage": True}
    ) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "content.delta")
        final = stream.get_final_completion()
    expected = "The quick brown fox jumps over the lazy dog."
    assert deltas == expected
    assert final.id == "a"
    assert final.choices[0].message.content == expected
    assert final.choices[0].finish_reason == "stop"
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (30, 7)
