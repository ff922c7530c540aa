"""Tenants under a real Envoy with the official SDKs as clients: the processor refuses a wrong
key (401), a model outside the tenant's patterns (403) and a spent limit (429 with
`retry-after`) before any upstream call, and a routed answer carries the tenant's rate-limit
headers, its usage settling the reservation."""

from __future__ import annotations

import asyncio
import hashlib

import anthropic
import openai
import pytest
from test_envoy_live import KEYS, config_text, otlp, rig

from envoy_rig import Rig
from switchyard_mw.extproc import Policies

__all__ = ["otlp", "rig"]  # fixtures, used by name
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.integration]
KEY = "sk-envoy-tenant"
TENANTS = f"""
[tenants.team]
keys = ["sha256:{hashlib.sha256(KEY.encode()).hexdigest()}"]
models = ["claude-haiku-5"]
limits = [{{ tokens = 600, per = "day" }}]
"""
HELLO = [{"role": "user", "content": "Hello"}]


def tenants(rig: Rig) -> Policies:
    policies = rig.install(config_text(rig.mock_url) + TENANTS)
    rig.mock.clear_requests()
    return policies


async def test_refusals_and_headers_through_envoy(rig: Rig) -> None:
    policies = tenants(rig)
    async with anthropic.AsyncAnthropic(
        base_url=rig.envoy_url, api_key="sk-wrong", max_retries=0
    ) as wrong:
        with pytest.raises(anthropic.AuthenticationError):
            await wrong.messages.create(model="claude-haiku-5", max_tokens=8, messages=HELLO)
    async with openai.AsyncOpenAI(
        base_url=rig.envoy_url + "/v1", api_key=KEY, max_retries=0
    ) as gpt:
        with pytest.raises(openai.PermissionDeniedError):
            await gpt.chat.completions.create(model="claude-opus-5", messages=HELLO)  # type: ignore[arg-type]
    assert rig.mock.requests == []
    async with anthropic.AsyncAnthropic(base_url=rig.envoy_url, api_key=KEY, max_retries=0) as sdk:
        raw = await sdk.messages.with_raw_response.create(
            model="claude-haiku-5", max_tokens=300, messages=HELLO
        )
        message = await raw.parse()
        assert raw.headers["anthropic-ratelimit-tokens-limit"] == "600"
        (seen,) = rig.mock.requests
        assert seen.key == KEYS["KEY_A"]  # the account's key; the client's never went upstream
        assert KEY not in repr(seen.headers)
        tenancy = policies.tenancy
        assert tenancy is not None
        (limit,) = tenancy.rules["team"].limits
        usage = message.usage
        spent = (
            usage.input_tokens
            + (usage.cache_read_input_tokens or 0)
            + (usage.cache_creation_input_tokens or 0)
            + usage.output_tokens
        )
        for _ in range(100):  # the processor settles as the body's end passes it
            if tenancy.store.used(limit) == spent:
                break
            await asyncio.sleep(0.02)
        assert tenancy.store.used(limit) == spent
        rig.mock.clear_requests()
        with pytest.raises(anthropic.RateLimitError) as refused:
            await sdk.messages.create(model="claude-haiku-5", max_tokens=560, messages=HELLO)
        assert int(refused.value.response.headers["retry-after"]) >= 1
        assert rig.mock.requests == []
