"""Tenants under Envoy, phase by phase: the processor asks `engine.tenancy` as the ASGI stack
does. A wrong key is a 401 at the body phase (no judge, no route), a model outside the
patterns a 403, a spent limit a 429 with `retry-after`; a routed request's answer gets the
tenant's rate-limit headers in place of the account's, and its usage read from the body
settles the reservation; an answer that never came gives it back."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import pytest

from extproc_helpers import (
    Stream,
    immediate,
    removes,
    request_body,
    request_headers,
    response_body,
    response_headers,
    sets,
)
from redis_server import running_redis
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.core.limits import Granted, LimitKey
from switchyard_mw.extproc import ExtProcServicer, Policies
from switchyard_mw.state.redis_limits import RedisLimits
from switchyard_mw.testing import MockProvider

KEY = "sk-tenant-envoy"
CONFIG = f"""
[llm_clients.a]
base_url = "https://prov.example"
api_key_env = "KEY_A"
auth = "x-api-key"
models = ["m", "auto-target"]
envoy_cluster = "prov"

[llm_clients.j]
base_url = "http://judge"
models = ["judge-model"]

[routes.auto]
classifier = "llm"
judge = "j"
judge_model = "judge-model"
choices = {{ simple = "m" }}
fallback = "m"

[tenants.team]
keys = ["sha256:{hashlib.sha256(KEY.encode()).hexdigest()}"]
models = ["m", "auto"]
limits = [{{ tokens = 1000, per = "day" }}, {{ requests = 3, per = "day" }}]
"""
ANSWER = msgspec.json.encode(
    {
        "type": "message",
        "model": "m",
        "content": [{"type": "text", "text": "hi"}],
        "usage": {"input_tokens": 12, "output_tokens": 5},
    }
)


@dataclass
class Env:
    mock: MockProvider
    policies: Policies
    servicer: ExtProcServicer

    def used(self) -> list[float]:
        tenancy = self.policies.tenancy
        assert tenancy is not None
        return [tenancy.store.used(limit) for limit in tenancy.rules["team"].limits]


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    mock = MockProvider()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=mock))
    config = parse_config(CONFIG)
    policies = Policies(config, build_accounts(config, {"KEY_A": "acct"}), judge_http_client=http)
    yield Env(mock, policies, ExtProcServicer(policies))
    await http.aclose()


def body(model: str = "m", max_tokens: int = 100) -> bytes:
    messages = [{"role": "user", "content": "hi"}]
    return msgspec.json.encode({"model": model, "max_tokens": max_tokens, "messages": messages})


async def sent(env: Env, key: str | None, payload: bytes) -> tuple[Stream, object]:
    stream = Stream(env.servicer)
    await stream.send(request_headers(extra={"x-api-key": key} if key else {}))
    return stream, await stream.send(request_body(payload))


async def test_a_wrong_or_missing_key_is_401_before_the_judge(env: Env) -> None:
    for key in ("sk-wrong", None):
        stream, answer = await sent(env, key, body("auto"))
        status, headers, error = immediate(answer)  # type: ignore[arg-type]
        assert status == 401
        assert error["error"]["type"] == "authentication_error"
        assert headers["x-should-retry"] == b"false"
        await stream.close()
    assert env.mock.requests == []  # the judge was never asked
    assert env.used() == [0, 0]


async def test_a_model_outside_the_patterns_is_403(env: Env) -> None:
    stream, answer = await sent(env, KEY, body("auto-target"))
    status, _, error = immediate(answer)  # type: ignore[arg-type]
    assert status == 403
    assert error["error"]["type"] == "permission_error"
    await stream.close()


async def test_a_routed_answer_carries_the_tenants_headers_and_settles_its_usage(
    env: Env,
) -> None:
    stream, answer = await sent(env, KEY, body())
    routed = sets(answer)  # type: ignore[arg-type]
    assert routed["x-api-key"] == b"acct"  # the account's key, never the client's
    reserved = env.used()
    assert reserved[1] == 1
    assert reserved[0] == 100 + -(-len(body()) // 3)
    upstream_limits = {"x-ratelimit-limit-tokens": "1", "anthropic-ratelimit-tokens-limit": "9"}
    headers = await stream.send(
        response_headers(
            200, {"content-type": "application/json", **upstream_limits}, details="via_upstream"
        )
    )
    given = sets(headers)  # type: ignore[arg-type]
    assert given["anthropic-ratelimit-tokens-limit"] == b"1000"
    assert given["anthropic-ratelimit-requests-remaining"] == b"2"
    assert "x-ratelimit-limit-tokens" in removes(headers)  # type: ignore[arg-type]
    await stream.send(response_body(ANSWER, end=True))
    await stream.close()
    await asyncio.sleep(0)  # the settle's task
    assert env.used() == [17, 1]


async def test_a_spent_limit_is_429_with_retry_after(env: Env) -> None:
    first, answer = await sent(env, KEY, body(max_tokens=900))  # its worst case held
    assert "x-switchyard-cluster" in sets(answer)  # type: ignore[arg-type]
    stream, answer = await sent(env, KEY, body(max_tokens=100))
    status, headers, error = immediate(answer)  # type: ignore[arg-type]
    assert status == 429
    assert error["error"]["type"] == "rate_limit_error"
    assert int(headers["retry-after"]) >= 1
    assert int(headers["anthropic-ratelimit-tokens-remaining"]) < 100
    await stream.close()
    await first.close()  # no answer came: the reservation goes back whole
    await asyncio.sleep(0)
    assert env.used() == [0, 0]


async def test_a_spent_model_limit_moves_the_request_down_a_budget_chain() -> None:
    text = CONFIG.replace('models = ["m", "auto"]', 'models = ["m", "auto", "auto-target"]')
    text = text.replace(
        'limits = [{ tokens = 1000, per = "day" }, { requests = 3, per = "day" }]',
        'limits = [{ tokens = 200, per = "day", model = "m" }]',
    )
    text += '[fallbacks.m]\nmodels = ["auto-target"]\non = ["budget"]\n'
    config = parse_config(text)
    policies = Policies(config, build_accounts(config, {"KEY_A": "acct"}))
    env = Env(MockProvider(), policies, ExtProcServicer(policies))
    held, first = await sent(env, KEY, body(max_tokens=150))  # fits m's 200
    assert common_body(first) == b""  # on its own model: the body goes as it came
    stream, moved = await sent(env, KEY, body(max_tokens=150))
    assert b'"model":"auto-target"' in common_body(moved)
    headers = await stream.send(
        response_headers(200, {"content-type": "application/json"}, details="via_upstream")
    )
    assert sets(headers)["x-switchyard-route"] == b"fallback:budget"  # type: ignore[arg-type]
    assert sets(headers)["x-switchyard-model"] == b"auto-target"  # type: ignore[arg-type]
    await stream.close()
    await held.close()


def common_body(answer: object) -> bytes:
    """The body a routed request goes upstream with (b"" when unchanged)."""
    value: bytes = answer.request_body.response.body_mutation.body  # type: ignore[attr-defined]
    return value


async def test_an_answer_the_processor_makes_itself_carries_the_tenants_headers_too(
    env: Env,
) -> None:
    stream, answer = await sent(env, KEY, body())
    assert "x-switchyard-cluster" in sets(answer)  # type: ignore[arg-type]
    # Envoy's own timeout before the answer started: the processor answers the 504.
    timeout = await stream.send(response_headers(504, details="upstream_response_timeout"))
    status, headers, _ = immediate(timeout)  # type: ignore[arg-type]
    assert status == 504
    assert headers["anthropic-ratelimit-tokens-limit"] == b"1000"
    await stream.close()
    await asyncio.sleep(0)
    assert env.used() == [0, 0]  # no answer started: given back


@pytest.mark.integration  # starts a redis-server
async def test_the_processors_start_connects_the_redis_limit_store(tmp_path: Path) -> None:
    """A Redis silent for 300 ms (3 x timeout_ms) while the processor starts: its start waits
    for the limit store (its start-up time), which is connected before the first request."""
    with contextlib.contextmanager(running_redis)(tmp_path) as redis:
        state = f'[state]\nbackend = "redis"\nurl = "{redis.url}"\ntimeout_ms = 100\n'
        config = parse_config(CONFIG + state)
        policies = Policies(config, build_accounts(config, {"KEY_A": "acct"}))
        store = policies.limit_store
        assert isinstance(store, RedisLimits)
        redis.pause()
        asyncio.get_running_loop().call_later(0.3, redis.resume)
        began = time.perf_counter()
        await policies.start()
        assert time.perf_counter() - began > 0.25
        assert store.healthy
        assert isinstance(await store.reserve({policies_limit(policies): 1}), Granted)
        assert store.healthy
        await policies.aclose()


def policies_limit(policies: Policies) -> LimitKey:
    tenancy = policies.tenancy
    assert tenancy is not None
    return tenancy.rules["team"].limits[0]
