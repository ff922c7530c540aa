"""The mock provider's prompt cache and its per-model / timed error statuses, as
docs/mock-provider.md ("Prompt cache", `status_models`, `status_for_secs`) tells them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from switchyard_mw.testing import Behaviour, MockProvider

SYSTEM = "x" * 4000
FIRST = [{"role": "user", "content": "Hello"}]
LATER = [*FIRST, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "More"}]


@pytest.fixture
async def http() -> AsyncIterator[tuple[MockProvider, httpx.AsyncClient]]:
    mock = MockProvider()
    transport = httpx.ASGITransport(app=mock)
    async with httpx.AsyncClient(transport=transport, base_url="http://mock") as client:
        yield mock, client


def messages(turns: list[dict[str, str]]) -> dict[str, Any]:
    return {"model": "claude-opus-5", "max_tokens": 100, "system": SYSTEM, "messages": turns}


async def usage(client: httpx.AsyncClient, body: dict[str, Any], key: str) -> tuple[int, int, int]:
    answer = await client.post("/v1/messages", json=body, headers={"x-api-key": key})
    assert answer.status_code == 200, answer.text
    u = answer.json()["usage"]
    return u["input_tokens"], u["cache_creation_input_tokens"], u["cache_read_input_tokens"]


async def test_the_documented_example(http: tuple[MockProvider, httpx.AsyncClient]) -> None:
    _, client = http
    assert await usage(client, messages(FIRST), "k1") == (17, 1008, 0)
    assert await usage(client, messages(FIRST), "k1") == (17, 0, 1008)
    assert await usage(client, messages(LATER), "k1") == (17, 17, 1008)
    assert await usage(client, messages(FIRST), "k2") == (17, 1008, 0)  # another key


async def test_only_a_prefix_that_starts_the_prompt_is_read(
    http: tuple[MockProvider, httpx.AsyncClient],
) -> None:
    _, client = http
    await usage(client, messages(LATER), "k")
    changed = [{"role": "user", "content": "Other"}, *LATER[1:]]
    _, written, read = await usage(client, messages(changed), "k")
    assert read < 1000  # only the system prompt is shared: the turns after it are written again
    assert written > 0


async def test_set_cache_counts_leave_the_cache_alone(
    http: tuple[MockProvider, httpx.AsyncClient],
) -> None:
    mock, client = http
    mock.set_behaviour("k", Behaviour(cache_read_tokens=5))
    assert (await usage(client, messages(FIRST), "k"))[1:] == (0, 5)
    mock.clear_behaviour("k")
    assert (await usage(client, messages(FIRST), "k"))[1:] == (1008, 0)  # nothing was remembered


async def test_a_responses_input_string_is_not_cached(
    http: tuple[MockProvider, httpx.AsyncClient],
) -> None:
    _, client = http
    body = {"model": "gpt-5", "input": "Hello " * 500}
    for _ in range(2):
        answer = await client.post(
            "/v1/responses", json=body, headers={"authorization": "Bearer k"}
        )
        details = answer.json()["usage"]["input_tokens_details"]
        assert (details["cached_tokens"], details["cache_write_tokens"]) == (0, 0)


async def test_status_models_drops_only_the_status_for_other_models(
    http: tuple[MockProvider, httpx.AsyncClient],
) -> None:
    mock, client = http
    behaviour = Behaviour(status=529, status_models=["claude-opus-5"], fail="malformed_event")
    mock.set_behaviour("k", behaviour)
    body = messages(FIRST)
    refused = await client.post("/v1/messages", json=body, headers={"x-api-key": "k"})
    assert refused.status_code == 529
    other = await client.post(
        "/v1/messages", json={**body, "model": "claude-haiku-5"}, headers={"x-api-key": "k"}
    )
    assert other.status_code == 200
    with pytest.raises(json.JSONDecodeError):  # the rest of the behaviour applies: cut short
        other.json()
