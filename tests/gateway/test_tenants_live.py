"""Tenants through a real gateway: the example app under uvicorn on the mock provider, with
the official `anthropic` and `openai` SDKs as clients (retries off, so each call is one
request). Who is asking (401, 403), a limit reached (429 and `retry-after`), the providers'
rate-limit headers on every answer, the settle from JSON answers and streams on all three
wires (`GET /switchyard/tenants`), a limit spent then reset, a budget fallback, and 64
concurrent requests against one limit."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from redis_server import running_redis
from servers import example_gateway, serve_in_thread
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration

HELLO: Any = [{"role": "user", "content": "Say hello"}]


def sha(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def _config(mock_url: str) -> str:
    return f"""
[llm_clients.claude]
base_url = "{mock_url}"
api_key_env = "ACCOUNT_KEY_CLAUDE"
models = ["opus", "haiku", "sonnet"]
[llm_clients.gpt]
base_url = "{mock_url}"
api_key_env = "ACCOUNT_KEY_GPT"
auth = "bearer"
models = ["gpt", "gpt-mini"]

[tenants.alpha]
keys = ["{sha("sk-alpha")}"]
models = ["opus", "haiku", "gpt*"]
limits = [{{ tokens = 1_000_000, per = "day" }}]
[tenants.beta]
keys = ["{sha("sk-beta")}"]
models = ["sonnet"]
limits = [{{ requests = 2, per = "second" }}]
[tenants.gamma]
keys = ["{sha("sk-gamma")}"]
models = ["opus", "haiku"]
limits = [{{ tokens = 600, per = "day", model = "opus" }}]
[tenants.delta]
keys = ["{sha("sk-delta")}"]
models = ["gpt"]
limits = [{{ tokens = 20_000, per = "day" }}]

[fallbacks.opus]
models = ["haiku"]
on = ["budget"]
"""


@pytest.fixture(scope="module")
def mock() -> Iterator[MockProvider]:
    provider = MockProvider()
    with serve_in_thread(provider) as url:
        provider.url = url  # type: ignore[attr-defined]
        yield provider


@pytest.fixture(scope="module")
def gateway(mock: MockProvider, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    env = {"ACCOUNT_KEY_CLAUDE": "acct-claude", "ACCOUNT_KEY_GPT": "acct-gpt"}
    url: str = mock.url  # type: ignore[attr-defined]
    with example_gateway(_config(url), tmp_path_factory.mktemp("tenants"), env) as gw:
        yield gw


def claude(gateway: str, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway, api_key=key, max_retries=0)


def gpt(gateway: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway + "/v1", api_key=key, max_retries=0)


def limits(gateway: str) -> dict[str, Any]:
    found: dict[str, Any] = httpx.get(gateway + "/switchyard/tenants").json()
    return found


def spent_of(usage: Any) -> int:
    """Every token of a Messages answer: its `input_tokens` leave the prompt cache's out."""
    cached = (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
    total: int = usage.input_tokens + cached + usage.output_tokens
    return total


def used(gateway: str, tenant: str, index: int = 0) -> float:
    value: float = limits(gateway)["tenants"][tenant][index]["used"]
    return value


def test_unknown_and_missing_keys_are_401_and_cost_no_upstream_call(
    gateway: str, mock: MockProvider
) -> None:
    mock.clear_requests()
    with pytest.raises(anthropic.AuthenticationError) as anthropic_error:
        claude(gateway, "sk-wrong").messages.create(model="opus", max_tokens=8, messages=HELLO)
    assert anthropic_error.value.status_code == 401
    assert anthropic_error.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(openai.AuthenticationError) as openai_error:
        gpt(gateway, "sk-wrong").chat.completions.create(model="gpt", messages=HELLO)
    assert openai_error.value.status_code == 401
    assert openai_error.value.type == "authentication_error"
    missing = httpx.post(gateway + "/v1/chat/completions", json={"model": "gpt", "messages": HELLO})
    assert missing.status_code == 401
    assert missing.json()["error"]["type"] == "authentication_error"
    # A flood of wrong keys: no upstream call, no counter written.
    with httpx.Client(base_url=gateway) as client:
        for i in range(200):
            answer = client.post(
                "/v1/messages",
                headers={"x-api-key": f"sk-flood-{i}"},
                json={"model": "opus", "max_tokens": 8, "messages": HELLO},
            )
            assert answer.status_code == 401
            assert "sk-flood" not in answer.text
    assert mock.requests == []
    assert "sk-flood" not in httpx.get(gateway + "/metrics").text


def test_a_model_outside_the_tenants_patterns_is_403(gateway: str, mock: MockProvider) -> None:
    mock.clear_requests()
    with pytest.raises(anthropic.PermissionDeniedError) as anthropic_error:
        claude(gateway, "sk-beta").messages.create(model="opus", max_tokens=8, messages=HELLO)
    assert anthropic_error.value.body["error"]["type"] == "permission_error"  # type: ignore[index]
    with pytest.raises(openai.PermissionDeniedError) as openai_error:
        gpt(gateway, "sk-gamma").responses.create(model="gpt", input="hi")
    assert openai_error.value.status_code == 403
    assert mock.requests == []


def test_an_answer_carries_the_tenants_rate_limit_headers_and_never_the_clients_key(
    gateway: str, mock: MockProvider
) -> None:
    mock.clear_requests()
    before = used(gateway, "alpha")
    raw = claude(gateway, "sk-alpha").messages.with_raw_response.create(
        model="opus", max_tokens=50, messages=HELLO
    )
    message = raw.parse()
    headers = raw.headers
    assert headers["anthropic-ratelimit-tokens-limit"] == "1000000"
    remaining = int(headers["anthropic-ratelimit-tokens-remaining"])
    # What was reserved at admission (the worst case) is what the header says is left.
    assert 1_000_000 - before - 50 - 200 <= remaining < 1_000_000 - before - 50
    reset = headers["anthropic-ratelimit-tokens-reset"]
    assert reset.endswith("Z")
    assert "x-ratelimit-limit-tokens" not in headers
    # Settled: the window holds exactly what the answer said it used.
    assert used(gateway, "alpha") == before + spent_of(message.usage)

    chat = gpt(gateway, "sk-alpha").chat.completions.with_raw_response.create(
        model="gpt", messages=HELLO, max_tokens=40
    )
    assert chat.headers["x-ratelimit-limit-tokens"] == "1000000"
    assert chat.headers["x-ratelimit-reset-tokens"].endswith("s")
    assert "anthropic-ratelimit-tokens-limit" not in chat.headers
    (first, second) = mock.requests
    assert first.key == "acct-claude"
    assert second.key == "acct-gpt"
    for request in mock.requests:
        assert "sk-alpha" not in repr(request.headers)
    assert "sk-alpha" not in httpx.get(gateway + "/switchyard/tenants").text


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("wire", ["messages", "chat", "responses"])
def test_usage_settles_the_reservation_on_every_wire(gateway: str, wire: str, stream: bool) -> None:
    before = used(gateway, "delta")
    if wire == "messages":
        # delta may only use gpt: messages go through alpha's day limit instead.
        before = used(gateway, "alpha")
        client = claude(gateway, "sk-alpha")
        if stream:
            with client.messages.stream(model="haiku", max_tokens=64, messages=HELLO) as events:
                final = events.get_final_message()
        else:
            final = client.messages.create(model="haiku", max_tokens=64, messages=HELLO)
        assert used(gateway, "alpha") == before + spent_of(final.usage)
        return
    tokens = gpt(gateway, "sk-delta")
    if wire == "chat":
        if stream:
            chunks = list(
                tokens.chat.completions.create(
                    model="gpt",
                    messages=HELLO,
                    max_tokens=64,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            usage = chunks[-1].usage
        else:
            usage = tokens.chat.completions.create(model="gpt", messages=HELLO, max_tokens=64).usage
        assert usage is not None
        spent = usage.prompt_tokens + usage.completion_tokens
    else:
        if stream:
            events = list(
                tokens.responses.create(model="gpt", input="hi", max_output_tokens=64, stream=True)
            )
            done = next(e for e in events if e.type == "response.completed")
            response_usage = done.response.usage  # type: ignore[union-attr]
        else:
            response_usage = tokens.responses.create(
                model="gpt", input="hi", max_output_tokens=64
            ).usage
        assert response_usage is not None
        spent = response_usage.input_tokens + response_usage.output_tokens
    assert used(gateway, "delta") == before + spent


def test_a_limit_spent_is_429_until_its_window_resets(gateway: str, mock: MockProvider) -> None:
    client = claude(gateway, "sk-beta")
    # Start just after a second turns, so that both requests land in one window.
    time.sleep(1 - time.time() % 1 + 0.02)
    for _ in range(2):
        raw = client.messages.with_raw_response.create(model="sonnet", max_tokens=8, messages=HELLO)
        assert raw.http_response.status_code == 200
    assert raw.headers["anthropic-ratelimit-requests-remaining"] == "0"
    mock.clear_requests()
    with pytest.raises(anthropic.RateLimitError) as refused:
        client.messages.create(model="sonnet", max_tokens=8, messages=HELLO)
    error = refused.value
    assert error.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert error.response.headers["retry-after"] == "1"
    assert error.response.headers["anthropic-ratelimit-requests-limit"] == "2"
    assert mock.requests == []  # no upstream call
    time.sleep(1 - time.time() % 1 + 0.02)  # the next second: a new window
    assert client.messages.create(model="sonnet", max_tokens=8, messages=HELLO).content


def test_a_spent_model_limit_falls_back_down_a_budget_chain(gateway: str) -> None:
    client = claude(gateway, "sk-gamma")
    # gamma's opus limit is 600 tokens a day and each request's worst case about 575: a
    # request fits while what the ones before used leaves room, then they move to haiku.
    served = []
    for _ in range(6):
        raw = client.messages.with_raw_response.create(model="opus", max_tokens=550, messages=HELLO)
        served.append(raw.headers["x-switchyard-model"])
        if served[-1] != "opus":
            break
    assert served[0] == "opus"
    assert served[-1] == "haiku"
    moved = raw
    assert moved.headers["x-switchyard-route"] == "fallback:budget"
    assert moved.headers["x-switchyard-model"] == "haiku"
    assert moved.parse().model == "haiku"
    # Signed thinking binds a conversation to its model: the 429 instead.
    thinking: Any = [
        {"role": "user", "content": "Think"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hm", "signature": "sig"},
                {"type": "text", "text": "ok"},
            ],
        },
        {"role": "user", "content": "Go on"},
    ]
    with pytest.raises(anthropic.RateLimitError):
        client.messages.create(model="opus", max_tokens=550, messages=thinking)


def test_64_concurrent_requests_never_overspend_one_limit(
    mock: MockProvider, tmp_path: Any
) -> None:
    """64 requests at once against a limit that fits about 10 of their worst cases: admitted
    requests are charged their usage, and what is charged never passes the limit."""
    url: str = mock.url  # type: ignore[attr-defined]
    amount = 3000
    text = f"""
[llm_clients.claude]
base_url = "{url}"
api_key_env = "ACCOUNT_KEY_CLAUDE"
models = ["opus"]
[tenants.busy]
keys = ["{sha("sk-busy")}"]
limits = [{{ tokens = {amount}, per = "day" }}]
"""
    # Every answer runs to its cap: what is charged comes as close to the reservation as the
    # input estimate lets it.
    mock.set_behaviour("acct-busy", Behaviour(reply="word " * 2000, stop_at_max_tokens=True))
    with example_gateway(text, tmp_path, {"ACCOUNT_KEY_CLAUDE": "acct-busy"}) as gw:

        async def one(client: anthropic.AsyncAnthropic) -> int:
            try:
                message = await client.messages.create(model="opus", max_tokens=200, messages=HELLO)
            except anthropic.RateLimitError:
                return -1
            return spent_of(message.usage)

        async def burst() -> list[int]:
            client = anthropic.AsyncAnthropic(base_url=gw, api_key="sk-busy", max_retries=0)
            async with client:
                return await asyncio.gather(*(one(client) for _ in range(64)))

        results = asyncio.run(burst())
        state = httpx.get(gw + "/switchyard/tenants").json()["tenants"]["busy"][0]
    mock.clear_behaviour("acct-busy")
    charged = sum(r for r in results if r >= 0)
    admitted = sum(1 for r in results if r >= 0)
    worst = 200 + 40  # max_tokens + ceil(bytes / 3) of this body (about 110 bytes)
    # Each worst case is ceil(bytes/3) + 200, each use about bytes/4 + 200: the limit is
    # spent to within one request's worst case and never passed (overspend 0; its bound is
    # the input estimate's error, none on this text).
    assert 0 < admitted < 64
    assert amount - worst < charged <= amount
    assert state["used"] == charged
    print(f"64 concurrent: {admitted} admitted, {charged} of {amount} tokens charged")


def test_two_gateways_on_one_redis_share_a_tenants_limits(
    mock: MockProvider, tmp_path: Path
) -> None:
    """64 concurrent requests split across two replicas against one tokens limit in Redis:
    what both charge together never passes the limit, and each replica's page reads the
    shared count."""
    url: str = mock.url  # type: ignore[attr-defined]
    amount = 3000
    mock.set_behaviour("acct-shared", Behaviour(reply="word " * 2000, stop_at_max_tokens=True))
    with contextlib.ExitStack() as stack:
        redis = stack.enter_context(contextlib.contextmanager(running_redis)(tmp_path))
        text = f"""
[llm_clients.claude]
base_url = "{url}"
api_key_env = "ACCOUNT_KEY_CLAUDE"
models = ["opus"]
[tenants.shared]
keys = ["{sha("sk-shared")}"]
limits = [{{ tokens = {amount}, per = "day" }}]
[tenants.warm]
keys = ["{sha("sk-warm")}"]
limits = [{{ requests = 1000, per = "day" }}]
[state]
backend = "redis"
url = "{redis.url}"
key_prefix = "tenants-live"
timeout_ms = 2000  # a loaded test machine: no replica is to fall back to its share here
replicas_hint = 2
"""
        replicas = []
        for name in ("one", "two"):
            (tmp_path / name).mkdir()
            env = {"ACCOUNT_KEY_CLAUDE": "acct-shared"}
            replicas.append(stack.enter_context(example_gateway(text, tmp_path / name, env)))

        async def one(client: anthropic.AsyncAnthropic) -> int:
            try:
                message = await client.messages.create(model="opus", max_tokens=200, messages=HELLO)
            except anthropic.RateLimitError:
                return -1
            return spent_of(message.usage)

        async def burst() -> list[int]:
            clients = [
                anthropic.AsyncAnthropic(base_url=gw, api_key="sk-shared", max_retries=0)
                for gw in replicas
            ]
            try:
                return await asyncio.gather(*(one(clients[i % 2]) for i in range(64)))
            finally:
                for client in clients:
                    await client.close()

        results = asyncio.run(burst())
        pages = [
            httpx.get(gw + "/switchyard/tenants").json()["tenants"]["shared"][0] for gw in replicas
        ]
    mock.clear_behaviour("acct-shared")
    charged = sum(r for r in results if r >= 0)
    admitted = sum(1 for r in results if r >= 0)
    print(f"two replicas, one Redis: {admitted} admitted of 64, {charged} of {amount} tokens")
    # One limit for both: as many admitted as one replica alone admits (13 above), never
    # each replica its own 3000; charged never past it.
    assert 0 < admitted <= amount // (200 + 30)
    assert amount - 240 < charged <= amount
    # Each page shows the shared window as its replica last read it (reservations in
    # flight included), never more than the limit.
    assert all(0 < page["used"] <= amount for page in pages)
    print(f"two replicas, one Redis: {admitted} admitted of 64, {charged} of {amount} tokens")
