"""Resumed streams (`resume_streams = true`) through the example gateway under uvicorn, read
with the official SDKs: a stream cut after 40 events, stalled past its idle bound, or under its
throughput floor is continued on account `b` with the partial answer as a prefill, and the SDK's
accumulated text is the first part followed by the continuation, parsed without error. A
continuation that `b` refuses (a 400, as a model that takes no prefill answers), one that
breaks too, and a Chat stream no account may continue end the client's stream with the error
event of the original break.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from servers import example_gateway, serve_in_thread
from switchyard_mw.testing import DEFAULT_REPLY, Behaviour, MockProvider
from switchyard_mw.testing._tool_calls import split_text

pytestmark = pytest.mark.integration

ENV = {"KEY_A": "key-a", "KEY_B": "key-b", "KEY_C": "key-c", "KEY_S": "key-s"}
QUESTION: Any = [{"role": "user", "content": "Tell me a story."}]
FIRST = (
    "Once upon a time, a fox met a crow in the forest at dawn. The crow held a piece of "
    "cheese in its beak, and the fox wanted it."
)
CONTINUED = " The crow sang, and the fox listened."
CHUNKS, CUT_AFTER = 48, 40  # the stream breaks after 40 text deltas (the figure)
PARTIAL = "".join(split_text(FIRST, CHUNKS)[:CUT_AFTER])


def config(mock_url: str) -> str:
    # `a` is preferred; its faults never cool it here (each test breaks it once).
    return f"""
[server]
resume_streams = true

[llm_clients.a]
base_url = "{mock_url}"
api_key_env = "KEY_A"
auth = "x-api-key"
models = ["claude-x", "gpt-x", "gpt-y"]
stream_idle_secs = 0.5
failure_threshold = 100

# `c` serves gpt-y on Chat without saying it takes a prefill: never given a continuation.
[llm_clients.c]
base_url = "{mock_url}"
api_key_env = "KEY_C"
auth = "x-api-key"
models = ["gpt-y"]
priority = 1

# `s` trickles claude-slow's streams: under its floor they end as `slow`.
[llm_clients.s]
base_url = "{mock_url}"
api_key_env = "KEY_S"
auth = "x-api-key"
models = ["claude-slow"]
min_tokens_per_sec = 20
throughput_window_secs = 0.5
failure_threshold = 100

[llm_clients.b]
base_url = "{mock_url}"
api_key_env = "KEY_B"
auth = "x-api-key"
models = ["claude-x", "gpt-x", "claude-slow"]
priority = 1
failure_threshold = 100
accepts_prefill = true
"""


@pytest.fixture(scope="module")
def mock() -> Iterator[tuple[MockProvider, str]]:
    provider = MockProvider()
    with serve_in_thread(provider) as url:
        yield provider, url


@pytest.fixture(scope="module")
def gateway(
    mock: tuple[MockProvider, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    with example_gateway(config(mock[1]), tmp_path_factory.mktemp("gw"), ENV) as url:
        yield url


@pytest.fixture
def provider(mock: tuple[MockProvider, str]) -> Iterator[MockProvider]:
    mock[0].reset()
    yield mock[0]
    mock[0].reset()


def cut(**extra: Any) -> Behaviour:
    """`a`'s stream: CUT_AFTER of its CHUNKS deltas, then the connection is reset."""
    return Behaviour(
        reply=FIRST, chunks=CHUNKS, stall_after_chunks=CUT_AFTER, fail="reset_mid_stream", **extra
    )


def claude(gateway: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gateway, api_key="caller", max_retries=0)


async def story(
    client: anthropic.AsyncAnthropic, into: list[str], model: str = "claude-x"
) -> anthropic.types.Message:
    """Stream the story into `into` as its text comes; the final message."""
    async with client.messages.stream(model=model, max_tokens=200, messages=QUESTION) as s:
        async for chunk in s.text_stream:
            into.append(chunk)
        return await s.get_final_message()


async def drain(stream: Any, into: list[str]) -> None:
    """Read a Chat stream's text into `into` until it ends or raises."""
    async for chunk in stream:
        into.extend(c.delta.content or "" for c in chunk.choices)


def resumes(gateway: str, result: str, model: str = "claude-x", reason: str = "cut") -> float:
    """`switchyard_resumes_total` of `model`'s streams broken by `reason`, ending in `result`,
    on /metrics."""
    text = httpx.get(gateway + "/metrics").text
    wanted = (f'result="{result}"', f'gen_ai_response_model="{model}"', f'reason="{reason}"')
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("switchyard_resumes_total{") and all(w in line for w in wanted)
    )


def prefill_of(provider: MockProvider) -> Any:
    """The continuation request's last message, as `b` received it."""
    continued = [r for r in provider.requests if r.key == "key-b"]
    assert len(continued) == 1
    return json.loads(continued[0].body)["messages"][-1]


async def test_a_cut_anthropic_stream_is_continued_on_another_account(
    gateway: str, provider: MockProvider
) -> None:
    provider.set_behaviour("key-a", cut())
    provider.set_behaviour("key-b", Behaviour(reply=CONTINUED, chunks=2))
    before = resumes(gateway, "resumed")
    text: list[str] = []
    async with claude(gateway) as client:
        final = await story(client, text)
    assert resumes(gateway, "resumed") == before + 1
    assert "".join(text) == PARTIAL + CONTINUED
    assert [b.text for b in final.content if b.type == "text"] == [PARTIAL + CONTINUED]
    assert [block.type for block in final.content] == ["text"]  # one block, the seam merged
    assert final.stop_reason == "end_turn"
    assert prefill_of(provider) == {
        "role": "assistant",
        "content": [{"type": "text", "text": PARTIAL.rstrip()}],
    }


async def test_a_stalled_anthropic_stream_is_continued_after_its_idle_bound(
    gateway: str, provider: MockProvider
) -> None:
    provider.set_behaviour(
        "key-a",
        Behaviour(reply=FIRST, chunks=CHUNKS, stall_after_chunks=CUT_AFTER, body_stall_secs=5),
    )
    provider.set_behaviour("key-b", Behaviour(reply=CONTINUED, chunks=2))
    text: list[str] = []
    async with claude(gateway) as client:
        final = await story(client, text)
    assert "".join(text) == PARTIAL + CONTINUED
    assert final.stop_reason == "end_turn"


async def test_a_refused_continuation_ends_with_the_original_error(
    gateway: str, provider: MockProvider
) -> None:
    provider.set_behaviour("key-a", cut())
    provider.set_behaviour("key-b", Behaviour(status=400))
    before = resumes(gateway, "refused")
    seen: list[str] = []
    async with claude(gateway) as client:
        with pytest.raises(anthropic.APIStatusError) as info:
            await story(client, seen)
    assert resumes(gateway, "refused") == before + 1
    assert "".join(seen) == PARTIAL  # nothing of the refusal reached the client
    error = info.value.body["error"]  # type: ignore[index]
    assert error["type"] == "upstream_error"
    assert "upstream stream failed" in error["message"]
    assert len([r for r in provider.requests if r.key == "key-b"]) == 1


async def test_a_cut_chat_stream_is_continued_where_the_account_takes_a_prefill(
    gateway: str, provider: MockProvider
) -> None:
    provider.set_behaviour("key-a", cut())
    provider.set_behaviour("key-b", Behaviour(reply=CONTINUED, chunks=2))
    async with openai.AsyncOpenAI(
        base_url=gateway + "/v1", api_key="caller", max_retries=0
    ) as client:
        parts: list[str] = []
        ids: set[str] = set()
        stream = await client.chat.completions.create(
            model="gpt-x",
            messages=QUESTION,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    for chunk in chunks:
        ids.add(chunk.id)
        parts.extend(c.delta.content or "" for c in chunk.choices)
    assert "".join(parts) == PARTIAL + CONTINUED
    assert len(ids) == 1  # one answer, under the first part's id
    assert prefill_of(provider) == {"role": "assistant", "content": PARTIAL}


async def test_a_refused_chat_continuation_ends_with_the_original_error(
    gateway: str, provider: MockProvider
) -> None:
    provider.set_behaviour("key-a", cut())
    provider.set_behaviour("key-b", Behaviour(status=400))
    parts: list[str] = []
    async with openai.AsyncOpenAI(
        base_url=gateway + "/v1", api_key="caller", max_retries=0
    ) as client:
        stream = await client.chat.completions.create(model="gpt-x", messages=QUESTION, stream=True)
        with pytest.raises(openai.APIError) as info:
            await drain(stream, parts)
    assert "".join(parts) == PARTIAL
    assert "upstream stream failed" in info.value.message


async def test_a_continuation_that_breaks_too_ends_with_the_first_break_s_error(
    gateway: str, provider: MockProvider
) -> None:
    provider.set_behaviour(
        "key-a",
        Behaviour(reply=FIRST, chunks=CHUNKS, stall_after_chunks=CUT_AFTER, body_stall_secs=5),
    )
    provider.set_behaviour(
        "key-b", Behaviour(reply=CONTINUED, chunks=4, stall_after_chunks=2, fail="reset_mid_stream")
    )
    seen: list[str] = []
    async with claude(gateway) as client:
        with pytest.raises(anthropic.APIStatusError) as info:
            await story(client, seen)
    # What reached the client is well formed: the first part, then the continuation's part.
    assert "".join(seen) == PARTIAL + "".join(split_text(CONTINUED, 4)[:2])
    error = info.value.body["error"]  # type: ignore[index]
    assert error["type"] == "deadline_exceeded"  # the first break's (idle), not the second's
    assert "idle" in error["message"]


async def test_a_stream_under_its_throughput_floor_is_continued(
    gateway: str, provider: MockProvider
) -> None:
    # About 25 characters a second, 6 tokens: under the floor of 20 over 0.5 s.
    provider.set_behaviour("key-s", Behaviour(reply=FIRST, chunks=CHUNKS, chunk_interval_secs=0.1))
    provider.set_behaviour("key-b", Behaviour(reply=CONTINUED, chunks=2))
    before = resumes(gateway, "resumed", "claude-slow", "slow")
    text: list[str] = []
    async with claude(gateway) as client:
        final = await story(client, text, model="claude-slow")
    assert resumes(gateway, "resumed", "claude-slow", "slow") == before + 1
    said = "".join(text)
    assert said.endswith(CONTINUED)
    partial = said.removesuffix(CONTINUED)
    assert partial
    assert FIRST.startswith(partial)
    assert len(partial) < len(FIRST)  # cut before the end: the floor, not the stream's end
    assert final.stop_reason == "end_turn"
    assert prefill_of(provider)["content"] == [{"type": "text", "text": partial.rstrip()}]


async def test_a_chat_stream_with_no_account_taking_a_prefill_ends_as_it_broke(
    gateway: str, provider: MockProvider
) -> None:
    provider.set_behaviour("key-a", cut())
    parts: list[str] = []
    async with openai.AsyncOpenAI(
        base_url=gateway + "/v1", api_key="caller", max_retries=0
    ) as client:
        stream = await client.chat.completions.create(model="gpt-y", messages=QUESTION, stream=True)
        with pytest.raises(openai.APIError) as info:
            await drain(stream, parts)
    assert "".join(parts) == PARTIAL
    assert "upstream stream failed" in info.value.message
    assert [r.key for r in provider.requests] == ["key-a"]  # `c` was not asked


async def test_a_stalled_chat_stream_is_continued_after_its_idle_bound(
    gateway: str, provider: MockProvider
) -> None:
    provider.set_behaviour(
        "key-a",
        Behaviour(reply=FIRST, chunks=CHUNKS, stall_after_chunks=CUT_AFTER, body_stall_secs=5),
    )
    provider.set_behaviour("key-b", Behaviour(reply=CONTINUED, chunks=2))
    parts: list[str] = []
    async with openai.AsyncOpenAI(
        base_url=gateway + "/v1", api_key="caller", max_retries=0
    ) as client:
        stream = await client.chat.completions.create(model="gpt-x", messages=QUESTION, stream=True)
        await drain(stream, parts)
    assert "".join(parts) == PARTIAL + CONTINUED


@pytest.mark.parametrize(
    ("chunks", "cut_after"),
    [(3, 1), (21, 8)],  # cut at "Hello fro"; at "Hello from " (the prefill drops the space)
)
async def test_a_resumed_stream_reads_the_answer_once(
    gateway: str, provider: MockProvider, chunks: int, cut_after: int
) -> None:
    """Both accounts answer alike, as two keys of one provider do: the continuation goes on
    from the prefill instead of starting over, so the client reads the answer once."""
    provider.set_behaviour(
        "key-a", Behaviour(chunks=chunks, stall_after_chunks=cut_after, fail="reset_mid_stream")
    )
    text: list[str] = []
    async with claude(gateway) as client:
        final = await story(client, text)
    assert "".join(text) == DEFAULT_REPLY
    assert [b.text for b in final.content if b.type == "text"] == [DEFAULT_REPLY]
    assert final.stop_reason == "end_turn"
    partial = "".join(split_text(DEFAULT_REPLY, chunks)[:cut_after])
    assert prefill_of(provider)["content"] == [{"type": "text", "text": partial.rstrip()}]

    provider.reset()
    provider.set_behaviour(
        "key-a", Behaviour(chunks=chunks, stall_after_chunks=cut_after, fail="reset_mid_stream")
    )
    parts: list[str] = []
    async with openai.AsyncOpenAI(
        base_url=gateway + "/v1", api_key="caller", max_retries=0
    ) as chat:
        await drain(
            await chat.chat.completions.create(model="gpt-x", messages=QUESTION, stream=True), parts
        )
    assert "".join(parts) == DEFAULT_REPLY
