"""The mock provider, driven by the official Anthropic and OpenAI SDKs as real clients.

Each SDK is pointed at the mock either in process (an `httpx2.ASGITransport`, since
these SDK majors are built on httpx2 and reject plain httpx objects) or over loopback
TCP to a real uvicorn server; stalls and connection resets only mean something over
TCP, because the in-process transport buffers the whole response.
"""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterable, Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import httpx2
import msgspec
import openai
import pytest
import uvicorn

from switchyard_mw.testing import DEFAULT_REPLY, Behaviour, MockProvider, MockProviderFault
from switchyard_mw.testing.mock_provider import main

MESSAGES: Any = [{"role": "user", "content": "Say hello"}]
PARTS = ("Hello fro", "m the mock", " provider.")  # DEFAULT_REPLY split in 3


@dataclass(frozen=True)
class Target:
    """Where the SDK clients send their requests."""

    base_url: str
    transport: httpx2.AsyncBaseTransport | None = None

    def anthropic(self, key: str = "test-key", **options: Any) -> anthropic.AsyncAnthropic:
        http = None
        if self.transport is not None:
            http = anthropic.DefaultAsyncHttpxClient(transport=self.transport)
        return anthropic.AsyncAnthropic(
            api_key=key, base_url=self.base_url, max_retries=0, http_client=http, **options
        )

    def openai(self, key: str = "test-key", **options: Any) -> openai.AsyncOpenAI:
        http = None
        if self.transport is not None:
            http = openai.DefaultAsyncHttpxClient(transport=self.transport)
        return openai.AsyncOpenAI(
            api_key=key, base_url=self.base_url + "/v1", max_retries=0, http_client=http, **options
        )


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[MockProvider, str]]:
    """One real uvicorn server for the module, on a free loopback port.

    It runs in a thread with its own event loop so it can outlive each test's loop:
    starting and stopping uvicorn per test costs ~0.15 s of shutdown polling each.
    """
    app = MockProvider()
    # IPPROTO_TCP spelled out: asyncio only sets TCP_NODELAY on sockets whose proto says
    # TCP, and with Nagle on, uvicorn's separate header and body writes each cost a
    # 40 ms delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        app, loop="asyncio", log_level="warning", access_log=False, timeout_graceful_shutdown=2
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 5
    while not server.started:
        assert thread.is_alive()
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.005)
    try:
        yield app, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(5)
        sock.close()


@pytest.fixture
def mock(served: tuple[MockProvider, str]) -> Iterator[MockProvider]:
    app = served[0]
    app.reset()
    yield app
    app.reset()


@pytest.fixture
def local(mock: MockProvider) -> Target:
    return Target("http://mock.test", httpx2.ASGITransport(app=mock))


@pytest.fixture
def tcp(served: tuple[MockProvider, str], mock: MockProvider) -> Target:
    return Target(served[1])


@pytest.fixture(params=["in_process", "uvicorn"])
def target(request: pytest.FixtureRequest, local: Target, tcp: Target) -> Target:
    return local if request.param == "in_process" else tcp


async def collect(stream: AsyncIterable[Any], into: list[Any]) -> None:
    """Append what a stream yields, keeping what arrived before it raises."""
    async for item in stream:
        into.append(item)


async def until_idle(mock: MockProvider) -> None:
    async with asyncio.timeout(3):
        while mock.in_flight:  # noqa: ASYNC110 - polling a plain counter
            await asyncio.sleep(0.01)


# --- the three APIs, non-streaming and streaming ------------------------------------------


async def test_anthropic_messages(target: Target) -> None:
    async with target.anthropic() as client:
        message = await client.messages.create(
            model="claude-routed", max_tokens=64, messages=MESSAGES
        )
    assert message.model == "claude-routed"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == DEFAULT_REPLY  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens > 0


async def test_anthropic_messages_stream(target: Target) -> None:
    async with target.anthropic() as client:
        stream = await client.messages.create(
            model="claude-streamed", max_tokens=64, messages=MESSAGES, stream=True
        )
        events = [event async for event in stream]
    # The SDK swallows the `ping` event the mock sends after content_block_start.
    assert [e.type for e in events] == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 3,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0].message.model == "claude-streamed"  # type: ignore[union-attr]
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]  # type: ignore[union-attr]
    assert tuple(deltas) == PARTS
    assert events[-2].delta.stop_reason == "end_turn"  # type: ignore[union-attr]


async def test_anthropic_stream_helper_accumulates(target: Target) -> None:
    async with (
        target.anthropic() as client,
        client.messages.stream(model="claude-helper", max_tokens=64, messages=MESSAGES) as stream,
    ):
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == DEFAULT_REPLY
    assert final.model == "claude-helper"
    assert final.stop_reason == "end_turn"


async def test_chat_completion(target: Target) -> None:
    async with target.openai() as client:
        completion = await client.chat.completions.create(model="gpt-routed", messages=MESSAGES)
    assert completion.object == "chat.completion"
    assert completion.model == "gpt-routed"
    assert completion.choices[0].message.content == DEFAULT_REPLY
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert completion.usage.total_tokens > 0


async def test_chat_completion_stream(target: Target) -> None:
    async with target.openai() as client:
        stream = await client.chat.completions.create(
            model="gpt-streamed",
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    assert {c.model for c in chunks} == {"gpt-streamed"}
    assert chunks[0].choices[0].delta.role == "assistant"
    contents = [c.choices[0].delta.content for c in chunks[1:4]]
    assert tuple(contents) == PARTS
    assert chunks[4].choices[0].finish_reason == "stop"
    assert chunks[5].choices == []
    assert chunks[5].usage is not None


async def test_responses(target: Target) -> None:
    async with target.openai() as client:
        response = await client.responses.create(model="gpt-resp", input="Say hello")
    assert response.object == "response"
    assert response.status == "completed"
    assert response.model == "gpt-resp"
    assert response.output_text == DEFAULT_REPLY
    assert response.usage is not None
    assert response.usage.total_tokens == response.usage.input_tokens + 7


async def test_responses_stream(target: Target) -> None:
    async with target.openai() as client:
        stream = await client.responses.create(model="gpt-resp", input="Say hello", stream=True)
        events = [event async for event in stream]
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert tuple(deltas) == PARTS
    completed = events[-1].response  # type: ignore[union-attr]
    assert completed.model == "gpt-resp"
    assert completed.output_text == DEFAULT_REPLY


async def test_responses_stream_helper_accumulates(local: Target) -> None:
    async with (
        local.openai() as client,
        client.responses.stream(model="gpt-helper", input="Say hello") as stream,
    ):
        final = await stream.get_final_response()
    assert final.output_text == DEFAULT_REPLY
    assert final.model == "gpt-helper"


async def test_chunks_split_the_reply(mock: MockProvider, local: Target) -> None:
    mock.set_behaviour("*", Behaviour(reply="abcdefghij", chunks=5, chunk_interval_secs=0.01))
    async with local.openai() as client:
        stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        contents = [c.choices[0].delta.content async for c in stream]
    assert contents == ["", "ab", "cd", "ef", "gh", "ij", None]

    mock.set_behaviour("*", Behaviour(reply="hi", chunks=5))
    async with local.anthropic() as client:
        stream2 = await client.messages.create(
            model="m", max_tokens=8, messages=MESSAGES, stream=True
        )
        texts = [e.delta.text async for e in stream2 if e.type == "content_block_delta"]  # type: ignore[union-attr]
    assert texts == ["h", "i"]


# --- a prefill: the answer continues the assistant's own last turn -----------------------

PREFILLS = [
    ("Hello fro", "m the mock provider."),  # how a resumed stream sends its partial answer
    ("Hello from", " the mock provider."),  # trailing whitespace dropped, as the API wants
    ("Sure:", DEFAULT_REPLY),  # a prefill the reply does not begin with: the whole reply
    (DEFAULT_REPLY, ""),  # the whole reply already said
]


@pytest.mark.parametrize(("prefill", "rest"), PREFILLS)
async def test_a_messages_prefill_is_continued_not_repeated(
    target: Target, prefill: str, rest: str
) -> None:
    turns: Any = [*MESSAGES, {"role": "assistant", "content": prefill}]
    async with target.anthropic() as client:
        message = await client.messages.create(model="m", max_tokens=64, messages=turns)
        stream = await client.messages.create(model="m", max_tokens=64, messages=turns, stream=True)
        events = [event async for event in stream]
    assert message.content[0].text == rest  # type: ignore[union-attr]
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]  # type: ignore[union-attr]
    assert "".join(deltas) == rest
    # Billed for what it said: the continuation alone (4 bytes a token).
    assert message.usage.output_tokens == max(1, len(rest.encode()) // 4)


async def test_a_prefill_in_text_blocks_is_continued(local: Target) -> None:
    blocks = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "fro"}]
    turns: Any = [*MESSAGES, {"role": "assistant", "content": blocks}]
    async with local.anthropic() as client:
        message = await client.messages.create(model="m", max_tokens=64, messages=turns)
    assert message.content[0].text == "m the mock provider."  # type: ignore[union-attr]


@pytest.mark.parametrize(("prefill", "rest"), PREFILLS[:2])
async def test_a_chat_prefill_is_continued_not_repeated(
    target: Target, prefill: str, rest: str
) -> None:
    turns: Any = [*MESSAGES, {"role": "assistant", "content": prefill}]
    async with target.openai() as client:
        completion = await client.chat.completions.create(model="m", messages=turns)
        stream = await client.chat.completions.create(model="m", messages=turns, stream=True)
        chunks = [chunk async for chunk in stream]
    assert completion.choices[0].message.content == rest
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == rest


async def test_a_responses_prefill_is_continued(local: Target) -> None:
    items: Any = [
        {"role": "user", "content": "Say hello"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello fro"}]},
    ]
    async with local.openai() as client:
        response = await client.responses.create(model="m", input=items)
    assert response.output_text == "m the mock provider."


async def test_a_conversation_that_ends_with_the_user_is_answered_whole(local: Target) -> None:
    turns: Any = [
        {"role": "user", "content": "Say hello"},
        {"role": "assistant", "content": "Hello fro"},
        {"role": "user", "content": "Again"},
    ]
    async with local.anthropic() as client:
        message = await client.messages.create(model="m", max_tokens=64, messages=turns)
    assert message.content[0].text == DEFAULT_REPLY  # type: ignore[union-attr]


# --- errors -------------------------------------------------------------------------------

ERRORS = [
    (400, anthropic.BadRequestError, openai.BadRequestError, "invalid_request_error"),
    (401, anthropic.AuthenticationError, openai.AuthenticationError, "authentication_error"),
    (402, anthropic.PaymentRequiredError, openai.APIStatusError, "billing_error"),
    (403, anthropic.PermissionDeniedError, openai.PermissionDeniedError, "permission_error"),
    (429, anthropic.RateLimitError, openai.RateLimitError, "rate_limit_error"),
    (500, anthropic.InternalServerError, openai.InternalServerError, "api_error"),
    (529, anthropic.OverloadedError, openai.InternalServerError, "overloaded_error"),
]


async def test_count_tokens_answers_as_anthropic_does(mock: MockProvider, target: Target) -> None:
    async with target.anthropic(key="k1") as client:
        counted = await client.messages.count_tokens(model="claude-x", messages=MESSAGES)
    (record,) = mock.requests
    assert (record.path, record.key, record.model) == (
        "/v1/messages/count_tokens",
        "k1",
        "claude-x",
    )
    # What a Messages call of this body reports as its input: 4 bytes a token.
    assert counted.input_tokens == max(1, len(record.body) // 4)


async def test_count_tokens_follows_the_keys_behaviour(mock: MockProvider, local: Target) -> None:
    mock.set_behaviour("k1", Behaviour(status=529, times=1))
    async with local.anthropic(key="k1") as client:
        with pytest.raises(anthropic.APIStatusError) as info:
            await client.messages.count_tokens(model="m", messages=MESSAGES)
        assert info.value.status_code == 529
        assert info.value.type == "overloaded_error"
        assert (await client.messages.count_tokens(model="m", messages=MESSAGES)).input_tokens > 0
        with pytest.raises(anthropic.BadRequestError):  # no messages: the API's 400
            await client.post("/v1/messages/count_tokens", cast_to=object, body={"model": "m"})
    assert len(mock.requests) == 3


@pytest.mark.parametrize(("status", "anthropic_error", "openai_error", "kind"), ERRORS)
async def test_status_surfaces_as_typed_sdk_error(
    mock: MockProvider,
    local: Target,
    status: int,
    anthropic_error: type[anthropic.APIStatusError],
    openai_error: type[openai.APIStatusError],
    kind: str,
) -> None:
    mock.set_behaviour("*", Behaviour(status=status))
    async with local.anthropic() as a_client, local.openai() as o_client:
        with pytest.raises(anthropic_error) as a_info:
            await a_client.messages.create(model="m", max_tokens=8, messages=MESSAGES)
        with pytest.raises(openai_error) as chat_info:
            await o_client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        with pytest.raises(openai_error) as resp_info:
            await o_client.responses.create(model="m", input="hi")
    assert a_info.value.status_code == status
    assert a_info.value.type == kind
    assert a_info.value.body == {
        "type": "error",
        "error": {"type": kind, "message": a_info.value.api_message},
    }
    for info in (chat_info, resp_info):
        assert info.value.status_code == status
        assert info.value.type == kind
        assert info.value.code == kind
    retry_after = a_info.value.response.headers.get("retry-after")
    assert retry_after == ("1" if status == 429 else None)


async def test_errors_over_tcp(mock: MockProvider, tcp: Target) -> None:
    mock.set_behaviour("*", Behaviour(status=401))
    async with tcp.anthropic() as client:
        with pytest.raises(anthropic.AuthenticationError):
            await client.messages.create(model="m", max_tokens=8, messages=MESSAGES, stream=True)


async def test_malformed_json_is_a_400_in_the_wire_format(mock: MockProvider) -> None:
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=mock), base_url="http://mock.test"
    ) as http:
        a = await http.post("/v1/messages", content=b"{not json", headers={"x-api-key": "k"})
        o = await http.post("/v1/responses", content=b"[1, 2]")
    assert a.status_code == 400
    assert a.json()["type"] == "error"
    assert a.json()["error"]["type"] == "invalid_request_error"
    assert o.status_code == 400
    assert o.json()["error"]["code"] == "invalid_request_error"
    assert [r.path for r in mock.requests] == ["/v1/messages", "/v1/responses"]
    assert mock.requests[0].model is None


async def test_unknown_path_and_wrong_method(mock: MockProvider) -> None:
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=mock), base_url="http://mock.test"
    ) as http:
        missing = await http.post("/v1/completions", json={})
        wrong = await http.get("/v1/chat/completions")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "not_found_error"
    assert wrong.status_code == 405
    assert "error" in wrong.json()
    assert mock.requests == []


# --- behaviours per key, records, control endpoints ---------------------------------------


async def test_key_behaviour_overrides_the_default(mock: MockProvider, local: Target) -> None:
    mock.set_behaviour("*", Behaviour(status=429))
    mock.set_behaviour("judge-key", Behaviour(reply="complex"))
    async with local.anthropic("judge-key") as judge, local.openai("other-key") as other:
        message = await judge.messages.create(model="m", max_tokens=8, messages=MESSAGES)
        assert message.content[0].text == "complex"  # type: ignore[union-attr]
        with pytest.raises(openai.RateLimitError):
            await other.chat.completions.create(model="m", messages=MESSAGES)

        mock.clear_behaviour("judge-key")
        with pytest.raises(anthropic.RateLimitError):
            await judge.messages.create(model="m", max_tokens=8, messages=MESSAGES)

        mock.reset()
        completion = await other.chat.completions.create(model="m", messages=MESSAGES)
        assert completion.choices[0].message.content == DEFAULT_REPLY
    assert len(mock.requests) == 1  # reset() also forgot the earlier records
    assert mock.behaviour_for("anyone") == Behaviour()


async def test_requests_are_recorded(mock: MockProvider, local: Target) -> None:
    async with local.anthropic("key-a") as a_client, local.openai("key-b") as o_client:
        await a_client.messages.create(model="claude-x", max_tokens=8, messages=MESSAGES)
        stream = await o_client.chat.completions.create(
            model="gpt-y", messages=MESSAGES, stream=True
        )
        async for _ in stream:
            pass
    first, second = mock.requests
    assert (first.path, first.key, first.model, first.stream) == (
        "/v1/messages",
        "key-a",
        "claude-x",
        False,
    )
    assert msgspec.json.decode(first.body)["messages"] == MESSAGES
    # anthropic 2.x sends its API key as a bearer token, not in x-api-key.
    assert first.headers["authorization"] == "Bearer key-a"
    assert "anthropic-version" in first.headers
    assert (second.path, second.key, second.model, second.stream) == (
        "/v1/chat/completions",
        "key-b",
        "gpt-y",
        True,
    )
    assert second.headers["authorization"] == "Bearer key-b"


async def test_x_api_key_wins_over_bearer(mock: MockProvider) -> None:
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=mock), base_url="http://mock.test"
    ) as http:
        headers = {"x-api-key": "from-header", "authorization": "Bearer from-bearer"}
        await http.post("/v1/messages", json={"model": "m"}, headers=headers)
        await http.post("/v1/messages", json={"model": "m"})
    assert [r.key for r in mock.requests] == ["from-header", ""]


async def test_records_are_capped(local: Target) -> None:
    mock = MockProvider(max_recorded_requests=2)
    target = Target(local.base_url, httpx2.ASGITransport(app=mock))
    async with target.openai() as client:
        for model in ("m1", "m2", "m3"):
            await client.responses.create(model=model, input="hi")
    assert [r.model for r in mock.requests] == ["m2", "m3"]


async def test_http_control_endpoints(mock: MockProvider, tcp: Target) -> None:
    async with httpx.AsyncClient(base_url=tcp.base_url) as http, tcp.openai("key-x") as client:
        assert (await http.get("/_mock/health")).json() == {"status": "ok"}

        put = await http.put("/_mock/behaviours/key-x", json={"status": 401})
        assert put.status_code == 200
        assert put.json()["status"] == 401
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model="gpt-z", messages=MESSAGES)
        assert mock.behaviour_for("key-x") == Behaviour(status=401)
        assert (await http.get("/_mock/behaviours")).json()["key-x"]["status"] == 401

        for invalid in ({"chunks": 0}, {"no_such_field": 1}, {"status": "x"}):
            bad = await http.put("/_mock/behaviours/*", json=invalid)
            assert bad.status_code == 400
            assert bad.json()["error"]["type"] == "invalid_request_error"

        records = (await http.get("/_mock/requests")).json()
        assert len(records) == 1
        assert records[0]["key"] == "key-x"
        assert records[0]["model"] == "gpt-z"
        assert records[0]["body"]["messages"] == MESSAGES
        assert records[0]["headers"]["authorization"] == "Bearer key-x"

        assert (await http.delete("/_mock/requests")).status_code == 204
        assert (await http.get("/_mock/requests")).json() == []

        assert (await http.delete("/_mock/behaviours")).status_code == 204
        completion = await client.chat.completions.create(model="gpt-z", messages=MESSAGES)
        assert completion.model == "gpt-z"
        assert (await http.get("/_mock/nothing")).status_code == 404


def test_behaviour_is_validated() -> None:
    with pytest.raises(ValueError, match="chunks"):
        Behaviour(chunks=0)
    with pytest.raises(ValueError, match="status"):
        Behaviour(status=302)
    with pytest.raises(ValueError, match="body_stall_secs"):
        Behaviour(body_stall_secs=-1)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"status": 99}', type=Behaviour)


# --- delays, stalls and faults ------------------------------------------------------------


async def test_headers_delay(mock: MockProvider, local: Target) -> None:
    mock.set_behaviour("*", Behaviour(headers_delay_secs=0.1))
    async with local.openai() as client:
        started = time.monotonic()
        completion = await client.chat.completions.create(model="m", messages=MESSAGES)
    assert time.monotonic() - started >= 0.05
    assert completion.choices[0].message.content == DEFAULT_REPLY


async def test_short_body_stall_still_completes(mock: MockProvider, target: Target) -> None:
    mock.set_behaviour("*", Behaviour(body_stall_secs=0.05, stall_after_chunks=1))
    async with target.anthropic() as client:
        message = await client.messages.create(model="m", max_tokens=8, messages=MESSAGES)
        async with client.messages.stream(model="m", max_tokens=8, messages=MESSAGES) as stream:
            streamed = await stream.get_final_text()
    assert message.content[0].text == DEFAULT_REPLY  # type: ignore[union-attr]
    assert streamed == DEFAULT_REPLY


async def test_body_stall_sends_headers_first(mock: MockProvider, tcp: Target) -> None:
    mock.set_behaviour("*", Behaviour(body_stall_secs=30))
    timeout = httpx.Timeout(5.0, read=0.2)
    async with httpx.AsyncClient(base_url=tcp.base_url, timeout=timeout) as http:
        request = {"model": "m", "messages": MESSAGES}
        async with http.stream("POST", "/v1/chat/completions", json=request) as response:
            assert response.status_code == 200
            assert "content-length" not in response.headers
            # The headers came, the body stalls: the answer is still in flight. (Not asserted
            # after the timeout: httpx drops the connection as it raises, and a loaded machine
            # lets the mock notice that before the assertion runs.)
            assert mock.in_flight == 1
            with pytest.raises(httpx.ReadTimeout):
                await response.aread()
    # The client hung up mid-stall: the mock must stop answering rather than sleep on.
    await until_idle(mock)


async def test_stream_stall_after_chunks(mock: MockProvider, tcp: Target) -> None:
    mock.set_behaviour("*", Behaviour(body_stall_secs=30, stall_after_chunks=1))
    chunks: list[Any] = []
    async with tcp.openai(timeout=httpx2.Timeout(5.0, read=0.3)) as client:
        stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        # openai 3.x wraps transport errors raised mid-stream; anthropic 2.x does not.
        with pytest.raises(openai.APITimeoutError):
            await collect(stream, chunks)
        await stream.close()
    assert [c.choices[0].delta.content for c in chunks] == ["", PARTS[0]]
    await until_idle(mock)


async def test_reset_mid_stream_breaks_the_sdk_stream(mock: MockProvider, tcp: Target) -> None:
    mock.set_behaviour("*", Behaviour(fail="reset_mid_stream", stall_after_chunks=2))
    events: list[Any] = []
    async with tcp.anthropic() as client:
        stream = await client.messages.create(
            model="m", max_tokens=8, messages=MESSAGES, stream=True
        )
        with pytest.raises(BROKEN_STREAM) as broken:
            await collect(stream, events)
    assert hung_up(broken.value)
    texts = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert tuple(texts) == PARTS[:2]

    async with tcp.openai() as o_client:
        o_stream = await o_client.responses.create(model="m", input="hi", stream=True)
        with pytest.raises(BROKEN_STREAM) as o_broken:
            await collect(o_stream, [])
    assert hung_up(o_broken.value)


BROKEN_STREAM = (anthropic.APIConnectionError, openai.APIConnectionError, httpx2.TransportError)
"""What an SDK raises when a stream it reads breaks off: its `APIConnectionError` (anthropic
from 2.17.0, openai's later 3.x), or, in the releases before, the transport's own error as it
came (anthropic 2.16.0, with which this module passes too). What the SDKs document is only
that a failure to reach the API is a connection error: the hang-up underneath is the check."""


def hung_up(error: BaseException) -> bool:
    """Whether the peer's hang-up mid-body is what `error` is, or what it wraps."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, httpx2.RemoteProtocolError):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


async def test_reset_mid_stream_without_streaming(mock: MockProvider, tcp: Target) -> None:
    mock.set_behaviour("*", Behaviour(fail="reset_mid_stream"))
    async with tcp.openai() as client:
        with pytest.raises(openai.APIConnectionError):
            await client.responses.create(model="m", input="hi")


async def test_reset_before_headers(mock: MockProvider, tcp: Target, local: Target) -> None:
    mock.set_behaviour("*", Behaviour(fail="reset_before_headers"))
    # uvicorn turns an exception before the response start into a plain-text 500.
    async with tcp.anthropic() as client:
        with pytest.raises(anthropic.InternalServerError) as info:
            await client.messages.create(model="m", max_tokens=8, messages=MESSAGES)
    assert info.value.response.text == "Internal Server Error"
    # In process no server translates the exception. anthropic wraps any exception of
    # its transport in APIConnectionError; openai only wraps httpx2's own errors.
    async with local.anthropic() as a_client, local.openai() as o_client:
        with pytest.raises(anthropic.APIConnectionError) as wrapped:
            await a_client.messages.create(model="m", max_tokens=8, messages=MESSAGES)
        assert isinstance(wrapped.value.__cause__, MockProviderFault)
        with pytest.raises(MockProviderFault):
            await o_client.responses.create(model="m", input="hi")


# --- the standalone server ----------------------------------------------------------------


def test_module_entry_point() -> None:
    # Port 0 and read back the port uvicorn logs: a port picked free beforehand can be
    # taken meanwhile, e.g. as the ephemeral port of another test's client connection.
    command = [sys.executable, "-m", "switchyard_mw.testing.mock_provider", "--port", "0"]
    args = ["--log-level", "info", "--reply", "from afar"]
    proc = subprocess.Popen([*command, *args], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    seen: list[str] = []
    try:
        # Blocking reads; pytest-timeout bounds a server that neither starts nor exits.
        base = None
        while base is None:
            line = proc.stderr.readline()
            assert line, f"mock provider exited early: {''.join(seen)}"
            seen.append(line)
            if started := re.search(r"running on (http://\S+)", line):
                base = started.group(1)
        assert httpx.get(f"{base}/_mock/health").json() == {"status": "ok"}
        httpx.put(f"{base}/_mock/behaviours/bad", json={"status": 403}).raise_for_status()
        request = {"model": "m", "messages": MESSAGES}
        denied = httpx.post(f"{base}/v1/messages", json=request, headers={"x-api-key": "bad"})
        assert denied.status_code == 403
        assert denied.json()["error"]["type"] == "permission_error"
        ok = httpx.post(f"{base}/v1/messages", json=request, headers={"x-api-key": "good"})
        assert ok.json()["content"][0]["text"] == "from afar"
    finally:
        proc.terminate()
        _, rest = proc.communicate(timeout=10)
    # The package must not import the module eagerly, or `-m` runs it twice and warns.
    assert "RuntimeWarning" not in "".join(seen) + rest


def test_main_without_uvicorn(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    with pytest.raises(SystemExit) as info:
        main(["--port", "0"])
    assert info.value.code == 2
    assert "pip install uvicorn (it comes with the 'example' extra)" in capsys.readouterr().err


# --- an error status for some models, for a while -----------------------------------------


async def test_an_error_status_for_some_models_leaves_the_others_answered(local: Target) -> None:
    mock = local.transport.app  # type: ignore[union-attr]
    mock.set_behaviour("k", Behaviour(status=503, status_models=["model-a"]))
    client = local.openai("k")
    with pytest.raises(openai.InternalServerError):
        await client.chat.completions.create(model="model-a", messages=MESSAGES)
    answer = await client.chat.completions.create(model="model-b", messages=MESSAGES)
    assert answer.choices[0].message.content == DEFAULT_REPLY


async def test_an_error_status_for_n_seconds_then_healthy(local: Target) -> None:
    mock = local.transport.app  # type: ignore[union-attr]
    mock.set_behaviour("k", Behaviour(status=503, status_for_secs=0.3))
    client = local.openai("k")
    with pytest.raises(openai.InternalServerError):
        await client.chat.completions.create(model="m", messages=MESSAGES)
    await asyncio.sleep(0.3)
    answer = await client.chat.completions.create(model="m", messages=MESSAGES)
    assert answer.choices[0].message.content == DEFAULT_REPLY
    # Set again, it lasts its N seconds again; through the control route too.
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=mock), base_url="http://mock.test"
    ) as control:
        put = await control.put("/_mock/behaviours/k", json={"status": 500, "status_for_secs": 5})
        assert put.json()["status_for_secs"] == 5
    with pytest.raises(openai.InternalServerError):
        await client.chat.completions.create(model="m", messages=MESSAGES)


def test_status_for_secs_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="status_for_secs"):
        Behaviour(status=503, status_for_secs=-1)
