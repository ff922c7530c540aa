"""Retry in place (`retry_wait_max_secs`) through the example gateway under uvicorn, called with
the official SDKs: the only account of a model answers a 429 with `retry-after: 2`, the caller
has 50 s of deadline, and the gateway waits the 2 s and asks the same account again instead of
answering its own 429 at once. Never twice, never past the deadline, never a started stream.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from servers import example_gateway, serve_in_thread
from switchyard_mw.testing import DEFAULT_REPLY, Behaviour, MockProvider

pytestmark = pytest.mark.integration

ENV = {"KEY_A": "key-a", "KEY_B": "key-b"}
QUESTION: Any = [{"role": "user", "content": "hi"}]
DEADLINE_50_S = {"x-switchyard-timeout-ms": "50000"}
RETRY_AFTER_2 = Behaviour(status=429, headers={"retry-after": "2"}, times=1)


def config(mock_url: str) -> str:
    # `b` serves another model: each `m*` has one account, so only waiting can help. A hold
    # is kept per account and model: each test asks its own model, free of the last's hold.
    return f"""
[llm_clients.a]
base_url = "{mock_url}"
api_key_env = "KEY_A"
auth = "x-api-key"
models = ["m1", "m2", "m3", "m4", "m5", "m6"]
retry_wait_max_secs = 5
failure_threshold = 100

[llm_clients.b]
base_url = "{mock_url}"
api_key_env = "KEY_B"
auth = "x-api-key"
models = ["other"]
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


def gpt(gateway: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=gateway + "/v1", api_key="caller", max_retries=0, default_headers=DEADLINE_50_S
    )


async def drain(stream: Any, into: list[Any]) -> None:
    """Read `stream` into `into` until it ends or raises."""
    async for item in stream:
        into.append(item)


async def test_a_429_retry_after_2_waits_2_s_and_succeeds_on_the_same_account(
    gateway: str, provider: MockProvider
) -> None:
    provider.set_behaviour("key-a", RETRY_AFTER_2)
    started = time.monotonic()
    async with gpt(gateway) as client:
        raw = await client.chat.completions.with_raw_response.create(model="m1", messages=QUESTION)
    took = time.monotonic() - started
    assert raw.parse().choices[0].message.content == DEFAULT_REPLY
    assert raw.headers["x-switchyard-account"] == "a"
    assert raw.headers["x-switchyard-attempts"] == "2"
    assert 2.0 <= took < 3.5
    assert [r.key for r in provider.requests] == ["key-a", "key-a"]


async def test_a_second_429_gives_the_client_the_429(gateway: str, provider: MockProvider) -> None:
    provider.set_behaviour("key-a", Behaviour(status=429, headers={"retry-after": "2"}))
    started = time.monotonic()
    async with gpt(gateway) as client:
        with pytest.raises(openai.RateLimitError) as info:
            await client.chat.completions.create(model="m2", messages=QUESTION)
    took = time.monotonic() - started
    assert 2.0 <= took < 3.5
    assert len(provider.requests) == 2  # once in place, never a loop
    # The provider's own answer, its retry time kept.
    assert info.value.response.headers["retry-after"] == "2"


async def test_a_wait_that_would_pass_the_deadline_is_not_taken(
    gateway: str, provider: MockProvider
) -> None:
    provider.set_behaviour("key-a", RETRY_AFTER_2)
    started = time.monotonic()
    async with gpt(gateway) as client:
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(
                model="m3", messages=QUESTION, extra_headers={"x-switchyard-timeout-ms": "1500"}
            )
    assert time.monotonic() - started < 1.0
    assert len(provider.requests) == 1


async def test_a_500_once_is_retried_after_half_a_second(
    gateway: str, provider: MockProvider
) -> None:
    provider.set_behaviour("key-a", Behaviour(status=500, times=1))
    started = time.monotonic()
    async with anthropic.AsyncAnthropic(
        base_url=gateway, api_key="caller", max_retries=0, default_headers=DEADLINE_50_S
    ) as client:
        answer = await client.messages.create(model="m4", max_tokens=9, messages=QUESTION)
    took = time.monotonic() - started
    assert answer.stop_reason == "end_turn"
    assert 0.5 <= took < 2.0
    assert len(provider.requests) == 2


async def test_a_stream_refused_before_it_started_is_retried_in_place(
    gateway: str, provider: MockProvider
) -> None:
    provider.set_behaviour("key-a", RETRY_AFTER_2)
    client = anthropic.AsyncAnthropic(
        base_url=gateway, api_key="caller", max_retries=0, default_headers=DEADLINE_50_S
    )
    async with client, client.messages.stream(model="m5", max_tokens=9, messages=QUESTION) as s:
        text = await s.get_final_text()
    assert text == DEFAULT_REPLY
    assert len(provider.requests) == 2


async def test_a_stream_that_started_is_never_retried(gateway: str, provider: MockProvider) -> None:
    provider.set_behaviour("key-a", Behaviour(fail="error_mid_stream", stall_after_chunks=1))
    events: list[Any] = []
    async with anthropic.AsyncAnthropic(
        base_url=gateway, api_key="caller", max_retries=0, default_headers=DEADLINE_50_S
    ) as client:
        stream = await client.messages.create(
            model="m6", max_tokens=9, messages=QUESTION, stream=True
        )
        with pytest.raises(anthropic.APIStatusError):
            await drain(stream, events)
    assert [e.type for e in events].count("content_block_delta") == 1
    assert len(provider.requests) == 1
