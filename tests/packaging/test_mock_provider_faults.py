"""The mock provider's misbehaviours that end, hang, break an event or filter content, read by
the official SDKs over a real socket: what a client sees of each must be what it sees of a
real provider misbehaving so (an SDK error, a timeout, a stream that stops short, a refusal's
stop reason in the wire's own field)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from servers import serve_in_thread
from switchyard_mw.testing import DEFAULT_REPLY, Behaviour, MockProvider

QUESTION: Any = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[MockProvider, str]]:
    app = MockProvider()
    with serve_in_thread(app) as url:
        yield app, url


@pytest.fixture
def tcp(served: tuple[MockProvider, str]) -> Iterator[tuple[MockProvider, str]]:
    served[0].reset()
    yield served
    served[0].reset()


def gpt(url: str, **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key="k", base_url=url + "/v1", max_retries=0, **kw)


def claude(url: str, **kw: Any) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(api_key="k", base_url=url, max_retries=0, **kw)


async def collect(stream: AsyncIterable[Any]) -> list[Any]:
    return [item async for item in stream]


# --- an answer N times, or for N seconds, then healthy ----------------------------------------


async def drain(stream: Any, into: list[Any]) -> None:
    """Read `stream` into `into` until it ends or raises."""
    async for item in stream:
        into.append(item)


async def test_500_once_then_healthy(tcp: tuple[MockProvider, str]) -> None:
    mock, url = tcp
    mock.set_behaviour("*", Behaviour(status=500, times=1))
    async with gpt(url) as client:
        with pytest.raises(openai.InternalServerError):
            await client.chat.completions.create(model="m", messages=QUESTION)
        for _ in range(2):
            answer = await client.chat.completions.create(model="m", messages=QUESTION)
            assert answer.choices[0].message.content == DEFAULT_REPLY
    assert len(mock.requests) == 3


async def test_a_429_twice_then_healthy_keeps_its_retry_after(
    tcp: tuple[MockProvider, str],
) -> None:
    mock, url = tcp
    mock.set_behaviour("*", Behaviour(status=429, times=2, headers={"retry-after": "2"}))
    async with claude(url) as client:
        for _ in range(2):
            with pytest.raises(anthropic.RateLimitError) as info:
                await client.messages.create(model="m", max_tokens=9, messages=QUESTION)
            assert info.value.response.headers["retry-after"] == "2"
        answer = await client.messages.create(model="m", max_tokens=9, messages=QUESTION)
    assert answer.stop_reason == "end_turn"


async def test_setting_a_behaviour_again_counts_afresh(tcp: tuple[MockProvider, str]) -> None:
    mock, url = tcp
    async with gpt(url) as client:
        for _ in range(2):
            mock.set_behaviour("*", Behaviour(status=503, times=1))
            with pytest.raises(openai.InternalServerError):
                await client.chat.completions.create(model="m", messages=QUESTION)
            await client.chat.completions.create(model="m", messages=QUESTION)


async def test_503_for_a_while_then_healthy(tcp: tuple[MockProvider, str]) -> None:
    _, url = tcp
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=url) as http:
        # Over the control API, as a test of a gateway running elsewhere would set it.
        put = await http.put("/_mock/behaviours/*", json={"status": 503, "for_secs": 0.4})
        assert put.status_code == 200
    statuses: list[int] = []
    async with gpt(url) as client:
        failed = 0
        while True:
            try:
                await client.chat.completions.create(model="m", messages=QUESTION)
            except openai.InternalServerError as exc:
                statuses.append(exc.status_code)
                failed += 1
                await asyncio.sleep(0.05)
                continue
            break
    healed = time.monotonic() - started
    assert failed >= 1
    assert set(statuses) == {503}
    assert 0.4 <= healed < 2.0


def test_times_and_for_secs_are_validated() -> None:
    with pytest.raises(ValueError, match="times"):
        Behaviour(times=-1)
    with pytest.raises(ValueError, match="for_secs"):
        Behaviour(for_secs=-0.1)


# --- no response at all ------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_no_response_holds_the_connection_until_the_client_gives_up(
    tcp: tuple[MockProvider, str], stream: bool
) -> None:
    mock, url = tcp
    mock.set_behaviour("*", Behaviour(fail="no_response"))
    started = time.monotonic()
    async with gpt(url, timeout=0.5) as client:
        with pytest.raises(openai.APITimeoutError):
            await client.chat.completions.create(model="m", messages=QUESTION, stream=stream)
    assert 0.5 <= time.monotonic() - started < 2.0
    deadline = time.monotonic() + 2.0
    while mock.in_flight and time.monotonic() < deadline:  # noqa: ASYNC110 - a plain counter
        await asyncio.sleep(0.02)
    assert mock.in_flight == 0  # the hung answer ended with the connection


# --- a malformed event -------------------------------------------------------------------------


async def test_malformed_event_chat(tcp: tuple[MockProvider, str]) -> None:
    mock, url = tcp
    mock.set_behaviour("*", Behaviour(fail="malformed_event", stall_after_chunks=1))
    seen: list[Any] = []
    async with gpt(url) as client:
        stream = await client.chat.completions.create(model="m", messages=QUESTION, stream=True)
        with pytest.raises(json.JSONDecodeError):
            await drain(stream, seen)
    assert [c.choices[0].delta.content for c in seen] == ["", "Hello fro"]


async def test_malformed_event_anthropic(tcp: tuple[MockProvider, str]) -> None:
    mock, url = tcp
    mock.set_behaviour("*", Behaviour(fail="malformed_event", stall_after_chunks=0))
    seen: list[Any] = []
    async with claude(url) as client:
        stream = await client.messages.create(
            model="m", max_tokens=9, messages=QUESTION, stream=True
        )
        with pytest.raises(json.JSONDecodeError):
            await drain(stream, seen)
    assert "content_block_delta" not in [e.type for e in seen]
    assert [e.type for e in seen] == ["message_start", "content_block_start"]


async def test_malformed_event_responses(tcp: tuple[MockProvider, str]) -> None:
    mock, url = tcp
    mock.set_behaviour("*", Behaviour(fail="malformed_event", stall_after_chunks=2))
    seen: list[Any] = []
    async with gpt(url) as client:
        stream = await client.responses.create(model="m", input="hi", stream=True)
        with pytest.raises(json.JSONDecodeError):
            await drain(stream, seen)
    assert [e.type for e in seen].count("response.output_text.delta") == 2


async def test_malformed_json_answer(tcp: tuple[MockProvider, str]) -> None:
    mock, url = tcp
    mock.set_behaviour("*", Behaviour(fail="malformed_event"))
    async with gpt(url) as client:
        with pytest.raises(json.JSONDecodeError):
            await client.chat.completions.create(model="m", messages=QUESTION)


# --- a stream without its terminator -----------------------------------------------------------


async def test_no_done_chat(tcp: tuple[MockProvider, str]) -> None:
    mock, url = tcp
    mock.set_behaviour("*", Behaviour(fail="no_terminator"))
    async with httpx.AsyncClient(base_url=url) as http:
        body = {"model": "m", "messages": QUESTION, "stream": True}
        raw = (await http.post("/v1/chat/completions", json=body)).text
    assert "[DONE]" not in raw
    assert raw.endswith("\n\n")
    async with gpt(url) as client:
        stream = await client.chat.completions.create(model="m", messages=QUESTION, stream=True)
        chunks = await collect(stream)  # the SDK ends quietly: only the missing [DONE] tells
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == DEFAULT_REPLY
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_no_message_stop_anthropic(tcp: tuple[MockProvider, str]) -> None:
    mock, url = tcp
    mock.set_behaviour("*", Behaviour(fail="no_terminator"))
    async with claude(url) as client:
        stream = await client.messages.create(
            model="m", max_tokens=9, messages=QUESTION, stream=True
        )
        types = [e.type for e in await collect(stream)]
    assert types[-1] == "message_delta"
    assert "message_stop" not in types


async def test_no_response_completed_responses(tcp: tuple[MockProvider, str]) -> None:
    mock, url = tcp
    mock.set_behaviour("*", Behaviour(fail="no_terminator"))
    async with gpt(url) as client:
        stream = await client.responses.create(model="m", input="hi", stream=True)
        types = [e.type for e in await collect(stream)]
    assert "response.completed" not in types
    assert types[-1] == "response.output_item.done"


# --- a content-filter refusal ------------------------------------------------------------------


async def test_content_filter_anthropic(tcp: tuple[MockProvider, str]) -> None:
    mock, url = tcp
    mock.set_behaviour("*", Behaviour(content_filter=True, reply="I"))
    async with claude(url) as client:
        answer = await client.messages.create(model="m", max_tokens=9, messages=QUESTION)
        stream = await client.messages.create(
            model="m", max_tokens=9, messages=QUESTION, stream=True
        )
        events = await collect(stream)
    assert answer.stop_reason == "refusal"
    deltas = [e for e in events if e.type == "message_delta"]
    assert [e.delta.stop_reason for e in deltas] == ["refusal"]


async def test_content_filter_chat(tcp: tuple[MockProvider, str]) -> None:
    mock, url = tcp
    mock.set_behaviour("*", Behaviour(content_filter=True, reply=""))
    async with gpt(url) as client:
        answer = await client.chat.completions.create(model="m", messages=QUESTION)
        stream = await client.chat.completions.create(model="m", messages=QUESTION, stream=True)
        chunks = await collect(stream)
    assert answer.choices[0].finish_reason == "content_filter"
    assert not answer.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "content_filter"


async def test_content_filter_responses(tcp: tuple[MockProvider, str]) -> None:
    mock, url = tcp
    mock.set_behaviour("*", Behaviour(content_filter=True))
    async with gpt(url) as client:
        answer = await client.responses.create(model="m", input="hi")
        stream = await client.responses.create(model="m", input="hi", stream=True)
        events = await collect(stream)
    assert answer.status == "incomplete"
    assert answer.incomplete_details is not None
    assert answer.incomplete_details.reason == "content_filter"
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "content_filter"


async def test_content_filter_for_one_request_then_healthy(tcp: tuple[MockProvider, str]) -> None:
    mock, url = tcp
    mock.set_behaviour("*", Behaviour(content_filter=True, times=1))
    async with claude(url) as client:
        first = await client.messages.create(model="m", max_tokens=9, messages=QUESTION)
        second = await client.messages.create(model="m", max_tokens=9, messages=QUESTION)
    assert (first.stop_reason, second.stop_reason) == ("refusal", "end_turn")
